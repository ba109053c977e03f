"""ModelRunner: SchedulerOutput -> tensors -> model -> sampler -> RunnerOutput.

The runner keeps a small state per request (its tokens, block table, progress) and receives only
diffs each step. It writes nothing the scheduler did not ask for: block ids and slot positions come
from the scheduler's block tables, so prefix hits and copy-on-write are the scheduler's decisions.
"""
from __future__ import annotations

import ctypes
import platform
from collections.abc import Iterable

import torch

from pagedllm.checkpoint.loader import load_model
from pagedllm.config import DTYPE_ALIASES, EngineConfig
from pagedllm.core.outputs import PromptLogprobsChunk, RunnerOutput, SchedulerOutput, TokenLogprobs
from pagedllm.errors import ValidationError
from pagedllm.layers.attention import get_attn_backend
from pagedllm.layers.attention.kv_cache_dtype import resolve_kv_cache_dtype
from pagedllm.layers.attention_metadata import AttentionMetadata, StagingBuffers, build_attention_metadata
from pagedllm.layers.forward_context import set_forward_context
from pagedllm.layers.kv_cache import allocate_kv_cache, attention_layers, bind_kv_caches, copy_blocks, kv_cache_layers
from pagedllm.lora.graph_weights import LoRAGraphInputs
from pagedllm.lora.manager import LoRAManager
from pagedllm.lora.mapping import set_lora_mapping
from pagedllm.lora.request import LoRARequest
from pagedllm.models.pooler import Pooler
from pagedllm.pooler_config import load_pooler_config
from pagedllm.runner.attention_choice import choose_cpu_attention
from pagedllm.runner.compile import compile_disabled_reason, maybe_compile
from pagedllm.runner.draft_model import DraftModel
from pagedllm.runner.eagle import EagleProposer
from pagedllm.runner.frame_chunks import keep_frame_chunks
from pagedllm.runner.grammar_bitmask import apply_grammar_bitmask
from pagedllm.runner.input_batch import CachedRequestState, InputBatch, ScheduledRequest
from pagedllm.runner.kv_cache_groups import KVCacheGroup, group_layers, layer_placement, plan_kv_tensors
from pagedllm.runner.ngram_drafter import NgramDrafter
from pagedllm.runner.sampler import Sampler, compute_topk_logprobs
from pagedllm.runner.sampling_batch import SamplingBatch, SamplingResult, SamplingRow
from pagedllm.runner.spec_decode import verify_drafts
from pagedllm.runner.step_inputs import gather_step_inputs
from pagedllm.runner_type import resolve_runner_type, serves_pooling
from pagedllm.speculative_config import SpeculativeConfig
from pagedllm.utils import cdiv
from pagedllm.weight_plan.plan import plan_weights
from pagedllm.weight_plan.weight_table import WeightRow

_DTYPES = {alias: getattr(torch, name) for alias, name in DTYPE_ALIASES.items()}
_CPU_DEFAULT_KV_BYTES = 1 << 30


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


