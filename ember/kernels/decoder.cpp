// A Llama-shaped decoder's layers in one call. Each layer runs the ops that ember/models/llama.py
// calls one by one from Python (norm with the residual add, fused qkv projection, rotary embedding
// and cache store, paged attention, output projection, norm, gate and up projection, SiLU and
// multiply, down projection), through the dispatcher, in the same order on the same tensors: the
// bits are the Python loop's. What goes is the interpreter's cost around each op, which on a
// small model decoding one row is as large as the layers' arithmetic.

#include "common.h"

#include <ATen/core/dispatch/Dispatcher.h>

#include <string>

#define EMBER_NAME(x) #x
#define EMBER_QUALIFIED(ns, op) EMBER_NAME(ns) "::" op

namespace ember_kernels {
namespace {

template <typename Signature>
c10::TypedOperatorHandle<Signature> find(const char* qualified_name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(qualified_name, "").typed<Signature>();
}

using Linear = at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, int64_t);
using Norm = at::Tensor(const at::Tensor&, const at::Tensor&, double);
using AddNorm = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&, double);
using RotaryStore = void(at::Tensor&, const at::Tensor&, const at::Tensor&, at::Tensor&, at::Tensor&,
                         const at::Tensor&, int64_t, int64_t);
using Attention = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                             const at::Tensor&, const at::Tensor&, double, int64_t);
using SiluMul = at::Tensor(const at::Tensor&);
using Rotary = void(at::Tensor&, const at::Tensor&, const at::Tensor&);
using StoreKV = void(const at::Tensor&, const at::Tensor&, at::Tensor&, at::Tensor&, const at::Tensor&);

// Layer l's weights are weights[4l .. 4l + 3] (qkv, attention output, gate and up, down), each with
// its bits and output width at the same index; its norms are norms[2l] (input) and norms[2l + 1]
// (after attention); its cache k_caches[l], v_caches[l], its window windows[l] (0: none).
// x (T, hidden): the embeddings. Returns the last layer's output and the residual stream before
// it, as the Python loop leaves them for the final norm.
std::tuple<at::Tensor, at::Tensor> decoder_layers(
    const at::Tensor& x, at::TensorList weights, at::IntArrayRef formats, at::IntArrayRef out_features,
    at::TensorList norms, double eps, const at::Tensor& cos, const at::Tensor& sin, at::TensorList k_caches,
    at::TensorList v_caches, const at::Tensor& slots, const at::Tensor& block_table, const at::Tensor& row_begin,
    const at::Tensor& first_pos, double scale, at::IntArrayRef windows, int64_t heads, int64_t kv_heads) {
  const int64_t L = int64_t(k_caches.size());
  TORCH_CHECK(L > 0 && int64_t(weights.size()) == 4 * L && int64_t(formats.size()) == 4 * L &&
                  int64_t(out_features.size()) == 4 * L && int64_t(norms.size()) == 2 * L &&
                  int64_t(v_caches.size()) == L && int64_t(windows.size()) == L,
              "four weights, two norms, one cache pair and one window per layer");
  TORCH_CHECK(x.dim() == 2, "x must be (T, hidden)");
  static const auto linear = find<Linear>(EMBER_QUALIFIED(EMBER_OPS, "quantized_linear"));
  static const auto norm = find<Norm>(EMBER_QUALIFIED(EMBER_OPS, "rms_norm"));
  static const auto add_norm = find<AddNorm>(EMBER_QUALIFIED(EMBER_OPS, "add_rms_norm"));
  static const auto rotary_store = find<RotaryStore>(EMBER_QUALIFIED(EMBER_OPS, "rotary_store_"));
  static const auto attention = find<Attention>(EMBER_QUALIFIED(EMBER_OPS, "paged_attention"));
  static const auto silu_mul = find<SiluMul>(EMBER_QUALIFIED(EMBER_OPS, "silu_mul"));
  const int64_t T = x.size(0);
  const int64_t q_width = out_features[0] / (heads + 2 * kv_heads) * heads;  // heads * head_dim
  at::Tensor out = x, residual, h;
  for (int64_t l = 0; l < L; ++l) {
    const int64_t w = 4 * l;
    if (l == 0) {
      residual = out;
      h = norm.call(out, norms[0], eps);
    } else {
      std::tie(residual, h) = add_norm.call(residual, out, norms[2 * l], eps);
    }
    at::Tensor qkv = linear.call(h, weights[w], out_features[w], formats[w]);
    at::Tensor k_cache = k_caches[l], v_cache = v_caches[l];
    rotary_store.call(qkv, cos, sin, k_cache, v_cache, slots, heads, kv_heads);
    const at::Tensor q = qkv.narrow(1, 0, q_width).view({T, heads, q_width / heads});
    const at::Tensor attended = attention.call(q, k_cache, v_cache, block_table, row_begin, first_pos, scale, windows[l]);
    const at::Tensor projected = linear.call(attended.view({T, q_width}), weights[w + 1], out_features[w + 1], formats[w + 1]);
    std::tie(residual, h) = add_norm.call(residual, projected, norms[2 * l + 1], eps);
    const at::Tensor gate_up = linear.call(h, weights[w + 2], out_features[w + 2], formats[w + 2]);
    out = linear.call(silu_mul.call(gate_up), weights[w + 3], out_features[w + 3], formats[w + 3]);
  }
  return {out, residual};
}

