"""Tool calls in model output, SGLang's ``--tool-call-parser`` formats:

- ``qwen`` (alias ``qwen25``): Hermes-style blocks, as Qwen2.5 and Qwen3 write
  them: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``;
- ``llama3``: Llama 3.x JSON, ``{"name": ..., "parameters": {...}}``, after an
  optional ``<|python_tag|>``, several calls separated by ``;``;
- and, whatever the flag, ``json_array``: the ``[{"name", "parameters"}, ...]``
  that ``tool_choice`` ``required`` or a named function constrains the output
  to (``tool_calls.tool_call_schema``).

A parser is fed the output text as it streams and returns, each time, the new
content and the new pieces of calls (a call's name once, then its arguments
in pieces). It decides only what the text seen so far settles (a partial
``<tool_c`` is held back until the next characters decide it), so any way of
cutting the text gives the same result; ``parse`` is one feed of the whole
text. As in SGLang, a call to a function that is not among the tools is
dropped, and so is a ``<tool_call>`` block that holds no call. Other text
stays content, less the whitespace before a call and that after the last one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Iterable

from radixserve.entrypoints.openai.call_scanner import CallObjectScanner


@dataclass
class ToolCallDelta:
    """A new piece of call ``index``: its ``name`` (on its first piece only)
    and more of its ``arguments`` (JSON text, possibly empty)."""

    index: int
    name: str | None = None
    arguments: str = ""


@dataclass
class ToolParseDelta:
    """What one feed adds: content, and call pieces (one per call, in order)."""

    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)

    def add_call_piece(self, index: int, name: str | None = None, arguments: str = "") -> None:
        if self.calls and self.calls[-1].index == index:
            self.calls[-1].arguments += arguments
        else:
            self.calls.append(ToolCallDelta(index, name, arguments))


@dataclass(frozen=True)
class ToolCall:
    """A whole call: the function's name and its arguments as JSON text."""

    index: int
    name: str
    arguments: str


@dataclass(frozen=True)
class ParsedToolCalls:
    """The whole output split into content and calls."""

    content: str
    calls: list[ToolCall]


def merge_deltas(deltas: Iterable[ToolParseDelta]) -> ParsedToolCalls:
    """The content and calls that a sequence of deltas adds up to."""
    content, names, args = [], {}, {}
    for delta in deltas:
        content.append(delta.content)
        for piece in delta.calls:
            if piece.name is not None:
                names[piece.index] = piece.name
            args[piece.index] = args.get(piece.index, "") + piece.arguments
    calls = [ToolCall(i, names[i], args.get(i, "")) for i in sorted(names)]
    return ParsedToolCalls("".join(content), calls)


def held_suffix(text: str, marker: str) -> int:
    """How many trailing characters of ``text`` to hold back: the longest
    one that is a proper prefix of ``marker``, and the whitespace before it
    (dropped if the marker follows, as whitespace next to a call is)."""
    keep = next((k for k in range(min(len(text), len(marker) - 1), 0, -1) if marker.startswith(text[-k:])), 0)
    end = len(text) - keep
    while end > 0 and text[end - 1].isspace():
        end -= 1
    return len(text) - end


