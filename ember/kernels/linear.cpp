// Block-quantized linear layers: y = x W^T with W in ember's 4- or 8-bit blocks (models/weights.py).
//
// Block formats (the `format` argument, BlockWeights.format in models/weights.py), a block being
// 32 weights of one column along K:
//   Q4  (4):  w = d * q + m, q in 0..15 (GGUF's Q4_0 and Q4_1 exactly)
//   Q8  (8):  w = d * (b - 128) (Q8_0 and Q5_0 exactly)
//   Q4S (20): w = d * s * q + m * t with integer steps s, t in 0..255 (Q4_K exactly: d and -dmin
//             of its super-block, its sub-block's 6-bit scale and minimum)
//   Q8S (24): w = d * s_h * (b - 128), a signed step s_h for each half h of 16 (Q6_K exactly)
//   Q8M (28): w = d * s * q + m * t, q in 0..127 in a byte (Q5_K and Q5_1 exactly)
//   Q8SM (40): w = d * s_h * (b - 128) + m * t: any of the others exactly (a fused projection's
//             parts in formats of both families, as a Q4_K_M file's Q4_K queries beside Q6_K values)
//   Q4K (52): Q4S whose d and m are the same for 8 blocks in a row (a Q4_K super-block of 256),
//             held once before the 8 (4.625 bits a weight against Q4S's 5.5 and Q4_K's 4.5)
//   Q5K (60): Q8M whose codes are 5 bits (q in 0..31) and whose d and m are the same for 8 blocks
//             in a row (a Q5_K super-block), held once before the 8: Q5_K exactly in 5.625 bits
//   Q6 (72), Q6S (88), Q6M (92), Q6SM (104): Q8, Q8S, Q8M and Q8SM (the format + 64) whose codes
//             all lie within 64 of each other (b - 96 in 0..63; Q6M's q in 0..63) in 6 bits, the
//             same arithmetic: Q5_0, Q6_K and Q5_1 exactly in 6.5, 7 and 7.5 bits a weight
//   Q6K (120): Q6S whose d is the same for 8 blocks in a row (a Q6_K super-block), held once
//             before the 8: Q6_K exactly in 6.5625 bits, the file's own
// d, m are float16; d * s and m * t are exact in float32, so a step costs no rounding.
//
// Activations are quantized per row in blocks of 32; a block's dot product is exact integer
// arithmetic (any order gives the same sum); the blocks are then summed in float32 in their order
// along K. Threads split the output columns. So a row's result never depends on how many rows,
// or which, share the call: batch-invariant by construction.
//
// quantized_linear_accumulate_ continues float32 sums that another call began: a sum over K cut
// at a block edge, its first part computed from zero and the rest continued from it, gives the
// bits of one call over the whole of K (tensor parallelism's row-parallel layers, whose ranks hold
// consecutive slices of K).
//
// The formats' bytes and traits are in linear_formats.h, the tiles of each vector path in
// linear_avx512.h and linear_avx2.h, the threads' split of the columns in linear_column_range.h,
// compiled a few formats a unit (linear_columns_*.cpp, side by side in a build); this file
// quantizes the rows, picks the format and holds the ops.

#include "common.h"

#include <ATen/ATen.h>
#include <torch/library.h>

#include <memory>

namespace ember_kernels {
namespace EMBER_LINEAR {
#include "linear_formats.h"
#include "linear_columns.h"
}  // namespace EMBER_LINEAR

namespace {

using namespace EMBER_LINEAR;

// ---- activations: rows quantized to int8 in blocks of 32 ---------------------------------------
// xq (M, K) int8; dx (M, K/32): each block's scale; sx (M, K/32): dx * sum(xq) of the block;
// qsum (M, K/32): sum(xq) as an integer; qlow (M, K/32): the sum of its first half's codes.

// One block of 32 values to int8 with scale d = max|x| / 127; returns d, the sum of the int8s and
// the sum of the first 16.
template <typename T>
inline float quantize_block(const T* src, int8_t* dst, int32_t& sum, int32_t& first_half) {
#if EMBER_AVX512
  const __m512 v0 = load16(src), v1 = load16(src + 16);
  const float d = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1))) / 127.f;
  const __m512 id = _mm512_set1_ps(d > 0.f ? 1.f / d : 0.f);
  const __m512i low = _mm512_set1_epi32(-127), high = _mm512_set1_epi32(127);
  // cvtps rounds to nearest even, as nearbyint does in the default rounding mode
  const __m512i q0 = _mm512_max_epi32(low, _mm512_min_epi32(high, _mm512_cvtps_epi32(_mm512_mul_ps(v0, id))));
  const __m512i q1 = _mm512_max_epi32(low, _mm512_min_epi32(high, _mm512_cvtps_epi32(_mm512_mul_ps(v1, id))));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm512_cvtepi32_epi8(q0));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 16), _mm512_cvtepi32_epi8(q1));
  first_half = _mm512_reduce_add_epi32(q0);
  sum = first_half + _mm512_reduce_add_epi32(q1);
  return d;
