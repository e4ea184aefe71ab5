"""Multi-LoRA on the GPU (GPU only): the segmented Triton kernels in bf16
against a float32 reference at model sizes and under CUDA graph capture and
replay; and the Engine with ``--lora-backend triton`` and CUDA graphs (decode
and piecewise extends) against HF transformers + peft, one batch mixing three
adapters of ranks 8, 16 and 64 and the base model.

Our greedy tokens must be HF + peft's argmax wherever its top-2 margin is
clear, and our logprobs match within bf16 tolerance (as tests/test_gpu_engine.py).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

import radixserve
from test_lora_kernels import ACT_CASES, CASES, make_case, reference, silu_and_mul

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
peft = pytest.importorskip("peft")

# max |kernel - reference| / max |reference| in bf16 (inputs and outputs rounded once each)
BF16_TOLERANCE = 2e-2
# (rows, K, parts, OUT, R, slots, share without an adapter): llama-3.1-8b's q|k|v, gate|up and down at rank 16
MODEL_CASES = [
    (1, 4096, [(0, 4096), (4096, 1024), (5120, 1024)], 6144, 16, 8, 0.0),
    (32, 4096, [(0, 14336), (14336, 14336)], 28672, 16, 4, 0.1),
    (256, 14336, [(0, 4096)], 4096, 16, 8, 0.2),
    (1000, 4096, [(0, 4096), (4096, 1024), (5120, 1024)], 6144, 64, 3, 0.3),
]


def _relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.float().cpu() - ref).abs().max() / ref.abs().max())


@pytest.mark.parametrize("case", CASES + [("model", *c) for c in MODEL_CASES], ids=lambda c: f"{c[0]}-{c[1]}rows")
def test_kernels_in_bf16(case):
    from radixserve.lora.triton_ops import build_table, lora_delta

    _, rows, k, parts, out, R, slots, none_share = case
    x, y, A, B, scaling, bounds, row_slots, ranks = make_case(rows, k, parts, out, R, slots, none_share, seed=rows,
                                                              device="cuda", dtype=torch.bfloat16)
    ref = reference(x, y, A, B, scaling, parts, row_slots, ranks, R)
    got = lora_delta(x, y.clone(), A, B, build_table(row_slots, rows).to(torch.device("cuda")), scaling, bounds, R)
    assert _relative_error(got, ref) < BF16_TOLERANCE


@pytest.mark.parametrize("case", CASES + [("model", *c) for c in MODEL_CASES], ids=lambda c: f"{c[0]}-{c[1]}rows")
def test_stacked_expand_in_bf16(case):
    """One GEMM over ``[W; A_0; ...]`` (the rank columns rounded to bf16 as
    it writes them), then the expand over its rank columns: in place, and
    into a contiguous tensor; and captured in a CUDA graph over a static
    table, replayed with another batch."""
    from radixserve.lora.triton_ops import StaticKernelTable, build_table, stacked_delta

    _, rows, k, parts, out, R, slots, none_share = case
    x, y, A, B, scaling, bounds, row_slots, ranks = make_case(rows, k, parts, out, R, slots, none_share, seed=rows,
                                                              device="cuda", dtype=torch.bfloat16)
    W = torch.randn(out, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    Ws = torch.cat([W, A.flatten(0, 1)])
    base = (x @ W.T).float().cpu()
    ref = reference(x, base, A, B, scaling, parts, row_slots, ranks, R)
    table = build_table(row_slots, rows).to(torch.device("cuda"))
    for contiguous in (False, True):
        got = stacked_delta(x @ Ws.T, out, B, table, scaling, bounds, R, A.shape[1], contiguous)
        assert got.is_contiguous() or not contiguous
        assert _relative_error(got, ref) < BF16_TOLERANCE, contiguous
    static = StaticKernelTable(rows, slots, x.device)
    ys = torch.empty(rows, Ws.shape[0], device="cuda", dtype=torch.bfloat16)
    graph, got = _captured(lambda: stacked_delta(torch.matmul(x, Ws.T, out=ys), out, B, static.view(rows), scaling,
                                                 bounds, R, A.shape[1], True))
    other = np.random.default_rng(rows).integers(-1, slots, rows)
    static.fill(other, rows)
    graph.replay()
    assert _relative_error(got, reference(x, base, A, B, scaling, parts, other, ranks, R)) < BF16_TOLERANCE


def _captured(launch):
    """``launch`` run once on a side stream (compiling outside the capture),
    then captured: the graph and what the captured call returned."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        launch()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = launch()
    return graph, out


