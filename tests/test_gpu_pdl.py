"""Programmatic dependent launch (``triton_ops.pdl``): on where the GPU has
it, off on a CPU and with ``RADIXSERVE_PDL=0``; and a decode MLP's chain of
PDL kernels (residual add + RMSNorm, the skinny fp8 GEMM with its L2
prefetch, SiLU-and-mul, the skinny GEMM again, over several layers) replayed
from a CUDA graph computes bit for bit what the same kernels launched plainly
compute. A kernel that read its input before the kernel writing it had
finished would differ. The engine tests cover the rest of the chain
(rotary, the K/V store, decode attention) against HF."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

HIDDEN, INTERMEDIATE, LAYERS = 4096, 14336, 4


@pytest.fixture
def pdl_switch(monkeypatch):
    """``switch(on)``: the next kernels launch with PDL or plainly."""
    from radixserve.layers.triton_ops import PDL_ENV, _pdl

    def switch(on: bool) -> None:
        monkeypatch.setenv(PDL_ENV, "1" if on else "0")
        _pdl.cache_clear()

    yield switch
    _pdl.cache_clear()  # the environment comes back after this: the next call reads it again


def test_pdl_is_on_from_hopper_at_a_few_rows_and_off_elsewhere(pdl_switch):
    from radixserve.layers.triton_ops import PDL_MAX_ROWS, pdl

    cuda = torch.device("cuda")
    assert pdl(torch.device("cpu"), 1) == {"USE_PDL": False}
    hopper = torch.cuda.get_device_capability()[0] >= 9
    pdl_switch(True)
    assert pdl(cuda, 1)["USE_PDL"] is pdl(cuda, PDL_MAX_ROWS)["USE_PDL"] is hopper
    assert pdl(cuda, PDL_MAX_ROWS + 1) == {"USE_PDL": False}
    pdl_switch(False)
    assert pdl(cuda, 1) == {"USE_PDL": False}


def _weights(gen):
    from radixserve.layers.quantization import quantize_fp8_rows

    layers = []
    for _ in range(LAYERS):
        up = torch.randn(2 * INTERMEDIATE, HIDDEN, device="cuda", generator=gen, dtype=torch.bfloat16) / HIDDEN**0.5
        down = torch.randn(HIDDEN, INTERMEDIATE, device="cuda", generator=gen, dtype=torch.bfloat16) / INTERMEDIATE**0.5
        norm = 1 + 0.1 * torch.randn(HIDDEN, device="cuda", generator=gen, dtype=torch.bfloat16)
        (uq, us), (dq, ds) = quantize_fp8_rows(up), quantize_fp8_rows(down)
        layers.append((norm, uq, us.view(-1), dq, ds.view(-1)))
    return layers


def _mlps(x, residual, layers):
    from radixserve.layers.triton_ops.activation import silu_and_mul
    from radixserve.layers.triton_ops.norm import rms_norm
    from radixserve.layers.triton_ops.skinny_gemm import skinny_linear

    for norm, uq, us, dq, ds in layers:
        h, residual = rms_norm(x, norm, 1e-6, residual=residual)
        x = skinny_linear(silu_and_mul(skinny_linear(h, uq, us)), dq, ds)
    return x, residual


@pytest.mark.parametrize("rows", [1, 4])  # the CUDA-core and the tensor-core tiles
def test_a_chain_of_pdl_kernels_in_a_cuda_graph_equals_plain_launches(pdl_switch, rows):
    gen = torch.Generator(device="cuda").manual_seed(rows)
    layers = _weights(gen)
    inputs = [(torch.randn(rows, HIDDEN, device="cuda", generator=gen, dtype=torch.bfloat16),
               torch.randn(rows, HIDDEN, device="cuda", generator=gen, dtype=torch.bfloat16)) for _ in range(5)]
    pdl_switch(False)
    expected = [_mlps(x, r, layers) for x, r in inputs]

    pdl_switch(True)
    static_x, static_r = (t.clone() for t in inputs[0])
    _mlps(static_x, static_r, layers)  # compiles the PDL variants outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, res = _mlps(static_x, static_r, layers)
    for _ in range(3):  # replays back to back, then read: any early read would show
        for (x, r), (want, want_res) in zip(inputs, expected):
            static_x.copy_(x)
            static_r.copy_(r)
            graph.replay()
            assert torch.equal(out, want) and torch.equal(res, want_res)
    eager = _mlps(*inputs[1], layers)  # and launched eagerly, back to back
    assert torch.equal(eager[0], expected[1][0])
