"""bench-serving: the workload generators, the metrics on a hand-made timeline,
and short runs against a real CPU server (tiny-llama, dummy weights)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from radixserve.bench import serving, serving_report
from radixserve.bench.datasets import (TokenSampler, generated_shared_prefix_dataset, jsonl_dataset,
                                       multi_turn_dataset, random_dataset)
from radixserve.bench.serving import RequestRecord, compute_metrics, itls, tpot, ttft
from radixserve.bench.serving_metrics import stream_pacing

# --------------------------------------------------------------------------- datasets


def test_random_lengths_stay_in_range_and_ids_avoid_special_tokens():
    sampler = TokenSampler(1000, special_ids=[0, 1, 2, 999], seed=3)
    ds = random_dataset(sampler, 200, input_len=100, output_len=40, range_ratio=0.5)
    turns = [c.turns[0] for c in ds.conversations]
    assert len(turns) == 200
    assert all(50 <= t.prompt_len <= 100 and len(t.prompt) == t.prompt_len for t in turns)
    assert all(20 <= t.output_len <= 40 for t in turns)
    assert {t.prompt_len for t in turns} != {100}  # the range is used, not just its top
    ids = np.concatenate([t.prompt for t in turns])
    assert ids.min() >= 3 and ids.max() <= 998


def test_random_range_ratio_one_gives_exact_lengths():
    ds = random_dataset(TokenSampler(500, seed=0), 20, 64, 8, range_ratio=1.0)
    assert {(c.turns[0].prompt_len, c.turns[0].output_len) for c in ds.conversations} == {(64, 8)}


def test_shared_prefix_groups_share_exactly_the_system_prompt():
    ds = generated_shared_prefix_dataset(TokenSampler(5000, seed=1), num_groups=4, prompts_per_group=5,
                                         system_prompt_len=32, question_len=8, output_len=6)
    by_group: dict[int, list[list[int]]] = {}
    for conv in ds.conversations:
        assert conv.turns[0].prompt_len == 40 == len(conv.turns[0].prompt) and conv.turns[0].output_len == 6
        by_group.setdefault(conv.prefix_group, []).append(conv.turns[0].prompt)
    assert sorted(map(len, by_group.values())) == [5] * 4
    prefixes = {g: {tuple(p[:32]) for p in prompts} for g, prompts in by_group.items()}
    assert all(len(s) == 1 for s in prefixes.values())  # one system prompt per group
    assert len({next(iter(s)) for s in prefixes.values()}) == 4  # and a different one for each group
    assert all(len({tuple(p[32:]) for p in prompts}) == 5 for prompts in by_group.values())
    # shuffled across groups by default; --gsp-ordered keeps them together
    assert [c.prefix_group for c in ds.conversations] != sorted(c.prefix_group for c in ds.conversations)
    ordered = generated_shared_prefix_dataset(TokenSampler(5000, seed=1), 4, 5, 32, 8, 6, ordered=True)
    assert [c.prefix_group for c in ordered.conversations] == [g for g in range(4) for _ in range(5)]
    # ideal: every prompt but the first of its group reuses the 32-token system prompt
    assert ds.ideal_cached_tokens() == 4 * 4 * 32
    assert ds.summary()["ideal_cache_hit_rate"] == pytest.approx(16 * 32 / (20 * 40))


def test_multi_turn_histories_grow_by_the_previous_turn_and_reply():
    ds = multi_turn_dataset(TokenSampler(5000, seed=2), num_conversations=3, num_turns=4, first_input_len=50,
                            turn_input_len=10, output_len=7)
    assert ds.num_requests == 12
    assert all([t.prompt_len for t in c.turns] == [50, 10, 10, 10] for c in ds.conversations)
    assert ds.prompt_lens() == [[50, 67, 84, 101]] * 3
    assert ds.ideal_cached_tokens() == 3 * (57 + 74 + 91)


def test_render_prompt_concatenates_ids_and_builds_chat_messages():
    class Tok:
        def decode(self, ids):
            return " ".join(map(str, ids))

    segments = [[1, 2], [3], [4, 5]]
    assert serving.render_prompt(segments, serving.NativeBackend(), None) == [1, 2, 3, 4, 5]
    assert serving.render_prompt([[1, 2], "hi", [3]], serving.OpenAICompletionsBackend(), Tok()) == "1 2hi3"
    chat = serving.render_prompt([[1], "reply", [2]], serving.OpenAIChatBackend(), Tok())
    assert chat == [{"role": "user", "content": "1"}, {"role": "assistant", "content": "reply"},
                    {"role": "user", "content": "2"}]
    with pytest.raises(ValueError, match="tokenizer"):
        serving.render_prompt([[1]], serving.OpenAIChatBackend(), None)


def test_jsonl_reads_sharegpt_and_prompt_records(tmp_path):
    class WordTokenizer:
        def encode(self, text, add_special_tokens=False):
            return text.split()

    path = tmp_path / "prompts.jsonl"
    rows = [{"conversations": [{"from": "human", "value": "one two three"}, {"from": "gpt", "value": "a b"},
                               {"from": "human", "value": "four"}, {"from": "gpt", "value": "c d e"}]},
            {"prompt": "five six", "output_len": 9}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    single = jsonl_dataset(str(path), None, WordTokenizer())
    assert [[(t.prompt, t.prompt_len, t.output_len) for t in c.turns] for c in single.conversations] == [
        [("one two three", 3, 2)], [("five six", 2, 9)]]
    multi = jsonl_dataset(str(path), 1, WordTokenizer(), multi_turn=True)
    assert [(t.prompt, t.output_len) for t in multi.conversations[0].turns] == [("one two three", 2), ("four", 3)]
    with pytest.raises(ValueError, match="tokenizer"):
        jsonl_dataset(str(path), None, tokenizer=None)


# --------------------------------------------------------------------------- metrics on a fake timeline


def _record(start, chunks, end=None, ok=True, prompt=100, cached=None):
    """chunks: [(arrival time, tokens so far)]."""
    return RequestRecord(0, 0, start, end if end is not None else chunks[-1][0], [t for t, _ in chunks],
                         [n for _, n in chunks], prompt, chunks[-1][1] if chunks else 0, cached, ok)


def test_per_request_latencies_on_a_fake_timeline():
    # first token 0.5 s after sending, then one at 0.6, then two tokens together at 0.8
    r = _record(10.0, [(10.5, 1), (10.6, 2), (10.8, 4)], end=10.85)
    assert ttft(r) == pytest.approx(0.5)
    assert itls(r) == pytest.approx([0.1, 0.1, 0.1])  # the 0.2 s gap split over its two tokens
    assert tpot(r) == pytest.approx((0.85 - 0.5) / 3)
    assert tpot(_record(0.0, [(0.3, 1)])) is None  # one token: no time per output token
    # OpenAI text streams carry no counts: every chunk is one token
    text = RequestRecord(0, 0, 0.0, 1.0, [0.2, 0.5, 1.0], [None, None, None], 10, 3, None, True)
    assert itls(text) == pytest.approx([0.3, 0.5])


def test_stream_pacing_tells_coalesced_events_from_bunched_reads():
    # events after the first: 2 (1 token), 4 (2 tokens, coalesced by the server), 5 (read with the one before)
    coalesced = _record(0.0, [(0.5, 1), (0.6, 2), (0.8, 4), (0.8, 5)])
    paced = _record(0.0, [(0.5, 1), (0.6, 2), (0.7, 3)])
    p = stream_pacing([coalesced, paced])
    assert p["coalesced_tokens"] == pytest.approx(2 / 6)  # 6 tokens after the first events, 2 came together
    assert p["bunched_events"] == pytest.approx(1 / 5)
    assert stream_pacing([paced]) == {"coalesced_tokens": 0.0, "bunched_events": 0.0}
    assert stream_pacing([_record(0.0, [(0.5, 1)])]) == {"coalesced_tokens": None, "bunched_events": None}
    assert compute_metrics([coalesced, paced], 1.0)["stream_pacing"] == p


def test_aggregate_metrics_percentiles_throughput_and_goodput():
    # ten requests: TTFT 0.1 .. 1.0 s, 11 tokens each, one token every 20 ms (TPOT 20 ms) for the odd
    # ones, every 60 ms for the even ones; one failure
    records = []
    for i in range(10):
        step = 0.02 if i % 2 else 0.06
        first = 0.1 * (i + 1)
        records.append(_record(0.0, [(first + k * step, k + 1) for k in range(11)], prompt=100, cached=25))
    records.append(RequestRecord(0, 0, 0.0, error="HTTP 500"))
    m = compute_metrics(records, duration=4.0, slo_ttft_ms=500, slo_tpot_ms=50)
    assert (m["completed"], m["failed"]) == (10, 1)
    assert m["total_input_tokens"] == 1000 and m["total_output_tokens"] == 110
    assert m["request_throughput"] == pytest.approx(2.5)
    assert m["output_throughput"] == pytest.approx(27.5) and m["total_throughput"] == pytest.approx(277.5)
    ttfts = np.arange(1, 11) * 100.0
    assert m["ttft_ms"]["mean"] == pytest.approx(550)
    assert m["ttft_ms"]["median"] == pytest.approx(550)
    assert m["ttft_ms"]["p90"] == pytest.approx(910)  # linear interpolation: 900 + 0.1 * 100
    assert m["ttft_ms"]["p99"] == pytest.approx(np.percentile(ttfts, 99)) == pytest.approx(991)
    assert m["tpot_ms"]["median"] == pytest.approx(40) and m["tpot_ms"]["p99"] == pytest.approx(60)
    assert m["itl_ms"]["mean"] == pytest.approx(40)
    # SLO TTFT <= 500 ms and TPOT <= 50 ms: requests 1 and 3 (TTFT 0.2, 0.4 s, TPOT 20 ms)
    assert m["goodput"] == pytest.approx(2 / 4.0)
    assert m["slo_attainment"] == pytest.approx(0.2)
    assert compute_metrics(records, 4.0)["goodput"] == pytest.approx(2.5)  # no SLO: every completed request
    assert m["cache_hit_rate_requests"] == pytest.approx(0.25)
    assert m["ttft_ms_by_turn"] is None  # one turn each


def test_ttft_by_turn_of_a_multi_turn_run():
    records = [RequestRecord(conv, turn, 0.0, 1.0, [0.1 * (turn + 1) + 0.01 * conv, 1.0], [1, 2], 10, 2, 0, True)
               for conv in range(3) for turn in range(2)]
    by_turn = compute_metrics(records, duration=1.0)["ttft_ms_by_turn"]
    assert list(by_turn) == ["0", "1"]
    assert by_turn["0"]["median"] == pytest.approx(110) and by_turn["1"]["median"] == pytest.approx(210)


def test_cache_hit_rate_from_server_counters_and_prometheus_gauges():
    assert serving.counters_hit_rate({"prompt_tokens": 100, "cached_tokens": 10},
                                     {"prompt_tokens": 500, "cached_tokens": 310}) == pytest.approx(0.75)
    assert serving.counters_hit_rate(None, {"prompt_tokens": 1, "cached_tokens": 1}) is None
    text = ('# HELP x\nsglang:num_running_reqs{model_name="m"} 7.0\nsglang:num_queue_reqs{model_name="m"} 2.0\n'
            "radixserve:token_usage 0.5\n")
    assert serving.parse_prometheus_gauges(text) == {"running": 7, "waiting": 2, "kv_usage": 0.5}


def test_poisson_arrivals():
    rng = np.random.default_rng(0)
    assert not serving.arrival_offsets(5, math.inf, rng).any()
    t = serving.arrival_offsets(4000, 8.0, rng)
    assert t[0] == 0 and np.all(np.diff(t) >= 0)
    assert np.mean(np.diff(t)) == pytest.approx(1 / 8, rel=0.05)


def test_sse_lines_split_reads_into_lines_stamped_when_their_bytes_came():
    """Events cut across reads come out whole; events of one read share its
    time; a line past aiohttp's 64 KiB line buffer is read too."""
    import asyncio

    long_event = b'data: {"text": "' + b"x" * 200_000 + b'"}\n\n'
    reads = [b'data: {"a": 1}\n\ndata: {"b"', b': 2}\n\n', long_event[:70_000], long_event[70_000:], b"data: [DONE]"]

    class Content:
        async def iter_any(self):
            for data in reads:
                await asyncio.sleep(0.01)
                yield data

    class Resp:
        content = Content()

    async def collect():
        return [item async for item in serving._sse_lines(Resp())]

    lines = asyncio.run(collect())
    assert [line for line, _ in lines if line] == ['data: {"a": 1}', 'data: {"b": 2}', long_event.decode().strip(),
                                                     "data: [DONE]"]
    times = {line[:11]: t for line, t in lines if line}
    assert times['data: {"a": 1}'[:11]] < times['data: {"b": 2}'[:11]]  # "b" ended in the second read
    first_read = [t for line, t in lines[:2]]
    assert first_read[0] == first_read[1]  # "a" and its blank line came in one read


