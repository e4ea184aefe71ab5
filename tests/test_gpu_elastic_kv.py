"""The elastic KV pool on a CUDA device (GPU only): pages mapped through the
driver's virtual memory API (cuda-python) read and write like any tensor,
come back zeroed, and give their memory back to the device; the Engine with
CUDA graphs, piecewise graphs and overlap scheduling gives the same greedy
tokens over an elastic pool as over a static one; maps the device refuses
(another tenant took the memory) queue requests instead of failing them."""

from __future__ import annotations

import pytest
import torch

import radixserve

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

MB = 1 << 20


def test_cuda_pages_map_read_write_and_return_their_memory():
    from radixserve.mem_cache.virtual_memory import CudaArena

    def device_free() -> int:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # what torch's own allocator keeps does not count
        return torch.cuda.mem_get_info()[0]

    arena = CudaArena([2 * MB, 4 * MB], 256, torch.device("cuda"), zero_pages=True)  # 1.5 GB of addresses, nothing mapped
    try:
        free_before = device_free()
        for page in range(64):
            assert arena.map(page)
        k, v = arena.tensors
        k[: 64 * 2 * MB].fill_(7)
        v[: 64 * 4 * MB].fill_(9)
        assert bool((k[: 64 * 2 * MB] == 7).all()) and bool((v[: 64 * 4 * MB] == 9).all())
        free_mapped = device_free()
        assert free_before - free_mapped >= 384 * MB
        for page in range(64):
            arena.unmap(page)
        assert device_free() - free_mapped >= 384 * MB  # all of it went back to the device
        assert arena.map(3)
        assert int(v[3 * 4 * MB: 4 * 4 * MB].count_nonzero()) == 0  # a page comes back zeroed
        assert arena.stats.maps == 65 and arena.stats.unmaps == 64
    finally:
        arena.close()


def _device_free() -> int:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # what torch's own allocator keeps does not count
    return torch.cuda.mem_get_info()[0]


@pytest.mark.parametrize("spans", ["probed", "off", "forced"])
def test_cuda_runs_of_pages_map_zeroed_and_unmap_at_once(spans):
    """``map_many`` / ``unmap_many`` over runs of adjacent pages (and a gap):
    the memory is taken and given back whole, pages come back zeroed, the
    stats count pages; with the driver's range calls as probed, off, or
    forced on (a range call the driver refuses falls back to one a page)."""
    from radixserve.mem_cache.virtual_memory import CudaArena

    arena = CudaArena([2 * MB, 4 * MB], 64, torch.device("cuda"), zero_pages=True)
    try:
        assert isinstance(arena.span_access, bool) and isinstance(arena.span_unmap, bool)
        if spans != "probed":
            arena.span_access = arena.span_unmap = spans == "forced"
        free_before = _device_free()
        pages = [*range(0, 24), *range(30, 38)]
        assert arena.map_many(pages) == 32 and arena.stats.maps == 32
        assert free_before - _device_free() >= 32 * 6 * MB
        k, v = arena.tensors
        for p in pages:
            assert int(k[p * 2 * MB: (p + 1) * 2 * MB].count_nonzero()) == 0
        k[: 24 * 2 * MB].fill_(3)
        v[30 * 4 * MB: 38 * 4 * MB].fill_(4)
        arena.unmap_many(range(0, 24))  # the fill may still run: unmap_many waits for the device
        assert arena.stats.unmaps == 24 and arena.stats.mapped == set(range(30, 38))
        assert int((v[30 * 4 * MB: 38 * 4 * MB] == 4).sum()) == 8 * 4 * MB
        arena.unmap_many(range(64))
        assert _device_free() - free_before >= -4 * MB  # all of it went back
        assert arena.map_many(range(0, 8)) == 8
        assert int(k[: 8 * 2 * MB].count_nonzero()) == 0  # mapped again, zeroed again
    finally:
        arena.close()


def test_a_cuda_run_refused_half_way_leaves_nothing_mapped_or_held():
    """The driver runs out of memory in the middle of a run (the second
    buffer's third page): every mapping made is undone, every allocation
    freed (the device's free memory is as before), and the pages map later."""
    from radixserve.mem_cache.virtual_memory import CudaArena

    class RunsOut:
        def __init__(self, driver, creates: int):
            self._driver, self.creates = driver, creates

        def __getattr__(self, name):
            return getattr(self._driver, name)

        def cuMemCreate(self, *args):
            self.creates -= 1
            if self.creates < 0:
                return self._driver.CUresult.CUDA_ERROR_OUT_OF_MEMORY, None
            return self._driver.cuMemCreate(*args)

    arena = CudaArena([2 * MB] * 4, 16, torch.device("cuda"))
    try:
        driver = arena._driver
        free_before = _device_free()
        arena._driver = RunsOut(driver, 6)
        assert arena.map_many([0, 1, 2, 3]) == 0
        assert arena.stats.mapped == set() and arena.stats.failed_maps == 4
        assert abs(_device_free() - free_before) < 4 * MB  # 12 MB had been mapped half way
        arena._driver = driver
        assert arena.map_many([0, 1, 2, 3]) == 4  # nothing left mapped in the way
    finally:
        arena.close()


