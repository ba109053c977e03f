"""GGUF checkpoints: block unpacking bit-exact against the gguf package, the config, tokenizer
and weights of tiny random models written as GGUF against transformers loading the same file,
split files, the demo model as Q8_0, and clear errors for bad files."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf_helpers import STORIES, permute, random_blocks, write_gguf
from paged_helpers import PagedRunner, hf_log_probs, randomize_
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

from pagedllm.checkpoint.gguf import read_gguf_config
from pagedllm.checkpoint.gguf.names import unpermute_rows
from pagedllm.checkpoint.gguf.quant_types import unpack
from pagedllm.checkpoint.loader import load_model
from pagedllm.errors import ModelLoadError, UnsupportedModelError
from pagedllm.layers.weight_format import Quantized

TOL = 1e-4
CPU = torch.device("cpu")
# K-quant rows are super-blocks of 256: every matrix dimension here is a multiple of it.
SMALL = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


# -- block types -------------------------------------------------------------------------------
def _encoded(type_id: int, rows: int, cols: int) -> np.ndarray:
    if type_id in (T.Q4_K, T.Q5_K, T.Q6_K):  # gguf cannot quantize these: random raw blocks
        return random_blocks(type_id, rows, cols, seed=type_id)
    w = np.random.default_rng(type_id).normal(0, 1, (rows, cols)).astype(np.float32)
    if type_id == T.F32:
        return w
    if type_id == T.F16:
        return w.astype(np.float16)
    return gguf.quants.quantize(w, type_id)


@pytest.mark.parametrize("type_id", [T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0,
                                     T.Q5_1, T.Q4_K, T.Q5_K, T.Q6_K], ids=lambda t: t.name)
def test_unpack_is_bit_exact(type_id):
    rows, cols = 5, 768
    data = _encoded(type_id, rows, cols)
    ours = unpack(int(type_id), data, (rows, cols))
    ref = gguf.quants.dequantize(data, type_id)
    if isinstance(ours, np.ndarray):
        np.testing.assert_array_equal(ours.astype(np.float32), ref)
        return
    kind, group, low, high = {T.Q8_0: ("q8", 32, -128, 127), T.Q4_0: ("q4", 32, 0, 15),
                              T.Q4_1: ("q4", 32, 0, 15), T.Q4_K: ("q4", 32, 0, 15),
                              T.Q5_0: ("q5", 32, -16, 15), T.Q5_1: ("q8", 32, 0, 31),
                              T.Q5_K: ("q8", 32, 0, 31), T.Q6_K: ("q6", 16, -32, 31)}[type_id]
    assert (ours.kind, ours.group_size, ours.scales.values().shape) == (kind, group,
                                                                        (rows, cols // group))
    # the K-quants' floats as the file holds them: an fp16 d per 256 and a multiplier per group
    k_quant = type_id in (T.Q4_K, T.Q5_K, T.Q6_K)
    assert ours.scales.per_super == (256 // group if k_quant else 1)
    assert ours.scales.d.dtype == np.float16
    assert low <= ours.codes.min() and ours.codes.max() <= high
    assert ours.codes.dtype == (np.uint8 if kind == "q4" else np.int8)  # q5: int8 -16..15
    np.testing.assert_array_equal(ours.dequantize(), ref)  # bit for bit


def test_unpermute_inverts_the_converter():
    w = np.arange(4 * 16 * 3, dtype=np.float32).reshape(4 * 16, 3)
    np.testing.assert_array_equal(permute(w, 4)[unpermute_rows(64, 4)], w)
    assert not np.array_equal(permute(w, 4), w)


# -- tiny models against transformers ------------------------------------------------------------
def _hf_model(arch: str, **overrides):
    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}[arch]
    config = cls(**{**SMALL, "tie_word_embeddings": False, **overrides})
    config.architectures = [cls.__name__.replace("Config", "ForCausalLM")]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                             attn_implementation="eager").eval()
    randomize_(model)
    return model


def _reference(hf_model, path):
    """transformers' own GGUF loading of ``path`` (dequantized to float32) into a model of the
    same config: the reference for the file's values."""
    ref = AutoModelForCausalLM.from_config(hf_model.config, dtype=torch.float32,
                                           attn_implementation="eager").eval()
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=ref)["tensors"]
    missing, unexpected = ref.load_state_dict(tensors, strict=False)
    assert not unexpected and all("lm_head" in m for m in missing), (missing, unexpected)
    if hf_model.config.tie_word_embeddings:
        ref.tie_weights()
    return ref


