// Row-wise ops of a decoder layer: RMS norm (with the residual add, or Gemma's scale in float32),
// rotary embeddings, SiLU and multiply. Each row is computed alone, lanes then across lanes, so rows never depend on one another.

#include "common.h"

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
#if EMBER_AVX2
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
#if EMBER_AVX2
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

// (T, 2I) gate | up -> (T, I): silu(gate) rounded to the dtype, times up.
at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.stride(1) == 1, "gate_up must be (T, 2I) with contiguous rows");
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2;
  auto out = at::empty({T, I}, gate_up.options());
  dispatch_float_or_bf16(gate_up.scalar_type(), [&](auto tag) {
    using T_ = decltype(tag);
    at::parallel_for(0, T, 4, [&](int64_t begin, int64_t end) {
      std::vector<float> gate(I), e(I);
      for (int64_t t = begin; t < end; ++t) {
        const T_* g = gate_up.data_ptr<T_>() + t * gate_up.stride(0);
        const T_* u = g + I;
        T_* o = out.data_ptr<T_>() + t * I;
        for (int64_t i = 0; i < I; ++i) {
          gate[i] = to_float<T_>(g[i]);
          e[i] = -std::fabs(gate[i]);
        }
        exp_and_sum(e.data(), I, 0.f);  // e^-|x| in place (never overflows)
        int64_t i = 0;
#if EMBER_AVX2
        const __m256 one = _mm256_set1_ps(1.f);
        for (; i + 8 <= I; i += 8) {
          const __m256 x = _mm256_loadu_ps(gate.data() + i), ex = _mm256_loadu_ps(e.data() + i);
          const __m256 denominator = _mm256_add_ps(one, ex);
          const __m256 sigmoid = _mm256_blendv_ps(_mm256_div_ps(ex, denominator), _mm256_div_ps(one, denominator),
                                                  _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_GE_OQ));
          store8(o + i, _mm256_mul_ps(round8(T_(), _mm256_mul_ps(x, sigmoid)), load8(u + i)));
        }
#endif
        for (; i < I; ++i) {
          const float sigmoid = gate[i] >= 0.f ? 1.f / (1.f + e[i]) : e[i] / (1.f + e[i]);
          o[i] = from_float<T_>(to_float<T_>(from_float<T_>(gate[i] * sigmoid)) * to_float<T_>(u[i]));
        }
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