def test_kernels_under_a_cuda_graph():
    """Captured once over a static table, replayed with batches of other adapters and sizes."""
    from radixserve.lora.triton_ops import StaticKernelTable, lora_delta

    rows, k, parts, out, R, slots = 64, 512, [(0, 256), (256, 128)], 384, 16, 4
    x, y, A, B, scaling, bounds, _, ranks = make_case(rows, k, parts, out, R, slots, 0.0, seed=0, device="cuda",
                                                      dtype=torch.bfloat16)
    static = StaticKernelTable(rows, slots, x.device)
    xs, ys = x.clone(), torch.zeros_like(y)
    graph, _ = _captured(lambda: lora_delta(xs, ys, A, B, static.view(rows), scaling, bounds, R))
    rng = np.random.default_rng(1)
    for n, none_share in ((rows, 0.0), (17, 0.5), (1, 0.0), (40, 1.0)):
        row_slots = rng.integers(0, slots, n)
        row_slots[rng.random(n) < none_share] = -1
        static.fill(row_slots, rows)
        ys.copy_(y)
        graph.replay()
        ref = reference(x[:n], y[:n], A, B, scaling, parts, row_slots, ranks, R)
        assert _relative_error(ys[:n], ref) < BF16_TOLERANCE
        assert torch.equal(ys[n:], y[n:]), "rows past the batch gained a delta"


def test_static_table_fill_does_not_wait_for_the_stream():
    """Under overlap scheduling a step's table is copied in while the step
    before still runs on the forward's stream: the host must not wait for it
    (as a copy from pageable memory may). The stream is still busy when
    ``fill`` returns, and the graph's buffers then hold the new table."""
    from radixserve.lora.triton_ops import StaticKernelTable, blocks_for, build_table

    rows, slots = 256, 8
    static = StaticKernelTable(rows, slots, torch.device("cuda"))
    row_slots = np.random.default_rng(0).integers(-1, slots, 200)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(2_000_000_000)  # about a second of a busy stream
        static.fill(row_slots, rows)
        assert not stream.query(), "fill waited for the work queued before it"
    stream.synchronize()
    want = build_table(row_slots, rows, blocks_for(rows, slots))
    assert torch.equal(static.rows[:rows].cpu(), want.rows)
    assert torch.equal(static.blocks[: want.all_blocks.shape[0]].cpu(), want.all_blocks)


# llama-3.1-8b's gate|up at rank 16: decode batches, and a prefill of several blocks of 64 rows
GATE_UP_CASES = [(rows, 4096, [(0, 14336), (14336, 14336)], 28672, 16, 8, 0.2) for rows in (1, 32, 256, 2000)]


@pytest.mark.parametrize("case", ACT_CASES + [("model", *c) for c in GATE_UP_CASES], ids=lambda c: f"{c[0]}-{c[1]}rows")
def test_expand_with_silu_and_mul_in_bf16(case):
    """The fused gate|up expand and SiLU-and-mul against the float32
    reference, and against the unfused kernels (the expand, then
    silu_and_mul), whose roundings it keeps: equal to within one bf16 step."""
    from radixserve.layers.triton_ops.activation import silu_and_mul as silu_kernel
    from radixserve.lora.triton_ops import build_table, expand_silu_and_mul, lora_delta

    _, rows, k, parts, out, R, slots, none_share = case
    x, y, A, B, scaling, bounds, row_slots, ranks = make_case(rows, k, parts, out, R, slots, none_share, seed=rows,
                                                              device="cuda", dtype=torch.bfloat16)
    table = build_table(row_slots, rows).to(torch.device("cuda"))
    got = expand_silu_and_mul(x, y, A, B, table, scaling, bounds, R)
    ref = silu_and_mul(reference(x, y, A, B, scaling, parts, row_slots, ranks, R))
    assert _relative_error(got, ref) < BF16_TOLERANCE
    unfused = silu_kernel(lora_delta(x, y.clone(), A, B, table, scaling, bounds, R)).float()
    assert torch.allclose(got.float(), unfused, rtol=2**-7, atol=1e-6), float((got.float() - unfused).abs().max())


def test_expand_with_silu_and_mul_under_a_cuda_graph():
    """Captured once over a static table, replayed with batches of other
    adapters and sizes; the graph's rows past the batch get SiLU-and-mul of
    their own values."""
    from radixserve.lora.triton_ops import StaticKernelTable, expand_silu_and_mul

    rows, k, parts, out, R, slots = 64, 512, [(0, 192), (192, 192)], 384, 16, 4
    x, y, A, B, scaling, bounds, _, ranks = make_case(rows, k, parts, out, R, slots, 0.0, seed=0, device="cuda",
                                                      dtype=torch.bfloat16)
    static = StaticKernelTable(rows, slots, x.device)
    graph, got = _captured(lambda: expand_silu_and_mul(x, y, A, B, static.view(rows), scaling, bounds, R))
    rng = np.random.default_rng(1)
    for n, none_share in ((rows, 0.0), (17, 0.5), (1, 0.0), (40, 1.0)):
        row_slots = rng.integers(0, slots, n)
        row_slots[rng.random(n) < none_share] = -1
        static.fill(row_slots, rows)
        graph.replay()
        ref = silu_and_mul(reference(x[:n], y[:n], A, B, scaling, parts, row_slots, ranks, R))
        assert _relative_error(got[:n], ref) < BF16_TOLERANCE
        if n < rows:
            assert _relative_error(got[n:], silu_and_mul(y[n:].cpu())) < BF16_TOLERANCE


