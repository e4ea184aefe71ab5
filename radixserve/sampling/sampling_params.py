"""``SamplingParams``: what a user may ask of the sampler for one request.

Field names and defaults follow SGLang so that requests written for SGLang
work unchanged. Validation happens once, at the edge (``verify``); the engine
then works on ``normalize``d params and never re-checks them.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

# A temperature below this is treated as greedy decoding.
GREEDY_EPS = 1e-6
# top_k meaning "no limit" when the vocabulary size is not known yet.
TOP_K_ALL = 1 << 30


@dataclass
class SamplingParams:
    """Per-request sampling settings (SGLang's names and defaults).

    ``top_k == -1`` means no top-k limit. ``logit_bias`` maps token ids (int, or
    str as OpenAI's JSON sends them) to a bias added to the logits.
    ``sampling_seed`` makes the request's sampling reproducible, independent of
    which other requests share its batch.
    """

    max_new_tokens: int = 128
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_new_tokens: int = 0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = 1
    logit_bias: dict[int | str, float] | None = None
    sampling_seed: int | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "SamplingParams":
        """Build from a plain dict, rejecting keys that are not fields."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"{unknown[0]}: unknown sampling parameter(s): {', '.join(unknown)}")
        return cls(**d)

    @property
    def is_greedy(self) -> bool:
        """True when sampling reduces to argmax."""
        return self.temperature < GREEDY_EPS or self.top_k == 1

    def verify(self, vocab_size: int | None = None) -> None:
        """Raise ``ValueError`` naming the first invalid field and its value.

        Token ids (``logit_bias`` keys, ``stop_token_ids``) are range-checked
        only when ``vocab_size`` is given.
        """
        self._verify_ranges()
        self._verify_stops(vocab_size)
        self._verify_logit_bias(vocab_size)
        if self.sampling_seed is not None:
            _require(_is_int(self.sampling_seed), "sampling_seed", self.sampling_seed, "an integer")

    def normalize(self, vocab_size: int | None = None) -> "SamplingParams":
        """Put the params in the canonical form the engine relies on; returns self.

        - ``stop`` becomes a list (``[]`` when unset), ``stop_token_ids`` a
          de-duplicated list, ``logit_bias`` keys become ints.
        - Greedy: a temperature below ``GREEDY_EPS`` becomes ``top_k = 1`` with
          ``temperature = 1.0``, as in SGLang. The sampler treats ``top_k == 1``
          as argmax; a temperature of 1.0 keeps the temperature division finite
          without changing which token is the argmax.
        - ``top_k == -1`` (or a top_k above the vocabulary) becomes the
          vocabulary size, or ``TOP_K_ALL`` when that is not known.

        Idempotent: normalizing twice gives the same params.
        """
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop_token_ids = list(dict.fromkeys(self.stop_token_ids or []))
        if self.logit_bias:
            self.logit_bias = {_bias_key(k): float(v) for k, v in self.logit_bias.items()}
        if self.temperature < GREEDY_EPS:
            self.temperature, self.top_k = 1.0, 1
        limit = vocab_size if vocab_size is not None else TOP_K_ALL
        if self.top_k == -1 or self.top_k > limit:
            self.top_k = limit
        return self

    def stop_str_max_len(self, tokenizer: Any = None) -> int:
        """Length of the longest stop string: in tokens when a tokenizer is
        given (how far back a detokenizer must look), else in characters."""
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if tokenizer is None:
            return max((len(s) for s in stops), default=0)
        return max((len(tokenizer.encode(s, add_special_tokens=False)) for s in stops), default=0)

    def _verify_ranges(self) -> None:
        for name, ok, expectation in _NUMBER_RULES:
            value = getattr(self, name)
            _require(_is_num(value) and ok(value), name, value, expectation)
        for name, ok, expectation in _INT_RULES:
            value = getattr(self, name)
            _require(_is_int(value) and ok(value), name, value, expectation)
        low_enough = _is_int(self.min_new_tokens) and 0 <= self.min_new_tokens <= self.max_new_tokens
        limit = f"in [0, max_new_tokens={self.max_new_tokens}]"
        _require(low_enough, "min_new_tokens", self.min_new_tokens, limit)

    def _verify_stops(self, vocab_size: int | None) -> None:
        stops = [self.stop] if isinstance(self.stop, str) else self.stop
        if stops is not None:
            ok = isinstance(stops, list) and all(isinstance(s, str) and s for s in stops)
            _require(ok, "stop", self.stop, "a non-empty string or a list of them")
        ok = all(_is_token(tok, vocab_size) for tok in self.stop_token_ids or [])
        _require(ok, "stop_token_ids", self.stop_token_ids, f"token ids {_token_range(vocab_size)}")

    def _verify_logit_bias(self, vocab_size: int | None) -> None:
        for key, bias in (self.logit_bias or {}).items():
            entry = {key: bias}
            in_vocab = _is_token(_bias_key(key), vocab_size)
            _require(in_vocab, "logit_bias", entry, f"keyed by token ids {_token_range(vocab_size)}")
            _require(_is_num(bias) and math.isfinite(bias), "logit_bias", entry, "finite biases")


# (field, test of a valid value, what the error says it must be)
_NUMBER_RULES = (
    ("temperature", lambda v: v >= 0, ">= 0"),
    ("top_p", lambda v: 0 < v <= 1, "in (0, 1]"),
    ("min_p", lambda v: 0 <= v <= 1, "in [0, 1]"),
    ("frequency_penalty", lambda v: -2 <= v <= 2, "in [-2, 2]"),
    ("presence_penalty", lambda v: -2 <= v <= 2, "in [-2, 2]"),
    ("repetition_penalty", lambda v: 0 < v < math.inf, "> 0 and finite"),
)
_INT_RULES = (
    ("top_k", lambda v: v == -1 or v >= 1, "-1 (all) or >= 1"),
    ("max_new_tokens", lambda v: v >= 0, ">= 0"),
    ("n", lambda v: v >= 1, ">= 1"),
)


def _require(ok: bool, field: str, value: Any, expectation: str) -> None:
    if not ok:
        raise ValueError(f"{field}: invalid sampling parameter {field}={value!r}: must be {expectation}")


def _is_num(x: Any) -> bool:
    """A real number that is not a bool and not NaN."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_token(tok: Any, vocab_size: int | None) -> bool:
    return _is_int(tok) and tok >= 0 and (vocab_size is None or tok < vocab_size)


def _token_range(vocab_size: int | None) -> str:
    return "in [0, vocab_size)" if vocab_size is None else f"in [0, {vocab_size})"


def _bias_key(key: int | str) -> int:
    """A logit_bias key as a token id; OpenAI's JSON sends them as strings."""
    if _is_int(key):
        return key
    if isinstance(key, str) and key.strip().lstrip("-").isdigit():
        return int(key)
    raise ValueError(f"logit_bias: invalid sampling parameter logit_bias={{{key!r}: ...}}: must be keyed by token ids")
