// The linear kernel's tiles on AVX-512 VNNI. Part of linear_column_range.h, which includes it inside
// its namespace after the formats (linear_formats.h) and prefetch_share.

#pragma once

inline __m512 load_halves(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// A six-bit format's codes of group g, 64 of them (4 of each of 16 columns), as bytes 0 to 63.
template <int g> inline __m512i six_bit_codes(const uint8_t* block) {
  const __m512i nibbles = _mm512_loadu_si512(block + (g % 4) * 64);
  const __m512i low = _mm512_and_si512(g < 4 ? nibbles : _mm512_srli_epi16(nibbles, 4), _mm512_set1_epi8(0x0f));
  const __m512i high = _mm512_loadu_si512(block + 256 + (g % 4 / 2) * 64);
  constexpr int shift = high_bits_shift(g);  // the group's 2 bits, moved to bits 4 and 5
  const __m512i moved = shift <= 4 ? _mm512_slli_epi16(high, 4 - shift) : _mm512_srli_epi16(high, shift - 4);
  return _mm512_or_si512(low, _mm512_and_si512(moved, _mm512_set1_epi8(0x30)));
}
inline __m512i six_bit_codes(const uint8_t* block, int g) {  // g known once the caller's loop unrolls
  switch (g) {
    case 0: return six_bit_codes<0>(block);
    case 1: return six_bit_codes<1>(block);
    case 2: return six_bit_codes<2>(block);
    case 3: return six_bit_codes<3>(block);
    case 4: return six_bit_codes<4>(block);
    case 5: return six_bit_codes<5>(block);
    case 6: return six_bit_codes<6>(block);
    default: return six_bit_codes<7>(block);
  }
}

// A five-bit format's codes of group g, 64 of them (4 of each of 16 columns), as bytes 0 to 31.
inline __m512i five_bit_codes(const uint8_t* block, int g) {
  const __m512i nibbles = _mm512_loadu_si512(block + (g % 4) * 64);
  const __m512i low = _mm512_and_si512(g < 4 ? nibbles : _mm512_srli_epi16(nibbles, 4), _mm512_set1_epi8(0x0f));
  __mmask64 fifth;
  std::memcpy(&fifth, block + 256 + g * 8, 8);
  return _mm512_mask_add_epi8(low, fifth, low, _mm512_set1_epi8(16));
}

// 16 steps as floats: unsigned (Q4S) or signed (Q8S) bytes.
inline __m512 load_steps(const uint8_t* p, bool is_signed) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm512_cvtepi32_ps(is_signed ? _mm512_cvtepi8_epi32(bytes) : _mm512_cvtepu8_epi32(bytes));
}

// A k block's 16 column scales (d, times s where stepped) and minimums (m, times t), for the
// formats whose steps cover whole blocks; add: a row's sums so far plus that block's products,
// from its integer sums over the block (`dot`, the codes as stored) and the row's scale, sum
// and codes' sum (at `row` of dx, sx and qsum). The one float arithmetic of the VNNI tiles and
// the AMX ones (linear_amx.h), so both give the same bits.
template <Format F> struct BlockScales {
  __m512 d, mins;
  __attribute__((always_inline)) BlockScales(const uint8_t* scales, const uint8_t* steps) {
    d = load_halves(scales);
    mins = HAS_MIN<F> ? load_halves(scales + 32) : _mm512_setzero_ps();
    if constexpr (STEP_AND_MIN<F>) {
      d = _mm512_mul_ps(d, load_steps(steps, false));
      mins = _mm512_mul_ps(mins, load_steps(steps + MIN_STEPS_AT<F>, false));
    }
  }
  __attribute__((always_inline)) __m512 add(__m512 acc, __m512i dot, int64_t row, const float* dx, const float* sx,
                                            const int32_t* qsum) const {
    if constexpr (OFFSET<F>) dot = _mm512_sub_epi32(dot, _mm512_set1_epi32(ZERO<F> * qsum[row]));
    const __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(dx[row]));
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc);
    if constexpr (HAS_MIN<F>) acc = _mm512_fmadd_ps(mins, _mm512_set1_ps(sx[row]), acc);
    return acc;
  }
};

// Row m's 16 sums of the columns from n0 (those before N) into y (M, N).
template <typename T>
__attribute__((always_inline)) inline void store_sums(__m512 sums, T* y, int64_t m, int64_t n0, int64_t N) {
  alignas(64) float out[NBLOCK];
  _mm512_store_ps(out, sums);
  const int64_t count = std::min<int64_t>(NBLOCK, N - n0);
  T* dst = y + m * N + n0;
  for (int64_t j = 0; j < count; ++j) dst[j] = from_float<T>(out[j]);
}

