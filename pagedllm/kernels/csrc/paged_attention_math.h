// The arithmetic of paged_attention.cpp: 8- and 16-float vectors (GCC/Clang vector extensions,
// so AVX, AVX-512 or NEON as the compiler sees fit), the small score and value GEMMs, a vectorisable
// exp. Everything works on float; K/V of any of the cache dtypes are widened on load.
#pragma once

#if defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "isa.h"

namespace paged_math {

// How many query rows each small GEMM below keeps in registers at once: sized for the vector
// register file (32 zmm on AVX-512, 16 ymm on AVX2, where the AVX-512 passes would spill). A
// row's arithmetic is the same whatever pass it is in, so results do not depend on the ISA's
// pass sizes either.
constexpr bool kWideRegs = isa::kVecRegs >= 32;
constexpr int kScoreRows = kWideRegs ? 2 : 1;       // score8: 8 accumulators per row
constexpr int kTransposedRows = kWideRegs ? 4 : 2;  // score_transposed: 4 per row
constexpr int kValueRows = kWideRegs ? 4 : 2;       // accumulate: kValueSplit per row


constexpr int64_t kKeyTile = 32;   // keys scored before one softmax rescale

// Eight floats in a register (GCC/Clang vector extensions: AVX, NEON, or two SSE halves).
// head_dim is a multiple of 8 in every model we serve; other sizes take the scalar loops.
constexpr int64_t kW = 8;
typedef float vfloat __attribute__((vector_size(kW * sizeof(float))));
typedef uint16_t vu16 __attribute__((vector_size(kW * sizeof(uint16_t))));
typedef uint32_t vu32 __attribute__((vector_size(kW * sizeof(uint32_t))));
typedef uint8_t vu8 __attribute__((vector_size(kW * sizeof(uint8_t))));
typedef uint8_t vu8x16 __attribute__((vector_size(16 * sizeof(uint8_t))));

// The fp8 KV cache dtypes (torch's float8_e4m3fn and float8_e5m2), as their bits: the kernel
// only ever widens them. Widening is integer work, no table: the 7 magnitude bits shifted into
// a float's exponent and mantissa fields, the exponent rebiased by an integer add. A subnormal
// fp8 (exponent 0) is rebiased one step further and the implicit leading 1 subtracted as a
// float: 2^(1 - bias) (1 + m / 2^M) - 2^(1 - bias) = m 2^(1 - bias - M), exactly. Nothing is ever
// a float subnormal: an operation on one takes a microcode assist (~100 cycles) on x86, which
// made a first version (multiplying subnormal floats by 2^(127 - bias)) far slower than float32.
// e4m3fn's NaN (S.1111.111) would read as 480 and e5m2's Inf/NaN as finite values; the cache
// never holds them, since K/V are clamped to the finite range before the cast
// (layers/attention/kv_cache_dtype.py).
template <int kMantBits, int kBias>
struct Fp8 {
  uint8_t bits;
  static constexpr uint32_t kShift = 23 - kMantBits;
  static constexpr uint32_t kExpMask = 0x7Fu & ~((1u << kMantBits) - 1);
  static constexpr uint32_t kRebias = static_cast<uint32_t>(127 - kBias) << 23;
  static constexpr uint32_t kOneBit = 1u << 23;  // one more step of exponent
  static constexpr float kMinNormal = 1.f / static_cast<float>(1u << (kBias - 1));  // 2^(1 - bias)
  explicit operator float() const {
    const uint32_t mag = bits & 0x7Fu;
    uint32_t w = (mag << kShift) + kRebias;
    if ((mag & kExpMask) == 0) w += kOneBit;
    float f;
    std::memcpy(&f, &w, sizeof f);
    if ((mag & kExpMask) == 0) f -= kMinNormal;
    return (bits & 0x80) ? -f : f;
  }
};
using Fp8E4M3 = Fp8<3, 7>;
using Fp8E5M2 = Fp8<2, 15>;

// Widens N fp8 values (a vector of N uint32 lanes in, N floats out), as Fp8's operator float.
template <typename VF, typename VU32, typename F8>
inline VF widen_fp8(VU32 w) {
  const VU32 mag = w & 0x7Fu;
  const VU32 sub = (VU32)((mag & F8::kExpMask) == 0u);  // all ones in subnormal (or 0) lanes
  const VU32 bits = (mag << F8::kShift) + F8::kRebias + (sub & F8::kOneBit);
  VF f, min_normal = VF{} + F8::kMinNormal;
  std::memcpy(&f, &bits, sizeof f);
  VU32 sub_bits;
  std::memcpy(&sub_bits, &min_normal, sizeof sub_bits);
  sub_bits &= sub;  // 2^(1 - bias) in subnormal lanes, 0 elsewhere
  VF sub_f;
  std::memcpy(&sub_f, &sub_bits, sizeof sub_f);
  f -= sub_f;
  VU32 out;
  std::memcpy(&out, &f, sizeof out);
  out |= (w & 0x80u) << 24;
  std::memcpy(&f, &out, sizeof f);
  return f;
}

inline vfloat load(const float* p) {
  vfloat v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline vfloat load(const c10::BFloat16* p) {  // bf16 is the top half of a float
  vu16 h;
  std::memcpy(&h, p, sizeof h);
  vu32 w = __builtin_convertvector(h, vu32) << 16;
  vfloat v;
  std::memcpy(&v, &w, sizeof v);
  return v;
}
inline vfloat load(const c10::Half* p) {
#if defined(__F16C__)
  return reinterpret_cast<vfloat>(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#else
  vfloat v;
  for (int64_t i = 0; i < kW; ++i) v[i] = static_cast<float>(p[i]);
  return v;
#endif
}
#if defined(__F16C__)
// e5m2 is the top byte of a float16: the hardware conversion takes it, subnormals included,
// faster than the integer widening below (docs/cpu_kernels.md#attention).
inline vfloat load(const Fp8E5M2* p) {
  const __m128i h = _mm_slli_epi16(_mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))), 8);
  return reinterpret_cast<vfloat>(_mm256_cvtph_ps(h));
}
#endif
template <int M, int B>
inline vfloat load(const Fp8<M, B>* p) {
#if defined(__AVX2__)  // GCC scalarises the generic byte -> int32 conversion below (16 ops)
  const vu32 w = reinterpret_cast<vu32>(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#else
  vu8 b;
  std::memcpy(&b, p, sizeof b);
  const vu32 w = __builtin_convertvector(b, vu32);
#endif
  return widen_fp8<vfloat, vu32, Fp8<M, B>>(w);
}
inline void store(float* p, vfloat v) { std::memcpy(p, &v, sizeof v); }

// A whole vector of floats from p, as one unaligned load.
template <typename V>
inline V load_vec(const float* p) {
  typedef V unaligned __attribute__((aligned(alignof(float)), may_alias));
  return *reinterpret_cast<const unaligned*>(p);
}

// Sixteen floats: the value accumulation's main width on AVX-512, which needs no horizontal sums
// (faster than 8 lanes on the whole kernel, docs/cpu_kernels.md#attention; results are
// identical, the arithmetic of every lane being the same). On AVX2 a 16-float vector is two registers, and kValueRows x
// kValueSplit of them would spill: the 8-float width runs there.
typedef float vfloat16 __attribute__((vector_size(16 * sizeof(float))));
typedef uint16_t vu16x16 __attribute__((vector_size(16 * sizeof(uint16_t))));
typedef uint32_t vu32x16 __attribute__((vector_size(16 * sizeof(uint32_t))));

// load(p) for either width, chosen by the destination: load_into(out, p).
inline void load_into(vfloat& out, const float* p) { out = load(p); }
inline void load_into(vfloat& out, const c10::BFloat16* p) { out = load(p); }
inline void load_into(vfloat& out, const c10::Half* p) { out = load(p); }
template <int M, int B>
inline void load_into(vfloat& out, const Fp8<M, B>* p) { out = load(p); }
inline void load_into(vfloat16& out, const float* p) { std::memcpy(&out, p, sizeof out); }
inline void load_into(vfloat16& out, const c10::BFloat16* p) {
  vu16x16 h;
  std::memcpy(&h, p, sizeof h);
  vu32x16 w = __builtin_convertvector(h, vu32x16) << 16;
  std::memcpy(&out, &w, sizeof out);
}
inline void load_into(vfloat16& out, const c10::Half* p) {
#if defined(__AVX512F__)
  out = reinterpret_cast<vfloat16>(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
#else
  for (int i = 0; i < 16; ++i) out[i] = static_cast<float>(p[i]);
#endif
}
template <int M, int B>
inline void load_into(vfloat16& out, const Fp8<M, B>* p) {
#if defined(__AVX512F__)
  const vu32x16 w = reinterpret_cast<vu32x16>(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#else
  vu8x16 b;
  std::memcpy(&b, p, sizeof b);
  const vu32x16 w = __builtin_convertvector(b, vu32x16);
#endif
  out = widen_fp8<vfloat16, vu32x16, Fp8<M, B>>(w);
}


// Lanes [c, c + kW) of a tile's row: which of them lie in [lo, hi).
inline auto lanes_within(int64_t c, int64_t lo, int64_t hi) {
  const vfloat idx = vfloat{0, 1, 2, 3, 4, 5, 6, 7} + static_cast<float>(c);
  return idx >= static_cast<float>(lo) && idx < static_cast<float>(hi);
}

// The largest of s[lo, hi) (lo < hi <= kKeyTile), s a row of a tile's kKeyTile scores: four
// vectors, the lanes outside [lo, hi) set to -inf. Written out because GCC left the plain loop's
// max reduction scalar, a 4-cycle dependency per key and row that cost as much as the scores at
// decode's few rows. The max is exact, so any order gives the same result.
inline float tile_max(const float* s, int64_t lo, int64_t hi) {
  static_assert(kKeyTile == 4 * kW, "a row of scores is four vectors");
  vfloat m = vfloat{} - std::numeric_limits<float>::infinity();
  for (int64_t c = 0; c < kKeyTile; c += kW) {
    const vfloat v = load(s + c);
    m = lanes_within(c, lo, hi) ? (v > m ? v : m) : m;
  }
  float out = m[0];
  for (int64_t i = 1; i < kW; ++i) out = std::max(out, m[i]);
  return out;
}

inline float hsum(vfloat v) {
  float s = 0.f;
  for (int64_t i = 0; i < kW; ++i) s += v[i];
  return s;
}

// The sums of eight vectors' lanes, as one vector: out[k] = the sum of v[k]'s lanes, by the
// same pairwise tree for every k (((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7))). Three
// rounds of two shuffles and an add; eight separate horizontal sums take ~80 instructions,
// which made them the larger part of scoring a decode's few rows (docs/cpu_kernels.md#attention).
inline vfloat sum8(const vfloat* v) {
  static_assert(kW == 8, "sum8 reduces 8-lane vectors");
  vfloat s[4], t[2];
  for (int k = 0; k < 4; ++k)  // [v[2k](l0+l1), v[2k+1](l0+l1), v[2k](l2+l3), v[2k+1](l2+l3), ...]
    s[k] = __builtin_shufflevector(v[2 * k], v[2 * k + 1], 0, 8, 2, 10, 4, 12, 6, 14) +
           __builtin_shufflevector(v[2 * k], v[2 * k + 1], 1, 9, 3, 11, 5, 13, 7, 15);
  for (int k = 0; k < 2; ++k)  // [v[4k..4k+3](l0..l3), v[4k..4k+3](l4..l7)]
    t[k] = __builtin_shufflevector(s[2 * k], s[2 * k + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
           __builtin_shufflevector(s[2 * k], s[2 * k + 1], 2, 3, 10, 11, 6, 7, 14, 15);
  return __builtin_shufflevector(t[0], t[1], 0, 1, 2, 3, 8, 9, 10, 11) +
         __builtin_shufflevector(t[0], t[1], 4, 5, 6, 7, 12, 13, 14, 15);
}

// Scores of GB (1 or 2) query rows (one kv head's group, pre-scaled, row stride d) against 8
// keys: 8 x GB dot products sharing every load of q and k (a tiny GEMM in registers), reduced
// by sum8. out[g * kKeyTile + j] for j < 8; k[j] points at the keys' kv head.
template <int GB, typename T>
inline void score8(const float* __restrict q, const T* const* k, int64_t d, float* out) {
  vfloat a[GB][8];
#pragma GCC unroll 2
  for (int g = 0; g < GB; ++g)
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) a[g][j] = vfloat{};  // not "= {}": see skinny_gemm.cpp
  int64_t i = 0;
  for (; i + kW <= d; i += kW) {
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      const vfloat kv = load(k[j] + i);
#pragma GCC unroll 2
      for (int g = 0; g < GB; ++g) a[g][j] += load(q + g * d + i) * kv;
    }
  }
  for (int g = 0; g < GB; ++g) {
    vfloat s = sum8(a[g]);
    for (int64_t t = i; t < d; ++t)  // head_dim not a multiple of 8
      for (int j = 0; j < 8; ++j) s[j] += q[g * d + t] * static_cast<float>(k[j][t]);
    store(out + g * kKeyTile, s);
  }
}

// acc[g] += sum_j p[g][j] * v[j] for GB rows of one kv head's group and tile keys: each value
// vector is loaded once for the group; the accumulators stay in registers across the keys. A
// register accumulating key after key waits for its previous FMA (4 cycles): with few rows that
// latency, not memory, bounded decode, so key j goes to partial sum j % kValueSplit (GB x
// kValueSplit independent chains), added up at the end. The split is the same for every GB, so
// a row's sum is the same whether it is computed in a decode or in a prefill chunk (recomputed
// tokens after a preemption get the same logprobs).
constexpr int kValueSplit = 4;

// Elements [i, i + lanes of V) of accumulate's sums.
template <int GB, typename V, typename T>
inline void accumulate_chunk(float* __restrict acc, const float* __restrict p, const T* const* v,
                             int64_t tile, int64_t d, int64_t i) {
  constexpr int U = kValueSplit;
  V a[GB][U];
  for (int g = 0; g < GB; ++g)
    for (int u = 0; u < U; ++u) a[g][u] = V{};  // not "= {}": see skinny_gemm.cpp
  // A vector load, not memcpy: tuned for 256-bit moves, GCC copied 64 bytes as two halves
  // into the stack slot of a[g][0], then read it back whole, a store-forwarding stall per row
  // and chunk (docs/cpu_kernels.md#attention).
  for (int g = 0; g < GB; ++g) a[g][0] = load_vec<V>(acc + g * d + i);
  int64_t j = 0;
  V vv;
  for (; j + U <= tile; j += U)
    for (int u = 0; u < U; ++u) {
      load_into(vv, v[j + u] + i);
      for (int g = 0; g < GB; ++g) a[g][u] += p[g * kKeyTile + j + u] * vv;
    }
  for (int u = 0; u < U; ++u)  // the last keys, each still to its own partial sum
    if (j + u < tile) {
      load_into(vv, v[j + u] + i);
      for (int g = 0; g < GB; ++g) a[g][u] += p[g * kKeyTile + j + u] * vv;
    }
  for (int g = 0; g < GB; ++g) {
    for (int u = 1; u < U; ++u) a[g][0] += a[g][u];
    std::memcpy(acc + g * d + i, &a[g][0], sizeof(V));
  }
}

template <int GB, typename T>
inline void accumulate(float* __restrict acc, const float* __restrict p, const T* const* v,
                       int64_t tile, int64_t d) {
  int64_t i = 0;
  if constexpr (isa::kVecFloats >= 16)
    for (; i + 16 <= d; i += 16) accumulate_chunk<GB, vfloat16>(acc, p, v, tile, d, i);
  for (; i + kW <= d; i += kW) accumulate_chunk<GB, vfloat>(acc, p, v, tile, d, i);
  for (; i < d; ++i)
    for (int64_t j = 0; j < tile; ++j)
      for (int g = 0; g < GB; ++g) acc[g * d + i] += p[g * kKeyTile + j] * static_cast<float>(v[j][i]);
}

// Scores of RB rows against a whole tile of keys held transposed (kt[i * kKeyTile + j] =
// key j, element i; zero past the tile): per element, four vectors of keys times one broadcast
// query element per row. No horizontal sums, so it wins when many rows share the keys
// (prefill chunks) and the transposition is amortised.
//
// The sum goes in score8's order, so that a row's score does not depend on which path scored it
// (a token scored in a decode and again in a prefill chunk after a preemption, or chunked
// differently by another schedule, gets the same bits): element i goes to the partial sum of
// lane i % 8, taken in order, the 8 partials are added by sum8's tree, then the elements past
// the last full 8 in order.
template <int RB>
inline void score_transposed(const float* __restrict q, const float* __restrict kt, int64_t d,
                             float* out) {
  static_assert(kKeyTile == 4 * kW, "one row of scores is four vectors");
  const int64_t full = d - d % kW;  // elements summed lane by lane
  vfloat part[kW][RB][4];           // per lane's partial sums (L1, not registers)
  for (int64_t lane = 0; lane < kW; ++lane) {
    vfloat a[RB][4];
    for (int r = 0; r < RB; ++r)
      for (int c = 0; c < 4; ++c) a[r][c] = vfloat{};
    for (int64_t i = lane; i < full; i += kW) {
      const float* kr = kt + i * kKeyTile;
      const vfloat k0 = load(kr), k1 = load(kr + kW), k2 = load(kr + 2 * kW), k3 = load(kr + 3 * kW);
      for (int r = 0; r < RB; ++r) {
        const float qe = q[r * d + i];
        a[r][0] += qe * k0;
        a[r][1] += qe * k1;
        a[r][2] += qe * k2;
        a[r][3] += qe * k3;
      }
    }
    for (int r = 0; r < RB; ++r)
      for (int c = 0; c < 4; ++c) part[lane][r][c] = a[r][c];
  }
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < 4; ++c) {
      const vfloat (&p)[kW][RB][4] = part;
      vfloat sum = ((p[0][r][c] + p[1][r][c]) + (p[2][r][c] + p[3][r][c])) +
                   ((p[4][r][c] + p[5][r][c]) + (p[6][r][c] + p[7][r][c]));
      for (int64_t i = full; i < d; ++i) sum += q[r * d + i] * load(kt + i * kKeyTile + c * kW);
      store(out + r * kKeyTile + c * kW, sum);
    }
}

template <typename T>
void score_group_transposed(const float* q, const T* const* k, int64_t tile, int64_t rows,
                            int64_t d, float* kt, float* out) {
  // Key by key: reads stream through memory, the scattered writes stay in L1.
  for (int64_t j = 0; j < tile; ++j)
    for (int64_t i = 0; i < d; ++i) kt[i * kKeyTile + j] = static_cast<float>(k[j][i]);
  for (int64_t j = tile; j < kKeyTile; ++j)
    for (int64_t i = 0; i < d; ++i) kt[i * kKeyTile + j] = 0.f;
  for (int64_t r = 0; r < rows; r += kTransposedRows) {
    switch (std::min<int64_t>(kTransposedRows, rows - r)) {
      case 4: score_transposed<4>(q + r * d, kt, d, out + r * kKeyTile); break;
      case 3: score_transposed<3>(q + r * d, kt, d, out + r * kKeyTile); break;
      case 2: score_transposed<2>(q + r * d, kt, d, out + r * kKeyTile); break;
      default: score_transposed<1>(q + r * d, kt, d, out + r * kKeyTile); break;
    }
  }
}

// The group's rows against 8 keys, in passes of kScoreRows rows (2 on AVX-512: 16 accumulators
// and the keys fill the vector registers).
template <typename T>
void score_group(const float* q, const T* const* k, int64_t rows, int64_t d, float* out) {
  for (int64_t g = 0; g < rows; g += kScoreRows) {
    if (kScoreRows >= 2 && rows - g >= 2)
      score8<2>(q + g * d, k, d, out + g * kKeyTile);
    else
      score8<1>(q + g * d, k, d, out + g * kKeyTile);
  }
}

// Always inlined: with two instantiations of the kernel's loop calling it (plain layers and
// layers with Features) GCC stopped inlining it into either, a call per kv head and tile that
// the plain loop never had.
template <typename T>
__attribute__((always_inline)) inline void accumulate_group(float* acc, const float* p, const T* const* v,
                                                            int64_t tile, int64_t rows, int64_t d) {
  // Passes of kValueRows rows (4 x kValueSplit accumulators fill AVX-512's registers, 2 x
  // kValueSplit AVX2's), the rest by 2, 1.
  for (int64_t g = 0; g < rows;) {
    float* a = acc + g * d;
    const float* pg = p + g * kKeyTile;
    const int64_t left = rows - g;
    if (kValueRows >= 4 && left >= 4) {
      accumulate<4>(a, pg, v, tile, d);
      g += 4;
    } else if (left >= 2) {
      accumulate<2>(a, pg, v, tile, d);
      g += 2;
    } else {
      accumulate<1>(a, pg, v, tile, d);
      g += 1;
    }
  }
}

// e^x for x <= 0, relative error ~2e-7 (glibc's expf is a call per element; this vectorises):
// x = n ln2 + r with |r| <= ln2 / 2, e^r by its Taylor series to r^6, 2^n through the exponent.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.f);  // keeps 2^n a normal float
  const float magic = 12582912.f;  // 1.5 * 2^23: adding it rounds to an integer in the mantissa
  const float t = x * 1.44269504f + magic;
  const float n = t - magic;
  const float r = x - n * 0.693145751953125f - n * 1.428606765330187e-06f;
  const float p = 1.f + r * (1.f + r * (0.5f + r * (1.f / 6 + r * (1.f / 24 + r * (1.f / 120 + r * (1.f / 720))))));
  int32_t bits;
  std::memcpy(&bits, &t, sizeof bits);  // low mantissa bits of t hold n (two's complement)
  const int32_t scale_bits = (bits - 0x4B400000 + 127) << 23;
  float scale;
  std::memcpy(&scale, &scale_bits, sizeof scale);
  return p * scale;
}

// exp_nonpositive of eight lanes, the same steps in vector arithmetic.
inline vfloat exp_nonpositive(vfloat x) {
  const vfloat floor = vfloat{} - 87.f, magic = vfloat{} + 12582912.f;
  x = x < floor ? floor : x;
  const vfloat t = x * 1.44269504f + magic;
  const vfloat n = t - magic;
  const vfloat r = x - n * 0.693145751953125f - n * 1.428606765330187e-06f;
  const vfloat p = 1.f + r * (1.f + r * (0.5f + r * (1.f / 6 + r * (1.f / 24 + r * (1.f / 120 + r * (1.f / 720))))));
  vu32 bits;
  std::memcpy(&bits, &t, sizeof bits);
  const vu32 scale_bits = (bits - 0x4B400000u + 127u) << 23;
  vfloat scale;
  std::memcpy(&scale, &scale_bits, sizeof scale);
  return p * scale;
}

// A row's softmax weights in a tile: s[j] = e^(s[j] - row_max) for j in [lo, hi), 0 elsewhere in
// the tile's kKeyTile scores; returns their sum (lane sums over the four vectors, then the lanes
// in order: the same on every ISA). Written out because GCC left the plain loop scalar in the
// x86-64-v3 build (~25 scalar instructions per score; AVX-512's masks let it vectorise there).
inline float exp_tile(float* s, int64_t lo, int64_t hi, float row_max) {
  vfloat sum = vfloat{};
  for (int64_t c = 0; c < kKeyTile; c += kW) {
    const vfloat e = exp_nonpositive(load(s + c) - row_max);
    const vfloat w = lanes_within(c, lo, hi) ? e : vfloat{};
    store(s + c, w);
    sum += w;
  }
  return hsum(sum);
}

// tanh(x), relative error ~3e-7, vectorisable (glibc's tanhf is a call per element; soft-capping
// takes one per score): (1 - e^-2|x|) / (1 + e^-2|x|) by exp_nonpositive, except below 0.25,
// where that difference would cancel and tanh's odd Taylor series to x^9 is exact to ~1e-8.
inline float tanh_approx(float x) {
  const float a = std::fabs(x);
  const float e = exp_nonpositive(-2.f * a);
  const float far = (1.f - e) / (1.f + e);
  const float a2 = a * a;
  const float near =
      a * (1.f + a2 * (-1.f / 3 + a2 * (2.f / 15 + a2 * (-17.f / 315 + a2 * (62.f / 2835)))));
  return std::copysign(a < 0.25f ? near : far, x);
}

}  // namespace paged_math
