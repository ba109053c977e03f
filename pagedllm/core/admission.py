"""Admission checks: a request that could never run is rejected before it is queued."""
from __future__ import annotations

from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request
from pagedllm.errors import ValidationError


def validate_request(request: Request, max_model_len: int, kv: KVCacheManager) -> None:
    """Raise ValidationError (saying what to change) unless the request can run alone in an
    empty cache; resolves ``max_tokens=None`` to what fits.

    What a request needs is counted per KV cache group (``kv.num_blocks_needed``): a window
    group holds about a window and a chunk however long the request, a full-attention group
    every position. The last sampled token is never written to the cache, hence total - 1."""
    num_prompt = request.num_prompt_tokens
    num_blocks = kv.num_blocks
    if num_prompt == 0:
        raise ValidationError("the prompt is empty; give at least one token", "prompt")
    if num_prompt >= max_model_len:
        raise ValidationError(
            f"the prompt has {num_prompt} tokens but max_model_len is {max_model_len} "
            f"(prompt + at least one output token must fit); shorten the prompt", "prompt")
    if request.max_tokens is None:
        # Up to max_model_len, and never more than the whole KV cache could hold.
        request.max_tokens = max(1, _max_total_tokens(kv, max_model_len) - num_prompt)
    total = num_prompt + request.max_tokens
    if total > max_model_len:
        raise ValidationError(
            f"this model's maximum context length is {max_model_len} tokens, but "
            f"{total} were requested ({num_prompt} in the prompt, {request.max_tokens} in "
            f"max_tokens); lower max_tokens or shorten the prompt", "max_tokens")
    needed = kv.num_blocks_needed(total - 1)
    if needed > num_blocks:
        raise ValidationError(
            f"the request needs {needed} KV blocks ({total} tokens) but the whole cache has "
            f"{num_blocks}; lower max_tokens, shorten the prompt or give "
            f"the KV cache more memory", "max_tokens")


def validate_pooling_request(request: Request, max_model_len: int, max_num_batched_tokens: int | None,
                             kv: KVCacheManager) -> None:
    """A pooling input must fit the model's length and the empty cache, and, where it runs in one
    step (an encoder's: ``max_num_batched_tokens`` given), the step's token budget."""
    num_prompt = request.num_prompt_tokens
    if num_prompt == 0:
        raise ValidationError("the input is empty; give at least one token", "input")
    if num_prompt > max_model_len:
        raise ValidationError(
            f"the input has {num_prompt} tokens but this model's maximum length is {max_model_len}; "
            f"shorten it or set truncate_prompt_tokens", "input")
    if max_num_batched_tokens is not None and num_prompt > max_num_batched_tokens:
        raise ValidationError(
            f"the input has {num_prompt} tokens but max_num_batched_tokens is "
            f"{max_num_batched_tokens} (a pooling input runs in one step); shorten it or raise "
            f"max_num_batched_tokens", "input")
    request.max_tokens = 1
    if kv.num_blocks_needed(num_prompt) > kv.num_blocks:
        raise ValidationError(f"the input needs {kv.num_blocks_needed(num_prompt)} KV blocks but "
                              f"the whole cache has {kv.num_blocks}; give the KV cache more memory",
                              "input")


def _max_total_tokens(kv: KVCacheManager, max_model_len: int) -> int:
    """The longest request (prompt + outputs, at most ``max_model_len``) the empty cache holds."""
    if kv.num_groups == 1 and kv.sliding_windows[0] is None:  # the plain paged cache
        return min(max_model_len, kv.num_blocks * kv.block_size + 1)
    lo, hi = 1, max_model_len  # needed(total - 1) grows with total: bisect
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if kv.num_blocks_needed(mid - 1) <= kv.num_blocks:
            lo = mid
        else:
            hi = mid - 1
    return lo
