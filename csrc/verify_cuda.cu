// CUDA implementations of verify_tree_greedy and verify_tree_sampling (verify.h).
//
// Both kernels run one block per row: the walk is inherently sequential (each visited node
// depends on the previous acceptance), but every step at a node is a pass over the V logits,
// which the whole block shares. All control flow that reaches a barrier is block-uniform:
// decisions are taken on values every thread computes identically (block reductions return
// the same total to every thread, shared or global loads of one address).
//
// Arithmetic follows the CPU kernel: sums over V are accumulated in double in a fixed order
// (deterministic run to run) and rounded once to float; a * b - c is written with __fmul_rn
// so nvcc cannot contract it into an FMA the CPU does not do.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cub/block/block_scan.cuh>

#include <climits>
#include <cmath>
#include <cstdint>

#include "cuda_check.h"
#include "tlt/verify.h"

namespace tlt {
namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int kDigitBits = 4;  // threshold search: 4 bits of the key per pass over V
constexpr int kBins = 1 << kDigitBits;
constexpr int kScanItems = 4;  // consecutive tokens per thread in the inverse-CDF scan
constexpr int kNone = INT_MAX;

using BlockScan = cub::BlockScan<double, kThreads>;

struct Shared {
  int32_t tok[kMaxTreeNodes];       // (N) token of each valid node (checked to be in [0, V))
  int32_t par[kMaxTreeNodes];       // (N) parent of each valid node
  int32_t path[kMaxTreeNodes];      // accepted path: node 0, then each accepted node
  float logprob[kMaxTreeNodes];     // emitted log-probability at each visited node
  int32_t rejected[kMaxTreeNodes];  // deterministic drafts: zeroed tokens at this node, sorted
  double red_d[kWarps * kBins];     // reduction scratch, one slot per warp (and bin)
  int32_t red_i[kWarps * kBins];
  float red_f[kWarps];
  typename BlockScan::TempStorage scan;
};

// ---------------------------------------------------------------------------------------
// Block-wide reductions. Every thread must call them; every thread gets the result; they end
// with a barrier, so the scratch can be reused by the next call at once.

__device__ __forceinline__ int lane_id() { return threadIdx.x & 31; }
__device__ __forceinline__ int warp_id() { return threadIdx.x >> 5; }

template <typename T>
__device__ __forceinline__ T warp_sum(T value) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    value += __shfl_xor_sync(0xffffffffu, value, offset);
  }
  return value;
}

__device__ __forceinline__ double* scratch_of(Shared& sh, double) { return sh.red_d; }
__device__ __forceinline__ int32_t* scratch_of(Shared& sh, int32_t) { return sh.red_i; }

// values[j] <- sum over the block of values[j], j < kCount, in a fixed order.
template <typename T, int kCount>
__device__ void block_sum(T (&values)[kCount], Shared& sh) {
  static_assert(kCount <= kBins, "scratch holds kBins values per warp");
  T* scratch = scratch_of(sh, T{});
#pragma unroll
  for (int j = 0; j < kCount; ++j) values[j] = warp_sum(values[j]);
  if (lane_id() == 0) {
#pragma unroll
    for (int j = 0; j < kCount; ++j) scratch[warp_id() * kCount + j] = values[j];
  }
  __syncthreads();
#pragma unroll
  for (int j = 0; j < kCount; ++j) {
    T total = 0;
    for (int w = 0; w < kWarps; ++w) total += scratch[w * kCount + j];
    values[j] = total;
  }
  __syncthreads();
}

template <typename T>
__device__ T block_sum(T value, Shared& sh) {
  T values[1] = {value};
  block_sum(values, sh);
  return values[0];
}

