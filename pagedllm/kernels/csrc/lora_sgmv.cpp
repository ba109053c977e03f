// The adapters' low-rank update of one linear layer for a mixed batch (lora/graph_weights.py, and
// lora/lora_format.py's few-row steps): y[t] += (x[t] A_s^T) B_s^T for each token row t whose slot
// s is not -1 (the base), vLLM's punica "shrink" then "expand", grouped by slot (the SGMV idea).
//
// Layout (every slot at one rank R, zeros past an adapter's rank and for a projection it does not
// train, the scaling folded into B):
//   lora_a [S, P * R, K]: slot s's A, projection j's rows at j * R (each row one contiguous dot);
//   lora_b [S, R, N]: slot s's B^T, projection j's in its own columns [offset_j, offset_j + size_j)
//           of y (the projections of a fused qkv or gate_up layer never share a column).
// The rows are grouped by slot first (a counting sort of token_slots), so a step reads only the
// slots its rows use, each once, whatever the number of rows or resident slots: a decode step
// with one adapter reads that adapter's A and B, never the other slots'.
//
// Arithmetic: a row's shrunk value is one vector dot over K in order, its update one sum over r in
// order per column, each row with its own accumulators whatever the rows beside it, so a row's
// result does not depend on its batch. x, y and the weights may each be float32 or bf16; the sums
// are float32, y is rounded once.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "isa.h"
#include "parallel_work.h"

namespace {

constexpr int64_t kW = isa::kVecFloats;
constexpr int64_t kShrinkRows = 4;    // rows of one group dotted with one A row at once
constexpr int64_t kShrinkA = 16;      // A rows per shrink item (one projection at rank 16)
constexpr int64_t kExpandCols = 64;   // output columns per expand item (a few vectors)
constexpr int64_t kBlockVecs = kExpandCols / kW;

typedef float vfloat __attribute__((vector_size(kW * sizeof(float))));
typedef uint16_t vhalf __attribute__((vector_size(kW * sizeof(uint16_t))));
typedef uint32_t vword __attribute__((vector_size(kW * sizeof(uint32_t))));

inline vfloat load(const float* p) {
  vfloat v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline vfloat load(const c10::BFloat16* p) {  // bf16 is float32's upper half
  vhalf h;
  std::memcpy(&h, p, sizeof h);
  const vword w = __builtin_convertvector(h, vword) << 16;
  vfloat v;
  std::memcpy(&v, &w, sizeof v);
  return v;
}
inline float hsum(vfloat v) {
  float s = 0.0f;
  for (int64_t i = 0; i < kW; ++i) s += v[i];
  return s;
}

// Runs item(i) for i in [0, items): on the calling thread below the parallel-work rule.
template <typename F>
void for_items(int64_t items, int64_t multiply_adds, const F& item) {
  const int64_t threads = std::min(parallel_work::threads_for(multiply_adds), items);
  if (threads <= 1) {
    for (int64_t i = 0; i < items; ++i) item(i);
    return;
  }
  at::parallel_for(0, items, (items + threads - 1) / threads, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) item(i);
  });
}

// shrunk[t] = x[t] . a (K long) for up to kShrinkRows rows ``rows`` of x.
template <typename XT, typename WT, int64_t NR>
void dot_rows(const XT* x, int64_t K, const int64_t* rows, const WT* a, float* out) {
  vfloat acc[NR];
  for (int64_t j = 0; j < NR; ++j) acc[j] = vfloat{};
  int64_t k = 0;
  for (; k + kW <= K; k += kW) {
    const vfloat av = load(a + k);
    for (int64_t j = 0; j < NR; ++j) acc[j] += av * load(x + rows[j] * K + k);
  }
  for (int64_t j = 0; j < NR; ++j) {
    float s = hsum(acc[j]);
    for (int64_t kk = k; kk < K; ++kk)
      s += static_cast<float>(a[kk]) * static_cast<float>(x[rows[j] * K + kk]);
    out[j] = s;
  }
}

struct Groups {
  std::vector<int64_t> slot, start, count;  // per slot in use, in slot order
  std::vector<int64_t> rows;                // the token rows, grouped by slot, in order within one
};

Groups group_rows(const at::Tensor& token_slots, int64_t T, int64_t S) {
  TORCH_CHECK(token_slots.scalar_type() == at::kLong && token_slots.dim() == 1 &&
                  token_slots.size(0) >= T,
              "token_slots must be int64 [>= ", T, "] (each row's slot, -1: none)");
  const at::Tensor ts = token_slots.contiguous();
  const int64_t* sp = ts.data_ptr<int64_t>();
  std::vector<int64_t> count(S, 0);
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(sp[t] >= -1 && sp[t] < S, "row ", t, "'s slot ", sp[t], " is not -1 or below ", S);
    if (sp[t] >= 0) ++count[sp[t]];
  }
  Groups g;
  std::vector<int64_t> next(S, 0);  // where slot s's next row goes
  int64_t total = 0;
  for (int64_t s = 0; s < S; ++s) {
    next[s] = total;
    if (count[s] == 0) continue;
    g.slot.push_back(s);
    g.start.push_back(total);
    g.count.push_back(count[s]);
    total += count[s];
  }
  g.rows.resize(total);
  for (int64_t t = 0; t < T; ++t)
    if (sp[t] >= 0) g.rows[next[sp[t]]++] = t;
  return g;
}

