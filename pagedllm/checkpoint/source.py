"""A model checkpoint, opened once: a safetensors folder, an AWQ/GPTQ folder or a GGUF file (or
its shards). Each gives its config (read once per process and shared by ModelInfo, the executor's
tensor-parallel check, the tokenizer and the loader), where its tokenizer is, and its named tensors.

Torch-free: the engine asks for a config before any model is built. The torch side of each
kind (how its tensors reach a model) is in checkpoint/weights.py and checkpoint/gguf/weights.py.
"""
from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pagedllm.errors import ModelLoadError
from pagedllm.hf_config import is_gguf_path, read_config_json


class Checkpoint:
    """One model's files. ``config`` is read on first use and kept; ``kind`` says which source
    class reads the weights."""

    kind = "safetensors"

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._config: dict | None = None

    @property
    def config(self) -> dict:
        if self._config is None:
            self._config = self._read_config()
        return self._config

    @property
    def tokenizer_path(self) -> str:
        return str(self.path)

    def resolve_quantization(self, requested: str | None) -> str | None:
        """``--quantization`` checked against what this checkpoint holds (or detected from it)."""
        from pagedllm.layers.quantization.checkpoint_formats import resolve_quantization

        return resolve_quantization(requested, self.config, is_gguf=False)

    def tensors(self) -> Iterator[tuple[str, Any]]:
        """(checkpoint name, tensor) for every tensor of the files, as stored."""
        from safetensors import safe_open

        for path in self.weight_files():
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)

    def _read_config(self) -> dict:
        path = self.path / "config.json"
        if not path.is_file():
            raise ModelLoadError(f"{self.path} is not a model folder: no config.json")
        try:
            return read_config_json(self.path)
        except json.JSONDecodeError as e:
            raise ModelLoadError(f"{path} is not valid JSON: {e}") from e

    def weight_files(self) -> list[Path]:
        """The safetensors files of the folder: the index's shards, or model.safetensors."""
        folder = self.path
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise ModelLoadError(f"{index} is not a valid safetensors index: {e}") from e
            files = [folder / name for name in sorted(set(weight_map.values()))]
            missing = [f.name for f in files if not f.is_file()]
            if missing:
                raise ModelLoadError(f"{folder}: weight shards listed in {index.name} are missing: "
                                     f"{', '.join(missing)}")
            return files
        single = folder / "model.safetensors"
        if single.is_file():
            return [single]
        others = sorted(folder.glob("*.safetensors"))
        if others:
            return others
        raise ModelLoadError(f"{folder}: no model.safetensors or model.safetensors.index.json "
                             "(only safetensors weights are supported)")


class QuantizedFolder(Checkpoint):
    """An AWQ or GPTQ folder: safetensors whose linears are packed 4-bit (``qweight``, ``scales``,
    ``qzeros``), described by config.json's ``quantization_config``."""

    def __init__(self, path: str | Path, config: dict, method: str) -> None:
        super().__init__(path)
        self._config = config
        self.kind = method


class GGUFFile(Checkpoint):
    """llama.cpp's file (any shard of a split one names them all): config from its metadata,
    tokenizer embedded, tensors typed (block-quantized or float)."""

    kind = "gguf"

    def __init__(self, path: str | Path) -> None:
        super().__init__(path)
        self._reader = None  # the file parsed for its config, handed to the first load

    def resolve_quantization(self, requested: str | None) -> str | None:
        from pagedllm.layers.quantization.checkpoint_formats import resolve_quantization

        return resolve_quantization(requested, None, is_gguf=True)

    def open(self):
        """The parsed and validated file (gguf/reader.py's GGUFCheckpoint); the one the config
        was read from, once, so a load parses the file once."""
        from pagedllm.checkpoint.gguf.reader import open_gguf

        reader, self._reader = self._reader, None
        return reader if reader is not None else open_gguf(self.path)

    def tensors(self) -> Iterator[tuple[str, Any]]:
        """(GGUF tensor name, unpacked value: a GroupQuant or a float array), in file order."""
        from pagedllm.checkpoint.gguf.quant_types import unpack

        for tensor in self.open().tensors.values():
            yield tensor.name, unpack(tensor.type_id, tensor.read(), tensor.shape)

    def _read_config(self) -> dict:
        from pagedllm.checkpoint.gguf.config import hf_config
        from pagedllm.checkpoint.gguf.reader import open_gguf

        self._reader = open_gguf(self.path)
        return hf_config(self._reader)


# path -> (the stamp of its config file, the opened checkpoint): each process reads a config once.
_OPENED: dict[str, tuple[tuple[int, int] | None, Checkpoint]] = {}
_LOCK = threading.Lock()


def open_checkpoint(path: str | Path) -> Checkpoint:
    """The checkpoint at ``path``, opened once per process while its config file is unchanged
    (a rewritten file is read again). A folder's config.json is read here (its
    ``quantization_config`` says the kind); a GGUF file is parsed when first asked."""
    key = str(Path(path).resolve())
    stamp = _stamp(Path(path))
    with _LOCK:
        cached = _OPENED.get(key)
        if cached is not None and stamp is not None and cached[0] == stamp:
            return cached[1]
        ckpt = GGUFFile(path) if is_gguf_path(path) else _folder(Path(path))
        if stamp is not None:
            _OPENED[key] = (stamp, ckpt)
        return ckpt


def _folder(path: Path) -> Checkpoint:
    plain = Checkpoint(path)
    if not (path / "config.json").is_file():
        return plain  # its config says what is wrong, when asked
    try:
        config = plain.config
    except ModelLoadError:
        return plain
    method = str((config.get("quantization_config") or {}).get("quant_method", "")).lower()
    return QuantizedFolder(path, config, method) if method in ("awq", "gptq") else plain


def _stamp(path: Path) -> tuple[int, int] | None:
    """(modification time, size) of the file that holds the config; None when there is none."""
    try:
        st = (path if is_gguf_path(path) else path / "config.json").stat()
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size
