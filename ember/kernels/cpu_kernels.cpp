// ember's CPU kernels: block-quantized linear layers and paged decode attention.
//
// Both compute every output element in an order fixed by the element's own position and data,
// never by how many rows, sequences or threads share a call, so their results are
// batch-invariant by construction:
// - linear: activations are quantized per row in blocks of 32; a block's dot product is exact
//   integer arithmetic (any order gives the same sum); the blocks are then summed in float32 in
//   their order along K. Threads split the output columns.
// - attention: each (sequence, KV head) reads its keys in fixed splits of SPLIT positions, each
//   split in position order; the splits are merged in order. Threads take whole splits.
//
// The AVX-512 VNNI path and the plain C++ path round differently, but each is deterministic.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define EMBER_AVX512 1
#else
#define EMBER_AVX512 0
#endif

namespace {

constexpr int64_t QBLOCK = 32;         // weights and activations are quantized in blocks of 32 along K
constexpr int64_t NBLOCK = 16;         // output columns per packed column block
constexpr int64_t Q4_BYTES = 256 + 64; // per (column block, k block): nibbles, d (fp16 x16), m (fp16 x16)
constexpr int64_t Q8_BYTES = 512 + 32; // per (column block, k block): bytes (w + 128), d (fp16 x16)

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

// ---- activations: rows quantized to int8 in blocks of 32 ---------------------------------------
// xq (M, K) int8; dx (M, K/32): each block's scale; sx (M, K/32): dx * sum(xq) of the block;
// qsum (M, K/32): sum(xq) as an integer.

template <typename T>
void quantize_rows(const T* x, int64_t M, int64_t K, int8_t* xq, float* dx, float* sx, int32_t* qsum) {
  const int64_t KB = K / QBLOCK;
  at::parallel_for(0, M, 1, [&](int64_t begin, int64_t end) {
    float values[QBLOCK];
    for (int64_t m = begin; m < end; ++m) {
      for (int64_t kb = 0; kb < KB; ++kb) {
        const T* src = x + m * K + kb * QBLOCK;
        float amax = 0.f;
        for (int64_t i = 0; i < QBLOCK; ++i) {
          values[i] = to_float<T>(src[i]);
          amax = std::max(amax, std::fabs(values[i]));
        }
        const float d = amax / 127.f;
        const float id = d > 0.f ? 1.f / d : 0.f;
        int32_t sum = 0;
        int8_t* dst = xq + m * K + kb * QBLOCK;
        for (int64_t i = 0; i < QBLOCK; ++i) {
          const int32_t q = std::clamp(int32_t(std::nearbyint(values[i] * id)), -127, 127);
          dst[i] = int8_t(q);
          sum += q;
        }
        dx[m * KB + kb] = d;
        sx[m * KB + kb] = d * float(sum);
        qsum[m * KB + kb] = sum;
      }
    }
  });
}

// ---- the linear kernel ---------------------------------------------------------------------------
// y (M, N) = x (M, K) W^T, W packed by column blocks of 16 and k blocks of 32 (see weights.py).
// Q4: w = d * q + m with q in 0..15; nibble byte p*64 + j*4 + i of a block holds q[j][4p+i] in its
// low half and q[j][4(p+4)+i] in its high half (j: column in the block).
// Q8: w = d * (b - 128); byte g*64 + j*4 + i holds b[j][4g+i].

enum class Format { Q4, Q8 };

#if EMBER_AVX512

inline __m512 load_halves(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// Rows [m0, m0 + MR) against column blocks [nb0, nb0 + NB); accumulators stay in registers.
template <Format F, int MR, int NB, typename T>
inline void tile(const uint8_t* w, int64_t KB, int64_t nb0, int64_t N, const int8_t* xq, const float* dx,
                 const float* sx, const int32_t* qsum, int64_t K, int64_t m0, T* y) {
  constexpr int64_t BYTES = F == Format::Q4 ? Q4_BYTES : Q8_BYTES;
  __m512 acc[MR][NB];
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NB; ++c) acc[r][c] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi8(0x0f);
  for (int64_t kb = 0; kb < KB; ++kb) {
    __m512i dots[MR][NB];
    for (int r = 0; r < MR; ++r)
      for (int c = 0; c < NB; ++c) dots[r][c] = _mm512_setzero_si512();
    const int32_t* xk[MR];
    for (int r = 0; r < MR; ++r) xk[r] = reinterpret_cast<const int32_t*>(xq + (m0 + r) * K + kb * QBLOCK);
    if constexpr (F == Format::Q4) {
      for (int p = 0; p < 4; ++p) {
        __m512i lo[NB], hi[NB];
        for (int c = 0; c < NB; ++c) {
          const __m512i packed = _mm512_loadu_si512(w + ((nb0 + c) * KB + kb) * BYTES + p * 64);
          lo[c] = _mm512_and_si512(packed, low);
          hi[c] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low);
        }
        for (int r = 0; r < MR; ++r) {
          const __m512i xa = _mm512_set1_epi32(xk[r][p]), xb = _mm512_set1_epi32(xk[r][p + 4]);
          for (int c = 0; c < NB; ++c) {
            dots[r][c] = _mm512_dpbusd_epi32(dots[r][c], lo[c], xa);
            dots[r][c] = _mm512_dpbusd_epi32(dots[r][c], hi[c], xb);
          }
        }
      }
    } else {
      for (int g = 0; g < 8; ++g) {
        __m512i b[NB];
        for (int c = 0; c < NB; ++c) b[c] = _mm512_loadu_si512(w + ((nb0 + c) * KB + kb) * BYTES + g * 64);
        for (int r = 0; r < MR; ++r) {
          const __m512i xa = _mm512_set1_epi32(xk[r][g]);
          for (int c = 0; c < NB; ++c) dots[r][c] = _mm512_dpbusd_epi32(dots[r][c], b[c], xa);
        }
      }
    }
    for (int c = 0; c < NB; ++c) {
      const uint8_t* block = w + ((nb0 + c) * KB + kb) * BYTES;
      const __m512 d = load_halves(block + (F == Format::Q4 ? 256 : 512));
      const __m512 mins = F == Format::Q4 ? load_halves(block + 288) : _mm512_setzero_ps();
      for (int r = 0; r < MR; ++r) {
        const int64_t row = (m0 + r) * KB + kb;
        __m512i dot = dots[r][c];
        if constexpr (F == Format::Q8) dot = _mm512_sub_epi32(dot, _mm512_set1_epi32(128 * qsum[row]));
        const __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(dx[row]));
        acc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc[r][c]);
        if constexpr (F == Format::Q4) acc[r][c] = _mm512_fmadd_ps(mins, _mm512_set1_ps(sx[row]), acc[r][c]);
      }
    }
  }
  for (int r = 0; r < MR; ++r) {
    for (int c = 0; c < NB; ++c) {
      alignas(64) float out[NBLOCK];
      _mm512_store_ps(out, acc[r][c]);
      const int64_t n0 = (nb0 + c) * NBLOCK;
      const int64_t count = std::min<int64_t>(NBLOCK, N - n0);
      T* dst = y + (m0 + r) * N + n0;
      for (int64_t j = 0; j < count; ++j) dst[j] = from_float<T>(out[j]);
    }
  }
}

