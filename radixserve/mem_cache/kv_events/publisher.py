"""Publishing KV event batches over ZeroMQ, as SGLang and vLLM do.

Each batch goes out on a PUB socket as three frames: the topic, an 8-byte
big-endian sequence number (0, 1, 2, ... per publisher) and the msgpack
payload (events.py). The last ``buffer_steps`` batches are kept for a ROUTER
replay socket: a client sends a start sequence number (8 bytes, big-endian)
and gets back every kept batch from it on, each as (topic, sequence,
payload), then the end marker (b"", sequence -1, b""). A gap that replay
cannot fill (the batches are no longer kept, or were dropped before being
sent) means the consumer's view of this replica is incomplete.

Without an ``endpoint`` the PUB socket is bound to port 5557 of the
server's ``--host`` (SGLang binds ``tcp://*:5557``, every interface); an
endpoint given is used as written. Replica ``dp_rank`` publishes on the
endpoint's port + ``dp_rank`` (and the replay endpoint's port + ``dp_rank``),
puts its rank in every batch, and is its TP rank 0's alone (the other ranks
hold the same cache).

``publish`` never blocks the scheduler: it hands the batch to a background
thread through a bounded queue, and counts a batch it finds no room for as
dropped (leaving a gap in the sequence numbers). The events of such batches,
and of those the socket refuses, are counted by why (``dropped_events``,
``radixserve:kv_events_dropped_total`` in ``/metrics``). A slow subscriber
loses messages at the PUB socket's high-water mark, as ZeroMQ's PUB sockets
do: silently, for that subscriber alone, which sees the gap in the sequence
numbers and can replay it.
"""

from __future__ import annotations

import atexit
import json
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, fields, replace

import zmq

from radixserve.mem_cache.kv_events.events import EventBatch, KVCacheEvent, encode_batch
from radixserve.mem_cache.kv_events.recorder import event_block_size

logger = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)  # the sequence number that ends a replay
_POLL_S = 0.05  # how long the thread waits for a batch before looking at replay requests again
DEFAULT_PORT = 5557  # SGLang's
DROP_REASONS = ("queue_full", "send_failed")  # why events are not sent live (``ZmqEventPublisher.dropped_events``)


