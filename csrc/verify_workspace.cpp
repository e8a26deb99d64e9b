// Workspace the CUDA sampling verifier needs (a residual buffer per row in sampled-draft mode).
// Defined outside the CUDA sources so CPU-only builds can answer the question too.
#include "tlt/verify.h"

namespace tlt {

int64_t verify_tree_sampling_workspace_bytes(int64_t batch, int64_t vocab, bool has_draft_probs) {
  return has_draft_probs ? batch * vocab * static_cast<int64_t>(sizeof(float)) : 0;
}

}  // namespace tlt
