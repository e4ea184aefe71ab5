"""Pipeline parallelism through the offline Engine and the HTTP server (CPU,
gloo, fp32): every stage's scheduler takes the same decisions, and pp 2 (also
with tp 2, and with one micro-batch at a time) produces pp 1's tokens and
logprobs with chunked prefill, cache hits, seeded sampling, retraction and
aborts; SmolLM2 at pp 3 produces HF's greedy tokens; a killed stage ends every
request and the server; what stages do not combine with fails at start-up."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

import radixserve
from server_harness import Prestarted
from test_engine import hf_greedy, llama, prompts, tiny  # noqa: F401 (fixtures)
from test_faults import check_a_killed_rank_ends_everything, killed_rank_args

TINY = dict(model_path="tiny-llama", load_format="dummy", device="cpu", dtype="float32", disable_tqdm=True,
            check_invariants=True, dist_timeout=60)
SHARED = [7, 3, 99, 12, 54, 8, 31, 2, 77, 15, 41, 5]  # a prefix the later prompts find in the cache
TAILS = [[1, 5, 9, 33, 70, 2, 8, 11, 19], [4, 4, 100, 7], [250, 3], list(range(60, 90)), [9] * 21, [13, 17, 19]]
PROMPTS = [t if i % 2 else SHARED + t for i, t in enumerate(TAILS)]
GREEDY = [{"temperature": 0, "max_new_tokens": n, "ignore_eos": True} for n in (12, 30, 5, 24, 17, 9)]
SEEDED = [{**p, "temperature": 0.9, "top_p": 0.9, "sampling_seed": 11 + i, "repetition_penalty": 1.2,
           "frequency_penalty": 0.3} for i, p in enumerate(GREEDY)]


PP2 = ("--model-path", "tiny-llama", "--load-format", "dummy", "--device", "cpu", "--dtype", "float32",
       "--max-total-tokens", "4096", "--pp-size", "2")
VICTIMS = ["scheduler", "scheduler-pp1"]  # the processes' names: the first and the second stage


@pytest.fixture(scope="module", autouse=True)
def servers(request, tmp_path_factory):
    """The HTTP servers of the module's last tests (those selected), started
    one after another in the background with its first test: they load
    while the engine tests run. ``serve``, and one to kill for each of
    ``VICTIMS`` (a TMPDIR of its own each)."""
    def wanted(name: str, victim: str | None = None) -> bool:
        return any(item.originalname == name and (victim is None or item.callspec.params["victim"] == victim)
                   for item in request.session.items if item.module is request.module)

    specs = {}
    if wanted("test_pp2_server_serves_pp1_tokens_and_reports_its_stages"):
        specs["serve"] = ((*PP2, "--check-invariants", "--chunked-prefill-size", "8"), {})
    for victim in VICTIMS:
        if wanted("test_a_killed_stage_ends_every_request_and_the_server", victim):
            specs[victim] = (killed_rank_args(PP2), {"env": {"TMPDIR": str(tmp_path_factory.mktemp("ipc"))}})
    started = Prestarted(specs)
    yield started
    started.stop()


def _run(**options) -> dict:
    """Greedy and seeded outputs, logprobs and the scheduler's stats of one engine."""
    with radixserve.Engine(**{**TINY, **options}) as eng:
        eng.generate(input_ids=SHARED + [1], sampling_params={"max_new_tokens": 1})  # cache the shared prefix
        greedy = eng.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        sampled = eng.generate(input_ids=PROMPTS, sampling_params=SEEDED)
        logprobs = eng.generate(input_ids=PROMPTS[:3], sampling_params=GREEDY[:3], return_logprob=True,
                                logprob_start_len=2, top_logprobs_num=3)
        return {"greedy": [o["output_ids"] for o in greedy], "sampled": [o["output_ids"] for o in sampled],
                "logprobs": [{k: o["meta_info"][k] for k in ("input_token_logprobs", "input_top_logprobs",
                                                             "output_token_logprobs", "output_top_logprobs")}
                             for o in logprobs],
                "cached": [o["meta_info"]["cached_tokens"] for o in greedy], "stats": eng.get_stats()}


@pytest.fixture(scope="module")
def pp1():
    return _run(chunked_prefill_size=8, max_total_tokens=2048, max_running_requests=8)


def _close(a, b) -> bool:
    """Equal structures, floats within 1e-5 (the stages' sums are float32 as pp 1's, in another order)."""
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) <= 1e-5
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    return a == b


@pytest.mark.parametrize("options", [dict(pp_size=2), dict(pp_size=2, pp_micro_batches=1),
                                     dict(pp_size=2, pp_micro_batches=3)],
                         ids=["pp2", "pp2-one-batch-at-a-time", "pp2-three-micro-batches"])
