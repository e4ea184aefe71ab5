"""Prefill/decode disaggregation: moving a request's KV from a prefill engine
to a decode engine (SGLang's ``disaggregation/`` package, our own code).

This package is the transfer layer: the interface (``base``), the
bootstrap server (``bootstrap``), the one backend that runs on our
machines, torch.distributed point-to-point (``torch_dist``), which KV heads
a decode rank takes from which prefill ranks (``head_map``), and what the
schedulers' parts (``managers/disagg_*.py``) need around it (``utils``).
See docs/disaggregation.md.
"""

from __future__ import annotations

from radixserve.disaggregation.base import (
    BaseKVBootstrapServer, BaseKVManager, BaseKVReceiver, BaseKVSender, DisaggregationMode, KVArgs, KVPoll,
    KVTransferConfig, KVTransferError, MetadataBuffers,
)

TRANSFER_BACKENDS = ("torch",)
_NEED_RDMA = ("mooncake", "nixl")


def get_kv_classes(backend: str) -> dict[str, type]:
    """The manager, sender, receiver and bootstrap server classes of a
    transfer backend (imported on first use), keyed by role."""
    if backend in _NEED_RDMA:
        raise ValueError(
            f"the {backend} transfer backend needs CUDA and RDMA libraries that radixserve does not support; "
            f"use one of {TRANSFER_BACKENDS}"
        )
    if backend != "torch":
        raise ValueError(f"unknown transfer backend {backend!r}; choose one of {TRANSFER_BACKENDS}")
    from radixserve.disaggregation.bootstrap import KVBootstrapServer
    from radixserve.disaggregation.torch_dist import TorchDistKVManager, TorchDistKVReceiver, TorchDistKVSender

    return {"manager": TorchDistKVManager, "sender": TorchDistKVSender, "receiver": TorchDistKVReceiver,
            "bootstrap_server": KVBootstrapServer}


__all__ = [
    "BaseKVBootstrapServer", "BaseKVManager", "BaseKVReceiver", "BaseKVSender", "DisaggregationMode", "KVArgs",
    "KVPoll", "KVTransferConfig", "KVTransferError", "MetadataBuffers", "TRANSFER_BACKENDS", "get_kv_classes",
]
