// Paged attention over ember's kernel cache layout, for decode and prompt rows alike.
//
// The cache of one layer is (kv_heads, blocks, 16 * D) for K and for V, a block holding 16 slots:
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
// bfloat16 path of its own, with one softmax step a split).
//
// An int8 cache (kv_int8.h) is read by the same splits and chunks, block by block, its rows
// quantized as they are stored; q and the output stay in the model's dtype.

#include <atomic>
#include <memory>
#include <optional>
#include <tuple>
#include <type_traits>
#include <utility>

#include "common.h"
#include "kv_int8.h"

// AMX tiles for bfloat16 attention (attention_tiles.h), where the build targets a processor with
// them (and so has a compiler and assembler that know them).
#if EMBER_BF16_DOT && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define EMBER_AMX_TILES 1
#else
#define EMBER_AMX_TILES 0
#endif

#if EMBER_AMX_TILES
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace ember_kernels {
namespace {

constexpr int64_t BLOCK = 16;
constexpr int64_t CHUNK = 64;  // keys per online-softmax step: 4 blocks
constexpr int64_t SPLIT = 256;
constexpr int64_t ROW_TILE = 8, TILES_ROW_TILE = 16;  // on AMX tiles: 16 rows' heads fill whole passes

// Where element (slot-in-block `key`, dim d) of a block lives.
template <typename T> inline int64_t k_offset(int64_t key, int64_t d, int64_t D);
template <> inline int64_t k_offset<at::BFloat16>(int64_t key, int64_t d, int64_t) { return ((d / 2) * BLOCK + key) * 2 + d % 2; }
template <> inline int64_t k_offset<float>(int64_t key, int64_t d, int64_t) { return d * BLOCK + key; }
template <typename T> inline int64_t v_offset(int64_t key, int64_t d, int64_t D);
template <> inline int64_t v_offset<at::BFloat16>(int64_t key, int64_t d, int64_t D) { return ((key / 2) * D + d) * 2 + key % 2; }
template <> inline int64_t v_offset<float>(int64_t key, int64_t d, int64_t D) { return key * D + d; }

// One (row, head)'s running state within a split.
struct State {
  float max, sum;
  float* values;  // D floats
};

// Scores of one query row (D values, already in the cache's dtype) against a block's 16 keys.
template <typename T>
inline void block_scores(const T* q, const T* kblock, int64_t D, float scale, float* out);

// values = values * correction + the block's probabilities times its values, each dim over the keys in order.
template <typename T>
inline void block_values(const float* probs, const T* vblock, int64_t D, int64_t valid, float correction,
                         float* values);

// The bfloat16 path without the bfloat16 dot-product instructions (with them, head_dim 64 and
// 128 take attend_chunk below). On AVX2 a block's scores are a lane per key, summed in four
// chains (even and odd dims of alternate pairs: one chain would wait on each fma in turn) that
// are added at the end in a fixed order; its values a lane per dim, every key in order. The
// heads of a KV group share each block's loads, and a prompt tile's rows take each chunk in turn
// while it is in L1: neither changes any head's arithmetic.
#if EMBER_AVX2
// A block's eight 32-bit lanes of bfloat16 pairs as floats: the even and the odd of each pair.
inline __m256 even_halves(__m256i pairs) { return _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16)); }
inline __m256 odd_halves(__m256i pairs) {
  return _mm256_castsi256_ps(_mm256_and_si256(pairs, _mm256_set1_epi32(int(0xffff0000u))));
}

// q's D bfloat16 values as floats, eight at a time (exact: a bfloat16 is a float's top half).
inline void widen_query(const at::BFloat16* q, int64_t D, float* qf) {
  for (int64_t d = 0; d < D; d += 8) {
    const __m128i halves = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + d));
    _mm256_store_ps(qf + d, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(halves), 16)));
  }
}

// The scores of N heads' queries (as floats) against one block, keys 8 * half to 8 * half + 7 of
// each: the four chains of block_scores per head, so a head's sums are the same as alone, while
// the block's pairs are loaded and widened once for all N.
template <int N>
inline void heads_scores(const float* const* qf, const at::BFloat16* kblock, int64_t D, float scale, int half,
                         float* const* out) {
  __m256 acc[N][4];
  for (int h = 0; h < N; ++h)
    for (int chain = 0; chain < 4; ++chain) acc[h][chain] = _mm256_setzero_ps();
  for (int64_t i = 0; i < D / 2; i += 2) {
    for (int step = 0; step < 2; ++step) {
      const int64_t pair = i + step;
      const __m256i pairs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(kblock + (pair * BLOCK + 8 * half) * 2));
      const __m256 even = even_halves(pairs), odd = odd_halves(pairs);
      for (int h = 0; h < N; ++h) {
        acc[h][2 * step] = _mm256_fmadd_ps(_mm256_broadcast_ss(qf[h] + 2 * pair), even, acc[h][2 * step]);
        acc[h][2 * step + 1] = _mm256_fmadd_ps(_mm256_broadcast_ss(qf[h] + 2 * pair + 1), odd, acc[h][2 * step + 1]);
      }
    }
  }
  for (int h = 0; h < N; ++h) {
    const __m256 sum = _mm256_add_ps(_mm256_add_ps(acc[h][0], acc[h][1]), _mm256_add_ps(acc[h][2], acc[h][3]));
    _mm256_storeu_ps(out[h] + 8 * half, _mm256_mul_ps(sum, _mm256_set1_ps(scale)));
  }
}
#endif

