"""Detokenizing through the Rust tokenizer gives transformers' text: the incremental
detokenizer run with the backend's decode and with transformers' decode, over random ids."""
from __future__ import annotations

import random
from pathlib import Path

import pytest

from pagedllm.engine.detokenizer import IncrementalDetokenizer
from pagedllm.engine.token_decode import decode_function

MODELS = Path(__file__).resolve().parents[2].parent / "shared" / "models"
FOLDERS = [MODELS / "stories260K" / "hf", MODELS / "synthetic-tokenizer-32k"]


@pytest.fixture(scope="module", params=FOLDERS, ids=lambda p: p.parent.name if p.name == "hf" else p.name)
def tokenizer(request):
    if not (request.param / "tokenizer.json").is_file():
        pytest.skip(f"no tokenizer at {request.param}")
    from pagedllm.engine.tokenizer import load_tokenizer

    return load_tokenizer(request.param)


def _run(tokenizer, decode, prompt, output, **kw) -> list[tuple[str, str | None]]:
    """The text and stop string after each token, as the output processor sees them."""
    detok = IncrementalDetokenizer(tokenizer, prompt, decode=decode, **kw)
    seen = []
    for tok in output:
        stop = detok.update([tok])
        seen.append((detok.output_text, stop))
        if stop is not None:
            break
    return seen


def test_a_fast_tokenizer_decodes_through_its_backend(tokenizer):
    assert decode_function(tokenizer) == tokenizer.backend_tokenizer.decode


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_random_ids_give_transformers_text(tokenizer, skip_special_tokens):
    rng = random.Random(len(tokenizer))
    vocab = len(tokenizer)
    fast = decode_function(tokenizer)
    # Byte tokens (multi-byte characters split across tokens) and special ids mixed in on purpose.
    pool = list(range(min(vocab, 300))) + list(tokenizer.all_special_ids)
    for trial in range(40):
        draw = (lambda: rng.choice(pool)) if trial % 2 else (lambda: rng.randrange(vocab))
        prompt = [draw() for _ in range(rng.randint(1, 8))]
        output = [draw() for _ in range(rng.randint(1, 24))]
        text = tokenizer.decode(output[2:5], skip_special_tokens=skip_special_tokens)
        stop = [text[: rng.randint(1, 3)]] if text.strip() and trial % 3 == 0 else None
        kw = dict(skip_special_tokens=skip_special_tokens, stop=stop, include_stop_str_in_output=trial % 2 == 0)
        want = _run(tokenizer, tokenizer.decode, prompt, output, **kw)
        assert _run(tokenizer, fast, prompt, output, **kw) == want
        for tok in output[:4]:  # a logprob's token text
            assert fast([tok], skip_special_tokens=False) == tokenizer.decode([tok])


def test_the_clean_up_pass_keeps_transformers_decode(tokenizer, monkeypatch):
    monkeypatch.setattr(tokenizer, "clean_up_tokenization_spaces", True)
    monkeypatch.setattr(tokenizer, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output",
                        True, raising=False)
    assert decode_function(tokenizer) == tokenizer.decode


def test_a_tokenizer_without_a_backend_keeps_its_decode():
    class Slow:
        def decode(self, ids, skip_special_tokens=False):
            return "".join(chr(97 + i % 26) for i in ids)

    slow = Slow()
    assert decode_function(slow) == slow.decode
    assert _run(slow, None, [1, 2], [3, 4]) == [("d", None), ("de", None)]
