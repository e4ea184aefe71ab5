"""What the elastic KV pool's virtual memory costs (docs/elastic_kv.md): an
arena shaped like llama-3.1-8b's pool (``--buffers`` K and V buffers, pages
of ``--page-mb`` in each), measured two ways.

- **Rates** (``elastic_vmm_rate``): ``--pages`` pages mapped, then unmapped,
  in runs of 1 (``map`` / ``unmap``, one device sync a page) and of 8, 32
  and all of them (``map_many`` / ``unmap_many``), with the driver's range
  calls over a run on (as probed) and off, with and without the zeroing
  memset and the look at the device's free memory before a map.
- **Interference** (``elastic_vmm_interference``): the time per step of a
  memory-bound CUDA graph (device copies, ``--step-ms`` a replay, its stream
  synced every step as the scheduler's is), alone and while a background thread
  maps all the pages through a :class:`PageMapper`, ``--ahead`` at a time,
  then unmaps them all, back to back; steps are counted in the phase
  (``map`` or ``unmap``) they started in. Variants take one suspect away at a
  time: ``per_page`` maps and unmaps a page per call (the engine before
  batching), ``no_memset`` leaves pages unzeroed, ``no_mem_get_info``
  keeps no margin (no ``cudaMemGetInfo`` before a map), ``runs`` is the
  engine now (``map_many`` / ``unmap_many`` in the mapper's batches),
  ``runs_no_span`` the same with the range calls off.
- **Fresh or reused** (``elastic_vmm_fresh``): the same steps while one pass
  maps every page, ``--ahead`` pages every ``--pace-ms`` (as a pool grows
  during a run), three times: a new arena (address range and memory never
  mapped by this process), the same arena again (both reused), and a second
  new arena (a new range over memory this process has unmapped). Which of
  them slows the steps says whether the cost of growing is the first
  mapping of a range or of memory.

    PYTHONPATH=. python benchmarks/elastic_vmm.py                 # on a GPU: every row, about a minute
    PYTHONPATH=. python benchmarks/elastic_vmm.py --device cpu --pages 16 --buffers 8 --graph-mb 16

Prints one JSON line per row. On a CPU the arena is :class:`CpuArena` and the
"graph" a loop of copies: the rows run, the figures mean little.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import threading
import time
from dataclasses import dataclass

import torch

from radixserve.bench import sync
from radixserve.mem_cache.page_mapper import MAP_BATCH, UNMAP_BATCH, PageMapper
from radixserve.mem_cache.virtual_memory import VirtualArena, granularity, make_arena

RUNS = (1, 8, 32, 0)  # pages per call in the rates; 0: all of them in one call


@dataclass(frozen=True)
class Variant:
    """One interference run: the mapper's batches and the arena's switches."""

    name: str
    map_batch: int = 1
    unmap_batch: int = 1
    margin: bool = True  # keep_free as the engine sets it: a cudaMemGetInfo before each map (run)
    zero: bool = True
    span: bool = True  # the range calls where the probe allowed them


VARIANTS = {v.name: v for v in (
    Variant("per_page"),
    Variant("no_memset", zero=False),
    Variant("no_mem_get_info", margin=False),
    Variant("runs", map_batch=MAP_BATCH, unmap_batch=UNMAP_BATCH),
    Variant("runs_no_span", map_batch=MAP_BATCH, unmap_batch=UNMAP_BATCH, span=False),
)}


# -- pure helpers (tests/test_virtual_memory.py) ------------------------------------------------

def chunks(pages: list[int], size: int) -> list[list[int]]:
    """``pages`` cut into lists of ``size`` (0: one list of all)."""
    size = size or len(pages) or 1
    return [pages[i: i + size] for i in range(0, len(pages), size)]


def copies_for(step_ms: float, copies: int, target_ms: float, most: int = 4096) -> int:
    """Copies a graph needs for a replay of ``target_ms``, when ``copies`` took ``step_ms``."""
    return max(1, min(most, round(copies * target_ms / max(step_ms, 1e-6))))


def summarize(times_s: list[float]) -> dict:
    """Steps, and their mean, median and p90 time in ms."""
    if not times_s:
        return {"steps": 0}
    ordered = sorted(times_s)
    return {"steps": len(times_s), "mean_ms": round(1e3 * statistics.fmean(times_s), 4),
            "median_ms": round(1e3 * statistics.median(times_s), 4),
            "p90_ms": round(1e3 * ordered[min(len(ordered) - 1, math.ceil(0.9 * len(ordered)) - 1)], 4)}


def slowdown_pct(alone_ms: float, busy_ms: float | None) -> float | None:
    return None if busy_ms is None or not alone_ms else round(100 * (busy_ms / alone_ms - 1), 2)


def gb_per_s(nbytes: int, seconds: float) -> float:
    return round(nbytes / max(seconds, 1e-9) / 1e9, 2)


# -- the device -------------------------------------------------------------------------------

def set_switches(arena: VirtualArena, keep_free: int, zero: bool, span: bool, probed: tuple[bool, bool]) -> None:
    """The arena's knobs for one row (a CPU arena has none but the margin it always keeps)."""
    if hasattr(arena, "keep_free"):
        arena.keep_free = keep_free
        arena.zero_pages = zero
        arena.span_access, arena.span_unmap = (probed if span else (False, False))


