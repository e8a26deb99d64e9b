// Row parallelism for the CPU kernels.
//
// Why not OpenMP: an OpenMP team waits at its closing barrier for every thread, so on a shared
// machine one worker that the OS schedules late stalls the whole kernel (we measured ~8 ms for
// a 16-number kernel on a busy 2-core box), and torch wheels bundle their own libgomp, so two
// OpenMP runtimes compete for the same cores. Here rows are claimed one at a time from an
// atomic counter: the caller works too and only waits for rows a worker actually claimed, so a
// late worker costs nothing.
#pragma once

#include <cstdint>
#include <functional>

namespace tlt::cpu {

// Runs body(i) for every i in [0, n) on the calling thread and the pool's workers. body must
// not throw. Threads in all: TLT_NUM_THREADS, else OMP_NUM_THREADS, else the hardware's.
void parallel_for(int64_t n, const std::function<void(int64_t)>& body);

}  // namespace tlt::cpu