def test_pp_engine_matches_pp1_with_chunks_cache_hits_sampling_and_logprobs(pp1, options):
    out = _run(chunked_prefill_size=8, max_total_tokens=2048, max_running_requests=8, **options)
    assert out["greedy"] == pp1["greedy"]
    assert out["sampled"] == pp1["sampled"]
    assert _close(out["logprobs"], pp1["logprobs"])
    assert out["cached"] == pp1["cached"] and sum(out["cached"]) >= 3 * len(SHARED), "the shared prefix was reused"


def _check_pp2_against_hf(folder, hf, tp: int = 1) -> None:
    batch = prompts([9, 30, 17, 4], seed=3, shared=range(40, 56))
    with radixserve.Engine(model_path=folder, device="cpu", pp_size=2, tp_size=tp, check_invariants=True,
                           disable_tqdm=True, max_total_tokens=2048, max_running_requests=8, chunked_prefill_size=16,
                           dist_timeout=60) as eng:
        outs = eng.generate(input_ids=batch, sampling_params={"temperature": 0, "max_new_tokens": 12, "ignore_eos": True})
    assert [o["output_ids"] for o in outs] == [hf_greedy(hf, ids, 12) for ids in batch]


def test_pp2_engine_matches_hf(tiny):
    """Greedy tokens equal HF's on its own checkpoint (Llama, Qwen2, Qwen3
    with its tied LM head on the last stage), a shared prefix hit in one batch."""
    _check_pp2_against_hf(*tiny)


def test_pp2_with_pages_and_mixed_chunks_matches_pp1():
    """Pages of 4 tokens, and decodes riding in prefill chunks (each
    micro-batch's running requests ride its own chunks)."""
    options = dict(chunked_prefill_size=8, max_total_tokens=2048, max_running_requests=8, page_size=4,
                   enable_mixed_chunk=True)
    ref, out = _run(**options), _run(**options, pp_size=2)
    assert out["greedy"] == ref["greedy"] and out["sampled"] == ref["sampled"]
    assert _close(out["logprobs"], ref["logprobs"]) and out["cached"] == ref["cached"]


@pytest.mark.slow
def test_pp2_tp2_engine_matches_hf(llama):
    _check_pp2_against_hf(*llama, tp=2)


@pytest.mark.slow
def test_pp2_tp2_engine_matches_pp1(pp1):
    """Four ranks: two stages of two TP ranks each; each TP rank passes its
    hidden states to its counterpart on the next stage."""
    out = _run(chunked_prefill_size=8, max_total_tokens=2048, max_running_requests=8, pp_size=2, tp_size=2)
    assert out["greedy"] == pp1["greedy"] and out["sampled"] == pp1["sampled"]


def test_pp2_engine_matches_pp1_under_retraction():
    """A pool too small for every request's output: micro-batches retract
    their own requests, every stage alike, and the tokens do not change."""
    prompts = [[(7 * i + j) % 500 for j in range(n)] for i, n in enumerate([20, 25, 18, 30, 22, 16])]
    params = {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}
    runs = []
    for pp in (1, 2):
        with radixserve.Engine(**TINY, pp_size=pp, max_total_tokens=160, max_running_requests=8) as eng:
            runs.append(([o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=params)],
                         eng.get_stats()["retractions"]))
    assert runs[0][1] > 0 and runs[1][1] > 0
    assert runs[1][0] == runs[0][0]


def test_pp2_engine_aborts_mid_flight_and_returns_the_memory(pp1):
    """Streams closed while their micro-batches are in the pipeline: the
    requests end on every stage, their KV comes back (the invariant is
    checked after every step), and the next requests get pp 1's tokens."""
    with radixserve.Engine(**TINY, pp_size=2, max_total_tokens=2048, max_running_requests=8,
                           chunked_prefill_size=8) as eng:
        streams = [eng.generate(input_ids=p, sampling_params={"temperature": 0, "max_new_tokens": 200,
                                                             "ignore_eos": True}, stream=True) for p in PROMPTS[:3]]
        for it in streams:
            next(it)
            next(it)
            it.close()  # the consumer goes away: the request is aborted
        out = eng.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        assert [o["output_ids"] for o in out] == pp1["greedy"]
        assert eng.scheduler.is_idle()
        eng.scheduler.check_memory()


