// Linear layers on CPUs with AVX-512: y = x W^T (+ bias), fp32 sums, out in the input's dtype.
// bf16 needs AVX512-BF16, in one of two forms: dtype 1 sums column pairs with vdpbf16ps, dtype 2
// widens the weights to fp32 and sums with FMAs (Bf16Fma below; faster where vdpbf16ps issues at
// half the FMA rate); float32 (dtype 0) any AVX-512 CPU (FMA).
//
// The weight [n, k] is packed once (kvfleet_pack_linear) into blocks of 16 output rows, each block
// its k columns (bf16: k/2 column pairs) for the 16 rows side by side: [n/16][k][16] float32,
// [n/16][k/2][16][2] bf16, so that one 64-byte vector holds one column (pair) of 16 outputs. A
// product then reads each block once, from start to end: per column (pair), one vector load of
// the weights and, for each row of x, that row's value (pair) broadcast to every lane and one
// FMA (vdpbf16ps) into the row's 16 sums. Nothing is summed across lanes, and the weights stream
// in order from memory, which is what decode steps (a few rows against every weight of the model)
// are bound by.
//
// Threads take chunks of contiguous blocks (about 8 per thread, handed out as each finishes its
// last) and compute all rows of x against them: every output is summed in the same order
// whatever the thread count, the thread that took it, the number of rows, or where a row sits in
// x (outputs are bit-identical across thread counts and batch compositions).
//
// Tiles: up to 4 rows against 4 blocks (64 outputs) when x has at most 4 rows (the weight loads
// are what costs), else 8 rows against 3 blocks (24 sums in registers: the products are; Bf16Fma
// 8 against 2, its even and odd columns taking registers of their own).
//
// SiLU in the epilogue (kvfleet_linear_silu): a SiLU MLP's gate and up projections packed with
// their blocks of 16 outputs alternating (gate, up, gate, ...) and computed in tiles of whole
// pairs; each pair's outputs are made as a plain product makes them (fp32 sums, the bias, one
// rounding to the output dtype) into 16-element scratch, then silu(gate) * up of those values
// by silu_mul_row (cpu_kernels.h), as the layer ops' kvfleet_silu_mul makes it: the same bits as
// the product followed by that pass, without the [m, 2 * inter] output's trip through memory.
//
// Where the CPU has no AVX-512 (float32) or no AVX512-BF16 (bf16), or in a build with
// KVFLEET_MATMUL_PORTABLE (as a test makes one), a portable product of the same packed weights
// takes that dtype: AVX2 intrinsics (plain C++ without AVX2), each output summed over the
// columns in order with one fused multiply-add per column, so its sums too are in one order
// whatever the rows or the threads. Linears take it where batch-invariance is asked for
// (`--deterministic`, the default) or KVFLEET_CPU_PRODUCTS=kvfleet; elsewhere oneDNN or MKL.
#if defined(KVFLEET_MATMUL_PORTABLE)
#undef __AVX512F__
#undef __AVX512BF16__
#endif
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_kernels.h"
#include "cpu_matmul.h"

