// CPU implementation of panel_matmul.h's bfloat16 pairs product. A micro-kernel (vector_block)
// multiplies G rows by C adjacent panels with one VDPBF16PS per (row, panel, pair of k): G C
// accumulators, C line loads and one broadcast of a row's pair each step, at most 24 + 3 + 1 of
// AVX-512's 32 registers. Rows beyond a group rerun the block's panels, now in L2, so only the
// first group reads them from memory.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "cpu_common.h"
#include "panel_common.h"
#include "parallel.h"
#include "tlt/panel_matmul.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define TLT_PAIRS_X86 1
// GCC 12's AVX-512 headers pass an undefined vector as the unused merge source of the unmasked
// intrinsics, which its own -Wuninitialized then reports at every call; nothing here is read
// uninitialized.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#endif

namespace tlt {
namespace {

// Up to this many rows share a pass over the panels (12 where there are no more than 12); 8
// rows by 3 panels keeps 24 products in flight, enough to cover the instruction's latency at two
// a cycle.
constexpr int kRowGroup = 8;
// From 2 rows on, a row group's dot products are enough to delay the memory stream, so each
// block streams its own panels' lines this many pairs (2 KB) ahead (SmolLM2's layers, 2 Zen 5
// cores, bench/panel_layers.py, two builds alternated five times: 1.04x at 2 rows, 1.09x at 3;
// at one row it cost 3%; 32 pairs against 16, alternated in one process: 1.04-1.08x at 2-4
// rows, sampled(2) and sampled(3) at batch 1 1.03x; 64 pairs 1.00-1.03x).
constexpr int kPrefetchFromRows = 2;
constexpr int64_t kPrefetchPairs = 32;
// From 5 rows on, the dot products outlast the memory's time for the lines, and a stream a few
// lines ahead still leaves the memory idle while they run (and through every later row group):
// there each block's row groups prefetch the whole next block instead, spread over all of their
// steps, so the memory streams at the pace of the arithmetic (SmolLM2's layers, two builds
// alternated four times: 1.15-1.2x at 8-16 rows, 1.1x at 32 and 64; at 2-4 rows it cost 5%).
constexpr int kSpreadFromRows = 5;
// One claimed unit of work: a contiguous run of up to this many panels (3.5 MB at SmolLM2's
// K = 576, 9.4 MB at K = 1536) and at least kMinPanelsPerTask, a whole number of tasks for each
// thread of the team, so equal threads finish together; each task's first block is the one that
// no earlier block prefetched, and the memory's own prefetchers follow one long stream better
// than many short ones (SmolLM2's layers against tasks of at most 12 panels, at least 4 a call,
// alternated in one process: 1.12x at 1 row, 1.1x at 2-4, 1.2x at 8-16; decoding SmolLM2 at
// batch 1, plain 1.09x, sampled(3) 1.06x, (5,4,16) 1.10x). Dynamic claiming still evens out the
// LM head's 16 tasks where a thread runs late.
constexpr int64_t kPanelsPerTask = 192;
constexpr int64_t kMinPanelsPerTask = 4;

// daz: a subnormal bfloat16 as a zero of its sign, widened.
inline float widen_daz(uint16_t value) {
  return (value & 0x7F80u) == 0 ? cpu::bits_to_float(static_cast<uint32_t>(value & 0x8000u) << 16)
                                : cpu::bfloat16_to_float(value);
}
// ftz: a subnormal sum as a zero of its sign.
inline float flush(float value) {
  return std::fpclassify(value) == FP_SUBNORMAL ? std::copysign(0.0f, value) : value;
}

struct Call {
  const uint16_t* x;  // rows x K2 pairs, row stride ldx elements (K even or padded)
  int64_t rows, K2, ldx;
  const uint16_t* pairs;
  int64_t N;
  const uint16_t* bias;
  const uint16_t* addend;
  int64_t ld_addend;
  uint16_t* y;
  int64_t ldy;

