// Shared vocabulary of every tlt_core kernel: dtypes, devices, per-row status codes,
// and the host/device annotation. No framework types anywhere in csrc/.
//
// Calling convention (every kernel):
//   * plain function over raw pointers, sizes and, for CUDA, a cudaStream_t passed as void*;
//   * all arrays are dense, row-major and contiguous, shapes are written [B, N, V] etc.;
//   * arguments the caller can get wrong cheaply (sizes, limits) are checked on the host and
//     raise std::invalid_argument (pybind11 turns it into ValueError);
//   * data-dependent problems (NaN logits, token ids out of range, ...) are reported per row in
//     an int32 `row_status[B]` output with the codes below: kernels never read or write out of
//     bounds, never trap, and leave a failed row's outputs in a defined padded state.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define TLT_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define TLT_HOST_DEVICE inline
#endif

namespace tlt {

// Element type of a floating-point input (logits, draft probabilities).
enum class FloatType : int32_t { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// Per-row status codes written to `row_status[B]`. 0 means the row is valid.
enum RowStatus : int32_t {
  kRowOk = 0,
  kRowBadLogits = 1,      // a visited logit (or l / T) is NaN or +inf, or all are -inf
  kRowBadToken = 2,       // a valid non-root node's token id is outside [0, V)
  kRowBadParent = 3,      // a valid node's parent is not in [0, i)
  kRowBadDraftProbs = 4,  // a visited q row is negative / non-finite / does not sum to 1 (1e-3)
  kRowBadNumNodes = 5,    // num_nodes[b] outside [1, N]
  kRowBadUniform = 6,     // a uniform used by the walk is outside [0, 1)
  kRowBadCacheRange = 7,  // cache_len[b] + node index would leave [0, max_len)
};

// Largest sizes the kernels accept (checked on the host). They bound shared-memory use on
// CUDA and keep the bit-packed mask small; EAGLE-2 / SGLang trees use N <= 64.
constexpr int64_t kMaxTreeNodes = 1024;       // N
constexpr int64_t kMaxCandidates = 4096;      // M (tree selection)
constexpr int64_t kMaxVocab = int64_t{1} << 24;  // V

// Words of the bit-packed ancestor mask per node: bit (j & 31) of word (j >> 5).
TLT_HOST_DEVICE int64_t mask_words(int64_t num_nodes) { return (num_nodes + 31) / 32; }

}  // namespace tlt
