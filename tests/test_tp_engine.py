"""Tensor parallelism through the offline Engine (CPU, gloo, fp32): the
scheduler ranks take the same decisions and produce tp 1's tokens, with
chunked prefill, cache hits, retraction, seeded sampling with penalties and
structured output; bad configurations fail at start-up with a clear error."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

import radixserve

TINY = dict(model_path="tiny-llama", load_format="dummy", device="cpu", dtype="float32", disable_tqdm=True,
            check_invariants=True, dist_timeout=60)
SHARED = [7, 3, 99, 12, 54, 8, 31, 2, 77, 15, 41, 5]  # a prefix the later prompts find in the cache


def _prompts() -> list[list[int]]:
    tails = [[1, 5, 9, 33, 70, 2, 8, 11, 19], [4, 4, 100, 7], [250, 3], list(range(60, 90)), [9] * 21]
    return [SHARED + t if i % 2 else t for i, t in enumerate(tails)]


def _run(tp: int, **options) -> tuple[list[list[int]], list[list[int]], dict]:
    """(greedy outputs, seeded outputs with penalties, the scheduler's stats)."""
    greedy = [{"temperature": 0, "max_new_tokens": n, "ignore_eos": True} for n in (12, 30, 5, 24, 17)]
    seeded = [{**p, "temperature": 0.9, "top_p": 0.9, "sampling_seed": 11 + i, "repetition_penalty": 1.2,
               "frequency_penalty": 0.3} for i, p in enumerate(greedy)]
    with radixserve.Engine(**{**TINY, **options}, tp_size=tp) as eng:
        eng.generate(input_ids=SHARED + [1], sampling_params={"max_new_tokens": 1})  # cache the shared prefix
        out = [o["output_ids"] for o in eng.generate(input_ids=_prompts(), sampling_params=greedy)]
        sampled = [o["output_ids"] for o in eng.generate(input_ids=_prompts(), sampling_params=seeded)]
        return out, sampled, eng.get_stats()


CHUNKED = dict(chunked_prefill_size=8, max_total_tokens=2048, max_running_requests=8)


@pytest.fixture(scope="module")
def tp1_chunked():
    """tp 1's greedy and seeded outputs with ``CHUNKED``."""
    return _run(1, **CHUNKED)[:2]


@pytest.mark.parametrize("tp", [2, 4])  # tiny-llama has 2 KV heads: at tp 4 each is replicated on 2 ranks
def test_tp_engine_matches_tp1_with_chunks_cache_hits_and_sampling(tp1_chunked, tp):
    ref_greedy, ref_sampled = tp1_chunked
    greedy, sampled, stats = _run(tp, **CHUNKED)
    assert greedy == ref_greedy
    assert sampled == ref_sampled
    assert stats["cached_tokens"] >= 2 * len(SHARED), "the shared prefix was found in the cache"


def test_tp_engine_matches_tp1_under_retraction():
    """A pool too small for every request's output: requests are retracted
    and re-prefilled on every rank alike."""
    prompts = [[(7 * i + j) % 500 for j in range(n)] for i, n in enumerate([20, 25, 18, 30, 22, 16])]
    params = {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}
    runs = []
    for tp in (1, 2):
        with radixserve.Engine(**TINY, tp_size=tp, max_total_tokens=160, max_running_requests=8) as eng:
            runs.append(([o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=params)],
                         eng.get_stats()["retractions"]))
    assert runs[0][1] > 0 and runs[1][1] == runs[0][1]
    assert runs[1][0] == runs[0][0]


