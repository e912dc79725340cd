// Paged attention over ember's kernel cache layout, for decode and prompt rows alike.
//
// The cache of one layer is (kv_heads, blocks, 16 * D) for K and for V, or (groups, kv_heads, blocks
// of a group, 16 * D) as the engine's pool holds it (CacheLayout), a block holding 16 slots:
//   bfloat16 K: [D / 2][16][2]  one vector per pair of dims: the 16 keys' values of that pair
//   bfloat16 V: [8][D][2]       per pair of keys, every dim's two values
//   float32  K: [D][16],  V: [16][D]
// so that a block's scores and its weighted values are plain vector dot products, with no
// transposition and no sum across lanes.
//
// A row at position p attends keys [0, p], or [p - window + 1, p] for a layer with a sliding
// window: its chunks then start at the block holding the window's first key, masked up to that
// key; those positions are fixed by p, so a window keeps every promise below, and no block before
// the window is read, so such blocks may be freed. The keys are cut into splits of SPLIT keys at fixed
// positions; within a split, blocks of 16 in order, with an online softmax; then the splits'
// partial results (max, sum, weighted values) are merged in order. A row's arithmetic depends on
// its position and its data alone: it is the same alone or in a batch, decoded or inside a prompt
// chunk, whatever rows share its tile. Sequences of one row spread their splits over the threads;
// longer ones their tiles of ROW_TILE rows (TILES_ROW_TILE on AMX tiles: attention_tiles.h, a
// bfloat16 path of its own, with one softmax step a split), and where the tiles are few, each
// tile's splits too.
//
// An int8 cache (kv_int8.h) is read by the same splits and chunks, block by block, its rows
// quantized as they are stored; q and the output stay in the model's dtype.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <atomic>
#include <memory>
#include <optional>
#include <tuple>
#include <type_traits>
#include <utility>

#include "common.h"
#include "kv_int8.h"

