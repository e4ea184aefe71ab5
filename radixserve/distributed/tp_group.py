"""This rank's tensor-parallel group, on torch.distributed.

A :class:`TPGroup` is passed to the model and its layers (there is no
module-global group). It holds two process groups over the same ranks:

- ``device_group``: the collectives of the forward pass (NCCL on CUDA, which
  CUDA graphs capture; gloo on CPU);
- ``cpu_group``: gloo, for host messages (the scheduler's broadcasts, agreeing
  on a number), so they never queue behind device work.

``TPGroup()`` is the trivial group of one rank: every method returns at once,
no collective runs and torch.distributed is never initialised. The torch
world is the TP group itself: its ranks are the TP ranks; with pipeline
stages (``--pp-size``), the ranks of every stage, and each stage's TP group
a subgroup of it (``pp_group.py``).

Where the ranks listen: rank 0's rendezvous store at the ``tcp://HOST:PORT``
given, and nowhere else (``tcp_store.py``); with every rank on one host, the
gloo groups' sockets at that same ``HOST`` too (gloo's default is the address
this machine's name resolves to, which other machines may reach). Across
hosts, or with ``GLOO_SOCKET_IFNAME`` set, gloo chooses as it does by default.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from radixserve.distributed.group_ops import CpuGroupOps
from radixserve.distributed.pp_group import PPGroup
from radixserve.distributed.tcp_store import listening_store

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 600.0  # a collective (or the start-up rendezvous) fails after this long
_JOINED = "radixserve/joined"  # in the rendezvous store: how many ranks but rank 0 reached it
_JOIN_POLL_S = 0.05  # how often rank 0 looks at that count, and asks why a rank may never come
# Newer torch renamed all_gather_into_tensor to all_gather_single; the GPU hosts may have either.
_all_gather_single = getattr(dist, "all_gather_single", None) or getattr(dist, "all_gather_into_tensor", None)


class RankStartFailed(RuntimeError):
    """Another rank will never join: its process ended while it started (``init_tp_group``'s ``rank_failure``)."""


@dataclass(frozen=True)
class TPGroup(CpuGroupOps):
    """Rank ``rank`` of ``size`` tensor-parallel ranks (see the module docstring)."""

    rank: int = 0
    size: int = 1
    device_group: dist.ProcessGroup | None = None
    cpu_group: dist.ProcessGroup | None = None

    def __post_init__(self):
        if not 0 <= self.rank < self.size:
            raise ValueError(f"tp_rank must be in [0, {self.size}), got {self.rank}")
        if self.size > 1 and (self.device_group is None or self.cpu_group is None):
            raise ValueError("a TP group of several ranks needs its device and CPU process groups (init_tp_group)")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place; returns ``x``."""
        if self.size > 1:
            dist.all_reduce(x, group=self.device_group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """The ranks' ``x`` (same shape on each) concatenated along ``dim``, in rank order."""
        if self.size == 1:
            return x
        x = x.contiguous()
        gathered = x.new_empty((self.size * x.shape[0], *x.shape[1:]))  # rank-major along dim 0
        _all_gather_single(gathered, x, group=self.device_group)
        return torch.cat(gathered.chunk(self.size), dim=dim)

    def broadcast_bytes(self, data: bytes | None, src: int = 0) -> bytes:
        """Rank ``src``'s ``data`` on every rank, over the CPU group (others pass None)."""
        if self.size == 1:
            return data
        length = torch.tensor([len(data) if self.rank == src else 0], dtype=torch.int64)
        dist.broadcast(length, src=src, group=self.cpu_group)
        n = int(length.item())
        if n == 0:
            return b""
        if self.rank == src:
            buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        else:
            buf = torch.empty(n, dtype=torch.uint8)
        dist.broadcast(buf, src=src, group=self.cpu_group)
        return buf.numpy().tobytes()


def check_tp_devices(tp_size: int, device: str | torch.device, nnodes: int = 1) -> None:
    """A ValueError when the ``tp_size / nnodes`` CUDA ranks of this host
    cannot each have a device of their own."""
    device = torch.device(device)
    if device.type != "cuda" or tp_size == 1:
        return
    if nnodes < 1 or tp_size % nnodes:
        raise ValueError(f"tp_size {tp_size} must be a multiple of nnodes {nnodes}")
    here, visible = tp_size // nnodes, torch.cuda.device_count()
    if here > visible:
        raise ValueError(f"tp_size {tp_size} needs {here} CUDA devices on this host (one per rank); {visible} visible")
    if device.index is not None and device.index >= visible:
        raise ValueError(f"device {device} does not exist: {visible} CUDA devices are visible")


def init_tp_group(
    tp_rank: int,
    tp_size: int,
    device: str | torch.device,
    init_method: str | None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    nnodes: int = 1,
    rank_failure: Callable[[], str | None] | None = None,
) -> TPGroup:
    """Join the ``tp_size`` ranks rendezvousing at ``init_method`` (e.g.
    ``tcp://127.0.0.1:29500``) as rank ``tp_rank`` and build the groups:
    :func:`init_model_parallel` with one pipeline stage."""
    return init_model_parallel(tp_rank, tp_size, device, init_method, timeout_s, nnodes, rank_failure)[0]


def init_model_parallel(
    tp_rank: int,
    tp_size: int,
    device: str | torch.device,
    init_method: str | None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    nnodes: int = 1,
    rank_failure: Callable[[], str | None] | None = None,
    pp_rank: int = 0,
    pp_size: int = 1,
) -> tuple[TPGroup, PPGroup]:
    """Join the ``tp_size * pp_size`` ranks rendezvousing at ``init_method``
    as TP rank ``tp_rank`` of pipeline stage ``pp_rank`` (global rank
    ``pp_rank * tp_size + tp_rank``): this rank's TP group (its stage's
    ranks) and its place in the pipeline (``pp_group.py``). ``nnodes``: the
    hosts the ranks span (one: every socket at the rendezvous host, see the
    module docstring).

    Every rank calls this once, in its own process. A rank that does not
    arrive, or an address nobody listens on, makes the others fail within
    about ``timeout_s`` (a RuntimeError naming the address) instead of
    waiting forever; later collectives fail after ``timeout_s`` as well. With
    a single rank nothing is initialised and the trivial groups are returned.
    Rank 0, while it waits at a ``tcp://`` rendezvous for the others to reach
    it, asks ``rank_failure`` (if given) why one of them never will; an
    answer ends the wait at once with :class:`RankStartFailed` saying it.
    """
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank must be in [0, {tp_size}), got {tp_rank}")
    if not 0 <= pp_rank < pp_size:
        raise ValueError(f"pp_rank must be in [0, {pp_size}), got {pp_rank}")
    world, rank = tp_size * pp_size, pp_rank * tp_size + tp_rank
    if world == 1:
        return TPGroup(), PPGroup()
    if not init_method:
        raise ValueError(f"tp_size {tp_size}" + (f" x pp_size {pp_size}" if pp_size > 1 else "")
                         + " needs an init method (e.g. tcp://127.0.0.1:PORT) for the ranks to meet")
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialised in this process: one rank per process")
    device = torch.device(device)
    timeout = timedelta(seconds=timeout_s)
    cuda = device.type == "cuda"
    extra = {}
    if cuda:
        device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
        torch.cuda.set_device(device)
        extra["device_id"] = device  # creates the NCCL communicator now, not at the first (captured) collective
    try:
        # The ranks meet in a store made first: if that fails, init_process_group
        # has not run, and a later group in this process is named as in a fresh one.
        store = _rendezvous_store(init_method, rank, world, timeout, rank_failure)
        gloo_host = _gloo_host(init_method, nnodes)
        device_backend = ("nccl", None) if cuda else _gloo_backend(gloo_host)
        dist.init_process_group(
            device_backend[0], world_size=world, rank=rank, timeout=timeout, pg_options=device_backend[1],
            **({"store": store} if store is not None else {"init_method": init_method}), **extra,
        )
        backend, pg_options = _gloo_backend(gloo_host)
        cpu_world = dist.new_group(backend=backend, pg_options=pg_options, timeout=timeout)
        tp_device, tp_cpu = dist.group.WORLD, cpu_world
        if pp_size > 1:  # every rank builds every stage's groups, in the same order
            for stage in range(pp_size):
                ranks = list(range(stage * tp_size, (stage + 1) * tp_size))
                groups = tuple(dist.new_group(ranks, backend=b, pg_options=o, timeout=timeout)
                               for b, o in (device_backend, (backend, pg_options)))
                if stage == pp_rank:
                    tp_device, tp_cpu = groups
    except RankStartFailed:  # the address is not to blame
        raise
    except (RuntimeError, OSError) as e:  # torch's DistError family, or rank 0 unable to listen at the address
        if dist.is_initialized():
            dist.destroy_process_group()
        raise RuntimeError(
            f"rank {rank} of {world} (TP rank {tp_rank} of {tp_size}, pipeline stage {pp_rank} of {pp_size}) "
            f"could not join the group at {init_method} within {timeout_s:g} s (a rank did not start, or the "
            f"address is unreachable): {e}"
        ) from e
    logger.info("rank %d of %d (TP %d of %d, stage %d of %d) joined at %s (%s)", rank, world, tp_rank, tp_size,
                pp_rank, pp_size, init_method, dist.get_backend())
    tp = TPGroup(tp_rank, tp_size, tp_device, tp_cpu) if tp_size > 1 else TPGroup()
    pp = PPGroup(pp_rank, pp_size, tp_rank, tp_size, dist.group.WORLD, cpu_world) if pp_size > 1 else PPGroup()
    return tp, pp


def _tcp_address(init_method: str) -> tuple[str, int] | None:
    """HOST and PORT of ``tcp://HOST:PORT``; None for another kind of init method."""
    if not init_method.startswith("tcp://"):
        return None
    host, _, port = init_method.removeprefix("tcp://").rpartition(":")
    return host, int(port)


def _rendezvous_store(init_method: str, rank: int, world: int, timeout: timedelta,
                      rank_failure: Callable[[], str | None] | None = None) -> dist.Store | None:
    """A TCP store at ``tcp://HOST:PORT`` that every rank has joined (rank 0
    hosts it, listening at HOST only); None for another kind of init method."""
    address = _tcp_address(init_method)
    if address is None:
        return None
    if rank != 0:
        store = dist.TCPStore(*address, world, is_master=False, timeout=timeout, wait_for_workers=True)
        store.add(_JOINED, 1)
        return store
    # Not torch's wait_for_workers: it blocks in C++ for the whole timeout, whatever became of the ranks.
    store = listening_store(*address, timeout, world)
    deadline = time.monotonic() + timeout.total_seconds()
    while (joined := store.add(_JOINED, 0)) < world - 1:
        failure = rank_failure() if rank_failure is not None else None
        if failure is not None:
            raise RankStartFailed(failure)
        if time.monotonic() > deadline:
            raise RuntimeError(f"{joined} of the other {world - 1} ranks reached it")
        time.sleep(_JOIN_POLL_S)
    return store


def _gloo_host(init_method: str, nnodes: int) -> str | None:
    """Where this rank's gloo sockets listen: the rendezvous host when every
    rank is on this host; None (gloo's default) across hosts, for another kind
    of init method, or when ``GLOO_SOCKET_IFNAME`` names the interface."""
    address = _tcp_address(init_method)
    if nnodes > 1 or address is None or os.environ.get("GLOO_SOCKET_IFNAME"):
        return None
    return address[0]


_GLOO_AT_HOST = "radixserve_gloo"  # gloo on the devices its pg_options name


def _create_gloo_at_host(backend_opts, pg_options) -> dist.ProcessGroupGloo:
    """torch's creator of a :data:`_GLOO_AT_HOST` group (a backend plugin's
    extended API): gloo over the devices of ``pg_options``."""
    opts = dist.ProcessGroupGloo._Options()
    opts._devices = pg_options._devices
    opts._timeout = backend_opts.timeout
    return dist.ProcessGroupGloo(backend_opts.store, backend_opts.group_rank, backend_opts.group_size, opts)


def _gloo_backend(host: str | None) -> tuple[str, object]:
    """The backend and options of a gloo group whose sockets listen at
    ``host`` (gloo's default when None). torch builds its own gloo groups on
    the default device whatever options it is given, so a group at a host
    is built by a backend plugin (registering it again changes nothing)."""
    if host is None:
        return "gloo", None
    dist.Backend.register_backend(_GLOO_AT_HOST, _create_gloo_at_host, extended_api=True, devices=["cpu", "cuda"])
    opts = dist.ProcessGroupGloo._Options()
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    return _GLOO_AT_HOST, opts
