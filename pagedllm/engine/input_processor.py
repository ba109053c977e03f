"""InputProcessor: turn what the user gave (text, token ids, a dict) into validated token ids.

Every check here raises ValidationError with a message that says what to change; nothing reaches
the scheduler unless it is well formed.
"""
from __future__ import annotations

from typing import Any

from pagedllm.errors import ValidationError

PromptType = str | list[int] | dict


class InputProcessor:
    def __init__(self, tokenizer: Any | None, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size

    def process_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """Returns (prompt text or None, prompt token ids)."""
        text: str | None = None
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                text = prompt.get("prompt")
            elif "prompt" in prompt:
                text = prompt["prompt"]
                ids = self._tokenize(text)
            else:
                raise ValidationError("a prompt dict needs 'prompt' or 'prompt_token_ids'", "prompt")
        elif isinstance(prompt, str):
            text = prompt
            ids = self._tokenize(prompt)
        elif isinstance(prompt, (list, tuple)):
            ids = prompt
        else:
            raise ValidationError(
                f"a prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}",
                "prompt")
        ids = self._validate_ids(ids)
        return text, ids

    def _tokenize(self, text: Any) -> list[int]:
        if not isinstance(text, str):
            raise ValidationError(f"prompt text must be a string, got {type(text).__name__}", "prompt")
        if self.tokenizer is None:
            raise ValidationError("this engine has no tokenizer; pass prompt_token_ids", "prompt")
        return list(self.tokenizer(text).input_ids)

    def _validate_ids(self, ids: Any) -> list[int]:
        if not isinstance(ids, (list, tuple)):
            raise ValidationError("prompt_token_ids must be a list of integers", "prompt")
        if len(ids) == 0:
            raise ValidationError("the prompt is empty; give at least one token", "prompt")
        out = []
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int):
                raise ValidationError(f"prompt token ids must be integers, got {t!r}", "prompt")
            if not 0 <= t < self.vocab_size:
                raise ValidationError(
                    f"token id {t} is outside the vocabulary (0..{self.vocab_size - 1})", "prompt")
            out.append(t)
        return out
