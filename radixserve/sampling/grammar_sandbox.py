"""Trial compiles: a grammar is compiled once in a child process under a
memory and a time limit before the scheduler compiles it for real.

Compiling a grammar (xgrammar's token-mask precomputation) can take far more
memory and time than the text of the grammar suggests: 8,000 enum properties
in a 0.3 MB JSON schema took 1.7 GB and 14 s on a 49k-token vocabulary, and a
few times that many take any machine down. The cost depends on the grammar's
states times the vocabulary, so no estimate from the text is safe. Instead,
the edge (the TokenizerManager, or the offline Engine) hands each new grammar
to a :class:`GrammarSandbox` before anything is queued: a worker process
compiles it with the same compiler settings under ``RLIMIT_DATA`` (the limit
per compile) and an alarm, and the caller waits at most the time limit. A
grammar over either bound is a ``ValueError`` naming its field (HTTP 400);
the worker is replaced, and the scheduler, which compiles only grammars that
passed, never sees it. Verdicts are kept by digest, so a grammar is tried
once, and a repeated bomb costs nothing.

The worker is a plain child (``python -m radixserve.sampling.grammar_sandbox
READ_FD WRITE_FD``) that speaks msgpack over two pipes; it is started on the
first grammar (importing xgrammar takes about 2 s) and leaves when its pipe
closes.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import resource
import select
import signal
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import msgpack

from radixserve.feature_args import CompileLimits
from radixserve.sampling.grammar import COMPILE_THREADS, compile_spec, first_line

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 120.0  # a worker's start (importing xgrammar, the vocabulary)
VERDICTS_KEPT = 4096  # digests of grammars tried, least recently used out


class GrammarSandbox:
    """Tries grammars in a worker process, one at a time, for one tokenizer
    and vocabulary. ``submit`` is thread-safe and returns at once; ``check``
    waits. ``refused`` counts the grammars over a bound since start."""

    def __init__(self, tokenizer, vocab_size: int, limits: CompileLimits):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.limits = limits
        self.refused = 0
        self._lock = threading.Lock()
        self._verdicts: OrderedDict[bytes, Future] = OrderedDict()
        self._runner = ThreadPoolExecutor(1, thread_name_prefix="grammar-trial")
        self._worker: _Worker | None = None
        self._vocab_json: str | None = None

    def submit(self, kind: str, text: str) -> Future:
        """A future that completes with None when ``(kind, text)`` compiles
        within the limits, or fails with ``ValueError("<kind>: ...")`` (kept
        as the grammar's verdict) or another error (the sandbox failed; not kept)."""
        key = hashlib.blake2b(f"{kind}\0{text}".encode(), digest_size=16).digest()
        with self._lock:
            fut = self._verdicts.get(key)
            if fut is not None and not fut.cancelled():
                self._verdicts.move_to_end(key)
                return fut
            fut = self._verdicts[key] = self._runner.submit(self._try, key, kind, text)
            while len(self._verdicts) > VERDICTS_KEPT:
                self._verdicts.popitem(last=False)
            return fut

    def check(self, kind: str, text: str) -> None:
        """Raise ``ValueError("<kind>: ...")`` for a grammar over a limit."""
        self.submit(kind, text).result()

    def close(self) -> None:
        self._runner.shutdown(wait=False, cancel_futures=True)
        if self._worker is not None:
            self._worker.stop()
            self._worker = None

    def _try(self, key: bytes, kind: str, text: str) -> None:
        try:
            if self._worker is not None and self._worker.proc.poll() is not None:  # died since (killed by hand, OOM)
                self._worker.stop()
                self._worker = None
            if self._worker is None:
                self._worker = _Worker(self._vocab(), self.limits)
            reply = self._worker.compile(kind, text)
        except Exception:
            with self._lock:
                self._verdicts.pop(key, None)
            raise
        if reply.get("ok"):
            return
        if reply.get("invalid"):  # the edge's cheaper check let it through, the compiler did not
            raise ValueError(f"{kind}: invalid {kind.replace('_', ' ')}: {reply['invalid']}")
        self._worker.stop()  # over a bound: its memory may not come back, so start afresh
        self._worker = None
        self.refused += 1
        why = reply["over"]
        logger.warning("refused a %s grammar of %d characters: %s", kind, len(text), why)
        raise ValueError(f"{kind}: this grammar is too large to compile: {why}")

    def _vocab(self) -> str:
        if self._vocab_json is None:
            import xgrammar

            info = xgrammar.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size)
            self._vocab_json = info.serialize_json()
        return self._vocab_json