// Gemma 3's layers in one call: the ops of ember/models/gemma3_text.py's loop with fused ops, in its
// order. Per layer: the input norm, the fused qkv projection, the norms on q and on k and their
// rotary embeddings (the layer's own tables, local or global: cos[l], sin[l]), q times q_scale
// where it is not 1, k and v into the cache and paged attention, the output projection, its norm
// added to the residual stream, the norm before the MLP, the gate and up projection, GELU (tanh)
// times up, the down projection and its norm added. Layer l's weights are weights[4l .. 4l + 3] as
// decoder_layers' are; its norms' scales (1 + weight, float32) scales[6l .. 6l + 5]: input, q, k,
// after attention, before and after the MLP. x (T, hidden): the scaled embeddings. Returns the
// residual stream after the last layer, as the loop leaves it for the final norm.
at::Tensor gemma_decoder_layers(
    const at::Tensor& x, at::TensorList weights, at::IntArrayRef formats, at::IntArrayRef out_features,
    at::TensorList scales, double eps, at::TensorList cos, at::TensorList sin, double q_scale,
    at::TensorList k_caches, at::TensorList v_caches, const at::Tensor& slots, const at::Tensor& block_table,
    const at::Tensor& row_begin, const at::Tensor& first_pos, double scale, at::IntArrayRef windows, int64_t heads,
    int64_t kv_heads) {
  const int64_t L = int64_t(k_caches.size());
  TORCH_CHECK(L > 0 && int64_t(weights.size()) == 4 * L && int64_t(formats.size()) == 4 * L &&
                  int64_t(out_features.size()) == 4 * L && int64_t(scales.size()) == 6 * L &&
                  int64_t(cos.size()) == L && int64_t(sin.size()) == L && int64_t(v_caches.size()) == L &&
                  int64_t(windows.size()) == L,
              "four weights, six norm scales, rotary tables, one cache pair and one window per layer");
  TORCH_CHECK(x.dim() == 2, "x must be (T, hidden)");
  static const auto linear = find<Linear>(EMBER_QUALIFIED(EMBER_OPS, "quantized_linear"));
  static const auto norm = find<Norm>(EMBER_QUALIFIED(EMBER_OPS, "scaled_rms_norm"));
  static const auto rotary = find<Rotary>(EMBER_QUALIFIED(EMBER_OPS, "rotary_"));
  static const auto store = find<StoreKV>(EMBER_QUALIFIED(EMBER_OPS, "store_kv_"));
  static const auto attention = find<Attention>(EMBER_QUALIFIED(EMBER_OPS, "paged_attention"));
  const int64_t T = x.size(0);
  const int64_t head_dim = out_features[0] / (heads + 2 * kv_heads);
  const int64_t q_width = heads * head_dim, kv_width = kv_heads * head_dim;
  at::Tensor stream = x;
  for (int64_t l = 0; l < L; ++l) {
    const int64_t w = 4 * l, n = 6 * l;
    const at::Tensor qkv = linear.call(norm.call(stream, scales[n], eps), weights[w], out_features[w], formats[w]);
    at::Tensor q = norm.call(qkv.narrow(1, 0, q_width).view({T, heads, head_dim}), scales[n + 1], eps);
    at::Tensor k = norm.call(qkv.narrow(1, q_width, kv_width).view({T, kv_heads, head_dim}), scales[n + 2], eps);
    const at::Tensor v = qkv.narrow(1, q_width + kv_width, kv_width).view({T, kv_heads, head_dim});
    rotary.call(q, cos[l], sin[l]);
    rotary.call(k, cos[l], sin[l]);
    if (q_scale != 1.0) q = at::mul(q, q_scale);
    at::Tensor k_cache = k_caches[l], v_cache = v_caches[l];
    store.call(k, v, k_cache, v_cache, slots);
    const at::Tensor attended = attention.call(q, k_cache, v_cache, block_table, row_begin, first_pos, scale, windows[l]);
    const at::Tensor projected = linear.call(attended.view({T, q_width}), weights[w + 1], out_features[w + 1],
                                             formats[w + 1]);
    stream = at::add(stream, norm.call(projected, scales[n + 3], eps));
    const at::Tensor gate_up = linear.call(norm.call(stream, scales[n + 4], eps), weights[w + 2], out_features[w + 2],
                                           formats[w + 2]);
    const int64_t inner = out_features[w + 2] / 2;
    const at::Tensor act = at::mul(at::gelu(gate_up.narrow(1, 0, inner), "tanh"), gate_up.narrow(1, inner, inner));
    const at::Tensor down = linear.call(act, weights[w + 3], out_features[w + 3], formats[w + 3]);
    stream = at::add(stream, norm.call(down, scales[n + 5], eps));
  }
  return stream;
}

}  // namespace
}  // namespace ember_kernels

TORCH_LIBRARY_FRAGMENT(EMBER_OPS, m) {
  m.def("decoder_layers(Tensor x, Tensor[] weights, int[] formats, int[] out_features, Tensor[] norms, float eps, "
        "Tensor cos, Tensor sin, Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, Tensor slots, Tensor block_table, "
        "Tensor row_begin, Tensor first_pos, float scale, int[] windows, int heads, int kv_heads) -> (Tensor, Tensor)");
  m.def("gemma_decoder_layers(Tensor x, Tensor[] weights, int[] formats, int[] out_features, Tensor[] scales, "
        "float eps, Tensor[] cos, Tensor[] sin, float q_scale, Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, "
        "Tensor slots, Tensor block_table, Tensor row_begin, Tensor first_pos, float scale, int[] windows, int heads, "
        "int kv_heads) -> Tensor");
}

TORCH_LIBRARY_IMPL(EMBER_OPS, CPU, m) {
  m.impl("decoder_layers", &ember_kernels::decoder_layers);
  m.impl("gemma_decoder_layers", &ember_kernels::gemma_decoder_layers);
}
