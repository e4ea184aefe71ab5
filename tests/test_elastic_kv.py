"""The elastic KV pool (``--enable-elastic-kv``): physical memory mapped in
pages as slots are handed out and given back when every slot in a page is
free (kvcached's rule), on the CPU (mmap + madvise). Checked by a Hypothesis
state machine over requests, the radix cache, eviction, refused maps and
rebalancing, with a marker written into every slot handed out (a page
unmapped under live data would read zeros); by greedy outputs with the flag
on and off (and under tensor parallelism, the hierarchical cache, and maps
the machine refuses); and by a server's resident memory across a burst."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import httpx
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, rule

import radixserve
from mem_harness import Harness, RequestRules
from radixserve.mem_cache.elastic_allocator import ElasticTokenToKVPoolAllocator, elastic_page_slots
from radixserve.mem_cache.elastic_registry import ElasticRegistry
from radixserve.mem_cache.page_mapper import PageMapper
from radixserve.mem_cache.virtual_memory import CpuArena
from server_harness import Prestarted, selected

TINY = dict(model_path="tiny-llama", load_format="dummy", device="cpu", dtype="float32", disable_tqdm=True,
            check_invariants=True, dist_timeout=60)
ELASTIC = dict(enable_elastic_kv=True, elastic_kv_page_mb=0.004, elastic_kv_min_reserve_pages=0,
               elastic_kv_max_reserve_pages=1)


def test_an_elastic_page_is_whole_slots_whole_kv_pages_and_whole_granules():
    for slot_bytes, page_size, gran, want in [([512], 1, 2 << 20, 2 << 20), ([768], 16, 4096, 2 << 20),
                                              ([4096, 2048], 64, 2 << 20, 2 << 20), ([96], 3, 4096, 1)]:
        slots = elastic_page_slots(slot_bytes, page_size, gran, want)
        assert slots % page_size == 0 and all(slots * b % gran == 0 for b in slot_bytes)
        assert slots * max(slot_bytes) >= min(want, gran)
    assert elastic_page_slots([512], 1, 2 << 20, 2 << 20) == 4096  # a GPU's 2 MB of 512-byte slots


# -- the state machine ---------------------------------------------------------------------------

SLOT_FLOATS = 64  # one float32 "layer" buffer of 256-byte slots: 16 slots fill a 4 KB page


class MarkedAllocator(ElasticTokenToKVPoolAllocator):
    """Writes each slot's own number into the slot when it is handed out."""

    def _mark_used(self, slots):
        self.arena.tensors[0].view(torch.float32).view(-1, SLOT_FLOATS)[slots, 0] = slots.to(torch.float32)
        return super()._mark_used(slots)


