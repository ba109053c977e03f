"""End to end sampling on the demo model: seeded reproducibility whatever the batch, n > 1,
the distribution of sampled tokens against the one computed from transformers' logits
(top-k, top-p, min-p; chi-square), min_tokens, stop strings and stop token ids, logit_bias,
penalties (repetition_penalty token for token against transformers' generate; presence and
frequency penalties against a reference loop over transformers' logits), the engine seed.
"""
from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams

ONCE = [1, 403, 407, 261, 378]  # "Once upon a time"
TOM_AND = [1, 274, 287, 269]  # "Tom and": a flat next-token distribution
NUM_DRAWS = 1500  # per variant


@pytest.fixture(scope="module")
def llm(demo_model_path):
    return LLM(demo_model_path, device="cpu", max_num_seqs=1024, max_num_batched_tokens=4096)


def _ids(prompt_ids: list[int]) -> dict:
    return {"prompt_token_ids": list(prompt_ids)}


def _greedy_tokens(llm, prompt_ids, max_tokens, **kw) -> list[int]:
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)
    return llm.generate(_ids(prompt_ids), sp, use_tqdm=False)[0].outputs[0].token_ids


# ----------------------------------------------------------------------------------------------
# Seeds
# ----------------------------------------------------------------------------------------------
def test_seeded_sample_is_independent_of_batch_and_preemption(demo_model_path, llm, e2e,
                                                             hf_demo_model):
    target = SamplingParams(seed=1234, temperature=1.0, top_p=0.9, max_tokens=40, ignore_eos=True)
    alone = llm.generate(_ids(ONCE), target, use_tqdm=False)[0].outputs[0].token_ids
    assert len(alone) == 40
    assert llm.generate(_ids(ONCE), target, use_tqdm=False)[0].outputs[0].token_ids == alone

    # In a batch of 8 others (greedy, unseeded, other seeds, other lengths), in the middle.
    others = [(ONCE, SamplingParams(temperature=1.0, max_tokens=30)),
              ([1, 291], SamplingParams(temperature=0.0, max_tokens=50)),
              (TOM_AND, SamplingParams(seed=1, temperature=0.7, top_k=20, max_tokens=45)),
              (ONCE + [432], SamplingParams(seed=1234, temperature=1.0, top_p=0.9, max_tokens=40)),
              ([1, 346, 394, 261] * 5, SamplingParams(temperature=1.5, max_tokens=20)),
              ([1], SamplingParams(seed=99, temperature=1.0, min_p=0.1, max_tokens=60)),
              (ONCE, SamplingParams(temperature=1.0, top_p=0.9, max_tokens=40)),
              ([1, 342], SamplingParams(temperature=0.0, presence_penalty=1.0, max_tokens=33))]
    prompts = [_ids(p) for p, _ in others]
    params = [sp for _, sp in others]
    prompts.insert(4, _ids(ONCE))
    params.insert(4, target)
    batched = llm.generate(prompts, params, use_tqdm=False)
    assert batched[4].outputs[0].token_ids == alone
    # The greedy rows of the mixed batch are exact.
    assert batched[1].outputs[0].token_ids == e2e.hf_greedy(hf_demo_model, [1, 291], 50)
    e2e.assert_engine_idle(llm)

    # Under preemption and chunked prefill (a separate engine with a tiny cache); the target is
    # admitted last, so FCFS picks it as the victim first.
    small = LLM(demo_model_path, device="cpu", block_size=4, num_gpu_blocks_override=36,
                max_num_seqs=8, max_num_batched_tokens=8)
    prompts.append(prompts.pop(4))
    params.append(params.pop(4))
    preempted = small.generate(prompts, params, use_tqdm=False)
    assert small.get_metrics()["pagedllm:num_preemptions"] > 0
    assert preempted[-1].outputs[0].token_ids == alone
    # Every seeded or greedy request in the batch reproduces too.
    for i, sp in enumerate(params[:-1]):
        if sp.seed is not None or sp.temperature == 0.0:
            j = i if i < 4 else i + 1
            assert preempted[i].outputs[0].token_ids == batched[j].outputs[0].token_ids, i
    e2e.assert_engine_idle(small)


