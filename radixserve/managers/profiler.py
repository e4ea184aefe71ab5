"""The torch profiler around a scheduler's steps, started and stopped over
HTTP (SGLang's ``/start_profile`` and ``/stop_profile``, with its fields).

Each TP rank profiles its own process and writes one Chrome trace,
``{output_dir}/{profile_prefix}{profile_id}-TP-{rank}.trace.json.gz``
(``-DP-{replica}-TP-{rank}`` under ``--dp-size``), which
Perfetto and ``chrome://tracing`` open. With ``start_step`` the profile
starts at that scheduler step (counted since launch); with ``num_steps`` it
stops by itself after that many steps, and the start request is answered
only then, once the traces are written (as SGLang does, so that a script
can read them when the call returns); otherwise at ``/stop_profile``.

Traces go only under the operator's ``--torch-profiler-dir``: a request's
``output_dir`` (relative to it, or absolute) must resolve inside it after
symlinks, or the request is refused before anything is created, so that a
client cannot make the server (often root) write where it chooses."""

from __future__ import annotations

import functools
import logging
import os
import time

import torch
from torch.profiler import record_function

from radixserve.managers.io_struct import ProfileReqOutput

logger = logging.getLogger(__name__)

ACTIVITIES = ("CPU", "GPU", "MEM")
_STRINGS = ("output_dir", "profile_id", "profile_prefix")
_FLAGS = ("with_stack", "record_shapes")
_STEPS = ("num_steps", "start_step")
_OFF = (None, False, [], "")  # SGLang's clients send these for options they leave unset


_active = False  # whether this process's profile is recording (a StepProfiler's, between _begin and _end)


def phase(name: str):
    """Decorator: name a scheduler phase in the traces, at the cost of one
    check while no profile records (``record_function`` costs microseconds)."""
    def wrap(fn):
        @functools.wraps(fn)
        def traced(*args, **kwargs):
            if not _active:
                return fn(*args, **kwargs)
            with record_function(name):
                return fn(*args, **kwargs)
        return traced
    return wrap


def resolve_output_dir(requested: str | None, root: str) -> str | None:
    """The directory a profile asking for ``requested`` writes to: that
    path (taken relative to ``root``; ``root`` itself when unset) with its
    symlinks and ``..`` resolved, or None when that lies outside ``root``.
    Creates nothing."""
    if requested and "\0" in requested:
        return None
    root = os.path.realpath(root)
    target = os.path.realpath(os.path.join(root, requested or ""))
    return target if os.path.commonpath([root, target]) == root else None


def _steps(value) -> int | None:
    """A step count given as an integer or, as SGLang's bench_serving sends it, a string of digits."""
    if isinstance(value, str) and value.strip().isdigit():
        return int(value)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def check_profile_options(options: dict, device: str, root: str) -> tuple[str, str] | None:
    """``(field, message)`` for the first invalid option of a start request
    on a server whose model runs on ``device`` and whose traces go under
    ``root`` (``--torch-profiler-dir``), or None."""
    for name, value in options.items():
        if name not in (*_STRINGS, *_FLAGS, *_STEPS, "activities") and value not in _OFF:
            return name, f"{name}: not supported by radixserve's profiler"
    activities = options.get("activities")
    if activities not in _OFF:
        if not isinstance(activities, list) or not all(isinstance(a, str) for a in activities):
            return "activities", "activities: a list of 'CPU', 'GPU', 'MEM'"
        for name in activities:
            if name not in ACTIVITIES:
                return "activities", f"activities: {name!r} is not supported here (supported: {', '.join(ACTIVITIES)})"
        if "GPU" in activities and not device.startswith("cuda"):
            return "activities", f"activities: 'GPU' needs a CUDA device; this server runs on {device}"
    for name in _STEPS:
        value = options.get(name)
        if value is not None and (_steps(value) is None or _steps(value) < (1 if name == "num_steps" else 0)):
            return name, f"{name}: a {'positive' if name == 'num_steps' else 'non-negative'} integer"
    for name in _FLAGS:
        if options.get(name) is not None and not isinstance(options[name], bool):
            return name, f"{name}: true or false"
    for name in _STRINGS:
        if options.get(name) is not None and not isinstance(options[name], str):
            return name, f"{name}: a string"
    for name in ("profile_id", "profile_prefix"):
        value = options.get(name)
        if value and (os.path.sep in value or value.startswith(".")):
            return name, f"{name}: a file name part (no path separators)"
    if resolve_output_dir(options.get("output_dir"), root) is None:
        return "output_dir", (f"output_dir: {options['output_dir']!r} is outside {root}, the only directory this "
                              "server writes traces under (--torch-profiler-dir)")
    return None


