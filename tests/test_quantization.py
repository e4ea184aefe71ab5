"""Online fp8 quantization (``--quantization fp8``, layers/quantization.py) on
the CPU: the row quantizer, the fp8 linear layers against their dequantized
weights, and the Engine against HF transformers whose linear layers are
fake-quantized the same way (weights per output channel, inputs per token, in
float8 e4m3; the LM head left alone), in float32."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

import radixserve
from radixserve.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from radixserve.layers.quantization import FP8_MAX, fp8_linear, quantize_fp8_rows
from radixserve.server_args import ServerArgs

E4M3 = torch.float8_e4m3fn


def fake_quantize_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` rounded through e4m3 row by row (scale amax / 448), in its own dtype."""
    scale = t.float().abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / 448.0
    return ((t.float() / scale).clamp(-448.0, 448.0).to(E4M3).float() * scale).to(t.dtype)


def fake_quantize_rows_in_chunks(t: torch.Tensor, chunks: int) -> torch.Tensor:
    """:func:`fake_quantize_rows` over each of ``chunks`` equal slices of the
    last dimension on its own (a row-parallel layer's columns on each TP rank)."""
    return torch.cat([fake_quantize_rows(c) for c in t.chunk(chunks, dim=-1)], dim=-1)


def fake_quantize_fp8(hf: nn.Module, tp_size: int = 1, quantized_rows: list[int] | None = None) -> nn.Module:
    """HF's model with every ``nn.Linear`` but the LM head computing on
    e4m3-rounded weights (per output row) and inputs (per token). Under
    ``tp_size`` ranks the row-parallel layers (o_proj, down_proj) are split
    along their input, so each rank scales its own slice of a row or token.
    ``quantized_rows``, a one-element list set before each forward, limits
    the rounded inputs to the first that many positions: a prompt's prefill
    rows, while the decode rows after them stay as they are, as the skinny fp8
    kernel takes a decode batch's activations on a GPU."""
    def round_inputs(_, args, n):
        x = args[0]
        if quantized_rows is None:
            return (fake_quantize_rows_in_chunks(x, n),)
        p = quantized_rows[0]
        return (torch.cat([fake_quantize_rows_in_chunks(x[..., :p, :], n), x[..., p:, :]], dim=-2),)

    for name, module in hf.named_modules():
        if isinstance(module, nn.Linear) and not name.endswith("lm_head"):
            chunks = tp_size if name.endswith(("o_proj", "down_proj")) else 1
            module.weight.data = fake_quantize_rows_in_chunks(module.weight.data, chunks)
            module.register_forward_pre_hook(lambda mod, args, n=chunks: round_inputs(mod, args, n))
    return hf


def test_rows_quantize_to_their_amax_and_back():
    x = torch.randn(5, 300) * torch.tensor([1e-3, 1.0, 30.0, 1.0, 1.0])[:, None]
    x[3] = 0.0
    q, scale = quantize_fp8_rows(x)
    assert q.dtype == E4M3 and scale.shape == (5, 1) and scale.dtype == torch.float32
    assert torch.isfinite(scale).all() and (scale > 0).all()
    rows = [0, 1, 2, 4]
    assert torch.equal(q[rows].float().abs().amax(dim=-1), torch.full((4,), FP8_MAX))  # each row's amax is 448
    assert not q[3].float().any()  # a zero row stays zero
    err = (q.float() * scale - x).abs()
    assert (err <= x.abs() / 16 + scale * 2.0**-9).all()  # e4m3: 3 mantissa bits, subnormals below 2^-6


@pytest.mark.parametrize("make", [
    lambda: ColumnParallelLinear(96, 40, bias=True),
    lambda: RowParallelLinear(96, 40, bias=True),
    lambda: QKVParallelLinear(96, 16, 4, 2),
], ids=["column", "row", "qkv"])
def test_fp8_layers_compute_on_their_dequantized_weights(make):
    torch.manual_seed(0)
    layer = make()
    layer.weight.data.normal_(0, 0.1)
    if layer.bias is not None:
        layer.bias.data.normal_()
    plain = layer.weight.data.clone()
    x = torch.randn(2, 7, 96)
    exact = nn.functional.linear(x, plain, layer.bias)
    layer.quantize_fp8()
    assert layer.weight.dtype == E4M3 and layer.weight_scale.shape == (1, layer.weight.shape[0])
    assert not layer.prepack_for_cpu()  # oneDNN's packed GEMM has no fp8: the layer keeps _scaled_mm
    reference = nn.functional.linear(fake_quantize_rows(x), layer.weight.float() * layer.weight_scale.t(), layer.bias)
    y = layer(x)
    assert y.shape == (2, 7, layer.weight.shape[0]) and y.dtype == x.dtype
    torch.testing.assert_close(y, reference, rtol=1e-5, atol=1e-5)
    assert 0.005 < (y - exact).norm() / exact.norm() < 0.08  # fp8's rounding, not a different product
    with pytest.raises(RuntimeError, match="once"):
        layer.quantize_fp8()


