// y = x W^T for a layer whose weight is held in a format other than float32, in the panels of
// the float32 kernel (skinny_gemm.cpp, 64 output columns per panel, k along the panel), so the
// weights stay in the precision users ship and stream from memory at that size:
//
//   codes dtype  layout             value of W[p * 64 + c][k]
//   bfloat16     [P, K, 32 x 2]     the bf16 widened (its bits are a float's high half); the
//                                   32-bit lane j of row k holds column j in its low half and
//                                   column j + 32 in its high one
//   bfloat16     [P, K/32, 2048]    (the bf16-activation path's, bf16_gemm.h: Intel's VNNI
//                                   pairs as whole B tiles) per block of 32 k, 4 tiles of 16 columns, each 16 pair
//                                   rows q: column 16t + c's k = 2q, 2q + 1 at (t, q, c, 0..1)
//   float16      [P, K, 64]         the fp16 widened (F16C's vcvtph2ps)
//   int8  (q8)   [P, K/4, 64 x 4]   code * scale (+ offset), per group of G k; column c's k =
//                                   4q + i at byte 4c + i of quad q
//   uint8 (q4)   [P, K/4, 32 x 4]   code * scale (+ offset); byte 4j + i of quad q holds column
//                                   j (k = 4q + i) in its low nibble and column j + 32 in its
//                                   high one
//   uint8 (q5)   [P, K/4, 160]      code * scale (+ offset), code -16..15: q4's 128 bytes of
//                                   nibbles, then 32 bytes of fifth bits (HighBitPanels below)
//   uint8 (q6)   [P, K/4, 192]      code * scale (+ offset), code -32..31: q4's 128 bytes of
//                                   nibbles, then 64 bytes of bit pairs (HighBitPanels below)
//
// (K/4 and K/32 rounded up, zeros padding the last quad or block: the float path stops at K,
// the int8 one takes whole groups of 4 k, the bf16-activation one whole blocks.) scales (and
// the optional offsets) give one float per group of G consecutive k of an output row, as float32 or float16
// [P, K / G, 64] or as GGUF's K-quants hold them, an fp16 per super-block times an int8 per
// group (group_scales.h; layers/quantization/ maps GGUF's block types and AWQ/GPTQ groups to
// these layouts and picks the smallest exact form).
// q8/q4 keep a column's 4 consecutive k together for the int8-activation path (int8_gemm.h:
// integer dot products of 4 k per 32-bit lane, the codes used as they lie); the float path
// below reads the same bytes, one quad load giving 4 k of kW columns. One copy of the weights
// serves both.
//
// The float path (the default: "exact", the dequantized model's numbers): activations and sums
// are float32. Each k block of a panel (64 k x 64 columns) is converted into a float32 block on
// the stack (16 KiB, in L1) and the float32 kernel's register tiles run over it unchanged, so
// every row tile of a chunk reuses one conversion; a single row (a decode step of one sequence)
// converts straight into registers instead (each value is used once). The arithmetic is the
// float32 kernel's on the converted weights: the same order of sums for every row count (a
// row's result does not depend on its batch), within float32 rounding of x times the
// dequantized weight (a value is code * scale + offset in one fused multiply-add, the same
// ``value`` on both paths). A row is widened kW floats at a time with the level's intrinsics
// (v3: 8, v4: 16), the tiles are skinny_tiles.h's for the level.
// Fewer bytes than the float32 panels make it faster at few rows; at one row the conversion,
// not the memory stream, is the limit (docs/cpu_kernels.md#weight-formats-measured).
//
// The narrow-activation paths (``narrow_activations``): bf16 weights on AMX tiles or AVX512-BF16
// dot products with x rounded to bf16 (bf16_gemm.h, the engine's
// quantization_activations=bfloat16), and q8/q4/q5 with x quantized to int8 (the engine's quantization_activations=int8; int8_gemm.h). The
// int8 one: x quantized per row in blocks of 32 k, integer dot products, one float step per
// block. It is as fast as the exact path or faster at every row count (many-row q8 ties: AVX2's
// sign trick costs as many instructions per weight as a float FMA once many rows share the
// conversion; docs/cpu_kernels.md#weight-formats-measured). So the engine uses it at every row
// count when asked, and a row's bits still never depend on its batch.
//
// Two ops: quant_linear, one layer's weight; grouped_quant_linear, a mixture-of-experts
// layer's experts in one call (as grouped_packed_linear in skinny_gemm.cpp for float32
// panels): the experts' tensors stacked along a leading dim, x's rows sorted by expert, one
// parallel region over every (expert, panel) item on either path (skinny::split_grouped_panels),
// each expert's rows getting the bits quant_linear gives them alone.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "bf16_gemm.h"
#include "group_scales.h"
#include "grouped_linear.h"
#include "int8_gemm.h"
#include "skinny_tiles.h"

