"""The layers' fused Triton kernels against their torch reference
(``forward_native``), on CUDA tensors.

Without a GPU, ``TRITON_INTERPRET=1`` runs the same tests on CPU tensors
through Triton's interpreter (slow; for debugging the kernels): the layers
are then made to dispatch CPU tensors to the kernels.
"""

from __future__ import annotations

import importlib
import os

import pytest
import torch

from radixserve.layers import activation, layernorm, rotary_embedding
from radixserve.layers.activation import SiluAndMul
from radixserve.layers.layernorm import RMSNorm
from radixserve.layers.rotary_embedding import get_rope

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not (torch.cuda.is_available() or INTERPRET), reason="the fused kernels need a CUDA device (or TRITON_INTERPRET=1)"
    ),
]

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# (atol, rtol) against the torch path in the same dtype. The rotary kernel
# rounds once where torch rounds each product, so in half precision the two
# can differ by a few units in the last place of the products.
TOLERANCE = {torch.bfloat16: (5e-2, 2e-2), torch.float16: (1e-2, 3e-3), torch.float32: (1e-4, 1e-4)}
TOKENS = (0, 1, 7, 300, 4096)
# Triton's interpreter truncates float32 -> bfloat16; the GPU rounds to nearest even, as torch does.
EXACT_BF16 = not INTERPRET
HIDDEN = (64, 576, 4096)


@pytest.fixture(autouse=True)
def _dispatch_cpu_tensors_when_interpreting(monkeypatch):
    if DEVICE == "cpu":
        for module in (layernorm, activation, rotary_embedding):
            monkeypatch.setattr(module, "use_triton", lambda *tensors: True)


def randn(*shape, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(DEVICE, dtype)


def assert_close(actual, expected):
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    atol, rtol = TOLERANCE[expected.dtype]
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol)


def make_norm(hidden, dtype):
    norm = RMSNorm(hidden, eps=1e-6).to(DEVICE, dtype)
    norm.weight.data = 1 + 0.1 * randn(hidden, dtype=dtype, seed=1)
    return norm


@torch.inference_mode()
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("tokens", TOKENS)
def test_rms_norm(tokens, hidden, dtype):
    norm = make_norm(hidden, dtype)
    x, residual = 3 * randn(tokens, hidden, dtype=dtype), randn(tokens, hidden, dtype=dtype, seed=2)
    assert_close(norm(x), norm.forward_native(x))
    out, new_residual = norm(x, residual)
    ref_out, ref_residual = norm.forward_native(x, residual)
    assert_close(out, ref_out)
    if dtype == torch.bfloat16 and not EXACT_BF16:
        assert_close(new_residual, ref_residual)
    else:
        assert torch.equal(new_residual, ref_residual)


@torch.inference_mode()
def test_fused_add_residual_is_the_exact_sum():
    norm = make_norm(4096, torch.float32)
    x, residual = randn(300, 4096), randn(300, 4096, seed=2)
    _, new_residual = norm(x, residual)
    assert torch.equal(new_residual, x + residual)


@torch.inference_mode()
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", (64, 128))
@pytest.mark.parametrize("tokens", TOKENS)
def test_qk_norm_over_strided_heads(tokens, head_dim, dtype):
    """Qwen3's per-head norm: q and k are [T, H, D] views of the qkv output."""
    heads, kv_heads = 16, 4
    qkv = randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype)
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    norm = make_norm(head_dim, dtype)
    for x in (q.reshape(tokens, heads, head_dim), k.reshape(tokens, kv_heads, head_dim)):
        out = norm(x)
        assert_close(out, norm.forward_native(x))
        assert out.is_contiguous()  # the model views it back as [T, H*D]


@torch.inference_mode()
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", (64, 128))
@pytest.mark.parametrize("tokens", TOKENS)
def test_qk_norm_and_rotary_in_one_launch(tokens, head_dim, dtype):
    """Qwen3's per-head norms of q and k inside the rotary kernel: what the
    norm kernel then the rotary kernel give, and the torch path, within the
    tolerance (the sum of squares may be added up in another order)."""
    heads, kv_heads = 16, 4
    rope = get_rope(head_dim, 8192, 1e6).to(DEVICE)
    qkv = 3 * randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype)
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q_norm, k_norm = make_norm(head_dim, dtype), make_norm(head_dim, dtype)
    k_norm.weight.data = 1 - 0.1 * randn(head_dim, dtype=dtype, seed=4)
    positions = torch.randint(0, 8192, (tokens,), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    fused = rope.forward_with_head_norms(positions, q, k, q_norm, k_norm)
    if not tokens:
        assert [t.shape for t in fused] == [q.shape, k.shape]
        return
    heads_of = lambda x: x.reshape(tokens, -1, head_dim)  # noqa: E731
    two_launches = rope(positions, q_norm(heads_of(q)).flatten(1), k_norm(heads_of(k)).flatten(1))
    native = rope.forward_native(positions, q_norm.forward_native(heads_of(q)).flatten(1),
                                 k_norm.forward_native(heads_of(k)).flatten(1))
    for out, unfused, ref in zip(fused, two_launches, native):
        assert_close(out, unfused)
        assert_close(out, ref)


@torch.inference_mode()
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", HIDDEN)
@pytest.mark.parametrize("tokens", TOKENS)
def test_silu_and_mul(tokens, d, dtype):
    act, x = SiluAndMul(), 4 * randn(tokens, 2 * d, dtype=dtype)
    assert_close(act(x), act.forward_native(x))


@torch.inference_mode()
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads", [(8, 8), (32, 8), (12, 2)])
@pytest.mark.parametrize("head_dim", (64, 128))
@pytest.mark.parametrize("tokens", TOKENS)
def test_rotary_embedding(tokens, head_dim, heads, kv_heads, dtype):
    """q and k are strided views of the qkv output; the cos/sin cache stays
    float32 and is rounded to the query's dtype on the way."""
    rope = get_rope(head_dim, 8192, 10000.0).to(DEVICE)
    qkv = randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype)
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    positions = torch.randint(0, 8192, (tokens,), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    # (torch's view(T, -1, D) cannot take 0 tokens; the kernel returns empty tensors)
    expected = rope.forward_native(positions, q, k) if tokens else (q.contiguous(), k.contiguous())
    for out, ref in zip(rope(positions, q, k), expected):
        assert_close(out, ref)


@torch.inference_mode()
def test_layers_dispatch_to_the_kernels(monkeypatch):
    """The comparisons above mean something only if ``forward`` ran a kernel."""
    calls = []
    for module_name, name in (("norm", "rms_norm"), ("activation", "silu_and_mul"), ("rotary", "rotary_embedding")):
        module = importlib.import_module(f"radixserve.layers.triton_ops.{module_name}")
        kernel = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _k=kernel, _n=name, **kw: calls.append(_n) or _k(*a, **kw))
    x = randn(5, 128)
    make_norm(128, torch.float32)(x, x)
    SiluAndMul()(x)
    rope = get_rope(64, 16, 10000.0).to(DEVICE)
    rope(torch.arange(5, device=DEVICE), x, x[:, :64])
    assert calls == ["rms_norm", "silu_and_mul", "rotary_embedding"]
    calls.clear()  # Qwen3's head norms run inside the rotary kernel
    rope.forward_with_head_norms(torch.arange(5, device=DEVICE), x, x[:, :64], make_norm(64, torch.float32),
                                 make_norm(64, torch.float32))
    assert calls == ["rotary_embedding"]
