// Shared by ember's CPU kernels: float conversions, the vector exp, dtype dispatch. Light on
// torch's headers (a unit that only computes, as the linear kernel's column units, compiles in
// seconds); a unit that defines ops includes ATen and torch/library.h itself.
#pragma once

#include <ATen/Parallel.h>
#include <c10/core/ScalarType.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

// The vector instructions at hand: AVX-512 with VNNI (Zen 4, Xeons since Cascade Lake) and AVX2
// with FMA and F16C (most x86 processors since 2015: Zen 1 to 3 and most laptops stop
// there). A kernel takes the widest path it has. The linear layers' vector paths give their plain
// C++'s bits; the row ops and attention sum across lanes and take a polynomial exp, so their bits
// are the path's own (each still batch-invariant).
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define EMBER_AVX512 1
#else
#define EMBER_AVX512 0
#endif
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define EMBER_AVX2 1
#else
#define EMBER_AVX2 0
#endif
#if EMBER_AVX512 || EMBER_AVX2
#include <immintrin.h>
#endif
// Byte dot products on AVX2's registers (AVX-VNNI: Intel's processors since Alder Lake that stop
// short of AVX-512, most laptops of recent years among them), taken by the AVX2 path's linear
// layers, which a build with AVX-512 does not take.
#if EMBER_AVX2 && !EMBER_AVX512 && defined(__AVXVNNI__)
#define EMBER_AVX_VNNI 1
#else
#define EMBER_AVX_VNNI 0
#endif
// bfloat16 dot products (vdpbf16ps: Zen 4, Xeons since Cooper Lake), on top of AVX-512.
#if EMBER_AVX512 && defined(__AVX512BF16__)
#define EMBER_BF16_DOT 1
#else
#define EMBER_BF16_DOT 0
#endif
// AMX tiles (Xeons since Sapphire Rapids; amx.h), where the build targets a processor with them
// (and so has a compiler and assembler that know them): bfloat16 products for attention, int8
// ones for the linear layers of many rows.
#if EMBER_BF16_DOT && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define EMBER_AMX_TILES 1
#else
#define EMBER_AMX_TILES 0
#endif
#if EMBER_AVX512 && defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define EMBER_AMX_INT8 1
#else
#define EMBER_AMX_INT8 0
#endif
#if EMBER_AMX_TILES || EMBER_AMX_INT8
#include "amx.h"
#endif

// The namespace of the ops under torch.ops: a test builds a second copy under another name.
#ifndef EMBER_OPS
#define EMBER_OPS ember
#endif
// The namespace of the linear kernel's units, which call one another across them: one for each op
// namespace, so that a second build loaded in the same process never lends the first its functions.
#define EMBER_JOIN_(a, b) a##_##b
#define EMBER_JOIN(a, b) EMBER_JOIN_(a, b)
#define EMBER_LINEAR EMBER_JOIN(linear, EMBER_OPS)

