// CPU implementation of panel_matmul.h. A micro-kernel (vector_block) multiplies up to kRowGroup
// rows by one to four adjacent panels, or up to kTallRows rows down one panel: at most 12
// accumulators, two loads per panel and one broadcast per row each k, within AVX2's 16 vector
// registers. Rows beyond a group rerun the task's panels, now in L2, so only the first group
// reads them from memory. One template serves both element types: a bfloat16 weight widens to
// float32 as it is loaded (a shift), so the arithmetic, and every bit of the sums, is the float32
// kernel's.
#include "tlt/panel_matmul.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu_common.h"
#include "panel_common.h"
#include "parallel.h"
#include "vector_bf16.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define TLT_PANEL_X86 1
#endif

namespace tlt {
namespace {

using panel::finish_row;
using panel::narrow;
using panel::widen;

constexpr int kRowGroup = 3;  // with 2-4 panels: 8-12 accumulators, enough FMAs in flight
// Products of more rows run in groups of this many down one panel (12 accumulators): each
// weight line then feeds twice the rows of a 3-row group, so later groups reread the panels from
// L2 half as often (SmolLM2's layers, 2 AVX2 cores: 1.05-1.15x at 5-16 rows in both dtypes).
constexpr int kTallRows = 6;
// How many k steps ahead in a panel the next lines are prefetched (1 KB of float32), so the
// memory streams while the FMAs of several rows run (SmolLM2's layers at 8 rows: 1.12x; at one
// float32 row it costs 1.08x).
constexpr int64_t kPrefetchLines = 16;
// The same for a tall block of bfloat16 panels (2 KB ahead: 1.08x at 4-16 rows over 16 steps; a
// float32 tall block gained nothing from going further).
constexpr int64_t kPrefetchTallBf16Lines = 64;
// One claimed unit of work: 6 panels (221-590 KB at K 576-1536, so a task's later row groups
// find them in L2), a whole number of blocks of 2 or 3 panels.
constexpr int64_t kPanelsPerTask = 6;
// The most floats of widened bfloat16 x kept between calls per thread (256 KB: 128 rows of 512,
// or 42 of SmolLM2's 1536); a larger x is widened into a buffer of its own.
constexpr size_t kReusedWideFloats = 64 << 10;

#ifdef TLT_PANEL_X86
// Eight weights of a panel line as float32.
__attribute__((target("avx2,fma"))) inline __m256 load8(const float* line) {
  return _mm256_loadu_ps(line);
}
__attribute__((target("avx2,fma"))) inline __m256 load8(const uint16_t* line) {
  return cpu::load_bfloat16x8(line);
}
#endif

// T: the element type of the panels, bias, addend and y (float, or uint16_t for bfloat16); x is
// float32 here (a bfloat16 x is widened once per call, before the panels run).
template <typename T>
struct Call {
  const float* x;
  int64_t rows, K, ldx;
  const T* panels;
  int64_t N;
  const T* bias;
  const T* addend;
  int64_t ld_addend;
  T* y;
  int64_t ldy;

  // Rows [r0, r0 + group) of panel p, portable: the header's loop literally.
  void portable(int64_t p, int64_t r0, int group) const {
    const T* panel = panels + p * K * kPanelWidth;
    const int width = static_cast<int>(std::min<int64_t>(kPanelWidth, N - p * kPanelWidth));
    for (int m = 0; m < group; ++m) {
      const float* row = x + (r0 + m) * ldx;
      float sums[kPanelWidth] = {};
      for (int64_t k = 0; k < K; ++k)
        for (int j = 0; j < kPanelWidth; ++j)
          sums[j] = std::fma(row[k], widen(panel[k * kPanelWidth + j]), sums[j]);
      emit(p, r0 + m, sums, width);
    }
  }

