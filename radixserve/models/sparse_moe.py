"""What the mixture-of-experts families share (Qwen2-MoE, Qwen3-MoE, Mixtral):
the sparse MLP block and the checkpoint names of its experts.

A MoE model is its dense family's model (``llama.py``) whose layers' MLP is,
where the config says so, a :class:`SparseMoeBlock`: a router (``gate``, a
replicated ``[E, H]`` linear whose logits go to ``layers/moe/topk.py``), the
experts (``layers/moe/layer.py``'s ``FusedMoE``), and for Qwen2-MoE a shared
expert scaled by a sigmoid gate. Its output is complete on every rank, as a
dense MLP's is after its all-reduce.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch
from torch import nn
from transformers import PretrainedConfig

from radixserve.distributed import TPGroup
from radixserve.distributed.expert_parallel import MoEParallel
from radixserve.distributed.pipeline import PPStage
from radixserve.layers.moe.layer import ExpertLoad, FusedMoE, Router
from radixserve.models.llama import LlamaForCausalLM, LlamaMLP

# One expert's tensor in a checkpoint: Qwen's ``mlp.experts.N.gate_proj.weight``,
# Mixtral's ``block_sparse_moe.experts.N.w1.weight`` (w1 gate, w3 up, w2 down).
_EXPERT_TENSOR = re.compile(r"^(?P<prefix>.*\.mlp)\.experts\.(?P<expert>\d+)\.(?P<part>\w+)\.weight$")
_EXPERT_PARTS = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "w1": "gate", "w3": "up", "w2": "down"}
# Every expert stacked, as HF (transformers 5) holds them in memory: ``mlp.experts.gate_up_proj``.
_STACKED_EXPERTS = {".mlp.experts.gate_up_proj": (".mlp.experts.w13_weight", "w13"),
                    ".mlp.experts.down_proj": (".mlp.experts.w2_weight", "w2")}


class SparseMoeBlock(nn.Module):
    """A layer's MoE MLP: router, experts and (Qwen2-MoE) a gated shared expert."""

    def __init__(self, config: PretrainedConfig, renormalize: bool, parallel: MoEParallel, load: ExpertLoad,
                 moe_index: int, shared_expert_size: int = 0):
        super().__init__()
        num_experts, hidden = num_experts_of(config), config.hidden_size
        self.gate = Router(hidden, num_experts)
        self.experts = FusedMoE(num_experts, config.num_experts_per_tok, hidden, moe_intermediate_size(config),
                                renormalize, parallel, load, moe_index)
        self.shared_expert = self.shared_expert_gate = None
        if shared_expert_size:
            self.shared_expert = LlamaMLP(hidden, shared_expert_size, config.hidden_act, False, parallel.tp_group)
            self.shared_expert_gate = Router(hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.experts(x, self.gate)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


def num_experts_of(config: PretrainedConfig) -> int:
    """Experts per MoE layer (Qwen's ``num_experts``, Mixtral's ``num_local_experts``); 0 for a dense model."""
    return int(getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None) or 0)


def moe_intermediate_size(config: PretrainedConfig) -> int:
    """One expert's intermediate size (Qwen's ``moe_intermediate_size``; Mixtral's ``intermediate_size``)."""
    return int(getattr(config, "moe_intermediate_size", None) or config.intermediate_size)


class MoEForCausalLM(LlamaForCausalLM):
    """A Llama-like model whose MoE layers are :class:`SparseMoeBlock`.

    ``expert_load`` counts the tokens each expert got (``layers/moe/layer.py``)
    in the MoE layers of this pipeline stage, the first of them row 0."""

    def mlp_factory(
        self, config: PretrainedConfig, tp_group: TPGroup, moe_parallel: MoEParallel | None, pp_stage: PPStage
    ) -> Callable[[int], nn.Module | None]:
        parallel = moe_parallel or MoEParallel(tp_group)
        if parallel.tp_group is not tp_group and parallel.tp_group != tp_group:
            raise ValueError("moe_parallel must be over the model's TP group")
        sparse = [i for i in range(pp_stage.start, pp_stage.end) if self.is_sparse_layer(config, i)]
        self.expert_load = ExpertLoad(len(sparse), num_experts_of(config))
        index = {layer: n for n, layer in enumerate(sparse)}

        def build(layer_id: int) -> nn.Module | None:
            if layer_id not in index:
                return self.dense_mlp(config, tp_group)
            return SparseMoeBlock(config, self.renormalize(config), parallel, self.expert_load, index[layer_id],
                                  self.shared_expert_size(config))

        return build

    @classmethod
    def is_sparse_layer(cls, config: PretrainedConfig, layer_id: int) -> bool:
        return True

    @classmethod
    def renormalize(cls, config: PretrainedConfig) -> bool:
        return bool(getattr(config, "norm_topk_prob", False))

    @classmethod
    def shared_expert_size(cls, config: PretrainedConfig) -> int:
        return 0

    @classmethod
    def dense_mlp(cls, config: PretrainedConfig, tp_group: TPGroup) -> nn.Module | None:
        return None  # the config's intermediate_size (llama.py's LlamaMLP)

    def moe_blocks(self) -> list[SparseMoeBlock]:
        return [m for m in self.modules() if isinstance(m, SparseMoeBlock)]

    # -- loading: expert tensors go to FusedMoE's loader (layers/moe/layer.py) --
    def param_name(self, hf_name: str) -> tuple[str, object]:
        hf_name = hf_name.replace(".block_sparse_moe.", ".mlp.")  # Mixtral's name for the MoE block
        if (m := _EXPERT_TENSOR.match(hf_name)) and m["part"] in _EXPERT_PARTS:
            part = _EXPERT_PARTS[m["part"]]
            return f"{m['prefix']}.experts.{'w2' if part == 'down' else 'w13'}_weight", (part, int(m["expert"]))
        for suffix, (param_suffix, shard) in _STACKED_EXPERTS.items():
            if hf_name.endswith(suffix):
                return hf_name[: -len(suffix)] + param_suffix, shard
        return super().param_name(hf_name)

    def expected_shards(self, params: dict[str, nn.Parameter]) -> set[tuple[str, object]]:
        dense = {n: p for n, p in params.items() if not n.endswith((".experts.w13_weight", ".experts.w2_weight"))}
        return super().expected_shards(dense)

    def missing_weights(self) -> list[str]:
        return [f"{name}.{m}" for name, block in self.named_modules() if isinstance(block, SparseMoeBlock)
                for m in block.experts.missing()]
