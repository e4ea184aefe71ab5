"""Arena calls over several pages on the CPU (``map_many`` and ``unmap_many``
work in runs of adjacent pages; docs/elastic_kv.md), the page mapper's
batches (consecutive maps, or unmaps, in one call, in the order asked), and
benchmarks/elastic_vmm.py run end to end on the CPU arena."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import threading

import pytest

from radixserve.mem_cache.page_mapper import PageMapper
from radixserve.mem_cache.virtual_memory import CpuArena, page_runs

MB = 1 << 20
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def rss_anon() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("RssAnon:"))


class RecordingArena(CpuArena):
    """A CPU arena that records the runs it maps and unmaps, may have room
    for only ``budget`` pages (a full device), and holds the mapper's thread
    at its next call while ``gate`` is clear (``held`` says it is there)."""

    def __init__(self, page_bytes: list[int], num_pages: int, budget: int | None = None):
        super().__init__(page_bytes, num_pages)
        self.calls: list[tuple] = []
        self.budget = budget
        self.gate, self.held = threading.Event(), threading.Event()
        self.gate.set()

    def physical_free(self) -> int:
        if self.budget is None:
            return super().physical_free()
        return max(self.budget - len(self.stats.mapped), 0) * self.bytes_per_page

    def _map_run(self, first: int, count: int) -> bool:
        self._hold()
        ok = super()._map_run(first, count)
        self.calls.append(("map", first, count, ok))
        return ok

    def _unmap_runs(self, runs: list[tuple[int, int]]) -> None:
        self._hold()
        self.calls.append(("unmap", runs))
        super()._unmap_runs(runs)

    def _hold(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            self.held.set()
            assert self.gate.wait(30), "the test never opened the gate"

    def hold_thread(self, mapper: PageMapper, page: int) -> None:
        """Have the mapper's thread map ``page`` and stay in that call until :attr:`gate` is set."""
        self.gate.clear()
        self.held.clear()
        mapper.map_ahead([page])
        assert self.held.wait(30)


def test_pages_split_into_runs_at_gaps():
    assert page_runs([7, 1, 2, 3, 5, 8, 2]) == [(1, 3), (5, 1), (7, 2)]
    assert page_runs([]) == [] and page_runs(range(4)) == [(0, 4)]


def test_map_many_and_unmap_many_work_in_runs_and_count_pages():
    """Runs split at gaps, one physical call each; the stats count pages;
    the resident memory grows with the maps and falls with the unmaps; the
    pages left mapped keep their contents, those given back read zero."""
    arena = RecordingArena([4 * MB, 4 * MB], 16)  # 8 MB a page
    before = rss_anon()
    assert arena.map_many([5, 1, 2, 3, 7, 8]) == 6
    assert arena.calls == [("map", 1, 3, True), ("map", 5, 1, True), ("map", 7, 2, True)]
    assert arena.stats.maps == 6 and arena.stats.mapped == {1, 2, 3, 5, 7, 8} and arena.stats.map_s > 0
    for t in arena.tensors:
        for page in arena.stats.mapped:
            t[page * 4 * MB: (page + 1) * 4 * MB].fill_(1)
    grown = rss_anon()
    assert grown - before >= 44 * MB

    assert arena.map_many([1, 2, 3]) == 3 and len(arena.calls) == 3  # mapped already: no call
    arena.unmap_many([2, 1, 9, 3, 7])  # 9 is not mapped
    assert arena.calls[-1] == ("unmap", [(1, 3), (7, 1)])
    assert arena.stats.unmaps == 4 and arena.stats.mapped == {5, 8}
    assert grown - rss_anon() >= 28 * MB
    k = arena.tensors[0]
    assert int(k[1 * 4 * MB: 4 * 4 * MB].count_nonzero()) == 0 and int(k[5 * 4 * MB]) == 1 and int(k[8 * 4 * MB]) == 1
    arena.close()
    assert arena.stats.mapped == set() and arena.stats.unmaps == 6


