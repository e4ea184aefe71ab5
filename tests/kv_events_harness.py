"""The router's side of KV events, for tests: SGLang's block hash computed
independently, a mirror that rebuilds a replica's cached blocks from the
event stream, and a ZMQ subscriber with replay."""

from __future__ import annotations

import hashlib
import json
import socket
import time

import msgpack
import zmq

from radixserve.mem_cache import RadixCache
from radixserve.mem_cache.kv_events import END_SEQ, ZmqEventPublisher


def sglang_block_hash(prefix: tuple[int, ...], block_size: int) -> int:
    """SGLang's page hash chain (mem_cache/utils.py get_hash_str +
    hash_str_to_int64), written out: the hash of the last block of ``prefix``."""
    prior_hex = None
    for start in range(0, len(prefix), block_size):
        h = hashlib.sha256()
        if prior_hex:
            h.update(bytes.fromhex(prior_hex))
        for t in prefix[start : start + block_size]:
            h.update(t.to_bytes(4, byteorder="little", signed=False))
        prior_hex = h.hexdigest()
    value = int(prior_hex[:16], 16)
    return value - 2**64 if value >= 2**63 else value


class Mirror:
    """A router's view of one replica's cache, from events only: block hash
    -> the token prefix that block ends. Strict: an unknown parent, a block
    stored twice or removed while absent, or a hash that is not SGLang's for
    its prefix fails the test."""

    def __init__(self):
        self.blocks: dict[int, tuple[int, ...]] = {}
        self.stored = self.removed = self.cleared = 0

    def apply(self, event: dict) -> None:
        kind = event["type"]
        if kind == "BlockStored":
            size, hashes, tokens = event["block_size"], event["block_hashes"], event["token_ids"]
            assert len(tokens) == size * len(hashes) and hashes
            parent = event["parent_block_hash"]
            prefix = () if parent is None else self.blocks[parent]
            for i, h in enumerate(hashes):
                prefix = prefix + tuple(tokens[i * size : (i + 1) * size])
                assert h not in self.blocks, "a block stored twice"
                assert h == sglang_block_hash(prefix, size), "not SGLang's hash for this prefix"
                self.blocks[h] = prefix
            self.stored += len(hashes)
        elif kind == "BlockRemoved":
            for h in event["block_hashes"]:
                del self.blocks[h]
            self.removed += len(event["block_hashes"])
        elif kind == "AllBlocksCleared":
            self.blocks.clear()
            self.cleared += 1
        else:
            raise AssertionError(f"unknown event {event!r}")

    def prefixes(self) -> set[tuple[int, ...]]:
        return set(self.blocks.values())


def tree_blocks(cache: RadixCache, block_size: int) -> set[tuple[int, ...]]:
    """The token prefix of every full block the tree holds."""
    out = set()

    def walk(node, path):
        for child in node.children.values():
            full = path + list(child.key)
            out.update(tuple(full[:n]) for n in range(block_size, len(full) + 1, block_size))
            walk(child, full)

    walk(cache.root, [])
    return out


def assert_mirrors(mirror: Mirror, cache: RadixCache, block_size: int) -> None:
    expected = tree_blocks(cache, block_size)
    assert mirror.prefixes() == expected
    assert set(mirror.blocks) == {sglang_block_hash(p, block_size) for p in expected}


class Subscriber:
    """One replica's stream as a router reads it: SUB for live batches, and a
    DEALER on the replay socket to fill a gap (the first batches, sent before
    the subscription took, come that way too)."""

    def __init__(self, ctx: zmq.Context, port: int, replay_port: int, topic: bytes = b""):
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic)
        self.sub.connect(f"tcp://127.0.0.1:{port}")
        self.replay = ctx.socket(zmq.DEALER)
        self.replay.connect(f"tcp://127.0.0.1:{replay_port}")
        self.topic = topic
        self.mirror = Mirror()
        self.next_seq = 0
        self.payloads: dict[int, bytes] = {}  # every batch applied, by sequence number
        self.live_seqs: list[int] = []  # in arrival order
        self.dp_ranks: set = set()

    def _apply(self, seq: int, payload: bytes) -> None:
        assert seq == self.next_seq, f"batch {seq} applied after {self.next_seq - 1}"
        ts, events, dp_rank = msgpack.unpackb(payload, raw=False)
        assert isinstance(ts, float) and abs(time.time() - ts) < 600
        self.dp_ranks.add(dp_rank)
        for event in events:
            self.mirror.apply(event)
        self.payloads[seq] = payload
        self.next_seq = seq + 1

    def poll(self, timeout_ms: int) -> bool:
        """Take the live batches waiting (up to ``timeout_ms`` for the first)."""
        got = False
        while self.sub.poll(timeout_ms if not got else 0):
            topic, seq_bytes, payload = self.sub.recv_multipart()
            assert topic == self.topic and len(seq_bytes) == 8
            seq = int.from_bytes(seq_bytes, "big")
            self.live_seqs.append(seq)
            got = True
            if seq > self.next_seq:
                self.catch_up()  # may bring this batch and later ones too
            if seq == self.next_seq:
                self._apply(seq, payload)
        return got

    def request_replay(self, start: int) -> list[tuple[int, bytes]]:
        self.replay.send_multipart([b"", start.to_bytes(8, "big")])
        out = []
        while True:
            assert self.replay.poll(5000), "no replay answer"
            empty, topic, seq_bytes, payload = self.replay.recv_multipart()
            assert empty == b""
            if seq_bytes == END_SEQ:
                assert topic == b"" and payload == b""
                return out
            assert topic == self.topic
            out.append((int.from_bytes(seq_bytes, "big"), payload))

    def catch_up(self) -> None:
        for seq, payload in self.request_replay(self.next_seq):
            if seq >= self.next_seq:
                self._apply(seq, payload)  # fails on a gap replay cannot fill

    def sync(self, publisher: ZmqEventPublisher, timeout: float = 10.0) -> None:
        """Until every batch published so far is applied."""
        deadline = time.monotonic() + timeout
        while self.next_seq < publisher.next_seq:
            assert time.monotonic() < deadline, f"at {self.next_seq}, published {publisher.next_seq}"
            if not self.poll(50):
                self.catch_up()

    def close(self) -> None:
        self.sub.close(linger=0)
        self.replay.close(linger=0)


def free_port_block(n: int) -> int:
    """A port p with p .. p+n-1 free (for a replica's endpoint + dp rank)."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("", 0))
            base = s.getsockname()[1]
        if base + n > 65535:
            continue
        socks = []
        try:
            for p in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free ports")


def events_config(dp_size: int = 1, **extra) -> tuple[str, int, int]:
    """A --kv-events-config on free ports; returns (json, pub port, replay port)."""
    pub, replay = free_port_block(dp_size), free_port_block(dp_size)
    while replay < pub + dp_size and pub < replay + dp_size:
        replay = free_port_block(dp_size)
    config = {"publisher": "zmq", "endpoint": f"tcp://*:{pub}", "replay_endpoint": f"tcp://*:{replay}",
              "topic": "kv", **extra}
    return json.dumps(config), pub, replay


def full_blocks(tokens: list[int], block_size: int = 16) -> set[tuple[int, ...]]:
    return {tuple(tokens[:n]) for n in range(block_size, len(tokens) + 1, block_size)}


def wait_until(check, what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)
