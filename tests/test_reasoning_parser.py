"""The reasoning parsers (qwen3, deepseek-r1): what they split out of
model-shaped output, forced (the template opened <think>) or not, and that a
stream cut at every character boundary or into token-like pieces gives
exactly the whole text's result, streamed or with stream_reasoning off."""

from __future__ import annotations

import pytest

from chunking import every_chunking
from radixserve.entrypoints.openai.reasoning_parser import (
    REASONING_FORMATS,
    ParsedReasoning,
    ReasoningParser,
    thinking_forced,
)
from radixserve.entrypoints.openai.chat_parsing import ChatParsing, ChoiceOutput
from radixserve.entrypoints.openai.tool_parser import QwenToolParser, ToolCall, ToolParseDelta, merge_deltas

QWEN3, R1 = REASONING_FORMATS["qwen3"], REASONING_FORMATS["deepseek-r1"]
CALL = '<tool_call>\n{"name": "search", "arguments": {"q": "</think> 東京"}}\n</tool_call>'

CASES = [
    # (format, forced, output, reasoning, content)
    (QWEN3, True, "<think>\nThe user greets me.\n</think>\n\nHello! 👋", "\nThe user greets me.\n", "\n\nHello! 👋"),
    (QWEN3, True, "The template opened it.</think>Answer", "The template opened it.", "Answer"),
    (QWEN3, False, "<think>Hmm</think>Answer", "Hmm", "Answer"),
    (QWEN3, False, "Answer without thinking </think> here", None, "Answer without thinking </think> here"),
    (QWEN3, True, "<think>cut off by the length lim", "cut off by the length lim", ""),
    (QWEN3, True, "still thinking </thi", "still thinking </thi", ""),
    (QWEN3, True, "<think></think>", "", ""),
    (QWEN3, True, "", "", ""),
    (QWEN3, False, "<thi", None, "<thi"),
    (QWEN3, True, "<thi", "<thi", ""),
    (QWEN3, True, "<think>I should search.</think>\n\n" + CALL, "I should search.", "\n\n" + CALL),
    # Qwen3 may open a call without closing </think>: the call ends the reasoning
    (QWEN3, True, "<think>I should search.\n" + CALL, "I should search.\n", CALL),
    (R1, True, "<think>\n深い考え\n</think>\n\nThe answer is 42.", "\n深い考え\n", "\n\nThe answer is 42."),
    (R1, True, "Reasoning first.</think>The answer is 42.", "Reasoning first.", "The answer is 42."),
    (R1, True, "Reasoning<tool_call> is text for R1", "Reasoning<tool_call> is text for R1", ""),
]


@pytest.mark.parametrize("fmt,force,text,reasoning,content", CASES)
@pytest.mark.parametrize("stream_reasoning", [True, False])
def test_parse_and_every_chunking_agree(fmt, force, text, reasoning, content, stream_reasoning):
    expected = ParsedReasoning(reasoning, content)
    assert ReasoningParser.parse(text, fmt, force=force) == expected
    for chunks in every_chunking(text):
        parser = ReasoningParser(fmt, force=force, stream_reasoning=stream_reasoning)
        deltas = [parser.feed(c) for c in chunks] + [parser.finish()]
        got = "".join(d.reasoning for d in deltas), "".join(d.content for d in deltas)
        assert got == (reasoning or "", content), chunks
        assert parser.saw_reasoning == (reasoning is not None)
        if not stream_reasoning:
            assert sum(1 for d in deltas if d.reasoning) <= 1  # sent once


def test_reasoning_streams_and_holds_back_a_partial_end_tag():
    parser = ReasoningParser(QWEN3, force=True)
    assert (parser.feed("<think>abc").reasoning, parser.feed(" </th").reasoning) == ("abc", " ")
    delta = parser.feed("ink>Hi")
    assert (delta.reasoning, delta.content) == ("", "Hi")


def test_without_streaming_reasoning_comes_whole_when_it_ends():
    parser = ReasoningParser(QWEN3, force=True, stream_reasoning=False)
    assert [parser.feed(c).reasoning for c in ("<think>", "a", "b")] == ["", "", ""]
    delta = parser.feed("</think>c")
    assert (delta.reasoning, delta.content) == ("ab", "c")
    parser = ReasoningParser(R1, force=True, stream_reasoning=False)
    assert parser.feed("unterminated").reasoning == "" and parser.finish().reasoning == "unterminated"


def test_which_requests_are_forced_into_reasoning():
    assert thinking_forced("qwen3", None) and thinking_forced("qwen3", {"enable_thinking": True})
    assert not thinking_forced("qwen3", {"enable_thinking": False})
    assert thinking_forced("deepseek-r1", {"enable_thinking": False})  # R1 always thinks
    parser = ReasoningParser.for_request("qwen3", {"enable_thinking": False})
    assert (parser.feed("Plain answer.").content, parser.saw_reasoning) == ("Plain answer.", False)


@pytest.mark.parametrize("text", [
    "<think>Search it.</think>\n\nSure. " + CALL,
    "Opened by the template; " + CALL + " and after",
    "<think>unterminated, cut by the length limit " + CALL[:30],
])
def test_reasoning_then_tool_call_stream_as_the_whole_text(text):
    """A choice's parser: the reasoning parser's answer feeds the tool parser."""
    parsing = ChatParsing(reasoning="qwen3", force_reasoning=True, tool_parser=QwenToolParser, tool_names=("search",))
    whole = parsing.parse(text)
    for chunks in every_chunking(text):
        parser = parsing.choice_parser()
        deltas = [parser.feed(c) for c in chunks] + [parser.feed("", final=True)]
        reasoning = "".join(d.reasoning for d in deltas)
        merged = merge_deltas(ToolParseDelta(d.content, d.calls) for d in deltas)
        assert (reasoning, merged.content, merged.calls) == (whole.reasoning, whole.content, whole.calls), chunks
    if "Sure" in text:
        assert whole == ChoiceOutput("Search it.", "\n\nSure.", [ToolCall(0, "search", '{"q": "</think> 東京"}')])
