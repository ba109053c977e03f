// bf16 panels times activations rounded to bf16: the engine's quantization_activations=bfloat16
// (the activations in the weights' own precision, as vLLM and transformers run a bf16 model).
// Two implementations over one weight layout, chosen by what the build's CPU has:
// - AMX tiles (Intel Sapphire Rapids and later: AMX-BF16). A bf16 tile product (tdpbf16ps: 16
//   rows x 16 columns x 32 k per instruction, float32 sums) does in one instruction what the
//   float path's widening FMAs do in 32, and vLLM's oneDNN uses it for every bf16 matmul.
// - AVX512-BF16 dot products where the CPU has no AMX (AMD Zen 4, Intel Cooper Lake): vdpbf16ps
//   multiplies 16 columns' k pairs by a broadcast pair of x and adds both products to float32
//   sums, twice the multiply-adds of a float32 FMA, with no widening of the weights (oneDNN's
//   bf16 matmul on these CPUs). A row of a B tile below (16 columns' k pairs, 64 bytes) is one
//   zmm operand of it as it lies, so both read the same panels.
// The float path (quant_gemm.cpp) stays the exact one.
//
// The weight: bf16 panels in Intel's VNNI layout cut into whole B tiles (QuantizedWeight.to_vnni,
// "bf16_vnni"), [P, ceil(K / 32), 2048]: k block b of a panel is its 4 column tiles in turn,
// each 16 pair rows q of 16 columns c, column 16t + c's k = 32b + 2q, 2q + 1 at (t, q, c, 0..1):
// a row of B of tdpbf16ps (16 columns' k pairs, 64 bytes), so a B tile is 1 KiB in one piece
// and a panel is read in order, one 4 KiB block after another, zero k padding the last. (The float
// path's bf16 panels pair columns j and j + 32 instead: read in k pairs, its one-row path was
// slower (docs/cpu_kernels.md#bf16-tiles), so each path keeps its layout and a model holds the
// one its activations need.) x's rows are rounded to bf16 once per call (round to
// nearest even) into whole A tiles (Bf16Tiles), zeros padding K to whole blocks.
//
// AMX tiles: up to 16 rows, C0..C3 the 4 column tiles of a 64-column panel (16 rows x 16 float32
// each), A a 16 x 32 block of x's bf16, B one column tile's k block: per 32 k, one A load and,
// per column tile, one B load and one tdpbf16ps. More rows: 2 x 2 C tiles (32 rows x 32
// columns), each panel in two halves. A tile holds the call's rows up to 16 (TileConfig), 16
// with zero rows padding a partial block past that, and sums its k blocks in order; a row of a
// tile product is that row of A times B alone, so a row's sums never depend on how many rows
// share its tile: a row's result does not depend on its batch, as on every path of these
// kernels. Dot products: up to kDotRows rows x the panel's 4 column vectors of sums, per pair
// row one load of each column tile's row and one vdpbf16ps per row and column tile, a row's
// sums in the order of its k pairs whatever rows share the pass. Either differs from the float
// path's result by the rounding of x to bf16 (2^-9 relative per activation) and by its order
// of sums (float32); the two differ from each other in that order.
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#define PAGEDLLM_BF16_X 1  // bf16 activations: this build has one of the two implementations
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#define PAGEDLLM_AMX 1
#endif
#endif

#include "skinny_tiles.h"

