// The grouped projections of a mixture-of-experts layer, shared by their ops (skinny_gemm.cpp:
// float32 panels; quant_gemm.cpp: every other weight format) and by fused_moe.cpp, which calls
// them from C++. In a namespace named after the build's op namespace (PAGEDLLM_NS: pagedllm,
// pagedllm_v3, ...), so two builds loaded in one process never resolve to each other's symbols.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>

namespace PAGEDLLM_NS {

// x [R, K] float32 holds the tokens sorted by expert, counts[e] rows for expert e in order;
// panels [E, P, K, 64] every expert's float32 weight. y [R, out_features].
at::Tensor grouped_packed_linear(const at::Tensor& x, const at::Tensor& panels,
                                 c10::IntArrayRef counts, int64_t out_features);

// The same for experts held as stacked codes (+ scales, offsets): bf16/fp16, q8, q4, q5.
at::Tensor grouped_quant_linear(const at::Tensor& x, const at::Tensor& codes,
                                const std::optional<at::Tensor>& scales,
                                const std::optional<at::Tensor>& offsets, int64_t group_size,
                                c10::IntArrayRef counts, int64_t out_features,
                                bool narrow_activations);

}  // namespace PAGEDLLM_NS