def _check_greedy_and_logprobs(model, ref) -> None:
    """Greedy decoding through the paged KV cache (prefill, then one token per step) gives
    transformers' greedy ids, and every position's log-probs agree within TOL."""
    prompt = torch.randint(0, 512, (12,), generator=torch.Generator().manual_seed(3)).tolist()
    runner = PagedRunner(model, block_size=4)
    ours = [runner.step([("A", prompt)])["A"]]
    ids = list(prompt)
    for _ in range(8):
        ids.append(int(ours[-1][-1].argmax()))
        ours.append(runner.step([("A", ids[-1:])])["A"])
    ref_lp = hf_log_probs(ref, ids)
    ours_lp = torch.cat(ours)[:len(ids)]
    assert ref_lp[len(prompt) - 1:-1].argmax(-1).tolist() == ids[len(prompt):]
    diff = (ours_lp - ref_lp).abs().max().item()
    assert diff < TOL, f"max log-prob diff {diff:.2e}"


def _types(spec: str):
    def pick(name: str, shape: tuple) -> int:
        if len(shape) == 1:
            return T.F32  # norms and biases: float, as llama.cpp writes them
        if spec == "f16":
            return T.F16
        if spec == "q8_0":
            return T.Q8_0
        if spec == "q4_0_q4_1":
            # and the 5-bit types llama.cpp's k-quant mixes fall back to on rows that are
            # not whole 256-blocks (Qwen2.5-0.5B's 896)
            if "attn_k" in name or "attn_v" in name:
                return T.Q5_0 if "attn_k" in name else T.Q5_1
            return T.Q4_1 if "ffn" in name else T.Q4_0
        # Q4_K_M-like: Q4_K, with Q6_K for attn_v, ffn_down and the head, Q5_K for attn_k
        # (fused q/k/v then holds three formats), the embedding Q8_0
        if "attn_v" in name or "ffn_down" in name or name == "output.weight":
            return T.Q6_K
        if "attn_k" in name:
            return T.Q5_K
        return T.Q8_0 if name == "token_embd.weight" else T.Q4_K
    return None if spec == "f32" else pick


TIED = {"tie_word_embeddings": True}
CASES = [("llama", "f32", {}), ("llama", "f16", TIED), ("llama", "q8_0", {}),
         ("llama", "k_quants", {}), ("qwen2", "q4_0_q4_1", {}), ("qwen2", "q4_0_q4_1", TIED),
         ("qwen3", "k_quants", {"head_dim": 64}), ("qwen3", "q8_0", {"head_dim": 64, **TIED})]


@pytest.mark.parametrize("arch,spec,overrides", CASES,
                         ids=[f"{a}-{s}{'-tied' if o.get('tie_word_embeddings') else ''}"
                              for a, s, o in CASES])
