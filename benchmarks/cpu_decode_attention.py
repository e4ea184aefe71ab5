"""Time the CPU decode-attention kernel (``layers/csrc/attention.c``) on W6's
decode step, or on requests that share prefixes; JSON lines to stdout.

    python benchmarks/cpu_decode_attention.py [--against OLD_attention.c] [--rounds 6]
    python benchmarks/cpu_decode_attention.py --grouped [--groups 4 --shared 512 --own 64]

The case is one decode step of W6 half-way through: 64 requests whose
prompts (U[32, 256] tokens) sit in contiguous slots and whose 36 decoded
tokens are interleaved across the batch, as continuous batching leaves them,
over SmolLM2's heads (9 query heads, 3 KV heads, d = 64) and its 30 layers,
float32 pools. ``cold`` reads a separate pool per layer (what a step does:
the K/V are far larger than the caches); ``warm`` reads layer 0's 30 times.
GB/s counts the K/V bytes a step reads. ``--against`` builds another version
of attention.c with the same flags and times it alternately with this one,
in rounds, reporting each one's best round, so that a shared machine's drift
falls on both.

``--grouped``: 64 requests in ``--groups`` groups, each group sharing
``--shared`` tokens (contiguous slots) and each request holding ``--own``
tokens of its own, over the same heads and layers: the plain kernel (every
request reads its whole context), the grouped kernel (each prefix read once
per group: ``--enable-prefix-grouped-decode``) and the torch path of the
grouping (``cascade_decode.py``, what the CPU ran before the kernel).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import random
import shutil
import subprocess
import tempfile
import time

import torch

from radixserve.layers import cpu_kernels

LAYERS, HEADS, KV_HEADS, HEAD_DIM, BATCH = 30, 9, 3, 64, 64


def build(source: str, out_dir: str) -> ctypes.CDLL:
    """``source`` (an attention.c) and the repo's elementwise.c as a library
    with cpu_kernels' flags and argument types."""
    out = os.path.join(out_dir, "against.so")
    elementwise = os.path.join(cpu_kernels.CSRC, "elementwise.c")
    compiler = os.environ.get("CC") or shutil.which("cc") or "gcc"
    subprocess.run([compiler, *cpu_kernels.CFLAGS, "-march=native", source, elementwise, "-o", out, "-lm"], check=True)
    ours, lib = cpu_kernels._library(), ctypes.CDLL(out)
    for name in ("rs_decode_attention", "rs_extend_attention", "rs_add_rms_norm", "rs_rotary"):
        getattr(lib, name).argtypes, getattr(lib, name).restype = getattr(ours, name).argtypes, getattr(ours, name).restype
    return lib


def make_case(decoded: int, seed: int = 0):
    rng = random.Random(seed)
    prompts = [rng.randint(32, 256) for _ in range(BATCH)]
    pool_rows = sum(prompts) + BATCH * decoded + 1
    pools = [(torch.randn(pool_rows, KV_HEADS, HEAD_DIM), torch.randn(pool_rows, KV_HEADS, HEAD_DIM))
             for _ in range(LAYERS)]
    req_to_token = torch.zeros(BATCH, 512, dtype=torch.int32)
    slot = 1
    for i, n in enumerate(prompts):
        req_to_token[i, :n] = torch.arange(slot, slot + n, dtype=torch.int32)
        slot += n
    for t in range(decoded):
        for i, n in enumerate(prompts):
            req_to_token[i, n + t] = slot
            slot += 1
    lens = torch.tensor([n + decoded for n in prompts])
    return pools, req_to_token, lens


def make_grouped_case(groups: int, shared: int, own: int):
    """Pools, req_to_token, lens and the PrefixGroupTable of ``--grouped``."""
    from radixserve.model_executor.forward_batch_info import PrefixGroupTable

    per = BATCH // groups
    pool_rows = groups * shared + BATCH * own + 1
    pools = [(torch.randn(pool_rows, KV_HEADS, HEAD_DIM), torch.randn(pool_rows, KV_HEADS, HEAD_DIM))
             for _ in range(LAYERS)]
    req_to_token = torch.zeros(BATCH, shared + own, dtype=torch.int32)
    for g in range(groups):
        prefix = torch.arange(1 + g * shared, 1 + (g + 1) * shared, dtype=torch.int32)
        req_to_token[g * per : (g + 1) * per, :shared] = prefix
    slot = 1 + groups * shared
    for t in range(own):  # decoded tokens interleaved across the batch
        req_to_token[:, shared + t] = torch.arange(slot, slot + BATCH, dtype=torch.int32)
        slot += BATCH
    ints = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
    members = [list(range(g * per, (g + 1) * per)) for g in range(groups)]
    table = PrefixGroupTable(
        prefix_rows=ints([m[0] for m in members]), prefix_lens=ints([shared] * groups),
        member_starts=ints([g * per for g in range(groups + 1)]), members=ints(sum(members, [])),
        suffix_starts=ints([shared] * BATCH), prefix_lens_cpu=[shared] * groups, members_cpu=members)
    return pools, req_to_token, torch.full((BATCH,), shared + own), table


