// The register tiles of the linear kernels and their walk over 64-column panels, shared by the
// float32 kernel (skinny_gemm.cpp) and the kernels of weights held in other formats
// (quant_gemm.cpp: bf16/fp16 panels, block-quantized q8/q4 panels). Why the tiles and the walk
// look as they do: skinny_gemm.cpp's opening comment.
//
// A weight format is a Source. Float32 panels (kInPlace) give ``block(p, k0)``, a pointer to
// rows k0.. of panel p as [k][kPanel] floats. Any other format gives ``code(p, k, v)``, vector v
// of row k of panel p widened to floats, with (kScaled, kOffset) ``scale(p, k, v)`` /
// ``offset(p, k, v)``, vector v of row k's group's, and ``group_size()``, and
// ``row_bytes(p, k)``, where the row lies
// (kRowBytes long): a k block is converted into an L1 buffer (kBlockK x kPanel floats) that
// every row tile of the chunk reads, or, for a single row, straight into registers. Formats
// whose codes lie in quads of 4 k (kQuads: q8/q4) also give ``quad(p, k / 4, v, f)``, the 4
// rows' vectors v from one load, which both conversions use. Both compute a weight by
// ``value_of``, so it is the same float whatever the row count, and every path sums in the
// same order: a row's result does not depend on its batch in any format.
//
// The walk: ``split_grouped_panels`` splits one weight's panels, or several weights' (a
// mixture-of-experts layer's experts, each over its own rows), by cost into one contiguous run
// per thread, for these tiles, int8_gemm.h's and bf16_gemm.h's alike.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#include "isa.h"
#include "parallel_work.h"

