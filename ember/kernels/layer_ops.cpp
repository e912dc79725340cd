// Row-wise ops of a decoder layer: RMS norm (with the residual add, or Gemma's scale in float32),
// rotary embeddings, SiLU and multiply. Each row is computed alone, lanes then across lanes, so rows never depend on one another.

#include "common.h"

#include <ATen/ATen.h>
#include <torch/library.h>

namespace ember_kernels {
namespace {

inline float sum_of_squares(const float* x, int64_t D) {
  int64_t i = 0;
  float total = 0.f;
#if EMBER_AVX512
  __m512 lanes = _mm512_setzero_ps();
  for (; i + 16 <= D; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    lanes = _mm512_fmadd_ps(v, v, lanes);
  }
  total = _mm512_reduce_add_ps(lanes);
#elif EMBER_AVX2
  __m256 lanes = _mm256_setzero_ps();
  for (; i + 8 <= D; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    lanes = _mm256_fmadd_ps(v, v, lanes);
  }
  total = sum8(lanes);
#endif
  for (; i < D; ++i) total = std::fma(x[i], x[i], total);
  return total;
}

// out = weight * to_T(x / rms(x)), transformers' order (normalise in float32, round, then scale).
template <typename T>
inline void norm_row(const float* x, const T* weight, int64_t D, double eps, T* out) {
  const float inv = 1.f / std::sqrt(sum_of_squares(x, D) / float(D) + float(eps));
  int64_t i = 0;
#if EMBER_AVX512
  const __m512 vinv = _mm512_set1_ps(inv);
  for (; i < D; i += 16) {
    const __mmask16 lanes = first_lanes(D - i);
    const __m512 normed = round16(T(), _mm512_mul_ps(load16(x + i, lanes), vinv));
    store16(out + i, _mm512_mul_ps(load16(weight + i, lanes), normed), lanes);
  }
#elif EMBER_AVX2
  const __m256 vinv = _mm256_set1_ps(inv);
  for (; i + 8 <= D; i += 8)
    store8(out + i, _mm256_mul_ps(load8(weight + i), round8(T(), _mm256_mul_ps(_mm256_loadu_ps(x + i), vinv))));
#endif
  for (; i < D; ++i)
    out[i] = from_float<T>(to_float<T>(weight[i]) * to_float<T>(from_float<T>(x[i] * inv)));
}

// Rows of x (..., D), the last dim contiguous, normalised and scaled by weight; with an addend
// (the same shape), the rows of x + addend (rounded to the dtype) instead, and that sum as well.
std::tuple<at::Tensor, at::Tensor> norm_rows(const at::Tensor& x, const at::Tensor* addend, const at::Tensor& weight,
                                             double eps) {
  TORCH_CHECK(x.stride(-1) == 1 && weight.is_contiguous() && weight.scalar_type() == x.scalar_type(),
              "x needs a contiguous last dim and weight its dtype");
  const int64_t D = x.size(-1);
  const at::Tensor rows = x.reshape({-1, D});
  const at::Tensor other = addend != nullptr ? addend->reshape({-1, D}) : rows;
  const int64_t R = rows.size(0);
  auto sum = addend != nullptr ? at::empty({R, D}, x.options()) : at::Tensor();
  auto out = at::empty({R, D}, x.options());
  dispatch_float_or_bf16(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    const T* w = weight.data_ptr<T>();
    at::parallel_for(0, R, 16, [&](int64_t begin, int64_t end) {
      std::vector<float> row(D);
      for (int64_t r = begin; r < end; ++r) {
        const T* a = rows.data_ptr<T>() + r * rows.stride(0);
        if (addend != nullptr) {
          const T* b = other.data_ptr<T>() + r * other.stride(0);
          T* s = sum.data_ptr<T>() + r * D;
          int64_t i = 0;
#if EMBER_AVX512
          for (; i < D; i += 16) {
            const __mmask16 lanes = first_lanes(D - i);
            const __m512 total = round16(T(), _mm512_add_ps(load16(a + i, lanes), load16(b + i, lanes)));
            store16(s + i, total, lanes);
            _mm512_mask_storeu_ps(row.data() + i, lanes, total);
          }
#elif EMBER_AVX2
          for (; i + 8 <= D; i += 8) {
            const __m256 total = round8(T(), _mm256_add_ps(load8(a + i), load8(b + i)));
            store8(s + i, total);
            _mm256_storeu_ps(row.data() + i, total);
          }
#endif
          for (; i < D; ++i) {
            s[i] = from_float<T>(to_float<T>(a[i]) + to_float<T>(b[i]));
            row[i] = to_float<T>(s[i]);
          }
        } else {
          for (int64_t i = 0; i < D; ++i) row[i] = to_float<T>(a[i]);
        }
        norm_row<T>(row.data(), w, D, eps, out.data_ptr<T>() + r * D);
      }
    });
  });
  return {sum, out.view(x.sizes())};
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return std::get<1>(norm_rows(x, nullptr, weight, eps));
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& addend, const at::Tensor& weight,
                                               double eps) {
  TORCH_CHECK(addend.sizes() == x.sizes() && addend.scalar_type() == x.scalar_type(), "addend unlike x");
  auto [sum, normed] = norm_rows(x, &addend, weight, eps);
  return {sum.view(x.sizes()), normed};
}

// Gemma's RMS norm: out = to_T(x / rms(x) * scale), the products in float32 and one rounding at
// the end; scale (D,) float32 is the model's 1 + weight. Rows of x as rms_norm's.
at::Tensor scaled_rms_norm(const at::Tensor& x, const at::Tensor& scale, double eps) {
  const int64_t D = x.size(-1);
  TORCH_CHECK(x.stride(-1) == 1 && scale.is_contiguous() && scale.scalar_type() == at::kFloat && scale.numel() == D,
              "x needs a contiguous last dim and scale (D,) float32");
  const at::Tensor rows = x.reshape({-1, D});
  const int64_t R = rows.size(0);
  auto out = at::empty({R, D}, x.options());
  const float* s = scale.data_ptr<float>();
  dispatch_float_or_bf16(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    at::parallel_for(0, R, 16, [&](int64_t begin, int64_t end) {
      std::vector<float> row(D);
      for (int64_t r = begin; r < end; ++r) {
        const T* a = rows.data_ptr<T>() + r * rows.stride(0);
        for (int64_t i = 0; i < D; ++i) row[i] = to_float<T>(a[i]);
        const float inv = 1.f / std::sqrt(sum_of_squares(row.data(), D) / float(D) + float(eps));
        T* o = out.data_ptr<T>() + r * D;
        for (int64_t i = 0; i < D; ++i) o[i] = from_float<T>(row[i] * inv * s[i]);
      }
    });
  });
  return out.view(x.sizes());
}