  const uint16_t* panel(int64_t p) const { return pairs + p * K2 * 2 * kPanelWidth; }

  void emit(int64_t p, int64_t r, const float* sums) const {
    const int64_t n0 = p * kPanelWidth;
    const int width = static_cast<int>(std::min<int64_t>(kPanelWidth, N - n0));
    panel::finish_row(sums, width, bias == nullptr ? nullptr : bias + n0,
                      addend == nullptr ? nullptr : addend + r * ld_addend + n0, y + r * ldy + n0);
  }

  // Rows [r0, r0 + group) of panel p: the header's loop literally.
  void portable(int64_t p, int64_t r0, int group) const {
    const uint16_t* lines = panel(p);
    for (int m = 0; m < group; ++m) {
      const uint16_t* row = x + (r0 + m) * ldx;
      float sums[kPanelWidth] = {};
      for (int64_t i = 0; i < K2; ++i)
        for (int j = 0; j < kPanelWidth; ++j)
          for (int t = 1; t >= 0; --t)
            sums[j] = flush(std::fma(widen_daz(row[2 * i + t]),
                                     widen_daz(lines[(i * kPanelWidth + j) * 2 + t]), sums[j]));
      emit(p, r0 + m, sums);
    }
  }

#ifdef TLT_PAIRS_X86
  // What a row group prefetches while it runs: its share, `lines` cache lines from `from`, of
  // the block after its own, spread evenly over its K2 steps; and, where `stream`, its own
  // panels' lines kPrefetchPairs ahead.
  struct Ahead {
    const uint16_t* from = nullptr;
    int64_t lines = 0;
    bool stream = false;
  };

  // G rows by C adjacent panels from panel p. Stream and Spread say which of `ahead` to do, as
  // template arguments: tested in the loop they slowed the one-row product, bound by memory,
  // by 4-9% (a scratch A/B).
  template <int G, int C, bool Stream, bool Spread>
  __attribute__((target("avx512f,avx512bw,avx512bf16"))) void vector_block(int64_t p, int64_t r0,
                                                                           Ahead ahead) const {
    // Every loop over the accumulators is unrolled, so each is a register.
    __m512 acc[G][C];
#pragma GCC unroll 32
    for (int m = 0; m < G; ++m)
#pragma GCC unroll 32
      for (int c = 0; c < C; ++c) acc[m][c] = _mm512_setzero_ps();
    const uint16_t* lines[C];
    for (int c = 0; c < C; ++c) lines[c] = panel(p + c);
    const uint16_t* row[G];
    for (int m = 0; m < G; ++m) row[m] = x + (r0 + m) * ldx;
    const char* next = reinterpret_cast<const char*>(ahead.from);
    int64_t credit = 0;  // lines of `ahead` owed: + lines a step, - K2 a line prefetched
    for (int64_t i = 0; i < K2; ++i) {
      if constexpr (Spread)
        for (credit += ahead.lines; credit >= K2; credit -= K2, next += 64)
          _mm_prefetch(next, _MM_HINT_T0);
      __m512i weights[C];
#pragma GCC unroll 32
      for (int c = 0; c < C; ++c) {
        const uint16_t* line = lines[c] + i * 2 * kPanelWidth;
        if constexpr (Stream)
          _mm_prefetch(reinterpret_cast<const char*>(line + kPrefetchPairs * 2 * kPanelWidth),
                       _MM_HINT_T0);
        weights[c] = _mm512_loadu_si512(line);
      }
#pragma GCC unroll 32
      for (int m = 0; m < G; ++m) {
        int32_t pair;  // x[r, 2i] in the low half, x[r, 2i + 1] in the high, as in the panels
        std::memcpy(&pair, row[m] + 2 * i, sizeof(pair));
        const __m512bh value = (__m512bh)_mm512_set1_epi32(pair);
#pragma GCC unroll 32
        for (int c = 0; c < C; ++c)
          acc[m][c] = _mm512_dpbf16_ps(acc[m][c], value, (__m512bh)weights[c]);
      }
    }
#pragma GCC unroll 32
    for (int c = 0; c < C; ++c)
#pragma GCC unroll 32
      for (int m = 0; m < G; ++m) vector_emit(p + c, r0 + m, acc[m][c]);
  }

