"""Prefill/decode disaggregation end to end: a prefill server and a decode
server (SmolLM2, fp32, CPU, pages of 4 tokens) in subprocesses,
each request sent to both at once with the same bootstrap room, as SGLang's
router does. Both halves run overlap scheduling's bookkeeping (forced on the
CPU, as it runs by default on a GPU; the colocated reference runs without).
Checked: the decode server's greedy output equals a colocated
server's, token for token, and so do its logprobs and top logprobs at every
position (the first token's came with the KV); the prefill server answers
with the first token;
both memory invariants hold once idle; and a transfer whose other half never
comes (no prefill request for the room, no decode server for it, no
bootstrap server at the address) ends with a clear error in bounded time
while the servers keep serving. Then the same pair behind SGLang's router
(``sglang_router.launch_router --pd-disaggregation``), unchanged: native
``/generate`` and OpenAI chat, streamed or not, equal the colocated server's,
and so do a prompt's logprobs (the router takes them from the prefill reply)."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

import radixserve
from disagg_server_harness import (
    DECODE_ARGS, GREEDY, PAGE_SIZE, PDPair, failure_message, assert_memory_ok, generate, model_args, prefill_args,
)
from radixserve.managers.io_struct import MAX_TOP_LOGPROBS
from radixserve.managers.scheduler import OVERLAP_ON_CPU_ENV
from server_harness import free_port, start_all

pytestmark = pytest.mark.slow
# the limits a transfer whose other half never comes runs into (SGLang's variables)
TIMEOUTS = {"SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "6", "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "6",
            "OMP_NUM_THREADS": "1"}
PAIR_ENV = {**TIMEOUTS, OVERLAP_ON_CPU_ENV: "1"}
FAULT_DEADLINE_S = 30  # the limits above plus slack for a loaded 2-core machine
PROMPTS = [[(7 * i + 3 * j) % 500 + 1 for j in range(n)] for i, n in enumerate((37, 5, 64))]
# as many top logprobs as a request may ask: the first token's fill the aux rows' columns
LOGPROBS = {"return_logprob": True, "top_logprobs_num": MAX_TOP_LOGPROBS}


@pytest.fixture(scope="module")
def servers():
    bootstrap_port = free_port()
    started = {}
    try:
        started["prefill"], started["decode"], started["colocated"] = start_all(  # side by side
            model_args() + prefill_args(bootstrap_port), model_args() + DECODE_ARGS, model_args(),
            envs=[PAIR_ENV, PAIR_ENV, {"OMP_NUM_THREADS": "1"}])
        started["bootstrap_port"] = bootstrap_port
        started["pair"] = PDPair(started["prefill"], started["decode"], bootstrap_port)
        yield started
    finally:
        for name in ("colocated", "decode", "prefill"):
            if name in started:
                assert started[name].stop() == 0, f"the {name} server shuts down cleanly"


def test_server_info_reports_the_mode(servers):
    info = httpx.get(servers["prefill"].url + "/get_server_info", timeout=10).json()
    assert info["disaggregation_mode"] == "prefill"
    assert [state["overlap"] for state in info["internal_states"]] == [True]
    colocated = httpx.get(servers["colocated"].url + "/get_server_info", timeout=10).json()
    assert [state["overlap"] for state in colocated["internal_states"]] == [False]
    assert info["disaggregation_bootstrap_port"] == servers["bootstrap_port"]
    bootstrap = httpx.get(f"http://127.0.0.1:{servers['bootstrap_port']}/route?engine_rank=0", timeout=10)
    assert bootstrap.status_code == 200 and bootstrap.json()["role"] == "Prefill"
    decode = httpx.get(servers["decode"].url + "/get_server_info", timeout=10).json()
    assert decode["disaggregation_mode"] == "decode" and decode["internal_states"][0]["overlap"]


def test_decode_output_equals_colocated(servers):
    for ids in PROMPTS:
        expected = generate(servers["colocated"].url, {"input_ids": ids, "sampling_params": GREEDY}).json()
        prefill, decode = servers["pair"].generate(ids)
        assert prefill.status_code == 200 and decode.status_code == 200, (prefill.text, decode.text)
        assert decode.json()["output_ids"] == expected["output_ids"]
        assert decode.json()["meta_info"]["finish_reason"] == {"type": "length", "length": 8}
        assert prefill.json()["output_ids"] == expected["output_ids"][:1]  # SGLang's prefill server's answer
    assert_memory_ok(servers["prefill"], servers["decode"])


def test_pair_with_the_hierarchical_cache_on_both_servers():
    """Both servers with a host tier under pools smaller than the prompts'
    shared prefixes (as SGLang runs HiCache on prefill servers): a prefix
    that went down to the host comes back for the next request of its group,
    and the decode server's output is a colocated engine's. The tiers and
    the transfer do not depend on the model: tiny-llama (dummy weights, in
    fp32 as the others), whose servers start and run in a fraction of SmolLM2's time."""
    heads = [[(13 * g + 7 * j) % 500 + 1 for j in range(96)] for g in range(4)]
    prompts = [h + [g + 1, 2 * g + 3, 5] for visit in range(2) for g, h in enumerate(heads)]
    tiny = ("--model-path", "tiny-llama", "--load-format", "dummy")
    tiers = ("--enable-hierarchical-cache", "--hicache-ratio", "4")
    with radixserve.Engine(model_path="tiny-llama", load_format="dummy", device="cpu", dtype="float32",
                           page_size=PAGE_SIZE, max_total_tokens=4096, max_running_requests=16, check_invariants=True,
                           disable_tqdm=True) as colocated:  # model_args()'s, one request at a time as the pair's
        expected = [colocated.generate(input_ids=ids, sampling_params=GREEDY)["output_ids"] for ids in prompts]
    bootstrap_port = free_port()
    started = {}
    try:
        started["prefill"], started["decode"] = start_all(  # side by side
            tiny + model_args(256) + tiers + prefill_args(bootstrap_port), tiny + model_args(256) + tiers + DECODE_ARGS,
            env=PAIR_ENV)
        pair = PDPair(started["prefill"], started["decode"], bootstrap_port)
        for ids, want in zip(prompts, expected):
            prefill, decode = pair.generate(ids)
            assert decode.status_code == 200, decode.text
            assert decode.json()["output_ids"] == want
        assert_memory_ok(pair.prefill, pair.decode)
        assert pair.prefill.state()["hicache_loaded_back"] > 0
    finally:
        for name in ("decode", "prefill"):
            if name in started:
                assert started[name].stop() == 0, f"the {name} server shuts down cleanly"