// Rotate-half rotary embedding, in place: x (T, heads, D) with a contiguous (heads, D) per token,
// cos and sin (T, ..., D / 2) with contiguous rows. x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin,
// each in one float rounding.
void rotary_(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2), "x must be (T, heads, D) per token");
  const int64_t T = x.size(0), H = x.size(1), D = x.size(2), half = D / 2;
  TORCH_CHECK(cos.size(0) == T && cos.size(-1) == half && cos.stride(-1) == 1 && sin.sizes() == cos.sizes() &&
              sin.strides() == cos.strides() && cos.numel() == T * half && cos.scalar_type() == x.scalar_type() &&
              sin.scalar_type() == x.scalar_type(), "cos and sin must be (T, D / 2) rows in x's dtype");
  const int64_t row_stride = cos.stride(0);
  dispatch_float_or_bf16(x.scalar_type(), [&](auto tag) {
    using T_ = decltype(tag);
    at::parallel_for(0, T, 8, [&](int64_t begin, int64_t end) {
      std::vector<float> c(half), s(half);
      for (int64_t t = begin; t < end; ++t)
        rotate_heads<T_>(x.data_ptr<T_>() + t * x.stride(0), H, D, half, cos.data_ptr<T_>() + t * row_stride,
                         sin.data_ptr<T_>() + t * row_stride, c.data(), s.data());
    });
  });
}