// Column blocks [nb, nb + NB) against every row, four rows at a time: the blocks' weights stay
// in L1 while the rows pass.
template <Format F, int NB, typename T>
inline void column_blocks(const uint8_t* w, int64_t KB, int64_t nb, int64_t N, const int8_t* xq, const float* dx,
                          const float* sx, const int32_t* qsum, int64_t K, int64_t M, T* y) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) tile<F, 4, NB>(w, KB, nb, N, xq, dx, sx, qsum, K, m, y);
  for (; m < M; ++m) tile<F, 1, NB>(w, KB, nb, N, xq, dx, sx, qsum, K, m, y);
}

#else  // plain C++: the same sums, element by element

template <Format F, typename T>
void columns_plain(const uint8_t* w, int64_t KB, int64_t nb_begin, int64_t nb_end, int64_t N, const int8_t* xq,
                   const float* dx, const float* sx, const int32_t* qsum, int64_t K, int64_t M, T* y) {
  constexpr int64_t BYTES = F == Format::Q4 ? Q4_BYTES : Q8_BYTES;
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t nb = nb_begin; nb < nb_end; ++nb) {
      for (int64_t j = 0; j < NBLOCK && nb * NBLOCK + j < N; ++j) {
        float acc = 0.f;
        for (int64_t kb = 0; kb < KB; ++kb) {
          const uint8_t* block = w + (nb * KB + kb) * BYTES;
          const int8_t* xk = xq + m * K + kb * QBLOCK;
          int32_t dot = 0;
          for (int64_t k = 0; k < QBLOCK; ++k) {
            const int64_t g = k / 4, i = k % 4;
            int32_t q;
            if constexpr (F == Format::Q4) {
              const uint8_t byte = block[(g % 4) * 64 + j * 4 + i];
              q = g < 4 ? (byte & 0x0f) : (byte >> 4);
            } else {
              q = int32_t(block[g * 64 + j * 4 + i]) - 128;
            }
            dot += q * int32_t(xk[k]);
          }
          uint16_t d_bits, m_bits;
          std::memcpy(&d_bits, block + (F == Format::Q4 ? 256 : 512) + 2 * j, 2);
          const float d = half_to_float(d_bits);
          acc = std::fma(float(dot), d * dx[m * KB + kb], acc);
          if constexpr (F == Format::Q4) {
            std::memcpy(&m_bits, block + 288 + 2 * j, 2);
            acc = std::fma(half_to_float(m_bits), sx[m * KB + kb], acc);
          }
        }
        y[m * N + nb * NBLOCK + j] = from_float<T>(acc);
      }
    }
  }
}

