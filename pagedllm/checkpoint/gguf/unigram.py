"""The Unigram (SentencePiece) tokenizer of an XLM-RoBERTa GGUF file (a ``bert`` file whose
``tokenizer.ggml.model`` is ``t5``: bge-m3, bge-reranker-v2-m3), built with the ``tokenizers``
library as transformers' XLMRobertaTokenizer builds it from the same pieces.

llama.cpp's converter writes the pieces in the model's id order (fairseq's: ``<s> <pad> </s>
<unk>`` first), with their log-probabilities, SentencePiece's normalization table
(``precompiled_charsmap``) and whether a word start gets the ``▁`` prefix.
"""
from __future__ import annotations

from typing import Any

from pagedllm.checkpoint.gguf.reader import GGUFCheckpoint
from pagedllm.errors import ModelLoadError


def _special(ckpt: GGUFCheckpoint, tokens: list[str], name: str) -> str | None:
    token_id = ckpt.get(f"tokenizer.ggml.{name}_token_id")
    return tokens[int(token_id)] if token_id is not None and 0 <= int(token_id) < len(tokens) else None


def unigram_tokenizer(ckpt: GGUFCheckpoint) -> Any:
    """A transformers fast tokenizer: ``<s> A </s>``, a pair ``<s> A </s> </s> B </s>``, one
    token type."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast  # heavy imports, kept off the engine's path

    tokens = [str(t) for t in ckpt.get("tokenizer.ggml.tokens")]
    scores = [float(s) for s in ckpt.get("tokenizer.ggml.scores") or ()]
    bos, eos, unk = (_special(ckpt, tokens, n) for n in ("bos", "eos", "unknown"))
    if len(scores) != len(tokens) or bos is None or eos is None or unk is None:
        raise ModelLoadError(f"{ckpt.path.name}: a Unigram tokenizer needs a score per token and the "
                             "bos, eos and unknown token ids in tokenizer.ggml.*")
    tok = Tokenizer(models.Unigram(list(zip(tokens, scores)), unk_id=tokens.index(unk), byte_fallback=False))
    charsmap = ckpt.get("tokenizer.ggml.precompiled_charsmap")
    if charsmap:
        tok.normalizer = normalizers.Precompiled(bytes(charsmap))
    prepend = "always" if ckpt.get("tokenizer.ggml.add_space_prefix", True) else "never"
    metaspace = {"replacement": "\u2581", "prepend_scheme": prepend}
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(),
                                                 pre_tokenizers.Metaspace(**metaspace)])
    tok.decoder = decoders.Metaspace(**metaspace)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A {eos}", pair=f"{bos} $A {eos} {eos} $B {eos}",
        special_tokens=[(bos, tokens.index(bos)), (eos, tokens.index(eos))])
    context = ckpt.get(f"{ckpt.architecture}.context_length")
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=bos, eos_token=eos, unk_token=unk, cls_token=bos, sep_token=eos,
        pad_token=_special(ckpt, tokens, "padding"), model_max_length=int(context) if context else 512,
        model_input_names=["input_ids", "attention_mask"])