// One row of silu_mul: o = silu(g) rounded to T, times u, over I values; e^-|g| (which never
// overflows) gives the sigmoid on either side of 0. `scratch`: 2 I floats where there is no
// AVX-512 (the exp then runs over a row at once).
template <typename T>
inline void silu_row(const T* g, const T* u, T* o, int64_t I, [[maybe_unused]] float* scratch) {
#if EMBER_AVX512
  const __m512 one = _mm512_set1_ps(1.f), sign = _mm512_set1_ps(-0.f);
  for (int64_t i = 0; i < I; i += 16) {
    const __mmask16 lanes = first_lanes(I - i);
    const __m512 x = load16(g + i, lanes);
    const __m512 ex = exp_nonpositive(_mm512_or_ps(x, sign));
    // 1 / (1 + e) for x >= 0, else e / (1 + e): the numerator chosen, then one division
    const __m512 numerator = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_GE_OQ), ex, one);
    const __m512 sigmoid = _mm512_div_ps(numerator, _mm512_add_ps(one, ex));
    store16(o + i, _mm512_mul_ps(round16(T(), _mm512_mul_ps(x, sigmoid)), load16(u + i, lanes)), lanes);
  }
#else
  float *gate = scratch, *e = scratch + I;
  for (int64_t i = 0; i < I; ++i) {
    gate[i] = to_float<T>(g[i]);
    e[i] = -std::fabs(gate[i]);
  }
  exp_and_sum(e, I, 0.f);  // e^-|x| in place
  int64_t i = 0;
#if EMBER_AVX2
  const __m256 one = _mm256_set1_ps(1.f);
  for (; i + 8 <= I; i += 8) {
    const __m256 x = _mm256_loadu_ps(gate + i), ex = _mm256_loadu_ps(e + i);
    const __m256 denominator = _mm256_add_ps(one, ex);
    const __m256 sigmoid = _mm256_blendv_ps(_mm256_div_ps(ex, denominator), _mm256_div_ps(one, denominator),
                                            _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_GE_OQ));
    store8(o + i, _mm256_mul_ps(round8(T(), _mm256_mul_ps(x, sigmoid)), load8(u + i)));
  }
#endif
  for (; i < I; ++i) {
    const float sigmoid = gate[i] >= 0.f ? 1.f / (1.f + e[i]) : e[i] / (1.f + e[i]);
    o[i] = from_float<T>(to_float<T>(from_float<T>(gate[i] * sigmoid)) * to_float<T>(u[i]));
  }
#endif
}

// (T, 2I) gate | up -> (T, I): silu(gate) rounded to the dtype, times up.
at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.stride(1) == 1, "gate_up must be (T, 2I) with contiguous rows");
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2;
  auto out = at::empty({T, I}, gate_up.options());
  dispatch_float_or_bf16(gate_up.scalar_type(), [&](auto tag) {
    using T_ = decltype(tag);
    at::parallel_for(0, T, 4, [&](int64_t begin, int64_t end) {
      std::vector<float> scratch(EMBER_AVX512 ? 0 : 2 * I);
      for (int64_t t = begin; t < end; ++t) {
        const T_* g = gate_up.data_ptr<T_>() + t * gate_up.stride(0);
        silu_row<T_>(g, g + I, out.data_ptr<T_>() + t * I, I, scratch.data());
      }
    });
  });
  return out;
}

}  // namespace
}  // namespace ember_kernels

TORCH_LIBRARY_FRAGMENT(EMBER_OPS, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("scaled_rms_norm(Tensor x, Tensor scale, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor addend, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("rotary_(Tensor(a!) x, Tensor cos, Tensor sin) -> ()");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
}

TORCH_LIBRARY_IMPL(EMBER_OPS, CPU, m) {
  m.impl("rms_norm", &ember_kernels::rms_norm);
  m.impl("scaled_rms_norm", &ember_kernels::scaled_rms_norm);
  m.impl("add_rms_norm", &ember_kernels::add_rms_norm);
  m.impl("rotary_", &ember_kernels::rotary_);
  m.impl("silu_mul", &ember_kernels::silu_mul);
}