@pytest.mark.parametrize("fp8", [False, True], ids=["plain", "fp8"])
def test_gated_forward_off_cuda_is_the_activation_of_the_product(fp8):
    """``forward_gated`` (the MLP's gate_up with SiLU-and-mul) where the
    skinny kernel does not run (the CPU): the layer's output, then the
    activation, for a plain and an fp8 weight, at the rows it would fuse."""
    from radixserve.layers.activation import SiluAndMul
    from radixserve.layers.linear import MergedColumnParallelLinear
    from radixserve.layers.quantization import GATED_ROWS, gated_linear

    torch.manual_seed(0)
    layer = MergedColumnParallelLinear(96, [40, 40], bias=True)
    layer.weight.data.normal_(0, 0.1)
    layer.bias.data.normal_()
    if fp8:
        layer.quantize_fp8()
    x = torch.randn(GATED_ROWS[0], 96)
    torch.testing.assert_close(layer.forward_gated(x, SiluAndMul()), SiluAndMul().forward_native(layer(x)),
                               rtol=0, atol=0)
    assert gated_linear(x, layer.weight, layer.weight_scale, layer.bias) is None  # no kernel here


def test_fp8_linear_of_no_rows():
    q, scale = quantize_fp8_rows(torch.randn(8, 16))
    assert fp8_linear(torch.empty(0, 16), q, scale.reshape(1, -1)).shape == (0, 8)


def test_unknown_quantization_is_refused():
    with pytest.raises(ValueError, match="quantization"):
        ServerArgs(quantization="int4")
    assert ServerArgs(quantization="fp8").quantization == "fp8"


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """(folder, a loader of fresh HF copies of the model)."""
    from test_engine import CONFIGS

    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("llama_fp8")
    AutoModelForCausalLM.from_config(CONFIGS["llama"](), dtype=torch.float32).save_pretrained(folder)
    return str(folder), lambda: AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@torch.no_grad()
def _hf_token_logprobs(hf, ids: list[int]) -> torch.Tensor:
    """HF's logprob of each of ``ids[1:]`` given the tokens before it."""
    logprobs = torch.log_softmax(hf(torch.tensor([ids])).logits[0, :-1].float(), dim=-1)
    return logprobs.gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


@pytest.mark.parametrize("tp", [1, 2])
def test_engine_fp8_matches_fake_quantized_hf(tiny_llama, tp):
    """The prompts' logprobs (one extend each) equal HF's with fake-quantized
    linear layers up to float rounding, and are far from the plain model's;
    greedy outputs are the fake-quantized HF's argmax wherever its top-2
    margin is clear (a decode's rows round across e4m3 steps a little
    differently from an extend's, and the random model amplifies that).
    Under TP (gloo ranks) each rank quantizes its own shard: the reference
    scales o_proj's and down_proj's halves on their own."""
    folder, load = tiny_llama
    hf, hf_fp8 = load(), fake_quantize_fp8(load(), tp_size=tp)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 320, (n,), generator=gen).tolist() for n in (40, 7, 100, 23)]
    with radixserve.Engine(model_path=folder, device="cpu", quantization="fp8", max_total_tokens=2048, tp_size=tp,
                           dist_timeout=60, check_invariants=True, disable_tqdm=True) as eng:
        if tp == 1:
            assert eng.scheduler.model_runner.model.model.layers[0].mlp.down_proj.weight.dtype == E4M3
        scored = eng.generate(input_ids=prompts, sampling_params={"max_new_tokens": 0}, return_logprob=True,
                              logprob_start_len=0)
        outs = eng.generate(input_ids=prompts, sampling_params={"temperature": 0, "max_new_tokens": 16, "ignore_eos": True})
        eng.scheduler.check_memory()
    to_fp8, to_plain = [], []
    for prompt, out in zip(prompts, scored):
        ours = torch.tensor([lp for lp, _ in out["meta_info"]["input_token_logprobs"][1:]])
        to_fp8.append((ours - _hf_token_logprobs(hf_fp8, prompt)).abs())
        to_plain.append((ours - _hf_token_logprobs(hf, prompt)).abs())
    to_fp8, to_plain = torch.cat(to_fp8), torch.cat(to_plain)
    assert to_fp8.median() < 1e-4 and to_fp8.mean() < 0.01
    assert to_plain.mean() > 0.05  # the quantization is really applied
    checked = 0
    for prompt, out in zip(prompts, outs):
        ids = prompt + out["output_ids"]
        with torch.no_grad():
            top2 = torch.log_softmax(hf_fp8(torch.tensor([ids])).logits[0, len(prompt) - 1:-1], dim=-1).topk(2)
        for k, tok in enumerate(out["output_ids"]):
            if top2.values[k, 0] - top2.values[k, 1] > 0.5:
                assert tok == int(top2.indices[k, 0]), f"step {k} of a {len(prompt)}-token prompt"
                checked += 1
    assert checked >= 6  # a 64-wide random model: most steps are near-ties