template <>
inline void block_scores<at::BFloat16>(const at::BFloat16* q, const at::BFloat16* kblock, int64_t D, float scale,
                                       float* out) {
#if EMBER_AVX2
  if (D % 8 == 0 && D <= 512) {
    alignas(32) float qf[512];
    widen_query(q, D, qf);
    const float* heads[1] = {qf};
    float* outs[1] = {out};
    for (int half = 0; half < 2; ++half) heads_scores<1>(heads, kblock, D, scale, half, outs);
    return;
  }
#endif
  for (int64_t key = 0; key < BLOCK; ++key) {
    float acc = 0.f;
    for (int64_t d = 0; d < D; ++d)
      acc = std::fma(bf16_to_float(q[d].x), bf16_to_float(kblock[k_offset<at::BFloat16>(key, d, D)].x), acc);
    out[key] = acc * scale;
  }
}

#if EMBER_AVX2
// Dims [d0, d0 + 8 NC) of N heads' weighted values over one block: a register of eight sums per
// head and eight dims, so N * NC fma chains run side by side and the heads share each widened
// pair of keys; each head's dim still takes every key in order, from its sum times correction.
template <int N, int NC>
inline void heads_values(const float* const* rounded, const at::BFloat16* vblock, int64_t D, int64_t d0,
                         int64_t valid, const float* correction, float* const* values) {
  __m256 sums[N][NC];
  for (int h = 0; h < N; ++h) {
    for (int c = 0; c < NC; ++c) sums[h][c] = _mm256_loadu_ps(values[h] + d0 + 8 * c);
    if (correction[h] != 1.f)  // times one changes nothing: most blocks leave the running max where it was
      for (int c = 0; c < NC; ++c) sums[h][c] = _mm256_mul_ps(sums[h][c], _mm256_set1_ps(correction[h]));
  }
  int64_t key = 0;
  for (; key + 1 < valid; key += 2) {
    const at::BFloat16* pairs_at = vblock + ((key / 2) * D + d0) * 2;
    for (int c = 0; c < NC; ++c) {
      const __m256i pairs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pairs_at + 16 * c));
      const __m256 even = even_halves(pairs), odd = odd_halves(pairs);
      for (int h = 0; h < N; ++h) {
        sums[h][c] = _mm256_fmadd_ps(_mm256_broadcast_ss(rounded[h] + key), even, sums[h][c]);
        sums[h][c] = _mm256_fmadd_ps(_mm256_broadcast_ss(rounded[h] + key + 1), odd, sums[h][c]);
      }
    }
  }
  if (key < valid) {  // a lone last key: the even halves
    const at::BFloat16* pairs_at = vblock + ((key / 2) * D + d0) * 2;
    for (int c = 0; c < NC; ++c) {
      const __m256 even = even_halves(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(pairs_at + 16 * c)));
      for (int h = 0; h < N; ++h) sums[h][c] = _mm256_fmadd_ps(_mm256_broadcast_ss(rounded[h] + key), even, sums[h][c]);
    }
  }
  for (int h = 0; h < N; ++h)
    for (int c = 0; c < NC; ++c) _mm256_storeu_ps(values[h] + d0 + 8 * c, sums[h][c]);
}

// Dims [d0, D) (a multiple of 8 of them), NC eights at a time while they last, then fewer.
template <int N, int NC>
inline void heads_values_from(const float* const* rounded, const at::BFloat16* vblock, int64_t D, int64_t d0,
                              int64_t valid, const float* correction, float* const* values) {
  for (; d0 + 8 * NC <= D; d0 += 8 * NC) heads_values<N, NC>(rounded, vblock, D, d0, valid, correction, values);
  if constexpr (NC > 1)
    if (d0 < D) heads_values_from<N, NC - 1>(rounded, vblock, D, d0, valid, correction, values);
}

// N heads' weighted values, with as many sums in registers as leave room for the widened keys.
template <int N>
inline void heads_block_values(const float* const* rounded, const at::BFloat16* vblock, int64_t D, int64_t valid,
                               const float* correction, float* const* values) {
  heads_values_from<N, N == 1 ? 8 : N == 2 ? 4 : 2>(rounded, vblock, D, 0, valid, correction, values);
}

// A block's 16 probabilities in bfloat16 (to nearest even; they are never NaN), as floats.
inline void round_to_bf16(const float* probs, float* rounded) {
  for (int half = 0; half < 2; ++half) {
    const __m256i u = _mm256_castps_si256(_mm256_loadu_ps(probs + 8 * half));
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i up = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), odd));
    _mm256_storeu_ps(rounded + 8 * half, _mm256_castsi256_ps(_mm256_and_si256(up, _mm256_set1_epi32(int(0xffff0000u)))));
  }
}
#endif

template <>
inline void block_values<at::BFloat16>(const float* probs, const at::BFloat16* vblock, int64_t D, int64_t valid,
                                       float correction, float* values) {
#if EMBER_AVX2
  if (D % 8 == 0) {
    alignas(32) float rounded[BLOCK];  // the probabilities in bfloat16, once for every dim
    round_to_bf16(probs, rounded);
    const float* heads[1] = {rounded};
    heads_block_values<1>(heads, vblock, D, valid, &correction, &values);
    return;
  }
#endif
  for (int64_t d = 0; d < D; ++d) values[d] *= correction;
  for (int64_t key = 0; key < valid; ++key) {
    const float p = bf16_to_float(float_to_bf16(probs[key]));
    for (int64_t d = 0; d < D; ++d)
      values[d] = std::fma(p, bf16_to_float(vblock[v_offset<at::BFloat16>(key, d, D)].x), values[d]);
  }
}

template <>
inline void block_scores<float>(const float* q, const float* kblock, int64_t D, float scale, float* out) {
#if EMBER_AVX512
  __m512 acc = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; ++d) acc = _mm512_fmadd_ps(_mm512_set1_ps(q[d]), _mm512_loadu_ps(kblock + d * BLOCK), acc);
  _mm512_storeu_ps(out, _mm512_mul_ps(acc, _mm512_set1_ps(scale)));
