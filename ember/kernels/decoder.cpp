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

}  // namespace
}  // namespace ember_kernels

TORCH_LIBRARY_FRAGMENT(EMBER_OPS, m) {
  m.def("decoder_layers(Tensor x, Tensor[] weights, int[] formats, int[] out_features, Tensor[] norms, float eps, "
        "Tensor cos, Tensor sin, Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, Tensor slots, Tensor block_table, "
        "Tensor row_begin, Tensor first_pos, float scale, int[] windows, int heads, int kv_heads) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(EMBER_OPS, CPU, m) {
  m.impl("decoder_layers", &ember_kernels::decoder_layers);
}
