// Layout of the CUDA sampling verifier's workspace, shared by the size query (compiled in every
// build) and the kernel: one row of float32 per batch row, holding the visited node's cached
// weights, padded to whole chunks of 8 tokens so the kernel's 32-byte accesses stay in bounds.
#pragma once

#include <cstdint>

namespace tlt {

inline int64_t sampling_workspace_stride(int64_t vocab) { return (vocab + 7) / 8 * 8; }

}  // namespace tlt
