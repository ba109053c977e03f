"""The sampled rows' state in the runner's persistent batch (vLLM's InputBatch sampling tensors).

A row's temperature, top-k, top-p, min-p, penalties, logit bias and logprobs come from its
request's SamplingParams, which do not change while the request runs: they live in host arrays
kept across steps and are written only for a row whose request differs from last step's (added,
moved, or another request in its place); a step takes the first B rows. What depends on the step
(a seeded row's generator for this output position, a min_tokens mask still active, the
penalties' token counts) is rebuilt every step, for the rows that need it only.
"""
from __future__ import annotations

from dataclasses import replace
from operator import is_

import numpy as np
import torch

from pagedllm.runner.input_batch import CachedRequestState
from pagedllm.runner.logits_processors import token_counts
from pagedllm.runner.sampler import SamplingMetadata

# (request state, draft prefix before the row's position, hidden row)
SamplingRow = tuple[CachedRequestState, list[int], int]
SamplingResult = tuple[SamplingMetadata, list[torch.Generator | None]]

_FIELDS = {"temperature": np.float32, "top_k": np.int64, "top_p": np.float32, "min_p": np.float32,
           "repetition_penalty": np.float32, "frequency_penalty": np.float32, "presence_penalty": np.float32}
_NO_TOKENS: list[int] = []


