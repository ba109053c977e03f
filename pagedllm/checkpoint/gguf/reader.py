"""Open a GGUF checkpoint (one file, or the shards of a split one) and validate it before any
weight is touched: a file that is not GGUF, is truncated or corrupt, holds a tensor type or an
architecture pagedllm cannot run, raises ModelLoadError / UnsupportedModelError with one line
that names what is wrong (and, when unsupported, what is supported).

Parsing is the ``gguf`` package's (llama.cpp's own reader). The loader reads each tensor's bytes
from the file when it unpacks that tensor (``GGUFTensor.read``), into a buffer freed after it:
the reader's memory map is not touched, so a loading process never holds the file's pages
beside the weights it builds from them.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pagedllm.checkpoint.gguf.quant_types import TYPE_INFO, supported_type_names, type_name
from pagedllm.errors import ModelLoadError, UnsupportedModelError

# llama.cpp's general.architecture -> the transformers architecture pagedllm runs it as
# (``llama`` with experts is Mixtral: families.py decides from the metadata).
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "gemma2": "Gemma2ForCausalLM",
                 "gemma3": "Gemma3ForCausalLM", "phi3": "Phi3ForCausalLM",
                 "granite": "GraniteForCausalLM", "olmo2": "Olmo2ForCausalLM",
                 "olmoe": "OlmoeForCausalLM", "qwen2moe": "Qwen2MoeForCausalLM",
                 "qwen3moe": "Qwen3MoeForCausalLM",
                 # encoders (embedders): checkpoint/gguf/encoders.py
                 "bert": "BertModel", "nomic-bert": "NomicBertModel"}

# gguf-split's shard names: ``<stem>-00001-of-00003.gguf``
_SHARD = re.compile(r"^(?P<stem>.*)-(?P<index>\d{5})-of-(?P<count>\d{5})\.gguf$")


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    type_id: int
    shape: tuple[int, ...]      # numpy order: [rows, cols] for a matrix (ggml's ne reversed)
    data: np.ndarray            # the file's bytes (or elements), memory-mapped
    path: Path                  # the shard that holds it
    offset: int                 # where its bytes start in that shard

    @property
    def type_name(self) -> str:
        return type_name(self.type_id)

    def read(self) -> np.ndarray:
        """The tensor's bytes, read from the file into memory of the caller's own (``data``'s
        pages, once touched, would stay resident with the map for the whole load)."""
        out = np.fromfile(self.path, dtype=np.uint8, count=self.data.nbytes, offset=self.offset)
        if out.nbytes != self.data.nbytes:
            raise ModelLoadError(f"{self.path}: tensor {self.name} ends past the end of the file "
                                 "(truncated?)")
        return out


@dataclass(frozen=True)
class GGUFCheckpoint:
    path: Path                   # the first shard
    metadata: dict[str, Any]     # key -> value (str, int, float, bool or list of them)
    tensors: dict[str, GGUFTensor]

    @property
    def architecture(self) -> str:
        return str(self.metadata["general.architecture"])

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)


def shard_paths(path: str | Path) -> list[Path]:
    """All shards of the checkpoint ``path`` names (any one of them), in order; ``[path]`` for
    an unsplit file."""
    path = Path(path)
    match = _SHARD.match(path.name)
    if not match:
        return [path]
    count = int(match["count"])
    shards = [path.with_name(f"{match['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    missing = [p.name for p in shards if not p.is_file()]
    if missing:
        raise ModelLoadError(f"{path.name} is shard {int(match['index'])} of {count}, but "
                             f"{', '.join(missing)} is missing from {path.parent}")
    return shards


def open_gguf(path: str | Path, read_tensors: bool = True) -> GGUFCheckpoint:
    """Parse and validate the checkpoint; with ``read_tensors`` False only the first shard's
    metadata is read (enough for the config and the tokenizer)."""
    shards = shard_paths(path)
    if not shards[0].is_file():
        raise ModelLoadError(f"GGUF file {shards[0]} does not exist")
    metadata: dict[str, Any] = {}
    tensors: dict[str, GGUFTensor] = {}
    for i, shard in enumerate(shards if read_tensors else shards[:1]):
        reader = _read(shard)
        if i == 0:
            metadata = _metadata(reader, shard)
            _check_architecture(metadata, shard)
        for t in reader.tensors:
            if t.name in tensors:
                raise ModelLoadError(f"{shard.name}: tensor {t.name} appears in two shards")
            tensors[t.name] = _tensor(t, shard)
    if read_tensors:
        _check_types(tensors, shards[0])
    return GGUFCheckpoint(shards[0], metadata, tensors)


def _read(path: Path):
    from gguf import GGUFReader  # the parser; numpy only

    try:
        return GGUFReader(path)
    except OSError as e:
        raise ModelLoadError(f"cannot read GGUF file {path}: {e}") from e
    except (ValueError, IndexError, KeyError, UnicodeDecodeError, OverflowError) as e:
        # The reader's own checks (magic, version) say ValueError; a truncated header or data
        # section shows as a short memory map that does not reshape.
        reason = str(e) or type(e).__name__
        if "magic" in reason:
            reason = "no GGUF magic at the start (not a GGUF file)"
        raise ModelLoadError(f"{path} is not a valid GGUF file (truncated or corrupt?): {reason}") from e


def _metadata(reader, path: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue  # the header's own counts
        try:
            out[key] = field.contents()
        except (ValueError, IndexError, UnicodeDecodeError) as e:
            raise ModelLoadError(f"{path}: metadata field {key} is corrupt: {e}") from e
    return out


def _tensor(t, path: Path) -> GGUFTensor:
    shape = tuple(int(n) for n in reversed(t.shape.tolist()))
    type_id = int(t.tensor_type)
    if type_id in TYPE_INFO:
        _, block, size = TYPE_INFO[type_id]
        expected = int(np.prod(shape)) // block * size
        if t.data.nbytes != expected:
            raise ModelLoadError(f"{path}: tensor {t.name} holds {t.data.nbytes} bytes, its shape "
                                 f"{shape} as {type_name(type_id)} needs {expected} (truncated?)")
    return GGUFTensor(t.name, type_id, shape, t.data, path, int(t.data_offset))


def _check_architecture(metadata: dict[str, Any], path: Path) -> None:
    arch = metadata.get("general.architecture")
    if arch is None:
        raise ModelLoadError(f"{path} has no general.architecture field")
    if arch not in ARCHITECTURES:
        raise UnsupportedModelError(f"GGUF architecture {arch!r} is not supported; supported: "
                                    f"{', '.join(sorted(ARCHITECTURES))}", "model")


def _check_types(tensors: dict[str, GGUFTensor], path: Path) -> None:
    for t in tensors.values():
        if t.type_id not in TYPE_INFO:
            raise UnsupportedModelError(
                f"{path.name}: tensor {t.name} has GGUF type {_ggml_name(t.type_id)}, which "
                f"pagedllm cannot load; supported types: {', '.join(supported_type_names())}", "model")


def _ggml_name(type_id: int) -> str:
    from gguf import GGMLQuantizationType

    try:
        return GGMLQuantizationType(type_id).name
    except ValueError:
        return f"#{type_id}"
