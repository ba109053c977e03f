"""The demo model with the engine core in its own process against the in-process core: greedy
tokens and logprobs the same, with async scheduling on and off, under chunked prefill, prefix
hits, preemption and aborts; n > 1, beam search and stop strings through the process."""
from __future__ import annotations

import os

import pytest

from pagedllm import LLM, BeamSearchParams, SamplingParams
from pagedllm.engine.core_client import ENV_ENABLE_MULTIPROCESSING, MPEngineCoreClient

SETTINGS = [  # (engine arguments): roomy, chunked + prefix hits, tight (preemption)
    {"num_gpu_blocks_override": 256},
    {"max_num_batched_tokens": 16, "long_prefill_token_threshold": 8, "block_size": 4},
    {"num_gpu_blocks_override": 24, "block_size": 4, "max_num_seqs": 4},
]


def _process_llm(model: str, **engine_args) -> LLM:
    """An LLM whose engine core runs in its own process (the switch is read at construction)."""
    saved = {k: os.environ.get(k) for k in (ENV_ENABLE_MULTIPROCESSING, "OMP_NUM_THREADS")}
    os.environ[ENV_ENABLE_MULTIPROCESSING] = "1"
    os.environ["OMP_NUM_THREADS"] = "1"  # the core's torch, on a small shared machine
    try:
        llm = LLM(model, **engine_args)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    assert isinstance(llm.llm_engine.engine_core, MPEngineCoreClient)
    return llm


def _prompts(golden_cases) -> list[dict]:
    cases = [{"prompt_token_ids": c["prompt_ids"]} for c in golden_cases]
    shared = golden_cases[0]["prompt_ids"]
    return cases + [{"prompt_token_ids": shared + [261, 370]}, {"prompt_token_ids": shared}]


def _assert_idle(llm: LLM) -> None:
    m = llm.get_metrics()
    assert m["pagedllm:num_requests_running"] == m["pagedllm:num_requests_waiting"] == 0, m
    assert m["pagedllm:kv_cache_usage_perc"] == 0, m
    assert not llm.llm_engine.has_unfinished_requests()


def _same(want, got) -> None:
    for a, b in zip(want, got, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert la.keys() == lb.keys()
            # The suite's tolerance for logprobs computed along different paths (1e-4, as for
            # compiled, tensor-parallel and transformers runs): the core process steps while
            # requests still arrive, so its chunks can split prompts elsewhere than the
            # in-process run, and a token can then come from torch's SDPA (a fresh chunk) in one
            # run and from the paged kernel (a chunk over cached blocks) in the other. Measured:
            # 1.5e-5 at worst (thread counts alone change nothing: 0.0).
            assert all(abs(la[t].logprob - lb[t].logprob) < 1e-4 for t in la)


@pytest.mark.slow
@pytest.mark.parametrize("engine_args", SETTINGS, ids=["roomy", "chunked", "preempting"])
def test_greedy_and_logprobs_identical_in_process_and_in_a_core_process(demo_model_path, golden_cases,
                                                                         engine_args):
    prompts = _prompts(golden_cases)
    params = SamplingParams(temperature=0.0, max_tokens=40, logprobs=2)
    want = LLM(demo_model_path, **engine_args).generate(prompts, params, use_tqdm=False)
    for async_scheduling in (False, True):
        llm = _process_llm(demo_model_path, async_scheduling=async_scheduling, **engine_args)
        _same(want, llm.generate(prompts, params, use_tqdm=False))
        if engine_args.get("max_num_seqs") == 4:  # the tight one
            assert llm.get_metrics()["pagedllm:num_preemptions"] > 0
        _assert_idle(llm)
        llm.llm_engine.shutdown()


@pytest.mark.slow
def test_n_beams_stops_and_aborts_through_the_process(demo_model_path, golden_cases):
    local = LLM(demo_model_path, block_size=4, num_gpu_blocks_override=256)
    remote = _process_llm(demo_model_path, block_size=4, num_gpu_blocks_override=256,
                          async_scheduling=True)
    prompts = _prompts(golden_cases)[:4]
    sampled = SamplingParams(n=3, temperature=0.9, seed=7, max_tokens=24, stop=[" the"])
    for a, b in zip(local.generate(prompts, sampled, use_tqdm=False),
                    remote.generate(prompts, sampled, use_tqdm=False), strict=True):
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
        assert [c.text for c in a.outputs] == [c.text for c in b.outputs]
        assert [c.finish_reason for c in a.outputs] == [c.finish_reason for c in b.outputs]
        assert [c.stop_reason for c in a.outputs] == [c.stop_reason for c in b.outputs]
    beams = BeamSearchParams(beam_width=3, max_tokens=12)
    for a, b in zip(local.beam_search(prompts, beams), remote.beam_search(prompts, beams), strict=True):
        assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]

    # Aborts mid-run: the others finish as they would have alone; nothing is left behind.
    engine = remote.llm_engine
    greedy = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"a{i}", p, greedy.clone(n=2) if i % 2 else greedy)
    for _ in range(3):
        engine.step()
    engine.abort_request(["a1", "a2"])
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            final[out.request_id] = out
    assert set(final) <= {"a0", "a3"} and "a1" not in final and "a2" not in final
    alone = local.generate([prompts[0]], greedy, use_tqdm=False)[0]
    assert final["a0"].outputs[0].token_ids == alone.outputs[0].token_ids
    _assert_idle(remote)
    engine.shutdown()
