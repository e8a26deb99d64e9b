// CPU implementation of random.h.
#include "cpu_common.h"
#include "parallel.h"
#include "tlt/random.h"

namespace tlt {

void philox_uniforms_cpu(const int64_t* seeds, const int64_t* offsets, int64_t batch,
                         int64_t count, float* uniforms) {
  cpu::require(batch >= 0, "batch", "must be >= 0");
  cpu::require(count >= 0, "count", "must be >= 0");
  cpu::parallel_for(batch, [&](int64_t b) {
    for (int64_t i = 0; i < count; ++i)
      uniforms[b * count + i] = philox_uniform(static_cast<uint64_t>(seeds[b]),
                                               static_cast<uint64_t>(offsets[b]),
                                               static_cast<uint64_t>(i));
  });
}

}  // namespace tlt
