"""Prefix-grouped decode on the GPU (GPU only; docs/prefix_grouped_decode.md):
the Triton kernels against float64 attention at W4's shapes, in bfloat16,
float32 and over fp8 pools, with the table passed as is and through a CUDA
graph's static buffers; and the Engine with CUDA graphs and overlap on, the
grouping on and off, against HF greedy tokens in float32."""

from __future__ import annotations

import random

import pytest
import torch

import radixserve
from radixserve.layers.attention import create_attention_backend
from radixserve.layers.radix_attention import RadixAttention
from radixserve.managers.prefix_groups import build_table
from radixserve.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool, to_kv_dtype
from radixserve.model_executor.forward_batch_info import ForwardBatch, ForwardMode, PrefixGroupTable
from test_prefix_grouped_decode import hf_greedy, llama, shared_prompts  # noqa: F401  (llama: a fixture)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DEVICE = "cuda"
HEAD_DIM = 128
KV_HEADS = 8
# (atol, rtol) against float64, as tests/test_triton_backend.py allows for each dtype
TOLERANCE = {torch.bfloat16: (2e-2, 2e-2), torch.float32: (2e-4, 2e-4), torch.float8_e4m3fn: (3e-2, 3e-2)}


class _Node:
    """Enough of a radix node for ``build_table``: a key and a parent."""

    _ids = iter(range(1 << 30))

    def __init__(self, length, parent=None):
        self.key, self.parent, self.id = [0] * length, parent, next(self._ids)


class _Req:
    def __init__(self, row, node):
        self.req_pool_idx, self.last_node = row, node


def w4_batch(groups: int, members: int, prefix: int, loners: int, kv_dtype, seed: int):
    """``groups`` groups of ``members`` requests sharing ``prefix`` tokens
    (page 16), ``loners`` in no group, members spread through the batch,
    suffixes of 1-300 tokens; the table from ``build_table``."""
    rng = random.Random(seed)
    page = 16
    bs = groups * members + loners
    order = list(range(bs))
    rng.shuffle(order)
    root = _Node(0)
    nodes = [_Node(prefix, root) for _ in range(groups)]
    suffix = [rng.randint(1, 300) for _ in range(bs)]
    shared_of = {order[g * members + i]: g for g in range(groups) for i in range(members)}
    seq_lens = [(prefix if i in shared_of else 0) + suffix[i] for i in range(bs)]
    num_slots = groups * prefix + sum(suffix) + page + 1
    kv = MHATokenToKVPool(num_slots, page, kv_dtype, KV_HEADS, HEAD_DIM, 1, DEVICE)
    gen = torch.Generator(DEVICE).manual_seed(seed)
    for buf in (*kv.k_buffer, *kv.v_buffer):
        buf.copy_(to_kv_dtype(torch.randn(buf.shape, generator=gen, device=DEVICE), kv_dtype))
    req_to_token = ReqToTokenPool(bs + 2, max(seq_lens) + 1, DEVICE)
    rows = req_to_token.alloc(bs)[::-1]
    free = iter((torch.randperm(num_slots - 1, generator=torch.Generator().manual_seed(seed)) + 1).tolist())
    prefix_slots = [torch.tensor([next(free) for _ in range(prefix)]) for _ in range(groups)]
    reqs = []
    for i, row in enumerate(rows):
        own = torch.tensor([next(free) for _ in range(suffix[i])])
        g = shared_of.get(i)
        req_to_token.write(row, 0, own if g is None else torch.cat([prefix_slots[g], own]))
        reqs.append(_Req(row, None if g is None else nodes[g]))
    return kv, req_to_token, rows, seq_lens, build_table(reqs, page)


