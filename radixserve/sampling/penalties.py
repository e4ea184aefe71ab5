"""Batched logit penalties, applied in place to ``[bs, vocab]`` logits before
temperature scaling.

Semantics (each row uses only its own request's settings):

- ``repetition_penalty`` (HF / vLLM / CTRL): for every token that occurs in
  the prompt or the generated output, a logit ``> 0`` is divided by the
  penalty, any other logit multiplied by it.
- ``frequency_penalty`` and ``presence_penalty`` (OpenAI): over GENERATED
  tokens only, ``logit -= frequency * count + presence * (count > 0)``.
- ``logit_bias``: the bias is added to the token's logit.
- ``min_new_tokens``: while fewer than ``min_new_tokens`` tokens have been
  generated, the request's stop tokens (``req.stop_token_ids_all``) get -inf,
  unless nothing else is left (a grammar whose only next token is its end:
  the grammar's end wins, and the request stops short of ``min_new_tokens``).

They are applied in that order (multiplicative, then additive, then masks), as
vLLM does. A penalizer exists in a batch only when some request uses it, so a
``[bs, vocab]`` tensor is allocated only then; rows of requests that do not
use it hold neutral settings (penalty 0 or 1, bias 0, min_new_tokens 0).

State is updated incrementally with ``cumulate(next_token_ids)`` after each
sampled step; building from the request lists gives the same effect.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from typing import Any, Protocol, Sequence

import torch

from radixserve.sampling.sampling_params import SamplingParams


class PenaltyReq(Protocol):
    """What the penalizers read from a request."""

    sampling_params: SamplingParams
    origin_input_ids: list[int]
    output_ids: list[int]
    stop_token_ids_all: set[int]


class Penalizer(ABC):
    """One kind of penalty over a batch. Every tensor named in ``_state`` has
    one row per request, so ``filter`` and ``merge`` are generic."""

    _state: tuple[str, ...] = ()

    def __init__(self, rows_used: list[bool]):
        # Host-side: which rows use this penalty, so that a penalizer whose
        # users all left can be dropped without reading the device.
        self.rows_used = rows_used

    @staticmethod
    @abstractmethod
    def is_used(params: SamplingParams) -> bool:
        """Whether a request with these params needs this penalizer."""

    @classmethod
    @abstractmethod
    def build(cls, reqs: Sequence[PenaltyReq], vocab_size: int, device: Any) -> "Penalizer":
        """State for ``reqs`` from scratch (their token lists as they are now)."""

    @classmethod
    @abstractmethod
    def neutral(cls, batch_size: int, vocab_size: int, device: Any) -> "Penalizer":
        """State for ``batch_size`` rows that do not use this penalty."""

    @abstractmethod
    def apply(self, logits: torch.Tensor) -> None:
        """Penalize ``logits`` [bs, vocab] in place."""

    def cumulate(self, next_token_ids: torch.Tensor) -> None:
        """Account for one newly generated token per row."""

    def filter(self, keep_indices: list[int], keep: torch.Tensor) -> None:
        """Keep only rows ``keep_indices`` (``keep``: the same, on the device)."""
        for name in self._state:
            setattr(self, name, getattr(self, name)[keep])
        self.rows_used = [self.rows_used[i] for i in keep_indices]

    def merge(self, other: "Penalizer") -> None:
        """Append ``other``'s rows after this batch's rows."""
        for name in self._state:
            setattr(self, name, torch.cat([getattr(self, name), getattr(other, name)]))
        self.rows_used = self.rows_used + other.rows_used


class RepetitionPenalizer(Penalizer):
    """HF-style repetition penalty over prompt + generated tokens."""

    _state = ("seen", "penalties")

    def __init__(self, seen: torch.Tensor, penalties: torch.Tensor, rows_used: list[bool]):
        super().__init__(rows_used)
        self.seen = seen  # [bs, vocab] bool
        self.penalties = penalties  # [bs, 1] float32

    @staticmethod
    def is_used(params: SamplingParams) -> bool:
        return params.repetition_penalty != 1.0

    @classmethod
    def build(cls, reqs, vocab_size, device):
        used = [cls.is_used(r.sampling_params) for r in reqs]
        ids = [r.origin_input_ids + r.output_ids if u else [] for r, u in zip(reqs, used)]
        seen = token_counts(ids, vocab_size, device) > 0
        pens = [[r.sampling_params.repetition_penalty] for r in reqs]
        return cls(seen, torch.tensor(pens, dtype=torch.float32, device=device), used)

    @classmethod
    def neutral(cls, batch_size, vocab_size, device):
        seen = torch.zeros(batch_size, vocab_size, dtype=torch.bool, device=device)
        return cls(seen, torch.ones(batch_size, 1, device=device), [False] * batch_size)

    def apply(self, logits):
        penalized = torch.where(logits > 0, logits / self.penalties, logits * self.penalties)
        logits.copy_(torch.where(self.seen, penalized, logits))

    def cumulate(self, next_token_ids):
        self.seen.scatter_(1, next_token_ids.view(-1, 1), True)


class FrequencyPresencePenalizer(Penalizer):
    """OpenAI frequency and presence penalties over generated tokens. One
    penalizer for both, so they share a single count tensor."""

    _state = ("counts", "frequency", "presence")

    def __init__(self, counts, frequency, presence, rows_used: list[bool]):
        super().__init__(rows_used)
        self.counts = counts  # [bs, vocab] float32
        self.frequency = frequency  # [bs, 1] float32
        self.presence = presence  # [bs, 1] float32

    @staticmethod
    def is_used(params: SamplingParams) -> bool:
        return params.frequency_penalty != 0.0 or params.presence_penalty != 0.0

    @classmethod
    def build(cls, reqs, vocab_size, device):
        used = [cls.is_used(r.sampling_params) for r in reqs]
        counts = token_counts([r.output_ids if u else [] for r, u in zip(reqs, used)], vocab_size, device)
        freq = [[r.sampling_params.frequency_penalty] for r in reqs]
        pres = [[r.sampling_params.presence_penalty] for r in reqs]
        as_tensor = lambda x: torch.tensor(x, dtype=torch.float32, device=device)  # noqa: E731
        return cls(counts, as_tensor(freq), as_tensor(pres), used)

    @classmethod
    def neutral(cls, batch_size, vocab_size, device):
        counts = torch.zeros(batch_size, vocab_size, device=device)
        zeros = torch.zeros(batch_size, 1, device=device)
        return cls(counts, zeros, zeros.clone(), [False] * batch_size)

    def apply(self, logits):
        logits.sub_(self.counts * self.frequency)
        logits.sub_((self.counts > 0) * self.presence)

    def cumulate(self, next_token_ids):
        ones = torch.ones(next_token_ids.numel(), 1, device=self.counts.device)
        self.counts.scatter_add_(1, next_token_ids.view(-1, 1), ones)


class LogitBiasPenalizer(Penalizer):
    """Adds each request's ``logit_bias``."""

    _state = ("bias",)

    def __init__(self, bias: torch.Tensor, rows_used: list[bool]):
        super().__init__(rows_used)
        self.bias = bias  # [bs, vocab] float32

    @staticmethod
    def is_used(params: SamplingParams) -> bool:
        return bool(params.logit_bias)

    @classmethod
    def build(cls, reqs, vocab_size, device):
        entries = [(row, int(tok), val) for row, r in enumerate(reqs)
                   for tok, val in (r.sampling_params.logit_bias or {}).items()]
        rows, toks, vals = zip(*entries) if entries else ((), (), ())
        bias = torch.zeros(len(reqs), vocab_size)
        bias[list(rows), list(toks)] = torch.tensor(vals, dtype=torch.float32)
        return cls(bias.to(device), [cls.is_used(r.sampling_params) for r in reqs])

    @classmethod
    def neutral(cls, batch_size, vocab_size, device):
        return cls(torch.zeros(batch_size, vocab_size, device=device), [False] * batch_size)

    def apply(self, logits):
        logits.add_(self.bias)


