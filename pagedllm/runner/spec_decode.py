"""Verifying draft tokens (speculative decoding) against the target model's distributions.

Rejection sampling: accept draft d with probability min(1, p(d) / q(d)); on rejection sample from
the residual max(p - q, 0), renormalised; if every draft is accepted, sample a bonus token from
the last distribution. The output is distributed exactly as sampling from p token by token.
A draft model's q is its real distribution (runner/draft_model.py); n-gram drafts have none,
so q is one-hot on d: accept with probability p(d), the residual is p with d removed. Greedy
rows accept while the draft equals the argmax, so their output is identical to decoding without
drafts.
"""
from __future__ import annotations

import torch

from pagedllm.runner.sampler import SamplingMetadata, _exponential_race, apply_logits_processors, sampling_probs


def target_probs(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """[R, V] raw logits -> the distribution each row samples from (greedy rows: unused)."""
    logits = apply_logits_processors(logits, md)
    return logits if md.all_greedy else sampling_probs(logits, md)


def _draw(probs: torch.Tensor, gen: torch.Generator | None) -> int:
    # The sampler's own draw: a row without drafts gets the token it would get in a batch without any.
    return int(_exponential_race(probs.unsqueeze(0), {0: gen} if gen is not None else {}).item())


def verify_drafts(logits: torch.Tensor, md: SamplingMetadata, greedy: list[bool],
                  groups: list[tuple[int, list[int]]],
                  generators: list[torch.Generator | None],
                  draft_probs: list[torch.Tensor | None] | None = None) -> list[list[int]]:
    """For each (first row, drafts) group, rows first .. first + len(drafts) hold the logits at
    the last real token and at each draft; ``draft_probs``: per group the draft's q
    [len(drafts), V] (None: one-hot). Returns the accepted drafts plus one new token."""
    processed = target_probs(logits, md)
    argmax = processed.argmax(dim=-1).tolist() if any(greedy) else None
    results = []
    for g, (first, drafts) in enumerate(groups):
        q = draft_probs[g] if draft_probs is not None else None
        out: list[int] = []
        for j in range(len(drafts) + 1):
            row = first + j
            if greedy[row]:
                target = argmax[row]
                if j < len(drafts) and drafts[j] == target:
                    out.append(target)
                    continue
                out.append(target)
                break
            probs = processed[row]
            gen = generators[row]
            if j == len(drafts):  # every draft accepted: a bonus token
                out.append(_draw(probs, gen))
                break
            d = drafts[j]
            u = torch.rand((), generator=gen).item()
            if u * (1.0 if q is None else q[j, d].item()) < probs[d].item():
                out.append(d)
                continue
            if q is None:
                residual = probs.clone()
                residual[d] = 0.0
            else:
                residual = (probs - q[j]).clamp_(min=0.0)
            if residual.sum() <= 0:  # p <= q everywhere means p == q, and yet rejected: keep d
                out.append(d)
                continue
            out.append(_draw(residual, gen))
            break
        results.append(out)
    return results