#endif

template <Format F, typename T>
void linear_impl(const T* x, const uint8_t* w, int64_t M, int64_t K, int64_t N, T* y) {
  const int64_t KB = K / QBLOCK, NBS = (N + NBLOCK - 1) / NBLOCK;
  std::vector<int8_t> xq(M * K);
  std::vector<float> dx(M * KB), sx(M * KB);
  std::vector<int32_t> qsum(M * KB);
  quantize_rows<T>(x, M, K, xq.data(), dx.data(), sx.data(), qsum.data());
  // Threads split the column blocks (in pairs, the kernel's widest tile); every thread runs all rows.
  const int64_t pairs = (NBS + 1) / 2;
  at::parallel_for(0, pairs, 1, [&](int64_t begin, int64_t end) {
    const int64_t nb_begin = begin * 2, nb_end = std::min(end * 2, NBS);
#if EMBER_AVX512
    int64_t nb = nb_begin;
    for (; nb + 2 <= nb_end; nb += 2)
      column_blocks<F, 2>(w, KB, nb, N, xq.data(), dx.data(), sx.data(), qsum.data(), K, M, y);
    if (nb < nb_end) column_blocks<F, 1>(w, KB, nb, N, xq.data(), dx.data(), sx.data(), qsum.data(), K, M, y);
#else
    columns_plain<F>(w, KB, nb_begin, nb_end, N, xq.data(), dx.data(), sx.data(), qsum.data(), K, M, y);
#endif
  });
}

