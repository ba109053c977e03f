"""SamplingMetadata built from scratch from each row's SamplingParams: the independent reference
the runner's persistent sampling rows (runner/sampling_batch.py) are checked against."""
from __future__ import annotations

import torch

from pagedllm.runner.logits_processors import token_counts
from pagedllm.runner.sampler import SamplingMetadata
from pagedllm.sampling_params import SamplingParams

_SAMPLING_EPS = 1e-5


def reference_metadata(
    params: list[SamplingParams],
    prompt_token_ids: list[list[int]],
    output_token_ids: list[list[int]],
    generators: list[torch.Generator | None],
    stop_ids_to_mask: list[frozenset[int]],
    vocab_size: int,
    device: torch.device | str,
) -> SamplingMetadata:
    num_rows = len(params)
    assert len(prompt_token_ids) == len(output_token_ids) == len(generators) == num_rows
    assert len(stop_ids_to_mask) == num_rows
    V = vocab_size
    greedy = [p.temperature < _SAMPLING_EPS for p in params]
    all_greedy, all_random = all(greedy), not any(greedy)

    def f32(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32, device=device)

    temperature = top_k = top_p = min_p = random_rows = None
    gens: dict[int, torch.Generator] = {}
    if not all_greedy:
        temperature = f32([1.0 if g else p.temperature for p, g in zip(params, greedy)])
        if not all_random:
            random_rows = [i for i, g in enumerate(greedy) if not g]
        # Greedy rows never reach the filters, so they count as neutral here.
        ks = [V if g or p.top_k <= 0 else min(p.top_k, V) for p, g in zip(params, greedy)]
        if any(k < V for k in ks):
            top_k = torch.tensor(ks, dtype=torch.int64, device=device)
        ps = [1.0 if g else p.top_p for p, g in zip(params, greedy)]
        if any(p < 1.0 for p in ps):
            top_p = f32(ps)
        mps = [0.0 if g else p.min_p for p, g in zip(params, greedy)]
        if any(m > 0.0 for m in mps):
            min_p = f32(mps)
        gens = {i: gen for i, gen in enumerate(generators) if gen is not None and not greedy[i]}

    biased = _in_vocab([p.logit_bias or {} for p in params], V)
    logit_bias = None
    if biased:
        logit_bias = (_i64([i for i, _ in biased], device), _i64([t for _, t in biased], device),
                      f32([params[i].logit_bias[t] for i, t in biased]))

    masked = _in_vocab(stop_ids_to_mask, V)
    min_tokens_mask = None
    if masked:
        min_tokens_mask = (_i64([i for i, _ in masked], device), _i64([t for _, t in masked], device))

    rep = [p.repetition_penalty for p in params]
    freq = [p.frequency_penalty for p in params]
    pres = [p.presence_penalty for p in params]
    use_rep = [r != 1.0 for r in rep]
    use_out = [u or f != 0.0 or q != 0.0 for u, f, q in zip(use_rep, freq, pres)]
    repetition_penalty = frequency_penalty = presence_penalty = None
    prompt_mask = output_counts = None
    if any(use_out):
        repetition_penalty, frequency_penalty, presence_penalty = f32(rep), f32(freq), f32(pres)
        output_counts = token_counts(output_token_ids, use_out, V, device)
        if any(use_rep):
            prompt_mask = token_counts(prompt_token_ids, use_rep, V, device) > 0

    num_logprobs = [p.logprobs for p in params]
    wanted = [n for n in num_logprobs if n is not None]
    return SamplingMetadata(
        vocab_size=V,
        all_greedy=all_greedy,
        all_random=all_random,
        random_rows=random_rows,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        generators=gens,
        logit_bias=logit_bias,
        min_tokens_mask=min_tokens_mask,
        repetition_penalty=repetition_penalty,
        frequency_penalty=frequency_penalty,
        presence_penalty=presence_penalty,
        prompt_mask=prompt_mask,
        output_counts=output_counts,
        num_logprobs=num_logprobs,
        max_num_logprobs=max(wanted) if wanted else None,
    )


def _in_vocab(per_row: list, vocab_size: int) -> list[tuple[int, int]]:
    """(row, token id) of every id of each row's collection that lies in the vocabulary."""
    return [(i, tok) for i, ids in enumerate(per_row) for tok in ids if 0 <= tok < vocab_size]


def _i64(values: list[int], device: torch.device | str) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)
