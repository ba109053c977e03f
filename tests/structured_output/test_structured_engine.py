"""Structured outputs through the engine over the FakeRunner (no torch), the demo tokenizer:
every output of 20 random schemas and 10 regexes validates, with n = 4, chunked prefill,
preemption, speculative drafts and the mp executor; grammars compile once, off the step loop."""
from __future__ import annotations

import threading

import pytest
from so_helpers import DEMO_EOS, DEMO_HF, REGEXES, VOCAB, check_json, check_regex, random_schemas

from pagedllm import SamplingParams, StructuredOutputsParams
from pagedllm.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.model_info import ModelInfo
from pagedllm.errors import ValidationError
from pagedllm.runner.fake import FakeRunner

PROMPTS = ["Once upon a time", "The little dog", "Lily"]
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}


def make_engine(num_blocks: int = 128, batched: int = 8, max_num_seqs: int = 8, speculative=None,
                backend: str = "uni", async_scheduling: bool = False) -> LLMEngine:
    config = EngineConfig(ModelConfig(model=DEMO_HF, max_model_len=256),
                          CacheConfig(block_size=4, num_gpu_blocks_override=num_blocks),
                          SchedulerConfig(max_num_batched_tokens=batched, max_num_seqs=max_num_seqs,
                                          async_scheduling=async_scheduling),
                          speculative, ParallelConfig(backend))
    info = ModelInfo(vocab_size=VOCAB, max_position_embeddings=256, eos_token_ids=DEMO_EOS)
    return LLMEngine(config, runner=FakeRunner(vocab_size=VOCAB), model_info=info)


def run(engine: LLMEngine, requests: dict[str, tuple[str, SamplingParams]]) -> dict:
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    final = {}
    for _ in range(20_000):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    assert not engine.has_unfinished_requests()
    return final


def json_params(schema, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=150, n=4, temperature=0.0, **kw,
                          structured_outputs=StructuredOutputsParams(json=schema, disable_any_whitespace=True))


@pytest.mark.parametrize("scenario", ["plain", "preemption", "speculative"])
def test_random_schemas_and_regexes_validate(scenario):
    schemas = random_schemas()
    kw = {"num_blocks": 44} if scenario == "preemption" else {}
    engine = make_engine(speculative=NGRAM if scenario == "speculative" else None, **kw)
    requests = {f"j{i}": (PROMPTS[i % 3], json_params(s, seed=i)) for i, s in enumerate(schemas)}
    requests |= {f"r{i}": (PROMPTS[i % 3], SamplingParams(
        max_tokens=60, n=4, structured_outputs=StructuredOutputsParams(regex=r)))
        for i, r in enumerate(REGEXES)}
    final = run(engine, requests)
    for i, schema in enumerate(schemas):
        for c in final[f"j{i}"].outputs:
            assert c.finish_reason == "stop", (schema, c.text)
            check_json(c.text, schema)
    for i, regex in enumerate(REGEXES):
        for c in final[f"r{i}"].outputs:
            assert c.finish_reason == "stop" and c.token_ids[-1] in DEMO_EOS, (regex, c.text)
            check_regex(c.text, regex)
    so = engine.engine_core.structured_output
    assert so.num_compiles == len(schemas) + len(REGEXES)  # each grammar once, for 4 samples
    assert not so._matchers and not so._keys  # nothing left behind
    if scenario == "preemption":
        assert engine.get_metrics()["pagedllm:num_preemptions"] > 0
    engine.engine_core.scheduler.kv_cache_manager.block_pool.check_integrity()


def test_choice_grammar_and_json_object():
    engine = make_engine()
    choices = ["yes", "no way", "it \"depends\""]
    final = run(engine, {
        "c": ("Lily", SamplingParams(max_tokens=20, n=4, structured_outputs=StructuredOutputsParams(choice=choices))),
        "g": ("Lily", SamplingParams(max_tokens=20, structured_outputs=StructuredOutputsParams(
            grammar='start: "a" ("b" | "c")+ "d"'))),
        "e": ("Lily", SamplingParams(max_tokens=20, structured_outputs=StructuredOutputsParams(
            grammar='root ::= "x" [0-9] "y"'))),
        "o": ("Lily", SamplingParams(max_tokens=80, structured_outputs=StructuredOutputsParams(
            json_object=True, disable_any_whitespace=True))),
    })
    assert all(c.text in choices for c in final["c"].outputs)
    check_regex(final["g"].outputs[0].text, r"a[bc]+d")
    check_regex(final["e"].outputs[0].text, r"x[0-9]y")
    # The object must close within max_tokens (no whitespace to spend the budget on), so the
    # check below always runs: a reply cut off by the length limit fails here.
    assert final["o"].outputs[0].finish_reason == "stop", final["o"].outputs[0]
    check_json(final["o"].outputs[0].text, {"type": "object"})


def test_the_cache_compiles_each_schema_once_and_ignores_key_order():
    engine = make_engine()
    a = {"type": "object", "properties": {"x": {"type": "boolean"}, "y": {"type": "boolean"}},
         "required": ["x", "y"], "additionalProperties": False}
    b = {"additionalProperties": False, "required": ["x", "y"],
         "properties": {"y": {"type": "boolean"}, "x": {"type": "boolean"}}, "type": "object"}
    final = run(engine, {f"q{i}": ("Lily", json_params(s)) for i, s in enumerate([a, b, a, b, a])})
    assert engine.engine_core.structured_output.num_compiles == 1
    for out in final.values():
        for c in out.outputs:
            check_json(c.text, a)