// Rows [m0, m0 + MR) against column blocks [nb0, nb0 + NB), whose bytes start at `w` (column block
// nb0's); accumulators stay in registers. `next` (or nullptr): the NB column blocks the thread
// takes after these, fetched into L2 (L1 keeps the blocks in use) block by block as the tile goes
// along K. Without it memory idles while a tile computes from L1 and the next tile then waits on
// memory: the time is the sum of the two rather than the larger.
// `start` (or nullptr: zero): the (M, N) float32 sums to continue.
template <Format F, int MR, int NB, typename T>
inline void tile(const uint8_t* w, int64_t KB, int64_t nb0, int64_t N, const int8_t* xq, const float* dx,
                 const float* sx, const int32_t* qsum, const int32_t* qlow, int64_t K, int64_t m0, T* y,
                 const float* start, const uint8_t* next) {
  __m512 acc[MR][NB];
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NB; ++c) {
      const int64_t n0 = (nb0 + c) * NBLOCK;
      acc[r][c] = start == nullptr ? _mm512_setzero_ps()
                                   : _mm512_maskz_loadu_ps(first_lanes(N - n0), start + (m0 + r) * N + n0);
    }
  const __m512i low = _mm512_set1_epi8(0x0f);
  const int64_t column = column_bytes<F>(KB);
  for (int64_t kb = 0; kb < KB; ++kb) {
    __m512i dots[MR][NB];
    for (int r = 0; r < MR; ++r)
      for (int c = 0; c < NB; ++c) dots[r][c] = _mm512_setzero_si512();
    const int32_t* xk[MR];
    for (int r = 0; r < MR; ++r) xk[r] = reinterpret_cast<const int32_t*>(xq + (m0 + r) * K + kb * QBLOCK);
    const Offsets at = offsets<F>(kb);
    const uint8_t *blocks[NB], *scales[NB], *steps[NB];
    for (int c = 0; c < NB; ++c) {
      blocks[c] = w + c * column + at.codes;
      scales[c] = w + c * column + at.scales;
      steps[c] = w + c * column + at.steps;
    }
    if (next != nullptr) prefetch_share<F>(next, column, NB, kb);
    if constexpr (NIBBLES<F>) {
      for (int p = 0; p < 4; ++p) {
        __m512i lo[NB], hi[NB];
        for (int c = 0; c < NB; ++c) {
          const __m512i packed = _mm512_loadu_si512(blocks[c] + p * 64);
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
    } else {  // Q8S and Q8SM sum each half apart, with its own step; Q8 and Q8M the block at once
      constexpr int HALVES = HALF_STEPS<F> ? 2 : 1;
      for (int h = 0; h < HALVES; ++h) {
        for (int g = h * 8 / HALVES; g < (h + 1) * 8 / HALVES; ++g) {
          __m512i b[NB];
          for (int c = 0; c < NB; ++c)
            b[c] = SIX_BITS<F>    ? six_bit_codes(blocks[c], g)
                   : FIVE_BITS<F> ? five_bit_codes(blocks[c], g)
                                  : _mm512_loadu_si512(blocks[c] + g * 64);
          for (int r = 0; r < MR; ++r) {
            const __m512i xa = _mm512_set1_epi32(xk[r][g]);
            for (int c = 0; c < NB; ++c) dots[r][c] = _mm512_dpbusd_epi32(dots[r][c], b[c], xa);
          }
        }
        if constexpr (HALF_STEPS<F>) {
          for (int c = 0; c < NB; ++c) {
            const __m512 d = _mm512_mul_ps(load_halves(scales[c]),
                                           load_steps(steps[c] + HALF * h, true));
            for (int r = 0; r < MR; ++r) {
              const int64_t row = (m0 + r) * KB + kb;
              const int32_t codes_sum = h == 0 ? qlow[row] : qsum[row] - qlow[row];
              const __m512i dot = _mm512_sub_epi32(dots[r][c], _mm512_set1_epi32(ZERO<F> * codes_sum));
              const __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(dx[row]));
              acc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc[r][c]);
              dots[r][c] = _mm512_setzero_si512();
            }
          }
        }
      }
    }
    if constexpr (HALF_STEPS<F> && HAS_MIN<F>) {  // Q8SM's minimum, after the halves
      for (int c = 0; c < NB; ++c) {
        const __m512 mins = _mm512_mul_ps(load_halves(scales[c] + 32), load_steps(steps[c] + MIN_STEPS_AT<F>, false));
        for (int r = 0; r < MR; ++r)
          acc[r][c] = _mm512_fmadd_ps(mins, _mm512_set1_ps(sx[(m0 + r) * KB + kb]), acc[r][c]);
      }
    } else if constexpr (!HALF_STEPS<F>) {
      for (int c = 0; c < NB; ++c) {
        const BlockScales<F> block(scales[c], steps[c]);
        for (int r = 0; r < MR; ++r) acc[r][c] = block.add(acc[r][c], dots[r][c], (m0 + r) * KB + kb, dx, sx, qsum);
      }
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NB; ++c) store_sums(acc[r][c], y, m0 + r, (nb0 + c) * NBLOCK, N);
}