def assert_same_logprobs(got: list, want: list) -> None:
    """Two servers' logprob entries (``[logprob, token id, text]``, or per
    position a list of them or None for top logprobs): the same token ids,
    logprobs within 1e-4."""
    assert len(got) == len(want)
    for g, w in zip(got, want):
        if w is None or not w or isinstance(w[0], list):  # one position's top logprobs
            assert (g is None) == (w is None) and len(g or []) == len(w or []), (g, w)
            pairs = list(zip(g or [], w or []))
        else:
            pairs = [(g, w)]
        for (g_lp, g_id, _), (w_lp, w_id, _) in pairs:
            assert g_id == w_id and (g_lp is None) == (w_lp is None), (g, w)
            assert w_lp is None or g_lp == pytest.approx(w_lp, abs=1e-4)


def test_concurrent_pairs_and_logprobs(servers):
    expected = [generate(servers["colocated"].url, {"input_ids": ids, "sampling_params": GREEDY, **LOGPROBS}).json()
                for ids in PROMPTS]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        pairs = list(pool.map(lambda ids: servers["pair"].generate(ids, **LOGPROBS), PROMPTS))
    for want, (_, decode) in zip(expected, pairs):
        got = decode.json()
        assert got["output_ids"] == want["output_ids"]
        for key in ("output_token_logprobs", "output_top_logprobs"):  # the first position's came with the KV
            assert_same_logprobs(got["meta_info"][key], want["meta_info"][key])
        assert len(got["meta_info"]["output_top_logprobs"][0]) == MAX_TOP_LOGPROBS
    assert_memory_ok(servers["prefill"], servers["decode"])


def test_more_top_logprobs_than_a_transfer_carries_are_refused(servers):
    body = servers["pair"].body(PROMPTS[1], return_logprob=True, top_logprobs_num=MAX_TOP_LOGPROBS + 1)
    for name in ("prefill", "decode"):
        out = generate(servers[name].url, body)
        assert out.status_code == 400 and "top_logprobs_num" in out.text, out.text


def test_token_ids_logprobs_a_transfer_does_not_carry_are_refused(servers):
    body = servers["pair"].body(PROMPTS[1], return_logprob=True, token_ids_logprob=[3, 4])
    for name in ("prefill", "decode"):
        out = generate(servers[name].url, body)
        assert out.status_code == 400 and out.json()["error"]["param"] == "token_ids_logprob", out.text


