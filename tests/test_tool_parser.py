"""The tool-call parsers (qwen, llama3, and the JSON array of a required or
named tool_choice): what they extract from model-shaped output, and that a
stream cut at every character boundary, or into token-like pieces, gives
exactly the whole text's result, with each call's name sent once before its
arguments."""

from __future__ import annotations

import json

import pytest

from chunking import every_chunking
from radixserve.entrypoints.openai.tool_parser import (
    TOOL_CALL_PARSERS,
    JsonArrayToolParser,
    Llama3ToolParser,
    ParsedToolCalls,
    QwenToolParser,
    ToolCall,
    ToolCallParser,
    merge_deltas,
)

TOOLS = ["get_weather", "search", "no_args"]
WEATHER = '{"city": "Paris", "unit": "celsius"}'
TRICKY = ('{"query": "a } b ]] \\"quoted\\" </tool_call> {x", "filters": {"tags": ["ä", "東京", "🌧"], '
          '"nested": {"deep": [1, 2.5e-3, true, false, null]}}, "n": -12}')


def calls(*pairs: tuple[str, str]) -> list[ToolCall]:
    return [ToolCall(i, name, args) for i, (name, args) in enumerate(pairs)]


def qwen_block(name: str, args: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'


QWEN_CASES = [
    ("The capital of France is Paris.", ParsedToolCalls("The capital of France is Paris.", [])),
    (qwen_block("get_weather", WEATHER), ParsedToolCalls("", calls(("get_weather", WEATHER)))),
    ("Let me check the weather.\n\n" + qwen_block("get_weather", WEATHER),
     ParsedToolCalls("Let me check the weather.", calls(("get_weather", WEATHER)))),
    (qwen_block("get_weather", WEATHER) + "\n" + qwen_block("search", TRICKY),
     ParsedToolCalls("", calls(("get_weather", WEATHER), ("search", TRICKY)))),
    # a call to an unknown function and a block without a call are dropped, the rest kept
    ("Hi " + qwen_block("launch_rockets", "{}") + "\n<tool_call>\nnot json\n</tool_call>\n"
     + qwen_block("search", '{"q": "x"}') + "\nDone.",
     ParsedToolCalls("Hi\nDone.", calls(("search", '{"q": "x"}')))),
    # arguments before the name; no arguments; Qwen's stray extra brace
    ('<tool_call>\n{"arguments": {"q": 1}, "name": "search"}\n</tool_call>'
     '<tool_call>{"name": "no_args"}</tool_call><tool_call>{"name": "search", "arguments": {}}}\n</tool_call>',
     ParsedToolCalls("", calls(("search", '{"q": 1}'), ("no_args", "{}"), ("search", "{}")))),
    # output that stopped inside a call (a length stop): the call as far as it got
    ("Sure. " + qwen_block("search", TRICKY)[:60],
     ParsedToolCalls("Sure.", calls(("search", TRICKY[:60 - len('<tool_call>\n{"name": "search", "arguments": ')])))),
    ("unicode: Zürich → 東京 🌧 <tool_c", ParsedToolCalls("unicode: Zürich → 東京 🌧 <tool_c", [])),
    ("a <tool_cal> b </tool_call> c", ParsedToolCalls("a <tool_cal> b </tool_call> c", [])),
    ("   ", ParsedToolCalls("   ", [])),
    ("", ParsedToolCalls("", [])),
]


LLAMA_CASES = [
    ('<|python_tag|>{"name": "get_weather", "parameters": ' + WEATHER + "}",
     ParsedToolCalls("", calls(("get_weather", WEATHER)))),
    ('{"name": "get_weather", "parameters": ' + WEATHER + '}; {"name": "search", "arguments": ' + TRICKY + "}",
     ParsedToolCalls("", calls(("get_weather", WEATHER), ("search", TRICKY)))),
    ('\n {"type": "function", "name": "search", "parameters": {"q": "ok"}};{"name": "no_args", "parameters": {}}',
     ParsedToolCalls("", calls(("search", '{"q": "ok"}'), ("no_args", "{}")))),
    ("Paris is the capital of France.", ParsedToolCalls("Paris is the capital of France.", [])),
    ('{"answer": 42, "unit": "}"} is my JSON', ParsedToolCalls('{"answer": 42, "unit": "}"} is my JSON', [])),
    ('{not json at all', ParsedToolCalls('{not json at all', [])),
    ("I will look it up. <|python_tag|>" + '{"name": "search", "parameters": {"q": "東京"}}',
     ParsedToolCalls("I will look it up.", calls(("search", '{"q": "東京"}')))),
    ('{"name": "rm_rf", "parameters": {}}; {"name": "search", "parameters": {"q": 1}} thanks',
     ParsedToolCalls(" thanks", calls(("search", '{"q": 1}')))),
    ("<|python_tag|>print('hi')", ParsedToolCalls("print('hi')", [])),
    ('{"name": "search", "parameters": {"q": "unfinis', ParsedToolCalls("", calls(("search", '{"q": "unfinis')))),
    ("  <|python_ta", ParsedToolCalls("  <|python_ta", [])),
]

ARRAY_CASES = [
    ('[{"name": "get_weather", "parameters": ' + WEATHER + "}]", ParsedToolCalls("", calls(("get_weather", WEATHER)))),
    ('[{"name":"search","parameters":' + TRICKY + '},\n {"name": "no_args", "parameters": {}}]',
     ParsedToolCalls("", calls(("search", TRICKY), ("no_args", "{}")))),
    ("[]", ParsedToolCalls("", [])),
    ('[{"name": "search", "parameters": {"q": "cut', ParsedToolCalls("", calls(("search", '{"q": "cut')))),
    ("I cannot call tools.", ParsedToolCalls("I cannot call tools.", [])),
]


def stream(parser_cls: type[ToolCallParser], chunks: list[str], names=TOOLS, max_calls=None):
    parser = parser_cls(names, max_calls)
    deltas = [parser.feed(c) for c in chunks] + [parser.finish()]
    return deltas, parser


def check_deltas(deltas) -> None:
    """Each call's first piece names it, no later piece does, indices count up."""
    named = []
    for delta in deltas:
        assert len({p.index for p in delta.calls}) == len(delta.calls)  # one piece per call per feed
        for piece in delta.calls:
            if piece.index not in named:
                assert piece.name is not None and piece.index == len(named)
                named.append(piece.index)
            else:
                assert piece.name is None


@pytest.mark.parametrize("parser_cls,text,expected", [
    *[(QwenToolParser, t, e) for t, e in QWEN_CASES],
    *[(Llama3ToolParser, t, e) for t, e in LLAMA_CASES],
    *[(JsonArrayToolParser, t, e) for t, e in ARRAY_CASES],
])
def test_parse_and_every_chunking_agree(parser_cls, text, expected):
    assert parser_cls.parse(text, TOOLS) == expected
    for chunks in every_chunking(text):
        deltas, parser = stream(parser_cls, chunks)
        check_deltas(deltas)
        assert merge_deltas(deltas) == expected, chunks
        assert parser.made_calls == bool(expected.calls)


def test_arguments_stream_in_pieces_and_parse():
    text = "Checking. " + qwen_block("search", TRICKY)
    deltas, _ = stream(QwenToolParser, list(text))
    pieces = [p.arguments for d in deltas for p in d.calls if p.arguments]
    assert len(pieces) > 50 and "".join(pieces) == TRICKY
    assert json.loads("".join(pieces))["filters"]["tags"] == ["ä", "東京", "🌧"]
    first = next(p for d in deltas for p in d.calls)
    assert (first.name, first.arguments) == ("search", "")  # the name goes out before any argument
    content = [d.content for d in deltas if d.content]
    assert "".join(content) == "Checking."  # content streams before the call, its trailing space dropped


def test_a_partial_marker_is_held_back_until_decided():
    parser = QwenToolParser(TOOLS)
    assert parser.feed("Hello <tool_c").content == "Hello"
    assert parser.feed("ar").content == " <tool_car"
    assert parser.feed(" <tool_call>").content == ""
    assert parser.feed('{"name": "sear').calls == []
    assert parser.feed('ch", "arguments": {"q"').calls[0].name == "search"


def test_max_calls_drops_the_later_calls():
    text = qwen_block("search", '{"q": 1}') + qwen_block("get_weather", WEATHER) + " bye"
    assert QwenToolParser.parse(text, TOOLS, max_calls=1) == ParsedToolCalls(" bye", calls(("search", '{"q": 1}')))


def test_without_tools_nothing_is_a_call():
    text = qwen_block("search", '{"q": 1}')
    assert QwenToolParser.parse("hi " + text, []) == ParsedToolCalls("hi", [])


def test_qwen25_parses_the_qwen_format_as_in_sglang():
    text = "Sure. " + qwen_block("search", '{"q": 1}')
    assert TOOL_CALL_PARSERS["qwen25"].parse(text, TOOLS) == ParsedToolCalls("Sure.", calls(("search", '{"q": 1}')))


def test_flags_take_sglangs_names_only():
    import argparse

    from radixserve.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = ServerArgs.from_cli_args(parser.parse_args(["--tool-call-parser", "qwen25", "--reasoning-parser", "qwen3"]))
    assert (args.tool_call_parser, args.reasoning_parser) == ("qwen25", "qwen3")
    with pytest.raises(SystemExit):
        parser.parse_args(["--tool-call-parser", "mistral"])
    with pytest.raises(ValueError, match="reasoning_parser must be one of"):
        ServerArgs(reasoning_parser="o1")
