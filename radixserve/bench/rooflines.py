"""The rooflines of ``bench.one_batch``: what a model's shape says a case
should cost (weight and KV bytes a decode step reads, a prefill's FLOPs), and
one case's latencies and throughputs as shares of a device's peaks. The
peaks default to the H200 figures of benchmarks/README.md."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

H200_COPY_BANDWIDTH = 4.25e12  # B/s, device copy (read + write)
H200_GEMV_BANDWIDTH = 3.7e12  # B/s of weights, bf16 GEMV
H200_BF16_FLOPS = 805e12  # bf16 8192^3 matmul


@dataclass(frozen=True)
class ModelShape:
    """What the rooflines need to know about a model."""

    weight_bytes: int
    non_embedding_params: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    itemsize: int
    # mixtures of experts: one rank's experts per MoE layer, the bytes of all
    # of them (every layer), and how many each token takes
    local_experts: int = 0
    expert_bytes: int = 0
    expert_params: int = 0
    top_k: int = 0

    @classmethod
    def of(cls, model: torch.nn.Module, model_config, heads=None, kv_dtype: torch.dtype | None = None) -> "ModelShape":
        """One rank's shape: its weights, ``heads`` (its ``HeadLayout``) under
        TP, and KV in ``kv_dtype`` (default the model's)."""
        from radixserve.layers.moe.layer import FusedMoE
        from radixserve.layers.vocab_embedding import VocabParallelEmbedding

        params = list(model.parameters())  # a tied embedding appears once
        moe = [m for m in model.modules() if isinstance(m, FusedMoE)]
        embedding = {id(p) for m in model.modules() if isinstance(m, VocabParallelEmbedding) for p in m.parameters()}
        return cls(
            weight_bytes=sum(p.numel() * p.element_size() for p in params),
            non_embedding_params=sum(p.numel() for p in params if id(p) not in embedding),
            num_layers=model_config.num_hidden_layers,
            num_heads=heads.num_heads if heads else model_config.num_attention_heads,
            num_kv_heads=heads.num_kv_heads if heads else model_config.num_key_value_heads,
            head_dim=model_config.head_dim,
            itemsize=(kv_dtype or model_config.dtype).itemsize,
            local_experts=moe[0].w13_weight.shape[0] if moe else 0,
            expert_bytes=sum(p.numel() * p.element_size() for m in moe for p in (m.w13_weight, m.w2_weight)),
            expert_params=sum(p.numel() for m in moe for p in (m.w13_weight, m.w2_weight)),
            top_k=moe[0].top_k if moe else 0,
        )

    def decode_weight_bytes(self, batch_size: int) -> float:
        """Weight bytes a decode step reads: all of a dense model's; of a
        mixture of experts, the experts its tokens choose, expected under
        uniform routing (at batch 1, the top k of each layer)."""
        if not self.local_experts:
            return self.weight_bytes
        e, k = self.local_experts, min(self.top_k, self.local_experts)
        touched = e * (1 - (1 - k / e) ** batch_size)
        return self.weight_bytes - self.expert_bytes + self.expert_bytes * touched / e

    def kv_bytes(self, tokens: float) -> float:
        return tokens * self.num_layers * self.num_kv_heads * self.head_dim * 2 * self.itemsize

    def prefill_flops(self, batch_size: int, input_len: int) -> float:
        causal_pairs = batch_size * input_len * (input_len + 1) / 2
        attention = 4 * self.num_layers * self.num_heads * self.head_dim * causal_pairs
        active = self.non_embedding_params  # a mixture of experts: each token's k experts
        if self.local_experts:
            active += self.expert_params * (min(self.top_k, self.local_experts) / self.local_experts - 1)
        return 2 * active * batch_size * input_len + attention


@dataclass(frozen=True)
class Peaks:
    bandwidth: float
    gemv_bandwidth: float
    flops: float


@dataclass
class Timing:
    """One case's measurement. ``decode_s`` holds every step (ours) or is None
    when only the mean step is known (HF: ``decode_mean_s``)."""

    prefill_s: float
    decode_s: list[float] | None = None
    decode_mean_s: float | None = None


def case_metrics(shape: ModelShape, peaks: Peaks, bs: int, input_len: int, output_len: int, t: Timing) -> dict:
    """Latencies, throughputs and roofline shares of one case."""
    flops = shape.prefill_flops(bs, input_len)
    out = {
        "prefill_ms": _ms(t.prefill_s),
        "prefill_tok_s": round(bs * input_len / t.prefill_s, 1),
        "prefill_flops": flops,
        "prefill_tflop_s": _sig(flops / t.prefill_s / 1e12),
        "prefill_pct_peak_flops": _sig(100 * flops / t.prefill_s / peaks.flops),
        "decode_steps": output_len - 1,
    }
    if output_len < 2:
        return out
    steps = t.decode_s
    mean = float(np.mean(steps)) if steps else t.decode_mean_s
    median = float(np.median(steps)) if steps else None
    step = median if median is not None else mean
    # Decode step k (1-based) attends over input_len + k tokens.
    mean_context = input_len + output_len / 2
    kv = shape.kv_bytes(bs * mean_context)
    weights = shape.decode_weight_bytes(bs)
    bandwidth = (weights + kv) / step
    out.update({
        "decode_median_ms": _ms(median),
        "decode_p90_ms": _ms(float(np.percentile(steps, 90))) if steps else None,
        "decode_mean_ms": _ms(mean),
        "decode_tok_s": round(bs / step, 2),
        "weight_bytes": shape.weight_bytes,
        "weight_bytes_read_per_step": int(weights),
        "kv_bytes_per_step": int(kv),
        "decode_bandwidth_gb_s": _sig(bandwidth / 1e9),
        "decode_pct_peak_bandwidth": _sig(100 * bandwidth / peaks.bandwidth),
        "decode_pct_gemv_bandwidth": _sig(100 * bandwidth / peaks.gemv_bandwidth),
    })
    return out


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 4)


def _sig(x: float, digits: int = 4) -> float:
    """``x`` to ``digits`` significant figures (CPU runs give tiny shares of GPU peaks)."""
    return float(f"{x:.{digits}g}")
