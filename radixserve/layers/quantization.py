"""Online fp8 quantization of the linear layers (``--quantization fp8``, as in
SGLang and vLLM, on a bf16 / fp16 / fp32 checkpoint): W8A8 in float8 e4m3.

- **Weights** are quantized once, after loading, per output channel: each row
  of ``W`` ``[out, in]`` gets a float32 scale ``amax(|row|) / 448`` and is
  stored in fp8 after division by it: half the bytes of bf16, and the memory
  freed goes to the KV pool.
- **Activations** are quantized per token, dynamically, before each
  ``_scaled_mm`` GEMM: one Triton kernel on CUDA (``triton_ops/fp8_quant.py``),
  torch ops elsewhere.
- **The GEMM** at a few rows (decode batches up to ``SKINNY_MAX_ROWS``, on
  CUDA) is the skinny kernel (``triton_ops/skinny_gemm.py``): it streams the
  fp8 weight, converts it in registers (to float32 for one row on the CUDA
  cores, to bf16 for the tensor cores) and leaves the activations
  unquantized: a weight-bound GEMM reads half the bytes of bf16 and does no
  more work than a bf16 one. Where the weight's tuned table on this GPU
  says quantization plus ``_scaled_mm`` was faster at those rows
  (``skinny_gemm.takes_kernel``), that path runs instead. (bf16 and fp16
  weights take the same kernel at the rows their own tables give it.)
  Above that it is ``torch._scaled_mm``, which applies the per-token and
  per-channel scales to its float32 accumulator (cuBLASLt / CUTLASS on a GPU
  with fp8 tensor cores, compute capability 8.9 or higher; a reference kernel
  on the CPU, which CI runs). On CUDA the output is bf16 (what row-wise
  scaling supports) and is cast to the model's dtype if that differs.

The embedding, the LM head and the norms stay in the model's dtype, as in
SGLang. Under tensor parallelism each rank quantizes its own shard and its
own slice of each input (docs/tensor_parallel.md). Checkpoints stored in fp8
(with ``weight_scale`` tensors) are not loaded: their extra tensors fail the
loader with a clear error.
"""

from __future__ import annotations

import torch

from radixserve.layers.triton_ops import use_triton
from radixserve.server_args import QUANTIZATIONS

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)  # an all-zero row still gets a finite, positive scale
SKINNY_MAX_ROWS = 16  # up to here the skinny kernel can beat quantization + _scaled_mm (benchmarks/README.md)
# Rows at which the skinny kernel with SiLU-and-mul in its epilogue beat it followed by the activation
# kernel on llama-3.1-8b's gate_up (H100): at one row (the CUDA cores) and at 16 it was slower.
GATED_ROWS = range(2, 9)


def quantize_fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[M, K]`` as fp8 rows and their float32 scales ``[M, 1]``:
    ``q = clamp(x / s, ±448)`` with ``s = max(amax(|x|) / 448, MIN_SCALE)``,
    so ``q * s`` approximates ``x``."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp_(min=MIN_SCALE)
    return (xf / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def quantize_tokens(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token fp8 quantization of activations ``[M, K]``: the fused kernel
    on CUDA, :func:`quantize_fp8_rows` elsewhere."""
    if use_triton(x):
        from radixserve.layers.triton_ops.fp8_quant import per_token_quant_fp8

        return per_token_quant_fp8(x, FP8_DTYPE, MIN_SCALE)
    return quantize_fp8_rows(x)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T + bias`` with ``W ≈ weight * weight_scale`` (fp8 ``[N, K]``,
    float32 ``[1, N]``): on CUDA at up to :data:`SKINNY_MAX_ROWS` rows the
    skinny kernel (``x`` as it is, the weight converted in registers), else
    ``x`` quantized per token and :func:`scaled_mm_linear`."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if takes_skinny(x2, weight):
        from radixserve.layers.triton_ops.skinny_gemm import skinny_linear

        y = skinny_linear(x2, weight, weight_scale.view(-1), bias)
    else:
        y = scaled_mm_linear(x2, weight, weight_scale)
        if y.dtype != x.dtype:
            y = y.to(x.dtype)
        if bias is not None:
            y = y.add_(bias)
    return y.reshape(*shape[:-1], weight.shape[0])


def takes_skinny(x2: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether rows ``x2`` ``[M, K]`` times ``weight`` run the skinny kernel:
    on CUDA, up to :data:`SKINNY_MAX_ROWS` rows, both with unit stride along
    K, where ``skinny_gemm.takes_kernel`` says so for the weight's dtype (fp8
    unless its tuned table prefers ``_scaled_mm`` at those rows; bf16 and
    fp16 only where their table has a config)."""
    m = x2.shape[0]
    if not (0 < m <= SKINNY_MAX_ROWS and use_triton(x2, weight) and x2.stride(-1) == 1 and weight.stride(-1) == 1):
        return False
    from radixserve.layers.triton_ops.skinny_gemm import takes_kernel

    return takes_kernel(m, weight.shape[0], weight.shape[1], weight.dtype, x2.device)


def gated_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor | None = None,
                 bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """``silu(gate) * up`` of ``x @ W.T + bias`` for a fused ``[gate; up]``
    weight (fp8 with its ``weight_scale``, or plain), in one skinny-kernel
    launch (the activation in its epilogue) where the plain product would
    take that kernel (:func:`takes_skinny`) and the rows are among
    :data:`GATED_ROWS`; None elsewhere, where the caller applies the
    activation to the plain product."""
    x2 = x.reshape(-1, x.shape[-1])
    if x2.shape[0] not in GATED_ROWS or not takes_skinny(x2, weight):
        return None
    from radixserve.layers.triton_ops.skinny_gemm import skinny_linear

    scale = None if weight_scale is None else weight_scale.view(-1)
    y = skinny_linear(x2, weight, scale, bias, gated=True)
    return y.reshape(*x.shape[:-1], weight.shape[0] // 2)


def scaled_mm_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """``x`` ``[M, K]`` quantized per token, times the fp8 ``weight``, by
    ``torch._scaled_mm`` (bf16 out on CUDA, ``x``'s dtype elsewhere)."""
    out_dtype = torch.bfloat16 if x.is_cuda else x.dtype
    if x.shape[0] == 0:
        return x.new_empty((0, weight.shape[0]), dtype=out_dtype)
    q, scale = quantize_tokens(x)
    return torch._scaled_mm(q, weight.t(), scale_a=scale, scale_b=weight_scale, out_dtype=out_dtype,
                            use_fast_accum=x.is_cuda)


def check_quantization(name: str | None, device: torch.device) -> None:
    """Raise ValueError for an unknown method or a device without fp8 GEMMs."""
    if name is None:
        return
    if name not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {name!r}")
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        cap = ".".join(map(str, torch.cuda.get_device_capability(device)))
        raise ValueError(f"quantization fp8 needs fp8 tensor cores (compute capability 8.9 or higher); "
                         f"{torch.cuda.get_device_name(device)} has {cap}")
