// The q8/q4/q5/q6 panels times activations quantized to int8 (llama.cpp's strategy for its
// quantized matmuls; the float path is quant_gemm.cpp's, on the same panels). Why a second path: with
// float32 activations every code is widened to a float before its multiply-add, and at a few
// rows that conversion, not the memory stream, bounds the kernel. Here each x row is quantized
// once per call, and a column's codes meet it in integer dot products of 4 k at a time, the
// codes used as they lie in memory:
//
//   q8 quad block [64 columns][4 k] int8: one vector = kW columns x 4 k;
//   q4 quad block [32 bytes][4 k]: byte (j, i) holds column j, k = 4q + i in its low nibble and
//   column j + 32 in its high one, so one vector gives the low columns j.. and the high j + 32..
//   q5 quad block: q4's, then 32 bytes of fifth bits (quant_gemm.cpp's HighBitPanels), which
//   q5_codes ORs onto each nibble: one vector of bytes b = code + 16 (0..31); q6 alike, with
//   64 bytes of bit pairs: b = code + 32 (0..63).
//
// AVX2: _mm256_maddubs_epi16 (unsigned x signed bytes, pairs summed to int16) then
// _mm256_madd_epi16 by ones (the two pairs to int32); AVX-512: the same on 512 bits, or one
// _mm512_dpbusd_epi32 with VNNI. maddubs wants one unsigned operand: q4 codes are (0..15), q5's
// enter as b = code + 16 (0..31; the block's sum then owes 16 x the sum of its x, taken off in
// the float step), q6's as code + 32; q8 codes are signed: they enter as |w| with w's sign
// moved onto x (llama.cpp's sign trick), or, in the many-row tiles with VNNI, as code + 128
// (one xor of the sign bits per weight vector, where the sign trick costs an op per row and
// vector; without VNNI code + 128 would saturate maddubs's int16 pairs; the faster many-row q8
// kernel: docs/cpu_kernels.md#int8-tiles). Nothing saturates: x is in
// -127..127 (never -128, so its negation fits); q8's pair sums are at most 2 x 128 x 127 =
// 32512, q5's 2 x 31 x 127, q6's 2 x 63 x 127, all widened per quad, and q4 sums its pairs in
// int16 over a block of at most 8 quads (8 x 2 x 15 x 127 = 30480) before widening them once;
// dpbusd sums four products straight into int32.
//
// Activation blocks: x is quantized per row in blocks of B k, B = 32 where the weight's group
// size G is a multiple of 32 (Q8_0, Q4_0/1, Q4_K, Q5_K, AWQ/GPTQ's 64/128), else the largest of
// 16/8/4 dividing G (Q6_K: 16). B divides G, so a block's integer sum has one weight scale per
// column and the float step is one multiply-add per block: y += S * (w_scale * x_scale) +
// offset * (x_scale * sum of the block's codes), the offset being q4's mins / Q4_0's -8d / AWQ's
// zeros (q5 also takes off w_scale * 16 * that sum, q6 32 times it). Not per weight group:
// blocks of 128 (AWQ) would give one outlier 128 activations' worth of lost precision; not per
// row: worse still. A
// block's scale is amax / 127, its codes round(x / scale) (half to even):
// tests/models/test_int8_activations.py rebuilds them.
//
// Threads: ``panels_gemm`` gives each a run of panels, ``panels_run`` being one thread's share;
// quant_gemm.cpp's grouped op (a mixture-of-experts layer's experts) quantizes x's rows once
// and runs each expert's rows through ``panels_run`` over the ranges of
// skinny::split_grouped_panels, the float tiles' cost-split walk.
//
// A row's result does not depend on its batch: its quantization reads only that row, its
// integer sums are exact and its float steps run per block in k order whatever tile holds it.
// It differs from the float path's by the activations' rounding: at most scale / 2 per
// activation, so |dy| <= sum over blocks of (amax_b / 254) * sum_(k in b) |w_k| (plus float32
// rounding).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "group_scales.h"
#include "skinny_tiles.h"

