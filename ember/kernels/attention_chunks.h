// One row's heads over one chunk of keys, the arithmetic every path of attention.cpp shares: where
// a block's elements lie, a block's scores, the online softmax step and the weighted values, for
// float32, bfloat16 (on the vector unit's dot products where it has them) and int8 caches. Part of
// attention.cpp, which includes it inside its namespace after the block and split sizes.

#pragma once

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
// 128 take attend_chunk below). A block's scores are a lane per key, summed in four chains (even
// and odd dims of alternate pairs: one chain would wait on each fma in turn) that are added at the
// end in a fixed order; its values a lane per dim, every key in order. The bfloat16 pairs are
// widened to floats by shifts and masks, eight lanes at a time on AVX2 and sixteen where the build
// has AVX-512 (Ice Lake and Cascade Lake Xeons: AVX-512 without the bfloat16 instructions); a
// lane's arithmetic is the same at either width, so the two give the same bits. The heads of a KV
// group share each block's loads, and a prompt tile's rows take each chunk in turn while it is in
// L1: neither changes any head's arithmetic.
#if EMBER_AVX2
// The float vectors of the widening path, of WIDTH lanes. pairs(p): WIDTH 32-bit lanes of
// bfloat16 pairs; even and odd: each pair's halves as floats (exact: a bfloat16 is a float's top half).
struct Lanes8 {
  using F = __m256;
  static constexpr int64_t WIDTH = 8;
  static __m256i pairs(const at::BFloat16* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static F even(__m256i v) { return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)); }
  static F odd(__m256i v) { return _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(int(0xffff0000u)))); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F broadcast(const float* p) { return _mm256_broadcast_ss(p); }
  static F zero() { return _mm256_setzero_ps(); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, F v) { _mm256_storeu_ps(p, v); }
};

#if EMBER_AVX512
struct Lanes16 {
  using F = __m512;
  static constexpr int64_t WIDTH = 16;
  static __m512i pairs(const at::BFloat16* p) { return _mm512_loadu_si512(p); }
  static F even(__m512i v) { return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)); }
  static F odd(__m512i v) { return _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(int(0xffff0000u)))); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F broadcast(const float* p) { return _mm512_set1_ps(*p); }
  static F zero() { return _mm512_setzero_ps(); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, F v) { _mm512_storeu_ps(p, v); }
};
#endif

// q's D bfloat16 values as floats, eight at a time (exact: a bfloat16 is a float's top half).
inline void widen_query(const at::BFloat16* q, int64_t D, float* qf) {
  for (int64_t d = 0; d < D; d += 8) {
    const __m128i halves = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + d));
    _mm256_store_ps(qf + d, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(halves), 16)));
  }
}

// The scores of N heads' queries (as floats) against one block's keys [key0, key0 + WIDTH): the
// four chains per head, while the block's pairs are loaded and widened once for all N.
template <typename L, int N>
inline void heads_scores(const float* const* qf, const at::BFloat16* kblock, int64_t D, float scale, int64_t key0,
                         float* const* out) {
  typename L::F acc[N][4];
  for (int h = 0; h < N; ++h)
    for (int chain = 0; chain < 4; ++chain) acc[h][chain] = L::zero();
  for (int64_t i = 0; i < D / 2; i += 2) {
    for (int step = 0; step < 2; ++step) {
      const int64_t pair = i + step;
      const auto pairs = L::pairs(kblock + (pair * BLOCK + key0) * 2);
      const typename L::F even = L::even(pairs), odd = L::odd(pairs);
      for (int h = 0; h < N; ++h) {
        acc[h][2 * step] = L::fma(L::broadcast(qf[h] + 2 * pair), even, acc[h][2 * step]);
        acc[h][2 * step + 1] = L::fma(L::broadcast(qf[h] + 2 * pair + 1), odd, acc[h][2 * step + 1]);
      }
    }
  }
  for (int h = 0; h < N; ++h) {
    const typename L::F sum = L::add(L::add(acc[h][0], acc[h][1]), L::add(acc[h][2], acc[h][3]));
    L::store(out[h] + key0, L::mul(sum, L::broadcast(&scale)));
  }
}

