// Scalar helpers shared by the CPU kernels (cpu_attention.cpp, cpu_prefill.cpp,
// cpu_layer_ops.cpp): bf16 <-> fp32 and an exp in plain arithmetic, so that the loops calling
// them vectorise; on AVX-512 the same exp on 16 lanes (exp512) and one summation tree
// (sum_lanes, sum_vectors) for the kernels written in intrinsics.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace kvfleet {

inline float load(float x) { return x; }
inline float load(uint16_t x) {  // bf16 -> fp32: the high half of the fp32 bits
    uint32_t bits = static_cast<uint32_t>(x) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

inline void store(float v, float* out) { *out = v; }
inline void store(float v, uint16_t* out) {  // fp32 -> bf16, round to nearest even
    uint32_t bits;
    std::memcpy(&bits, &v, 4);
    const uint32_t rounded_bits = bits + 0x7FFF + ((bits >> 16) & 1);
    *out = static_cast<uint16_t>((v != v ? 0x7FC00000u : rounded_bits) >> 16);  // NaN stays NaN
}

// Element-wise passes run on several threads only when they are this large: below it a parallel
// region costs more than it saves (decode steps have a few dozen rows).
constexpr int64_t kParallelElements = 1 << 16;

template <typename T>
inline float rounded(float v) {  // v as an eager op in T would leave it (NaN-free inputs)
    uint32_t bits;
    if constexpr (sizeof(T) == 4) {
        return v;
    } else {
        std::memcpy(&bits, &v, 4);
        bits += 0x7FFF + ((bits >> 16) & 1);
        bits &= 0xFFFF0000u;
        std::memcpy(&v, &bits, 4);
        return v;
    }
}

// exp(x), Cephes' expf: range reduction by ln 2 in two parts, degree-6 polynomial, within ~2 ulp;
// x is clamped to [-87, 88] (beyond that exp under/overflows anyway).
inline float exp_approx(float x) {
    x = std::min(std::max(x, -87.0f), 88.0f);
    const float n = std::nearbyint(x * 1.44269504088896341f);
    x = x - n * 0.693359375f + n * 2.12194440e-4f;
    const float z = x * x;
    float y = 1.9875691500e-4f;
    y = y * x + 1.3981999507e-3f;
    y = y * x + 8.3334519073e-3f;
    y = y * x + 4.1665795894e-2f;
    y = y * x + 1.6666665459e-1f;
    y = y * x + 5.0000001201e-1f;
    y = y * z + x + 1.0f;
    const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;  // 2^n
    float scale;
    std::memcpy(&scale, &bits, 4);
    return y * scale;
}

// out[d] = silu(gate[d]) * up[d] for d < n, as an eager layer in T computes it: silu rounded to
// T, the product rounded to T. The one definition of this pass's arithmetic: the layer ops'
// pass over a gate/up product (cpu_layer_ops.cpp) and the AMX product's fused epilogue
// (cpu_amx.cpp) both call it, so the two give the same bits.
template <typename T>
inline void silu_mul_row(const T* gate, const T* up, T* out, int n) {
#pragma omp simd
    for (int d = 0; d < n; ++d) {
        const float gv = load(gate[d]);
        store(rounded<T>(gv / (1.f + exp_approx(-gv))) * load(up[d]), out + d);
    }
}

#if defined(__AVX512F__)
// exp_approx on 16 lanes: the same steps, so within the same ~2 ulp.
inline __m512 exp512(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    x = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), x);
    const __m512 z = _mm512_mul_ps(x, x);
    __m512 y = _mm512_set1_ps(1.9875691500e-4f);
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507e-3f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073e-3f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894e-2f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459e-1f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201e-1f));
    y = _mm512_add_ps(_mm512_fmadd_ps(y, z, x), _mm512_set1_ps(1.0f));
    const __m512i bits = _mm512_slli_epi32(
        _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);  // 2^n
    return _mm512_mul_ps(y, _mm512_castsi512_ps(bits));
}

// The sum of v's 16 lanes in one fixed tree, written out so that no compiler's reduction decides
// it: a_i = v_i + v_i+8, b_i = a_i + a_i+4, c_i = b_i + b_i+2, then c_0 + c_1 (the tree of GCC's
// _mm512_reduce_add_ps). The decode kernel sums a softmax's normaliser with it; sum_vectors is
// the same tree over 16 vectors lane by lane, for kernels whose rows lie across lanes.
inline float sum_lanes(__m512 v) {
    const __m256 a = _mm256_add_ps(_mm512_castps512_ps256(v),
                                   _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    const __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    const __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));
    return _mm_cvtss_f32(_mm_add_ss(c, _mm_shuffle_ps(c, c, 1)));
}

// sum_lanes(v) of every lane at once: lane i of the result is the tree over v[0..15]'s lane i.
inline __m512 sum_vectors(const __m512 (&v)[16]) {
    __m512 a[8], b[4];
    for (int i = 0; i < 8; ++i) a[i] = _mm512_add_ps(v[i], v[i + 8]);
    for (int i = 0; i < 4; ++i) b[i] = _mm512_add_ps(a[i], a[i + 4]);
    return _mm512_add_ps(_mm512_add_ps(b[0], b[2]), _mm512_add_ps(b[1], b[3]));
}
#endif

}  // namespace kvfleet
