"""CPU kernels in C (``csrc/``): decode and extend attention straight from
the paged KV pool, RMSNorm with its residual add, and rotary. They are built on first
use with the host's C compiler for the host's vector ISA, and loaded with
ctypes.

A plain C file needs neither torch's headers nor a build step at install: it
compiles in about a second, once per machine, into the radixserve cache
(``$RADIXSERVE_CACHE_DIR``, keyed by source, compiler and CPU). It links the
OpenMP runtime by soname, so inside a torch process it shares torch's threads.
Without a compiler (or with ``RADIXSERVE_CPU_KERNELS=0``)
:func:`decode_attention_available` is False: the torch-native backend keeps
its SDPA path, and the norms and rotary their torch code.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from typing import TYPE_CHECKING

import torch

from radixserve.cache_dir import cache_root

if TYPE_CHECKING:
    from radixserve.model_executor.forward_batch_info import PrefixGroupTable

logger = logging.getLogger(__name__)

DISABLE_ENV = "RADIXSERVE_CPU_KERNELS"  # "0" turns the kernels off
CSRC = os.path.join(os.path.dirname(__file__), "csrc")
SOURCES = [os.path.join(CSRC, name) for name in ("attention.c", "elementwise.c")]
HEADERS = [os.path.join(CSRC, "vector_math.h")]  # part of the build's cache key, as the sources are
CFLAGS = ["-O3", "-fPIC", "-shared", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=fast"]
BUILD_TIMEOUT_S = 300
# Split a request's keys only while that leaves at least this many per split.
MIN_KEYS_PER_SPLIT = 256
# Pool dtypes the kernel reads: float32, and fp8 through a table of its 256 values.
KV_DTYPES = (torch.float32, torch.float8_e4m3fn, torch.float8_e5m2)


def _cpu_identity() -> str:
    """What the compiled code depends on: the CPU model and its feature flags."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags", "Features"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor()


def _compile(compiler: str, out: str) -> str | None:
    """Build the shared library at ``out``; returns None or the error text.
    ``-march=native`` first; a compiler without it gets a generic build."""
    err = ""
    for arch in (["-march=native"], []):
        with tempfile.TemporaryDirectory(dir=os.path.dirname(out)) as tmp:
            tmp_out = os.path.join(tmp, "kernel.so")
            cmd = [compiler, *CFLAGS, *arch, *SOURCES, "-o", tmp_out, "-lm"]
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
            except (OSError, subprocess.TimeoutExpired) as e:
                return str(e)
            if proc.returncode == 0:
                os.replace(tmp_out, out)  # atomic: concurrent builders race harmlessly
                return None
            err = proc.stderr.strip()[-2000:]
    return err


@functools.cache
def _library() -> ctypes.CDLL | None:
    if os.environ.get(DISABLE_ENV, "1") == "0":
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        logger.warning("no C compiler found: CPU decode attention, norms and rotary stay on torch (slower)")
        return None
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60).stdout
        source = b""
        for path in SOURCES + HEADERS:
            with open(path, "rb") as f:
                source += f.read()
    except (OSError, subprocess.TimeoutExpired) as e:
        logger.warning("cannot build CPU kernels (%s): CPU decode attention, norms and rotary stay on torch", e)
        return None
    key = hashlib.sha256(b"\0".join(
        [source, version.encode(), " ".join(CFLAGS).encode(), platform.machine().encode(), _cpu_identity().encode()]
    )).hexdigest()[:16]
    folder = os.path.join(cache_root(), "kernels")
    path = os.path.join(folder, f"cpu_kernels-{key}.so")
    if not os.path.exists(path):
        os.makedirs(folder, exist_ok=True)
        error = _compile(compiler, path)
        if error is not None:
            logger.warning("building CPU kernels failed; CPU decode attention, norms and rotary stay on torch:\n%s", error)
            return None
        logger.info("built CPU kernels into %s", path)
    lib = ctypes.CDLL(path)
    logger.info("CPU kernels: %s", os.path.basename(path))
    p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    lib.rs_decode_attention.argtypes = [p, i64, p, p, p, p, i64, p, p, p, i32, i32, i32, i32, f32, i32, i32]
    lib.rs_decode_attention.restype = i32
    lib.rs_extend_attention.argtypes = [p, i64, p, p, p, p, i64, p, p, p, p, p, i32, i32, i32, i32, f32, i32]
    lib.rs_extend_attention.restype = i32
    lib.rs_grouped_decode_attention.argtypes = [p, i64, p, p, p, p, i64, p, p, p, i32, p, p, p, p, p, i32, i32, i32, i32,
                                                f32, i32]
    lib.rs_grouped_decode_attention.restype = i32
    lib.rs_add_rms_norm.argtypes = [p, i64, p, i64, p, p, p, i64, i32, f32, i32, i32]
    lib.rs_add_rms_norm.restype = None
    lib.rs_rotary.argtypes = [p, i64, p, i32, p, i64, p, i32, p, p, i64, i64, i32, i32]
    lib.rs_rotary.restype = i64
    return lib


