// kvfleet's bf16 linear product on Intel's AMX tiles: y = x W^T (+ bias), fp32 sums, bf16 out
// (cpu_linear.py's bf16 form `amx`, dtype code 3).
//
// Tiles. A tile register holds up to 16 rows of 64 bytes. TDPBF16PS multiplies an A tile (rows
// of x: up to 16 rows x 32 bf16 columns) by a B tile (16 column pairs x 16 outputs x 2 bf16, the
// "VNNI" layout: the two columns of a pair side by side) into a C tile of fp32 sums (the rows x
// 16 outputs). The weight [n, k] is packed once (kvfleet_amx_pack) into those B tiles: blocks of
// 16 outputs, each block its ceil(k / 32) tiles in k order, 1 KiB apiece, rows and columns past
// n and k zero. It is cpu_matmul.cpp's bf16 layout ([n/16][k/2][16][2]) with k padded to a
// whole tile, so a tile is 1 KiB read with a 64-byte stride.
//
// A product takes up to 32 rows of x (two A tiles) against two blocks (two B tiles) into four C
// tiles (tmm0-3: C[r][b] = A[r] (tmm4+r) x B[b] (tmm6+b)); for each k tile in order it loads the
// A and B tiles and issues one TDPBF16PS per C tile. The k tiles go in passes of 8: the 32 rows'
// A tiles of a pass stay in L1 while a thread's blocks stream past, and between passes the C tiles
// are stored as fp32 and loaded back unchanged, so the sums are those of one pass over all of k. The last k tile of an x whose k is no
// multiple of 32 is read from a copy padded with zeros (a tile load reads 64 bytes per row: past
// the row's end, the next row's values or memory past x). Rows past m are never loaded: the tile
// configuration gives the A and C tiles the rows that are left.
//
// SiLU in the epilogue (kvfleet_amx_linear_silu). A SiLU MLP's gate and up projections packed
// as one weight with their blocks of 16 outputs alternating (gate's, up's, gate's, ...): the two
// B tiles a product takes together are one gate block and its up block, so where the sums are
// stored the pair's bf16 outputs are made as above into a 1 KiB scratch and silu(gate) * up of
// them written instead, by the layer ops' own row function: the bits of the plain product
// followed by kvfleet_silu_mul, without the [m, 2 * inter] output's trip through memory.
//
// The residual add in the epilogue (kvfleet_amx_linear_add): y holds the addend, and each bf16
// output, made as above, is added to it in fp32 and the sum rounded to bf16 alike (a bf16
// `y += x W^T`, as torch's add_ after the product rounds it, but for denormal sums, which the
// conversion flushes), so the layer's down product never writes its output to be read back.
//
// Sum order. Each output is the dot product of one row of x with one row of W. Its sums follow
// from k alone: the k tiles in order, each a TDPBF16PS whose arithmetic on one output reads that
// row of x and that output's weights only (the pseudo-code below); the rows that share its tile,
// the thread that computes it, m and the thread count play no part, so outputs are bit-identical
// across batch compositions and thread counts (as cpu_matmul.cpp's forms are). Zero padding adds
// exact zeros to sums that start at +0, which leaves every sum as it was.
//
// What TDPBF16PS computes, per Intel's SDM (Vol. 2, TDPBF16PS "Operation"): for each output, two
// fp32 sums start at zero, one over the even columns of the tile's 16 pairs and one over the odd
// columns, each step a fused multiply-add (the bf16 x bf16 product is exact in fp32) rounded to
// nearest even, input denormals treated as zero, output denormals flushed, MXCSR not consulted;
// then the two are added and that added to the output's C element, rounded alike. Intel's
// intrinsics guide gives an older pseudo-code for _tile_dpbf16ps: one sum per output, the even
// and then the odd column of each pair added to it in k order, which is the order of
// cpu_matmul.cpp's `fma` form. The two are both here as scalar models (below), so a test on an
// AMX CPU can say which the hardware follows; the SDM's is the one the emulation build takes.
//
// Emulation. Every tile operation goes through the few inline functions of `tiles` below. In a
// build with KVFLEET_AMX_EMULATE (a test makes one) they are plain C++ over 8 tile registers per
// thread: the scalar model of the instructions, which runs on any CPU, so the layout, the loop
// over tiles and the sum order are tested where there is no AMX; KVFLEET_AMX_EMULATE_SEQUENTIAL
// takes the intrinsics guide's model instead. Otherwise they are the AMX intrinsics, in functions
// compiled for AMX by a target attribute: the library builds with -march=native on any x86 CPU
// (g++ 11 or later has the intrinsics), and kvfleet_amx_supported says 0 where the CPU lacks AMX.
//
// Permission. Linux gives a process the tile state (8 KiB of registers in every context switch)
// only when it asks: arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA). The kernel asks once
// per process (the permission is the process's, every thread has it), the first time it is asked
// whether it computes; where Linux refuses, the form is unavailable and cpu_linear.py takes
// another, so a tile instruction never runs without the state (it would raise SIGILL).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_amx.h"
#include "cpu_kernels.h"

#if !defined(KVFLEET_AMX_EMULATE)
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
// the instruction sets a function that issues tile instructions or converts its sums needs
#define KVFLEET_AMX_TARGET \
    __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16")))
#else
#define KVFLEET_AMX_TARGET
#endif

