// bfloat16 attention on AMX tiles (Xeons since Sapphire Rapids): part of attention.cpp, which
// includes it after State, chunk_softmax and the cache layout it reads.
//
// A tile product (tdpbf16ps) gives each element of its output from that element's row of A, its
// column of B and its old value alone: neither the other rows nor the tile's shape change its
// bits (tests/engine/test_attention.py holds the kernel to that). So a decode row (its group's
// heads as the rows of A) and a prompt's rows (up to 16 row-heads at once) take the same
// arithmetic per row-head, split by split (the splits and their merge are attention.cpp's):
//   scores: each block's 16 keys against q, from zero, sixteen pairs of dims per product in
//     order, then times the scale; one softmax step (chunk_softmax) over all the split's blocks.
//   values: from zero, one product per block (its 16 keys as eight pairs) in order, sixteen dims
//     per tile; they are the split's values (its one step starts from an empty state).
// A block all of whose keys precede the row is read as it lies. The row's own last block, when it
// reaches past the row, is read from a copy whose values past the row are zero: a slot past the
// row may hold anything (NaN included) and a zero weight would not mask it. The blocks every
// row-head of a pass reads whole are shared products; each row's last ones are its own, taken
// after (its sums leave the tiles and come back: a move, not a rounding).
//
// These are not the dot-product path's bits (the tile unit rounds its sums its own way), so one
// path serves a process: the tiles wherever the build targets them (EMBER_AMX_TILES), the
// processor has them and Linux grants them (arch_prctl's ARCH_REQ_XCOMP_PERM), for head_dim a
// multiple of 32 up to 256; else the dot products. attention_tiles(False) (EMBER_ATTENTION_TILES=0
// at load) turns them off.

