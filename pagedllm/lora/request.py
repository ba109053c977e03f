"""LoRARequest: which adapter a request runs with (vLLM's name and fields), plain data."""
from __future__ import annotations

from dataclasses import dataclass

from pagedllm.errors import ValidationError


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """``lora_name`` names the adapter (the ``model`` a server request gives), ``lora_int_id``
    (>= 1) identifies it in the worker's slots and the prefix cache, ``lora_path`` is its PEFT
    folder or GGUF adapter file (a Hub id: fetched by the engine)."""
    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValidationError("lora_name must be a non-empty string", "lora_request")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or not (
                1 <= self.lora_int_id < 1 << 63):
            raise ValidationError(f"lora_int_id must be an integer >= 1, got {self.lora_int_id!r}",
                                  "lora_request")
        if not isinstance(self.lora_path, str):
            raise ValidationError("lora_path must be a string (the adapter's folder)", "lora_request")

    @property
    def cache_key(self) -> str:
        """The prefix cache's extra key: blocks computed under one adapter are never another's."""
        return f"lora:{self.lora_int_id}:{self.lora_name}"


def check_lora_request(value: object) -> LoRARequest | None:
    """``value`` if it is a LoRARequest or None; ValidationError otherwise."""
    if value is None or isinstance(value, LoRARequest):
        return value
    raise ValidationError(f"lora_request must be a LoRARequest or None, got {type(value).__name__}",
                          "lora_request")