namespace ember_kernels {
namespace {

constexpr int64_t BLOCK = 16;
constexpr int64_t CHUNK = 64;  // keys per online-softmax step: 4 blocks
constexpr int64_t SPLIT = 256;
constexpr int64_t ROW_TILE = 8, TILES_ROW_TILE = 16;  // on AMX tiles: 16 rows' heads fill whole passes

// A decode item's cache blocks asked for into L2 a share at a time among its tile products
// (tiles::attend calls step() after each), rather than all at once: a core keeps only a few lines
// in flight, so lines asked for together wait on one another and hold up the work behind them,
// while lines asked for among the work arrive as it runs (bench/prefetch_overlap.py). Empty, it
// asks for nothing.
struct Drip {
  static constexpr int64_t MOST = 2 * SPLIT / BLOCK + 4;  // an item's K and V blocks, the next item's first four
  const char* blocks[MOST];
  int64_t count = 0, lines_each = 0, at = 0, line = 0, per_step = 0;
  void add(const void* block) {
    if (count < MOST) blocks[count++] = static_cast<const char*>(block);
  }
  // The lines shared out over `steps` calls of step().
  void start(int64_t steps) { per_step = steps > 0 ? (count * lines_each + steps - 1) / steps : 0; }
  void step() {
    for (int64_t k = 0; k < per_step && at < count; ++k) {
      prefetch_to_l2(blocks[at] + line * 64);
      if (++line == lines_each) line = 0, ++at;
    }
  }
};

// The item a thread takes after the one it computes (s < 0: none), whose first blocks that one asks for.
struct Ahead {
  int64_t s = -1, kvh = 0, split = 0;
};

#include "attention_chunks.h"

#if EMBER_AMX_TILES
#include "attention_tiles.h"
#endif

// Where a layer's cache keeps block b of KV head h, in elements from its start. A cache is
// (kv_heads, blocks, block elements), every KV head's blocks in one run, or, as the engine's pool
// lays it out (ember/engine/attention.py), (groups, kv_heads, blocks of a group, block elements):
// runs of a group's blocks, group after group.
struct CacheLayout {
  int64_t kv_heads, blocks, head_stride, block_stride, group_stride, group_blocks;
  int64_t offset(int64_t h, int64_t b) const {
    return (b / group_blocks) * group_stride + h * head_stride + (b % group_blocks) * block_stride;
  }
};

CacheLayout layout_of(const at::Tensor& cache) {
  if (cache.dim() == 3)
    return {cache.size(0), cache.size(1), cache.stride(0), cache.stride(1), 0, std::max<int64_t>(1, cache.size(1))};
  return {cache.size(1), cache.size(0) * cache.size(2), cache.stride(1), cache.stride(2), cache.stride(0),
          std::max<int64_t>(1, cache.size(2))};
}

struct Batch {
  const void* q;
  int64_t q_stride, H, KVH, G, D;
  const void* k_cache;
  const void* v_cache;
  CacheLayout layout;  // of both caches
  const int32_t* tables;
  int64_t table_width;
  const int32_t* row_begin;  // (S + 1,) rows of sequence s: [row_begin[s], row_begin[s + 1])
  const int32_t* first_pos;  // (S,) the position of each sequence's first row
  int64_t window;  // keys a row sees, its own included; 0: every key before it
  float scale;
  void* out;
  bool tiles;  // bfloat16 on AMX tiles (attention_tiles.h)
};

constexpr int64_t partial_floats(int64_t D) { return 2 + D; }  // max, sum, values

// Each row-head's max and sum beside its values, in partials[i] = (max, sum, values).
inline void keep_max_and_sum(const State* states, int64_t count, int64_t D, float* partials) {
  for (int64_t i = 0; i < count; ++i) {
    partials[i * partial_floats(D)] = states[i].max;
    partials[i * partial_floats(D) + 1] = states[i].sum;
  }
}

#if EMBER_AMX_TILES
// A tile's R rows' G heads each (row-head i * G + g) over one split on AMX tiles, in passes of up to
// 16 consecutive row-heads whose rows' chunks start at the same key.
template <typename Blocks>
void tile_passes(int64_t R, int64_t G, int64_t D, float scale, const at::BFloat16* const* rows, State* states,
                 const int64_t* first_chunk, const int64_t* begin, const int64_t* end, Drip& drip,
                 Blocks&& blocks_at) {
  int64_t row_of[tiles::MOST_ROWS];
  for (int64_t a = 0; a < R * G;) {
    int64_t z = a;
    for (; z < R * G && z - a < tiles::MOST_ROWS && first_chunk[z / G] == first_chunk[a / G]; ++z)
      row_of[z - a] = z / G;
    tiles::attend(tiles::Pass{rows + a, states + a, row_of, begin, end, z - a, first_chunk[a / G]}, D, scale, drip,
                  blocks_at);
    a = z;
  }
}
#endif

// The first key a row at position pos sees: its window's first, or 0.
inline int64_t first_key(const Batch& b, int64_t pos) {
  return b.window > 0 ? std::max<int64_t>(0, pos + 1 - b.window) : 0;
}

// Partials of rows [r0, r1) of sequence s, KV head kvh, split `split`: for each row and head of the
// group, (max, sum, values) into partials[(row - r0) * G + g]. T: q's dtype; C: the cache's (T or int8).
// `ahead`: the item the thread takes next, a one-row sequence's split.
template <typename T, typename C>
void split_partials(const Batch& b, int64_t s, int64_t kvh, int64_t split, int64_t r0, int64_t r1, float* partials,
                    Ahead ahead = {}) {
  const int64_t D = b.D, G = b.G, lo = split * SPLIT, R = r1 - r0;
  const T* q = static_cast<const T*>(b.q);
  const C* keys = static_cast<const C*>(b.k_cache);
  const C* vals = static_cast<const C*>(b.v_cache);
  const int32_t* table = b.tables + s * b.table_width;
  // the thread's scratch, kept from call to call (every entry is set below before it is read)
  thread_local std::vector<State> states;
  thread_local std::vector<const T*> rows;
  thread_local std::vector<int64_t> first_chunk, end, begin;
  states.resize(R * G), rows.resize(R * G), first_chunk.resize(R), end.resize(R), begin.resize(R);
  int64_t chunks = 0;  // the most any row of the tile takes
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t i = r - r0, pos = b.first_pos[s] + (r - b.row_begin[s]);
    end[i] = std::min<int64_t>(pos + 1, lo + SPLIT);
    begin[i] = first_key(b, pos);
    // A window's chunks start at the block holding its first key (a position fixed by the row's),
    // so no block before the window is read.
    first_chunk[i] = std::max(lo, begin[i] / BLOCK * BLOCK);
    chunks = std::max(chunks, (end[i] - first_chunk[i] + CHUNK - 1) / CHUNK);
    for (int64_t g = 0; g < G; ++g) {
      float* p = partials + (i * G + g) * partial_floats(D);
      states[i * G + g] = State{-std::numeric_limits<float>::infinity(), 0.f, p + 2};
      std::fill(p + 2, p + 2 + D, 0.f);
      rows[i * G + g] = q + r * b.q_stride + (kvh * G + g) * D;
    }
  }
#if EMBER_AMX_TILES
  if constexpr (std::is_same_v<T, at::BFloat16> && std::is_same_v<C, at::BFloat16>) {
    if (b.tiles) {
      // A decode row's blocks out of the caches (the weights streamed through since the last step):
      // its K blocks past the first round of four (the item before asked for those of the first), its
      // V blocks, then the first four K blocks of the thread's next item, asked for among its tile
      // products (decode steps of 32 x 250 to 1 x 8,000 tokens on the Intel Xeon: 0.93x-0.96x the
      // time of none, switched inside one build; all at once a round ahead, as the dot products
      // below, 0.98x-1.06x). A prompt's rows read each block many times over; theirs are left to
      // the hardware (asked for a round ahead, they took 1.08x-1.12x the time).
      Drip drip;
      if (R == 1) {
        drip.lines_each = b.layout.block_stride * int64_t(sizeof(C)) / 64;
        for (int64_t pos = first_chunk[0] + 4 * BLOCK; pos < end[0]; pos += BLOCK)
          drip.add(keys + b.layout.offset(kvh, table[pos / BLOCK]));
        for (int64_t pos = first_chunk[0]; pos < end[0]; pos += BLOCK)
          drip.add(vals + b.layout.offset(kvh, table[pos / BLOCK]));
        if (ahead.s >= 0) {
          const int64_t pos = b.first_pos[ahead.s];
          const int64_t from = std::max(ahead.split * SPLIT, first_key(b, pos) / BLOCK * BLOCK);
          const int32_t* next_table = b.tables + ahead.s * b.table_width;
          for (int64_t key = from; key < std::min<int64_t>(pos + 1, from + 4 * BLOCK); key += BLOCK)
            drip.add(keys + b.layout.offset(ahead.kvh, next_table[key / BLOCK]));
        }
      }
      tile_passes(R, G, D, b.scale, rows.data(), states.data(), first_chunk.data(), begin.data(), end.data(), drip,
                  [&](int64_t pos) {
                    const int64_t base = b.layout.offset(kvh, table[pos / BLOCK]);
                    return std::make_pair(keys + base, vals + base);
                  });
      return keep_max_and_sum(states.data(), R * G, D, partials);
    }
  }
#endif
  // Chunk by chunk, every row of the tile in turn, so the rows share a chunk's keys and values
  // while they are in L1; each row still takes its own chunks in order. The blocks of the tile's
  // last row (the furthest) are asked for a chunk ahead, the first chunk's at once: a decode step
  // finds them out of the caches (the weights streamed through since the last step), and the
  // hardware's prefetcher loses the thread at each block's end where blocks do not lie in a run
  // (bench/attention_versions.py on the Zen 4, 2026-12-05: cold, 1.02-1.09x; scattered,
  // 1.35-1.64x; in the caches, 0.90-0.96x).
  const int64_t block_bytes = b.layout.block_stride * int64_t(sizeof(C));
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t next = first_chunk[R - 1] + (c + 1) * CHUNK;
    for (int64_t pos = c == 0 ? first_chunk[R - 1] : next; pos < std::min(end[R - 1], next + CHUNK); pos += BLOCK) {
      const int64_t base = b.layout.offset(kvh, table[pos / BLOCK]);
      for (int64_t line = 0; line < block_bytes; line += 64) {
        prefetch_to_l2(reinterpret_cast<const char*>(keys + base) + line);
        prefetch_to_l2(reinterpret_cast<const char*>(vals + base) + line);
      }
    }
    for (int64_t i = 0, rows_at_once = 1; i < R; i += rows_at_once) {
      const int64_t chunk = first_chunk[i] + c * CHUNK;
      rows_at_once = 1;
      if (chunk >= end[i]) continue;
      const int64_t count = (std::min(end[i], chunk + CHUNK) - chunk + BLOCK - 1) / BLOCK;
      const C* kblocks[CHUNK / BLOCK];
      const C* vblocks[CHUNK / BLOCK];
      for (int64_t blk = 0; blk < count; ++blk) {
        const int64_t base = b.layout.offset(kvh, table[chunk / BLOCK + blk]);
        kblocks[blk] = keys + base;
        vblocks[blk] = vals + base;
      }
      const int64_t first = std::max<int64_t>(0, begin[i] - chunk), valid = std::min(end[i], chunk + CHUNK) - chunk;
      if constexpr (WIDENED_ROWS_SHARE_CHUNKS && std::is_same_v<T, at::BFloat16> && std::is_same_v<C, T>) {
        // the next rows that see this chunk's keys as this one does: more heads of one call
        while (i + rows_at_once < R && (rows_at_once + 1) * G * D <= MOST_WIDENED &&
               (rows_at_once + 1) * G <= MOST_WIDENED_HEADS &&
               first_chunk[i + rows_at_once] == first_chunk[i] && begin[i + rows_at_once] == begin[i] &&
               std::min(end[i + rows_at_once], chunk + CHUNK) == chunk + valid)
          ++rows_at_once;
      }
      if constexpr (std::is_same_v<C, int8_t>)
        attend_chunk_int8<T>(rows.data() + i * G, G, kblocks, vblocks, count, D, first, valid, b.scale,
                             states.data() + i * G);
      else
        attend_chunk<T>(rows.data() + i * G, rows_at_once * G, kblocks, vblocks, count, D, first, valid, b.scale,
                        states.data() + i * G);
    }
  }
  keep_max_and_sum(states.data(), R * G, D, partials);
}

