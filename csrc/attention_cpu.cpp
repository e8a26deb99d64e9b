// CPU implementation of attention.h. A task is up to kQueryBlock queries that share a KV head
// in one row (query heads of a group x new tokens). Each query takes three passes over the
// slots it sees (scores and their max, exponentials and their sum, the weighted sum of V), the
// slots in chunks that every query of the task reads while they are in L1; a query's
// arithmetic is the same whatever else the call holds. On AVX2 eight slots' dot products run at
// once, and the exponentials and the V sums eight lanes wide. Where the CPU has AVX-512, the
// slots every query of the task sees (all of them in a decode step, the committed prefix in a
// verification pass) run for up to four queries at once, each K and V row loaded once for them
// (SmolLM2's layer, 2 Zen 5 cores: 1.7x at one token over 200 slots, 2.4x at 16 over 800).
// A bfloat16 cache is read as stored and each K and V element widened exactly as it is loaded
// (its bits shifted up), so it gives the bits a float32 cache holding the same values gives,
// for half the bytes read.
#include "tlt/attention.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu_common.h"
#include "parallel.h"
#include "vector_exp.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define TLT_ATTENTION_X86 1
// GCC 12's AVX-512 headers pass an undefined vector as the unused merge source of the unmasked
// intrinsics, which its own -Wmaybe-uninitialized then reports at every call; nothing here is
// read uninitialized.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#endif

namespace tlt {
namespace {

// Below this many multiply-adds (B H_q T S d) a call runs on the calling thread: waking the
// team costs more (SmolLM2 decoding one token over 200 slots is 115 K a layer, 15 us).
constexpr int64_t kParallelWork = 1 << 18;
// V is summed in column blocks of this many floats: eight AVX2 accumulators.
constexpr int64_t kValueBlock = 64;
// Slots whose K (then V) rows every query of a task reads while they are in L1 (16 KB of K at
// d = 64).
constexpr int64_t kSlotChunk = 64;
// The most queries (heads sharing a KV head x new tokens) one task runs: more tasks than cores
// for a wide pass, each reading its KV head's slots from memory once.
constexpr int64_t kQueryBlock = 8;

struct Problem {
  const void* q;  // in the cache's type
  int64_t batch, q_heads, tokens, d;
  const void* k;
  const void* v;
  FloatType kv_type;  // float32 or bfloat16: q, K and V
  int64_t group;  // query heads per KV head
  int64_t row_stride, head_stride, slots;
  const uint8_t* mask;
  int64_t mask_batch_stride, mask_token_stride;
  float scale;
  void* out;
  FloatType out_type;
};

#ifdef TLT_ATTENTION_X86
// The sum of each of eight vectors' lanes, as one vector: lanes ((0 + 1) + (2 + 3)) + ((4 + 5) +
// (6 + 7)) for each, whichever place it has among the eight.
__attribute__((target("avx2,fma"))) inline __m256 lane_sums(const __m256* v) {
  const __m256 s01 = _mm256_hadd_ps(v[0], v[1]), s23 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 s45 = _mm256_hadd_ps(v[4], v[5]), s67 = _mm256_hadd_ps(v[6], v[7]);
  const __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
  // low halves hold lanes 0-3 of each vector, high halves lanes 4-7
  const __m256 low = _mm256_permute2f128_ps(s0123, s4567, 0x20);
  const __m256 high = _mm256_permute2f128_ps(s0123, s4567, 0x31);
  return _mm256_add_ps(low, high);
}

// Eight (sixteen) K or V elements as float32: a bfloat16 element widened exactly.
__attribute__((target("avx2,fma"))) inline __m256 load8(const float* p) {
  return _mm256_loadu_ps(p);
}
__attribute__((target("avx2,fma"))) inline __m256 load8(const uint16_t* p) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}
__attribute__((target("avx512f,avx512dq,avx512vl"))) inline __m512 load16(const float* p) {
  return _mm512_loadu_ps(p);
}
__attribute__((target("avx512f,avx512dq,avx512vl"))) inline __m512 load16(const uint16_t* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// scores[n] = scale * q . key(seen[n]) for n < count, eight slots at a time (one accumulator
// each, k in order); a slot's bits do not depend on the others in its eight. Returns their max.
template <typename E>
__attribute__((target("avx2,fma"))) float scores_avx2(const float* query, const E* keys,
                                                      const int64_t* seen, int64_t count,
                                                      int64_t d, float scale, float* scores) {
  // a last group of fewer than eight repeats its first slot, which leaves the max as it is
  __m256 top = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t n0 = 0; n0 < count; n0 += 8) {
    const int64_t group = count - n0 < 8 ? count - n0 : 8;
    const E* key[8];
    for (int64_t m = 0; m < 8; ++m) key[m] = keys + seen[n0 + (m < group ? m : 0)] * d;
    __m256 acc[8];
#pragma GCC unroll 8
    for (int m = 0; m < 8; ++m) acc[m] = _mm256_setzero_ps();
    for (int64_t i = 0; i < d; i += 8) {
      const __m256 q = _mm256_loadu_ps(query + i);
#pragma GCC unroll 8
      for (int m = 0; m < 8; ++m)
        acc[m] = _mm256_fmadd_ps(q, load8(key[m] + i), acc[m]);
    }
    alignas(32) float out[8];
    const __m256 scaled = _mm256_mul_ps(_mm256_set1_ps(scale), lane_sums(acc));
    top = _mm256_max_ps(top, scaled);
    _mm256_store_ps(out, scaled);
    for (int64_t m = 0; m < group; ++m) scores[n0 + m] = out[m];
  }
  __m128 half = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
  half = _mm_max_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_max_ss(half, _mm_movehdup_ps(half)));
}