def test_the_mapper_thread_maps_zeroed_pages_and_gives_them_back():
    """Pages mapped ahead on the mapper's thread (its own stream) are zeroed
    before they count as mapped, work in kernels on the default stream, and
    are unmapped by the thread after the device is done with them."""
    from radixserve.mem_cache.page_mapper import PageMapper
    from radixserve.mem_cache.virtual_memory import CudaArena

    arena = CudaArena([2 * MB, 2 * MB], 64, torch.device("cuda"), zero_pages=True)
    mapper = PageMapper(arena, background=True)
    try:
        assert mapper.map_now(0)
        k, _ = arena.tensors
        k[: 2 * MB].fill_(5)
        mapper.map_ahead(list(range(1, 33)))
        mapper.drain()
        assert mapper.now_maps == 1 and all(arena.is_mapped(p) for p in range(33))
        assert int(k[2 * MB: 33 * 2 * MB].count_nonzero()) == 0  # zeroed on the thread's stream, waited for
        k[: 33 * 2 * MB].add_(1)
        mapper.unmap(list(range(1, 33)))  # while the add may still run
        mapper.drain()
        assert int((k[: 2 * MB] == 6).sum()) == 2 * MB and len(arena.stats.mapped) == 1
    finally:
        mapper.close()
        arena.close()


def test_a_cuda_arena_leaves_the_device_the_margin_it_keeps():
    """``keep_free`` (a static pool's ``1 - mem_fraction_static``): maps stop
    when the device would have less free, not when it has none."""
    from radixserve.mem_cache.virtual_memory import CudaArena

    torch.cuda.synchronize()
    free = torch.cuda.mem_get_info()[0]
    arena = CudaArena([2 * MB, 2 * MB], 64, torch.device("cuda"), keep_free=free - 10 * 4 * MB)  # room for ~10 pages
    try:
        mapped = sum(arena.map(page) for page in range(64))
        assert 6 <= mapped <= 10 and arena.stats.failed_maps == 64 - mapped
        assert arena.physical_free() < arena.bytes_per_page
    finally:
        arena.close()


def test_the_leads_of_all_buffers_share_one_granule():
    """The dummy page's lead: one 2 MB allocation mapped before page 0 of
    every buffer (what one buffer's lead holds, all of them read), apart
    from the pages; unmapped, the device gets the 2 MB back."""
    from radixserve.mem_cache.virtual_memory import CudaArena

    arena = CudaArena([2 * MB] * 8, 4, torch.device("cuda"), lead_bytes=4096)
    try:
        torch.cuda.synchronize()
        free = torch.cuda.mem_get_info()[0]
        assert arena.map_lead() and arena.lead_physical_bytes() == 2 * MB and arena.mapped_bytes() == 2 * MB
        assert free - torch.cuda.mem_get_info()[0] <= 2 * MB  # not 16 MB: one granule for the 8 leads
        arena.tensors[0][:4096] = 7
        assert all(int(t[:4096].sum()) == 7 * 4096 for t in arena.tensors)  # aliases of the same memory
        assert arena.map(0)
        arena.tensors[3][4096: 4096 + 2 * MB] = 1  # page 0 of buffer 3, right after its lead
        assert int(arena.tensors[3][4095]) == 7 and int(arena.tensors[0][4095]) == 7  # the leads untouched
        arena.unmap_lead()
        torch.cuda.synchronize()
        assert not arena.lead_mapped and arena.mapped_bytes() == arena.bytes_per_page
        assert int(arena.tensors[3][4096]) == 1  # the pages keep their contents
    finally:
        arena.close()


DUMMY = dict(model_path="tiny-llama", load_format="dummy", dtype="bfloat16", disable_tqdm=True, check_invariants=True,
             max_total_tokens=1 << 16, max_running_requests=16,
             # 2 KB of KV a token and layer: 1,024 tokens in each 2 MB elastic page
             json_model_override_args='{"num_attention_heads": 8, "num_key_value_heads": 8, "head_dim": 128}')
