"""Verifying draft tokens (speculative decoding) against the target model's distributions.

Drafts come from an n-gram lookup, so the draft distribution q is one-hot on the draft token d.
Rejection sampling then reads: accept d with probability min(1, p(d) / q(d)) = p(d); on rejection
sample from the residual max(p - q, 0), which is p with d removed, renormalised; if every draft is
accepted, sample a bonus token from the last distribution. The output is distributed exactly as
sampling from p token by token. Greedy rows accept while the draft equals the argmax, so their
output is identical to decoding without drafts.
"""
from __future__ import annotations

import torch

from pagedllm.runner.sampler import SamplingMetadata, apply_logits_processors, sampling_probs


def target_probs(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """[R, V] raw logits -> the distribution each row samples from (greedy rows: unused)."""
    logits = apply_logits_processors(logits, md)
    return logits if md.all_greedy else sampling_probs(logits, md)


def _draw(probs: torch.Tensor, gen: torch.Generator | None) -> int:
    return int(torch.multinomial(probs, 1, generator=gen).item())


def verify_drafts(logits: torch.Tensor, md: SamplingMetadata, greedy: list[bool],
                  groups: list[tuple[int, list[int]]],
                  generators: list[torch.Generator | None]) -> list[list[int]]:
    """For each (first row, drafts) group, rows first .. first + len(drafts) hold the logits at
    the last real token and at each draft. Returns the accepted drafts plus one new token."""
    processed = target_probs(logits, md)
    argmax = processed.argmax(dim=-1).tolist() if any(greedy) else None
    results = []
    for first, drafts in groups:
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
            if u < probs[d].item():
                out.append(d)
                continue
            residual = probs.clone()
            residual[d] = 0.0
            if residual.sum() <= 0:  # p was one-hot on d and yet rejected (u == 1): keep d
                out.append(d)
                continue
            out.append(_draw(residual, gen))
            break
        results.append(out)
    return results