class _Worker:
    """The parent's end of one worker process."""

    def __init__(self, vocab_json: str, limits: CompileLimits):
        self.limits = limits
        to_child_r, self._to_child = os.pipe()
        self._from_child, from_child_w = os.pipe()
        self.proc = subprocess.Popen([sys.executable, "-m", __name__, str(to_child_r), str(from_child_w)],
                                     pass_fds=(to_child_r, from_child_w), stdin=subprocess.DEVNULL)
        os.close(to_child_r)
        os.close(from_child_w)
        self._unpacker = msgpack.Unpacker(raw=False)
        self._send({"vocab": vocab_json, "threads": COMPILE_THREADS})
        if not self._recv(START_TIMEOUT_S).get("ready"):
            self.stop()
            raise RuntimeError("the grammar sandbox did not start")

    def compile(self, kind: str, text: str) -> dict:
        """The worker's reply: ``{"ok": True}``, ``{"invalid": message}`` or ``{"over": why}``."""
        limits = self.limits
        self._send({"kind": kind, "text": text, "max_mb": limits.max_mb, "timeout_s": limits.timeout_s})
        reply = self._recv(limits.timeout_s)
        if reply:
            return reply
        if self.proc.poll() is None:
            return {"over": f"compiling it takes more than {limits.timeout_s:g} s (--grammar-compile-timeout)"}
        return {"over": f"compiling it needs more than {limits.max_mb} MB (--grammar-compile-max-mb; "
                        f"the trial compile ended with exit code {self.proc.returncode})"}

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()
        for fd in (self._to_child, self._from_child):
            os.close(fd)

    def _send(self, msg: dict) -> None:
        data = memoryview(msgpack.packb(msg))
        while data:
            data = data[os.write(self._to_child, data):]

    def _recv(self, timeout_s: float) -> dict:
        """The next message, or ``{}`` when the worker died or ``timeout_s`` passed."""
        deadline = time.monotonic() + timeout_s
        while True:
            for msg in self._unpacker:
                return msg
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._from_child], [], [], left)[0]:
                return {}
            data = os.read(self._from_child, 1 << 16)
            if not data:
                self.proc.wait()
                return {}
            self._unpacker.feed(data)


# -- the worker process ---------------------------------------------------------------------------

def _data_bytes() -> int:
    """This process's private writable memory (what ``RLIMIT_DATA`` counts)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmData:"):
                return int(line.split()[1]) * 1024
    return 0


def _compile_bounded(compiler, msg: dict) -> dict:
    """Compile one grammar under ``max_mb`` more data memory and an alarm
    (SIGALRM's default action ends the process: the compile never yields
    to Python). The compiled grammar is dropped; only the verdict returns."""
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    limit = _data_bytes() + msg["max_mb"] * 2**20
    resource.setrlimit(resource.RLIMIT_DATA, (limit if hard == resource.RLIM_INFINITY else min(limit, hard), hard))
    signal.alarm(math.ceil(msg["timeout_s"]) + 1)
    try:
        compile_spec(compiler, msg["kind"], msg["text"])
        return {"ok": True}
    except MemoryError:
        return {"over": f"compiling it needs more than {msg['max_mb']} MB (--grammar-compile-max-mb)"}
    except (RuntimeError, ValueError, TypeError, KeyError, AttributeError) as exc:
        if "bad_alloc" in str(exc):  # the C++ side ran out under the limit
            return {"over": f"compiling it needs more than {msg['max_mb']} MB (--grammar-compile-max-mb)"}
        return {"invalid": first_line(exc)}
    finally:
        signal.alarm(0)
        resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))
        _TRIM(0)  # give the compile's freed heap back, so the worker stays small


def _malloc_trim():
    """glibc's ``malloc_trim(0)``, or a no-op where there is none."""
    try:
        import ctypes

        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return lambda *_: 0


_TRIM = _malloc_trim()


def _serve(read_fd: int, write_fd: int) -> None:
    reader = os.fdopen(read_fd, "rb", buffering=0)
    writer = os.fdopen(write_fd, "wb", buffering=0)
    unpacker = msgpack.Unpacker(reader, raw=False, max_buffer_size=1 << 31)
    hello = next(unpacker)
    import xgrammar

    info = xgrammar.TokenizerInfo.deserialize_json(hello["vocab"])
    compiler = xgrammar.GrammarCompiler(info, max_threads=hello["threads"], cache_enabled=False)
    writer.write(msgpack.packb({"ready": True}))
    for msg in unpacker:  # ends when the parent closes its end (or dies)
        writer.write(msgpack.packb(_compile_bounded(compiler, msg)))


if __name__ == "__main__":
    _serve(int(sys.argv[1]), int(sys.argv[2]))
