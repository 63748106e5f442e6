// Paged decode attention on the CPU (worker/engine/kernels/cpu_kernels.py builds it, cpu_attention.py
// calls it; its interface: cpu_attention.h).
//
// Each decoding sequence has one query; the query heads that share a KV head (`rep` of them)
// are computed together so every K/V row is read once, in place, from the pool's blocks through
// the sequence's block table: no dense copy, no padding. Pool layer layout:
// [2 (K, V), num_kv_heads, num_blocks, block_size, head_dim]. Scores, softmax and the P.V sum
// are in fp32; in bf16 the probabilities are rounded to bf16 before P.V and the normaliser is
// summed from the unrounded ones, as SDPA's CPU flash kernel does, so bf16 results follow
// HF's SDPA closely. Work is split over (sequence, KV head) pairs with OpenMP; each pair is
// computed by one thread alone, so the result does not depend on the thread count.
//
// A step's keys and values come from memory (every layer's pool outgrows the caches), in pages at
// random places, so the kernel is bound by how many cache lines are in flight, not by its
// arithmetic: it requests the lines it will read next into L2 (a prefetch with locality 2), ahead
// of the loads, and each thread takes its next pair before computing this one so that the next
// pair's first page is requested too. On a Zen 4 (docs/BENCHMARKS.md, "The decode attention's
// keys and values requested into L2"), L1 requests kept too few lines in flight: a step's
// attention read them at 16 GB/s, the requests into L2 at 24 (pages of 8 KB read at random
// places reach 25 on that machine).
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "cpu_attention.h"
#include "cpu_kernels.h"