namespace {

constexpr int kTilesCode = 3;   // kvfleet_amx_*'s dtype for bf16 on tiles
constexpr int kLanes = 16;      // outputs per block: the fp32 columns of a C tile
constexpr int kTileK = 32;      // bf16 columns per k tile: an A tile row, a B tile's 16 pairs
constexpr int kTileRows = 16;   // rows of x per A tile
constexpr int kRowBytes = 64;   // bytes per tile row
constexpr int64_t kTileElems = kTileK * kLanes;  // bf16 elements of one B tile

int64_t k_tiles(int64_t k) { return (k + kTileK - 1) / kTileK; }

// LDTILECFG's 64-byte operand (palette 1): each tile's rows and bytes per row.
struct alignas(64) TileConfig {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
};

// The tile registers' roles, fixed: C[r][b] = tmm(2r + b), A[r] = tmm(4 + r), B[b] = tmm(6 + b).
// A configuration for r0 rows in the first A tile and r1 (0-16) in the second.
TileConfig config_for(int r0, int r1) {
    TileConfig config;
    const int rows[8] = {r0, r0, r1, r1, r0, r1, kTileRows, kTileRows};
    for (int t = 0; t < 8; ++t) {
        config.rows[t] = static_cast<uint8_t>(rows[t]);
        config.colsb[t] = rows[t] ? kRowBytes : 0;  // an unused tile: 0 rows and 0 bytes
    }
    return config;
}

#if defined(KVFLEET_AMX_EMULATE)
namespace tiles {  // the scalar model of the tile instructions

struct Tile {
    int rows = 0, colsb = 0;
    uint8_t data[kTileRows][kRowBytes] = {};
};
thread_local Tile reg[8];  // tile state is per thread, as the hardware's is

float as_float(uint32_t bits) {
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}
float bf16(const uint8_t* at) {  // make_fp32: the bf16 bits as the high half of an fp32
    uint16_t h;
    std::memcpy(&h, at, 2);
    return as_float(static_cast<uint32_t>(h) << 16);
}
float fp32(const uint8_t* at) {
    float f;
    std::memcpy(&f, at, 4);
    return f;
}
// denormals as zero (DAZ on inputs, FTZ on results), the sign kept
float flush(float v) { return std::fpclassify(v) == FP_SUBNORMAL ? std::copysign(0.f, v) : v; }
// one accumulation step of TDPBF16PS: the exact product added with one rounding (an FMA)
float fma_step(float a, float b, float acc) { return flush(std::fma(flush(a), flush(b), flush(acc))); }
[[maybe_unused]] float add_step(float a, float b) { return flush(flush(a) + flush(b)); }

inline void configure(const TileConfig& config) {
    for (int t = 0; t < 8; ++t) {
        reg[t] = Tile{};
        reg[t].rows = config.rows[t];
        reg[t].colsb = config.colsb[t];
    }
}
inline void release() {}
inline void load(int t, const void* base, int64_t stride) {
    for (int r = 0; r < reg[t].rows; ++r)
        std::memcpy(reg[t].data[r], static_cast<const uint8_t*>(base) + r * stride, reg[t].colsb);
}
inline void zero(int t) { std::memset(reg[t].data, 0, sizeof(reg[t].data)); }
inline void store(int t, void* base, int64_t stride) {
    for (int r = 0; r < reg[t].rows; ++r)
        std::memcpy(static_cast<uint8_t*>(base) + r * stride, reg[t].data[r], reg[t].colsb);
}
// TDPBF16PS tmm(c), tmm(a), tmm(b)
inline void dpbf16ps(int c, int a, int b) {
    Tile &dst = reg[c], &src1 = reg[a], &src2 = reg[b];
    const int pairs = src1.colsb / 4, outputs = dst.colsb / 4;
    for (int m = 0; m < dst.rows; ++m)
        for (int n = 0; n < outputs; ++n) {
            const uint8_t* x = src1.data[m];
            float out = fp32(dst.data[m] + 4 * n);
#if defined(KVFLEET_AMX_EMULATE_SEQUENTIAL)
            // the intrinsics guide: the even then the odd product of each pair added in k order
            for (int k = 0; k < pairs; ++k) {
                out = fma_step(bf16(x + 4 * k), bf16(src2.data[k] + 4 * n), out);
                out = fma_step(bf16(x + 4 * k + 2), bf16(src2.data[k] + 4 * n + 2), out);
            }
#else
            // the SDM: even and odd products summed apart from zero, then together into C
            float even = 0.f, odd = 0.f;
            for (int k = 0; k < pairs; ++k) {
                even = fma_step(bf16(x + 4 * k), bf16(src2.data[k] + 4 * n), even);
                odd = fma_step(bf16(x + 4 * k + 2), bf16(src2.data[k] + 4 * n + 2), odd);
            }
            out = add_step(out, add_step(even, odd));
#endif
            std::memcpy(dst.data[m] + 4 * n, &out, 4);
        }
}

}  // namespace tiles

// The kernel's tile operations, by role (the registers above).
template <int R> inline void load_a(const uint16_t* at, int64_t stride) { tiles::load(4 + R, at, stride); }
template <int B> inline void load_b(const uint16_t* at) { tiles::load(6 + B, at, kRowBytes); }
template <int R, int B> inline void zero_c() { tiles::zero(2 * R + B); }
template <int R, int B> inline void dot_c() { tiles::dpbf16ps(2 * R + B, 4 + R, 6 + B); }
template <int R, int B> inline void store_c(float* at) { tiles::store(2 * R + B, at, kRowBytes); }
template <int R, int B> inline void load_c(const float* at) { tiles::load(2 * R + B, at, kRowBytes); }
inline void configure(const TileConfig& config) { tiles::configure(config); }
inline void release() { tiles::release(); }

#else
// The intrinsics paste the register's number into the instruction's text, so each role is
// spelled out per register. Their asm names only the address of what a tile load reads: a
// compiler barrier first, so that the bytes written just before (the padded copy, the
// configuration) are in memory when the instruction reads them.
inline void barrier() { asm volatile("" ::: "memory"); }

template <int R> KVFLEET_AMX_TARGET inline void load_a(const uint16_t* at, int64_t stride) {
    barrier();
    if constexpr (R == 0) _tile_loadd(4, at, stride);
    else _tile_loadd(5, at, stride);
}
template <int B> KVFLEET_AMX_TARGET inline void load_b(const uint16_t* at) {
    if constexpr (B == 0) _tile_loadd(6, at, kRowBytes);
    else _tile_loadd(7, at, kRowBytes);
}
template <int R, int B> KVFLEET_AMX_TARGET inline void zero_c() {
    if constexpr (R == 0 && B == 0) _tile_zero(0);
    else if constexpr (R == 0) _tile_zero(1);
    else if constexpr (B == 0) _tile_zero(2);
    else _tile_zero(3);
}
template <int R, int B> KVFLEET_AMX_TARGET inline void dot_c() {
    if constexpr (R == 0 && B == 0) _tile_dpbf16ps(0, 4, 6);
    else if constexpr (R == 0) _tile_dpbf16ps(1, 4, 7);
    else if constexpr (B == 0) _tile_dpbf16ps(2, 5, 6);
    else _tile_dpbf16ps(3, 5, 7);
}
template <int R, int B> KVFLEET_AMX_TARGET inline void store_c(float* at) {
    if constexpr (R == 0 && B == 0) _tile_stored(0, at, kRowBytes);
    else if constexpr (R == 0) _tile_stored(1, at, kRowBytes);
    else if constexpr (B == 0) _tile_stored(2, at, kRowBytes);
    else _tile_stored(3, at, kRowBytes);
}
template <int R, int B> KVFLEET_AMX_TARGET inline void load_c(const float* at) {
    barrier();
    if constexpr (R == 0 && B == 0) _tile_loadd(0, at, kRowBytes);
    else if constexpr (R == 0) _tile_loadd(1, at, kRowBytes);
    else if constexpr (B == 0) _tile_loadd(2, at, kRowBytes);
    else _tile_loadd(3, at, kRowBytes);
}
KVFLEET_AMX_TARGET inline void configure(const TileConfig& config) {
    barrier();
    _tile_loadconfig(&config);
}
KVFLEET_AMX_TARGET inline void release() { _tile_release(); }

// The CPU has the instructions (CPUID leaf 7) and Linux gave this process the tile state.
bool tiles_granted() {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    const bool amx = (d >> 24 & 1) && (d >> 22 & 1);                 // AMX-TILE, AMX-BF16
    const bool avx512 = (b >> 16 & 1) && (b >> 30 & 1) && (b >> 31 & 1);  // F, BW, VL
    unsigned a1 = 0, b1, c1, d1;
    const bool bf16 = __get_cpuid_count(7, 1, &a1, &b1, &c1, &d1) && (a1 >> 5 & 1);  // AVX512-BF16
    if (!amx || !avx512 || !bf16) return false;
    constexpr long kGetPermission = 0x1022, kRequestPermission = 0x1023, kTileData = 18;
    if (syscall(SYS_arch_prctl, kRequestPermission, kTileData) != 0) return false;
    unsigned long granted = 0;
    return syscall(SYS_arch_prctl, kGetPermission, &granted) == 0 && (granted >> kTileData & 1);
}
#endif

// The store of `rows` rows of one C tile's sums (fp32, 16 per row, 64 bytes apart) as bf16, bias
// added in fp32: the lanes past n are left alone. The conversion is VCVTNEPS2BF16's: round to
// nearest even, denormal inputs as zero (what cpu_matmul.cpp's AVX-512 forms store with). With
// `add` (kvfleet_amx_linear_add) y holds an addend: that bf16 output is added to it in fp32 and
// the sum rounded to bf16 alike, as a bf16 `y += product` after the product computes.
#if defined(KVFLEET_AMX_EMULATE)
uint16_t to_bf16(float v) {
    uint32_t bits;
    v = tiles::flush(v);
    std::memcpy(&bits, &v, 4);
    if (v != v) return static_cast<uint16_t>((bits >> 16) | 0x40);  // NaN: quieted, sign kept
    return static_cast<uint16_t>((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
}
float from_bf16(uint16_t h) { return tiles::as_float(static_cast<uint32_t>(h) << 16); }
void store_rows(const float* sums, int rows, const float* bias, int valid, uint16_t* y,
                int64_t y_stride, bool add = false) {
    for (int r = 0; r < rows; ++r)
        for (int lane = 0; lane < valid; ++lane) {
            uint16_t& out = y[r * y_stride + lane];
            const uint16_t p = to_bf16(sums[r * kLanes + lane] + (bias ? bias[lane] : 0.f));
            out = add ? to_bf16(from_bf16(p) + from_bf16(out)) : p;
        }
}
void store_pair_rows(const float* sums0, const float* sums1, int rows, const float* bias,
                     uint16_t* y, int64_t y_stride, bool add = false) {
    store_rows(sums0, rows, bias, kLanes, y, y_stride, add);
    store_rows(sums1, rows, bias ? bias + kLanes : nullptr, kLanes, y + kLanes, y_stride, add);
}
#else
// bf16 lanes -> fp32 lanes (the high halves)
KVFLEET_AMX_TARGET inline __m512 widen(__m256i h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
KVFLEET_AMX_TARGET void store_rows(const float* sums, int rows, const float* bias, int valid,
                                   uint16_t* y, int64_t y_stride, bool add = false) {
    const __mmask16 mask = static_cast<__mmask16>((1u << valid) - 1);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias) : _mm512_setzero_ps();
    for (int r = 0; r < rows; ++r) {
        uint16_t* out = y + r * y_stride;
        __m256i p = (__m256i)_mm512_cvtneps_pbh(
            _mm512_add_ps(_mm512_loadu_ps(sums + r * kLanes), b));
        if (add)
            p = (__m256i)_mm512_cvtneps_pbh(
                _mm512_add_ps(widen(p), widen(_mm256_maskz_loadu_epi16(mask, out))));
        _mm256_mask_storeu_epi16(out, mask, p);
    }
}
// store_rows of two whole blocks side by side (sums1 the next 16 outputs): each row's 32
// outputs in one 64-byte store, not two masked halves of it (measured 5-10% of a product's time
// at the 135M model's prefill shapes on a Xeon with AMX: y's lines are written whole)
KVFLEET_AMX_TARGET void store_pair_rows(const float* sums0, const float* sums1, int rows,
                                        const float* bias, uint16_t* y, int64_t y_stride,
                                        bool add = false) {
    const __m512 b0 = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
    const __m512 b1 = bias ? _mm512_loadu_ps(bias + kLanes) : _mm512_setzero_ps();
    for (int r = 0; r < rows; ++r) {
        uint16_t* out = y + r * y_stride;
        __m256i p0 = (__m256i)_mm512_cvtneps_pbh(
            _mm512_add_ps(_mm512_loadu_ps(sums0 + r * kLanes), b0));
        __m256i p1 = (__m256i)_mm512_cvtneps_pbh(
            _mm512_add_ps(_mm512_loadu_ps(sums1 + r * kLanes), b1));
        if (add) {
            const __m512i old = _mm512_loadu_si512(out);
            p0 = (__m256i)_mm512_cvtneps_pbh(
                _mm512_add_ps(widen(p0), widen(_mm512_castsi512_si256(old))));
            p1 = (__m256i)_mm512_cvtneps_pbh(
                _mm512_add_ps(widen(p1), widen(_mm512_extracti64x4_epi64(old, 1))));
        }
        _mm512_storeu_si512(out, _mm512_inserti64x4(_mm512_castsi256_si512(p0), p1, 1));
    }
}
#endif

struct Job {
    const uint16_t* x;
    int64_t m, k, x_stride;
    const uint16_t* w;  // packed
    int64_t n;
    const float* bias;  // n floats, or null
    uint16_t* y;
    int64_t y_stride;
    // gate/up pairs (kvfleet_amx_linear_silu): blocks 2i and 2i + 1 are a gate's and an up's 16
    // outputs, and y's columns [16i, 16i + 16) get silu(gate) * up of them (n / 2 columns)
    bool silu = false;
    bool add = false;  // y holds an addend: y += the bf16 outputs (kvfleet_amx_linear_add)
};

// The fused epilogue of a gate/up pair: the pair's sums stored as bf16 exactly as the plain
// product stores them (store_rows), then silu(gate) * up of those bf16 values by the layer ops'
// own row pass (cpu_kernels.h), so y holds the bits that the product followed by
// kvfleet_silu_mul would: the [rows, 2 * inter] output is never written to memory and read back.
KVFLEET_AMX_TARGET void store_silu_rows(const float* gate_sums, const float* up_sums, int rows,
                                        const float* bias, uint16_t* y, int64_t y_stride) {
    alignas(64) uint16_t gate[kTileRows * kLanes], up[kTileRows * kLanes];
    store_rows(gate_sums, rows, bias, kLanes, gate, kLanes);
    store_rows(up_sums, rows, bias ? bias + kLanes : nullptr, kLanes, up, kLanes);
    for (int r = 0; r < rows; ++r)
        kvfleet::silu_mul_row(gate + r * kLanes, up + r * kLanes, y + r * y_stride, kLanes);
}

// x's rows [row, row + rows) (1-32; two A tiles where TwoA) against blocks [block, block + 1 or
// 2] (TwoB), k tiles [t0, t1) of them: the C tiles start at zero where t0 is the first k tile,
// else from `partial` (the fp32 sums of k tiles [0, t0), as stored below: exact, so a sum is the
// same whichever k tiles a pass covers); where t1 is the last, the sums go to y as bf16, else
// back to `partial`. `tail`: the last k tile's columns of those rows padded with zeros (32 x 32),
// or null where k is a multiple of 32.
template <bool TwoA, bool TwoB>
KVFLEET_AMX_TARGET void tile_product(const Job& j, int64_t row, int rows, int64_t block,
                                     int64_t t0, int64_t t1, const uint16_t* tail,
                                     float* partial) {
    const int64_t tiles_k = k_tiles(j.k);
    const uint16_t* w0 = j.w + block * tiles_k * kTileElems;
    const uint16_t* w1 = w0 + tiles_k * kTileElems;
    constexpr int64_t kC = kTileRows * kLanes;  // floats of one C tile
    // partial: [2 row tiles][2 blocks][16 rows][16 lanes]
    if (t0 == 0) {
        zero_c<0, 0>();
        if constexpr (TwoB) zero_c<0, 1>();
        if constexpr (TwoA) zero_c<1, 0>();
        if constexpr (TwoA && TwoB) zero_c<1, 1>();
    } else {
        load_c<0, 0>(partial);
        if constexpr (TwoB) load_c<0, 1>(partial + kC);
        if constexpr (TwoA) load_c<1, 0>(partial + 2 * kC);
        if constexpr (TwoA && TwoB) load_c<1, 1>(partial + 3 * kC);
    }
    for (int64_t t = t0; t < t1; ++t) {
        const bool padded = tail && t == tiles_k - 1;
        const uint16_t* a = padded ? tail : j.x + row * j.x_stride + t * kTileK;
        const int64_t stride = padded ? kTileK : j.x_stride;  // elements between rows
        load_a<0>(a, stride * 2);
        if constexpr (TwoA) load_a<1>(a + kTileRows * stride, stride * 2);
        load_b<0>(w0 + t * kTileElems);
        if constexpr (TwoB) load_b<1>(w1 + t * kTileElems);
        dot_c<0, 0>();
        if constexpr (TwoB) dot_c<0, 1>();
        if constexpr (TwoA) dot_c<1, 0>();
        if constexpr (TwoA && TwoB) dot_c<1, 1>();
    }
    store_c<0, 0>(partial);
    if constexpr (TwoB) store_c<0, 1>(partial + kC);
    if constexpr (TwoA) store_c<1, 0>(partial + 2 * kC);
    if constexpr (TwoA && TwoB) store_c<1, 1>(partial + 3 * kC);
    if (t1 < tiles_k) return;
    const int r0 = rows < kTileRows ? rows : kTileRows;
    if (j.silu) {  // a gate/up pair (TwoB: every pair is whole, kvfleet_amx_linear_silu)
        const int64_t col = block * kLanes;
        const float* bias = j.bias ? j.bias + col : nullptr;
        uint16_t* y = j.y + row * j.y_stride + block / 2 * kLanes;
        store_silu_rows(partial, partial + kC, r0, bias, y, j.y_stride);
        if (TwoA) store_silu_rows(partial + 2 * kC, partial + 3 * kC, rows - r0, bias,
                                  y + kTileRows * j.y_stride, j.y_stride);
        return;
    }
    if (TwoB && j.n - block * kLanes >= 2 * kLanes) {  // two whole blocks
        const int64_t col = block * kLanes;
        const float* bias = j.bias ? j.bias + col : nullptr;
        uint16_t* y = j.y + row * j.y_stride + col;
        store_pair_rows(partial, partial + kC, r0, bias, y, j.y_stride, j.add);
        if (TwoA) store_pair_rows(partial + 2 * kC, partial + 3 * kC, rows - r0, bias,
                                  y + kTileRows * j.y_stride, j.y_stride, j.add);
        return;
    }
    for (int b = 0; b < (TwoB ? 2 : 1); ++b) {
        const int64_t col = (block + b) * kLanes;
        const int valid = static_cast<int>(j.n - col < kLanes ? j.n - col : kLanes);
        const float* bias = j.bias ? j.bias + col : nullptr;
        uint16_t* y = j.y + row * j.y_stride + col;
        store_rows(partial + b * kC, r0, bias, valid, y, j.y_stride, j.add);
        if (TwoA) store_rows(partial + (2 + b) * kC, rows - r0, bias, valid,
                             y + kTileRows * j.y_stride, j.y_stride, j.add);
    }
}

// k tiles per pass over a chunk's blocks: 32 rows of x for 8 k tiles are 16 KiB, which stay in
// L1 while each pair of blocks' 16 KiB of those k tiles streams past (with the whole k at once,
// x's 32 rows and a pair of blocks need up to twice L1 at k = 2048 and both came from L2)
constexpr int64_t kPassTiles = 8;

// x's rows [first, last) against blocks [block, end), 32 rows at a time, on this thread's tiles
KVFLEET_AMX_TARGET void chunk(const Job& j, int64_t first, int64_t last, int64_t block,
                              int64_t end, float* partials) {
    const int64_t tiles_k = k_tiles(j.k), tail_cols = j.k - (tiles_k - 1) * kTileK;
    // passes of at most kPassTiles, as even as they go (18 k tiles: 6, 6, 6, not 8, 8, 2)
    const int64_t passes = (tiles_k + kPassTiles - 1) / kPassTiles;
    const int64_t pass_tiles = (tiles_k + passes - 1) / passes;
    alignas(64) uint16_t tail[2 * kTileRows * kTileK];
    int configured = -1;
    for (int64_t row = first; row < last; row += 2 * kTileRows) {
        const int rows = static_cast<int>(last - row < 2 * kTileRows ? last - row : 2 * kTileRows);
        const int r0 = rows < kTileRows ? rows : kTileRows;
        if (rows != configured) configure(config_for(r0, rows - r0));
        configured = rows;
        const uint16_t* padded = nullptr;
        if (tail_cols < kTileK) {
            std::memset(tail, 0, sizeof(tail));
            for (int r = 0; r < rows; ++r)
                std::memcpy(tail + r * kTileK, j.x + (row + r) * j.x_stride + (tiles_k - 1) * kTileK,
                            tail_cols * 2);
            padded = tail;
        }
        // a task of at most 32 rows (a decode step's) in one pass over k: its A tiles are few,
        // and each block's weight then streams from memory in order (passes read a chunk's
        // blocks a pass's 8 KiB at a time, a new stream for the prefetchers at each; at the
        // 135M model's decode shapes, weights cycled past the cache: 1.08-1.16x)
        const int64_t step = last - first <= 2 * kTileRows ? tiles_k : pass_tiles;
        for (int64_t t0 = 0; t0 < tiles_k; t0 += step) {
            const int64_t t1 = t0 + step < tiles_k ? t0 + step : tiles_k;
            for (int64_t b = block; b < end; b += 2) {
                const bool two_b = b + 1 < end;
                float* partial = partials + (b - block) / 2 * 4 * kTileRows * kLanes;
                if (rows > kTileRows)
                    two_b ? tile_product<true, true>(j, row, rows, b, t0, t1, padded, partial)
                          : tile_product<true, false>(j, row, rows, b, t0, t1, padded, partial);
                else
                    two_b ? tile_product<false, true>(j, row, rows, b, t0, t1, padded, partial)
                          : tile_product<false, false>(j, row, rows, b, t0, t1, padded, partial);
            }
        }
    }
    release();  // the tile state back to its init state: no 8 KiB saved at every switch
}

// rows of x per task: each task reads its chunk of packed weight from memory once (the weights
// of a model's layers outgrow every cache: a layer's are not there again when the next step comes
// back to them), so a weight is read once for every kTaskRows rows; x's rows are read again for
// each chunk, from L2 or the last-level cache. Measured on a Xeon with AMX (2 cores, 16
// distinct weights a shape, as an engine's layers): 1024-row tasks against 256-row ones 1.13-
// 1.26x at the 1B model's MLP shapes with 512 and 1024 rows (the level of oneDNN's packed
// product), 0.95-1.13x at the 135M model's 2048-row prefill shapes (the host's noise)
constexpr int64_t kTaskRows = 32 * 2 * kTileRows;

// packed weight per chunk, at most: half the 2 MiB L2 of a Sapphire Rapids core, the rest for
// x's rows and the sums (measured on one: 13-17% faster products at the 1B model's MLP shapes
// than chunks of twice that, the same at the 135M model's, whose chunks are smaller anyway)
constexpr int64_t kChunkWeightBytes = int64_t(1) << 20;

// blocks per chunk where `blocks` blocks (of all the products a call makes) are shared among
// `threads`: about 8 chunks per thread, an even number of blocks each (whole pairs of B tiles),
// and at most kChunkWeightBytes of packed weight a chunk, so a chunk's blocks stay in L2 while
// its rows of x pass over them (at the 1B model's shapes 8 chunks a thread were 2 MiB each,
// all of L2, and came from memory again for every 32 rows)
int64_t chunk_blocks(int64_t blocks, int64_t k, int threads) {
    const int64_t target = (blocks + 8 * threads - 1) / (8 * threads);
    const int64_t block_bytes = k_tiles(k) * kTileElems * 2;
    const int64_t cap = std::max<int64_t>(2, kChunkWeightBytes / block_bytes / 2 * 2);
    return std::min(cap, (target + 1) / 2 * 2);
}

// One product's task: rows [first, last) of x against blocks [block, end) of its weight.
struct Task {
    int64_t product, first, last, block, end;
};

// The tasks of `jobs` (products of the same k and n, each with its own rows and weight) in one
// parallel region: threads take tasks as they finish the last, kTaskRows rows of x against a
// chunk of blocks, the chunks of one rows' task in turn, as cpu_matmul.cpp's do; the split
// decides which thread computes an output, never how it is summed.
void run_tasks(const std::vector<Job>& jobs, int threads) {
    const int64_t num_blocks = (jobs[0].n + kLanes - 1) / kLanes;
    // each product's chunks as it makes them alone (chunks sized to the products' blocks
    // together were up to 42 blocks at an MoE layer's shapes: sums of 21 pairs of blocks
    // between passes, 84 KiB, past L1, and the 512-token step 1.15x the per-product loop's)
    const int64_t size = chunk_blocks(num_blocks, jobs[0].k, threads);
    std::vector<Task> tasks;
    for (int64_t p = 0; p < static_cast<int64_t>(jobs.size()); ++p)
        for (int64_t first = 0; first < jobs[p].m; first += kTaskRows)
            for (int64_t block = 0; block < num_blocks; block += size)
                tasks.push_back({p, first, std::min(first + kTaskRows, jobs[p].m), block,
                                 std::min(block + size, num_blocks)});
    const int64_t num_tasks = static_cast<int64_t>(tasks.size());
    // each thread's sums between passes: 4 C tiles per pair of blocks of its chunk
    const int64_t partial_floats = size / 2 * 4 * kTileRows * kLanes;
#pragma omp parallel num_threads(threads)
    {
        std::vector<float> partials(partial_floats + 16);
        float* aligned = reinterpret_cast<float*>(
            (reinterpret_cast<uintptr_t>(partials.data()) + 63) & ~uintptr_t(63));
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < num_tasks; ++t) {
            const Task& task = tasks[t];
            chunk(jobs[task.product], task.first, task.last, task.block, task.end, aligned);
        }
    }
}

void product(const Job& j, int threads) { run_tasks({j}, threads); }

// ---- Attention on tiles (cpu_attention.py's row-invariant path on AMX CPUs) ------------------
//
// Every query row of a step, a decode's or a prefill chunk's, is computed from its own query,
// the keys and values [0, ctx) of its sequence and nothing else, in the same order whatever
// rows share its tiles; so a stream's tokens are the same whether its prompt was computed in
// one chunk, several, or row by row as decodes (batch invariance, identical resume).
//
// A task is (chunk, KV head, up to kGroupTokens of the chunk's tokens): its rows, each token
// times the `rep` query heads of that KV head, are computed 16 at a time (a row tile) against
// the keys [0, the tile's last position]. Scores are C = K Q^T: A tiles of 16 keys x 32
// dimensions read in place from the pool's pages (pages of whole 16-key tiles; otherwise from a
// dense copy), B tiles the row tile's queries (16 dimension pairs x 16 rows), so a C tile holds
// 16 keys x the 16 rows and the softmax runs with rows across vector lanes. P.V takes A tiles of
// 16 rows x 32 keys of probabilities and B tiles of V packed once per task (16 key pairs x 16
// dimensions). For each row:
//   1. score_t = scale * (q . k_t) for t < ctx, the dot product as TDPBF16PS sums it, 32
//      dimensions a tile in order (the SDM's model: this file's header; k_t[i] q[i] and q[i]
//      k_t[i] are the same exact product, so which operand is A does not change a sum);
//   2. a softmax over those scores in fp32: the maximum, then p_t = exp(score_t - max) summed in
//      16 partial sums (t mod 16) in key order, added in a fixed tree; p_t rounded to bf16 (as
//      the decode kernel and SDPA's bf16 kernel do), 0 for t >= ctx;
//   3. out_d = (sum_t p_t v_t,d, 32 keys a tile in order) / the sum, rounded to bf16.
// Keys and probabilities past a row's ctx are zero or masked in the tiles (a tile's sums with
// them are its sums without them: exact zeros added to a sum that is not -0, and a sum holds
// p = 1 at its maximum). Rows of one tile differ in ctx only by what they read as zero.
namespace attention {

using kvfleet::exp_approx;
using kvfleet::store;
#if defined(__AVX512F__)
using kvfleet::exp512;
#endif

constexpr int kGroupTokens = 128;  // tokens of a chunk per task

struct Shape {
    int num_heads, num_kv_heads, head_dim, block_size;
    int64_t num_blocks, table_width, q_stride_h, q_stride_t;
    float scale;
};

struct Buffers {  // one thread's, reused across its tasks
    std::vector<uint16_t> q, k, v, p;
    std::vector<float> s, c;
    template <typename V> static auto* aligned(V& vec, size_t n) {
        vec.resize(n + 64);
        using T = typename V::value_type;
        return reinterpret_cast<T*>((reinterpret_cast<uintptr_t>(vec.data()) + 63) & ~uintptr_t(63));
    }
};

// the keys' and values' rows [0, n) of one KV head (pool: [num_blocks, block_size, dim] each),
// packed: k_tiles [n16 / 16][dim / 32][16 pairs][16 keys][2], v_tiles [n32 / 32][dim / 16][16
// key pairs][16 dims][2], rows past n zero (n16, n32: n rounded up to 16 and 32 keys).
#if defined(__AVX512F__)
// rows[i] (16 rows of 16 32-bit words; null: zeros) transposed into out[16][16]: out[w][i] =
// rows[i][w]
KVFLEET_AMX_TARGET inline void transpose16(const uint32_t* const rows[16], uint32_t* out) {
    __m512i r[16], t[16];
    for (int i = 0; i < 16; ++i)
        r[i] = rows[i] ? _mm512_loadu_si512(rows[i]) : _mm512_setzero_si512();
    for (int i = 0; i < 16; i += 2) {  // pairs of rows: words interleaved
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {  // quads: 64-bit pairs interleaved
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    // r[4q + j], 128-bit lane L: rows 4q..4q+3, word 4L + j; the lanes gathered across quads
    for (int j = 0; j < 4; ++j) {
        const __m512i a = _mm512_shuffle_i32x4(r[j], r[4 + j], 0x88);      // lanes 0, 2 of each
        const __m512i b = _mm512_shuffle_i32x4(r[j], r[4 + j], 0xDD);      // lanes 1, 3
        const __m512i c = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0x88);
        const __m512i d = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0xDD);
        const int word = j;
        _mm512_storeu_si512(out + (0 + word) * 16, _mm512_shuffle_i32x4(a, c, 0x88));
        _mm512_storeu_si512(out + (8 + word) * 16, _mm512_shuffle_i32x4(a, c, 0xDD));
        _mm512_storeu_si512(out + (4 + word) * 16, _mm512_shuffle_i32x4(b, d, 0x88));
        _mm512_storeu_si512(out + (12 + word) * 16, _mm512_shuffle_i32x4(b, d, 0xDD));
    }
}
#endif

// the values' rows [0, n) of one KV head (pool: [num_blocks, block_size, dim]) as B tiles of
// 16 key pairs x 16 dimensions: [n32 / 32][dim / 16][16 key pairs][16 dims][2], rows past n zero
//
// While it reads a key's value it prefetches that key's row of keys, which the scores read next
// (tile loads, which no prefetcher runs ahead of), and the value a page ahead: the pages of a
// sequence lie anywhere in the pool, so the hardware's prefetchers start again at each. (On a
// Xeon with AMX, 30 layers of 32 decoding sequences of ~285 keys: 19.6 -> 17.4 ms a step.)
KVFLEET_AMX_TARGET void pack_values(const uint16_t* values, const uint16_t* keys,
                                    const int32_t* table, int n, const Shape& shape,
                                    uint16_t* v_tiles) {
    const int dim = shape.head_dim, bs = shape.block_size;
    const int n32 = (n + 31) / 32 * 32, pages = (n + bs - 1) / bs;
    int page = 0, slot = 0;  // key t's place, walked page by page as t goes up by one
    auto next_row = [&](int t) -> const uint16_t* {
        const uint16_t* at = nullptr;
        if (t < n) {
            const int64_t row = static_cast<int64_t>(table[page]) * bs + slot;
            at = values + row * dim;
            const char* key = reinterpret_cast<const char*>(keys + row * dim);
            for (int l = 0; l < dim * 2; l += 64) __builtin_prefetch(key + l, 0, 3);
            if (page + 1 < pages) {
                const char* ahead = reinterpret_cast<const char*>(
                    values + (static_cast<int64_t>(table[page + 1]) * bs + slot) * dim);
                for (int l = 0; l < dim * 2; l += 64) __builtin_prefetch(ahead + l, 0, 2);
            }
        }
        if (++slot == bs) slot = 0, ++page;
        return at;
    };
    for (int t0 = 0; t0 < n32; t0 += 2) {  // a key pair's rows side by side per dimension
        uint32_t* vt = reinterpret_cast<uint32_t*>(v_tiles) + static_cast<int64_t>(t0 / 32) * dim * 16 + (t0 % 32 / 2) * 16;
        const uint16_t* v0 = next_row(t0);
        const uint16_t* v1 = next_row(t0 + 1);
#if defined(__AVX512F__)
        for (int d = 0; d < dim; d += 16) {
            const __m512i a = v0 ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v0 + d)))
                                 : _mm512_setzero_si512();
            const __m512i b = v1 ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v1 + d)))
                                 : _mm512_setzero_si512();
            _mm512_storeu_si512(vt + (d / 16) * 256, _mm512_or_si512(a, _mm512_slli_epi32(b, 16)));
        }
