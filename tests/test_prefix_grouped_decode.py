"""Prefix-grouped decode attention (docs/prefix_grouped_decode.md): the
cascade against plain decode attention on random groupings, the groups
against a brute-force computation over random radix trees, and the Engine
with the grouping on and off giving the same greedy tokens."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, precondition, rule
from mem_harness import Harness, RequestRules
from triton_interpreter import run_interpreted

import radixserve
from radixserve.layers import cpu_kernels
from radixserve.layers.attention import create_attention_backend
from radixserve.layers.attention.cascade_decode import attend_with_lse, merge_states
from radixserve.layers.radix_attention import RadixAttention
from radixserve.managers import prefix_groups
from radixserve.managers.prefix_groups import PrefixGrouper, build_table, find_groups
from radixserve.managers.schedule_batch import ScheduleBatch
from radixserve.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from radixserve.model_executor.forward_batch_info import ForwardBatch, ForwardMode, PrefixGroupTable
from radixserve.server_args import ServerArgs

HEAD_DIM = 16
KV_HEADS = 2
LAYER_ID = 1


# -- the cascade against plain attention ---------------------------------------------------------

def random_batch(rng: random.Random, page_size: int, kv_dtype=torch.float32):
    """A pool with random K/V and a decode batch whose requests form random
    groups (members share their first pages' slots) and ragged suffixes."""
    groups, bs = [], 0
    for _ in range(rng.randint(0, 3)):
        size = rng.randint(2, 6)  # up to more members than the C kernel takes at once
        groups.append((rng.randint(1, 6) * page_size, list(range(bs, bs + size))))
        bs += size
    loners = rng.randint(0 if groups else 1, 3)
    bs += loners
    order = list(range(bs))
    rng.shuffle(order)  # members are not adjacent in the batch
    groups = [(shared, sorted(order[i] for i in members)) for shared, members in groups]
    shared_of = {i: (g, shared) for g, (shared, members) in enumerate(groups) for i in members}
    suffix = [rng.randint(1, 3 * page_size + 2) for _ in range(bs)]
    seq_lens = [shared_of.get(i, (None, 0))[1] + suffix[i] for i in range(bs)]
    num_slots = (sum(s for s, _ in groups) + sum(suffix) + bs * page_size + 1) * 2
    kv = MHATokenToKVPool(num_slots, page_size, kv_dtype, KV_HEADS, HEAD_DIM, 2)
    gen = torch.Generator().manual_seed(rng.randint(0, 2**31))
    for layer in range(2):
        kv.set_kv_buffer(layer, torch.arange(1, num_slots), torch.randn(num_slots - 1, KV_HEADS, HEAD_DIM, generator=gen),
                         torch.randn(num_slots - 1, KV_HEADS, HEAD_DIM, generator=gen))
    req_to_token = ReqToTokenPool(bs + 2, max(seq_lens) + 1)
    rows = req_to_token.alloc(bs)[::-1]
    free = iter(torch.randperm(num_slots - 1, generator=gen).add(1).tolist())  # slots scattered, page-free on purpose
    prefix_slots = [torch.tensor([next(free) for _ in range(shared)]) for shared, _ in groups]
    for i, row in enumerate(rows):
        g, shared = shared_of.get(i, (None, 0))
        own = torch.tensor([next(free) for _ in range(suffix[i])])
        req_to_token.write(row, 0, own if g is None else torch.cat([prefix_slots[g], own]))
    table = build_table_by_hand(groups, rows, bs)
    return kv, req_to_token, rows, seq_lens, table


def build_table_by_hand(groups, rows, bs):
    """The table ``build_table`` would give for ``groups`` (shared length, batch rows)."""
    if not groups:
        return None
    sizes = [len(m) for _, m in groups]
    starts = [0] + list(itertools.accumulate(sizes))
    suffix_starts = [0] * bs
    for shared, members in groups:
        for i in members:
            suffix_starts[i] = shared
    t = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
    return prefix_groups.PrefixGroupTable(
        prefix_rows=t([rows[m[0]] for _, m in groups]), prefix_lens=t([s for s, _ in groups]),
        member_starts=t(starts), members=t([i for _, m in groups for i in m]), suffix_starts=t(suffix_starts),
        prefix_lens_cpu=[s for s, _ in groups], members_cpu=[m for _, m in groups],
    )


def decode(kv, req_to_token, rows, seq_lens, table, q, k, v, group, cpu_kernel=False, save_kv_cache=True):
    layer = RadixAttention(KV_HEADS * group, HEAD_DIM, HEAD_DIM**-0.5, KV_HEADS, LAYER_ID)
    backend = create_attention_backend("torch_native", None)
    backend.cpu_decode_kernel = cpu_kernel
    out_loc = req_to_token.req_to_token[torch.tensor(rows), torch.tensor(seq_lens) - 1].to(torch.int64)
    fb = ForwardBatch(
        forward_mode=ForwardMode.DECODE, batch_size=len(rows), input_ids=torch.zeros(len(rows), dtype=torch.int64),
        positions=torch.tensor(seq_lens) - 1, req_pool_indices=torch.tensor(rows), seq_lens=torch.tensor(seq_lens),
        out_cache_loc=out_loc, seq_lens_cpu=list(seq_lens), req_to_token_pool=req_to_token, token_to_kv_pool=kv,
        attn_backend=backend, prefix_groups=table,
    )
    backend.init_forward_metadata(fb)
    return layer(q, k, v, fb, save_kv_cache=save_kv_cache)


def dense(kv, req_to_token, rows, seq_lens, q, k, v, group):
    """Decode attention of each request over its whole context, in float64."""
    k_buf, v_buf = (b.double() for b in kv.get_kv_buffer(LAYER_ID))
    out = []
    for i, (row, n) in enumerate(zip(rows, seq_lens)):
        slots = req_to_token.req_to_token[row, :n].to(torch.int64)
        keys, values = k_buf[slots].clone(), v_buf[slots].clone()
        keys[-1], values[-1] = k[i].view(KV_HEADS, HEAD_DIM).double(), v[i].view(KV_HEADS, HEAD_DIM).double()
        keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
        qi = q[i].view(KV_HEADS * group, HEAD_DIM).double()
        probs = (torch.einsum("hd,khd->hk", qi, keys) * HEAD_DIM**-0.5).softmax(-1)
        out.append(torch.einsum("hk,khd->hd", probs, values).flatten())
    return torch.stack(out).float()


KERNELS = [False, pytest.param(True, marks=pytest.mark.skipif(
    not cpu_kernels.decode_attention_available(), reason="no C compiler for the CPU kernels"))]


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("cpu_kernel", KERNELS)
def test_grouped_decode_matches_plain_decode(page_size, group, seed, cpu_kernel):
    """The torch path and the C kernel (groups of more members than the
    kernel takes at once included), each against plain decode and float64."""
    rng = random.Random(seed * 100 + page_size * 10 + group)
    kv, req_to_token, rows, seq_lens, table = random_batch(rng, page_size)
    gen = torch.Generator().manual_seed(seed)
    bs = len(rows)
    q = torch.randn(bs, KV_HEADS * group * HEAD_DIM, generator=gen)
    k, v = (torch.randn(bs, KV_HEADS * HEAD_DIM, generator=gen) for _ in range(2))
    grouped = decode(kv, req_to_token, rows, seq_lens, table, q, k, v, group, cpu_kernel=cpu_kernel)
    plain = decode(kv, req_to_token, rows, seq_lens, None, q, k, v, group)
    torch.testing.assert_close(grouped, plain, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(grouped, dense(kv, req_to_token, rows, seq_lens, q, k, v, group), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float8_e4m3fn])
@pytest.mark.parametrize("cpu_kernel", KERNELS)
def test_grouped_decode_without_saving_kv_and_fp8(kv_dtype, cpu_kernel):
    rng = random.Random(7)
    kv, req_to_token, rows, seq_lens, table = random_batch(rng, 2, kv_dtype)
    while table is None or table.num_groups == 0:
        kv, req_to_token, rows, seq_lens, table = random_batch(rng, 2, kv_dtype)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(len(rows), KV_HEADS * 2 * HEAD_DIM, generator=gen)
    k, v = (torch.randn(len(rows), KV_HEADS * HEAD_DIM, generator=gen) for _ in range(2))
    for save in (False, True):  # the same result whether the new token is in the pool or put in place
        grouped = decode(kv, req_to_token, rows, seq_lens, table, q, k, v, 2, cpu_kernel, save_kv_cache=save)
        plain = decode(kv, req_to_token, rows, seq_lens, None, q, k, v, 2, save_kv_cache=save)
        torch.testing.assert_close(grouped, plain, atol=2e-6, rtol=1e-5)


def test_merge_of_two_key_sets_is_attention_over_both():
    gen = torch.Generator().manual_seed(0)
    q, keys, values = torch.randn(3, 5, 8, generator=gen), torch.randn(3, 20, 8, generator=gen) * 4, torch.randn(3, 20, 8, generator=gen)
    whole, _ = attend_with_lse(q, keys, values, 0.3)
    a, lse_a = attend_with_lse(q, keys[:, :7], values[:, :7], 0.3)
    b, lse_b = attend_with_lse(q, keys[:, 7:], values[:, 7:], 0.3)
    torch.testing.assert_close(merge_states(a, lse_a, b, lse_b), whole, atol=1e-6, rtol=1e-6)


# -- the groups against a brute-force computation over random radix trees ------------------------

def brute_force_groups(prefixes: list[list[int] | None], page: int) -> list[tuple[int, list[int]]]:
    """Repeatedly: the longest common cached prefix (in whole pages) of two
    ungrouped requests, and every ungrouped request that has it."""
    def common(a, b):
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        return n // page * page

    left, groups = [i for i, p in enumerate(prefixes) if p], []
    while True:
        pairs = [(common(prefixes[a], prefixes[b]), a) for a, b in itertools.combinations(left, 2)]
        best, a = max(pairs, default=(0, None))
        if best < page:
            return sorted(groups)
        members = [i for i in left if prefixes[i][:best] == prefixes[a][:best]]
        groups.append((best, members))
        left = [i for i in left if i not in members]


class GroupingRules(RequestRules):
    """The request life cycle of the cache tests, with requests' prompts
    cached while they run (``cache_unfinished_req``, as after a prefill), and
    after every step the groups of the live requests checked."""

    @initialize(page_size=st.sampled_from([1, 2, 4]))
    def setup(self, page_size):
        self.h = Harness(pool_size=512, page_size=page_size, max_reqs=8)
        self.grouper = PrefixGrouper(page_size, min_members=2)

    @precondition(lambda self: self.h.live)
    @rule(data=st.data())
    def cache_running(self, data):
        self.h.cache.cache_unfinished_req(data.draw(st.sampled_from(self.h.live)))

    @invariant()
    def groups_are_the_deepest_shared_prefixes(self):
        live, page = self.h.live, self.h.page_size
        prefixes = [(r.origin_input_ids + r.output_ids)[: r.cache_protected_len] for r in live]
        assert sorted(find_groups([r.last_node for r in live], page)) == brute_force_groups(prefixes, page)
        table = self.grouper.table(live)
        if table is None:
            return
        req_to_token = self.h.req_pool.req_to_token
        for g, members in enumerate(table.members_cpu):
            shared = table.prefix_lens_cpu[g]
            slots = req_to_token[table.prefix_rows[g], :shared]
            for i in members:
                assert torch.equal(req_to_token[live[i].req_pool_idx, :shared], slots)
                assert int(table.suffix_starts[i]) == shared


TestGrouping = GroupingRules.TestCase
TestGrouping.settings = settings(max_examples=60, stateful_step_count=30, deadline=None,
                                 suppress_health_check=[HealthCheck.too_slow])


def test_grouper_rebuilds_only_when_the_running_set_changes():
    h = Harness(pool_size=256, page_size=2, max_reqs=8)
    shared = [5, 6, 7, 8]
    reqs = [h.start(shared + [i, i]) for i in range(3)]
    for r in reqs:
        h.cache.cache_unfinished_req(r)
    grouper = PrefixGrouper(2, min_members=2)
    table = grouper.table(reqs)
    assert table.prefix_lens_cpu == [4] and table.members_cpu == [[0, 1, 2]]
    assert grouper.table(reqs) is table and grouper.rebuilds == 1  # a step that changes nothing
    h.finish(reqs[1])
    assert grouper.table([reqs[0], reqs[2]]).members_cpu == [[0, 1]] and grouper.rebuilds == 2
    assert grouper.table([reqs[0]]) is None  # alone: attended as without grouping


def test_groups_smaller_than_the_least_go_up_to_the_parent():
    """A pair under a deep node joins its parent's group when groups need
    three members; a group too small at the root is no group."""
    h = Harness(pool_size=256, page_size=2, max_reqs=8)
    system = [5, 6, 7, 8]
    reqs = [h.start(system + tail) for tail in ([1, 2, 3, 4], [1, 2, 3, 9], [20, 21], [30, 31])]
    for r in reqs:
        h.cache.cache_unfinished_req(r)
    nodes = [r.last_node for r in reqs]
    assert find_groups(nodes, 2) == [(6, [0, 1]), (4, [2, 3])]
    assert find_groups(nodes, 2, min_members=3) == [(4, [0, 1, 2, 3])]
    assert find_groups(nodes[:2], 2, min_members=3) == []
    assert PrefixGrouper(2).min_members == prefix_groups.MIN_GROUP_MEMBERS


# -- the flag and the Engine -------------------------------------------------------------------

def test_flag_is_off_by_default_and_taken_by_both_backends():
    assert not ServerArgs(model_path="x").enable_prefix_grouped_decode
    for backend in ("torch_native", "triton"):
        assert ServerArgs(model_path="x", device="cpu", attention_backend=backend,
                          enable_prefix_grouped_decode=True).enable_prefix_grouped_decode


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         initializer_range=0.1, architectures=["LlamaForCausalLM"])
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    folder = tmp_path_factory.mktemp("llama_grouped")
    hf.save_pretrained(folder)
    return str(folder), hf