# --------------------------------------------------------------------------- against a real server


TINY = ("--model-path", "tiny-llama", "--max-total-tokens", "4096")


@pytest.fixture(scope="module")
def servers():
    """``server`` and one with --incremental-streaming-output, started side by side."""
    from tests.server_harness import start_all

    started = start_all(TINY, (*TINY, "--incremental-streaming-output"))
    try:
        yield started
    finally:
        for srv in started:
            srv.stop()


@pytest.fixture(scope="module")
def server(servers):
    return servers[0]


def _run(server, tmp_path, name, *args):
    out = tmp_path / f"{name}.json"
    rc = serving.main(["--base-url", server.url, "--disable-tqdm", "--output-json", str(out), *args])
    return rc, json.loads(out.read_text())


def test_random_run_at_two_rates_completes_without_failures(server, tmp_path, capsys):
    rc, out = _run(server, tmp_path, "random", "--num-prompts", "12", "--random-input-len", "48",
                   "--random-output-len", "48", "--random-range-ratio", "0.5", "--request-rate", "20", "inf",
                   "--poll-interval", "0.05", "--slo-ttft", "60000", "--plot", "--save-requests")
    assert rc == 0
    assert [r["request_rate"] for r in out["runs"]] == [20.0, "inf"]
    for run in out["runs"]:
        assert (run["completed"], run["failed"]) == (12, 0)
        assert run["total_input_tokens"] == out["dataset"]["prompt_tokens"]  # as the server counted them
        assert run["total_output_tokens"] == out["dataset"]["output_tokens"]  # ignore_eos: exact lengths
        assert 0 < run["ttft_ms"]["median"] <= run["e2e_ms"]["median"]
        assert run["itl_ms"]["p99"] is not None and run["goodput"] == pytest.approx(run["request_throughput"])
    assert out["server"]["model"] == "tiny-llama"
    serving_report.main([str(tmp_path / "random.json")])  # the scripts' one-line summaries
    lines = capsys.readouterr().out.strip().splitlines()[-2:]
    assert [line.split()[0] for line in lines] == ["random.json"] * 2 and "rate 20.0  ok 12/12" in lines[0]
    assert (tmp_path / "random-latency.png").stat().st_size > 0 and (tmp_path / "random-rates.png").exists()
    # the saved timelines reproduce the figures, and --compare draws them again without a server
    saved = [RequestRecord(**d) for d in out["runs"][1]["requests"]]
    # all at once: they stream tokens at the same time, so they share decode batches (the
    # server's own running count is sampled every half second and can miss so short a run)
    streaming = [(r.chunk_times[0], r.end) for r in saved]
    assert max(sum(a <= t < b for a, b in streaming) for t, _ in streaming) > 1
    again = compute_metrics(saved, out["runs"][1]["duration_s"])
    assert again["ttft_ms"] == pytest.approx(out["runs"][1]["ttft_ms"], abs=0.2)
    assert serving.main(["--compare", str(tmp_path / "random.json"), "--plot", str(tmp_path / "again")]) == 0
    assert (tmp_path / "again-compare.png").exists() and (tmp_path / "again-latency.png").exists()  # two rates


