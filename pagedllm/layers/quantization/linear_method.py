"""How a linear layer holds its weight and multiplies by it, one ``LinearMethod`` per format
(vLLM's LinearMethodBase): the layer's ``quant_method`` is set once at load, ``qweight`` holds
the weight (``weight`` is then None), and ``layers/linear.linear`` calls
``layer.quant_method.apply(layer, x, bias)``: the model code never branches on the format.

- A loader that reads quantized tensors (GGUF, AWQ, GPTQ) builds a ``QuantizedWeight``
  (``from_q8`` / ``from_q4`` / ``from_q5`` / ``from_q6``) and calls ``set_quantized_weight(layer,
  qweight)``. For a stacked layer (qkv_proj, gate_up_proj) it concatenates the parts' codes,
  scales and offsets along the rows first (groups run along the input, so every part's rows
  stay whole); a tensor-parallel slice of the input must cut at group boundaries.
- A model loaded as float32 and quantized at load (``--quantization q8_0|q4_0``), or loaded in
  bfloat16/float16 on CPU: the method is set on the layer and
  ``process_weights_after_loading(layer)`` converts its loaded ``weight``.

Every method runs ``pagedllm::quant_linear`` (csrc/quant_gemm.cpp): float32 activations and
sums whatever the weight's format (x of another dtype is widened, the result narrowed back).
The block methods (q8, q4, q5, q6) can instead quantize the activations to int8
(``activations="int8"``, the engine's ``quantization_activations``; csrc/int8_gemm.h):
llama.cpp's integer dot products, on the same panels, at every row count (so a row's bits still
never depend on its batch). bf16 weights can take activations rounded to bf16
(``activations="bfloat16"``; csrc/bf16_gemm.h): AMX tile products, or AVX512-BF16 dot products
on CPUs with AVX512-BF16 and no AMX, as vLLM's oneDNN runs a bf16 model; the weights are
converted to the tiles' layout for it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.errors import ModelLoadError
from pagedllm.kernels.cpu_extension import load_cpu_ops
from pagedllm.layers.quantization.quantized_weight import QuantizedWeight
from pagedllm.layers.quantization.round_to_nearest import quantize_linear

ACTIVATIONS = ("float32", "int8", "bfloat16")  # ModelConfig.quantization_activations


class LinearMethod:
    """The base: ``apply`` through the kernel on ``layer.qweight``; subclasses say how a loaded
    float weight becomes one."""

    formats: tuple[str, ...] = ()
    # The activations besides float32 a method's kernel takes: "int8" (int8-quantized, block
    # methods) or "bfloat16" (rounded to bf16, bf16 weights on AMX).
    narrow_activations: str | None = None
    activations = "float32"

    def __init__(self, activations: str = "float32") -> None:
        if activations not in ("float32", self.narrow_activations):
            raise ModelLoadError(f"quantization activations {activations!r} do not apply to "
                                 f"{'/'.join(self.formats)} weights; they take float32"
                                 + (f" or {self.narrow_activations}" if self.narrow_activations else ""))
        self.activations = activations

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Convert ``layer.weight`` (loaded) into ``layer.qweight``; nothing when the loader
        set ``qweight`` itself."""
        if getattr(layer, "qweight", None) is None:
            qweight = self.convert(layer.weight)
            layer.qweight, layer.weight = qweight, None

    def convert(self, weight: torch.Tensor) -> QuantizedWeight:
        raise NotImplementedError

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        qw: QuantizedWeight = layer.qweight
        # A bf16 model's x goes to the AMX path as it is, which returns bf16 y, bias included.
        as_is = self.activations == "bfloat16" and x.dtype == torch.bfloat16
        y = torch.ops.pagedllm.quant_linear(
            x if as_is else x.float(), qw.codes, qw.scales, qw.offsets, qw.group_size,
            qw.out_features, None if bias is None else bias.float(), self.activations != "float32")
        return y.to(x.dtype)


