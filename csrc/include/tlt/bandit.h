// Strategy selection per batch-size bucket: a bucketed epsilon-greedy bandit (BEG-MAB) over a
// sliding window, its arms seeded with priors (a cost model's predictions).
//
// The reward of an arm is whatever the caller measures for one step with it (the rollout loop
// uses emitted tokens per second). Each batch-size bucket learns on its own, because the best
// draft shape at batch 1 is not the best at batch 16. Per (bucket, arm) the bandit keeps the
// last `window` rewards; its estimate is
//     (prior * prior_weight + sum of the window) / (prior_weight + rewards in the window),
// so a prior counts as prior_weight observations and fades as real ones arrive, and a sliding
// window follows a reward that drifts (the drafter improving, the sequences growing).
// select(): with probability epsilon a uniformly random arm (exploration), else the arm with
// the highest estimate (lowest index on ties). Randomness is this object's own SplitMix64
// stream, so a run is reproducible and the stream is part of the saved state.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace tlt {

struct BanditConfig {
  // Upper edges of the buckets, strictly increasing: batch b falls in the first bucket whose
  // edge is >= b; batches above the last edge fall in the last bucket.
  std::vector<int32_t> bucket_edges;
  int32_t num_arms = 0;
  double epsilon = 0.1;       // exploration probability, in [0, 1]
  int32_t window = 32;        // rewards kept per (bucket, arm), >= 1
  double prior_weight = 2.0;  // pseudo-observations a prior counts as, >= 0
  uint64_t seed = 0;
};

class BucketBandit {
 public:
  // Throws std::invalid_argument on a bad config (names the field).
  explicit BucketBandit(BanditConfig config);

  int32_t bucket(int32_t batch) const;  // throws for batch < 1
  int32_t num_buckets() const { return static_cast<int32_t>(config_.bucket_edges.size()); }
  const BanditConfig& config() const { return config_; }

  void set_prior(int32_t bucket, int32_t arm, double reward);
  int32_t select(int32_t batch);                  // draws from the stream
  int32_t best(int32_t batch) const;              // greedy choice, no draw
  void update(int32_t batch, int32_t arm, double reward);  // throws on non-finite reward
  double estimate(int32_t bucket, int32_t arm) const;  // NaN with no prior and no reward
  int32_t observations(int32_t bucket, int32_t arm) const;  // rewards in the window
  int64_t explorations() const { return explorations_; }

  // The whole state (config, priors, windows, stream position) as bytes, and back. load_state
  // throws std::invalid_argument on bytes that are not a state or were saved under another
  // config (bucket edges, arms, window).
  std::string save_state() const;
  void load_state(const std::string& bytes);

 private:
  struct Cell {
    bool has_prior = false;
    double prior = 0;
    std::vector<double> rewards;  // ring buffer, capacity window
    int32_t next = 0;             // where the next reward goes
    int32_t count = 0;            // rewards held (<= window)
    double sum = 0;
  };
  Cell& cell(int32_t bucket, int32_t arm);
  const Cell& cell(int32_t bucket, int32_t arm) const;
  void check_arm(int32_t arm) const;
  void check_bucket(int32_t bucket) const;
  uint64_t next_random();
  double uniform();  // [0, 1)

  BanditConfig config_;
  std::vector<Cell> cells_;  // bucket-major
  uint64_t state_;
  int64_t explorations_ = 0;
};

}  // namespace tlt
