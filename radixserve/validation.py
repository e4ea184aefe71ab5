"""Turning pydantic's validation errors into the engine's one error style:
``ValueError("<field path>: <message>")``, which the HTTP layer answers with
a 400 whose ``param`` is the field path."""

from __future__ import annotations

import re
from typing import Any

from pydantic import ValidationError

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
    """The first error of ``exc`` as a ``ValueError`` naming its field."""
    errors = exc.errors(include_url=False)
    return ValueError(describe_error(errors[0], what, prefix) if errors else f"{prefix or 'body'}: invalid")