#else
        for (int d = 0; d < dim; ++d)
            vt[(d / 16) * 256 + d % 16] = (v0 ? v0[d] : 0u) | (v1 ? uint32_t(v1[d]) << 16 : 0u);
#endif
    }
}

// The tile registers by number (the intrinsics paste the number into the instruction's text: one
// branch per register, chosen at compile time).
#if defined(KVFLEET_AMX_EMULATE)
template <int T> inline void tload(const void* at, int64_t stride) { tiles::load(T, at, stride); }
template <int T> inline void tstore(void* at) { tiles::store(T, at, kRowBytes); }
template <int T> inline void tzero() { tiles::zero(T); }
template <int C, int A, int B> inline void tdot() { tiles::dpbf16ps(C, A, B); }
#else
#define KVFLEET_TILE_CASES(F) F(0) F(1) F(2) F(3) F(4) F(5) F(6) F(7)
template <int T> KVFLEET_AMX_TARGET inline void tload(const void* at, int64_t stride) {
    barrier();
#define KVFLEET_LOAD(i) if constexpr (T == i) _tile_loadd(i, at, stride);
    KVFLEET_TILE_CASES(KVFLEET_LOAD)
#undef KVFLEET_LOAD
}
template <int T> KVFLEET_AMX_TARGET inline void tstore(void* at) {
#define KVFLEET_STORE(i) if constexpr (T == i) _tile_stored(i, at, kRowBytes);
    KVFLEET_TILE_CASES(KVFLEET_STORE)
#undef KVFLEET_STORE
}
template <int T> KVFLEET_AMX_TARGET inline void tzero() {
#define KVFLEET_ZERO(i) if constexpr (T == i) _tile_zero(i);
    KVFLEET_TILE_CASES(KVFLEET_ZERO)
#undef KVFLEET_ZERO
}
template <int C, int A, int B> KVFLEET_AMX_TARGET inline void tdot() {
#define KVFLEET_DOT_B(c, a, b) if constexpr (C == c && A == a && B == b) _tile_dpbf16ps(c, a, b);
#define KVFLEET_DOT(c, a) KVFLEET_DOT_B(c, a, 4) KVFLEET_DOT_B(c, a, 5) \
    KVFLEET_DOT_B(c, a, 6) KVFLEET_DOT_B(c, a, 7)
    KVFLEET_DOT(0, 2) KVFLEET_DOT(0, 3) KVFLEET_DOT(1, 2) KVFLEET_DOT(1, 3)
#undef KVFLEET_DOT
#undef KVFLEET_DOT_B
}
#undef KVFLEET_TILE_CASES
#endif

