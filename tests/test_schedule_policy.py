"""Model-free unit tests of the scheduling policy (``SchedulePolicy``) and of
admission (``PrefillAdder``) on a real RadixCache over real pools: which
waiting request runs first, which sit out a round, how many fit the KV
budget, and where a long prompt is cut."""

from __future__ import annotations

import pytest

from radixserve.managers.schedule_batch import PREFIX_GROUP_TOKENS, Req
from radixserve.managers.schedule_policy import (
    CACHE_AWARE_MAX_QUEUE,
    IN_BATCH_PREFIX_DEPRIORITIZE,
    MIXED_QUEUE_STEPS,
    AddResult,
    PrefillAdder,
    SchedulePolicy,
    mixed_step_budget,
)
from radixserve.mem_cache import ChunkCache, RadixCache, ReqToTokenPool, TokenToKVPoolAllocator
from radixserve.sampling.sampling_params import SamplingParams
from radixserve.server_args import ServerArgs

VOCAB = 100_000


def seq(n, start):
    return list(range(start, start + n))


class Pools:
    """A RadixCache over a real request-row pool and KV allocator."""

    def __init__(self, size=1024, page_size=1):
        self.page_size = page_size
        self.req_pool = ReqToTokenPool(16, 1024)
        self.alloc = TokenToKVPoolAllocator(size, page_size)
        self.cache = RadixCache(self.req_pool, self.alloc, page_size, "lru")

    def cache_tokens(self, key):
        """Put ``key`` in the cache as a finished request would (evictable)."""
        slots = self.alloc.alloc(len(key))
        present = self.cache.insert(key, slots)
        self.alloc.free(slots[:present])

    def adder(self, running=(), ratio=0.5, max_prefill=10_000, chunk=-1, max_new_reqs=16, available=None,
              decode_tokens=0):
        available = self.alloc.available_size() if available is None else available
        return PrefillAdder(self.cache, available, list(running), ratio, max_prefill, chunk, max_new_reqs,
                            self.page_size, decode_tokens)


def req(ids, max_new_tokens=16, rid=None, output=0):
    sp = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    sp.verify(VOCAB)
    sp.normalize(VOCAB)
    r = Req(rid or f"r{ids[0]}-{len(ids)}", ids, sp)
    r.output_ids = [1] * output
    return r


def rids(reqs):
    return [r.rid for r in reqs]


# -- ordering ---------------------------------------------------------------------
A, B, C = seq(48, 1000), seq(40, 2000), seq(20, 3000)


def test_lpm_runs_the_longest_cached_prefix_first_and_fcfs_keeps_arrival_order():
    p = Pools()
    p.cache_tokens(A)
    waiting = [
        req(seq(10, 5000), rid="none-1"),
        req(A[:16] + seq(5, 6000), rid="hit-16"),
        req(A[:40] + seq(5, 7000), rid="hit-40"),
        req(seq(12, 8000), rid="none-2"),
        req(A + seq(3, 9000), rid="hit-48"),
    ]
    arrival = rids(waiting)
    assert SchedulePolicy("fcfs", p.cache).calc_priority(waiting) == set()
    assert rids(waiting) == arrival
    assert SchedulePolicy("lpm", p.cache).calc_priority(waiting) == set()
    assert rids(waiting) == ["hit-48", "hit-40", "hit-16", "none-1", "none-2"]  # stable among equals
    assert [len(r.prefix_indices) for r in waiting] == [48, 40, 16, 0, 0]


def test_cache_aware_ordering_falls_back_to_fcfs_with_too_many_prompt_groups_or_without_a_radix_cache():
    p = Pools()
    p.cache_tokens(A)
    long_queue = [req(seq(4, 10 * i + 5000), rid=f"u{i}") for i in range(CACHE_AWARE_MAX_QUEUE)]
    long_queue.append(req(A + [1], rid="hit"))
    assert SchedulePolicy("lpm", p.cache).calc_priority(long_queue) == set()
    assert long_queue[-1].rid == "hit", "past CACHE_AWARE_MAX_QUEUE groups the queue keeps arrival order"

    no_cache = ChunkCache(p.req_pool, p.alloc, 1)
    waiting = [req(seq(4, 5000), rid="u"), req(A + [1], rid="hit")]
    assert SchedulePolicy("lpm", no_cache).calc_priority(waiting) == set()
    assert rids(waiting) == ["u", "hit"]


