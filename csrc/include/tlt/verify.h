// Tree verification: walk a draft tree against the target's logits and decide, losslessly,
// which draft tokens to keep.
//
// Shapes: B rows, N tree nodes, V vocabulary. Tree inputs as in tree.h (tokens[B, N] int64,
// parents[B, N] int32, num_nodes[B] int32 or nullptr for "all N"). logits[B, N, V] are the
// target's logits at each node, i.e. the target's prediction of the token that follows the
// node (dtype given by FloatType; float16/bfloat16 are widened to float32 on load).
// children(v) = the valid nodes c with parents[c] == v, tried in increasing index order
// (the sibling order, which select_tree makes the draft-score order).
//
// Outputs shared by both verifiers (padding after the valid entries):
//   accept_index[B, N]     int32   accepted path: node 0 (root) first, then each accepted
//                                  draft node; -1 after the path
//   num_accepted[B]        int32   accepted draft nodes (path length - 1)
//   emitted_tokens[B, N]   int64   tokens this step commits: the accepted draft tokens, then
//                                  one final token (the "bonus" / corrected token); the row
//                                  emits num_accepted + 1 tokens; -1 after them
//   emitted_logprobs[B, N] float32 target log-probability of each emitted token, at the node
//                                  that emitted it (see below); 0 after them
//   row_status[B]          int32   RowStatus; a failed row gets num_accepted 0 and padding
//                                  everywhere (emitted_tokens[b, 0] = -1 too)
#pragma once

#include <cstdint>

#include "tlt/common.h"

