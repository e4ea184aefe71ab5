"""K/V stored into the pool by the rotary kernel (``triton_ops/rotary.py``
with ``kv_store``), in place of the attention backend's store launch: the
pool's bytes and the rotated q/k exactly as the rotary kernel followed by the
store kernel (``attention/triton_ops/kv_store.py``) give them, for bf16, fp8
and float32 pools, with and without Qwen3's per-head norms, over strided
views of a qkv output and scattered slots; the slots not written stay as
they were. On the CPU the kernels run in Triton's interpreter (one
subprocess); on a GPU the same cases run on CUDA. The torch path
(``RotaryEmbedding.forward`` off the kernels) stores what the kernel does.
"""

from __future__ import annotations

import os

import pytest
import torch

from triton_interpreter import run_interpreted

from radixserve.model_executor.forward_batch_info import KVStore
from radixserve.layers.rotary_embedding import get_rope
from radixserve.mem_cache.memory_pool import to_kv_dtype

HEADS, KV_HEADS, HEAD_DIM = 8, 2, 64
# (name, activations' dtype, pool dtype, Qwen3's head norms)
CASES = [
    ("bf16 pool", "bfloat16", "bfloat16", False),
    ("bf16 pool, head norms", "bfloat16", "bfloat16", True),
    ("fp8 e4m3 pool", "bfloat16", "float8_e4m3fn", False),
    ("fp8 e5m2 pool, head norms", "bfloat16", "float8_e5m2", True),
    ("float32", "float32", "float32", False),
]


def make_case(act: str, pool: str, norms: bool, device: str, tokens: int = 7, slots: int = 40, seed: int = 0):
    """q, k, v (views of one qkv output), positions, a zeroed pool's K/V
    buffers, scattered slots and the head norms' weights (or None)."""
    gen = torch.Generator().manual_seed(seed)
    dtype, pool_dtype = getattr(torch, act), getattr(torch, pool)
    qkv = (30 * torch.randn(tokens, (HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=gen)).to(device, dtype)
    q, k, v = qkv.split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1)
    positions = torch.randint(0, 4096, (tokens,), generator=gen).to(device)
    k_buf = torch.zeros(slots, KV_HEADS, HEAD_DIM, dtype=pool_dtype, device=device)
    loc = torch.randperm(slots, generator=gen)[:tokens].to(device)
    weights = None
    if norms:
        weights = tuple((1 + 0.1 * torch.randn(HEAD_DIM, generator=gen)).to(device, dtype) for _ in range(2))
    return q, k, v, positions, k_buf, torch.zeros_like(k_buf), loc, weights


def compare(device: str) -> dict:
    """Each case: whether the fused store gave the two launches' pool bytes
    and q/k exactly, and whether only the batch's slots were written."""
    from radixserve.layers.attention.triton_ops.kv_store import store_kv
    from radixserve.layers.triton_ops.rotary import rotary_embedding

    rope = get_rope(HEAD_DIM, 4096, 1e6).to(device)
    out = {}
    for seed, (name, act, pool, norms) in enumerate(CASES):
        q, k, v, positions, k_buf, v_buf, loc, weights = make_case(act, pool, norms, device, seed=seed)
        args = (positions, q, k, rope.cos_sin_cache, HEAD_DIM, weights, 1e-6)
        fused_q, fused_k = rotary_embedding(*args, v=v, kv_store=KVStore(k_buf, v_buf, loc))
        ref_q, ref_k = rotary_embedding(*args)
        ref_kb, ref_vb = torch.zeros_like(k_buf), torch.zeros_like(v_buf)
        store_kv(ref_k.view(-1, KV_HEADS, HEAD_DIM), v.reshape(-1, KV_HEADS, HEAD_DIM), ref_kb, ref_vb, loc)
        bytes_of = lambda t: t.view(torch.uint8) if t.element_size() == 1 else t  # noqa: E731
        untouched = torch.ones(k_buf.shape[0], dtype=torch.bool, device=device)
        untouched[loc] = False
        out[name] = {
            "q and k": torch.equal(fused_q, ref_q) and torch.equal(fused_k, ref_k),
            "k pool": torch.equal(bytes_of(k_buf), bytes_of(ref_kb)),
            "v pool": torch.equal(bytes_of(v_buf), bytes_of(ref_vb)),
            "written": bool((k_buf[loc].float().abs().sum((1, 2)) > 0).all()),
            "others untouched": bool((k_buf[untouched].float() == 0).all() and (v_buf[untouched].float() == 0).all()),
        }
    return out


