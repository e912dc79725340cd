// The linear kernel's tiles on AVX2 (with FMA and F16C): processors without AVX-512. Part of
// linear_column_range.h, which includes it inside its namespace after the formats
// (linear_formats.h) and prefetch_share.

#pragma once

inline __m256 load_halves(const uint8_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// A six-bit format's codes of group g for the 8 columns at `half` (0 or 32) of each 64 bytes, as bytes 0 to 63.
template <int g> inline __m256i six_bit_codes(const uint8_t* block, int64_t half) {
  const __m256i nibbles = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + (g % 4) * 64 + half));
  const __m256i low = _mm256_and_si256(g < 4 ? nibbles : _mm256_srli_epi16(nibbles, 4), _mm256_set1_epi8(0x0f));
  const __m256i high = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 256 + (g % 4 / 2) * 64 + half));
  constexpr int shift = high_bits_shift(g);  // the group's 2 bits, moved to bits 4 and 5
  const __m256i moved = shift <= 4 ? _mm256_slli_epi16(high, 4 - shift) : _mm256_srli_epi16(high, shift - 4);
  return _mm256_or_si256(low, _mm256_and_si256(moved, _mm256_set1_epi8(0x30)));
}
inline __m256i six_bit_codes(const uint8_t* block, int g, int64_t half) {  // g known once the loop unrolls
  switch (g) {
    case 0: return six_bit_codes<0>(block, half);
    case 1: return six_bit_codes<1>(block, half);
    case 2: return six_bit_codes<2>(block, half);
    case 3: return six_bit_codes<3>(block, half);
    case 4: return six_bit_codes<4>(block, half);
    case 5: return six_bit_codes<5>(block, half);
    case 6: return six_bit_codes<6>(block, half);
    default: return six_bit_codes<7>(block, half);
  }
}

// A five-bit format's codes of group g for the 8 columns at `half` (0 or 32) of each 64 bytes, as bytes 0 to 31:
// each of the half's 32 fifth bits spread to its byte (shuffled to it, then picked by its bit).
inline __m256i five_bit_codes(const uint8_t* block, int g, int64_t half) {
  const __m256i nibbles = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + (g % 4) * 64 + half));
  const __m256i low = _mm256_and_si256(g < 4 ? nibbles : _mm256_srli_epi16(nibbles, 4), _mm256_set1_epi8(0x0f));
  int32_t fifth;
  std::memcpy(&fifth, block + 256 + g * 8 + half / 8, 4);
  const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32(fifth),
                                             _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202,
                                                                0x0303030303030303));
  const __m256i bit = _mm256_set1_epi64x(int64_t(0x8040201008040201));
  const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
  return _mm256_or_si256(low, _mm256_and_si256(set, _mm256_set1_epi8(16)));
}

// dots plus each 32-bit lane's four products of unsigned bytes u and signed bytes s, no pair of
// which may reach past int16 (maddubs saturates there; dpbusd never does).
inline __m256i byte_products(__m256i dots, __m256i u, __m256i s, __m256i ones) {
#if EMBER_AVX_VNNI
  (void)ones;
  return _mm256_dpbusd_avx_epi32(dots, u, s);
#else
  return _mm256_add_epi32(dots, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), ones));
#endif
}

// 8 steps as floats: unsigned (Q4S) or signed (Q8S) bytes.
inline __m256 load_steps(const uint8_t* p, bool is_signed) {
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtepi32_ps(is_signed ? _mm256_cvtepi8_epi32(bytes) : _mm256_cvtepu8_epi32(bytes));
}