PROMPTS = [[(13 * i + j) % 500 + 3 for j in range(n)] for i, n in enumerate((5, 300, 1, 77, 1000, 33, 700, 9))]


def _greedy(**options) -> tuple[list[list[int]], dict]:
    params = [{"temperature": 0, "max_new_tokens": n, "ignore_eos": True} for n in (24, 3, 17, 40, 32, 9, 24, 12)]
    with radixserve.Engine(**DUMMY, **options) as eng:
        out = [o["output_ids"] for o in eng.generate(input_ids=PROMPTS, sampling_params=params)]
        again = [o["output_ids"] for o in eng.generate(input_ids=PROMPTS, sampling_params=params)]  # radix hits
        assert again == out
        assert eng.flush_cache()
        return out, eng.get_stats()


def test_greedy_tokens_are_the_same_over_an_elastic_pool():
    static, _ = _greedy()
    elastic, stats = _greedy(enable_elastic_kv=True, elastic_kv_page_mb=2)  # pages of 1,024 tokens: several maps
    assert elastic == static
    assert stats["elastic_kv_maps"] >= 3 and stats["elastic_kv_unmaps"] >= 1
    # flushed: the reserve, and the dummy page's lead: one 2 MB granule behind all 8 buffers
    assert stats["elastic_kv_used_bytes"] == stats["elastic_kv_lead_bytes"] == 2 * MB
    assert stats["elastic_kv_reserve_pages"] <= 2


def test_refused_maps_queue_requests_on_the_gpu(monkeypatch):
    """Every other map refused, as when another process holds the memory: the
    same tokens, later, and no error in a kernel."""
    from radixserve.mem_cache.virtual_memory import CudaArena

    static, _ = _greedy()
    original, calls = CudaArena._map_run, {"n": 0}

    def flaky(self, first, count):
        calls["n"] += 1
        return calls["n"] % 2 == 1 and original(self, first, count)  # the first maps

    monkeypatch.setattr(CudaArena, "_map_run", flaky)
    elastic, stats = _greedy(enable_elastic_kv=True, elastic_kv_page_mb=2)
    assert elastic == static and stats["elastic_kv_failed_maps"] > 0


def test_two_pools_on_one_gpu_give_each_other_memory(monkeypatch):
    """Two servers' pools on one GPU in one group (the registry named by the
    GPU's UUID), with a budget of 16 pages together: one fills 12 pages with
    cached KV; the other, refused by the budget, asks; the first unmaps what
    was asked (the device gets it back) and the second maps it."""
    import os

    from radixserve.mem_cache.elastic_allocator import build_elastic_pool
    from radixserve.feature_args import ElasticKVConfig

    monkeypatch.setattr("radixserve.mem_cache.elastic_registry.HEARTBEAT_S", 0.0)  # look at every call
    config = ElasticKVConfig(page_mb=2, min_reserve_pages=0, max_reserve_pages=0, group=f"gpu-test-{os.getpid()}",
                             group_gb=16 * 16 / 1024)  # 16 pages of 16 MB (2 MB in each of 8 buffers)
    shape = (1 << 16, 1, torch.bfloat16, 8, 128, 4, torch.device("cuda"))
    (_, a), (_, b) = (build_elastic_pool(*shape, config=config, tenant=t) for t in (1, 2))
    try:
        assert a.arena.bytes_per_page == 16 * MB and str(torch.cuda.get_device_properties(0).uuid) in a.registry.path
        cached = [a.alloc(1024) for _ in range(13)]  # 13 pages mapped
        assert all(c is not None for c in cached) and len(a.mapped_epages()) == 13

        def evict(n: int) -> int:  # the cache's LRU order: oldest first
            freed = 0
            while cached and freed < n:
                slots = cached.pop(0)
                a.free(slots)
                freed += len(slots)
            return freed

        assert b.alloc(1024 * 4) is None and b.asks == 1  # 4 pages wanted, 3 left in the budget
        torch.cuda.synchronize()
        free_before = torch.cuda.mem_get_info()[0]
        keep = a.pages_to_keep(0, idle=False)
        assert keep is not None and a.give(keep, evict) == 13 - keep >= 1
        a.mapper.drain()  # the mapper's thread unmaps once the device is done
        torch.cuda.synchronize()
        # back to the device (less a 2 MB block or two that torch's allocator may take for the frees' own tensors)
        assert torch.cuda.mem_get_info()[0] - free_before >= (13 - keep) * 16 * MB - 4 * MB
        b.rebalance()
        assert b.alloc(1024 * 4) is not None
    finally:
        for alloc in (a, b):
            alloc.close()
            alloc.arena.close()