// out = sum_j e^(max_j - M) values_j / sum_j e^(max_j - M) sum_j over a row-head's splits, in order.
template <typename T>
void merge(const float* partials, int64_t splits, int64_t stride, int64_t D, T* out) {
  float max = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < splits; ++j) max = std::max(max, partials[j * stride]);
  constexpr int64_t MOST_ON_STACK = 512;  // a row-head's dims; more (none known) take the heap
  float on_stack[MOST_ON_STACK];
  std::vector<float> on_heap(D > MOST_ON_STACK ? D : 0);
  float* const values = D > MOST_ON_STACK ? on_heap.data() : on_stack;
  std::fill(values, values + D, 0.f);
  float total = 0.f;
  for (int64_t j = 0; j < splits; ++j) {
    const float* p = partials + j * stride;
    const float weight = std::exp(p[0] - max);
    total = std::fma(weight, p[1], total);
    axpy(weight, p + 2, values, D);
  }
  const float inv = 1.f / total;
  int64_t d = 0;
#if EMBER_AVX512
  for (; d < D; d += 16) {
    const __mmask16 lanes = first_lanes(D - d);
    store16(out + d, _mm512_mul_ps(_mm512_maskz_loadu_ps(lanes, values + d), _mm512_set1_ps(inv)), lanes);
  }