SCRIPT = """
import json, sys
sys.path.insert(0, json.loads(sys.argv[1]))
from test_rotary_kv_store import compare
print(json.dumps(compare("cpu")))
"""


@pytest.fixture(scope="module")
def interpreted():
    return run_interpreted(SCRIPT, os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_the_rotary_kernel_stores_what_the_store_kernel_stores(interpreted, case):
    assert interpreted[case] == {"q and k": True, "k pool": True, "v pool": True, "written": True,
                                 "others untouched": True}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_rotary_kernel_stores_what_the_store_kernel_stores_on_the_gpu():
    got = compare("cuda")
    assert all(all(case.values()) for case in got.values()), got


@torch.inference_mode()
@pytest.mark.parametrize("pool", ["float32", "float8_e4m3fn"])
def test_the_torch_path_stores_the_rotated_k(pool):
    """Off the kernels (a CPU), ``forward`` rotates, then stores k and v as a
    backend's store does (cast to the pool's dtype, fp8 saturating)."""
    q, k, v, positions, k_buf, v_buf, loc, _ = make_case("float32", pool, False, "cpu")
    rope = get_rope(HEAD_DIM, 4096, 1e6)
    rot_q, rot_k = rope(positions, q, k, v, KVStore(k_buf, v_buf, loc))
    ref_q, ref_k = rope(positions, q, k)
    assert torch.equal(rot_q, ref_q) and torch.equal(rot_k, ref_k)
    pool_dtype = k_buf.dtype
    want_k = to_kv_dtype(ref_k.reshape(-1, KV_HEADS, HEAD_DIM), pool_dtype)
    want_v = to_kv_dtype(v.reshape(-1, KV_HEADS, HEAD_DIM), pool_dtype)
    assert torch.equal(k_buf[loc].float(), want_k.float()) and torch.equal(v_buf[loc].float(), want_v.float())
    assert k_buf.float().abs().sum() > 0


def test_only_the_triton_backend_on_cuda_offers_the_pool():
    """The torch-native backend stores K/V itself; the Triton one hands the
    pool to the rotary kernel only on CUDA (the interpreter's CPU tensors
    take its own store), and ``kv_stored`` without ``save_kv_cache`` is refused."""
    from types import SimpleNamespace

    from radixserve.layers.attention.torch_native_backend import TorchNativeAttnBackend
    from radixserve.layers.attention.triton_backend import TritonAttnBackend
    from radixserve.layers.radix_attention import RadixAttention

    layer = RadixAttention(HEADS, HEAD_DIM, 1.0, KV_HEADS, layer_id=0)
    k_buf = torch.zeros(4, KV_HEADS, HEAD_DIM)
    pool = SimpleNamespace(get_kv_buffer=lambda layer_id: (k_buf, k_buf))
    fb = SimpleNamespace(token_to_kv_pool=pool, out_cache_loc=torch.arange(2))
    assert TorchNativeAttnBackend.kv_store(object(), layer, fb) is None
    assert TritonAttnBackend().kv_store(layer, fb) is None
    with pytest.raises(ValueError, match="save_kv_cache must be True"):
        TritonAttnBackend().forward(None, None, None, layer, fb, save_kv_cache=False, kv_stored=True)
