// CUDA implementations of verify_tree_greedy and verify_tree_sampling (verify.h).
//
// A row's walk is sequential (each visited node depends on the previous acceptance), but every
// step at a node is a pass over the node's V logits. All control flow that reaches a barrier is
// uniform over the threads that share it: decisions are taken on values every thread computes
// identically (reductions hand the same total to every thread, loads of one address).
//
// verify_tree_greedy runs one block per row and makes two passes over V per visited node (max,
// then the temperature-1 normaliser), summing in double in a fixed order.
//
// verify_tree_sampling splits each row's vocabulary across a row group of `split` blocks: a thread
// block cluster on sm_90 (the blocks are co-scheduled, can read each other's shared memory and meet
// at a hardware barrier); one block per row before sm_90, and when the batch alone fills the GPU.
// Block `rank` owns a contiguous slice of V; each of its threads owns chunks of 8 consecutive
// tokens of the slice (16-byte loads of bf16 logits), the same chunks in every pass, so a thread
// only ever reads back the workspace entries it wrote itself. The node's transformed values
// (z = l / T, then e = expf(z - m)) are computed once per visited node and cached in a per-row
// float32 workspace row, which later passes read instead of the logits. Row-wide values (max, sums,
// histograms) go through an exchange: every block writes its partial into its shared memory, the
// group meets at a barrier, and every block reads all partials in rank order, so all blocks take
// the same decisions. Nothing is allocated, nothing waits for the host and no block waits on a
// block that may not be resident: the launch can be captured in a CUDA graph.
//
// Passes over a block's slice per visited node at T > 0: read the logits, write z, max / argmax
// (and the first top-k radix digit's histogram); write e and sum Z (and the first top-p
// digit's); three more 8-bit radix passes for each of top-k and top-p. The children's tests
// read single tokens. Sampled drafts: one pass to validate q, two per rejection (residual mass,
// then its store). The final token: slice totals, then a scan of the one slice that holds it.
//
// Determinism and agreement with the CPU kernel. Every sum over V that a decision depends on
// (Z, S, top-p histogram masses, a residual's mass, the inverse CDF's running sums) is exact:
// an integer in units of 2^-149 (exact_sum.h), so it does not depend on the split, the thread
// count or the order of atomics, and a row's result depends on that row alone, run to run and
// batch to batch. Z, S and residual masses are rounded once to float; the top-k / top-p
// thresholds and the inverse CDF compare exact sums with verify.h's float limits (k, top_p * Z,
// u * S), so they follow verify.h's rules exactly on the per-token float values. The CPU kernel
// sums the same values in double in index order (error far below a float ulp), so its floats
// and comparisons agree with these unless an exact value lies within that error of a float
// rounding boundary or of the limit it is compared with. The per-token values themselves agree
// except where expf here and std::exp on the CPU differ by an ulp. Hence verify.h's statement:
// integer outputs agree except where a uniform (or top_p * Z) falls within float rounding of a
// decision threshold; the GPU tests check bitwise equality on random problems.
// a * b - c is written with __fmul_rn so nvcc cannot contract it into an FMA the CPU does not do.
#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cub/block/block_scan.cuh>

#include <algorithm>
#include <array>
#include <climits>
#include <cmath>
#include <cstdint>
#include <mutex>
#include <string>

#include "cuda_check.h"
#include "exact_sum.h"
#include "tlt/verify.h"
#include "verify_workspace.h"

namespace tlt {
namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int kNone = INT_MAX;
constexpr unsigned kFullMask = 0xffffffffu;

// ---------------------------------------------------------------------------------------
// Block-wide reductions. Every thread must call them; every thread gets the result; they end
// with a barrier, so the scratch can be reused by the next call at once.

struct BlockScratch {
  double red_d[kWarps];
  int32_t red_i[2 * kWarps];
  float red_f[kWarps];
  ExactSum red_x[kWarps];
};

__device__ __forceinline__ int lane_id() { return threadIdx.x & 31; }
__device__ __forceinline__ int warp_id() { return threadIdx.x >> 5; }

__device__ double block_sum(double value, BlockScratch& s) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    value += __shfl_xor_sync(kFullMask, value, offset);
  }
  if (lane_id() == 0) s.red_d[warp_id()] = value;
  __syncthreads();
  double total = 0.0;
  for (int w = 0; w < kWarps; ++w) total += s.red_d[w];
  __syncthreads();
  return total;
}

__device__ ExactSum block_exact_sum(ExactSum value, BlockScratch& s) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    ExactSum other;
#pragma unroll
    for (int j = 0; j < 3; ++j) other.word[j] = __shfl_xor_sync(kFullMask, value.word[j], offset);
    exact_add(value, other);
  }
  if (lane_id() == 0) s.red_x[warp_id()] = value;
  __syncthreads();
  ExactSum total{{0, 0, 0}};
  for (int w = 0; w < kWarps; ++w) exact_add(total, s.red_x[w]);
  __syncthreads();
  return total;
}

// lo <- block min of lo, hi <- block max of hi.
__device__ void block_min_max(int& lo, int& hi, BlockScratch& s) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    lo = min(lo, __shfl_xor_sync(kFullMask, lo, offset));
    hi = max(hi, __shfl_xor_sync(kFullMask, hi, offset));
  }
  if (lane_id() == 0) {
    s.red_i[2 * warp_id()] = lo;
    s.red_i[2 * warp_id() + 1] = hi;
  }
  __syncthreads();
  for (int w = 0; w < kWarps; ++w) {
    lo = min(lo, s.red_i[2 * w]);
    hi = max(hi, s.red_i[2 * w + 1]);
  }
  __syncthreads();
}

__device__ int block_min(int value, BlockScratch& s) {
  int unused = 0;
  block_min_max(value, unused, s);
  return value;
}

struct ArgMax {
  float value;
  int index;  // kNone: nothing seen yet
};

// Larger value wins; on equal values the lower index.
__device__ __forceinline__ ArgMax better_of(ArgMax a, ArgMax b) {
  return (b.value > a.value || (b.value == a.value && b.index < a.index)) ? b : a;
}

__device__ ArgMax block_argmax(ArgMax best, BlockScratch& s) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    const ArgMax other{__shfl_xor_sync(kFullMask, best.value, offset),
                       __shfl_xor_sync(kFullMask, best.index, offset)};
    best = better_of(best, other);
  }
  if (lane_id() == 0) {
    s.red_f[warp_id()] = best.value;
    s.red_i[warp_id()] = best.index;
  }
  __syncthreads();
  best = ArgMax{s.red_f[0], s.red_i[0]};
  for (int w = 1; w < kWarps; ++w) best = better_of(best, ArgMax{s.red_f[w], s.red_i[w]});
  __syncthreads();
  return best;
}

// ---------------------------------------------------------------------------------------
// Logits and keys.

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

