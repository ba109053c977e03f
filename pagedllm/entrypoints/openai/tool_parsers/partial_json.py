"""Reading ``{"name": ..., "arguments": {...}}`` objects out of JSON text that may still be
growing (a stream), without parsing the arguments.

A call's arguments are kept as the raw text of their JSON value, cut where the value ends (or
where the text ends, while it is unfinished). That text only ever grows by appending, so a
stream can send each new piece as an argument delta, and the pieces join to exactly the value
the finished text holds.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

_WS = " \t\r\n"


class NotACall(ValueError):
    """The text is not (the start of) a tool-call object."""


@dataclass
class PartialCall:
    name: str | None = None  # set once the name's string is complete
    raw_arguments: str = ""  # the arguments' JSON text seen so far ("" before it starts)
    complete: bool = False  # the call's object has closed

    def arguments_so_far(self) -> str:
        """The argument text a stream may send by now. Arguments written as a JSON string
        (some models quote the object) are sent once decoded, when the string is whole; a
        closed call without arguments has {} (so the joined deltas always parse)."""
        if self.complete and not self.raw_arguments:
            return "{}"
        if not self.raw_arguments.startswith('"'):
            return self.raw_arguments
        end = scan_string(self.raw_arguments, 0)
        try:
            return json.loads(self.raw_arguments[:end]) if end is not None else ""
        except ValueError:  # a bad escape: nothing a client could use
            return ""


    def finished_arguments(self) -> str | None:
        """The arguments as compact JSON text, or None if they are missing or not JSON."""
        text = self.arguments_so_far() or "{}"
        try:
            value = json.loads(text)
        except ValueError:
            return None
        return json.dumps(value, ensure_ascii=False)


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


# A string's body up to (not including) its closing quote, escapes skipped; the characters that
# open, close or quote JSON values. Scanning jumps between them in C.
_STRING_BODY = re.compile(r'(?:[^"\\]|\\.)*', re.DOTALL)
_STRUCTURE = re.compile(r'["{}\[\]]')
_SCALAR = re.compile(r'[^\s,}\]]*')


class ScanMemo:
    """Where the scans of unfinished values stopped, by the value's start index. A stream
    re-reads the text at every delta, and the text only grows, so each reading resumes where
    the last one stopped: the work over a whole reply stays linear in its length."""

    def __init__(self) -> None:
        self.strings: dict[int, int] = {}  # start -> where the body's scan resumes
        self.containers: dict[int, tuple[int, int]] = {}  # start -> (depth, where to resume)


def scan_string(text: str, i: int, memo: ScanMemo | None = None) -> int | None:
    """``text[i]`` opens a JSON string: the index after its closing quote, or None if unfinished."""
    start = memo.strings.get(i, i + 1) if memo is not None else i + 1
    end = _STRING_BODY.match(text, start).end()  # stops at the quote, a lone final "\", or the end
    if end < len(text) and text[end] == '"':
        return end + 1
    if memo is not None:
        memo.strings[i] = end
    return None


def scan_value(text: str, i: int, memo: ScanMemo | None = None) -> int | None:
    """The index where the JSON value starting at ``text[i]`` ends, or None if it is unfinished
    (brackets are matched, strings skipped; the value itself is not checked)."""
    c = text[i]
    if c == '"':
        return scan_string(text, i, memo)
    if c in "{[":
        depth, j = memo.containers.get(i, (0, i)) if memo is not None else (0, i)
        while (m := _STRUCTURE.search(text, j)) is not None:
            c, j = m.group(), m.end()
            if c == '"':
                end = scan_string(text, j - 1, memo)
                if end is None:
                    j -= 1  # resume at the open string (its own scan resumes inside it)
                    break
                j = end
            elif c in "{[":
                depth += 1
            else:
                depth -= 1
                if depth == 0:
                    return j
        else:
            j = len(text)
        if memo is not None:
            memo.containers[i] = (depth, j)
        return None
    # A number, true, false or null: it ends at a delimiter, and may grow until one comes.
    end = _SCALAR.match(text, i).end()
    return end if end < len(text) else None


def scan_call(text: str, i: int, argument_keys: tuple[str, ...],
              memo: ScanMemo | None = None) -> tuple[PartialCall | None, int | None]:
    """The call object starting at ``text[i]`` (after whitespace): (the call so far, the index
    after its ``}`` or None while it is open). (None, None) if only whitespace is left.
    NotACall if the text cannot be such an object."""
    i = skip_ws(text, i)
    if i >= len(text):
        return None, None
    if text[i] != "{":
        raise NotACall(f"expected '{{' at {i}")
    call = PartialCall()
    i += 1
    while True:
        i = skip_ws(text, i)
        if i >= len(text):
            return call, None
        if text[i] == "}":
            call.complete = True
            return call, i + 1
        if text[i] == ",":
            i += 1
            continue
        key, i = _scan_key(text, i, memo)
        if i is None:
            return call, None
        end = scan_value(text, i, memo)
        _take_member(call, key, text, i, end, argument_keys)
        if end is None:
            return call, None
        i = end


def _scan_key(text: str, i: int, memo: ScanMemo | None) -> tuple[str | None, int | None]:
    """The member key starting at ``text[i]`` and where its value starts (after the colon and
    whitespace), or (None, None) while the text ends before the value."""
    if text[i] != '"':
        raise NotACall(f"expected a key at {i}")
    end = scan_string(text, i, memo)
    if end is None:
        return None, None
    try:
        key = json.loads(text[i:end])
    except ValueError as e:
        raise NotACall(str(e)) from e
    i = skip_ws(text, end)
    if i >= len(text):
        return None, None
    if text[i] != ":":
        raise NotACall(f"expected ':' at {i}")
    i = skip_ws(text, i + 1)
    return (key, i) if i < len(text) else (None, None)


def _take_member(call: PartialCall, key: str | None, text: str, i: int, end: int | None,
                 argument_keys: tuple[str, ...]) -> None:
    """Record the member ``key`` whose value spans ``text[i:end]`` (to the text's end while
    ``end`` is None) in ``call``: the name once complete, the arguments as they grow."""
    if key == "name" and end is not None:
        if text[i] != '"':
            raise NotACall("the name is not a string")
        try:
            call.name = json.loads(text[i:end])
        except ValueError as e:
            raise NotACall(str(e)) from e
    elif key in argument_keys:
        call.raw_arguments = text[i:] if end is None else text[i:end]
