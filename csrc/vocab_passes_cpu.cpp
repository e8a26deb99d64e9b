// CPU implementation of vocab_passes.h: each pass as the portable loop and as an AVX2 loop over
// eight lanes with the portable loop's code for the last n % 8 elements.
#include "vocab_passes.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "cpu_common.h"
#include "vector_bf16.h"
#include "vector_exp.h"

namespace tlt::cpu {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr float kPosInf = std::numeric_limits<float>::infinity();

bool finite_z(float z) { return !(std::isnan(z) || z == kPosInf); }

// The first index in [from, n) holding value (present there).
int64_t first_index_of(const float* z, int64_t from, int64_t n, float value) {
  for (int64_t x = from; x < n; ++x)
    if (z[x] == value) return x;
  return from;
}

#if defined(__x86_64__) || defined(_M_X64)
#define TLT_VOCAB_X86 1

__attribute__((target("avx2,fma"))) double sum_lanes(__m256d a, __m256d b) {
  alignas(32) double lanes[4];
  _mm256_store_pd(lanes, _mm256_add_pd(a, b));
  return (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
}

// Adds the eight floats of v to the two float64 accumulators (four lanes each).
__attribute__((target("avx2,fma"))) inline void accumulate(__m256 v, __m256d& low, __m256d& high) {
  low = _mm256_add_pd(low, _mm256_cvtps_pd(_mm256_castps256_ps128(v)));
  high = _mm256_add_pd(high, _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1)));
}

__attribute__((target("avx2,fma"))) void widen_bf16_avx2(const uint16_t* src, int64_t count,
                                                          float* out) {
  int64_t i = 0;
  for (; i + 8 <= count; i += 8) _mm256_storeu_ps(out + i, load_bfloat16x8(src + i));
  for (; i < count; ++i) out[i] = bfloat16_to_float(src[i]);
}

__attribute__((target("avx2,fma"))) ScaledMax scale_and_max_avx2(float* z, int64_t n,
                                                                  float temperature) {
  const bool scale = temperature > 0.f;
  const __m256 divisor = _mm256_set1_ps(temperature), pos_inf = _mm256_set1_ps(kPosInf);
  __m256 best = _mm256_set1_ps(kNegInf), bad = _mm256_setzero_ps();
  int64_t x = 0;
  for (; x + 8 <= n; x += 8) {
    __m256 v = _mm256_loadu_ps(z + x);
    if (scale) {
      v = _mm256_div_ps(v, divisor);
      _mm256_storeu_ps(z + x, v);
    }
    bad = _mm256_or_ps(bad, _mm256_or_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q),
                                         _mm256_cmp_ps(v, pos_inf, _CMP_EQ_OQ)));
    best = _mm256_max_ps(best, v);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, best);
  float max_value = kNegInf;
  for (float lane : lanes) max_value = std::max(max_value, lane);
  bool finite = _mm256_movemask_ps(bad) == 0;
  for (; x < n; ++x) {
    if (scale) z[x] /= temperature;
    finite &= finite_z(z[x]);
    max_value = std::max(max_value, z[x]);
  }
  if (!finite || max_value == kNegInf) return {max_value, 0, false};
  // The lowest index holding the max: eight at a time up to the first block that has it.
  const __m256 target = _mm256_set1_ps(max_value);
  int64_t block = 0;
  for (; block + 8 <= n; block += 8)
    if (_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(z + block), target, _CMP_EQ_OQ)))
      break;
  const int64_t argmax = first_index_of(z, block, n, max_value);
  return {z[argmax], argmax, true};
}

// Eight weights from eight z (out may be null) into the sums.
__attribute__((target("avx2,fma"))) inline void exp_block(const float* in, float* out,
                                                           __m256 shift, __m256 lowest_kept,
                                                           __m256d& low, __m256d& high) {
  const __m256 v = _mm256_loadu_ps(in);
  const __m256 kept = _mm256_cmp_ps(v, lowest_kept, _CMP_GE_OQ);
  const __m256 e = _mm256_and_ps(kept, exp_nonpositive_avx2(_mm256_sub_ps(v, shift)));
  if (out != nullptr) _mm256_storeu_ps(out, e);
  accumulate(e, low, high);
}

__attribute__((target("avx2,fma"))) double exp_weights_avx2(const float* z, int64_t n, float max,
                                                             float floor, float* weights) {
  const __m256 shift = _mm256_set1_ps(max), lowest_kept = _mm256_set1_ps(floor);
  __m256d low = _mm256_setzero_pd(), high = _mm256_setzero_pd();
  int64_t x = 0;
  for (; x + 8 <= n; x += 8)
    exp_block(z + x, weights == nullptr ? nullptr : weights + x, shift, lowest_kept, low, high);
  if (x < n) {  // the last n % 8 through the same lanes, padded with -inf (weight 0)
    alignas(32) float in[8], out[8];
    std::fill(in, in + 8, kNegInf);
    std::copy(z + x, z + n, in);
    exp_block(in, out, shift, lowest_kept, low, high);
    if (weights != nullptr) std::copy(out, out + (n - x), weights + x);
  }
  return sum_lanes(low, high);
}

