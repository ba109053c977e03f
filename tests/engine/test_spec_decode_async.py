"""Issue 57: speculative decoding overlapped with async scheduling.

A step that verifies drafts is scheduled past as if every draft were accepted; the runner rolls
the rejected ones back at once and the scheduler at its update. Greedy output must equal the
target alone for each method (n-gram, draft model, EAGLE-3), with batching, chunked prefill,
prefix hits and preemption; the next step must really have been scheduled while a verification
was in flight, drafts must have been rejected too, and nothing may leak.
"""
from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from tests.engine.spec_decode_models import assert_idle, tiny_eagle3, tiny_llama

VOCAB = 64
SHARED = [1, 2, 3, 4, 5, 6, 7, 0] * 2
# Repeated text (n-gram hits), a prompt that hits the first one's blocks, short and long ones.
PROMPTS = [SHARED + [9], [9, 8, 7], list(range(10, 30)), [5] * 13, SHARED + [11, 12]]
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
SETTINGS = {
    "chunked_prefix": {"max_num_batched_tokens": 8, "long_prefill_token_threshold": 4, "block_size": 4},
    "preemption": {"num_gpu_blocks_override": 18, "block_size": 4, "max_num_seqs": 4},
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec-async")
    return {"target": tiny_llama(root / "target", VOCAB, seed=0, layers=4),
            "draft": tiny_llama(root / "draft", VOCAB, seed=1, layers=1, hidden=16),
            "eagle": tiny_eagle3(root / "eagle", VOCAB, 32, seed=5)}


def _specs(models) -> dict[str, dict]:
    return {"ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                      "prompt_lookup_max": 3},
            "draft_model": {"method": "draft_model", "model": models["draft"], "num_speculative_tokens": 3},
            "eagle3": {"method": "eagle3", "model": models["eagle"], "num_speculative_tokens": 3}}


def _run(llm: LLM) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _watch_overlap(llm: LLM) -> list[bool]:
    """Per schedule(): whether a step verifying drafts was in flight (a spy; the real schedule runs)."""
    core = llm.llm_engine.engine_core
    schedule, seen = core.scheduler.schedule, []

    def watched():
        seen.append(any(so.scheduled_spec_decode_tokens for so, _ in core._in_flight))
        return schedule()
    core.scheduler.schedule = watched
    return seen


@pytest.mark.parametrize("setting", sorted(SETTINGS))
@pytest.mark.parametrize("method", ["ngram", "draft_model", "eagle3"])
def test_greedy_identical_to_the_target_alone(models, method, setting):
    engine_args = SETTINGS[setting]
    reference = _run(LLM(models["target"], enforce_eager=True, **engine_args))
    llm = LLM(models["target"], enforce_eager=True, async_scheduling=True,
              speculative_config=_specs(models)[method], **engine_args)
    overlapped = _watch_overlap(llm)
    assert _run(llm) == reference
    m = llm.get_metrics()
    drafted, accepted = m["pagedllm:spec_decode_num_draft_tokens"], m["pagedllm:spec_decode_num_accepted_tokens"]
    assert drafted > accepted  # rejections happened, and were rolled back under the next step
    assert any(overlapped)
    if setting == "preemption":
        assert m["pagedllm:num_preemptions"] > 0
    else:
        assert m["pagedllm:prefix_cache_hits"] > 0
    assert_idle(llm)