def test_n_samples_with_seed_are_distinct_and_reproducible(demo_model_path, llm, e2e):
    sp = SamplingParams(n=3, seed=42, temperature=1.0, max_tokens=24, ignore_eos=True)
    first = llm.generate(_ids(ONCE), sp, use_tqdm=False)[0]
    assert [c.index for c in first.outputs] == [0, 1, 2]
    samples = [tuple(c.token_ids) for c in first.outputs]
    assert all(len(s) == 24 for s in samples)
    assert len(set(samples)) == 3, samples
    again = llm.generate([_ids(ONCE), _ids(TOM_AND)], [sp, sp], use_tqdm=False)[0]
    assert [tuple(c.token_ids) for c in again.outputs] == samples
    e2e.assert_engine_idle(llm)
    # Shared prompt blocks, copy-on-write and preemption in a tiny cache: the same samples.
    small = LLM(demo_model_path, device="cpu", block_size=4, num_gpu_blocks_override=24,
                max_num_seqs=6, max_num_batched_tokens=8)
    batch = small.generate([_ids(ONCE), _ids(TOM_AND), _ids(ONCE)], [sp, sp, sp], use_tqdm=False)
    assert small.get_metrics()["pagedllm:num_preemptions"] > 0
    assert [tuple(c.token_ids) for c in batch[0].outputs] == samples
    assert [tuple(c.token_ids) for c in batch[2].outputs] == samples
    e2e.assert_engine_idle(small)


@pytest.mark.parametrize("prompt", [ONCE, ONCE + [432, 383, 286]], ids=["5 tokens", "8 tokens"])
def test_n_samples_see_their_own_tokens(llm, hf_demo_model, e2e, prompt):
    """The n samples share the prompt's blocks (the partial last one too, copy-on-write): each
    sample's logprobs must still be those of its own context, per transformers."""
    sp = SamplingParams(n=4, seed=7, temperature=1.2, max_tokens=20, logprobs=0, ignore_eos=True)
    out = llm.generate(_ids(prompt), sp, use_tqdm=False)[0]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    for c in out.outputs:
        rows = e2e.hf_log_softmax(hf_demo_model, prompt + c.token_ids)
        for i, (tok, lp) in enumerate(zip(c.token_ids, c.logprobs)):
            ref = float(rows[len(prompt) - 1 + i, tok])
            assert abs(lp[tok].logprob - ref) < 1e-4, (c.index, i)
    e2e.assert_engine_idle(llm)


def test_unseeded_samples_differ(llm, e2e):
    sp = SamplingParams(temperature=1.0, max_tokens=32, ignore_eos=True)
    first = llm.generate(_ids(ONCE), sp, use_tqdm=False)[0].outputs[0].token_ids
    second = llm.generate(_ids(ONCE), sp, use_tqdm=False)[0].outputs[0].token_ids
    assert first != second
    batch = llm.generate([_ids(ONCE)] * 4, sp, use_tqdm=False)
    assert len({tuple(o.outputs[0].token_ids) for o in batch}) > 1
    e2e.assert_engine_idle(llm)


# ----------------------------------------------------------------------------------------------
# The distribution of the first sampled token
# ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tom_and_logits(hf_demo_model) -> torch.Tensor:
    with torch.no_grad():
        return hf_demo_model(torch.tensor([TOM_AND])).logits[0, -1].double()


def _analytical(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0,
                min_p: float = 0.0) -> dict[int, float]:
    """The sampling distribution as the spec defines it (vLLM's order: temperature, top-k, top-p,
    min-p), in float64; asserts that no token sits within a hair of a cut-off."""
    probs = torch.softmax(logits / temperature, dim=-1)
    order = probs.argsort(descending=True).tolist()
    keep = order[:top_k] if top_k else order
    if top_p < 1.0:
        mass = probs[keep] / probs[keep].sum()
        above = torch.cumsum(mass, 0) - mass  # mass strictly above each token
        assert not torch.isclose(above, torch.tensor(top_p, dtype=above.dtype), atol=0.01).any()
        keep = [t for t, a in zip(keep, above.tolist()) if a < top_p]
    if min_p > 0.0:
        mass = probs[keep] / probs[keep].sum()
        threshold = min_p * float(mass.max())
        assert not torch.isclose(mass, torch.tensor(threshold, dtype=mass.dtype), rtol=0.05).any()
        keep = [t for t, m in zip(keep, mass.tolist()) if m >= threshold]
    total = float(probs[keep].sum())
    return {t: float(probs[t]) / total for t in keep}


