// Full (non-causal) bfloat16 attention for the vision tower: every query row of a piece against
// every key of one image tile, with an optional mask of the keys a row may see.
//
// A layer computes its keys and values once and attends to them piece by piece, so they are
// packed once per layer (tower_pack_kv) into the layouts the bfloat16 dot products read, in steps
// of STEP keys (the last step padded with zeros):
//   K of one head: (steps, D / 2, STEP, 2)   for each pair of dims, the step's keys' two values
//   V of one head: (steps * STEP / 2, D, 2)  for each pair of keys, every dim's two values
// so a step's scores and its weighted values are plain vector dot products (vdpbf16ps), with no
// transposition and no sum across lanes.
//
// A row takes the steps in order with an online softmax in float32, in base 2 (scores scaled by
// log2 e with the scale, then a polynomial 2^x): the running max and its correction, the step's
// probabilities rounded to bfloat16 for the values' products, their sum kept in 16 lanes until the
// end. A row's arithmetic depends on its own data alone, not on the rows beside it, so it gives the
// same bits in a piece of any size. Work items are (head, block of QUERY_BLOCK rows); within one,
// each step's K and V are read once from memory and shared by the block's rows, ROWS at a time,
// while they are in L1.
//
// The op is built only where the processor has the bfloat16 dot products (EMBER_BF16_DOT); the
// tower keeps torch's attention elsewhere.

#include "common.h"

#include <ATen/ATen.h>
#include <torch/library.h>

#if EMBER_BF16_DOT