class MinNewTokensPenalizer(Penalizer):
    """Bans a request's stop tokens until it has ``min_new_tokens`` outputs."""

    _state = ("stop_mask", "min_new_tokens", "output_lens")

    def __init__(self, stop_mask, min_new_tokens, output_lens, rows_used: list[bool]):
        super().__init__(rows_used)
        self.stop_mask = stop_mask  # [bs, vocab] bool
        self.min_new_tokens = min_new_tokens  # [bs] int64
        self.output_lens = output_lens  # [bs] int64

    @staticmethod
    def is_used(params: SamplingParams) -> bool:
        return params.min_new_tokens > 0

    @classmethod
    def build(cls, reqs, vocab_size, device):
        used = [cls.is_used(r.sampling_params) for r in reqs]
        # A stop id beyond the logits is a token the model cannot emit: nothing to ban.
        stops = [[t for t in r.stop_token_ids_all if t < vocab_size] if u else [] for r, u in zip(reqs, used)]
        as_tensor = lambda x: torch.tensor(x, dtype=torch.int64, device=device)  # noqa: E731
        min_new = as_tensor([r.sampling_params.min_new_tokens for r in reqs])
        lens = as_tensor([len(r.output_ids) for r in reqs])
        return cls(token_counts(stops, vocab_size, device) > 0, min_new, lens, used)

    @classmethod
    def neutral(cls, batch_size, vocab_size, device):
        mask = torch.zeros(batch_size, vocab_size, dtype=torch.bool, device=device)
        zeros = torch.zeros(batch_size, dtype=torch.int64, device=device)
        return cls(mask, zeros, zeros.clone(), [False] * batch_size)

    def apply(self, logits):
        too_short = (self.output_lens < self.min_new_tokens).view(-1, 1)
        banned = logits.masked_fill(self.stop_mask & too_short, float("-inf"))
        # A row left with no token (a grammar that can only end) keeps its stop
        # tokens: the grammar's end outranks min_new_tokens.
        stuck = torch.isneginf(banned).all(dim=-1, keepdim=True)
        logits.copy_(torch.where(stuck, logits, banned))

    def cumulate(self, next_token_ids):
        self.output_lens += 1