namespace int8gemm {

using skinny::kPanel;
using skinny::kW;
using skinny::load;
using skinny::store;
using skinny::vfloat;

#if defined(__AVX512F__) && defined(__AVX512BW__)
constexpr bool kAvailable = true;
using ivec = __m512i;
inline ivec iload(const void* p) { return _mm512_loadu_si512(p); }
inline ivec bcast(int32_t v) { return _mm512_set1_epi32(v); }
inline ivec izero() { return _mm512_setzero_si512(); }
inline ivec low_nibbles(ivec b) { return _mm512_and_si512(b, _mm512_set1_epi8(15)); }
inline ivec high_nibbles(ivec b) {
  return _mm512_and_si512(_mm512_srli_epi16(b, 4), _mm512_set1_epi8(15));
}
inline ivec abs8(ivec w) { return _mm512_abs_epi8(w); }
inline ivec plus128(ivec w) { return _mm512_xor_si512(w, _mm512_set1_epi8(-128)); }
// x where w >= 0, -x where w < 0 (AVX-512 has no vpsignb; w == 0 meets |w| = 0 anyway)
inline ivec sign8(ivec x, ivec w) {
  return _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(w), _mm512_setzero_si512(), x);
}
inline ivec add16(ivec a, ivec b) { return _mm512_add_epi16(a, b); }
inline ivec add32(ivec a, ivec b) { return _mm512_add_epi32(a, b); }
inline ivec sub32(ivec a, ivec b) { return _mm512_sub_epi32(a, b); }
inline ivec pairs(ivec u, ivec s) { return _mm512_maddubs_epi16(u, s); }
inline ivec widen_pairs(ivec p) { return _mm512_madd_epi16(p, _mm512_set1_epi16(1)); }
inline vfloat to_floats(ivec i) { return (vfloat)_mm512_cvtepi32_ps(i); }
// q5: the quad block's 32 plane bytes in both 256-bit halves, the upper one shifted 2 bits
// right: a vector of 16 columns' fifth bits (the upper 8 lanes' 2 bits higher in the plane)
// then lie at one bit position in every byte.
inline ivec q5_plane(const uint8_t* plane) {
  const __m256i p = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(plane));
  return _mm512_inserti64x4(_mm512_castsi256_si512(p), _mm256_srli_epi16(p, 2), 1);
}
// Bytes b = code + 16 (0..31) of a q5 vector: nibble ``h`` (0 low, 1 high) of each byte at
// ``nib``, its fifth bit from bit ``t`` of the plane's byte.
inline ivec q5_codes(const uint8_t* nib, ivec plane, int t, int h) {
  ivec w = iload(nib);
  if (h) w = _mm512_srli_epi16(w, 4);
  const ivec fifth = t >= 4 ? _mm512_srl_epi16(plane, _mm_cvtsi32_si128(t - 4))
                            : _mm512_sll_epi16(plane, _mm_cvtsi32_si128(4 - t));
  return _mm512_or_si512(_mm512_and_si512(w, _mm512_set1_epi8(15)),
                         _mm512_and_si512(fifth, _mm512_set1_epi8(16)));
}
// Bytes b = code + 32 (0..63) of a q6 vector: nibble ``h`` of each byte at ``nib``, its two
// high bits from bits s, s + 1 of the plane's bytes at ``plane`` (quant_gemm.cpp's HighBitPanels).
inline ivec q6_codes(const uint8_t* nib, const uint8_t* plane, int s, int h) {
  ivec w = iload(nib);
  if (h) w = _mm512_srli_epi16(w, 4);
  const ivec p = iload(plane);
  const ivec high = s >= 4 ? _mm512_srl_epi16(p, _mm_cvtsi32_si128(s - 4))
                           : _mm512_sll_epi16(p, _mm_cvtsi32_si128(4 - s));
  return _mm512_or_si512(_mm512_and_si512(w, _mm512_set1_epi8(15)),
                         _mm512_and_si512(high, _mm512_set1_epi8(0x30)));
}
#if defined(__AVX512VNNI__)
constexpr bool kVnni = true;
inline ivec dpbusd(ivec acc, ivec u, ivec s) { return _mm512_dpbusd_epi32(acc, u, s); }
#endif
#elif defined(__AVX2__)
constexpr bool kAvailable = true;
using ivec = __m256i;
inline ivec iload(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
inline ivec bcast(int32_t v) { return _mm256_set1_epi32(v); }
inline ivec izero() { return _mm256_setzero_si256(); }
inline ivec low_nibbles(ivec b) { return _mm256_and_si256(b, _mm256_set1_epi8(15)); }
inline ivec high_nibbles(ivec b) {
  return _mm256_and_si256(_mm256_srli_epi16(b, 4), _mm256_set1_epi8(15));
}
inline ivec abs8(ivec w) { return _mm256_abs_epi8(w); }
inline ivec plus128(ivec w) { return _mm256_xor_si256(w, _mm256_set1_epi8(-128)); }
inline ivec sign8(ivec x, ivec w) { return _mm256_sign_epi8(x, w); }
inline ivec add16(ivec a, ivec b) { return _mm256_add_epi16(a, b); }
inline ivec add32(ivec a, ivec b) { return _mm256_add_epi32(a, b); }
inline ivec sub32(ivec a, ivec b) { return _mm256_sub_epi32(a, b); }
inline ivec pairs(ivec u, ivec s) { return _mm256_maddubs_epi16(u, s); }
inline ivec widen_pairs(ivec p) { return _mm256_madd_epi16(p, _mm256_set1_epi16(1)); }
inline vfloat to_floats(ivec i) { return (vfloat)_mm256_cvtepi32_ps(i); }
inline ivec q5_plane(const uint8_t* plane) { return iload(plane); }
inline ivec q5_codes(const uint8_t* nib, ivec plane, int t, int h) {
  ivec w = iload(nib);
  if (h) w = _mm256_srli_epi16(w, 4);
  const ivec fifth = t >= 4 ? _mm256_srl_epi16(plane, _mm_cvtsi32_si128(t - 4))
                            : _mm256_sll_epi16(plane, _mm_cvtsi32_si128(4 - t));
  return _mm256_or_si256(_mm256_and_si256(w, _mm256_set1_epi8(15)),
                         _mm256_and_si256(fifth, _mm256_set1_epi8(16)));
}
inline ivec q6_codes(const uint8_t* nib, const uint8_t* plane, int s, int h) {
  ivec w = iload(nib);
  if (h) w = _mm256_srli_epi16(w, 4);
  const ivec p = iload(plane);
  const ivec high = s >= 4 ? _mm256_srl_epi16(p, _mm_cvtsi32_si128(s - 4))
                           : _mm256_sll_epi16(p, _mm_cvtsi32_si128(4 - s));
  return _mm256_or_si256(_mm256_and_si256(w, _mm256_set1_epi8(15)),
                         _mm256_and_si256(high, _mm256_set1_epi8(0x30)));
}
#else
// Any other CPU: no int8 path (quant_gemm.cpp runs the float one; the engine uses torch there).
constexpr bool kAvailable = false;
#endif

#if !defined(__AVX512VNNI__) || !defined(__AVX512F__)
constexpr bool kVnni = false;
#endif

// The code layouts of quad blocks (quant_gemm.cpp's table): which the kernels' templates read.
enum class Codes { q8, q4, q5, q6 };
template <Codes C>
constexpr int64_t kQuadBytes = C == Codes::q8   ? kPanel * 4
                               : C == Codes::q4 ? kPanel * 2
                               : C == Codes::q5 ? kPanel * 5 / 2
                                                : kPanel * 3;
// q6: a vector of nibble bytes from byte o of the quad's 128 (o a multiple of kW x 4, so
// within one half of 64) finds its high bits at byte o % 64 of the plane, bits s, s + 1.
inline int q6_shift(int64_t o, int h) { return int(2 * (2 * (o / 64) + h)); }

// x's rows quantized: codes q [M, K], per block of B k a scale and the sum of its codes.
struct QuantizedRows {
  std::vector<int8_t> q;
  std::vector<float> scale;
  std::vector<int32_t> code_sum;
  int64_t K, B, num_blocks;
};

// B for a weight group size G (a multiple of 4): see the top of this file.
inline int64_t block_size(int64_t group_size) {
  for (int64_t b : {32, 16, 8, 4})
    if (group_size % b == 0) return b;
  return 0;
}

// A block of x's B k: the largest |x|, and its codes q = round(x * id) clamped to -127..127
// with their sum. Vector code where B is a multiple of the vector width (every group size but
// the odd 4 and 8), the scalar loop's numbers exactly: the convert rounds half to even as
// nearbyint does, and the max ignores a NaN as std::max does (NaN as the first operand).
// Vector code since the scalar loops were a visible share of a batch-1 MoE decode step
// (docs/cpu_kernels.md#int8-tiles).
inline float block_amax(const float* xb, int64_t B) {
#if defined(__AVX512F__)
  if (B % 16 == 0) {
    __m512 m = _mm512_setzero_ps();
    for (int64_t k = 0; k < B; k += 16) m = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(xb + k)), m);
    return _mm512_reduce_max_ps(m);
  }