@torch.no_grad()
def hf_greedy(hf, ids, n):
    out = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, min_new_tokens=n)
    return out[0, len(ids):].tolist()


def shared_prompts(seed=0, families=3, per_family=4, prefix_len=37):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(families):
        prefix = torch.randint(0, 320, (prefix_len,), generator=gen).tolist()
        out += [prefix + torch.randint(0, 320, (int(n),), generator=gen).tolist()
                for n in torch.randint(1, 12, (per_family,), generator=gen)]
    out += [torch.randint(0, 320, (20,), generator=gen).tolist()]  # one in no group
    return out


def run_engine(folder, batch, grouped, overlap=False, params=None, **kw):
    kw.setdefault("max_total_tokens", 4096)
    kw.setdefault("max_running_requests", 16)
    params = params or {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}
    with radixserve.Engine(model_path=folder, check_invariants=True, disable_tqdm=True, device="cpu",
                           enable_prefix_grouped_decode=grouped, **kw) as eng:
        eng.scheduler.overlap = overlap
        outs = [o["output_ids"] for o in eng.generate(input_ids=batch, sampling_params=params)]
        eng.scheduler.check_memory()
        return outs, eng.scheduler.stats


@pytest.fixture
def tables(monkeypatch):
    """Every table the grouper builds (None included)."""
    built = []

    def recording(reqs, min_shared_len, min_members):
        table = build_table(reqs, min_shared_len, min_members)
        built.append(table)
        return table

    monkeypatch.setattr(prefix_groups, "build_table", recording)
    return built


