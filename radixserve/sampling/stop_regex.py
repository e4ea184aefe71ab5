"""``stop_regex``: stop a request when its output matches a regular expression.

The scheduler searches the tail of each request's output after every token;
the tail must be long enough to hold a whole match, so each pattern's longest
match is bounded from its parse tree (``max_match_chars``): a pattern with an
unbounded repeat (``a+``, ``.*``) gets ``UNBOUNDED`` and the whole output is
searched. Matching runs under a time limit (the ``regex`` module's
``timeout``), so a pattern that backtracks catastrophically ends its own
request instead of stalling the scheduler's loop for every other request.

The detokenizer trims the final text at the first match, as it does for stop
strings (unless ``no_stop_trim``), and holds back the last characters of a
stream while a match could still begin in them (``stream_hold``).
"""

from __future__ import annotations

try:  # the parser behind ``re`` (``sre_parse`` before Python 3.11)
    from re import _parser as sre
except ImportError:  # pragma: no cover - Python 3.10
    import sre_parse as sre

import regex

UNBOUNDED = 1 << 30
# Time one search of one request's tail may take before the request is ended.
MATCH_TIMEOUT_S = 0.05
# A stream holds back at most this many characters for an unbounded pattern:
# a longer match may have begun in text already sent.
MAX_STREAM_HOLD = 64

_ONE_CHAR = {sre.LITERAL, sre.NOT_LITERAL, sre.IN, sre.ANY}
# possessive repeats and atomic groups are Python 3.11's
_REPEATS = {sre.MAX_REPEAT, sre.MIN_REPEAT, getattr(sre, "POSSESSIVE_REPEAT", sre.MAX_REPEAT)}
_ATOMIC = getattr(sre, "ATOMIC_GROUP", sre.SUBPATTERN)
_ZERO_WIDTH = {sre.AT, sre.ASSERT_NOT}


class StopRegexTimeout(Exception):
    """A search took longer than ``MATCH_TIMEOUT_S``."""


def max_match_chars(pattern: str) -> int:
    """An upper bound on the length of a match of ``pattern`` (a lookbehind
    counts, since it reads text before the match); ``UNBOUNDED`` when there
    is none or the pattern is beyond ``re``'s syntax."""
    try:
        return min(_max_chars(sre.parse(pattern)), UNBOUNDED)
    except (sre.error, RecursionError, OverflowError):  # a ``regex``-only construct: search everything
        return UNBOUNDED


def _max_chars(sub) -> int:
    total = 0
    for op, arg in sub:
        if op in _ONE_CHAR:
            total += 1
        elif op is sre.SUBPATTERN:
            total += _max_chars(arg[-1])
        elif op is _ATOMIC:
            total += _max_chars(arg)
        elif op is sre.BRANCH:
            total += max(_max_chars(branch) for branch in arg[1])
        elif op in _REPEATS:
            low, high, item = arg
            total += UNBOUNDED if high is sre.MAXREPEAT else high * _max_chars(item)
        elif op is sre.ASSERT:  # a lookahead or lookbehind reads its own text
            total += _max_chars(arg[1])
        elif op not in _ZERO_WIDTH:  # back-references and the like
            return UNBOUNDED
        if total >= UNBOUNDED:
            return UNBOUNDED
    return total


def compile_all(patterns: list[str]) -> list[regex.Pattern]:
    return [regex.compile(p) for p in patterns]


def first_match(patterns: list[regex.Pattern], text: str, timeout_s: float | None = None) -> tuple[str, int] | None:
    """The first pattern that matches ``text`` and where its match starts, or
    None; raises ``StopRegexTimeout`` naming a pattern too slow to search
    (within ``timeout_s``, by default ``MATCH_TIMEOUT_S``)."""
    timeout_s = MATCH_TIMEOUT_S if timeout_s is None else timeout_s
    for pattern in patterns:
        try:
            found = pattern.search(text, timeout=timeout_s)
        except TimeoutError:
            raise StopRegexTimeout(
                f"sampling_params.stop_regex: searching the output for {pattern.pattern!r} "
                f"took over {timeout_s}s; the request was stopped"
            ) from None
        if found is not None:
            return pattern.pattern, found.start()
    return None


def stream_hold(patterns: list[str]) -> int:
    """Characters a stream keeps back so that it never sends the start of a
    match that the final text will trim."""
    return max((min(max_match_chars(p), MAX_STREAM_HOLD + 1) - 1 for p in patterns), default=0)
