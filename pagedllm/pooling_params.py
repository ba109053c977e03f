"""PoolingParams: what a pooling request asks of its vector, with vLLM's field names.

A pooling request is one forward over its whole input; its output is a vector (an embedding, a
class distribution, a relevance score), not tokens. Validation happens once, in
``__post_init__``, and raises :class:`ValidationError` naming the field.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from pagedllm.errors import ValidationError, check_ints

# vLLM's pooling tasks: embed (a normalized sentence vector), classify (class probabilities),
# score (a cross-encoder's relevance of a text pair), encode (the raw pooled hidden state).
POOLING_TASKS = ("embed", "classify", "score", "encode")


@dataclass
class PoolingParams:
    task: str | None = None  # None: the caller (LLM.embed, a route) sets it
    dimensions: int | None = None  # Matryoshka: keep the first k dimensions, then renormalize
    normalize: bool | None = None  # embed: L2-normalize (None: the model's default, on)
    use_activation: bool | None = None  # classify/score: sigmoid or softmax (None: on)
    # Keep only the last k tokens of the input (vLLM's left truncation); -1: the model's limit.
    truncate_prompt_tokens: int | None = None
    # Where the second segment of a text pair starts (a cross-encoder's token type 1); None: one
    # segment. vLLM carries it as compressed_token_type_ids too.
    extra_kwargs: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_ints([self.dimensions, self.truncate_prompt_tokens], "pooling_params")
        if self.task is not None and self.task not in POOLING_TASKS:
            raise ValidationError(f"task must be one of {', '.join(POOLING_TASKS)}; got {self.task!r}", "task")
        if self.dimensions is not None and (isinstance(self.dimensions, bool) or self.dimensions < 1):
            raise ValidationError(f"dimensions must be a positive integer, got {self.dimensions!r}",
                                  "dimensions")
        tpt = self.truncate_prompt_tokens
        if tpt is not None and (isinstance(tpt, bool) or (tpt < 1 and tpt != -1)):
            raise ValidationError(f"truncate_prompt_tokens must be -1 or >= 1, got {tpt!r}",
                                  "truncate_prompt_tokens")
        for name in ("normalize", "use_activation"):
            if getattr(self, name) not in (None, True, False):
                raise ValidationError(f"{name} must be true or false", name)

    @property
    def token_type_start(self) -> int | None:
        return self.extra_kwargs.get("compressed_token_type_ids")

    def clone(self, **changes) -> "PoolingParams":
        changes.setdefault("extra_kwargs", dict(self.extra_kwargs))
        return replace(self, **changes)
