"""SGLang's ``/release_memory_occupation`` and ``/resume_memory_occupation``
(``--enable-memory-saver``) on the CPU: greedy outputs identical before and
after a round trip (tp 1, tp 2 over gloo, tied embeddings), the weights
bit for bit; the resident memory of the process that holds the weights and
the KV falls at release and comes back at resume; the refusals (unknown or
unreleasable tags, requests running) are clear answers; a server holds the
requests sent while released and runs them after resume."""

from __future__ import annotations

import os
import threading

import httpx
import pytest
import torch

import radixserve
from server_harness import ServerProcess, wait_for

TINY = dict(model_path="tiny-llama", load_format="dummy", device="cpu", dtype="float32", disable_tqdm=True,
            check_invariants=True, dist_timeout=60)
SAVER = dict(enable_memory_saver=True, elastic_kv_page_mb=0.004, elastic_kv_min_reserve_pages=0,
             elastic_kv_max_reserve_pages=1, max_total_tokens=4096, chunked_prefill_size=16)
PROMPTS = [[1, 5, 9, 33, 70, 2, 8, 11, 19], [4, 4, 100, 7], list(range(60, 150)), [9] * 41]
PARAMS = [{"temperature": 0, "max_new_tokens": n, "ignore_eos": True} for n in (12, 30, 5, 24)]
# 107 MB of float32 weights and 16 KB of KV a token: large enough to see in RssAnon
BIG = '{"hidden_size": 1024, "intermediate_size": 2816, "num_attention_heads": 8, "num_key_value_heads": 8, "head_dim": 128}'
MB = 1 << 20


def _greedy(eng) -> list[list[int]]:
    return [o["output_ids"] for o in eng.generate(input_ids=PROMPTS, sampling_params=PARAMS)]


def rss_anon(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("RssAnon:"))


@pytest.mark.parametrize("options", [dict(), dict(tp_size=2), dict(model_path="tiny-qwen2")],
                         ids=["tp1", "tp2", "tied-embeddings"])
def test_greedy_outputs_are_the_same_after_a_round_trip(options):
    with radixserve.Engine(**{**TINY, **options}, max_total_tokens=4096) as eng:
        expected = _greedy(eng)  # without the memory saver (on a CPU: with prepacked weights)
    with radixserve.Engine(**{**TINY, **SAVER, **options}) as eng:
        weights = {k: v.clone() for k, v in eng.scheduler.model_runner.model.state_dict().items()}
        assert _greedy(eng) == expected
        state = eng.release_memory_occupation()
        assert state == {"memory_saver": True, "memory_released": ["kv_cache", "weights"], "weights_mapped_bytes": 0}
        assert eng.get_stats()["elastic_kv_mapped_bytes"] == 0 and eng.get_stats()["kv_cached"] == 0
        with pytest.raises(RuntimeError, match="resume_memory_occupation"):  # nothing would ever resume it
            eng.generate(input_ids=PROMPTS[0], sampling_params=PARAMS[0])
        assert eng.resume_memory_occupation()["memory_released"] == []
        assert _greedy(eng) == expected
        # One tag at a time, each twice: the second call changes nothing (SGLang's resume would raise).
        for tag in ("weights", "kv_cache"):
            assert eng.release_memory_occupation([tag])["memory_released"] == eng.release_memory_occupation([tag])[
                "memory_released"]
        assert eng.resume_memory_occupation(["kv_cache"])["memory_released"] == ["weights"]
        assert eng.resume_memory_occupation([])["memory_released"] == []  # empty: all, as SGLang
        assert eng.resume_memory_occupation()["memory_released"] == []
        assert _greedy(eng) == expected
        assert all(torch.equal(v, weights[k]) for k, v in eng.scheduler.model_runner.model.state_dict().items())


def test_release_gives_the_weights_and_the_kv_back_to_the_machine():
    """The Engine's process holds both: its RssAnon falls by the KV's mapped
    pages at a ``kv_cache`` release, by the weights at a ``weights`` release
    (their host copy is a temporary file), and the weights come back at resume."""
    with radixserve.Engine(**{**TINY, "check_invariants": False}, json_model_override_args=BIG,
                           enable_memory_saver=True, max_total_tokens=8192, chunked_prefill_size=1024) as eng:
        prompts = [[(13 * i + j) % 500 + 3 for j in range(600)] for i in range(4)]
        params = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}
        before = [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=params)]
        kv = eng.get_stats()["elastic_kv_mapped_bytes"]  # the prompts stay cached
        weights = eng.scheduler.memory_occupation()["weights_mapped_bytes"]
        assert kv >= 32 * MB and weights >= 100 * MB
        pid = os.getpid()
        rss = rss_anon(pid)
        eng.release_memory_occupation(["kv_cache"])
        released_kv = rss_anon(pid)
        assert rss - released_kv >= kv - 4 * MB
        eng.release_memory_occupation(["weights"])
        released = rss_anon(pid)
        assert released_kv - released >= weights - 4 * MB
        eng.resume_memory_occupation()
        assert rss_anon(pid) - released >= weights
        assert [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=params)] == before


