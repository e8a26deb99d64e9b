// Exact sums of non-negative float32 values, for the CUDA sampling verifier.
//
// Every float32 is an integer multiple of 2^-149 (the smallest subnormal), so a non-negative
// float below 2^42 is an integer of at most 191 bits in that unit, and a sum of up to 2^24 such
// values in [0, 1] (the verifier's weights) is an integer below 2^174. Integer addition is
// associative: the sum does not depend on the order of the terms, so a kernel can add them in
// whatever order its threads, blocks and atomics happen to produce and still get one answer,
// rounded once at the end. That is what makes the CUDA kernel's results independent of how the
// vocabulary is split across blocks (see verify_cuda.cu).
#pragma once

#include <cstdint>
#include <cstring>

#include "tlt/common.h"

namespace tlt {

// A 192-bit unsigned integer in units of 2^-149, little-endian words.
struct ExactSum {
  uint64_t word[3];
};

TLT_HOST_DEVICE uint32_t float_bits(float value) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(value);
#else
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  return bits;
#endif
}

// m * 2^shift (in units of 2^-149); the product must stay below 2^192.
TLT_HOST_DEVICE ExactSum exact_shifted(uint64_t m, int shift) {
  ExactSum r{{0, 0, 0}};
  const int word = shift >> 6, offset = shift & 63;
  const uint64_t low = m << offset;
  const uint64_t high = offset != 0 ? m >> (64 - offset) : 0;
  if (word == 0) {
    r.word[0] = low;
    r.word[1] = high;
  } else if (word == 1) {
    r.word[1] = low;
    r.word[2] = high;
  } else {
    r.word[2] = low;
  }
  return r;
}

// A float32 value's significand with the implicit bit, and the power of two that scales it to
// units of 2^-149: value = significand * 2^shift * 2^-149.
TLT_HOST_DEVICE void float_significand(uint32_t bits, uint32_t& significand, int& shift) {
  const int exponent = static_cast<int>((bits >> 23) & 0xFFu);
  significand = bits & 0x7FFFFFu;
  shift = 0;
  if (exponent != 0) {
    significand |= 0x800000u;
    shift = exponent - 1;
  }
}

// value (finite, >= 0 or -0, < 2^42) exactly.
TLT_HOST_DEVICE ExactSum exact_of(float value) {
  uint32_t significand;
  int shift;
  float_significand(float_bits(value) & 0x7FFFFFFFu, significand, shift);
  return exact_shifted(significand, shift);
}

TLT_HOST_DEVICE void exact_add(ExactSum& acc, const ExactSum& x) {
  const uint64_t s0 = acc.word[0] + x.word[0];
  const uint64_t carry0 = s0 < x.word[0] ? 1 : 0;
  const uint64_t t1 = acc.word[1] + x.word[1];
  const uint64_t carry1 = t1 < x.word[1] ? 1 : 0;
  const uint64_t s1 = t1 + carry0;
  const uint64_t carry1b = s1 < carry0 ? 1 : 0;
  acc.word[2] = acc.word[2] + x.word[2] + carry1 + carry1b;
  acc.word[0] = s0;
  acc.word[1] = s1;
}

TLT_HOST_DEVICE ExactSum exact_sum_of(const ExactSum& a, const ExactSum& b) {
  ExactSum r = a;
  exact_add(r, b);
  return r;
}

TLT_HOST_DEVICE bool exact_less(const ExactSum& a, const ExactSum& b) {
  if (a.word[2] != b.word[2]) return a.word[2] < b.word[2];
  if (a.word[1] != b.word[1]) return a.word[1] < b.word[1];
  return a.word[0] < b.word[0];
}

TLT_HOST_DEVICE bool exact_is_zero(const ExactSum& a) {
  return (a.word[0] | a.word[1] | a.word[2]) == 0;
}

// The value as a double: each word converted and scaled by a power of two, then added from the
// least significant up (within two double ulps of the exact value; deterministic).
TLT_HOST_DEVICE double exact_to_double(const ExactSum& a) {
  return (static_cast<double>(a.word[0]) * 0x1p-149 + static_cast<double>(a.word[1]) * 0x1p-85) +
         static_cast<double>(a.word[2]) * 0x1p-21;
}

}  // namespace tlt