class HalfLinearMethod(LinearMethod):
    """bfloat16 / float16 weights, widened in registers (never torch's half GEMM, which on a CPU
    without native bf16 converts the whole matrix on every call)."""

    formats = ("bf16", "fp16", "bf16_vnni")
    narrow_activations = "bfloat16"  # bf16 weights, as bf16_vnni (set_quantization_activations)

    def convert(self, weight: torch.Tensor) -> QuantizedWeight:
        return QuantizedWeight.from_half(weight)


class BlockLinearMethod(LinearMethod):
    """Block-quantized codes with a scale (and offset) per group, which int8 activations
    apply to."""

    narrow_activations = "int8"


class Q8LinearMethod(BlockLinearMethod):
    """int8 codes with a scale (and optional offset) per group: GGUF Q8_0, Q5_K; at load,
    llama.cpp's q8_0 round-to-nearest."""

    formats = ("q8",)

    def convert(self, weight: torch.Tensor) -> QuantizedWeight:
        return quantize_linear(weight, "q8_0")


class Q4LinearMethod(BlockLinearMethod):
    """4-bit codes with a scale and offset per group: GGUF Q4_0, Q4_1, Q4_K, AWQ, GPTQ; at
    load, llama.cpp's q4_0 round-to-nearest."""

    formats = ("q4",)

    def convert(self, weight: torch.Tensor) -> QuantizedWeight:
        return quantize_linear(weight, "q4_0")


class Q5LinearMethod(BlockLinearMethod):
    """5-bit codes -16..15 with a scale (and optional offset) per group: GGUF Q5_0 (the blocks
    a Q4_K_M file holds where rows are not whole K-quant super-blocks). Loaded only: load-time
    quantization offers q8_0 and q4_0, llama.cpp's round-to-nearest schemes."""

    formats = ("q5",)


class Q6LinearMethod(BlockLinearMethod):
    """6-bit codes -32..31 with a scale per group: GGUF Q6_K (Q4_K_M's attn_v, half its ffn_down
    and often its lm_head). Loaded only, as Q5LinearMethod."""

    formats = ("q6",)


# The methods of block-quantized codes: the ones int8 activations apply to.
BLOCK_METHODS = (Q8LinearMethod, Q4LinearMethod, Q5LinearMethod, Q6LinearMethod)
_METHODS = {fmt: cls for cls in (HalfLinearMethod, *BLOCK_METHODS) for fmt in cls.formats}


def quantized_kernels_available(device: torch.device) -> bool:
    """The formats other than float32 run on pagedllm's CPU kernels only."""
    return device.type == "cpu" and load_cpu_ops() is not None


def method_for(qweight: QuantizedWeight) -> LinearMethod:
    """The method that multiplies by ``qweight``'s format (the exact, float32-activation path)."""
    return _METHODS[qweight.format]()


def set_quantization_activations(model: nn.Module, activations: str) -> int:
    """Run every layer of ``model`` (after loading and choose_linear_kernels) that takes
    ``activations`` with them: "int8", the block-quantized (q8/q4/q5/q6) layers; "bfloat16", the
    bf16 ones, dense and experts, their weights converted to that path's layout
    (``QuantizedWeight.to_vnni``; a tied embedding follows its head) and each shape first
    checked against float64 (``check_kernel``); "float32", the block layers back on their exact
    path. Returns how many layers that is; the others keep float32 activations."""
    if activations not in ACTIVATIONS:
        raise ModelLoadError(f"quantization activations {activations!r} are not supported; "
                             f"supported: {', '.join(ACTIVATIONS)}")
    count = 0
    converted: dict[int, tuple[QuantizedWeight, QuantizedWeight]] = {}  # id(bf16): (it, vnni)
    checked: set[tuple[int, int]] = set()
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is None:
            continue
        if activations not in ("float32", method.narrow_activations):
            continue
        names = [name for name in ("qweight", "qweight_gate_up", "qweight_down")
                 if getattr(module, name, None) is not None]
        if any(getattr(module, name).format == "bf16_vnni" for name in names):
            raise ModelLoadError("bf16 layers converted for bfloat16 activations keep them; "
                                 "load the model again for other activations")
        if activations == "bfloat16":
            names = [name for name in names if getattr(module, name).format == "bf16"]
            if not names:
                continue  # fp16 weights
            for name in names:
                bf16 = getattr(module, name)
                if id(bf16) not in converted:
                    converted[id(bf16)] = (bf16, bf16.to_vnni())
                vnni = converted[id(bf16)][1]
                one = vnni.expert(0) if vnni.codes.dim() == 4 else vnni
                if (one.out_features, one.in_features) not in checked:
                    check_kernel(one, None, activations)
                    checked.add((one.out_features, one.in_features))
                setattr(module, name, vnni)
        module.quant_method = type(method)(activations)
        count += 1
    for module in model.modules():  # embeddings reading rows of a converted head
        qweight = getattr(module, "qweight", None)
        if qweight is not None and id(qweight) in converted:
            module.qweight = converted[id(qweight)][1]
    return count