namespace {

constexpr int kLanes = 16;          // outputs per block: one vector of fp32 sums
constexpr int kPrefetchSteps = 16;  // a block's columns (pairs) requested ahead of their load

#if defined(__AVX512F__)
struct F32 {  // one column per step
    using X = float;
    using W = float;
    using Y = float;
    static constexpr int kPer = 1;
    static constexpr int kSub = 1;
    static constexpr int kLargeRows = 8, kLargeBlocks = 3;
    static constexpr int kPairRows = 6, kPairBlocks = 4;  // SiLU's tile: whole gate/up pairs
    static __m512 load(const float* at) { return _mm512_loadu_ps(at); }
    static __m512 value(const float* row, int64_t q, int) { return _mm512_set1_ps(row[q]); }
    static __m512 last(const float* row, int64_t q, int64_t, int s) { return value(row, q, s); }
    static __m512 fma(__m512 acc, __m512 w, __m512 x) { return _mm512_fmadd_ps(w, x, acc); }
    static void store(__m512 v, float* out, __mmask16 mask) { _mm512_mask_storeu_ps(out, mask, v); }
};
#endif

#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
struct Bf16 {  // one column pair per step (vdpbf16ps)
    using X = uint16_t;
    using W = uint16_t;
    using Y = uint16_t;
    static constexpr int kPer = 2;
    static constexpr int kSub = 1;
    static constexpr int kLargeRows = 8, kLargeBlocks = 3;
    static constexpr int kPairRows = 6, kPairBlocks = 4;  // SiLU's tile: whole gate/up pairs
    static __m512 load(const uint16_t* at) { return _mm512_castsi512_ps(_mm512_loadu_si512(at)); }
    // the row's column pair q as one 32-bit word broadcast
    static __m512 value(const uint16_t* row, int64_t q, int) {
        int32_t pair;
        std::memcpy(&pair, row + 2 * q, 4);
        return _mm512_castsi512_ps(_mm512_set1_epi32(pair));
    }
    // the last pair: of an odd k, its one column alone (the second half zero, as the packed
    // weight's is)
    static __m512 last(const uint16_t* row, int64_t q, int64_t k, int s) {
        return k % 2 ? _mm512_castsi512_ps(_mm512_set1_epi32(row[2 * q])) : value(row, q, s);
    }
    static __m512 fma(__m512 acc, __m512 w, __m512 x) {
        return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_castps_si512(w),
                                (__m512bh)_mm512_castps_si512(x));
    }
    static void store(__m512 v, uint16_t* out, __mmask16 mask) {
        _mm256_mask_storeu_epi16(out, mask, (__m256i)_mm512_cvtneps_pbh(v));
    }
};
// bf16 weights summed with fp32 FMAs (dtype 2): the packed column pair's two columns widened
// to fp32 (the high half of each 32-bit word is the odd column, the low half shifted up the
// even one), x widened to fp32 once per call (its rows k rounded up to even, the pad zero); each
// output summed over its columns in order, one FMA per column: the portable product's sums, bit
// for bit. Where vdpbf16ps issues at half the rate of fp32 FMAs (seen on Xeons without AMX), the
// products run twice as fast at prefill and many-stream decode sizes; cpu_linear.py chooses the
// form by the CPU (bf16_form_rule: `fma` on Intel), never by a timing, and on CPUs with AMX-BF16
// takes the tiles instead (cpu_amx.cpp, the same bf16 layout with k padded to whole tiles).
struct Bf16Fma {
    using X = float;
    using W = uint16_t;
    using Y = uint16_t;
    static constexpr int kPer = 2;
    static constexpr int kSub = 2;
    static constexpr int kLargeRows = 8, kLargeBlocks = 2;  // 16 sums + 4 weight vectors
    static constexpr int kPairRows = 8, kPairBlocks = 2;
    static __m512i load(const uint16_t* at) { return _mm512_loadu_si512(at); }
    // column s (0 even, 1 odd) of the loaded pairs as fp32
    static __m512 sub(__m512i raw, int s) {
        return _mm512_castsi512_ps(s == 0 ? _mm512_slli_epi32(raw, 16)
                                          : _mm512_and_si512(raw, _mm512_set1_epi32(
                                                static_cast<int>(0xFFFF0000u))));
    }
    static __m512 value(const float* row, int64_t q, int s) { return _mm512_set1_ps(row[2 * q + s]); }
    static __m512 fma(__m512 acc, __m512 w, __m512 x) { return _mm512_fmadd_ps(w, x, acc); }
    static void store(__m512 v, uint16_t* out, __mmask16 mask) {
        _mm256_mask_storeu_epi16(out, mask, (__m256i)_mm512_cvtneps_pbh(v));
    }
};
#define KVFLEET_BF16_PRODUCT 1
#endif

int64_t steps_of(int64_t k, int per) { return (k + per - 1) / per; }

#if defined(__AVX512F__)
template <typename D>
struct Product {
    const typename D::X* x;
    int64_t x_stride, k;
    const typename D::W* w;  // packed
    int64_t n;
    const float* bias;  // n floats, or null
    typename D::Y* y;
    int64_t y_stride;
    bool silu = false;  // blocks 2i, 2i + 1: a gate's and an up's outputs; y gets silu(gate) * up
};