#elif defined(__AVX2__)
  if (B % 8 == 0) {
    const __m256 sign = _mm256_set1_ps(-0.f);
    __m256 m = _mm256_setzero_ps();
    for (int64_t k = 0; k < B; k += 8)
      m = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(xb + k)), m);
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
  }
#endif
  float amax = 0.f;
  for (int64_t k = 0; k < B; ++k) amax = std::max(amax, std::fabs(xb[k]));
  return amax;
}

inline int32_t quantize_block(const float* xb, int64_t B, float id, int8_t* q) {
#if defined(__AVX512F__)
  if (B % 16 == 0) {
    const __m512 scale = _mm512_set1_ps(id);
    const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
    __m512i sum = _mm512_setzero_si512();
    for (int64_t k = 0; k < B; k += 16) {
      __m512i c = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xb + k), scale));
      c = _mm512_max_epi32(_mm512_min_epi32(c, hi), lo);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + k), _mm512_cvtepi32_epi8(c));
      sum = _mm512_add_epi32(sum, c);
    }
    return _mm512_reduce_add_epi32(sum);
  }
#elif defined(__AVX2__)
  if (B % 8 == 0) {
    const __m256 scale = _mm256_set1_ps(id);
    const __m256i lo = _mm256_set1_epi32(-127), hi = _mm256_set1_epi32(127);
    __m256i sum = _mm256_setzero_si256();
    for (int64_t k = 0; k < B; k += 8) {
      __m256i c = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + k), scale));
      c = _mm256_max_epi32(_mm256_min_epi32(c, hi), lo);
      const __m128i c16 = _mm_packs_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1));
      _mm_storel_epi64(reinterpret_cast<__m128i*>(q + k), _mm_packs_epi16(c16, c16));
      sum = _mm256_add_epi32(sum, c);
    }
    __m128i h = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4e));
    return _mm_cvtsi128_si32(_mm_add_epi32(h, _mm_shuffle_epi32(h, 0xb1)));
  }
