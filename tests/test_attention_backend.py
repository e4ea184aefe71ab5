"""The torch-native attention backend against plain dense causal attention,
over a paged KV pool whose slots are laid out by hand (pages scattered)."""

from __future__ import annotations

import pytest
import torch

from radixserve.layers.attention import create_attention_backend
from radixserve.layers.radix_attention import RadixAttention
from radixserve.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from radixserve.model_executor.forward_batch_info import ForwardBatch, ForwardMode

HEAD_DIM = 16
KV_HEADS = 2
LAYER_ID = 1  # the second of two layers, so a wrong layer index shows


class PagedContext:
    """A pool plus requests whose pages are handed out in shuffled order."""

    def __init__(self, seq_lens: list[int], page_size: int, seed: int):
        self.gen = torch.Generator().manual_seed(seed)
        self.page_size = page_size
        pages_needed = [-(-n // page_size) for n in seq_lens]
        num_pages = sum(pages_needed) + 3
        self.kv = MHATokenToKVPool(num_pages * page_size, page_size, torch.float32, KV_HEADS, HEAD_DIM, 2)
        self.req_to_token = ReqToTokenPool(len(seq_lens) + 2, max(seq_lens) + 1)
        self.rows = self.req_to_token.alloc(len(seq_lens))[::-1]  # rows out of order, too
        free_pages = (torch.randperm(num_pages, generator=self.gen) + 1).tolist()
        self.slots = []
        for row, n, p in zip(self.rows, seq_lens, pages_needed):
            pages = torch.tensor([free_pages.pop() for _ in range(p)])
            slots = (pages[:, None] * page_size + torch.arange(page_size)).flatten()[:n]
            self.req_to_token.write(row, 0, slots)
            self.slots.append(slots)

    def randn(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen)


def dense_reference(q, k, v, prefix_len: int, scale: float) -> torch.Tensor:
    """Causal attention of ``q [n, H, d]`` (positions prefix_len..) over ``k/v [ctx, Hkv, d]``."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    q_pos = prefix_len + torch.arange(q.shape[0])[:, None]
    scores = scores.masked_fill(torch.arange(k.shape[0])[None, :] > q_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def make_batch(ctx: PagedContext, mode: ForwardMode, prefix_lens, extend_lens, backend) -> ForwardBatch:
    seq_lens = [p + n for p, n in zip(prefix_lens, extend_lens)]
    out_loc = torch.cat([s[p:] for s, p in zip(ctx.slots, prefix_lens)])
    fb = ForwardBatch(
        forward_mode=mode,
        batch_size=len(seq_lens),
        input_ids=torch.zeros(len(out_loc), dtype=torch.int64),
        positions=torch.zeros(len(out_loc), dtype=torch.int64),  # unused by attention
        req_pool_indices=torch.tensor(ctx.rows),
        seq_lens=torch.tensor(seq_lens),
        out_cache_loc=out_loc,
        seq_lens_cpu=seq_lens,
        req_to_token_pool=ctx.req_to_token,
        token_to_kv_pool=ctx.kv,
        attn_backend=backend,
    )
    if mode.is_extend():
        ext = torch.tensor(extend_lens)
        fb.extend_prefix_lens, fb.extend_seq_lens = torch.tensor(prefix_lens), ext
        fb.extend_start_loc = torch.cumsum(ext, 0) - ext
        fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu = list(prefix_lens), list(extend_lens)
    return fb


def run_and_check(mode, prefix_lens, extend_lens, page_size, group, save_kv_cache=True, seed=0):
    num_heads = KV_HEADS * group
    ctx = PagedContext([p + n for p, n in zip(prefix_lens, extend_lens)], page_size, seed)
    layer = RadixAttention(num_heads, HEAD_DIM, HEAD_DIM**-0.5, KV_HEADS, LAYER_ID)
    # The cached prefixes: random K/V already in the pool.
    prefix_k = [ctx.randn(p, KV_HEADS, HEAD_DIM) for p in prefix_lens]
    prefix_v = [ctx.randn(p, KV_HEADS, HEAD_DIM) for p in prefix_lens]
    for slots, p, pk, pv in zip(ctx.slots, prefix_lens, prefix_k, prefix_v):
        ctx.kv.set_kv_buffer(LAYER_ID, slots[:p], pk, pv)
    total = sum(extend_lens)
    q = ctx.randn(total, num_heads * HEAD_DIM)
    k, v = ctx.randn(total, KV_HEADS * HEAD_DIM), ctx.randn(total, KV_HEADS * HEAD_DIM)

    backend = create_attention_backend("torch_native", None)
    fb = make_batch(ctx, mode, prefix_lens, extend_lens, backend)
    backend.init_forward_metadata(fb)
    out = layer(q, k, v, fb, save_kv_cache=save_kv_cache)

    assert out.shape == (total, num_heads * HEAD_DIM)
    start = 0
    for i, (p, n) in enumerate(zip(prefix_lens, extend_lens)):
        new = slice(start, start + n)
        k_new, v_new = k[new].view(n, KV_HEADS, HEAD_DIM), v[new].view(n, KV_HEADS, HEAD_DIM)
        ref = dense_reference(
            q[new].view(n, num_heads, HEAD_DIM), torch.cat([prefix_k[i], k_new]), torch.cat([prefix_v[i], v_new]),
            p, layer.scaling,
        )
        torch.testing.assert_close(out[new].view(n, num_heads, HEAD_DIM), ref, atol=1e-5, rtol=1e-5)
        stored_k, stored_v = ctx.kv.get_kv_buffer(LAYER_ID)
        new_slots = ctx.slots[i][p:]
        if save_kv_cache:
            assert torch.equal(stored_k[new_slots], k_new) and torch.equal(stored_v[new_slots], v_new)
        else:
            assert not stored_k[new_slots].any()
        assert not ctx.kv.get_key_buffer(0).any(), "wrote into another layer"
        start += n


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize(
    "prefix_lens,extend_lens",
    [
        ([0], [23]),  # plain prefill
        ([0, 5, 40], [7, 9, 1]),  # no prefix, partial prefix, a decode riding along
        ([130, 17], [25, 16]),  # long prefix spanning many pages
    ],
)
def test_extend_matches_dense(page_size, group, prefix_lens, extend_lens):
    run_and_check(ForwardMode.EXTEND, prefix_lens, extend_lens, page_size, group)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("context_lens", [[0], [0, 16, 3, 150], [31, 31]])
def test_decode_matches_dense(page_size, group, context_lens):
    run_and_check(ForwardMode.DECODE, context_lens, [1] * len(context_lens), page_size, group)


@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.DECODE])
def test_without_saving_kv(mode):
    """save_kv_cache=False still attends to the new tokens but leaves the pool alone."""
    extend = [3, 4] if mode.is_extend() else [1, 1]
    run_and_check(mode, [9, 20], extend, page_size=4, group=2, save_kv_cache=False)


def test_unknown_backend_is_rejected():
    with pytest.raises(ValueError, match="torch_native"):
        create_attention_backend("flashinfer", None)


@pytest.mark.parametrize("page_size", [1, 16])
def test_decode_steps_reuse_and_rebuild_the_dense_cache(page_size):
    """Consecutive decode steps of the same requests reuse the CPU dense K/V
    cache; a changed batch rebuilds it. Every step must equal the reference."""
    group, steps, start_lens = 2, 3, [20, 35, 9]
    num_heads = KV_HEADS * group
    ctx = PagedContext([n + steps + 1 for n in start_lens], page_size, seed=3)
    layer = RadixAttention(num_heads, HEAD_DIM, HEAD_DIM**-0.5, KV_HEADS, LAYER_ID)
    full_k = [ctx.randn(n + steps + 1, KV_HEADS, HEAD_DIM) for n in start_lens]
    full_v = [ctx.randn(n + steps + 1, KV_HEADS, HEAD_DIM) for n in start_lens]
    for slots, n, fk, fv in zip(ctx.slots, start_lens, full_k, full_v):
        ctx.kv.set_kv_buffer(LAYER_ID, slots[:n], fk[:n], fv[:n])
    backend = create_attention_backend("torch_native", None)
    plans = []
    # three steps of all requests, then one step of a smaller batch (the first request left)
    schedule = [[0, 1, 2]] * steps + [[1, 2]]
    lens = list(start_lens)
    for batch in schedule:
        sub = PagedContext.__new__(PagedContext)
        sub.__dict__.update(ctx.__dict__)
        sub.rows, sub.slots = [ctx.rows[i] for i in batch], [ctx.slots[i][: lens[i] + 1] for i in batch]
        prefix = [lens[i] for i in batch]
        fb = make_batch(sub, ForwardMode.DECODE, prefix, [1] * len(batch), backend)
        backend.init_forward_metadata(fb)
        plans.append(fb.attn_metadata.dense)
        q = ctx.randn(len(batch), num_heads * HEAD_DIM)
        k = torch.stack([full_k[i][lens[i]] for i in batch]).view(len(batch), -1)
        v = torch.stack([full_v[i][lens[i]] for i in batch]).view(len(batch), -1)
        out = layer(q, k, v, fb)
        for j, i in enumerate(batch):
            n = lens[i] + 1
            ref = dense_reference(q[j].view(1, num_heads, HEAD_DIM), full_k[i][:n], full_v[i][:n], n - 1, layer.scaling)
            torch.testing.assert_close(out[j].view(1, num_heads, HEAD_DIM), ref, atol=1e-5, rtol=1e-5)
        for i in batch:
            lens[i] += 1
    assert plans == [True, False, False, True], "rebuild, reuse twice, rebuild for the new batch"
