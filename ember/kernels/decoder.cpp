// A Llama-shaped decoder's layers in one call. Each layer runs the ops that ember/models/llama.py
// calls one by one from Python (norm with the residual add, fused qkv projection, rotary embedding
// and cache store, paged attention, output projection, norm, gate and up projection, SiLU and
// multiply, down projection), through the dispatcher, in the same order on the same tensors: the
// bits are the Python loop's. What goes is the interpreter's cost around each op, which on a
// small model decoding one row is as large as the layers' arithmetic.

#include "common.h"

#include <ATen/ATen.h>
#include <torch/library.h>

#include <ATen/core/dispatch/Dispatcher.h>

#include <string>
#include <vector>

#define EMBER_NAME(x) #x
#define EMBER_QUALIFIED(ns, op) EMBER_NAME(ns) "::" op

namespace ember_kernels {
namespace {

template <typename Signature>
c10::TypedOperatorHandle<Signature> find(const char* qualified_name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(qualified_name, "").typed<Signature>();
}

using Linear = at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, int64_t);
using LinearParts = at::Tensor(const at::Tensor&, at::TensorList, at::IntArrayRef, at::IntArrayRef);
using Norm = at::Tensor(const at::Tensor&, const at::Tensor&, double);
using AddNorm = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&, double);
using RotaryStore = void(at::Tensor&, const at::Tensor&, const at::Tensor&, at::Tensor&, at::Tensor&,
                         const at::Tensor&, int64_t, int64_t);
using Attention = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                             const at::Tensor&, const at::Tensor&, double, int64_t);
using SiluMul = at::Tensor(const at::Tensor&);
using Rotary = void(at::Tensor&, const at::Tensor&, const at::Tensor&);
using StoreKV = void(const at::Tensor&, const at::Tensor&, at::Tensor&, at::Tensor&, const at::Tensor&);

// The layers' projections: projection i is parts[i] consecutive entries of weights, each with its
// format and output width at the same index, stacked along the output (one part but where a fused
// projection's parts keep formats of their own).
class Projections {
 public:
  Projections(at::TensorList weights, at::IntArrayRef formats, at::IntArrayRef out_features, at::IntArrayRef parts)
      : weights_(weights), formats_(formats), out_features_(out_features), parts_(parts) {
    TORCH_CHECK(formats.size() == weights.size() && out_features.size() == weights.size(),
                "a format and an output width for each weight");
    int64_t first = 0;
    for (const int64_t count : parts) {
      TORCH_CHECK(count > 0, "every projection has a part");
      first_.push_back(first);
      first += count;
    }
    TORCH_CHECK(first == int64_t(weights.size()), "the projections' parts are the weights");
  }

  int64_t size() const { return int64_t(parts_.size()); }

  // Projection i's output width.
  int64_t width(int64_t i) const {
    int64_t total = 0;
    for (int64_t p = first_[i]; p < first_[i] + parts_[i]; ++p) total += out_features_[p];
    return total;
  }

  at::Tensor operator()(const at::Tensor& x, int64_t i) const {
    static const auto linear = find<Linear>(EMBER_QUALIFIED(EMBER_OPS, "quantized_linear"));
    static const auto linear_parts = find<LinearParts>(EMBER_QUALIFIED(EMBER_OPS, "quantized_linear_parts"));
    const int64_t p = first_[i], n = parts_[i];
    if (n == 1) return linear.call(x, weights_[p], out_features_[p], formats_[p]);
    return linear_parts.call(x, weights_.slice(p, n), out_features_.slice(p, n), formats_.slice(p, n));
  }

 private:
  at::TensorList weights_;
  at::IntArrayRef formats_, out_features_, parts_;
  std::vector<int64_t> first_;  // projection i's first part
};

