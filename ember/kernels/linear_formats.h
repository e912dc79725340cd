// ember's block formats for the linear kernel: their arithmetic, their bytes, and scalar readers
// of codes, scales and minimums. Part of linear.cpp (the formats are listed at its top) and of its
// column units (linear_column_range.h), which include it inside namespace
// ember_kernels::EMBER_LINEAR before everything that reads a packed weight.

#pragma once

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
