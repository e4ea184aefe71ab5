"""SGLang's own clients, unchanged, against a real radixserve server (SmolLM2
on the CPU): the frontend language (``sgl.function`` programs over
``sgl.RuntimeEndpoint``), sglang-router in front of the server, and
``sglang.bench_serving``. They are test-only dependencies that ``make test``
installs (pyproject's ``compat`` extra, and ``sglang`` without its own)."""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import re
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from router_harness import RouterProcess
from server_harness import selected, wait_for

pytestmark = pytest.mark.slow
HERE = Path(__file__).parent
MODEL = "SmolLM2-135M-Instruct"
GREEDY = {"temperature": 0, "max_new_tokens": 16}
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


def needs(module: str) -> None:
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed (make test installs it)")


@pytest.fixture(scope="module")
def server(smollm2_open):
    return smollm2_open  # conftest.py: shared with test_structured_output.py


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


def generate(client: httpx.Client, text: str, **params) -> str:
    out = client.post("/generate", json={"text": text, "sampling_params": {**GREEDY, **params}})
    assert out.status_code == 200, out.text
    return out.json()["text"]


def prompt_logprobs(client: httpx.Client, text: str, start: int = 0) -> list:
    """``input_token_logprobs`` of ``text`` from position ``start`` on, as SGLang's ``select`` asks."""
    out = client.post("/generate", json={"text": text, "sampling_params": {"max_new_tokens": 0},
                                         "return_logprob": True, "logprob_start_len": start,
                                         "return_text_in_logprobs": True}).json()
    return out["meta_info"]["input_token_logprobs"]


# -- the frontend language ---------------------------------------------------------------
@pytest.fixture(scope="module")
def frontend(server) -> dict:
    """What tests/sglang_frontend_programs.py's programs produced against the server."""
    needs("sglang")
    run = subprocess.run([sys.executable, str(HERE / "sglang_frontend_programs.py"), server.url],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.splitlines()[-1])


def test_prompt_logprobs_follow_sglang_convention(client):
    """From ``logprob_start_len`` on, one entry per prompt token, the first
    None: SGLang's frontend averages what follows when it scores choices."""
    text = "The capital of France is Paris"
    whole = prompt_logprobs(client, text)
    for start in (0, 2, len(whole) - 1):
        part = prompt_logprobs(client, text, start)
        assert [e[1] for e in part] == [e[1] for e in whole[start:]]
        assert part[0][0] is None and all(e[0] is not None for e in part[1:])
        assert [e[0] for e in part[1:]] == pytest.approx([e[0] for e in whole[start + 1:]], abs=1e-3)
    assert "".join(e[2] for e in whole) == text


def test_gen_is_the_servers_greedy_output(frontend, client):
    assert frontend["gen"] == generate(client, "The capital of France is", max_new_tokens=8, stop=["."]) == " Paris"


def test_run_batch_answers_each_prompt(frontend):
    assert frontend["run_batch"] == [" Paris", " Tokyo", " Rome", " Berlin"]


def test_gen_with_regex_matches_it(frontend):
    assert re.fullmatch(frontend["regex"]["pattern"], frontend["regex"]["output"])


def test_select_and_gen_choices_pick_the_sure_answer(frontend):
    assert frontend["select"] == frontend["gen_choices"] == "Paris"


def test_select_agrees_with_prompt_logprobs(frontend, client):
    """The choice whose tokens the server finds likeliest, scored here
    independently from whole-prompt logprobs, is the one ``select`` took."""
    prompt = frontend["count"]["prompt"]
    n = len(prompt_logprobs(client, prompt))
    means = {}
    for choice in (" four", " seven"):
        entries = prompt_logprobs(client, prompt + choice)[n:]
        means[choice] = sum(e[0] for e in entries) / len(entries)
    assert frontend["count"]["answer"] == max(means, key=means.get) == " four"


def test_system_user_assistant_turns(frontend):
    turns = frontend["two_turns"]
    assert turns["roles"] == ["system", "user", "assistant", "user", "assistant"]
    assert "Paris" in turns["first"] and "Tokyo" in turns["second"]


def test_fork_branches_each_generate(frontend, client):
    fork = frontend["fork"]
    assert len(fork["facts"]) == 2 and all(f.strip() for f in fork["facts"])
    for fact, prompt in zip(fork["facts"], fork["prompts"]):
        assert fact == generate(client, prompt, stop=["\n"]) and fact in fork["text"]


# -- sglang-router -------------------------------------------------------------------
@pytest.fixture(scope="module", autouse=True)
def early_router(request, tmp_path_factory):
    """``router``'s router (if a selected test uses it), started in the
    background with the module's first test, once the server is up: it
    starts while the frontend's programs run. Stopped with the module."""
    if not selected(request, "router") or importlib.util.find_spec("sglang_router") is None:
        yield None
        return
    url = request.getfixturevalue("server").url
    pool = ThreadPoolExecutor(1)
    started = pool.submit(RouterProcess, [url], policy="cache_aware",
                          log_path=tmp_path_factory.mktemp("router") / "router.log")
    yield started
    pool.shutdown(wait=True)
    if started.exception() is None:
        started.result().stop()


