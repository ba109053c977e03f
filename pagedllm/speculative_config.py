"""vLLM's ``speculative_config``: which method drafts tokens, and how many per step.

``{"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2, "prompt_lookup_max": 4}``
(prompt lookup, in the engine core) or ``{"method": "draft_model", "model": PATH,
"num_speculative_tokens": k}`` (a second, smaller model in the runner; ``quantization`` its own,
as ModelConfig's; ``adaptive_draft_length``, on by default, lets each request draft fewer than k
from its measured acceptance, core/draft_length.py; or ``draft_p_min``, llama.cpp's: a request
stops drafting at a draft its draft model gives less than that probability). Either method:
``disable_by_batch_size`` (vLLM's) drafts nothing while that many requests or more are running or
waiting. ``{"method": "eagle3", "model": HEAD, ...}`` (an EAGLE-3 head) and ``{"method": "mtp", ...}``
(the multi-token-prediction layers of the target's own checkpoint) draft in the runner from the
target's hidden states (runner/eagle.py), with a draft model's other keys. Parsed once at the
edge; a bad value names the key to change.
"""
from __future__ import annotations

from dataclasses import dataclass

from pagedllm.errors import ValidationError

_NGRAM_METHODS = ("ngram", "ngram-prompt-lookup")
_DRAFTER_KEYS = {"adaptive_draft_length", "disable_by_batch_size", "draft_p_min"}
_KEYS = {"ngram": {"prompt_lookup_min", "prompt_lookup_max", "disable_by_batch_size"},
         "draft_model": {"model", "quantization"} | _DRAFTER_KEYS,
         "eagle3": {"model"} | _DRAFTER_KEYS,
         "mtp": _DRAFTER_KEYS}
# Methods whose drafts the runner makes from the target's hidden states (runner/eagle.py).
HIDDEN_STATE_METHODS = ("eagle3", "mtp")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str  # "ngram", "draft_model", "eagle3" or "mtp"
    num_speculative_tokens: int
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    model: str | None = None  # the draft model: a folder, a .gguf file or a Hub id
    quantization: str | None = None  # the draft's (None: what its checkpoint is)
    adaptive_draft_length: bool = True  # draft_model: fewer drafts for requests that reject them
    disable_by_batch_size: int | None = None  # no drafts while this many requests are queued
    draft_p_min: float | None = None  # draft_model: stop a request's drafts below this draft probability

    @property
    def uses_draft_model(self) -> bool:
        """The runner fills the draft slots (a draft model, an EAGLE-3 head, MTP layers)."""
        return self.method == "draft_model" or self.method in HIDDEN_STATE_METHODS

    @property
    def reads_target_hidden_states(self) -> bool:
        return self.method in HIDDEN_STATE_METHODS

    @classmethod
    def from_dict(cls, speculative_config: dict | None) -> SpeculativeConfig | None:
        if not speculative_config:
            return None
        if not isinstance(speculative_config, dict):
            raise ValidationError("speculative_config must be a JSON object", "speculative_config")
        cfg = dict(speculative_config)
        method = cfg.pop("method", "ngram")
        method = "ngram" if method in _NGRAM_METHODS else method
        if method not in _KEYS:
            raise ValidationError(f"speculative method {method!r} is not supported; use 'ngram', "
                                  "'draft_model', 'eagle3' or 'mtp'", "speculative_config")
        k = cfg.pop("num_speculative_tokens", None)
        unknown = set(cfg) - _KEYS[method]
        if unknown:
            raise ValidationError(f"unknown speculative_config keys for method {method!r}: "
                                  f"{sorted(unknown)}", "speculative_config")
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValidationError("speculative_config needs num_speculative_tokens >= 1", "speculative_config")
        off = cfg.pop("disable_by_batch_size", None)
        if off is not None and (not isinstance(off, int) or isinstance(off, bool) or off < 1):
            raise ValidationError("speculative_config.disable_by_batch_size must be an int >= 1",
                                  "speculative_config")
        if method != "ngram":
            return _draft_model_config(method, cfg, k, off)
        lo, hi = cfg.get("prompt_lookup_min"), cfg.get("prompt_lookup_max")
        hi = hi if hi is not None else (lo if lo is not None else 4)
        lo = lo if lo is not None else min(2, hi)
        if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi):
            raise ValidationError("need 1 <= prompt_lookup_min <= prompt_lookup_max", "speculative_config")
        return cls(method, k, lo, hi, disable_by_batch_size=off)


def _draft_model_config(method: str, cfg: dict, k: int, disable_by_batch_size: int | None) -> SpeculativeConfig:
    model, quantization, p_min = cfg.get("model"), cfg.get("quantization"), cfg.get("draft_p_min")
    if method != "mtp" and (not isinstance(model, str) or not model):
        what = "the draft model's" if method == "draft_model" else "the EAGLE-3 head's"
        raise ValidationError(f"speculative_config with method {method!r} needs \"model\": "
                              f"{what} path or Hub id", "speculative_config")
    if quantization is not None and not isinstance(quantization, str):
        raise ValidationError("speculative_config.quantization must be a string", "speculative_config")
    if p_min is not None and (isinstance(p_min, bool) or not isinstance(p_min, (int, float))
                              or not 0.0 <= p_min < 1.0):
        raise ValidationError("speculative_config.draft_p_min must be a number in [0, 1)", "speculative_config")
    adaptive = cfg.get("adaptive_draft_length", p_min is None)
    if not isinstance(adaptive, bool):
        raise ValidationError("speculative_config.adaptive_draft_length must be true or false",
                              "speculative_config")
    if adaptive and p_min is not None:
        raise ValidationError("speculative_config: adaptive_draft_length and draft_p_min are two ways to "
                              "choose how many drafts a request makes; set one", "speculative_config")
    return SpeculativeConfig(method, k, model=model, quantization=quantization,
                             adaptive_draft_length=adaptive, disable_by_batch_size=disable_by_batch_size,
                             draft_p_min=None if p_min is None else float(p_min))
