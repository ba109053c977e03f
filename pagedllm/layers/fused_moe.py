"""The experts of a mixture-of-experts layer, stored fused per layer (vLLM's FusedMoE).

Weights: ``gate_up_proj`` ``[E, 2 * I, H]`` (each expert's gate rows, then its up rows) and
``down_proj`` ``[E, H, I]``, the layout transformers 5 keeps in memory. Checkpoints come in two
spellings: one tensor per expert and projection (``experts.N.gate_proj.weight``, what
transformers 5 writes for these families and what the Hub holds; Mixtral's ``w1``/``w3``/``w2``)
or the fused tensors themselves (``experts.gate_up_proj``, ``experts.down_proj``); the loader
takes either (``checkpoint_tensors``, ``fused_checkpoint_tensors``). GPT-OSS stores the fused
tensors transposed with gate and up columns alternating (``ExpertLayout.TRANSPOSED_INTERLEAVED``:
``gate_up_proj [E, H, 2I]``, ``down_proj [E, I, H]``), with per-expert biases, or as MXFP4
blocks and scales (layers/quantization/mxfp4.py) in the rows' orientation; whatever the spelling,
after ``process_weights_after_loading`` the layer holds the layout above (gate rows then up rows)
in the model dtype, so one compute path serves every family. The activation is a module taking
``[..., 2I]`` (gate half, up half): SwiGLU by name, or a family's own (GPT-OSS's clamped one).

Tensor parallelism splits every expert's intermediate dimension: a rank holds ``I / tp`` rows of
each expert's gate and up and the matching columns of its down, so each rank's result is a
partial sum of the layer's output, all-reduced once per layer (after the shared expert's partial
sum, where the family has one) -- the row-parallel path of the dense MLP.

On CPU, where the skinny kernel runs (layers/linear.py), the planning pass
(weight_plan/plan.py) holds the experts for it: float32 experts as panels, experts in another
format as stacked ``QuantizedWeight``s (bfloat16/float16 in their precision, and a quantized
checkpoint's (GGUF, AWQ/GPTQ) as it holds them, unpacked per expert by the loader,
checkpoint/quantized_layers.py, so their float matrices are never allocated). The
whole layer after the routing is then one C++ op, ``pagedllm::fused_experts``
(csrc/fused_moe.cpp): the tokens grouped by expert, each projection one grouped kernel call over
every active expert's tokens (one parallel region streaming the experts' weights), the
activation, and each token's weighted sum. A row's sums run in the same order whatever the
number of rows, so a token's output does not depend on which other tokens share its step or its
expert (torch's matmul picks kernels by the row count). Elsewhere (GPU, no kernel for this CPU)
the tokens are grouped in Python and each active expert is an ``F.linear``; under torch.compile
that loop (its trip count depends on the routing) is one opaque custom op per layer,
``pagedllm::fused_moe_experts``, found by number like attention's (layers/op_registry.py). The
routing stays in the graph either way.
"""
from __future__ import annotations

from enum import Enum

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.distributed.parallel_state import get_tp_group
from pagedllm.distributed.tp_sizes import split_size
from pagedllm.errors import UnsupportedModelError
from pagedllm.kernels.op_registry import LayerRegistry, layer_op
from pagedllm.layers.activation import GatedActivation
from pagedllm.layers.linear import WeightSlice
from pagedllm.layers.moe_router import RoutingOrder, check_routing, select_experts
from pagedllm.layers.quantization.mxfp4 import BLOCK_SIZE
from pagedllm.layers.weight_format import MXFP4, Dense, WeightFormat


class ExpertLayout(str, Enum):
    """How the fused checkpoint tensors lie (the per-expert spelling is nn.Linear's)."""

    STACKED = "stacked"  # gate_up_proj [E, 2I, H], gate rows then up rows; down_proj [E, H, I]
    # GPT-OSS: gate_up_proj [E, H, 2I] with column 2i gate unit i and 2i + 1 up unit i;
    # down_proj [E, I, H]. No per-expert spelling.
    TRANSPOSED_INTERLEAVED = "transposed_interleaved"


