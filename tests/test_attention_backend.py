"""The torch-native attention backend against plain dense causal attention,
over a paged KV pool whose slots are laid out by hand (pages scattered)."""

from __future__ import annotations

import shutil

import pytest
import torch

from radixserve.cache_dir import CACHE_ENV
from radixserve.layers import cpu_kernels
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


def run_and_check(mode, prefix_lens, extend_lens, page_size, group, save_kv_cache=True, seed=0, cpu_kernel=False):
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
    backend.cpu_decode_kernel = cpu_kernel
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


needs_kernel = pytest.mark.skipif(not cpu_kernels.decode_attention_available(), reason="no C compiler")


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
@pytest.mark.parametrize("cpu_kernel", [pytest.param(True, id="c-kernel", marks=needs_kernel),
                                        pytest.param(False, id="sdpa")])
def test_extend_matches_dense(page_size, group, prefix_lens, extend_lens, cpu_kernel):
    run_and_check(ForwardMode.EXTEND, prefix_lens, extend_lens, page_size, group, cpu_kernel=cpu_kernel)


DECODE_PATHS = [pytest.param(True, id="c-kernel", marks=needs_kernel), pytest.param(False, id="sdpa")]


@pytest.mark.parametrize("cpu_kernel", DECODE_PATHS)
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("context_lens", [[0], [0, 16, 3, 150], [31, 31], [700]])
def test_decode_matches_dense(page_size, group, context_lens, cpu_kernel):
    """[700] alone: the C kernel splits its keys (see ``num_kv_splits``)."""
    run_and_check(ForwardMode.DECODE, context_lens, [1] * len(context_lens), page_size, group, cpu_kernel=cpu_kernel)


@pytest.mark.parametrize("cpu_kernel", DECODE_PATHS)
@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.DECODE])
def test_without_saving_kv(mode, cpu_kernel):
    """save_kv_cache=False still attends to the new tokens but leaves the pool alone."""
    extend = [3, 4] if mode.is_extend() else [1, 1]
    run_and_check(mode, [9, 20], extend, page_size=4, group=2, save_kv_cache=False, cpu_kernel=cpu_kernel)


def test_unknown_backend_is_rejected():
    with pytest.raises(ValueError, match="torch_native"):
        create_attention_backend("flashinfer", None)


@needs_kernel
@pytest.mark.parametrize("splits", [1, 3, 8])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (32, 8, 128), (4, 4, 16), (14, 2, 64), (6, 2, 12)])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float8_e4m3fn, torch.float8_e5m2])
def test_cpu_decode_kernel_shapes_and_splits(num_heads, num_kv_heads, head_dim, kv_dtype, splits, monkeypatch):
    """Model head shapes, q as a strided view of a qkv row, keys split any
    number of ways (more splits than keys included), slots scattered; fp8
    pools (--kv-cache-dtype) read through the kernel's table."""
    monkeypatch.setattr(cpu_kernels, "num_kv_splits", lambda *_: splits)
    gen = torch.Generator().manual_seed(splits)
    lens = [1, 2, 33, 300]
    pool_rows = 1024
    k_buf, v_buf = (torch.randn(pool_rows, num_kv_heads, head_dim, generator=gen).to(kv_dtype) for _ in range(2))
    req_to_token = torch.zeros(6, 512, dtype=torch.int32)
    rows = torch.tensor([4, 1, 5, 2])
    for row, n in zip(rows.tolist(), lens):
        req_to_token[row, :n] = (torch.randperm(pool_rows - 1, generator=gen)[:n] + 1).to(torch.int32)
    qkv = torch.randn(len(lens), (num_heads + 2 * num_kv_heads) * head_dim, generator=gen)
    q = qkv[:, : num_heads * head_dim]
    scale = head_dim**-0.5
    out = cpu_kernels.decode_attention(
        q, k_buf, v_buf, req_to_token, rows, torch.tensor(lens), max(lens), num_heads, scale
    )
    for i, (row, n) in enumerate(zip(rows.tolist(), lens)):
        slots = req_to_token[row, :n].long()
        ref = dense_reference(q[i].view(1, num_heads, head_dim), k_buf[slots].float(), v_buf[slots].float(), n - 1, scale)
        torch.testing.assert_close(out[i].view(1, num_heads, head_dim), ref, atol=1e-5, rtol=1e-5)


