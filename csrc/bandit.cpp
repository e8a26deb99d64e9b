#include "tlt/bandit.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>

namespace tlt {

namespace {

constexpr char kMagic[8] = {'T', 'L', 'T', 'B', 'A', 'N', 'D', '1'};

template <typename T>
void put(std::string& out, const T& value) {
  out.append(reinterpret_cast<const char*>(&value), sizeof(T));
}

// Reads sequentially from a state string; throws on a short read.
class Reader {
 public:
  explicit Reader(const std::string& bytes) : bytes_(bytes) {}
  template <typename T>
  T get() {
    if (offset_ + sizeof(T) > bytes_.size())
      throw std::invalid_argument("state: truncated bandit state");
    T value;
    std::memcpy(&value, bytes_.data() + offset_, sizeof(T));
    offset_ += sizeof(T);
    return value;
  }
  bool done() const { return offset_ == bytes_.size(); }

 private:
  const std::string& bytes_;
  size_t offset_ = 0;
};

}  // namespace

BucketBandit::BucketBandit(BanditConfig config) : config_(std::move(config)) {
  if (config_.bucket_edges.empty())
    throw std::invalid_argument("bucket_edges: need at least one bucket");
  for (size_t i = 0; i < config_.bucket_edges.size(); ++i) {
    if (config_.bucket_edges[i] < 1)
      throw std::invalid_argument("bucket_edges: edges must be >= 1");
    if (i > 0 && config_.bucket_edges[i] <= config_.bucket_edges[i - 1])
      throw std::invalid_argument("bucket_edges: edges must be strictly increasing");
  }
  if (config_.num_arms < 1) throw std::invalid_argument("num_arms: must be >= 1");
  if (!(config_.epsilon >= 0 && config_.epsilon <= 1))
    throw std::invalid_argument("epsilon: must be in [0, 1]");
  if (config_.window < 1) throw std::invalid_argument("window: must be >= 1");
  if (!(config_.prior_weight >= 0 && std::isfinite(config_.prior_weight)))
    throw std::invalid_argument("prior_weight: must be finite and >= 0");
  cells_.resize(config_.bucket_edges.size() * static_cast<size_t>(config_.num_arms));
  for (Cell& c : cells_) c.rewards.assign(static_cast<size_t>(config_.window), 0.0);
  state_ = config_.seed;
}

int32_t BucketBandit::bucket(int32_t batch) const {
  if (batch < 1) throw std::invalid_argument("batch: must be >= 1");
  const auto& edges = config_.bucket_edges;
  for (size_t i = 0; i < edges.size(); ++i)
    if (batch <= edges[i]) return static_cast<int32_t>(i);
  return static_cast<int32_t>(edges.size()) - 1;
}

void BucketBandit::check_arm(int32_t arm) const {
  if (arm < 0 || arm >= config_.num_arms)
    throw std::invalid_argument("arm: must be in [0, num_arms)");
}

void BucketBandit::check_bucket(int32_t bucket) const {
  if (bucket < 0 || bucket >= num_buckets())
    throw std::invalid_argument("bucket: must be in [0, num_buckets)");
}

BucketBandit::Cell& BucketBandit::cell(int32_t bucket, int32_t arm) {
  return cells_[static_cast<size_t>(bucket) * config_.num_arms + arm];
}
const BucketBandit::Cell& BucketBandit::cell(int32_t bucket, int32_t arm) const {
  return cells_[static_cast<size_t>(bucket) * config_.num_arms + arm];
}

void BucketBandit::set_prior(int32_t bucket, int32_t arm, double reward) {
  check_bucket(bucket);
  check_arm(arm);
  if (!std::isfinite(reward)) throw std::invalid_argument("reward: prior must be finite");
  Cell& c = cell(bucket, arm);
  c.has_prior = true;
  c.prior = reward;
}

double BucketBandit::estimate(int32_t bucket, int32_t arm) const {
  check_bucket(bucket);
  check_arm(arm);
  const Cell& c = cell(bucket, arm);
  const double weight = c.has_prior ? config_.prior_weight : 0.0;
  const double total = weight + c.count;
  if (total == 0) return std::numeric_limits<double>::quiet_NaN();
  return ((c.has_prior ? c.prior * weight : 0.0) + c.sum) / total;
}

int32_t BucketBandit::observations(int32_t bucket, int32_t arm) const {
  check_bucket(bucket);
  check_arm(arm);
  return cell(bucket, arm).count;
}

int32_t BucketBandit::best(int32_t batch) const {
  const int32_t b = bucket(batch);
  // An arm never tried and without a prior is tried first: its estimate is unknown, not bad.
  for (int32_t arm = 0; arm < config_.num_arms; ++arm)
    if (std::isnan(estimate(b, arm))) return arm;
  int32_t chosen = 0;
  for (int32_t arm = 1; arm < config_.num_arms; ++arm)
    if (estimate(b, arm) > estimate(b, chosen)) chosen = arm;
  return chosen;
}

int32_t BucketBandit::select(int32_t batch) {
  const int32_t greedy = best(batch);  // validates batch before any draw
  if (config_.epsilon > 0 && uniform() < config_.epsilon) {
    ++explorations_;
    return static_cast<int32_t>(next_random() % static_cast<uint64_t>(config_.num_arms));
  }
  return greedy;
}

void BucketBandit::update(int32_t batch, int32_t arm, double reward) {
  check_arm(arm);
  if (!std::isfinite(reward)) throw std::invalid_argument("reward: must be finite");
  Cell& c = cell(bucket(batch), arm);
  if (c.count == config_.window) {
    c.sum -= c.rewards[c.next];
  } else {
    ++c.count;
  }
  c.rewards[c.next] = reward;
  c.sum += reward;
  c.next = (c.next + 1) % config_.window;
  // Recompute the sum from the window now and then, so rounding error cannot accumulate over
  // a long run of add-and-subtract.
  if (c.next == 0) {
    c.sum = 0;
    for (int32_t i = 0; i < c.count; ++i) c.sum += c.rewards[i];
  }
}

uint64_t BucketBandit::next_random() {  // SplitMix64
  uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

double BucketBandit::uniform() { return (next_random() >> 11) * 0x1.0p-53; }

std::string BucketBandit::save_state() const {
  std::string out(kMagic, sizeof(kMagic));
  put(out, static_cast<int32_t>(config_.bucket_edges.size()));
  for (int32_t edge : config_.bucket_edges) put(out, edge);
  put(out, config_.num_arms);
  put(out, config_.window);
  put(out, config_.epsilon);
  put(out, config_.prior_weight);
  put(out, state_);
  put(out, explorations_);
  for (const Cell& c : cells_) {
    put(out, static_cast<uint8_t>(c.has_prior));
    put(out, c.prior);
    put(out, c.next);
    put(out, c.count);
    for (double r : c.rewards) put(out, r);
  }
  return out;
}

void BucketBandit::load_state(const std::string& bytes) {
  if (bytes.size() < sizeof(kMagic) || std::memcmp(bytes.data(), kMagic, sizeof(kMagic)) != 0)
    throw std::invalid_argument("state: not a tlt bandit state");
  Reader in(bytes);
  for (size_t i = 0; i < sizeof(kMagic); ++i) in.get<char>();
  const auto buckets = in.get<int32_t>();
  if (buckets != num_buckets())
    throw std::invalid_argument("state: saved with other bucket_edges");
  for (int32_t i = 0; i < buckets; ++i)
    if (in.get<int32_t>() != config_.bucket_edges[i])
      throw std::invalid_argument("state: saved with other bucket_edges");
  if (in.get<int32_t>() != config_.num_arms)
    throw std::invalid_argument("state: saved with another num_arms");
  if (in.get<int32_t>() != config_.window)
    throw std::invalid_argument("state: saved with another window");
  const double epsilon = in.get<double>();
  const double prior_weight = in.get<double>();
  const uint64_t stream = in.get<uint64_t>();
  const int64_t explorations = in.get<int64_t>();
  std::vector<Cell> cells(cells_.size());
  for (Cell& c : cells) {
    c.has_prior = in.get<uint8_t>() != 0;
    c.prior = in.get<double>();
    c.next = in.get<int32_t>();
    c.count = in.get<int32_t>();
    if (c.next < 0 || c.next >= config_.window || c.count < 0 || c.count > config_.window)
      throw std::invalid_argument("state: corrupt bandit window");
    c.rewards.resize(static_cast<size_t>(config_.window));
    for (double& r : c.rewards) r = in.get<double>();
    for (int32_t i = 0; i < c.count; ++i) c.sum += c.rewards[i];
  }
  if (!in.done()) throw std::invalid_argument("state: trailing bytes after bandit state");
  // Committed only once everything parsed: a bad state leaves this bandit as it was.
  config_.epsilon = epsilon;
  config_.prior_weight = prior_weight;
  state_ = stream;
  explorations_ = explorations;
  cells_ = std::move(cells);
}

}  // namespace tlt