#endif
  for (; d < D; ++d) out[d] = from_float<T>(values[d] * inv);
}

template <typename T, typename C>
void attention_impl(const Batch& b, int64_t S) {
  const int64_t G = b.G, D = b.D, P = partial_floats(D);
  // Work items: (sequence, kv head, split) for one-row sequences, (sequence, kv head, tile) else.
  // Where the tiles are fewer than two a thread (a drafted round's rows fill one tile a KV head,
  // and the default model has 3 KV heads for 2 threads), each tile's splits are items of their own
  // too: the item that computes a tile's last split merges its rows, as for one-row sequences.
  // The same calls on the same rows either way, so the same bits. Where there are tiles, the
  // threads take the items longest first, each the next one left as it finishes one (a prompt
  // chunk's later tiles read more keys than its first: shared out in even runs, one thread got
  // most of them); one-row sequences alone are shared out in even runs, which keeps each one's
  // splits of a KV head on one core for its merge.
  struct Item { int64_t s, kvh, part, split, group, cost; };  // group >= 0: one split of a split tile
  const int64_t row_tile = b.tiles ? TILES_ROW_TILE : ROW_TILE;
  const auto tile_splits = [&](int64_t s, int64_t r1) {  // the splits a tile ending before row r1 reaches
    return (b.first_pos[s] + (r1 - 1 - b.row_begin[s])) / SPLIT + 1;
  };
  int64_t tiles_in_step = 0;
  for (int64_t s = 0; s < S; ++s) {
    const int64_t rows = b.row_begin[s + 1] - b.row_begin[s];
    if (rows > 1) tiles_in_step += b.KVH * ((rows + row_tile - 1) / row_tile);
  }
  const bool split_tiles = tiles_in_step < 2 * at::get_num_threads();
  std::vector<Item> items;
  std::vector<int64_t> first_split(S, -1), splits_of(S, 0), group_first;  // group_first: offsets into `grouped`
  int64_t single_partials = 0, grouped_partials = 0;
  for (int64_t s = 0; s < S; ++s) {
    const int64_t rows = b.row_begin[s + 1] - b.row_begin[s];
    const int64_t last = b.first_pos[s] + rows - 1;  // the position of its last row
    if (rows == 1) {
      splits_of[s] = last / SPLIT + 1;
      first_split[s] = single_partials;
      single_partials += splits_of[s] * b.KVH;
      for (int64_t kvh = 0; kvh < b.KVH; ++kvh)
        for (int64_t j = 0; j < splits_of[s]; ++j)
          items.push_back({s, kvh, j, 0, -1, std::min(SPLIT, last + 1 - j * SPLIT)});
      continue;
    }
    for (int64_t kvh = 0; kvh < b.KVH; ++kvh)
      for (int64_t tile = 0; tile * row_tile < rows; ++tile) {
        const int64_t tile_rows = std::min(row_tile, rows - tile * row_tile);
        const int64_t r1 = b.row_begin[s] + tile * row_tile + tile_rows;  // the row after its last
        const int64_t keys = b.first_pos[s] + (r1 - b.row_begin[s]);  // the keys its last row attends
        if (!split_tiles) {
          items.push_back({s, kvh, tile, 0, -1, tile_rows * keys});
          continue;
        }
        const int64_t group = int64_t(group_first.size()), splits = tile_splits(s, r1);
        group_first.push_back(grouped_partials);
        grouped_partials += splits * tile_rows * G * P;
        for (int64_t j = 0; j < splits; ++j)
          items.push_back({s, kvh, tile, j, group, tile_rows * std::min(SPLIT, keys - j * SPLIT)});
      }
  }
  std::vector<float> single(single_partials * G * P), grouped(grouped_partials);
  // Splits of each (one-row sequence, kv head), and of each split tile, computed so far: the item
  // that computes the last one merges them all, in order (one parallel region serves: a second
  // costs a wake-up of every thread), and the bits are the merge's whoever runs it.
  const int64_t groups = int64_t(group_first.size());
  const std::unique_ptr<std::atomic<int64_t>[]> splits_done(new std::atomic<int64_t>[S * b.KVH + groups]);
  for (int64_t i = 0; i < S * b.KVH + groups; ++i) splits_done[i].store(0, std::memory_order_relaxed);
  T* out = static_cast<T*>(b.out);
  // A tile's rows [r0, r1), each from the splits it reaches, out of partials laid out split by split.
  const auto merge_tile = [&](int64_t s, int64_t kvh, int64_t r0, int64_t r1, const float* partials) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t g = 0; g < G; ++g)
        merge<T>(partials + ((r - r0) * G + g) * P, tile_splits(s, r + 1), (r1 - r0) * G * P, D,
                 out + r * b.H * D + (kvh * G + g) * D);
  };
  const auto attend_item = [&](const Item& item, std::vector<float>& local, Ahead ahead) {
    const int64_t s = item.s, kvh = item.kvh, row0 = b.row_begin[s];
    // acq_rel below: the last sees every other split's partials, written before their increments
    if (first_split[s] >= 0) {  // one split of a one-row sequence
      float* first = single.data() + ((first_split[s] + kvh * splits_of[s]) * G) * P;
      split_partials<T, C>(b, s, kvh, item.part, row0, row0 + 1, first + item.part * G * P, ahead);
      if (splits_done[s * b.KVH + kvh].fetch_add(1, std::memory_order_acq_rel) + 1 == splits_of[s])
        for (int64_t g = 0; g < G; ++g)
          merge<T>(first + g * P, splits_of[s], G * P, D, out + row0 * b.H * D + (kvh * G + g) * D);
      return;
    }
    const int64_t r0 = row0 + item.part * row_tile, r1 = std::min<int64_t>(b.row_begin[s + 1], r0 + row_tile);
    const int64_t splits = tile_splits(s, r1);
    if (item.group >= 0) {  // one split of a split tile
      float* partials = grouped.data() + group_first[item.group];
      split_partials<T, C>(b, s, kvh, item.split, r0, r1, partials + item.split * (r1 - r0) * G * P);
      if (splits_done[S * b.KVH + item.group].fetch_add(1, std::memory_order_acq_rel) + 1 == splits)
        merge_tile(s, kvh, r0, r1, partials);
      return;
    }
    // every entry is written (split_partials) before the merge reads it: no zeroing first
    if (int64_t(local.size()) < splits * (r1 - r0) * G * P) local.resize(splits * (r1 - r0) * G * P);
    for (int64_t j = 0; j < splits; ++j)
      split_partials<T, C>(b, s, kvh, j, r0, r1, local.data() + j * (r1 - r0) * G * P);
    merge_tile(s, kvh, r0, r1, local.data());
  };
  const int64_t count = int64_t(items.size());
  if (tiles_in_step == 0) {  // one-row sequences alone: equal splits, each run of them on one thread
    at::parallel_for(0, count, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> local;
      for (int64_t i = begin; i < end; ++i) {
        const Ahead ahead = i + 1 < end ? Ahead{items[i + 1].s, items[i + 1].kvh, items[i + 1].part} : Ahead{};
        attend_item(items[i], local, ahead);
      }
#if EMBER_AMX_TILES
      if (b.tiles) tiles::release();  // other code (oneDNN's kernels) may configure them its own way
#endif
    });
    return;
  }
  std::stable_sort(items.begin(), items.end(), [](const Item& x, const Item& y) { return x.cost > y.cost; });
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(count, at::get_num_threads()), 1, [&](int64_t, int64_t) {
    std::vector<float> local;
    for (int64_t i = next.fetch_add(1, std::memory_order_relaxed); i < count;
         i = next.fetch_add(1, std::memory_order_relaxed))
      attend_item(items[i], local, Ahead{});
#if EMBER_AMX_TILES
    if (b.tiles) tiles::release();
#endif
  });
}