def test_decode_request_whose_prefill_never_comes(servers):
    """A room no prefill request claims: the decode side gives up after its
    waiting timeout, frees what it reserved, and serves the next pair."""
    body = servers["pair"].body(PROMPTS[0])
    start = time.monotonic()
    out = generate(servers["decode"].url, body)
    assert time.monotonic() - start < FAULT_DEADLINE_S
    text = failure_message(out)
    assert f"KV transfer of bootstrap room {body['bootstrap_room']} failed" in text and "no KV arrived" in text
    assert_memory_ok(servers["decode"])
    _, decode = servers["pair"].generate(PROMPTS[1])
    assert decode.status_code == 200 and len(decode.json()["output_ids"]) == 8


def test_prefill_request_whose_decode_never_comes(servers):
    body = servers["pair"].body(PROMPTS[1])
    start = time.monotonic()
    out = generate(servers["prefill"].url, body)
    assert time.monotonic() - start < FAULT_DEADLINE_S
    assert "no decode rank registered for it" in failure_message(out)
    assert_memory_ok(servers["prefill"])


def test_bootstrap_address_that_does_not_answer(servers):
    body = {**servers["pair"].body(PROMPTS[1]), "bootstrap_port": free_port()}
    out = generate(servers["decode"].url, body, timeout=FAULT_DEADLINE_S)
    assert "did not answer" in failure_message(out)
    assert_memory_ok(servers["decode"])


def test_bad_bootstrap_fields_are_refused(servers):
    ids = PROMPTS[1]
    out = generate(servers["colocated"].url, {"input_ids": ids, "bootstrap_host": "127.0.0.1", "bootstrap_room": 5})
    assert out.status_code == 400 and "--disaggregation-mode" in out.text
    out = generate(servers["decode"].url, {"input_ids": ids, "bootstrap_room": 2**63})
    assert out.status_code == 400 and "bootstrap_room" in out.text
    out = generate(servers["decode"].url, {"input_ids": ids, "bootstrap_room": 5})
    assert out.status_code == 400 and "bootstrap_host" in out.text


# -- behind SGLang's router ----------------------------------------------------------


@pytest.fixture(scope="module")
def router(servers):
    pytest.importorskip("sglang_router", reason="the compat extra (sglang-router) is not installed")
    from router_harness import RouterProcess

    prefill, decode = servers["prefill"].url, servers["decode"].url
    proc = RouterProcess([], "--pd-disaggregation", "--prefill", prefill, str(servers["bootstrap_port"]),
                         "--decode", decode, policy="round_robin", healthy_urls=[prefill, decode])
    yield proc
    proc.stop()


def chat(url: str, stream: bool = False) -> str:
    model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
    body = {"model": model, "messages": [{"role": "user", "content": "Name three colours."}], "max_tokens": 8,
            "temperature": 0, "stream": stream}
    if not stream:
        out = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
        assert out.status_code == 200, out.text
        return out.json()["choices"][0]["message"]["content"]
    text = ""
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as out:
        assert out.status_code == 200
        for line in out.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
    return text


def test_through_sglang_router(servers, router):
    for ids in PROMPTS:
        expected = generate(servers["colocated"].url, {"input_ids": ids, "sampling_params": GREEDY}).json()
        got = generate(router.url, {"input_ids": ids, "sampling_params": GREEDY})
        assert got.status_code == 200, got.text
        assert got.json()["output_ids"] == expected["output_ids"]
    expected = chat(servers["colocated"].url)
    assert expected and chat(router.url) == expected
    assert chat(router.url, stream=True) == expected
    assert_memory_ok(servers["prefill"], servers["decode"])


def test_prompt_logprobs_through_sglang_router(servers, router):
    """The router merges the prefill reply's ``input_token_logprobs`` into the
    decode reply's; a completion's echoed prompt logprobs it cannot merge, so
    both servers refuse them (400) instead of answering without them."""
    body = {"input_ids": PROMPTS[0], "sampling_params": GREEDY, "logprob_start_len": 0, **LOGPROBS}
    want = generate(servers["colocated"].url, body).json()["meta_info"]
    got = generate(router.url, body)
    assert got.status_code == 200, got.text
    for key in ("input_token_logprobs", "output_token_logprobs", "output_top_logprobs"):
        assert_same_logprobs(got.json()["meta_info"][key], want[key])
    assert len(want["input_token_logprobs"]) == len(PROMPTS[0])
    model = httpx.get(router.url + "/v1/models", timeout=10).json()["data"][0]["id"]
    echo = {"model": model, "prompt": "Name three colours.", "max_tokens": 4, "echo": True, "logprobs": 1}
    out = httpx.post(router.url + "/v1/completions", json=echo, timeout=120)
    assert out.status_code == 400 and "echo" in out.text, out.text
    assert_memory_ok(servers["prefill"], servers["decode"])
