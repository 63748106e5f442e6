// Element-wise pieces of a decoder layer on the CPU, each one pass over its rows instead of the
// 4-10 small torch ops of the eager layer code (worker/engine/model/cpu_layers.py calls them).
// In bf16 every step rounds to bf16 where the eager bf16 layer rounds (RMSNorm normalises in fp32
// then scales in bf16; RoPE rounds q*cos and rotate_half(q)*sin before their sum; SiLU rounds
// before the product with up), so results follow HF's own bf16 layers; float32 is plain fp32.
#include <cstdint>
#include <cstring>
#include <algorithm>
#include <vector>

#include "cpu_kernels.h"
#include "cpu_layer_ops.h"

namespace {

using namespace kvfleet;  // load, store, rounded, exp_approx (cpu_kernels.h)

// out = weight * rms_norm(x); with residual: residual <- x + residual first, and that sum is
// what is normalised (the layer's `h = residual + attn_out; norm(h)`).
template <typename T>
void rms_norm(const T* x, T* residual, const T* weight, T* out, int64_t rows, int hidden,
              float eps, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows * hidden >= kParallelElements)
    for (int64_t i = 0; i < rows; ++i) {
        const T* xi = x + i * hidden;
        T* oi = out + i * hidden;
        const T* src = xi;
        if (residual) {
            T* ri = residual + i * hidden;
#pragma omp simd
            for (int d = 0; d < hidden; ++d) store(load(xi[d]) + load(ri[d]), ri + d);
            src = ri;
        }
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int d = 0; d < hidden; ++d) sum += load(src[d]) * load(src[d]);
        const float inv = 1.f / std::sqrt(sum / hidden + eps);
#pragma omp simd
        for (int d = 0; d < hidden; ++d)
            store(load(weight[d]) * rounded<T>(load(src[d]) * inv), oi + d);
    }
}

// x [rows, heads, dim] (row stride, head stride) rotated in place: x*cos + rotate_half(x)*sin,
// rotate_half(x) = (-x2, x1) for the halves x1, x2; cos/sin [rows, dim] contiguous.
template <typename T>
void rope(T* x, int64_t rows, int heads, int64_t row_stride, int64_t head_stride, int dim,
          const T* cos, const T* sin, int num_threads) {
    const int half = dim / 2;
#pragma omp parallel for num_threads(num_threads) if (rows * heads * dim >= kParallelElements)
    for (int64_t i = 0; i < rows; ++i) {
        const T* c = cos + i * dim;
        const T* s = sin + i * dim;
        for (int h = 0; h < heads; ++h) {
            T* xh = x + i * row_stride + h * head_stride;
#pragma omp simd
            for (int d = 0; d < half; ++d) {
                const float x1 = load(xh[d]), x2 = load(xh[d + half]);
                const float lo = rounded<T>(x1 * load(c[d])) + rounded<T>(-x2 * load(s[d]));
                const float hi = rounded<T>(x2 * load(c[d + half])) + rounded<T>(x1 * load(s[d + half]));
                store(lo, xh + d);
                store(hi, xh + d + half);
            }
        }
    }
}

// out [rows, inter] = silu(gate) * up, from gate_up [rows, 2 * inter] (gate then up).
template <typename T>
void silu_mul(const T* gate_up, T* out, int64_t rows, int inter, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows * inter >= kParallelElements)
    for (int64_t i = 0; i < rows; ++i) {
        const T* g = gate_up + i * 2 * inter;
        silu_mul_row(g, g + inter, out + i * inter, inter);
    }
}

