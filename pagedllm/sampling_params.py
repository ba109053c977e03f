"""SamplingParams: how to pick tokens and when to stop, with vLLM's field names.

Validation happens once, in ``__post_init__``, and raises :class:`ValidationError` naming the field.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import IntEnum

from pagedllm.errors import INT64_MAX, INT64_MIN, ValidationError, check_ints, check_text
from pagedllm.structured_outputs_params import StructuredOutputsParams

_SAMPLING_EPS = 1e-5
# The integer fields: each must fit the executor wire (64 bits) before its own range check
# (a seed seeds a torch generator, whose seed is 64 bits too: vLLM's range).
_INT_FIELDS = ("n", "top_k", "seed", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs")
# The floats a NaN or an infinity would poison (NaN fails every comparison, so range checks
# alone let it through).
_FLOAT_FIELDS = ("presence_penalty", "frequency_penalty", "repetition_penalty", "temperature",
                 "top_p", "min_p")
# The fields a model's generation_config.json sets for requests that omit them (vLLM's
# --generation-config): the engine's defaults and the server's per-field fallback.
GENERATION_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def generation_defaults(generation_config: dict) -> dict:
    """The sampling defaults a generation_config.json's values give (other keys ignored)."""
    return {k: generation_config[k] for k in GENERATION_DEFAULT_KEYS if k in generation_config}


class RequestOutputKind(IntEnum):
    CUMULATIVE = 0  # every output carries everything generated so far
    DELTA = 1  # every output carries only what is new since the previous one (streaming)
    FINAL_ONLY = 2  # only the finished output is returned


def _bad(param: str, msg: str) -> ValidationError:
    """The error for a bad ``param``: its name starts the message and is the error's param."""
    return ValidationError(f"{param} {msg}", param)


@dataclass
class SamplingParams:
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None
    output_kind: RequestOutputKind = RequestOutputKind.FINAL_ONLY
    detokenize: bool = True
    # Constrain the output to a JSON schema, regex, choice or grammar (pagedllm/structured_output/).
    structured_outputs: StructuredOutputsParams | None = None

    # Filled in by __post_init__.
    _all_stop_token_ids: frozenset[int] = field(default=frozenset(), repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.logit_bias is not None:
            try:
                self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except (TypeError, ValueError, AttributeError) as e:
                raise ValidationError(
                    f"logit_bias must map token ids to floats, got {self.logit_bias!r}", "logit_bias"
                ) from e
        if self.top_k == -1:
            self.top_k = 0
        self._validate()
        self._all_stop_token_ids = frozenset(self.stop_token_ids)

    def _validate(self) -> None:
        self._validate_numbers()
        self._validate_limits()
        self._validate_stops()

    def _validate_numbers(self) -> None:
        """Types, and the sampling knobs' ranges."""
        for name in _INT_FIELDS:
            check_ints(getattr(self, name), name)
        check_ints(self.stop_token_ids, "stop_token_ids")
        check_ints(list(self.logit_bias or ()), "logit_bias")
        if not isinstance(self.n, int) or self.n < 1:
            raise _bad("n", f"must be an integer >= 1, got {self.n!r}")
        for name in _FLOAT_FIELDS:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise _bad(name, f"must be a finite number, got {v!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not -2.0 <= v <= 2.0:
                raise _bad(name, f"must be in [-2, 2], got {v}")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise _bad("repetition_penalty", f"must be in (0, 2], got {self.repetition_penalty}")
        if self.temperature < 0.0:
            raise _bad("temperature", f"must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise _bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise _bad("top_k", f"must be -1 (disable), 0 or a positive integer, got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            raise _bad("min_p", f"must be in [0, 1], got {self.min_p}")

    def _validate_limits(self) -> None:
        """The seed, the output length and how many logprobs."""
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not INT64_MIN <= self.seed <= INT64_MAX):
            raise _bad("seed", f"must be an integer in [-2**63, 2**63 - 1], got {self.seed!r}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise _bad("max_tokens", f"must be at least 1, got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise _bad("min_tokens", f"must be >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise _bad("min_tokens", f"must be <= max_tokens={self.max_tokens}, got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 0 or v > 20):
                raise _bad(name, f"must be an integer in [0, 20], got {v!r}")

    def _validate_stops(self) -> None:
        """Stop strings and token ids, logit biases, structured outputs."""
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise _bad("stop", "must be non-empty strings")
        check_text(self.stop, "stop")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise _bad("stop_token_ids", "must be non-negative integers")
        if self.logit_bias is not None and any(not -100.0 <= v <= 100.0 for v in self.logit_bias.values()):
            raise _bad("logit_bias", "values must be finite and in [-100, 100]")  # NaN fails too
        if self.structured_outputs is not None and not isinstance(self.structured_outputs,
                                                                  StructuredOutputsParams):
            raise _bad("structured_outputs", "must be a StructuredOutputsParams")

    @property
    def sampling_type_greedy(self) -> bool:
        return self.temperature < _SAMPLING_EPS

    @property
    def all_stop_token_ids(self) -> frozenset[int]:
        return self._all_stop_token_ids

    def clone(self, **changes) -> "SamplingParams":
        """A copy with some fields changed (validated again)."""
        values = {k: getattr(self, k) for k in self.__dataclass_fields__ if not k.startswith("_")}
        values.update(changes)
        return SamplingParams(**values)