// the 16 rows' queries (rows[i], null past the tile's rows) as B tiles, one per 32 dimensions:
// [16 dimension pairs][16 rows][2]
KVFLEET_AMX_TARGET void pack_queries(const uint16_t* const rows[16], int dim, uint32_t* out) {
    for (int dt = 0; dt < dim / 32; ++dt) {
        const uint32_t* part[16];
        for (int i = 0; i < 16; ++i)
            part[i] = rows[i] ? reinterpret_cast<const uint32_t*>(rows[i]) + dt * 16 : nullptr;
#if defined(__AVX512F__)
        transpose16(part, out + dt * 256);
#else
        for (int pair = 0; pair < 16; ++pair)
            for (int i = 0; i < 16; ++i) out[dt * 256 + pair * 16 + i] = part[i] ? part[i][pair] : 0u;
#endif
    }
}

// scores of keys [16 g, 16 g + 32) (two key tiles, the A tiles: 16 keys x 32 dimensions, `stride`
// bytes between keys) against the row tile's queries (B tiles tmm4..): C tile [16 keys][16 rows]
// into s_t + 256 g
template <int kDimTiles>
KVFLEET_AMX_TARGET void score_pair(const uint16_t* k0, const uint16_t* k1, int64_t stride,
                                   float* s_t) {
    tzero<0>();
    tzero<1>();
    tload<2>(k0, stride);
    tload<3>(k1, stride);
    tdot<0, 2, 4>();
    tdot<1, 3, 4>();
    if constexpr (kDimTiles > 1) {
        tload<2>(k0 + 32, stride);
        tload<3>(k1 + 32, stride);
        tdot<0, 2, 5>();
        tdot<1, 3, 5>();
    }
    if constexpr (kDimTiles > 2) {
        tload<2>(k0 + 64, stride);
        tload<3>(k1 + 64, stride);
        tdot<0, 2, 6>();
        tdot<1, 3, 6>();
    }
    if constexpr (kDimTiles > 3) {
        tload<2>(k0 + 96, stride);
        tload<3>(k1 + 96, stride);
        tdot<0, 2, 7>();
        tdot<1, 3, 7>();
    }
    tstore<0>(s_t);
    tstore<1>(s_t + 256);
}

