// KV-cache compaction after verification: move the accepted path's K/V entries next to the
// committed prefix, in place.
//
// Cache layout. The cache is one dense tensor viewed as [P, B, G, T, E]:
//   P planes (e.g. K and V of every layer: P = 2 * layers), B rows, G groups (1 for a
//   token-major cache [.., B, T, H * d]; H_kv for a head-major cache [.., B, H_kv, T, d]),
//   T = max_len token slots, E = bytes of one token's entry within a group.
// During a tree verification pass the engine writes node i of row b to slot cache_len[b] + i
// (the root included: it is not in the cache before the pass). Compaction then copies slot
// cache_len[b] + accept_index[b, j] to slot cache_len[b] + j for j = 0..num_accepted[b], in
// every plane and group. accept_index is increasing along a path (parents[i] < i), so a copy
// never reads a slot an earlier copy of the same row wrote. Afterwards the row's cache holds
// cache_len[b] + num_accepted[b] + 1 valid slots; the caller updates its lengths.
#pragma once

#include <cstdint>

#include "tlt/common.h"

namespace tlt {

// accept_index[B, N] int32 and num_accepted[B] int32 are verify_tree_*'s outputs;
// cache_len[B] int32. A row is left untouched and flagged in row_status[B]
// (kRowBadCacheRange) when num_accepted[b] is outside [0, N), when cache_len[b] +
// accept_index[b, j] or cache_len[b] + j leaves [0, T), or when its path is not strictly
// increasing with accept_index[b, j] >= j. (A failed verification's row, num_accepted 0 and
// accept_index[b, 0] = 0, is a valid no-op.) Any entry size E >= 1 byte works.
void compact_kv_cpu(void* cache, int64_t planes, int64_t batch, int64_t groups, int64_t max_len,
                    int64_t entry_bytes, const int32_t* cache_len, const int32_t* accept_index,
                    const int32_t* num_accepted, int64_t num_nodes_max, int32_t* row_status);
void compact_kv_cuda(void* cache, int64_t planes, int64_t batch, int64_t groups,
                     int64_t max_len, int64_t entry_bytes, const int32_t* cache_len,
                     const int32_t* accept_index, const int32_t* num_accepted,
                     int64_t num_nodes_max, int32_t* row_status, void* stream);

}  // namespace tlt