// An MoE layer's routed terms added per token: out[t] = the sum over j < k, in order, of
// rows[at[t * k + j]] * weights[t * k + j], the product rounded to T and each partial sum rounded
// to T, from +0 (transformers' loop: `out[tokens] += update * weight`, expert by expert). No
// fused multiply-add: an eager op rounds the product before the sum, in float32 too, so each
// term is made in its own pass into `term` and added in another (the compiler contracts a
// product and a sum of one expression into an FMA; a pragma against it kept the helpers from
// inlining, and the pass from vectorising).
template <typename T>
void moe_combine(const T* rows, const int64_t* at, const float* weights, int64_t tokens, int k,
                 int hidden, T* out, int num_threads) {
#pragma omp parallel num_threads(num_threads) if (tokens * k * hidden >= kParallelElements)
    {
        std::vector<float> buffer(hidden);
        float* term = buffer.data();
#pragma omp for
        for (int64_t t = 0; t < tokens; ++t) {
            T* ot = out + t * hidden;
            for (int j = 0; j < k; ++j) {
                const T* r = rows + at[t * k + j] * hidden;
                const float w = weights[t * k + j];
#pragma omp simd
                for (int d = 0; d < hidden; ++d) term[d] = rounded<T>(load(r[d]) * w);
                if (j == 0) {
#pragma omp simd
                    for (int d = 0; d < hidden; ++d) store(0.f + term[d], ot + d);
                } else {
#pragma omp simd
                    for (int d = 0; d < hidden; ++d) store(load(ot[d]) + term[d], ot + d);
                }
            }
        }
    }
}

}  // namespace

// The arguments of each: cpu_layer_ops.h.
extern "C" int kvfleet_rms_norm(int dtype, const void* x, void* residual, const void* weight,
                                void* out, int64_t rows, int hidden, float eps, int num_threads) {
    if (dtype == 0)
        rms_norm(static_cast<const float*>(x), static_cast<float*>(residual),
                 static_cast<const float*>(weight), static_cast<float*>(out), rows, hidden, eps,
                 num_threads);
    else if (dtype == 1)
        rms_norm(static_cast<const uint16_t*>(x), static_cast<uint16_t*>(residual),
                 static_cast<const uint16_t*>(weight), static_cast<uint16_t*>(out), rows, hidden,
                 eps, num_threads);
    else
        return 1;
    return 0;
}

extern "C" int kvfleet_rope(int dtype, void* x, int64_t rows, int heads, int64_t row_stride,
                            int64_t head_stride, int dim, const void* cos, const void* sin,
                            int num_threads) {
    if (dtype == 0)
        rope(static_cast<float*>(x), rows, heads, row_stride, head_stride, dim,
             static_cast<const float*>(cos), static_cast<const float*>(sin), num_threads);
    else if (dtype == 1)
        rope(static_cast<uint16_t*>(x), rows, heads, row_stride, head_stride, dim,
             static_cast<const uint16_t*>(cos), static_cast<const uint16_t*>(sin), num_threads);
    else
        return 1;
    return 0;
}

extern "C" int kvfleet_silu_mul(int dtype, const void* gate_up, void* out, int64_t rows,
                                int inter, int num_threads) {
    if (dtype == 0)
        silu_mul(static_cast<const float*>(gate_up), static_cast<float*>(out), rows, inter,
                 num_threads);
    else if (dtype == 1)
        silu_mul(static_cast<const uint16_t*>(gate_up), static_cast<uint16_t*>(out), rows, inter,
                 num_threads);
    else
        return 1;
    return 0;
}

// Plain copies: the pool stores the model's dtype.
extern "C" int kvfleet_write_kv(int dtype, const void* k, const void* v, int64_t row_stride,
                                int64_t tokens, int num_kv_heads, int head_dim,
                                const int64_t* rows, int64_t slots_per_kv, void* pool_layer) {
    const int64_t size = dtype == 0 ? 4 : dtype == 1 ? 2 : 0;
    if (size == 0) return 1;
    const int64_t bytes = head_dim * size;
    const char* ks = static_cast<const char*>(k);
    const char* vs = static_cast<const char*>(v);
    char* keys = static_cast<char*>(pool_layer);
    char* values = keys + slots_per_kv * bytes;
    for (int h = 0; h < num_kv_heads; ++h) {
        for (int64_t t = 0; t < tokens; ++t) {
            const int64_t row = rows[h * tokens + t];
            if (row < 0 || row >= slots_per_kv) return 2;
            const int64_t src = (t * row_stride + static_cast<int64_t>(h) * head_dim) * size;
            std::memcpy(keys + row * bytes, ks + src, bytes);
            std::memcpy(values + row * bytes, vs + src, bytes);
        }
    }
    return 0;
}

