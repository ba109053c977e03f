"""The one loader: every checkpoint kind (safetensors folder, AWQ/GPTQ folder, GGUF file) goes
through the same steps, and only the weight source differs.

1. open: the checkpoint (checkpoint/source.py) gives its config, read once per process;
2. build on meta: the model's class from the config, no memory, no random init;
3. plan: which layers keep the checkpoint's quantized blocks (the planning pass decides from
   the source's tensor index: weight_plan/plan.py); their float parameters are dropped before
   anything is allocated;
4. materialise: the rest allocated uninitialised in the model's dtype on the device;
5. stream: the source copies this rank's part of each tensor into its place
   (checkpoint/placement.py), and hands each planned layer's unpacked blocks to the planning
   pass; a parameter no tensor fills is an error, one filled only in part (the last rank's
   vocabulary padding) is zeroed first;
6. tie: a tied embedding reads its rows from a quantized head;
7. finish: each module's ``process_weights_after_loading`` (the MoE experts' layout).

Formats are not the loader's: the planning pass (weight_plan/plan.py) names the checkpoint's
blocks before streaming, and the runner then calls it to give every other layer the one it runs
with (``--quantization q8_0|q4_0`` included).
"""
from __future__ import annotations

import torch
from torch import nn

from pagedllm.checkpoint.placement import expected_tensors, zero_uncovered
from pagedllm.checkpoint.quantized_layers import drop_float_weights, tied_heads
from pagedllm.checkpoint.source import Checkpoint, open_checkpoint
from pagedllm.models.registry import get_model_class
from pagedllm.weight_plan.plan import hold_tied_embeddings


def load_model(model_path: str, dtype: torch.dtype, device: torch.device,
               quantization: str | None = None) -> tuple[nn.Module, dict]:
    """Return ``(model in eval mode with weights loaded, its config dict)``. ``quantization``:
    ModelConfig's (None: what the checkpoint is; see layers/quantization/checkpoint_formats.py)."""
    ckpt = open_checkpoint(model_path)
    method = ckpt.resolve_quantization(quantization)
    config = ckpt.config
    with torch.device("meta"):
        model = get_model_class(config)(config)
    weights = weight_source(ckpt, method, dtype, device)
    heads = tied_heads(model)
    plan = weights.plan(model, expected_tensors(model))
    drop_float_weights(model, plan)
    model = model.to(dtype=dtype).to_empty(device=device)
    if hasattr(model, "tie_weights"):
        model.tie_weights()  # moving a module breaks parameter sharing; restore it
    expected = expected_tensors(model)
    zero_uncovered(model, expected)
    weights.stream(model, expected, plan)
    hold_tied_embeddings(model, heads)
    finish_loading(model)
    return model.eval(), config


def weight_source(ckpt: Checkpoint, method: str | None, dtype: torch.dtype, device: torch.device):
    """The object that plans and streams this checkpoint's weights (one ``plan`` and one ``stream``)."""
    if ckpt.kind == "gguf":
        from pagedllm.checkpoint.gguf.weights import GGUFWeights

        return GGUFWeights(ckpt.open(), ckpt.config, dtype, device)  # type: ignore[attr-defined]
    files = ckpt.weight_files()
    if method in ("awq", "gptq"):  # their linears stay 4-bit: the float matrix never exists
        from pagedllm.checkpoint.quantized_checkpoint import QuantizedFolderWeights

        return QuantizedFolderWeights(ckpt.config, files, device)
    from pagedllm.checkpoint.weights import SafetensorsWeights

    return SafetensorsWeights(files)


def finish_loading(model: nn.Module) -> None:
    # quantization q8_0/q4_0 is not done here: the runner's planning pass (weight_plan/plan.py).
    for module in model.modules():
        if hasattr(module, "process_weights_after_loading"):
            module.process_weights_after_loading()  # e.g. the MoE experts' layout
    model.requires_grad_(False)  # inference only: no autograd bookkeeping in forward