def rate_row(arena: VirtualArena, pages: list[int], run: int, device: torch.device) -> dict:
    """Map ``pages`` in calls of ``run`` pages, then unmap them so."""
    before = (arena.stats.maps, arena.stats.unmaps)
    sync(device)
    start = time.perf_counter()
    for chunk in chunks(pages, run):
        if run == 1:
            ok = arena.map(chunk[0])
        else:
            ok = arena.map_many(chunk) == len(chunk)
        if not ok:
            raise RuntimeError(f"the device refused pages {chunk[0]}..{chunk[-1]}")
    sync(device)  # the zeroing done
    mapped = time.perf_counter() - start
    start = time.perf_counter()
    for chunk in chunks(pages, run):
        if run == 1:
            arena.unmap(chunk[0])
        else:
            arena.unmap_many(chunk)
    unmapped = time.perf_counter() - start
    assert (arena.stats.maps - before[0], arena.stats.unmaps - before[1]) == (len(pages), len(pages))
    nbytes = arena.bytes_per_page * len(pages)
    return {"map_gb_per_s": gb_per_s(nbytes, mapped), "unmap_gb_per_s": gb_per_s(nbytes, unmapped),
            "map_ms_per_page": round(1e3 * mapped / len(pages), 3),
            "unmap_ms_per_page": round(1e3 * unmapped / len(pages), 3)}


class CopyStep:
    """One step of memory-bound work: ``copies`` device copies between two
    ``mb``-MB buffers, captured in a CUDA graph on a GPU (replayed each step),
    plain copies on a CPU."""

    def __init__(self, mb: float, copies: int, device: torch.device):
        self.device, self.copies = device, copies
        n = int(mb * 2**20)
        self.a = torch.ones(n, dtype=torch.uint8, device=device)
        self.b = torch.zeros(n, dtype=torch.uint8, device=device)
        self.graph = None
        if device.type == "cuda":
            stream = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                self._copies()  # warmed up outside the capture
            torch.cuda.current_stream(device).wait_stream(stream)
            sync(device)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self._copies()
            sync(device)

    def _copies(self) -> None:
        for i in range(self.copies):
            (self.b if i % 2 == 0 else self.a).copy_(self.a if i % 2 == 0 else self.b)

    def __call__(self) -> None:
        """One step, waited for as the scheduler waits for a batch: on its
        own stream only (a device-wide sync would also wait for the
        mapper's zeroing, which the engine's steps do not)."""
        if self.graph is not None:
            self.graph.replay()
            torch.cuda.current_stream(self.device).synchronize()
        else:
            self._copies()

    def time_ms(self, replays: int = 20) -> float:
        self()
        start = time.perf_counter()
        for _ in range(replays):
            self()
        return 1e3 * (time.perf_counter() - start) / replays