// rows [row, row + R) of x against blocks [block, block + B)
template <typename D, int R, int B>
void tile(const Product<D>& p, int64_t row, int64_t block) {
    const int64_t steps = steps_of(p.k, D::kPer), block_elems = steps * D::kPer * kLanes;
    const typename D::W* w = p.w + block * block_elems;
    const typename D::X* x = p.x + row * p.x_stride;
    __m512 acc[R][B];
    for (int r = 0; r < R; ++r)
        for (int b = 0; b < B; ++b) acc[r][b] = _mm512_setzero_ps();
    if constexpr (D::kSub == 2) {
        // Bf16Fma: per column pair, its even column then its odd (x is padded: no last step).
        // Plain loops: behind a lambda GCC kept the sums on the stack (a load and a store per
        // FMA), at about half the FMA rate.
        for (int64_t q = 0; q < steps; ++q) {
            __m512 even[B], odd[B];
#pragma GCC unroll 8
            for (int b = 0; b < B; ++b) {
                const typename D::W* at = w + b * block_elems + q * D::kPer * kLanes;
                _mm_prefetch(reinterpret_cast<const char*>(at + kPrefetchSteps * D::kPer * kLanes),
                             _MM_HINT_T0);
                const auto raw = D::load(at);
                even[b] = D::sub(raw, 0);
                odd[b] = D::sub(raw, 1);
            }
#pragma GCC unroll 8
            for (int r = 0; r < R; ++r) {
                const typename D::X* xr = x + r * p.x_stride;
                const __m512 xe = D::value(xr, q, 0);
#pragma GCC unroll 8
                for (int b = 0; b < B; ++b) acc[r][b] = D::fma(acc[r][b], even[b], xe);
                const __m512 xo = D::value(xr, q, 1);
#pragma GCC unroll 8
                for (int b = 0; b < B; ++b) acc[r][b] = D::fma(acc[r][b], odd[b], xo);
            }
        }
    } else {
        // one column (pair) per step; only a bf16 pair past an odd k's end takes `last`
        const int64_t odd_last = D::kPer == 2 && p.k % 2 ? steps - 1 : -1;
        for (int64_t q = 0; q < steps; ++q) {
            __m512 wv[B];
#pragma GCC unroll 8
            for (int b = 0; b < B; ++b) {
                const typename D::W* at = w + b * block_elems + q * D::kPer * kLanes;
                _mm_prefetch(reinterpret_cast<const char*>(at + kPrefetchSteps * D::kPer * kLanes),
                             _MM_HINT_T0);
                wv[b] = D::load(at);
            }
#pragma GCC unroll 8
            for (int r = 0; r < R; ++r) {
                const typename D::X* xr = x + r * p.x_stride;
                const __m512 xv = q == odd_last ? D::last(xr, q, p.k, 0) : D::value(xr, q, 0);
#pragma GCC unroll 8
                for (int b = 0; b < B; ++b) acc[r][b] = D::fma(acc[r][b], wv[b], xv);
            }
        }
    }
    if constexpr (B % 2 == 0) {
        if (p.silu) {  // block is even: each (b, b + 1) a gate/up pair, whole (n: whole pairs)
            for (int b = 0; b < B; b += 2) {
                const int64_t col = (block + b) * kLanes;
                const __m512 zero = _mm512_setzero_ps();
                const __m512 gate_bias = p.bias ? _mm512_loadu_ps(p.bias + col) : zero;
                const __m512 up_bias = p.bias ? _mm512_loadu_ps(p.bias + col + kLanes) : zero;
                for (int r = 0; r < R; ++r) {
                    typename D::Y gate[kLanes], up[kLanes];
                    D::store(_mm512_add_ps(acc[r][b], gate_bias), gate, 0xFFFF);
                    D::store(_mm512_add_ps(acc[r][b + 1], up_bias), up, 0xFFFF);
                    kvfleet::silu_mul_row(gate, up, p.y + (row + r) * p.y_stride + col / 2, kLanes);
                }
            }
            return;
        }
    }
    for (int b = 0; b < B; ++b) {
        const int64_t col = (block + b) * kLanes;
        const int64_t valid = p.n - col < kLanes ? p.n - col : kLanes;
        const __mmask16 mask = static_cast<__mmask16>((1u << valid) - 1);
        const __m512 bias = p.bias ? _mm512_maskz_loadu_ps(mask, p.bias + col) : _mm512_setzero_ps();
        for (int r = 0; r < R; ++r)
            D::store(_mm512_add_ps(acc[r][b], bias), p.y + (row + r) * p.y_stride + col, mask);
    }
}

