// CUDA implementations of select_tree and tree_metadata (tree.h).
#include <cub/block/block_scan.cuh>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "cuda_check.h"
#include "tlt/tree.h"

namespace tlt {
namespace {

// ----------------------------------------------------------------------------------------
// select_tree

constexpr int kSelectThreads = 512;
constexpr int kSelectWarps = kSelectThreads / 32;
constexpr int kSelectItems = static_cast<int>(kMaxCandidates) / kSelectThreads;  // per thread
static_assert(kSelectItems * kSelectThreads == kMaxCandidates, "candidates must tile the block");
static_assert(kMaxCandidates <= 4096 && kMaxTreeNodes <= 65535,
              "the packed sort key and the uint16 depth/position arrays assume these limits");

// Dynamic shared memory per candidate: ancestor (int32) + effective score (float) + depth
// (uint16) = 10 bytes, 40 KB at M = 4096, under the 48 KB that needs no opt-in.
constexpr int64_t kSelectSmemPerCandidate = 10;
static_assert(kSelectSmemPerCandidate * kMaxCandidates <= 48 * 1024 - 4096,
              "select_tree shared memory must stay below the default 48 KB limit");

using SelectScan = cub::BlockScan<int, kSelectThreads>;

// Block-wide sum, returned to every thread. Ends with a barrier so `scratch` can be reused.
__device__ int select_block_sum(int value, int* scratch) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    value += __shfl_xor_sync(0xffffffffu, value, offset);
  }
  if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = value;
  __syncthreads();
  int total = 0;
  for (int w = 0; w < kSelectWarps; ++w) total += scratch[w];
  __syncthreads();
  return total;
}