namespace {

constexpr int64_t kLoraColumns = 64;  // output columns of one expand block

// h[k * h_stride] = A_r . x_k for the n rows of x (fp32, `in` apart) (the portable build's;
// AVX-512 builds take lora_shrink's blocked kernel). A row's dot is the same sequence of
// operations whichever rows it is computed beside.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16(const uint16_t* p, __mmask16 m) {  // bf16 -> fp32 lanes
    return _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

// delta[0, cols) = sum over r < width, in order, of h[r] * br[r * len + j]
template <typename W>
inline void lora_expand_block(const float* h, int64_t width, const W* br, int64_t len,
                              int64_t cols, float* delta) {
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                     _mm512_setzero_ps()};
    __mmask16 mask[4];
    for (int c = 0; c < 4; ++c) {
        const int64_t left = std::max<int64_t>(0, std::min<int64_t>(16, cols - 16 * c));
        mask[c] = static_cast<__mmask16>((1u << left) - 1);
    }
    for (int64_t r = 0; r < width; ++r) {
        if (h[r] == 0.f) continue;  // past the adapter's rank (zero rows of A)
        const __m512 hb = _mm512_set1_ps(h[r]);
        for (int c = 0; c < 4; ++c)
            acc[c] = _mm512_fmadd_ps(hb, load16(br + r * len + 16 * c, mask[c]), acc[c]);
    }
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(delta + 16 * c, acc[c]);
}

// one h element: the same operations as each element of the blocked kernel below
template <typename W>
inline float lora_dot_one(const float* x, const W* ar, int64_t full, __mmask16 tail) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < full; i += 16)
        acc = _mm512_fmadd_ps(_mm512_loadu_ps(x + i), load16(ar + i, 0xFFFF), acc);
    if (tail) acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tail, x + full), load16(ar + full, tail),
                                    acc);
    return _mm512_reduce_add_ps(acc);
}

// h[k * rank_total + r] = A_r . x_k for every row k < n and r < rank_total: 4 rows x 4 ranks per
// pass (16 independent sums, 8 loads per 16 FMAs); each element its own accumulator over i in
// order, so blocking changes no element's operations.
template <typename W>
inline void lora_shrink(const float* x, int64_t n, int64_t in, const W* as, int64_t rank_total,
                        float* h) {
    const int64_t full = in / 16 * 16;
    const __mmask16 tail = static_cast<__mmask16>((1u << (in - full)) - 1);
    const int64_t n4 = n / 4 * 4, r4 = rank_total / 4 * 4;
    for (int64_t r = 0; r < r4; r += 4) {
        for (int64_t k = 0; k < n4; k += 4) {
            __m512 acc[4][4];
            for (int q = 0; q < 4; ++q)
                for (int j = 0; j < 4; ++j) acc[q][j] = _mm512_setzero_ps();
            auto step = [&](int64_t i, __mmask16 m) {
                __m512 av[4];
                for (int j = 0; j < 4; ++j) av[j] = load16(as + (r + j) * in + i, m);
                for (int q = 0; q < 4; ++q) {
                    const __m512 xv = _mm512_maskz_loadu_ps(m, x + (k + q) * in + i);
                    for (int j = 0; j < 4; ++j) acc[q][j] = _mm512_fmadd_ps(xv, av[j], acc[q][j]);
                }
            };
            for (int64_t i = 0; i < full; i += 16) step(i, 0xFFFF);
            if (tail) step(full, tail);
            for (int q = 0; q < 4; ++q)
                for (int j = 0; j < 4; ++j)
                    h[(k + q) * rank_total + r + j] = _mm512_reduce_add_ps(acc[q][j]);
        }
        for (int64_t k = n4; k < n; ++k)
            for (int j = 0; j < 4; ++j)
                h[k * rank_total + r + j] =
                    lora_dot_one(x + k * in, as + (r + j) * in, full, tail);
    }
    for (int64_t r = r4; r < rank_total; ++r)
        for (int64_t k = 0; k < n; ++k)
            h[k * rank_total + r] = lora_dot_one(x + k * in, as + r * in, full, tail);
}

