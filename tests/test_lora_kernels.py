"""The segmented LoRA GEMMs (``radixserve.lora.triton_ops``) against a float32
reference, on random batches: rows of several adapters in any order, rows
without one, ranks below the slots' rank, parts with gaps between them, a
K long enough to split, and a CUDA graph's static table filled with smaller
batches. On the CPU the kernels run in Triton's interpreter, in one
subprocess; ``tests/test_gpu_lora.py`` runs the same cases on CUDA in bf16.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from triton_interpreter import run_interpreted

# (name, rows, K, parts as (offset, size), OUT, R, slots, share of rows without an adapter)
CASES = [
    ("one row", 1, 40, [(0, 24)], 24, 16, 2, 0.0),
    ("q|k|v of a decode batch", 37, 48, [(0, 32), (32, 16), (48, 16)], 64, 16, 3, 0.3),
    ("gap: q and v only", 20, 32, [(0, 32), (48, 16)], 64, 8, 2, 0.2),
    ("rank 24 slots, split K", 9, 300, [(0, 40)], 40, 24, 4, 0.0),
    ("rows past several blocks", 70, 64, [(0, 80), (80, 80)], 160, 16, 3, 0.1),
    ("prefill blocks", 600, 32, [(0, 16)], 16, 16, 3, 0.1),
    ("prefill blocks, two parts", 520, 48, [(0, 24), (24, 8)], 32, 16, 2, 0.2),  # kernel_config's prefill choice
    ("no adapter in the batch", 5, 32, [(0, 16)], 16, 16, 2, 1.0),
]

# The MLP's gate|up through expand_silu_and_mul: OUT = 2 * D columns [gate | up]; the adapters may
# target both halves or one (the layer's parts are then that half only).
ACT_CASES = [
    ("gate|up of a decode batch", 37, 48, [(0, 40), (40, 40)], 80, 16, 3, 0.3),
    ("gate|up, rank 8 slots, split K", 6, 300, [(0, 24), (24, 24)], 48, 8, 4, 0.0),
    ("gate only", 21, 32, [(0, 32)], 64, 16, 2, 0.2),
    ("up only", 21, 32, [(32, 32)], 64, 16, 2, 0.2),
    ("gate|up prefill blocks", 600, 32, [(0, 24), (24, 24)], 48, 16, 3, 0.1),
    ("gate|up, no adapter in the batch", 5, 32, [(0, 16), (16, 16)], 32, 16, 2, 1.0),
]


def make_case(rows, k, parts, out, R, slots, none_share, *, seed, device="cpu", dtype=torch.float32):
    """(x, y, A, B, scaling, part_bounds, row_slots, ranks): slot s's adapter has rank ranks[s] <= R."""
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    ranks = [int(rng.integers(1, R + 1)) for _ in range(slots)]
    ranks[0] = R
    A = torch.zeros(slots, len(parts) * R, k)
    B = torch.zeros(slots, out, R)
    for s, r in enumerate(ranks):
        for p, (off, size) in enumerate(parts):
            A[s, p * R : p * R + r] = torch.randn(r, k, generator=gen) / k**0.5
            B[s, off : off + size, :r] = torch.randn(size, r, generator=gen)
    row_slots = rng.integers(0, slots, rows)
    row_slots[rng.random(rows) < none_share] = -1
    x = torch.randn(rows, k, generator=gen)
    y = torch.randn(rows, out, generator=gen)
    scaling = torch.rand(slots, generator=gen) + 0.5
    bounds = torch.tensor([[off, off + size] for off, size in parts], dtype=torch.int32)
    move = lambda t: t.to(device, dtype)  # noqa: E731
    return (move(x), move(y), move(A), move(B), scaling.to(device), bounds.to(device), row_slots, ranks)


def silu_and_mul(y):
    gate, up = y.float().chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def reference(x, y, A, B, scaling, parts, row_slots, ranks, R):
    """``y + scaling * (x A_p^T) B_p^T`` per row and part, in float32, reading only each adapter's rank."""
    x, y, A, B = (t.float().cpu() for t in (x, y, A, B))
    out = y.clone()
    for i, s in enumerate(row_slots):
        if s < 0:
            continue
        r = ranks[s]
        for p, (off, size) in enumerate(parts):
            a, b = A[s, p * R : p * R + r], B[s, off : off + size, :r]
            out[i, off : off + size] += float(scaling[s]) * ((x[i] @ a.T) @ b.T)
    return out


