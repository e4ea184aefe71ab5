"""Where a decode step's time goes: ``torch.profiler`` over a few steps of a
benchmark, as one table (``bench.one_batch --kernel-profile PATH``).

On a GPU the rows are the device's kernels and copies (CUDA graph replays
included: the profiler sees each kernel of a replay); on a CPU they are the
operators' own CPU time. Each row: the name, launches and microseconds per
step, and its share of the steps' total. On a GPU :func:`host_rows` adds the
host's side: the calls that took the host's time (runtime calls such as
``cudaGraphLaunch`` or ``cudaMemcpyAsync``, and operators, by their own CPU
time) and the steps' wall time, so a step's time that is no kernel's shows
where the host spent it, and :func:`idle_rows` the device's idle time on
the timeline: before a step's first kernel, between its kernels (with the
kernels that waited longest), after its last. A profiled run is extra,
after the timed one, so profiling never touches the reported figures.

    prof = decode_profiler(device, steps=8)
    with prof:
        ...  # the prefill, then prof.step() after it and after each decode step
    rows = kernel_rows(prof, device, steps=8) + host_rows(prof, steps=8) + idle_rows(*timeline(prof))
"""

from __future__ import annotations

import json

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity

TOP_ROWS = 40
TOP_HOST_ROWS = 15
TOP_IDLE_ROWS = 15
STEP_MARK = "ProfilerStep"  # the profiler's own range around each step: not work


def decode_profiler(device: torch.device, steps: int) -> torch.profiler.profile:
    """A profiler that records ``steps`` decode steps: ``step()`` is called
    after the prefill (skipped) and after each decode step; the first decode
    step warms the profiler up and is not recorded either."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    return torch.profiler.profile(
        activities=activities, schedule=torch.profiler.schedule(skip_first=1, wait=0, warmup=1, active=steps, repeat=1))


def kernel_rows(prof: torch.profiler.profile, device: torch.device, steps: int, top: int = TOP_ROWS) -> list[dict]:
    """The ``top`` rows by time (see the module docstring), most first; the
    last row, ``"(all)"``, sums every row, those left out included."""
    averages = prof.key_averages()
    if device.type == "cuda":
        timed = [(e, e.self_device_time_total) for e in averages if e.device_type == DeviceType.CUDA]
        if not timed:  # a profiler that files kernels under their operators: the operators' own device time
            timed = [(e, e.self_device_time_total) for e in averages]
    else:
        timed = [(e, e.self_cpu_time_total) for e in averages]
    timed = sorted(((e, us) for e, us in timed if us > 0 and not e.key.startswith(STEP_MARK)),
                   key=lambda t: t[1], reverse=True)
    total = sum(us for _, us in timed) or 1.0
    rows = [{"name": e.key[:200], "calls_per_step": round(e.count / steps, 2), "us_per_step": round(us / steps, 2),
             "share": round(us / total, 4)} for e, us in timed[:top]]
    rows.append({"name": "(all)", "calls_per_step": round(sum(e.count for e, _ in timed) / steps, 2),
                 "us_per_step": round(total / steps, 2), "share": 1.0})
    return rows


def host_rows(prof: torch.profiler.profile, steps: int, top: int = TOP_HOST_ROWS) -> list[dict]:
    """The host's side of the same steps (``"where": "host"``): the ``top``
    calls by their own CPU time, then ``"(step wall)"``, the steps' wall
    time (the profiler's step ranges), against which the kernels' total
    says how long the device sat idle."""
    averages = prof.key_averages()
    timed = sorted(((e, e.self_cpu_time_total) for e in averages
                    if e.device_type == DeviceType.CPU and e.self_cpu_time_total > 0 and not e.key.startswith(STEP_MARK)),
                   key=lambda t: t[1], reverse=True)
    rows = [{"where": "host", "name": e.key[:200], "calls_per_step": round(e.count / steps, 2),
             "us_per_step": round(us / steps, 2)} for e, us in timed[:top]]
    wall = sum(e.cpu_time_total for e in averages if e.key.startswith(STEP_MARK))
    rows.append({"where": "host", "name": "(step wall)", "calls_per_step": 1.0, "us_per_step": round(wall / steps, 2)})
    return rows


def timeline(prof: torch.profiler.profile) -> tuple[list[tuple[str, float, float]], list[tuple[float, float]]]:
    """The device's kernels and copies as ``(name, start_us, end_us)`` and the
    recorded steps as ``(start_us, end_us)``, both on the profiler's clock."""
    events = prof.events()
    work = [(e.name, e.time_range.start, e.time_range.end) for e in events
            if e.device_type == DeviceType.CUDA and e.time_range.end > e.time_range.start
            and not getattr(e, "is_user_annotation", False) and not e.name.startswith(STEP_MARK)]  # a range, not work
    steps = sorted((e.time_range.start, e.time_range.end) for e in events
                   if e.device_type == DeviceType.CPU and e.name.startswith(STEP_MARK))
    return work, steps


def idle_rows(work: list[tuple[str, float, float]], steps: list[tuple[float, float]],
              top: int = TOP_IDLE_ROWS) -> list[dict]:
    """Where the device sat idle in each step (``"where": "device idle"``),
    per step: ``"(before the first kernel)"`` (the host preparing the step),
    ``"(between kernels)"``, ``"(after the last kernel)"`` (the step's end:
    sampling's read-back, the host's bookkeeping), and ``"(busy)"``; then the
    ``top`` kernels by the idle time just before them (``"before NAME"``),
    which names what the device waited on. A kernel belongs to the step in
    which it starts; steps without one are left out."""
    if not steps:
        return []
    work = sorted(work, key=lambda w: w[1])
    lead = inner = tail = busy = 0.0
    counted = 0
    waits: dict[str, list[float]] = {}
    i = 0
    for start, end in steps:
        while i < len(work) and work[i][1] < start:
            i += 1
        first, reach = i, start
        while i < len(work) and work[i][1] < end:
            name, s, e = work[i]
            if i > first and s > reach:
                inner += s - reach
                waits.setdefault(name[:200], []).append(s - reach)
            busy += max(0.0, e - max(s, reach))
            reach = max(reach, e)
            i += 1
        if i == first:
            continue
        counted += 1
        lead += work[first][1] - start
        tail += max(0.0, end - reach)
    if not counted:
        return []
    rows = [{"where": "device idle", "name": name, "us_per_step": round(us / counted, 2)}
            for name, us in (("(before the first kernel)", lead), ("(between kernels)", inner),
                             ("(after the last kernel)", tail), ("(busy)", busy))]
    ranked = sorted(waits.items(), key=lambda kv: sum(kv[1]), reverse=True)[:top]
    rows += [{"where": "device idle", "name": f"before {name}", "calls_per_step": round(len(gaps) / counted, 2),
              "us_per_step": round(sum(gaps) / counted, 2)} for name, gaps in ranked]
    return rows


def write_rows(path: str, case: dict, rows: list[dict]) -> None:
    """Append ``rows`` to ``path`` as JSON lines, each with ``case``'s fields."""
    with open(path, "a") as f:
        for row in rows:
            f.write(json.dumps({**case, **row}) + "\n")
