"""GGUF files (llama.cpp) turned into cached HF-style folders.

A ``.gguf`` file is converted once into ``config.json``, ``model.safetensors``
(float32, every tensor dequantized with ``gguf.quants``; beyond
``SHARD_BYTES`` of weights, shards ``model-0000i-of-0000n.safetensors`` and
their index, written one at a time, so converting never holds more than a
shard of float32 weights in memory; a mixture of experts'
stacked ``ffn_*_exps`` tensors become transformers' ``mlp.experts.gate_up_proj``
and ``down_proj``), the tokenizer files
and ``generation_config.json``; afterwards the engine loads it like any HF
checkpoint. ``gguf_cache.load_gguf`` keeps the converted folders.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize
from safetensors.torch import save_file
from transformers import (
    GenerationConfig,
    LlamaConfig,
    MixtralConfig,
    PretrainedConfig,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)
from transformers.integrations.ggml import GGUF_CONFIG_DEFAULTS_MAPPING, GGUF_CONFIG_MAPPING

from radixserve.model_loader.weight_utils import SAFETENSORS_INDEX

logger = logging.getLogger(__name__)

# Bump when the converted output changes, so old cache entries are not reused.
CONVERTER_VERSION = 1
# Float32 bytes of weights per safetensors file written: a model larger than
# this is written in shards, one at a time (Qwen3-30B-A3B is ~120 GB in float32).
SHARD_BYTES = 4 << 30

# general.architecture -> (HF architecture, HF config class)
GGUF_ARCHITECTURES: dict[str, tuple[str, type[PretrainedConfig]]] = {
    "llama": ("LlamaForCausalLM", LlamaConfig),
    "qwen2": ("Qwen2ForCausalLM", Qwen2Config),
    "qwen3": ("Qwen3ForCausalLM", Qwen3Config),
    "qwen2moe": ("Qwen2MoeForCausalLM", Qwen2MoeConfig),
    "qwen3moe": ("Qwen3MoeForCausalLM", Qwen3MoeConfig),
}
# llama.cpp writes Mixtral as a "llama" with {arch}.expert_count and stacked
# expert tensors; transformers' GGUF support does not cover it, so the names of
# its two expert fields are ours (transformers' GGUF_CONFIG_MAPPING has Qwen's).
_MIXTRAL = ("MixtralForCausalLM", MixtralConfig)
_MIXTRAL_EXPERT_FIELDS = {"expert_count": "num_local_experts", "expert_used_count": "num_experts_per_tok"}
_MOE_MODEL_TYPES = {"mixtral", "qwen2_moe", "qwen3_moe"}
# llama.cpp's convert_hf_to_gguf.py interleaves the q/k rows of each head (its
# rotary kernel pairs adjacent dims) only for the llama family; the qwen
# converters write q/k as HF has them.
_PERMUTED_ARCHITECTURES = {"llama"}

_TOP_LEVEL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# llama.cpp's first Mixtral files (before stacked ffn_*_exps): blk.N.ffn_gate.E.weight, one per expert.
_PER_EXPERT_NAMES = {"ffn_gate": "gate_proj", "ffn_up": "up_proj", "ffn_down": "down_proj"}
# Not weights: llama3 rope factors, folded into config.rope_scaling instead.
_CONFIG_ONLY_TENSORS = {"rope_freqs.weight"}


def hf_tensor_name(gguf_name: str) -> str:
    """The HF checkpoint name of a llama.cpp tensor name (``blk.3.attn_q.weight``)."""
    if gguf_name in _TOP_LEVEL_NAMES:
        return _TOP_LEVEL_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _BLOCK_NAMES:
        return f"model.layers.{parts[1]}.{_BLOCK_NAMES[parts[2]]}.{parts[3]}"
    if len(parts) == 5 and parts[0] == "blk" and parts[2] in _PER_EXPERT_NAMES and parts[3].isdigit():
        return f"model.layers.{parts[1]}.mlp.experts.{parts[3]}.{_PER_EXPERT_NAMES[parts[2]]}.{parts[4]}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no known HF counterpart")


def unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's per-head q/k row interleaving (works for weights and biases).

    Within each head of d rows llama.cpp stores the HF rows in the order
    0, d/2, 1, d/2+1, ...; reading them as (pair, half) and swapping the two
    axes restores the HF order.
    """
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# --- metadata and config -------------------------------------------------------


