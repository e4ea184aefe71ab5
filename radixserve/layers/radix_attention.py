"""The attention layer models call; the math lives in the attention backend."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from radixserve.model_executor.forward_batch_info import ForwardBatch, KVStore


class RadixAttention(nn.Module):
    """Attention of one layer over the paged KV pool.

    Holds the layer's shape (heads of this rank) and hands q/k/v to
    ``forward_batch.attn_backend``, which stores k/v at
    ``forward_batch.out_cache_loc`` in layer ``layer_id`` of the KV pool and
    attends each query to its request's context.
    """

    def __init__(self, num_heads: int, head_dim: int, scaling: float, num_kv_heads: int, layer_id: int):
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scaling = scaling
        self.layer_id = layer_id

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads * head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads * head_dim]
        v: torch.Tensor,
        forward_batch: "ForwardBatch",
        save_kv_cache: bool = True,
        kv_stored: bool = False,
    ) -> torch.Tensor:  # [num_tokens, num_heads * head_dim]
        return forward_batch.attn_backend.forward(q, k, v, self, forward_batch, save_kv_cache, kv_stored)

    def kv_store(self, forward_batch: "ForwardBatch") -> "KVStore | None":
        """Where this layer's new K/V may be stored before :meth:`forward`
        (then called with ``kv_stored=True``), if the backend offers it."""
        return forward_batch.attn_backend.kv_store(self, forward_batch)

    def extra_repr(self) -> str:
        return f"layer_id={self.layer_id}, heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}"