at::Tensor quantized_linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features, int64_t format) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous (rows, in_features) tensor");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous(), "packed weights must be contiguous bytes");
  const int64_t M = x.size(0), K = x.size(1), N = out_features;
  TORCH_CHECK(K % QBLOCK == 0, "in_features must be a multiple of 32");
  const int64_t bytes = format == 4 ? Q4_BYTES : Q8_BYTES;
  TORCH_CHECK(packed.numel() == (N + NBLOCK - 1) / NBLOCK * (K / QBLOCK) * bytes, "packed weights of the wrong size");
  auto y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  const uint8_t* w = packed.data_ptr<uint8_t>();
  if (x.scalar_type() == at::kBFloat16) {
    auto* xp = x.data_ptr<at::BFloat16>();
    auto* yp = y.data_ptr<at::BFloat16>();
    format == 4 ? linear_impl<Format::Q4>(xp, w, M, K, N, yp) : linear_impl<Format::Q8>(xp, w, M, K, N, yp);
  } else {
    TORCH_CHECK(x.scalar_type() == at::kFloat, "x must be bfloat16 or float32");
    auto* xp = x.data_ptr<float>();
    auto* yp = y.data_ptr<float>();
    format == 4 ? linear_impl<Format::Q4>(xp, w, M, K, N, yp) : linear_impl<Format::Q8>(xp, w, M, K, N, yp);
  }
  return y;
}

// ---- paged decode attention ----------------------------------------------------------------------

constexpr int64_t SPLIT = 256;  // keys per split: the unit of work and of the fixed merge order

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

template <typename T> inline void load_row(const T* src, float* dst, int64_t D) {
  for (int64_t i = 0; i < D; ++i) dst[i] = to_float<T>(src[i]);
}

#if EMBER_AVX512
template <> inline void load_row<at::BFloat16>(const at::BFloat16* src, float* dst, int64_t D) {
  int64_t i = 0;
  for (; i + 16 <= D; i += 16) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
    _mm512_storeu_ps(dst + i, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
  }
  for (; i < D; ++i) dst[i] = to_float<at::BFloat16>(src[i]);
}
#endif

inline float dot(const float* a, const float* b, int64_t D) {
#if EMBER_AVX512
  if (D % 16 == 0) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < D; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
    return _mm512_reduce_add_ps(acc);
  }
#endif
  float acc = 0.f;
  for (int64_t i = 0; i < D; ++i) acc = std::fma(a[i], b[i], acc);
  return acc;
}

inline void axpy(float a, const float* x, float* y, int64_t D) {
#if EMBER_AVX512
  if (D % 16 == 0) {
    const __m512 va = _mm512_set1_ps(a);
    for (int64_t i = 0; i < D; i += 16)
      _mm512_storeu_ps(y + i, _mm512_fmadd_ps(va, _mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i)));
    return;
  }
#endif
  for (int64_t i = 0; i < D; ++i) y[i] = std::fma(a, x[i], y[i]);
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

#if EMBER_AVX512
template <typename T> inline __m512 load16_as_float(const T* p);
template <> inline __m512 load16_as_float<float>(const float* p) { return _mm512_loadu_ps(p); }
template <> inline __m512 load16_as_float<at::BFloat16>(const at::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// C = head_dim / 16 vectors per row, known at compile time so rows and sums stay in registers.
template <typename T, int C>
void split_scores_fixed(const float* q, const T* keys, const int64_t* slots, int64_t n, int64_t G, float* scores) {
  constexpr int64_t D = 16 * C;
  for (int64_t i = 0; i < n; ++i) {
    const T* key = keys + slots[i] * D;
    __m512 k[C];
    for (int c = 0; c < C; ++c) k[c] = load16_as_float<T>(key + 16 * c);
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = q + g * D;
      __m512 sum = _mm512_mul_ps(_mm512_loadu_ps(qg), k[0]);
      for (int c = 1; c < C; ++c) sum = _mm512_fmadd_ps(_mm512_loadu_ps(qg + 16 * c), k[c], sum);
      scores[g * SPLIT + i] = _mm512_reduce_add_ps(sum);
    }
  }
}