def test_a_refused_run_maps_nothing_and_then_as_many_pages_as_fit():
    """No room: ``map_many`` maps no page in any buffer, the resident memory
    stays, every page counts as refused. Room for two of three: the run is
    refused whole, then the lowest two map, as one ``map`` each would."""
    arena = RecordingArena([8 * MB, 8 * MB], 8, budget=0)
    before = rss_anon()
    assert arena.map_many([1, 2, 3]) == 0
    assert arena.stats.mapped == set() and arena.stats.maps == 0 and arena.stats.failed_maps == 3
    assert arena.calls == [("map", 1, 3, False)] + [("map", p, 1, False) for p in (1, 2, 3)]
    assert rss_anon() - before < 8 * MB
    arena.budget = 2
    assert arena.map_many([4, 5, 6]) == 2
    assert arena.stats.mapped == {4, 5} and arena.stats.failed_maps == 4 and arena.mapped_bytes() == 2 * 16 * MB
    assert not arena.map(7) and arena.stats.failed_maps == 5
    arena.close()


def test_the_mapper_coalesces_consecutive_ops_in_order():
    """While the thread is busy, maps and unmaps queue; it then takes each
    stretch of one kind as one call (at most ``map_batch`` pages a map),
    never reordering a map and an unmap."""
    arena = RecordingArena([4096], 16)
    mapper = PageMapper(arena, background=True, map_batch=4)
    try:
        arena.hold_thread(mapper, 0)
        mapper.map_ahead([1, 2])
        mapper.map_ahead([3])
        mapper.unmap([2, 1])
        mapper.map_ahead([5, 6, 7, 8, 9])
        mapper.unmap([5])
        assert mapper.pending() == 12
        arena.gate.set()
        mapper.drain()
        assert arena.calls == [("map", 0, 1, True), ("map", 1, 3, True), ("unmap", [(1, 2)]),
                               ("map", 5, 4, True), ("map", 9, 1, True), ("unmap", [(5, 1)])]
        assert arena.stats.mapped == {0, 3, 6, 7, 8, 9} and arena.stats.maps == 9 and arena.stats.unmaps == 3
        assert mapper.pending() == 0
    finally:
        arena.gate.set()
        mapper.close()


def test_a_mapper_without_a_thread_batches_too():
    arena = RecordingArena([4096], 16)
    mapper = PageMapper(arena, background=False)
    mapper.map_ahead([3, 4, 5])
    mapper.unmap([5, 3])
    assert arena.calls == [("map", 3, 3, True), ("unmap", [(3, 1), (5, 1)])] and arena.stats.mapped == {4}
    with pytest.raises(ValueError):
        PageMapper(arena, background=False, map_batch=0)


def test_map_now_waits_for_the_batch_it_needs():
    """A page the thread is mapping in a batch is handed out once the whole
    batch is done (not mapped twice); a page queued to be given back, behind
    a batch still running, is mapped again only after that unmap."""
    arena = RecordingArena([4096], 16)
    mapper = PageMapper(arena, background=True)
    try:
        arena.hold_thread(mapper, 1)
        mapper.map_ahead([2, 3])  # queued behind the held call
        threading.Timer(0.2, arena.gate.set).start()
        assert mapper.map_now(1) and mapper.now_maps == 0  # the thread's map, waited for
        mapper.drain()
        assert arena.calls == [("map", 1, 1, True), ("map", 2, 2, True)]

        arena.hold_thread(mapper, 8)
        mapper.unmap([2, 1])
        threading.Timer(0.2, arena.gate.set).start()
        assert mapper.map_now(2) and mapper.now_maps == 1
        assert arena.calls[2:] == [("map", 8, 1, True), ("unmap", [(1, 2)]), ("map", 2, 1, True)]
        mapper.drain()
        assert arena.stats.mapped == {2, 3, 8}
    finally:
        arena.gate.set()
        mapper.close()