class RefusingArena(CpuArena):
    """A CPU arena whose maps the test can refuse, as a full device would."""

    full = False
    lag = 0.0  # seconds a map or unmap takes on the mapper's thread: widens its races with the allocator

    def physical_free(self) -> int:
        return 0 if self.full else 1 << 40

    def _map_run(self, first: int, count: int) -> bool:
        self._lag()
        return not self.full and super()._map_run(first, count)

    def _unmap_runs(self, runs: list[tuple[int, int]]) -> None:
        self._lag()
        super()._unmap_runs(runs)

    def _lag(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            time.sleep(self.lag)


class ElasticMachine(RequestRules):
    background = False  # maps ahead and unmaps done at once, in the test's thread

    @initialize(page_size=st.sampled_from([1, 2, 4, 8]), epage_kv_pages=st.sampled_from([2, 4]),
                reserve=st.sampled_from([(0, 0), (0, 1), (1, 2)]))
    def setup(self, page_size, epage_kv_pages, reserve):
        epage_slots = page_size * epage_kv_pages * max(16 // (page_size * epage_kv_pages), 1)
        size = 12 * epage_slots - page_size
        self.arena = RefusingArena([epage_slots * SLOT_FLOATS * 4], 12, lead_bytes=page_size * SLOT_FLOATS * 4)
        self.arena.lag = 0.002 if self.background else 0.0
        alloc = MarkedAllocator(size, page_size, "cpu", self.arena, epage_slots, *reserve, background=self.background)
        self.h = Harness(page_size=page_size, max_reqs=6, max_len=256, allocator=alloc)
        self.reserve = reserve

    @rule()
    def rebalance(self):
        self.h.alloc.rebalance()
        used = self.h.alloc.epage_used().tolist()
        empty = [e for e in self.h.alloc.mapped_epages() if not used[e]]
        assert len(empty) <= self.reserve[1], "an empty page kept beyond the reserve"
        alloc = self.h.alloc
        room = min(alloc.num_epages, alloc.limit_pages) - len(alloc.mapped_epages()) - len(alloc._ahead)
        free = len(alloc.free_pages) + sum(len(p) for p in alloc._released) + len(alloc._ahead) * alloc.kv_pages_per_epage
        if not self.arena.full:
            assert free >= self.reserve[0] * alloc.kv_pages_per_epage or room <= 0, "the reserve was not refilled"

    @rule()
    def rebalance_while_busy(self):
        self.h.alloc.rebalance(busy=True)  # may skip the look for empty pages; the invariants still hold

    @rule(pages=st.one_of(st.none(), st.integers(0, 12)))
    def limit(self, pages):
        """A run-time limit (``/set_kv_limit``): cached KV goes, in LRU order, until it is met."""
        alloc = self.h.alloc
        alloc.set_limit(pages)
        alloc.rebalance(self.h.cache.evict)
        self._check_shrunk(alloc.limit_pages)

    @rule(pages=st.integers(0, 12))
    def shrink(self, pages):
        """Memory asked back for another server sharing the device."""
        self.h.alloc.shrink(pages, self.h.cache.evict)
        self._check_shrunk(pages)

    def _check_shrunk(self, pages):
        alloc = self.h.alloc
        used = alloc.epage_used().tolist()
        if len(alloc.mapped_epages()) > pages:  # only pages that hold a running request's or a locked node's slot
            assert self.h.cache.evictable_size() == 0, "cached KV kept over the limit"
            assert all(used[e] for e in alloc.mapped_epages()), "an empty page kept over the limit"

    @rule(full=st.booleans())
    def device_full(self, full):
        self.arena.full = full

    @rule(n=st.integers(0, 96))
    def evict(self, n):
        self.h.cache.evict(n)

    @rule()
    def flush(self):
        if self.h.live:  # a rule enabled whatever the state: see RequestRules
            return
        self.h.cache.reset()
        self.h.alloc.clear()
        assert len(self.h.alloc.mapped_epages()) <= self.reserve[1]

    @invariant()
    def held_and_cached_slots_are_mapped_and_intact(self):
        h = self.h
        h.check()  # the memory invariant, and the allocator's own (kvcached's rule among them)
        held = [h.req_pool.req_to_token[r.req_pool_idx, r.cache_protected_len: r.kv_len].to(torch.int64)
                for r in h.live]
        owned = torch.cat([*held, h.cache.all_values()])
        mapped = set(h.alloc.mapped_epages())
        assert all(int(e) in mapped for e in h.alloc.epage_of(owned // h.alloc.page_size)), "a used slot in an unmapped page"
        marks = self.arena.tensors[0].view(torch.float32).view(-1, SLOT_FLOATS)[owned, 0]
        assert torch.equal(marks, owned.to(torch.float32)), "a used slot lost its contents"


    def teardown(self):
        if hasattr(self, "h"):
            self.h.alloc.close()


class BackgroundElasticMachine(ElasticMachine):
    """The same, with the mapper's thread mapping ahead and unmapping while
    the test allocates, frees and evicts: a page taken while the thread is
    on it, or still giving it back, must still hold what was written."""

    background = True


ElasticMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
BackgroundElasticMachine.TestCase.settings = ElasticMachine.TestCase.settings
TestElasticProperties = ElasticMachine.TestCase
TestElasticPropertiesWithAMapperThread = BackgroundElasticMachine.TestCase


def test_the_mapper_never_hands_out_a_page_it_is_still_giving_back():
    """The mapper's thread is slow (50 ms a call): a page asked for now
    while it is queued to be mapped ahead is mapped at once; one queued to be
    given back is handed out only after that unmap, mapped again."""
    arena = RefusingArena([4096], 4)
    arena.lag = 0.05
    mapper = PageMapper(arena, background=True)
    try:
        mapper.map_ahead([1])
        deadline = time.monotonic() + 10
        while 1 not in mapper._busy and not arena.is_mapped(1) and time.monotonic() < deadline:  # on page 1
            time.sleep(0.001)
        mapper.map_ahead([2, 3])
        assert mapper.map_now(3) and arena.is_mapped(3)  # at once, not after 1 and 2
        mapper.drain()
        assert arena.stats.maps == 3 and mapper.now_maps == 1
        mapper.unmap([2])
        assert mapper.map_now(2)  # after the unmap, mapped again
        mapper.drain()
        assert all(arena.is_mapped(p) for p in (1, 2, 3)) and arena.stats.unmaps == 1 and arena.stats.maps == 4
        assert mapper.pending() == 0
    finally:
        mapper.close()


def test_a_busy_pool_looks_for_empty_pages_once_in_look_steps_calls():
    """While a batch is in flight the look for empty pages (a device sync)
    waits LOOK_STEPS calls; an idle call looks at once."""
    from radixserve.mem_cache.elastic_allocator import LOOK_STEPS

    arena = CpuArena([16 * SLOT_FLOATS * 4], 12, lead_bytes=SLOT_FLOATS * 4)
    alloc = ElasticTokenToKVPoolAllocator(12 * 16, 1, "cpu", arena, 16, 0, 0)
    for busy in (True, False):
        slots = alloc.alloc(16 * 6)
        assert slots is not None and len(alloc.mapped_epages()) == 6
        alloc.free(slots)
        for _ in range(LOOK_STEPS if busy else 0):
            alloc.rebalance(busy=True)
            assert len(alloc.mapped_epages()) == 6  # not looked yet
        alloc.rebalance(busy=busy)
        alloc.mapper.drain()
        assert alloc.mapped_epages() == [], busy  # the six empty ones unmapped; the dummy page is the lead's
    alloc.close()


def test_the_dummy_page_is_a_lead_apart_from_the_pages():
    """Slot 0's page (padded tokens write there) lies before elastic page 0,
    in a lead mapped while the pool holds memory: elastic page 0 holds KV
    pages 1..E, no page ever holds the dummy, and giving every page back
    leaves the lead (one granule on CUDA, shared by the buffers). An arena
    without the lead is refused."""
    with pytest.raises(ValueError, match="dummy page"):
        ElasticTokenToKVPoolAllocator(12 * 16, 2, "cpu", CpuArena([16 * SLOT_FLOATS * 4], 12), 16, 0, 0)
    arena = CpuArena([16 * SLOT_FLOATS * 4], 12, lead_bytes=2 * SLOT_FLOATS * 4)
    alloc = ElasticTokenToKVPoolAllocator(12 * 16, 2, "cpu", arena, 16, 0, 0)
    assert alloc.num_epages == 12 and arena.lead_mapped and alloc.mapped_epages() == []
    assert alloc.epage_of(torch.tensor([1, 8, 9, 96])).tolist() == [0, 0, 1, 11]
    slots = alloc.alloc(16)  # the first 8 KV pages: all of elastic page 0
    assert slots.min() == 2 and slots.max() == 17 and alloc.mapped_epages() == [0]
    view = arena.tensors[0].view(torch.float32).view(-1, SLOT_FLOATS)
    view[slots, 0] = 1.0
    view[0:2, 0] = 7.0  # padding writes the dummy page
    assert arena.map_many([1]) == 1  # the page after it: its slots untouched by the dummy page's
    assert bool((view[slots, 0] == 1.0).all()) and float(view[18, 0]) == 0.0
    stats = alloc.pool_stats()
    assert stats["elastic_kv_mapped_bytes"] == 2 * arena.bytes_per_page + arena.lead_physical_bytes()
    alloc.free(slots)
    alloc.shrink(0, lambda n: 0)
    alloc.mapper.drain()
    arena.unmap(1)
    assert alloc.mapped_epages() == [] and alloc.pool_stats()["elastic_kv_mapped_bytes"] == arena.lead_physical_bytes()
    alloc.check_invariants()
    alloc.release()
    assert not arena.lead_mapped and alloc.pool_stats()["elastic_kv_mapped_bytes"] == 0
    assert alloc.resume() and arena.lead_mapped
    alloc.check_invariants()
    alloc.close()


def test_a_mapper_thread_that_fails_makes_the_next_call_fail():
    class Broken(CpuArena):
        def _map_run(self, first, count):
            if threading.current_thread() is not threading.main_thread():
                raise OSError("the device went away")
            return super()._map_run(first, count)

    mapper = PageMapper(Broken([4096], 4), background=True)
    mapper.map_ahead([1])
    with pytest.raises(RuntimeError, match="mapper thread failed"):
        mapper.drain()
    with pytest.raises(RuntimeError, match="mapper thread failed"):
        mapper.map_now(2)
    mapper.close()


# -- servers that share a device ----------------------------------------------------------------

def _member(path: str, tenant: int, floor_pages: int = 1, budget_pages: int | None = None) -> Harness:
    """A server's pool (16-slot elastic pages of 4 KB, 12 of them) in the registry at ``path``."""
    per_page = 16 * SLOT_FLOATS * 4
    registry = ElasticRegistry(path, tenant, floor_pages * per_page, budget_pages and budget_pages * per_page)
    alloc = ElasticTokenToKVPoolAllocator(12 * 16, 1, "cpu", CpuArena([per_page], 12, lead_bytes=SLOT_FLOATS * 4), 16,
                                          0, 0, registry=registry, floor_pages=floor_pages)
    return Harness(page_size=1, max_reqs=8, max_len=256, allocator=alloc)


def test_a_server_that_cannot_map_gets_the_cached_kv_of_the_others(tmp_path, monkeypatch):
    """Two pools whose group may map 9 pages together: the first fills 7
    with cached prefixes; the second, refused, asks; the first, at its next
    look, evicts in LRU order and unmaps down to what was asked, never
    under its floor; the second then maps. Ranks of one server (one
    tenant) never give to each other, and a member that leaves frees its row."""
    monkeypatch.setattr("radixserve.mem_cache.elastic_registry.HEARTBEAT_S", 0.0)  # look at every call
    path = str(tmp_path / "registry")
    a, b = _member(path, tenant=1, floor_pages=3, budget_pages=9), _member(path, tenant=2, budget_pages=9)
    for i in range(7):  # 7 prompts of 16 tokens: 7 pages, all cached once finished
        a.finish(a.start([100 + i] * 16))
    assert len(a.alloc.mapped_epages()) == 7 and a.cache.evictable_size() == 7 * 16
    assert a.alloc.pages_to_keep(a.cache.evictable_size(), idle=True) is None  # nobody asked
    # 40 slots: 3 pages, of which the budget leaves two (9 - 7)
    assert b.start(list(range(40))) is None
    assert b.alloc.asks >= 1 and [m.want for m in b.alloc.registry.members() if m.tenant == 2] == [4096]
    keep = a.alloc.pages_to_keep(a.cache.evictable_size(), idle=False)
    assert keep == 6  # busy, a gives the ask, in whole pages: what b could not map
    assert a.alloc.give(keep, a.cache.evict) == 7 - keep and len(a.alloc.mapped_epages()) == keep
    # the least recently used prompt went (the first: its 16 slots are page 0)
    assert sorted(a.cache.all_values().tolist()) == list(range(17, 113))
    b.alloc.rebalance()
    req = b.start(list(range(40)))
    assert req is not None and b.alloc.registry.members()[1].want == 0
    # Asked for one page: busy, a gives that page; idle, its whole cache down to its floor.
    b.alloc.registry.ask(4096)
    assert a.alloc.pages_to_keep(a.cache.evictable_size(), idle=False) == keep - 1
    b.alloc.registry.ask(4096)
    floor = a.alloc.pages_to_keep(a.cache.evictable_size(), idle=True)
    assert floor == 3 and a.alloc.give(floor, a.cache.evict) == keep - 3
    b.alloc.registry.ask(100 << 20)  # at its floor, a gives nothing more, busy or idle
    assert a.alloc.pages_to_keep(a.cache.evictable_size(), idle=False) is None
    # A member of a's own server asks: a gives nothing.
    own = _member(path, tenant=1)
    own.alloc.registry.ask(100 << 20)
    assert a.alloc.pages_to_keep(a.cache.evictable_size(), idle=True) is None
    assert len(a.alloc.registry.members()) == 3
    own.alloc.close()
    assert len(a.alloc.registry.members()) == 2
    for h in (a, b):
        h.check()
        h.alloc.close()


# -- through the engine ----------------------------------------------------------------------------

SHARED = [7, 3, 99, 12, 54, 8, 31, 2, 77, 15, 41, 5] * 3


def _prompts() -> list[list[int]]:
    tails = [[1, 5, 9, 33, 70, 2, 8, 11, 19], [4, 4, 100, 7], [250, 3], list(range(60, 150)), [9] * 41]
    return [SHARED + t if i % 2 else t for i, t in enumerate(tails)] * 2


def _outputs(**options) -> tuple[list[list[int]], dict]:
    params = [{"temperature": 0, "max_new_tokens": n, "ignore_eos": True} for n in (12, 30, 5, 24, 17) * 2]
    with radixserve.Engine(**{**TINY, **options}) as eng:
        eng.generate(input_ids=SHARED + [1], sampling_params={"max_new_tokens": 1})  # cache the shared prefix
        out = [o["output_ids"] for o in eng.generate(input_ids=_prompts(), sampling_params=params)]
        for _ in range(500):  # the host tier's copies land first (a flush is refused while they run)
            if eng.flush_cache():
                break
            eng.scheduler.step()
        else:
            raise AssertionError("the cache was never flushed")
        return out, eng.get_stats()


@pytest.fixture(scope="module")
def reference():
    return _outputs(chunked_prefill_size=16, max_total_tokens=4096, max_running_requests=8)[0]


@pytest.mark.parametrize("options", [dict(), dict(tp_size=2), dict(enable_hierarchical_cache=True), dict(page_size=4)],
                         ids=["tp1", "tp2", "hicache", "page4"])
def test_greedy_outputs_are_the_same_with_the_elastic_pool(reference, options):
    out, stats = _outputs(**{"chunked_prefill_size": 16, "max_total_tokens": 4096, "max_running_requests": 8,
                             **ELASTIC, **options})
    assert out == reference
    assert stats["elastic_kv_maps"] > 1 and stats["elastic_kv_unmaps"] > 0  # it grew, and gave back after the flush
    assert stats["elastic_kv_reserve_pages"] <= 1


def test_retraction_in_a_small_elastic_pool_gives_the_same_tokens():
    """A pool too small for every request's output (as in test_tp_engine):
    requests are retracted and re-prefilled, their pages unmapped and mapped again."""
    prompts = [[(7 * i + j) % 500 for j in range(n)] for i, n in enumerate([20, 25, 18, 30, 22, 16])]
    params = {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}
    runs = []
    for options in (dict(), ELASTIC):
        with radixserve.Engine(**TINY, **options, max_total_tokens=160, max_running_requests=8) as eng:
            runs.append(([o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=params)],
                         eng.get_stats()))
    assert runs[0][1]["retractions"] > 0 and runs[1][1]["retractions"] == runs[0][1]["retractions"]
    assert runs[1][0] == runs[0][0]


def test_refused_maps_queue_requests_instead_of_failing(reference, monkeypatch):
    """The machine refuses every other map for a while: allocations fail like
    a full pool, requests wait or are retracted, and all finish as without it."""
    original = CpuArena._map_run
    calls = {"n": 0}

    def flaky(self, first, count):
        calls["n"] += 1
        return calls["n"] % 2 == 1 and original(self, first, count)

    monkeypatch.setattr(CpuArena, "_map_run", flaky)
    out, stats = _outputs(chunked_prefill_size=16, max_total_tokens=4096, max_running_requests=8, **ELASTIC)
    assert out == reference and stats["elastic_kv_failed_maps"] > 0


def test_a_limit_lowered_below_use_holds_requests_until_it_rises(reference):
    """``set_kv_limit`` while requests run: the cache is evicted and pages
    unmapped down to what the running requests hold, nobody is admitted or
    cut short meanwhile (the last ones are retracted to wait), and once the
    limit rises every request finishes with the tokens it has without one."""
    params = [{"temperature": 0, "max_new_tokens": n, "ignore_eos": True} for n in (12, 30, 5, 24, 17) * 2]
    with radixserve.Engine(**TINY, chunked_prefill_size=16, max_total_tokens=4096, max_running_requests=8,
                           **ELASTIC) as eng:
        eng.generate(input_ids=SHARED + [1], sampling_params={"max_new_tokens": 1})
        sched = eng.scheduler
        reqs = [r for ids, p in zip(_prompts(), params) for r in eng._make_reqs(ids, p, False, -1, 0, None)]
        for req in reqs:
            sched.add_request(req)
        while len(sched.running_batch.reqs) < 3:
            sched.step()
        page = eng.get_kv_limit()["elastic_kv_page_bytes"]
        state = eng.set_kv_limit(2 * page)  # two pages: less than the running requests hold
        assert state["elastic_kv_limit_bytes"] == 2 * page and eng.get_kv_limit() == state
        lead = state["elastic_kv_lead_bytes"]  # the dummy page's, outside the limit
        for _ in range(60):
            sched.step()
            state = eng.get_kv_limit()
            assert state["elastic_kv_mapped_bytes"] - lead <= max(state["elastic_kv_used_bytes"] - lead, 2 * page)
        assert state["elastic_kv_mapped_bytes"] - lead <= 2 * page  # the cache keeps only what fits under the limit
        assert not sched.running_batch.reqs and not any(r.finished() for r in reqs[5:])  # held, none cut
        eng.set_kv_limit(None)
        pending = {id(r) for r in reqs if not r.finished()}
        while pending:
            pending -= {id(r) for r in sched.step() if r.finished()}
        assert [r.output_ids for r in reqs] == reference
        assert all(r.finished_reason.to_json()["type"] == "length" and "message" not in r.finished_reason.to_json()
                   for r in reqs)


def test_a_kv_limit_needs_the_elastic_pool():
    with radixserve.Engine(**TINY, max_total_tokens=512) as eng:
        with pytest.raises(ValueError, match="--enable-elastic-kv"):
            eng.set_kv_limit(1 << 20)


# -- a server's resident memory ---------------------------------------------------------------------

WIDE = '{"num_hidden_layers": 8, "num_key_value_heads": 4, "head_dim": 32}'  # 8 KB of KV a token


def rss_anon(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("RssAnon:"))


def _burst(url: str, seed: int, n: int = 16) -> None:
    """``n`` prompts of 1,000 tokens at once (8 MB of KV each with ``WIDE``), all answered 200."""
    prompts = [[(31 * i + j + seed) % 500 + 3 for j in range(1000)] for i in range(n)]
    replies = []

    def send(ids):
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}}
        replies.append(httpx.post(url + "/generate", json=body, timeout=300).status_code)

    threads = [threading.Thread(target=send, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert replies == [200] * n


ELASTIC_SERVER = ("--model-path", "tiny-llama", "--load-format", "dummy", "--device", "cpu",
                  "--json-model-override-args", WIDE, "--max-total-tokens", "65536", "--enable-elastic-kv",
                  "--elastic-kv-page-mb", "2",  # pages of 32 MB: the tests' arithmetic
                  "--elastic-kv-min-reserve-pages", "1", "--elastic-kv-max-reserve-pages", "1")


@pytest.fixture(scope="module", autouse=True)
def elastic_servers(request):
    """The servers of the tests below that the selected tests use, started
    one after another in the background with the module's first test (they
    load while the tests before run): ``group0`` and ``group1``, in one
    elastic group, and ``alone``."""
    group = (*ELASTIC_SERVER, "--elastic-kv-group", f"test-{os.getpid()}", "--elastic-kv-group-gb", "0.25",
             "--elastic-kv-min-gb", "0.03")  # a floor of one page
    specs = {}
    if selected(request, "group_servers"):
        specs.update(group0=(group, {}), group1=(group, {}))
    if selected(request, "alone_server"):  # a group of its own: the engines of the tests before are in "default"
        specs["alone"] = ((*ELASTIC_SERVER, "--elastic-kv-group", f"test-alone-{os.getpid()}"), {})
    started = Prestarted(specs)
    yield started
    started.stop()


@pytest.fixture
def group_servers(elastic_servers):
    return [elastic_servers.get("group0"), elastic_servers.get("group1")]


@pytest.fixture
def alone_server(elastic_servers):
    return elastic_servers.get("alone")


@pytest.mark.slow
def test_two_servers_on_one_device_take_turns_with_its_memory(group_servers):
    """Two servers in one group whose budget (256 MB: 8 pages of 32 MB)
    holds one burst's KV, not two. After its burst a server keeps its
    prompts cached; the other's burst cannot map, asks, and the first (idle)
    evicts and unmaps what is asked; a burst that needs all but the floor
    takes the idle server down to its floor. No request fails."""
    servers = group_servers
    try:
        page = 32 << 20

        def turn(busy: int, prompts: int) -> list[dict]:
            _burst(servers[busy].url, seed=100 * prompts + busy, n=prompts)  # 125 KB of KV a prompt
            after = [s.wait_idle() for s in servers]
            pages = [st["elastic_kv_mapped_bytes"] - st["elastic_kv_lead_bytes"] for st in after]  # the dummy pages' apart
            assert sum(pages) <= 8 * page  # the group's budget held
            assert after[busy]["elastic_kv_mapped_bytes"] >= prompts * 8_000_000 // page * page  # its prompts, cached
            return after

        turn(0, 16)  # 4 pages of prompts and the reserve: 5, and 3 for the idle server
        before = servers[0].wait_idle()["elastic_kv_given_pages"]
        after = turn(1, 16)  # needs 4 more pages than the budget leaves it: the first server gives them
        assert after[0]["elastic_kv_given_pages"] > before and after[1]["elastic_kv_asks"] > 0
        given = after[1]["elastic_kv_given_pages"]
        after = turn(0, 26)  # about 7 pages: the other server goes down to its floor and its reserve
        assert after[1]["elastic_kv_given_pages"] > given
        idle_pages = after[1]["elastic_kv_mapped_bytes"] - after[1]["elastic_kv_lead_bytes"]
        assert idle_pages <= after[1]["elastic_kv_floor_bytes"] + page == 2 * page
    finally:
        assert [s.stop() for s in servers] == [0] * len(servers)


@pytest.mark.slow
def test_an_idle_server_holds_the_reserve_a_burst_grows_it_and_a_flush_gives_it_back(alone_server):
    srv = alone_server
    try:
        pid = srv.children()["scheduler"]
        state = srv.wait_idle()
        lead = state["elastic_kv_lead_bytes"]  # the dummy page's: a few KB on a CPU
        page = state["elastic_kv_mapped_bytes"] - lead  # one in reserve
        assert page == 32 << 20 and 0 < lead < 1 << 20

        def burst(seed: int) -> dict:
            _burst(srv.url, seed)
            return srv.wait_idle()

        def flush() -> dict:
            assert httpx.post(srv.url + "/flush_cache", timeout=30).status_code == 200
            return srv.wait_idle()

        # A first burst and flush leave what the scheduler's malloc keeps of the prefills' activations.
        burst(0)
        assert flush()["elastic_kv_mapped_bytes"] == page + lead
        idle = rss_anon(pid)
        assert burst(1)["elastic_kv_mapped_bytes"] >= 100 << 20  # the prompts stay cached: their pages stay mapped
        assert rss_anon(pid) - idle >= 80 << 20  # what was mapped beyond the reserve, which idle holds already
        assert flush()["elastic_kv_mapped_bytes"] == page + lead
        assert rss_anon(pid) - idle < page  # back to the reserve, give or take the allocator's own

        # The run-time limit, through kvctl and the endpoints.
        def kvctl(*argv: str) -> list[dict]:
            done = subprocess.run([sys.executable, "-m", "radixserve.entrypoints.cli", "kvctl", "--url", srv.url,
                                   "--json", *argv], capture_output=True, text=True, timeout=60)
            assert done.returncode == 0, done.stderr
            return json.loads(done.stdout)

        shown = kvctl("show")[0]
        assert shown["elastic_kv_limit_bytes"] == shown["elastic_kv_max_bytes"]
        for body, field in [({}, "limit_bytes"), ({"limit_bytes": -1}, "limit_bytes"), ({"limit_gb": "1"}, "limit_gb"),
                            ({"limit_bytes": 1, "limit_gb": 1}, "limit_bytes"), ([1], "limit_bytes")]:
            reply = httpx.post(srv.url + "/set_kv_limit", json=body, timeout=30)
            assert reply.status_code == 400 and reply.json()["error"]["param"] == field, (body, reply.text)
        burst(2)  # cached: 125 MB mapped
        assert kvctl("limit", "64M")[0]["elastic_kv_mapped_bytes"] - lead <= 64 << 20  # the cache evicted down to it
        assert httpx.get(srv.url + "/get_kv_limit", timeout=30).json()[0]["elastic_kv_limit_bytes"] == 64 << 20
        states = []
        watcher = threading.Timer(3.0, lambda: states.append(kvctl("limit", "none")))
        watcher.start()
        burst(3)  # 125 MB of prompts under a 64 MB limit: some wait until the limit rises, none fails
        watcher.join()
        assert states[0][0]["elastic_kv_limit_bytes"] == states[0][0]["elastic_kv_max_bytes"]
    finally:
        assert srv.stop() == 0

