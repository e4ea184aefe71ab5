"""Reading one tool-call object, ``{"name": ..., "arguments": {...}}``, as
its text arrives.

Tool-call formats differ in what surrounds the object (``<tool_call>`` tags,
``<|python_tag|>``, a JSON array) but not in the object itself, so the
format parsers (``tool_parser``) share this scanner. It takes the text one
character at a time, so what it reports depends only on the characters seen,
never on how they were cut into chunks: a stream parses exactly as the whole
text does.

The arguments are reported as the model wrote them (the raw text of the
``arguments`` or ``parameters`` value), not re-serialized: their pieces then
concatenate to the final arguments, which are valid JSON whenever the model
wrote valid JSON (always, under a grammar). Strings, escapes and bracket
nesting are tracked, so ``}`` or ``</tool_call>`` inside a string is text.
"""

from __future__ import annotations

import json

ARGUMENT_KEYS = ("arguments", "parameters")  # Llama 3 writes "parameters"
_WS = " \t\n\r"
_SCALAR = frozenset("-+.0123456789eEtrufalsn")  # numbers, true, false, null
_CLOSE = {"{": "}", "[": "]"}

# states
_OPEN, _KEY_OR_END, _KEY_START, _KEY, _COLON, _VALUE_START, _VALUE, _AFTER_VALUE, _DONE, _FAILED = range(10)


class CallObjectScanner:
    """One JSON object read incrementally. ``name`` is set once the
    ``"name"`` string has closed; ``take_arguments`` returns the arguments'
    raw text read since the last call; ``done`` when the object has closed,
    ``failed`` when the text stopped being a JSON object (the offending
    character is consumed)."""

    def __init__(self):
        self._state = _OPEN
        self._key: list[str] = []  # raw text of the key being read
        self._role: str | None = None  # of the current value: "name", "arguments" or None
        self._stack: list[str] = []  # open brackets of the current value
        self._in_string = self._escape = self._scalar = False
        self._name_raw: list[str] = []
        self._args: list[str] = []
        self._args_taken = 0
        self._roles_seen: set[str] = set()
        self.name: str | None = None
        self.has_arguments = False

    @property
    def done(self) -> bool:
        return self._state == _DONE

    @property
    def failed(self) -> bool:
        return self._state == _FAILED

    @property
    def finished(self) -> bool:
        return self._state in (_DONE, _FAILED)

    def feed(self, text: str) -> int:
        """Read ``text`` up to the end of the object; returns how many
        characters were consumed (all of them unless the object finished)."""
        for i, ch in enumerate(text):
            if self.finished:
                return i
            while not self._step(ch):  # a number ends at the character after it, which is read again
                pass
        return len(text)

    def take_arguments(self) -> str:
        """The arguments' raw text read since the last call."""
        new = "".join(self._args[self._args_taken:])
        self._args_taken = len(self._args)
        return new

    def _step(self, ch: str) -> bool:
        """Consume ``ch``; False when it must be read again in the new state."""
        state = self._state
        if state == _VALUE:
            return self._value_char(ch)
        if ch in _WS and state != _KEY:
            return True
        if state == _OPEN:
            self._state = _KEY_OR_END if ch == "{" else _FAILED
        elif state in (_KEY_OR_END, _KEY_START):
            if ch == '"':
                self._state, self._key = _KEY, []
            else:
                self._state = _DONE if ch == "}" and state == _KEY_OR_END else _FAILED
        elif state == _KEY:
            self._key_char(ch)
        elif state == _COLON:
            self._state = _VALUE_START if ch == ":" else _FAILED
        elif state == _VALUE_START:
            self._start_value(ch)
        elif state == _AFTER_VALUE:
            self._state = _KEY_START if ch == "," else _DONE if ch == "}" else _FAILED
        return True

    def _key_char(self, ch: str) -> None:
        if self._escape:
            self._escape = False
        elif ch == "\\":
            self._escape = True
        elif ch == '"':
            self._state = _COLON
            return
        self._key.append(ch)

    def _start_value(self, ch: str) -> None:
        key = _decode('"' + "".join(self._key) + '"')
        role = "name" if key == "name" else "arguments" if key in ARGUMENT_KEYS else None
        self._role = role if role not in self._roles_seen else None  # the first one counts
        if self._role:
            self._roles_seen.add(self._role)
        if ch == '"':
            self._in_string = True
        elif ch in _CLOSE:
            self._stack = [ch]
        elif ch in _SCALAR:
            self._scalar = True
        else:
            self._state = _FAILED
            return
        self._state = _VALUE
        self._record(ch)
        if self._role == "arguments":
            self.has_arguments = True

    def _value_char(self, ch: str) -> bool:
        if self._scalar:
            if ch in _SCALAR:
                self._record(ch)
                return True
            self._scalar = False
            self._end_value()
            return False
        if not self._in_string and ch in "}]" and _CLOSE[self._stack[-1]] != ch:
            self._state = _FAILED  # a bracket that does not match
            return True
        self._record(ch)
        if self._in_string:
            if self._escape:
                self._escape = False
            elif ch == "\\":
                self._escape = True
            elif ch == '"':
                self._in_string = False
                if not self._stack:
                    self._end_value()
        elif ch == '"':
            self._in_string = True
        elif ch in _CLOSE:
            self._stack.append(ch)
        elif ch in "}]":
            self._stack.pop()
            if not self._stack:
                self._end_value()
        return True

    def _record(self, ch: str) -> None:
        if self._role == "name":
            self._name_raw.append(ch)
        elif self._role == "arguments":
            self._args.append(ch)

    def _end_value(self) -> None:
        self._state = _AFTER_VALUE
        if self._role == "name":
            name = _decode("".join(self._name_raw))
            self.name = name if isinstance(name, str) else None
        self._role = None


def _decode(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None