@pytest.fixture(scope="module")
def router(early_router):
    """``sglang_router.launch_router`` in front of the server; its URL once it routes to it."""
    needs("sglang_router")
    return early_router.result().url


@pytest.fixture(scope="module")
def routed(router):
    with httpx.Client(base_url=router, timeout=120) as c:
        yield c


def sse_texts(response: httpx.Response) -> list[str]:
    data = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d)["text"] for d in data[:-1]]


def test_router_lists_the_served_model(routed, client):
    ids = [m["id"] for m in routed.get("/v1/models").json()["data"]]
    assert ids == [m["id"] for m in client.get("/v1/models").json()["data"]] == [MODEL]


def test_router_generate_streamed_and_not(routed, client):
    body = {"text": "The capital of France is", "sampling_params": GREEDY}
    whole = routed.post("/generate", json=body)
    assert whole.status_code == 200, whole.text
    assert whole.json()["text"] == generate(client, body["text"])
    with routed.stream("POST", "/generate", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        texts = sse_texts(r)
    assert len(texts) > 1 and texts[-1] == whole.json()["text"]


def test_router_openai_routes_through_the_sdk(router):
    from openai import OpenAI

    sdk = OpenAI(base_url=router + "/v1", api_key="none", timeout=120)
    model = sdk.models.list().data[0].id
    done = sdk.completions.create(model=model, prompt="The capital of France is", max_tokens=16, temperature=0)
    chunks = sdk.completions.create(model=model, prompt="The capital of France is", max_tokens=16, temperature=0,
                                    stream=True)
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert done.choices[0].text.startswith(" Paris") and streamed == done.choices[0].text
    reply = sdk.chat.completions.create(model=model, messages=CHAT, max_tokens=16, temperature=0)
    chunks = sdk.chat.completions.create(model=model, messages=CHAT, max_tokens=16, temperature=0, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "Paris" in reply.choices[0].message.content and streamed == reply.choices[0].message.content


def test_router_flushes_the_servers_cache(routed):
    out = routed.post("/flush_cache").json()
    assert out["workers_flushed"] == 1 and out["total_http_workers"] == 1


def test_get_load_reports_what_runs(server, client, routed):
    """/get_load (which the router polls for its power-of-two policy) counts a
    running request and its KV tokens, and nothing once it is done."""

    def load_if(pred):
        state = client.get("/get_load").json()[0]
        return state if pred(state) else None

    body = {"text": "Count to a thousand:", "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True},
            "stream": True}
    stop = threading.Event()

    def stream_until_stopped():
        with httpx.Client(base_url=server.url, timeout=120) as c, c.stream("POST", "/generate", json=body) as r:
            for _ in r.iter_lines():
                if stop.is_set():
                    return  # closing the stream aborts the request

    worker = threading.Thread(target=stream_until_stopped)
    worker.start()
    try:
        # its KV tokens: the prompt's (5), then one more per output token
        busy = wait_for(lambda: load_if(lambda s: s["num_reqs"] == 1 and s["num_tokens"] > 20), 60,
                        "a running request holding its tokens")
        assert busy["num_waiting_reqs"] == 0
    finally:
        stop.set()
        worker.join(60)
    idle = wait_for(lambda: load_if(lambda s: s["num_reqs"] == 0), 30, "the request's end")
    assert idle == {"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}
    loads = routed.get("/get_loads").json()["workers"]
    assert loads == [{"worker": server.url, "load": 0}]  # -1 if the router could not read /get_load


# -- bench_serving ------------------------------------------------------------------
@functools.lru_cache(maxsize=None)  # a probe of some seconds; test_lora_smollm2.py asks too
def bench_serving_import_error() -> str | None:
    """Why ``sglang.bench_serving`` does not import here (None if it does):
    it imports sglang's server configs, which need torchvision and more."""
    probe = subprocess.run([sys.executable, "-c", "import sglang.bench_serving"], capture_output=True, text=True,
                           timeout=300)
    return None if probe.returncode == 0 else (probe.stderr.strip().splitlines() or ["?"])[-1]


def test_bench_serving_completes_every_request(server, client, tmp_path):
    """``python -m sglang.bench_serving --backend sglang``: it finds the model
    (/v1/models) and our tokenizer (/model_info, so no --tokenizer and no hub),
    every request completes, and the server counted the tokens it reports."""
    needs("sglang")
    error = bench_serving_import_error()
    if error:
        pytest.skip(f"sglang.bench_serving cannot be imported here: {error}")
    state = server.wait_idle()
    out = tmp_path / "bench.jsonl"
    run = subprocess.run(
        [sys.executable, "-m", "sglang.bench_serving", "--backend", "sglang", "--dataset-name", "random-ids",
         "--num-prompts", "16", "--random-input-len", "64", "--random-output-len", "16", "--warmup-requests", "0",
         "--tokenize-prompt", "--base-url", server.url, "--output-file", str(out)],
        capture_output=True, text=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    result = json.loads(out.read_text().splitlines()[-1])
    after = server.wait_idle()
    assert result["completed"] == 16
    assert after["prompt_tokens"] - state["prompt_tokens"] == result["total_input_tokens"]
    assert after["generated"] - state["generated"] == result["total_output_tokens"]
