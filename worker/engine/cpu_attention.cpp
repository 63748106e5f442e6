// Paged decode attention on the CPU (worker/engine/cpu_attention.py builds and calls it).
//
// Each decoding sequence has one query; the query heads that share a KV head (`rep` of them)
// are computed together so every K/V row is read once, in place, from the pool's blocks through
// the sequence's block table: no dense copy, no padding. Pool layer layout:
// [2 (K, V), num_kv_heads, num_blocks, block_size, head_dim]. Scores, softmax and the P.V sum
// are in fp32; in bf16 the probabilities are rounded to bf16 before P.V and the normaliser is
// summed from the unrounded ones, as SDPA's CPU flash kernel does, so bf16 results follow
// HF's SDPA closely. Work is split over (sequence, KV head) pairs with OpenMP; each pair is
// computed by one thread alone, so the result does not depend on the thread count.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "cpu_kernels.h"

namespace {

using namespace kvfleet;  // load, store, rounded, exp_approx (cpu_kernels.h)

// Pages sit at random places in the pool, so the hardware prefetcher stalls at each page's start:
// while one page is read, its successor's row `j` is requested (every cache line of it).
template <typename T>
inline void prefetch_row(const T* row, int dim) {
    const char* p = reinterpret_cast<const char*>(row);
    for (int offset = 0; offset < dim * static_cast<int>(sizeof(T)); offset += 64)
        __builtin_prefetch(p + offset);
}

// visit(t, row) for the rows t = 0 .. ctx-1 of one KV head, page by page through the block table
// (no division per key), the next page's rows prefetched while this page is read.
template <typename T, typename Visit>
inline void for_each_row(const T* head, const int32_t* table, int ctx, int bs, int dim,
                         Visit&& visit) {
    for (int t0 = 0, b = 0; t0 < ctx; t0 += bs, ++b) {
        const T* page = head + static_cast<int64_t>(table[b]) * bs * dim;
        const int n = std::min(bs, ctx - t0);
        const int n_next = std::min(bs, ctx - t0 - bs);  // rows of the next page (<= 0: none)
        const T* next = n_next > 0 ? head + static_cast<int64_t>(table[b + 1]) * bs * dim : page;
        for (int j = 0; j < n; ++j) {
            if (j < n_next) prefetch_row(next + j * dim, dim);
            visit(t0 + j, page + j * dim);
        }
    }
}

struct Shape {
    int num_heads, num_kv_heads, head_dim, block_size;
    int64_t num_blocks, table_width, q_stride_h, q_stride_t;
};

// One (sequence, KV head) pair: `rep` query heads over `ctx` keys. kHeadDim > 0 fixes head_dim at
// compile time (fully unrolled, vectorised inner loops); 0 reads it from `shape`.
template <int kHeadDim, typename T>
void attend(const T* q, const T* k_head, const T* v_head, T* out, const int32_t* table, int ctx,
            const Shape& shape, float scale, std::vector<float>& buf) {
    const int dim = kHeadDim > 0 ? kHeadDim : shape.head_dim;
    const int rep = shape.num_heads / shape.num_kv_heads;
    const int bs = shape.block_size;
    buf.resize(static_cast<size_t>(rep) * (ctx + 2 * dim) + dim);
    float* scores = buf.data();              // [rep, ctx]
    float* qf = scores + rep * ctx;          // [rep, dim]
    float* acc = qf + rep * dim;             // [rep, dim]
    float* row = acc + rep * dim;            // [dim]: one K or V row in fp32
    for (int r = 0; r < rep; ++r) {
        const T* src = q + r * shape.q_stride_h;
        for (int d = 0; d < dim; ++d) qf[r * dim + d] = load(src[d]);
    }
    for_each_row(k_head, table, ctx, bs, dim, [&](int t, const T* k) {
#pragma omp simd
        for (int d = 0; d < dim; ++d) row[d] = load(k[d]);
        for (int r = 0; r < rep; ++r) {
            const float* qr = qf + r * dim;
            float s = 0.f;
#pragma omp simd reduction(+ : s)
            for (int d = 0; d < dim; ++d) s += qr[d] * row[d];
            scores[r * ctx + t] = s * scale;  // scaled after the dot, as SDPA
        }
    });
    for (int r = 0; r < rep; ++r) {
        float* sr = scores + r * ctx;
        float m = -INFINITY;
        for (int t = 0; t < ctx; ++t) m = std::max(m, sr[t]);
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int t = 0; t < ctx; ++t) {
            const float p = exp_approx(sr[t] - m);
            sum += p;  // the normaliser from the unrounded probabilities, as SDPA
            sr[t] = rounded<T>(p);
        }
        for (int d = 0; d < dim; ++d) acc[r * dim + d] = 0.f;
        qf[r * dim] = 1.f / sum;  // the query row is no longer needed: keep 1/sum there
    }
    for_each_row(v_head, table, ctx, bs, dim, [&](int t, const T* v) {
#pragma omp simd
        for (int d = 0; d < dim; ++d) row[d] = load(v[d]);
        for (int r = 0; r < rep; ++r) {
            const float p = scores[r * ctx + t];
            float* ar = acc + r * dim;
#pragma omp simd
            for (int d = 0; d < dim; ++d) ar[d] += p * row[d];
        }
    });
    for (int r = 0; r < rep; ++r) {
        const float inv = qf[r * dim];
        for (int d = 0; d < dim; ++d) store(acc[r * dim + d] * inv, out + r * dim + d);
    }
}