  void emit(int64_t p, int64_t r, const float* sums, int width) const {
    const int64_t n0 = p * kPanelWidth;
    finish_row(sums, width, bias == nullptr ? nullptr : bias + n0,
               addend == nullptr ? nullptr : addend + r * ld_addend + n0, y + r * ldy + n0);
  }

#ifdef TLT_PANEL_X86
  // G rows by C adjacent panels: 2 G C accumulators, so few rows still keep 8-12 independent
  // FMA chains in flight (one row by one panel has 2, and waits on the FMA latency), and the
  // next cache lines of each panel are prefetched so the memory streams while the FMAs run.
  template <int G, int C>
  __attribute__((target("avx2,fma"))) void vector_block(int64_t p, int64_t r0) const {
    // Every loop over the accumulators is unrolled, so each is a register: indexed at run time
    // anywhere, GCC keeps the array in memory too and stores each accumulator on every k.
    const int64_t depth = K;
    const float* row[G];
    for (int m = 0; m < G; ++m) row[m] = x + (r0 + m) * ldx;
    const T* panel[C];
    for (int c = 0; c < C; ++c) panel[c] = panels + (p + c) * depth * kPanelWidth;
    __m256 acc[G][C][2];
#pragma GCC unroll 16
    for (int m = 0; m < G; ++m)
#pragma GCC unroll 16
      for (int c = 0; c < C; ++c) acc[m][c][0] = acc[m][c][1] = _mm256_setzero_ps();
    constexpr int64_t pf =
        (C == 1 && !std::is_same_v<T, float> ? kPrefetchTallBf16Lines : kPrefetchLines) *
        kPanelWidth;
    for (int64_t k = 0; k < depth; ++k) {
      if constexpr (C == 1) {  // both halves of the line live, each row's broadcast used at once
        const T* line = panel[0] + k * kPanelWidth;
        if constexpr (G > 1 || !std::is_same_v<T, float>)
          _mm_prefetch(reinterpret_cast<const char*>(line + pf), _MM_HINT_T0);
        const __m256 low = load8(line), high = load8(line + 8);
#pragma GCC unroll 16
        for (int m = 0; m < G; ++m) {
          const __m256 value = _mm256_broadcast_ss(row[m] + k);
          acc[m][0][0] = _mm256_fmadd_ps(value, low, acc[m][0][0]);
          acc[m][0][1] = _mm256_fmadd_ps(value, high, acc[m][0][1]);
        }
        continue;
      }
      __m256 value[G];
#pragma GCC unroll 16
      for (int m = 0; m < G; ++m) value[m] = _mm256_broadcast_ss(row[m] + k);
#pragma GCC unroll 16
      for (int c = 0; c < C; ++c) {
        const T* line = panel[c] + k * kPanelWidth;  // one cache line (bf16: half) per k
        // measured: helps where FMAs are many, and for bfloat16 (SmolLM2's layers at one row:
        // 1.05x), costs float32 at one row
        if constexpr (G > 1 || !std::is_same_v<T, float>)
          _mm_prefetch(reinterpret_cast<const char*>(line + pf), _MM_HINT_T0);
        // One half-line of weights live at a time: with 12 accumulators and G broadcasts, a
        // second would take a 17th register and GCC would keep an accumulator on the stack,
        // which made every k wait on a store and a reload.
#pragma GCC unroll 2
        for (int half = 0; half < 2; ++half) {
          const __m256 weights = load8(line + 8 * half);
#pragma GCC unroll 16
          for (int m = 0; m < G; ++m)
            acc[m][c][half] = _mm256_fmadd_ps(value[m], weights, acc[m][c][half]);
        }
      }
    }
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) {
      const int width =
          static_cast<int>(std::min<int64_t>(kPanelWidth, N - (p + c) * kPanelWidth));
#pragma GCC unroll 16
      for (int m = 0; m < G; ++m) {
        alignas(32) float sums[kPanelWidth];
        _mm256_store_ps(sums, acc[m][c][0]);
        _mm256_store_ps(sums + 8, acc[m][c][1]);
        emit(p + c, r0 + m, sums, width);
      }
    }
  }

  // Panels [p0, p1) for rows [r0, r0 + G): blocks of C panels, the last few as wide as they go.
  template <int G, int C>
  void vector_rows(int64_t p0, int64_t p1, int64_t r0) const {
    panel::in_blocks<C>(p0, p1, [&](auto width, int64_t p) {
      this->template vector_block<G, decltype(width)::value>(p, r0);
    });
  }

  // Rows [r0, r0 + group) of panels [p0, p1): up to kRowGroup rows across 2-4 panels, more
  // (up to kTallRows) down one panel.
  void vector(int64_t p0, int64_t p1, int64_t r0, int group) const {
    switch (group) {
      case 1: vector_rows<1, 4>(p0, p1, r0); break;
      case 2: vector_rows<2, 3>(p0, p1, r0); break;
      case 3: vector_rows<3, 2>(p0, p1, r0); break;
      case 4: vector_rows<4, 1>(p0, p1, r0); break;
      case 5: vector_rows<5, 1>(p0, p1, r0); break;
      default: vector_rows<kTallRows, 1>(p0, p1, r0); break;
    }
  }
#endif