@pytest.mark.parametrize("page_size,overlap,kw", [
    (1, False, {}),
    (4, False, {}),
    (4, True, {}),
    (1, False, {"chunked_prefill_size": 16}),
    (4, False, {"enable_mixed_chunk": True, "chunked_prefill_size": 24}),
])
def test_engine_tokens_identical_with_grouping_on_and_off(llama, tables, page_size, overlap, kw):
    folder, hf = llama
    batch = shared_prompts()
    off, _ = run_engine(folder, batch, False, overlap, page_size=page_size, **kw)
    assert not tables
    on, _ = run_engine(folder, batch, True, overlap, page_size=page_size, **kw)
    assert on == off == [hf_greedy(hf, ids, 16) for ids in batch]
    grouped = [t for t in tables if t is not None]
    assert grouped and max(t.num_groups for t in grouped) >= 2, "the shared prompts decoded in groups"
    assert all(s >= page_size for t in grouped for s in t.prefix_lens_cpu)


def test_engine_radix_hits_across_calls(llama, tables):
    first, second = shared_prompts(seed=1), shared_prompts(seed=1, per_family=3)
    outs = {}
    for grouped in (False, True):
        with radixserve.Engine(model_path=llama[0], check_invariants=True, disable_tqdm=True, device="cpu",
                               max_total_tokens=4096, enable_prefix_grouped_decode=grouped) as eng:
            params = {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True}
            a = [o["output_ids"] for o in eng.generate(input_ids=first, sampling_params=params)]
            b = eng.generate(input_ids=second, sampling_params=params)
            assert sum(o["meta_info"]["cached_tokens"] for o in b) > 0
            outs[grouped] = a, [o["output_ids"] for o in b]
    assert outs[True] == outs[False]
    assert any(t is not None for t in tables)


