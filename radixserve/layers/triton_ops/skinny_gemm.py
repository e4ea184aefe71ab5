"""The linear layers' GEMM at a few rows (decode batches of one to a few
dozen): ``y = x @ (W * s).T + b`` at the bandwidth of reading ``W``.

At a few rows a GEMM reads every weight byte for a handful of products: it
is bound by the weight read, and what counts is streaming ``W`` from HBM
with every SM busy. ``torch._scaled_mm`` (``--quantization fp8``) does not:
it wants the activations in fp8 (one more kernel) and its tiles are sized for
large M, so batch 1 in fp8 decoded no faster than in bf16 with half the bytes.

Here ``W`` ``[N, K]`` (fp8 with float32 per-row scales ``s``, or the
activations' own dtype with no scale) is read once, each tile converted to
the activations' dtype in registers; ``x`` ``[M, K]`` stays as it is (bf16),
so nothing is quantized on the way in. The tile product runs on the tensor
cores with the weight as the left operand and the rows padded to 16, so the
output tile is ``y``'s transpose: the weight fills the MMA's large dimension
and the few rows its small one.

At one to a few rows the tensor cores gain nothing: the MMA pads the rows to
16 and its operands go through shared memory. A config with ``block_m``
below 16 multiplies on the CUDA cores instead: each weight tile, loaded
straight to registers, times each row, summed along K in registers. One
row is an ``[N, K]`` product with the weight tile left in the registers it
was loaded into; several rows either one ``[N, K]`` product a row over the
same converted tile (``row_loop``) or one ``[N, K, rows]`` product, for
which the compiler moves the weight tile through shared memory.

Programs tile N. Where N's tiles are too few to keep every SM streaming, K is
split too: each split writes a float32 partial ``[split, M, N]`` and a second
launch sums the partials in order (the result does not depend on timing),
applies the scale and the bias and casts. With one split the first launch
does that itself.

For a fused ``[gate; up]`` weight (``gated``), the kernel can also apply
SiLU-and-mul in its epilogue: each program takes a tile of gate rows and the
same tile of up rows, so the activation needs no launch of its own.

Where the GPU has programmatic dependent launch (:func:`triton_ops.pdl`),
each program asks L2 for its first K tile of ``W`` before it waits for the
kernel before it (whose output is ``x``): the weight stream starts during
that kernel's tail instead of after it.

The tiles come from a tuned table of the weight's shape on this GPU
(``configs/skinny``, written by ``python -m radixserve.bench.fp8_gemm
--sweep-s S --write-tables DIR``), else from :func:`default_config`. The
table also says at which rows the vendor's GEMM beat the best tiles when it
was tuned, and :func:`takes_kernel` decides from it. fp8 weights
(``layers/quantization.py``) take this kernel up to ``SKINNY_MAX_ROWS`` rows
unless their table names quantization plus ``torch._scaled_mm`` there. bf16
and fp16 weights keep ``F.linear`` (cuBLAS), which reads large weights at
close to the bandwidth, except at the rows where their table has a config:
small projections such as a MoE model's attention, where
cuBLAS's one-row kernels leave the HBM half idle.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
import triton.language as tl

from radixserve.layers.triton_ops import DTYPE_NAMES, device_name, interpreting, num_sms, pdl
from radixserve.layers.triton_ops.gdc import pdl_trigger, pdl_wait, prefetch_l2
from radixserve.layers.triton_ops.tile import rows_product, tile_product

MAX_ROWS = 64  # beyond this the GEMM is no longer bound by the weight read
FMA_MAX_ROWS = 1  # the default config's CUDA-core rows
TABLE_DIR = Path(__file__).parent / "configs" / "skinny"  # tuned tables: configs/skinny/README.md


@dataclass(frozen=True)
class SkinnyConfig:
    """One launch's tiles: rows (padded; 16 to 64 on the tensor cores, 1 to 8
    on the CUDA cores), N and K tiles, K splits, warps and software-pipeline
    stages."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int = 4
    num_stages: int = 4
    row_loop: bool = False  # CUDA cores, several rows: one [N, K] product a row (one row always is)

    @classmethod
    def from_json(cls, entry: dict) -> SkinnyConfig:
        """A table entry's config (the entry may carry its timings beside it)."""
        return cls(**{f.name: entry[f.name] for f in dataclasses.fields(cls) if f.name in entry})