def calibrated_step(mb: float, target_ms: float, device: torch.device) -> tuple[CopyStep, float]:
    """A :class:`CopyStep` of about ``target_ms`` a step (one re-capture at most), and its time."""
    step = CopyStep(mb, 8, device)
    ms = step.time_ms()
    copies = copies_for(ms, step.copies, target_ms)
    if copies != step.copies:
        step = CopyStep(mb, copies, device)
        ms = step.time_ms()
    return step, ms


def timed_steps(step: CopyStep, seconds: float, phase: list[str] | None = None) -> dict[str, list[float]]:
    """Step for ``seconds``; each step's time under the phase it started in."""
    times: dict[str, list[float]] = {}
    end = time.perf_counter() + seconds
    while (start := time.perf_counter()) < end:
        now = phase[0] if phase else "alone"
        step()
        times.setdefault(now, []).append(time.perf_counter() - start)
    return times


def interference_row(arena: VirtualArena, pages: list[int], step: CopyStep, variant: Variant, seconds: float,
                     ahead: int) -> dict:
    """Steps while a mapper maps ``pages`` (``ahead`` asked at a time, as the
    allocator's rebalance asks) and unmaps them all (as an idle server gives
    them back), over and over."""
    mapper = PageMapper(arena, background=True, map_batch=variant.map_batch, unmap_batch=variant.unmap_batch)
    phase, stop, counts = ["map"], threading.Event(), {"maps": 0, "unmaps": 0, "cycles": 0}
    failed, errors = arena.stats.failed_maps, []

    def churn() -> None:
        try:
            cycle()
        except BaseException as exc:  # noqa: BLE001 -- raised in the main thread below
            errors.append(exc)
            stop.set()

    def cycle() -> None:
        while not stop.is_set():
            phase[0] = "map"
            for chunk in chunks(pages, ahead):
                mapper.map_ahead(chunk)
                mapper.drain()
                counts["maps"] += len(chunk)
                if stop.is_set():
                    break
            phase[0] = "unmap"
            mapper.unmap(sorted(pages, reverse=True))  # the allocator gives back highest first
            mapper.drain()
            counts["unmaps"] += len(pages)
            counts["cycles"] += 1

    worker = threading.Thread(target=churn, name="elastic-vmm-churn")
    start = time.perf_counter()
    worker.start()
    try:
        times = timed_steps(step, seconds, phase)
    finally:
        stop.set()
        worker.join()
        elapsed = time.perf_counter() - start
        mapper.unmap(list(arena.stats.mapped))
        mapper.close()
    if errors:
        raise RuntimeError(f"the mapping thread failed in variant {variant.name}") from errors[0]
    return {"phases": {name: summarize(ts) for name, ts in times.items()},
            "all": summarize([t for ts in times.values() for t in ts]),
            "pages_mapped_per_s": round(counts["maps"] / elapsed, 1),
            "pages_unmapped_per_s": round(counts["unmaps"] / elapsed, 1), "cycles": counts["cycles"],
            "refused_maps": arena.stats.failed_maps - failed}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--buffers", type=int, default=64, help="K and V buffers (llama-3.1-8b: 32 layers, 64)")
    parser.add_argument("--page-mb", type=float, default=2.0, help="an elastic page's share of one buffer")
    parser.add_argument("--pages", type=int, default=128, help="pages mapped and unmapped in each row")
    parser.add_argument("--keep-free-frac", type=float, default=0.2,
                        help="the margin the engine keeps (1 - --mem-fraction-static), a share of the device")
    parser.add_argument("--graph-mb", type=float, default=256.0, help="each of the graph's two copy buffers")
    parser.add_argument("--step-ms", type=float, default=3.0, help="the graph's replay time to aim for")
    parser.add_argument("--measure-s", type=float, default=3.0, help="seconds of steps in each interference row")
    parser.add_argument("--ahead", type=int, default=8, help="pages the background thread asks the mapper at a time")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="interference variants, comma-separated")
    parser.add_argument("--pace-ms", type=float, default=100.0, help="fresh rows: ms between asks of --ahead pages")
    parser.add_argument("--skip", default="", help="'rates', 'interference' and/or 'fresh'")
    args = parser.parse_args(argv)
    unknown = set(filter(None, args.variants.split(","))) - set(VARIANTS)
    if unknown:
        parser.error(f"--variants: unknown {sorted(unknown)}; known {list(VARIANTS)}")
    return args


