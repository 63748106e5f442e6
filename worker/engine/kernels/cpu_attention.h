// The C interface of the paged decode attention kernel (cpu_attention.cpp). This declaration is
// the one source of its types: cpu_attention.cpp includes it (the compiler refuses a definition
// that differs), and kernel_binding.py reads it to type the ctypes binding.
#pragma once
#include <cstdint>

extern "C" {

// q: [num_heads, T, head_dim] with strides (q_stride_h, q_stride_t, 1), rows 0..num_seqs-1 the
// decodes; kv: one pool layer [2, num_kv_heads, num_blocks, block_size, head_dim]; out: [T,
// num_heads, head_dim] contiguous; tables: [num_seqs, table_width] int32; ctx_lens: [num_seqs]
// int32 (keys [0, ctx_len)). dtype: 0 = float32 everywhere, 1 = bfloat16. Returns 0, 1 for
// another dtype, 2 for a bad shape.
int kvfleet_paged_decode(int dtype, const void* q, int64_t q_stride_h, int64_t q_stride_t,
                         const void* kv, void* out, const int32_t* tables, int64_t table_width,
                         const int32_t* ctx_lens, int num_seqs, int num_heads, int num_kv_heads,
                         int head_dim, int64_t num_blocks, int block_size, float scale,
                         int num_threads);

}  // extern "C"
