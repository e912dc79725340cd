// The int8 KV cache in ember's attention kernel (attention.cpp): a key or value row quantized as it
// is stored, and a block's scores and weighted values read from int8.
//
// A block of 16 slots is 16 * D int8 values, K as [D][16] (a dim's 16 keys side by side) and V as
// [16][D] (a key's dims side by side), then the 16 slots' float32 scales: a slot's value is its
// int8 times its scale. Each row (one token's K or V in one KV head) has its own scale,
// max |x| / 127, and its values are round-half-to-even(x / scale): a row's bits depend on that row
// alone, and engine.attention.quantize_rows gives the same bits. Scores and weighted values are
// computed in float32 from the widened int8 (exact), the K scale applied to a key's dot product and
// the V scale folded into its probability.
#pragma once

#include "common.h"

namespace ember_kernels {
namespace kv_int8 {

constexpr int64_t BLOCK = 16;

inline int64_t block_bytes(int64_t D) { return BLOCK * (D + 4); }
inline const float* scales(const int8_t* block, int64_t D) { return reinterpret_cast<const float*>(block + BLOCK * D); }

// x (D values) into slot `key` of a K block (values false) or a V block (values true), its scale too.
template <typename T>
inline void store_row(const T* x, int64_t D, int8_t* block, int64_t key, bool values) {
  float amax = 0.f;
  for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(to_float<T>(x[d])));
  const float scale = amax / 127.f;
  for (int64_t d = 0; d < D; ++d) {
    const float q = scale > 0.f ? std::nearbyint(to_float<T>(x[d]) / scale) : 0.f;
    block[values ? key * D + d : d * BLOCK + key] = int8_t(std::max(-127.f, std::min(127.f, q)));
  }
  std::memcpy(block + BLOCK * D + 4 * key, &scale, 4);
}

#if EMBER_AVX512
inline __m512 widen16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
#elif EMBER_AVX2
inline __m256 widen8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
#endif

// N heads' scores against a K block: out[h][key] = (q_h . k_key) * the key's scale * `scale`, the
// dot product in two chains (even and odd dims) added at the end, a lane per key. D even. Every
// path computes the same bits.
template <int N>
inline void heads_scores(const float* const* qf, const int8_t* kblock, int64_t D, float scale, float (*out)[BLOCK]) {
  const float* ks = scales(kblock, D);
#if EMBER_AVX512
  __m512 even[N], odd[N];
  for (int h = 0; h < N; ++h) even[h] = odd[h] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 2) {
    const __m512 k0 = widen16(kblock + d * BLOCK), k1 = widen16(kblock + (d + 1) * BLOCK);
    for (int h = 0; h < N; ++h) {
      even[h] = _mm512_fmadd_ps(_mm512_set1_ps(qf[h][d]), k0, even[h]);
      odd[h] = _mm512_fmadd_ps(_mm512_set1_ps(qf[h][d + 1]), k1, odd[h]);
    }
  }
  const __m512 factor = _mm512_mul_ps(_mm512_loadu_ps(ks), _mm512_set1_ps(scale));
  for (int h = 0; h < N; ++h) _mm512_storeu_ps(out[h], _mm512_mul_ps(_mm512_add_ps(even[h], odd[h]), factor));
#elif EMBER_AVX2
  for (int half = 0; half < 2; ++half) {  // keys 8 * half to 8 * half + 7
    __m256 even[N], odd[N];
    for (int h = 0; h < N; ++h) even[h] = odd[h] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 2) {
      const __m256 k0 = widen8(kblock + d * BLOCK + 8 * half), k1 = widen8(kblock + (d + 1) * BLOCK + 8 * half);
      for (int h = 0; h < N; ++h) {
        even[h] = _mm256_fmadd_ps(_mm256_set1_ps(qf[h][d]), k0, even[h]);
        odd[h] = _mm256_fmadd_ps(_mm256_set1_ps(qf[h][d + 1]), k1, odd[h]);
      }
    }
    const __m256 factor = _mm256_mul_ps(_mm256_loadu_ps(ks + 8 * half), _mm256_set1_ps(scale));
    for (int h = 0; h < N; ++h)
      _mm256_storeu_ps(out[h] + 8 * half, _mm256_mul_ps(_mm256_add_ps(even[h], odd[h]), factor));
  }
