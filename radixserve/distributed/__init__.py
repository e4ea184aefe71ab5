"""Tensor and pipeline parallelism on torch.distributed: the rank's groups and how a model divides over ranks."""

from radixserve.distributed.partition import HeadLayout, divide, head_layout, padded_vocab_size
from radixserve.distributed.pp_group import PPGroup
from radixserve.distributed.tp_group import (
    DEFAULT_TIMEOUT_S,
    TPGroup,
    check_tp_devices,
    init_model_parallel,
    init_tp_group,
)

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "HeadLayout",
    "PPGroup",
    "TPGroup",
    "check_tp_devices",
    "divide",
    "head_layout",
    "init_model_parallel",
    "init_tp_group",
    "padded_vocab_size",
]