__attribute__((target("avx2,fma"))) bool is_distribution_avx2(const float* q, int64_t n) {
  const __m256 zero = _mm256_setzero_ps(), pos_inf = _mm256_set1_ps(kPosInf);
  __m256d low = _mm256_setzero_pd(), high = _mm256_setzero_pd();
  __m256 good = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
  int64_t x = 0;
  for (; x + 8 <= n; x += 8) {
    const __m256 v = _mm256_loadu_ps(q + x);
    good = _mm256_and_ps(good, _mm256_and_ps(_mm256_cmp_ps(v, zero, _CMP_GE_OQ),
                                             _mm256_cmp_ps(v, pos_inf, _CMP_NEQ_UQ)));
    accumulate(v, low, high);
  }
  if (_mm256_movemask_ps(good) != 0xFF) return false;
  double total = sum_lanes(low, high);
  for (; x < n; ++x) {
    if (!(q[x] >= 0.f) || std::isinf(q[x])) return false;
    total += q[x];
  }
  return std::abs(total - 1.0) <= 1e-3;
}

__attribute__((target("avx2,fma"))) double residual_mass_avx2(const float* w, const float* q,
                                                               float scale, int64_t n) {
  const __m256 s = _mm256_set1_ps(scale), zero = _mm256_setzero_ps();
  __m256d low = _mm256_setzero_pd(), high = _mm256_setzero_pd();
  int64_t y = 0;
  for (; y + 8 <= n; y += 8) {
    const __m256 product = _mm256_mul_ps(_mm256_loadu_ps(q + y), s);
    accumulate(_mm256_max_ps(zero, _mm256_sub_ps(_mm256_loadu_ps(w + y), product)), low, high);
  }
  double total = sum_lanes(low, high);
  for (; y < n; ++y) total += std::max(0.f, w[y] - q[y] * scale);
  return total;
}

__attribute__((target("avx2,fma"))) void take_residual_avx2(float* w, const float* q,
                                                             float scale, int64_t n) {
  const __m256 s = _mm256_set1_ps(scale), zero = _mm256_setzero_ps();
  int64_t y = 0;
  for (; y + 8 <= n; y += 8) {
    const __m256 product = _mm256_mul_ps(_mm256_loadu_ps(q + y), s);
    _mm256_storeu_ps(w + y, _mm256_max_ps(zero, _mm256_sub_ps(_mm256_loadu_ps(w + y), product)));
  }
  for (; y < n; ++y) w[y] = std::max(0.f, w[y] - q[y] * scale);
}
#endif

// Whether the caller's vector request can run here.
bool use_avx2(bool vector) {
#ifdef TLT_VOCAB_X86
  return vector && has_avx2_fma();
#else
  (void)vector;
  return false;
#endif
}

}  // namespace

void widen_logits(const void* logits, FloatType type, int64_t offset, int64_t count, float* out,
                  bool vector) {
#ifdef TLT_VOCAB_X86
  if (use_avx2(vector) && type == FloatType::kBFloat16)
    return widen_bf16_avx2(static_cast<const uint16_t*>(logits) + offset, count, out);
#endif
  load_floats(logits, type, offset, count, out);
}

ScaledMax scale_and_max(float* z, int64_t n, float temperature, bool vector) {
#ifdef TLT_VOCAB_X86
  if (use_avx2(vector)) return scale_and_max_avx2(z, n, temperature);
#endif
  float max_value = kNegInf;
  int64_t argmax = 0;
  bool finite = true;
  for (int64_t x = 0; x < n; ++x) {
    if (temperature > 0.f) z[x] /= temperature;
    finite &= finite_z(z[x]);
    if (z[x] > max_value) {
      max_value = z[x];
      argmax = x;
    }
  }
  return {max_value, argmax, finite && max_value != kNegInf};
}

double exp_weights(const float* z, int64_t n, float max, float floor, float* weights,
                   bool vector) {
#ifdef TLT_VOCAB_X86
  if (use_avx2(vector)) return exp_weights_avx2(z, n, max, floor, weights);
#endif
  double total = 0.0;
  for (int64_t x = 0; x < n; ++x) {
    const float e = z[x] >= floor ? std::exp(z[x] - max) : 0.f;
    if (weights != nullptr) weights[x] = e;
    total += e;
  }
  return total;
}

bool is_distribution(const float* q, int64_t n, bool vector) {
#ifdef TLT_VOCAB_X86
  if (use_avx2(vector)) return is_distribution_avx2(q, n);
#endif
  double total = 0.0;
  for (int64_t x = 0; x < n; ++x) {
    if (!(q[x] >= 0.f) || std::isinf(q[x])) return false;
    total += q[x];
  }
  return std::abs(total - 1.0) <= 1e-3;
}

double residual_mass(const float* w, const float* q, float scale, int64_t n, bool vector) {
#ifdef TLT_VOCAB_X86
  if (use_avx2(vector)) return residual_mass_avx2(w, q, scale, n);
#endif
  double total = 0.0;
  for (int64_t y = 0; y < n; ++y) total += std::max(0.f, w[y] - q[y] * scale);
  return total;
}

void take_residual(float* w, const float* q, float scale, int64_t n, bool vector) {
#ifdef TLT_VOCAB_X86
  if (use_avx2(vector)) return take_residual_avx2(w, q, scale, n);
#endif
  for (int64_t y = 0; y < n; ++y) w[y] = std::max(0.f, w[y] - q[y] * scale);
}

int64_t inverse_cdf(const float* w, int64_t n, double target) {
  double running = 0.0;
  int64_t last_positive = -1;
  for (int64_t x = 0; x < n; ++x) {
    if (w[x] > 0.f) {
      running += w[x];
      last_positive = x;
      if (running > target) return x;
    }
  }
  return last_positive;
}

}  // namespace tlt::cpu
