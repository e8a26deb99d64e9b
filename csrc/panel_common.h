// What the two panel kernels (panel_matmul_cpu.cpp: 16-feature panels; panel_pairs_cpu.cpp: the
// bfloat16 pairs layout) share: element types as storage, a row's bias / addend / rounding, the
// header's argument checks and when a product is worth the OpenMP team.
#pragma once

#include <cstdint>
#include <type_traits>

#include "cpu_common.h"

namespace tlt::panel {

// Below this many weight bytes a call runs on the calling thread: waking a worker costs more
// than the product (SmolLM2's smallest matrix is 1.3 MB; the embedded model's are 6-200 KB).
constexpr int64_t kParallelBytes = 512 << 10;

// The element types as storage: bfloat16 is the upper half of a float32.
inline float widen(float value) { return value; }
inline float widen(uint16_t value) { return cpu::bfloat16_to_float(value); }
inline void narrow(float value, float* out) { *out = value; }
inline void narrow(float value, uint16_t* out) { *out = cpu::float_to_bfloat16(value); }

// y[r, n] (+ bias) (+ addend) for one panel's `width` features, from the 16 sums of row r.
template <typename T>
inline void finish_row(const float* sums, int width, const T* bias, const T* addend, T* y) {
  for (int j = 0; j < width; ++j) {
    float value = sums[j];
    if (bias != nullptr) value += widen(bias[j]);
    if (addend != nullptr) value += widen(addend[j]);
    narrow(value, y + j);
  }
}

// The header's argument checks; false when there is nothing to do (no rows).
inline bool check_arguments(const void* x, int64_t rows, int64_t in_features, int64_t ldx,
                            const void* panels, int64_t out_features, const void* addend,
                            int64_t ld_addend, const void* y, int64_t ldy, int isa) {
  cpu::require(rows >= 0, "x", "rows must be >= 0");
  cpu::require(in_features >= 1, "x", "in_features K must be >= 1");
  cpu::require(out_features >= 1, "panels", "out_features N must be >= 1");
  cpu::require(ldx >= in_features, "x", "row stride must be >= K");
  cpu::require(ldy >= out_features, "out", "row stride must be >= N");
  cpu::require(addend == nullptr || ld_addend >= out_features, "addend",
               "row stride must be >= N");
  cpu::require(isa == 0 || isa == 1, "isa", "must be 0 (fastest) or 1 (portable)");
  cpu::require(panels != nullptr, "panels", "is null");
  if (rows == 0) return false;
  cpu::require(x != nullptr, "x", "is null");
  cpu::require(y != nullptr, "out", "is null");
  return true;
}

// Panels [p0, p1) in blocks of C adjacent panels, the last few (fewer than C) as wide as they
// go: block(std::integral_constant<int, width>, first panel) for each.
template <int C, typename Block>
inline void in_blocks(int64_t p0, int64_t p1, Block&& block) {
  int64_t p = p0;
  for (; p + C <= p1; p += C) block(std::integral_constant<int, C>{}, p);
  if constexpr (C > 3) {
    if (p1 - p == 3) return block(std::integral_constant<int, 3>{}, p);
  }
  if constexpr (C > 2) {
    if (p1 - p == 2) return block(std::integral_constant<int, 2>{}, p);
  }
  if (p1 - p == 1) block(std::integral_constant<int, 1>{}, p);
}

}  // namespace tlt::panel
