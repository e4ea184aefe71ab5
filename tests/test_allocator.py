"""Unit tests of ReqToTokenPool, the paged KV allocator and the KV pool."""

import pytest
import torch

from radixserve.mem_cache import (
    MHATokenToKVPool, PoolExhausted, ReqToTokenPool, TokenToKVPoolAllocator, page_aligned, page_floor, pages_for,
)


def t(*xs):
    return torch.tensor(xs, dtype=torch.int64)


@pytest.mark.parametrize("page_size", [1, 16])
def test_alloc_free_returns_everything(page_size):
    a = TokenToKVPoolAllocator(size=8 * page_size, page_size=page_size)
    assert a.available_size() == 8 * page_size
    slots = a.alloc(3 * page_size)
    assert len(slots) == 3 * page_size and len(set(slots.tolist())) == 3 * page_size
    assert bool((slots >= page_size).all()), "the dummy page is never handed out"
    a.check_invariants()
    assert a.available_size() == 5 * page_size
    a.free(slots)
    a.check_invariants()
    assert a.available_size() == 8 * page_size


def test_alloc_fails_cleanly_when_short():
    a = TokenToKVPoolAllocator(size=4 * 16, page_size=16)
    assert a.alloc(65) is None
    assert a.available_size() == 64
    assert a.alloc_extend(t(0, 0), t(40, 40), t(0, 0)) is None  # 3 + 3 pages > 4
    assert a.available_size() == 64
    a.check_invariants()


def test_page_rounding_of_ints_and_tensors():
    assert [pages_for(n, 16) for n in (0, 1, 16, 17)] == [0, 1, 1, 2]
    assert [page_aligned(n, 16) for n in (0, 1, 16, 17)] == [0, 16, 16, 32]
    assert [page_floor(n, 16) for n in (0, 15, 16, 33)] == [0, 0, 16, 32]
    assert pages_for(t(0, 1, 17), 16).tolist() == [0, 1, 2]  # the allocator's batched extends
    assert page_floor(t(15, 33), 16).tolist() == [0, 32]
    assert TokenToKVPoolAllocator(size=100, page_size=16).size == 96  # whole pages only


def test_page_returns_only_when_all_its_slots_are_free():
    a = TokenToKVPoolAllocator(size=4 * 16, page_size=16)
    slots = a.alloc(16)
    a.free(slots[:10])
    assert a.available_size() == 3 * 16
    a.free(slots[10:15])
    assert a.available_size() == 3 * 16
    a.free(slots[15:])
    assert a.available_size() == 4 * 16
    a.check_invariants()


def test_double_free_and_dummy_free_are_errors():
    a = TokenToKVPoolAllocator(size=32, page_size=1)
    slots = a.alloc(4)
    a.free(slots[:2])
    with pytest.raises(RuntimeError, match="not in use"):
        a.free(slots[:1])
    with pytest.raises(RuntimeError, match="not in use"):
        a.free(t(0))