namespace {

using namespace kvfleet;  // load, store, rounded, exp_approx, exp512 (cpu_kernels.h)

// Pages sit at random places in the pool, so the hardware prefetcher stalls at each page's start:
// while one page is read, its successor's row `j` is requested (every cache line of it). kL2:
// into L2 (lines read a page or more later, from memory); else into L1 (lines already in L2).
template <typename T, bool kL2 = true>
inline void prefetch_row(const T* row, int dim) {
    const char* p = reinterpret_cast<const char*>(row);
    for (int offset = 0; offset < dim * static_cast<int>(sizeof(T)); offset += 64)
        __builtin_prefetch(p + offset, 0, kL2 ? 2 : 3);
}

// Every row of page `b` of one KV head (if the context reaches it) requested into L2.
template <typename T>
inline void prefetch_page(const T* head, const int32_t* table, int ctx, int bs, int dim, int b) {
    const int rows = std::min(bs, ctx - b * bs);
    if (rows <= 0) return;
    const T* page = head + static_cast<int64_t>(table[b]) * bs * dim;
    for (int j = 0; j < rows; ++j) prefetch_row(page + j * dim, dim);
}

// Pages of at least this many rows have the whole next page requested at once, at the start of
// each page; shorter ones one row of it per row read (measured on float32 pages: per row was
// faster with pages of 16 rows, at once with pages of 64).
constexpr int kPrefetchWholePageRows = 32;

// visit(t, row) for the rows t = 0 .. ctx-1 of one KV head, page by page through the block table
// (no division per key), the next page's rows prefetched while this page is read.
template <typename T, typename Visit>
inline void for_each_row(const T* head, const int32_t* table, int ctx, int bs, int dim,
                         Visit&& visit) {
    for (int t0 = 0, b = 0; t0 < ctx; t0 += bs, ++b) {
        const T* page = head + static_cast<int64_t>(table[b]) * bs * dim;
        const int n = std::min(bs, ctx - t0);
        if (bs >= kPrefetchWholePageRows) {
            prefetch_page(head, table, ctx, bs, dim, b + 1);
            for (int j = 0; j < n; ++j) visit(t0 + j, page + j * dim);
            continue;
        }
        const int n_next = std::min(bs, ctx - t0 - bs);  // rows of the next page (<= 0: none)
        const T* next = n_next > 0 ? head + static_cast<int64_t>(table[b + 1]) * bs * dim : page;
        for (int j = 0; j < n; ++j) {
            if (j < n_next) prefetch_row(next + j * dim, dim);
            visit(t0 + j, page + j * dim);
        }
    }
}

// One query head's softmax over its `ctx` scores: keep(t, p) takes each probability unrounded;
// returns 1 / the normaliser, summed from the unrounded probabilities as SDPA does.
template <typename Keep>
inline float softmax_row(const float* scores, int ctx, Keep&& keep) {
    // a vector maximum: the scalar loop kept m in memory, one store-to-load chain per key, which
    // was a quarter of the kernel's time at 4 streams (the order of a maximum changes nothing).
    // Written as a comparison, which gcc vectorises (vmaxps) without -ffast-math; std::max it
    // left scalar, one vmaxss chain per key.
    float m = -INFINITY;
#pragma omp simd reduction(max : m)
    for (int t = 0; t < ctx; ++t) m = scores[t] > m ? scores[t] : m;
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int t = 0; t < ctx; ++t) {
        const float p = exp_approx(scores[t] - m);
        sum += p;
        keep(t, p);
    }
    return 1.f / sum;
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
        // the query row is no longer needed: keep 1/sum there
        qf[r * dim] = softmax_row(sr, ctx, [&](int t, float p) { sr[t] = rounded<T>(p); });
        for (int d = 0; d < dim; ++d) acc[r * dim + d] = 0.f;
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

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
// The same attention for float32 K/V with AVX2 and FMA, head_dim a multiple of 8: q.k of 8 keys
// at a time, each key's sum over 8-float chunks of its row in order (one FMA chain per key, 8
// chains in flight) then its 8 lanes in one tree, transpose_sum8's; P.V one query head at a time,
// up to 64 dimensions of sums in registers, each summed over the keys in order. The loops above
// left to the compiler spend a dependent chain of FMAs and a horizontal sum on every key and
// query head. A row's sums depend on its keys alone (never on the rows beside it).

// s[j] = v[j]'s 8 lanes summed as ((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7)), j < 8.
inline __m256 transpose_sum8(const __m256 (&v)[8]) {
    const __m256 h01 = _mm256_hadd_ps(v[0], v[1]), h23 = _mm256_hadd_ps(v[2], v[3]);
    const __m256 h45 = _mm256_hadd_ps(v[4], v[5]), h67 = _mm256_hadd_ps(v[6], v[7]);
    // keys 0-3 (a) and 4-7 (b): lanes 0-3 summed in the low half, lanes 4-7 in the high half
    const __m256 a = _mm256_hadd_ps(h01, h23), b = _mm256_hadd_ps(h45, h67);
    return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

template <int kHeadDim>
void attend_f32(const float* q, const float* k_head, const float* v_head, float* out,
                const int32_t* table, int ctx, const Shape& shape, float scale,
                std::vector<float>& buf) {
    const int dim = kHeadDim > 0 ? kHeadDim : shape.head_dim, chunks = dim / 8;
    const int rep = shape.num_heads / shape.num_kv_heads, bs = shape.block_size;
    buf.resize(static_cast<size_t>(rep) * (ctx + 1) + dim);
    float* scores = buf.data();          // [rep, ctx]
    float* inv = scores + rep * ctx;     // [rep]
    float* zero = inv + rep;             // [dim]: the row of a key past the page's last
    std::fill(zero, zero + dim, 0.f);
    const __m256 sc = _mm256_set1_ps(scale);
    for (int r = 0; r < rep; ++r) {
        const float* qr = q + r * shape.q_stride_h;
        float* sr = scores + r * ctx;
        for (int t0 = 0, b = 0; t0 < ctx; t0 += bs, ++b) {
            const float* page = k_head + static_cast<int64_t>(table[b]) * bs * dim;
            const int n = std::min(bs, ctx - t0);
            if (r == 0) {  // the next page's keys, and this page's values for P.V below
                prefetch_page(k_head, table, ctx, bs, dim, b + 1);
                prefetch_page(v_head, table, ctx, bs, dim, b);
            }
            for (int j0 = 0; j0 < n; j0 += 8) {
                const int m = std::min(8, n - j0);
                const float* rows[8];
                for (int j = 0; j < 8; ++j) rows[j] = j < m ? page + (j0 + j) * dim : zero;
                __m256 acc[8];
                for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
                for (int c = 0; c < chunks; ++c) {
                    const __m256 qc = _mm256_loadu_ps(qr + 8 * c);
                    for (int j = 0; j < 8; ++j)
                        acc[j] = _mm256_fmadd_ps(qc, _mm256_loadu_ps(rows[j] + 8 * c), acc[j]);
                }
                alignas(32) float s8[8];
                _mm256_store_ps(s8, _mm256_mul_ps(transpose_sum8(acc), sc));  // scaled after
                std::memcpy(sr + t0 + j0, s8, sizeof(float) * m);
            }
        }
        inv[r] = softmax_row(sr, ctx, [&](int t, float p) { sr[t] = p; });
        for (int d0 = 0; d0 < chunks; d0 += 8) {  // P.V: 8 chunks of sums in registers at a time
            const int g = std::min(8, chunks - d0);
            __m256 acc[8];
            for (int c = 0; c < 8; ++c) acc[c] = _mm256_setzero_ps();
            for_each_row(v_head, table, ctx, bs, dim, [&](int t, const float* v) {
                const __m256 p = _mm256_set1_ps(sr[t]);
                for (int c = 0; c < 8; ++c)
                    if (c < g) acc[c] = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 8 * (d0 + c)), acc[c]);
            });
            const __m256 iv = _mm256_set1_ps(inv[r]);
            for (int c = 0; c < g; ++c)
                _mm256_storeu_ps(out + r * dim + 8 * (d0 + c), _mm256_mul_ps(acc[c], iv));
        }
    }
}
#endif