def test_shared_prefix_run_one_at_a_time_hits_the_ideal(server, tmp_path):
    rc, out = _run(server, tmp_path, "gsp", "--dataset-name", "generated-shared-prefix", "--gsp-num-groups", "3",
                   "--gsp-prompts-per-group", "3", "--gsp-system-prompt-len", "64", "--gsp-question-len", "8",
                   "--gsp-output-len", "4", "--max-concurrency", "1")
    run = out["runs"][0]
    assert rc == 0 and (run["completed"], run["failed"]) == (9, 0)
    assert run["ideal_cache_hit_rate"] == pytest.approx(6 * 64 / (9 * 72))
    # sequential requests: each group's second and third prompts find the system prompt cached
    assert run["cache_hit_rate_requests"] == pytest.approx(run["ideal_cache_hit_rate"])


def test_multi_turn_run_resends_the_growing_history(server, tmp_path):
    rc, out = _run(server, tmp_path, "mt", "--dataset-name", "multi-turn", "--num-prompts", "3",
                   "--mt-num-turns", "3", "--mt-first-input-len", "40", "--mt-turn-input-len", "8",
                   "--mt-output-len", "5", "--request-rate", "50")
    run = out["runs"][0]
    assert rc == 0 and (run["completed"], run["failed"]) == (9, 0)
    # prompts of 40, 53, 66 tokens per conversation: the history came back to the server
    assert run["total_input_tokens"] == 3 * (40 + 53 + 66)
    # each later turn reuses the earlier turns; at most the reply's last token is not cached yet
    ideal = run["ideal_cache_hit_rate"]
    assert ideal - 6 / run["total_input_tokens"] - 1e-9 <= run["cache_hit_rate_requests"] <= ideal + 1e-9


