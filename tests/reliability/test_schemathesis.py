"""schemathesis over the server's own /openapi.json (issue 15): bounded, deterministic example
generation for every operation, sent to the in-process ASGI app over the
demo model (260K parameters: a step costs little).

* No operation answers 5xx, whatever schemathesis sends (valid bodies and invalid ones).
* The answers conform to the schema: the status codes and content types each route really
  returns are documented (400 with OpenAI's error object rather than FastAPI's 422, an SSE
  stream for ``stream: true``, Prometheus text on /metrics), and the bodies match.
"""
from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

MAX_EXAMPLES = 25
pytestmark = pytest.mark.slow  # ~40 s of requests on two shared cores; `make test` (CI) runs it


@pytest.fixture
def api_schema():
    """A fresh app per test: schemathesis ends an app's lifespan with its client, and the end
    of the lifespan shuts the engine down for good."""
    from server_utils import CHAT_TEMPLATE

    from pagedllm.config import default_model
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.entrypoints.openai.server import build_app

    # The demo model, not a FakeRunner: the FakeRunner reports no logprobs, so a beam search
    # request (use_beam_search, which schemathesis sends) never advances on it.
    # max_model_len 96 bounds the dearest case (a beam search of width 16 to the end of the
    # context) to a few seconds.
    engine = LLMEngine.from_engine_args(default_model(), num_gpu_blocks_override=512, max_num_seqs=32,
                                        max_model_len=96)
    app = build_app(engine, ["demo"], chat_template=CHAT_TEMPLATE)
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    # The dashboard's trace feed is an endless event stream with no input to vary.
    return schema.exclude(path="/v1/trace/stream")


_SETTINGS = settings(max_examples=MAX_EXAMPLES, derandomize=True, deadline=None, database=None,
                     suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate])


def _run(api_schema, checks, modes) -> list[str]:
    """Every operation, MAX_EXAMPLES cases per generation mode; the failures as text.
    (schemathesis' own pytest fixture loader does not work with pytest 9, so the loop is here.)"""
    failures: list[str] = []
    for result in api_schema.get_all_operations():
        operation = result.ok()
        for mode in modes:

            @given(case=operation.as_strategy(generation_mode=mode))
            @_SETTINGS
            def run(case):
                case.call_and_validate(checks=checks, timeout=60)

            try:
                run()
            except Unsatisfiable:  # no input to break (GET /health): nothing negative to send
                if mode is not GenerationMode.NEGATIVE:
                    raise
            except BaseException as e:  # noqa: BLE001 - schemathesis raises exception groups
                if isinstance(e, (KeyboardInterrupt, SystemExit)):
                    raise
                failures.append(f"{operation.label} [{mode.value}]: {type(e).__name__}: {str(e)[:1500]}")
    return failures


def test_no_server_errors(api_schema):
    failures = _run(api_schema, [not_a_server_error], list(GenerationMode))
    assert not failures, "\n\n".join(failures)


def test_answers_conform_to_the_schema(api_schema):
    failures = _run(api_schema, [not_a_server_error, status_code_conformance, content_type_conformance,
                                 response_schema_conformance], list(GenerationMode))
    assert not failures, "\n\n".join(failures)