class ToolCallParser:
    """Base of the formats: the call-object handling they share.

    Subclasses implement ``_advance(delta, final)``: consume what ``self._buf``
    settles into ``delta`` (everything when ``final``)."""

    def __init__(self, tool_names: Iterable[str], max_calls: int | None = None):
        self._names = frozenset(tool_names)
        self._max_calls = max_calls
        self._buf = ""
        self._state = "start"
        self._calls = 0
        self._obj: CallObjectScanner | None = None
        self._obj_raw: list[str] = []  # text of an undecided object, content if it is no call
        self._obj_call: int | None = None  # the index of the call the object is, once known
        self._obj_decided = False

    def feed(self, text: str) -> ToolParseDelta:
        self._buf += text
        delta = ToolParseDelta()
        self._advance(delta, final=False)
        return delta

    def finish(self) -> ToolParseDelta:
        """The end of the output: settle what was held back."""
        delta = ToolParseDelta()
        self._advance(delta, final=True)
        return delta

    @classmethod
    def parse(cls, text: str, tool_names: Iterable[str], max_calls: int | None = None) -> ParsedToolCalls:
        parser = cls(tool_names, max_calls)
        return merge_deltas([parser.feed(text), parser.finish()])

    @property
    def made_calls(self) -> bool:
        return self._calls > 0

    @classmethod
    def call_frame(cls, name: str) -> tuple[str, str, str]:
        """(begin, end, trigger) of a call to ``name`` in this format: the
        text around its arguments, and the marker that opens a call (for
        the structural tag of strict tools)."""
        raise NotImplementedError

    def _advance(self, delta: ToolParseDelta, final: bool) -> None:
        raise NotImplementedError

    def _peek_start(self, delta: ToolParseDelta, final: bool) -> str | None:
        """The output's first non-space character, None until one has come;
        an output of only whitespace is content."""
        stripped = self._buf.lstrip()
        if not stripped and final:
            delta.content += self._buf
            self._buf = ""
        return stripped[:1] or None

    def _skip_whitespace(self) -> bool:
        """Drop leading whitespace; True when a character follows."""
        self._buf = self._buf.lstrip()
        return bool(self._buf)

    def _after_call(self, final: bool) -> str | None:
        """The first character after a call's whitespace, or None while only
        whitespace has come. The whitespace stays in the buffer: it is dropped
        if the output ends or another call follows, and kept before text."""
        rest = self._buf.lstrip()
        if not rest and final:
            self._buf = ""
        return rest[0] if rest else None

    def _start_object(self) -> None:
        self._obj, self._obj_raw, self._obj_call, self._obj_decided = CallObjectScanner(), [], None, False
        self._state = "object"

    def _read_object(self, delta: ToolParseDelta, final: bool) -> str | None:
        """Feed the buffer to the current object. Returns None while it is
        open, else ``"call"``, ``"dropped"`` (an unknown or surplus function)
        or ``"text"`` (no call: its text is in ``self._obj_raw``)."""
        obj = self._obj
        used = obj.feed(self._buf)
        if not self._obj_decided:
            self._obj_raw.append(self._buf[:used])
        self._buf = self._buf[used:]
        if not self._obj_decided and obj.name is not None:
            self._decide_call(obj.name, delta)
        if self._obj_call is not None:
            args = obj.take_arguments()
            if obj.done and not obj.has_arguments:
                args = "{}"  # a call without arguments, as SGLang reports it
            if args:
                delta.add_call_piece(self._obj_call, arguments=args)
        if not (obj.finished or final):
            return None
        self._obj = None
        if self._obj_call is not None:
            return "call"
        return "dropped" if self._obj_decided else "text"

    def _decide_call(self, name: str, delta: ToolParseDelta) -> None:
        self._obj_decided = True
        if name in self._names and (self._max_calls is None or self._calls < self._max_calls):
            self._obj_call, self._calls = self._calls, self._calls + 1
            delta.add_call_piece(self._obj_call, name=name)

    def _text_until(self, marker: str, delta: ToolParseDelta | None, final: bool) -> bool:
        """Pass text up to ``marker`` into ``delta.content`` (or drop it when
        ``delta`` is None), the whitespace before the marker dropped; True
        when the marker was found and consumed."""
        at = self._buf.find(marker)
        if at >= 0:
            if delta is not None:
                delta.content += self._buf[:at].rstrip()
            self._buf = self._buf[at + len(marker):]
            return True
        cut = len(self._buf) if final else len(self._buf) - held_suffix(self._buf, marker)
        if delta is not None:
            delta.content += self._buf[:cut]
        self._buf = self._buf[cut:]
        return False