#endif
  int32_t sum = 0;
  for (int64_t k = 0; k < B; ++k) {
    const float v = std::clamp(std::nearbyint(xb[k] * id), -127.f, 127.f);
    q[k] = static_cast<int8_t>(v);
    sum += static_cast<int32_t>(v);
  }
  return sum;
}

inline QuantizedRows quantize_rows(const float* x, int64_t M, int64_t K, int64_t B) {
  QuantizedRows r{std::vector<int8_t>(M * K), std::vector<float>(M * (K / B)),
                  std::vector<int32_t>(M * (K / B)), K, B, K / B};
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m)
      for (int64_t b = 0; b < r.num_blocks; ++b) {
        const float* xb = x + m * K + b * B;
        const float d = block_amax(xb, B) / 127.f, id = d != 0.f ? 1.f / d : 0.f;
        const int32_t sum = quantize_block(xb, B, id, r.q.data() + m * K + b * B);
        r.scale[m * r.num_blocks + b] = d;
        r.code_sum[m * r.num_blocks + b] = sum;
      }
  });
  return r;
}

#if defined(__AVX2__) || defined(__AVX512F__)

// Output columns in "units": unit u is one code vector of a quad block for q4 (its low nibbles
// columns u * kW.., its high ones 32 + u * kW..), two for q8 (the same columns); kUnits of them
// cover a panel.
constexpr int kUnits = int(kPanel / 2 / kW);
// Tiles (R rows x U units = 2RU accumulators): one row takes the whole panel row; more rows go
// 4 at a time over U units (AVX2: 8 accumulators + 2 code vectors + |codes|; AVX-512: 16).
#if defined(__AVX512F__)
constexpr int kManyR = 4, kManyU = 2;
#else
constexpr int kManyR = 4, kManyU = 1;
#endif
// One row goes over two panels at once where their accumulators (2 x kUnits x 2) fit in 8
// registers: AVX-512 (see panels_run).
constexpr bool kRowInPairs = 2 * kUnits * 2 <= 8;
constexpr int64_t kBlockK = 256;       // k per block: its codes (<= 16 KiB) stay in L1 across tiles
constexpr int64_t kChunkRows = 64;     // rows per chunk: their codes stay in L2 across panels
constexpr int64_t kPrefetchQuads = 16; // the first tile prefetches the stream this far ahead

