// y = x W^T for the few-row inputs of decode steps: x [M, K] float32, M small (a batch of
// decoding requests), W [N, K] prepacked into panels of kPanel output columns.
//
// Why not oneDNN or MKL: at M <= 64 a linear is bound by how fast its weights stream in from
// memory (each weight is used M times), and the general libraries read them in bursts: one tile
// of rows pulls a panel from DRAM while the rest of the panel's row tiles compute from cache, so
// memory idles most of the time (measured: 4-8 GB/s of a 17 GB/s read bandwidth at M = 8..32).
// Here each panel is walked in k blocks; within a block every row tile uses the same 8 KiB of
// weights from L1, so the stream is steady, and the first row tile prefetches 4 KiB ahead.
// Measured on the 58M benchmark model's shapes with cold caches (benchmarks/linear_kernels.py):
// 1.2-2.1x oneDNN's prepacked matmul on the decoder's projections at 8-32 rows, 1.06-1.3x on the
// lm_head (bound by the tile's arithmetic at 32 rows); about the same at 64 rows, slower above:
// the caller hands larger inputs to MKL (layers/linear.py).
//
// Layout: panels[p][k][c] = W[p * kPanel + c][k] (zero rows pad the last panel), so a panel is
// one contiguous stream. Arithmetic: every output is a sum over k blocks, in order, of the
// block's products summed in order; the same for every row count and row position, so a row's
// result does not depend on the batch it came in (and is reproducible bit for bit).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kW = 16;                  // floats per vector (AVX-512; two halves on AVX2)
constexpr int64_t kVecs = 2;                // vectors per panel row
constexpr int64_t kPanel = kVecs * kW;      // output columns per panel
constexpr int64_t kBlockK = 64;             // k per block: 64 x 32 floats = 8 KiB of weights
constexpr int64_t kTileRows = 12;           // rows per register tile: 24 accumulators + 2 weights
constexpr int64_t kPrefetchFloats = 1024;   // how far ahead the first row tile prefetches (4 KiB)

typedef float vfloat __attribute__((vector_size(kW * sizeof(float))));

inline vfloat load(const float* p) {
  vfloat v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void store(float* p, vfloat v) { std::memcpy(p, &v, sizeof v); }

// c[R][kPanel] (+)= x[R][0:kl] . w[0:kl][kPanel]: one register tile over one k block. The block
// is summed from zero and then added to c (FIRST: stored), which keeps the rounding error of a
// long K to that of a block plus K / kBlockK additions.
template <int R, bool FIRST, bool PREFETCH>
inline void tile(const float* __restrict x, int64_t ldx, const float* __restrict w, int64_t kl,
                 float* __restrict c) {
  // Unrolled so the accumulators live in registers from the start to the stores (with
  // ``= {}`` GCC kept a zeroed copy on the stack: a memset and 24 spills per tile call).
  vfloat acc[R][kVecs];
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int v = 0; v < kVecs; ++v) acc[r][v] = vfloat{};
  for (int64_t k = 0; k < kl; ++k) {
    const float* wk = w + k * kPanel;
    if (PREFETCH) {
      __builtin_prefetch(wk + kPrefetchFloats);
      __builtin_prefetch(wk + kPrefetchFloats + kW);
    }
    vfloat wv[kVecs];
    for (int v = 0; v < kVecs; ++v) wv[v] = load(wk + v * kW);
    for (int r = 0; r < R; ++r) {
      const float a = x[r * ldx + k];
      for (int v = 0; v < kVecs; ++v) acc[r][v] += a * wv[v];
    }
  }
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int v = 0; v < kVecs; ++v) {
      float* dst = c + r * kPanel + v * kW;
      store(dst, FIRST ? acc[r][v] : load(dst) + acc[r][v]);
    }
}

template <int R>
inline void tile_any(bool first, bool prefetch, const float* x, int64_t ldx, const float* w,
                     int64_t kl, float* c) {
  if (first) {
    prefetch ? tile<R, true, true>(x, ldx, w, kl, c) : tile<R, true, false>(x, ldx, w, kl, c);
  } else {
    prefetch ? tile<R, false, true>(x, ldx, w, kl, c) : tile<R, false, false>(x, ldx, w, kl, c);
  }
}

// A tile of 1..kTileRows rows (the row count must be a compile-time constant for the
// accumulators to stay in registers).
inline void tile_rows(int64_t rows, bool first, bool prefetch, const float* x, int64_t ldx,
                      const float* w, int64_t kl, float* c) {
  switch (rows) {
#define PAGEDLLM_TILE(R) \
  case R: tile_any<R>(first, prefetch, x, ldx, w, kl, c); break;
    PAGEDLLM_TILE(1) PAGEDLLM_TILE(2) PAGEDLLM_TILE(3) PAGEDLLM_TILE(4) PAGEDLLM_TILE(5)
    PAGEDLLM_TILE(6) PAGEDLLM_TILE(7) PAGEDLLM_TILE(8) PAGEDLLM_TILE(9) PAGEDLLM_TILE(10)
    PAGEDLLM_TILE(11) PAGEDLLM_TILE(12)
#undef PAGEDLLM_TILE
  }
}
static_assert(kTileRows == 12, "tile_rows covers 1..12 rows");

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
  // Threads take contiguous runs of panels: each streams its own part of the weights.
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    std::vector<float> c(M * kPanel);  // the panel's outputs, all rows
    for (int64_t p = p0; p < p1; ++p) {
      const float* panel = wp + p * K * kPanel;
      for (int64_t k0 = 0; k0 < K; k0 += kBlockK) {
        const int64_t kl = std::min(kBlockK, K - k0);
        for (int64_t m0 = 0; m0 < M; m0 += kTileRows)
          tile_rows(std::min(kTileRows, M - m0), k0 == 0, m0 == 0, xp + m0 * K + k0, K,
                    panel + k0 * kPanel, kl, c.data() + m0 * kPanel);
      }
      const int64_t cols = std::min(kPanel, N - p * kPanel);
      for (int64_t m = 0; m < M; ++m)
        std::memcpy(yp + m * N + p * kPanel, c.data() + m * kPanel, cols * sizeof(float));
    }
  });
  return y;
}

// Rows up to which the skinny kernel runs (measured crossover with MKL: 64-96 rows, 58M model).
constexpr int64_t kMaxRows = 64;

// x W^T (+ bias) for a layer whose weight is also prepacked: the one place that picks the kernel.
// Few rows take the skinny kernel, more (prefill) MKL through at::linear, where its blocking wins.
// In C++ so that a compiled graph calls it straight from inductor's wrapper: a Python custom op
// around the same choice cost ~30 us per call, ~1 ms per decode step of the 58M model.
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& panels,
                         const std::optional<at::Tensor>& bias) {
  if (x.dim() != 2 || x.size(0) > kMaxRows) return at::linear(x, weight, bias);
  at::Tensor y = skinny_gemm(x, panels, weight.size(0));
  return bias ? y.add_(*bias) : y;  // y is the kernel's own new tensor
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedllm, m) {
  m.def("skinny_gemm(Tensor x, Tensor panels, int out_features) -> Tensor");
  m.def("packed_linear(Tensor x, Tensor weight, Tensor panels, Tensor? bias) -> Tensor");
  m.def("skinny_max_rows() -> int", [] { return kMaxRows; });
}

TORCH_LIBRARY_IMPL(pagedllm, CPU, m) {
  m.impl("skinny_gemm", &skinny_gemm);
  m.impl("packed_linear", &packed_linear);
}