class QwenToolParser(ToolCallParser):
    """``<tool_call>{json}</tool_call>`` blocks among text (Qwen2.5, Qwen3).
    A block whose JSON is no call, or that calls an unknown function, is
    dropped, as is anything between a call's JSON and ``</tool_call>``."""

    START, END = "<tool_call>", "</tool_call>"

    @classmethod
    def call_frame(cls, name: str) -> tuple[str, str, str]:
        return f'{cls.START}\n{{"name": {json.dumps(name)}, "arguments": ', f"}}\n{cls.END}", cls.START

    def _advance(self, delta: ToolParseDelta, final: bool) -> None:
        while True:
            state = self._state
            if state in ("start", "text"):
                if not self._text_until(self.START, delta, final):
                    return
                self._state = "block"
            elif state == "block":
                if not self._skip_whitespace():
                    return
                if self._buf[0] == "{":
                    self._start_object()
                else:
                    self._state = "skip"
            elif state == "object":
                if self._read_object(delta, final) is None:
                    return
                self._state = "skip"
            elif state == "skip":
                if not self._text_until(self.END, None, final):
                    return
                self._state = "after"
            elif state == "after":
                if self._after_call(final) is None:
                    return
                self._state = "text"


class Llama3ToolParser(ToolCallParser):
    """Llama 3.x: the output is ``{"name", "parameters"}`` objects separated
    by ``;``, when it starts with one or after ``<|python_tag|>``. A JSON
    object that names no function stays text, as does whatever follows the
    calls; a call to an unknown function is dropped."""

    TAG = "<|python_tag|>"

    @classmethod
    def call_frame(cls, name: str) -> tuple[str, str, str]:
        return f'{cls.TAG}{{"name": {json.dumps(name)}, "parameters": ', "}", cls.TAG

    def _advance(self, delta: ToolParseDelta, final: bool) -> None:
        while True:
            state = self._state
            if state == "start":
                first = self._peek_start(delta, final)
                if first is None:
                    return
                if first == "{":
                    self._buf = self._buf.lstrip()
                    self._start_object()
                else:
                    self._state = "text"
            elif state == "text":
                if not self._text_until(self.TAG, delta, final):
                    return
                self._state = "tag"
            elif state in ("tag", "separator"):
                if not self._skip_whitespace():
                    return
                if self._buf[0] == "{":
                    self._start_object()
                else:
                    self._state = "text"
            elif state == "object":
                outcome = self._read_object(delta, final)
                if outcome is None:
                    return
                if outcome == "text":
                    delta.content += "".join(self._obj_raw)
                self._state = "text" if outcome == "text" else "after"
            elif state == "after":
                ch = self._after_call(final)
                if ch is None:
                    return
                if ch == ";":
                    self._buf = self._buf.lstrip()[1:]
                    self._state = "separator"
                else:
                    self._state = "text"


class JsonArrayToolParser(ToolCallParser):
    """The JSON array of calls that a ``required`` or named ``tool_choice``
    constrains the output to; output that is not such an array is content."""

    def _advance(self, delta: ToolParseDelta, final: bool) -> None:
        while True:
            state = self._state
            if state == "start":
                first = self._peek_start(delta, final)
                if first is None:
                    return
                if first == "[":
                    self._buf, self._state = self._buf.lstrip()[1:], "items"
                else:
                    self._state = "text"
            elif state in ("items", "after"):
                if not self._skip_whitespace():
                    return
                ch = self._buf[0]
                if ch == "{" and state == "items":
                    self._start_object()
                    continue
                if ch == "]" or (ch == "," and state == "after"):
                    self._buf = self._buf[1:]
                    self._state = "end" if ch == "]" else "items"
                else:
                    self._state = "text"
            elif state == "object":
                if self._read_object(delta, final) is None:
                    return
                self._state = "after"
            elif state == "end":
                if self._after_call(final) is None:
                    return
                self._state = "text"
            else:  # text
                delta.content += self._buf
                self._buf = ""
                return


TOOL_CALL_PARSERS: dict[str, type[ToolCallParser]] = {
    "qwen": QwenToolParser,
    "qwen25": QwenToolParser,
    "llama3": Llama3ToolParser,
}