# Application order: multiplicative, additive, bias, then hard masks last so
# that nothing can lift a banned token back from -inf.
PENALIZER_TYPES: tuple[type[Penalizer], ...] = (
    RepetitionPenalizer,
    FrequencyPresencePenalizer,
    LogitBiasPenalizer,
    MinNewTokensPenalizer,
)


class BatchedPenalizers:
    """The penalizers a batch needs, in application order. Empty (and free)
    when no request in the batch uses any penalty."""

    def __init__(
        self, penalizers: dict[type[Penalizer], Penalizer], batch_size: int, vocab_size: int, device: Any
    ):
        self.penalizers = penalizers
        self.batch_size = batch_size
        self.vocab_size = vocab_size
        self.device = device

    @classmethod
    def from_reqs(cls, reqs: Sequence[PenaltyReq], vocab_size: int, device: Any) -> "BatchedPenalizers":
        """Build only the penalizers that some request in ``reqs`` uses."""
        penalizers = {
            kind: kind.build(reqs, vocab_size, device)
            for kind in PENALIZER_TYPES
            if any(kind.is_used(r.sampling_params) for r in reqs)
        }
        return cls(penalizers, len(reqs), vocab_size, device)

    @property
    def is_active(self) -> bool:
        return bool(self.penalizers)

    def apply(self, logits: torch.Tensor) -> None:
        """Apply every penalty to ``logits`` [bs, vocab] in place."""
        for penalizer in self.penalizers.values():
            penalizer.apply(logits)

    def cumulate(self, next_token_ids: torch.Tensor) -> None:
        """Update state with one new token per row ([bs] int64, on device)."""
        for penalizer in self.penalizers.values():
            penalizer.cumulate(next_token_ids)

    def filter(self, keep_indices: list[int], keep: torch.Tensor) -> None:
        """Keep rows ``keep_indices``; drop penalizers no remaining row uses."""
        for kind, penalizer in list(self.penalizers.items()):
            penalizer.filter(keep_indices, keep)
            if not any(penalizer.rows_used):
                del self.penalizers[kind]
        self.batch_size = len(keep_indices)

    def merge(self, other: "BatchedPenalizers") -> None:
        """Append ``other``'s rows; a penalizer only one side has gets neutral
        rows for the other side."""
        merged = {}
        for kind in PENALIZER_TYPES:
            mine, theirs = self.penalizers.get(kind), other.penalizers.get(kind)
            if mine is None and theirs is None:
                continue
            if mine is None:
                mine = kind.neutral(self.batch_size, self.vocab_size, self.device)
            if theirs is None:
                theirs = kind.neutral(other.batch_size, self.vocab_size, self.device)
            mine.merge(theirs)
            merged[kind] = mine
        self.penalizers = merged
        self.batch_size += other.batch_size


def token_counts(id_lists: Sequence[Sequence[int]], vocab_size: int, device: Any) -> torch.Tensor:
    """``[len(id_lists), vocab]`` float32 counts of each token id per row,
    built with one scatter rather than a loop over rows."""
    lengths = torch.tensor([len(ids) for ids in id_lists], dtype=torch.int64)
    flat = torch.tensor(list(itertools.chain.from_iterable(id_lists)), dtype=torch.int64)
    rows = torch.repeat_interleave(torch.arange(len(id_lists)), lengths)
    counts = torch.zeros(len(id_lists) * vocab_size, device=device)
    index = (rows * vocab_size + flat).to(device)
    counts.scatter_add_(0, index, torch.ones(index.numel(), device=device))
    return counts.view(len(id_lists), vocab_size)
