"""Start a real radixserve server in a subprocess for tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import httpx


# One torch thread in a server's scheduler: on a small CPU host the test's
# client and the server's tokenizer and detokenizer processes use the same
# cores, and an op spread over torch's threads waits for whichever of them is
# descheduled (on 2 cores this made a server's steps several times slower).
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``radixserve.launch_server`` with ``args``; ``env`` adds environment
    variables (``TMPDIR`` decides where its IPC directory goes); its output
    goes to ``log_path`` if given, else to a temporary file whose end a
    failed start-up's error shows (or to the console with
    ``RADIXSERVE_TEST_LOG=1``). Without ``warmup`` it starts with
    ``--skip-server-warmup``, so that a test's requests are the first the
    server sees (its figures and cache start empty); test_server_native.py
    tests the warm-up. A start-up that loses its port (``free_port``'s port
    taken by another process before the server binds it) is retried on another."""

    START_TRIES = 3

    def __init__(self, *args: str, api_key: str | None = None, timeout: float = 300, env: dict | None = None,
                 warmup: bool = False, log_path=None):
        self.api_key = api_key
        self._own_log = log_path is None and not os.environ.get("RADIXSERVE_TEST_LOG")
        self.log_path = tempfile.mkstemp(prefix="radixserve-server-", suffix=".log")[1] if self._own_log else log_path
        for attempt in range(1, self.START_TRIES + 1):
            self.port = free_port()
            self.url = f"http://127.0.0.1:{self.port}"
            cmd = [sys.executable, "-m", "radixserve.launch_server", "--port", str(self.port), *args]
            if not warmup:
                cmd.append("--skip-server-warmup")
            if api_key:
                cmd += ["--api-key", api_key]
            self.log = open(self.log_path, "w") if self.log_path is not None else None
            self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT if self.log else None,
                                         env={**os.environ, **(env or {})})
            try:
                self._wait(timeout)
                return
            except RuntimeError as e:
                if attempt == self.START_TRIES or "address already in use" not in str(e).lower():
                    raise

    def log_tail(self, lines: int = 30) -> str:
        """The end of the server's output, where it went to a file."""
        if self.log_path is None:
            return "(its output went to the console)"
        with open(self.log_path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])

    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def _wait(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.stop()
                raise RuntimeError(f"server exited with {self.proc.returncode} during start-up; "
                                   f"its output ended:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)  # a start-up takes seconds: a short poll answers sooner after it
        self.stop()
        raise RuntimeError(f"server did not become healthy in {timeout:g} s; its output ended:\n{self.log_tail()}")

    def state(self) -> dict:
        """The scheduler's internal state (its figures and ``memory_check``)."""
        info = httpx.get(self.url + "/get_server_info", headers=self.headers(), timeout=10).json()
        return info["internal_states"][0]

    def wait_idle(self, timeout: float = 60) -> dict:
        """Wait until no request runs; returns the scheduler's internal state."""
        deadline = time.monotonic() + timeout
        while True:
            state = self.state()
            if state["memory_check"] != "busy" or time.monotonic() > deadline:
                return state
            time.sleep(0.2)

    def kill(self) -> None:
        """SIGKILL the server and every child process at once, as when its machine dies."""
        if self.proc.poll() is None:
            for pid in [*self.children().values(), self.proc.pid]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            self.proc.wait()
        self.stop()

    def children(self) -> dict[str, int]:
        """The engine's child processes by role, the name each gives itself once
        started (``detokenizer``, ``scheduler`` (TP rank 0), ``scheduler-tp1``, ...,
        cut to 15 characters; a name taken already gets its pid appended), and
        any others as ``other-PID``."""
        with open(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children") as f:
            pids = [int(x) for x in f.read().split()]
        roles = {}
        for pid in pids:
            role = process_name(pid) if "spawn_main" in cmdline(pid) else "other"
            roles[role if role not in roles and role != "other" else f"{role}-{pid}"] = pid
        return roles

    def stop(self) -> int:
        terminate(self.proc)
        if self.log:
            self.log.close()
        return self.proc.returncode

    def __del__(self):
        if getattr(self, "_own_log", False) and os.path.exists(self.log_path):
            os.unlink(self.log_path)


def terminate(proc: subprocess.Popen, timeout: float = 30) -> int:
    """SIGTERM ``proc`` unless it has ended, SIGKILL it after ``timeout`` s; its exit code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def start_all(*arg_lists: tuple[str, ...], env: dict | None = None,
              envs: list[dict | None] | None = None, options: list[dict] | None = None) -> list[ServerProcess]:
    """One server per argument list, started side by side (a tiny-llama
    server's start-up keeps about one core busy: on two cores two take far
    less than twice as long as one; servers of several ranks, or SmolLM2's,
    gain little), each with ``env`` or its own of ``envs``, and its own of
    ``options`` (more ``ServerProcess`` keyword arguments: ``log_path``...).
    If one fails to start, the others are stopped before the error propagates."""
    envs = [env] * len(arg_lists) if envs is None else envs
    options = [{}] * len(arg_lists) if options is None else options
    assert len(envs) == len(arg_lists) == len(options)
    with ThreadPoolExecutor(max(len(arg_lists), 1)) as pool:
        futures = [pool.submit(ServerProcess, *args, env=e, **o) for args, e, o in zip(arg_lists, envs, options)]
    started = [f.result() for f in futures if f.exception() is None]
    failed = [f.exception() for f in futures if f.exception() is not None]
    if failed:
        for srv in started:
            srv.stop()
        raise failed[0]
    return started


class Prestarted:
    """Servers started one after another on a thread of their own, without
    waiting, so that they load while the tests before the ones that use
    them run (a module's tests mostly keep one core of two busy: one server,
    or a few ranks that wait for each other). ``specs``: name -> (arguments,
    ``ServerProcess`` keyword arguments). ``get(name)`` waits for that one;
    ``stop()`` stops every one started, and starts none of those not yet begun."""

    def __init__(self, specs: dict[str, tuple[tuple[str, ...], dict]]):
        self._pool = ThreadPoolExecutor(1)
        self._futures = {name: self._pool.submit(ServerProcess, *args, **kwargs)
                         for name, (args, kwargs) in specs.items()}

    def __contains__(self, name: str) -> bool:
        return name in self._futures

    def get(self, name: str) -> ServerProcess:
        return self._futures[name].result()

    def stop(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        for future in self._futures.values():
            if not future.cancelled() and future.exception() is None:
                future.result().stop()


def selected(request, fixturename: str) -> bool:
    """Whether a selected test of the session uses the fixture ``fixturename``
    (a fixture that starts servers for others starts theirs only if so)."""
    return any(fixturename in item.fixturenames for item in request.session.items)


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline") as f:
            return f.read().replace("\0", " ")
    except OSError:
        return ""


def process_name(pid: int) -> str:
    """The name the process gave itself (``/proc/PID/comm``); "" once it is gone."""
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_for(check, timeout: float, what: str, interval: float = 0.2):
    """``check()``'s first truthy value, polled until ``timeout`` seconds;
    AssertionError naming ``what`` if it never comes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"{what} did not happen within {timeout:g} s")
