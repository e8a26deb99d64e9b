// Implementation of parallel.h: a lazily started pool of worker threads that help with
// whichever job was published last.
#include "parallel.h"

#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace tlt::cpu {
namespace {

struct Job {
  explicit Job(int64_t n, const std::function<void(int64_t)>& body) : n(n), body(body) {}
  const int64_t n;
  const std::function<void(int64_t)>& body;  // valid while claimed rows remain unfinished
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  std::mutex mutex;
  std::condition_variable finished;

  // Claims and runs rows until none are left.
  void work() {
    for (int64_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) {
      body(i);
      if (done.fetch_add(1) + 1 == n) {
        std::lock_guard<std::mutex> lock(mutex);
        finished.notify_all();
      }
    }
  }
};

int configured_threads() {
  for (const char* name : {"TLT_NUM_THREADS", "OMP_NUM_THREADS"}) {
    if (const char* value = std::getenv(name)) {
      const int threads = std::atoi(value);
      if (threads >= 1) return threads;
    }
  }
  const unsigned hardware = std::thread::hardware_concurrency();
  return hardware == 0 ? 1 : static_cast<int>(hardware);
}

class Pool {
 public:
  explicit Pool(int workers) {
    for (int w = 0; w < workers; ++w) threads_.emplace_back([this] { loop(); });
  }
  ~Pool() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    wake_.notify_all();
    for (std::thread& thread : threads_) thread.join();
  }
  bool has_workers() const { return !threads_.empty(); }

  void publish(const std::shared_ptr<Job>& job) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      job_ = job;
      ++generation_;
    }
    wake_.notify_all();
  }

 private:
  void loop() {
    uint64_t seen = 0;
    for (;;) {
      std::shared_ptr<Job> job;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return stopping_ || generation_ != seen; });
        if (stopping_) return;
        seen = generation_;
        job = job_;
      }
      job->work();
    }
  }

  std::vector<std::thread> threads_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::shared_ptr<Job> job_;
  uint64_t generation_ = 0;
  bool stopping_ = false;
};

Pool& pool() {
  static Pool instance(configured_threads() - 1);
  return instance;
}

}  // namespace

void parallel_for(int64_t n, const std::function<void(int64_t)>& body) {
  if (n <= 0) return;
  if (n == 1 || !pool().has_workers()) {
    for (int64_t i = 0; i < n; ++i) body(i);
    return;
  }
  auto job = std::make_shared<Job>(n, body);
  pool().publish(job);
  job->work();
  std::unique_lock<std::mutex> lock(job->mutex);
  job->finished.wait(lock, [&] { return job->done.load() == n; });
}

}  // namespace tlt::cpu