def grouped_main(args) -> None:
    from radixserve.layers.attention.cascade_decode import grouped_decode_attention

    pools, req_to_token, lens, table = make_grouped_case(args.groups, args.shared, args.own)
    q, rows = torch.randn(BATCH, HEADS * HEAD_DIM), torch.arange(BATCH)
    scale, lens_cpu = HEAD_DIM**-0.5, lens.tolist()
    paths = {
        "plain": lambda k, v: cpu_kernels.decode_attention(q, k, v, req_to_token, rows, lens, max(lens_cpu), HEADS,
                                                           scale),
        "grouped": lambda k, v: cpu_kernels.grouped_decode_attention(q, k, v, req_to_token, rows, lens, table, HEADS,
                                                                     scale),
        "grouped_torch": lambda k, v: grouped_decode_attention(q, k, v, req_to_token, rows, lens, lens_cpu, table,
                                                               HEADS, scale),
    }
    ref = paths["plain"](*pools[0])
    best: dict[str, float] = {}
    for _ in range(args.rounds):
        for name, fn in paths.items():
            torch.testing.assert_close(fn(*pools[0]), ref, atol=1e-5, rtol=1e-5)
            start = time.perf_counter()
            for k, v in pools:
                fn(k, v)
            best[name] = min(best.get(name, float("inf")), time.perf_counter() - start)
    for name, s in best.items():
        print(json.dumps({"bench": "cpu_decode_attention", "case": "grouped", "path": name, "batch": BATCH,
                          "groups": args.groups, "shared": args.shared, "own": args.own, "layers": LAYERS,
                          "threads": torch.get_num_threads(), "ms_per_step": round(s * 1e3, 2),
                          "rounds": args.rounds}))


def step_s(pools, req_to_token, lens, q, warm: bool, repeats: int = 3) -> float:
    def step():
        for layer in range(LAYERS):
            k, v = pools[0 if warm else layer]
            cpu_kernels.decode_attention(q, k, v, req_to_token, torch.arange(BATCH), lens, int(lens.max()), HEADS,
                                         HEAD_DIM**-0.5)

    step()
    start = time.perf_counter()
    for _ in range(repeats):
        step()
    return (time.perf_counter() - start) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--against", help="another attention.c to time alternately with this one")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--decoded", type=int, default=36, help="tokens each request has decoded")
    parser.add_argument("--grouped", action="store_true", help="requests that share prefixes (see above)")
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--shared", type=int, default=512)
    parser.add_argument("--own", type=int, default=64)
    args = parser.parse_args()
    if not cpu_kernels.decode_attention_available():
        raise SystemExit("the CPU kernels could not be built here")
    if args.grouped:
        return grouped_main(args)
    pools, req_to_token, lens = make_case(args.decoded)
    q = torch.randn(BATCH, HEADS * HEAD_DIM)
    kv_bytes = int(lens.sum()) * KV_HEADS * HEAD_DIM * 4 * 2 * LAYERS
    with tempfile.TemporaryDirectory() as tmp:
        versions = {"this": cpu_kernels._library()}
        if args.against:
            versions["against"] = build(args.against, tmp)
        best: dict[tuple[str, str], float] = {}
        real = cpu_kernels._library
        try:
            for _ in range(args.rounds):
                for name, lib in versions.items():
                    cpu_kernels._library = lambda lib=lib: lib
                    for mode in ("cold", "warm"):
                        s = step_s(pools, req_to_token, lens, q, warm=mode == "warm")
                        best[name, mode] = min(best.get((name, mode), float("inf")), s)
        finally:
            cpu_kernels._library = real
    for (name, mode), s in best.items():
        print(json.dumps({"bench": "cpu_decode_attention", "version": name, "mode": mode, "batch": BATCH,
                          "mean_context": round(float(lens.float().mean()), 1), "layers": LAYERS,
                          "threads": torch.get_num_threads(), "ms_per_step": round(s * 1e3, 2),
                          "kv_gb_s": round(kv_bytes / s / 1e9, 1), "rounds": args.rounds}))


if __name__ == "__main__":
    main()