// all m rows of x against blocks [block, block + B), R rows at a time
template <typename D, int R, int B>
void rows(const Product<D>& p, int64_t m, int64_t block) {
    int64_t row = 0;
    for (; row + R <= m; row += R) tile<D, R, B>(p, row, block);
    switch (m - row) {
#define KVFLEET_TAIL(n)                                    \
    case n:                                                \
        if constexpr (n < R) tile<D, n, B>(p, row, block); \
        break;
        KVFLEET_TAIL(1) KVFLEET_TAIL(2) KVFLEET_TAIL(3) KVFLEET_TAIL(4)
        KVFLEET_TAIL(5) KVFLEET_TAIL(6) KVFLEET_TAIL(7)
#undef KVFLEET_TAIL
        default:
            break;
    }
}

// blocks [*block, end) in groups of B (what is left: fewer than B)
template <typename D, int R, int B>
void blocks(const Product<D>& p, int64_t m, int64_t* block, int64_t end) {
    for (; *block + B <= end; *block += B) rows<D, R, B>(p, m, *block);
}

// blocks [block, end): groups of B (B: the tile's), then what is left one block at a time (with
// SiLU, one gate/up pair at a time: block and end are even)
template <typename D, int R, int B>
void range(const Product<D>& p, int64_t m, int64_t block, int64_t end) {
    blocks<D, R, B>(p, m, &block, end);
    if (p.silu)
        blocks<D, R, 2>(p, m, &block, end);
    else
        blocks<D, R, 1>(p, m, &block, end);
}

template <typename D>
void product(const Product<D>& p, int64_t m, int threads) {
    const int64_t num_blocks = (p.n + kLanes - 1) / kLanes;
    // Threads take chunks of blocks as they finish the last, about 8 chunks per thread, each a
    // whole number of tiles: where one thread streams its weights slower (a smaller share of the
    // memory bandwidth, another process on its core) the other takes more chunks instead of
    // waiting for it (faster than halves fixed in advance at decode sizes, the same at 16-64
    // rows).
    const int group = m <= 4 ? 4 : p.silu ? D::kPairBlocks : D::kLargeBlocks;
    const int64_t target = (num_blocks + 8 * threads - 1) / (8 * threads);
    const int64_t chunk = (target + group - 1) / group * group;  // with SiLU: whole pairs
    const int64_t num_chunks = (num_blocks + chunk - 1) / chunk;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (int64_t c = 0; c < num_chunks; ++c) {
        const int64_t block = c * chunk;
        const int64_t end = block + chunk < num_blocks ? block + chunk : num_blocks;
        if (m <= 4)
            range<D, 4, 4>(p, m, block, end);
        else if (p.silu)
            range<D, D::kPairRows, D::kPairBlocks>(p, m, block, end);
        else
            range<D, D::kLargeRows, D::kLargeBlocks>(p, m, block, end);
    }
}

// kvfleet_linear_groups: each group's blocks in chunks as `product` makes them, every group's
// chunks handed out from one list (a group's tile by its own rows, as `product` picks it)
template <typename D>
void product_groups(const typename D::X* x, int64_t k, int64_t x_stride, const int64_t* offsets,
                    const int64_t* weights, int64_t count, int64_t n, typename D::Y* y,
                    int64_t y_stride, int threads) {
    const int64_t num_blocks = (n + kLanes - 1) / kLanes;
    struct Task {
        int64_t group, block, end;
    };
    std::vector<Task> tasks;
    int64_t busy = 0;
    for (int64_t g = 0; g < count; ++g) busy += offsets[g + 1] > offsets[g];
    const int64_t target = (num_blocks * busy + 8 * threads - 1) / (8 * threads);
    for (int64_t g = 0; g < count; ++g) {
        const int64_t m = offsets[g + 1] - offsets[g];
        if (m <= 0) continue;
        const int group = m <= 4 ? 4 : D::kLargeBlocks;
        const int64_t chunk = (target + group - 1) / group * group;
        for (int64_t block = 0; block < num_blocks; block += chunk)
            tasks.push_back({g, block, block + chunk < num_blocks ? block + chunk : num_blocks});
    }
    const int64_t num_tasks = static_cast<int64_t>(tasks.size());
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (int64_t t = 0; t < num_tasks; ++t) {
        const Task& task = tasks[t];
        const int64_t first = offsets[task.group], m = offsets[task.group + 1] - first;
        const Product<D> p{x + first * x_stride, x_stride, k,
                           reinterpret_cast<const typename D::W*>(weights[task.group]), n, nullptr,
                           y + first * y_stride, y_stride};
        if (m <= 4)
            range<D, 4, 4>(p, m, task.block, task.end);
        else
            range<D, D::kLargeRows, D::kLargeBlocks>(p, m, task.block, task.end);
    }
}

