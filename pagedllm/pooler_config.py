"""PoolerConfig: how a pooling model turns hidden states into its vector, read once from the
checkpoint (sentence-transformers' files where they exist, else the checkpoint's config) and vLLM's
``pooler_config`` override. Standard library only: the front end checks requests against it
(``dimensions``, prompts) and the runner builds the pooler from it (models/pooler.py)."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from pagedllm.errors import ModelLoadError, ValidationError
from pagedllm.hf_config import is_gguf_path

POOLING_TYPES = ("CLS", "MEAN", "LAST")
# classifier_from_token: a decoder as a yes/no reranker (Qwen3-Reranker): the score is
# sigmoid(logit[yes] - logit[no]) at the last token, [no, yes] given as tokens or token ids.
_OVERRIDE_KEYS = ("pooling_type", "normalize", "classifier_from_token")
# sentence-transformers' 1_Pooling/config.json flags -> pooling type.
_ST_MODES = {"pooling_mode_cls_token": "CLS", "pooling_mode_mean_tokens": "MEAN",
             "pooling_mode_lasttoken": "LAST"}
_ST_MODE_NAMES = {"cls": "CLS", "mean": "MEAN", "lasttoken": "LAST"}


@dataclass(frozen=True)
class DenseSpec:
    """One sentence-transformers Dense module (a folder with its weights)."""
    path: str
    in_features: int
    out_features: int
    bias: bool
    activation: str  # the torch class path sentence-transformers saved


@dataclass(frozen=True)
class PoolerConfig:
    pooling_type: str
    normalize: bool  # embed's default (a Normalize module, or on without sentence-transformers)
    hidden_size: int
    dense: tuple[DenseSpec, ...] = ()
    is_matryoshka: bool = False
    num_labels: int = 0  # a classification head's outputs (0: none)
    id2label: dict[int, str] = field(default_factory=dict)
    multi_label: bool = False  # problem_type multi_label_classification: sigmoid per label
    prompts: dict[str, str] = field(default_factory=dict)
    default_prompt_name: str | None = None
    classifier_from_token: tuple[str | int, ...] = ()  # (no, yes): a decoder's two logits

    @property
    def embedding_size(self) -> int:
        return self.dense[-1].out_features if self.dense else self.hidden_size

    def check_dimensions(self, dimensions: int | None) -> None:
        if dimensions is None:
            return
        if not self.is_matryoshka:
            raise ValidationError("this model does not support matryoshka representations: "
                                  "leave dimensions unset", "dimensions")
        if dimensions > self.embedding_size:
            raise ValidationError(f"dimensions={dimensions} exceeds the model's embedding size "
                                  f"{self.embedding_size}; lower it", "dimensions")

    def prompt_text(self, prompt_name: str | None) -> str:
        """The prefix sentence-transformers would put before an input (``prompts``)."""
        name = prompt_name if prompt_name is not None else self.default_prompt_name
        if name is None:
            return ""
        if name not in self.prompts:
            raise ValidationError(f"prompt_name {name!r} is not one of the model's prompts "
                                  f"({', '.join(self.prompts) or 'none'})", "prompt_name")
        return self.prompts[name]


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read {path}: {e}") from e


def _st_pooling_type(path: Path) -> str:
    """sentence-transformers' pooling: ``pooling_mode`` (v6: a name or a list) or the older
    ``pooling_mode_*`` flags; exactly one of CLS, mean and last token."""
    cfg = _read_json(path)
    if "pooling_mode" in cfg:
        mode = cfg["pooling_mode"]
        names = [mode] if isinstance(mode, str) else list(mode)
        modes = [_ST_MODE_NAMES.get(str(n).lower(), str(n)) for n in names]
    else:
        modes = [t for key, t in _ST_MODES.items() if cfg.get(key)]
        modes += [key for key, on in cfg.items() if on is True and key.startswith("pooling_mode_")
                  and key not in _ST_MODES]
    if len(modes) != 1 or modes[0] not in POOLING_TYPES:
        raise ModelLoadError(f"{path}: pagedllm pools by exactly one of CLS, mean or last token; "
                             f"this pooling config asks for {modes}")
    return modes[0]


def _st_modules(folder: Path) -> tuple[str | None, bool, list[DenseSpec]]:
    """(pooling type, normalize, dense modules) from modules.json, in module order."""
    pooling_type, normalize, dense = None, False, []
    for module in _read_json(folder / "modules.json"):
        kind, path = str(module.get("type", "")), folder / module.get("path", "")
        if kind.endswith(".Pooling"):
            pooling_type = _st_pooling_type(path / "config.json")
        elif kind.endswith(".Normalize"):
            normalize = True
        elif kind.endswith(".Dense"):
            cfg = _read_json(path / "config.json")
            dense.append(DenseSpec(str(path), int(cfg["in_features"]), int(cfg["out_features"]),
                                   bool(cfg.get("bias", True)),
                                   str(cfg.get("activation_function", "torch.nn.modules.linear.Identity"))))
    return pooling_type, normalize, dense


def _default_pooling_type(config: dict) -> str:
    """Without sentence-transformers' files: a classifier's CLS for encoders, the last token
    for decoders (Qwen3-Embedding style), as vLLM."""
    archs = config.get("architectures") or []
    if config.get("classifier_pooling"):  # ModernBERT's classifier: "cls" or "mean"
        return "MEAN" if config["classifier_pooling"] == "mean" else "CLS"
    decoder = any(a.endswith(("ForCausalLM", "ForConditionalGeneration")) for a in archs)
    return "LAST" if decoder else "CLS"


def load_pooler_config(model: str, config: dict, overrides: dict | None = None) -> PoolerConfig:
    """``config``: the opened checkpoint's (checkpoint/source.py: config.json is read once);
    sentence-transformers' own files are read from the folder ``model``."""
    folder = Path(model)
    pooling_type, normalize, dense = None, True, []
    if is_gguf_path(folder):  # llama.cpp's file: normalized, as llama.cpp's default
        from pagedllm.checkpoint.gguf.pooling import gguf_pooling_type

        pooling_type = gguf_pooling_type(folder)
    text = config.get("text_config") or config
    if (folder / "modules.json").is_file():
        pooling_type, normalize, dense = _st_modules(folder)
    overrides = dict(overrides or {})
    unknown = set(overrides) - set(_OVERRIDE_KEYS)
    if unknown:
        raise ValidationError(f"pooler_config keys must be among {', '.join(_OVERRIDE_KEYS)}; got "
                              f"{', '.join(sorted(unknown))}", "pooler_config")
    pooling_type = str(overrides.get("pooling_type", pooling_type or _default_pooling_type(config))).upper()
    if pooling_type not in POOLING_TYPES:
        raise ValidationError(f"pooling_type must be one of {', '.join(POOLING_TYPES)}; got "
                              f"{pooling_type!r}", "pooler_config")
    st = {}
    if (folder / "config_sentence_transformers.json").is_file():
        st = _read_json(folder / "config_sentence_transformers.json")
    archs = config.get("architectures") or []
    classifier = any(a.endswith("ForSequenceClassification") for a in archs)
    id2label = {int(k): str(v) for k, v in (config.get("id2label") or {}).items()} if classifier else {}
    from_token = tuple(overrides.get("classifier_from_token") or ())
    if from_token:
        if len(from_token) != 2 or not all(isinstance(t, (str, int)) for t in from_token):
            raise ValidationError("classifier_from_token must name two tokens, [no, yes]", "pooler_config")
        id2label = {0: str(from_token[1])}
    return PoolerConfig(
        pooling_type=pooling_type,
        normalize=bool(overrides.get("normalize", normalize)),
        hidden_size=int(text.get("hidden_size") or text["n_embd"]),  # n_embd: GPT-2-style configs
        dense=tuple(dense),
        is_matryoshka=bool(config.get("is_matryoshka") or config.get("matryoshka_dimensions")),
        num_labels=len(id2label),
        id2label=id2label,
        multi_label=config.get("problem_type") == "multi_label_classification",
        prompts=dict(st.get("prompts") or {}),
        default_prompt_name=st.get("default_prompt_name"),
        classifier_from_token=from_token,
    )