// The rows' softmax (step 2) from their scores, keys across tiles and rows across lanes (s_t:
// [key][16 rows], unscaled, 32 * key_pairs keys), into probabilities for P.V (p: [32-key tile][16
// rows][32 keys], bf16) and 1 / their sums (inv[16]). ctx[r]: row r's keys (0 past the tile's
// rows). Each row's sums: 16 partial sums (key t into sum t mod 16) in key order, then a fixed
// tree. The AVX-512 form and the scalar one (an emulation build on a CPU without AVX-512) take
// the same steps: exp512 is exp_approx on 16 lanes, VCVTNEPS2BF16 rounds as store() does (no
// probability is a denormal: exp_approx's input is clamped at -87).
#if defined(__AVX512F__) && defined(__AVX512BF16__)
KVFLEET_AMX_TARGET void softmax_lanes(const float* s_t, const int* ctx, int key_pairs, float scale,
                                      uint16_t* p, float* inv) {
    const __m512 scales = _mm512_set1_ps(scale);
    const __m512i limit = _mm512_loadu_si512(ctx);
    const int keys = key_pairs * 32;
    int last = 0;
    for (int r = 0; r < 16; ++r) last = ctx[r] > last ? ctx[r] : last;
    __m512 mv = _mm512_set1_ps(-INFINITY);
    for (int t = 0; t < last; ++t) {
        const __mmask16 valid = _mm512_cmpgt_epi32_mask(limit, _mm512_set1_epi32(t));
        mv = _mm512_mask_max_ps(mv, valid, mv, _mm512_mul_ps(_mm512_loadu_ps(s_t + t * 16), scales));
    }
    __m512 sums[16];
    for (int l = 0; l < 16; ++l) sums[l] = _mm512_setzero_ps();
    for (int t0 = 0; t0 < keys; t0 += 16) {
        alignas(64) float e[16][16];  // [key][row]
        for (int l = 0; l < 16; ++l) {
            const int t = t0 + l;
            const __mmask16 valid = _mm512_cmpgt_epi32_mask(limit, _mm512_set1_epi32(t));
            const __m512 v = _mm512_mul_ps(_mm512_loadu_ps(s_t + t * 16), scales);
            const __m512 x = _mm512_maskz_mov_ps(valid, exp512(_mm512_sub_ps(v, mv)));
            sums[l] = _mm512_add_ps(sums[l], x);
            _mm512_store_ps(e[l], x);
        }
        const uint32_t* rows[16];
        for (int l = 0; l < 16; ++l) rows[l] = reinterpret_cast<const uint32_t*>(e[l]);
        alignas(64) float by_row[16][16];  // [row][key]
        transpose16(rows, reinterpret_cast<uint32_t*>(by_row));
        for (int r = 0; r < 16; ++r)
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + (static_cast<int64_t>(t0 / 32) * 16 + r) * 32 + t0 % 32),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(by_row[r])));
    }
    for (int width = 8; width >= 1; width /= 2)  // the fixed tree: sum l += sum l + width
        for (int l = 0; l < width; ++l) sums[l] = _mm512_add_ps(sums[l], sums[l + width]);
    _mm512_storeu_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.f), sums[0]));
}
#else
void softmax_lanes(const float* s_t, const int* ctx, int key_pairs, float scale, uint16_t* p,
                   float* inv) {
    for (int r = 0; r < 16; ++r) {
        const int n = ctx[r];
        float m = -INFINITY;
        for (int t = 0; t < n; ++t) m = s_t[t * 16 + r] * scale > m ? s_t[t * 16 + r] * scale : m;
        float sums[16] = {};
        for (int t = 0; t < key_pairs * 32; ++t) {
            const float e = t < n ? exp_approx(s_t[t * 16 + r] * scale - m) : 0.f;
            sums[t % 16] += e;
            store(e, p + (static_cast<int64_t>(t / 32) * 16 + r) * 32 + t % 32);
        }
        for (int width = 8; width >= 1; width /= 2)  // the fixed tree: sum l += sum l + width
            for (int l = 0; l < width; ++l) sums[l] += sums[l + width];
        inv[r] = 1.f / sums[0];
    }
}
#endif