#if defined(__AVX512BF16__) && defined(__AVX512F__)
// The same attention for bf16 K/V with AVX512-BF16's pair dot products (vdpbf16ps: two bf16
// products summed into each fp32 lane, exact products, fp32 sums). q.k: the keys of a page are
// taken 16 at a time, each key's 16 partial sums reduced by a transpose-and-add tree into one
// score lane; P.V: two keys at once, their V rows interleaved per dimension so one vdpbf16ps
// adds p_t * v_t + p_t+1 * v_t+1 for 16 dimensions. The eager scalar loop above spends most of
// its time in one horizontal sum per key and query head; this form is bound by memory instead.
// kChunks: head_dim / 32 (one 512-bit register holds 32 bf16); kRep: query heads per KV head.

// softmax_row for the bf16 path, 16 keys at a time: probabilities rounded to bf16 into `probs`;
// returns 1 / the normaliser (summed from the unrounded probabilities). gcc leaves the scalar
// form's maximum unvectorised (a float max reduction needs -ffast-math) and rounds each
// probability to bf16 one lane at a time, which together took longer than q.k.
inline float softmax_row_bf16(const float* scores, int ctx, uint16_t* probs) {
    const int full = ctx & ~15;
    const __mmask16 tail = static_cast<__mmask16>((1u << (ctx - full)) - 1);
    __m512 mv = _mm512_set1_ps(-INFINITY);
    for (int t = 0; t < full; t += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(scores + t));
    if (tail) mv = _mm512_mask_max_ps(mv, tail, mv, _mm512_maskz_loadu_ps(tail, scores + full));
    const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mv));
    __m512 sum = _mm512_setzero_ps();
    for (int t = 0; t < full; t += 16) {
        const __m512 p = exp512(_mm512_sub_ps(_mm512_loadu_ps(scores + t), m));
        sum = _mm512_add_ps(sum, p);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(probs + t), (__m256i)_mm512_cvtneps_pbh(p));
    }
    if (tail) {
        const __m512 p = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, scores + full), m));
        sum = _mm512_mask_add_ps(sum, tail, sum, p);
        _mm256_mask_storeu_epi16(probs + full, tail, (__m256i)_mm512_cvtneps_pbh(p));
    }
    return 1.f / sum_lanes(sum);  // the tree cpu_prefill.cpp's row form repeats across lanes
}

// s[j] = sum of the 16 lanes of v[j], j < 16, each in one tree: ((y_0 + y_1) + (y_2 + y_3)),
// y_L = (x_4L + x_4L+2) + (x_4L+1 + x_4L+3) over its lanes x (cpu_prefill.cpp's row form repeats
// it across lanes: change both together).
inline __m512 transpose_sum16(__m512 v[16]) {
    __m512 t[8], u[4];
    for (int i = 0; i < 8; ++i)
        t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; ++i) {
        const __m512d a = _mm512_castps_pd(t[2 * i]), b = _mm512_castps_pd(t[2 * i + 1]);
        u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }  // u[i]: keys 4i..4i+3 in each 128-bit lane, summed over that lane's dimensions
    const __m512 x01 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88),
                                     _mm512_shuffle_f32x4(u[0], u[1], 0xDD));
    const __m512 x23 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x88),
                                     _mm512_shuffle_f32x4(u[2], u[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(x01, x23, 0x88), _mm512_shuffle_f32x4(x01, x23, 0xDD));
}

