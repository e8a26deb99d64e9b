// Draft trees: selecting the nodes to verify (EAGLE-2 dynamic tree) and deriving the tree's
// metadata (depths, positions, bit-packed ancestor mask) from its parent links.
//
// A draft tree of row b is tokens[b, 0:N] and parents[b, 0:N]. Node 0 is the root: the last
// committed token, whose K/V is not in the cache yet. parents[b, 0] = -1 and, for every valid
// node i >= 1, 0 <= parents[b, i] < i (topological order). Rows may be ragged: nodes
// i >= num_nodes[b] are padding, ignored by every kernel.
#pragma once

#include <cstdint>

#include "tlt/common.h"

namespace tlt {

// ---------------------------------------------------------------------------------------
// select_tree: keep the best N-1 draft candidates (plus the root) by cumulative score.
//
// Inputs, per row b (M candidates, the flattened per-depth top-k expansions of the drafter):
//   cand_tokens[B, M]  int64   token of candidate m
//   cand_scores[B, M]  float32 cumulative draft log-prob of the path root..m; -inf marks an
//                              invalid / padding candidate that is never selected
//   cand_parents[B, M] int32   -1 if m is a child of the root, else the candidate index of its
//                              parent, which must be < m (so candidate order is topological)
//   root_tokens[B]     int64
// Selection: effective score eff[m] = min(score[m], eff[parent[m]]) (a path never scores
// higher than its prefix, so the selection is ancestor-closed even for scores that are not
// monotone along a path). Candidates are ranked by (eff descending, m ascending); the best
// min(N-1, #candidates with eff > -inf) are kept. A parent always outranks its child (eff is
// not larger, index is smaller), hence every kept candidate's parent is kept.
// Output order: root at 0, then kept candidates by (depth ascending, eff descending, m
// ascending) -- topological, with siblings ordered by draft score.
// Outputs:
//   tokens[B, N]       int64   node tokens; padding nodes get 0
//   parents[B, N]      int32   node parents; -1 for the root and for padding nodes
//   source_index[B, N] int32   candidate index of each node; -1 for the root and padding
//   num_nodes[B]       int32   1 + number of kept candidates
//   row_status[B]      int32   kRowBadParent if a candidate's parent is not in [-1, m)
// Limits: 1 <= N <= kMaxTreeNodes, 0 <= M <= kMaxCandidates.
void select_tree_cpu(const int64_t* cand_tokens, const float* cand_scores,
                     const int32_t* cand_parents, const int64_t* root_tokens, int64_t batch,
                     int64_t num_candidates, int64_t num_nodes_max, int64_t* tokens,
                     int32_t* parents, int32_t* source_index, int32_t* num_nodes,
                     int32_t* row_status);
void select_tree_cuda(const int64_t* cand_tokens, const float* cand_scores,
                      const int32_t* cand_parents, const int64_t* root_tokens, int64_t batch,
                      int64_t num_candidates, int64_t num_nodes_max, int64_t* tokens,
                      int32_t* parents, int32_t* source_index, int32_t* num_nodes,
                      int32_t* row_status, void* stream);

// ---------------------------------------------------------------------------------------
// tree_metadata: depths, positions and the bit-packed ancestor mask of a tree.
//
// Inputs:
//   parents[B, N]   int32
//   num_nodes[B]    int32 (nullptr: every row has N nodes)
//   cache_len[B]    int32 (nullptr: 0) committed tokens already in the KV cache; the root sits
//                   at position cache_len[b]
// Outputs:
//   depths[B, N]    int32   depth of node i (root 0); 0 for padding
//   positions[B, N] int64   cache_len[b] + depths[b, i]; cache_len[b] for padding
//   mask[B, N, W]   int32   W = mask_words(N); bit j of row i is set iff node j is node i or an
//                           ancestor of it. A padding node sees only itself (a softmax over its
//                           row never divides by zero). Words are little-endian bit sets:
//                           node j is bit (j & 31) of word (j >> 5).
//   row_status[B]   int32   kRowBadNumNodes / kRowBadParent; a failed row gets depth 0 and a
//                           self-only mask for every node
void tree_metadata_cpu(const int32_t* parents, const int32_t* num_nodes, const int32_t* cache_len,
                       int64_t batch, int64_t num_nodes_max, int32_t* depths, int64_t* positions,
                       int32_t* mask, int32_t* row_status);
void tree_metadata_cuda(const int32_t* parents, const int32_t* num_nodes,
                        const int32_t* cache_len, int64_t batch, int64_t num_nodes_max,
                        int32_t* depths, int64_t* positions, int32_t* mask, int32_t* row_status,
                        void* stream);

}  // namespace tlt
