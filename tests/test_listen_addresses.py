"""Where the server's sockets listen (docs/limits.md, "Listening sockets"):
at ``--host`` or loopback by default, never on every interface unless asked.

A prefill server at ``--host 127.0.0.1`` with two TP ranks and KV events on
their default endpoint, after a request went through it to a decode server
(so the transfer's pair groups exist too): every TCP socket its processes
and the decode server's listen on is at 127.0.0.1. Below that, torch's
pieces on their own: a TCP store and the TP ranks' groups listen at the
address they were given (127.0.0.2 is loopback too, but not where this
machine's name resolves to, which is where gloo listens by default).
"""

from __future__ import annotations

import os
import socket
import struct
from datetime import timedelta

import httpx
import pytest
import torch
import torch.distributed as dist

from disagg_server_harness import DECODE_ARGS, PDPair, prefill_args
from radixserve.distributed.tcp_store import listening_store
from radixserve.mem_cache.kv_events import KVEventsConfig, ZmqEventPublisher
from radixserve.mem_cache.kv_events.publisher import DEFAULT_PORT
from server_harness import free_port, start_all
from tp_harness import run_ranks

TINY = ("--model-path", "tiny-llama", "--load-format", "dummy", "--device", "cpu", "--dtype", "float32",
        "--max-total-tokens", "2048", "--host", "127.0.0.1")
LIMITS = {"SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "60", "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "60",
          "OMP_NUM_THREADS": "1"}
_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp


def _address(hex_address: str) -> tuple[str, int]:
    """A /proc/net/tcp{,6} ``local_address``: the address in host-order 32-bit words, then the port."""
    words, port = hex_address.split(":")
    raw = bytes.fromhex(words)
    host_order = struct.pack(f"={len(raw) // 4}I", *struct.unpack(f">{len(raw) // 4}I", raw))
    family = socket.AF_INET if len(raw) == 4 else socket.AF_INET6
    return socket.inet_ntop(family, host_order), int(port, 16)


def descendants(pid: int) -> list[int]:
    """``pid`` and every process below it."""
    parents = {}
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
        except (ValueError, OSError):
            continue
    found, frontier = [pid], [pid]
    while frontier:
        frontier = [child for child, parent in parents.items() if parent in frontier]
        found += frontier
    return found


def listening(pids: list[int]) -> set[tuple[str, int]]:
    """The (address, port) of every TCP socket the processes ``pids`` listen on."""
    inodes = set()
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:  # gone meanwhile
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(int(target[len("socket:["):-1]))
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == _LISTEN and int(fields[9]) in inodes:
                    found.add(_address(fields[1]))
    return found


def _port_taken(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


@pytest.mark.slow
def test_a_prefill_server_at_loopback_listens_only_there():
    """A prefill server (two TP ranks, KV events on their default endpoint)
    and a decode server, both at ``--host 127.0.0.1``, after a transfer."""
    if _port_taken(DEFAULT_PORT):
        pytest.skip(f"port {DEFAULT_PORT} (the KV events' default) is taken on this machine")
    bootstrap_port = free_port()
    started = []
    try:
        started += start_all((*TINY, "--tp-size", "2", "--kv-events-config", '{"publisher": "zmq"}',
                              *prefill_args(bootstrap_port)), (*TINY, *DECODE_ARGS), env=LIMITS)  # side by side
        pair = PDPair(*started, bootstrap_port)
        prefill, decode = pair.generate([1, 5, 9, 33, 70, 2, 8])
        assert prefill.status_code == 200 and decode.status_code == 200, (prefill.text, decode.text)
        assert httpx.get(pair.prefill.url + "/health", timeout=10).status_code == 200
        for srv in started:
            sockets = listening(descendants(srv.proc.pid))
            assert ("127.0.0.1", srv.port) in sockets  # the HTTP server: the listing sees the server's sockets
            assert {host for host, _ in sockets} == {"127.0.0.1"}, sorted(sockets)
        prefill_sockets = listening(descendants(pair.prefill.proc.pid))
        assert {("127.0.0.1", bootstrap_port), ("127.0.0.1", DEFAULT_PORT)} <= prefill_sockets
    finally:
        exits = {srv.url: srv.stop() for srv in reversed(started)}
    assert set(exits.values()) <= {0}, f"each server shuts down cleanly: {exits}"


def test_a_tcp_store_listens_at_its_host_only():
    """torch's own store server listens on every interface whatever host it
    is given; this one listens at that host alone and serves as usual."""
    store = listening_store("127.0.0.2", 0, timedelta(seconds=10))
    port = store.port
    assert [host for host, p in listening([os.getpid()]) if p == port] == ["127.0.0.2"]
    with pytest.raises(OSError):  # another loopback address, as another interface would be
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    client = dist.TCPStore("127.0.0.2", port, is_master=False, timeout=timedelta(seconds=10))
    client.queue_push("q", b"x")  # the libuv server's queues, which the KV transfer's protocol uses
    assert store.queue_pop("q") == b"x"
    del client, store
    assert all(p != port for _, p in listening([os.getpid()])), "the port is released with the store"


def _rank_sockets(rank: int, tp_size: int, _local_init: str, init_method: str) -> list[tuple[str, int]]:
    from radixserve.distributed import init_tp_group

    group = init_tp_group(rank, tp_size, "cpu", init_method, timeout_s=20)
    group.all_reduce(torch.ones(2))  # both groups connected
    group.agree_min(rank)
    sockets = sorted(listening([os.getpid()]))
    group.barrier()
    group.destroy()
    return sockets


def test_tp_ranks_on_one_host_listen_at_the_rendezvous_host():
    """Rank 0's store and both ranks' gloo groups (the CPU group and, on
    CPU, the world) listen at the rendezvous host, not where gloo would."""
    with socket.socket() as s:
        s.bind(("127.0.0.2", 0))
        port = s.getsockname()[1]
    by_rank = run_ranks(_rank_sockets, 2, f"tcp://127.0.0.2:{port}")
    assert ("127.0.0.2", port) in by_rank[0]  # rank 0's store
    for sockets in by_rank:  # the store, and each gloo group's listener
        assert len(sockets) >= 2 and {host for host, _ in sockets} == {"127.0.0.2"}, sockets


def test_kv_events_default_endpoint_is_the_host():
    assert KVEventsConfig().on_host("127.0.0.1") == KVEventsConfig(endpoint=f"tcp://127.0.0.1:{DEFAULT_PORT}", bind=True)
    assert KVEventsConfig().on_host("::1").endpoint == f"tcp://[::1]:{DEFAULT_PORT}"
    explicit = KVEventsConfig(endpoint="tcp://*:6000")
    assert explicit.on_host("127.0.0.1") is explicit  # as written, a wildcard included


def test_kv_events_bind_an_ipv6_address():
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
            port = s.getsockname()[1]
    except OSError:
        pytest.skip("no IPv6 loopback here")
    publisher = ZmqEventPublisher(KVEventsConfig(endpoint=f"tcp://[::1]:{port}", bind=True))
    try:
        assert ("::1", port) in listening([os.getpid()])
    finally:
        publisher.close()