// p[n] = exp(p[n] - top) for n < count; returns their sum (eight lane sums, then lane_sums'
// order across the lanes).
__attribute__((target("avx2,fma"))) float weights_avx2(float* p, int64_t count, float top) {
  const __m256 shift = _mm256_set1_ps(top);
  __m256 total = _mm256_setzero_ps();
  int64_t n = 0;
  for (; n + 8 <= count; n += 8) {
    const __m256 e = cpu::exp_nonpositive_avx2(_mm256_sub_ps(_mm256_loadu_ps(p + n), shift));
    _mm256_storeu_ps(p + n, e);
    total = _mm256_add_ps(total, e);
  }
  if (n < count) {
    alignas(32) float rest[8] = {};
    for (int64_t m = n; m < count; ++m) rest[m - n] = p[m];
    const __m256 e = cpu::exp_nonpositive_avx2(_mm256_sub_ps(_mm256_load_ps(rest), shift));
    const __m256 kept = _mm256_blendv_ps(  // lanes past count add +0
        _mm256_setzero_ps(), e,
        _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(count - n)),
                                               _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7))));
    _mm256_store_ps(rest, kept);
    for (int64_t m = n; m < count; ++m) p[m] = rest[m - n];
    total = _mm256_add_ps(total, kept);
  }
  const __m256 zero = _mm256_setzero_ps();
  const __m256 parts[8] = {total, zero, zero, zero, zero, zero, zero, zero};
  return _mm_cvtss_f32(_mm256_castps256_ps128(lane_sums(parts)));
}