namespace ember_kernels {
namespace {

constexpr int64_t STEP = 64;         // keys per online-softmax step: four vectors of scores
constexpr int ROWS = 4;              // query rows sharing each load of K and V
constexpr int64_t QUERY_BLOCK = 32;  // rows of one work item: their sums stay in L1 beside a step's K and V

// 2^x for x <= 0: 2^n * p(r), r = x - n in [-1/2, 1/2], p of degree 6 (relative error ~2e-7).
inline __m512 exp2_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-126.f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.5403530393381606e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3333558146428443e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(9.618129107628477e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.550410866482158e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(2.402265069591007e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(6.931471805599453e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// One row's running state: its max, the sum of its probabilities in 16 lanes, its D weighted values.
struct RowState {
  float max;
  float* sums;
  float* values;
};

// The scores of ROWS_ rows against one step's keys, then their probabilities into `probs` (bfloat16
// pairs, in key order) and the rows' max, sums and the correction of their values into `correction`.
template <int ROWS_, int D>
inline void step_probabilities(const uint32_t* const* q, const uint32_t* kstep, uint64_t visible, float scale,
                               RowState* rows, uint32_t (*probs)[STEP / 2], float* correction) {
  __m512 acc[ROWS_][4];
  for (int r = 0; r < ROWS_; ++r)
    for (int s = 0; s < 4; ++s) acc[r][s] = _mm512_setzero_ps();
  for (int i = 0; i < D / 2; ++i) {
    __m512bh k[4];
    for (int s = 0; s < 4; ++s) k[s] = (__m512bh)_mm512_loadu_si512(kstep + i * STEP + 16 * s);
    for (int r = 0; r < ROWS_; ++r) {
      const __m512bh pair = (__m512bh)_mm512_set1_epi32(int(q[r][i]));
      for (int s = 0; s < 4; ++s) acc[r][s] = _mm512_dpbf16_ps(acc[r][s], k[s], pair);
    }
  }
  const __m512 vscale = _mm512_set1_ps(scale * 1.44269504088896341f);  // scores in base 2
  for (int r = 0; r < ROWS_; ++r) {
    __m512 scores[4];
    __m512 vmax = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int s = 0; s < 4; ++s) {
      scores[s] = _mm512_mul_ps(acc[r][s], vscale);
      vmax = _mm512_mask_max_ps(vmax, __mmask16(visible >> (16 * s)), vmax, scores[s]);
    }
    // the step holds a visible key (steps without one are skipped), so the max is finite
    const float max = std::max(rows[r].max, _mm512_reduce_max_ps(vmax));
    correction[r] = std::exp2(rows[r].max - max);  // 0 on a row's first step (its max was -inf)
    rows[r].max = max;
    __m512 sums = _mm512_mul_ps(_mm512_loadu_ps(rows[r].sums), _mm512_set1_ps(correction[r]));
    __m512 p[4];
    for (int s = 0; s < 4; ++s) {
      p[s] = _mm512_maskz_mov_ps(__mmask16(visible >> (16 * s)),
                                 exp2_nonpositive(_mm512_sub_ps(scores[s], _mm512_set1_ps(max))));
      sums = _mm512_add_ps(sums, p[s]);
    }
    _mm512_storeu_ps(rows[r].sums, sums);
    _mm512_store_si512(probs[r], (__m512i)_mm512_cvtne2ps_pbh(p[1], p[0]));
    _mm512_store_si512(probs[r] + 16, (__m512i)_mm512_cvtne2ps_pbh(p[3], p[2]));
  }
}

// values = values * correction + probs . V over one step's keys, pair by pair in order, for ROWS_
// rows; D = 16 C + 8 TAIL (the last eight dims in half vectors).
template <int ROWS_, int C, int TAIL>
inline void step_values(const at::BFloat16* vstep, uint64_t visible, const uint32_t (*probs)[STEP / 2],
                        const float* correction, RowState* rows) {
  constexpr int D = 16 * C + 8 * TAIL;
  __m512 acc[ROWS_][C];
  __m256 tail[ROWS_];  // the last eight dims' sums, when TAIL
  for (int r = 0; r < ROWS_; ++r) {
    const __m512 factor = _mm512_set1_ps(correction[r]);
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_mul_ps(_mm512_loadu_ps(rows[r].values + 16 * c), factor);
    if constexpr (TAIL) tail[r] = _mm256_mul_ps(_mm256_loadu_ps(rows[r].values + 16 * C), _mm512_castps512_ps256(factor));
  }
  for (int j = 0; j < STEP / 2; ++j) {
    if (!((visible >> (2 * j)) & 3)) continue;  // both keys hidden: their probabilities are 0
    const at::BFloat16* pair_values = vstep + j * 2 * D;
    __m512bh p[ROWS_];
    for (int r = 0; r < ROWS_; ++r) p[r] = (__m512bh)_mm512_set1_epi32(int(probs[r][j]));
    for (int c = 0; c < C; ++c) {
      const __m512bh v = (__m512bh)_mm512_loadu_si512(pair_values + 32 * c);
      for (int r = 0; r < ROWS_; ++r) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], v, p[r]);
    }
    if constexpr (TAIL) {
      const __m256bh v = (__m256bh)_mm256_loadu_si256(reinterpret_cast<const __m256i*>(pair_values + 32 * C));
      for (int r = 0; r < ROWS_; ++r)
        tail[r] = _mm256_dpbf16_ps(tail[r], v, (__m256bh)_mm512_castsi512_si256((__m512i)p[r]));
    }
  }
  for (int r = 0; r < ROWS_; ++r) {
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(rows[r].values + 16 * c, acc[r][c]);
    if constexpr (TAIL) _mm256_storeu_ps(rows[r].values + 16 * C, tail[r]);
  }
}

// One step for ROWS_ rows: their probabilities, then their values, the latter in groups of rows
// whose sums fit in the registers.
template <int ROWS_, int C, int TAIL>
inline void attend_step(const uint32_t* const* q, const uint32_t* kstep, const at::BFloat16* vstep, uint64_t visible,
                        float scale, RowState* rows) {
  alignas(64) uint32_t probs[ROWS_][STEP / 2];
  float correction[ROWS_];
  step_probabilities<ROWS_, 16 * C + 8 * TAIL>(q, kstep, visible, scale, rows, probs, correction);
  constexpr int GROUP = C + TAIL <= 5 ? 4 : 2;
  if constexpr (ROWS_ <= GROUP) {
    step_values<ROWS_, C, TAIL>(vstep, visible, probs, correction, rows);
  } else {
    step_values<GROUP, C, TAIL>(vstep, visible, probs, correction, rows);
    step_values<ROWS_ - GROUP, C, TAIL>(vstep, visible, probs + GROUP, correction + GROUP, rows + GROUP);
  }
}

template <int C, int TAIL>
inline void attend_step_rows(int count, const uint32_t* const* q, const uint32_t* kstep, const at::BFloat16* vstep,
                             uint64_t visible, float scale, RowState* rows) {
  switch (count) {
    case 1: return attend_step<1, C, TAIL>(q, kstep, vstep, visible, scale, rows);
    case 2: return attend_step<2, C, TAIL>(q, kstep, vstep, visible, scale, rows);
    case 3: return attend_step<3, C, TAIL>(q, kstep, vstep, visible, scale, rows);
    default: return attend_step<4, C, TAIL>(q, kstep, vstep, visible, scale, rows);
  }
}

// Rows [r0, r1) of head h: every visible step in order, the rows ROWS at a time, then each row's
// values divided by its sum, rounded to bfloat16 into out (rows, heads * D).
template <int C, int TAIL>
void attend_block(const at::BFloat16* q, int64_t q_row_stride, int64_t q_head_stride, const at::BFloat16* kp,
                  const at::BFloat16* vp, const std::vector<uint64_t>& visible, int64_t h, int64_t r0, int64_t r1,
                  int64_t H, float scale, at::BFloat16* out) {
  constexpr int64_t D = 16 * C + 8 * TAIL;
  const int64_t R = r1 - r0, steps = int64_t(visible.size());
  alignas(64) float sums[QUERY_BLOCK][16];
  alignas(64) float values[QUERY_BLOCK][D];
  RowState rows[QUERY_BLOCK];
  const uint32_t* q_pairs[QUERY_BLOCK];
  for (int64_t i = 0; i < R; ++i) {
    std::fill(sums[i], sums[i] + 16, 0.f);
    std::fill(values[i], values[i] + D, 0.f);
    rows[i] = RowState{-std::numeric_limits<float>::infinity(), sums[i], values[i]};
    q_pairs[i] = reinterpret_cast<const uint32_t*>(q + (r0 + i) * q_row_stride + h * q_head_stride);
  }
  const uint32_t* kh = reinterpret_cast<const uint32_t*>(kp + h * steps * STEP * D);
  const at::BFloat16* vh = vp + h * steps * STEP * D;
  for (int64_t step = 0; step < steps; ++step) {
    if (!visible[step]) continue;
    const uint32_t* kstep = kh + step * (D / 2) * STEP;
    const at::BFloat16* vstep = vh + step * STEP * D;
    for (int64_t i = 0; i < R; i += ROWS)
      attend_step_rows<C, TAIL>(int(std::min<int64_t>(ROWS, R - i)), q_pairs + i, kstep, vstep, visible[step], scale,
                                rows + i);
  }
  for (int64_t i = 0; i < R; ++i) {
    const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(_mm512_load_ps(sums[i])));
    at::BFloat16* row_out = out + (r0 + i) * H * D + h * D;
    for (int c = 0; c < C; ++c)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(row_out + 16 * c),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(values[i] + 16 * c), inv)));
    if constexpr (TAIL)
      _mm_storeu_si128(reinterpret_cast<__m128i*>(row_out + 16 * C),
                       (__m128i)_mm256_cvtneps_pbh(_mm256_mul_ps(_mm256_loadu_ps(values[i] + 16 * C),
                                                                 _mm512_castps512_ps256(inv))));
  }
}

