"""What the TP group and the pipeline group share: collectives over their
CPU (gloo) group of ``size`` ranks, each a no-op with one rank."""

from __future__ import annotations

import torch
import torch.distributed as dist


class CpuGroupOps:
    """Mixed into a group dataclass with ``size`` and ``cpu_group``."""

    size: int
    cpu_group: dist.ProcessGroup | None

    def agree_min(self, value: int) -> int:
        """The smallest ``value`` over the ranks (a decision every rank must
        share, e.g. the KV pool size when free memory differs per device)."""
        return self.agree_mins([value])[0]

    def agree_mins(self, values: list[int]) -> list[int]:
        """Each of ``values``' smallest over the ranks, in one collective
        (e.g. how many of each queue's asynchronous copies or transfers have
        finished on every rank, so that all ranks act on the same ones)."""
        if self.size == 1:
            return list(values)
        t = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return t.tolist()

    def barrier(self) -> None:
        if self.size > 1:
            dist.barrier(group=self.cpu_group)

    def destroy(self) -> None:
        """Leave torch.distributed: every group of this rank is unusable afterwards."""
        if self.size > 1 and dist.is_initialized():
            dist.destroy_process_group()


class StagePosition:
    """Mixed into a pipeline stage with ``rank`` of ``size``."""

    rank: int
    size: int

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.size - 1
