// y = x W^T for a float32 layer whose weight is prepacked: x [M, K], W [N, K] prepacked into
// panels of kPanel output columns. Written for the few-row inputs of decode steps ("skinny"),
// and used for every row count.
//
// Why not oneDNN or MKL at few rows: at M <= 64 a linear is bound by how fast its weights stream
// in from memory (each weight is used M times), and the general libraries read them in bursts:
// one tile of rows pulls a panel from DRAM while the rest of the panel's row tiles compute from
// cache, so memory idles most of the time. Here each panel is walked in k blocks; within a block
// every row tile uses the same 16 KiB of weights from L1, so the stream is steady, and the row
// tiles of the first kPrefetchRows rows prefetch the next block while they compute.
// Why not MKL at many rows (prefill) either: with a block of weights in L1 and a row tile's 24
// accumulators in registers, a tile runs at ~90% of the FMA peak, and re-reading x for each
// panel from L2/L3 costs little. Measured on 2 cores: ~400 GFLOP/s at 128-2,048 rows with warm
// caches (oneDNN ~440), 2.1x MKL's sgemm on this AMD CPU (MKL takes an AVX2 path there); with
// cold caches (benchmarks/linear_kernels.py) 1.6-2.0x MKL at 2,048 rows, while oneDNN's
// prepacked matmul is 1.05-1.45x faster there; at 8-32 rows 1.2-2.5x oneDNN on the decoder's
// projections and 1.0-1.4x on the lm_head. On 2 Sapphire Rapids cores (Intel, where MKL takes
// its AVX-512 path) the 6 x 4 tile runs at 140-200 GFLOP/s at 256-2,048 rows with cold caches,
// within ~0.8-1.0x of MKL there, and the 12 x 2 tile at 32 rows at 1.3-1.7x MKL.
//
// Layout: panels[p][k][c] = W[p * kPanel + c][k] (zero rows pad the last panel), so a panel is
// one contiguous stream. Arithmetic: every output is a sum over k blocks, in order, of the
// block's products summed in order; the same for every row count and row position, so a row's
// result does not depend on the batch it came in (and is reproducible bit for bit).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "isa.h"

