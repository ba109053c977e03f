"""End to end on tiny random models of every supported family, against transformers:

* Llama with GQA and an untied lm_head; Qwen2 (q/k/v biases); Qwen3 (q/k norm, explicit head_dim);
  built in the test with torch.manual_seed, biases and norm weights randomised, vocab 32000
  (the synthetic tokenizer), saved with save_pretrained;
* prompt logprobs of a fixed sequence, inside a mixed batch of other requests and chunked by a
  small token budget, within 1e-4 of transformers' log_softmax;
* greedy generation equal to transformers' generate (up to a near-tie of the top two logits, where
  float rounding may legitimately pick either);
* sample logprobs (logprobs=3) equal to transformers' log_softmax at the sampled positions;
* prompt logprobs and greedy tokens still right when a tiny cache forces preemption.
"""
from __future__ import annotations

import random

import pytest
import torch

from pagedllm import LLM, SamplingParams

TOL = 1e-4
NEAR_TIE = 1e-3  # top-2 logit gap under which greedy float rounding may pick either token
EOS = frozenset({2})


def _random_ids(rng: random.Random, n: int) -> list[int]:
    return [1] + [rng.randrange(3, 32000) for _ in range(n - 1)]


@pytest.fixture(scope="module", params=["llama_gqa", "qwen2", "qwen3"])
def tiny(request, tiny_model_dirs):
    """(arch, HF model, pagedllm LLM with a 16-token step budget so prompts are chunked)."""
    from transformers import AutoModelForCausalLM

    arch = request.param
    folder = tiny_model_dirs[arch]
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    llm = LLM(str(folder), device="cpu", dtype="float32", max_num_batched_tokens=16,
              long_prefill_token_threshold=12, block_size=8)
    yield arch, hf, llm
    del llm


def _hf_greedy_with_gaps(hf, prompt_ids: list[int], max_new_tokens: int):
    """HF greedy tokens (up to and including EOS) and the top-2 logit gap at each step."""
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids),
                          dtype=torch.long), do_sample=False, max_new_tokens=max_new_tokens,
                          eos_token_id=sorted(EOS), pad_token_id=0, output_logits=True,
                          return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt_ids):].tolist()
    gaps = []
    for step_logits in out.logits:
        top2 = step_logits[0].float().topk(2).values
        gaps.append(float(top2[0] - top2[1]))
    n = len(tokens)
    for i, t in enumerate(tokens):
        if t in EOS:
            n = i + 1
            break
    return tokens[:n], gaps[:n]


def _check_logprob_entry(entry: dict, token: int, hf_row: torch.Tensor, k: int, where: str) -> None:
    """One position's {token id: Logprob}: the given token (with its rank) and the top-k."""
    assert token in entry, f"{where}: token {token} missing from {entry}"
    value = float(hf_row[token])
    got = entry[token]
    assert abs(got.logprob - value) < TOL, f"{where}: logprob {got.logprob} vs HF {value}"
    lo = 1 + int((hf_row > value + 1e-5).sum())
    hi = 1 + int((hf_row > value - 1e-5).sum())
    assert lo <= got.rank <= hi, f"{where}: rank {got.rank}, HF says {lo}..{hi}"
    for tok, lp in entry.items():
        assert abs(lp.logprob - float(hf_row[tok])) < TOL, f"{where}: token {tok}"
    # The top-k entries carry ranks 1..k (the given token is one of them when its rank <= k).
    top = sorted((lp for lp in entry.values() if lp.rank <= k), key=lambda lp: -lp.logprob)
    assert len(entry) in (k, k + 1), f"{where}: {len(entry)} entries for k={k}"
    hf_top = hf_row.topk(k).values.tolist() if k else []
    assert len(top) == k, f"{where}: expected {k} top entries, got {entry}"
    for lp, ref in zip(top, hf_top):
        assert abs(lp.logprob - ref) < TOL, (where, [x.logprob for x in top], hf_top)
    assert sorted(lp.rank for lp in top) == list(range(1, k + 1))


@pytest.mark.parametrize("k", [0, 5])
def test_prompt_logprobs_in_mixed_chunked_batch(tiny, e2e, k):
    arch, hf, llm = tiny
    rng = random.Random(1234)
    target = _random_ids(rng, 45)
    others = [_random_ids(rng, n) for n in (3, 21, 34, 60)]
    prompts = [others[0], others[1], target, others[2], others[3]]
    params = [
        SamplingParams(temperature=0.0, max_tokens=9, prompt_logprobs=2),
        SamplingParams(temperature=1.0, seed=7, max_tokens=5),
        SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=k),
        SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=1, logprobs=2),
        SamplingParams(temperature=0.8, top_k=5, max_tokens=12, prompt_logprobs=0),
    ]
    # Twice: the second time the prompts' blocks are in the prefix cache, and prompt logprobs
    # must still cover every position.
    for _ in range(2):
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        for prompt, sp, out in zip(prompts, params, outputs):
            if sp.prompt_logprobs is None:
                assert out.prompt_logprobs is None
                continue
            lps = out.prompt_logprobs
            assert lps is not None and len(lps) == len(prompt)
            assert lps[0] is None
            hf_rows = e2e.hf_log_softmax(hf, prompt)
            for pos in range(1, len(prompt)):
                _check_logprob_entry(lps[pos], prompt[pos], hf_rows[pos - 1], sp.prompt_logprobs,
                                     f"{arch} prompt of {len(prompt)} pos {pos}")
        e2e.assert_engine_idle(llm)


