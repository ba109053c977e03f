// When a kernel call opens a parallel region: one rule for every kernel and both ISAs. Waking
// the pool's threads and joining them costs a few microseconds, which is about what one core
// spends on kMinParallelWork multiply-adds, so a call with less work than that (a tiny model's
// linears, a decode's attention over a short context) runs on the calling thread only.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

namespace parallel_work {

constexpr int64_t kMinParallelWork = int64_t{1} << 16;

// The threads a call of ``multiply_adds`` work is split over: 1 (no region) below the rule.
inline int64_t threads_for(int64_t multiply_adds) {
  return multiply_adds < kMinParallelWork ? 1 : std::max<int64_t>(at::get_num_threads(), 1);
}

}  // namespace parallel_work
