"""The skinny GEMM (``radixserve.layers.triton_ops.skinny_gemm``), the fp8
path at a few rows, against a float32 reference of the dequantized weight:
fp8 weights with their per-row scales and bf16 / float32 weights without,
on the tensor cores and on the CUDA cores, one to 64 rows, N and K off the tiles, K split into partials (a last split
shorter than the others), a bias, and strided rows of ``x``; and with
SiLU-and-mul fused into it for a ``[gate; up]`` weight. On the CPU the
kernel runs in Triton's interpreter, in one subprocess;
``tests/test_gpu_quantization.py`` runs it on CUDA at llama-3.1-8b's shapes
against ``torch._scaled_mm``, under a CUDA graph.
"""

from __future__ import annotations

import os

import pytest
import torch

from triton_interpreter import run_interpreted

# (name, rows, N, K, weight dtype, (block_m, block_n, block_k, split_k) or None for the default, bias)
CASES = [
    ("one row, fp8", 1, 40, 72, "fp8", (16, 16, 32, 1), True),
    ("one row, default tiles", 1, 80, 300, "fp8", None, True),
    ("one row, K split in 3", 1, 48, 100, "fp8", (16, 16, 32, 3), False),
    ("7 rows, uneven last split", 7, 33, 200, "fp8", (16, 32, 64, 3), True),
    ("20 rows, default tiles", 20, 64, 96, "fp8", None, False),
    ("64 rows", 64, 24, 64, "fp8", (64, 16, 32, 2), True),
    ("bf16 weight, no scale", 5, 40, 80, "bf16", (16, 16, 32, 2), True),
    ("float32", 3, 17, 50, "fp32", (16, 16, 16, 4), False),
    # block_m below 16: the CUDA cores
    ("one row, CUDA cores", 1, 40, 72, "fp8", (1, 16, 32, 1), True),
    ("one row, CUDA cores, default tiles", 1, 70, 600, "fp8", None, False),
    ("3 rows in 4, CUDA cores, uneven split", 3, 33, 200, "fp8", (4, 16, 64, 3), True),
    ("8 rows, CUDA cores, bf16 weight", 8, 20, 96, "bf16", (8, 16, 32, 2), False),
    ("float32, CUDA cores", 2, 17, 50, "fp32", (2, 16, 16, 2), False),
    # row_loop: the CUDA cores a row at a time over the same converted tile
    ("one row, CUDA cores as a row, K split in 2", 1, 40, 300, "fp8",
     dict(block_m=1, block_n=8, block_k=128, split_k=2, row_loop=True), True),
    ("3 rows in 4, CUDA cores a row at a time, uneven split", 3, 33, 200, "fp8",
     dict(block_m=4, block_n=16, block_k=64, split_k=3, row_loop=True), True),
    ("8 rows, CUDA cores a row at a time, bf16 weight", 8, 20, 96, "bf16",
     dict(block_m=8, block_n=16, block_k=32, split_k=1, row_loop=True), False),
    ("float32, CUDA cores a row at a time", 2, 17, 50, "fp32",
     dict(block_m=2, block_n=16, block_k=16, split_k=2, row_loop=True), False),
]

# gated (a [gate; up] weight, silu(gate) * up out): (name, rows, N out, K, weight dtype, tiles, bias)
GATED_CASES = [
    ("gated, one row, CUDA cores, default tiles", 1, 40, 300, "fp8", None, True),
    ("gated, 5 rows, tensor cores, K split in 3", 5, 48, 200, "fp8", (16, 64, 32, 3), False),
    ("gated, 3 rows, CUDA cores, K split in 2, bf16 weight", 3, 21, 96, "bf16", (4, 8, 32, 2), True),
    ("gated, float32", 2, 17, 50, "fp32", (16, 32, 16, 1), False),
    ("gated, 5 rows in 8, CUDA cores a row at a time, K split in 2", 5, 24, 160, "fp8",
     dict(block_m=8, block_n=16, block_k=32, split_k=2, row_loop=True), True),
]


def config_of(tiles):
    """A case's SkinnyConfig: its tiles as a tuple or keyword arguments, None for the default."""
    from radixserve.layers.triton_ops.skinny_gemm import SkinnyConfig

    if tiles is None:
        return None
    return SkinnyConfig(**tiles) if isinstance(tiles, dict) else SkinnyConfig(*tiles)


def gated_reference(ref: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """SiLU-and-mul of the float32 reference of the whole ``[gate; up]``
    product, with the roundings of the unfused path (the GEMM's output in
    ``dtype``, SiLU rounded before the product)."""
    gate, up = ref.to(dtype).float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate).to(dtype).float() * up).to(dtype).float()


