"""ModelInfo: what the engine needs to know about a model folder, read from its JSON files alone
(no torch, no transformers), so the engine can validate requests before any weight is loaded."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from pagedllm.checkpoint.source import is_gguf_path, open_checkpoint
from pagedllm.errors import ModelLoadError
from pagedllm.hf_config import max_position_embeddings, sliding_window, text_config
from pagedllm.sampling_params import generation_defaults


@dataclass(frozen=True)
class ModelInfo:
    vocab_size: int
    max_position_embeddings: int
    eos_token_ids: frozenset[int] = frozenset()
    bos_token_id: int | None = None
    architectures: tuple[str, ...] = ()
    generation_defaults: dict = field(default_factory=dict)
    # The active attention window (hf_config.sliding_window), None without one: what the
    # dashboard and logs name; the attention layers apply it.
    sliding_window: int | None = None

    @classmethod
    def from_folder(cls, path: str | Path) -> "ModelInfo":
        folder = Path(path)
        cfg_path = folder / "config.json"
        gen: dict = {}
        if is_gguf_path(path):  # llama.cpp's file: config from its metadata
            cfg, cfg_path = open_checkpoint(folder).config, folder
        elif not cfg_path.is_file():
            raise ModelLoadError(
                f"{folder} is not a Hugging Face model folder: config.json is missing "
                f"(pass --model or set PAGEDLLM_MODEL to a folder with config.json and safetensors, "
                f"or a .gguf file)")
        else:
            cfg = open_checkpoint(folder).config
            gen_path = folder / "generation_config.json"
            if gen_path.is_file():
                gen = json.loads(gen_path.read_text())
        text_cfg = text_config(cfg)
        eos = gen.get("eos_token_id", text_cfg.get("eos_token_id"))
        if eos is None:
            eos_ids: frozenset[int] = frozenset()
        elif isinstance(eos, int):
            eos_ids = frozenset([eos])
        else:
            eos_ids = frozenset(int(e) for e in eos)
        vocab_size = text_cfg.get("vocab_size")
        if not isinstance(vocab_size, int):
            raise ModelLoadError(f"{cfg_path} has no integer vocab_size")
        return cls(
            vocab_size=vocab_size,
            max_position_embeddings=max_position_embeddings(cfg),
            eos_token_ids=eos_ids,
            bos_token_id=gen.get("bos_token_id", text_cfg.get("bos_token_id")),
            architectures=tuple(cfg.get("architectures") or ()),
            generation_defaults=generation_defaults(gen),
            sliding_window=sliding_window(cfg),
        )