VARIANTS = [
    {"temperature": 1.3, "top_k": 3, "seeded": True},
    # Temperatures != 1 so that filtering before the temperature would change the kept set.
    {"temperature": 1.3, "min_p": 0.25, "seeded": True},
    {"temperature": 0.8, "top_p": 0.8, "seeded": False},  # the global generator's path
    {"temperature": 1.3, "top_k": 5, "top_p": 0.6, "seeded": True},  # top-k, then top-p
]


def test_first_token_distribution_matches_hf(llm, tom_and_logits, e2e):
    """NUM_DRAWS requests per variant, all variants interleaved in one batch (so every row of a
    step has its own parameters), max_tokens=1; chi-square against the distribution computed from
    transformers' logits."""
    from scipy.stats import chisquare

    variants = []
    for v in VARIANTS:
        v = dict(v)
        seeded = v.pop("seeded")
        variants.append((v, seeded, _analytical(tom_and_logits, **v)))
    params = [SamplingParams(max_tokens=1, seed=i if seeded else None, **v)
              for i in range(NUM_DRAWS) for v, seeded, _ in variants]
    outputs = llm.generate([_ids(TOM_AND)] * len(params), params, use_tqdm=False)
    failures = []
    for k, (v, _, expected) in enumerate(variants):
        assert 3 <= len(expected) <= 6, (v, expected)
        counts: dict[int, int] = {}
        for out in outputs[k::len(variants)]:
            (tok,) = out.outputs[0].token_ids
            counts[tok] = counts.get(tok, 0) + 1
        outside = {t: n for t, n in counts.items() if t not in expected}
        if outside:
            failures.append(f"{v}: sampled tokens outside {sorted(expected)}: {outside}")
            continue
        tokens = sorted(expected)
        observed = [counts.get(t, 0) for t in tokens]
        exp_counts = [expected[t] * NUM_DRAWS for t in tokens]
        assert min(exp_counts) >= 5
        pvalue = chisquare(observed, exp_counts).pvalue
        if pvalue <= 1e-3:
            failures.append(f"{v}: p={pvalue:.2e} observed {observed} expected "
                            f"{[round(x, 1) for x in exp_counts]} for tokens {tokens}")
    assert not failures, "\n".join(failures)
    e2e.assert_engine_idle(llm)


# ----------------------------------------------------------------------------------------------
# Stopping
# ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def near_the_end(llm, demo_tokenizer, e2e) -> tuple[list[int], list[int]]:
    """A prompt whose greedy continuation ends with EOS after 5 tokens (the end of a story)."""
    prompt = demo_tokenizer("The cat sat on the mat.").input_ids
    story = _greedy_tokens(llm, prompt, 200)
    assert story[-1] in e2e.DEMO_EOS_IDS and len(story) > 10
    prompt = prompt + story[:-6]
    ending = story[-6:]
    assert _greedy_tokens(llm, prompt, 20) == ending
    return prompt, ending


def test_min_tokens_holds_back_eos(llm, near_the_end, e2e):
    prompt, ending = near_the_end
    eos = e2e.DEMO_EOS_IDS
    got = _greedy_tokens(llm, prompt, 20, min_tokens=12)
    assert got[:5] == ending[:5]
    assert len(got) >= 12 and not eos & set(got[:12])
    # Sampled too: whatever the seed, no EOS before min_tokens.
    params = [SamplingParams(temperature=1.0, seed=s, min_tokens=8, max_tokens=10)
              for s in range(16)]
    unconstrained = [sp.clone(min_tokens=0) for sp in params]
    outs = llm.generate([_ids(prompt)] * 32, params + unconstrained, use_tqdm=False)
    for out in outs[:16]:
        assert len(out.outputs[0].token_ids) >= 8
        assert not eos & set(out.outputs[0].token_ids[:8])
    # ... while without min_tokens, some of the same samples do end early.
    assert any(len(o.outputs[0].token_ids) < 8 for o in outs[16:])
    e2e.assert_engine_idle(llm)


