"""``bench.trace_summary`` on a hand-made Chrome trace: the GPU's busy time
is the union of its kernels (overlaps counted once), and kernels are sorted
into kinds by name."""

from __future__ import annotations

import gzip
import json

from radixserve.bench.trace_summary import busy_time, kind_of, main, summarize


def kernel(name, ts, dur):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur}


TRACE = {"traceEvents": [
    kernel("nvjet_tst_128x256_64x4_2x1_v_bz_coopA_TNT", 0, 50),
    kernel("_decode_split_kernel", 40, 30),  # overlaps the GEMM by 10
    kernel("_rms_norm_kernel", 100, 10),  # after a 30 us gap
    kernel("Memcpy HtoD (Pinned -> Device)", 110, 10) | {"cat": "gpu_memcpy"},
    {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 500},  # host time is not GPU time
]}


def test_busy_time_counts_overlaps_once():
    assert busy_time([(0, 50), (40, 70), (100, 110), (110, 120)]) == 90
    assert busy_time([(0, 100), (10, 20)]) == 100


def test_kinds_and_busy_fraction():
    assert [kind_of(k["name"]) for k in TRACE["traceEvents"][:4]] == ["gemm", "attention", "norm_rope_act",
                                                                     "copy_index"]
    s = summarize(TRACE, top=2)
    assert s["kernels"] == 4 and s["window_ms"] == 0.12 and s["gpu_busy_fraction"] == 0.75
    assert s["by_kind_fraction"]["gemm"] == 0.5 and [k["name"] for k in s["top_kernels"]][1] == "_decode_split_kernel"


def test_cli_reads_a_gzipped_trace(tmp_path, capsys):
    path = tmp_path / "t-TP-0.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump(TRACE, f)
    assert main([str(path)]) == 0
    assert json.loads(capsys.readouterr().out)["gpu_busy_fraction"] == 0.75


def test_idle_gaps_name_the_kernels_around_them_and_the_host_work_spanning_them():
    trace = {"traceEvents": [
        kernel("gemm_a", 0, 100),
        kernel("attn_b", 90, 20),  # ends at 110
        kernel("norm_c", 500, 10),  # a 390 us gap
        kernel("norm_d", 560, 10),  # 50 us: under the threshold
        {"ph": "X", "cat": "user_annotation", "name": "scheduler.process", "ts": 100, "dur": 450},
        {"ph": "X", "cat": "cpu_op", "name": "aten::tolist", "ts": 105, "dur": 390},
        {"ph": "X", "cat": "cpu_op", "name": "aten::add", "ts": 200, "dur": 5},  # inside the gap, does not span it
    ]}
    gaps = summarize(trace)["idle_gaps"]
    assert (gaps["count"], gaps["total_ms"]) == (1, 0.39)
    assert gaps["longest"] == [{"us": 390, "after": "attn_b", "before": "norm_c",
                                "host": ["aten::tolist", "scheduler.process"]}]