#elif EMBER_AVX2
  for (int half = 0; half < 2; ++half) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; ++d)
      acc = _mm256_fmadd_ps(_mm256_set1_ps(q[d]), _mm256_loadu_ps(kblock + d * BLOCK + 8 * half), acc);
    _mm256_storeu_ps(out + 8 * half, _mm256_mul_ps(acc, _mm256_set1_ps(scale)));
  }
#else
  for (int64_t key = 0; key < BLOCK; ++key) {
    float acc = 0.f;
    for (int64_t d = 0; d < D; ++d) acc = std::fma(q[d], kblock[d * BLOCK + key], acc);
    out[key] = acc * scale;
  }
#endif
}

template <>
inline void block_values<float>(const float* probs, const float* vblock, int64_t D, int64_t valid, float correction,
                               float* values) {
  for (int64_t d = 0; d < D; ++d) values[d] *= correction;
  for (int64_t key = 0; key < valid; ++key) axpy(probs[key], vblock + key * D, values, D);
}

// The largest of a block's scores [first, valid) (-inf for none).
inline float visible_max(const float* scores, int64_t first, int64_t valid) {
#if EMBER_AVX2
  if (first == 0 && valid == BLOCK) {
    __m256 m8 = _mm256_max_ps(_mm256_load_ps(scores), _mm256_load_ps(scores + 8));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m8), _mm256_extractf128_ps(m8, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    return _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
  }
#endif
  float max = -std::numeric_limits<float>::infinity();
  for (int64_t key = first; key < valid; ++key) max = std::max(max, scores[key]);
  return max;
}

// The online softmax's step over one block whose keys [first, valid) the row sees: its scores
// become weights (0 for unseen keys), the state's max and sum move on; returns the factor the
// state's values must take before the block's weighted values are added.
inline float softmax_weights(float* scores, int64_t first, int64_t valid, State& state) {
  const float max = std::max(state.max, visible_max(scores, first, valid));
  // 0 on the first block (max was -inf); exactly 1 when the max stays put, as it mostly does
  const float correction = state.max == max && std::isfinite(max) ? 1.f : std::exp(state.max - max);
  const float sum = exp_and_sum(scores + first, valid - first, max);
  for (int64_t key = 0; key < first; ++key) scores[key] = 0.f;  // keys before the window weigh nothing
  for (int64_t key = valid; key < BLOCK; ++key) scores[key] = 0.f;  // keys past the row weigh nothing
  state.sum = std::fma(state.sum, correction, sum);
  state.max = max;
  return correction;
}

template <typename T>
inline void attend_block(const T* q, const T* kblock, const T* vblock, int64_t D, int64_t first, int64_t valid,
                         float scale, State& state) {
  alignas(64) float scores[BLOCK];
  block_scores<T>(q, kblock, D, scale, scores);
  const float correction = softmax_weights(scores, first, valid, state);
  block_values<T>(scores, vblock, D, valid, correction, state.values);
}

// Heads [0, G) of a row over one chunk of `count` blocks, block by block and head by head.
template <typename T>
inline void attend_blocks(const T* const* q, int64_t G, const T* const* kblocks, const T* const* vblocks,
                          int64_t count, int64_t D, int64_t first, int64_t valid, float scale, State* states) {
  for (int64_t blk = first / BLOCK; blk < count; ++blk)
    for (int64_t g = 0; g < G; ++g)
      attend_block<T>(q[g], kblocks[blk], vblocks[blk], D, std::max<int64_t>(0, first - blk * BLOCK),
                      std::min<int64_t>(BLOCK, valid - blk * BLOCK), scale, states[g]);
}

// Heads [0, G) of a row over one chunk (float32; bfloat16 has its own paths below).
template <typename T>
inline void attend_chunk(const T* const* q, int64_t G, const T* const* kblocks, const T* const* vblocks, int64_t count,
                         int64_t D, int64_t first, int64_t valid, float scale, State* states) {
  attend_blocks<T>(q, G, kblocks, vblocks, count, D, first, valid, scale, states);
}

#if EMBER_AVX2 && !EMBER_BF16_DOT
constexpr int64_t MAX_HEADS_AT_ONCE = 3;  // twelve sums in registers, with the block's two widened vectors

// bfloat16 heads [0, G) of a row over one chunk, block by block: each head's query widened to
// floats once for the chunk, the block's scores for up to three heads at a time, then each
// head's softmax step: the bits of attend_block, head by head.
template <>
inline void attend_chunk<at::BFloat16>(const at::BFloat16* const* q, int64_t G, const at::BFloat16* const* kblocks,
                                       const at::BFloat16* const* vblocks, int64_t count, int64_t D, int64_t first,
                                       int64_t valid, float scale, State* states) {
  constexpr int64_t MOST = 4096, MOST_HEADS = 64;  // the widened queries and the scores live on the stack
  if (D % 8 != 0 || G * D > MOST || G > MOST_HEADS)
    return attend_blocks<at::BFloat16>(q, G, kblocks, vblocks, count, D, first, valid, scale, states);
  alignas(32) float qf[MOST];
  alignas(64) float scores[MOST_HEADS][BLOCK];
  const float* heads[MOST_HEADS];
  float* outs[MOST_HEADS];
  float* values[MOST_HEADS];
  float corrections[MOST_HEADS];
  for (int64_t g = 0; g < G; ++g) {
    widen_query(q[g], D, qf + g * D);
    heads[g] = qf + g * D;
    outs[g] = scores[g];
    values[g] = states[g].values;
  }
  for (int64_t blk = first / BLOCK; blk < count; ++blk) {
    for (int64_t g = 0; g < G; g += MAX_HEADS_AT_ONCE)
      for (int half = 0; half < 2; ++half)
        switch (std::min(MAX_HEADS_AT_ONCE, G - g)) {
          case 1: heads_scores<1>(heads + g, kblocks[blk], D, scale, half, outs + g); break;
          case 2: heads_scores<2>(heads + g, kblocks[blk], D, scale, half, outs + g); break;
          default: heads_scores<3>(heads + g, kblocks[blk], D, scale, half, outs + g); break;
        }
    const int64_t seen = std::min<int64_t>(BLOCK, valid - blk * BLOCK);
    for (int64_t g = 0; g < G; ++g) {
      corrections[g] = softmax_weights(scores[g], std::max<int64_t>(0, first - blk * BLOCK), seen, states[g]);
      round_to_bf16(scores[g], scores[g]);
    }
    for (int64_t g = 0; g < G; g += MAX_HEADS_AT_ONCE)
      switch (std::min(MAX_HEADS_AT_ONCE, G - g)) {
        case 1: heads_block_values<1>(outs + g, vblocks[blk], D, seen, corrections + g, values + g); break;
        case 2: heads_block_values<2>(outs + g, vblocks[blk], D, seen, corrections + g, values + g); break;
        default: heads_block_values<3>(outs + g, vblocks[blk], D, seen, corrections + g, values + g); break;
      }
  }
}
#endif