@needs_kernel
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (32, 8, 128), (4, 4, 16), (6, 2, 12)])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float8_e4m3fn])
def test_cpu_extend_kernel_shapes(num_heads, num_kv_heads, head_dim, kv_dtype):
    """Each new token against its request's keys up to itself: new tokens
    that do not fill the kernel's groups of four (1, 2, 3, 5, 37), cached
    prefixes, one over many of the kernel's key blocks, q a strided view of a
    qkv row, slots scattered, rows out of order; fp8 pools through the table."""
    gen = torch.Generator().manual_seed(head_dim)
    prefix, new = [0, 7, 0, 70, 1, 0], [1, 2, 3, 5, 37, 100]
    pool_rows = 1024
    k_buf, v_buf = (torch.randn(pool_rows, num_kv_heads, head_dim, generator=gen).to(kv_dtype) for _ in range(2))
    req_to_token = torch.zeros(8, 256, dtype=torch.int32)
    rows = torch.tensor([4, 1, 7, 5, 0, 2])
    for row, n in zip(rows.tolist(), [p + e for p, e in zip(prefix, new)]):
        req_to_token[row, :n] = (torch.randperm(pool_rows - 1, generator=gen)[:n] + 1).to(torch.int32)
    qkv = torch.randn(sum(new), (num_heads + 2 * num_kv_heads) * head_dim, generator=gen)
    q = qkv[:, : num_heads * head_dim]
    scale = head_dim**-0.5
    lens = torch.tensor(new)
    out = cpu_kernels.extend_attention(q, k_buf, v_buf, req_to_token, rows, torch.tensor(prefix), lens,
                                       torch.cumsum(lens, 0) - lens, num_heads, scale)
    start = 0
    for row, p, n in zip(rows.tolist(), prefix, new):
        slots = req_to_token[row, : p + n].long()
        ref = dense_reference(q[start: start + n].view(n, num_heads, head_dim), k_buf[slots].float(),
                              v_buf[slots].float(), p, scale)
        torch.testing.assert_close(out[start: start + n].view(n, num_heads, head_dim), ref, atol=1e-5, rtol=1e-5)
        start += n


def test_kv_splits_keep_threads_busy_but_splits_long():
    assert cpu_kernels.num_kv_splits(64, 300, threads=2) == 1
    assert cpu_kernels.num_kv_splits(1, 100, threads=2) == 1  # too short to split
    assert cpu_kernels.num_kv_splits(1, 2000, threads=2) == 7  # 8 wanted, 256 keys each at least
    assert cpu_kernels.num_kv_splits(2, 100_000, threads=16) == 32


def test_cpu_kernel_build_is_cached_and_failures_fall_back(tmp_path, monkeypatch, caplog):
    """A fresh cache builds the library once; a broken compiler means no
    kernel and a warning, never an exception."""
    if not (shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("no C compiler")
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    cpu_kernels._library.cache_clear()
    try:
        assert cpu_kernels.decode_attention_available()
        built = list((tmp_path / "kernels").glob("cpu_kernels-*.so"))
        assert len(built) == 1
        mtime = built[0].stat().st_mtime_ns
        cpu_kernels._library.cache_clear()
        assert cpu_kernels.decode_attention_available()
        assert built[0].stat().st_mtime_ns == mtime  # loaded, not rebuilt

        cpu_kernels._library.cache_clear()
        monkeypatch.setenv(CACHE_ENV, str(tmp_path / "other"))
        monkeypatch.setenv("CC", "false")  # a compiler that always fails
        assert not cpu_kernels.decode_attention_available()
        assert "building CPU kernels failed" in caplog.text
        assert not list((tmp_path / "other" / "kernels").iterdir())  # nothing half-written left

        cpu_kernels._library.cache_clear()
        monkeypatch.delenv("CC")
        monkeypatch.setenv(cpu_kernels.DISABLE_ENV, "0")
        assert not cpu_kernels.decode_attention_available()
    finally:
        cpu_kernels._library.cache_clear()