// Order-preserving float -> uint32 map; -0 and +0 share a key, as they compare equal.
__device__ __forceinline__ uint32_t order_key(float f) {
  if (f == 0.0f) return 0x80000000u;
  const uint32_t bits = __float_as_uint(f);
  return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

// ---------------------------------------------------------------------------------------
// The tree of a row, its walk and its outputs (both kernels; every block of a row group loads
// its own copy and walks it identically).

struct RowTree {
  int32_t tok[kMaxTreeNodes];    // (N) token of each valid node (checked to be in [0, V))
  int32_t par[kMaxTreeNodes];    // (N) parent of each valid node
  int32_t path[kMaxTreeNodes];   // accepted path: node 0, then each accepted node
  float logprob[kMaxTreeNodes];  // emitted log-probability at each visited node
};

// Loads the row's tree into shared memory and validates it. Returns a RowStatus. Node i's
// problems are checked for 1 <= i < n (the root's token and parent are never used); like the
// CPU kernel, the reported problem is the one of the highest bad node, its parent before its
// token.
__device__ int load_tree(const int64_t* tokens, const int32_t* parents, int n, int num_nodes_max,
                         int vocab, RowTree& tree, BlockScratch& s) {
  if (n < 1 || n > num_nodes_max) return kRowBadNumNodes;
  int worst = -1;  // 2 * node + (1 if the parent is bad, 0 if only the token is)
  for (int i = threadIdx.x; i < n; i += kThreads) {
    const int32_t p = parents[i];
    const int64_t t = tokens[i];
    const bool token_ok = t >= 0 && t < vocab;
    tree.par[i] = p;
    tree.tok[i] = token_ok ? static_cast<int32_t>(t) : 0;
    if (i > 0 && (p < 0 || p >= i)) {
      worst = max(worst, 2 * i + 1);
    } else if (i > 0 && !token_ok) {
      worst = max(worst, 2 * i);
    }
  }
  int unused = kNone;
  block_min_max(unused, worst, s);  // its barriers also publish tree.par / tree.tok
  if (worst < 0) return kRowOk;
  return (worst & 1) ? kRowBadParent : kRowBadToken;
}

// Smallest valid node c > after with parents[c] == v (and tokens[c] == token when token >= 0);
// n if there is none.
__device__ int next_child(const RowTree& tree, BlockScratch& s, int v, int after, int n,
                          int token) {
  int found = kNone;
  for (int c = after + 1 + threadIdx.x; c < n; c += kThreads) {
    if (tree.par[c] == v && (token < 0 || tree.tok[c] == token)) {
      found = c;
      break;
    }
  }
  found = block_min(found, s);
  return found == kNone ? n : found;
}

struct RowOutputs {
  int32_t* accept_index;      // (B, N)
  int32_t* num_accepted;      // (B)
  int64_t* emitted_tokens;    // (B, N)
  float* emitted_logprobs;    // (B, N)
  int32_t* row_status;        // (B)
};

// Writes row b's outputs from tree.path / tree.logprob, or the padded state of a failed row.
// Must follow a barrier after the last write to tree.path / tree.logprob.
__device__ void write_outputs(const RowOutputs& out, int64_t b, int num_nodes_max, int status,
                              int num_accepted, int final_token, const RowTree& tree) {
  const bool ok = status == kRowOk;
  for (int i = threadIdx.x; i < num_nodes_max; i += kThreads) {
    int32_t node = i == 0 ? 0 : -1;
    int64_t token = -1;
    float logprob = 0.0f;
    if (ok && i <= num_accepted) {
      node = tree.path[i];
      token = i < num_accepted ? tree.tok[tree.path[i + 1]] : final_token;
      logprob = tree.logprob[i];
    }
    const int64_t o = b * num_nodes_max + i;
    out.accept_index[o] = node;
    out.emitted_tokens[o] = token;
    out.emitted_logprobs[o] = logprob;
  }
  if (threadIdx.x == 0) {
    out.num_accepted[b] = ok ? num_accepted : 0;
    out.row_status[b] = status;
  }
}

// ---------------------------------------------------------------------------------------
// verify_tree_greedy: one block per row.

// The argmax of a node's logits (lowest id on ties) and the temperature-1 normaliser.
struct GreedyNode {
  int argmax;
  float max_l;
  float log_norm;  // logf(sum expf(l - max l))
};

// Returns false for kRowBadLogits: a NaN or +inf logit, or all -inf.
template <typename LogitT>
__device__ bool prepare_greedy_node(GreedyNode& d, const LogitT* logits, int vocab,
                                    BlockScratch& s) {
  ArgMax best{-INFINITY, kNone};
  bool bad = false;
  for (int x = threadIdx.x; x < vocab; x += kThreads) {
    const float l = to_float(logits[x]);
    bad |= isnan(l) || l == INFINITY;
    if (l > best.value) best = ArgMax{l, x};
  }
  if (__syncthreads_or(bad)) return false;
  best = block_argmax(best, s);
  if (best.value == -INFINITY) return false;
  d.argmax = best.index;
  d.max_l = best.value;
  double total = 0.0;
  for (int x = threadIdx.x; x < vocab; x += kThreads) {
    total += expf(to_float(logits[x]) - d.max_l);
  }
  d.log_norm = logf(static_cast<float>(block_sum(total, s)));
  return true;
}

struct GreedyShared {
  RowTree tree;
  BlockScratch scratch;
};

template <typename LogitT>
__global__ __launch_bounds__(kThreads) void verify_greedy_kernel(
    const LogitT* logits,      // (B, N, V)
    const int64_t* tokens,     // (B, N)
    const int32_t* parents,    // (B, N)
    const int32_t* num_nodes,  // (B) or nullptr
    int num_nodes_max, int vocab, RowOutputs out) {
  __shared__ GreedyShared sh;
  const int N = num_nodes_max;
  const int64_t b = blockIdx.x;
  const int n = num_nodes != nullptr ? num_nodes[b] : N;
  int status = load_tree(tokens + b * N, parents + b * N, n, N, vocab, sh.tree, sh.scratch);
  int num_accepted = 0, final_token = -1;
  if (status == kRowOk) {
    if (threadIdx.x == 0) sh.tree.path[0] = 0;
    for (int v = 0;;) {
      const LogitT* node_logits = logits + (b * N + v) * vocab;
      GreedyNode d;
      if (!prepare_greedy_node(d, node_logits, vocab, sh.scratch)) {
        status = kRowBadLogits;
        break;
      }
      const int child = next_child(sh.tree, sh.scratch, v, v, n, d.argmax);
      if (threadIdx.x == 0) {
        sh.tree.logprob[num_accepted] = to_float(node_logits[d.argmax]) - d.max_l - d.log_norm;
      }
      if (child >= n) {
        final_token = d.argmax;
        break;
      }
      ++num_accepted;
      if (threadIdx.x == 0) sh.tree.path[num_accepted] = child;
      v = child;
    }
  }
  __syncthreads();
  write_outputs(out, b, N, status, num_accepted, final_token, sh.tree);
}

// ---------------------------------------------------------------------------------------
// verify_tree_sampling: the row group and its exchanges.

constexpr int kMaxSplit = 8;  // blocks per row: the portable thread block cluster size
constexpr int kChunk = 8;     // consecutive tokens a thread handles together
constexpr int kRadixBits = 8;
constexpr int kBins = 1 << kRadixBits;
constexpr uint32_t kNoDigit = 0xFFFFFFFFu;
static_assert(kThreads >= kBins, "radix_resolve gives each digit its own thread");

// The blocks that share one row: `size` blocks of one cluster, or one block.
struct RowGroup {
  int rank;
  int size;

  __device__ void sync() const {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (size > 1) {
      cooperative_groups::this_cluster().sync();
      return;
    }
#endif
    __syncthreads();
  }

  // The copy of `local` (an object in this block's shared memory) in block `block`.
  template <typename T>
  __device__ const T* remote(T* local, int block) const {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (size > 1) return cooperative_groups::this_cluster().map_shared_rank(local, block);
#endif
    return local;
  }
};

// The host launches split > 1 only as clusters of `split` blocks of sm_90 code.
__device__ RowGroup row_group(int split) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (split > 1) {
    return RowGroup{static_cast<int>(cooperative_groups::this_cluster().block_rank()), split};
  }
#endif
  return RowGroup{0, 1};
}

