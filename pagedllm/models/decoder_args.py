"""What a decoder-only model is, read once from config.json: dimensions, the variant knobs the
families differ in, and one ``LayerSpec`` per layer (its rope and its attention window), so the
layers are built from specs instead of testing flags in ``forward``."""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from pagedllm.errors import ModelLoadError
from pagedllm.hf_config import layer_types, max_position_embeddings, sliding_window
from pagedllm.layers.rotary import RopeConfig


@dataclass(frozen=True)
class LayerSpec:
    """How one layer's attention differs from its neighbours'."""

    rope: RopeConfig | None  # None: no rotary at all (SmolLM3's NoPE layers)
    sliding_window: int | None = None  # attend to the last ``sliding_window`` tokens only
    num_kv_heads: int | None = None  # None: the model's (a layer may have its own KV geometry)
    head_dim: int | None = None  # None: the model's


@dataclass(frozen=True)
class DecoderArgs:
    """The model dimensions and variant knobs (their defaults are Llama's)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    tie_word_embeddings: bool
    hidden_act: str = "silu"
    qkv_bias: bool = False     # Qwen2: always; Llama/Qwen3: attention_bias
    o_bias: bool = False       # Llama/Qwen3: attention_bias; Qwen2: never
    mlp_bias: bool = False
    qk_norm: bool = False      # Qwen3, Gemma 3: a norm over each head of q and k before rope
    norm_kind: str = "llama"   # "gemma": (1 + weight) * x; "olmo2": scaled before the cast back
    attn_scale: float | None = None  # None: head_dim ** -0.5
    attn_logits_soft_cap: float | None = None   # Gemma 2: cap * tanh(scores / cap)
    final_logits_soft_cap: float | None = None  # Gemma 2/3: the same on the logits
    logits_scaling: float = 1.0        # Granite: logits divided by it
    embedding_multiplier: float = 1.0  # Granite; Gemma: sqrt(hidden_size)
    residual_multiplier: float = 1.0   # Granite: each block's output scaled before the add
    layers: tuple[LayerSpec, ...] = field(default=())

    def __post_init__(self) -> None:
        if not self.layers:  # every layer alike: the model's rope, full attention
            object.__setattr__(self, "layers", (LayerSpec(self.rope),) * self.num_layers)
        for i in range(len(self.layers)):
            kv_heads = self.layer_num_kv_heads(i)
            if kv_heads < 1 or self.num_heads % kv_heads or self.layer_head_dim(i) < 1:
                raise ModelLoadError(f"layer {i}: {kv_heads} KV heads of size {self.layer_head_dim(i)} "
                                     f"for {self.num_heads} query heads; expected a positive divisor "
                                     "of the query heads and a positive head size")

    def layer_num_kv_heads(self, i: int) -> int:
        """Layer ``i``'s KV heads (all ranks')."""
        return self.layers[i].num_kv_heads or self.num_kv_heads

    def layer_head_dim(self, i: int) -> int:
        return self.layers[i].head_dim or self.head_dim

    @classmethod
    def from_hf(cls, config: dict, default_pattern: int | None = None, **overrides) -> DecoderArgs:
        """``config``: the language model's fields (``hf_config.text_config``).
        ``default_pattern``: the family's sliding-window period when the config names none."""
        def need(key: str):
            if config.get(key) is None:
                raise ModelLoadError(f"config.json lacks required field {key!r}")
            return config[key]

        hidden, heads = int(need("hidden_size")), int(need("num_attention_heads"))
        kv_heads = int(config.get("num_key_value_heads") or heads)
        if heads % kv_heads:
            raise ModelLoadError(f"num_attention_heads ({heads}) is not a multiple of "
                                 f"num_key_value_heads ({kv_heads})")
        attention_bias = bool(config.get("attention_bias", False))
        rope = RopeConfig.from_hf(config)
        window = sliding_window(config)
        specs = tuple(LayerSpec(rope, window if kind == "sliding_attention" else None)
                      for kind in layer_types(config, default_pattern))
        args = dict(
            vocab_size=int(need("vocab_size")), hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_layers=int(need("num_hidden_layers")), num_heads=heads, num_kv_heads=kv_heads,
            head_dim=int(config.get("head_dim") or hidden // heads),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=max_position_embeddings(config),
            rope=rope, tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            hidden_act=config.get("hidden_act", "silu"),
            qkv_bias=attention_bias, o_bias=attention_bias,
            mlp_bias=bool(config.get("mlp_bias", False)), layers=specs)
        args.update(overrides)
        if len(args["layers"]) != args["num_layers"]:
            raise ModelLoadError(f"config.json describes {len(args['layers'])} layer types for "
                                 f"{args['num_layers']} layers")
        return cls(**args)

    def with_layer_ropes(self, ropes: list[RopeConfig | None]) -> DecoderArgs:
        """The same model with layer ``i`` rotated by ``ropes[i]`` (None: not rotated)."""
        return replace(self, layers=tuple(replace(spec, rope=rope)
                                          for spec, rope in zip(self.layers, ropes, strict=True)))