using BlockFn = void (*)(const at::BFloat16*, int64_t, int64_t, const at::BFloat16*, const at::BFloat16*,
                         const std::vector<uint64_t>&, int64_t, int64_t, int64_t, int64_t, float, at::BFloat16*);

// head_dim in eighths: 8 to 16 (64 to 128).
BlockFn block_for(int64_t D) {
  switch (D) {
    case 64: return &attend_block<4, 0>;
    case 72: return &attend_block<4, 1>;
    case 80: return &attend_block<5, 0>;
    case 88: return &attend_block<5, 1>;
    case 96: return &attend_block<6, 0>;
    case 104: return &attend_block<6, 1>;
    case 112: return &attend_block<7, 0>;
    case 120: return &attend_block<7, 1>;
    case 128: return &attend_block<8, 0>;
    default: TORCH_CHECK(false, "tower attention takes head_dim 64 to 128, a multiple of 8, not ", D);
  }
}

void check_heads(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 3 && t.stride(2) == 1 && t.scalar_type() == at::kBFloat16, name,
              " must be (patches, heads, head_dim) bfloat16 with contiguous head_dim");
}

// k, v (N, H, D) -> K and V packed as the header says, zeros past the last key.
std::tuple<at::Tensor, at::Tensor> tower_pack_kv(const at::Tensor& k, const at::Tensor& v) {
  check_heads(k, "k");
  check_heads(v, "v");
  TORCH_CHECK(v.sizes() == k.sizes(), "k and v must be alike");
  const int64_t N = k.size(0), H = k.size(1), D = k.size(2), steps = (N + STEP - 1) / STEP;
  TORCH_CHECK(D % 2 == 0 && k.stride(0) % 2 == 0 && k.stride(1) % 2 == 0, "head_dim and strides must be even");
  auto kp = at::empty({H, steps, D / 2, STEP, 2}, k.options());
  auto vp = at::empty({H, steps * STEP / 2, D, 2}, v.options());
  const at::BFloat16* ks = k.data_ptr<at::BFloat16>();
  const at::BFloat16* vs = v.data_ptr<at::BFloat16>();
  const int64_t k_row = k.stride(0), k_head = k.stride(1), v_row = v.stride(0), v_head = v.stride(1);
  uint32_t* kd = reinterpret_cast<uint32_t*>(kp.data_ptr<at::BFloat16>());
  uint16_t* vd = reinterpret_cast<uint16_t*>(vp.data_ptr<at::BFloat16>());
  // a step's heads in turn, while its rows of k and v are in cache
  at::parallel_for(0, steps * H, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t step = item / H, h = item % H;
      uint32_t* kstep = kd + (h * steps + step) * STEP * D / 2;  // (D / 2, STEP) pairs of dims
      uint16_t* vstep = vd + (h * steps + step) * STEP * D;      // (STEP / 2, D, 2)
      for (int64_t key = 0; key < STEP; ++key) {
        const int64_t n = step * STEP + key;
        uint16_t* vpair = vstep + (key / 2) * D * 2 + key % 2;
        if (n < N) {
          const uint32_t* krow = reinterpret_cast<const uint32_t*>(ks + n * k_row + h * k_head);
          const uint16_t* vrow = reinterpret_cast<const uint16_t*>(vs + n * v_row + h * v_head);
          for (int64_t i = 0; i < D / 2; ++i) kstep[i * STEP + key] = krow[i];
          for (int64_t d = 0; d < D; ++d) vpair[2 * d] = vrow[d];
        } else {
          for (int64_t i = 0; i < D / 2; ++i) kstep[i * STEP + key] = 0;
          for (int64_t d = 0; d < D; ++d) vpair[2 * d] = 0;
        }
      }
    }
  });
  return {kp, vp};
}

