// CUDA implementation of philox_uniforms (random.h).
#include <algorithm>
#include <cstdint>

#include "cuda_check.h"
#include "tlt/random.h"

namespace tlt {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 65536;

// One thread per output element (grid-stride): every number is an independent Philox call, so
// the flat [B * count] index space is split evenly with coalesced stores.
__global__ void philox_uniforms_kernel(const int64_t* seeds,    // (B)
                                       const int64_t* offsets,  // (B)
                                       int64_t count, int64_t total,
                                       float* uniforms) {       // (B, count)
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += stride) {
    const int64_t b = idx / count;
    const int64_t i = idx - b * count;
    uniforms[idx] = philox_uniform(static_cast<uint64_t>(seeds[b]),
                                   static_cast<uint64_t>(offsets[b]), static_cast<uint64_t>(i));
  }
}

}  // namespace

void philox_uniforms_cuda(const int64_t* seeds, const int64_t* offsets, int64_t batch,
                          int64_t count, float* uniforms, void* stream) {
  using namespace cuda_detail;
  constexpr const char* fn = "philox_uniforms_cuda";
  check_range(fn, "batch", batch, 0, INT64_MAX);
  check_range(fn, "count", count, 0, INT64_MAX);
  check_arg(product_fits({batch, count}), fn, "batch * count", "overflows int64");
  const int64_t total = batch * count;
  if (total == 0) return;
  check_not_null(fn, "seeds", seeds);
  check_not_null(fn, "offsets", offsets);
  check_not_null(fn, "uniforms", uniforms);
  const int64_t blocks = std::min<int64_t>((total + kThreads - 1) / kThreads, kMaxBlocks);
  launch(fn, philox_uniforms_kernel, dim3(static_cast<unsigned>(blocks)), dim3(kThreads), 0,
         stream, seeds, offsets, count, total, uniforms);
}

}  // namespace tlt
