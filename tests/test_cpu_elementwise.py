"""The C RMSNorm and rotary kernels (layers/cpu_kernels.py) against the
modules' torch references, and the modules choosing them on a CPU."""

from __future__ import annotations

import pytest
import torch

from radixserve.layers import cpu_kernels
from radixserve.layers.layernorm import RMSNorm
from radixserve.layers.rotary_embedding import get_rope

pytestmark = pytest.mark.skipif(not cpu_kernels.decode_attention_available(), reason="no C compiler")


@pytest.mark.parametrize("rows", [0, 1, 7, 300])
@pytest.mark.parametrize("cols", [576, 13])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_kernel_matches_torch(rows, cols, with_residual):
    gen = torch.Generator().manual_seed(rows * cols)
    norm = RMSNorm(cols, eps=1e-5)
    norm.weight.data.normal_(generator=gen)
    wide = torch.randn(rows, cols + 9, generator=gen) * 3  # rows with a stride: a view of a wider output
    x, residual = wide[:, :cols], (torch.randn(rows, cols, generator=gen) if with_residual else None)
    assert cpu_kernels.elementwise_takes(x, residual)
    with torch.inference_mode():
        got = norm(x, residual)
        want = norm.forward_native(x, residual)
    got, want = (got, want) if with_residual else ((got,), (want,))
    for g, w in zip(got, want):
        assert g.shape == w.shape
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    if with_residual:
        assert torch.equal(got[1], want[1])  # the sum is exact
    assert torch.equal(x, wide[:, :cols])  # inputs untouched


@pytest.mark.parametrize("rope_scaling", [None, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 256}])
@pytest.mark.parametrize("head_dim,q_heads,k_heads", [(64, 9, 3), (128, 4, 1), (16, 2, 2)])
def test_rotary_kernel_matches_torch(head_dim, q_heads, k_heads, rope_scaling):
    rope = get_rope(head_dim, 2048, 10000.0, rope_scaling)
    gen = torch.Generator().manual_seed(head_dim)
    tokens = 37
    qkv = torch.randn(tokens, (q_heads + 2 * k_heads) * head_dim, generator=gen)
    q, k, _ = qkv.split([q_heads * head_dim, k_heads * head_dim, k_heads * head_dim], dim=-1)
    positions = torch.randint(0, rope.cos_sin_cache.shape[0], (tokens,), generator=gen)
    before = qkv.clone()
    got = rope(positions, q, k)
    want = rope.forward_native(positions, q, k)
    for g, w in zip(got, want):
        assert g.is_contiguous() and g.shape == w.shape
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)
    assert torch.equal(qkv, before)  # a copy, as the Triton kernel returns
    empty = rope(positions[:0], q[:0], k[:0])
    assert [t.shape for t in empty] == [(0, q_heads * head_dim), (0, k_heads * head_dim)]


def test_rotary_kernel_refuses_positions_outside_its_cache():
    rope = get_rope(16, 32, 10000.0)
    q, k = torch.randn(2, 32), torch.randn(2, 16)
    with pytest.raises(IndexError):
        rope(torch.tensor([3, 32]), q, k)
    with pytest.raises(IndexError):
        rope(torch.tensor([-1, 0]), q, k)


def test_other_inputs_keep_the_torch_path():
    """bfloat16, 3-D (per-head norms) and column-strided inputs are not the
    kernels': the modules fall back to their torch reference."""
    x = torch.randn(4, 8)
    assert not cpu_kernels.elementwise_takes(x.bfloat16())
    assert not cpu_kernels.elementwise_takes(x.view(4, 2, 4))
    assert not cpu_kernels.elementwise_takes(x.t())
    heads = x.view(4, 2, 4)
    assert torch.equal(RMSNorm(4)(heads), RMSNorm(4).forward_native(heads))
    assert torch.equal(RMSNorm(8)(x.bfloat16()), RMSNorm(8).forward_native(x.bfloat16()))
