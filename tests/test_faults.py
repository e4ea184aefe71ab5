"""Dead and stuck processes, and the operator's limits, against real servers
(tiny-llama on the CPU, in subprocesses): a killed child ends every request
with an error and the server with it; a killed server leaves no process and
no IPC directory behind; idle sockets, queues and slow requests are cut off;
garbage on the IPC sockets is dropped; /metrics never waits for the scheduler."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx
import msgpack
import pytest
import zmq

from radixserve.entrypoints.launcher import scheduler_addr
from server_harness import ServerProcess, alive, start_all, wait_for

TINY = ("--model-path", "tiny-llama", "--max-total-tokens", "4096")
LONG = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True}}
# A KV pool with room for _in_flight_then's six LONG requests at once: in a smaller one the last are
# admitted only as the scheduler's reservation for their outputs decays, seconds later.
IN_FLIGHT_POOL = ("--max-total-tokens", "16384")
# On a GPU, RADIXSERVE_FAULT_SERVER_ARGS names a larger model than these ("--model-path qwen3-0.6b ..."):
FAULT_SERVER_ARGS = os.environ.get("RADIXSERVE_FAULT_SERVER_ARGS")
# The default model (SmolLM2) decodes slowly enough on a CPU that requests are still in flight when the
# shutdown's grace period (5 s) ends;
REAL = tuple((FAULT_SERVER_ARGS or "--max-total-tokens 16384").split())
# a server that is killed needs them in flight only when it is killed, some 0.3 s after they start:
# tiny-llama takes about 5 s for the six on a 2-core CPU.
KILLED = tuple(FAULT_SERVER_ARGS.split()) if FAULT_SERVER_ARGS else (*TINY, *IN_FLIGHT_POOL)


def ipc_dirs(tmp: Path) -> list[Path]:
    return sorted(tmp.glob("radixserve-ipc-*"))


async def _long_request(ac: httpx.AsyncClient, stream: bool, started: asyncio.Event) -> tuple[int, dict | None, float]:
    """(status, the error body or event if any, seconds after the kill it ended)."""
    body = {**LONG, "stream": stream}
    if not stream:  # its response starts only when it ends
        started.set()
    async with ac.stream("POST", "/generate", json=body) as r:
        if not stream:
            data = json.loads(await r.aread())
            return r.status_code, data.get("error") if isinstance(data, dict) else None, time.monotonic()
        error = None
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                started.set()
                event = json.loads(line[len("data: "):])
                error = event.get("error", error)
        return r.status_code, error, time.monotonic()


def _in_flight_then(srv: ServerProcess, action) -> list[tuple[int, dict | None, float]]:
    """Start 3 streaming and 3 plain long requests, run ``action`` once they
    run, return how each ended (times relative to the action)."""

    async def run():
        async with httpx.AsyncClient(base_url=srv.url, timeout=60) as ac:
            started = [asyncio.Event() for _ in range(6)]
            tasks = [asyncio.create_task(_long_request(ac, i % 2 == 0, started[i])) for i in range(6)]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 30)
            await asyncio.sleep(0.3)
            t0 = time.monotonic()
            action()
            results = await asyncio.gather(*tasks, return_exceptions=True)
            return [r if isinstance(r, BaseException) else (r[0], r[1], r[2] - t0) for r in results]

    return asyncio.run(run())


def _assert_answered(results: list, within: float, expected) -> None:
    """Every client got an answer that ``expected(error)`` accepts, within ``within`` seconds."""
    for res in results:
        assert not isinstance(res, BaseException), f"a client got no answer: {res!r}"
        status, error, after = res
        assert expected(error), res
        assert after < within, f"the answer came {after:.1f}s after the event"


def _wait_exit(proc: subprocess.Popen, seconds: float) -> int | None:
    try:
        return proc.wait(seconds)
    except subprocess.TimeoutExpired:
        return None


def killed_rank_args(server_args: tuple) -> tuple[str, ...]:
    """The arguments of a server of several scheduler ranks (``server_args``)
    for ``check_a_killed_rank_ends_everything``."""
    return (*server_args, *IN_FLIGHT_POOL, "--dist-timeout", "20")


def check_a_killed_rank_ends_everything(srv: ServerProcess, victim: str) -> None:
    """A server of several scheduler ranks (started with ``killed_rank_args``)
    whose rank ``victim`` (``ServerProcess.children``'s name) is killed while
    requests decode: every request ends with a 503 and the server exits
    non-zero, its other children with it."""
    try:
        kids = srv.children()
        results = _in_flight_then(srv, lambda: os.kill(kids[victim], signal.SIGKILL))
        _assert_answered(results, 30, lambda error: error is not None and error["code"] == 503)
        code = _wait_exit(srv.proc, 40)
        assert code is not None and code != 0, "the server exits non-zero"
        wait_for(lambda: not any(alive(pid) for pid in kids.values()), 30, "every child's exit")
    finally:
        srv.stop()


# The tests that kill or stop a server each get a fresh one, all started side by side (each TMPDIR,
# and so its IPC directory, its own): a tiny-llama server's start-up keeps about one core busy.
REAL_USES = ("scheduler", "detokenizer", "killed-server", "sigterm")


@pytest.fixture(scope="module")
def real_servers(tmp_path_factory):
    """A fresh server for each of ``REAL_USES`` (``REAL`` for the SIGTERM
    one, which logs to ``.tmp / "server.log"``, ``KILLED`` for the others),
    with ``.tmp``, its TMPDIR. Whatever a test left running is stopped at the end."""
    tmps = [tmp_path_factory.mktemp(name) for name in REAL_USES]
    servers = start_all(*[REAL if name == "sigterm" else KILLED for name in REAL_USES],
                        envs=[{"TMPDIR": str(tmp)} for tmp in tmps],
                        options=[{"log_path": tmp / "server.log"} if name == "sigterm" else {}
                                 for name, tmp in zip(REAL_USES, tmps)])
    for srv, tmp in zip(servers, tmps):
        srv.tmp = tmp
    try:
        yield dict(zip(REAL_USES, servers))
    finally:
        for srv in servers:
            srv.stop()


@pytest.mark.slow
@pytest.mark.parametrize("victim", ["scheduler", "detokenizer"])
def test_a_killed_child_ends_every_request_and_the_server(real_servers, victim):
    srv = real_servers[victim]
    tmp_path = srv.tmp
    try:
        kids = srv.children()
        assert len(ipc_dirs(tmp_path)) == 1
        results = _in_flight_then(srv, lambda: os.kill(kids[victim], signal.SIGKILL))
        _assert_answered(results, 10, lambda error: error is not None and error["code"] == 503 and victim in error["message"])
        assert {r[0] for r in results} == {200, 503}, "streams fail with an error event, the others with a 503"
        code = _wait_exit(srv.proc, 30)
        assert code is not None and code != 0, "the server exits non-zero within 30 s"
        wait_for(lambda: not any(alive(pid) for pid in kids.values()), 10, "every child's exit after the server's")
        assert ipc_dirs(tmp_path) == [], "the IPC directory is removed"
    finally:
        srv.stop()


@pytest.mark.slow
def test_a_killed_server_leaves_no_process_behind(real_servers):
    srv = real_servers["killed-server"]
    tmp_path = srv.tmp
    kids = srv.children()
    try:
        _in_flight_then(srv, lambda: os.kill(srv.proc.pid, signal.SIGKILL))
        wait_for(lambda: not any(alive(p) for p in kids.values()), 15, "every child's exit with the server")
        assert ipc_dirs(tmp_path) == [], "the last child out removes the IPC directory"
    finally:
        for pid in kids.values():
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        srv.stop()


@pytest.mark.slow
def test_sigterm_with_requests_in_flight_ends_them_and_exits_0(real_servers):
    """The requests still running after the grace period end with a 503; the
    scheduler is then asked to close (its cache tiers' writes land), not killed."""
    srv = real_servers["sigterm"]
    tmp_path = srv.tmp
    kids = srv.children()
    try:
        results = _in_flight_then(srv, lambda: srv.proc.send_signal(signal.SIGTERM))
        # finished in the grace period, or ended with a 503
        _assert_answered(results, 15, lambda error: error is None or error["code"] == 503)
        assert _wait_exit(srv.proc, 30) == 0
        wait_for(lambda: not any(alive(p) for p in kids.values()), 10, "every child's exit after the server's")
        assert ipc_dirs(tmp_path) == []
        assert "[scheduler] closed" in (tmp_path / "server.log").read_text()
    finally:
        srv.stop()


# -- limits and stuck processes, on one server ---------------------------------------------


def _warm(srv: ServerProcess) -> ServerProcess:
    """One request first: a GPU compiles its kernels on the first forward."""
    r = httpx.post(srv.url + "/generate", json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 8}}, timeout=120)
    assert r.status_code in (200, 504), r.text
    return srv


