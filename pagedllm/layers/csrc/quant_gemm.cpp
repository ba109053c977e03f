// y = x W^T for a layer whose weight is held in a format other than float32, in the panels of
// the float32 kernel (skinny_gemm.cpp, 64 output columns per panel, k along the panel), so the
// weights stay in the precision users ship and stream from memory at that size:
//
//   codes dtype  layout             value of W[p * 64 + c][k]
//   bfloat16     [P, K, 64]         the bf16 widened (its bits are a float's high half)
//   float16      [P, K, 64]         the fp16 widened (F16C's vcvtph2ps)
//   int8  (q8)   [P, K, 64]         code * scale (+ offset), per group of G k
//   uint8 (q4)   [P, K, 32]         code * scale (+ offset); byte j of a k holds column j in its
//                                   low nibble and column j + 32 in its high one
//
// scales (and the optional offsets) are float32 [P, K / G, 64]: one per group of G consecutive
// k of an output row (layers/quantization/ maps GGUF's block types and AWQ/GPTQ groups to these
// two layouts). Activations and sums are float32.
//
// How: each k block of a panel (64 k x 64 columns) is converted into a float32 block on the
// stack (16 KiB, in L1) and the float32 kernel's register tiles run over it unchanged, so every
// row tile of a chunk reuses one conversion; a single row (a decode step of one sequence)
// converts straight into registers instead (each value is used once). The arithmetic is the
// float32 kernel's on the converted weights: the same order of sums for every row count (a
// row's result does not depend on its batch), within float32 rounding of x times the
// dequantized weight (a value is code * scale + offset in one fused multiply-add, the same
// ``row`` function on both paths). A row is widened kW floats at a time with the level's
// intrinsics (v3: 8, v4: 16), the tiles are skinny_tiles.h's for the level.
// Measured (CPU time of one thread, cold caches, on a 2-core AMD EPYC Zen 3 VM busy with other
// work, so +-20%; 896x4864 and 2048x8192): against the float32 panels, q8 and q4 are 1.6-2.5x
// faster at 1 row, bf16/fp16 1.4-1.9x; 1.1-1.9x at 8 rows; 0.9-1.4x at 32-256 rows. At one row
// the conversion, not the memory stream, is the limit (q4 streams 3.3-4.5 GB/s of its bytes per
// thread, q8 5-8, float32 9-11).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "skinny_tiles.h"

namespace {

using skinny::kPanel;
using skinny::kRowVecs;
using skinny::kW;
using skinny::load;
using skinny::vfloat;

// kW codes widened to a vector of floats. Intrinsics, not __builtin_convertvector: GCC 12
// converts a byte vector to floats one element at a time (measured 3x slower at one row).
#if defined(__AVX512F__)
inline __m512i widen_u8(const uint8_t* c) {
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c)));
}
inline vfloat as_floats(__m512i i) { return (vfloat)_mm512_cvtepi32_ps(i); }
inline vfloat widen_i8(const int8_t* c) {
  return as_floats(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c))));
}
inline vfloat widen_nibbles(const uint8_t* c, bool high) {
  const __m512i b = widen_u8(c);
  return as_floats(high ? _mm512_srli_epi32(b, 4) : _mm512_and_si512(b, _mm512_set1_epi32(15)));
}
inline vfloat widen_bf16(const uint16_t* h) {
  const __m512i i = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h)));
  return (vfloat)_mm512_castsi512_ps(_mm512_slli_epi32(i, 16));
}
inline vfloat widen_fp16(const uint16_t* h) {
  return (vfloat)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h)));
}
#elif defined(__AVX2__) && defined(__F16C__)
inline __m256i widen_u8(const uint8_t* c) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(c)));
}
inline vfloat as_floats(__m256i i) { return (vfloat)_mm256_cvtepi32_ps(i); }
inline vfloat widen_i8(const int8_t* c) {
  return as_floats(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(c))));
}
inline vfloat widen_nibbles(const uint8_t* c, bool high) {
  const __m256i b = widen_u8(c);
  return as_floats(high ? _mm256_srli_epi32(b, 4) : _mm256_and_si256(b, _mm256_set1_epi32(15)));
}
inline vfloat widen_bf16(const uint16_t* h) {
  const __m256i i = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h)));
  return (vfloat)_mm256_castsi256_ps(_mm256_slli_epi32(i, 16));
}
inline vfloat widen_fp16(const uint16_t* h) {
  return (vfloat)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h)));
}
#else  // any other CPU: element by element (correct, untuned; the engine runs torch there)
template <class F>
inline vfloat widen(F f) {
  float out[kW];
  for (int64_t j = 0; j < kW; ++j) out[j] = f(j);
  return load(out);
}
inline vfloat widen_i8(const int8_t* c) { return widen([&](int64_t j) { return float(c[j]); }); }
inline vfloat widen_nibbles(const uint8_t* c, bool high) {
  return widen([&](int64_t j) { return float(high ? c[j] >> 4 : c[j] & 15); });
}
inline vfloat widen_bf16(const uint16_t* h) {
  return widen([&](int64_t j) {
    const uint32_t bits = uint32_t(h[j]) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
  });
}
inline vfloat widen_fp16(const uint16_t* h) {
  return widen([&](int64_t j) { return c10::detail::fp16_ieee_to_fp32_value(h[j]); });
}
#endif