// Layer l's projections are 4l .. 4l + 3 (qkv, attention output, gate and up, down); its norms are
// norms[2l] (input) and norms[2l + 1] (after attention); its cache k_caches[l], v_caches[l], its
// window windows[l] (0: none).
// x (T, hidden): the embeddings. Returns the last layer's output and the residual stream before
// it, as the Python loop leaves them for the final norm.
std::tuple<at::Tensor, at::Tensor> decoder_layers(
    const at::Tensor& x, at::TensorList weights, at::IntArrayRef formats, at::IntArrayRef out_features,
    at::IntArrayRef parts, at::TensorList norms, double eps, const at::Tensor& cos, const at::Tensor& sin,
    at::TensorList k_caches, at::TensorList v_caches, const at::Tensor& slots, const at::Tensor& block_table,
    const at::Tensor& row_begin, const at::Tensor& first_pos, double scale, at::IntArrayRef windows, int64_t heads,
    int64_t kv_heads) {
  const int64_t L = int64_t(k_caches.size());
  const Projections project(weights, formats, out_features, parts);
  TORCH_CHECK(L > 0 && project.size() == 4 * L && int64_t(norms.size()) == 2 * L && int64_t(v_caches.size()) == L &&
                  int64_t(windows.size()) == L,
              "four projections, two norms, one cache pair and one window per layer");
  TORCH_CHECK(x.dim() == 2, "x must be (T, hidden)");
  static const auto norm = find<Norm>(EMBER_QUALIFIED(EMBER_OPS, "rms_norm"));
  static const auto add_norm = find<AddNorm>(EMBER_QUALIFIED(EMBER_OPS, "add_rms_norm"));
  static const auto rotary_store = find<RotaryStore>(EMBER_QUALIFIED(EMBER_OPS, "rotary_store_"));
  static const auto attention = find<Attention>(EMBER_QUALIFIED(EMBER_OPS, "paged_attention"));
  static const auto silu_mul = find<SiluMul>(EMBER_QUALIFIED(EMBER_OPS, "silu_mul"));
  const int64_t T = x.size(0);
  const int64_t q_width = project.width(0) / (heads + 2 * kv_heads) * heads;  // heads * head_dim
  at::Tensor out = x, residual, h;
  for (int64_t l = 0; l < L; ++l) {
    const int64_t w = 4 * l;
    if (l == 0) {
      residual = out;
      h = norm.call(out, norms[0], eps);
    } else {
      std::tie(residual, h) = add_norm.call(residual, out, norms[2 * l], eps);
    }
    at::Tensor qkv = project(h, w);
    at::Tensor k_cache = k_caches[l], v_cache = v_caches[l];
    rotary_store.call(qkv, cos, sin, k_cache, v_cache, slots, heads, kv_heads);
    const at::Tensor q = qkv.narrow(1, 0, q_width).view({T, heads, q_width / heads});
    const at::Tensor attended = attention.call(q, k_cache, v_cache, block_table, row_begin, first_pos, scale, windows[l]);
    const at::Tensor projected = project(attended.view({T, q_width}), w + 1);
    std::tie(residual, h) = add_norm.call(residual, projected, norms[2 * l + 1], eps);
    out = project(silu_mul.call(project(h, w + 2)), w + 3);
  }
  return {out, residual};
}

