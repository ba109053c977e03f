"""Whether a GGUF file is a pooling model, and how it pools, from its metadata alone (no torch,
no tensors read): what runner_type.py and pooler_config.py ask of a ``.gguf`` path.

llama.cpp's encoders (``bert``, ``nomic-bert``) are embedders, or cross-encoders with RoBERTa's
classification head (``cls``, ``cls.output``); a decoder is one when its converter wrote
``<arch>.pooling_type`` (Qwen3-Embedding). The value is llama.cpp's
``llama_pooling_type``: 0 none, 1 mean, 2 CLS, 3 last, 4 rank (a reranker's head).
"""
from __future__ import annotations

from pathlib import Path

from pagedllm.checkpoint.gguf.encoders import ENCODER_ARCHITECTURES
from pagedllm.checkpoint.gguf.reader import open_gguf
from pagedllm.errors import UnsupportedModelError

_NONE, _RANK = 0, 4
_POOLING_TYPES = {1: "MEAN", 2: "CLS", 3: "LAST"}


def is_pooling_gguf(path: str | Path) -> bool:
    ckpt = open_gguf(path, read_tensors=False)
    pooling = ckpt.get(f"{ckpt.architecture}.pooling_type")
    return ckpt.architecture in ENCODER_ARCHITECTURES or (pooling is not None and int(pooling) != _NONE)


def gguf_pooling_type(path: str | Path) -> str | None:
    """The file's pooling type: CLS, MEAN, LAST, or None when unwritten."""
    ckpt = open_gguf(path)
    if "cls.output.weight" in ckpt.tensors:  # a cross-encoder: its head reads the CLS row
        if "cls.weight" not in ckpt.tensors:
            raise UnsupportedModelError(
                f"{Path(path).name} is a BERT cross-encoder without the pooler its classifier reads "
                "(llama.cpp's converter drops BERT's pooler), so no engine can give the model's scores "
                "from it; serve the Hugging Face folder (an XLM-R cross-encoder's GGUF is complete)", "model")
        return "CLS"
    value = ckpt.get(f"{ckpt.architecture}.pooling_type")
    if value is None or int(value) == _NONE:
        return None
    if int(value) not in _POOLING_TYPES:
        kind = "rank (a reranker's classification head)" if int(value) == _RANK else str(value)
        raise UnsupportedModelError(f"{Path(path).name}: GGUF pooling type {kind} is not supported; "
                                    "supported: mean, cls, last", "model")
    return _POOLING_TYPES[int(value)]