def set_quantized_weight(layer: nn.Module, qweight: QuantizedWeight, check: bool = True) -> None:
    """Make ``layer`` hold ``qweight`` only (its ``weight`` becomes None) and multiply through
    its format's method. ``check``: first compare the kernel with float64 on the dequantized
    weight (see ``kernel_matches_float64``); a mismatch raises ModelLoadError."""
    # [out, in] of the layer: its allocated weight's (an lm_head has no in_features)
    weight = getattr(layer, "weight", None)
    shape = tuple(weight.shape) if weight is not None else (layer.out_features, layer.in_features)
    if (qweight.out_features, qweight.in_features) != shape:
        raise ModelLoadError(f"a {qweight.out_features}x{qweight.in_features} weight does not fit "
                             f"a {shape[0]}x{shape[1]} layer")
    if check:
        check_kernel(qweight, getattr(layer, "bias", None))
    layer.quant_method = method_for(qweight)
    layer.qweight, layer.weight = qweight, None


def check_kernel(qweight: QuantizedWeight, bias: torch.Tensor | None,
                 activations: str = "float32") -> None:
    """ModelLoadError unless ``kernel_matches_float64``."""
    try:
        ok = kernel_matches_float64(qweight, bias, activations)
    except RuntimeError as exc:  # the kernel refused (bf16 activations: no AVX512-BF16 in this build)
        raise ModelLoadError(f"{activations} activations on {qweight.format} weights: "
                             f"{str(exc).splitlines()[0]}") from None
    if not ok:
        raise ModelLoadError(f"the {qweight.format} CPU kernel ({activations} activations) "
                             f"disagrees with float64 on a {qweight.out_features}x"
                             f"{qweight.in_features} weight")


def kernel_matches_float64(qweight: QuantizedWeight, bias: torch.Tensor | None,
                           activations: str = "float32") -> bool:
    """Whether the kernel's product is within float32 rounding of float64 on the dequantized
    weight, at 1, 5 and 40 rows, on the first two panels and the last (every path of the kernel:
    one check per shape and format suffices). With bfloat16 activations the reference's x is
    rounded to bf16 as the kernel's is, so the check holds it to the same bound. False when the
    kernels cannot be built here."""
    ops = load_cpu_ops()
    if ops is None:
        return False
    n, k = qweight.out_features, qweight.in_features
    head = min(128, n)
    rows = torch.cat((torch.arange(head), torch.arange(max(head, n - 64), n)))
    w64 = qweight.dequantize(torch.float64)[rows]
    b64 = None if bias is None else bias.detach()[rows].double()
    b32 = None if bias is None else bias.detach().float()
    gen = torch.Generator().manual_seed(0)
    for num_rows in (1, 5, 40):
        x = torch.randn(num_rows, k, generator=gen)
        y = ops.quant_linear(x, qweight.codes, qweight.scales, qweight.offsets,
                             qweight.group_size, n, b32, activations == "bfloat16")[:, rows]
        x64 = (x.bfloat16() if activations == "bfloat16" else x).double()
        error = (y.double() - F.linear(x64, w64, b64)).abs()
        # float32 rounding of a dot product is a small multiple of eps x sum |x_i w_i|; a wrong
        # layout or a missed group is off by the order of the sum itself.
        scale = x64.abs() @ w64.abs().T + (0 if b64 is None else b64.abs())
        if not bool((error <= 1e-5 * scale.amax() + 1e-30).all()):
            return False
    return True