// out[0, width) += p[n] * V[seen[n], 0, width) for n < count, in order; width a multiple of 8
// up to kValueBlock.
template <typename E>
__attribute__((target("avx2,fma"))) void weighted_sum_avx2(const float* p, const E* v,
                                                           int64_t v_stride, const int64_t* seen,
                                                           int64_t count, int64_t width,
                                                           float* out) {
  __m256 acc[kValueBlock / 8];
  const int64_t lanes = width / 8;
#pragma GCC unroll 8
  for (int64_t c = 0; c < kValueBlock / 8; ++c)
    acc[c] = c < lanes ? _mm256_loadu_ps(out + 8 * c) : _mm256_setzero_ps();
  for (int64_t n = 0; n < count; ++n) {
    const __m256 weight = _mm256_broadcast_ss(p + n);
    const E* row = v + seen[n] * v_stride;
#pragma GCC unroll 8
    for (int64_t c = 0; c < kValueBlock / 8; ++c)
      if (c < lanes) acc[c] = _mm256_fmadd_ps(weight, load8(row + 8 * c), acc[c]);
  }
#pragma GCC unroll 8
  for (int64_t c = 0; c < kValueBlock / 8; ++c)
    if (c < lanes) _mm256_storeu_ps(out + 8 * c, acc[c]);
}

// Slots that every query of a task sees, for several queries at once where the CPU has
// AVX-512: each slot's K (then V) row is loaded once for all of them, and two slots (then
// sixteen columns) share an instruction. Every lane does what scores_avx2 and weighted_sum_avx2
// do for one query, the same fused multiply-adds in the same order and the same lane_sums, so
// a query's bits are those of the one-query path.

// scores[j][s] = scale * q_j . key(s) for slots s in [s0, s1), a multiple of 8 of them, for Q
// queries; top[j] = max(top[j], those scores).
template <int Q, typename E>
__attribute__((target("avx512f,avx512dq,avx512vl,avx2,fma"))) void shared_scores_avx512(
    const float* const* query, const E* keys, int64_t s0, int64_t s1, int64_t d,
    float scale, float* const* scores, float* top) {
  __m256 tops[Q];
#pragma GCC unroll 4
  for (int j = 0; j < Q; ++j) tops[j] = _mm256_set1_ps(top[j]);
  for (int64_t s = s0; s < s1; s += 8) {
    __m512 acc[Q][4];  // acc[j][k]: slot s + k in the low half, slot s + k + 4 in the high
#pragma GCC unroll 16
    for (int j = 0; j < Q; ++j)
#pragma GCC unroll 4
      for (int k = 0; k < 4; ++k) acc[j][k] = _mm512_setzero_ps();
    for (int64_t i = 0; i < d; i += 8) {
      __m512 key[4];
#pragma GCC unroll 4
      for (int k = 0; k < 4; ++k)
        key[k] = _mm512_insertf32x8(_mm512_castps256_ps512(load8(keys + (s + k) * d + i)),
                                    load8(keys + (s + k + 4) * d + i), 1);
#pragma GCC unroll 4
      for (int j = 0; j < Q; ++j) {
        const __m512 q = _mm512_broadcast_f32x8(_mm256_loadu_ps(query[j] + i));
#pragma GCC unroll 4
        for (int k = 0; k < 4; ++k) acc[j][k] = _mm512_fmadd_ps(q, key[k], acc[j][k]);
      }
    }
#pragma GCC unroll 4
    for (int j = 0; j < Q; ++j) {
      __m256 slots[8];
#pragma GCC unroll 4
      for (int k = 0; k < 4; ++k) {
        slots[k] = _mm512_castps512_ps256(acc[j][k]);
        slots[k + 4] = _mm512_extractf32x8_ps(acc[j][k], 1);
      }
      const __m256 scaled = _mm256_mul_ps(_mm256_set1_ps(scale), lane_sums(slots));
      tops[j] = _mm256_max_ps(tops[j], scaled);
      _mm256_storeu_ps(scores[j] + s, scaled);
    }
  }
#pragma GCC unroll 4
  for (int j = 0; j < Q; ++j) {
    __m128 half = _mm_max_ps(_mm256_castps256_ps128(tops[j]), _mm256_extractf128_ps(tops[j], 1));
    half = _mm_max_ps(half, _mm_movehl_ps(half, half));
    top[j] = _mm_cvtss_f32(_mm_max_ss(half, _mm_movehdup_ps(half)));
  }
}

