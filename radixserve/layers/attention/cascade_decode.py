"""Prefix-grouped (cascade) decode attention in torch ops: the reference the
GPU kernel is tested against and the CPU path (docs/prefix_grouped_decode.md).

For each group of a ``PrefixGroupTable``, the queries of all its members
attend to the shared prefix's K/V in one pass (the prefix is read once for
the group); every request attends to its own suffix ``[suffix_start,
seq_len)``; a grouped request's two partial results are merged exactly by
their log-sum-exps. Scores, softmax and merge run in float32.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from radixserve.mem_cache.memory_pool import to_kv_dtype

if TYPE_CHECKING:
    from radixserve.model_executor.forward_batch_info import PrefixGroupTable


def attend_with_lse(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
                    valid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of ``q [..., n, d]`` over ``keys/values [..., L, d]``
    (float32); ``valid [..., 1 or n, L]`` masks keys out. Returns the output
    ``[..., n, d]`` and the log-sum-exp of the scaled scores ``[..., n]``."""
    scores = torch.matmul(q, keys.transpose(-1, -2)) * scale
    if valid is not None:
        scores = scores.masked_fill(~valid, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.unsqueeze(-1))
    return torch.matmul(probs, values), lse


def merge_states(o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor) -> torch.Tensor:
    """Attention over the union of two disjoint key sets from each set's
    output and log-sum-exp: ``(e^lse1 o1 + e^lse2 o2) / (e^lse1 + e^lse2)``,
    computed against the larger lse so nothing overflows."""
    m = torch.maximum(lse1, lse2)
    w1, w2 = torch.exp(lse1 - m).unsqueeze(-1), torch.exp(lse2 - m).unsqueeze(-1)
    return (w1 * o1 + w2 * o2) / (w1 + w2)


def grouped_decode_attention(
    q: torch.Tensor,  # [bs, num_heads * d]
    k_buffer: torch.Tensor,  # [pool_rows, kv_heads, d], any KV pool dtype
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,  # [rows, max_context] int32
    req_pool_indices: torch.Tensor,  # [bs] int64
    seq_lens: torch.Tensor,  # [bs] int64
    seq_lens_cpu: list[int],
    table: "PrefixGroupTable",
    num_heads: int,
    scale: float,
    new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """One query token per request over its context, the shared prefixes of
    ``table`` read once per group. ``new_kv`` (``[bs, kv_heads, d]`` each):
    the new tokens' K/V when the pool does not hold them yet. Returns
    ``[bs, num_heads * d]`` in ``q``'s dtype."""
    bs, kv_heads, d = q.shape[0], k_buffer.shape[1], k_buffer.shape[2]
    group = num_heads // kv_heads
    qh = q.reshape(bs, kv_heads, group, d).float()  # GQA: the heads of a KV head on the query axis
    out, lse = _suffix_attention(qh, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, seq_lens_cpu,
                                 table, scale, new_kv)
    start = 0
    for g, members in enumerate(table.members_cpu):
        slots = req_to_token[table.prefix_rows[g], : table.prefix_lens_cpu[g]].to(torch.int64)
        keys, values = (buf.index_select(0, slots).float().permute(1, 0, 2) for buf in (k_buffer, v_buffer))
        n = len(members)
        rows, start = table.members[start : start + n], start + n
        # [kv_heads, members * group, d]: all the group's queries against one read of the prefix
        qg = qh.index_select(0, rows).permute(1, 0, 2, 3).reshape(kv_heads, n * group, d)
        o1, lse1 = attend_with_lse(qg, keys, values, scale)
        o1 = o1.view(kv_heads, n, group, d).permute(1, 0, 2, 3)
        lse1 = lse1.view(kv_heads, n, group).permute(1, 0, 2)
        out[rows] = merge_states(o1, lse1, out[rows], lse[rows])
    return out.reshape(bs, num_heads * d).to(q.dtype)


def _suffix_attention(qh, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, seq_lens_cpu, table, scale,
                      new_kv):
    """Each request over positions ``[suffix_start, seq_len)`` (its whole
    context when in no group), padded to the longest suffix: output
    ``[bs, kv_heads, group, d]`` and lse ``[bs, kv_heads, group]``."""
    bs, kv_heads, _, d = qh.shape
    starts = table.suffix_starts
    lens = seq_lens - starts
    width = max(s - a for s, a in zip(seq_lens_cpu, table.suffix_starts.tolist())) if bs else 0
    offsets = torch.arange(width, device=qh.device)
    valid = offsets < lens[:, None]  # every suffix holds at least the new token
    positions = torch.minimum(starts[:, None] + offsets, (seq_lens - 1)[:, None])
    slots = req_to_token[req_pool_indices[:, None], positions].to(torch.int64)
    slots = torch.where(valid, slots, 0).flatten()
    keys, values = (buf.index_select(0, slots).view(bs, width, kv_heads, d) for buf in (k_buffer, v_buffer))
    if new_kv is not None:  # the pool lacks the new token: put it in place
        rows = torch.arange(bs, device=qh.device)
        keys[rows, lens - 1], values[rows, lens - 1] = (to_kv_dtype(t, keys.dtype) for t in new_kv)
    keys, values = (t.float().permute(0, 2, 1, 3) for t in (keys, values))  # [bs, kv_heads, width, d]
    return attend_with_lse(qh, keys, values, scale, valid[:, None, None, :])