template <typename D>
void run(const void* x, int64_t m, int64_t k, int64_t x_stride, const void* packed, int64_t n,
         const float* bias, void* y, int64_t y_stride, int threads, bool silu = false) {
    product(Product<D>{static_cast<const typename D::X*>(x), x_stride, k,
                       static_cast<const typename D::W*>(packed), n, bias,
                       static_cast<typename D::Y*>(y), y_stride, silu},
            m, threads);
}
#endif

#if defined(KVFLEET_BF16_PRODUCT)
// Bf16Fma's x: the m rows widened to fp32, each k rounded up to even with a zero pad (the packed
// weight's pad column is zero too), in this thread's buffer.
void run_bf16_fma(const uint16_t* x, int64_t m, int64_t k, int64_t x_stride, const void* packed,
                  int64_t n, const float* bias, void* y, int64_t y_stride, int threads,
                  bool silu = false) {
    static thread_local std::vector<float> wide;
    const int64_t width = k + k % 2;
    if (static_cast<int64_t>(wide.size()) < m * width) wide.resize(m * width);
    float* out = wide.data();
#pragma omp parallel for num_threads(threads) schedule(static) if (m * k > 65536)
    for (int64_t i = 0; i < m; ++i) {
        const uint16_t* row = x + i * x_stride;
        float* to = out + i * width;
        for (int64_t c = 0; c < k; ++c) {
            const uint32_t bits = static_cast<uint32_t>(row[c]) << 16;
            std::memcpy(to + c, &bits, 4);
        }
        if (width > k) to[k] = 0.f;
    }
    run<Bf16Fma>(out, m, k, width, packed, n, bias, y, y_stride, threads, silu);
}
#endif

#if !defined(__AVX512F__) || !defined(KVFLEET_BF16_PRODUCT)
#define KVFLEET_PORTABLE_PRODUCT 1
// The portable product, R rows of x against one block of 16 outputs: for each column c in order,
// acc[r][lane] = fma(w[lane][c], x[r][c], acc[r][lane]). With AVX2 and FMA (every x86 CPU
// kvfleet runs on) the 16 lanes are two 8-float vectors, else (or with KVFLEET_MATMUL_SCALAR, as a
// test builds it) plain C++; both compute the same fused multiply-adds in the same order.
#if defined(__AVX2__) && defined(__FMA__) && !defined(KVFLEET_MATMUL_SCALAR)
#include <immintrin.h>

// The 16 outputs' weights of column pair q as fp32: [lane 0-7, 8-15] of the even column (h = 0)
// or the odd one (h = 1); float32 has one column per step.
inline void weights16(const float* at, int, __m256& lo, __m256& hi) {
    lo = _mm256_loadu_ps(at);
    hi = _mm256_loadu_ps(at + 8);
}
inline void weights16(const uint16_t* at, int h, __m256& lo, __m256& hi) {
    // 16 (even, odd) bf16 pairs as 32-bit words; bf16 -> fp32 is the high half of the bits
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at));
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at + 16));
    const __m256i mask = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
    lo = _mm256_castsi256_ps(h == 0 ? _mm256_slli_epi32(a, 16) : _mm256_and_si256(a, mask));
    hi = _mm256_castsi256_ps(h == 0 ? _mm256_slli_epi32(b, 16) : _mm256_and_si256(b, mask));
}