def decode_attention_available() -> bool:
    return _library() is not None


def num_kv_splits(batch_size: int, max_len: int, threads: int) -> int:
    """Splits of each request's keys: enough items for every thread to get a
    few, while each split keeps at least ``MIN_KEYS_PER_SPLIT`` keys."""
    want = -(-4 * threads // batch_size)
    return max(1, min(want, max_len // MIN_KEYS_PER_SPLIT))


@functools.cache
def _decode_table(dtype: torch.dtype) -> torch.Tensor:
    """The float32 value of each of the 256 bytes of a one-byte dtype."""
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).float()


def _check_operands(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, req_to_token: torch.Tensor,
                    num_heads: int) -> tuple[int, int, torch.Tensor | None]:
    """What the attention kernels require of their operands (AssertionError
    otherwise); returns the pool's KV heads, its head size and the table that
    decodes a one-byte pool (None for float32)."""
    num_kv_heads, head_dim = k_buffer.shape[1], k_buffer.shape[2]
    assert q.dtype == torch.float32 and k_buffer.dtype == v_buffer.dtype and k_buffer.dtype in KV_DTYPES
    assert q.stride(1) == 1 and k_buffer.is_contiguous() and v_buffer.is_contiguous() and req_to_token.stride(1) == 1
    assert v_buffer.shape == k_buffer.shape and req_to_token.dtype == torch.int32
    assert q.shape[1] == num_heads * head_dim and num_heads % num_kv_heads == 0
    return num_kv_heads, head_dim, None if k_buffer.dtype == torch.float32 else _decode_table(k_buffer.dtype)


def decode_attention(
    q: torch.Tensor,  # [bs, num_heads * head_dim] float32, rows may be strided (a view of qkv)
    k_buffer: torch.Tensor,  # [pool_rows, num_kv_heads, head_dim] float32 or fp8, contiguous
    v_buffer: torch.Tensor,  # same shape
    req_to_token: torch.Tensor,  # [rows, max_context] int32
    req_pool_indices: torch.Tensor,  # [bs] int64
    seq_lens: torch.Tensor,  # [bs] int64, each >= 1, the new token's K/V already in the pool
    max_len: int,
    num_heads: int,
    scale: float,
) -> torch.Tensor:
    """One query token per request against its whole context, read straight
    from the paged pool; returns ``[bs, num_heads * head_dim]``."""
    bs = q.shape[0]
    num_kv_heads, head_dim, lut = _check_operands(q, k_buffer, v_buffer, req_to_token, num_heads)
    rows = req_pool_indices.to(torch.int64).contiguous()
    lens = seq_lens.to(torch.int64).contiguous()
    out = torch.empty(bs, num_heads * head_dim, dtype=torch.float32)
    threads = torch.get_num_threads()
    rc = _library().rs_decode_attention(
        q.data_ptr(), q.stride(0), k_buffer.data_ptr(), v_buffer.data_ptr(), None if lut is None else lut.data_ptr(),
        req_to_token.data_ptr(),
        req_to_token.stride(0), rows.data_ptr(), lens.data_ptr(), out.data_ptr(), bs, num_heads, num_kv_heads,
        head_dim, scale, num_kv_splits(bs, max_len, threads), threads,
    )
    if rc != 0:
        raise MemoryError("CPU decode attention could not allocate its scratch memory")
    return out


def extend_attention(
    q: torch.Tensor,  # [tokens, num_heads * head_dim] float32, rows may be strided (a view of qkv)
    k_buffer: torch.Tensor,  # [pool_rows, num_kv_heads, head_dim] float32 or fp8, contiguous
    v_buffer: torch.Tensor,  # same shape
    req_to_token: torch.Tensor,  # [rows, max_context] int32
    rows: torch.Tensor,  # [bs] int64: each request's req_to_token row
    prefix_lens: torch.Tensor,  # [bs] int64: its cached tokens
    extend_lens: torch.Tensor,  # [bs] int64: its new tokens (rows of q, request after request)
    q_starts: torch.Tensor,  # [bs] int64: its first row of q
    num_heads: int,
    scale: float,
) -> torch.Tensor:
    """Each new token against its request's keys up to itself (causal over
    the prefix and the new tokens), read straight from the paged pool, which
    already holds the new tokens' K/V; returns ``[tokens, num_heads * head_dim]``."""
    tokens = q.shape[0]
    num_kv_heads, head_dim, lut = _check_operands(q, k_buffer, v_buffer, req_to_token, num_heads)
    assert all(t.dtype == torch.int64 and t.is_contiguous() for t in (rows, prefix_lens, extend_lens, q_starts))
    out = torch.empty(tokens, num_heads * head_dim, dtype=torch.float32)
    rc = _library().rs_extend_attention(
        q.data_ptr(), q.stride(0), k_buffer.data_ptr(), v_buffer.data_ptr(), None if lut is None else lut.data_ptr(),
        req_to_token.data_ptr(), req_to_token.stride(0), rows.data_ptr(), prefix_lens.data_ptr(),
        extend_lens.data_ptr(), q_starts.data_ptr(), out.data_ptr(), rows.numel(), num_heads, num_kv_heads, head_dim,
        scale, torch.get_num_threads(),
    )
    if rc != 0:
        raise MemoryError("CPU extend attention could not allocate its scratch memory")
    return out


def grouped_decode_attention(
    q: torch.Tensor,  # [bs, num_heads * head_dim] float32, rows may be strided (a view of qkv)
    k_buffer: torch.Tensor,  # [pool_rows, num_kv_heads, head_dim] float32 or fp8, contiguous
    v_buffer: torch.Tensor,  # same shape
    req_to_token: torch.Tensor,  # [rows, max_context] int32
    req_pool_indices: torch.Tensor,  # [bs] int64
    seq_lens: torch.Tensor,  # [bs] int64, each >= 1, the new token's K/V already in the pool
    table: "PrefixGroupTable",  # forward_batch_info.PrefixGroupTable, on the CPU
    num_heads: int,
    scale: float,
) -> torch.Tensor:
    """:func:`decode_attention` with the shared prefixes of ``table`` read
    once per group (docs/prefix_grouped_decode.md): each group's prefix
    against all its members' queries in one pass, each request's own suffix
    as decode does, the two merged by their maxima and sums. Returns
    ``[bs, num_heads * head_dim]``."""
    bs = q.shape[0]
    num_kv_heads, head_dim, lut = _check_operands(q, k_buffer, v_buffer, req_to_token, num_heads)
    ints = [t.to(torch.int64).contiguous() for t in (req_pool_indices, seq_lens, table.suffix_starts, table.prefix_rows,
                                                   table.prefix_lens, table.member_starts, table.members)]
    rows, lens, suffix_starts, prefix_rows, prefix_lens, member_starts, members = ints
    out = torch.empty(bs, num_heads * head_dim, dtype=torch.float32)
    rc = _library().rs_grouped_decode_attention(
        q.data_ptr(), q.stride(0), k_buffer.data_ptr(), v_buffer.data_ptr(), None if lut is None else lut.data_ptr(),
        req_to_token.data_ptr(), req_to_token.stride(0), rows.data_ptr(), lens.data_ptr(), suffix_starts.data_ptr(),
        table.num_groups, prefix_rows.data_ptr(), prefix_lens.data_ptr(), member_starts.data_ptr(), members.data_ptr(),
        out.data_ptr(), bs, num_heads, num_kv_heads, head_dim, scale, torch.get_num_threads(),
    )
    if rc != 0:
        raise MemoryError("CPU grouped decode attention could not allocate its scratch memory")
    return out


def elementwise_takes(*rows: torch.Tensor | None) -> bool:
    """Whether :func:`add_rms_norm` and :func:`rotary` take these operands
    (None ones aside): float32 CPU ``[n, m]`` tensors with contiguous rows
    (any row stride), and the kernels built."""
    return all(t is None or (t.device.type == "cpu" and t.dtype == torch.float32 and t.dim() == 2 and t.stride(1) == 1)
               for t in rows) and _library() is not None


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``layernorm.RMSNorm.forward_native`` for float32 ``[rows, cols]``: with
    ``residual``, ``(norm(x + residual), x + residual)``, else ``(norm(x), None)``."""
    rows, cols = x.shape
    assert elementwise_takes(x, residual) and weight.dtype == torch.float32 and weight.is_contiguous()
    assert weight.shape == (cols,) and (residual is None or residual.shape == x.shape)
    add = residual is not None
    summed = torch.empty(rows, cols, dtype=torch.float32) if add else None
    out = torch.empty(rows, cols, dtype=torch.float32)
    _library().rs_add_rms_norm(x.data_ptr(), x.stride(0), residual.data_ptr() if add else None,
                               residual.stride(0) if add else 0, summed.data_ptr() if add else None,
                               weight.data_ptr(), out.data_ptr(), rows, cols, eps, int(add), torch.get_num_threads())
    return out, summed


def rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor,
           head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated, contiguous copies of float32 ``q [T, H*D]`` and ``k [T, Hkv*D]``
    (rows contiguous, views of one qkv row allowed), NeoX style, with
    ``cos_sin[positions]`` (``[max_pos, D]``: the cos halves, then the sin)."""
    assert elementwise_takes(q, k, cos_sin) and cos_sin.is_contiguous() and cos_sin.shape[1] == head_dim
    pos = positions.to(torch.int64).contiguous()
    q_out, k_out = torch.empty(q.shape, dtype=torch.float32), torch.empty(k.shape, dtype=torch.float32)
    bad = _library().rs_rotary(q.data_ptr(), q.stride(0), q_out.data_ptr(), q.shape[1] // head_dim, k.data_ptr(),
                               k.stride(0), k_out.data_ptr(), k.shape[1] // head_dim, pos.data_ptr(),
                               cos_sin.data_ptr(), cos_sin.shape[0], q.shape[0], head_dim, torch.get_num_threads())
    if bad:  # as indexing the cache would
        raise IndexError(f"{bad} positions out of the rotary cache's {cos_sin.shape[0]}")
    return q_out, k_out