// one task: tokens [first, first + tokens) of a chunk whose token i is at position pos0 + i
template <int kDimTiles>
KVFLEET_AMX_TARGET void task(const uint16_t* q, const uint16_t* keys, const uint16_t* values,
                             uint16_t* out, const int32_t* table, int q_row, int pos0, int first,
                             int tokens, int kvh, const Shape& shape, Buffers& b) {
    constexpr int dim = 32 * kDimTiles;
    const int rep = shape.num_heads / shape.num_kv_heads, bs = shape.block_size;
    const int rows = tokens * rep, n = pos0 + first + tokens;  // keys [0, n)
    const int n32 = (n + 31) / 32 * 32;
    // keys are read in place where a page holds whole 16-key tiles, else from a dense copy
    const bool in_place = bs % 16 == 0;
    // in place: a 16-key tile past the last key reads zeros (its page is not the sequence's)
    uint16_t* dense = Buffers::aligned(b.k, static_cast<size_t>(in_place ? 16 : n32) * dim);
    if (in_place) std::memset(dense, 0, static_cast<size_t>(16) * dim * 2);
    uint16_t* vt = Buffers::aligned(b.v, static_cast<size_t>(n32) * dim);
    float* s_t = Buffers::aligned(b.s, static_cast<size_t>(16) * n32);
    uint16_t* p = Buffers::aligned(b.p, static_cast<size_t>(16) * n32);
    uint32_t* qt = reinterpret_cast<uint32_t*>(Buffers::aligned(b.q, static_cast<size_t>(kDimTiles) * 512));
    float* c = Buffers::aligned(b.c, 2 * 256 + 16);
    pack_values(values, keys, table, n, shape, vt);
    if (!in_place)
        for (int t = 0; t < n32; ++t) {
            if (t < n) std::memcpy(dense + t * dim, keys + (static_cast<int64_t>(table[t / bs]) * bs + t % bs) * dim, dim * 2);
            else std::memset(dense + t * dim, 0, dim * 2);
        }
    auto key_tile = [&](int t0) -> const uint16_t* {  // the A tile of keys [t0, t0 + 16)
        if (!in_place) return dense + static_cast<int64_t>(t0) * dim;
        return t0 < n ? keys + (static_cast<int64_t>(table[t0 / bs]) * bs + t0 % bs) * dim : dense;
    };
    alignas(64) int ctx[16];
    alignas(64) float inv[16];
    for (int r0 = 0; r0 < rows; r0 += 16) {
        const int count = rows - r0 < 16 ? rows - r0 : 16;
        const uint16_t* row_q[16];
        int last = 0;  // the tile's keys: [0, last)
        for (int r = 0; r < 16; ++r) {
            const int row = r0 + r, token = first + row / rep;
            row_q[r] = r < count ? q + (kvh * rep + row % rep) * shape.q_stride_h + (q_row + token) * shape.q_stride_t
                                 : nullptr;
            ctx[r] = r < count ? pos0 + token + 1 : 0;
            last = ctx[r] > last ? ctx[r] : last;
        }
        pack_queries(row_q, dim, qt);
        tload<4>(qt, kRowBytes);
        if constexpr (kDimTiles > 1) tload<5>(qt + 256, kRowBytes);
        if constexpr (kDimTiles > 2) tload<6>(qt + 512, kRowBytes);
        if constexpr (kDimTiles > 3) tload<7>(qt + 768, kRowBytes);
        const int pairs = (last + 31) / 32;  // 32-key tiles
        for (int kp = 0; kp < pairs; ++kp)
            score_pair<kDimTiles>(key_tile(32 * kp), key_tile(32 * kp + 16), dim * 2,
                                  s_t + static_cast<int64_t>(kp) * 512);
        softmax_lanes(s_t, ctx, pairs, shape.scale, p, inv);
        for (int db = 0; db < dim / 16; db += 2) {  // outputs [16 db, 16 db + 32)
            tzero<0>();
            tzero<1>();
            for (int kp = 0; kp < pairs; ++kp) {
                tload<2>(p + static_cast<int64_t>(kp) * 512, kRowBytes);
                tload<4>(vt + (static_cast<int64_t>(kp) * dim / 16 + db) * 512, kRowBytes);
                tload<5>(vt + (static_cast<int64_t>(kp) * dim / 16 + db + 1) * 512, kRowBytes);
                tdot<0, 2, 4>();
                tdot<1, 2, 5>();
            }
            tstore<0>(c);
            tstore<1>(c + 256);
            for (int r = 0; r < count; ++r) {
                const int row = r0 + r, token = first + row / rep, head = kvh * rep + row % rep;
                uint16_t* o = out + (static_cast<int64_t>(q_row + token) * shape.num_heads + head) * dim + 16 * db;
                for (int half = 0; half < 2; ++half)
                    for (int l = 0; l < 16; ++l) store(c[half * 256 + r * 16 + l] * inv[r], o + half * 16 + l);
            }
        }
    }
}

}  // namespace attention


