// Counter-based uniform random numbers (Philox4x32-10, Salmon et al. 2011) that the CPU and
// CUDA kernels compute bit-identically, so a seed reproduces a speculative step anywhere.
#pragma once

#include <cstdint>

#include "tlt/common.h"

namespace tlt {

struct Philox4x32 {
  uint32_t x[4];
};

// Philox4x32-10 of counter (c0, c1, c2, c3) under key (k0, k1).
TLT_HOST_DEVICE Philox4x32 philox4x32_10(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3,
                                         uint32_t k0, uint32_t k1) {
  constexpr uint32_t kMul0 = 0xD2511F53u, kMul1 = 0xCD9E8D57u;
  constexpr uint32_t kWeyl0 = 0x9E3779B9u, kWeyl1 = 0xBB67AE85u;
  for (int round = 0; round < 10; ++round) {
    const uint64_t prod0 = static_cast<uint64_t>(kMul0) * c0;
    const uint64_t prod1 = static_cast<uint64_t>(kMul1) * c2;
    const uint32_t hi0 = static_cast<uint32_t>(prod0 >> 32), lo0 = static_cast<uint32_t>(prod0);
    const uint32_t hi1 = static_cast<uint32_t>(prod1 >> 32), lo1 = static_cast<uint32_t>(prod1);
    c0 = hi1 ^ c1 ^ k0;
    c1 = lo1;
    c2 = hi0 ^ c3 ^ k1;
    c3 = lo0;
    k0 += kWeyl0;
    k1 += kWeyl1;
  }
  return Philox4x32{{c0, c1, c2, c3}};
}

// Uniform in [0, 1) with 24 random bits: exactly representable in float32.
TLT_HOST_DEVICE float philox_uniform(uint64_t seed, uint64_t offset, uint64_t index) {
  const Philox4x32 r = philox4x32_10(
      static_cast<uint32_t>(offset), static_cast<uint32_t>(offset >> 32),
      static_cast<uint32_t>(index), static_cast<uint32_t>(index >> 32),
      static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
  return static_cast<float>(r.x[0] >> 8) * (1.0f / 16777216.0f);
}

// uniforms[b, i] = philox_uniform(seeds[b], offsets[b], i) for i < count. Rows are independent
// streams: a row's numbers depend only on its own seed and offset.
void philox_uniforms_cpu(const int64_t* seeds, const int64_t* offsets, int64_t batch,
                         int64_t count, float* uniforms);
void philox_uniforms_cuda(const int64_t* seeds, const int64_t* offsets, int64_t batch,
                          int64_t count, float* uniforms, void* stream);

}  // namespace tlt