// Rows [m0, m0 + MR) against halves [H, H + HALVES) of column block nb (half h: columns 8h to
// 8h + 7; its bytes from `w`), a register of eight float sums per row and half. Both halves in one pass along K read
// each line of the block once; one half a pass keeps more rows' sums, codes and pair sums in the
// sixteen registers. Without dpbusd a block's dot products are maddubs (unsigned codes times
// signed activations, in pairs, to int16) then madd (pairs to int32): exact, as no int16
// saturates. Q4: a pair is at most 2 * 15 * 127 and the block's eight pairs sum in int16 (at most
// 30480). Q8: the code b becomes the signed w = b - 128, and |w| times x with w's sign (at most
// 2 * 128 * 127 a pair) goes straight to int32. With AVX-VNNI, dpbusd sums each lane's four
// products straight to int32 instead: the same exact sums, so the same bits. `next` (or nullptr):
// the column block fetched into L2 as this one is computed, as on the AVX-512 path.
// `start` (or nullptr: zero): the (M, N) float32 sums to continue.
template <Format F, int MR, int H, int HALVES, typename T>
inline void tile(const uint8_t* w, int64_t KB, int64_t nb, int64_t N, const int8_t* xq, const float* dx,
                 const float* sx, int64_t K, int64_t m0, T* y, const float* start, const uint8_t* next) {
  __m256 acc[MR][HALVES];
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (int r = 0; r < MR; ++r)
    for (int h = 0; h < HALVES; ++h) {
      const int64_t n0 = nb * NBLOCK + 8 * (H + h);  // a half past N loads nothing
      const __m256i inside = _mm256_cmpgt_epi32(_mm256_set1_epi32(int(std::max<int64_t>(N - n0, 0))), lanes);
      acc[r][h] = start == nullptr ? _mm256_setzero_ps() : _mm256_maskload_ps(start + (m0 + r) * N + n0, inside);
    }
  const __m256i low = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
  const int64_t column = column_bytes<F>(KB);
  for (int64_t kb = 0; kb < KB; ++kb) {
    const Offsets at = offsets<F>(kb);
    const uint8_t *block = w + at.codes, *scales = w + at.scales, *steps = w + at.steps;
    const int32_t* xk[MR];
    for (int r = 0; r < MR; ++r) xk[r] = reinterpret_cast<const int32_t*>(xq + (m0 + r) * K + kb * QBLOCK);
    if (next != nullptr) prefetch_share<F>(next, column, 1, kb);
#pragma GCC unroll 2
    for (int h = 0; h < HALVES; ++h) {
      const int64_t half = (H + h) * 32;  // the half's bytes in each 64 of codes
      __m256i dots[MR];
      for (int r = 0; r < MR; ++r) dots[r] = _mm256_setzero_si256();
      if constexpr (NIBBLES<F>) {  // dots: the int16 pair sums, then their int32 sums
        const auto pairs = [&](int p) {
          const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + p * 64 + half));
          const __m256i lo = _mm256_and_si256(packed, low);
          const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low);
          for (int r = 0; r < MR; ++r) {
#if EMBER_AVX_VNNI
            dots[r] = _mm256_dpbusd_avx_epi32(dots[r], lo, _mm256_set1_epi32(xk[r][p]));
            dots[r] = _mm256_dpbusd_avx_epi32(dots[r], hi, _mm256_set1_epi32(xk[r][p + 4]));
#else
            dots[r] = _mm256_add_epi16(dots[r], _mm256_maddubs_epi16(lo, _mm256_set1_epi32(xk[r][p])));
            dots[r] = _mm256_add_epi16(dots[r], _mm256_maddubs_epi16(hi, _mm256_set1_epi32(xk[r][p + 4])));
#endif
          }
        };
        // Unrolled, with three rows or more, the compiler hoists all 8 * MR products above their
        // sums and spills them; one p at a time keeps them in registers (0.84x-0.89x the time).
        if constexpr (MR * HALVES <= 2) {
          for (int p = 0; p < 4; ++p) pairs(p);
        } else {
#pragma GCC unroll 1
          for (int p = 0; p < 4; ++p) pairs(p);
        }
        if constexpr (!EMBER_AVX_VNNI)
          for (int r = 0; r < MR; ++r) dots[r] = _mm256_madd_epi16(dots[r], ones);
      } else {  // Q8S and Q8SM sum each half of the block apart, with its own step; Q8 and Q8M at once
        constexpr int HALVES_K = HALF_STEPS<F> ? 2 : 1;
        for (int k_half = 0; k_half < HALVES_K; ++k_half) {
          for (int g = k_half * 8 / HALVES_K; g < (k_half + 1) * 8 / HALVES_K; ++g) {
            const __m256i codes =
                SIX_BITS<F>    ? six_bit_codes(block, g, half)
                : FIVE_BITS<F> ? five_bit_codes(block, g, half)
                               : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + g * 64 + half));
            if constexpr (OFFSET<F>) {
              const __m256i signed_w = SIX_BITS<F> ? _mm256_sub_epi8(codes, _mm256_set1_epi8(char(ZERO<F>)))
                                                   : _mm256_xor_si256(codes, _mm256_set1_epi8(char(0x80)));
              const __m256i magnitude = _mm256_sign_epi8(signed_w, signed_w);  // -128 stays 0x80: 128 unsigned
              for (int r = 0; r < MR; ++r) {
                const __m256i x = _mm256_sign_epi8(_mm256_set1_epi32(xk[r][g]), signed_w);
                dots[r] = byte_products(dots[r], magnitude, x, ones);
              }
            } else {  // Q8M's codes are below 128: a pair is at most 2 * 127 * 127, within int16
              for (int r = 0; r < MR; ++r) {
                const __m256i x = _mm256_set1_epi32(xk[r][g]);
                dots[r] = byte_products(dots[r], codes, x, ones);
              }
            }
          }
          if constexpr (HALF_STEPS<F>) {
            const __m256 d = _mm256_mul_ps(load_halves(scales + (H + h) * 16),
                                           load_steps(steps + HALF * k_half + (H + h) * 8, true));
            for (int r = 0; r < MR; ++r) {
              const int64_t row = (m0 + r) * KB + kb;
              const __m256 scale = _mm256_mul_ps(d, _mm256_set1_ps(dx[row]));
              acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots[r]), scale, acc[r][h]);
              dots[r] = _mm256_setzero_si256();
            }
          }
        }
      }
      if constexpr (HALF_STEPS<F> && HAS_MIN<F>) {  // Q8SM's minimum, after the halves
        const __m256 mins = _mm256_mul_ps(load_halves(scales + 32 + (H + h) * 16),
                                          load_steps(steps + MIN_STEPS_AT<F> + (H + h) * 8, false));
        for (int r = 0; r < MR; ++r)
          acc[r][h] = _mm256_fmadd_ps(mins, _mm256_set1_ps(sx[(m0 + r) * KB + kb]), acc[r][h]);
      } else if constexpr (!HALF_STEPS<F>) {
        __m256 d = load_halves(scales + (H + h) * 16);
        __m256 mins = HAS_MIN<F> ? load_halves(scales + 32 + (H + h) * 16) : _mm256_setzero_ps();
        if constexpr (STEP_AND_MIN<F>) {
          d = _mm256_mul_ps(d, load_steps(steps + (H + h) * 8, false));
          mins = _mm256_mul_ps(mins, load_steps(steps + MIN_STEPS_AT<F> + (H + h) * 8, false));
        }
        for (int r = 0; r < MR; ++r) {
          const int64_t row = (m0 + r) * KB + kb;
          const __m256 scale = _mm256_mul_ps(d, _mm256_set1_ps(dx[row]));
          acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots[r]), scale, acc[r][h]);
          if constexpr (HAS_MIN<F>) acc[r][h] = _mm256_fmadd_ps(mins, _mm256_set1_ps(sx[row]), acc[r][h]);
        }
      }
    }
  }
  for (int r = 0; r < MR; ++r) {
    for (int h = 0; h < HALVES; ++h) {
      const int64_t n0 = nb * NBLOCK + 8 * (H + h), count = std::min<int64_t>(8, N - n0);
      alignas(32) float out[8];
      _mm256_store_ps(out, acc[r][h]);
      T* dst = y + (m0 + r) * N + n0;
      for (int64_t j = 0; j < count; ++j) dst[j] = from_float<T>(out[j]);
    }
  }
}

