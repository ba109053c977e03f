"""The engine loop (LLMEngine) over the FakeRunner: no torch, no model, token-id prompts.

Plus the detokenizer and stop strings with the real demo tokenizer (stories260K).
"""
from __future__ import annotations

import random
from pathlib import Path

import pytest

from pagedllm.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.model_info import ModelInfo
from pagedllm.errors import ValidationError
from pagedllm.runner.fake import FakeRunner, fake_generate
from pagedllm.sampling_params import RequestOutputKind, SamplingParams

VOCAB = 100
EOS = frozenset({7})
TOKENIZER_DIR = Path(__file__).resolve().parents[2].parent / "shared/models/stories260K/hf"


def make_engine(num_blocks: int = 64, block_size: int = 4, max_model_len: int = 64,
                vocab_size: int = VOCAB, eos=EOS, tokenizer=None, runner=None,
                **sched_kwargs) -> LLMEngine:
    config = EngineConfig(
        ModelConfig(model="unused-fake-model", max_model_len=max_model_len),
        CacheConfig(block_size=block_size, num_gpu_blocks_override=num_blocks),
        SchedulerConfig(**sched_kwargs))
    info = ModelInfo(vocab_size=vocab_size, max_position_embeddings=128, eos_token_ids=eos)
    runner = runner or FakeRunner(vocab_size=vocab_size, verify_kv=True)
    return LLMEngine(config, runner=runner, model_info=info, tokenizer=tokenizer,
                     load_tokenizer=False)


def run(engine: LLMEngine, max_steps: int = 2000) -> dict:
    """Step to the end; returns request id -> its last RequestOutput."""
    final = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            final[out.request_id] = out
        engine.scheduler.check_integrity()
    else:
        raise AssertionError("engine did not finish")
    return final


def assert_idle(engine: LLMEngine) -> None:
    kv = engine.scheduler.kv_cache_manager
    kv.check_integrity()
    assert not engine.has_unfinished_requests()
    assert engine.scheduler.requests == {}
    assert engine.output_processor.parents == {} and engine.output_processor.request_states == {}
    assert kv.block_pool.get_num_free_blocks() == kv.num_blocks
    m = engine.get_metrics()
    assert m["pagedllm:kv_cache_usage_perc"] == 0.0
    assert m["pagedllm:num_requests_running"] == 0 and m["pagedllm:num_requests_waiting"] == 0


def expected(prompt, sp: SamplingParams, vocab_size: int = VOCAB, eos=EOS) -> list[int]:
    return fake_generate(prompt, sp.max_tokens, vocab_size, eos, sp.ignore_eos, sp.min_tokens,
                         frozenset(sp.stop_token_ids))


def prompts(n: int, seed: int = 0, lo: int = 1, hi: int = 20) -> list[list[int]]:
    rng = random.Random(seed)
    base = [rng.randrange(VOCAB) for _ in range(12)]
    out = []
    for i in range(n):
        shared = base[: rng.choice([0, 4, 8, 12])]
        out.append(shared + [rng.randrange(VOCAB) for _ in range(rng.randint(lo, hi))])
    return out


# -- results -------------------------------------------------------------------------------------
def test_outputs_equal_fake_generate():
    engine = make_engine(max_num_batched_tokens=16, max_num_seqs=4)
    params = [
        SamplingParams(max_tokens=10),
        SamplingParams(max_tokens=30, ignore_eos=True),
        SamplingParams(max_tokens=20, min_tokens=5),
        SamplingParams(max_tokens=20, stop_token_ids=[3, 11, 42]),
        SamplingParams(max_tokens=1),
    ]
    ps = prompts(len(params))
    for i, (p, sp) in enumerate(zip(ps, params)):
        engine.add_request(f"r{i}", p, sp)
    final = run(engine)
    assert sorted(final) == [f"r{i}" for i in range(len(params))]
    for i, (p, sp) in enumerate(zip(ps, params)):
        out = final[f"r{i}"]
        assert out.finished and out.prompt_token_ids == p
        (comp,) = out.outputs
        want = expected(p, sp)
        assert comp.token_ids == want, i
        assert comp.text == ""
        stopped = len(want) < sp.max_tokens or (
            (want[-1] in EOS and not sp.ignore_eos and len(want) >= sp.min_tokens)
            or want[-1] in sp.stop_token_ids)
        assert comp.finish_reason == ("stop" if stopped else "length"), i
    assert_idle(engine)


