"""The dense families of issue 31 against transformers on tiny random models (float32): the
logits of a mixed paged batch (``check_mixed_batch``: a full prefill, a chunk over a cached
prefix, decodes) within 1e-4 of transformers' log-probs, and the same greedy ids."""
from __future__ import annotations

import pytest
import torch
from paged_helpers import PagedRunner, randomize_
from test_model_parity import SMALL, check_mixed_batch, save
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3Config,
    Gemma3ForConditionalGeneration,
    Gemma3TextConfig,
    GraniteConfig,
    MinistralConfig,
    MistralConfig,
    Olmo2Config,
    Phi3Config,
    SiglipVisionConfig,
    SmolLM3Config,
)

from pagedllm.checkpoint.loader import load_model
from pagedllm.models.registry import get_model_class

HEAD_DIM = SMALL["hidden_size"] // SMALL["num_attention_heads"]  # 16
WINDOW = 6  # shorter than every test sequence but one: the window really slides


def _longrope(partial: float) -> dict:
    half = int(HEAD_DIM * partial) // 2
    return {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": partial,
            "short_factor": [1.0 + 0.1 * i for i in range(half)],
            "long_factor": [2.0 + 0.5 * i for i in range(half)]}


GEMMA = dict(SMALL, num_key_value_heads=2, head_dim=HEAD_DIM, query_pre_attn_scalar=24,
             sliding_window=WINDOW, final_logit_softcapping=2.0)
GEMMA3 = dict(GEMMA, num_hidden_layers=3, layer_types=["sliding_attention", "full_attention",
                                                       "sliding_attention"],
              rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
                               "full_attention": {"rope_type": "linear", "factor": 4.0,
                                                  "rope_theta": 10000.0}})

# name -> (config, architecture, whether attention windows are needed)
CONFIGS = {
    # Phi-4-mini-like: partial rotary and longrope (within the original context: short factors)
    "phi3_longrope_partial": lambda: (Phi3Config(
        **SMALL, num_key_value_heads=2, tie_word_embeddings=True, pad_token_id=0,
        original_max_position_embeddings=32,
        rope_parameters=_longrope(0.75)), "Phi3ForCausalLM"),
    "phi3_window": lambda: (Phi3Config(**SMALL, num_key_value_heads=4, sliding_window=WINDOW,
                                       pad_token_id=0,
                                       tie_word_embeddings=False), "Phi3ForCausalLM"),
    "granite": lambda: (GraniteConfig(
        **SMALL, num_key_value_heads=2, embedding_multiplier=3.0, residual_multiplier=0.5,
        attention_multiplier=0.3, logits_scaling=2.5, tie_word_embeddings=False), "GraniteForCausalLM"),
    "olmo2": lambda: (Olmo2Config(**SMALL, num_key_value_heads=2, tie_word_embeddings=False),
                      "Olmo2ForCausalLM"),
    # one KV head: at tensor_parallel 2 both ranks hold it (its k norm must count it once)
    "olmo2_one_kv_head": lambda: (Olmo2Config(**SMALL, num_key_value_heads=1,
                                              tie_word_embeddings=False), "Olmo2ForCausalLM"),
    "smollm3_nope": lambda: (SmolLM3Config(**dict(SMALL, num_hidden_layers=3), num_key_value_heads=2,
                                           pad_token_id=0,
                                           no_rope_layers=[1, 0, 1], tie_word_embeddings=True),
                             "SmolLM3ForCausalLM"),
    "gemma2": lambda: (Gemma2Config(**GEMMA, attn_logit_softcapping=1.5), "Gemma2ForCausalLM"),
    "gemma3_text": lambda: (Gemma3TextConfig(**GEMMA3), "Gemma3ForCausalLM"),
    "mistral_window": lambda: (MistralConfig(**SMALL, num_key_value_heads=2, sliding_window=WINDOW,
                                             tie_word_embeddings=False), "MistralForCausalLM"),
    "ministral_mixed_windows": lambda: (MinistralConfig(
        **SMALL, num_key_value_heads=2, head_dim=HEAD_DIM, sliding_window=WINDOW,
        tie_word_embeddings=False, layer_types=["sliding_attention", "full_attention"]), "MinistralForCausalLM"),
}


