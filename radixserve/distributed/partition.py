"""How a model's dimensions divide over tensor-parallel ranks.

Pure arithmetic, shared by the layers (what each rank holds), the model
config (start-up checks) and the ModelRunner (the KV pool's head count).
"""

from __future__ import annotations

from dataclasses import dataclass


def divide(total: int, tp_size: int, what: str) -> int:
    """``total // tp_size``; a ValueError naming ``what`` if it does not divide."""
    if total % tp_size:
        raise ValueError(f"{what} {total} is not divisible by tp_size {tp_size}")
    return total // tp_size


def padded_vocab_size(vocab_size: int, tp_size: int) -> int:
    """The vocabulary rounded up to a multiple of ``tp_size`` (each rank holds
    an equal slice; the padding rows are zero and their logits are dropped)."""
    return -(-vocab_size // tp_size) * tp_size


@dataclass(frozen=True)
class HeadLayout:
    """The attention heads of one rank.

    Query heads are split evenly: rank ``r`` holds heads ``q_head_start ..
    q_head_start + num_heads - 1``. KV heads are split the same way while
    there are at least as many as ranks; with fewer, each KV head is
    replicated on ``kv_replicas`` consecutive ranks, and every rank holds the
    one KV head its query heads attend with (``kv_head_start``).
    """

    num_heads: int
    num_kv_heads: int
    q_head_start: int
    kv_head_start: int
    kv_replicas: int


def head_layout(total_heads: int, total_kv_heads: int, tp_size: int, tp_rank: int = 0) -> HeadLayout:
    """Rank ``tp_rank``'s share of ``total_heads`` query and ``total_kv_heads``
    KV heads; a ValueError when they cannot be split over ``tp_size`` ranks."""
    num_heads = divide(total_heads, tp_size, "num_attention_heads")
    if total_kv_heads % tp_size and tp_size % total_kv_heads:
        raise ValueError(
            f"num_key_value_heads {total_kv_heads} and tp_size {tp_size} do not divide one another: "
            "each rank needs whole KV heads (KV heads are replicated when tp_size is a multiple of their count)"
        )
    if tp_size >= total_kv_heads:
        replicas = tp_size // total_kv_heads
        return HeadLayout(num_heads, 1, tp_rank * num_heads, tp_rank // replicas, replicas)
    num_kv_heads = total_kv_heads // tp_size
    return HeadLayout(num_heads, num_kv_heads, tp_rank * num_heads, tp_rank * num_kv_heads, 1)