@pytest.mark.parametrize("overlap", [False, True])
def test_engine_retraction_leaves_groups_and_keeps_tokens(llama, tables, overlap, monkeypatch):
    batch = shared_prompts(seed=2, families=2, per_family=4, prefix_len=24)
    params = {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}
    kw = dict(max_total_tokens=320, max_running_requests=8, page_size=4)
    off, _ = run_engine(llama[0], batch, False, overlap, params, **kw)
    retract = ScheduleBatch.retract_decode

    def marked(self, **kwargs):
        retracted, cut = retract(self, **kwargs)
        tables.extend(["retracted"] * bool(retracted))
        return retracted, cut

    monkeypatch.setattr(ScheduleBatch, "retract_decode", marked)
    monkeypatch.setattr(prefix_groups, "MIN_GROUP_MEMBERS", 2)  # groups of four shrink below four at once
    on, stats = run_engine(llama[0], batch, True, overlap, params, **kw)
    assert stats.retractions > 0
    assert on == off
    grouped = lambda t: sum(map(len, t.members_cpu)) if t is not None else 0  # noqa: E731
    after = [(grouped(tables[i - 1]), grouped(tables[i + 1])) for i, t in enumerate(tables)
             if t == "retracted" and 0 < i < len(tables) - 1 and tables[i - 1] != "retracted"]
    assert any(new < old for old, new in after), "a retracted request left its group"


