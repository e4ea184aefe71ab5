"""Tiny Llama / Mistral / Qwen2 / Qwen3 models against HF transformers (CPU, float32):
logits, chunked prefill + greedy decode through the KV pool, input logprobs,
rotary scaling, the registry and weight loading."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from radixserve.configs.model_config import ModelConfig
from radixserve.layers import logits_processor, triton_ops
from radixserve.layers.activation import SiluAndMul
from radixserve.layers.layernorm import RMSNorm
from radixserve.layers.rotary_embedding import get_rope
from radixserve.managers.schedule_batch import ModelWorkerBatch
from radixserve.model_executor.forward_batch_info import ForwardMode
from radixserve.model_executor.model_runner import ModelRunner
from radixserve.models.registry import ModelRegistry

VOCAB = 256
SHAPE = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.1,
)
LLAMA3_ROPE = {
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64, "rope_theta": 10000.0,
}
CONFIGS = {
    "llama": lambda: LlamaConfig(**SHAPE, architectures=["LlamaForCausalLM"]),
    "llama3-rope-scaling": lambda: LlamaConfig(**SHAPE, rope_scaling=LLAMA3_ROPE, architectures=["LlamaForCausalLM"]),
    "llama-tied-bias": lambda: LlamaConfig(
        **SHAPE, tie_word_embeddings=True, attention_bias=True, mlp_bias=True, architectures=["LlamaForCausalLM"]
    ),
    "mistral": lambda: MistralConfig(**SHAPE, architectures=["MistralForCausalLM"]),
    "qwen2": lambda: Qwen2Config(**SHAPE, architectures=["Qwen2ForCausalLM"]),
    "qwen3": lambda: Qwen3Config(**SHAPE, head_dim=32, tie_word_embeddings=True, architectures=["Qwen3ForCausalLM"]),
}


def hf_model(config):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # random weights: never stop early
    return model


def our_model(config, hf):
    model = ModelRegistry.resolve(config.architectures)(config)
    model.load_weights(hf.state_dict().items())
    return model.eval()


def make_runner(config, model, page_size=1):
    model_config = ModelConfig("tiny", config, "dummy", None, None, torch.float32)
    return ModelRunner(model_config, page_size=page_size, max_total_tokens=512, max_running_requests=4, model=model)


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request):
    """(HF model, our model with the same weights, config)."""
    config = CONFIGS[request.param]()
    hf = hf_model(config)
    return hf, our_model(config, hf), config


def prompts(lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=gen) for n in lengths]


@torch.no_grad()
def hf_logits(hf, ids: torch.Tensor) -> torch.Tensor:
    return hf(ids[None]).logits[0].float()


class Request:
    """Test-side stand-in for the scheduler's bookkeeping of one request."""

    def __init__(self, runner: ModelRunner, token_ids: torch.Tensor):
        self.runner, self.ids = runner, token_ids.tolist()
        self.row = runner.req_to_token_pool.alloc(1)[0]
        self.cached = 0  # tokens whose KV is in the pool

    def take_slots(self, n: int) -> torch.Tensor:
        slots = self.runner.token_to_kv_pool_allocator.alloc(n)
        self.runner.req_to_token_pool.write(self.row, self.cached, slots)
        self.cached += n
        return slots


def run_extend(runner, chunks, logprob_starts=None, top_logprobs_nums=None):
    """One EXTEND forward of ``[(request, number of its next tokens to prefill)]``."""
    prefix = [r.cached for r, _ in chunks]
    ids = [torch.tensor(r.ids[r.cached : r.cached + n]) for r, n in chunks]
    slots = [r.take_slots(n) for r, n in chunks]
    batch = ModelWorkerBatch(
        forward_mode=ForwardMode.EXTEND,
        input_ids=torch.cat(ids),
        req_pool_indices=torch.tensor([r.row for r, _ in chunks]),
        seq_lens=torch.tensor([r.cached for r, _ in chunks]),
        out_cache_loc=torch.cat(slots),
        seq_lens_cpu=[r.cached for r, _ in chunks],
        extend_prefix_lens=prefix,
        extend_seq_lens=[n for _, n in chunks],
        return_logprob=logprob_starts is not None,
        extend_logprob_start_lens=logprob_starts,
        top_logprobs_nums=top_logprobs_nums,
    )
    return runner.forward(runner.forward_batch_from(batch))