@pytest.mark.parametrize("policy", ["lpm", "dfs-weight"])
def test_a_long_queue_runs_its_cached_prompt_groups_first_and_one_request_of_each_uncached_group(policy):
    """Past CACHE_AWARE_MAX_QUEUE requests, only each group's oldest request
    is matched (a group: prompts sharing their first PREFIX_GROUP_TOKENS).
    The group with the longest cached prefix runs first, each group in
    arrival order; of a group with nothing cached only the oldest request
    runs until it has cached the prefix the others share."""
    p = Pools(size=4096)
    sys_a, sys_b, sys_c = seq(PREFIX_GROUP_TOKENS + 40, 10_000), seq(PREFIX_GROUP_TOKENS + 8, 20_000), seq(80, 30_000)
    p.cache_tokens(sys_a)  # A's system prompt is cached, and it is longer than B's
    p.cache_tokens(sys_b)
    waiting = []
    for i in range(CACHE_AWARE_MAX_QUEUE):  # interleaved arrivals; C's prompt is not cached
        system, name = [(sys_c, "c"), (sys_b, "b"), (sys_a, "a")][i % 3]
        waiting.append(req(system + [i, i], rid=f"{name}{i}"))
    waiting.append(req(seq(5, 40_000), rid="solo"))
    sit_out = SchedulePolicy(policy, p.cache).calc_priority(waiting)
    order = rids(waiting)
    a, b, c = ([r for r in order if r[0] == g] for g in "abc")
    assert order == a + b + ["c0", "solo"] + c[1:]
    assert [int(r[1:]) for r in a] == sorted(int(r[1:]) for r in a), "each group keeps arrival order"
    assert sit_out == {id(r) for r in waiting if r.rid in c[1:]}
    assert len(waiting[0].prefix_indices) == len(sys_a)  # the matched representative


def test_dfs_weight_walks_the_tree_heaviest_subtree_first():
    """The contract of dfs-weight: requests without a cache hit (at the root)
    first, in arrival order; then a depth-first walk of the tree in which a
    node's own requests come before its children's and, among siblings, the
    subtree with more waiting requests comes first."""
    p = Pools()
    p.cache_tokens(A)
    p.cache_tokens(A + C)  # C is a child of A
    p.cache_tokens(B)
    waiting = [
        req(B + [1, 2], rid="B1"),
        req(A + C + [3, 4], rid="AC1"),
        req(B + [5, 6], rid="B2"),
        req(A + [7, 8], rid="A1"),
        req(seq(6, 9000), rid="none"),
        req(A + [9, 10], rid="A2"),
    ]
    assert SchedulePolicy("dfs-weight", p.cache).calc_priority(waiting) == set()
    # A's subtree holds 3 waiting requests, B's 2: A's group runs first, whole.
    assert rids(waiting) == ["none", "A1", "A2", "AC1", "B1", "B2"]


# -- in-batch prefix sharing ------------------------------------------------------------
def test_requests_sharing_a_new_prefix_sit_out_until_the_first_has_cached_it():
    p = Pools()
    shared = seq(40, 4000)  # not in the cache
    first, second, third = (req(shared + [i], rid=f"s{i}") for i in range(3))
    other = req(seq(30, 6000), rid="other")
    short = req(shared[: IN_BATCH_PREFIX_DEPRIORITIZE - 2] + [7, 7], rid="short-share")
    waiting = [first, second, other, third, short]
    sit_out = SchedulePolicy("lpm", p.cache).calc_priority(waiting)
    # Only the ones that share >= IN_BATCH_PREFIX_DEPRIORITIZE new tokens with one ahead sit out.
    assert sit_out == {id(second), id(third)}
    assert rids(waiting) == ["s0", "other", "short-share", "s1", "s2"]
    assert SchedulePolicy("fcfs", p.cache).calc_priority([first, second]) == set()

    # The scheduler prefills s0 alone; its prompt is then cached, and the next
    # round the others hit it instead of computing it again.
    p.cache_tokens(first.origin_input_ids)
    waiting = [second, third]
    assert SchedulePolicy("lpm", p.cache).calc_priority(waiting) == set()
    assert [len(r.prefix_indices) for r in waiting] == [40, 40]


