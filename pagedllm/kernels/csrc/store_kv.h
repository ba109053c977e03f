// Stores a step's keys and values in the paged KV cache (vLLM's reshape_and_cache):
// kv_cache[0][s] = key[t] and kv_cache[1][s] = value[t] for s = slot_mapping[t], all kv heads.
// paged_attention (paged_attention.cpp) calls it before it reads the cache, so that a layer's
// attention is one op, not two (a second op is another dispatch and return to Python per layer).
//
// Why not index_copy_ into a slot-indexed view: at decode sizes it was a visible share of a step
// (docs/cpu_kernels.md#attention), most of it TensorIterator's element-wise loop over cache
// lines that miss. Here a token's kv heads are one contiguous run
// in the source (a row of the fused qkv projection's output) and in the cache (a slot), so
// each token is two memcpy calls, which stream whole lines.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <cstring>

namespace paged_store {

// Checks every argument before anything is written: a bad slot writes nothing.
inline void store_kv(const at::Tensor& kv_cache, const at::Tensor& key, const at::Tensor& value,
                     const at::Tensor& slot_mapping) {
  TORCH_CHECK(key.dim() == 3 && key.sizes() == value.sizes() && key.size(1) == kv_cache.size(3) &&
                  key.size(2) == kv_cache.size(4),
              "key and value must be [T, Hkv, D] with the cache's Hkv and D");
  TORCH_CHECK(key.scalar_type() == kv_cache.scalar_type() &&
                  value.scalar_type() == kv_cache.scalar_type(),
              "key, value and kv_cache dtypes differ");
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == key.size(0) &&
                  slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous(),
              "slot_mapping must be a contiguous int64 [T]");
  const int64_t num_tokens = key.size(0);
  const int64_t num_slots = kv_cache.size(1) * kv_cache.size(2);
  const int64_t* slots = slot_mapping.const_data_ptr<int64_t>();
  for (int64_t t = 0; t < num_tokens; ++t)
    TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "slot ", slots[t], " of token ", t,
                " is outside the cache's ", num_slots, " slots");
  // A token's heads must be one run; a view that is not (never the model's) is copied first.
  auto rows = [](const at::Tensor& x) {
    return x.stride(2) == 1 && x.stride(1) == x.size(2) ? x : x.contiguous();
  };
  const at::Tensor k = rows(key), v = rows(value);
  const int64_t item = kv_cache.element_size();
  const int64_t slot_bytes = kv_cache.size(3) * kv_cache.size(4) * item;
  char* k_cache = static_cast<char*>(kv_cache.data_ptr());
  char* v_cache = k_cache + kv_cache.stride(0) * item;
  const char* k_src = static_cast<const char*>(k.const_data_ptr());
  const char* v_src = static_cast<const char*>(v.const_data_ptr());
  const int64_t k_step = k.stride(0) * item, v_step = v.stride(0) * item;
  // Threads for prefill-sized writes only: a decode's few tokens take a microsecond or two.
  at::parallel_for(0, num_tokens, 256, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      std::memcpy(k_cache + slots[t] * slot_bytes, k_src + t * k_step, slot_bytes);
      std::memcpy(v_cache + slots[t] * slot_bytes, v_src + t * v_step, slot_bytes);
    }
  });
}

}  // namespace paged_store
