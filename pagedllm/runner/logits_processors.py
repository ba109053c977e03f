"""Tensor-level logits processors used by the sampler: penalties, top-k/top-p, min-p.

Every function here is out of place and works on a [B, V] batch with one parameter per row.
"""
from __future__ import annotations

import torch

_TOP_P_WIDTH = 256  # candidates looked at before falling back to the whole vocabulary


def apply_penalties(
    logits: torch.Tensor,
    output_counts: torch.Tensor,
    prompt_mask: torch.Tensor | None,
    repetition_penalty: torch.Tensor,
    frequency_penalty: torch.Tensor,
    presence_penalty: torch.Tensor,
) -> torch.Tensor:
    """Repetition (HF/vLLM: over prompt and output tokens), then frequency and presence (output).

    ``output_counts`` [B, V] float32, ``prompt_mask`` [B, V] bool (None: no repetition penalty),
    the penalties [B] with neutral values 1.0, 0.0, 0.0.
    """
    if prompt_mask is not None:
        seen = prompt_mask | (output_counts > 0)
        penalty = repetition_penalty.unsqueeze(1)
        # Dividing a positive logit and multiplying a negative one both make the token less likely.
        penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(seen, penalized, logits)
    logits = logits - frequency_penalty.unsqueeze(1) * output_counts
    return logits - presence_penalty.unsqueeze(1) * (output_counts > 0).float()


def apply_min_p(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Zero the probabilities below min_p * the row's top probability (rows left unnormalized).

    The cut is relative to the top token, so it is the same before or after renormalizing."""
    threshold = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
    return probs.masked_fill(probs < threshold, 0.0)


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Set to -inf the logits outside each row's top-k, then outside its top-p nucleus.

    No full sort in the common case: the cut is found among the ``_TOP_P_WIDTH`` largest logits,
    and only rows whose nucleus (or k) reaches past them are redone over the whole vocabulary.
    Each row's result depends only on that row. Logits tied with the cut stay in.
    """
    if top_k is None and top_p is None:
        return logits
    V = logits.shape[1]
    if top_p is None:
        has_k = top_k < V
        max_k = int(top_k.masked_fill(~has_k, 1).max())
        top_vals = logits.topk(max_k, dim=-1).values  # [B, max_k], descending
        kth = top_vals.gather(1, (top_k.clamp(max=max_k) - 1).unsqueeze(1))
        kth = kth.masked_fill(~has_k.unsqueeze(1), float("-inf"))
        return logits.masked_fill(logits < kth, float("-inf"))
    cut = _top_k_top_p_cut(logits, top_k, top_p, min(V, _TOP_P_WIDTH))
    redo = cut.squeeze(1).isnan()
    if bool(redo.any()):
        rows = redo.nonzero().squeeze(1)
        row_k = top_k[rows] if top_k is not None else None
        cut[rows] = _top_k_top_p_cut(logits[rows], row_k, top_p[rows], V)
    return logits.masked_fill(logits < cut, float("-inf"))


def _top_k_top_p_cut(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor, width: int
) -> torch.Tensor:
    """[B, 1] lowest logit each row keeps; NaN where ``width`` candidates cannot decide it."""
    V = logits.shape[1]
    if width < V:
        vals = logits.topk(width, dim=-1).values  # [B, width], descending
    else:
        vals = logits.sort(dim=-1, descending=True).values  # faster than a full topk
    cut = torch.full_like(vals[:, :1], float("-inf"))
    undecided = torch.zeros_like(top_p, dtype=torch.bool)
    if top_k is not None:
        has_k = top_k < V
        kth = vals.gather(1, (top_k.clamp(max=width) - 1).unsqueeze(1))
        cut = torch.where(has_k.unsqueeze(1), kth, cut)
        undecided |= has_k & (top_k > width)
        vals = vals.masked_fill(vals < cut, float("-inf"))
    # Probabilities after top-k: normalized over the whole row, not just the candidates.
    lse = logits.masked_fill(logits < cut, float("-inf")).logsumexp(dim=-1, keepdim=True)
    probs = (vals - lse).exp()
    cum = probs.cumsum(dim=-1)
    # A token goes if the mass strictly above it already reaches top_p (top_p > 0, so the top
    # token, with nothing above it, always stays).
    drop = (cum - probs) >= top_p.unsqueeze(1)
    active = top_p < 1.0
    nucleus_cut = vals.masked_fill(drop, float("inf")).amin(dim=-1, keepdim=True)
    cut = torch.where(active.unsqueeze(1), torch.maximum(cut, nucleus_cut), cut)
    if width < V:
        undecided |= active & (cum[:, -1] < top_p)  # the nucleus may reach past the candidates
        cut = cut.masked_fill(undecided.unsqueeze(1), float("nan"))
    return cut


def _i64(values: list[int], device: torch.device | str) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)


def token_counts(
    token_ids: list[list[int]], use: list[bool], vocab_size: int, device: torch.device | str
) -> torch.Tensor:
    """[B, V] float32 occurrence counts, filled only for rows with ``use[i]``."""
    counts = torch.zeros(len(token_ids), vocab_size, dtype=torch.float32, device=device)
    rows = [i for i, u in enumerate(use) if u and token_ids[i]]
    if not rows:
        return counts
    flat = [t for i in rows for t in token_ids[i]]
    row_idx = torch.repeat_interleave(_i64(rows, device), _i64([len(token_ids[i]) for i in rows], device))
    ids = _i64(flat, device)
    # Ids outside the vocabulary (should not happen) would crash index_put_; drop them.
    keep = (ids >= 0) & (ids < vocab_size)
    row_idx, ids = row_idx[keep], ids[keep]
    counts.index_put_((row_idx, ids), torch.ones_like(ids, dtype=torch.float32), accumulate=True)
    return counts