// lora_expand_block for two rows at once (8 independent sums per rank step; each row's sums are
// the operations lora_expand_block does: a rank step both rows skip is skipped, one only row
// skips adds 0 * b to that row's sums, which leaves them as they are)
template <typename W>
inline void lora_expand_block2(const float* h0, const float* h1, int64_t width, const W* br,
                               int64_t len, int64_t cols, float* delta0, float* delta1) {
    __m512 acc0[4], acc1[4];
    __mmask16 mask[4];
    for (int c = 0; c < 4; ++c) {
        acc0[c] = acc1[c] = _mm512_setzero_ps();
        const int64_t left = std::max<int64_t>(0, std::min<int64_t>(16, cols - 16 * c));
        mask[c] = static_cast<__mmask16>((1u << left) - 1);
    }
    for (int64_t r = 0; r < width; ++r) {
        if (h0[r] == 0.f && h1[r] == 0.f) continue;
        const __m512 hb0 = _mm512_set1_ps(h0[r]), hb1 = _mm512_set1_ps(h1[r]);
        for (int c = 0; c < 4; ++c) {
            const __m512 bv = load16(br + r * len + 16 * c, mask[c]);
            acc0[c] = _mm512_fmadd_ps(hb0, bv, acc0[c]);
            acc1[c] = _mm512_fmadd_ps(hb1, bv, acc1[c]);
        }
    }
    for (int c = 0; c < 4; ++c) {
        _mm512_storeu_ps(delta0 + 16 * c, acc0[c]);
        _mm512_storeu_ps(delta1 + 16 * c, acc1[c]);
    }
}
#define KVFLEET_LORA_EXPAND2 1
#else
template <typename W>
inline void lora_dot_rows(const float* x, int64_t n, int64_t in, const W* ar, float* h,
                          int64_t h_stride) {
    for (int64_t k = 0; k < n; ++k) {
        float acc[16] = {};
        int64_t i = 0;
        for (; i + 16 <= in; i += 16)
#pragma omp simd
            for (int l = 0; l < 16; ++l) acc[l] += x[k * in + i + l] * load(ar[i + l]);
        for (int l = 0; i + l < in; ++l) acc[l] += x[k * in + i + l] * load(ar[i + l]);
        float sum = 0.f;
        for (int l = 0; l < 16; ++l) sum += acc[l];
        h[k * h_stride] = sum;
    }
}

template <typename W>
inline void lora_expand_block(const float* h, int64_t width, const W* br, int64_t len,
                              int64_t cols, float* delta) {
    for (int64_t j = 0; j < kLoraColumns; ++j) delta[j] = 0.f;
    for (int64_t r = 0; r < width; ++r) {
        if (h[r] == 0.f) continue;  // past the adapter's rank (zero rows of A)
#pragma omp simd
        for (int64_t j = 0; j < cols; ++j) delta[j] += h[r] * load(br[r * len + j]);
    }
}

template <typename W>
inline void lora_shrink(const float* x, int64_t n, int64_t in, const W* as, int64_t rank_total,
                        float* h) {
    for (int64_t r = 0; r < rank_total; ++r)
        lora_dot_rows(x, n, in, as + r * in, h + r, rank_total);
}
#endif

