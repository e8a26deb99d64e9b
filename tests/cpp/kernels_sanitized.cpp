// Runs every CPU kernel on valid, edge-case and malformed inputs under AddressSanitizer and
// UndefinedBehaviorSanitizer (built by .ci/run with TLT_SANITIZE=ON). The Python tests check
// values; this checks that no input, however bad, makes a kernel read or write out of bounds.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <random>
#include <stdexcept>
#include <vector>

#include "tlt/kv_cache.h"
#include "tlt/random.h"
#include "tlt/tree.h"
#include "tlt/verify.h"

namespace {

int failures = 0;

void expect(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "FAILED: %s\n", what);
    ++failures;
  }
}

struct Tree {
  std::vector<int64_t> tokens;
  std::vector<int32_t> parents;
  std::vector<int32_t> num_nodes;
};

Tree random_tree(std::mt19937& rng, int64_t batch, int64_t n, int64_t vocab) {
  Tree t{std::vector<int64_t>(batch * n), std::vector<int32_t>(batch * n), std::vector<int32_t>(batch)};
  for (int64_t b = 0; b < batch; ++b) {
    t.num_nodes[b] = 1 + static_cast<int32_t>(rng() % n);
    for (int64_t i = 0; i < n; ++i) {
      t.tokens[b * n + i] = static_cast<int64_t>(rng() % vocab);
      t.parents[b * n + i] = i == 0 ? -1 : static_cast<int32_t>(rng() % i);
    }
  }
  return t;
}

void run_verifiers(const std::vector<float>& logits, const std::vector<float>* q, const Tree& t,
                   int64_t batch, int64_t n, int64_t vocab, const std::vector<float>& uniforms,
                   std::vector<int32_t>& status) {
  std::vector<int32_t> accept(batch * n), num_accepted(batch);
  std::vector<int64_t> emitted(batch * n);
  std::vector<float> logprobs(batch * n);
  std::vector<float> temperature(batch), top_p(batch);
  std::vector<int32_t> top_k(batch);
  for (int64_t b = 0; b < batch; ++b) {
    temperature[b] = b % 3 == 0 ? 0.f : 0.5f + 0.25f * static_cast<float>(b % 4);
    top_k[b] = static_cast<int32_t>(b % 5);
    top_p[b] = b % 2 ? 0.9f : 1.f;
  }
  tlt::verify_tree_greedy_cpu(logits.data(), tlt::FloatType::kFloat32, t.tokens.data(),
                              t.parents.data(), t.num_nodes.data(), batch, n, vocab,
                              accept.data(), num_accepted.data(), emitted.data(), logprobs.data(),
                              status.data());
  tlt::verify_tree_sampling_cpu(logits.data(), tlt::FloatType::kFloat32, q ? q->data() : nullptr,
                                t.tokens.data(), t.parents.data(), t.num_nodes.data(),
                                temperature.data(), top_k.data(), top_p.data(), uniforms.data(),
                                batch, n, vocab, accept.data(), num_accepted.data(),
                                emitted.data(), logprobs.data(), status.data());
  for (int64_t b = 0; b < batch; ++b) {
    expect(num_accepted[b] >= 0 && num_accepted[b] < n, "num_accepted in [0, N)");
    std::vector<int32_t> scratch(batch);
    std::vector<float> cache(2 * batch * 3 * (n + 4) * 2, 1.f);
    std::vector<int32_t> cache_len(batch, 4);
    tlt::compact_kv_cpu(cache.data(), 2, batch, 3, n + 4, 2 * sizeof(float), cache_len.data(),
                        accept.data(), num_accepted.data(), n, scratch.data());
  }
}

}  // namespace