# -- the Triton kernel (Triton's interpreter on the CPU; tests/test_gpu_prefix_grouped_decode.py on a GPU) ----

_TRITON_SCRIPT = """
import itertools, json, os, random, sys
import torch
tests_dir, folder, batch, params = json.loads(sys.argv[1])
sys.path.insert(0, tests_dir)
import test_prefix_grouped_decode as t
import radixserve
from radixserve.layers.attention.triton_ops import decode_attention as ops

result = {"kernel": [], "plain": []}
# Small chunks and tiles, so that prefixes split and groups span several tiles.
ops.MIN_PREFIX_SPLIT, ops.TILE_QUERY_ROWS = 4, 4
# MAX_KV_SPLITS 1: one split a request, where the split kernel merges the prefix itself.
for seed, max_splits in itertools.product(range(2), (ops.MAX_KV_SPLITS, 1)):
    ops.MAX_KV_SPLITS = max_splits
    for page, group in ((1, 1), (4, 3), (2, 2)):
        rng = random.Random(seed * 100 + page * 10 + group)
        kv, r2t, rows, seq_lens, table = t.random_batch(rng, page)
        gen = torch.Generator().manual_seed(seed)
        bs = len(rows)
        q = torch.randn(bs, t.KV_HEADS * group * t.HEAD_DIM, generator=gen)
        k, v = (torch.randn(bs, t.KV_HEADS * t.HEAD_DIM, generator=gen) for _ in range(2))
        want = t.dense(kv, r2t, rows, seq_lens, q, k, v, group)
        for static in (False, True):
            got = t.triton_decode(kv, r2t, rows, seq_lens, table, q, k, v, group, static)
            result["kernel"].append([(got - want).abs().max().item(), 0 if table is None else table.num_groups])
        # no table: plain decode, merged by the merge kernel or (one split) written by the split kernel
        got = t.triton_decode(kv, r2t, rows, seq_lens, None, q, k, v, group)
        result["plain"].append((got - want).abs().max().item())
ops.MIN_PREFIX_SPLIT, ops.TILE_QUERY_ROWS = 8, 64
from radixserve.managers import prefix_groups
built, build = [], prefix_groups.build_table
def recording(reqs, min_shared_len, min_members):
    table = build(reqs, min_shared_len, min_members)
    built.append(0 if table is None else table.num_groups)
    return table
prefix_groups.build_table = recording
for grouped in (False, True):
    with radixserve.Engine(model_path=folder, device="cpu", attention_backend="triton", max_total_tokens=4096,
                           max_running_requests=16, page_size=4, check_invariants=True, disable_tqdm=True,
                           enable_prefix_grouped_decode=grouped) as eng:
        outs = eng.generate(input_ids=batch, sampling_params=params)
        result[str(grouped)] = [o["output_ids"] for o in outs]
result["groups"] = max(built)
print(json.dumps(result))
"""