namespace bf16gemm {

using skinny::kPanel;

#if defined(PAGEDLLM_BF16_X)
constexpr int64_t kTileRows = 16;       // rows of x per tile (and of C)
constexpr int64_t kTileK = 32;          // k per tile: 32 bf16 = 64 bytes, 16 pair rows of B
constexpr int64_t kColTile = 16;        // columns per C tile (per vector of dot products)
constexpr int64_t kBRowBytes = kColTile * 2 * 2;  // a row of B: 16 columns x 2 k x 2 bytes
constexpr int64_t kBTileBytes = kTileK / 2 * kBRowBytes;  // 16 pair rows: 1 KiB
constexpr int64_t kBlockBytes = kPanel / kColTile * kBTileBytes;  // a panel's 32 k: 4 KiB
// Panels per group: the thread's panels go in groups of about kGroupBytes of weights; each
// group is walked once per 16 or 32 rows of x (AMX; dot products: per pass of rows), so its weights stay in L2 across the rows and
// each row's outputs are written as one run of the group's columns. (Rows in chunks of 128,
// each walking the panels one by one, wrote y as 128-byte pieces a row apart: at 2,048 rows of
// 3072x512 the writes took half the time.)
constexpr int64_t kGroupBytes = 1 << 20;

// x's rows rounded to bf16, as A tiles: per group of rows (a grouped call's experts; one
// group otherwise) ceil(rows / 32) * 2 row blocks, each [ceil(K / 32) k blocks][16 rows][32 k],
// zeros padding. Each tile's 1 KiB is contiguous: tile loads of A and B both strided (x's rows,
// the panels' pair rows) ran far slower than those with one side contiguous
// (docs/cpu_kernels.md#bf16-tiles).
struct Bf16Tiles {
  std::vector<uint16_t> data;
  std::vector<int64_t> first_block;  // per group: its first row block
  int64_t k_blocks;
  const char* tile(int64_t row_block, int64_t k_block) const {
    return reinterpret_cast<const char*>(data.data() +
                                         (row_block * k_blocks + k_block) * kTileRows * kTileK);
  }
};

// Rows [start[g], start[g] + rows[g]) of x [*, K] as group g's tiles: float32 x rounded, bf16
// x (uint16_t bits: a bf16 model's activations) as it is.
template <class In>
inline Bf16Tiles round_rows(const In* xp, int64_t K, const std::vector<int64_t>& start,
                            const std::vector<int64_t>& rows) {
  const int64_t G = static_cast<int64_t>(rows.size());
  const int64_t k_blocks = (K + kTileK - 1) / kTileK;
  std::vector<int64_t> first(G + 1, 0);
  for (int64_t g = 0; g < G; ++g)
    first[g + 1] = first[g] + (rows[g] + 2 * kTileRows - 1) / (2 * kTileRows) * 2;
  Bf16Tiles t{std::vector<uint16_t>(first[G] * k_blocks * kTileRows * kTileK, 0), first, k_blocks};
  at::parallel_for(0, G, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t m = 0; m < rows[g]; ++m) {
        const In* x = xp + (start[g] + m) * K;
        uint16_t* out = t.data.data() +
                        ((first[g] + m / kTileRows) * k_blocks * kTileRows + m % kTileRows) * kTileK;
        for (int64_t kb = 0; kb < k_blocks; ++kb, out += kTileRows * kTileK) {
          const int64_t k0 = kb * kTileK, kl = std::min(kTileK, K - k0);
          if constexpr (std::is_same_v<In, uint16_t>) {
            std::memcpy(out, x + k0, kl * sizeof(uint16_t));
            continue;
          }
          int64_t k = 0;
          for (; k + 16 <= kl; k += 16) {
            const __m256bh h = _mm512_cvtneps_pbh(_mm512_loadu_ps(x + k0 + k));
            std::memcpy(out + k, &h, sizeof h);
          }
          for (; k < kl; ++k) out[k] = c10::BFloat16(x[k0 + k]).x;  // round to nearest even
        }
      }
  });
  return t;
}


// ``rows`` rows of C (``c``, rows of kPanel floats) into y's [rows, cols] at ``y`` (rows of N):
// float32 as they are; bf16 (uint16_t) plus ``bias`` (the panel's, or nullptr), rounded once.
inline void write_rows(const float* c, int64_t rows, int64_t cols, float* y, int64_t N,
                       const float*) {
  for (int64_t m = 0; m < rows; ++m) std::memcpy(y + m * N, c + m * kPanel, cols * sizeof(float));
}
inline void write_rows(const float* c, int64_t rows, int64_t cols, uint16_t* y, int64_t N,
                       const float* bias) {
  __m512 b[kPanel / 16];
  for (int64_t j = 0; j < kPanel; j += 16) {  // the panel's columns < cols only: bias ends at N
    const int64_t valid = std::clamp<int64_t>(cols - j, 0, 16);
    b[j / 16] = bias ? _mm512_maskz_loadu_ps(__mmask16((1u << valid) - 1), bias + j)
                     : _mm512_setzero_ps();
  }
  for (int64_t m = 0; m < rows; ++m) {
    for (int64_t j = 0; j < kPanel; j += 16) {
      __m512 v = _mm512_loadu_ps(c + m * kPanel + j);
      if (bias) v = _mm512_add_ps(v, b[j / 16]);  // (not + 0: -0 would become +0)
      const __m256bh h = _mm512_cvtneps_pbh(v);
      if (j + 16 <= cols) {  // stored straight (a memcpy per row was costly at many rows)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + m * N + j), (__m256i)h);
      } else if (j < cols) {
        _mm256_mask_storeu_epi16(y + m * N + j, __mmask16((1u << (cols - j)) - 1), (__m256i)h);
      }
    }
  }
}