def test_n_greater_than_one_gathers_children():
    engine = make_engine()
    prompt = [5, 6, 8, 9, 10, 11]
    sp = SamplingParams(n=3, max_tokens=6, ignore_eos=True)
    engine.add_request("g", prompt, sp)
    final = run(engine)
    out = final["g"]
    assert out.finished and len(out.outputs) == 3
    assert [c.index for c in out.outputs] == [0, 1, 2]
    want = fake_generate(prompt, 6, VOCAB, EOS, True)
    for c in out.outputs:
        assert c.token_ids == want
        assert c.finish_reason == "length"
    assert engine.get_metrics()["pagedllm:generation_tokens"] == 18
    assert engine.get_metrics()["pagedllm:prompt_tokens"] == 6
    assert_idle(engine)


def test_streaming_deltas_add_up():
    engine = make_engine(max_num_batched_tokens=5)
    prompt = list(range(10, 23))
    sp = SamplingParams(n=2, max_tokens=7, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    engine.add_request("s", prompt, sp)
    got = {0: [], 1: []}
    finished = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            for c in out.outputs:
                got[c.index].extend(c.token_ids)
            finished += out.finished
    assert finished == 1
    want = fake_generate(prompt, 7, VOCAB, EOS, True)
    assert got == {0: want, 1: want}
    assert_idle(engine)


def test_tiny_cache_preempts_and_results_stay_exact():
    engine = make_engine(num_blocks=8, block_size=4, max_model_len=32, max_num_seqs=4)
    ps = [[i + 1] * 6 for i in range(4)]
    sp = SamplingParams(max_tokens=20, ignore_eos=True)
    for i, p in enumerate(ps):
        engine.add_request(f"r{i}", p, sp)
    final = run(engine)
    for i, p in enumerate(ps):
        assert final[f"r{i}"].outputs[0].token_ids == expected(p, sp)
    m = engine.get_metrics()
    assert m["pagedllm:num_preemptions"] > 0
    assert m["pagedllm:prompt_tokens"] == 24
    assert m["pagedllm:generation_tokens"] == 80
    assert m["pagedllm:prompt_tokens_computed"] >= 24  # recompute counts too
    assert m["pagedllm:request_success"] == 4
    assert m["pagedllm:num_gpu_blocks"] == 8
    assert_idle(engine)


def test_tiny_cache_with_parallel_samples():
    engine = make_engine(num_blocks=10, block_size=4, max_model_len=32, max_num_seqs=6)
    sp = SamplingParams(n=3, max_tokens=14, ignore_eos=True)
    ps = [[3, 4, 5, 6, 8], [9, 10, 11, 12, 13, 14, 15]]
    for i, p in enumerate(ps):
        engine.add_request(f"g{i}", p, sp)
    final = run(engine)
    for i, p in enumerate(ps):
        want = fake_generate(p, 14, VOCAB, EOS, True)
        assert [c.token_ids for c in final[f"g{i}"].outputs] == [want] * 3
    assert_idle(engine)


def test_kv_usage_and_counters_while_running():
    engine = make_engine(num_blocks=10)
    engine.add_request("a", [1, 2, 3, 4, 5, 6], SamplingParams(max_tokens=5, ignore_eos=True))
    engine.step()
    m = engine.get_metrics()
    assert m["pagedllm:kv_cache_usage_perc"] == pytest.approx(0.2)
    assert m["pagedllm:num_requests_running"] == 1
    assert m["pagedllm:prefix_cache_queries"] == 6
    run(engine)
    engine.add_request("b", [1, 2, 3, 4, 5, 6, 9], SamplingParams(max_tokens=2))
    run(engine)
    m = engine.get_metrics()
    assert m["pagedllm:prefix_cache_queries"] == 13
    assert m["pagedllm:prefix_cache_hits"] == 4
    assert_idle(engine)


# -- abort ---------------------------------------------------------------------------------------
def test_abort_request_idempotent():
    engine = make_engine(num_blocks=16)
    engine.add_request("a", list(range(1, 10)), SamplingParams(max_tokens=30, ignore_eos=True))
    engine.add_request("b", [4, 5, 6], SamplingParams(max_tokens=5, ignore_eos=True))
    engine.add_request("w", [9, 9, 9], SamplingParams(n=2, max_tokens=5))
    engine.step()
    engine.step()
    engine.abort_request("a")
    engine.abort_request("a")
    engine.abort_request(["a", "never-added"])
    assert "a" not in engine.scheduler.requests
    engine.abort_request("w")  # a parent with two children
    assert not any(r.endswith("_w") for r in engine.scheduler.requests)
    engine.scheduler.check_integrity()
    final = run(engine)
    assert set(final) == {"b"}  # no output for aborted requests
    assert final["b"].outputs[0].token_ids == fake_generate([4, 5, 6], 5, VOCAB, EOS, True)
    engine.abort_request("b")  # already finished: nothing happens
    assert_idle(engine)


def test_abort_frees_blocks_at_once():
    engine = make_engine(num_blocks=16)
    engine.add_request("a", list(range(1, 14)), SamplingParams(max_tokens=30, ignore_eos=True))
    engine.step()
    kv = engine.scheduler.kv_cache_manager
    assert kv.block_pool.get_num_free_blocks() == 12
    engine.abort_request("a")
    assert kv.block_pool.get_num_free_blocks() == 16
    assert_idle(engine)


# -- bad input -----------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs", [
    {"temperature": -0.5},
    {"top_p": 0.0},
    {"top_p": 1.5},
    {"top_k": -2},
    {"min_p": 1.5},
    {"n": 0},
    {"max_tokens": 0},
    {"min_tokens": -1},
    {"min_tokens": 5, "max_tokens": 4},
    {"logprobs": 21},
    {"prompt_logprobs": -1},
    {"stop": [""]},
    {"stop_token_ids": [-3]},
    {"presence_penalty": 2.5},
    {"frequency_penalty": -3.0},
    {"repetition_penalty": 0.0},
    {"seed": 1.5},
    {"logit_bias": {"x": 1.0}},
    {"logit_bias": {3: 500.0}},
])
def test_invalid_sampling_params_raise_validation_error(kwargs):
    with pytest.raises(ValidationError):
        SamplingParams(**kwargs)


