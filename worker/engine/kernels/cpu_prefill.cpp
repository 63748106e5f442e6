// Paged prefill attention on the CPU with AVX-512 (worker/engine/kernels/cpu_kernels.py builds it,
// cpu_attention.py calls it, cpu_prefill.h is its interface; elsewhere prefill chunks keep
// SDPA): bf16 K/V where the CPU has AVX512-BF16, float32 K/V on any AVX-512 CPU.
//
// A prefill chunk of n query tokens at positions [start, start + n) attends causally over its
// sequence's keys [0, start + n), read in place from the pool's blocks through the block table
// (the chunk's own K/V are written there before). SDPA's CPU flash kernel does this on a dense
// copy of the keys, and on CPUs without AMX its bf16 products run as fp32 sgemm on converted
// copies; here every bf16 product is a pair dot product (vdpbf16ps: two exact bf16 products summed
// into an fp32 lane), every float32 product an FMA, with no copy of the keys.
//
// Work is split into tasks of (chunk, KV head, tile of 16 query tokens); each task's rows are its
// 16 tokens x the `rep` query heads of that KV head. The rows lie across the lanes of the vectors
// (one 16-lane vector per query head), so that the softmax over the keys is element-wise between
// vectors and nothing is summed across lanes:
//   1. scores S[t][row] = scale * q_row . k_t: each key's dimensions (bf16: dimension pairs)
//      broadcast against the rows' (packed once per task), 8 keys x up to 3 heads of accumulators
//      in registers;
//   2. keys after a row's position masked; an exact softmax per row in fp32 (the maximum over all
//      keys first), the normaliser summed from the unrounded probabilities; in bf16 the
//      probabilities are then rounded to bf16 for P.V, as SDPA's bf16 kernel and the decode
//      kernel do;
//   3. O[row][d] = sum_t P[t][row] v_t[d]: each V element broadcast against 16 rows'
//      probabilities (bf16: the V rows of two keys interleaved per dimension, packed once per
//      task, against the two keys' probabilities).
// Each task is computed by one thread alone, so results do not depend on the thread count.
//
// The row form (kvfleet_paged_prefill_rows, bf16): the same steps with every sum in the decode
// kernel's order (cpu_attention.cpp), so each row equals that kernel's for the row alone, bit
// for bit: q.k as its 16 lane sums and their tree, the normaliser as its 16 lanes by key index
// mod 16 and their tree (sum_vectors); P.V's pairs of keys are already its pairs where pages
// hold an even number of keys. Batch-invariant engines compute prefill chunks with it.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "cpu_kernels.h"
#include "cpu_prefill.h"

#if defined(__AVX512F__)
#define KVFLEET_PREFILL_F32 1
#endif
#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__)
#define KVFLEET_PREFILL_BF16 1
#endif

