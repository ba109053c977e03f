"""Load a GGUF LoRA adapter (llama.cpp's ``convert_lora_to_gguf.py`` output: ``general.type``
``adapter``, ``adapter.type`` ``lora``, ``adapter.lora.alpha``, tensors ``blk.N.<proj>.weight.lora_a``
[r, in] and ``.lora_b`` [out, r]) for one base, checked against it like a PEFT folder.

The update is llama.cpp's: ``(x A^T) B^T * alpha / r`` (alpha 0: scale 1). The converter writes B
of ``attn_q``/``attn_k`` in llama.cpp's rope-pair row order for the architectures it converts as
Llama, as it does the base's weights; loading puts those rows back in Hugging Face order.
"""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch

from pagedllm.lora.peft_loader import LoRAModel, build_lora_model, fail
from pagedllm.lora.request import LoRARequest
from pagedllm.lora.targets import LoRATarget

# llama.cpp's projection names -> the Hugging Face module under ``model.layers.N``.
_PROJECTIONS = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
                "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
                "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_KEY = re.compile(r"^blk\.(?P<layer>\d+)\.(?P<proj>[a-z_]+)\.weight\.lora_(?P<side>[ab])$")
# Architectures convert_hf_to_gguf.py writes with q and k rows permuted to rope pairs.
_PERMUTED_ARCHITECTURES = {"llama", "granite"}


def _field(reader, key: str):
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def _tensor(request: LoRARequest, tensor) -> torch.Tensor:
    """The tensor as float32 [rows, cols] (numpy order), whatever its GGUF type."""
    from gguf.quants import dequantize

    try:
        value = dequantize(tensor.data, tensor.tensor_type)
    except (NotImplementedError, ValueError) as exc:
        raise fail(request, f"tensor {tensor.name} has a type pagedllm cannot read "
                            f"({tensor.tensor_type.name}: {exc})") from None
    shape = tuple(int(n) for n in reversed(tensor.shape))  # ggml's ne is reversed
    return torch.from_numpy(np.array(value, dtype=np.float32).reshape(shape))  # a copy: the map is read-only


def _unpermute_rows(lora_b: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Rope-pair row order back to Hugging Face's halves: HF row h*D + t*D/2 + i is file row
    h*D + 2i + t (the heads' count follows from the rows)."""
    rows = lora_b.shape[0]
    perm = torch.arange(rows).reshape(rows // head_dim, head_dim // 2, 2).transpose(1, 2).reshape(-1)
    return lora_b[perm]


def read_gguf_pairs(request: LoRARequest, head_dim: int
                    ) -> tuple[float, dict[str, dict[str, torch.Tensor]]]:
    """(alpha, checkpoint module -> {"A", "B"}) from the adapter file; ValidationError when it is
    no GGUF LoRA adapter pagedllm can apply."""
    from gguf import GGUFReader

    path = Path(request.lora_path)
    try:
        reader = GGUFReader(path)
    except (OSError, ValueError, IndexError) as exc:
        raise fail(request, f"not a readable GGUF file ({str(exc).splitlines()[0] if str(exc) else exc})"
                   ) from None
    if _field(reader, "general.type") != "adapter" or _field(reader, "adapter.type") != "lora":
        raise fail(request, "this GGUF file is no LoRA adapter (general.type must be 'adapter' and "
                            "adapter.type 'lora')")
    alpha = _field(reader, "adapter.lora.alpha")
    if not isinstance(alpha, (int, float)):
        raise fail(request, "the GGUF adapter has no adapter.lora.alpha")
    permuted = _field(reader, "general.architecture") in _PERMUTED_ARCHITECTURES
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for tensor in reader.tensors:
        match = _KEY.match(tensor.name)
        if match is None or match["proj"] not in _PROJECTIONS:
            raise fail(request, f"tensor {tensor.name} is no lora_a/lora_b of a projection pagedllm "
                                f"adapts ({', '.join(sorted(_PROJECTIONS))})")
        value = _tensor(request, tensor)
        if match["side"] == "b" and permuted and match["proj"] in ("attn_q", "attn_k"):
            if value.shape[0] % head_dim:
                raise fail(request, f"{tensor.name}: {value.shape[0]} rows are no whole heads of "
                                    f"{head_dim}")
            value = _unpermute_rows(value, head_dim)
        module = f"model.layers.{match['layer']}.{_PROJECTIONS[match['proj']]}"
        pairs.setdefault(module, {})["A" if match["side"] == "a" else "B"] = value
    for module, pair in pairs.items():
        if len(pair) != 2:
            raise fail(request, f"{module} has lora_{'a' if 'A' in pair else 'b'} without its pair")
    if not pairs:
        raise fail(request, "the GGUF adapter holds no lora_a/lora_b tensors")
    return float(alpha), pairs


def load_gguf_adapter(request: LoRARequest, targets: dict[str, LoRATarget], max_lora_rank: int,
                      dtype: torch.dtype, head_dim: int) -> LoRAModel:
    """The GGUF adapter at ``request.lora_path`` for the base whose projections are ``targets``
    (``head_dim``: the base's, to restore q and k's row order)."""
    alpha, pairs = read_gguf_pairs(request, head_dim)
    ranks = {pair["A"].shape[0] for pair in pairs.values()}
    if len(ranks) != 1:
        raise fail(request, f"the GGUF adapter's lora_a tensors have different ranks {sorted(ranks)}")
    rank = ranks.pop()
    if rank > max_lora_rank:
        raise fail(request, f"rank {rank} is above max_lora_rank {max_lora_rank}; raise --max-lora-rank")
    return build_lora_model(request, rank, alpha / rank if alpha else 1.0, pairs, targets, dtype)