namespace skinny {

constexpr int64_t kW = isa::kVecFloats;     // floats per vector register
constexpr int64_t kPanel = 64;              // output columns per panel (every ISA: one layout)
constexpr int64_t kBlockK = 64;             // k per block: 64 x 64 floats = 16 KiB of weights
// Two register tiles, both over a k block in L1, chosen by the row count; each holds kTileAcc
// accumulators, about three quarters of the vector registers (the rest hold the block's weight
// vectors and a broadcast of x).
// AVX-512 (32 zmm, 24 accumulators): many rows (prefill): 6 rows x a whole panel row (4
// vectors), so each k step loads 4 weight vectors and 6 broadcasts per 24 FMAs. Few rows
// (decode): 12 rows x half a panel row (2 vectors), the panel's two halves one after the other,
// so 32 rows take 3 tiles per half, not 6 per panel (fewer, longer tiles keep the weight stream
// steady). Up to 12 rows the 6 x 4 tile again (the whole panel row, as AVX2's tiny tile: each k
// block read row by row, as it lies, not in two half-row passes), which a mixture-of-experts
// layer's few rows per expert favour.
// AVX2 (16 ymm, 12 accumulators): 6 rows x 2 vectors (a quarter of a panel row) from 5 rows up;
// up to 12 rows, 1 row x the whole panel row (8 vectors: 8 independent accumulators where a
// 1-row 6 x 2 tile would have 2 chains waiting on their FMA latency). It reads each k block row
// by row, as it lies, one pass per row of x, where the 6 x 2 tile makes four strided passes over
// the block. Each tile and bound is the faster one measured: docs/cpu_kernels.md#register-tiles.
#if defined(__AVX512F__)
constexpr int64_t kTileAcc = 24;
constexpr int64_t kTinyRows = 12;
constexpr int kTinyV = 4, kFewV = 2, kManyV = 4;
#else
constexpr int64_t kTileAcc = 12;
constexpr int64_t kTinyRows = 12;
constexpr int kTinyV = 8, kFewV = 2, kManyV = 2;
#endif
constexpr int64_t kTileFloats = kTileAcc * kW;
constexpr int64_t kFewRows = 64;            // up to this many rows: the few-rows tile
// Row tiles starting in the first kPrefetchRows rows (all of a decode batch of <= 32) prefetch
// the next k block, the line of it they are about to read in this one (one block ahead: nearer
// or further, or the first tile alone, was slower). With more rows each block is reused long
// enough that the stream is not the limit, and more prefetches only take issue slots
// (docs/cpu_kernels.md#register-tiles).
constexpr int64_t kPrefetchRows = 32;
// Up to kPairedRows rows (a decode step's expert, a batch-1 dense layer), float32 panels go in
// pairs: one tile of kPairRows rows runs over two neighbouring panels' blocks at once, so the
// thread reads two weight streams instead of one, without software prefetch: one stream per
// thread left memory bandwidth unused (docs/cpu_kernels.md#panel-pairs). Past 6 rows a block's FMAs, not its stream, bound the tile; the prefetching tiles stay. AVX2
// has no pairs: a panel row is 8 ymm there, two panels' would be 16 accumulators, every register.
constexpr int64_t kPairRows = kTileAcc / (2 * (kPanel / kW));
constexpr int64_t kPairedRows = kPairRows > 0 ? 6 : 0;

constexpr int64_t kPrefetchFloats = kBlockK * kPanel;
constexpr int64_t kLineFloats = 16;         // a 64-byte cache line
// Rows per chunk. A panel is walked once per chunk, so a chunk's rows of x (<= 120 x K floats)
// stay in L2 across the thread's panels, and its outputs (15-30 KiB) in L1 across a panel's k
// blocks; the weights are read once per chunk, from L3 after the first (a prefill's layer is a
// few MB). One chunk of all rows would read x and the outputs from L3 for every panel
// (docs/cpu_kernels.md#register-tiles).
constexpr int64_t kFewChunkRows = 120;
constexpr int64_t kManyChunkRows = 60;

typedef float vfloat __attribute__((vector_size(kW * sizeof(float))));

inline vfloat load(const float* p) {
  vfloat v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void store(float* p, vfloat v) { std::memcpy(p, &v, sizeof v); }

// c_j[R][0:V*kW] (+)= x[R][0:kl] . w_j[0:kl][0:V*kW] for NP panels j at once: one register tile
// over one k block of each (w_j and c_j have rows of kPanel floats). The block is summed from
// zero and then added to c_j (FIRST: stored), which keeps the rounding error of a long K to that
// of a block plus K / kBlockK additions. A column's sum is the same chain of FMAs in k order
// whatever NP, R and V are, so every tile gives a row the same bits.
template <int NP, int R, int V, bool FIRST, bool PREFETCH>
inline void tile(const float* __restrict x, int64_t ldx, const float* const (&w)[NP], int64_t kl,
                 float* const (&c)[NP]) {
  // Unrolled so the accumulators live in registers from the start to the stores (with
  // ``= {}`` GCC kept a zeroed copy on the stack: a memset and 24 spills per tile call).
  vfloat acc[NP][R][V];
#pragma GCC unroll 2
  for (int j = 0; j < NP; ++j)
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
      for (int v = 0; v < V; ++v) acc[j][r][v] = vfloat{};
  for (int64_t k = 0; k < kl; ++k) {
    vfloat wv[NP][V];
    for (int j = 0; j < NP; ++j) {
      const float* wk = w[j] + k * kPanel;
      if (PREFETCH) {
        for (int64_t f = 0; f < V * kW; f += kLineFloats) __builtin_prefetch(wk + kPrefetchFloats + f);
      }
      for (int v = 0; v < V; ++v) wv[j][v] = load(wk + v * kW);
    }
    for (int r = 0; r < R; ++r) {
      const float a = x[r * ldx + k];
      for (int j = 0; j < NP; ++j)
        for (int v = 0; v < V; ++v) acc[j][r][v] += a * wv[j][v];
    }
  }
#pragma GCC unroll 2
  for (int j = 0; j < NP; ++j)
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
      for (int v = 0; v < V; ++v) {
        float* dst = c[j] + r * kPanel + v * kW;
        store(dst, FIRST ? acc[j][r][v] : load(dst) + acc[j][r][v]);
      }
}

template <int NP, int R, int V>
inline void tile_any(bool first, bool prefetch, const float* x, int64_t ldx,
                     const float* const (&w)[NP], int64_t kl, float* const (&c)[NP]) {
  if (first) {
    prefetch ? tile<NP, R, V, true, true>(x, ldx, w, kl, c)
             : tile<NP, R, V, true, false>(x, ldx, w, kl, c);
  } else {
    prefetch ? tile<NP, R, V, false, true>(x, ldx, w, kl, c)
             : tile<NP, R, V, false, false>(x, ldx, w, kl, c);
  }
}

// A tile of 1..R rows over NP panels (NP x R x V = kTileAcc accumulators): the row count must
// be a compile-time constant for the accumulators to stay in registers.
template <int NP, int V, int R = kTileFloats / (NP * V * kW)>
inline void tile_rows(int64_t rows, bool first, bool prefetch, const float* x, int64_t ldx,
                      const float* const (&w)[NP], int64_t kl, float* const (&c)[NP]) {
  if constexpr (R > 1) {
    if (rows < R) return tile_rows<NP, V, R - 1>(rows, first, prefetch, x, ldx, w, kl, c);
  }
  tile_any<NP, R, V>(first, prefetch, x, ldx, w, kl, c);
}

constexpr int64_t kRowVecs = kPanel / kW;  // vectors per panel row (one k)

// The float32 values of row k of panel p from ``src``'s codes: ``code`` widened, times the
// group's scale, plus its offset, in one fused multiply-add (the formats without them: the
// code itself). ``s`` and ``o``: the group's scales and offsets of the vector's columns.
template <class Source>
inline vfloat value_of(const vfloat& f, const vfloat& s, const vfloat& o) {
  if constexpr (Source::kOffset) return f * s + o;
  if constexpr (Source::kScaled) return f * s;
  return f;
}
template <class Source>
inline vfloat value(const Source& src, int64_t p, int64_t k, int v, const vfloat& s,
                    const vfloat& o) {
  return value_of<Source>(src.code(p, k, v), s, o);
}

template <class Source>
inline void prefetch_next_block(const Source& src, int64_t p, int64_t k) {
  const char* next = src.row_bytes(p, k) + kBlockK * Source::kRowBytes;
  for (int64_t b = 0; b < Source::kRowBytes; b += kLineFloats * 4) __builtin_prefetch(next + b);
}

// Rows k0..k0+kl of panel p converted by ``src`` into ``buf`` ([kl][kPanel] floats), the
// source's stream prefetched one block ahead (as the float32 tiles prefetch their panels).
// Sources whose codes lie in quads of 4 k (kQuads: q8/q4) give the 4 rows' vectors from one
// load (``quad(p, k / 4, v, f)``); k0 is then a multiple of 4.
template <class Source>
inline const float* convert_block(const Source& src, int64_t p, int64_t k0, int64_t kl,
                                  float* __restrict buf) {
  if constexpr (Source::kQuads) {
    // Where groups are whole quads, a group's scales (and offsets) are read at its first quad
    // and kept for the rest (reading some forms takes a few instructions: group_scales.h).
    const bool whole_quads = src.group_size() % 4 == 0;
    vfloat s[kRowVecs] = {}, o[kRowVecs] = {};
    for (int64_t k = k0; k < k0 + kl; k += 4) {
      const int rows = int(std::min<int64_t>(4, k0 + kl - k));  // < 4: the end of K
      for (int j = 0; j < rows; ++j) prefetch_next_block(src, p, k + j);
      if (whole_quads && (k == k0 || k % src.group_size() == 0)) {
#pragma GCC unroll 8
        for (int v = 0; v < kRowVecs; ++v) {
          if constexpr (Source::kScaled) s[v] = src.scale(p, k, v);
          if constexpr (Source::kOffset) o[v] = src.offset(p, k, v);
        }
      }
#pragma GCC unroll 8
      for (int v = 0; v < kRowVecs; ++v) {
        vfloat f[4];
        src.quad(p, k / 4, v, f);
#pragma GCC unroll 4
        for (int j = 0; j < 4; ++j) {
          if (j >= rows) break;
          vfloat sv = s[v], ov = o[v];
          if (!whole_quads) {
            if constexpr (Source::kScaled) sv = src.scale(p, k + j, v);
            if constexpr (Source::kOffset) ov = src.offset(p, k + j, v);
          }
          store(buf + (k + j - k0) * kPanel + v * kW, value_of<Source>(f[j], sv, ov));
        }
      }
    }
    return buf;
  }
  for (int64_t k = k0; k < k0 + kl; ++k) {
    prefetch_next_block(src, p, k);
#pragma GCC unroll 8
    for (int v = 0; v < kRowVecs; ++v) {
      const vfloat sv = Source::kScaled ? src.scale(p, k, v) : vfloat{};
      const vfloat ov = Source::kOffset ? src.offset(p, k, v) : vfloat{};
      store(buf + (k - k0) * kPanel + v * kW, value(src, p, k, v, sv, ov));
    }
  }
  return buf;
}

// One row times the k block of NP neighbouring panels p.. (c_j = c + j * c_stride), the weights
// converted in registers (no block buffer): a single row uses each converted value once, so
// storing it to L1 and loading it back would be half the work. A group's scales and offsets
// stay in registers across its k, so a scaled format's panel row goes in parts of kPart vectors
// (AVX2: two halves; 4 accumulators + 8 scales and offsets); an unscaled one (bf16/fp16) goes
// whole, kRowVecs independent sums. Two panels at once are two weight streams, as the float32
// pairs (panels_times_x). Bit for bit the tiles' result on convert_block's floats: the same
// values (``value``), summed per column from zero over the block in k order, then added to c.
template <class Source, int NP = 1>
inline void row_times_block(const float* __restrict x, const Source& src, int64_t p, int64_t k0,
                            int64_t kl, float* __restrict c, int64_t c_stride = 0) {
  constexpr int kPart = kRowVecs < 4 || !Source::kScaled ? kRowVecs : 4;
  for (int v0 = 0; v0 < kRowVecs; v0 += kPart) {
    vfloat acc[NP][kPart], s[NP][kPart], o[NP][kPart];
#pragma GCC unroll 2
    for (int j = 0; j < NP; ++j)
#pragma GCC unroll 8
      for (int v = 0; v < kPart; ++v) acc[j][v] = s[j][v] = o[j][v] = vfloat{};
    if constexpr (Source::kQuads) {
      // A quad's 4 k from one load, in the same k order per column; groups start at quads
      // (a multiple of 4 k; others take the row-by-row loop below).
      if (src.group_size() % 4 == 0) {
        for (int64_t k = k0; k < k0 + kl; k += 4) {
          const int rows = int(std::min<int64_t>(4, k0 + kl - k));  // < 4: the end of K
          if (v0 == 0)
            for (int j = 0; j < NP; ++j)
              for (int i = 0; i < rows; ++i) prefetch_next_block(src, p + j, k + i);
          if (k == k0 || k % src.group_size() == 0) {
#pragma GCC unroll 2
            for (int j = 0; j < NP; ++j)
#pragma GCC unroll 4
              for (int v = 0; v < kPart; ++v) {
                s[j][v] = src.scale(p + j, k, v0 + v);
                if constexpr (Source::kOffset) o[j][v] = src.offset(p + j, k, v0 + v);
              }
          }
          const float* a = x + (k - k0);
#pragma GCC unroll 2
          for (int j = 0; j < NP; ++j)
#pragma GCC unroll 4
            for (int v = 0; v < kPart; ++v) {
              vfloat f[4];
              src.quad(p + j, k / 4, v0 + v, f);
              if (rows == 4) {
#pragma GCC unroll 4
                for (int i = 0; i < 4; ++i)
                  acc[j][v] += a[i] * value_of<Source>(f[i], s[j][v], o[j][v]);
              } else {
                for (int i = 0; i < rows; ++i)
                  acc[j][v] += a[i] * value_of<Source>(f[i], s[j][v], o[j][v]);
              }
            }
        }
#pragma GCC unroll 2
        for (int j = 0; j < NP; ++j)
#pragma GCC unroll 4
          for (int v = 0; v < kPart; ++v) {
            float* dst = c + j * c_stride + (v0 + v) * kW;
            store(dst, k0 == 0 ? acc[j][v] : load(dst) + acc[j][v]);
          }
        continue;
      }
    }
    for (int64_t k = k0; k < k0 + kl; ++k) {
      if (v0 == 0)
        for (int j = 0; j < NP; ++j) prefetch_next_block(src, p + j, k);
      if constexpr (Source::kScaled) {
        if (k == k0 || k % src.group_size() == 0) {  // a new group: its scales (and offsets)
#pragma GCC unroll 2
          for (int j = 0; j < NP; ++j)
#pragma GCC unroll 4
            for (int v = 0; v < kPart; ++v) {
              s[j][v] = src.scale(p + j, k, v0 + v);
              if constexpr (Source::kOffset) o[j][v] = src.offset(p + j, k, v0 + v);
            }
        }
      }
      const float a = x[k - k0];
#pragma GCC unroll 2
      for (int j = 0; j < NP; ++j)
#pragma GCC unroll 8
        for (int v = 0; v < kPart; ++v) acc[j][v] += a * value(src, p + j, k, v0 + v, s[j][v], o[j][v]);
    }
#pragma GCC unroll 2
    for (int j = 0; j < NP; ++j)
#pragma GCC unroll 8
      for (int v = 0; v < kPart; ++v) {
        float* dst = c + j * c_stride + (v0 + v) * kW;
        store(dst, k0 == 0 ? acc[j][v] : load(dst) + acc[j][v]);
      }
  }
}

// Whether a chunk of ``rows`` rows goes over the panels in pairs: float32 panels up to
// kPairedRows rows (the tiles), another format at one row where its Source says so
// (``kPairedRow``, row_times_block): bf16 and q8 gain from two streams at one row, q4 loses
// (docs/cpu_kernels.md#panel-pairs).
template <class Source>
constexpr bool in_pairs(int64_t rows) {
  if constexpr (Source::kInPlace) return rows <= kPairedRows;
  else return Source::kPairedRow && rows == 1;
}

// y[0:M, panels p0..p1) for one tile shape: V vectors per tile (a panel row in kPanel / (V * kW)
// parts), kTileFloats / (V * kW) rows per tile, CHUNK rows per chunk; the weights' k blocks from
// ``src`` (see the top of this file). Float32 panels (Source::kInPlace) are read in place and
// prefetched by the tiles; other formats are converted once per block and chunk.
template <int V, int64_t CHUNK, class Source>
void panels_times_x(const float* xp, int64_t M, int64_t K, const Source& src, int64_t N,
                    float* yp, int64_t p0, int64_t p1) {
  constexpr int64_t TILE = kTileFloats / (V * kW);
  const int64_t chunk_rows = std::min(M, CHUNK);
  // The outputs of the panels in hand (one, or a pair), the chunk's rows.
  std::vector<float> c(2 * chunk_rows * kPanel);
  float* const c1 = c.data() + chunk_rows * kPanel;
  alignas(64) float buf[Source::kInPlace ? 1 : kBlockK * kPanel];
  for (int64_t r0 = 0; r0 < M; r0 += CHUNK) {
    const int64_t rows = std::min(CHUNK, M - r0);
    const float* xr = xp + r0 * K;
    const bool pairs = in_pairs<Source>(rows);
    for (int64_t p = p0, np = 1; p < p1; p += np) {
      np = pairs && p + 1 < p1 ? 2 : 1;
      for (int64_t k0 = 0; k0 < K; k0 += kBlockK) {
        const int64_t kl = std::min(kBlockK, K - k0);
        if constexpr (Source::kInPlace) {
          if constexpr (kPairRows > 0) {
            if (np == 2) {
              const float* const w[2] = {src.block(p, k0), src.block(p + 1, k0)};
              for (int64_t m0 = 0; m0 < rows; m0 += kPairRows) {
                float* const cm[2] = {c.data() + m0 * kPanel, c1 + m0 * kPanel};
                tile_rows<2, kRowVecs>(std::min(kPairRows, rows - m0), k0 == 0, false,
                                       xr + m0 * K + k0, K, w, kl, cm);
              }
              continue;
            }
          }
          const float* block = src.block(p, k0);
          for (int64_t col = 0; col < kPanel; col += V * kW)
            for (int64_t m0 = 0; m0 < rows; m0 += TILE) {
              const float* const w[1] = {block + col};
              float* const cm[1] = {c.data() + m0 * kPanel + col};
              tile_rows<1, V>(std::min(TILE, rows - m0), k0 == 0, m0 < kPrefetchRows,
                              xr + m0 * K + k0, K, w, kl, cm);
            }
        } else if (rows == 1) {
          np == 2 ? row_times_block<Source, 2>(xr + k0, src, p, k0, kl, c.data(), c1 - c.data())
                  : row_times_block<Source, 1>(xr + k0, src, p, k0, kl, c.data());
        } else {
          const float* block = convert_block(src, p, k0, kl, buf);
          for (int64_t col = 0; col < kPanel; col += V * kW)
            for (int64_t m0 = 0; m0 < rows; m0 += TILE) {
              const float* const w[1] = {block + col};
              float* const cm[1] = {c.data() + m0 * kPanel + col};
              tile_rows<1, V>(std::min(TILE, rows - m0), k0 == 0, false, xr + m0 * K + k0, K,
                              w, kl, cm);
            }
        }
      }
      for (int64_t j = 0; j < np; ++j) {  // panel p + j's outputs into y
        const int64_t cols = std::min(kPanel, N - (p + j) * kPanel);
        const float* cj = j ? c1 : c.data();
        for (int64_t m = 0; m < rows; ++m)
          std::memcpy(yp + (r0 + m) * N + (p + j) * kPanel, cj + m * kPanel,
                      cols * sizeof(float));
      }
    }
  }
}

// y[0:M, panels p0..p1) with the tile chosen by the row count M.
template <class Source>
void panels_run(const float* xp, int64_t M, int64_t K, const Source& src, int64_t N, float* yp,
                int64_t p0, int64_t p1) {
  if (M <= kTinyRows)
    panels_times_x<kTinyV, kFewChunkRows>(xp, M, K, src, N, yp, p0, p1);
  else if (M <= kFewRows)
    panels_times_x<kFewV, kFewChunkRows>(xp, M, K, src, N, yp, p0, p1);
  else
    panels_times_x<kManyV, kManyChunkRows>(xp, M, K, src, N, yp, p0, p1);
}

// Grouped: rows [start[g], start[g] + rows[g]) of x times group g's weight (P panels each) into
// the same rows of y -- a mixture-of-experts layer's experts over their tokens, in one parallel
// region. ``split_grouped_panels`` is the walk every grouped kernel shares (the float tiles
// below, int8_gemm.h's through quant_gemm.cpp): it hands ``run(g, p0, p1)`` group g's panels
// p0..p1, and ``run`` computes the group's rows over them as the kernel's own call would (the
// same tiles for the same row count), so a row's bits do not change with the grouping or the
// threads. The (group, panel) items are split over the threads by cost, so each thread streams
// one contiguous run of the groups' weights however unevenly the rows fall: an item costs its
// panel's bytes plus its rows' arithmetic, ``K * (kRowsPerPanelRead + rows)`` (at a few rows a
// panel is bound by its stream, at many by the FMAs; one panel read costs about as much as
// the FMAs of kRowsPerPanelRead rows on these cores, measured with the float32 panels and used
// for every format).
// The runs are claimed, not assigned: each thread takes the next unclaimed run until none is
// left, so when a thread comes late to the region (on 2 cores its core is often busy with the
// engine's other threads) the other takes its run too rather than wait for it at the end. One
// run per thread, not several smaller ones: each run starts its stream cold
// (docs/cpu_kernels.md#runs-of-panels-per-thread).
constexpr int64_t kRowsPerPanelRead = 10;

template <class Run>
void split_grouped_panels(const std::vector<int64_t>& rows, int64_t P, int64_t row_work, const Run& run) {
  const int64_t G = static_cast<int64_t>(rows.size());
  std::vector<int64_t> cost_before(G + 1, 0);  // the cost of groups 0..g-1, all their panels
  for (int64_t g = 0; g < G; ++g)
    cost_before[g + 1] = cost_before[g] + (rows[g] ? P * (kRowsPerPanelRead + rows[g]) : 0);
  const int64_t total = cost_before[G];
  if (total == 0) return;
  int64_t num_rows = 0;
  for (const int64_t r : rows) num_rows += r;
  const int64_t threads = std::min<int64_t>(parallel_work::threads_for(num_rows * row_work), total);
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t t = next++; t < threads; t = next++) {
      // Run t: the items whose cost starts in [lo, hi).
      const int64_t lo = total * t / threads, hi = total * (t + 1) / threads;
      for (int64_t g = 0; g < G; ++g) {
        if (!rows[g] || cost_before[g + 1] <= lo || cost_before[g] >= hi) continue;
        const int64_t item = kRowsPerPanelRead + rows[g];
        const int64_t p0 = std::max<int64_t>(0, (lo - cost_before[g] + item - 1) / item);
        const int64_t p1 = std::min<int64_t>(P, (hi - cost_before[g] + item - 1) / item);
        if (p0 < p1) run(g, p0, p1);
      }
    }
  });
}

