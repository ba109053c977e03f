// The arithmetic of paged_attention.cpp: 8-float vectors (GCC/Clang vector extensions, so AVX,
// AVX-512VL or NEON as the compiler sees fit), the small score and value GEMMs, a vectorisable
// exp. Everything works on float; K/V of any of the cache dtypes are widened on load.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace paged_math {


constexpr int64_t kKeyTile = 32;   // keys scored before one softmax rescale

// Eight floats in a register (GCC/Clang vector extensions: AVX, NEON, or two SSE halves).
// head_dim is a multiple of 8 in every model we serve; other sizes take the scalar loops.
constexpr int64_t kW = 8;
typedef float vfloat __attribute__((vector_size(kW * sizeof(float))));
typedef uint16_t vu16 __attribute__((vector_size(kW * sizeof(uint16_t))));
typedef uint32_t vu32 __attribute__((vector_size(kW * sizeof(uint32_t))));

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
  vfloat v;
  for (int64_t i = 0; i < kW; ++i) v[i] = static_cast<float>(p[i]);
  return v;
}
inline void store(float* p, vfloat v) { std::memcpy(p, &v, sizeof v); }


inline float hsum(vfloat v) {
  float s = 0.f;
  for (int64_t i = 0; i < kW; ++i) s += v[i];
  return s;
}

// Scores of GB query rows (one kv head's group, pre-scaled, row stride d) against 4 keys:
// 4 x GB dot products sharing every load of q and k (a tiny GEMM in registers).
// out[g * kKeyTile + j] for j < 4; k[j] points at the keys' kv head.
template <int GB, typename T>
inline void score4(const float* __restrict q, const T* const* k, int64_t d, float* out) {
  vfloat a[GB][4] = {};
  int64_t i = 0;
  for (; i + kW <= d; i += kW) {
    const vfloat k0 = load(k[0] + i), k1 = load(k[1] + i), k2 = load(k[2] + i), k3 = load(k[3] + i);
    for (int g = 0; g < GB; ++g) {
      const vfloat qv = load(q + g * d + i);
      a[g][0] += qv * k0;
      a[g][1] += qv * k1;
      a[g][2] += qv * k2;
      a[g][3] += qv * k3;
    }
  }
  for (int g = 0; g < GB; ++g)
    for (int j = 0; j < 4; ++j) {
      float s = hsum(a[g][j]);
      for (int64_t t = i; t < d; ++t) s += q[g * d + t] * static_cast<float>(k[j][t]);
      out[g * kKeyTile + j] = s;
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

template <int GB, typename T>
inline void accumulate(float* __restrict acc, const float* __restrict p, const T* const* v,
                       int64_t tile, int64_t d) {
  constexpr int U = kValueSplit;
  int64_t i = 0;
  for (; i + kW <= d; i += kW) {
    vfloat a[GB][U] = {};
    for (int g = 0; g < GB; ++g) a[g][0] = load(acc + g * d + i);
    int64_t j = 0;
    for (; j + U <= tile; j += U)
      for (int u = 0; u < U; ++u) {
        const vfloat vv = load(v[j + u] + i);
        for (int g = 0; g < GB; ++g) a[g][u] += p[g * kKeyTile + j + u] * vv;
      }
    for (int u = 0; u < U; ++u)  // the last keys, each still to its own partial sum
      if (j + u < tile) {
        const vfloat vv = load(v[j + u] + i);
        for (int g = 0; g < GB; ++g) a[g][u] += p[g * kKeyTile + j + u] * vv;
      }
    for (int g = 0; g < GB; ++g) {
      for (int u = 1; u < U; ++u) a[g][0] += a[g][u];
      store(acc + g * d + i, a[g][0]);
    }
  }
  for (; i < d; ++i)
    for (int64_t j = 0; j < tile; ++j)
      for (int g = 0; g < GB; ++g) acc[g * d + i] += p[g * kKeyTile + j] * static_cast<float>(v[j][i]);
}

// Scores of RB rows against a whole tile of keys held transposed (kt[i * kKeyTile + j] =
// key j, element i; zero past the tile): per element, four vectors of keys times one broadcast
// query element per row. No horizontal sums, so it wins when many rows share the keys
// (prefill chunks) and the transposition is amortised.
template <int RB>
inline void score_transposed(const float* __restrict q, const float* __restrict kt, int64_t d,
                             float* out) {
  static_assert(kKeyTile == 4 * kW, "one row of scores is four vectors");
  vfloat a[RB][4] = {};
  for (int64_t i = 0; i < d; ++i) {
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
    for (int c = 0; c < 4; ++c) store(out + r * kKeyTile + c * kW, a[r][c]);
}

template <typename T>
void score_group_transposed(const float* q, const T* const* k, int64_t tile, int64_t rows,
                            int64_t d, float* kt, float* out) {
  // Key by key: reads stream through memory, the scattered writes stay in L1.
  for (int64_t j = 0; j < tile; ++j)
    for (int64_t i = 0; i < d; ++i) kt[i * kKeyTile + j] = static_cast<float>(k[j][i]);
  for (int64_t j = tile; j < kKeyTile; ++j)
    for (int64_t i = 0; i < d; ++i) kt[i * kKeyTile + j] = 0.f;
  for (int64_t r = 0; r < rows; r += 4) {
    switch (std::min<int64_t>(4, rows - r)) {
      case 4: score_transposed<4>(q + r * d, kt, d, out + r * kKeyTile); break;
      case 3: score_transposed<3>(q + r * d, kt, d, out + r * kKeyTile); break;
      case 2: score_transposed<2>(q + r * d, kt, d, out + r * kKeyTile); break;
      default: score_transposed<1>(q + r * d, kt, d, out + r * kKeyTile); break;
    }
  }
}

// The group's rows in passes of up to 4 (register pressure), dispatched to the templates.
template <typename T>
void score_group(const float* q, const T* const* k, int64_t rows, int64_t d, float* out) {
  for (int64_t g = 0; g < rows; g += 4) {
    const float* qg = q + g * d;
    float* o = out + g * kKeyTile;
    switch (std::min<int64_t>(4, rows - g)) {
      case 4: score4<4>(qg, k, d, o); break;
      case 3: score4<3>(qg, k, d, o); break;
      case 2: score4<2>(qg, k, d, o); break;
      default: score4<1>(qg, k, d, o); break;
    }
  }
}

template <typename T>
void accumulate_group(float* acc, const float* p, const T* const* v, int64_t tile, int64_t rows,
                      int64_t d) {
  // Passes of 4 rows (4 x kValueSplit accumulators fill the vector registers), the rest by 2, 1.
  for (int64_t g = 0; g < rows;) {
    float* a = acc + g * d;
    const float* pg = p + g * kKeyTile;
    const int64_t left = rows - g;
    if (left >= 4) {
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

}  // namespace paged_math