namespace {

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
// steady). Measured on 2 Sapphire Rapids cores: 6 x 4 is 1.1-1.4x the 12 x 2 tile at
// 256-2,048 rows, 12 x 2 as fast or up to 1.1x at 32 rows.
// AVX2 (16 ymm, 12 accumulators), measured on 1-2 AMD EPYC (Zen 3) cores with cold caches
// (benchmarks/linear_kernels.py's shapes): 6 rows x 2 vectors (a quarter of a panel row) from 5
// rows up, 1.0-1.6x 3 x 4 at 16-128 rows; up to 4 rows, 1 row x the whole panel row (8
// vectors: 8 independent accumulators where a 1-row 6 x 2 tile would have 2 chains waiting on
// their FMA latency), 1.1-1.4x the 6 x 2 tile at one row.
#if defined(__AVX512F__)
constexpr int64_t kTileAcc = 24;
constexpr int64_t kTinyRows = 0;  // no tiny-row tile
constexpr int kTinyV = 2, kFewV = 2, kManyV = 4;
#else
constexpr int64_t kTileAcc = 12;
constexpr int64_t kTinyRows = 4;
constexpr int kTinyV = 8, kFewV = 2, kManyV = 2;
#endif
constexpr int64_t kTileFloats = kTileAcc * kW;
constexpr int64_t kFewRows = 64;            // up to this many rows: the few-rows tile
// Row tiles starting in the first kPrefetchRows rows (all of a decode batch of <= 32) prefetch
// the next k block, the line of it they are about to read in this one (one block ahead).
// Measured inside the engine, decode steps of 32 rows: 1.06x the first tile alone prefetching
// half a block ahead, 1.03x the first tile alone one block ahead; half a block or 1.5-2 blocks
// ahead are slower. With more rows each block is reused long enough that the stream is not the
// limit, and more prefetches only take issue slots (5-17% slower at 256-2,048 rows).
constexpr int64_t kPrefetchRows = 32;
constexpr int64_t kPrefetchFloats = kBlockK * kPanel;
constexpr int64_t kLineFloats = 16;         // a 64-byte cache line
// Rows per chunk. A panel is walked once per chunk, so a chunk's rows of x (<= 120 x K floats)
// stay in L2 across the thread's panels, and its outputs (15-30 KiB) in L1 across a panel's k
// blocks; the weights are read once per chunk, from L3 after the first (a prefill's layer is a
// few MB). Measured with cold caches at 2,048 rows: 1.1-1.7x one chunk of all rows (x and the
// outputs then come from L3 for every panel).
constexpr int64_t kFewChunkRows = 120;
constexpr int64_t kManyChunkRows = 60;

typedef float vfloat __attribute__((vector_size(kW * sizeof(float))));

inline vfloat load(const float* p) {
  vfloat v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void store(float* p, vfloat v) { std::memcpy(p, &v, sizeof v); }

// c[R][0:V*kW] (+)= x[R][0:kl] . w[0:kl][0:V*kW]: one register tile over one k block (w and c
// have rows of kPanel floats). The block is summed from zero and then added to c (FIRST:
// stored), which keeps the rounding error of a long K to that of a block plus K / kBlockK
// additions.
template <int R, int V, bool FIRST, bool PREFETCH>
inline void tile(const float* __restrict x, int64_t ldx, const float* __restrict w, int64_t kl,
                 float* __restrict c) {
  // Unrolled so the accumulators live in registers from the start to the stores (with
  // ``= {}`` GCC kept a zeroed copy on the stack: a memset and 24 spills per tile call).
  vfloat acc[R][V];
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int v = 0; v < V; ++v) acc[r][v] = vfloat{};
  for (int64_t k = 0; k < kl; ++k) {
    const float* wk = w + k * kPanel;
    if (PREFETCH) {
      for (int64_t f = 0; f < V * kW; f += kLineFloats) __builtin_prefetch(wk + kPrefetchFloats + f);
    }
    vfloat wv[V];
    for (int v = 0; v < V; ++v) wv[v] = load(wk + v * kW);
    for (int r = 0; r < R; ++r) {
      const float a = x[r * ldx + k];
      for (int v = 0; v < V; ++v) acc[r][v] += a * wv[v];
    }
  }
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int v = 0; v < V; ++v) {
      float* dst = c + r * kPanel + v * kW;
      store(dst, FIRST ? acc[r][v] : load(dst) + acc[r][v]);
    }
}

template <int R, int V>
inline void tile_any(bool first, bool prefetch, const float* x, int64_t ldx, const float* w,
                     int64_t kl, float* c) {
  if (first) {
    prefetch ? tile<R, V, true, true>(x, ldx, w, kl, c) : tile<R, V, true, false>(x, ldx, w, kl, c);
  } else {
    prefetch ? tile<R, V, false, true>(x, ldx, w, kl, c) : tile<R, V, false, false>(x, ldx, w, kl, c);
  }
}

// A tile of 1..R rows (R x V = kTileAcc accumulators): the row count must be a compile-time
// constant for the accumulators to stay in registers.
template <int V, int R = kTileFloats / (V * kW)>
inline void tile_rows(int64_t rows, bool first, bool prefetch, const float* x, int64_t ldx,
                      const float* w, int64_t kl, float* c) {
  if constexpr (R > 1) {
    if (rows < R) return tile_rows<V, R - 1>(rows, first, prefetch, x, ldx, w, kl, c);
  }
  tile_any<R, V>(first, prefetch, x, ldx, w, kl, c);
}