// One block's partials of one exchange.
struct Exchange {
  unsigned long long bins[kBins];  // radix histogram (token counts, or masses in the bin's unit)
  uint32_t key_min[kBins];         // smallest and largest key counted in each bin
  uint32_t key_max[kBins];
  ExactSum sum;
  float max_value;
  int32_t argmax;
  int32_t flag;
  int32_t index;
};

// Exchanges go through two slots per block, used alternately: exchange k writes slot k % 2
// after its block has passed exchange k - 1's barrier, which every block reaches only after
// reading exchange k - 2's slots, so no slot is rewritten while another block may read it.
struct RowExchange {
  Exchange* slots;  // (2) in this block's shared memory
  RowGroup group;
  int parity;

  __device__ Exchange& mine() const { return slots[parity]; }
  // Every block's slot of this exchange is written and may now be read by every block.
  __device__ void publish() const { group.sync(); }
  __device__ const Exchange& of(int block) const { return *group.remote(&slots[parity], block); }
  __device__ void close() { parity ^= 1; }

  __device__ ExactSum total() const {
    ExactSum total{{0, 0, 0}};
    for (int r = 0; r < group.size; ++r) exact_add(total, of(r).sum);
    return total;
  }
  __device__ bool any_flag() const {
    bool any = false;
    for (int r = 0; r < group.size; ++r) any |= of(r).flag != 0;
    return any;
  }
};

// The tokens one block owns, [lo, hi), in chunks of kChunk: chunk c belongs to thread
// c % kThreads, which handles it in round c / kThreads.
struct Slice {
  int lo;
  int hi;
  int rounds;
};

// Tokens per block: V / split rounded up to whole chunks.
__host__ __device__ __forceinline__ int slice_tokens(int vocab, int split) {
  return ((vocab + split - 1) / split + kChunk - 1) / kChunk * kChunk;
}

__device__ Slice slice_of(const RowGroup& g, int vocab) {
  const int per_block = slice_tokens(vocab, g.size);
  const int lo = min(g.rank * per_block, vocab);
  const int hi = min(lo + per_block, vocab);
  const int chunks = (hi - lo + kChunk - 1) / kChunk;
  return Slice{lo, hi, (chunks + kThreads - 1) / kThreads};
}

// First token of this thread's chunk in `round`; chunk_size: its tokens below hi (0: none).
__device__ __forceinline__ int chunk_start(const Slice& s, int round) {
  return s.lo + (round * kThreads + static_cast<int>(threadIdx.x)) * kChunk;
}
__device__ __forceinline__ int chunk_size(const Slice& s, int x0) {
  return x0 < s.hi ? min(kChunk, s.hi - x0) : 0;
}
__device__ __forceinline__ bool owns(const Slice& s, int x) {
  return x >= s.lo && x < s.hi &&
         ((x - s.lo) / kChunk) % kThreads == static_cast<int>(threadIdx.x);
}

// A chunk of logits as float; entries at or past `size` are 0. `vector`: the node's row is
// 16-byte aligned (chunks start at multiples of 8 tokens), so whole chunks load in 16 bytes.
__device__ __forceinline__ void load_chunk(const float* p, bool vector, int size,
                                           float (&v)[kChunk]) {
  if (vector && size == kChunk) {
    const float4 a = __ldg(reinterpret_cast<const float4*>(p));
    const float4 b = __ldg(reinterpret_cast<const float4*>(p) + 1);
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
    return;
  }
#pragma unroll
  for (int i = 0; i < kChunk; ++i) v[i] = i < size ? __ldg(p + i) : 0.0f;
}

__device__ __forceinline__ float2 to_float2(__nv_bfloat162 v) { return __bfloat1622float2(v); }
__device__ __forceinline__ float2 to_float2(__half2 v) { return __half22float2(v); }

// bf16 / fp16: a 16-byte load holds the chunk's 8 values as 4 pairs.
template <typename Half, typename Pair>
__device__ __forceinline__ void load_half_chunk(const Half* p, bool vector, int size,
                                                float (&v)[kChunk]) {
  if (vector && size == kChunk) {
    const uint4 raw = __ldg(reinterpret_cast<const uint4*>(p));
    const Pair* pairs = reinterpret_cast<const Pair*>(&raw);
#pragma unroll
    for (int j = 0; j < kChunk / 2; ++j) {
      const float2 f = to_float2(pairs[j]);
      v[2 * j] = f.x;
      v[2 * j + 1] = f.y;
    }
    return;
  }
#pragma unroll
  for (int i = 0; i < kChunk; ++i) v[i] = i < size ? to_float(p[i]) : 0.0f;
}

__device__ __forceinline__ void load_chunk(const __nv_bfloat16* p, bool vector, int size,
                                           float (&v)[kChunk]) {
  load_half_chunk<__nv_bfloat16, __nv_bfloat162>(p, vector, size, v);
}

__device__ __forceinline__ void load_chunk(const __half* p, bool vector, int size,
                                           float (&v)[kChunk]) {
  load_half_chunk<__half, __half2>(p, vector, size, v);
}

// The slice's cache (shared memory, or the workspace row) is written by this kernel: plain
// (coherent) loads, never __ldg. Chunks start at multiples of 8 floats from the slice's start,
// which is 16-byte aligned in both, and the workspace row's stride is whole chunks
// (verify_workspace.h), so both halves of a chunk are aligned and inside the row.
__device__ __forceinline__ void load_cached(const float* p, float (&v)[kChunk]) {
  const float4 a = reinterpret_cast<const float4*>(p)[0];
  const float4 b = reinterpret_cast<const float4*>(p)[1];
  v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
}

__device__ __forceinline__ void store_cached(float* p, const float (&v)[kChunk]) {
  reinterpret_cast<float4*>(p)[0] = make_float4(v[0], v[1], v[2], v[3]);
  reinterpret_cast<float4*>(p)[1] = make_float4(v[4], v[5], v[6], v[7]);
}

// ---------------------------------------------------------------------------------------
// Threshold search (top-k and top-p): the smallest 32-bit key t such that the total weight of
// the tokens with key > t is < limit (limit > 0, weights >= 0). Radix search from the most
// significant digit, 8 bits per pass: the answer is known to lie in [low, low + 2^(shift + 8));
// a pass builds the histogram of the weights of the keys in that range by their next digit, and
// the answer's digit is the lowest sub-range whose upper end has less than `limit` above it.
// Weights are token counts (top-k: keys order_key(z)) or exp values (top-p: keys are the float
// bits of e >= 0, so order follows value); both are summed exactly, so the search is exact.

__device__ void clear_histogram(Exchange& mine) {
  for (int i = threadIdx.x; i < kBins; i += kThreads) {
    mine.bins[i] = 0;
    mine.key_min[i] = UINT32_MAX;
    mine.key_max[i] = 0;
  }
  __syncthreads();
}

// Adds `weight` to bins[digit] (and key to its key range) for the lanes with `candidate`; all 32
// lanes call it together. Lanes with equal digits are combined first, one shared-memory atomic
// per digit per warp: the first top-p digit of exp values piles into a few bins, where per-lane
// atomics serialise. Integer atomics are exact, so their order does not matter.
__device__ __forceinline__ void histogram_add(Exchange& mine, bool candidate, uint32_t digit,
                                              uint32_t weight, uint32_t key) {
  if (__ballot_sync(kFullMask, candidate) == 0) return;
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
  const unsigned peers = __match_any_sync(kFullMask, candidate ? digit : kNoDigit);
  if (!candidate) return;
  const uint32_t total = __reduce_add_sync(peers, weight);
  const uint32_t low = __reduce_min_sync(peers, key);
  const uint32_t high = __reduce_max_sync(peers, key);
  if (lane_id() == __ffs(peers) - 1) {
    atomicAdd(&mine.bins[digit], static_cast<unsigned long long>(total));
    atomicMin(&mine.key_min[digit], low);
    atomicMax(&mine.key_max[digit], high);
  }
#else
  if (candidate) {
    atomicAdd(&mine.bins[digit], static_cast<unsigned long long>(weight));
    atomicMin(&mine.key_min[digit], key);
    atomicMax(&mine.key_max[digit], key);
  }
#endif
}