// Whether bfloat16 attention takes AMX tiles from now on: `enable` turns them on or off (for tests
// of the other path; every row of a process should take one path), None leaves them.
bool attention_tiles(std::optional<bool> enable) {
#if EMBER_AMX_TILES
  if (enable) tiles::wanted.store(*enable);
  return tiles::wanted.load() && tiles::granted();
#else
  return false;
#endif
}

bool is_int8(const at::Tensor& cache) { return cache.scalar_type() == at::kChar; }

void check_cache(const at::Tensor& k_cache, const at::Tensor& v_cache, int64_t D) {
  const int64_t block = is_int8(k_cache) ? kv_int8::block_bytes(D) : BLOCK * D;
  TORCH_CHECK((k_cache.dim() == 3 || k_cache.dim() == 4) && k_cache.size(-1) == block && k_cache.stride(-1) == 1 &&
                  k_cache.stride(-2) == block,
              "the cache must be (kv_heads, blocks, 16 * head_dim) or (groups, kv_heads, blocks of a group, 16 * "
              "head_dim), int8 with 16 * (head_dim + 4)");
  TORCH_CHECK(!is_int8(k_cache) || D % 16 == 0, "an int8 cache needs head_dim a multiple of 16");
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes() && v_cache.strides() == k_cache.strides() &&
              v_cache.scalar_type() == k_cache.scalar_type(), "v_cache unlike k_cache");
  TORCH_CHECK(k_cache.scalar_type() != at::kBFloat16 || D % 16 == 0 || !EMBER_BF16_DOT,
              "bfloat16 attention needs head_dim a multiple of 16");
}