namespace {

using skinny::kPanel;
using skinny::kRowVecs;
using skinny::kW;
using skinny::load;
using skinny::vfloat;
using gscale::Groups;
using gscale::widen_fp16;

// kW codes widened to a vector of floats. Intrinsics, not __builtin_convertvector: GCC 12
// converts a byte vector to floats one element at a time (docs/cpu_kernels.md#weight-formats-measured).
#if defined(__AVX512F__)
inline vfloat as_floats(__m512i i) { return (vfloat)_mm512_cvtepi32_ps(i); }
// kW columns of a quad block (kW lanes of 4 bytes, one per k): byte j of each lane.
inline vfloat quad_i8(const void* q, int j) {
  const __m512i w = _mm512_loadu_si512(q);
  return as_floats(_mm512_srai_epi32(_mm512_slli_epi32(w, 24 - 8 * j), 24));
}
inline vfloat quad_nibbles(const void* q, int shift) {
  const __m512i w = _mm512_loadu_si512(q);
  return as_floats(_mm512_and_si512(_mm512_srli_epi32(w, shift), _mm512_set1_epi32(15)));
}
// The 4 signed bytes of each 32-bit lane of w, as 4 vectors of floats (byte j: f[j]).
inline void lane_bytes_4(__m512i w, vfloat f[4]) {
  f[0] = as_floats(_mm512_srai_epi32(_mm512_slli_epi32(w, 24), 24));
  f[1] = as_floats(_mm512_srai_epi32(_mm512_slli_epi32(w, 16), 24));
  f[2] = as_floats(_mm512_srai_epi32(_mm512_slli_epi32(w, 8), 24));
  f[3] = as_floats(_mm512_srai_epi32(w, 24));
}
inline void quad_i8_4(const void* q, vfloat f[4]) { lane_bytes_4(_mm512_loadu_si512(q), f); }
template <int HIGH>
inline void quad_nibbles_4(const void* q, vfloat f[4]) {
  const __m512i w = _mm512_loadu_si512(q), m = _mm512_set1_epi32(15);
  f[0] = as_floats(_mm512_and_si512(_mm512_srli_epi32(w, HIGH), m));
  f[1] = as_floats(_mm512_and_si512(_mm512_srli_epi32(w, 8 + HIGH), m));
  f[2] = as_floats(_mm512_and_si512(_mm512_srli_epi32(w, 16 + HIGH), m));
  f[3] = as_floats(_mm512_and_si512(_mm512_srli_epi32(w, 24 + HIGH), m));
}
inline vfloat bf16_pairs(const uint16_t* h, bool high) {
  const __m512i w = _mm512_loadu_si512(h);
  return (vfloat)_mm512_castsi512_ps(high ? _mm512_and_si512(w, _mm512_set1_epi32(-65536))
                                          : _mm512_slli_epi32(w, 16));
}
// q5 (the layout: HighBitPanels below): 4 k of kW columns, codes -16..15.
inline void q5_quad_4(const uint8_t* nib, const uint8_t* plane, int t, int h, vfloat f[4]) {
  using namespace int8gemm;
  lane_bytes_4(_mm512_sub_epi8(q5_codes(nib, q5_plane(plane), t, h), _mm512_set1_epi8(16)), f);
}
// q6 (HighBitPanels below): 4 k of kW columns, codes -32..31.
inline void q6_quad_4(const uint8_t* nib, const uint8_t* plane, int s, int h, vfloat f[4]) {
  lane_bytes_4(_mm512_sub_epi8(int8gemm::q6_codes(nib, plane, s, h), _mm512_set1_epi8(32)), f);
}
#elif defined(__AVX2__) && defined(__F16C__)
inline vfloat as_floats(__m256i i) { return (vfloat)_mm256_cvtepi32_ps(i); }
inline vfloat quad_i8(const void* q, int j) {
  const __m256i w = _mm256_loadu_si256(static_cast<const __m256i*>(q));
  return as_floats(_mm256_srai_epi32(_mm256_slli_epi32(w, 24 - 8 * j), 24));
}
inline vfloat quad_nibbles(const void* q, int shift) {
  const __m256i w = _mm256_loadu_si256(static_cast<const __m256i*>(q));
  return as_floats(_mm256_and_si256(_mm256_srli_epi32(w, shift), _mm256_set1_epi32(15)));
}
// The 4 signed bytes of each 32-bit lane of w, as 4 vectors of floats (byte j: f[j]).
inline void lane_bytes_4(__m256i w, vfloat f[4]) {
  f[0] = as_floats(_mm256_srai_epi32(_mm256_slli_epi32(w, 24), 24));
  f[1] = as_floats(_mm256_srai_epi32(_mm256_slli_epi32(w, 16), 24));
  f[2] = as_floats(_mm256_srai_epi32(_mm256_slli_epi32(w, 8), 24));
  f[3] = as_floats(_mm256_srai_epi32(w, 24));
}
inline void quad_i8_4(const void* q, vfloat f[4]) {
  lane_bytes_4(_mm256_loadu_si256(static_cast<const __m256i*>(q)), f);
}
template <int HIGH>
inline void quad_nibbles_4(const void* q, vfloat f[4]) {
  const __m256i w = _mm256_loadu_si256(static_cast<const __m256i*>(q)), m = _mm256_set1_epi32(15);
  f[0] = as_floats(_mm256_and_si256(_mm256_srli_epi32(w, HIGH), m));
  f[1] = as_floats(_mm256_and_si256(_mm256_srli_epi32(w, 8 + HIGH), m));
  f[2] = as_floats(_mm256_and_si256(_mm256_srli_epi32(w, 16 + HIGH), m));
  f[3] = as_floats(_mm256_and_si256(_mm256_srli_epi32(w, 24 + HIGH), m));
}
inline vfloat bf16_pairs(const uint16_t* h, bool high) {
  const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(h));
  return (vfloat)_mm256_castsi256_ps(high ? _mm256_and_si256(w, _mm256_set1_epi32(-65536))
                                          : _mm256_slli_epi32(w, 16));
}
inline void q5_quad_4(const uint8_t* nib, const uint8_t* plane, int t, int h, vfloat f[4]) {
  using namespace int8gemm;
  lane_bytes_4(_mm256_sub_epi8(q5_codes(nib, q5_plane(plane), t, h), _mm256_set1_epi8(16)), f);
}
inline void q6_quad_4(const uint8_t* nib, const uint8_t* plane, int s, int h, vfloat f[4]) {
  lane_bytes_4(_mm256_sub_epi8(int8gemm::q6_codes(nib, plane, s, h), _mm256_set1_epi8(32)), f);
}
#else  // any other CPU: element by element (correct, untuned; the engine runs torch there)
template <class F>
inline vfloat widen(F f) {
  float out[kW];
  for (int64_t j = 0; j < kW; ++j) out[j] = f(j);
  return load(out);
}
inline vfloat quad_i8(const void* q, int j) {
  const auto* c = static_cast<const int8_t*>(q);
  return widen([&](int64_t i) { return float(c[4 * i + j]); });
}
inline vfloat quad_nibbles(const void* q, int shift) {
  const auto* c = static_cast<const uint8_t*>(q);
  return widen([&](int64_t i) { return float((c[4 * i + shift / 8] >> (shift % 8)) & 15); });
}
inline void quad_i8_4(const void* q, vfloat f[4]) {
  for (int j = 0; j < 4; ++j) f[j] = quad_i8(q, j);
}
template <int HIGH>
inline void quad_nibbles_4(const void* q, vfloat f[4]) {
  for (int j = 0; j < 4; ++j) f[j] = quad_nibbles(q, 8 * j + HIGH);
}
inline vfloat bf16_pairs(const uint16_t* h, bool high) {
  return widen([&](int64_t j) {
    const uint32_t bits = uint32_t(h[2 * j + (high ? 1 : 0)]) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
  });
}
// Nibble byte b = 4 (low + j) + i of the block, its fifth bit found by the layout's rule itself
// (low, the vector's first lane, from t = low / 4 + h).
inline void q5_quad_4(const uint8_t* nib, const uint8_t* plane, int t, int h, vfloat f[4]) {
  const int64_t low = 4 * (t - h);
  for (int i = 0; i < 4; ++i)
    f[i] = widen([&](int64_t j) {
      const int64_t b = 4 * (low + j) + i;
      const int nibble = (nib[4 * j + i] >> (4 * h)) & 15;
      const int fifth = (plane[b % 32] >> (2 * (b / 32) + h)) & 1;
      return float(nibble + 16 * fifth - 16);
    });
}
// The vector's nibble bytes from the block's byte o = nib - block, their bit pairs at byte
// o % 64 + 4 j + i of the plane, bits s, s + 1.
inline void q6_quad_4(const uint8_t* nib, const uint8_t* plane, int s, int h, vfloat f[4]) {
  for (int i = 0; i < 4; ++i)
    f[i] = widen([&](int64_t j) {
      const int nibble = (nib[4 * j + i] >> (4 * h)) & 15;
      const int high = (plane[4 * j + i] >> s) & 3;
      return float(nibble + 16 * high - 32);
    });
}
#endif

