"""Admission checks: a request that could never run is rejected before it is queued."""
from __future__ import annotations

from pagedllm.core.request import Request
from pagedllm.errors import ValidationError


def validate_request(request: Request, max_model_len: int, num_blocks: int, block_size: int) -> None:
    """Raise ValidationError (saying what to change) unless the request can run alone in an
    empty cache; resolves ``max_tokens=None`` to what fits."""
    num_prompt = request.num_prompt_tokens
    if num_prompt == 0:
        raise ValidationError("the prompt is empty; give at least one token", "prompt")
    if num_prompt >= max_model_len:
        raise ValidationError(
            f"the prompt has {num_prompt} tokens but max_model_len is {max_model_len} "
            f"(prompt + at least one output token must fit); shorten the prompt", "prompt")
    if request.max_tokens is None:
        # Up to max_model_len, and never more than the whole KV cache could hold (the
        # last sampled token is never written, hence + 1).
        request.max_tokens = max(1, min(max_model_len, num_blocks * block_size + 1) - num_prompt)
    total = num_prompt + request.max_tokens
    if total > max_model_len:
        raise ValidationError(
            f"this model's maximum context length is {max_model_len} tokens, but "
            f"{total} were requested ({num_prompt} in the prompt, {request.max_tokens} in "
            f"max_tokens); lower max_tokens or shorten the prompt", "max_tokens")
    # The last sampled token is never written to the cache, hence total - 1.
    needed = -(-(total - 1) // block_size)
    if needed > num_blocks:
        raise ValidationError(
            f"the request needs {needed} KV blocks ({total} tokens) but the whole cache has "
            f"{num_blocks}; lower max_tokens, shorten the prompt or give "
            f"the KV cache more memory", "max_tokens")