# -- admission against the KV budget ------------------------------------------------------
def test_admission_fits_prompts_plus_estimated_output_in_free_plus_evictable():
    p = Pools(size=256)
    p.cache_tokens(seq(56, 9000))  # evictable: counts as room
    assert p.alloc.available_size() == 200 and p.cache.evictable_size() == 56
    running = [req(seq(8, 100), max_new_tokens=100, output=20)]  # future: 80 * 0.5 = 40, + 1 page
    adder = p.adder(running, ratio=0.5)
    assert adder.rem_total == 256 - 41
    r1 = req(seq(50, 1000), max_new_tokens=60)  # 50 + 30 + 1 = 81 -> 134 left
    r2 = req(seq(100, 2000), max_new_tokens=40)  # 100 + 20 + 1 = 121 -> 13 left
    r3 = req(seq(10, 3000), max_new_tokens=10)  # 10 + 5 + 1 = 16 > 13
    r4 = req(seq(8, 4000), max_new_tokens=8)  # 8 + 4 + 1 = 13: exactly fits
    assert adder.add_one_req(r1) == AddResult.CONTINUE
    assert adder.add_one_req(r2) == AddResult.CONTINUE
    assert adder.add_one_req(r3) == AddResult.NO_TOKEN
    assert adder.add_one_req(r4) == AddResult.CONTINUE
    assert adder.can_run == [r1, r2, r4]
    assert [r.extend_input_len for r in adder.can_run] == [50, 100, 8]
    assert adder.rem_total == 0
    # A higher new_token_ratio (after a retraction) admits fewer.
    careful = p.adder(running, ratio=1.0)
    assert careful.add_one_req(req(seq(50, 1000), max_new_tokens=60)) == AddResult.CONTINUE
    assert careful.add_one_req(req(seq(100, 2000), max_new_tokens=40)) == AddResult.NO_TOKEN


def test_a_cache_hit_is_not_computed_again_and_is_locked_while_admitted():
    p = Pools(size=256)
    prefix = seq(56, 9000)
    p.cache_tokens(prefix)
    hit = req(prefix + seq(10, 1000), max_new_tokens=8)
    adder = p.adder(ratio=0.5)
    assert adder.add_one_req(hit) == AddResult.CONTINUE
    assert (hit.extend_input_len, hit.cached_tokens, hit.cache_protected_len) == (10, 56, 56)
    assert p.cache.protected_size() == 56 and p.cache.evictable_size() == 0
    # The locked prefix can no longer be evicted: it left the budget.
    assert adder.rem_total == 200 - 10 - 4 - 1


def test_a_refused_request_leaves_its_prefix_unlocked():
    p = Pools(size=128)
    prefix = seq(40, 9000)
    p.cache_tokens(prefix)
    running = [req(seq(8, 100), max_new_tokens=150)]  # future 105 + 1
    adder = p.adder(running, ratio=0.7)
    assert adder.add_one_req(req(prefix + seq(30, 1000), max_new_tokens=8)) == AddResult.NO_TOKEN
    assert p.cache.protected_size() == 0 and p.cache.evictable_size() == 40