// bf16 and fp16 panels [P, K, 64] of 16-bit values. A bf16 row's columns lie in pairs (j, j +
// 32) per 32-bit lane: one load of kW lanes gives two vectors, each widened by one shift or one
// mask (a float is a bf16 in its high half), where a row in column order takes a widening
// shuffle and a shift per vector: faster at one row (docs/cpu_kernels.md#weight-formats-measured).
// fp16 stays in column order for F16C's vcvtph2ps.
template <bool BF16>
struct HalfPanels {
  static constexpr bool kInPlace = false, kScaled = false, kOffset = false, kQuads = false;
  static constexpr bool kPairedRow = true;  // skinny_tiles.h's row_times_block
  static constexpr int64_t kRowBytes = kPanel * 2;
  const uint16_t* w;
  int64_t K;
  const char* row_bytes(int64_t p, int64_t k) const {
    return reinterpret_cast<const char*>(w + (p * K + k) * kPanel);
  }
  vfloat code(int64_t p, int64_t k, int v) const {
    const uint16_t* row = w + (p * K + k) * kPanel;
    if constexpr (BF16) return bf16_pairs(row + 2 * (v * kW % 32), v * kW >= 32);
    return widen_fp16(row + v * kW);
  }
  vfloat scale(int64_t, int64_t, int) const { return vfloat{}; }
  vfloat offset(int64_t, int64_t, int) const { return vfloat{}; }
  int64_t group_size() const { return 1; }
};