def _bad_requests(engine):
    """(description, callable) pairs that must each raise ValidationError."""
    ok = SamplingParams(max_tokens=4)
    return [
        ("empty prompt", lambda: engine.add_request("x", [], ok)),
        ("token id = vocab size", lambda: engine.add_request("x", [1, VOCAB], ok)),
        ("negative token id", lambda: engine.add_request("x", [1, -1], ok)),
        ("non-integer token", lambda: engine.add_request("x", [1, 2.0], ok)),
        ("bool token", lambda: engine.add_request("x", [True], ok)),
        ("text without tokenizer", lambda: engine.add_request("x", "hello", ok)),
        ("not a prompt", lambda: engine.add_request("x", 42, ok)),
        ("params not SamplingParams", lambda: engine.add_request("x", [1], {"max_tokens": 3})),
        ("logit_bias outside vocab", lambda: engine.add_request(
            "x", [1], SamplingParams(logit_bias={VOCAB + 5: 1.0}))),
        ("priority not int", lambda: engine.add_request("x", [1], ok, priority="high")),
        ("prompt >= max_model_len", lambda: engine.add_request("x", [1] * 64, ok)),
        ("prompt + max_tokens > max_model_len", lambda: engine.add_request(
            "x", [1] * 60, SamplingParams(max_tokens=5))),
        ("more blocks than the cache", lambda: engine.add_request(
            "x", [1] * 40, SamplingParams(max_tokens=20))),
        ("n above max_num_seqs", lambda: engine.add_request(
            "x", [1, 2], SamplingParams(n=5, max_tokens=2))),
    ]