// sums[j][0, d) += p[j][s] * V(s) for slots s in [s0, s1), in order, for Q queries; d a
// multiple of 16.
template <int Q, typename E>
__attribute__((target("avx512f,avx512dq,avx512vl"))) void shared_values_avx512(
    const float* const* p, const E* values, int64_t s0, int64_t s1, int64_t d,
    float* const* sums) {
  constexpr int kBlocks = kValueBlock / 16;
  for (int64_t i0 = 0; i0 < d; i0 += kValueBlock) {
    const int64_t blocks = std::min<int64_t>(kBlocks, (d - i0) / 16);
    __m512 acc[Q][kBlocks];
#pragma GCC unroll 4
    for (int j = 0; j < Q; ++j)
#pragma GCC unroll 4
      for (int c = 0; c < kBlocks; ++c)
        acc[j][c] = c < blocks ? _mm512_loadu_ps(sums[j] + i0 + 16 * c) : _mm512_setzero_ps();
    for (int64_t s = s0; s < s1; ++s) {
      const E* row = values + s * d + i0;
      __m512 value[kBlocks];
#pragma GCC unroll 4
      for (int c = 0; c < kBlocks; ++c)
        value[c] = c < blocks ? load16(row + 16 * c) : _mm512_setzero_ps();
#pragma GCC unroll 4
      for (int j = 0; j < Q; ++j) {
        const __m512 weight = _mm512_set1_ps(p[j][s]);
#pragma GCC unroll 4
        for (int c = 0; c < kBlocks; ++c)
          if (c < blocks) acc[j][c] = _mm512_fmadd_ps(weight, value[c], acc[j][c]);
      }
    }
#pragma GCC unroll 4
    for (int j = 0; j < Q; ++j)
#pragma GCC unroll 4
      for (int c = 0; c < kBlocks; ++c)
        if (c < blocks) _mm512_storeu_ps(sums[j] + i0 + 16 * c, acc[j][c]);
  }
}

// body(std::integral_constant<int, Q>, first) over queries [0, count) in groups of up to 4.
template <typename Body>
void in_query_groups(int64_t count, Body&& body) {
  int64_t j = 0;
  for (; j + 4 <= count; j += 4) body(std::integral_constant<int, 4>{}, j);
  switch (count - j) {
    case 3: body(std::integral_constant<int, 3>{}, j); break;
    case 2: body(std::integral_constant<int, 2>{}, j); break;
    case 1: body(std::integral_constant<int, 1>{}, j); break;
    default: break;
  }
}

#endif

// A K or V element as float32 (a bfloat16 one widened exactly).
inline float widen(float value) { return value; }
inline float widen(uint16_t value) { return cpu::bfloat16_to_float(value); }

// A task's queries: for query j, the slots it sees (seen[j S ..]), their scores and then
// weights (p[j S ..]), its running sums of V (sums[j d ..]) and, from a bfloat16 q only, q
// widened (queries[j d ..], grown where attend_block widens it).
struct Scratch {
  std::vector<int64_t> seen, count, cursor;
  std::vector<float> p, top, total, sums, queries;
  void reserve(int64_t queries, int64_t slots, int64_t d) {
    // each buffer sized on its own: after a failed resize the others must not pass as grown
    auto grow = [](auto& buffer, int64_t size) {
      if (static_cast<int64_t>(buffer.size()) < size) buffer.resize(size);
    };
    grow(seen, queries * slots);
    grow(p, queries * slots);
    grow(sums, queries * d);
    for (auto* buffer : {&count, &cursor}) grow(*buffer, queries);
    for (auto* buffer : {&top, &total}) grow(*buffer, queries);
  }
};