namespace ember_kernels {

// Asks for the cache line holding p to be brought into L2, without waiting for it; always inlined.
// GCC takes a function or lambda whose only effect is a prefetch for one without effects and
// drops every call to it that it does not inline: attention's prefetches, asked for through such
// a lambda, were missing from the build from 2026-12-06 to 2026-12-08 without a word. So a
// prefetch sits in code that does something else too (a loop's body, a function that also
// computes or keeps a count), never alone in a helper of its own; tests/models/
// test_kernel_prefetches.py reads the build for them. (An asm statement, which the compiler never
// drops, cost the linear kernel's VNNI tiles 3-7% of their time at 1 to 16 rows.)
__attribute__((always_inline)) inline void prefetch_to_l2(const void* p) { __builtin_prefetch(p, 0, 2); }

inline float bf16_to_float(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t float_to_bf16(float f) {  // round to nearest even, as torch does
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);  // NaN stays NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

inline float half_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000) << 16;
  uint32_t exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff, bits;
  if (exponent == 0) {
    if (mantissa == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      exponent = 127 - 15 + 1;
      while (!(mantissa & 0x400)) { mantissa <<= 1; --exponent; }
      bits = sign | (exponent << 23) | ((mantissa & 0x3ff) << 13);
    }
  } else if (exponent == 0x1f) {
    bits = sign | 0x7f800000u | (mantissa << 13);
  } else {
    bits = sign | ((exponent + 127 - 15) << 23) | (mantissa << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

template <typename T> inline float to_float(T v);
template <> inline float to_float<float>(float v) { return v; }
template <> inline float to_float<at::BFloat16>(at::BFloat16 v) { return bf16_to_float(v.x); }

template <typename T> inline T from_float(float v);
template <> inline float from_float<float>(float v) { return v; }
template <> inline at::BFloat16 from_float<at::BFloat16>(float v) {
  at::BFloat16 out;
  out.x = float_to_bf16(v);
  return out;
}

#if EMBER_AVX2
// Eight floats rounded to T and back (float_to_bf16's rounding, NaN kept a NaN), and stored as T.
inline __m256i bf16_bits(__m256 v) {  // in each lane's high half
  const __m256i u = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), odd));
  const __m256i quiet = _mm256_or_si256(u, _mm256_set1_epi32(0x400000));
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  return _mm256_and_si256(_mm256_blendv_epi8(rounded, quiet, nan), _mm256_set1_epi32(int(0xffff0000u)));
}
inline __m256 round8(float, __m256 v) { return v; }
inline __m256 round8(at::BFloat16, __m256 v) { return _mm256_castsi256_ps(bf16_bits(v)); }
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(at::BFloat16* p, __m256 v) {
  const __m256i words = _mm256_srli_epi32(bf16_bits(v), 16);
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(words), _mm256_extracti128_si256(words, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}
#endif

#if EMBER_AVX512
inline __mmask16 first_lanes(int64_t count) { return count >= 16 ? __mmask16(0xffff) : __mmask16((1u << count) - 1); }

// Sixteen values of T as floats (to_float lane by lane); with a mask, the lanes it sets (the others 0).
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
inline __m512 load16(const float* p, __mmask16 lanes) { return _mm512_maskz_loadu_ps(lanes, p); }
inline __m512 load16(const at::BFloat16* p, __mmask16 lanes) {
  const __m256i bits = _mm256_maskz_loadu_epi16(lanes, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// Sixteen floats rounded to T and back (float_to_bf16's rounding, NaN kept a NaN, as bf16_bits
// for eight), and stored as T in the lanes `lanes` sets.
inline __m512i bf16_bits(__m512 v) {  // in each lane's high half
  const __m512i u = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd));
  const __m512i quiet = _mm512_or_si512(u, _mm512_set1_epi32(0x400000));
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  return _mm512_and_si512(_mm512_mask_blend_epi32(nan, rounded, quiet), _mm512_set1_epi32(int(0xffff0000u)));
}
#if EMBER_BF16_DOT && defined(__AVX512DQ__)
#define EMBER_BF16_ROUND 1
#else
#define EMBER_BF16_ROUND 0
#endif
#if EMBER_BF16_ROUND
// vcvtneps2bf16 rounds as float_to_bf16 does (to nearest even, a NaN's high half quieted) but
// flushes subnormals to zero: where a lane is subnormal (rare), the integer steps above instead.
inline bool has_subnormal(__m512 v) { return _mm512_fpclass_ps_mask(v, 0x20) != 0; }
#endif
inline __m512 round16(float, __m512 v) { return v; }
inline __m512 round16(at::BFloat16, __m512 v) {
#if EMBER_BF16_ROUND
  if (!has_subnormal(v))
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
#endif
  return _mm512_castsi512_ps(bf16_bits(v));
}
inline void store16(float* p, __m512 v, __mmask16 lanes) { _mm512_mask_storeu_ps(p, lanes, v); }
inline void store16(at::BFloat16* p, __m512 v, __mmask16 lanes) {
#if EMBER_BF16_ROUND
  if (!has_subnormal(v)) return _mm256_mask_storeu_epi16(p, lanes, (__m256i)_mm512_cvtneps_pbh(v));
#endif
  _mm256_mask_storeu_epi16(p, lanes, _mm512_cvtepi32_epi16(_mm512_srli_epi32(bf16_bits(v), 16)));
}
#endif

#if EMBER_AVX2
// Eight values of T as floats (to_float lane by lane).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}
#endif

#if EMBER_AVX512
// e^x for x <= 0 (softmax after the max is taken): 2^n * p(r), r in [-ln2/2, ln2/2].
inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}
#endif

