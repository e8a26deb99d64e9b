// CPU implementation of verify.h. Rows run in parallel (parallel.h); inside a row the walk is
// sequential and touches only the nodes it visits: each visit is a few linear passes over V
// (load + max, top-k select, exp + sum, top-p select), so a row costs O(visited * V) instead of
// the O(N * V log V) of transforming every node's distribution up front.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "cpu_common.h"
#include "parallel.h"
#include "tlt/verify.h"
#include "vocab_passes.h"

namespace tlt {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Per-thread scratch reused across rows and calls: V-sized buffers would otherwise be
// mmap-allocated and page-faulted for every row.
struct Scratch {
  std::vector<float> logits;  // (V,) the node's logits, widened
  std::vector<float> weights; // (V,) w: unnormalised target (or residual) weights
  std::vector<float> select;  // (V,) scratch for top-k / top-p selection
};
Scratch& thread_scratch(int64_t vocab) {
  thread_local Scratch scratch;
  // Each buffer is sized on its own: when one resize throws std::bad_alloc, the buffers grown
  // before it must not pass for the whole set on the next call.
  for (std::vector<float>* buffer : {&scratch.logits, &scratch.weights, &scratch.select})
    if (static_cast<int64_t>(buffer->size()) < vocab) buffer->resize(vocab);
  return scratch;
}

// Problem-wide read-only inputs.
struct VerifyProblem {
  const void* logits;
  FloatType logits_type;
  const float* draft_probs;  // nullptr: deterministic drafts
  const int64_t* tokens;
  const int32_t* parents;
  const int32_t* num_nodes;
  const float* temperature;  // nullptr: every row greedy
  const int32_t* top_k;
  const float* top_p;
  const float* uniforms;     // nullptr: greedy verifier (uniforms are irrelevant at T = 0)
  int64_t n_max;
  int64_t vocab;
  bool vector;  // the AVX2 passes over V (vocab_passes.h) where the CPU has them
};

// Per-row outputs.
struct RowOutputs {
  int32_t* accept_index;
  int32_t* num_accepted;
  int64_t* emitted_tokens;
  float* emitted_logprobs;
};

// The target distribution at one visited node: w = weights[0:V], sum S, and what the
// emitted log-probabilities need.
struct NodeDistribution {
  float sum = 0.f;          // S, the current (possibly residual) mass
  float fresh_sum = 0.f;    // S_v before any rejection (T > 0)
  float max_z = 0.f;        // m (T > 0) or the max logit (T == 0)
  float log_normalizer = 0.f;  // T == 0: log sum exp(l - max)
  int64_t argmax = 0;
  bool greedy = false;
};

// Smallest threshold t0 such that sum_{e(y) > t0} e(y) < mass_limit, over the positive values
// in values[0:n] (reordered in place). Keeping e(x) >= t0 is exactly verify.h's top-p rule.
// Expected O(n): a quickselect that descends into the part that contains the threshold.
float top_p_threshold(float* values, int64_t n, double mass_limit) {
  double mass_above = 0.0;  // mass of the values greater than everything in [lo, hi)
  float threshold = std::numeric_limits<float>::infinity();
  int64_t lo = 0, hi = n;
  while (lo < hi) {
    const float pivot = values[lo + (hi - lo) / 2];
    // Three-way partition of [lo, hi): greater | equal | less.
    float* first = values + lo;
    float* last = values + hi;
    float* greater_end = std::partition(first, last, [pivot](float v) { return v > pivot; });
    float* equal_end = std::partition(greater_end, last, [pivot](float v) { return v == pivot; });
    double greater_mass = 0.0;
    for (float* v = first; v < greater_end; ++v) greater_mass += *v;
    if (mass_above + greater_mass >= mass_limit) {
      hi = greater_end - values;  // the pivot is dropped; the threshold is above it
      continue;
    }
    threshold = pivot;  // kept: less than mass_limit lies strictly above it
    mass_above += greater_mass + static_cast<double>(equal_end - greater_end) * pivot;
    if (mass_above >= mass_limit) break;
    lo = equal_end - values;
  }
  return threshold;
}

// Computes w and S at node `node` of row b into scratch.weights. Returns a RowStatus.
int32_t compute_distribution(const VerifyProblem& pb, int64_t b, int64_t node, Scratch& scratch,
                             NodeDistribution& dist) {
  const int64_t V = pb.vocab;
  float* logits = scratch.logits.data();
  float* w = scratch.weights.data();
  cpu::widen_logits(pb.logits, pb.logits_type, (b * pb.n_max + node) * V, V, logits, pb.vector);
  const float temperature = pb.temperature ? pb.temperature[b] : 0.f;
  dist.greedy = !(temperature > 0.f);

  // Pass 1: (scaled) logits, their max and argmax, finiteness.
  const cpu::ScaledMax scaled =
      cpu::scale_and_max(logits, V, dist.greedy ? 0.f : temperature, pb.vector);
  if (!scaled.finite) return kRowBadLogits;
  const float max_value = scaled.max;
  dist.max_z = max_value;
  dist.argmax = scaled.argmax;

  if (dist.greedy) {
    const double total = cpu::exp_weights(logits, V, max_value, kNegInf, nullptr, pb.vector);
    dist.log_normalizer = std::log(static_cast<float>(total));
    std::fill(w, w + V, 0.f);
    w[scaled.argmax] = 1.f;
    dist.sum = dist.fresh_sum = 1.f;
    return kRowOk;
  }

  // Top-k: keep z >= the k-th largest z.
  float z_floor = kNegInf;
  const int32_t k = pb.top_k ? pb.top_k[b] : 0;
  if (k > 0 && k < V) {
    float* select = scratch.select.data();
    std::copy(logits, logits + V, select);
    std::nth_element(select, select + (k - 1), select + V, std::greater<float>());
    z_floor = select[k - 1];
  }
  // Pass 2: e = exp(z - m) over the kept tokens.
  float sum = static_cast<float>(cpu::exp_weights(logits, V, max_value, z_floor, w, pb.vector));
  // Top-p: keep e >= t0, the boundary the nucleus rule implies.
  const float top_p = pb.top_p ? pb.top_p[b] : 1.f;
  if (top_p < 1.f) {
    float* select = scratch.select.data();
    int64_t positive = 0;
    for (int64_t x = 0; x < V; ++x)
      if (w[x] > 0.f) select[positive++] = w[x];
    const float threshold = top_p_threshold(select, positive, static_cast<double>(top_p * sum));
    double kept = 0.0;
    for (int64_t x = 0; x < V; ++x) {
      if (w[x] < threshold) w[x] = 0.f;
      kept += w[x];
    }
    sum = static_cast<float>(kept);
  }
  dist.sum = dist.fresh_sum = sum;
  return kRowOk;
}

float emitted_logprob(const NodeDistribution& dist, const Scratch& scratch, int64_t token) {
  const float z = scratch.logits[token];
  if (dist.greedy) return z - dist.max_z - dist.log_normalizer;
  return z - dist.max_z - std::log(dist.fresh_sum);
}

// The final token at a node: inverse CDF of w / S with uniform u (the target u * S rounded to
// float32, as verify.h states), the argmax where w is all zero.
int64_t sample_final(const float* w, int64_t V, float sum, float u, int64_t fallback_argmax) {
  const int64_t x = cpu::inverse_cdf(w, V, u * sum);
  return x >= 0 ? x : fallback_argmax;
}

void pad_row(int64_t n_max, const RowOutputs& out) {
  for (int64_t i = 0; i < n_max; ++i) {
    out.accept_index[i] = -1;
    out.emitted_tokens[i] = -1;
    out.emitted_logprobs[i] = 0.f;
  }
  out.accept_index[0] = 0;
  *out.num_accepted = 0;
}

int32_t walk_row(const VerifyProblem& pb, int64_t b, const RowOutputs& out) {
  const int64_t n_max = pb.n_max, V = pb.vocab;
  const int64_t* tokens = pb.tokens + b * n_max;
  const int32_t* parents = pb.parents + b * n_max;
  const float* uniforms = pb.uniforms ? pb.uniforms + b * n_max : nullptr;
  const int64_t valid = pb.num_nodes ? pb.num_nodes[b] : n_max;
  if (valid < 1 || valid > n_max) return kRowBadNumNodes;
  // Children lists in sibling (index) order, built back to front.
  std::vector<int32_t> first_child(valid, -1), next_sibling(valid, -1);
  for (int64_t i = valid - 1; i >= 1; --i) {
    if (parents[i] < 0 || parents[i] >= i) return kRowBadParent;
    if (tokens[i] < 0 || tokens[i] >= V) return kRowBadToken;
    next_sibling[i] = first_child[parents[i]];
    first_child[parents[i]] = static_cast<int32_t>(i);
  }
  auto uniform = [&](int64_t i) { return uniforms ? uniforms[i] : 0.f; };

  Scratch& scratch = thread_scratch(V);
  float* w = scratch.weights.data();
  NodeDistribution dist;
  int64_t node = 0, emitted = 0;
  for (;;) {
    if (const int32_t status = compute_distribution(pb, b, node, scratch, dist); status != kRowOk)
      return status;
    const float* q = pb.draft_probs ? pb.draft_probs + (b * n_max + node) * V : nullptr;
    if (q && first_child[node] >= 0 && !cpu::is_distribution(q, V, pb.vector))
      return kRowBadDraftProbs;
    int64_t accepted = -1;
    for (int32_t child = first_child[node]; child >= 0; child = next_sibling[child]) {
      const float u = uniform(child);
      if (!(u >= 0.f && u < 1.f)) return kRowBadUniform;
      const int64_t x = tokens[child];
      if (!q) {
        if (u * dist.sum < w[x]) {
          accepted = child;
          break;
        }
        dist.sum -= w[x];
        w[x] = 0.f;
      } else {
        if (u * q[x] * dist.sum < w[x]) {
          accepted = child;
          break;
        }
        // Residual max(0, p - q), kept unnormalised: max(0, w - q * S).
        const double residual_mass = cpu::residual_mass(w, q, dist.sum, V, pb.vector);
        if (residual_mass > 0.0) {
          cpu::take_residual(w, q, dist.sum, V, pb.vector);
          dist.sum = static_cast<float>(residual_mass);
        }
      }
    }
    if (accepted >= 0) {
      out.emitted_tokens[emitted] = tokens[accepted];
      out.emitted_logprobs[emitted] = emitted_logprob(dist, scratch, tokens[accepted]);
      ++emitted;
      out.accept_index[emitted] = static_cast<int32_t>(accepted);
      node = accepted;
      continue;
    }
    const float u0 = uniform(0);
    if (!(u0 >= 0.f && u0 < 1.f)) return kRowBadUniform;
    const int64_t final_token = sample_final(w, V, dist.sum, u0, dist.argmax);
    out.emitted_tokens[emitted] = final_token;
    out.emitted_logprobs[emitted] = emitted_logprob(dist, scratch, final_token);
    *out.num_accepted = static_cast<int32_t>(emitted);
    return kRowOk;
  }
}

void verify_rows(const VerifyProblem& pb, int64_t batch, int32_t* accept_index,
                 int32_t* num_accepted, int64_t* emitted_tokens, float* emitted_logprobs,
                 int32_t* row_status) {
  cpu::parallel_for(batch, [&](int64_t b) {
    const RowOutputs out{accept_index + b * pb.n_max, num_accepted + b,
                         emitted_tokens + b * pb.n_max, emitted_logprobs + b * pb.n_max};
    pad_row(pb.n_max, out);
    row_status[b] = walk_row(pb, b, out);
    if (row_status[b] != kRowOk) pad_row(pb.n_max, out);
  });
}

}  // namespace