#if EMBER_BF16_DOT
// bfloat16 over one chunk of up to CHUNK / BLOCK blocks, for N heads of a group at once: they
// share the chunk's key and value loads, each q pair and probability pair is broadcast once per
// chunk, and every sum stays in a register. C = head_dim / 16. A head's arithmetic is the same
// whatever heads it is grouped with.
// Lanes of a block's 16 keys that a row sees: [hidden, left), both counted from the block's start.
inline __mmask16 visible_keys(int64_t hidden, int64_t left) {
  const uint32_t upto = left >= BLOCK ? 0xffffu : (1u << std::max<int64_t>(left, 0)) - 1;
  const uint32_t before = hidden <= 0 ? 0u : hidden >= BLOCK ? 0xffffu : (1u << hidden) - 1;
  return __mmask16(upto & ~before);
}

// One row-head's online-softmax step over `count` blocks (at most MOST_BLOCKS), `raw` their 16 dot
// products each (not yet scaled), keys [first, valid) of them seen: the state's max and sum move on,
// the weights go to prob_pairs (bfloat16, 8 pairs a block) and the factor the state's values must
// take comes back. The one step of both bfloat16 paths (the dot instructions' and the tiles'),
// inlined so that the dot path's sums stay in registers.
template <int MOST_BLOCKS>
__attribute__((always_inline)) inline float chunk_softmax(const __m512* raw, int count, int64_t first, int64_t valid,
                                                          float scale, State& state, uint32_t* prob_pairs) {
  __m512 scores[MOST_BLOCKS];
  __m512 vmax = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int blk = 0; blk < count; ++blk) {
    const __mmask16 mask = visible_keys(first - blk * BLOCK, valid - blk * BLOCK);
    scores[blk] = _mm512_mul_ps(raw[blk], _mm512_set1_ps(scale));
    vmax = _mm512_mask_max_ps(vmax, mask, vmax, scores[blk]);
  }
  const float max = std::max(state.max, _mm512_reduce_max_ps(vmax));
  const float factor = std::exp(state.max - max);  // 0 on the first chunk (max was -inf)
  __m512 sum = _mm512_setzero_ps();
  for (int blk = 0; blk < count; ++blk) {
    const __mmask16 mask = visible_keys(first - blk * BLOCK, valid - blk * BLOCK);
    const __m512 probs = _mm512_maskz_mov_ps(mask, exp_nonpositive(_mm512_sub_ps(scores[blk], _mm512_set1_ps(max))));
    sum = _mm512_add_ps(sum, probs);
    _mm256_store_si256(reinterpret_cast<__m256i*>(prob_pairs + blk * BLOCK / 2), (__m256i)_mm512_cvtneps_pbh(probs));
  }
  state.sum = std::fma(state.sum, factor, _mm512_reduce_add_ps(sum));
  state.max = max;
  return factor;
}