// The scores of N heads against a whole block, as wide as the build goes.
template <int N>
inline void heads_block_scores(const float* const* qf, const at::BFloat16* kblock, int64_t D, float scale,
                               float* const* out) {
#if EMBER_AVX512
  heads_scores<Lanes16, N>(qf, kblock, D, scale, 0, out);
#else
  for (int64_t key0 = 0; key0 < BLOCK; key0 += Lanes8::WIDTH) heads_scores<Lanes8, N>(qf, kblock, D, scale, key0, out);
#endif
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
    heads_block_scores<1>(heads, kblock, D, scale, outs);
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
// Dims [d0, d0 + WIDTH NC) of N heads' weighted values over one block: a register of WIDTH sums per
// head and WIDTH dims, so N * NC fma chains run side by side and the heads share each widened
// pair of keys; each head's dim still takes every key in order, from its sum times correction.
template <typename L, int N, int NC>
inline void heads_values(const float* const* rounded, const at::BFloat16* vblock, int64_t D, int64_t d0,
                         int64_t valid, const float* correction, float* const* values) {
  constexpr int64_t W = L::WIDTH;
  typename L::F sums[N][NC];
  for (int h = 0; h < N; ++h) {
    for (int c = 0; c < NC; ++c) sums[h][c] = L::load(values[h] + d0 + W * c);
    if (correction[h] != 1.f)  // times one changes nothing: most blocks leave the running max where it was
      for (int c = 0; c < NC; ++c) sums[h][c] = L::mul(sums[h][c], L::broadcast(correction + h));
  }
  int64_t key = 0;
  for (; key + 1 < valid; key += 2) {
    const at::BFloat16* pairs_at = vblock + ((key / 2) * D + d0) * 2;
    for (int c = 0; c < NC; ++c) {
      const auto pairs = L::pairs(pairs_at + 2 * W * c);
      const typename L::F even = L::even(pairs), odd = L::odd(pairs);
      for (int h = 0; h < N; ++h) {
        sums[h][c] = L::fma(L::broadcast(rounded[h] + key), even, sums[h][c]);
        sums[h][c] = L::fma(L::broadcast(rounded[h] + key + 1), odd, sums[h][c]);
      }
    }
  }
  if (key < valid) {  // a lone last key: the even halves
    const at::BFloat16* pairs_at = vblock + ((key / 2) * D + d0) * 2;
    for (int c = 0; c < NC; ++c) {
      const typename L::F even = L::even(L::pairs(pairs_at + 2 * W * c));
      for (int h = 0; h < N; ++h) sums[h][c] = L::fma(L::broadcast(rounded[h] + key), even, sums[h][c]);
    }
  }
  for (int h = 0; h < N; ++h)
    for (int c = 0; c < NC; ++c) L::store(values[h] + d0 + W * c, sums[h][c]);
}

// Dims [d0, D) (a multiple of WIDTH of them), NC vectors at a time while they last, then fewer.
template <typename L, int N, int NC>
inline void heads_values_from(const float* const* rounded, const at::BFloat16* vblock, int64_t D, int64_t d0,
                              int64_t valid, const float* correction, float* const* values) {
  for (; d0 + L::WIDTH * NC <= D; d0 += L::WIDTH * NC)
    heads_values<L, N, NC>(rounded, vblock, D, d0, valid, correction, values);
  if constexpr (NC > 1)
    if (d0 < D) heads_values_from<L, N, NC - 1>(rounded, vblock, D, d0, valid, correction, values);
}

// N heads' weighted values, as wide as the build and D allow, with as many sums in registers as
// leave room for the widened keys.
template <int N>
inline void heads_block_values(const float* const* rounded, const at::BFloat16* vblock, int64_t D, int64_t valid,
                               const float* correction, float* const* values) {
#if EMBER_AVX512
  if (D % 16 == 0)
    return heads_values_from<Lanes16, N, N == 1 ? 8 : 4>(rounded, vblock, D, 0, valid, correction, values);
#endif
  heads_values_from<Lanes8, N, N == 1 ? 8 : N == 2 ? 4 : 2>(rounded, vblock, D, 0, valid, correction, values);
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

// Whether a prompt tile's rows that see a chunk's keys alike go to attend_chunk as more heads of
// one call (split_partials): the widening path's, below, whose passes of heads share each block's
// widened keys and values, so that a group of fewer heads than a pass holds fills one too. A
// call's heads and their widened queries (floats) live on the stack, up to these.
constexpr bool WIDENED_ROWS_SHARE_CHUNKS = EMBER_AVX2 && !EMBER_BF16_DOT;
constexpr int64_t MOST_WIDENED = 4096, MOST_WIDENED_HEADS = 64;

#if EMBER_AVX2 && !EMBER_BF16_DOT
#if EMBER_AVX512
// softmax_weights, then round_to_bf16, for a block the row sees whole, sixteen lanes in registers
// rather than through memory: the same operations (a max is exact in any order; the sum's
// sixteen lanes are reduced as exp_and_sum reduces them; bf16_bits rounds as round_to_bf16 does
// where no weight is NaN), so the same bits.
inline float whole_block_weights(float* scores, State& state) {
  const __m512 scaled = _mm512_load_ps(scores);
  const float max = std::max(state.max, _mm512_reduce_max_ps(scaled));
  const float correction = state.max == max && std::isfinite(max) ? 1.f : std::exp(state.max - max);
  const __m512 weights = exp_nonpositive(_mm512_sub_ps(scaled, _mm512_set1_ps(max)));
  state.sum = std::fma(state.sum, correction, _mm512_reduce_add_ps(weights));
  state.max = max;
  _mm512_store_ps(scores, _mm512_castsi512_ps(bf16_bits(weights)));
  return correction;
}
#endif

// Heads that share a block's widened keys and values: their sums fill twelve of AVX2's sixteen
// registers, sixteen of AVX-512's thirty-two, beside the widened vectors.
constexpr int MAX_HEADS_AT_ONCE = EMBER_AVX512 ? 4 : 3;

// f(std::integral_constant<int, n>) for n heads, 1 <= n <= MAX_HEADS_AT_ONCE: a template's count.
template <typename F> inline void with_heads(int64_t n, F&& f) {
  switch (n) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
    case 3: return f(std::integral_constant<int, 3>{});
    default: return f(std::integral_constant<int, MAX_HEADS_AT_ONCE>{});
  }
}

// bfloat16 heads [0, G) of a row over one chunk, block by block: each head's query widened to
// floats once for the chunk, the block's scores for up to MAX_HEADS_AT_ONCE heads at a time,
// then each head's softmax step: the bits of attend_block, head by head.
template <>
inline void attend_chunk<at::BFloat16>(const at::BFloat16* const* q, int64_t G, const at::BFloat16* const* kblocks,
                                       const at::BFloat16* const* vblocks, int64_t count, int64_t D, int64_t first,
                                       int64_t valid, float scale, State* states) {
  if (D % 8 != 0 || G * D > MOST_WIDENED || G > MOST_WIDENED_HEADS)
    return attend_blocks<at::BFloat16>(q, G, kblocks, vblocks, count, D, first, valid, scale, states);
  alignas(32) float qf[MOST_WIDENED];
  alignas(64) float scores[MOST_WIDENED_HEADS][BLOCK];
  const float* heads[MOST_WIDENED_HEADS];
  float* outs[MOST_WIDENED_HEADS];
  float* values[MOST_WIDENED_HEADS];
  float corrections[MOST_WIDENED_HEADS];
  for (int64_t g = 0; g < G; ++g) {
    widen_query(q[g], D, qf + g * D);
    heads[g] = qf + g * D;
    outs[g] = scores[g];
    values[g] = states[g].values;
  }
  for (int64_t blk = first / BLOCK; blk < count; ++blk) {
    for (int64_t g = 0; g < G; g += MAX_HEADS_AT_ONCE)
      with_heads(std::min<int64_t>(MAX_HEADS_AT_ONCE, G - g), [&](auto n) {
        heads_block_scores<decltype(n)::value>(heads + g, kblocks[blk], D, scale, outs + g);
      });
    const int64_t seen = std::min<int64_t>(BLOCK, valid - blk * BLOCK);
    for (int64_t g = 0; g < G; ++g) {
#if EMBER_AVX512
      if (seen == BLOCK && first <= blk * BLOCK) {
        corrections[g] = whole_block_weights(scores[g], states[g]);
        continue;
      }
#endif
      corrections[g] = softmax_weights(scores[g], std::max<int64_t>(0, first - blk * BLOCK), seen, states[g]);
      round_to_bf16(scores[g], scores[g]);
    }
    for (int64_t g = 0; g < G; g += MAX_HEADS_AT_ONCE)
      with_heads(std::min<int64_t>(MAX_HEADS_AT_ONCE, G - g), [&](auto n) {
        heads_block_values<decltype(n)::value>(outs + g, vblocks[blk], D, seen, corrections + g, values + g);
      });
  }
}
#endif

#if EMBER_BF16_DOT
// Lanes of a block's 16 keys that a row sees: [hidden, left), both counted from the block's start.
inline __mmask16 visible_keys(int64_t hidden, int64_t left) {
  const uint32_t upto = left >= BLOCK ? 0xffffu : (1u << std::max<int64_t>(left, 0)) - 1;
  const uint32_t before = hidden <= 0 ? 0u : hidden >= BLOCK ? 0xffffu : (1u << hidden) - 1;
  return __mmask16(upto & ~before);
}

// The keys of block `blk` a row sees, where it sees keys [first, valid) counted from the step's
// first key: a block between the two, seen whole, needs no mask worked out.
inline __mmask16 block_keys(int64_t blk, int64_t first, int64_t valid) {
  const bool whole = blk * BLOCK >= first && (blk + 1) * BLOCK <= valid;
  return whole ? __mmask16(0xffff) : visible_keys(first - blk * BLOCK, valid - blk * BLOCK);
}

// One block's weights in a softmax step whose max is known: e^(score - max) on the keys seen and 0
// elsewhere, to `pairs` in bfloat16 (8 pairs); the float weights come back for the step's sum.
__attribute__((always_inline)) inline __m512 block_weights(__m512 scaled, float max, __mmask16 seen,
                                                           uint32_t* pairs) {
  const __m512 probs = _mm512_maskz_mov_ps(seen, exp_nonpositive(_mm512_sub_ps(scaled, _mm512_set1_ps(max))));
  _mm256_store_si256(reinterpret_cast<__m256i*>(pairs), (__m256i)_mm512_cvtneps_pbh(probs));
  return probs;
}

// One row-head's online-softmax step over `count` blocks (at most MOST_BLOCKS), `raw` their 16 dot
// products each (not yet scaled), keys [first, valid) of them seen: the state's max and sum move on,
// the weights go to prob_pairs (bfloat16, 8 pairs a block) and the factor the state's values must
// take comes back. The dot instructions' step, inlined so that their sums stay in registers; the
// tiles take the same step in its block-by-block parts (attention_tiles.h), the same operations.
template <int MOST_BLOCKS>
__attribute__((always_inline)) inline float chunk_softmax(const __m512* raw, int count, int64_t first, int64_t valid,
                                                          float scale, State& state, uint32_t* prob_pairs) {
  __m512 scores[MOST_BLOCKS];
  __mmask16 masks[MOST_BLOCKS];
  __m512 vmax = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int blk = 0; blk < count; ++blk) {
    masks[blk] = block_keys(blk, first, valid);
    scores[blk] = _mm512_mul_ps(raw[blk], _mm512_set1_ps(scale));
    vmax = _mm512_mask_max_ps(vmax, masks[blk], vmax, scores[blk]);
  }
  const float max = std::max(state.max, _mm512_reduce_max_ps(vmax));
  const float factor = std::exp(state.max - max);  // 0 on the first chunk (max was -inf)
  __m512 sum = _mm512_setzero_ps();
  for (int blk = 0; blk < count; ++blk)
    sum = _mm512_add_ps(sum, block_weights(scores[blk], max, masks[blk], prob_pairs + blk * BLOCK / 2));
  state.sum = std::fma(state.sum, factor, _mm512_reduce_add_ps(sum));
  state.max = max;
  return factor;
}

// bfloat16 over one chunk of up to CHUNK / BLOCK blocks, for N heads of a group at once: they
// share the chunk's key and value loads, each q pair and probability pair is broadcast once per
// chunk, and every sum stays in a register. C = head_dim / 16. A head's arithmetic is the same
// whatever heads it is grouped with.
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
#pragma GCC unroll 8
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
