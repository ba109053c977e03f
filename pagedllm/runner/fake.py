"""FakeRunner: a deterministic stand-in for the model, with no torch.

It keeps a real paged "KV cache" of token ids: each step writes the scheduled tokens into their
slots through the block tables, then (with ``verify_kv``) reads every request's whole context back
through its block table and checks it against the tokens the request should have. A scheduler or
block-manager bug (a wrong block id, a bad prefix hit, a missed copy-on-write) therefore fails
loudly instead of passing silently. The next token is a function of the request's own tokens
only, so batching, chunking and preemption can never change a result.
"""
from __future__ import annotations

from pagedllm.core.outputs import RunnerOutput, SchedulerOutput, TokenLogprobs
from pagedllm.runner.input_batch import CachedRequestState, InputBatch


def fake_next_token(token_ids: list[int], vocab_size: int) -> int:
    """Deterministic next token from the first token, the last three and the length (O(1), so
    the scheduler benchmark is not dominated by it)."""
    a = token_ids[-1]
    b = token_ids[-2] if len(token_ids) > 1 else 7
    c = token_ids[-3] if len(token_ids) > 2 else 13
    return (a * 1_000_003 + b * 7_919 + c * 101 + token_ids[0] * 17 + len(token_ids) * 31) % vocab_size


def fake_generate(prompt_token_ids: list[int], max_tokens: int, vocab_size: int,
                  eos_token_ids: frozenset[int] = frozenset(), ignore_eos: bool = False,
                  min_tokens: int = 0, stop_token_ids: frozenset[int] = frozenset()) -> list[int]:
    """What the FakeRunner produces for one request run alone (the test oracle)."""
    tokens = list(prompt_token_ids)
    out: list[int] = []
    while len(out) < max_tokens:
        tok = fake_next_token(tokens, vocab_size)
        tokens.append(tok)
        out.append(tok)
        if len(out) >= min_tokens and ((not ignore_eos and tok in eos_token_ids) or tok in stop_token_ids):
            break
    return out


def fake_pooled(token_ids: list[int]) -> list[float]:
    """A pooling request's vector: a function of its whole input only, so chunking cannot
    change it (the test oracle)."""
    return [float(len(token_ids)), float(sum(token_ids)), float(token_ids[0]), float(token_ids[-1])]


def grammar_choice(mask: bytes, row: int, num_rows: int, token: int) -> int:
    """Structured outputs: ``token`` if row ``row`` of the packed bitmask allows it, else an
    allowed token picked from it deterministically (so a grammar is followed, not stalled on
    the same filler token), else ``token`` (an empty mask: nothing can be right)."""
    size = len(mask) // num_rows
    bits = mask[row * size:(row + 1) * size]
    if token < 8 * size and bits[token >> 3] >> (token & 7) & 1:
        return token
    allowed = [8 * i + b for i, byte in enumerate(bits) if byte for b in range(8) if byte >> b & 1]
    return allowed[token % len(allowed)] if allowed else token


class KVMismatchError(AssertionError):
    pass


class FakeRunner:
    def __init__(self, vocab_size: int = 1000, verify_kv: bool = True,
                 sliding_windows: tuple[int | None, ...] = (None,)) -> None:
        """``sliding_windows``: the fake model's KV cache groups, each with its window (None:
        full attention); a window group's check reads only the positions its window sees."""
        self.vocab_size = vocab_size
        self.verify_kv = verify_kv
        self.sliding_windows = tuple(sliding_windows)
        self.block_size = 0
        self.cache: list[list[int]] = []
        self.input_batch = InputBatch()
        self.num_steps = 0
        self.max_tokens_in_step = 0

    @property
    def requests(self) -> dict[str, CachedRequestState]:
        return self.input_batch.requests

    def determine_num_blocks(self, block_size: int) -> int:
        return 1024

    def get_kv_cache_groups(self) -> list[int | None]:
        return list(self.sliding_windows)

    def initialize_kv_cache(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.cache = [[-1] * block_size for _ in range(num_blocks)]

    def execute_model(self, so: SchedulerOutput) -> RunnerOutput:
        scheduled = self.input_batch.update_states(so)
        for src, dst in so.block_copies:
            self.cache[dst] = list(self.cache[src])
        self.num_steps += 1
        self.max_tokens_in_step = max(self.max_tokens_in_step, so.total_num_scheduled_tokens)

        # Write every new token first (like each layer writes its K/V before attending), so a
        # request may read blocks that another request fills in this same step.
        # One pool of blocks for every KV cache group: a block id belongs to one group at a time.
        bs = self.block_size
        for s in scheduled:
            for table in s.state.block_ids:
                for pos, tok in enumerate(s.input_ids, s.start):
                    self.cache[table[pos // bs]][pos % bs] = tok

        sampled: list[list[int]] = []
        logprobs: list[list[TokenLogprobs] | None] | None = None
        pooled: dict[str, list[float]] = {}
        for s in scheduled:
            state = s.state
            if self.verify_kv:
                self._verify(state, s.start, s.start + s.num_tokens - len(s.drafts))
            if not s.samples:
                sampled.append([])  # partial prefill or a pooling input: nothing to sample
                if s.pools:
                    pooled[state.req_id] = fake_pooled(state.token_ids)
                continue
            # Greedy verification of drafts against the deterministic "model".
            context = list(state.token_ids)
            out: list[int] = []
            mask = so.grammar_bitmask.get(state.req_id) if so.grammar_bitmask else None
            for j, d in enumerate([*s.drafts, None]):
                tok = fake_next_token(context, self.vocab_size)
                if mask is not None:
                    tok = grammar_choice(mask, j, len(s.drafts) + 1, tok)
                out.append(tok)
                if d is None or d != tok:
                    break
                context.append(tok)
            sampled.append(out)
            self.input_batch.append_sampled(s, out)
            if state.params.logprobs is not None:  # a fake distribution, led by the chosen token
                if logprobs is None:
                    logprobs = [None] * len(scheduled)
                logprobs[len(sampled) - 1] = [self._fake_logprobs(t, state.params.logprobs) for t in out]
        req_ids = list(so.num_scheduled_tokens)
        return RunnerOutput(req_ids, {rid: i for i, rid in enumerate(req_ids)}, sampled, logprobs,
                            pooler_output=pooled)

    def _fake_logprobs(self, token: int, k: int) -> TokenLogprobs:
        """The chosen token most likely, then the next ids in the vocabulary, each one less likely
        (deterministic, so beam search on the FakeRunner reproduces itself)."""
        top = [(token + i) % self.vocab_size for i in range(max(k, 1))]
        return TokenLogprobs([token, *top[:k]], [-0.5, *(-0.5 - i for i in range(k))],
                             [1, *range(1, k + 1)])

    def _verify(self, state: CachedRequestState, start: int, end: int) -> None:
        """Read back what queries [start, end) attend to, group by group: every position before
        ``end`` for full attention, (start - window, end) for a window group, which must never
        reach a null block (-1) or a block that was handed to someone else."""
        bs = self.block_size
        for window, table in zip(self.sliding_windows, state.block_ids):
            first = 0 if window is None else max(start - window + 1, 0)
            for pos in range(first, end):
                block_id = table[pos // bs]
                got = self.cache[block_id][pos % bs] if block_id >= 0 else None
                if got != state.token_ids[pos]:
                    raise KVMismatchError(
                        f"{state.req_id}: position {pos} (block {block_id}, window {window}) "
                        f"holds {got}, expected {state.token_ids[pos]}")