def run_decode(runner, requests):
    """One DECODE forward: each request's last token id goes in."""
    slots = torch.cat([r.take_slots(1) for r in requests])
    batch = ModelWorkerBatch(
        forward_mode=ForwardMode.DECODE,
        input_ids=torch.tensor([r.ids[-1] for r in requests]),
        req_pool_indices=torch.tensor([r.row for r in requests]),
        seq_lens=torch.tensor([r.cached for r in requests]),
        out_cache_loc=slots,
        seq_lens_cpu=[r.cached for r in requests],
    )
    return runner.forward(runner.forward_batch_from(batch))


def test_extend_logits_match_hf(pair):
    hf, model, config = pair
    runner = make_runner(config, model)
    batch = prompts([5, 17, 11])
    out = run_extend(runner, [(Request(runner, p), len(p)) for p in batch])
    assert out.next_token_logits.shape == (3, VOCAB) and out.next_token_logits.dtype == torch.float32
    for i, p in enumerate(batch):
        torch.testing.assert_close(out.next_token_logits[i], hf_logits(hf, p)[-1], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("page_size", [1, 16])
def test_chunked_prefill_then_greedy_decode_matches_hf_generate(pair, page_size):
    """Prompt A is prefilled in 3 chunks, B in 2; B's first decode rides in A's
    last chunk (a mixed EXTEND batch); then both decode token by token."""
    hf, model, config = pair
    runner = make_runner(config, model, page_size=page_size)
    steps = 10
    a, b = (Request(runner, p) for p in prompts([20, 13], seed=1))
    expected = [hf.generate(torch.tensor([r.ids]), do_sample=False, max_new_tokens=steps)[0].tolist() for r in (a, b)]

    run_extend(runner, [(a, 7), (b, 6)])
    out = run_extend(runner, [(a, 8), (b, 7)])
    b.ids.append(int(out.next_token_logits[1].argmax()))
    out = run_extend(runner, [(a, 5), (b, 1)])
    for r, logits in zip((a, b), out.next_token_logits):
        r.ids.append(int(logits.argmax()))
    while len(a.ids) < len(expected[0]):
        out = run_decode(runner, [a, b])
        for r, logits in zip((a, b), out.next_token_logits):
            r.ids.append(int(logits.argmax()))
    assert a.ids == expected[0]
    assert b.ids[: len(expected[1])] == expected[1]


def test_input_logprobs_match_hf(pair, monkeypatch):
    hf, model, config = pair
    monkeypatch.setattr(logits_processor, "LOGPROB_CHUNK_ROWS", 4)  # several LM-head chunks
    runner = make_runner(config, model)
    a, b = (Request(runner, p) for p in prompts([14, 9], seed=2))
    run_extend(runner, [(a, 5)])  # a has a 5-token cached prefix
    out = run_extend(runner, [(a, 9), (b, 9)], logprob_starts=[2, 0], top_logprobs_nums=[3, 0])

    # a: new tokens are positions 5..13; entries for new-token indices 2..7 predict positions 8..13.
    # b: new-token indices 0..7 predict positions 1..8.
    assert out.input_logprob_lens == [6, 8]
    lp_a, lp_b = out.input_token_logprobs.split(out.input_logprob_lens)
    for r, lp, first in ((a, lp_a, 7), (b, lp_b, 0)):
        ref = torch.log_softmax(hf_logits(hf, torch.tensor(r.ids)), dim=-1)
        targets = torch.tensor(r.ids[first + 1 :])
        torch.testing.assert_close(lp, ref[first:-1].gather(1, targets[:, None])[:, 0], atol=1e-4, rtol=1e-4)
    ref_a = torch.log_softmax(hf_logits(hf, torch.tensor(a.ids)), dim=-1)[7:-1]
    top_val, top_idx = ref_a.topk(3, dim=-1)
    assert out.input_top_logprobs_idx[0] == top_idx.tolist() and out.input_top_logprobs_idx[1] == []
    torch.testing.assert_close(torch.tensor(out.input_top_logprobs_val[0]), top_val, atol=1e-4, rtol=1e-4)


def test_runner_positions_and_offsets():
    config = CONFIGS["llama"]()
    runner = make_runner(config, our_model(config, hf_model(config)))
    batch = ModelWorkerBatch(
        forward_mode=ForwardMode.EXTEND, input_ids=torch.arange(6), req_pool_indices=torch.tensor([1, 2]),
        seq_lens=torch.tensor([7, 3]), out_cache_loc=torch.arange(6) + 1, seq_lens_cpu=[7, 3],
        extend_prefix_lens=[3, 1], extend_seq_lens=[4, 2],
    )
    fb = runner.forward_batch_from(batch)
    assert fb.positions.tolist() == [3, 4, 5, 6, 1, 2]
    assert fb.extend_start_loc.tolist() == [0, 4]
    batch.extend_seq_lens = [4, 1]
    with pytest.raises(ValueError, match="inconsistent EXTEND batch"):
        runner.forward_batch_from(batch)
    assert runner.req_to_token_pool.available_size() == 4  # row 0 is the padding row


def test_tied_model_loads_from_save_pretrained(tmp_path):
    """save_pretrained drops the tied lm_head; loading the file must still work."""
    config = CONFIGS["qwen3"]()
    hf = hf_model(config)
    hf.save_pretrained(tmp_path)
    model = ModelRegistry.resolve(config.architectures)(config)
    model.load_weights(load_file(tmp_path / "model.safetensors").items())
    runner = make_runner(config, model)
    ids = prompts([6])[0]
    out = run_extend(runner, [(Request(runner, ids), 6)])
    torch.testing.assert_close(out.next_token_logits[0], hf_logits(hf, ids)[-1], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "scaling",
    [
        None,
        LLAMA3_ROPE,
        {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
        {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},  # plain inside max_position
    ],
    ids=["default", "llama3", "linear", "dynamic"],
)
def test_rope_matches_hf_inv_freq(scaling):
    """The cos/sin cache equals HF's frequencies at every position up to max_position."""
    config = LlamaConfig(**SHAPE, rope_scaling=scaling)
    rope = get_rope(16, 256, 10000.0, scaling)
    if scaling is None:
        inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 16, 2).float() / 16))
    else:
        inv_freq, _ = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](config, "cpu")
    freqs = torch.arange(256).float()[:, None] * inv_freq
    torch.testing.assert_close(rope.cos_sin_cache[:256], torch.cat((freqs.cos(), freqs.sin()), -1), atol=1e-6, rtol=0)