@pytest.fixture(scope="module")
def tiny_servers(tmp_path_factory):
    """``limited`` and ``timed``, started side by side; each must shut down cleanly at the end."""
    tmp = tmp_path_factory.mktemp("ipc")
    servers = start_all((*TINY, "--max-running-requests", "2", "--max-queued-requests", "2",
                         "--http-header-timeout", "1", "--max-connections", "16"),
                        (*TINY, "--request-timeout", "0.5"),
                        envs=[{"TMPDIR": str(tmp), "RADIXSERVE_HEALTH_CHECK_TIMEOUT": "1"}, None],
                        options=[{"log_path": tmp / "server.log"}, {}])
    servers[0].tmp = tmp
    try:
        yield [_warm(srv) for srv in servers]
    finally:
        codes = [srv.stop() for srv in servers]
    assert codes == [0, 0]


@pytest.fixture(scope="module")
def limited(tiny_servers):
    return tiny_servers[0]


@pytest.fixture(scope="module")
def timed(tiny_servers):
    return tiny_servers[1]


def _whole(srv: ServerProcess) -> None:
    """No request state is left and the KV pool is whole."""
    state = srv.wait_idle()
    assert state["memory_check"] == "ok" and state["running"] == 0 and state["waiting"] == 0
    assert httpx.post(srv.url + "/flush_cache").status_code == 200


