"""Tool-call parsers for ``tool_choice: "auto"``, by the name ``--tool-call-parser`` gives
(vLLM's names). Each reads one model family's tool-call format out of the generated text."""
from __future__ import annotations

from collections.abc import Callable

from pagedllm.entrypoints.openai.tool_parsers.abstract_tool_parser import ExtractedToolCallInformation, ToolParser
from pagedllm.entrypoints.openai.tool_parsers.hermes_tool_parser import Hermes2ProToolParser
from pagedllm.entrypoints.openai.tool_parsers.llama3_json_tool_parser import Llama3JsonToolParser
from pagedllm.errors import ValidationError


class ToolParserManager:
    tool_parsers: dict[str, type[ToolParser]] = {}

    @classmethod
    def register_module(cls, names: str | list[str]) -> Callable[[type[ToolParser]], type[ToolParser]]:
        def register(parser: type[ToolParser]) -> type[ToolParser]:
            for name in [names] if isinstance(names, str) else names:
                cls.tool_parsers[name] = parser
            return parser
        return register

    @classmethod
    def get_tool_parser(cls, name: str) -> type[ToolParser]:
        if name not in cls.tool_parsers:
            raise ValidationError(f"invalid tool call parser: {name} (choose from "
                                  f"{{ {','.join(sorted(cls.tool_parsers))} }})", "tool_call_parser")
        return cls.tool_parsers[name]


ToolParserManager.register_module("hermes")(Hermes2ProToolParser)
ToolParserManager.register_module(["llama3_json", "llama4_json"])(Llama3JsonToolParser)

__all__ = ["ExtractedToolCallInformation", "ToolParser", "ToolParserManager"]