template <int N, int C, int COUNT>
inline void attend_chunk_heads(const uint32_t* const* q_pairs, const at::BFloat16* const* kblocks,
                               const at::BFloat16* const* vblocks, int64_t first, int64_t valid, float scale,
                               State* states) {
  constexpr int64_t D = 16 * C;
  constexpr int count = COUNT;
  __m512 acc[N][COUNT];
  for (int h = 0; h < N; ++h)
    for (int blk = 0; blk < COUNT; ++blk) acc[h][blk] = _mm512_setzero_ps();
  for (int64_t i = 0; i < D / 2; ++i) {
    __m512bh q[N];
    for (int h = 0; h < N; ++h) q[h] = (__m512bh)_mm512_set1_epi32(int(q_pairs[h][i]));
    for (int blk = 0; blk < COUNT; ++blk) {
      const __m512bh k = (__m512bh)_mm512_loadu_si512(kblocks[blk] + i * 2 * BLOCK);
      for (int h = 0; h < N; ++h) acc[h][blk] = _mm512_dpbf16_ps(acc[h][blk], k, q[h]);
    }
  }
  alignas(32) uint32_t prob_pairs[N][CHUNK / 2];
  __m512 correction[N];
  for (int h = 0; h < N; ++h)
    correction[h] = _mm512_set1_ps(chunk_softmax<COUNT>(acc[h], count, first, valid, scale, states[h], prob_pairs[h]));
  __m512 values[N][C];
  for (int h = 0; h < N; ++h)
    for (int c = 0; c < C; ++c) values[h][c] = _mm512_mul_ps(_mm512_loadu_ps(states[h].values + 16 * c), correction[h]);
  // One pair of keys j of a block: each head's two probabilities times the pair's values.
  const auto add_pair = [&](const at::BFloat16* vblock, int blk, int64_t j, __mmask32 lanes) {
    __m512bh p[N];
    for (int h = 0; h < N; ++h) p[h] = (__m512bh)_mm512_set1_epi32(int(prob_pairs[h][blk * BLOCK / 2 + j]));
    for (int c = 0; c < C; ++c) {
      const __m512bh v = (__m512bh)_mm512_maskz_loadu_epi16(lanes, vblock + (j * D + 16 * c) * 2);
      for (int h = 0; h < N; ++h) values[h][c] = _mm512_dpbf16_ps(values[h][c], v, p[h]);
    }
  };
  for (int blk = 0; blk < count; ++blk) {
    const at::BFloat16* vblock = vblocks[blk];
    // Slots past the row's keys may hold anything, NaN included: they are never read, since even
    // a zero weight times NaN would be NaN. A lone last key takes the even half of its pair. A
    // whole block's loop has a fixed count, which keeps the sums in registers.
    const int64_t keys = std::min<int64_t>(BLOCK, valid - blk * BLOCK);
    if (keys == BLOCK) {
      for (int64_t j = 0; j < BLOCK / 2; ++j) add_pair(vblock, blk, j, __mmask32(0xffffffffu));
      continue;
    }
    for (int64_t j = 0; 2 * j < keys; ++j)
      add_pair(vblock, blk, j, 2 * j + 1 < keys ? __mmask32(0xffffffffu) : __mmask32(0x55555555u));
  }
  for (int h = 0; h < N; ++h)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(states[h].values + 16 * c, values[h][c]);
}

template <int N, int C>
inline void attend_chunk_count(const uint32_t* const* pairs, const at::BFloat16* const* kblocks,
                               const at::BFloat16* const* vblocks, int64_t count, int64_t first, int64_t valid,
                               float scale, State* states) {
  switch (count) {
    case 1: return attend_chunk_heads<N, C, 1>(pairs, kblocks, vblocks, first, valid, scale, states);
    case 2: return attend_chunk_heads<N, C, 2>(pairs, kblocks, vblocks, first, valid, scale, states);
    case 3: return attend_chunk_heads<N, C, 3>(pairs, kblocks, vblocks, first, valid, scale, states);
    default: return attend_chunk_heads<N, C, 4>(pairs, kblocks, vblocks, first, valid, scale, states);
  }
}

// Heads [0, G) in passes of up to 4 (3 for head_dim 128: the sums must fit in the registers).
template <int C>
inline void attend_chunk_passes(const uint32_t* const* pairs, int64_t G, const at::BFloat16* const* kblocks,
                                const at::BFloat16* const* vblocks, int64_t count, int64_t first, int64_t valid,
                                float scale, State* states) {
  constexpr int64_t PER_PASS = C <= 4 ? 4 : 3;
  for (int64_t g = 0; g < G; g += PER_PASS) {
    switch (std::min(PER_PASS, G - g)) {
      case 1: attend_chunk_count<1, C>(pairs + g, kblocks, vblocks, count, first, valid, scale, states + g); break;
      case 2: attend_chunk_count<2, C>(pairs + g, kblocks, vblocks, count, first, valid, scale, states + g); break;
      case 3: attend_chunk_count<3, C>(pairs + g, kblocks, vblocks, count, first, valid, scale, states + g); break;
      default: attend_chunk_count<C <= 4 ? 4 : 3, C>(pairs + g, kblocks, vblocks, count, first, valid, scale, states + g);
    }
  }
}

#if EMBER_AMX_TILES
#include "attention_tiles.h"
#endif

template <>
inline void attend_chunk<at::BFloat16>(const at::BFloat16* const* q, int64_t G, const at::BFloat16* const* kblocks,
                                       const at::BFloat16* const* vblocks, int64_t count, int64_t D, int64_t first,
                                       int64_t valid, float scale, State* states) {
  constexpr int64_t MOST_ON_STACK = 64;  // heads of a group; more (none known) take the heap
  const uint32_t* on_stack[MOST_ON_STACK];
  std::vector<const uint32_t*> on_heap(G > MOST_ON_STACK ? G : 0);
  const uint32_t** pairs = G > MOST_ON_STACK ? on_heap.data() : on_stack;
  for (int64_t g = 0; g < G; ++g) pairs[g] = reinterpret_cast<const uint32_t*>(q[g]);
  switch (D) {
    case 64: return attend_chunk_passes<4>(pairs, G, kblocks, vblocks, count, first, valid, scale, states);
    case 128: return attend_chunk_passes<8>(pairs, G, kblocks, vblocks, count, first, valid, scale, states);
    default: return attend_blocks<at::BFloat16>(q, G, kblocks, vblocks, count, D, first, valid, scale, states);
  }
}
#endif

// Heads [0, G) of a row over one chunk of an int8 cache, block by block: each head's query
// widened to floats once for the chunk, up to four heads sharing each block's loads, then each
// head's softmax step, whose weights take the keys' V scales before the block's values.
constexpr int64_t INT8_MOST_FLOATS = 8192, INT8_MOST_HEADS = 64;  // the widened queries live on the stack

