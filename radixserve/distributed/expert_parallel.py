"""How a mixture of experts divides over the tensor-parallel ranks (SGLang's
``--ep-size`` and ``--moe-a2a-backend``; docs/moe.md).

With ``tp_size`` ranks and ``ep_size`` expert-parallel ranks, the TP group is
``ep_size`` groups of ``moe_tp_size = tp_size // ep_size`` consecutive ranks:
rank ``r`` holds experts ``ep_rank * E_local .. (ep_rank + 1) * E_local - 1``
(``ep_rank = r // moe_tp_size``, ``E_local = E / ep_size``), and of each its
``moe_tp_rank = r % moe_tp_size``-th slice of the intermediate dimension, as
a dense MLP is sharded. ``ep_size == 1`` shards every expert over all ranks;
``ep_size == tp_size`` gives each rank whole experts. Attention stays tensor
parallel either way.
"""

from __future__ import annotations

from dataclasses import dataclass

from radixserve.distributed.expert_flags import check_expert_parallel
from radixserve.distributed.partition import divide
from radixserve.distributed.tp_group import TPGroup


@dataclass(frozen=True)
class ExpertLayout:
    """The experts one rank holds (see the module docstring)."""

    num_experts: int  # in the model
    ep_size: int
    ep_rank: int
    moe_tp_size: int
    moe_tp_rank: int

    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.ep_size

    @property
    def first_expert(self) -> int:
        return self.ep_rank * self.num_local_experts


def expert_layout(num_experts: int, tp_size: int = 1, tp_rank: int = 0, ep_size: int = 1) -> ExpertLayout:
    """Rank ``tp_rank``'s share of ``num_experts``; a ValueError naming the flag when they do not divide."""
    moe_tp_size = divide(tp_size, ep_size, "tp_size")
    if num_experts % ep_size:
        raise ValueError(f"ep_size {ep_size} must divide the model's {num_experts} experts (--ep-size)")
    return ExpertLayout(num_experts, ep_size, tp_rank // moe_tp_size, moe_tp_size, tp_rank % moe_tp_size)


@dataclass(frozen=True)
class MoEParallel:
    """What a MoE layer needs to know of the ranks: the TP group (every
    collective runs in it, since ``all_to_all`` takes ``ep_size == tp_size``),
    ``--ep-size`` and ``--moe-a2a-backend``."""

    tp_group: TPGroup = TPGroup()
    ep_size: int = 1
    a2a_backend: str = "none"

    def __post_init__(self):
        check_expert_parallel(self.tp_group.size, self.ep_size, self.a2a_backend)

    def layout(self, num_experts: int) -> ExpertLayout:
        return expert_layout(num_experts, self.tp_group.size, self.tp_group.rank, self.ep_size)
