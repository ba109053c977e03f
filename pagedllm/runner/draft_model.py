"""A draft model: a second, smaller model in the same runner that proposes the draft tokens.

The scheduler sees one request with ``k`` draft slots (core/outputs.py's DRAFT_PLACEHOLDER); at
the start of the step the draft fills them, then the target verifies them in the same forward as
everything else (runner/spec_decode.py, with the draft's real distribution q).

The draft's attention layers are KV layers of the runner like the target's: grouped by attention
type with them (runner/kv_cache_groups.py), so a draft layer keeps its KV in tensors of its own
addressed by the target's block ids. Prefix hits, copy-on-write, preemption and freeing therefore
cover the draft's KV with no bookkeeping of its own, and a token costs one block id, not two.

Per request the draft keeps how many positions its KV holds (``num_draft_computed``). Each step,
one forward per draft position, batched over the requests:
  1. every scheduled request runs the tokens the draft has not seen up to its last known token
     (a prefill chunk as the target's; in decode the tokens accepted last step), and the
     speculating ones sample their first draft from the last row;
  2. then position j feeds draft j - 1 of the requests that want a j-th draft.
Rejected drafts' KV is overwritten later: the next step starts the draft at the target's
``num_computed_tokens`` at the latest. A step in which no request speculates and every request
decodes one token runs no draft at all (a large batch with drafts switched off pays nothing):
those tokens are caught up in forward 1 of the request's next speculating step. After a step
that ran the draft, its KV trails the target's by one position at most (the last draft, when
every draft was accepted), so a request that enters with cached blocks (a prefix hit, a resume
after preemption, a fork) starts the draft one position before its hit (input_batch.py): the
same tokens give the same KV, so blocks other requests share keep their content.
"""
from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

import torch

from pagedllm.checkpoint.loader import load_model
from pagedllm.errors import ModelLoadError
from pagedllm.layers.attention import Attention, KVCacheSpec
from pagedllm.layers.attention_metadata import AttentionMetadata
from pagedllm.layers.forward_context import set_forward_context
from pagedllm.layers.kv_cache import kv_cache_layers
from pagedllm.runner.compile import maybe_compile
from pagedllm.runner.input_batch import CachedRequestState, ScheduledRequest
from pagedllm.runner.sampler import SamplingMetadata
from pagedllm.runner.spec_decode import target_probs
from pagedllm.speculative_config import SpeculativeConfig
from pagedllm.weight_plan.plan import plan_weights

logger = logging.getLogger("pagedllm")

# (query_lens, num_computed, block tables per request) -> the step's attention metadata.
MetadataBuilder = Callable[[list[int], list[int], list[list[list[int]]]], AttentionMetadata]
# Rows (state, draft prefix, hidden row) and a stream -> sampling metadata and per-row generators.
SamplingBuilder = Callable[..., tuple[SamplingMetadata, list[torch.Generator | None]]]
# Seeded draws of the draft come from a stream of their own, never the verifier's.
DRAFT_STREAM = 1


