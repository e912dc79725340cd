// The linear kernel's column blocks on AMX tiles, for many rows (Xeons since Sapphire Rapids). Part
// of linear_column_range.h, which includes it inside its namespace after linear_avx512.h.
//
// A tile product (tdpbsud) of a tile of rows' codes (A: 16 rows, one k block's 32 signed
// bytes each) and a column block's codes of that k block (B: 8 rows of 64 bytes, four codes of each
// of the 16 columns a row: the VNNI layout, as a byte format stores them, a nibble format's
// unpacked) gives each row's 16 integer sums over the block: the VNNI tiles' sums, exactly (an
// integer sum has no order). The float steps after it are the VNNI tiles' own (BlockScales), block
// by block in order along K, so a row has the same bits whichever path computes it; the tiles only
// take the products off the vector units. The formats: those whose steps cover whole blocks
// (AMX_FORMAT); half-block steps (Q8S, Q8SM) take the VNNI tiles.

#pragma once

template <Format F> constexpr bool AMX_FORMAT = !HALF_STEPS<F> && !SIX_BITS<F> && !FIVE_BITS<F> && !PER_SUPER<F>;
constexpr int64_t AMX_ROWS = 16;  // rows of a tile
// The tiles of rows over which a column block asks for the next one (1, 2, 4 and 8 measured alike
// at 64 to 512 rows; spread over every tile, the shares' divisions cost 4-5% at 256 and 512).
constexpr int64_t FETCH_TILES = 4;
// Fewer rows take the VNNI tiles alone: at 16 to 31 rows the tiles measured no faster (Intel Xeon,
// bench/linear_versions.py), and the rows past the last whole tile take a pass of VNNI tiles.
constexpr int64_t AMX_FROM_ROWS = 32;

// The tiles' shapes: 0, 3, 4 and 5 C (16 rows of 16 int32 sums: four k blocks' in turn); 1 A (16
// rows of 32 codes); 2 B (8 rows of 64 codes).
constexpr int64_t AMX_AHEAD = 3;  // k blocks whose products are under way while one block's sums are taken
inline void amx_configure() {
  amx::Config config;
  for (int t : {0, 3, 4, 5}) config.rows[t] = AMX_ROWS, config.bytes[t] = 64;
  config.rows[1] = AMX_ROWS, config.bytes[1] = 32;
  config.rows[2] = 8, config.bytes[2] = 64;
  amx::configure(config);
}

// A nibble format's column block's codes of every k block in B's layout, 512 bytes a block, into
// `to`: group g < 4 the low halves of the block's 64 bytes of group g, g >= 4 the high halves of
// those of g - 4 (the pairs the VNNI tiles take apart).
template <Format F> inline void unpack_nibbles(const uint8_t* column, int64_t KB, uint8_t* to) {
  const __m512i low = _mm512_set1_epi8(0x0f);
  for (int64_t kb = 0; kb < KB; ++kb)
    for (int p = 0; p < 4; ++p) {
      const __m512i packed = _mm512_loadu_si512(column + offsets<F>(kb).codes + p * 64);
      _mm512_storeu_si512(to + kb * 512 + p * 64, _mm512_and_si512(packed, low));
      _mm512_storeu_si512(to + kb * 512 + (p + 4) * 64, _mm512_and_si512(_mm512_srli_epi16(packed, 4), low));
    }
}

// Column block nb (its bytes at `column`) against rows [0, M), M a multiple of 16, a tile of 16
// rows at a time (configured: amx_configure); `codes`: a nibble format's unpacked codes
// (unpack_nibbles), else nullptr. A k block's sums are stored from one C tile while the next
// blocks' products go to the others, so the vector units find them in memory rather than waiting
// on the store. `next` (or nullptr): the `next_bytes` of the column block the thread takes after
// this one's pair, asked for into L2 in even shares over the k blocks of the first tiles of rows.
// Without it, memory idles while a column block computes and the next one's first k blocks wait
// on it: at 32 rows a decode step's linear layers took their arithmetic's time plus their
// weights' read time.
template <Format F, typename T>
void amx_column_block(const uint8_t* column, const uint8_t* codes, int64_t nb, int64_t N, const QuantizedRows& rows,
                      T* y, const float* start, const uint8_t* next, int64_t next_bytes) {
  const int64_t K = rows.K, KB = rows.KB, n0 = nb * NBLOCK;
  alignas(64) int32_t sums[AMX_AHEAD + 1][AMX_ROWS][NBLOCK];
  // `next`'s lines are asked for over the k blocks of the first FETCH_TILES tiles of rows, a line
  // each time `owed` reaches `steps` (no division in the loop)
  const int64_t fetch_rows = next == nullptr ? 0 : std::min(rows.M, FETCH_TILES * AMX_ROWS);
  const int64_t steps = fetch_rows / AMX_ROWS * KB, lines = (next_bytes + 63) / 64;
  int64_t owed = 0, line = 0;
  for (int64_t m0 = 0; m0 < rows.M; m0 += AMX_ROWS) {
    // k block kb's sums into sums[kb % 4], through C tile 0, 3, 4 or 5
    const auto product = [&](int64_t kb) {
      const auto through = [&](auto c) {
        amx::load<1>(rows.xq + m0 * K + kb * QBLOCK, K);
        amx::load<2>(NIBBLES<F> ? codes + kb * 512 : column + offsets<F>(kb).codes, 64);
        amx::zero<decltype(c)::value>();
        amx::dot_s8u8<decltype(c)::value, 1, 2>();
        amx::store<decltype(c)::value>(sums[kb % 4], NBLOCK * sizeof(int32_t));
      };
      switch (kb % 4) {
        case 0: return through(std::integral_constant<int, 0>{});
        case 1: return through(std::integral_constant<int, 3>{});
        case 2: return through(std::integral_constant<int, 4>{});
        default: return through(std::integral_constant<int, 5>{});
      }
    };
    __m512 acc[AMX_ROWS];
#pragma GCC unroll 16
    for (int64_t r = 0; r < AMX_ROWS; ++r)
      acc[r] = start == nullptr ? _mm512_setzero_ps()
                                : _mm512_maskz_loadu_ps(first_lanes(N - n0), start + (m0 + r) * N + n0);
    for (int64_t kb = 0; kb < std::min(AMX_AHEAD, KB); ++kb) product(kb);
    for (int64_t kb = 0; kb < KB; ++kb) {
      if (m0 < fetch_rows)
        for (owed += lines; owed >= steps && line < lines; owed -= steps) prefetch_to_l2(next + 64 * line++);
      if (kb + AMX_AHEAD < KB) product(kb + AMX_AHEAD);
      const Offsets at = offsets<F>(kb);
      const BlockScales<F> block(column + at.scales, column + at.steps);
#pragma GCC unroll 16
      for (int64_t r = 0; r < AMX_ROWS; ++r)
        acc[r] = block.add(acc[r], _mm512_load_si512(sums[kb % 4][r]), (m0 + r) * KB + kb, rows.dx, rows.sx, rows.qsum);
    }
    for (int64_t r = 0; r < AMX_ROWS; ++r) store_sums(acc[r], y, m0 + r, n0, N);
  }
}
