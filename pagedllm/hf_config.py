"""What a Hugging Face config.json (a parsed dict) means for pagedllm: the rules every reader of
the file must agree on, in one torch-free place (the engine's ModelInfo, the model's DecoderArgs).

Today that is the sliding window: whether a model has an active one (``sliding_window``) and which
layers use it (``layer_types``). The attention layers apply it exactly (layers/attention/), so the
context is the model's max_position_embeddings, windowed or not.
"""
from __future__ import annotations

import json
from pathlib import Path

# Families whose config carries a ``use_sliding_window`` flag that transformers defaults to False:
# their ``sliding_window`` field is only a size, set or not, and means nothing while the flag is off.
_WINDOW_FLAG_DEFAULT_OFF = frozenset({"qwen2", "qwen2_moe", "qwen3", "qwen3_moe"})


def is_gguf_path(path: str | Path) -> bool:
    """llama.cpp's checkpoints are single files (or shards) named ``*.gguf``."""
    return str(path).lower().endswith(".gguf")


def text_config(config: dict) -> dict:
    """The language model's fields: multimodal-style configs nest them under ``text_config``."""
    return config.get("text_config", config)


def max_position_embeddings(config: dict) -> int:
    text = text_config(config)
    # RoBERTa's positions start after its padding id: the table's first pad_token_id + 1 rows are unused.
    offset = text.get("pad_token_id", 1) + 1 if text.get("model_type") in ("roberta", "xlm-roberta") else 0
    return int(text.get("max_position_embeddings", text.get("n_positions", 2048))) - offset  # GPT-2 style: n_positions


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


def layer_types(config: dict, default_pattern: int | None = None) -> list[str]:
    """Each layer's declared attention, ``"full_attention"`` or ``"sliding_attention"``, whether
    or not the window is active (Gemma 3's local layers keep their own rope either way):
    ``layer_types`` when the config lists it; else every ``sliding_window_pattern``-th layer (or
    the family's ``default_pattern``-th) full and the others sliding (Gemma 2/3 before
    transformers 4.56); else all sliding when a window is set and active (Mistral), else all full."""
    text = text_config(config)
    num_layers = int(text["num_hidden_layers"])
    if text.get("layer_types"):
        return list(text["layer_types"])
    pattern = text.get("sliding_window_pattern") or default_pattern
    if pattern and text.get("sliding_window"):
        return ["sliding_attention" if (i + 1) % int(pattern) else "full_attention"
                for i in range(num_layers)]
    kind = "sliding_attention" if sliding_window(config) is not None else "full_attention"
    return [kind] * num_layers


# folder -> ((modification time, size) of its config.json, the parsed file)
_READ: dict[str, tuple[tuple[int, int], dict]] = {}


def read_config_json(folder: str | Path) -> dict:
    """``folder``'s config.json, parsed once per process while the file is unchanged (every
    reader shares it: checkpoint/source.py, runner_type.py). Raises OSError or ValueError as
    reading the file does."""
    path = Path(folder) / "config.json"
    st = path.stat()
    stamp = (st.st_mtime_ns, st.st_size)
    key = str(path.resolve())
    cached = _READ.get(key)
    if cached is None or cached[0] != stamp:
        cached = _READ[key] = (stamp, json.loads(path.read_text()))
    return cached[1]
