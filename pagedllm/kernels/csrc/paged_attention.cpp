// Paged attention on CPU: reads K/V in place from the paged cache through the block tables.
//
// One call covers a whole flat batch: request b owns query rows [qsl[b], qsl[b+1]) and attends
// to its first seq_lens[b] cached positions; its query row i sits at position
// seq_lens[b] - n + i (n = its number of query rows) and sees keys at positions <= its own
// (causal over the cached prefix and the chunk itself). A request with seq_lens[b] == 0 is
// skipped: its output rows are left for the caller to fill. Given the step's key, value and
// slot_mapping, the kernel first stores them in the cache (store_kv.h), then reads; without
// them the cache already holds them.
//
// Work items (see plan_items): a decode item is one request with all its kv heads, so each slot
// is read once, front to back, and every query head of a kv head's group (GQA) is scored
// against a key while it sits in L1: decode is bound by memory bandwidth. A multi-token item is
// one kv head and up to kPrefillRows query rows: a small GEMM per key tile. Items are handed
// out through an atomic counter (dynamic scheduling: ragged lengths), longest first, on torch's
// own thread pool.
// Softmax is online (flash-attention style): per key tile, one max, one rescale of the
// accumulators, so nothing of size seq_len is materialised. Keys are read in an order that has
// several blocks' cache misses in flight at once (see for_each_read_position).
//
// Per layer (Features, a second instantiation of run so plain layers keep their code): a
// sliding window, where an item reads only the positions its rows' windows cover (a decode's
// cost is O(window), the blocks before it never touched); logit soft-capping, applied to a
// tile's visible scores before its softmax update; attention sinks, a per-head logit that
// starts each row's online softmax as a key of value 0 (so it counts in the denominator only);
// bidirectional attention (an encoder's layer): a row sees every key of its request, or with a
// window those at a distance below it, after its position as well as before.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

#include "isa.h"
#include "paged_attention_math.h"
#include "parallel_work.h"
#include "store_kv.h"