def emit(row: dict) -> None:
    print(json.dumps(row), flush=True)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = torch.device(args.device)
    gran = granularity(device)
    page = max(gran, round(args.page_mb * 2**20 / gran) * gran)
    keep_free = int(torch.cuda.mem_get_info(device)[1] * args.keep_free_frac) if device.type == "cuda" else 0
    arena = make_arena([page] * args.buffers, args.pages, device, keep_free)
    probed = (getattr(arena, "span_access", False), getattr(arena, "span_unmap", False))
    common = {"device": str(device), "buffers": args.buffers, "page_mb": page / 2**20,
              "page_bytes_all_buffers": arena.bytes_per_page, "pages": args.pages}
    if device.type == "cuda":
        common["gpu"] = torch.cuda.get_device_name(device)
    pages = list(range(args.pages))
    try:
        look_us = None
        if device.type == "cuda":
            start = time.perf_counter()
            for _ in range(200):
                torch.cuda.mem_get_info(device)
            look_us = round(1e6 * (time.perf_counter() - start) / 200, 2)
        emit({"bench": "elastic_vmm_setup", **common, "span_access": probed[0], "span_unmap": probed[1],
              "keep_free_gb": round(keep_free / 1e9, 2), "mem_get_info_us": look_us})
        if "rates" not in args.skip:
            for run, span, zero, margin in rate_configs(probed, args.pages, cuda=device.type == "cuda"):
                set_switches(arena, keep_free if margin else 0, zero, span, probed)
                emit({"bench": "elastic_vmm_rate", **common, "run": run or args.pages, "span": span and any(probed),
                      "zero": zero, "margin": margin, **rate_row(arena, pages, run, device)})
        if "interference" not in args.skip:
            interference(arena, pages, args, device, keep_free, probed, common)
        if "fresh" not in args.skip:
            fresh_or_reused(arena.page_bytes, args, device, keep_free, common)
    finally:
        sync(device)
        arena.close()


def rate_configs(probed: tuple[bool, bool], pages: int, cuda: bool) -> list[tuple[int, bool, bool, bool]]:
    """(pages a call, range calls, zeroing, margin) for each rate row; the
    range calls off only where the probe turned them on, the other switches
    only on CUDA."""
    runs = [run for run in RUNS if run < pages]  # 0 (all of them) included
    rows = [(run, True, True, True) for run in runs]
    if any(probed):
        rows += [(run, False, True, True) for run in runs if run != 1]
    if cuda:
        rows += [(1, True, False, True), (1, True, True, False), (runs[-2] if len(runs) > 2 else 0, True, False, True)]
    return rows


