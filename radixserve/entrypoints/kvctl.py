"""``radixserve kvctl``: read and set a running server's elastic KV limit
(kvcached's ``kvctl``, over the server's HTTP API: ``/get_kv_limit`` and
``/set_kv_limit``). docs/elastic_kv.md.

    radixserve kvctl show                      # each replica's limit, mapped and used bytes
    radixserve kvctl limit 6G                  # at most 6 GiB of KV memory per replica
    radixserve kvctl limit none                # back to the pool's whole size
    radixserve kvctl watch --interval 1        # show, every second
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
import urllib.error
import urllib.request

_UNITS = {"": 1, "b": 1, "k": 2**10, "kb": 2**10, "kib": 2**10, "m": 2**20, "mb": 2**20, "mib": 2**20,
          "g": 2**30, "gb": 2**30, "gib": 2**30, "t": 2**40, "tb": 2**40, "tib": 2**40}


def parse_size(text: str) -> int | None:
    """Bytes in ``text`` ("6G", "512MiB", "1.5gb", "1048576"; binary
    units), or None for "none"/"max" (no limit). ValueError otherwise."""
    if text.strip().lower() in ("none", "max", "unlimited"):
        return None
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"not a size: {text!r} (e.g. 6G, 512M, none)")
    size = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    if size <= 0:
        raise ValueError(f"a limit must be positive: {text!r}")
    return size


def _call(url: str, api_key: str | None, path: str, body: dict | None = None):
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url.rstrip("/") + path, data=data, method="GET" if body is None else "POST")
    request.add_header("Content-Type", "application/json")
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace")
        try:
            detail = json.loads(detail)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            pass  # not the server's JSON error: show the body as it came
        raise SystemExit(f"kvctl: {path}: HTTP {exc.code}: {detail}") from None
    except urllib.error.URLError as exc:
        raise SystemExit(f"kvctl: cannot reach {url}: {exc.reason}") from None


def _gib(value: float) -> str:
    return f"{value / 2**30:.2f}"


def _table(states: list[dict]) -> str:
    rows = ["replica  limit_GiB  mapped_GiB  used_GiB  max_GiB  reserve_pages  over_limit"]
    for s in states:
        rows.append(f"{s.get('dp_rank', 0):>7}  {_gib(s['elastic_kv_limit_bytes']):>9}  "
                    f"{_gib(s['elastic_kv_mapped_bytes']):>10}  {_gib(s['elastic_kv_used_bytes']):>8}  "
                    f"{_gib(s['elastic_kv_max_bytes']):>7}  {s['elastic_kv_reserve_pages']:>13}  "
                    f"{str(s['elastic_kv_over_limit']).lower():>10}")
    return "\n".join(rows)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="radixserve kvctl", description="read and set a server's elastic KV limit")
    parser.add_argument("--url", default="http://127.0.0.1:30000", help="the server (default: %(default)s)")
    parser.add_argument("--api-key", default=None, help="the server's --api-key, if it has one")
    parser.add_argument("--json", action="store_true", help="print the server's JSON reply")
    sub = parser.add_subparsers(dest="action", required=True)
    sub.add_parser("show", help="each replica's limit, mapped, used and largest KV memory")
    limit = sub.add_parser("limit", help="set the limit of every replica")
    limit.add_argument("size", help="bytes with an optional binary unit (6G, 512M), or none")
    watch = sub.add_parser("watch", help="show, again every --interval seconds, until interrupted")
    watch.add_argument("--interval", type=float, default=1.0)
    args = parser.parse_args(argv)
    if args.action == "limit":
        try:
            size = parse_size(args.size)
        except ValueError as exc:
            parser.error(str(exc))
        states = _call(args.url, args.api_key, "/set_kv_limit", {"limit_bytes": size})
    else:
        states = _call(args.url, args.api_key, "/get_kv_limit")
    while True:
        print(json.dumps(states) if args.json else _table(states), flush=True)
        if args.action != "watch":
            return 0
        try:
            time.sleep(args.interval)
        except KeyboardInterrupt:
            return 0
        states = _call(args.url, args.api_key, "/get_kv_limit")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
