// unified_attention: one attention layer of a compiled graph, from the graph straight to the
// paged kernel, with no call back into Python (vLLM's unified_attention custom op, on CPU).
//
// The graph holds a layer's number and its constant settings (scale, window, soft cap, sinks);
// what changes per step or per engine stays out of the graph and is looked up here:
// - each layer's KV cache and KV cache group, registered when the runner binds the caches;
// - the step's metadata per group (block tables, query start locations, sequence lengths, slot
//   mapping), set once per step when the forward context is entered, cleared when it is left.
// Whatever the kernel alone cannot do (no step set: a warm-up or another backend; a fresh prompt
// that a plain layer attends with SDPA; a cache narrower than the query, cast first; a layer not
// registered) goes to pagedllm::attention, the layer's Python path, which does all of it.
//
// One step runs at a time per process (the Python forward context is a module global too); the
// mutex only keeps registration from another thread (a second engine loading) from racing a step.
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <cstdint>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <vector>

#define PAGEDLLM_STR2(x) #x
#define PAGEDLLM_STR(x) PAGEDLLM_STR2(x)

namespace {

struct LayerCache {
  at::Tensor kv_cache;  // [2, blocks, block_size, Hkv, D]
  int64_t group;        // whose step metadata the layer reads
};

struct GroupStep {
  at::Tensor block_tables, query_start_loc, seq_lens, slot_mapping;
  bool has_fresh;  // fresh prompts that plain layers attend in Python (SDPA), not here
};

std::mutex mutex;
std::unordered_map<int64_t, LayerCache> layers;
std::vector<GroupStep> step;  // empty: no step entered

void set_attention_layer(int64_t layer_id, const at::Tensor& kv_cache, int64_t group) {
  std::lock_guard<std::mutex> lock(mutex);
  layers[layer_id] = LayerCache{kv_cache, group};
}

void forget_attention_layer(int64_t layer_id) {
  std::lock_guard<std::mutex> lock(mutex);
  layers.erase(layer_id);
}

void set_attention_step(at::TensorList block_tables, at::TensorList query_start_loc, at::TensorList seq_lens,
                        at::TensorList slot_mapping, c10::List<bool> has_fresh) {
  const size_t n = block_tables.size();
  TORCH_CHECK(query_start_loc.size() == n && seq_lens.size() == n && slot_mapping.size() == n &&
                  has_fresh.size() == n,
              "set_attention_step: one entry per KV cache group in every list");
  std::lock_guard<std::mutex> lock(mutex);
  step.clear();
  for (size_t g = 0; g < n; ++g)
    step.push_back(GroupStep{block_tables[g], query_start_loc[g], seq_lens[g], slot_mapping[g], has_fresh.get(g)});
}

void clear_attention_step() {
  std::lock_guard<std::mutex> lock(mutex);
  step.clear();
}

at::Tensor python_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                            int64_t layer_id) {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("pagedllm::attention", "");
  torch::jit::Stack stack{query, key, value, layer_id};
  op.callBoxed(&stack);
  return stack.back().toTensor();
}

at::Tensor unified_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                             int64_t layer_id, double scale, int64_t sliding_window, double logits_soft_cap,
                             const std::optional<at::Tensor>& sinks) {
  std::optional<LayerCache> layer;
  std::optional<GroupStep> group;
  {
    std::lock_guard<std::mutex> lock(mutex);
    auto it = layers.find(layer_id);
    if (it != layers.end() && it->second.group < static_cast<int64_t>(step.size())) {
      layer = it->second;
      group = step[it->second.group];
    }
  }
  const bool plain = sliding_window == 0 && logits_soft_cap == 0 && !sinks.has_value();
  if (!layer || (plain && group->has_fresh) || layer->kv_cache.scalar_type() != query.scalar_type())
    return python_attention(query, key, value, layer_id);
  static const auto paged_attention =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow(PAGEDLLM_STR(PAGEDLLM_NS) "::paged_attention", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                            const at::Tensor&, double, int64_t, double, const std::optional<at::Tensor>&,
                            const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
                            const std::optional<at::Tensor>&, bool)>();
  // The kernel reads float32 sink logits (a copy only when the model's are narrower).
  std::optional<at::Tensor> sinks_f32;
  if (sinks.has_value()) sinks_f32 = sinks->to(at::kFloat).contiguous();
  at::Tensor out = paged_attention.call(query, layer->kv_cache, group->block_tables, group->query_start_loc,
                                        group->seq_lens, scale, sliding_window, logits_soft_cap, sinks_f32,
                                        key, value, group->slot_mapping,
                                        /*causal=*/true);  // a layer bound here keeps KV: a causal one
  return out.view({query.size(0), query.size(1) * query.size(2)});  // [T, H * D], contiguous
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(PAGEDLLM_NS, m) {
  m.def("unified_attention(Tensor query, Tensor key, Tensor value, int layer_id, float scale, "
        "int sliding_window, float logits_soft_cap, Tensor? sinks) -> Tensor");
  // Bookkeeping, with no tensor to dispatch on (or one it only keeps): one kernel for all.
  m.def("set_attention_layer(int layer_id, Tensor kv_cache, int group) -> ()", &set_attention_layer);
  m.def("forget_attention_layer(int layer_id) -> ()", &forget_attention_layer);
  m.def("set_attention_step(Tensor[] block_tables, Tensor[] query_start_loc, Tensor[] seq_lens, "
        "Tensor[] slot_mapping, bool[] has_fresh) -> ()", &set_attention_step);
  m.def("clear_attention_step() -> ()", &clear_attention_step);
}

TORCH_LIBRARY_IMPL(PAGEDLLM_NS, CPU, m) { m.impl("unified_attention", &unified_attention); }