// Rank key of a score: smaller key = higher score; -0 and +0 share one key.
__device__ uint32_t descending_key(float score) {
  if (score == 0.0f) return ~0x80000000u;
  const uint32_t bits = __float_as_uint(score);
  const uint32_t ascending = (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
  return ~ascending;
}

// One block per row: the row's candidates are coupled (effective scores follow parent links,
// the selection is a top-K over the whole row) and M <= 4096 fits one block's shared memory.
// Thread t owns candidates [t * kSelectItems, (t + 1) * kSelectItems) (blocked, so block scans
// run in candidate order). Steps:
//   1. pointer jumping (log2(depth) rounds) gives eff[m] = min of the scores on the path
//      root..m and the depth of m; min is exact, so this equals the sequential recurrence;
//   2. a 32-step bisection finds the K-th best rank key, ties on it are broken by index with
//      a block scan, which yields exactly the first K candidates in (eff desc, m asc) order;
//   3. the kept candidates are compacted and each one's output slot is its rank under the
//      packed key (depth, descending eff, m), counted against the K <= N - 1 kept keys.
__global__ __launch_bounds__(kSelectThreads) void select_tree_kernel(
    const int64_t* cand_tokens,   // (B, M)
    const float* cand_scores,     // (B, M)
    const int32_t* cand_parents,  // (B, M)
    const int64_t* root_tokens,   // (B)
    int num_candidates, int num_nodes_max,
    int64_t* tokens,              // (B, N)
    int32_t* parents,             // (B, N)
    int32_t* source_index,        // (B, N)
    int32_t* num_nodes,           // (B)
    int32_t* row_status) {        // (B)
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ typename SelectScan::TempStorage scan_storage;
  __shared__ int scratch[kSelectWarps];

  const int M = num_candidates;
  const int N = num_nodes_max;
  const int64_t b = blockIdx.x;
  const int tid = threadIdx.x;
  // Phase 1 arrays; phase 2 reuses the first 8 * M bytes for the packed keys of the kept
  // candidates (K <= M) and the depth array for their output positions.
  int32_t* s_anc = reinterpret_cast<int32_t*>(smem);           // (M)
  float* s_eff = reinterpret_cast<float*>(smem + 4 * M);       // (M)
  uint16_t* s_dep = reinterpret_cast<uint16_t*>(smem + 8 * M); // (M)
  uint64_t* s_key = reinterpret_cast<uint64_t*>(smem);         // (K)
  uint16_t* s_pos = s_dep;                                     // (M)

  const int64_t* row_tokens = cand_tokens + b * M;
  const float* row_scores = cand_scores + b * M;
  const int32_t* row_parents = cand_parents + b * M;
  int64_t* out_tokens = tokens + b * N;
  int32_t* out_parents = parents + b * N;
  int32_t* out_source = source_index + b * N;

  int anc[kSelectItems];
  float eff[kSelectItems];
  int dep[kSelectItems];
  bool bad_parent = false;
#pragma unroll
  for (int i = 0; i < kSelectItems; ++i) {
    const int m = tid * kSelectItems + i;
    anc[i] = -1;
    eff[i] = -INFINITY;
    dep[i] = 0;
    if (m < M) {
      const int32_t p = row_parents[m];
      bad_parent |= p < -1 || p >= m;
      float s = row_scores[m];
      if (isnan(s)) s = -INFINITY;  // a NaN score is unselectable, like padding
      if (s == 0.0f) s = 0.0f;      // -0 -> +0, so min() and the key agree with float compare
      anc[i] = p;
      eff[i] = s;
      dep[i] = 1;
      s_anc[m] = p;
      s_eff[m] = s;
      s_dep[m] = 1;
    }
  }
  if (__syncthreads_or(bad_parent)) {
    for (int i = tid; i < N; i += kSelectThreads) {
      out_tokens[i] = i == 0 ? root_tokens[b] : 0;
      out_parents[i] = -1;
      out_source[i] = -1;
    }
    if (tid == 0) {
      num_nodes[b] = 1;
      row_status[b] = kRowBadParent;
    }
    return;
  }

  // 1. Pointer jumping. Invariant: eff[m] = min score and dep[m] = count of the candidates on
  //    the path from m up to (excluding) anc[m]; anc = -1 means the path reached the root.
  bool pending = false;
#pragma unroll
  for (int i = 0; i < kSelectItems; ++i) pending |= anc[i] >= 0;
  while (__syncthreads_or(pending)) {
#pragma unroll
    for (int i = 0; i < kSelectItems; ++i) {
      if (anc[i] >= 0) {
        const int a = anc[i];
        eff[i] = fminf(eff[i], s_eff[a]);
        dep[i] += s_dep[a];
        anc[i] = s_anc[a];
      }
    }
    __syncthreads();  // every read of this round precedes every write
    pending = false;
#pragma unroll
    for (int i = 0; i < kSelectItems; ++i) {
      const int m = tid * kSelectItems + i;
      if (m < M) {
        s_anc[m] = anc[i];
        s_eff[m] = eff[i];
        s_dep[m] = static_cast<uint16_t>(dep[i]);
      }
      pending |= anc[i] >= 0;
    }
  }

  // 2. Keep the first K in (eff desc, m asc) order.
  uint32_t key[kSelectItems];
  int valid[kSelectItems];
  int count = 0;
#pragma unroll
  for (int i = 0; i < kSelectItems; ++i) {
    valid[i] = eff[i] > -INFINITY;  // false for m >= M
    key[i] = descending_key(eff[i]);
    count += valid[i];
  }
  const int num_valid = select_block_sum(count, scratch);
  const int K = min(N - 1, num_valid);

  int kept[kSelectItems];
#pragma unroll
  for (int i = 0; i < kSelectItems; ++i) kept[i] = 0;
  if (K > 0) {
    // Smallest threshold t with #{valid keys <= t} >= K, i.e. the K-th smallest key.
    uint32_t threshold = 0;
    for (int bit = 31; bit >= 0; --bit) {
      const uint32_t probe = threshold | ((1u << bit) - 1u);
      count = 0;
#pragma unroll
      for (int i = 0; i < kSelectItems; ++i) count += valid[i] && key[i] <= probe;
      if (select_block_sum(count, scratch) < K) threshold |= 1u << bit;
    }
    count = 0;
#pragma unroll
    for (int i = 0; i < kSelectItems; ++i) count += valid[i] && key[i] < threshold;
    const int ties_kept = K - select_block_sum(count, scratch);  // >= 1
    int tie[kSelectItems];
    int tie_rank[kSelectItems];
#pragma unroll
    for (int i = 0; i < kSelectItems; ++i) tie[i] = valid[i] && key[i] == threshold;
    SelectScan(scan_storage).ExclusiveSum(tie, tie_rank);
    __syncthreads();  // scan_storage is reused below
#pragma unroll
    for (int i = 0; i < kSelectItems; ++i) {
      kept[i] = valid[i] && (key[i] < threshold || (tie[i] && tie_rank[i] < ties_kept));
    }
  }

  // 3. Compact the kept candidates' packed keys (depth <= 4096: 13 bits, key: 32, m: 12).
  int slot[kSelectItems];
  SelectScan(scan_storage).ExclusiveSum(kept, slot);
  __syncthreads();  // phase-1 arrays are dead from here on
#pragma unroll
  for (int i = 0; i < kSelectItems; ++i) {
    if (kept[i]) {
      const int m = tid * kSelectItems + i;
      s_key[slot[i]] = (static_cast<uint64_t>(dep[i]) << 44) |
                       (static_cast<uint64_t>(key[i]) << 12) | static_cast<uint64_t>(m);
    }
  }
  __syncthreads();
  for (int k = tid; k < K; k += kSelectThreads) {
    const uint64_t mine = s_key[k];
    int rank = 0;
    for (int j = 0; j < K; ++j) rank += s_key[j] < mine;
    s_pos[mine & 0xFFFu] = static_cast<uint16_t>(1 + rank);
  }
  __syncthreads();
  for (int k = tid; k < K; k += kSelectThreads) {
    const int m = static_cast<int>(s_key[k] & 0xFFFu);
    const int pos = s_pos[m];
    const int32_t p = row_parents[m];  // kept, since a parent outranks its child
    out_tokens[pos] = row_tokens[m];
    out_parents[pos] = p < 0 ? 0 : s_pos[p];
    out_source[pos] = m;
  }
  for (int i = tid; i < N; i += kSelectThreads) {
    if (i == 0 || i > K) {
      out_tokens[i] = i == 0 ? root_tokens[b] : 0;
      out_parents[i] = -1;
      out_source[i] = -1;
    }
  }
  if (tid == 0) {
    num_nodes[b] = K + 1;
    row_status[b] = kRowOk;
  }
}

// ----------------------------------------------------------------------------------------
// tree_metadata

// One block per row, one thread per node (strided when N > blockDim): a node's depth and
// ancestor mask come from walking its own parent chain in shared memory, so nodes are
// independent and no level-by-level synchronisation is needed. The chain visits ancestors in
// decreasing index order, so mask words complete from the highest to the lowest and each
// word is stored once.
__global__ __launch_bounds__(1024) void tree_metadata_kernel(
    const int32_t* parents,    // (B, N)
    const int32_t* num_nodes,  // (B) or nullptr
    const int32_t* cache_len,  // (B) or nullptr
    int num_nodes_max, int words,
    int32_t* depths,           // (B, N)
    int64_t* positions,        // (B, N)
    int32_t* mask,             // (B, N, W)
    int32_t* row_status) {     // (B)
  __shared__ int32_t s_par[kMaxTreeNodes];
  const int N = num_nodes_max;
  const int64_t b = blockIdx.x;
  const int n = num_nodes != nullptr ? num_nodes[b] : N;
  const int64_t base = cache_len != nullptr ? cache_len[b] : 0;

  int status = kRowOk;
  if (n < 1 || n > N) {
    status = kRowBadNumNodes;
  } else {
    bool bad = false;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
      const int32_t p = parents[b * N + i];
      s_par[i] = p;
      bad |= i > 0 && (p < 0 || p >= i);
    }
    if (__syncthreads_or(bad)) status = kRowBadParent;
  }

  const bool ok = status == kRowOk;
  for (int i = threadIdx.x; i < N; i += blockDim.x) {
    uint32_t* row = reinterpret_cast<uint32_t*>(mask) + (b * N + i) * words;  // (W)
    int depth = 0;
    if (!ok || i >= n) {
      for (int w = 0; w < words; ++w) row[w] = w == (i >> 5) ? 1u << (i & 31) : 0u;
    } else {
      int word = words - 1;
      uint32_t bits = 0;
      for (int j = i;; j = s_par[j], ++depth) {  // terminates: 0 <= parent < j for j >= 1
        for (; word > (j >> 5); --word) {
          row[word] = bits;
          bits = 0;
        }
        bits |= 1u << (j & 31);
        if (j == 0) break;
      }
      for (; word >= 0; --word) {
        row[word] = bits;
        bits = 0;
      }
    }
    depths[b * N + i] = depth;
    positions[b * N + i] = base + depth;
  }
  if (threadIdx.x == 0) row_status[b] = status;
}

}  // namespace