  // emit's bits with 16 lanes at once: the float32 adds in the same order, then
  // float_to_bfloat16's rounding (nearest even on the bits, any NaN as 0x7FC0).
  __attribute__((target("avx512f,avx512bw,avx512vl"))) void vector_emit(int64_t p, int64_t r,
                                                                        __m512 value) const {
    const int64_t n0 = p * kPanelWidth;
    const int width = static_cast<int>(std::min<int64_t>(kPanelWidth, N - n0));
    const __mmask16 lanes = static_cast<__mmask16>((1u << width) - 1u);
    if (bias != nullptr) value = _mm512_add_ps(value, widen16(bias + n0, lanes));
    if (addend != nullptr)
      value = _mm512_add_ps(value, widen16(addend + r * ld_addend + n0, lanes));
    const __m512i bits = _mm512_castps_si512(value);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_srli_epi32(
        _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
    rounded = _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(value, value, _CMP_UNORD_Q),
                                    _mm512_set1_epi32(0x7FC0));
    _mm256_mask_storeu_epi16(y + r * ldy + n0, lanes, _mm512_cvtepi32_epi16(rounded));
  }

  // Sixteen bfloat16 (those in `lanes`; 0 elsewhere) as float32.
  __attribute__((target("avx512f,avx512bw,avx512vl"))) static __m512 widen16(
      const uint16_t* values, __mmask16 lanes) {
    const __m256i halves = _mm256_maskz_loadu_epi16(lanes, values);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(halves), 16));
  }

  // Rows [r0, r0 + group) of the C panels from p, 1 <= group <= MaxRows: `ahead`'s prefetches
  // as template arguments, then the group size.
  template <int C, int MaxRows>
  void vector_group(int64_t p, int64_t r0, int group, Ahead ahead) const {
    if (ahead.lines != 0) {
      if (ahead.stream) return vector_sized<C, MaxRows, true, true>(p, r0, group, ahead);
      return vector_sized<C, MaxRows, false, true>(p, r0, group, ahead);
    }
    if (ahead.stream) return vector_sized<C, MaxRows, true, false>(p, r0, group, ahead);
    vector_sized<C, MaxRows, false, false>(p, r0, group, ahead);
  }
  template <int C, int MaxRows, bool Stream, bool Spread, int G = 1>
  void vector_sized(int64_t p, int64_t r0, int group, Ahead ahead) const {
    if constexpr (G < MaxRows) {
      if (group != G)
        return this->template vector_sized<C, MaxRows, Stream, Spread, G + 1>(p, r0, group,
                                                                             ahead);
    }
    vector_block<G, C, Stream, Spread>(p, r0, ahead);
  }

