// Idle detection for spot training: is this worker's accelerator free right now?
//
// Two signals, combined and debounced:
// - the engine's own: does the worker still have requests running or waiting? Work arriving
//   makes the worker busy at once (a spot trainer must yield within one training step);
// - device utilization from NVML (percent of time a kernel ran in the last sample period),
//   loaded at run time with dlopen, so nothing links against NVML and a machine without a GPU
//   driver still runs (the engine's signal alone then decides).
// The worker becomes idle only after both have been quiet (no engine work, utilization unknown
// or at most the threshold) for idle_after_s without a break: a momentary dip between two
// decode steps is not idleness.
#pragma once

#include <cstdint>
#include <string>

namespace tlt {

enum class WorkerState : int32_t { kBusy = 0, kIdle = 1 };

struct IdleConfig {
  double utilization_threshold = 10.0;  // percent; above it the device counts as in use
  double idle_after_s = 0.5;            // quiet this long, without a break, before idle
};

class IdleStateMachine {
 public:
  // Throws std::invalid_argument for a negative threshold or debounce time.
  explicit IdleStateMachine(IdleConfig config);

  // One observation at time now_s (seconds, non-decreasing; throws std::invalid_argument if it
  // goes back). utilization: percent, or < 0 when unknown (no NVML). Returns the new state.
  WorkerState update(double now_s, double utilization, bool engine_has_work);

  WorkerState state() const { return state_; }
  int64_t transitions() const { return transitions_; }  // busy->idle and idle->busy changes
  double last_change_s() const { return last_change_s_; }

 private:
  IdleConfig config_;
  WorkerState state_ = WorkerState::kBusy;
  bool quiet_ = false;        // the current run of observations is quiet
  double quiet_since_s_ = 0;  // when that run began
  double last_now_s_ = -1e300;
  double last_change_s_ = 0;
  int64_t transitions_ = 0;
};

// NVML, resolved with dlopen at construction. Never throws: available() says whether it loaded
// and initialised, error() why not.
class NvmlProbe {
 public:
  explicit NvmlProbe(const std::string& library = "libnvidia-ml.so.1");
  ~NvmlProbe();
  NvmlProbe(const NvmlProbe&) = delete;
  NvmlProbe& operator=(const NvmlProbe&) = delete;

  bool available() const { return available_; }
  const std::string& error() const { return error_; }
  int32_t device_count() const;
  // GPU utilization percent of device `index` over NVML's last sample period; -1 on failure.
  int32_t utilization(int32_t index) const;
  // NVML's index of the device with this UUID ("GPU-..."), -1 if none. NVML numbers every
  // device on the machine whatever CUDA_VISIBLE_DEVICES says, so a rank finds its own GPU by
  // UUID, never by its CUDA index.
  int32_t index_of_uuid(const std::string& uuid) const;

 private:
  void* library_ = nullptr;
  bool available_ = false;
  std::string error_;
  // NVML entry points (C ABI: int nvmlReturn_t, opaque device handle pointer).
  int (*init_)() = nullptr;
  int (*shutdown_)() = nullptr;
  int (*count_)(unsigned int*) = nullptr;
  int (*handle_)(unsigned int, void**) = nullptr;
  int (*rates_)(void*, unsigned int*) = nullptr;  // nvmlUtilization_t {gpu, memory}
  int (*by_uuid_)(const char*, void**) = nullptr;  // nvmlDeviceGetHandleByUUID
  int (*index_)(void*, unsigned int*) = nullptr;   // nvmlDeviceGetIndex
};

}  // namespace tlt