// q (T, H, D) rows with contiguous heads; sequence s owns rows [row_begin[s], row_begin[s + 1])
// at positions first_pos[s] onward, its blocks listed in block_table[s].
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_table, const at::Tensor& row_begin, const at::Tensor& first_pos,
                           double scale, int64_t window) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2), "q must be (T, heads, head_dim) rows");
  check_cache(k_cache, v_cache, q.size(2));
  const CacheLayout layout = layout_of(k_cache);
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), KVH = layout.kv_heads, S = first_pos.numel();
  TORCH_CHECK(H % KVH == 0 && (is_int8(k_cache) || q.scalar_type() == k_cache.scalar_type()),
              "heads: a multiple of kv_heads; q in the cache's dtype, unless the cache is int8");
  TORCH_CHECK(!is_int8(k_cache) || ((H / KVH) * D <= INT8_MOST_FLOATS && H / KVH <= INT8_MOST_HEADS),
              "an int8 cache takes at most 64 query heads per KV head and 8192 of their dims");
  for (const at::Tensor* t : {&block_table, &row_begin, &first_pos})
    TORCH_CHECK(t->scalar_type() == at::kInt && t->is_contiguous(), "block_table, row_begin, first_pos: int32");
  TORCH_CHECK(block_table.dim() == 2 && block_table.size(0) == S && row_begin.numel() == S + 1,
              "one block table row and row range per sequence");
  TORCH_CHECK(S == 0 || row_begin.data_ptr<int32_t>()[S] == T, "the sequences' rows must cover q");
  auto out = at::empty({T, H, D}, q.options());
  if (T == 0) return out;
  Batch b{q.data_ptr(), q.stride(0), H, KVH, H / KVH, D, k_cache.data_ptr(), v_cache.data_ptr(), layout,
          block_table.data_ptr<int32_t>(), block_table.size(1), row_begin.data_ptr<int32_t>(),
          first_pos.data_ptr<int32_t>(), window, float(scale), out.data_ptr(), false};
#if EMBER_AMX_TILES
  b.tiles = q.scalar_type() == at::kBFloat16 && k_cache.scalar_type() == at::kBFloat16 && tiles::apply(D);
