"""This rank's place in the pipeline (``--pp-size``), on torch.distributed.

The world is ``pp_size * tp_size`` ranks; global rank ``pp_rank * tp_size +
tp_rank``. Stage ``s`` is the TP group of ranks ``s * tp_size ..``, and TP
rank ``r`` of one stage talks point-to-point only to TP rank ``r`` of the
stages before and after it (every TP rank holds the whole hidden state after
its stage's last all-reduce, so each pair passes it on by itself).

Two channels between a pair, each first-in first-out:

- ``device_group`` (NCCL on CUDA, gloo on a CPU): hidden states and residuals;
  the receiver knows their shape from its own copy of the batch;
- ``cpu_group`` (gloo): bytes (a length, then the data): the messages the
  first stage took in, relayed down the pipeline each loop, decisions only
  the first stage can take, and each micro-batch's sampled tokens, sent by the
  last stage to every other.

Sends are asynchronous (``isend``): a stage never waits for the next one to
take what it sent; ``reap`` drops the finished ones. ``PPGroup()`` is the
trivial pipeline of one stage, whose methods return at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from radixserve.distributed.group_ops import CpuGroupOps, StagePosition


@dataclass
class PPGroup(StagePosition, CpuGroupOps):
    """Stage ``rank`` of ``size``, as TP rank ``tp_rank`` of ``tp_size`` (see the module docstring)."""

    rank: int = 0
    size: int = 1
    tp_rank: int = 0
    tp_size: int = 1
    device_group: dist.ProcessGroup | None = None
    cpu_group: dist.ProcessGroup | None = None
    _sends: list = field(default_factory=list, repr=False)  # (work, tensor kept alive until it is sent)

    def __post_init__(self):
        if not 0 <= self.rank < self.size:
            raise ValueError(f"pp_rank must be in [0, {self.size}), got {self.rank}")
        if self.size > 1 and (self.device_group is None or self.cpu_group is None):
            raise ValueError("a pipeline of several stages needs its process groups (init_model_parallel)")

    def peer(self, stage: int) -> int:
        """The global rank of this TP rank's counterpart on ``stage``."""
        return stage * self.tp_size + self.tp_rank

    # -- tensors (hidden states) ------------------------------------------------------------
    def send_tensor(self, tensor: torch.Tensor, stage: int) -> None:
        tensor = tensor.contiguous()
        self._sends.append((dist.isend(tensor, self.peer(stage), group=self.device_group), tensor))
        self.reap()

    def recv_tensor(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, stage: int) -> torch.Tensor:
        out = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(out, self.peer(stage), group=self.device_group)
        return out

    # -- bytes (messages, decisions, sampled tokens) -------------------------------------------
    def send_bytes(self, data: bytes, stage: int) -> None:
        header = torch.tensor([len(data)], dtype=torch.int64)
        self._sends.append((dist.isend(header, self.peer(stage), group=self.cpu_group), header))
        if data:
            buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            self._sends.append((dist.isend(buf, self.peer(stage), group=self.cpu_group), buf))
        self.reap()

    def recv_bytes(self, stage: int) -> bytes:
        header = torch.empty(1, dtype=torch.int64)
        dist.recv(header, self.peer(stage), group=self.cpu_group)
        n = int(header.item())
        if n == 0:
            return b""
        buf = torch.empty(n, dtype=torch.uint8)
        dist.recv(buf, self.peer(stage), group=self.cpu_group)
        return buf.numpy().tobytes()

    def relay(self, data: bytes | None) -> bytes:
        """The first stage's ``data`` on every stage, in pipeline order: the
        first stage passes it on (others pass None), every other stage takes
        it from the one before and passes it on. Only the stages after this
        one wait for it."""
        if self.size == 1:
            return data
        if not self.is_first:
            data = self.recv_bytes(self.rank - 1)
        if not self.is_last:
            self.send_bytes(data, self.rank + 1)
        return data

    def reap(self) -> None:
        """Forget the sends that have completed."""
        self._sends = [(w, t) for w, t in self._sends if not w.is_completed()]

    def flush(self) -> None:
        """Wait until every send has been taken."""
        for work, _ in self._sends:
            work.wait()
        self._sends = []
