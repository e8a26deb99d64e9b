// Internal helpers of the CUDA kernels (not part of the public API): host-side argument checks
// that throw std::invalid_argument naming the argument, and a launcher that turns the caller's
// `void* stream` into a cudaStream_t and throws std::runtime_error if the launch failed.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <initializer_list>
#include <stdexcept>
#include <string>
#include <utility>

namespace tlt {
namespace cuda_detail {

// Largest grid.x of a kernel that runs one block per row.
constexpr int64_t kMaxGridX = 2147483647;

inline void check_arg(bool ok, const char* fn, const char* arg, const std::string& what) {
  if (!ok) throw std::invalid_argument(std::string(fn) + ": " + arg + " " + what);
}

inline void check_range(const char* fn, const char* arg, int64_t value, int64_t lo, int64_t hi) {
  check_arg(value >= lo && value <= hi, fn, arg,
            "must be in [" + std::to_string(lo) + ", " + std::to_string(hi) + "], got " +
                std::to_string(value));
}

inline void check_not_null(const char* fn, const char* arg, const void* ptr) {
  check_arg(ptr != nullptr, fn, arg, "must not be null");
}

inline void check_aligned(const char* fn, const char* arg, const void* ptr, uintptr_t align) {
  check_arg(reinterpret_cast<uintptr_t>(ptr) % align == 0, fn, arg,
            "must be aligned to " + std::to_string(align) + " bytes");
}

// a * b * c ... fits in int64 (all factors >= 0).
inline bool product_fits(std::initializer_list<int64_t> factors) {
  int64_t product = 1;
  for (const int64_t f : factors) {
    if (f != 0 && product > INT64_MAX / f) return false;
    product *= f;
  }
  return true;
}

// Throws std::runtime_error if the last launch (or an earlier asynchronous error) failed.
inline void check_launch(const char* fn) {
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string(fn) + ": CUDA error: " + cudaGetErrorString(err));
  }
}

// kernel<<<grid, block, smem_bytes, stream>>>(args...), then check_launch(fn).
template <typename... KernelArgs, typename... Args>
void launch(const char* fn, void (*kernel)(KernelArgs...), dim3 grid, dim3 block,
            size_t smem_bytes, void* stream, Args&&... args) {
  kernel<<<grid, block, smem_bytes, static_cast<cudaStream_t>(stream)>>>(
      std::forward<Args>(args)...);
  check_launch(fn);
}

}  // namespace cuda_detail
}  // namespace tlt