def test_tp_engine_with_the_host_tier_matches_tp1_without_it():
    """The hierarchical cache at tp 2, under a device pool smaller than the
    prompts' shared prefixes: each rank backs up and loads back its own KV
    heads, a copy finishes when it has on every rank, and the tokens are tp
    1's without the tiers."""
    heads = [[(31 * g + 7 * j) % 400 for j in range(48)] for g in range(5)]
    prompts = [h + [(g + 5 * i) % 400 for i in range(6)] for visit in range(2) for g, h in enumerate(heads)]
    params = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
    outs = {}
    for tp, tiers in ((1, False), (2, True)):
        with radixserve.Engine(**TINY, tp_size=tp, max_total_tokens=160, max_running_requests=4,
                               enable_hierarchical_cache=tiers, hicache_ratio=4) as eng:
            outs[tp] = [eng.generate(input_ids=[p], sampling_params=params)[0]["output_ids"] for p in prompts]
            stats = eng.get_stats()
    assert outs[2] == outs[1]
    assert stats["hicache_loaded_back"] > 0


def test_tp_engine_restarted_on_the_file_tier_serves_prefixes_from_files(tmp_path):
    """Each rank writes and reads the files of its own KV heads; a new tp-2
    engine on the same directory finds every prompt's 64-token block on file
    on both ranks, and its tokens are tp 1's without the tiers."""
    prompts = [[(17 * g + 5 * j) % 400 for j in range(64)] + [g, 3, 9, g + 1] for g in range(4)]
    params = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
    tier = dict(enable_hierarchical_cache=True, hicache_ratio=4, hicache_storage_backend="file",
                hicache_storage_dir=str(tmp_path))
    with radixserve.Engine(**TINY, max_total_tokens=512) as eng:
        ref = [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=params)]
    with radixserve.Engine(**TINY, tp_size=2, max_total_tokens=512, **tier) as eng:
        eng.generate(input_ids=prompts, sampling_params=params)
        followers = eng.scheduler.processes
    # Closing asked rank 1 to close too (its writes land) rather than killing it.
    assert [p.exitcode for p in followers] == [0]
    for rank in (0, 1):
        files = list(tmp_path.glob(f"*-tp{rank}of2-*/*/*.kv"))
        assert len(files) == 4, f"rank {rank} wrote {len(files)} blocks"
    with radixserve.Engine(**TINY, tp_size=2, max_total_tokens=512, **tier) as eng:
        outs = eng.generate(input_ids=prompts, sampling_params=params)
        stats = eng.get_stats()
    assert [o["output_ids"] for o in outs] == ref
    assert [o["meta_info"]["cached_tokens"] for o in outs] == [64] * 4
    assert stats["hicache_storage_prefetched"] == 4 * 64


# SmolLM2 at tp 1 and tp 3, for the two tests below: each engine is built once
SMOLLM2 = dict(device="cpu", max_total_tokens=4096, max_running_requests=4, chunked_prefill_size=16,
               check_invariants=True, disable_tqdm=True, dist_timeout=120)
CHATS = ["What is the capital of France?", "Name three primary colors.", "Write a haiku about the sea."]
CITY = '{"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}'
SMOLLM2_GREEDY = {"temperature": 0, "max_new_tokens": 24}
FRANCE_GREEDY = {"temperature": 0, "max_new_tokens": 12}


def _structured(eng) -> tuple:
    """The chat prompts' greedy tokens in one batch, and the first's JSON-schema request's tokens and text."""
    prompts = [eng.apply_chat_template([{"role": "user", "content": c}]) for c in CHATS]
    texts = [o["output_ids"] for o in eng.generate(prompts, SMOLLM2_GREEDY)]
    js = eng.generate(prompts[0], {**SMOLLM2_GREEDY, "json_schema": CITY})
    return texts, js["output_ids"], js["text"]


@pytest.fixture(scope="module")
def smollm2_tp1():
    """tp 1's outputs: ``_structured``'s, and the first chat prompt's alone (``FRANCE_GREEDY``)."""
    with radixserve.Engine(**SMOLLM2) as eng:
        alone = eng.generate(eng.apply_chat_template([{"role": "user", "content": CHATS[0]}]), FRANCE_GREEDY)
        return {"structured": _structured(eng), "alone": alone["output_ids"]}


