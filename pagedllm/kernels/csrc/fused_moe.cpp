// The experts of a mixture-of-experts layer in one op (layers/fused_moe.py): each token's top-k
// experts' gated MLPs, weighted by the router, from the routing the graph computed (vLLM's
// fused_experts). Steps, all here:
//   1. the (token, choice) pairs grouped by expert, tokens in order within one (a stable
//      counting sort), and x's rows gathered in that order;
//   2. gate_up of every active expert in one grouped call (grouped_linear.h: float32 panels or
//      the experts' codes in any format), plus the experts' biases where the family has them;
//   3. the gated activation, ATen's own ops (the same functions and order as the layer's
//      activation module in Python, so the same numbers);
//   4. down in one grouped call (+ bias);
//   5. each token's sum over its choices, in choice order, weighted by the router.
// Why one op: a decode step of a few tokens streams each active expert's weights once, and the
// bookkeeping around the two grouped calls (a dozen small torch ops and the Python between them,
// cold in the caches after each weight stream) cost a large share of the layer at 1-4 tokens
// (docs/cpu_kernels.md#linear-ops-around-the-tiles).
// A token's result does not depend on which tokens share its step: its rows are gathered and
// combined alone, and the grouped calls give each row the bits its expert's own call would.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <optional>
#include <string_view>
#include <vector>

#include "grouped_linear.h"

namespace {

// Expert e's rows of a grouped projection's output (``start``/``counts``) += bias[e].
void add_expert_bias(at::Tensor& y, const std::optional<at::Tensor>& bias,
                     const std::vector<int64_t>& start, const std::vector<int64_t>& counts) {
  if (!bias) return;
  const int64_t N = y.size(1);
  TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->dim() == 2 &&
                  bias->size(0) == static_cast<int64_t>(counts.size()) && bias->size(1) == N,
              "an expert bias must be float32 [experts, ", N, "], got ", bias->sizes());
  const at::Tensor b = bias->contiguous();
  const float* bp = b.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  for (size_t e = 0; e < counts.size(); ++e)
    for (int64_t r = start[e]; r < start[e] + counts[e]; ++r)
      for (int64_t c = 0; c < N; ++c) yp[r * N + c] += bp[e * N + c];
}

// One projection of every active expert: float32 panels [E, P, K, 64], or stacked codes.
at::Tensor project(const at::Tensor& x, const at::Tensor& weight,
                   const std::optional<at::Tensor>& scales,
                   const std::optional<at::Tensor>& offsets, int64_t group_size,
                   c10::IntArrayRef counts, int64_t out_features, bool narrow_activations) {
  if (weight.scalar_type() == at::kFloat)
    return PAGEDLLM_NS::grouped_packed_linear(x, weight, counts, out_features);
  return PAGEDLLM_NS::grouped_quant_linear(x, weight, scales, offsets, group_size, counts,
                                           out_features, narrow_activations);
}

// [R, 2I] (gate half, up half) -> [R, I]. "silu", "gelu", "gelu_tanh": GatedActivation
// (layers/activation.py); "swiglu_clamped": GPT-OSS's ClampedSwiGLU (models/gpt_oss.py), the
// same ops in the same order.
at::Tensor gated(const at::Tensor& gate_up, int64_t I, std::string_view activation, double alpha,
                 double limit) {
  const at::Tensor gate = gate_up.narrow(1, 0, I), up = gate_up.narrow(1, I, I);
  if (activation == "silu") return at::silu(gate) * up;
  if (activation == "gelu") return at::gelu(gate) * up;
  if (activation == "gelu_tanh") return at::gelu(gate, "tanh") * up;
  if (activation == "swiglu_clamped") {
    const at::Tensor g = gate.clamp_max(limit), u = up.clamp(-limit, limit);
    return (u + 1) * (g * at::sigmoid(g * alpha));
  }
  TORCH_CHECK(false, "activation ", std::string(activation), " is not one of silu, gelu, "
              "gelu_tanh, swiglu_clamped");
}

