"""Turning pydantic's validation errors into the engine's one error style:
``ValueError("<field path>: <message>")``, which the HTTP layer answers with
a 400 whose ``param`` is the field path."""

from __future__ import annotations

import json
import re
from typing import Any

from pydantic import ValidationError, ValidationInfo, field_validator

# Tags pydantic puts in an error's location for union members.
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "tuple", "set", "none", "None", "bytes"}
_MAX_SHOWN = 80  # characters of the offending value quoted in a message
# "<field path>: " at the start of a message
FIELD_PREFIX = re.compile(r"^([A-Za-z_][\w.\[\]]*): ")


def error_path(loc: tuple | list, prefix: str = "") -> str:
    """A pydantic error location as a field path (``messages[0].content``),
    without the tags pydantic adds for union members (``str``, ``list[int]``,
    ``function-after[...]``, a model's class name) or dict keys."""
    path = prefix
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part.isidentifier() and part not in _TYPE_TAGS and not part[0].isupper():
            path += f".{part}" if path else part
    return path


def describe_error(err: dict, what: str = "invalid value", prefix: str = "") -> str:
    """``"<field>: <what> <field>=<value>: <reason>"`` for one item of
    ``ValidationError.errors()``."""
    path = error_path(err.get("loc", ()), prefix)
    reason = err.get("msg", "invalid").removeprefix("Value error, ")
    if not err.get("loc"):  # a check across fields names its field itself
        return reason if FIELD_PREFIX.match(reason) else f"{path or 'body'}: {reason}"
    path = path or "body"
    if err.get("type") in ("unexpected_keyword_argument", "extra_forbidden"):
        return f"{path}: unknown field"
    if err.get("type") == "missing_argument" or err.get("type") == "missing":
        return f"{path}: required"
    return f"{path}: {what} {path}={shown(err.get('input'))}: {reason}"


def shown(value: Any) -> str:
    """``repr(value)``, cut short: messages quote what the client sent, never all of it."""
    text = repr(value)
    return text if len(text) <= _MAX_SHOWN else text[: _MAX_SHOWN - 3] + "..."


def first_error(exc: ValidationError, what: str = "invalid value", prefix: str = "") -> ValueError:
    """The first error of ``exc`` as a ``ValueError`` naming its field. Of a
    union's errors for one field, the one that reached deepest into the value
    says most (``top_logprobs_num[0]`` is over 20, not "not an integer")."""
    errors = exc.errors(include_url=False)
    if not errors:
        return ValueError(f"{prefix or 'body'}: invalid")
    field = errors[0]["loc"][:1]
    same_field = [e for e in errors if e["loc"][:1] == field]
    return ValueError(describe_error(max(same_field, key=lambda e: len(e["loc"])), what, prefix))


def require_no_op(field: str, value: Any, no_ops: tuple) -> Any:
    """``value`` if it asks for nothing (one of ``no_ops``, or a list of such
    values); else ``ValueError`` saying the field is not supported."""
    if _is_no_op(value, no_ops):
        return value
    accepted = " or ".join(json.dumps(v) for v in no_ops)
    raise ValueError(f"'{field}' is not supported by this server (only {accepted} is accepted)")


def _is_no_op(value: Any, no_ops: tuple) -> bool:
    if any(value == ok and type(value) is type(ok) for ok in no_ops):
        return True
    return isinstance(value, list) and bool(value) and all(_is_no_op(v, no_ops) for v in value)


def no_op_validator(table: dict[str, tuple], fields: tuple[str, ...] | None = None):
    """A pydantic field validator that holds each field of ``table`` (or
    ``fields`` of it) to its no-op values (``require_no_op``); assign it in a
    model or pydantic dataclass body."""

    def check(value: Any, info: ValidationInfo) -> Any:
        return require_no_op(info.field_name, value, table[info.field_name])

    return field_validator(*(fields or tuple(table)))(check)