def test_stop_strings(llm, e2e):
    full = llm.generate(_ids(ONCE), SamplingParams(temperature=0.0, max_tokens=32),
                        use_tqdm=False)[0].outputs[0]
    text = full.text
    assert text.startswith(", there was a little girl named Lily.")
    # A stop string that occurs only in the prompt does not stop anything.
    sp = SamplingParams(temperature=0.0, max_tokens=32, stop=["time", "Once"])
    out = llm.generate(_ids(ONCE), sp, use_tqdm=False)[0].outputs[0]
    assert out.text == text and out.finish_reason == "length" and out.stop_reason is None
    cases = [("Lily", False), ("Lily", True), ("e was", False), (["park", "girl"], False)]
    for stop, include in cases:
        sp = SamplingParams(temperature=0.0, max_tokens=32, stop=stop,
                            include_stop_str_in_output=include)
        out = llm.generate(_ids(ONCE), sp, use_tqdm=False)[0].outputs[0]
        first = "girl" if isinstance(stop, list) else stop
        cut = text.index(first) + (len(first) if include else 0)
        assert out.text == text[:cut], (stop, include)
        assert out.finish_reason == "stop"
        assert out.stop_reason == first
        assert out.token_ids == full.token_ids[:len(out.token_ids)]
        assert len(out.token_ids) < len(full.token_ids)
    e2e.assert_engine_idle(llm)


def test_min_tokens_holds_back_stop_strings_and_stop_token_ids(llm, e2e):
    """min_tokens comes first among the stop checks: a stop string or stop token id completed
    before min_tokens tokens does not end the request (vLLM: the detokenizer skips stop strings
    until min_tokens; stop token ids are masked like EOS)."""
    full = llm.generate(_ids(ONCE), SamplingParams(temperature=0.0, max_tokens=32),
                        use_tqdm=False)[0].outputs[0]
    assert full.text.count("Lily") == 1 and full.finish_reason == "length"
    lily_end = next(i for i in range(32)
                    if "Lily" in llm.get_tokenizer().decode(full.token_ids[:i + 1]))
    assert lily_end < 12
    # A stop string that completes before min_tokens is ignored; none occurs later.
    sp = SamplingParams(temperature=0.0, max_tokens=32, stop="Lily", min_tokens=20)
    out = llm.generate(_ids(ONCE), sp, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) >= 20, (len(out.token_ids), out.text, out.stop_reason)
    assert out.token_ids == full.token_ids and out.text == full.text
    assert out.finish_reason == "length" and out.stop_reason is None
    # A stop token id that is the greedy choice before min_tokens is masked out.
    first = full.token_ids[0]
    out = llm.generate(_ids(ONCE), SamplingParams(temperature=0.0, max_tokens=8, min_tokens=3,
                                                  stop_token_ids=[first]), use_tqdm=False)[0]
    tokens = out.outputs[0].token_ids
    assert len(tokens) >= 3 and first not in tokens[:3]
    e2e.assert_engine_idle(llm)


def test_stop_strings_with_n_samples(llm, e2e):
    sp = SamplingParams(n=4, seed=21, temperature=1.0, max_tokens=40, stop=[".", "!"])
    out = llm.generate(_ids(ONCE), sp, use_tqdm=False)[0]
    assert len(out.outputs) == 4
    for c in out.outputs:
        assert "." not in c.text and "!" not in c.text
        if c.finish_reason == "stop":
            assert c.stop_reason in (".", "!", None)
        else:
            assert c.finish_reason == "length" and len(c.token_ids) == 40
    assert any(c.stop_reason in (".", "!") for c in out.outputs)
    e2e.assert_engine_idle(llm)


def test_stop_token_ids(llm, e2e):
    full = _greedy_tokens(llm, ONCE, 32)
    i = next(i for i in range(4, 20) if full[i] not in full[:i])
    stop_id = full[i]
    out = llm.generate(_ids(ONCE), SamplingParams(temperature=0.0, max_tokens=32,
                                                   stop_token_ids=[stop_id]), use_tqdm=False)[0]
    completion = out.outputs[0]
    assert completion.token_ids == full[:i + 1]
    assert completion.finish_reason == "stop"
    assert completion.stop_reason == stop_id
    shorter = llm.generate(_ids(ONCE), SamplingParams(temperature=0.0, max_tokens=i),
                           use_tqdm=False)[0].outputs[0]
    assert completion.text == shorter.text  # the stop token itself is not shown
    e2e.assert_engine_idle(llm)


