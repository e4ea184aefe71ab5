"""The tuned launch tables shipped in the package (the fused MoE kernel's in
``layers/moe/configs``, the skinny GEMM's in ``layers/triton_ops/configs/skinny``):
every file is named as its kernel looks for it and every entry is one the
kernel accepts, so a malformed table fails here, not on a GPU at serving
time."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

pytest.importorskip("triton")


def power_of_two(value: int) -> bool:
    return value > 0 and value & (value - 1) == 0


def table_files(directory: Path, name: str) -> list[tuple[Path, dict]]:
    """Each JSON file of ``directory`` (at least one) with its parsed contents,
    its name matching ``name`` (a regular expression)."""
    files = sorted(directory.glob("*.json"))
    assert files, directory
    for path in files:
        assert re.fullmatch(name, path.name), path.name
    return [(path, json.loads(path.read_text())) for path in files]


def test_fused_moe_tables():
    """Every launch key, powers of two for the tiles and warps, and blocks of
    one row (the CUDA cores) or of 16 and more (the tensor cores)."""
    from radixserve.layers.moe.triton_ops import fused_moe

    for path, raw in table_files(fused_moe.CONFIG_DIR,
                                 r"E=\d+,H=\d+,I=\d+,dtype=(bf16|fp16|fp32),device_name=[\w-]+\.json"):
        assert raw and all(int(tokens) > 0 for tokens in raw), path.name
        for tokens, cfg in raw.items():
            assert set(cfg) == set(fused_moe.CONFIG_KEYS), (path.name, tokens)
            for key in ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "num_warps"):
                assert power_of_two(cfg[key]), (path.name, tokens, key)
            assert cfg["BLOCK_SIZE_M"] == 1 or cfg["BLOCK_SIZE_M"] >= 16, (path.name, tokens)
        assert fused_moe.load_configs(str(path)) is not None


def test_skinny_gemm_tables():
    """Each entry is the weight dtype's vendor GEMM (``_scaled_mm`` for fp8,
    ``F.linear`` for the others; no slower than the best tiles by its own
    times) or a config the kernel accepts: powers of two, rows of 1 to 8 on
    the CUDA cores or 16 to 64 on the tensor cores, ``row_loop`` only on the
    CUDA cores; entries written by the tuner carry both times."""
    from radixserve.bench import fp8_gemm
    from radixserve.layers.triton_ops import skinny_gemm

    for path, raw in table_files(skinny_gemm.TABLE_DIR,
                                 r"N=\d+,K=\d+,dtype=(fp8|bf16|fp16|fp32),device_name=[\w-]+\.json"):
        table = skinny_gemm.load_table(str(path))
        assert table and set(table) == {int(rows) for rows in raw}, path.name
        vendor = skinny_gemm.SCALED_MM if ",dtype=fp8," in path.name else skinny_gemm.LINEAR
        for rows, entry in table.items():
            written = raw[str(rows)]
            assert 1 <= rows <= skinny_gemm.MAX_ROWS, (path.name, rows)
            if "kernel" in written:
                assert written["kernel"] in ("skinny", vendor), (path.name, rows)
                assert {"us", f"{vendor}_us"} <= set(written), (path.name, rows)
            if "kernel" in written:  # the vendor's GEMM where it won as the tuner decides (bench.fp8_gemm)
                margin = fp8_gemm.LINEAR_MARGIN if vendor == skinny_gemm.LINEAR else 1.0
                won = written[f"{vendor}_us"] < written["us"] or written["us"] > margin * written[f"{vendor}_us"]
                assert won == (entry == vendor), (path.name, rows)
            if entry == vendor:
                continue
            for value in (entry.block_m, entry.block_n, entry.block_k, entry.num_warps):
                assert power_of_two(value), (path.name, rows, entry)
            assert entry.block_m >= rows and (entry.block_m <= 8 or 16 <= entry.block_m <= 64), (path.name, rows)
            assert not entry.row_loop or entry.block_m < 16, (path.name, rows)
            assert entry.split_k >= 1 and 1 <= entry.num_stages <= 8, (path.name, rows)