def make_model(config, architecture: str, seed: int = 0):
    torch.manual_seed(seed)
    config.architectures = [architecture]
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                             attn_implementation="eager").eval()
    randomize_(model, seed)
    return model


def _greedy_ids_match(model, hf_model) -> None:
    """Greedy ids of one prompt, decoded step by step through the paged cache."""
    runner = PagedRunner(model, block_size=4, seed=5)
    ids = torch.randint(0, 96, (9,), generator=torch.Generator().manual_seed(4)).tolist()
    hf_ids, ours = list(ids), list(ids)
    out = runner.step([("R", ours)])["R"]
    for _ in range(6):
        ours.append(int(out[-1].argmax()))
        out = runner.step([("R", ours[-1:])])["R"]
    with torch.no_grad():
        for _ in range(6):
            hf_ids.append(int(hf_model(input_ids=torch.tensor([hf_ids])).logits[0, -1].argmax()))
    assert ours == hf_ids


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_family_matches_transformers(name, tmp_path):
    config, architecture = CONFIGS[name]()
    hf_model = make_model(config, architecture)
    model, saved = load_model(save(hf_model, tmp_path), torch.float32, torch.device("cpu"))
    assert type(model) is get_model_class(saved)
    check_mixed_batch(model, hf_model, PagedRunner(model, block_size=4))
    _greedy_ids_match(model, hf_model)


def test_layer_specs_follow_the_config(tmp_path):
    gemma3, _ = load_model(save(make_model(Gemma3TextConfig(**GEMMA3), "Gemma3ForCausalLM"), tmp_path),
                           torch.float32, torch.device("cpu"))
    attns = [layer.self_attn.attn for layer in gemma3.model.layers]
    assert [a.sliding_window for a in attns] == [WINDOW, None, WINDOW]
    assert [a.scale for a in attns] == [24 ** -0.5] * 3
    thetas = [gemma3.model.rotary_embs[i].rope.theta for i in gemma3.model._layer_rope]
    assert thetas == [10.0, 10000.0, 10.0]
    smol = get_model_class({"architectures": ["SmolLM3ForCausalLM"]})
    args = smol.args_from_hf(SmolLM3Config(**dict(SMALL, num_hidden_layers=8)).to_dict())
    assert [spec.rope is not None for spec in args.layers] == [True, True, True, False] * 2


def test_gemma3_multimodal_checkpoint_loads_its_language_model(tmp_path, caplog):
    # transformers' multimodal class never soft-caps its logits (real Gemma 3 configs set no cap)
    text = Gemma3TextConfig(**dict(GEMMA3, final_logit_softcapping=None))
    vision = SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                num_attention_heads=2, image_size=28, patch_size=14)
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4)
    config.architectures = ["Gemma3ForConditionalGeneration"]
    torch.manual_seed(0)
    hf_model = Gemma3ForConditionalGeneration(config).eval()
    randomize_(hf_model, 0)
    model, _ = load_model(save(hf_model, tmp_path), torch.float32, torch.device("cpu"))
    assert not any("vision" in name for name, _ in model.named_parameters())
    assert "ignoring" not in caplog.text  # the vision tower is skipped knowingly, not warned about
    check_mixed_batch(model, hf_model, PagedRunner(model, block_size=4))