namespace tiles {

constexpr int64_t MOST_ROWS = 16, MOST_DIMS = 256, SPAN = SPLIT;  // keys of one softmax step

bool granted() { return amx::granted(true, false); }

std::atomic<bool> wanted{true};  // attention_tiles(False) turns them off

bool apply(int64_t D) { return D % 32 == 0 && D <= MOST_DIMS && wanted.load() && granted(); }

// The registers' shapes: 0-3 C (M rows of 16 floats): four blocks' scores, then sixteen dims each
// of the weighted values; 4 A: sixteen pairs of the rows' dims; 5 B: a K block's sixteen
// pairs of dims, 16 keys each; 6 A: a block's eight pairs of weights; 7 B: a V block's eight pairs
// of keys, sixteen dims each.
thread_local int64_t rows_configured = 0;  // 0: not configured (released at the end of each call's work)

void configure(int64_t M) {
  if (M == rows_configured) return;
  amx::Config config;
  for (int t = 0; t < 5; ++t) config.rows[t] = uint8_t(M), config.bytes[t] = 64;
  config.rows[5] = 16, config.bytes[5] = 64;
  config.rows[6] = uint8_t(M), config.bytes[6] = 32;
  config.rows[7] = 8, config.bytes[7] = 64;
  amx::configure(config);
  rows_configured = M;
}

// Hands the tiles back (their state then costs a context switch nothing); configure takes them again.
void release() {
  if (rows_configured == 0) return;
  amx::release();
  rows_configured = 0;
}

using amx::load;
using amx::store;
using amx::zero;
template <int C, int A, int B> inline void dot() { amx::dot_bf16<C, A, B>(); }

// f(std::integral_constant<int, t>) for t in [0, n), n <= 4: a tile's number must be a constant.
template <typename F> inline void each_tile(int n, F&& f) {
  if (n > 0) f(std::integral_constant<int, 0>{});
  if (n > 1) f(std::integral_constant<int, 1>{});
  if (n > 2) f(std::integral_constant<int, 2>{});
  if (n > 3) f(std::integral_constant<int, 3>{});
}

// Adds to C tiles [0, n) one V block's products: the weights of block `blk` (tile 6) times its
// dims [d0, d0 + 16 n) (tile 7, one load per tile); a step of `drip` first.
inline void add_block(const uint32_t* pairs, int64_t blk, const at::BFloat16* vblock, int64_t D, int64_t d0, int n,
                      Drip& drip) {
  drip.step();
  load<6>(pairs + blk * BLOCK / 2, SPAN / 2 * sizeof(uint32_t));
  each_tile(n, [&](auto t) {
    load<7>(vblock + (d0 + 16 * decltype(t)::value) * 2, D * 2 * sizeof(at::BFloat16));
    dot<decltype(t)::value, 6, 7>();
  });
}

// The block's first `keys` keys' values, the rest zero, in `copy` (16 D values).
inline const at::BFloat16* values_up_to(const at::BFloat16* vblock, int64_t keys, int64_t D, at::BFloat16* copy) {
  const int64_t kept = (keys + 1) / 2 * 2 * D;  // the pairs holding a kept key; the rest are zero
  std::memcpy(copy, vblock, sizeof(at::BFloat16) * kept);
  std::memset(static_cast<void*>(copy + kept), 0, sizeof(at::BFloat16) * (BLOCK * D - kept));
  if (keys % 2)  // the last kept key's pair: its odd halves
    for (int64_t d = 0; d < D; ++d) copy[v_offset<at::BFloat16>(keys, d, D)] = at::BFloat16(0.f);
  return copy;
}

// Row-heads [0, M) of a pass, M <= 16: rows[m] its D query values, states[m] its state (no keys
// seen yet), row_of[m] its row, which sees keys [begin[row], end[row]). Every row's keys in the
// split start at `from` (a block's first key) and end within SPAN keys of it.
struct Pass {
  const at::BFloat16* const* rows;
  State* states;
  const int64_t* row_of;
  const int64_t* begin;
  const int64_t* end;
  int64_t M, from;
};

// The pass over its rows' keys of one split, one softmax step for them all: `blocks_at(position)`
// gives the K and V blocks holding a key; `drip` asks for its lines after each tile product.
template <typename Blocks>
void attend(const Pass& p, int64_t D, float scale, Drip& drip, Blocks&& blocks_at) {
  const int64_t M = p.M;
  int64_t last = p.from;
  for (int64_t m = 0; m < M; ++m) last = std::max(last, p.end[p.row_of[m]]);
  if (last <= p.from) return;  // no row of the pass reaches this split
  configure(M);
  alignas(64) at::BFloat16 copied[MOST_ROWS * MOST_DIMS];
  alignas(64) float scores[SPAN / BLOCK][MOST_ROWS][BLOCK];
  alignas(64) uint32_t pairs[MOST_ROWS][SPAN / 2];
  alignas(64) float weighted[MOST_ROWS * MOST_DIMS], own[MOST_ROWS * MOST_DIMS];
  alignas(64) at::BFloat16 copy[BLOCK * MOST_DIMS];
  // The rows of A: read where they lie if they lie at one stride (a decode row's heads), else
  // copied (a tile load just after the copy's stores would wait for them).
  const int64_t stride = M > 1 ? p.rows[1] - p.rows[0] : D;
  bool in_place = stride >= D;
  for (int64_t m = 2; m < M && in_place; ++m) in_place = p.rows[m] == p.rows[0] + m * stride;
  const at::BFloat16* q = in_place ? p.rows[0] : copied;
  const int64_t q_bytes = (in_place ? stride : D) * int64_t(sizeof(at::BFloat16));
  if (!in_place)
    for (int64_t m = 0; m < M; ++m) std::memcpy(copied + m * D, p.rows[m], sizeof(at::BFloat16) * D);
  const int64_t count = (last - p.from + BLOCK - 1) / BLOCK;
  const at::BFloat16* kblocks[SPAN / BLOCK];
  const at::BFloat16* vblocks[SPAN / BLOCK];
  for (int64_t blk = 0; blk < count; ++blk) std::tie(kblocks[blk], vblocks[blk]) = blocks_at(p.from + blk * BLOCK);
  // Each row-head's keys in the split: [first, seen) from its start, in its first `blocks_of` blocks;
  // `whole`: the blocks every row of the pass reads whole. A row that ends before the split has
  // no blocks, and its weights are zero.
  int64_t first[MOST_ROWS], seen[MOST_ROWS], blocks_of[MOST_ROWS], whole = count;
  for (int64_t m = 0; m < M; ++m) {
    const int64_t row = p.row_of[m];
    seen[m] = p.end[row] - p.from, first[m] = std::max<int64_t>(0, p.begin[row] - p.from);
    blocks_of[m] = seen[m] > 0 ? (seen[m] + BLOCK - 1) / BLOCK : 0;
    if (seen[m] > 0) whole = std::min(whole, seen[m] / BLOCK);
    else std::fill(pairs[m], pairs[m] + SPAN / 2, 0u);
  }
  // The softmax step (chunk_softmax's, split into its block-by-block parts so that the vector unit
  // works while the tiles do, the same operations in the same order for each row-head): the
  // maxima of a round's scores are taken while the next round's products run, and a block's
  // weights while the values take the weights of the block two before (a tile load then finds
  // its weights' stores done).
  __m512 vmax[MOST_ROWS], sums[MOST_ROWS];
  __mmask16 masks[MOST_ROWS][SPAN / BLOCK];
  float maxima[MOST_ROWS];
  const auto take_maxima = [&](int64_t b0, int64_t n) {
    for (int64_t m = 0; m < M; ++m)
      for (int64_t blk = b0; blk < std::min(b0 + n, blocks_of[m]); ++blk) {
        masks[m][blk] = block_keys(blk, first[m], seen[m]);
        const __m512 scaled = _mm512_mul_ps(_mm512_load_ps(scores[blk][m]), _mm512_set1_ps(scale));
        vmax[m] = _mm512_mask_max_ps(vmax[m], masks[m][blk], vmax[m], scaled);
      }
  };
  const auto take_weights = [&](int64_t blk) {
    for (int64_t m = 0; m < M; ++m)
      if (blk < blocks_of[m]) {
        const __m512 scaled = _mm512_mul_ps(_mm512_load_ps(scores[blk][m]), _mm512_set1_ps(scale));
        sums[m] = _mm512_add_ps(sums[m], block_weights(scaled, maxima[m], masks[m][blk], pairs[m] + blk * BLOCK / 2));
      }
  };
  for (int64_t m = 0; m < M; ++m) vmax[m] = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  // Scores, four blocks to a round of the C tiles.
  const int64_t sums_bytes = D * sizeof(float);
  drip.start(count * (D / 32) + count * ((D + 63) / 64));  // the score products, then the value blocks
  for (int64_t b0 = 0; b0 < count; b0 += 4) {
    const int n = int(std::min<int64_t>(4, count - b0));
    each_tile(n, [&](auto t) { zero<decltype(t)::value>(); });
    for (int64_t half = 0; half < D / 32; ++half) {
      load<4>(q + half * 32, q_bytes);
      each_tile(n, [&](auto t) {
        load<5>(kblocks[b0 + decltype(t)::value] + half * 32 * BLOCK, 2 * BLOCK * sizeof(at::BFloat16));
        dot<decltype(t)::value, 4, 5>();
        drip.step();
      });
    }
    if (b0 > 0) take_maxima(b0 - 4, 4);
    each_tile(n, [&](auto t) { store<decltype(t)::value>(scores[b0 + decltype(t)::value], BLOCK * sizeof(float)); });
  }
  take_maxima((count - 1) / 4 * 4, 4);
  for (int64_t m = 0; m < M; ++m) {
    maxima[m] = std::max(p.states[m].max, _mm512_reduce_max_ps(vmax[m]));
    sums[m] = _mm512_setzero_ps();
  }
  // Weighted values, sixty-four dims to a round of the C tiles; the first round's blocks take
  // their weights as they go.
  constexpr int64_t LAG = 2;
  for (int64_t d0 = 0; d0 < D; d0 += 64) {
    const int n = int(std::min<int64_t>(4, (D - d0) / 16));
    each_tile(n, [&](auto t) { zero<decltype(t)::value>(); });
    if (d0 == 0) {
      for (int64_t blk = 0; blk < count + LAG; ++blk) {
        if (blk >= LAG && blk - LAG < whole) add_block(pairs[0], blk - LAG, vblocks[blk - LAG], D, d0, n, drip);
        if (blk < count) take_weights(blk);
      }
    } else {
      for (int64_t blk = 0; blk < whole; ++blk) add_block(pairs[0], blk, vblocks[blk], D, d0, n, drip);
    }
    each_tile(n, [&](auto t) { store<decltype(t)::value>(weighted + d0 + 16 * decltype(t)::value, sums_bytes); });
    // Each row's blocks past the shared ones, row by row: the tiles take every row-head's sums
    // and the row's own come back.
    for (int64_t m0 = 0; m0 < M;) {
      const int64_t row = p.row_of[m0];
      int64_t m1 = m0;
      while (m1 < M && p.row_of[m1] == row) ++m1;
      if (seen[m0] > whole * BLOCK) {
        each_tile(n, [&](auto t) { load<decltype(t)::value>(weighted + d0 + 16 * decltype(t)::value, sums_bytes); });
        for (int64_t blk = whole; blk * BLOCK < seen[m0]; ++blk) {
          const int64_t keys = std::min<int64_t>(BLOCK, seen[m0] - blk * BLOCK);
          add_block(pairs[0], blk, keys == BLOCK ? vblocks[blk] : values_up_to(vblocks[blk], keys, D, copy), D, d0, n,
                    drip);
        }
        each_tile(n, [&](auto t) { store<decltype(t)::value>(own + d0 + 16 * decltype(t)::value, sums_bytes); });
        for (int64_t m = m0; m < m1; ++m) std::memcpy(weighted + m * D + d0, own + m * D + d0, sizeof(float) * 16 * n);
      }
      m0 = m1;
    }
  }
  for (int64_t m = 0; m < M; ++m) {  // the split's one step: its state held no values before
    if (seen[m] <= 0) continue;
    State& state = p.states[m];
    state.sum = std::fma(state.sum, std::exp(state.max - maxima[m]), _mm512_reduce_add_ps(sums[m]));
    state.max = maxima[m];
    std::memcpy(state.values, weighted + m * D, sizeof(float) * D);
  }
}

}  // namespace tiles
