"""Logits processing and sampling, run by the model runner once per step.

Order (as vLLM): logit_bias -> min_tokens mask -> repetition penalty -> frequency/presence
penalties -> greedy argmax, or temperature -> top-k -> top-p -> min-p -> exponential-race draw.
Logprobs come from the raw logits (vLLM's default ``raw_logprobs`` mode).

A seeded row draws its noise from its own ``torch.Generator`` only, so its tokens do not depend on
the rest of the batch or on its row index; unseeded rows share the global RNG.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from pagedllm.runner.logits_processors import (
    apply_min_p,
    apply_penalties,
    apply_top_k_top_p,
)

# (token_ids, logprobs, ranks): entry 0 is the chosen token, entries 1..k the top-k by logprob.
LogprobsEntry = tuple[list[int], list[float], list[int]]


@dataclass(slots=True)
class SamplingMetadata:
    """Per-step tensors for a batch of B rows. A field is None when no row uses its feature."""

    vocab_size: int
    all_greedy: bool
    all_random: bool
    random_rows: list[int] | None  # the random rows of a mixed batch; None when all_greedy or all_random
    temperature: torch.Tensor | None  # [B] float32, greedy rows hold 1.0; None when all_greedy
    top_k: torch.Tensor | None  # [B] int64 in [1, V]; rows without top-k hold V
    top_p: torch.Tensor | None  # [B] float32; rows without top-p hold 1.0
    min_p: torch.Tensor | None  # [B] float32; rows without min-p hold 0.0
    generators: dict[int, torch.Generator]  # row -> its own generator (random rows only)
    # Sparse (row, token) -> value edits; out-of-vocabulary ids are dropped at build time.
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    min_tokens_mask: tuple[torch.Tensor, torch.Tensor] | None
    # Penalties: [B] factors plus the token statistics they need (only rows that use them filled).
    repetition_penalty: torch.Tensor | None  # [B]; 1.0 = neutral
    frequency_penalty: torch.Tensor | None  # [B]; 0.0 = neutral
    presence_penalty: torch.Tensor | None  # [B]; 0.0 = neutral
    prompt_mask: torch.Tensor | None  # [B, V] bool: token occurs in the prompt
    output_counts: torch.Tensor | None  # [B, V] float32: occurrences in the output so far
    num_logprobs: list[int | None]  # per row: SamplingParams.logprobs
    max_num_logprobs: int | None  # None: no row wants logprobs


_ARGMAX_CHUNK = 128
# Below this many logits the scalar loop is shorter than the chunked path's operators.
_ARGMAX_SCALAR_MAX = 1 << 15


def greedy_sample(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` for [B, V], the same indices (the first maximum wins), faster.

    torch's CPU argmax is a scalar loop, while a max is vectorised:
    take the max of every 128-wide chunk, the first chunk holding the row's maximum, then the
    argmax inside that chunk only. Falls back to argmax when V is not a multiple of 128."""
    num_rows, vocab = logits.shape
    num_chunks = vocab // _ARGMAX_CHUNK
    if (logits.device.type != "cpu" or num_chunks < 2 or vocab % _ARGMAX_CHUNK
            or num_rows * vocab < _ARGMAX_SCALAR_MAX):
        return logits.argmax(dim=-1)
    chunks = logits.reshape(num_rows, num_chunks, _ARGMAX_CHUNK)
    best_chunk = chunks.amax(dim=-1).argmax(dim=-1)  # [B]
    within = chunks[torch.arange(num_rows), best_chunk].argmax(dim=-1)  # [B]
    return best_chunk * _ARGMAX_CHUNK + within


@dataclass(slots=True)
class SamplerOutput:
    sampled_token_ids: list[int]  # one per row
    logprobs: list[LogprobsEntry | None] | None  # None when no row asked for logprobs


class Sampler:
    """Stateless: ``Sampler()(logits[B, V], metadata) -> SamplerOutput``."""

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        assert logits.dim() == 2 and logits.shape[1] == metadata.vocab_size, logits.shape
        if logits.dtype != torch.float32:  # .float() would dispatch even as a no-op
            logits = logits.float()
        raw_logprobs, lp_rows = None, []
        if metadata.max_num_logprobs is not None:
            # From the raw logits, before any processing (vLLM's default "raw_logprobs").
            lp_rows = [i for i, n in enumerate(metadata.num_logprobs) if n is not None]
            raw_logprobs = torch.log_softmax(logits[lp_rows], dim=-1)

        logits = apply_logits_processors(logits, metadata)
        sampled = sample(logits, metadata)

        logprobs = None
        if raw_logprobs is not None:
            ks = [metadata.num_logprobs[i] for i in lp_rows]
            entries = _gather_topk_logprobs(raw_logprobs, sampled[lp_rows], ks)
            logprobs = [None] * logits.shape[0]
            for i, entry in zip(lp_rows, entries):
                logprobs[i] = entry
        return SamplerOutput(sampled_token_ids=sampled.tolist(), logprobs=logprobs)


