"""What one forward pass needs, as device tensors (the last stage of
ScheduleBatch -> ModelWorkerBatch -> ForwardBatch).

Token layout for EXTEND: the new tokens of every request, concatenated in
batch order. Request ``i`` contributes ``extend_seq_lens[i]`` tokens at
positions ``extend_prefix_lens[i] .. seq_lens[i]-1``; its first
``extend_prefix_lens[i]`` tokens are already in the KV pool and are read
through ``req_to_token[req_pool_indices[i]]``.

DECODE is the special case of one new token per request; it has its own mode
so that backends and CUDA graphs can take a faster path.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import torch

if TYPE_CHECKING:
    from radixserve.distributed.pipeline import PPHidden
    from radixserve.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool


class ForwardMode(enum.IntEnum):
    EXTEND = 1  # prefill of the uncached part of each prompt (or of its next chunk)
    DECODE = 2  # one new token per request

    def is_extend(self) -> bool:
        return self == ForwardMode.EXTEND

    def is_decode(self) -> bool:
        return self == ForwardMode.DECODE


class KVStore(NamedTuple):
    """Where a layer's new K/V go in the pool, for a kernel before attention
    that stores them itself (the rotary kernel, which has K in registers):
    slots ``loc`` of ``k_buffer`` / ``v_buffer`` (``[slots, kv_heads, dim]``,
    each slot's heads contiguous), cast to the pool's dtype."""

    k_buffer: torch.Tensor
    v_buffer: torch.Tensor
    loc: torch.Tensor


class AttentionBackendProtocol(Protocol):
    """What a forward calls on its attention backend (``layers/attention/base.py``'s
    ``AttentionBackend`` is one), declared here because the layers import this module."""

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None: ...

    def kv_store(self, layer: torch.nn.Module, forward_batch: ForwardBatch) -> KVStore | None: ...

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: torch.nn.Module,
                forward_batch: ForwardBatch, save_kv_cache: bool = True, kv_stored: bool = False) -> torch.Tensor: ...


@dataclass
class PrefixGroupTable:
    """Which requests of a decode batch share a cached prefix (docs/prefix_grouped_decode.md).

    Group ``g`` is the batch rows ``members[member_starts[g]:member_starts[g + 1]]``;
    its shared prefix is the KV slots ``req_to_token[prefix_rows[g], :prefix_lens[g]]``
    (every member's row holds the same slots there). Each request's own suffix
    is positions ``suffix_starts[i] .. seq_len - 1``: ``prefix_lens`` of its
    group, 0 for a request in no group. The ``*_cpu`` lists are the same
    numbers for host-side loops; the tensors are what a kernel takes.
    """

    prefix_rows: torch.Tensor  # [G] int64, a member's req_to_token row
    prefix_lens: torch.Tensor  # [G] int64, each >= one page
    member_starts: torch.Tensor  # [G + 1] int64
    members: torch.Tensor  # [M] int64, batch rows
    suffix_starts: torch.Tensor  # [bs] int64
    prefix_lens_cpu: list[int]
    members_cpu: list[list[int]]

    @property
    def num_groups(self) -> int:
        return len(self.prefix_lens_cpu)

    def to(self, device: torch.device | str) -> "PrefixGroupTable":
        move = lambda t: t.to(device, non_blocking=True)  # noqa: E731
        return PrefixGroupTable(move(self.prefix_rows), move(self.prefix_lens), move(self.member_starts),
                                move(self.members), move(self.suffix_starts), self.prefix_lens_cpu, self.members_cpu)

    @classmethod
    def static(cls, max_bs: int, padding_row: int, device: torch.device) -> "PrefixGroupTable":
        """Buffers for a CUDA graph's input: room for every table of up to
        ``max_bs`` requests (a group has two members at least), holding no
        group. :meth:`fill` copies a batch's table in; the spare groups have
        no members, and a device kernel reads only the tensors, never the
        ``*_cpu`` lists (empty here)."""
        groups = max(1, max_bs // 2)
        zeros = lambda n: torch.zeros(n, dtype=torch.int64, device=device)  # noqa: E731
        return cls(torch.full((groups,), padding_row, dtype=torch.int64, device=device), zeros(groups),
                   zeros(groups + 1), zeros(max_bs), zeros(max_bs), [], [])

    def fill(self, table: "PrefixGroupTable | None", bs: int, padded: int) -> None:
        """Copy ``table`` (of a batch of ``bs`` requests, on this device; None:
        no group) into these static buffers, rows ``bs .. padded-1`` (a graph's
        padding) in no group. Device copies only."""
        if table is None:
            self.member_starts.zero_()
            self.suffix_starts[:padded].zero_()
            return
        g, m = table.num_groups, table.members.shape[0]
        self.prefix_rows[:g].copy_(table.prefix_rows)
        self.prefix_lens[:g].copy_(table.prefix_lens)
        self.member_starts[: g + 1].copy_(table.member_starts)
        self.member_starts[g + 1 :].fill_(m)
        self.members[:m].copy_(table.members)
        self.suffix_starts[:bs].copy_(table.suffix_starts)
        self.suffix_starts[bs:padded].zero_()

    def rows(self, bs: int) -> "PrefixGroupTable":
        """The static table as a batch of ``bs`` requests sees it (its own suffix starts)."""
        return PrefixGroupTable(self.prefix_rows, self.prefix_lens, self.member_starts, self.members,
                                self.suffix_starts[:bs], [], [])


@dataclass
class ForwardBatch:
    """Device tensors for one forward; built by the ModelRunner from a ModelWorkerBatch."""

    forward_mode: ForwardMode
    batch_size: int
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    req_pool_indices: torch.Tensor  # [bs] int64, rows of req_to_token
    seq_lens: torch.Tensor  # [bs] int64, length of each request after this forward
    out_cache_loc: torch.Tensor  # [num_tokens] int64, KV slots the new tokens write to
    seq_lens_cpu: list[int]
    req_to_token_pool: "ReqToTokenPool"
    token_to_kv_pool: "MHATokenToKVPool"
    attn_backend: AttentionBackendProtocol

    # EXTEND only (None for DECODE)
    extend_prefix_lens: torch.Tensor | None = None  # [bs]
    extend_seq_lens: torch.Tensor | None = None  # [bs]
    extend_start_loc: torch.Tensor | None = None  # [bs], offset of each request's first new token
    extend_prefix_lens_cpu: list[int] | None = None
    extend_seq_lens_cpu: list[int] | None = None
    # The last ``num_decoding`` requests of an EXTEND decode one token each
    # (a mixed batch): a backend may run them as a decode.
    num_decoding: int = 0

    # Input-token logprobs (EXTEND with return_logprob): for request i, logprobs
    # are computed for new-token positions >= extend_logprob_start_lens_cpu[i]
    # (relative to the request's first new token).
    return_logprob: bool = False
    extend_logprob_start_lens_cpu: list[int] | None = None
    top_logprobs_nums: list[int] | None = None
    token_ids_logprobs: list[list[int] | None] | None = None

    # DECODE with --enable-prefix-grouped-decode: the running requests that
    # share a cached prefix (managers/prefix_groups.py); None: attend as usual.
    prefix_groups: PrefixGroupTable | None = None

    # --enable-lora: the batch's rows grouped by adapter slot (lora/pool.py's LoRABatch); None: no adapter
    lora: Any = None

    # --pp-size, a stage other than the first: the previous stage's output, which
    # its layers take instead of the embedded input_ids (distributed/pipeline.py)
    pp_hidden: PPHidden | None = None

    # Backend-private metadata, filled by attn_backend.init_forward_metadata().
    attn_metadata: Any = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


def ragged_arange(starts: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """``cat([arange(s, s + n) for s, n in zip(starts, lens)])`` without a Python loop.

    E.g. the positions of an EXTEND batch are ``ragged_arange(extend_prefix_lens,
    extend_seq_lens)``. ``lens`` must be non-negative; the result is on ``lens.device``.
    """
    total = int(lens.sum())
    ends = torch.cumsum(lens, 0)
    offsets = torch.repeat_interleave(starts - (ends - lens), lens, output_size=total)
    return torch.arange(total, dtype=offsets.dtype, device=lens.device) + offsets
