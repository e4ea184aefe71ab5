"""The device side of programmatic dependent launch (see
:func:`radixserve.layers.triton_ops.pdl`): a kernel launched with it waits
for the kernel before it, lets the kernel after it start, and may prefetch
what no kernel writes before it waits."""

from __future__ import annotations

import triton
import triton.language as tl

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # an older Triton: pdl() never sets USE_PDL, so neither is reached
    gdc_launch_dependents = gdc_wait = None


@triton.jit
def pdl_wait(USE_PDL: tl.constexpr):
    """With ``USE_PDL``: wait until the kernel before on the stream has
    completed and its writes are visible. Call it before any load or store
    that another kernel's writes could touch."""
    if USE_PDL:
        gdc_wait()


@triton.jit
def pdl_trigger(USE_PDL: tl.constexpr):
    """With ``USE_PDL``: let the kernel after this one start once every
    program of this one has come here (it waits in turn, :func:`pdl_wait`).
    Kernels with a main loop call it after the loop, so that the next
    kernel's programs take no SM slot while this one still streams."""
    if USE_PDL:
        gdc_launch_dependents()


@triton.jit
def prefetch_l2(ptrs):
    """Ask L2 for the 128-byte lines of ``ptrs`` (a tensor of pointers) and
    go on without waiting for them."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // dummy $0", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)
