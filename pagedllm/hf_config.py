"""What a Hugging Face config.json (a parsed dict) means for pagedllm: the rules every reader of
the file must agree on, in one torch-free place (the engine's ModelInfo, the model's DecoderArgs).

Today that is the sliding window. pagedllm has no sliding-window attention yet; within the
window, full attention is exactly what a sliding-window model computes, so a model with an
active window runs with its context capped at the window (vLLM's ``disable_sliding_window``).
"""
from __future__ import annotations

# Families whose config carries a ``use_sliding_window`` flag that transformers defaults to False:
# their ``sliding_window`` field is only a size, set or not, and means nothing while the flag is off.
_WINDOW_FLAG_DEFAULT_OFF = frozenset({"qwen2", "qwen2_moe", "qwen3", "qwen3_moe"})


def text_config(config: dict) -> dict:
    """The language model's fields: multimodal-style configs nest them under ``text_config``."""
    return config.get("text_config", config)


def max_position_embeddings(config: dict) -> int:
    return int(text_config(config).get("max_position_embeddings", 2048))


def sliding_window(config: dict) -> int | None:
    """The attention window of the model if any of its layers uses one and it is shorter than
    the context, else None.

    * Mistral-style: ``sliding_window`` set (null or absent: no window).
    * Qwen2-style: ``use_sliding_window`` must be true; Qwen2 checkpoints commonly ship
      ``sliding_window: 32768`` (or 131072) with the flag false, which means no window.
    * ``layer_types`` (transformers >= 4.56 writes it) lists each layer's attention; when it is
      there and names no ``sliding_attention`` layer, no layer is windowed.
    """
    text = text_config(config)
    window = text.get("sliding_window")
    if not window:
        return None
    flag = text.get("use_sliding_window")
    if flag is None:
        flag = text.get("model_type") not in _WINDOW_FLAG_DEFAULT_OFF
    if not flag:
        return None
    layer_types = text.get("layer_types")
    if layer_types is not None and "sliding_attention" not in layer_types:
        return None
    window = int(window)
    # A window as long as the context never slides: plain full attention.
    return window if window < max_position_embeddings(config) else None


def usable_context(config: dict) -> int:
    """The longest sequence pagedllm computes exactly: max_position_embeddings, capped at an
    active sliding window (see the module docstring)."""
    return cap_at_window(max_position_embeddings(config), sliding_window(config))


def cap_at_window(max_position_embeddings: int, window: int | None) -> int:
    return max_position_embeddings if window is None else min(max_position_embeddings, window)
