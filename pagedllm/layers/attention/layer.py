"""The attention layer models use: the step's backend writes the step's K/V into the paged
cache, then attends.

KV cache of one layer: ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (index 0 = keys,
1 = values). Writing first matters: requests scheduled in the same step may share blocks
(identical prompts), and the reader must see the writer's K/V.

Under torch.compile the whole layer (cache write, forward-context lookup, backend, C++ kernel)
is one opaque custom op, ``pagedllm::unified_attention`` on CPU (straight to the kernel,
unified_attention.py) or ``pagedllm::attention`` (this layer in Python): dynamo traces the
model around it without a graph break and never sees the step's metadata (Python lists, a backend object) or the cache,
which the op reaches through the layer it names. Its fake implementation only says the output
shape. Eagerly the layer calls the same function directly: the dispatcher would add a few
microseconds per layer and buy nothing.
"""
from __future__ import annotations

import torch
from torch import nn

from pagedllm.errors import ModelLoadError
from pagedllm.kernels.op_registry import LayerRegistry, layer_op
from pagedllm.layers.attention.kv_cache_spec import KVCacheSpec
from pagedllm.layers.attention.torch_backend import attend_sequence
from pagedllm.layers.attention.unified_attention import available_on_cpu
from pagedllm.layers.forward_context import get_attn_metadata


class Attention(nn.Module):
    """Scaled dot-product attention over the paged KV cache of layer ``layer_idx``.

    ``forward(q [T, H, D], k [T, Hkv, D], v [T, Hkv, D]) -> [T, H * D]`` where rope has already
    been applied. ``kv_cache`` is bound by the runner (see ``bind_kv_caches``).

    Per-layer variations (transformers' semantics; None / False: plain causal attention):
    ``sliding_window``: a query at position p sees the keys at positions (p - window, p] (Mistral,
    Gemma 2/3's local layers, GPT-OSS); ``logits_soft_cap``: scores become
    ``cap * tanh(scores / cap)`` after the scale, before the mask (Gemma 2); ``has_sinks``: a
    learned logit per query head joins the softmax's denominator (GPT-OSS), ``self.sinks``, for
    this rank's heads, filled by the model's loader; ``causal=False``: every token sees every
    token of its request (an encoder's, an embedder's bidirectional layer), a window then
    reaching as far after a position as before it.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 layer_idx: int, sliding_window: int | None = None,
                 logits_soft_cap: float | None = None, has_sinks: bool = False, causal: bool = True) -> None:
        super().__init__()
        # From a checkpoint's config: a bad value is the model's, not the caller's.
        if sliding_window is not None and (isinstance(sliding_window, bool)
                                           or not isinstance(sliding_window, int) or sliding_window < 1):
            raise ModelLoadError(f"attention layer {layer_idx}: sliding_window={sliding_window!r} "
                                 "is unsupported; expected a positive int or None")
        if logits_soft_cap is not None and not logits_soft_cap > 0:
            raise ModelLoadError(f"attention layer {layer_idx}: logits_soft_cap={logits_soft_cap!r} "
                                 "is unsupported; expected a positive float or None")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.layer_idx = layer_idx
        self.num_groups = num_heads // num_kv_heads
        self.sliding_window = sliding_window
        self.causal = causal
        self.logits_soft_cap = None if logits_soft_cap is None else float(logits_soft_cap)
        self.sinks: torch.Tensor | None = None
        if has_sinks:
            self.sinks = nn.Parameter(torch.empty(num_heads))
        # A plain attribute (not a buffer): the runner owns the cache memory, and model.to() or
        # state_dict() must not copy or save it. Empty until bound.
        self.kv_cache: torch.Tensor = torch.empty(0, device="cpu")
        # Its KV cache group: whose block tables it reads (set by bind_kv_caches).
        self.kv_cache_group = 0
        # How the compiled graph names this layer (layers/op_registry.py).
        self._op_id = _layers_by_op_id.register(self)

    def kv_cache_spec(self, kv_cache_dtype: torch.dtype) -> KVCacheSpec | None:
        """What this layer keeps in the cache, whose dtype the runner decides; None: no KV."""
        if not self.causal:  # it only ever runs whole inputs, so nothing it computes is read again
            return None
        return KVCacheSpec(self.num_kv_heads, self.head_dim, kv_cache_dtype, self.sliding_window)

    def extra_repr(self) -> str:
        extra = "".join(f", {name}={value}" for name, value in (
            ("sliding_window", self.sliding_window), ("logits_soft_cap", self.logits_soft_cap),
            ("causal", False if not self.causal else None),
            ("sinks", True if self.sinks is not None else None)) if value is not None)
        return (f"layer_idx={self.layer_idx}, heads={self.num_heads}, kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}{extra}")

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            # No Python per layer in a compiled step (unified_attention.py).
            if q.device.type == "cpu" and available_on_cpu():
                return torch.ops.pagedllm.unified_attention(
                    q, k, v, self._op_id, self.scale, self.sliding_window or 0, self.logits_soft_cap or 0.0,
                    self.sinks)
            return torch.ops.pagedllm.attention(q, k, v, self._op_id)
        return self.attend(q, k, v)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The layer's work, always eager: ``[T, H, D]`` x 3 -> ``[T, H * D]`` contiguous (what
        the op's fake implementation promises the compiled graph)."""
        num_tokens = q.shape[0]
        md = get_attn_metadata()
        if md is None:  # no step: one sequence, no cache (warm-up, profiling)
            return attend_sequence(self, q, k, v).reshape(num_tokens, -1)
        if self.causal and self.kv_cache.dim() != 5:
            raise RuntimeError(f"attention layer {self.layer_idx} has no KV cache bound; "
                               "call bind_kv_caches(model, kv_caches) first")
        if md.group_metadata is not None:  # several KV cache groups: read this layer's own
            md = md.group_metadata[self.kv_cache_group]
        return md.backend.forward(self, q, k, v, md).reshape(num_tokens, -1)  # [T, H * D]


_layers_by_op_id: LayerRegistry[Attention] = LayerRegistry()


@layer_op("attention")
def attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int) -> torch.Tensor:
    """Attention layer ``layer_id`` on the current forward context. It writes the step's K/V into
    that layer's cache, a tensor outside the graph: nothing in the graph reads the cache, and
    each layer's op depends on the previous layer's output, so the order is kept without
    declaring the mutation (declared, functionalization would copy the cache)."""
    return _layers_by_op_id[layer_id].attend(q, k, v).contiguous()  # a no-op unless it is not


@torch.library.register_fake("pagedllm::attention")
def _attention_fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int) -> torch.Tensor:
    return q.new_empty((q.shape[0], q.shape[1] * q.shape[2]))
