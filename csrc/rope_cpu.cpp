// CPU implementation of rope.h. Rows are independent; a decode step has few (B * T), so they
// run on the calling thread unless there are enough to be worth the pool (prefill).
#include <cmath>
#include <cstring>
#include <string>

#include "cpu_common.h"
#include "parallel.h"
#include "tlt/rope.h"

#if defined(__x86_64__) || defined(_M_X64)
#include "vector_bf16.h"
#define TLT_ROPE_X86 1
#define TLT_AVX2 __attribute__((target("avx2,fma")))
#endif

namespace tlt {
namespace {

constexpr int64_t kParallelRows = 64;
constexpr int64_t kMaxHeadDim = 1024;  // every model family's is <= 256

// The element types as storage: bfloat16 is the upper half of a float32.
// Each with its eight-lane forms (v*) for the AVX2 path, the same bits as the scalar ones.
struct BF16 {
  using Storage = uint16_t;
  static float load(uint16_t value) { return cpu::bfloat16_to_float(value); }
  static uint16_t store(float value) { return cpu::float_to_bfloat16(value); }
  static float round(float value) { return load(store(value)); }
  // One rounding of a + b * c: a bfloat16 product is exact in float32, so the plain sum is it.
  static float multiply_add(float b, float c, float a) { return a + b * c; }
#ifdef TLT_ROPE_X86
  TLT_AVX2 static __m256 vload(const uint16_t* p) { return cpu::load_bfloat16x8(p); }
  TLT_AVX2 static void vstore(__m256 v, uint16_t* p) { cpu::store_bfloat16x8(v, p); }
  TLT_AVX2 static __m256 vround(__m256 v) { return cpu::through_bfloat16x8(v); }
  TLT_AVX2 static __m256 vmultiply_add(__m256 b, __m256 c, __m256 a) {
    return _mm256_add_ps(a, _mm256_mul_ps(b, c));
  }
#endif
};

struct F32 {
  using Storage = float;
  static float load(float value) { return value; }
  static float store(float value) { return value; }
  static float round(float value) { return value; }
  // PyTorch's vectorised addcmul on float32 is a fused multiply-add: one rounding.
  static float multiply_add(float b, float c, float a) { return std::fma(b, c, a); }
#ifdef TLT_ROPE_X86
  TLT_AVX2 static __m256 vload(const float* p) { return _mm256_loadu_ps(p); }
  TLT_AVX2 static void vstore(__m256 v, float* p) { _mm256_storeu_ps(p, v); }
  TLT_AVX2 static __m256 vround(__m256 v) { return v; }
  TLT_AVX2 static __m256 vmultiply_add(__m256 b, __m256 c, __m256 a) {
    return _mm256_fmadd_ps(b, c, a);
  }
#endif
};

#ifdef TLT_ROPE_X86
// One head of write_rows' row body, eight lanes at a time (head_dim a multiple of 16): the
// same operations per element as the scalar loops.
template <typename Model, typename Cache>
TLT_AVX2 void rotate_head(const typename Model::Storage* head, const float* cos,
                          const float* sin, int64_t d, typename Cache::Storage* out) {
  const int64_t half = d / 2;
  for (int64_t i = 0; i < half; i += 8) {
    const __m256 low = Model::vload(head + i), high = Model::vload(head + i + half);
    const __m256 cos_low = _mm256_loadu_ps(cos + i), cos_high = _mm256_loadu_ps(cos + i + half);
    const __m256 sin_low = _mm256_loadu_ps(sin + i), sin_high = _mm256_loadu_ps(sin + i + half);
    const __m256 scaled_low = Model::vround(_mm256_mul_ps(low, cos_low));
    const __m256 scaled_high = Model::vround(_mm256_mul_ps(high, cos_high));
    Cache::vstore(Model::vround(Model::vmultiply_add(high, sin_low, scaled_low)), out + i);
    Cache::vstore(Model::vround(Model::vmultiply_add(low, sin_high, scaled_high)),
                  out + i + half);
  }
}

// A value head copied into the cache, eight at a time.
template <typename Model, typename Cache>
TLT_AVX2 void copy_head(const typename Model::Storage* head, int64_t d,
                        typename Cache::Storage* out) {
  for (int64_t i = 0; i < d; i += 8) Cache::vstore(Model::vload(head + i), out + i);
}
#endif

template <typename Model, typename Cache>
void write_rows(const void* qkv_v, int64_t batch, int64_t tokens, int64_t q_heads,
                int64_t kv_heads, int64_t d, const void* cos_v, const void* sin_v,
                const int64_t* positions, const int64_t* slots, void* cache_k_v, void* cache_v_v,
                int64_t row_stride, int64_t head_stride, void* q_out_v) {
  using In = typename Model::Storage;
  using Out = typename Cache::Storage;
  const In* qkv = static_cast<const In*>(qkv_v);
  const In* cos_table = static_cast<const In*>(cos_v);
  const In* sin_table = static_cast<const In*>(sin_v);
  Out* cache_k = static_cast<Out*>(cache_k_v);
  Out* cache_v = static_cast<Out*>(cache_v_v);
  Out* q_out = static_cast<Out*>(q_out_v);
  const int64_t half = d / 2, width = (q_heads + 2 * kv_heads) * d;
#ifdef TLT_ROPE_X86
  const bool vector = d % 16 == 0 && cpu::has_avx2_fma();
#endif
  auto row_body = [&](int64_t r) {
    const int64_t b = r / tokens, t = r % tokens, slot = slots[r];
    float cos[kMaxHeadDim], sin[kMaxHeadDim], x[kMaxHeadDim], scaled[kMaxHeadDim];
    for (int64_t i = 0; i < d; ++i) {
      cos[i] = Model::load(cos_table[positions[r] * d + i]);
      sin[i] = Model::load(sin_table[positions[r] * d + i]);
    }
    for (int64_t h = 0; h < q_heads + kv_heads; ++h) {
      const In* head = qkv + r * width + h * d;
      Out* out = h < q_heads ? q_out + ((b * q_heads + h) * tokens + t) * d
                             : cache_k + b * row_stride + (h - q_heads) * head_stride + slot * d;
#ifdef TLT_ROPE_X86
      if (vector) {
        rotate_head<Model, Cache>(head, cos, sin, d, out);
        continue;
      }
#endif
      for (int64_t i = 0; i < d; ++i) {
        x[i] = Model::load(head[i]);
        scaled[i] = Model::round(x[i] * cos[i]);
      }
      // rope(x)[i] = round(scaled[i] + x[(i + half) % d] * sin[i]), the two halves apart
      for (int64_t i = 0; i < half; ++i)
        out[i] = Cache::store(Model::round(Model::multiply_add(x[i + half], sin[i], scaled[i])));
      for (int64_t i = half; i < d; ++i)
        out[i] = Cache::store(Model::round(Model::multiply_add(x[i - half], sin[i], scaled[i])));
    }
    for (int64_t h = 0; h < kv_heads; ++h) {
      const In* head = qkv + r * width + (q_heads + kv_heads + h) * d;
      Out* out = cache_v + b * row_stride + h * head_stride + slot * d;
#ifdef TLT_ROPE_X86
      if (vector) {
        copy_head<Model, Cache>(head, d, out);
        continue;
      }
#endif
      for (int64_t i = 0; i < d; ++i) out[i] = Cache::store(Model::load(head[i]));
    }
  };
  const int64_t rows = batch * tokens;
  if (rows < kParallelRows) {
    for (int64_t r = 0; r < rows; ++r) row_body(r);
  } else {
    cpu::parallel_for(rows, row_body);
  }
}

void check_type(FloatType type, const char* argument) {
  cpu::require(type == FloatType::kFloat32 || type == FloatType::kBFloat16, argument,
               "must be float32 or bfloat16 (type code " +
                   std::to_string(static_cast<int32_t>(type)) + ")");
}

}  // namespace

void rope_kv_write_cpu(const void* qkv, FloatType model_type, int64_t batch, int64_t tokens,
                       int64_t q_heads, int64_t kv_heads, int64_t head_dim, const void* cos,
                       const void* sin_signed, int64_t table_len, const int64_t* positions,
                       const int64_t* slots, void* cache_k, void* cache_v, FloatType cache_type,
                       int64_t row_stride, int64_t head_stride, int64_t max_len, void* q_out) {
  check_type(model_type, "qkv");
  check_type(cache_type, "cache_kv");
  cpu::require(batch >= 0 && tokens >= 0, "qkv", "batch and tokens must be >= 0");
  cpu::require(q_heads >= 1 && kv_heads >= 1, "qkv", "needs >= 1 query and key-value head");
  cpu::require(head_dim >= 2 && head_dim % 2 == 0 && head_dim <= kMaxHeadDim, "qkv",
               "head_dim must be even, in [2, " + std::to_string(kMaxHeadDim) + "]");
  cpu::require(table_len >= 0, "cos", "table_len must be >= 0");
  cpu::require(max_len >= 0, "cache_kv", "max_len must be >= 0");
  cpu::require(head_stride >= max_len * head_dim && row_stride >= kv_heads * head_stride,
               "cache_kv", "strides must keep rows and heads apart");
  for (int64_t r = 0; r < batch * tokens; ++r) {
    cpu::require(positions[r] >= 0 && positions[r] < table_len, "positions",
                 "position " + std::to_string(positions[r]) + " is outside the tables' [0, " +
                     std::to_string(table_len) + ")");
    cpu::require(slots[r] >= 0 && slots[r] < max_len, "slots",
                 "slot " + std::to_string(slots[r]) + " is outside the cache's [0, " +
                     std::to_string(max_len) + ")");
  }
  const bool bf16_in = model_type == FloatType::kBFloat16;
  const bool bf16_out = cache_type == FloatType::kBFloat16;
  auto run = [&](auto model, auto cache) {
    write_rows<decltype(model), decltype(cache)>(qkv, batch, tokens, q_heads, kv_heads,
                                                 head_dim, cos, sin_signed, positions, slots,
                                                 cache_k, cache_v, row_stride, head_stride, q_out);
  };
  if (bf16_in && bf16_out) run(BF16{}, BF16{});
  else if (bf16_in) run(BF16{}, F32{});
  else if (bf16_out) run(F32{}, BF16{});
  else run(F32{}, F32{});
}

}  // namespace tlt
