"""bench.scheduler_host on a CPU, scaled down: every step kind is timed, and
mixed steps appear only with --enable-mixed-chunk."""

from __future__ import annotations

from radixserve.bench import scheduler_host

SMALL = ["--num-prompts", "12", "--input-len", "40", "--output-len", "6", "--max-running-requests", "4",
         "--chunked-prefill-size", "32"]


def test_mixed_steps_are_timed_only_with_the_flag(capsys):
    mixed = scheduler_host.main(SMALL + ["--enable-mixed-chunk"])
    assert mixed["next_batch_mixed"]["steps"] > 0 and mixed["next_batch_extend"]["steps"] > 0
    assert 0 < mixed["next_batch_mixed"]["median_ms"] <= mixed["next_batch_mixed"]["p99_ms"]
    plain = scheduler_host.main(SMALL)
    assert plain["next_batch_mixed"] == {"steps": 0} and plain["next_batch_decode"]["steps"] > 0
    assert capsys.readouterr().out.count('"bench": "scheduler_host"') == 2
