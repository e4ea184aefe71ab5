"""The attention-backend contract shared by ``torch_native`` and ``triton``."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch

from radixserve.model_executor.forward_batch_info import KVStore

if TYPE_CHECKING:
    from radixserve.layers.radix_attention import RadixAttention
    from radixserve.model_executor.forward_batch_info import ForwardBatch


class AttentionBackend(ABC):
    """Computes attention for a :class:`ForwardBatch` over the paged KV pool.

    ``forward`` first stores the new tokens' K/V at ``forward_batch.out_cache_loc``
    (unless ``save_kv_cache`` is False, or ``kv_stored`` says the caller did),
    then attends each query to its request's whole context (cached prefix
    read through ``req_to_token`` plus the new tokens, causally).
    """

    def init_forward_metadata(self, forward_batch: "ForwardBatch") -> None:
        """Precompute per-batch metadata once, before the layers run."""

    def kv_store(self, layer: "RadixAttention", forward_batch: "ForwardBatch") -> KVStore | None:
        """Where the caller may store this layer's new K/V itself, then call
        ``forward`` with ``kv_stored=True`` (a launch fewer); None: the
        backend stores them (this default)."""
        return None

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads * head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads * head_dim]
        v: torch.Tensor,
        layer: "RadixAttention",
        forward_batch: "ForwardBatch",
        save_kv_cache: bool = True,
        kv_stored: bool = False,
    ) -> torch.Tensor:  # [num_tokens, num_heads * head_dim]
        stored = {}
        if kv_stored:  # only where kv_store offered the pool
            if not save_kv_cache:
                raise ValueError("kv_stored: the new K/V are in the pool already, so save_kv_cache must be True")
            stored = {"kv_stored": True}
        if forward_batch.forward_mode.is_decode():
            return self.forward_decode(q, k, v, layer, forward_batch, save_kv_cache, **stored)
        return self.forward_extend(q, k, v, layer, forward_batch, save_kv_cache, **stored)

    @abstractmethod
    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True) -> torch.Tensor: ...

    @abstractmethod
    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True) -> torch.Tensor: ...
