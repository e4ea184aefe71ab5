"""How a chat request's output is split into reasoning, content and tool
calls: which parsers run (from the server's ``--reasoning-parser`` and
``--tool-call-parser`` and the request), and a per-choice parser that chains
them, the reasoning parser's answer feeding the tool-call parser.

Reasoning is parsed when the server has a reasoning parser, the request
keeps ``separate_reasoning`` (the default) and no grammar constrains the
output from its first token (a forced tool call, ``response_format``, ...):
such output has no reasoning section, and reading it as one would hide the
answer. Tool calls are parsed as ``tool_calls.py`` describes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from radixserve.entrypoints.openai.reasoning_parser import REASONING_FORMATS, ReasoningParser, thinking_forced
from radixserve.entrypoints.openai.tool_calls import forces_calls, offered_tools
from radixserve.entrypoints.openai.tool_parser import (
    TOOL_CALL_PARSERS,
    JsonArrayToolParser,
    ToolCall,
    ToolCallDelta,
    ToolCallParser,
    ToolParseDelta,
    merge_deltas,
)


@dataclass(frozen=True)
class ChatParsing:
    """The parsers one request's choices go through; inactive: plain content."""

    reasoning: str | None = None  # a REASONING_FORMATS name
    force_reasoning: bool = False
    stream_reasoning: bool = True
    tool_parser: type[ToolCallParser] | None = None
    tool_names: tuple[str, ...] = ()
    max_calls: int | None = None

    @property
    def active(self) -> bool:
        return self.reasoning is not None or self.tool_parser is not None

    def choice_parser(self) -> ChoiceParser:
        return ChoiceParser(self)

    def parse(self, text: str) -> ChoiceOutput:
        """One whole output, parsed as its stream would be."""
        parser = ChoiceParser(self)
        delta = parser.feed(text, final=True)
        reasoning = delta.reasoning if parser.saw_reasoning else None
        return ChoiceOutput(reasoning, delta.content, merge_deltas([ToolParseDelta(calls=delta.calls)]).calls)


def chat_parsing(req: Any, tool_call_parser: str | None = None, reasoning_parser: str | None = None) -> ChatParsing:
    """The parsing of ``req``'s output on a server with these parsers."""
    forced = forces_calls(req)
    reasoning = reasoning_parser if reasoning_parser and req.separate_reasoning else None
    if forced or req.grammar() is not None:
        reasoning = None
    tools = offered_tools(req)
    parser = None
    if tools and forced:
        parser = JsonArrayToolParser
    elif tools and tool_call_parser:
        parser = TOOL_CALL_PARSERS[tool_call_parser]
    return ChatParsing(
        reasoning=reasoning,
        force_reasoning=reasoning is not None and thinking_forced(reasoning, req.template_kwargs()),
        stream_reasoning=req.stream_reasoning,
        tool_parser=parser,
        tool_names=tuple(t.function.name for t in tools),
        max_calls=None if req.parallel_tool_calls else 1,
    )


@dataclass(frozen=True)
class ChoiceOutput:
    """One whole choice: ``reasoning`` is None without a reasoning section."""

    reasoning: str | None
    content: str
    calls: list[ToolCall]


@dataclass
class ChoiceDelta:
    """What one piece of a choice's text adds."""

    reasoning: str = ""
    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.calls)


class ChoiceParser:
    """One choice's text through the reasoning parser, then the tool-call parser."""

    def __init__(self, parsing: ChatParsing):
        self._reasoning = None
        if parsing.reasoning is not None:
            self._reasoning = ReasoningParser(REASONING_FORMATS[parsing.reasoning], force=parsing.force_reasoning,
                                              stream_reasoning=parsing.stream_reasoning)
        self._tools = None
        if parsing.tool_parser is not None:
            self._tools = parsing.tool_parser(parsing.tool_names, parsing.max_calls)

    @property
    def made_calls(self) -> bool:
        return self._tools is not None and self._tools.made_calls

    @property
    def saw_reasoning(self) -> bool:
        return self._reasoning is not None and self._reasoning.saw_reasoning

    def feed(self, text: str, final: bool = False) -> ChoiceDelta:
        """The new reasoning, content and call pieces in ``text``; ``final``
        on the last piece of the choice settles what was held back."""
        out = ChoiceDelta(content=text)
        if self._reasoning is not None:
            step = self._reasoning.feed(text)
            if final:
                tail = self._reasoning.finish()
                step.reasoning, step.content = step.reasoning + tail.reasoning, step.content + tail.content
            out.reasoning, out.content = step.reasoning, step.content
        if self._tools is not None:
            found = self._tools.feed(out.content)
            if final:
                _extend(found, self._tools.finish())
            out.content, out.calls = found.content, found.calls
        return out


def _extend(delta: ToolParseDelta, more: ToolParseDelta) -> None:
    delta.content += more.content
    for piece in more.calls:
        delta.add_call_piece(piece.index, piece.name, piece.arguments)
