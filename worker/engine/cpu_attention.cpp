// Paged decode attention on the CPU: each decoding sequence's one query (all query heads of a KV
// head together) attends over its K/V read in place from the pool's blocks through its block
// table, fp32 accumulation, exact softmax (max subtracted). No dense copy, no padding.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

inline float load(float x) { return x; }
inline float load(uint16_t x) {  // bf16 -> fp32: the high half of the fp32 bits
    uint32_t bits = static_cast<uint32_t>(x) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}
// v rounded to Q's precision and back: probabilities go to the P.V product in the model's dtype,
// as SDPA's flash kernel hands them to its second matrix product (agreement with HF in bf16)
inline float round_to(float v, const float*) { return v; }
inline float round_to(float v, const uint16_t*) {
    uint32_t bits;
    std::memcpy(&bits, &v, 4);
    bits += 0x7FFF + ((bits >> 16) & 1);
    bits &= 0xFFFF0000u;
    std::memcpy(&v, &bits, 4);
    return v;
}
inline void store(float v, float* out) { *out = v; }
inline void store(float v, uint16_t* out) {  // fp32 -> bf16, round to nearest even
    uint32_t bits;
    std::memcpy(&bits, &v, 4);
    if (std::isnan(v)) { *out = 0x7FC0; return; }
    bits += 0x7FFF + ((bits >> 16) & 1);
    *out = static_cast<uint16_t>(bits >> 16);
}

template <typename Q, typename KV>
void decode(const Q* q, int64_t q_stride_h, int64_t q_stride_t, const KV* kv, Q* out,
            const int32_t* tables, int64_t table_width, const int32_t* ctx_lens, int num_seqs,
            int num_heads, int num_kv_heads, int head_dim, int64_t num_blocks, int block_size,
            float scale, int num_threads) {
    const int rep = num_heads / num_kv_heads;
    const int64_t head_rows = num_blocks * block_size;  // K rows of one KV head
    const KV* keys = kv;
    const KV* values = kv + static_cast<int64_t>(num_kv_heads) * head_rows * head_dim;
    const int tasks = num_seqs * num_kv_heads;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int task = 0; task < tasks; ++task) {
        const int seq = task / num_kv_heads, kvh = task % num_kv_heads;
        const int ctx = ctx_lens[seq];
        const int32_t* table = tables + seq * table_width;
        std::vector<float> qf(rep * head_dim), row(head_dim), acc(rep * head_dim, 0.f);
        std::vector<float> scores(static_cast<size_t>(rep) * ctx);
        for (int r = 0; r < rep; ++r) {
            const Q* src = q + (kvh * rep + r) * q_stride_h + seq * q_stride_t;
            for (int d = 0; d < head_dim; ++d) qf[r * head_dim + d] = load(src[d]);
        }
        const KV* k_head = keys + kvh * head_rows * head_dim;
        const KV* v_head = values + kvh * head_rows * head_dim;
        for (int t = 0; t < ctx; ++t) {
            const KV* k = k_head + (static_cast<int64_t>(table[t / block_size]) * block_size + t % block_size) * head_dim;
            float* kr = row.data();
#pragma omp simd
            for (int d = 0; d < head_dim; ++d) kr[d] = load(k[d]);
            for (int r = 0; r < rep; ++r) {
                const float* qr = qf.data() + r * head_dim;
                float s = 0.f;
#pragma omp simd reduction(+ : s)
                for (int d = 0; d < head_dim; ++d) s += qr[d] * kr[d];
                scores[static_cast<size_t>(r) * ctx + t] = s * scale;  // scaled after the dot, as SDPA
            }
        }
        std::vector<float> inv(rep);
        for (int r = 0; r < rep; ++r) {
            float* sr = scores.data() + static_cast<size_t>(r) * ctx;
            float m = -INFINITY;
            for (int t = 0; t < ctx; ++t) m = std::max(m, sr[t]);
            float sum = 0.f;
            for (int t = 0; t < ctx; ++t) {
                const float p = std::exp(sr[t] - m);
                sum += p;  // the normaliser from the unrounded probabilities, as SDPA
                sr[t] = round_to(p, static_cast<const Q*>(nullptr));
            }
            inv[r] = 1.f / sum;
        }
        for (int t = 0; t < ctx; ++t) {
            const KV* v = v_head + (static_cast<int64_t>(table[t / block_size]) * block_size + t % block_size) * head_dim;
            float* vr = row.data();
#pragma omp simd
            for (int d = 0; d < head_dim; ++d) vr[d] = load(v[d]);
            for (int r = 0; r < rep; ++r) {
                const float p = scores[static_cast<size_t>(r) * ctx + t];
                float* ar = acc.data() + r * head_dim;
#pragma omp simd
                for (int d = 0; d < head_dim; ++d) ar[d] += p * vr[d];
            }
        }
        for (int r = 0; r < rep; ++r) {
            Q* dst = out + (static_cast<int64_t>(seq) * num_heads + kvh * rep + r) * head_dim;
            for (int d = 0; d < head_dim; ++d) store(acc[r * head_dim + d] * inv[r], dst + d);
        }
    }
}

}  // namespace

extern "C" int kvfleet_paged_decode(
        int dtype, const void* q, int64_t q_stride_h, int64_t q_stride_t, const void* kv, void* out,
        const int32_t* tables, int64_t table_width, const int32_t* ctx_lens, int num_seqs,
        int num_heads, int num_kv_heads, int head_dim, int64_t num_blocks, int block_size,
        float scale, int num_threads) {
    // dtype: 0 = float32 (queries, output and K/V), 1 = bfloat16
    if (dtype == 0)
        decode(static_cast<const float*>(q), q_stride_h, q_stride_t, static_cast<const float*>(kv),
               static_cast<float*>(out), tables, table_width, ctx_lens, num_seqs, num_heads,
               num_kv_heads, head_dim, num_blocks, block_size, scale, num_threads);
    else if (dtype == 1)
        decode(static_cast<const uint16_t*>(q), q_stride_h, q_stride_t,
               static_cast<const uint16_t*>(kv), static_cast<uint16_t*>(out), tables, table_width,
               ctx_lens, num_seqs, num_heads, num_kv_heads, head_dim, num_blocks, block_size,
               scale, num_threads);
    else
        return 1;
    return 0;
}