// A histogram bin's keys share their top 8 bits, i.e. (e >= 0) the top 7 exponent bits, so its
// values lie in two binades: integers below 2^25 in units of 2^bin_shift(top) * 2^-149. Lane
// sums (32 values) fit 32 bits and bins (<= 2^24 tokens) 64 bits, exactly.
__device__ __forceinline__ int bin_shift(uint32_t top) {
  return top == 0 ? 0 : 2 * static_cast<int>(top) - 1;
}
__device__ __forceinline__ uint32_t bin_weight(uint32_t bits) {
  uint32_t significand;
  int shift;
  float_significand(bits, significand, shift);
  return significand << (shift - bin_shift(bits >> 24));
}

struct ExactAdd {
  __device__ ExactSum operator()(const ExactSum& a, const ExactSum& b) const {
    return exact_sum_of(a, b);
  }
};

using ExactScan = cub::BlockScan<ExactSum, kThreads, cub::BLOCK_SCAN_WARP_SCANS>;

struct RadixSearch {
  bool weighted;   // exp masses (top-p) or token counts (top-k)
  ExactSum limit;  // > 0
  uint32_t low;    // the answer lies in [low, low + 2^(shift + 8)) before the pass at shift
  ExactSum above;  // weight of the keys above that range; < limit
  bool done;       // the answer is low: the chosen sub-range held a single key
  ExactSum at_low; // once done: weight of the keys equal to low
};

__device__ __forceinline__ ExactSum exact_zero() { return ExactSum{{0, 0, 0}}; }

__device__ RadixSearch radix_search(bool weighted, ExactSum limit) {
  return RadixSearch{weighted, limit, 0u, exact_zero(), false, exact_zero()};
}

// Whether key is in the range of the pass at shift, and its digit there.
__device__ __forceinline__ bool in_radix_range(const RadixSearch& rs, int shift, uint32_t key) {
  return (static_cast<uint64_t>(key) >> (shift + kRadixBits)) ==
         (static_cast<uint64_t>(rs.low) >> (shift + kRadixBits));
}
__device__ __forceinline__ uint32_t radix_digit(int shift, uint32_t key) {
  return (key >> shift) & (kBins - 1);
}

// Adds one key to this block's histogram of the pass at shift (all 32 lanes call it together).
__device__ __forceinline__ void radix_count(const RadixSearch& rs, int shift, bool present,
                                            uint32_t key, Exchange& mine) {
  bool candidate = present && in_radix_range(rs, shift, key);
  uint32_t weight = 1;
  if (rs.weighted) {
    candidate = candidate && key != 0;  // e == 0 weighs nothing
    weight = candidate ? bin_weight(key) : 0;
  }
  histogram_add(mine, candidate, radix_digit(shift, key), weight, key);
}

// Shared memory of a sampling block.
struct SamplingShared {
  RowTree tree;
  BlockScratch scratch;
  union {
    int32_t rejected[kMaxTreeNodes];   // deterministic drafts: zeroed tokens at this node, sorted
    float residual_mass[kMaxTreeNodes];  // sampled drafts: S of each residual taken at this node
  };
  Exchange slots[2];
  ExactSum radix_above;
  ExactSum radix_bin;
  uint32_t radix_single;  // the chosen sub-range's key if it held only one, else 0
  typename ExactScan::TempStorage scan;
};

// Picks the digit of the pass at shift from every block's histogram (the open exchange).
__device__ void radix_resolve(RadixSearch& rs, int shift, const RowExchange& ex,
                              SamplingShared& sh) {
  const int t = threadIdx.x;
  const int digit = kBins - 1 - t;  // thread t < kBins: digits from the top down
  ExactSum mass = exact_zero();
  uint32_t key_min = UINT32_MAX, key_max = 0;
  if (t < kBins) {
    unsigned long long count = 0;
    for (int r = 0; r < ex.group.size; ++r) {
      const Exchange& other = ex.of(r);
      count += other.bins[digit];
      key_min = min(key_min, other.key_min[digit]);
      key_max = max(key_max, other.key_max[digit]);
    }
    const uint32_t top = (rs.low + (static_cast<uint32_t>(digit) << shift)) >> 24;
    mass = exact_shifted(count, rs.weighted ? bin_shift(top) : 0);
  }
  ExactSum above;  // weight of the keys above sub-range `digit`
  ExactScan(sh.scan).ExclusiveScan(mass, above, exact_zero(), ExactAdd{});
  exact_add(above, rs.above);
  // Too much above sub-range d holds for d = 0 .. chosen - 1, and not for chosen: the answer.
  const int chosen = __syncthreads_count(t < kBins && !exact_less(above, rs.limit));
  if (t < kBins && digit == chosen) {
    sh.radix_above = above;
    sh.radix_bin = mass;
    sh.radix_single = key_min == key_max ? key_min : 0;
  }
  __syncthreads();
  rs.low += static_cast<uint32_t>(chosen) << shift;
  rs.above = sh.radix_above;
  // One key in the chosen sub-range, k: every key above k is above the sub-range (weight < limit),
  // and the sub-range's weight brings it to >= limit, so the answer is k, whatever bits remain.
  // (0 stands for "not one key": top-p does not count e = 0, and order_key(z) is never 0.)
  if (sh.radix_single != 0) {
    rs.low = sh.radix_single;
    rs.done = true;
    rs.at_low = sh.radix_bin;
  }
}

// One radix pass over the cached values (z for top-k, e for top-p), as one exchange.
__device__ void radix_pass(RadixSearch& rs, int shift, const Slice& slice, const float* cache,
                           RowExchange& ex, SamplingShared& sh) {
  Exchange& mine = ex.mine();
  clear_histogram(mine);
  for (int round = 0; round < slice.rounds; ++round) {
    const int x0 = chunk_start(slice, round);
    const int size = chunk_size(slice, x0);
    float v[kChunk] = {};
    if (size > 0) load_cached(cache + (x0 - slice.lo), v);
#pragma unroll
    for (int i = 0; i < kChunk; ++i) {
      const uint32_t key = rs.weighted ? __float_as_uint(v[i]) : order_key(v[i]);
      radix_count(rs, shift, i < size, key, mine);
    }
  }
  ex.publish();
  radix_resolve(rs, shift, ex, sh);
  ex.close();
}

// ---------------------------------------------------------------------------------------
// The target distribution at one visited node.

// w(x) from e(x): top-p keeps the tokens with bits(e) >= topp_bits (0 keeps all).
__device__ __forceinline__ float top_p_weight(float e, uint32_t topp_bits) {
  return __float_as_uint(e) >= topp_bits ? e : 0.0f;
}

// The fresh w and S_v of verify.h at one node; the workspace row caches the slice's values
// (e for T > 0, before top-p: w(x) = e(x) if bits(e) >= topp_bits; one_hot(argmax) for T == 0).
template <typename LogitT>
struct NodeWeights {
  const LogitT* logits;  // (V) the node's logits
  float temperature;
  bool greedy;           // temperature not > 0: w = one_hot(argmax), S = 1
  int argmax;            // argmax of z, lowest id on ties
  float max_z;           // m (greedy: max l)
  uint32_t topk_key;     // top-k keeps order_key(z) >= topk_key; 0 keeps all
  uint32_t topp_bits;    // top-p keeps bits(e) >= topp_bits; 0 keeps all
  float log_norm;        // greedy: logf(sum expf(l - max l)), for the temperature-1 logprob
  float mass;            // S_v, the fresh sum of w