// Whether a call's tiles prefetch its weight streams (one row's tile; of more rows, the first
// tile of each block). Not q8 codes on AMD CPUs: a q8 byte is one dot product, the least work a
// byte of any format, and on AMD Zen 4 the hardware prefetchers alone kept up, where the
// software prefetches slowed every q8 tile; q4, q5 and q6 codes lost nothing to them. On
// Sapphire Rapids the prefetches are what made the one-row pairs pay (panels_run; the figures:
// docs/cpu_kernels.md#int8-tiles).
template <Codes C>
inline bool prefetches() {
  static const bool amd = __builtin_cpu_is("amd");
  return C != Codes::q8 || !amd;
}


// The weight: codes [P, K / 4, quad bytes] (q8: 256, q4: 128, q5: 160, q6: 192), its groups'
// scales and offsets in any of group_scales.h's forms.
struct Panels {
  const uint8_t* codes;
  gscale::Groups g;
  int64_t K4;
};

// acc += per column, the dot product of its 4 codes (unsigned bytes u) with x's 4 (signed s).
template <Codes C>
inline ivec dot(ivec acc, ivec u, ivec s) {
  if constexpr (kVnni) {
#if defined(__AVX512VNNI__) && defined(__AVX512F__)
    return dpbusd(acc, u, s);
#endif
  } else if constexpr (C == Codes::q4) {
    return add16(acc, pairs(u, s));
  } else {
    return add32(acc, widen_pairs(pairs(u, s)));
  }
}
template <Codes C>
inline ivec finish(ivec acc) {
  if constexpr (C == Codes::q4 && !kVnni) return widen_pairs(acc);
  return acc;
}

