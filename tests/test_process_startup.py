"""What the server's processes do at start-up: the main module a spawned
child imports again loads nothing, and the start-up objects are moved out of
the collector's reach (a stop took 4 s instead of 1.3 without it:
benchmarks/server_start_stop.py)."""

from __future__ import annotations

import gc
import subprocess
import sys

from radixserve.managers.child_process import freeze_startup_objects


def test_launch_server_imported_by_a_spawned_child_loads_nothing():
    """The server's children are spawned, and each imports the main module
    (``radixserve.launch_server``) again as ``__mp_main__``. That import must
    not load the HTTP server, nor torch, into each of them."""
    code = ("import runpy, sys; runpy.run_module('radixserve.launch_server', run_name='__mp_main__'); "
            "print(sorted(name for name in ('torch', 'fastapi', 'radixserve.entrypoints.http_server') "
            "if name in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]"


class Node:
    def __init__(self):
        self.other = None


def test_freezing_collects_the_garbage_then_freezes_what_lives():
    collected = []
    dead = Node()
    dead.other = Node()
    dead.other.other = dead  # a cycle: only the collector frees it
    gc.callbacks.append(lambda phase, info: phase == "stop" and collected.append(info["collected"]))
    alive = Node()
    del dead
    try:
        frozen = freeze_startup_objects()
        assert sum(collected) >= 2  # the cycle went before the freeze, not into the permanent generation
        # A frozen object that dies leaves the permanent generation, and other
        # threads of the suite (servers' clients, log handlers) free objects too.
        assert 0 < gc.get_freeze_count() <= frozen
        assert gc.is_tracked(alive)
        assert not any(obj is alive for generation in range(3) for obj in gc.get_objects(generation))  # frozen
    finally:
        gc.callbacks.pop()
        gc.unfreeze()