  __device__ float z(int x) const {
    const float l = to_float(logits[x]);
    return greedy ? l : l / temperature;
  }
  // e(x) = expf(z - m) for tokens top-k keeps, else 0.
  __device__ float e_of(float zx) const {
    return order_key(zx) >= topk_key ? expf(zx - max_z) : 0.0f;
  }
  // w(x) recomputed from the logits with the expressions of the passes that fill the cache, so
  // every block gets the value the owning block caches.
  __device__ float fresh(int x) const {
    if (greedy) return x == argmax ? 1.0f : 0.0f;
    return top_p_weight(e_of(z(x)), topp_bits);
  }
  // T > 0: z(x) - m - logf(S_v); greedy: log_softmax(l)(x) at temperature 1.
  __device__ float logprob(int x) const {
    const float centered = z(x) - max_z;
    return greedy ? centered - log_norm : centered - logf(mass);
  }
};

// Fills d and the workspace for the node whose logits are `logits` (V). Returns false for
// kRowBadLogits: a z that is NaN or +inf, or all z = -inf (z = l / T, so this includes l / T
// overflowing).
template <typename LogitT>
__device__ bool prepare_node(NodeWeights<LogitT>& d, const LogitT* logits, float* cache,
                             const Slice& slice, int vocab, float temperature, int top_k,
                             float top_p, RowExchange& ex, SamplingShared& sh) {
  d.logits = logits;
  d.temperature = temperature;
  d.greedy = !(temperature > 0.0f);
  d.topk_key = 0;
  d.topp_bits = 0;
  d.log_norm = 0.0f;
  const bool use_top_k = !d.greedy && top_k > 0 && top_k < vocab;
  const bool use_top_p = !d.greedy && top_p < 1.0f;
  const bool vector = reinterpret_cast<uintptr_t>(logits) % 16 == 0;

  // Pass 1: z into the cache; max / argmax and validity; top-k's first digit.
  RadixSearch top_k_search = radix_search(false, exact_shifted(top_k > 0 ? top_k : 0, 0));
  {
    Exchange& mine = ex.mine();
    if (use_top_k) clear_histogram(mine);
    ArgMax best{-INFINITY, kNone};
    bool bad = false;
    for (int round = 0; round < slice.rounds; ++round) {
      const int x0 = chunk_start(slice, round);
      const int size = chunk_size(slice, x0);
      float v[kChunk] = {};
      if (size > 0) load_chunk(logits + x0, vector, size, v);
#pragma unroll
      for (int i = 0; i < kChunk; ++i) {
        const float zx = d.greedy ? v[i] : v[i] / temperature;
        v[i] = zx;
        if (i < size) {
          bad |= isnan(zx) || zx == INFINITY;
          if (zx > best.value) best = ArgMax{zx, x0 + i};
        }
        if (use_top_k) radix_count(top_k_search, 24, i < size, order_key(zx), mine);
      }
      if (size > 0) store_cached(cache + (x0 - slice.lo), v);
    }
    bad = __syncthreads_or(bad);
    best = block_argmax(best, sh.scratch);
    if (threadIdx.x == 0) {
      mine.flag = bad;
      mine.max_value = best.value;
      mine.argmax = best.index;
    }
    ex.publish();
    bad = ex.any_flag();
    best = ArgMax{-INFINITY, kNone};
    for (int r = 0; r < ex.group.size; ++r) {
      best = better_of(best, ArgMax{ex.of(r).max_value, ex.of(r).argmax});
    }
    bad |= best.value == -INFINITY;
    if (!bad && use_top_k) radix_resolve(top_k_search, 24, ex, sh);
    ex.close();
    if (bad) return false;
    d.argmax = best.index;
    d.max_z = best.value;
  }
  if (use_top_k) {
    for (int shift = 16; shift >= 0 && !top_k_search.done; shift -= kRadixBits) {
      radix_pass(top_k_search, shift, slice, cache, ex, sh);
    }
    d.topk_key = top_k_search.low;
  }

  // Pass 2: e into the cache (greedy: one_hot(argmax)) and its exact sum; top-p's first digit.
  ExactSum row_total;
  RadixSearch top_p_search = radix_search(true, exact_zero());
  float limit = 0.0f;
  {
    Exchange& mine = ex.mine();
    if (use_top_p) clear_histogram(mine);
    ExactSum total = exact_zero();
    for (int round = 0; round < slice.rounds; ++round) {
      const int x0 = chunk_start(slice, round);
      const int size = chunk_size(slice, x0);
      float v[kChunk] = {};
      if (size > 0) load_cached(cache + (x0 - slice.lo), v);
#pragma unroll
      for (int i = 0; i < kChunk; ++i) {
        float weight;
        if (d.greedy) {
          if (i < size) exact_add(total, exact_of(expf(v[i] - d.max_z)));
          weight = x0 + i == d.argmax ? 1.0f : 0.0f;
        } else {
          weight = d.e_of(v[i]);
          if (i < size) exact_add(total, exact_of(weight));
        }
        if (use_top_p) radix_count(top_p_search, 24, i < size, __float_as_uint(weight), mine);
        v[i] = weight;
      }
      if (size > 0) store_cached(cache + (x0 - slice.lo), v);
    }
    total = block_exact_sum(total, sh.scratch);
    if (threadIdx.x == 0) mine.sum = total;
    ex.publish();
    row_total = ex.total();
    if (use_top_p) {
      // Z = sum e; top-p's limit top_p * Z as one float multiplication, as on the CPU.
      limit = top_p * static_cast<float>(exact_to_double(row_total));
      top_p_search.limit = exact_of(fmaxf(limit, 0.0f));
      if (limit > 0.0f) radix_resolve(top_p_search, 24, ex, sh);
    }
    ex.close();
  }
  if (d.greedy) {
    d.log_norm = logf(static_cast<float>(exact_to_double(row_total)));
    d.mass = 1.0f;
    return true;
  }
  d.mass = static_cast<float>(exact_to_double(row_total));
  if (!use_top_p) return true;
  if (!(limit > 0.0f)) {
    // limit <= 0 (top_p <= 0): no token has less than `limit` above it, so none is kept.
    d.topp_bits = UINT32_MAX;
    d.mass = 0.0f;
    return true;
  }
  for (int shift = 16; shift >= 0 && !top_p_search.done; shift -= kRadixBits) {
    radix_pass(top_p_search, shift, slice, cache, ex, sh);
  }
  d.topp_bits = top_p_search.low;
  // S = sum of e >= topp_bits: the weight above the threshold plus the weight at it.
  d.mass = static_cast<float>(
      exact_to_double(exact_sum_of(top_p_search.above, top_p_search.at_low)));
  return true;
}

// ---------------------------------------------------------------------------------------
// The walk's steps at a node.

__device__ __forceinline__ float residual_of(float w, float q, float mass) {
  const float r = w - __fmul_rn(q, mass);
  return r > 0.0f ? r : 0.0f;
}

// How the cache holds the current w: the node's e, thresholded by top-p and zeroed at rejected
// tokens, until a residual replaces it with the residual's values.
struct CacheView {
  uint32_t topp_bits;
  bool residual;
  __device__ float operator()(float cached) const {
    return residual ? cached : top_p_weight(cached, topp_bits);
  }
};

__device__ bool sorted_contains(const int32_t* values, int count, int x) {
  int lo = 0, hi = count;
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (values[mid] < x) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return lo < count && values[lo] == x;
}