// c_j[R rows][columns of units u0..u0+U) += rows m.. of x times panel p + j's k in
// [k0, k0 + kl), block by block (kl a multiple of B), for NP neighbouring panels j at once
// (c_j = c + j * c_stride): two panels are two weight streams, as the float tiles' pairs
// (skinny_tiles.h). Each column's integer sums and float steps are the same whatever NP.
// ``gf`` gives the groups' scales and offsets (group_scale / group_offset): the weight's own
// gscale::Groups, or a block of them decoded for the many-row tiles (gscale::BlockGroups).
template <Codes C, bool OFFSET, int R, int U, int NP = 1, class GroupFloats>
inline void tile(const Panels& w, const GroupFloats& gf, const QuantizedRows& x, int64_t m,
                 int64_t p, int u0, int64_t k0, int64_t kl, float* __restrict c, bool prefetch,
                 int64_t c_stride = 0) {
  constexpr int64_t kBytes = kQuadBytes<C>;
  // q8 with VNNI: codes + 128 in the many-row tiles, the sign trick in the one-row tile (codes
  // + 128 there slowed a Q8_0 file's batch-1 decode: docs/cpu_kernels.md#int8-tiles), the
  // integer sums made equal (code + 128's owe 128 x the block's x code sum) before any float
  // step: a row's bits are the same in either tile.
  constexpr bool kPlus128 = C == Codes::q8 && kVnni && R > 1;
  const int64_t B = x.B;
  for (int64_t b0 = k0; b0 < k0 + kl; b0 += B) {
    ivec acc[NP][R][U][2];
#pragma GCC unroll 2
    for (int j = 0; j < NP; ++j)
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
        for (int u = 0; u < U; ++u) acc[j][r][u][0] = acc[j][r][u][1] = izero();
    for (int64_t k = b0; k < b0 + B; k += 4) {
      ivec raw[NP][U][2], wu[NP][U][2];
#pragma GCC unroll 2
      for (int j = 0; j < NP; ++j) {
        const uint8_t* quad = w.codes + ((p + j) * w.K4 + k / 4) * kBytes;
        if (prefetch) {
          for (int64_t l = 0; l < kBytes; l += 64)
            __builtin_prefetch(quad + kPrefetchQuads * kBytes + l);
        }
#pragma GCC unroll 4
        for (int u = 0; u < U; ++u) {
          if constexpr (C == Codes::q4) {
            const ivec bytes = iload(quad + (u0 + u) * kW * 4);
            wu[j][u][0] = low_nibbles(bytes);
            wu[j][u][1] = high_nibbles(bytes);
          } else if constexpr (C == Codes::q6) {
            const int64_t o = (u0 + u) * kW * 4;  // the unit's nibble bytes
            for (int h = 0; h < 2; ++h)
              wu[j][u][h] = q6_codes(quad + o, quad + kPanel * 2 + o % 64, q6_shift(o, h), h);
          } else if constexpr (C == Codes::q5) {
            // unit u's columns (u * kW) % 32..: their fifth bits at bit 2 ((u * kW) / 8) + h
            const ivec plane = q5_plane(quad + kPanel * 2);
            const int t = int((u0 + u) * kW / 4);
            for (int h = 0; h < 2; ++h)
              wu[j][u][h] = q5_codes(quad + (u0 + u) * kW * 4, plane, t + h, h);
          } else {
            for (int h = 0; h < 2; ++h) {
              raw[j][u][h] = iload(quad + ((u0 + u) + h * kUnits) * kW * 4);
              wu[j][u][h] = kPlus128 ? plus128(raw[j][u][h]) : abs8(raw[j][u][h]);
            }
          }
        }
      }
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        int32_t four;
        std::memcpy(&four, x.q.data() + (m + r) * x.K + k, 4);
        const ivec xb = bcast(four);
#pragma GCC unroll 2
        for (int j = 0; j < NP; ++j)
#pragma GCC unroll 4
          for (int u = 0; u < U; ++u)
            for (int h = 0; h < 2; ++h)
              acc[j][r][u][h] = dot<C>(acc[j][r][u][h], wu[j][u][h],
                                       C == Codes::q8 && !kPlus128 ? sign8(xb, raw[j][u][h]) : xb);
      }
    }
    const int64_t block = b0 / B, group = b0 / w.g.group_size;
#pragma GCC unroll 2
    for (int j = 0; j < NP; ++j)
#pragma GCC unroll 4
      for (int u = 0; u < U; ++u)
        for (int h = 0; h < 2; ++h) {
          const int64_t col = (u0 + u) * kW + h * (kPanel / 2);
          const vfloat ws = gf.group_scale(p + j, group, col);
          const vfloat wo = OFFSET ? gf.group_offset(p + j, group, col) : vfloat{};
#pragma GCC unroll 8
          for (int r = 0; r < R; ++r) {
            const float xs = x.scale[(m + r) * x.num_blocks + block];
            const int32_t code_sum = x.code_sum[(m + r) * x.num_blocks + block];
            const float xsum = xs * static_cast<float>(code_sum);  // the block's sum of x
            float* dst = c + j * c_stride + r * kPanel + col;
            ivec sums = finish<C>(acc[j][r][u][h]);
            if constexpr (kPlus128)
              sums = sub32(sums, bcast(128 * code_sum));
            vfloat v = load(dst) + to_floats(sums) * (ws * xs);
            if constexpr (C == Codes::q5) v -= ws * (16.f * xsum);  // the bytes were code + 16
            if constexpr (C == Codes::q6) v -= ws * (32.f * xsum);  // code + 32
            if constexpr (OFFSET) v += wo * xsum;
            store(dst, v);
          }
        }
  }
}

// 1..R rows of the many-rows tile (the row count a compile-time constant, as skinny::tile_rows).
template <Codes C, bool OFFSET, int R = kManyR>
inline void tile_rows(int64_t rows, const Panels& w, const gscale::BlockGroups& bg,
                      const QuantizedRows& x, int64_t m, int64_t p, int u0, int64_t k0,
                      int64_t kl, float* c, bool prefetch) {
  if constexpr (R > 1) {
    if (rows < R)
      return tile_rows<C, OFFSET, R - 1>(rows, w, bg, x, m, p, u0, k0, kl, c, prefetch);
  }
  tile<C, OFFSET, R, kManyU>(w, bg, x, m, p, u0, k0, kl, c, prefetch);
}