// scores[r * ctx + t] = scale * q_r . k_t for the rows of one page (n <= block_size). Each group
// of 16 rows requests the same rows of the next page (`next`, n_next rows): a steady distance of
// one page ahead keeps the threads reading random pages from DRAM faster than requesting the
// whole next page at each page's start (the same in P.V below). `values` (or null): this page's
// V rows, requested into L2 beside their K rows so that P.V finds them there.
template <int kChunks>
inline void page_scores(const __m512bh* qv, int rep, const uint16_t* page, int n, int t0,
                        float scale, float* scores, int ctx, const uint16_t* next, int n_next,
                        const uint16_t* values) {
    constexpr int dim = 32 * kChunks;
    for (int j0 = 0; j0 < n; j0 += 16) {
        const int m = std::min(16, n - j0);
        for (int j = j0; j < std::min(j0 + 16, n_next); ++j) prefetch_row(next + j * dim, dim);
        if (values != nullptr)
            for (int j = j0; j < j0 + m; ++j) prefetch_row(values + j * dim, dim);
        const __mmask16 keep = static_cast<__mmask16>((1u << m) - 1);
        for (int r = 0; r < rep; ++r) {
            __m512 acc[16];
            for (int j = 0; j < 16; ++j) {
                acc[j] = _mm512_setzero_ps();
                if (j < m) {
                    const uint16_t* k = page + static_cast<int64_t>(j0 + j) * dim;
                    for (int c = 0; c < kChunks; ++c)
                        acc[j] = _mm512_dpbf16_ps(acc[j], qv[r * kChunks + c],
                                                  (__m512bh)_mm512_loadu_si512(k + 32 * c));
                }
            }
            const __m512 s = _mm512_mul_ps(transpose_sum16(acc), _mm512_set1_ps(scale));
            _mm512_mask_storeu_ps(scores + r * ctx + t0 + j0, keep, s);
        }
    }
}

// acc[r][2c], acc[r][2c + 1] += p_r,t * v_t + p_r,t+1 * v_t+1 over dims 32c..32c+31 (interleaved:
// lane 4L + i of the first is dim 32c + 8L + i, of the second dim 32c + 8L + 4 + i).
template <int kChunks, int kRep>
inline void pv_pair(const uint16_t* v0, const uint16_t* v1, const uint16_t* probs, int stride,
                    int t, uint32_t partner, __m512 (&acc)[kRep][2 * kChunks]) {
    __m512i lo[kChunks], hi[kChunks];
    for (int c = 0; c < kChunks; ++c) {
        const __m512i a = _mm512_loadu_si512(v0 + 32 * c), b = _mm512_loadu_si512(v1 + 32 * c);
        lo[c] = _mm512_unpacklo_epi16(a, b);
        hi[c] = _mm512_unpackhi_epi16(a, b);
    }
    for (int r = 0; r < kRep; ++r) {
        uint32_t pair;
        std::memcpy(&pair, probs + static_cast<int64_t>(r) * stride + t, 4);
        pair &= partner;  // 0xFFFF: no partner row, its probability taken as 0
        const __m512bh p = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
        for (int c = 0; c < kChunks; ++c) {
            acc[r][2 * c] = _mm512_dpbf16_ps(acc[r][2 * c], (__m512bh)lo[c], p);
            acc[r][2 * c + 1] = _mm512_dpbf16_ps(acc[r][2 * c + 1], (__m512bh)hi[c], p);
        }
    }
}