// Adds x to the sorted rejected list of `count` entries (x is not in it).
__device__ void reject_token(SamplingShared& sh, int count, int x) {
  __syncthreads();  // everyone is done reading the list
  if (threadIdx.x == 0) {
    int i = count;
    for (; i > 0 && sh.rejected[i - 1] > x; --i) sh.rejected[i] = sh.rejected[i - 1];
    sh.rejected[i] = x;
  }
  __syncthreads();
}

// The current w(x) of one token, the same in every block: the fresh weight, zero if rejected
// (deterministic drafts), through each residual taken so far (sampled drafts, q = q row).
template <typename LogitT>
__device__ float current_weight(const NodeWeights<LogitT>& d, int x, const float* q,
                                const SamplingShared& sh, int num_rejected, int num_residuals) {
  if (num_rejected > 0 && sorted_contains(sh.rejected, num_rejected, x)) return 0.0f;
  float w = d.fresh(x);
  for (int k = 0; k < num_residuals; ++k) w = residual_of(w, q[x], sh.residual_mass[k]);
  return w;
}

// Sum over V of max(0, w(y) - q(y) * S); with store, the values also replace the cache (each
// thread rewrites its own chunks, so no barrier is needed before later passes read them).
__device__ ExactSum residual_pass(const CacheView& view, const float* q, bool q_vector,
                                  float mass, float* cache, const Slice& slice, bool store,
                                  RowExchange& ex, SamplingShared& sh) {
  ExactSum total = exact_zero();
  for (int round = 0; round < slice.rounds; ++round) {
    const int x0 = chunk_start(slice, round);
    const int size = chunk_size(slice, x0);
    if (size == 0) break;
    float w[kChunk], qv[kChunk];
    load_cached(cache + (x0 - slice.lo), w);
    load_chunk(q + x0, q_vector, size, qv);
#pragma unroll
    for (int i = 0; i < kChunk; ++i) {
      w[i] = residual_of(view(w[i]), qv[i], mass);
      if (i < size) exact_add(total, exact_of(w[i]));
    }
    if (store) store_cached(cache + (x0 - slice.lo), w);
  }
  if (store) return exact_zero();
  total = block_exact_sum(total, sh.scratch);
  Exchange& mine = ex.mine();
  if (threadIdx.x == 0) mine.sum = total;
  ex.publish();
  total = ex.total();
  ex.close();
  return total;
}

// A q row (V) is valid: every entry finite and >= 0, and the sum within 1e-3 of 1. An entry
// above 2 makes the sum exceed 1 + 1e-3 (the CPU kernel's verdict too); ruling it out here keeps
// every summed entry within exact_sum.h's range.
__device__ bool draft_row_valid(const float* q, bool q_vector, const Slice& slice,
                                RowExchange& ex, SamplingShared& sh) {
  bool bad = false;
  ExactSum total = exact_zero();
  for (int round = 0; round < slice.rounds; ++round) {
    const int x0 = chunk_start(slice, round);
    const int size = chunk_size(slice, x0);
    if (size == 0) break;
    float qv[kChunk];
    load_chunk(q + x0, q_vector, size, qv);
#pragma unroll
    for (int i = 0; i < kChunk; ++i) {
      const bool entry_bad = !(qv[i] >= 0.0f) || qv[i] > 2.0f;  // also NaN and +inf
      bad |= i < size && entry_bad;
      if (i < size && !entry_bad) exact_add(total, exact_of(qv[i]));
    }
  }
  bad = __syncthreads_or(bad);
  total = block_exact_sum(total, sh.scratch);
  Exchange& mine = ex.mine();
  if (threadIdx.x == 0) {
    mine.flag = bad;
    mine.sum = total;
  }
  ex.publish();
  const bool valid = !ex.any_flag() && fabs(exact_to_double(ex.total()) - 1.0) <= 1e-3;
  ex.close();
  return valid;
}

// The holder of the inverse CDF's crossing scans its slice: the first x with w(x) > 0 whose
// running sum (carry = the exact sum before the slice) exceeds target. Chunk totals, a block
// scan of them per round, and a carry between rounds; stops at the first round with a hit.
__device__ int scan_slice(const CacheView& view, const float* cache, const Slice& slice,
                          const ExactSum& target, ExactSum carry, SamplingShared& sh) {
  for (int round = 0; round < slice.rounds; ++round) {
    const int x0 = chunk_start(slice, round);
    const int size = chunk_size(slice, x0);
    float w[kChunk] = {};
    if (size > 0) load_cached(cache + (x0 - slice.lo), w);
    ExactSum chunk_total = exact_zero();
#pragma unroll
    for (int i = 0; i < kChunk; ++i) {
      w[i] = i < size ? view(w[i]) : 0.0f;
      if (w[i] > 0.0f) exact_add(chunk_total, exact_of(w[i]));
    }
    ExactSum running, round_total;
    ExactScan(sh.scan).ExclusiveScan(chunk_total, running, exact_zero(), ExactAdd{}, round_total);
    exact_add(running, carry);
    int hit = kNone;
#pragma unroll
    for (int i = 0; i < kChunk; ++i) {
      if (w[i] > 0.0f) {
        exact_add(running, exact_of(w[i]));
        if (hit == kNone && exact_less(target, running)) hit = x0 + i;
      }
    }
    hit = block_min(hit, sh.scratch);  // its barriers also free the scan storage
    if (hit != kNone) return hit;
    exact_add(carry, round_total);
  }
  return kNone;
}

// Inverse CDF over the row: the smallest x with w(x) > 0 whose running sum of w exceeds target;
// else the largest x with w(x) > 0; else fallback. With exact sums the block whose slice holds
// the crossing is known from the slice totals alone, and its scan finds it.
__device__ int sample_inverse_cdf(const CacheView& view, const float* cache, const Slice& slice,
                                  float target, int fallback, RowExchange& ex,
                                  SamplingShared& sh) {
  ExactSum total = exact_zero();
  int last = -1;
  for (int round = 0; round < slice.rounds; ++round) {
    const int x0 = chunk_start(slice, round);
    const int size = chunk_size(slice, x0);
    if (size == 0) break;
    float w[kChunk];
    load_cached(cache + (x0 - slice.lo), w);
#pragma unroll
    for (int i = 0; i < kChunk; ++i) {
      const float wi = view(w[i]);
      if (i < size && wi > 0.0f) {
        exact_add(total, exact_of(wi));
        last = x0 + i;
      }
    }
  }
  total = block_exact_sum(total, sh.scratch);
  int unused = kNone;
  block_min_max(unused, last, sh.scratch);
  {
    Exchange& mine = ex.mine();
    if (threadIdx.x == 0) {
      mine.sum = total;
      mine.index = last;
    }
  }
  ex.publish();
  const ExactSum exact_target = exact_of(target);
  ExactSum carry = exact_zero(), my_carry = exact_zero();
  int holder = -1, last_positive = -1;
  for (int r = 0; r < ex.group.size; ++r) {
    const Exchange& other = ex.of(r);
    last_positive = max(last_positive, other.index);
    if (r == ex.group.rank) my_carry = carry;
    exact_add(carry, other.sum);
    if (holder < 0 && exact_less(exact_target, carry)) holder = r;
  }
  ex.close();
  if (holder < 0) return last_positive >= 0 ? last_positive : fallback;

  const int hit = ex.group.rank == holder
                      ? scan_slice(view, cache, slice, exact_target, my_carry, sh)
                      : kNone;
  {
    Exchange& mine = ex.mine();
    if (threadIdx.x == 0) mine.index = hit;
  }
  ex.publish();
  int found = kNone;
  for (int r = 0; r < ex.group.size; ++r) found = min(found, ex.of(r).index);
  ex.close();
  // Exact sums make the holder's scan find the crossing; the fallback only keeps a broken
  // invariant from becoming an out-of-bounds token.
  return found != kNone ? found : fallback;
}