def test_alloc_extend_fills_last_partial_page_first():
    a = TokenToKVPoolAllocator(size=8 * 4, page_size=4)
    first = a.alloc_extend(t(0), t(6), t(0))  # pages p, q; q has 2 of 4 used
    assert (first // 4).unique().numel() == 2
    more = a.alloc_extend(t(6), t(11), t(int(first[-1])))
    # positions 6, 7 continue the partial page; 8, 9, 10 take a fresh one
    assert more[:2].tolist() == [int(first[-1]) + 1, int(first[-1]) + 2]
    assert more[2] % 4 == 0 and more[2:].tolist() == [int(more[2]) + i for i in range(3)]
    a.check_invariants()
    assert a.available_size() == 8 * 4 - 3 * 4


def test_alloc_extend_batch_layout():
    a = TokenToKVPoolAllocator(size=64, page_size=4)
    base = a.alloc_extend(t(0, 0), t(3, 5), t(0, 0))
    r0, r1 = base[:3], base[3:]
    out = a.alloc_extend(t(3, 5), t(5, 6), t(int(r0[-1]), int(r1[-1])))
    assert out[0] == r0[-1] + 1  # request 0 fills its page
    assert out[1] % 4 == 0  # then needs a new page at position 4
    assert out[2] == r1[-1] + 1  # request 1 continues inside its second page
    a.check_invariants()


def test_alloc_decode_new_page_only_at_boundary():
    a = TokenToKVPoolAllocator(size=64, page_size=4)
    pre = a.alloc_extend(t(0), t(4), t(0))
    before = a.available_size()
    d1 = a.alloc_decode(t(5), t(int(pre[-1])))  # position 4: a new page
    assert a.available_size() == before - 4 and int(d1[0]) % 4 == 0
    d2 = a.alloc_decode(t(6), t(int(d1[0])))  # position 5: same page
    assert a.available_size() == before - 4 and int(d2[0]) == int(d1[0]) + 1
    a.check_invariants()


@pytest.mark.parametrize("page_size", [1, 4])
def test_alloc_decode_takes_the_slots_the_general_path_takes(page_size):
    """The host-side decode path and alloc_extend agree on a batch mixing
    requests inside a page and at a page boundary."""
    lens = t(3, 4, 8, 9, 1)
    results = []
    for decode in (True, False):
        a = TokenToKVPoolAllocator(size=64, page_size=page_size)
        pre = [a.alloc_extend(t(0), t(n), t(0)) for n in lens.tolist()]
        last = t(*[int(p[-1]) for p in pre])
        slots = a.alloc_decode(lens + 1, last) if decode else a.alloc_extend(lens, lens + 1, last)
        a.check_invariants()
        results.append((slots.tolist(), a.available_size()))
    assert results[0] == results[1]


def test_free_group_batches():
    a = TokenToKVPoolAllocator(size=32, page_size=4)
    s = a.alloc(16)
    a.free_group_begin()
    a.free(s[:4])
    a.free(s[4:])
    assert a.available_size() == 16  # nothing freed until the group ends
    a.free_group_end()
    assert a.available_size() == 32
    a.check_invariants()


def test_req_to_token_pool():
    pool = ReqToTokenPool(size=2, max_context_len=8)
    rows = pool.alloc(2)
    with pytest.raises(PoolExhausted, match="0 of 2 free"):
        pool.alloc(1)
    pool.write(rows[0], 2, t(5, 6, 7))
    assert pool.req_to_token[rows[0], 2:5].tolist() == [5, 6, 7]
    with pytest.raises(ValueError, match="max_context_len"):
        pool.write(rows[0], 6, t(1, 2, 3))
    pool.write_at(t(rows[1], rows[0], rows[1]), t(0, 7, 1), t(9, 8, 4))  # several rows in one scatter
    assert pool.req_to_token[rows[1], :2].tolist() == [9, 4] and pool.req_to_token[rows[0], 7] == 8
    with pytest.raises(ValueError, match="position 8 exceeds max_context_len 8"):
        pool.write_at(t(rows[0]), t(8), t(1))
    pool.free(rows[0])
    with pytest.raises(RuntimeError, match="double free"):
        pool.free(rows[0])
    assert pool.available_size() == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_pool_write_read_by_slot(dtype):
    kv = MHATokenToKVPool(size=32, page_size=4, dtype=dtype, head_num=2, head_dim=8, layer_num=3)
    assert kv.get_key_buffer(0).shape == (36, 2, 8)
    loc = t(4, 9, 30)
    k, v = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    kv.set_kv_buffer(1, loc, k, v)
    assert torch.equal(kv.get_key_buffer(1)[loc], k.to(dtype))
    assert torch.equal(kv.get_value_buffer(1)[loc], v.to(dtype))
    assert kv.get_key_buffer(0).abs().sum() == 0, "other layers untouched"
