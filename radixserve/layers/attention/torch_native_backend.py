"""Attention in plain PyTorch over the paged KV pool (CPU production path,
GPU reference).

Each request's context lives in KV slots ``req_to_token[row, :seq_len]``,
scattered over the pool in any page layout.

- DECODE on a CPU, float32 model: the C kernel of ``cpu_kernels.py``, which
  reads each request's K/V rows (float32 or fp8) straight from the pool
  (about 3x faster than the SDPA path below at 64 requests of ~200 tokens,
  SmolLM2 head shapes, 2 cores).
- DECODE otherwise: one batched SDPA. Keys are gathered (one
  ``index_select`` per buffer, on CPU several times faster than advanced
  indexing) into ``[bs, max_len]`` rows (padding points at dummy slot 0,
  masked out) inside two workspaces the backend keeps across layers and
  steps: a fresh multi-MB tensor per gather costs page faults that made the
  gather 2x slower. The query heads that share a KV head are folded into the
  query-length axis, ``q: [bs, kv_heads, group, d]``, so GQA needs no copy of K/V.
- DECODE with prefix groups (``--enable-prefix-grouped-decode``): each
  shared prefix read once per group, by the C kernel's grouped decode where
  it attends (as above), else by the cascade of ``cascade_decode.py``.
- EXTEND on a CPU, float32 model and pool: the C kernel's extend attention,
  each new token against its request's keys up to itself, four tokens at a
  time, straight from the pool (W6's prefill 14.8 s against 15.4 with the
  SDPA path below, 2 cores).
- EXTEND otherwise: one SDPA per request (with an fp8 pool the new tokens'
  own K/V are used as computed, not as stored, as the reference does).
  Measured on 2 CPU cores (16 requests of 100-1000 new tokens, SmolLM2 head
  shapes), this is 2-3x faster than one padded batched SDPA, which wastes
  work on padding and cannot use the causal fast path; with cached prefixes
  the loop still wins by 1.5x.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from radixserve.layers import cpu_kernels
from radixserve.layers.attention.base import AttentionBackend
from radixserve.layers.attention.cascade_decode import grouped_decode_attention
from radixserve.mem_cache.memory_pool import to_kv_dtype

if TYPE_CHECKING:
    from radixserve.layers.radix_attention import RadixAttention
    from radixserve.model_executor.forward_batch_info import ForwardBatch


@dataclass
class DecodeMetadata:
    kv_slots: torch.Tensor | None  # [bs * max_len] int64; padding -> slot 0 (SDPA path only)
    mask: torch.Tensor | None  # [bs, 1, 1, max_len] bool, True where the key is real (SDPA path only)
    max_len: int


@dataclass
class ExtendSegment:
    """One request of an EXTEND batch: its new tokens are rows
    ``q_start .. q_start + q_len`` of q/k/v; its cached prefix is ``prefix_slots``."""

    q_start: int
    q_len: int
    prefix_slots: torch.Tensor  # [prefix_len] int64
    mask: torch.Tensor | None  # [q_len, prefix_len + q_len] bool, None when not needed


@dataclass
class ExtendKernelMetadata:
    """An EXTEND batch for the C kernel (``cpu_kernels.extend_attention``):
    per request, its ``req_to_token`` row, cached and new tokens, first row of q."""

    rows: torch.Tensor  # [bs] int64
    prefix_lens: torch.Tensor  # [bs] int64
    extend_lens: torch.Tensor  # [bs] int64
    q_starts: torch.Tensor  # [bs] int64


class TorchNativeAttnBackend(AttentionBackend):
    """See the module docstring. Keeps per-batch metadata (in the ForwardBatch)
    and the decode gather workspaces; ``model_runner`` is not needed."""

    def __init__(self, model_runner=None):
        self._workspaces: list[torch.Tensor | None] = [None, None]  # decode K and V gathers
        self.model_dtype = getattr(model_runner, "dtype", torch.float32)  # the queries' (the C kernel's is float32)
        # CPU float32 decode and extend run the C kernels when they could be built (tests may turn them off).
        self.cpu_decode_kernel = cpu_kernels.decode_attention_available()

    def _kernel_attends(self, forward_batch: "ForwardBatch") -> bool:
        pool = forward_batch.token_to_kv_pool
        return (
            self.cpu_decode_kernel and pool.device.type == "cpu" and self.model_dtype == torch.float32
            and pool.dtype in cpu_kernels.KV_DTYPES and pool.v_head_dim == pool.head_dim
        )

    def init_forward_metadata(self, forward_batch: "ForwardBatch") -> None:
        if not forward_batch.forward_mode.is_decode():
            # the kernel reads the new tokens' K/V back from the pool: only where that is exact
            kernel = self._kernel_attends(forward_batch) and forward_batch.token_to_kv_pool.dtype == torch.float32
            forward_batch.attn_metadata = (_extend_kernel_metadata if kernel else _extend_metadata)(forward_batch)
        elif forward_batch.prefix_groups is not None:  # the grouped decode reads the table itself
            forward_batch.attn_metadata = None
        elif self._kernel_attends(forward_batch):
            forward_batch.attn_metadata = DecodeMetadata(None, None, max(forward_batch.seq_lens_cpu))
        else:
            forward_batch.attn_metadata = _decode_metadata(forward_batch)

    def forward_decode(self, q, k, v, layer: "RadixAttention", forward_batch: "ForwardBatch", save_kv_cache=True):
        md: DecodeMetadata = forward_batch.attn_metadata
        bs, kv_heads, d = forward_batch.batch_size, layer.num_kv_heads, layer.head_dim
        k, v = k.view(-1, kv_heads, d), v.view(-1, kv_heads, d)
        if save_kv_cache:
            forward_batch.token_to_kv_pool.set_kv_buffer(layer.layer_id, forward_batch.out_cache_loc, k, v)
        if forward_batch.prefix_groups is not None:
            return self._forward_grouped_decode(q, k, v, layer, forward_batch, save_kv_cache)
        if md.kv_slots is None and save_kv_cache:  # the C kernel, straight from the pool (new token included)
            k_buf, v_buf = _kv(layer, forward_batch)
            return cpu_kernels.decode_attention(
                q.reshape(bs, -1), k_buf, v_buf, forward_batch.req_to_token_pool.req_to_token,
                forward_batch.req_pool_indices, forward_batch.seq_lens, md.max_len, layer.num_heads, layer.scaling,
            )
        if md.kv_slots is None:
            md = _decode_metadata(forward_batch)
        keys, values = (
            self._gather_decode(i, buf, md.kv_slots).view(bs, md.max_len, kv_heads, d)
            for i, buf in enumerate(_kv(layer, forward_batch))
        )
        if not save_kv_cache:  # the pool lacks the new token: put it in place
            rows, last = torch.arange(bs, device=k.device), forward_batch.seq_lens - 1
            keys[rows, last], values[rows, last] = to_kv_dtype(k, keys.dtype), to_kv_dtype(v, values.dtype)
        q = q.reshape(bs, kv_heads, layer.num_heads // kv_heads, d)
        out = F.scaled_dot_product_attention(
            q, keys.transpose(1, 2).to(q.dtype), values.transpose(1, 2).to(q.dtype), attn_mask=md.mask, scale=layer.scaling
        )
        return out.reshape(bs, layer.num_heads * d)

    def _forward_grouped_decode(self, q, k, v, layer: "RadixAttention", forward_batch: "ForwardBatch",
                                save_kv_cache: bool) -> torch.Tensor:
        """Decode with ``forward_batch.prefix_groups``: each shared prefix read
        once per group, by the C kernel where it attends (straight from the
        pool, which must hold the new tokens), else ``cascade_decode.py``."""
        k_buf, v_buf = _kv(layer, forward_batch)
        fb = forward_batch
        if save_kv_cache and self._kernel_attends(fb):
            return cpu_kernels.grouped_decode_attention(
                q.reshape(fb.batch_size, -1), k_buf, v_buf, fb.req_to_token_pool.req_to_token, fb.req_pool_indices,
                fb.seq_lens, fb.prefix_groups, layer.num_heads, layer.scaling,
            )
        return grouped_decode_attention(
            q.reshape(fb.batch_size, -1), k_buf, v_buf, fb.req_to_token_pool.req_to_token, fb.req_pool_indices,
            fb.seq_lens, fb.seq_lens_cpu, fb.prefix_groups, layer.num_heads, layer.scaling,
            new_kv=None if save_kv_cache else (k, v),
        )

    def forward_extend(self, q, k, v, layer: "RadixAttention", forward_batch: "ForwardBatch", save_kv_cache=True):
        kv_heads, d = layer.num_kv_heads, layer.head_dim
        k, v = k.view(-1, kv_heads, d), v.view(-1, kv_heads, d)
        if save_kv_cache:
            forward_batch.token_to_kv_pool.set_kv_buffer(layer.layer_id, forward_batch.out_cache_loc, k, v)
        k_buf, v_buf = _kv(layer, forward_batch)
        md = forward_batch.attn_metadata
        if isinstance(md, ExtendKernelMetadata):
            if save_kv_cache:  # the C kernel, straight from the pool (the new tokens included)
                return cpu_kernels.extend_attention(
                    q.reshape(q.shape[0], -1), k_buf, v_buf, forward_batch.req_to_token_pool.req_to_token, md.rows,
                    md.prefix_lens, md.extend_lens, md.q_starts, layer.num_heads, layer.scaling,
                )
            forward_batch.attn_metadata = _extend_metadata(forward_batch)  # the pool lacks them: per-request SDPA
        q = q.view(-1, layer.num_heads, d)
        out = torch.empty_like(q)
        for seg in forward_batch.attn_metadata:
            new = slice(seg.q_start, seg.q_start + seg.q_len)
            keys = _with_prefix(k_buf, seg.prefix_slots, k[new], kv_heads, d)
            values = _with_prefix(v_buf, seg.prefix_slots, v[new], kv_heads, d)
            out[new] = _sdpa_one(q[new], keys, values, seg, layer.scaling)
        return out.view(-1, layer.num_heads * d)

    def _gather_decode(self, which: int, buf: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """``_gather(buf, slots)`` into workspace ``which`` (valid until the next call)."""
        numel = slots.numel() * buf[0].numel()
        ws = self._workspaces[which]
        if ws is None or ws.numel() < numel or ws.dtype != buf.dtype or ws.device != buf.device:
            ws = self._workspaces[which] = torch.empty(numel, dtype=buf.dtype, device=buf.device)
        out = ws[:numel].view(slots.numel(), -1)
        return torch.index_select(buf.view(buf.shape[0], -1), 0, slots, out=out)


def _kv(layer: "RadixAttention", forward_batch: "ForwardBatch") -> tuple[torch.Tensor, torch.Tensor]:
    return forward_batch.token_to_kv_pool.get_kv_buffer(layer.layer_id)


def _gather(buf: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """``buf[slots]`` as ``[len(slots), kv_heads * d]`` rows."""
    return buf.view(buf.shape[0], -1).index_select(0, slots)


def _with_prefix(buf: torch.Tensor, prefix_slots: torch.Tensor, new: torch.Tensor, kv_heads: int, d: int) -> torch.Tensor:
    if prefix_slots.numel() == 0:
        return new
    return torch.cat((_gather(buf, prefix_slots).view(-1, kv_heads, d).to(new.dtype), new))


def _sdpa_one(q, keys, values, seg: ExtendSegment, scaling: float) -> torch.Tensor:
    """Attention of one request: ``q [n, H, d]``, ``keys/values [ctx, Hkv, d]`` -> ``[n, H, d]``."""
    # 4-D inputs keep SDPA on its fused CPU kernel (3-D ones fall back to a slow path).
    q4, k4, v4 = (t.transpose(0, 1).unsqueeze(0) for t in (q, keys, values))
    causal = seg.mask is None and seg.prefix_slots.numel() == 0 and seg.q_len > 1
    out = F.scaled_dot_product_attention(
        q4, k4, v4, attn_mask=seg.mask, is_causal=causal, scale=scaling, enable_gqa=k4.shape[1] != q4.shape[1]
    )
    return out[0].transpose(0, 1)


def _decode_metadata(fb: "ForwardBatch") -> DecodeMetadata:
    max_len = max(fb.seq_lens_cpu)
    rows = fb.req_to_token_pool.req_to_token[fb.req_pool_indices, :max_len]
    mask = torch.arange(max_len, device=rows.device) < fb.seq_lens[:, None].to(rows.device)
    slots = torch.where(mask, rows, 0).to(torch.int64).flatten()
    return DecodeMetadata(kv_slots=slots, mask=mask[:, None, None, :], max_len=max_len)


def _extend_kernel_metadata(fb: "ForwardBatch") -> "ExtendKernelMetadata":
    new = torch.tensor(fb.extend_seq_lens_cpu, dtype=torch.int64)
    return ExtendKernelMetadata(
        rows=fb.req_pool_indices.to(device="cpu", dtype=torch.int64).contiguous(),
        prefix_lens=torch.tensor(fb.extend_prefix_lens_cpu, dtype=torch.int64),
        extend_lens=new, q_starts=torch.cumsum(new, 0) - new,
    )


def _extend_metadata(fb: "ForwardBatch") -> list[ExtendSegment]:
    req_to_token = fb.req_to_token_pool.req_to_token
    segments, q_start = [], 0
    for row, prefix, n in zip(fb.req_pool_indices.tolist(), fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu):
        slots = req_to_token[row, :prefix].to(torch.int64)
        # Query i sits at position prefix + i and sees keys 0 .. prefix + i.
        mask = None
        if prefix > 0 and n > 1:
            mask = torch.ones(n, prefix + n, dtype=torch.bool, device=req_to_token.device).tril(prefix)
        segments.append(ExtendSegment(q_start=q_start, q_len=n, prefix_slots=slots, mask=mask))
        q_start += n
    return segments
