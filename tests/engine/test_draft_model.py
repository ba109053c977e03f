"""Issue 57: speculative decoding with a draft model (runner/draft_model.py).

Tiny random Llamas made here: the target's own weights as the draft accept every draft; another
random model of the same vocabulary accepts almost none. Greedy output must equal the target
alone in every case, and sampled output be distributed as the target alone.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.errors import ModelLoadError, ValidationError
from tests.engine.spec_decode_models import assert_idle, sampled_distribution_pvalue
from tests.engine.spec_decode_models import tiny_llama as _tiny_llama

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER = ROOT.parent / "shared" / "models" / "synthetic-tokenizer-32k"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("draft-models")
    return {"target": _tiny_llama(root / "target", 64, seed=0),
            "other": _tiny_llama(root / "other", 64, seed=1, layers=1, hidden=16),
            "small_vocab": _tiny_llama(root / "small-vocab", 48, seed=2, layers=1, hidden=16)}


def _spec(draft: str, k: int = 3) -> dict:
    return {"method": "draft_model", "model": draft, "num_speculative_tokens": k}


PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7], list(range(10, 30)), [5] * 13]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def _token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def _run(llm: LLM, prompts=PROMPTS, params=GREEDY) -> list[list[int]]:
    return _token_ids(llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False))


@pytest.mark.parametrize("engine_args", [
    {},  # batching
    {"max_num_batched_tokens": 6, "long_prefill_token_threshold": 4},  # chunked prefill
    {"num_gpu_blocks_override": 14, "block_size": 4, "max_num_seqs": 4},  # preemption
], ids=["batch", "chunked", "preemption"])
def test_greedy_identical_to_the_target_alone(models, engine_args):
    reference = _run(LLM(models["target"], enforce_eager=True, **engine_args))
    for draft, full in ((models["target"], True), (models["other"], False)):
        llm = LLM(models["target"], enforce_eager=True, speculative_config=_spec(draft), **engine_args)
        assert _run(llm) == reference
        m = llm.get_metrics()
        proposed, accepted = m["pagedllm:spec_decode_num_draft_tokens"], m["pagedllm:spec_decode_num_accepted_tokens"]
        assert proposed > 0
        if full:  # the target's own weights as the draft: every draft accepted
            assert accepted == proposed
        else:  # an unrelated random model: almost none
            assert accepted < 0.2 * proposed
        if "num_gpu_blocks_override" in engine_args:
            assert m["pagedllm:num_preemptions"] > 0
        assert_idle(llm)


def test_prefix_hits_keep_the_draft_cache(models):
    """A second request over the same prompt hits the target's blocks, and the draft's KV lives
    in those blocks too: still full acceptance with the target as its own draft."""
    prompt = list(range(1, 19))
    reference = _run(LLM(models["target"], enforce_eager=True, block_size=4), [prompt])
    llm = LLM(models["target"], enforce_eager=True, block_size=4, speculative_config=_spec(models["target"]))
    for _ in range(2):
        assert _run(llm, [prompt]) == reference
    m = llm.get_metrics()
    assert m["pagedllm:prefix_cache_hits"] >= 16
    assert m["pagedllm:spec_decode_num_accepted_tokens"] == m["pagedllm:spec_decode_num_draft_tokens"]
    assert_idle(llm)


def test_seeded_sampling_is_reproducible_and_logprobs_served(models):
    llm = LLM(models["target"], enforce_eager=True, speculative_config=_spec(models["other"]))
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=16, ignore_eos=True, logprobs=2)
              for s in range(4)]
    alone = [_token_ids(llm.generate([{"prompt_token_ids": PROMPTS[i]}], params[i], use_tqdm=False))[0]
             for i in range(4)]
    batched = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert _token_ids(batched) == alone  # the draws do not depend on the batch
    for out in batched:
        assert len(out.outputs[0].logprobs) == 16
        assert all(tok in entry for tok, entry in zip(out.outputs[0].token_ids, out.outputs[0].logprobs))


def test_sampling_keeps_the_target_distribution(models, tmp_path):
    """Joint distribution of the first 3 sampled tokens (a draft verified for the last two) with
    a draft that disagrees often, against the exact one from transformers' logits (chi-square,
    fixed seeds)."""
    target = _tiny_llama(tmp_path / "t8", 8, seed=3)
    draft = _tiny_llama(tmp_path / "d8", 8, seed=4, layers=1, hidden=16)
    llm = LLM(target, enforce_eager=True, max_num_seqs=256, speculative_config=_spec(draft, k=2))
    assert sampled_distribution_pvalue(llm, target, [1, 2, 3, 1, 2], vocab=8) > 1e-3


def test_a_draft_with_another_vocabulary_is_refused(models):
    with pytest.raises(ModelLoadError, match=r"vocabulary of 48 tokens .* 64"):
        LLM(models["target"], enforce_eager=True, speculative_config=_spec(models["small_vocab"]))


@pytest.mark.parametrize("spec, match", [
    ({"method": "draft_model", "num_speculative_tokens": 2}, "needs \"model\""),
    ({"method": "draft_model", "model": "x", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "draft_model", "model": "x", "num_speculative_tokens": 2, "prompt_lookup_max": 3},
     "unknown speculative_config keys"),
    ({"method": "eagle7", "num_speculative_tokens": 2}, "not supported"),
])
def test_bad_speculative_configs_name_what_to_change(spec, match):
    from pagedllm.speculative_config import SpeculativeConfig

    with pytest.raises(ValidationError, match=match):
        SpeculativeConfig.from_dict(spec)


def test_a_quantized_draft_of_the_same_weights(models):
    """The draft loads through the normal loaders with a weight format of its own."""
    reference = _run(LLM(models["target"], enforce_eager=True))
    spec = {**_spec(models["target"]), "quantization": "q8_0"}
    llm = LLM(models["target"], enforce_eager=True, speculative_config=spec)
    assert _run(llm) == reference
    m = llm.get_metrics()
    assert m["pagedllm:spec_decode_num_accepted_tokens"] > 0.8 * m["pagedllm:spec_decode_num_draft_tokens"]
    assert_idle(llm)


def test_the_draft_runs_in_the_worker_process(models):
    reference = _run(LLM(models["target"], enforce_eager=True))
    llm = LLM(models["target"], enforce_eager=True, distributed_executor_backend="mp",
              speculative_config=_spec(models["target"]))
    try:
        assert _run(llm) == reference
        m = llm.get_metrics()
        assert m["pagedllm:spec_decode_num_accepted_tokens"] == m["pagedllm:spec_decode_num_draft_tokens"] > 0
    finally:
        llm.llm_engine.shutdown()


def test_drafts_adapt_to_acceptance_and_switch_off_by_batch_size(models):
    reference = _run(LLM(models["target"], enforce_eager=True))
    proposed = {}
    for name, extra in (("fixed", {"adaptive_draft_length": False}), ("adaptive", {}),
                        ("off", {"disable_by_batch_size": 2})):
        llm = LLM(models["target"], enforce_eager=True,
                  speculative_config={**_spec(models["other"], k=4), **extra})
        assert _run(llm) == reference
        proposed[name] = llm.get_metrics()["pagedllm:spec_decode_num_draft_tokens"]
    # A draft that is almost never accepted: one draft a step instead of four.
    assert proposed["adaptive"] < 0.5 * proposed["fixed"]
    # 4 requests >= 2: no drafts until only one is left.
    assert proposed["off"] < 0.5 * proposed["fixed"]


def test_a_bad_speculative_config_is_refused_before_any_model_loads():
    from pagedllm.config import EngineConfig

    with pytest.raises(ValidationError, match="num_speculative_tokens"):
        EngineConfig.from_kwargs("no/such/model", speculative_config={"method": "draft_model", "model": "x"})


def test_sampled_n_and_structured_requests_with_a_draft():
    """The demo model as its own draft: sampled drafts come from q = p, so all are accepted
    (a wrong q would reject some); n > 1 samples draft on their own; a structured request is
    served without drafts."""
    from pagedllm import StructuredOutputsParams

    demo = str(ROOT.parent / "shared" / "models" / "stories260K" / "hf")
    llm = LLM(demo, enforce_eager=True, block_size=4, speculative_config=_spec(demo, k=3))
    sampled = SamplingParams(n=3, temperature=0.8, top_p=0.9, seed=5, max_tokens=20, ignore_eos=True)
    out = llm.generate(["Once upon a time"], sampled, use_tqdm=False)[0]
    assert len(out.outputs) == 3 and all(len(c.token_ids) == 20 for c in out.outputs)
    m = llm.get_metrics()
    assert m["pagedllm:spec_decode_num_accepted_tokens"] >= 0.99 * m["pagedllm:spec_decode_num_draft_tokens"] > 0
    choice = SamplingParams(temperature=0, max_tokens=10,
                            structured_outputs=StructuredOutputsParams(choice=["a dog", "a cat"]))
    text = llm.generate(["The pet was"], choice, use_tqdm=False)[0].outputs[0].text
    assert text in ("a dog", "a cat")
    assert_idle(llm)


def test_a_draft_shorter_than_max_model_len_is_refused(models, tmp_path):
    short = _tiny_llama(tmp_path / "short", 64, seed=5, layers=1, hidden=16, max_positions=128)
    with pytest.raises(ModelLoadError, match="lower max_model_len to 128"):
        LLM(models["target"], enforce_eager=True, speculative_config=_spec(short))


def test_draft_p_min_stops_unsure_drafts(models):
    """llama.cpp's rule: a request stops drafting at a draft its draft model is unsure of; the
    target then verifies fewer tokens, and only the drafts verified are counted."""
    reference = _run(LLM(models["target"], enforce_eager=True))
    counted = {}
    for name, draft, p_min in (("self", models["target"], 0.5), ("other", models["other"], None),
                               ("other_p_min", models["other"], 0.999)):
        spec = {**_spec(draft, k=4), "adaptive_draft_length": False}
        if p_min is not None:
            spec = {**_spec(draft, k=4), "draft_p_min": p_min}
        llm = LLM(models["target"], enforce_eager=True, speculative_config=spec)
        assert _run(llm) == reference
        m = llm.get_metrics()
        counted[name] = (m["pagedllm:spec_decode_num_draft_tokens"], m["pagedllm:spec_decode_num_accepted_tokens"])
        assert_idle(llm)
    assert counted["self"][0] == counted["self"][1] > 0  # sure and right: every draft verified is kept
    assert counted["other_p_min"][0] < 0.5 * counted["other"][0]
    with pytest.raises(ValidationError, match="set one"):
        LLM(models["target"], speculative_config={**_spec(models["other"]), "draft_p_min": 0.5,
                                                  "adaptive_draft_length": True})


@pytest.mark.parametrize("engine_args", [
    {}, {"max_num_batched_tokens": 6, "long_prefill_token_threshold": 4},
    {"num_gpu_blocks_override": 14, "block_size": 4, "max_num_seqs": 4},
], ids=["batch", "chunked", "preemption"])
def test_async_scheduling_with_a_draft_model(models, engine_args):
    """The draft model proposes after the token in flight; nothing is scheduled past a step
    that verifies drafts. Greedy output is the target's, every request ends cleanly."""
    reference = _run(LLM(models["target"], enforce_eager=True, **engine_args))
    for draft in (models["target"], models["other"]):
        llm = LLM(models["target"], enforce_eager=True, async_scheduling=True,
                  speculative_config=_spec(draft), **engine_args)
        assert _run(llm) == reference
        m = llm.get_metrics()
        assert m["pagedllm:spec_decode_num_draft_tokens"] > 0
        if draft == models["target"]:
            assert m["pagedllm:spec_decode_num_accepted_tokens"] == m["pagedllm:spec_decode_num_draft_tokens"]
        assert_idle(llm)