template <typename T, int C, int HEADS>
void split_values_fixed(const float* probs, const T* vals, const int64_t* slots, int64_t n, int64_t g0, float* acc) {
  constexpr int64_t D = 16 * C;
  __m512 sums[HEADS][C];
  for (int h = 0; h < HEADS; ++h)
    for (int c = 0; c < C; ++c) sums[h][c] = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; ++i) {
    const T* value = vals + slots[i] * D;
    __m512 v[C];
    for (int c = 0; c < C; ++c) v[c] = load16_as_float<T>(value + 16 * c);
    for (int h = 0; h < HEADS; ++h) {
      const __m512 p = _mm512_set1_ps(probs[(g0 + h) * SPLIT + i]);
      for (int c = 0; c < C; ++c) sums[h][c] = _mm512_fmadd_ps(p, v[c], sums[h][c]);
    }
  }
  for (int h = 0; h < HEADS; ++h)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc + (g0 + h) * D + 16 * c, sums[h][c]);
}

// Heads in passes of up to 24 / C register rows; the pass sizes depend only on G and D.
template <typename T, int C>
void split_values_passes(const float* probs, const T* vals, const int64_t* slots, int64_t n, int64_t G, float* acc) {
  constexpr int64_t PER_PASS = 24 / C;
  int64_t g0 = 0;
  for (; g0 + PER_PASS <= G; g0 += PER_PASS) split_values_fixed<T, C, PER_PASS>(probs, vals, slots, n, g0, acc);
  for (; g0 < G; ++g0) split_values_fixed<T, C, 1>(probs, vals, slots, n, g0, acc);
}
#endif

// scores[g * SPLIT + i] = q_g . k(slots[i]) for the n keys of a split, every head g of the group.
template <typename T>
void split_scores(const float* q, const T* keys, const int64_t* slots, int64_t n, int64_t G, int64_t D,
                  float* scores, float* row) {
#if EMBER_AVX512
  if (D == 64) return split_scores_fixed<T, 4>(q, keys, slots, n, G, scores);
  if (D == 128) return split_scores_fixed<T, 8>(q, keys, slots, n, G, scores);
#endif
  for (int64_t i = 0; i < n; ++i) {
    load_row(keys + slots[i] * D, row, D);
    for (int64_t g = 0; g < G; ++g) scores[g * SPLIT + i] = dot(q + g * D, row, D);
  }
}

// acc[g] = sum over the split's keys, in order, of p_g(i) v(slots[i]).
template <typename T>
void split_values(const float* probs, const T* vals, const int64_t* slots, int64_t n, int64_t G, int64_t D,
                  float* acc, float* row) {
#if EMBER_AVX512
  if (D == 64) return split_values_passes<T, 4>(probs, vals, slots, n, G, acc);
  if (D == 128) return split_values_passes<T, 8>(probs, vals, slots, n, G, acc);
#endif
  std::fill(acc, acc + G * D, 0.f);
  for (int64_t i = 0; i < n; ++i) {
    load_row(vals + slots[i] * D, row, D);
    for (int64_t g = 0; g < G; ++g) axpy(probs[g * SPLIT + i], row, acc + g * D, D);
  }
}

