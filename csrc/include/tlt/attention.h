// Attention of a decode step's few new tokens over the KV cache, on the CPU, in one call per
// layer: what PyTorch's scaled_dot_product_attention does there for a small model at 60 us a
// layer (SmolLM2, one token, 200 slots, 2 cores), most of it fixed cost, for a few hundred
// thousand multiply-adds. It writes the output in the layout the o projection reads, so the
// transpose, copy and narrowing after attention go too.
//
// q[B, H_q, T, d] (the layout rope.h writes) and the cache's K and V in kv_type, float32 or
// bfloat16 (each bfloat16 element widened exactly to float32 before any arithmetic); element
// (b, g, s, i) at b * row_stride + g * head_stride + s * d + i (the head-major cache [.., B,
// H_kv, max_len, d]); slots S <= max_len read. Query head h reads KV head h / (H_q / H_kv)
// (grouped-query attention). mask: null (every query sees slots [0, S)), or bytes where
// mask[b * mask_batch_stride + t * mask_token_stride + s] != 0 means query t of row b sees slot
// s. For each (b, h, t), over the slots it sees, in slot order:
//   score[s] = scale * dot(q[b, h, t], K[b, h / G, s])
//   p[s]     = exp(score[s] - max over seen slots of score)
//   out[b, t, h, :] = (sum of p[s] * V[b, h / G, s, :]) / (sum of p[s])
// in float32, rounded once to out's type (bfloat16: nearest even, NaN -> 0x7FC0). A query that
// sees no slot gets zeros.
//
// Each query's bits depend only on its own q and the K and V of the slots it sees: not on T,
// the other queries or rows, S beyond its last seen slot, or the contents of slots it does not
// see (they are not read). So a token verified inside a tree gets the bits it gets decoded
// alone, and unseen slots may hold anything. The dot products and sums run in a fixed order of
// their own (eight lanes where the CPU has AVX2, whose exp is a polynomial within 2 float32
// ulps, 0 below e^-87; where it has AVX-512 as well, the same operations in the same order two
// slots or sixteen columns an instruction, so the same bits), not PyTorch's: the values agree with scaled_dot_product_attention to
// float32 rounding, not bit for bit. A NaN or +inf score (from non-finite q or K values, or
// past float32's range), a non-finite V value of a seen slot, or scores all -inf make the
// query's outputs non-finite.
//
// Checked before anything is written (std::invalid_argument naming the argument): sizes >= 1
// (B may be 0), H_q a multiple of H_kv, 1 <= S <= max_len, non-negative strides (K and V are
// only read, so views that overlap are fine), a finite scale, out's type float32 or bfloat16,
// kv_type float32 or bfloat16.
#pragma once

#include <cstdint>

#include "tlt/common.h"

namespace tlt {

void decode_attention_cpu(const void* q, int64_t batch, int64_t q_heads, int64_t tokens,
                          int64_t head_dim, const void* cache_k, const void* cache_v,
                          FloatType kv_type, int64_t kv_heads, int64_t row_stride,
                          int64_t head_stride, int64_t max_len, int64_t slots, const uint8_t* mask,
                          int64_t mask_batch_stride, int64_t mask_token_stride, float scale,
                          void* out, FloatType out_type);

}  // namespace tlt