int main() {
  std::mt19937 rng(1234);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  for (int round = 0; round < 40; ++round) {
    const int64_t batch = 1 + rng() % 6, n = 1 + rng() % 40, vocab = 1 + rng() % 70;
    Tree t = random_tree(rng, batch, n, vocab);
    std::vector<float> logits(batch * n * vocab), q(batch * n * vocab), uniforms(batch * n);
    std::normal_distribution<float> normal;
    std::uniform_real_distribution<float> unit(0.f, 1.f);
    for (float& v : logits) v = normal(rng);
    for (int64_t row = 0; row < batch * n; ++row) {
      float sum = 0.f;
      for (int64_t x = 0; x < vocab; ++x) sum += (q[row * vocab + x] = unit(rng));
      for (int64_t x = 0; x < vocab; ++x) q[row * vocab + x] /= sum;
    }
    for (float& u : uniforms) u = unit(rng) * 0.999f;
    std::vector<int32_t> status(batch);
    run_verifiers(logits, nullptr, t, batch, n, vocab, uniforms, status);
    run_verifiers(logits, &q, t, batch, n, vocab, uniforms, status);

    // Malformed inputs: every row must come back flagged, never crash.
    switch (round % 6) {
      case 0: for (auto& tok : t.tokens) tok = -5 - static_cast<int64_t>(rng() % 1000000); break;
      case 1: for (auto& p : t.parents) p = static_cast<int32_t>(rng() % 100000) - 50000; break;
      case 2: for (float& v : logits) v = (rng() % 2) ? nan : inf; break;
      case 3: for (auto& m : t.num_nodes) m = static_cast<int32_t>(rng() % 3) * 100000 - 100000; break;
      case 4: for (float& u : uniforms) u = (rng() % 2) ? 7.f : -1.f; break;
      case 5: for (float& v : q) v = -v; break;
    }
    run_verifiers(logits, round % 6 == 5 ? &q : nullptr, t, batch, n, vocab, uniforms, status);

    // Tree kernels on random candidates, including broken parent links.
    const int64_t m = rng() % 60;
    std::vector<int64_t> cand_tokens(batch * m), roots(batch, 1), tokens(batch * n);
    std::vector<float> scores(batch * m);
    std::vector<int32_t> cand_parents(batch * m), parents(batch * n), source(batch * n),
        num_nodes(batch), depths(batch * n), mask(batch * n * tlt::mask_words(n)), cache_len(batch, 3);
    std::vector<int64_t> positions(batch * n);
    for (int64_t i = 0; i < batch * m; ++i) {
      cand_tokens[i] = rng() % 100;
      scores[i] = (rng() % 7 == 0) ? -inf : -unit(rng) * 5;
      const int64_t own = i % (m ? m : 1);
      cand_parents[i] = round % 2 ? static_cast<int32_t>(rng() % 200) - 100
                                  : (own == 0 ? -1 : static_cast<int32_t>(rng() % (own + 1)) - 1);
    }
    tlt::select_tree_cpu(cand_tokens.data(), scores.data(), cand_parents.data(), roots.data(), batch,
                         m, n, tokens.data(), parents.data(), source.data(), num_nodes.data(),
                         status.data());
    tlt::tree_metadata_cpu(parents.data(), num_nodes.data(), cache_len.data(), batch, n,
                           depths.data(), positions.data(), mask.data(), status.data());
    tlt::tree_metadata_cpu(t.parents.data(), t.num_nodes.data(), nullptr, batch, n, depths.data(),
                           positions.data(), mask.data(), status.data());
    std::vector<int64_t> seeds(batch, round), offsets(batch, -round);
    tlt::philox_uniforms_cpu(seeds.data(), offsets.data(), batch, n, uniforms.data());
  }
  bool threw = false;
  try {
    tlt::verify_tree_greedy_cpu(nullptr, tlt::FloatType::kFloat32, nullptr, nullptr, nullptr, 1,
                                0, 10, nullptr, nullptr, nullptr, nullptr, nullptr);
  } catch (const std::invalid_argument&) {
    threw = true;
  }
  expect(threw, "N = 0 is rejected on the host");
  std::printf("%d passed, %d failed\n", failures ? 0 : 1, failures ? 1 : 0);
  return failures ? 1 : 0;
}