def test_max_prefill_tokens_and_the_row_limit_stop_admission():
    p = Pools()
    adder = p.adder(max_prefill=100)
    first, second = req(seq(60, 1000)), req(seq(60, 2000))
    assert adder.add_one_req(first) == AddResult.CONTINUE
    assert adder.add_one_req(second) == AddResult.OTHER  # 60 > the 40 prefill tokens left
    assert adder.add_one_req(req(seq(40, 3000))) == AddResult.CONTINUE  # 40 still fit
    assert adder.add_one_req(req(seq(1, 4000))) == AddResult.OTHER  # none left
    assert len(adder.can_run) == 2 and second not in adder.can_run

    # The first request of a round is admitted even beyond max_prefill_tokens.
    alone = p.adder(max_prefill=100)
    assert alone.add_one_req(req(seq(150, 5000))) == AddResult.CONTINUE
    assert alone.can_run[0].extend_input_len == 150

    rows = p.adder(max_new_reqs=2)
    assert [rows.add_one_req(req(seq(4, 6000 + 10 * i))) for i in range(3)] == [
        AddResult.CONTINUE, AddResult.CONTINUE, AddResult.OTHER]
    assert len(rows.can_run) == 2


# -- chunked prefill ------------------------------------------------------------------------------
def test_a_long_prompt_is_cut_at_whole_pages_and_continues_next_round():
    p = Pools(page_size=4)
    long = req(seq(50, 1000), max_new_tokens=8)
    adder = p.adder(chunk=30)
    assert adder.add_one_req(long) == AddResult.OTHER  # the round ends with the chunked request
    assert adder.new_chunked_req is long and long.is_chunked
    assert long.extend_input_len == 28  # 30 rounded down to whole pages of 4
    assert adder.add_one_req(req(seq(4, 2000))) == AddResult.OTHER  # 2 chunk tokens left: under a page

    long.kv_len = 28  # what prepare_for_extend and the forward did
    cont = p.adder(chunk=30)
    cont.add_chunked_req(long)
    assert (long.extend_input_len, long.is_chunked, cont.new_chunked_req) == (22, False, None)
    assert cont.can_run == [long]


def test_decodes_riding_a_mixed_step_take_their_share_of_the_chunk_and_prefill_budget():
    p = Pools(page_size=4)
    running = [req(seq(8, 5000 + 100 * i), output=1) for i in range(10)]
    long = req(seq(100, 1000))
    adder = p.adder(running=running, chunk=40, decode_tokens=len(running))
    adder.add_one_req(long)
    assert long.extend_input_len == 28  # 40 - 10 riders = 30, cut to whole pages
    capped = p.adder(running=running, max_prefill=30, decode_tokens=len(running))
    assert capped.add_one_req(req(seq(16, 2000))) == AddResult.CONTINUE  # 30 - 10 riders: 20 prompt tokens
    assert capped.add_one_req(req(seq(8, 3000))) == AddResult.OTHER  # 4 left
    crowded = p.adder(running=running, chunk=8, decode_tokens=len(running))
    other = req(seq(100, 4000))
    crowded.add_one_req(other)
    assert other.extend_input_len == 4, "more riders than the chunk: the prompt still advances a page a step"


def test_a_mixed_step_sized_by_the_queue_takes_the_riders_and_an_eighth_of_what_waits():
    """--mixed-chunk-min-size: riders + queued prompt tokens / MIXED_QUEUE_STEPS,
    between the minimum and the chunk; a prompt's matched prefix and a chunked
    prompt's computed part are not queued."""
    assert MIXED_QUEUE_STEPS == 8
    assert mixed_step_budget(5, [], None, 64, 512) == 64
    short = [req(seq(100, 1000)), req(seq(60, 2000))]
    assert mixed_step_budget(5, short, None, 16, 512) == 5 + 20
    assert mixed_step_budget(5, short, None, 64, 512) == 64
    short[0].prefix_indices = list(range(36))
    assert mixed_step_budget(5, short, None, 16, 512) == 5 + 16  # 124 / 8, rounded up
    chunked = req(seq(1000, 3000))
    chunked.kv_len, chunked.kv_inflight = 500, 100  # 600 computed or in flight
    assert mixed_step_budget(5, short, chunked, 16, 512) == 5 + 66  # (400 + 124) / 8
    long = [req(seq(1000, 10_000 * i)) for i in range(1, 11)]
    assert mixed_step_budget(5, long, None, 16, 512) == 512
    assert mixed_step_budget(5, long, None, 16, -1) == 5 + 1250
    assert mixed_step_budget(5, short, None, 600, 512) == 512, "the chunk caps the minimum too"