  void panels_range(int64_t p0, int64_t p1, bool use_vector) const {
#ifdef TLT_PANEL_X86
    if (use_vector) {
      const int64_t step = rows <= kRowGroup ? kRowGroup : kTallRows;
      for (int64_t r0 = 0; r0 < rows; r0 += step)
        vector(p0, p1, r0, static_cast<int>(std::min<int64_t>(step, rows - r0)));
      return;
    }
#endif
    for (int64_t r0 = 0; r0 < rows; r0 += kRowGroup) {
      const int group = static_cast<int>(std::min<int64_t>(kRowGroup, rows - r0));
      for (int64_t p = p0; p < p1; ++p) portable(p, r0, group);
    }
  }
};

}  // namespace

bool panel_matmul_vectorised() {
#ifdef TLT_PANEL_X86
  return cpu::has_avx2_fma();
#else
  return false;
#endif
}

namespace {

template <typename T>
void run(const Call<T>& call, int isa) {
  const bool use_vector = isa == 0 && panel_matmul_vectorised();
  const int64_t num_panels = (call.N + kPanelWidth - 1) / kPanelWidth;
  const int64_t weight_bytes =
      num_panels * kPanelWidth * call.K * static_cast<int64_t>(sizeof(T));
  if (weight_bytes < panel::kParallelBytes) {
    call.panels_range(0, num_panels, use_vector);
    return;
  }
  const int64_t tasks = (num_panels + kPanelsPerTask - 1) / kPanelsPerTask;
  cpu::parallel_for_on_openmp_team(tasks, [&](int64_t task) {
    const int64_t p0 = task * kPanelsPerTask;
    call.panels_range(p0, std::min(num_panels, p0 + kPanelsPerTask), use_vector);
  });
}

// The product for element type T: x widened first where it is bfloat16, so the micro-kernel
// broadcasts float32 as in the float32 product. A decode step's few rows (a few KB) reuse one
// buffer per thread, as every layer of every step makes several calls; a larger x (prefill) gets
// its own, freed on return, so a long prompt does not leave megabytes held per thread.
template <typename T>
void product(const T* x, int64_t rows, int64_t in_features, int64_t ldx, const T* panels,
             int64_t out_features, const T* bias, const T* addend, int64_t ld_addend, T* y,
             int64_t ldy, int isa) {
  if (!panel::check_arguments(x, rows, in_features, ldx, panels, out_features, addend, ld_addend,
                              y, ldy, isa))
    return;
  std::vector<float> own;  // a large x's widened copy, freed on return
  const float* wide = nullptr;
  int64_t ld_wide = ldx;
  if constexpr (std::is_same_v<T, float>) {
    wide = x;
  } else {
    thread_local std::vector<float> reused;
    const size_t count = static_cast<size_t>(rows * in_features);
    std::vector<float>& buffer = count <= kReusedWideFloats ? reused : own;
    buffer.resize(count);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t k = 0; k < in_features; ++k)
        buffer[r * in_features + k] = widen(x[r * ldx + k]);
    wide = buffer.data();
    ld_wide = in_features;
  }
  run(Call<T>{wide, rows, in_features, ld_wide, panels, out_features, bias, addend, ld_addend, y,
              ldy},
      isa);
}

}  // namespace

void panel_matmul_f32_cpu(const float* x, int64_t rows, int64_t in_features, int64_t ldx,
                          const float* panels, int64_t out_features, const float* bias,
                          const float* addend, int64_t ld_addend, float* y, int64_t ldy,
                          int isa) {
  product(x, rows, in_features, ldx, panels, out_features, bias, addend, ld_addend, y, ldy, isa);
}

void panel_matmul_bf16_cpu(const uint16_t* x, int64_t rows, int64_t in_features, int64_t ldx,
                           const uint16_t* panels, int64_t out_features, const uint16_t* bias,
                           const uint16_t* addend, int64_t ld_addend, uint16_t* y, int64_t ldy,
                           int isa) {
  product(x, rows, in_features, ldx, panels, out_features, bias, addend, ld_addend, y, ldy, isa);
}

}  // namespace tlt