// q8 and q4 codes in quad blocks, [P, K / 4, quad bytes] (K rounded up to 4 with zero codes):
// a column's 4 consecutive k lie in one 32-bit lane, so int8_gemm.h's integer dot products take
// them as they lie; here a row k is byte k % 4 of each lane.
// q8: [P, K / 4, 64 x 4] int8, column j's k = 4q + i at byte 4j + i.
template <bool OFFSET>
struct Q8Panels {
  static constexpr bool kInPlace = false, kScaled = true, kOffset = OFFSET, kQuads = true;
  static constexpr bool kPairedRow = true;
  static constexpr int64_t kRowBytes = kPanel;  // a k's share of the stream (a quarter quad)
  const uint8_t* codes;
  int64_t K4;
  Groups g;
  const char* row_bytes(int64_t p, int64_t k) const {
    return reinterpret_cast<const char*>(codes + p * K4 * 4 * kRowBytes + k * kRowBytes);
  }
  vfloat code(int64_t p, int64_t k, int v) const {
    return quad_i8(codes + ((p * K4 + k / 4) * kPanel + v * kW) * 4, int(k % 4));
  }
  void quad(int64_t p, int64_t q, int v, vfloat f[4]) const {
    quad_i8_4(codes + ((p * K4 + q) * kPanel + v * kW) * 4, f);
  }
  vfloat scale(int64_t p, int64_t k, int v) const { return g.scale(p, k, v * kW); }
  vfloat offset(int64_t p, int64_t k, int v) const { return g.offset(p, k, v * kW); }
  int64_t group_size() const { return g.group_size; }
};

// q4: [P, K / 4, 32 x 4] bytes, byte 4j + i holding column j's k = 4q + i in its low nibble and
// column j + 32's in its high one.
template <bool OFFSET>
struct Q4Panels {
  static constexpr bool kInPlace = false, kScaled = true, kOffset = OFFSET, kQuads = true;
  static constexpr bool kPairedRow = false;  // unpacking two panels' nibbles: slower (in_pairs)
  static constexpr int64_t kRowBytes = kPanel / 2;
  const uint8_t* codes;
  int64_t K4;
  Groups g;
  const char* row_bytes(int64_t p, int64_t k) const {
    return reinterpret_cast<const char*>(codes + p * K4 * 4 * kRowBytes + k * kRowBytes);
  }
  vfloat code(int64_t p, int64_t k, int v) const {
    const int64_t col = v * kW;  // columns col.. are nibbles of bytes 4 (col % 32)..
    return quad_nibbles(codes + ((p * K4 + k / 4) * kRowBytes + col % kRowBytes) * 4,
                        int(8 * (k % 4) + (col >= kRowBytes ? 4 : 0)));
  }
  void quad(int64_t p, int64_t q, int v, vfloat f[4]) const {
    const int64_t col = v * kW;
    const uint8_t* c = codes + ((p * K4 + q) * kRowBytes + col % kRowBytes) * 4;
    col >= kRowBytes ? quad_nibbles_4<4>(c, f) : quad_nibbles_4<0>(c, f);
  }
  vfloat scale(int64_t p, int64_t k, int v) const { return g.scale(p, k, v * kW); }
  vfloat offset(int64_t p, int64_t k, int v) const { return g.offset(p, k, v * kW); }
  int64_t group_size() const { return g.group_size; }
};

