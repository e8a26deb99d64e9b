// A bfloat16 Llama-family model's decoder layers over one pass's new tokens, on the CPU, in one
// call. Decoding a small model at batch 1 costs a fifth of each pass in the Python and PyTorch
// glue between its kernels (SmolLM2-135M: 1.65 of 8.3 ms, 270 kernel calls a pass); here the
// calls follow one another in C++.
//
// Each layer calls the kernels the packed pass (tlt_core.model.packed.run_layers) calls one by
// one, in the same order with the same arguments, so the pass computes the same bits:
//   h, x    = add_rms_norm(h, -, input_norm)                 rms_norm.h
//   qkv     = x @ qkv (+ qkv bias)                           panel_matmul.h
//   each q head and k head of qkv: add_rms_norm(head, -, q_norm / k_norm)   (Qwen3; optional)
//   q       = rope_kv_write(qkv) (k and v into the cache)    rope.h
//   a       = decode_attention(q) in bfloat16                attention.h
//   h       = a @ o (+ o bias) + h
//   h, x    = add_rms_norm(h, -, post_attention_norm)
//   m       = silu_mul(x @ gate_up)                          silu_mul.h
//   h       = m @ down + h
// h[R, H] (R = B * T rows, row r = b * T + t) is updated in place; after layer saved_layers[i]
// it is copied to saved[i] ([R, H] each). What the layers share (shapes, the cache, RoPE
// tables, positions, write slots and the attention mask) is one DecoderStep; the kernels'
// headers give each argument's meaning. Products are bfloat16 panels or pairs (pack_panels).
//
// Checked before anything is written (std::invalid_argument naming the argument): sizes,
// null pointers, saved layer indices, then each kernel's own checks. Work space is the calling
// thread's, reused across calls.
#pragma once

#include <cstdint>

#include "tlt/common.h"

namespace tlt {

// A weight matrix as panel_matmul.h takes it: in_features from the layer's shapes.
struct PanelWeightBf16 {
  const uint16_t* panels;  // pack_panels(W) [ceil(N / 16), K, 16] or pairs [.., K / 2, 16, 2]
  int64_t out_features;    // N
  bool pairs;              // the pairs layout (panel_matmul_bf16_pairs_cpu)
  const uint16_t* bias;    // [N] or null
};

struct DecoderLayerBf16 {
  const uint16_t* input_norm;  // [H] RMSNorm weight, or null: none (x = h; EAGLE's drafter)
  float input_eps;
  PanelWeightBf16 qkv;         // H -> (H_q + 2 H_kv) d
  // [d] RMSNorm weights of each q head and each k head after the product, or both null: none
  const uint16_t* q_norm;
  const uint16_t* k_norm;
  float qk_eps;
  PanelWeightBf16 o;           // H_q d -> H
  const uint16_t* post_attention_norm;  // [H]
  float post_attention_eps;
  PanelWeightBf16 gate_up;     // H -> 2 I
  PanelWeightBf16 down;        // I -> H
};

struct DecoderStep {
  int64_t batch, tokens;  // B, T
  int64_t hidden, q_heads, kv_heads, head_dim, intermediate;  // H, H_q, H_kv, d, I
  // The KV cache [L, 2, B, H_kv, max_len, d], float32 or bfloat16 (cache_type), strides in
  // elements; slots dense rows of d.
  void* cache;
  FloatType cache_type;
  int64_t layer_stride, plane_stride, row_stride, head_stride, max_len;
  const uint16_t* cos;         // [table_len, d] (rope.h)
  const uint16_t* sin_signed;  // [table_len, d]
  int64_t table_len;
  const int64_t* positions;    // [B, T]
  const int64_t* slots;        // [B, T] cache slot each new token is written to
  const uint8_t* mask;         // attention.h's mask, or null
  int64_t mask_batch_stride, mask_token_stride;
  int64_t read_len;            // S: cache slots attention reads
};

void decoder_layers_bf16_cpu(const DecoderLayerBf16* layers, int64_t num_layers,
                             const DecoderStep& step, uint16_t* h, const int64_t* saved_layers,
                             uint16_t* const* saved, int64_t num_saved);

}  // namespace tlt
