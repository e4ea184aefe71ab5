"""A prefill server and a decode server (SmolLM2, fp32, CPU, pages of 4
tokens) for tests/test_disagg_server.py and tests/test_disagg_faults.py:
their flags, a request sent to both halves at once with one bootstrap room
(as SGLang's router does), how a half that failed reads, and the
scheduler's figures that say where a request stands."""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx

from server_harness import ServerProcess

PAGE_SIZE = 4
GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
_rooms = random.Random(10)


def new_room() -> int:
    return _rooms.getrandbits(63)


def model_args(pool_tokens: int = 4096) -> tuple[str, ...]:
    """SmolLM2 in fp32 with a KV pool of ``pool_tokens`` tokens, its invariant checked after every step."""
    return ("--dtype", "float32", "--page-size", str(PAGE_SIZE), "--max-total-tokens", str(pool_tokens),
            "--max-running-requests", "16", "--check-invariants")


def prefill_args(bootstrap_port: int) -> tuple[str, ...]:
    return ("--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(bootstrap_port))


DECODE_ARGS = ("--disaggregation-mode", "decode")


def generate(url: str, body: dict, timeout: float = 120) -> httpx.Response:
    return httpx.post(url + "/generate", json=body, timeout=timeout)


@dataclass
class PDPair:
    """A prefill server, a decode server, and the prefill's bootstrap port."""

    prefill: ServerProcess
    decode: ServerProcess
    bootstrap_port: int

    def body(self, input_ids: list[int], room: int | None = None, sampling_params: dict = GREEDY, **extra) -> dict:
        """A request body bound to this pair's bootstrap server, in a new room unless given one."""
        return {"input_ids": input_ids, "sampling_params": sampling_params, "bootstrap_host": "127.0.0.1",
                "bootstrap_port": self.bootstrap_port, "bootstrap_room": new_room() if room is None else room,
                **extra}

    def generate(self, input_ids: list[int], **extra) -> tuple[httpx.Response, httpx.Response]:
        """The same request to the prefill and the decode server at once."""
        body = self.body(input_ids, **extra)
        with ThreadPoolExecutor(2) as pool:
            prefill = pool.submit(generate, self.prefill.url, body)
            decode = pool.submit(generate, self.decode.url, body)
            return prefill.result(), decode.result()


def abort_message(out: httpx.Response) -> str:
    """The message of a request aborted on purpose (``/abort_request``): a
    finished request whose finish_reason is an abort, as in SGLang."""
    assert out.status_code == 200, out.text
    reason = out.json()["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and "status_code" not in reason, reason
    return reason["message"]


def failure_message(out: httpx.Response) -> str:
    """The message of a request the server failed (a KV transfer that could
    not end): HTTP 500, as SGLang answers it."""
    assert out.status_code == 500, out.text
    return out.json()["error"]["message"]


def replica_states(srv: ServerProcess) -> list[dict]:
    """The scheduler state of each of the server's ``--dp-size`` replicas, in dp-rank order."""
    return httpx.get(srv.url + "/get_server_info", headers=srv.headers(), timeout=10).json()["internal_states"]


def kv_used(srv: ServerProcess) -> int:
    """The KV tokens the server's replicas hold, together."""
    return sum(state["kv_used"] for state in replica_states(srv))


def scheduler_pids(srv: ServerProcess) -> list[int]:
    """The server's scheduler processes in launch order: replica by replica, each's TP ranks in order."""
    return [pid for role, pid in srv.children().items() if role.startswith("scheduler")]


def assert_memory_ok(*procs: ServerProcess, timeout: float = 60) -> None:
    """Every replica of each server goes idle within ``timeout`` s (nothing
    running, waiting or in transfer) with its memory invariant holding."""
    for proc in procs:
        deadline, states = time.monotonic() + timeout, replica_states(proc)
        while any(state["memory_check"] == "busy" for state in states) and time.monotonic() < deadline:
            time.sleep(0.2)
            states = replica_states(proc)
        for state in states:
            assert state["memory_check"] == "ok", (proc.url, state.get("dp_rank"), state["memory_check"])
            assert state["running"] == state["waiting"] == 0, (proc.url, state)
