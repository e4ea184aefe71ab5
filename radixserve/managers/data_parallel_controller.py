"""Which data-parallel replica a request goes to (``--dp-size``,
``--load-balance-method``).

SGLang runs this in a process of its own between the TokenizerManager and
the schedulers; here it is a small object inside the TokenizerManager, which
already sees every request start and finish, so the per-replica counts are
exact and no message takes an extra hop.

- ``round_robin``: replicas in turn.
- ``shortest_queue``: the replica with the fewest requests in flight.
- ``cache_aware`` (modelled on sglang-router's policy, over token ids): each replica has
  an approximate prefix index (``ApproxPrefixIndex``) of the prompts sent to
  it. A request goes to the replica whose index matches the longest share of
  its prompt when that share is at least ``CACHE_THRESHOLD``, otherwise to
  the replica with the smallest index (the most room for a new prefix); when
  the loads are unbalanced it falls back to the shortest queue. The index is
  a hint: a replica's radix cache may have evicted what the index remembers.

On a prefill server of prefill/decode disaggregation (``by_room``), a
request with a bootstrap room goes to replica ``room % dp_size`` whatever
the method: the decode server computes from the room where the KV is
(docs/disaggregation.md). Requests without a room follow the method.
"""

from __future__ import annotations

from collections import OrderedDict

from radixserve.mem_cache.kv_events.events import chain_digests

BLOCK_TOKENS = 16  # the prefix index's unit: a prompt's first k * 16 tokens
CACHE_THRESHOLD = 0.5  # least matched share of a prompt that routes by cache
BALANCE_ABS_THRESHOLD = 32  # loads are unbalanced when max - min exceeds this
BALANCE_REL_THRESHOLD = 1.5  # ... and max exceeds min times this
INDEX_MAX_BLOCKS = 1 << 16  # per replica (about a million tokens); the least recently used go first


def block_keys(token_ids: list[int], block: int = BLOCK_TOKENS) -> list[bytes]:
    """One key per whole block of the prompt, each naming the whole prefix
    up to it: the chained block digests of the KV events."""
    return chain_digests(token_ids, block)


class ApproxPrefixIndex:
    """The prompt prefixes sent to one replica, as chained block keys, LRU-bounded."""

    def __init__(self, max_blocks: int = INDEX_MAX_BLOCKS):
        self.blocks: OrderedDict[bytes, None] = OrderedDict()
        self.max_blocks = max_blocks

    def __len__(self) -> int:
        return len(self.blocks)

    def match(self, keys: list[bytes]) -> int:
        """How many leading blocks of the prompt the replica has seen."""
        n = 0
        while n < len(keys) and keys[n] in self.blocks:
            n += 1
        return n

    def insert(self, keys: list[bytes]) -> None:
        for key in keys:
            self.blocks[key] = None
            self.blocks.move_to_end(key)
        while len(self.blocks) > self.max_blocks:
            self.blocks.popitem(last=False)

    def clear(self) -> None:
        self.blocks.clear()


class DataParallelController:
    """Picks a replica per request and counts each replica's requests in
    flight; with ``by_room`` (a prefill server) a request's bootstrap room
    picks it."""

    def __init__(self, dp_size: int, method: str = "round_robin", by_room: bool = False):
        if method not in ("round_robin", "shortest_queue", "cache_aware"):
            raise ValueError(f"load_balance_method: unknown method {method!r}")
        self.dp_size, self.method, self.by_room = dp_size, method, by_room
        self.in_flight = [0] * dp_size
        self.sent = [0] * dp_size  # requests dispatched to each replica
        self.owner: dict[str, int] = {}  # rid -> replica, while in flight
        self.indexes = [ApproxPrefixIndex() for _ in range(dp_size)] if method == "cache_aware" else []
        self._next = 0

    def dispatch(self, rid: str, input_ids: list[int], bootstrap_room: int | None = None) -> int:
        """The replica ``rid`` goes to; counted in flight until ``finished``."""
        if self.dp_size == 1:
            replica = 0
        elif self.by_room and bootstrap_room is not None:
            replica = bootstrap_room % self.dp_size
            if self.indexes:  # what the replica caches, for the requests without a room
                self.indexes[replica].insert(block_keys(input_ids))
        else:
            replica = self._pick(input_ids)
        self.owner[rid] = replica
        self.in_flight[replica] += 1
        self.sent[replica] += 1
        return replica

    def finished(self, rid: str) -> None:
        replica = self.owner.pop(rid, None)
        if replica is not None:
            self.in_flight[replica] -= 1

    def replica_of(self, rid: str) -> int | None:
        return self.owner.get(rid)

    def cache_flushed(self) -> None:
        for index in self.indexes:
            index.clear()

    def _pick(self, input_ids: list[int]) -> int:
        if self.method == "round_robin":
            replica, self._next = self._next, (self._next + 1) % self.dp_size
            return replica
        if self.method == "shortest_queue":
            return self._shortest()
        keys = block_keys(input_ids)
        if self._unbalanced():
            best = self._shortest()
        else:
            matched = [index.match(keys) for index in self.indexes]
            best = max(range(self.dp_size), key=lambda i: (matched[i], -self.in_flight[i]))
            if not keys or matched[best] / len(keys) < CACHE_THRESHOLD:
                best = min(range(self.dp_size), key=lambda i: (len(self.indexes[i]), self.in_flight[i]))
        self.indexes[best].insert(keys)
        return best

    def _shortest(self) -> int:
        return min(range(self.dp_size), key=lambda i: (self.in_flight[i], self.sent[i]))

    def _unbalanced(self) -> bool:
        low, high = min(self.in_flight), max(self.in_flight)
        return high - low > BALANCE_ABS_THRESHOLD and high > low * BALANCE_REL_THRESHOLD
