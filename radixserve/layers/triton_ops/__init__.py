"""Fused Triton kernels of the layers' GPU fast path.

- ``norm``: RMSNorm, alone or with the residual add fused in (also over
  Qwen3's per-head q/k rows).
- ``activation``: SiLU-and-mul over the fused ``gate_up`` output.
- ``skinny_gemm``: the linear layers' GEMM at a few rows, streaming fp8 or
  bf16 weights at the bandwidth of reading them.
- ``rotary``: neox RoPE of q and k in one launch, with Qwen3's per-head RMSNorm
  of q and k fused in where the model has it.
- ``tile``: the tile product the GEMM kernels share (CUDA cores or tensor cores).

Each kernel matches its layer's ``forward_native`` up to float rounding, runs
without host syncs and allocates only its outputs, so CUDA graphs can capture
it. The kernel modules import triton at the top: a layer imports one only
after :func:`use_triton` says yes, so a CPU install (no triton) never does.
"""

from __future__ import annotations

import functools
import os

import torch


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter (``TRITON_INTERPRET=1``,
    the CPU tests): numpy has no bfloat16, so a bf16 dot there is computed
    wrongly and the kernels run their dots in float32 instead."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.cache
def num_sms(device: torch.device | str) -> int:
    """The streaming multiprocessors of a CUDA device: kernels size their
    grids (K splits, key splits) to keep every one of them busy."""
    return torch.cuda.get_device_properties(device).multi_processor_count


def canonical_device(device) -> torch.device:
    """``cuda`` -> ``cuda:<current>``, so that device comparisons (and
    per-device buffers' keys) hold."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


# how the kernels' tuned tables name a dtype in their file names
DTYPE_NAMES = {torch.float8_e4m3fn: "fp8", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def device_name(device: torch.device) -> str:
    """A CUDA device's name, which keys the kernels' tuned tables, spaces as
    underscores: ``NVIDIA_H200``."""
    return _device_name(torch.cuda.current_device() if device.index is None else device.index)


@functools.cache
def _device_name(index: int) -> str:
    return torch.cuda.get_device_name(index).replace(" ", "_")


def use_triton(*tensors: torch.Tensor | None) -> bool:
    """Whether the fused kernels take these tensors (``None`` is skipped):
    all on a CUDA device with unit stride along the last dimension, and
    triton installed. CPU tensors fail the first test and never import triton."""
    return all(t is None or (t.is_cuda and t.stride(-1) == 1) for t in tensors) and triton_available()


PDL_ENV = "RADIXSERVE_PDL"  # "0": launch every kernel plainly (for an A/B of the two)
PDL_MAX_ROWS = 16  # launches over more tokens (or requests) go plainly


def pdl(device: torch.device, rows: int) -> dict:
    """Launch options for programmatic dependent launch (Hopper and later) of
    a kernel over ``rows`` tokens or requests: ``USE_PDL`` (the kernel's
    constexpr) and Triton's ``launch_pdl``. A kernel so launched may start
    while the kernel before it on the stream is still running: with
    ``USE_PDL`` it waits for that kernel's completion (``gdc_wait``) before
    touching anything but its weights, and lets the kernel after it start
    once its own main loop is done (``gdc_launch_dependents``). Chained
    kernels thus overlap one's launch and first loads with the other's tail.

    Only up to :data:`PDL_MAX_ROWS` rows, where a kernel lasts a few
    microseconds and its launch and tail are a large share of it: W2 at
    batch 1 steps 4-5% faster with it, at batch 32 and 256 it measured up to
    4% slower (benchmarks/README.md). Off (``USE_PDL`` False) off CUDA, under
    Triton's interpreter, before compute capability 9.0, with a Triton that
    lacks it, and with ``RADIXSERVE_PDL=0``."""
    if rows > PDL_MAX_ROWS or device.type != "cuda" or interpreting():
        return _NO_PDL
    return _pdl(torch.cuda.current_device() if device.index is None else device.index)


_NO_PDL = {"USE_PDL": False}


@functools.cache
def _pdl(index: int) -> dict:
    if os.environ.get(PDL_ENV, "1") == "0" or torch.cuda.get_device_capability(index)[0] < 9:
        return _NO_PDL
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: F401
    except ImportError:
        return _NO_PDL
    if "launch_pdl" not in getattr(CUDAOptions, "__dataclass_fields__", {}):
        return _NO_PDL
    return {"USE_PDL": True, "launch_pdl": True}
