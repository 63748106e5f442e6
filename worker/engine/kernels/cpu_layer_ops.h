// The C interface of a decoder layer's element-wise ops (cpu_layer_ops.cpp). These declarations
// are the one source of their types: cpu_layer_ops.cpp includes them (the compiler refuses a
// definition that differs), and kernel_binding.py reads them to type the ctypes binding.
// dtype: 0 = float32, 1 = bfloat16, as kvfleet_paged_decode. Each returns 0, or 1 for another
// dtype.
#pragma once
#include <cstdint>

extern "C" {

// out = weight * rms_norm(x) over contiguous [rows, hidden]; with residual (else null):
// residual <- x + residual first, and that sum is what is normalised.
int kvfleet_rms_norm(int dtype, const void* x, void* residual, const void* weight, void* out,
                     int64_t rows, int hidden, float eps, int num_threads);

// x [rows, heads, dim] (row_stride, head_stride, 1) rotated in place by cos/sin [rows, dim].
int kvfleet_rope(int dtype, void* x, int64_t rows, int heads, int64_t row_stride,
                 int64_t head_stride, int dim, const void* cos, const void* sin,
                 int num_threads);

// out [rows, inter] = silu(gate) * up from contiguous gate_up [rows, 2 * inter].
int kvfleet_silu_mul(int dtype, const void* gate_up, void* out, int64_t rows, int inter,
                     int num_threads);

// An MoE layer's output from its routed experts' terms: out [tokens, hidden] row t = the sum
// over j < k, in order, of rows[at[t * k + j]] * weights[t * k + j] (rows [*, hidden] in `dtype`,
// weights fp32), each product and each partial sum rounded to `dtype` as eager ops round them,
// the sum from +0: transformers' per-expert `out[tokens] += update * weight`, experts ascending.
int kvfleet_moe_combine(int dtype, const void* rows, const int64_t* at, const float* weights,
                        int64_t tokens, int k, int hidden, void* out, int num_threads);

// The step's new K and V rows into the pool, straight from the q/k/v product: k and v are
// [tokens, num_kv_heads, head_dim] with `row_stride` elements between tokens (views into that
// product); rows[h * tokens + t] is the pool row (h * slots + slot) of token t's head h, as
// AttentionContext.write_index; pool_layer is one layer [2, num_kv_heads * slots, head_dim]
// (K then V), slots_per_kv = num_kv_heads * slots. Returns 2 for a row outside the pool.
int kvfleet_write_kv(int dtype, const void* k, const void* v, int64_t row_stride, int64_t tokens,
                     int num_kv_heads, int head_dim, const int64_t* rows, int64_t slots_per_kv,
                     void* pool_layer);

// LoRA terms (worker/engine/lora/slots.py): for every row t of x [rows, in] (rows `x_stride`
// elements apart) whose slot s = row_slots[t] is >= 0, h = A_s x_t in fp32 (a: [slots]
// [rank_total][in], part p's rows at p * width), then for each part p out[t, part_start[p] + j] +=
// sum_r h[p * width + r] * b[b_offset[p] + (s * width + r) * part_len[p] + j] (b: each part
// [slots][width][part_len[p]]), summed in fp32 and rounded once into out (rows `out_stride`
// apart); x, a, b and out in `dtype`.
// Each row is computed alone by one thread in one fixed order: batch- and thread-invariant.
int kvfleet_lora_add(int dtype, const void* x, int64_t x_stride, int64_t rows, int64_t in,
                     const int64_t* row_slots, const void* a, int64_t rank_total,
                     const void* b, int parts, int64_t width, const int64_t* part_start,
                     const int64_t* part_len, const int64_t* b_offset, void* out,
                     int64_t out_stride, int num_threads);

}  // extern "C"
