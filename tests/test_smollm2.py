"""SmolLM2-135M-Instruct from its GGUF, end to end through the Engine,
against HF transformers on the same converted weights (CPU, float32)."""

from __future__ import annotations

import pytest
import torch

import radixserve

pytestmark = pytest.mark.slow

CHATS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
    "What is 12 times 7?",
]


@pytest.fixture(scope="module")
def eng():
    with radixserve.Engine(max_total_tokens=8192, max_running_requests=8, check_invariants=True,
                           disable_tqdm=True, device="cpu", chunked_prefill_size=16) as e:
        yield e


@pytest.fixture(scope="module")
def hf(eng):
    from transformers import AutoModelForCausalLM

    folder = eng.scheduler.model_runner.model_config.weights_dir
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def test_capital_of_france(eng):
    prompt = eng.apply_chat_template([{"role": "user", "content": CHATS[0]}])
    out = eng.generate(prompt, {"temperature": 0, "max_new_tokens": 32})
    assert out["text"].startswith("The capital of France is Paris.")
    assert out["meta_info"]["finish_reason"]["type"] == "stop"


def test_chat_prompts_match_hf_in_one_batch(eng, hf):
    prompts = [eng.apply_chat_template([{"role": "user", "content": c}]) for c in CHATS]
    outs = eng.generate(prompts, {"temperature": 0, "max_new_tokens": 24})
    for prompt, out in zip(prompts, outs):
        ids = eng.tokenizer.encode(prompt)
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)[0, len(ids):].tolist()
        assert out["output_ids"] == ref
    # the chat template's system prompt is shared: later prompts hit the cache
    assert eng.generate(prompts[0], {"temperature": 0, "max_new_tokens": 1})["meta_info"]["cached_tokens"] > 20


def test_stop_strings_are_trimmed(eng):
    prompt = eng.apply_chat_template([{"role": "user", "content": CHATS[0]}])
    out = eng.generate(prompt, {"temperature": 0, "max_new_tokens": 32, "stop": ["France"]})
    assert out["text"] == "The capital of "
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": "France"}
    kept = eng.generate(prompt, {"temperature": 0, "max_new_tokens": 32, "stop": ["France"], "no_stop_trim": True})
    assert kept["text"].endswith("France")


def test_stop_token_ids_and_min_new_tokens(eng):
    prompt = eng.apply_chat_template([{"role": "user", "content": CHATS[0]}])
    full = eng.generate(prompt, {"temperature": 0, "max_new_tokens": 32})["output_ids"]
    stop_at = full[3]
    out = eng.generate(prompt, {"temperature": 0, "max_new_tokens": 32, "stop_token_ids": [stop_at]})
    assert out["output_ids"] == full[:4] and out["meta_info"]["finish_reason"]["matched"] == stop_at
    eos = eng.tokenizer.eos_token_id
    longer = eng.generate(prompt, {"temperature": 0, "max_new_tokens": 40, "min_new_tokens": 20})
    assert len(longer["output_ids"]) >= 20 and eos not in longer["output_ids"][:19]


def test_stop_regex_in_the_engine(eng):
    prompt = eng.apply_chat_template([{"role": "user", "content": CHATS[3]}])
    full = eng.generate(prompt, {"temperature": 0, "max_new_tokens": 32})
    out = eng.generate(prompt, {"temperature": 0, "max_new_tokens": 32, "stop_regex": r"\d+"})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": r"\d+"}
    first_digit = next(i for i, ch in enumerate(full["text"]) if ch.isdigit())
    assert out["text"] == full["text"][:first_digit]
    assert full["output_ids"][: len(out["output_ids"])] == out["output_ids"]