namespace tlt {

// ---------------------------------------------------------------------------------------
// verify_tree_greedy: walk from the root, at each node moving to the first child (sibling
// order) whose token equals the target's argmax there; the final token is the argmax at the
// path's last node. When siblings carry distinct tokens (select_tree's trees, a trie of n-gram
// drafts) this is the longest path whose every token equals the target's argmax at its parent;
// siblings with equal tokens should be merged, as only the first is followed.
//   argmax ties resolve to the lowest token id.
//   emitted_logprobs: log_softmax(logits[b, v]) of the emitted token at temperature 1 (greedy
//   has no sampling distribution; this is what a trainer recomputes).
// Only the nodes on the accepted path are read (fused: no [B, N] argmax is materialised).
void verify_tree_greedy_cpu(const void* logits, FloatType logits_type, const int64_t* tokens,
                            const int32_t* parents, const int32_t* num_nodes, int64_t batch,
                            int64_t num_nodes_max, int64_t vocab, int32_t* accept_index,
                            int32_t* num_accepted, int64_t* emitted_tokens,
                            float* emitted_logprobs, int32_t* row_status, int isa = 0);
void verify_tree_greedy_cuda(const void* logits, FloatType logits_type, const int64_t* tokens,
                             const int32_t* parents, const int32_t* num_nodes, int64_t batch,
                             int64_t num_nodes_max, int64_t vocab, int32_t* accept_index,
                             int32_t* num_accepted, int64_t* emitted_tokens,
                             float* emitted_logprobs, int32_t* row_status, void* stream);

// ---------------------------------------------------------------------------------------
// verify_tree_sampling: lossless tree rejection sampling (Leviathan et al. 2023, Chen et al.
// 2023; multi-draft recursion as in SpecInfer, Miao et al. 2024), fused with the temperature /
// top-k / top-p transform of the target logits, evaluated only at the nodes the walk visits.
//
// Per row parameters: temperature[B] float32 (>= 0; 0 = greedy row), top_k[B] int32
// (<= 0 or >= V: off), top_p[B] float32 in (0, 1] (1: off).
//
// The target distribution p_v at a visited node v, row b:
//   T > 0:  l = logits[b, v, :] as float32;  z(x) = l(x) / T  (IEEE division);
//           top-k: if 0 < k < V, theta = k-th largest z (duplicates counted), keep z(x) >= theta;
//           m = max z;  e(x) = expf(z(x) - m) for kept x, else 0;  Z = sum e;
//           top-p: if top_p < 1, keep x iff  sum_{y: e(y) > e(x)} e(y)  <  top_p * Z
//           (ties at the boundary are kept together; order independent);
//           w(x) = e(x) if kept else 0;  S = sum w;  p_v = w / S.
//   T == 0: a = argmax l (lowest id on ties); w = one_hot(a); S = 1.
// The walk, starting at v = 0 (the root):
//   for each child c of v, in sibling order, with draft token x = tokens[b, c]:
//     deterministic drafts (draft_probs == nullptr; q is one-hot at x, EAGLE/SGLang style):
//       accept iff u[b, c] * S < w(x); on rejection: S -= w(x); w(x) = 0.
//     sampled drafts (q = draft_probs[b, v, :], the distribution v's children were sampled
//     from, i.i.d.):
//       accept iff u[b, c] * q(x) * S < w(x); on rejection the residual
//       w(y) = max(0, w(y) - q(y) * S) for all y, S = sum w (if that mass is 0, w is kept).
//     on acceptance: emit x, move to v = c and start again with a fresh p_c.
//   when no child is accepted (or v is a leaf): emit the final token from w / S with u[b, 0]:
//     the smallest x whose running sum sum_{y <= x} w(y) exceeds u[b, 0] * S; if rounding
//     leaves none, the largest x with w(x) > 0; if w is all zero, argmax of l (lowest id).
// Emitted log-probabilities are those of the distribution the token was emitted from before
// any rejection at that node: T > 0: z(x) - m - log(S_v) with S_v the fresh sum at v;
// T == 0: log_softmax(l)(x) at temperature 1.
// Randomness: uniforms[B, N] float32 in [0, 1): u[b, c] (c >= 1) tests child c, u[b, 0] draws
// the final token. Each uniform is used at most once, so results do not depend on how the walk
// is scheduled; philox_uniforms (random.h) generates them from seeds for CPU/CUDA agreement.
// Integer outputs agree across implementations except where a uniform (or top_p * Z) lies within
// float rounding of a decision threshold: the CPU kernel sums over V in double in index order,
// the CUDA kernel exactly (verify_cuda.cu explains), and exp may differ by an ulp or two
// between them. CPU isa: 0 the fastest this CPU runs (the AVX2 passes over V of vocab_passes.h,
// whose exp is within 2 ulps of expf and whose float64 sums run in eight interleaved parts),
// 1 the portable loops (std::exp, sums in index order); they agree but for that rounding.
// The CUDA kernel's result for a row does not depend on the other rows or on the batch size.
// workspace: CUDA needs verify_tree_sampling_workspace_bytes() in either draft mode (where a
// block's share of a row's V does not fit its shared memory, the visited node's weights are
// cached there); CPU: nullptr.
int64_t verify_tree_sampling_workspace_bytes(int64_t batch, int64_t vocab);
void verify_tree_sampling_cpu(const void* logits, FloatType logits_type,
                              const float* draft_probs, const int64_t* tokens,
                              const int32_t* parents, const int32_t* num_nodes,
                              const float* temperature, const int32_t* top_k,
                              const float* top_p, const float* uniforms, int64_t batch,
                              int64_t num_nodes_max, int64_t vocab, int32_t* accept_index,
                              int32_t* num_accepted, int64_t* emitted_tokens,
                              float* emitted_logprobs, int32_t* row_status, int isa = 0);
void verify_tree_sampling_cuda(const void* logits, FloatType logits_type,
                               const float* draft_probs, const int64_t* tokens,
                               const int32_t* parents, const int32_t* num_nodes,
                               const float* temperature, const int32_t* top_k,
                               const float* top_p, const float* uniforms, int64_t batch,
                               int64_t num_nodes_max, int64_t vocab, int32_t* accept_index,
                               int32_t* num_accepted, int64_t* emitted_tokens,
                               float* emitted_logprobs, int32_t* row_status, void* workspace,
                               void* stream);

}  // namespace tlt
