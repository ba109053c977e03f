"""The wire between the API process and the engine core process: every message of the core
protocol (engine/core_proc.py) survives encode -> decode, value and type, nested dataclasses,
frozensets and tuples included, and a real EngineCore run's every step comes back equal."""
from __future__ import annotations

from pagedllm.beam_search_params import BeamSearchParams
from pagedllm.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from pagedllm.core.outputs import EngineCoreOutputs, EngineCoreRequest, FinishedBeam, PromptLogprobsChunk, TokenLogprobs
from pagedllm.core.scheduler_stats import SchedulerStats
from pagedllm.engine.engine_core import EngineCore
from pagedllm.errors import ValidationError
from pagedllm.executor.ipc import error_info
from pagedllm.executor.wire import Codec
from pagedllm.runner.fake import FakeRunner
from pagedllm.sampling_params import RequestOutputKind, SamplingParams

CODEC = Codec()


def _round_trip(obj):
    back = CODEC.decode(CODEC.encode(obj))
    assert back == obj and type(back) is type(obj)
    return back


def test_engine_core_requests_round_trip():
    params = SamplingParams(n=3, temperature=0.5, seed=7, stop=["x"], logprobs=2,
                            logit_bias={4: -1.0}, output_kind=RequestOutputKind.DELTA)
    sampled = EngineCoreRequest("a", [1, 2, 3], params, frozenset({1, 2}), 12.5, priority=-1,
                                cache_salt="salt")
    back = _round_trip([3, "add_request", [sampled]])[2][0]
    assert type(back.eos_token_ids) is frozenset and back.sampling_params.output_kind is RequestOutputKind.DELTA
    assert back.sampling_params.logit_bias == {4: -1.0}
    beam = EngineCoreRequest("b", [5], None, frozenset(), 1.0,
                             beam_search_params=BeamSearchParams(beam_width=3, max_tokens=4,
                                                                 length_penalty=0.5))
    assert type(_round_trip(beam).beam_search_params) is BeamSearchParams


def test_engine_core_outputs_round_trip():
    out = EngineCoreOutputs(scheduler_stats=SchedulerStats(num_running_reqs=2, kv_cache_usage=0.25))
    lp = [TokenLogprobs([5, 6], [-0.1, -2.0], [1, 2])]
    out.add("a", [5], lp, PromptLogprobsChunk(1, [TokenLogprobs([3], [-1.5], [4])]))
    out.add("b", [])
    out.finished["a"] = ("stop", "END")
    out.num_cached_tokens["b"] = 16
    out.finished_beams["c"] = [FinishedBeam([1, 2], -0.5, -0.25, "length")]
    back = _round_trip(["outputs", 4, True, out])[3]
    assert type(back.finished["a"]) is tuple and type(back.finished_beams["c"][0]) is FinishedBeam
    assert [o.finish_reason for o in back] == ["stop", None]
    _round_trip(["outputs", 5, False, None])  # the idle report


def test_replies_and_errors_round_trip():
    _round_trip(["reply", 2, False, {"pagedllm:num_gpu_blocks": 40, "pagedllm:kv_cache_usage_perc": 0.5}])
    info = error_info(ValidationError("too long", "max_tokens"))
    back = _round_trip(["error", 3, False, info])[3]
    assert back["type"] == "ValidationError" and back["param"] == "max_tokens"


def test_every_step_of_a_real_core_round_trips():
    config = EngineConfig(ModelConfig(model="unused", max_model_len=64),
                          CacheConfig(block_size=4, num_gpu_blocks_override=20),
                          SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=4))
    core = EngineCore(config, 64, FakeRunner(vocab_size=100))
    core.add_request(EngineCoreRequest("s", [1, 2, 3, 4, 5, 6, 7, 8, 9], SamplingParams(
        max_tokens=5, n=2, logprobs=1, prompt_logprobs=1, seed=1), frozenset(), 0.0))
    core.add_request(EngineCoreRequest("t", [3, 4], SamplingParams(max_tokens=4, temperature=0.0),
                                       frozenset({7}), 0.0))
    steps = 0
    for _ in range(100):
        if not core.has_unfinished_requests():
            break
        outputs = core.step()
        if outputs is not None:
            _round_trip(outputs)
            steps += 1
    assert steps > 3 and not core.has_unfinished_requests()
    core.shutdown()
