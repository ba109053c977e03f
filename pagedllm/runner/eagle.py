"""EAGLE-3 heads and MTP layers: drafters that read the target's hidden states.

vLLM's EagleProposer, in this runner's shape (runner/draft_model.py): the slots are filled at the
start of the step, before the target verifies them. The head at position p reads the embedding
of token p + 1 and the target's hidden state at p (EAGLE-3: ``fc`` of the residual streams
entering three target layers; MTP: the target's final hidden state) and predicts token p + 2.

The target's hidden states of a step are known only after its forward, so after each target
forward (``observe_target``) the rows of every request are kept on its state; the next step's
first forward runs the head over the positions the target has computed since, up to the one
before the last known token, and samples the first draft from its last row. Draft j > 1 feeds
draft j - 1 and the head's own output at the previous position; those positions are run again
the next step with the target's hidden states (the draft's KV there is overwritten).

The head's KV layers share the target's block tables (grouped by attention type, as a draft
model's). A request entering with a prefix hit has no target hidden states for the hit: the head
starts after it and reads the KV the request that filled those blocks left there. That KV, and
the head's draft near a block boundary that several requests share, depends on other requests'
next tokens: this changes which drafts are proposed, never what is accepted (the verifier
decides with the head's real q).
"""
from __future__ import annotations

import functools
import logging

import torch

from pagedllm.checkpoint.draft_heads import load_eagle3_head, load_mtp_head
from pagedllm.errors import ModelLoadError
from pagedllm.layers.forward_context import set_forward_context
from pagedllm.layers.kv_cache import kv_cache_layers
from pagedllm.models.eagle3 import default_aux_layer_ids
from pagedllm.runner.draft_model import DraftModel, MetadataBuilder, SamplingBuilder
from pagedllm.runner.input_batch import CachedRequestState, ScheduledRequest
from pagedllm.speculative_config import SpeculativeConfig
from pagedllm.weight_plan.plan import plan_weights

logger = logging.getLogger("pagedllm")