template <typename T>
void decode_attention_impl(const T* q, int64_t q_stride, const T* k_cache, const T* v_cache, int64_t kv_head_stride,
                           const int32_t* block_table, int64_t table_width, const int32_t* lengths, int64_t B,
                           int64_t H, int64_t KVH, int64_t D, int64_t block_size, float scale, T* out) {
  const int64_t G = H / KVH;
  int64_t max_splits = 0;
  std::vector<int64_t> first_item(B + 1, 0);  // items of sequence b: [first_item[b], first_item[b + 1])
  for (int64_t b = 0; b < B; ++b) {
    const int64_t splits = (lengths[b] + SPLIT - 1) / SPLIT;
    max_splits = std::max(max_splits, splits);
    first_item[b + 1] = first_item[b] + splits * KVH;
  }
  const int64_t items = first_item[B];
  // Per item (sequence, KV head, split) and query head of the group: max, sum, weighted values.
  std::vector<float> maxes(items * G), sums(items * G), values(items * G * D);
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * D), row(D), scores(G * SPLIT);
    std::vector<int64_t> slots(SPLIT);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = std::upper_bound(first_item.begin(), first_item.end(), item) - first_item.begin() - 1;
      const int64_t local = item - first_item[b];
      const int64_t kvh = local % KVH, split = local / KVH;
      const int64_t lo = split * SPLIT, hi = std::min<int64_t>(lengths[b], lo + SPLIT), n = hi - lo;
      for (int64_t g = 0; g < G; ++g) {
        load_row(q + b * q_stride + (kvh * G + g) * D, qf.data() + g * D, D);
        for (int64_t i = 0; i < D; ++i) qf[g * D + i] *= scale;
      }
      const T* keys = k_cache + kvh * kv_head_stride;
      const T* vals = v_cache + kvh * kv_head_stride;
      const int32_t* table = block_table + b * table_width;
      // Key positions [lo, hi) lie in whole runs of a block's slots.
      for (int64_t t = lo; t < hi;) {
        const int64_t offset = t % block_size, run = std::min(hi - t, block_size - offset);
        const int64_t base = int64_t(table[t / block_size]) * block_size + offset;
        for (int64_t i = 0; i < run; ++i) slots[t - lo + i] = base + i;
        t += run;
      }
      float* acc = values.data() + item * G * D;
      split_scores(qf.data(), keys, slots.data(), n, G, D, scores.data(), row.data());
      for (int64_t g = 0; g < G; ++g) {
        float* s = scores.data() + g * SPLIT;
        const float max = *std::max_element(s, s + n);
        maxes[item * G + g] = max;
        sums[item * G + g] = exp_and_sum(s, n, max);
      }
      split_values(scores.data(), vals, slots.data(), n, G, D, acc, row.data());
    }
  });
  // Merge each (sequence, KV head)'s splits in order.
  at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> merged(D);
    for (int64_t pair = begin; pair < end; ++pair) {
      const int64_t b = pair / KVH, kvh = pair % KVH;
      const int64_t splits = (first_item[b + 1] - first_item[b]) / KVH;
      for (int64_t g = 0; g < G; ++g) {
        float max = -std::numeric_limits<float>::infinity();
        for (int64_t s = 0; s < splits; ++s)
          max = std::max(max, maxes[(first_item[b] + s * KVH + kvh) * G + g]);
        float total = 0.f;
        std::fill(merged.begin(), merged.end(), 0.f);
        for (int64_t s = 0; s < splits; ++s) {
          const int64_t at = (first_item[b] + s * KVH + kvh) * G + g;
          const float weight = std::exp(maxes[at] - max);
          total = std::fma(weight, sums[at], total);
          axpy(weight, values.data() + at * D, merged.data(), D);
        }
        T* dst = out + (b * H + kvh * G + g) * D;
        const float inv = 1.f / total;
        for (int64_t i = 0; i < D; ++i) dst[i] = from_float<T>(merged[i] * inv);
      }
    }
  });
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_table, const at::Tensor& lengths, int64_t block_size,
                                  double scale) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2),
              "q must be (sequences, heads, head_dim) with contiguous heads");
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.stride(2) == 1 && k_cache.stride(1) == k_cache.size(2),
              "k_cache must be (kv_heads, slots, head_dim) with contiguous slots");
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes() && v_cache.strides() == k_cache.strides(), "v_cache unlike k_cache");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && block_table.is_contiguous() && block_table.dim() == 2,
              "block_table must be contiguous int32 (sequences, blocks)");
  TORCH_CHECK(lengths.scalar_type() == at::kInt && lengths.is_contiguous(), "lengths must be contiguous int32");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type(), "q and the cache must share a dtype");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), KVH = k_cache.size(0);
  TORCH_CHECK(H % KVH == 0 && k_cache.size(2) == D, "heads must be a multiple of kv_heads");
  TORCH_CHECK(block_table.size(0) == B && lengths.numel() == B, "one block table row and length per sequence");
  auto out = at::empty({B, H, D}, q.options());
  if (B == 0) return out;
  if (q.scalar_type() == at::kBFloat16) {
    decode_attention_impl<at::BFloat16>(q.data_ptr<at::BFloat16>(), q.stride(0), k_cache.data_ptr<at::BFloat16>(),
                                        v_cache.data_ptr<at::BFloat16>(), k_cache.stride(0),
                                        block_table.data_ptr<int32_t>(), block_table.size(1),
                                        lengths.data_ptr<int32_t>(), B, H, KVH, D, block_size, float(scale),
                                        out.data_ptr<at::BFloat16>());
  } else {
    TORCH_CHECK(q.scalar_type() == at::kFloat, "q must be bfloat16 or float32");
    decode_attention_impl<float>(q.data_ptr<float>(), q.stride(0), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(),
                                 k_cache.stride(0), block_table.data_ptr<int32_t>(), block_table.size(1),
                                 lengths.data_ptr<int32_t>(), B, H, KVH, D, block_size, float(scale),
                                 out.data_ptr<float>());
  }
  return out;
}