template <typename T>
inline void attend_chunk_int8(const T* const* q, int64_t G, const int8_t* const* kblocks,
                              const int8_t* const* vblocks, int64_t count, int64_t D, int64_t first, int64_t valid,
                              float scale, State* states) {
  alignas(64) float qf[INT8_MOST_FLOATS];
  alignas(64) float weights[INT8_MOST_HEADS][BLOCK];
  const float* heads[INT8_MOST_HEADS];
  float* values[INT8_MOST_HEADS];
  float corrections[INT8_MOST_HEADS];
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t d = 0; d < D; ++d) qf[g * D + d] = to_float<T>(q[g][d]);
    heads[g] = qf + g * D;
    values[g] = states[g].values;
  }
  for (int64_t blk = first / BLOCK; blk < count; ++blk) {
    const int8_t* kblock = kblocks[blk];
    const int8_t* vblock = vblocks[blk];
    for (int64_t g = 0; g < G; g += 4)
      switch (std::min<int64_t>(4, G - g)) {
        case 1: kv_int8::heads_scores<1>(heads + g, kblock, D, scale, weights + g); break;
        case 2: kv_int8::heads_scores<2>(heads + g, kblock, D, scale, weights + g); break;
        case 3: kv_int8::heads_scores<3>(heads + g, kblock, D, scale, weights + g); break;
        default: kv_int8::heads_scores<4>(heads + g, kblock, D, scale, weights + g); break;
      }
    const int64_t seen = std::min<int64_t>(BLOCK, valid - blk * BLOCK);
    const float* vscales = kv_int8::scales(vblock, D);
    for (int64_t g = 0; g < G; ++g) {
      corrections[g] = softmax_weights(weights[g], std::max<int64_t>(0, first - blk * BLOCK), seen, states[g]);
      for (int64_t key = 0; key < seen; ++key) weights[g][key] *= vscales[key];
    }
    for (int64_t g = 0; g < G; g += 4)
      switch (std::min<int64_t>(4, G - g)) {
        case 1: kv_int8::heads_values<1>(weights + g, vblock, D, seen, corrections + g, values + g); break;
        case 2: kv_int8::heads_values<2>(weights + g, vblock, D, seen, corrections + g, values + g); break;
        case 3: kv_int8::heads_values<3>(weights + g, vblock, D, seen, corrections + g, values + g); break;
        default: kv_int8::heads_values<4>(weights + g, vblock, D, seen, corrections + g, values + g); break;
      }
  }
}

// Asks for `bytes` from p into L2, a line at a time, without waiting for them.
inline void prefetch_bytes(const void* p, int64_t bytes) {
  for (int64_t line = 0; line < bytes; line += 64) __builtin_prefetch(static_cast<const char*>(p) + line, 0, 2);
}

struct Batch {
  const void* q;
  int64_t q_stride, H, KVH, G, D;
  const void* k_cache;
  const void* v_cache;
  int64_t head_stride;  // elements between kv heads in a layer's cache
  int64_t block_stride;  // elements between blocks of a kv head
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
template <typename Prefetch, typename Blocks>
void tile_passes(int64_t R, int64_t G, int64_t D, float scale, const at::BFloat16* const* rows, State* states,
                 const int64_t* first_chunk, const int64_t* begin, const int64_t* end, Prefetch&& prefetch,
                 Blocks&& blocks_at) {
  int64_t row_of[tiles::MOST_ROWS];
  for (int64_t a = 0; a < R * G;) {
    int64_t z = a;
    for (; z < R * G && z - a < tiles::MOST_ROWS && first_chunk[z / G] == first_chunk[a / G]; ++z)
      row_of[z - a] = z / G;
    tiles::attend(tiles::Pass{rows + a, states + a, row_of, begin, end, z - a, first_chunk[a / G]}, D, scale, prefetch,
                  blocks_at);
    a = z;
  }
}
#endif

// Partials of rows [r0, r1) of sequence s, KV head kvh, split `split`: for each row and head of the
// group, (max, sum, values) into partials[(row - r0) * G + g]. T: q's dtype; C: the cache's (T or int8).
template <typename T, typename C>
void split_partials(const Batch& b, int64_t s, int64_t kvh, int64_t split, int64_t r0, int64_t r1, float* partials) {
  const int64_t D = b.D, G = b.G, lo = split * SPLIT, R = r1 - r0;
  const T* q = static_cast<const T*>(b.q);
  const C* keys = static_cast<const C*>(b.k_cache) + kvh * b.head_stride;
  const C* vals = static_cast<const C*>(b.v_cache) + kvh * b.head_stride;
  const int32_t* table = b.tables + s * b.table_width;
  std::vector<State> states(R * G);
  std::vector<const T*> rows(R * G);
  std::vector<int64_t> first_chunk(R), end(R), begin(R);
  int64_t chunks = 0;  // the most any row of the tile takes
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t i = r - r0, pos = b.first_pos[s] + (r - b.row_begin[s]);
    end[i] = std::min<int64_t>(pos + 1, lo + SPLIT);
    begin[i] = b.window > 0 ? std::max<int64_t>(0, pos + 1 - b.window) : 0;  // the row's first key
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
  // Chunk by chunk, every row of the tile in turn, so the rows share a chunk's keys and values
  // while they are in L1; each row still takes its own chunks in order. The blocks of the tile's
  // last row (the furthest) are asked for a chunk ahead, the first chunk's at once: a decode step
  // finds them out of the caches (the weights streamed through since the last step), and the
  // hardware's prefetcher loses the thread at each block's end where blocks do not lie in a run
  // (bench/attention_versions.py: cold, 1.02-1.09x; scattered, 1.35-1.64x; in the caches, 0.90-0.96x).
  const int64_t block_bytes = b.block_stride * int64_t(sizeof(C));
  const auto prefetch = [&](int64_t from, int64_t to) {  // the blocks of keys [from, to)
    for (int64_t pos = from; pos < to; pos += BLOCK) {
      const int64_t base = int64_t(table[pos / BLOCK]) * b.block_stride;
      prefetch_bytes(keys + base, block_bytes);
      prefetch_bytes(vals + base, block_bytes);
    }
  };
#if EMBER_AMX_TILES
  if constexpr (std::is_same_v<T, at::BFloat16> && std::is_same_v<C, at::BFloat16>) {
    if (b.tiles) {
      tile_passes(R, G, D, b.scale, rows.data(), states.data(), first_chunk.data(), begin.data(), end.data(), prefetch,
                  [&](int64_t pos) {
                    const int64_t base = int64_t(table[pos / BLOCK]) * b.block_stride;
                    return std::make_pair(keys + base, vals + base);
                  });
      return keep_max_and_sum(states.data(), R * G, D, partials);
    }
  }
#endif
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t next = first_chunk[R - 1] + (c + 1) * CHUNK;
    prefetch(c == 0 ? first_chunk[R - 1] : next, std::min(end[R - 1], next + CHUNK));
    for (int64_t i = 0; i < R; ++i) {
      const int64_t chunk = first_chunk[i] + c * CHUNK;
      if (chunk >= end[i]) continue;
      const int64_t count = (std::min(end[i], chunk + CHUNK) - chunk + BLOCK - 1) / BLOCK;
      const C* kblocks[CHUNK / BLOCK];
      const C* vblocks[CHUNK / BLOCK];
      for (int64_t blk = 0; blk < count; ++blk) {
        const int64_t base = int64_t(table[chunk / BLOCK + blk]) * b.block_stride;
        kblocks[blk] = keys + base;
        vblocks[blk] = vals + base;
      }
      const int64_t first = std::max<int64_t>(0, begin[i] - chunk), valid = std::min(end[i], chunk + CHUNK) - chunk;
      if constexpr (std::is_same_v<C, int8_t>)
        attend_chunk_int8<T>(rows.data() + i * G, G, kblocks, vblocks, count, D, first, valid, b.scale,
                             states.data() + i * G);
      else
        attend_chunk<T>(rows.data() + i * G, G, kblocks, vblocks, count, D, first, valid, b.scale, states.data() + i * G);
    }
  }
  keep_max_and_sum(states.data(), R * G, D, partials);
}