def test_aborts_mid_draft_leave_nothing_behind(models):
    llm = LLM(models["target"], enforce_eager=True, block_size=4, speculative_config=_spec(models["target"]))
    engine = llm.llm_engine
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, GREEDY)
    for _ in range(4):  # past the prefills, into verification steps
        engine.step()
    assert llm.get_metrics()["pagedllm:spec_decode_num_draft_tokens"] > 0
    engine.abort_request(["0", "2"])
    while engine.has_unfinished_requests():
        engine.step()
    assert_idle(llm)
    assert _run(llm, PROMPTS[:1]) == _run(LLM(models["target"], enforce_eager=True, block_size=4), PROMPTS[:1])


def test_beam_search_is_served_without_drafts(models):
    from pagedllm import BeamSearchParams

    params = BeamSearchParams(beam_width=3, max_tokens=12)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:2]]
    plain = LLM(models["target"], enforce_eager=True).beam_search(prompts, params)
    llm = LLM(models["target"], enforce_eager=True, speculative_config=_spec(models["other"]))
    spec = llm.beam_search(prompts, params)
    assert [[s.tokens for s in r.sequences] for r in spec] == [[s.tokens for s in r.sequences] for r in plain]
    assert llm.get_metrics()["pagedllm:spec_decode_num_draft_tokens"] == 0
    assert_idle(llm)