def test_prompt_logprobs_and_greedy_under_preemption(tiny, tiny_model_dirs, e2e):
    """A cache too small for the batch: requests are preempted and recomputed (prompt logprobs
    included) and still agree with transformers."""
    arch, hf, _ = tiny
    llm = LLM(str(tiny_model_dirs[arch]), device="cpu", block_size=4, num_gpu_blocks_override=40,
              max_num_seqs=4, max_num_batched_tokens=16)
    rng = random.Random(77)
    prompts = [_random_ids(rng, n) for n in (50, 31, 44, 38)]
    params = [SamplingParams(temperature=0.0, max_tokens=24 + 2 * i, prompt_logprobs=1,
                             ignore_eos=True) for i in range(4)]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert llm.get_metrics()["pagedllm:num_preemptions"] > 0
    for prompt, sp, out in zip(prompts, params, outputs):
        hf_rows = e2e.hf_log_softmax(hf, prompt)
        assert out.prompt_logprobs[0] is None
        for pos in range(1, len(prompt)):
            _check_logprob_entry(out.prompt_logprobs[pos], prompt[pos], hf_rows[pos - 1], 1,
                                 f"{arch} prompt of {len(prompt)} pos {pos}")
        tokens = out.outputs[0].token_ids
        assert len(tokens) == sp.max_tokens
        # Greedy: every token is the argmax of transformers' logits on the same context
        # (unless the top two are within a hair of each other).
        rows = e2e.hf_log_softmax(hf, prompt + tokens)
        for i, tok in enumerate(tokens):
            row = rows[len(prompt) - 1 + i]
            top2 = row.topk(2).values
            assert tok == int(row.argmax()) or float(top2[0] - top2[1]) < NEAR_TIE, (arch, i)
    e2e.assert_engine_idle(llm)


def test_greedy_matches_hf_generate(tiny, e2e):
    arch, hf, llm = tiny
    rng = random.Random(99)
    prompts = [_random_ids(rng, n) for n in (2, 13, 40)]
    max_tokens = 16
    # A batch together with sampled requests, chunked by the 16-token budget.
    filler = [SamplingParams(temperature=1.0, max_tokens=20, seed=i) for i in range(3)]
    batch = prompts + [_random_ids(rng, n) for n in (7, 30, 19)]
    params = [SamplingParams(temperature=0.0, max_tokens=max_tokens)] * 3 + filler
    outputs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    compared = 0
    for prompt, out in zip(prompts, outputs[:3]):
        expected, gaps = _hf_greedy_with_gaps(hf, prompt, max_tokens)
        got = out.outputs[0].token_ids
        n = next((i for i, g in enumerate(gaps) if g < NEAR_TIE), len(expected))
        if n == len(expected):
            assert got == expected, f"{arch}: prompt of {len(prompt)}"
        else:  # a near-tie at step n: everything before it must agree
            assert got[:n] == expected[:n], f"{arch}: prompt of {len(prompt)}"
        compared += n
    assert compared >= 20, "too many near-ties: the comparison says little"
    e2e.assert_engine_idle(llm)


def test_sample_logprobs_match_hf(tiny, e2e):
    arch, hf, llm = tiny
    rng = random.Random(5)
    prompts = [_random_ids(rng, n) for n in (6, 27)]
    params = [SamplingParams(temperature=1.0, seed=11, logprobs=3, max_tokens=10),
              SamplingParams(temperature=0.0, logprobs=0, max_tokens=10)]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, sp, out in zip(prompts, params, outputs):
        completion = out.outputs[0]
        tokens = completion.token_ids
        assert completion.logprobs is not None and len(completion.logprobs) == len(tokens)
        hf_rows = e2e.hf_log_softmax(hf, prompt + tokens)
        total = 0.0
        for i, tok in enumerate(tokens):
            row = hf_rows[len(prompt) - 1 + i]
            _check_logprob_entry(completion.logprobs[i], tok, row, sp.logprobs,
                                 f"{arch} output pos {i}")
            total += float(row[tok])
        assert completion.cumulative_logprob == pytest.approx(total, abs=1e-3)
    # The seeded sample is not just the argmax: its ranks show the sampler really sampled.
    assert any(lp[t].rank > 1 for lp, t in zip(outputs[0].outputs[0].logprobs,
                                                 outputs[0].outputs[0].token_ids))
    e2e.assert_engine_idle(llm)


def test_text_prompt_uses_the_model_tokenizer(tiny, tiny_model_dirs, e2e):
    from transformers import AutoTokenizer

    arch, hf, llm = tiny
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dirs[arch])
    text = "hello world, this is a tiny model"
    out = llm.generate(text, SamplingParams(temperature=0.0, max_tokens=6), use_tqdm=False)[0]
    assert out.prompt == text
    assert out.prompt_token_ids == tokenizer(text).input_ids
    expected, gaps = _hf_greedy_with_gaps(hf, out.prompt_token_ids, 6)
    n = next((i for i, g in enumerate(gaps) if g < NEAR_TIE), len(expected))
    assert out.outputs[0].token_ids[:n] == expected[:n]
    e2e.assert_engine_idle(llm)