// q5 and q6 (BITS 1, 2): [P, K / 4, 128 + 32 x BITS] bytes, a q4 quad block of the codes'
// low 4 bits (128 bytes of nibbles) and a plane of their high bits.
// q5: the code of nibble h (0 low, 1 high) of byte b = 4j + i is ``nibble + 16 * fifth - 16``
// (-16..15), its fifth bit being bit 2 (b / 32) + h of plane byte b % 32. So the fifth bits of
// any kW columns' 4 k (AVX2: a quarter of the nibble bytes, AVX-512 half) lie at one bit
// position of the plane's bytes (AVX-512: after q5_plane's shift of its upper half), and one
// load of the plane serves a quad.
// q6: the code is ``nibble + 16 * high - 32`` (-32..31: GGUF's Q6_K), the high bit pair of
// nibble h of byte b being bits s, s + 1 of plane byte b % 64, s = 2 (2 (b / 64) + h). So a
// vector of nibble bytes (AVX2: 32 of them, AVX-512: 64, never across the 64-byte halves)
// finds its bit pairs in one load of the plane, at one bit position.
template <int BITS, bool OFFSET>
struct HighBitPanels {
  static constexpr bool kInPlace = false, kScaled = true, kOffset = OFFSET, kQuads = true;
  static constexpr bool kPairedRow = false;  // q4's nibbles and more
  static constexpr int64_t kQuadBytes = kPanel * 2 + 32 * BITS;
  static constexpr int64_t kRowBytes = kQuadBytes / 4;
  const uint8_t* codes;
  int64_t K4;
  Groups g;
  const char* row_bytes(int64_t p, int64_t k) const {
    return reinterpret_cast<const char*>(codes + p * K4 * kQuadBytes + k * kRowBytes);
  }
  void quad(int64_t p, int64_t q, int v, vfloat f[4]) const {
    const int64_t col = v * kW, low = col % (kPanel / 2), o = low * 4;  // the nibble bytes
    const uint8_t* block = codes + (p * K4 + q) * kQuadBytes;
    const int h = col >= kPanel / 2 ? 1 : 0;
    if constexpr (BITS == 1)
      q5_quad_4(block + o, block + kPanel * 2, int(2 * (low / 8)) + h, h, f);
    else
      q6_quad_4(block + o, block + kPanel * 2 + o % 64, int8gemm::q6_shift(o, h), h, f);
  }
  vfloat code(int64_t p, int64_t k, int v) const {  // groups not of whole quads only
    vfloat f[4];
    quad(p, k / 4, v, f);
    return f[k % 4];
  }
  vfloat scale(int64_t p, int64_t k, int v) const { return g.scale(p, k, v * kW); }
  vfloat offset(int64_t p, int64_t k, int v) const { return g.offset(p, k, v * kW); }
  int64_t group_size() const { return g.group_size; }
};

// One of scales / offsets (``name``) in one of group_scales.h's forms, checked against the
// weight's shape: ``experts`` > 0, the grouped op's, one weight's tensor per expert along a
// leading dim.
gscale::Values check_values(const char* name, const at::Tensor& t, int64_t P, int64_t G,
                            int64_t experts) {
  std::vector<int64_t> lead{P};
  if (experts > 0) lead.insert(lead.begin(), experts);
  const auto dtype = t.scalar_type();
  gscale::Values v{static_cast<const uint8_t*>(t.data_ptr()), gscale::Form::f32, G, 0};
  std::vector<int64_t> shape = lead;
  if (dtype == at::kByte) {  // super-block records [.., P, K / S, 64 x (2 + S / G)]
    const int64_t width = t.dim() == int64_t(lead.size()) + 2 ? t.size(-1) : 0;
    const int64_t per_super = width % kPanel == 0 ? width / kPanel - 2 : 0;
    v.form = gscale::Form::records;
    while ((int64_t(1) << v.per_super_log2) < per_super) ++v.per_super_log2;
    TORCH_CHECK(per_super > 0 && v.per_super() == per_super && G % per_super == 0, name,
                ": super-block records must be [", experts > 0 ? "experts, " : "",
                "P, in / S, 64 x (2 + S / group_size)] uint8, S / group_size a power of two "
                "dividing in_features / group_size; got ", t.sizes());
    shape.insert(shape.end(), {G / per_super, width});
  } else {
    TORCH_CHECK(dtype == at::kFloat || dtype == at::kHalf, name, " must be float32 or float16 "
                "[P, in / group_size, 64], or uint8 super-block records; got ", dtype);
    v.form = dtype == at::kFloat ? gscale::Form::f32 : gscale::Form::f16;
    shape.insert(shape.end(), {G, kPanel});
  }
  TORCH_CHECK(t.is_contiguous() && t.sizes() == at::IntArrayRef(shape), name, " must be a "
              "contiguous ", dtype, " tensor shaped ", at::IntArrayRef(shape), " here (",
              experts > 0 ? "[experts, " : "[", "P, groups, ...]), got ", t.sizes());
  return v;
}

