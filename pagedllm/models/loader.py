"""Load a local Hugging Face model folder: config.json plus safetensors weights.

The model is built on the meta device (no memory, no random init), materialised uninitialised
on the target device, then every parameter is filled from the checkpoint. A parameter that no
checkpoint tensor fills is an error, so a half-loaded model can never run. Under tensor
parallelism the model's layers hold this rank's shards, and each rank reads only its rows or
columns of each tensor from the files (``safe_open(...).get_slice``), never the whole model.
Then modules with ``process_weights_after_loading()`` convert what they loaded (the MoE experts'
layout); the runner's planning pass (runner/weight_plan.py) then gives each layer its format.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from pagedllm.errors import ModelLoadError
from pagedllm.layers import WeightSlice
from pagedllm.models.checkpoint_names import renamed
from pagedllm.models.registry import get_model_class

logger = logging.getLogger(__name__)

# Checkpoint tensors that carry no weights we need (old checkpoints saved the rope table).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def load_model(model_path: str, dtype: torch.dtype, device: torch.device,
               quantization: str | None = None) -> tuple[nn.Module, dict]:
    """Return ``(model in eval mode with weights loaded, the parsed config.json)``.
    ``quantization``: ModelConfig's (None: what the checkpoint is; see
    layers/quantization/checkpoint_formats.py)."""
    from pagedllm.layers.quantization.checkpoint_formats import resolve_quantization

    if str(model_path).lower().endswith(".gguf"):  # llama.cpp's single-file checkpoints
        resolve_quantization(quantization, None, is_gguf=True)
        from pagedllm.gguf.model_loader import load_gguf_model

        return load_gguf_model(model_path, dtype, device, expected_tensors)
    folder = Path(model_path)
    config = read_config(folder)
    method = resolve_quantization(quantization, config, is_gguf=False)
    model_cls = get_model_class(config)
    with torch.device("meta"):
        model = model_cls(config)
    files = weight_files(folder)
    quantized = None
    if method in ("awq", "gptq"):  # their linears stay 4-bit: the float matrix never exists
        from pagedllm.models.quantized_checkpoint import QuantizedCheckpointLoader

        quantized = QuantizedCheckpointLoader(model, config, files, device, expected_tensors)
    model = model.to(dtype=dtype).to_empty(device=device)
    if hasattr(model, "tie_weights"):
        model.tie_weights()  # moving a module breaks parameter sharing; restore it
    load_weights(model, files, ignored=quantized.ignored if quantized else ())
    if quantized is not None:
        quantized.load(model)
    # quantization q8_0/q4_0 (``method``): the runner's planning pass (runner/weight_plan.py).
    for module in model.modules():
        if hasattr(module, "process_weights_after_loading"):
            module.process_weights_after_loading()  # e.g. the MoE experts' layout
    model.requires_grad_(False)  # inference only: no autograd bookkeeping in forward
    return model.eval(), config


def read_config(folder: Path) -> dict:
    path = folder / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"{folder} is not a model folder: no config.json")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path} is not valid JSON: {e}") from e


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files of the folder: the index's shards, or model.safetensors."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ModelLoadError(f"{index} is not a valid safetensors index: {e}") from e
        files = [folder / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{folder}: weight shards listed in {index.name} are missing: "
                                 f"{', '.join(missing)}")
        return files
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    others = sorted(folder.glob("*.safetensors"))
    if others:
        return others
    raise ModelLoadError(f"{folder}: no model.safetensors or model.safetensors.index.json "
                         "(only safetensors weights are supported)")


def expected_tensors(model: nn.Module) -> dict[str, list[tuple[WeightSlice, str]]]:
    """Checkpoint tensor name -> [(where it goes on this rank, parameter name for messages)]:
    usually one place; a fused checkpoint tensor (Phi-3's ``qkv_proj``) fills several parts.

    Layers that shard or fuse (``checkpoint_slices``: the tensor-parallel linears, the vocabulary
    embedding and head) say which checkpoint tensors fill which rows of their parameters; a fused
    ``qkv_proj`` expects ``q_proj.weight``, ``k_proj.weight``... each into its rows. Any other
    parameter takes its checkpoint tensor whole. A tied lm_head shares the embedding's Parameter,
    which named_parameters() lists once, so no ``lm_head.weight`` is expected. The MoE experts
    (``checkpoint_tensors``) name their tensors themselves, one per expert and projection; their
    fused spelling is in ``fused_tensors``.
    """
    modules = dict(model.named_modules())
    expected: dict[str, list[tuple[WeightSlice, str]]] = {}
    for param_name, param in model.named_parameters():
        module_name, _, attr = param_name.rpartition(".")
        module = modules[module_name]
        if hasattr(module, "checkpoint_tensors"):  # names its own tensors (one per MoE expert)
            for name, piece in module.checkpoint_tensors(attr, param.data).items():
                expected.setdefault(f"{module_name}.{name}", []).append((piece, param_name))
            continue
        slices = (module.checkpoint_slices(attr, param.data) if hasattr(module, "checkpoint_slices")
                  else [WeightSlice(param.data)])
        parent, _, _ = module_name.rpartition(".")
        prefix = f"{parent}." if parent else ""
        for piece in slices:
            name = f"{prefix}{piece.shard_name}.{attr}" if piece.shard_name else param_name
            expected.setdefault(name, []).append((piece, param_name))
    return expected


def fused_tensors(model: nn.Module) -> dict[str, tuple[list[tuple[WeightSlice, str]], list[str]]]:
    """The other spelling of modules that name their own tensors: a fused checkpoint tensor
    (``experts.gate_up_proj``, named as the parameter) -> (its places on this rank, the
    per-expert names of ``expected_tensors`` it stands for)."""
    modules = dict(model.named_modules())
    fused: dict[str, tuple[list[tuple[WeightSlice, str]], list[str]]] = {}
    for param_name, param in model.named_parameters():
        module_name, _, attr = param_name.rpartition(".")
        module = modules[module_name]
        if hasattr(module, "fused_checkpoint_tensors"):
            pieces = module.fused_checkpoint_tensors(attr, param.data)
            replaced = [f"{module_name}.{name}"
                        for name in module.checkpoint_tensors(attr, param.data)]
            fused[param_name] = ([(piece, param_name) for piece in pieces], replaced)
    return fused


@torch.no_grad()
def load_weights(model: nn.Module, files: list[Path], ignored=()) -> None:
    """Copy this rank's part of every checkpoint tensor into its place, reading only that part
    from the file (safetensors slices); raise ModelLoadError on missing tensors or shape
    mismatches. Unknown tensors are logged and skipped; ``ignored`` names are read elsewhere
    (an AWQ/GPTQ layer's packed tensors)."""
    expected = expected_tensors(model)
    fused = fused_tensors(model)
    renames = getattr(model, "checkpoint_renames", {})
    _zero_padding(model, expected)
    tied = getattr(getattr(model, "args", None), "tie_word_embeddings", False)
    # Parts of the checkpoint a model knowingly leaves out (a multimodal model's vision tower).
    skipped: tuple[str, ...] = getattr(model, "skipped_checkpoint_prefixes", ())
    unexpected: list[str] = []
    for path in files:
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for file_name in f.keys():
                    name = renamed(file_name, renames)
                    targets = expected.pop(name, None)
                    if targets is None and name in fused:  # the experts' fused spelling
                        targets, replaced = fused.pop(name)
                        for per_expert in replaced:
                            expected.pop(per_expert, None)
                    if targets is None:
                        if not (file_name in ignored or name.endswith(_IGNORED_SUFFIXES)
                                or name.startswith(skipped)
                                or (tied and name == "lm_head.weight")):
                            unexpected.append(name)
                        continue
                    for target in targets:
                        _copy_slice(f, file_name, *target)
        except (OSError, SafetensorError) as e:  # truncated file, corrupt header, ...
            raise ModelLoadError(f"cannot read weights from {path}: {e}") from e
    if expected:
        names = sorted(expected)
        more = f" and {len(names) - 10} more" if len(names) > 10 else ""
        raise ModelLoadError(f"checkpoint is missing {len(names)} tensors: "
                             f"{', '.join(names[:10])}{more}")
    if unexpected:
        logger.warning("ignoring %d checkpoint tensors the model does not use: %s",
                       len(unexpected), ", ".join(unexpected[:10]))


def _copy_slice(f, name: str, piece: WeightSlice, param_name: str) -> None:
    sliced = f.get_slice(name)
    shape = tuple(sliced.get_shape())
    if shape != piece.checkpoint_shape():
        raise ModelLoadError(f"checkpoint tensor {name} has shape {shape}, the model expects "
                             f"{piece.checkpoint_shape()} (for {param_name})")
    if piece.dim is None:
        piece.dest.copy_(f.get_tensor(name))  # casts to the model dtype and moves to its device
        return
    index = [slice(None)] * len(shape)
    index[piece.dim] = slice(piece.start, piece.start + piece.dest.shape[piece.dim])
    piece.dest.copy_(sliced[tuple(index)])  # reads only these rows (or columns) from the file


def _zero_padding(model: nn.Module, expected: dict[str, list[tuple[WeightSlice, str]]]) -> None:
    """Zero the parameters the checkpoint does not cover whole: the vocabulary rows past the end
    on the last rank (``to_empty`` left them as whatever the memory held, NaN included)."""
    covered: dict[str, int] = {}
    for piece, param_name in (t for targets in expected.values() for t in targets):
        covered[param_name] = covered.get(param_name, 0) + piece.dest.numel()
    for param_name, param in model.named_parameters():
        if covered.get(param_name, 0) < param.numel():
            param.data.zero_()