#if defined(PAGEDLLM_AMX)
// The first pass over a panel (its first 16 or 32 rows' tile steps: a whole decode step's)
// touches the first two lines of the k block kPrefetchBlocks ahead: the hardware's streamer
// fetches within a 4 KiB page, one block, and learns a new page from its first accesses, so
// the touch starts each page's stream before the tiles need it; the tiles then read the block
// in order (its 4 B tiles one after another), as the streamer fetches it. Faster than the whole
// block prefetched into L1, whose prefetches waited for the L1's line fill buffers
// (docs/cpu_kernels.md#bf16-tiles).
constexpr int64_t kPrefetchBlocks = 4;

// The first two lines of the k block kPrefetchBlocks after block b of ``panel`` (past the
// thread's last panel: harmless, a prefetch never faults).
inline void prefetch_ahead(const char* panel, int64_t b) {
  const char* ahead = panel + (b + kPrefetchBlocks) * kBlockBytes;
  _mm_prefetch(ahead, _MM_HINT_T0);
  _mm_prefetch(ahead + 64, _MM_HINT_T0);
}

// Linux hands out AMX's tile state only to a process that asks (arch_prctl
// ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA); torch's oneDNN asks too, once per process.
inline bool permitted() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                                 18 /* XFEATURE_XTILEDATA */) == 0;
  return ok;
}

// The palette of every call: 8 tiles of 64 bytes a row (C: 16 float32, A: 32 bf16 k, B: 16 pair
// rows of 16 columns), 16 rows each, except that A and C (tiles 0-4 of the 16-row step) hold
// only the call's rows when they are fewer: a tile product then computes those rows alone (a
// decode step's expert has 1-4), and C is stored straight into y. Each row's sums are the same
// either way (a row of C is its row of A times B), so the bits do not change.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  explicit TileConfig(int64_t x_rows) {
    for (int t = 0; t < 8; ++t) {
      colsb[t] = 64;
      rows[t] = t < 5 ? x_rows : kTileRows;
    }
  }
};

// One tile step over k block b: C (tiles 0-3) += A (tile 4 from ``a``) x B (the panel's 4
// column tiles from ``blk``, through tiles 5-6): 16 rows x 64 columns. B is read with the
// streaming hint: each weight is used by one tile product per pass and should not evict x's
// tiles and the outputs.
inline void rows16_step(const char* a, const char* blk) {
  _tile_loadd(4, a, kTileK * 2);
  _tile_stream_loadd(5, blk, kBRowBytes);
  _tile_dpbf16ps(0, 4, 5);
  _tile_stream_loadd(6, blk + 1 * kBTileBytes, kBRowBytes);
  _tile_dpbf16ps(1, 4, 6);
  _tile_stream_loadd(5, blk + 2 * kBTileBytes, kBRowBytes);
  _tile_dpbf16ps(2, 4, 5);
  _tile_stream_loadd(6, blk + 3 * kBTileBytes, kBRowBytes);
  _tile_dpbf16ps(3, 4, 6);
}
// 32 rows x 32 columns (``blk``: the half's first B tile): C tiles 0-1 rows 0-15, 2-3 rows
// 16-31; A tiles 4-5, B tiles 6-7.
inline void rows32_step(const char* a0, const char* a1, const char* blk) {
  _tile_loadd(4, a0, kTileK * 2);
  _tile_stream_loadd(6, blk, kBRowBytes);
  _tile_dpbf16ps(0, 4, 6);
  _tile_stream_loadd(7, blk + kBTileBytes, kBRowBytes);
  _tile_dpbf16ps(1, 4, 7);
  _tile_loadd(5, a1, kTileK * 2);
  _tile_dpbf16ps(2, 5, 6);
  _tile_dpbf16ps(3, 5, 7);
}

