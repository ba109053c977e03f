"""Writing GGUF files for the tests: a transformers model's weights under llama.cpp's names
(q/k rows permuted as convert_hf_to_gguf.py does for Llama), in chosen ggml types, with a
sentencepiece-style tokenizer; and raw K-quant blocks built from random codes and scales."""
from __future__ import annotations

import struct
import zlib
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as T

from pagedllm.checkpoint.gguf.quant_types import TYPE_INFO

STORIES = Path(__file__).resolve().parents[3].parent / "shared" / "models" / "stories260K"

_LAYER_NAMES = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}
_GLOBAL_NAMES = {"model.embed_tokens.weight": "token_embd.weight",
                 "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}


def gguf_name(hf_name: str) -> str:
    if hf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, _, attr = rest.rpartition(".")
    return f"blk.{layer}.{_LAYER_NAMES[module]}.{attr}"


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's Llama q/k row order: per head, (2, D/2) -> (D/2, 2)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def sentencepiece_vocab(model_file: Path) -> tuple[list[str], list[float], list[int]]:
    """(pieces, scores, types) of a sentencepiece ModelProto, read with a minimal protobuf walk
    (the sentencepiece package is not installed): field 1 repeats SentencePiece messages of
    piece (1, string), score (2, float32), type (3, enum)."""
    data = model_file.read_bytes()
    pieces, scores, types = [], [], []

    def varint(buf, i):
        shift = value = 0
        while True:
            b = buf[i]
            i += 1
            value |= (b & 0x7F) << shift
            shift += 7
            if b < 0x80:
                return value, i

    i = 0
    while i < len(data):
        key, i = varint(data, i)
        field, wire = key >> 3, key & 7
        if wire == 2:
            length, i = varint(data, i)
            body, i = data[i:i + length], i + length
            if field == 1:
                piece, score, kind, j = "", 0.0, 1, 0
                while j < len(body):
                    k, j = varint(body, j)
                    if k & 7 == 2:
                        n, j = varint(body, j)
                        piece, j = body[j:j + n].decode(), j + n
                    elif k & 7 == 5:
                        score, j = struct.unpack("<f", body[j:j + 4])[0], j + 4
                    else:
                        kind, j = varint(body, j)
                pieces.append(piece)
                scores.append(score)
                types.append(kind)
        elif wire == 0:
            _, i = varint(data, i)
        elif wire == 5:
            i += 4
        elif wire == 1:
            i += 8
    return pieces, scores, types


def random_blocks(type_id: int, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Raw blocks of a ``[rows, cols]`` tensor of ggml type ``type_id``: random codes, scales
    and mins (every bit field random), fp16 super-scales small and finite. ``[rows, bytes]``."""
    rng = np.random.default_rng(seed)
    _, block, size = TYPE_INFO[type_id]
    blocks = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
    fp16_at = {T.Q8_0: [0], T.Q4_0: [0], T.Q4_1: [0, 2], T.Q4_K: [0, 2], T.Q5_K: [0, 2],
               T.Q6_K: [208]}[type_id]
    # K-quant sub-scales reach 63 (Q6_K: 127), codes 31: keep weights around 0.05
    scale = 0.05 / {T.Q4_K: 63 * 15, T.Q5_K: 63 * 31, T.Q6_K: 127 * 32}.get(type_id, 8)
    for at in fp16_at:
        d = rng.uniform(0.5, 1.5, (blocks.shape[0], 1)) * scale
        blocks[:, at:at + 2] = d.astype(np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


def write_gguf(path: Path, hf_model, arch: str, types=None, with_tokenizer: bool = True,
               split: int = 1, extra_tensors: dict | None = None, metadata: dict | None = None) -> Path:
    """Write ``hf_model`` as a GGUF checkpoint (``split`` > 1: that many shards, named as
    gguf-split names them; returns the first). ``types(gguf_name, shape) -> ggml type`` (F32
    by default); K-quant types get random blocks in place of the model's weights."""
    cfg = hf_model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    tensors: list[tuple[str, np.ndarray, int]] = []
    for name, value in hf_model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        w = value.detach().float().numpy()
        g = gguf_name(name)
        if arch == "llama" and (".attn_q." in g or ".attn_k." in g):
            w = permute(w, cfg.num_attention_heads if ".attn_q." in g else cfg.num_key_value_heads)
        tensors.append((g, w, types(g, w.shape) if types else T.F32))
    for g, w in (extra_tensors or {}).items():
        tensors.append((g, w, T.F32))
    shards = [tensors[i::split] for i in range(split)]
    paths = [path if split == 1 else path.with_name(f"{path.stem}-{i + 1:05d}-of-{split:05d}.gguf")
             for i in range(split)]
    for i, (shard_path, shard) in enumerate(zip(paths, shards)):
        writer = gguf.GGUFWriter(shard_path, arch)
        if i == 0:
            _write_metadata(writer, cfg, arch, head_dim, with_tokenizer, metadata or {})
        if split > 1:
            writer.add_uint16("split.no", i)
            writer.add_uint16("split.count", split)
        for g, w, t in shard:
            _add_tensor(writer, g, w, t)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    return paths[0]


def _add_tensor(writer, name: str, w: np.ndarray, t: int) -> None:
    if t == T.F32:
        writer.add_tensor(name, w.astype(np.float32))
    elif t == T.F16:
        writer.add_tensor(name, w.astype(np.float16))
    elif t in (T.Q4_K, T.Q5_K, T.Q6_K):
        writer.add_tensor(name, random_blocks(t, *w.shape, seed=_stable_seed(name)), raw_dtype=t)
    else:
        writer.add_tensor(name, gguf.quants.quantize(w.astype(np.float32), t), raw_dtype=t)


def _stable_seed(name: str) -> int:
    # hash() of a str changes per process (PYTHONHASHSEED), so the codes would change per run.
    return zlib.crc32(name.encode())


def _write_metadata(writer, cfg, arch, head_dim, with_tokenizer, extra) -> None:
    writer.add_name("tiny test model")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    rope = getattr(cfg, "rope_parameters", None) or {}
    writer.add_rope_freq_base(float(rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))))
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    if arch == "llama":
        writer.add_rope_dimension_count(head_dim)
    writer.add_file_type(0)
    for key, value in extra.items():
        writer.add_key_value(key, *value)
    if with_tokenizer:
        pieces, scores, kinds = sentencepiece_vocab(STORIES / "hf" / "tokenizer.model")
        pieces = pieces + [f"<extra_{i}>" for i in range(cfg.vocab_size - len(pieces))]
        scores = scores + [-1000.0] * (cfg.vocab_size - len(scores))
        kinds = kinds + [gguf.TokenType.USER_DEFINED] * (cfg.vocab_size - len(kinds))
        writer.add_tokenizer_model("llama")
        writer.add_token_list(pieces[:cfg.vocab_size])
        writer.add_token_scores(scores[:cfg.vocab_size])
        writer.add_token_types(kinds[:cfg.vocab_size])
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_unk_token_id(0)
        writer.add_chat_template((STORIES / "chat_template.jinja").read_text())
