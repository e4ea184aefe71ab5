"""GGUF mixtures of experts (docs/moe.md): tiny random Qwen3-MoE, Mixtral and
Qwen2-MoE models written the way llama.cpp's convert_hf_to_gguf.py writes
them (Mixtral as arch ``llama`` with q/k rows permuted; every layer's experts
stacked as ``ffn_{gate,up,down}_exps`` ``[E, out, in]``; Qwen2-MoE's shared
expert as ``ffn_*_shexp`` and its 1-D gate ``ffn_gate_inp_shexp``), loaded by
the offline Engine from the ``.gguf`` path, against HF transformers greedy
decoding in float32: on the original weights for F32 files, on the
dequantized weights for Q8_0 files (transformers' own GGUF loader cannot
build these models: its config mapping has no expert sizes and no Mixtral).
"""

from __future__ import annotations

import os

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize
from safetensors.numpy import load_file
from test_model_loader import llama_cpp_permute, transformers_gguf_tensors
from test_moe_models import CONFIGS, GREEDY, hf_greedy, prompts
from transformers import AutoModelForCausalLM

import radixserve
from radixserve.model_loader import gguf_cache, gguf_loader, load_gguf

GGUF_ARCH = {"mixtral": "llama", "qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe"}


def hf_model(name: str):
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(CONFIGS[name](), dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    return hf


def stored(w: np.ndarray, qtype: Q) -> np.ndarray:
    """What llama.cpp keeps of ``w``: quantized along its rows where the block fits, else F32."""
    if qtype == Q.F32 or w.ndim < 2 or w.shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0]:
        return w
    return quantize(w, qtype)


def file_values(hf, qtype: Q) -> dict[str, torch.Tensor]:
    """The HF state dict as a ``qtype`` file holds it (dequantized); routers stay F32, as llama.cpp keeps them."""
    values = {}
    for name, t in hf.state_dict().items():
        a = t.numpy()
        kept = name.endswith((".mlp.gate.weight", "shared_expert_gate.weight"))
        q = stored(a, Q.F32 if kept else qtype)
        values[name] = t if q is a else torch.from_numpy(dequantize(q, qtype).reshape(a.shape))
    return values


