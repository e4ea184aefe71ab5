"""Pipeline parallelism, the model side (CPU, fp32, one process): stages run
one after another here, each a ModelRunner with its own layers and KV pool,
the hidden states handed on through ``forward_batch.pp_hidden``, give the
logits of the whole model on the same weights (dummy, a checkpoint, a GGUF),
through tp_harness's chunked prefill with input logprobs, prefill on a cached
prefix and decodes. Also: the layer split (SGLang's rule and
``SGLANG_PP_LAYER_PARTITION``), what a stage holds and loads, its KV pool,
and what stages refuse."""

from __future__ import annotations

import pytest
import torch
from tp_harness import forward_scenario
from transformers import AutoModelForCausalLM

from radixserve.distributed import TPGroup
from radixserve.distributed.pipeline import PP_LAYER_PARTITION_ENV, PPStage, pp_layer_range
from radixserve.lora.options import LoRAOptions
from radixserve.model_executor import model_runner
from radixserve.model_executor.model_runner import ModelRunner
from radixserve.model_loader import dummy_config, get_model, load_gguf, resolve_model
from radixserve.models.registry import ModelRegistry

RUNNER = dict(max_total_tokens=512, max_running_requests=4, tp_group=TPGroup())  # a stage alone: no pipeline to join
STEPS = 3


class Pipeline:
    """Stages run in turn, as the scheduler runs them across processes: the
    ``runner`` tp_harness's workload drives. Every stage reads the one slot
    table (a token's KV has the same slot on every stage) and writes its own
    KV pool; ``forward_batch_from`` keeps the host batch, which each stage
    turns into its own ForwardBatch."""

    def __init__(self, stages: list[ModelRunner]):
        self.stages = stages
        first = stages[0]
        for stage in stages[1:]:
            stage.req_to_token_pool = first.req_to_token_pool
        self.req_to_token_pool, self.token_to_kv_pool_allocator = first.req_to_token_pool, first.token_to_kv_pool_allocator

    def forward_batch_from(self, batch):
        return batch

    def forward(self, batch):
        out = None
        for stage in self.stages:
            fb = stage.forward_batch_from(batch)
            fb.pp_hidden = out
            out = stage.forward(fb)
        return out


def random_prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (13, 5, 9)]


