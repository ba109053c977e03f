"""ModelRunner: SchedulerOutput -> tensors -> model -> sampler -> RunnerOutput.

The runner keeps a small state per request (its tokens, block table, progress) and receives only
diffs each step. It writes nothing the scheduler did not ask for: block ids and slot positions come
from the scheduler's block tables, so prefix hits and copy-on-write are the scheduler's decisions.
"""
from __future__ import annotations

import ctypes
import platform
from dataclasses import dataclass

import torch

from pagedllm.config import EngineConfig
from pagedllm.core.outputs import PromptLogprobsChunk, RunnerOutput, SchedulerOutput, TokenLogprobs
from pagedllm.engine.model_info import ModelInfo
from pagedllm.layers.attention_metadata import build_attention_metadata
from pagedllm.layers.decode_kv import DecodeKVStore
from pagedllm.layers.forward_context import set_forward_context
from pagedllm.layers.kv_cache import bind_kv_caches, copy_blocks, kv_cache_shape
from pagedllm.layers.linear import prepack_linear_weights
from pagedllm.models.loader import load_model
from pagedllm.runner.sampler import (Sampler, SamplingMetadata, compute_topk_logprobs, greedy_sample,
                                     is_plain_greedy)
from pagedllm.runner.spec_decode import verify_drafts
from pagedllm.sampling_params import SamplingParams

_DTYPES = {"float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
           "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "half": torch.float16, "fp16": torch.float16}
_CPU_DEFAULT_KV_BYTES = 1 << 30


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


@dataclass(slots=True)
class CachedRequestState:
    req_id: str
    token_ids: list[int]  # prompt + outputs known to the runner
    num_prompt_tokens: int
    params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    eos_token_ids: frozenset[int]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]


