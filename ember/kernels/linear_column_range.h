// The linear kernel's column work: the tiles of each vector path, the plain C++ columns and
// column_range, which splits a weight's column blocks among the threads. Each linear_columns_*.cpp
// includes this and compiles column_range for its formats (EMBER_LINEAR_COLUMNS).

#pragma once

#include "common.h"

#include <memory>

namespace ember_kernels {
namespace EMBER_LINEAR {

#include "linear_formats.h"
#include "linear_columns.h"

#if EMBER_AVX512 || EMBER_AVX2

// The kb-th of the KB equal shares of each of `count` column blocks from `next` (k block kb where
// the blocks are all alike; an eighth of a Q4K super-block), fetched into L2 line by line.
// (Inlined: once its prefetches were builtins the compiler dropped the calls it left out of line;
// see prefetch_to_l2.)
template <Format F>
__attribute__((always_inline)) inline void prefetch_share(const uint8_t* next, int64_t column, int count, int64_t kb) {
  constexpr int64_t SHARE = PER_SUPER<F> ? SUPER_BYTES<F> / SUPER : BLOCK_BYTES<F>;
  const int64_t first = kb * SHARE / 64 * 64, end = (kb + 1) * SHARE;
  for (int c = 0; c < count; ++c)
    for (int64_t line = first; line < end; line += 64)
      prefetch_to_l2(next + c * column + line);
}

#endif

#if EMBER_AVX512
#include "linear_avx512.h"
#if EMBER_AMX_INT8
#include "linear_amx.h"
#endif
#elif EMBER_AVX2
#include "linear_avx2.h"
#else  // plain C++: the same sums, element by element

// Column blocks [nb_begin, nb_end) of y, the first one's bytes at `w`.
template <Format F, typename T>
void columns_plain(const uint8_t* w, int64_t KB, int64_t nb_begin, int64_t nb_end, int64_t N, const int8_t* xq,
                   const float* dx, const float* sx, const int32_t* qsum, int64_t K, int64_t M, T* y,
                   const float* start) {
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t nb = nb_begin; nb < nb_end; ++nb) {
      const uint8_t* column = w + (nb - nb_begin) * column_bytes<F>(KB);
      for (int64_t j = 0; j < NBLOCK && nb * NBLOCK + j < N; ++j) {
        float acc = start == nullptr ? 0.f : start[m * N + nb * NBLOCK + j];
        for (int64_t kb = 0; kb < KB; ++kb) {
          const uint8_t* block = column + offsets<F>(kb).codes;
          const int8_t* xk = xq + m * K + kb * QBLOCK;
          constexpr int64_t SPAN = HALF_STEPS<F> ? HALF : QBLOCK;  // the codes one scale covers
          for (int64_t h = 0; h < QBLOCK / SPAN; ++h) {
            int32_t dot = 0;
            for (int64_t k = h * SPAN; k < (h + 1) * SPAN; ++k) dot += code_at<F>(block, j, k) * int32_t(xk[k]);
            acc = std::fma(float(dot), scale_at<F>(column, kb, j, h) * dx[m * KB + kb], acc);
          }
          if constexpr (HAS_MIN<F>) acc = std::fma(min_at<F>(column, kb, j), sx[m * KB + kb], acc);
        }
        y[m * N + nb * NBLOCK + j] = from_float<T>(acc);
      }
    }
  }
}

#endif

#if EMBER_AVX512 || EMBER_AVX2

// The format a column block is unpacked into for many rows: a six- or five-bit format's codes as its
// byte format's, Q4K's as Q4S's; a super-block's d and m in each of its blocks.
template <Format F> constexpr Format UNPACKED = F == Format::Q4K ? Format::Q4S : BYTES_OF<F>;
// Past these rows a column block is unpacked (the fewest rows at which it measured faster, Intel Xeon).
template <Format F> constexpr int64_t UNPACK_ROWS = SIX_BITS<F> || FIVE_BITS<F> ? 12 : 24;

// A column block of KB blocks as UNPACKED<F>'s, into `out`: the same codes, scales and steps.
template <Format F> inline void unpack(const uint8_t* column, int64_t KB, uint8_t* out) {
  constexpr Format B = UNPACKED<F>;
  for (int64_t kb = 0; kb < KB; ++kb) {
    const uint8_t* codes = column + offsets<F>(kb).codes;
    uint8_t* to = out + kb * BLOCK_BYTES<B>;
    if constexpr (SIX_BITS<F>) {
      unpack_six_bits<F>(codes, to);
    } else if constexpr (FIVE_BITS<F>) {
      for (int g = 0; g < 8; ++g) {
#if EMBER_AVX512
        _mm512_storeu_si512(to + g * 64, five_bit_codes(codes, g));
#else
        for (int64_t half = 0; half < 64; half += 32)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(to + g * 64 + half), five_bit_codes(codes, g, half));
#endif
      }
    } else {
      static_assert(F == Format::Q4K && B == Format::Q4S);
      std::memcpy(to, codes, 256);
    }
    copy_scales_and_steps<F, B>(column, kb, to);
  }
}

#endif