template <typename T, int kPer, int R>
void portable_tile(const T* x, int64_t x_stride, int64_t k, const T* w, int64_t block,
                   int64_t n, const float* bias, T* y, int64_t y_stride, int64_t row) {
    const int64_t steps = steps_of(k, kPer);
    const T* wb = w + block * steps * kPer * kLanes;
    __m256 acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t q = 0; q < steps; ++q)
        for (int h = 0; h < kPer && q * kPer + h < k; ++h) {
            __m256 lo, hi;
            weights16(wb + q * kLanes * kPer, h, lo, hi);
            for (int r = 0; r < R; ++r) {
                const __m256 xv = _mm256_set1_ps(
                    kvfleet::load(x[(row + r) * x_stride + q * kPer + h]));
                acc[r][0] = _mm256_fmadd_ps(lo, xv, acc[r][0]);
                acc[r][1] = _mm256_fmadd_ps(hi, xv, acc[r][1]);
            }
        }
    const int64_t col = block * kLanes;
    const int valid = static_cast<int>(n - col < kLanes ? n - col : kLanes);
    for (int r = 0; r < R; ++r) {
        alignas(32) float sums[kLanes];
        _mm256_store_ps(sums, acc[r][0]);
        _mm256_store_ps(sums + 8, acc[r][1]);
        for (int lane = 0; lane < valid; ++lane)
            kvfleet::store(sums[lane] + (bias ? bias[col + lane] : 0.f),
                           y + (row + r) * y_stride + col + lane);
    }
}
#else
template <typename T, int kPer, int R>
void portable_tile(const T* x, int64_t x_stride, int64_t k, const T* w, int64_t block,
                   int64_t n, const float* bias, T* y, int64_t y_stride, int64_t row) {
    const int64_t steps = steps_of(k, kPer);
    const T* wb = w + block * steps * kPer * kLanes;
    float acc[R][kLanes] = {};
    for (int64_t q = 0; q < steps; ++q)
        for (int h = 0; h < kPer && q * kPer + h < k; ++h)
            for (int r = 0; r < R; ++r) {
                const float xv = kvfleet::load(x[(row + r) * x_stride + q * kPer + h]);
                for (int lane = 0; lane < kLanes; ++lane)
                    acc[r][lane] = std::fma(kvfleet::load(wb[(q * kLanes + lane) * kPer + h]), xv,
                                            acc[r][lane]);
            }
    const int64_t col = block * kLanes;
    const int valid = static_cast<int>(n - col < kLanes ? n - col : kLanes);
    for (int r = 0; r < R; ++r)
        for (int lane = 0; lane < valid; ++lane)
            kvfleet::store(acc[r][lane] + (bias ? bias[col + lane] : 0.f),
                           y + (row + r) * y_stride + col + lane);
}
#endif

template <typename T, int kPer>
void portable_product(const T* x, int64_t m, int64_t k, int64_t x_stride, const T* w, int64_t n,
                      const float* bias, T* y, int64_t y_stride, int threads) {
    const int64_t num_blocks = (n + kLanes - 1) / kLanes;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 4)
    for (int64_t block = 0; block < num_blocks; ++block) {
        // 6 rows at a time: 12 accumulators, the 2 weight vectors and a broadcast fill AVX2's 16
        // registers; a row's sums are the same fused multiply-adds in the same order whatever
        // rows share its tile, so the row count never changes a result
        int64_t row = 0;
        for (; row + 6 <= m; row += 6)
            portable_tile<T, kPer, 6>(x, x_stride, k, w, block, n, bias, y, y_stride, row);
        if (m - row >= 3) {
            portable_tile<T, kPer, 3>(x, x_stride, k, w, block, n, bias, y, y_stride, row);
            row += 3;
        }
        for (; row < m; ++row)
            portable_tile<T, kPer, 1>(x, x_stride, k, w, block, n, bias, y, y_stride, row);
    }
}
#endif

template <typename T>
void pack(const T* w, int64_t n, int64_t k, int per, T* out, int threads) {
    const int64_t steps = steps_of(k, per), num_blocks = (n + kLanes - 1) / kLanes;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t block = 0; block < num_blocks; ++block)
        for (int64_t q = 0; q < steps; ++q)
            for (int lane = 0; lane < kLanes; ++lane)
                for (int h = 0; h < per; ++h) {
                    const int64_t row = block * kLanes + lane, col = q * per + h;
                    out[((block * steps + q) * kLanes + lane) * per + h] =
                        row < n && col < k ? w[row * k + col] : T(0);
                }
}

}  // namespace