// y[0:M, panels p0..p1) for rows row0..row0 + M of x (quantized into ``x``; y at row0's
// output), rows in chunks, each over all of the panels: one thread's share of ``panels_gemm``,
// or of a grouped call (quant_gemm.cpp: an expert's rows over its weight's panels, the range
// from skinny::split_grouped_panels). The tiles take rows by their index into ``x``; which
// tile holds a row does not change its bits (exact integer sums, float steps per block).
template <Codes C, bool OFFSET>
void panels_run(const Panels& w, const QuantizedRows& x, int64_t row0, int64_t M, int64_t N,
                float* yp, int64_t p0, int64_t p1) {
  // One row: neighbouring panels in pairs, two weight streams per thread (both prefetched), the
  // outputs of the second after the first's: faster than one panel at a time on large weights,
  // and only with the prefetch. AVX-512 only (kRowInPairs): AVX2's pair would hold 16
  // accumulators, every ymm register, and its q4 lost (docs/cpu_kernels.md#int8-tiles).
  // The outputs of the panels in hand, each panel's rows after the previous panel's.
  std::vector<float> c(std::max<int64_t>(2, std::min(M, kChunkRows)) * kPanel);
  // the many-row tiles' decoded group floats (one row reads them in place)
  std::vector<float> group_floats(M > 1 ? w.g.block_floats(kBlockK) : 0);
  const bool prefetch = prefetches<C>();
  for (int64_t r0 = 0; r0 < M; r0 += kChunkRows) {
    const int64_t rows = std::min(kChunkRows, M - r0);
    for (int64_t p = p0, np = 1; p < p1; p += np) {
      np = kRowInPairs && rows == 1 && p + 1 < p1 ? 2 : 1;
      std::fill(c.begin(), c.begin() + np * rows * kPanel, 0.f);
      for (int64_t k0 = 0; k0 < x.K; k0 += kBlockK) {
        const int64_t kl = std::min(kBlockK, x.K - k0);
        // One row reads each group's floats once, straight from the weight's tensors; more
        // rows share them, decoded once per block (group_scales.h's forms take a few
        // instructions a vector to read: decoded per 4-row tile was slower, docs/cpu_kernels.md).
        if (rows == 1) {
          if constexpr (kRowInPairs) {
            if (np == 2) {
              tile<C, OFFSET, 1, kUnits, 2>(w, w.g, x, row0 + r0, p, 0, k0, kl, c.data(), prefetch,
                                            kPanel);
              continue;
            }
          }
          tile<C, OFFSET, 1, kUnits>(w, w.g, x, row0 + r0, p, 0, k0, kl, c.data(), prefetch);
          continue;
        }
        const gscale::BlockGroups bg = w.g.block(p, k0, kl, group_floats.data());
        for (int u0 = 0; u0 < kUnits; u0 += kManyU)
          for (int64_t m0 = 0; m0 < rows; m0 += kManyR)
            tile_rows<C, OFFSET>(std::min<int64_t>(kManyR, rows - m0), w, bg, x, row0 + r0 + m0,
                                 p, u0, k0, kl, c.data() + m0 * kPanel,
                                 prefetch && m0 == 0 && u0 == 0);
      }
      for (int64_t j = 0; j < np; ++j) {  // panel p + j's outputs into y
        const int64_t cols = std::min(kPanel, N - (p + j) * kPanel);
        for (int64_t m = 0; m < rows; ++m)
          std::memcpy(yp + (r0 + m) * N + (p + j) * kPanel, c.data() + (j * rows + m) * kPanel,
                      cols * sizeof(float));
      }
    }
  }
}

// y [M, N] = x W^T for x quantized into ``x``: threads take runs of panels.
template <Codes C, bool OFFSET>
void panels_gemm(const Panels& w, const QuantizedRows& x, int64_t M, int64_t N, int64_t P,
                 float* yp) {
  skinny::split_grouped_panels({M}, P, N * 4 * w.K4, [&](int64_t, int64_t p0, int64_t p1) {
    panels_run<C, OFFSET>(w, x, 0, M, N, yp, p0, p1);
  });
}

#endif  // AVX2 or AVX-512

}  // namespace int8gemm