// out rows [r0, r0 + kRep) of one (sequence, KV head): sum over t of probs[r][t] * v_t, times inv.
template <int kChunks, int kRep>
void pv_rows(const uint16_t* v_head, const int32_t* table, int ctx, int bs, const uint16_t* probs,
             int stride, const float* inv, uint16_t* out) {
    constexpr int dim = 32 * kChunks;
    __m512 acc[kRep][2 * kChunks];
    for (int r = 0; r < kRep; ++r)
        for (int c = 0; c < 2 * kChunks; ++c) acc[r][c] = _mm512_setzero_ps();
    for (int t0 = 0, b = 0; t0 < ctx; t0 += bs, ++b) {
        const uint16_t* page = v_head + static_cast<int64_t>(table[b]) * bs * dim;
        const int n = std::min(bs, ctx - t0);
        const int n_next = std::min(bs, ctx - t0 - bs);  // rows of the next page (<= 0: none)
        const uint16_t* next = n_next > 0 ? v_head + static_cast<int64_t>(table[b + 1]) * bs * dim
                                          : page;
        int j = 0;
        for (; j + 1 < n; j += 2) {
            if (j + 1 < n_next) {  // into L1: q.k above requested every value into L2
                prefetch_row<uint16_t, false>(next + j * dim, dim);
                prefetch_row<uint16_t, false>(next + (j + 1) * dim, dim);
            } else if (j < n_next) {
                prefetch_row<uint16_t, false>(next + j * dim, dim);
            }
            pv_pair<kChunks, kRep>(page + j * dim, page + (j + 1) * dim, probs, stride, t0 + j,
                                   0xFFFFFFFFu, acc);
        }
        if (j < n)  // an odd last row of the page: paired with itself at probability 0
            pv_pair<kChunks, kRep>(page + j * dim, page + j * dim, probs, stride, t0 + j, 0xFFFFu,
                                   acc);
    }
    for (int r = 0; r < kRep; ++r) {
        alignas(64) float lanes[2 * kChunks * 16];
        for (int c = 0; c < 2 * kChunks; ++c) _mm512_store_ps(lanes + 16 * c, acc[r][c]);
        uint16_t* o = out + r * dim;
        for (int c = 0; c < kChunks; ++c)
            for (int half = 0; half < 2; ++half)
                for (int lane = 0; lane < 16; ++lane)
                    store(lanes[16 * (2 * c + half) + lane] * inv[r],
                          o + 32 * c + 8 * (lane / 4) + 4 * half + lane % 4);
    }
}

template <int kChunks, int kRep>
void pv_dispatch(const uint16_t* v_head, const int32_t* table, int ctx, int bs,
                 const uint16_t* probs, int stride, const float* inv, uint16_t* out, int rep) {
    constexpr int dim = 32 * kChunks;
    int r0 = 0;  // query heads in groups of kRep (accumulators kept in registers), then the rest
    for (; r0 + kRep <= rep; r0 += kRep)
        pv_rows<kChunks, kRep>(v_head, table, ctx, bs, probs + r0 * stride, stride, inv + r0,
                               out + r0 * dim);
    for (; r0 < rep; ++r0)
        pv_rows<kChunks, 1>(v_head, table, ctx, bs, probs + r0 * stride, stride, inv + r0,
                            out + r0 * dim);
}

