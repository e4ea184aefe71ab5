"""Attention through our own Triton kernels (GPU).

- DECODE: paged split-KV decode (``triton_ops.decode_attention``). Per batch,
  ``init_forward_metadata`` picks the grid's split axis from the batch size
  and each request's split count from its length, on the device. Nothing in
  ``forward`` syncs with the host or allocates beyond its output, and the
  scratch buffers for partial outputs are allocated once, for the runner's
  largest batch (a few MB: the split axis shrinks as batches grow): the path
  is ready for CUDA-graph capture.
- EXTEND: one kernel over all requests (``triton_ops.extend_attention``): the
  cached prefix through ``req_to_token``, the new tokens causally from q/k/v.
  In a mixed batch the requests decoding inside it (the last
  ``num_decoding``, one token each) go through the decode kernel instead,
  after their K/V is stored: the extend kernel would spend a whole query
  block on each one's single token and read its K/V once per query head.
- New K/V go into the pool with one fused store kernel (``triton_ops.kv_store``),
  or, where the model asks :meth:`TritonAttnBackend.kv_store` first, from
  the rotary kernel as it rotates K (``forward(..., kv_stored=True)``).

Kernels only see slot indices, so any page size works. q/k/v may be bf16,
fp16 or fp32 (fp32 dots run in full precision, for debugging).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from radixserve.layers.attention.base import AttentionBackend
from radixserve.layers.attention.triton_ops import decode_attention as decode_ops
from radixserve.layers.attention.triton_ops.extend_attention import extend_attention_fwd
from radixserve.layers.attention.triton_ops.kv_store import can_store_kv, store_kv
from radixserve.layers.triton_ops import canonical_device, num_sms
from radixserve.model_executor.forward_batch_info import KVStore

if TYPE_CHECKING:
    from radixserve.layers.radix_attention import RadixAttention
    from radixserve.model_executor.forward_batch_info import ForwardBatch

DEFAULT_NUM_SMS = 16  # off CUDA (Triton's interpreter) there is no multiprocessor count to read


@dataclass
class DecodeMetadata:
    num_kv_splits: torch.Tensor  # [bs] int32, a view of the backend's persistent buffer
    max_splits: int  # the split axis of the grid
    shared: decode_ops.SharedPrefixes | None = None  # prefix-grouped decode: the batch's shared prefixes


@dataclass
class ExtendMetadata:
    prefix_lens: torch.Tensor  # [bs]
    extend_lens: torch.Tensor  # [bs]
    extend_start: torch.Tensor  # [bs], row of each request's first new token in q/k/v
    max_extend_len: int
    riders: DecodeMetadata | None = None  # the decode of a mixed batch's last requests, if any


def check_kv_dtype(kv_dtype: torch.dtype, capability: tuple[int, int]) -> None:
    """Refuse, at start-up, a pool dtype that Triton cannot read on this GPU:
    float8_e4m3fn needs compute capability 8.9 (Ada, Hopper) or newer."""
    if kv_dtype == torch.float8_e4m3fn and tuple(capability) < (8, 9):
        raise ValueError(
            f"--kv-cache-dtype fp8_e4m3 needs a GPU of compute capability 8.9 or newer for the triton "
            f"attention backend (this one is {capability[0]}.{capability[1]}): use fp8_e5m2, or "
            f"--attention-backend torch_native")


class TritonAttnBackend(AttentionBackend):
    """See the module docstring. With a ``model_runner`` the decode scratch is
    sized for its ``max_running_requests + 1`` rows (the padding row included)
    up front; without one (kernel tests) it grows on demand."""

    graphs_prefix_groups = True  # its grouped decode runs inside CUDA graphs (cuda_graph_runner.py)

    def __init__(self, model_runner=None):
        self.num_kv_heads = 1
        self.group = 1  # query heads per KV head
        self._splits_buf: torch.Tensor | None = None  # [capacity] int32
        # Flat fp32 scratch, viewed per batch as [bs, heads, splits, v_head_dim] and [bs, heads, splits].
        self._mid_o: torch.Tensor | None = None
        self._mid_lse: torch.Tensor | None = None
        self._prefix_o: torch.Tensor | None = None  # the same for the shared prefixes' partials
        self._prefix_lse: torch.Tensor | None = None
        if model_runner is not None:
            heads, device = model_runner.head_layout, model_runner.device  # this TP rank's heads
            if device.type == "cuda":
                check_kv_dtype(model_runner.kv_cache_dtype, torch.cuda.get_device_capability(device))
            self.num_kv_heads = heads.num_kv_heads
            self.group = heads.num_heads // heads.num_kv_heads
            rows = model_runner.max_running_requests + 1  # the padding row too
            self._splits(rows, device)
            split_rows = decode_ops.scratch_splits(rows, self.num_kv_heads, self._sm_count(device))
            self._scratch(split_rows, 1, heads.num_heads, model_runner.model_config.head_dim, device)

    # -- metadata (once per forward, before the layers) ---------------------
    def init_forward_metadata(self, forward_batch: "ForwardBatch") -> None:
        fb = forward_batch
        if fb.forward_mode.is_decode():
            if fb.prefix_groups is not None:
                fb.attn_metadata = self._grouped_metadata(fb)
            else:
                fb.attn_metadata = self._decode_metadata(fb.seq_lens)
            return
        n = fb.batch_size - fb.num_decoding  # requests that extend; the others ride as a decode
        fb.attn_metadata = ExtendMetadata(
            prefix_lens=fb.extend_prefix_lens[:n],
            extend_lens=fb.extend_seq_lens[:n],
            extend_start=fb.extend_start_loc[:n],
            max_extend_len=max(fb.extend_seq_lens_cpu[:n], default=0),
            riders=self._decode_metadata(fb.seq_lens[n:]) if fb.num_decoding else None,
        )

    def _decode_metadata(self, seq_lens: torch.Tensor) -> DecodeMetadata:
        bs, device = seq_lens.shape[0], seq_lens.device
        max_splits = decode_ops.splits_grid(bs, self.num_kv_heads, self._sm_count(device))
        num_kv_splits = decode_ops.num_kv_splits_(self._splits(bs, device)[:bs], seq_lens, max_splits)
        return DecodeMetadata(num_kv_splits=num_kv_splits, max_splits=max_splits)

    def _grouped_metadata(self, fb: "ForwardBatch") -> DecodeMetadata:
        """A decode whose requests read their own suffixes, and the groups'
        shared prefixes cut into tiles of ``members_per_tile`` members (device
        ops of fixed shapes only: a CUDA graph captures them, and the table's
        spare groups, of no members, give no tiles)."""
        table, bs, device = fb.prefix_groups, fb.batch_size, fb.seq_lens.device
        md = self._decode_metadata(fb.seq_lens - table.suffix_starts)
        per_tile = decode_ops.members_per_tile(self.group)
        starts = table.member_starts
        sizes = starts[1:] - starts[:-1]
        tiles_of_group = torch.div(sizes + (per_tile - 1), per_tile, rounding_mode="floor")
        ends = torch.cumsum(tiles_of_group, 0)
        tile = torch.arange(bs, device=device)  # never more tiles than grouped requests
        g = torch.searchsorted(ends, tile, right=True).clamp_(max=sizes.shape[0] - 1)
        local = tile - (ends[g] - tiles_of_group[g])
        counts = torch.where(tile < ends[-1], (sizes[g] - local * per_tile).clamp(0, per_tile), 0)
        tiles = torch.stack([table.prefix_rows[g], table.prefix_lens[g], starts[g] + local * per_tile, counts])
        md.shared = decode_ops.SharedPrefixes(
            prefix_lens=table.suffix_starts, tiles=tiles, num_tiles=ends[-1:], members=table.members,
            mid_o=None, mid_lse=None,
            programs=decode_ops.prefix_programs(self.num_kv_heads, self._sm_count(device)),
        )
        return md

    # -- forward --------------------------------------------------------------
    def kv_store(self, layer: "RadixAttention", forward_batch: "ForwardBatch") -> KVStore | None:
        """The pool's layer on CUDA where each slot's heads are contiguous
        (the store kernel's layout): the rotary kernel then stores K and V
        as it rotates K, and the store kernel's launch goes."""
        k_buf, v_buf = forward_batch.token_to_kv_pool.get_kv_buffer(layer.layer_id)
        if not (k_buf.is_cuda and can_store_kv(k_buf, v_buf, k_buf, v_buf)):
            return None
        return KVStore(k_buf, v_buf, forward_batch.out_cache_loc)

    def forward_decode(self, q, k, v, layer: "RadixAttention", forward_batch: "ForwardBatch", save_kv_cache=True,
                       kv_stored=False):
        fb = forward_batch
        if not save_kv_cache:
            # The pool lacks the new tokens: read them from k/v like an extend of one token.
            return self._extend(q, k, v, layer, fb, _decode_as_extend(fb))
        bs, d, dv = fb.batch_size, layer.head_dim, v.shape[-1] // layer.num_kv_heads
        if not kv_stored:
            self._store(k.view(bs, layer.num_kv_heads, d), v.view(bs, layer.num_kv_heads, dv), layer, fb)
        out = q.new_empty(bs, layer.num_heads, dv)
        self._decode(q.view(bs, layer.num_heads, d), out, layer, fb, fb.attn_metadata, slice(None))
        return out.view(bs, layer.num_heads * dv)

    def _decode(self, q, out, layer: "RadixAttention", fb: "ForwardBatch", md: DecodeMetadata, rows: slice) -> None:
        """Attention of one new token per request of ``rows`` over its cached K/V (stored already)."""
        bs, dv = q.shape[0], out.shape[-1]
        k_buf, v_buf = fb.token_to_kv_pool.get_kv_buffer(layer.layer_id)
        mid_o, mid_lse = self._scratch(bs, md.max_splits, layer.num_heads, dv, q.device)
        shared = md.shared
        if shared is not None:
            shared.mid_o, shared.mid_lse = self._prefix_scratch(bs, layer.num_heads, dv, q.device)
        decode_ops.decode_attention_fwd(
            q, k_buf, v_buf, out, fb.req_to_token_pool.req_to_token, fb.req_pool_indices[rows], fb.seq_lens[rows],
            md.num_kv_splits, md.max_splits, mid_o, mid_lse, layer.scaling, shared,
        )

    def forward_extend(self, q, k, v, layer: "RadixAttention", forward_batch: "ForwardBatch", save_kv_cache=True,
                       kv_stored=False):
        fb, md = forward_batch, forward_batch.attn_metadata
        if save_kv_cache and not kv_stored:
            d, dv = layer.head_dim, v.shape[-1] // layer.num_kv_heads
            self._store(k.view(-1, layer.num_kv_heads, d), v.view(-1, layer.num_kv_heads, dv), layer, fb)
        if md.riders is None or not save_kv_cache:  # without the riders' K/V in the pool, they extend too
            return self._extend(q, k, v, layer, fb, md if md.riders is None else _all_extend(fb))
        riders = fb.num_decoding
        d, dv = layer.head_dim, v.shape[-1] // layer.num_kv_heads
        out = q.new_empty(q.shape[0], layer.num_heads, dv)
        ext = q.shape[0] - riders  # the riders' tokens are the batch's last
        self._extend(q[:ext], k[:ext], v[:ext], layer, fb, md, out[:ext])
        self._decode(q[ext:].view(riders, layer.num_heads, d), out[ext:], layer, fb, md.riders,
                     slice(fb.batch_size - riders, None))
        return out.view(-1, layer.num_heads * dv)

    def _extend(self, q, k, v, layer: "RadixAttention", fb: "ForwardBatch", md: ExtendMetadata,
                out: torch.Tensor | None = None) -> torch.Tensor:
        d, dv = layer.head_dim, v.shape[-1] // layer.num_kv_heads
        q = q.reshape(-1, layer.num_heads, d)
        out = q.new_empty(q.shape[0], layer.num_heads, dv) if out is None else out
        k_buf, v_buf = fb.token_to_kv_pool.get_kv_buffer(layer.layer_id)
        rows = fb.req_pool_indices[: md.prefix_lens.shape[0]]
        extend_attention_fwd(
            q, k.reshape(-1, layer.num_kv_heads, d), v.reshape(-1, layer.num_kv_heads, dv), out, k_buf, v_buf,
            fb.req_to_token_pool.req_to_token, rows,
            md.prefix_lens, md.extend_lens, md.extend_start, md.max_extend_len, layer.scaling,
        )
        return out.view(-1, layer.num_heads * dv)

    def _store(self, k: torch.Tensor, v: torch.Tensor, layer: "RadixAttention", fb: "ForwardBatch") -> None:
        pool = fb.token_to_kv_pool
        k_buf, v_buf = pool.get_kv_buffer(layer.layer_id)
        if can_store_kv(k, v, k_buf, v_buf):
            store_kv(k, v, k_buf, v_buf, fb.out_cache_loc)
        else:
            pool.set_kv_buffer(layer.layer_id, fb.out_cache_loc, k, v)

    # -- persistent buffers -------------------------------------------------------
    def _splits(self, bs: int, device: torch.device) -> torch.Tensor:
        buf, device = self._splits_buf, canonical_device(device)
        if buf is None or buf.shape[0] < bs or buf.device != device:
            buf = self._splits_buf = torch.ones(bs, dtype=torch.int32, device=device)
        return buf

    def _scratch(self, bs: int, splits: int, num_heads: int, v_head_dim: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """Views ``[bs, num_heads, splits, v_head_dim]`` and ``[bs, num_heads, splits]``
        of the flat scratch buffers (grown, eagerly, only if a batch outgrows
        what was allocated)."""
        device = canonical_device(device)
        lse_numel = bs * num_heads * splits
        if self._mid_lse is None or self._mid_lse.numel() < lse_numel or self._mid_lse.device != device:
            self._mid_lse = torch.empty(lse_numel, dtype=torch.float32, device=device)
        if self._mid_o is None or self._mid_o.numel() < lse_numel * v_head_dim or self._mid_o.device != device:
            self._mid_o = torch.empty(lse_numel * v_head_dim, dtype=torch.float32, device=device)
        mid_o = self._mid_o[: lse_numel * v_head_dim].view(bs, num_heads, splits, v_head_dim)
        return mid_o, self._mid_lse[:lse_numel].view(bs, num_heads, splits)

    def _prefix_scratch(self, bs: int, num_heads: int, v_head_dim: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """``[bs, num_heads, PREFIX_SPLITS, v_head_dim]`` and ``[bs, num_heads,
        PREFIX_SPLITS]`` for the shared prefixes' partials (grown like ``_scratch``)."""
        device, splits = canonical_device(device), decode_ops.PREFIX_SPLITS
        lse_numel = bs * num_heads * splits
        if self._prefix_lse is None or self._prefix_lse.numel() < lse_numel or self._prefix_lse.device != device:
            self._prefix_lse = torch.empty(lse_numel, dtype=torch.float32, device=device)
            self._prefix_o = torch.empty(lse_numel * v_head_dim, dtype=torch.float32, device=device)
        if self._prefix_o.numel() < lse_numel * v_head_dim:
            self._prefix_o = torch.empty(lse_numel * v_head_dim, dtype=torch.float32, device=device)
        o = self._prefix_o[: lse_numel * v_head_dim].view(bs, num_heads, splits, v_head_dim)
        return o, self._prefix_lse[:lse_numel].view(bs, num_heads, splits)

    def _sm_count(self, device: torch.device) -> int:
        device = canonical_device(device)
        return num_sms(device) if device.type == "cuda" else DEFAULT_NUM_SMS


def _all_extend(fb: "ForwardBatch") -> ExtendMetadata:
    """A mixed batch's metadata with its riders extending like the rest."""
    return ExtendMetadata(fb.extend_prefix_lens, fb.extend_seq_lens, fb.extend_start_loc,
                          max(fb.extend_seq_lens_cpu, default=0))


def _decode_as_extend(fb: "ForwardBatch") -> ExtendMetadata:
    """A DECODE batch seen as an EXTEND of one new token per request (device ops only)."""
    ones = torch.ones_like(fb.seq_lens)
    return ExtendMetadata(
        prefix_lens=fb.seq_lens - 1,
        extend_lens=ones,
        extend_start=torch.arange(fb.batch_size, device=fb.seq_lens.device),
        max_extend_len=1,
    )