// ---------------------------------------------------------------------------------------
// The sampling kernel: a row group of `split` blocks per row (see the top of the file).

template <typename LogitT>
__global__ __launch_bounds__(kThreads) void verify_sampling_kernel(
    const LogitT* logits,       // (B, N, V)
    const float* draft_probs,   // (B, N, V) or nullptr (deterministic drafts)
    const int64_t* tokens,      // (B, N)
    const int32_t* parents,     // (B, N)
    const int32_t* num_nodes,   // (B) or nullptr
    const float* temperature,   // (B)
    const int32_t* top_k,       // (B)
    const float* top_p,         // (B)
    const float* uniforms,      // (B, N)
    int num_nodes_max, int vocab, int split, RowOutputs out,
    float* workspace,           // (B, stride) the visited node's cached weights per row
    int64_t workspace_stride,
    bool cache_in_shared) {     // the slice's cache is the dynamic shared memory
  __shared__ SamplingShared sh;
  extern __shared__ float4 shared_cache[];  // (slice_tokens / 4) when cache_in_shared
  const RowGroup group = row_group(split);
  RowExchange ex{sh.slots, group, 0};
  const Slice slice = slice_of(group, vocab);
  const int N = num_nodes_max;
  const int64_t b = blockIdx.x / split;
  // The node's cached values of this block's slice, from token slice.lo on.
  float* cache = cache_in_shared ? reinterpret_cast<float*>(shared_cache)
                                 : workspace + b * workspace_stride + slice.lo;
  const int n = num_nodes != nullptr ? num_nodes[b] : N;
  int status = load_tree(tokens + b * N, parents + b * N, n, N, vocab, sh.tree, sh.scratch);
  int num_accepted = 0, final_token = -1;
  if (status == kRowOk) {
    const float row_temperature = temperature[b];
    const int row_top_k = top_k[b];
    const float row_top_p = top_p[b];
    const float* u = uniforms + b * N;  // (N)
    if (threadIdx.x == 0) sh.tree.path[0] = 0;
    for (int v = 0;;) {
      const int64_t node_offset = (b * N + v) * vocab;
      NodeWeights<LogitT> d;
      if (!prepare_node(d, logits + node_offset, cache, slice, vocab, row_temperature,
                        row_top_k, row_top_p, ex, sh)) {
        status = kRowBadLogits;
        break;
      }
      const float* q = draft_probs != nullptr ? draft_probs + node_offset : nullptr;  // (V)
      const bool q_vector = reinterpret_cast<uintptr_t>(q) % 16 == 0;
      CacheView view{d.topp_bits, false};
      float mass = d.mass;  // S
      int num_rejected = 0, num_residuals = 0;
      int child = next_child(sh.tree, sh.scratch, v, v, n, -1);
      if (q != nullptr && child < n && !draft_row_valid(q, q_vector, slice, ex, sh)) {
        status = kRowBadDraftProbs;
        break;
      }
      bool accepted = false;
      for (; child < n; child = next_child(sh.tree, sh.scratch, v, child, n, -1)) {
        const float uc = u[child];
        if (!(uc >= 0.0f && uc < 1.0f)) {
          status = kRowBadUniform;
          break;
        }
        const int x = sh.tree.tok[child];
        const float wx = current_weight(d, x, q, sh, num_rejected, num_residuals);
        if (q != nullptr ? uc * q[x] * mass < wx : uc * mass < wx) {
          accepted = true;
          break;
        }
        if (q != nullptr) {
          const ExactSum residual_mass =
              residual_pass(view, q, q_vector, mass, cache, slice, false, ex, sh);
          if (!exact_is_zero(residual_mass)) {  // else w (and S) stay as they were
            residual_pass(view, q, q_vector, mass, cache, slice, true, ex, sh);
            view.residual = true;
            if (threadIdx.x == 0) sh.residual_mass[num_residuals] = mass;
            __syncthreads();
            ++num_residuals;
            mass = static_cast<float>(exact_to_double(residual_mass));
          }
        } else if (wx > 0.0f) {  // rejecting a zero-weight token changes nothing
          mass -= wx;
          reject_token(sh, num_rejected, x);
          ++num_rejected;
          if (owns(slice, x)) cache[x - slice.lo] = 0.0f;
        }
      }
      if (status != kRowOk) break;
      if (accepted) {
        if (threadIdx.x == 0) {
          sh.tree.logprob[num_accepted] = d.logprob(sh.tree.tok[child]);
          sh.tree.path[num_accepted + 1] = child;
        }
        ++num_accepted;
        v = child;
        continue;
      }
      const float u0 = u[0];
      if (!(u0 >= 0.0f && u0 < 1.0f)) {
        status = kRowBadUniform;
        break;
      }
      final_token = sample_inverse_cdf(view, cache, slice, u0 * mass, d.argmax, ex, sh);
      if (threadIdx.x == 0) sh.tree.logprob[num_accepted] = d.logprob(final_token);
      break;
    }
  }
  __syncthreads();
  if (group.rank == 0) write_outputs(out, b, N, status, num_accepted, final_token, sh.tree);
  group.sync();  // no block leaves while another may still read its shared memory
}

// ---------------------------------------------------------------------------------------
// Host side.

size_t logit_bytes(FloatType type, const char* fn) {
  switch (type) {
    case FloatType::kFloat32:
      return sizeof(float);
    case FloatType::kFloat16:
    case FloatType::kBFloat16:
      return 2;
  }
  throw std::invalid_argument(std::string(fn) + ": logits_type is not a FloatType");
}

// Calls f(LogitT{}) with the C++ type of `type`.
template <typename F>
void dispatch_logits(FloatType type, F&& f) {
  switch (type) {
    case FloatType::kFloat32:
      f(float{});
      return;
    case FloatType::kFloat16:
      f(__half{});
      return;
    case FloatType::kBFloat16:
      f(__nv_bfloat16{});
      return;
  }
}

void check_verify_args(const char* fn, const void* logits, FloatType logits_type,
                       const int64_t* tokens, const int32_t* parents, int64_t batch,
                       int64_t num_nodes_max, int64_t vocab, const RowOutputs& out) {
  using namespace cuda_detail;
  check_range(fn, "batch", batch, 0, kMaxGridX);
  check_range(fn, "num_nodes_max", num_nodes_max, 1, kMaxTreeNodes);
  check_range(fn, "vocab", vocab, 1, kMaxVocab);
  check_arg(product_fits({batch, num_nodes_max, vocab}), fn, "batch * num_nodes_max * vocab",
            "overflows int64");
  const size_t elem = logit_bytes(logits_type, fn);
  if (batch == 0) return;
  check_not_null(fn, "logits", logits);
  check_aligned(fn, "logits", logits, elem);
  check_not_null(fn, "tokens", tokens);
  check_not_null(fn, "parents", parents);
  check_not_null(fn, "accept_index", out.accept_index);
  check_not_null(fn, "num_accepted", out.num_accepted);
  check_not_null(fn, "emitted_tokens", out.emitted_tokens);
  check_not_null(fn, "emitted_logprobs", out.emitted_logprobs);
  check_not_null(fn, "row_status", out.row_status);
}

void check_cuda(const char* fn, cudaError_t err) {
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string(fn) + ": CUDA error: " + cudaGetErrorString(err));
  }
}