// Queries [j0, j1) of KV head g in row b, query j being token j % T of head g G + j / T: the
// slots in chunks of kSlotChunk, each chunk's K (then V) rows read by every query while they are
// in L1. A query's arithmetic is the same as alone: its scores are per slot, and its exponential
// sums and V sums run over its own slots in order, chunk after chunk.
// shared: whether the slots every query sees run through the AVX-512 path (shared_scores_avx512,
// shared_values_avx512); the rest of each query's slots run query by query.
template <typename E>
void attend_block(const Problem& pb, int64_t b, int64_t g, int64_t j0, int64_t j1, bool vector,
                  bool shared, Scratch& scratch) {
  const int64_t d = pb.d, S = pb.slots, T = pb.tokens;
  const int64_t kv_offset = b * pb.row_stride + g * pb.head_stride;
  const E* keys = static_cast<const E*>(pb.k) + kv_offset;
  const E* values = static_cast<const E*>(pb.v) + kv_offset;
  const int64_t queries = j1 - j0;
  scratch.reserve(queries, S, d);
  // each query's q as float32: read in place, or widened once from bfloat16
  auto q_offset = [&](int64_t j) {
    return ((b * pb.q_heads + g * pb.group + (j0 + j) / T) * T + (j0 + j) % T) * d;
  };
  if constexpr (std::is_same_v<E, uint16_t>) {
    if (static_cast<int64_t>(scratch.queries.size()) < queries * d)
      scratch.queries.resize(queries * d);
    for (int64_t j = 0; j < queries; ++j) {
      const uint16_t* q = static_cast<const uint16_t*>(pb.q) + q_offset(j);
      for (int64_t i = 0; i < d; ++i) scratch.queries[j * d + i] = cpu::bfloat16_to_float(q[i]);
    }
  }
  auto query_of = [&](int64_t j) -> const float* {
    if constexpr (std::is_same_v<E, uint16_t>) return scratch.queries.data() + j * d;
    return static_cast<const float*>(pb.q) + q_offset(j);
  };
  auto sees_of = [&](int64_t j) -> const uint8_t* {
    return pb.mask == nullptr ? nullptr
                              : pb.mask + b * pb.mask_batch_stride +
                                    ((j0 + j) % T) * pb.mask_token_stride;
  };
  // Slots [0, common) every query sees (a multiple of 8): entry n of each query's seen slots is
  // slot n there, so its list starts at `common`.
  int64_t common = 0;
  if (shared) {
    common = S;
    for (int64_t j = 0; j < queries && common > 0; ++j) {
      if (const uint8_t* sees = sees_of(j)) {
        const void* hole = std::memchr(sees, 0, static_cast<size_t>(common));
        if (hole != nullptr) common = static_cast<const uint8_t*>(hole) - sees;
      }
    }
    common &= ~int64_t{7};
  }
  for (int64_t j = 0; j < queries; ++j) {
    const uint8_t* sees = sees_of(j);
    int64_t* seen = scratch.seen.data() + j * S;
    int64_t count = common;
    for (int64_t s = common; s < S; ++s)
      if (sees == nullptr || sees[s] != 0) seen[count++] = s;
    scratch.count[j] = count;
    scratch.top[j] = -std::numeric_limits<float>::infinity();
  }
#ifdef TLT_ATTENTION_X86
  // each query's q, scores and sums, for the shared path's pointer arrays
  const float* query_rows[kQueryBlock];
  float* score_rows[kQueryBlock];
  float* sum_rows[kQueryBlock];
  for (int64_t j = 0; j < queries; ++j) {
    query_rows[j] = query_of(j);
    score_rows[j] = scratch.p.data() + j * S;
    sum_rows[j] = scratch.sums.data() + j * d;
  }
#endif

  // body(j, n0, n1) for each chunk of kSlotChunk slots past `common`, query by query: [n0, n1)
  // are the entries of query j's seen slots that fall in the chunk.
  auto over_chunks = [&](auto&& body) {
    std::fill(scratch.cursor.begin(), scratch.cursor.begin() + queries, common);
    for (int64_t end = common + kSlotChunk; end < S + kSlotChunk; end += kSlotChunk) {
      for (int64_t j = 0; j < queries; ++j) {
        const int64_t* seen = scratch.seen.data() + j * S;
        const int64_t n0 = scratch.cursor[j];
        int64_t n1 = n0;
        while (n1 < scratch.count[j] && seen[n1] < end) ++n1;
        scratch.cursor[j] = n1;
        body(j, n0, n1);
      }
    }
  };

#ifdef TLT_ATTENTION_X86
  for (int64_t c0 = 0; c0 < common; c0 += kSlotChunk) {
    const int64_t c1 = std::min(common, c0 + kSlotChunk);
    in_query_groups(queries, [&](auto group, int64_t j) {
      shared_scores_avx512<decltype(group)::value, E>(query_rows + j, keys, c0, c1, d, pb.scale,
                                                   score_rows + j, scratch.top.data() + j);
    });
  }
#endif
  over_chunks([&](int64_t j, int64_t n0, int64_t n1) {
    const int64_t* seen = scratch.seen.data() + j * S;
    float* p = scratch.p.data() + j * S;
    const float* query = query_of(j);
    float top = scratch.top[j];
#ifdef TLT_ATTENTION_X86
    if (vector && n1 > n0) {
      const float chunk_top = scores_avx2(query, keys, seen + n0, n1 - n0, d, pb.scale, p + n0);
      top = chunk_top > top ? chunk_top : top;
    }
#endif
    if (!vector) {
      for (int64_t n = n0; n < n1; ++n) {
        const E* key = keys + seen[n] * d;
        float dot = 0.f;
        for (int64_t i = 0; i < d; ++i) dot = std::fma(query[i], widen(key[i]), dot);
        p[n] = pb.scale * dot;
        top = p[n] > top ? p[n] : top;
      }
    }
    scratch.top[j] = top;
  });

  for (int64_t j = 0; j < queries; ++j) {
    float* p = scratch.p.data() + j * S;
    const int64_t count = scratch.count[j];
    const float top = scratch.top[j];
    float total = 0.f;
#ifdef TLT_ATTENTION_X86
    if (vector) total = weights_avx2(p, count, top);
#endif
    if (!vector) {
      for (int64_t n = 0; n < count; ++n) {
        p[n] = std::exp(p[n] - top);
        total += p[n];
      }
    }
    scratch.total[j] = total;
    std::fill(scratch.sums.data() + j * d, scratch.sums.data() + (j + 1) * d, 0.f);
  }
#ifdef TLT_ATTENTION_X86
  for (int64_t c0 = 0; c0 < common; c0 += kSlotChunk) {
    const int64_t c1 = std::min(common, c0 + kSlotChunk);
    in_query_groups(queries, [&](auto group, int64_t j) {
      shared_values_avx512<decltype(group)::value, E>(score_rows + j, values, c0, c1, d,
                                                   sum_rows + j);
    });
  }
#endif

  over_chunks([&](int64_t j, int64_t n0, int64_t n1) {
    const int64_t* seen = scratch.seen.data() + j * S;
    const float* p = scratch.p.data() + j * S;
    float* sums = scratch.sums.data() + j * d;
    for (int64_t i0 = 0; i0 < d; i0 += kValueBlock) {
      const int64_t width = d - i0 < kValueBlock ? d - i0 : kValueBlock;
#ifdef TLT_ATTENTION_X86
      if (vector) {
        weighted_sum_avx2(p + n0, values + i0, d, seen + n0, n1 - n0, width, sums + i0);
        continue;
      }
#endif
      for (int64_t i = i0; i < i0 + width; ++i)
        for (int64_t n = n0; n < n1; ++n)
          sums[i] = std::fma(p[n], widen(values[seen[n] * d + i]), sums[i]);
    }
  });

  for (int64_t j = 0; j < queries; ++j) {
    const int64_t h = g * pb.group + (j0 + j) / T, t = (j0 + j) % T;
    const int64_t out_offset = ((b * T + t) * pb.q_heads + h) * d;
    const float* sums = scratch.sums.data() + j * d;
    for (int64_t i = 0; i < d; ++i) {
      const float value = scratch.count[j] == 0 ? 0.f : sums[i] / scratch.total[j];
      if (pb.out_type == FloatType::kFloat32)
        static_cast<float*>(pb.out)[out_offset + i] = value;
      else
        static_cast<uint16_t*>(pb.out)[out_offset + i] = cpu::float_to_bfloat16(value);
    }
  }
}

}  // namespace

