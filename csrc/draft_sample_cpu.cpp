// CPU implementation of draft_sample.h: one row (a node's distribution) per task, its passes over
// V' those of the verifier (vocab_passes.h), then the spread over V and the inverse-CDF draws.
#include "tlt/draft_sample.h"

#include <algorithm>
#include <limits>
#include <vector>

#include "cpu_common.h"
#include "parallel.h"
#include "tlt/common.h"
#include "vocab_passes.h"

namespace tlt {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

struct Problem {
  const float* logits;
  int64_t draft_vocab;
  const float* temperature;
  const float* uniforms;
  int64_t draws;
  const int64_t* draft_to_target;
  int64_t vocab;
  float* out;
  int64_t ld_out;
  int64_t* ids;
};

int32_t sample_row(const Problem& pb, int64_t m) {
  const int64_t n = pb.draft_vocab;
  thread_local std::vector<float> scratch;
  if (static_cast<int64_t>(scratch.size()) < n) scratch.resize(n);
  float* q = scratch.data();
  std::copy(pb.logits + m * n, pb.logits + (m + 1) * n, q);
  const float temperature = pb.temperature[m];
  const bool greedy = !(temperature > 0.f);
  const cpu::ScaledMax scaled = cpu::scale_and_max(q, n, greedy ? 0.f : temperature, true);
  if (!scaled.finite) return kRowBadLogits;
  const float* u = pb.uniforms + m * pb.draws;
  for (int64_t j = 0; j < pb.draws; ++j)
    if (!(u[j] >= 0.f && u[j] < 1.f)) return kRowBadUniform;
  if (greedy) {
    std::fill(q, q + n, 0.f);
    q[scaled.argmax] = 1.f;
  } else {
    const float sum =
        static_cast<float>(cpu::exp_weights(q, n, scaled.max, kNegInf, q, true));
    for (int64_t x = 0; x < n; ++x) q[x] /= sum;
  }
  float* out = pb.out + m * pb.ld_out;
  if (pb.draft_to_target == nullptr) {
    std::copy(q, q + n, out);
  } else {
    std::fill(out, out + pb.vocab, 0.f);
    for (int64_t x = 0; x < n; ++x) out[pb.draft_to_target[x]] = q[x];
  }
  double total = 0.0;
  if (!greedy)
    for (int64_t x = 0; x < n; ++x) total += q[x];
  for (int64_t j = 0; j < pb.draws; ++j) {
    // q(argmax) = 1 / S > 0, so the inverse CDF always finds a token
    const int64_t x = greedy ? scaled.argmax : cpu::inverse_cdf(q, n, u[j] * total);
    pb.ids[m * pb.draws + j] = pb.draft_to_target == nullptr ? x : pb.draft_to_target[x];
  }
  return kRowOk;
}

}  // namespace

void sample_draft_cpu(const float* logits, int64_t rows, int64_t draft_vocab,
                      const float* temperature, const float* uniforms, int64_t draws,
                      const int64_t* draft_to_target, int64_t vocab, float* out,
                      int64_t ld_out, int64_t* ids, int32_t* row_status) {
  cpu::require(rows >= 0, "logits", "rows must be >= 0");
  cpu::require(draft_vocab >= 1, "logits", "the draft vocabulary V' must be >= 1");
  cpu::require(draws >= 1, "uniforms", "needs at least one draw per row");
  cpu::require(draft_to_target != nullptr ? vocab >= draft_vocab : vocab == draft_vocab, "out",
               "V must be >= V' with a draft_to_target map, and V' without one");
  cpu::require(ld_out >= vocab, "out", "row stride must be >= V");
  if (rows == 0) return;
  cpu::require(logits != nullptr, "logits", "is null");
  cpu::require(temperature != nullptr, "temperature", "is null");
  cpu::require(uniforms != nullptr, "uniforms", "is null");
  cpu::require(out != nullptr, "out", "is null");
  cpu::require(ids != nullptr, "ids", "is null");
  cpu::require(row_status != nullptr, "row_status", "is null");
  const Problem pb{logits, draft_vocab, temperature, uniforms, draws, draft_to_target, vocab, out,
                   ld_out, ids};
  cpu::parallel_for_on_openmp_team(rows, [&](int64_t m) {
    row_status[m] = sample_row(pb, m);
    if (row_status[m] != kRowOk) {
      std::fill(out + m * ld_out, out + m * ld_out + vocab, 0.f);
      std::fill(ids + m * draws, ids + (m + 1) * draws, int64_t{-1});
    }
  });
}

}  // namespace tlt