// lo <- block min of lo, hi <- block max of hi.
__device__ void block_min_max(int& lo, int& hi, Shared& sh) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    lo = min(lo, __shfl_xor_sync(0xffffffffu, lo, offset));
    hi = max(hi, __shfl_xor_sync(0xffffffffu, hi, offset));
  }
  if (lane_id() == 0) {
    sh.red_i[2 * warp_id()] = lo;
    sh.red_i[2 * warp_id() + 1] = hi;
  }
  __syncthreads();
  for (int w = 0; w < kWarps; ++w) {
    lo = min(lo, sh.red_i[2 * w]);
    hi = max(hi, sh.red_i[2 * w + 1]);
  }
  __syncthreads();
}

__device__ int block_min(int value, Shared& sh) {
  int unused = 0;
  block_min_max(value, unused, sh);
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

__device__ ArgMax block_argmax(ArgMax best, Shared& sh) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    const ArgMax other{__shfl_xor_sync(0xffffffffu, best.value, offset),
                       __shfl_xor_sync(0xffffffffu, best.index, offset)};
    best = better_of(best, other);
  }
  if (lane_id() == 0) {
    sh.red_f[warp_id()] = best.value;
    sh.red_i[warp_id()] = best.index;
  }
  __syncthreads();
  best = ArgMax{sh.red_f[0], sh.red_i[0]};
  for (int w = 1; w < kWarps; ++w) best = better_of(best, ArgMax{sh.red_f[w], sh.red_i[w]});
  __syncthreads();
  return best;
}

// ---------------------------------------------------------------------------------------
// Threshold search (top-k and top-p).

template <typename T>
struct KeyWeight {
  uint32_t key;
  T weight;
};

// Smallest 32-bit t such that the total weight of the tokens with key > t is < limit
// (limit > 0, weights >= 0). Radix search from the most significant digit: the answer is
// known to lie in [low, low + 2^(shift + kDigitBits)); a pass over V sums, per thread and then
// in a fixed order over the block, the weight of the tokens whose key falls into each of the
// kBins sub-ranges, and keeps the lowest sub-range whose upper end still has less than `limit`
// above it. Exact for integer weights; for float weights the sums are double. 8 passes.
template <typename T, typename Item>
__device__ uint32_t threshold_select(int vocab, T limit, const Item& item, Shared& sh) {
  uint32_t low = 0;
  T above = 0;  // weight of the keys above the current range; < limit by construction
  for (int shift = 32 - kDigitBits; shift >= 0; shift -= kDigitBits) {
    const uint64_t prefix = static_cast<uint64_t>(low) >> (shift + kDigitBits);
    T bins[kBins];
#pragma unroll
    for (int j = 0; j < kBins; ++j) bins[j] = 0;
    for (int x = threadIdx.x; x < vocab; x += kThreads) {
      const KeyWeight<T> kw = item(x);
      if ((static_cast<uint64_t>(kw.key) >> (shift + kDigitBits)) != prefix) continue;
      const int digit = static_cast<int>((kw.key >> shift) & (kBins - 1));
#pragma unroll
      for (int j = 0; j < kBins; ++j) {
        if (digit == j) bins[j] += kw.weight;
      }
    }
    block_sum(bins, sh);
    // The weight above the end of sub-range d is above + bins[kBins - 1] + ... + bins[d + 1].
    int d = kBins - 1;
    while (d > 0 && above + bins[d] < limit) {
      above += bins[d];
      --d;
    }
    low += static_cast<uint32_t>(d) << shift;
  }
  return low;
}