@pytest.fixture(scope="class")  # a plain function: pytest deprecates class-scoped fixtures that are methods
def smollm2_tp3():
    """One tp-3 engine for the class below's tests (its rank 0 is this
    process's: it is shut down after them, before other tests start engines
    of their own)."""
    with radixserve.Engine(**SMOLLM2, tp_size=3) as eng:
        yield eng


@pytest.mark.slow
class TestSmolLM2AtTp3:
    """SmolLM2 at tp 3, both tests on one engine (``smollm2_tp3``)."""

    def test_smollm2_at_tp3_matches_tp1_with_structured_output(self, smollm2_tp1, smollm2_tp3):
        """SmolLM2-135M has 9 query and 3 KV heads: tp 3 splits both. Chat
        prompts give tp 1's greedy tokens; a JSON-schema request (whose grammar
        each rank compiles; rank 0 decides when it is ready) gives the same JSON."""
        out = _structured(smollm2_tp3)
        assert out == smollm2_tp1["structured"]
        assert '"city"' in out[2]

    def test_a_stop_regex_timeout_on_rank_0_ends_the_request_on_every_rank(self, smollm2_tp1, smollm2_tp3,
                                                                           monkeypatch):
        """The stop_regex time limit is measured on each rank; rank 0's verdict
        holds everywhere. Here every search on rank 0 (this process) runs out of
        time and none on the other ranks: the request ends after its first token
        on every rank, and the next request runs as at tp 1."""
        from radixserve.sampling import stop_regex

        eng = smollm2_tp3
        prompt = eng.apply_chat_template([{"role": "user", "content": CHATS[0]}])
        monkeypatch.setattr(stop_regex, "MATCH_TIMEOUT_S", 1e-9)  # rank 0 only: the others are processes of their own
        out = eng.generate(prompt, {**FRANCE_GREEDY, "stop_regex": [r"\d+"]})
        monkeypatch.undo()
        assert out["meta_info"]["finish_reason"]["type"] == "abort" and len(out["output_ids"]) == 1
        assert "stop_regex" in out["meta_info"]["finish_reason"]["message"]
        assert eng.generate(prompt, FRANCE_GREEDY)["output_ids"] == smollm2_tp1["alone"]


def test_a_model_tp_does_not_split_fails_at_start_up():
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="num_attention_heads 4 is not divisible by tp_size 3"):
        radixserve.Engine(**TINY, tp_size=3)
    assert time.monotonic() - t0 < 60


def test_a_script_without_a_main_guard_fails_at_once_saying_why(tmp_path):
    """Rank 1's process imports the script again and stops while it starts;
    rank 0 says so at once instead of waiting --dist-timeout at its rendezvous."""
    script = tmp_path / "no_main_guard.py"
    script.write_text("import radixserve\n\n"
                      f"radixserve.Engine(**{dict(TINY, dist_timeout=600)!r}, tp_size=2)\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert "scheduler-tp1 exited during start-up" in done.stderr and 'if __name__ == "__main__":' in done.stderr


def test_an_unusable_init_address_fails_at_start_up():
    """An address that is not this host's: rank 0 cannot listen there, and
    once --dist-timeout has passed it says where it tried."""
    with pytest.raises(RuntimeError, match="203.0.113.1:29500"):
        radixserve.Engine(**{**TINY, "dist_timeout": 5}, tp_size=2, dist_init_addr="203.0.113.1:29500")


def test_tp_flags_are_checked():
    with pytest.raises(ValueError, match="tp_size 3 is not divisible by nnodes 2"):
        radixserve.Engine(**TINY, tp_size=3, nnodes=2, dist_init_addr="127.0.0.1:29500")
    with pytest.raises(ValueError, match="dist_init_addr must be host:port"):
        radixserve.Engine(**TINY, tp_size=2, dist_init_addr="nowhere")
    with pytest.raises(ValueError, match="tp_size must be >= 1"):
        radixserve.Engine(**TINY, tp_size=0)
