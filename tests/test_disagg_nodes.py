"""Prefill/decode disaggregation with servers over two nodes (``--nnodes 2``,
``--tp-size 2``, a TP rank a node; here two processes on one machine that
meet at ``--dist-init-addr``; tiny-llama, dummy weights, fp32, CPU, gloo).

Node 0 of each server serves HTTP; node 1 runs its rank only. On the prefill
server only node 0 runs the bootstrap server, and the rank of node 1
registers with it there (at ``--dist-init-addr``'s host), so the decode
ranks find both prefill ranks. Checked: the decode server's greedy output,
logprobs and top logprobs equal a tp-1 engine's, both memory invariants
hold, and every process of both servers shuts down cleanly."""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from disagg_server_harness import DECODE_ARGS, PDPair, assert_memory_ok, prefill_args
from server_harness import ServerProcess, free_port, terminate
from test_disagg_faults import LIMITS
from test_disagg_tp import TINY, assert_serves_tp1_output, tp1_outputs  # noqa: F401  (a fixture)

pytestmark = pytest.mark.slow


class OtherNode:
    """``radixserve.launch_server`` as a node other than node 0: no HTTP, its ranks only."""

    def __init__(self, *args: str, env: dict):
        self.proc = subprocess.Popen([sys.executable, "-m", "radixserve.launch_server", *args],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, **env})

    def stop(self) -> int:
        return terminate(self.proc)


def two_nodes(*args: str) -> tuple[ServerProcess, OtherNode]:
    """A server of ``args`` over two nodes: node 1 is started first, node 0
    (which serves HTTP once every rank has loaded) is returned healthy."""
    nodes = ("--tp-size", "2", "--nnodes", "2", "--dist-init-addr", f"127.0.0.1:{free_port()}")
    other = OtherNode(*args, *nodes, "--node-rank", "1", env=LIMITS)
    try:
        return ServerProcess(*args, *nodes, "--node-rank", "0", env=LIMITS), other
    except BaseException:
        other.stop()
        raise


@pytest.fixture(scope="module")
def servers():
    port = free_port()
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(two_nodes, *TINY, *prefill_args(port)), pool.submit(two_nodes, *TINY, *DECODE_ARGS)]
    started = [f.result() for f in futures if f.exception() is None]
    try:
        for f in futures:
            if f.exception() is not None:
                raise f.exception()
        (prefill, prefill_node1), (decode, decode_node1) = started
        yield {"pair": PDPair(prefill, decode, port), "bootstrap_port": port}
    finally:
        # every node at once: a node left alone would see its peer's ranks go
        with ThreadPoolExecutor(4) as pool:
            codes = list(pool.map(lambda proc: proc.stop(), [proc for server in started for proc in server]))
        assert codes == [0] * len(codes), f"every node shuts down cleanly: {codes}"


def test_the_rank_of_node_1_registers_with_the_bootstrap_server_of_node_0(servers):
    route = f"http://127.0.0.1:{servers['bootstrap_port']}/route"
    entries = [httpx.get(route, params={"engine_rank": rank}, timeout=10).json() for rank in (0, 1)]
    assert [(e["engine_rank"], e["tp_size"]) for e in entries] == [(0, 2), (1, 2)]


def test_servers_over_two_nodes_serve_tp1_output(servers, tp1_outputs):  # noqa: F811
    pair = servers["pair"]
    assert_serves_tp1_output(pair, tp1_outputs)
    assert_memory_ok(pair.prefill, pair.decode)