// The walk over the float tiles: group g's weight is ``source(g)``, its rows computed by
// ``panels_run``, the tile chosen by the group's row count.
template <class SourceOf>
void grouped_panels_gemm(const float* xp, int64_t K, const std::vector<int64_t>& start,
                         const std::vector<int64_t>& rows, const SourceOf& source, int64_t N,
                         int64_t P, float* yp) {
  split_grouped_panels(rows, P, N * K, [&](int64_t g, int64_t p0, int64_t p1) {
    panels_run(xp + start[g] * K, rows[g], K, source(g), N, yp + start[g] * N, p0, p1);
  });
}

// y [M, N] = x [M, K] W^T for W held as P panels by ``src``: the grouped walk over one group of
// all the rows. Rows go in chunks, each over all of a thread's run of panels (one chunk at
// decode sizes); the tile by the row count.
template <class Source>
void panels_gemm(const float* xp, int64_t M, int64_t K, const Source& src, int64_t N, int64_t P,
                 float* yp) {
  grouped_panels_gemm(xp, K, {0}, {M}, [&](int64_t) { return src; }, N, P, yp);
}

// x's M rows of a grouped call by group: ``counts[g]`` consecutive rows for group g, the groups
// in order (a count may be 0); start[g] is the first. Checks the counts against M.
struct RowGroups {
  std::vector<int64_t> start, rows;
};

