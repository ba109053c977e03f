"""Integers past 64 bits are refused where they enter, naming the field, and never reach the
executor wire (msgpack: 64 bits), where they used to fail as a 500 ("the executor wire cannot
encode builtins.int"): SamplingParams, BeamSearchParams, engine arguments, priority, and the
OpenAI API's fields and token-id lists, over an engine core in its own process."""
from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.beam_search_params import BeamSearchParams
from pagedllm.config import EngineConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.model_info import ModelInfo
from pagedllm.errors import ValidationError
from pagedllm.runner.fake import FakeRunner

WIDE = 10 ** 30
DEMO_HF = str(EngineConfig().model_config.model)


@pytest.mark.parametrize("field, value", [
    ("max_tokens", WIDE), ("n", WIDE), ("top_k", WIDE), ("min_tokens", WIDE), ("seed", WIDE),
    ("logprobs", WIDE), ("prompt_logprobs", -WIDE), ("stop_token_ids", [1, WIDE]),
    ("logit_bias", {WIDE: 1.0}), ("max_tokens", 2 ** 63)])
def test_sampling_params_name_the_field(field, value):
    with pytest.raises(ValidationError) as e:
        SamplingParams(**{field: value})
    assert e.value.param == field


@pytest.mark.parametrize("field", ["beam_width", "max_tokens"])
def test_beam_search_params_name_the_field(field):
    with pytest.raises(ValidationError) as e:
        BeamSearchParams(**{"beam_width": 2, "max_tokens": 4, field: WIDE})
    assert e.value.param == field


@pytest.mark.parametrize("field", ["max_num_seqs", "seed", "max_model_len", "num_gpu_blocks_override",
                                   "max_num_batched_tokens"])
def test_engine_arguments_name_the_field(field):
    with pytest.raises(ValidationError) as e:
        LLM(DEMO_HF, **{field: WIDE})
    assert e.value.param == field


@pytest.fixture(scope="module")
def core_process_engine():
    """A FakeRunner engine whose core runs in its own process: requests cross the wire."""
    engine = LLMEngine(EngineConfig.from_kwargs(DEMO_HF, num_gpu_blocks_override=64),
                       runner=FakeRunner(512), model_info=ModelInfo.from_folder(DEMO_HF),
                       multiprocess=True)
    yield engine
    engine.shutdown()


def test_priority_names_the_field(core_process_engine):
    with pytest.raises(ValidationError) as e:
        core_process_engine.add_request("wide", "Once", SamplingParams(max_tokens=2), priority=WIDE)
    assert e.value.param == "priority"


@pytest.fixture(scope="module")
def http(core_process_engine):
    from fastapi.testclient import TestClient

    from pagedllm.entrypoints.openai.server import build_app

    with TestClient(build_app(core_process_engine, ["demo"])) as client:
        yield client


@pytest.mark.parametrize("body, field", [
    ({"max_tokens": WIDE}, "max_tokens"), ({"priority": WIDE}, "priority"),
    ({"priority": -WIDE}, "priority"), ({"n": WIDE}, "n"), ({"min_tokens": WIDE}, "min_tokens"),
    ({"top_k": WIDE}, "top_k"), ({"logprobs": WIDE}, "logprobs"),
    ({"stop_token_ids": [WIDE]}, "stop_token_ids"), ({"prompt": [1, WIDE]}, "prompt"),
    ({"prompt": [[1], [WIDE]]}, "prompt"), ({"truncate_prompt_tokens": WIDE}, "truncate_prompt_tokens"),
    ({"logit_bias": {str(WIDE): 1}}, "logit_bias"),
    ({"use_beam_search": True, "n": 2, "max_tokens": WIDE}, "max_tokens"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "integer", "maximum": WIDE}}}}, "response_format"),
    # Within 64 bits the request crosses the wire and the core's admission caps max_tokens by
    # the context, as vLLM does: still a 400 naming it.
    ({"max_tokens": 2 ** 62}, "max_tokens"),
])
def test_api_answers_400_naming_the_field(http, body, field):
    r = http.post("/v1/completions", json={"model": "demo", "prompt": "Once", **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field, r.text


def test_api_still_serves_after_them(http):
    r = http.post("/v1/completions", json={"model": "demo", "prompt": "Once", "max_tokens": 3,
                                           "priority": -(2 ** 63)})
    assert r.status_code == 200, r.text
    r = http.post("/v1/chat/completions", json={
        "model": "demo", "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": WIDE})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_completion_tokens", r.text