// y[0:M, panels p0..p1) for one tile shape: V vectors per tile (a panel row in kPanel / (V * kW)
// parts), kTileFloats / (V * kW) rows per tile, CHUNK rows per chunk.
template <int V, int64_t CHUNK>
void panels_times_x(const float* xp, int64_t M, int64_t K, const float* wp, int64_t N, float* yp,
                    int64_t p0, int64_t p1) {
  constexpr int64_t TILE = kTileFloats / (V * kW);
  std::vector<float> c(std::min(M, CHUNK) * kPanel);  // a panel's outputs, the chunk's rows
  for (int64_t r0 = 0; r0 < M; r0 += CHUNK) {
    const int64_t rows = std::min(CHUNK, M - r0);
    const float* xr = xp + r0 * K;
    for (int64_t p = p0; p < p1; ++p) {
      const float* panel = wp + p * K * kPanel;
      for (int64_t k0 = 0; k0 < K; k0 += kBlockK) {
        const int64_t kl = std::min(kBlockK, K - k0);
        for (int64_t col = 0; col < kPanel; col += V * kW)
          for (int64_t m0 = 0; m0 < rows; m0 += TILE)
            tile_rows<V>(std::min(TILE, rows - m0), k0 == 0, m0 < kPrefetchRows,
                         xr + m0 * K + k0, K, panel + k0 * kPanel + col, kl,
                         c.data() + m0 * kPanel + col);
      }
      const int64_t cols = std::min(kPanel, N - p * kPanel);
      for (int64_t m = 0; m < rows; ++m)
        std::memcpy(yp + (r0 + m) * N + p * kPanel, c.data() + m * kPanel, cols * sizeof(float));
    }
  }
}

at::Tensor skinny_gemm(const at::Tensor& x, const at::Tensor& panels, int64_t out_features) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be a 2-D float32 tensor");
  TORCH_CHECK(panels.dim() == 3 && panels.scalar_type() == at::kFloat && panels.is_contiguous() &&
                  panels.size(2) == kPanel,
              "panels must be a contiguous float32 [P, K, ", kPanel, "] tensor");
  TORCH_CHECK(panels.size(1) == x.size(1), "x has ", x.size(1), " columns, the weight ",
              panels.size(1));
  TORCH_CHECK(out_features > (panels.size(0) - 1) * kPanel && out_features <= panels.size(0) * kPanel,
              "out_features does not match the number of panels");
  const at::Tensor xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), N = out_features, P = panels.size(0);
  at::Tensor y = at::empty({M, N}, xc.options());
  if (M == 0 || N == 0) return y;
  if (K == 0) return y.zero_();
  const float* xp = xc.data_ptr<float>();
  const float* wp = panels.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // Threads take contiguous runs of panels: each streams its own part of the weights. Rows go
  // in chunks, each over all of the thread's panels (one chunk at decode sizes).
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    if (M <= kTinyRows)
      panels_times_x<kTinyV, kFewChunkRows>(xp, M, K, wp, N, yp, p0, p1);
    else if (M <= kFewRows)
      panels_times_x<kFewV, kFewChunkRows>(xp, M, K, wp, N, yp, p0, p1);
    else
      panels_times_x<kManyV, kManyChunkRows>(xp, M, K, wp, N, yp, p0, p1);
  });
  return y;
}

// x W^T (+ bias) for a layer whose weight is held as panels only (x of any number of leading
// dims, flattened to rows). In C++ so that a compiled graph calls it straight from inductor's
// wrapper: a Python custom op around the same call cost ~30 us per call, ~1 ms per decode step of
// the 58M model.
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& panels, int64_t out_features,
                         const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() >= 1, "x must have at least one dimension");
  at::Tensor y = skinny_gemm(x.reshape({-1, x.size(-1)}), panels, out_features);
  if (bias) y.add_(*bias);  // y is the kernel's own new tensor
  if (x.dim() == 2) return y;
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = out_features;
  return y.view(shape);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(PAGEDLLM_NS, m) {
  m.def("skinny_gemm(Tensor x, Tensor panels, int out_features) -> Tensor");
  m.def("packed_linear(Tensor x, Tensor panels, int out_features, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(PAGEDLLM_NS, CPU, m) {
  m.impl("skinny_gemm", &skinny_gemm);
  m.impl("packed_linear", &packed_linear);
}