def assert_pipeline_matches(config, pp_size: int, model_for=None) -> list[ModelRunner]:
    """The whole model and ``pp_size`` stages (``model_for(stage)`` each, or
    loaded by the runner) run the same scenario, fed the whole model's
    greedy tokens; their logits and input logprobs agree. Returns the stages."""
    whole = ModelRunner(config, model=model_for and model_for(PPStage(0, config.num_hidden_layers)), **RUNNER)
    prompts = random_prompts(config.vocab_size)
    ref = forward_scenario(whole, prompts, None, STEPS)
    stages = [ModelRunner(config, pp_rank=rank, pp_size=pp_size, **RUNNER,
                          model=model_for and model_for(PPStage.of(config.num_hidden_layers, rank, pp_size)))
              for rank in range(pp_size)]
    out = forward_scenario(Pipeline(stages), prompts, ref["fed"], STEPS)
    assert len(out["logits"]) == 2 + STEPS
    for got, want in zip(out["logits"], ref["logits"], strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    torch.testing.assert_close(out["input_logprobs"], ref["input_logprobs"], atol=1e-5, rtol=0)
    assert out["top_idx"] == ref["top_idx"]
    return stages


# -- the layer split -------------------------------------------------------------


@pytest.mark.parametrize("num_layers, pp_size, ranges", [
    (4, 1, [(0, 4)]),
    (4, 2, [(0, 2), (2, 4)]),
    (5, 2, [(0, 2), (2, 5)]),  # SGLang's rule: the last stages take the extra layers
    (8, 3, [(0, 2), (2, 5), (5, 8)]),
    (3, 3, [(0, 1), (1, 2), (2, 3)]),
])
def test_even_split(num_layers, pp_size, ranges, monkeypatch):
    monkeypatch.delenv(PP_LAYER_PARTITION_ENV, raising=False)
    assert [pp_layer_range(num_layers, rank, pp_size) for rank in range(pp_size)] == ranges


def test_partition_from_the_environment(monkeypatch):
    monkeypatch.setenv(PP_LAYER_PARTITION_ENV, "1,4,3")
    assert [pp_layer_range(8, rank, 3) for rank in range(3)] == [(0, 1), (1, 5), (5, 8)]
    assert pp_layer_range(8, 0, 1) == (0, 8)  # one stage holds every layer whatever the variable says
    for bad in ("4,4", "1,4,2", "0,4,4", "1,4,3,0", "1,x,3", ""):
        monkeypatch.setenv(PP_LAYER_PARTITION_ENV, bad)
        with pytest.raises(ValueError, match=PP_LAYER_PARTITION_ENV):
            pp_layer_range(8, 0, 3)


def test_every_stage_needs_a_layer(monkeypatch):
    monkeypatch.delenv(PP_LAYER_PARTITION_ENV, raising=False)
    with pytest.raises(ValueError, match="pp_size 3 is larger than the model's 2 layers"):
        pp_layer_range(2, 0, 3)
    with pytest.raises(ValueError, match=r"pp_rank must be in \[0, 2\), got 2"):
        PPStage.of(4, 2, 2)
    with pytest.raises(ValueError, match="pp_size 3 is larger"):
        ModelRunner(resolve_model("tiny-llama"), pp_rank=0, pp_size=3, **RUNNER)


def test_stage_properties():
    first, middle, last = (PPStage.of(8, rank, 3) for rank in range(3))
    assert (first.is_first, first.is_last, middle.is_first, middle.is_last, last.is_last) == (
        True, False, False, False, True)
    assert (middle.start, middle.end, middle.num_layers) == (2, 5, 3)
    assert [i for i in range(8) if middle.holds(i)] == [2, 3, 4]
    whole = PPStage.of(8)
    assert whole == PPStage(0, 8) and whole.is_first and whole.is_last


# -- stages give the whole model's logits ----------------------------------------------


@pytest.mark.parametrize("name, pp_size, overrides", [
    ("tiny-llama", 2, {}),
    ("tiny-llama", 3, {"num_hidden_layers": 4}),  # layers 0 | 1 | 2, 3
    ("tiny-llama", 2, {"tie_word_embeddings": True}),  # SmolLM2's tied LM head, on the last stage too
    ("tiny-qwen3-moe", 2, {}),  # MoE layer 0 | dense layer 1, MoE layer 2
    ("tiny-mixtral", 2, {}),
])
def test_stages_match_the_whole_model(name, pp_size, overrides, monkeypatch):
    monkeypatch.delenv(PP_LAYER_PARTITION_ENV, raising=False)
    config = resolve_model(name, overrides=overrides)
    stages = assert_pipeline_matches(config, pp_size)
    whole = dict(get_model(config).named_parameters())
    held = set()
    for stage in stages:
        pp, model = stage.pp, stage.model
        assert stage.token_to_kv_pool.layer_num == pp.num_layers
        params = dict(model.named_parameters())
        layers = {int(n.split(".")[2]) for n in params if n.startswith("model.layers.")}
        assert layers == set(range(pp.start, pp.end))  # global indices
        assert ("model.embed_tokens.weight" in params) == (pp.is_first or (config.hf_config.tie_word_embeddings
                                                                           and pp.is_last))
        assert ("model.norm.weight" in params) == pp.is_last == (model.lm_head is not None)
        for key, value in get_model(config, pp_stage=pp).named_parameters():  # the runner's are prepacked
            assert torch.equal(value, whole[key]), key  # dummy weights: the whole model's, stage by stage
        held |= params.keys()
    assert held == whole.keys()


def test_stages_of_a_checkpoint_match(monkeypatch):
    """HF's Mixtral tensors (each expert's, Mixtral's names) loaded into each
    stage, which skips the others' tensors."""
    monkeypatch.delenv(PP_LAYER_PARTITION_ENV, raising=False)
    hf_config = dummy_config("tiny-mixtral")
    torch.manual_seed(0)
    state = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32).state_dict()
    model_cls = ModelRegistry.resolve(hf_config.architectures)

    def model_for(stage: PPStage):
        model = model_cls(hf_config, pp_stage=stage)
        model.load_weights(state.items())
        return model

    assert_pipeline_matches(resolve_model("tiny-mixtral"), 2, model_for)