@dataclass(frozen=True)
class KVEventsConfig:
    """``--kv-events-config``: a JSON object with SGLang's keys (vLLM's
    ``enable_kv_cache_events`` is understood too), plus ``block_size``, the
    tokens per block events count in (default: the page size, or 16 when it
    is 1). Unlike SGLang, a config without ``publisher`` publishes over ZMQ;
    ``"publisher": "null"`` turns events off."""

    publisher: str = "zmq"
    endpoint: str | None = None  # None: bind DEFAULT_PORT on the server's --host (``on_host``)
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # the PUB socket's high-water mark, in messages
    max_queue_size: int = 100_000  # batches waiting for the publisher thread
    topic: str = ""
    bind: bool | None = None  # None: bind a wildcard, ipc or inproc endpoint, connect any other
    block_size: int | None = None

    @classmethod
    def from_json(cls, text: str) -> "KVEventsConfig":
        """Parse and check ``--kv-events-config``; ValueError names the problem."""
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--kv-events-config: not JSON ({exc})") from exc
        if not isinstance(raw, dict):
            raise ValueError("--kv-events-config: expected a JSON object")
        raw = dict(raw)
        raw.pop("format", None)  # SGLang's "dynamo" format differs only for salted or LoRA caches: none here
        if raw.pop("enable_kv_cache_events", True) is False:  # vLLM's switch
            raw["publisher"] = "null"
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(raw) - set(known))
        if unknown:
            raise ValueError(f"--kv-events-config: unknown key(s) {unknown}; known: {sorted(known)}")
        config = cls(**raw)
        config._check()
        return config

    def _check(self) -> None:
        if self.publisher not in ("zmq", "null"):
            raise ValueError(f"--kv-events-config: publisher must be 'zmq' or 'null', got {self.publisher!r}")
        if not isinstance(self.topic, str):
            raise ValueError("--kv-events-config: topic must be a string")
        for name in ("endpoint", "replay_endpoint"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise ValueError(f"--kv-events-config: {name} must be a string")
        for name, low in (("buffer_steps", 1), ("hwm", 0), ("max_queue_size", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"--kv-events-config: {name} must be an integer >= {low}, got {value!r}")
        if self.block_size is not None and (not isinstance(self.block_size, int) or self.block_size < 1):
            raise ValueError(f"--kv-events-config: block_size must be a positive integer, got {self.block_size!r}")
        if self.bind not in (None, True, False):
            raise ValueError(f"--kv-events-config: bind must be true, false or null, got {self.bind!r}")

    def on_host(self, host: str) -> KVEventsConfig:
        """This config with its endpoint settled: without one, ``DEFAULT_PORT``
        of ``host`` (the server's ``--host``), bound unless ``bind`` says otherwise."""
        if self.endpoint is not None:
            return self
        address = f"[{host}]" if ":" in host else host
        return replace(self, endpoint=f"tcp://{address}:{DEFAULT_PORT}", bind=self.bind is not False)


def offset_endpoint(endpoint: str | None, dp_rank: int) -> str | None:
    """Replica ``dp_rank``'s endpoint: the TCP port + ``dp_rank``, or
    ``_dp<rank>`` appended to an ipc or inproc address (vLLM's rule)."""
    if not endpoint or dp_rank == 0:
        return endpoint
    if endpoint.startswith(("inproc://", "ipc://")):
        return f"{endpoint}_dp{dp_rank}"
    if endpoint.startswith("tcp://"):
        host, _, port = endpoint.rpartition(":")
        if port.isdigit():
            return f"{host}:{int(port) + dp_rank}"
    raise ValueError(f"--kv-events-config: cannot offset endpoint {endpoint!r} for dp rank {dp_rank}: "
                     "expected tcp://host:port, ipc:// or inproc://")


def _binds(endpoint: str) -> bool:
    return endpoint.startswith(("ipc://", "inproc://")) or any(w in endpoint for w in ("*", "0.0.0.0", "::"))


class ZmqEventPublisher:
    """Replica ``dp_rank``'s PUB socket, replay socket and sending thread.
    The sockets are bound (or connected) here, so a port in use fails at
    construction; after that only the thread uses them. A config without an
    endpoint publishes at ``host`` (``KVEventsConfig.on_host``)."""

    def __init__(self, config: KVEventsConfig, dp_rank: int = 0, host: str = "127.0.0.1"):
        self.config = config = config.on_host(host)
        self.dp_rank = dp_rank
        self.endpoint = offset_endpoint(config.endpoint, dp_rank)
        self.replay_endpoint = offset_endpoint(config.replay_endpoint, dp_rank)
        self._topic = config.topic.encode()
        ctx = zmq.Context.instance()
        self._pub = ctx.socket(zmq.PUB)
        self._replay = None
        try:
            self._pub.setsockopt(zmq.SNDHWM, config.hwm)
            self._pub.setsockopt(zmq.LINGER, 0)
            self._pub.setsockopt(zmq.IPV6, int("[" in self.endpoint))  # ZMQ takes IPv4 addresses only without it
            bind = config.bind if config.bind is not None else _binds(self.endpoint)
            (self._pub.bind if bind else self._pub.connect)(self.endpoint)
            if self.replay_endpoint is not None:
                self._replay = ctx.socket(zmq.ROUTER)
                # a whole replay fits, with room: the socket's credit lags what the client has read
                self._replay.setsockopt(zmq.SNDHWM, 2 * config.buffer_steps + 1000)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.setsockopt(zmq.IPV6, int("[" in self.replay_endpoint))
                self._replay.bind(self.replay_endpoint)
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise RuntimeError(f"KV events: cannot open {self.endpoint} / {self.replay_endpoint}: {exc}") from exc
        self._queue: queue.Queue = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._next_seq = 0
        self.sent = 0  # batches handed to the PUB socket
        self.dropped = 0  # batches the queue had no room for
        # events never sent live: the queue had no room for their batch, or the socket refused it (replay has it)
        self.dropped_events = dict.fromkeys(DROP_REASONS, 0)
        self.replays = 0  # replay requests answered
        self._closing = False
        self._thread = threading.Thread(target=self._run, name=f"kv-events-dp{dp_rank}", daemon=True)
        self._thread.start()
        atexit.register(self.close)

    @property
    def next_seq(self) -> int:
        """The sequence number the next batch will get (batches published so far)."""
        return self._next_seq

    def publish(self, events: list[KVCacheEvent]) -> int | None:
        """Queue one batch; returns its sequence number (None for no events).
        Never blocks: a full queue drops the batch."""
        if not events:
            return None
        if self._closing:
            raise RuntimeError("KV events: publish after close")
        seq, self._next_seq = self._next_seq, self._next_seq + 1
        try:
            self._queue.put_nowait((seq, EventBatch(time.time(), events, self.dp_rank)))
        except queue.Full:
            self.dropped += 1
            self.dropped_events["queue_full"] += len(events)
            if self.dropped == 1 or self.dropped % 1000 == 0:
                logger.warning("KV events: the publisher queue is full; %d batches dropped", self.dropped)
        return seq

    def stats(self) -> dict:
        return {"published": self._next_seq, "sent": self.sent, "dropped": self.dropped, "replays": self.replays,
                "queued": self._queue.qsize(), **self.drop_stats()}

    def drop_stats(self) -> dict[str, int]:
        """The events dropped so far, by why, as the scheduler reports them (``/metrics``)."""
        return {f"kv_events_dropped_{why}": n for why, n in self.dropped_events.items()}

    def close(self, timeout: float = 2.0) -> None:
        """Send what is queued (for up to ``timeout`` seconds), stop the thread, close the sockets."""
        if self._closing:
            return
        self._closing = True
        atexit.unregister(self.close)
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("KV events: the publisher thread did not stop; %d batches unsent", self._queue.qsize())

    # -- the thread ----------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                while self._replay is not None and self._replay.poll(0):
                    self._serve_replay()
                try:
                    seq, batch = self._queue.get(timeout=_POLL_S)
                except queue.Empty:
                    if self._closing:
                        return
                    continue
                self._send(seq, batch)
        except Exception:  # never take the scheduler down; the consumers see the gap
            logger.exception("KV events: the publisher thread failed")
        finally:
            self._close_sockets()

    def _send(self, seq: int, batch: EventBatch) -> None:
        payload = encode_batch(batch)
        seq_bytes = seq.to_bytes(8, "big")
        try:
            self._pub.send_multipart([self._topic, seq_bytes, payload], flags=zmq.NOBLOCK)
            self.sent += 1
        except zmq.ZMQError as exc:  # lost live, but replay still has it
            self.dropped_events["send_failed"] += len(batch.events)
            if self.dropped_events["send_failed"] == len(batch.events):
                logger.warning("KV events: the PUB socket refused a batch (%s); counting what it refuses", exc)
        self._buffer.append((seq, payload))

    def _serve_replay(self) -> None:
        """Answer one request: [identity, (a REQ's empty delimiter), start sequence].
        A DEALER client receives every reply; a REQ client only the first."""
        *reply, request = self._replay.recv_multipart()  # the route back: identity and delimiter
        if len(request) == 8:
            start = int.from_bytes(request, "big", signed=True)
            for seq, payload in list(self._buffer):
                if seq >= start:
                    self._replay.send_multipart(reply + [self._topic, seq.to_bytes(8, "big"), payload])
        else:
            logger.warning("KV events: a replay request of %d bytes (expected 8)", len(request))
        self._replay.send_multipart(reply + [b"", END_SEQ, b""])
        self.replays += 1

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)


def create_publisher(config_json: str | None, dp_rank: int = 0, page_size: int = 1,
                     host: str = "127.0.0.1") -> ZmqEventPublisher | None:
    """Replica ``dp_rank``'s publisher for ``--kv-events-config`` (without
    an endpoint, at ``host``: the server's ``--host``), or None when events
    are off. ValueError for a bad config (``block_size`` must hold whole
    pages), RuntimeError for an endpoint it cannot open."""
    if not config_json:
        return None
    config = KVEventsConfig.from_json(config_json)
    event_block_size(page_size, config.block_size)
    return ZmqEventPublisher(config, dp_rank, host) if config.publisher == "zmq" else None