namespace attention {

void run(const uint16_t* q, const uint16_t* kv, uint16_t* out, const int32_t* tables,
         const int32_t* q_starts, const int32_t* q_lens, const int32_t* ctx_ends, int num_chunks,
         const Shape& shape, int num_threads) {
    const int64_t head_elems = shape.num_blocks * shape.block_size * shape.head_dim;
    const uint16_t* values = kv + shape.num_kv_heads * head_elems;
    std::vector<int64_t> offsets(num_chunks + 1, 0);  // tasks before each chunk (per KV head)
    for (int c = 0; c < num_chunks; ++c)
        offsets[c + 1] = offsets[c] + (q_lens[c] + kGroupTokens - 1) / kGroupTokens;
    const int64_t tasks = offsets[num_chunks] * shape.num_kv_heads;
    const int dim_tiles = shape.head_dim / 32;
#pragma omp parallel num_threads(num_threads)
    {
        Buffers buffers;
        configure(config_for(kTileRows, kTileRows));  // every tile 16 rows of 64 bytes
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < tasks; ++t) {
            const int kvh = static_cast<int>(t % shape.num_kv_heads);
            const int64_t group = t / shape.num_kv_heads;
            const int c = static_cast<int>(
                std::upper_bound(offsets.begin(), offsets.end(), group) - offsets.begin() - 1);
            const int first = static_cast<int>(group - offsets[c]) * kGroupTokens;
            const int tokens = q_lens[c] - first < kGroupTokens ? q_lens[c] - first : kGroupTokens;
            auto* run_task = dim_tiles == 1 ? task<1> : dim_tiles == 2 ? task<2>
                           : dim_tiles == 3 ? task<3> : task<4>;
            run_task(q, kv + kvh * head_elems, values + kvh * head_elems, out,
                     tables + c * shape.table_width, q_starts[c], ctx_ends[c] - q_lens[c], first,
                     tokens, kvh, shape, buffers);
        }
        release();
    }
}

}  // namespace attention

