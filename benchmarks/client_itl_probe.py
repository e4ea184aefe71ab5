"""How many streams can bench.serving time faithfully? JSON lines to stdout.

    python benchmarks/client_itl_probe.py [--streams 100 200 300] [--tick-ms 30] [--output-len 256]

A synthetic server (its own process, plain asyncio sockets, no engine) holds
every stream open and, once a tick, writes one event to each: ``/generate``'s
cumulative event (the reply's text and ``output_ids`` so far), as the
Scheduler's step does for its whole running batch. So every true inter-token
gap is one tick. bench.serving's ``send_request`` reads the streams and its
ITL percentiles are compared with the tick; a client that falls behind reads
events in bursts and reports gaps near 0 and far above the tick. The same
streams read with httpx (bench.serving's client before it took aiohttp) are
the baseline, in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import socket
import time

import numpy as np


def serve(port: int, tick_s: float, output_len: int, ready) -> None:
    streams: list[list] = []

    async def handle(reader, writer):
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(int(h.split(b":")[1]) for h in head.split(b"\r\n") if h.lower().startswith(b"content-length"))
        await reader.readexactly(length)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        done = asyncio.Event()
        streams.append([writer, 0, done])
        await done.wait()

    def event(k: int) -> bytes:
        finish = {"type": "length", "length": k} if k == output_len else None
        body = {"text": " word" * k, "output_ids": list(range(1000, 1000 + k)),
                "meta_info": {"id": "probe", "prompt_tokens": 1024, "completion_tokens": k, "cached_tokens": 0,
                              "finish_reason": finish, "e2e_latency": 0.0}}
        data = b"data: " + json.dumps(body).encode() + b"\n\n" + (b"data: [DONE]\n\n" if finish else b"")
        return b"%x\r\n%s\r\n" % (len(data), data) + (b"0\r\n\r\n" if finish else b"")

    async def ticker():
        while True:
            start = time.perf_counter()
            for s in list(streams):
                s[1] += 1
                s[0].write(event(s[1]))
                if s[1] == output_len:
                    streams.remove(s)
                    s[2].set()
            await asyncio.sleep(max(0.0, tick_s - (time.perf_counter() - start)))

    async def main():
        server = await asyncio.start_server(handle, "127.0.0.1", port)
        asyncio.ensure_future(ticker())
        ready.set()
        async with server:
            await server.serve_forever()

    asyncio.run(main())


async def read_with_bench_serving(url: str, n: int, output_len: int) -> list:
    import aiohttp

    from radixserve.bench.serving import ClientConfig, NativeBackend, RequestRecord, send_request

    cfg = ClientConfig(base_url=url)
    records = [RequestRecord(i, 0, 0.0) for i in range(n)]
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as client:
        await asyncio.gather(*(send_request(client, cfg, NativeBackend(), [1, 2, 3], output_len, r) for r in records))
    return records


async def read_with_httpx(url: str, n: int, output_len: int) -> list:
    import httpx

    from radixserve.bench.serving import NativeBackend, RequestRecord

    backend = NativeBackend()

    async def one(client, record):
        tokens = 0
        async with client.stream("POST", url + "/generate", json=backend.payload([1, 2, 3], output_len, {}, "")) as resp:
            async for line in resp.aiter_lines():
                if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                    continue
                now = time.perf_counter()
                chunk = backend.parse(json.loads(line[5:]), tokens)
                record.chunk_times.append(now)
                record.chunk_tokens.append(chunk.tokens)
                tokens = chunk.tokens
        record.success = True

    records = [RequestRecord(i, 0, 0.0) for i in range(n)]
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(600)) as client:
        await asyncio.gather(*(one(client, r) for r in records))
    return records


CLIENTS = {"bench.serving (aiohttp)": read_with_bench_serving, "httpx": read_with_httpx}


def probe(client: str, streams: int, tick_ms: float, output_len: int) -> dict:
    from radixserve.bench.serving_metrics import itls

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ready = mp.Event()
    server = mp.Process(target=serve, args=(port, tick_ms / 1000, output_len, ready), daemon=True)
    server.start()
    try:
        ready.wait(30)
        start = time.perf_counter()
        records = asyncio.run(CLIENTS[client](f"http://127.0.0.1:{port}", streams, output_len))
        wall = time.perf_counter() - start
    finally:
        server.terminate()
        server.join()
    gaps = np.array([g for r in records for g in itls(r)]) * 1000
    return {"bench": "client_itl_probe", "client": client, "streams": streams, "tick_ms": tick_ms,
            "events_per_s": round(streams * 1000 / tick_ms), "ok": sum(r.success for r in records),
            "wall_s": round(wall, 2), "ideal_wall_s": round(output_len * tick_ms / 1000, 2),
            "itl_p10_ms": round(float(np.percentile(gaps, 10)), 2), "itl_p50_ms": round(float(np.median(gaps)), 2),
            "itl_p99_ms": round(float(np.percentile(gaps, 99)), 2),
            "share_under_1ms": round(float((gaps < 1).mean()), 3)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, nargs="+", default=[100, 200, 300])
    p.add_argument("--tick-ms", type=float, default=30.0, help="the synthetic step time")
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--clients", nargs="+", choices=sorted(CLIENTS), default=list(CLIENTS))
    args = p.parse_args()
    for n in args.streams:
        for client in args.clients:
            print(json.dumps(probe(client, n, args.tick_ms, args.output_len)), flush=True)


if __name__ == "__main__":
    main()
