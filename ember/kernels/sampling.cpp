// The sampler's greedy choice: each row's index of its largest value, the first among equals; a
// row holding NaN gives its first NaN (torch.argmax's answers, found sixteen lanes at a time).

#include "common.h"

#include <ATen/ATen.h>
#include <torch/library.h>

namespace ember_kernels {
namespace {

int64_t first_nan_or_max(const float* x, int64_t n) {
  int64_t best = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (std::isnan(x[i])) return i;
    if (x[i] > x[best]) best = i;
  }
  return best;
}

int64_t row_argmax(const float* x, int64_t n) {
#if EMBER_AVX512
  const __m512 lowest = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 best = lowest;
  __m512i best_at = _mm512_setzero_si512();  // a lane that never rises above -inf points at 0
  __m512i at = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __mmask16 nan = 0;
  for (int64_t i = 0; i < n; i += 16) {
    const __m512 v = _mm512_mask_loadu_ps(lowest, first_lanes(n - i), x + i);
    const __mmask16 higher = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);  // strict: a lane keeps its first
    best = _mm512_mask_mov_ps(best, higher, v);
    best_at = _mm512_mask_mov_epi32(best_at, higher, at);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    at = _mm512_add_epi32(at, _mm512_set1_epi32(16));
  }
  if (!nan) {
    const __mmask16 ties = _mm512_cmp_ps_mask(best, _mm512_set1_ps(_mm512_reduce_max_ps(best)), _CMP_EQ_OQ);
    return _mm512_mask_reduce_min_epi32(ties, best_at);
  }
#endif
  return first_nan_or_max(x, n);
}

// x (rows, n) float32 with contiguous rows -> (rows,) int64.
at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == at::kFloat && x.size(1) > 0,
              "x must be (rows, n) float32 with contiguous rows");
  TORCH_CHECK(x.size(1) < (int64_t(1) << 31), "rows of 2^31 values or more");
  const int64_t R = x.size(0), n = x.size(1), stride = x.stride(0);
  auto out = at::empty({R}, x.options().dtype(at::kLong));
  const float* data = x.data_ptr<float>();
  int64_t* result = out.data_ptr<int64_t>();
  at::parallel_for(0, R, 2, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) result[r] = row_argmax(data + r * stride, n);
  });
  return out;
}

}  // namespace
}  // namespace ember_kernels

TORCH_LIBRARY_FRAGMENT(EMBER_OPS, m) { m.def("argmax_rows(Tensor x) -> Tensor"); }

TORCH_LIBRARY_IMPL(EMBER_OPS, CPU, m) { m.impl("argmax_rows", &ember_kernels::argmax_rows); }
