// bf16 linear layers on CPUs with AVX512-BF16: y = x W^T (+ bias), fp32 sums, bf16 out.
//
// The weight [n, k] is packed once (kvfleet_pack_bf16_linear) into blocks of 16 output rows, each
// block the k/2 column pairs of its 16 rows side by side: [n/16][k/2][16][2] bf16, so that one
// 64-byte vector holds one column pair of 16 outputs. A product then reads each block once, from
// start to end: per column pair, one vector load of the weights and, for each row of x, that
// row's pair broadcast to every lane and one vdpbf16ps into the row's 16 sums. Nothing is summed
// across lanes, and the weights stream in order from memory, which is what decode steps (a few
// rows against every weight of the model) are bound by.
//
// Each thread takes a contiguous range of blocks and computes all rows of x against them: every
// output is summed in the same order whatever the thread count, the number of rows, or where a
// row sits in x (outputs are bit-identical across thread counts and batch compositions).
//
// Tiles: up to 4 rows against 4 blocks (64 outputs) when x has at most 4 rows (the weight loads
// are what costs), else 8 rows against 3 blocks (24 sums in registers: the products are).
#include <immintrin.h>
#include <omp.h>

#include <cstdint>
#include <cstring>

namespace {

constexpr int kLanes = 16;       // outputs per block: one vector of fp32 sums
constexpr int kPrefetchPairs = 16;  // a block's column pairs requested ahead of their load

int64_t pairs_of(int64_t k) { return (k + 1) / 2; }

#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
constexpr bool kSupported = true;

struct Product {
    const uint16_t* x;
    int64_t x_stride, k;
    const uint16_t* w;  // packed
    int64_t n;
    const float* bias;  // n floats, or null
    uint16_t* y;
    int64_t y_stride;
};

// x's column pair q of one row as a 32-bit word: both bf16, or the last column of an odd k alone
// (its second half zero, as the packed weight's is)
inline int32_t pair_at(const uint16_t* row, int64_t q, int64_t k) {
    int32_t pair = 0;
    if (2 * q + 1 < k)
        std::memcpy(&pair, row + 2 * q, 4);
    else
        pair = row[2 * q];
    return pair;
}

// rows [row, row + R) of x against blocks [block, block + B)
template <int R, int B>
void tile(const Product& p, int64_t row, int64_t block) {
    const int64_t pairs = pairs_of(p.k), block_elems = pairs * 2 * kLanes;
    const uint16_t* w = p.w + block * block_elems;
    const uint16_t* x = p.x + row * p.x_stride;
    __m512 acc[R][B];
    for (int r = 0; r < R; ++r)
        for (int b = 0; b < B; ++b) acc[r][b] = _mm512_setzero_ps();
    const int64_t whole = p.k / 2;  // pairs with both columns in x
    for (int64_t q = 0; q < pairs; ++q) {
        __m512bh wv[B];
        for (int b = 0; b < B; ++b) {
            const uint16_t* at = w + b * block_elems + q * 2 * kLanes;
            _mm_prefetch(reinterpret_cast<const char*>(at + kPrefetchPairs * 2 * kLanes), _MM_HINT_T0);
            wv[b] = (__m512bh)_mm512_loadu_si512(at);
        }
        for (int r = 0; r < R; ++r) {
            int32_t pair;
            if (q < whole)
                std::memcpy(&pair, x + r * p.x_stride + 2 * q, 4);
            else
                pair = pair_at(x + r * p.x_stride, q, p.k);
            const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
            for (int b = 0; b < B; ++b) acc[r][b] = _mm512_dpbf16_ps(acc[r][b], wv[b], xv);
        }
    }
    for (int b = 0; b < B; ++b) {
        const int64_t col = (block + b) * kLanes;
        const int64_t valid = p.n - col < kLanes ? p.n - col : kLanes;
        const __mmask16 mask = static_cast<__mmask16>((1u << valid) - 1);
        const __m512 bias = p.bias ? _mm512_maskz_loadu_ps(mask, p.bias + col) : _mm512_setzero_ps();
        for (int r = 0; r < R; ++r) {
            const __m256i out = (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[r][b], bias));
            _mm256_mask_storeu_epi16(p.y + (row + r) * p.y_stride + col, mask, out);
        }
    }
}

// all m rows of x against blocks [block, block + B), R rows at a time
template <int R, int B>
void rows(const Product& p, int64_t m, int64_t block) {
    int64_t row = 0;
    for (; row + R <= m; row += R) tile<R, B>(p, row, block);
    switch (m - row) {
#define KVFLEET_TAIL(n) \
    case n:                                            \
        if constexpr (n < R) tile<n, B>(p, row, block); \
        break;
        KVFLEET_TAIL(1) KVFLEET_TAIL(2) KVFLEET_TAIL(3) KVFLEET_TAIL(4)
        KVFLEET_TAIL(5) KVFLEET_TAIL(6) KVFLEET_TAIL(7)
#undef KVFLEET_TAIL
        default:
            break;
    }
}

// blocks [*block, end) in groups of B (what is left: fewer than B)
template <int R, int B>
void blocks(const Product& p, int64_t m, int64_t* block, int64_t end) {
    for (; *block + B <= end; *block += B) rows<R, B>(p, m, *block);
}

void product(const Product& p, int64_t m, int threads) {
    const int64_t num_blocks = (p.n + kLanes - 1) / kLanes;
#pragma omp parallel num_threads(threads)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        int64_t block = num_blocks * t / nt;
        const int64_t end = num_blocks * (t + 1) / nt;
        if (m <= 4) {
            blocks<4, 4>(p, m, &block, end);
            blocks<4, 1>(p, m, &block, end);
        } else {
            blocks<8, 3>(p, m, &block, end);
            blocks<8, 1>(p, m, &block, end);
        }
    }
}
#else
constexpr bool kSupported = false;
#endif

}  // namespace

extern "C" {

// 1 where this build computes bf16 products (compiled for a CPU with AVX512-BF16, BW and VL)
int kvfleet_bf16_linear_supported() { return kSupported ? 1 : 0; }

// w [n, k] row-major bf16 -> out [n/16][k/2][16][2], rows and columns past n and k zero
int kvfleet_pack_bf16_linear(const uint16_t* w, int64_t n, int64_t k, uint16_t* out, int threads) {
    const int64_t pairs = pairs_of(k), num_blocks = (n + kLanes - 1) / kLanes;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t block = 0; block < num_blocks; ++block)
        for (int64_t q = 0; q < pairs; ++q)
            for (int lane = 0; lane < kLanes; ++lane)
                for (int half = 0; half < 2; ++half) {
                    const int64_t row = block * kLanes + lane, col = 2 * q + half;
                    out[((block * pairs + q) * kLanes + lane) * 2 + half] =
                        row < n && col < k ? w[row * k + col] : 0;
                }
    return 0;
}

// y[i, :n] = x[i, :k] W^T (+ bias) for i < m; x and y rows `x_stride` / `y_stride` elements
// apart; bias n floats or null. -1 where this build has no bf16 products.
int kvfleet_bf16_linear(const uint16_t* x, int64_t m, int64_t k, int64_t x_stride,
                        const uint16_t* packed, int64_t n, const float* bias, uint16_t* y,
                        int64_t y_stride, int threads) {
#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
    if (m <= 0 || n <= 0) return 0;
    product(Product{x, x_stride, k, packed, n, bias, y, y_stride}, m, threads);
    return 0;
#else
    (void)x, (void)m, (void)k, (void)x_stride, (void)packed, (void)n, (void)bias, (void)y,
        (void)y_stride, (void)threads;
    return -1;
#endif
}

}  // extern "C"
