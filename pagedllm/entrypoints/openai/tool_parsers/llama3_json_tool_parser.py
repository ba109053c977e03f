"""llama3_json: Llama 3.1/3.2's JSON tool calls, ``{"name": ..., "parameters": {...}}``
(``arguments`` is read too), optionally after ``<|python_tag|>``, several separated by ``;``.

A reply is a tool call when it starts (after whitespace) with ``{`` or the tag; anything else
is content. A reply that starts like a call but is not one (JSON that is not a call, junk
after the calls) is returned whole as content."""
from __future__ import annotations

from typing import Any

from pagedllm.entrypoints.openai.tool_parsers.abstract_tool_parser import ParsedOutput, ToolParser
from pagedllm.entrypoints.openai.tool_parsers.partial_json import NotACall, scan_call, skip_ws

BOT_TOKEN = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):

    def adjust_request(self, request: Any) -> Any:
        # <|python_tag|> is a special token: keep it in the text, or a tagged call reads as
        # plain JSON and the tag's meaning is lost.
        if request.tools and request.tool_choice != "none":
            request.skip_special_tokens = False
        return request

    def parse(self, text: str, final: bool) -> ParsedOutput:
        start = skip_ws(text, 0)
        rest = text[start:]
        if rest.startswith(BOT_TOKEN):
            start += len(BOT_TOKEN)
        elif not rest.startswith("{"):
            if not final and BOT_TOKEN.startswith(rest):  # "" or the tag's start: undecided
                return ParsedOutput("")
            return ParsedOutput(text)
        out = ParsedOutput("")
        i = start
        while True:
            try:
                call, end = scan_call(text, i, ("parameters", "arguments"), self.memo)
            except NotACall:
                out.valid = False
                return out
            if call is None:  # only whitespace left (a trailing ";" included)
                return out
            out.calls.append(call)
            if end is None:
                return out
            i = skip_ws(text, end)
            if i < len(text) and text[i] == ";":
                i += 1
            elif i < len(text):  # junk after a call
                out.valid = False
                return out
