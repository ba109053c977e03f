"""The WordPiece tokenizer of a ``bert`` / ``nomic-bert`` GGUF file (``tokenizer.ggml.model``
``bert``), built with the ``tokenizers`` library: transformers has no GGUF converter for it.

llama.cpp's converter writes the vocabulary in "phantom space" form: a token that starts a word
gets a ``▁`` prefix, a continuation (``##ing``) loses its ``##``, and control tokens ([CLS],
[SEP], ...) stay as they are. Undoing that gives BERT's vocab.txt back, id for id.
"""
from __future__ import annotations

from typing import Any

from pagedllm.checkpoint.gguf.reader import GGUFCheckpoint
from pagedllm.errors import ModelLoadError

_WORD_START = "\u2581"
_CONTROL = 3  # llama.cpp's token type of [CLS], [SEP], [PAD], [UNK], [MASK]


def wordpiece_vocab(tokens: list[str], token_types: list[int]) -> dict[str, int]:
    """BERT's vocabulary (token -> id) from the file's phantom-space tokens."""
    vocab: dict[str, int] = {}
    for i, (token, kind) in enumerate(zip(tokens, token_types)):
        if kind == _CONTROL:
            vocab[token] = i
        elif token.startswith(_WORD_START):
            vocab[token[len(_WORD_START):]] = i
        else:
            vocab["##" + token] = i
    return vocab


def _special(ckpt: GGUFCheckpoint, tokens: list[str], name: str) -> str | None:
    token_id = ckpt.get(f"tokenizer.ggml.{name}_token_id")
    return tokens[int(token_id)] if token_id is not None and 0 <= int(token_id) < len(tokens) else None


def wordpiece_tokenizer(ckpt: GGUFCheckpoint) -> Any:
    """A transformers fast tokenizer that tokenizes as BertTokenizerFast on the original folder:
    BERT's normalizer (lower case as the file says), pre-tokenizer and WordPiece, then
    ``[CLS] A [SEP]`` (a pair: ``[CLS] A [SEP] B [SEP]``, B with token type 1)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast  # heavy imports, kept off the engine's path

    tokens = [str(t) for t in ckpt.get("tokenizer.ggml.tokens")]
    types = [int(t) for t in ckpt.get("tokenizer.ggml.token_type") or [1] * len(tokens)]
    vocab = wordpiece_vocab(tokens, types)
    # llama.cpp names [CLS] its bos and [SEP] its eos (or seperator, the gguf package's spelling)
    cls, sep = _special(ckpt, tokens, "bos"), _special(ckpt, tokens, "seperator") or _special(ckpt, tokens, "eos")
    unk = _special(ckpt, tokens, "unknown")
    if cls is None or sep is None or unk is None:
        raise ModelLoadError(f"{ckpt.path.name}: a WordPiece tokenizer needs the bos ([CLS]), eos or "
                             "seperator ([SEP]) and unknown token ids in tokenizer.ggml.*")
    lowercase = bool(ckpt.get("tokenizer.ggml.normalizer.lowercase", True))
    tok = Tokenizer(models.WordPiece(vocab, unk_token=unk, continuing_subword_prefix="##",
                                     max_input_chars_per_word=100))
    tok.normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True,
                                                strip_accents=None, lowercase=lowercase)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single=f"{cls}:0 $A:0 {sep}:0", pair=f"{cls}:0 $A:0 {sep}:0 $B:1 {sep}:1",
        special_tokens=[(cls, vocab[cls]), (sep, vocab[sep])])
    tok.decoder = decoders.WordPiece(prefix="##")
    context = ckpt.get(f"{ckpt.architecture}.context_length")
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token=unk, cls_token=cls, sep_token=sep,
        pad_token=_special(ckpt, tokens, "padding"), mask_token=_special(ckpt, tokens, "mask"),
        model_max_length=int(context) if context else 512,
        model_input_names=["input_ids", "token_type_ids", "attention_mask"])  # a pair's segments