@pytest.mark.slow  # two worker processes
def test_the_draft_is_sharded_with_the_target_under_tensor_parallelism(models):
    reference = _run(LLM(models["target"], enforce_eager=True))
    llm = LLM(models["target"], enforce_eager=True, tensor_parallel_size=2, speculative_config=_spec(models["target"]))
    try:
        assert _run(llm) == reference
        m = llm.get_metrics()
        assert m["pagedllm:spec_decode_num_accepted_tokens"] == m["pagedllm:spec_decode_num_draft_tokens"] > 0
    finally:
        llm.llm_engine.shutdown()


def test_a_sliding_window_target_with_a_full_attention_draft(models, tmp_path):
    """The draft's layers join the target's KV cache groups by attention type: a full-attention
    draft beside a windowed target makes a full group of its own (the hybrid allocator)."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    cfg = MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                        sliding_window=8, tie_word_embeddings=False, bos_token_id=0, eos_token_id=63)
    model = MistralForCausalLM(cfg)
    with torch.no_grad():
        model.lm_head.weight.mul_(40.0)
    model.save_pretrained(tmp_path / "sw")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TOKENIZER / name, tmp_path / "sw" / name)
    target = str(tmp_path / "sw")
    prompts = [list(range(1, 20)), [5, 6, 7]]
    reference = _run(LLM(target, enforce_eager=True), prompts)
    for draft, full in ((target, True), (models["other"], False)):
        llm = LLM(target, enforce_eager=True, speculative_config=_spec(draft))
        assert _run(llm, prompts) == reference
        assert llm.llm_engine.engine_core.kv_cache_groups == ((8,) if full else (None, 8, 8))
        m = llm.get_metrics()
        assert (m["pagedllm:spec_decode_num_accepted_tokens"] == m["pagedllm:spec_decode_num_draft_tokens"]) == full
        assert_idle(llm)


def test_the_draft_only_mirrors_prompts_while_drafts_are_off(models):
    """disable_by_batch_size: steps where nobody drafts and everybody decodes one token run no
    draft forward; the prompts still go through the draft (their blocks may be shared)."""
    reference = _run(LLM(models["target"], enforce_eager=True))
    llm = LLM(models["target"], enforce_eager=True,
              speculative_config={**_spec(models["other"]), "disable_by_batch_size": 1})
    drafter = llm.llm_engine.engine_core.executor.runner.drafter
    forward, tokens = drafter._forward, []
    drafter._forward = lambda ids, *rest: tokens.append(len(ids)) or forward(ids, *rest)
    assert _run(llm) == reference
    assert sum(tokens) == sum(len(p) for p in PROMPTS)
    assert llm.get_metrics()["pagedllm:spec_decode_num_draft_tokens"] == 0