Groups check_groups(int64_t P, int64_t K, const std::optional<at::Tensor>& scales,
                    const std::optional<at::Tensor>& offsets, int64_t group_size,
                    int64_t experts = 0) {
  TORCH_CHECK(scales.has_value(), "q8/q4/q5/q6 codes need scales");
  TORCH_CHECK(group_size > 0 && K % group_size == 0, "group_size ", group_size,
              " must divide in_features ", K);
  const int64_t G = K / group_size;
  Groups g{check_values("scales", *scales, P, G, experts), {}, group_size, G};
  if (offsets) g.offsets = check_values("offsets", *offsets, P, G, experts);
  return g;
}

// Which weight x's rows meet: one weight, every row (quant_linear: one group of all the rows);
// or, ``grouped``, one weight per expert, each over its own rows (``rows``). Either way the
// (expert, panel) items are split by cost in one parallel region (skinny::split_grouped_panels).
// A grouped call's tensors hold the experts' weights along a leading dim; the Source or
// int8gemm::Panels of expert e points at its part.
struct Experts {
  bool grouped;
  skinny::RowGroups rows;
};

// The float path over ``source(e)``, expert e's weight (a single weight: e = 0).
template <class SourceOf>
void float_gemm(const float* xp, int64_t K, const Experts& ex, const SourceOf& source, int64_t N,
                int64_t P, float* yp) {
  skinny::grouped_panels_gemm(xp, K, ex.rows.start, ex.rows.rows, source, N, P, yp);
}

// The float path over q8/q4/q5 quad panels, or with ``int8`` (and a group size of a multiple of
// 4 on an AVX2/AVX-512 build) int8_gemm.h's path over the same panels. ``expert_bytes``: the
// codes of one expert's weight (grouped).
template <int8gemm::Codes C, bool OFFSET>
void quad_panels_gemm(const float* xp, int64_t M, int64_t K, const Experts& ex,
                      const uint8_t* codes, int64_t expert_bytes, const Groups& g, int64_t N,
                      int64_t P, bool int8, float* yp) {
  const int64_t K4 = (K + 3) / 4;
#if defined(__AVX2__) || defined(__AVX512F__)
  const int64_t B = int8gemm::block_size(g.group_size);
  if (int8 && B > 0) {
    // Every row at once, whatever its expert: a row's codes and scales are computed from that
    // row alone, so they are the ones its expert's own call would compute.
    const int8gemm::QuantizedRows xq = int8gemm::quantize_rows(xp, M, K, B);
    const auto weight = [&](int64_t e) {
      return int8gemm::Panels{codes + e * expert_bytes, g.expert(e, P), K4};
    };
    if (!ex.grouped) return int8gemm::panels_gemm<C, OFFSET>(weight(0), xq, M, N, P, yp);
    const std::vector<int64_t>& start = ex.rows.start;
    const std::vector<int64_t>& rows = ex.rows.rows;
    return skinny::split_grouped_panels(rows, P, N * K, [&](int64_t e, int64_t p0, int64_t p1) {
      int8gemm::panels_run<C, OFFSET>(weight(e), xq, start[e], rows[e], N, yp + start[e] * N,
                                      p0, p1);
    });
  }
#endif
  using int8gemm::Codes;
  using Source = std::conditional_t<
      C == Codes::q4, Q4Panels<OFFSET>,
      std::conditional_t<C == Codes::q5, HighBitPanels<1, OFFSET>,
                         std::conditional_t<C == Codes::q6, HighBitPanels<2, OFFSET>,
                                            Q8Panels<OFFSET>>>>;
  const auto source = [&](int64_t e) {
    return Source{codes + e * expert_bytes, K4, g.expert(e, P)};
  };
  float_gemm(xp, K, ex, source, N, P, yp);
}

// bf16 panels (VNNI layout) times x rounded to bf16 (bf16_gemm.h: AMX tiles, or AVX512-BF16
// dot products on a CPU without AMX): x float32 or bf16 (In: float / uint16_t), y float32 or,
// with bf16 x (Out: uint16_t), bf16 with ``bias`` added before the rounding; ``expert_elems``:
// the codes of one expert's weight (grouped).
template <class In, class Out>
void bf16_activations_gemm(const In* xp, int64_t M, int64_t K, const Experts& ex,
                           const uint16_t* codes, int64_t expert_elems, int64_t N, int64_t P,
                           Out* yp, const float* bias) {
#if defined(PAGEDLLM_BF16_X)
#if defined(PAGEDLLM_AMX)
  TORCH_CHECK(bf16gemm::permitted(), "the kernel refused AMX: Linux did not grant this process "
              "the tile state (arch_prctl ARCH_REQ_XCOMP_PERM)");
#endif
  const skinny::RowGroups& r = ex.rows;
  const bf16gemm::Bf16Tiles xb = bf16gemm::round_rows(xp, K, r.start, r.rows);
  skinny::split_grouped_panels(r.rows, P, N * K, [&](int64_t e, int64_t p0, int64_t p1) {
    bf16gemm::panels_run(codes + e * expert_elems, K, xb, e, r.rows[e], N, yp + r.start[e] * N,
                         p0, p1, bias);
  });
#else
  TORCH_CHECK(false, "bf16 activations run on AMX tiles or AVX512-BF16 dot products, and this "
              "build has neither (a CPU with AVX512-BF16, such as AMD Zen 4 or Intel Sapphire "
              "Rapids, built with -march=native)");
#endif
}

