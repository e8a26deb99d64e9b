// CUDA implementation of device.h.
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "tlt/device.h"

namespace tlt {

void cuda_set_device(int64_t device) {
  const cudaError_t status = cudaSetDevice(static_cast<int>(device));
  if (status != cudaSuccess)
    throw std::runtime_error("cudaSetDevice(" + std::to_string(device) +
                             ") failed: " + cudaGetErrorString(status));
}

}  // namespace tlt