def run_decode(kv, req_to_token, rows, seq_lens, table, q, group, *, static=False):
    layer = RadixAttention(KV_HEADS * group, HEAD_DIM, HEAD_DIM**-0.5, KV_HEADS, 0)
    backend = create_attention_backend("triton", None)
    backend.group, backend.num_kv_heads = group, KV_HEADS
    bs = len(rows)
    if table is not None:
        table = table.to(DEVICE)
        if static:  # as a CUDA graph of 16 more rows takes it
            padded = PrefixGroupTable.static(bs + 16, 0, torch.device(DEVICE))
            padded.fill(table, bs, bs + 16)
            table = padded.rows(bs)
    seq = torch.tensor(seq_lens, device=DEVICE)
    idx = torch.tensor(rows, device=DEVICE)
    fb = ForwardBatch(
        forward_mode=ForwardMode.DECODE, batch_size=bs, input_ids=torch.zeros(bs, dtype=torch.int64, device=DEVICE),
        positions=seq - 1, req_pool_indices=idx, seq_lens=seq,
        out_cache_loc=req_to_token.req_to_token[idx, seq - 1].to(torch.int64), seq_lens_cpu=list(seq_lens),
        req_to_token_pool=req_to_token, token_to_kv_pool=kv, attn_backend=backend, prefix_groups=table,
    )
    backend.init_forward_metadata(fb)
    # The new tokens' K/V are in the pool already (random), so the store is skipped.
    k_buf, v_buf = kv.get_kv_buffer(0)
    out = q.new_empty(bs, layer.num_heads, HEAD_DIM)
    backend._decode(q.view(bs, layer.num_heads, HEAD_DIM), out, layer, fb, fb.attn_metadata, slice(None))
    return out.view(bs, -1)


def dense(kv, req_to_token, rows, seq_lens, q, group):
    k_buf, v_buf = (b.double() for b in kv.get_kv_buffer(0))
    out = []
    for i, (row, n) in enumerate(zip(rows, seq_lens)):
        slots = req_to_token.req_to_token[row, :n].to(torch.int64)
        keys, values = k_buf[slots].repeat_interleave(group, 1), v_buf[slots].repeat_interleave(group, 1)
        qi = q[i].view(KV_HEADS * group, HEAD_DIM).double()
        probs = (torch.einsum("hd,khd->hk", qi, keys) * HEAD_DIM**-0.5).softmax(-1)
        out.append(torch.einsum("hk,khd->hd", probs, values).flatten())
    return torch.stack(out)


@pytest.mark.parametrize("dtype,kv_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32),
                                            (torch.bfloat16, torch.float8_e4m3fn)])
@pytest.mark.parametrize("shape", [(4, 16, 2048, 3, 4), (3, 70, 1000, 0, 2), (1, 2, 16, 5, 8), (0, 0, 0, 6, 4)],
                         ids=["w4", "big-groups", "one-page", "no-group"])
@pytest.mark.parametrize("static", [False, True], ids=["eager", "graph-input"])
def test_kernel_against_float64(dtype, kv_dtype, shape, static):
    groups, members, prefix, loners, group = shape
    kv, req_to_token, rows, seq_lens, table = w4_batch(groups, members, prefix, loners, kv_dtype, seed=sum(shape))
    assert (table is None) == (groups == 0)
    q = torch.randn(len(rows), KV_HEADS * group * HEAD_DIM, device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(1))
    got = run_decode(kv, req_to_token, rows, seq_lens, table, q.to(dtype), group, static=static)
    plain = run_decode(kv, req_to_token, rows, seq_lens, None, q.to(dtype), group)
    want = dense(kv, req_to_token, rows, seq_lens, q.to(dtype).float(), group)
    atol, rtol = TOLERANCE[kv_dtype if kv_dtype != torch.bfloat16 else dtype]
    torch.testing.assert_close(got.double(), want, atol=atol, rtol=rtol)
    torch.testing.assert_close(got.double(), plain.double(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("cuda_graph", [True, False], ids=["graph", "eager"])
def test_engine_tokens_match_hf_with_grouping(llama, cuda_graph):  # noqa: F811
    """float32, CUDA graphs and overlap on: grouped decode gives HF's greedy
    tokens, and the graphs replayed with groups in their table."""
    folder, hf = llama
    batch = shared_prompts(seed=4, families=3, per_family=5, prefix_len=40)
    params = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
    with radixserve.Engine(model_path=folder, device=DEVICE, dtype="float32", attention_backend="triton",
                           disable_cuda_graph=not cuda_graph, page_size=4, max_total_tokens=4096,
                           max_running_requests=32, enable_prefix_grouped_decode=True, check_invariants=True,
                           disable_tqdm=True) as eng:
        graphs = eng.scheduler.model_runner.cuda_graph_runner
        assert (graphs is not None and graphs.prefix_groups is not None) == cuda_graph
        filled = []
        if cuda_graph:
            fill = graphs.prefix_groups.fill
            graphs.prefix_groups.fill = lambda table, bs, padded: (filled.append(table is not None),
                                                                   fill(table, bs, padded))
        outs = eng.generate(input_ids=batch, sampling_params=params)
        eng.scheduler.check_memory()
    assert [o["output_ids"] for o in outs] == [hf_greedy(hf, ids, 12) for ids in batch]
    assert not cuda_graph or any(filled), "graphs replayed with prefix groups"
