"""Reasoning sections in model output, SGLang's ``--reasoning-parser``
formats: ``qwen3`` and ``deepseek-r1``, both ``<think>reasoning</think>answer``.

Chat templates of thinking models often open ``<think>`` in the prompt, so
the output holds only ``reasoning</think>answer``: with ``force`` the output
starts in the reasoning, whether or not it repeats ``<think>``. SGLang forces
it for ``deepseek-r1`` always and for ``qwen3`` unless the request turns
thinking off (``chat_template_kwargs={"enable_thinking": false}``, where
Qwen3's template closes an empty think block in the prompt); unforced, only
output that starts with ``<think>`` has a reasoning section. Output that
stops inside the reasoning (a length stop) is all reasoning. Qwen3 sometimes
opens ``<tool_call>`` without closing ``</think>``: that ends the reasoning
too, the tag staying in the answer for the tool-call parser.

As the tool-call parsers do, a parser decides only what the text seen so far
settles (a partial ``</thi`` is held back), so a stream cut anywhere parses
exactly as the whole text does; ``parse`` is one feed of the whole text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ReasoningFormat:
    """A model family's markers and when its output starts in the reasoning."""

    start: str
    end: str
    interrupt: str | None  # also ends the reasoning, and stays in the answer
    forced_unless_disabled: bool  # forced unless enable_thinking is false (else: always forced)


REASONING_FORMATS: dict[str, ReasoningFormat] = {
    "qwen3": ReasoningFormat("<think>", "</think>", "<tool_call>", forced_unless_disabled=True),
    "deepseek-r1": ReasoningFormat("<think>", "</think>", None, forced_unless_disabled=False),
}


@dataclass
class ReasoningDelta:
    """What one feed adds to the reasoning and to the answer."""

    reasoning: str = ""
    content: str = ""


@dataclass(frozen=True)
class ParsedReasoning:
    """The whole output split; ``reasoning`` is None without a reasoning section."""

    reasoning: str | None
    content: str


def thinking_forced(name: str, chat_template_kwargs: dict[str, Any] | None) -> bool:
    """Whether output of parser ``name`` starts in the reasoning for a request
    with these ``chat_template_kwargs``."""
    fmt = REASONING_FORMATS[name]
    if not fmt.forced_unless_disabled:
        return True
    return (chat_template_kwargs or {}).get("enable_thinking") is not False


class ReasoningParser:
    """Splits one output into reasoning and answer, fed as it streams. With
    ``stream_reasoning=False`` the reasoning comes out in one piece when it
    ends (SGLang's ``stream_reasoning``)."""

    def __init__(self, fmt: ReasoningFormat, *, force: bool, stream_reasoning: bool = True):
        self._fmt = fmt
        self._force = force
        self._stream = stream_reasoning
        self._buf = ""
        self._state = "open"  # open: before the first characters decide; think; answer
        self._held_reasoning = ""  # all of it, when not streamed
        self.saw_reasoning = False

    @classmethod
    def for_request(cls, name: str, chat_template_kwargs: dict[str, Any] | None,
                    stream_reasoning: bool = True) -> ReasoningParser:
        return cls(REASONING_FORMATS[name], force=thinking_forced(name, chat_template_kwargs),
                   stream_reasoning=stream_reasoning)

    @classmethod
    def parse(cls, text: str, fmt: ReasoningFormat, *, force: bool) -> ParsedReasoning:
        parser = cls(fmt, force=force)
        first, last = parser.feed(text), parser.finish()
        reasoning = first.reasoning + last.reasoning
        return ParsedReasoning(reasoning if parser.saw_reasoning else None, first.content + last.content)

    def feed(self, text: str) -> ReasoningDelta:
        self._buf += text
        delta = ReasoningDelta()
        self._advance(delta, final=False)
        return delta

    def finish(self) -> ReasoningDelta:
        """The end of the output: what was held back."""
        delta = ReasoningDelta()
        self._advance(delta, final=True)
        return delta

    def _advance(self, delta: ReasoningDelta, final: bool) -> None:
        if self._state == "open":
            self._open(final)
        if self._state == "think":
            self._think(delta, final)
        if self._state == "answer":
            delta.content += self._buf
            self._buf = ""

    def _open(self, final: bool) -> None:
        start = self._fmt.start
        if self._buf.startswith(start):
            self._buf = self._buf[len(start):]
            self._state = "think"
        elif start.startswith(self._buf) and not final:
            return  # maybe the start of the marker: wait
        else:
            self._state = "think" if self._force else "answer"
        self.saw_reasoning = self._state == "think"

    def _think(self, delta: ReasoningDelta, final: bool) -> None:
        end, interrupt = self._buf.find(self._fmt.end), -1
        if self._fmt.interrupt:
            interrupt = self._buf.find(self._fmt.interrupt)
        if end >= 0 and (interrupt < 0 or end < interrupt):
            self._emit(delta, self._buf[:end], done=True)
            self._buf = self._buf[end + len(self._fmt.end):]
        elif interrupt >= 0:
            self._emit(delta, self._buf[:interrupt], done=True)
            self._buf = self._buf[interrupt:]
        else:
            cut = len(self._buf) if final else len(self._buf) - self._held()
            self._emit(delta, self._buf[:cut], done=final)
            self._buf = self._buf[cut:]
            return
        self._state = "answer"

    def _held(self) -> int:
        """Trailing characters that may begin a marker."""
        markers = [m for m in (self._fmt.end, self._fmt.interrupt) if m]
        return max(next((k for k in range(min(len(self._buf), len(m) - 1), 0, -1)
                         if m.startswith(self._buf[-k:])), 0) for m in markers)

    def _emit(self, delta: ReasoningDelta, text: str, done: bool) -> None:
        if self._stream:
            delta.reasoning += text
            return
        self._held_reasoning += text
        if done:
            delta.reasoning, self._held_reasoning = self._held_reasoning, ""