// Column blocks [nb, nb + NB) (their bytes from `w`) against every row, in tiles of rows. The
// blocks' weights stay in L1 while the rows pass, and each tile unpacks them once (a few rows, as
// in a drafted round's verification, cost little more than one). A nibble format's rows go in as
// few tiles of up to six rows as they fit, their sizes as even as they go: each tile unpacks the
// nibbles again, and six rows' sums of two column blocks still fit the registers. A byte format's
// rows (nothing to unpack; a step for each half block wants registers of its own) go in tiles of
// four, where a remainder of one or two joins the first tile (five or six rows) and a remainder
// of three takes the last. Every tile asks for `next` (a repeated ask finds its lines on their
// way), so memory stays busy however many tiles the rows take.
template <Format F, int NB, typename T>
inline void column_blocks(const uint8_t* w, int64_t KB, int64_t nb, int64_t N, const int8_t* xq, const float* dx,
                          const float* sx, const int32_t* qsum, const int32_t* qlow, int64_t K, int64_t M, T* y,
                          const float* start, const uint8_t* next) {
  const auto rows_from = [&](int64_t m, int64_t rows) {  // rows [m, m + rows), 1 to 6 of them
    switch (rows) {
      case 6: return tile<F, 6, NB>(w, KB, nb, N, xq, dx, sx, qsum, qlow, K, m, y, start, next);
      case 5: return tile<F, 5, NB>(w, KB, nb, N, xq, dx, sx, qsum, qlow, K, m, y, start, next);
      case 4: return tile<F, 4, NB>(w, KB, nb, N, xq, dx, sx, qsum, qlow, K, m, y, start, next);
      case 3: return tile<F, 3, NB>(w, KB, nb, N, xq, dx, sx, qsum, qlow, K, m, y, start, next);
      case 2: return tile<F, 2, NB>(w, KB, nb, N, xq, dx, sx, qsum, qlow, K, m, y, start, next);
      default: return tile<F, 1, NB>(w, KB, nb, N, xq, dx, sx, qsum, qlow, K, m, y, start, next);
    }
  };
  int64_t m = 0;
  if constexpr (NIBBLES<F>) {
    for (int64_t tiles = (M + 5) / 6; tiles > 0; --tiles) {
      const int64_t rows = (M - m) / tiles;
      rows_from(m, rows);
      m += rows;
    }
    return;
  }
  if (M >= 5 && (M % 4 == 1 || M % 4 == 2)) {
    rows_from(0, 4 + M % 4);
    m = 4 + M % 4;
  }
  for (; m + 4 <= M; m += 4) rows_from(m, 4);
  if (m < M) rows_from(m, M - m);
}

// Column blocks [nb, nb + count) (count 1 or 2; their bytes from `w`) against every row.
template <Format F, typename T>
inline void columns(const uint8_t* w, int64_t KB, int64_t nb, int count, int64_t N, const int8_t* xq, const float* dx,
                    const float* sx, const int32_t* qsum, const int32_t* qlow, int64_t K, int64_t M, T* y,
                    const float* start, const uint8_t* next) {
  if (count == 2)
    column_blocks<F, 2>(w, KB, nb, N, xq, dx, sx, qsum, qlow, K, M, y, start, next);
  else
    column_blocks<F, 1>(w, KB, nb, N, xq, dx, sx, qsum, qlow, K, M, y, start, next);
}

// A six-bit format's block's codes (at `block`) as its byte format's, into `to`: q plus CODE_BASE.
template <Format F> inline void unpack_six_bits(const uint8_t* block, uint8_t* to) {
  const __m512i low = _mm512_set1_epi8(0x0f), high_bits = _mm512_set1_epi8(0x30);
  const __m512i base = _mm512_set1_epi8(CODE_BASE<F>);
  for (int k = 0; k < 2; ++k) {  // groups 2k, 2k + 1 and the two 4 after them share their bytes of high bits
    const __m512i high = _mm512_loadu_si512(block + 256 + k * 64);
    const __m512i moved[4] = {_mm512_slli_epi16(high, 4), _mm512_slli_epi16(high, 2), high,
                              _mm512_srli_epi16(high, 2)};  // each group's 2 bits at bits 4 and 5
    for (int e = 0; e < 2; ++e) {
      const int p = 2 * k + e;
      const __m512i nibbles = _mm512_loadu_si512(block + p * 64);
      const __m512i first =
          _mm512_or_si512(_mm512_and_si512(nibbles, low), _mm512_and_si512(moved[2 * e], high_bits));
      const __m512i second = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(nibbles, 4), low),
                                             _mm512_and_si512(moved[2 * e + 1], high_bits));
      _mm512_storeu_si512(to + p * 64, _mm512_add_epi8(first, base));
      _mm512_storeu_si512(to + (p + 4) * 64, _mm512_add_epi8(second, base));
    }
  }
}
