"""Mixtures of experts (docs/moe.md) on the CPU: routing and the torch path
of the experts against plain references; tiny random Qwen3-MoE, Mixtral and
Qwen2-MoE models through the offline Engine against HF transformers greedy
decoding (float32), with radix hits, chunked prefill and mixed batches; the
same tokens under tensor and expert parallelism over gloo; the flags'
errors; the experts' load in /metrics."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

import radixserve
from radixserve.configs.model_config import ModelConfig
from radixserve.layers.moe.layer import FusedMoE
from radixserve.layers.moe.native import moe_forward_native, moe_forward_reference
from radixserve.layers.moe.topk import select_experts
from radixserve.managers.metrics import ServerMetrics
from radixserve.model_loader import dummy_config
from radixserve.models.registry import ModelRegistry
from radixserve.server_args import ServerArgs

VOCAB = 320
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=512, initializer_range=0.1)
CONFIGS = {
    # layer 1 is dense (mlp_only_layers), as HF builds it
    "qwen3_moe": lambda: Qwen3MoeConfig(**SHAPE, head_dim=16, intermediate_size=96, moe_intermediate_size=32,
                                        num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                                        mlp_only_layers=[1], architectures=["Qwen3MoeForCausalLM"]),
    "mixtral": lambda: MixtralConfig(**SHAPE, intermediate_size=48, num_local_experts=8, num_experts_per_tok=2,
                                     architectures=["MixtralForCausalLM"]),
    # a shared expert with its sigmoid gate; every second layer sparse; no renormalisation
    "qwen2_moe": lambda: Qwen2MoeConfig(**SHAPE, intermediate_size=96, moe_intermediate_size=32,
                                        shared_expert_intermediate_size=48, num_experts=8, num_experts_per_tok=2,
                                        decoder_sparse_step=2, architectures=["Qwen2MoeForCausalLM"]),
}
GREEDY = {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True}


def save_hf(name, folder):
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(CONFIGS[name](), dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    hf.save_pretrained(folder)  # per-expert tensors, as real checkpoints have them
    return str(folder), hf


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def tiny(request, tmp_path_factory):
    return save_hf(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    return save_hf("qwen3_moe", tmp_path_factory.mktemp("qwen3_moe_tp"))


def prompts(lengths, seed=0, shared=()):
    gen = torch.Generator().manual_seed(seed)
    return [list(shared) + torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in lengths]


@torch.no_grad()
def hf_greedy(hf, ids, n):
    return hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, min_new_tokens=n)[0, len(ids):].tolist()


# -- routing and the experts' torch path ------------------------------------------------


@pytest.mark.parametrize("renormalize", [False, True])
def test_select_experts_is_hf_routing(renormalize):
    logits = torch.randn(7, 8, generator=torch.Generator().manual_seed(1))
    weights, ids = select_experts(logits, 3, renormalize)
    probs = torch.softmax(logits.float(), -1)
    ref_w, ref_ids = probs.topk(3, -1)
    if renormalize:
        ref_w = ref_w / ref_w.sum(-1, keepdim=True)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32
    assert ids.tolist() == ref_ids.tolist()
    torch.testing.assert_close(weights, ref_w)


def test_native_experts_match_a_per_token_reference_and_skip_minus_one():
    gen = torch.Generator().manual_seed(2)
    T, H, inter, E, k = 11, 16, 24, 6, 3
    hidden, w13, w2 = torch.randn(T, H, generator=gen), torch.randn(E, 2 * inter, H, generator=gen), torch.randn(E, H, inter, generator=gen)
    weights = torch.rand(T, k, generator=gen)
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)]).int()
    ids[0, 1] = ids[4, :] = -1  # choices another rank computes; token 4 has none here
    out = moe_forward_native(hidden, w13, w2, weights, ids)
    torch.testing.assert_close(out, moe_forward_reference(hidden, w13, w2, weights, ids), rtol=1e-4, atol=1e-4)
    assert out[4].abs().max() == 0
    assert moe_forward_native(hidden[:0], w13, w2, weights[:0], ids[:0]).shape == (0, H)


def test_expert_weights_load_per_expert_or_stacked_and_missing_ones_are_named():
    gen = torch.Generator().manual_seed(3)
    E, H, inter = 4, 8, 6
    gate, up, down = torch.randn(E, inter, H, generator=gen), torch.randn(E, inter, H, generator=gen), torch.randn(E, H, inter, generator=gen)
    stacked = FusedMoE(E, 2, H, inter, renormalize=True)
    stacked.weight_loader(stacked.w13_weight, torch.cat([gate, up], 1), "w13")
    stacked.weight_loader(stacked.w2_weight, down, "w2")
    per_expert = FusedMoE(E, 2, H, inter, renormalize=True)
    for e in range(E):
        per_expert.weight_loader(per_expert.w13_weight, gate[e], ("gate", e))
        per_expert.weight_loader(per_expert.w13_weight, up[e], ("up", e))
        if e != 2:
            per_expert.weight_loader(per_expert.w2_weight, down[e], ("down", e))
    assert stacked.missing() == [] and per_expert.missing() == ["experts.2.down"]
    assert torch.equal(stacked.w13_weight, per_expert.w13_weight)
    with pytest.raises(ValueError, match="shape mismatch"):
        per_expert.weight_loader(per_expert.w2_weight, down[0].T, ("down", 0))


def test_a_checkpoint_without_an_expert_fails_to_load():
    config = CONFIGS["mixtral"]()
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model = ModelRegistry.resolve(config.architectures)(config)
    weights = [(n, t) for n, t in hf.state_dict().items() if not n.endswith("layers.2.mlp.experts.down_proj")]
    with pytest.raises(ValueError, match=r"missing.*layers\.2\.mlp\.experts\.0\.down"):
        model.load_weights(weights)


# -- the models end to end against HF ---------------------------------------------------


def test_greedy_tokens_match_hf_with_cache_hits_chunks_and_mixed_batches(tiny):
    """Chunks of 16 tokens, running requests riding in prefills (mixed
    batches), then prompts that share a prefix cached by the first batch."""
    folder, hf = tiny
    shared = prompts([40], seed=5)[0]
    first = prompts([37, 5, 21], seed=1, shared=shared[:0]) + [shared + [1, 2]]
    second = prompts([6, 19], seed=2, shared=shared)
    with radixserve.Engine(model_path=folder, device="cpu", check_invariants=True, disable_tqdm=True,
                           chunked_prefill_size=16, enable_mixed_chunk=True, max_total_tokens=2048,
                           max_running_requests=8) as eng:
        for batch in (first, second):
            outs = eng.generate(input_ids=batch, sampling_params=GREEDY)
            assert [o["output_ids"] for o in outs] == [hf_greedy(hf, ids, GREEDY["max_new_tokens"]) for ids in batch]
        assert all(o["meta_info"]["cached_tokens"] >= 32 for o in outs), "the shared prefix came from the cache"
        stats = eng.get_stats()
    assert stats["moe_expert_tokens_count"] > 0


# -- tensor and expert parallelism (gloo) ------------------------------------------------


@pytest.mark.parametrize("parallel", [
    dict(tp_size=2),  # every expert's intermediate dimension sharded
    dict(tp_size=2, ep_size=2),  # whole experts per rank, all-reduce
    dict(tp_size=2, ep_size=2, moe_a2a_backend="all_to_all"),
], ids=["tp2", "tp2-ep2", "tp2-ep2-a2a"])
def test_tensor_and_expert_parallel_give_hf_tokens(qwen3_moe, parallel):
    folder, hf = qwen3_moe
    batch = prompts([23, 1, 9], seed=3)
    params = {**GREEDY, "max_new_tokens": 6}
    with radixserve.Engine(model_path=folder, device="cpu", check_invariants=True, disable_tqdm=True,
                           chunked_prefill_size=16, max_total_tokens=1024, max_running_requests=4, dist_timeout=60,
                           **parallel) as eng:
        outs = eng.generate(input_ids=batch, sampling_params=params)
    assert [o["output_ids"] for o in outs] == [hf_greedy(hf, ids, params["max_new_tokens"]) for ids in batch]


def test_dummy_experts_are_the_same_model_at_every_ep_size():
    """Dummy weights draw every expert whole and each rank keeps its own; a
    lone one-token request leaves one all-to-all rank without tokens."""
    opts = dict(model_path="tiny-mixtral", load_format="dummy", device="cpu", dtype="float32", disable_tqdm=True,
                max_total_tokens=512, max_running_requests=4, dist_timeout=60)
    batch = prompts([12, 4], seed=4)
    runs = []
    for parallel in (dict(), dict(tp_size=2, ep_size=2, moe_a2a_backend="all_to_all")):
        with radixserve.Engine(**opts, **parallel) as eng:
            outs = eng.generate(input_ids=batch, sampling_params=GREEDY)
            lone = eng.generate(input_ids=[[5]], sampling_params=GREEDY)
            runs.append([o["output_ids"] for o in outs + lone])
    assert runs[0] == runs[1]


# -- flags ------------------------------------------------------------------------------


@pytest.mark.parametrize("options, message", [
    (dict(tp_size=4, ep_size=3), "ep_size 3 must divide tp_size 4"),
    (dict(tp_size=2, ep_size=4), "ep_size 4 must divide tp_size 2"),
    (dict(ep_size=0), "ep_size must be >= 1"),
    (dict(moe_a2a_backend="deepep"), "deepep.*RDMA.*this build lacks"),
    (dict(tp_size=2, ep_size=2, moe_a2a_backend="mooncake"), "mooncake.*RDMA.*this build lacks"),
    (dict(tp_size=2, moe_a2a_backend="all_to_all"), "all_to_all.*--ep-size equal to --tp-size"),
    (dict(moe_a2a_backend="nccl"), "moe_a2a_backend must be one of"),
])
def test_bad_expert_parallel_flags_fail_at_start_up(options, message):
    with pytest.raises(ValueError, match=message):
        ServerArgs(**options)


def test_experts_and_models_that_do_not_split_are_refused():
    def config(name, **fields):
        hf_config = dummy_config(name)
        for key, value in fields.items():
            setattr(hf_config, key, value)
        return ModelConfig(name, hf_config, "dummy", None, None, torch.float32)

    with pytest.raises(ValueError, match="--ep-size splits a mixture of experts"):
        config("tiny-llama").check_tensor_parallel(2, ep_size=2)
    with pytest.raises(ValueError, match="ep_size 16 must divide the model's 8 experts"):
        config("mixtral-8x7b").check_tensor_parallel(16, ep_size=16)
    with pytest.raises(ValueError, match="intermediate size 34 is not divisible by tp_size / ep_size = 4"):
        config("tiny-qwen3-moe", moe_intermediate_size=34).check_tensor_parallel(4, ep_size=1)
    config("tiny-qwen3-moe", moe_intermediate_size=34).check_tensor_parallel(4, ep_size=4)  # whole experts
    config("qwen3-30b-a3b").check_tensor_parallel(4, ep_size=4)
    config("mixtral-8x7b").check_tensor_parallel(8, ep_size=8)


# -- load balance in /metrics -----------------------------------------------------------


def test_expert_load_histogram_reaches_metrics():
    with radixserve.Engine(model_path="tiny-qwen3-moe", load_format="dummy", device="cpu", dtype="float32",
                           disable_tqdm=True, max_total_tokens=512, max_running_requests=4) as eng:
        eng.generate(input_ids=[list(range(1, 30))], sampling_params={**GREEDY, "max_new_tokens": 1})
        stats = eng.get_stats()
        load = eng.scheduler.model_runner.model.expert_load
        counts, steps = load.read()
    # one prefill of 29 tokens, top 2 of 8 experts, in the two MoE layers (layer 1 is dense)
    assert steps == 1 and [sum(row) for row in counts] == [58, 58]
    assert stats["moe_expert_tokens_count"] == 16 and stats["moe_expert_tokens_sum"] == 116
    assert stats["moe_expert_tokens_le_inf"] == 16 and stats["moe_expert_tokens_le_0"] == sum(
        c == 0 for row in counts for c in row)
    metrics = ServerMetrics()
    metrics.update_from_state(stats)
    text = metrics.render().decode()
    assert 'radixserve:moe_expert_tokens_per_step_bucket{le="+Inf"} 16.0' in text
    assert "radixserve:moe_expert_tokens_per_step_sum 116.0" in text
    assert "moe_expert_tokens" not in ServerMetrics().render().decode()  # a dense model shows none
