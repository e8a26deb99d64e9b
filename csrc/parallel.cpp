// Implementation of parallel.h: a lazily started pool of worker threads that help with
// whichever job was published last.
#include "parallel.h"

#include <dlfcn.h>
#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <exception>
#include <memory>
#include <mutex>
#include <system_error>
#include <thread>
#include <vector>

namespace tlt::cpu {
namespace {

struct Job {
  explicit Job(int64_t n, const std::function<void(int64_t)>& body) : n(n), body(body) {}
  const int64_t n;
  const std::function<void(int64_t)>& body;  // valid while claimed rows remain unfinished
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};  // rows finished: run, failed or skipped after a failure
  std::atomic<bool> failed{false};
  std::mutex mutex;
  std::condition_variable finished;
  std::exception_ptr error;  // the first row's exception; guarded by `mutex`

  // Claims and runs rows until none are left. Never throws: a worker thread that let an
  // exception escape would end the process in std::terminate.
  void work() {
    for (int64_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) {
      if (!failed.load()) {
        try {
          body(i);
        } catch (...) {
          record(std::current_exception());
        }
      }
      if (done.fetch_add(1) + 1 == n) {
        std::lock_guard<std::mutex> lock(mutex);
        finished.notify_all();
      }
    }
  }

  // Waits until every row is finished (so no thread still uses `body`), then rethrows the
  // first row's exception, if any.
  void wait_and_rethrow() {
    std::unique_lock<std::mutex> lock(mutex);
    finished.wait(lock, [&] { return done.load() == n; });
    if (error) std::rethrow_exception(error);
  }

 private:
  void record(std::exception_ptr exception) {
    std::lock_guard<std::mutex> lock(mutex);
    if (!error) error = std::move(exception);
    failed.store(true);
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

// Never destroyed (see `current` below), so the workers loop until the process ends.
class Pool {
 public:
  explicit Pool(int workers) {
    threads_.reserve(workers);  // so only the thread's creation can throw below
    for (int w = 0; w < workers; ++w) {
      try {
        threads_.emplace_back([this] { loop(); });
      } catch (const std::system_error&) {
        break;  // the OS refused the thread (RLIMIT_NPROC, no memory for its stack)
      }
    }
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
  [[noreturn]] void loop() {
    uint64_t seen = 0;
    for (;;) {
      std::shared_ptr<Job> job;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return generation_ != seen; });
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
};

// The process's pool, started on first use. It is never destroyed: joining the workers at exit
// could wait for a kernel that a daemon thread is still running, and the OS ends them anyway.
//
// fork() copies only the forking thread, so a child must not use its parent's pool: its
// workers are gone and its mutex and condition variable may be in the middle of another
// thread's operation. The fork handlers below hold `start_mutex` across fork() (so no thread is
// half-way through starting a pool) and give the child no pool at all: its first kernel starts
// a fresh one. The parent's pool object is left to leak in the child; destroying it would join
// threads that do not exist there.
std::mutex start_mutex;
std::atomic<Pool*> current{nullptr};
bool fork_handlers_registered = false;  // guarded by start_mutex; a child inherits the handlers

void before_fork() { start_mutex.lock(); }
void after_fork_in_parent() { start_mutex.unlock(); }
void after_fork_in_child() {
  current.store(nullptr);
  start_mutex.unlock();  // held by this thread, the only one the child has
}

Pool& pool() {
  if (Pool* started = current.load()) return *started;
  std::lock_guard<std::mutex> lock(start_mutex);
  if (!fork_handlers_registered) {
    if (const int err = pthread_atfork(before_fork, after_fork_in_parent, after_fork_in_child))
      throw std::system_error(err, std::generic_category(), "tlt thread pool: pthread_atfork");
    fork_handlers_registered = true;
  }
  Pool* started = current.load();
  if (!started) {
    started = new Pool(configured_threads() - 1);
    current.store(started);
  }
  return *started;
}

// libgomp's entry for `#pragma omp parallel` (its public ABI): runs fn(data) on a team of the
// calling thread's default size, the caller included, and returns when every member is done.
using GompParallel = void (*)(void (*fn)(void*), void* data, unsigned num_threads,
                              unsigned flags);

// `name` in the libgomp this process has already loaded, or null (cached in `found`).
// RTLD_NOLOAD: never loads one of our own (a second OpenMP runtime is what parallel.h avoids).
// A miss is not cached: PyTorch may load it later.
template <typename Entry>
Entry loaded_gomp(const char* name, std::atomic<Entry>& found) {
  if (Entry entry = found.load()) return entry;
  void* library = dlopen("libgomp.so.1", RTLD_NOW | RTLD_NOLOAD);
  if (library == nullptr) return nullptr;
  auto entry = reinterpret_cast<Entry>(dlsym(library, name));
  found.store(entry);
  return entry;  // the handle stays open: the library is in use for the process's life anyway
}

GompParallel loaded_gomp_parallel() {
  static std::atomic<GompParallel> found{nullptr};
  return loaded_gomp("GOMP_parallel", found);
}

using GompMaxThreads = int (*)();

}  // namespace

int openmp_team_size() {
  static std::atomic<GompMaxThreads> found{nullptr};
  const GompMaxThreads max_threads =
      loaded_gomp_parallel() == nullptr ? nullptr : loaded_gomp("omp_get_max_threads", found);
  return max_threads == nullptr ? configured_threads() : std::max(1, max_threads());
}

void parallel_for_on_openmp_team(int64_t n, const std::function<void(int64_t)>& body) {
  const GompParallel gomp = n > 1 ? loaded_gomp_parallel() : nullptr;
  if (gomp == nullptr) {
    parallel_for(n, body);
    return;
  }
  Job job(n, body);
  gomp([](void* data) { static_cast<Job*>(data)->work(); }, &job, 0, 0);
  job.wait_and_rethrow();  // every row is done (the team has joined); rethrows a row's error
}

void parallel_for(int64_t n, const std::function<void(int64_t)>& body) {
  if (n <= 0) return;
  if (n == 1 || !pool().has_workers()) {
    for (int64_t i = 0; i < n; ++i) body(i);
    return;
  }
  auto job = std::make_shared<Job>(n, body);
  pool().publish(job);
  job->work();
  job->wait_and_rethrow();
}

}  // namespace tlt::cpu
