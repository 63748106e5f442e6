// The C interface of kvfleet's linear product on AMX tiles (cpu_amx.cpp). These declarations are
// the one source of its types: cpu_amx.cpp includes them (the compiler refuses a definition that
// differs), and kernel_binding.py reads them to type the ctypes binding.
#pragma once
#include <cstdint>

extern "C" {

// `dtype` 3 (bf16 on tiles, cpu_linear.py's BF16_FORM_CODES["amx"]): 1 where this process
// computes it on AMX tiles (the CPU has AMX-TILE, AMX-BF16 and AVX512-BF16, and Linux granted
// the tile state), 2 in an emulation build (KVFLEET_AMX_EMULATE: a scalar model of the tile
// instructions computes), else 0; 0 for any other dtype.
int kvfleet_amx_supported(int dtype);

// w [n, k] bf16 row-major -> out: [n/16][k/32][16][16][2], the B tiles of each block of 16
// outputs in k order (a tile: 16 column pairs x 16 outputs x 2), rows past n and columns past k
// zero (16 * ceil(n / 16) * 32 * ceil(k / 32) elements). Returns 0, -1 for another dtype.
int kvfleet_amx_pack(int dtype, const void* w, int64_t n, int64_t k, void* out, int threads);

// y[i, :n] = x[i, :k] W^T (+ bias) for i < m, bf16 in and out, fp32 sums; x and y rows
// `x_stride` / `y_stride` elements apart; bias n floats or null. Returns 0, -1 where this
// process cannot compute `dtype` (kvfleet_amx_supported is 0).
int kvfleet_amx_linear(int dtype, const void* x, int64_t m, int64_t k, int64_t x_stride,
                       const void* packed, int64_t n, const float* bias, void* y,
                       int64_t y_stride, int threads);

// kvfleet_amx_linear's product added into y: y[i, :n] holds bf16 addends on entry and gets
// addend + output (the bf16 output kvfleet_amx_linear would store, added in fp32, the sum
// rounded to bf16 alike): a bf16 `y += x W^T` without the output's trip through memory. Returns
// as kvfleet_amx_linear.
int kvfleet_amx_linear_add(int dtype, const void* x, int64_t m, int64_t k, int64_t x_stride,
                           const void* packed, int64_t n, const float* bias, void* y,
                           int64_t y_stride, int threads);

// The gate/up product of a SiLU MLP with its activation fused: `packed` is kvfleet_amx_pack of
// the [n, k] weight whose rows are the gate's and the up projection's 16 at a time, alternating
// (rows [32i, 32i + 16) the gate's outputs [16i, 16i + 16), rows [32i + 16, 32i + 32) the up's
// same outputs; bias likewise, or null); y[r, c] for c < n / 2 = silu(gate) * up, each rounded
// to bf16 as kvfleet_silu_mul (cpu_layer_ops.h) rounds it, from the bf16 outputs
// kvfleet_amx_linear would store: the same bits as that product followed by that pass. Returns
// 0; -1 where kvfleet_amx_supported(dtype) is 0; 1 where n is not a multiple of 32.
int kvfleet_amx_linear_silu(int dtype, const void* x, int64_t m, int64_t k, int64_t x_stride,
                            const void* packed, int64_t n, const float* bias, void* y,
                            int64_t y_stride, int threads);

// For each group g < count: rows [offsets[g], offsets[g + 1]) of x against the weight packed at
// address weights[g] (as kvfleet_amx_pack packs an [n, k] weight), into the same rows of y; a
// group of no rows is skipped. Every output is the one kvfleet_amx_linear computes for that
// group alone (no bias): the groups' tasks share one parallel region (a mixture-of-experts
// layer's experts: one call for all). Returns as kvfleet_amx_linear.
int kvfleet_amx_linear_groups(int dtype, const void* x, int64_t k, int64_t x_stride,
                              const int64_t* offsets, const int64_t* weights, int64_t count,
                              int64_t n, void* y, int64_t y_stride, int threads);

// Causal attention on AMX tiles, bf16, for every row of a step (cpu_amx.cpp, "Attention on
// tiles"): each row's result depends on its query and its sequence's keys and values [0, ctx)
// only. Arguments as kvfleet_paged_prefill's (cpu_prefill.h): q [num_heads, T, head_dim] with
// strides (q_stride_h, q_stride_t, 1); out [T, num_heads, head_dim] contiguous; chunk c's queries
// are rows [q_starts[c], q_starts[c] + q_lens[c]) at positions [ctx_ends[c] - q_lens[c],
// ctx_ends[c]), its keys [0, ctx_ends[c]) through tables[c]; a decode is a chunk of one row.
// Returns 0; -1 where kvfleet_amx_supported(3) is 0; 1 where head_dim is not 32, 64, 96 or 128; 2
// for a bad shape.
int kvfleet_amx_attention(const void* q, int64_t q_stride_h, int64_t q_stride_t, const void* kv,
                          void* out, const int32_t* tables, int64_t table_width,
                          const int32_t* q_starts, const int32_t* q_lens, const int32_t* ctx_ends,
                          int num_chunks, int num_heads, int num_kv_heads, int head_dim,
                          int64_t num_blocks, int block_size, float scale, int num_threads);

}  // extern "C"