void verify_tree_greedy_cpu(const void* logits, FloatType logits_type, const int64_t* tokens,
                            const int32_t* parents, const int32_t* num_nodes, int64_t batch,
                            int64_t num_nodes_max, int64_t vocab, int32_t* accept_index,
                            int32_t* num_accepted, int64_t* emitted_tokens,
                            float* emitted_logprobs, int32_t* row_status, int isa) {
  cpu::check_common_sizes(batch, num_nodes_max);
  cpu::check_vocab(vocab);
  cpu::check_float_type(logits_type, "logits_type");
  cpu::require(isa == 0 || isa == 1, "isa", "must be 0 (fastest) or 1 (portable)");
  // Greedy is the temperature-0 case of the sampling walk, with no randomness needed.
  const VerifyProblem pb{logits,  logits_type, nullptr, tokens,        parents, num_nodes,
                         nullptr, nullptr,     nullptr, nullptr,       num_nodes_max, vocab,
                         isa == 0};
  verify_rows(pb, batch, accept_index, num_accepted, emitted_tokens, emitted_logprobs,
              row_status);
}

void verify_tree_sampling_cpu(const void* logits, FloatType logits_type,
                              const float* draft_probs, const int64_t* tokens,
                              const int32_t* parents, const int32_t* num_nodes,
                              const float* temperature, const int32_t* top_k,
                              const float* top_p, const float* uniforms, int64_t batch,
                              int64_t num_nodes_max, int64_t vocab, int32_t* accept_index,
                              int32_t* num_accepted, int64_t* emitted_tokens,
                              float* emitted_logprobs, int32_t* row_status, int isa) {
  cpu::check_common_sizes(batch, num_nodes_max);
  cpu::check_vocab(vocab);
  cpu::check_float_type(logits_type, "logits_type");
  cpu::require(isa == 0 || isa == 1, "isa", "must be 0 (fastest) or 1 (portable)");
  if (batch == 0) return;  // nothing to read: empty arrays may come with null pointers
  cpu::require(temperature && top_k && top_p, "temperature/top_k/top_p", "must not be null");
  cpu::require(uniforms != nullptr, "uniforms", "must not be null");
  const VerifyProblem pb{logits,      logits_type, draft_probs, tokens,        parents, num_nodes,
                         temperature, top_k,       top_p,       uniforms,      num_nodes_max,
                         vocab,       isa == 0};
  verify_rows(pb, batch, accept_index, num_accepted, emitted_tokens, emitted_logprobs,
              row_status);
}

}  // namespace tlt