def triton_decode(kv, req_to_token, rows, seq_lens, table, q, k, v, group, static=False):
    """``decode`` through the Triton backend; ``static``: the table as a CUDA
    graph takes it (``PrefixGroupTable.static``, spare groups and rows included)."""
    layer = RadixAttention(KV_HEADS * group, HEAD_DIM, HEAD_DIM**-0.5, KV_HEADS, LAYER_ID)
    backend = create_attention_backend("triton", None)
    backend.group, backend.num_kv_heads = group, KV_HEADS
    bs = len(rows)
    if static:
        padded = PrefixGroupTable.static(bs + 5, 0, torch.device("cpu"))
        padded.fill(table, bs, bs + 2)
        table = padded.rows(bs)
    out_loc = req_to_token.req_to_token[torch.tensor(rows), torch.tensor(seq_lens) - 1].to(torch.int64)
    fb = ForwardBatch(
        forward_mode=ForwardMode.DECODE, batch_size=bs, input_ids=torch.zeros(bs, dtype=torch.int64),
        positions=torch.tensor(seq_lens) - 1, req_pool_indices=torch.tensor(rows), seq_lens=torch.tensor(seq_lens),
        out_cache_loc=out_loc, seq_lens_cpu=list(seq_lens), req_to_token_pool=req_to_token, token_to_kv_pool=kv,
        attn_backend=backend, prefix_groups=table,
    )
    backend.init_forward_metadata(fb)
    return layer(q, k, v, fb)


def test_triton_grouped_decode_in_the_interpreter(llama):
    """The Triton kernels (prefix tiles, suffixes, merge, or the merge in the
    suffix kernel) against float64 attention on random groupings, and plain
    decode (merged, or written by its one split), with the table passed as is and as a
    CUDA graph's static input; and the Engine on the triton backend with the
    grouping on and off: the same tokens as HF."""
    import os

    folder, hf = llama
    batch = shared_prompts(seed=3, families=2, per_family=4, prefix_len=30)
    params = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
    result = run_interpreted(_TRITON_SCRIPT, [os.path.dirname(__file__), folder, batch, params])
    assert len(result["kernel"]) == 24 and sum(groups > 0 for _, groups in result["kernel"]) >= 12
    assert max(err for err, _ in result["kernel"]) < 1e-5
    assert len(result["plain"]) == 12 and max(result["plain"]) < 1e-5
    assert result["groups"] == 2, "both families decoded as groups"
    assert result["True"] == result["False"] == [hf_greedy(hf, ids, 6) for ids in batch]