extern "C" {  // the arguments of each: cpu_matmul.h

int kvfleet_linear_supported(int dtype) {
#if defined(__AVX512F__)
    if (dtype == 0) return 1;
#endif
#if defined(KVFLEET_BF16_PRODUCT)
    if (dtype == 1 || dtype == 2) return 1;
#endif
#if defined(KVFLEET_PORTABLE_PRODUCT)
    if (dtype == 0 || dtype == 1 || dtype == 2) return 2;  // 2: its sums are the portable ones
#endif
    return 0;
}

int kvfleet_pack_linear(int dtype, const void* w, int64_t n, int64_t k, void* out, int threads) {
    if (dtype == 0) {
        pack(static_cast<const float*>(w), n, k, 1, static_cast<float*>(out), threads);
        return 0;
    }
    if (dtype == 1 || dtype == 2) {
        pack(static_cast<const uint16_t*>(w), n, k, 2, static_cast<uint16_t*>(out), threads);
        return 0;
    }
    return -1;
}

int kvfleet_linear(int dtype, const void* x, int64_t m, int64_t k, int64_t x_stride,
                   const void* packed, int64_t n, const float* bias, void* y, int64_t y_stride,
                   int threads) {
    if (!kvfleet_linear_supported(dtype)) return -1;
    if (m <= 0 || n <= 0) return 0;
#if defined(__AVX512F__)
    if (dtype == 0) run<F32>(x, m, k, x_stride, packed, n, bias, y, y_stride, threads);
#endif
#if defined(KVFLEET_BF16_PRODUCT)
    if (dtype == 1) run<Bf16>(x, m, k, x_stride, packed, n, bias, y, y_stride, threads);
    if (dtype == 2)
        run_bf16_fma(static_cast<const uint16_t*>(x), m, k, x_stride, packed, n, bias, y,
                     y_stride, threads);
#endif
#if defined(KVFLEET_PORTABLE_PRODUCT)
    if (kvfleet_linear_supported(dtype) != 2) return 0;
    if (dtype == 0)
        portable_product<float, 1>(static_cast<const float*>(x), m, k, x_stride,
                                   static_cast<const float*>(packed), n, bias,
                                   static_cast<float*>(y), y_stride, threads);
    else
        portable_product<uint16_t, 2>(static_cast<const uint16_t*>(x), m, k, x_stride,
                                      static_cast<const uint16_t*>(packed), n, bias,
                                      static_cast<uint16_t*>(y), y_stride, threads);
#endif
    (void)x, (void)k, (void)x_stride, (void)packed, (void)bias, (void)y, (void)y_stride,
        (void)threads;
    return 0;
}

int kvfleet_linear_silu(int dtype, const void* x, int64_t m, int64_t k, int64_t x_stride,
                        const void* packed, int64_t n, const float* bias, void* y,
                        int64_t y_stride, int threads) {
    if (kvfleet_linear_supported(dtype) != 1) return -1;
    if (n % (2 * kLanes) != 0) return -2;
    if (m <= 0 || n <= 0) return 0;
#if defined(__AVX512F__)
    if (dtype == 0) run<F32>(x, m, k, x_stride, packed, n, bias, y, y_stride, threads, true);
#endif
#if defined(KVFLEET_BF16_PRODUCT)
    if (dtype == 1) run<Bf16>(x, m, k, x_stride, packed, n, bias, y, y_stride, threads, true);
    if (dtype == 2)
        run_bf16_fma(static_cast<const uint16_t*>(x), m, k, x_stride, packed, n, bias, y,
                     y_stride, threads, true);
#endif
    (void)x, (void)k, (void)x_stride, (void)packed, (void)bias, (void)y, (void)y_stride,
        (void)threads;
    return 0;
}

int kvfleet_linear_groups(int dtype, const void* x, int64_t k, int64_t x_stride,
                          const int64_t* offsets, const int64_t* weights, int64_t count, int64_t n,
                          void* y, int64_t y_stride, int threads) {
    if (!kvfleet_linear_supported(dtype)) return -1;
    if (count <= 0 || n <= 0) return 0;
#if defined(__AVX512F__)
    if (dtype == 0) {
        product_groups<F32>(static_cast<const float*>(x), k, x_stride, offsets, weights, count, n,
                            static_cast<float*>(y), y_stride, threads);
        return 0;
    }
#endif
#if defined(KVFLEET_BF16_PRODUCT)
    if (dtype == 1) {
        product_groups<Bf16>(static_cast<const uint16_t*>(x), k, x_stride, offsets, weights,
                             count, n, static_cast<uint16_t*>(y), y_stride, threads);
        return 0;
    }
#endif
    // the other forms (bf16 summed with FMAs, the portable product): one product per group
    const int64_t size = dtype == 0 ? 4 : 2;
    for (int64_t g = 0; g < count; ++g) {
        const int64_t first = offsets[g], m = offsets[g + 1] - first;
        if (m <= 0) continue;
        const int status = kvfleet_linear(
            dtype, static_cast<const char*>(x) + first * x_stride * size, m, k, x_stride,
            reinterpret_cast<const void*>(weights[g]), n, nullptr,
            static_cast<char*>(y) + first * y_stride * size, y_stride, threads);
        if (status != 0) return status;
    }
    return 0;
}

}  // extern "C"
