// Workspace the CUDA sampling verifier needs. Defined outside the CUDA sources so CPU-only builds
// can answer the question too.
#include "verify_workspace.h"

#include "tlt/verify.h"

namespace tlt {

// Both draft modes cache the visited node's weights: the same size either way.
int64_t verify_tree_sampling_workspace_bytes(int64_t batch, int64_t vocab) {
  return batch * sampling_workspace_stride(vocab) * static_cast<int64_t>(sizeof(float));
}

}  // namespace tlt
