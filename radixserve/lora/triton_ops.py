"""Segmented LoRA GEMMs in Triton (``--lora-backend triton``): the delta of
every adapter in a batch in two launches per linear layer, or one beside a
stacked base GEMM (:func:`stacked_delta`), whatever the number of adapters,
and no host sync, so CUDA graphs capture them.

The batch's rows that have an adapter are sorted by slot and cut into blocks
of at most ``BLOCK_M`` rows of one slot (``LoRAKernelTable``, built on the
host by :func:`build_table`). A block is one program row of both kernels:

1. **shrink**: ``t[rows] = x[rows] @ A[slot].T``, all parts at once (q|k|v
   or gate|up: ``A`` stacks their ``R`` rows each), split along K into
   ``SPLIT_K`` partial sums when the batch has few blocks (each partial in
   its own plane of ``t``: no atomics, the same sums every run);
2. **expand**: ``y[rows, cols] += scaling[slot] * t[rows, part(col)] @ B[slot, cols].T``,
   summing the partials once per program, which then walks several column
   tiles; each output column takes the rank columns of the part it belongs to.

A stacked layer (``pool.LoRALayer.stack``) has no shrink: its base GEMM
over ``[W; A_0; ...; A_S-1]`` writes every slot's rank columns beside ``y``,
and the expand reads its block's slot's (one partial, ``t``'s strides
say where: :func:`_t_strides`).

Region map of a table (``BLOCK_M`` = 4; batch rows r0..r7, ``-`` no adapter)::

    row slots   r0:1  r1:-  r2:0  r3:1  r4:1  r5:1  r6:1  r7:0
    rows        | 2  7 | 0  3  4  5 | 6 |          (sorted by slot, stable)
    blocks      (0, 0, 2) (1, 2, 6) (1, 6, 7) (-1, ..) ...   (slot, start, end)

Blocks past the batch's own are ``slot = -1`` and return at once: a CUDA
graph captured for ``T`` rows launches ``blocks_for(T, slots)`` programs per
column tile, enough for any batch of at most ``T`` rows.

After the adapters' blocks, the table holds the rows without one (``r1`` and
any padding rows of a graph), in blocks of ``slot = NO_ADAPTER``, which the
shrink never launches, nor the expand unless it writes a new tensor (it
then copies their rows). The MLP's gate/up takes them:
:func:`expand_silu_and_mul` replaces its expand and the SiLU-and-mul after
it, so the layer's ``[T, 2 * I]`` output is read once and never written
back: every block's rows go through SiLU-and-mul, an adapter's with their
delta added first (rounded to ``y``'s dtype, as the expand stores it).

Rank ``r < R`` adapters leave rows ``r..R-1`` of ``A`` and columns of ``B``
zero (``LoRALayer.fill``), so the kernels read ``R`` and add nothing more.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

_SHRINK_BLOCK_N = 16
_PREFILL_SHRINK_BLOCK_N = 64  # rank columns a prefill block's shrink program takes (all of q|k|v at rank 16)
_PREFILL_MAX_SPLIT_K = 2
_MAX_SPLIT_K = 8
_TARGET_PROGRAMS = 264  # two shrink programs per SM of an H100 / H200
_EXPAND_PROGRAMS = 528  # four expand programs per SM
_MAX_EXPAND_TILES = 16
_ACT_BLOCK_N = 64  # output columns (of gate and of up each) a program of the fused SiLU-and-mul takes
NO_ADAPTER = -2  # the slot of a block of rows without an adapter (only the fused SiLU-and-mul takes it)


def block_m_for(num_rows: int) -> int:
    """Rows per block for a forward of ``num_rows`` rows: 16 (tl.dot's least)
    for decode batches, larger for prefills, which re-read each adapter's
    weights once per block."""
    return 16 if num_rows <= 512 else 64


@dataclass
class LoRAKernelTable:
    """Which rows each program of the kernels takes (see the module's region map)."""

    rows: torch.Tensor  # [>= rows] int32: batch rows with an adapter sorted by slot, then those without
    all_blocks: torch.Tensor  # [*, 3] int32: slot (-1: none, NO_ADAPTER: rows without one), start, end in ``rows``
    num_blocks: int  # the first ``num_blocks`` of ``all_blocks`` are the adapters' (the kernels' grid)
    block_m: int

    @property
    def blocks(self) -> torch.Tensor:
        """The adapters' blocks (then padding): the shrink's and expand's programs."""
        return self.all_blocks[: self.num_blocks]

    def to(self, device: torch.device) -> "LoRAKernelTable":
        return LoRAKernelTable(staged(self.rows, device).to(device, non_blocking=True),
                               staged(self.all_blocks, device).to(device, non_blocking=True), self.num_blocks,
                               self.block_m)


def staged(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` ready for an asynchronous copy to ``device``: in pinned
    memory when that is a GPU. CUDA lets a copy from pageable memory wait
    for the stream's earlier work (which under overlap scheduling is the
    previous step's forward) while the driver stages it; one from pinned
    memory never waits. PyTorch's pinned allocator keeps the block until
    the copy has run."""
    return host.pin_memory() if torch.device(device).type == "cuda" else host


def blocks_for(num_rows: int, num_slots: int) -> int:
    """The most blocks a forward of ``num_rows`` rows over ``num_slots`` slots cuts into."""
    return triton.cdiv(num_rows, block_m_for(num_rows)) + num_slots


def all_blocks_for(num_rows: int, num_slots: int) -> int:
    """:func:`blocks_for` and then the most blocks of rows without an adapter."""
    return blocks_for(num_rows, num_slots) + triton.cdiv(num_rows, block_m_for(num_rows))


def _cut(slots: np.ndarray, starts: np.ndarray, counts: np.ndarray, block_m: int, pad_to: int | None) -> np.ndarray:
    """``[n, 3]`` blocks (slot, start, end) of at most ``block_m`` rows cutting
    each run ``starts[i] .. starts[i] + counts[i]`` of slot ``slots[i]``,
    padded with ``-1`` rows to ``pad_to``."""
    per_run = -(-counts // block_m)
    index = np.arange(per_run.sum()) - np.repeat(np.cumsum(per_run) - per_run, per_run)  # block within its run
    first = np.repeat(starts, per_run) + block_m * index
    ends = np.minimum(first + block_m, np.repeat(starts + counts, per_run))
    blocks = np.stack([np.repeat(slots, per_run), first, ends], axis=1).astype(np.int32).reshape(-1, 3)
    if pad_to is not None:
        blocks = np.concatenate([blocks, np.full((pad_to - len(blocks), 3), -1, dtype=np.int32)])
    return blocks


def build_table(row_slots: np.ndarray, num_rows: int, num_blocks: int | None = None) -> LoRAKernelTable:
    """The host table of a forward of ``num_rows`` rows whose row ``i`` takes
    slot ``row_slots[i]`` (-1: none; rows past ``row_slots`` take none), in
    blocks of ``block_m_for(num_rows)``. With ``num_blocks`` (a graph's), the
    adapters' blocks are padded to it with ``slot = -1``, and the blocks
    without an adapter to ``all_blocks_for(num_rows)`` in all."""
    block_m = block_m_for(num_rows)
    row_slots = np.concatenate([row_slots[:num_rows], np.full(max(0, num_rows - len(row_slots)), -1)])
    have = np.flatnonzero(row_slots >= 0)
    order = have[np.argsort(row_slots[have], kind="stable")]
    without = np.flatnonzero(row_slots < 0)
    slots, starts, counts = np.unique(row_slots[order], return_index=True, return_counts=True)
    blocks = _cut(slots, starts, counts, block_m, num_blocks)
    rest = None if num_blocks is None else triton.cdiv(num_rows, block_m)
    plain = _cut(np.array([NO_ADAPTER]), np.array([len(order)]), np.array([len(without)]), block_m, rest)
    rows = np.concatenate([order, without]).astype(np.int32)
    return LoRAKernelTable(torch.from_numpy(rows), torch.from_numpy(np.concatenate([blocks, plain])), len(blocks),
                           block_m)


class StaticKernelTable:
    """A CUDA graph's table: buffers for up to ``max_rows`` rows, into which
    :meth:`fill` copies each batch's table before a replay."""

    def __init__(self, max_rows: int, num_slots: int, device: torch.device):
        self.num_slots = num_slots
        self.rows = torch.zeros(max_rows, dtype=torch.int32, device=device)
        # the most blocks of any graph's rows: blocks grow 4x larger past 512 rows, so the count is not monotonic
        most = max(all_blocks_for(n, num_slots) for n in (min(max_rows, 512), max_rows))
        self.blocks = torch.full((most, 3), -1, dtype=torch.int32, device=device)
        self._filled: tuple | None = None  # what the buffers hold: (num_rows, the row slots' bytes)

    def view(self, num_rows: int) -> LoRAKernelTable:
        """The table a graph of ``num_rows`` rows captures."""
        return LoRAKernelTable(self.rows, self.blocks[: all_blocks_for(num_rows, self.num_slots)],
                               blocks_for(num_rows, self.num_slots), block_m_for(num_rows))

    def fill(self, row_slots: np.ndarray | None, num_rows: int) -> None:
        """Copy in the table of a batch whose rows take ``row_slots`` (None:
        no adapter) for a graph of ``num_rows`` rows: two host-to-device copies,
        none when the buffers hold that table already (decode steps of an
        unchanged running batch), from pinned memory: the host does not wait
        for the forward before."""
        row_slots = np.full(0, -1) if row_slots is None else row_slots
        key = (num_rows, row_slots.tobytes())
        if key == self._filled:
            return
        table = build_table(row_slots, num_rows, blocks_for(num_rows, self.num_slots))
        self.rows[:num_rows].copy_(staged(table.rows, self.rows.device), non_blocking=True)
        self.blocks[: table.all_blocks.shape[0]].copy_(staged(table.all_blocks, self.blocks.device), non_blocking=True)
        self._filled = key


@triton.jit
def _block(Blocks, Rows, BLOCK_M: tl.constexpr):
    """This program's block: its slot (-1: none, NO_ADAPTER: rows without one), its batch rows and which of the BLOCK_M are real."""
    slot = tl.load(Blocks + tl.program_id(0) * 3)
    start = tl.load(Blocks + tl.program_id(0) * 3 + 1)
    end = tl.load(Blocks + tl.program_id(0) * 3 + 2)
    offs_m = start + tl.arange(0, BLOCK_M)
    mask_m = offs_m < end
    return slot, tl.load(Rows + offs_m, mask=mask_m, other=0).to(tl.int64), mask_m  # no block: end -1, no row


@triton.jit
def _rank_columns(T, rows, mask_m, slot, stride_tp, stride_tm, stride_ts, R: tl.constexpr, R_PAD: tl.constexpr,
                  PARTS: tl.constexpr, PR_PAD: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr):
    """A block's rank columns of every part, the K-partials summed, as one
    float32 ``[BLOCK_M, PR_PAD]`` tile; and for each of its columns ``j``
    the part ``jp``, the rank column ``jr`` and whether it is real. ``T``'s
    strides: between partials, rows and slots (0 for the shrink's own
    ``t``; see :func:`_t_strides`)."""
    offs_j = tl.arange(0, PR_PAD)
    jp, jr = offs_j // R_PAD, offs_j % R_PAD
    mask_j = (jp < PARTS) & (jr < R)
    t = tl.zeros([BLOCK_M, PR_PAD], dtype=tl.float32)
    base = T + slot.to(tl.int64) * stride_ts + rows[:, None] * stride_tm + (jp * R + jr)[None, :]
    for s in tl.static_range(SPLIT_K):
        t += tl.load(base + s * stride_tp, mask=mask_m[:, None] & mask_j[None, :], other=0.0).to(tl.float32)
    return t, jp, jr, mask_j


@triton.jit
def _shrink_kernel(X, A, T, Rows, Blocks, num_rows, N, K, stride_xm, stride_as, stride_an,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr):
    slot, rows, mask_m = _block(Blocks, Rows, BLOCK_M)
    if slot < 0:
        return
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    split = tl.program_id(2)
    k_span = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    a_base = A + slot.to(tl.int64) * stride_as
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(split * k_span, tl.minimum(K, (split + 1) * k_span), BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        x = tl.load(X + rows[:, None] * stride_xm + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        a = tl.load(a_base + offs_n[:, None] * stride_an + offs_k[None, :], mask=mask_n[:, None] & mask_k[None, :],
                    other=0.0)
        acc += tl.dot(x, tl.trans(a))
    out = T + split.to(tl.int64) * num_rows * N + rows[:, None] * N + offs_n[None, :]
    tl.store(out, acc, mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _expand_kernel(T, B, Y, Out, Rows, Blocks, Scaling, PartBounds, OUT, stride_tp, stride_tm, stride_ts, stride_ym,
                   stride_om, stride_bs, stride_bo, R: tl.constexpr, R_PAD: tl.constexpr, PARTS: tl.constexpr,
                   PR_PAD: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_N: tl.constexpr, TILES: tl.constexpr,
                   BLOCK_M: tl.constexpr):
    # One program: a block's rows times TILES column tiles. Its rank columns
    # of every part are read (and the K-partials summed) once, as one
    # [BLOCK_M, PR_PAD] tile; each column tile then takes B's rank columns of
    # its own part only (``jp``: the part of rank column j), so one dot adds
    # each column's own part's delta. ``Out`` is ``Y`` (in place) or another
    # tensor, into which the blocks of rows without an adapter copy theirs.
    slot, rows, mask_m = _block(Blocks, Rows, BLOCK_M)
    if slot == -1:
        return
    if slot == -2:  # NO_ADAPTER: launched only where Out is not Y
        for c in range(TILES):
            offs_n = (tl.program_id(1) * TILES + c) * BLOCK_N + tl.arange(0, BLOCK_N)
            mask = mask_m[:, None] & (offs_n < OUT)[None, :]
            y = tl.load(Y + rows[:, None] * stride_ym + offs_n[None, :], mask=mask, other=0.0)
            tl.store(Out + rows[:, None] * stride_om + offs_n[None, :], y, mask=mask)
    else:
        t, jp, jr, mask_j = _rank_columns(T, rows, mask_m, slot, stride_tp, stride_tm, stride_ts, R, R_PAD, PARTS,
                                          PR_PAD, SPLIT_K, BLOCK_M)
        t = t.to(B.dtype.element_ty)
        b_base = B + slot.to(tl.int64) * stride_bs
        scale = tl.load(Scaling + slot)
        for c in range(TILES):
            offs_n = (tl.program_id(1) * TILES + c) * BLOCK_N + tl.arange(0, BLOCK_N)
            mask_n = offs_n < OUT
            part = _parts_of(offs_n, PartBounds, PARTS)
            b = tl.load(b_base + offs_n[:, None] * stride_bo + jr[None, :],
                        mask=mask_n[:, None] & (part[:, None] == jp[None, :]) & mask_j[None, :], other=0.0)
            acc = tl.dot(t, tl.trans(b))
            mask = mask_m[:, None] & mask_n[None, :]
            y = tl.load(Y + rows[:, None] * stride_ym + offs_n[None, :], mask=mask, other=0.0)
            tl.store(Out + rows[:, None] * stride_om + offs_n[None, :], (y.to(tl.float32) + scale * acc).to(y.dtype),
                     mask=mask)


@triton.jit
def _parts_of(offs_n, PartBounds, PARTS: tl.constexpr):
    """The part (-1: none) that each of the columns ``offs_n`` belongs to."""
    part = tl.full(offs_n.shape, -1, dtype=tl.int32)
    for p in tl.static_range(PARTS):
        lo = tl.load(PartBounds + 2 * p)
        hi = tl.load(PartBounds + 2 * p + 1)
        part = tl.where((offs_n >= lo) & (offs_n < hi), p, part)
    return part


@triton.jit
def _silu_and_mul_rows(Y, Out, rows, mask_m, offs_n, D, stride_ym, dgate, dup, HAS_DELTA: tl.constexpr):
    """``silu(gate) * up`` of a tile of ``rows`` and columns ``offs_n``, each
    half plus its delta first (rounded to ``Y``'s dtype, as the expand
    stores it) when ``HAS_DELTA``; the product as ``silu_and_mul`` computes it."""
    mask = mask_m[:, None] & (offs_n < D)[None, :]
    y_ptrs = Y + rows[:, None] * stride_ym + offs_n[None, :]
    gate = tl.load(y_ptrs, mask=mask, other=0.0)
    up = tl.load(y_ptrs + D, mask=mask, other=0.0)
    if HAS_DELTA:
        gate = (gate.to(tl.float32) + dgate).to(gate.dtype)
        up = (up.to(tl.float32) + dup).to(up.dtype)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(up.dtype)  # rounded before the product, as silu_and_mul does
    tl.store(Out + rows[:, None] * D + offs_n[None, :], (act.to(tl.float32) * up.to(tl.float32)).to(up.dtype),
             mask=mask)


@triton.jit
def _expand_silu_and_mul_kernel(Y, T, B, Out, Rows, Blocks, Scaling, PartBounds, D, stride_tp, stride_tm, stride_ts,
                                stride_ym, stride_bs, stride_bo, R: tl.constexpr, R_PAD: tl.constexpr, PARTS: tl.constexpr,
                                PR_PAD: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_N: tl.constexpr,
                                TILES: tl.constexpr, BLOCK_M: tl.constexpr):
    # One program: a block's rows times TILES tiles of BLOCK_N output columns,
    # which are columns c of the gate and D + c of the up half of ``Y``. An
    # adapter's block reads its rank columns (summing the K-partials) once,
    # and adds each half's delta (the expand's dot, over the rank columns of
    # the part each column belongs to).
    slot, rows, mask_m = _block(Blocks, Rows, BLOCK_M)
    if slot == -1:
        return
    first = tl.program_id(1) * TILES * BLOCK_N
    if slot == -2:  # NO_ADAPTER
        for c in range(TILES):
            offs_n = first + c * BLOCK_N + tl.arange(0, BLOCK_N)
            _silu_and_mul_rows(Y, Out, rows, mask_m, offs_n, D, stride_ym, 0.0, 0.0, HAS_DELTA=False)
    else:
        t, jp, jr, mask_j = _rank_columns(T, rows, mask_m, slot, stride_tp, stride_tm, stride_ts, R, R_PAD, PARTS,
                                          PR_PAD, SPLIT_K, BLOCK_M)
        t = t.to(B.dtype.element_ty)
        scale = tl.load(Scaling + slot)
        b_base = B + slot.to(tl.int64) * stride_bs
        for c in range(TILES):
            offs_n = first + c * BLOCK_N + tl.arange(0, BLOCK_N)
            b_ptrs = b_base + offs_n[:, None] * stride_bo + jr[None, :]
            mask_b = (offs_n < D)[:, None] & mask_j[None, :]
            b_gate = tl.load(b_ptrs, mask=mask_b & (_parts_of(offs_n, PartBounds, PARTS)[:, None] == jp[None, :]),
                             other=0.0)
            b_up = tl.load(b_ptrs + D * stride_bo,
                           mask=mask_b & (_parts_of(offs_n + D, PartBounds, PARTS)[:, None] == jp[None, :]),
                           other=0.0)
            _silu_and_mul_rows(Y, Out, rows, mask_m, offs_n, D, stride_ym, scale * tl.dot(t, tl.trans(b_gate)),
                               scale * tl.dot(t, tl.trans(b_up)), HAS_DELTA=True)


@dataclass(frozen=True)
class KernelConfig:
    """Launch parameters of one layer's two kernels."""

    split_k: int
    shrink_block_k: int = 128
    shrink_warps: int = 4
    shrink_block_n: int = _SHRINK_BLOCK_N  # rank columns a shrink program takes (of all parts' P*R)
    expand_block_n: int = 128
    expand_warps: int = 4
    expand_tiles: int = 0  # column tiles per expand program; 0: enough programs to fill the device


def kernel_config(num_blocks: int, n: int, k: int, block_m: int = 16, block_k: int = 128) -> KernelConfig:
    """Split K so the shrink has enough programs to fill the device when
    the batch has few blocks (decode), each with at least one K tile.

    Prefill blocks (``block_m`` past 16) with several parts' rank columns
    (q|k|v, gate|up) take them all in one shrink program, so a block's rows
    of ``x`` are read once rather than once per 16 columns, split K in two
    at most, and give each expand program one column tile: with few
    partials to sum, more programs beat fewer that walk several tiles (an
    H100 at 4,096 rows: q/k/v 73 to 64 us, gate/up 224 to 207;
    docs/lora.md)."""
    block_n = _PREFILL_SHRINK_BLOCK_N if block_m > 16 and n > _SHRINK_BLOCK_N else _SHRINK_BLOCK_N
    programs = num_blocks * triton.cdiv(n, block_n)
    split = max(1, min(triton.cdiv(_TARGET_PROGRAMS, max(1, programs)), _MAX_SPLIT_K, triton.cdiv(k, block_k)))
    if block_n == _SHRINK_BLOCK_N:
        return KernelConfig(split, block_k)
    return KernelConfig(min(split, _PREFILL_MAX_SPLIT_K), block_k, shrink_block_n=block_n, expand_tiles=1)


def _tiles_per_program(config: KernelConfig, n_tiles: int, num_blocks: int) -> int:
    """Column tiles an expand program walks: ``config``'s, else enough
    programs to fill the device with the partial sums read once a program."""
    return config.expand_tiles or min(_MAX_EXPAND_TILES, max(1, n_tiles * num_blocks // _EXPAND_PROGRAMS))


def lora_delta(x: torch.Tensor, y: torch.Tensor, A: torch.Tensor, B: torch.Tensor, table: LoRAKernelTable,
               scaling: torch.Tensor, part_bounds: torch.Tensor, rank: int,
               config: KernelConfig | None = None) -> torch.Tensor:
    """``y`` plus each block's delta, in place (see the module's docstring).

    ``x`` [T, K] and ``y`` [T, OUT] rows are the batch's; ``A`` [S, P*R, K],
    ``B`` [S, OUT, R] (strided over S); ``scaling`` [S] float32;
    ``part_bounds`` [P, 2] int32 (the columns of ``y`` each part adds to;
    part p's rank columns of ``t`` are ``p*R .. p*R+R-1``). ``config``:
    launch parameters (default :func:`kernel_config`'s)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    num_blocks = table.blocks.shape[0]
    if num_blocks == 0 or x.shape[0] == 0:
        return y
    config = config or kernel_config(num_blocks, A.shape[1], x.shape[1], table.block_m)
    t = shrink(x, A, table, config)
    return expand(t, B, y, table, scaling, part_bounds, rank, config)


def shrink(x: torch.Tensor, A: torch.Tensor, table: LoRAKernelTable, config: KernelConfig) -> torch.Tensor:
    """``t`` [split_k, T, P*R] float32: the partial sums of ``x[rows] @ A[slot].T`` (rows in no block: garbage)."""
    num_rows, k = x.shape
    n, split = A.shape[1], config.split_k
    t = torch.empty(split, num_rows, n, dtype=torch.float32, device=x.device)
    _shrink_kernel[(table.blocks.shape[0], triton.cdiv(n, config.shrink_block_n), split)](
        x, A, t, table.rows, table.blocks, num_rows, n, k, x.stride(0), A.stride(0), A.stride(1),
        BLOCK_N=config.shrink_block_n, BLOCK_K=config.shrink_block_k, SPLIT_K=split, BLOCK_M=table.block_m,
        num_warps=config.shrink_warps)
    return t


def _t_strides(t: torch.Tensor, slot_cols: int) -> tuple[int, int, int, int]:
    """(partials, plane stride, row stride, slot stride) of the rank columns
    ``t`` the expand reads: :func:`shrink`'s ``[split_k, T, P*R]``, or (a
    2-D ``t``) the stacked GEMM's ``[T, S*P*R]`` columns, where slot ``s``'s
    begin at ``s * slot_cols``."""
    if t.dim() == 3:
        return t.shape[0], t.stride(0), t.stride(1), 0
    return 1, 0, t.stride(0), slot_cols


def expand(t: torch.Tensor, B: torch.Tensor, y: torch.Tensor, table: LoRAKernelTable, scaling: torch.Tensor,
           part_bounds: torch.Tensor, rank: int, config: KernelConfig, slot_cols: int = 0,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """``y[rows, part p] += scaling[slot] * sum(t)[rows, p*R : p*R+R] @ B[slot, part p].T``,
    in place; or, with ``out``, ``y`` plus the deltas written to ``out``
    (every row: those without an adapter are copied). ``t``: see :func:`_t_strides`."""
    split, stride_tp, stride_tm, stride_ts = _t_strides(t, slot_cols)
    blocks = table.blocks if out is None else table.all_blocks
    out = y if out is None else out
    width, parts, num_blocks = y.shape[1], part_bounds.shape[0], blocks.shape[0]
    if num_blocks == 0 or y.shape[0] == 0:
        return out
    n_tiles = triton.cdiv(width, config.expand_block_n)
    tiles = _tiles_per_program(config, n_tiles, num_blocks)
    r_pad = max(16, triton.next_power_of_2(rank))
    _expand_kernel[(num_blocks, triton.cdiv(n_tiles, tiles))](
        t, B, y, out, table.rows, blocks, scaling, part_bounds, width, stride_tp, stride_tm, stride_ts, y.stride(0),
        out.stride(0), B.stride(0), B.stride(1), R=rank, R_PAD=r_pad, PARTS=parts,
        PR_PAD=triton.next_power_of_2(parts) * r_pad, SPLIT_K=split, BLOCK_N=config.expand_block_n, TILES=tiles,
        BLOCK_M=table.block_m, num_warps=config.expand_warps)
    return out


def stacked_delta(y_ext: torch.Tensor, width: int, B: torch.Tensor, table: LoRAKernelTable, scaling: torch.Tensor,
                  part_bounds: torch.Tensor, rank: int, slot_cols: int, contiguous: bool,
                  config: KernelConfig | None = None) -> torch.Tensor:
    """The layer's output from the stacked GEMM's ``y_ext`` ``[T, width +
    S * slot_cols]`` (``x @ [W; A_0; ...; A_S-1].T``): its first ``width``
    columns plus each adapter row's delta, whose rank columns are the rest
    of the row, no shrink launched. In place (a strided view of ``y_ext``),
    or with ``contiguous`` a new ``[T, width]`` tensor."""
    y, t = y_ext[:, :width], y_ext[:, width:]
    # one column tile a program: with one partial there is nothing to read once for several
    config = config or KernelConfig(split_k=1, expand_tiles=1)
    out = torch.empty(y.shape, dtype=y.dtype, device=y.device) if contiguous else None
    return expand(t, B, y, table, scaling, part_bounds, rank, config, slot_cols, out)


def expand_silu_and_mul(x: torch.Tensor, y: torch.Tensor, A: torch.Tensor, B: torch.Tensor, table: LoRAKernelTable,
                        scaling: torch.Tensor, part_bounds: torch.Tensor, rank: int, block_n: int = _ACT_BLOCK_N,
                        num_warps: int = 4, tiles: int = 0, stacked_t: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(gate) * up`` of ``y`` [T, 2 * D] = ``[gate | up]`` plus each
    adapter row's delta (``lora_delta``'s): the shrink, then one launch for
    the expand and the activation, over every block of ``table`` (the rows
    without an adapter too), ``tiles`` tiles of ``block_n`` output columns a
    program (0: as the expand chooses; one with ``stacked_t``). With
    ``stacked_t`` (the stacked GEMM's rank columns, ``A.shape[1]`` a slot, as
    :func:`stacked_delta` takes them) no shrink runs and ``x`` is not read.
    Returns a new ``[T, D]`` tensor."""
    num_rows, d = y.shape[0], y.shape[1] // 2
    out = torch.empty(num_rows, d, dtype=y.dtype, device=y.device)
    num_all = table.all_blocks.shape[0]
    if num_rows == 0 or d == 0 or num_all == 0:
        return out
    if stacked_t is not None:  # one partial: one column tile a program, as stacked_delta's
        t, tiles = stacked_t, tiles or 1
    else:
        config = kernel_config(max(1, table.num_blocks), A.shape[1], x.shape[1], table.block_m)
        t = (shrink(x if x.stride(-1) == 1 else x.contiguous(), A, table, config) if table.num_blocks else
             torch.empty(1, num_rows, A.shape[1], dtype=torch.float32, device=x.device))
        tiles = tiles or _tiles_per_program(config, triton.cdiv(d, block_n), num_all)
    split, stride_tp, stride_tm, stride_ts = _t_strides(t, A.shape[1])
    r_pad = max(16, triton.next_power_of_2(rank))
    parts = part_bounds.shape[0]
    _expand_silu_and_mul_kernel[(num_all, triton.cdiv(d, block_n * tiles))](
        y, t, B, out, table.rows, table.all_blocks, scaling, part_bounds, d, stride_tp, stride_tm, stride_ts,
        y.stride(0), B.stride(0), B.stride(1), R=rank, R_PAD=r_pad, PARTS=parts,
        PR_PAD=triton.next_power_of_2(parts) * r_pad, SPLIT_K=split, BLOCK_N=block_n, TILES=tiles,
        BLOCK_M=table.block_m, num_warps=num_warps)
    return out