def test_a_burst_of_requests_spreads_over_the_micro_batches():
    """Eight requests at once into two micro-batches (each could take all
    eight: the cap is 16 / 2): each takes its share, four, rather than the
    first taking the whole burst."""
    with radixserve.Engine(**TINY, pp_size=2, max_total_tokens=2048, max_running_requests=16) as eng:
        params = {"temperature": 0, "max_new_tokens": 50, "ignore_eos": True}
        streams = [eng.generate(input_ids=p, sampling_params=params, stream=True) for p in PROMPTS + PROMPTS[:2]]
        for it in streams:
            next(it)
        sched = eng.scheduler
        assert sorted([len(sched.running_batch)] + [len(mb.running_batch) for mb in sched.parked()]) == [4, 4]
        for it in streams:
            it.close()


@pytest.mark.slow
def test_smollm2_at_pp3_matches_hf_with_structured_output():
    """SmolLM2-135M's 30 layers over 3 stages: chat prompts give HF's greedy
    tokens; a JSON-schema request (each stage compiles the grammar; the first
    stage decides when it is ready, and the last applies its mask) gives pp
    1's JSON."""
    from transformers import AutoModelForCausalLM

    chats = ["What is the capital of France?", "Name three primary colors.", "Write a haiku about the sea."]
    schema = '{"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}'
    greedy = {"temperature": 0, "max_new_tokens": 24}
    with radixserve.Engine(device="cpu", pp_size=3, max_total_tokens=4096, max_running_requests=4,
                           chunked_prefill_size=16, check_invariants=True, disable_tqdm=True, dist_timeout=120) as eng:
        prompts = [eng.apply_chat_template([{"role": "user", "content": c}]) for c in chats]
        outs = [o["output_ids"] for o in eng.generate(prompts, greedy)]
        js = eng.generate(prompts[0], {**greedy, "json_schema": schema})
        folder = eng.scheduler.model_runner.model_config.weights_dir
        ids = [eng.tokenizer.encode(p) for p in prompts]
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    for prompt_ids, out in zip(ids, outs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt_ids]), max_new_tokens=24, do_sample=False)[0, len(prompt_ids):]
        assert out == ref.tolist()
    with radixserve.Engine(device="cpu", max_total_tokens=4096, max_running_requests=4, disable_tqdm=True) as eng:
        assert eng.generate(prompts[0], {**greedy, "json_schema": schema})["output_ids"] == js["output_ids"]
    assert '"city"' in js["text"]


# -- the HTTP server (started by ``servers``) ------------------------------------------------------


@pytest.mark.slow
def test_pp2_server_serves_pp1_tokens_and_reports_its_stages(pp1, servers):
    srv = servers.get("serve")
    try:
        assert len([k for k in srv.children() if k.startswith("scheduler")]) == 2
        info = httpx.get(srv.url + "/get_server_info", timeout=30).json()
        stages = info["pp_stages"]
        assert [s["layers"] for s in stages] == [[0, 1], [1, 2]]
        assert all(s["max_total_tokens"] == info["max_total_tokens"] for s in stages)
        body = {"input_ids": PROMPTS, "sampling_params": GREEDY}
        httpx.post(srv.url + "/generate", json={"input_ids": SHARED + [1], "sampling_params": {"max_new_tokens": 1}},
                   timeout=60)
        outs = httpx.post(srv.url + "/generate", json=body, timeout=60).json()
        assert [o["output_ids"] for o in outs] == pp1["greedy"]
        with httpx.stream("POST", srv.url + "/generate", json={**body, "input_ids": PROMPTS[3],
                                                              "sampling_params": GREEDY[3], "stream": True},
                          timeout=60) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        assert events[-1]["output_ids"] == pp1["greedy"][3]
        assert srv.wait_idle()["memory_check"] == "ok"
        assert httpx.post(srv.url + "/flush_cache", timeout=30).status_code == 200
    finally:
        assert srv.stop() == 0


@pytest.mark.slow
@pytest.mark.parametrize("victim", VICTIMS)
def test_a_killed_stage_ends_every_request_and_the_server(servers, victim):
    """Stage 0 or stage 1 killed while requests decode."""
    check_a_killed_rank_ends_everything(servers.get(victim), victim)


def test_pp_flags_are_checked():
    with pytest.raises(ValueError, match="pp_size must be >= 1"):
        radixserve.Engine(**TINY, pp_size=0)
    with pytest.raises(ValueError, match="pp_micro_batches must be >= 1"):
        radixserve.Engine(**TINY, pp_size=2, pp_micro_batches=0)
    for name, value in (("enable_hierarchical_cache", True), ("enable_elastic_kv", True),
                        ("enable_prefix_grouped_decode", True), ("disaggregation_mode", "prefill")):
        with pytest.raises(ValueError, match=f"{name}: not supported with pipeline parallelism"):
            radixserve.Engine(**TINY, pp_size=2, **{name: value})
    with pytest.raises(ValueError, match="pp_size 3 is larger than the model's 2 layers"):
        radixserve.Engine(**TINY, pp_size=3)