def test_the_queue_sized_mixed_step_needs_mixing_and_a_minimum_of_at_least_zero():
    args = ServerArgs.from_kwargs(model_path="tiny-llama", enable_mixed_chunk=True, mixed_chunk_min_size=512)
    assert args.mixed_chunk_min_size == 512
    for bad in ({"mixed_chunk_min_size": 512}, {"enable_mixed_chunk": True, "mixed_chunk_min_size": -1}):
        with pytest.raises(ValueError, match="mixed_chunk_min_size must be >= 0 and needs --enable-mixed-chunk"):
            ServerArgs.from_kwargs(model_path="tiny-llama", **bad)


def test_every_cut_of_a_chunked_prompt_is_page_aligned():
    p = Pools(page_size=4)
    long = req(seq(50, 1000))
    adder = p.adder(chunk=10)
    adder.add_one_req(long)
    cuts = [long.extend_input_len]
    while long.is_chunked:
        long.kv_len += long.extend_input_len
        nxt = p.adder(chunk=10)
        nxt.add_chunked_req(long)
        cuts.append(long.extend_input_len)
        assert nxt.new_chunked_req is (long if long.is_chunked else None)
    assert cuts == [8, 8, 8, 8, 8, 10]  # the last piece fits the chunk whole: no cut
    ends = [sum(cuts[: i + 1]) for i in range(len(cuts) - 1)]
    assert all(e % 4 == 0 for e in ends) and sum(cuts) == 50


def test_a_chunk_smaller_than_a_page_still_cuts_one_whole_page():
    p = Pools(page_size=4)
    long = req(seq(20, 1000))
    adder = p.adder(chunk=3)
    adder.add_one_req(long)
    assert long.extend_input_len == 4 and adder.new_chunked_req is long


# -- a lone request larger than the budget ---------------------------------------------------------
def test_an_idle_engine_admits_a_lone_prompt_whose_output_estimate_does_not_fit():
    p = Pools(size=100)
    big = req(seq(60, 1000), max_new_tokens=200)  # 60 + 140 + 1 > 100, but the prompt fits
    adder = p.adder(ratio=0.7)
    assert adder.add_one_req(big) == AddResult.CONTINUE
    assert adder.add_one_req(req(seq(4, 2000), max_new_tokens=4)) == AddResult.NO_TOKEN  # not a second one

    # With a request already running, the same request waits.
    busy = p.adder([req(seq(4, 3000), max_new_tokens=1, output=1)], ratio=0.7)
    assert busy.add_one_req(req(seq(60, 1000), max_new_tokens=200)) == AddResult.NO_TOKEN


@pytest.mark.parametrize("chunk", [-1, 16])
def test_a_lone_prompt_larger_than_free_plus_evictable_is_refused_even_when_chunked(chunk):
    p = Pools(size=100)
    p.cache_tokens(seq(20, 9000))
    held = p.alloc.alloc(40)  # KV of something else: 40 free + 20 evictable
    assert held is not None
    adder = p.adder(chunk=chunk)
    big = req(seq(60, 1000), max_new_tokens=1)  # 60 + 1 page > 60
    assert adder.add_one_req(big) == AddResult.NO_TOKEN
    assert adder.can_run == [] and adder.new_chunked_req is None
    assert p.cache.evictable_size() == 20
    # One token shorter fits, whole or as its first chunk.
    fits = p.adder(chunk=chunk)
    result = fits.add_one_req(req(seq(59, 1000), max_new_tokens=1))
    assert result == (AddResult.CONTINUE if chunk < 0 else AddResult.OTHER)
    assert [r.extend_input_len for r in fits.can_run] == [59 if chunk < 0 else 16]