// x [T, H] float32, topk_weights/topk_ids [T, k]; gate_up (+ scales, offsets, group size) the
// experts' [2I, H] weights stacked, down their [H, I]. Returns [T, H] float32.
at::Tensor fused_experts(const at::Tensor& x, const at::Tensor& topk_weights,
                         const at::Tensor& topk_ids, const at::Tensor& gate_up,
                         const std::optional<at::Tensor>& gate_up_scales,
                         const std::optional<at::Tensor>& gate_up_offsets,
                         int64_t gate_up_group_size, const at::Tensor& down,
                         const std::optional<at::Tensor>& down_scales,
                         const std::optional<at::Tensor>& down_offsets, int64_t down_group_size,
                         const std::optional<at::Tensor>& gate_up_bias,
                         const std::optional<at::Tensor>& down_bias, int64_t intermediate_size,
                         c10::string_view activation, double alpha, double limit,
                         bool narrow_activations) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be 2-D float32");
  TORCH_CHECK(topk_ids.dim() == 2 && topk_ids.size(0) == x.size(0) &&
                  topk_ids.scalar_type() == at::kLong,
              "topk_ids must be int64 [tokens, k], got ", topk_ids.scalar_type(), " ",
              topk_ids.sizes());
  TORCH_CHECK(topk_weights.sizes() == topk_ids.sizes(), "topk_weights must be shaped like "
              "topk_ids ", topk_ids.sizes(), ", got ", topk_weights.sizes());
  TORCH_CHECK(gate_up.dim() >= 1 && down.dim() >= 1 && gate_up.size(0) == down.size(0),
              "gate_up and down must stack the same experts");
  const int64_t T = x.size(0), H = x.size(1), k = topk_ids.size(1), E = gate_up.size(0);
  const int64_t R = T * k, I = intermediate_size;
  const at::Tensor xc = x.contiguous(), ids = topk_ids.contiguous();
  const at::Tensor weights = topk_weights.to(at::kFloat).contiguous();
  const int64_t* id = ids.data_ptr<int64_t>();

  // 1. pair i = t * k + j goes to row pos[i] of its expert's run
  std::vector<int64_t> counts(E, 0), start(E, 0), pos(R);
  for (int64_t i = 0; i < R; ++i) {
    TORCH_CHECK(id[i] >= 0 && id[i] < E, "expert id ", id[i], " is not in 0..", E - 1);
    ++counts[id[i]];
  }
  for (int64_t e = 1; e < E; ++e) start[e] = start[e - 1] + counts[e - 1];
  std::vector<int64_t> next(start);
  for (int64_t i = 0; i < R; ++i) pos[i] = next[id[i]]++;
  at::Tensor xs = at::empty({R, H}, x.options());
  const float* xp = xc.data_ptr<float>();
  float* xsp = xs.data_ptr<float>();
  for (int64_t i = 0; i < R; ++i) std::memcpy(xsp + pos[i] * H, xp + (i / k) * H, H * sizeof(float));

  // 2-4. the experts' MLPs over their rows
  at::Tensor h = project(xs, gate_up, gate_up_scales, gate_up_offsets, gate_up_group_size, counts,
                         2 * I, narrow_activations);
  add_expert_bias(h, gate_up_bias, start, counts);
  const at::Tensor a = gated(h, I, activation, alpha, limit).contiguous();
  at::Tensor y = project(a, down, down_scales, down_offsets, down_group_size, counts, H,
                         narrow_activations);
  add_expert_bias(y, down_bias, start, counts);

  // 5. out[t] = sum over j, in order, of w[t, j] * (token t's row of its j-th expert)
  at::Tensor out = at::empty({T, H}, x.options());
  const float* yp = y.data_ptr<float>();
  const float* wp = weights.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      float* o = op + t * H;
      const float* y0 = yp + pos[t * k] * H;
      const float w0 = wp[t * k];
      for (int64_t c = 0; c < H; ++c) o[c] = y0[c] * w0;
      for (int64_t j = 1; j < k; ++j) {
        const float* yj = yp + pos[t * k + j] * H;
        const float wj = wp[t * k + j];
        for (int64_t c = 0; c < H; ++c) o[c] += yj[c] * wj;
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(PAGEDLLM_NS, m) {
  m.def("fused_experts(Tensor x, Tensor topk_weights, Tensor topk_ids, Tensor gate_up, "
        "Tensor? gate_up_scales, Tensor? gate_up_offsets, int gate_up_group_size, Tensor down, "
        "Tensor? down_scales, Tensor? down_offsets, int down_group_size, Tensor? gate_up_bias, "
        "Tensor? down_bias, int intermediate_size, str activation, float alpha, float limit, "
        "bool narrow_activations) -> Tensor");
}

TORCH_LIBRARY_IMPL(PAGEDLLM_NS, CPU, m) { m.impl("fused_experts", &fused_experts); }
