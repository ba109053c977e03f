"""AWQ and GPTQ checkpoints: which ``quantization`` a model folder asks for, and each quantized
linear's packed tensors unpacked into the q4 layout (codes 0..15, scale ``s`` and offset
``-z * s`` per group of ``group_size`` inputs: ``w = (q - z) * s``, what both formats mean).

Both keep, per linear ``x``, int32 tensors of eight 4-bit values each and fp16 scales:

- AWQ (AutoAWQ's GEMM layout, the one vLLM's ``awq`` reads): ``x.qweight`` [in, out / 8] and
  ``x.qzeros`` [in / G, out / 8], packed along the *output* dimension in AWQ's interleaved
  order: nibble i of a word holds column ``8 c + (0, 2, 4, 6, 1, 3, 5, 7)[i]``;
  ``x.scales`` [in / G, out]. The zeros are the zero points themselves.
- GPTQ (AutoGPTQ / GPTQModel): ``x.qweight`` [in / 8, out] packed along the *input* dimension
  in plain order (nibble i of row r holds input ``8 r + i``), ``x.qzeros`` [in / G, out / 8]
  plain order along the output, ``x.scales`` [in / G, out], ``x.g_idx`` [in] (the group of each
  input). The classic format (``checkpoint_format`` "gptq", AutoGPTQ) stores ``z - 1`` (its
  kernels add the 1 back); GPTQModel's "gptq_v2" stores ``z``.

Supported: 4 bits, groups that divide the input (any size; AWQ's own are 32/64/128), GPTQ
without act-order (``desc_act`` false and ``g_idx[i] == i // G``). Anything else is refused
at load with one line saying what is supported.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pagedllm.config import QUANTIZATION_METHODS
from pagedllm.errors import UnsupportedModelError, ValidationError

CHECKPOINT_METHODS = ("awq", "gptq")  # the quant_method values of config.json read here

_AWQ_ORDER = np.array([0, 2, 4, 6, 1, 3, 5, 7])  # nibble i holds column 8c + _AWQ_ORDER[i]
_SHIFTS = np.arange(8, dtype=np.uint32) * 4


@dataclass(frozen=True)
class CheckpointQuant:
    """A folder's ``quantization_config``, checked."""

    method: str        # "awq" or "gptq"
    group_size: int
    zeros_minus_one: bool  # GPTQ v1: the stored zeros are z - 1

    def unpack(self, name: str, tensors: dict[str, np.ndarray]) -> tuple[np.ndarray, ...]:
        """``(codes uint8 [out, in], scales float32 [out, in / G], offsets float32 [out,
        in / G])`` of linear ``name`` from its ``qweight``, ``qzeros``, ``scales`` (and GPTQ's
        ``g_idx``)."""
        qweight, qzeros, scales = (tensors[k] for k in ("qweight", "qzeros", "scales"))
        if self.method == "awq":
            codes = _unpack_columns(qweight, _AWQ_ORDER)            # [in, out]
            zeros = _unpack_columns(qzeros, _AWQ_ORDER)             # [in / G, out]
        else:
            codes = _unpack_rows(qweight)                           # [in, out]
            zeros = _unpack_columns(qzeros, np.arange(8))           # [in / G, out]
            _check_g_idx(name, tensors.get("g_idx"), codes.shape[0], self.group_size)
        in_features, out_features = codes.shape
        groups = in_features // self.group_size
        if in_features % self.group_size or scales.shape != (groups, out_features) \
                or zeros.shape != (groups, out_features):
            raise UnsupportedModelError(
                f"{name}: {self.method} tensors qweight {qweight.shape}, qzeros {qzeros.shape}, "
                f"scales {scales.shape} do not fit group size {self.group_size}")
        s = scales.astype(np.float32)
        z = zeros.astype(np.float32) + (1.0 if self.zeros_minus_one else 0.0)
        return (np.ascontiguousarray(codes.T), np.ascontiguousarray(s.T),
                np.ascontiguousarray((-z * s).T))


def _unpack_columns(packed: np.ndarray, order: np.ndarray) -> np.ndarray:
    """int32 [r, c / 8] -> uint8 [r, c]: nibble i of word j is column ``8 j + order[i]``."""
    words = packed.view(np.uint32)[:, :, None]                    # [r, c/8, 1]
    nibbles = ((words >> _SHIFTS) & 15).astype(np.uint8)         # [r, c/8, 8] by nibble
    out = np.empty_like(nibbles)
    out[:, :, order] = nibbles                                   # by column within the word
    return out.reshape(packed.shape[0], -1)