namespace {

using namespace kvfleet;

#if KVFLEET_PREFILL_F32
constexpr int kTile = 16;  // query tokens per task: one vector lane each
constexpr int kKeys = 8;   // keys per register block of step 1

struct PrefillShape {
    int num_heads, num_kv_heads, head_dim, block_size;
    int64_t num_blocks, table_width, q_stride_h, q_stride_t;
};

struct Task {
    int chunk, kv_head, first;  // first: the tile's first query token within the chunk
    int64_t cost;               // keys, to start the longest tasks first
};

// Per-thread buffers of one task, reused across tasks.
struct Buffers {
    std::vector<float> s;       // [keys][rep][16]: scores, then probabilities (fp32)
    std::vector<float> o;       // [rep][dim][16]: P.V sums, rows across lanes
    std::vector<float> stats;   // [rep * 16]: 1 / each row's normaliser
    std::vector<uint32_t> qw;   // [32-bit words of a row][rep][16]: queries, rows across lanes
    // bf16
    std::vector<uint32_t> pp;   // [keys / 2][rep][16]: probabilities of keys 2t, 2t+1 as bf16 pairs
    std::vector<uint32_t> vp;   // [keys / 2][dim]: v_2t[d], v_2t+1[d] as a bf16 pair
    std::vector<uint16_t> kbuf; // [8][dim]: key rows of a block that crosses a page or the end
    std::vector<uint16_t> zero; // [dim]: the V row of keys past the end
    // float32
    std::vector<float> kbuf_f;  // [8][dim]
    std::vector<const float*> vrows;  // [keys]: each key's V row in the pool
};

template <typename T>
inline const T* key_row(const T* head, const int32_t* table, int t, int bs, int dim) {
    return head + (static_cast<int64_t>(table[t / bs]) * bs + t % bs) * dim;
}

// Keeps a vector in a register: GCC otherwise reloads loop-invariant operands from memory before
// every vdpbf16ps, which makes both products load-bound.
template <typename V>
inline void pin(V& v) { asm("" : "+v"(v)); }

// Step 1 over every key in register blocks of 8 keys: block(rows, s) for each. Keys of a block
// that lie in one page are read there (a page's rows lie one after another); others are copied
// into `kbuf` first, zero past the last key.
template <int kDim, typename T, typename Block>
void for_key_blocks(const T* k_head, const int32_t* table, int keys, int bs, T* kbuf, float* s,
                    int width, Block&& block) {
    for (int t0 = 0; t0 < keys; t0 += kKeys) {
        const T* rows;
        if (t0 + kKeys <= keys && t0 / bs == (t0 + kKeys - 1) / bs) {
            rows = key_row(k_head, table, t0, bs, kDim);
        } else {
            for (int j = 0; j < kKeys; ++j) {
                if (t0 + j < keys)
                    std::memcpy(kbuf + j * kDim, key_row(k_head, table, t0 + j, bs, kDim),
                                sizeof(T) * kDim);
                else
                    std::memset(kbuf + j * kDim, 0, sizeof(T) * kDim);
            }
            rows = kbuf;
        }
        block(rows, s + static_cast<int64_t>(t0) * width);
    }
}

// Step 2 for every head: keys past a row's position (and past the last key) masked, an exact
// softmax per row (lane) in fp32, the maximum over all keys first; emit(t, h, p_2t, p_2t+1)
// takes each pair of keys' probabilities (unrounded, in key order); inv gets 1 / the
// normalisers, summed from the unrounded probabilities; kRows (the row form): in the decode
// kernel's order, 16 sums by key index mod 16 (its lanes), then sum_vectors (its sum_lanes).
template <bool kRows, typename Emit>
inline void masked_softmax(float* s, int rep, int keys, int padded, int diagonal, float* inv,
                           Emit&& emit) {
    const int width = rep * kTile;
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512 minus_inf = _mm512_set1_ps(-INFINITY);
    for (int h = 0; h < rep; ++h) {
        float* sh = s + h * kTile;
        // row i (query position diagonal + i) sees key t when t <= diagonal + i, t < keys
        for (int t = diagonal; t < padded; ++t) {
            const __mmask16 hidden = t >= keys ? static_cast<__mmask16>(0xFFFF)
                : _mm512_cmplt_epi32_mask(_mm512_add_epi32(lane, _mm512_set1_epi32(diagonal)),
                                          _mm512_set1_epi32(t));
            float* st = sh + static_cast<int64_t>(t) * width;
            _mm512_storeu_ps(st, _mm512_mask_mov_ps(_mm512_loadu_ps(st), hidden, minus_inf));
        }
        __m512 mx = minus_inf;
        for (int t = 0; t < keys; ++t)
            mx = _mm512_max_ps(mx, _mm512_loadu_ps(sh + static_cast<int64_t>(t) * width));
        __m512 sum = _mm512_setzero_ps();
        __m512 part[16] = {};  // kRows: by key index mod 16 (padded is a multiple of 8)
        for (int t8 = 0; t8 < padded / 2; t8 += 8) {
            for (int u = 0; u < 8 && t8 + u < padded / 2; ++u) {
                const int t = t8 + u;
                const __m512 se = _mm512_loadu_ps(sh + static_cast<int64_t>(2 * t) * width);
                const __m512 so = _mm512_loadu_ps(sh + static_cast<int64_t>(2 * t + 1) * width);
                const __m512 pe = _mm512_maskz_mov_ps(_mm512_cmpneq_ps_mask(se, minus_inf),
                                                      exp512(_mm512_sub_ps(se, mx)));
                const __m512 po = _mm512_maskz_mov_ps(_mm512_cmpneq_ps_mask(so, minus_inf),
                                                      exp512(_mm512_sub_ps(so, mx)));
                if constexpr (kRows) {
                    part[2 * u] = _mm512_add_ps(part[2 * u], pe);
                    part[2 * u + 1] = _mm512_add_ps(part[2 * u + 1], po);
                } else {
                    sum = _mm512_add_ps(_mm512_add_ps(sum, pe), po);
                }
                emit(t, h, pe, po);
            }
        }
        if constexpr (kRows) sum = sum_vectors(part);
        _mm512_storeu_ps(inv + h * kTile, _mm512_div_ps(_mm512_set1_ps(1.f), sum));
    }
}

// Runs body.template operator()<G>(h0) over the heads in blocks of 3, 2 and 1.
template <typename Body>
inline void for_head_blocks(int rep, Body&& body) {
    int h0 = 0;
    for (; h0 + 3 <= rep; h0 += 3) body(std::integral_constant<int, 3>{}, h0);
    for (; h0 + 2 <= rep; h0 += 2) body(std::integral_constant<int, 2>{}, h0);
    for (; h0 < rep; ++h0) body(std::integral_constant<int, 1>{}, h0);
}

// float32 step 1 for kKeys keys (rows of kDim in `k`, one after another) and G query heads.
template <int G, int kDim>
inline void score_block_f32(const float* qf, int rep, const float* k, float* s, float scale) {
    __m512 acc[kKeys][G];
    for (int j = 0; j < kKeys; ++j)
        for (int h = 0; h < G; ++h) acc[j][h] = _mm512_setzero_ps();
    for (int d = 0; d < kDim; ++d) {
        __m512 q[G];
        for (int h = 0; h < G; ++h) {
            q[h] = _mm512_loadu_ps(qf + (static_cast<int64_t>(d) * rep + h) * kTile);
            pin(q[h]);
        }
        for (int j = 0; j < kKeys; ++j) {
            const __m512 b = _mm512_set1_ps(k[j * kDim + d]);
            for (int h = 0; h < G; ++h) acc[j][h] = _mm512_fmadd_ps(q[h], b, acc[j][h]);
        }
    }
    const __m512 sc = _mm512_set1_ps(scale);
    for (int j = 0; j < kKeys; ++j)
        for (int h = 0; h < G; ++h)
            _mm512_storeu_ps(s + (static_cast<int64_t>(j) * rep + h) * kTile,
                             _mm512_mul_ps(acc[j][h], sc));
}

// float32 step 3 for G query heads and kDims dimensions [d0, d0 + kDims): O over every key.
template <int G, int kDims, int kDim>
inline void pv_block_f32(const float* p, const float* const* vrows, int rep, int keys, int d0,
                         float (*o)[kTile]) {
    const int width = rep * kTile;
    __m512 acc[kDims][G];
    for (int j = 0; j < kDims; ++j)
        for (int h = 0; h < G; ++h) acc[j][h] = _mm512_setzero_ps();
    for (int t = 0; t < keys; ++t) {
        __m512 pr[G];
        for (int h = 0; h < G; ++h) {
            pr[h] = _mm512_loadu_ps(p + static_cast<int64_t>(t) * width + h * kTile);
            pin(pr[h]);
        }
        const float* v = vrows[t] + d0;
        for (int j = 0; j < kDims; ++j) {
            const __m512 b = _mm512_set1_ps(v[j]);
            for (int h = 0; h < G; ++h) acc[j][h] = _mm512_fmadd_ps(pr[h], b, acc[j][h]);
        }
    }
    for (int j = 0; j < kDims; ++j)
        for (int h = 0; h < G; ++h) _mm512_storeu_ps(o[h * kDim + d0 + j], acc[j][h]);
}

// out rows of the task's tokens: O / normaliser, rows across lanes back to [token][head][dim].
template <int kDim, typename T>
inline void store_rows(const float (*o)[kTile], const float* inv, int tokens, int rep, int kvh,
                       int row0, const PrefillShape& shape, T* out) {
    for (int i = 0; i < tokens; ++i) {
        T* row = out + (static_cast<int64_t>(row0 + i) * shape.num_heads + kvh * rep) * kDim;
        for (int h = 0; h < rep; ++h)
            for (int d = 0; d < kDim; ++d)
                store(o[h * kDim + d][i] * inv[h * kTile + i], row + h * kDim + d);
    }
}

// What one task covers: 16 tokens x rep heads of KV head `kvh` of one chunk (tokens past the
// chunk's end are zero rows, never stored), the keys its last token sees, its K and V heads.
template <typename T>
struct TaskRange {
    int rep, tokens, keys, padded, width, row0;
    const T* k_head;
    const T* v_head;
};

template <int kDim, typename T>
TaskRange<T> task_range(const T* kv, int q_start, int n, int start, int first, int kvh,
                        const PrefillShape& shape) {
    TaskRange<T> r;
    r.rep = shape.num_heads / shape.num_kv_heads;
    r.tokens = std::min(kTile, n - first);
    r.keys = start + first + r.tokens;  // the tile's last token sees keys [0, keys)
    r.padded = (r.keys + kKeys - 1) / kKeys * kKeys;  // a multiple of 8, so even
    r.width = r.rep * kTile;  // floats per key in S
    r.row0 = q_start + first;
    const int64_t head_elems = shape.num_blocks * shape.block_size * kDim;
    r.k_head = kv + kvh * head_elems;
    r.v_head = kv + (shape.num_kv_heads + kvh) * head_elems;
    return r;
}

// The task's query rows across lanes, 32 bits at a time (a float32 dimension, or a bf16 pair):
// words[(w * rep + h) * 16 + i] = word w of token i's query head h; zero past the chunk's end.
template <int kDim, typename T>
void pack_queries(const T* q, const TaskRange<T>& r, int kvh, const PrefillShape& shape,
                  std::vector<uint32_t>& words) {
    constexpr int kWords = kDim * static_cast<int>(sizeof(T)) / 4;
    words.assign(static_cast<size_t>(kWords) * r.width, 0u);
    for (int h = 0; h < r.rep; ++h)
        for (int i = 0; i < r.tokens; ++i) {
            const T* src = q + (kvh * r.rep + h) * shape.q_stride_h +
                           static_cast<int64_t>(r.row0 + i) * shape.q_stride_t;
            for (int w = 0; w < kWords; ++w)
                std::memcpy(&words[(static_cast<size_t>(w) * r.rep + h) * kTile + i],
                            reinterpret_cast<const char*>(src) + 4 * w, 4);
        }
}

// One float32 task: 16 tokens x rep heads of KV head `kvh` of one chunk.
template <int kDim>
void prefill_task_f32(const float* q, const float* kv, float* out, const int32_t* table,
                      int q_start, int n, int start, int first, int kvh, const PrefillShape& shape,
                      float scale, Buffers& buf) {
    const TaskRange<float> r = task_range<kDim>(kv, q_start, n, start, first, kvh, shape);
    const int bs = shape.block_size, rep = r.rep, keys = r.keys, padded = r.padded;
    const int width = r.width;
    pack_queries<kDim>(q, r, kvh, shape, buf.qw);
    const float* qf = reinterpret_cast<const float*>(buf.qw.data());
    buf.s.resize(static_cast<size_t>(padded) * width);
    buf.kbuf_f.resize(kKeys * kDim);
    float* s = buf.s.data();
    for_head_blocks(rep, [&](auto g, int h0) {
        for_key_blocks<kDim>(r.k_head, table, keys, bs, buf.kbuf_f.data(), s + h0 * kTile, width,
                             [&](const float* rows, float* sb) {
            score_block_f32<decltype(g)::value, kDim>(qf + h0 * kTile, rep, rows, sb, scale);
        });
    });
    buf.stats.resize(width);
    float* inv = buf.stats.data();
    masked_softmax<false>(s, rep, keys, padded, start + first, inv,
                          [&](int t, int h, __m512 pe, __m512 po) {  // unrounded, back into S
        _mm512_storeu_ps(s + static_cast<int64_t>(2 * t) * width + h * kTile, pe);
        _mm512_storeu_ps(s + static_cast<int64_t>(2 * t + 1) * width + h * kTile, po);
    });
    buf.vrows.resize(keys);
    for (int t = 0; t < keys; ++t) buf.vrows[t] = key_row(r.v_head, table, t, bs, kDim);
    buf.o.resize(static_cast<size_t>(rep) * kDim * kTile);
    auto o = reinterpret_cast<float (*)[kTile]>(buf.o.data());
    for_head_blocks(rep, [&](auto g, int h0) {
        constexpr int G = decltype(g)::value;
        constexpr int kDims = G == 1 ? 16 : 8;
        for (int d0 = 0; d0 < kDim; d0 += kDims)
            pv_block_f32<G, kDims, kDim>(s + h0 * kTile, buf.vrows.data(), rep, keys, d0,
                                         o + h0 * kDim);
    });
    store_rows<kDim>(o, inv, r.tokens, rep, kvh, r.row0, shape, out);
}

#if KVFLEET_PREFILL_BF16
// Step 1 for kKeys keys (rows of kDim in `k`, one after another) and G query heads:
// S[j][h][lanes] (fp32).
template <int G, int kDim>
inline void score_block(const uint32_t* qp, int rep, const uint16_t* k, float* s, float scale) {
    __m512 acc[kKeys][G];
    for (int j = 0; j < kKeys; ++j)
        for (int h = 0; h < G; ++h) acc[j][h] = _mm512_setzero_ps();
    for (int p = 0; p < kDim / 2; ++p) {
        __m512bh q[G];
        for (int h = 0; h < G; ++h) {
            q[h] = (__m512bh)_mm512_loadu_si512(qp + (static_cast<int64_t>(p) * rep + h) * kTile);
            pin(q[h]);
        }
        for (int j = 0; j < kKeys; ++j) {
            int32_t pair;
            std::memcpy(&pair, k + j * kDim + 2 * p, 4);
            const __m512bh b = (__m512bh)_mm512_set1_epi32(pair);
            for (int h = 0; h < G; ++h) acc[j][h] = _mm512_dpbf16_ps(acc[j][h], q[h], b);
        }
    }
    const __m512 sc = _mm512_set1_ps(scale);
    for (int j = 0; j < kKeys; ++j)
        for (int h = 0; h < G; ++h)
            _mm512_storeu_ps(s + (static_cast<int64_t>(j) * rep + h) * kTile,
                             _mm512_mul_ps(acc[j][h], sc));  // scaled after the dot, as SDPA
}

// Step 1 in the row form, for query head h and kKeys keys: each score in the decode kernel's
// order (cpu_attention.cpp, page_scores): 16 partial sums x_l, x_l over the 32-dimension chunks
// in order of the pair product of word 16c + l, then ((y_0 + y_1) + (y_2 + y_3)) with
// y_L = (x_4L + x_4L+2) + (x_4L+1 + x_4L+3) (its transpose_sum16), then the scale: the same
// operations on the same operands, the query rows across lanes. 4 keys at a time.
template <int kDim>
inline void score_block_rows(const uint32_t* qp, int rep, int h, const uint16_t* k, float* s,
                             float scale) {
    constexpr int kChunks = kDim / 32, kGroup = 4;
    const __m512 sc = _mm512_set1_ps(scale);
    for (int j0 = 0; j0 < kKeys; j0 += kGroup) {
        __m512 z01[kGroup], y2[kGroup];
        for (int L = 0; L < 4; ++L) {
            __m512 x[kGroup][4];
            for (int j = 0; j < kGroup; ++j)
                for (int i = 0; i < 4; ++i) x[j][i] = _mm512_setzero_ps();
            for (int c = 0; c < kChunks; ++c)
                for (int i = 0; i < 4; ++i) {
                    const int w = 16 * c + 4 * L + i;  // the 32-bit word of lane 4L + i, chunk c
                    const __m512bh q = (__m512bh)_mm512_loadu_si512(
                        qp + (static_cast<int64_t>(w) * rep + h) * kTile);
                    for (int j = 0; j < kGroup; ++j) {
                        int32_t pair;
                        std::memcpy(&pair, k + (j0 + j) * kDim + 2 * w, 4);
                        x[j][i] = _mm512_dpbf16_ps(x[j][i], q, (__m512bh)_mm512_set1_epi32(pair));
                    }
                }
            for (int j = 0; j < kGroup; ++j) {
                const __m512 y = _mm512_add_ps(_mm512_add_ps(x[j][0], x[j][2]),
                                               _mm512_add_ps(x[j][1], x[j][3]));
                if (L < 2) z01[j] = L == 0 ? y : _mm512_add_ps(z01[j], y);
                else if (L == 2) y2[j] = y;
                else
                    _mm512_storeu_ps(s + (static_cast<int64_t>(j0 + j) * rep + h) * kTile,
                                     _mm512_mul_ps(_mm512_add_ps(z01[j], _mm512_add_ps(y2[j], y)), sc));
            }
        }
    }
}

// Step 3 for G query heads and kDims dimensions [d0, d0 + kDims): O over every key pair.
template <int G, int kDims, int kDim>
inline void pv_block(const uint32_t* pp, const uint32_t* vp, int rep, int key_pairs, int d0,
                     float (*o)[kTile] /* [rep * kDim][16]: row (h, d) */) {
    __m512 acc[kDims][G];
    for (int j = 0; j < kDims; ++j)
        for (int h = 0; h < G; ++h) acc[j][h] = _mm512_setzero_ps();
    for (int t = 0; t < key_pairs; ++t) {
        __m512bh p[G];
        for (int h = 0; h < G; ++h) {
            p[h] = (__m512bh)_mm512_loadu_si512(pp + (static_cast<int64_t>(t) * rep + h) * kTile);
            pin(p[h]);
        }
        const uint32_t* v = vp + static_cast<int64_t>(t) * kDim + d0;
        for (int j = 0; j < kDims; ++j) {
            const __m512bh b = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(v[j]));
            for (int h = 0; h < G; ++h) acc[j][h] = _mm512_dpbf16_ps(acc[j][h], p[h], b);
        }
    }
    for (int j = 0; j < kDims; ++j)
        for (int h = 0; h < G; ++h) _mm512_storeu_ps(o[h * kDim + d0 + j], acc[j][h]);
}