def test_idle_and_half_sent_connections_are_closed(limited):
    socks = [socket.create_connection(("127.0.0.1", limited.port)) for _ in range(20)]
    socks[0].sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\n")  # headers never finished
    try:
        wait_for(lambda: httpx.get(limited.url + "/health").status_code == 503, 10,
                 "a refusal past --max-connections")
        deadline = time.monotonic() + 10  # --http-header-timeout is 1 s
        for s in socks:
            s.settimeout(max(deadline - time.monotonic(), 0.01))
            assert s.recv(1) == b"", "the server closed a connection that sent no request in time"
        wait_for(lambda: httpx.get(limited.url + "/health").status_code == 200, 10, "serving again")
    finally:
        for s in socks:
            s.close()


def test_a_full_queue_answers_429_and_too_large_a_request_400(limited):
    short = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}}

    async def run():
        async with httpx.AsyncClient(base_url=limited.url, timeout=30) as ac:
            return await asyncio.gather(*(ac.post("/generate", json=short) for _ in range(12)))

    replies = asyncio.run(run())
    codes = sorted(r.status_code for r in replies)
    assert 200 in codes and 429 in codes and set(codes) <= {200, 429}, codes
    busy = next(r for r in replies if r.status_code == 429)
    assert busy.headers["retry-after"] == "1" and busy.json()["error"]["type"] == "rate_limit_error"
    r = httpx.post(limited.url + "/generate", json={**short, "sampling_params": {"max_new_tokens": 4, "n": 5}})
    assert r.status_code == 400 and "at most 4" in r.json()["error"]["message"]
    _whole(limited)


def test_a_slow_request_times_out_with_504(timed):
    r = httpx.post(timed.url + "/generate", json=LONG, timeout=30)
    assert r.status_code == 504 and "--request-timeout" in r.json()["error"]["message"]
    r = httpx.post(timed.url + "/generate", json={**LONG, "stream": True}, timeout=30)
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    assert r.status_code == 200 and events[-1]["error"]["code"] == 504
    _whole(timed)


def test_garbage_on_the_ipc_sockets_is_dropped(limited):
    (ipc,) = ipc_dirs(limited.tmp)
    ctx = zmq.Context()
    try:
        sockets = {}
        addresses = {"scheduler": scheduler_addr(str(ipc), 0), "detokenizer": f"ipc://{ipc}/detokenizer",
                     "tokenizer": f"ipc://{ipc}/tokenizer"}
        for name, address in addresses.items():
            sockets[name] = ctx.socket(zmq.PUSH)
            sockets[name].setsockopt(zmq.LINGER, 2000)
            sockets[name].connect(address)
        junk = [b"\x00junk", msgpack.packb(5), msgpack.packb(["NoSuchMessage", {}]),
                msgpack.packb(["TokenizedGenerateReqInput", {"rid": 5, "input_ids": "x"}]),
                msgpack.packb(["TokenizedGenerateReqInput", {"rid": "r1", "input_ids": [10 ** 9], "sampling_params": {}}]),
                msgpack.packb(["TokenizedGenerateReqInput", {"rid": "r2", "input_ids": [1], "sampling_params": {"n": "x"}}]),
                msgpack.packb(["BatchTokenIDOut", {"rids": ["r3"], "new_ids": [[1]], "meta": "x"}])]
        for sock in sockets.values():
            for data in [*junk, msgpack.packb(["EndOfJunk", {}])]:
                sock.send(data)
        # A socket's messages arrive in order: once each process has logged
        # dropping the last one, it has handled all of them.
        log = limited.tmp / "server.log"
        ends = ("[scheduler] dropped a malformed message: unknown message type 'EndOfJunk'",
                "[detokenizer] dropped a malformed message: unknown message type 'EndOfJunk'",
                "dropped a message from the detokenizer: ValueError: unknown message type 'EndOfJunk'")
        wait_for(lambda: all(end in log.read_text() for end in ends), 30, "every process's drop of the last message")
    finally:
        ctx.destroy(linger=2000)
    r = httpx.post(limited.url + "/generate", json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4}})
    assert r.status_code == 200 and len(r.json()["output_ids"]) == 4
    assert all(alive(pid) for pid in limited.children().values())
    _whole(limited)


def test_metrics_do_not_wait_for_a_stopped_scheduler_and_health_generate_times_out(limited):
    scheduler = limited.children()["scheduler"]
    os.kill(scheduler, signal.SIGSTOP)
    try:
        r = httpx.get(limited.url + "/metrics", timeout=5)
        assert r.status_code == 200 and "radixserve:num_running_reqs" in r.text
        r = httpx.get(limited.url + "/health_generate", timeout=10)
        assert r.status_code == 503 and "no token generated" in r.json()["error"]["message"]
    finally:
        os.kill(scheduler, signal.SIGCONT)
    assert httpx.get(limited.url + "/health_generate", timeout=10).status_code == 200
    _whole(limited)
