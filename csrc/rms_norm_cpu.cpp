// CPU implementation of rms_norm.h. Rows are independent; a decode step has few, so they run on
// the calling thread unless there are enough to be worth the pool (prefill).
#include "tlt/rms_norm.h"

#include <cmath>
#include <cstring>
#include <vector>

#include "cpu_common.h"
#include "parallel.h"

namespace tlt {
namespace {

constexpr int64_t kParallelRows = 64;
constexpr int kLanes = 16;  // partial sums of squares: vectorisable, and an order of our own

float load(uint16_t value) { return cpu::bfloat16_to_float(value); }
uint16_t store(float value) { return cpu::float_to_bfloat16(value); }

// Three passes over the row, each a loop the compiler vectorises: the sum into h_out (and its
// float32 values into a scratch row), the sum of squares in kLanes partial sums, the scaling.
void norm_row(const uint16_t* h, const uint16_t* delta, const uint16_t* weight, int64_t hidden,
              float eps, uint16_t* h_out, uint16_t* normed, float* values) {
  if (delta == nullptr) {
    for (int64_t i = 0; i < hidden; ++i) values[i] = load(h[i]);
    if (h_out != h) std::memcpy(h_out, h, hidden * sizeof(uint16_t));
  } else {
    for (int64_t i = 0; i < hidden; ++i) {
      const uint16_t sum = store(load(h[i]) + load(delta[i]));
      h_out[i] = sum;
      values[i] = load(sum);
    }
  }
  float partial[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= hidden; i += kLanes)
    for (int j = 0; j < kLanes; ++j) partial[j] += values[i + j] * values[i + j];
  for (; i < hidden; ++i) partial[i % kLanes] += values[i] * values[i];
  float squares = 0.0f;
  for (float p : partial) squares += p;
  const float scale = 1.0f / std::sqrt(squares / static_cast<float>(hidden) + eps);
  for (int64_t k = 0; k < hidden; ++k)
    normed[k] = store(load(weight[k]) * load(store(values[k] * scale)));
}

}  // namespace

void add_rms_norm_bf16_cpu(const void* h, const void* delta, const void* weight, int64_t rows,
                           int64_t hidden, float eps, void* h_out, void* normed) {
  cpu::require(rows >= 0, "h", "rows must be >= 0");
  cpu::require(hidden >= 1, "h", "the hidden size must be >= 1");
  cpu::require(std::isfinite(eps) && eps >= 0.0f, "eps", "must be finite and >= 0");
  const auto* hs = static_cast<const uint16_t*>(h);
  const auto* ds = static_cast<const uint16_t*>(delta);
  const auto* w = static_cast<const uint16_t*>(weight);
  auto* out = static_cast<uint16_t*>(h_out);
  auto* ns = static_cast<uint16_t*>(normed);
  auto row = [&](int64_t r, float* values) {
    norm_row(hs + r * hidden, ds == nullptr ? nullptr : ds + r * hidden, w, hidden, eps,
             out + r * hidden, ns + r * hidden, values);
  };
  if (rows < kParallelRows) {  // one scratch row for the call
    std::vector<float> values(static_cast<size_t>(hidden));
    for (int64_t r = 0; r < rows; ++r) row(r, values.data());
  } else {  // a scratch row per claimed row: workers share nothing
    cpu::parallel_for(rows, [&](int64_t r) {
      std::vector<float> values(static_cast<size_t>(hidden));
      row(r, values.data());
    });
  }
}

}  // namespace tlt
