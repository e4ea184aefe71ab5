"""Llama family: Llama 2/3/3.1/3.2, SmolLM2, Mistral (no sliding window).

Qwen2 and Qwen3 reuse these modules through :class:`AttentionOptions` (biases,
per-head q/k norm); see ``qwen2.py`` and ``qwen3.py``. Under tensor
parallelism every module takes the rank's :class:`TPGroup` (see
docs/tensor_parallel.md): attention runs on the rank's heads, the MLP on its
slice of the intermediate size, and norms and rotary are replicated. Under
pipeline parallelism the model is one :class:`PPStage`'s part of it
(``distributed/pipeline.py``): its decoder layers, under their global names.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PretrainedConfig

from radixserve.distributed import TPGroup
from radixserve.distributed.expert_parallel import MoEParallel
from radixserve.distributed.pipeline import PPHidden, PPMissingLayer, PPStage
from radixserve.layers.activation import SiluAndMul
from radixserve.layers.layernorm import RMSNorm
from radixserve.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    default_weight_loader,
)
from radixserve.layers.logits_processor import LogitsProcessor, LogitsProcessorOutput
from radixserve.layers.radix_attention import RadixAttention
from radixserve.layers.rotary_embedding import RotaryEmbedding, get_rope, rope_params_from_config
from radixserve.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from radixserve.model_executor.forward_batch_info import ForwardBatch, KVStore

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AttentionOptions:
    """What differs between the attention blocks of the Llama-like families."""

    qkv_bias: bool
    o_bias: bool
    qk_norm: bool = False  # RMSNorm over head_dim on q and k before rotary (Qwen3)


def head_dim_of(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class LlamaMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str, bias: bool, tp_group: TPGroup):
        super().__init__()
        if hidden_act != "silu":
            raise ValueError(f"only the silu activation is supported, got {hidden_act!r}")
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias, tp_group)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias, tp_group)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj.forward_gated(x, self.act_fn))


class LlamaAttention(nn.Module):
    """Self-attention over this rank's heads (``qkv_proj.layout``): the
    decoder layer calls :meth:`qkv`, then ``attn``, then ``o_proj``.
    ``layer_id`` is the layer's index in the KV pool, which holds only the
    layers of this pipeline stage."""

    def __init__(
        self, config: PretrainedConfig, layer_id: int, rotary_emb: RotaryEmbedding, options: AttentionOptions,
        tp_group: TPGroup,
    ):
        super().__init__()
        total_heads = config.num_attention_heads
        total_kv_heads = getattr(config, "num_key_value_heads", None) or total_heads
        self.head_dim = head_dim_of(config)
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, self.head_dim, total_heads, total_kv_heads, options.qkv_bias, tp_group
        )
        self.num_heads, self.num_kv_heads = self.qkv_proj.layout.num_heads, self.qkv_proj.layout.num_kv_heads
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.o_proj = RowParallelLinear(total_heads * self.head_dim, config.hidden_size, options.o_bias, tp_group)
        self.q_norm = self.k_norm = None
        if options.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.rotary_emb = rotary_emb  # one module shared by all layers
        self.attn = RadixAttention(self.num_heads, self.head_dim, self.head_dim**-0.5, self.num_kv_heads, layer_id)

    def qkv(self, positions: torch.Tensor, hidden_states: torch.Tensor,
            kv_store: KVStore | None = None) -> tuple[torch.Tensor, ...]:
        """Projected q, k (normed per head, rotated) and v: what attention
        takes. ``kv_store`` (``attn.kv_store``): k and v also go into the KV
        pool there, from the rotary kernel."""
        q, k, v = self.qkv_proj(hidden_states).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.q_norm is not None:
            q, k = self.rotary_emb.forward_with_head_norms(positions, q, k, self.q_norm, self.k_norm, v, kv_store)
        else:
            q, k = self.rotary_emb(positions, q, k, v, kv_store)
        return q, k, v


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self, config: PretrainedConfig, layer_id: int, rotary_emb: RotaryEmbedding, options: AttentionOptions,
        tp_group: TPGroup, mlp: nn.Module | None = None,
    ):
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_id, rotary_emb, options, tp_group)
        if mlp is None:
            mlp_bias = getattr(config, "mlp_bias", False)
            mlp = LlamaMLP(config.hidden_size, config.intermediate_size, config.hidden_act, mlp_bias, tp_group)
        self.mlp = mlp  # a dense MLP, or a mixture of experts (sparse_moe.py): x -> y, complete on every rank
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        forward_batch: ForwardBatch,
        residual: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns ``(mlp output, residual)``; their sum is this layer's output
        (the next norm adds them, see :class:`RMSNorm`)."""
        attn = self.self_attn.attn
        kv_store = attn.kv_store(forward_batch)  # the rotary kernel stores K/V where the backend lets it
        q, k, v, residual = self.before_attention(positions, hidden_states, residual, kv_store)
        return self.after_attention(attn(q, k, v, forward_batch, kv_stored=kv_store is not None), residual)

    # The layer in two pieces around its attention, which alone reads the
    # batch's layout: piecewise CUDA graphs capture the pieces for a token count
    # (without ``kv_store``: the slots are the batch's, so attention stores K/V).
    def before_attention(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None,
        kv_store: KVStore | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(q, k, v, residual)`` from the previous layer's ``(mlp output, residual)``."""
        if residual is None:
            residual, hidden_states = hidden_states, self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        return *self.self_attn.qkv(positions, hidden_states, kv_store), residual

    def after_attention(self, attn_output: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(mlp output, residual)`` from the attention's output."""
        hidden_states, residual = self.post_attention_layernorm(self.self_attn.o_proj(attn_output), residual)
        return self.mlp(hidden_states), residual


class LlamaModel(nn.Module):
    """The decoder layers ``pp_stage`` holds (``layers[i]``, i global; a
    :class:`PPMissingLayer` in the place of another stage's), the embedding on
    the first stage (and on the last when the LM head is tied to it), the
    final norm on the last. ``mlp_factory(layer_id)``, if given, builds each
    layer's MLP (None: the dense one)."""

    def __init__(self, config: PretrainedConfig, options: AttentionOptions, tp_group: TPGroup,
                 mlp_factory: Callable[[int], nn.Module | None] | None, pp_stage: PPStage):
        super().__init__()
        self.pp_stage = stage = pp_stage
        tied = bool(getattr(config, "tie_word_embeddings", False))
        self.embed_tokens = None
        if stage.is_first or (tied and stage.is_last):
            self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp_group)
        rope_theta, rope_scaling = rope_params_from_config(config)
        self.rotary_emb = get_rope(head_dim_of(config), config.max_position_embeddings, rope_theta, rope_scaling)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i - stage.start, self.rotary_emb, options, tp_group,
                              mlp_factory and mlp_factory(i))
            if stage.holds(i) else PPMissingLayer()
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps) if stage.is_last else None

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch
    ) -> torch.Tensor | PPHidden:
        """The final norm's output on the last stage, the :class:`PPHidden`
        for the next stage on another. A stage other than the first starts
        from ``forward_batch.pp_hidden`` instead of embedding ``input_ids``."""
        stage = self.pp_stage
        if stage.is_first:
            hidden_states, residual = self.embed_tokens(input_ids), None
        elif forward_batch.pp_hidden is None:
            raise ValueError(f"pipeline stage {stage.rank} needs the previous stage's output (forward_batch.pp_hidden)")
        else:
            hidden_states, residual = forward_batch.pp_hidden.hidden_states, forward_batch.pp_hidden.residual
        for i in range(stage.start, stage.end):
            hidden_states, residual = self.layers[i](positions, hidden_states, forward_batch, residual)
        if not stage.is_last:
            return PPHidden(hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


# (parameter part, checkpoint part, shard id): HF's separate projections that
# live in one merged parameter here.
_STACKED_PARAMS = (
    (".qkv_proj.", ".q_proj.", "q"),
    (".qkv_proj.", ".k_proj.", "k"),
    (".qkv_proj.", ".v_proj.", "v"),
    (".gate_up_proj.", ".gate_proj.", 0),
    (".gate_up_proj.", ".up_proj.", 1),
)
# Checkpoint entries that are not weights (old HF rotary caches).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")
_LAYER_TENSOR = re.compile(r"^model\.layers\.(\d+)\.")


class LlamaForCausalLM(nn.Module):
    """Decoder-only Llama model taking HF checkpoint names in :meth:`load_weights`.

    ``tp_group`` is this rank's tensor-parallel group (default: one rank);
    the model then holds, and loads, only the rank's shard of each weight.
    ``moe_parallel`` (``--ep-size``, ``--moe-a2a-backend``) concerns the
    mixture-of-experts subclasses only (``sparse_moe.py``). ``pp_stage``
    (default: the whole model) is the pipeline stage this model is: it holds
    that stage's layers, and the LM head (``lm_head``, ``logits_processor``;
    None elsewhere) only on the last stage, where :meth:`forward` returns the
    logits; another stage's returns a :class:`PPHidden`."""

    def __init__(self, config: PretrainedConfig, tp_group: TPGroup | None = None,
                 moe_parallel: MoEParallel | None = None, pp_stage: PPStage | None = None):
        super().__init__()
        _check_config(config)
        tp_group = tp_group or TPGroup()
        self.pp_stage = pp_stage or PPStage(0, config.num_hidden_layers)
        if self.pp_stage.end > config.num_hidden_layers:
            raise ValueError(f"pipeline stage layers {self.pp_stage.start}..{self.pp_stage.end - 1} "
                             f"beyond the model's {config.num_hidden_layers}")
        self.config = config
        self.model = LlamaModel(config, self.attention_options(config), tp_group,
                                self.mlp_factory(config, tp_group, moe_parallel, self.pp_stage), self.pp_stage)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = self.logits_processor = None
        if self.pp_stage.is_last:
            if self.tie_word_embeddings:
                self.lm_head = self.model.embed_tokens
            else:
                self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp_group)
            self.logits_processor = LogitsProcessor(config.vocab_size, tp_group)

    @classmethod
    def attention_options(cls, config: PretrainedConfig) -> AttentionOptions:
        bias = bool(getattr(config, "attention_bias", False))
        return AttentionOptions(qkv_bias=bias, o_bias=bias)

    def mlp_factory(
        self, config: PretrainedConfig, tp_group: TPGroup, moe_parallel: MoEParallel | None, pp_stage: PPStage
    ) -> Callable[[int], nn.Module | None] | None:
        """What builds the MLP of each layer ``pp_stage`` holds; None: every layer's is dense (:class:`LlamaMLP`)."""
        return None

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch
    ) -> LogitsProcessorOutput | PPHidden:
        hidden_states = self.model(input_ids, positions, forward_batch)
        if isinstance(hidden_states, PPHidden):
            return hidden_states
        return self.logits_processor(input_ids, hidden_states, self.lm_head, forward_batch)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors, each whole as in the checkpoint (a parameter's
        ``weight_loader`` keeps this rank's shard; the tensors of another
        pipeline stage are skipped); raises ValueError on a name this model
        does not have, a shape mismatch, or a parameter left unloaded."""
        params = dict(self.named_parameters())
        loaded: set[tuple[str, object]] = set()
        for hf_name, tensor in weights:
            if hf_name.endswith(_IGNORED_SUFFIXES) or (self.tie_word_embeddings and hf_name == "lm_head.weight"):
                continue
            if self.held_elsewhere(hf_name):
                continue
            name, shard = self.param_name(hf_name)
            if name not in params:
                raise ValueError(f"{type(self).__name__}: unexpected weight {hf_name!r} in the checkpoint")
            param = params[name]
            try:
                getattr(param, "weight_loader", default_weight_loader)(param, tensor, shard)
            except ValueError as e:
                raise ValueError(f"{type(self).__name__}: cannot load {hf_name!r}: {e}") from e
            loaded.add((name, shard))
        missing = sorted(f"{n}[{s}]" if s is not None else n for n, s in self.expected_shards(params) - loaded)
        missing += self.missing_weights()
        if missing:
            raise ValueError(f"{type(self).__name__}: {len(missing)} weights missing from the checkpoint: {missing[:8]}")

    def held_elsewhere(self, hf_name: str) -> bool:
        """Whether checkpoint tensor ``hf_name`` belongs to another pipeline stage."""
        if m := _LAYER_TENSOR.match(hf_name):
            return not self.pp_stage.holds(int(m[1]))
        if hf_name.startswith("model.embed_tokens."):
            return self.model.embed_tokens is None
        if hf_name.startswith(("model.norm.", "lm_head.")):
            return not self.pp_stage.is_last
        return False

    def param_name(self, hf_name: str) -> tuple[str, object]:
        """The parameter and shard id a checkpoint tensor loads into."""
        return _param_name(hf_name)

    def expected_shards(self, params: dict[str, nn.Parameter]) -> set[tuple[str, object]]:
        """Every ``(parameter, shard id)`` a complete checkpoint loads."""
        return _expected(params)

    def missing_weights(self) -> list[str]:
        """Checkpoint tensors not loaded that :meth:`expected_shards` does not cover."""
        return []


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral is Llama's architecture (its sliding window is not applied)."""


def _param_name(hf_name: str) -> tuple[str, object]:
    for param_part, ckpt_part, shard in _STACKED_PARAMS:
        if ckpt_part in hf_name:
            return hf_name.replace(ckpt_part, param_part), shard
    return hf_name, None


def _expected(params: dict[str, nn.Parameter]) -> set[tuple[str, object]]:
    expected = set()
    for name in params:
        shards = [s for part, _, s in _STACKED_PARAMS if part in name] or [None]
        expected.update((name, s) for s in shards)
    return expected


def _check_config(config: PretrainedConfig) -> None:
    if getattr(config, "use_sliding_window", False):
        raise ValueError("sliding-window attention (use_sliding_window=True) is not supported")
    window = getattr(config, "sliding_window", None)
    if window and not hasattr(config, "use_sliding_window") and window < config.max_position_embeddings:
        logger.warning(
            "sliding_window=%d is not applied: attention sees the whole context, "
            "so outputs differ from the reference past %d tokens", window, window
        )
