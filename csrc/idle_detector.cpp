// The idle state machine and the run-time NVML loader of tlt/idle.h.
#include "tlt/idle.h"

#include <dlfcn.h>

#include <cmath>
#include <stdexcept>

namespace tlt {

IdleStateMachine::IdleStateMachine(IdleConfig config) : config_(config) {
  if (!(config.utilization_threshold >= 0) || !std::isfinite(config.utilization_threshold))
    throw std::invalid_argument("utilization_threshold: must be a finite number >= 0");
  if (!(config.idle_after_s >= 0) || !std::isfinite(config.idle_after_s))
    throw std::invalid_argument("idle_after_s: must be a finite number >= 0");
}

WorkerState IdleStateMachine::update(double now_s, double utilization, bool engine_has_work) {
  if (!std::isfinite(now_s) || now_s < last_now_s_)
    throw std::invalid_argument("now_s: observation times must be finite and non-decreasing");
  last_now_s_ = now_s;
  WorkerState next = state_;
  const bool device_quiet = utilization < 0 || utilization <= config_.utilization_threshold;
  if (engine_has_work || !device_quiet) {
    quiet_ = false;
    // Work arriving preempts at once; a busy device with no engine work (other kernels still
    // draining) only delays idleness, it does not end an idle period by itself.
    if (engine_has_work) next = WorkerState::kBusy;
  } else {
    if (!quiet_) {
      quiet_ = true;
      quiet_since_s_ = now_s;
    }
    if (now_s - quiet_since_s_ >= config_.idle_after_s) next = WorkerState::kIdle;
  }
  if (next != state_) {
    state_ = next;
    last_change_s_ = now_s;
    ++transitions_;
  }
  return state_;
}

namespace {
constexpr int kNvmlSuccess = 0;

template <typename Fn>
Fn symbol(void* library, const char* name) {
  return reinterpret_cast<Fn>(dlsym(library, name));
}
}  // namespace

NvmlProbe::NvmlProbe(const std::string& library) {
  library_ = dlopen(library.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (library_ == nullptr) {
    const char* why = dlerror();
    error_ = "cannot load " + library + (why ? std::string(": ") + why : std::string());
    return;
  }
  init_ = symbol<int (*)()>(library_, "nvmlInit_v2");
  shutdown_ = symbol<int (*)()>(library_, "nvmlShutdown");
  count_ = symbol<int (*)(unsigned int*)>(library_, "nvmlDeviceGetCount_v2");
  handle_ = symbol<int (*)(unsigned int, void**)>(library_, "nvmlDeviceGetHandleByIndex_v2");
  rates_ = symbol<int (*)(void*, unsigned int*)>(library_, "nvmlDeviceGetUtilizationRates");
  by_uuid_ = symbol<int (*)(const char*, void**)>(library_, "nvmlDeviceGetHandleByUUID");
  index_ = symbol<int (*)(void*, unsigned int*)>(library_, "nvmlDeviceGetIndex");
  if (!init_ || !shutdown_ || !count_ || !handle_ || !rates_ || !by_uuid_ || !index_) {
    error_ = library + " lacks an NVML entry point this probe needs";
    dlclose(library_);
    library_ = nullptr;
    return;
  }
  const int status = init_();
  if (status != kNvmlSuccess) {
    error_ = "nvmlInit_v2 failed with NVML error " + std::to_string(status) +
             " (no driver, or no permission)";
    dlclose(library_);
    library_ = nullptr;
    return;
  }
  available_ = true;
}

NvmlProbe::~NvmlProbe() {
  if (available_) shutdown_();
  if (library_ != nullptr) dlclose(library_);
}

int32_t NvmlProbe::device_count() const {
  unsigned int count = 0;
  if (!available_ || count_(&count) != kNvmlSuccess) return 0;
  return static_cast<int32_t>(count);
}

int32_t NvmlProbe::utilization(int32_t index) const {
  if (!available_ || index < 0) return -1;
  void* device = nullptr;
  if (handle_(static_cast<unsigned int>(index), &device) != kNvmlSuccess) return -1;
  unsigned int rates[2] = {0, 0};  // nvmlUtilization_t: gpu, memory
  if (rates_(device, rates) != kNvmlSuccess) return -1;
  return static_cast<int32_t>(rates[0]);
}

int32_t NvmlProbe::index_of_uuid(const std::string& uuid) const {
  if (!available_) return -1;
  void* device = nullptr;
  if (by_uuid_(uuid.c_str(), &device) != kNvmlSuccess) return -1;
  unsigned int index = 0;
  if (index_(device, &index) != kNvmlSuccess) return -1;
  return static_cast<int32_t>(index);
}

}  // namespace tlt
