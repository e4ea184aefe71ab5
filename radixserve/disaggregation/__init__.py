"""Prefill/decode disaggregation: moving a request's KV from a prefill engine
to a decode engine (SGLang's ``disaggregation/`` package, our own code).

This package is the transfer layer: the interface (``base``), the
bootstrap server (``bootstrap``), the one backend that runs on our
machines, torch.distributed point-to-point (``torch_dist``, with
``control_plane``, ``prefill_control``, ``link_table`` and ``group_link``),
which KV heads a decode rank takes from which prefill ranks (``head_map``),
and what the schedulers' parts (``managers/disagg_*.py``) need around it
(``utils``). See docs/disaggregation.md.

The package itself imports no torch: ``server_args`` checks
``--disaggregation-transfer-backend`` here (``check_transfer_backend``), and
the interface's names below are imported from ``base`` on first use.
"""

from __future__ import annotations

# SGLang's backends that need CUDA and RDMA (InfiniBand/RoCE) libraries this build does not have
_NEED_RDMA = ("mooncake", "nixl")
_BASE_NAMES = (
    "BaseKVBootstrapServer", "BaseKVManager", "BaseKVReceiver", "BaseKVSender", "DisaggregationMode", "KVArgs",
    "KVPoll", "KVTransferConfig", "KVTransferError", "MetadataBuffers",
)


def _torch_classes() -> dict[str, type]:
    from radixserve.disaggregation.bootstrap import KVBootstrapServer
    from radixserve.disaggregation.torch_dist import TorchDistKVManager, TorchDistKVReceiver, TorchDistKVSender

    return {"manager": TorchDistKVManager, "sender": TorchDistKVSender, "receiver": TorchDistKVReceiver,
            "bootstrap_server": KVBootstrapServer}


_BACKENDS = {"torch": _torch_classes}  # a backend's classes by role, imported on first use
TRANSFER_BACKENDS = tuple(_BACKENDS)


def check_transfer_backend(backend: str) -> None:
    """``ValueError`` unless ``backend`` is one of ``TRANSFER_BACKENDS``,
    saying why SGLang's RDMA backends are missing."""
    if backend in _NEED_RDMA:
        raise ValueError(f"the {backend} transfer backend needs CUDA and RDMA (InfiniBand/RoCE) libraries that "
                         f"radixserve does not have; use one of {', '.join(TRANSFER_BACKENDS)}")
    if backend not in _BACKENDS:
        raise ValueError(f"unknown transfer backend {backend!r}; choose one of {', '.join(TRANSFER_BACKENDS)}")


def get_kv_classes(backend: str) -> dict[str, type]:
    """The manager, sender, receiver and bootstrap server classes of a
    transfer backend (imported on first use), keyed by role."""
    check_transfer_backend(backend)
    return _BACKENDS[backend]()


def __getattr__(name: str):
    if name in _BASE_NAMES:
        from radixserve.disaggregation import base

        return getattr(base, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [*_BASE_NAMES, "TRANSFER_BACKENDS", "check_transfer_backend", "get_kv_classes"]