namespace {

using namespace paged_math;

constexpr int64_t kTransposeRows = 16;  // rows sharing a kv head from which keys are transposed
constexpr int64_t kMaxRows = 32;   // query heads of a decode item (all of a typical model's)
constexpr int64_t kPrefetchTileBytes = 32 << 10;  // see "prefetch" in run()
constexpr int64_t kPrefillRows = 64;  // rows of a multi-token item: each key it loads serves
                                      // them all (32 and 128 measured slower)
constexpr int64_t kGroupBlocks = 8;   // blocks of a read group (see for_each_read_position)

struct Item {
  int64_t req, head0, head1, row0, row1;  // kv heads [head0, head1), query rows [row0, row1)
  int64_t own_group;  // the first position of the read group its rows sit in
  // A sliding-window layer's item reads positions [key0, last row's position] in order:
  // window_start is the first position its first row sees (nothing before it is read), key0
  // that rounded down to a multiple of kKeyTile (see for_each_item_position). 0 without a window.
  int64_t key0, window_start;
};

// What a layer adds to plain causal attention (run<T, true>; plain layers run<T, false>, the
// code they always had). window: a query at position p sees keys (p - window, p], 0 = all;
// soft_cap: scores become soft_cap * tanh(score / soft_cap), 0 = off; sinks: per query head, a
// logit that joins the softmax's denominator only (nullptr = none); causal false: a query at
// position p sees every key, or with a window those in (p - window, p + window).
struct Features {
  int64_t window;
  float soft_cap;
  const float* sinks;
  bool causal;
};

// Which work items cover a flat batch. A decode item takes as many kv heads as fit kMaxRows
// query heads, all of them in a typical model: a slot's K (or V) of all kv heads is one
// contiguous run, so reading whole slots streams through memory, where one head's slice of
// every slot would be a page-crossing stride. Heads are split further only when there are too
// few items to keep every thread busy. A multi-token item takes one kv head and as many query
// rows as fit, so that each key it loads is scored against kPrefillRows rows (a small GEMM),
// and ends where a read group does (its rows must share their own group: see
// for_each_read_position).
std::vector<Item> plan_items(const int64_t* qsl, const int64_t* seq_lens, int64_t num_reqs, int64_t num_kv_heads,
                             int64_t group, int64_t block_size, int64_t num_threads, int64_t window) {
  const int64_t group_len = kGroupBlocks * block_size;
  int64_t decode_heads = std::clamp<int64_t>(kMaxRows / group, 1, num_kv_heads);
  int64_t num_rows = 0;
  for (int64_t b = 0; b < num_reqs; ++b) num_rows += seq_lens[b] == 0 ? 0 : qsl[b + 1] - qsl[b];
  while (decode_heads > 1 && num_rows * ((num_kv_heads + decode_heads - 1) / decode_heads) < 4 * num_threads)
    decode_heads /= 2;
  std::vector<Item> items;
  for (int64_t b = 0; b < num_reqs; ++b) {
    const int64_t n = seq_lens[b] == 0 ? 0 : qsl[b + 1] - qsl[b];  // seq_len 0: skipped
    const int64_t heads = n == 1 ? decode_heads : 1;
    const int64_t rows_per_item = std::max<int64_t>(1, (n == 1 ? kMaxRows : kPrefillRows) / (heads * group));
    const int64_t first_pos = seq_lens[b] - n;  // position of the request's query row 0
    for (int64_t h = 0; h < num_kv_heads; h += heads)
      for (int64_t r = 0, end; r < n; r = end) {
        const int64_t own_group = (first_pos + r) / group_len * group_len;
        end = std::min({n, r + rows_per_item, own_group + group_len - first_pos});
        const int64_t window_start = window > 0 ? std::max<int64_t>(0, first_pos + r - window + 1) : 0;
        items.push_back({b, h, std::min(num_kv_heads, h + heads), r, end, own_group,
                         window_start / kKeyTile * kKeyTile, window_start});
      }
  }
  // Longest first (by keys x rows): threads take items in this order, so the last ones are
  // short and no thread waits long for another to finish (docs/cpu_kernels.md#attention).
  // Items are independent: the order changes no result.
  std::stable_sort(items.begin(), items.end(), [&](const Item& a, const Item& b) {
    return (seq_lens[a.req] - a.key0) * (a.row1 - a.row0) > (seq_lens[b.req] - b.key0) * (b.row1 - b.row0);
  });
  return items;
}

// Calls f(pos) for the first `limit` of the positions [0, num_keys) an item reads, in the order it
// reads them. Positions fall into read groups of kGroupBlocks blocks. Those below own_group (the
// first position of the group holding the item's query rows, Item::own_group) are read group by group, one slot
// of each of the group's blocks in turn; the rest in order. Blocks are scattered in memory and a
// block's slots are 1-4 pages: reading them one block after the other keeps one or two pages'
// cache misses in flight (the hardware prefetcher stops at each page), reading a group's blocks
// side by side keeps eight (eight-block groups: the fastest size, docs/cpu_kernels.md#attention).
// Every row of an item sees all of the groups below its own, and in its own group the keys up
// to its position, which the in-order part keeps a prefix of each tile. A row's keys, their
// tiles and the order within each tile depend only on its position, not on the rows beside it,
// so a token gets the same bits in a decode and in any prefill chunk (plan_items ends chunk
// items at group boundaries so their rows share own_group).
template <typename F>
inline void for_each_read_position(int64_t num_keys, int64_t own_group, int64_t block_size, int64_t limit, F f) {
  const int64_t group_len = kGroupBlocks * block_size;
  int64_t done = 0;
  for (int64_t g0 = 0; g0 < own_group; g0 += group_len)
    for (int64_t slot = 0; slot < block_size; ++slot)
      for (int64_t pos = g0 + slot; pos < g0 + group_len; pos += block_size) {
        if (done++ == limit) return;
        f(pos);
      }
  for (int64_t pos = own_group; pos < num_keys && done < limit; ++pos, ++done) f(pos);
}

// for_each_read_position for an item of a layer with Features: without a window the same; with
// one, the positions [key0, num_keys) in order, those before window_start (seen by none of the
// item's rows, and maybe in blocks the request no longer holds) replaced by window_start. Tiles
// then start at multiples of kKeyTile whatever the item's first row, so a row's tiles and sums
// are the same in a decode and in any chunk (as without a window), and the replaced keys, masked
// for every row, only ever meet a weight of 0 and a value that is finite.
template <typename F>
inline void for_each_item_position(const Item& item, int64_t num_keys, int64_t block_size, bool windowed,
                                   int64_t limit, F f) {
  if (!windowed) return for_each_read_position(num_keys, item.own_group, block_size, limit, f);
  for (int64_t pos = item.key0; pos < num_keys && pos - item.key0 < limit; ++pos) f(std::max(pos, item.window_start));
}

// Requests the cache lines of one slot's kv heads [head0, head1), into L1 (LOCALITY 3) or L2 (2).
template <int LOCALITY, typename T>
inline void prefetch_heads(const T* slot, int64_t head0, int64_t head1, int64_t head_dim) {
  const char* first = reinterpret_cast<const char*>(slot + head0 * head_dim);
  const char* end = reinterpret_cast<const char*>(slot + head1 * head_dim);
  for (const char* p = first; p < end; p += 64) __builtin_prefetch(p, 0, LOCALITY);
}

// Q: the query and output dtype (the model's); C: the cache's, Q itself or narrower (widened on
// load, see paged_attention_math.h).
template <typename Q, typename C, bool kFeatures>
void run(const at::Tensor& query, const at::Tensor& kv_cache, const at::Tensor& block_tables,
         const at::Tensor& query_start_loc, const at::Tensor& seq_lens, double scale,
         const Features& features, at::Tensor& out) {
  const int64_t num_heads = query.size(1), head_dim = query.size(2);
  const int64_t block_size = kv_cache.size(2), num_kv_heads = kv_cache.size(3);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t num_reqs = seq_lens.size(0), max_blocks = block_tables.size(1);
  const int64_t q_tok = query.stride(0), q_head = query.stride(1);
  const int64_t o_tok = out.stride(0), o_head = out.stride(1);
  // kv_cache is contiguous [2, num_blocks, block_size, Hkv, D]: slot s of kv head h starts at
  // (s * Hkv + h) * D; values sit one half of the tensor further.
  const int64_t value_offset = kv_cache.stride(0), slot_stride = num_kv_heads * head_dim;
  const C* cache = static_cast<const C*>(kv_cache.const_data_ptr());
  const Q* q_ptr = query.const_data_ptr<Q>();
  Q* o_ptr = out.data_ptr<Q>();
  const int64_t* tables = block_tables.const_data_ptr<int64_t>();
  const int64_t* qsl = query_start_loc.const_data_ptr<int64_t>();
  const int64_t* lens = seq_lens.const_data_ptr<int64_t>();

  // Scores and values: each query row's dot product with every key it may see, twice.
  int64_t row_keys = 0;
  for (int64_t r = 0; r < num_reqs; ++r) row_keys += (qsl[r + 1] - qsl[r]) * lens[r];
  const int64_t num_threads = parallel_work::threads_for(2 * row_keys * num_heads * head_dim);
  const bool windowed = kFeatures && features.window > 0;
  const bool causal = !kFeatures || features.causal;
  // Keys past which the row at position pos sees none (its own position + 1 when causal).
  auto key_end = [&](int64_t pos, int64_t seq_len) -> int64_t {
    if (causal) return pos + 1;
    return windowed ? std::min(seq_len, pos + features.window) : seq_len;
  };
  const std::vector<Item> items = plan_items(qsl, lens, num_reqs, num_kv_heads, group, block_size, num_threads,
                                             kFeatures ? features.window : 0);
  const int64_t num_items = static_cast<int64_t>(items.size());
  std::atomic<int64_t> next{0};

  at::parallel_for(0, num_threads, 1, [&](int64_t, int64_t) {
    const int64_t max_rows = std::max({kMaxRows, kPrefillRows, group});
    // The thread's scratch lives across calls: a decode step calls this once per layer, and a
    // tiny model's call is short enough that allocating and zeroing it each time showed.
    thread_local std::vector<float> qs, acc, kt, scores, row_max, row_sum;
    auto at_least = [](std::vector<float>& v, int64_t n) { if (static_cast<int64_t>(v.size()) < n) v.resize(n); };
    at_least(qs, max_rows * head_dim), at_least(acc, max_rows * head_dim), at_least(kt, head_dim * kKeyTile);
    at_least(scores, max_rows * kKeyTile), at_least(row_max, max_rows), at_least(row_sum, max_rows);
    thread_local std::vector<const C*> slot_of;  // the item's slots in its read order (at their kv head 0)
    const C* ptrs[kKeyTile];
    // The first element (kv head 0) of the slot holding position pos of a request's table.
    auto slot_at = [&](const int64_t* tbl, int64_t pos) {
      return cache + (tbl[pos / block_size] * block_size + pos % block_size) * slot_stride;
    };
    // Each thread claims its next item one ahead, so that the next item's first keys and values
    // can be requested while this item's last tile is computed.
    int64_t it_next = next++;
    for (int64_t it = it_next; it < num_items; it = it_next) {
      it_next = next++;
      const Item item = items[it];
      const int64_t n = qsl[item.req + 1] - qsl[item.req], seq_len = lens[item.req];
      const int64_t first_pos = seq_len - n;  // position of the request's query row 0
      const int64_t item_heads = item.head1 - item.head0;  // kv heads of the item
      const int64_t item_rows = item.row1 - item.row0;     // query rows of the item
      // Rows are kv-head major: row r is kv head item.head0 + r / group_rows, query row
      // item.row0 + (r / group) % item_rows, query head kv_head * group + r % group. The
      // group_rows rows of one kv head share every key and value they read.
      const int64_t group_rows = item_rows * group;
      const int64_t rows = item_heads * group_rows;
      const int64_t* table = tables + item.req * max_blocks;
      const bool transposed = group_rows >= kTransposeRows && head_dim % kW == 0;
      auto query_row = [&](int64_t r) { return item.row0 + (r / group) % item_rows; };
      auto query_head = [&](int64_t r) { return (item.head0 + r / group_rows) * group + r % group; };
      for (int64_t r = 0; r < rows; ++r) {
        const Q* src = q_ptr + (qsl[item.req] + query_row(r)) * q_tok + query_head(r) * q_head;
        for (int64_t d = 0; d < head_dim; ++d) qs[r * head_dim + d] = static_cast<float>(src[d]) * scale;
      }
      std::fill(acc.begin(), acc.begin() + rows * head_dim, 0.f);
      std::fill(row_max.begin(), row_max.begin() + rows, -std::numeric_limits<float>::infinity());
      std::fill(row_sum.begin(), row_sum.begin() + rows, 0.f);
      if (kFeatures && features.sinks != nullptr)
        for (int64_t r = 0; r < rows; ++r) {  // the sink: a key of logit sinks[h] and value 0
          row_max[r] = features.sinks[query_head(r)];
          row_sum[r] = 1.f;
        }

      const int64_t num_keys = key_end(first_pos + item.row1 - 1, seq_len);  // the last row's keys
      // The item reads positions [key0, num_keys) (key0 > 0 in a sliding window only): read
      // index k is position key0 + k in the in-order part of the reads.
      const int64_t key0 = kFeatures ? item.key0 : 0;
      const int64_t num_read = num_keys - key0;
      // Small slots (few kv heads x head_dim) put several slots in one 4 KiB page, and the
      // hardware prefetcher stops at every page (a block's 16 slots span several, and blocks
      // are scattered): the next tile's keys and values are requested while this tile is
      // computed. Large slots are a page or more each, which the hardware streams; there the
      // extra requests only cost (docs/cpu_kernels.md#attention).
      const bool prefetch_next =
          kKeyTile * item_heads * head_dim * static_cast<int64_t>(sizeof(C)) <= kPrefetchTileBytes;
      // Padded by 7 copies of the last slot: an 8-key block may run past the end, and must read
      // (and ignore) valid memory there.
      slot_of.clear();
      auto add_slot = [&](int64_t pos) { slot_of.push_back(slot_at(table, pos)); };
      if constexpr (kFeatures)
        for_each_item_position(item, num_keys, block_size, windowed, num_read, add_slot);
      else
        for_each_read_position(num_keys, item.own_group, block_size, num_keys, add_slot);
      slot_of.resize(num_read + 7, slot_of.back());

      for (int64_t k0 = 0; k0 < num_read; k0 += kKeyTile) {
        const int64_t tile = std::min(kKeyTile, num_read - k0);
        const C* const* slots = &slot_of[k0];
        // The tile's values (read by P @ V below) are requested now, so that their cache
        // misses overlap this tile's arithmetic: read head by head, a tile's values are a 1 KiB
        // stride the hardware prefetcher does not follow across pages, and decode was bound by
        // those misses' latency, not by bandwidth. With small slots the previous tile has
        // requested them already (below), and the first tile's were requested into L2 while
        // the thread's previous item ended.
        if (!prefetch_next || k0 == 0)
          for (int64_t j = 0; j < tile; ++j)
            prefetch_heads<3>(slots[j] + value_offset, item.head0, item.head1, head_dim);
        // With small slots, the next tile's keys and values are requested a head at a time as
        // this tile reads the same head (keys into L1, values into L2), so requests go out at
        // the rate the data is used rather than in one burst of a whole tile; and in the last
        // tile, the first tile of the thread's next item (into L2). Faster than one burst per
        // tile (docs/cpu_kernels.md#attention).
        const int64_t next_keys =
            prefetch_next ? std::clamp<int64_t>(num_read - k0 - kKeyTile, 0, kKeyTile) : 0;
        auto prefetch_next_keys = [&](int64_t h, int64_t j0, int64_t j1) {  // kv head h, keys [j0, j1)
          for (int64_t j = j0; j < std::min(j1, next_keys); ++j)
            prefetch_heads<3>(slots[kKeyTile + j], item.head0 + h, item.head0 + h + 1, head_dim);
        };
        if (prefetch_next && next_keys == 0 && it_next < num_items) {
          const Item& nx = items[it_next];
          const int64_t nx_keys = key_end(lens[nx.req] - (qsl[nx.req + 1] - qsl[nx.req]) + nx.row1 - 1, lens[nx.req]);
          const int64_t* nx_table = tables + nx.req * max_blocks;
          auto prefetch_slot = [&](int64_t pos) {
            const C* slot = slot_at(nx_table, pos);
            prefetch_heads<2>(slot, nx.head0, nx.head1, head_dim);
            prefetch_heads<2>(slot + value_offset, nx.head0, nx.head1, head_dim);
          };
          if constexpr (kFeatures)
            for_each_item_position(nx, nx_keys, block_size, windowed, kKeyTile, prefetch_slot);
          else
            for_each_read_position(nx_keys, nx.own_group, block_size, kKeyTile, prefetch_slot);
        }
        // Keys a row sees in this tile: those up to its query's position (causal mask). The
        // scores are computed up to what the item's last query row sees, then masked per row.
        // k0 counts keys in read order: every key before item.own_group is visible to every row,
        // and from there on the j-th key read is position j, so the visible keys are a prefix.
        // In a sliding window (read in order from key0) they are the range [first_visible(r),
        // visible(r)) of the tile. Bidirectional without a window: every key read.
        auto visible = [&](int64_t r) {
          return std::clamp<int64_t>(key_end(first_pos + query_row(r), seq_len) - (key0 + k0), 0, tile);
        };
        auto first_visible = [&](int64_t r) -> int64_t {
          if (!windowed) return 0;
          const int64_t start = std::max<int64_t>(0, first_pos + query_row(r) - features.window + 1);
          return std::clamp<int64_t>(start - (key0 + k0), 0, tile);
        };
        const int64_t tile_visible = std::clamp<int64_t>(num_read - k0, 0, tile);
        // Scores, 8 keys at a time for every kv head, so each slot is read front to back once:
        // within a page that is one sequential stream, which the hardware prefetcher follows.
        if (transposed) {
          for (int64_t h = 0; h < item_heads; ++h) {
            const int64_t off = (item.head0 + h) * head_dim;
            prefetch_next_keys(h, 0, kKeyTile);
            for (int64_t j = 0; j < tile_visible; ++j) ptrs[j] = slots[j] + off;
            score_group_transposed(&qs[h * group_rows * head_dim], ptrs, tile_visible, group_rows,
                                   head_dim, kt.data(), &scores[h * group_rows * kKeyTile]);
          }
        }
        for (int64_t jb = 0; jb < tile_visible && !transposed; jb += 8) {
          for (int64_t h = 0; h < item_heads; ++h) {
            const int64_t off = (item.head0 + h) * head_dim;
            const C* k8[8];
            for (int j = 0; j < 8; ++j) k8[j] = slots[jb + j] + off;
            prefetch_next_keys(h, jb, jb + 8);
            score_group(&qs[h * group_rows * head_dim], k8, group_rows, head_dim,
                        &scores[h * group_rows * kKeyTile + jb]);
          }
        }
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t vis = visible(r);
          const int64_t lo = kFeatures ? first_visible(r) : 0;  // visible: [lo, vis)
          float* sr = &scores[r * kKeyTile];
          if (vis == lo) {  // nothing visible in this tile: weights 0, no update
            std::fill(sr, sr + tile, 0.f);
            continue;
          }
          // Otherwise exp_tile gives the masked keys (outside [lo, vis)) weight 0.
          if (kFeatures && features.soft_cap > 0.f) {  // after the scale, before the softmax
            const float cap = features.soft_cap, inv_cap = 1.f / cap;
#pragma omp simd
            for (int64_t j = lo; j < vis; ++j) sr[j] = cap * tanh_approx(sr[j] * inv_cap);
          }
          const float new_max = std::max(row_max[r], tile_max(sr, lo, vis));
          const float alpha = std::exp(row_max[r] - new_max);  // 0 on the first tile
          const float sum = exp_tile(sr, lo, vis, new_max);
          row_sum[r] = row_sum[r] * alpha + sum;
          row_max[r] = new_max;
          if (alpha != 1.f) {
            float* a = &acc[r * head_dim];
            for (int64_t d = 0; d < head_dim; ++d) a[d] *= alpha;
          }
        }
        // P @ V, in the same slot order; masked weights are 0.
        for (int64_t h = 0; h < item_heads && tile_visible > 0; ++h) {
          const int64_t off = value_offset + (item.head0 + h) * head_dim;
          for (int64_t j = 0; j < next_keys; ++j)
            prefetch_heads<2>(slots[kKeyTile + j] + value_offset, item.head0 + h, item.head0 + h + 1,
                              head_dim);
          for (int64_t j = 0; j < tile_visible; ++j) ptrs[j] = slots[j] + off;
          accumulate_group(&acc[h * group_rows * head_dim], &scores[h * group_rows * kKeyTile], ptrs,
                           tile_visible, group_rows, head_dim);
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        Q* dst = o_ptr + (qsl[item.req] + query_row(r)) * o_tok + query_head(r) * o_head;
        const float inv = 1.f / row_sum[r];
        for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<Q>(acc[r * head_dim + d] * inv);
      }
    }
  });
}

template <typename Q, typename C>
void dispatch(const at::Tensor& query, const at::Tensor& kv_cache, const at::Tensor& block_tables,
              const at::Tensor& query_start_loc, const at::Tensor& seq_lens, double scale,
              const Features& features, at::Tensor& out) {
  if (!features.causal || features.window > 0 || features.soft_cap > 0.f || features.sinks != nullptr)
    run<Q, C, true>(query, kv_cache, block_tables, query_start_loc, seq_lens, scale, features, out);
  else
    run<Q, C, false>(query, kv_cache, block_tables, query_start_loc, seq_lens, scale, features, out);
}

// The cache dtypes a query dtype reads (--kv-cache-dtype): its own, and the narrower ones. A
// 16-bit model's cache is never float32 (no gain), nor the other 16-bit type (a lossy swap).
template <typename Q>
void dispatch_cache(const at::Tensor& query, const at::Tensor& kv_cache, const at::Tensor& block_tables,
                    const at::Tensor& query_start_loc, const at::Tensor& seq_lens, double scale,
                    const Features& features, at::Tensor& out) {
  const at::ScalarType c = kv_cache.scalar_type();
  if (c == query.scalar_type())
    return dispatch<Q, Q>(query, kv_cache, block_tables, query_start_loc, seq_lens, scale, features, out);
  if constexpr (std::is_same_v<Q, float>) {
    if (c == at::kBFloat16)
      return dispatch<Q, c10::BFloat16>(query, kv_cache, block_tables, query_start_loc, seq_lens, scale, features, out);
    if (c == at::kHalf)
      return dispatch<Q, c10::Half>(query, kv_cache, block_tables, query_start_loc, seq_lens, scale, features, out);
  }
  if (c == at::kFloat8_e4m3fn)
    return dispatch<Q, Fp8E4M3>(query, kv_cache, block_tables, query_start_loc, seq_lens, scale, features, out);
  if (c == at::kFloat8_e5m2)
    return dispatch<Q, Fp8E5M2>(query, kv_cache, block_tables, query_start_loc, seq_lens, scale, features, out);
  TORCH_CHECK(false, "paged_attention: a ", query.scalar_type(), " query cannot read a ", c, " kv_cache");
}

at::Tensor paged_attention(const at::Tensor& query, const at::Tensor& kv_cache,
                           const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                           const at::Tensor& seq_lens, double scale, int64_t sliding_window,
                           double logits_soft_cap, const std::optional<at::Tensor>& sinks,
                           const std::optional<at::Tensor>& key, const std::optional<at::Tensor>& value,
                           const std::optional<at::Tensor>& slot_mapping, bool causal) {
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1, "query must be [T, H, D], D contiguous");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(),
              "kv_cache must be a contiguous [2, blocks, block_size, Hkv, D]");
  TORCH_CHECK(kv_cache.size(4) == query.size(2), "head_dim of query and kv_cache differ");
  TORCH_CHECK(query.size(1) % kv_cache.size(3) == 0, "heads must be a multiple of kv heads");
  for (const at::Tensor* t : {&block_tables, &query_start_loc, &seq_lens})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous(),
                "block_tables, query_start_loc and seq_lens must be contiguous int64");
  TORCH_CHECK(query_start_loc.size(0) == seq_lens.size(0) + 1 &&
                  block_tables.size(0) == seq_lens.size(0),
              "query_start_loc must be [B + 1], block_tables [B, max_blocks], seq_lens [B]");
  TORCH_CHECK(sliding_window >= 0 && logits_soft_cap >= 0, "sliding_window and logits_soft_cap must be >= 0 (0: none)");
  if (sinks.has_value())
    TORCH_CHECK(sinks->scalar_type() == at::kFloat && sinks->is_contiguous() && sinks->dim() == 1 &&
                    sinks->size(0) == query.size(1),
                "sinks must be a contiguous float32 [num_heads]");
  const Features features{sliding_window, static_cast<float>(logits_soft_cap),
                          sinks.has_value() ? sinks->const_data_ptr<float>() : nullptr, causal};
  TORCH_CHECK(key.has_value() == value.has_value() && key.has_value() == slot_mapping.has_value(),
              "key, value and slot_mapping come together (the step's K/V to store) or not at all");
  if (key.has_value()) paged_store::store_kv(kv_cache, *key, *value, *slot_mapping);
  at::Tensor out = at::empty_like(query, at::MemoryFormat::Contiguous);
  switch (query.scalar_type()) {
    case at::kFloat: dispatch_cache<float>(query, kv_cache, block_tables, query_start_loc, seq_lens, scale, features, out); break;
    case at::kBFloat16: dispatch_cache<c10::BFloat16>(query, kv_cache, block_tables, query_start_loc, seq_lens, scale, features, out); break;
    case at::kHalf: dispatch_cache<c10::Half>(query, kv_cache, block_tables, query_start_loc, seq_lens, scale, features, out); break;
    default: TORCH_CHECK(false, "paged_attention: unsupported dtype ", query.scalar_type());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(PAGEDLLM_NS, m) {
  m.def("paged_attention(Tensor query, Tensor(a!) kv_cache, Tensor block_tables, "
        "Tensor query_start_loc, Tensor seq_lens, float scale, int sliding_window=0, "
        "float logits_soft_cap=0., Tensor? sinks=None, Tensor? key=None, Tensor? value=None, "
        "Tensor? slot_mapping=None, bool causal=True) -> Tensor");
}

TORCH_LIBRARY_IMPL(PAGEDLLM_NS, CPU, m) { m.impl("paged_attention", &paged_attention); }