def test_bad_input_rejected_and_engine_keeps_serving():
    engine = make_engine(num_blocks=12, max_model_len=64, max_num_seqs=4)  # 48 cache tokens
    engine.add_request("live", [3, 4, 5], SamplingParams(max_tokens=6, ignore_eos=True))
    engine.step()
    for name, call in _bad_requests(engine):
        with pytest.raises(ValidationError):
            call()
        assert list(engine.scheduler.requests) == ["live"], name
        assert list(engine.output_processor.parents) == ["live"], name
    with pytest.raises(ValidationError):
        engine.add_request("live", [1], SamplingParams(max_tokens=2))  # duplicate id
    engine.add_request("x", [8, 9, 10], SamplingParams(max_tokens=5, ignore_eos=True))
    final = run(engine)
    assert final["live"].outputs[0].token_ids == fake_generate([3, 4, 5], 6, VOCAB, EOS, True)
    assert final["x"].outputs[0].token_ids == fake_generate([8, 9, 10], 5, VOCAB, EOS, True)
    assert engine.get_metrics()["pagedllm:prompt_tokens"] == 6
    assert_idle(engine)


def test_request_id_reusable_after_finish():
    engine = make_engine()
    engine.add_request("a", [1, 2], SamplingParams(max_tokens=2))
    run(engine)
    engine.add_request("a", [3, 4], SamplingParams(max_tokens=2))
    final = run(engine)
    assert final["a"].prompt_token_ids == [3, 4]
    assert_idle(engine)


# -- detokenizer and stop strings with the real demo tokenizer ------------------------------------
@pytest.fixture(scope="module")
def tokenizer():
    if not (TOKENIZER_DIR / "tokenizer.json").is_file():
        pytest.skip(f"demo tokenizer not found at {TOKENIZER_DIR}")
    from pagedllm.engine.tokenizer import load_tokenizer

    return load_tokenizer(TOKENIZER_DIR)


STORY = "Once upon a time, there was a little girl named Lily. She liked to play outside."


def incremental_text(tokenizer, prompt_ids, output_ids, **kw):
    from pagedllm.engine.detokenizer import IncrementalDetokenizer

    detok = IncrementalDetokenizer(tokenizer, prompt_ids, **kw)
    stop = None
    for tok in output_ids:
        stop = detok.update([tok])
        if stop is not None:
            break
    return detok.output_text, stop


def reference_text(tokenizer, prompt_ids, output_ids):
    """The text the output tokens add after the prompt, decoded in one go."""
    prompt_text = tokenizer.decode(prompt_ids, skip_special_tokens=True)
    full = tokenizer.decode(prompt_ids + output_ids, skip_special_tokens=True)
    assert full.startswith(prompt_text)
    return full[len(prompt_text):]


@pytest.mark.parametrize("text", [
    STORY,
    'Tom said: "Hi!"\n\nThe end.',
    "  two  spaces and   three",
    "café — naïve 😀 ok",
])
def test_incremental_detokenizer_matches_decode(tokenizer, text):
    ids = tokenizer(text).input_ids
    whole = tokenizer.decode(ids, skip_special_tokens=True)
    assert incremental_text(tokenizer, [], ids)[0] == whole
    for split in range(1, len(ids)):
        prompt, out = ids[:split], ids[split:]
        prompt_text = tokenizer.decode(prompt, skip_special_tokens=True)
        if prompt_text.endswith("\ufffd"):
            continue  # the prompt ends inside a multi-byte character
        want = reference_text(tokenizer, prompt, out)
        assert incremental_text(tokenizer, prompt, out)[0] == want, split