def write_gguf(hf, name: str, path, qtype: Q, drop: tuple[str, ...] = (), per_expert: bool = False) -> None:
    """Write ``hf`` as llama.cpp does (leaving out the tensors named in ``drop``); ``per_expert``:
    as its first Mixtral files did, one ``blk.N.ffn_gate.E.weight`` per expert instead of the stacks."""
    config, arch = hf.config, GGUF_ARCH[name]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_block_count(config.num_hidden_layers)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.num_attention_heads)
    w.add_head_count_kv(config.num_key_value_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_rope_freq_base(config.rope_parameters["rope_theta"])
    w.add_expert_count(getattr(config, "num_experts", None) or config.num_local_experts)
    w.add_expert_used_count(config.num_experts_per_tok)
    if name != "mixtral":
        w.add_expert_feed_forward_length(config.moe_intermediate_size)
    if name == "qwen2_moe":
        w.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    sd = {k: v.numpy() for k, v in hf.state_dict().items()}

    def add(gguf_name: str, value, n_head: int | None = None, quant: bool = True):
        value = sd[value] if isinstance(value, str) else value
        data = stored(value, qtype if quant else Q.F32)
        if n_head:  # llama.cpp permutes the rows; quantization blocks run along them
            data = llama_cpp_permute(data, n_head)
        if gguf_name not in drop:
            w.add_tensor(gguf_name, data, raw_dtype=None if data.dtype == np.float32 else qtype)

    add("token_embd.weight", "model.embed_tokens.weight")
    for i in range(config.num_hidden_layers):
        pre, blk = f"model.layers.{i}", f"blk.{i}"
        add(f"{blk}.attn_norm.weight", f"{pre}.input_layernorm.weight")
        add(f"{blk}.ffn_norm.weight", f"{pre}.post_attention_layernorm.weight")
        for kind, proj, heads in (("attn_q", "q_proj", config.num_attention_heads),
                                  ("attn_k", "k_proj", config.num_key_value_heads), ("attn_v", "v_proj", None)):
            add(f"{blk}.{kind}.weight", f"{pre}.self_attn.{proj}.weight", heads if arch == "llama" else None)
            if f"{pre}.self_attn.{proj}.bias" in sd:
                add(f"{blk}.{kind}.bias", f"{pre}.self_attn.{proj}.bias")
        add(f"{blk}.attn_output.weight", f"{pre}.self_attn.o_proj.weight")
        for norm in ("q_norm", "k_norm"):
            if f"{pre}.self_attn.{norm}.weight" in sd:
                add(f"{blk}.attn_{norm}.weight", f"{pre}.self_attn.{norm}.weight")
        if f"{pre}.mlp.gate.weight" not in sd:  # a dense layer
            for part in ("gate", "up", "down"):
                add(f"{blk}.ffn_{part}.weight", f"{pre}.mlp.{part}_proj.weight")
            continue
        add(f"{blk}.ffn_gate_inp.weight", f"{pre}.mlp.gate.weight", quant=False)
        gate, up = np.split(sd[f"{pre}.mlp.experts.gate_up_proj"], 2, axis=1)  # [E, I, H] each
        down = sd[f"{pre}.mlp.experts.down_proj"]  # [E, H, I]
        for part, stack in (("gate", gate), ("up", up), ("down", down)):
            if per_expert:
                for e in range(len(stack)):
                    add(f"{blk}.ffn_{part}.{e}.weight", np.ascontiguousarray(stack[e]))
            else:
                add(f"{blk}.ffn_{part}_exps.weight", np.ascontiguousarray(stack))
        if f"{pre}.mlp.shared_expert_gate.weight" in sd:
            for part in ("gate", "up", "down"):
                add(f"{blk}.ffn_{part}_shexp.weight", f"{pre}.mlp.shared_expert.{part}_proj.weight")
            add(f"{blk}.ffn_gate_inp_shexp.weight", sd[f"{pre}.mlp.shared_expert_gate.weight"].reshape(-1))
    add("output_norm.weight", "model.norm.weight")
    if not config.tie_word_embeddings:
        add("output.weight", "lm_head.weight")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module", params=[(name, q) for name in sorted(CONFIGS) for q in ("F32", "Q8_0")],
                ids=lambda p: f"{p[0]}-{p[1]}")
def tiny_gguf(request, tmp_path_factory):
    """(name, .gguf path, the HF model holding the file's values, the converted folder)."""
    name, qtype = request.param[0], Q[request.param[1]]
    root = tmp_path_factory.mktemp(f"{name}-{qtype.name}")
    path = root / f"tiny-{name}-{qtype.name}.gguf"
    hf = hf_model(name)
    write_gguf(hf, name, path, qtype)
    hf.load_state_dict(file_values(hf, qtype))
    return name, path, hf, load_gguf(str(path), str(root / "cache"))