def test_what_cannot_be_released_is_a_clear_error():
    with radixserve.Engine(**TINY, max_total_tokens=512) as eng:  # a static pool, weights where they were loaded
        for tags in (None, ["kv_cache"]):
            with pytest.raises(ValueError, match="^tags: kv_cache .*--enable-memory-saver"):
                eng.release_memory_occupation(tags)
        with pytest.raises(ValueError, match="^tags: weights .*--enable-memory-saver"):
            eng.resume_memory_occupation(["weights"])
    with radixserve.Engine(**TINY, max_total_tokens=512, enable_elastic_kv=True) as eng:  # KV releasable, not weights
        with pytest.raises(ValueError, match="^tags: weights"):
            eng.release_memory_occupation()
        with pytest.raises(ValueError, match="^tags: unknown tag 'cuda_graph'"):
            eng.release_memory_occupation(["kv_cache", "cuda_graph"])
        assert eng.scheduler.offload_tags == set()  # a refused call releases nothing
        expected = _greedy(eng)
        assert eng.release_memory_occupation(["kv_cache"])["memory_released"] == ["kv_cache"]
        assert eng.get_stats()["elastic_kv_mapped_bytes"] == 0
        eng.resume_memory_occupation(["kv_cache"])
        assert _greedy(eng) == expected


def test_release_is_refused_while_requests_run():
    """SGLang asserts that the server is idle; here the call is refused and
    the requests finish as if it had not been made."""
    with radixserve.Engine(**TINY, **SAVER) as eng:
        expected = _greedy(eng)
        assert eng.flush_cache()
        sched = eng.scheduler
        reqs = [r for ids, p in zip(PROMPTS, PARAMS) for r in eng._make_reqs(ids, p, False, -1, 0, None)]
        for req in reqs:
            sched.add_request(req)
        while len(sched.running_batch.reqs) < 2:
            sched.step()
        for tags in (None, ["weights"], ["kv_cache"]):
            with pytest.raises(ValueError, match="while requests are running"):
                eng.release_memory_occupation(tags)
        while not all(r.finished() for r in reqs):
            sched.step()
        assert [r.output_ids for r in reqs] == expected
        assert eng.release_memory_occupation()["memory_released"] == ["kv_cache", "weights"]


@pytest.mark.slow
def test_a_server_holds_requests_while_released_and_runs_them_after_resume():
    """As an RL framework drives SGLang between rollouts: release (the
    scheduler's resident memory falls by the weights and the KV), requests
    sent meanwhile wait (an abort still ends one), resume (the memory comes
    back) and they finish with the tokens they have without the round trip."""
    srv = ServerProcess("--model-path", "tiny-llama", "--load-format", "dummy", "--device", "cpu",
                        "--json-model-override-args", BIG, "--max-total-tokens", "8192", "--enable-memory-saver")
    try:
        pid = srv.children()["scheduler"]
        prompts = [[(7 * i + j) % 500 + 3 for j in range(300)] for i in range(4)]

        def generate(ids: list[int], out: list) -> None:
            body = {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}}
            reply = httpx.post(srv.url + "/generate", json=body, timeout=300)
            out.append((reply.status_code, reply.json()["output_ids"]))

        def rollout() -> tuple[list[threading.Thread], list[list]]:
            outs = [[] for _ in prompts]
            threads = [threading.Thread(target=generate, args=(p, o)) for p, o in zip(prompts, outs)]
            for t in threads:
                t.start()
            return threads, outs

        threads, outs = rollout()
        for t in threads:
            t.join()
        expected = [o[0] for o in outs]
        state = srv.wait_idle()
        assert state["memory_released"] == [] and state["memory_saver"] and state["memory_check"] == "ok"
        weights, kv = state["weights_mapped_bytes"], state["elastic_kv_mapped_bytes"]

        for path in ("/release_memory_occupation", "/resume_memory_occupation"):
            for body, field in [({"tags": ["kv_cache", "nope"]}, "tags"), ({"tags": "weights"}, "tags"),
                                ({"tag": ["weights"]}, "tag"), ([1], "body")]:
                reply = httpx.post(srv.url + path, json=body, timeout=30)
                assert reply.status_code == 400 and reply.json()["error"]["param"] == field, (path, body, reply.text)
        assert srv.state()["memory_released"] == []

        rss = rss_anon(pid)
        reply = httpx.post(srv.url + "/release_memory_occupation", json={"tags": None}, timeout=120)
        assert reply.status_code == 200 and reply.json()[0]["memory_released"] == ["kv_cache", "weights"]
        assert rss - rss_anon(pid) >= weights + kv - 8 * MB
        state = srv.state()
        assert state["weights_mapped_bytes"] == 0 and state["elastic_kv_mapped_bytes"] == 0
        assert httpx.post(srv.url + "/release_memory_occupation", timeout=30).status_code == 200  # again: no change

        threads, outs = rollout()
        aborted = []
        body = {"input_ids": prompts[0], "rid": "held-then-aborted", "sampling_params": {"max_new_tokens": 8}}
        abortee = threading.Thread(target=lambda: aborted.append(httpx.post(srv.url + "/generate", json=body,
                                                                             timeout=60).text))
        abortee.start()
        wait_for(lambda: srv.state()["waiting"] == len(prompts) + 1, 60, "every request queued while released")
        assert not any(outs) and not aborted  # held, not failed
        assert httpx.post(srv.url + "/abort_request", json={"rid": "held-then-aborted"}, timeout=10).status_code == 200
        abortee.join(timeout=30)
        assert "aborted by request" in aborted[0] and srv.state()["waiting"] == len(prompts)  # aborts still end them
        released = rss_anon(pid)
        reply = httpx.post(srv.url + "/resume_memory_occupation", json={"tags": ["weights", "kv_cache"]}, timeout=120)
        assert reply.status_code == 200 and reply.json()[0]["memory_released"] == []
        for t in threads:
            t.join()
        assert [o[0] for o in outs] == expected and all(status == 200 for status, _ in expected)
        assert rss_anon(pid) - released >= weights
        assert srv.wait_idle()["memory_check"] == "ok"
    finally:
        assert srv.stop() == 0