def make_case(rows, n, k, wdtype, bias, *, seed):
    """(x with a row stride, weight, scale or None, bias or None, the float32 reference)."""
    from radixserve.layers.quantization import quantize_fp8_rows

    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) / k**0.5
    xdtype = torch.float32 if wdtype == "fp32" else torch.bfloat16
    x = torch.randn(rows, k + 5, generator=gen).to(xdtype)[:, :k]
    b = torch.randn(n, generator=gen).to(xdtype) if bias else None
    if wdtype == "fp8":
        w, scale = quantize_fp8_rows(w)
        scale = scale.view(-1)
        dense = w.float() * scale[:, None]
    else:
        w, scale = w.to(xdtype), None
        dense = w.float()
    ref = x.float() @ dense.t() + (b.float() if b is not None else 0.0)
    return x, w, scale, b, ref


SCRIPT = r"""
import json, sys
import torch
sys.path.insert(0, json.loads(sys.argv[1]))
from test_skinny_gemm import CASES, config_of, make_case
from radixserve.layers.triton_ops.skinny_gemm import SkinnyConfig, skinny_linear

out = {}
for seed, (name, rows, n, k, wdtype, tiles, bias) in enumerate(CASES):
    x, w, scale, b, ref = make_case(rows, n, k, wdtype, bias, seed=seed)
    y = skinny_linear(x, w, scale, b, config_of(tiles))
    out[name] = {"dtype": str(y.dtype), "shape": list(y.shape),
                 "error": float((y.float() - ref).abs().max() / ref.abs().max())}
from test_skinny_gemm import GATED_CASES, gated_reference
from radixserve.layers.triton_ops.activation import silu_and_mul
for seed, (name, rows, n, k, wdtype, tiles, bias) in enumerate(GATED_CASES):
    x, w, scale, b, ref = make_case(rows, 2 * n, k, wdtype, bias, seed=100 + seed)
    cfg = config_of(tiles)
    y = skinny_linear(x, w, scale, b, cfg, gated=True)
    unfused = silu_and_mul(skinny_linear(x, w, scale, b, cfg))
    ref = gated_reference(ref, x.dtype)
    out[name] = {"dtype": str(y.dtype), "shape": list(y.shape),
                 "error": float((y.float() - ref).abs().max() / ref.abs().max()),
                 "vs_unfused": float((y.float() - unfused.float()).abs().max() / ref.abs().max())}
try:
    skinny_linear(torch.zeros(1, 8), torch.zeros(5, 8), gated=True)
except ValueError as e:
    out["odd gated"] = str(e)
try:
    skinny_linear(torch.zeros(65, 8), torch.zeros(4, 8))
except ValueError as e:
    out["too many rows"] = str(e)
try:
    skinny_linear(torch.zeros(3, 8), torch.zeros(4, 8), config=SkinnyConfig(2, 16, 16, 1))
except ValueError as e:
    out["config too small"] = str(e)
try:
    skinny_linear(torch.zeros(3, 8), torch.zeros(4, 8), config=SkinnyConfig(16, 16, 16, 1, row_loop=True))
except ValueError as e:
    out["row loop on tensor cores"] = str(e)
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def interpreted():
    return run_interpreted(SCRIPT, os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_kernel_matches_the_float32_reference(interpreted, case):
    _, rows, n, _, wdtype, _, _ = next(c for c in CASES if c[0] == case)
    got = interpreted[case]
    assert got["shape"] == [rows, n]
    assert got["dtype"] == ("torch.float32" if wdtype == "fp32" else "torch.bfloat16")
    # bf16 output: one ulp of the largest value (the interpreter casts float32 to bf16 toward
    # zero, the GPU to nearest); float32: accumulation order only
    assert got["error"] < (1e-5 if wdtype == "fp32" else 2**-7), got


@pytest.mark.parametrize("case", [c[0] for c in GATED_CASES])
def test_gated_kernel_is_silu_and_mul_of_the_product(interpreted, case):
    """SiLU-and-mul in the GEMM's epilogue: the gate and up tiles in one
    program, K split into partials of both, against the reference and
    against the plain kernel followed by the activation kernel."""
    _, rows, n, _, wdtype, _, _ = next(c for c in GATED_CASES if c[0] == case)
    got = interpreted[case]
    assert got["shape"] == [rows, n]
    assert got["dtype"] == ("torch.float32" if wdtype == "fp32" else "torch.bfloat16")
    # bf16: three roundings (the product, SiLU, the output), each up to one ulp in the interpreter
    assert got["error"] < (1e-5 if wdtype == "fp32" else 3 * 2**-7), got
    assert got["vs_unfused"] < (1e-5 if wdtype == "fp32" else 2**-7), got


def test_more_rows_than_the_kernel_takes_is_an_error(interpreted):
    assert "at most 64 rows, got 65" in interpreted["too many rows"]
    assert "fewer rows than x (3)" in interpreted["config too small"]
    assert "rows must be even, got 5" in interpreted["odd gated"]
    assert "row_loop is a CUDA-core form" in interpreted["row loop on tensor cores"]


def test_a_tuned_table_gives_the_config_for_the_fewest_rows_at_least_m(tmp_path, monkeypatch):
    """The engine's lookup: the table of this shape, dtype and GPU name; the
    entry for the fewest rows covering m (a config, with or without its
    timings, or ``_scaled_mm`` where that won); the default beyond the
    table, for other shapes and off CUDA."""
    import json

    pytest.importorskip("triton")
    from radixserve.layers.triton_ops import skinny_gemm

    monkeypatch.setattr(skinny_gemm, "device_name", lambda device: "Fake_GPU")
    monkeypatch.setattr(skinny_gemm, "num_sms", lambda device: 100)
    skinny_gemm.table_entry.cache_clear()
    skinny_gemm.get_config.cache_clear()
    cuda = torch.device("cuda", 0)
    name = skinny_gemm.table_file_name(4096, 1024, torch.float8_e4m3fn, cuda)
    assert name == "N=4096,K=1024,dtype=fp8,device_name=Fake_GPU.json"
    table = {"1": dict(block_m=1, block_n=16, block_k=512, split_k=2, num_warps=8, num_stages=3),
             "2": dict(kernel="skinny", block_m=2, block_n=8, block_k=1024, split_k=1, num_warps=4, num_stages=4,
                       row_loop=True, us=9.5, scaled_mm_us=12.0),
             "4": dict(block_m=4, block_n=32, block_k=256, split_k=4, num_warps=4, num_stages=2),
             "8": dict(kernel="scaled_mm", us=20.0, scaled_mm_us=15.5)}
    (tmp_path / name).write_text(json.dumps(table))
    get = lambda m, n=4096, dtype=torch.float8_e4m3fn, device=cuda: skinny_gemm.get_config(  # noqa: E731
        m, n, 1024, dtype, device, tmp_path)
    scaled = lambda m, n=4096, device=cuda: not skinny_gemm.takes_kernel(  # noqa: E731
        m, n, 1024, torch.float8_e4m3fn, device, tmp_path)
    try:
        assert get(1) == skinny_gemm.SkinnyConfig(**table["1"])
        assert get(2) == skinny_gemm.SkinnyConfig(2, 8, 1024, 1, 4, 4, row_loop=True)
        assert get(3) == get(4) == skinny_gemm.SkinnyConfig(**table["4"])
        assert [scaled(m) for m in (1, 2, 3, 4, 5, 8, 9)] == [False] * 4 + [True] * 2 + [False]
        # rows where _scaled_mm won, asked for this kernel anyway, get the default tiles
        assert get(5) == get(8) == skinny_gemm.default_config(8, 4096, 1024, 100)
        assert get(9) == skinny_gemm.default_config(9, 4096, 1024, 100)
        assert get(1, n=2048) == skinny_gemm.default_config(1, 2048, 1024, 100)
        assert not scaled(8, n=2048)
        assert get(1, dtype=torch.bfloat16) == skinny_gemm.default_config(1, 4096, 1024, 100)
        assert get(1, device=torch.device("cpu")) == skinny_gemm.default_config(1, 4096, 1024, 1)
        assert not scaled(8, device=torch.device("cpu"))
        # bf16 weights take the kernel only at the rows where their own table has a config
        bf16 = {"1": dict(kernel="skinny", block_m=1, block_n=8, block_k=1024, split_k=2, us=7.0, linear_us=9.0),
                "4": dict(kernel="linear", us=12.0, linear_us=11.0)}
        (tmp_path / skinny_gemm.table_file_name(4096, 1024, torch.bfloat16, cuda)).write_text(json.dumps(bf16))
        for cached in (skinny_gemm.load_table, skinny_gemm.table_entry, skinny_gemm.get_config):
            cached.cache_clear()  # the lookups above cached "no bf16 table"
        takes = lambda m, n=4096, device=cuda: skinny_gemm.takes_kernel(  # noqa: E731
            m, n, 1024, torch.bfloat16, device, tmp_path)
        assert [takes(m) for m in (1, 2, 4, 5)] == [True, False, False, False]
        assert not takes(1, n=2048) and not takes(1, device=torch.device("cpu"))
        assert get(1, dtype=torch.bfloat16) == skinny_gemm.SkinnyConfig(1, 8, 1024, 2)
        # the packaged tables' directory is read at lookup time, so a test may point it elsewhere
        monkeypatch.setattr(skinny_gemm, "TABLE_DIR", tmp_path)
        assert skinny_gemm.takes_kernel(1, 4096, 1024, torch.bfloat16, cuda)
    finally:
        skinny_gemm.table_entry.cache_clear()
        skinny_gemm.get_config.cache_clear()


def test_the_tune_writes_scaled_mm_where_it_was_faster(tmp_path, monkeypatch):
    """``bench.fp8_gemm``'s tables: each swept row as the best config with
    its time, or as ``_scaled_mm`` where quantization + ``_scaled_mm`` was
    faster in the same run (for gate_up at ``GATED_ROWS``, with SiLU-and-mul
    on both sides, as the MLP runs them); rows already in the file stay
    unless swept again. What it writes, the engine's lookup reads back."""
    import json

    pytest.importorskip("triton")
    from radixserve.bench import fp8_gemm
    from radixserve.layers.triton_ops import skinny_gemm

    monkeypatch.setattr(skinny_gemm, "device_name", lambda device: "Fake_GPU")
    monkeypatch.setattr(fp8_gemm, "table_file_name",
                        lambda n, k, dtype, device: f"N={n},K={k},{dtype},Fake_GPU.json".replace("torch.", ""))
    load = lambda dtype: skinny_gemm.load_table(str(tmp_path / f"N=4096,K=1024,{dtype},Fake_GPU.json".replace(  # noqa: E731
        "torch.", "")))
    cfg = dict(block_m=1, block_n=8, block_k=2048, split_k=1, num_warps=4, num_stages=4, row_loop=False)
    row = lambda m, best, scaled: {"out": 4096, "in": 1024, "tokens": m, "best_us": best,  # noqa: E731
                                    "config": dict(cfg, block_m=m), "scaled_mm_us": scaled}
    path = tmp_path / "N=4096,K=1024,float8_e4m3fn,Fake_GPU.json"
    path.write_text(json.dumps({"16": dict(cfg, block_m=16), "2": dict(cfg, block_m=2)}))
    fp8_gemm.write_table(str(tmp_path), [row(1, 11.1, 15.6), row(2, 16.3, 15.5), row(4, 18.1, 18.1)],
                         torch.float8_e4m3fn)
    table = json.loads(path.read_text())
    assert list(table) == ["1", "2", "4", "16"]
    assert table["1"] == {"kernel": "skinny", **cfg, "us": 11.1, "scaled_mm_us": 15.6}
    assert table["2"] == {"kernel": "scaled_mm", "us": 16.3, "scaled_mm_us": 15.5}
    assert table["4"]["kernel"] == "skinny"  # a tie keeps the skinny kernel (no quantization launch)
    assert table["16"] == dict(cfg, block_m=16)
    # gate_up at GATED_ROWS: the kernel with SiLU in its epilogue against _scaled_mm then the activation
    gated = dict(row(4, 50.4, 46.7), skinny_gated_us=44.0, scaled_mm_then_silu_us=49.0)
    assert fp8_gemm.as_table_entry(gated) == {"kernel": "skinny", **dict(cfg, block_m=4), "us": 44.0,
                                              "scaled_mm_us": 49.0}
    gated.update(skinny_gated_us=52.0)
    assert fp8_gemm.as_table_entry(gated) == {"kernel": "scaled_mm", "us": 52.0, "scaled_mm_us": 49.0}
    read = skinny_gemm.load_table(str(path))
    assert read[1] == skinny_gemm.SkinnyConfig(**cfg)
    assert read[2] == skinny_gemm.SCALED_MM
    assert read[16] == skinny_gemm.SkinnyConfig(**dict(cfg, block_m=16))
    # bf16: F.linear unless the tiles beat it by the margin (cuBLAS keeps a near tie)
    linear = lambda m, best, vendor: {"out": 4096, "in": 1024, "tokens": m, "best_us": best,  # noqa: E731
                                      "config": dict(cfg, block_m=m), "linear_us": vendor}
    assert fp8_gemm.as_table_entry(linear(1, 9.0, 10.0))["kernel"] == "skinny"
    assert fp8_gemm.as_table_entry(linear(1, 9.8, 10.0)) == {"kernel": "linear", "us": 9.8, "linear_us": 10.0}
    gated = dict(linear(2, 9.0, 10.0), skinny_gated_us=11.0, linear_then_silu_us=11.2)
    assert fp8_gemm.as_table_entry(gated) == {"kernel": "linear", "us": 11.0, "linear_us": 11.2}
    fp8_gemm.write_table(str(tmp_path), [linear(1, 9.0, 10.0), linear(2, 9.9, 10.0)], torch.bfloat16)
    assert load(torch.bfloat16) == {1: skinny_gemm.SkinnyConfig(**cfg), 2: skinny_gemm.LINEAR}
