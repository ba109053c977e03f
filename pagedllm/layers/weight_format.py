"""How a layer holds its weight: one ``WeightFormat`` object per linear layer, vocabulary
embedding and head, set once at load (``weight`` is then None), which multiplies by it
(``apply``), reads its rows for an embedding lookup (``rows``), reports its size (``nbytes``)
and checks its kernel against float64 (``check``: the one self-check every format shares).

- ``Panels``: float32 panels of ``pagedllm::packed_linear`` (kernels/csrc/skinny_gemm.cpp),
  where the runner measured the skinny kernel faster than torch's matmul (weight_plan/linear_choice.py).
- ``Half``: bf16/fp16 panels widened in registers (``pagedllm::quant_linear``), with float32 or
  (bf16 weights in the AMX/AVX512-BF16 layout, ``bf16_vnni``) bfloat16 activations.
- ``Blocks``: block-quantized codes (q8, q4, q5, q6: GGUF, AWQ/GPTQ, load-time q8_0/q4_0), with
  float32 or int8 activations (llama.cpp's integer dot products).
- ``Dense``: the float weight itself on torch's matmul (the float model on a GPU, a shape where
  torch's matmul won the measurement, a layer no kernel takes); the layer keeps its ``weight``.
- ``MXFP4``: GPT-OSS's microscaling FP4 experts as the checkpoint ships them, until the layer
  dequantizes them to the model dtype (exact) at load.
The planning pass (weight_plan/plan.py) gives every layer one of these; a layer not yet
planned (a model straight from a loader, a test's layer) multiplies by its ``weight``.

Every format keeps the same C++ op and arguments the layers called before it existed, so a
compiled graph still sees each as one opaque node.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.errors import ModelLoadError
from pagedllm.kernels.cpu_extension import load_cpu_ops
from pagedllm.layers.quantization.mxfp4 import BLOCK_SIZE, dequantize_mxfp4
from pagedllm.layers.quantization.quantized_weight import HALF_FORMATS, QuantizedWeight
from pagedllm.utils import cdiv

ACTIVATIONS = ("float32", "int8", "bfloat16")  # ModelConfig.quantization_activations, besides auto
PANEL = 64  # output columns per panel (kPanel in csrc/skinny_gemm.cpp)
_NARROW_STEP = 16  # a narrow panel's width is a multiple of this (one AVX-512 vector)
_CHECK_ROWS = (1, 5, 40)  # row counts of the self-check: every tile path of the kernels


class WeightFormat:
    """The base: subclasses hold the weight and say how to multiply by it."""

    name = "float32"
    activations = "float32"
    # The activations besides float32 the format's kernel takes (``with_activations``).
    narrow_activations: str | None = None
    out_features: int
    in_features: int

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x W^T + b``."""
        raise NotImplementedError

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of W (an embedding lookup): ``[T] -> [T, in]``."""
        raise NotImplementedError

    def tensors(self) -> list[torch.Tensor]:
        """The tensors the format holds (what ``nbytes`` counts)."""
        raise NotImplementedError

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def dequantize_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows ``rows`` of W in float64 (the self-check's reference)."""
        raise NotImplementedError

    def describe(self) -> str:
        """The format's name and, where not float32, its activations (a table's cell)."""
        return self.name if self.activations == "float32" else f"{self.name} ({self.activations})"

    def with_activations(self, activations: str) -> WeightFormat:
        """The same weight multiplied with ``activations``; ModelLoadError where the kernel
        does not take them."""
        if activations == self.activations:
            return self
        raise ModelLoadError(f"quantization activations {activations!r} do not apply to "
                             f"{self.name} weights; they take float32"
                             + (f" or {self.narrow_activations}" if self.narrow_activations else ""))

    def kernel_args(self) -> tuple:
        """The weight as the grouped kernels take it (``pagedllm::fused_experts``): weight,
        scales, offsets, group size."""
        raise NotImplementedError

    def _exact_product(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """What ``check`` compares with float64: ``apply``, except that int8 activations are
        checked on their weights' float32 path (int8 rounding is no float32 rounding)."""
        return self.apply(x, bias)

    def _reference_input(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def check(self, bias: torch.Tensor | None = None) -> bool:
        """Whether the kernel's product is within float32 rounding of float64 on the weight,
        at 1, 5 and 40 rows, on the first two panels and the last (every path of the kernels:
        one check per shape and format suffices). False when the kernels cannot run here;
        RuntimeError when the kernel refuses the format (``check_format`` says why)."""
        if load_cpu_ops() is None:
            return False
        n, k = self.out_features, self.in_features
        head = min(2 * PANEL, n)
        rows = torch.cat((torch.arange(head), torch.arange(max(head, n - PANEL), n)))
        w64 = self.dequantize_rows(rows)
        b64 = None if bias is None else bias.detach()[rows].double()
        b32 = None if bias is None else bias.detach().float()
        gen = torch.Generator().manual_seed(0)
        for num_rows in _CHECK_ROWS:
            x = torch.randn(num_rows, k, generator=gen)
            y = self._exact_product(x, b32)[:, rows]
            x64 = self._reference_input(x).double()
            error = (y.double() - F.linear(x64, w64, b64)).abs()
            # float32 rounding of a dot product is a small multiple of eps x sum |x_i w_i|; a
            # wrong layout or a missed group is off by the order of the sum itself.
            scale = x64.abs() @ w64.abs().T + (0 if b64 is None else b64.abs())
            if not bool((error <= 1e-5 * scale.amax() + 1e-30).all()):
                return False
        return True


class Dense(WeightFormat):
    """A float weight ``[out, in]`` (a MoE projection's ``[E, out, in]``) multiplied by torch's
    matmul. It is the layer's own ``weight`` tensor (one copy: state_dict and adapters still
    see the Parameter); its kernel is the reference, so ``check`` holds."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight
        self.out_features, self.in_features = weight.shape[-2], weight.shape[-1]

    @property
    def name(self) -> str:  # type: ignore[override]
        return str(self.weight.dtype).removeprefix("torch.")

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, self.weight, bias)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)

    def tensors(self) -> list[torch.Tensor]:
        return [self.weight]

    def dequantize_rows(self, rows: torch.Tensor) -> torch.Tensor:
        return self.weight.detach()[rows].double()

    def check(self, bias: torch.Tensor | None = None) -> bool:
        return True


class MXFP4(WeightFormat):
    """OCP microscaling FP4 (layers/quantization/mxfp4.py): uint8 ``blocks [..., out, in / 32,
    16]`` and e8m0 ``scales [..., out, in / 32]``. No kernel multiplies by them: the layer holds
    ``dequantize(dtype)`` after loading (every value is exact in bf16, fp16 and fp32)."""

    name = "mxfp4"

    def __init__(self, blocks: torch.Tensor, scales: torch.Tensor) -> None:
        self.blocks, self.scales = blocks, scales
        self.out_features, self.in_features = blocks.shape[-3], blocks.shape[-2] * BLOCK_SIZE

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight ``[..., out, in]`` in ``dtype``."""
        return dequantize_mxfp4(self.blocks, self.scales, dtype)

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, self.dequantize(x.dtype), bias)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return dequantize_mxfp4(self.blocks[ids], self.scales[ids], torch.float32)

    def tensors(self) -> list[torch.Tensor]:
        return [self.blocks, self.scales]

    def dequantize_rows(self, rows: torch.Tensor) -> torch.Tensor:
        return dequantize_mxfp4(self.blocks[rows], self.scales[rows], torch.float64)

    def check(self, bias: torch.Tensor | None = None) -> bool:
        return True


class Panels(WeightFormat):
    """float32 W as skinny_gemm's panels ``[ceil(out / width), in, width]`` (zero rows pad the
    last), multiplied by ``pagedllm::packed_linear``."""

    name = "panels"

    def __init__(self, packed: torch.Tensor, out_features: int) -> None:
        self.packed = packed  # [panels, in, width], or [E, panels, in, 64]: a MoE's experts
        self.out_features, self.in_features = out_features, packed.shape[-2]

    @classmethod
    def pack(cls, weight: torch.Tensor, narrow: bool = True) -> Panels | None:
        """``weight`` [out, in] as panels of 64 outputs, or with ``narrow`` one narrow panel
        [1, in, 16 | 32 | 48] for a layer of at most 48 outputs (a router's experts); None
        where the kernel cannot take it: not float32 on CPU, or not built."""
        if weight.device.type != "cpu" or weight.dtype != torch.float32 or weight.dim() != 2:
            return None
        if load_cpu_ops() is None:
            return None
        out_features, in_features = weight.shape
        width = PANEL
        if narrow and out_features <= PANEL - _NARROW_STEP:
            width = cdiv(out_features, _NARROW_STEP) * _NARROW_STEP
        padded = F.pad(weight.detach(), (0, 0, 0, -out_features % width))
        # [out, in] -> [panels, width, in] -> [panels, in, width]
        return cls(padded.view(-1, width, in_features).transpose(1, 2).contiguous(), out_features)

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return torch.ops.pagedllm.packed_linear(x, self.packed, self.out_features, bias)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        width = self.packed.shape[2]
        return self.packed[ids // width, :, ids % width]

    def tensors(self) -> list[torch.Tensor]:
        return [self.packed]

    def kernel_args(self) -> tuple:
        return self.packed, None, None, 0

    def dequantize_rows(self, rows: torch.Tensor) -> torch.Tensor:
        return self.rows(rows).double()


class Quantized(WeightFormat):
    """A ``QuantizedWeight`` (layers/quantization/quantized_weight.py) multiplied by
    ``pagedllm::quant_linear``: float32 activations and sums whatever the weight's format (x of
    another dtype is widened, the result narrowed back), or the narrow activations of the
    subclass."""

    def __init__(self, qweight: QuantizedWeight, activations: str = "float32") -> None:
        if activations not in ("float32", self.narrow_activations):
            raise ModelLoadError(f"quantization activations {activations!r} do not apply to "
                                 f"{qweight.format} weights; they take float32"
                                 + (f" or {self.narrow_activations}" if self.narrow_activations
                                    else ""))
        self.qweight, self.activations = qweight, activations
        self.out_features, self.in_features = qweight.out_features, qweight.in_features

    @property
    def name(self) -> str:  # type: ignore[override]
        return self.qweight.format

    @staticmethod
    def of(qweight: QuantizedWeight, activations: str = "float32") -> Quantized:
        """The format that multiplies by ``qweight`` (its class from its format name)."""
        cls = Half if qweight.format in HALF_FORMATS else Blocks
        return cls(qweight, activations)

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        qw = self.qweight
        # A bf16 model's x goes to the bf16 path as it is, which returns bf16 y, bias included.
        as_is = self.activations == "bfloat16" and x.dtype == torch.bfloat16
        y = torch.ops.pagedllm.quant_linear(
            x if as_is else x.float(), qw.codes, qw.scales, qw.offsets, qw.group_size,
            qw.out_features, None if bias is None else bias.float(), self.activations != "float32")
        return y.to(x.dtype)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self.qweight.rows(ids)

    def tensors(self) -> list[torch.Tensor]:
        qw = self.qweight
        return [t for t in (qw.codes, qw.scales, qw.offsets) if t is not None]

    def kernel_args(self) -> tuple:
        qw = self.qweight
        return qw.codes, qw.scales, qw.offsets, qw.group_size

    def dequantize_rows(self, rows: torch.Tensor) -> torch.Tensor:
        return self.qweight.dequantize(torch.float64)[rows]

    def _exact_product(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        qw = self.qweight
        return load_cpu_ops().quant_linear(x, qw.codes, qw.scales, qw.offsets, qw.group_size,
                                           qw.out_features, bias, self.activations == "bfloat16")

    def _reference_input(self, x: torch.Tensor) -> torch.Tensor:
        # bf16 activations: the reference's x is rounded as the kernel's is.
        return x.bfloat16() if self.activations == "bfloat16" else x


class Half(Quantized):
    """bfloat16 / float16 weights, widened in registers (never torch's half GEMM, which on a CPU
    without native bf16 converts the whole matrix on every call); bf16 ones can take bfloat16
    activations, in the AMX tiles' layout (``bf16_vnni``)."""

    narrow_activations = "bfloat16"

    def with_activations(self, activations: str) -> WeightFormat:
        if activations == self.activations:
            return self
        if self.qweight.format == "bf16_vnni":
            raise ModelLoadError("bf16 layers converted for bfloat16 activations keep them; "
                                 "load the model again for other activations")
        if activations == "bfloat16" and self.qweight.format == "bf16":
            return Half(self.qweight.to_vnni(), activations)
        return super().with_activations(activations)


class Blocks(Quantized):
    """Block-quantized codes with a scale (and offset) per group (q8, q4, q5, q6), which int8
    activations apply to."""

    narrow_activations = "int8"

    def with_activations(self, activations: str) -> WeightFormat:
        if activations in ACTIVATIONS and activations in ("float32", self.narrow_activations):
            return self if activations == self.activations else Blocks(self.qweight, activations)
        return super().with_activations(activations)


def check_format(fmt: WeightFormat, bias: torch.Tensor | None = None) -> None:
    """ModelLoadError unless ``fmt.check(bias)``."""
    try:
        ok = fmt.check(bias)
    except RuntimeError as exc:  # the kernel refused (bf16 activations: no AVX512-BF16 here)
        raise ModelLoadError(f"{fmt.activations} activations on {fmt.name} weights: "
                             f"{str(exc).splitlines()[0]}") from None
    if not ok:
        raise ModelLoadError(f"the {fmt.name} CPU kernel ({fmt.activations} activations) "
                             f"disagrees with float64 on a {fmt.out_features}x{fmt.in_features} "
                             "weight")