template <int kChunks>
void attend_bf16(const uint16_t* q, const uint16_t* k_head, const uint16_t* v_head, uint16_t* out,
                 const int32_t* table, int ctx, const Shape& shape, float scale,
                 std::vector<float>& buf) {
    constexpr int dim = 32 * kChunks;
    const int rep = shape.num_heads / shape.num_kv_heads;
    const int bs = shape.block_size;
    const int stride = ctx + 2;  // probabilities per query head, even, with a zero after the last
    buf.resize(static_cast<size_t>(rep) * ctx + rep + (static_cast<size_t>(rep) * stride + 1) / 2 + 1);
    float* scores = buf.data();          // [rep, ctx]
    float* inv = scores + rep * ctx;     // [rep]: 1 / the softmax's normaliser
    uint16_t* probs = reinterpret_cast<uint16_t*>(inv + rep);  // [rep, stride] bf16 bits
    __m512bh qv[8 * kChunks];
    const int rep_tile = std::min(rep, 8);
    for (int r0 = 0; r0 < rep; r0 += rep_tile) {  // q.k for up to 8 query heads per pass over K
        const int reps = std::min(rep_tile, rep - r0);
        for (int r = 0; r < reps; ++r)
            for (int c = 0; c < kChunks; ++c)
                qv[r * kChunks + c] =
                    (__m512bh)_mm512_loadu_si512(q + (r0 + r) * shape.q_stride_h + 32 * c);
        for (int t0 = 0, b = 0; t0 < ctx; t0 += bs, ++b) {
            const uint16_t* page = k_head + static_cast<int64_t>(table[b]) * bs * dim;
            const int n_next = std::min(bs, ctx - t0 - bs);  // rows of the next page (<= 0: none)
            const uint16_t* next = n_next > 0
                ? k_head + static_cast<int64_t>(table[b + 1]) * bs * dim : page;
            page_scores<kChunks>(qv, reps, page, std::min(bs, ctx - t0), t0, scale,
                                 scores + r0 * ctx, ctx, next, n_next,
                                 r0 == 0 ? v_head + static_cast<int64_t>(table[b]) * bs * dim
                                         : nullptr);
        }
    }
    for (int r = 0; r < rep; ++r) {
        uint16_t* pr = probs + static_cast<int64_t>(r) * stride;
        // P.V takes the probabilities rounded to bf16, as SDPA's bf16 kernel
        inv[r] = softmax_row_bf16(scores + r * ctx, ctx, pr);
        pr[ctx] = pr[ctx + 1] = 0;
    }
    if (rep % 4 == 0 && kChunks <= 2)
        pv_dispatch<kChunks, 4>(v_head, table, ctx, bs, probs, stride, inv, out, rep);
    else if (rep % 3 == 0 && kChunks <= 2)
        pv_dispatch<kChunks, 3>(v_head, table, ctx, bs, probs, stride, inv, out, rep);
    else
        pv_dispatch<kChunks, 2>(v_head, table, ctx, bs, probs, stride, inv, out, rep);
}
#endif

template <int kHeadDim, typename T>
void decode(const T* q, const T* kv, T* out, const int32_t* tables, const int32_t* ctx_lens,
            int num_seqs, const Shape& shape, float scale, int num_threads) {
    const int rep = shape.num_heads / shape.num_kv_heads;
    const int64_t head_elems = shape.num_blocks * shape.block_size * shape.head_dim;
    const T* values = kv + shape.num_kv_heads * head_elems;
    const int tasks = num_seqs * shape.num_kv_heads;
    std::atomic<int> claimed{0};  // pairs taken one at a time, as OpenMP's schedule(dynamic, 1)
#pragma omp parallel num_threads(num_threads)
    {
        std::vector<float> buf;  // per thread, reused across its pairs
        int task = claimed.fetch_add(1);
        for (int following; task < tasks; task = following) {
            following = claimed.fetch_add(1);  // taken now: its first page requested meanwhile
            if (following < tasks) {
                const int seq = following / shape.num_kv_heads;
                const int64_t kvh = following % shape.num_kv_heads;
                const int32_t* table = tables + seq * shape.table_width;
                prefetch_page(kv + kvh * head_elems, table, ctx_lens[seq], shape.block_size,
                              shape.head_dim, 0);
                prefetch_page(values + kvh * head_elems, table, ctx_lens[seq], shape.block_size,
                              shape.head_dim, 0);
            }
            const int seq = task / shape.num_kv_heads, kvh = task % shape.num_kv_heads;
            const T* qs = q + kvh * rep * shape.q_stride_h + seq * shape.q_stride_t;
            T* os = out + (static_cast<int64_t>(seq) * shape.num_heads + kvh * rep) * shape.head_dim;
            const int32_t* table = tables + seq * shape.table_width;
#if defined(__AVX512BF16__) && defined(__AVX512F__)
            if constexpr (std::is_same_v<T, uint16_t> && (kHeadDim == 64 || kHeadDim == 128)) {
                attend_bf16<kHeadDim / 32>(qs, kv + kvh * head_elems, values + kvh * head_elems,
                                           os, table, ctx_lens[seq], shape, scale, buf);
                continue;
            }
#endif
#if defined(__AVX2__) && defined(__FMA__)
            if constexpr (std::is_same_v<T, float>) {
                if (shape.head_dim % 8 == 0) {
                    attend_f32<kHeadDim>(qs, kv + kvh * head_elems, values + kvh * head_elems, os,
                                         table, ctx_lens[seq], shape, scale, buf);
                    continue;
                }
            }
#endif
            attend<kHeadDim>(qs, kv + kvh * head_elems, values + kvh * head_elems, os, table,
                             ctx_lens[seq], shape, scale, buf);
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

// The arguments: cpu_attention.h.
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