#else
  for (int h = 0; h < N; ++h)
    for (int64_t key = 0; key < BLOCK; ++key) {
      float even = 0.f, odd = 0.f;
      for (int64_t d = 0; d < D; d += 2) {
        even = std::fma(qf[h][d], float(kblock[d * BLOCK + key]), even);
        odd = std::fma(qf[h][d + 1], float(kblock[(d + 1) * BLOCK + key]), odd);
      }
      out[h][key] = (even + odd) * (ks[key] * scale);
    }
#endif
}

#if EMBER_AVX512
// Dims [d0, d0 + 16 C) of heads_values: N * C sums in registers, each V row widened once for all N.
template <int N, int C>
inline void heads_values_at(const float (*weights)[BLOCK], const int8_t* vblock, int64_t D, int64_t d0,
                            int64_t valid, const float* correction, float* const* values) {
  __m512 sums[N][C];
  for (int h = 0; h < N; ++h)
    for (int c = 0; c < C; ++c)
      sums[h][c] = _mm512_mul_ps(_mm512_loadu_ps(values[h] + d0 + 16 * c), _mm512_set1_ps(correction[h]));
  for (int64_t key = 0; key < valid; ++key)
    for (int c = 0; c < C; ++c) {
      const __m512 v = widen16(vblock + key * D + d0 + 16 * c);
      for (int h = 0; h < N; ++h) sums[h][c] = _mm512_fmadd_ps(_mm512_set1_ps(weights[h][key]), v, sums[h][c]);
    }
  for (int h = 0; h < N; ++h)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(values[h] + d0 + 16 * c, sums[h][c]);
}
#elif EMBER_AVX2
// Dims [d0, d0 + 8 C) of heads_values, as the AVX-512 path's with eight lanes.
template <int N, int C>
inline void heads_values_at(const float (*weights)[BLOCK], const int8_t* vblock, int64_t D, int64_t d0,
                            int64_t valid, const float* correction, float* const* values) {
  __m256 sums[N][C];
  for (int h = 0; h < N; ++h)
    for (int c = 0; c < C; ++c)
      sums[h][c] = _mm256_mul_ps(_mm256_loadu_ps(values[h] + d0 + 8 * c), _mm256_set1_ps(correction[h]));
  for (int64_t key = 0; key < valid; ++key)
    for (int c = 0; c < C; ++c) {
      const __m256 v = widen8(vblock + key * D + d0 + 8 * c);
      for (int h = 0; h < N; ++h) sums[h][c] = _mm256_fmadd_ps(_mm256_set1_ps(weights[h][key]), v, sums[h][c]);
    }
  for (int h = 0; h < N; ++h)
    for (int c = 0; c < C; ++c) _mm256_storeu_ps(values[h] + d0 + 8 * c, sums[h][c]);
}
#endif

// N heads' running values over a V block: values_h = values_h * correction_h, then each dim takes
// keys [0, valid) in order, weights[h][key] * v[key] (the weights already times the keys' V
// scales). D a multiple of 16.
template <int N>
inline void heads_values(const float (*weights)[BLOCK], const int8_t* vblock, int64_t D, int64_t valid,
                         const float* correction, float* const* values) {
#if EMBER_AVX512
  int64_t d0 = 0;
  for (; d0 + 64 <= D; d0 += 64) heads_values_at<N, 4>(weights, vblock, D, d0, valid, correction, values);
  for (; d0 < D; d0 += 16) heads_values_at<N, 1>(weights, vblock, D, d0, valid, correction, values);
#elif EMBER_AVX2
  constexpr int C = N <= 2 ? 4 : N == 3 ? 3 : 2;  // at most twelve sums in the sixteen registers
  int64_t d0 = 0;
  for (; d0 + 8 * C <= D; d0 += 8 * C) heads_values_at<N, C>(weights, vblock, D, d0, valid, correction, values);
  for (; d0 < D; d0 += 8) heads_values_at<N, 1>(weights, vblock, D, d0, valid, correction, values);
#else
  for (int h = 0; h < N; ++h) {
    for (int64_t d = 0; d < D; ++d) values[h][d] *= correction[h];
    for (int64_t key = 0; key < valid; ++key)
      for (int64_t d = 0; d < D; ++d) values[h][d] = std::fma(weights[h][key], float(vblock[key * D + d]), values[h][d]);
  }
#endif
}

}  // namespace kv_int8
}  // namespace ember_kernels
