"""GGUF files without llama.cpp: a transformers Llama folder written with the ``gguf`` package.

benchmarks/gguf.py makes its files with llama.cpp's converter and quantizer when
benchmarks/setup_llama_cpp.sh has installed them; without them it still measures pagedllm, on a
file written here: llama.cpp's tensor names, q/k rows permuted as convert_hf_to_gguf.py does for
Llama, norms in F32 and every matrix in one type quantized by ``gguf.quants.quantize`` (the
reference quantizer of Q8_0 and Q4_0; the package makes no K-quants, so Q4_K_M needs llama.cpp).
The file carries no tokenizer: the benchmark passes its tokenizer folder to pagedllm.
"""
from __future__ import annotations

import json
from pathlib import Path

WRITABLE_TYPES = ("Q8_0", "Q4_0")
_LAYER_NAMES = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_GLOBAL_NAMES = {"model.embed_tokens.weight": "token_embd.weight",
                 "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
_FILE_TYPES = {"F32": 0, "Q4_0": 2, "Q8_0": 7}  # llama.cpp's llama_ftype values


def gguf_name(hf_name: str) -> str:
    if hf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)  # model.layers.N.<module>.weight
    module, _, attr = rest.rpartition(".")
    if module not in _LAYER_NAMES:
        raise SystemExit(f"{hf_name}: only dense Llama layers are written without llama.cpp "
                         "(run bash benchmarks/setup_llama_cpp.sh for this shape)")
    return f"blk.{layer}.{_LAYER_NAMES[module]}.{attr}"


def _permute(w, n_head: int):
    # convert_hf_to_gguf.py's Llama q/k row order: per head, (2, D/2) -> (D/2, 2).
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(hf_folder: Path, path: Path, type_name: str) -> None:
    """Write the float32 Llama checkpoint in ``hf_folder`` to ``path`` with every matrix in
    ``type_name`` (one of WRITABLE_TYPES)."""
    import gguf
    import numpy as np
    from safetensors.numpy import load_file

    if type_name not in WRITABLE_TYPES:
        raise SystemExit(f"{type_name} needs llama.cpp's quantizer (the gguf package writes "
                         f"{', '.join(WRITABLE_TYPES)} only): run bash benchmarks/setup_llama_cpp.sh "
                         f"or pass --type {' '.join(WRITABLE_TYPES)}")
    cfg = json.loads((hf_folder / "config.json").read_text())
    qtype = getattr(gguf.GGMLQuantizationType, type_name)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name(f"random {hf_folder.name}")
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    rope = cfg.get("rope_parameters") or {}
    writer.add_rope_freq_base(float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))))
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_file_type(_FILE_TYPES[type_name])
    writer.add_bos_token_id(cfg["bos_token_id"])
    writer.add_eos_token_id(cfg["eos_token_id"])
    tensors = {}
    for shard in sorted(hf_folder.glob("*.safetensors")):
        tensors.update(load_file(str(shard)))
    for name, w in tensors.items():
        if name == "lm_head.weight" and cfg.get("tie_word_embeddings"):
            continue
        g = gguf_name(name)
        w = w.astype(np.float32)
        if ".attn_q." in g or ".attn_k." in g:
            w = _permute(w, cfg["num_attention_heads"] if ".attn_q." in g else cfg["num_key_value_heads"])
        if w.ndim == 2:
            writer.add_tensor(g, gguf.quants.quantize(w, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(g, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