class SamplingBatch:
    """One per random stream (the sampler's and verifier's, a draft model's): seeded rows of
    different streams draw from different generators."""

    def __init__(self, vocab_size: int, device: torch.device, stream: int = 0) -> None:
        self.vocab_size, self.device, self.stream = vocab_size, device, stream
        self._arrays = {name: np.zeros(0, dtype) for name, dtype in _FIELDS.items()}
        self._states: list[CachedRequestState] = []
        # Per row: greedy, and whether the row needs per-step data or penalty statistics.
        self._greedy: list[bool] = []
        self._per_step: list[bool] = []
        self._use_rep: list[bool] = []
        self._use_out: list[bool] = []
        self._step_rows: list[int] = []  # the rows needing per-step data
        self._metadata: SamplingMetadata | None = None
        self.rows_written = 0  # rows written since startup: a steady batch adds none

    def prepare(self, rows: list[SamplingRow]) -> SamplingResult:
        """The step's metadata and per-row generators; valid for this step only (its tensors
        view the persistent arrays)."""
        states = [state for state, _, _ in rows]
        if len(states) != len(self._states) or not all(map(is_, states, self._states)):
            self._write_rows(states)
        if not self._step_rows:
            return self._metadata, [None] * len(rows)
        return self._with_step_data(rows)

    def _write_rows(self, states: list[CachedRequestState]) -> None:
        num_rows, kept = len(states), self._states
        if num_rows > len(self._arrays["temperature"]):
            self._grow(num_rows)
        for lst in (self._greedy, self._per_step, self._use_rep, self._use_out):
            del lst[num_rows:]
            lst.extend([False] * (num_rows - len(lst)))
        for i, state in enumerate(states):
            if i >= len(kept) or kept[i] is not state:
                self._write_row(i, state)
        self._states = states
        self._step_rows = [i for i, s in enumerate(self._per_step) if s]
        self._metadata = self._build(num_rows)

    def _grow(self, num_rows: int) -> None:
        size = max(num_rows, 2 * len(self._arrays["temperature"]), 8)
        for name, old in self._arrays.items():
            new = np.zeros(size, old.dtype)
            new[:len(old)] = old
            self._arrays[name] = new

    def _write_row(self, i: int, state: CachedRequestState) -> None:
        p, a, V = state.params, self._arrays, self.vocab_size
        greedy = p.sampling_type_greedy
        # Greedy rows never reach temperature or the filters, so they hold the neutral values.
        a["temperature"][i] = 1.0 if greedy else p.temperature
        a["top_k"][i] = V if greedy or p.top_k <= 0 else min(p.top_k, V)
        a["top_p"][i] = 1.0 if greedy else p.top_p
        a["min_p"][i] = 0.0 if greedy else p.min_p
        a["repetition_penalty"][i] = p.repetition_penalty
        a["frequency_penalty"][i] = p.frequency_penalty
        a["presence_penalty"][i] = p.presence_penalty
        self._greedy[i] = greedy
        self._use_rep[i] = p.repetition_penalty != 1.0
        self._use_out[i] = self._use_rep[i] or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0
        self._per_step[i] = self._use_out[i] or p.min_tokens > 0 or (p.seed is not None and not greedy)
        self.rows_written += 1

    def _tensor(self, name: str, num_rows: int) -> torch.Tensor:
        t = torch.from_numpy(self._arrays[name][:num_rows])
        return t if self.device.type == "cpu" else t.to(self.device)

    def _build(self, num_rows: int) -> SamplingMetadata:
        """The step-independent metadata of the first ``num_rows`` rows."""
        V, a, greedy = self.vocab_size, self._arrays, self._greedy
        params = [s.params for s in self._states]
        all_greedy, all_random = all(greedy), not any(greedy)
        temperature = top_k = top_p = min_p = random_rows = None
        if not all_greedy:
            temperature = self._tensor("temperature", num_rows)
            if not all_random:
                random_rows = [i for i, g in enumerate(greedy) if not g]
            if (a["top_k"][:num_rows] < V).any():
                top_k = self._tensor("top_k", num_rows)
            if (a["top_p"][:num_rows] < 1.0).any():
                top_p = self._tensor("top_p", num_rows)
            if (a["min_p"][:num_rows] > 0.0).any():
                min_p = self._tensor("min_p", num_rows)
        logit_bias = None
        biased = [(i, t) for i, p in enumerate(params) if p.logit_bias for t in p.logit_bias if 0 <= t < V]
        if biased:
            logit_bias = (self._i64([i for i, _ in biased]), self._i64([t for _, t in biased]),
                          torch.tensor([params[i].logit_bias[t] for i, t in biased], dtype=torch.float32,
                                       device=self.device))
        penalties = (None, None, None)
        if any(self._use_out):
            penalties = tuple(self._tensor(n, num_rows)
                              for n in ("repetition_penalty", "frequency_penalty", "presence_penalty"))
        num_logprobs = [p.logprobs for p in params]
        wanted = [n for n in num_logprobs if n is not None]
        return SamplingMetadata(
            vocab_size=V, all_greedy=all_greedy, all_random=all_random, random_rows=random_rows,
            temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, generators={},
            logit_bias=logit_bias, min_tokens_mask=None, repetition_penalty=penalties[0],
            frequency_penalty=penalties[1], presence_penalty=penalties[2], prompt_mask=None,
            output_counts=None, num_logprobs=num_logprobs, max_num_logprobs=max(wanted) if wanted else None)

    def _with_step_data(self, rows: list[SamplingRow]) -> SamplingResult:
        """The kept metadata plus this step's generators, min_tokens masks and token counts."""
        V, stream = self.vocab_size, self.stream
        generators: list[torch.Generator | None] = [None] * len(rows)
        masked: list[tuple[int, int]] = []
        for i in self._step_rows:
            state, prefix, _ = rows[i]
            p = state.params
            num_output = len(state.token_ids) - state.num_prompt_tokens + len(prefix)
            if p.seed is not None and not self._greedy[i]:
                # One stream per (seed, output position): the draw for token i does not depend
                # on the batch, on earlier steps, or on whether the request was preempted.
                g = torch.Generator(device=self.device)
                g.manual_seed(((p.seed * 1_000_003 + num_output) ^ (stream << 48)) % (1 << 63))
                generators[i] = g
            if num_output < p.min_tokens:
                ids = p.all_stop_token_ids if p.ignore_eos else (p.all_stop_token_ids | state.eos_token_ids)
                masked.extend((i, t) for t in ids if 0 <= t < V)
        md = replace(self._metadata, generators={i: g for i, g in enumerate(generators) if g is not None},
                     min_tokens_mask=(self._i64([i for i, _ in masked]), self._i64([t for _, t in masked]))
                     if masked else None)
        if md.repetition_penalty is not None:
            # Only penalties read the tokens: rows without them get none copied.
            outputs = [state.output_token_ids + prefix if use else _NO_TOKENS
                       for (state, prefix, _), use in zip(rows, self._use_out)]
            md.output_counts = token_counts(outputs, self._use_out, V, self.device)
            if any(self._use_rep):
                prompts = [state.token_ids[:state.num_prompt_tokens] if use else _NO_TOKENS
                           for (state, _, _), use in zip(rows, self._use_rep)]
                md.prompt_mask = token_counts(prompts, self._use_rep, V, self.device) > 0
        return md, generators

    def _i64(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.device)
