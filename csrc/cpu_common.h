// Internal helpers for the CPU kernels: host-side argument checks, widening of the
// half-precision logit formats to float32 (bit manipulation, so no compiler extension needed),
// and whether the CPU runs the kernels' AVX2 paths.
#pragma once

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

#include "tlt/common.h"

namespace tlt::cpu {

#if defined(__x86_64__) || defined(_M_X64)
// Whether this CPU has AVX2 and FMA, the instructions of the kernels' vector paths.
inline bool has_avx2_fma() {
  static const bool supported = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return supported;
}

// Whether this CPU has AVX-512 F, DQ and VL (sixteen float lanes, 32 vector registers).
inline bool has_avx512f_dq_vl() {
  static const bool supported = __builtin_cpu_supports("avx512f") &&
                                __builtin_cpu_supports("avx512dq") &&
                                __builtin_cpu_supports("avx512vl");
  return supported;
}

// Whether this CPU has AVX512-BF16 (VDPBF16PS), the instruction of the bfloat16 pairs product.
inline bool has_avx512_bf16() {
  static const bool supported =
      __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bf16");
  return supported;
}
#endif

inline void require(bool ok, const char* argument, const std::string& what) {
  if (!ok) throw std::invalid_argument(std::string(argument) + ": " + what);
}

inline void check_common_sizes(int64_t batch, int64_t num_nodes_max) {
  require(batch >= 0, "batch", "must be >= 0");
  require(num_nodes_max >= 1 && num_nodes_max <= kMaxTreeNodes, "num_nodes",
          "N must be in [1, " + std::to_string(kMaxTreeNodes) + "]");
}

inline void check_vocab(int64_t vocab) {
  require(vocab >= 1 && vocab <= kMaxVocab, "vocab",
          "V must be in [1, " + std::to_string(kMaxVocab) + "]");
}

inline void check_float_type(FloatType type, const char* argument) {
  require(type == FloatType::kFloat32 || type == FloatType::kFloat16 ||
              type == FloatType::kBFloat16,
          argument,
          "type code " + std::to_string(static_cast<int32_t>(type)) +
              " is not a FloatType (0 float32, 1 float16, 2 bfloat16)");
}

inline float bits_to_float(uint32_t bits) {
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}

// bfloat16 is the upper half of a float32.
inline float bfloat16_to_float(uint16_t h) { return bits_to_float(static_cast<uint32_t>(h) << 16); }

// c10's scalar float -> bfloat16: round to nearest even, any NaN to the quiet 0x7FC0 (a tensor's
// .to(bfloat16) may keep a NaN's sign and payload instead).
inline uint16_t float_to_bfloat16(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0u;
  return static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

// IEEE binary16 -> binary32, exact (every half is representable as a float).
inline float float16_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exponent = (h >> 10) & 0x1Fu;
  uint32_t mantissa = h & 0x3FFu;
  if (exponent == 0x1Fu) return bits_to_float(sign | 0x7F800000u | (mantissa << 13));  // inf/nan
  if (exponent == 0) {
    if (mantissa == 0) return bits_to_float(sign);  // signed zero
    // Subnormal half: normalise the mantissa.
    exponent = 127 - 15 + 1;
    while ((mantissa & 0x400u) == 0) {
      mantissa <<= 1;
      --exponent;
    }
    mantissa &= 0x3FFu;
    return bits_to_float(sign | (exponent << 23) | (mantissa << 13));
  }
  return bits_to_float(sign | ((exponent + 127 - 15) << 23) | (mantissa << 13));
}

// Widen `count` logits starting at element `offset` of a FloatType array into `out`.
inline void load_floats(const void* data, FloatType type, int64_t offset, int64_t count,
                        float* out) {
  switch (type) {
    case FloatType::kFloat32:
      std::memcpy(out, static_cast<const float*>(data) + offset, count * sizeof(float));
      return;
    case FloatType::kFloat16: {
      const uint16_t* src = static_cast<const uint16_t*>(data) + offset;
      for (int64_t i = 0; i < count; ++i) out[i] = float16_to_float(src[i]);
      return;
    }
    case FloatType::kBFloat16: {
      const uint16_t* src = static_cast<const uint16_t*>(data) + offset;
      for (int64_t i = 0; i < count; ++i) out[i] = bfloat16_to_float(src[i]);
      return;
    }
  }
  throw std::invalid_argument("logits: unknown FloatType");
}

}  // namespace tlt::cpu