// ---- row-wise ops of a decoder layer ---------------------------------------------------------------
// Each row is computed alone, lanes then across lanes, so rows never depend on one another.

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
#endif
  for (; i < D; ++i) total = std::fma(x[i], x[i], total);
  return total;
}

// out = weight * to_T(x / rms(x)), transformers' order (normalise in float32, round, then scale).
template <typename T>
inline void norm_row(const float* x, const T* weight, int64_t D, double eps, T* out) {
  const float inv = 1.f / std::sqrt(sum_of_squares(x, D) / float(D) + float(eps));
  for (int64_t i = 0; i < D; ++i)
    out[i] = from_float<T>(to_float<T>(weight[i]) * to_float<T>(from_float<T>(x[i] * inv)));
}

template <typename F> void dispatch_float_or_bf16(at::ScalarType dtype, F&& body) {
  if (dtype == at::kBFloat16) {
    body(at::BFloat16());
  } else {
    TORCH_CHECK(dtype == at::kFloat, "ember's CPU kernels take bfloat16 or float32");
    body(float());
  }
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
          for (int64_t i = 0; i < D; ++i) {
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
      for (int64_t t = begin; t < end; ++t) {
        for (int64_t i = 0; i < half; ++i) {
          c[i] = to_float<T_>(cos.data_ptr<T_>()[t * row_stride + i]);
          s[i] = to_float<T_>(sin.data_ptr<T_>()[t * row_stride + i]);
        }
        for (int64_t h = 0; h < H; ++h) {
          T_* row = x.data_ptr<T_>() + t * x.stride(0) + h * D;
          for (int64_t i = 0; i < half; ++i) {
            const float x1 = to_float<T_>(row[i]), x2 = to_float<T_>(row[i + half]);
            row[i] = from_float<T_>(std::fma(x1, c[i], -x2 * s[i]));
            row[i + half] = from_float<T_>(std::fma(x2, c[i], x1 * s[i]));
          }
        }
      }
    });
  });
}