def test_eos_ends_with_stop_reason_none(llm, near_the_end):
    prompt, ending = near_the_end
    out = llm.generate(_ids(prompt), SamplingParams(temperature=0.0, max_tokens=20),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == ending
    assert out.finish_reason == "stop" and out.stop_reason is None
    sp = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    ignored = llm.generate(_ids(prompt), sp, use_tqdm=False)[0].outputs[0]
    assert len(ignored.token_ids) == 20 and ignored.finish_reason == "length"


# ----------------------------------------------------------------------------------------------
# Logit bias and penalties
# ----------------------------------------------------------------------------------------------
def test_logit_bias(llm, golden_cases, e2e):
    forced = 300
    for sp in (SamplingParams(temperature=0.0, max_tokens=8, logit_bias={forced: 100.0}),
               SamplingParams(temperature=1.0, seed=3, max_tokens=8, logit_bias={forced: 100.0})):
        assert llm.generate(_ids(ONCE), sp, use_tqdm=False)[0].outputs[0].token_ids == [forced] * 8
    # A -100 bias on the greedy token leaves the second best (golden top-5 at the last position).
    case = next(c for c in golden_cases if c["prompt_ids"] == ONCE)
    best, second = case["last_pos_top5_ids"][:2]
    got = _greedy_tokens(llm, ONCE, 1, logit_bias={best: -100.0})
    assert got == [second]
    e2e.assert_engine_idle(llm)


def test_penalties_change_the_output(llm, demo_tokenizer):
    prompt = demo_tokenizer("The cat sat on the mat.").input_ids
    plain = _greedy_tokens(llm, prompt, 40)
    assert len(set(plain)) < len(plain)  # repetitive: penalties have something to act on
    for kw in ({"presence_penalty": 1.5}, {"frequency_penalty": 1.0}, {"repetition_penalty": 1.5}):
        penalized = _greedy_tokens(llm, prompt, 40, **kw)
        assert penalized != plain, kw
    # Negative presence/frequency penalties favour repetition: fewer distinct tokens.
    repeated = _greedy_tokens(llm, prompt, 40, frequency_penalty=-1.0, ignore_eos=True)
    assert len(set(repeated)) <= len(set(plain))


def _reference_penalized_greedy(hf, prompt, max_tokens, presence, frequency, eos) -> list[int]:
    """Greedy with OpenAI/vLLM presence and frequency penalties (over the output tokens only),
    computed from transformers' logits with a plain loop."""
    out: list[int] = []
    for _ in range(max_tokens):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + out])).logits[0, -1].double()
        counts = torch.zeros_like(logits)
        for t in out:
            counts[t] += 1
        logits = logits - frequency * counts - presence * (counts > 0).double()
        tok = int(logits.argmax())
        out.append(tok)
        if tok in eos:
            break
    return out


def test_presence_and_frequency_penalties_match_reference(llm, demo_tokenizer, hf_demo_model, e2e):
    prompts = [demo_tokenizer("The cat sat on the mat.").input_ids, ONCE]
    for presence, frequency in ((0.6, 0.0), (0.0, 0.4), (0.5, 0.3)):
        sp = SamplingParams(temperature=0.0, max_tokens=30, presence_penalty=presence,
                            frequency_penalty=frequency)
        outputs = llm.generate([_ids(p) for p in prompts], sp, use_tqdm=False)
        for prompt, out in zip(prompts, outputs):
            expected = _reference_penalized_greedy(hf_demo_model, prompt, 30, presence, frequency,
                                                   e2e.DEMO_EOS_IDS)
            assert out.outputs[0].token_ids == expected, (presence, frequency)
    e2e.assert_engine_idle(llm)


def test_repetition_penalty_matches_hf(llm, demo_tokenizer, hf_demo_model, e2e):
    prompts = [ONCE, [1], demo_tokenizer("The cat sat on the mat.").input_ids,
               demo_tokenizer("Lily and Ben were friends. They liked to play").input_ids]
    sp = SamplingParams(temperature=0.0, max_tokens=48, repetition_penalty=1.3)
    outputs = llm.generate([_ids(p) for p in prompts], sp, use_tqdm=False)
    for prompt, out in zip(prompts, outputs):
        expected = e2e.hf_greedy(hf_demo_model, prompt, 48, repetition_penalty=1.3)
        assert out.outputs[0].token_ids == expected
    e2e.assert_engine_idle(llm)


def test_engine_seed_makes_unseeded_runs_reproducible(demo_model_path):
    sp = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True)
    runs = []
    for seed in (5, 5, 6):
        engine = LLM(demo_model_path, device="cpu", seed=seed)
        runs.append(engine.generate([_ids(ONCE)] * 2, sp, use_tqdm=False))
    tokens = [[o.outputs[0].token_ids for o in run] for run in runs]
    assert tokens[0] == tokens[1]
    assert tokens[0] != tokens[2]
    assert tokens[0][0] != tokens[0][1]  # two unseeded requests of one batch differ
