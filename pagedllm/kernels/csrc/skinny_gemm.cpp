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
// accumulators in registers, a tile runs near the FMA peak, and re-reading x for each panel
// from L2/L3 costs little (the figures: docs/cpu_kernels.md#the-float32-kernel-against-the-libraries).
//
// Layout: panels[p][k][c] = W[p * kPanel + c][k] (zero rows pad the last panel), so a panel is
// one contiguous stream. Arithmetic: every output is a sum over k blocks, in order, of the
// block's products summed in order; the same for every row count and row position, so a row's
// result does not depend on the batch it came in (and is reproducible bit for bit).
//
// The tiles and the walk over the panels live in skinny_tiles.h (shared with quant_gemm.cpp,
// the same walk over weights held in other formats).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "grouped_linear.h"
#include "skinny_tiles.h"

namespace {

using skinny::kPanel;

// Float32 panels: a k block is read where it lies (and prefetched by the tiles).
struct F32Panels {
  static constexpr bool kInPlace = true;
  const float* w;
  int64_t K;
  const float* block(int64_t p, int64_t k0) const { return w + (p * K + k0) * kPanel; }
};

// A layer narrower than a panel (a mixture-of-experts router's 8-32 experts) is held as one
// panel of its own width, 16, 32 or 48 columns, not 64 (layers/linear.py's pack_weight): padded,
// a 16-expert router reads four times its bytes (docs/cpu_kernels.md#linear-ops-around-the-tiles).
// Each row here: a column's products over k in C
// chains (k mod C), added in chain order at the end; the same for every row count, so a row's
// result does not depend on its batch (the router's choice of experts must not).
template <int V>
void narrow_rows(const float* x, int64_t M, int64_t K, const float* w, int64_t N, float* y) {
  using skinny::kW;
  using skinny::load;
  using skinny::vfloat;
  constexpr int64_t kWidth = V * kW;
  constexpr int C = V * 4 <= 16 ? 4 : 2;  // chains: C x V accumulators stay in registers
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const float* xm = x + m * K;
      vfloat acc[C][V];
      for (int c = 0; c < C; ++c)
        for (int v = 0; v < V; ++v) acc[c][v] = vfloat{};
      int64_t k = 0;
      for (; k + C <= K; k += C)
        for (int c = 0; c < C; ++c)
          for (int v = 0; v < V; ++v) acc[c][v] += xm[k + c] * load(w + (k + c) * kWidth + v * kW);
      for (; k < K; ++k)
        for (int v = 0; v < V; ++v) acc[0][v] += xm[k] * load(w + k * kWidth + v * kW);
      float row[kWidth];
      for (int v = 0; v < V; ++v) {
        vfloat sum = acc[0][v];
        for (int c = 1; c < C; ++c) sum += acc[c][v];
        skinny::store(row + v * kW, sum);
      }
      std::memcpy(y + m * N, row, N * sizeof(float));
    }
  });
}

at::Tensor narrow_gemm(const at::Tensor& x, const at::Tensor& panel, int64_t out_features) {
  const int64_t width = panel.size(2);
  TORCH_CHECK(panel.size(0) == 1 && width % 16 == 0 && width < kPanel && out_features <= width &&
                  out_features > width - 16,
              "a narrow weight must be one panel [1, K, 16 | 32 | 48] of its out_features");
  const skinny::PanelCall c = skinny::begin_panel_call(x, panel, width, out_features);
  if (c.done) return c.y;
  const float* w = panel.data_ptr<float>();
  float* y = c.y.data_ptr<float>();
  const float* xp = c.x.data_ptr<float>();
  switch (width / skinny::kW) {  // vectors per k: AVX-512 1-3, AVX2 2-6
    case 1: narrow_rows<1>(xp, c.M, c.K, w, c.N, y); break;
    case 2: narrow_rows<2>(xp, c.M, c.K, w, c.N, y); break;
    case 3: narrow_rows<3>(xp, c.M, c.K, w, c.N, y); break;
    case 4: narrow_rows<4>(xp, c.M, c.K, w, c.N, y); break;
    case 6: narrow_rows<6>(xp, c.M, c.K, w, c.N, y); break;
    default: TORCH_CHECK(false, "no narrow kernel for width ", width);
  }
  return c.y;
}

