"""Rotary position embedding (RoPE), neox layout as in HF Llama.

The cos/sin of every position up to ``max_position`` are computed once, in
float32, with the same formulas as ``transformers`` (``inv_freq`` from
``modeling_rope_utils``, ``freqs = position * inv_freq``, the same rotation
arithmetic), so results match HF to float32 rounding. The neox layout
rotates the pair ``(x[i], x[i + d/2])``.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from radixserve.layers import cpu_kernels
from radixserve.layers.triton_ops import use_triton
from radixserve.mem_cache.memory_pool import to_kv_dtype
from radixserve.model_executor.forward_batch_info import KVStore

_SCALED_TYPES = ("linear", "dynamic", "llama3")


class RotaryEmbedding(nn.Module):
    """Applies RoPE to q and k given per-token positions.

    ``freqs`` are the angles ``[max_position, head_dim/2]``; ``cos_sin_cache``
    holds their cos, then their sin, in float32. It is a non-persistent buffer,
    so it follows the model's device. Looked-up rows are cast to the query's
    dtype, as HF casts its float32 cos/sin (casting the whole model to bf16
    casts the buffer first, which rounds the same way). On CUDA one Triton
    kernel rotates q and k, on a CPU in float32 a C kernel (``cpu_kernels.py``);
    ``forward_native`` is the torch reference.
    """

    def __init__(self, head_dim: int, freqs: torch.Tensor):
        super().__init__()
        self.head_dim = head_dim
        self.register_buffer("cos_sin_cache", torch.cat((freqs.cos(), freqs.sin()), dim=-1), persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None = None,
        kv_store: KVStore | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate ``q`` ``[T, H*D]`` and ``k`` ``[T, Hkv*D]`` for ``positions`` ``[T]``.
        ``kv_store`` (from the attention backend): also store the rotated
        ``k`` and ``v`` in the KV pool, which the rotary kernel does as it
        rotates (no store launch of the backend's)."""
        if use_triton(q, k, v):
            from radixserve.layers.triton_ops.rotary import rotary_embedding

            return rotary_embedding(positions, q, k, self.cos_sin_cache, self.head_dim, v=v, kv_store=kv_store)
        if cpu_kernels.elementwise_takes(q, k, self.cos_sin_cache):
            q, k = cpu_kernels.rotary(positions, q, k, self.cos_sin_cache, self.head_dim)
        else:
            q, k = self.forward_native(positions, q, k)
        if kv_store is not None:
            _store(kv_store, k, v)
        return q, k

    def forward_with_head_norms(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, q_norm: nn.Module, k_norm: nn.Module,
        v: torch.Tensor | None = None, kv_store: KVStore | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Qwen3's order: each head of ``q`` and ``k`` RMS-normed (``q_norm``,
        ``k_norm``: :class:`RMSNorm` over ``head_dim``), then rotated (and
        stored, as :meth:`forward`). On CUDA the norms run inside the rotary
        kernel: one launch for the three (four with the store)."""
        if use_triton(q, k, v, q_norm.weight, k_norm.weight) and q_norm.variance_epsilon == k_norm.variance_epsilon:
            from radixserve.layers.triton_ops.rotary import rotary_embedding

            return rotary_embedding(positions, q, k, self.cos_sin_cache, self.head_dim,
                                    (q_norm.weight, k_norm.weight), q_norm.variance_epsilon, v, kv_store)
        heads = lambda x: x.reshape(x.shape[0], -1, self.head_dim)  # noqa: E731
        return self.forward(positions, q_norm(heads(q)).flatten(1), k_norm(heads(k)).flatten(1), v, kv_store)

    def forward_native(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.cos_sin_cache[positions].to(q.dtype).unsqueeze(1).chunk(2, dim=-1)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x1, x2 = x.view(shape[0], -1, self.head_dim).chunk(2, dim=-1)
        # The same products and sums as HF's q*cos + rotate_half(q)*sin.
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).view(shape)


def _store(kv_store: KVStore, k: torch.Tensor, v: torch.Tensor) -> None:
    """The rotated ``k`` and ``v`` into the pool at ``kv_store``'s slots, as a
    backend's store does (off the Triton path: never on the fast path)."""
    k_buf, v_buf, loc = kv_store
    k_buf[loc] = to_kv_dtype(k.reshape(k.shape[0], *k_buf.shape[1:]), k_buf.dtype)
    v_buf[loc] = to_kv_dtype(v.reshape(v.shape[0], *v_buf.shape[1:]), v_buf.dtype)


