// exp over eight float32 lanes for the CPU kernels' AVX2 paths (attention's softmax weights,
// SwiGLU's sigmoid), where a call to the C library's exp per element would cost more than the
// rest of the kernel.
#pragma once

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>

namespace tlt::cpu {

// exp(x) for x <= 0, eight at a time: 2^n exp(r), |r| <= ln 2 / 2, with Cephes' expf
// polynomial (within 2 float32 ulps of exp); 0 below -87 (about where float32's exp leaves the
// normal range: ln FLT_MIN = -87.34), where exp is under 1.7e-38; NaN stays NaN.
__attribute__((target("avx2,fma"))) inline __m256 exp_nonpositive_avx2(__m256 x) {
  const __m256 tiny = _mm256_cmp_ps(x, _mm256_set1_ps(-87.f), _CMP_LT_OQ);
  x = _mm256_max_ps(_mm256_set1_ps(-87.f), x);  // max_ps returns its second operand for a NaN
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  const __m256 y = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r),
                                 _mm256_set1_ps(1.f));
  const __m256i biased = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
  const __m256 two_to_n = _mm256_castsi256_ps(_mm256_slli_epi32(biased, 23));
  return _mm256_andnot_ps(tiny, _mm256_mul_ps(y, two_to_n));
}

}  // namespace tlt::cpu

#endif
