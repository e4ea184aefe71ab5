"""What every child process of the server (scheduler, detokenizer) does to
die with its parent: the kernel signals it when the parent dies (Linux), its
loop also checks the parent between steps, its sockets never linger, and the
last one out removes the IPC directory a killed parent could not. And what
each of the server's processes does once it has started
(:func:`freeze_startup_objects`)."""

from __future__ import annotations

import ctypes
import gc
import logging
import multiprocessing
import os
import shutil
import signal
import sys

import zmq

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15  # the name ps, top and /proc/PID/comm show (15 bytes)
PARENT_DEATH_SIGNAL = signal.SIGUSR2


class ParentWatch:
    """Install in a child at start-up; ``alive()`` is cheap enough to call every step.
    On Linux it also names the process after its role (``ps``, ``top``).

    The kernel sends ``PARENT_DEATH_SIGNAL`` when the thread that started the
    child exits: for a Python parent, its main thread, so the whole process
    is going. A signal of its own (not SIGTERM, which the parent sends to
    stop a child it will clean up after) says so without asking
    ``getppid()``, which still names the dying process while its other
    threads exit."""

    def __init__(self, ipc_dir: str | None = None):
        self.parent = os.getppid()
        self.ipc_dir = ipc_dir
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the parent decides
        signal.signal(PARENT_DEATH_SIGNAL, lambda *_: self.exit_orphaned())
        if sys.platform.startswith("linux"):
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, PARENT_DEATH_SIGNAL, 0, 0, 0)
            # the role, not "python": "scheduler", "scheduler-tp1", "detokenizer" (the process's name)
            libc.prctl(_PR_SET_NAME, ctypes.c_char_p(multiprocessing.current_process().name.encode()[:15]), 0, 0, 0)
        if not self.alive():  # the parent died before the kernel was told to warn us
            self.exit_orphaned()

    def alive(self) -> bool:
        return os.getppid() == self.parent

    def exit_orphaned(self) -> None:
        """The parent is gone: clean up what it would have, and leave now."""
        logger.error("the server process is gone; exiting")
        if self.ipc_dir:
            shutil.rmtree(self.ipc_dir, ignore_errors=True)
        os._exit(1)


def freeze_startup_objects() -> int:
    """Collect, then move every object alive into the collector's permanent
    generation (``gc.freeze``); returns how many. Call once a process has
    started, before it serves. What start-up leaves (torch, transformers, the
    tokenizer, the model's Python objects: some 300,000 objects in the HTTP
    process) lives as long as the process, yet each full collection would
    walk all of it, a pause of a third of a second on a small CPU, in the
    middle of serving; and the last collection at exit took seconds. SGLang
    offers the same as ``POST /freeze_gc``, for its users to call after a
    warm-up."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def zmq_context() -> zmq.Context:
    """A context whose sockets drop unsent messages on close, so that exiting never blocks."""
    ctx = zmq.Context(2)
    ctx.setsockopt(zmq.LINGER, 0)
    return ctx