// Order-preserving float -> uint32 map; -0 and +0 share a key, as they compare equal.
__device__ __forceinline__ uint32_t order_key(float f) {
  if (f == 0.0f) return 0x80000000u;
  const uint32_t bits = __float_as_uint(f);
  return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

// ---------------------------------------------------------------------------------------
// The target distribution at one visited node.

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

// Fresh (w, S) of verify.h at one node, evaluated per token on demand from the logits: there is
// no V-sized buffer, so each pass recomputes z / e / w with the same expressions.
template <typename LogitT>
struct NodeDist {
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
  __device__ float e(int x) const {
    const float zx = z(x);
    return order_key(zx) >= topk_key ? expf(zx - max_z) : 0.0f;
  }
  __device__ float w(int x) const {
    if (greedy) return x == argmax ? 1.0f : 0.0f;
    const float ex = e(x);
    return __float_as_uint(ex) >= topp_bits ? ex : 0.0f;
  }
  // T > 0: z(x) - m - logf(S_v); greedy: log_softmax(l)(x) at temperature 1.
  __device__ float logprob(int x) const {
    const float centered = z(x) - max_z;
    return greedy ? centered - log_norm : centered - logf(mass);
  }
};

// Fills d for the node whose logits are `logits` (V). Returns false for kRowBadLogits: a z
// that is NaN or +inf, or all z = -inf (z = l / T, so this includes l / T overflowing).
// Passes over V: 1 (validate, max) + greedy: 1 (normaliser); T > 0: 8 (top-k) + 1 (Z)
// + 8 (top-p) + 1 (S), each stage only when enabled.
template <typename LogitT>
__device__ bool prepare_node(NodeDist<LogitT>& d, const LogitT* logits, int vocab,
                             float temperature, int top_k, float top_p, Shared& sh) {
  d.logits = logits;
  d.temperature = temperature;
  d.greedy = !(temperature > 0.0f);
  d.topk_key = 0;
  d.topp_bits = 0;
  d.log_norm = 0.0f;

  ArgMax best{-INFINITY, kNone};
  bool bad = false;
  for (int x = threadIdx.x; x < vocab; x += kThreads) {
    const float zx = d.z(x);
    bad |= isnan(zx) || zx == INFINITY;
    if (zx > best.value) best = ArgMax{zx, x};
  }
  if (__syncthreads_or(bad)) return false;
  best = block_argmax(best, sh);
  if (best.value == -INFINITY) return false;
  d.argmax = best.index;
  d.max_z = best.value;

  if (d.greedy) {
    double total = 0.0;
    for (int x = threadIdx.x; x < vocab; x += kThreads) total += expf(d.z(x) - d.max_z);
    d.log_norm = logf(static_cast<float>(block_sum(total, sh)));
    d.mass = 1.0f;
    return true;
  }

  if (top_k > 0 && top_k < vocab) {
    d.topk_key = threshold_select<int32_t>(
        vocab, top_k, [&d](int x) { return KeyWeight<int32_t>{order_key(d.z(x)), 1}; }, sh);
  }
  double total = 0.0;
  for (int x = threadIdx.x; x < vocab; x += kThreads) total += d.e(x);
  const float z_sum = static_cast<float>(block_sum(total, sh));
  d.mass = z_sum;
  if (top_p < 1.0f) {
    const float limit = top_p * z_sum;
    // limit <= 0 (top_p <= 0): no token has less than `limit` above it, so none is kept.
    d.topp_bits = limit > 0.0f ? threshold_select<double>(
                                     vocab, static_cast<double>(limit),
                                     [&d](int x) {
                                       const float ex = d.e(x);
                                       return KeyWeight<double>{__float_as_uint(ex), ex};
                                     },
                                     sh)
                               : UINT32_MAX;
    total = 0.0;
    for (int x = threadIdx.x; x < vocab; x += kThreads) total += d.w(x);
    d.mass = static_cast<float>(block_sum(total, sh));
  }
  return true;
}

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

// The current w at a node: fresh, minus the rejected tokens (deterministic drafts), or the
// residual stored in the workspace (sampled drafts, after a rejection that left mass).
template <typename LogitT>
struct Weights {
  NodeDist<LogitT> dist;
  const float* residual;    // (V) or nullptr
  const int32_t* rejected;  // sorted, num_rejected entries
  int num_rejected;

  __device__ float operator()(int x) const {
    if (residual != nullptr) return residual[x];
    if (num_rejected > 0 && sorted_contains(rejected, num_rejected, x)) return 0.0f;
    return dist.w(x);
  }
};

// Adds x to the sorted rejected list of `count` entries (x is not in it).
__device__ void reject_token(Shared& sh, int count, int x) {
  __syncthreads();  // everyone is done reading the list
  if (threadIdx.x == 0) {
    int i = count;
    for (; i > 0 && sh.rejected[i - 1] > x; --i) sh.rejected[i] = sh.rejected[i - 1];
    sh.rejected[i] = x;
  }
  __syncthreads();
}

// Sum over y of max(0, w(y) - q(y) * S); with store, also writes it to residual (V). A token
// is read and written by the same thread, and the closing block_sum orders the stores before
// any later read.
template <typename W>
__device__ double residual_pass(const W& w, const float* q, float mass, float* residual,
                                int vocab, bool store, Shared& sh) {
  double total = 0.0;
  for (int y = threadIdx.x; y < vocab; y += kThreads) {
    const float r = w(y) - __fmul_rn(q[y], mass);
    const float kept = r > 0.0f ? r : 0.0f;
    total += kept;
    if (store) residual[y] = kept;
  }
  return block_sum(total, sh);
}

// A q row (V) is valid: every entry finite and >= 0, and the sum within 1e-3 of 1.
__device__ bool draft_row_valid(const float* q, int vocab, Shared& sh) {
  bool bad = false;
  double total = 0.0;
  for (int y = threadIdx.x; y < vocab; y += kThreads) {
    const float qy = q[y];
    bad |= !(qy >= 0.0f) || isinf(qy);
    total += qy;
  }
  if (__syncthreads_or(bad)) return false;
  return fabs(block_sum(total, sh) - 1.0) <= 1e-3;
}

// Inverse CDF: the smallest x with w(x) > 0 whose running sum of w exceeds target; else the
// largest x with w(x) > 0; else fallback. Chunks of kThreads * kScanItems tokens, thread t
// holding kScanItems consecutive ones, a block scan of the per-thread totals (double) and a
// carry between chunks; stops at the first chunk with a hit.
template <typename W>
__device__ int sample_inverse_cdf(const W& w, int vocab, float target, int fallback,
                                  Shared& sh) {
  double carry = 0.0;
  int last_positive = -1;
  for (int base = 0; base < vocab; base += kThreads * kScanItems) {
    const int first = base + threadIdx.x * kScanItems;
    float weight[kScanItems];
    double running[kScanItems];
    double total = 0.0;
#pragma unroll
    for (int i = 0; i < kScanItems; ++i) {
      weight[i] = first + i < vocab ? w(first + i) : 0.0f;
      if (weight[i] > 0.0f) total += weight[i];
      running[i] = total;
    }
    double before = 0.0, chunk_total = 0.0;
    BlockScan(sh.scan).ExclusiveSum(total, before, chunk_total);
    const double start = carry + before;
    int hit = kNone, last = -1;
#pragma unroll
    for (int i = 0; i < kScanItems; ++i) {
      if (weight[i] > 0.0f) {
        last = first + i;
        if (hit == kNone && start + running[i] > target) hit = first + i;
      }
    }
    block_min_max(hit, last, sh);  // also orders this scan before the next one's storage use
    last_positive = max(last_positive, last);
    carry += chunk_total;
    if (hit != kNone) return hit;
  }
  return last_positive >= 0 ? last_positive : fallback;
}

// ---------------------------------------------------------------------------------------
// Row set-up and outputs.

// Loads the row's tree into shared memory and validates it. Returns a RowStatus. Node i's
// problems are checked for 1 <= i < n (the root's token and parent are never used); like the
// CPU kernel, the reported problem is the one of the highest bad node, its parent before its
// token.
__device__ int load_tree(const int64_t* tokens, const int32_t* parents, int n, int num_nodes_max,
                         int vocab, Shared& sh) {
  if (n < 1 || n > num_nodes_max) return kRowBadNumNodes;
  int worst = -1;  // 2 * node + (1 if the parent is bad, 0 if only the token is)
  for (int i = threadIdx.x; i < n; i += kThreads) {
    const int32_t p = parents[i];
    const int64_t t = tokens[i];
    const bool token_ok = t >= 0 && t < vocab;
    sh.par[i] = p;
    sh.tok[i] = token_ok ? static_cast<int32_t>(t) : 0;
    if (i > 0 && (p < 0 || p >= i)) {
      worst = max(worst, 2 * i + 1);
    } else if (i > 0 && !token_ok) {
      worst = max(worst, 2 * i);
    }
  }
  int unused = kNone;
  block_min_max(unused, worst, sh);  // its barriers also publish sh.par / sh.tok
  if (worst < 0) return kRowOk;
  return (worst & 1) ? kRowBadParent : kRowBadToken;
}

// Smallest valid node c > after with parents[c] == v (and tokens[c] == token when token >= 0);
// n if there is none.
__device__ int next_child(Shared& sh, int v, int after, int n, int token) {
  int found = kNone;
  for (int c = after + 1 + threadIdx.x; c < n; c += kThreads) {
    if (sh.par[c] == v && (token < 0 || sh.tok[c] == token)) {
      found = c;
      break;
    }
  }
  found = block_min(found, sh);
  return found == kNone ? n : found;
}

struct RowOutputs {
  int32_t* accept_index;      // (B, N)
  int32_t* num_accepted;      // (B)
  int64_t* emitted_tokens;    // (B, N)
  float* emitted_logprobs;    // (B, N)
  int32_t* row_status;        // (B)
};

// Writes row b's outputs from sh.path / sh.logprob, or the padded state of a failed row.
// Must follow a barrier after the last write to sh.path / sh.logprob.
__device__ void write_outputs(const RowOutputs& out, int64_t b, int num_nodes_max, int status,
                              int num_accepted, int final_token, const Shared& sh) {
  const bool ok = status == kRowOk;
  for (int i = threadIdx.x; i < num_nodes_max; i += kThreads) {
    int32_t node = i == 0 ? 0 : -1;
    int64_t token = -1;
    float logprob = 0.0f;
    if (ok && i <= num_accepted) {
      node = sh.path[i];
      token = i < num_accepted ? sh.tok[sh.path[i + 1]] : final_token;
      logprob = sh.logprob[i];
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
// Kernels: one block of kThreads per row (see the top of the file).

template <typename LogitT>
__global__ __launch_bounds__(kThreads) void verify_greedy_kernel(
    const LogitT* logits,      // (B, N, V)
    const int64_t* tokens,     // (B, N)
    const int32_t* parents,    // (B, N)
    const int32_t* num_nodes,  // (B) or nullptr
    int num_nodes_max, int vocab, RowOutputs out) {
  __shared__ Shared sh;
  const int N = num_nodes_max;
  const int64_t b = blockIdx.x;
  const int n = num_nodes != nullptr ? num_nodes[b] : N;
  int status = load_tree(tokens + b * N, parents + b * N, n, N, vocab, sh);
  int num_accepted = 0, final_token = -1;
  if (status == kRowOk) {
    if (threadIdx.x == 0) sh.path[0] = 0;
    for (int v = 0;;) {
      NodeDist<LogitT> d;
      if (!prepare_node(d, logits + (b * N + v) * vocab, vocab, 0.0f, 0, 1.0f, sh)) {
        status = kRowBadLogits;
        break;
      }
      const int child = next_child(sh, v, v, n, d.argmax);
      if (threadIdx.x == 0) sh.logprob[num_accepted] = d.logprob(d.argmax);
      if (child >= n) {
        final_token = d.argmax;
        break;
      }
      ++num_accepted;
      if (threadIdx.x == 0) sh.path[num_accepted] = child;
      v = child;
    }
  }
  __syncthreads();
  write_outputs(out, b, N, status, num_accepted, final_token, sh);
}

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
    int num_nodes_max, int vocab, RowOutputs out,
    float* workspace) {         // (B, V) residual w; with draft_probs only
  __shared__ Shared sh;
  const int N = num_nodes_max;
  const int64_t b = blockIdx.x;
  const int n = num_nodes != nullptr ? num_nodes[b] : N;
  int status = load_tree(tokens + b * N, parents + b * N, n, N, vocab, sh);
  int num_accepted = 0, final_token = -1;
  if (status == kRowOk) {
    const float row_temperature = temperature[b];
    const int row_top_k = top_k[b];
    const float row_top_p = top_p[b];
    const float* u = uniforms + b * N;                                           // (N)
    float* residual = draft_probs != nullptr ? workspace + b * vocab : nullptr;  // (V)
    if (threadIdx.x == 0) sh.path[0] = 0;
    for (int v = 0;;) {
      const int64_t node_offset = (b * N + v) * vocab;
      NodeDist<LogitT> d;
      if (!prepare_node(d, logits + node_offset, vocab, row_temperature, row_top_k, row_top_p,
                        sh)) {
        status = kRowBadLogits;
        break;
      }
      const float* q = draft_probs != nullptr ? draft_probs + node_offset : nullptr;  // (V)
      Weights<LogitT> w{d, nullptr, sh.rejected, 0};
      float mass = d.mass;  // S
      int child = next_child(sh, v, v, n, -1);
      if (q != nullptr && child < n && !draft_row_valid(q, vocab, sh)) {
        status = kRowBadDraftProbs;
        break;
      }
      bool accepted = false;
      for (; child < n; child = next_child(sh, v, child, n, -1)) {
        const float uc = u[child];
        if (!(uc >= 0.0f && uc < 1.0f)) {
          status = kRowBadUniform;
          break;
        }
        const int x = sh.tok[child];
        const float wx = w(x);
        if (q != nullptr ? uc * q[x] * mass < wx : uc * mass < wx) {
          accepted = true;
          break;
        }
        if (q != nullptr) {
          const double residual_mass = residual_pass(w, q, mass, residual, vocab, false, sh);
          if (residual_mass > 0.0) {  // else w (and S) stay as they were
            residual_pass(w, q, mass, residual, vocab, true, sh);
            w.residual = residual;
            mass = static_cast<float>(residual_mass);
          }
        } else if (wx > 0.0f) {  // rejecting a zero-weight token changes nothing
          mass -= wx;
          reject_token(sh, w.num_rejected, x);
          ++w.num_rejected;
        }
      }
      if (status != kRowOk) break;
      if (accepted) {
        if (threadIdx.x == 0) {
          sh.logprob[num_accepted] = d.logprob(sh.tok[child]);
          sh.path[num_accepted + 1] = child;
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
      final_token = sample_inverse_cdf(w, vocab, u0 * mass, d.argmax, sh);
      if (threadIdx.x == 0) sh.logprob[num_accepted] = d.logprob(final_token);
      break;
    }
  }
  __syncthreads();
  write_outputs(out, b, N, status, num_accepted, final_token, sh);
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
  if (draft_probs != nullptr) {
    check_not_null(fn, "workspace", workspace);
    check_aligned(fn, "workspace", workspace, alignof(float));
  }
  dispatch_logits(logits_type, [&](auto tag) {
    using LogitT = decltype(tag);
    launch(fn, verify_sampling_kernel<LogitT>, dim3(static_cast<unsigned>(batch)),
           dim3(kThreads), 0, stream, static_cast<const LogitT*>(logits), draft_probs, tokens,
           parents, num_nodes, temperature, top_k, top_p, uniforms,
           static_cast<int>(num_nodes_max), static_cast<int>(vocab), out,
           static_cast<float*>(workspace));
  });
}

}  // namespace tlt
