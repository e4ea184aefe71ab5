"""How long /metrics and /health take while a server is busy: STREAMS long
generations stream while SCRAPES scrapes of /metrics and /health run one after
another. Prints one JSON line.

    python benchmarks/scrape_under_load.py --url http://127.0.0.1:30000 [--streams 16] [--scrapes 300]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import httpx


async def _stream(ac: httpx.AsyncClient, max_new_tokens: int) -> None:
    body = {"input_ids": [1, 2, 3, 4], "stream": True,
            "sampling_params": {"max_new_tokens": max_new_tokens, "ignore_eos": True}}
    async with ac.stream("POST", "/generate", json=body) as r:
        async for _ in r.aiter_lines():
            pass


async def _timed(ac: httpx.AsyncClient, path: str, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        r = await ac.get(path)
        r.raise_for_status()
        out.append(time.perf_counter() - t0)
    return out


def _summary(samples: list[float]) -> dict:
    ms = sorted(s * 1000 for s in samples)
    return {"n": len(ms), "total_s": round(sum(ms) / 1000, 3), "p50_ms": round(statistics.median(ms), 2),
            "p99_ms": round(ms[int(0.99 * (len(ms) - 1))], 2), "max_ms": round(ms[-1], 2)}


async def main(args) -> dict:
    async with httpx.AsyncClient(base_url=args.url, timeout=600) as ac:
        load = [asyncio.create_task(_stream(ac, args.max_new_tokens)) for _ in range(args.streams)]
        await asyncio.sleep(args.warmup)
        metrics = await _timed(ac, "/metrics", args.scrapes)
        health = await _timed(ac, "/health", args.scrapes)
        for task in load:
            task.cancel()
        await asyncio.gather(*load, return_exceptions=True)
    return {"url": args.url, "streams": args.streams, "metrics": _summary(metrics), "health": _summary(health)}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:30000")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--scrapes", type=int, default=300)
    parser.add_argument("--max-new-tokens", type=int, default=4000)
    parser.add_argument("--warmup", type=float, default=2.0, help="seconds of load before the first scrape")
    print(json.dumps(asyncio.run(main(parser.parse_args()))))
