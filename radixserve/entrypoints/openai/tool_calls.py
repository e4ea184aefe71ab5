"""What a chat request's ``tools`` and ``tool_choice`` ask of generation,
as SGLang does it:

- ``none`` (the default without tools): the template is not shown the tools
  and the output is not parsed for calls;
- ``auto`` (the default with tools): the template is shown the tools; the
  output is parsed for calls with ``--tool-call-parser``, and is plain
  content without one. With a parser, ``strict`` tools constrain a call once
  the model opens one (an xgrammar structural tag triggered by the format's
  call marker);
- ``required`` or a named function: the output is constrained from its
  first token to a JSON array of ``{"name", "parameters"}`` calls (the name
  one of the allowed functions, the parameters valid for it), which parses
  into calls whatever the parser; a named function is the only tool the
  template is shown.
"""

from __future__ import annotations

import json
from typing import Any

from radixserve.entrypoints.openai.tool_parser import TOOL_CALL_PARSERS
from radixserve.entrypoints.openai.tool_protocol import ChatTool, NamedToolChoice
from radixserve.sampling.grammar import check_grammar

_DEFS_KEYS = ("$defs", "definitions")  # where schemas keep the definitions their "$ref"s point to
_NO_PARAMETERS = {"type": "object", "properties": {}}


def tool_choice(req: Any) -> str | NamedToolChoice:
    """The request's ``tool_choice``, its default filled in as OpenAI does."""
    if req.tool_choice is not None:
        return req.tool_choice
    return "auto" if req.tools else "none"


def forces_calls(req: Any) -> bool:
    """Whether the output must be calls (``required`` or a named function)."""
    return bool(req.tools) and (tool_choice(req) == "required" or isinstance(tool_choice(req), NamedToolChoice))


def offered_tools(req: Any) -> list[ChatTool]:
    """The tools the template is shown and calls may name."""
    choice = tool_choice(req)
    if not req.tools or choice == "none":
        return []
    if isinstance(choice, NamedToolChoice):
        return [t for t in req.tools if t.function.name == choice.function.name]
    return list(req.tools)


def check_tool_schemas(tools: list[ChatTool] | None) -> None:
    """Raise ``ValueError("tools[i].function.parameters: ...")`` for a schema
    that does not build as a grammar (an unknown type, a dangling ``$ref``).
    Takes milliseconds a tool; the first call imports xgrammar."""
    for i, tool in enumerate(tools or []):
        if tool.function.parameters is None:
            continue
        try:
            check_grammar("json_schema", json.dumps(tool.function.parameters))
        except ValueError as exc:
            reason = str(exc).removeprefix("json_schema: ")
            raise ValueError(f"tools[{i}].function.parameters: {reason}") from None


def tool_grammar(req: Any, tool_call_parser: str | None) -> tuple[str, str] | None:
    """The sampling param (name, text) that the tools constrain the output
    with, if any; ``ValueError`` naming the field when strict tools meet
    another grammar (``required`` with one is refused by the request model)."""
    tools = offered_tools(req)
    if not tools:
        return None
    if forces_calls(req):
        return "json_schema", json.dumps(tool_call_schema(tools, req.parallel_tool_calls))
    if tool_call_parser is None or not any(t.function.strict for t in tools):
        return None
    if req.grammar() is not None:
        first = next(i for i, t in enumerate(req.tools) if t.function.strict)
        raise ValueError(f"tools[{first}].function.strict: a strict tool constrains the output, which cannot also "
                         "follow response_format, json_schema, regex or ebnf")
    return "structural_tag", json.dumps(strict_tool_tag(tools, tool_call_parser))


def tool_call_schema(tools: list[ChatTool], parallel: bool = True) -> dict:
    """SGLang's schema for forced calls: an array of at least one
    ``{"name": <one of the tools>, "parameters": <its schema>}`` (at most one
    without ``parallel_tool_calls``). The tools' ``$defs`` move to the root,
    where their ``$ref``s now point."""
    items = [_call_schema(tool) for tool in tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": items[0] if len(items) == 1 else {"type": "object", "anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    schema.update(_merged_defs(tools))
    return schema


def _call_schema(tool: ChatTool) -> dict:
    params = tool.function.parameters
    params = {k: v for k, v in params.items() if k not in _DEFS_KEYS} if params else _NO_PARAMETERS
    return {"type": "object", "properties": {"name": {"type": "string", "enum": [tool.function.name]},
                                             "parameters": params}, "required": ["name", "parameters"]}


def _merged_defs(tools: list[ChatTool]) -> dict:
    merged: dict[str, dict] = {}
    for i, tool in enumerate(tools):
        for key in _DEFS_KEYS:
            for name, definition in ((tool.function.parameters or {}).get(key) or {}).items():
                if merged.setdefault(key, {}).setdefault(name, definition) != definition:
                    raise ValueError(f"tools[{i}].function.parameters: '{key}/{name}' differs from another "
                                     "tool's, and forced tool calls need one definition of each")
    return merged


def strict_tool_tag(tools: list[ChatTool], tool_call_parser: str) -> dict:
    """SGLang's structural tag for ``auto`` with strict tools: once the model
    writes the format's call marker, the call follows the tool's schema (any
    JSON for tools that are not strict)."""
    parser = TOOL_CALL_PARSERS[tool_call_parser]
    structures, triggers = [], []
    for tool in tools:
        begin, end, trigger = parser.call_frame(tool.function.name)
        schema = (tool.function.parameters or _NO_PARAMETERS) if tool.function.strict else {}
        structures.append({"begin": begin, "schema": schema, "end": end})
        if trigger not in triggers:
            triggers.append(trigger)
    return {"structures": structures, "triggers": triggers}