def test_moe_gguf_config_matches_the_hf_config(tiny_gguf):
    name, _, hf, folder = tiny_gguf
    config = hf.config.__class__.from_pretrained(folder)
    assert config.architectures == hf.config.architectures
    fields = {"mixtral": ["num_local_experts", "num_experts_per_tok", "intermediate_size"],
              "qwen3_moe": ["num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                            "head_dim", "intermediate_size"],
              "qwen2_moe": ["num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                            "shared_expert_intermediate_size", "intermediate_size"]}[name]
    assert {k: getattr(config, k) for k in fields} == {k: getattr(hf.config, k) for k in fields}
    if name != "mixtral":  # the same dense layers as HF's rule picks (mlp_only_layers, decoder_sparse_step)
        with torch.device("meta"):
            ours = AutoModelForCausalLM.from_config(config)
        assert sorted(ours.state_dict()) == sorted(hf.state_dict())


def test_moe_gguf_tensors_are_the_files_values_in_hf_layout(tiny_gguf):
    _, _, hf, folder = tiny_gguf
    converted = load_file(os.path.join(folder, "model.safetensors"))
    expected = {k: v.numpy() for k, v in hf.state_dict().items()}
    if hf.config.tie_word_embeddings:
        expected.pop("lm_head.weight")
    assert sorted(converted) == sorted(expected)
    for name, value in converted.items():
        np.testing.assert_array_equal(value, expected[name], err_msg=name)


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen2_moe"])
def test_moe_gguf_tensors_match_transformers_gguf_loader(tmp_path, name):
    """transformers reads Qwen MoE GGUF tensors (not their config: it lacks the
    expert sizes); where it names a tensor, its values are ours."""
    path = tmp_path / f"{name}.gguf"
    write_gguf(hf_model(name), name, path, Q.Q8_0)
    converted = load_file(os.path.join(load_gguf(str(path), str(tmp_path / "cache")), "model.safetensors"))
    theirs = transformers_gguf_tensors(path)
    moe = [n for n in converted if ".experts." in n or ".mlp.gate." in n or "shared_expert" in n]
    assert moe and set(moe) <= set(theirs)
    for tensor in converted.keys() & theirs.keys():
        np.testing.assert_array_equal(converted[tensor], theirs[tensor].float().numpy(), err_msg=tensor)


def test_moe_gguf_greedy_tokens_match_hf(tiny_gguf, tmp_path, monkeypatch):
    """The Engine from the .gguf path (converted into a private cache), with
    chunked prefill and a mixed batch, gives HF's tokens on the file's values."""
    _, path, hf, _ = tiny_gguf
    monkeypatch.setenv(gguf_cache.CACHE_ENV, str(tmp_path / "cache"))
    batch = prompts([29, 3, 17], seed=7)
    with radixserve.Engine(model_path=str(path), device="cpu", check_invariants=True, disable_tqdm=True,
                           chunked_prefill_size=16, enable_mixed_chunk=True, max_total_tokens=1024,
                           max_running_requests=4) as eng:
        outs = eng.generate(input_ids=batch, sampling_params=GREEDY)
    assert [o["output_ids"] for o in outs] == [hf_greedy(hf, ids, GREEDY["max_new_tokens"]) for ids in batch]


def test_mixtral_gguf_needs_a_router_in_every_layer(tmp_path):
    path = tmp_path / "mixtral.gguf"
    write_gguf(hf_model("mixtral"), "mixtral", path, Q.F32, drop=("blk.1.ffn_gate_inp.weight",))
    with pytest.raises(ValueError, match="GGUF Mixtral has routers in 2 of its 3 layers"):
        load_gguf(str(path), str(tmp_path / "cache"))


def test_mixtral_gguf_with_one_tensor_per_expert(tmp_path, monkeypatch):
    """llama.cpp's first Mixtral layout (``blk.N.ffn_gate.E.weight``) loads as HF's per-expert tensors."""
    path = tmp_path / "mixtral-per-expert.gguf"
    hf = hf_model("mixtral")
    write_gguf(hf, "mixtral", path, Q.Q8_0, per_expert=True)
    hf.load_state_dict(file_values(hf, Q.Q8_0))
    converted = load_file(os.path.join(load_gguf(str(path), str(tmp_path / "cache")), "model.safetensors"))
    gate_up = hf.state_dict()["model.layers.2.mlp.experts.gate_up_proj"].numpy()
    np.testing.assert_array_equal(converted["model.layers.2.mlp.experts.7.up_proj.weight"], gate_up[7, 48:])
    monkeypatch.setenv(gguf_cache.CACHE_ENV, str(tmp_path / "cache"))
    batch = prompts([21, 4], seed=8)
    with radixserve.Engine(model_path=str(path), device="cpu", disable_tqdm=True, max_total_tokens=512,
                           max_running_requests=4) as eng:
        outs = eng.generate(input_ids=batch, sampling_params=GREEDY)
    assert [o["output_ids"] for o in outs] == [hf_greedy(hf, ids, GREEDY["max_new_tokens"]) for ids in batch]
