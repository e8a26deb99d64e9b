// CPU implementation of tree.h. Rows are independent, so they are split across threads;
// within a row the work is O(M log M) (selection) or O(N * depth) (metadata).
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "cpu_common.h"
#include "parallel.h"
#include "tlt/tree.h"

namespace tlt {
namespace {

void pad_tree_row(int64_t root_token, int64_t n_max, int64_t* tokens, int32_t* parents,
                  int32_t* source_index) {
  for (int64_t i = 0; i < n_max; ++i) {
    tokens[i] = 0;
    parents[i] = -1;
    source_index[i] = -1;
  }
  tokens[0] = root_token;
}

int32_t select_tree_row(const int64_t* cand_tokens, const float* cand_scores,
                        const int32_t* cand_parents, int64_t root_token, int64_t num_candidates,
                        int64_t n_max, int64_t* tokens, int32_t* parents,
                        int32_t* source_index, int32_t* num_nodes) {
  pad_tree_row(root_token, n_max, tokens, parents, source_index);
  *num_nodes = 1;
  std::vector<float> eff(num_candidates);
  std::vector<int32_t> depth(num_candidates);
  std::vector<int32_t> ranked;
  ranked.reserve(num_candidates);
  for (int64_t m = 0; m < num_candidates; ++m) {
    const int32_t parent = cand_parents[m];
    if (parent < -1 || parent >= m) return kRowBadParent;
    // NaN ranks like -inf (never kept), so a NaN parent cannot leave an orphan child.
    const float score = std::isnan(cand_scores[m]) ? -std::numeric_limits<float>::infinity()
                                                   : cand_scores[m];
    eff[m] = parent < 0 ? score : std::min(score, eff[parent]);
    depth[m] = parent < 0 ? 1 : depth[parent] + 1;
    if (eff[m] > -std::numeric_limits<float>::infinity()) ranked.push_back(static_cast<int32_t>(m));
  }
  const int64_t keep = std::min<int64_t>(n_max - 1, static_cast<int64_t>(ranked.size()));
  auto by_score = [&](int32_t a, int32_t b) { return eff[a] > eff[b] || (eff[a] == eff[b] && a < b); };
  std::partial_sort(ranked.begin(), ranked.begin() + keep, ranked.end(), by_score);
  ranked.resize(keep);
  std::sort(ranked.begin(), ranked.end(), [&](int32_t a, int32_t b) {
    return depth[a] < depth[b] || (depth[a] == depth[b] && by_score(a, b));
  });
  // Candidate -> output node; ancestor closure guarantees every kept parent is mapped.
  std::vector<int32_t> node_of(num_candidates, -1);
  for (int64_t i = 0; i < keep; ++i) {
    const int32_t m = ranked[i];
    node_of[m] = static_cast<int32_t>(i + 1);
    tokens[i + 1] = cand_tokens[m];
    parents[i + 1] = cand_parents[m] < 0 ? 0 : node_of[cand_parents[m]];
    source_index[i + 1] = m;
  }
  *num_nodes = static_cast<int32_t>(keep + 1);
  return kRowOk;
}

}  // namespace

void select_tree_cpu(const int64_t* cand_tokens, const float* cand_scores,
                     const int32_t* cand_parents, const int64_t* root_tokens, int64_t batch,
                     int64_t num_candidates, int64_t num_nodes_max, int64_t* tokens,
                     int32_t* parents, int32_t* source_index, int32_t* num_nodes,
                     int32_t* row_status) {
  cpu::check_common_sizes(batch, num_nodes_max);
  cpu::require(num_candidates >= 0 && num_candidates <= kMaxCandidates, "cand_tokens",
               "M must be in [0, " + std::to_string(kMaxCandidates) + "]");
  cpu::parallel_for(batch, [&](int64_t b) {
    const int64_t c0 = b * num_candidates, n0 = b * num_nodes_max;
    row_status[b] = select_tree_row(cand_tokens + c0, cand_scores + c0, cand_parents + c0,
                                    root_tokens[b], num_candidates, num_nodes_max, tokens + n0,
                                    parents + n0, source_index + n0, num_nodes + b);
    if (row_status[b] != kRowOk) {
      pad_tree_row(root_tokens[b], num_nodes_max, tokens + n0, parents + n0, source_index + n0);
      num_nodes[b] = 1;
    }
  });
}

void tree_metadata_cpu(const int32_t* parents, const int32_t* num_nodes, const int32_t* cache_len,
                       int64_t batch, int64_t num_nodes_max, int32_t* depths, int64_t* positions,
                       int32_t* mask, int32_t* row_status) {
  cpu::check_common_sizes(batch, num_nodes_max);
  const int64_t n_max = num_nodes_max, words = mask_words(n_max);
  cpu::parallel_for(batch, [&](int64_t b) {
    const int32_t* row_parents = parents + b * n_max;
    int32_t* row_depths = depths + b * n_max;
    int64_t* row_positions = positions + b * n_max;
    int32_t* row_mask = mask + b * n_max * words;
    const int64_t base = cache_len ? cache_len[b] : 0;
    int64_t valid = num_nodes ? num_nodes[b] : n_max;
    int32_t status = kRowOk;
    if (valid < 1 || valid > n_max) status = kRowBadNumNodes;
    for (int64_t i = 1; status == kRowOk && i < valid; ++i)
      if (row_parents[i] < 0 || row_parents[i] >= i) status = kRowBadParent;
    if (status != kRowOk) valid = 0;  // every node becomes self-only padding
    std::fill(row_mask, row_mask + n_max * words, 0);
    for (int64_t i = 0; i < n_max; ++i) {
      uint32_t* bits = reinterpret_cast<uint32_t*>(row_mask + i * words);
      if (i > 0 && i < valid) {
        // A node sees what its parent sees, plus itself; parents come first.
        const int32_t parent = row_parents[i];
        const uint32_t* parent_bits = reinterpret_cast<const uint32_t*>(row_mask + parent * words);
        std::copy(parent_bits, parent_bits + words, bits);
        row_depths[i] = row_depths[parent] + 1;
      } else {
        row_depths[i] = 0;
      }
      bits[i >> 5] |= uint32_t{1} << (i & 31);
      row_positions[i] = base + row_depths[i];
    }
    row_status[b] = status;
  });
}

}  // namespace tlt
