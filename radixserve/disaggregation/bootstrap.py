"""The bootstrap server a prefill server runs on ``--disaggregation-bootstrap-port``,
and the client calls that prefill and decode ranks make to it.

As in SGLang, it is a small HTTP server whose ``/route`` endpoint is a
directory of prefill ranks, keyed by (dp group, TP rank): a prefill server
of ``--dp-size`` D runs D replicas (dp groups) of ``--tp-size`` ranks each.

- ``PUT /route`` (JSON body): a prefill rank registers where it listens:
  ``{"role": "Prefill", "engine_rank", "tp_size", "dp_group", "dp_size",
  "rank_ip", "rank_port", "layout"}`` (``engine_rank``: its TP rank). A rank
  that registers again (a restarted process) replaces its entry.
- ``GET /route?engine_rank=R&target_dp_group=G`` (G is 0 when absent): a
  decode rank looks up rank R of dp group G; the answer is the registered
  JSON, 404 until it has registered. The entry of (0, 0) tells a decode rank
  the prefill server's dp size, tp size and KV layout.
- ``GET /health``: 200 ``OK``.

The server runs on the standard library's ``ThreadingHTTPServer`` in a
background thread of the process that owns it. Every client call has a time
limit and turns any failure (refused, silent, bad answer) into a
:class:`KVTransferError` naming the address.
"""

from __future__ import annotations

import http.client
import json
import logging
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

from radixserve.disaggregation.base import BaseKVBootstrapServer, KVTransferError

logger = logging.getLogger(__name__)

_REGISTRATION_FIELDS = {"engine_rank": int, "tp_size": int, "dp_group": int, "dp_size": int, "rank_ip": str,
                        "rank_port": int, "layout": dict}
_MAX_BODY_BYTES = 1 << 20


class _Server(ThreadingHTTPServer):
    daemon_threads = True  # a handler thread never holds the process open


class _V6Server(_Server):
    address_family = socket.AF_INET6


class KVBootstrapServer(BaseKVBootstrapServer):
    """The ``/route`` directory, served from a daemon thread until :meth:`close`.

    ``port`` 0 picks a free port; :attr:`port` is the one bound.
    """

    def __init__(self, host: str, port: int):
        self._lock = threading.Lock()
        self._ranks: dict[tuple[int, int], dict] = {}  # by (dp group, TP rank)
        self._httpd = (_V6Server if ":" in host else _Server)((host, port), _make_handler(self))
        self.host = host
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._httpd.serve_forever, name=f"kv-bootstrap-{self.port}", daemon=True)
        self._thread.start()
        logger.info("KV bootstrap server listening on %s:%d", host, self.port)

    @property
    def address(self) -> str:
        return join_address(self.host, self.port)

    def close(self) -> None:
        """Stop serving, release the port and wait for the serving thread."""
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> KVBootstrapServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _register(self, info: dict) -> None:
        with self._lock:
            self._ranks[info["dp_group"], info["engine_rank"]] = info
        logger.info("prefill rank %d of dp group %d registered at %s:%d", info["engine_rank"], info["dp_group"],
                    info["rank_ip"], info["rank_port"])

    def _lookup(self, dp_group: int, engine_rank: int) -> dict | None:
        with self._lock:
            return self._ranks.get((dp_group, engine_rank))


def _make_handler(server: KVBootstrapServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self):
            url = urlsplit(self.path)
            if url.path == "/health":
                return self._reply(200, "OK")
            if url.path != "/route":
                return self._reply(404, f"no route {url.path}")
            query = parse_qs(url.query)
            try:
                rank, group = int(query["engine_rank"][0]), int(query.get("target_dp_group", ["0"])[0])
            except (KeyError, ValueError):
                return self._reply(400, "GET /route needs an integer engine_rank (and target_dp_group, if any)")
            info = server._lookup(group, rank)
            if info is None:
                return self._reply(404, f"{rank_name(rank, group)} has not registered")
            return self._reply(200, json.dumps(info), "application/json")

        def do_PUT(self):
            if urlsplit(self.path).path != "/route":
                return self._reply(404, f"no route {self.path}")
            try:
                length = int(self.headers.get("Content-Length", "0"))
                if not 0 < length <= _MAX_BODY_BYTES:
                    raise ValueError(f"body of {length} bytes")
                info = _validate_registration(json.loads(self.rfile.read(length)))
                server._register(info)
            except (ValueError, TypeError) as e:
                return self._reply(400, f"bad registration: {e}")
            return self._reply(200, "OK")

        def _reply(self, status: int, body: str, content_type: str = "text/plain") -> None:
            data = body.encode()
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, fmt, *args):  # the default writes every request to stderr
            logger.debug("bootstrap %s: " + fmt, self.address_string(), *args)

    return Handler


