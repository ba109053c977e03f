"""ToolParser: reads a model's tool calls out of its text, whole (``extract_tool_calls``) or
as the text streams in (``extract_tool_calls_streaming``), with vLLM's method names.

A parser only says how its format splits text into content and calls (``parse``); both
extraction paths are built on that one reading, so a streamed reply and a whole one always
agree. Streaming re-reads the text so far at each delta and sends what grew since the last one:
new content, a new call's id and name, more of a call's argument text. Re-reading costs
O(length) per delta, which is nothing next to a decode step for replies of tool-call size, and
it cannot drift from the whole-text reading the way incremental state machines do.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pagedllm.entrypoints.openai.protocol_chat import DeltaMessage
from pagedllm.entrypoints.openai.protocol_tools import (
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
    make_tool_call_id,
)
from pagedllm.entrypoints.openai.tool_parsers.partial_json import PartialCall, ScanMemo


@dataclass
class ParsedOutput:
    """One reading of the text so far."""
    content: str  # text for the client; held back while it may still turn into a call's markup
    calls: list[PartialCall] = field(default_factory=list)
    valid: bool = True  # False: the text broke the format (the whole reply is then content)


@dataclass
class ExtractedToolCallInformation:
    tools_called: bool
    tool_calls: list[ToolCall]
    content: str | None = None


def held_back(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` could be the start of ``tag`` (a stream
    holds them until the next delta says whether the tag follows)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ToolParser:
    """Base of the parsers; one instance reads one choice of one request (it keeps the stream's
    state)."""

    def __init__(self, tokenizer: Any = None) -> None:
        self.tokenizer = tokenizer
        self._sent_content = 0
        self._sent_calls: list[list[Any]] = []  # [id, number of argument characters sent]
        # What parse() hands the scans: a stream's memo (its text only grows), none for a
        # whole reply.
        self.memo: ScanMemo | None = None

    def adjust_request(self, request: Any) -> Any:
        """Change the request before it runs (e.g. keep special tokens a format is made of)."""
        return request

    def parse(self, text: str, final: bool) -> ParsedOutput:
        """Split ``text`` into content and calls; ``final``: no more text will come."""
        raise NotImplementedError

    @property
    def tools_streamed(self) -> bool:
        return bool(self._sent_calls)

    def _read(self, text: str, final: bool) -> ParsedOutput:
        parsed = self.parse(text, final)
        if final and any(c.name is None or not c.complete for c in parsed.calls):
            parsed.valid = False  # a call left open, or an object that names no function
        return parsed

    def extract_tool_calls(self, model_output: str, request: Any = None) -> ExtractedToolCallInformation:
        memo, self.memo = self.memo, None
        try:
            parsed = self._read(model_output, final=True)
        finally:
            self.memo = memo
        calls = [_finished(c) for c in parsed.calls]
        if not parsed.valid or not calls or any(c is None for c in calls):
            return ExtractedToolCallInformation(False, [], model_output)
        return ExtractedToolCallInformation(True, calls, parsed.content or None)  # type: ignore[arg-type]

    def extract_complete_tool_calls(self, model_output: str) -> list[ToolCall]:
        """The calls that closed before the text was cut short (max_tokens): a reply cut
        inside its third call still holds the first two whole."""
        memo, self.memo = self.memo, None
        try:
            parsed = self.parse(model_output, final=False)
        finally:
            self.memo = memo
        calls = [_finished(c) for c in parsed.calls] if parsed.valid else []
        return [c for c in calls if c is not None]

    def extract_tool_calls_streaming(self, previous_text: str, current_text: str, delta_text: str,
                                     request: Any = None, finished: bool = False) -> DeltaMessage | None:
        """The delta to send after ``delta_text`` arrived (None: nothing to send yet).
        ``finished``: the last delta, so nothing is held back any more."""
        if self.memo is None:
            self.memo = ScanMemo()
        parsed = self._read(current_text, final=finished)
        if finished and not parsed.valid and not self._sent_calls:
            # Not calls after all: the whole text is content, as extract_tool_calls says
            # (what was sent of it is a prefix of it, so the rest follows as a delta).
            parsed = ParsedOutput(current_text)
        content = parsed.content[self._sent_content:]
        self._sent_content = max(self._sent_content, len(parsed.content))
        deltas: list[DeltaToolCall] = []
        for index, call in enumerate(parsed.calls):
            if call.name is None:  # the id and name go first: wait for the whole name
                break
            arguments = call.arguments_so_far()
            if index == len(self._sent_calls):
                call_id = make_tool_call_id()
                self._sent_calls.append([call_id, len(arguments)])
                deltas.append(DeltaToolCall(index=index, id=call_id, type="function",
                                            function=DeltaFunctionCall(name=call.name, arguments=arguments)))
            elif len(arguments) > self._sent_calls[index][1]:
                deltas.append(DeltaToolCall(index=index, function=DeltaFunctionCall(
                    arguments=arguments[self._sent_calls[index][1]:])))
                self._sent_calls[index][1] = len(arguments)
        if not content and not deltas:
            return None
        return DeltaMessage(content=content or None, tool_calls=deltas or None)


def _finished(call: PartialCall) -> ToolCall | None:
    arguments = call.finished_arguments()
    if not call.complete or call.name is None or arguments is None:
        return None
    return ToolCall(function=FunctionCall(name=call.name, arguments=arguments))