#endif
  dispatch_float_or_bf16(q.scalar_type(), [&](auto tag) {
    using T_ = decltype(tag);
    if (is_int8(k_cache))
      attention_impl<T_, int8_t>(b, S);
    else
      attention_impl<T_, T_>(b, S);
  });
  return out;
}

// One row's k and v (D values each) into the cache's `slot` of KV head kvh, quantized where it is int8.
template <typename T>
inline void store_slot(const T* k, const T* v, int64_t slot, int64_t kvh, const at::Tensor& k_cache,
                       const at::Tensor& v_cache, const CacheLayout& layout, int64_t D) {
  const int64_t at = layout.offset(kvh, slot / BLOCK), key = slot % BLOCK;
  if (!is_int8(k_cache)) {
    T* kb = k_cache.data_ptr<T>() + at;
    T* vb = v_cache.data_ptr<T>() + at;
    for (int64_t d = 0; d < D; ++d) {
      kb[k_offset<T>(key, d, D)] = k[d];
      vb[v_offset<T>(key, d, D)] = v[d];
    }
    return;
  }
  kv_int8::store_row<T>(k, D, k_cache.data_ptr<int8_t>() + at, key, false);
  kv_int8::store_row<T>(v, D, v_cache.data_ptr<int8_t>() + at, key, true);
}

// k, v (T, KVH, D) with contiguous heads -> the cache's slots[t].
void store_kv_(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
               const at::Tensor& slots) {
  const int64_t T = k.size(0), KVH = k.size(1), D = k.size(2);
  check_cache(k_cache, v_cache, D);
  TORCH_CHECK(k.stride(2) == 1 && k.stride(1) == D && v.stride(2) == 1 && v.stride(1) == D && v.sizes() == k.sizes() &&
              (k.scalar_type() == k_cache.scalar_type() || is_int8(k_cache)) && v.scalar_type() == k.scalar_type(),
              "k and v: (T, kv_heads, head_dim) rows in the cache's dtype (any, for an int8 cache)");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == T, "one int64 slot per row");
  const CacheLayout layout = layout_of(k_cache);
  TORCH_CHECK(layout.kv_heads == KVH, "k and v: the cache's kv_heads");
  dispatch_float_or_bf16(k.scalar_type(), [&](auto tag) {
    using T_ = decltype(tag);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < KVH; ++h)
        store_slot<T_>(k.data_ptr<T_>() + t * k.stride(0) + h * D, v.data_ptr<T_>() + t * v.stride(0) + h * D,
                       slots.data_ptr<int64_t>()[t], h, k_cache, v_cache, layout, D);
  });
}

// A fused qkv projection (T, (H + 2 KVH) D): rotate its q and k heads in place (rotate-half, each
// output in one float rounding), then store its k and v heads at slots[t].
void rotary_store_(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache,
                   at::Tensor& v_cache, const at::Tensor& slots, int64_t heads, int64_t kv_heads) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) % (heads + 2 * kv_heads) == 0 && qkv.stride(1) == 1,
              "qkv must be (T, (H + 2 KVH) D) rows");
  const int64_t T = qkv.size(0), D = qkv.size(1) / (heads + 2 * kv_heads), half = D / 2;
  check_cache(k_cache, v_cache, D);
  const CacheLayout layout = layout_of(k_cache);
  TORCH_CHECK(layout.kv_heads == kv_heads && (k_cache.scalar_type() == qkv.scalar_type() || is_int8(k_cache)),
              "the cache: kv_heads, and qkv's dtype or int8");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == T, "one int64 slot per row");
  TORCH_CHECK(cos.size(0) == T && cos.size(-1) == half && cos.stride(-1) == 1 && sin.strides() == cos.strides() &&
              sin.sizes() == cos.sizes() && cos.scalar_type() == qkv.scalar_type(), "cos and sin: (T, D / 2) rows");
  const int64_t row_stride = cos.stride(0), heads_in_row = heads + kv_heads, width = qkv.stride(0);
  // No two threads store into one cache block of one KV head, whose lines interleave its 16 keys
  // (a thread each writing half of a block's keys moved every line between the cores: 9 to 32
  // rows took up to three times as long). Rows are cut into parts at block changes once a part
  // holds a block's worth; with a part or two per thread, each part's heads are split too: an item
  // rotates one q head, or one k head and stores that KV head's k and v, over its part's rows.
  // Up to 8 rows run on the calling thread, not worth waking the others for.
  const int64_t* slot = slots.data_ptr<int64_t>();
  std::vector<int64_t> part_begin{0};
  for (int64_t t = 1; t < T && T > 8; ++t)
    if (t - part_begin.back() >= BLOCK && slot[t] / BLOCK != slot[t - 1] / BLOCK) part_begin.push_back(t);
  part_begin.push_back(T);
  const int64_t parts = int64_t(part_begin.size()) - 1;
  const int64_t heads_apart = T > 8 && parts < 2 * at::get_num_threads() ? heads_in_row : 1;
  dispatch_float_or_bf16(qkv.scalar_type(), [&](auto tag) {
    using T_ = decltype(tag);
    T_* const rows = qkv.data_ptr<T_>();
    const T_ *const cos_rows = cos.data_ptr<T_>(), *const sin_rows = sin.data_ptr<T_>();
    at::parallel_for(0, parts * heads_apart, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> c(half), s(half);
      for (int64_t item = begin; item < end; ++item) {
        const int64_t part = item / heads_apart, first = heads_apart == 1 ? 0 : item % heads_apart;
        const int64_t last = heads_apart == 1 ? heads_in_row : first + 1;  // the item's heads: [first, last)
        for (int64_t t = part_begin[part]; t < part_begin[part + 1]; ++t) {
          T_* row = rows + t * width;
          rotate_heads<T_>(row + first * D, last - first, D, half, cos_rows + t * row_stride, sin_rows + t * row_stride,
                           c.data(), s.data());
          for (int64_t head = std::max(first, heads); head < last; ++head)
            store_slot<T_>(row + head * D, row + (head + kv_heads) * D, slot[t], head - heads, k_cache, v_cache, layout,
                           D);
        }
      }
    });
  });
}

