"""Loading a Hugging Face tokenizer (lazily: transformers is imported only when needed)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from pagedllm.checkpoint.source import is_gguf_path
from pagedllm.checkpoint.tokenizer import load_hf_tokenizer
from pagedllm.errors import ModelLoadError, ValidationError


def load_tokenizer(path: str | Path) -> Any:
    folder = Path(path)
    if not is_gguf_path(path) and not any((folder / name).is_file()
                                          for name in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        raise ModelLoadError(f"{folder} has no tokenizer files (tokenizer.json, tokenizer.model or vocab.json)")
    return load_hf_tokenizer(path)


def apply_chat_template(tokenizer: Any, messages: list[dict], chat_template: str | None = None,
                        add_generation_prompt: bool = True, **kwargs: Any) -> list[int]:
    """Render chat messages to prompt token ids with the model's (or the given) template."""
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if not template:
        raise ValidationError(
            "this model's tokenizer has no chat template; pass chat_template=... "
            "(or --chat-template to the server), or use generate() with a plain prompt",
            "messages")
    if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
        raise ValidationError("messages must be a list of {'role': ..., 'content': ...} objects", "messages")
    text = tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                         add_generation_prompt=add_generation_prompt, **kwargs)
    # The template already wrote any BOS it wants: do not add special tokens twice.
    return tokenizer(text, add_special_tokens=False).input_ids
