// Rotary position embedding of a decoder layer's fused q|k|v projection, with k and v written
// into the KV cache and q laid out for attention: what a decode step does between the qkv
// matmul and attention, in one call instead of a dozen tensor ops (a small model decoding on a
// CPU pays per op, not per flop).
//
// qkv[R, H_q + 2 H_kv, d] (R = B * T rows, row r = b * T + t), in the model's dtype. For each
// row and each of its H_q query and H_kv key heads x (d values, half = d / 2), with c and s the
// rows positions[r] of the tables cos[P, d] and sin_signed[P, d] (sin with its first half
// negated: transformers' rotate_half(x) * sin = roll(x, half) * sin_signed):
//   rope(x)[i] = round(round(x[i] * c[i]) + x[(i + half) % d] * s[i])
// computed in float32 with one rounding of the sum (a fused multiply-add), round() being the
// model dtype's rounding (none for float32; nearest-even for bfloat16, NaN -> 0x7FC0): exactly
// PyTorch's vectorised `addcmul(x * cos, roll(x, half), sin_signed)` on those dtypes. Then, in the cache's dtype (widened exactly or rounded nearest-even):
//   q_out[b, h, t, :]            = rope(q head h of row r)      q_out [B, H_q, T, d]
//   cache_k[b, h, slots[r], :]   = rope(k head h of row r)
//   cache_v[b, h, slots[r], :]   = v head h of row r
// where element (b, h, s, i) of cache_k / cache_v lies at b * row_stride + h * head_stride +
// s * d + i (strides in elements; the head-major cache [.., B, H_kv, max_len, d]).
//
// Checked before anything is written (std::invalid_argument naming the argument): sizes,
// dtypes (float32 or bfloat16), every position in [0, table_len), every slot in [0, max_len),
// strides that keep rows and heads apart. Nothing else of the cache is touched.
#pragma once

#include <cstdint>

#include "tlt/common.h"

namespace tlt {

void rope_kv_write_cpu(const void* qkv, FloatType model_type, int64_t batch, int64_t tokens,
                       int64_t q_heads, int64_t kv_heads, int64_t head_dim, const void* cos,
                       const void* sin_signed, int64_t table_len, const int64_t* positions,
                       const int64_t* slots, void* cache_k, void* cache_v, FloatType cache_type,
                       int64_t row_stride, int64_t head_stride, int64_t max_len, void* q_out);

}  // namespace tlt
