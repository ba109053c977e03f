"""N-gram drafts proposed in the runner, for async scheduling.

With async scheduling the engine core schedules a request's next step before the token in
flight is known, so it cannot look up the n-gram that ends with it. It gives the request draft
slots instead (as for a draft model) and the runner, which holds that token, fills them from the
request's own text with the same lookup (core/ngram_proposer.py). Slots the lookup cannot fill
are dropped: the request computes fewer tokens and reports how many drafts it verified. Without
async scheduling the engine core proposes n-gram drafts itself, budgeting only real ones.
"""
from __future__ import annotations

import torch

from pagedllm.core.ngram_proposer import NgramProposer
from pagedllm.runner.input_batch import ScheduledRequest
from pagedllm.speculative_config import SpeculativeConfig


class NgramDrafter:
    kv_layers: list = []  # a lookup keeps no KV

    def __init__(self, spec: SpeculativeConfig) -> None:
        self.proposer = NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max)

    @staticmethod
    def can_skip(scheduled: list[ScheduledRequest]) -> bool:
        return all(not s.drafts for s in scheduled)

    def observe_target(self, scheduled: list[ScheduledRequest], hidden: torch.Tensor) -> None:
        """A lookup reads tokens only."""

    def propose(self, scheduled: list[ScheduledRequest], metadata, sampling) -> list[None]:
        """Fill each request's slots with the tokens that followed the latest earlier occurrence
        of its last n-gram; n-gram drafts have no distribution (q is one-hot on the draft)."""
        for s in scheduled:
            if not s.drafts:
                continue
            # A drafting request's known tokens end at its last real input: the token in flight.
            drafts = self.proposer.propose(s.state.token_ids, len(s.drafts))
            dropped = len(s.drafts) - len(drafts)
            s.num_tokens -= dropped
            s.state.num_computed_tokens -= dropped
            s.drafts = drafts
        return [None] * len(scheduled)