class ModelRunner:
    def __init__(self, config: EngineConfig, max_model_len: int) -> None:
        mc = config.model_config
        self.config = config
        self.device = resolve_device(mc.device)
        self.dtype = resolve_dtype(mc.dtype, self.device)
        # The KV cache's dtype: the model's (auto) or a narrower one the backends cast K/V to
        # (checked before the weights load).
        self.kv_cache_dtype = resolve_kv_cache_dtype(config.cache_config.kv_cache_dtype, self.dtype)
        torch.manual_seed(mc.seed)
        self.model, self.hf_config = load_model(mc.model, self.dtype, self.device, mc.quantization)
        # A pooling model's step ends in the pooler instead of the sampler; a generator that
        # pools too ends in both, each for its own rows.
        self.pooler = (Pooler(load_pooler_config(mc.model, self.hf_config, config.pooler_config), self.model,
                              self.dtype, self.device, mc.tokenizer or mc.model)
                       if serves_pooling(resolve_runner_type(mc.runner, mc.model), config.pooler_config)
                       else None)
        # Every layer's weight format, decided once (weight_plan/plan.py), before the forward
        # compiles: layer name -> format, bytes, and each quantized or 16-bit format's activations.
        self._weight_table, self.activations = plan_weights(self.model, self.hf_config, self.device,
                                                            mc.quantization_activations, mc.quantization)
        if self.device.type == "cpu":
            _keep_freed_memory()  # after every load-time conversion: what they freed goes back
        keep_frame_chunks()  # before the first forward: Python's frame stack stays mapped
        # Adapters wrap the layers' formats, after every choice above (pagedllm/lora/); compiled,
        # the rows' slots are a tensor the graph reads (lora/graph_weights.py). An encoder compiles
        # like a generator (its attention is the same op). Each layer's KV spec: this rank's heads,
        # the cache's dtype (``_plan_kv_cache``).
        self._kv_layers = kv_cache_layers(self.model, self.kv_cache_dtype)
        encoder = not self._kv_layers
        eager = mc.enforce_eager  # None: auto
        graph_inputs = (LoRAGraphInputs(max(config.scheduler_config.max_num_batched_tokens, max_model_len, 16),
                                        self.device)
                        if config.lora_config.enable_lora and compile_disabled_reason(eager, self.device) is None
                        else None)
        self.lora_manager = (LoRAManager(self.model, config.lora_config, self.dtype, graph_inputs)
                             if config.lora_config.enable_lora else None)
        self.vocab_size = self.model.vocab_size
        self._token_types = getattr(self.model, "supports_token_types", False)  # a text pair's second segment
        spec = SpeculativeConfig.from_dict(config.speculative_config)
        self.drafter = (NgramDrafter(spec) if spec is not None and spec.method == "ngram"
                        and config.scheduler_config.async_scheduling
                        else None if spec is None or not spec.uses_draft_model
                        else EagleProposer(spec, self.model, mc.model, self.dtype, self.device, self.kv_cache_dtype)
                        if spec.reads_target_hidden_states
                        else DraftModel(spec, self.model, mc.model, self.dtype, self.device, self.kv_cache_dtype,
                                        mc.quantization_activations, mc.enforce_eager, max_model_len))
        # After the drafter: an EAGLE-3 head's hooks on the target's layers are traced with it.
        self.compiled = maybe_compile(self.model, eager, self.device, warmup_tokens=16)
        # A second graph for steps where no row uses an adapter: without the adapters' products.
        self.compiled_base = None if graph_inputs is None or self.compiled is None else \
            graph_inputs.without_adapters(lambda: maybe_compile(self.model, eager, self.device, warmup_tokens=16))
        self.sampler = Sampler()
        # The sampled rows' parameters, per random stream, kept across steps.
        self._sampling_batches: dict[int, SamplingBatch] = {}
        self.input_batch = InputBatch()
        self.kv_caches: list[torch.Tensor] = []
        self.attn_backend = get_attn_backend(mc.attention_backend, self.device.type)
        if mc.attention_backend == "auto" and self.attn_backend.name == "cpu_paged" and not encoder:
            # The kernel against the torch backend on this model's heads (the safety net).
            self.attn_backend = choose_cpu_attention(attention_layers(self.model),
                                                     self.kv_cache_dtype, self.dtype)
        self.block_size = 0
        self.max_model_len = max_model_len
        self._plan_kv_cache(max_model_len)

    def _plan_kv_cache(self, max_model_len: int) -> None:
        """The KV cache groups (full, each window) and tensors, planned from each layer's spec
        (the drafter's beside the target's), never from one model-wide geometry."""
        if self.drafter is not None:
            self._kv_layers = self._kv_layers + self.drafter.kv_layers
        # An encoder keeps no KV: one empty group, so the scheduler's block tables stay the same.
        self.kv_cache_groups = (group_layers([spec.sliding_window for _, spec in self._kv_layers], max_model_len)
                                if self._kv_layers else [KVCacheGroup(None, ())])
        self.kv_cache_tensors = plan_kv_tensors(self.kv_cache_groups,
                                                [spec.bytes_per_token for _, spec in self._kv_layers])
        self._windowed_groups = [g.sliding_window is not None for g in self.kv_cache_groups]
        # Host arrays each step's input ids and metadata are written into, one set per group.
        self._staging = [StagingBuffers() for _ in self.kv_cache_groups]

    # -- KV cache ----------------------------------------------------------------------------
    def get_kv_cache_groups(self) -> list[int | None]:
        return [g.sliding_window for g in self.kv_cache_groups]

    def bytes_per_block(self, block_size: int) -> int:
        """What one block id of the pool costs: a block in each KV tensor (runner/
        kv_cache_groups.py), each sized by the specs of the layers that use it."""
        return sum(t.page_size_bytes(block_size) for t in self.kv_cache_tensors)

    def determine_num_blocks(self, block_size: int) -> int:
        cc = self.config.cache_config
        if not self.kv_cache_tensors:  # no KV: block ids are bookkeeping, as many as requests can use
            return self.config.scheduler_config.max_num_seqs * cdiv(self.max_model_len, block_size)
        if cc.kv_cache_memory_bytes is not None:
            budget = cc.kv_cache_memory_bytes
        elif self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            # Leave room for activations: a generous fixed reserve plus the step's logits.
            reserve = (1 << 30) + 4 * self.config.scheduler_config.max_num_batched_tokens * self.vocab_size
            budget = int(total * cc.gpu_memory_utilization) - (total - free) - reserve
        else:
            budget = min(_CPU_DEFAULT_KV_BYTES, _total_ram_bytes() // 4)
        # What the budget holds; the engine caps a default budget at what the running requests
        # can use (engine/engine_core.py).
        num_blocks = max(budget // self.bytes_per_block(block_size), 0)
        if num_blocks < 1:
            raise ValueError("the KV cache budget does not hold a single block; give it more memory")
        return int(num_blocks)

    def initialize_kv_cache(self, num_blocks: int, block_size: int) -> None:
        tensors = self.kv_cache_tensors
        # Shared only by layers of equal bytes per block (the kernels read a contiguous cache, so
        # no padding): each tensor in its first layer's shape, the others view it in theirs.
        self.kv_caches = [allocate_kv_cache(self._kv_layers[t.layer_indices[0]][1].shape(
            num_blocks, block_size), self.kv_cache_dtype, self.device) for t in tensors]
        if tensors:
            bind_kv_caches([layer for layer, _ in self._kv_layers], self.kv_caches,
                           layer_placement(self.kv_cache_groups, tensors))
        self.block_size = block_size

    # -- one step ----------------------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> RunnerOutput:
        scheduled = self.input_batch.update_states(so)
        copy_blocks(self.kv_caches, so.block_copies)
        if not scheduled:
            return RunnerOutput.empty()
        draft_probs: dict[str, torch.Tensor | None] = {}
        num_drafts: dict[str, int] = {}  # requests whose draft model filled fewer slots
        if self.drafter is not None and not self.drafter.can_skip(scheduled):  # fills the slots, keeps q
            qs = self.drafter.propose(scheduled, self._attention_metadata, self._sampling_metadata)
            draft_probs = {s.state.req_id: q for s, q in zip(scheduled, qs)}
            slots = so.scheduled_spec_decode_tokens
            num_drafts = {s.state.req_id: len(s.drafts) for s in scheduled
                          if len(s.drafts) != len(slots.get(s.state.req_id, ()))}

        step = gather_step_inputs(scheduled)
        attn_md = self._attention_metadata(step.query_lens, step.num_computed, step.block_tables)
        ids_t = self._staging[0].fill("input_ids", step.input_ids, (len(step.input_ids),))
        if self.device.type != "cpu":
            ids_t = ids_t.to(self.device, non_blocking=True)
        lora_mapping = None if self.lora_manager is None else self.lora_manager.step_mapping(
            [(s.state.lora_request, s.num_tokens) for s in scheduled], self.device)
        token_types = self._token_type_ids(step.token_type_starts, len(step.input_ids))
        with set_forward_context(attn_md, token_types), set_lora_mapping(lora_mapping):
            # The metadata's positions are the model's: one tensor for both.
            # An adapter's trained embedding or experts run outside the graph: its steps run eagerly.
            compiled = self.compiled_base if lora_mapping is None and self.compiled_base is not None \
                else None if self.lora_manager is not None and self.lora_manager.eager_only else self.compiled
            hidden = (compiled or self.model)(ids_t, attn_md.positions)
        if self.drafter is not None:
            self.drafter.observe_target(scheduled, hidden)

        req_ids = [s.state.req_id for s in scheduled]
        out = RunnerOutput(req_ids=req_ids, req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
                           sampled_token_ids=[[] for _ in req_ids], num_draft_tokens=num_drafts or None)
        if step.prompt_logprob_jobs:
            out.prompt_logprobs = self._prompt_logprobs(hidden, step.prompt_logprob_jobs)
        if step.samplers:
            self._sample(hidden, step.samplers, out, so.grammar_bitmask, draft_probs)
        if step.poolers:
            self._pool(hidden, step.poolers, out)
        return out

    def _pool(self, hidden: torch.Tensor, poolers: list[tuple[ScheduledRequest, int]], out: RunnerOutput) -> None:
        """The vector of each pooling request whose input ends this step; a chunk before the
        last keeps the rows the pooler will read (``Pooler.carry``)."""
        states, inputs = [], []
        for s, row0 in poolers:
            rows, carried = hidden[row0:row0 + s.num_tokens], s.state.pooling_carry
            if not s.pools:
                carried.append(self.pooler.carry(rows))
                continue
            states.append(s.state)
            inputs.append(torch.cat([*carried, rows]) if carried else rows)
        if states:
            vectors = self.pooler(inputs, [st.pooling_params for st in states])
            out.pooler_output = {st.req_id: vec for st, vec in zip(states, vectors)}

    @property
    def weight_table(self) -> list[WeightRow]:
        """Layer name -> format, bytes; the adapters' tensors one row (their bytes change as they load)."""
        if self.lora_manager is None:
            return self._weight_table
        return [*self._weight_table, WeightRow("lora_adapters", "lora", self.lora_manager.nbytes)]

    # -- LoRA adapters -----------------------------------------------------------------------
    def add_lora(self, lora_request: LoRARequest) -> str | None:
        """Load an adapter; the reason as text (the executor raises it) if refused, else None."""
        if self.lora_manager is None:
            return "this engine serves no LoRA adapters; start it with enable_lora"
        try:
            self.lora_manager.add_lora(lora_request)
        except ValidationError as exc:
            return exc.message
        return None

    def remove_lora(self, lora_int_id: int) -> bool:
        return self.lora_manager is not None and self.lora_manager.remove_lora(lora_int_id)

    def _token_type_ids(self, segments: list[tuple[int, int]], num_tokens: int) -> torch.Tensor | None:
        """``[T]`` token types, 1 on a text pair's second segment; None when all are 0 or the
        model has no token types."""
        if not self._token_types or all(a == b for a, b in segments):
            return None
        types = torch.zeros(num_tokens, dtype=torch.long)
        for a, b in segments:
            types[a:b] = 1
        return types.to(self.device)

    def _attention_metadata(self, query_lens: list[int], num_computed: list[int],
                            block_tables: list[list[list[int]]]) -> AttentionMetadata:
        """The step's attention metadata; with several KV cache groups, one per group (the
        first carries them all, each layer picks its group's)."""
        windowed = self._windowed_groups
        if len(windowed) == 1:
            return build_attention_metadata(query_lens, num_computed, [t[0] for t in block_tables],
                                            self.block_size, self.device, self.attn_backend,
                                            has_null_blocks=windowed[0], buffers=self._staging[0])
        mds = [build_attention_metadata(query_lens, num_computed, [t[g] for t in block_tables],
                                        self.block_size, self.device, self.attn_backend,
                                        has_null_blocks=windowed[g], buffers=self._staging[g])
               for g in range(len(windowed))]
        mds[0].group_metadata = mds
        return mds[0]

    def _sample(self, hidden: torch.Tensor, samplers: list[tuple[ScheduledRequest, int]],
                out: RunnerOutput, grammar_bitmask: dict[str, bytes] | None = None,
                draft_probs: dict[str, torch.Tensor | None] | None = None) -> None:
        """Sample one token per request, or verify its drafts (``draft_probs``: a draft model's
        q per request; n-gram drafts have none), filling ``out`` in place; structured requests'
        rows are masked to what their grammar allows first."""
        # One row per logits position: (state, draft prefix before it, hidden row).
        rows: list[tuple[CachedRequestState, list[int], int]] = []
        groups: list[tuple[int, list[int]]] = []  # per request: (its first row, its drafts)
        for s, row in samplers:
            groups.append((len(rows), s.drafts))
            for j in range(len(s.drafts) + 1):
                rows.append((s.state, s.drafts[:j], row + j))
        logits = self._compute_logits(self._hidden_rows(hidden, [r[2] for r in rows]), (r[0] for r in rows))
        md, generators = self._sampling_metadata(rows)
        if grammar_bitmask:
            row_masks: list[bytes | None] = []
            for s, _ in samplers:  # 1 + len(drafts) rows each, packed back to back
                mask, k = grammar_bitmask.get(s.state.req_id), len(s.drafts) + 1
                size = len(mask) // k if mask else 0
                row_masks.extend([mask[j * size:(j + 1) * size] if mask else None for j in range(k)])
            apply_grammar_bitmask(logits, row_masks)

        if not any(drafts for _, drafts in groups):
            result = self.sampler(logits, md)
            outputs = [[result.sampled_token_ids[first]] for first, _ in groups]
            row_logprobs = result.logprobs
        else:
            greedy = [state.params.sampling_type_greedy for state, _, _ in rows]
            qs = [draft_probs.get(s.state.req_id) for s, _ in samplers] if draft_probs else None
            outputs = verify_drafts(logits, md, greedy, groups, generators, qs)
            row_logprobs = None
            if md.max_num_logprobs is not None:
                chosen = [0] * len(rows)  # rows past a rejection score token 0; nobody reads them
                for (first, _), toks in zip(groups, outputs):
                    chosen[first:first + len(toks)] = toks
                entries = compute_topk_logprobs(logits, chosen, [st.params.logprobs or 0 for st, _, _ in rows])
                row_logprobs = [e if st.params.logprobs is not None else None
                                for e, (st, _, _) in zip(entries, rows)]

        for (s, _), (first, _), toks in zip(samplers, groups, outputs):
            i = out.req_id_to_index[s.state.req_id]
            out.sampled_token_ids[i] = toks
            self.input_batch.append_sampled(s, toks)
            if row_logprobs is not None and row_logprobs[first] is not None:
                if out.logprobs is None:
                    out.logprobs = [None] * len(out.req_ids)
                out.logprobs[i] = [TokenLogprobs(*row_logprobs[first + j]) for j in range(len(toks))]

    def _compute_logits(self, hidden: torch.Tensor, states: Iterable[CachedRequestState]) -> torch.Tensor:
        """Logits of ``hidden``'s rows under their requests' adapters, for an adapter that trained
        the head (lora/vocab_format.py); without adapters, the head alone (``states`` unread)."""
        if self.lora_manager is None:
            return self.model.compute_logits(hidden)
        with set_lora_mapping(self.lora_manager.logits_mapping([s.lora_request for s in states], self.device)):
            return self.model.compute_logits(hidden)

    def _hidden_rows(self, hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """``hidden[rows]`` for increasing ``rows``; consecutive ones (every decode step) as a
        view, without an index tensor and its gather."""
        first, num = rows[0], len(rows)
        if rows[-1] - first == num - 1:
            return hidden if num == hidden.shape[0] else hidden[first:first + num]
        index = self._staging[0].fill("sample_rows", rows, (num,))
        return hidden[index if self.device.type == "cpu" else index.to(self.device)]

    def _prompt_logprobs(self, hidden: torch.Tensor, jobs: list[tuple[CachedRequestState, int, int, int]]
                         ) -> dict[str, PromptLogprobsChunk]:
        result = {}
        for state, row0, pos0, count in jobs:
            if count <= 0:
                continue
            logits = self._compute_logits(hidden[row0:row0 + count], [state] * count)
            targets = state.token_ids[pos0 + 1:pos0 + 1 + count]
            entries = compute_topk_logprobs(logits, targets, state.params.prompt_logprobs)
            result[state.req_id] = PromptLogprobsChunk(pos0 + 1, [TokenLogprobs(*e) for e in entries])
        return result

    def _sampling_metadata(self, rows: list[SamplingRow], stream: int = 0) -> SamplingResult:
        """``stream``: which of a seeded request's random streams its rows draw from (0: the
        sampler's and verifier's; a draft model samples from its own)."""
        batch = self._sampling_batches.get(stream)
        if batch is None:
            batch = self._sampling_batches[stream] = SamplingBatch(self.vocab_size, self.device, stream)
        return batch.prepare(rows)




def _keep_freed_memory() -> None:
    """Make glibc keep freed activation memory for the next step instead of returning it.

    By default glibc serves large blocks with mmap and gives them (and the top of the heap) back
    to the OS when freed, so every large activation of the next step page-faults its memory in
    again: a 2048-token prefill step took ~100k page faults, a quarter of its time. Like torch's
    CUDA caching allocator, keep it. Process-wide and idempotent; a no-op off glibc.

    What loading freed (safetensors' read buffers, the matrices replaced by packed panels, the
    kernel measurements' temporaries) is given back first: it lies in holes of the heap that
    glibc would otherwise keep, ~0.6x the checkpoint's size resident for nothing."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    libc.malloc_trim(0)
    m_trim_threshold, m_mmap_threshold = -1, -3  # from <malloc.h>
    libc.mallopt(m_mmap_threshold, 32 << 20)  # blocks up to 32 MiB from the heap (glibc's max)
    libc.mallopt(m_trim_threshold, 1 << 30)  # keep up to 1 GiB free at the top of the heap


def _total_ram_bytes() -> int:
    try:
        import os

        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 8 << 30