def test_incremental_detokenizer_after_multibyte_prompt(tokenizer):
    # The prompt ends right after two 3-byte characters (byte-fallback tokens): the left context
    # the detokenizer keeps must not start inside a character, or later characters are lost.
    prompt = tokenizer("日本").input_ids
    out = tokenizer("日本語 ok").input_ids[len(prompt):]
    assert tokenizer.decode(prompt, skip_special_tokens=True) == "日本"
    assert incremental_text(tokenizer, prompt, out)[0] == "語 ok"


def test_incremental_detokenizer_random_token_ids(tokenizer):
    rng = random.Random(0)
    specials = list(tokenizer.all_special_ids)
    normal = range(259, tokenizer.vocab_size)  # skip the 256 byte-fallback tokens
    for trial in range(100):
        prompt = [1] + [rng.choice(normal) for _ in range(trial % 7)]
        out = [rng.choice(specials) if rng.random() < 0.1 else rng.choice(normal)
               for _ in range(rng.randint(1, 25))]
        assert incremental_text(tokenizer, prompt, out)[0] == reference_text(tokenizer, prompt, out)


def test_stop_strings_truncate(tokenizer):
    ids = tokenizer(STORY).input_ids
    prompt, out = ids[:5], ids[5:]  # "Once upon a time" | ", there was a little girl ..."
    assert reference_text(tokenizer, prompt, out).startswith(", there was a little girl")
    assert incremental_text(tokenizer, prompt, out, stop=["little"]) == (", there was a ", "little")
    assert incremental_text(tokenizer, prompt, out, stop=["little"],
                            include_stop_str_in_output=True) == (", there was a little", "little")
    # A stop string spanning several tokens ("girl" is ▁g + ir + l).
    assert incremental_text(tokenizer, prompt, out, stop=["zzz", "girl"]) == (
        ", there was a little ", "girl")
    assert incremental_text(tokenizer, prompt, out, stop=["zzz"]) == (
        reference_text(tokenizer, prompt, out), None)


class ScriptedRunner(FakeRunner):
    """A FakeRunner (KV checks and all) whose sampled tokens follow a script per request."""

    def __init__(self, scripts: dict[str, list[int]], vocab_size: int) -> None:
        super().__init__(vocab_size=vocab_size, verify_kv=True)
        self.scripts = {rid: list(s) for rid, s in scripts.items()}

    def execute_model(self, so):
        ro = super().execute_model(so)
        for i, rid in enumerate(ro.req_ids):
            if ro.sampled_token_ids[i]:
                token = self.scripts[rid].pop(0)
                ro.sampled_token_ids[i] = [token]
                self.requests[rid].token_ids[-1] = token  # what this runner "sampled" and feeds on
        return ro


@pytest.mark.parametrize("include", [False, True])
def test_engine_stop_string_finishes_request(tokenizer, include):
    ids = tokenizer(STORY).input_ids
    prompt, script = ids[:5], ids[5:]
    runner = ScriptedRunner({"s": script}, tokenizer.vocab_size)
    engine = make_engine(vocab_size=tokenizer.vocab_size, eos=frozenset({2}), tokenizer=tokenizer,
                         runner=runner)
    engine.add_request("s", prompt, SamplingParams(max_tokens=len(script), stop=["little"],
                                                   include_stop_str_in_output=include))
    final = run(engine)
    comp = final["s"].outputs[0]
    assert comp.text == (", there was a little" if include else ", there was a ")
    assert (comp.finish_reason, comp.stop_reason) == ("stop", "little")
    assert len(comp.token_ids) < len(script)  # finished early, not at max_tokens
    assert_idle(engine)