// out = sum_j e^(max_j - M) values_j / sum_j e^(max_j - M) sum_j over a row-head's splits, in order.
template <typename T>
void merge(const float* partials, int64_t splits, int64_t stride, int64_t D, T* out) {
  float max = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < splits; ++j) max = std::max(max, partials[j * stride]);
  std::vector<float> values(D, 0.f);
  float total = 0.f;
  for (int64_t j = 0; j < splits; ++j) {
    const float* p = partials + j * stride;
    const float weight = std::exp(p[0] - max);
    total = std::fma(weight, p[1], total);
    axpy(weight, p + 2, values.data(), D);
  }
  const float inv = 1.f / total;
  for (int64_t d = 0; d < D; ++d) out[d] = from_float<T>(values[d] * inv);
}

template <typename T, typename C>
void attention_impl(const Batch& b, int64_t S) {
  const int64_t G = b.G, D = b.D, P = partial_floats(D);
  // Work items: (sequence, kv head, split) for one-row sequences, (sequence, kv head, tile) else.
  struct Item { int64_t s, kvh, part; };
  const int64_t row_tile = b.tiles ? TILES_ROW_TILE : ROW_TILE;
  std::vector<Item> items;
  std::vector<int64_t> first_split(S, -1), splits_of(S, 0);
  int64_t single_partials = 0;
  for (int64_t s = 0; s < S; ++s) {
    const int64_t rows = b.row_begin[s + 1] - b.row_begin[s];
    const int64_t last = b.first_pos[s] + rows - 1;  // the position of its last row
    if (rows == 1) {
      splits_of[s] = last / SPLIT + 1;
      first_split[s] = single_partials;
      single_partials += splits_of[s] * b.KVH;
      for (int64_t kvh = 0; kvh < b.KVH; ++kvh)
        for (int64_t j = 0; j < splits_of[s]; ++j) items.push_back({s, kvh, j});
    } else {
      for (int64_t kvh = 0; kvh < b.KVH; ++kvh)
        for (int64_t tile = 0; tile * row_tile < rows; ++tile) items.push_back({s, kvh, tile});
    }
  }
  std::vector<float> single(single_partials * G * P);
  // Splits of each (one-row sequence, kv head) computed so far: the item that computes the last
  // one merges them all, in order, so one parallel region serves (a second costs a wake-up of
  // every thread) and the bits are the merge's whoever runs it.
  const std::unique_ptr<std::atomic<int64_t>[]> splits_done(new std::atomic<int64_t>[S * b.KVH]);
  for (int64_t pair = 0; pair < S * b.KVH; ++pair) splits_done[pair].store(0, std::memory_order_relaxed);
  T* out = static_cast<T*>(b.out);
  at::parallel_for(0, int64_t(items.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> local;
    for (int64_t i = begin; i < end; ++i) {
      const Item item = items[i];
      const int64_t s = item.s, kvh = item.kvh, row0 = b.row_begin[s];
      if (first_split[s] >= 0) {  // one split of a one-row sequence
        float* first = single.data() + ((first_split[s] + kvh * splits_of[s]) * G) * P;
        split_partials<T, C>(b, s, kvh, item.part, row0, row0 + 1, first + item.part * G * P);
        // acq_rel: the last sees every other split's partials, written before their increments
        if (splits_done[s * b.KVH + kvh].fetch_add(1, std::memory_order_acq_rel) + 1 == splits_of[s])
          for (int64_t g = 0; g < G; ++g)
            merge<T>(first + g * P, splits_of[s], G * P, D, out + row0 * b.H * D + (kvh * G + g) * D);
        continue;
      }
      const int64_t r0 = row0 + item.part * row_tile, r1 = std::min<int64_t>(b.row_begin[s + 1], r0 + row_tile);
      const int64_t splits = (b.first_pos[s] + (r1 - 1 - row0)) / SPLIT + 1;
      local.assign(splits * (r1 - r0) * G * P, 0.f);
      for (int64_t j = 0; j < splits; ++j)
        split_partials<T, C>(b, s, kvh, j, r0, r1, local.data() + j * (r1 - r0) * G * P);
      for (int64_t r = r0; r < r1; ++r) {
        const int64_t own = (b.first_pos[s] + (r - row0)) / SPLIT + 1;  // splits this row reaches
        for (int64_t g = 0; g < G; ++g)
          merge<T>(local.data() + ((r - r0) * G + g) * P, own, (r1 - r0) * G * P, D,
                   out + r * b.H * D + (kvh * G + g) * D);
      }
    }
#if EMBER_AMX_TILES
    if (b.tiles) tiles::release();  // other code (oneDNN's kernels) may configure them its own way
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
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.size(2) == block && k_cache.stride(2) == 1 && k_cache.stride(1) == block,
              "the cache must be (kv_heads, blocks, 16 * head_dim), or int8 (kv_heads, blocks, 16 * (head_dim + 4))");
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
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), KVH = k_cache.size(0), S = first_pos.numel();
  check_cache(k_cache, v_cache, D);
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
  Batch b{q.data_ptr(), q.stride(0), H, KVH, H / KVH, D, k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0),
          k_cache.stride(1), block_table.data_ptr<int32_t>(), block_table.size(1), row_begin.data_ptr<int32_t>(),
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

template <typename T>
inline void store_row(const T* k, const T* v, int64_t slot, int64_t kvh, T* k_cache, T* v_cache, int64_t head_stride,
                      int64_t D) {
  T* kb = k_cache + kvh * head_stride + (slot / BLOCK) * BLOCK * D;
  T* vb = v_cache + kvh * head_stride + (slot / BLOCK) * BLOCK * D;
  const int64_t key = slot % BLOCK;
  for (int64_t d = 0; d < D; ++d) {
    kb[k_offset<T>(key, d, D)] = k[d];
    vb[v_offset<T>(key, d, D)] = v[d];
  }
}

// One row's k and v (D values each) into the cache's `slot` of KV head kvh, quantized where it is int8.
template <typename T>
inline void store_slot(const T* k, const T* v, int64_t slot, int64_t kvh, const at::Tensor& k_cache,
                       const at::Tensor& v_cache, int64_t D) {
  if (!is_int8(k_cache))
    return store_row<T>(k, v, slot, kvh, k_cache.data_ptr<T>(), v_cache.data_ptr<T>(), k_cache.stride(0), D);
  const int64_t at = kvh * k_cache.stride(0) + (slot / BLOCK) * k_cache.stride(1);
  kv_int8::store_row<T>(k, D, k_cache.data_ptr<int8_t>() + at, slot % BLOCK, false);
  kv_int8::store_row<T>(v, D, v_cache.data_ptr<int8_t>() + at, slot % BLOCK, true);
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
  dispatch_float_or_bf16(k.scalar_type(), [&](auto tag) {
    using T_ = decltype(tag);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < KVH; ++h)
        store_slot<T_>(k.data_ptr<T_>() + t * k.stride(0) + h * D, v.data_ptr<T_>() + t * v.stride(0) + h * D,
                       slots.data_ptr<int64_t>()[t], h, k_cache, v_cache, D);
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
  TORCH_CHECK(k_cache.size(0) == kv_heads && (k_cache.scalar_type() == qkv.scalar_type() || is_int8(k_cache)),
              "the cache: kv_heads, and qkv's dtype or int8");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == T, "one int64 slot per row");
  TORCH_CHECK(cos.size(0) == T && cos.size(-1) == half && cos.stride(-1) == 1 && sin.strides() == cos.strides() &&
              sin.sizes() == cos.sizes() && cos.scalar_type() == qkv.scalar_type(), "cos and sin: (T, D / 2) rows");
  const int64_t row_stride = cos.stride(0);
  dispatch_float_or_bf16(qkv.scalar_type(), [&](auto tag) {
    using T_ = decltype(tag);
    at::parallel_for(0, T, 8, [&](int64_t begin, int64_t end) {
      std::vector<float> c(half), s(half);
      for (int64_t t = begin; t < end; ++t) {
        T_* row = qkv.data_ptr<T_>() + t * qkv.stride(0);
        rotate_heads<T_>(row, heads + kv_heads, D, half, cos.data_ptr<T_>() + t * row_stride,
                         sin.data_ptr<T_>() + t * row_stride, c.data(), s.data());
        for (int64_t h = 0; h < kv_heads; ++h)
          store_slot<T_>(row + (heads + h) * D, row + (heads + kv_heads + h) * D, slots.data_ptr<int64_t>()[t], h,
                         k_cache, v_cache, D);
      }
    });
  });
}

// The cache's blocks back in the (kv_heads, slots, D) layout: for tests and for debugging. An int8
// cache comes back as float32, each value times its row's scale.
at::Tensor unpack_cache(const at::Tensor& cache, bool values, int64_t D) {
  const int64_t KVH = cache.size(0), blocks = cache.size(1);
  if (is_int8(cache)) {
    auto out = at::empty({KVH, blocks * BLOCK, D}, cache.options().dtype(at::kFloat));
    for (int64_t h = 0; h < KVH; ++h)
      for (int64_t slot = 0; slot < blocks * BLOCK; ++slot) {
        const int8_t* block = cache.data_ptr<int8_t>() + h * cache.stride(0) + (slot / BLOCK) * cache.stride(1);
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
          const T_* block = cache.data_ptr<T_>() + h * cache.stride(0) + (slot / BLOCK) * BLOCK * D;
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