def test_multi_turn_histories_are_exact_from_a_server_that_streams_what_is_new(servers, tmp_path):
    """With --incremental-streaming-output the client adds up each reply's
    new output_ids (it reads the flag from /get_server_info), so every later
    turn resends the exact history, as from a cumulative server."""
    srv = servers[1]
    try:
        rc, out = _run(srv, tmp_path, "mt-incremental", "--dataset-name", "multi-turn", "--num-prompts", "2",
                       "--mt-num-turns", "3", "--mt-first-input-len", "40", "--mt-turn-input-len", "8",
                       "--mt-output-len", "5", "--request-rate", "50")
    finally:
        srv.stop()
    run = out["runs"][0]
    assert rc == 0 and (run["completed"], run["failed"]) == (6, 0)
    assert run["total_input_tokens"] == 2 * (40 + 53 + 66)  # only the last event's ids would give 40 + 49 + 58
    assert run["total_output_tokens"] == 6 * 5


def test_server_counters_agree_with_per_request_cached_tokens(server, tmp_path):
    rc, out = _run(server, tmp_path, "counters", "--dataset-name", "generated-shared-prefix", "--gsp-num-groups",
                   "2", "--gsp-prompts-per-group", "2", "--gsp-system-prompt-len", "32", "--gsp-question-len", "4",
                   "--gsp-output-len", "2", "--max-concurrency", "1")
    run = out["runs"][0]
    assert run["cache_hit_rate_requests"] > 0
    assert run["cache_hit_rate"] == pytest.approx(run["cache_hit_rate_requests"])


def test_openai_backend_and_failures_are_reported(server, tmp_path):
    rc, out = _run(server, tmp_path, "openai", "--backend", "openai", "--num-prompts", "4",
                   "--random-input-len", "16", "--random-output-len", "4", "--random-range-ratio", "1")
    run = out["runs"][0]
    assert rc == 0 and (run["completed"], run["failed"]) == (4, 0) and run["total_output_tokens"] == 16
    # a prompt past the context window (2048) is refused: counted as failed, the run goes on
    rc, out = _run(server, tmp_path, "too-long", "--num-prompts", "2", "--random-input-len", "3000",
                   "--random-output-len", "4", "--random-range-ratio", "1", "--warmup-requests", "0")
    assert rc == 1 and (out["runs"][0]["completed"], out["runs"][0]["failed"]) == (0, 2)