def test_phi3_fused_checkpoint_splits_over_ranks(tmp_path, monkeypatch):
    """Under a 2-way split each rank loads its own q/k/v (and gate/up) rows out of the fused
    checkpoint tensors, through the real loader."""
    from safetensors.torch import save_file

    import pagedllm.layers.linear as linear_mod
    from pagedllm.checkpoint.weights import load_weights
    from pagedllm.models.decoder_args import DecoderArgs
    from pagedllm.models.phi3 import Phi3Attention, Phi3MLP

    config, _ = CONFIGS["phi3_window"]()
    hf_model = make_model(config, "Phi3ForCausalLM")
    hf_attn, hf_mlp = hf_model.model.layers[0].self_attn, hf_model.model.layers[0].mlp
    tensors = {"self_attn.qkv_proj.weight": hf_attn.qkv_proj.weight,
               "self_attn.o_proj.weight": hf_attn.o_proj.weight,
               "mlp.gate_up_proj.weight": hf_mlp.gate_up_proj.weight,
               "mlp.down_proj.weight": hf_mlp.down_proj.weight}
    save_file({k: v.detach().contiguous() for k, v in tensors.items()}, str(tmp_path / "w.safetensors"))
    args = DecoderArgs.from_hf(hf_model.config.to_dict())
    fused_qkv, fused_gate_up = tensors["self_attn.qkv_proj.weight"], tensors["mlp.gate_up_proj.weight"]
    size, inter = SMALL["hidden_size"], SMALL["intermediate_size"]  # q, k, v: 64 rows each here
    for rank in range(2):
        group = type("Group", (), {"world_size": 2, "rank": rank})()
        monkeypatch.setattr(linear_mod, "get_tp_group", lambda: group)
        layer = torch.nn.Module()
        layer.self_attn, layer.mlp = Phi3Attention(args, 0), Phi3MLP(args)
        load_weights(layer, [tmp_path / "w.safetensors"])
        half, half_i = size // 2, inter // 2
        mine = [fused_qkv[part * size + rank * half:part * size + (rank + 1) * half] for part in range(3)]
        assert torch.equal(layer.self_attn.qkv_proj.weight, torch.cat(mine))
        mine = [fused_gate_up[part * inter + rank * half_i:part * inter + (rank + 1) * half_i]
                for part in range(2)]
        assert torch.equal(layer.mlp.gate_up_proj.weight, torch.cat(mine))


TP_FAMILIES = ("gemma2", "gemma3_text", "granite", "olmo2", "olmo2_one_kv_head",
               "phi3_longrope_partial", "phi3_window", "smollm3_nope")
TP_TOKENS = [1, 5, 95, 0, 17, 48, 2, 18, 9, 60, 33]


def _tp_logits(folder: str) -> torch.Tensor:
    model, _ = load_model(folder, torch.float32, torch.device("cpu"))
    with torch.inference_mode():
        return model.compute_logits(model(torch.tensor(TP_TOKENS), torch.arange(len(TP_TOKENS))))


def _tp_rank(rank: int, port: int, folders: list[str], queue) -> None:
    from pagedllm.distributed.launch import DistributedInit
    from pagedllm.distributed.parallel_state import destroy_distributed, init_distributed

    torch.set_num_threads(1)
    init_distributed(DistributedInit(rank, 2, "127.0.0.1", port, "cpu", rank, 2, timeout_s=120))
    queue.put((rank, [_tp_logits(f).tolist() for f in folders]))  # lists: no shared memory
    destroy_distributed()


@pytest.mark.slow  # two spawned ranks import torch and transformers, then load eight models
def test_two_ranks_compute_the_unsharded_logits(tmp_path):
    """Phi-3's fused tensors split per rank, Gemma's per-head norms and soft caps, Granite's
    multipliers, OLMo 2's whole-projection q/k norms (sums of squares all-reduced; a replicated
    KV head counted once) and SmolLM3's NoPE layers all give the unsharded logits at
    tensor_parallel 2."""
    from rank_processes import run_on_ranks

    folders = []
    for name in TP_FAMILIES:
        config, architecture = CONFIGS[name]()
        folders.append(save(make_model(config, architecture), tmp_path / name))
    want = [_tp_logits(f) for f in folders]
    results = run_on_ranks(_tp_rank, (folders,), timeout=300)
    for rank in (0, 1):
        for name, got, ref in zip(TP_FAMILIES, results[rank], want):
            torch.testing.assert_close(torch.tensor(got), ref, rtol=1e-5, atol=1e-5, msg=name)