#elif EMBER_AVX2
  __m256 v[4];
  __m256 amax = _mm256_setzero_ps();
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  for (int i = 0; i < 4; ++i) {
    v[i] = load8(src + 8 * i);
    amax = _mm256_max_ps(amax, _mm256_and_ps(v[i], magnitude));
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  const float d = _mm_cvtss_f32(m4) / 127.f;
  const __m256 id = _mm256_set1_ps(d > 0.f ? 1.f / d : 0.f);
  const __m256i low = _mm256_set1_epi32(-127), high = _mm256_set1_epi32(127);
  __m256i q[4];
  __m256i total = _mm256_setzero_si256();
  for (int i = 0; i < 4; ++i) {  // cvtps rounds to nearest even, as nearbyint does
    q[i] = _mm256_max_epi32(low, _mm256_min_epi32(high, _mm256_cvtps_epi32(_mm256_mul_ps(v[i], id))));
    total = _mm256_add_epi32(total, q[i]);
  }
  // packs works within 128-bit lanes: the permute puts the four groups of four back in order
  const __m256i bytes = _mm256_permutevar8x32_epi32(
      _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3])),
      _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), bytes);
  const auto lanes_sum = [](__m256i v) {
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(1, 0, 3, 2)));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm_cvtsi128_si32(s4);
  };
  sum = lanes_sum(total);
  first_half = lanes_sum(_mm256_add_epi32(q[0], q[1]));
  return d;
#else
  float values[QBLOCK];
  float amax = 0.f;
  for (int64_t i = 0; i < QBLOCK; ++i) {
    values[i] = to_float<T>(src[i]);
    amax = std::max(amax, std::fabs(values[i]));
  }
  const float d = amax / 127.f;
  const float id = d > 0.f ? 1.f / d : 0.f;
  sum = 0;
  for (int64_t i = 0; i < QBLOCK; ++i) {
    const int32_t q = std::clamp(int32_t(std::nearbyint(values[i] * id)), -127, 127);
    dst[i] = int8_t(q);
    sum += q;
    if (i == HALF - 1) first_half = sum;
  }
  return d;
#endif
}

