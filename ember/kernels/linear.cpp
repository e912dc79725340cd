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

#include "common.h"

#include <memory>

namespace ember_kernels {
namespace {

constexpr int64_t QBLOCK = 32;         // weights and activations are quantized in blocks of 32 along K
constexpr int64_t NBLOCK = 16;         // output columns per packed column block
constexpr int64_t HALF = 16;           // a step of Q8S or Q8SM (and their six-bit forms) covers half a block
constexpr int64_t SUPER = 8;           // k blocks per super-block (Q4K, Q5K, Q6K)
// Per (column block, k block): the codes (nibbles, or bytes), d (fp16 x16), m where the format has
// one (fp16 x16), then the steps: s and t (u8 x16 each), or the s of each half (i8 x16 each; Q8S,
// and Q8SM with its t after them).
// Q4K, Q5K and Q6K, per (column block, super-block): d and m (Q6K: d), then its 8 k blocks' codes
// and steps (s, t; Q6K: the halves' s).
// Q5K's codes: their low 4 bits as Q4's nibbles, then their fifth bits (64 bytes: group g's 64
// bits at 8 g, bit j*4 + i for column j's code 4g + i), then its steps.
// Six-bit formats: the codes' low 4 bits as Q4's nibbles, then their high 2 bits (128 bytes), then
// as their byte format.

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

template <typename T>
void quantize_rows(const T* x, int64_t M, int64_t K, int8_t* xq, float* dx, float* sx, int32_t* qsum,
                   int32_t* qlow) {
  const int64_t KB = K / QBLOCK;
  at::parallel_for(0, M, 1, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
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

// ---- the linear kernel ---------------------------------------------------------------------------
// y (M, N) = x (M, K) W^T, W packed by column blocks of 16 and k blocks of 32 (see weights.py).
// Q4: w = d * q + m with q in 0..15; nibble byte p*64 + j*4 + i of a block holds q[j][4p+i] in its
// low half and q[j][4(p+4)+i] in its high half (j: column in the block).
// Q8: w = d * (b - 128); byte g*64 + j*4 + i holds b[j][4g+i].

// Q4S, Q8S: as Q4, Q8, their steps after the scales (and minimums).

enum class Format : int64_t {
  Q4 = 4, Q8 = 8, Q4S = 20, Q8S = 24, Q8M = 28, Q8SM = 40, Q4K = 52, Q5K = 60, Q6 = 72, Q6S = 88, Q6M = 92,
  Q6SM = 104, Q6K = 120
};
template <Format F> constexpr bool SIX_BITS =
    F == Format::Q6 || F == Format::Q6S || F == Format::Q6M || F == Format::Q6SM || F == Format::Q6K;
template <Format F> constexpr bool FIVE_BITS = F == Format::Q5K;
template <Format F> constexpr Format BYTES_OF =  // the byte format of the same arithmetic
    F == Format::Q6K ? Format::Q8S : SIX_BITS<F> ? Format(int64_t(F) - 64) : FIVE_BITS<F> ? Format::Q8M : F;
// A six-bit code q is its byte format's b less this
template <Format F> constexpr int32_t CODE_BASE = SIX_BITS<F> && BYTES_OF<F> != Format::Q8M ? 96 : 0;
template <Format F> constexpr bool NIBBLES = F == Format::Q4 || F == Format::Q4S || F == Format::Q4K;  // else bytes
// Signed codes, their zero stored as 128 (b = code + 128; a six-bit q = code + 32); the others unsigned
template <Format F> constexpr bool OFFSET =
    BYTES_OF<F> == Format::Q8 || BYTES_OF<F> == Format::Q8S || BYTES_OF<F> == Format::Q8SM;
template <Format F> constexpr int32_t ZERO = OFFSET<F> ? 128 - CODE_BASE<F> : 0;
template <Format F> constexpr bool HALF_STEPS = BYTES_OF<F> == Format::Q8S || BYTES_OF<F> == Format::Q8SM;  // s_h
template <Format F> constexpr bool HAS_MIN = !OFFSET<F> || BYTES_OF<F> == Format::Q8SM;
template <Format F> constexpr bool STEP_AND_MIN =
    F == Format::Q4S || F == Format::Q4K || BYTES_OF<F> == Format::Q8M;  // s and t
template <Format F> constexpr bool MIN_STEP = STEP_AND_MIN<F> || BYTES_OF<F> == Format::Q8SM;  // t
template <Format F> constexpr bool STEPPED = STEP_AND_MIN<F> || HALF_STEPS<F>;
template <Format F> constexpr bool PER_SUPER =  // d and m once per super-block
    F == Format::Q4K || F == Format::Q5K || F == Format::Q6K;

// Within a block: the codes, then the 16 columns' scales d, then their minimums m, float16, then
// the steps: s then t, or the s of the first half then of the second (then t).
template <Format F> constexpr int64_t SCALES_AT = NIBBLES<F> ? 256 : SIX_BITS<F> ? 256 + 128 : 512;
template <Format F> constexpr int64_t MINS_AT = SCALES_AT<F> + 32;
template <Format F> constexpr int64_t STEPS_AT = MINS_AT<F> + (HAS_MIN<F> ? 32 : 0);
template <Format F> constexpr int64_t MIN_STEPS_AT = HALF_STEPS<F> ? 2 * NBLOCK : NBLOCK;  // t, from the steps
template <Format F> constexpr int64_t BLOCK_BYTES =
    PER_SUPER<F> ? (SIX_BITS<F> ? 256 + 128 : FIVE_BITS<F> ? 256 + 64 : 256) + 32
                 : STEPS_AT<F> + (STEPPED<F> ? 32 : 0) + (BYTES_OF<F> == Format::Q8SM ? NBLOCK : 0);
// A super-block (Q4K, Q5K, Q6K): d and m (Q6K: d), then its 8 blocks, each its codes and then its
// steps (s and t; Q6K: the halves' s).
template <Format F> constexpr int64_t SUPER_HEADER = HAS_MIN<F> ? 64 : 32;
template <Format F> constexpr int64_t SUPER_BYTES = SUPER_HEADER<F> + SUPER * BLOCK_BYTES<F>;

// A column block's bytes over KB k blocks (a multiple of SUPER where the format has super-blocks).
template <Format F> constexpr int64_t column_bytes(int64_t KB) {
  return PER_SUPER<F> ? KB / SUPER * SUPER_BYTES<F> : KB * BLOCK_BYTES<F>;
}

// Where k block kb's codes, its 16 scales d (float16; their minimums m follow them) and its steps
// start in its column block. (kb counted unsigned: a division and a remainder by SUPER are then a
// shift and a mask, where a signed one takes more instructions in the kernel's busiest loop.)
struct Offsets {
  int64_t codes, scales, steps;
};
template <Format F> constexpr Offsets offsets(int64_t kb) {
  if constexpr (PER_SUPER<F>) {
    const uint64_t k = uint64_t(kb);
    const int64_t super = int64_t(k / SUPER) * SUPER_BYTES<F>;
    const int64_t codes = super + SUPER_HEADER<F> + int64_t(k % SUPER) * BLOCK_BYTES<F>;
    return {codes, super, codes + BLOCK_BYTES<F> - 32};
  } else {
    const int64_t codes = kb * BLOCK_BYTES<F>;
    return {codes, codes + SCALES_AT<F>, codes + STEPS_AT<F>};
  }
}

// fn(std::integral_constant<Format, F>) for the run-time format; false for an unknown one.
template <typename Fn> bool with_format(int64_t format, Fn&& fn) {
  switch (format) {
    case 4: fn(std::integral_constant<Format, Format::Q4>{}); return true;
    case 8: fn(std::integral_constant<Format, Format::Q8>{}); return true;
    case 20: fn(std::integral_constant<Format, Format::Q4S>{}); return true;
    case 24: fn(std::integral_constant<Format, Format::Q8S>{}); return true;
    case 28: fn(std::integral_constant<Format, Format::Q8M>{}); return true;
    case 40: fn(std::integral_constant<Format, Format::Q8SM>{}); return true;
    case 52: fn(std::integral_constant<Format, Format::Q4K>{}); return true;
    case 60: fn(std::integral_constant<Format, Format::Q5K>{}); return true;
    case 72: fn(std::integral_constant<Format, Format::Q6>{}); return true;
    case 88: fn(std::integral_constant<Format, Format::Q6S>{}); return true;
    case 92: fn(std::integral_constant<Format, Format::Q6M>{}); return true;
    case 104: fn(std::integral_constant<Format, Format::Q6SM>{}); return true;
    case 120: fn(std::integral_constant<Format, Format::Q6K>{}); return true;
    default: return false;
  }
}

// A column block's bytes at run time over KB k blocks (0: no such format, or KB does not split
// into its super-blocks).
inline int64_t column_block_bytes(int64_t format, int64_t KB) {
  int64_t bytes = 0;
  with_format(format, [&](auto f) {
    constexpr Format F = decltype(f)::value;
    if (!PER_SUPER<F> || KB % SUPER == 0) bytes = column_bytes<F>(KB);
  });
  return bytes;
}

// Where a six-bit format's high bits of group g (codes 4g to 4g + 3) lie: in the 64 bytes at 256 + 64 * (g % 4 / 2),
// each byte holding 2 bits of groups 2k, 2k + 4, 2k + 1 and 2k + 5 (k = g % 4 / 2) from its low end.
constexpr int high_bits_shift(int g) { return (g % 2) * 4 + (g < 4 ? 0 : 2); }

// Column j's code k of a block: q of the nibble formats and Q8M, less the zero's code in the others.
template <Format F> inline int32_t code_at(const uint8_t* block, int64_t j, int64_t k) {
  const int64_t g = k / 4, i = k % 4;
  if constexpr (NIBBLES<F> || SIX_BITS<F> || FIVE_BITS<F>) {
    const uint8_t byte = block[(g % 4) * 64 + j * 4 + i];
    const int32_t low = g < 4 ? (byte & 0x0f) : (byte >> 4);
    if constexpr (SIX_BITS<F>) {
      const uint8_t high = block[256 + (g % 4 / 2) * 64 + j * 4 + i];
      return (low | ((high >> high_bits_shift(int(g))) & 3) << 4) - ZERO<F>;
    }
    if constexpr (FIVE_BITS<F>) return low | ((block[256 + g * 8 + (j * 4 + i) / 8] >> ((j * 4 + i) % 8)) & 1) << 4;
    return low;
  } else {
    return int32_t(block[g * 64 + j * 4 + i]) - ZERO<F>;
  }
}

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return half_to_float(bits);
}

// Column j's scale for the codes of half h of k block kb (d, times s or s_h where stepped) and its
// minimum (m, times t where stepped; the formats with one): each an exact product. `column`: the
// column block's first byte.
template <Format F> inline float scale_at(const uint8_t* column, int64_t kb, int64_t j, int64_t h) {
  const Offsets at = offsets<F>(kb);
  const float d = half_at(column + at.scales + 2 * j);
  if constexpr (STEP_AND_MIN<F>) return d * float(column[at.steps + j]);
  if constexpr (HALF_STEPS<F>) return d * float(int8_t(column[at.steps + HALF * h + j]));
  return d;
}
template <Format F> inline float min_at(const uint8_t* column, int64_t kb, int64_t j) {
  const Offsets at = offsets<F>(kb);
  const float m = half_at(column + at.scales + 32 + 2 * j);
  return MIN_STEP<F> ? m * float(column[at.steps + MIN_STEPS_AT<F> + j]) : m;
}

// K block kb's scales, minimums and steps (in `column`) into `to`, a block of format B that holds
// the same numbers for every block (unpacking for many rows): all that follows the codes, as it
// is, or a super-block's d and m and then the block's steps.
template <Format F, Format B> inline void copy_scales_and_steps(const uint8_t* column, int64_t kb, uint8_t* to) {
  const Offsets at = offsets<F>(kb);
  if constexpr (PER_SUPER<F>) {
    std::memcpy(to + SCALES_AT<B>, column + at.scales, SUPER_HEADER<F>);
    std::memcpy(to + STEPS_AT<B>, column + at.steps, BLOCK_BYTES<B> - STEPS_AT<B>);
  } else {
    std::memcpy(to + SCALES_AT<B>, column + at.scales, BLOCK_BYTES<F> - (at.scales - at.codes));
  }
}

#if EMBER_AVX512 || EMBER_AVX2

// The kb-th of the KB equal shares of each of `count` column blocks from `next` (k block kb where
// the blocks are all alike; an eighth of a Q4K super-block), fetched into L2 line by line.
// (Inlined: left to itself, the compiler kept Q4K's prefetches out of the kernel's loop.)
template <Format F>
__attribute__((always_inline)) inline void prefetch_share(const uint8_t* next, int64_t column, int count, int64_t kb) {
  constexpr int64_t SHARE = PER_SUPER<F> ? SUPER_BYTES<F> / SUPER : BLOCK_BYTES<F>;
  const int64_t first = kb * SHARE / 64 * 64, end = (kb + 1) * SHARE;
  for (int c = 0; c < count; ++c)
    for (int64_t line = first; line < end; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(next + c * column + line), _MM_HINT_T1);
}

#endif

#if EMBER_AVX512

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
        __m512 d = load_halves(scales[c]);
        __m512 mins = HAS_MIN<F> ? load_halves(scales[c] + 32) : _mm512_setzero_ps();
        if constexpr (STEP_AND_MIN<F>) {
          d = _mm512_mul_ps(d, load_steps(steps[c], false));
          mins = _mm512_mul_ps(mins, load_steps(steps[c] + MIN_STEPS_AT<F>, false));
        }
        for (int r = 0; r < MR; ++r) {
          const int64_t row = (m0 + r) * KB + kb;
          __m512i dot = dots[r][c];
          if constexpr (OFFSET<F>) dot = _mm512_sub_epi32(dot, _mm512_set1_epi32(ZERO<F> * qsum[row]));
          const __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(dx[row]));
          acc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc[r][c]);
          if constexpr (HAS_MIN<F>) acc[r][c] = _mm512_fmadd_ps(mins, _mm512_set1_ps(sx[row]), acc[r][c]);
        }
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

// Column blocks [nb, nb + NB) (their bytes from `w`) against every row, in tiles of four rows; a
// remainder of one or two joins the first tile (five or six rows) rather than taking a pass of its
// own, which would unpack the weights once more for it, and a remainder of three takes the last
// tile. The blocks' weights stay in L1 while the rows pass, and each tile unpacks them once (a few
// rows, as in a drafted round's verification, cost little more than one). Every tile asks for
// `next` (a repeated ask finds its lines on their way), so memory stays busy however many tiles
// the rows take.
template <Format F, int NB, typename T>
inline void column_blocks(const uint8_t* w, int64_t KB, int64_t nb, int64_t N, const int8_t* xq, const float* dx,
                          const float* sx, const int32_t* qsum, const int32_t* qlow, int64_t K, int64_t M, T* y,
                          const float* start, const uint8_t* next) {
  int64_t m = 0;
  if (M >= 5 && M % 4 == 1) {
    tile<F, 5, NB>(w, KB, nb, N, xq, dx, sx, qsum, qlow, K, 0, y, start, next);
    m = 5;
  } else if (M >= 6 && M % 4 == 2) {
    tile<F, 6, NB>(w, KB, nb, N, xq, dx, sx, qsum, qlow, K, 0, y, start, next);
    m = 6;
  }
  for (; m + 4 <= M; m += 4) tile<F, 4, NB>(w, KB, nb, N, xq, dx, sx, qsum, qlow, K, m, y, start, next);
  switch (M - m) {
    case 3: tile<F, 3, NB>(w, KB, nb, N, xq, dx, sx, qsum, qlow, K, m, y, start, next); break;
    case 2: tile<F, 2, NB>(w, KB, nb, N, xq, dx, sx, qsum, qlow, K, m, y, start, next); break;
    case 1: tile<F, 1, NB>(w, KB, nb, N, xq, dx, sx, qsum, qlow, K, m, y, start, next); break;
    default: break;
  }
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

#elif EMBER_AVX2

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
// 2 * 128 * 127 a pair) goes straight to int32. `next` (or nullptr): the column block fetched
// into L2 as this one is computed, as on the AVX-512 path.
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
            dots[r] = _mm256_add_epi16(dots[r], _mm256_maddubs_epi16(lo, _mm256_set1_epi32(xk[r][p])));
            dots[r] = _mm256_add_epi16(dots[r], _mm256_maddubs_epi16(hi, _mm256_set1_epi32(xk[r][p + 4])));
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
                dots[r] = _mm256_add_epi32(dots[r], _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, x), ones));
              }
            } else {  // Q8M's codes are below 128: a pair is at most 2 * 127 * 127, within int16
              for (int r = 0; r < MR; ++r) {
                const __m256i x = _mm256_set1_epi32(xk[r][g]);
                dots[r] = _mm256_add_epi32(dots[r], _mm256_madd_epi16(_mm256_maddubs_epi16(codes, x), ones));
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

// x (M, K)'s rows quantized in blocks of 32 (quantize_rows), once for every weight that reads them.
struct QuantizedRows {
  int64_t M, K, KB;
  // quantize_rows writes every entry before any is read, so nothing is zeroed first (a prompt
  // chunk's codes are a megabyte a projection)
  std::unique_ptr<int8_t[]> codes;
  std::unique_ptr<float[]> scales;
  std::unique_ptr<int32_t[]> sums;
  int8_t* xq;
  float *dx, *sx;
  int32_t *qsum, *qlow;

  template <typename T>
  QuantizedRows(const T* x, int64_t M_, int64_t K_)
      : M(M_), K(K_), KB(K_ / QBLOCK), codes(new int8_t[M_ * K_]), scales(new float[2 * M_ * KB]),
        sums(new int32_t[2 * M_ * KB]) {
    xq = codes.get();
    dx = scales.get(), sx = dx + M * KB;
    qsum = sums.get(), qlow = qsum + M * KB;
    quantize_rows<T>(x, M, K, xq, dx, sx, qsum, qlow);
  }
};

// Column blocks [nb_first, nb_first + count) of y (M, N) from weights in format F, the first
// block's bytes at `w`. `start` (or nullptr: zero): the (M, N) float32 sums to continue; it may
// be y itself.
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
    const auto pass = [&](int64_t b, int n, const uint8_t* next) {
      if constexpr (U != F) {
        if (unpacked) {
          for (int c = 0; c < n; ++c)
            unpack<F>(w + (b + c) * column, KB, unpacked.get() + c * column_bytes<U>(KB));
          columns<U>(unpacked.get(), KB, nb_first + b, n, N, xq, dx, sx, qsum, qlow, K, M, y, start, nullptr);
          return;
        }
      }
      columns<F>(w + b * column, KB, nb_first + b, n, N, xq, dx, sx, qsum, qlow, K, M, y, start, next);
    };
#endif
#if EMBER_AVX512
    int64_t b = first;
    for (; b + 2 <= last; b += 2)  // a pair fetches the next pair, when there is one
      pass(b, 2, b + 4 <= last ? w + (b + 2) * column : nullptr);
    if (b < last) pass(b, 1, nullptr);
#elif EMBER_AVX2
    for (int64_t b = first; b < last; ++b)  // a block fetches the next, when there is one
      pass(b, 1, b + 1 < last ? w + (b + 1) * column : nullptr);
#else
    columns_plain<F>(w + first * column, KB, nb_first + first, nb_first + last, N, xq, dx, sx, qsum, K, M, y, start);
#endif
  });
}

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
    const QuantizedRows rows(static_cast<const T*>(x.data_ptr()), M, K);
    T* yp = static_cast<T*>(y.data_ptr());
    int64_t nb = 0;
    for (size_t p = 0; p < P; ++p) {
      const int64_t count = (out_features[p] + NBLOCK - 1) / NBLOCK;
      with_format(formats[p], [&](auto f) {
        column_range<decltype(f)::value>(rows, packed[p].data_ptr<uint8_t>(), nb, count, N, yp, nullptr);
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
  const QuantizedRows rows(x.data_ptr<float>(), M, K);
  float* sp = sums.data_ptr<float>();
  const int64_t count = (N + NBLOCK - 1) / NBLOCK;
  with_format(format, [&](auto f) {
    column_range<decltype(f)::value>(rows, packed.data_ptr<uint8_t>(), 0, count, N, sp, sp);
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

}  // namespace ember_kernels

TORCH_LIBRARY_FRAGMENT(EMBER_OPS, m) {
  m.def("quantized_linear(Tensor x, Tensor packed, int out_features, int format) -> Tensor");
  m.def("quantized_linear_parts(Tensor x, Tensor[] packed, int[] out_features, int[] formats) -> Tensor");
  m.def("quantized_linear_accumulate_(Tensor x, Tensor packed, int out_features, int format, Tensor(a!) sums) -> ()");
  m.def("vector_bits() -> int", &ember_kernels::vector_bits);
  m.def("block_rows(Tensor packed, Tensor ids, int in_features, int format, ScalarType dtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(EMBER_OPS, CPU, m) {
  m.impl("quantized_linear", &ember_kernels::quantized_linear);
  m.impl("quantized_linear_parts", &ember_kernels::quantized_linear_parts);
  m.impl("quantized_linear_accumulate_", &ember_kernels::quantized_linear_accumulate_);
  m.impl("block_rows", &ember_kernels::block_rows);
}
