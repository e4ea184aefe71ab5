"""Pydantic models of OpenAI's tool calling: the ``tools`` and
``tool_choice`` of a chat request and the calls in earlier assistant
messages (validated here, at the edge, each error naming its field), and the
``tool_calls`` of responses and stream chunks, shaped so that the ``openai``
client parses and accumulates them."""

from __future__ import annotations

import json
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, model_serializer

TOOL_NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"  # OpenAI's rule for function names
TOOL_CHOICES = ("none", "auto", "required")


class FunctionDefinition(BaseModel):
    """A function the model may call; ``parameters`` is the JSON schema of
    its arguments (checked to build as a grammar when the request is turned
    into the engine's, ``tool_calls.check_tool_schemas``)."""

    model_config = ConfigDict(extra="ignore", strict=True)

    name: str = Field(pattern=TOOL_NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(BaseModel):
    """One entry of ``tools``: ``{"type": "function", "function": {...}}``."""

    model_config = ConfigDict(extra="ignore", strict=True)

    type: Literal["function"]
    function: FunctionDefinition

    def template_dict(self) -> dict:
        """The tool as chat templates take it (OpenAI's shape, unset fields left out)."""
        return self.model_dump(exclude_none=True)


class ToolChoiceFunction(BaseModel):
    """``tool_choice.function``: the function that must be called."""

    model_config = ConfigDict(extra="ignore", strict=True)

    name: str


class NamedToolChoice(BaseModel):
    """``tool_choice`` naming the one function to call."""

    model_config = ConfigDict(extra="ignore", strict=True)

    type: Literal["function"]
    function: ToolChoiceFunction


ToolChoice = Union[Literal["none", "auto", "required"], NamedToolChoice]


def check_tool_choice_shape(value: Any) -> Any:
    """``value`` if it has one of ``tool_choice``'s shapes, else one clear error
    (pydantic would list a failure per member of the union)."""
    if value is None or (isinstance(value, str) and value in TOOL_CHOICES):
        return value
    if isinstance(value, dict) and value.get("type") == "function" and isinstance(value.get("function"), dict) \
            and isinstance(value["function"].get("name"), str):
        return value
    raise ValueError('must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}')


def check_tool_request(req: Any) -> None:
    """A chat request's checks across fields: tool names unique; a named
    ``tool_choice`` among the tools; a forced call (``required`` or named)
    the only grammar. ``ValueError("<field>: ...")`` otherwise."""
    names = [tool.function.name for tool in req.tools or []]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise ValueError(f"tools[{i}].function.name: the function '{name}' is given twice")
    choice = req.tool_choice
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        raise ValueError(f"tool_choice: the function '{choice.function.name}' is not among the tools")
    if choice == "required" and not names:
        raise ValueError("tool_choice: 'required' needs at least one tool")
    grammar = [name for name in ("response_format", "json_schema", "regex", "ebnf") if getattr(req, name)]
    if grammar == ["response_format"] and req.response_format.type == "text":
        grammar = []
    if (choice == "required" or isinstance(choice, NamedToolChoice)) and grammar:
        raise ValueError(f"tool_choice: a required or named tool call constrains the output, which cannot also "
                         f"follow {grammar[0]}")


class CalledFunction(BaseModel):
    """The function of an earlier call; ``arguments`` is JSON text, as OpenAI
    sends it (an object is accepted too)."""

    model_config = ConfigDict(extra="ignore", strict=True)

    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCallParam(BaseModel):
    """A call in an earlier assistant message."""

    model_config = ConfigDict(extra="ignore", strict=True)

    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction

    def template_dict(self) -> dict:
        """The call as chat templates take it: SGLang hands them the arguments
        as an object (templates write ``arguments | tojson``); arguments that
        are not JSON text stay a string."""
        args = self.function.arguments
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                pass
        call = {"type": self.type, "function": {"name": self.function.name, "arguments": args}}
        return call if self.id is None else {"id": self.id, **call}


# -- responses ---------------------------------------------------------------------------


class FunctionCallResponse(BaseModel):
    """A call's function: its name and its arguments as JSON text."""

    name: str
    arguments: str


class ToolCallResponse(BaseModel):
    """One entry of ``message.tool_calls``."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCallResponse


class DeltaFunctionCall(BaseModel):
    """A piece of a call's function in a stream chunk."""

    name: str | None = None
    arguments: str | None = None

    @model_serializer(mode="wrap")
    def _without_nulls(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaToolCall(BaseModel):
    """One entry of ``delta.tool_calls``: the first piece of call ``index``
    has its ``id``, ``type`` and name, later pieces only more arguments (the
    client concatenates what it is sent, so nothing is sent twice)."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall

    @model_serializer(mode="wrap")
    def _without_nulls(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}
