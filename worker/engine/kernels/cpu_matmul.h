// The C interface of kvfleet's linear product (cpu_matmul.cpp). These declarations are the one
// source of its types: cpu_matmul.cpp includes them (the compiler refuses a definition that
// differs), and kernel_binding.py reads them to type the ctypes binding.
#pragma once
#include <cstdint>

extern "C" {

// 1 where this build computes products of `dtype` with AVX-512 (0 float32: AVX-512F; 1 bf16 with
// vdpbf16ps, 2 bf16 weights summed with fp32 FMAs: AVX512-BF16, BW and VL), 2 where with its
// portable product (a build without them; dtype 2's sums are the portable product's), else 0.
int kvfleet_linear_supported(int dtype);

// w [n, k] row-major -> out: [n/16][k][16] float32 or [n/16][k/2][16][2] bf16, rows and columns
// past n and k zero (16 * ceil(n / 16) * k elements, k rounded up to even for bf16). Returns 0,
// -1 for another dtype (2 packs as 1).
int kvfleet_pack_linear(int dtype, const void* w, int64_t n, int64_t k, void* out, int threads);

// y[i, :n] = x[i, :k] W^T (+ bias) for i < m, in `dtype`; x and y rows `x_stride` / `y_stride`
// elements apart; bias n floats or null. Returns 0, -1 where this build has no products of that
// dtype.
int kvfleet_linear(int dtype, const void* x, int64_t m, int64_t k, int64_t x_stride,
                   const void* packed, int64_t n, const float* bias, void* y, int64_t y_stride,
                   int threads);

// kvfleet_linear of [gate; up] packed with their blocks of 16 outputs alternating (gate block 0,
// up block 0, gate block 1, ...: n / 2 outputs each, n a multiple of 32): y[i, c] for c < n / 2
// is silu(gate) * up, each of them rounded as kvfleet_linear rounds it and the result as
// kvfleet_silu_mul (cpu_layer_ops.h) rounds it, from them. Returns 0, -1 where this build has
// no AVX-512 products of that dtype, -2 where n is not a multiple of 32.
int kvfleet_linear_silu(int dtype, const void* x, int64_t m, int64_t k, int64_t x_stride,
                        const void* packed, int64_t n, const float* bias, void* y,
                        int64_t y_stride, int threads);

// For each group g < count: rows [offsets[g], offsets[g + 1]) of x against the weight packed at
// address weights[g] (as kvfleet_pack_linear packs an [n, k] weight), into the same rows of y;
// a group of no rows is skipped. Every output is the one kvfleet_linear computes for that group
// alone (no bias); the groups' blocks share one parallel region (a mixture-of-experts layer's
// experts: one call for all). Returns 0, -1 where this build has no products of that dtype.
int kvfleet_linear_groups(int dtype, const void* x, int64_t k, int64_t x_stride,
                          const int64_t* offsets, const int64_t* weights, int64_t count, int64_t n,
                          void* y, int64_t y_stride, int threads);

}  // extern "C"