// What the current device offers verify_sampling_kernel<LogitT>, queried once per device and
// kernel: the dynamic shared memory a block may use to cache its slice (the opt-in limit less
// the static part), and how many rows run at once with each split of 2, 4, ..., kMaxSplit
// blocks: the clusters of that size that fit at once, where the kernel runs sm_90 code (its
// PTX target: the cluster code is compiled only there) on a device that launches clusters,
// else 0.
constexpr int kSplitLevels = 3;  // splits 2 << level
static_assert(2 << (kSplitLevels - 1) == kMaxSplit, "one level per power of two up to kMaxSplit");

struct LaunchCapacity {
  bool known;
  int shared_cache_bytes;
  int clusters_at_once[kSplitLevels];
};

template <typename Kernel>
LaunchCapacity launch_capacity(const char* fn, Kernel* kernel) {
  constexpr int kMaxDevices = 64;
  static std::mutex mutex;
  static std::array<LaunchCapacity, kMaxDevices> known{};
  int device = 0;
  check_cuda(fn, cudaGetDevice(&device));
  const std::lock_guard<std::mutex> lock(mutex);
  if (device < kMaxDevices && known[device].known) return known[device];
  LaunchCapacity capacity{true, 0, {}};
  cudaFuncAttributes attributes{};
  check_cuda(fn, cudaFuncGetAttributes(&attributes, kernel));
  int shared_optin = 0, cluster_launch = 0;
  check_cuda(fn, cudaDeviceGetAttribute(&shared_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin,
                                        device));
  capacity.shared_cache_bytes =
      std::max(0, (shared_optin - static_cast<int>(attributes.sharedSizeBytes)) / 16 * 16);
  check_cuda(fn, cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      capacity.shared_cache_bytes));
  check_cuda(fn, cudaDeviceGetAttribute(&cluster_launch, cudaDevAttrClusterLaunch, device));
  if (cluster_launch != 0 && attributes.ptxVersion >= 90) {
    for (int level = 0; level < kSplitLevels; ++level) {
      const unsigned split = 2u << level;
      cudaLaunchConfig_t config{};
      config.gridDim = dim3(split);
      config.blockDim = dim3(kThreads);
      config.dynamicSmemBytes = static_cast<size_t>(capacity.shared_cache_bytes);
      cudaLaunchAttribute cluster{};
      cluster.id = cudaLaunchAttributeClusterDimension;
      cluster.val.clusterDim.x = split;
      cluster.val.clusterDim.y = 1;
      cluster.val.clusterDim.z = 1;
      config.attrs = &cluster;
      config.numAttrs = 1;
      // A device that will not say runs that split not at all (the query's error is cleared).
      if (cudaOccupancyMaxActiveClusters(&capacity.clusters_at_once[level], kernel, &config) !=
          cudaSuccess) {
        capacity.clusters_at_once[level] = 0;
        cudaGetLastError();
      }
    }
  }
  if (device < kMaxDevices) known[device] = capacity;
  return capacity;
}

// Blocks per row: the largest split that still runs every row at once and leaves each block at
// least kThreads * kChunk / 2 tokens (smaller slices do not pay for the exchanges); 1 when no
// split fits the batch in one wave. The results do not depend on it (exact sums).
int choose_split(int64_t batch, int64_t vocab, const LaunchCapacity& capacity) {
  for (int level = kSplitLevels - 1; level >= 0; --level) {
    const int split = 2 << level;
    if (batch <= capacity.clusters_at_once[level] && vocab / split >= kThreads * kChunk / 2) {
      return split;
    }
  }
  return 1;
}

}  // namespace

void verify_tree_greedy_cuda(const void* logits, FloatType logits_type, const int64_t* tokens,
                             const int32_t* parents, const int32_t* num_nodes, int64_t batch,
                             int64_t num_nodes_max, int64_t vocab, int32_t* accept_index,
                             int32_t* num_accepted, int64_t* emitted_tokens,
                             float* emitted_logprobs, int32_t* row_status, void* stream) {
  constexpr const char* fn = "verify_tree_greedy_cuda";
  const RowOutputs out{accept_index, num_accepted, emitted_tokens, emitted_logprobs, row_status};
  check_verify_args(fn, logits, logits_type, tokens, parents, batch, num_nodes_max, vocab, out);
  if (batch == 0) return;
  dispatch_logits(logits_type, [&](auto tag) {
    using LogitT = decltype(tag);
    cuda_detail::launch(fn, verify_greedy_kernel<LogitT>, dim3(static_cast<unsigned>(batch)),
                        dim3(kThreads), 0, stream, static_cast<const LogitT*>(logits), tokens,
                        parents, num_nodes, static_cast<int>(num_nodes_max),
                        static_cast<int>(vocab), out);
  });
}

void verify_tree_sampling_cuda(const void* logits, FloatType logits_type,
                               const float* draft_probs, const int64_t* tokens,
                               const int32_t* parents, const int32_t* num_nodes,
                               const float* temperature, const int32_t* top_k,
                               const float* top_p, const float* uniforms, int64_t batch,
                               int64_t num_nodes_max, int64_t vocab, int32_t* accept_index,
                               int32_t* num_accepted, int64_t* emitted_tokens,
                               float* emitted_logprobs, int32_t* row_status, void* workspace,
                               void* stream) {
  using namespace cuda_detail;
  constexpr const char* fn = "verify_tree_sampling_cuda";
  const RowOutputs out{accept_index, num_accepted, emitted_tokens, emitted_logprobs, row_status};
  check_verify_args(fn, logits, logits_type, tokens, parents, batch, num_nodes_max, vocab, out);
  if (batch == 0) return;
  check_not_null(fn, "temperature", temperature);
  check_not_null(fn, "top_k", top_k);
  check_not_null(fn, "top_p", top_p);
  check_not_null(fn, "uniforms", uniforms);
  check_not_null(fn, "workspace", workspace);
  check_aligned(fn, "workspace", workspace, 16);
  dispatch_logits(logits_type, [&](auto tag) {
    using LogitT = decltype(tag);
    auto* kernel = verify_sampling_kernel<LogitT>;
    const LaunchCapacity capacity = launch_capacity(fn, kernel);
    const int split = choose_split(batch, vocab, capacity);
    // The slice's cache lives in shared memory when it fits, else in the workspace row.
    const int64_t cache_bytes =
        static_cast<int64_t>(slice_tokens(static_cast<int>(vocab), split)) * sizeof(float);
    const bool cache_in_shared = cache_bytes <= capacity.shared_cache_bytes;
    cudaLaunchConfig_t config{};
    config.gridDim = dim3(static_cast<unsigned>(batch * split));
    config.blockDim = dim3(kThreads);
    config.dynamicSmemBytes = cache_in_shared ? static_cast<size_t>(cache_bytes) : 0;
    config.stream = static_cast<cudaStream_t>(stream);
    cudaLaunchAttribute cluster{};
    cluster.id = cudaLaunchAttributeClusterDimension;
    cluster.val.clusterDim.x = static_cast<unsigned>(split);
    cluster.val.clusterDim.y = 1;
    cluster.val.clusterDim.z = 1;
    config.attrs = &cluster;
    config.numAttrs = split > 1 ? 1 : 0;
    check_cuda(fn, cudaLaunchKernelEx(&config, kernel, static_cast<const LogitT*>(logits),
                                      draft_probs, tokens, parents, num_nodes, temperature,
                                      top_k, top_p, uniforms, static_cast<int>(num_nodes_max),
                                      static_cast<int>(vocab), split, out,
                                      static_cast<float*>(workspace),
                                      sampling_workspace_stride(vocab), cache_in_shared));
    check_launch(fn);
  });
}

}  // namespace tlt
