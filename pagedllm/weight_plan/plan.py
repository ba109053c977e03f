"""The one planning pass over a loaded model's weights: every linear layer, vocabulary embedding
and head, and MoE projection ends it holding the one ``WeightFormat`` it runs with
(layers/weight_format.py), decided from, in order:

1. the checkpoint's format (GGUF blocks, AWQ/GPTQ groups, GPT-OSS's MXFP4 experts): decided
   before the weights stream, from the checkpoint's tensor index (``keeps_checkpoint_blocks``),
   so a quantized layer's float matrix is never allocated; the loader unpacks each planned
   layer's blocks and hands them here (``hold_checkpoint_blocks``, ``hold_checkpoint_experts``);
2. ``--quantization q8_0|q4_0``: the float layers quantized (``quantize_linears``);
3. the dtype: bfloat16/float16 layers and experts as half panels (``Half``) where the kernels
   run;
4. the CPU's kernels: float32 panels (``Panels``) or torch's matmul, per layer shape as
   measured (weight_plan/linear_choice.py); a MoE layer's float32 experts (the grouped kernel) and
   its router (batch-independent sums) on the kernels unconditionally;
5. the activation mode (weight_plan/activation_choice.py): int8 or bfloat16 activations for the
   formats that take them;
and ``Dense`` (the float weight on torch's matmul) for every layer left. It returns the table
(layer name -> format, bytes) the startup log and ``pagedllm bench memory`` print, and the
activations each quantized or 16-bit format took. This module is the only code that gives a
layer its format (``hold``); the steps' helpers beside it measure and propose.
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from pagedllm import envs
from pagedllm.errors import ModelLoadError, UnsupportedModelError
from pagedllm.kernels.cpu_extension import cpu_description, load_cpu_ops, native_isa
from pagedllm.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from pagedllm.layers.fused_moe import FusedMoE
from pagedllm.layers.linear import Linear, hold, pack_weight
from pagedllm.layers.quantization import (
    SCHEMES,
    QuantizedWeight,
    check_kernel,
    quantize_linear,
    quantized_kernels_available,
)
from pagedllm.layers.quantization.round_to_nearest import BLOCK
from pagedllm.layers.weight_format import Dense, Half, Panels, Quantized
from pagedllm.weight_plan.activation_choice import checkpoint_method, choose_activations
from pagedllm.weight_plan.linear_choice import ShapeChoice, choose_panels
from pagedllm.weight_plan.weight_table import WeightRow, log_weight_table, weight_table

logger = logging.getLogger(__name__)


@torch.inference_mode()
def plan_weights(model: nn.Module, hf_config: dict, device: torch.device, activations: str,
                 quantization: str | None = None) -> tuple[list[WeightRow], dict[str, str]]:
    """Give every layer of the loaded ``model`` its format (module doc), log the table; returns
    (the table, weight format -> the activations its layers take). Call once, after loading and
    before anything compiles the model; ``quantization``: ModelConfig's (the loader checked it
    against the checkpoint)."""
    if quantization in SCHEMES:  # round-to-nearest; each float matrix freed as it goes
        quantize_linears(model, quantization)
    if device.type == "cpu":
        hold_routers(model)
        for module in model.modules():
            if isinstance(module, FusedMoE):
                hold_experts(module)
        hold_half_layers(model)
        choose_linear_kernels(model)
    chosen = choose_activations(model, activations, device, checkpoint_method(hf_config))
    hold_dense(model)
    table = weight_table(model)
    log_weight_table(table)
    return table, chosen


# -- step 1, the checkpoint's own blocks: decided before streaming, filled by the loader --------

def _routers(model: nn.Module) -> set[int]:
    """ids of the MoE blocks' routers (``gate``, ``shared_expert_gate``): they stay float, as
    llama.cpp keeps them, and run batch-independent (``hold_routers``)."""
    return {id(getattr(block, name)) for block in model.modules()
            if isinstance(getattr(block, "experts", None), FusedMoE)
            for name in ("gate", "shared_expert_gate") if hasattr(block, name)}


def keeps_checkpoint_blocks(model: nn.Module, device: torch.device, only_form: bool) -> set[str]:
    """The modules (linear layers, heads, MoE layers; still on the meta device) that hold the
    checkpoint's quantized tensors as they are, where the checkpoint stores them quantized:
    every one where the quantized kernels run, none elsewhere (the loader dequantizes).
    ``only_form``: the blocks are the checkpoint's only form (AWQ/GPTQ), so routers keep them
    too; otherwise (GGUF) routers stay float."""
    if not quantized_kernels_available(device):
        return set()
    routers = set() if only_form else _routers(model)
    return {name for name, m in model.named_modules()
            if isinstance(m, (Linear, ParallelLMHead, FusedMoE)) and id(m) not in routers}


def hold_checkpoint_blocks(layer: nn.Module, qweight: QuantizedWeight) -> None:
    """A layer ``keeps_checkpoint_blocks`` named, holding its blocks as the loader unpacked them."""
    hold(layer, Quantized.of(qweight))  # checks a linear layer's shape


def hold_checkpoint_experts(layer: FusedMoE, attr: str, experts: dict[int, QuantizedWeight]) -> None:
    """A MoE layer's projection ``attr`` from its checkpoint's per-expert blocks (this rank's
    rows or columns), stacked for the grouped kernel."""
    inter, hidden = layer.intermediate_size, layer.hidden_size
    shape = (2 * inter, hidden) if attr == "gate_up_proj" else (hidden, inter)
    for expert, qweight in experts.items():
        if (qweight.out_features, qweight.in_features) != shape or not 0 <= expert < layer.num_experts:
            raise ModelLoadError(f"expert {expert}'s {attr} is {qweight.out_features}x"
                                 f"{qweight.in_features}; the layer wants {shape[0]}x{shape[1]} "
                                 f"for experts 0..{layer.num_experts - 1}")
    if len(experts) != layer.num_experts:
        raise ModelLoadError(f"{attr}: the checkpoint held {len(experts)} of "
                             f"{layer.num_experts} experts")
    layer.hold(attr, Quantized.of(QuantizedWeight.stack([experts[e] for e in range(layer.num_experts)])))


def hold_tied_embeddings(model: nn.Module, heads: dict[str, str]) -> None:
    """Each tied embedding (embedding name -> its head's) reads its rows from its head's
    checkpoint blocks, once the head holds them: one copy of the matrix."""
    modules = dict(model.named_modules())
    for embedding, head in heads.items():
        if modules[head].weight_format is not None:
            hold(modules[embedding], modules[head].weight_format)


# -- step 2, --quantization q8_0|q4_0 ---------------------------------------------------------

@torch.no_grad()
def quantize_linears(model: nn.Module, scheme: str) -> None:
    """Every linear of the decoder layers (not the embedding, norms, routers or lm_head), and
    every expert of a MoE layer's projections, quantized by ``scheme`` ("q8_0" | "q4_0",
    llama.cpp's round-to-nearest); the float weight is freed as each layer is converted. Layers
    whose input is not whole blocks of 32 stay float (as llama.cpp keeps them), with a log line."""
    if not quantized_kernels_available(next(model.parameters()).device):
        raise UnsupportedModelError(f"quantization {scheme} runs on pagedllm's CPU kernels; "
                                    "supported: device cpu with the C++ extension built")
    routers = _routers(model)
    checked: set[tuple] = set()
    kept: list[str] = []
    count = 0
    for name, layer in model.named_modules():
        if not isinstance(layer, Linear) or layer.weight is None or id(layer) in routers:
            continue
        if layer.in_features % BLOCK:
            kept.append(name)
            continue
        qweight = quantize_linear(layer.weight, scheme)
        key = (*layer.weight.shape, layer.bias is None)
        if key not in checked:  # once per shape
            check_kernel(qweight, layer.bias)
        hold(layer, Quantized.of(qweight))
        checked.add(key)
        count += 1
    for name, layer in model.named_modules():
        # GPT-OSS's MXFP4 experts keep the checkpoint's values (dequantized exactly).
        if not isinstance(layer, FusedMoE) or layer.weight_format == "mxfp4":
            continue
        for attr in list(layer.float_weights()):
            if layer.float_weights()[attr].shape[-1] % BLOCK:
                kept.append(f"{name}.{attr}")
                continue
            qweights = [quantize_linear(w, scheme) for w in layer.float_weights()[attr]]
            check_kernel(qweights[0], None)  # one check per projection: every expert has its shape
            layer.hold(attr, Quantized.of(QuantizedWeight.stack(qweights)))
            count += 1
    why = f"; kept float (input not a multiple of {BLOCK}): {', '.join(kept)}" if kept else ""
    logger.info("quantization %s: %d linear layers (an MoE layer's experts: one per projection) "
                "quantized at load%s", scheme, count, why)


# -- steps 3 to 5, and Dense for the rest ------------------------------------------------------

def choose_linear_kernels(model: nn.Module) -> list[ShapeChoice]:
    """Step 4: every float32 layer of a shape the measurement chose (weight_plan/linear_choice.py)
    held as panels; a tied embedding reads its rows from its head's panels. Returns the choice
    per float32 shape."""
    tied = _tied_embeddings(model)

    def take(layer: nn.Module, panels: Panels) -> None:
        embedding = tied.get(id(layer.weight))
        hold(layer, panels)
        if embedding is not None:
            hold(embedding, panels)

    return choose_panels(model, take)


def _float_layers(model: nn.Module) -> list[nn.Module]:
    """The linear layers and heads still holding a plain float ``weight`` (in no format)."""
    return [m for m in model.modules()
            if isinstance(m, (Linear, ParallelLMHead)) and m.weight is not None
            and m.weight_format is None]


def _tied_embeddings(model: nn.Module) -> dict[int, VocabParallelEmbedding]:
    """id(weight) -> the embedding holding it: a head sharing it is tied to that embedding."""
    return {id(m.weight): m for m in model.modules()
            if isinstance(m, VocabParallelEmbedding) and m.weight is not None}


def hold_routers(model: nn.Module) -> None:
    """MoE routers (``Linear.batch_invariant``) as panels: the skinny kernel's sums do not depend
    on the batch, so a token picks the same experts with the same weights in any batch (the
    measured choice, which may pick torch's matmul, applies to the other layers)."""
    if envs.cpu_kernels() == "torch":
        return
    for layer in _float_layers(model):
        if isinstance(layer, Linear) and layer.batch_invariant:
            panels = Panels.pack(layer.weight)
            if panels is not None and panels.check(layer.bias):
                hold(layer, panels)


def hold_experts(layer: FusedMoE) -> None:
    """A MoE layer's float experts on the grouped CPU kernel (``pagedllm::fused_experts``):
    bfloat16/float16 ones stacked as half panels, float32 ones as panels ``[E, panels, in,
    64]``; every projection through the kernel or none (``FusedMoE.apply_experts``), each
    float shape checked against float64 once, on expert 0. A projection the checkpoint holds
    quantized is in the kernel already, so the other follows it even when the kernels are
    forced off."""
    floats = layer.float_weights()
    if not floats or (envs.cpu_kernels() == "torch" and not layer.expert_formats):
        return
    if any(w.device.type != "cpu" for w in floats.values()):
        return
    halves = [n for n, w in floats.items() if w.dtype in (torch.float16, torch.bfloat16)]
    del floats  # each weight is fetched when converted: its float copy goes as it is
    if halves and not _hold_half_experts(layer, halves):
        return
    names = list(layer.float_weights())
    firsts = {name: pack_weight(layer.float_weights()[name][0], None, narrow=False) for name in names}
    if any(first is None for first in firsts.values()):
        if len(names) < len(FusedMoE.PROJECTIONS):  # the other one is held in another format
            raise ModelLoadError(f"the experts' {', '.join(names)} cannot run in the CPU kernel "
                                 "beside their quantized or half-precision projection (no "
                                 "kernel for this weight here)")
        return
    for name, first in firsts.items():
        weight = layer.float_weights()[name]
        panels = torch.empty((layer.num_experts, *first.shape), dtype=first.dtype)
        panels[0] = first
        for e in range(1, layer.num_experts):  # one expert's transient copy at a time
            panels[e] = pack_weight(weight[e], None, check=False, narrow=False)
        out_features = weight.shape[1]
        del weight  # the plain weight goes at once: one projection of one layer held twice
        layer.hold(name, Panels(panels, out_features))


def _hold_half_experts(layer: FusedMoE, names: list[str]) -> bool:
    """bfloat16/float16 experts kept in their precision, stacked half panels (the dense layers'
    rule, ``hold_half_layers``); False, changing nothing, when the kernel cannot take them."""
    if not quantized_kernels_available(layer.float_weights()[names[0]].device):
        return False
    stacks = {}
    for name in names:  # every projection checked before any is converted: all or none
        weight = layer.float_weights()[name]
        stacks[name] = [QuantizedWeight.from_half(weight[e]) for e in range(layer.num_experts)]
        if not Half(stacks[name][0]).check():
            return False
    for name, qweights in stacks.items():
        layer.hold(name, Quantized.of(QuantizedWeight.stack(qweights)))
    return True


def hold_half_layers(model: nn.Module) -> None:
    """bfloat16/float16 layers keep their precision, as panels widened in registers by
    pagedllm's kernel (``Half``), checked against float64 once per shape and dtype; not measured:
    torch's half matmul on a CPU without native bf16 converts the whole matrix on every call
    (``PAGEDLLM_CPU_KERNELS=torch`` keeps it anyway). A tied embedding reads its rows from the
    head's half panels (the same format object): one copy of the matrix."""
    layers = [m for m in _float_layers(model) if m.weight.device.type == "cpu"
              and m.weight.dtype in (torch.bfloat16, torch.float16)]
    if not layers or envs.cpu_kernels() == "torch" or native_isa() is None or load_cpu_ops() is None:
        return
    tied = _tied_embeddings(model)
    checked: dict[tuple, bool] = {}
    for layer in layers:
        fmt = Half(QuantizedWeight.from_half(layer.weight))
        key = (*layer.weight.shape, layer.weight.dtype)
        if key not in checked:
            checked[key] = fmt.check(getattr(layer, "bias", None))
        if not checked[key]:
            continue
        embedding = tied.get(id(layer.weight))
        hold(layer, fmt)
        if embedding is not None:
            hold(embedding, fmt)
    kept = [f"{n}x{k} {dtype}" for (n, k, dtype), ok in checked.items() if not ok]
    logger.info("linears on %s: %d bfloat16/float16 layers as half panels in the skinny kernel%s",
                cpu_description(), sum(m.weight_format is not None for m in layers),
                f"; torch's matmul for {', '.join(kept)} (the kernel disagreed with float64)"
                if kept else "")


def hold_dense(model: nn.Module) -> None:
    """``Dense`` for every layer the steps before left on its float weight: a tied embedding
    shares its head's object (one weight, counted once in the table)."""
    tied = _tied_embeddings(model)
    for layer in _float_layers(model):
        fmt = Dense(layer.weight)
        embedding = tied.get(id(layer.weight))
        hold(layer, fmt)
        if embedding is not None and embedding.weight_format is None:
            hold(embedding, fmt)
    for module in model.modules():
        if isinstance(module, VocabParallelEmbedding) and module.weight_format is None:
            hold(module, Dense(module.weight))
        elif isinstance(module, FusedMoE):
            for name, weight in module.float_weights().items():  # torch's matmul per expert
                module.hold(name, Dense(weight))