def _validate_registration(info) -> dict:
    if not isinstance(info, dict) or info.get("role") != "Prefill":
        raise ValueError('expected a JSON object with "role": "Prefill"')
    for name, kind in _REGISTRATION_FIELDS.items():
        if not isinstance(info.get(name), kind) or isinstance(info.get(name), bool):
            raise ValueError(f"{name} must be {kind.__name__}, got {info.get(name)!r}")
    for rank, size in (("engine_rank", "tp_size"), ("dp_group", "dp_size")):
        if not 0 <= info[rank] < info[size]:
            raise ValueError(f"{rank} {info[rank]} is not in [0, {info[size]})")
    if not 0 < info["rank_port"] < 65536:
        raise ValueError(f"rank_port {info['rank_port']} is not a port")
    return {name: info[name] for name in ("role", *_REGISTRATION_FIELDS)}


def rank_name(engine_rank: int, dp_group: int) -> str:
    """How errors and logs name prefill rank ``engine_rank`` of ``dp_group``."""
    return f"prefill rank {engine_rank} of dp group {dp_group}"


def join_address(host: str, port: int) -> str:
    """``host:port``, with an IPv6 host in brackets (SGLang's bootstrap_addr)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def split_address(addr: str) -> tuple[str, int]:
    """``(host, port)`` of ``host:port`` or ``[v6-host]:port``; ValueError otherwise."""
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"a bootstrap address is host:port, got {addr!r}")
    return host.strip("[]"), int(port)


def _request(addr: str, method: str, path: str, body: dict | None, timeout_s: float) -> tuple[int, bytes]:
    """One HTTP request to the bootstrap server at ``addr``; every socket
    operation (the connect, each read) is limited to ``timeout_s``."""
    try:
        host, port = split_address(addr)
    except ValueError as e:
        raise KVTransferError(str(e)) from None
    start = time.monotonic()
    conn = http.client.HTTPConnection(host, port, timeout=timeout_s)
    try:
        data = None if body is None else json.dumps(body).encode()
        headers = {} if data is None else {"Content-Type": "application/json"}
        conn.request(method, path, body=data, headers=headers)
        resp = conn.getresponse()
        return resp.status, resp.read()
    except (OSError, http.client.HTTPException) as e:
        waited = time.monotonic() - start
        raise KVTransferError(
            f"bootstrap server at {addr} did not answer {method} {path} ({type(e).__name__}: {e}; after {waited:.1f} s)"
        ) from None
    finally:
        conn.close()


def register_prefill_rank(addr: str, info: dict, timeout_s: float = 5.0) -> None:
    """PUT this prefill rank's entry (see the module docstring) to ``addr``."""
    status, body = _request(addr, "PUT", "/route", {"role": "Prefill", **info}, timeout_s)
    if status != 200:
        raise KVTransferError(f"bootstrap server at {addr} refused the registration ({status}): {body.decode(errors='replace')}")


def query_prefill_rank(addr: str, engine_rank: int, dp_group: int = 0, timeout_s: float = 5.0) -> dict:
    """The entry prefill rank ``engine_rank`` of ``dp_group`` registered at ``addr``."""
    path = f"/route?engine_rank={int(engine_rank)}&target_dp_group={int(dp_group)}"
    status, body = _request(addr, "GET", path, None, timeout_s)
    if status != 200:
        raise KVTransferError(f"bootstrap server at {addr} has no {rank_name(engine_rank, dp_group)} ({status}): "
                              f"{body.decode(errors='replace')}")
    try:
        info = json.loads(body)
        return _validate_registration(info)
    except ValueError as e:
        raise KVTransferError(f"bootstrap server at {addr} answered with a bad entry: {e}") from None


def wait_for_prefill_rank(addr: str, engine_rank: int, dp_group: int, deadline: float, http_timeout_s: float,
                          stop=lambda: False) -> dict:
    """:func:`query_prefill_rank`, asked again while the rank has not
    registered (a prefill server still starting) until ``deadline``
    (``time.monotonic()``) or ``stop()``; then its 404 is raised."""
    while True:
        try:
            return query_prefill_rank(addr, engine_rank, dp_group, http_timeout_s)
        except KVTransferError as e:
            if "(404)" not in e.reason or time.monotonic() > deadline or stop():
                raise
        time.sleep(0.2)


def check_health(addr: str, timeout_s: float = 5.0) -> bool:
    """True when the bootstrap server at ``addr`` answers its health route."""
    try:
        return _request(addr, "GET", "/health", None, timeout_s)[0] == 200
    except KVTransferError:
        return False
