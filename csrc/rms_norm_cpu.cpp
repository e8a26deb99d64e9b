// CPU implementation of rms_norm.h. Rows are independent; a decode step has few, so they run on
// the calling thread unless there are enough to be worth the pool (prefill).
#include "tlt/rms_norm.h"

#include <cmath>
#include <cstring>
#include <vector>

#include "cpu_common.h"
#include "parallel.h"
#include "vector_bf16.h"

namespace tlt {
namespace {

constexpr int64_t kParallelRows = 64;
constexpr int kLanes = 16;  // partial sums of squares: vectorisable, and an order of our own

float load(uint16_t value) { return cpu::bfloat16_to_float(value); }
uint16_t store(float value) { return cpu::float_to_bfloat16(value); }

#if defined(__x86_64__) || defined(_M_X64)
// The three passes of norm_row over the row's first `count` (a multiple of kLanes) elements,
// eight lanes at a time, with the scalar loops' bits: every sum and product is the same single
// float32 operation (no FMA: the build contracts nothing), the sums of squares the same kLanes
// chains, each rounding to bfloat16 the scalar store's. Returns the partial sums of squares.
__attribute__((target("avx2,fma"))) void vector_passes(const uint16_t* h, const uint16_t* delta,
                                                      int64_t count, uint16_t* h_out,
                                                      float* values, float* partial) {
  __m256 low = _mm256_setzero_ps(), high = _mm256_setzero_ps();  // partial[0..7], [8..15]
  for (int64_t i = 0; i < count; i += kLanes) {
    __m256 v[2];
    for (int half = 0; half < 2; ++half) {
      const int64_t at = i + 8 * half;
      __m256 value = cpu::load_bfloat16x8(h + at);
      if (delta != nullptr) {
        value = _mm256_add_ps(value, cpu::load_bfloat16x8(delta + at));
        cpu::store_bfloat16x8(value, h_out + at);
        value = cpu::through_bfloat16x8(value);
      }
      _mm256_storeu_ps(values + at, value);
      v[half] = value;
    }
    low = _mm256_add_ps(low, _mm256_mul_ps(v[0], v[0]));
    high = _mm256_add_ps(high, _mm256_mul_ps(v[1], v[1]));
  }
  _mm256_storeu_ps(partial, low);
  _mm256_storeu_ps(partial + 8, high);
}

// normed[k] = store(weight[k] * round(values[k] * scale)) for k < count (a multiple of 8).
__attribute__((target("avx2,fma"))) void vector_scale(const float* values, const uint16_t* weight,
                                                      float scale, int64_t count,
                                                      uint16_t* normed) {
  const __m256 factor = _mm256_set1_ps(scale);
  for (int64_t k = 0; k < count; k += 8) {
    const __m256 scaled =
        cpu::through_bfloat16x8(_mm256_mul_ps(_mm256_loadu_ps(values + k), factor));
    cpu::store_bfloat16x8(_mm256_mul_ps(cpu::load_bfloat16x8(weight + k), scaled), normed + k);
  }
}
#endif

// Three passes over the row: the sum into h_out (and its float32 values into a scratch row),
// the sum of squares in kLanes partial sums, the scaling. On AVX2 the row's whole blocks of
// kLanes run eight lanes at a time (vector_passes, vector_scale) and the rest as scalars.
void norm_row(const uint16_t* h, const uint16_t* delta, const uint16_t* weight, int64_t hidden,
              float eps, uint16_t* h_out, uint16_t* normed, float* values) {
  float partial[kLanes] = {};
  int64_t done = 0;  // elements of the first two passes already run as vectors
#if defined(__x86_64__) || defined(_M_X64)
  const bool vector = cpu::has_avx2_fma();
  if (vector) {
    done = hidden / kLanes * kLanes;
    vector_passes(h, delta, done, h_out, values, partial);
  }
#endif
  if (delta == nullptr) {
    for (int64_t i = done; i < hidden; ++i) values[i] = load(h[i]);
    if (h_out != h) std::memcpy(h_out, h, hidden * sizeof(uint16_t));
  } else {
    for (int64_t i = done; i < hidden; ++i) {
      const uint16_t sum = store(load(h[i]) + load(delta[i]));
      h_out[i] = sum;
      values[i] = load(sum);
    }
  }
  int64_t i = done;
  for (; i + kLanes <= hidden; i += kLanes)
    for (int j = 0; j < kLanes; ++j) partial[j] += values[i + j] * values[i + j];
  for (; i < hidden; ++i) partial[i % kLanes] += values[i] * values[i];
  float squares = 0.0f;
  for (float p : partial) squares += p;
  const float scale = 1.0f / std::sqrt(squares / static_cast<float>(hidden) + eps);
  int64_t scaled = 0;
#if defined(__x86_64__) || defined(_M_X64)
  if (vector) {
    scaled = hidden / 8 * 8;
    vector_scale(values, weight, scale, scaled, normed);
  }
#endif
  for (int64_t k = scaled; k < hidden; ++k)
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
