"""How tokens reach the experts of other ranks and how their results come
back (``--moe-a2a-backend``; docs/moe.md has the costs).

Attention is tensor parallel, so after its output projection's all-reduce
every rank of the group holds every token of the batch: the tokens are
already gathered. A dispatcher turns the model's routing (global expert ids)
into what this rank's experts compute, and ``combine`` turns their partial
output back into the layer's output, the same on every rank.

- :class:`StandardDispatcher` (``none``, the default): nothing moves before
  the experts; a choice of an expert held elsewhere gets id -1 (the kernels
  skip it), and one all-reduce over the TP group sums the ranks' experts
  (and, under ``moe_tp_size > 1``, their intermediate slices). It is the
  dense MLP's one all-reduce, and CUDA graphs capture it.
- :class:`AllToAllDispatcher` (``all_to_all``, ``ep_size == tp_size``): each
  rank routes its own slice of the tokens, sends each (token, expert) choice
  to the rank that holds the expert with ``all_to_all_single``, gets the
  results back the same way, sums its tokens' k results and all-gathers the
  slices. Split sizes are exchanged first and read on the host, so it does
  not run under CUDA graphs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from radixserve.distributed.expert_parallel import ExpertLayout, MoEParallel


@dataclass
class Dispatched:
    """What this rank's experts compute: rows, their routing weights
    ``float32 [R, k]`` and local expert ids ``int32 [R, k]`` (-1: not here)."""

    hidden: torch.Tensor
    topk_weights: torch.Tensor
    topk_ids: torch.Tensor
    handle: Any = None  # what combine needs


class MoEDispatcher(Protocol):
    def dispatch(self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> Dispatched:
        """From every token and its global expert ids to this rank's work."""

    def combine(self, out: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        """From the experts' output on ``dispatched`` to the layer's output ``[T, H]``."""


def local_expert_ids(topk_ids: torch.Tensor, layout: ExpertLayout) -> torch.Tensor:
    """Global ids made local to this rank; -1 for an expert another rank holds."""
    if layout.ep_size == 1:
        return topk_ids
    local = topk_ids - layout.first_expert
    return torch.where((local >= 0) & (local < layout.num_local_experts), local, -1).to(torch.int32)


class StandardDispatcher:
    """``--moe-a2a-backend none``: see the module docstring."""

    def __init__(self, parallel: MoEParallel, layout: ExpertLayout):
        self.tp_group, self.layout = parallel.tp_group, layout

    def dispatch(self, hidden, topk_weights, topk_ids) -> Dispatched:
        return Dispatched(hidden, topk_weights, local_expert_ids(topk_ids, self.layout))

    def combine(self, out, dispatched) -> torch.Tensor:
        return self.tp_group.all_reduce(out)


@dataclass
class _A2AHandle:
    start: int  # this rank's first token
    num_tokens: int  # in the batch
    token_of_row: torch.Tensor  # the local token of each row sent, in send order
    send_splits: list[int]  # rows sent to each rank
    recv_splits: list[int]  # rows received from each rank


class AllToAllDispatcher:
    """``--moe-a2a-backend all_to_all``: see the module docstring."""

    def __init__(self, parallel: MoEParallel, layout: ExpertLayout):
        self.tp_group, self.layout = parallel.tp_group, layout
        self.size, self.rank = parallel.tp_group.size, parallel.tp_group.rank

    def _bounds(self, num_tokens: int, rank: int) -> tuple[int, int]:
        return num_tokens * rank // self.size, num_tokens * (rank + 1) // self.size

    def dispatch(self, hidden, topk_weights, topk_ids) -> Dispatched:
        num_tokens, k = topk_ids.shape
        start, end = self._bounds(num_tokens, self.rank)
        ids = topk_ids[start:end].reshape(-1).to(torch.int64)
        dest = ids // self.layout.num_local_experts
        order = torch.argsort(dest, stable=True)
        token_of_row = order // k
        send_counts = torch.bincount(dest, minlength=self.size)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.tp_group.device_group)
        send_splits, recv_splits = send_counts.tolist(), recv_counts.tolist()  # the host sync
        rows = self._exchange(hidden[start:end][token_of_row], recv_splits, send_splits)
        # ids (exact in float32) and weights travel together in one float32 message
        meta = torch.stack([(ids[order] % self.layout.num_local_experts).float(),
                            topk_weights[start:end].reshape(-1)[order].float()], dim=1)
        meta = self._exchange(meta, recv_splits, send_splits)
        handle = _A2AHandle(start, num_tokens, token_of_row, send_splits, recv_splits)
        return Dispatched(rows, meta[:, 1:2].contiguous(), meta[:, 0:1].to(torch.int32), handle)

    def combine(self, out, dispatched) -> torch.Tensor:
        h: _A2AHandle = dispatched.handle
        back = self._exchange(out, h.send_splits, h.recv_splits)
        end = self._bounds(h.num_tokens, self.rank)[1]
        mine = out.new_zeros((end - h.start, out.shape[1]))
        mine.index_add_(0, h.token_of_row, back)
        # all-gather the ranks' slices (uneven: padded to the longest)
        longest = -(-h.num_tokens // self.size)
        padded = out.new_zeros((longest, out.shape[1]))
        padded[: mine.shape[0]] = mine
        gathered = self.tp_group.all_gather(padded, dim=0)
        pieces = [gathered[r * longest : r * longest + (b - a)]
                  for r, (a, b) in enumerate(self._bounds(h.num_tokens, r) for r in range(self.size))]
        return torch.cat(pieces)

    def _exchange(self, x: torch.Tensor, out_splits: list[int], in_splits: list[int]) -> torch.Tensor:
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=self.tp_group.device_group)
        return out


def make_dispatcher(parallel: MoEParallel, layout: ExpertLayout) -> MoEDispatcher:
    if parallel.a2a_backend == "all_to_all":
        return AllToAllDispatcher(parallel, layout)
    return StandardDispatcher(parallel, layout)