// One token row of a fused qkv projection (T, (H + 2 KVH) D): rotate its q and k heads in place,
// as rotary_ does, and write its k and v heads into the cache (KVH, slots, D) at slots[t].
void rotary_store_(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache,
                   at::Tensor& v_cache, const at::Tensor& slots, int64_t heads, int64_t kv_heads) {
  const int64_t T = qkv.size(0), D = k_cache.size(2), half = D / 2, width = (heads + 2 * kv_heads) * D;
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) == width && qkv.stride(1) == 1, "qkv must be (T, (H + 2 KVH) D) rows");
  TORCH_CHECK(k_cache.size(0) == kv_heads && k_cache.stride(2) == 1 && k_cache.stride(1) == D &&
              v_cache.sizes() == k_cache.sizes() && v_cache.strides() == k_cache.strides() &&
              k_cache.scalar_type() == qkv.scalar_type(), "caches must be (KVH, slots, D) in qkv's dtype");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == T, "one int64 slot per row");
  TORCH_CHECK(cos.size(0) == T && cos.size(-1) == half && cos.stride(-1) == 1 && sin.strides() == cos.strides() &&
              sin.sizes() == cos.sizes() && cos.scalar_type() == qkv.scalar_type(), "cos and sin: (T, D / 2) rows");
  const int64_t row_stride = cos.stride(0);
  dispatch_float_or_bf16(qkv.scalar_type(), [&](auto tag) {
    using T_ = decltype(tag);
    at::parallel_for(0, T, 8, [&](int64_t begin, int64_t end) {
      std::vector<float> c(half), s(half);
      for (int64_t t = begin; t < end; ++t) {
        for (int64_t i = 0; i < half; ++i) {
          c[i] = to_float<T_>(cos.data_ptr<T_>()[t * row_stride + i]);
          s[i] = to_float<T_>(sin.data_ptr<T_>()[t * row_stride + i]);
        }
        T_* row = qkv.data_ptr<T_>() + t * qkv.stride(0);
        for (int64_t h = 0; h < heads + kv_heads; ++h) {
          T_* x = row + h * D;
          for (int64_t i = 0; i < half; ++i) {
            const float x1 = to_float<T_>(x[i]), x2 = to_float<T_>(x[i + half]);
            x[i] = from_float<T_>(std::fma(x1, c[i], -x2 * s[i]));
            x[i + half] = from_float<T_>(std::fma(x2, c[i], x1 * s[i]));
          }
        }
        const int64_t slot = slots.data_ptr<int64_t>()[t];
        for (int64_t h = 0; h < kv_heads; ++h) {
          std::memcpy(k_cache.data_ptr<T_>() + h * k_cache.stride(0) + slot * D, row + (heads + h) * D, D * sizeof(T_));
          std::memcpy(v_cache.data_ptr<T_>() + h * v_cache.stride(0) + slot * D, row + (heads + kv_heads + h) * D,
                      D * sizeof(T_));
        }
      }
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
        for (int64_t i = 0; i < I; ++i) {
          const float sigmoid = gate[i] >= 0.f ? 1.f / (1.f + e[i]) : e[i] / (1.f + e[i]);
          o[i] = from_float<T_>(to_float<T_>(from_float<T_>(gate[i] * sigmoid)) * to_float<T_>(u[i]));
        }
      }
    });
  });
  return out;
}

int64_t vector_path() { return EMBER_AVX512; }

}  // namespace

TORCH_LIBRARY(ember, m) {
  m.def("quantized_linear(Tensor x, Tensor packed, int out_features, int format) -> Tensor");
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, Tensor lengths, "
        "int block_size, float scale) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor addend, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("rotary_(Tensor(a!) x, Tensor cos, Tensor sin) -> ()");
  m.def("rotary_store_(Tensor(a!) qkv, Tensor cos, Tensor sin, Tensor(b!) k_cache, Tensor(c!) v_cache, Tensor slots, "
        "int heads, int kv_heads) -> ()");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("vector_path() -> int", &vector_path);
}

TORCH_LIBRARY_IMPL(ember, CPU, m) {
  m.impl("quantized_linear", &quantized_linear);
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("rotary_", &rotary_);
  m.impl("rotary_store_", &rotary_store_);
  m.impl("silu_mul", &silu_mul);
}
