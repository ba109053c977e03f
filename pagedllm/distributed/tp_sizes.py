"""Which tensor-parallel sizes a model can be split into, from its config.json alone (no torch).

A rank holds ``num_attention_heads / tp`` query heads (and their attention sinks) and
``intermediate_size / tp`` MLP units, so both must divide; so must the experts' own width
(``moe_intermediate_size``) and a shared expert's (``shared_expert_intermediate_size``) where the
model has them, and with MXFP4 experts (GPT-OSS) the number of 32-value blocks along the
intermediate dimension, since a rank reads whole blocks. KV heads are split when there are at
least as many as ranks (then ``tp`` must divide them) and replicated otherwise (then they must
divide ``tp``, so each KV head serves a whole number of ranks), as vLLM does. The vocabulary is
padded to a multiple of ``tp``, so any size works there.
"""
from __future__ import annotations

from pagedllm.errors import ValidationError
from pagedllm.hf_config import text_config
from pagedllm.utils import cdiv

MXFP4_BLOCK = 32  # values per scale (layers/quantization/mxfp4.py; no torch here)


def _dims(hf_config: dict) -> tuple[int, int, dict[str, int]]:
    """(heads, KV heads, {name: size} of every other dimension ``tp`` must divide)."""
    text = text_config(hf_config)
    heads = int(text["num_attention_heads"])
    kv_heads = int(text.get("num_key_value_heads") or heads)
    split = {"intermediate_size": int(text["intermediate_size"])}
    for key in ("moe_intermediate_size", "shared_expert_intermediate_size"):
        if text.get(key):
            split[key] = int(text[key])
    quant = hf_config.get("quantization_config") or text.get("quantization_config") or {}
    expert_width = split.get("moe_intermediate_size", split["intermediate_size"])
    if str(quant.get("quant_method", "")).lower() == "mxfp4" and expert_width % MXFP4_BLOCK == 0:
        split["MXFP4 blocks per expert row"] = expert_width // MXFP4_BLOCK
    return heads, kv_heads, split


def kv_heads_fit(num_kv_heads: int, tp: int) -> bool:
    """Split over the ranks when there are as many or more, else each replicated on whole ranks."""
    return num_kv_heads % tp == 0 if num_kv_heads >= tp else tp % num_kv_heads == 0


def divides_model(num_heads: int, num_kv_heads: int, split_sizes: list[int], tp: int) -> bool:
    return num_heads % tp == 0 and all(size % tp == 0 for size in split_sizes) and kv_heads_fit(num_kv_heads, tp)


def split_size(size: int, tp: int, what: str) -> int:
    """One rank's share of a dimension split ``tp`` ways; ``what`` names it if ``tp`` does not divide it."""
    if size % tp:
        raise ValidationError(f"{what} {size} does not split over {tp} ranks", "tensor_parallel_size")
    return size // tp


def check_heads_split(num_heads: int, num_kv_heads: int, tp: int) -> None:
    """The attention rule: query heads split evenly, KV heads split or replicated (kv_heads_fit)."""
    if num_heads % tp or not kv_heads_fit(num_kv_heads, tp):
        raise ValidationError(f"{num_heads} heads / {num_kv_heads} KV heads do not split over {tp} ranks",
                              "tensor_parallel_size")


def vocab_rows_per_rank(vocab_size: int, tp: int) -> int:
    """Rows of the vocabulary each rank holds: padded up, so any ``tp`` splits it."""
    return cdiv(vocab_size, tp)


def valid_tensor_parallel_sizes(hf_config: dict) -> list[int]:
    heads, kv_heads, split = _dims(hf_config)
    return [tp for tp in range(1, heads + 1)
            if divides_model(heads, kv_heads, list(split.values()), tp)]


def check_tensor_parallel_size(hf_config: dict, tp: int) -> None:
    """Raise ValidationError naming the valid sizes if ``tp`` does not split this model."""
    heads, kv_heads, split = _dims(hf_config)
    if divides_model(heads, kv_heads, list(split.values()), tp):
        return
    valid = ", ".join(str(n) for n in valid_tensor_parallel_sizes(hf_config))
    others = ", ".join(f"{name} {size}" for name, size in split.items())
    raise ValidationError(
        f"tensor_parallel_size={tp} does not split this model (num_attention_heads {heads}, "
        f"num_key_value_heads {kv_heads}, {others}); valid sizes: {valid}",
        "tensor_parallel_size")
