"""Fused Triton kernels of the layers' GPU fast path.

- ``norm``: RMSNorm, alone or with the residual add fused in (also over
  Qwen3's per-head q/k rows).
- ``activation``: SiLU-and-mul over the fused ``gate_up`` output.
- ``skinny_gemm``: the linear layers' GEMM at a few rows, streaming fp8 or
  bf16 weights at the bandwidth of reading them.
- ``rotary``: neox RoPE of q and k in one launch, with Qwen3's per-head RMSNorm
  of q and k fused in where the model has it.

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