def test_engine_eos_not_shown_in_text(tokenizer):
    ids = tokenizer(STORY).input_ids
    prompt, script = ids[:5], ids[5:9] + [2]
    runner = ScriptedRunner({"e": script}, tokenizer.vocab_size)
    engine = make_engine(vocab_size=tokenizer.vocab_size, eos=frozenset({2}), tokenizer=tokenizer,
                         runner=runner)
    engine.add_request("e", prompt, SamplingParams(max_tokens=20))
    comp = run(engine)["e"].outputs[0]
    assert comp.token_ids == script
    assert comp.text == reference_text(tokenizer, prompt, script[:-1]) == ", there was a"
    assert (comp.finish_reason, comp.stop_reason) == ("stop", None)
    assert_idle(engine)


@pytest.mark.parametrize("stop", [[], ["girl"], ["Lily", "zz"]])
def test_engine_streamed_text_adds_up_to_final_text(tokenizer, stop):
    ids = tokenizer(STORY).input_ids
    prompt, script = ids[:5], ids[5:]

    def generate(kind):
        runner = ScriptedRunner({"s": script}, tokenizer.vocab_size)
        engine = make_engine(vocab_size=tokenizer.vocab_size, eos=frozenset({2}),
                             tokenizer=tokenizer, runner=runner)
        engine.add_request("s", prompt, SamplingParams(max_tokens=len(script), stop=stop,
                                                       output_kind=kind))
        outs = []
        while engine.has_unfinished_requests():
            outs.extend(o.outputs[0] for o in engine.step())
        assert_idle(engine)
        return outs

    (final,) = generate(RequestOutputKind.FINAL_ONLY)
    deltas = generate(RequestOutputKind.DELTA)
    assert "".join(d.text for d in deltas) == final.text
    assert [t for d in deltas for t in d.token_ids] == final.token_ids
    assert deltas[-1].finish_reason == final.finish_reason
    full = reference_text(tokenizer, prompt, script)
    assert final.text == (full[:full.index(stop[0])] if stop else full)


def test_beam_search_on_the_fake_runner_finishes(tokenizer):
    """The FakeRunner reports a (fake) distribution when asked for logprobs, so beam search
    advances and ends on it instead of waiting forever for reports."""
    from pagedllm import BeamSearchParams

    engine = make_engine(vocab_size=tokenizer.vocab_size, eos=frozenset({2}), tokenizer=tokenizer)
    for width in (1, 2, 3):
        engine.add_beam_search_request(f"b{width}", [1, 403, 407], BeamSearchParams(beam_width=width, max_tokens=5))
    results = {}
    for _ in range(50):
        for out in engine.step():
            if out.finished:
                results[out.request_id] = [c.token_ids for c in out.outputs]
        if not engine.has_unfinished_requests():
            break
    assert sorted(results) == ["b1", "b2", "b3"]
    assert all(len(beams) == int(rid[1:]) and all(len(t) == 5 for t in beams) for rid, beams in results.items())
    assert_idle(engine)


def test_beam_searches_share_the_request_id_space_and_the_output_processor(tokenizer):
    from pagedllm import BeamSearchParams

    engine = make_engine(vocab_size=tokenizer.vocab_size, eos=frozenset({2}), tokenizer=tokenizer)
    engine.add_request("s", [1, 403], SamplingParams(max_tokens=3, ignore_eos=True))
    engine.add_beam_search_request("b", [1, 403, 407], BeamSearchParams(beam_width=2, max_tokens=4))
    for rid, add in (("s", engine.add_beam_search_request), ("b", engine.add_request)):
        with pytest.raises(ValidationError, match=f"request id '{rid}' is already in use"):
            add(rid, [5, 6], BeamSearchParams(beam_width=1, max_tokens=2) if rid == "s"
                else SamplingParams(max_tokens=2))
    assert engine.get_num_unfinished_requests() == 2
    final = run(engine)
    beams = final["b"]
    assert beams.finished and len(beams.outputs) == 2 and len(beams.beam_scores) == 2
    for completion in beams.outputs:  # decoded by the OutputProcessor, EOS never shown as text
        shown = completion.token_ids[:-1] if completion.finish_reason == "stop" else completion.token_ids
        assert completion.text == tokenizer.decode(shown, skip_special_tokens=True)
    assert engine.get_num_unfinished_requests() == 0 and not engine.output_processor.beam_searches
    engine.add_beam_search_request("b", [1, 403], BeamSearchParams(beam_width=1, max_tokens=2))  # free again
    engine.abort_request("b")
    assert not engine.has_unfinished_requests()
    assert_idle(engine)


