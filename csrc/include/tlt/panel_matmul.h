// The products of a decode step on the CPU, float32 or bfloat16: y = x @ W.T (+ bias) (+ addend)
// for the rows a step has (one per running row, or a tree's nodes), reading W once from memory
// however many rows there are. A step of a small model streams every weight once and does little
// arithmetic on it, so its products are bound by memory bandwidth and by how well the FMAs overlap
// it. On SmolLM2-135M's layer matrices on 2 AVX2 cores these read 28-33 GB/s at one row where
// oneDNN's float32 products read 14-16, and run 1.6x oneDNN's speed at 5 rows, 1.3x at 16 and
// 1.06x at 128 (weight_layout.PANEL_MAX_ROWS); from about 160 rows oneDNN's blocked GEMM wins.
//
// W (N, K) is held packed in panels of 16 output features, each panel K x 16 contiguous:
//   panels[(p * K + k) * 16 + j] = W[16 p + j, k]   (0 where 16 p + j >= N), p < ceil(N / 16)
// so one panel is one sequential stream and the 16 sums of a row live in two vector registers.
//
// x (M, K) with row stride ldx, y (M, N) with row stride ldy, bias (N) or null, addend (M, N)
// with row stride ld_addend or null (may be y itself: the residual add in place). The bits, for
// every row r and feature n, whatever M, the thread count or the instruction set:
//   acc = 0; for k = 0 .. K - 1: acc = fma(x[r, k], W[n, k], acc)   (one rounding each)
//   y[r, n] = acc, then + bias[n], then + addend[r, n] (one float32 add each, when given)
// so a row's result never depends on the other rows in the call (the engine's rows-independent
// invariant holds bit for bit across batch sizes and tree widths).
//
// bfloat16 (panel_matmul_bf16_cpu: x, panels, bias, addend and y all bfloat16, as uint16_t bits,
// the panels laid out as above): every operand widened exactly to float32, the same float32
// chain and adds, and y[r, n] that float32 value rounded once to bfloat16 (nearest even, any NaN
// to 0x7FC0). Why a kernel of our own: a bfloat16 weight is half a float32's bytes, and a CPU
// without AVX-512 or AMX has no bfloat16 product in PyTorch's oneDNN (its fallback multiplies
// SmolLM2's layers 2.4x slower than this kernel at one row, 10x at 64), while widening on load is
// a zero-extend and a shift.
//
// isa: 0 the fastest this CPU runs (AVX2 + FMA, else the portable loop), 1 the portable loop
// (std::fma; what the tests compare the vector path with). Panels run on PyTorch's OpenMP team
// when the weights are large enough to be worth it (parallel_for_on_openmp_team, parallel.h).
//
// Checked before anything is written (std::invalid_argument naming the argument): M >= 0,
// K >= 1, N >= 1, ldx >= K, ldy >= N, ld_addend >= N with an addend, isa 0 or 1, pointers
// non-null where needed.
#pragma once

#include <cstdint>

namespace tlt {

constexpr int64_t kPanelWidth = 16;

void panel_matmul_f32_cpu(const float* x, int64_t rows, int64_t in_features, int64_t ldx,
                          const float* panels, int64_t out_features, const float* bias,
                          const float* addend, int64_t ld_addend, float* y, int64_t ldy,
                          int isa);

void panel_matmul_bf16_cpu(const uint16_t* x, int64_t rows, int64_t in_features, int64_t ldx,
                           const uint16_t* panels, int64_t out_features, const uint16_t* bias,
                           const uint16_t* addend, int64_t ld_addend, uint16_t* y, int64_t ldy,
                           int isa);

// Whether isa 0 runs the AVX2 + FMA path on this CPU.
bool panel_matmul_vectorised();

// bfloat16 in pairs (panel_matmul_bf16_pairs_cpu): for a CPU with AVX512-BF16, whose dot-product
// instruction (VDPBF16PS) multiplies two k at once, sixteen features to a 64-byte line:
//   pairs[((p * K2 + i) * 16 + j) * 2 + t] = W[16 p + j, 2 i + t]   (0 past N or K)
// with K2 = ceil(K / 2), a panel K2 x 16 x 2 contiguous. One instruction per line and row, and
// no widening, so the products stay bound by memory to several rows more than the float32
// chain's (SmolLM2's layers, 2 Zen 5 cores: bench/panel_layers.py). The bits follow that
// instruction: for every row r and feature n,
//   acc = 0; for i = 0 .. K2 - 1:
//     acc = ftz(fma(daz(x[r, 2i + 1]), daz(W[n, 2i + 1]), acc))   (x[r, K] = W[n, K] = 0)
//     acc = ftz(fma(daz(x[r, 2i]), daz(W[n, 2i]), acc))
// then bias, addend and the rounding to bfloat16 as above; daz reads a subnormal operand as a
// zero of its sign and ftz writes a subnormal sum as one (a bfloat16 product is exact in
// float32, so each step rounds once). isa 1, the portable loop, computes the same bits on any
// CPU; isa 0 is the vector path where the CPU has AVX512-BF16, else the portable loop. x, y,
// bias, addend and the checks as panel_matmul_bf16_cpu's.
void panel_matmul_bf16_pairs_cpu(const uint16_t* x, int64_t rows, int64_t in_features,
                                 int64_t ldx, const uint16_t* pairs, int64_t out_features,
                                 const uint16_t* bias, const uint16_t* addend, int64_t ld_addend,
                                 uint16_t* y, int64_t ldy, int isa);

// Whether isa 0 runs the AVX512-BF16 path of panel_matmul_bf16_pairs_cpu on this CPU.
bool panel_matmul_pairs_vectorised();

}  // namespace tlt
