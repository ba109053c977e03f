"""What the tool-calling tests share: the tools, a test-only chat template that renders them, a
FakeRunner that "writes" a fixed reply (the demo model never calls a tool by itself), servers
over the demo model and over that runner, and a check of a call against its tool's schema."""
from __future__ import annotations

import json
from pathlib import Path

import jsonschema
from server_utils import ServerThread, make_fake_engine

from pagedllm.entrypoints.openai.server_options import ServerOptions
from pagedllm.runner.fake import FakeRunner

TOOL_TEMPLATE = (Path(__file__).parent / "tool_chat_template.jinja").read_text()
DEMO_EOS = 2

# Small, bounded schemas: the demo model's context is 512 tokens and its tokens are mostly
# single characters, so a call must end well inside max_tokens whatever the model picks.
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "days"],
           "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                          "days": {"type": "integer", "minimum": 1, "maximum": 7}}}
TIME = {"type": "object", "additionalProperties": False, "required": ["zone"],
        "properties": {"zone": {"enum": ["utc", "cet"]}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather forecast",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


def check_call(name: str, arguments: str) -> dict:
    """A call names one of TOOLS and its arguments are JSON its schema accepts."""
    assert name in SCHEMAS, name
    args = json.loads(arguments)
    jsonschema.validate(args, SCHEMAS[name])
    return args


class ScriptedRunner(FakeRunner):
    """Every request's reply is ``script`` (token ids), then EOS: a model that calls tools."""

    def __init__(self, script: list[int], vocab_size: int) -> None:
        super().__init__(vocab_size=vocab_size)
        self.script = list(script)
        self.num_sampled: dict[str, int] = {}

    def execute_model(self, so):
        ro = super().execute_model(so)
        for i, rid in enumerate(ro.req_ids):
            if ro.sampled_token_ids[i]:
                n = self.num_sampled.get(rid, 0)
                self.num_sampled[rid] = n + 1
                token = self.script[n] if n < len(self.script) else DEMO_EOS
                ro.sampled_token_ids[i] = [token]
                self.requests[rid].token_ids[-1] = token  # what this "model" sampled and feeds on
        return ro


def auto_options(parser: str = "hermes") -> ServerOptions:
    return ServerOptions(enable_auto_tool_choice=True, tool_call_parser=parser)


def scripted_server(tokenizer, reply: str, parser: str = "hermes") -> ServerThread:
    """A started server whose model replies ``reply``, with tool_choice auto on ``parser``."""
    from pagedllm.entrypoints.openai.server import build_app

    runner = ScriptedRunner(tokenizer(reply, add_special_tokens=False).input_ids, len(tokenizer))
    engine = make_fake_engine(tokenizer, runner, num_gpu_blocks_override=64)
    return ServerThread(build_app(engine, ["demo"], chat_template=TOOL_TEMPLATE,
                                  options=auto_options(parser))).start()


def streamed_calls(stream) -> tuple[str, dict[int, list[str]], list[str]]:
    """An openai-client stream as (content, {index: [id, name, arguments]}, finish reasons),
    checking OpenAI's delta order: a call's id, type and name come first, and only once."""
    content, calls, reasons = "", {}, []
    for chunk in stream:
        for c in chunk.choices:
            content += c.delta.content or ""
            for d in c.delta.tool_calls or []:
                if d.index not in calls:
                    assert d.id and d.type == "function" and d.function.name
                    calls[d.index] = [d.id, d.function.name, d.function.arguments or ""]
                else:
                    assert d.id is None and d.function.name is None
                    calls[d.index][2] += d.function.arguments or ""
            if c.finish_reason:
                reasons.append(c.finish_reason)
    return content, calls, reasons
