// What the kernels know of the instruction set they are compiled for, and the op namespace of
// this build. kernels/cpu_extension.py compiles the same sources once per x86 level it needs:
// the engine's build (-march=native, namespace pagedllm) and, for the benchmarks that measure
// one level on a CPU of another, -march=x86-64-v3 or -v4 builds in namespaces pagedllm_v3 and
// pagedllm_v4 (PAGEDLLM_NS), so several builds can be loaded in one process side by side.
#pragma once

#include <cstdint>

#ifndef PAGEDLLM_NS
#define PAGEDLLM_NS pagedllm
#endif

namespace isa {

#if defined(__AVX512F__)
// x86-64-v4: 16-float zmm vectors, 32 of them.
constexpr int64_t kVecFloats = 16;
constexpr int64_t kVecRegs = 32;
#else
// x86-64-v3 (AVX2 + FMA: 8-float ymm vectors, 16 of them), and the layout any other CPU gets
// (two SSE or NEON halves per vector: correct, but nobody tuned for it; the runner checks it
// against torch's matmul at startup, runner/linear_choice.py).
constexpr int64_t kVecFloats = 8;
constexpr int64_t kVecRegs = 16;
#endif

}  // namespace isa
