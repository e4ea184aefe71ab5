"""The Sampler: turns a batch's last-position logits into next token ids.

Order of operations (all vectorised over the batch, no host sync unless top
logprobs are asked for):

1. raw logprobs = log_softmax(logits as given), if asked for;
2. penalties, logit_bias and min_new_tokens, in place (``SamplingBatchInfo``);
3. all rows greedy: argmax. Otherwise: divide by temperature, softmax, then
   top-k, top-p and min-p, each on what the previous filter left (as HF's
   warpers and vLLM do), and draw one token per row. Greedy rows of a mixed
   batch still take the argmax.

The draw is an exponential race: ``argmax(p / E)`` with ``E ~ Exp(1)`` per
token picks token ``i`` with probability ``p_i / sum(p)``, so filtered
probabilities need no renormalization. For a seeded request ``E`` comes from
a hash of (seed, step, token id); for the others from torch's global RNG. The
hash makes a seeded request's tokens depend only on its own logits, seed and
step, never on the batch it runs in.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.sampling.sampling_batch_info import SamplingBatchInfo


@dataclass
class SampleOutput:
    """One sampled token per row, and optionally its logprobs.

    Logprobs are of the RAW model distribution: log_softmax of the logits the
    sampler was given, before penalties and temperature (vLLM's "raw
    logprobs").
    """

    next_token_ids: torch.Tensor  # [bs] int64
    next_token_logprobs: torch.Tensor | None = None  # [bs] float32
    top_logprobs_val: list[list[float]] | None = None  # per row, top_logprobs_nums[i] long
    top_logprobs_idx: list[list[int]] | None = None
    token_ids_logprobs_val: list[list[float] | None] | None = None  # per row, of token_ids_logprobs[i] (or None)


class Sampler(nn.Module):
    """Samples next tokens from ``[bs, vocab]`` logits; see the module docstring."""

    def forward(
        self,
        logits: torch.Tensor,
        sampling_info: SamplingBatchInfo,
        return_logprob: bool = False,
        top_logprobs_nums: list[int] | None = None,
        step_positions: torch.Tensor | None = None,
        token_ids_logprobs: list[list[int] | None] | None = None,
    ) -> SampleOutput:
        """Sample one token per row. ``logits`` (float32) is modified in place.
        With ``return_logprob``, row ``i`` also gets the logprobs of its
        ``top_logprobs_nums[i]`` likeliest tokens and of the ids
        ``token_ids_logprobs[i]`` names (SGLang's ``token_ids_logprob``).

        ``step_positions`` [bs] int64 is how many tokens each request has
        generated so far (``len(output_ids)``); it keys seeded noise. When
        omitted, ``sampling_info.output_lens`` is used, which is right as long
        as the caller calls ``cumulate_output_tokens`` after each step.
        """
        logits = logits.float()
        raw_logprobs = torch.log_softmax(logits, dim=-1) if return_logprob else None
        sampling_info.apply_penalties(logits)
        if sampling_info.is_all_greedy:
            next_ids = logits.argmax(dim=-1)
        else:
            steps = sampling_info.output_lens if step_positions is None else step_positions
            next_ids = sample_from_logits(logits, sampling_info, steps)
        if raw_logprobs is None:
            return SampleOutput(next_ids)
        return _with_logprobs(next_ids, raw_logprobs, top_logprobs_nums, token_ids_logprobs)


def sample_from_logits(logits: torch.Tensor, info: SamplingBatchInfo, steps: torch.Tensor) -> torch.Tensor:
    """Temperature, top-k / top-p / min-p and a draw for every row; greedy
    rows take the argmax. Divides ``logits`` by the temperatures in place."""
    greedy_ids = logits.argmax(dim=-1)
    probs = torch.softmax(logits.div_(info.temperatures), dim=-1)
    noise = exponential_noise(info, steps, probs.shape[-1])
    if info.need_top_k_sampling or info.need_top_p_sampling:
        sampled = _sample_sorted(probs, noise, info)
    else:
        if info.need_min_p_sampling:
            apply_min_p_(probs, info.min_ps)
        sampled = _race(probs, noise)
    return torch.where(info.top_ks == 1, greedy_ids, sampled)


def _sample_sorted(probs: torch.Tensor, noise: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    """Filter in descending-probability order, then map the draw back to ids."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    if info.need_top_k_sampling:
        apply_top_k_sorted_(sorted_probs, info.top_ks)
    if info.need_top_p_sampling:
        apply_top_p_sorted_(sorted_probs, info.top_ps)
    if info.need_min_p_sampling:
        apply_min_p_(sorted_probs, info.min_ps)
    position = _race(sorted_probs, noise.gather(1, order))
    return order.gather(1, position.view(-1, 1)).view(-1)


def apply_top_k_sorted_(sorted_probs: torch.Tensor, top_ks: torch.Tensor) -> None:
    """Zero every rank at or past ``top_ks`` [bs] (probs sorted descending)."""
    ranks = torch.arange(sorted_probs.shape[-1], device=sorted_probs.device)
    sorted_probs.masked_fill_(ranks.view(1, -1) >= top_ks.view(-1, 1), 0.0)


def apply_top_p_sorted_(sorted_probs: torch.Tensor, top_ps: torch.Tensor) -> None:
    """Keep the smallest prefix whose mass reaches ``top_ps`` of what is left.

    A token is dropped when the tokens ranked above it already hold
    ``top_p`` of the (unnormalized) mass. Rows with ``top_p == 1`` keep
    everything: float rounding in the cumsum must not cut their tail.
    """
    cumsum = sorted_probs.cumsum(dim=-1)
    mass_before = F.pad(cumsum[:, :-1], (1, 0))
    outside = mass_before >= top_ps.view(-1, 1) * cumsum[:, -1:]
    sorted_probs.masked_fill_(outside & (top_ps < 1.0).view(-1, 1), 0.0)


def apply_min_p_(probs: torch.Tensor, min_ps: torch.Tensor) -> None:
    """Zero tokens below ``min_ps`` times the row's top probability. The
    ratio test needs no renormalization, so order and scale do not matter."""
    threshold = probs.amax(dim=-1, keepdim=True) * min_ps.view(-1, 1)
    probs.masked_fill_(probs < threshold, 0.0)


def _race(weights: torch.Tensor, exponential: torch.Tensor) -> torch.Tensor:
    """Index of ``argmax(weights / exponential)`` per row: a draw proportional
    to ``weights`` (which need not sum to 1; zeros are never drawn)."""
    return (weights / exponential).argmax(dim=-1)


# --- noise -----------------------------------------------------------------

# Smallest uniform used: keeps -log(u) finite. u is a multiple of 2**-24 in [0, 1).
_MIN_UNIFORM = 2.0**-25


def exponential_noise(info: SamplingBatchInfo, steps: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[bs, vocab]`` Exp(1) noise: hashed for seeded rows, torch.rand otherwise."""
    bs = info.temperatures.shape[0]
    uniform = torch.rand(bs, vocab_size, device=info.temperatures.device)
    if info.sampling_seeds is not None:
        hashed = seeded_uniform(info.sampling_seeds, steps, vocab_size)
        uniform = torch.where(info.has_seed.view(-1, 1), hashed, uniform)
    return -torch.log(uniform.clamp_min(_MIN_UNIFORM))


def _as_signed(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


# SplitMix64 constants, as signed int64 so torch accepts them.
_GOLDEN = _as_signed(0x9E3779B97F4A7C15)
_MIX1 = _as_signed(0xBF58476D1CE4E5B9)
_MIX2 = _as_signed(0x94D049BB133111EB)


def _shr(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's ``>>`` is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def mix64(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finalizer on int64 tensors (wrapping multiplication): a
    bijection of 64-bit values that scrambles every input bit into every
    output bit."""
    x = (x ^ _shr(x, 30)) * _MIX1
    x = (x ^ _shr(x, 27)) * _MIX2
    return x ^ _shr(x, 31)


def seeded_uniform(seeds: torch.Tensor, steps: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[bs, vocab]`` uniforms in [0, 1), a pure function of (seed, step, token id).

    Each (seed, step) picks a pseudo-random SplitMix64 stream state; token
    ``t`` takes the stream's ``t+1``-th output. The top 24 bits become a
    float32 exactly.
    """
    row_state = mix64(mix64(seeds + _GOLDEN) + steps.to(torch.int64) * _GOLDEN)
    tokens = torch.arange(1, vocab_size + 1, dtype=torch.int64, device=seeds.device)
    hashed = mix64(row_state.view(-1, 1) + tokens.view(1, -1) * _GOLDEN)
    return _shr(hashed, 40).to(torch.float32) * 2.0**-24


# --- logprobs --------------------------------------------------------------


def _with_logprobs(
    next_ids: torch.Tensor, raw_logprobs: torch.Tensor, top_nums: list[int] | None,
    token_ids: list[list[int] | None] | None = None,
) -> SampleOutput:
    """Attach the chosen tokens' raw logprobs and, if asked, the top ones and
    those of the ids named (the only host transfers the sampler makes)."""
    out = SampleOutput(next_ids, raw_logprobs.gather(1, next_ids.view(-1, 1)).view(-1))
    if top_nums is not None:
        k = min(max(top_nums, default=0), raw_logprobs.shape[-1])
        values, indices = raw_logprobs.topk(k, dim=-1)
        values, indices = values.tolist(), indices.tolist()
        out.top_logprobs_val = [row[:n] for row, n in zip(values, top_nums)]
        out.top_logprobs_idx = [row[:n] for row, n in zip(indices, top_nums)]
    if token_ids is not None and any(ids is not None for ids in token_ids):
        out.token_ids_logprobs_val = _logprobs_of(raw_logprobs, token_ids)
    return out


def _logprobs_of(logprobs: torch.Tensor, token_ids: list[list[int] | None]) -> list[list[float] | None]:
    """Row ``i``'s logprobs of the ids ``token_ids[i]`` names (None: none), in one gather and one transfer."""
    rows = torch.tensor([i for i, ids in enumerate(token_ids) for _ in ids or ()], dtype=torch.int64)
    cols = torch.tensor([t for ids in token_ids for t in ids or ()], dtype=torch.int64)
    flat = logprobs[rows.to(logprobs.device), cols.to(logprobs.device)].tolist()
    out, start = [], 0
    for ids in token_ids:
        out.append(None if ids is None else flat[start : start + len(ids)])
        start += len(ids or ())
    return out