class EagleProposer(DraftModel):
    def __init__(self, spec: SpeculativeConfig, target_model: torch.nn.Module, target_path: str,
                 dtype: torch.dtype, device: torch.device, kv_cache_dtype: torch.dtype) -> None:
        self.num_speculative_tokens = spec.num_speculative_tokens
        self.draft_p_min = spec.draft_p_min
        self.device = device
        self.compiled = None  # one layer: eager
        decoder = getattr(target_model, "decoder", None)
        if decoder is None or not hasattr(decoder, "layers"):
            raise ModelLoadError(f"speculative method {spec.method!r} reads the target's hidden states; "
                                 f"{type(target_model).__name__} does not expose them")
        self._layer_ids: tuple[int, ...] | None = None  # EAGLE-3: the target layers it reads
        if spec.method == "eagle3":
            self.model = load_eagle3_head(spec.model, target_model, dtype, device)
            layer_ids = self.model.aux_layer_ids or default_aux_layer_ids(target_model.num_layers)
            if len(layer_ids) != 3 or not all(0 <= i < target_model.num_layers for i in layer_ids):
                raise ModelLoadError(f"an EAGLE-3 head reads 3 target layers in 0..{target_model.num_layers - 1}; "
                                     f"got {list(layer_ids)} (eagle_aux_hidden_state_layer_ids)")
            self._layer_ids = tuple(layer_ids)
            self._captured: dict[int, torch.Tensor] = {}
            # The residual stream entering each of the three layers, captured in the target's forward.
            for i in sorted(set(layer_ids)):
                decoder.layers[i].register_forward_pre_hook(functools.partial(self._capture, i))
        else:
            self.model = load_mtp_head(target_path, target_model, dtype, device)
        # The head's own layers only: the target's (its embedding, an MTP head's lm_head) are not its modules.
        plan_weights(self.model, {}, device, "auto")
        self.hf_config = None
        self.kv_layers = kv_cache_layers(self.model, kv_cache_dtype)
        logger.info("%s drafter: %d KV layers, %d draft tokens a step", spec.method, len(self.kv_layers),
                    self.num_speculative_tokens)

    def _capture(self, layer_idx: int, _module: torch.nn.Module, args: tuple) -> None:
        self._captured[layer_idx] = args[0]

    @torch.inference_mode()
    def observe_target(self, scheduled: list[ScheduledRequest], hidden: torch.Tensor) -> None:
        """Keep the target's hidden rows of this step per request, from the first position the
        head has not consumed (rows past the accepted tokens are dropped next step)."""
        if self._layer_ids is not None:
            # In the config's order (fc's input is laid out so); a layer named twice is read twice.
            captured = [self._captured.get(i) for i in self._layer_ids]
            self._captured = {}
            if any(t is None or t.shape[0] != hidden.shape[0] for t in captured):
                raise RuntimeError("the EAGLE-3 head did not receive the target's hidden states of this step")
            rows = self.model.combine_target(captured)
        else:
            rows = self.model.combine_target(hidden)
        row = 0
        for s in scheduled:
            state, n = s.state, s.num_tokens
            new = rows[row:row + n]
            row += n
            old, old_start = state.draft_hidden, state.draft_hidden_start
            keep = max(state.num_draft_computed, old_start)
            if old is not None and keep < s.start <= old_start + old.shape[0]:
                state.draft_hidden = torch.cat((old[keep - old_start:s.start - old_start], new))
                state.draft_hidden_start = keep
            else:
                state.draft_hidden, state.draft_hidden_start = new, s.start

    @torch.inference_mode()
    def propose(self, scheduled: list[ScheduledRequest], metadata: MetadataBuilder,
                sampling: SamplingBuilder) -> list[torch.Tensor | None]:
        """As DraftModel.propose: fill the draft slots in place, return each request's q."""
        runs = [(i, *span) for i, s in enumerate(scheduled) if (span := _catch_up_span(s.state, s.start))]
        probs: list[list[torch.Tensor] | None] = [[] if s.drafts else None for s in scheduled]
        drafts: list[list[int]] = [[] for _ in scheduled]
        stopped: set[int] = set()  # below draft_p_min: no more drafts this step
        speculating: list[int] = []
        feed: dict[int, torch.Tensor] = {}  # per drafting request: the head's output at its last position
        if runs:
            ids: list[int] = []
            hidden_rows: list[torch.Tensor] = []
            last_row: dict[int, int] = {}
            for i, begin, end in runs:
                state = scheduled[i].state
                ids.extend(state.token_ids[begin + 1:end + 1])
                hidden_rows.append(state.draft_hidden[begin - state.draft_hidden_start:end - state.draft_hidden_start])
                last_row[i] = len(ids) - 1
                state.num_draft_computed = end
            for_logits, prenorm = self._run(ids, [e - b for _, b, e in runs], [b for _, b, _ in runs],
                                            [scheduled[i].state.block_ids for i, _, _ in runs],
                                            torch.cat(hidden_rows), metadata)
            # Only a request whose head reached the one before its last known token drafts.
            speculating = [i for i, _, end in runs if scheduled[i].drafts and end == scheduled[i].start]
            rows = [last_row[i] for i in speculating]
            if speculating:
                self._sample(for_logits[rows], speculating, scheduled, drafts, probs, sampling, stopped)
            feed = {i: prenorm[r] for i, r in zip(speculating, rows)}
        for j in range(1, max((len(s.drafts) for s in scheduled), default=0)):
            active = [i for i in speculating if len(scheduled[i].drafts) > j and i not in stopped]
            if not active:
                break
            positions = [scheduled[i].start - 1 + j for i in active]
            for_logits, prenorm = self._run([drafts[i][-1] for i in active], [1] * len(active), positions,
                                            [scheduled[i].state.block_ids for i in active],
                                            torch.stack([feed[i] for i in active]), metadata)
            feed = {i: prenorm[r] for r, i in enumerate(active)}
            self._sample(for_logits, active, scheduled, drafts, probs, sampling, stopped)
        for i, s in enumerate(scheduled):
            if not s.drafts:
                continue
            dropped = len(s.drafts) - len(drafts[i])
            s.num_tokens -= dropped
            s.state.num_computed_tokens -= dropped
            s.drafts = drafts[i]
        return [None if not p or p[0] is None else torch.stack(p) for p in probs]

    def _run(self, ids: list[int], query_lens: list[int], starts: list[int], block_tables: list[list[list[int]]],
             hidden: torch.Tensor, metadata: MetadataBuilder) -> tuple[torch.Tensor, torch.Tensor]:
        md = metadata(query_lens, starts, block_tables)
        ids_t = torch.tensor(ids, dtype=torch.long, device=self.device)
        with set_forward_context(md):
            return self.model(ids_t, md.positions, hidden)


def _catch_up_span(state: CachedRequestState, start: int) -> tuple[int, int] | None:
    """Positions [begin, end) the head runs this step: from what it has not consumed (or the
    first the target computed for this request) to the one before ``start``, as far as the
    target's hidden rows reach."""
    if state.draft_hidden is None:
        return None
    begin = max(min(state.num_draft_computed, start), state.draft_hidden_start)
    end = min(start, state.draft_hidden_start + state.draft_hidden.shape[0], len(state.token_ids) - 1)
    return (begin, end) if end > begin else None
