"""Which waiting requests run next (policy ordering) and how many fit
(``PrefillAdder`` token budgets). Neither allocates KV itself."""

from __future__ import annotations

import enum
import time
from collections import defaultdict
from typing import Callable

import torch

from radixserve.managers.schedule_batch import Req
from radixserve.mem_cache.allocator import page_aligned, page_floor
from radixserve.mem_cache.base_prefix_cache import BasePrefixCache, MatchResult
from radixserve.mem_cache.radix_cache import RadixCache

# Cache-aware ordering matches every waiting request; past this queue length
# that costs more than it saves (SGLang falls back to fcfs there), so only one
# request per group of prompts sharing their first tokens is matched; past
# this many groups, the queue keeps arrival order.
CACHE_AWARE_MAX_QUEUE = 128
# In-batch prefix sharing: a request whose cached prefix is shorter than
# CHECK and which shares at least DEPRIORITIZE new tokens with a request ahead
# of it in this round waits one round, so that it can reuse that one's KV.
IN_BATCH_PREFIX_CHECK = 32
IN_BATCH_PREFIX_DEPRIORITIZE = 32
# Cap of the per-request output estimate (tokens).
CLIP_MAX_NEW_TOKENS = 4096
# A mixed step sized by the queue (--mixed-chunk-min-size) prefills this share
# of the prompt tokens waiting: a long queue is prefilled within about this
# many steps, and a short one in small steps that stall the riders little.
MIXED_QUEUE_STEPS = 8


def prefix_key(req: Req) -> list[int]:
    """The tokens of ``req`` that may come from the cache. At least one input
    token is left to compute (it yields the next-token logits), and for input
    logprobs the positions that need logits are not taken from cache."""
    limit = len(req.fill_ids) - 1
    if req.return_logprob and req.logprob_start_len >= 0:
        limit = min(limit, max(req.logprob_start_len - 1, 0))
    return req.fill_ids[: max(limit, 0)]


def match_prefix(req: Req, tree_cache: BasePrefixCache, key: list[int] | None = None) -> MatchResult:
    """Set ``req.prefix_indices`` / ``last_node`` from the cache's match of
    ``key`` (``prefix_key(req)`` unless given), which is returned."""
    m = tree_cache.match_prefix(prefix_key(req) if key is None else key, req.lora_id)
    req.prefix_indices, req.last_node = m.device_indices, m.last_node
    return m


class SchedulePolicy:
    """Orders the waiting queue: fcfs, lpm (longest cached prefix first) or
    dfs-weight (walk the radix tree so requests sharing prefixes run
    together), with in-batch prefix sharing for the cache-aware ones."""

    def __init__(self, policy: str, tree_cache: BasePrefixCache):
        self.policy = policy
        self.tree_cache = tree_cache
        self.cache_enabled = isinstance(tree_cache, RadixCache)

    def calc_priority(self, waiting: list[Req]) -> set[int]:
        """Sort ``waiting`` in place (stable). Returns the ``id``s of requests
        that should sit out this round because a request ahead of them
        prefills the same new prefix (in-batch prefix sharing)."""
        if self.policy == "fcfs" or not self.cache_enabled:
            return set()
        if len(waiting) > CACHE_AWARE_MAX_QUEUE:
            return self._by_prefix_group(waiting)
        for req in waiting:
            match_prefix(req, self.tree_cache)
        deprioritized = self._in_batch_prefix_sharing(waiting)
        if self.policy == "lpm":
            waiting.sort(key=lambda r: (id(r) in deprioritized, -len(r.prefix_indices)))
        else:
            order = self._dfs_weight_order(waiting)
            waiting.sort(key=lambda r: (id(r) in deprioritized, order[id(r)]))
        return deprioritized

    def _by_prefix_group(self, waiting: list[Req]) -> set[int]:
        """A long queue, grouped by ``Req.prefix_group``, with only each
        group's oldest request matched: groups with the longest cached
        prefix (on the device or a lower tier) first, each in arrival order.
        In a group with nothing cached, all but the oldest sit out until it
        has cached their prefix (in-batch prefix sharing, a group at a time)."""
        groups: dict[tuple[int, ...], list[Req]] = defaultdict(list)
        for req in waiting:
            groups[req.prefix_group].append(req)
        if len(groups) > CACHE_AWARE_MAX_QUEUE:
            return set()
        rank: dict[int, tuple[int, int]] = {}
        sit_out = set()
        for order, members in enumerate(groups.values()):
            m = match_prefix(members[0], self.tree_cache)
            cached = len(m.device_indices) + m.host_hit_length
            rank.update((id(r), (-cached, order)) for r in members)
            if cached < IN_BATCH_PREFIX_CHECK:
                sit_out.update(id(r) for r in members[1:])
        waiting.sort(key=lambda r: (id(r) in sit_out, rank[id(r)]))
        return sit_out

    def _in_batch_prefix_sharing(self, waiting: list[Req]) -> set[int]:
        shadow = RadixCache(None, None, page_size=1)
        out = set()
        for req in waiting:
            if len(req.prefix_indices) >= IN_BATCH_PREFIX_CHECK:
                continue
            new_tokens = req.fill_ids[len(req.prefix_indices) :]
            if len(shadow.match_prefix(new_tokens, req.lora_id).device_indices) >= IN_BATCH_PREFIX_DEPRIORITIZE:
                out.add(id(req))
            else:
                shadow.insert(new_tokens, torch.zeros(len(new_tokens), dtype=torch.int64), req.lora_id)
        return out

    def _dfs_weight_order(self, waiting: list[Req]) -> dict[int, int]:
        """Rank requests by a DFS over the tree visiting heavier subtrees
        (more waiting requests below) first."""
        by_node: dict[int, list[Req]] = defaultdict(list)
        weight: dict[int, int] = defaultdict(int)
        for req in waiting:
            node = req.last_node
            by_node[id(node)].append(req)
            while node is not None:
                weight[id(node)] += 1
                node = node.parent
        rank: dict[int, int] = {}
        stack = [self.tree_cache.root]
        while stack:
            node = stack.pop()
            for req in by_node.get(id(node), []):
                rank[id(req)] = len(rank)
            children = sorted(node.children.values(), key=lambda c: weight.get(id(c), 0))
            stack.extend(c for c in children if weight.get(id(c), 0))
        return rank


