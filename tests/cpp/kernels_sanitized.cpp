// Runs every CPU kernel on valid, edge-case and malformed inputs under AddressSanitizer and
// UndefinedBehaviorSanitizer (built by .ci/run with TLT_SANITIZE=ON). The Python tests check
// values; this checks that no input, however bad, makes a kernel read or write out of bounds,
// and that the thread pool under the kernels survives an empty batch, rows that throw and fork.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <new>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "parallel.h"
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

// B = 0 with every pointer null: each entry point returns without reading one.
void check_empty_batch() {
  const int64_t n = 4, vocab = 16;
  tlt::select_tree_cpu(nullptr, nullptr, nullptr, nullptr, 0, 5, n, nullptr, nullptr, nullptr,
                       nullptr, nullptr);
  tlt::tree_metadata_cpu(nullptr, nullptr, nullptr, 0, n, nullptr, nullptr, nullptr, nullptr);
  for (const auto type : {tlt::FloatType::kFloat32, tlt::FloatType::kFloat16,
                          tlt::FloatType::kBFloat16}) {
    tlt::verify_tree_greedy_cpu(nullptr, type, nullptr, nullptr, nullptr, 0, n, vocab, nullptr,
                                nullptr, nullptr, nullptr, nullptr);
    tlt::verify_tree_sampling_cpu(nullptr, type, nullptr, nullptr, nullptr, nullptr, nullptr,
                                  nullptr, nullptr, nullptr, 0, n, vocab, nullptr, nullptr,
                                  nullptr, nullptr, nullptr);
  }
  tlt::compact_kv_cpu(nullptr, 2, 0, 3, 8, 4, nullptr, nullptr, nullptr, n, nullptr);
  tlt::philox_uniforms_cpu(nullptr, nullptr, 0, 7, nullptr);
}

// A type code outside FloatType is rejected on the host, before any row reads logits.
void check_bad_float_type() {
  const int64_t batch = 8, n = 2, vocab = 4;
  std::vector<float> logits(batch * n * vocab);
  std::vector<int64_t> tokens(batch * n), emitted(batch * n);
  std::vector<int32_t> parents(batch * n, 0), accept(batch * n), num_accepted(batch),
      status(batch);
  std::vector<float> logprobs(batch * n);
  for (const int32_t code : {-1, 3, 1 << 30}) {
    bool threw = false;
    try {
      tlt::verify_tree_greedy_cpu(logits.data(), static_cast<tlt::FloatType>(code),
                                  tokens.data(), parents.data(), nullptr, batch, n, vocab,
                                  accept.data(), num_accepted.data(), emitted.data(),
                                  logprobs.data(), status.data());
    } catch (const std::invalid_argument&) {
      threw = true;
    }
    expect(threw, "a bad logits_type is rejected with std::invalid_argument");
  }
}

// A row's exception, thrown on whichever thread ran it, reaches the caller; the pool then runs
// every row of the next job exactly once.
template <typename Exception>
void check_row_exception_reaches_caller(int64_t failing_row) {
  const int64_t rows = 64;
  bool caught = false;
  try {
    tlt::cpu::parallel_for(rows, [&](int64_t i) {
      std::this_thread::yield();  // let the workers claim rows too
      if (i != failing_row) return;
      if constexpr (std::is_default_constructible_v<Exception>) throw Exception();
      else throw Exception("row " + std::to_string(i));
    });
  } catch (const Exception&) {
    caught = true;
  }
  expect(caught, "a row's exception is rethrown on the calling thread");
  std::vector<std::atomic<int>> runs(rows);
  tlt::cpu::parallel_for(rows, [&](int64_t i) { runs[i].fetch_add(1); });
  bool once = true;
  for (const auto& count : runs) once &= count.load() == 1;
  expect(once, "after a failed job, every row of the next one runs exactly once");
}

int count_rows(int64_t rows) {
  std::atomic<int> ran{0};
  tlt::cpu::parallel_for(rows, [&](int64_t) { ran.fetch_add(1); });
  return ran.load();
}

// Children forked while other threads keep the pool busy run their kernels to the end (an
// alarm kills one that hangs).
void check_fork_while_pool_busy() {
  std::atomic<bool> stop{false};
  std::atomic<int> wrong{0};
  std::vector<std::thread> busy;
  for (int t = 0; t < 2; ++t)
    busy.emplace_back([&] {
      while (!stop.load())
        if (count_rows(32) != 32) wrong.fetch_add(1);
    });
  std::vector<pid_t> children;
  for (int c = 0; c < 50; ++c) {
    const pid_t pid = fork();
    if (pid == 0) {
      alarm(30);
      _exit(count_rows(32) == 32 && count_rows(5) == 5 ? 0 : 1);
    }
    if (pid > 0) children.push_back(pid);
  }
  stop.store(true);
  for (std::thread& thread : busy) thread.join();
  expect(children.size() == 50, "fork succeeded");
  int failed = 0;
  for (const pid_t pid : children) {
    int status = 0;
    if (waitpid(pid, &status, 0) != pid || !WIFEXITED(status) || WEXITSTATUS(status) != 0)
      ++failed;
  }
  expect(failed == 0, "every forked child finishes its kernels");
  expect(wrong.load() == 0, "the parent's rows all ran while it forked");
}

}  // namespace

int main() {
  setenv("TLT_NUM_THREADS", "4", 1);  // workers even on a one-core machine
  check_empty_batch();
  check_bad_float_type();
  check_row_exception_reaches_caller<std::bad_alloc>(0);
  check_row_exception_reaches_caller<std::invalid_argument>(37);
  check_fork_while_pool_busy();
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