struct Call {
  int64_t T, K, S, P, R, N, y_stride;
  std::vector<int64_t> offsets, sizes;
};

template <typename XT, typename WT, typename YT>
void run(const Call& c, const Groups& g, const XT* x, const WT* a, const WT* b, YT* y) {
  const int64_t G = g.slot.size(), PR = c.P * c.R, rows = g.rows.size();
  std::vector<float> shrunk(rows * PR);  // grouped row i's shrunk columns at i * PR
  // Shrink: one item per (group, tile of kShrinkRows rows, chunk of kShrinkA A rows): the tile's
  // rows stay in L1 while the chunk streams, so x is read about once per chunk, not once per A row.
  const int64_t chunks = (PR + kShrinkA - 1) / kShrinkA;
  std::vector<int64_t> items_before(G + 1, 0);
  for (int64_t gi = 0; gi < G; ++gi)
    items_before[gi + 1] = items_before[gi] + (g.count[gi] + kShrinkRows - 1) / kShrinkRows * chunks;
  for_items(items_before[G], rows * PR * c.K, [&](int64_t item) {
    const int64_t gi = std::upper_bound(items_before.begin(), items_before.end(), item) -
                       items_before.begin() - 1;
    const int64_t local = item - items_before[gi];
    const int64_t i0 = local / chunks * kShrinkRows, k0 = local % chunks * kShrinkA;
    const int64_t n = std::min(kShrinkRows, g.count[gi] - i0), k1 = std::min(PR, k0 + kShrinkA);
    const int64_t* grows = g.rows.data() + g.start[gi] + i0;
    float* out = shrunk.data() + (g.start[gi] + i0) * PR;
    float dots[kShrinkRows];
    for (int64_t k = k0; k < k1; ++k) {
      const WT* ak = a + (g.slot[gi] * PR + k) * c.K;
      if (n == kShrinkRows) {
        dot_rows<XT, WT, kShrinkRows>(x, c.K, grows, ak, dots);
      } else {
        for (int64_t j = 0; j < n; ++j) dot_rows<XT, WT, 1>(x, c.K, grows + j, ak, dots + j);
      }
      for (int64_t j = 0; j < n; ++j) out[j * PR + k] = dots[j];
    }
  });
  // Expand: one item per (group, projection, block of kExpandCols columns).
  std::vector<int64_t> blocks_before(c.P + 1, 0);  // column blocks of the projections before j
  for (int64_t j = 0; j < c.P; ++j)
    blocks_before[j + 1] = blocks_before[j] + (c.sizes[j] + kExpandCols - 1) / kExpandCols;
  const int64_t per_group = blocks_before[c.P];
  int64_t columns = 0;
  for (int64_t j = 0; j < c.P; ++j) columns += c.sizes[j];
  for_items(G * per_group, rows * c.R * columns, [&](int64_t item) {
    const int64_t gi = item / per_group, block = item % per_group;
    const int64_t j = std::upper_bound(blocks_before.begin(), blocks_before.end(), block) -
                      blocks_before.begin() - 1;
    const int64_t c0 = c.offsets[j] + (block - blocks_before[j]) * kExpandCols;
    const int64_t width = std::min(kExpandCols, c.offsets[j] + c.sizes[j] - c0);
    const WT* bs = b + g.slot[gi] * c.R * c.N + c0;
    for (int64_t i = 0; i < g.count[gi]; ++i) {
      const float* s = shrunk.data() + (g.start[gi] + i) * PR + j * c.R;
      YT* yt = y + g.rows[g.start[gi] + i] * c.y_stride + c0;
      int64_t col = 0;
      if (width == kExpandCols) {  // a whole block: kBlockVecs independent sums, not one chain
        vfloat acc[kBlockVecs] = {};
        for (int64_t r = 0; r < c.R; ++r)
          for (int64_t v = 0; v < kBlockVecs; ++v) acc[v] += s[r] * load(bs + r * c.N + v * kW);
        for (int64_t v = 0; v < kBlockVecs; ++v)
          for (int64_t e = 0; e < kW; ++e)
            yt[v * kW + e] = static_cast<YT>(static_cast<float>(yt[v * kW + e]) + acc[v][e]);
        col = width;
      }
      for (; col + kW <= width; col += kW) {
        vfloat acc = vfloat{};
        for (int64_t r = 0; r < c.R; ++r) acc += s[r] * load(bs + r * c.N + col);
        for (int64_t e = 0; e < kW; ++e) yt[col + e] = static_cast<YT>(static_cast<float>(yt[col + e]) + acc[e]);
      }
      for (; col < width; ++col) {
        float acc = 0.0f;
        for (int64_t r = 0; r < c.R; ++r) acc += s[r] * static_cast<float>(bs[r * c.N + col]);
        yt[col] = static_cast<YT>(static_cast<float>(yt[col]) + acc);
      }
    }
  });
}