template <int8gemm::Codes C>
void quad_panels_gemm(const float* xp, int64_t M, int64_t K, const Experts& ex,
                      const uint8_t* codes, int64_t expert_bytes, const Groups& g, int64_t N,
                      int64_t P, bool int8, float* yp) {
  if (g.offsets.data)
    quad_panels_gemm<C, true>(xp, M, K, ex, codes, expert_bytes, g, N, P, int8, yp);
  else
    quad_panels_gemm<C, false>(xp, M, K, ex, codes, expert_bytes, g, N, P, int8, yp);
}

// x [M, K] float32 times the weight held as ``codes`` (+ scales, offsets): [M, N] float32. With
// ``counts`` (grouped_quant_linear): the tensors hold one weight per expert along a leading
// dim, x's rows sorted by expert, counts[e] of them for expert e. On the bf16-activation path
// (bf16 codes, ``narrow``) x may be bf16: y is then bf16, ``bias`` (float32 [N]) added before the rounding.
at::Tensor quant_gemm(const at::Tensor& x, const at::Tensor& codes,
                      const std::optional<at::Tensor>& scales,
                      const std::optional<at::Tensor>& offsets, int64_t group_size,
                      int64_t out_features, bool narrow,
                      std::optional<c10::IntArrayRef> counts = std::nullopt,
                      const std::optional<at::Tensor>& bias = std::nullopt) {
  const auto dtype = codes.scalar_type();
  const bool quads = dtype == at::kChar || dtype == at::kByte;
  // uint8 codes are q4, q5 or q6 quad blocks, told apart by their width (128, 160 or 192
  // bytes; anything else is taken for q4, whose check then names the width it wants)
  using int8gemm::Codes;
  const int64_t last = dtype == at::kByte && codes.dim() >= 1 ? codes.size(-1) : 0;
  const Codes byte_codes = last == int8gemm::kQuadBytes<Codes::q5>   ? Codes::q5
                           : last == int8gemm::kQuadBytes<Codes::q6> ? Codes::q6
                                                                     : Codes::q4;
  const bool grouped = counts.has_value();
  const int64_t experts = grouped ? static_cast<int64_t>(counts->size()) : 0;
  if (grouped) {
    TORCH_CHECK(codes.dim() == 4 && codes.is_contiguous(),
                "codes must be contiguous [experts, P, ...]: one weight's codes per expert, "
                "stacked; got ", codes.sizes());
    TORCH_CHECK(codes.size(0) == experts && experts > 0, "codes hold ", codes.size(0),
                " experts' weights and counts has ", experts, " row counts: one per expert");
  }
  const bool bf16_vnni = dtype == at::kBFloat16 && narrow;  // bf16 B tiles (VNNI), bf16 x
  const int64_t width = dtype == at::kByte ? (byte_codes == Codes::q5   ? int8gemm::kQuadBytes<Codes::q5>
                                              : byte_codes == Codes::q6 ? int8gemm::kQuadBytes<Codes::q6>
                                                                        : kPanel * 2)
                        : dtype == at::kChar ? kPanel * 4
                        : bf16_vnni          ? kPanel * 32  // a block of 32 k
                                             : kPanel;
  const skinny::PanelCall call = skinny::begin_panel_call(
      x, grouped ? codes.select(0, 0) : codes, width, out_features, quads ? 4 : bf16_vnni ? 32 : 1,
      bf16_vnni);
  const Experts ex{grouped, grouped ? skinny::row_groups(*counts, call.M)
                                       : skinny::RowGroups{{0}, {call.M}}};
  if (call.done) return call.y;
  const int64_t M = call.M, K = call.K, N = call.N, P = call.P;
  const bool bf16_x = call.x.scalar_type() == at::kBFloat16;  // the bf16-activation path only
  TORCH_CHECK(!bias || (bf16_x && bias->scalar_type() == at::kFloat && bias->is_contiguous() &&
                        bias->numel() == N),
              "a fused bias is bf16 y's: float32, contiguous, out_features long");
  const float* xp = bf16_x ? nullptr : call.x.data_ptr<float>();
  float* yp = bf16_x ? nullptr : call.y.data_ptr<float>();
  const void* cp = codes.data_ptr();
  const int64_t stride = grouped ? codes.stride(0) : 0;  // codes of one expert (elements)
  switch (dtype) {
    case at::kBFloat16:
    case at::kHalf: {
      const auto* h = static_cast<const uint16_t*>(cp);
      TORCH_CHECK(!narrow || dtype == at::kBFloat16, "narrow activations: fp16 weights have none "
                  "(bf16 ones: bf16 activations)");
      if (bf16_vnni) {
        if (bf16_x)
          bf16_activations_gemm(static_cast<const uint16_t*>(call.x.data_ptr()), M, K, ex, h,
                                stride, N, P, static_cast<uint16_t*>(call.y.data_ptr()),
                                bias ? bias->data_ptr<float>() : nullptr);
        else
          bf16_activations_gemm(xp, M, K, ex, h, stride, N, P, yp, nullptr);
        break;
      }
      if (dtype == at::kBFloat16)
        float_gemm(xp, K, ex, [&](int64_t e) { return HalfPanels<true>{h + e * stride, K}; },
                   N, P, yp);
      else
        float_gemm(xp, K, ex, [&](int64_t e) { return HalfPanels<false>{h + e * stride, K}; },
                   N, P, yp);
      break;
    }
    case at::kChar:
    case at::kByte: {
      const Groups g = check_groups(P, K, scales, offsets, group_size, experts);
      const auto* c = static_cast<const uint8_t*>(cp);
      if (dtype == at::kChar)
        quad_panels_gemm<Codes::q8>(xp, M, K, ex, c, stride, g, N, P, narrow, yp);
      else if (byte_codes == Codes::q5)
        quad_panels_gemm<Codes::q5>(xp, M, K, ex, c, stride, g, N, P, narrow, yp);
      else if (byte_codes == Codes::q6)
        quad_panels_gemm<Codes::q6>(xp, M, K, ex, c, stride, g, N, P, narrow, yp);
      else
        quad_panels_gemm<Codes::q4>(xp, M, K, ex, c, stride, g, N, P, narrow, yp);
      break;
    }
    default:
      TORCH_CHECK(false, "codes of dtype ", dtype, " are not a weight format (bfloat16, float16, "
                  "int8 q8, uint8 q4 / q5 / q6)");
  }
  return call.y;
}