WEIGHT_FORMATS = ("mxfp4",)  # besides the model dtype (None)


class FusedMoE(nn.Module):
    """``forward(hidden [T, H], router_logits [T, E]) -> [T, H]``: each token's top-k experts'
    gated MLPs, weighted by the router. With ``reduce_results`` False the result is this rank's
    partial sum (the caller adds to it and all-reduces once)."""

    PROJECTIONS = ("gate_up_proj", "down_proj")

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 hidden_act: str, renormalize: bool,
                 order: RoutingOrder = RoutingOrder.SOFTMAX_TOPK,
                 expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
                 reduce_results: bool = True, activation: nn.Module | None = None,
                 bias: bool = False, layout: ExpertLayout = ExpertLayout.STACKED,
                 weight_format: str | None = None) -> None:
        super().__init__()
        check_routing(num_experts, top_k)
        if weight_format is not None and weight_format not in WEIGHT_FORMATS:
            raise UnsupportedModelError(f"expert weight format {weight_format!r} is not supported; "
                                        f"supported: the model dtype, {', '.join(WEIGHT_FORMATS)}")
        self.tp = get_tp_group()
        self.num_experts, self.top_k = num_experts, top_k
        self.hidden_size = hidden_size
        self.full_intermediate_size = intermediate_size
        self.intermediate_size = split_size(intermediate_size, self.tp.world_size,
                                            "expert intermediate size")  # this rank's
        self.renormalize, self.order = renormalize, RoutingOrder(order)
        self.expert_names = expert_names
        self.reduce_results = reduce_results
        self.act = GatedActivation(hidden_act) if activation is None else activation
        self.layout, self.weight_format = ExpertLayout(layout), weight_format
        inter = self.intermediate_size
        # Until process_weights_after_loading: gate_up rows alternate gate and up units.
        self._rows_interleaved = self.layout == ExpertLayout.TRANSPOSED_INTERLEAVED
        self._mxfp4_loaded = weight_format == "mxfp4"  # blocks and scales until processed
        if weight_format == "mxfp4":
            self._init_mxfp4(num_experts, hidden_size, inter)
        else:
            self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden_size))
            self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, inter))
        self.gate_up_proj_bias = self.down_proj_bias = None
        if bias:  # down's is added once, on rank 0: the ranks' partial sums are all-reduced
            self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, 2 * inter))
            self.down_proj_bias = nn.Parameter(torch.empty(num_experts, hidden_size))
        # Projection name -> how its experts are held: float32 panels [E, panels, in, 64]
        # (Panels), the experts' weights in another format (bf16/fp16, a quantized checkpoint's
        # q8/q4) stacked (QuantizedWeight.stack: Half, Blocks), or the float parameter itself on
        # torch's matmul (Dense). Set by the planning pass (weight_plan/plan.py); one copy either way.
        self.expert_formats: dict[str, WeightFormat] = {}
        self._op_id = _layers_by_op_id.register(self)  # how a compiled graph names this layer
        self.lora = None  # adapters' updates of the experts, set with enable_lora (lora/expert_format.py)

    def _init_mxfp4(self, num_experts: int, hidden: int, inter: int) -> None:
        """uint8 blocks and scales in the checkpoint's row orientation, [E, rows, in / 32(, 16)];
        the float weights appear at process_weights_after_loading."""
        if self.layout != ExpertLayout.TRANSPOSED_INTERLEAVED:
            raise UnsupportedModelError(
                f"MXFP4 experts in the {self.layout.value} layout are not supported; supported: "
                "GPT-OSS's (transposed_interleaved)")
        if hidden % BLOCK_SIZE or inter % BLOCK_SIZE:
            raise UnsupportedModelError(
                f"MXFP4 experts with hidden size {hidden} and intermediate size {inter} per rank "
                f"are not supported; supported: both multiples of {BLOCK_SIZE}")
        def packed(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.empty(*shape, dtype=torch.uint8), requires_grad=False)
        g_in, g_inter = hidden // BLOCK_SIZE, inter // BLOCK_SIZE
        self.gate_up_proj_blocks = packed(num_experts, 2 * inter, g_in, BLOCK_SIZE // 2)
        self.gate_up_proj_scales = packed(num_experts, 2 * inter, g_in)
        self.down_proj_blocks = packed(num_experts, hidden, g_inter, BLOCK_SIZE // 2)
        self.down_proj_scales = packed(num_experts, hidden, g_inter)
        self.register_parameter("gate_up_proj", None)
        self.register_parameter("down_proj", None)
        # model.to(dtype) casts float buffers: this empty one carries the model dtype to the
        # dequantization (uint8 parameters keep theirs).
        self.register_buffer("_dtype_probe", torch.empty(0), persistent=False)

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, top_k={self.top_k}, hidden={self.hidden_size}, "
                f"intermediate={self.intermediate_size}, order={self.order.value}, "
                f"renormalize={self.renormalize}, bias={self.down_proj_bias is not None}, "
                f"layout={self.layout.value}, format={self.weight_format}, "
                f"held={ {name: fmt.describe() for name, fmt in self.expert_formats.items()} }")

    # -- loading -------------------------------------------------------------------------------
    def checkpoint_tensors(self, attr: str, param: torch.Tensor) -> dict[str, WeightSlice]:
        """Per-expert spelling: checkpoint name (relative to this module) -> where it goes.
        A layout without one names its fused tensor, so a missing one is reported by name."""
        if self.layout != ExpertLayout.STACKED:  # one piece each (fused_checkpoint_tensors)
            (piece,) = self.fused_checkpoint_tensors(attr, param)
            return {attr: piece}
        gate, up, down = self.expert_names
        kind = "bias" if attr.endswith("_bias") else "weight"
        size, rank_start = self.intermediate_size, self.tp.rank * self.intermediate_size
        full = self.full_intermediate_size
        names: dict[str, WeightSlice] = {}
        for e in range(self.num_experts):
            if attr.startswith("gate_up_proj"):
                names[f"{e}.{gate}.{kind}"] = WeightSlice(param[e, :size], None, 0, rank_start,
                                                          full)
                names[f"{e}.{up}.{kind}"] = WeightSlice(param[e, size:], None, 0, rank_start, full)
            elif attr == "down_proj_bias":  # replicated: every rank holds all H
                names[f"{e}.{down}.bias"] = WeightSlice(param[e])
            else:
                names[f"{e}.{down}.weight"] = WeightSlice(param[e], None, 1, rank_start, full)
        return names

    def fused_checkpoint_tensors(self, attr: str, param: torch.Tensor) -> list[WeightSlice]:
        """Fused spelling: the pieces of the checkpoint tensor named ``attr`` (the same name as
        the parameter) that fill ``param``: this rank's gate rows and up rows of every expert,
        or its columns of every down."""
        size, rank_start = self.intermediate_size, self.tp.rank * self.intermediate_size
        full = self.full_intermediate_size
        if attr == "down_proj_bias":
            return [WeightSlice(param)]
        transposed = self.layout == ExpertLayout.TRANSPOSED_INTERLEAVED
        if attr.startswith("down_proj"):
            if attr != "down_proj":  # MXFP4 blocks/scales [E, H, I / 32(, 16)]: whole blocks
                return [WeightSlice(param, None, 2, rank_start // BLOCK_SIZE, full // BLOCK_SIZE)]
            if transposed:  # [E, I, H] in the checkpoint
                return [WeightSlice(param.transpose(1, 2), None, 1, rank_start, full)]
            return [WeightSlice(param, None, 2, rank_start, full)]
        # gate_up: weight, bias, MXFP4 blocks or scales; the units run along dim 1 (rows)
        # except for the transposed weight.
        if transposed:
            dest, dim = (param.transpose(1, 2), 2) if attr == "gate_up_proj" else (param, 1)
            # Interleaved, a rank's units [start, start + size) are the 2 * size consecutive
            # columns from 2 * start: one slice (de-interleaved after loading).
            return [WeightSlice(dest, None, dim, 2 * rank_start, 2 * full)]
        return [WeightSlice(param[:, :size], None, 1, rank_start, 2 * full),
                WeightSlice(param[:, size:], None, 1, full + rank_start, 2 * full)]

    def drop_float_projection(self, attr: str) -> None:
        """On the meta model: projection ``attr``'s experts will come as the checkpoint's blocks
        (the planning pass's ``hold_checkpoint_experts``), so its float parameter is never
        allocated."""
        self.register_parameter(attr, None)

    @torch.no_grad()
    def process_weights_after_loading(self) -> None:
        """Dequantize MXFP4 experts, de-interleave: the layout every family shares. Each step
        runs once; the format the experts run in is the planning pass's (weight_plan/plan.py)."""
        if self._mxfp4_loaded:  # the checkpoint's blocks and scales, dequantized (exact)
            dtype = self._dtype_probe.dtype
            gate_up = MXFP4(self.gate_up_proj_blocks, self.gate_up_proj_scales)
            down = MXFP4(self.down_proj_blocks, self.down_proj_scales)
            self.gate_up_proj = nn.Parameter(gate_up.dequantize(dtype), requires_grad=False)
            self.down_proj = nn.Parameter(down.dequantize(dtype), requires_grad=False)  # [E, rows, in]
            del self.gate_up_proj_blocks, self.gate_up_proj_scales
            del self.down_proj_blocks, self.down_proj_scales
            self._mxfp4_loaded = False
        if self._rows_interleaved:
            # [g0, u0, g1, u1, ...] -> [g0, g1, ..., u0, u1, ...]: GatedActivation's halves.
            rows = 2 * self.intermediate_size
            order = torch.cat((torch.arange(0, rows, 2), torch.arange(1, rows, 2)))
            order = order.to(self.gate_up_proj.device)
            self.gate_up_proj.data = self.gate_up_proj.data[:, order].contiguous()
            if self.gate_up_proj_bias is not None:
                self.gate_up_proj_bias.data = self.gate_up_proj_bias.data[:, order].contiguous()
            self._rows_interleaved = False

    def float_weights(self) -> dict[str, torch.Tensor]:
        """Projection name -> its float parameter ``[E, out, in]``, for those in no format yet."""
        weights = {"gate_up_proj": self.gate_up_proj, "down_proj": self.down_proj}
        return {name: w for name, w in weights.items()
                if w is not None and name not in self.expert_formats}

    def hold(self, name: str, fmt: WeightFormat) -> None:
        """Projection ``name``'s experts multiplied through ``fmt`` (weight_plan/plan.py
        decides which); its float parameter goes, except under ``Dense``, whose tensor it is."""
        self.expert_formats[name] = fmt
        if not isinstance(fmt, Dense):
            self.register_parameter(name, None)

    # -- compute -------------------------------------------------------------------------------
    def forward(self, hidden_states: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = select_experts(router_logits, self.top_k, self.renormalize,
                                                self.order)
        if not torch.compiler.is_compiling() and self.lora is not None:
            out = self.lora.forward(hidden_states, topk_weights, topk_ids, self._experts)
        else:
            out = self._experts(hidden_states, topk_weights, topk_ids)
        if self.reduce_results and self.tp.world_size > 1:
            out = self.tp.all_reduce(out)
        return out

    def _experts(self, x: torch.Tensor, topk_weights: torch.Tensor,
                 topk_ids: torch.Tensor) -> torch.Tensor:
        if self._experts_in_kernel():
            return self._fused_experts(x, topk_weights, topk_ids)
        if torch.compiler.is_compiling():
            return torch.ops.pagedllm.fused_moe_experts(x, topk_weights, topk_ids, self._op_id)
        return self.apply_experts(x, topk_weights, topk_ids)

    def _experts_in_kernel(self) -> bool:
        """Both projections held for the CPU kernels (panels or stacked codes), not ``Dense``."""
        return (len(self.expert_formats) == len(self.PROJECTIONS)
                and not any(isinstance(f, Dense) for f in self.expert_formats.values()))

    def _fused_experts(self, x: torch.Tensor, topk_weights: torch.Tensor,
                       topk_ids: torch.Tensor) -> torch.Tensor:
        """Every active expert's gated MLP and each token's weighted sum in one C++ op
        (``pagedllm::fused_experts``, csrc/fused_moe.cpp): the tokens grouped by expert, each
        projection one grouped kernel call over all active experts, in float32."""
        activation, alpha, limit = self.act.kernel_activation()
        gate_up, down = self.expert_formats["gate_up_proj"], self.expert_formats["down_proj"]
        # One activations setting serves both projections (the kernel takes one flag).
        narrow = gate_up.activations != "float32" or down.activations != "float32"
        bias_1, bias_2 = self.gate_up_proj_bias, self.down_proj_bias
        out = torch.ops.pagedllm.fused_experts(
            x.float(), topk_weights.float(), topk_ids, *gate_up.kernel_args(),
            *down.kernel_args(), None if bias_1 is None else bias_1.float(),
            None if bias_2 is None or self.tp.rank != 0 else bias_2.float(),
            self.intermediate_size, activation, alpha, limit, narrow)
        return out.to(x.dtype)

    def apply_experts(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                      expert=None) -> torch.Tensor:
        """``sum_j w[t, j] * expert_{ids[t, j]}(x[t])`` for every token ``t``, expert by expert
        with ``F.linear`` (where the CPU kernels do not hold the experts), or by
        ``expert(e, rows, their tokens)`` (an adapter's, lora/expert_format.py)."""
        num_tokens, top_k = topk_ids.shape
        flat_ids = topk_ids.flatten()  # [T * k]: token t's j-th choice at t * k + j
        # Group the (token, choice) pairs by expert; stable, so tokens stay in order within one.
        order = torch.argsort(flat_ids, stable=True)
        counts = torch.bincount(flat_ids, minlength=self.num_experts).tolist()
        tokens = order // top_k
        x_sorted = x[tokens]  # [T * k, H], expert 0's tokens first
        y_sorted = torch.empty_like(x_sorted)
        start = 0
        for e, count in enumerate(counts):
            if count:
                rows = slice(start, start + count)
                y_sorted[rows] = (self._expert(e, x_sorted[rows]) if expert is None
                                  else expert(e, x_sorted[rows], tokens[rows]))
                start += count
        y = torch.empty_like(y_sorted)
        y[order] = y_sorted  # back to token order: [T * k, H] -> [T, k, H]
        y = y.view(num_tokens, top_k, self.hidden_size)
        weights = topk_weights.to(x.dtype)
        # Elementwise, choice by choice: a token's sum never depends on other tokens.
        out = y[:, 0] * weights[:, :1]
        for j in range(1, top_k):
            out = torch.addcmul(out, y[:, j], weights[:, j:j + 1])
        return out

    def _expert(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        """One expert's gated MLP on its tokens: ``[n, H] -> [n, H]`` (a partial sum under TP)."""
        assert not self._rows_interleaved, "process_weights_after_loading was not run"
        bias_1 = None if self.gate_up_proj_bias is None else self.gate_up_proj_bias[expert]
        bias_2 = (self.down_proj_bias[expert]
                  if self.down_proj_bias is not None and self.tp.rank == 0 else None)
        gate_up = F.linear(x, self.gate_up_proj[expert], bias_1)
        return F.linear(self.act(gate_up), self.down_proj[expert], bias_2)


_layers_by_op_id: LayerRegistry[FusedMoE] = LayerRegistry()


@layer_op("fused_moe_experts")
def fused_moe_experts_op(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                         layer_id: int) -> torch.Tensor:
    """``FusedMoE.apply_experts`` of layer ``layer_id``, eager inside a compiled graph."""
    return _layers_by_op_id[layer_id].apply_experts(x, topk_weights, topk_ids)


@torch.library.register_fake("pagedllm::fused_moe_experts")
def _fused_moe_experts_fake(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                            layer_id: int) -> torch.Tensor:
    return torch.empty_like(x)