template <typename T>
void lora_slot(const T* x, int64_t x_stride, int64_t in, const std::vector<int64_t>& mine,
               const T* as, int64_t rank_total, const T* b, int64_t slot, int parts,
               int64_t width, const int64_t* part_start, const int64_t* part_len,
               const int64_t* b_offset, T* out, int64_t out_stride) {
    const int64_t n = static_cast<int64_t>(mine.size());
    std::vector<float> xf(n * in), h(n * rank_total);
    for (int64_t k = 0; k < n; ++k)
        for (int64_t i = 0; i < in; ++i) xf[k * in + i] = load(x[mine[k] * x_stride + i]);
    lora_shrink(xf.data(), n, in, as, rank_total, h.data());  // h = A_s x, every row here
    for (int p = 0; p < parts; ++p) {  // out[row, part] += B_s,p h_p
        const int64_t len = part_len[p];
        const T* bp = b + b_offset[p] + slot * width * len;
        for (int64_t j0 = 0; j0 < len; j0 += kLoraColumns) {
            const int64_t cols = std::min(kLoraColumns, len - j0);
            int64_t k = 0;
#if defined(KVFLEET_LORA_EXPAND2)
            for (; k + 2 <= n; k += 2) {
                float delta[2][kLoraColumns];
                lora_expand_block2(h.data() + k * rank_total + p * width,
                                   h.data() + (k + 1) * rank_total + p * width, width, bp + j0,
                                   len, cols, delta[0], delta[1]);
                for (int q = 0; q < 2; ++q) {
                    T* o = out + mine[k + q] * out_stride + part_start[p] + j0;
#pragma omp simd
                    for (int64_t j = 0; j < cols; ++j) store(load(o[j]) + delta[q][j], o + j);
                }
            }
#endif
            for (; k < n; ++k) {
                float delta[kLoraColumns];
                lora_expand_block(h.data() + k * rank_total + p * width, width, bp + j0, len,
                                  cols, delta);
                T* o = out + mine[k] * out_stride + part_start[p] + j0;
#pragma omp simd
                for (int64_t j = 0; j < cols; ++j) store(load(o[j]) + delta[j], o + j);
            }
        }
    }
}

template <typename T>
void lora_add(const T* x, int64_t x_stride, int64_t rows, int64_t in, const int64_t* row_slots,
              const T* a, int64_t rank_total, const T* b, int parts, int64_t width,
              const int64_t* part_start, const int64_t* part_len, const int64_t* b_offset,
              T* out, int64_t out_stride, int num_threads) {
    int64_t num_slots = 0;
    for (int64_t t = 0; t < rows; ++t) num_slots = std::max(num_slots, row_slots[t] + 1);
    std::vector<std::vector<int64_t>> by_slot(num_slots);
    for (int64_t t = 0; t < rows; ++t)
        if (row_slots[t] >= 0) by_slot[row_slots[t]].push_back(t);
#pragma omp parallel for num_threads(num_threads) schedule(dynamic, 1) if (num_slots > 1)
    for (int64_t s = 0; s < num_slots; ++s)
        if (!by_slot[s].empty())
            lora_slot(x, x_stride, in, by_slot[s], a + s * rank_total * in, rank_total, b, s,
                      parts, width, part_start, part_len, b_offset, out, out_stride);
}

}  // namespace

extern "C" int kvfleet_lora_add(int dtype, const void* x, int64_t x_stride, int64_t rows,
                                int64_t in, const int64_t* row_slots, const void* a,
                                int64_t rank_total, const void* b, int parts, int64_t width,
                                const int64_t* part_start, const int64_t* part_len,
                                const int64_t* b_offset, void* out, int64_t out_stride,
                                int num_threads) {
    if (dtype == 0)
        lora_add(static_cast<const float*>(x), x_stride, rows, in, row_slots,
                 static_cast<const float*>(a), rank_total, static_cast<const float*>(b), parts,
                 width, part_start, part_len, b_offset, static_cast<float*>(out),
                 out_stride, num_threads);
    else if (dtype == 1)
        lora_add(static_cast<const uint16_t*>(x), x_stride, rows, in, row_slots,
                 static_cast<const uint16_t*>(a), rank_total, static_cast<const uint16_t*>(b),
                 parts, width, part_start, part_len, b_offset, static_cast<uint16_t*>(out),
                 out_stride, num_threads);
    else
        return 1;
    return 0;
}

extern "C" int kvfleet_moe_combine(int dtype, const void* rows, const int64_t* at,
                                   const float* weights, int64_t tokens, int k, int hidden,
                                   void* out, int num_threads) {
    if (dtype == 0)
        moe_combine(static_cast<const float*>(rows), at, weights, tokens, k, hidden,
                    static_cast<float*>(out), num_threads);
    else if (dtype == 1)
        moe_combine(static_cast<const uint16_t*>(rows), at, weights, tokens, k, hidden,
                    static_cast<uint16_t*>(out), num_threads);
    else
        return 1;
    return 0;
}