// x W^T (+ bias) for x of any number of leading dims (flattened to rows), like packed_linear.
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& codes,
                        const std::optional<at::Tensor>& scales,
                        const std::optional<at::Tensor>& offsets, int64_t group_size,
                        int64_t out_features, const std::optional<at::Tensor>& bias,
                        bool narrow_activations) {
  // bf16 x on the bf16-activation path: bf16 y, the bias added in the kernel, before the
  // rounding (a bf16 y is half the bytes of a float32 one, and no conversion pass follows it)
  const bool bf16_io = narrow_activations && x.scalar_type() == at::kBFloat16;
  const std::optional<at::Tensor> fused =
      bf16_io && bias ? std::optional<at::Tensor>(bias->to(at::kFloat).contiguous()) : std::nullopt;
  return skinny::linear_over_rows(x, out_features, bf16_io ? std::nullopt : bias,
                                  [&](const at::Tensor& rows) {
    return quant_gemm(rows, codes, scales, offsets, group_size, out_features, narrow_activations,
                      std::nullopt, fused);
  });
}

}  // namespace

namespace PAGEDLLM_NS {

// The experts of a mixture-of-experts layer whose weights are held in these formats
// (layers/fused_moe.py), as grouped_packed_linear (skinny_gemm.cpp) for float32 panels: codes
// (and scales, offsets) stack every expert's QuantizedWeight tensors along a leading dim; x [R,
// K] holds the tokens sorted by expert, ``counts[e]`` rows for expert e in order. y [R,
// out_features]: each row times its expert's weight, in one parallel region over all active
// experts on either path; each expert's rows get exactly the bits quant_linear gives them alone.
at::Tensor grouped_quant_linear(const at::Tensor& x, const at::Tensor& codes,
                                const std::optional<at::Tensor>& scales,
                                const std::optional<at::Tensor>& offsets, int64_t group_size,
                                c10::IntArrayRef counts, int64_t out_features,
                                bool narrow_activations) {
  return quant_gemm(x, codes, scales, offsets, group_size, out_features, narrow_activations, counts);
}

}  // namespace PAGEDLLM_NS

TORCH_LIBRARY_FRAGMENT(PAGEDLLM_NS, m) {
  m.def("quant_linear(Tensor x, Tensor codes, Tensor? scales, Tensor? offsets, int group_size, "
        "int out_features, Tensor? bias, bool narrow_activations=False) -> Tensor");
  m.def("grouped_quant_linear(Tensor x, Tensor codes, Tensor? scales, Tensor? offsets, "
        "int group_size, int[] counts, int out_features, bool narrow_activations=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(PAGEDLLM_NS, CPU, m) {
  m.impl("quant_linear", &quant_linear);
  m.impl("grouped_quant_linear", &PAGEDLLM_NS::grouped_quant_linear);
}