def test_gguf_matches_transformers(arch, spec, overrides, tmp_path):
    hf_model = _hf_model(arch, **overrides)
    path = write_gguf(tmp_path / "model.gguf", hf_model, arch, _types(spec))
    model, config = load_model(str(path), torch.float32, CPU)
    assert config["architectures"] == hf_model.config.architectures
    assert config["tie_word_embeddings"] == hf_model.config.tie_word_embeddings
    _check_greedy_and_logprobs(model, _reference(hf_model, path))
    linears = [m for name, m in model.named_modules() if name.endswith(("_proj", "lm_head"))]
    if spec in ("f32", "f16"):
        assert all(not isinstance(m.weight_format, Quantized) for m in linears)
    else:  # every linear holds its quantized weight only
        assert linears and all(isinstance(m.weight_format, Quantized) and m.weight is None
                               for m in linears)
    if spec == "k_quants":  # Q4_K and Q6_K held at the file's size (panels of 64 rows aside)
        for m in linears:
            qw, k = m.weight_format.qweight, m.weight_format.qweight.in_features
            rows = -(-qw.out_features // 64) * 64
            records = 2 * k // 256 + k // qw.group_size  # fp16 d per 256, int8 per group
            per_row = {"q4": k // 2 + 2 * records, "q6": k * 3 // 4 + records}.get(qw.format)
            if per_row is not None:  # the fused qkv mixes three types: held as q8
                assert qw.nbytes == rows * per_row, (qw.format, qw.out_features, k)
        assert {m.weight_format.qweight.format for m in linears} >= {"q4", "q6"}
    if spec not in ("f32", "f16") and hf_model.config.tie_word_embeddings:
        # one copy of the tied matrix, in the file's format: the embedding reads the head's
        embedding = model.decoder.embed_tokens
        assert embedding.weight is None and embedding.weight_format is model.lm_head.weight_format


def test_split_file_loads_like_one(tmp_path):
    hf_model = _hf_model("llama")
    (tmp_path / "one").mkdir()
    one = write_gguf(tmp_path / "one" / "m.gguf", hf_model, "llama", _types("q8_0"))
    first = write_gguf(tmp_path / "m.gguf", hf_model, "llama", _types("q8_0"), split=3)
    assert first.name == "m-00001-of-00003.gguf"
    ids = list(range(3, 40))
    logits = []
    for path in (one, first, first.with_name("m-00002-of-00003.gguf")):  # any shard names them all
        model, _ = load_model(str(path), torch.float32, CPU)
        logits.append(PagedRunner(model, block_size=4).step([("A", ids)])["A"])
    assert torch.equal(logits[0], logits[1]) and torch.equal(logits[0], logits[2])
    first.with_name("m-00003-of-00003.gguf").unlink()
    with pytest.raises(ModelLoadError, match="m-00003-of-00003.gguf is missing"):
        load_model(str(first), torch.float32, CPU)


def test_config_from_metadata(tmp_path):
    hf_model = _hf_model("qwen2", num_hidden_layers=1, tie_word_embeddings=True, rms_norm_eps=1e-5)
    uint32, string = gguf.GGUFValueType.UINT32, gguf.GGUFValueType.STRING
    meta = {"tokenizer.ggml.eos_token_id": (2, uint32), "tokenizer.ggml.eot_token_id": (7, uint32),
            "tokenizer.ggml.bos_token_id": (1, uint32), "qwen2.rope.scaling.type": ("linear", string),
            "qwen2.rope.scaling.factor": (4.0, gguf.GGUFValueType.FLOAT32)}
    path = write_gguf(tmp_path / "m.gguf", hf_model, "qwen2", with_tokenizer=False, metadata=meta)
    config = read_gguf_config(path)
    assert config == {**config, "architectures": ["Qwen2ForCausalLM"], "vocab_size": 512,
                      "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 1,
                      "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
                      "max_position_embeddings": 256, "tie_word_embeddings": True,
                      "bos_token_id": 1, "eos_token_id": [2, 7],
                      "rope_scaling": {"rope_type": "linear", "factor": 4.0}}
    assert config["rms_norm_eps"] == pytest.approx(1e-5)
    assert config["rope_theta"] == hf_model.config.rope_parameters["rope_theta"]
    from pagedllm.engine.model_info import ModelInfo

    info = ModelInfo.from_folder(path)
    assert (info.vocab_size, info.max_position_embeddings, info.eos_token_ids, info.bos_token_id) == (
        512, 256, frozenset({2, 7}), 1)
    meta["qwen2.rope.scaling.type"] = ("yarn", string)
    path = write_gguf(tmp_path / "yarn.gguf", hf_model, "qwen2", with_tokenizer=False, metadata=meta)
    with pytest.raises(UnsupportedModelError,
                       match="rope scaling 'yarn' is not supported; supported: none, linear"):
        read_gguf_config(path)


@pytest.mark.slow
@pytest.mark.skipif(not (STORIES / "hf").is_dir(), reason="demo model not found")
def test_demo_model_q8_0_under_tensor_parallelism(tmp_path):
    """Two ranks (worker processes): each holds its rows of the column-parallel layers and its
    input groups of the row-parallel ones, still quantized."""
    from pagedllm import LLM, SamplingParams

    cases = json.loads((STORIES / "golden_greedy.json").read_text())["cases"]
    llm = LLM(str(_stories_q8_0(tmp_path)), tensor_parallel_size=2,
              distributed_executor_backend="mp", max_num_seqs=8, quantization_activations="float32")
    outputs = llm.generate([{"prompt_token_ids": c["prompt_ids"]} for c in cases],
                           [SamplingParams(temperature=0.0, max_tokens=c["max_new_tokens"],
                                           ignore_eos=True) for c in cases])
    assert [list(o.outputs[0].token_ids) for o in outputs] == [c["greedy_ids"] for c in cases]


LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def test_llama3_rope_from_rope_freqs(tmp_path):
    """Llama 3.1+ files carry llama3 rope scaling as the ``rope_freqs`` tensor alone."""
    hf_model = _hf_model("llama", rope_parameters=LLAMA3_ROPE, max_position_embeddings=256)
    head_dim = SMALL["hidden_size"] // SMALL["num_attention_heads"]
    # llama.cpp's converter: the divisor of each frequency (1 short, factor long, smooth between)
    inv_freq = 1.0 / 10000.0 ** (np.arange(0, head_dim, 2) / head_dim)
    wavelen = 2 * np.pi / inv_freq
    smooth = (8192 / wavelen - 1.0) / (4.0 - 1.0)
    factors = np.where(wavelen < 8192 / 4, 1.0, np.where(wavelen > 8192, 8.0,
                                                         1 / ((1 - smooth) / 8.0 + smooth)))
    path = write_gguf(tmp_path / "m.gguf", hf_model, "llama",
                      extra_tensors={"rope_freqs.weight": factors.astype(np.float32)})
    config = read_gguf_config(path)
    assert config["rope_scaling"] == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    model, _ = load_model(str(path), torch.float32, CPU)
    # A head_dim of 64 at theta 1e4 puts frequencies in all three llama3 bands.
    assert (factors == 1).any() and (factors == 8).any() and ((factors > 1) & (factors < 8)).any()
    _check_greedy_and_logprobs(model, hf_model)


# -- the engine: tokenizer, config, the demo model ---------------------------------------------
def _stories_q8_0(tmp_path):
    hf_model = AutoModelForCausalLM.from_pretrained(STORIES / "hf", dtype=torch.float32).eval()
    # Q8_0 where rows are whole blocks of 32 (llama.cpp falls back to float for the others:
    # ffn_down's 172 inputs)
    return write_gguf(tmp_path / "stories260K-Q8_0.gguf", hf_model, "llama",
                      lambda name, shape: T.Q8_0 if len(shape) == 2 and shape[1] % 32 == 0 else T.F32)


@pytest.mark.skipif(not (STORIES / "hf").is_dir(), reason="demo model not found")
def test_demo_model_as_q8_0_gives_the_golden_stories(tmp_path):
    from pagedllm import LLM, SamplingParams

    path = _stories_q8_0(tmp_path)
    cases = json.loads((STORIES / "golden_greedy.json").read_text())["cases"]
    # float32 activations: the exact path, which tells the float model's stories
    llm = LLM(str(path), max_num_seqs=8, max_model_len=512, quantization_activations="float32")
    assert llm.llm_engine.model_info.eos_token_ids == frozenset({2})
    prompts = [{"prompt_token_ids": case["prompt_ids"]} for case in cases]
    params = [SamplingParams(temperature=0.0, max_tokens=c["max_new_tokens"], ignore_eos=True)
              for c in cases]
    outputs = llm.generate(prompts, params)
    for case, out in zip(cases, outputs):
        assert list(out.outputs[0].token_ids) == case["greedy_ids"], case["prompt"]
    # the file's tokenizer encodes as the folder's does (BOS added), and carries the template
    from transformers import AutoTokenizer

    folder_tok = AutoTokenizer.from_pretrained(STORIES / "hf")
    tok = llm.get_tokenizer()
    for case in cases:
        assert tok(case["prompt"]).input_ids == folder_tok(case["prompt"]).input_ids == case["prompt_ids"]
    assert tok.chat_template == (STORIES / "chat_template.jinja").read_text()
    text = llm.generate(["Once upon a time"], SamplingParams(temperature=0.0, max_tokens=8))[0]
    assert text.outputs[0].text == folder_tok.decode(cases[1]["greedy_ids"][:8])


@pytest.mark.skipif(not (STORIES / "hf").is_dir(), reason="demo model not found")
def test_gguf_runs_int8_activations_by_default(tmp_path):
    """quantization_activations=auto: a GGUF file's block layers take llama.cpp's int8
    activations, and the confident start of a golden story stays the same."""
    from pagedllm import LLM, SamplingParams

    case = json.loads((STORIES / "golden_greedy.json").read_text())["cases"][1]
    llm = LLM(str(_stories_q8_0(tmp_path)), enforce_eager=True, kv_cache_memory_bytes=1 << 20)
    assert llm.llm_engine.executor.runner.activations == {"q8": "int8"}
    out = llm.generate({"prompt_token_ids": case["prompt_ids"]},
                       SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                       use_tqdm=False)[0]
    assert list(out.outputs[0].token_ids) == case["greedy_ids"][:8]


# -- bad files ------------------------------------------------------------------------------------
@pytest.fixture
def small_gguf(tmp_path):
    return write_gguf(tmp_path / "m.gguf", _hf_model("llama", num_hidden_layers=1), "llama",
                      _types("q8_0"), with_tokenizer=False)


@pytest.mark.parametrize("keep", [0.5, 0.99, 20 / 10 ** 6])
def test_truncated_file_is_a_clear_error(small_gguf, keep):
    data = small_gguf.read_bytes()
    small_gguf.write_bytes(data[:max(24, int(len(data) * keep))])
    with pytest.raises(ModelLoadError, match="m.gguf"):
        load_model(str(small_gguf), torch.float32, CPU)


def test_wrong_magic_is_a_clear_error(small_gguf):
    small_gguf.write_bytes(b"GGML" + small_gguf.read_bytes()[4:])
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        load_model(str(small_gguf), torch.float32, CPU)
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(str(small_gguf.with_name("nothing.gguf")), torch.float32, CPU)


def test_unsupported_tensor_type_names_it_and_the_supported(tmp_path):
    hf_model = _hf_model("llama", num_hidden_layers=1)

    def types(name, shape):
        return T.IQ2_XXS if name == "blk.0.ffn_up.weight" else T.F32

    import gguf_helpers
    original = gguf_helpers._add_tensor

    def add(writer, name, w, t):
        if t == T.IQ2_XXS:  # random bytes: the loader must refuse before reading them
            blocks = np.zeros((w.shape[0], w.shape[1] // 256 * 66), np.uint8)
            return writer.add_tensor(name, blocks, raw_dtype=t)
        return original(writer, name, w, t)

    gguf_helpers._add_tensor = add
    try:
        path = write_gguf(tmp_path / "m.gguf", hf_model, "llama", types, with_tokenizer=False)
    finally:
        gguf_helpers._add_tensor = original
    with pytest.raises(UnsupportedModelError, match=r"blk.0.ffn_up.weight has GGUF type IQ2_XXS.*"
                                                    r"supported types: F32, .*Q4_K"):
        load_model(str(path), torch.float32, CPU)


def test_unsupported_architecture_names_the_supported(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", _hf_model("llama", num_hidden_layers=1), "gemma",
                      with_tokenizer=False)
    with pytest.raises(UnsupportedModelError,
                       match="'gemma' is not supported; supported: bert, gemma2, gemma3, granite, llama, "):
        load_model(str(path), torch.float32, CPU)
    with pytest.raises(UnsupportedModelError, match="gemma"):
        read_gguf_config(path)


_LOAD_PEAK = """
import sys, torch
from pagedllm.checkpoint.loader import load_model
from pagedllm.layers.weight_format import Quantized

def rss(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024

# A tiny file of the same types first: the modules, the extension and its kernel checks are
# not the load's.
load_model(sys.argv[1], torch.float32, torch.device("cpu"))
open("/proc/self/clear_refs", "w").write("5")  # the peak from here on
before = rss("VmRSS")
model, _ = load_model(sys.argv[2], torch.float32, torch.device("cpu"))
weights = sum(t.nbytes for m in model.modules()
              if isinstance(getattr(m, "weight_format", None), Quantized)
              for t in (m.weight_format.qweight.codes, m.weight_format.qweight.scales,
                        m.weight_format.qweight.offsets) if t is not None)
print(rss("VmHWM") - before, weights)
"""


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="reads Linux's VmHWM")
def test_loading_holds_the_weights_and_one_layer_beside_them(tmp_path):
    """A quantized file's load peaks at its weights plus one layer's parts: the loader reads
    each tensor into a buffer of its own (the file's pages never stay mapped in), and builds
    each layer as soon as its parts are read (the unpacked parts of every layer, with the
    file's pages, used to take three times the weights)."""
    paths = []
    for name, size in (("tiny", dict(num_hidden_layers=1)),
                       ("m", dict(vocab_size=1024, hidden_size=1024, intermediate_size=4096,
                                  num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8))):
        hf_model = AutoModelForCausalLM.from_config(LlamaConfig(**SMALL | size), dtype=torch.float32)
        paths.append(str(write_gguf(tmp_path / f"{name}.gguf", hf_model, "llama",
                                    _types("k_quants"), with_tokenizer=False)))
    out = subprocess.run([sys.executable, "-c", _LOAD_PEAK, *paths], capture_output=True,
                         text=True, check=True, cwd=tmp_path)
    peak, weights = map(int, out.stdout.split())
    # 4 layers of 16.8M weights and the head: 51 MB held. The peak measured 100-108 MB (one
    # layer's parts, their combined copy and its panels); before, 212-231 MB.
    assert weights > 45e6 and peak < weights + 100e6, (peak, weights)