void decode_attention_cpu(const void* q, int64_t batch, int64_t q_heads, int64_t tokens,
                          int64_t head_dim, const void* cache_k, const void* cache_v,
                          FloatType kv_type, int64_t kv_heads, int64_t row_stride,
                          int64_t head_stride, int64_t max_len, int64_t slots, const uint8_t* mask,
                          int64_t mask_batch_stride, int64_t mask_token_stride, float scale,
                          void* out, FloatType out_type) {
  cpu::require(batch >= 0, "q", "batch must be >= 0");
  cpu::require(q_heads >= 1 && tokens >= 1 && head_dim >= 1, "q",
               "heads, tokens and head_dim must be >= 1");
  cpu::require(kv_heads >= 1 && q_heads % kv_heads == 0, "kv_heads",
               "must be >= 1 and divide the query heads");
  cpu::require(max_len >= 1 && slots >= 1 && slots <= max_len, "slots",
               "must be in [1, max_len]");
  cpu::require(row_stride >= 0 && head_stride >= 0, "cache", "strides must be >= 0");
  cpu::require(mask_batch_stride >= 0 && mask_token_stride >= 0, "mask",
               "strides must be >= 0");
  cpu::require(std::isfinite(scale), "scale", "must be finite");
  cpu::require(out_type == FloatType::kFloat32 || out_type == FloatType::kBFloat16, "out",
               "must be float32 or bfloat16");
  cpu::require(kv_type == FloatType::kFloat32 || kv_type == FloatType::kBFloat16, "cache",
               "must be float32 or bfloat16");
  if (batch == 0) return;
  cpu::require(q != nullptr, "q", "is null");
  cpu::require(cache_k != nullptr && cache_v != nullptr, "cache", "is null");
  cpu::require(out != nullptr, "out", "is null");

#ifdef TLT_ATTENTION_X86
  const bool vector = head_dim % 8 == 0 && cpu::has_avx2_fma();
  const bool shared = vector && head_dim % 16 == 0 && cpu::has_avx512f_dq_vl();
#else
  const bool vector = false, shared = false;
#endif
  const Problem pb{q,           batch,      q_heads,     tokens, head_dim,
                   cache_k,     cache_v,    kv_type,     q_heads / kv_heads,
                   row_stride,  head_stride, slots,      mask,   mask_batch_stride,
                   mask_token_stride, scale, out,        out_type};
  // a task: up to kQueryBlock queries of one KV head in one row
  const int64_t per_head = (q_heads / kv_heads) * tokens;
  const int64_t blocks = (per_head + kQueryBlock - 1) / kQueryBlock;
  const int64_t tasks = batch * kv_heads * blocks;
  auto task = [&](int64_t index) {
    thread_local Scratch scratch;
    const int64_t block = index % blocks, head = index / blocks;
    const int64_t b = head / kv_heads, g = head % kv_heads, j0 = block * kQueryBlock;
    const int64_t j1 = std::min(per_head, (block + 1) * kQueryBlock);
    if (kv_type == FloatType::kBFloat16)
      attend_block<uint16_t>(pb, b, g, j0, j1, vector, shared, scratch);
    else
      attend_block<float>(pb, b, g, j0, j1, vector, shared, scratch);
  };
  if (batch * q_heads * tokens * slots * head_dim < kParallelWork) {
    for (int64_t index = 0; index < tasks; ++index) task(index);
    return;
  }
  cpu::parallel_for_on_openmp_team(tasks, task);
}

}  // namespace tlt