  // Panels [p0, p1) for every row: blocks of C panels, the last few as wide as they go, each
  // block's row groups one after another (the later ones find its lines in L2) while they
  // prefetch the next block between them.
  template <int C, int MaxRows>
  void vector_panels(int64_t p0, int64_t p1) const {
    const int64_t groups = (rows + MaxRows - 1) / MaxRows;
    const bool stream = rows >= kPrefetchFromRows;
    const bool spread = rows >= kSpreadFromRows;
    panel::in_blocks<C>(p0, p1, [&](auto width, int64_t p) {
      constexpr int W = decltype(width)::value;
      const int64_t next = p + W;
      const int64_t next_lines = spread && next < p1 ? std::min<int64_t>(C, p1 - next) * K2 : 0;
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t first = next_lines * g / groups, last = next_lines * (g + 1) / groups;
        const Ahead ahead{next_lines == 0 ? nullptr : panel(next) + first * 2 * kPanelWidth,
                          last - first, stream && g == 0 && (p == p0 || !spread)};
        const int group = static_cast<int>(std::min<int64_t>(MaxRows, rows - g * MaxRows));
        this->template vector_group<W, MaxRows>(p, g * MaxRows, group, ahead);
      }
    });
  }

  // Up to 4 rows across 4 panels (16 accumulators), 8 across 3 (24) and 12 across 2 (24) in
  // one group; more in groups of kRowGroup across 3. A second group rereads every block from L2
  // for its rows: 9-12 rows in one group of 12 ran 1.3-1.4x faster than a group of 8 and one of
  // the rest (SmolLM2's layers, alternated in one process); 16 rows down one panel (16
  // accumulators, a broadcast per product) ran 0.85x two groups of 8, so from 13 rows on it is
  // groups of 8.
  void vector(int64_t p0, int64_t p1) const {
    if (rows <= 4) return vector_panels<4, 4>(p0, p1);
    if (rows <= 8) return vector_panels<3, kRowGroup>(p0, p1);
    if (rows <= 12) return vector_panels<2, 12>(p0, p1);
    vector_panels<3, kRowGroup>(p0, p1);
  }
#endif

  void panels_range(int64_t p0, int64_t p1, bool use_vector) const {
#ifdef TLT_PAIRS_X86
    if (use_vector) return vector(p0, p1);
#endif
    for (int64_t r0 = 0; r0 < rows; r0 += kRowGroup)
      for (int64_t p = p0; p < p1; ++p)
        portable(p, r0, static_cast<int>(std::min<int64_t>(kRowGroup, rows - r0)));
  }
};

}  // namespace

bool panel_matmul_pairs_vectorised() {
#ifdef TLT_PAIRS_X86
  return cpu::has_avx512_bf16();
#else
  return false;
#endif
}

void panel_matmul_bf16_pairs_cpu(const uint16_t* x, int64_t rows, int64_t in_features,
                                 int64_t ldx, const uint16_t* pairs, int64_t out_features,
                                 const uint16_t* bias, const uint16_t* addend, int64_t ld_addend,
                                 uint16_t* y, int64_t ldy, int isa) {
  if (!panel::check_arguments(x, rows, in_features, ldx, pairs, out_features, addend, ld_addend,
                              y, ldy, isa))
    return;
  const int64_t K2 = (in_features + 1) / 2;
  // An odd K reads x[r, K] as 0: the rows are copied with that zero after them, once per call.
  std::vector<uint16_t> padded;
  if (in_features % 2 != 0) {
    padded.assign(static_cast<size_t>(rows * 2 * K2), 0);
    for (int64_t r = 0; r < rows; ++r)
      std::memcpy(padded.data() + r * 2 * K2, x + r * ldx, in_features * sizeof(uint16_t));
    x = padded.data();
    ldx = 2 * K2;
  }
  const Call call{x, rows, K2, ldx, pairs, out_features, bias, addend, ld_addend, y, ldy};
  const bool use_vector = isa == 0 && panel_matmul_pairs_vectorised();
  const int64_t num_panels = (out_features + kPanelWidth - 1) / kPanelWidth;
  const int64_t weight_bytes = num_panels * K2 * 2 * kPanelWidth * 2;
  if (weight_bytes < panel::kParallelBytes) {
    call.panels_range(0, num_panels, use_vector);
    return;
  }
  const int64_t threads = cpu::openmp_team_size();
  int64_t tasks = (num_panels + kPanelsPerTask - 1) / kPanelsPerTask;
  tasks = std::min((tasks + threads - 1) / threads * threads,
                   std::max<int64_t>(1, num_panels / kMinPanelsPerTask));
  const int64_t per_task = (num_panels + tasks - 1) / tasks;
  tasks = (num_panels + per_task - 1) / per_task;
  cpu::parallel_for_on_openmp_team(tasks, [&](int64_t task) {
    const int64_t p0 = task * per_task;
    call.panels_range(p0, std::min(num_panels, p0 + per_task), use_vector);
  });
}

}  // namespace tlt
