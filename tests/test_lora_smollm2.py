"""Multi-LoRA serving on the real SmolLM2-135M-Instruct (docs/lora.md),
CPU float32: three PEFT adapters of ranks 8, 16 and 64 against HF
transformers + peft in one batch with the base model, radix hits included;
and a server driven as users drive SGLang's: ``sglang.bench_serving
--lora-name`` and the openai SDK with ``model: "BASE:ADAPTER"``."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx
import pytest
import torch
from server_harness import ONE_THREAD, ServerProcess
from test_sglang_clients import bench_serving_import_error, needs
from transformers import AutoModelForCausalLM, AutoTokenizer

import radixserve
from radixserve.model_loader import default_model_path, load_gguf

peft = pytest.importorskip("peft")

ADAPTERS = {"r8": 8, "r16": 16, "r64": 64}
MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
N_NEW = 8
GREEDY = {"temperature": 0, "max_new_tokens": N_NEW, "ignore_eos": True}
TEXTS = ["The capital of France is", "Write a haiku about the sea:", "def fibonacci(n):", "Rain in April means"]


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    """(the converted SmolLM2 folder, {adapter: folder}, its tokenizer)."""
    folder = load_gguf(default_model_path())
    root = tmp_path_factory.mktemp("lora_smollm2")
    adapters = {}
    for i, (name, rank) in enumerate(ADAPTERS.items()):
        torch.manual_seed(10 + i)
        model = peft.get_peft_model(_hf(folder), peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=MODULES,
                                                                 lora_dropout=0.0))
        with torch.no_grad():
            for pname, param in model.named_parameters():
                if "lora_B" in pname:
                    param.normal_(0, 0.1)  # PEFT starts B at zero, which would change nothing
        model.save_pretrained(root / name)
        adapters[name] = str(root / name)
    return folder, adapters, AutoTokenizer.from_pretrained(folder)


def _hf(folder):
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return model


_MODELS: dict = {}


@torch.no_grad()
def hf_peft_greedy(smollm2, adapter: str | None, ids: list[int]) -> list[int]:
    folder, adapters, _ = smollm2
    if adapter not in _MODELS:
        model = _hf(folder)
        _MODELS[adapter] = model if adapter is None else peft.PeftModel.from_pretrained(model, adapters[adapter]).eval()
    model = _MODELS[adapter]
    out = model.generate(input_ids=torch.tensor([ids]), max_new_tokens=N_NEW, min_new_tokens=N_NEW, do_sample=False)
    return out[0, len(ids):].tolist()


def lora_paths(adapters: dict) -> list[str]:
    return [f"{name}={path}" for name, path in adapters.items()]


@pytest.mark.slow
def test_one_batch_of_three_adapters_and_the_base_matches_hf_peft(smollm2):
    folder, adapters, tokenizer = smollm2
    mix = ["r8", "r16", None, "r64"]
    batch = [tokenizer.encode(t) for t in TEXTS]
    expected = [hf_peft_greedy(smollm2, a, ids) for a, ids in zip(mix, batch)]
    assert all(expected[i] != hf_peft_greedy(smollm2, None, batch[i]) for i, a in enumerate(mix) if a), \
        "each adapter changes SmolLM2's output"
    with radixserve.Engine(model_path=folder, device="cpu", enable_lora=True, lora_paths=lora_paths(adapters),
                           max_total_tokens=4096, check_invariants=True, disable_tqdm=True) as eng:
        for _ in range(2):  # the second time from the radix cache, under each request's own adapter
            outs = eng.generate(input_ids=batch, sampling_params=GREEDY, lora_path=mix)
            assert [o["output_ids"] for o in outs] == expected
        assert all(o["meta_info"]["cached_tokens"] >= len(ids) - 1 for o, ids in zip(outs, batch))


@pytest.fixture(scope="module")
def server(smollm2):
    folder, adapters, _ = smollm2
    srv = ServerProcess("--model-path", folder, "--enable-lora", "--lora-paths", *lora_paths(adapters),
                        "--max-total-tokens", "8192", env=ONE_THREAD)
    yield srv
    assert srv.stop() == 0


@pytest.mark.slow
def test_openai_sdk_selects_an_adapter_by_base_colon_name(server, smollm2):
    """``model: "BASE:ADAPTER"`` and the adapter's name alone give the
    adapter's tokens (those of ``/generate`` with ``lora_path``, which the
    Engine test holds to HF + peft), the base name the base model's; an
    unknown adapter is a 400 naming it."""
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
    ids = [m.id for m in client.models.list().data]
    base = ids[0]
    assert {base, *ADAPTERS} <= set(ids), ids

    def native(adapter):
        body = {"text": TEXTS[0], "sampling_params": GREEDY, "lora_path": adapter}
        return httpx.post(server.url + "/generate", json=body, timeout=120).json()["text"]

    def sdk(model):
        return client.completions.create(model=model, prompt=TEXTS[0], max_tokens=N_NEW, temperature=0,
                                         extra_body={"ignore_eos": True}).choices[0].text

    assert sdk(f"{base}:r16") == sdk("r16") == native("r16")
    assert sdk(base) == native(None) != native("r16")
    with pytest.raises(openai.BadRequestError, match="nope"):
        sdk(f"{base}:nope")


@pytest.mark.slow
def test_sglang_bench_serving_with_lora_names(server, tmp_path):
    """``python -m sglang.bench_serving --lora-name r8 r64``: every request
    completes; with an adapter the server does not have, every one fails
    (so bench_serving's requests do name their adapter)."""
    needs("sglang")
    error = bench_serving_import_error()
    if error:
        pytest.skip(f"sglang.bench_serving cannot be imported here: {error}")
    def bench(*names: str) -> dict:
        out = tmp_path / f"bench-{'-'.join(names)}.jsonl"
        run = subprocess.run(
            [sys.executable, "-m", "sglang.bench_serving", "--backend", "sglang", "--dataset-name", "random-ids",
             "--num-prompts", "8", "--random-input-len", "32", "--random-output-len", "8", "--warmup-requests", "0",
             "--tokenize-prompt", "--lora-name", *names, "--base-url", server.url, "--output-file", str(out)],
            capture_output=True, text=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        assert run.returncode == 0 or not out.exists(), run.stdout[-2000:] + run.stderr[-2000:]
        return json.loads(out.read_text().splitlines()[-1]) if out.exists() else {"completed": 0}

    assert bench("r8", "r64")["completed"] == 8
    assert bench("nope")["completed"] == 0