// y[0:M, panels p0..p1) for group g's M rows of ``x`` (y at its first row's output) and one
// weight of panels ``w`` (bf16_vnni, ceil(K / 32) blocks each): one thread's share.
// Out: float (float32 y, a bias added by the caller) or uint16_t (bf16 y, ``bias`` [N] added
// here before the rounding, or nullptr).
template <class Out>
inline void panels_run(const uint16_t* w, int64_t K, const Bf16Tiles& x, int64_t g, int64_t M,
                       int64_t N, Out* yp, int64_t p0, int64_t p1, const float* bias = nullptr) {
  const int64_t k_blocks = (K + kTileK - 1) / kTileK;
  const int64_t panel_bytes = k_blocks * kBlockBytes;
  const int64_t group = std::max<int64_t>(1, kGroupBytes / panel_bytes);
  const bool wide = M > kTileRows;
  const TileConfig config(wide ? kTileRows : M);
  _tile_loadconfig(&config);
  alignas(64) float c[2 * kTileRows * kPanel];
  const int64_t step = wide ? 2 * kTileRows : kTileRows;
  for (int64_t g0 = p0; g0 < p1; g0 += group) {
    const int64_t g1 = std::min(p1, g0 + group);
    for (int64_t m0 = 0; m0 < M; m0 += step) {
      const int64_t rb = x.first_block[g] + m0 / kTileRows;
      const int64_t rows = std::min(step, M - m0);
      for (int64_t p = g0; p < g1; ++p) {
        const char* panel = reinterpret_cast<const char*>(w) + p * panel_bytes;
        const int64_t cols = std::min(kPanel, N - p * kPanel);
        // float32 C tiles straight into y where they fit whole, else (and bf16 y) through
        // ``c`` and write_rows.
        const bool whole = std::is_same_v<Out, float> && (rows == step || !wide) && cols == kPanel;
        float* out = whole ? reinterpret_cast<float*>(yp) + m0 * N + p * kPanel : c;
        const int64_t ld = whole ? N : kPanel;  // floats
        const int64_t ldb = ld * 4;
        if (wide) {
          for (int64_t half = 0; half < 2; ++half) {
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int64_t b = 0; b < k_blocks; ++b) {
              if (m0 == 0 && half == 0) prefetch_ahead(panel, b);  // (half 1: from L1/L2)
              rows32_step(x.tile(rb, b), x.tile(rb + 1, b),
                          panel + b * kBlockBytes + half * 2 * kBTileBytes);
            }
            float* oh = out + half * 2 * kColTile;
            _tile_stored(0, oh, ldb);
            _tile_stored(1, oh + kColTile, ldb);
            _tile_stored(2, oh + kTileRows * ld, ldb);
            _tile_stored(3, oh + kTileRows * ld + kColTile, ldb);
          }
        } else {
          _tile_zero(0);
          _tile_zero(1);
          _tile_zero(2);
          _tile_zero(3);
          for (int64_t b = 0; b < k_blocks; ++b) {
            prefetch_ahead(panel, b);
            rows16_step(x.tile(rb, b), panel + b * kBlockBytes);
          }
          _tile_stored(0, out + 0 * kColTile, ldb);
          _tile_stored(1, out + 1 * kColTile, ldb);
          _tile_stored(2, out + 2 * kColTile, ldb);
          _tile_stored(3, out + 3 * kColTile, ldb);
        }
        if (!whole)
          write_rows(c, rows, cols, yp + m0 * N + p * kPanel, N, bias ? bias + p * kPanel : nullptr);
      }
    }
  }
  _tile_release();
}
#else  // AVX512-BF16 dot products
// Rows per pass of the dot products: R rows x 4 column vectors of sums, plus the 4 weight
// vectors of a pair row and a broadcast of x, within AVX-512's 32 registers at R = 6.
constexpr int64_t kDotRows = 6;
// The dot products' groups of panels: half of kGroupBytes, so that a group stays in a Zen 4
// core's 1 MiB of L2 beside x and y across the passes of rows (1 MiB groups were slower:
// docs/cpu_kernels.md#bf16-tiles).
constexpr int64_t kDotGroupBytes = kGroupBytes / 2;

