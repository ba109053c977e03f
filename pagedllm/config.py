"""Engine configuration: frozen dataclasses built once at the edge and passed down read-only.

Every field carries a ``help`` text in its metadata; the CLI turns each field into a flag with it.
Values discovered at run time (the number of KV blocks, EOS ids) live in their own objects,
never in these.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path

from pagedllm import envs
from pagedllm.errors import ValidationError, check_ints
from pagedllm.speculative_config import SpeculativeConfig

# The demo model lives in the shared folder beside the repository; PAGEDLLM_MODEL overrides it.
_REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL_DIR = _REPO_ROOT.parent / "shared" / "models" / "stories260K" / "hf"


# The values of ModelConfig.attention_backend (the backends live in pagedllm/layers/attention/).
ATTENTION_BACKENDS = ("auto", "torch", "cpu_paged")
# The values of CacheConfig.kv_cache_dtype, vLLM's names: auto = the model's dtype; fp8 =
# fp8_e4m3 (pagedllm/layers/attention/kv_cache_dtype.py).
KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2")
# vLLM's runner argument; runner_type.py resolves auto (kept here: it reads checkpoints, config does not)
RUNNER_TYPES = ("auto", "generate", "pooling")
# The values of ModelConfig.quantization: vLLM's names for quantized checkpoints, and pagedllm's
# round-to-nearest formats for quantizing a full-precision one at load
# (pagedllm/layers/quantization/).
QUANTIZATION_METHODS = ("awq", "gptq", "gguf", "mxfp4", "q8_0", "q4_0")
# The values of ModelConfig.dtype besides auto: each name (torch's and the usual short ones) ->
# the torch dtype it means (the runner looks it up in torch).
DTYPE_ALIASES = {"float32": "float32", "float": "float32", "fp32": "float32",
                 "bfloat16": "bfloat16", "bf16": "bfloat16",
                 "float16": "float16", "half": "float16", "fp16": "float16"}


def default_model() -> str:
    return envs.model() or str(DEFAULT_MODEL_DIR)


def _doc(text: str, **kw):
    return field(metadata={"help": text}, **kw)


@dataclass(frozen=True)
class ModelConfig:
    model: str = _doc("A local model folder or GGUF file (LLM() and the CLI also take a Hub id).",
                      default_factory=default_model)
    tokenizer: str | None = _doc("Tokenizer folder; defaults to the model folder.", default=None)
    dtype: str = _doc("Weights and activations: auto (float32 on CPU, bfloat16 on CUDA), "
                      "float32, bfloat16 or float16.", default="auto")
    max_model_len: int | None = _doc("Longest prompt + output, in tokens; defaults to the "
                                     "model's max_position_embeddings.", default=None)
    seed: int = _doc("Seed of the engine's random generator (unseeded requests).", default=0)
    device: str = _doc("cpu, cuda, or auto (cuda when available).", default="auto")
    attention_backend: str = _doc(
        "auto (cpu_paged on CPU, torch elsewhere), torch (gather + SDPA, the reference) or "
        "cpu_paged (a C++ kernel reading the paged cache in place; CPU only).", default="auto")
    enforce_eager: bool | None = _doc(
        "True: run the model eagerly, never through torch.compile; False or unset (auto): "
        "compile it wherever a compiler exists (unset and PAGEDLLM_ENFORCE_EAGER=1 in the "
        "environment: eager; see pagedllm/runner/compile.py).", default=None)
    quantization: str | None = _doc(
        "Linear weight format: awq, gptq, gguf or mxfp4 (must match the checkpoint), q8_0 or q4_0 "
        "(a full-precision checkpoint quantized at load; CPU); unset: what the checkpoint is.",
        default=None)
    quantization_activations: str = _doc(
        "Activations of the quantized and bf16 linears on CPU: auto (int8 for GGUF and "
        "q8_0/q4_0 weights, as llama.cpp; bfloat16 for bf16 weights on CPUs with AVX512-BF16 or "
        "AMX, as vLLM; float32 elsewhere, AWQ/GPTQ included); float32 (exact: the dequantized "
        "model's numbers); int8 for q8/q4 weights (GGUF, AWQ/GPTQ, q8_0/q4_0: quantized per "
        "row in blocks of 32, integer dot products); bfloat16 for bf16 weights (dtype=bfloat16: "
        "rounded to bf16, AMX tiles or AVX512-BF16 dot products); docs/quantization.md.",
        default="auto")
    runner: str = _doc("auto (pooling for a *Model, *ForSequenceClassification or "
                       "sentence-transformers checkpoint, else generate), generate or pooling "
                       "(embed, classify, score: docs/pooling.md).", default="auto")

    def __post_init__(self) -> None:
        if self.runner not in RUNNER_TYPES:
            raise ValidationError(f"runner must be one of {', '.join(RUNNER_TYPES)}; got {self.runner!r}",
                                  "runner")
        if self.dtype != "auto" and self.dtype not in DTYPE_ALIASES:
            raise ValidationError(
                f"dtype must be one of auto, float32, bfloat16, float16; got {self.dtype!r}", "dtype")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValidationError(f"max_model_len must be >= 1, got {self.max_model_len}", "max_model_len")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValidationError(f"device must be auto, cpu or cuda, got {self.device!r}", "device")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValidationError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}; "
                                  f"got {self.attention_backend!r}", "attention_backend")
        if self.quantization is not None and self.quantization not in QUANTIZATION_METHODS:
            raise ValidationError(f"quantization {self.quantization!r} is not supported; "
                                  f"supported: {', '.join(QUANTIZATION_METHODS)}", "quantization")
        if self.quantization_activations not in ("auto", "float32", "int8", "bfloat16"):
            raise ValidationError(f"quantization_activations must be auto, float32, int8 or "
                                  f"bfloat16, got "
                                  f"{self.quantization_activations!r}", "quantization_activations")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = _doc("Tokens per KV cache block.", default=16)
    enable_prefix_caching: bool = _doc("Reuse the KV blocks of identical prompt prefixes.", default=True)
    kv_cache_memory_bytes: int | None = _doc(
        "Bytes of KV cache to allocate (CPU default: 1 GiB, capped at a quarter of RAM).", default=None)
    gpu_memory_utilization: float = _doc(
        "Share of GPU memory the engine may use, KV cache included (CUDA only).", default=0.9)
    num_gpu_blocks_override: int | None = _doc(
        "Force this many KV blocks, whatever the memory budget says (tests use tiny caches).", default=None)
    kv_cache_dtype: str = _doc(
        "KV cache dtype: auto (the model's), bfloat16, float16, fp8 (= fp8_e4m3) or fp8_e5m2; "
        "a narrower one holds 2x (16-bit) or 4x (fp8) the tokens of float32.", default="auto")

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValidationError(f"kv_cache_dtype {self.kv_cache_dtype!r} is unsupported; supported: "
                                  f"{', '.join(KV_CACHE_DTYPES)}", "kv_cache_dtype")
        if self.block_size < 1 or self.block_size > 1024:
            raise ValidationError(f"block_size must be in [1, 1024], got {self.block_size}", "block_size")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValidationError("gpu_memory_utilization must be in (0, 1]", "gpu_memory_utilization")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ValidationError("num_gpu_blocks_override must be >= 1", "num_gpu_blocks_override")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes < 1:
            raise ValidationError("kv_cache_memory_bytes must be >= 1", "kv_cache_memory_bytes")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = _doc("Most requests running in one step.", default=256)
    max_num_batched_tokens: int = _doc("Token budget of one step (prefill chunks + decodes).", default=2048)
    long_prefill_token_threshold: int = _doc(
        "Most tokens one request may take in a step (0: no cap); keeps a long prompt from "
        "taking the whole budget.", default=0)
    scheduling_policy: str = _doc("fcfs or priority (lower value first, then arrival).", default="fcfs")
    max_skip_ahead: int = _doc(
        "How many later waiting requests may be admitted past a head-of-line request that does "
        "not fit, before the queue waits for it.", default=16)
    async_scheduling: bool = _doc(
        "Schedule step N+1 while step N runs (its sampled tokens are in flight: the runner "
        "feeds them in itself), hiding the Python work behind the model.", default=False)
    # A CPU decode step costs a fixed part (every weight read once, the step's Python) plus a
    # part per token, and one token of compute is already about a tenth of a small batch's
    # step: the default lets one pooling token ride along (docs/pooling.md).
    max_pooling_tokens_while_decoding: int = _doc(
        "A generator that also pools (started with a pooler_config): most embedding-input "
        "tokens in a step while generation requests run, so each of their steps grows by at "
        "most that many tokens (0: no cap; docs/pooling.md).", default=1)

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValidationError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}", "max_num_seqs")
        if self.max_num_batched_tokens < 1:
            raise ValidationError("max_num_batched_tokens must be >= 1", "max_num_batched_tokens")
        if self.long_prefill_token_threshold < 0:
            raise ValidationError("long_prefill_token_threshold must be >= 0", "long_prefill_token_threshold")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValidationError(
                f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}",
                "scheduling_policy")
        if self.max_skip_ahead < 0:
            raise ValidationError("max_skip_ahead must be >= 0", "max_skip_ahead")
        if self.max_pooling_tokens_while_decoding < 0:
            raise ValidationError("max_pooling_tokens_while_decoding must be >= 0",
                                  "max_pooling_tokens_while_decoding")


# The keys of EngineConfig.structured_outputs_config (vLLM's StructuredOutputsConfig has more;
# these are the ones pagedllm honours).
STRUCTURED_OUTPUTS_OPTIONS = ("disable_any_whitespace",)

# The values of ParallelConfig.distributed_executor_backend (the executors: pagedllm/executor/).
EXECUTOR_BACKENDS = ("uni", "mp", "ray")


@dataclass(frozen=True)
class ParallelConfig:
    distributed_executor_backend: str | None = _doc(
        "Where the model runs: uni (in the engine's process, one rank), mp (a worker process per "
        "rank on this machine, over ZeroMQ) or ray (a Ray actor per rank, on a local Ray or the "
        "cluster RAY_ADDRESS names). Unset: uni for one rank, mp for more.", default=None)
    tensor_parallel_size: int = _doc(
        "Ranks that split every layer's heads and hidden units (torch.distributed: gloo on CPU, "
        "NCCL on CUDA).", default=1)
    data_parallel_size: int = _doc(
        "Engine cores (replicas) behind one API server, requests routed between them.", default=1)

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "data_parallel_size"):
            size = getattr(self, name)
            if not isinstance(size, int) or size < 1:
                raise ValidationError(f"{name} must be an integer >= 1, got {size!r}", name)
        tp = self.tensor_parallel_size
        if self.distributed_executor_backend is None:  # as vLLM: worker processes for > 1 rank
            object.__setattr__(self, "distributed_executor_backend", "uni" if tp == 1 else "mp")
        backend = self.distributed_executor_backend
        if backend not in EXECUTOR_BACKENDS:
            raise ValidationError(f"distributed_executor_backend must be one of "
                                  f"{', '.join(EXECUTOR_BACKENDS)}; got {backend!r}",
                                  "distributed_executor_backend")
        if backend == "uni" and tp > 1:
            raise ValidationError(f"distributed_executor_backend='uni' runs one rank in the "
                                  f"engine's process; tensor_parallel_size={tp} needs 'mp' (worker "
                                  f"processes on this machine) or 'ray' (leave it unset for mp)",
                                  "distributed_executor_backend")


@dataclass(frozen=True)
class ObservabilityConfig:
    trace_file: str | None = _doc(
        "Write one JSON line per engine step to this file (the step trace: docs/trace_schema.md); "
        "off by default, and free when off.", default=None)


@dataclass(frozen=True)
class LoRAConfig:
    enable_lora: bool = _doc("Serve LoRA adapters on the base model (docs/lora.md).", default=False)
    max_loras: int = _doc("Most adapters resident in the worker, and in one step.", default=1)
    max_lora_rank: int = _doc("Highest adapter rank accepted at load.", default=16)
    max_cpu_loras: int | None = _doc("Most adapters kept loaded beyond the resident ones (LRU); "
                                     "unset: max_loras.", default=None)

    def __post_init__(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            if getattr(self, name) < 1:
                raise ValidationError(f"{name} must be >= 1, got {getattr(self, name)}", name)
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValidationError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras "
                                  f"({self.max_loras})", "max_cpu_loras")


@dataclass(frozen=True)
class EngineConfig:
    model_config: ModelConfig = field(default_factory=ModelConfig)
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative_config: dict | None = None
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    observability_config: ObservabilityConfig = field(default_factory=ObservabilityConfig)
    # vLLM's structured_outputs_config (--structured-outputs-config '{"disable_any_whitespace":
    # true}'): the engine's default for requests that leave an option unset.
    structured_outputs_config: dict | None = None
    lora_config: LoRAConfig = field(default_factory=LoRAConfig)
    # vLLM's pooler_config ('{"pooling_type": "MEAN", "normalize": true}'): overrides what the
    # checkpoint's sentence-transformers files say (models/pooler_config.py checks it).
    pooler_config: dict | None = None

    def __post_init__(self) -> None:
        # Engine arguments travel to worker and core processes, and seeds and sizes into torch:
        # 64 bits at most, refused here by name rather than deep inside a worker.
        for part in (self.model_config, self.cache_config, self.scheduler_config,
                     self.parallel_config, self.lora_config):
            for f in fields(part):
                check_ints(getattr(part, f.name), f.name)
        check_ints(list((self.speculative_config or {}).values()), "speculative_config")
        SpeculativeConfig.from_dict(self.speculative_config)  # a bad key is refused here, by name
        if self.speculative_config and self.pooler_config is not None:
            raise ValidationError("pooler_config does not combine with speculative_config: pooling "
                                  "requests have no drafts to verify; drop one", "pooler_config")
        so = self.structured_outputs_config
        if so is None:
            return
        if not isinstance(so, dict) or set(so) - set(STRUCTURED_OUTPUTS_OPTIONS):
            raise ValidationError(f"structured_outputs_config must be a JSON object with keys among "
                                  f"{', '.join(STRUCTURED_OUTPUTS_OPTIONS)}; got {so!r}",
                                  "structured_outputs_config")
        if so.get("disable_any_whitespace") not in (None, True, False):
            raise ValidationError("structured_outputs_config.disable_any_whitespace must be true or "
                                  "false", "structured_outputs_config")

    @classmethod
    def from_kwargs(cls, model: str | None = None, **kwargs) -> "EngineConfig":
        """Build from vLLM-style flat engine arguments (``LLM(model, max_num_seqs=...)``)."""
        parts: dict[type, dict] = {ModelConfig: {}, CacheConfig: {}, SchedulerConfig: {},
                                   ParallelConfig: {}, ObservabilityConfig: {}, LoRAConfig: {}}
        if model is not None:
            parts[ModelConfig]["model"] = str(model)
        speculative_config = kwargs.pop("speculative_config", None)
        structured_outputs_config = kwargs.pop("structured_outputs_config", None)
        pooler_config = kwargs.pop("pooler_config", None)
        for key, value in kwargs.items():
            for klass, values in parts.items():
                if key in {f.name for f in fields(klass)}:
                    values[key] = value
                    break
            else:
                raise ValidationError(f"unknown engine argument {key!r}", key)
        return cls(ModelConfig(**parts[ModelConfig]), CacheConfig(**parts[CacheConfig]),
                   SchedulerConfig(**parts[SchedulerConfig]), speculative_config,
                   ParallelConfig(**parts[ParallelConfig]),
                   ObservabilityConfig(**parts[ObservabilityConfig]), structured_outputs_config,
                   LoRAConfig(**parts[LoRAConfig]), pooler_config)
