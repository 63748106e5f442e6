// Element-wise pieces of a decoder layer on the CPU, each one pass over its rows instead of the
// 4-10 small torch ops of the eager layer code (worker/engine/cpu_layers.py calls them).
// In bf16 every step rounds to bf16 where the eager bf16 layer rounds (RMSNorm normalises in fp32
// then scales in bf16; RoPE rounds q*cos and rotate_half(q)*sin before their sum; SiLU rounds
// before the product with up), so results follow HF's own bf16 layers; float32 is plain fp32.
#include <cstdint>
#include <cstring>

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
        const T* u = g + inter;
        T* o = out + i * inter;
#pragma omp simd
        for (int d = 0; d < inter; ++d) {
            const float gv = load(g[d]);
            store(rounded<T>(gv / (1.f + exp_approx(-gv))) * load(u[d]), o + d);
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