#if EMBER_AVX512
// Lane b: the largest lane of v[b], for 16 vectors (a transposing tree: pairs of vectors, then
// pairs of pairs, interleaved a step at a time). A maximum's order never changes it.
inline __m512 lane_maxima(const __m512* v) {
  __m512 t[8], u[4], w[2];
  for (int i = 0; i < 8; ++i)  // each 128-bit lane: v[2i]'s, v[2i+1]'s, v[2i]'s, v[2i+1]'s
    t[i] = _mm512_max_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int j = 0; j < 4; ++j) {  // each 128-bit lane: v[4j]'s .. v[4j+3]'s
    const __m512d a = _mm512_castps_pd(t[2 * j]), b = _mm512_castps_pd(t[2 * j + 1]);
    u[j] = _mm512_max_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  for (int k = 0; k < 2; ++k)  // 128-bit lanes of u[2k] and u[2k+1] in pairs
    w[k] = _mm512_max_ps(_mm512_shuffle_f32x4(u[2 * k], u[2 * k + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(u[2 * k], u[2 * k + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_max_ps(_mm512_shuffle_f32x4(w[0], w[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(w[0], w[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// Blocks [0, n), n <= 16, of a row: quantize_block's d, codes and sums, sixteen blocks at once so
// that their maxima and divisions are taken together rather than block by block (the same IEEE
// operations on the same values, so the same bits).
template <typename T>
inline void quantize_blocks16(const T* src, int64_t n, int8_t* dst, float* dx, float* sx, int32_t* qsum,
                              int32_t* qlow) {
  __m512 largest[16];
  for (int64_t b = 0; b < 16; ++b)
    largest[b] = b < n ? _mm512_max_ps(_mm512_abs_ps(load16(src + b * QBLOCK)),
                                       _mm512_abs_ps(load16(src + b * QBLOCK + 16)))
                       : _mm512_setzero_ps();
  const __m512 d = _mm512_div_ps(lane_maxima(largest), _mm512_set1_ps(127.f));
  const __m512 id = _mm512_maskz_div_ps(_mm512_cmp_ps_mask(d, _mm512_setzero_ps(), _CMP_GT_OQ), _mm512_set1_ps(1.f), d);
  alignas(64) float ds[16], ids[16];
  _mm512_store_ps(ds, d);
  _mm512_store_ps(ids, id);
  // Codes two blocks (64 bytes) at a time (past the last block, zeros), and their sums from the
  // bytes: psadbw adds each run of 8 (each code + 128) into a 64-bit lane, two lanes a half block.
  alignas(64) uint64_t runs[8][8];
  const __m512i low = _mm512_set1_epi32(-127), high = _mm512_set1_epi32(127);
  for (int64_t b = 0; b < n; b += 2) {
    __m512i codes = _mm512_setzero_si512();
    for (int h = 0; h < 4; ++h) {
      const int64_t blk = b + h / 2;
      if (blk == n) break;
      const __m512 v = load16(src + blk * QBLOCK + 16 * (h % 2));
      // cvtps rounds to nearest even, as nearbyint does in the default rounding mode
      const __m512 scaled = _mm512_mul_ps(v, _mm512_set1_ps(ids[blk]));
      const __m512i q = _mm512_max_epi32(low, _mm512_min_epi32(high, _mm512_cvtps_epi32(scaled)));
      codes = _mm512_inserti32x4(codes, _mm512_cvtepi32_epi8(q), h);
    }
    _mm512_mask_storeu_epi8(dst + b * QBLOCK, b + 1 < n ? ~__mmask64(0) : __mmask64(0xffffffffu), codes);
    _mm512_store_si512(runs[b / 2], _mm512_sad_epu8(_mm512_xor_si512(codes, _mm512_set1_epi8(char(0x80))),
                                                    _mm512_setzero_si512()));
  }
  for (int64_t b = 0; b < n; ++b) {
    const uint64_t* r = runs[b / 2] + 4 * (b % 2);
    const int32_t first_half = int32_t(r[0] + r[1]) - HALF * 128, sum = first_half + int32_t(r[2] + r[3]) - HALF * 128;
    dx[b] = ds[b];
    sx[b] = ds[b] * float(sum);
    qsum[b] = sum;
    qlow[b] = first_half;
  }
}
#endif

template <typename T>
void quantize_rows(const T* x, int64_t M, int64_t K, int8_t* xq, float* dx, float* sx, int32_t* qsum,
                   int32_t* qlow) {
  const int64_t KB = K / QBLOCK;
  at::parallel_for(0, M, 1, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
#if EMBER_AVX512
      for (int64_t kb = 0; kb < KB; kb += 16)
        quantize_blocks16<T>(x + m * K + kb * QBLOCK, std::min<int64_t>(16, KB - kb), xq + m * K + kb * QBLOCK,
                             dx + m * KB + kb, sx + m * KB + kb, qsum + m * KB + kb, qlow + m * KB + kb);
      continue;
#endif
      for (int64_t kb = 0; kb < KB; ++kb) {
        int32_t sum, first_half;
        const float d = quantize_block<T>(x + m * K + kb * QBLOCK, xq + m * K + kb * QBLOCK, sum, first_half);
        dx[m * KB + kb] = d;
        sx[m * KB + kb] = d * float(sum);
        qsum[m * KB + kb] = sum;
        qlow[m * KB + kb] = first_half;
      }
    }
  });
}

// x (M, K)'s rows quantized in blocks of 32 (quantize_rows), once for every weight that reads them.
struct QuantizedInput {
  // quantize_rows writes every entry before any is read, so nothing is zeroed first (a prompt
  // chunk's codes are a megabyte a projection)
  std::unique_ptr<int8_t[]> codes;
  std::unique_ptr<float[]> scales;
  std::unique_ptr<int32_t[]> sums;
  QuantizedRows rows;

  template <typename T>
  QuantizedInput(const T* x, int64_t M, int64_t K)
      : codes(new int8_t[M * K]), scales(new float[2 * M * (K / QBLOCK)]), sums(new int32_t[2 * M * (K / QBLOCK)]) {
    const int64_t KB = K / QBLOCK;
    float *const dx = scales.get(), *const sx = dx + M * KB;
    int32_t *const qsum = sums.get(), *const qlow = qsum + M * KB;
    quantize_rows<T>(x, M, K, codes.get(), dx, sx, qsum, qlow);
    rows = {M, K, KB, codes.get(), dx, sx, qsum, qlow};
  }
};

void check_packed(const at::Tensor& packed, int64_t K, int64_t N, int64_t format) {
  const int64_t bytes = column_block_bytes(format, K / QBLOCK);
  TORCH_CHECK(bytes > 0, "unknown block format ", format, " (or in_features not in its super-blocks)");
  TORCH_CHECK(packed.numel() == (N + NBLOCK - 1) / NBLOCK * bytes, "packed weights of the wrong size");
}

// y (M, sum of out_features) = x W^T for W the parts stacked along the output, each in its own
// format (a fused projection whose parts a file holds in different types): x quantized once, each
// part's columns computed into y in place, its threads splitting that part's column blocks. Every
// part but the last is a whole number of column blocks wide, so each column block lies in one
// part; a part's columns are the bits its own call gives.
at::Tensor quantized_linear_parts(const at::Tensor& x, at::TensorList packed, at::IntArrayRef out_features,
                                  at::IntArrayRef formats) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous (rows, in_features) tensor");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, "x must be bfloat16 or float32");
  const size_t P = packed.size();
  TORCH_CHECK(P > 0 && out_features.size() == P && formats.size() == P, "one size and one format for each part");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K % QBLOCK == 0, "in_features must be a multiple of 32");
  int64_t N = 0;
  for (size_t p = 0; p < P; ++p) {
    TORCH_CHECK(packed[p].scalar_type() == at::kByte && packed[p].is_contiguous(),
                "packed weights must be contiguous bytes");
    TORCH_CHECK(p + 1 == P || out_features[p] % NBLOCK == 0, "every part but the last a multiple of 16 wide");
    check_packed(packed[p], K, out_features[p], formats[p]);
    N += out_features[p];
  }
  auto y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  dispatch_float_or_bf16(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    const QuantizedInput input(static_cast<const T*>(x.data_ptr()), M, K);
    T* yp = static_cast<T*>(y.data_ptr());
    int64_t nb = 0;
    for (size_t p = 0; p < P; ++p) {
      const int64_t count = (out_features[p] + NBLOCK - 1) / NBLOCK;
      with_format(formats[p], [&](auto f) {
        column_range<decltype(f)::value>(input.rows, packed[p].data_ptr<uint8_t>(), nb, count, N, yp, nullptr);
      });
      nb += count;
    }
  });
  return y;
}

at::Tensor quantized_linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features, int64_t format) {
  return quantized_linear_parts(x, packed, out_features, format);
}

// sums (M, N) float32 += x (M, K) float32 W^T, in place, continuing each sum over K's blocks in
// their order (see the top of this file).
void quantized_linear_accumulate_(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                                  int64_t format, const at::Tensor& sums) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat,
              "x must be a contiguous (rows, in_features) float32 tensor");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous(), "packed weights must be contiguous bytes");
  const int64_t M = x.size(0), K = x.size(1), N = out_features;
  TORCH_CHECK(K % QBLOCK == 0, "in_features must be a multiple of 32");
  check_packed(packed, K, N, format);
  TORCH_CHECK(sums.scalar_type() == at::kFloat && sums.is_contiguous() && sums.dim() == 2 && sums.size(0) == M &&
                  sums.size(1) == N, "sums must be a contiguous (rows, out_features) float32 tensor");
  if (M == 0) return;
  const QuantizedInput input(x.data_ptr<float>(), M, K);
  float* sp = sums.data_ptr<float>();
  const int64_t count = (N + NBLOCK - 1) / NBLOCK;
  with_format(format, [&](auto f) {
    column_range<decltype(f)::value>(input.rows, packed.data_ptr<uint8_t>(), 0, count, N, sp, sp);
  });
}

// Rows `ids` of a packed weight, dequantized: embedding lookups from a tied LM head. A code times
// its scale (and a minimum) are computed as QuantBlocks.dequantize computes them: its bits.
template <Format F, typename T>
void dequantize_row(const uint8_t* column_block, int64_t j, int64_t KB, T* out) {
  for (int64_t kb = 0; kb < KB; ++kb, out += QBLOCK) {
    const uint8_t* block = column_block + offsets<F>(kb).codes;
    const float m = HAS_MIN<F> ? min_at<F>(column_block, kb, j) : 0.f;
    for (int64_t k = 0; k < QBLOCK; ++k) {
      const float w = float(code_at<F>(block, j, k)) * scale_at<F>(column_block, kb, j, k / HALF);
      out[k] = from_float<T>(HAS_MIN<F> ? w + m : w);
    }
  }
}

// ids (T,) int64 -> (T, in_features) in `dtype` (bfloat16 or float32).
at::Tensor block_rows(const at::Tensor& packed, const at::Tensor& ids, int64_t in_features, int64_t format,
                      at::ScalarType dtype) {
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.dim() == 3,
              "packed weights must be contiguous (column blocks, k blocks or super-blocks, bytes)");
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong, "ids must be (T,) int64");
  TORCH_CHECK(in_features % QBLOCK == 0, "in_features must be a multiple of 32");
  const int64_t KB = in_features / QBLOCK, bytes = column_block_bytes(format, KB);
  TORCH_CHECK(bytes > 0, "unknown block format ", format, " (or in_features not in its super-blocks)");
  TORCH_CHECK(packed.size(1) * packed.size(2) == bytes, "packed weights of another shape or format");
  auto out = at::empty({ids.size(0), in_features}, packed.options().dtype(dtype));
  const auto index = ids.contiguous();
  const int64_t* id = index.data_ptr<int64_t>();
  const int64_t rows = packed.size(0) * NBLOCK;
  for (int64_t t = 0; t < ids.size(0); ++t) TORCH_CHECK(0 <= id[t] && id[t] < rows, "an id outside the table");
  const uint8_t* w = packed.data_ptr<uint8_t>();
  dispatch_float_or_bf16(dtype, [&](auto tag) {
    using T = decltype(tag);
    T* o = static_cast<T*>(out.data_ptr());
    for (int64_t t = 0; t < ids.size(0); ++t) {
      const uint8_t* column_block = w + (id[t] / NBLOCK) * bytes;
      T* row = o + t * in_features;
      with_format(format, [&](auto f) { dequantize_row<decltype(f)::value>(column_block, id[t] % NBLOCK, KB, row); });
    }
  });
  return out;
}

}  // namespace

