"""hermes: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one block per call
(Hermes 2 Pro, Qwen 2.5 and Qwen 3 write this). The content is the text before the first block;
text between or after blocks is dropped, as vLLM does."""
from __future__ import annotations

from typing import Any

from pagedllm.entrypoints.openai.tool_parsers.abstract_tool_parser import ParsedOutput, ToolParser, held_back
from pagedllm.entrypoints.openai.tool_parsers.partial_json import NotACall, scan_call

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"


class Hermes2ProToolParser(ToolParser):

    def adjust_request(self, request: Any) -> Any:
        # <tool_call> is a special token in these tokenizers: skipping special tokens would
        # erase the markup the calls are found by.
        if request.tools and request.tool_choice != "none":
            request.skip_special_tokens = False
        return request

    def parse(self, text: str, final: bool) -> ParsedOutput:
        first = text.find(TOOL_CALL_START)
        if first < 0:
            keep = len(text) if final else len(text) - held_back(text, TOOL_CALL_START)
            return ParsedOutput(text[:keep])
        out = ParsedOutput(text[:first])
        start = first
        while start >= 0:
            try:  # the object's own end, not the first end tag: a string may hold "</tool_call>"
                call, call_end = scan_call(text, start + len(TOOL_CALL_START), ("arguments", "parameters"),
                                           self.memo)
            except NotACall:
                out.valid = False
                return out
            if call is None:  # nothing after the tag yet
                out.valid = out.valid and not final
                return out
            out.calls.append(call)
            if call_end is None:  # the object is still open
                return out
            end = text.find(TOOL_CALL_END, call_end)
            if end < 0:
                # A block left unclosed at the end still counts (vLLM accepts a reply cut
                # right after the call), unless something else follows the object.
                if final and text[call_end:].strip():
                    out.valid = False
                return out
            if text[call_end:end].strip():
                out.valid = False  # junk beside the object
            start = text.find(TOOL_CALL_START, end + len(TOOL_CALL_END))
        return out