// bf16 and fp16 panels [P, K, 64] of 16-bit values.
template <bool BF16>
struct HalfPanels {
  static constexpr bool kInPlace = false, kScaled = false, kOffset = false;
  static constexpr int64_t kRowBytes = kPanel * 2;
  const uint16_t* w;
  int64_t K;
  const char* row_bytes(int64_t p, int64_t k) const {
    return reinterpret_cast<const char*>(w + (p * K + k) * kPanel);
  }
  vfloat code(int64_t p, int64_t k, int v) const {
    const uint16_t* h = w + (p * K + k) * kPanel + v * kW;
    return BF16 ? widen_bf16(h) : widen_fp16(h);
  }
  const float* scale_row(int64_t, int64_t) const { return nullptr; }
  const float* offset_row(int64_t, int64_t) const { return nullptr; }
  int64_t group_size() const { return 1; }
};

// The groups' scales and offsets, float32 [P, K / G, 64] each (offsets may be absent).
struct Groups {
  const float* scales;
  const float* offsets;
  int64_t group_size, num_groups;
  int64_t row_of(int64_t p, int64_t k) const { return (p * num_groups + k / group_size) * kPanel; }
};

// q8: int8 codes [P, K, 64].
template <bool OFFSET>
struct Q8Panels {
  static constexpr bool kInPlace = false, kScaled = true, kOffset = OFFSET;
  static constexpr int64_t kRowBytes = kPanel;
  const int8_t* codes;
  int64_t K;
  Groups g;
  const char* row_bytes(int64_t p, int64_t k) const {
    return reinterpret_cast<const char*>(codes + (p * K + k) * kPanel);
  }
  vfloat code(int64_t p, int64_t k, int v) const { return widen_i8(codes + (p * K + k) * kPanel + v * kW); }
  const float* scale_row(int64_t p, int64_t k) const { return g.scales + g.row_of(p, k); }
  const float* offset_row(int64_t p, int64_t k) const { return g.offsets + g.row_of(p, k); }
  int64_t group_size() const { return g.group_size; }
};

// q4: two 4-bit codes per byte, [P, K, 32] (column j low, column j + 32 high).
template <bool OFFSET>
struct Q4Panels {
  static constexpr bool kInPlace = false, kScaled = true, kOffset = OFFSET;
  static constexpr int64_t kRowBytes = kPanel / 2;
  const uint8_t* codes;
  int64_t K;
  Groups g;
  const char* row_bytes(int64_t p, int64_t k) const {
    return reinterpret_cast<const char*>(codes + (p * K + k) * kRowBytes);
  }
  vfloat code(int64_t p, int64_t k, int v) const {
    const int64_t col = v * kW;  // columns col.. are the nibbles of bytes col % 32..
    return widen_nibbles(codes + (p * K + k) * kRowBytes + col % kRowBytes, col >= kRowBytes);
  }
  const float* scale_row(int64_t p, int64_t k) const { return g.scales + g.row_of(p, k); }
  const float* offset_row(int64_t p, int64_t k) const { return g.offsets + g.row_of(p, k); }
  int64_t group_size() const { return g.group_size; }
};

