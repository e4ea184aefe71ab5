"""``FusedMoE``: a MoE layer's experts on this rank, their weights and loader,
and :class:`ExpertLoad`, the tokens each expert received (for ``/metrics``).

Weights (``E_local`` experts, ``I_shard`` of the intermediate dimension, see
``distributed/expert_parallel.py``):

- ``w13_weight [E_local, 2 * I_shard, H]``: each expert's gate rows, then its up rows;
- ``w2_weight [E_local, H, I_shard]``: its down projection's columns.

Their ``weight_loader(param, tensor, shard_id)`` takes the checkpoint's
tensors whole: per expert, shard ids ``("gate", e)``, ``("up", e)`` (``[I, H]``)
and ``("down", e)`` (``[H, I]``), as HF's Qwen ``experts.N.gate_proj`` and
Mixtral's ``experts.N.w1`` are; or every expert stacked, ``"w13"``
(``[E, 2I, H]``, gate then up: HF's in-memory ``experts.gate_up_proj``) and
``"w2"`` (``[E, H, I]``). A rank keeps its experts' slice and drops the rest.
"""

from __future__ import annotations

import torch
from torch import nn

from radixserve.distributed.expert_parallel import MoEParallel
from radixserve.layers.linear import copy_checked, linear
from radixserve.layers.moe.dispatch import make_dispatcher
from radixserve.layers.moe.native import moe_forward_native
from radixserve.layers.moe.topk import select_experts
from radixserve.layers.triton_ops import use_triton

_PER_EXPERT_PARTS = ("gate", "up", "down")


class ExpertLoad:
    """Tokens routed to each expert of each MoE layer since start, counted on
    the device by the routing itself (``topk.select_experts``: no host sync,
    and no launch of its own in the fused kernel; CUDA graphs capture it),
    and the forward passes that routed them. Counts are of the model's
    routing (global expert ids), so rank 0 alone sees every expert; a padded
    CUDA-graph row is routed, and counted, like any other."""

    def __init__(self, num_layers: int, num_experts: int):
        self.counts = torch.zeros(num_layers, num_experts, dtype=torch.int64)
        self.steps = torch.zeros(1, dtype=torch.int64)

    def layer_counts(self, moe_index: int) -> torch.Tensor:
        """The histogram row the routing of MoE layer ``moe_index`` adds to;
        the first layer's call counts a forward pass."""
        if moe_index == 0:
            self.steps.add_(1)
        return self.counts[moe_index]

    def read(self) -> tuple[list[list[int]], int]:
        """``(counts per layer and expert, steps)``: one copy to the host."""
        steps = int(self.steps.item())
        return self.counts.tolist(), steps