// One bf16 task: 16 tokens x rep heads of KV head `kvh` of one chunk; kRows: the row form.
template <int kDim, bool kRows>
void prefill_task_bf16(const uint16_t* q, const uint16_t* kv, uint16_t* out, const int32_t* table,
                       int q_start, int n, int start, int first, int kvh,
                       const PrefillShape& shape, float scale, Buffers& buf) {
    const TaskRange<uint16_t> r = task_range<kDim>(kv, q_start, n, start, first, kvh, shape);
    const int bs = shape.block_size, rep = r.rep, keys = r.keys, padded = r.padded;
    const int width = r.width, key_pairs = padded / 2;
    pack_queries<kDim>(q, r, kvh, shape, buf.qw);  // dimension pairs

    // 1. scores
    buf.s.resize(static_cast<size_t>(padded) * width);
    buf.kbuf.resize(kKeys * kDim);
    float* s = buf.s.data();
    if constexpr (kRows) {
        for_key_blocks<kDim>(r.k_head, table, keys, bs, buf.kbuf.data(), s, width,
                             [&](const uint16_t* rows, float* sb) {
            for (int h = 0; h < rep; ++h)
                score_block_rows<kDim>(buf.qw.data(), rep, h, rows, sb, scale);
        });
    } else {
        for_head_blocks(rep, [&](auto g, int h0) {
            for_key_blocks<kDim>(r.k_head, table, keys, bs, buf.kbuf.data(), s + h0 * kTile,
                                 width, [&](const uint16_t* rows, float* sb) {
                score_block<decltype(g)::value, kDim>(buf.qw.data() + h0 * kTile, rep, rows, sb,
                                                      scale);
            });
        });
    }

    // 2. the probabilities as bf16 pairs of keys
    buf.stats.resize(width);
    float* inv = buf.stats.data();
    buf.pp.resize(static_cast<size_t>(key_pairs) * width);
    // bf16 of keys 2t (low half) and 2t+1 (high half) in each 32-bit lane
    const __m512i interleave = _mm512_set_epi16(
        31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
        23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    masked_softmax<kRows>(s, rep, keys, padded, start + first, inv,
                          [&](int t, int h, __m512 pe, __m512 po) {
        // cvtne2ps: lanes 0-15 from the second argument, 16-31 from the first (round to even)
        const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(po, pe);
        _mm512_storeu_si512(buf.pp.data() + static_cast<int64_t>(t) * width + h * kTile,
                            _mm512_permutexvar_epi16(interleave, both));
    });

    // 3. V rows of each key pair interleaved per dimension, then P.V
    buf.vp.resize(static_cast<size_t>(key_pairs) * kDim);
    buf.zero.assign(kDim, 0);
    const __m512i lo = _mm512_set_epi16(
        47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
        39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i hi = _mm512_set_epi16(
        63, 31, 62, 30, 61, 29, 60, 28, 59, 27, 58, 26, 57, 25, 56, 24,
        55, 23, 54, 22, 53, 21, 52, 20, 51, 19, 50, 18, 49, 17, 48, 16);
    for (int t = 0; t < key_pairs; ++t) {
        const uint16_t* zero = buf.zero.data();
        const uint16_t* a = 2 * t < keys ? key_row(r.v_head, table, 2 * t, bs, kDim) : zero;
        const uint16_t* b = 2 * t + 1 < keys ? key_row(r.v_head, table, 2 * t + 1, bs, kDim) : zero;
        uint32_t* dst = buf.vp.data() + static_cast<int64_t>(t) * kDim;
        for (int d = 0; d < kDim; d += 32) {
            const __m512i x = _mm512_loadu_si512(a + d), y = _mm512_loadu_si512(b + d);
            _mm512_storeu_si512(dst + d, _mm512_permutex2var_epi16(x, lo, y));
            _mm512_storeu_si512(dst + d + 16, _mm512_permutex2var_epi16(x, hi, y));
        }
    }
    buf.o.resize(static_cast<size_t>(rep) * kDim * kTile);
    auto o = reinterpret_cast<float (*)[kTile]>(buf.o.data());
    for_head_blocks(rep, [&](auto g, int h0) {
        constexpr int G = decltype(g)::value;
        constexpr int kDims = G == 1 ? 16 : 8;
        for (int d0 = 0; d0 < kDim; d0 += kDims)
            pv_block<G, kDims, kDim>(buf.pp.data() + h0 * kTile, buf.vp.data(), rep, key_pairs,
                                     d0, o + h0 * kDim);
    });
    store_rows<kDim>(o, inv, r.tokens, rep, kvh, r.row0, shape, out);
}
#endif  // KVFLEET_PREFILL_BF16
#endif  // KVFLEET_PREFILL_F32

}  // namespace

// The arguments of all: cpu_prefill.h.
extern "C" int kvfleet_prefill_supported(int dtype, int head_dim) {
    const bool shape = head_dim == 64 || head_dim == 128;
#if KVFLEET_PREFILL_BF16
    if (dtype == 1) return shape ? 1 : 0;
#endif
#if KVFLEET_PREFILL_F32
    if (dtype == 0) return shape ? 1 : 0;
#endif
    (void)dtype, (void)shape;
    return 0;
}

extern "C" int kvfleet_prefill_rows_supported(int head_dim) {
    return kvfleet_prefill_supported(1, head_dim);
}

namespace {

// form 0: float32; 1: bf16; 2: bf16 in the row form.
int paged_prefill(int form, const void* q, int64_t q_stride_h, int64_t q_stride_t, const void* kv,
                  void* out, const int32_t* tables, int64_t table_width, const int32_t* q_starts,
                  const int32_t* q_lens, const int32_t* ctx_ends, int num_chunks, int num_heads,
                  int num_kv_heads, int head_dim, int64_t num_blocks, int block_size, float scale,
                  int num_threads) {
    // the row form: the decode kernel pairs keys for P.V within a page: even pages, keys 2t, 2t+1
    if (!kvfleet_prefill_supported(form == 2 ? 1 : form, head_dim) ||
        (form == 2 && block_size % 2 != 0))
        return 1;
    if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0 || block_size <= 0) return 2;
#if KVFLEET_PREFILL_F32
    const PrefillShape shape{num_heads, num_kv_heads, head_dim, block_size,
                             num_blocks, table_width, q_stride_h, q_stride_t};
    std::vector<Task> tasks;
    for (int c = 0; c < num_chunks; ++c) {
        const int start = ctx_ends[c] - q_lens[c];
        if (start < 0 || q_lens[c] <= 0) return 2;
        for (int first = 0; first < q_lens[c]; first += kTile)
            for (int h = 0; h < num_kv_heads; ++h)
                tasks.push_back({c, h, first, static_cast<int64_t>(start + first + kTile)});
    }
    std::stable_sort(tasks.begin(), tasks.end(),
                     [](const Task& a, const Task& b) { return a.cost > b.cost; });
    const int count = static_cast<int>(tasks.size());
#pragma omp parallel num_threads(num_threads)
    {
        Buffers buf;
#pragma omp for schedule(dynamic, 1)
        for (int i = 0; i < count; ++i) {
            const Task& task = tasks[i];
            const int c = task.chunk;
            const int32_t* table = tables + c * table_width;
            const int start = ctx_ends[c] - q_lens[c];
            // form and head_dim as template arguments: run(std::integral_constant<int, D>, form)
            auto run = [&](auto dim, auto form_c) {
                constexpr int kDim = decltype(dim)::value, kForm = decltype(form_c)::value;
                if constexpr (kForm == 0)
                    prefill_task_f32<kDim>(static_cast<const float*>(q),
                                           static_cast<const float*>(kv), static_cast<float*>(out),
                                           table, q_starts[c], q_lens[c], start, task.first,
                                           task.kv_head, shape, scale, buf);
#if KVFLEET_PREFILL_BF16
                else
                    prefill_task_bf16<kDim, kForm == 2>(
                        static_cast<const uint16_t*>(q), static_cast<const uint16_t*>(kv),
                        static_cast<uint16_t*>(out), table, q_starts[c], q_lens[c], start,
                        task.first, task.kv_head, shape, scale, buf);
#endif
            };
            auto in_form = [&](auto dim) {
                if (form == 0) return run(dim, std::integral_constant<int, 0>{});
                if (form == 1) return run(dim, std::integral_constant<int, 1>{});
                run(dim, std::integral_constant<int, 2>{});
            };
            if (head_dim == 64) in_form(std::integral_constant<int, 64>{});
            else in_form(std::integral_constant<int, 128>{});
        }
    }
    return 0;
#else
    return 1;  // no AVX-512: never reached (kvfleet_prefill_supported says 0)
#endif
}

}  // namespace