def test_requests_wait_for_their_grammar_off_the_step_loop(monkeypatch):
    engine = make_engine()
    core = engine.engine_core
    gate = threading.Event()
    from pagedllm.structured_output.backend import GrammarBackend

    compile_ = GrammarBackend.compile
    monkeypatch.setattr(GrammarBackend, "compile", lambda self, src: (gate.wait(10), compile_(self, src))[1])
    engine.add_request("plain", "Lily", SamplingParams(max_tokens=4))
    engine.add_request("held", "Lily", SamplingParams(
        max_tokens=20, structured_outputs=StructuredOutputsParams(regex="[a-z]{4}")))
    for _ in range(6):  # the plain request runs and finishes while the grammar compiles
        engine.step()
    assert "held" not in core.scheduler.requests and core.structured_output.is_held("held")
    assert engine.has_unfinished_requests()
    gate.set()
    final = run(engine, {})
    check_regex(final["held"].outputs[0].text, "[a-z]{4}")


def test_abort_while_held_leaves_nothing(monkeypatch):
    engine = make_engine()
    gate = threading.Event()
    from pagedllm.structured_output.backend import GrammarBackend

    compile_ = GrammarBackend.compile
    monkeypatch.setattr(GrammarBackend, "compile", lambda self, src: (gate.wait(10), compile_(self, src))[1])
    engine.add_request("h", "Lily", SamplingParams(
        max_tokens=20, n=4, structured_outputs=StructuredOutputsParams(regex="[0-9]{3}")))
    engine.abort_request("h")
    gate.set()
    assert not engine.engine_core.has_unfinished_requests()
    so = engine.engine_core.structured_output
    assert not so.has_held() and not so._keys


@pytest.mark.parametrize("bad, word", [
    (dict(regex="a(b"), "regex"),
    (dict(json={"type": "frobnicate"}), "json"),
    (dict(grammar="start: (("), "grammar"),
])
def test_an_invalid_constraint_is_a_validation_error_at_add(bad, word):
    engine = make_engine()
    with pytest.raises(ValidationError) as e:
        engine.add_request("x", "Lily", SamplingParams(structured_outputs=StructuredOutputsParams(**bad)))
    assert e.value.param == "structured_outputs" and word in e.value.message
    assert not engine.has_unfinished_requests()


def test_async_scheduling_is_refused_for_structured_requests():
    engine = make_engine(async_scheduling=True)
    with pytest.raises(ValidationError) as e:
        engine.add_request("x", "Lily", SamplingParams(structured_outputs=StructuredOutputsParams(regex="a")))
    assert e.value.param == "structured_outputs" and "async_scheduling" in e.value.message


def test_speculative_drafts_are_truncated_at_the_grammar():
    engine = make_engine(speculative=NGRAM)
    core = engine.engine_core
    seen: list[list[int]] = []
    proposer = core.proposer
    original = proposer.propose
    proposer.propose = lambda ids: (lambda d: (seen.append(d), d)[1])(original(ids) or [5, 5, 5])
    drafted = []
    set_drafts = core.scheduler.set_draft_tokens
    core.scheduler.set_draft_tokens = lambda rid, d: (drafted.append(d), set_drafts(rid, d))[1]
    final = run(engine, {"d": ("Lily", SamplingParams(
        max_tokens=40, structured_outputs=StructuredOutputsParams(regex="[0-9]{6}")))})
    check_regex(final["d"].outputs[0].text, "[0-9]{6}")
    # The filler drafts [5, 5, 5] (token 5 is no digit) are the ones the grammar must cut; they
    # must have been proposed, or the check says nothing.
    cut = [(s, d) for s, d in zip(seen, drafted, strict=True) if s[:1] == [5]]
    assert cut and all(len(d) < len(s) for s, d in cut), (seen, drafted)


@pytest.mark.parametrize("backend", ["mp"])
def test_mp_executor(backend):
    schemas = random_schemas(4, seed=3)
    engine = make_engine(backend=backend)
    try:
        final = run(engine, {f"j{i}": (PROMPTS[i % 3], json_params(s)) for i, s in enumerate(schemas)})
    finally:
        engine.shutdown()
    for i, schema in enumerate(schemas):
        for c in final[f"j{i}"].outputs:
            check_json(c.text, schema)


def test_a_held_request_is_validated_once(monkeypatch):
    """Admission's check runs when the request arrives (its ValidationError reaches the caller),
    not again when its grammar is ready and the scheduler queues it."""
    from pagedllm.core.scheduler import Scheduler

    seen: list[str] = []
    real = Scheduler.validate

    def counting(self, request):
        seen.append(request.request_id)
        return real(self, request)

    monkeypatch.setattr(Scheduler, "validate", counting)
    engine = make_engine()
    params = SamplingParams(max_tokens=20, structured_outputs=StructuredOutputsParams(regex="[ab]{3,8}"))
    final = run(engine, {"held": ("Lily", params), "plain": ("Lily", SamplingParams(max_tokens=5))})
    check_regex(final["held"].outputs[0].text, "[ab]{3,8}")
    assert sorted(seen) == ["held", "plain"]
    with pytest.raises(ValidationError, match="maximum context length"):
        engine.add_request("long", "Lily",
                           SamplingParams(max_tokens=1000, structured_outputs=params.structured_outputs))
