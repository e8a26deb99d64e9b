// CPU implementation of silu_mul.h. Elementwise: eight lanes at a time on AVX2 (sigmoid from
// exp(-|g|), which cannot overflow), the C library's exp elsewhere and for the last few.
#include "tlt/silu_mul.h"

#include <cmath>

#include "cpu_common.h"
#include "vector_bf16.h"
#include "vector_exp.h"

namespace tlt {
namespace {

inline float widen(float value) { return value; }
inline float widen(uint16_t value) { return cpu::bfloat16_to_float(value); }
inline void narrow(float value, float* out) { *out = value; }
inline void narrow(float value, uint16_t* out) { *out = cpu::float_to_bfloat16(value); }

template <typename T>
void portable(const T* gate, const T* up, int64_t count, T* out) {
  for (int64_t i = 0; i < count; ++i) {
    const float g = widen(gate[i]);
    narrow(g / (1.f + std::exp(-g)) * widen(up[i]), out + i);
  }
}

#if defined(__x86_64__) || defined(_M_X64)
__attribute__((target("avx2,fma"))) inline __m256 load8(const float* p) {
  return _mm256_loadu_ps(p);
}
__attribute__((target("avx2,fma"))) inline __m256 load8(const uint16_t* p) {
  return cpu::load_bfloat16x8(p);
}
__attribute__((target("avx2,fma"))) inline void store8(__m256 v, float* p) {
  _mm256_storeu_ps(p, v);
}
__attribute__((target("avx2,fma"))) inline void store8(__m256 v, uint16_t* p) {
  cpu::store_bfloat16x8(v, p);
}

// sigmoid(g) = 1 / (1 + e) for g >= 0, e / (1 + e) below, with e = exp(-|g|) <= 1.
template <typename T>
__attribute__((target("avx2,fma"))) int64_t vector_part(const T* gate, const T* up,
                                                        int64_t count, T* out) {
  const __m256 sign = _mm256_set1_ps(-0.f), one = _mm256_set1_ps(1.f);
  int64_t i = 0;
  for (; i + 8 <= count; i += 8) {
    const __m256 g = load8(gate + i);
    const __m256 e = cpu::exp_nonpositive_avx2(_mm256_or_ps(g, sign));  // exp(-|g|)
    const __m256 negative = _mm256_cmp_ps(g, _mm256_setzero_ps(), _CMP_LT_OQ);
    const __m256 sigmoid = _mm256_div_ps(_mm256_blendv_ps(one, e, negative), _mm256_add_ps(one, e));
    store8(_mm256_mul_ps(_mm256_mul_ps(g, sigmoid), load8(up + i)), out + i);
  }
  return i;
}

#endif

template <typename T>
void run(const void* gate_up, int64_t rows, int64_t width, int64_t ld, void* out) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* gate = static_cast<const T*>(gate_up) + r * ld;
    T* row_out = static_cast<T*>(out) + r * width;
    int64_t done = 0;
#if defined(__x86_64__) || defined(_M_X64)
    if (cpu::has_avx2_fma()) done = vector_part(gate, gate + width, width, row_out);
#endif
    portable(gate + done, gate + width + done, width - done, row_out + done);
  }
}

}  // namespace

void silu_mul_cpu(const void* gate_up, FloatType type, int64_t rows, int64_t width, int64_t ld,
                  void* out) {
  cpu::require(rows >= 0, "gate_up", "rows must be >= 0");
  cpu::require(width >= 1, "gate_up", "the width 2 I must be >= 2");
  cpu::require(ld >= 2 * width, "gate_up", "row stride must be >= 2 I");
  cpu::require(type == FloatType::kFloat32 || type == FloatType::kBFloat16, "gate_up",
               "must be float32 or bfloat16");
  if (rows == 0) return;
  cpu::require(gate_up != nullptr, "gate_up", "is null");
  cpu::require(out != nullptr, "out", "is null");
  if (type == FloatType::kFloat32)
    run<float>(gate_up, rows, width, ld, out);
  else
    run<uint16_t>(gate_up, rows, width, ld, out);
}

}  // namespace tlt