class ModelRunner:
    def __init__(self, config: EngineConfig, model_info: ModelInfo) -> None:
        mc = config.model_config
        self.config = config
        self.device = resolve_device(mc.device)
        self.dtype = resolve_dtype(mc.dtype, self.device)
        torch.manual_seed(mc.seed)
        self.model, self.hf_config = load_model(mc.model, self.dtype, self.device)
        if self.device.type == "cpu":
            _keep_freed_memory()
        if self.device.type == "cpu" and _param_bytes(self.model) * 4 < _total_ram_bytes():
            # A second, matmul-friendly copy of the linear weights (see layers/linear.py).
            prepack_linear_weights(self.model)
        self.vocab_size = self.model.vocab_size
        self.sampler = Sampler()
        self.requests: dict[str, CachedRequestState] = {}
        self.kv_caches: list[torch.Tensor] = []
        self.decode_kv: DecodeKVStore | None = None
        self.block_size = 0
        self.max_model_len = mc.max_model_len or model_info.max_position_embeddings

    # -- KV cache ----------------------------------------------------------------------------
    def bytes_per_block(self, block_size: int) -> int:
        m = self.model
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * m.num_layers * block_size * m.num_kv_heads * m.head_dim * elem

    def determine_num_blocks(self, block_size: int) -> int:
        cc = self.config.cache_config
        if cc.kv_cache_memory_bytes is not None:
            budget = cc.kv_cache_memory_bytes
        elif self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            # Leave room for activations: a generous fixed reserve plus the step's logits.
            reserve = (1 << 30) + 4 * self.config.scheduler_config.max_num_batched_tokens * self.vocab_size
            budget = int(total * cc.gpu_memory_utilization) - (total - free) - reserve
        else:
            budget = min(_CPU_DEFAULT_KV_BYTES, _total_ram_bytes() // 4)
        num_blocks = max(budget // self.bytes_per_block(block_size), 0)
        # Never more than every running request could fill at full length.
        useful = self.config.scheduler_config.max_num_seqs * (-(-self.max_model_len // block_size))
        if cc.kv_cache_memory_bytes is None:
            num_blocks = min(num_blocks, useful)
        if num_blocks < 1:
            raise ValueError("the KV cache budget does not hold a single block; give it more memory")
        return int(num_blocks)

    def initialize_kv_cache(self, num_blocks: int, block_size: int) -> None:
        m = self.model
        shape = kv_cache_shape(num_blocks, block_size, m.num_kv_heads, m.head_dim)
        # Zeros, not empty: masked-out slots are multiplied by zero weights, and 0 * NaN = NaN.
        self.kv_caches = [torch.zeros(shape, dtype=self.dtype, device=self.device)
                          for _ in range(m.num_layers)]
        bind_kv_caches(m, self.kv_caches)
        self.block_size = block_size
        if self.device.type == "cpu":
            # Decode attention without a per-step gather (see layers/decode_kv.py), holding at
            # most as many tokens as the paged cache.
            self.decode_kv = DecodeKVStore(m.num_layers, m.num_kv_heads, m.head_dim, self.dtype,
                                           self.device, max_tokens=num_blocks * block_size)

    # -- one step ----------------------------------------------------------------------------
    def _update_states(self, so: SchedulerOutput) -> None:
        store = self.decode_kv
        for rid in (*so.finished_req_ids, *so.preempted_req_ids):
            self.requests.pop(rid, None)
            if store is not None:
                store.release(rid)
        for new in so.scheduled_new_reqs:
            if store is not None:
                store.release(new.req_id)  # a resumed request starts over
            self.requests[new.req_id] = CachedRequestState(
                new.req_id, new.prompt_token_ids + new.output_token_ids, len(new.prompt_token_ids),
                new.sampling_params, list(new.block_ids), new.num_computed_tokens, new.eos_token_ids)
        cached = so.scheduled_cached_reqs
        for rid, blocks, num_computed, new_ids in zip(cached.req_ids, cached.new_block_ids,
                                                      cached.num_computed_tokens, cached.new_token_ids):
            state = self.requests[rid]
            if blocks:
                state.block_ids.extend(blocks)
            if new_ids:
                state.token_ids.extend(new_ids)
            # The scheduler's count wins: it rolls back past rejected drafts.
            state.num_computed_tokens = num_computed
        for rid, table in so.replaced_block_tables.items():
            self.requests[rid].block_ids = list(table)
            if store is not None:
                store.invalidate(rid)

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> RunnerOutput:
        self._update_states(so)
        copy_blocks(self.kv_caches, so.block_copies)
        if so.total_num_scheduled_tokens == 0:
            return RunnerOutput.empty()

        req_ids = list(so.num_scheduled_tokens)
        input_ids: list[int] = []
        positions: list[int] = []
        query_lens: list[int] = []
        num_computed: list[int] = []
        block_tables: list[list[int]] = []
        decodes: list[tuple[str, int, list[int]]] = []  # (rid, position, block table) if n == 1
        # Requests that sample this step: (state, first logits row, drafts to verify).
        samplers: list[tuple[CachedRequestState, int, list[int]]] = []
        prompt_lp_jobs: list[tuple[str, int, int, int]] = []  # (rid, first row, first pos, count)
        for rid in req_ids:
            state = self.requests[rid]
            n = so.num_scheduled_tokens[rid]
            drafts = so.scheduled_spec_decode_tokens.get(rid, [])
            start = state.num_computed_tokens
            n_real = n - len(drafts)
            row0 = len(input_ids)
            input_ids.extend(state.token_ids[start:start + n_real])
            input_ids.extend(drafts)
            positions.extend(range(start, start + n))
            query_lens.append(n)
            num_computed.append(start)
            block_tables.append(state.block_ids)
            if n == 1:
                decodes.append((rid, start, state.block_ids))
            if state.params.prompt_logprobs is not None and start < state.num_prompt_tokens - 1:
                # Logits at position p score prompt token p + 1.
                count = min(start + n_real, state.num_prompt_tokens - 1) - start
                prompt_lp_jobs.append((rid, row0, start, count))
            state.num_computed_tokens = start + n
            if start + n_real >= len(state.token_ids):  # caught up: sample (a partial prefill does not)
                samplers.append((state, row0 + n_real - 1, drafts))

        device = self.device
        ids_t = torch.tensor(input_ids, dtype=torch.long, device=device)
        pos_t = torch.tensor(positions, dtype=torch.long, device=device)
        plan = self.decode_kv.plan(decodes, self.block_size) if decodes and self.decode_kv else None
        attn_md = build_attention_metadata(query_lens, num_computed, block_tables, self.block_size,
                                           device, decode_kv=plan)
        with set_forward_context(attn_md):
            hidden = self.model(ids_t, pos_t)

        out = RunnerOutput(req_ids=req_ids, req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
                           sampled_token_ids=[[] for _ in req_ids])
        if prompt_lp_jobs:
            out.prompt_logprobs = self._prompt_logprobs(hidden, prompt_lp_jobs)
        if samplers:
            self._sample(hidden, samplers, so, out)
        return out

    def _sample(self, hidden: torch.Tensor, samplers: list[tuple[CachedRequestState, int, list[int]]],
                so: SchedulerOutput, out: RunnerOutput) -> None:
        """Sample one token per request (plus draft verification and the first token of forked
        children), filling ``out`` in place."""
        if not so.pending_forks and all(
                not drafts and is_plain_greedy(state.params, len(state.token_ids) - state.num_prompt_tokens)
                for state, _, drafts in samplers):
            # The common case, kept lean: logits of the sampled rows, one argmax, no metadata.
            index = torch.tensor([row for _, row, _ in samplers], device=self.device)
            tokens = greedy_sample(self.model.compute_logits(hidden[index])).tolist()
            for (state, _, _), token in zip(samplers, tokens):
                out.sampled_token_ids[out.req_id_to_index[state.req_id]] = [token]
            return
        # One virtual row per logits position: (state, params, draft prefix, hidden row).
        rows: list[tuple[CachedRequestState, SamplingParams, list[int], int]] = []
        groups: list[tuple[int, list[int]]] = []
        for state, row, drafts in samplers:
            groups.append((len(rows), drafts))
            for j in range(len(drafts) + 1):
                rows.append((state, state.params, drafts[:j], row + j))
            for _child_id, child_params in so.pending_forks.get(state.req_id, ()):
                rows.append((state, child_params, [], row))
        logits = self.model.compute_logits(hidden[torch.tensor([r[3] for r in rows], device=self.device)])
        md, generators = self._sampling_metadata(rows)
        index = {rid: i for i, rid in enumerate(out.req_ids)}

        # chosen[r]: the token picked at virtual row r; outputs[k]: request k's new tokens.
        if not any(drafts for _, _, drafts in samplers):
            result = self.sampler(logits, md)
            chosen: list[int | None] = list(result.sampled_token_ids)
            outputs = [[chosen[first]] for first, _ in groups]
            row_logprobs = result.logprobs
        else:
            greedy = [p.sampling_type_greedy for _, p, _, _ in rows]
            outputs = verify_drafts(logits, md, greedy, groups, generators)
            chosen = [None] * len(rows)
            for (first, _), toks in zip(groups, outputs):
                chosen[first:first + len(toks)] = toks
            for r, (state, params, _, _) in enumerate(rows):
                if state.params is not params:  # a fork's first token: plain sampling
                    chosen[r] = self.sampler(logits[r:r + 1], self._sampling_metadata([rows[r]])[0]).sampled_token_ids[0]
            row_logprobs = None
            if md.max_num_logprobs is not None:
                ks = [p.logprobs or 0 for _, p, _, _ in rows]
                entries = compute_topk_logprobs(logits, [c if c is not None else 0 for c in chosen], ks)
                row_logprobs = [e if p.logprobs is not None and c is not None else None
                                for e, (_, p, _, _), c in zip(entries, rows, chosen)]

        for (state, _row, drafts), (first, _), toks in zip(samplers, groups, outputs):
            rid = state.req_id
            out.sampled_token_ids[index[rid]] = toks
            if row_logprobs is not None and row_logprobs[first] is not None:
                if out.logprobs is None:
                    out.logprobs = [None] * len(out.req_ids)
                out.logprobs[index[rid]] = [TokenLogprobs(*row_logprobs[first + j]) for j in range(len(toks))]
            forks = so.pending_forks.get(rid, ())
            if forks:
                base = first + len(drafts) + 1
                out.fork_token_ids[rid] = [chosen[base + c] for c in range(len(forks))]
                if row_logprobs is not None:
                    out.fork_logprobs[rid] = [TokenLogprobs(*row_logprobs[base + c]) if row_logprobs[base + c] else None
                                              for c in range(len(forks))]

    def _prompt_logprobs(self, hidden: torch.Tensor,
                         jobs: list[tuple[str, int, int, int]]) -> dict[str, PromptLogprobsChunk]:
        result = {}
        for rid, row0, pos0, count in jobs:
            if count <= 0:
                continue
            state = self.requests[rid]
            logits = self.model.compute_logits(hidden[row0:row0 + count])
            targets = state.token_ids[pos0 + 1:pos0 + 1 + count]
            entries = compute_topk_logprobs(logits, targets, state.params.prompt_logprobs)
            result[rid] = PromptLogprobsChunk(pos0 + 1, [TokenLogprobs(*e) for e in entries])
        return result

    def _sampling_metadata(self, rows: list[tuple[CachedRequestState, SamplingParams, list[int], int]]
                           ) -> tuple[SamplingMetadata, list[torch.Generator | None]]:
        params, prompts, outputs = [], [], []
        generators: list[torch.Generator | None] = []
        stop_masks: list[frozenset[int]] = []
        for state, p, prefix, _ in rows:
            out = state.output_token_ids + prefix if prefix else state.output_token_ids
            params.append(p)
            prompts.append(state.token_ids[:state.num_prompt_tokens])
            outputs.append(out)
            if p.seed is not None and not p.sampling_type_greedy:
                # One stream per (seed, output position): the draw for token i does not depend
                # on the batch, on earlier steps, or on whether the request was preempted.
                g = torch.Generator(device=self.device)
                g.manual_seed((p.seed * 1_000_003 + len(out)) % (1 << 63))
                generators.append(g)
            else:
                generators.append(None)
            if len(out) < p.min_tokens:
                ids = p.all_stop_token_ids if p.ignore_eos else (p.all_stop_token_ids | state.eos_token_ids)
                stop_masks.append(ids)
            else:
                stop_masks.append(frozenset())
        md = SamplingMetadata.build(params, prompts, outputs, generators, stop_masks,
                                    self.vocab_size, self.device)
        return md, generators

def _keep_freed_memory() -> None:
    """Make glibc keep freed activation memory for the next step instead of returning it.

    By default glibc serves large blocks with mmap and gives them (and the top of the heap) back
    to the OS when freed, so every large activation of the next step page-faults its memory in
    again: a 2048-token prefill step took ~100k page faults, a quarter of its time. Like torch's
    CUDA caching allocator, keep it. Process-wide and idempotent; a no-op off glibc."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    m_trim_threshold, m_mmap_threshold = -1, -3  # from <malloc.h>
    libc.mallopt(m_mmap_threshold, 32 << 20)  # blocks up to 32 MiB from the heap (glibc's max)
    libc.mallopt(m_trim_threshold, 1 << 30)  # keep up to 1 GiB free at the top of the heap


def _param_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _total_ram_bytes() -> int:
    try:
        import os

        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 8 << 30
