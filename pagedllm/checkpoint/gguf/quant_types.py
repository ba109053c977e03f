"""GGUF (ggml) tensor types -> the group formats of pagedllm's quantized linears.

Every block type a Q4_K_M, Q4_0 or Q8_0 file of the supported architectures holds is, after
unpacking its bit fields, small integer codes with one float scale (and for some one float
offset) per group of G consecutive input elements of a row: ``value = code * scale + offset``.

    type   block            pagedllm format             scale          offset
    Q8_0   32 x int8        q8  G=32  codes -128..127   d              none
    Q4_0   32 x 4 bit       q4  G=32  codes 0..15       d              -8 d
    Q4_1   32 x 4 bit       q4  G=32  codes 0..15       d              m
    Q5_0   32 x 5 bit       q5  G=32  codes -16..15     d              none
    Q5_1   32 x 5 bit       q8  G=32  codes 0..31       d              m
    Q4_K   256 = 8 x 32     q4  G=32  codes 0..15       d * sc[j]      -dmin * m[j]
    Q5_K   256 = 8 x 32     q8  G=32  codes 0..31       d * sc[j]      -dmin * m[j]
    Q6_K   256 = 16 x 16    q6  G=16  codes -32..31     d * sc[j]      none

The K-quants' scales and offsets stay as the file holds them, an fp16 per super-block times an
integer per group (``GroupScales``; the kernels keep them so), the others are the file's fp16.
The products are exact in float32 (an fp16 times an integer of at most 8 bits), so ``code *
scale + offset`` in float32 is bit for bit what ggml's (and the ``gguf`` package's)
dequantization computes. F32, F16 and BF16 stay plain arrays.

All unpacking is vectorised numpy over whole tensors (no Python loop per block).
"""
from __future__ import annotations

import numpy as np

# the unpacked form, shared with the AWQ/GPTQ loaders (layers/quantization/)
from pagedllm.checkpoint.quantized_layers import GroupQuant
from pagedllm.layers.quantization.quantized_weight import GroupScales

# ggml type ids (ggml.h's enum ggml_type), the ones pagedllm reads.
F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, BF16 = 0, 1, 2, 3, 6, 7, 8, 12, 13, 14, 30

# type id -> (name, elements per block, bytes per block)
TYPE_INFO: dict[int, tuple[str, int, int]] = {
    F32: ("F32", 1, 4), F16: ("F16", 1, 2), BF16: ("BF16", 1, 2),
    Q8_0: ("Q8_0", 32, 34), Q4_0: ("Q4_0", 32, 18), Q4_1: ("Q4_1", 32, 20),
    Q5_0: ("Q5_0", 32, 22), Q5_1: ("Q5_1", 32, 24),
    Q4_K: ("Q4_K", 256, 144), Q5_K: ("Q5_K", 256, 176), Q6_K: ("Q6_K", 256, 210),
}
FLOAT_TYPES = frozenset({F32, F16, BF16})


def type_name(type_id: int) -> str:
    return TYPE_INFO[type_id][0] if type_id in TYPE_INFO else f"type {type_id}"


def supported_type_names() -> list[str]:
    return [info[0] for info in TYPE_INFO.values()]


