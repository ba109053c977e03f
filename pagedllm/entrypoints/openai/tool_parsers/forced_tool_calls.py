"""The replies of ``tool_choice: "required"`` and of a named function, read as tool calls.

Both are generated under a JSON schema (see tool_request.py), so their shape is known:
``required`` writes ``[{"name": ..., "parameters": {...}}, ...]`` and a named function writes
its arguments object alone. They are parsers like the ones ``auto`` uses, so the same streaming
code sends their deltas."""
from __future__ import annotations

from pagedllm.entrypoints.openai.tool_parsers.abstract_tool_parser import ParsedOutput, ToolParser
from pagedllm.entrypoints.openai.tool_parsers.partial_json import NotACall, PartialCall, scan_call, skip_ws


class RequiredToolCallsParser(ToolParser):
    """A JSON array of {"name", "parameters"} objects; nothing else is content."""

    def parse(self, text: str, final: bool) -> ParsedOutput:
        out = ParsedOutput("")
        i = skip_ws(text, 0)
        if i >= len(text):
            out.valid = not final
            return out
        if text[i] != "[":
            out.valid = False
            return out
        i += 1
        while True:
            i = skip_ws(text, i)
            if i < len(text) and text[i] == "]":
                out.valid = bool(out.calls) and not text[i + 1:].strip()
                return out
            if i < len(text) and text[i] == "," and out.calls:
                i += 1
            try:
                call, end = scan_call(text, i, ("parameters",), self.memo)
            except NotACall:
                out.valid = False
                return out
            if call is not None:
                out.calls.append(call)
            if end is None:  # the text ends inside the array
                out.valid = not final
                return out
            i = end


class NamedToolCallParser(ToolParser):
    """The arguments object of the function the request named."""

    def __init__(self, function_name: str) -> None:
        super().__init__()
        self.function_name = function_name

    def parse(self, text: str, final: bool) -> ParsedOutput:
        # Leading whitespace is dropped so the argument text only grows by appending; the
        # schema allows nothing after the object.
        call = PartialCall(name=self.function_name, raw_arguments=text.lstrip(), complete=final)
        return ParsedOutput("", [call])
