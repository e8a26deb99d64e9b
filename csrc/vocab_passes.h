// The linear passes over a vocabulary that the CPU verifier (verify_cpu.cpp) makes at each node
// it visits: widen the logits, scale them and find their max, exponentiate and sum, check a draft
// distribution, take a residual. At V = 49152 (SmolLM2) the scalar loops cost about 0.3 ms a
// node, mostly in the C library's exp, which is a sizeable part of a one-token decode step of a
// small model; the AVX2 paths run the same passes eight lanes at a time.
//
// Each pass has two paths, chosen per call by `vector` (true: AVX2 + FMA, where
// cpu::has_avx2_fma(); the caller decides). They compute the same values except:
//   - exp: the portable path calls std::exp, the vector path exp_nonpositive_avx2 (within 2
//     float32 ulps of it; 0 below -87, where exp is under 1.7e-38);
//   - sums are float64 either way, in index order on the portable path and in eight interleaved
//     partial sums on the vector path (so they differ by float64 rounding, about 1e-16 relative).
// Every other value (the scaled logits, the max and its index, the residual weights) is bit for
// bit the same: each is one IEEE operation per element, with no contraction (-ffp-contract=off).
#pragma once

#include <cstdint>

#include "tlt/common.h"

namespace tlt::cpu {

// logits[offset : offset + count] of the given type, widened to float32 into out.
void widen_logits(const void* logits, FloatType type, int64_t offset, int64_t count, float* out,
                  bool vector);

struct ScaledMax {
  float max;       // max z; meaningful only when finite
  int64_t argmax;  // the lowest index holding it
  bool finite;     // no z is NaN or +inf, and some z is above -inf
};

// z = z / temperature in place (IEEE division) when temperature > 0, left as is otherwise;
// then the max over z and the lowest index holding it.
ScaledMax scale_and_max(float* z, int64_t n, float temperature, bool vector);

// weights[x] = z[x] >= floor ? exp(z[x] - max) : 0 (max >= every z), when weights is not null
// (it may be z itself: in place); returns the float64 sum of those values.
double exp_weights(const float* z, int64_t n, float max, float floor, float* weights,
                   bool vector);

// Whether q[0:n] is a distribution: every q >= 0 and finite, and its float64 sum within 1e-3
// of 1.
bool is_distribution(const float* q, int64_t n, bool vector);

// sum over y of max(0, w[y] - q[y] * scale) in float64 (each term rounded as float32: the
// product, then the difference).
double residual_mass(const float* w, const float* q, float scale, int64_t n, bool vector);

// w[y] = max(0, w[y] - q[y] * scale) for every y (the terms residual_mass sums).
void take_residual(float* w, const float* q, float scale, int64_t n, bool vector);

// Inverse CDF over unnormalised weights w[0:n] >= 0: the smallest x with w[x] > 0 whose running
// float64 sum of w[0..x] exceeds target; where rounding leaves none, the largest x with
// w[x] > 0; -1 when every w is 0. One scalar pass in index order (it stops at the token).
int64_t inverse_cdf(const float* w, int64_t n, double target);

}  // namespace tlt::cpu