// Gemma 3's layers in one call: the ops of ember/models/gemma3_text.py's loop with fused ops, in its
// order. Per layer: the input norm, the fused qkv projection, the norms on q and on k and their
// rotary embeddings (the layer's own tables, local or global: cos[l], sin[l]), q times q_scale
// where it is not 1, k and v into the cache and paged attention, the output projection, its norm
// added to the residual stream, the norm before the MLP, the gate and up projection, GELU (tanh)
// times up, the down projection and its norm added. Layer l's projections are 4l .. 4l + 3 as
// decoder_layers' are; its norms' scales (1 + weight, float32) scales[6l .. 6l + 5]: input, q, k,
// after attention, before and after the MLP. x (T, hidden): the scaled embeddings. Returns the
// residual stream after the last layer, as the loop leaves it for the final norm.
at::Tensor gemma_decoder_layers(
    const at::Tensor& x, at::TensorList weights, at::IntArrayRef formats, at::IntArrayRef out_features,
    at::IntArrayRef parts, at::TensorList scales, double eps, at::TensorList cos, at::TensorList sin, double q_scale,
    at::TensorList k_caches, at::TensorList v_caches, const at::Tensor& slots, const at::Tensor& block_table,
    const at::Tensor& row_begin, const at::Tensor& first_pos, double scale, at::IntArrayRef windows, int64_t heads,
    int64_t kv_heads) {
  const int64_t L = int64_t(k_caches.size());
  const Projections project(weights, formats, out_features, parts);
  TORCH_CHECK(L > 0 && project.size() == 4 * L && int64_t(scales.size()) == 6 * L && int64_t(cos.size()) == L &&
                  int64_t(sin.size()) == L && int64_t(v_caches.size()) == L && int64_t(windows.size()) == L,
              "four projections, six norm scales, rotary tables, one cache pair and one window per layer");
  TORCH_CHECK(x.dim() == 2, "x must be (T, hidden)");
  static const auto norm = find<Norm>(EMBER_QUALIFIED(EMBER_OPS, "scaled_rms_norm"));
  static const auto rotary = find<Rotary>(EMBER_QUALIFIED(EMBER_OPS, "rotary_"));
  static const auto store = find<StoreKV>(EMBER_QUALIFIED(EMBER_OPS, "store_kv_"));
  static const auto attention = find<Attention>(EMBER_QUALIFIED(EMBER_OPS, "paged_attention"));
  const int64_t T = x.size(0);
  const int64_t head_dim = project.width(0) / (heads + 2 * kv_heads);
  const int64_t q_width = heads * head_dim, kv_width = kv_heads * head_dim;
  at::Tensor stream = x;
  for (int64_t l = 0; l < L; ++l) {
    const int64_t w = 4 * l, n = 6 * l;
    const at::Tensor qkv = project(norm.call(stream, scales[n], eps), w);
    at::Tensor q = norm.call(qkv.narrow(1, 0, q_width).view({T, heads, head_dim}), scales[n + 1], eps);
    at::Tensor k = norm.call(qkv.narrow(1, q_width, kv_width).view({T, kv_heads, head_dim}), scales[n + 2], eps);
    const at::Tensor v = qkv.narrow(1, q_width + kv_width, kv_width).view({T, kv_heads, head_dim});
    rotary.call(q, cos[l], sin[l]);
    rotary.call(k, cos[l], sin[l]);
    if (q_scale != 1.0) q = at::mul(q, q_scale);
    at::Tensor k_cache = k_caches[l], v_cache = v_caches[l];
    store.call(k, v, k_cache, v_cache, slots);
    const at::Tensor attended = attention.call(q, k_cache, v_cache, block_table, row_begin, first_pos, scale, windows[l]);
    const at::Tensor projected = project(attended.view({T, q_width}), w + 1);
    stream = at::add(stream, norm.call(projected, scales[n + 3], eps));
    const at::Tensor gate_up = project(norm.call(stream, scales[n + 4], eps), w + 2);
    const int64_t inner = gate_up.size(1) / 2;
    const at::Tensor act = at::mul(at::gelu(gate_up.narrow(1, 0, inner), "tanh"), gate_up.narrow(1, inner, inner));
    const at::Tensor down = project(act, w + 3);
    stream = at::add(stream, norm.call(down, scales[n + 5], eps));
  }
  return stream;
}

}  // namespace
}  // namespace ember_kernels

TORCH_LIBRARY_FRAGMENT(EMBER_OPS, m) {
  m.def("decoder_layers(Tensor x, Tensor[] weights, int[] formats, int[] out_features, int[] parts, Tensor[] norms, "
        "float eps, Tensor cos, Tensor sin, Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, Tensor slots, "
        "Tensor block_table, Tensor row_begin, Tensor first_pos, float scale, int[] windows, int heads, "
        "int kv_heads) -> (Tensor, Tensor)");
  m.def("gemma_decoder_layers(Tensor x, Tensor[] weights, int[] formats, int[] out_features, int[] parts, "
        "Tensor[] scales, float eps, Tensor[] cos, Tensor[] sin, float q_scale, Tensor(a!)[] k_caches, "
        "Tensor(b!)[] v_caches, Tensor slots, Tensor block_table, Tensor row_begin, Tensor first_pos, float scale, "
        "int[] windows, int heads, int kv_heads) -> Tensor");
}

TORCH_LIBRARY_IMPL(EMBER_OPS, CPU, m) {
  m.impl("decoder_layers", &ember_kernels::decoder_layers);
  m.impl("gemma_decoder_layers", &ember_kernels::gemma_decoder_layers);
}