def mixed_step_budget(riders: int, waiting: list[Req], chunked: Req | None, min_size: int, chunk: int) -> int:
    """The tokens (prompts and riders) of a mixed step that follows the queue:
    the riders plus ``1/MIXED_QUEUE_STEPS`` of the prompt tokens still to
    prefill (the chunked request's rest, and each waiting prompt beyond the
    prefix its last match found), at least ``min_size``, at most ``chunk``
    (-1: no cap). Below the knee the queue is short and the steps stay near
    ``min_size``: the riders' token gaps stay near a decode step's; under load
    the steps grow back to the chunk, whose larger matrix products keep up."""
    enough = (chunk if chunk > 0 else 1 << 62) * MIXED_QUEUE_STEPS
    queued = chunked.seqlen - chunked.kv_end if chunked is not None else 0  # seqlen: len(fill_ids), unbuilt
    for req in waiting:
        if queued >= enough:
            break
        queued += req.seqlen - len(req.prefix_indices)
    budget = max(riders + -(-queued // MIXED_QUEUE_STEPS), min_size)
    return min(budget, chunk) if chunk > 0 else budget


class AddResult(enum.Enum):
    CONTINUE = 1  # admitted; try the next one
    NO_TOKEN = 2  # out of KV budget
    OTHER = 3  # another limit (prefill tokens, running requests)
    WAIT = 4  # its prefix is being copied up from a lower cache tier; try the next one


class PrefillAdder:
    """Admits waiting requests into one prefill batch within the KV budget
    (free + evictable, minus the estimated future output of running
    requests), ``max_prefill_tokens`` and ``chunked_prefill_size``.

    ``decode_tokens`` is the number of running requests that will decode in
    the same forward (``--enable-mixed-chunk``): as in SGLang, they take
    their share of the step's token budget, so the prompt tokens shrink by as
    many (down to one page, so that prompts still advance under a running
    batch as large as the chunk)."""

    def __init__(
        self,
        tree_cache: BasePrefixCache,
        available_tokens: int,
        running: list[Req],
        new_token_ratio: float,
        max_prefill_tokens: int,
        chunked_prefill_size: int,
        max_new_reqs: int,
        page_size: int,
        decode_tokens: int = 0,
        can_back: Callable[[int], bool] | None = None,
    ):
        self.tree_cache = tree_cache
        self.can_back = can_back  # KVPools.can_back: the slots taken so far can be allocated now
        self.new_kv = 0  # slots this batch allocates: its prompts' pages and a page each (prepare_for_extend)
        self.page_size = page_size
        self.new_token_ratio = new_token_ratio
        self.rem_total = available_tokens + tree_cache.evictable_size()
        self.rem_total -= sum(self.future_tokens(r) + page_size for r in running)
        self.idle = not running
        self.rem_input = max(max_prefill_tokens - decode_tokens, page_size)
        chunk = chunked_prefill_size if chunked_prefill_size > 0 else 1 << 62
        self.rem_chunk = max(chunk - decode_tokens, page_size)
        self.max_new_reqs = max_new_reqs
        self.can_run: list[Req] = []
        self.new_chunked_req: Req | None = None

    def future_tokens(self, req: Req) -> int:
        left = req.sampling_params.max_new_tokens - len(req.output_ids)
        return int(min(max(left, 0), CLIP_MAX_NEW_TOKENS) * self.new_token_ratio)

    def _pages(self, n: int) -> int:
        return page_aligned(n, self.page_size)

    def add_chunked_req(self, req: Req) -> bool:
        """Continue the request whose prefill was cut last round; False, with
        nothing taken, when its next chunk's KV cannot be allocated now."""
        left = len(req.fill_ids) - req.kv_end  # its previous chunk may still be in flight
        if self.can_back is not None and not self.can_back(self._pages(min(left, self.rem_chunk)) + self.page_size):
            return False
        self._take(req, left, first=False)
        return True

    def add_one_req(self, req: Req) -> AddResult:
        if len(self.can_run) >= self.max_new_reqs or self.rem_input <= 0:
            return AddResult.OTHER
        key = prefix_key(req)
        wait, taken = self.tree_cache.fetch(key, match_prefix(req, self.tree_cache, key), self.rem_total)
        self.rem_total -= taken
        if wait is not None and not wait.finished and time.monotonic() < wait.deadline:
            return AddResult.WAIT
        extend = len(req.fill_ids) - len(req.prefix_indices)
        if self.can_run and extend > self.rem_input and extend <= self.rem_chunk:
            return AddResult.OTHER
        if self.can_run and extend > self.rem_chunk and self.rem_chunk < self.page_size:
            return AddResult.OTHER  # not even one page of this round's chunk budget is left
        # Locking the matched prefix takes it out of the evictable budget.
        evictable = self.tree_cache.evictable_size()
        self.tree_cache.inc_lock_ref(req.last_node)
        budget = self.rem_total - (evictable - self.tree_cache.evictable_size())
        if not self.fits(req, extend, budget) or (
                self.can_back is not None
                and not self.can_back(self.new_kv + self._pages(min(extend, self.rem_chunk)) + self.page_size)):
            self.tree_cache.dec_lock_ref(req.last_node)
            return AddResult.NO_TOKEN
        self.rem_total = budget - self.future_tokens(req) - self.page_size
        req.cache_protected_len = len(req.prefix_indices)
        req.kv_len = len(req.prefix_indices)
        if len(req.output_ids) == 0 and req.retractions == 0:
            req.cached_tokens = len(req.prefix_indices)
        self._take(req, extend, first=True)
        return AddResult.CONTINUE if self.new_chunked_req is None else AddResult.OTHER

    def fits(self, req: Req, new_tokens: int, budget: int | None = None) -> bool:
        """Whether ``new_tokens`` of KV (whole pages), ``req``'s estimated
        output and one page fit ``budget`` (``rem_total`` unless given). An
        idle engine takes one request whose prompt fits even if its output
        estimate does not: retraction keeps it safe, and it cannot starve."""
        budget = self.rem_total if budget is None else budget
        prompt = self._pages(new_tokens) + self.page_size
        return prompt + self.future_tokens(req) <= budget or (self.idle and not self.can_run and prompt <= budget)

    def reserve(self, req: Req, new_tokens: int) -> bool:
        """Count ``req`` with ``new_tokens`` of KV, all of it (no chunk cut),
        against the budget as an admitted request is counted; False, with
        nothing counted, if it does not fit. (A decode server's admission of
        a prompt whose KV another server sends.)"""
        if not self.fits(req, new_tokens):
            return False
        self.rem_total -= self._pages(new_tokens) + self.future_tokens(req) + self.page_size
        self.can_run.append(req)
        return True

    def _take(self, req: Req, extend: int, first: bool) -> None:
        n = min(extend, self.rem_chunk)
        if n < extend:  # cut the prompt: whole pages, at least one
            n = min(max(page_floor(n, self.page_size), self.page_size), extend)
        if n < extend:
            self.new_chunked_req = req
        req.extend_input_len = n
        req.is_chunked = n < extend
        self.new_kv += self._pages(n) + self.page_size
        self.rem_total -= self._pages(n)
        self.rem_input -= n
        self.rem_chunk -= n
        self.can_run.append(req)