# -- benchmarks/elastic_vmm.py -----------------------------------------------------------------

@pytest.fixture(scope="module")
def elastic_vmm():
    spec = importlib.util.spec_from_file_location("elastic_vmm", os.path.join(ROOT, "benchmarks", "elastic_vmm.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


def test_the_benchmark_helpers(elastic_vmm):
    assert elastic_vmm.chunks(list(range(5)), 2) == [[0, 1], [2, 3], [4]]
    assert elastic_vmm.chunks(list(range(5)), 0) == [list(range(5))]
    assert elastic_vmm.copies_for(1.0, 8, 3.0) == 24 and elastic_vmm.copies_for(100.0, 8, 3.0) == 1
    summary = elastic_vmm.summarize([0.001] * 9 + [0.011])
    assert summary["steps"] == 10 and summary["median_ms"] == 1.0 and summary["mean_ms"] == 2.0
    assert summary["p90_ms"] == 1.0 and elastic_vmm.summarize([]) == {"steps": 0}
    assert elastic_vmm.slowdown_pct(2.0, 2.5) == 25.0 and elastic_vmm.slowdown_pct(2.0, None) is None
    rows = elastic_vmm.rate_configs((True, True), 128, cuda=True)
    assert (8, False, True, True) in rows and (0, True, True, True) in rows and (1, True, True, False) in rows
    assert [r[0] for r in elastic_vmm.rate_configs((False, False), 16, cuda=False)] == [1, 8, 0]
    with pytest.raises(SystemExit):
        elastic_vmm.parse_args(["--variants", "per_page,nonsense"])


def test_the_benchmark_runs_on_the_cpu_arena(elastic_vmm, capsys):
    elastic_vmm.main(["--device", "cpu", "--pages", "4", "--buffers", "2", "--page-mb", "0.25", "--graph-mb", "1",
                      "--step-ms", "1", "--measure-s", "0.2", "--ahead", "2", "--variants", "per_page,runs",
                      "--pace-ms", "5"])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["bench"] for r in rows[:3]] == ["elastic_vmm_setup", "elastic_vmm_rate", "elastic_vmm_rate"]
    assert [r["run"] for r in rows[1:3]] == [1, 4] and all(r["map_gb_per_s"] > 0 for r in rows[1:3])
    interference = {r["variant"]: r for r in rows if r["bench"] == "elastic_vmm_interference"}
    assert list(interference) == ["alone", "per_page", "runs", "alone_again"]
    assert interference["alone"]["steps"] > 0
    for name in ("per_page", "runs"):
        row = interference[name]
        assert row["cycles"] >= 1 and row["refused_maps"] == 0 and row["all"]["steps"] > 0
    assert interference["runs"]["map_batch"] > 1 and interference["per_page"]["map_batch"] == 1
    fresh = {r["case"]: r for r in rows if r["bench"] == "elastic_vmm_fresh"}
    assert list(fresh) == ["alone", "new_range_new_memory", "same_range_reused_memory", "new_range_reused_memory"]
    for case in list(fresh)[1:]:  # each pass mapped all 4 pages while steps ran
        assert fresh[case]["steps"] > 0 and fresh[case]["map_s"] > 0


def test_unmapping_returns_resident_memory():
    def rss_anon() -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) << 10 for line in f if line.startswith("RssAnon:"))

    arena = CpuArena([8 << 20, 8 << 20], 16)  # 16 pages of 16 MB
    before = rss_anon()
    for page in range(8):
        assert arena.map(page)
        for t in arena.tensors:
            t[page * (8 << 20): (page + 1) * (8 << 20)].fill_(1)
    grown = rss_anon()
    for page in range(8):
        arena.unmap(page)
    assert grown - before >= 120 << 20 and rss_anon() - before < 16 << 20
    assert int(arena.tensors[0][0]) == 0 and arena.stats.maps == arena.stats.unmaps == 8
