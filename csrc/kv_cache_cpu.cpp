// CPU implementation of kv_cache.h: per (plane, row, group), memmove the accepted slots down
// in path order. Rows are validated once up front so every plane sees the same decision.
#include <cstring>
#include <vector>

#include "cpu_common.h"
#include "parallel.h"
#include "tlt/kv_cache.h"

namespace tlt {
namespace {

int32_t check_row(int64_t max_len, int64_t n_max, int32_t base, const int32_t* path,
                  int32_t num_accepted) {
  if (num_accepted < 0 || num_accepted >= n_max || base < 0) return kRowBadCacheRange;
  for (int32_t j = 0; j <= num_accepted; ++j) {
    if (path[j] < j || (j > 0 && path[j] <= path[j - 1])) return kRowBadCacheRange;
    if (static_cast<int64_t>(base) + path[j] >= max_len) return kRowBadCacheRange;
  }
  return kRowOk;
}

}  // namespace

void compact_kv_cpu(void* cache, int64_t planes, int64_t batch, int64_t groups, int64_t max_len,
                    int64_t entry_bytes, const int32_t* cache_len, const int32_t* accept_index,
                    const int32_t* num_accepted, int64_t num_nodes_max, int32_t* row_status) {
  cpu::check_common_sizes(batch, num_nodes_max);
  cpu::require(planes >= 0 && groups >= 0, "cache", "planes and groups must be >= 0");
  cpu::require(max_len >= 0, "cache", "max_len must be >= 0");
  cpu::require(entry_bytes >= 1, "cache", "entry_bytes must be >= 1");
  for (int64_t b = 0; b < batch; ++b)
    row_status[b] = check_row(max_len, num_nodes_max, cache_len[b],
                              accept_index + b * num_nodes_max, num_accepted[b]);
  char* bytes = static_cast<char*>(cache);
  const int64_t lanes = planes * batch * groups;
  cpu::parallel_for(lanes, [&](int64_t lane) {
    const int64_t b = (lane / groups) % batch;
    if (row_status[b] != kRowOk) return;
    const int32_t* path = accept_index + b * num_nodes_max;
    char* slots = bytes + lane * max_len * entry_bytes;
    const int64_t base = cache_len[b];
    // path[j] >= j and increasing: the source of a later copy is never an earlier destination.
    for (int32_t j = 0; j <= num_accepted[b]; ++j) {
      if (path[j] == j) continue;
      std::memcpy(slots + (base + j) * entry_bytes, slots + (base + path[j]) * entry_bytes,
                  entry_bytes);
    }
  });
}

}  // namespace tlt