def _field(reader: GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.get_field(key)
    return default if field is None else field.contents()


def _float(reader: GGUFReader, key: str, default: float) -> float:
    # Metadata floats are float32: 1e-5 is stored as 9.99999974e-06. The
    # shortest decimal that round-trips through float32 is the intended value.
    value = _field(reader, key)
    return default if value is None else float(str(np.float32(value)))


def _tensor(reader: GGUFReader, name: str):
    return next((t for t in reader.tensors if t.name == name), None)


def gguf_architecture(reader: GGUFReader) -> str:
    """The GGUF ``general.architecture``, checked against those we convert."""
    arch = _field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported; supported: {', '.join(GGUF_ARCHITECTURES)}"
        )
    return arch


def _hf_architecture(reader: GGUFReader, arch: str) -> tuple[str, type[PretrainedConfig]]:
    if arch == "llama" and _field(reader, "llama.expert_count", 0):
        return _MIXTRAL
    return GGUF_ARCHITECTURES[arch]


def gguf_to_hf_config(reader: GGUFReader) -> PretrainedConfig:
    """Build the HF config of a GGUF model from its metadata and tensor shapes."""
    arch = gguf_architecture(reader)
    hf_arch, config_cls = _hf_architecture(reader, arch)
    layers = int(_field(reader, f"{arch}.block_count"))
    heads = int(_field(reader, f"{arch}.attention.head_count"))
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    head_dim = int(_field(reader, f"{arch}.attention.key_length", hidden // heads))
    theta = _float(reader, f"{arch}.rope.freq_base", 10000.0)
    embed = _tensor(reader, "token_embd.weight")
    if embed is None:
        raise ValueError("GGUF file has no token_embd.weight; it is not a language model we can convert")
    return config_cls(
        architectures=[hf_arch],
        hidden_size=hidden,
        num_hidden_layers=layers,
        intermediate_size=int(_field(reader, f"{arch}.feed_forward_length")),
        num_attention_heads=heads,
        num_key_value_heads=int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
        head_dim=head_dim,
        vocab_size=int(embed.shape[1]),  # GGUF shapes are (cols, rows)
        max_position_embeddings=int(_field(reader, f"{arch}.context_length", 4096)),
        rms_norm_eps=_float(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6),
        rope_theta=theta,
        rope_scaling=_rope_scaling(reader, arch, theta, head_dim),
        tie_word_embeddings=_tensor(reader, "output.weight") is None,
        dtype="float32",
        **_special_token_ids(reader),
        **_moe_fields(reader, arch, config_cls.model_type, layers),
    )


def _moe_fields(reader: GGUFReader, arch: str, model_type: str, layers: int) -> dict[str, Any]:
    """The experts' part of a MoE config: counts from the metadata, sizes from the tensors.

    A layer is sparse where the file has its router (``ffn_gate_inp``); the
    Qwen families' other layers become ``mlp_only_layers`` (llama.cpp itself
    writes every layer sparse, as their release models are).
    """
    if model_type not in _MOE_MODEL_TYPES:
        return {}
    names = GGUF_CONFIG_MAPPING.get(model_type, _MIXTRAL_EXPERT_FIELDS)
    fields: dict[str, Any] = {
        names[key]: int(_field(reader, f"{arch}.{key}")) for key in ("expert_count", "expert_used_count")
    }
    fields.update(GGUF_CONFIG_DEFAULTS_MAPPING.get(model_type, {}))  # qwen3moe: llama.cpp's norm_topk_prob
    sparse = [i for i in range(layers) if _tensor(reader, f"blk.{i}.ffn_gate_inp.weight") is not None]
    if model_type == "mixtral":  # every layer sparse; the experts' size is feed_forward_length
        if len(sparse) != layers:
            raise ValueError(f"GGUF Mixtral has routers in {len(sparse)} of its {layers} layers; it needs all")
        return fields
    if not sparse:
        raise ValueError(f"GGUF {arch} file has no ffn_gate_inp (router) tensors")
    experts = _tensor(reader, f"blk.{sparse[0]}.ffn_gate_exps.weight")  # GGUF shape (H, I, E)
    if experts is None:
        raise ValueError(f"GGUF {arch} file has a router but no stacked ffn_gate_exps in layer {sparse[0]}")
    fields.update(moe_intermediate_size=int(experts.shape[1]), decoder_sparse_step=1,
                  mlp_only_layers=[i for i in range(layers) if i not in sparse])
    if model_type == "qwen2_moe":
        shared = _tensor(reader, f"blk.{sparse[0]}.ffn_gate_shexp.weight")  # (H, I_shared)
        fields["shared_expert_intermediate_size"] = 0 if shared is None else int(shared.shape[1])
    return fields


def _special_token_ids(reader: GGUFReader) -> dict[str, Any]:
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    eot = _field(reader, "tokenizer.ggml.eot_token_id")
    if eot is not None and eos is not None and eot != eos:
        eos = [int(eos), int(eot)]
    pad = _field(reader, "tokenizer.ggml.padding_token_id")
    return {"bos_token_id": bos, "eos_token_id": eos, "pad_token_id": pad}


def _rope_scaling(reader: GGUFReader, arch: str, theta: float, head_dim: int) -> dict[str, Any] | None:
    freqs = _tensor(reader, "rope_freqs.weight")
    if freqs is not None:
        return _llama3_rope_from_factors(dequantize(freqs.data, freqs.tensor_type).ravel(), theta, head_dim)
    kind = _field(reader, f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind not in ("linear", "yarn"):
        raise ValueError(f"GGUF rope scaling type {kind!r} is not supported (linear, yarn, llama3 are)")
    scaling: dict[str, Any] = {"rope_type": kind, "factor": _float(reader, f"{arch}.rope.scaling.factor", 1.0)}
    original = _field(reader, f"{arch}.rope.scaling.original_context_length")
    if original is not None:
        scaling["original_max_position_embeddings"] = int(original)
    return scaling


def llama3_rope_factors(scaling: dict[str, Any], theta: float, head_dim: int) -> np.ndarray:
    """Per-frequency divisors that llama3 rope scaling applies (llama.cpp's ``rope_freqs``)."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    factor, old_len = scaling["factor"], scaling["original_max_position_embeddings"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    smooth = np.clip((old_len / wavelen - low) / (high - low), 0.0, 1.0)
    return 1.0 / ((1 - smooth) / factor + smooth)


def _llama3_rope_from_factors(factors: np.ndarray, theta: float, head_dim: int) -> dict[str, Any]:
    """Recognise llama3 scaling from its factor table.

    The table does not store the parameters; Llama 3.x release models all use
    low=1, high=4, original length 8192 with a varying factor (its maximum), so
    that guess is verified against the table rather than trusted.
    """
    scaling = {
        "rope_type": "llama3",
        "factor": float(factors.max()),
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    if not np.allclose(llama3_rope_factors(scaling, theta, head_dim), factors, rtol=1e-4):
        raise ValueError("GGUF rope_freqs.weight does not match llama3 rope scaling with low=1, high=4, original=8192")
    return scaling


# --- tensors -------------------------------------------------------------------


def iter_gguf_tensors(reader: GGUFReader, config: PretrainedConfig) -> Iterator[tuple[str, np.ndarray]]:
    """Yield ``(hf_name, float32 array)`` for every weight in the GGUF file.

    Quantized blocks are expanded with ``gguf.quants.dequantize``; llama-family
    q/k rows are put back into HF order (Mixtral's too: llama.cpp writes it as
    a llama). A layer's stacked ``ffn_gate_exps`` and ``ffn_up_exps``
    (``[E, I, H]`` each) come out as one ``gate_up_proj`` ``[E, 2I, H]``.
    """
    arch = gguf_architecture(reader)
    heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}
    moe_names, shapes = _moe_tensor_names(config, arch)
    halves: dict[str, dict[str, np.ndarray]] = {}  # gate_up_proj name -> the half read so far
    for tensor in reader.tensors:
        if tensor.name in _CONFIG_ONLY_TENSORS:
            continue
        array = _dequantized(tensor)
        kind = tensor.name.split(".")[2] if tensor.name.startswith("blk.") else ""
        if arch in _PERMUTED_ARCHITECTURES and kind in heads:
            array = unpermute_rows(array, heads[kind])
        name = moe_names.get(tensor.name) or moe_names.get(tensor.name.removesuffix(".weight"))
        name = name or hf_tensor_name(tensor.name)  # the dense layers of a MoE model too
        if kind in ("ffn_gate_exps", "ffn_up_exps"):
            pair = halves.setdefault(name, {})
            pair[kind] = array
            if len(pair) < 2:
                continue
            array = np.concatenate([pair["ffn_gate_exps"], pair["ffn_up_exps"]], axis=1)
            del halves[name]
        if name in shapes and array.shape != shapes[name] and array.size == math.prod(shapes[name]):
            array = array.reshape(shapes[name])  # llama.cpp's 1-D ffn_gate_inp_shexp is HF's [1, H]
        yield name, array
    if halves:
        raise ValueError(f"GGUF file has only one of ffn_gate_exps and ffn_up_exps for {sorted(halves)}")


def _dequantized(tensor) -> np.ndarray:
    shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists dims fastest-first
    array = dequantize(tensor.data, tensor.tensor_type).reshape(shape)
    # F32 tensors come back as read-only views of the memory-mapped file.
    array = np.ascontiguousarray(array, dtype=np.float32)
    return array if array.flags.writeable else array.copy()


def _moe_tensor_names(config: PretrainedConfig, arch: str) -> tuple[dict[str, str], dict[str, tuple[int, ...]]]:
    """transformers' GGUF -> HF tensor names of a MoE model, and the HF shapes.

    The names come from its ``get_gguf_hf_weights_map`` over the model built on
    the meta device (gguf-py's name table, reversed); its Qwen2-MoE processor
    maps both ``ffn_gate_exps`` and ``ffn_up_exps`` to ``gate_up_proj``, a rule
    that holds for Mixtral's llama layout as well. Neither covers the dense
    layers of a MoE model, which ``hf_tensor_name`` names.
    """
    if config.model_type not in _MOE_MODEL_TYPES:
        return {}, {}
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import Qwen2MoeTensorProcessor, get_gguf_hf_weights_map

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    return get_gguf_hf_weights_map(model, Qwen2MoeTensorProcessor(), model_type=arch), shapes


# --- conversion and cache ------------------------------------------------------


def convert_gguf(gguf_path: str, out_dir: str) -> None:
    """Write the HF-style folder (config, float32 safetensors, tokenizer) for a GGUF file."""
    reader = GGUFReader(gguf_path)
    config = gguf_to_hf_config(reader)
    write_shards(iter_gguf_tensors(reader, config), out_dir)
    config.save_pretrained(out_dir)
    GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    ).save_pretrained(out_dir)
    if reader.get_field("tokenizer.ggml.model") is not None:
        _convert_tokenizer(gguf_path, out_dir, config.max_position_embeddings)


def write_shards(tensors: Iterator[tuple[str, np.ndarray]], out_dir: str, shard_bytes: int | None = None) -> None:
    """Save ``tensors`` as ``model.safetensors``, or, past ``shard_bytes``
    (default ``SHARD_BYTES``), as HF's numbered shards and their index; a
    shard is written as soon as it is full and then let go."""
    limit = SHARD_BYTES if shard_bytes is None else shard_bytes
    parts: list[list[str]] = []  # the tensor names of each shard written
    shard: dict[str, torch.Tensor] = {}
    size = total = 0

    def flush() -> None:
        nonlocal shard, size
        save_file(shard, os.path.join(out_dir, f"part-{len(parts)}.safetensors"), metadata={"format": "pt"})
        parts.append(list(shard))
        shard, size = {}, 0

    for name, array in tensors:
        if shard and size + array.nbytes > limit:
            flush()
        shard[name] = torch.from_numpy(array)
        size += array.nbytes
        total += array.nbytes
    flush()
    if len(parts) == 1:
        os.replace(os.path.join(out_dir, "part-0.safetensors"), os.path.join(out_dir, "model.safetensors"))
        return
    weight_map = {}
    for i, names in enumerate(parts):
        file = f"model-{i + 1:05d}-of-{len(parts):05d}.safetensors"
        os.replace(os.path.join(out_dir, f"part-{i}.safetensors"), os.path.join(out_dir, file))
        weight_map.update(dict.fromkeys(names, file))
    with open(os.path.join(out_dir, SAFETENSORS_INDEX), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)


def _convert_tokenizer(gguf_path: str, out_dir: str, max_length: int) -> None:
    # transformers owns the GGUF vocabulary -> tokenizers conversion (BPE and
    # sentencepiece flavours), the special tokens and the chat template.
    from transformers import AutoTokenizer

    folder, name = os.path.split(os.path.abspath(gguf_path))
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
    tokenizer.model_max_length = max_length
    # The chat template goes into tokenizer_config.json, where every
    # transformers version looks for it.
    tokenizer.save_pretrained(out_dir, save_jinja_files=False)
