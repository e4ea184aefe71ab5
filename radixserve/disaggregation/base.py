"""The interface every KV transfer backend implements, in SGLang's shape.

A prefill engine and a decode engine each own a KV pool. For one request (one
``bootstrap_room``) the prefill side's :class:`BaseKVSender` copies the KV of
the request's pages, and a little aux data (the first sampled token, its
logprob and its top alternatives), into the pages the decode side's
:class:`BaseKVReceiver` reserved.
A :class:`BaseKVManager` per engine rank holds what the senders or receivers of
that rank share (connections, threads); a :class:`BaseKVBootstrapServer`, run
by the prefill server, tells decode ranks where each prefill rank listens.

Both halves are driven by polling from the scheduler loop: ``poll()`` never
blocks and walks through :class:`KVPoll`. Indices are *page* indices into the
pool (page ``p`` covers slots ``[p * page_size, (p + 1) * page_size)``), as in
SGLang's ``kv_to_page_indices``.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch

from radixserve.disaggregation.head_map import rank_kv_heads

MAX_BOOTSTRAP_ROOM = 2**63  # rooms are 63-bit ints, picked at random by the router


class KVPoll(enum.IntEnum):
    """Where one request's transfer stands (SGLang's states and values)."""

    Failed = 0
    Bootstrapping = 1  # the two halves have not found each other yet
    WaitingForInput = 2  # paired; the sender waits for send(), the receiver for init() or the data
    Transferring = 3
    Success = 4


class DisaggregationMode(str, enum.Enum):
    """The role of an engine (SGLang's ``--disaggregation-mode``)."""

    NULL = "null"
    PREFILL = "prefill"
    DECODE = "decode"


class KVTransferError(Exception):
    """A transfer that cannot complete: a peer that died or never came, a
    timeout, a bootstrap server that does not answer, mismatched layouts."""

    def __init__(self, reason: str, bootstrap_room: int | None = None):
        super().__init__(reason)
        self.bootstrap_room = bootstrap_room
        self.reason = reason

    def __str__(self) -> str:
        if self.bootstrap_room is None:
            return self.reason
        return f"KV transfer of bootstrap room {self.bootstrap_room} failed: {self.reason}"


def check_room(room: int) -> int:
    """``room`` as an int, or ValueError when it is not a 63-bit room."""
    if isinstance(room, bool) or not isinstance(room, int) or not 0 <= room < MAX_BOOTSTRAP_ROOM:
        raise ValueError(f"bootstrap_room must be an int in [0, 2**63), got {room!r}")
    return room


@dataclass
class KVArgs:
    """What a KV manager needs to know about its engine rank's KV pool.

    ``k_buffers[l]`` and ``v_buffers[l]`` are layer ``l``'s buffers, shaped
    ``[num_slots, heads, dim]`` (the pool's ``k_buffer``/``v_buffer`` lists):
    this TP rank's heads of the model's ``num_kv_heads`` (None: this rank's
    heads times ``tp_size``, no replication), split as the model's layers
    split them (``head_map.rank_kv_heads``). The manager reads and writes
    them in place. ``aux_buffers`` are indexed by a request's ``aux_index``
    on dim 0 (see :class:`MetadataBuffers`). ``transfer_host``/``transfer_port``
    is where this rank can be reached by its peers (on the prefill side it
    listens there; port 0 picks a free one). ``dp_rank`` of ``dp_size``: the
    server's data-parallel replica this rank belongs to; a prefill rank
    registers under it (its *dp group*), and a room's KV is on group
    ``room % dp_size``.
    """

    k_buffers: list[torch.Tensor]
    v_buffers: list[torch.Tensor]
    page_size: int = 1
    aux_buffers: list[torch.Tensor] = field(default_factory=list)
    tp_rank: int = 0
    tp_size: int = 1
    transfer_host: str = "127.0.0.1"
    transfer_port: int = 0
    num_kv_heads: int | None = None
    dp_rank: int = 0
    dp_size: int = 1

    def __post_init__(self):
        bufs = self.kv_buffers
        if not self.k_buffers or len(self.k_buffers) != len(self.v_buffers):
            raise ValueError(f"need one K and one V buffer per layer, got {len(self.k_buffers)} K and {len(self.v_buffers)} V")
        if len({(b.shape[0], b.dtype, b.device) for b in bufs}) != 1 or not all(b.is_contiguous() for b in bufs):
            raise ValueError("K and V buffers must be contiguous, with one slot count, dtype and device")
        k_shapes, v_shapes = {b.shape[1:] for b in self.k_buffers}, {b.shape[1:] for b in self.v_buffers}
        if any(b.dim() != 3 for b in bufs) or len(k_shapes) != 1 or len(v_shapes) != 1 \
                or k_shapes.pop()[0] != v_shapes.pop()[0]:
            raise ValueError("K and V buffers must be [slots, heads, dim]: one shape for every K, one for every V, "
                             "the same heads in both")
        if self.page_size < 1 or self.num_slots % self.page_size:
            raise ValueError(f"page_size {self.page_size} must divide the {self.num_slots} slots")
        if not all(b.is_contiguous() for b in self.aux_buffers):
            raise ValueError("aux buffers must be contiguous")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank must be in [0, {self.tp_size}), got {self.tp_rank}")
        if not 0 <= self.dp_rank < self.dp_size:
            raise ValueError(f"dp_rank must be in [0, {self.dp_size}), got {self.dp_rank}")
        if self.num_kv_heads is None:
            self.num_kv_heads = self.local_kv_heads * self.tp_size
        held = len(rank_kv_heads(self.num_kv_heads, self.tp_size, self.tp_rank))
        if held != self.local_kv_heads:
            raise ValueError(f"TP rank {self.tp_rank} of {self.tp_size} holds {held} of {self.num_kv_heads} KV heads, "
                             f"but its buffers have {self.local_kv_heads}")

    @property
    def kv_buffers(self) -> list[torch.Tensor]:
        return [*self.k_buffers, *self.v_buffers]

    @property
    def engine_rank(self) -> int:
        """The rank this one registers as, or is, to its peers (its TP rank)."""
        return self.tp_rank

    @property
    def local_kv_heads(self) -> int:
        return self.k_buffers[0].shape[1]

    @property
    def num_slots(self) -> int:
        return self.k_buffers[0].shape[0]

    @property
    def num_pages(self) -> int:
        return self.num_slots // self.page_size

    @property
    def device(self) -> torch.device:
        return self.k_buffers[0].device

    def layout(self) -> dict:
        """What both sides must agree on for their pages to be interchangeable
        (head by head: the tp sizes may differ)."""
        return {
            "dtype": str(self.k_buffers[0].dtype),
            "page_size": self.page_size,
            "num_layers": len(self.k_buffers),
            "num_kv_heads": self.num_kv_heads,
            "k_head_dim": self.k_buffers[0].shape[2],
            "v_head_dim": self.v_buffers[0].shape[2],
            "aux_row_bytes": [b[0].numel() * b.element_size() for b in self.aux_buffers],
        }


def layout_mismatch(prefill: dict, decode: dict) -> str | None:
    """How a prefill server's ``KVArgs.layout()`` differs from a decode
    server's, in words, or None when the decode server can receive its KV."""
    diffs = [f"{key} {prefill.get(key)} on the prefill server, {value} on the decode server"
             for key, value in decode.items() if prefill.get(key) != value]
    return "; ".join(diffs) or None


class MetadataBuffers:
    """The aux data of requests in flight (SGLang's MetadataBuffers, reduced
    to what decode needs to continue): row ``aux_index`` holds the first
    output token id, its logprob, and its top alternatives, up to
    ``max_top_logprobs_num`` (logprob, token id) pairs in fixed-width columns
    with their count. Its ``buffers`` go in ``KVArgs.aux_buffers``, so the
    width is part of the layout both sides must agree on."""

    def __init__(self, size: int, max_top_logprobs_num: int):
        self.max_top_logprobs_num = max_top_logprobs_num
        self.output_ids = torch.zeros(size, dtype=torch.int64)
        self.output_logprobs = torch.zeros(size, dtype=torch.float32)
        self.output_top_logprobs_num = torch.zeros(size, dtype=torch.int32)
        self.output_top_logprobs_val = torch.zeros((size, max_top_logprobs_num), dtype=torch.float32)
        self.output_top_logprobs_idx = torch.zeros((size, max_top_logprobs_num), dtype=torch.int32)

    @property
    def buffers(self) -> list[torch.Tensor]:
        return [self.output_ids, self.output_logprobs, self.output_top_logprobs_num, self.output_top_logprobs_val,
                self.output_top_logprobs_idx]

    def set(self, index: int, token_id: int, logprob: float, top: list[tuple[float, int]] = ()) -> None:
        """Row ``index``: the first token, its logprob and its top
        alternatives; ValueError when there are more than the columns hold."""
        if len(top) > self.max_top_logprobs_num:
            raise ValueError(f"{len(top)} top logprobs do not fit the {self.max_top_logprobs_num} columns")
        self.output_ids[index] = token_id
        self.output_logprobs[index] = logprob
        self.output_top_logprobs_num[index] = len(top)
        if top:
            vals, ids = zip(*top)
            self.output_top_logprobs_val[index, : len(top)] = torch.tensor(vals, dtype=torch.float32)
            self.output_top_logprobs_idx[index, : len(top)] = torch.tensor(ids, dtype=torch.int32)

    def get(self, index: int) -> tuple[int, float, list[tuple[float, int]]]:
        """What :meth:`set` wrote in row ``index``."""
        n = int(self.output_top_logprobs_num[index])
        vals, ids = self.output_top_logprobs_val[index, :n].tolist(), self.output_top_logprobs_idx[index, :n].tolist()
        return int(self.output_ids[index]), float(self.output_logprobs[index]), list(zip(vals, ids))


@dataclass(frozen=True)
class KVTransferConfig:
    """Time limits and message size of a transfer backend (seconds, bytes).

    - ``bootstrap_timeout_s``: a sender whose decode half has not registered
      (sent its page indices) by then fails (SGLang's bootstrap timeout); so
      does a receiver not paired with its prefill rank by then, or paired
      but not given its pages (``init()``), as when a full pool holds it back;
    - ``waiting_timeout_s``: a receiver whose KV has not arrived this long after
      ``init()`` fails (SGLang's waiting timeout);
    - ``transfer_timeout_s``: data announced or sent but not delivered by then
      fails the transfer and drops the pair of ranks it was on;
    - ``connect_timeout_s``: forming a pair (waiting for the prefill rank to
      register, the store connection, the group set-up);
    - ``http_timeout_s``: each request to the bootstrap server;
    - ``max_message_bytes``: a request's pages go in messages of at most this
      size (at least one page each).
    """

    bootstrap_timeout_s: float = 300.0
    waiting_timeout_s: float = 300.0
    transfer_timeout_s: float = 60.0
    connect_timeout_s: float = 30.0
    http_timeout_s: float = 5.0
    max_message_bytes: int = 256 << 20

    def __post_init__(self):
        for name in ("bootstrap_timeout_s", "waiting_timeout_s", "transfer_timeout_s", "connect_timeout_s", "http_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.max_message_bytes < 1:
            raise ValueError(f"max_message_bytes must be positive, got {self.max_message_bytes}")


class BaseKVManager(ABC):
    """One per engine rank and role: the shared state of its senders or receivers."""

    @abstractmethod
    def __init__(self, args: KVArgs, mode: DisaggregationMode, config: KVTransferConfig): ...

    @abstractmethod
    def register_to_bootstrap(self) -> None:
        """Prefill side: tell the bootstrap server where this rank listens."""

    @abstractmethod
    def close(self) -> None:
        """Stop this manager's threads and connections; its transfers fail."""


class _KVHalf(ABC):
    """What a request's two halves of a transfer share."""

    @abstractmethod
    def __init__(self, mgr: BaseKVManager, bootstrap_addr: str, bootstrap_room: int): ...

    @abstractmethod
    def poll(self) -> KVPoll:
        """Where the transfer stands; never blocks."""

    @abstractmethod
    def failure_exception(self) -> None:
        """Raise the :class:`KVTransferError` that made ``poll()`` return Failed."""

    def abort(self, reason: str | None = None) -> None:
        """Give the transfer up (a client abort, or ``reason``, e.g. another
        TP rank's half failed); ``poll()`` then returns Failed and the other
        side is told. A half already Success or Failed stays as it is."""

    def clear(self) -> None:
        """Forget this room once the caller is done with it."""


class BaseKVSender(_KVHalf):
    """The prefill half of one request's transfer."""

    @abstractmethod
    def init(self, num_kv_indices: int, aux_index: int | None = None) -> None:
        """The number of pages that ``send`` will send, and the aux row to send with them."""

    @abstractmethod
    def send(self, kv_indices: torch.Tensor) -> None:
        """Send the KV of these pages (and the aux row). Call once, after
        ``poll()`` returned WaitingForInput. The pool is not read after it returns."""


class BaseKVReceiver(_KVHalf):
    """The decode half of one request's transfer."""

    @abstractmethod
    def init(self, kv_indices: torch.Tensor, aux_index: int | None = None) -> None:
        """The pages reserved for the request's KV and the aux row for its
        aux data; the prefill side is told to send there."""

    @abstractmethod
    def poll(self) -> KVPoll:
        """Where the transfer stands; never blocks. Success means the KV and
        aux data are in place. After Failed the pool is never written again
        for this request, so its pages may be freed at once."""


class BaseKVBootstrapServer(ABC):
    """The prefill server's directory of prefill ranks, on
    ``--disaggregation-bootstrap-port``."""

    @abstractmethod
    def __init__(self, host: str, port: int): ...

    @abstractmethod
    def close(self) -> None:
        """Stop serving and release the port."""
