// CPU implementation of decoder_layers.h: the kernels of a layer called back to back, between
// them only pointer arithmetic.
#include "tlt/decoder_layers.h"

#include <cmath>
#include <cstring>
#include <vector>

#include "cpu_common.h"
#include "tlt/attention.h"
#include "tlt/panel_matmul.h"
#include "tlt/rms_norm.h"
#include "tlt/rope.h"
#include "tlt/silu_mul.h"

namespace tlt {
namespace {

// y[R, N] = x[R, K] @ W (+ bias) (+ addend), rows dense; y may be the addend (panel_matmul.h).
void product(const uint16_t* x, int64_t rows, int64_t in_features, const PanelWeightBf16& w,
             const uint16_t* addend, uint16_t* y) {
  const int64_t n = w.out_features;
  if (w.pairs) {
    panel_matmul_bf16_pairs_cpu(x, rows, in_features, in_features, w.panels, n, w.bias, addend,
                                n, y, n, 0);
  } else {
    panel_matmul_bf16_cpu(x, rows, in_features, in_features, w.panels, n, w.bias, addend, n, y,
                          n, 0);
  }
}

void check_weight(const PanelWeightBf16& w, int64_t out_features, const char* name) {
  cpu::require(w.panels != nullptr, name, "panels are null");
  cpu::require(w.out_features == out_features, name,
               "out_features must be " + std::to_string(out_features) + ", got " +
                   std::to_string(w.out_features));
}

void check_layer(const DecoderLayerBf16& layer, const DecoderStep& s) {
  const int64_t qkv_width = (s.q_heads + 2 * s.kv_heads) * s.head_dim;
  cpu::require((layer.q_norm == nullptr) == (layer.k_norm == nullptr), "q_norm",
               "q_norm and k_norm come together or not at all");
  cpu::require(layer.q_norm == nullptr || layer.qk_eps >= 0.f, "qk_eps", "must be >= 0");
  cpu::require(layer.post_attention_norm != nullptr, "post_attention_norm", "is null");
  cpu::require(layer.input_eps >= 0.f && layer.post_attention_eps >= 0.f, "eps",
               "must be >= 0");
  check_weight(layer.qkv, qkv_width, "qkv");
  check_weight(layer.o, s.hidden, "o");
  check_weight(layer.gate_up, 2 * s.intermediate, "gate_up");
  check_weight(layer.down, s.hidden, "down");
}

// The calling thread's activations between kernels, grown as needed.
struct Workspace {
  std::vector<uint16_t> normed, qkv, attended, gate_up, act, heads;
  // q as rope_kv_write lays it out, in the cache's type (a bfloat16 q fills its first half)
  std::vector<float> q;
};

// count heads of d values at `heads`, each RMSNormed with `weight` in place (through `scratch`:
// the kernel's output may not alias its input).
void norm_heads(uint16_t* heads, int64_t count, int64_t d, const uint16_t* weight, float eps,
                std::vector<uint16_t>& scratch) {
  add_rms_norm_bf16_cpu(heads, nullptr, weight, count, d, eps, heads, scratch.data());
  std::memcpy(heads, scratch.data(), count * d * sizeof(uint16_t));
}

}  // namespace

void decoder_layers_bf16_cpu(const DecoderLayerBf16* layers, int64_t num_layers,
                             const DecoderStep& s, uint16_t* h, const int64_t* saved_layers,
                             uint16_t* const* saved, int64_t num_saved) {
  cpu::require(num_layers >= 0 && (num_layers == 0 || layers != nullptr), "layers",
               "must be >= 0 layers, non-null when any");
  cpu::require(s.batch >= 0 && s.tokens >= 1, "h", "needs B >= 0 rows of T >= 1 tokens");
  cpu::require(s.hidden >= 1 && s.intermediate >= 1 && s.head_dim >= 2, "shape",
               "hidden, intermediate and head_dim must be >= 1 (head_dim >= 2)");
  cpu::require(s.kv_heads >= 1 && s.q_heads >= s.kv_heads && s.q_heads % s.kv_heads == 0,
               "kv_heads", "must be >= 1 and divide q_heads");
  cpu::require(s.layer_stride >= 0 && s.plane_stride >= 0, "cache",
               "layer and plane strides must be >= 0");
  cpu::require(s.cache_type == FloatType::kFloat32 || s.cache_type == FloatType::kBFloat16,
               "cache", "must be float32 or bfloat16");
  cpu::require(num_saved >= 0 && (num_saved == 0 || (saved_layers && saved)), "saved",
               "must be >= 0 layers, non-null when any");
  for (int64_t i = 0; i < num_saved; ++i) {
    cpu::require(saved_layers[i] >= 0 && saved_layers[i] < num_layers, "saved_layers",
                 "index " + std::to_string(saved_layers[i]) + " is not a layer");
  }
  for (int64_t i = 0; i < num_layers; ++i) check_layer(layers[i], s);
  const int64_t rows = s.batch * s.tokens;
  if (rows == 0) return;
  cpu::require(h != nullptr, "h", "is null");
  cpu::require(s.cache != nullptr, "cache", "is null");
  for (int64_t i = 0; i < num_saved; ++i) {
    cpu::require(saved[i] != nullptr, "saved", "an output is null");
  }

  const int64_t H = s.hidden, d = s.head_dim;
  const int64_t qkv_width = (s.q_heads + 2 * s.kv_heads) * d, q_width = s.q_heads * d;
  thread_local Workspace work;
  work.normed.resize(rows * H);
  work.qkv.resize(rows * qkv_width);
  work.q.resize(rows * q_width);
  const int64_t element = s.cache_type == FloatType::kBFloat16 ? 2 : 4;  // the cache's bytes
  work.attended.resize(rows * q_width);
  work.gate_up.resize(rows * 2 * s.intermediate);
  work.act.resize(rows * s.intermediate);
  work.heads.resize(s.q_heads * d);
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(d)));

  for (int64_t index = 0; index < num_layers; ++index) {
    const DecoderLayerBf16& layer = layers[index];
    char* keys = static_cast<char*>(s.cache) + index * s.layer_stride * element;
    char* values = keys + s.plane_stride * element;
    const uint16_t* x = h;
    if (layer.input_norm != nullptr) {
      add_rms_norm_bf16_cpu(h, nullptr, layer.input_norm, rows, H, layer.input_eps, h,
                            work.normed.data());
      x = work.normed.data();
    }
    product(x, rows, H, layer.qkv, nullptr, work.qkv.data());
    if (layer.q_norm != nullptr) {
      for (int64_t r = 0; r < rows; ++r) {
        uint16_t* heads = work.qkv.data() + r * qkv_width;
        norm_heads(heads, s.q_heads, d, layer.q_norm, layer.qk_eps, work.heads);
        norm_heads(heads + q_width, s.kv_heads, d, layer.k_norm, layer.qk_eps, work.heads);
      }
    }
    rope_kv_write_cpu(work.qkv.data(), FloatType::kBFloat16, s.batch, s.tokens, s.q_heads,
                      s.kv_heads, d, s.cos, s.sin_signed, s.table_len, s.positions, s.slots,
                      keys, values, s.cache_type, s.row_stride, s.head_stride, s.max_len,
                      work.q.data());
    decode_attention_cpu(work.q.data(), s.batch, s.q_heads, s.tokens, d, keys, values,
                         s.cache_type, s.kv_heads, s.row_stride, s.head_stride, s.max_len,
                         s.read_len, s.mask, s.mask_batch_stride, s.mask_token_stride, scale,
                         work.attended.data(), FloatType::kBFloat16);
    product(work.attended.data(), rows, q_width, layer.o, h, h);
    add_rms_norm_bf16_cpu(h, nullptr, layer.post_attention_norm, rows, H,
                          layer.post_attention_eps, h, work.normed.data());
    product(work.normed.data(), rows, H, layer.gate_up, nullptr, work.gate_up.data());
    silu_mul_cpu(work.gate_up.data(), FloatType::kBFloat16, rows, s.intermediate,
                 2 * s.intermediate, work.act.data());
    product(work.act.data(), rows, s.intermediate, layer.down, h, h);
    for (int64_t i = 0; i < num_saved; ++i) {
      if (saved_layers[i] == index) std::memcpy(saved[i], h, rows * H * sizeof(uint16_t));
    }
  }
}

}  // namespace tlt
