"""LLMEngine over both executors (distributed_executor_backend "uni" and "mp"), FakeRunner
behind them: the same outputs under n > 1, speculative drafts and aborts; shutdown reaps the
worker."""
from __future__ import annotations

import pytest
from executor_helpers import child_pids, workload

from pagedllm.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.model_info import ModelInfo
from pagedllm.runner.fake import FakeRunner
from pagedllm.sampling_params import SamplingParams

VOCAB = 1000
# A small vocabulary, so the FakeRunner's tokens repeat and the n-gram proposer finds drafts.
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}
SPEC_VOCAB = 12


def _engine(backend: str, speculative_config: dict | None = None) -> LLMEngine:
    vocab = SPEC_VOCAB if speculative_config else VOCAB
    config = EngineConfig(ModelConfig(model="unused-fake-model", max_model_len=64),
                          CacheConfig(block_size=4, num_gpu_blocks_override=40),
                          SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=6),
                          speculative_config, ParallelConfig(backend))
    info = ModelInfo(vocab_size=vocab, max_position_embeddings=64, eos_token_ids=frozenset({7}))
    return LLMEngine(config, runner=FakeRunner(vocab_size=vocab), model_info=info,
                     load_tokenizer=False)


def _run(engine: LLMEngine, scenario: str) -> dict[str, list[list[int]]]:
    for i, req in enumerate(workload()):
        prompt = req.prompt_token_ids
        if scenario == "speculative":
            prompt = [t % SPEC_VOCAB for t in prompt]
        n = 1 + i % 3 if scenario == "sampling" else 1
        engine.add_request(req.request_id, prompt, SamplingParams(
            max_tokens=req.max_tokens, n=n, seed=i, temperature=0.0, detokenize=False,
            ignore_eos=scenario == "speculative"))
    final = {}
    for step in range(2000):
        if not engine.has_unfinished_requests():
            break
        if scenario == "abort" and step in (2, 5):
            engine.abort_request([f"r{step}", f"r{step + 1}"])
        for out in engine.step():
            final[out.request_id] = [c.token_ids for c in out.outputs]
    assert not engine.has_unfinished_requests()
    return final


@pytest.mark.parametrize("scenario", ["sampling", "speculative", "abort"])
def test_engine_outputs_match_across_backends(scenario):
    spec = NGRAM if scenario == "speculative" else None
    before = child_pids()
    uni = _engine("uni", spec)
    want = _run(uni, scenario)
    uni.shutdown()
    engine = _engine("mp", spec)
    assert child_pids() > before  # the worker
    assert _run(engine, scenario) == want
    if scenario == "speculative":
        assert uni.get_metrics()["pagedllm:spec_decode_num_draft_tokens"] > 0
    engine.shutdown()
    engine.shutdown()
    assert child_pids() == before
