"""Sampler: logits processors against hand-written references, seeded reproducibility, and
chi-square goodness-of-fit of the sampled distributions against analytical ones."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.runner import logits_processors
from pagedllm.runner.logits_processors import apply_top_k_top_p
from pagedllm.runner.sampler import (
    Sampler,
    apply_logits_processors,
    compute_topk_logprobs,
)
from pagedllm.sampling_params import SamplingParams
from tests.runner.sampling_reference import reference_metadata

NEG_INF = float("-inf")


def build(params, vocab_size, prompts=None, outputs=None, generators=None, masks=None, device="cpu"):
    n = len(params)
    return reference_metadata(
        params,
        prompts if prompts is not None else [[] for _ in range(n)],
        outputs if outputs is not None else [[] for _ in range(n)],
        generators if generators is not None else [None] * n,
        masks if masks is not None else [frozenset()] * n,
        vocab_size,
        device,
    )


def assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    # torch.testing takes seconds to import; this is all we need.
    assert got.shape == want.shape and torch.allclose(got, want, rtol=1e-5, atol=1e-6), (got, want)


def seeded(seed: int, device: str = "cpu") -> torch.Generator:
    return torch.Generator(device).manual_seed(seed)


# ---------------------------------------------------------------- greedy, bias, min_tokens


def test_greedy_is_argmax_and_fast_path_builds_nothing():
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    md = build([SamplingParams(temperature=0.0)] * 6, 50)
    assert md.all_greedy and md.temperature is None and md.output_counts is None
    assert md.top_k is None and md.logit_bias is None and md.max_num_logprobs is None
    out = Sampler()(logits, md)
    assert out.sampled_token_ids == logits.argmax(-1).tolist()
    assert out.logprobs is None


def test_greedy_rows_in_a_mixed_batch_ignore_filters_and_noise():
    torch.manual_seed(1)
    logits = torch.randn(8, 40)
    params = [
        SamplingParams(temperature=0.0, top_k=3, top_p=0.5) if i % 2 else SamplingParams(temperature=1.5)
        for i in range(8)
    ]
    before = logits.clone()
    for _ in range(20):
        out = Sampler()(logits, build(params, 40))
        for i in range(1, 8, 2):
            assert out.sampled_token_ids[i] == int(logits[i].argmax())
    assert torch.equal(logits, before), "the sampler must not modify its input"


def test_logit_bias_forces_and_forbids_tokens():
    torch.manual_seed(2)
    logits = torch.randn(4, 30)
    low0, low2 = int(logits[0].argmin()), int(logits[2].argmin())
    top1, second1 = logits[1].topk(2).indices.tolist()
    params = [
        SamplingParams(temperature=0.0, logit_bias={low0: 100.0}),
        SamplingParams(temperature=0.0, logit_bias={top1: -100.0, 10_000: 5.0}),  # 10_000: ignored
        SamplingParams(temperature=1.0, logit_bias={low2: 100.0}),
        SamplingParams(temperature=0.0),
    ]
    for _ in range(10):
        out = Sampler()(logits, build(params, 30)).sampled_token_ids
        assert out[:3] == [low0, second1, low2]
        assert out[3] == int(logits[3].argmax())


def test_min_tokens_mask_forbids_listed_ids():
    V = 12
    logits = torch.zeros(2000, V)
    logits[:, 3] = 5.0  # the "EOS" dominates
    logits[:, 7] = 4.0  # a stop token id
    masks = [frozenset({3, 7})] * 1000 + [frozenset()] * 1000
    # rows 0 and 1999 greedy, the rest random
    params = [SamplingParams(temperature=0.0)] + [SamplingParams(temperature=1.0)] * 1998
    params.append(SamplingParams(temperature=0.0))
    torch.manual_seed(3)
    out = torch.tensor(Sampler()(logits, build(params, V, masks=masks)).sampled_token_ids)
    assert out[0] != 3 and out[0] != 7  # greedy row with the mask
    assert not torch.isin(out[:1000], torch.tensor([3, 7])).any()
    assert (out[1000:] == 3).sum() > 500  # unmasked rows still pick the dominant token
    assert out[-1] == 3


# ---------------------------------------------------------------- penalties


def reference_penalties(logits, params, prompts, outputs):
    out = logits.clone()
    for i, p in enumerate(params):
        row = out[i].tolist()
        seen = set(prompts[i]) | set(outputs[i])
        for t in seen:
            if p.repetition_penalty != 1.0:
                row[t] = row[t] / p.repetition_penalty if row[t] > 0 else row[t] * p.repetition_penalty
        for t in set(outputs[i]):
            row[t] -= p.frequency_penalty * outputs[i].count(t) + p.presence_penalty
        out[i] = torch.tensor(row)
    return out


def test_penalties_match_reference_on_hand_made_logits():
    logits = torch.tensor(
        [
            [2.0, -1.0, 0.5, -0.5, 3.0, 0.0],
            [2.0, -1.0, 0.5, -0.5, 3.0, 0.0],
            [2.0, -1.0, 0.5, -0.5, 3.0, 0.0],
            [2.0, -1.0, 0.5, -0.5, 3.0, 0.0],
        ]
    )
    params = [
        SamplingParams(repetition_penalty=2.0),
        SamplingParams(frequency_penalty=0.5),
        SamplingParams(presence_penalty=1.5, frequency_penalty=-0.25, repetition_penalty=0.5),
        SamplingParams(),  # neutral row in a penalized batch
    ]
    prompts = [[0, 1], [0, 1], [0, 5], [0, 1, 4]]
    outputs = [[2, 3, 3], [4, 4, 4, 1], [1, 1, 2], [4, 4]]
    got = apply_logits_processors(logits, build(params, 6, prompts, outputs))
    want = reference_penalties(logits, params, prompts, outputs)
    assert_close(got, want)
    # Spot checks written out by hand, so the reference itself is checked.
    assert got[0].tolist() == [1.0, -2.0, 0.25, -1.0, 3.0, 0.0]
    assert got[1].tolist() == [2.0, -1.5, 0.5, -0.5, 1.5, 0.0]
    assert got[3].tolist() == logits[3].tolist()


@settings(max_examples=25, deadline=None)
@given(
    data=st.data(),
    rep=st.sampled_from([1.0, 0.5, 1.3, 2.0]),
    freq=st.sampled_from([0.0, -1.0, 0.7]),
    pres=st.sampled_from([0.0, 2.0, -0.3]),
)
def test_penalties_match_reference_random(data, rep, freq, pres):
    V = 10
    prompt = data.draw(st.lists(st.integers(0, V - 1), max_size=8))
    output = data.draw(st.lists(st.integers(0, V - 1), max_size=8))
    seed = data.draw(st.integers(0, 2**16))
    logits = torch.randn(2, V, generator=seeded(seed))
    params = [
        SamplingParams(repetition_penalty=rep, frequency_penalty=freq, presence_penalty=pres),
        SamplingParams(repetition_penalty=1.1),
    ]
    prompts, outputs = [prompt, output], [output, prompt]
    got = apply_logits_processors(logits, build(params, V, prompts, outputs))
    assert_close(got, reference_penalties(logits, params, prompts, outputs))


def test_bias_then_mask_then_penalty_order():
    logits = torch.tensor([[1.0, 1.0, 1.0, 1.0]])
    params = [SamplingParams(logit_bias={0: 3.0, 1: 2.0}, repetition_penalty=2.0, presence_penalty=1.0)]
    md = build(params, 4, prompts=[[0]], outputs=[[1]], masks=[frozenset({2})])
    got = apply_logits_processors(logits, md)[0].tolist()
    # token 0: (1+3)/2; token 1: (1+2)/2 - 1; token 2: masked; token 3: untouched
    assert got == [2.0, 0.5, NEG_INF, 1.0]


# ---------------------------------------------------------------- seeded reproducibility


def run_steps(rows, num_steps, V=64, global_seed=0, device="cpu"):
    """rows: list of (SamplingParams, seed or None). Returns tokens per row, per step.

    The logits of a row at a step depend only on (its key, the step), never on the batch."""
    torch.manual_seed(global_seed)
    gens = [seeded(s, device) if s is not None else None for _, s in rows]
    history = [[] for _ in rows]
    for step in range(num_steps):
        logits = torch.stack(
            [torch.randn(V, generator=seeded(1000 * step + (s if s is not None else 7))) for _, s in rows]
        ).to(device)
        md = build([p for p, _ in rows], V, outputs=history, generators=gens, device=device)
        for h, t in zip(history, Sampler()(logits, md).sampled_token_ids):
            h.append(t)
    return history


@pytest.mark.parametrize("width", [256, 4])
def test_seeded_row_is_independent_of_batch_and_position(width, monkeypatch):
    # width 4: the top-p cut is decided from 4 candidates for some rows, redone for others
    monkeypatch.setattr(logits_processors, "_TOP_P_WIDTH", width)
    a = (SamplingParams(temperature=1.3, seed=11), 11)
    b = (SamplingParams(temperature=0.9, top_p=0.9, seed=22), 22)
    c = (SamplingParams(temperature=1.0, top_k=20, min_p=0.01, seed=33, presence_penalty=0.5), 33)
    unseeded = (SamplingParams(temperature=1.0, top_k=5), None)
    greedy = (SamplingParams(temperature=0.0), None)
    steps = 12
    alone = {key: run_steps([row], steps)[0] for key, row in zip("abc", (a, b, c))}
    assert len({tuple(v) for v in alone.values()}) == 3
    batches = [
        ("ab", [a, b]),
        ("bua", [b, unseeded, a]),
        ("ugcuab", [unseeded, greedy, c, unseeded, a, b]),
        ("cguuuuba", [c, greedy, unseeded, unseeded, unseeded, unseeded, b, a]),
    ]
    for global_seed, (names, rows) in enumerate(batches, start=5):
        got = run_steps(rows, steps, global_seed=global_seed)
        for name, tokens in zip(names, got):
            if name in alone:
                assert tokens == alone[name], (names, name)


def test_unseeded_rows_follow_the_global_rng():
    row = (SamplingParams(temperature=1.0), None)
    first = run_steps([row], 10, global_seed=1)
    assert run_steps([row], 10, global_seed=1) == first
    assert run_steps([row], 10, global_seed=2) != first


# ---------------------------------------------------------------- distributions

LOGITS8 = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
NUM_SAMPLES = 20_000


def analytical(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    """The target distribution, step by step in plain Python: scale, top-k, top-p, min-p."""
    z = [x / temperature for x in LOGITS8.tolist()]
    keep = set(range(len(z)))
    order = sorted(keep, key=lambda i: -z[i])

    def probs(kept):
        m = max(z[i] for i in kept)
        w = {i: math.exp(z[i] - m) for i in kept}
        s = sum(w.values())
        return {i: w[i] / s for i in kept}

    if top_k:
        keep = set(order[:top_k])
    if top_p < 1.0:
        p, mass, nucleus = probs(keep), 0.0, set()
        for i in (j for j in order if j in keep):
            nucleus.add(i)
            mass += p[i]
            if mass >= top_p:
                break
        keep = nucleus
    if min_p > 0.0:
        p = probs(keep)
        pmax = max(p.values())
        keep = {i for i in keep if p[i] >= min_p * pmax}
    p = probs(keep)
    return [p.get(i, 0.0) for i in range(len(z))]


def chi_square_pvalue(counts, expected_probs):
    """Pearson goodness-of-fit over the tokens with nonzero probability; p from the chi2 tail."""
    n = sum(counts)
    cells = [(c, n * p) for c, p in zip(counts, expected_probs) if p > 0]
    stat = sum((c - e) ** 2 / e for c, e in cells)
    df = len(cells) - 1
    if df == 0:
        return 1.0
    # P(chi2_df > stat) = Q(df/2, stat/2), the regularized upper incomplete gamma function.
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def draw(params: SamplingParams, n=NUM_SAMPLES, with_generators=False, seed=0):
    torch.manual_seed(seed)
    gens = [seeded(10_000 * seed + i) for i in range(n)] if with_generators else None
    md = build([params] * n, 8, generators=gens)
    tokens = Sampler()(LOGITS8.expand(n, 8), md).sampled_token_ids
    return torch.bincount(torch.tensor(tokens), minlength=8).tolist()


CASES = {
    "temperature": dict(temperature=0.7),
    "top_k": dict(top_k=3),
    "top_p": dict(top_p=0.85),
    "min_p": dict(min_p=0.15),
    "combined": dict(temperature=0.8, top_k=6, top_p=0.9, min_p=0.1),
    "hot": dict(temperature=2.5, top_k=7),
    # top-k first, then top-p over the renormalized top 3 (0.506, 0.307, 0.186) keeps 2 tokens
    "top_k_then_top_p": dict(top_k=3, top_p=0.8),
    "top_k_with_loose_top_p": dict(top_k=3, top_p=0.95),
}


# Top-p cases also run with fewer candidates than the vocabulary: width 4 decides from the
# candidates for most cases, width 2 falls back to the whole vocabulary.
WIDTH_CASES = [(name, 256) for name in CASES] + [
    (name, w) for name in ("top_p", "top_k_then_top_p") for w in (4, 2)
]


@pytest.mark.parametrize("name,width", WIDTH_CASES)
def test_sampled_distribution_matches_analytical(name, width, monkeypatch):
    monkeypatch.setattr(logits_processors, "_TOP_P_WIDTH", width)
    kwargs = CASES[name]
    expected = analytical(**kwargs)
    counts = draw(SamplingParams(**kwargs), seed=len(name))
    assert all(c == 0 for c, p in zip(counts, expected) if p == 0.0), (counts, expected)
    assert 0 < sum(p == 0.0 for p in expected) or name in ("temperature",), "case excludes nothing"
    assert chi_square_pvalue(counts, expected) > 1e-3, (counts, expected)


def test_analytical_reference_excludes_what_it_should():
    # Hand-checked boundaries so a wrong reference cannot hide a wrong sampler.
    assert [p > 0 for p in analytical(top_k=3)] == [True] * 3 + [False] * 5
    # softmax(LOGITS8) = 0.405, 0.245, 0.149, 0.090, ... -> cumulative 0.405, 0.650, 0.799, 0.889
    assert sum(p > 0 for p in analytical(top_p=0.85)) == 4
    assert sum(p > 0 for p in analytical(top_p=0.75)) == 3
    # min_p=0.15 keeps exp(l - 2) >= 0.15, i.e. l >= 2 + ln 0.15 = 0.103
    assert sum(p > 0 for p in analytical(min_p=0.15)) == 4


def reference_top_k_top_p(row: list[float], k: int, p: float) -> set[int]:
    order = sorted(range(len(row)), key=lambda i: -row[i])
    kept = order[:k] if k else order
    m = max(row)
    w = [math.exp(row[i] - m) for i in kept]
    total, mass, nucleus = sum(w), 0.0, set()
    for i, wi in zip(kept, w):
        nucleus.add(i)
        mass += wi / total
        if mass >= p:
            break
    return nucleus


@pytest.mark.parametrize("width", [2, 8, 40, 256])
def test_top_k_top_p_matches_a_sorting_reference(width, monkeypatch):
    monkeypatch.setattr(logits_processors, "_TOP_P_WIDTH", width)
    g = seeded(width)
    B, V = 300, 40
    logits = torch.randn(B, V, generator=g) * 2
    ks = torch.randint(0, 30, (B,), generator=g)  # 0: no top-k
    ks[::7] = 0
    ps = torch.rand(B, generator=g).clamp(min=0.05)
    ps[::5] = 1.0
    top_k = torch.where(ks == 0, V, ks)
    got = apply_top_k_top_p(logits, top_k, ps)
    for i in range(B):
        kept = set(torch.nonzero(got[i] > float("-inf")).squeeze(1).tolist())
        assert kept == reference_top_k_top_p(logits[i].tolist(), int(ks[i]), float(ps[i])), i
        assert torch.equal(got[i][list(kept)], logits[i][list(kept)])
    # top-k alone: the partial top-k path
    got = apply_top_k_top_p(logits, top_k, None)
    for i in range(B):
        assert int((got[i] > float("-inf")).sum()) == (int(ks[i]) or V)


def test_tiny_top_p_keeps_the_top_token():
    assert analytical(top_p=1e-8) == [1.0] + [0.0] * 7
    logits = LOGITS8.flip(0).expand(500, 8)  # the top token is last, not at index 0
    md = build([SamplingParams(top_p=1e-8)] * 500, 8)
    assert Sampler()(logits, md).sampled_token_ids == [7] * 500


@pytest.mark.parametrize(
    "groups",
    [
        # no top-p anywhere: the partial top-k path, with rows of different k and rows without
        [dict(top_k=2), dict(top_k=5, temperature=1.5), dict(temperature=0.5), dict(min_p=0.3)],
        # top-p in the batch: the candidate path (and its fallback with width 2)
        [dict(top_k=2), dict(top_k=5, temperature=1.5), dict(temperature=0.5), dict(top_p=0.7, min_p=0.5)],
    ],
    ids=["top_k_only", "top_p"],
)
def test_mixed_batch_rows_each_follow_their_own_params(groups, monkeypatch):
    monkeypatch.setattr(logits_processors, "_TOP_P_WIDTH", 2)  # top-p rows: candidates, then fallback
    per_group = 4000
    params = [SamplingParams(**groups[i % len(groups)]) for i in range(per_group * len(groups))]
    torch.manual_seed(21)
    md = build(params, 8)
    tokens = torch.tensor(Sampler()(LOGITS8.expand(len(params), 8), md).sampled_token_ids)
    for g, kwargs in enumerate(groups):
        counts = torch.bincount(tokens[g :: len(groups)], minlength=8).tolist()
        expected = analytical(**kwargs)
        assert all(c == 0 for c, p in zip(counts, expected) if p == 0.0), (kwargs, counts)
        assert chi_square_pvalue(counts, expected) > 1e-3, (kwargs, counts, expected)


def test_seeded_rows_sample_the_right_distribution():
    kwargs = dict(temperature=0.7, top_p=0.95)
    counts = draw(SamplingParams(**kwargs), n=8000, with_generators=True, seed=3)
    assert chi_square_pvalue(counts, analytical(**kwargs)) > 1e-3, counts


def test_chi_square_detects_a_wrong_distribution():
    counts = draw(SamplingParams(temperature=1.0), seed=9)
    assert chi_square_pvalue(counts, analytical(temperature=1.0)) > 1e-3
    assert chi_square_pvalue(counts, analytical(temperature=0.7)) < 1e-6
    assert chi_square_pvalue(counts, analytical(temperature=1.1)) < 1e-6
    assert counts[7] > 0  # the rarest token (p = 0.0027) does show up without truncation


# ---------------------------------------------------------------- logprobs


def test_logprobs_are_raw_with_ranks_and_sampled_token_first():
    torch.manual_seed(4)
    V = 30
    logits = torch.randn(5, V)
    forced = int(logits[1].argsort()[3])  # a low-ranked token, forced by logit_bias
    params = [
        SamplingParams(temperature=0.0),  # no logprobs
        SamplingParams(temperature=0.0, logprobs=4, logit_bias={forced: 100.0}, repetition_penalty=1.5),
        SamplingParams(temperature=0.6, top_k=5, logprobs=0),
        SamplingParams(temperature=1.0, logprobs=20, presence_penalty=2.0),
        SamplingParams(temperature=0.0, logprobs=2),
    ]
    md = build(params, V, prompts=[[1, 2]] * 5, outputs=[[3, 4, 4]] * 5)
    out = Sampler()(logits, md)
    raw = torch.log_softmax(logits, dim=-1)
    assert out.logprobs[0] is None
    assert out.sampled_token_ids[1] == forced
    for i in range(1, 5):
        ids, lps, ranks = out.logprobs[i]
        k = params[i].logprobs
        assert len(ids) == len(lps) == len(ranks) == k + 1
        assert ids[0] == out.sampled_token_ids[i]
        assert_close(torch.tensor(lps), raw[i, ids])
        assert ids[1:] == raw[i].argsort(descending=True)[:k].tolist()
        assert ranks[1:] == list(range(1, k + 1))
        assert ranks[0] == int((raw[i] > raw[i, ids[0]]).sum()) + 1
    assert out.logprobs[1][2][0] == V - 3  # the forced token is the 4th least likely
    assert out.logprobs[4][2][0] == 1  # greedy without processing: rank 1


def test_compute_topk_logprobs_for_prompt_tokens():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0], [3.0, 2.0, 1.0, 0.0]])
    out = compute_topk_logprobs(logits, [0, 1], 2)
    lse = math.log(sum(math.exp(x) for x in range(4)))
    ids, lps, ranks = out[0]
    assert ids == [0, 3, 2] and ranks == [4, 1, 2]
    assert lps == pytest.approx([0.0 - lse, 3.0 - lse, 2.0 - lse], abs=1e-6)
    ids, lps, ranks = out[1]
    assert ids == [1, 0, 1] and ranks == [2, 1, 2]
    # ties share the better rank
    ids, lps, ranks = compute_topk_logprobs(torch.tensor([[1.0, 1.0, 0.0]]), [1], 1)[0]
    assert ranks[0] == 1 and lps[0] == pytest.approx(lps[1])
    # per-row k, and k = 0 gives only the given token
    out = compute_topk_logprobs(logits, torch.tensor([2, 3]), [0, 1])
    assert out[0][0] == [2] and out[0][2] == [2]
    assert out[1][0] == [3, 0] and out[1][2] == [4, 1]


# ---------------------------------------------------------------- CUDA (skipped without a GPU)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_seeded_rows_and_distribution():
    a = (SamplingParams(temperature=1.3, seed=11), 11)
    b = (SamplingParams(temperature=0.9, top_p=0.9, top_k=30, seed=22, logprobs=3), 22)
    unseeded = (SamplingParams(temperature=1.0, top_k=5), None)
    alone = [run_steps([row], 8, device="cuda")[0] for row in (a, b)]
    got = run_steps([unseeded, b, unseeded, a], 8, global_seed=3, device="cuda")
    assert [got[3], got[1]] == alone
    kwargs = dict(temperature=0.8, top_k=6, top_p=0.9, min_p=0.1)
    n = NUM_SAMPLES
    gens = [seeded(i, "cuda") if i % 2 else None for i in range(n)]  # half seeded, half global
    md = build([SamplingParams(**kwargs)] * n, 8, generators=gens, device="cuda")
    tokens = Sampler()(LOGITS8.cuda().expand(n, 8), md).sampled_token_ids
    counts = torch.bincount(torch.tensor(tokens), minlength=8).tolist()
    expected = analytical(**kwargs)
    assert all(c == 0 for c, p in zip(counts, expected) if p == 0.0), counts
    assert chi_square_pvalue(counts, expected) > 1e-3, (counts, expected)