// q (R, H, D) rows against K and V packed by tower_pack_kv from `keys` keys; key_mask (keys,) bool,
// True where a row may see the key, or None for all. -> (R, H * D) bfloat16.
at::Tensor tower_attention(const at::Tensor& q, const at::Tensor& kp, const at::Tensor& vp,
                           const std::optional<at::Tensor>& key_mask, int64_t keys, double scale) {
  check_heads(q, "q");
  const int64_t R = q.size(0), H = q.size(1), D = q.size(2), steps = (keys + STEP - 1) / STEP;
  const BlockFn block = block_for(D);
  TORCH_CHECK(kp.is_contiguous() && vp.is_contiguous() && kp.scalar_type() == at::kBFloat16 &&
              vp.scalar_type() == at::kBFloat16 && kp.numel() == H * steps * STEP * D && vp.numel() == kp.numel(),
              "K and V must be packed by tower_pack_kv from `keys` keys of q's heads and head_dim");
  // The keys each step shows: bit t of step s for key s * STEP + t.
  std::vector<uint64_t> visible(steps, 0);
  const bool* mask = nullptr;
  if (key_mask.has_value()) {
    TORCH_CHECK(key_mask->scalar_type() == at::kBool && key_mask->is_contiguous() && key_mask->numel() == keys,
                "key_mask must be (keys,) bool");
    mask = key_mask->data_ptr<bool>();
  }
  bool any = false;
  for (int64_t n = 0; n < keys; ++n)
    if (!mask || mask[n]) {
      visible[n / STEP] |= uint64_t(1) << (n % STEP);
      any = true;
    }
  TORCH_CHECK(any, "tower attention needs a key a row may see");
  auto out = at::empty({R, H * D}, q.options());
  const int64_t blocks = (R + QUERY_BLOCK - 1) / QUERY_BLOCK;
  const at::BFloat16* qd = q.data_ptr<at::BFloat16>();
  at::parallel_for(0, H * blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t h = item / blocks, r0 = (item % blocks) * QUERY_BLOCK;
      block(qd, q.stride(0), q.stride(1), kp.data_ptr<at::BFloat16>(), vp.data_ptr<at::BFloat16>(), visible, h, r0,
            std::min(R, r0 + QUERY_BLOCK), H, float(scale), out.data_ptr<at::BFloat16>());
    }
  });
  return out;
}

}  // namespace
}  // namespace ember_kernels

TORCH_LIBRARY_FRAGMENT(EMBER_OPS, m) {
  m.def("tower_pack_kv(Tensor k, Tensor v) -> (Tensor, Tensor)");
  m.def("tower_attention(Tensor q, Tensor k_packed, Tensor v_packed, Tensor? key_mask, int keys, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(EMBER_OPS, CPU, m) {
  m.impl("tower_pack_kv", &ember_kernels::tower_pack_kv);
  m.impl("tower_attention", &ember_kernels::tower_attention);
}

#endif