#if EMBER_AVX2
// The same e^x for eight lanes: the same steps, 2^n built in the exponent bits (n >= -126 after
// the clamp, so 2^n is a normal float and the product rounds as scalef's does).
inline __m256 exp_nonpositive(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i power = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(power));
}

// The eight lanes' sum: halves, then pairs, then the last two (a fixed order).
inline float sum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// Lanes [0, count) set, as a mask for maskload and maskstore.
inline __m256i first_lanes8(int64_t count) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(int(count)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
#endif

// y += a x over D floats.
inline void axpy(float a, const float* x, float* y, int64_t D) {
  int64_t i = 0;
#if EMBER_AVX512
  const __m512 va = _mm512_set1_ps(a);
  for (; i + 16 <= D; i += 16)
    _mm512_storeu_ps(y + i, _mm512_fmadd_ps(va, _mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i)));
#elif EMBER_AVX2
  const __m256 va = _mm256_set1_ps(a);
  for (; i + 8 <= D; i += 8)
    _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
#endif
  for (; i < D; ++i) y[i] = std::fma(a, x[i], y[i]);
}

// scores[0, n) -> exp(scores - max) in place; returns the sum (lanes, then across lanes).
inline float exp_and_sum(float* scores, int64_t n, float max) {
  int64_t t = 0;
  float sum = 0.f;
#if EMBER_AVX512
  __m512 lanes = _mm512_setzero_ps();
  const __m512 vmax = _mm512_set1_ps(max);
  for (; t + 16 <= n; t += 16) {
    const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(scores + t), vmax));
    _mm512_storeu_ps(scores + t, e);
    lanes = _mm512_add_ps(lanes, e);
  }
  if (t < n) {
    const __mmask16 mask = __mmask16((1u << (n - t)) - 1);
    const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, scores + t), vmax));
    _mm512_mask_storeu_ps(scores + t, mask, e);
    lanes = _mm512_add_ps(lanes, _mm512_maskz_mov_ps(mask, e));
    t = n;
  }
  sum = _mm512_reduce_add_ps(lanes);
#elif EMBER_AVX2
  __m256 lanes = _mm256_setzero_ps();
  const __m256 vmax = _mm256_set1_ps(max);
  for (; t + 8 <= n; t += 8) {
    const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(scores + t), vmax));
    _mm256_storeu_ps(scores + t, e);
    lanes = _mm256_add_ps(lanes, e);
  }
  if (t < n) {
    const __m256i mask = first_lanes8(n - t);
    const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_maskload_ps(scores + t, mask), vmax));
    _mm256_maskstore_ps(scores + t, mask, e);
    lanes = _mm256_add_ps(lanes, _mm256_and_ps(e, _mm256_castsi256_ps(mask)));
    t = n;
  }
  sum = sum8(lanes);
#endif
  for (; t < n; ++t) {
    scores[t] = std::exp(scores[t] - max);
    sum += scores[t];
  }
  return sum;
}

template <typename F> void dispatch_float_or_bf16(at::ScalarType dtype, F&& body) {
  if (dtype == at::kBFloat16) {
    body(at::BFloat16());
  } else {
    TORCH_CHECK(dtype == at::kFloat, "ember's CPU kernels take bfloat16 or float32");
    body(float());
  }
}

// Rotary embedding of one token's heads, in place: for each of `heads` rows of D = 2 half values
// (`stride` apart), x1' = x1 cos - x2 sin and x2' = x2 cos + x1 sin, each in one float rounding.
// cos and sin are the token's (D / 2) row in T; c and s are scratch of D / 2 floats.
template <typename T>
inline void rotate_heads(T* x, int64_t heads, int64_t stride, int64_t half, const T* cos, const T* sin, float* c,
                         float* s) {
  for (int64_t i = 0; i < half; ++i) {
    c[i] = to_float<T>(cos[i]);
    s[i] = to_float<T>(sin[i]);
  }
  for (int64_t h = 0; h < heads; ++h) {
    T* row = x + h * stride;
    for (int64_t i = 0; i < half; ++i) {
      const float x1 = to_float<T>(row[i]), x2 = to_float<T>(row[i + half]);
      row[i] = from_float<T>(std::fma(x1, c[i], -x2 * s[i]));
      row[i + half] = from_float<T>(std::fma(x2, c[i], x1 * s[i]));
    }
  }
}

}  // namespace ember_kernels