// The vector registers' width in bits the kernels were built for: 512, 256, or 0 (plain C++).
int64_t vector_bits() { return EMBER_AVX512 ? 512 : EMBER_AVX2 ? 256 : 0; }

// Whether the AVX2 path's linear layers take AVX-VNNI's byte dot products (linear_avx2.h).
bool avx_vnni() { return EMBER_AVX_VNNI; }

// Whether linear layers of many rows take AMX tiles here (linear_amx.h): built for them, and the
// processor grants them.
bool linear_tiles() {
#if EMBER_AMX_INT8
  return amx::granted(false, true);
#else
  return false;
#endif
}

}  // namespace ember_kernels

TORCH_LIBRARY_FRAGMENT(EMBER_OPS, m) {
  m.def("quantized_linear(Tensor x, Tensor packed, int out_features, int format) -> Tensor");
  m.def("quantized_linear_parts(Tensor x, Tensor[] packed, int[] out_features, int[] formats) -> Tensor");
  m.def("quantized_linear_accumulate_(Tensor x, Tensor packed, int out_features, int format, Tensor(a!) sums) -> ()");
  m.def("vector_bits() -> int", &ember_kernels::vector_bits);
  m.def("avx_vnni() -> bool", &ember_kernels::avx_vnni);
  m.def("linear_tiles() -> bool", &ember_kernels::linear_tiles);
  m.def("block_rows(Tensor packed, Tensor ids, int in_features, int format, ScalarType dtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(EMBER_OPS, CPU, m) {
  m.impl("quantized_linear", &ember_kernels::quantized_linear);
  m.impl("quantized_linear_parts", &ember_kernels::quantized_linear_parts);
  m.impl("quantized_linear_accumulate_", &ember_kernels::quantized_linear_accumulate_);
  m.impl("block_rows", &ember_kernels::block_rows);
}