template <typename XT, typename WT>
void dispatch_y(const Call& c, const Groups& g, const at::Tensor& x, const at::Tensor& a,
                const at::Tensor& b, at::Tensor& y) {
  const XT* xp = x.data_ptr<XT>();
  const WT *ap = a.data_ptr<WT>(), *bp = b.data_ptr<WT>();
  if (y.scalar_type() == at::kFloat) run(c, g, xp, ap, bp, y.data_ptr<float>());
  else run(c, g, xp, ap, bp, y.data_ptr<c10::BFloat16>());
}

template <typename XT>
void dispatch_w(const Call& c, const Groups& g, const at::Tensor& x, const at::Tensor& a,
                const at::Tensor& b, at::Tensor& y) {
  if (a.scalar_type() == at::kFloat) dispatch_y<XT, float>(c, g, x, a, b, y);
  else dispatch_y<XT, c10::BFloat16>(c, g, x, a, b, y);
}

bool float_or_bf16(const at::Tensor& t) {
  return t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16;
}

// y[t, offsets[j]:offsets[j] + sizes[j]] += (x[t] . A_s[j R:(j + 1) R]) B_s^T[:, those columns]
// for each row t of x whose token_slots[t] = s >= 0 (token_slots may be longer than x: the graph
// passes its whole static tensor). In place on y.
void lora_shrink_expand(const at::Tensor& x, at::Tensor& y, const at::Tensor& lora_a,
                        const at::Tensor& lora_b, const at::Tensor& token_slots,
                        c10::IntArrayRef offsets, c10::IntArrayRef sizes) {
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && x.size(0) == y.size(0),
              "x [T, in] and y [T, out] must have the same rows");
  TORCH_CHECK(lora_a.dim() == 3 && lora_b.dim() == 3 && lora_a.size(0) == lora_b.size(0) &&
                  lora_a.scalar_type() == lora_b.scalar_type() && lora_a.is_contiguous() &&
                  lora_b.is_contiguous(),
              "lora_a [slots, P * R, in] and lora_b [slots, R, N] must be contiguous, one dtype");
  TORCH_CHECK(float_or_bf16(x) && float_or_bf16(y) && float_or_bf16(lora_a),
              "x, y and the adapters' weights must be float32 or bf16");
  TORCH_CHECK(y.stride(1) == 1, "y's rows must be contiguous");
  Call c{x.size(0), x.size(1), lora_a.size(0), static_cast<int64_t>(offsets.size()),
         lora_b.size(1), lora_b.size(2), y.stride(0), offsets.vec(), sizes.vec()};
  TORCH_CHECK(c.P > 0 && sizes.size() == offsets.size() && lora_a.size(1) == c.P * c.R &&
                  lora_a.size(2) == c.K,
              "lora_a must be [slots, ", c.P, " projections x rank ", c.R, ", ", c.K, "], got ",
              lora_a.sizes());
  for (int64_t j = 0; j < c.P; ++j)
    TORCH_CHECK(c.offsets[j] >= 0 && c.sizes[j] >= 0 && c.offsets[j] + c.sizes[j] <= c.N &&
                    c.N <= y.size(1),
                "projection ", j, "'s columns [", c.offsets[j], ", +", c.sizes[j],
                ") must lie in lora_b's ", c.N, " and y's ", y.size(1));
  const Groups g = group_rows(token_slots, c.T, c.S);
  if (g.rows.empty()) return;
  const at::Tensor xc = x.contiguous();
  if (xc.scalar_type() == at::kFloat) dispatch_w<float>(c, g, xc, lora_a, lora_b, y);
  else dispatch_w<c10::BFloat16>(c, g, xc, lora_a, lora_b, y);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(PAGEDLLM_NS, m) {
  m.def("lora_shrink_expand(Tensor x, Tensor(a!) y, Tensor lora_a, Tensor lora_b, "
        "Tensor token_slots, int[] offsets, int[] sizes) -> ()");
}

TORCH_LIBRARY_IMPL(PAGEDLLM_NS, CPU, m) {
  m.impl("lora_shrink_expand", &lora_shrink_expand);
}