SCALED_MM = "scaled_mm"  # an fp8 table's entry where quantization + torch._scaled_mm was faster
LINEAR = "linear"  # a bf16 / fp16 table's entry where F.linear (cuBLAS) was faster


def vendor_kernel(dtype: torch.dtype) -> str:
    """The path a weight of ``dtype`` takes where this kernel does not: the
    name its tables' entries give it."""
    return SCALED_MM if dtype == torch.float8_e4m3fn else LINEAR


@triton.jit
def _skinny_gemm_kernel(X, W, Scale, Bias, Y, Part, M, N, K, stride_xm, stride_wn, stride_ym, k_per_split,
                        HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr, DOT_F32: tl.constexpr,
                        FMA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        LINE: tl.constexpr = 128, GATED: tl.constexpr = False, ROW_LOOP: tl.constexpr = False,
                        USE_PDL: tl.constexpr = False):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    n_ok, m_ok = rn < N, rm < M
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    up = N * stride_wn  # GATED: the up row of each gate row, N rows further down W
    if USE_PDL:  # no kernel writes W: its first K tile streams into L2 while the kernel before finishes
        lines = k_lo + tl.arange(0, BLOCK_K // LINE) * LINE  # LINE elements of W a 128-byte line
        first = W + rn[:, None].to(tl.int64) * stride_wn + lines[None, :]
        first = tl.where(n_ok[:, None] & (lines < k_hi)[None, :], first, W)
        prefetch_l2(first)
        if GATED:
            prefetch_l2(first + up)
    pdl_wait(USE_PDL)
    w_ptrs = W + rn[:, None].to(tl.int64) * stride_wn + (k_lo + rk)[None, :]
    x_ptrs = X + rm[None, :] * stride_xm + (k_lo + rk)[:, None]
    x_row0 = X + k_lo + rk  # ROW_LOOP: row 0 of x_ptrs' tile
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)  # y's tile, transposed
    acc_up = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)  # GATED: the up rows' tile
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k_ok = rk < k_hi - k0
        w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if GATED:  # both tiles' loads in flight before either product waits for its own
            w_up = tl.load(w_ptrs + up, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if ROW_LOOP:
            acc = rows_product(acc, w, x_row0, stride_xm, k_ok, M, rm, BLOCK_M)
            if GATED:
                acc_up = rows_product(acc_up, w_up, x_row0, stride_xm, k_ok, M, rm, BLOCK_M)
        else:
            x = tl.load(x_ptrs, mask=k_ok[:, None] & m_ok[None, :], other=0.0)
            acc = tile_product(acc, w, x, FMA, DOT_F32)
            if GATED:
                acc_up = tile_product(acc_up, w_up, x, FMA, DOT_F32)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
        x_row0 += BLOCK_K
    pdl_trigger(USE_PDL)
    if PARTIAL:
        width = N
        if GATED:  # a partial's row: the gate columns, then the up columns
            width = 2 * N
        part = Part + (pid_k * M + rm[None, :]) * width + rn[:, None]
        tl.store(part, acc, mask=n_ok[:, None] & m_ok[None, :])
        if GATED:
            tl.store(part + N, acc_up, mask=n_ok[:, None] & m_ok[None, :])
    else:
        _epilogue(acc, acc_up, Scale, Bias, Y, rn, rm, n_ok, m_ok, N, stride_ym, HAS_SCALE, HAS_BIAS, GATED)


@triton.jit
def _scaled(acc, Scale, Bias, rn, n_ok, HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr):
    if HAS_SCALE:
        acc = acc * tl.load(Scale + rn, mask=n_ok, other=0.0)[:, None]
    if HAS_BIAS:
        acc = acc + tl.load(Bias + rn, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    return acc


@triton.jit
def _epilogue(acc, acc_up, Scale, Bias, Y, rn, rm, n_ok, m_ok, N, stride_ym,
              HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr, GATED: tl.constexpr):
    """Scale and bias ``acc`` and store it in ``Y``; with GATED, store
    ``silu(gate) * up`` of ``acc`` (the gate) and ``acc_up``, each rounded to
    ``Y``'s dtype first, as the GEMM's output is before SiLU-and-mul
    (``activation.py``), which this then computes as that kernel does."""
    y = _scaled(acc, Scale, Bias, rn, n_ok, HAS_SCALE, HAS_BIAS).to(Y.dtype.element_ty)
    if GATED:
        gate = y.to(tl.float32)
        up = _scaled(acc_up, Scale + N, Bias + N, rn, n_ok, HAS_SCALE, HAS_BIAS).to(Y.dtype.element_ty)
        act = (gate / (1.0 + tl.exp(-gate))).to(Y.dtype.element_ty)
        y = (act.to(tl.float32) * up.to(tl.float32)).to(Y.dtype.element_ty)
    tl.store(Y + rm[None, :] * stride_ym + rn[:, None], y, mask=n_ok[:, None] & m_ok[None, :])


@triton.jit
def _split_sum_kernel(Scale, Bias, Y, Part, M, N, stride_ym, HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr,
                      SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GATED: tl.constexpr = False,
                      USE_PDL: tl.constexpr = False):
    pdl_wait(USE_PDL)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    n_ok, m_ok = rn < N, rm < M
    mask = n_ok[:, None] & m_ok[None, :]
    width = N
    if GATED:  # a partial's row: the gate columns, then the up columns
        width = 2 * N
    part = Part + rm[None, :] * width + rn[:, None]
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for s in tl.static_range(SPLIT):
        acc += tl.load(part + s * M * width, mask=mask, other=0.0)
        if GATED:
            acc_up += tl.load(part + s * M * width + N, mask=mask, other=0.0)
    pdl_trigger(USE_PDL)
    _epilogue(acc, acc_up, Scale, Bias, Y, rn, rm, n_ok, m_ok, N, stride_ym, HAS_SCALE, HAS_BIAS, GATED)


def split_for(n: int, k: int, block_n: int, block_k: int, programs: int) -> int:
    """K splits that bring N's tiles up to about ``programs`` programs, each
    split at least two K tiles long."""
    return max(1, min(triton.cdiv(programs, triton.cdiv(n, block_n)), k // (2 * block_k)))


def default_config(m: int, n: int, k: int, sms: int) -> SkinnyConfig:
    """Untuned tiles for ``[m, k] @ [n, k].T``, K split until there are
    about four programs an SM. One row (:data:`FMA_MAX_ROWS`) goes to the
    CUDA cores with N tiles of 8 rows of W and K tiles of 2048 (or all of a
    shorter K); more go to the tensor cores, the rows padded to 16 at least,
    N tiles of 64 and K tiles of 128. Those won most often in sweeps over
    llama-3.1-8b's projections at 1 to 16 rows on an H100
    (benchmarks/README.md); GPUs and shapes with a tuned table take its."""
    if m <= FMA_MAX_ROWS:
        block_m, block_n, block_k = triton.next_power_of_2(m), 8, min(2048, triton.next_power_of_2(k))
    else:
        block_m, block_n, block_k = max(16, triton.next_power_of_2(m)), 64, 128
    return SkinnyConfig(block_m, block_n, block_k, split_for(n, k, block_n, block_k, 4 * sms))


def table_file_name(n: int, k: int, dtype: torch.dtype, device: torch.device) -> str:
    """The tuned table of one weight shape on this GPU, e.g.
    ``N=6144,K=4096,dtype=fp8,device_name=NVIDIA_H200.json``."""
    return f"N={n},K={k},dtype={DTYPE_NAMES[dtype]},device_name={device_name(device)}.json"


@functools.cache
def load_table(path: str) -> dict[int, SkinnyConfig | str] | None:
    """A tuned table (rows -> config, or :data:`SCALED_MM` / :data:`LINEAR`
    where the vendor's GEMM won), read once; None where there is no such file."""
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return {int(rows): entry["kernel"] if entry.get("kernel") in (SCALED_MM, LINEAR)
                else SkinnyConfig.from_json(entry) for rows, entry in json.load(f).items()}


@functools.cache
def table_entry(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device,
                table_dir: str | Path | None = None) -> SkinnyConfig | str | None:
    """The tuned table's entry for ``m`` rows of this weight on this GPU: the
    entry for the fewest rows at least ``m`` (a config for more rows also
    computes fewer); None without one (no table, more rows than it has, or
    off CUDA). Cached: the engine asks once per layer and step."""
    if device.type != "cuda":
        return None
    table = load_table(str(Path(table_dir or TABLE_DIR) / table_file_name(n, k, dtype, device)))
    fits = [rows for rows in table or () if rows >= m]
    return table[min(fits)] if fits else None


@functools.cache
def get_config(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device,
               table_dir: str | Path | None = None) -> SkinnyConfig:
    """The config for ``m`` rows of this weight: the tuned table's
    (:func:`table_entry`), else :func:`default_config` (also where the table
    prefers ``_scaled_mm``: a caller that runs this kernel anyway gets the
    untuned tiles)."""
    entry = table_entry(m, n, k, dtype, device, table_dir)
    if isinstance(entry, SkinnyConfig):
        return entry
    return default_config(m, n, k, num_sms(device) if device.type == "cuda" else 1)


def takes_kernel(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device,
                 table_dir: str | Path | None = None) -> bool:
    """Whether ``m`` rows times this weight (``dtype``, on CUDA) run this
    kernel rather than the vendor's GEMM: an fp8 weight unless its tuned
    table says quantization plus ``torch._scaled_mm`` won at those rows, any
    other only where its table has a config for them."""
    entry = table_entry(m, n, k, dtype, device, table_dir)
    if dtype == torch.float8_e4m3fn:
        return entry != SCALED_MM
    return isinstance(entry, SkinnyConfig)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None,
                  bias: torch.Tensor | None = None, config: SkinnyConfig | None = None,
                  gated: bool = False) -> torch.Tensor:
    """``x @ (weight * scale).T + bias`` for ``x`` ``[M, K]`` with M at most
    :data:`MAX_ROWS` (unit stride along K); ``weight`` ``[N, K]`` (unit
    stride along K) in fp8 with float32 ``scale`` (N values) or in ``x``'s
    dtype without one. The output is ``[M, N]`` in ``x``'s dtype.

    ``gated``: ``weight`` is a fused ``[gate; up]`` projection (N even) and
    the output ``silu(gate) * up``, ``[M, N / 2]``, as SiLU-and-mul of the
    plain output gives it: each program computes a tile of gate rows and
    the same tile of up rows, so the activation needs no launch of its own
    and the ``[M, N]`` product is never written. ``config`` is still that of
    the whole weight; each half takes half its N tile (at least 16 on the
    tensor cores), so a program streams as many bytes."""
    m, k = x.shape
    n = weight.shape[0]
    if m > MAX_ROWS:
        raise ValueError(f"skinny_linear takes at most {MAX_ROWS} rows, got {m}")
    if gated and n % 2:
        raise ValueError(f"a gated weight stacks gate and up rows, so its rows must be even, got {n}")
    n_out = n // 2 if gated else n
    y = torch.empty((m, n_out), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    cfg = config or get_config(m, n, k, weight.dtype, x.device)
    if cfg.block_m < m:
        raise ValueError(f"config {cfg} has fewer rows than x ({m})")
    fma = cfg.block_m < 16
    if cfg.row_loop and not fma:
        raise ValueError(f"config {cfg}: row_loop is a CUDA-core form (block_m below 16)")
    block_n = max(cfg.block_n // 2, 1 if fma else 16) if gated else cfg.block_n
    k_per_split = triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k
    split = triton.cdiv(k, k_per_split)
    part = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1 else y
    flags = dict(HAS_SCALE=scale is not None, HAS_BIAS=bias is not None, GATED=gated, **pdl(x.device, m))
    scale_arg = scale if scale is not None else y  # an unused pointer where a flag is off
    bias_arg = bias if bias is not None else y
    _skinny_gemm_kernel[(triton.cdiv(n_out, block_n), split)](
        x, weight, scale_arg, bias_arg, y, part, m, n_out, k, x.stride(0), weight.stride(0), y.stride(0),
        k_per_split, PARTIAL=split > 1, FMA=fma, ROW_LOOP=fma and (cfg.row_loop or cfg.block_m == 1),
        DOT_F32=x.dtype == torch.float32 or (interpreting() and x.dtype == torch.bfloat16),
        BLOCK_M=cfg.block_m, BLOCK_N=block_n, BLOCK_K=cfg.block_k,
        LINE=min(cfg.block_k, 128 // weight.element_size()),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **flags)
    if split > 1:
        _split_sum_kernel[(triton.cdiv(n_out, 128),)](scale_arg, bias_arg, y, part, m, n_out, y.stride(0),
                                                      SPLIT=split, BLOCK_M=cfg.block_m, BLOCK_N=128, num_warps=4,
                                                      **flags)
    return y
