"""The CPU default: a C++ kernel (kernels/csrc/paged_attention.cpp) that reads K/V in place from the
paged cache through the block tables, for the whole flat batch in one call per layer: decodes and
prefill chunks over a cached prefix. No gather, no second copy of the cache, no per-step masks:
causality comes from each request's query and sequence lengths. The same call first stores the
step's K/V in the cache (kernels/csrc/store_kv.h), two memcpy per token: one op per layer.

Prompts without a cached prefix need nothing from the cache: their own K/V (just written) go to
torch's SDPA, whose GEMM-based flash kernel is faster than ours at prefill shapes (many
query rows per key; docs/cpu_kernels.md#attention); the kernel skips them (sequence length 0 in its view of the batch).

The cache may be narrower than the model (kv_cache_dtype.py): K/V are cast when written, and the
kernel widens them to float32 as it reads; fresh prompts attend their K/V rounded the same way.

A layer with a sliding window, logit soft-capping or attention sinks runs every row in the
kernel, fresh prompts included: SDPA has no soft cap or sinks, and a window would need a dense
``[n, n]`` mask there, where the kernel reads only each row's window (``O(n * window)``).

A bidirectional layer (an encoder's) keeps no KV: plain, each request goes to SDPA as a fresh
prompt does; with a window or other features, the kernel reads the step's K/V from a scratch
cache (scratch_kv.py) with its causal flag off.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.kernels.cpu_extension import load_cpu_ops, load_paged_attention_op
from pagedllm.layers.attention.backend import AttentionBackend, AttentionLayer, AttentionMetadata, is_plain
from pagedllm.layers.attention.kv_cache_dtype import as_stored, to_cache_dtype
from pagedllm.layers.attention.scratch_kv import ScratchKV
from pagedllm.layers.attention.torch_backend import attend_causal, attend_each_request
from pagedllm.layers.attention.unified_attention import clear_step, set_step

__all__ = ["CpuPagedBackend", "load_paged_attention_op"]


class CpuPagedBackend(AttentionBackend):
    name = "cpu_paged"
    needs_gather_plan = False

    def __init__(self) -> None:
        ops = load_cpu_ops()
        if ops is None:
            raise RuntimeError("the cpu_paged attention kernel is not available")
        self._op = ops.paged_attention

    def prepare(self, md: AttentionMetadata) -> _Plan:
        qsl, computed = md.query_start_loc, md.num_computed_tokens
        fresh = [i for i in range(len(computed)) if computed[i] == 0 and qsl[i + 1] - qsl[i] > 1]
        if not fresh:
            return _Plan(md.seq_lens_tensor, [])
        seq_lens = list(md.seq_lens)
        for i in fresh:
            seq_lens[i] = 0
        kernel_seq_lens = torch.tensor(seq_lens, dtype=torch.long, device=md.seq_lens_tensor.device)
        return _Plan(kernel_seq_lens, [slice(qsl[i], qsl[i + 1]) for i in fresh])

    def enter_step(self, md: AttentionMetadata) -> None:
        groups = md.group_metadata or [md]
        set_step(md, [bool(g.backend_data.fresh_rows) for g in groups])

    def leave_step(self) -> None:
        clear_step()

    def forward(self, layer: AttentionLayer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                md: AttentionMetadata) -> torch.Tensor:
        # The kernel stores k/v (a narrower cache dtype cast first: one pass over the step's K/V).
        if not layer.causal:
            return self._bidirectional(layer, q, k, v, md)
        dtype = layer.kv_cache.dtype
        store = (to_cache_dtype(k, dtype), to_cache_dtype(v, dtype), md.slot_mapping)
        if not is_plain(layer):
            sinks = layer.sinks
            if sinks is not None:  # the kernel reads float32 logits (a copy only if cast to bf16)
                sinks = sinks.detach().float()
            return self._op(q, layer.kv_cache, md.block_tables, md.query_start_loc_tensor,
                            md.seq_lens_tensor, layer.scale, layer.sliding_window or 0,
                            layer.logits_soft_cap or 0.0, sinks, *store)
        plan: _Plan = md.backend_data
        # With only fresh prompts (no row for the kernel) the call stores and attends nothing.
        out = self._op(q, layer.kv_cache, md.block_tables, md.query_start_loc_tensor,
                       plan.seq_lens, layer.scale, 0, 0.0, None, *store)
        # Fresh prompts attend their K/V rounded as stored, as every later read of them will.
        for rows in plan.fresh_rows:
            out[rows] = attend_causal(q[rows], as_stored(k[rows], dtype), as_stored(v[rows], dtype),
                                      layer.scale)
        return out

    def _bidirectional(self, layer: AttentionLayer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       md: AttentionMetadata) -> torch.Tensor:
        if is_plain(layer):
            return attend_each_request(layer, q, k, v, md.query_start_loc)
        plan: _Plan = md.backend_data
        if plan.scratch is None:
            plan.scratch = ScratchKV(md.query_start_loc, md.block_size or 16, q.device)
        scratch = plan.scratch
        sinks = None if layer.sinks is None else layer.sinks.detach().float()
        return self._op(q, scratch.cache(layer.num_kv_heads, layer.head_dim, k.dtype), scratch.block_tables,
                        md.query_start_loc_tensor, scratch.seq_lens, layer.scale, layer.sliding_window or 0,
                        layer.logits_soft_cap or 0.0, sinks, k, v, scratch.slot_mapping, False)


@dataclass(slots=True)
class _Plan:
    seq_lens: torch.Tensor         # [B] long: the kernel's view, 0 for the fresh prompts it skips
    fresh_rows: list[slice]        # the fresh prompts' rows of the flat batch
    scratch: ScratchKV | None = None  # a bidirectional layer's K/V, laid out at its first use in the step