// linear_columns.h says what it computes.
template <Format F, typename T>
void column_range(const QuantizedRows& rows, const uint8_t* w, int64_t nb_first, int64_t count, int64_t N, T* y,
                  const float* start) {
  const int64_t M = rows.M, K = rows.K, KB = rows.KB;
  const int8_t* const xq = rows.xq;
  const float *const dx = rows.dx, *const sx = rows.sx;
  const int32_t *const qsum = rows.qsum, *const qlow = rows.qlow;
  const int64_t column = column_bytes<F>(KB);
  // Threads split the column blocks (in pairs, the kernel's widest tile); every thread runs all rows.
  const int64_t pairs = (count + 1) / 2;
  at::parallel_for(0, pairs, 1, [&](int64_t begin, int64_t end) {
    const int64_t first = begin * 2, last = std::min(end * 2, count);  // blocks counted from nb_first
#if EMBER_AVX512 || EMBER_AVX2
    // Six-bit formats and Q4K for many rows: each column block unpacked once into its byte
    // format's or Q4S's bytes, then that format's tiles, whose integer sums and float steps are
    // the same: the same bits, without unpacking the codes (or finding the super-block's d and m)
    // again for every tile of rows.
    constexpr Format U = UNPACKED<F>;
    std::unique_ptr<uint8_t[]> unpacked;
    if constexpr (U != F)
      if (M > UNPACK_ROWS<F>) unpacked.reset(new uint8_t[2 * column_bytes<U>(KB)]);
#if EMBER_AMX_INT8
    // Formats the AMX tiles take, for many rows where the processor has them: column blocks one
    // at a time, a nibble format's codes unpacked into the tiles' layout first.
    const bool tiles = AMX_FORMAT<U> && M >= AMX_FROM_ROWS && amx::granted(false, true);
    bool configured = false;
    std::unique_ptr<uint8_t[]> codes;
    if (tiles && NIBBLES<U>) codes.reset(new uint8_t[KB * 512]);
    // Whole tiles of 16 rows on the AMX tiles; the rows after them (a short tile costs as much as a
    // whole one there) on the VNNI tiles, which give the same bits.
    const int64_t tiled = M / AMX_ROWS * AMX_ROWS;
    const auto tile_columns = [&](const uint8_t* blocks, int64_t b, int n, const uint8_t* next) {
      if constexpr (AMX_FORMAT<U>) {
        const QuantizedRows whole{tiled, K, KB, xq, dx, sx, qsum, qlow};
        if (!configured) amx_configure(), configured = true;
        for (int c = 0; c < n; ++c) {
          const uint8_t* block = blocks + c * column_bytes<U>(KB);
          if constexpr (NIBBLES<U>) unpack_nibbles<U>(block, KB, codes.get());
          amx_column_block<U>(block, codes.get(), nb_first + b + c, N, whole, y, start,
                              next == nullptr ? nullptr : next + c * column, column);
        }
        if (tiled < M)
          columns<U>(blocks, KB, nb_first + b, n, N, xq + tiled * K, dx + tiled * KB, sx + tiled * KB,
                     qsum + tiled * KB, qlow + tiled * KB, K, M - tiled, y + tiled * N,
                     start == nullptr ? nullptr : start + tiled * N, nullptr);
      }
    };
#endif
    const auto pass = [&](int64_t b, int n, const uint8_t* next) {
      if constexpr (U != F) {
        if (unpacked) {
          for (int c = 0; c < n; ++c)
            unpack<F>(w + (b + c) * column, KB, unpacked.get() + c * column_bytes<U>(KB));
#if EMBER_AMX_INT8
          if (tiles) return tile_columns(unpacked.get(), b, n, next);
#endif
          columns<U>(unpacked.get(), KB, nb_first + b, n, N, xq, dx, sx, qsum, qlow, K, M, y, start, nullptr);
          return;
        }
      }
#if EMBER_AMX_INT8
      if constexpr (U == F)
        if (tiles) return tile_columns(w + b * column, b, n, next);
#endif
      columns<F>(w + b * column, KB, nb_first + b, n, N, xq, dx, sx, qsum, qlow, K, M, y, start, next);
    };
#endif
#if EMBER_AVX512
    int64_t b = first;
    for (; b + 2 <= last; b += 2)  // a pair fetches the next pair, when there is one
      pass(b, 2, b + 4 <= last ? w + (b + 2) * column : nullptr);
    if (b < last) pass(b, 1, nullptr);
#if EMBER_AMX_INT8
    if (configured) amx::release();  // other code (oneDNN's kernels, attention) configures them its own way
#endif
#elif EMBER_AVX2
    for (int64_t b = first; b < last; ++b)  // a block fetches the next, when there is one
      pass(b, 1, b + 1 < last ? w + (b + 1) * column : nullptr);
#else
    columns_plain<F>(w + first * column, KB, nb_first + first, nb_first + last, N, xq, dx, sx, qsum, K, M, y, start);
#endif
  });
}


}  // namespace EMBER_LINEAR
}  // namespace ember_kernels

// column_range for format F's float32 and bfloat16 rows, in the unit that names it.
#define EMBER_LINEAR_COLUMNS(F)                                                                                   \
  template void ember_kernels::EMBER_LINEAR::column_range<ember_kernels::EMBER_LINEAR::Format::F, float>(          \
      const ember_kernels::EMBER_LINEAR::QuantizedRows&, const uint8_t*, int64_t, int64_t, int64_t, float*,        \
      const float*);                                                                                               \
  template void ember_kernels::EMBER_LINEAR::column_range<ember_kernels::EMBER_LINEAR::Format::F, at::BFloat16>(   \
      const ember_kernels::EMBER_LINEAR::QuantizedRows&, const uint8_t*, int64_t, int64_t, int64_t, at::BFloat16*, \
      const float*);