// R rows of x (``xr[r]``: row r's bf16 in its A tiles, k block 0; block b is kTileRows *
// kTileK elements on) times one panel: c[r][0:kPanel] float32 sums. ``prefetch``: the first
// pass over the panel, which prefetches every line of the block kDotPrefetchBlocks ahead, 4
// lines per pair row: at one row the fastest of the prefetches tried, where the AMX tiles' touch
// of two lines or none were slower (docs/cpu_kernels.md#bf16-tiles).
constexpr int64_t kDotPrefetchBlocks = 4;
template <int R>
inline void dot_rows(const uint16_t* const* xr, const char* panel, int64_t k_blocks,
                     bool prefetch, float* c) {
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < 4; ++t) acc[r][t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < k_blocks; ++b) {
    const char* blk = panel + b * kBlockBytes;
    const int64_t xo = b * kTileRows * kTileK;
    for (int64_t q = 0; q < kTileK / 2; ++q) {
      if (prefetch)
        for (int64_t line = 0; line < 4; ++line)
          _mm_prefetch(blk + kDotPrefetchBlocks * kBlockBytes + (4 * q + line) * 64, _MM_HINT_T0);
      __m512bh w[4];
      for (int t = 0; t < 4; ++t)
        w[t] = (__m512bh)_mm512_loadu_si512(blk + t * kBTileBytes + q * kBRowBytes);
      for (int r = 0; r < R; ++r) {
        int32_t pair;  // x's k pair 2q, 2q + 1 of this block, as one 32-bit lane
        std::memcpy(&pair, xr[r] + xo + 2 * q, sizeof pair);
        const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
        for (int t = 0; t < 4; ++t) acc[r][t] = _mm512_dpbf16_ps(acc[r][t], xv, w[t]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < 4; ++t) _mm512_storeu_ps(c + r * kPanel + t * kColTile, acc[r][t]);
}

// y[0:M, panels p0..p1) for group g's M rows of ``x`` (y at its first row's output) and one
// weight of panels ``w`` (bf16_vnni, ceil(K / 32) blocks each): one thread's share, as the AMX
// version's (the same groups of panels, so a group's weights stay in L2 across the passes of
// rows), in passes of up to kDotRows rows, the rows split evenly between the passes.
template <class Out>
inline void panels_run(const uint16_t* w, int64_t K, const Bf16Tiles& x, int64_t g, int64_t M,
                       int64_t N, Out* yp, int64_t p0, int64_t p1, const float* bias = nullptr) {
  const int64_t k_blocks = (K + kTileK - 1) / kTileK;
  const int64_t panel_bytes = k_blocks * kBlockBytes;
  const int64_t group = std::max<int64_t>(1, kDotGroupBytes / panel_bytes);
  const int64_t passes = (M + kDotRows - 1) / kDotRows;
  alignas(64) float c[kDotRows * kPanel];
  const uint16_t* xr[kDotRows];
  for (int64_t g0 = p0; g0 < p1; g0 += group) {
    const int64_t g1 = std::min(p1, g0 + group);
    for (int64_t i = 0; i < passes; ++i) {
      const int64_t m0 = M * i / passes, rows = M * (i + 1) / passes - m0;
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t m = m0 + r;
        xr[r] = reinterpret_cast<const uint16_t*>(x.tile(x.first_block[g] + m / kTileRows, 0)) +
                m % kTileRows * kTileK;
      }
      for (int64_t p = g0; p < g1; ++p) {
        const char* panel = reinterpret_cast<const char*>(w) + p * panel_bytes;
        const bool first = i == 0;
        switch (rows) {
          case 1: dot_rows<1>(xr, panel, k_blocks, first, c); break;
          case 2: dot_rows<2>(xr, panel, k_blocks, first, c); break;
          case 3: dot_rows<3>(xr, panel, k_blocks, first, c); break;
          case 4: dot_rows<4>(xr, panel, k_blocks, first, c); break;
          case 5: dot_rows<5>(xr, panel, k_blocks, first, c); break;
          default: dot_rows<6>(xr, panel, k_blocks, first, c); break;
        }
        const int64_t cols = std::min(kPanel, N - p * kPanel);
        write_rows(c, rows, cols, yp + m0 * N + p * kPanel, N, bias ? bias + p * kPanel : nullptr);
      }
    }
  }
}
#endif
#endif

}  // namespace bf16gemm