extern "C" int kvfleet_paged_prefill(
        int dtype, const void* q, int64_t q_stride_h, int64_t q_stride_t, const void* kv, void* out,
        const int32_t* tables, int64_t table_width, const int32_t* q_starts, const int32_t* q_lens,
        const int32_t* ctx_ends, int num_chunks, int num_heads, int num_kv_heads, int head_dim,
        int64_t num_blocks, int block_size, float scale, int num_threads) {
    if (dtype != 0 && dtype != 1) return 1;
    return paged_prefill(dtype, q, q_stride_h, q_stride_t, kv, out, tables, table_width, q_starts,
                         q_lens, ctx_ends, num_chunks, num_heads, num_kv_heads, head_dim,
                         num_blocks, block_size, scale, num_threads);
}

extern "C" int kvfleet_paged_prefill_rows(
        const void* q, int64_t q_stride_h, int64_t q_stride_t, const void* kv, void* out,
        const int32_t* tables, int64_t table_width, const int32_t* q_starts, const int32_t* q_lens,
        const int32_t* ctx_ends, int num_chunks, int num_heads, int num_kv_heads, int head_dim,
        int64_t num_blocks, int block_size, float scale, int num_threads) {
    return paged_prefill(2, q, q_stride_h, q_stride_t, kv, out, tables, table_width, q_starts,
                         q_lens, ctx_ends, num_chunks, num_heads, num_kv_heads, head_dim,
                         num_blocks, block_size, scale, num_threads);
}
