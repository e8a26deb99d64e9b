// Sampled drafts in one call, for a drafting level on the CPU: the drafter's distribution
// q = softmax(logits / T) over its V' draft tokens, written out over the target's V ids (the
// draft_probs the sampled-draft verifier tests against), and n tokens drawn from that same q.
// PyTorch spends about sixteen ops a level on it (softmax, a one-hot branch for greedy rows,
// cumsum, searchsorted, a zero fill and a scatter over V): 0.17 ms a level against this call's
// 0.10 for SmolLM2's V' = 8192 over V = 49152 at batch 1 on this project's CPUs
// (bench/draft_sample.py).
//
// logits[M, V'] float32 (M = rows x nodes, dense), temperature[M] float32 (the node's row's),
// uniforms[M, n] float32, draft_to_target[V'] int64 or null (then V = V'), out[M, V] float32
// with row stride ld_out >= V (a level's rows of the step's (B, N, V) draft_probs: written in
// place), ids[M, n] int64. For each m, with z = logits[m]:
//   T = temperature[m] > 0:  z = z / T (IEEE division);  mx = max z;  e(x) = exp(z(x) - mx);
//                            S = sum e (float64);  q(x) = e(x) / float(S)  (float32);
//   otherwise (greedy):      q = one_hot(argmax z)  (the lowest index on ties);
//   out[m, :] = 0, then out[m, draft_to_target[x]] = q(x)  (out[m, x] = q(x) without a map);
//   for j < n, with u = uniforms[m, j]:  ids[m, j] = draft_to_target[x] for the smallest x
//     whose running float64 sum of q(0..x) exceeds u * (float64 sum of q); where rounding
//     leaves none, the largest x with q(x) > 0; a greedy row draws its argmax.
// So each token is drawn from exactly the q written for it, up to float64 rounding of the
// running sums. exp is exp_nonpositive_avx2 on AVX2 (within 2 float32 ulps; 0 below -87) and
// std::exp elsewhere, sums in eight interleaved parts there and in index order elsewhere
// (vocab_passes.h). Rows are independent: a row's bits do not depend on the others.
//
// row_status[M] (kRowOk, or kRowBadLogits: NaN or +inf in z, or every z -inf; kRowBadUniform:
// a u outside [0, 1)); a bad row gets out[m, :] = 0 and ids -1.
// Checked before anything is written (std::invalid_argument naming the argument): M >= 0,
// V' >= 1, n >= 1, V >= V' (V == V' without a map), ld_out >= V, pointers non-null where
// needed. The map
// itself (distinct ids in [0, V)) is the caller's to check.
#pragma once

#include <cstdint>

namespace tlt {

void sample_draft_cpu(const float* logits, int64_t rows, int64_t draft_vocab,
                      const float* temperature, const float* uniforms, int64_t draws,
                      const int64_t* draft_to_target, int64_t vocab, float* out,
                      int64_t ld_out, int64_t* ids, int32_t* row_status);

}  // namespace tlt
