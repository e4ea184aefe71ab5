"""The Triton decode kernel over fp8 pools: what it compiles to for Hopper
(no GPU needed: Triton compiles for an NVIDIA target anywhere, and its wheel
carries cuobjdump) and, in Triton's interpreter, what it computes with a
bfloat16 model's query, where its dots run in float16."""

from __future__ import annotations

import os

import pytest

from triton_interpreter import run_interpreted

triton = pytest.importorskip("triton")


def _compiles_for_hopper() -> bool:
    try:
        from radixserve.bench import kernel_sass
    except ImportError:
        return False
    return os.path.exists(kernel_sass.cuobjdump_path())


needs_cuda_toolchain = pytest.mark.skipif(not _compiles_for_hopper(), reason="Triton without its NVIDIA tools")


def _opcodes(kv_cache_dtype: str):
    from radixserve.bench import kernel_sass

    return kernel_sass.summary(kv_cache_dtype)["opcodes"]


def _count(ops: dict, prefix: str) -> int:
    return sum(n for op, n in ops.items() if op == prefix or op.startswith(prefix + "."))


@needs_cuda_toolchain
@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_tiles_move_like_bf16_ones_on_hopper(kv_cache_dtype):
    """Over an fp8 pool the V tile must reach the tensor cores as the bf16
    one does, transposed as 16-bit values by ldmatrix, not read from shared
    memory a byte at a time, and fp8 must convert in pairs, not one value per
    instruction: either slow path cost the kernel 1.8x the time of a read at
    the memory's speed on an H200."""
    fp8, bf16 = _opcodes(kv_cache_dtype), _opcodes("bf16")
    assert _count(fp8, "LDS.U8") == 0
    assert _count(fp8, "LDSM.16.MT88") == _count(bf16, "LDSM.16.MT88") > 0
    unpacks = sum(n for op, n in fp8.items() if op.startswith("F2FP.F16.E") and op.endswith("UNPACK_B"))
    assert unpacks > 0 and _count(fp8, "F2F") < unpacks // 4  # F2F: the query's few, not one per K/V value
    assert _count(fp8, "HMMA") == _count(bf16, "HMMA")


_DECODE_SCRIPT = """
import json, sys
import torch
from radixserve.layers.attention.triton_ops import decode_attention as dec
from radixserve.mem_cache.memory_pool import resolve_kv_cache_dtype, to_kv_dtype
dec._num_sms = lambda device: 132  # an H200's; the interpreter has no device to ask
lens, kv_name = json.loads(sys.argv[1])
torch.manual_seed(0)
heads, kv_heads, dim = 8, 2, 64
kv_dtype = resolve_kv_cache_dtype(kv_name, torch.bfloat16)
slots = sum(lens) + 1
k = to_kv_dtype(torch.randn(slots, kv_heads, dim) * 3, kv_dtype)
v = to_kv_dtype(torch.randn(slots, kv_heads, dim) * 3, kv_dtype)
q = torch.randn(len(lens), heads, dim).to(torch.bfloat16)
perm = torch.randperm(slots - 1) + 1
req_to_token = torch.zeros(len(lens), max(lens), dtype=torch.int32)
start = 0
for i, n in enumerate(lens):
    req_to_token[i, :n] = perm[start:start + n]
    start += n
seq_lens = torch.tensor(lens)
max_splits = dec.splits_grid(len(lens), kv_heads, 132)
splits = dec.num_kv_splits_(torch.empty(len(lens), dtype=torch.int32), seq_lens, max_splits)
mid_o = torch.empty(len(lens), heads, max_splits, dim)
mid_lse = torch.empty(len(lens), heads, max_splits)
out = torch.empty_like(q)
dec.decode_attention_fwd(q, k, v, out, req_to_token, torch.arange(len(lens)), seq_lens, splits, max_splits,
                         mid_o, mid_lse, dim ** -0.5)
errors = []
for i, n in enumerate(lens):
    rows = req_to_token[i, :n].long()
    kk = k[rows].float().repeat_interleave(heads // kv_heads, dim=1)
    vv = v[rows].float().repeat_interleave(heads // kv_heads, dim=1)
    w = torch.softmax(torch.einsum("hd,nhd->hn", q[i].float(), kk) * dim ** -0.5, dim=-1)
    want = torch.einsum("hn,nhd->hd", w, vv)
    errors.append(float((out[i].float() - want).abs().max() / want.abs().max()))
print(json.dumps(errors))
"""


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_decode_kernel_with_a_bf16_query_over_fp8_pools(kv_cache_dtype):
    """float16 dots over the pool's exact values: the attention of the fp8
    values in float32, to the output's bfloat16 rounding."""
    errors = run_interpreted(_DECODE_SCRIPT, [[1, 70, 200, 9], kv_cache_dtype])
    assert max(errors) < 1e-2, errors