// Rows [m0, m0 + MR) against column block nb: both halves in one pass for one row (and two of
// 8-bit blocks), else one half a pass (a half past N, in a partial last block, is skipped):
// whichever measured faster.
template <Format F, int MR, typename T>
inline void both_halves(const uint8_t* w, int64_t KB, int64_t nb, int64_t N, const int8_t* xq, const float* dx,
                        const float* sx, int64_t K, int64_t m0, T* y, const float* start, const uint8_t* next) {
  if constexpr (MR == 1 || (!NIBBLES<F> && MR == 2)) {
    tile<F, MR, 0, 2>(w, KB, nb, N, xq, dx, sx, K, m0, y, start, next);
  } else {
    tile<F, MR, 0, 1>(w, KB, nb, N, xq, dx, sx, K, m0, y, start, next);
    if (nb * NBLOCK + 8 < N) tile<F, MR, 1, 1>(w, KB, nb, N, xq, dx, sx, K, m0, y, start, next);
  }
}

// Column block nb against every row, four at a time and the last one to three in one tile.
template <Format F, typename T>
inline void column_block(const uint8_t* w, int64_t KB, int64_t nb, int64_t N, const int8_t* xq, const float* dx,
                         const float* sx, int64_t K, int64_t M, T* y, const float* start, const uint8_t* next) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) both_halves<F, 4>(w, KB, nb, N, xq, dx, sx, K, m, y, start, next);
  switch (M - m) {
    case 3: both_halves<F, 3>(w, KB, nb, N, xq, dx, sx, K, m, y, start, next); break;
    case 2: both_halves<F, 2>(w, KB, nb, N, xq, dx, sx, K, m, y, start, next); break;
    case 1: both_halves<F, 1>(w, KB, nb, N, xq, dx, sx, K, m, y, start, next); break;
    default: break;
  }
}

// Column block nb (count 1; its bytes from `w`) against every row.
template <Format F, typename T>
inline void columns(const uint8_t* w, int64_t KB, int64_t nb, int count, int64_t N, const int8_t* xq, const float* dx,
                    const float* sx, const int32_t*, const int32_t*, int64_t K, int64_t M, T* y, const float* start,
                    const uint8_t* next) {
  column_block<F>(w, KB, nb, N, xq, dx, sx, K, M, y, start, next);
}

// A six-bit format's block's codes (at `block`) as its byte format's, into `to`: q plus CODE_BASE.
template <Format F> inline void unpack_six_bits(const uint8_t* block, uint8_t* to) {
  for (int g = 0; g < 8; ++g)
    for (int64_t half = 0; half < 64; half += 32)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(to + g * 64 + half),
                          _mm256_add_epi8(six_bit_codes(block, g, half), _mm256_set1_epi8(CODE_BASE<F>)));
}
