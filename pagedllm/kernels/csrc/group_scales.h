// The scales (and offsets) of a block-quantized weight's groups, as quant_gemm.cpp's ops take
// them: one float per group of G consecutive k of each output column, ``value = code * scale
// (+ offset)``, held in the smallest of three forms that gives every float exactly
// (layers/quantization/quantized_weight.py chooses it at load):
//
//   dtype    shape                        a group's float
//   float32  [P, K / G, 64]               itself (AWQ/GPTQ's zero * scale, load-time quantization)
//   float16  [P, K / G, 64]               widened (GGUF's d of Q8_0, Q5_0, Q4_0 ...: an fp16)
//   uint8    [P, K / S, 64 x (2 + S / G)] super-block records: 64 fp16 d (one per column),
//                                         then S / G rows of 64 int8 multipliers, one row per
//                                         group: d times the group's multiplier
//
// The records are GGUF's K-quants as the file holds them: an fp16 d (and dmin) per super-block
// of S = 256 k and a 6-bit (Q4_K, Q5_K) or 8-bit (Q6_K) multiplier per group of 32 or 16.
// Against float32 per group they take a Q4_K weight from 6 to 4.6 bits, a Q6_K one held as q8
// from 10 to 8.6, and fp16 takes Q5_0 held as q5 from 6 to 5.5 (the file's size): fewer bytes
// to stream per token. Every form gives the float the float32 form held, bit for bit (d times
// an integer of at most 8 bits is exact in float32), so the kernels' results do not depend on
// the form.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <c10/util/Half.h>

#include "skinny_tiles.h"

namespace gscale {

using skinny::kPanel;
using skinny::kW;
using skinny::load;
using skinny::vfloat;

// kW fp16 / int8 values widened to floats.
#if defined(__AVX512F__)
inline vfloat widen_fp16(const uint16_t* h) {
  return (vfloat)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h)));
}
inline vfloat widen_i8(const int8_t* b) {
  return (vfloat)_mm512_cvtepi32_ps(
      _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b))));
}
#elif defined(__AVX2__) && defined(__F16C__)
inline vfloat widen_fp16(const uint16_t* h) {
  return (vfloat)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h)));
}
inline vfloat widen_i8(const int8_t* b) {
  return (vfloat)_mm256_cvtepi32_ps(
      _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b))));
}
#else  // any other CPU: element by element (correct, untuned)
inline vfloat widen_fp16(const uint16_t* h) {
  float out[kW];
  for (int64_t j = 0; j < kW; ++j) out[j] = c10::detail::fp16_ieee_to_fp32_value(h[j]);
  return load(out);
}
inline vfloat widen_i8(const int8_t* b) {
  float out[kW];
  for (int64_t j = 0; j < kW; ++j) out[j] = float(b[j]);
  return load(out);
}
#endif

enum class Form { f32, f16, records };

// One of a weight's scales or offsets (``data`` null: absent), for one weight; ``expert``
// steps to the next of a grouped op's stacked experts.
struct Values {
  const uint8_t* data = nullptr;
  Form form = Form::f32;
  int64_t num_groups = 0;  // K / G
  int per_super_log2 = 0;  // records: 2^this groups per super-block (S / G, a power of two:
                           // a shift, not a division, in the float step of every block)