class DraftModel:
    def __init__(self, spec: SpeculativeConfig, target_model: torch.nn.Module, target_path: str,
                 dtype: torch.dtype, device: torch.device, kv_cache_dtype: torch.dtype,
                 activations: str, enforce_eager: bool | None, max_model_len: int) -> None:
        self.num_speculative_tokens = spec.num_speculative_tokens
        self.draft_p_min = spec.draft_p_min
        self.device = device
        self.model, self.hf_config = load_model(spec.model, dtype, device, spec.quantization)
        check_same_vocabulary(spec.model, self.model.vocab_size, target_path, target_model.vocab_size)
        draft_len = getattr(self.model, "max_position_embeddings", None)
        if draft_len is not None and draft_len < max_model_len:  # drafts run as far as the target
            raise ModelLoadError(f"the draft model {spec.model} handles {draft_len} positions, fewer than "
                                 f"max_model_len {max_model_len}: lower max_model_len to {draft_len}")
        plan_weights(self.model, self.hf_config, device, activations, spec.quantization)
        self.compiled = maybe_compile(self.model, enforce_eager, device, warmup_tokens=16)
        self.kv_layers: list[tuple[Attention, KVCacheSpec]] = kv_cache_layers(self.model, kv_cache_dtype)
        logger.info("draft model %s: %d KV layers, %d draft tokens a step", spec.model,
                    len(self.kv_layers), self.num_speculative_tokens)

    @staticmethod
    def can_skip(scheduled: list[ScheduledRequest]) -> bool:
        """Nobody drafts and every request decodes one token: the draft catches up later. Prompt
        tokens are always mirrored, so blocks published to the prefix cache hold the draft's KV."""
        return all(not s.drafts and s.num_tokens == 1 and s.samples and s.start >= s.state.num_prompt_tokens
                   for s in scheduled)

    def observe_target(self, scheduled: list[ScheduledRequest], hidden: torch.Tensor) -> None:
        """A draft model reads tokens only (an EAGLE-3 head keeps the target's hidden states)."""

    @torch.inference_mode()
    def propose(self, scheduled: list[ScheduledRequest], metadata: MetadataBuilder,
                sampling: SamplingBuilder) -> list[torch.Tensor | None]:
        """Fill every scheduled request's draft slots in place (with ``draft_p_min``, fewer when
        a draft falls below it: the request computes fewer tokens); returns per request the draft
        distributions q [num_drafts, V] its drafts were drawn from (None: greedy or no drafts)."""
        # Forward 1: catch up to each request's last known token.
        ids: list[int] = []
        query_lens, starts, last_rows = [], [], []
        for s in scheduled:
            state = s.state
            end = s.start + s.num_tokens - len(s.drafts)
            done = min(state.num_draft_computed, s.start)
            ids.extend(state.token_ids[done:end])
            query_lens.append(end - done)
            starts.append(done)
            last_rows.append(len(ids) - 1)
            state.num_draft_computed = end
        speculating = [i for i, s in enumerate(scheduled) if s.drafts]
        probs: list[list[torch.Tensor] | None] = [[] if s.drafts else None for s in scheduled]
        drafts: list[list[int]] = [[] for _ in scheduled]
        stopped: set[int] = set()  # below draft_p_min: no more drafts this step
        hidden = self._forward(ids, query_lens, starts, [s.state.block_ids for s in scheduled], metadata)
        if speculating:
            self._sample(hidden[[last_rows[i] for i in speculating]], speculating, scheduled, drafts,
                         probs, sampling, stopped)
        # Forward j: draft j - 1 in, draft j out, for the requests that want that many.
        for j in range(1, max((len(s.drafts) for s in scheduled), default=0)):
            active = [i for i in speculating if len(scheduled[i].drafts) > j and i not in stopped]
            if not active:
                break
            positions = [scheduled[i].state.num_draft_computed for i in active]
            hidden = self._forward([drafts[i][-1] for i in active], [1] * len(active), positions,
                                   [scheduled[i].state.block_ids for i in active], metadata)
            for i, pos in zip(active, positions):
                scheduled[i].state.num_draft_computed = pos + 1
            self._sample(hidden, active, scheduled, drafts, probs, sampling, stopped)
        for i in speculating:
            s = scheduled[i]
            dropped = len(s.drafts) - len(drafts[i])
            s.num_tokens -= dropped
            s.state.num_computed_tokens -= dropped
            s.drafts = drafts[i]
        return [None if not p or p[0] is None else torch.stack(p) for p in probs]

    def _forward(self, ids: list[int], query_lens: list[int], starts: list[int],
                 block_tables: list[list[list[int]]], metadata: MetadataBuilder) -> torch.Tensor:
        md = metadata(query_lens, starts, block_tables)
        ids_t = torch.tensor(ids, dtype=torch.long, device=self.device)
        with set_forward_context(md):
            return (self.compiled or self.model)(ids_t, md.positions)

    def _sample(self, hidden: torch.Tensor, active: list[int], scheduled: list[ScheduledRequest],
                drafts: list[list[int]], probs: list[list[torch.Tensor | None] | None],
                sampling: SamplingBuilder, stopped: set[int]) -> None:
        """One draft token for each active request from its row of ``hidden``: greedy rows
        take the argmax, the others draw from q (kept for the verifier). A draft the draft
        model gives less than ``draft_p_min`` is dropped and its request stops (llama.cpp's rule)."""
        rows: list[tuple[CachedRequestState, list[int], int]] = [
            (scheduled[i].state, drafts[i], r) for r, i in enumerate(active)]
        md, generators = sampling(rows, stream=DRAFT_STREAM)
        q = target_probs(self.model.compute_logits(hidden).float(), md)
        argmax = q.argmax(dim=-1).tolist() if not md.all_random else None
        p_min = self.draft_p_min
        for (state, _, r), i, gen in zip(rows, active, generators):
            if state.params.sampling_type_greedy:
                token, row_q = argmax[r], None
                confidence = (torch.softmax(q[r], -1) if md.all_greedy else q[r])[token] if p_min else None
            else:
                token, row_q = int(torch.multinomial(q[r], 1, generator=gen).item()), q[r]
                confidence = q[r, token] if p_min else None
            if confidence is not None and confidence.item() < p_min:
                stopped.add(i)
                continue
            drafts[i].append(token)
            probs[i].append(row_q)


def check_same_vocabulary(draft_path: str, draft_size: int, target_path: str, target_size: int) -> None:
    """A draft proposes token ids of the target's tokenizer: refuse another vocabulary at load."""
    if draft_size != target_size:
        raise ModelLoadError(f"the draft model {draft_path} has a vocabulary of {draft_size} tokens and "
                             f"the target {target_path} one of {target_size}: a draft model must use the "
                             "target's tokenizer")
    draft_vocab, target_vocab = _tokenizer_vocab(draft_path), _tokenizer_vocab(target_path)
    if draft_vocab is not None and target_vocab is not None and draft_vocab != target_vocab:
        raise ModelLoadError(f"the draft model {draft_path} and the target {target_path} have different "
                             f"tokenizers ({len(draft_vocab)} and {len(target_vocab)} entries, or other "
                             "ids): a draft model must use the target's tokenizer")


def _tokenizer_vocab(path: str) -> dict | None:
    """A folder's tokenizer.json vocabulary (token -> id, added tokens included); None when
    the folder has none (a GGUF file: its size was checked)."""
    file = Path(path) / "tokenizer.json"
    if not file.is_file():
        return None
    try:
        data = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    vocab = dict((data.get("model") or {}).get("vocab") or {})
    vocab.update({t["content"]: t["id"] for t in data.get("added_tokens") or []})
    return vocab