def interference(arena: VirtualArena, pages: list[int], args: argparse.Namespace, device: torch.device,
                 keep_free: int, probed: tuple[bool, bool], common: dict) -> None:
    step, step_ms = calibrated_step(args.graph_mb, args.step_ms, device)
    base = {"bench": "elastic_vmm_interference", **common, "graph_mb": args.graph_mb, "copies": step.copies,
            "ahead": args.ahead}
    alone = summarize(timed_steps(step, args.measure_s).get("alone", []))
    emit({**base, "variant": "alone", "calibrated_ms": round(step_ms, 3), **alone})
    for name in filter(None, args.variants.split(",")):
        variant = VARIANTS[name]
        if variant.name == "runs_no_span" and not any(probed):
            continue  # the same as "runs" here
        set_switches(arena, keep_free if variant.margin else 0, variant.zero, variant.span, probed)
        row = interference_row(arena, pages, step, variant, args.measure_s, args.ahead)
        for ph in row["phases"].values():
            ph["slowdown_pct"] = slowdown_pct(alone.get("mean_ms", 0), ph.get("mean_ms"))
        row["all"]["slowdown_pct"] = slowdown_pct(alone.get("mean_ms", 0), row["all"].get("mean_ms"))
        emit({**base, "variant": name, "map_batch": variant.map_batch, "unmap_batch": variant.unmap_batch,
              "margin": variant.margin, "zero": variant.zero, "span": variant.span and any(probed), **row})
    set_switches(arena, keep_free, True, True, probed)
    again = summarize(timed_steps(step, args.measure_s).get("alone", []))
    emit({**base, "variant": "alone_again", **again,
          "drift_pct": slowdown_pct(alone.get("mean_ms", 0), again.get("mean_ms"))})


def paced_pass(arena: VirtualArena, step: CopyStep, ahead: int, pace_s: float) -> dict:
    """Steps while a thread maps all of ``arena``'s pages, ``ahead`` every
    ``pace_s`` seconds; unmapped again after the steps stop."""
    mapper = PageMapper(arena, background=True, map_batch=MAP_BATCH)
    done, errors = threading.Event(), []

    def grow() -> None:
        try:
            for chunk in chunks(list(range(arena.num_pages)), ahead):
                mapper.map_ahead(chunk)
                mapper.drain()
                time.sleep(pace_s)
        except BaseException as exc:  # noqa: BLE001 -- raised in the main thread below
            errors.append(exc)
        done.set()

    worker = threading.Thread(target=grow, name="elastic-vmm-grow")
    start = time.perf_counter()
    worker.start()
    times: list[float] = []
    while not done.is_set():
        times += timed_steps(step, 0.05).get("alone", [])
    worker.join()
    elapsed = time.perf_counter() - start
    mapper.unmap(list(arena.stats.mapped))
    mapper.close()
    if errors:
        raise RuntimeError("the mapping thread failed") from errors[0]
    return {**summarize(times), "seconds": round(elapsed, 3), "map_s": round(arena.stats.map_s, 3)}


def fresh_or_reused(page_bytes: list[int], args: argparse.Namespace, device: torch.device, keep_free: int,
                    common: dict) -> None:
    step, step_ms = calibrated_step(args.graph_mb, args.step_ms, device)
    base = {"bench": "elastic_vmm_fresh", **common, "graph_mb": args.graph_mb, "copies": step.copies,
            "ahead": args.ahead, "pace_ms": args.pace_ms}
    alone = summarize(timed_steps(step, args.measure_s).get("alone", []))
    emit({**base, "case": "alone", "calibrated_ms": round(step_ms, 3), **alone})
    first = make_arena(page_bytes, args.pages, device, keep_free)
    second = None
    try:
        for case, arena in (("new_range_new_memory", first), ("same_range_reused_memory", first),
                            ("new_range_reused_memory", None)):
            if arena is None:
                arena = second = make_arena(page_bytes, args.pages, device, keep_free)
            arena.stats.map_s = 0.0
            row = paced_pass(arena, step, args.ahead, args.pace_ms / 1e3)
            row["slowdown_pct"] = slowdown_pct(alone.get("mean_ms", 0), row.get("mean_ms"))
            emit({**base, "case": case, **row})
    finally:
        sync(device)
        for arena in (first, second):
            if arena is not None:
                arena.close()


if __name__ == "__main__":
    main(sys.argv[1:])