SCRIPT = r"""
import json, sys
import numpy as np
import torch
sys.path.insert(0, json.loads(sys.argv[1]))
from test_lora_kernels import ACT_CASES, CASES, make_case, reference, silu_and_mul
from radixserve.lora.triton_ops import (KernelConfig, StaticKernelTable, build_table, expand_silu_and_mul, lora_delta,
                                        stacked_delta)


def stacked(x, y, A):  # what the stacked GEMM writes: y, then x @ A_s.T of every slot s ([T, OUT + S * P*R])
    return torch.cat([y, x @ A.flatten(0, 1).T], dim=1)

errors = {}
for seed, (name, rows, k, parts, out, R, slots, none_share) in enumerate(CASES):
    x, y, A, B, scaling, bounds, row_slots, ranks = make_case(rows, k, parts, out, R, slots, none_share, seed=seed)
    ref = reference(x, y, A, B, scaling, parts, row_slots, ranks, R)
    got = lora_delta(x, y.clone(), A, B, build_table(row_slots, rows), scaling, bounds, R)
    # a graph's static table, sized for more rows, filled after a larger batch
    static = StaticKernelTable(rows + 20, slots, torch.device("cpu"))
    static.fill(np.random.default_rng(seed).integers(0, slots, rows + 20), rows + 20)
    static.fill(row_slots, rows + 3)
    big = torch.cat([y, torch.zeros(3, out)])
    graph = lora_delta(torch.cat([x, torch.zeros(3, k)]), big, A, B, static.view(rows + 3), scaling, bounds, R)
    # small column tiles, several per expand program (a partial group at the end), K split in two,
    # a shrink program over 32 rank columns (several parts', masked past P*R)
    tiled = lora_delta(x, y.clone(), A, B, build_table(row_slots, rows), scaling, bounds, R,
                       KernelConfig(split_k=2, shrink_block_k=16, expand_block_n=16, expand_tiles=3,
                                    shrink_block_n=32))
    # the stacked GEMM's rank columns, no shrink: in place on a view of its output, and into a new tensor
    ext = stacked(x, y, A)
    in_place = stacked_delta(ext, out, B, build_table(row_slots, rows), scaling, bounds, R, A.shape[1], False)
    fresh = stacked_delta(stacked(x, y, A), out, B, build_table(row_slots, rows), scaling, bounds, R, A.shape[1], True)
    ext_graph = stacked(torch.cat([x, torch.zeros(3, k)]), torch.cat([y, torch.zeros(3, out)]), A)
    stacked_graph = stacked_delta(ext_graph, out, B, static.view(rows + 3), scaling, bounds, R, A.shape[1], True)
    scale = float(ref.abs().max())
    errors[name] = [float((got - ref).abs().max()) / scale, float((graph[:rows] - ref).abs().max()) / scale,
                    float(graph[rows:].abs().max()), float((tiled - ref).abs().max()) / scale,
                    float((in_place - ref).abs().max()) / scale, float((ext[:, out:] - stacked(x, y, A)[:, out:]).abs().max()),
                    float((fresh - ref).abs().max()) / scale, int(fresh.is_contiguous() and in_place.data_ptr() == ext.data_ptr()),
                    float((stacked_graph[:rows] - ref).abs().max()) / scale, float(stacked_graph[rows:].abs().max())]
for seed, (name, rows, k, parts, out, R, slots, none_share) in enumerate(ACT_CASES):
    x, y, A, B, scaling, bounds, row_slots, ranks = make_case(rows, k, parts, out, R, slots, none_share, seed=seed)
    ref = silu_and_mul(reference(x, y, A, B, scaling, parts, row_slots, ranks, R))
    got = expand_silu_and_mul(x, y, A, B, build_table(row_slots, rows), scaling, bounds, R)
    static = StaticKernelTable(rows + 20, slots, torch.device("cpu"))
    static.fill(np.random.default_rng(seed).integers(0, slots, rows + 20), rows + 20)
    static.fill(row_slots, rows + 3)
    pad = torch.randn(3, out, generator=torch.Generator().manual_seed(seed))
    graph = expand_silu_and_mul(torch.cat([x, torch.zeros(3, k)]), torch.cat([y, pad]), A, B, static.view(rows + 3),
                                scaling, bounds, R)
    # 16-column tiles, three a program (a partial group at the end)
    tiled = expand_silu_and_mul(x, y, A, B, build_table(row_slots, rows), scaling, bounds, R, block_n=16, tiles=3)
    ext = stacked(x, y, A)
    from_stacked = expand_silu_and_mul(x, ext[:, :out], A, B, build_table(row_slots, rows), scaling, bounds, R,
                                       stacked_t=ext[:, out:])
    scale = float(ref.abs().max())
    errors[name] = [float((got - ref).abs().max()) / scale, float((graph[:rows] - ref).abs().max()) / scale,
                    float((graph[rows:] - silu_and_mul(pad)).abs().max()), float((tiled - ref).abs().max()) / scale,
                    float((from_stacked - ref).abs().max()) / scale]
print(json.dumps(errors))
"""


