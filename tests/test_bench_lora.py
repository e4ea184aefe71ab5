"""The LoRA benchmarks' own pieces (CPU): random PEFT adapters for a model's
shapes (``bench.lora_adapters``), which peft reads and the engine serves
with HF + peft's tokens; an adapter whose shapes do not fit the model,
refused by name; ``bench.one_batch --lora-adapters``; and
``bench.serving --lora-name``'s requests."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

import radixserve
from radixserve.bench.lora_adapters import spread, write_random_adapter
from radixserve.bench.serving import ClientConfig
from radixserve.bench.serving_backends import NativeBackend, OpenAIChatBackend, OpenAICompletionsBackend
from radixserve.model_loader import resolve_model

peft = pytest.importorskip("peft")

SHAPE = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.1)
GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bench-lora") / "base"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(LlamaConfig(**SHAPE, architectures=["LlamaForCausalLM"]),
                                     dtype=torch.float32).save_pretrained(folder)
    return str(folder)


def test_random_adapters_load_in_peft_and_serve_its_tokens(base, tmp_path):
    config = resolve_model(base)
    folder = write_random_adapter(str(tmp_path / "r"), config, 8, b_std=0.5, dtype=torch.float32)
    hf = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    model = peft.PeftModel.from_pretrained(hf, folder).eval()
    ids = torch.randint(0, SHAPE["vocab_size"], (12,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        want = model.generate(input_ids=torch.tensor([ids]), max_new_tokens=8, min_new_tokens=8, do_sample=False)
        with model.disable_adapter():
            plain = model.generate(input_ids=torch.tensor([ids]), max_new_tokens=8, min_new_tokens=8, do_sample=False)
    want, plain = want[0, len(ids):].tolist(), plain[0, len(ids):].tolist()
    assert want != plain  # peft read the weights (its B would be zero otherwise), and they change the tokens
    with radixserve.Engine(model_path=base, device="cpu", lora_paths=[f"r={folder}"], disable_tqdm=True) as eng:
        assert eng.generate(input_ids=ids, sampling_params=GREEDY, lora_path="r")["output_ids"] == want
        assert eng.generate(input_ids=ids, sampling_params=GREEDY)["output_ids"] == plain


def test_an_adapter_for_other_shapes_is_refused_by_name(base, tmp_path):
    config = resolve_model(base)
    other = LlamaConfig(**{**SHAPE, "intermediate_size": 128})
    other.head_dim = config.head_dim
    wrong = write_random_adapter(str(tmp_path / "wrong"), other, 4, modules=("q_proj", "down_proj"))
    with pytest.raises(ValueError, match="lora_paths: adapter 'wrong': layer 0 down_proj: lora_A \\(4, 128\\)"):
        radixserve.Engine(model_path=base, device="cpu", lora_paths=[f"wrong={wrong}"], disable_tqdm=True)
    good = write_random_adapter(str(tmp_path / "good"), config, 4, modules=("q_proj", "down_proj"))
    with radixserve.Engine(model_path=base, device="cpu", lora_paths=[f"good={good}"], disable_tqdm=True) as eng:
        with pytest.raises(ValueError, match="lora_path: adapter 'w': layer 0 down_proj: .* do not fit"):
            eng.load_lora_adapter("w", wrong)
        assert eng.scheduler.model_runner.lora_manager.loaded() == {"good": good}


def test_one_batch_runs_each_case_with_each_count_of_adapters(base):
    from radixserve.bench import one_batch

    records = one_batch.main(["--workload", "W2", "--model-path", base, "--device", "cpu", "--batch-sizes", "3",
                              "--input-len", "8", "--output-len", "3", "--lora-adapters", "0", "2", "--lora-rank", "4"])
    assert [(r["batch_size"], r["lora_adapters"], r["lora_rank"]) for r in records] == [(3, 0, 4), (3, 2, 4)]


def test_spread_puts_request_i_on_adapter_i_mod_n():
    class Manager:
        def resolve(self, name):
            return name + "#1"

    assert spread(Manager(), 5, 0) is None
    assert spread(Manager(), 5, 2) == (["lora0#1", "lora1#1", "lora0#1", "lora1#1", "lora0#1"], [0, 1, 0, 1, 0])


def test_bench_serving_sends_the_adapter_as_sglang_clients_do():
    cfg = ClientConfig("http://x", lora_names=["a", "b", "c"])
    assert [cfg.lora(i) for i in range(5)] == ["a", "b", "c", "a", "b"] and ClientConfig("http://x").lora(3) is None
    native = NativeBackend().payload([1, 2], 4, {}, "", "a")
    assert native["lora_path"] == "a" and "lora_path" not in NativeBackend().payload([1, 2], 4, {}, "", None)
    assert OpenAICompletionsBackend().payload("hi", 4, {}, "base", "a")["model"] == "base:a"
    assert OpenAIChatBackend().payload([{"role": "user", "content": "hi"}], 4, {}, "", "a")["model"] == "a"
