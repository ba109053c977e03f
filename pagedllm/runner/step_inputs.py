"""A step's inputs, gathered from its scheduled requests in one pass (vLLM's ``_prepare_inputs``):
the token ids, each request's query length, computed prefix and block tables for the attention
metadata, and which rows the step samples, pools or scores as prompt logprobs."""
from __future__ import annotations

from dataclasses import dataclass, field

from pagedllm.runner.input_batch import CachedRequestState, ScheduledRequest


@dataclass
class StepInputs:
    input_ids: list[int] = field(default_factory=list)
    query_lens: list[int] = field(default_factory=list)
    num_computed: list[int] = field(default_factory=list)
    block_tables: list[list[list[int]]] = field(default_factory=list)  # one table per KV cache group
    samplers: list[tuple[ScheduledRequest, int]] = field(default_factory=list)  # (request, its logits row)
    # (request, its first row) of the pooling requests: pooled where the input ends this step.
    poolers: list[tuple[ScheduledRequest, int]] = field(default_factory=list)
    token_type_starts: list[tuple[int, int]] = field(default_factory=list)  # rows [a, b) of a pair's second segment
    # (state, first row, first position, count): rows whose logits score prompt tokens.
    prompt_logprob_jobs: list[tuple[CachedRequestState, int, int, int]] = field(default_factory=list)


def gather_step_inputs(scheduled: list[ScheduledRequest]) -> StepInputs:
    """The rows of ``scheduled`` in order: each request's real tokens, then its drafts."""
    step = StepInputs()
    for s in scheduled:
        state, start, n = s.state, s.start, s.num_tokens
        n_real = n - len(s.drafts)
        row0 = len(step.input_ids)
        step.input_ids.extend(state.token_ids[start:start + n_real])
        if s.drafts:
            step.input_ids.extend(s.drafts)
        step.query_lens.append(n)
        step.num_computed.append(start)
        step.block_tables.append(state.block_ids)
        if state.params is not None and state.params.prompt_logprobs is not None \
                and start < state.num_prompt_tokens - 1:
            # Logits at position p score prompt token p + 1.
            count = min(start + n_real, state.num_prompt_tokens - 1) - start
            step.prompt_logprob_jobs.append((state, row0, start, count))
        if s.samples:
            step.samplers.append((s, row0 + n_real - 1))
        elif state.pooling_params is not None:
            step.poolers.append((s, row0))
            step.token_type_starts.append((row0 + (state.pooling_params.token_type_start or n), row0 + n))
    return step