class StepProfiler:
    """One rank's profiler. ``start``, ``step`` and ``stop`` return the
    replies due now (``ProfileReqOutput``), each carrying its request's id."""

    def __init__(self, rank_name: str, device: torch.device, root: str):
        self.rank_name = rank_name  # "TP-0", or "DP-1-TP-0"
        self.device = device
        self.root = root  # --torch-profiler-dir: every trace goes under it
        self.steps = 0  # scheduler steps since launch
        self._options: dict | None = None  # the profile asked for, until it stops
        self._prof: torch.profiler.profile | None = None
        self._start_at = self._stop_at = None
        self._path = ""
        self._waiting_id: int | None = None  # a start request answered when the profile stops

    def start(self, options: dict, req_id: int) -> list[ProfileReqOutput]:
        if self._options is not None:
            return [ProfileReqOutput(req_id, False, "profiling is already in progress: call /stop_profile first")]
        bad = check_profile_options(options, self.device.type, self.root)  # on every rank, before creating anything
        if bad is not None:
            return [ProfileReqOutput(req_id, False, bad[1])]
        output_dir = resolve_output_dir(options.get("output_dir"), self.root)
        try:
            os.makedirs(output_dir, exist_ok=True)
        except OSError as exc:
            return [ProfileReqOutput(req_id, False, f"output_dir: cannot create {output_dir!r}: {exc.strerror}")]
        if not os.access(output_dir, os.W_OK):
            return [ProfileReqOutput(req_id, False, f"output_dir: {output_dir!r} is not writable")]
        name = (options.get("profile_prefix") or "") + (options.get("profile_id") or str(time.time()))
        self._path = os.path.join(output_dir, f"{name}-{self.rank_name}.trace.json.gz")
        self._options = options
        start_step, num_steps = _steps(options.get("start_step")), _steps(options.get("num_steps"))
        self._start_at = max(start_step, self.steps) if start_step is not None else self.steps
        self._stop_at = self._start_at + num_steps if num_steps else None
        if self._stop_at is not None:
            self._waiting_id = req_id
        if self._start_at <= self.steps:
            self._begin()
        if self._waiting_id is not None:
            return []
        return [ProfileReqOutput(req_id, True, "Start profiling.\n")]

    def _begin(self) -> None:
        default = ["CPU", "GPU"] if self.device.type == "cuda" else ["CPU"]
        names = self._options.get("activities") or default
        kinds = {"CPU": torch.profiler.ProfilerActivity.CPU, "GPU": torch.profiler.ProfilerActivity.CUDA}
        self._prof = torch.profiler.profile(
            activities=[kinds[n] for n in names if n in kinds] or [kinds["CPU"]],
            record_shapes=bool(self._options.get("record_shapes")),
            with_stack=bool(self._options.get("with_stack")),
            profile_memory="MEM" in names,
        )
        self._prof.start()
        global _active
        _active = True
        logger.info("profiling started (%s), trace to %s", ", ".join(names), self._path)

    def step(self) -> list[ProfileReqOutput]:
        """After a scheduler step: start a profile due at this step, or end one that has run its steps."""
        self.steps += 1
        if self._options is None:
            return []
        if self._prof is None and self.steps >= self._start_at:
            self._begin()
        if self._stop_at is not None and self.steps >= self._stop_at:
            return self._end()
        return []

    def stop(self, req_id: int) -> list[ProfileReqOutput]:
        if self._options is None:
            return [ProfileReqOutput(req_id, False, "profiling is not in progress: call /start_profile first")]
        return self._end(req_id)

    def _end(self, stop_id: int | None = None) -> list[ProfileReqOutput]:
        """Write the trace (if the profile began) and answer the waiting start and the stop."""
        global _active
        prof, self._prof, self._options, _active = self._prof, None, None, False
        message = "Stop profiling: no step ran, no trace written.\n"
        if prof is not None:
            prof.stop()
            prof.export_chrome_trace(self._path)
            logger.info("profiling stopped, trace written to %s", self._path)
            message = f"Stop profiling. Trace written to {self._path}\n"
        replies = [ProfileReqOutput(i, True, message) for i in (self._waiting_id, stop_id) if i is not None]
        self._waiting_id = None
        return replies