enum class Epilogue { kStore, kAdd, kSilu };

// kvfleet_amx_linear and its fused forms: the arguments checked, then the product
int run_product(int dtype, const void* x, int64_t m, int64_t k, int64_t x_stride,
                const void* packed, int64_t n, const float* bias, void* y, int64_t y_stride,
                int threads, Epilogue epilogue) {
    if (!kvfleet_amx_supported(dtype)) return -1;
    if (m <= 0 || n <= 0) return 0;
    Job job{static_cast<const uint16_t*>(x), m, k, x_stride, static_cast<const uint16_t*>(packed),
            n, bias, static_cast<uint16_t*>(y), y_stride};
    job.add = epilogue == Epilogue::kAdd;
    job.silu = epilogue == Epilogue::kSilu;
    product(job, threads);
    return 0;
}

}  // namespace

extern "C" {  // the arguments of each: cpu_amx.h

int kvfleet_amx_supported(int dtype) {
    if (dtype != kTilesCode) return 0;
#if defined(KVFLEET_AMX_EMULATE)
    return 2;
#else
    static const bool granted = tiles_granted();  // asked once per process
    return granted ? 1 : 0;
#endif
}

int kvfleet_amx_pack(int dtype, const void* w, int64_t n, int64_t k, void* out, int threads) {
    if (dtype != kTilesCode) return -1;
    const uint16_t* from = static_cast<const uint16_t*>(w);
    uint16_t* to = static_cast<uint16_t*>(out);
    const int64_t pairs = k_tiles(k) * kTileK / 2, num_blocks = (n + kLanes - 1) / kLanes;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t block = 0; block < num_blocks; ++block)
        for (int64_t q = 0; q < pairs; ++q)
            for (int lane = 0; lane < kLanes; ++lane)
                for (int h = 0; h < 2; ++h) {
                    const int64_t row = block * kLanes + lane, col = 2 * q + h;
                    to[((block * pairs + q) * kLanes + lane) * 2 + h] =
                        row < n && col < k ? from[row * k + col] : uint16_t(0);
                }
    return 0;
}

int kvfleet_amx_linear(int dtype, const void* x, int64_t m, int64_t k, int64_t x_stride,
                       const void* packed, int64_t n, const float* bias, void* y,
                       int64_t y_stride, int threads) {
    return run_product(dtype, x, m, k, x_stride, packed, n, bias, y, y_stride, threads,
                       Epilogue::kStore);
}

int kvfleet_amx_linear_add(int dtype, const void* x, int64_t m, int64_t k, int64_t x_stride,
                           const void* packed, int64_t n, const float* bias, void* y,
                           int64_t y_stride, int threads) {
    return run_product(dtype, x, m, k, x_stride, packed, n, bias, y, y_stride, threads,
                       Epilogue::kAdd);
}

int kvfleet_amx_linear_silu(int dtype, const void* x, int64_t m, int64_t k, int64_t x_stride,
                            const void* packed, int64_t n, const float* bias, void* y,
                            int64_t y_stride, int threads) {
    // product()'s chunks are whole pairs of blocks from an even block, so each TwoB call is one
    // gate/up pair
    if (kvfleet_amx_supported(dtype) && n % (2 * kLanes) != 0) return 1;
    return run_product(dtype, x, m, k, x_stride, packed, n, bias, y, y_stride, threads,
                       Epilogue::kSilu);
}

int kvfleet_amx_linear_groups(int dtype, const void* x, int64_t k, int64_t x_stride,
                              const int64_t* offsets, const int64_t* weights, int64_t count,
                              int64_t n, void* y, int64_t y_stride, int threads) {
    if (!kvfleet_amx_supported(dtype)) return -1;
    if (count <= 0 || n <= 0) return 0;
    std::vector<Job> jobs;
    for (int64_t g = 0; g < count; ++g) {
        const int64_t first = offsets[g], m = offsets[g + 1] - first;
        if (m <= 0) continue;
        jobs.push_back(Job{static_cast<const uint16_t*>(x) + first * x_stride, m, k, x_stride,
                           reinterpret_cast<const uint16_t*>(weights[g]), n, nullptr,
                           static_cast<uint16_t*>(y) + first * y_stride, y_stride});
    }
    if (!jobs.empty()) run_tasks(jobs, threads);
    return 0;
}

int kvfleet_amx_attention(const void* q, int64_t q_stride_h, int64_t q_stride_t, const void* kv,
                          void* out, const int32_t* tables, int64_t table_width,
                          const int32_t* q_starts, const int32_t* q_lens, const int32_t* ctx_ends,
                          int num_chunks, int num_heads, int num_kv_heads, int head_dim,
                          int64_t num_blocks, int block_size, float scale, int num_threads) {
    if (!kvfleet_amx_supported(kTilesCode)) return -1;
    if (head_dim <= 0 || head_dim % 32 != 0 || head_dim > 128) return 1;
    if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0 || block_size <= 0) return 2;
    if (num_chunks <= 0) return 0;
    const attention::Shape shape{num_heads, num_kv_heads, head_dim, block_size, num_blocks,
                                 table_width, q_stride_h, q_stride_t, scale};
    attention::run(static_cast<const uint16_t*>(q), static_cast<const uint16_t*>(kv),
                   static_cast<uint16_t*>(out), tables, q_starts, q_lens, ctx_ends, num_chunks,
                   shape, num_threads);
    return 0;
}

}  // extern "C"
