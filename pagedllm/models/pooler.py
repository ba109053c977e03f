"""Pooler: the last stage of a pooling model's step, in place of the sampler.

Each request's rows of the flat hidden states become one vector: CLS, mean or last-token
pooling; then, for embed, sentence-transformers' Dense modules, Matryoshka truncation and L2
normalization; for classify and score, the model's classification head and its activation.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from pagedllm.errors import ModelLoadError
from pagedllm.pooler_config import DenseSpec, PoolerConfig
from pagedllm.pooling_params import PoolingParams

_DENSE_ACTIVATIONS = {"torch.nn.modules.linear.Identity": nn.Identity, "torch.nn.modules.activation.Tanh": nn.Tanh,
                      "torch.nn.modules.activation.ReLU": nn.ReLU, "torch.nn.modules.activation.GELU": nn.GELU,
                      "torch.nn.modules.activation.Sigmoid": nn.Sigmoid}


def _load_dense(spec: DenseSpec, dtype: torch.dtype, device: torch.device) -> nn.Sequential:
    folder = Path(spec.path)
    if spec.activation not in _DENSE_ACTIVATIONS:
        raise ModelLoadError(f"{folder}: Dense activation {spec.activation} is not supported")
    files = sorted(folder.glob("*.safetensors"))
    if files:
        state = load_file(str(files[0]))
    elif (folder / "pytorch_model.bin").is_file():
        state = torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
    else:
        raise ModelLoadError(f"{folder}: a Dense module without weights")
    linear = nn.Linear(spec.in_features, spec.out_features, bias=spec.bias)
    linear.load_state_dict({k.removeprefix("linear."): v for k, v in state.items()})
    return nn.Sequential(linear, _DENSE_ACTIVATIONS[spec.activation]()).to(dtype=dtype, device=device)


def token_ids(tokens: tuple[str | int, ...], model_path: str) -> list[int]:
    """Token ids as given, or each token string's single id in the model's tokenizer."""
    if all(isinstance(t, int) for t in tokens):
        return list(tokens)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    ids = []
    for t in tokens:
        found = t if isinstance(t, int) else tokenizer.convert_tokens_to_ids(t)
        if found is None or found == tokenizer.unk_token_id:
            raise ModelLoadError(f"classifier_from_token: {t!r} is not one token of this model's vocabulary")
        ids.append(int(found))
    return ids


class YesNoClassifier(nn.Module):
    """Qwen3-Reranker: the relevance logit is logit[yes] - logit[no] at the last token, so its
    sigmoid is the softmax of the two."""

    def __init__(self, model: nn.Module, ids: list[int]) -> None:
        super().__init__()
        self.model = [model]  # a list: not a submodule of the pooler
        self.no, self.yes = ids

    def forward(self, last_rows: torch.Tensor) -> torch.Tensor:
        logits = self.model[0].compute_logits(last_rows)
        return (logits[:, self.yes] - logits[:, self.no]).unsqueeze(-1)


class Pooler(nn.Module):
    def __init__(self, config: PoolerConfig, model: nn.Module, dtype: torch.dtype, device: torch.device,
                 model_path: str = "") -> None:
        super().__init__()
        self.config = config
        self.dense = nn.ModuleList(_load_dense(spec, dtype, device) for spec in config.dense)
        # A classifier's head lives in the model (its checkpoint names are the model's); a
        # decoder reranker reads two of its logits.
        self.classify = getattr(model, "classify", None)
        if config.classifier_from_token:
            self.classify = YesNoClassifier(model, token_ids(config.classifier_from_token, model_path))

    def carry(self, rows: torch.Tensor) -> torch.Tensor:
        """What a chunk of an input, not its last, keeps for the pooler: every row for mean
        pooling, the first for CLS (the input's first row comes first), none for the last
        token. A copy: the step's hidden states are not kept."""
        kind = self.config.pooling_type
        return (rows if kind == "MEAN" else rows[:1] if kind == "CLS" else rows[:0]).clone()

    def _pool(self, inputs: list[torch.Tensor]) -> torch.Tensor:
        """Each request's rows ``[n, hidden]`` -> ``[B, hidden]``."""
        kind = self.config.pooling_type
        if kind == "CLS":
            return torch.stack([rows[0] for rows in inputs])
        if kind == "LAST":
            return torch.stack([rows[-1] for rows in inputs])
        return torch.stack([rows.mean(dim=0) for rows in inputs])

    @torch.inference_mode()
    def forward(self, inputs: list[torch.Tensor], params: list[PoolingParams]) -> list[list[float]]:
        """``inputs``: each request's hidden rows (its whole input), in ``params``' order."""
        pooled = self._pool(inputs).float()
        dtype = inputs[0].dtype
        tasks = {p.task for p in params}
        results: list[list[float]] = [[] for _ in params]
        if tasks & {"classify", "score"}:
            if self.classify is None:
                raise ModelLoadError("this model has no classification head: it can embed, not classify or score")
            logits = self.classify(pooled.to(dtype)).float()
        if tasks & {"embed"}:
            embedded = pooled.to(dtype)
            for dense in self.dense:
                embedded = dense(embedded)
            embedded = embedded.float()
        for i, p in enumerate(params):
            if p.task == "encode":
                results[i] = pooled[i].tolist()
            elif p.task == "embed":
                vec = embedded[i, :p.dimensions] if p.dimensions else embedded[i]
                if self.config.normalize if p.normalize is None else p.normalize:
                    vec = F.normalize(vec, dim=-1)
                results[i] = vec.tolist()
            else:
                results[i] = self._activate(logits[i], p).tolist()
        return results

    def _activate(self, logits: torch.Tensor, params: PoolingParams) -> torch.Tensor:
        """Sigmoid for one label (a relevance score) or a multi-label classifier, else softmax."""
        if params.use_activation is False:
            return logits
        if logits.shape[-1] == 1 or self.config.multi_label:
            return torch.sigmoid(logits)
        return torch.softmax(logits, dim=-1)
