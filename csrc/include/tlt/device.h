// Selecting the CUDA device a kernel launch goes to (CUDA builds only).
#pragma once

#include <cstdint>

namespace tlt {

// Makes `device` current for the calling thread; throws std::runtime_error on failure.
void cuda_set_device(int64_t device);

}  // namespace tlt