def test_a_beam_search_aborted_as_it_ends_yields_nothing():
    from pagedllm.core.outputs import EngineCoreOutputs, FinishedBeam
    from pagedllm.engine.output_processor import BeamSearchRequest, OutputProcessor

    op = OutputProcessor(tokenizer=None)
    op.add_beam_search(BeamSearchRequest("b", None, [1, 2]))
    assert op.has_unfinished_requests() and op.abort_requests(["b"]) == ["b"]
    late = EngineCoreOutputs(finished_beams={"b": [FinishedBeam([3, 4], -1.0, -0.5, "length")]})
    assert op.process_outputs(late) == ([], [])  # the core finished it before reading the abort
    op.add_beam_search(BeamSearchRequest("c", None, [1, 2]))
    outs, _ = op.process_outputs(EngineCoreOutputs(finished_beams={"c": [FinishedBeam([3, 4], -1.0, -0.5, "length")]}))
    assert [(o.request_id, o.outputs[0].token_ids, o.beam_scores) for o in outs] == [("c", [3, 4], [-0.5])]
    assert not op.has_unfinished_requests()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_generator_that_pools_runs_both_kinds_in_shared_steps(async_scheduling):
    """pooler_config on a generator: pooling inputs chunked beside decodes (at most the cap
    of them in a step that decodes), each request with the result it gets alone, nothing left."""
    from pagedllm.pooling_outputs import PoolingRequestOutput
    from pagedllm.pooling_params import PoolingParams
    from pagedllm.runner.fake import fake_pooled

    if not TOKENIZER_DIR.is_dir():
        pytest.skip("demo model (its config.json) not present")
    config = EngineConfig(
        ModelConfig(model=str(TOKENIZER_DIR), max_model_len=64),
        CacheConfig(block_size=4, num_gpu_blocks_override=64),
        SchedulerConfig(max_num_batched_tokens=16, max_pooling_tokens_while_decoding=3,
                        async_scheduling=async_scheduling), pooler_config={})
    engine = LLMEngine(config, runner=FakeRunner(vocab_size=VOCAB), load_tokenizer=False,
                       model_info=ModelInfo(vocab_size=VOCAB, max_position_embeddings=128, eos_token_ids=EOS))
    schedules = []
    engine.step_observers.append(lambda so, outs, t: schedules.append(dict(so.num_scheduled_tokens)))
    sp = SamplingParams(max_tokens=10, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY)
    gens = prompts(3, seed=1)
    inputs = prompts(4, seed=2, lo=10, hi=40)  # most longer than a step's budget
    for i, p in enumerate(gens):
        engine.add_request(f"g{i}", {"prompt_token_ids": p}, sp)
    for i, p in enumerate(inputs):
        engine.add_pooling_request(f"e{i}", {"prompt_token_ids": p}, PoolingParams(task="embed"))
    final = run(engine)
    assert {rid: list(o.outputs[0].token_ids) for rid, o in final.items() if rid.startswith("g")} == \
        {f"g{i}": expected(p, sp) for i, p in enumerate(gens)}
    vectors = {rid: o.outputs.data for rid, o in final.items() if isinstance(o, PoolingRequestOutput)}
    assert vectors == {f"e{i}": fake_pooled(p) for i, p in enumerate(inputs)}
    decoding = [s for s in schedules if any(r.startswith("g") and n == 1 for r, n in s.items())]
    assert decoding and all(sum(n for r, n in s.items() if r.startswith("e")) <= 3 for s in decoding)
    assert not engine.pooling.pending
    assert_idle(engine)