@pytest.fixture(scope="module")
def interpreted():
    return run_interpreted(SCRIPT, os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_kernels_match_reference(interpreted, case):
    eager, graph, padding, tiled = interpreted[case][:4]
    assert eager < 1e-5, f"eager table: relative error {eager}"
    assert tiled < 1e-5, f"column tiles grouped per program: relative error {tiled}"
    assert graph < 1e-5, f"static table: relative error {graph}"
    assert padding == 0.0, "padding rows of a graph gained a delta"


@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_stacked_expand_matches_reference(interpreted, case):
    """The expand over the rank columns a stacked GEMM wrote beside the
    output (each slot's at its own offset, no shrink): in place on the
    output's view (the rank columns left as they were), or into a new
    contiguous tensor, whose rows without an adapter are copied; and
    through a graph's static table, whose padding rows gain nothing."""
    in_place, rank_columns, fresh, layouts, graph, padding = interpreted[case][4:]
    assert in_place < 1e-5, f"in place: relative error {in_place}"
    assert rank_columns == 0.0, "the expand wrote into the rank columns"
    assert fresh < 1e-5, f"into a new tensor: relative error {fresh}"
    assert layouts == 1, "the new tensor is not contiguous, or the in-place result is not a view of the output"
    assert graph < 1e-5, f"static table: relative error {graph}"
    assert padding == 0.0, "padding rows of a graph gained a delta"


@pytest.mark.parametrize("case", [c[0] for c in ACT_CASES])
def test_expand_with_silu_and_mul_matches_reference(interpreted, case):
    """The gate|up deltas and SiLU-and-mul in one launch equal the reference
    deltas followed by the activation; a graph's padding rows get the
    activation of their own values, with no delta."""
    eager, graph, padding, tiled, from_stacked = interpreted[case]
    assert eager < 1e-5, f"eager table: relative error {eager}"
    assert graph < 1e-5, f"static table: relative error {graph}"
    assert padding < 1e-5, f"padding rows: error {padding}"
    assert tiled < 1e-5, f"column tiles grouped per program: relative error {tiled}"
    assert from_stacked < 1e-5, f"the stacked GEMM's rank columns, no shrink: relative error {from_stacked}"


def test_table_layout():
    """Rows with an adapter sorted by slot (stable), in blocks of at most
    BLOCK_M rows of one slot; then the rows without one, in blocks of slot
    NO_ADAPTER, after the adapters' blocks (and a graph's padding)."""
    from radixserve.lora.triton_ops import NO_ADAPTER, all_blocks_for, block_m_for, blocks_for, build_table

    BLOCK_M = block_m_for(21)
    row_slots = np.array([1, -1, 0] + [1] * (BLOCK_M + 2) + [0, -1])
    n = len(row_slots)
    table = build_table(row_slots, n)
    rows, blocks = table.rows.tolist(), table.blocks.tolist()
    ones = [i for i, s in enumerate(row_slots) if s == 1]
    assert rows == [2, n - 2] + ones + [1, n - 1]
    assert blocks == [[0, 0, 2], [1, 2, 2 + BLOCK_M], [1, 2 + BLOCK_M, n - 2]]
    assert table.all_blocks.tolist() == blocks + [[NO_ADAPTER, n - 2, n]]
    assert len(blocks) <= blocks_for(n, 2)
    longer = build_table(row_slots, n + 2)  # rows past row_slots have no adapter
    assert longer.rows.tolist()[n - 2:] == [1, n - 1, n, n + 1] and longer.all_blocks.tolist()[3:] == [
        [NO_ADAPTER, n - 2, n + 2]]
    empty = build_table(np.array([-1, -1]), 2)
    assert empty.rows.tolist() == [0, 1] and tuple(empty.blocks.shape) == (0, 3)
    assert empty.all_blocks.tolist() == [[NO_ADAPTER, 0, 2]]
    padded = build_table(row_slots, 600, blocks_for(600, 2))  # a prefill's blocks are larger
    big = padded.block_m
    assert big > BLOCK_M and padded.blocks.tolist()[:2] == [[0, 0, 2], [1, 2, n - 2]]
    assert padded.blocks.tolist()[2:] == [[-1, -1, -1]] * (blocks_for(600, 2) - 2)
    plain = padded.all_blocks.tolist()[blocks_for(600, 2):]
    assert len(plain) == all_blocks_for(600, 2) - blocks_for(600, 2)
    starts = list(range(n - 2, 600, big))
    assert plain == [[NO_ADAPTER, s, min(s + big, 600)] for s in starts] + [[-1, -1, -1]] * (len(plain) - len(starts))


def test_static_table_refills_only_on_change():
    """A graph's table is copied in again only when the batch's rows or slots
    change: the buffers then hold each batch's own table, and an unchanged
    decode batch leaves them as they are."""
    from radixserve.lora.triton_ops import StaticKernelTable, blocks_for, build_table

    static = StaticKernelTable(40, 3, torch.device("cpu"))

    def holds(row_slots, num_rows):
        want = build_table(row_slots, num_rows, blocks_for(num_rows, 3))
        view = static.view(num_rows)
        return (torch.equal(static.rows[:num_rows], want.rows) and torch.equal(view.all_blocks, want.all_blocks)
                and view.num_blocks == want.num_blocks)

    a, b = np.array([2, 0, 1, 1, -1, 2]), np.array([0, 0, 1, 2, 2, 2])
    for row_slots, num_rows in ((a, 8), (b, 8), (a, 8), (a, 16), (None, 8), (a, 8)):
        static.fill(row_slots, num_rows)
        assert holds(np.full(0, -1) if row_slots is None else row_slots, num_rows), (row_slots, num_rows)
    static.blocks.fill_(7)  # the buffers of the same batch are not written again
    static.fill(a.copy(), 8)
    assert bool((static.blocks == 7).all())
    static.fill(a[:5], 8)
    assert holds(a[:5], 8)


def test_kernel_config_by_block_size():
    """Decode blocks split K to fill the device, 16 rank columns a shrink
    program; prefill blocks of several parts take up to 64 columns a shrink
    program, split K in two at most, and one column tile an expand program."""
    from radixserve.lora.triton_ops import kernel_config

    decode = kernel_config(num_blocks=10, n=48, k=4096, block_m=16)
    assert (decode.shrink_block_n, decode.split_k, decode.expand_tiles) == (16, 8, 0)
    prefill = kernel_config(num_blocks=72, n=48, k=4096, block_m=64)
    assert (prefill.shrink_block_n, prefill.split_k, prefill.expand_tiles) == (64, 2, 1)
    one_part = kernel_config(num_blocks=72, n=16, k=14336, block_m=64)  # o, down: as for decode
    assert (one_part.shrink_block_n, one_part.split_k, one_part.expand_tiles) == (16, 4, 0)
    assert kernel_config(num_blocks=2, n=32, k=64, block_m=64).split_k == 1  # at least one K tile a partial
