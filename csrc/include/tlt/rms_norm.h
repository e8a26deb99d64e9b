// A decoder layer's residual add and RMSNorm in one call, for a bfloat16 model on the CPU:
// what a decode step does between one matmul and the next, where a small model pays per op
// (PyTorch's bf16 RMSNorm is four ops, 19 us at one row of SmolLM2's 576 on this project's
// CPUs; this call is one).
//
// h[R, H], delta[R, H] (may be null: no residual add) and weight[H], bfloat16, dense rows.
// For each row, in float32 (every operation one IEEE float32 operation, none fused), with
// round() bfloat16's nearest-even rounding (any NaN to 0x7FC0):
//   h_out[r, i]  = round(h[r, i] + delta[r, i])          (h[r, i] without delta)
//   partial[j]   = sum over i = j, j + 16, j + 32, ... of h_out[r, i]^2, in that order (j < 16)
//   s            = 1 / sqrt((partial[0] + partial[1] + ... + partial[15]) / H + eps)
//   normed[r, i] = round(weight[i] * round(h_out[r, i] * s))
// the operations of transformers' LlamaRMSNorm on a bf16 model (and of
// tlt_core.model.transformer.RMSNorm), the sum of squares in the order above (PyTorch's has its
// own), so s can differ from PyTorch's in the last float32 place, and normed in the last
// bfloat16 place where that moves it across a rounding boundary. h_out may alias h (then h is
// updated in place); normed must not alias either.
//
// Checked before anything is written (std::invalid_argument naming the argument): R >= 0,
// H >= 1, eps >= 0 and finite.
#pragma once

#include <cstdint>

namespace tlt {

void add_rms_norm_bf16_cpu(const void* h, const void* delta, const void* weight, int64_t rows,
                           int64_t hidden, float eps, void* h_out, void* normed);

}  // namespace tlt