def _unpack_rows(packed: np.ndarray) -> np.ndarray:
    """int32 [r / 8, c] -> uint8 [r, c]: nibble i of row j is row ``8 j + i``."""
    words = packed.view(np.uint32)[:, None, :]                    # [r/8, 1, c]
    nibbles = ((words >> _SHIFTS[:, None]) & 15).astype(np.uint8)  # [r/8, 8, c]
    return nibbles.reshape(-1, packed.shape[1])


def _check_g_idx(name: str, g_idx: np.ndarray | None, in_features: int, group_size: int) -> None:
    if g_idx is None:
        return
    if not np.array_equal(g_idx.astype(np.int64), np.arange(in_features) // group_size):
        raise UnsupportedModelError(
            f"{name}: GPTQ act-order (desc_act, a permuted g_idx) is not supported; supported: "
            "GPTQ checkpoints quantized with desc_act=false")


def checkpoint_quant(config: dict) -> CheckpointQuant | None:
    """The folder's AWQ/GPTQ ``quantization_config`` checked, or None when it has none."""
    qc = config.get("quantization_config")
    if not qc:
        return None
    method = str(qc.get("quant_method", "")).lower()
    if method not in CHECKPOINT_METHODS:
        raise UnsupportedModelError(
            f"quantization_config quant_method {qc.get('quant_method')!r} is not supported; "
            f"supported checkpoint formats: {', '.join(CHECKPOINT_METHODS)}")
    bits = qc.get("bits", qc.get("w_bit"))
    if bits != 4:
        raise UnsupportedModelError(f"{method} with {bits} bits is not supported; "
                                    "supported: 4 bits")
    group_size = qc.get("group_size", qc.get("q_group_size"))
    if not isinstance(group_size, int) or group_size <= 0:
        raise UnsupportedModelError(f"{method} group_size {group_size!r} is not supported; "
                                    "supported: a positive group size (per-channel -1 is not)")
    if method == "awq":
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm" or qc.get("zero_point", True) is not True:
            raise UnsupportedModelError(
                f"AWQ version {version!r}, zero_point {qc.get('zero_point')!r} is not supported; "
                "supported: AutoAWQ's GEMM layout with zero points")
        return CheckpointQuant("awq", group_size, False)
    if qc.get("desc_act"):
        raise UnsupportedModelError("GPTQ act-order (desc_act=true) is not supported; supported: "
                                    "GPTQ checkpoints quantized with desc_act=false")
    fmt = str(qc.get("checkpoint_format", "gptq")).lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise UnsupportedModelError(f"GPTQ checkpoint_format {fmt!r} is not supported; "
                                    "supported: gptq, gptq_v2")
    return CheckpointQuant("gptq", group_size, fmt == "gptq")


def resolve_quantization(requested: str | None, config: dict | None, is_gguf: bool) -> str | None:
    """The quantization to load with: ``requested`` checked against what the checkpoint is
    (config.json's ``quantization_config``, or a .gguf path), or detected from it."""
    if requested is not None and requested not in QUANTIZATION_METHODS:
        raise ValidationError(f"quantization {requested!r} is not supported; supported: "
                              f"{', '.join(QUANTIZATION_METHODS)}", "quantization")
    found = "gguf" if is_gguf else None
    if config is not None and config.get("quantization_config"):
        method = str(config["quantization_config"].get("quant_method", "")).lower()
        # MXFP4 ships GPT-OSS's experts, which the model dequantizes at load (models/gpt_oss.py);
        # anything else is checked here, refusing what cannot be read first.
        found = "mxfp4" if method == "mxfp4" else checkpoint_quant(config).method
    if requested is None:
        return found
    if requested in ("q8_0", "q4_0"):
        if found is not None:
            raise ValidationError(f"quantization {requested} quantizes a full-precision checkpoint "
                                  f"at load; this one is already {found}", "quantization")
        return requested
    if requested != found:
        raise ValidationError(f"quantization {requested} does not match the checkpoint "
                              f"({found or 'not quantized'}); supported: "
                              f"{', '.join(QUANTIZATION_METHODS)}", "quantization")
    return requested
