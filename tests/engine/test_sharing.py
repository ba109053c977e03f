"""Issue 6: parallel sampling by fork + copy-on-write, beam search, n-gram speculative decoding.

End to end on the demo model (transformers is the reference) and on a tiny random Llama.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from pagedllm import LLM, BeamSearchParams, SamplingParams

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT.parent / "shared" / "models" / "stories260K" / "hf"
GOLDEN = json.loads((DEMO.parent / "golden_greedy.json").read_text())
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


@pytest.fixture(scope="module")
def hf_demo():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(DEMO), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def demo_llm():
    return LLM(str(DEMO), block_size=4)


def _case_prompts() -> list[list[int]]:
    return [c["prompt_ids"] for c in GOLDEN["cases"]]


# -- parallel sampling ---------------------------------------------------------------------------

def test_parallel_sampling_prefills_once_and_shares_blocks(demo_llm):
    prompt = _case_prompts()[1] * 3  # 15 tokens: 3 full blocks + a partial one (block_size 4)
    engine = demo_llm.llm_engine
    before = demo_llm.get_metrics()["pagedllm:prompt_tokens_computed"]
    demo_llm.reset_prefix_cache()
    params = SamplingParams(n=8, temperature=1.0, seed=11, max_tokens=12, ignore_eos=True)
    engine.add_request("par", {"prompt_token_ids": prompt}, params)
    peak_blocks = 0
    result = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                result = out
        kv = engine.scheduler.kv_cache_manager
        peak_blocks = max(peak_blocks, kv.num_blocks - kv.block_pool.get_num_free_blocks())
        engine.scheduler.check_integrity()
    computed = demo_llm.get_metrics()["pagedllm:prompt_tokens_computed"] - before
    # Once, not 8 times: each forked sample recomputes only the last prompt token, to sample its
    # own first token.
    assert computed == len(prompt) + 7
    # 4 prompt blocks shared; each child owns the copy of the partial block plus what it adds:
    # 15 + 12 tokens -> 7 blocks per sequence, of which the 3 full prompt blocks are shared.
    assert peak_blocks <= 3 + 8 * 4
    assert peak_blocks < 8 * 7  # far below 8 private copies
    assert len(result.outputs) == 8 and [c.index for c in result.outputs] == list(range(8))
    assert demo_llm.get_metrics()["pagedllm:kv_cache_usage_perc"] == 0.0
    # Child i reproduces an independent request seeded with seed + i.
    for i in (0, 3, 7):
        alone = demo_llm.generate({"prompt_token_ids": prompt},
                                  SamplingParams(temperature=1.0, seed=11 + i, max_tokens=12, ignore_eos=True),
                                  use_tqdm=False)[0]
        assert alone.outputs[0].token_ids == result.outputs[i].token_ids


def test_parallel_sampling_greedy_children_equal_and_abort_frees(demo_llm):
    prompt = _case_prompts()[2]
    out = demo_llm.generate({"prompt_token_ids": prompt}, SamplingParams(n=3, temperature=0, max_tokens=10),
                            use_tqdm=False)[0]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 1
    engine = demo_llm.llm_engine
    engine.add_request("ab", {"prompt_token_ids": prompt}, SamplingParams(n=4, max_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()
    engine.abort_request("ab")
    engine.abort_request("ab")  # idempotent
    assert not engine.has_unfinished_requests()
    assert demo_llm.get_metrics()["pagedllm:kv_cache_usage_perc"] == 0.0


def test_parallel_sampling_under_preemption():
    llm = LLM(str(DEMO), block_size=4, num_gpu_blocks_override=24, max_num_seqs=8)
    prompts = [{"prompt_token_ids": p} for p in _case_prompts()]
    params = SamplingParams(n=3, temperature=0.8, seed=5, max_tokens=24, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.get_metrics()["pagedllm:num_preemptions"] > 0
    roomy = LLM(str(DEMO), block_size=4)
    ref = roomy.generate(prompts, params, use_tqdm=False)
    for a, b in zip(outs, ref):
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert llm.get_metrics()["pagedllm:kv_cache_usage_perc"] == 0.0


# -- beam search --------------------------------------------------------------------------------

@pytest.mark.parametrize("width", [2, 3, 4])
@pytest.mark.parametrize("length_penalty", [1.0, 0.6])
def test_beam_search_matches_transformers(demo_llm, hf_demo, width, length_penalty):
    max_tokens = 24
    prompts = _case_prompts()[:3]
    results = demo_llm.beam_search([{"prompt_token_ids": p} for p in prompts],
                                   BeamSearchParams(beam_width=width, max_tokens=max_tokens,
                                                    length_penalty=length_penalty))
    for prompt, res in zip(prompts, results):
        ref = hf_demo.generate(torch.tensor([prompt]), num_beams=width, do_sample=False,
                               length_penalty=length_penalty, max_new_tokens=max_tokens,
                               output_scores=True, return_dict_in_generate=True, pad_token_id=0)
        ref_ids = ref.sequences[0].tolist()[len(prompt):]
        best = res.sequences[0]
        assert best.tokens[:len(prompt)] == prompt
        mine = best.tokens[len(prompt):]
        assert mine == ref_ids[:len(mine)] and all(t == 0 for t in ref_ids[len(mine):])
        assert abs(best.score - ref.sequences_scores[0].item()) < 1e-4
        assert len(res.sequences) == width
        assert [s.score for s in res.sequences] == sorted((s.score for s in res.sequences), reverse=True)
    assert demo_llm.get_metrics()["pagedllm:kv_cache_usage_perc"] == 0.0


def test_beam_search_with_eos_matches_transformers(demo_llm, hf_demo):
    # Long enough for the story to end: beams finish on EOS (ids 1 and 2) at different lengths,
    # which exercises the finished list and transformers' early-stopping heuristic.
    start = demo_llm.get_tokenizer()("Lily said sorry. Her mom hugged her.").input_ids
    story = demo_llm.generate({"prompt_token_ids": start}, SamplingParams(temperature=0, max_tokens=300),
                              use_tqdm=False)[0].outputs[0]
    assert story.finish_reason == "stop"  # the greedy story ends (after ~200 tokens)
    prompt = start + story.token_ids[:-12]  # a dozen tokens before its end
    ref = hf_demo.generate(torch.tensor([prompt]), num_beams=3, do_sample=False, max_new_tokens=40,
                           output_scores=True, return_dict_in_generate=True, pad_token_id=0)
    res = demo_llm.beam_search([{"prompt_token_ids": prompt}], BeamSearchParams(beam_width=3, max_tokens=40))[0]
    best = res.sequences[0]
    ref_ids = ref.sequences[0].tolist()[len(prompt):]
    mine = best.tokens[len(prompt):]
    assert mine == ref_ids[:len(mine)] and all(t == 0 for t in ref_ids[len(mine):])
    assert abs(best.score - ref.sequences_scores[0].item()) < 1e-4
    assert best.finish_reason == "stop" and mine[-1] in (1, 2)


def test_beam_search_under_memory_pressure_matches_roomy(demo_llm):
    # 20 blocks of 4 tokens for 8 beams of up to 25 tokens: beams must be preempted (40 were
    # enough for all of them, and the test then compared two roomy runs).
    tight = LLM(str(DEMO), block_size=4, num_gpu_blocks_override=20, max_num_seqs=8)
    prompts = [{"prompt_token_ids": p} for p in _case_prompts()]
    params = BeamSearchParams(beam_width=3, max_tokens=20)
    a = tight.beam_search(prompts, params)
    b = demo_llm.beam_search(prompts, params)
    for x, y in zip(a, b, strict=True):
        assert [s.tokens for s in x.sequences] == [s.tokens for s in y.sequences]
    m = tight.get_metrics()
    assert m["pagedllm:num_preemptions"] > 0  # the pressure was real: beams were preempted
    assert m["pagedllm:kv_cache_usage_perc"] == 0.0


# -- speculative decoding -----------------------------------------------------------------------

def _repetitive_prompts(llm: LLM) -> list[list[int]]:
    tok = llm.get_tokenizer()
    text = "Once upon a time, there was a little dog. The little dog liked to play. The little dog"
    return [tok(text).input_ids, tok(text + " liked to play. The little").input_ids] + _case_prompts()


@pytest.mark.parametrize("engine_args", [
    {},
    {"max_num_batched_tokens": 8, "long_prefill_token_threshold": 4},
    {"num_gpu_blocks_override": 30, "max_num_seqs": 6},
])
def test_speculative_greedy_identical_on_demo_model(engine_args):
    plain = LLM(str(DEMO), block_size=4, **engine_args)
    spec = LLM(str(DEMO), block_size=4, speculative_config=SPEC, **engine_args)
    prompts = [{"prompt_token_ids": p} for p in _repetitive_prompts(plain)]
    params = SamplingParams(temperature=0, max_tokens=48)
    a = plain.generate(prompts, params, use_tqdm=False)
    b = spec.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    m = spec.get_metrics()
    assert m["pagedllm:spec_decode_num_draft_tokens"] > 0
    assert m["pagedllm:spec_decode_num_accepted_tokens"] > 0
    assert m["pagedllm:kv_cache_usage_perc"] == 0.0


def _tiny_llama(path: Path, vocab: int) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=False, bos_token_id=0, eos_token_id=vocab - 1)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # sharper distributions than the default init, so drafts get accepted
        model.lm_head.weight.mul_(40.0)
    model.save_pretrained(path)
    tok = ROOT.parent / "shared" / "models" / "synthetic-tokenizer-32k"
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tok / name, path / name)
    return path


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return _tiny_llama(tmp_path_factory.mktemp("tiny-llama"), vocab=8)


def test_speculative_greedy_identical_on_tiny_model(tiny_llama):
    prompts = [{"prompt_token_ids": [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]}, {"prompt_token_ids": [5, 6, 5, 6, 5]},
               {"prompt_token_ids": [3] * 11}]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    for args in ({}, {"max_num_batched_tokens": 6}, {"num_gpu_blocks_override": 14, "block_size": 4}):
        a = LLM(str(tiny_llama), **args).generate(prompts, params, use_tqdm=False)
        spec = LLM(str(tiny_llama), speculative_config=SPEC, **args)
        b = spec.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
        assert spec.get_metrics()["pagedllm:spec_decode_num_accepted_tokens"] > 0


def test_speculative_sampling_keeps_the_distribution(tiny_llama):
    """Joint distribution of the first 3 sampled tokens, with and without speculation, against
    the exact one computed from transformers' logits (chi-square, fixed seeds)."""
    from scipy.stats import chisquare
    from transformers import AutoModelForCausalLM

    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    temp = 1.5
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32).eval()
    vocab = 8
    exact: dict[tuple[int, ...], float] = {}

    def expand(prefix: list[int], prob: float, depth: int) -> None:
        if depth == 3:
            exact[tuple(prefix[len(prompt):])] = prob
            return
        with torch.no_grad():
            logits = hf(torch.tensor([prefix])).logits[0, -1].float()
        p = torch.softmax(logits / temp, dim=-1)
        for t in range(vocab):
            expand(prefix + [t], prob * p[t].item(), depth + 1)

    expand(list(prompt), 1.0, 0)
    n = 3000
    for spec_cfg in (None, {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3,
                            "prompt_lookup_min": 1}):
        llm = LLM(str(tiny_llama), speculative_config=spec_cfg, max_num_seqs=256)
        outs = llm.generate([{"prompt_token_ids": prompt}] * n,
                            [SamplingParams(temperature=temp, seed=s, max_tokens=3, ignore_eos=True)
                             for s in range(n)], use_tqdm=False)
        counts: dict[tuple[int, ...], int] = {}
        for o in outs:
            key = tuple(o.outputs[0].token_ids)
            counts[key] = counts.get(key, 0) + 1
        # Pool the rare outcomes so every expected count is >= 5.
        keys = sorted(exact, key=lambda k: -exact[k])
        big = [k for k in keys if exact[k] * n >= 5]
        obs = [counts.get(k, 0) for k in big] + [n - sum(counts.get(k, 0) for k in big)]
        exp = [exact[k] * n for k in big] + [n * (1 - sum(exact[k] for k in big))]
        p_value = chisquare(obs, exp).pvalue
        assert p_value > 1e-3, (spec_cfg, p_value)
        if spec_cfg:
            m = llm.get_metrics()
            assert m["pagedllm:spec_decode_num_accepted_tokens"] > 0
