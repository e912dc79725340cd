// The linear kernel's interface between linear.cpp, which quantizes the rows and holds the ops,
// and the units that compute columns (linear_columns_*.cpp, each a few formats: a build compiles
// them side by side). Included inside namespace ember_kernels::EMBER_LINEAR after linear_formats.h.

#pragma once

// x (M, K)'s rows quantized in blocks of 32 (linear.cpp's quantize_rows): the codes xq (M, K) and,
// for each block (M, K / 32), its scale dx, dx times the sum of its codes sx, that sum qsum and
// the sum of its first half's codes qlow.
struct QuantizedRows {
  int64_t M, K, KB;
  const int8_t* xq;
  const float *dx, *sx;
  const int32_t *qsum, *qlow;
};

// Column blocks [nb_first, nb_first + count) of y (M, N) from weights in format F, the first
// block's bytes at `w`. `start` (or nullptr: zero): the (M, N) float32 sums to continue; it may
// be y itself. Defined in linear_column_range.h, compiled for float and bfloat16 rows in the unit
// of its format.
template <Format F, typename T>
void column_range(const QuantizedRows& rows, const uint8_t* w, int64_t nb_first, int64_t count, int64_t N, T* y,
                  const float* start);