at::Tensor skinny_gemm(const at::Tensor& x, const at::Tensor& panels, int64_t out_features) {
  TORCH_CHECK(panels.scalar_type() == at::kFloat, "panels must be float32");
  if (panels.dim() == 3 && panels.size(2) != kPanel) return narrow_gemm(x, panels, out_features);
  const skinny::PanelCall c = skinny::begin_panel_call(x, panels, kPanel, out_features);
  if (c.done) return c.y;
  skinny::panels_gemm(c.x.data_ptr<float>(), c.M, c.K, F32Panels{panels.data_ptr<float>(), c.K},
                      c.N, c.P, c.y.data_ptr<float>());
  return c.y;
}

// x W^T (+ bias) for a layer whose weight is held as panels only (x of any number of leading
// dims, flattened to rows). In C++ so that a compiled graph calls it straight from inductor's
// wrapper: a Python custom op around the same call costs more than a decode-sized call
// (docs/cpu_kernels.md#linear-ops-around-the-tiles).
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& panels, int64_t out_features,
                         const std::optional<at::Tensor>& bias) {
  return skinny::linear_over_rows(x, out_features, bias, [&](const at::Tensor& rows) {
    return skinny_gemm(rows, panels, out_features);
  });
}

}  // namespace

namespace PAGEDLLM_NS {

// The experts of a mixture-of-experts layer (layers/fused_moe.py): x [R, K] holds the tokens
// sorted by expert, ``counts[e]`` rows for expert e in order; panels [E, P, K, kPanel] every
// expert's weight. y [R, out_features]: each row times its expert's weight, in one parallel
// region over all active experts (skinny::grouped_panels_gemm). One call per projection in
// place of one per expert: each short call left its threads idle at its start and end
// (docs/cpu_kernels.md#linear-ops-around-the-tiles).
at::Tensor grouped_packed_linear(const at::Tensor& x, const at::Tensor& panels,
                                 c10::IntArrayRef counts, int64_t out_features) {
  TORCH_CHECK(panels.scalar_type() == at::kFloat, "panels must be float32");
  TORCH_CHECK(panels.dim() == 4 && panels.is_contiguous() &&
                  panels.size(0) == static_cast<int64_t>(counts.size()),
              "panels must be contiguous [experts, P, K, ", kPanel, "], one row count per expert");
  const at::Tensor first = panels.select(0, 0);
  const skinny::PanelCall c = skinny::begin_panel_call(x, first, kPanel, out_features);
  const skinny::RowGroups r = skinny::row_groups(counts, c.M);
  if (c.done) return c.y;
  const float* w = panels.data_ptr<float>();
  const int64_t expert_floats = c.P * c.K * kPanel;
  skinny::grouped_panels_gemm(
      c.x.data_ptr<float>(), c.K, r.start, r.rows,
      [&](int64_t e) { return F32Panels{w + e * expert_floats, c.K}; }, c.N, c.P,
      c.y.data_ptr<float>());
  return c.y;
}

}  // namespace PAGEDLLM_NS

TORCH_LIBRARY_FRAGMENT(PAGEDLLM_NS, m) {
  m.def("skinny_gemm(Tensor x, Tensor panels, int out_features) -> Tensor");
  m.def("packed_linear(Tensor x, Tensor panels, int out_features, Tensor? bias) -> Tensor");
  m.def("grouped_packed_linear(Tensor x, Tensor panels, int[] counts, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(PAGEDLLM_NS, CPU, m) {
  m.impl("skinny_gemm", &skinny_gemm);
  m.impl("packed_linear", &packed_linear);
  m.impl("grouped_packed_linear", &PAGEDLLM_NS::grouped_packed_linear);
}