void select_tree_cuda(const int64_t* cand_tokens, const float* cand_scores,
                      const int32_t* cand_parents, const int64_t* root_tokens, int64_t batch,
                      int64_t num_candidates, int64_t num_nodes_max, int64_t* tokens,
                      int32_t* parents, int32_t* source_index, int32_t* num_nodes,
                      int32_t* row_status, void* stream) {
  using namespace cuda_detail;
  constexpr const char* fn = "select_tree_cuda";
  check_range(fn, "batch", batch, 0, kMaxGridX);
  check_range(fn, "num_candidates", num_candidates, 0, kMaxCandidates);
  check_range(fn, "num_nodes_max", num_nodes_max, 1, kMaxTreeNodes);
  if (batch == 0) return;
  if (num_candidates > 0) {
    check_not_null(fn, "cand_tokens", cand_tokens);
    check_not_null(fn, "cand_scores", cand_scores);
    check_not_null(fn, "cand_parents", cand_parents);
  }
  check_not_null(fn, "root_tokens", root_tokens);
  check_not_null(fn, "tokens", tokens);
  check_not_null(fn, "parents", parents);
  check_not_null(fn, "source_index", source_index);
  check_not_null(fn, "num_nodes", num_nodes);
  check_not_null(fn, "row_status", row_status);
  const size_t smem = static_cast<size_t>(kSelectSmemPerCandidate * num_candidates);
  launch(fn, select_tree_kernel, dim3(static_cast<unsigned>(batch)), dim3(kSelectThreads), smem,
         stream, cand_tokens, cand_scores, cand_parents, root_tokens,
         static_cast<int>(num_candidates), static_cast<int>(num_nodes_max), tokens, parents,
         source_index, num_nodes, row_status);
}

void tree_metadata_cuda(const int32_t* parents, const int32_t* num_nodes,
                        const int32_t* cache_len, int64_t batch, int64_t num_nodes_max,
                        int32_t* depths, int64_t* positions, int32_t* mask, int32_t* row_status,
                        void* stream) {
  using namespace cuda_detail;
  constexpr const char* fn = "tree_metadata_cuda";
  check_range(fn, "batch", batch, 0, kMaxGridX);
  check_range(fn, "num_nodes_max", num_nodes_max, 1, kMaxTreeNodes);
  if (batch == 0) return;
  check_not_null(fn, "parents", parents);
  check_not_null(fn, "depths", depths);
  check_not_null(fn, "positions", positions);
  check_not_null(fn, "mask", mask);
  check_not_null(fn, "row_status", row_status);
  const int threads = static_cast<int>(std::min<int64_t>(1024, (num_nodes_max + 31) / 32 * 32));
  launch(fn, tree_metadata_kernel, dim3(static_cast<unsigned>(batch)), dim3(threads), 0, stream,
         parents, num_nodes, cache_len, static_cast<int>(num_nodes_max),
         static_cast<int>(mask_words(num_nodes_max)), depths, positions, mask, row_status);
}

}  // namespace tlt