template <int kHeadDim, typename T>
void decode(const T* q, const T* kv, T* out, const int32_t* tables, const int32_t* ctx_lens,
            int num_seqs, const Shape& shape, float scale, int num_threads) {
    const int rep = shape.num_heads / shape.num_kv_heads;
    const int64_t head_elems = shape.num_blocks * shape.block_size * shape.head_dim;
    const T* values = kv + shape.num_kv_heads * head_elems;
    const int tasks = num_seqs * shape.num_kv_heads;
#pragma omp parallel num_threads(num_threads)
    {
        std::vector<float> buf;  // per thread, reused across its pairs
#pragma omp for schedule(dynamic, 1)
        for (int task = 0; task < tasks; ++task) {
            const int seq = task / shape.num_kv_heads, kvh = task % shape.num_kv_heads;
            attend<kHeadDim>(q + kvh * rep * shape.q_stride_h + seq * shape.q_stride_t,
                             kv + kvh * head_elems, values + kvh * head_elems,
                             out + (static_cast<int64_t>(seq) * shape.num_heads + kvh * rep) * shape.head_dim,
                             tables + seq * shape.table_width, ctx_lens[seq], shape, scale, buf);
        }
    }
}

template <typename T>
void dispatch(const T* q, const T* kv, T* out, const int32_t* tables, const int32_t* ctx_lens,
              int num_seqs, const Shape& shape, float scale, int num_threads) {
    if (shape.head_dim == 64)
        decode<64>(q, kv, out, tables, ctx_lens, num_seqs, shape, scale, num_threads);
    else if (shape.head_dim == 128)
        decode<128>(q, kv, out, tables, ctx_lens, num_seqs, shape, scale, num_threads);
    else
        decode<0>(q, kv, out, tables, ctx_lens, num_seqs, shape, scale, num_threads);
}

}  // namespace

// q: [num_heads, T, head_dim] with strides (q_stride_h, q_stride_t, 1), rows 0..num_seqs-1 the
// decodes; out: [T, num_heads, head_dim] contiguous; tables: [num_seqs, table_width] int32;
// ctx_lens: [num_seqs] int32 (keys [0, ctx_len)). dtype: 0 = float32 everywhere, 1 = bfloat16.
extern "C" int kvfleet_paged_decode(
        int dtype, const void* q, int64_t q_stride_h, int64_t q_stride_t, const void* kv, void* out,
        const int32_t* tables, int64_t table_width, const int32_t* ctx_lens, int num_seqs,
        int num_heads, int num_kv_heads, int head_dim, int64_t num_blocks, int block_size,
        float scale, int num_threads) {
    if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0) return 2;
    const Shape shape{num_heads, num_kv_heads, head_dim, block_size,
                      num_blocks, table_width, q_stride_h, q_stride_t};
    if (dtype == 0)
        dispatch(static_cast<const float*>(q), static_cast<const float*>(kv),
                 static_cast<float*>(out), tables, ctx_lens, num_seqs, shape, scale, num_threads);
    else if (dtype == 1)
        dispatch(static_cast<const uint16_t*>(q), static_cast<const uint16_t*>(kv),
                 static_cast<uint16_t*>(out), tables, ctx_lens, num_seqs, shape, scale,
                 num_threads);
    else
        return 1;
    return 0;
}