SHAPE = dict(vocab_size=4096, hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=2, max_position_embeddings=4096, initializer_range=0.1)
ADAPTERS = {"a8": (8, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
            "a16": (16, ["q_proj", "v_proj", "down_proj"]), "a64": (64, ["k_proj", "o_proj", "gate_proj", "up_proj"])}
PROMPT_LENS = (5, 300, 1, 77, 600, 33, 128, 9)
OUTPUT_LENS = (24, 3, 17, 1, 32, 9, 24, 12)
NAMES = ("a8", None, "a16", "a64", "a8", "a64", None, "a16")
MARGIN = 0.5
LOGPROB_MAX_DIFF, LOGPROB_MEAN_DIFF = 0.35, 0.08


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(base folder, {name: adapter folder}, HF + peft with every adapter, on the GPU in bf16)."""
    root = tmp_path_factory.mktemp("gpu-lora")
    torch.manual_seed(0)
    config = LlamaConfig(**SHAPE, rope_theta=500000.0, architectures=["LlamaForCausalLM"])
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(root / "base")
    folders, model = {}, None
    for i, (name, (r, modules)) in enumerate(ADAPTERS.items()):
        torch.manual_seed(100 + i)
        base = AutoModelForCausalLM.from_pretrained(root / "base", dtype=torch.bfloat16)
        m = peft.get_peft_model(base, peft.LoraConfig(r=r, lora_alpha=2 * r, target_modules=modules, lora_dropout=0.0))
        with torch.no_grad():
            for pname, param in m.named_parameters():
                if "lora_B" in pname:
                    param.normal_(0, 0.05)
        m.save_pretrained(root / name)
        folders[name] = str(root / name)
    base = AutoModelForCausalLM.from_pretrained(root / "base", dtype=torch.bfloat16).cuda().eval()
    model = peft.PeftModel.from_pretrained(base, folders["a8"], adapter_name="a8")
    for name in ("a16", "a64"):
        model.load_adapter(folders[name], adapter_name=name)
    return str(root / "base"), folders, model.eval()


@torch.no_grad()
def _hf_logprobs(model, name, prompt, output) -> torch.Tensor:
    ids = torch.tensor([prompt + output], device="cuda")
    if name is None:
        with model.disable_adapter():
            logits = model(input_ids=ids).logits
    else:
        model.set_adapter(name)
        logits = model(input_ids=ids).logits
    return torch.log_softmax(logits[0, len(prompt) - 1 : len(prompt) + len(output) - 1].float(), dim=-1).cpu()


def test_engine_with_graphs_matches_hf_peft(checkpoint):
    base, folders, model = checkpoint
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, SHAPE["vocab_size"], (n,), generator=gen).tolist() for n in PROMPT_LENS]
    params = [{"temperature": 0, "max_new_tokens": n, "ignore_eos": True} for n in OUTPUT_LENS]
    with radixserve.Engine(model_path=base, device="cuda", dtype="bfloat16", max_running_requests=16,
                           max_total_tokens=16384, lora_paths=[f"{n}={p}" for n, p in folders.items()],
                           check_invariants=True, disable_tqdm=True) as eng:
        runner = eng.scheduler.model_runner
        assert runner.cuda_graph_runner is not None and runner.piecewise_runner is not None
        assert runner.lora_manager.kernels
        outs = eng.generate(input_ids=prompts, sampling_params=params, lora_path=list(NAMES), return_logprob=True)
        again = eng.generate(input_ids=prompts, sampling_params=params, lora_path=list(NAMES))  # radix hits
        assert all(o["meta_info"]["cached_tokens"] > 0 for o, n in zip(again, PROMPT_LENS) if n > 16)
    checked, diffs = 0, []
    for prompt, name, out, out2 in zip(prompts, NAMES, outs, again):
        ref = _hf_logprobs(model, name, prompt, out["output_ids"])
        diffs += [abs(lp - float(ref[k, tok])) for k, (lp, tok) in enumerate(out["meta_info"]["output_token_logprobs"])]
        for output in (out["output_ids"], out2["output_ids"]):
            top2 = _hf_logprobs(model, name, prompt, output).topk(2, dim=-1)
            for k, tok in enumerate(output):
                if top2.values[k, 0] - top2.values[k, 1] > MARGIN:
                    assert tok == int(top2.indices[k, 0]), f"adapter {name}, step {k} of a {len(prompt)}-token prompt"
                    checked += 1
    print(f"logprob |diff| vs HF + peft: max {max(diffs):.3f} mean {sum(diffs) / len(diffs):.4f}; {checked} checked")
    assert max(diffs) <= LOGPROB_MAX_DIFF and sum(diffs) / len(diffs) <= LOGPROB_MEAN_DIFF
    assert checked >= 2 * sum(OUTPUT_LENS) // 3