Groups check_groups(const at::Tensor& codes, const std::optional<at::Tensor>& scales,
                    const std::optional<at::Tensor>& offsets, int64_t group_size) {
  const int64_t P = codes.size(0), K = codes.size(1);
  TORCH_CHECK(scales.has_value(), "q8/q4 codes need scales");
  TORCH_CHECK(group_size > 0 && K % group_size == 0, "group_size ", group_size,
              " must divide in_features ", K);
  const int64_t G = K / group_size;
  const std::vector<int64_t> shape{P, G, kPanel};
  TORCH_CHECK(scales->scalar_type() == at::kFloat && scales->is_contiguous() &&
                  scales->sizes() == at::IntArrayRef(shape),
              "scales must be a contiguous float32 [P, in / group_size, 64] tensor");
  if (offsets) {
    TORCH_CHECK(offsets->scalar_type() == at::kFloat && offsets->is_contiguous() &&
                    offsets->sizes() == at::IntArrayRef(shape),
                "offsets must be a contiguous float32 tensor shaped like scales");
  }
  return Groups{scales->data_ptr<float>(), offsets ? offsets->data_ptr<float>() : nullptr,
                group_size, G};
}

// x [M, K] float32 times the weight held as ``codes`` (+ scales, offsets): [M, N] float32.
at::Tensor quant_gemm(const at::Tensor& x, const at::Tensor& codes,
                      const std::optional<at::Tensor>& scales,
                      const std::optional<at::Tensor>& offsets, int64_t group_size,
                      int64_t out_features) {
  const auto dtype = codes.scalar_type();
  const skinny::PanelCall call =
      skinny::begin_panel_call(x, codes, dtype == at::kByte ? kPanel / 2 : kPanel, out_features);
  if (call.done) return call.y;
  const int64_t M = call.M, K = call.K, N = call.N, P = call.P;
  const float* xp = call.x.data_ptr<float>();
  float* yp = call.y.data_ptr<float>();
  const void* cp = codes.data_ptr();
  switch (dtype) {
    case at::kBFloat16:
      skinny::panels_gemm(xp, M, K, HalfPanels<true>{static_cast<const uint16_t*>(cp), K}, N, P, yp);
      break;
    case at::kHalf:
      skinny::panels_gemm(xp, M, K, HalfPanels<false>{static_cast<const uint16_t*>(cp), K}, N, P, yp);
      break;
    case at::kChar: {
      const Groups g = check_groups(codes, scales, offsets, group_size);
      const auto* c = static_cast<const int8_t*>(cp);
      if (offsets)
        skinny::panels_gemm(xp, M, K, Q8Panels<true>{c, K, g}, N, P, yp);
      else
        skinny::panels_gemm(xp, M, K, Q8Panels<false>{c, K, g}, N, P, yp);
      break;
    }
    case at::kByte: {
      const Groups g = check_groups(codes, scales, offsets, group_size);
      const auto* c = static_cast<const uint8_t*>(cp);
      if (offsets)
        skinny::panels_gemm(xp, M, K, Q4Panels<true>{c, K, g}, N, P, yp);
      else
        skinny::panels_gemm(xp, M, K, Q4Panels<false>{c, K, g}, N, P, yp);
      break;
    }
    default:
      TORCH_CHECK(false, "codes of dtype ", dtype, " are not a weight format (bfloat16, float16, "
                  "int8 q8, uint8 q4)");
  }
  return call.y;
}

// x W^T (+ bias) for x of any number of leading dims (flattened to rows), like packed_linear.
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& codes,
                        const std::optional<at::Tensor>& scales,
                        const std::optional<at::Tensor>& offsets, int64_t group_size,
                        int64_t out_features, const std::optional<at::Tensor>& bias) {
  return skinny::linear_over_rows(x, out_features, bias, [&](const at::Tensor& rows) {
    return quant_gemm(rows, codes, scales, offsets, group_size, out_features);
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(PAGEDLLM_NS, m) {
  m.def("quant_linear(Tensor x, Tensor codes, Tensor? scales, Tensor? offsets, int group_size, "
        "int out_features, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(PAGEDLLM_NS, CPU, m) { m.impl("quant_linear", &quant_linear); }
