"""What the server's processes do at start-up: the main module a spawned
child imports again loads nothing, the scheduler ranks are made before the
main process loads torch, and the start-up objects are moved out of the
collector's reach (a stop took 4 s instead of 1.3 without it:
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


def test_the_ranks_are_made_before_torch_or_the_http_server_loads():
    """``entrypoints/serve.py`` starts the scheduler ranks before it imports
    the HTTP server, so that their start-up overlaps the main process's
    imports: loading it, parsing the arguments and making the ranks must
    load neither torch, transformers nor FastAPI."""
    code = ("import argparse, shutil, sys\n"
            "import radixserve.entrypoints.serve\n"
            "from radixserve.entrypoints import launcher\n"
            "from radixserve.server_args import ServerArgs\n"
            "parser = argparse.ArgumentParser()\n"
            "ServerArgs.add_cli_args(parser)\n"
            "args = ServerArgs.from_cli_args(parser.parse_args(['--model-path', 'tiny-llama', '--tp-size', '2']))\n"
            "ranks = launcher.scheduler_ranks(args)\n"
            "shutil.rmtree(ranks.ipc_dir)\n"
            "print([p.name for p, _ in ranks.children], sorted(name for name in ('torch', 'transformers', 'fastapi', "
            "'radixserve.entrypoints.http_server') if name in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "['scheduler', 'scheduler-tp1'] []"


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
