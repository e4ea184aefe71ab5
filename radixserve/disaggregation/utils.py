"""What the schedulers need around the transfer layer (SGLang's
``disaggregation/utils.py``): the KV pool as ``KVArgs``, the aux rows of
requests in flight, page indices from slots, the time limits, why a transfer failed."""

from __future__ import annotations

import os
import socket

import torch

from radixserve.disaggregation.base import KVArgs, KVTransferConfig, KVTransferError, MetadataBuffers
from radixserve.mem_cache.allocator import page_floor

# SGLang's environment variables for the same limits (seconds).
_TIMEOUT_ENV = {"bootstrap_timeout_s": "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT",
                "waiting_timeout_s": "SGLANG_DISAGGREGATION_WAITING_TIMEOUT"}


def transfer_config_from_env() -> KVTransferConfig:
    """The default limits, with SGLang's environment variables applied."""
    limits = {}
    for name, var in _TIMEOUT_ENV.items():
        if os.environ.get(var):
            try:
                limits[name] = float(os.environ[var])
            except ValueError:
                raise ValueError(f"{var} must be a number of seconds, got {os.environ[var]!r}") from None
    return KVTransferConfig(**limits)


def advertised_host(host: str) -> str:
    """The address peers reach a server bound to ``host`` at (a wildcard
    bind is reached at this machine's name's address)."""
    if host in ("", "0.0.0.0", "::"):
        return socket.gethostbyname(socket.gethostname())
    return host


def local_address(host: str) -> str:
    """Where this machine reaches its own server bound to ``host``."""
    return {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)


def pool_kv_args(token_to_kv_pool, page_size: int, metadata: MetadataBuffers, transfer_host: str,
                 num_kv_heads: int, tp_rank: int = 0, tp_size: int = 1, dp_rank: int = 0,
                 dp_size: int = 1) -> KVArgs:
    """``KVArgs`` over the ``MHATokenToKVPool`` of TP rank ``tp_rank`` of
    replica ``dp_rank`` (its share of the model's ``num_kv_heads``). The
    pool's buffers have ``size + page_size`` rows; only whole pages are exposed."""
    rows = page_floor(token_to_kv_pool.k_buffer[0].shape[0], page_size)
    return KVArgs([b[:rows] for b in token_to_kv_pool.k_buffer], [b[:rows] for b in token_to_kv_pool.v_buffer],
                  page_size=page_size, aux_buffers=metadata.buffers, tp_rank=tp_rank, tp_size=tp_size,
                  transfer_host=transfer_host, num_kv_heads=num_kv_heads, dp_rank=dp_rank, dp_size=dp_size)


def failure_reason(kv_half) -> str:
    """Why a failed sender or receiver failed (its ``KVTransferError``'s
    reason, without the room)."""
    try:
        kv_half.failure_exception()
    except KVTransferError as exc:
        return exc.reason
    return "the KV transfer failed"


def slots_to_pages(slots: torch.Tensor, page_size: int) -> torch.Tensor:
    """The page indices of a request's slots for positions ``0 .. n-1``
    (position ``i`` lies at ``page * page_size + i % page_size``)."""
    return (slots[::page_size].to(torch.int64) // page_size).cpu()


class AuxRows:
    """Free rows of the ``MetadataBuffers`` (SGLang's ReqToMetadataIdxAllocator).
    Sized like the request rows, since every holder also holds one."""

    def __init__(self, size: int):
        self.size = size
        self._free = list(range(size - 1, -1, -1))

    def alloc(self) -> int:
        if not self._free:
            raise RuntimeError(f"all {self.size} aux rows are in use")
        return self._free.pop()

    def free(self, row: int) -> None:
        self._free.append(row)

    def available(self) -> int:
        return len(self._free)
