"""Which tensor-parallel sizes a model can be split into, from its config.json alone (no torch).

A rank holds ``num_attention_heads / tp`` query heads and ``intermediate_size / tp`` MLP units,
so both must divide. KV heads are split when there are at least as many as ranks (then ``tp``
must divide them) and replicated otherwise (then they must divide ``tp``, so each KV head serves
a whole number of ranks), as vLLM does. The vocabulary is padded to a multiple of ``tp``, so any
size works there.
"""
from __future__ import annotations

from pagedllm.errors import ValidationError
from pagedllm.hf_config import text_config


def _dims(hf_config: dict) -> tuple[int, int, int]:
    text = text_config(hf_config)
    heads = int(text["num_attention_heads"])
    kv_heads = int(text.get("num_key_value_heads") or heads)
    return heads, kv_heads, int(text["intermediate_size"])


def divides_model(num_heads: int, num_kv_heads: int, intermediate_size: int, tp: int) -> bool:
    kv_ok = num_kv_heads % tp == 0 if num_kv_heads >= tp else tp % num_kv_heads == 0
    return num_heads % tp == 0 and intermediate_size % tp == 0 and kv_ok


def valid_tensor_parallel_sizes(hf_config: dict) -> list[int]:
    heads, kv_heads, inter = _dims(hf_config)
    return [tp for tp in range(1, heads + 1) if divides_model(heads, kv_heads, inter, tp)]


def check_tensor_parallel_size(hf_config: dict, tp: int) -> None:
    """Raise ValidationError naming the valid sizes if ``tp`` does not split this model."""
    heads, kv_heads, inter = _dims(hf_config)
    if divides_model(heads, kv_heads, inter, tp):
        return
    valid = ", ".join(str(n) for n in valid_tensor_parallel_sizes(hf_config))
    raise ValidationError(
        f"tensor_parallel_size={tp} does not split this model (num_attention_heads {heads}, "
        f"num_key_value_heads {kv_heads}, intermediate_size {inter}); valid sizes: {valid}",
        "tensor_parallel_size")