// The cache's blocks back in the (kv_heads, slots, D) layout: for tests and for debugging. An int8
// cache comes back as float32, each value times its row's scale.
at::Tensor unpack_cache(const at::Tensor& cache, bool values, int64_t D) {
  const CacheLayout layout = layout_of(cache);
  const int64_t KVH = layout.kv_heads, blocks = layout.blocks;
  if (is_int8(cache)) {
    auto out = at::empty({KVH, blocks * BLOCK, D}, cache.options().dtype(at::kFloat));
    for (int64_t h = 0; h < KVH; ++h)
      for (int64_t slot = 0; slot < blocks * BLOCK; ++slot) {
        const int8_t* block = cache.data_ptr<int8_t>() + layout.offset(h, slot / BLOCK);
        const int64_t key = slot % BLOCK;
        for (int64_t d = 0; d < D; ++d)
          out.data_ptr<float>()[(h * blocks * BLOCK + slot) * D + d] =
              float(block[values ? key * D + d : d * BLOCK + key]) * kv_int8::scales(block, D)[key];
      }
    return out;
  }
  auto out = at::empty({KVH, blocks * BLOCK, D}, cache.options());
  dispatch_float_or_bf16(cache.scalar_type(), [&](auto tag) {
    using T_ = decltype(tag);
    for (int64_t h = 0; h < KVH; ++h)
      for (int64_t slot = 0; slot < blocks * BLOCK; ++slot)
        for (int64_t d = 0; d < D; ++d) {
          const T_* block = cache.data_ptr<T_>() + layout.offset(h, slot / BLOCK);
          const int64_t key = slot % BLOCK;
          out.data_ptr<T_>()[(h * blocks * BLOCK + slot) * D + d] = block[values ? v_offset<T_>(key, d, D) : k_offset<T_>(key, d, D)];
        }
  });
  return out;
}

}  // namespace
}  // namespace ember_kernels

TORCH_LIBRARY_FRAGMENT(EMBER_OPS, m) {
  m.def("paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, Tensor row_begin, "
        "Tensor first_pos, float scale, int window=0) -> Tensor");
  m.def("store_kv_(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots) -> ()");
  m.def("rotary_store_(Tensor(a!) qkv, Tensor cos, Tensor sin, Tensor(b!) k_cache, Tensor(c!) v_cache, Tensor slots, "
        "int heads, int kv_heads) -> ()");
  m.def("unpack_cache(Tensor cache, bool values, int head_dim) -> Tensor");
  m.def("attention_tiles(bool? enable=None) -> bool", &ember_kernels::attention_tiles);
}

TORCH_LIBRARY_IMPL(EMBER_OPS, CPU, m) {
  m.impl("paged_attention", &ember_kernels::paged_attention);
  m.impl("store_kv_", &ember_kernels::store_kv_);
  m.impl("rotary_store_", &ember_kernels::rotary_store_);
  m.impl("unpack_cache", &ember_kernels::unpack_cache);
}
