// Shared by ember's CPU kernels: float conversions, the vector exp, dtype dispatch.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define EMBER_AVX512 1
#else
#define EMBER_AVX512 0
#endif

namespace ember_kernels {

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

#if EMBER_AVX512
inline __mmask16 first_lanes(int64_t count) { return count >= 16 ? __mmask16(0xffff) : __mmask16((1u << count) - 1); }

// Sixteen values of T as floats (to_float lane by lane).
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
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

// y += a x over D floats.
inline void axpy(float a, const float* x, float* y, int64_t D) {
  int64_t i = 0;
#if EMBER_AVX512
  const __m512 va = _mm512_set1_ps(a);
  for (; i + 16 <= D; i += 16)
    _mm512_storeu_ps(y + i, _mm512_fmadd_ps(va, _mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i)));
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
