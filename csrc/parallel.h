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

// Runs body(i) for every i in [0, n) on the calling thread and the pool's workers. Threads in
// all: TLT_NUM_THREADS, else OMP_NUM_THREADS, else the hardware's.
//
// If body throws (std::bad_alloc from a row's scratch, say), rows not yet started are skipped,
// parallel_for waits for the rows already running and rethrows the first exception on the
// calling thread, so a binding can turn it into a Python exception instead of std::terminate.
//
// The pool starts on first use. Where the OS refuses a worker thread, the pool keeps the ones it
// got (possibly none: the caller then runs every row), so a thread limit slows kernels down but
// never fails them. A forked child starts a fresh pool on its first call: the parent's workers
// do not exist there.
void parallel_for(int64_t n, const std::function<void(int64_t)>& body);

// parallel_for on the OpenMP team of the libgomp this process has already loaded (PyTorch's CPU
// build brings one), where there is one; else parallel_for itself. For kernels called between
// PyTorch ops in a decode step: PyTorch's OpenMP workers spin for a while after each op, so a
// worker of our pool competes with them for the same cores (the panel products of a SmolLM2
// step ran 1.4x slower that way on 2 cores). Rows are claimed one at a time as in parallel_for;
// the call returns once the whole team is done (its closing barrier), as PyTorch's ops do.
// Exceptions as in parallel_for.
void parallel_for_on_openmp_team(int64_t n, const std::function<void(int64_t)>& body);

// The threads parallel_for_on_openmp_team runs a call on, the caller included: the OpenMP
// team's default size, or parallel_for's thread count where no libgomp is loaded.
int openmp_team_size();

}  // namespace tlt::cpu