def apply_logits_processors(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """logit_bias, min_tokens masking, repetition/frequency/presence penalties (out of place)."""
    if md.logit_bias is None and md.min_tokens_mask is None and md.output_counts is None:
        return logits
    logits = logits.clone()
    if md.logit_bias is not None:
        rows, ids, vals = md.logit_bias
        logits.index_put_((rows, ids), vals, accumulate=True)
    if md.min_tokens_mask is not None:
        logits[md.min_tokens_mask] = float("-inf")
    if md.output_counts is not None:
        logits = apply_penalties(
            logits, md.output_counts, md.prompt_mask,
            md.repetition_penalty, md.frequency_penalty, md.presence_penalty,
        )
    return logits


def sampling_probs(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """[B, V] processed logits -> the distribution random rows draw from: temperature, then
    top-k, top-p, then min-p (also what speculative verification tests drafts against)."""
    logits = logits / md.temperature.unsqueeze(1)
    logits = apply_top_k_top_p(logits, md.top_k, md.top_p)
    probs = torch.softmax(logits, dim=-1)
    if md.min_p is not None:
        probs = apply_min_p(probs, md.min_p)
    return probs


def sample(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """[B, V] processed logits -> [B] int64 token ids."""
    greedy = None if md.all_random else greedy_sample(logits)
    if md.all_greedy:
        return greedy
    if md.random_rows is None:
        return _exponential_race(sampling_probs(logits, md), md.generators)
    # A mixed batch: only its random rows go through temperature, the filters and the softmax.
    rows = md.random_rows
    index = torch.tensor(rows, dtype=torch.int64, device=logits.device)
    sub = replace(md, temperature=_take(md.temperature, index), top_k=_take(md.top_k, index),
                  top_p=_take(md.top_p, index), min_p=_take(md.min_p, index))
    generators = {j: md.generators[r] for j, r in enumerate(rows) if r in md.generators}
    random = _exponential_race(sampling_probs(logits[index], sub), generators)
    return greedy.index_copy_(0, index, random)


def _take(values: torch.Tensor | None, index: torch.Tensor) -> torch.Tensor | None:
    return None if values is None else values[index]


def _exponential_race(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """argmax(probs / E) with E ~ Exp(1) picks token i with probability probs[i] / sum(probs)."""
    # E = -log(U): uniform_ is several times faster than exponential_ on CPU.
    u = torch.empty_like(probs)
    if len(generators) < probs.shape[0]:
        u.uniform_()  # global RNG for unseeded rows
    for row, gen in generators.items():
        u[row].uniform_(generator=gen)  # [V] from the row's own stream only
    noise = torch.log1p(-u).neg_()
    # E can be exactly 0 (U = 0); keep 0/0 (NaN, which argmax would pick) out.
    noise.clamp_(min=torch.finfo(noise.dtype).tiny)
    return (probs / noise).argmax(dim=-1)


def compute_topk_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor | list[int], k: int | list[int]
) -> list[LogprobsEntry]:
    """For each row: (token_ids, logprobs, ranks) of the given token then the top-k by logprob."""
    num_rows = logits.shape[0]
    ks = [k] * num_rows if isinstance(k, int) else list(k)
    token_ids = torch.as_tensor(token_ids, dtype=torch.int64, device=logits.device)
    return _gather_topk_logprobs(torch.log_softmax(logits.float(), dim=-1), token_ids, ks)


def _gather_topk_logprobs(
    logprobs: torch.Tensor, token_ids: torch.Tensor, ks: list[int]
) -> list[LogprobsEntry]:
    if logprobs.shape[0] == 0:
        return []
    token_lp = logprobs.gather(1, token_ids.unsqueeze(1))  # [N, 1]
    # 1-based rank: 1 + number of tokens strictly more likely (ties share the better rank).
    token_rank = (logprobs > token_lp).sum(dim=-1) + 1
    max_k = max(ks)
    top_lp, top_ids = logprobs.topk(max_k, dim=-1) if max_k > 0 else (None, None)
    tok_l, lp_l, rank_l = token_ids.tolist(), token_lp.squeeze(1).tolist(), token_rank.tolist()
    top_lp_l = top_lp.tolist() if top_lp is not None else None
    top_ids_l = top_ids.tolist() if top_ids is not None else None
    out = []
    for i, n in enumerate(ks):
        ids, lps, ranks = [tok_l[i]], [lp_l[i]], [rank_l[i]]
        if n > 0:
            ids += top_ids_l[i][:n]
            lps += top_lp_l[i][:n]
            ranks += list(range(1, n + 1))
        out.append((ids, lps, ranks))
    return out
