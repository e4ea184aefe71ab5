"""``SamplingBatchInfo``: the sampling settings of a batch as device tensors,
plus the batch's penalty state. Built from requests, then kept in step with
the running batch by ``cumulate_output_tokens``, ``filter`` and ``merge``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from radixserve.sampling.penalties import BatchedPenalizers, PenaltyReq
from radixserve.sampling.sampling_params import SamplingParams

_INT64_MIN, _UINT64 = -(1 << 63), 1 << 64
# Per-row tensors every batch has (the seed tensors exist only when used).
_ROW_TENSORS = ("temperatures", "top_ps", "top_ks", "min_ps", "output_lens")


@dataclass
class SamplingBatchInfo:
    """Per-row sampling settings for a batch of ``bs`` requests.

    A greedy row (``SamplingParams.is_greedy``: temperature ~0 or top_k 1) has
    ``top_ks == 1`` and ``temperatures == 1``. The boolean flags are computed
    on the host from ``params`` so the sampler can skip work without reading
    the device.
    """

    temperatures: torch.Tensor  # [bs, 1] float32
    top_ps: torch.Tensor  # [bs] float32
    top_ks: torch.Tensor  # [bs] int64, in [1, vocab]
    min_ps: torch.Tensor  # [bs] float32
    output_lens: torch.Tensor  # [bs] int64: tokens generated so far
    sampling_seeds: torch.Tensor | None  # [bs] int64, None when no row is seeded
    has_seed: torch.Tensor | None  # [bs] bool, None when no row is seeded
    penalizers: BatchedPenalizers
    params: list[SamplingParams]
    vocab_size: int
    device: Any
    is_all_greedy: bool = True
    need_top_k_sampling: bool = False
    need_top_p_sampling: bool = False
    need_min_p_sampling: bool = False

    @classmethod
    def from_reqs(cls, reqs: Sequence[PenaltyReq], vocab_size: int, device: Any) -> "SamplingBatchInfo":
        """Build from scratch. Each req has ``sampling_params`` (normalized),
        ``origin_input_ids``, ``output_ids`` and ``stop_token_ids_all``."""
        params = [r.sampling_params for r in reqs]
        rows = [_effective(p, vocab_size) for p in params]
        as_tensor = lambda xs, dtype: torch.tensor(xs, dtype=dtype, device=device)  # noqa: E731
        seeds, has_seed = _seed_tensors(params, device)
        info = cls(
            temperatures=as_tensor([r[0] for r in rows], torch.float32).view(-1, 1),
            top_ps=as_tensor([r[1] for r in rows], torch.float32),
            top_ks=as_tensor([r[2] for r in rows], torch.int64),
            min_ps=as_tensor([r[3] for r in rows], torch.float32),
            output_lens=as_tensor([len(r.output_ids) for r in reqs], torch.int64),
            sampling_seeds=seeds,
            has_seed=has_seed,
            penalizers=BatchedPenalizers.from_reqs(reqs, vocab_size, device),
            params=params,
            vocab_size=vocab_size,
            device=device,
        )
        info._update_flags()
        return info

    @property
    def batch_size(self) -> int:
        return len(self.params)

    def apply_penalties(self, logits: torch.Tensor) -> None:
        """Apply penalties, logit_bias and min_new_tokens to ``logits``
        [bs, vocab] in place (before temperature). A no-op when unused."""
        self.penalizers.apply(logits)

    def cumulate_output_tokens(self, next_token_ids: torch.Tensor) -> None:
        """Record one newly generated token per row ([bs] int64, on device),
        without rebuilding from the token lists."""
        self.output_lens += 1
        self.penalizers.cumulate(next_token_ids)

    def filter(self, keep_indices: list[int], keep: torch.Tensor | None = None) -> None:
        """Keep only rows ``keep_indices`` (in that order), in place. ``keep``
        is the same list already on the device, if the caller has it (so that
        no host-to-device copy is issued here)."""
        if keep is None:
            keep = torch.tensor(keep_indices, dtype=torch.int64, device=self.device)
        for name in _ROW_TENSORS + ("sampling_seeds", "has_seed"):
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, value[keep])
        self.params = [self.params[i] for i in keep_indices]
        if not any(p.sampling_seed is not None for p in self.params):
            self.sampling_seeds = self.has_seed = None
        self.penalizers.filter(keep_indices, keep)
        self._update_flags()

    def merge(self, other: "SamplingBatchInfo") -> None:
        """Append ``other``'s rows after this batch's rows, in place."""
        for name in _ROW_TENSORS:
            setattr(self, name, torch.cat([getattr(self, name), getattr(other, name)]))
        if self.sampling_seeds is not None or other.sampling_seeds is not None:
            mine, theirs = self._seeds_or_zeros(), other._seeds_or_zeros()
            self.sampling_seeds = torch.cat([mine[0], theirs[0]])
            self.has_seed = torch.cat([mine[1], theirs[1]])
        self.penalizers.merge(other.penalizers)
        self.params = self.params + other.params
        self._update_flags()

    def _seeds_or_zeros(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.sampling_seeds is not None:
            return self.sampling_seeds, self.has_seed
        zeros = torch.zeros(self.batch_size, dtype=torch.int64, device=self.device)
        return zeros, zeros.bool()

    def _update_flags(self) -> None:
        rows = [_effective(p, self.vocab_size) for p in self.params]
        self.is_all_greedy = all(top_k == 1 for _, _, top_k, _ in rows)
        self.need_top_k_sampling = any(1 < top_k < self.vocab_size for _, _, top_k, _ in rows)
        self.need_top_p_sampling = any(top_p < 1.0 for _, top_p, _, _ in rows)
        self.need_min_p_sampling = any(min_p > 0.0 for _, _, _, min_p in rows)


def _effective(p: SamplingParams, vocab_size: int) -> tuple[float, float, int, float]:
    """(temperature, top_p, top_k, min_p) as the sampler uses them. Greedy
    rows become top_k 1 and temperature 1 even if ``p`` was not normalized."""
    if p.is_greedy:
        return 1.0, 1.0, 1, 0.0
    top_k = vocab_size if p.top_k == -1 else min(p.top_k, vocab_size)
    return p.temperature, p.top_p, top_k, p.min_p


def _seed_tensors(params: list[SamplingParams], device: Any) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Seeds as int64 (any Python int wraps to 64 bits) and a seeded-row mask."""
    if all(p.sampling_seed is None for p in params):
        return None, None
    seeds = [_to_int64(p.sampling_seed or 0) for p in params]
    has = [p.sampling_seed is not None for p in params]
    return (torch.tensor(seeds, dtype=torch.int64, device=device),
            torch.tensor(has, dtype=torch.bool, device=device))


def _to_int64(x: int) -> int:
    """``x`` modulo 2**64, as a signed 64-bit value."""
    return (x - _INT64_MIN) % _UINT64 + _INT64_MIN