def test_a_stage_reports_only_its_own_missing_weights():
    hf_config = dummy_config("tiny-llama")
    state = AutoModelForCausalLM.from_config(hf_config).state_dict()
    model_cls = ModelRegistry.resolve(hf_config.architectures)
    last = PPStage.of(2, 1, 2)
    first_stage_only = ("model.embed_tokens.", "model.layers.0.")
    model_cls(hf_config, pp_stage=last).load_weights((k, v) for k, v in state.items()
                                                     if not k.startswith(first_stage_only))
    with pytest.raises(ValueError, match=r"missing.*layers\.1\.mlp\.gate_up_proj\.weight\[1\]"):
        model_cls(hf_config, pp_stage=last).load_weights(
            (k, v) for k, v in state.items() if k != "model.layers.1.mlp.up_proj.weight")
    with pytest.raises(ValueError, match="unexpected weight 'model.layers.1.self_attn.rope.weight'"):
        model_cls(hf_config, pp_stage=last).load_weights([*state.items(), ("model.layers.1.self_attn.rope.weight",
                                                                           torch.zeros(1))])


def test_stages_of_a_gguf_hold_its_weights(tmp_path, monkeypatch):
    from test_model_loader import write_tiny_gguf

    monkeypatch.delenv(PP_LAYER_PARTITION_ENV, raising=False)
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, "qwen2")
    config = resolve_model(load_gguf(str(path), str(tmp_path / "cache")))
    whole = dict(get_model(config).named_parameters())
    stages = [dict(get_model(config, pp_stage=PPStage.of(config.num_hidden_layers, rank, 2)).named_parameters())
              for rank in range(2)]
    assert {k for s in stages for k in s} == whole.keys()
    assert all(torch.equal(v, whole[k]) for s in stages for k, v in s.items())


# -- a stage's KV pool and what stages refuse ------------------------------------------------


def test_a_stage_pool_holds_its_layers_and_more_tokens(monkeypatch):
    monkeypatch.delenv(PP_LAYER_PARTITION_ENV, raising=False)
    config = resolve_model("tiny-llama", overrides={"num_hidden_layers": 4})
    per_layer = config.num_key_value_heads * config.head_dim * 2 * 4  # K and V, float32
    monkeypatch.setattr(model_runner, "available_ram", lambda: 4 * 1000 * 4 * per_layer)
    whole = ModelRunner(config, max_running_requests=4)  # the RAM share holds 1000 tokens of 4 layers
    stages = [ModelRunner(config, max_running_requests=4, pp_rank=rank, pp_size=2, tp_group=TPGroup()) for rank in range(2)]
    assert whole.max_total_tokens == 1000 and whole.token_to_kv_pool.layer_num == 4
    for stage in stages:
        assert stage.token_to_kv_pool.layer_num == 2 and stage.kv_bytes_per_token() == 2 * per_layer
        assert stage.max_total_tokens == 2000


def test_stages_refuse_graphs_lora_and_a_missing_input():
    config = resolve_model("tiny-llama")
    for graphs in (dict(cuda_graph_max_bs=8), dict(piecewise_cuda_graph_tokens=[16])):
        with pytest.raises(ValueError, match="pipeline parallelism runs eagerly for now"):
            ModelRunner(config, device="cuda", pp_rank=0, pp_size=2, **graphs, **RUNNER)
    with pytest.raises(ValueError, match="pipeline parallelism does not support LoRA"):
        ModelRunner(config, pp_rank=1, pp_size=2, lora=LoRAOptions(max_lora_rank=8), **RUNNER)
    with pytest.raises(ValueError, match="the model given is pipeline stage"):
        ModelRunner(config, pp_rank=1, pp_size=2, model=get_model(config), **RUNNER)
    stage = ModelRunner(config, pp_rank=1, pp_size=2, cuda_graph_max_bs=8, **RUNNER)  # no graphs off CUDA anyway
    with pytest.raises(ValueError, match="pipeline stage 1 needs the previous stage's output"):
        forward_scenario(stage, random_prompts(config.vocab_size), None, 1)
