// CUDA implementation of compact_kv (kv_cache.h).
#include <algorithm>
#include <cstdint>

#include "cuda_check.h"
#include "tlt/kv_cache.h"

namespace tlt {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 65536;

// One thread per row: checks that num_accepted[b] is in [0, N) (the path fits in
// accept_index), that every slot of the row's copies lies in [0, T) and that the path is
// strictly increasing with accept_index[b, j] >= j (a source is never an earlier copy's
// destination). The copy kernel then reads the verdict, so every plane and group of a row
// makes the same decision.
__global__ void compact_kv_check_kernel(const int32_t* cache_len,     // (B)
                                        const int32_t* accept_index,  // (B, N)
                                        const int32_t* num_accepted,  // (B)
                                        int64_t batch, int num_nodes_max, int64_t max_len,
                                        int32_t* row_status) {        // (B)
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t b = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; b < batch;
       b += stride) {
    const int32_t n = num_accepted[b];
    const int64_t base = cache_len[b];
    const int32_t* path = accept_index + b * num_nodes_max;
    bool ok = n >= 0 && n < num_nodes_max;
    for (int32_t j = 0; ok && j <= n; ++j) {
      const int64_t src = base + path[j], dst = base + j;
      ok = src >= 0 && src < max_len && dst >= 0 && dst < max_len && path[j] >= j &&
           (j == 0 || path[j] > path[j - 1]);
    }
    row_status[b] = ok ? kRowOk : kRowBadCacheRange;
  }
}

// Grid-stride over (plane, row, group, word of the entry): each thread owns one Word-sized
// column of one (plane, row, group) lane and performs that column's copies for j = 0..n in
// order. Every byte is then moved by exactly one thread in the same order as a sequential
// copy, so no synchronisation between the j steps is needed, and consecutive threads touch
// consecutive words (coalesced).
template <typename Word>
__global__ void compact_kv_copy_kernel(Word* cache,  // (P, B, G, T, E / sizeof(Word))
                                       int64_t batch, int64_t groups, int64_t max_len,
                                       int64_t words_per_entry, int64_t total,
                                       const int32_t* cache_len,     // (B)
                                       const int32_t* accept_index,  // (B, N)
                                       const int32_t* num_accepted,  // (B)
                                       int num_nodes_max,
                                       const int32_t* row_status) {  // (B)
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t item = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; item < total;
       item += stride) {
    const int64_t lane = item / words_per_entry;  // (plane * B + b) * G + g
    const int64_t word = item - lane * words_per_entry;
    const int64_t b = (lane / groups) % batch;
    if (row_status[b] != kRowOk) continue;
    const int32_t n = num_accepted[b];
    const int32_t* path = accept_index + b * num_nodes_max;
    Word* column = cache + lane * max_len * words_per_entry + word;  // slot s at s * wpe
    const int64_t base = cache_len[b];
    for (int32_t j = 0; j <= n; ++j) {
      const int32_t src = path[j];
      if (src != j) column[(base + j) * words_per_entry] = column[(base + src) * words_per_entry];
    }
  }
}

struct alignas(16) Word16 {
  uint32_t v[4];
};
struct alignas(8) Word8 {
  uint32_t v[2];
};

template <typename Word>
void launch_copy(void* cache, int64_t lanes, int64_t batch, int64_t groups, int64_t max_len,
                 int64_t entry_bytes, const int32_t* cache_len, const int32_t* accept_index,
                 const int32_t* num_accepted, int64_t num_nodes_max, const int32_t* row_status,
                 void* stream) {
  const int64_t words_per_entry = entry_bytes / static_cast<int64_t>(sizeof(Word));
  const int64_t total = lanes * words_per_entry;
  const int64_t blocks = std::min<int64_t>((total + kThreads - 1) / kThreads, kMaxBlocks);
  cuda_detail::launch("compact_kv_cuda", compact_kv_copy_kernel<Word>,
                      dim3(static_cast<unsigned>(blocks)), dim3(kThreads), 0, stream,
                      static_cast<Word*>(cache), batch, groups, max_len, words_per_entry, total,
                      cache_len, accept_index, num_accepted, static_cast<int>(num_nodes_max),
                      row_status);
}

}  // namespace

void compact_kv_cuda(void* cache, int64_t planes, int64_t batch, int64_t groups,
                     int64_t max_len, int64_t entry_bytes, const int32_t* cache_len,
                     const int32_t* accept_index, const int32_t* num_accepted,
                     int64_t num_nodes_max, int32_t* row_status, void* stream) {
  using namespace cuda_detail;
  constexpr const char* fn = "compact_kv_cuda";
  check_range(fn, "planes", planes, 0, INT64_MAX);
  check_range(fn, "batch", batch, 0, INT64_MAX);
  check_range(fn, "groups", groups, 0, INT64_MAX);
  check_range(fn, "max_len", max_len, 0, INT64_MAX);
  check_range(fn, "entry_bytes", entry_bytes, 1, INT64_MAX);
  check_range(fn, "num_nodes_max", num_nodes_max, 1, kMaxTreeNodes);
  check_arg(product_fits({planes, batch, groups, max_len, entry_bytes}), fn,
            "planes * batch * groups * max_len * entry_bytes", "overflows int64");
  if (batch == 0) return;
  check_not_null(fn, "cache_len", cache_len);
  check_not_null(fn, "accept_index", accept_index);
  check_not_null(fn, "num_accepted", num_accepted);
  check_not_null(fn, "row_status", row_status);
  const int64_t lanes = planes * batch * groups;
  if (lanes > 0 && max_len > 0) check_not_null(fn, "cache", cache);

  const int64_t check_blocks = std::min<int64_t>((batch + kThreads - 1) / kThreads, kMaxBlocks);
  launch(fn, compact_kv_check_kernel, dim3(static_cast<unsigned>(check_blocks)), dim3(kThreads),
         0, stream, cache_len, accept_index, num_accepted, batch,
         static_cast<int>(num_nodes_max), max_len, row_status);
  if (lanes == 0 || max_len == 0) return;

  // Widest word that divides the entry size and the base address (so every entry is aligned).
  const uintptr_t address = reinterpret_cast<uintptr_t>(cache);
  auto fits = [&](int64_t bytes) {
    return entry_bytes % bytes == 0 && address % static_cast<uintptr_t>(bytes) == 0;
  };
  if (fits(16)) {
    launch_copy<Word16>(cache, lanes, batch, groups, max_len, entry_bytes, cache_len,
                        accept_index, num_accepted, num_nodes_max, row_status, stream);
  } else if (fits(8)) {
    launch_copy<Word8>(cache, lanes, batch, groups, max_len, entry_bytes, cache_len,
                       accept_index, num_accepted, num_nodes_max, row_status, stream);
  } else if (fits(4)) {
    launch_copy<uint32_t>(cache, lanes, batch, groups, max_len, entry_bytes, cache_len,
                          accept_index, num_accepted, num_nodes_max, row_status, stream);
  } else if (fits(2)) {
    launch_copy<uint16_t>(cache, lanes, batch, groups, max_len, entry_bytes, cache_len,
                          accept_index, num_accepted, num_nodes_max, row_status, stream);
  } else {
    launch_copy<uint8_t>(cache, lanes, batch, groups, max_len, entry_bytes, cache_len,
                         accept_index, num_accepted, num_nodes_max, row_status, stream);
  }
}

}  // namespace tlt
