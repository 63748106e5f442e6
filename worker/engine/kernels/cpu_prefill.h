// The C interface of the paged prefill attention kernel (cpu_prefill.cpp), and of its row form. These declarations
// are the one source of its types: cpu_prefill.cpp includes them (the compiler refuses a
// definition that differs), and kernel_binding.py reads them to type the ctypes binding.
#pragma once
#include <cstdint>

extern "C" {

// 1 where kvfleet_paged_prefill computes this dtype (0 float32, 1 bfloat16) and head_dim on
// this build, else 0.
int kvfleet_prefill_supported(int dtype, int head_dim);

// q: [num_heads, T, head_dim] with strides (q_stride_h, q_stride_t, 1); out: [T, num_heads,
// head_dim] contiguous; chunk c's queries are rows [q_starts[c], q_starts[c] + q_lens[c]) at
// positions [ctx_ends[c] - q_lens[c], ctx_ends[c]), its keys [0, ctx_ends[c]) through
// tables[c] ([num_chunks, table_width] int32). Pool layer layout as the decode kernel's.
// Returns 0, or 1 for an unsupported dtype or head_dim (kvfleet_prefill_supported), 2 for a
// bad shape.
int kvfleet_paged_prefill(int dtype, const void* q, int64_t q_stride_h, int64_t q_stride_t,
                          const void* kv, void* out, const int32_t* tables, int64_t table_width,
                          const int32_t* q_starts, const int32_t* q_lens, const int32_t* ctx_ends,
                          int num_chunks, int num_heads, int num_kv_heads, int head_dim,
                          int64_t num_blocks, int block_size, float scale, int num_threads);

// 1 where kvfleet_paged_prefill_rows runs on this build (bf16, head_dim 64 or 128), else 0.
int kvfleet_prefill_rows_supported(int head_dim);

// The row form of kvfleet_paged_prefill, bf16 only (same arguments but dtype): every row's output
// is the decode kernel's (kvfleet_paged_decode) for that row alone over keys [0, its position],
// bit for bit, whatever rows share its chunk or tile; the batch-invariant prefill (`--deterministic`).
// Returns 0, or 1 where kvfleet_prefill_rows_supported says no or block_size is odd (the decode
// kernel's key pairs are a page's), 2 for a bad shape.
int kvfleet_paged_prefill_rows(const void* q, int64_t q_stride_h, int64_t q_stride_t,
                               const void* kv, void* out, const int32_t* tables,
                               int64_t table_width, const int32_t* q_starts,
                               const int32_t* q_lens, const int32_t* ctx_ends, int num_chunks,
                               int num_heads, int num_kv_heads, int head_dim, int64_t num_blocks,
                               int block_size, float scale, int num_threads);

}  // extern "C"