def unpack(type_id: int, data: np.ndarray, shape: tuple[int, ...]) -> GroupQuant | np.ndarray:
    """The tensor of ``shape`` (numpy order: ``[rows, cols]`` for a matrix, ``[n]`` for a
    vector), stored as ggml type ``type_id`` in ``data`` (the file's bytes or elements): a
    GroupQuant for block types (matrices only), a float32/float16 array for float types."""
    if type_id in FLOAT_TYPES:
        return _float(type_id, data, shape)
    if len(shape) != 2:
        raise ValueError(f"a {type_name(type_id)} tensor must be a matrix, got shape {shape}")
    rows, cols = shape
    _, block, size = TYPE_INFO[type_id]
    if cols % block:
        raise ValueError(f"{type_name(type_id)} rows of {cols} elements are not whole blocks of {block}")
    # [rows * blocks per row, bytes per block]: the blocks of a row are consecutive
    blocks = np.ascontiguousarray(data).view(np.uint8).reshape(rows * (cols // block), size)
    kind, codes, scales, offsets, group = _UNPACKERS[type_id](blocks)
    return GroupQuant(kind, codes.reshape(rows, cols), _by_rows(scales, rows),
                      None if offsets is None else _by_rows(offsets, rows), group)


def _by_rows(values: np.ndarray | GroupScales, rows: int) -> GroupScales:
    """A block type's group floats, [blocks, per block] (plain or GroupScales), as [rows, ...]."""
    if not isinstance(values, GroupScales):
        return GroupScales(values.reshape(rows, -1))
    return GroupScales(values.d.reshape(rows, -1), values.multipliers.reshape(rows, -1))


def _float(type_id: int, data: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    raw = np.ascontiguousarray(data)
    if type_id == F32:
        return raw.view(np.float32).reshape(shape)
    if type_id == F16:
        return raw.view(np.float16).reshape(shape)
    # bf16 is the high half of a float32: widen by shifting its bits up
    return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(shape)


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The fp16 at byte ``start`` of every block, ``[n, 1]``."""
    return blocks[:, start:start + 2].copy().view(np.float16)


def _nibbles(packed: np.ndarray, width: int) -> np.ndarray:
    """``[n, k * width]`` bytes -> ``[n, k, 2, width]``: each run of ``width`` bytes gives
    ``width`` low nibbles, then ``width`` high nibbles (ggml's order for 4-bit codes)."""
    n = packed.shape[0]
    runs = packed.reshape(n, -1, 1, width)
    return np.concatenate((runs & 0x0F, runs >> 4), axis=2)


def _q8_0(blocks):
    d = _f16(blocks, 0)
    return "q8", blocks[:, 2:].view(np.int8), d, None, 32


def _q4_0(blocks):
    d = _f16(blocks, 0)
    codes = _nibbles(blocks[:, 2:], 16)
    return "q4", codes, d, d.astype(np.float32) * np.float32(-8), 32


def _q4_1(blocks):
    d, m = _f16(blocks, 0), _f16(blocks, 2)
    return "q4", _nibbles(blocks[:, 4:], 16), d, m, 32


def _five_bit(blocks, start: int) -> np.ndarray:
    """Q5_0/Q5_1 codes 0..31: 4 bytes of fifth bits at ``start`` (bit j of the little-endian
    word belongs to element j), then 16 bytes of low nibbles (elements 0-15 low, 16-31 high)."""
    low = _nibbles(blocks[:, start + 4:start + 20], 16).reshape(-1, 32)
    high = np.unpackbits(blocks[:, start:start + 4], axis=1, bitorder="little")
    return (low | (high << 4)).astype(np.int8)


def _q5_0(blocks):
    # The offset -16 d is the scale's: fold it into signed codes, and the layer needs no
    # offsets (4 fewer bytes per 32 weights, and no offset term in the kernels).
    d = _f16(blocks, 0)
    return "q5", _five_bit(blocks, 2) - np.int8(16), d, None, 32


def _q5_1(blocks):
    d, m = _f16(blocks, 0), _f16(blocks, 2)
    return "q8", _five_bit(blocks, 4), d, m, 32


def _k_scales_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8 six-bit scales and 8 six-bit mins of a Q4_K/Q5_K super-block from its 12 bytes:
    bytes 0-3 hold scales 0-3 (low 6 bits) and the top 2 bits of scales 4-7; bytes 4-7 the same
    for the mins; bytes 8-11 the low 4 bits of scales 4-7 (low nibble) and mins 4-7 (high)."""
    first, second, low = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scales = np.concatenate((first & 0x3F, (low & 0x0F) | ((first >> 6) << 4)), axis=1)
    mins = np.concatenate((second & 0x3F, (low >> 4) | ((second >> 6) << 4)), axis=1)
    return scales.astype(np.int8), mins.astype(np.int8)  # 0..63


def _k_scale_offset(blocks):
    """Scales d * sc[j] and offsets -dmin * m[j] of a Q4_K/Q5_K super-block, as the file holds
    them (an fp16 and eight 6-bit multipliers each)."""
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    sc, m = _k_scales_mins(blocks[:, 4:16])
    return GroupScales(d, sc), GroupScales(-dmin, m)


def _q4_k(blocks):
    scales, offsets = _k_scale_offset(blocks)
    # 128 bytes: four runs of 32, each sub-blocks 2j (low nibbles) and 2j + 1 (high)
    codes = _nibbles(blocks[:, 16:144], 32)
    return "q4", codes, scales, offsets, 32


def _q5_k(blocks):
    scales, offsets = _k_scale_offset(blocks)
    n = blocks.shape[0]
    low = _nibbles(blocks[:, 48:176], 32).reshape(n, 8, 32)
    # qh[l] bit j is the fifth bit of element l of sub-block j
    high = (blocks[:, None, 16:48] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1
    codes = (low | (high << 4)).astype(np.int8)
    return "q8", codes, scales, offsets, 32


def _q6_k(blocks):
    n = blocks.shape[0]
    scales = GroupScales(_f16(blocks, 208), blocks[:, 192:208].view(np.int8).copy())  # d * sc[j]
    # Two halves of 128 elements; a half has 64 bytes of low nibbles (runs of 32: elements
    # 0-31 and 32-63 low nibbles, 64-95 and 96-127 high) and 32 bytes of 2-bit pairs.
    low = blocks[:, 0:128].reshape(n, 2, 1, 64)
    low = np.concatenate((low & 0x0F, low >> 4), axis=2).reshape(n, 2, 4, 32)
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8)[None, None, :, None]
    high = blocks[:, 128:192].reshape(n, 2, 1, 32) >> shifts  # [n, 2, 4, 32]
    codes = ((low | ((high & 3) << 4)).astype(np.int16) - 32).astype(np.int8)
    return "q6", codes, scales, None, 16


_UNPACKERS = {Q8_0: _q8_0, Q4_0: _q4_0, Q4_1: _q4_1, Q5_0: _q5_0, Q5_1: _q5_1, Q4_K: _q4_k,
               Q5_K: _q5_k, Q6_K: _q6_k}