inline RowGroups row_groups(c10::IntArrayRef counts, int64_t M) {
  RowGroups r{std::vector<int64_t>(counts.size()),
              std::vector<int64_t>(counts.begin(), counts.end())};
  int64_t total = 0;
  for (size_t g = 0; g < counts.size(); ++g) {
    TORCH_CHECK(counts[g] >= 0, "row counts must not be negative");
    r.start[g] = total;
    total += counts[g];
  }
  TORCH_CHECK(total == M, "the row counts add up to ", total, ", x has ", M, " rows");
  return r;
}

// The checks and the output every panel GEMM shares: x [M, K] float32 against a weight of P
// panels [P, ceil(K / k_per_row), width] holding out_features rows (width: 64 values; the
// quad blocks of q8/q4: k_per_row 4, 256 or 128 bytes).
// ``done`` when there is nothing left to compute: y is then the answer already (empty, or
// zeros when K == 0).
struct PanelCall {
  at::Tensor x, y;  // x made contiguous; y [M, N] float32
  int64_t M, K, N, P;
  bool done;
};

inline PanelCall begin_panel_call(const at::Tensor& x, const at::Tensor& panels, int64_t width,
                                  int64_t out_features, int64_t k_per_row = 1,
                                  bool bf16_x = false) {
  // x float32 (bf16_x: or bfloat16, y then bfloat16 too: the bf16-activation path's)
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat ||
                               (bf16_x && x.scalar_type() == at::kBFloat16)),
              "x must be a 2-D float32 tensor", bf16_x ? " or bfloat16" : "");
  TORCH_CHECK(panels.dim() == 3 && panels.is_contiguous() && panels.size(2) == width,
              "the weight must be contiguous [P, K, ", width, "] panels");
  TORCH_CHECK(panels.size(1) == (x.size(1) + k_per_row - 1) / k_per_row, "x has ", x.size(1),
              " columns, the weight ", panels.size(1), " rows of ", k_per_row, " k");
  TORCH_CHECK(out_features > (panels.size(0) - 1) * kPanel && out_features <= panels.size(0) * kPanel,
              "out_features does not match the number of panels");
  PanelCall call{x.contiguous(), at::Tensor(), x.size(0), x.size(1), out_features, panels.size(0),
                 false};
  call.y = at::empty({call.M, call.N}, call.x.options());
  if (call.M == 0 || call.N == 0) {
    call.done = true;
  } else if (call.K == 0) {
    call.y.zero_();
    call.done = true;
  }
  return call;
}

// A linear layer's op around a panel GEMM: x of any number of leading dims flattened to rows,
// ``gemm(rows)`` -> [rows, out_features], the bias added in place (the GEMM's own new tensor),
// the leading dims restored.
template <class Gemm>
at::Tensor linear_over_rows(const at::Tensor& x, int64_t out_features,
                            const std::optional<at::Tensor>& bias, Gemm gemm) {
  TORCH_CHECK(x.dim() >= 1, "x must have at least one dimension");
  at::Tensor y = gemm(x.reshape({-1, x.size(-1)}));
  if (bias) y.add_(*bias);
  if (x.dim() == 2) return y;
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = out_features;
  return y.view(shape);
}

}  // namespace skinny