def test_cpu_tensors_keep_the_torch_path_where_triton_is_installed(monkeypatch):
    """The fused Triton kernels take CUDA tensors only: CPU tensors still run
    the CPU code compared to HF above (a Triton kernel would fail on them):
    the torch references, or for float32 the C kernels that compute the same
    (tests/test_cpu_elementwise.py)."""
    monkeypatch.setattr(triton_ops, "triton_available", lambda: True)
    x, residual, positions = torch.randn(3, 64), torch.randn(3, 64), torch.tensor([0, 5, 9])
    norm, act, rope = RMSNorm(64), SiluAndMul(), get_rope(16, 256, 10000.0)
    pairs = [
        (norm(x, residual), norm.forward_native(x, residual)),
        ((act(x),), (act.forward_native(x),)),
        (rope(positions, x, x[:, :32]), rope.forward_native(positions, x, x[:, :32])),
    ]
    for outs, refs in pairs:
        for a, b in zip(outs, refs, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_registry_errors():
    assert ModelRegistry.supported() == [
        "LlamaForCausalLM", "MistralForCausalLM", "MixtralForCausalLM", "Qwen2ForCausalLM", "Qwen2MoeForCausalLM",
        "Qwen3ForCausalLM", "Qwen3MoeForCausalLM",
    ]
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel.*supported: LlamaForCausalLM"):
        ModelRegistry.resolve(["GPT2LMHeadModel"])
    with pytest.raises(ValueError, match="not supported"):
        ModelRegistry.resolve([])
    assert ModelRegistry.resolve(["Foo", "MistralForCausalLM"]).__name__ == "MistralForCausalLM"


def test_load_weights_rejects_bad_checkpoints():
    config = CONFIGS["llama"]()
    weights = hf_model(config).state_dict()
    model = ModelRegistry.resolve(config.architectures)(config)
    with pytest.raises(ValueError, match="unexpected weight 'model.layers.0.self_attn.rope.weight'"):
        model.load_weights([*weights.items(), ("model.layers.0.self_attn.rope.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match=r"missing.*gate_up_proj.weight\[1\]"):
        model.load_weights((k, v) for k, v in weights.items() if k != "model.layers.1.mlp.up_proj.weight")
    bad = dict(weights, **{"model.layers.0.self_attn.k_proj.weight": torch.zeros(3, 3)})
    with pytest.raises(ValueError, match="k_proj.*shape mismatch"):
        model.load_weights(bad.items())


def test_qwen_sliding_window_is_refused():
    config = Qwen2Config(**SHAPE, use_sliding_window=True, sliding_window=16, architectures=["Qwen2ForCausalLM"])
    with pytest.raises(ValueError, match="sliding"):
        ModelRegistry.resolve(config.architectures)(config)


needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this torch build")


@needs_onednn
@pytest.mark.parametrize("dense_from", ["plain GEMM from 1,024 rows", "oneDNN at every size"])
def test_cpu_prepacked_linear_equals_plain_gemm(monkeypatch, dense_from):
    """Both choices of the GEMM for many rows (the CPU picks one by its vector width) give the plain result."""
    from radixserve.layers import linear as linear_mod
    from radixserve.layers.linear import DENSE_GEMM_MIN_ROWS, QKVParallelLinear

    monkeypatch.setattr(linear_mod, "dense_gemm_min_rows",
                        lambda: DENSE_GEMM_MIN_ROWS if dense_from.startswith("plain") else float("inf"))
    layer = QKVParallelLinear(64, 16, num_heads=4, num_kv_heads=2, bias=True)
    torch.nn.init.normal_(layer.weight)
    torch.nn.init.normal_(layer.bias)
    x = torch.randn(DENSE_GEMM_MIN_ROWS + 5, 64)  # the first 37 rows take oneDNN's GEMM, all of them either
    with torch.inference_mode():
        plain = layer(x)
        assert layer.prepack_for_cpu() and layer.weight.is_mkldnn
        assert layer.prepack_for_cpu() and layer.weight.is_mkldnn  # packing twice is harmless
        packed, few = layer(x), layer(x[:37])
        assert layer(x[:0]).shape == (0, 128) and layer(x[:1]).shape == (1, 128)
        assert layer.weight.is_mkldnn  # a call on many rows leaves the packed weight in place
    torch.testing.assert_close(packed, plain, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(few, plain[:37], rtol=1e-5, atol=1e-4)


@needs_onednn
@pytest.mark.parametrize("tied", [True, False])
def test_model_runner_prepacks_linears_and_lm_head_on_cpu(tied):
    """Every test here that runs a model through a ModelRunner on the CPU thus
    compares the prepacked GEMMs against HF."""
    config = LlamaConfig(**SHAPE, tie_word_embeddings=tied, architectures=["LlamaForCausalLM"])
    model = our_model(config, hf_model(config))
    embedding = model.model.embed_tokens.weight.detach().clone()
    make_runner(config, model)
    layer = model.model.layers[0]
    for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
        assert linear.weight.is_mkldnn
    assert model.lm_head.lm_head_weight().is_mkldnn
    torch.testing.assert_close(model.lm_head.lm_head_weight().to_dense(), model.lm_head.weight.to_dense())
    assert not model.model.embed_tokens.weight.is_mkldnn  # lookups still read the plain matrix
    assert torch.equal(model.model.embed_tokens.weight, embedding)


_REUSE_PROBE = """
import ctypes, resource, sys
from radixserve.model_executor.cpu_malloc import reuse_freed_memory
assert reuse_freed_memory(sys.argv[1] == "tuned")
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
size = 8 << 20
def use():  # an activation's life: allocated, written, freed
    block = libc.malloc(size)
    ctypes.memset(block, 1, size)
    libc.free(block)
use()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(4):
    use()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.parametrize("setting", ["tuned", "default"])
def test_glibc_malloc_keeps_freed_blocks_for_reuse(setting):
    """With the settings applied, an 8 MB block freed and allocated again is
    served from pages the heap kept: no page faults. With glibc's defaults it
    is a fresh mmap each time (2,048 faults per use), and with a trim
    threshold of 0 (what a value too wide for mallopt's int became) the heap
    gave the pages back at every free."""
    import subprocess
    import sys

    if not sys.platform.startswith("linux"):
        pytest.skip("glibc only")
    out = subprocess.run([sys.executable, "-c", _REUSE_PROBE, setting], capture_output=True, text=True, check=True)
    faults = int(out.stdout.strip())
    pages = 4 * (8 << 20) // 4096
    if setting == "tuned":
        assert faults < pages // 20, faults
    else:
        assert faults > pages // 2, faults


def test_the_heap_figures_start_no_process(monkeypatch):
    """/get_server_info reads them in the scheduler's loop: the C library is
    looked up once (``find_library`` runs ``ldconfig``), not at every call."""
    import subprocess

    from radixserve.model_executor.cpu_malloc import heap_figures

    first = heap_figures()
    children, popen_init = [], subprocess.Popen.__init__

    def counted(self, *args, **kwargs):
        children.append(args[0] if args else kwargs.get("args"))
        popen_init(self, *args, **kwargs)

    monkeypatch.setattr(subprocess.Popen, "__init__", counted)
    again = heap_figures()
    assert children == [] and again.keys() == first.keys()


def test_the_heap_trimmer_returns_what_freed_blocks_keep():
    """With freed blocks kept (reuse_freed_memory), a heap of freed tensors
    stays resident until the trimmer gives it back; the memory in use stays."""
    import sys

    from radixserve.model_executor.cpu_malloc import HeapTrimmer, heap_figures, reuse_freed_memory

    if not sys.platform.startswith("linux") or "malloc_free_bytes" not in heap_figures():
        pytest.skip("glibc 2.33 or later only")
    assert reuse_freed_memory()
    try:
        blocks = [torch.ones(256 * 1024 + 97 * i, dtype=torch.uint8) for i in range(800)]  # about 230 MB
        keep = blocks[::8]
        del blocks
        held = heap_figures()
        assert held["malloc_free_bytes"] > 150 << 20  # freed, kept by malloc, still resident
        trimmer = HeapTrimmer(interval_s=3600)
        trimmer.busy()  # not due yet
        assert trimmer.returned_bytes == 0
        trimmer.idle()
        after = heap_figures()
        assert trimmer.returned_bytes > 150 << 20 and held["rss_bytes"] - after["rss_bytes"] > 150 << 20
        assert abs(after["malloc_in_use_bytes"] - held["malloc_in_use_bytes"]) < 8 << 20 and len(keep) == 100
    finally:
        reuse_freed_memory(False)