def default_inv_freq(head_dim: int, base: float) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


def llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1 frequency-dependent scaling: long wavelengths are divided by
    ``factor``, short ones kept, the band between them interpolated."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
    return torch.where(is_medium, smoothed, scaled)


def dynamic_ntk_inv_freq(head_dim: int, base: float, factor: float, max_position: int, seq_len: int) -> torch.Tensor:
    """NTK-aware base for a context of ``seq_len`` > ``max_position``."""
    base = base * ((factor * seq_len / max_position) - (factor - 1)) ** (head_dim / (head_dim - 2))
    return default_inv_freq(head_dim, base)


def get_rope(head_dim: int, max_position: int, base: float, rope_scaling: dict | None = None) -> RotaryEmbedding:
    """Build the rotary embedding for ``rope_scaling`` (HF's ``rope_parameters``
    / ``rope_scaling`` dict, or None).

    Supported types: default, ``linear`` (positions divided by ``factor``; the
    cache covers ``max_position * factor``), ``llama3``, and ``dynamic`` (NTK):
    inside ``max_position`` it is plain RoPE, exactly as HF; beyond it the
    cache uses the NTK base for the whole extended length
    ``max_position * factor``. HF instead recomputes the base from the current
    sequence length at every call, which would change the keys already in the
    KV cache, so past ``max_position`` the two differ by design.
    """
    rope_type = _rope_type(rope_scaling)
    inv_freq = default_inv_freq(head_dim, base)
    positions = torch.arange(max_position, dtype=torch.float32)
    if rope_type == "llama3":
        inv_freq = llama3_inv_freq(inv_freq, {"original_max_position_embeddings": max_position, **rope_scaling})
    elif rope_type == "linear":
        inv_freq = inv_freq / rope_scaling["factor"]
        positions = torch.arange(int(max_position * rope_scaling["factor"]), dtype=torch.float32)
    elif rope_type == "dynamic":
        return _dynamic_rope(head_dim, max_position, base, rope_scaling["factor"])
    return RotaryEmbedding(head_dim, positions[:, None] * inv_freq[None, :])


def _dynamic_rope(head_dim: int, max_position: int, base: float, factor: float) -> RotaryEmbedding:
    total = int(max_position * factor)
    freqs = torch.arange(total, dtype=torch.float32)[:, None] * default_inv_freq(head_dim, base)[None, :]
    if total > max_position:
        long_inv_freq = dynamic_ntk_inv_freq(head_dim, base, factor, max_position, total)
        freqs[max_position:] = torch.arange(max_position, total, dtype=torch.float32)[:, None] * long_inv_freq
    return RotaryEmbedding(head_dim, freqs)


def _rope_type(rope_scaling: dict | None) -> str:
    if not rope_scaling:
        return "default"
    if rope_scaling.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial rotary embeddings (partial_rotary_factor < 1) are not supported")
    rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
    if rope_type != "default" and rope_type not in _SCALED_TYPES:
        raise ValueError(f"rope type {rope_type!r} is not supported (supported: default, {', '.join(_SCALED_TYPES)})")
    return rope_type


def rope_params_from_config(config) -> tuple[float, dict | None]:
    """``(rope_theta, scaling dict or None)`` from an HF config of either
    transformers 5 (``rope_parameters``) or 4 (``rope_theta`` + ``rope_scaling``)."""
    params = getattr(config, "rope_parameters", None)
    if params and "rope_theta" in params:
        return float(params["rope_theta"]), dict(params)
    scaling = getattr(config, "rope_scaling", None)
    return float(getattr(config, "rope_theta", 10000.0)), dict(scaling) if scaling else None