class Router(nn.Module):
    """The router's ``[E, H]`` linear, replicated on every rank, in the model's
    dtype (as HF computes the logits), never quantized or prepacked: its
    logits (``forward``) and the routing of a batch (:meth:`select`)."""

    def __init__(self, hidden_size: int, num_experts: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)
        # fused_router_topk's count of finished programs, zero between launches
        self.register_buffer("ticket", torch.zeros(1, dtype=torch.int32), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight)

    def select(self, x: torch.Tensor, top_k: int, renormalize: bool,
               counts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``topk.select_experts`` of this router's logits for ``x`` ``[T, H]``:
        on CUDA at up to ``MAX_FUSED_ROUTER_TOKENS`` rows the logits and the
        routing in one launch (``triton_ops/topk.py``), else the GEMM then
        the routing."""
        if use_triton(x) and x.dtype == self.weight.dtype:
            from radixserve.layers.moe.triton_ops.topk import MAX_EXPERTS, MAX_FUSED_ROUTER_TOKENS, fused_router_topk

            if 0 < x.shape[0] <= MAX_FUSED_ROUTER_TOKENS and self.weight.shape[0] <= MAX_EXPERTS:
                return fused_router_topk(x, self.weight, top_k, renormalize, self.ticket, counts)
        return select_experts(self(x), top_k, renormalize, counts)


class FusedMoE(nn.Module):
    """The experts of one MoE layer on this rank (module docstring).

    ``forward(hidden [T, H], router)`` routes (:meth:`Router.select`),
    dispatches (``dispatch.py``), runs the experts (the fused Triton kernel on
    CUDA, the torch path elsewhere) and combines: its output is the layer's,
    complete and the same on every rank."""

    def __init__(
        self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int, renormalize: bool,
        parallel: MoEParallel | None = None, load: ExpertLoad | None = None, moe_index: int = 0,
    ):
        super().__init__()
        parallel = parallel or MoEParallel()
        self.layout = parallel.layout(num_experts)
        if intermediate_size % self.layout.moe_tp_size:
            raise ValueError(f"the experts' intermediate size {intermediate_size} is not divisible by "
                             f"tp_size / ep_size = {self.layout.moe_tp_size} (--tp-size, --ep-size)")
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.shard_size = intermediate_size // self.layout.moe_tp_size
        local = self.layout.num_local_experts
        self.w13_weight = nn.Parameter(torch.empty(local, 2 * self.shard_size, hidden_size), requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(local, hidden_size, self.shard_size), requires_grad=False)
        for param, shard_id, shape in ((self.w13_weight, "w13", (num_experts, 2 * intermediate_size, hidden_size)),
                                       (self.w2_weight, "w2", (num_experts, hidden_size, intermediate_size))):
            param.weight_loader = self.weight_loader
            param.checkpoint_shards = [(shard_id, shape)]  # dummy weights draw the whole stack
        self.dispatcher = make_dispatcher(parallel, self.layout)
        self.load, self.moe_index = load, moe_index
        self._loaded: set[tuple[str, int]] = set()

    # -- loading -------------------------------------------------------------
    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id) -> None:
        if shard_id == "w13":
            self._check_stack(loaded, 2 * self.intermediate_size, 1)
            for e in self._local_experts():
                gate, up = loaded[e].chunk(2)
                self._load_part(e, "gate", gate)
                self._load_part(e, "up", up)
            self._loaded.update((part, e) for part in ("gate", "up") for e in range(self.num_experts))
        elif shard_id == "w2":
            self._check_stack(loaded, self.intermediate_size, 2)
            for e in self._local_experts():
                self._load_part(e, "down", loaded[e])
            self._loaded.update(("down", e) for e in range(self.num_experts))
        elif isinstance(shard_id, tuple) and len(shard_id) == 2 and shard_id[0] in _PER_EXPERT_PARTS:
            part, e = shard_id
            if not 0 <= e < self.num_experts:
                raise ValueError(f"expert {e} does not exist: the layer has {self.num_experts}")
            if e in self._local_experts():
                self._load_part(e, part, loaded)
            self._loaded.add((part, e))
        else:
            raise ValueError(f"unknown expert shard id {shard_id!r}")

    def missing(self) -> list[str]:
        """The checkpoint tensors of this layer's experts not loaded yet."""
        return [f"experts.{e}.{part}" for e in range(self.num_experts) for part in _PER_EXPERT_PARTS
                if (part, e) not in self._loaded]

    def _local_experts(self) -> range:
        first = self.layout.first_expert
        return range(first, first + self.layout.num_local_experts)

    def _check_stack(self, loaded: torch.Tensor, inter: int, dim: int) -> None:
        shape = [self.num_experts, self.hidden_size, self.hidden_size]
        shape[dim] = inter
        if tuple(loaded.shape) != tuple(shape):
            raise ValueError(f"weight shape mismatch: stacked experts {tuple(loaded.shape)}, expected {tuple(shape)}")

    def _load_part(self, expert: int, part: str, loaded: torch.Tensor) -> None:
        """Copy this rank's slice of one expert's ``part`` into place."""
        local, size = expert - self.layout.first_expert, self.shard_size
        start = self.layout.moe_tp_rank * size
        with torch.no_grad():
            if part == "down":  # [H, I]: this rank's columns
                if loaded.dim() != 2 or loaded.shape[1] != self.intermediate_size:
                    raise ValueError(f"weight shape mismatch: down {tuple(loaded.shape)}, "
                                     f"expected ({self.hidden_size}, {self.intermediate_size})")
                copy_checked(self.w2_weight.data[local], loaded.narrow(1, start, size))
            else:  # [I, H]: this rank's rows, into the gate or the up half
                if loaded.dim() != 2 or loaded.shape[0] != self.intermediate_size:
                    raise ValueError(f"weight shape mismatch: {part} {tuple(loaded.shape)}, "
                                     f"expected ({self.intermediate_size}, {self.hidden_size})")
                offset = 0 if part == "gate" else size
                copy_checked(self.w13_weight.data[local, offset : offset + size], loaded.narrow(0, start, size))

    # -- forward -------------------------------------------------------------
    def forward(self, hidden: torch.Tensor, router: Router) -> torch.Tensor:
        counts = None if self.load is None else self.load.layer_counts(self.moe_index)
        topk_weights, topk_ids = router.select(hidden, self.top_k, self.renormalize, counts)
        work = self.dispatcher.dispatch(hidden, topk_weights, topk_ids)
        out = self.experts(work.hidden, work.topk_weights, work.topk_ids)
        return self.dispatcher.combine(out, work)

    def experts(self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """This rank's experts on ``hidden``, weighted and summed over each row's choices."""
        if hidden.is_cuda:
            from radixserve.layers.moe.triton_ops.fused_moe import fused_experts  # Triton: only on CUDA

            return fused_experts(hidden, self.w13_weight, self.w2_weight, topk_weights, topk_ids)
        return moe_forward_native(hidden, self.w13_weight, self.w2_weight, topk_weights, topk_ids)

    def extra_repr(self) -> str:
        lay = self.layout
        return (f"experts={self.num_experts} ({lay.num_local_experts} on this rank from {lay.first_expert}), "
                f"top_k={self.top_k}, hidden={self.hidden_size}, intermediate={self.intermediate_size} "
                f"({self.shard_size} on this rank)")
