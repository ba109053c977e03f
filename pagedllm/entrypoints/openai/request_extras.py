"""vLLM's request extras that the server implements on top of the engine's own parameters.

* ``truncate_prompt_tokens`` (keep the last k prompt tokens; -1: as many as the context holds)
  and ``add_special_tokens``: the server tokenizes the prompt itself, then hands the engine ids.
* ``allowed_token_ids`` and ``bad_words``: expressed as ``logit_bias`` entries of -100 (the
  floor of logit_bias), which leaves a banned token a probability below e^-100 relative to
  the best, i.e. never sampled in practice. A bad word is banned in both spellings vLLM bans
  ("word" and " word"); a bad word that tokenizes to more than one token needs the sampler to
  watch the generated suffix, which it does not yet do, so it is a 400 rather than ignored.
* ``prompt_logprobs`` in completion choices, in vLLM's shape (one entry per prompt token, the
  first None, each a map token id -> {logprob, rank, decoded_token}).
"""
from __future__ import annotations

from typing import Any

from pagedllm.errors import ValidationError
from pagedllm.outputs import Logprob

BAN_BIAS = -100.0  # the most negative logit_bias SamplingParams accepts
_MIN_LOGPROB = -9999.0  # JSON has no -inf


def truncate(ids: list[int], truncate_prompt_tokens: int | None, max_model_len: int) -> list[int]:
    if truncate_prompt_tokens is None:
        return ids
    keep = max_model_len if truncate_prompt_tokens == -1 else truncate_prompt_tokens
    return ids[-keep:] if keep < len(ids) else ids


def check_truncate(value: int | None, max_model_len: int) -> None:
    if value is not None and not (value == -1 or 1 <= value <= max_model_len):
        raise ValidationError(f"truncate_prompt_tokens must be -1 or in [1, {max_model_len}] "
                              f"(max_model_len), got {value}", "truncate_prompt_tokens")


def ban_bias(allowed_token_ids: list[int] | None, bad_word_ids: list[int], vocab_size: int,
             logit_bias: dict[Any, float] | None) -> dict[int, float] | None:
    """The request's logit_bias with every token outside ``allowed_token_ids``, and every bad
    word's token, pushed to the floor."""
    if not allowed_token_ids and not bad_word_ids:
        return logit_bias
    bias: dict[int, float] = {}
    for k, v in (logit_bias or {}).items():
        try:
            bias[int(k)] = float(v)
        except (TypeError, ValueError) as e:
            raise ValidationError(f"logit_bias must map token ids to floats, got {k!r}", "logit_bias") from e
    if allowed_token_ids:
        if any(not 0 <= t < vocab_size for t in allowed_token_ids):
            raise ValidationError(f"allowed_token_ids must be in [0, {vocab_size})", "allowed_token_ids")
        allowed = set(allowed_token_ids)
        bias.update({t: BAN_BIAS for t in range(vocab_size) if t not in allowed})
    bias.update({t: BAN_BIAS for t in bad_word_ids})
    return bias


def bad_word_token_ids(tokenizer: Any, words: list[str] | None) -> list[int]:
    """The token of each bad word, as written and after a space (a word's two usual forms)."""
    if not words:
        return []
    if tokenizer is None:
        raise ValidationError("bad_words needs a tokenizer", "bad_words")
    ids: list[int] = []
    for word in words:
        if not isinstance(word, str) or not word.strip():
            raise ValidationError("bad_words must be non-empty strings", "bad_words")
        singles = [tokens[0] for form in (word.strip(), " " + word.strip())
                   if len(tokens := tokenizer(form, add_special_tokens=False).input_ids) == 1]
        if not singles:
            raise ValidationError(
                f"bad word {word!r} is more than one token; only single-token bad words are "
                "supported (the sampler does not match token sequences yet)", "bad_words")
        ids.extend(singles)
    return ids


def prompt_logprobs_json(tokenizer: Any, positions: list[dict[int, Logprob] | None] | None
                         ) -> list[dict[str, dict[str, Any]] | None] | None:
    if positions is None:
        return None
    out: list[dict[str, dict[str, Any]] | None] = []
    for entries in positions:
        if entries is None:
            out.append(None)
            continue
        out.append({str(t): {"logprob": max(e.logprob, _MIN_LOGPROB), "rank": e.rank,
                             "decoded_token": e.decoded_token if e.decoded_token is not None
                             else (tokenizer.decode([t]) if tokenizer is not None else None)}
                    for t, e in entries.items()})
    return out
