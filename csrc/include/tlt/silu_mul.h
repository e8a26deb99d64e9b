// A SwiGLU MLP's activation in one call, for a decode step on the CPU: silu(gate) * up from the
// fused gate|up projection, where PyTorch spends a split, a silu and a multiply (10 us a layer
// for SmolLM2's 1536 in bf16 at one row on this project's CPUs, against a product of 60).
//
// gate_up[R, 2 I] (row stride ld >= 2 I elements), out[R, I] dense, both float32 or both
// bfloat16. For each row r and i < I, with g = gate_up[r, i] and u = gate_up[r, I + i] widened
// to float32:
//   out[r, i] = round(g * sigmoid(g) * u),  sigmoid(g) = 1 / (1 + exp(-g))
// in float32, rounded once to the dtype (bfloat16: nearest even, NaN -> 0x7FC0). PyTorch's
// `silu(gate) * up` rounds twice in bfloat16 (after the silu and after the product), so the two
// differ in the last bfloat16 place where that moves a value across a rounding boundary; in
// float32 they agree to a few ulps (exp on AVX2 is a polynomial within 2 ulps), except that on
// AVX2 a gate below -87, whose silu is under 1.7e-36 in magnitude, gives -0. Elements are
// independent: a row's bits do not depend on the others.
//
// Checked before anything is written (std::invalid_argument naming the argument): R >= 0,
// I >= 1, ld >= 2 I, the dtype float32 or bfloat16.
#pragma once

#include <cstdint>

#include "tlt/common.h"

namespace tlt {

void silu_mul_cpu(const void* gate_up, FloatType type, int64_t rows, int64_t width, int64_t ld,
                  void* out);

}  // namespace tlt
