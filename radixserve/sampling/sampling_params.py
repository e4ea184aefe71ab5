"""``SamplingParams``: what a user may ask of the sampler for one request.

Field names and defaults follow SGLang so that requests written for SGLang
work unchanged. Types and ranges are declared once, here, and checked by
pydantic when the params are built (strictly: a bool must be a bool, an int
an int, a float finite); ``verify`` adds what needs the vocabulary. The
engine then works on ``normalize``d params and never re-checks them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import regex
from pydantic import ConfigDict, Field, ValidationError, field_validator
from pydantic.dataclasses import dataclass

from radixserve.validation import NoOpOnly, first_error

# A temperature below this is treated as greedy decoding.
GREEDY_EPS = 1e-6
# top_k meaning "no limit" when the vocabulary size is not known yet.
TOP_K_ALL = 1 << 30
# Bounds that keep one request's work and every number the engine derives
# from it finite (float32 logits, 64-bit seeds, 32-bit token counts).
MAX_INT32 = (1 << 31) - 1
MAX_N = 128  # samples per prompt
MAX_STOP_STRINGS = 128
MAX_STOP_CHARS = 1024  # per stop string: the scheduler re-decodes this much output each step
MAX_STOP_REGEX = 32  # patterns per request, as SGLang
MAX_STOP_REGEX_BYTES = 256  # per pattern, as SGLang
MAX_LOGIT_BIAS = 1e6  # |bias|: still finite in float32 once divided by a tiny temperature
SEED_RANGE = (-(1 << 63), (1 << 64) - 1)  # what a 64-bit seed (and msgpack) holds


@dataclass(config=ConfigDict(strict=True, extra="forbid", allow_inf_nan=False))
class SamplingParams:
    """Per-request sampling settings (SGLang's names and defaults).

    ``top_k == -1`` means no top-k limit. ``logit_bias`` maps token ids (int, or
    str as OpenAI's JSON sends them) to a bias added to the logits.
    ``sampling_seed`` makes the request's sampling reproducible, independent of
    which other requests share its batch. A null field means its default.
    """

    max_new_tokens: int = Field(128, ge=0, le=MAX_INT32)
    stop: str | list[str] | None = None
    stop_regex: str | list[str] | None = None  # Python regular expressions searched in the output (stop_regex.py)
    stop_token_ids: list[int] | None = None
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1, le=MAX_INT32)
    min_p: float = Field(0.0, ge=0, le=1)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float = Field(1.0, gt=0)
    min_new_tokens: int = Field(0, ge=0, le=MAX_INT32)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = Field(1, ge=1, le=MAX_N)
    logit_bias: dict[int | str, float] | None = None
    sampling_seed: int | None = Field(None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    stream_interval: int | None = Field(None, ge=1, le=MAX_INT32)  # tokens per stream event
    # structured output (at most one; sampling/grammar.py): a JSON schema as JSON text, a regular
    # expression, an EBNF grammar, or an SGLang / xgrammar structural tag as JSON text
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    # not implemented: accepted only at their no-op values (validation.NO_OP_VALUES)
    custom_params: NoOpOnly = None
    watermark: NoOpOnly = None
    beam_width: NoOpOnly = None
    ebnf_full_assistant: NoOpOnly = False

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, v: str | list[str] | None) -> str | list[str] | None:
        stops = [v] if isinstance(v, str) else v or []
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        if not all(0 < len(s) <= MAX_STOP_CHARS for s in stops):
            raise ValueError(f"stop strings must be non-empty and at most {MAX_STOP_CHARS} characters")
        return v

    _stop_regex = field_validator("stop_regex")(classmethod(lambda cls, v: check_stop_regex(v)))

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int) -> int:
        if v == 0:
            raise ValueError("must be -1 (all) or >= 1")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v: dict[int | str, float] | None) -> dict[int | str, float] | None:
        for key, bias in (v or {}).items():
            if not _is_token_key(key):
                raise ValueError(f"keys must be token ids, got {key!r}")
            if abs(bias) > MAX_LOGIT_BIAS:
                raise ValueError(f"biases must be within ±{MAX_LOGIT_BIAS:g}, got {bias} for token {key}")
        return v

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "SamplingParams":
        """Build from a plain dict; raises ``ValueError("<field>: ...")`` naming
        the first bad or unknown field."""
        if not isinstance(d, dict):
            raise ValueError("sampling_params: must be an object")
        # null means the default, as in SGLang (its frontend sends "regex": null and the like),
        # except that a null max_new_tokens, as there, means up to the context length
        given = {k: v for k, v in d.items() if v is not None or k not in _FIELD_NAMES}
        if "max_new_tokens" in d and d["max_new_tokens"] is None:
            given["max_new_tokens"] = MAX_INT32
        try:
            return cls(**given)
        except ValidationError as exc:
            raise first_error(exc, "invalid sampling parameter") from None

    @property
    def is_greedy(self) -> bool:
        """True when sampling reduces to argmax."""
        return self.temperature < GREEDY_EPS or self.top_k == 1

    def verify(self, vocab_size: int | None = None) -> None:
        """Raise ``ValueError`` naming the first invalid field and its value:
        the checks that span fields or need the vocabulary. Token ids
        (``logit_bias`` keys, ``stop_token_ids``) are range-checked only when
        ``vocab_size`` is given."""
        limit = f"in [0, max_new_tokens={self.max_new_tokens}]"
        _require(self.min_new_tokens <= self.max_new_tokens, "min_new_tokens", self.min_new_tokens, limit)
        grammars = [name for name in ("json_schema", "regex", "ebnf", "structural_tag") if getattr(self, name) is not None]
        if len(grammars) > 1:
            raise ValueError(f"{grammars[1]}: only one of json_schema, regex, ebnf and structural_tag may be set")
        ok = all(_is_token(tok, vocab_size) for tok in self.stop_token_ids or [])
        _require(ok, "stop_token_ids", self.stop_token_ids, f"token ids {_token_range(vocab_size)}")
        for key, bias in (self.logit_bias or {}).items():
            ok = _is_token_key(key) and _is_token(_bias_key(key), vocab_size)
            _require(ok, "logit_bias", {key: bias}, f"keyed by token ids {_token_range(vocab_size)}")

    def normalize(self, vocab_size: int | None = None) -> "SamplingParams":
        """Put the params in the canonical form the engine relies on; returns self.

        - ``stop`` and ``stop_regex`` become lists (``[]`` when unset), ``stop_token_ids`` a
          de-duplicated list, ``logit_bias`` keys become ints.
        - Greedy: a temperature below ``GREEDY_EPS`` becomes ``top_k = 1`` with
          ``temperature = 1.0``, as in SGLang. The sampler treats ``top_k == 1``
          as argmax; a temperature of 1.0 keeps the temperature division finite
          without changing which token is the argmax.
        - ``top_k == -1`` (or a top_k above the vocabulary) becomes the
          vocabulary size, or ``TOP_K_ALL`` when that is not known.

        Idempotent: normalizing twice gives the same params.
        """
        self.stop = _as_list(self.stop)
        self.stop_regex = _as_list(self.stop_regex)
        self.stop_token_ids = list(dict.fromkeys(self.stop_token_ids or []))
        if self.logit_bias:
            self.logit_bias = {_bias_key(k): float(v) for k, v in self.logit_bias.items()}
        if self.temperature < GREEDY_EPS:
            self.temperature, self.top_k = 1.0, 1
        limit = vocab_size if vocab_size is not None else TOP_K_ALL
        if self.top_k == -1 or self.top_k > limit:
            self.top_k = limit
        return self

    def to_dict(self) -> dict[str, Any]:
        """The fields as a plain dict (what crosses a process boundary)."""
        return dataclasses.asdict(self)

    def stop_str_max_len(self, tokenizer: Any = None) -> int:
        """Length of the longest stop string: in tokens when a tokenizer is
        given (how far back a detokenizer must look), else in characters."""
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if tokenizer is None:
            return max((len(s) for s in stops), default=0)
        return max((len(tokenizer.encode(s, add_special_tokens=False)) for s in stops), default=0)


def check_stop_regex(v: str | list[str] | None) -> str | list[str] | None:
    """``stop_regex``'s checks (shared with the OpenAI routes): SGLang's limits,
    and every pattern compiles."""
    patterns = _as_list(v)
    if len(patterns) > MAX_STOP_REGEX:
        raise ValueError(f"at most {MAX_STOP_REGEX} patterns")
    for pattern in patterns:
        if not 0 < len(pattern.encode("utf-8", "surrogatepass")) <= MAX_STOP_REGEX_BYTES:
            raise ValueError(f"patterns must be non-empty and at most {MAX_STOP_REGEX_BYTES} bytes")
        try:
            regex.compile(pattern)
        except (regex.error, RecursionError, OverflowError) as exc:
            raise ValueError(f"invalid regular expression {pattern!r}: {exc}") from None
    return v


def _as_list(v: str | list[str] | None) -> list[str]:
    return [v] if isinstance(v, str) else list(v or [])


_FIELD_NAMES = frozenset(f.name for f in dataclasses.fields(SamplingParams))


def _require(ok: bool, field: str, value: Any, expectation: str) -> None:
    if not ok:
        raise ValueError(f"{field}: invalid sampling parameter {field}={value!r}: must be {expectation}")


def _is_token(tok: Any, vocab_size: int | None) -> bool:
    return isinstance(tok, int) and not isinstance(tok, bool) and tok >= 0 and (vocab_size is None or tok < vocab_size)


def _token_range(vocab_size: int | None) -> str:
    return "in [0, vocab_size)" if vocab_size is None else f"in [0, {vocab_size})"


def _is_token_key(key: int | str) -> bool:
    return (isinstance(key, int) and not isinstance(key, bool)) or (
        isinstance(key, str) and key.strip().lstrip("-").isdigit() and len(key) < 20)


def _bias_key(key: int | str) -> int:
    """A logit_bias key as a token id; OpenAI's JSON sends them as strings."""
    return key if isinstance(key, int) else int(key)
