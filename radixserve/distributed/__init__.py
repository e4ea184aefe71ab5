"""Tensor and pipeline parallelism on torch.distributed: the rank's groups and how a model divides over ranks.

The names below load with their module on first use, so that a light
submodule (``expert_flags``, which the server's argument parsing reads
before torch loads) does not bring torch in with this package."""

import importlib

_HOMES = {
    "HeadLayout": "partition",
    "divide": "partition",
    "head_layout": "partition",
    "padded_vocab_size": "partition",
    "PPGroup": "pp_group",
    "DEFAULT_TIMEOUT_S": "tp_group",
    "TPGroup": "tp_group",
    "check_tp_devices": "tp_group",
    "init_model_parallel": "tp_group",
    "init_tp_group": "tp_group",
}
__all__ = sorted(_HOMES)


def __getattr__(name: str):
    if name in _HOMES:
        return getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
