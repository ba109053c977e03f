"""LLMEngine over both executors (distributed_executor_backend "uni" and "mp"), FakeRunner
behind them: the same outputs, n > 1 included, and shutdown reaps the worker."""
from __future__ import annotations

import pytest

from pagedllm.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.model_info import ModelInfo
from pagedllm.runner.fake import FakeRunner
from pagedllm.sampling_params import SamplingParams

from executor_helpers import child_pids, workload

VOCAB = 1000


def _engine(backend: str) -> LLMEngine:
    config = EngineConfig(ModelConfig(model="unused-fake-model", max_model_len=64),
                          CacheConfig(block_size=4, num_gpu_blocks_override=40),
                          SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=6),
                          parallel_config=ParallelConfig(backend))
    info = ModelInfo(vocab_size=VOCAB, max_position_embeddings=64, eos_token_ids=frozenset({7}))
    return LLMEngine(config, runner=FakeRunner(vocab_size=VOCAB), model_info=info,
                     load_tokenizer=False)


def _run(engine: LLMEngine) -> dict[str, list[list[int]]]:
    for i, req in enumerate(workload()):
        params = SamplingParams(max_tokens=req.max_tokens, n=1 + i % 3, seed=i, temperature=0.0,
                                detokenize=False)
        engine.add_request(req.request_id, req.prompt_token_ids, params)
    final = {}
    for _ in range(2000):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            final[out.request_id] = [c.token_ids for c in out.outputs]
    assert not engine.has_unfinished_requests()
    return final


@pytest.mark.parametrize("backend", ["mp"])
def test_engine_outputs_match_across_backends(backend):
    before = child_pids()
    uni = _engine("uni")
    want = _run(uni)
    uni.shutdown()
    engine = _engine(backend)
    assert child_pids() > before  # the worker
    assert _run(engine) == want
    engine.shutdown()
    engine.shutdown()
    assert child_pids() == before