  int64_t per_super() const { return int64_t(1) << per_super_log2; }
  int64_t record_bytes() const { return kPanel * (2 + per_super()); }
  int64_t panel_bytes() const {
    return form == Form::records ? (num_groups >> per_super_log2) * record_bytes()
                                 : num_groups * kPanel * (form == Form::f32 ? 4 : 2);
  }
  // Columns col..col + kW of group ``group`` of panel p.
  vfloat at(int64_t p, int64_t group, int64_t col) const {
    switch (form) {
      case Form::f32:
        return load(reinterpret_cast<const float*>(data) + (p * num_groups + group) * kPanel + col);
      case Form::f16:
        return widen_fp16(reinterpret_cast<const uint16_t*>(data) +
                          (p * num_groups + group) * kPanel + col);
      case Form::records:
      default: {
        const int64_t super = (p * num_groups + group) >> per_super_log2;
        const uint8_t* record = data + super * record_bytes();
        const int64_t row = group & (per_super() - 1);
        const auto* multipliers = reinterpret_cast<const int8_t*>(record + 2 * kPanel);
        return widen_fp16(reinterpret_cast<const uint16_t*>(record) + col) *
               widen_i8(multipliers + row * kPanel + col);
      }
    }
  }
  // Groups first..first + n of panel p as float32 [n][64] into ``out``: a record's d widened
  // once for all its groups.
  void decode(int64_t p, int64_t first, int64_t n, float* __restrict out) const {
    constexpr int kVecs = int(kPanel / kW);
    if (form != Form::records) {
      for (int64_t g = 0; g < n; ++g)
        for (int v = 0; v < kVecs; ++v)
          skinny::store(out + g * kPanel + v * kW, at(p, first + g, v * kW));
      return;
    }
    for (int64_t g = 0; g < n;) {
      const int64_t group = p * num_groups + first + g;
      const uint8_t* record = data + (group >> per_super_log2) * record_bytes();
      const auto* multipliers = reinterpret_cast<const int8_t*>(record + 2 * kPanel);
      vfloat d[kVecs];
      for (int v = 0; v < kVecs; ++v)
        d[v] = widen_fp16(reinterpret_cast<const uint16_t*>(record) + v * kW);
      for (int64_t row = group & (per_super() - 1); row < per_super() && g < n; ++row, ++g)
        for (int v = 0; v < kVecs; ++v)
          skinny::store(out + g * kPanel + v * kW,
                        d[v] * widen_i8(multipliers + row * kPanel + v * kW));
    }
  }
};

// The group floats of one panel's k block as float32 [groups][64] from group ``first``
// (Groups::block), read as Groups' are (``p``: that panel, the tiles' own index).
struct BlockGroups {
  const float* scales;
  const float* offsets;
  int64_t first;
  vfloat group_scale(int64_t, int64_t group, int64_t col) const {
    return load(scales + (group - first) * kPanel + col);
  }
  vfloat group_offset(int64_t, int64_t group, int64_t col) const {
    return load(offsets + (group - first) * kPanel + col);
  }
};

// A weight's groups: G, the scales and the optional offsets.
struct Groups {
  Values scales, offsets;
  int64_t group_size, num_groups;

  // The scale (offset) of k's group, columns col..col + kW of panel p.
  vfloat scale(int64_t p, int64_t k, int64_t col) const {
    return scales.at(p, k / group_size, col);
  }
  vfloat offset(int64_t p, int64_t k, int64_t col) const {
    return offsets.at(p, k / group_size, col);
  }
  vfloat group_scale(int64_t p, int64_t group, int64_t col) const {
    return scales.at(p, group, col);
  }
  vfloat group_offset(int64_t p, int64_t group, int64_t col) const {
    return offsets.at(p, group, col);
  }
  // Floats of ``buf`` that ``block`` needs for a k block of at most kl k: none where both
  // forms are float32.
  int64_t block_floats(int64_t kl) const {
    const bool f32 = scales.form == Form::f32 && (!offsets.data || offsets.form == Form::f32);
    return f32 ? 0 : 2 * ((kl + group_size - 1) / group_size + 1) * kPanel;
  }
  // k0..k0 + kl of panel p: the tensors' own floats where both are float32, else decoded into
  // ``buf`` (block_floats long) once for every tile over the block.
  BlockGroups block(int64_t p, int64_t k0, int64_t kl, float* buf) const {
    const int64_t first = k0 / group_size, n = (k0 + kl - 1) / group_size - first + 1;
    if (block_floats(kl) == 0) {
      const int64_t at = (p * num_groups + first) * kPanel;
      const auto* s = reinterpret_cast<const float*>(scales.data);
      const auto* o = reinterpret_cast<const float*>(offsets.data);
      return BlockGroups{s + at, o ? o + at : nullptr, first};
    }
    float* o = offsets.data ? buf + n * kPanel : nullptr;
    scales.decode(p, first, n, buf);
    if (o) offsets.decode(p, first, n, o);
    return BlockGroups{buf, o, first};
  }
  // Expert e's of a grouped op's stack of P-panel weights.
  Groups expert(int64_t e, int64_t P) const {
    Groups g = *this;
    g.scales.data += e * P * scales.panel_bytes();
    if (offsets.data) g.offsets.data += e * P * offsets.panel_bytes();
    return g;
  }
};

}  // namespace gscale
