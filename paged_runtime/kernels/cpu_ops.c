/* CPU kernels for the decode step (see cpu.py, which compiles and loads this file).
 *
 * A batch-1 decode step on the CPU is bound by reading the weights once: every
 * kernel here keeps its own work small and, where it streams weights, keeps the
 * memory system busy (one contiguous stream per thread, software prefetch far
 * ahead: measured 22-26 GB/s over SmolLM2's 120 layer matrices where torch.mv
 * reached 15-17, on the development machine).
 *
 * Numerics follow the PyTorch path of models/llama.py: fp32 arithmetic, with a
 * rounding to the tensor dtype exactly where PyTorch stores an intermediate in
 * that dtype, so the two paths differ in the order of fp32 sums and, in attention,
 * in keeping the softmax probabilities in fp32 (PyTorch's bf16 SDPA rounds them).
 *
 * Tensors are bfloat16 (dt = 1) or float32 (dt = 0); index tensors int64.
 * OpenMP threads come from the runtime PyTorch already loaded (same soname).
 */
#if defined(__AMX_INT8__) && !defined(PR_AMX_EMULATE)
#define _GNU_SOURCE /* syscall(), for the AMX tile permission */
#include <sys/syscall.h>
#include <unistd.h>
#endif
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

enum { F32 = 0, BF16 = 1 };
#ifndef MAX_ROWS
#define MAX_ROWS 32 /* linear() and decode_layer(): rows of x per weight pass */
#endif
#ifndef PREFETCH
#define PREFETCH 4096 /* bytes ahead of the weight stream */
#endif

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, as c10::BFloat16 */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float load(const void *p, int64_t i, int dt) {
    return dt == BF16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline void store(void *p, int64_t i, float v, int dt) {
    if (dt == BF16) ((uint16_t *)p)[i] = f32_to_bf16(v);
    else ((float *)p)[i] = v;
}

/* The value PyTorch would hold after storing v in a tensor of dtype dt. */
static inline float rnd(float v, int dt) { return dt == BF16 ? bf16_to_f32(f32_to_bf16(v)) : v; }

/* Cache-line aligned scratch: vector loads and stores never split a line. */
static void *alloc_lines(size_t bytes) { return aligned_alloc(64, (bytes + 63) / 64 * 64); }

static void thread_range(int64_t n, int64_t *begin, int64_t *end) {
    int t = omp_get_thread_num(), T = omp_get_num_threads();
    int64_t per = (n + T - 1) / T;
    *begin = t * per < n ? t * per : n;
    *end = *begin + per < n ? *begin + per : n;
}

/* ---- 16-float vectors: AVX-512 registers, or pairs of AVX2 ones ------------------------------- */

/* The vector paths below are written once against V16 (16 fp32 lanes). With AVX-512F a V16 is one __m512;
 * with AVX2 + FMA (every AVX2 CPU has FMA) it is two __m256, so the same loops run at half the width. Only
 * their tails differ: AVX-512 masks them, AVX2 finishes them in scalar code. */
#if defined(__AVX512F__)
#define VEC16 1
typedef __m512 V16;
static inline V16 v16_zero(void) { return _mm512_setzero_ps(); }
static inline V16 v16_set1(float a) { return _mm512_set1_ps(a); }
static inline V16 v16_loadf(const float *p) { return _mm512_loadu_ps(p); }
static inline void v16_storef(float *p, V16 v) { _mm512_storeu_ps(p, v); }
static inline V16 v16_add(V16 a, V16 b) { return _mm512_add_ps(a, b); }
static inline V16 v16_sub(V16 a, V16 b) { return _mm512_sub_ps(a, b); }
static inline V16 v16_mul(V16 a, V16 b) { return _mm512_mul_ps(a, b); }
static inline V16 v16_div(V16 a, V16 b) { return _mm512_div_ps(a, b); }
static inline V16 v16_max(V16 a, V16 b) { return _mm512_max_ps(a, b); }
static inline V16 v16_fmadd(V16 a, V16 b, V16 c) { return _mm512_fmadd_ps(a, b, c); }
static inline V16 v16_fnmadd(V16 a, V16 b, V16 c) { return _mm512_fnmadd_ps(a, b, c); } /* c - a * b */
static inline V16 v16_load_i32(const int32_t *p) { return _mm512_cvtepi32_ps(_mm512_loadu_si512(p)); } /* as floats */
/* Lane l plus lane l + 8: v16_sum's first step (see fold_sum). */
static inline __m256 v16_fold(V16 v) {
    return _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}
static inline float v16_hmax(V16 v) { return _mm512_reduce_max_ps(v); }

static inline V16 load16(const void *p, int64_t i, int dt) {
    if (dt == BF16) {
        __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_loadu_ps((const float *)p + i);
}

static inline __m512 load16_masked(const void *p, int64_t i, int dt, __mmask16 m) {
    if (dt == BF16) {
        __m256i h = _mm256_maskz_loadu_epi16(m, (const uint16_t *)p + i);
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_maskz_loadu_ps(m, (const float *)p + i);
}

/* round(x) to the nearest integer and 2^n * p */
static inline V16 v16_round(V16 x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline V16 v16_scale2(V16 p, V16 n) { return _mm512_scalef_ps(p, n); }
static inline V16 v16_exp_cap(V16 x) { return x; } /* scalef saturates to inf by itself */

/* v as PyTorch would hold it after storing it in dt (round to nearest even for bfloat16, NaN kept). */
static inline V16 round16(V16 v, int dt) {
    if (dt != BF16) return v;
    __m512i u = _mm512_castps_si512(v);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
    r = _mm512_and_si512(r, _mm512_set1_epi32((int)0xffff0000u));
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_castsi512_ps(r), v);
}

/* Stores 16 values already rounded to dt. */
static inline void store16(void *p, int64_t i, V16 rounded, int dt) {
    if (dt == BF16)
        _mm256_storeu_si256((__m256i *)((uint16_t *)p + i),
                            _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(rounded), 16)));
    else _mm512_storeu_ps((float *)p + i, rounded);
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define VEC16 1
typedef struct {
    __m256 lo, hi;
} V16;
static inline V16 v16_pair(__m256 lo, __m256 hi) { return (V16){lo, hi}; }
static inline V16 v16_zero(void) { return v16_pair(_mm256_setzero_ps(), _mm256_setzero_ps()); }
static inline V16 v16_set1(float a) { return v16_pair(_mm256_set1_ps(a), _mm256_set1_ps(a)); }
static inline V16 v16_loadf(const float *p) { return v16_pair(_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)); }
static inline void v16_storef(float *p, V16 v) { _mm256_storeu_ps(p, v.lo), _mm256_storeu_ps(p + 8, v.hi); }
static inline V16 v16_add(V16 a, V16 b) { return v16_pair(_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)); }
static inline V16 v16_sub(V16 a, V16 b) { return v16_pair(_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)); }
static inline V16 v16_mul(V16 a, V16 b) { return v16_pair(_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)); }
static inline V16 v16_div(V16 a, V16 b) { return v16_pair(_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)); }
/* NaN in b is kept: max returns its second operand when either is NaN */
static inline V16 v16_max(V16 a, V16 b) { return v16_pair(_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)); }
static inline V16 v16_fmadd(V16 a, V16 b, V16 c) {
    return v16_pair(_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi));
}
static inline V16 v16_fnmadd(V16 a, V16 b, V16 c) { /* c - a * b */
    return v16_pair(_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi));
}
static inline V16 v16_load_i32(const int32_t *p) { /* as floats */
    return v16_pair(_mm256_cvtepi32_ps(_mm256_loadu_si256((const __m256i *)p)),
                    _mm256_cvtepi32_ps(_mm256_loadu_si256((const __m256i *)(p + 8))));
}
static inline __m256 v16_fold(V16 v) { return _mm256_add_ps(v.lo, v.hi); } /* lane l plus lane l + 8 */
static inline float v16_hmax(V16 v) {
    __m256 s = _mm256_max_ps(v.lo, v.hi);
    __m128 t = _mm_max_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    t = _mm_max_ps(t, _mm_movehl_ps(t, t));
    return _mm_cvtss_f32(_mm_max_ss(t, _mm_movehdup_ps(t)));
}

static inline __m256 bf16x8_to_f32(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
static inline V16 load16(const void *p, int64_t i, int dt) {
    if (dt == BF16) return v16_pair(bf16x8_to_f32((const uint16_t *)p + i), bf16x8_to_f32((const uint16_t *)p + i + 8));
    return v16_loadf((const float *)p + i);
}

static inline __m256 round_half8(__m256 x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline V16 v16_round(V16 x) { return v16_pair(round_half8(x.lo), round_half8(x.hi)); }
/* 2^n * p for integral n in exp's range (n + 127 in 1..254 after exp16's clamp) */
static inline __m256 scale2_8(__m256 p, __m256 n) {
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
static inline V16 v16_scale2(V16 p, V16 n) { return v16_pair(scale2_8(p.lo, n.lo), scale2_8(p.hi, n.hi)); }
/* exp(88) is finite (2^127 * p); above it the exponent would overflow: exp16 gives exp(88) there. NaN stays NaN
 * (min returns its second operand then): attention's online softmax passes a NaN score straight to exp16. */
static inline V16 v16_exp_cap(V16 x) {
    return v16_pair(_mm256_min_ps(_mm256_set1_ps(88.f), x.lo), _mm256_min_ps(_mm256_set1_ps(88.f), x.hi));
}

static inline __m256 round8_bf16(__m256 v) {
    __m256i u = _mm256_castps_si256(v);
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff)));
    r = _mm256_and_si256(r, _mm256_set1_epi32((int)0xffff0000u));
    return _mm256_blendv_ps(_mm256_castsi256_ps(r), v, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
}
static inline V16 round16(V16 v, int dt) { return dt == BF16 ? v16_pair(round8_bf16(v.lo), round8_bf16(v.hi)) : v; }

static inline __m128i bf16_bits8(__m256 rounded) { /* the high halves of 8 rounded floats */
    __m256i h = _mm256_srli_epi32(_mm256_castps_si256(rounded), 16);
    return _mm_packus_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}
static inline void store16(void *p, int64_t i, V16 rounded, int dt) {
    if (dt == BF16) {
        _mm_storeu_si128((__m128i *)((uint16_t *)p + i), bf16_bits8(rounded.lo));
        _mm_storeu_si128((__m128i *)((uint16_t *)p + i + 8), bf16_bits8(rounded.hi));
    } else v16_storef((float *)p + i, rounded);
}
#endif

#ifdef VEC16
/* A vector's sum from its fold (v16_fold: lane l plus lane l + 8): then lane l plus l + 4, + 2, + 1. GCC's
 * _mm512_reduce_add_ps adds so; written out so that no compiler changes it, and both builds sum alike (scores16
 * and sum8_folds mirror this tree across lanes). */
static inline float fold_sum(__m256 s) {
    __m128 t = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    t = _mm_add_ps(t, _mm_movehl_ps(t, t));
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}
static inline float v16_sum(V16 v) { return fold_sum(v16_fold(v)); }

/* fold_sum of the 8 folds at u (8 floats each, one after another), as one vector: each sum in fold_sum's
 * tree, so the same bits, for ~4 instructions a sum instead of 7 and one store instead of 8. */
static inline __m256 sum8_folds(const float *u) {
    __m256 w[4], x[2];
    for (int i = 0; i < 4; i++) { /* [l + l+4 of fold 2i | of fold 2i + 1] */
        __m256 a = _mm256_loadu_ps(u + 16 * i), b = _mm256_loadu_ps(u + 16 * i + 8);
        w[i] = _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
    }
    for (int i = 0; i < 2; i++) /* then + 2: [folds 4i, 4i + 2 | 4i + 1, 4i + 3], two lanes each */
        x[i] = _mm256_add_ps(_mm256_shuffle_ps(w[2 * i], w[2 * i + 1], 0x44),
                             _mm256_shuffle_ps(w[2 * i], w[2 * i + 1], 0xee));
    __m256 y = _mm256_add_ps(_mm256_shuffle_ps(x[0], x[1], 0x88), _mm256_shuffle_ps(x[0], x[1], 0xdd)); /* + 1 */
    return _mm256_permutevar8x32_ps(y, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)); /* lanes 0 2 4 6 1 3 5 7 */
}

/* sums[i] = fold_sum of fold i at folds + 8 i, for i < n. */
static inline void sum_folds(const float *folds, int64_t n, float *sums) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(sums + i, sum8_folds(folds + 8 * i));
    for (; i < n; i++) sums[i] = fold_sum(_mm256_loadu_ps(folds + 8 * i));
}

/* exp(x): Cephes' expf polynomial, ~1 ulp; inputs below -87.3 give exp(-87.3) (adds nothing to a sum). */
static inline V16 exp16(V16 x) {
    x = v16_max(v16_set1(-87.3f), x); /* NaN in x stays NaN (max returns its second operand) */
    x = v16_exp_cap(x);
    V16 n = v16_round(v16_mul(x, v16_set1(1.44269504088896341f)));
    V16 r = v16_fnmadd(n, v16_set1(0.693359375f), x);
    r = v16_fnmadd(n, v16_set1(-2.12194440e-4f), r);
    V16 p = v16_set1(1.9875691500e-4f);
    p = v16_fmadd(p, r, v16_set1(1.3981999507e-3f));
    p = v16_fmadd(p, r, v16_set1(8.3334519073e-3f));
    p = v16_fmadd(p, r, v16_set1(4.1665795894e-2f));
    p = v16_fmadd(p, r, v16_set1(1.6666665459e-1f));
    p = v16_fmadd(p, r, v16_set1(5.0000001201e-1f));
    p = v16_fmadd(p, v16_mul(r, r), v16_add(r, v16_set1(1.f)));
    return v16_scale2(p, n);
}

/* One weight row against M fp32 rows of x; inlined per constant M so the accumulators stay in registers. */
static inline __attribute__((always_inline)) void dot_rows(const void *w, int64_t row, int64_t K, int dt,
                                                           const float *x, int M, float *sums) {
    V16 acc[8];
    for (int m = 0; m < M; m++) acc[m] = v16_zero();
    const char *bytes = (const char *)w + row * K * (dt == BF16 ? 2 : 4);
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
        if (dt == F32 || (k & 16) == 0) /* once per 64-byte line */
            _mm_prefetch(bytes + k * (dt == BF16 ? 2 : 4) + PREFETCH, _MM_HINT_T0);
        V16 wv = load16(w, row * K + k, dt);
        for (int m = 0; m < M; m++) acc[m] = v16_fmadd(wv, v16_loadf(x + m * K + k), acc[m]);
    }
#ifdef __AVX512F__
    if (k < K) {
        __mmask16 mask = (__mmask16)((1u << (K - k)) - 1);
        __m512 wv = load16_masked(w, row * K + k, dt, mask);
        for (int m = 0; m < M; m++) acc[m] = _mm512_fmadd_ps(wv, _mm512_maskz_loadu_ps(mask, x + m * K + k), acc[m]);
    }
    for (int m = 0; m < M; m++) sums[m] = v16_sum(acc[m]);
#else
    for (int m = 0; m < M; m++) {
        sums[m] = v16_sum(acc[m]);
        for (int64_t j = k; j < K; j++) sums[m] += load(w, row * K + j, dt) * x[m * K + j];
    }
#endif
}
#else
static inline void dot_rows(const void *w, int64_t row, int64_t K, int dt, const float *x, int M, float *sums) {
    for (int m = 0; m < M; m++) {
        float s = 0.f;
        for (int64_t k = 0; k < K; k++) s += load(w, row * K + k, dt) * x[m * K + k];
        sums[m] = s;
    }
}
#endif

#if defined(__AVX512BF16__)
#define DOT_BF16 1
/* One bfloat16 weight row against M bfloat16 rows of x (xb, rows K apart) with vdpbf16ps: 32 products an
 * instruction, each pair's exact products summed into an fp32 lane (dot_rows does 16 with a widening
 * first). The same products as dot_rows', added in another order; subnormal inputs read as zero. */
static inline __attribute__((always_inline)) void dot_rows_bf16(const uint16_t *w, int64_t K, const uint16_t *xb,
                                                                int M, float *sums) {
    __m512 acc[8];
    for (int m = 0; m < M; m++) acc[m] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        _mm_prefetch((const char *)(w + k) + PREFETCH, _MM_HINT_T0);
        __m512bh wv = (__m512bh)_mm512_loadu_si512(w + k);
        for (int m = 0; m < M; m++) acc[m] = _mm512_dpbf16_ps(acc[m], wv, (__m512bh)_mm512_loadu_si512(xb + m * K + k));
    }
    if (k < K) {
        __mmask32 mask = (__mmask32)((1ull << (K - k)) - 1);
        __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(mask, w + k);
        for (int m = 0; m < M; m++)
            acc[m] = _mm512_dpbf16_ps(acc[m], wv, (__m512bh)_mm512_maskz_loadu_epi16(mask, xb + m * K + k));
    }
    for (int m = 0; m < M; m++) sums[m] = _mm512_reduce_add_ps(acc[m]);
}

/* linear_rows for bfloat16 weights with vdpbf16ps: x's values are bfloat16 ones (a bfloat16 tensor widened, or
 * rounded to it where PyTorch stores one), so the thread's bfloat16 copy of x is exact. 0, or -1 where that
 * copy cannot be allocated (the caller then runs dot_rows). */
static int linear_rows_bf16(const uint16_t *w, const void *bias, int64_t begin, int64_t end, int64_t N, int64_t K,
                            const float *x, int M, void *out) {
    uint16_t *xb = alloc_lines(sizeof(uint16_t) * M * K);
    float sums[MAX_ROWS];
    if (!xb) return -1;
    int64_t i = 0;
    for (; i + 16 <= M * K; i += 16) _mm256_storeu_si256((__m256i *)(xb + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + i)));
    for (; i < M * K; i++) xb[i] = f32_to_bf16(x[i]);
    for (int64_t n = begin; n < end; n++) {
        for (int m0 = 0; m0 < M; m0 += 8) { /* blocks of up to 8 rows of x, as linear_rows */
            const uint16_t *xr = xb + (int64_t)m0 * K, *wr = w + n * K;
            float *sb = sums + m0;
            switch (M - m0 < 8 ? M - m0 : 8) {
            case 1: dot_rows_bf16(wr, K, xr, 1, sb); break;
            case 2: dot_rows_bf16(wr, K, xr, 2, sb); break;
            case 3: dot_rows_bf16(wr, K, xr, 3, sb); break;
            case 4: dot_rows_bf16(wr, K, xr, 4, sb); break;
            case 5: dot_rows_bf16(wr, K, xr, 5, sb); break;
            case 6: dot_rows_bf16(wr, K, xr, 6, sb); break;
            case 7: dot_rows_bf16(wr, K, xr, 7, sb); break;
            default: dot_rows_bf16(wr, K, xr, 8, sb); break;
            }
        }
        float b = bias ? load(bias, n, BF16) : 0.f;
        for (int m = 0; m < M; m++) store(out, m * N + n, sums[m] + b, BF16); /* one rounding, as F.linear */
    }
    free(xb);
    return 0;
}
#endif

/* Rows [begin, end) of out = x @ w.T (+ bias, before the one rounding). */
static void linear_rows(const void *w, const void *bias, int64_t begin, int64_t end, int64_t N, int64_t K, int dt,
                        const float *x, int M, void *out) {
#ifdef DOT_BF16
    if (dt == BF16 && begin < end && !linear_rows_bf16(w, bias, begin, end, N, K, x, M, out)) return;
#endif
    float sums[MAX_ROWS]; /* callers check 1 <= M <= MAX_ROWS */
    for (int64_t n = begin; n < end; n++) {
        /* Rows of x in blocks of up to 8 (registers); a weight row re-read for the next block comes from L1. */
        for (int m0 = 0; m0 < M; m0 += 8) {
            const float *xb = x + (int64_t)m0 * K;
            float *sb = sums + m0;
            switch (M - m0 < 8 ? M - m0 : 8) { /* constant row count per case: see dot_rows */
            case 1: dot_rows(w, n, K, dt, xb, 1, sb); break;
            case 2: dot_rows(w, n, K, dt, xb, 2, sb); break;
            case 3: dot_rows(w, n, K, dt, xb, 3, sb); break;
            case 4: dot_rows(w, n, K, dt, xb, 4, sb); break;
            case 5: dot_rows(w, n, K, dt, xb, 5, sb); break;
            case 6: dot_rows(w, n, K, dt, xb, 6, sb); break;
            case 7: dot_rows(w, n, K, dt, xb, 7, sb); break;
            default: dot_rows(w, n, K, dt, xb, 8, sb); break;
            }
        }
        float b = bias ? load(bias, n, dt) : 0.f;
        for (int m = 0; m < M; m++) store(out, m * N + n, sums[m] + b, dt); /* one rounding, as F.linear */
    }
}

/* The calling thread's share of a linear inside a parallel region: one contiguous run of rows, so each
 * core streams one prefetched run of the weights. */
static void linear_part(const void *w, const void *bias, int64_t N, int64_t K, int dt, const float *x, int M,
                        void *out) {
    int64_t begin, end;
    thread_range(N, &begin, &end);
    linear_rows(w, bias, begin, end, N, K, dt, x, M, out);
}

int pr_linear(const void *x, const void *w, const void *bias, void *out, int64_t M, int64_t N, int64_t K, int dt) {
    if (M < 1 || M > MAX_ROWS) return -1;
    float *xf = alloc_lines(sizeof(float) * M * K);
    if (!xf) return -2;
    for (int64_t i = 0; i < M * K; i++) xf[i] = load(x, i, dt);
#pragma omp parallel
    linear_part(w, bias, N, K, dt, xf, (int)M, out);
    free(xf);
    return 0;
}

/* ---- LoRA: each row's adapter delta on a product ------------------------------------------------ */

/* A linear layer's adapter slots (layers/lora.py): slot s holds A_s, the N parts' rank rows stacked (part i's
 * at rows i * rank ..), and B_s, whose output column n reads the ranks of the part n falls in (parts in order
 * along the output, `width` columns each). Ranks below `rank` are zero-padded: they add exact zeros. */
enum { MAX_PARTS = 3 }; /* parts of a fused matrix (q | k | v) */
typedef struct {
    const void *a, *b; /* dt, [slots, parts * rank, K] and [slots, N, rank]; a NULL: no slots */
    int64_t slots, rank, parts;
    int64_t width[MAX_PARTS];
} LoraSlots;

#ifndef LORA_GROUP
#define LORA_GROUP 16 /* most rows of one group: its x rows stay in cache while each rank row of A meets them */
#endif
#define LORA_TILE 64 /* ranks per transposed tile of B (4 KB): any rank runs in passes of this many */

/* A step's rows that run adapters, grouped by slot: group g is rows row[first[g] .. first[g + 1]), all of slot
 * slot[g], ascending. So each slot's A and B are read once per group, not once per row. */
typedef struct {
    int64_t count;
    int64_t *slot, *first, *row; /* [rows], [rows + 1], [rows] */
} LoraRows;

static int cmp_i64(const void *p, const void *q) {
    int64_t a = *(const int64_t *)p, b = *(const int64_t *)q;
    return (a > b) - (a < b);
}

/* Groups the rows t < T of row_slots (-1: the base model) into g (its arrays hold T entries, first T + 1).
 * Returns -1 where a row names a slot outside [-1, slots). */
static int lora_rows(const int64_t *row_slots, int64_t T, int64_t slots, LoraRows *g) {
    int64_t n = 0;
    for (int64_t t = 0; t < T; t++) {
        if (row_slots[t] < -1 || row_slots[t] >= slots) return -1;
        if (row_slots[t] >= 0) g->row[n++] = row_slots[t] * T + t; /* sorts by slot, then row */
    }
    qsort(g->row, (size_t)n, sizeof(int64_t), cmp_i64);
    g->count = 0;
    for (int64_t i = 0; i < n; i++) {
        int64_t s = g->row[i] / T;
        g->row[i] %= T;
        if (!g->count || s != g->slot[g->count - 1] || i - g->first[g->count - 1] == LORA_GROUP)
            g->slot[g->count] = s, g->first[g->count++] = i;
    }
    g->first[g->count] = n;
    return 0;
}

#ifdef VEC16
/* dot_rows for G rows of x found through pointers (a group's rows are not adjacent): sums[i] = w . x[i]. */
static inline __attribute__((always_inline)) void dot_rows_at(const void *w, int64_t K, int dt,
                                                              const float *const *x, const int G, float *sums) {
    V16 acc[8];
    for (int i = 0; i < G; i++) acc[i] = v16_zero();
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
        if (dt == F32 || (k & 16) == 0) /* once per 64-byte line */
            _mm_prefetch((const char *)w + k * (dt == BF16 ? 2 : 4) + PREFETCH, _MM_HINT_T0);
        V16 wv = load16(w, k, dt);
        for (int i = 0; i < G; i++) acc[i] = v16_fmadd(wv, v16_loadf(x[i] + k), acc[i]);
    }
#ifdef __AVX512F__
    if (k < K) {
        __mmask16 mask = (__mmask16)((1u << (K - k)) - 1);
        __m512 wv = load16_masked(w, k, dt, mask);
        for (int i = 0; i < G; i++) acc[i] = _mm512_fmadd_ps(wv, _mm512_maskz_loadu_ps(mask, x[i] + k), acc[i]);
    }
    for (int i = 0; i < G; i++) sums[i] = v16_sum(acc[i]);
#else
    for (int i = 0; i < G; i++) {
        sums[i] = v16_sum(acc[i]);
        for (int64_t j = k; j < K; j++) sums[i] += load(w, j, dt) * x[i][j];
    }
#endif
}

/* Elements i .. i + n - 1 (n <= 16) of p, zeros in the lanes after. */
static inline V16 load16_first(const void *p, int64_t i, int64_t n, int dt) {
#ifdef __AVX512F__
    return load16_masked(p, i, dt, (__mmask16)((1u << n) - 1));
#else
    if (n == 8) /* rank 8 (or 24, 40 ...): one half, never reading past the 8 */
        return v16_pair(dt == BF16 ? bf16x8_to_f32((const uint16_t *)p + i) : _mm256_loadu_ps((const float *)p + i),
                        _mm256_setzero_ps());
    float tmp[16] = {0};
    for (int64_t k = 0; k < n; k++) tmp[k] = load(p, i + k, dt);
    return v16_loadf(tmp);
#endif
}

/* out = m transposed (16 x 16): lane q of m[r] becomes lane r of out[q]. */
#ifdef __AVX512F__
static inline __attribute__((always_inline)) void v16_transpose16(V16 *m, V16 *out) {
    __m512 t[16];
    for (int i = 0; i < 8; i++) /* per 128-bit lane L: rows 2i, 2i + 1 interleaved */
        t[2 * i] = _mm512_unpacklo_ps(m[2 * i], m[2 * i + 1]), t[2 * i + 1] = _mm512_unpackhi_ps(m[2 * i], m[2 * i + 1]);
    for (int i = 0; i < 4; i++) /* m[4i + e], 128-bit lane L: column 4L + e of rows 4i .. 4i + 3 */
        for (int e = 0; e < 2; e++) {
            __m512d x = _mm512_castps_pd(t[4 * i + e]), y = _mm512_castps_pd(t[4 * i + 2 + e]);
            m[4 * i + 2 * e] = _mm512_castpd_ps(_mm512_unpacklo_pd(x, y));
            m[4 * i + 2 * e + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(x, y));
        }
    for (int e = 0; e < 4; e++) { /* the four 128-bit lanes of a column, gathered */
        __m512 ab_lo = _mm512_shuffle_f32x4(m[e], m[4 + e], 0x44), ab_hi = _mm512_shuffle_f32x4(m[e], m[4 + e], 0xee);
        __m512 cd_lo = _mm512_shuffle_f32x4(m[8 + e], m[12 + e], 0x44);
        __m512 cd_hi = _mm512_shuffle_f32x4(m[8 + e], m[12 + e], 0xee);
        out[e] = _mm512_shuffle_f32x4(ab_lo, cd_lo, 0x88), out[4 + e] = _mm512_shuffle_f32x4(ab_lo, cd_lo, 0xdd);
        out[8 + e] = _mm512_shuffle_f32x4(ab_hi, cd_hi, 0x88), out[12 + e] = _mm512_shuffle_f32x4(ab_hi, cd_hi, 0xdd);
    }
}
#else
static inline void transpose8(__m256 *r) { /* 8 x 8, in place */
    __m256 t[8], s[8];
    for (int i = 0; i < 4; i++)
        t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]), t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    for (int h = 0; h < 2; h++) /* s[4h + c], 128-bit lane L: column 4L + c of rows 4h .. 4h + 3 */
        for (int e = 0; e < 2; e++) {
            s[4 * h + 2 * e] = _mm256_shuffle_ps(t[4 * h + e], t[4 * h + 2 + e], 0x44);
            s[4 * h + 2 * e + 1] = _mm256_shuffle_ps(t[4 * h + e], t[4 * h + 2 + e], 0xee);
        }
    for (int c = 0; c < 4; c++)
        r[c] = _mm256_permute2f128_ps(s[c], s[4 + c], 0x20), r[4 + c] = _mm256_permute2f128_ps(s[c], s[4 + c], 0x31);
}
static inline void v16_transpose16(V16 *m, V16 *out) { /* four 8 x 8 blocks, the off-diagonal ones swapped */
    __m256 a[8], b[8], c[8], d[8];
    for (int i = 0; i < 8; i++) a[i] = m[i].lo, b[i] = m[i].hi, c[i] = m[8 + i].lo, d[i] = m[8 + i].hi;
    transpose8(a), transpose8(b), transpose8(c), transpose8(d);
    for (int i = 0; i < 8; i++) out[i] = v16_pair(a[i], c[i]), out[8 + i] = v16_pair(b[i], d[i]);
}
#endif

/* bt[r * 16 + q] = rank r0 + r of B row n + q (fp32), r < rc (<= LORA_TILE), q < 16: zeros from q = nb on. */
static void lora_tile(const void *b, int64_t n, int64_t nb, int64_t R, int64_t r0, int64_t rc, int dt, float *bt) {
    for (int64_t c = 0; c < rc; c += 16) {
        int64_t w = rc - c < 16 ? rc - c : 16;
        const char *row = (const char *)b + ((n * R + r0 + c) << (dt == BF16 ? 1 : 2));
        V16 m[16], t[16];
        if (nb == 16 && w == 16) { /* whole tiles: constant trip counts, so it all stays in registers */
            for (int q = 0; q < 16; q++) m[q] = load16(row, q * R, dt);
            v16_transpose16(m, t);
            for (int r = 0; r < 16; r++) v16_storef(bt + (c + r) * 16, t[r]);
            continue;
        }
        for (int64_t q = 0; q < 16; q++) m[q] = q < nb ? load16_first(row, q * R, w, dt) : v16_zero();
        v16_transpose16(m, t);
        for (int64_t r = 0; r < w; r++) v16_storef(bt + (c + r) * 16, t[r]);
    }
}
#else
static inline void dot_rows_at(const void *w, int64_t K, int dt, const float *const *x, int G, float *sums) {
    for (int i = 0; i < G; i++) {
        float s = 0.f;
        for (int64_t k = 0; k < K; k++) s += load(w, k, dt) * x[i][k];
        sums[i] = s;
    }
}
#endif

/* y[at + q] += dt(d[q]) for q < nb (<= 16), rounded once: the reference's F.linear, then its add. */
static void lora_add(const float *d, int64_t nb, int dt, void *y, int64_t at) {
#ifdef VEC16
    if (nb == 16) {
        store16(y, at, round16(v16_add(load16(y, at, dt), round16(v16_loadf(d), dt)), dt), dt);
        return;
    }
#endif
    for (int64_t q = 0; q < nb; q++) store(y, at + q, load(y, at + q, dt) + rnd(d[q], dt), dt);
}

/* Columns n .. n + nb - 1 (nb <= 16) of group k's delta for one part: y row t += dt(B_s u_t), u_t its rows'
 * part ranks (u + t * NR + offset). With vector paths, the 16 B rows are transposed once into bt (LORA_TILE
 * ranks at a time) and each row of the group is then 16 columns per FMA: u_t[r] times bt's rank r. */
static void lora_expand_block(const void *b, int64_t n, int64_t nb, int64_t R, int dt, const LoraRows *g,
                              int64_t k, const float *u, int64_t NR, int64_t offset, void *y, int64_t N) {
    float d[LORA_GROUP][16] __attribute__((aligned(64)));
    int64_t first = g->first[k], rows = g->first[k + 1] - first;
#ifdef VEC16
    float bt[LORA_TILE * 16] __attribute__((aligned(64)));
    for (int64_t r0 = 0; r0 < R; r0 += LORA_TILE) {
        int64_t rc = R - r0 < LORA_TILE ? R - r0 : LORA_TILE;
        lora_tile(b, n, nb, R, r0, rc, dt, bt);
        for (int64_t j = 0; j < rows; j++) {
            const float *v = u + g->row[first + j] * NR + offset + r0;
            V16 even = r0 ? v16_loadf(d[j]) : v16_zero(), odd = v16_zero(); /* two chains: FMA latency */
            int64_t r = 0;
            for (; r + 2 <= rc; r += 2) {
                even = v16_fmadd(v16_loadf(bt + r * 16), v16_set1(v[r]), even);
                odd = v16_fmadd(v16_loadf(bt + (r + 1) * 16), v16_set1(v[r + 1]), odd);
            }
            if (r < rc) even = v16_fmadd(v16_loadf(bt + r * 16), v16_set1(v[r]), even);
            v16_storef(d[j], v16_add(even, odd));
        }
    }
#else
    for (int64_t j = 0; j < rows; j++)
        for (int64_t q = 0; q < nb; q++) {
            const float *v = u + g->row[first + j] * NR + offset;
            d[j][q] = 0.f;
            for (int64_t r = 0; r < R; r++) d[j][q] += load(b, (n + q) * R + r, dt) * v[r];
        }
#endif
    for (int64_t j = 0; j < rows; j++) lora_add(d[j], nb, dt, y, g->row[first + j] * N + n);
}

/* The calling thread's share of the shrink (every thread calls it): u (fp32, [T, parts * rank], rows as x's)
 * = dt(A_s x_t) for the grouped rows t, s their slot; xf fp32 [T, K]. Items are (group, rank row of A): a rank
 * row is read once for its group's rows, up to 8 at a time. */
static void lora_shrink_part(const LoraSlots *L, const LoraRows *g, int64_t K, int dt, const float *xf, float *u) {
    int64_t NR = L->parts * L->rank, elem = dt == BF16 ? 2 : 4, begin, end;
    thread_range(g->count * NR, &begin, &end);
    for (int64_t item = begin; item < end; item++) {
        int64_t k = item / NR, j = item % NR;
        const void *a = (const char *)L->a + (g->slot[k] * NR + j) * K * elem;
        for (int64_t i0 = g->first[k]; i0 < g->first[k + 1]; i0 += 8) {
            int G = g->first[k + 1] - i0 < 8 ? (int)(g->first[k + 1] - i0) : 8;
            const float *x[8];
            float sums[8];
            for (int i = 0; i < G; i++) x[i] = xf + g->row[i0 + i] * K;
            switch (G) { /* constant row count per case, as linear_rows */
            case 1: dot_rows_at(a, K, dt, x, 1, sums); break;
            case 2: dot_rows_at(a, K, dt, x, 2, sums); break;
            case 3: dot_rows_at(a, K, dt, x, 3, sums); break;
            case 4: dot_rows_at(a, K, dt, x, 4, sums); break;
            case 5: dot_rows_at(a, K, dt, x, 5, sums); break;
            case 6: dot_rows_at(a, K, dt, x, 6, sums); break;
            case 7: dot_rows_at(a, K, dt, x, 7, sums); break;
            default: dot_rows_at(a, K, dt, x, 8, sums); break;
            }
            for (int i = 0; i < G; i++) u[g->row[i0 + i] * NR + j] = rnd(sums[i], dt);
        }
    }
}

/* The calling thread's share of the expand, after every thread's shrink: y (dt, [T, N]) += dt(B_s u_t) by
 * part for the grouped rows, one rounding of the sum. Threads take contiguous runs of output columns; per
 * group, blocks of 16 columns (each B row read once per group), then the group's rows. */
static void lora_expand_part(const LoraSlots *L, const LoraRows *g, int dt, const float *u, void *y) {
    int64_t N = 0, R = L->rank, NR = L->parts * R, elem = dt == BF16 ? 2 : 4, begin, end;
    for (int64_t i = 0; i < L->parts; i++) N += L->width[i];
    thread_range(N, &begin, &end);
    for (int64_t i = 0, first = 0; i < L->parts; first += L->width[i], i++) {
        int64_t lo = begin > first ? begin : first, hi = end < first + L->width[i] ? end : first + L->width[i];
        for (int64_t k = 0; k < g->count && lo < hi; k++) {
            const char *b = (const char *)L->b + g->slot[k] * N * R * elem;
            for (int64_t n = lo; n < hi; n += 16)
                lora_expand_block(b, n, hi - n < 16 ? hi - n : 16, R, dt, g, k, u, NR, i * R, y, N);
        }
    }
}

/* y (dt, [T, N]) += each row's adapter delta in place, as TorchOps.lora_delta computes it: for row t of slot
 * s = row_slots[t] (-1: none), u = dt(A_s x_t), then per part dt(B_s u) added to y with one rounding (fp32
 * sums throughout). Returns -1 for a slot outside [-1, L->slots), -2 if scratch is not had. */
int pr_lora_delta(void *y, const void *x, const LoraSlots *L, const int64_t *row_slots, int64_t T, int64_t K,
                  int dt) {
    int64_t NR = L->parts * L->rank, convert = dt == BF16 ? T * K : 0;
    char *scratch = alloc_lines(sizeof(float) * (convert + T * NR) + sizeof(int64_t) * (3 * T + 1));
    if (!scratch) return -2;
    float *xs = (float *)scratch, *u = xs + convert;
    const float *xf = convert ? xs : (const float *)x;
    int64_t *index = (int64_t *)(u + T * NR);
    LoraRows g = {0, index, index + T, index + 2 * T + 1};
    int rc = lora_rows(row_slots, T, L->slots, &g);
    if (rc || !g.count) {
        free(scratch);
        return rc;
    }
#pragma omp parallel
    {
        if (convert) {
#pragma omp for
            for (int64_t i = 0; i < convert; i++) xs[i] = load(x, i, dt);
        }
        lora_shrink_part(L, &g, K, dt, xf, u);
#pragma omp barrier
        lora_expand_part(L, &g, dt, u, y);
    }
    free(scratch);
    return 0;
}

/* ---- RMSNorm, optionally after the residual add --------------------------------------------- */

/* How a norm applies its weight (the model's RMSNorm class): NORM_RMS as Llama, weight * dt(h * inv);
 * NORM_UNIT_OFFSET as Gemma, dt(h * inv * (1 + weight)) in fp32, rounded once (TorchOps.gemma_rms_norm). */
enum { NORM_RMS = 0, NORM_UNIT_OFFSET = 1 };

/* One row: with residual, residual += x (stored in dt) and the norm is of residual. Writes
 * the normed row (kind: see above; inv = rsqrt(mean(h^2) + eps)) to out (dt) and, if xf, its fp32 value to
 * xf; out may be x itself (each element is read before it is written). With vector paths the sum of squares
 * runs in 16 lanes (then summed across), the elementwise steps 16 at a time. */
static void rms_norm_row(const void *x, void *residual, const void *weight, void *out, float *xf, int64_t m,
                         int64_t K, float eps, int dt, int kind) {
    const void *src = x;
    int64_t k0 = 0;
    if (residual) {
#ifdef VEC16
        for (; k0 + 16 <= K; k0 += 16)
            store16(residual, m * K + k0, round16(v16_add(load16(residual, m * K + k0, dt), load16(x, m * K + k0, dt)), dt), dt);
#endif
        for (int64_t k = k0; k < K; k++)
            store(residual, m * K + k, load(residual, m * K + k, dt) + load(x, m * K + k, dt), dt);
        src = residual;
    }
    float ss = 0.f;
    k0 = 0;
#ifdef VEC16
    {
        V16 acc = v16_zero();
        for (; k0 + 16 <= K; k0 += 16) {
            V16 h = load16(src, m * K + k0, dt);
            acc = v16_add(acc, v16_mul(h, h));
        }
        ss = v16_sum(acc);
    }
#endif
    for (int64_t k = k0; k < K; k++) {
        float h = load(src, m * K + k, dt);
        ss += h * h;
    }
    float inv = 1.f / sqrtf(ss / (float)K + eps);
    k0 = 0;
#ifdef VEC16
    for (; k0 + 16 <= K; k0 += 16) {
        V16 h = v16_mul(load16(src, m * K + k0, dt), v16_set1(inv)), w = load16(weight, k0, dt);
        V16 v = kind == NORM_UNIT_OFFSET ? round16(v16_mul(h, v16_add(v16_set1(1.f), w)), dt)
                                         : round16(v16_mul(w, round16(h, dt)), dt);
        if (out) store16(out, m * K + k0, v, dt);
        if (xf) v16_storef(xf + m * K + k0, v);
    }
#endif
    for (int64_t k = k0; k < K; k++) {
        float h = load(src, m * K + k, dt) * inv, w = load(weight, k, dt);
        float v = kind == NORM_UNIT_OFFSET ? rnd(h * (1.f + w), dt) : rnd(w * rnd(h, dt), dt);
        if (out) store(out, m * K + k, v, dt);
        if (xf) xf[m * K + k] = v;
    }
}

void pr_rms_norm(const void *x, void *residual, const void *weight, void *out, int64_t M, int64_t K, float eps,
                 int dt) {
#pragma omp parallel for if (M > 8)
    for (int64_t m = 0; m < M; m++) rms_norm_row(x, residual, weight, out, NULL, m, K, eps, dt, NORM_RMS);
}

/* ---- rotary embedding, in place --------------------------------------------------------------- */

/* Rotates the first `rot` dims of `heads` consecutive heads of `dim` at the start of row m (q heads then k
 * heads of a fused qkv row; rot < dim: partial rotary, the rest passes through): x * dt(cos) +
 * rotate_half(x) * dt(sin), each product and the sum stored in dt. cos/sin are fp32 tables [max_len, rot]
 * indexed by position. */
static void rope_row(void *qk, int64_t row_stride, int64_t position, const float *cos_table,
                     const float *sin_table, int64_t m, int64_t heads, int64_t dim, int64_t rot, int dt) {
    int64_t half = rot / 2;
    const float *c = cos_table + position * rot, *s = sin_table + position * rot;
    for (int64_t h = 0; h < heads; h++) {
        int64_t base = m * row_stride + h * dim, i = 0;
#ifdef VEC16
        for (; i + 16 <= half; i += 16) { /* the same operations, 16 at a time */
            V16 x1 = load16(qk, base + i, dt), x2 = load16(qk, base + half + i, dt);
            V16 c1 = round16(v16_loadf(c + i), dt), c2 = round16(v16_loadf(c + half + i), dt);
            V16 s1 = round16(v16_loadf(s + i), dt), s2 = round16(v16_loadf(s + half + i), dt);
            V16 lo = v16_add(round16(v16_mul(x1, c1), dt), round16(v16_mul(v16_mul(x2, v16_set1(-1.f)), s1), dt));
            V16 hi = v16_add(round16(v16_mul(x2, c2), dt), round16(v16_mul(x1, s2), dt));
            store16(qk, base + i, round16(lo, dt), dt);
            store16(qk, base + half + i, round16(hi, dt), dt);
        }
#endif
        for (; i < half; i++) {
            float x1 = load(qk, base + i, dt), x2 = load(qk, base + half + i, dt);
            float lo = rnd(x1 * rnd(c[i], dt), dt) + rnd(-x2 * rnd(s[i], dt), dt);
            float hi = rnd(x2 * rnd(c[half + i], dt), dt) + rnd(x1 * rnd(s[half + i], dt), dt);
            store(qk, base + i, lo, dt);
            store(qk, base + half + i, hi, dt);
        }
    }
}

void pr_rope(void *qk, int64_t row_stride, const int64_t *positions, const float *cos_table,
             const float *sin_table, int64_t M, int64_t heads, int64_t dim, int dt) {
#pragma omp parallel for if (M > 8)
    for (int64_t m = 0; m < M; m++) rope_row(qk, row_stride, positions[m], cos_table, sin_table, m, heads, dim, dim, dt);
}

/* ---- gated MLP activations: out = dt(act(gate)) * up, gate and up the two halves of each row -------------- */

enum { ACT_SILU = 0, ACT_GELU_TANH = 1 }; /* SwiGLU (Llama), GeGLU (Gemma; TorchOps.gelu_tanh_mul) */

/* gelu with the tanh approximation, 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), as PyTorch's
 * approximate="tanh". */
static inline float gelu_tanh(float x) {
    float z = 0.7978845608028654f * (x + 0.044715f * x * x * x);
    return 0.5f * x * (1.f + tanhf(z));
}

static inline float act_one(float g, int act) { return act == ACT_GELU_TANH ? gelu_tanh(g) : g / (1.f + expf(-g)); }

#ifdef VEC16
static inline V16 act16(V16 g, int act) {
    V16 one = v16_set1(1.f);
    if (act != ACT_GELU_TANH) return v16_div(g, v16_add(one, exp16(v16_sub(v16_zero(), g))));
    /* tanh(z) = 1 - 2 / (exp(2 z) + 1) */
    V16 z = v16_mul(v16_set1(0.7978845608028654f), v16_fmadd(v16_mul(v16_set1(0.044715f), v16_mul(g, g)), g, g));
    V16 t = v16_sub(one, v16_div(v16_set1(2.f), v16_add(exp16(v16_mul(v16_set1(2.f), z)), one)));
    return v16_mul(v16_mul(v16_set1(0.5f), g), v16_add(one, t));
}
#endif

/* Elements [begin, end) of the flattened [M, I] output; fp32 copies to xf when given. */
static void gated_range(const void *gate_up, void *out, float *xf, int64_t begin, int64_t end, int64_t I, int dt,
                        int act) {
    for (int64_t m = begin / I; m * I < end; m++) {
        int64_t i = begin > m * I ? begin - m * I : 0, stop = end < (m + 1) * I ? end - m * I : I;
        const int64_t gate = m * 2 * I, up = gate + I;
#ifdef VEC16
        for (; i + 16 <= stop; i += 16) {
            V16 s = round16(act16(load16(gate_up, gate + i, dt), act), dt);
            V16 v = round16(v16_mul(s, load16(gate_up, up + i, dt)), dt);
            if (out) store16(out, m * I + i, v, dt);
            if (xf) v16_storef(xf + m * I + i, v);
        }
#endif
        for (; i < stop; i++) {
            float v = rnd(rnd(act_one(load(gate_up, gate + i, dt), act), dt) * load(gate_up, up + i, dt), dt);
            if (out) store(out, m * I + i, v, dt);
            if (xf) xf[m * I + i] = v;
        }
    }
}

void pr_silu_mul(const void *gate_up, void *out, int64_t M, int64_t I, int dt) {
#pragma omp parallel
    {
        int64_t begin, end;
        thread_range(M * I, &begin, &end);
        gated_range(gate_up, out, NULL, begin, end, I, dt, ACT_SILU);
    }
}

/* ---- paged KV store and decode attention ---------------------------------------------------- */

/* Cache layout [slots, 2, kv_heads, dim]: a slot's key at [slot, 0], its value at [slot, 1]. Its elements
 * are the model's dtype (KV_MODEL), 8 bits or bfloat16 under fp32 activations (kernels/kv_quant.py: the
 * contract, with torch's reference): KV_FP8 float8_e4m3fn with per-tensor scales kv_scale[0] (keys), [1]
 * (values); KV_INT8 int8 with a float32 scale per slot, key/value and KV head,
 * kv_scale[(slot * 2 + kv) * kv_heads + head]; KV_BF16 (dt F32 only) stored rounded to nearest even, read
 * widened (exact), no scales. */
enum { KV_MODEL = 0, KV_FP8 = 1, KV_INT8 = 2, KV_BF16 = 3 };
#define FP8_MAX 448.f /* e4m3fn's largest finite */

static inline float e4m3_to_f32(uint8_t b) {
    int exp = (b >> 3) & 15, mant = b & 7;
    float v = exp == 0 ? ldexpf((float)mant, -9) : exp == 15 && mant == 7 ? NAN : ldexpf((float)(8 + mant), exp - 10);
    return b & 0x80 ? -v : v;
}

/* Round to nearest even, saturated at +-FP8_MAX (NaN stays NaN), as torch's .to(float8_e4m3fn) after a clamp. */
static inline uint8_t f32_to_e4m3(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    uint8_t sign = (uint8_t)((u >> 24) & 0x80);
    float a = fabsf(f);
    if (a != a) return sign | 0x7f;
    if (a >= FP8_MAX) return sign | 0x7e;
    if (a < 0.015625f) return sign | (uint8_t)nearbyintf(a * 512.f); /* subnormals: steps of 2^-9 (8 -> 2^-6) */
    uint32_t r = (u & 0x7fffffffu) + 0x7ffffu + ((u >> 20) & 1u); /* keep 3 mantissa bits, ties to even */
    return sign | (uint8_t)((((r >> 23) - 120) << 3) | ((r >> 20) & 7)); /* exponent bias 127 -> 7 */
}

static float dot(const float *q, const void *k, int64_t dim, int dt) {
#ifdef VEC16
    if (dim % 16 == 0) {
        V16 acc = v16_zero();
        for (int64_t i = 0; i < dim; i += 16) acc = v16_fmadd(v16_loadf(q + i), load16(k, i, dt), acc);
        return v16_sum(acc);
    }
#endif
    float s = 0.f;
    for (int64_t i = 0; i < dim; i++) s += q[i] * load(k, i, dt);
    return s;
}

static void axpy(float a, const void *v, float *acc, int64_t dim, int dt) {
#ifdef VEC16
    if (dim % 16 == 0) {
        V16 av = v16_set1(a);
        for (int64_t i = 0; i < dim; i += 16) v16_storef(acc + i, v16_fmadd(av, load16(v, i, dt), v16_loadf(acc + i)));
        return;
    }
#endif
    for (int64_t i = 0; i < dim; i++) acc[i] += a * load(v, i, dt);
}

/* A row's cache slots in token order, without a division per token. */
typedef struct {
    const int64_t *table;
    int64_t block_size, block, offset;
} SlotWalk;

static inline int64_t next_slot(SlotWalk *w) {
    int64_t slot = w->table[w->block] * w->block_size + w->offset;
    if (++w->offset == w->block_size) w->offset = 0, w->block++;
    return slot;
}

typedef struct {
    const int64_t *block_tables, *context_lens;
    int64_t table_stride, block_size, heads, kv_heads, dim;
    int64_t window; /* > 0: a row reads only its last `window` tokens (sliding window); 0: all */
    float scale;
    float softcap; /* > 0: each scaled score s becomes softcap * tanh(s / softcap) before the softmax */
    int kv_dt;       /* KV_MODEL, KV_FP8, KV_INT8 or KV_BF16 (see store_kv_row) */
    float *kv_scale; /* an 8-bit cache's scales; NULL for KV_MODEL and KV_BF16 */
} Paged;

/* The first context position row b reads: the start of its window, or 0. */
static inline int64_t first_key(const Paged *P, int64_t b) {
    int64_t first = P->window > 0 ? P->context_lens[b] - P->window : 0;
    return first > 0 ? first : 0;
}

/* Walk row b's slots from token `first` on: blocks wholly before the window are never touched. */
static inline SlotWalk walk_from(const Paged *P, const int64_t *table, int64_t first) {
    return (SlotWalk){table, P->block_size, first / P->block_size, first % P->block_size};
}

static inline float cap(const Paged *P, float s) { return P->softcap > 0.f ? P->softcap * tanhf(s / P->softcap) : s; }

/* Row kv (0 key, 1 value) of KV head g at slot: the cache's own row (read with *row_dt = dt, or BF16 for a
 * KV_BF16 cache), or an 8-bit one dequantized into tmp (dim floats, each rounded to dt as torch's gather
 * does; *row_dt = F32). */
static inline const void *kv_row(const Paged *P, const void *kv_cache, int64_t slot, int kv, int64_t g, int dt,
                                 float *tmp, int *row_dt) {
    int64_t dim = P->dim, at = (slot * 2 + kv) * P->kv_heads * dim + g * dim;
    *row_dt = P->kv_dt == KV_BF16 ? BF16 : dt;
    if (P->kv_dt == KV_MODEL || P->kv_dt == KV_BF16)
        return (const char *)kv_cache + at * (*row_dt == BF16 ? 2 : 4);
    *row_dt = F32;
    if (P->kv_dt == KV_FP8) {
        const uint8_t *src = (const uint8_t *)kv_cache + at;
        for (int64_t i = 0; i < dim; i++) tmp[i] = rnd(e4m3_to_f32(src[i]) * P->kv_scale[kv], dt);
    } else {
        const int8_t *src = (const int8_t *)kv_cache + at;
        float s = rnd(P->kv_scale[(slot * 2 + kv) * P->kv_heads + g], dt); /* as kv_quant.dequantize */
        for (int64_t i = 0; i < dim; i++) tmp[i] = rnd((float)src[i] * s, dt);
    }
    return tmp;
}

/* Rows slots[0..n) of an 8-bit cache, dequantized into out ([n, 2, kv_heads, dim], dt) in one pass: what
 * kv_quant.gather computes in three or four PyTorch passes (the torch backend's read on the CPU). fp8: value *
 * kv_scale[kv] (kv_scale NULL: the values as they are); int8: value * rnd(its scale, dt); each rounded to dt. */
void pr_kv_gather(const void *kv_cache, const float *kv_scale, const int64_t *slots, int64_t n, int64_t kv_heads,
                  int64_t dim, int kv_dt, void *out, int dt) {
    float table[256];
    for (int i = 0; i < 256; i++) table[i] = kv_dt == KV_FP8 ? e4m3_to_f32((uint8_t)i) : (float)(int8_t)i;
    int64_t row = 2 * kv_heads * dim;
#pragma omp parallel for if (n * row > 32768)
    for (int64_t r = 0; r < n; r++) {
        const uint8_t *src = (const uint8_t *)kv_cache + slots[r] * row;
        for (int64_t h = 0; h < 2 * kv_heads; h++) { /* h = kv * kv_heads + head */
            float s = 1.f;
            if (kv_dt == KV_FP8 && kv_scale) s = kv_scale[h / kv_heads];
            else if (kv_dt == KV_INT8) s = rnd(kv_scale[slots[r] * 2 * kv_heads + h], dt);
            const uint8_t *x = src + h * dim;
            int64_t at = (r * 2 * kv_heads + h) * dim;
            if (dt == BF16)
                for (int64_t i = 0; i < dim; i++) ((uint16_t *)out)[at + i] = f32_to_bf16(table[x[i]] * s);
            else
                for (int64_t i = 0; i < dim; i++) ((float *)out)[at + i] = table[x[i]] * s;
        }
    }
}

/* One token's k and v (dt, [kv_heads, dim] each) into slot: copied, rounded to bfloat16 or quantized as
 * kv_quant.py. */
static void store_kv_row(const Paged *P, const void *k, const void *v, void *kv_cache, int64_t slot, int dt) {
    int64_t n = P->kv_heads * P->dim, elem = dt == BF16 ? 2 : 4;
    if (P->kv_dt == KV_MODEL) {
        memcpy((char *)kv_cache + slot * 2 * n * elem, k, n * elem);
        memcpy((char *)kv_cache + (slot * 2 + 1) * n * elem, v, n * elem);
        return;
    }
    if (P->kv_dt == KV_BF16) {
        for (int64_t i = 0; i < n; i++) {
            store(kv_cache, slot * 2 * n + i, load(k, i, dt), BF16);
            store(kv_cache, (slot * 2 + 1) * n + i, load(v, i, dt), BF16);
        }
        return;
    }
    for (int kv = 0; kv < 2; kv++)
        for (int64_t g = 0; g < P->kv_heads; g++) {
            const void *src = kv ? v : k;
            int64_t from = g * P->dim, at = (slot * 2 + kv) * n + from;
            if (P->kv_dt == KV_FP8) {
                for (int64_t i = 0; i < P->dim; i++) {
                    float x = load(src, from + i, dt) / P->kv_scale[kv];
                    ((uint8_t *)kv_cache)[at + i] = f32_to_e4m3(x > FP8_MAX ? FP8_MAX : x < -FP8_MAX ? -FP8_MAX : x);
                }
                continue;
            }
            float amax = 0.f;
            for (int64_t i = 0; i < P->dim; i++) amax = fmaxf(amax, fabsf(load(src, from + i, dt)));
            float scale = amax / 127.f, safe = scale > 0.f ? scale : 1.f;
            for (int64_t i = 0; i < P->dim; i++) {
                float q = nearbyintf(load(src, from + i, dt) / safe);
                ((int8_t *)kv_cache)[at + i] = (int8_t)(q > 127.f ? 127.f : q < -127.f ? -127.f : q);
            }
            P->kv_scale[(slot * 2 + kv) * P->kv_heads + g] = scale;
        }
}

/* Query head h of row b (q at q + b * q_stride + h * dim) over the row's first context_lens[b] cached
 * tokens (its own already stored), or only the last P->window of them; token t lives in slot
 * block_tables[b, t / block_size] * block_size + t % block_size. Exact softmax in fp32; scratch holds
 * context_lens[b] + 2 * dim floats. The result, rounded to dt, goes to out (dt, [B, heads, dim]) and/or xf
 * (fp32, same layout). */
static void attend_head(const Paged *P, const void *q, int64_t q_stride, const void *kv_cache, int64_t b,
                        int64_t h, float *scratch, void *out, float *xf, int dt) {
    int64_t first = first_key(P, b), len = P->context_lens[b] - first, dim = P->dim, g = h / (P->heads / P->kv_heads);
    float *scores = scratch, *qf = scratch + len, *acc = qf + dim, *tmp = acc + dim, max_score = -INFINITY, sum = 0.f;
    int row_dt;
    for (int64_t i = 0; i < dim; i++) qf[i] = load(q, b * q_stride + h * dim + i, dt), acc[i] = 0.f;
    const int64_t *table = P->block_tables + b * P->table_stride;
    SlotWalk walk = walk_from(P, table, first);
    for (int64_t t = 0; t < len; t++) {
        int64_t slot = next_slot(&walk);
        const void *key = kv_row(P, kv_cache, slot, 0, g, dt, tmp, &row_dt);
        scores[t] = cap(P, dot(qf, key, dim, row_dt) * P->scale);
        max_score = scores[t] > max_score ? scores[t] : max_score;
    }
    walk = walk_from(P, table, first);
    for (int64_t t = 0; t < len; t++) {
        int64_t slot = next_slot(&walk);
        float p = expf(scores[t] - max_score);
        sum += p;
        const void *value = kv_row(P, kv_cache, slot, 1, g, dt, tmp, &row_dt);
        axpy(p, value, acc, dim, row_dt);
    }
    for (int64_t i = 0; i < dim; i++) {
        float v = rnd(acc[i] / sum, dt);
        if (out) store(out, (b * P->heads + h) * dim + i, v, dt);
        if (xf) xf[(b * P->heads + h) * dim + i] = v;
    }
}

#define TILE_ROWS 8 /* query rows of one sequence that attend_tile_impl reads a KV head's keys and values once for */
static int attention_tile_rows = TILE_ROWS; /* pr_attention_tile_rows: 1 attends every row alone */
#define KV_RUN 16 /* tokens attend_group_impl reads a key and value run of: a block of the default size */

#ifdef VEC16
/* 8-bit cache values as fp32 (AVX2 and F16C, which every VEC16 CPU has). */
static inline __m256 int8x8_to_f32(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
/* 16 e4m3fn bytes as their values over 256: the bits moved into float16 ones (sign, then exponent and
 * mantissa shifted to float16's places) are the value over 2^8 for normals and subnormals alike (float16's
 * bias is 8 more than e4m3's), which F16C widens exactly; 0x7f / 0xff (NaN) become float16 NaNs. The 2^8
 * goes into the scale. */
static inline void e4m3x16_to_f32_over256(const uint8_t *p, __m256 *lo, __m256 *hi) {
    __m256i x = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p));
    __m256i em = _mm256_and_si256(x, _mm256_set1_epi16(0x7f));
    __m256i h = _mm256_or_si256(_mm256_slli_epi16(em, 7), _mm256_slli_epi16(_mm256_and_si256(x, _mm256_set1_epi16(0x80)), 8));
    h = _mm256_or_si256(h, _mm256_and_si256(_mm256_cmpeq_epi16(em, _mm256_set1_epi16(0x7f)), _mm256_set1_epi16(0x7e00)));
    *lo = _mm256_cvtph_ps(_mm256_castsi256_si128(h)), *hi = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
}
static inline V16 v16_halves(__m256 lo, __m256 hi) {
#ifdef __AVX512F__
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(lo)), _mm256_castps_pd(hi), 1));
#else
    return v16_pair(lo, hi);
#endif
}

/* 16 elements i.. of a cache row as attention reads them: the model dtype's values, a bfloat16 cache's
 * widened, or an 8-bit cache's times its scale, kept in fp32 (kv_row and torch's gather round them to dt: here
 * that rounding cost a decode step at 512 tokens 20-30% more than the cache read itself, measured, and only
 * takes precision away). */
static inline __attribute__((always_inline)) V16 kv_load16(const void *row, int64_t i, const int kv_dt, V16 scale,
                                                           int dt) {
    if (kv_dt == KV_MODEL) return load16(row, i, dt);
    if (kv_dt == KV_BF16) return load16(row, i, BF16);
    const uint8_t *p = (const uint8_t *)row + i;
    if (kv_dt == KV_FP8) {
        __m256 lo, hi;
        e4m3x16_to_f32_over256(p, &lo, &hi);
        return v16_mul(v16_halves(lo, hi), scale); /* scale carries the 256 (kv_scale16) */
    }
    return v16_mul(v16_halves(int8x8_to_f32((const int8_t *)p), int8x8_to_f32((const int8_t *)p + 8)), scale);
}

#define MAX_CHUNKS 16 /* head_dim <= 256 */
#define MAX_GROUP 64   /* query heads per KV head */

/* The factor an 8-bit cache row (slot, kv, KV head g) is read with, as kv_row applies it (fp8: times the 256
 * that kv_load16's decoding leaves out). */
static inline V16 kv_scale16(const Paged *P, int64_t slot, int kv, int64_t g, int dt) {
    if (P->kv_dt == KV_FP8) return v16_set1(P->kv_scale[kv] * 256.f);
    return v16_set1(rnd(P->kv_scale[(slot * 2 + kv) * P->kv_heads + g], dt));
}

/* row[t] = exp(row[t] - max(row)) for t < len; returns their sum. */
static float softmax_unnormalized(float *row, int64_t len) {
#ifdef __AVX512F__
    __m512 m = _mm512_set1_ps(-INFINITY), total = _mm512_setzero_ps();
    for (int64_t t = 0; t < len; t += 16) {
        __mmask16 mask = len - t >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (len - t)) - 1);
        m = _mm512_mask_max_ps(m, mask, m, _mm512_maskz_loadu_ps(mask, row + t));
    }
    m = _mm512_set1_ps(_mm512_reduce_max_ps(m));
    for (int64_t t = 0; t < len; t += 16) {
        __mmask16 mask = len - t >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (len - t)) - 1);
        __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, row + t), m));
        _mm512_mask_storeu_ps(row + t, mask, e);
        total = _mm512_add_ps(total, _mm512_maskz_mov_ps(mask, e));
    }
    return _mm512_reduce_add_ps(total);
#else
    int64_t whole = len / 16 * 16;
    V16 m = v16_set1(-INFINITY), total = v16_zero();
    for (int64_t t = 0; t < whole; t += 16) m = v16_max(v16_loadf(row + t), m);
    float top = v16_hmax(m), sum = 0.f;
    for (int64_t t = whole; t < len; t++) top = row[t] > top ? row[t] : top;
    for (int64_t t = 0; t < whole; t += 16) {
        V16 e = exp16(v16_sub(v16_loadf(row + t), v16_set1(top)));
        v16_storef(row + t, e);
        total = v16_add(total, e);
    }
    for (int64_t t = whole; t < len; t++) row[t] = expf(row[t] - top), sum += row[t];
    return v16_sum(total) + sum;
#endif
}

#define KV_AHEAD_BYTES (24 << 10) /* how far ahead attention prefetches, in bytes of the slots it reads (tuned on
                                     the online-softmax version of this loop, same reads): at 128
                                     rows x 512 tokens, 16 tokens of a float32 cache (24 KB) ran 1.15x 48's, 32-48 of a
                                     bfloat16 one (24-36 KB) 1.1-1.2x 16's, and 48 of one head's float32 rows (24 KB) at
                                     4 rows 1.25x 16's */

/* Into L2, the cache lines of a slot's keys (kv 0) or values (kv 1) from byte `from`, `bytes` long: attention
 * asks for the slot KV_AHEAD_BYTES on while it computes this one. Blocks are scattered, so the hardware
 * prefetchers lose the stream at each one, and the loop waited on memory: at 128 rows x 512 tokens (float32
 * cache, 30 layers' caches in turn, 2-core Zen 4) 9.6 -> 4.7 ms a layer with whole rows. L2, not L1: fetched into
 * L1 (32 KB) the slots ahead evicted this run's values before they were read (no gain then). Each pass fetches
 * its own half only: the keys' pass also fetched the values once, and a row longer than L2 holds lost them
 * before the values' pass read them, which fetched them again (16 rows x 2,000 tokens of a float32 cache: 3.0
 * -> 2.8 ms on a 2-core Xeon, the rest alike; kernels.md). Inlined: a call in the token loop spilled the vector
 * registers and lost the gain. */
static inline __attribute__((always_inline)) void prefetch_slot(const void *kv_cache, int64_t slot, int kv,
                                                                  int64_t row_bytes, int64_t from, int64_t bytes) {
    const char *at = (const char *)kv_cache + (slot * 2 + kv) * row_bytes + from;
    for (int64_t line = 0; line < bytes; line += 64) _mm_prefetch(at + line, _MM_HINT_T1);
}

/* 32 bfloat16 values from p as two V16, widened by a shift (the even ones) and a mask (the odd ones) instead of
 * a widening move and a shift each 8: value r lands in lane bf16_split_lane(r) of the pair (r < 32). Only for
 * sums that keep each lane to itself: the values' pass (the keys' tree of lanes is the arithmetic, see
 * fold_sum). */
static inline void bf16x32_split(const uint16_t *p, V16 *x0, V16 *x1) {
#ifdef __AVX512F__
    __m512i a = _mm512_loadu_si512(p), high = _mm512_set1_epi32((int)0xffff0000u);
    *x0 = _mm512_castsi512_ps(_mm512_slli_epi32(a, 16)), *x1 = _mm512_castsi512_ps(_mm512_and_si512(a, high));
#else
    __m256i a = _mm256_loadu_si256((const __m256i *)p), b = _mm256_loadu_si256((const __m256i *)(p + 16));
    __m256i high = _mm256_set1_epi32((int)0xffff0000u);
    *x0 = v16_pair(_mm256_castsi256_ps(_mm256_slli_epi32(a, 16)), _mm256_castsi256_ps(_mm256_and_si256(a, high)));
    *x1 = v16_pair(_mm256_castsi256_ps(_mm256_slli_epi32(b, 16)), _mm256_castsi256_ps(_mm256_and_si256(b, high)));
#endif
}
static inline int64_t bf16_split_lane(int64_t r) {
#ifdef __AVX512F__
    return (r & 1) * 16 + r / 2; /* one 512-bit load: the even values, then the odd */
#else
    return (r & 16) + (r & 1) * 8 + (r & 15) / 2; /* two 256-bit loads, each its even values, then its odd */
#endif
}

/* Bytes of one cache element: the model dtype's (dt), a bfloat16 cache's, or an 8-bit one's. */
static inline int64_t kv_elem_bytes(int kv_dt, int dt) {
    return kv_dt == KV_MODEL ? (dt == BF16 ? 2 : 4) : kv_dt == KV_BF16 ? 2 : 1;
}

/* Row b's outputs of query heads h0 .. h0 + n - 1, dims [i0, i1): each head's value sums acc ([n][dim], bfloat16
 * values' in bf16x32_split's lane order where split) over its softmax sum, rounded to dt, into out and xf. */
static inline void attend_write(const Paged *P, const float *acc, const float *sums, int64_t b, int64_t h0, int64_t n,
                                int64_t dim, int64_t i0, int64_t i1, int split, void *out, float *xf, int dt) {
    for (int64_t j = 0; j < n; j++)
        for (int64_t i = i0; i < i1; i++) {
            int64_t at = (b * P->heads + h0 + j) * dim + i;
            float v = rnd(acc[j * dim + (split ? (i & ~(int64_t)31) + bf16_split_lane(i & 31) : i)] / sums[j], dt);
            if (out) store(out, at, v, dt);
            if (xf) xf[at] = v;
        }
}

/* One row's attention computed by the whole team (attend_team): the part the calling thread takes in a phase. */
enum { TEAM_KEYS, TEAM_SOFTMAX, TEAM_VALUES };
typedef struct {
    int phase;
    int64_t from, to; /* TEAM_KEYS: the row's tokens [from, to); TEAM_SOFTMAX: query heads; TEAM_VALUES: pairs of
                         16-value chunks of each head's dims */
    float *scores;    /* the team's [heads][len] scores (then their exps), then the heads' sums */
} TeamRow;

/* attend_group_impl's pass over the values, and its output, for chunk pairs [team->from, team->to) of every head of
 * row b, the scores the team's exps and sums: each head's sums over the same values in the same order. */
static inline __attribute__((always_inline)) void attend_team_values(
    const Paged *P, const void *kv_cache, int64_t b, const TeamRow *team, float *acc, const float *scores,
    const float *sums, void *out, float *xf, const int64_t chunks, const int dt, const int kv_dt) {
    int64_t G = P->heads / P->kv_heads, dim = chunks * 16, first = first_key(P, b), len = P->context_lens[b] - first;
    int64_t elem = kv_elem_bytes(kv_dt, dt);
    int64_t row_bytes = P->kv_heads * dim * elem, c0 = 2 * team->from, c1 = 2 * team->to;
    const int scaled = kv_dt == KV_FP8 || kv_dt == KV_INT8, split = elem == 2; /* chunks is even here */
    V16 scale = v16_set1(1.f), x[2];
    int64_t slots[KV_RUN], distance = KV_AHEAD_BYTES / (2 * P->kv_heads * dim * elem) + 1;
    const int64_t *table = P->block_tables + b * P->table_stride;
    SlotWalk walk = walk_from(P, table, first), ahead = walk;
    for (int64_t t = 0; t < distance && t < len; t++) next_slot(&ahead);
    for (int64_t t0 = 0; t0 < len; t0 += KV_RUN) {
        int64_t tn = len - t0 < KV_RUN ? len - t0 : KV_RUN;
        for (int64_t t = 0; t < tn; t++) {
            slots[t] = next_slot(&walk);
            if (t0 + t + distance >= len) continue;
            int64_t slot = next_slot(&ahead);
            for (int64_t g = 0; g < P->kv_heads; g++) /* this thread's dims of each head */
                prefetch_slot(kv_cache, slot, 1, row_bytes, (g * dim + c0 * 16) * elem, (c1 - c0) * 16 * elem);
        }
        for (int64_t j = 0; j < P->heads; j++)
            for (int64_t c = c0; c < c1; c += 2) {
                V16 a0 = v16_loadf(acc + j * dim + c * 16), a1 = v16_loadf(acc + j * dim + c * 16 + 16);
                for (int64_t t = 0; t < tn; t++) {
                    const char *value = (const char *)kv_cache + (slots[t] * 2 + 1) * row_bytes + j / G * dim * elem;
                    if (scaled) scale = kv_scale16(P, slots[t], 1, j / G, dt);
                    V16 w = v16_set1(scores[j * len + t0 + t]);
                    if (split) bf16x32_split((const uint16_t *)value + c * 16, &x[0], &x[1]);
                    else
                        for (int h = 0; h < 2; h++) x[h] = kv_load16(value, (c + h) * 16, kv_dt, scale, dt);
                    a0 = v16_fmadd(w, x[0], a0), a1 = v16_fmadd(w, x[1], a1);
                }
                v16_storef(acc + j * dim + c * 16, a0), v16_storef(acc + j * dim + c * 16 + 16, a1);
            }
    }
    attend_write(P, acc, sums, b, 0, P->heads, dim, c0 * 16, c1 * 16, split, out, xf, dt);
}

/* The query heads of KV heads g0 .. g0 + gn - 1, for row b: a pass over the row's keys for every head's scores,
 * an exact softmax, then a pass over its values, each walking the row's slots in runs of KV_RUN tokens and
 * prefetching ahead. With gn = kv_heads a pass reads every KV head's key (or value) of a slot: passes per KV
 * head read 1/kv_heads of each slot, and with scattered blocks the prefetchers lost them. Each key is loaded and
 * widened once for the query heads that share it; each score's products are folded to 8 lanes, and the run's
 * scores summed 8 at a time from their folds (sum_folds: v16_sum's bits, under half its instructions). A head's
 * value sums stay in registers over a run; bfloat16 values are widened 32 at a time by bf16x32_split. Together
 * 1.05-1.19x the kernel over a bfloat16 cache in memory (2-core Zen 3, 1-128 rows; see kernels.md), which was
 * bound by its instructions, not by memory. The arithmetic per head
 * is the same whatever gn is, and the same as a token-by-token two-pass loop: the default model's near-tie
 * answers (its int8-quantized activations turn 1e-7 of attention rounding into 0.1 nats of a logit, measured)
 * stay as they were. Scratch: gn * G * (2 * dim + len + 1 + 8 * KV_RUN) floats. Inlined per constant (chunks, dt)
 * so the widened row stays in registers: 15-20% faster than a runtime chunk count at batch 1-64 here. With team
 * (gn = kv_heads, the whole row) the call computes one phase's part only, its scores and sums the team's:
 * tokens' scores, heads' softmaxes, or chunk pairs of every head's values and output (the same operations on
 * each value as alone, so the same bits). */
static inline __attribute__((always_inline)) void attend_group_impl(
    const Paged *P, const void *q, int64_t q_stride, const void *kv_cache, int64_t b, int64_t g0, int64_t gn,
    float *scratch, void *out, float *xf, const TeamRow *team, const int64_t chunks, const int dt, const int kv_dt) {
    int64_t G = P->heads / P->kv_heads, dim = chunks * 16, n = gn * G, first = first_key(P, b);
    int64_t len = P->context_lens[b] - first;
    int64_t elem = kv_elem_bytes(kv_dt, dt);
    int64_t row_bytes = P->kv_heads * dim * elem;
    const int scaled = kv_dt == KV_FP8 || kv_dt == KV_INT8;
    const int split = elem == 2 && chunks % 2 == 0; /* bfloat16 values, widened 32 at a time (acc in that order) */
    V16 scale = v16_set1(1.f), kv[MAX_CHUNKS];
    float *qf = scratch, *acc = qf + n * dim, *scores = acc + n * dim, *folds = scores + n * (len + 1);
    if (team) scores = team->scores;
    float *sums = scores + n * len;
    for (int64_t i = 0; i < n * dim; i++) qf[i] = load(q, b * q_stride + g0 * G * dim + i, dt) * P->scale, acc[i] = 0.f;
    int64_t slots[KV_RUN], distance = KV_AHEAD_BYTES / (2 * gn * dim * elem) + 1; /* tokens */
    const int64_t *table = P->block_tables + b * P->table_stride;
    if (team && team->phase == TEAM_VALUES) {
        attend_team_values(P, kv_cache, b, team, acc, scores, sums, out, xf, chunks, dt, kv_dt);
        return;
    }
    if (team && team->phase == TEAM_SOFTMAX) {
        for (int64_t j = team->from; j < team->to; j++) {
            if (P->softcap > 0.f)
                for (int64_t t = 0; t < len; t++) scores[j * len + t] = cap(P, scores[j * len + t]);
            sums[j] = softmax_unnormalized(scores + j * len, len);
        }
        return;
    }
    const int64_t k0 = team ? team->from : 0, k1 = team && team->to < len ? team->to : len; /* the keys' tokens */
    SlotWalk walk = walk_from(P, table, first + k0), ahead = walk;
    for (int64_t t = k0; t < k0 + distance && t < k1; t++) next_slot(&ahead);
    for (int64_t t0 = k0; t0 < k1; t0 += KV_RUN) { /* keys: each score's fold, then the run's sums */
        int64_t tn = k1 - t0 < KV_RUN ? k1 - t0 : KV_RUN;
        for (int64_t t = 0; t < tn; t++) slots[t] = next_slot(&walk);
        for (int64_t t = 0; t < tn; t++) {
            if (t0 + t + distance < k1)
                prefetch_slot(kv_cache, next_slot(&ahead), 0, row_bytes, g0 * dim * elem, gn * dim * elem);
            for (int64_t gi = 0; gi < gn; gi++) {
                const char *key = (const char *)kv_cache + slots[t] * 2 * row_bytes + (g0 + gi) * dim * elem;
                if (scaled) scale = kv_scale16(P, slots[t], 0, g0 + gi, dt);
                for (int64_t c = 0; c < chunks; c++) kv[c] = kv_load16(key, c * 16, kv_dt, scale, dt);
                for (int64_t j = gi * G; j < (gi + 1) * G; j++) {
                    V16 s = v16_mul(v16_loadf(qf + j * dim), kv[0]);
                    for (int64_t c = 1; c < chunks; c++) s = v16_fmadd(v16_loadf(qf + j * dim + c * 16), kv[c], s);
                    _mm256_storeu_ps(folds + (j * KV_RUN + t) * 8, v16_fold(s));
                }
            }
        }
        for (int64_t j = 0; j < n; j++) sum_folds(folds + j * KV_RUN * 8, tn, scores + j * len + t0);
    }
    if (team) return;
    if (P->softcap > 0.f)
        for (int64_t i = 0; i < n * len; i++) scores[i] = cap(P, scores[i]);
    for (int64_t j = 0; j < n; j++) sums[j] = softmax_unnormalized(scores + j * len, len);
    walk = walk_from(P, table, first), ahead = walk;
    for (int64_t t = 0; t < distance && t < len; t++) next_slot(&ahead);
    for (int64_t t0 = 0; t0 < len; t0 += KV_RUN) { /* values */
        int64_t tn = len - t0 < KV_RUN ? len - t0 : KV_RUN;
        for (int64_t t = 0; t < tn; t++) {
            slots[t] = next_slot(&walk);
            if (t0 + t + distance < len)
                prefetch_slot(kv_cache, next_slot(&ahead), 1, row_bytes, g0 * dim * elem, gn * dim * elem);
        }
        for (int64_t j = 0; j < n; j++) {
            int64_t g = g0 + j / G;
            V16 a[MAX_CHUNKS], x[2];
            for (int64_t c = 0; c < chunks; c++) a[c] = v16_loadf(acc + j * dim + c * 16);
            for (int64_t t = 0; t < tn; t++) {
                const char *value = (const char *)kv_cache + (slots[t] * 2 + 1) * row_bytes + g * dim * elem;
                if (scaled) scale = kv_scale16(P, slots[t], 1, g, dt);
                V16 w = v16_set1(scores[j * len + t0 + t]);
                if (split)
                    for (int64_t c = 0; c < chunks; c += 2) {
                        bf16x32_split((const uint16_t *)value + c * 16, &x[0], &x[1]);
                        a[c] = v16_fmadd(w, x[0], a[c]), a[c + 1] = v16_fmadd(w, x[1], a[c + 1]);
                    }
                else
                    for (int64_t c = 0; c < chunks; c++) a[c] = v16_fmadd(w, kv_load16(value, c * 16, kv_dt, scale, dt), a[c]);
            }
            for (int64_t c = 0; c < chunks; c++) v16_storef(acc + j * dim + c * 16, a[c]);
        }
    }
    attend_write(P, acc, sums, b, g0 * G, n, dim, 0, dim, split, out, xf, dt);
}

/* The variants of a kernel: (chunks, dt, kv_dt) constants for the common head sizes and each cache kind, the
 * widened rows kept in registers (an fp8 cache read through the runtime-chunk loop made a decode step at 512
 * tokens 1.37x bf16's; 0.99x so), and the runtime-chunk one. X(chunks, dt, kv_dt, when) for each, in the order
 * a dispatch tries them. */
#define ATTEND_KV(X, kv_dt_)                                                                                  \
    X(4, BF16, kv_dt_, dt == BF16 && chunks == 4) X(8, BF16, kv_dt_, dt == BF16 && chunks == 8)              \
    X(4, F32, kv_dt_, chunks == 4) X(8, F32, kv_dt_, chunks == 8) X(chunks, dt, kv_dt_, 1)
#define ATTEND_VARIANTS(X) ATTEND_KV(X, KV_FP8) ATTEND_KV(X, KV_INT8) ATTEND_KV(X, KV_BF16) ATTEND_KV(X, KV_MODEL)
/* Each variant is a function of its own: the twenty inlined into one dispatching function made the compiler's
 * passes superlinear in its size (the file took 72 s to build, these variants 50 s of it). */
#define ATTEND_NAME(kernel, chunks_, dt_, kv_dt_) kernel##_##chunks_##_##dt_##_##kv_dt_
/* A variant: kernel_impl with the constants; ATTEND_PARAMS / ATTEND_ARGS: the kernel's own parameters. */
#define ATTEND_DEFINE(kernel, chunks_, dt_, kv_dt_)                                                           \
    static __attribute__((noinline)) void ATTEND_NAME(kernel, chunks_, dt_, kv_dt_)(                          \
        ATTEND_PARAMS, const int64_t chunks, const int dt) {                                                  \
        (void)chunks, (void)dt;                                                                               \
        kernel##_impl(ATTEND_ARGS, chunks_, dt_, kv_dt_);                                                     \
    }
#define ATTEND_DISPATCH(kernel, chunks_, dt_, kv_dt_, when)                                                   \
    if (P->kv_dt == kv_dt_ && (when)) {                                                                       \
        ATTEND_NAME(kernel, chunks_, dt_, kv_dt_)(ATTEND_ARGS, chunks, dt);                                   \
        return;                                                                                               \
    }

#define ATTEND_PARAMS const Paged *P, const void *q, int64_t q_stride, const void *kv_cache, int64_t b, int64_t g, \
                      int64_t gn, float *scratch, void *out, float *xf, const TeamRow *team
#define ATTEND_ARGS P, q, q_stride, kv_cache, b, g, gn, scratch, out, xf, team
#define DEFINE(chunks_, dt_, kv_dt_, when) ATTEND_DEFINE(attend_group, chunks_, dt_, kv_dt_)
#define DISPATCH(chunks_, dt_, kv_dt_, when) ATTEND_DISPATCH(attend_group, chunks_, dt_, kv_dt_, when)
ATTEND_VARIANTS(DEFINE)

static void attend_group(ATTEND_PARAMS, int dt) {
    int64_t chunks = P->dim / 16;
    ATTEND_VARIANTS(DISPATCH)
}
#undef DISPATCH
#undef DEFINE
#undef ATTEND_ARGS
#undef ATTEND_PARAMS


/* Lane t: query qv's score against key t of the 16 whose transpose is kt (kt[d * 16 + t]: element d of key t),
 * bit for bit what attend_group_impl computes for that key: the same lane products, chained over the chunks in
 * the same order, summed across lanes in v16_sum's tree (lane l plus lane l + 8, then + 4, + 2, + 1: both
 * builds' v16_sum add so). So a tile's rows get the same scores, and outputs, as each row alone, and no
 * horizontal sum is left per score. */
static inline __attribute__((always_inline)) V16 scores16(const float *qv, const float *kt, const int64_t chunks) {
    V16 quarter[4]; /* quarter a: lanes a, a + 4, a + 8, a + 12 */
    for (int a = 0; a < 4; a++) {
        V16 p[4];
        for (int e = 0; e < 4; e++) {
            int64_t l = a + 4 * e;
            p[e] = v16_mul(v16_set1(qv[l]), v16_loadf(kt + l * 16));
            for (int64_t c = 1; c < chunks; c++)
                p[e] = v16_fmadd(v16_set1(qv[c * 16 + l]), v16_loadf(kt + (c * 16 + l) * 16), p[e]);
        }
        quarter[a] = v16_add(v16_add(p[0], p[2]), v16_add(p[1], p[3])); /* (l + l+8) + (l+4 + l+12) */
    }
    return v16_add(v16_add(quarter[0], quarter[2]), v16_add(quarter[1], quarter[3]));
}

/* The query heads of KV head g for rows b0 .. b0 + nq - 1, which read the same slots (tile_rows): each run of
 * KV_RUN keys is loaded, transposed and scored against every row's queries at once, then each row's exact
 * softmax over its own context, then each value run is read once for all of them. Each row's arithmetic is
 * attend_group_impl's (scores16), so a prompt chunk's rows give the bits they give one at a time. Scratch:
 * nq * G * (2 * dim + span) + 16 * dim floats, span the tokens from the tile's first key to its last. */
static inline __attribute__((always_inline)) void attend_tile_impl(
    const Paged *P, const void *q, int64_t q_stride, const void *kv_cache, int64_t b0, int64_t nq, int64_t g,
    float *scratch, void *out, float *xf, const int64_t chunks, const int dt, const int kv_dt) {
    int64_t G = P->heads / P->kv_heads, dim = chunks * 16, n = nq * G, firsts[TILE_ROWS], ends[TILE_ROWS];
    int64_t lo = INT64_MAX, hi = 0;
    for (int64_t r = 0; r < nq; r++) {
        firsts[r] = first_key(P, b0 + r), ends[r] = P->context_lens[b0 + r];
        lo = firsts[r] < lo ? firsts[r] : lo, hi = ends[r] > hi ? ends[r] : hi;
    }
    int64_t span = hi - lo, elem = kv_elem_bytes(kv_dt, dt);
    int64_t row_bytes = P->kv_heads * dim * elem, head_at = g * dim * elem;
    const int scaled = kv_dt == KV_FP8 || kv_dt == KV_INT8;
    V16 scale = v16_set1(1.f);
    float *qf = scratch, *acc = qf + n * dim, *kt = acc + n * dim, *scores = kt + 16 * dim, sums[TILE_ROWS * MAX_GROUP];
    for (int64_t j = 0; j < n; j++) /* j = r * G + head in the group */
        for (int64_t i = 0; i < dim; i++)
            qf[j * dim + i] = load(q, (b0 + j / G) * q_stride + (g * G + j % G) * dim + i, dt) * P->scale, acc[j * dim + i] = 0.f;
    int64_t slots[KV_RUN], distance = KV_AHEAD_BYTES / (2 * dim * elem) + 1;
    const int64_t *table = P->block_tables + b0 * P->table_stride;
    SlotWalk walk = walk_from(P, table, lo), ahead = walk;
    for (int64_t t = 0; t < distance && t < span; t++) next_slot(&ahead);
    for (int64_t t0 = 0; t0 < span; t0 += KV_RUN) { /* keys: t counts from lo */
        int64_t tn = span - t0 < KV_RUN ? span - t0 : KV_RUN;
        V16 m[16];
        for (int64_t t = 0; t < tn; t++) {
            slots[t] = next_slot(&walk);
            if (t0 + t + distance < span) prefetch_slot(kv_cache, next_slot(&ahead), 0, row_bytes, head_at, dim * elem);
        }
        for (int64_t c = 0; c < chunks; c++) {
            for (int64_t t = 0; t < 16; t++) {
                if (t >= tn) { m[t] = v16_zero(); continue; }
                if (scaled) scale = kv_scale16(P, slots[t], 0, g, dt);
                m[t] = kv_load16((const char *)kv_cache + slots[t] * 2 * row_bytes + head_at, c * 16, kv_dt, scale, dt);
            }
            V16 tr[16];
            v16_transpose16(m, tr);
            for (int64_t l = 0; l < 16; l++) v16_storef(kt + (c * 16 + l) * 16, tr[l]);
        }
        for (int64_t j = 0; j < n; j++) {
            int64_t r = j / G, from = firsts[r] - lo, to = ends[r] - lo; /* row r's keys: [from, to) */
            int64_t a = t0 > from ? t0 : from, e = t0 + tn < to ? t0 + tn : to;
            if (a >= e) continue;
            V16 s = scores16(qf + j * dim, kt, chunks);
            if (e - a == KV_RUN && P->softcap <= 0.f) { /* the whole run is row r's */
                v16_storef(scores + j * span + t0 - from, s);
                continue;
            }
            float lanes[16];
            v16_storef(lanes, s);
            for (int64_t t = a; t < e; t++) scores[j * span + t - from] = cap(P, lanes[t - t0]);
        }
    }
    for (int64_t j = 0; j < n; j++)
        sums[j] = softmax_unnormalized(scores + j * span, ends[j / G] - firsts[j / G]);
    walk = walk_from(P, table, lo), ahead = walk;
    for (int64_t t = 0; t < distance && t < span; t++) next_slot(&ahead);
    for (int64_t t0 = 0; t0 < span; t0 += KV_RUN) { /* values */
        int64_t tn = span - t0 < KV_RUN ? span - t0 : KV_RUN;
        const char *values[KV_RUN];
        V16 value_scales[KV_RUN];
        for (int64_t t = 0; t < tn; t++) {
            slots[t] = next_slot(&walk);
            values[t] = (const char *)kv_cache + (slots[t] * 2 + 1) * row_bytes + head_at;
            if (scaled) value_scales[t] = kv_scale16(P, slots[t], 1, g, dt);
            if (t0 + t + distance < span) prefetch_slot(kv_cache, next_slot(&ahead), 1, row_bytes, head_at, dim * elem);
        }
        for (int64_t j = 0; j < n; j++) {
            int64_t r = j / G, from = firsts[r] - lo, to = ends[r] - lo;
            int64_t a = t0 > from ? t0 : from, e = t0 + tn < to ? t0 + tn : to;
            if (a >= e) continue;
            const float *row = scores + j * span; /* token lo + t at t - from */
            V16 av[MAX_CHUNKS];
            for (int64_t c = 0; c < chunks; c++) av[c] = v16_loadf(acc + j * dim + c * 16);
            for (int64_t t = a; t < e; t++) {
                const char *value = values[t - t0];
                if (scaled) scale = value_scales[t - t0];
                V16 w = v16_set1(row[t - from]);
                for (int64_t c = 0; c < chunks; c++) av[c] = v16_fmadd(w, kv_load16(value, c * 16, kv_dt, scale, dt), av[c]);
            }
            for (int64_t c = 0; c < chunks; c++) v16_storef(acc + j * dim + c * 16, av[c]);
        }
    }
    for (int64_t j = 0; j < n; j++)
        for (int64_t i = 0; i < dim; i++) {
            int64_t at = ((b0 + j / G) * P->heads + g * G + j % G) * dim + i;
            float v = rnd(acc[j * dim + i] / sums[j], dt);
            if (out) store(out, at, v, dt);
            if (xf) xf[at] = v;
        }
}

#define ATTEND_PARAMS const Paged *P, const void *q, int64_t q_stride, const void *kv_cache, int64_t b0, \
                      int64_t nq, int64_t g, float *scratch, void *out, float *xf
#define ATTEND_ARGS P, q, q_stride, kv_cache, b0, nq, g, scratch, out, xf
#define DEFINE(chunks_, dt_, kv_dt_, when) ATTEND_DEFINE(attend_tile, chunks_, dt_, kv_dt_)
#define DISPATCH(chunks_, dt_, kv_dt_, when) ATTEND_DISPATCH(attend_tile, chunks_, dt_, kv_dt_, when)
ATTEND_VARIANTS(DEFINE)

static void attend_tile(ATTEND_PARAMS, int dt) {
    int64_t chunks = P->dim / 16;
    ATTEND_VARIANTS(DISPATCH)
}
#undef DISPATCH
#undef DEFINE
#undef ATTEND_ARGS
#undef ATTEND_PARAMS
#undef ATTEND_VARIANTS
#undef ATTEND_KV
#undef ATTEND_DISPATCH
#undef ATTEND_DEFINE
#undef ATTEND_NAME

/* The rows from b on (at most TILE_ROWS, 1 at least) that read the same slots: each one's block table agrees
 * with row b's over the blocks the longest of them reads. A prompt chunk's rows (one request's tokens) and a
 * verification's do; rows of different requests differ at their first block, or where a shared prefix ends. */
static int64_t tile_rows(const Paged *P, int64_t b, int64_t B) {
    int64_t n = 1, longest = P->context_lens[b];
    const int64_t *table = P->block_tables + b * P->table_stride;
    for (; n < attention_tile_rows && b + n < B; n++) {
        longest = P->context_lens[b + n] > longest ? P->context_lens[b + n] : longest;
        int64_t blocks = (longest + P->block_size - 1) / P->block_size;
        if (memcmp(table, P->block_tables + (b + n) * P->table_stride, blocks * sizeof(int64_t))) break;
    }
    return n;
}
#endif

/* Floats of per-thread scratch that attention needs for contexts up to max_len: attend_group's for all heads
 * (queries, sums, scores), attend_head's (scores, its query, sums and a dequantized row of an 8-bit cache). */
static int64_t attention_scratch(const Paged *P, int64_t max_len) {
    int64_t group = P->heads * (2 * P->dim + max_len + 1 + 8 * KV_RUN), head = max_len + 3 * P->dim;
    int64_t tile = TILE_ROWS * (P->heads / P->kv_heads) * (2 * P->dim + max_len) + 16 * P->dim;
    int64_t most = group > head ? group : head;
    return ((tile > most ? tile : most) + 15) / 16 * 16; /* whole lines: each thread's part stays aligned */
}

/* A row's cost in attention items: its keys read plus a fixed part. */
static inline int64_t row_cost(const Paged *P, int64_t b) { return P->context_lens[b] - first_key(P, b) + 16; }

/* The calling thread's [begin, end) of B rows' n = B * per_row attention items (item i is row i / per_row's):
 * contiguous runs of about equal cost, a row's cost its keys read plus a fixed part. Rows' contexts differ
 * many-fold, so equal counts of items left one thread waiting at the next barrier (measured: 13% of a
 * 128-request run's time went to OpenMP waits). Every thread computes the same split. */
static void attention_range(const Paged *P, int64_t B, int64_t per_row, int64_t *begin, int64_t *end) {
    int64_t t = omp_get_thread_num(), T = omp_get_num_threads(), total = 0, sum = 0;
    for (int64_t b = 0; b < B; b++) total += row_cost(P, b);
    *begin = *end = B * per_row;
    for (int64_t b = 0; b < B; b++) {
        int64_t cost = row_cost(P, b);
        for (int64_t i = 0; i < per_row; i++, sum += cost) { /* item b * per_row + i starts at cost sum */
            if (*begin == B * per_row && sum * T >= t * total * per_row) *begin = b * per_row + i;
            if (sum * T >= (t + 1) * total * per_row) {
                *end = b * per_row + i;
                return;
            }
        }
    }
}

#ifdef VEC16
#define TEAM_MIN_KEYS 256 /* a one-row step's keys from which its threads share each KV head (attend_team) */

/* Whether the team attends row 0 of a B-row step together (attend_team): one row, its KV heads not a multiple of
 * the threads (SmolLM2's 3 over 2 gave one thread twice the other's reads), long enough to pay two more barriers,
 * and its head dim whole pairs of chunks, at least one a thread. */
static int team_row(const Paged *P, int64_t B, int T) {
    return B == 1 && T > 1 && P->kv_heads % T && P->heads <= MAX_GROUP && P->dim % 32 == 0 && P->dim / 32 >= T &&
           P->context_lens[0] - first_key(P, 0) >= TEAM_MIN_KEYS;
}

/* Row 0 by the whole team: each thread scores its share of the keys' tokens, then softmaxes its share of the
 * heads, then sums its share of every head's value dims, barriers between; each value the same operations as
 * one thread's (attend_group_impl), so the same bits. Called by every thread; scratch is the team's, per_thread
 * floats a thread, the scores in thread 0's part. */
static void attend_team(const Paged *P, const void *q, int64_t q_stride, const void *kv_cache, float *scratch,
                        int64_t per_thread, void *out, float *xf, int dt) {
    int64_t T = omp_get_num_threads(), t = omp_get_thread_num(), pairs = P->dim / 32;
    int64_t runs = (P->context_lens[0] - first_key(P, 0) + KV_RUN - 1) / KV_RUN;
    TeamRow team = {TEAM_KEYS, runs * t / T * KV_RUN, runs * (t + 1) / T * KV_RUN, scratch + 2 * P->heads * P->dim};
    float *own = scratch + per_thread * t;
    attend_group(P, q, q_stride, kv_cache, 0, 0, P->kv_heads, own, out, xf, &team, dt);
#pragma omp barrier
    team.phase = TEAM_SOFTMAX, team.from = P->heads * t / T, team.to = P->heads * (t + 1) / T;
    attend_group(P, q, q_stride, kv_cache, 0, 0, P->kv_heads, own, out, xf, &team, dt);
#pragma omp barrier
    team.phase = TEAM_VALUES, team.from = pairs * t / T, team.to = pairs * (t + 1) / T;
    attend_group(P, q, q_stride, kv_cache, 0, 0, P->kv_heads, own, out, xf, &team, dt);
}
#endif

#define ROWS_PER_THREAD 4
/* The calling thread's share of B rows' attention with the vector kernel (an 8-bit cache dequantized there 16
 * values at a time). Rows that read the same slots (a prompt chunk's) go in tiles of up to TILE_ROWS, one item
 * per KV head; a row of its own is one item where there are ROWS_PER_THREAD rows a thread (each slot read once),
 * else one per KV head, so a few rows still keep every thread busy. Each item, in order, goes to the thread
 * with the least cost so far (an item's cost its rows' row_cost; every thread computes the same owners), so
 * each thread gets long and short rows alike: contiguous runs of equal cost gave the first thread a step's
 * oldest, longest rows, and it finished last (measured: docs/kernels.md). Which thread attends an item changes
 * no bit of it; a long single row is the team's (attend_team). (row, query head) items with the scalar kernel
 * otherwise. scratch: the team's, per_thread floats a thread (attention_scratch). */
static void attend_part(const Paged *P, const void *q, int64_t q_stride, const void *kv_cache, int64_t B,
                        float *team_scratch, int64_t per_thread, void *out, float *xf, int dt) {
    int64_t begin, end;
    float *scratch = team_scratch + per_thread * omp_get_thread_num();
#ifdef VEC16
    if (P->dim % 16 == 0 && P->dim <= 16 * MAX_CHUNKS && P->heads / P->kv_heads <= MAX_GROUP) {
        int T = omp_get_num_threads(), t = omp_get_thread_num();
        if (team_row(P, B, T)) {
            attend_team(P, q, q_stride, kv_cache, team_scratch, per_thread, out, xf, dt);
            return;
        }
        int whole = B >= ROWS_PER_THREAD * T && P->heads <= MAX_GROUP;
        int64_t gn = whole ? P->kv_heads : 1, load[T];
        for (int i = 0; i < T; i++) load[i] = 0;
        for (int64_t b = 0, nq; b < B; b += nq) {
            nq = tile_rows(P, b, B);
            int64_t cost = 0, items = nq > 1 ? P->kv_heads : P->kv_heads / gn;
            for (int64_t r = 0; r < nq; r++) cost += row_cost(P, b + r);
            for (int64_t i = 0; i < items; i++) {
                int owner = 0;
                for (int u = 1; u < T; u++) owner = load[u] < load[owner] ? u : owner;
                load[owner] += cost;
                if (owner != t) continue;
                if (nq > 1) attend_tile(P, q, q_stride, kv_cache, b, nq, i, scratch, out, xf, dt);
                else attend_group(P, q, q_stride, kv_cache, b, i * gn, gn, scratch, out, xf, NULL, dt);
            }
        }
        return;
    }
#endif
    attention_range(P, B, P->heads, &begin, &end);
    for (int64_t item = begin; item < end; item++)
        attend_head(P, q, q_stride, kv_cache, item / P->heads, item % P->heads, scratch, out, xf, dt);
}

static int64_t max_context(const int64_t *context_lens, int64_t B) {
    int64_t longest = 0;
    for (int64_t b = 0; b < B; b++) longest = context_lens[b] > longest ? context_lens[b] : longest;
    return longest;
}

/* Rows per attention tile from now on, 1 to TILE_ROWS (benchmarks compare tiles with rows alone). */
void pr_attention_tile_rows(int n) { attention_tile_rows = n < 1 ? 1 : n > TILE_ROWS ? TILE_ROWS : n; }

/* One query token per row of q (rows q_stride elements apart, heads dim apart) over its paged context
 * (window > 0: its last `window` tokens, the blocks before them unread; softcap > 0: scores soft-capped);
 * out is [B, heads, dim]; kv_dt / kv_scale: the cache's element kind and an 8-bit cache's scales (see
 * store_kv_row). Returns -2 if the per-thread score buffers cannot be allocated. */
int pr_paged_decode_attention(const void *q, int64_t q_stride, const void *kv_cache, const int64_t *block_tables,
                              int64_t table_stride, const int64_t *context_lens, int64_t B, int64_t heads,
                              int64_t kv_heads, int64_t dim, int64_t block_size, int64_t window, float scale,
                              float softcap, void *out, int dt, int kv_dt, float *kv_scale) {
    Paged P = {block_tables, context_lens, table_stride, block_size, heads, kv_heads, dim, window, scale, softcap,
               kv_dt, kv_scale};
    int64_t per_thread = attention_scratch(&P, max_context(context_lens, B));
    float *scratch = alloc_lines(sizeof(float) * per_thread * omp_get_max_threads());
    if (!scratch) return -2;
#pragma omp parallel
    attend_part(&P, q, q_stride, kv_cache, B, scratch, per_thread, out, NULL, dt);
    free(scratch);
    return 0;
}


/* ---- prompt chunks: flash attention over a packed copy of the context ----------------------------------
 *
 * One request's chunk of nq query rows (positions context_len - nq .. context_len - 1, each over its causal
 * context, or its last `window` tokens) as blocked products with an online softmax, where SDPA's blocked GEMMs
 * beat the per-row kernels (long chunks: see attention/cpu_backend.py). Per KV head, the chunk's context is
 * first read from the paged cache once, widened to fp32 (an 8-bit cache's times its scales, as kv_load16
 * reads it) into panels: keys transposed in runs of 16 (panel p: kt[(p * dim + d) * 16 + t]), values as rows.
 * Then each work item, FLASH_QVECS query vectors (rows x the KV head's query heads), walks the keys its rows
 * see in blocks of FLASH_KEYS: scores FLASH_QV query vectors x 16 keys at a time (6 x 2 AVX2 accumulators:
 * 2 key loads per 12 multiply-adds), the block's softmax folded into each vector's running max and sum, and
 * the output rescaled and accumulated FLASH_QV vectors x 16 dims at a time. Every sum is fp32; the result is
 * SDPA's within rounding, not bit for bit the row kernel's. Items go to threads longest first (dynamic). */
#ifdef VEC16
#define FLASH_QV 6
#define FLASH_KEYS 64
#define FLASH_QVECS 48

/* Keys and values t0 .. t0 + 15 (t counts from the chunk's first key `lo`) of KV head g into their panels;
 * keys past `span` are zeros (their scores are masked, their zero weights meet zero values, never NaN). */
static void flash_pack(const Paged *P, const void *kv_cache, const int64_t *table, int64_t lo, int64_t span,
                       int64_t t0, int64_t g, int dt, float *kt, float *vv) {
    int64_t dim = P->dim, elem = kv_elem_bytes(P->kv_dt, dt);
    int64_t row_bytes = P->kv_heads * dim * elem, head_at = g * dim * elem;
    const int scaled = P->kv_dt == KV_FP8 || P->kv_dt == KV_INT8;
    int64_t slots[16];
    for (int64_t t = 0; t < 16; t++) {
        int64_t pos = lo + t0 + t;
        slots[t] = t0 + t < span ? table[pos / P->block_size] * P->block_size + pos % P->block_size : -1;
    }
    for (int64_t c = 0; c < dim / 16; c++) {
        V16 m[16], tr[16];
        for (int64_t t = 0; t < 16; t++) {
            float *value = vv + (t0 + t) * dim + c * 16;
            if (slots[t] < 0) {
                m[t] = v16_zero(), v16_storef(value, m[t]);
                continue;
            }
            const char *at = (const char *)kv_cache + slots[t] * 2 * row_bytes + head_at;
            V16 ks = scaled ? kv_scale16(P, slots[t], 0, g, dt) : v16_set1(1.f);
            V16 vs = scaled ? kv_scale16(P, slots[t], 1, g, dt) : v16_set1(1.f);
            m[t] = kv_load16(at, c * 16, P->kv_dt, ks, dt);
            v16_storef(value, kv_load16(at + row_bytes, c * 16, P->kv_dt, vs, dt));
        }
        v16_transpose16(m, tr);
        for (int64_t l = 0; l < 16; l++) v16_storef(kt + (t0 / 16 * dim + c * 16 + l) * 16, tr[l]);
    }
}

/* s[i * FLASH_KEYS + col ..+16] = FLASH_QV query vectors (q, dim apart) . the 16 keys of panel kt. */
static inline __attribute__((always_inline)) void flash_scores(const float *q, const float *kt, int64_t dim,
                                                               float *s, int64_t col) {
    V16 a0 = v16_zero(), a1 = v16_zero(), a2 = v16_zero(), a3 = v16_zero(), a4 = v16_zero(), a5 = v16_zero();
    for (int64_t d = 0; d < dim; d++) {
        V16 k = v16_loadf(kt + d * 16);
        a0 = v16_fmadd(v16_set1(q[d]), k, a0), a1 = v16_fmadd(v16_set1(q[dim + d]), k, a1);
        a2 = v16_fmadd(v16_set1(q[2 * dim + d]), k, a2), a3 = v16_fmadd(v16_set1(q[3 * dim + d]), k, a3);
        a4 = v16_fmadd(v16_set1(q[4 * dim + d]), k, a4), a5 = v16_fmadd(v16_set1(q[5 * dim + d]), k, a5);
    }
    v16_storef(s + col, a0), v16_storef(s + FLASH_KEYS + col, a1), v16_storef(s + 2 * FLASH_KEYS + col, a2);
    v16_storef(s + 3 * FLASH_KEYS + col, a3), v16_storef(s + 4 * FLASH_KEYS + col, a4);
    v16_storef(s + 5 * FLASH_KEYS + col, a5);
}

/* One query vector's scores s[0 .. width) (width a multiple of 16) become its softmax weights against its
 * running max *m and sum *l: keys outside [a, e) weigh 0. Returns the factor its output so far is rescaled by. */
static inline float flash_softmax(const Paged *P, float *s, int64_t width, int64_t a, int64_t e, float *m, float *l) {
    if (a >= e) {
        memset(s, 0, sizeof(float) * width);
        return 1.f;
    }
    if (P->softcap > 0.f)
        for (int64_t t = a; t < e; t++) s[t] = cap(P, s[t]);
    for (int64_t t = 0; t < a; t++) s[t] = -INFINITY;
    for (int64_t t = e; t < width; t++) s[t] = -INFINITY;
    V16 top = v16_set1(-INFINITY), total = v16_zero();
    for (int64_t t = 0; t < width; t += 16) top = v16_max(v16_loadf(s + t), top);
    float block_max = v16_hmax(top), new_max = block_max > *m ? block_max : *m, alpha = expf(*m - new_max);
    V16 shift = v16_set1(new_max);
    for (int64_t t = 0; t < width; t += 16) v16_storef(s + t, exp16(v16_sub(v16_loadf(s + t), shift)));
    for (int64_t t = 0; t < a; t++) s[t] = 0.f; /* exp16 leaves exp(-87.3) for -inf */
    for (int64_t t = e; t < width; t++) s[t] = 0.f;
    for (int64_t t = 0; t < width; t += 16) total = v16_add(total, v16_loadf(s + t));
    *m = new_max, *l = *l * alpha + v16_sum(total);
    return alpha;
}

/* o (FLASH_QV vectors, dim apart) = o * alpha + p . values, p FLASH_QV rows of weights (FLASH_KEYS apart) over
 * the width values from vv (rows dim apart). */
static inline __attribute__((always_inline)) void flash_values(float *o, const float *alpha, const float *p,
                                                               const float *vv, int64_t width, int64_t dim) {
    for (int64_t c = 0; c < dim; c += 16) {
        V16 a0 = v16_mul(v16_loadf(o + c), v16_set1(alpha[0]));
        V16 a1 = v16_mul(v16_loadf(o + dim + c), v16_set1(alpha[1]));
        V16 a2 = v16_mul(v16_loadf(o + 2 * dim + c), v16_set1(alpha[2]));
        V16 a3 = v16_mul(v16_loadf(o + 3 * dim + c), v16_set1(alpha[3]));
        V16 a4 = v16_mul(v16_loadf(o + 4 * dim + c), v16_set1(alpha[4]));
        V16 a5 = v16_mul(v16_loadf(o + 5 * dim + c), v16_set1(alpha[5]));
        for (int64_t t = 0; t < width; t++) {
            V16 v = v16_loadf(vv + t * dim + c);
            a0 = v16_fmadd(v16_set1(p[t]), v, a0), a1 = v16_fmadd(v16_set1(p[FLASH_KEYS + t]), v, a1);
            a2 = v16_fmadd(v16_set1(p[2 * FLASH_KEYS + t]), v, a2), a3 = v16_fmadd(v16_set1(p[3 * FLASH_KEYS + t]), v, a3);
            a4 = v16_fmadd(v16_set1(p[4 * FLASH_KEYS + t]), v, a4), a5 = v16_fmadd(v16_set1(p[5 * FLASH_KEYS + t]), v, a5);
        }
        v16_storef(o + c, a0), v16_storef(o + dim + c, a1), v16_storef(o + 2 * dim + c, a2);
        v16_storef(o + 3 * dim + c, a3), v16_storef(o + 4 * dim + c, a4), v16_storef(o + 5 * dim + c, a5);
    }
}

typedef struct {
    const Paged *P;
    const void *q;
    int64_t q_stride, nq, context_len, lo, rows_per_item;
    const float *kt, *vv; /* the packed context of the KV head being attended */
    void *out;
    int dt;
} FlashChunk;

/* Query vectors j = r * G + h (row r0 + r, head g * G + h) of item (g, r0): queries scaled into qf, each one's
 * keys [from, to) (counted from lo; padding vectors none), running max, sum and output cleared. */
static int64_t flash_load(const FlashChunk *C, int64_t g, int64_t r0, float *qf, float *o, float *m, float *l,
                          int64_t *from, int64_t *to) {
    const Paged *P = C->P;
    int64_t G = P->heads / P->kv_heads, dim = P->dim, rows = C->nq - r0 < C->rows_per_item ? C->nq - r0 : C->rows_per_item;
    int64_t n = rows * G, padded = (n + FLASH_QV - 1) / FLASH_QV * FLASH_QV;
    for (int64_t j = 0; j < padded; j++) {
        int64_t r = r0 + j / G, end = C->context_len - C->nq + r + 1, first = P->window > 0 ? end - P->window : 0;
        from[j] = j < n ? (first > 0 ? first : 0) - C->lo : 0, to[j] = j < n ? end - C->lo : 0;
        m[j] = -INFINITY, l[j] = 0.f;
        for (int64_t i = 0; i < dim; i++) {
            qf[j * dim + i] = j < n ? load(C->q, r * C->q_stride + (g * G + j % G) * dim + i, C->dt) * P->scale : 0.f;
            o[j * dim + i] = 0.f;
        }
    }
    return padded;
}

static void flash_item(const FlashChunk *C, int64_t g, int64_t r0, float *scratch) {
    const Paged *P = C->P;
    int64_t dim = P->dim, G = P->heads / P->kv_heads, most = (C->rows_per_item * G + FLASH_QV - 1) / FLASH_QV * FLASH_QV;
    float *qf = scratch, *o = qf + most * dim, *m = o + most * dim, *l = m + most, *s = l + most, alpha[FLASH_QV];
    int64_t *from = (int64_t *)(s + FLASH_QV * FLASH_KEYS), *to = from + most;
    int64_t n = flash_load(C, g, r0, qf, o, m, l, from, to), first = INT64_MAX, end = 0;
    for (int64_t j = 0; j < n; j++)
        if (from[j] < to[j]) first = from[j] < first ? from[j] : first, end = to[j] > end ? to[j] : end;
    for (int64_t k0 = first / 16 * 16; k0 < end; k0 += FLASH_KEYS) {
        int64_t width = end - k0 < FLASH_KEYS ? (end - k0 + 15) / 16 * 16 : FLASH_KEYS;
        for (int64_t j0 = 0; j0 < n; j0 += FLASH_QV) {
            int64_t live = 0;
            for (int64_t j = j0; j < j0 + FLASH_QV; j++) live |= from[j] < k0 + width && to[j] > k0;
            if (!live) continue;
            for (int64_t col = 0; col < width; col += 16)
                flash_scores(qf + j0 * dim, C->kt + (k0 + col) * dim, dim, s, col);
            for (int64_t i = 0; i < FLASH_QV; i++) {
                int64_t a = from[j0 + i] - k0, e = to[j0 + i] - k0;
                alpha[i] = flash_softmax(P, s + i * FLASH_KEYS, width, a > 0 ? a : 0, e < width ? e : width,
                                         m + j0 + i, l + j0 + i);
            }
            flash_values(o + j0 * dim, alpha, s, C->vv + k0 * dim, width, dim);
        }
    }
    for (int64_t j = 0; j < n; j++) {
        if (from[j] >= to[j]) continue; /* padding */
        int64_t at = ((r0 + j / G) * P->heads + g * G + j % G) * dim;
        for (int64_t i = 0; i < dim; i++) store(C->out, at + i, o[j * dim + i] / l[j], C->dt);
    }
}

/* Floats of one thread's flash_item scratch. */
static int64_t flash_scratch(const Paged *P, int64_t rows_per_item) {
    int64_t most = (rows_per_item * (P->heads / P->kv_heads) + FLASH_QV - 1) / FLASH_QV * FLASH_QV;
    return (most * (2 * P->dim + 2 + 4) + FLASH_QV * FLASH_KEYS + 15) / 16 * 16; /* + from and to, int64 */
}

static int flash_chunk(FlashChunk *C, const void *kv_cache, const int64_t *table) {
    const Paged *P = C->P;
    int64_t first = C->context_len - C->nq + 1 - P->window;
    C->lo = P->window > 0 && first > 0 ? first : 0;
    int64_t span = C->context_len - C->lo, panels = (span + 15) / 16, dim = P->dim;
    int64_t blocks = (C->nq + C->rows_per_item - 1) / C->rows_per_item, per_thread = flash_scratch(P, C->rows_per_item);
    float *kt = alloc_lines(sizeof(float) * panels * 16 * dim * 2);
    float *scratch = alloc_lines(sizeof(float) * per_thread * omp_get_max_threads());
    if (!kt || !scratch) {
        free(kt), free(scratch);
        return -2;
    }
    C->kt = kt, C->vv = kt + panels * 16 * dim;
#pragma omp parallel
    for (int64_t g = 0; g < P->kv_heads; g++) { /* one KV head's panels at a time: memory O(context x dim) */
#pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; p++) flash_pack(P, kv_cache, table, C->lo, span, p * 16, g, C->dt, kt, kt + panels * 16 * dim);
#pragma omp for schedule(dynamic, 1)
        for (int64_t b = blocks - 1; b >= 0; b--) /* the last rows see the most keys: first */
            flash_item(C, g, b * C->rows_per_item, scratch + per_thread * omp_get_thread_num());
    }
    free(kt), free(scratch);
    return 0;
}
#endif

/* One request's prompt chunk: nq query rows (q rows q_stride elements apart, heads dim apart) at positions
 * context_len - nq .. context_len - 1, each over its causal context (window > 0: its last `window` tokens;
 * softcap > 0: scores soft-capped) in the paged cache (its block table `table`), this step's keys and values
 * already stored; out is [nq, heads, dim]. Without the vector kernels (or head dims not a multiple of 16, or
 * more than 256), the chunk's rows go to pr_paged_decode_attention instead. Returns -2 if scratch cannot be
 * allocated. */
int pr_paged_prompt_attention(const void *q, int64_t q_stride, const void *kv_cache, const int64_t *table,
                              int64_t nq, int64_t context_len, int64_t heads, int64_t kv_heads, int64_t dim,
                              int64_t block_size, int64_t window, float scale, float softcap, void *out, int dt,
                              int kv_dt, float *kv_scale) {
#ifdef VEC16
    if (dim % 16 == 0 && dim <= 16 * MAX_CHUNKS) {
        Paged P = {table, NULL, 0, block_size, heads, kv_heads, dim, window, scale, softcap, kv_dt, kv_scale};
        int64_t per_item = FLASH_QVECS / (heads / kv_heads);
        FlashChunk C = {&P, q, q_stride, nq, context_len, 0, per_item > 1 ? per_item : 1, NULL, NULL, out, dt};
        return flash_chunk(&C, kv_cache, table);
    }
#endif
    int64_t *context_lens = malloc(sizeof(int64_t) * nq);
    if (!context_lens) return -2;
    for (int64_t r = 0; r < nq; r++) context_lens[r] = context_len - nq + r + 1;
    int rc = pr_paged_decode_attention(q, q_stride, kv_cache, table, 0, context_lens, nq, heads, kv_heads, dim,
                                       block_size, window, scale, softcap, out, dt, kv_dt, kv_scale);
    free(context_lens);
    return rc;
}
/* ==== GGUF block-quantized weights ================================================================
 *
 * Weights stay in llama.cpp's GGUF blocks (ggml-common.h layouts): a weight is [N, row_bytes] bytes, row
 * n the K inputs of output n as K / QK blocks, exactly as the file holds them. Two entry points:
 *
 * pr_gguf_dequantize: rows to fp32 / bf16, the same values as gguf.quants.dequantize (same fp32 operations
 *   in the same order: (d * sc) * q, then + m where the type has a min), bf16 rounded once from those.
 *
 * pr_gguf_linear: out = x @ dequant(w).T (+ bias) for up to GGUF_MAX_ROWS rows of x, without the
 *   dequantized matrix: as llama.cpp does, each 32-run of an x row is first rounded to int8 with one
 *   fp32 scale (d = max|x| / 127, q = nearest(x / d)), then every weight block meets it in an integer dot
 *   product, scaled in fp32 once per 32 weights (the types' mins through the run's sum d * sum(q)). So
 *   the result differs from the exact x @ dequant(w).T by the activation rounding (a relative error of
 *   about 1/254 per element at worst, averaging out over K), and paths differ only in fp32 sum order.
 *   Weights are streamed once per call for all rows; OpenMP threads take contiguous runs of output rows.
 *
 * The vector paths need AVX2 (+ FMA, F16C: -march=native on any AVX2 CPU has them); every type also has
 * a scalar path, compiled everywhere, which pr_gguf_force_scalar(1) selects at run time (tests use both).
 * AVX-512 adds to them where the build has it: the x8 kernel's VNNI dot product (vpdpbusd on 256-bit lanes,
 * exactly maddubs' integers) and 8 x rows per pass (32 vector registers); see the x8 section.
 */
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define GGUF_AVX2 1
#include <immintrin.h>
#else
#define GGUF_AVX2 0
#endif

#define GGUF_MAX_ROWS MAX_ROWS /* rows of x per pr_gguf_linear call */
#ifndef GGUF_GROUP
#define GGUF_GROUP 4 /* x rows per pass over a weight row, 1 to 4 */
#endif
#define GGUF_TILE 16 /* weight rows per tile (gguf_dot_tile_avx2) */

enum { GGUF_Q4_0 = 2, GGUF_Q4_1 = 3, GGUF_Q5_0 = 6, GGUF_Q5_1 = 7, GGUF_Q8_0 = 8, GGUF_Q4_K = 12, GGUF_Q5_K = 13,
       GGUF_Q6_K = 14 };
/* Flag on a type id: the rows are repacked 8 at a time (pr_gguf_pack_x8; the "x8" section below). */
enum { GGUF_X8 = 256 };
static inline int gguf_base(int qt) { return qt & ~GGUF_X8; }
static inline int gguf_x8(int qt) { return (qt & GGUF_X8) != 0; }

static int gguf_force_scalar = 0;

/* Bytes per block; 0 for a type this file does not know. */
static int64_t gguf_block_bytes(int qt) {
    switch (gguf_base(qt)) {
    case GGUF_Q4_0: return 18;
    case GGUF_Q4_1: return 20;
    case GGUF_Q5_0: return 22;
    case GGUF_Q5_1: return 24;
    case GGUF_Q8_0: return 34;
    case GGUF_Q4_K: return 144;
    case GGUF_Q5_K: return 176;
    case GGUF_Q6_K: return 210;
    default: return 0;
    }
}

static inline int gguf_x8_packable(int qt) { return gguf_block_bytes(qt) != 0; } /* every known type */
static inline int gguf_qk(int qt) { return gguf_base(qt) >= GGUF_Q4_K ? 256 : 32; } /* weights per block */
static inline int gguf_has_min(int qt) {
    return qt == GGUF_Q4_1 || qt == GGUF_Q5_1 || qt == GGUF_Q4_K || qt == GGUF_Q5_K;
}
/* Types whose 32 decoded values are signed (the vector dot then moves the sign onto x). */
static inline int gguf_signed(int qt) {
    return qt == GGUF_Q4_0 || qt == GGUF_Q5_0 || qt == GGUF_Q8_0 || qt == GGUF_Q6_K;
}

static inline float f16_to_f32(uint16_t h) {
#if GGUF_AVX2
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, u;
    if (exp == 0x1f) u = sign | 0x7f800000u | (man << 13);
    else if (exp) u = sign | ((exp + 112) << 23) | (man << 13);
    else {
        float f = (float)man * 0x1p-24f; /* zero or subnormal: exact */
        memcpy(&u, &f, 4);
        u |= sign;
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
#endif
}

static inline float half_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return f16_to_f32(h);
}

/* The 6-bit scale and min of sub-block j of a Q4_K / Q5_K block's 12 packed scale bytes. */
static inline void k4_scale_min(const uint8_t *s, int j, int *sc, int *mn) {
    if (j < 4) {
        *sc = s[j] & 63;
        *mn = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0xf) | ((s[j - 4] >> 6) << 4);
        *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

/* 32-run s of the block at p holds w[i] = (i < 16 ? lo : hi) * q[i] (+ m where the type has a min). */
typedef struct {
    float lo, hi, m;
} GgufScales;

static inline GgufScales gguf_scales(const uint8_t *p, int s, int qt) {
    switch (qt) {
    case GGUF_Q4_1: case GGUF_Q5_1: {
        float d = half_at(p);
        return (GgufScales){d, d, half_at(p + 2)};
    }
    case GGUF_Q4_K: case GGUF_Q5_K: {
        int sc, mn;
        k4_scale_min(p + 4, s, &sc, &mn);
        float d = half_at(p) * (float)sc;
        return (GgufScales){d, d, -(half_at(p + 2) * (float)mn)};
    }
    case GGUF_Q6_K: {
        const int8_t *sc = (const int8_t *)(p + 192) + (s / 4) * 8 + (s % 4) * 2;
        float d = half_at(p + 208);
        return (GgufScales){d * (float)sc[0], d * (float)sc[1], 0.f};
    }
    default: { /* Q4_0, Q5_0, Q8_0 */
        float d = half_at(p);
        return (GgufScales){d, d, 0.f};
    }
    }
}

/* The 32 integer weights of run s of the block at p (the q above). */
static inline void gguf_q_scalar(const uint8_t *p, int s, int qt, int8_t *q) {
    switch (qt) {
    case GGUF_Q4_0: case GGUF_Q4_1: {
        const uint8_t *qs = p + (qt == GGUF_Q4_0 ? 2 : 4);
        int off = qt == GGUF_Q4_0 ? 8 : 0;
        for (int j = 0; j < 16; j++) q[j] = (int8_t)((qs[j] & 15) - off), q[j + 16] = (int8_t)((qs[j] >> 4) - off);
        break;
    }
    case GGUF_Q5_0: case GGUF_Q5_1: {
        const uint8_t *qh_at = p + (qt == GGUF_Q5_0 ? 2 : 4), *qs = qh_at + 4;
        uint32_t qh = (uint32_t)qh_at[0] | (uint32_t)qh_at[1] << 8 | (uint32_t)qh_at[2] << 16 | (uint32_t)qh_at[3] << 24;
        int off = qt == GGUF_Q5_0 ? 16 : 0;
        for (int j = 0; j < 16; j++) {
            q[j] = (int8_t)(((qs[j] & 15) | ((qh >> j) & 1) << 4) - off);
            q[j + 16] = (int8_t)(((qs[j] >> 4) | ((qh >> (j + 16)) & 1) << 4) - off);
        }
        break;
    }
    case GGUF_Q8_0: memcpy(q, p + 2, 32); break;
    case GGUF_Q4_K: case GGUF_Q5_K: {
        const uint8_t *ql = p + (qt == GGUF_Q4_K ? 16 : 48) + (s / 2) * 32, *qh = p + 16;
        int shift = (s & 1) * 4;
        for (int j = 0; j < 32; j++)
            q[j] = (int8_t)(((ql[j] >> shift) & 15) | (qt == GGUF_Q5_K ? ((qh[j] >> s) & 1) << 4 : 0));
        break;
    }
    case GGUF_Q6_K: {
        int h = s / 4, r = s % 4;
        const uint8_t *ql = p + 64 * h + (r & 1) * 32, *qh = p + 128 + 32 * h;
        for (int j = 0; j < 32; j++)
            q[j] = (int8_t)((((ql[j] >> ((r >> 1) * 4)) & 15) | ((qh[j] >> (2 * r)) & 3) << 4) - 32);
        break;
    }
    }
}

/* x rows as int8 runs of 32: run i (row i / runs, flattened) is d[i] * q[32 i ..], with sum[i] = sum q and
 * s[i] = d[i] * sum[i]. */
typedef struct {
    int8_t *q;
    float *d, *s;
    int32_t *sum;
} GgufActs;

/* The rows from m of a: its runs from row m's first. */
static inline GgufActs gguf_acts_from(GgufActs a, int64_t m, int64_t K) {
    return (GgufActs){a.q + m * K, a.d + m * (K / 32), a.s + m * (K / 32), a.sum + m * (K / 32)};
}

static void gguf_quantize_run_scalar(const void *x, int64_t i, int dt, GgufActs a) {
    float v[32], amax = 0.f;
    for (int j = 0; j < 32; j++) v[j] = load(x, i * 32 + j, dt), amax = fmaxf(amax, fabsf(v[j]));
    float d = amax / 127.f, id = d != 0.f ? 1.f / d : 0.f;
    int sum = 0;
    for (int j = 0; j < 32; j++) {
        int q = (int)nearbyintf(v[j] * id);
        a.q[i * 32 + j] = (int8_t)q;
        sum += q;
    }
    a.d[i] = d, a.s[i] = d * (float)sum, a.sum[i] = sum;
}

/* out rows m of one weight row (the run at row), scalar: sums[m] for m < M. */
static void gguf_dot_scalar(const uint8_t *row, int64_t K, int qt, GgufActs a, int M, float *sums) {
    int64_t bb = gguf_block_bytes(qt), runs = K / 32;
    int per = gguf_qk(qt) / 32;
    for (int m = 0; m < M; m++) sums[m] = 0.f;
    for (int64_t r = 0; r < runs; r++) {
        const uint8_t *p = row + r / per * bb;
        int s = (int)(r % per);
        int8_t q[32];
        gguf_q_scalar(p, s, qt, q);
        GgufScales sc = gguf_scales(p, s, qt);
        for (int m = 0; m < M; m++) {
            const int8_t *x = a.q + m * K + r * 32;
            int lo = 0, hi = 0;
            for (int j = 0; j < 16; j++) lo += q[j] * x[j], hi += q[j + 16] * x[j + 16];
            sums[m] += (sc.lo * (float)lo + sc.hi * (float)hi) * a.d[m * runs + r] + sc.m * a.s[m * runs + r];
        }
    }
}

static void gguf_dequantize_run_scalar(const uint8_t *p, int s, int qt, void *out, int64_t at, int dt) {
    int8_t q[32];
    gguf_q_scalar(p, s, qt, q);
    GgufScales sc = gguf_scales(p, s, qt);
    for (int j = 0; j < 32; j++) {
        float w = (j < 16 ? sc.lo : sc.hi) * (float)q[j];
        store(out, at + j, gguf_has_min(qt) ? w + sc.m : w, dt);
    }
}

#if GGUF_AVX2
static inline __m256 gguf_load8(const void *x, int64_t i, int dt) {
    if (dt == BF16) {
        __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)x + i));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    return _mm256_loadu_ps((const float *)x + i);
}

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* The same rounding as gguf_quantize_run_scalar (round to nearest even, through the same reciprocal). */
static void gguf_quantize_run_avx2(const void *x, int64_t i, int dt, GgufActs a) {
    __m256 v[4], amax = _mm256_setzero_ps(), sign = _mm256_set1_ps(-0.f);
    for (int j = 0; j < 4; j++) v[j] = gguf_load8(x, i * 32 + 8 * j, dt), amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[j]));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    float d = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4))) / 127.f, id = d != 0.f ? 1.f / d : 0.f;
    __m256i q[4], total = _mm256_setzero_si256();
    for (int j = 0; j < 4; j++) {
        q[j] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[j], _mm256_set1_ps(id)),
                                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        total = _mm256_add_epi32(total, q[j]);
    }
    /* packs interleave the 128-bit lanes: 32-bit groups come out as 0 2 4 6 1 3 5 7, put back in order */
    __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i *)(a.q + i * 32), p);
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4e));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xb1));
    int sum = _mm_cvtsi128_si32(t);
    a.d[i] = d, a.s[i] = d * (float)sum, a.sum[i] = sum;
}

/* 16 nibbles per byte pair: low nibbles are weights 0-15, high ones 16-31. */
static inline __m256i nibbles16(const uint8_t *p) {
    __m128i b = _mm_loadu_si128((const __m128i *)p);
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(b, 4), b), _mm256_set1_epi8(15));
}

/* 0x10 in byte i where bit i of the 32-bit little-endian word at p is set. */
static inline __m256i bit4_from_bits(const uint8_t *p) {
    uint32_t bits;
    memcpy(&bits, p, 4);
    __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits),
                                    _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0));
    v = _mm256_or_si256(v, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe)); /* all bits but bit i % 8 of byte i */
    return _mm256_and_si256(_mm256_cmpeq_epi8(v, _mm256_set1_epi8(-1)), _mm256_set1_epi8(16));
}

/* The q of gguf_q_scalar, as 32 int8 lanes. */
static inline __attribute__((always_inline)) __m256i gguf_q_avx2(const uint8_t *p, int s, int qt) {
    const __m256i lo4 = _mm256_set1_epi8(15);
    switch (qt) {
    case GGUF_Q4_0: return _mm256_sub_epi8(nibbles16(p + 2), _mm256_set1_epi8(8));
    case GGUF_Q4_1: return nibbles16(p + 4);
    case GGUF_Q5_0: return _mm256_sub_epi8(_mm256_or_si256(nibbles16(p + 6), bit4_from_bits(p + 2)), _mm256_set1_epi8(16));
    case GGUF_Q5_1: return _mm256_or_si256(nibbles16(p + 8), bit4_from_bits(p + 4));
    case GGUF_Q8_0: return _mm256_loadu_si256((const __m256i *)(p + 2));
    case GGUF_Q4_K: case GGUF_Q5_K: {
        __m256i v = _mm256_loadu_si256((const __m256i *)(p + (qt == GGUF_Q4_K ? 16 : 48) + (s / 2) * 32));
        v = _mm256_and_si256(s & 1 ? _mm256_srli_epi16(v, 4) : v, lo4);
        if (qt == GGUF_Q4_K) return v;
        __m256i bit = _mm256_set1_epi8((char)(1 << s)), qh = _mm256_loadu_si256((const __m256i *)(p + 16));
        __m256i high = _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, bit), bit), _mm256_set1_epi8(16));
        return _mm256_or_si256(v, high);
    }
    default: { /* Q6_K: low 4 bits from ql, bits 4-5 from qh bits 2r, 2r + 1 */
        int h = s / 4, r = s % 4;
        __m256i ql = _mm256_loadu_si256((const __m256i *)(p + 64 * h + (r & 1) * 32));
        __m256i qh = _mm256_loadu_si256((const __m256i *)(p + 128 + 32 * h));
        ql = _mm256_and_si256(r >> 1 ? _mm256_srli_epi16(ql, 4) : ql, lo4);
        qh = r == 0 ? _mm256_slli_epi16(qh, 4) : r == 1 ? _mm256_slli_epi16(qh, 2) : r == 3 ? _mm256_srli_epi16(qh, 2) : qh;
        qh = _mm256_and_si256(qh, _mm256_set1_epi8(0x30));
        return _mm256_sub_epi8(_mm256_or_si256(ql, qh), _mm256_set1_epi8(32));
    }
    }
}

/* Run r (run s of the block at p) against G rows of x, on its own (a row's last runs % 8): acc[g] += the
 * run's scaled integer dot, macc[g] += its min term. */
static inline __attribute__((always_inline)) void gguf_run_avx2(const uint8_t *p, int s, int64_t r, const int qt,
                                                                const int8_t *xq, const float *xd, const float *xs,
                                                                int64_t K, int64_t runs, const int G, __m256 *acc,
                                                                float *macc) {
    __m256i q = gguf_q_avx2(p, s, qt), qa = gguf_signed(qt) ? _mm256_sign_epi8(q, q) : q;
    GgufScales sc = gguf_scales(p, s, qt);
    __m256 dv = qt == GGUF_Q6_K ? _mm256_set_m128(_mm_set1_ps(sc.hi), _mm_set1_ps(sc.lo)) : _mm256_set1_ps(sc.lo);
    for (int g = 0; g < G; g++) {
        __m256i x = _mm256_loadu_si256((const __m256i *)(xq + g * K + r * 32));
        __m256i p16 = _mm256_maddubs_epi16(qa, gguf_signed(qt) ? _mm256_sign_epi8(x, q) : x);
        __m256 f = _mm256_cvtepi32_ps(_mm256_madd_epi16(p16, _mm256_set1_epi16(1)));
        acc[g] = _mm256_fmadd_ps(f, _mm256_mul_ps(dv, _mm256_broadcast_ss(xd + g * runs + r)), acc[g]);
        if (gguf_has_min(qt)) macc[g] += sc.m * xs[g * runs + r];
    }
}

/* Float scales (and min factors, for types with a min) of the 8 runs r .. r + 7 of a row, as vectors:
 * run u's w = D[u] * q + M[u]. Q6_K's per-16 scales stay out (gguf_q6k_scale16): D holds its d. */
static inline __attribute__((always_inline)) void gguf_scales8(const uint8_t *row, int64_t r, const int qt,
                                                               __m256 *D, __m256 *M) {
    const int64_t bb = gguf_block_bytes(qt);
    if (gguf_qk(qt) == 32) {
        const uint8_t *p = row + r * bb;
        __m128i d = _mm_setzero_si128(), m = _mm_setzero_si128();
        uint16_t h;
#define GGUF_LANE(u)                                                                   \
        memcpy(&h, p + (u) * bb, 2), d = _mm_insert_epi16(d, h, u);                     \
        if (gguf_has_min(qt)) memcpy(&h, p + (u) * bb + 2, 2), m = _mm_insert_epi16(m, h, u);
        GGUF_LANE(0) GGUF_LANE(1) GGUF_LANE(2) GGUF_LANE(3) GGUF_LANE(4) GGUF_LANE(5) GGUF_LANE(6) GGUF_LANE(7)
#undef GGUF_LANE
        *D = _mm256_cvtph_ps(d), *M = _mm256_cvtph_ps(m);
        return;
    }
    const uint8_t *p = row + r / 8 * bb;
    if (qt == GGUF_Q6_K) {
        *D = _mm256_set1_ps(half_at(p + 208)), *M = _mm256_setzero_ps();
        return;
    }
    /* k4_scale_min for all 8 sub-blocks at once, 4 bytes a word (no array: a store then a wide load stalls) */
    uint32_t u[3];
    memcpy(u, p + 4, 12);
    uint64_t sc = (uint64_t)(u[0] & 0x3f3f3f3fu) | (uint64_t)((u[2] & 0x0f0f0f0fu) | ((u[0] >> 6) & 0x03030303u) << 4) << 32;
    uint64_t mn = (uint64_t)(u[1] & 0x3f3f3f3fu) | (uint64_t)(((u[2] >> 4) & 0x0f0f0f0fu) | ((u[1] >> 6) & 0x03030303u) << 4) << 32;
    *D = _mm256_mul_ps(_mm256_set1_ps(half_at(p)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)sc))));
    *M = _mm256_mul_ps(_mm256_set1_ps(-half_at(p + 2)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)mn))));
}

/* Q6_K run s's two int8 scales, each repeated over its half of a madd_epi16's 16 lanes. */
static inline __m256i gguf_q6k_scale16(const uint8_t *p, int s) { /* run s has scales 2 s and 2 s + 1 */
    __m128i pick = _mm_set_epi64x(0x0101010101010101LL * (2 * s + 1), 0x0101010101010101LL * (2 * s));
    return _mm256_cvtepi8_epi16(_mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(p + 192)), pick));
}

/* Run s of the block at p against x's 32 int8 at x: 8 int32 partial dots (Q6_K's per-16 scales applied). */
static inline __attribute__((always_inline)) __m256i gguf_idot(const uint8_t *p, int s, const int qt, __m256i q,
                                                               const int8_t *x) {
    __m256i xv = _mm256_loadu_si256((const __m256i *)x);
    __m256i p16 = gguf_signed(qt) ? _mm256_maddubs_epi16(_mm256_sign_epi8(q, q), _mm256_sign_epi8(xv, q))
                                  : _mm256_maddubs_epi16(q, xv);
    return _mm256_madd_epi16(p16, qt == GGUF_Q6_K ? gguf_q6k_scale16(p, s) : _mm256_set1_epi16(1));
}

/* sums[g] = row . x row g0 + g, for G (constant after inlining) rows. Per 8 runs, each row's 8 integer
 * dots are reduced to one vector as they come (pairwise adds) and scaled there once, instead of run by
 * run: 1.3-1.5x fewer cycles a block at one row, measured. The last runs % 8 go run by run. */
static inline __attribute__((always_inline)) void gguf_dot_avx2(const uint8_t *row, int64_t K, const int qt, GgufActs a,
                                                                int64_t g0, const int G, float *sums) {
    const int64_t bb = gguf_block_bytes(qt), runs = K / 32;
    const int per = gguf_qk(qt) / 32;
    const int8_t *xq = a.q + g0 * K;
    const float *xd = a.d + g0 * runs, *xs = a.s + g0 * runs;
    __m256 acc[4], macc[4];
    for (int g = 0; g < G; g++) acc[g] = macc[g] = _mm256_setzero_ps();
    int64_t r = 0;
    for (; r + 8 <= runs; r += 8) {
        const uint8_t *base = row + r / per * bb;
        for (int64_t line = 0; line < 8 / per * bb; line += 64) _mm_prefetch((const char *)base + PREFETCH + line, _MM_HINT_T0);
        __m256i half[2][4]; /* [runs 0-3 | 4-7][row]: the four runs' dots, pairwise added */
#pragma GCC unroll 4
        for (int u = 0; u < 8; u += 2) {
            const uint8_t *p0 = per == 1 ? base + u * bb : base, *p1 = per == 1 ? base + (u + 1) * bb : base;
            int s0 = per == 1 ? 0 : u, s1 = per == 1 ? 0 : u + 1;
            __m256i q0 = gguf_q_avx2(p0, s0, qt), q1 = gguf_q_avx2(p1, s1, qt);
            for (int g = 0; g < G; g++) {
                const int8_t *x = xq + g * K + (r + u) * 32;
                __m256i pair = _mm256_hadd_epi32(gguf_idot(p0, s0, qt, q0, x), gguf_idot(p1, s1, qt, q1, x + 32));
                if (u % 4 == 0) half[u / 4][g] = pair;
                else half[u / 4][g] = _mm256_hadd_epi32(half[u / 4][g], pair);
            }
        }
        __m256 D, M;
        gguf_scales8(row, r, qt, &D, &M);
        for (int g = 0; g < G; g++) {
            /* lanes: low 128 bits hold runs' low-half sums, high 128 bits their high-half sums */
            __m256i t = _mm256_add_epi32(_mm256_permute2x128_si256(half[0][g], half[1][g], 0x20),
                                         _mm256_permute2x128_si256(half[0][g], half[1][g], 0x31));
            acc[g] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), _mm256_mul_ps(D, _mm256_loadu_ps(xd + g * runs + r)), acc[g]);
            if (gguf_has_min(qt)) macc[g] = _mm256_fmadd_ps(M, _mm256_loadu_ps(xs + g * runs + r), macc[g]);
        }
    }
    __m256 tail[4];
    float mtail[4];
    for (int g = 0; g < G; g++) tail[g] = _mm256_setzero_ps(), mtail[g] = 0.f;
    for (; r < runs; r++) /* the last runs % 8 (32-blocks only: K-blocks are 8 runs) */
        gguf_run_avx2(row + r * bb, 0, r, qt, xq, xd, xs, K, runs, G, tail, mtail);
    for (int g = 0; g < G; g++) sums[g] = hsum8(_mm256_add_ps(acc[g], _mm256_add_ps(macc[g], tail[g]))) + mtail[g];
}

/* sums[(n - n0) * M + m] = weight row n . x row m for rows n0 <= n < n1 (the row stride row_bytes) and all M
 * x rows. Four x rows a pass (their accumulators fit the registers), each pass over the whole tile of
 * weight rows: the tile (GGUF_TILE rows) and the pass's x rows stay in L1, where row by row every weight
 * row would stream all M x rows from L2 (64 rows of K = 1536: 98 KB). A row's arithmetic is the same in any
 * tile or pass. */
static inline __attribute__((always_inline)) void gguf_dot_tile_avx2(const uint8_t *w, int64_t row_bytes, int64_t n0,
                                                                     int64_t n1, int64_t K, const int qt, GgufActs a,
                                                                     int M, float *sums) {
    for (int g0 = 0; g0 < M; g0 += GGUF_GROUP) {
        int G = M - g0 < GGUF_GROUP ? M - g0 : GGUF_GROUP;
        for (int64_t n = n0; n < n1; n++) {
            const uint8_t *row = w + n * row_bytes;
            float *out = sums + (n - n0) * M + g0;
            switch (G) {
            case 1: gguf_dot_avx2(row, K, qt, a, g0, 1, out); break;
            case 2: gguf_dot_avx2(row, K, qt, a, g0, 2, out); break;
            case 3: gguf_dot_avx2(row, K, qt, a, g0, 3, out); break;
            default: gguf_dot_avx2(row, K, qt, a, g0, 4, out); break;
            }
        }
    }
}

static void gguf_dot_any_avx2(const uint8_t *w, int64_t row_bytes, int64_t n0, int64_t n1, int64_t K, int qt,
                              GgufActs a, int M, float *sums) {
    switch (qt) { /* one specialisation per type */
    case GGUF_Q4_0: gguf_dot_tile_avx2(w, row_bytes, n0, n1, K, GGUF_Q4_0, a, M, sums); break;
    case GGUF_Q4_1: gguf_dot_tile_avx2(w, row_bytes, n0, n1, K, GGUF_Q4_1, a, M, sums); break;
    case GGUF_Q5_0: gguf_dot_tile_avx2(w, row_bytes, n0, n1, K, GGUF_Q5_0, a, M, sums); break;
    case GGUF_Q5_1: gguf_dot_tile_avx2(w, row_bytes, n0, n1, K, GGUF_Q5_1, a, M, sums); break;
    case GGUF_Q8_0: gguf_dot_tile_avx2(w, row_bytes, n0, n1, K, GGUF_Q8_0, a, M, sums); break;
    case GGUF_Q4_K: gguf_dot_tile_avx2(w, row_bytes, n0, n1, K, GGUF_Q4_K, a, M, sums); break;
    case GGUF_Q5_K: gguf_dot_tile_avx2(w, row_bytes, n0, n1, K, GGUF_Q5_K, a, M, sums); break;
    default: gguf_dot_tile_avx2(w, row_bytes, n0, n1, K, GGUF_Q6_K, a, M, sums); break;
    }
}

/* 8 fp32 to 8 bfloat16, rounded to nearest even as f32_to_bf16 (NaN kept NaN). */
static inline __m128i bf16x8(__m256 v) {
    __m256i u = _mm256_castps_si256(v);
    __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff),
                                                     _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1))));
    r = _mm256_srli_epi32(r, 16);
    __m256i nan = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    r = _mm256_blendv_epi8(r, nan, _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

static inline __attribute__((always_inline)) void gguf_dequantize_run_avx2(const uint8_t *p, int s, const int qt,
                                                                           void *out, int64_t at, int dt) {
    __m256i q = gguf_q_avx2(p, s, qt);
    GgufScales sc = gguf_scales(p, s, qt);
    __m128i halves[2] = {_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1)};
    for (int j = 0; j < 4; j++) {
        __m128i h = halves[j / 2];
        __m256 w = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(j & 1 ? _mm_srli_si128(h, 8) : h));
        w = _mm256_mul_ps(w, _mm256_set1_ps(j < 2 ? sc.lo : sc.hi)); /* then + m: gguf's order, no fma */
        if (gguf_has_min(qt)) w = _mm256_add_ps(w, _mm256_set1_ps(sc.m));
        if (dt == BF16) _mm_storeu_si128((__m128i *)((uint16_t *)out + at + 8 * j), bf16x8(w));
        else _mm256_storeu_ps((float *)out + at + 8 * j, w);
    }
}

static void gguf_dequantize_range_avx2(const uint8_t *w, int64_t begin, int64_t end, int64_t K, int qt, void *out,
                                       int dt) {
    int64_t bb = gguf_block_bytes(qt), runs = K / 32;
    int per = gguf_qk(qt) / 32;
    for (int64_t i = begin; i < end; i++) { /* run i: row i / runs, run i % runs of that row */
        const uint8_t *p = w + (i / runs) * (K / gguf_qk(qt)) * bb + (i % runs) / per * bb;
        int s = (int)(i % runs % per);
        switch (qt) {
        case GGUF_Q4_0: gguf_dequantize_run_avx2(p, s, GGUF_Q4_0, out, i * 32, dt); break;
        case GGUF_Q4_1: gguf_dequantize_run_avx2(p, s, GGUF_Q4_1, out, i * 32, dt); break;
        case GGUF_Q5_0: gguf_dequantize_run_avx2(p, s, GGUF_Q5_0, out, i * 32, dt); break;
        case GGUF_Q5_1: gguf_dequantize_run_avx2(p, s, GGUF_Q5_1, out, i * 32, dt); break;
        case GGUF_Q8_0: gguf_dequantize_run_avx2(p, s, GGUF_Q8_0, out, i * 32, dt); break;
        case GGUF_Q4_K: gguf_dequantize_run_avx2(p, s, GGUF_Q4_K, out, i * 32, dt); break;
        case GGUF_Q5_K: gguf_dequantize_run_avx2(p, s, GGUF_Q5_K, out, i * 32, dt); break;
        default: gguf_dequantize_run_avx2(p, s, GGUF_Q6_K, out, i * 32, dt); break;
        }
    }
}
#endif


/* ---- x8: rows repacked 8 at a time, for GEMM-shaped work ---------------------------------------------
 *
 * Row by row, every (weight row, x row) pair pays its own horizontal reduction and scaling per 32 weights,
 * so a batch costs nearly a row's time per row. Repacked, a vector lane is an output row: per 32-run, each x
 * row's 4 inputs are broadcast against 4 inputs of all 8 weight rows (maddubs), partial sums stay in lanes,
 * and one scale multiply serves 8 outputs; a weight record is read once per 4 x rows (llama.cpp's AVX2
 * "Q4_0x8" repack is the same idea).
 *
 * Layout (every type; N a multiple of 8): rows 8 g .. 8 g + 7 hold, block after block, a record of the 8
 * rows' block (8 x the block's bytes, so a packed tensor keeps its shape): first their scales, then run
 * after run (a block holds 256 / 32 = 8 runs for K-quants, else 1) the 8 rows' 32 quants each:
 *   - scales: d[8] (fp16, one per row; Q6_K's at the file's end of block), then for Q4_1 / Q5_1 m[8]
 *     (fp16), for Q4_K / Q5_K dmin[8] (fp16) and per run 12 bytes (byte i: row i's 6-bit scale | the low
 *     2 bits of its 6-bit min << 6; bytes 8 + i / 2: the min's high 4 bits, odd rows in the high nibble),
 *     for Q6_K per run 16 int8 (row i's scale of the run's first 16 weights at i, of its last 16 at 8 + i);
 *   - quants as unsigned values u = q + 8 (Q4_0), + 16 (Q5_0), + 32 (Q6_K), + 128 (Q8_0), q otherwise: 4 chunks of 32
 *     bytes, byte 4 i + e of chunk c holding row i's u[8 c + e] (low nibble) and u[8 c + 4 + e] (high);
 *     then the bits above 4: 5-bit types 32 bytes, byte 4 i + e's bits 2 c and 2 c + 1 those of u[8 c + e]
 *     and u[8 c + 4 + e]; Q6_K 64 bytes, two vectors of 32, vector v's byte 4 i + e holding 2 bits each of
 *     u[8 c + e], u[8 c + 4 + e] for c = 2 v (bits 0-1, 2-3), then c = 2 v + 1 (bits 4-5, 6-7). Q8_0 has 8
 *     chunks instead, byte 4 i + e of chunk c row i's u[4 c + e].
 * The offsets of the signed types go back as a multiple of sum x (Q4_0, Q5_0; Q8_0 where the CPU has VNNI,
 * whose u8 x s8 dot takes u as it is: one instruction per 4 products instead of a sign move and one), or
 * the sign moves onto x (Q6_K; Q8_0 without VNNI: maddubs' int16 pairs of u <= 255 would saturate).
 *
 * Arithmetic (the scalar and the vector paths alike, for every batch size): out[m, n] = acc + bias with
 * acc = 0 and, run by run, acc = fma(t, D * xd, acc) then, for the types with a min, acc = fma(M, xs, acc),
 * t the run's exact integer dot, D and M the run's scale and min as gguf_scales gives them; Q6_K's two
 * halves of 16 each have their own t and D, first half first. */
static int64_t x8_record_bytes(int base) { return 8 * gguf_block_bytes(base); }
static inline int x8_runs(int base) { return gguf_qk(base) / 32; } /* runs per record */
static inline int x8_quant_offset(int base) { /* scale bytes at the start of a record */
    switch (base) {
    case GGUF_Q4_1: case GGUF_Q5_1: return 32;
    case GGUF_Q4_K: case GGUF_Q5_K: return 32 + 8 * 12;
    case GGUF_Q6_K: return 16 + 8 * 16;
    default: return 16;
    }
}
static inline int x8_high_bytes(int base) { /* bytes of a run's bits above 4 */
    return base == GGUF_Q6_K ? 64 : base == GGUF_Q5_0 || base == GGUF_Q5_1 || base == GGUF_Q5_K ? 32 : 0;
}
static inline int x8_run_bytes(int base) { return base == GGUF_Q8_0 ? 256 : 128 + x8_high_bytes(base); }
static inline int x8_offset(int base) { /* what the stored u exceeds q by */
    return base == GGUF_Q4_0 ? 8 : base == GGUF_Q5_0 ? 16 : base == GGUF_Q6_K ? 32 : base == GGUF_Q8_0 ? 128 : 0;
}
static inline int x8_halves(int base) { return base == GGUF_Q6_K; } /* a scale per 16 weights */

/* Run j's scales of row i (of 8) of record rec, as gguf_scales gives them for the file's block. */
static GgufScales x8_scales(const uint8_t *rec, int j, int i, int base) {
    float d = half_at(rec + 2 * i);
    switch (base) {
    case GGUF_Q4_1: case GGUF_Q5_1: return (GgufScales){d, d, half_at(rec + 16 + 2 * i)};
    case GGUF_Q4_K: case GGUF_Q5_K: {
        const uint8_t *sb = rec + 32 + 12 * j;
        int sc = sb[i] & 63, mn = sb[i] >> 6 | ((sb[8 + i / 2] >> (4 * (i % 2))) & 15) << 2;
        return (GgufScales){d * (float)sc, d * (float)sc, -(half_at(rec + 16 + 2 * i) * (float)mn)};
    }
    case GGUF_Q6_K: {
        const int8_t *sb = (const int8_t *)(rec + 16 + 16 * j);
        return (GgufScales){d * (float)sb[i], d * (float)sb[8 + i], 0.f};
    }
    default: return (GgufScales){d, d, 0.f};
    }
}

/* Row i (of 8) of record rec: run j's 32 quants as the file's q and scales. */
static void x8_q_scalar(const uint8_t *rec, int j, int i, int base, int8_t *q, GgufScales *sc) {
    const uint8_t *qs = rec + x8_quant_offset(base) + j * x8_run_bytes(base), *high = qs + 128;
    *sc = x8_scales(rec, j, i, base);
    for (int w = 0; w < 32; w++) {
        if (base == GGUF_Q8_0) {
            q[w] = (int8_t)(qs[32 * (w / 4) + 4 * i + w % 4] - x8_offset(base));
            continue;
        }
        int c = w / 8, upper = w % 8 >= 4, at = 4 * i + w % 4, u = upper ? qs[32 * c + at] >> 4 : qs[32 * c + at] & 15;
        if (x8_high_bytes(base) == 32) u |= ((high[at] >> (2 * c + upper)) & 1) << 4;
        if (base == GGUF_Q6_K) u |= ((high[32 * (c / 2) + at] >> (4 * (c % 2) + 2 * upper)) & 3) << 4;
        q[w] = (int8_t)(u - x8_offset(base));
    }
}

/* Row i's block at p into record rec (zeroed: bits are or-ed in) as row i of 8. */
static void x8_pack_row(const uint8_t *p, int i, int base, uint8_t *rec) {
    memcpy(rec + 2 * i, p + (base == GGUF_Q6_K ? 208 : 0), 2);   /* d */
    if (gguf_has_min(base)) memcpy(rec + 16 + 2 * i, p + 2, 2); /* m, or a K-quant's dmin */
    for (int j = 0; j < x8_runs(base); j++) {
        if (base == GGUF_Q4_K || base == GGUF_Q5_K) {
            int sc, mn;
            k4_scale_min(p + 4, j, &sc, &mn);
            uint8_t *sb = rec + 32 + 12 * j;
            sb[i] = (uint8_t)(sc | (mn & 3) << 6);
            sb[8 + i / 2] |= (uint8_t)((mn >> 2) << (4 * (i % 2)));
        }
        if (base == GGUF_Q6_K) { /* the run's two scales (gguf_scales' order) */
            const int8_t *sc = (const int8_t *)(p + 192) + (j / 4) * 8 + (j % 4) * 2;
            rec[16 + 16 * j + i] = (uint8_t)sc[0], rec[16 + 16 * j + 8 + i] = (uint8_t)sc[1];
        }
        int8_t q[32];
        gguf_q_scalar(p, j, base, q);
        uint8_t *qs = rec + x8_quant_offset(base) + j * x8_run_bytes(base), *high = qs + 128;
        for (int w = 0; w < 32; w++) {
            int u = q[w] + x8_offset(base), at = 4 * i + w % 4, c = w / 8, upper = w % 8 >= 4;
            if (base == GGUF_Q8_0) {
                qs[32 * (w / 4) + at] = (uint8_t)u;
                continue;
            }
            qs[32 * c + at] |= (uint8_t)((u & 15) << (4 * upper));
            if (x8_high_bytes(base) == 32) high[at] |= (uint8_t)(((u >> 4) & 1) << (2 * c + upper));
            if (base == GGUF_Q6_K) high[32 * (c / 2) + at] |= (uint8_t)(((u >> 4) & 3) << (4 * (c % 2) + 2 * upper));
        }
    }
}

/* Rows [8 g, 8 g + 8) of w (the file's layout, row_bytes apart) repacked into out (zeroed) as above. */
static void x8_pack_group(const uint8_t *w, int64_t row_bytes, int64_t g, int base, int64_t K, uint8_t *out) {
    int64_t bb = gguf_block_bytes(base), rb = x8_record_bytes(base);
    for (int64_t r = 0; r < K / gguf_qk(base); r++) {
        uint8_t *rec = out + g * 8 * row_bytes + r * rb;
        for (int i = 0; i < 8; i++) x8_pack_row(w + (8 * g + i) * row_bytes + r * bb, i, base, rec);
    }
}

/* out[m, n] for the 8 rows of the group at grp and M x rows, scalar (the arithmetic above). */
static void x8_dot_scalar(const uint8_t *grp, int64_t K, int base, GgufActs a, int M, float (*acc)[8]) {
    int64_t runs = K / 32, rb = x8_record_bytes(base);
    for (int m = 0; m < M; m++)
        for (int i = 0; i < 8; i++) acc[m][i] = 0.f;
    for (int64_t r = 0; r < runs; r++)
        for (int i = 0; i < 8; i++) {
            int8_t q[32];
            GgufScales sc;
            x8_q_scalar(grp + r / x8_runs(base) * rb, (int)(r % x8_runs(base)), i, base, q, &sc);
            for (int m = 0; m < M; m++) {
                const int8_t *x = a.q + m * K + r * 32;
                int t = 0, t2 = 0;
                for (int j = 0; j < 32; j++) *(x8_halves(base) && j >= 16 ? &t2 : &t) += q[j] * x[j];
                acc[m][i] = fmaf((float)t, sc.lo * a.d[m * runs + r], acc[m][i]);
                if (x8_halves(base)) acc[m][i] = fmaf((float)t2, sc.hi * a.d[m * runs + r], acc[m][i]);
                if (gguf_has_min(base)) acc[m][i] = fmaf(sc.m, a.s[m * runs + r], acc[m][i]);
            }
        }
}

#if GGUF_AVX2
/* Keeps v in a register here: unpinned, GCC computes a run's products first and spills them to sum them
 * after (integer adds reassociate): 1.3x slower, measured. */
#define X8_PIN(v) __asm__("" : "+x"(v))
/* x rows per pass over a weight record: each pass keeps 2 accumulators per row in registers, so 8 where
 * AVX-512 gives 32 vector registers (a record's nibbles then unpacked once per 8 rows, not 4), else 4 */
#ifdef __AVX512F__
#define X8_ROWS 8
#else
#define X8_ROWS 4
#endif

/* acc + the sums of 4 adjacent u8 x s8 products, per int32 lane, in one instruction where the CPU has VNNI
 * (AVX512-VNNI with VL, or AVX-VNNI): what maddubs + madd + add compute in three, and exactly the same
 * integers (the products of nibbles or |int8| <= 127 with int8 never reach maddubs' int16 saturation), so
 * every variant gives the same bits. */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define X8_VNNI "avx512_vnni"
static inline __m256i dpbusd8(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_epi32(acc, u, s); }
#elif defined(__AVXVNNI__)
#define X8_VNNI "avx_vnni"
static inline __m256i dpbusd8(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_avx_epi32(acc, u, s); }
#endif

/* Bit `from` of each byte of h moved to bit `to`, then only the bits of mask kept (16-bit shifts: the bits
 * that cross a byte boundary land outside the masks the layout's bit places use). */
static inline __m256i x8_bits(__m256i h, const int from, const int to, const int mask) {
    __m256i v = from <= to ? _mm256_slli_epi16(h, to - from) : _mm256_srli_epi16(h, from - to);
    return _mm256_and_si256(v, _mm256_set1_epi8((char)mask));
}

/* Chunk c of a run's quants qs as unsigned bytes: lo = u[8 c + e], hi = u[8 c + 4 + e] at byte 4 i + e. */
static inline __attribute__((always_inline)) void x8_chunk(const uint8_t *qs, const int c, const int base,
                                                           __m256i *lo, __m256i *hi) {
    const __m256i lo4 = _mm256_set1_epi8(15);
    __m256i b = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
    *lo = _mm256_and_si256(b, lo4), *hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), lo4);
    if (x8_high_bytes(base) == 32) {
        __m256i h = _mm256_loadu_si256((const __m256i *)(qs + 128));
        *lo = _mm256_or_si256(*lo, x8_bits(h, 2 * c, 4, 0x10));
        *hi = _mm256_or_si256(*hi, x8_bits(h, 2 * c + 1, 4, 0x10));
    } else if (base == GGUF_Q6_K) {
        __m256i h = _mm256_loadu_si256((const __m256i *)(qs + 128 + 32 * (c / 2)));
        *lo = _mm256_or_si256(*lo, x8_bits(h, 4 * (c % 2), 4, 0x30));
        *hi = _mm256_or_si256(*hi, x8_bits(h, 4 * (c % 2) + 2, 4, 0x30));
    }
}

/* t + lo . xl + hi . xh, 4 adjacent u8 x s8 products a lane each: exact (u8 <= 63 and |s8| <= 127 keep
 * maddubs' pairs and their sum within int16). */
static inline __m256i x8_dot2(__m256i t, __m256i lo, __m256i xl, __m256i hi, __m256i xh) {
#ifdef X8_VNNI
    return dpbusd8(dpbusd8(t, lo, xl), hi, xh);
#else
    __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xl), _mm256_maddubs_epi16(hi, xh));
    return _mm256_add_epi32(t, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
#endif
}

/* A run's exact integer dots of the group's 8 rows (lanes) with x rows g0 .. g0 + G - 1 into t (Q6_K: its
 * first 16 weights' into t, its last 16's into t2); qs: the run's quants, xq: row g0's run. */
static inline __attribute__((always_inline)) void x8_idot_avx2(const uint8_t *qs, const int8_t *xq, int64_t K,
                                                               const int base, const int G, __m256i *t,
                                                               __m256i *t2) {
    const __m256i lo4 = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
    for (int g = 0; g < G; g++) t[g] = t2[g] = _mm256_setzero_si256();
    if (base == GGUF_Q8_0) {
        for (int c = 0; c < 8; c++) {
            __m256i u = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
#ifndef X8_VNNI
            __m256i w = _mm256_xor_si256(u, _mm256_set1_epi8((char)0x80)), aw = _mm256_sign_epi8(w, w); /* q, |q| */
#endif
            for (int g = 0; g < G; g++) {
                int32_t x4;
                memcpy(&x4, xq + g * K + 4 * c, 4);
#ifdef X8_VNNI
                t[g] = dpbusd8(t[g], u, _mm256_set1_epi32(x4)); /* sum u x: x8_dot_offset takes 128 sum x off */
#else
                __m256i sx = _mm256_sign_epi8(_mm256_set1_epi32(x4), w);
                t[g] = _mm256_add_epi32(t[g], _mm256_madd_epi16(_mm256_maddubs_epi16(aw, sx), ones));
#endif
                X8_PIN(t[g]);
            }
        }
        return;
    }
#ifndef X8_VNNI
    if (x8_high_bytes(base) == 0) {
        /* 4-bit: int16 sums over the run, 8 maddubs of nibbles (<= 15) and int8 x (|x| <= 127): at most
         * 30480, no overflow; one widening at the end */
        for (int c = 0; c < 4; c++) {
            __m256i b = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
            __m256i lo = _mm256_and_si256(b, lo4), hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), lo4);
            for (int g = 0; g < G; g++) {
                int32_t xl, xh;
                memcpy(&xl, xq + g * K + 8 * c, 4);
                memcpy(&xh, xq + g * K + 8 * c + 4, 4);
                t[g] = _mm256_add_epi16(t[g], _mm256_maddubs_epi16(lo, _mm256_set1_epi32(xl)));
                t[g] = _mm256_add_epi16(t[g], _mm256_maddubs_epi16(hi, _mm256_set1_epi32(xh)));
                X8_PIN(t[g]);
            }
        }
        for (int g = 0; g < G; g++) t[g] = _mm256_madd_epi16(t[g], ones);
        return;
    }
#endif
    (void)lo4, (void)ones;
    for (int c = 0; c < 4; c++) {
        __m256i lo, hi;
        x8_chunk(qs, c, base, &lo, &hi);
        __m256i slo = lo, shi = hi; /* Q6_K: signed q, whose sign goes onto x */
        if (base == GGUF_Q6_K) {
            slo = _mm256_sub_epi8(lo, _mm256_set1_epi8(32)), shi = _mm256_sub_epi8(hi, _mm256_set1_epi8(32));
            lo = _mm256_abs_epi8(slo), hi = _mm256_abs_epi8(shi);
        }
        __m256i *into = base == GGUF_Q6_K && c >= 2 ? t2 : t;
        for (int g = 0; g < G; g++) {
            int32_t xl, xh;
            memcpy(&xl, xq + g * K + 8 * c, 4);
            memcpy(&xh, xq + g * K + 8 * c + 4, 4);
            __m256i bl = _mm256_set1_epi32(xl), bh = _mm256_set1_epi32(xh);
            if (base == GGUF_Q6_K) bl = _mm256_sign_epi8(bl, slo), bh = _mm256_sign_epi8(bh, shi);
            into[g] = x8_dot2(into[g], lo, bl, hi, bh);
            X8_PIN(into[g]);
        }
    }
}

/* Run j's scales of the record's 8 rows (lanes) from its d: D (Q6_K: D2 too, for the last 16 weights) and,
 * for the types with a min, M; each as x8_scales computes it. */
static inline __attribute__((always_inline)) void x8_scales_avx2(const uint8_t *rec, int j, const int base,
                                                                 __m256 *D, __m256 *D2, __m256 *M) {
    __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)rec));
    *D = *D2 = d, *M = _mm256_setzero_ps();
    if (base == GGUF_Q4_1 || base == GGUF_Q5_1) *M = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(rec + 16)));
    if (base == GGUF_Q4_K || base == GGUF_Q5_K) {
        const uint8_t *sb = rec + 32 + 12 * j;
        uint32_t high;
        memcpy(&high, sb + 8, 4);
        __m256i s8 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)sb));
        __m256i mh = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)high),
                                                        _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28)),
                                      _mm256_set1_epi32(15));
        __m256i sc = _mm256_and_si256(s8, _mm256_set1_epi32(63));
        __m256i mn = _mm256_or_si256(_mm256_srli_epi32(s8, 6), _mm256_slli_epi32(mh, 2));
        __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(rec + 16)));
        *D = _mm256_mul_ps(d, _mm256_cvtepi32_ps(sc));
        *M = _mm256_xor_ps(_mm256_mul_ps(dmin, _mm256_cvtepi32_ps(mn)), _mm256_set1_ps(-0.f));
    }
    if (base == GGUF_Q6_K) {
        const uint8_t *sb = rec + 16 + 16 * j;
        *D = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)sb))));
        *D2 = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(sb + 8)))));
    }
}

/* Run r of the group at grp: the record holding it (its block's, for the 8 rows) and the run's quants in it. */
static inline const uint8_t *x8_record(const uint8_t *grp, int64_t r, const int base) {
    return grp + r / x8_runs(base) * x8_record_bytes(base);
}
static inline const uint8_t *x8_quants(const uint8_t *rec, int64_t r, const int base) {
    return rec + x8_quant_offset(base) + r % x8_runs(base) * x8_run_bytes(base);
}

/* PREFETCH bytes ahead of run r's reads: a whole record of one run, else the run's quants (a K-quant record's
 * scales are read 8 times). */
static inline __attribute__((always_inline)) void x8_prefetch(const uint8_t *rec, const uint8_t *qs, const int base) {
    const int whole = x8_runs(base) == 1;
    const uint8_t *ahead = (whole ? rec : qs) + PREFETCH;
    for (int line = 0; line < (whole ? x8_record_bytes(base) : x8_run_bytes(base)); line += 64)
        _mm_prefetch((const char *)ahead + line, _MM_HINT_T0);
}

/* What x8_idot_avx2's integer dots exceed the dots with q by, in multiples of the run's sum x: the stored
 * offset, but for Q6_K (whose sign moves onto x) and, without VNNI, Q8_0 (likewise). */
static inline int x8_dot_offset(int base) {
#ifdef X8_VNNI
    return base == GGUF_Q6_K ? 0 : x8_offset(base);
#else
    return base == GGUF_Q6_K || base == GGUF_Q8_0 ? 0 : x8_offset(base);
#endif
}

/* x8_dot_scalar's acc for G (1 to X8_ROWS) x rows from g0 (lanes: the group's 8 rows) into out[g0 ..]. */
static inline __attribute__((always_inline)) void x8_dot_avx2(const uint8_t *grp, int64_t K, const int base,
                                                              GgufActs a, int64_t g0, const int G, float (*out)[8]) {
    const int64_t runs = K / 32;
    const int per = x8_runs(base);
    __m256 acc[X8_ROWS];
    for (int g = 0; g < G; g++) acc[g] = _mm256_setzero_ps();
#pragma GCC unroll 1
    for (int64_t r = 0; r < runs; r++) {
        const uint8_t *rec = x8_record(grp, r, base), *qs = x8_quants(rec, r, base);
        x8_prefetch(rec, qs, base);
        __m256i t[X8_ROWS], t2[X8_ROWS];
        x8_idot_avx2(qs, a.q + g0 * K + r * 32, K, base, G, t, t2);
        __m256 D, D2, M;
        x8_scales_avx2(rec, (int)(r % per), base, &D, &D2, &M);
        for (int g = 0; g < G; g++) {
            int64_t at = (g0 + g) * runs + r;
            __m256i ti = x8_dot_offset(base)
                             ? _mm256_sub_epi32(t[g], _mm256_set1_epi32(x8_dot_offset(base) * a.sum[at])) : t[g];
            __m256 xd = _mm256_set1_ps(a.d[at]);
            acc[g] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ti), _mm256_mul_ps(D, xd), acc[g]);
            if (base == GGUF_Q6_K) acc[g] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t2[g]), _mm256_mul_ps(D2, xd), acc[g]);
            if (gguf_has_min(base)) acc[g] = _mm256_fmadd_ps(M, _mm256_set1_ps(a.s[at]), acc[g]);
        }
    }
    for (int g = 0; g < G; g++) _mm256_storeu_ps(out[g0 + g], acc[g]);
}

static inline __attribute__((always_inline)) void x8_group_avx2(const uint8_t *grp, int64_t K, const int base,
                                                                GgufActs a, int M, float (*out)[8]) {
    int g0 = 0;
    for (; g0 + X8_ROWS <= M; g0 += X8_ROWS) x8_dot_avx2(grp, K, base, a, g0, X8_ROWS, out);
    switch (M - g0) {
    case 1: x8_dot_avx2(grp, K, base, a, g0, 1, out); break;
    case 2: x8_dot_avx2(grp, K, base, a, g0, 2, out); break;
    case 3: x8_dot_avx2(grp, K, base, a, g0, 3, out); break;
#if X8_ROWS == 8
    case 4: x8_dot_avx2(grp, K, base, a, g0, 4, out); break;
    case 5: x8_dot_avx2(grp, K, base, a, g0, 5, out); break;
    case 6: x8_dot_avx2(grp, K, base, a, g0, 6, out); break;
    case 7: x8_dot_avx2(grp, K, base, a, g0, 7, out); break;
#endif
    default: break;
    }
}

/* out[m, n .. n + 7] = acc[m * stride ..] + bias[n ..], stored in dt: store()'s roundings, 8 at a time. */
static void x8_store_avx2(const float *acc, int stride, const void *bias, int64_t n, int64_t N, int M, void *out,
                          int dt) {
    __m256 b = bias ? gguf_load8(bias, n, dt) : _mm256_setzero_ps();
    for (int m = 0; m < M; m++) {
        __m256 v = _mm256_add_ps(_mm256_loadu_ps(acc + m * stride), b);
        if (dt == BF16) _mm_storeu_si128((__m128i *)((uint16_t *)out + m * N + n), bf16x8(v));
        else _mm256_storeu_ps((float *)out + m * N + n, v);
    }
}

/* ---- AMX: the x8 kernel's integer dots as tile products --------------------------------------------------
 *
 * Where the build has AMX-INT8 and Linux granted this process the tile state, x8_linear_rows takes M >=
 * AMX_MIN_ROWS x rows through tile products, two groups (16 output columns) at a time. AMX_RUNS runs of the
 * groups at a time are unpacked once into B tiles as signed q: the x8 layout's chunks already hold 4
 * consecutive inputs of a row side by side, the order B wants, so chunk c's low nibbles are B's row 2 c and its
 * high ones row 2 c + 1. Then each 16 x rows of int8 are an A tile straight from GgufActs (rows K apart; the
 * last, short tile from a zero-padded copy), and per run tdpbssd gives the 16 x 16 exact integer dots (Q6_K:
 * one per half of 16 inputs, K = 16 each). They are scaled as x8_dot_avx2 scales its own, lane for lane: the
 * same integers, the same fma chain, the same bits; the 16 rows' sums stay in registers across the runs.
 *
 * PR_AMX_EMULATE builds the same code with the tile instructions written in C from their definitions (Intel
 * SDM: LDTILECFG, TILELOADD, TILEZERO, TDPBSSD, TILESTORED), so a CPU without AMX runs the layout, the
 * tails and the scaling (tests/unit/test_gguf_kernels.py); the instructions themselves run only on a CPU that
 * has them. */
#if defined(__AMX_INT8__) || defined(PR_AMX_EMULATE)
#define X8_AMX 1
#define AMX_MIN_ROWS 16 /* fewer x rows than a tile: the vector path */
/* The tiles (numbers, not an enum: the intrinsics paste them into the instruction) and their shapes below. */
#define AMX_TC 0   /* 16 x rows x 16 columns, int32 */
#define AMX_TC2 1  /* the same: the next run's (Q6_K: its second half's) */
#define AMX_TA 2   /* 16 x rows x 32 inputs, int8 */
#define AMX_TB 3   /* 32 inputs x 16 columns: 8 rows of 4 inputs x 16 columns */
#define AMX_TA2 4  /* the next run's A and B, in the same shapes */
#define AMX_TB2 5
#define AMX_TAH 4  /* or (configured for Q6_K) its halves: 16 x rows x 16 inputs */
#define AMX_TBH 5  /* and 16 inputs x 16 columns */
#define AMX_TAH2 6
#define AMX_TBH2 7
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16]; /* bytes per row of tile t */
    uint8_t rows[16];
} AmxConfig;

#ifdef PR_AMX_EMULATE
static _Thread_local struct { int rows, colsb; uint8_t b[16][64]; } amx_tile[8];
static int64_t amx_products; /* tdpbssd executed: tests check the path ran, and how often */
static void amx_config(const AmxConfig *c) {
    for (int t = 0; t < 8; t++) {
        amx_tile[t].rows = c->rows[t], amx_tile[t].colsb = c->colsb[t];
        memset(amx_tile[t].b, 0, sizeof amx_tile[t].b);
    }
}
static void amx_load(int t, const void *p, int64_t stride) {
    for (int r = 0; r < amx_tile[t].rows; r++)
        memcpy(amx_tile[t].b[r], (const char *)p + r * stride, amx_tile[t].colsb);
}
static void amx_store(int t, void *p, int64_t stride) {
    for (int r = 0; r < amx_tile[t].rows; r++) memcpy((char *)p + r * stride, amx_tile[t].b[r], amx_tile[t].colsb);
}
static void amx_zero(int t) { memset(amx_tile[t].b, 0, sizeof amx_tile[t].b); }
/* c[m][n] += the sum over k of a[m][k] b[k / 4][4 n + k % 4], int8 x int8 into int32 (K = a's bytes a row);
 * shapes that do not fit abort, where the instruction would fault */
static void amx_dpbssd(int c, int a, int b) {
    if (amx_tile[a].colsb / 4 != amx_tile[b].rows || amx_tile[c].colsb != amx_tile[b].colsb ||
        amx_tile[c].rows != amx_tile[a].rows)
        abort();
    for (int m = 0; m < amx_tile[a].rows; m++)
        for (int n = 0; n < amx_tile[c].colsb / 4; n++) {
            int32_t s;
            memcpy(&s, amx_tile[c].b[m] + 4 * n, 4);
            for (int k = 0; k < amx_tile[a].colsb; k++)
                s += (int8_t)amx_tile[a].b[m][k] * (int8_t)amx_tile[b].b[k / 4][4 * n + k % 4];
            memcpy(amx_tile[c].b[m] + 4 * n, &s, 4);
        }
    __atomic_fetch_add(&amx_products, 1, __ATOMIC_RELAXED);
}
#define AMX_CONFIG(c) amx_config(c)
#define AMX_LOAD(t, p, stride) amx_load(t, p, stride)
#define AMX_STORE(t, p, stride) amx_store(t, p, stride)
#define AMX_ZERO(t) amx_zero(t)
#define AMX_DPBSSD(c, a, b) amx_dpbssd(c, a, b)
#define AMX_RELEASE() ((void)0)
static const int amx_on = 1;
#define VARIANT_AMX "amx_int8_emulated"
#else
/* The intrinsics' asm reads the tile's memory without saying so: the barrier keeps the stores to it before.
 * gcc 12's _tile_loadconfig says it reads 8 bytes of the 64-byte configuration, so the stores of the rest may be
 * dropped as dead (int8_peak.c's were: ldtilecfg then faulted on garbage); this asm names the whole struct. */
#define AMX_CONFIG(c) __asm__ volatile("ldtilecfg %0" ::"m"(*(const AmxConfig *)(c)))
#define AMX_LOAD(t, p, stride)                                                                                 \
    do {                                                                                                       \
        __asm__ volatile("" ::: "memory");                                                                     \
        _tile_loadd(t, p, stride);                                                                             \
    } while (0)
#define AMX_STORE(t, p, stride) _tile_stored(t, p, stride)
#define AMX_ZERO(t) _tile_zero(t)
#define AMX_DPBSSD(c, a, b) _tile_dpbssd(c, a, b)
#define AMX_RELEASE() _tile_release()
/* Linux gives a process the tile state (8 KB more of XSAVE) only when asked (ARCH_REQ_XCOMP_PERM for
 * XFEATURE_XTILEDATA, Linux 5.16+), for all its threads; before that a tile instruction faults. Asked once,
 * at load; refused (an older kernel, a seccomp filter), the x8 kernel keeps its vector path. */
static int amx_on;
__attribute__((constructor)) static void amx_request(void) {
    unsigned long granted = 0;
    amx_on = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18) == 0 &&
             syscall(SYS_arch_prctl, 0x1022 /* ARCH_GET_XCOMP_PERM */, &granted) == 0 && (granted >> 18 & 1);
}
#define VARIANT_AMX "amx_int8"
#endif

/* This thread's tiles in the shapes above (a thread's own state: each configures before its products). */
static void amx_configure(int halves) {
    static const uint8_t shape[2][8][2] = {
        {[AMX_TC] = {16, 64}, [AMX_TC2] = {16, 64}, [AMX_TA] = {16, 32}, [AMX_TB] = {8, 64}, [AMX_TA2] = {16, 32},
         [AMX_TB2] = {8, 64}, [6] = {16, 64}, [7] = {16, 64}},
        {[AMX_TC] = {16, 64}, [AMX_TC2] = {16, 64}, [AMX_TA] = {16, 32}, [AMX_TB] = {8, 64}, [AMX_TAH] = {16, 16},
         [AMX_TBH] = {4, 64}, [AMX_TAH2] = {16, 16}, [AMX_TBH2] = {4, 64}}};
    AmxConfig c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) c.rows[t] = shape[halves][t][0], c.colsb[t] = shape[halves][t][1];
    AMX_CONFIG(&c);
}

/* A run's quants of two groups (qs[h]: group h's) as signed q into b: b[k / 4][4 n + k % 4] is input k of
 * column n (group n / 8's row n % 8). */
static inline __attribute__((always_inline)) void amx_unpack(const uint8_t *const *quants, const int base,
                                                             int8_t (*b)[64]) {
    const __m256i off = _mm256_set1_epi8((char)x8_offset(base));
    for (int h = 0; h < 2; h++) {
        const uint8_t *qs = quants[h];
        if (base == GGUF_Q8_0) { /* chunk c: inputs 4 c .. 4 c + 3 (u - 128 wraps to q) */
            for (int c = 0; c < 8; c++)
                _mm256_storeu_si256((__m256i *)(b[c] + 32 * h),
                                    _mm256_sub_epi8(_mm256_loadu_si256((const __m256i *)(qs + 32 * c)), off));
            continue;
        }
        for (int c = 0; c < 4; c++) {
            __m256i lo, hi;
            x8_chunk(qs, c, base, &lo, &hi);
            _mm256_storeu_si256((__m256i *)(b[2 * c] + 32 * h), _mm256_sub_epi8(lo, off));
            _mm256_storeu_si256((__m256i *)(b[2 * c + 1] + 32 * h), _mm256_sub_epi8(hi, off));
        }
    }
}

#define AMX_RUNS 16 /* runs of a pair unpacked at a time (AmxRun: 11 KB), then multiplied with every x row */

/* A run of two groups as the tile products take it: its quants as signed q in B's order (amx_unpack) and its
 * scales, 16 lanes (group h's 8 rows at 8 h) as x8_scales_avx2 computes them. */
typedef struct {
    int8_t b[8][64];
    float d[16], d2[16], m[16];
} AmxRun;

static inline __attribute__((always_inline)) void amx_prepare(const uint8_t *grp, int64_t group_bytes, int64_t r,
                                                              const int base, AmxRun *run) {
    const uint8_t *qs[2];
    for (int h = 0; h < 2; h++) {
        const uint8_t *rec = x8_record(grp + h * group_bytes, r, base);
        qs[h] = x8_quants(rec, r, base);
        x8_prefetch(rec, qs[h], base);
        __m256 D, D2, M;
        x8_scales_avx2(rec, (int)(r % x8_runs(base)), base, &D, &D2, &M);
        _mm256_storeu_ps(run->d + 8 * h, D), _mm256_storeu_ps(run->d2 + 8 * h, D2), _mm256_storeu_ps(run->m + 8 * h, M);
    }
    amx_unpack(qs, base, run->b);
}

/* Run r's int8 of x rows m0 .. m0 + rows - 1 as an A tile reads them (*stride bytes apart): straight from
 * GgufActs (rows K apart), a short tile (rows < 16) from a zero-padded copy in pad, not past a's end. */
static inline const int8_t *amx_rows_x(GgufActs a, int64_t K, int m0, const int rows, int64_t r, int8_t (*pad)[32],
                                       int64_t *stride) {
    const int8_t *x = a.q + m0 * K + r * 32;
    *stride = K;
    if (rows == 16) return x;
    for (int m = 0; m < rows; m++) memcpy(pad[m], x + m * K, 32);
    *stride = 32;
    return pad[0];
}

/* Tile c = the product of A tile ta (x rows) and B tile tb (a run's quants at b). */
#define AMX_PRODUCT(c, ta, tb, x, stride, b)                                                                   \
    do {                                                                                                       \
        AMX_ZERO(c);                                                                                           \
        AMX_LOAD(tb, b, 64);                                                                                   \
        AMX_LOAD(ta, x, stride);                                                                               \
        AMX_DPBSSD(c, ta, tb);                                                                                 \
    } while (0)

/* acc[m0 ..][16] += runs r0 .. r0 + n - 1 (run[0 ..]) of x rows m0 .. m0 + rows - 1 (rows <= 16): per run, one tile
 * product of the rows' int8 with the run's B gives its 16 x 16 exact integer dots (Q6_K: one per half of 16
 * inputs), then scaled lane for lane as x8_dot_avx2 scales its own: the same integers, the same fma chain, the
 * same bits. The rows' sums stay in registers across the runs (rows is a constant 16 for whole tiles). One
 * product's result waits on its tile product and store (measured: a quarter of the time, on one C tile), so
 * the next run's product goes into the other C tile before this one is scaled (Q6_K's halves take both). */
static inline __attribute__((always_inline)) void amx_rows(const AmxRun *run, int n, int64_t r0, const int base,
                                                           GgufActs a, int64_t K, int m0, const int rows,
                                                           float (*acc)[16]) {
    const int64_t runs = K / 32;
    const int halves = x8_halves(base);
    int8_t pad[16][32] __attribute__((aligned(64)));
    int32_t ct[2][16][16] __attribute__((aligned(64)));
    int64_t stride;
    const int8_t *x;
    V16 v[16];
    if (rows < 16) memset(pad, 0, sizeof pad);
    for (int m = 0; m < rows; m++) v[m] = v16_loadf(acc[m0 + m]);
    if (!halves) {
        x = amx_rows_x(a, K, m0, rows, r0, pad, &stride);
        AMX_PRODUCT(AMX_TC, AMX_TA, AMX_TB, x, stride, run[0].b[0]);
    }
#pragma GCC unroll 1
    for (int i = 0; i < n; i++) {
        const int64_t r = r0 + i;
        if (halves) {
            x = amx_rows_x(a, K, m0, rows, r, pad, &stride);
            AMX_ZERO(AMX_TC);
            AMX_ZERO(AMX_TC2);
            AMX_LOAD(AMX_TBH, run[i].b[0], 64);
            AMX_LOAD(AMX_TBH2, run[i].b[4], 64);
            AMX_LOAD(AMX_TAH, x, stride);
            AMX_LOAD(AMX_TAH2, x + 16, stride);
            AMX_DPBSSD(AMX_TC, AMX_TAH, AMX_TBH);
            AMX_DPBSSD(AMX_TC2, AMX_TAH2, AMX_TBH2);
            AMX_STORE(AMX_TC, ct[0], 64);
            AMX_STORE(AMX_TC2, ct[1], 64);
        } else {
            if (i + 1 < n) { /* the next run's product, into the other tiles (run i's are TC, TA, TB if i is even) */
                x = amx_rows_x(a, K, m0, rows, r + 1, pad, &stride);
                if (i & 1) AMX_PRODUCT(AMX_TC, AMX_TA, AMX_TB, x, stride, run[i + 1].b[0]);
                else AMX_PRODUCT(AMX_TC2, AMX_TA2, AMX_TB2, x, stride, run[i + 1].b[0]);
            }
            if (i & 1) AMX_STORE(AMX_TC2, ct[0], 64);
            else AMX_STORE(AMX_TC, ct[0], 64);
        }
        __asm__ volatile("" ::: "memory"); /* the tile stores above wrote ct (see AMX_LOAD) */
        const V16 D = v16_loadf(run[i].d), D2 = v16_loadf(run[i].d2), Mn = v16_loadf(run[i].m);
#pragma GCC unroll 16
        for (int m = 0; m < rows; m++) {
            const int64_t at = (m0 + m) * runs + r;
            const V16 xd = v16_set1(a.d[at]);
            v[m] = v16_fmadd(v16_load_i32(ct[0][m]), v16_mul(D, xd), v[m]);
            if (base == GGUF_Q6_K) v[m] = v16_fmadd(v16_load_i32(ct[1][m]), v16_mul(D2, xd), v[m]);
            if (gguf_has_min(base)) v[m] = v16_fmadd(Mn, v16_set1(a.s[at]), v[m]);
        }
    }
    for (int m = 0; m < rows; m++) v16_storef(acc[m0 + m], v[m]);
}

/* acc[m][8 h ..] = x8_dot_avx2's out[m] for group h of the two at grp (group_bytes apart) and a's M x rows:
 * AMX_RUNS runs at a time are unpacked once, then multiplied with the rows 16 at a time. */
static inline __attribute__((always_inline)) void x8_pair_amx(const uint8_t *grp, int64_t group_bytes, int64_t K,
                                                              const int base, GgufActs a, int M,
                                                              float (*acc)[16]) {
    const int64_t runs = K / 32;
    AmxRun run[AMX_RUNS] __attribute__((aligned(64)));
    memset(acc, 0, sizeof(float) * 16 * M);
#pragma GCC unroll 1
    for (int64_t r0 = 0; r0 < runs; r0 += AMX_RUNS) {
        const int n = runs - r0 < AMX_RUNS ? (int)(runs - r0) : AMX_RUNS;
        for (int i = 0; i < n; i++) amx_prepare(grp, group_bytes, r0 + i, base, &run[i]);
        int m0 = 0;
        for (; m0 + 16 <= M; m0 += 16) amx_rows(run, n, r0, base, a, K, m0, 16, acc);
        if (m0 < M) amx_rows(run, n, r0, base, a, K, m0, M - m0, acc);
    }
}

/* x8_pair_amx with the type's constants folded (one instance per type, as x8_linear_rows' vector path). */
static void x8_pair_amx_any(const uint8_t *grp, int64_t group_bytes, int64_t K, int base, GgufActs a, int M,
                            float (*acc)[16]) {
    switch (base) {
    case GGUF_Q4_0: x8_pair_amx(grp, group_bytes, K, GGUF_Q4_0, a, M, acc); break;
    case GGUF_Q4_1: x8_pair_amx(grp, group_bytes, K, GGUF_Q4_1, a, M, acc); break;
    case GGUF_Q5_0: x8_pair_amx(grp, group_bytes, K, GGUF_Q5_0, a, M, acc); break;
    case GGUF_Q5_1: x8_pair_amx(grp, group_bytes, K, GGUF_Q5_1, a, M, acc); break;
    case GGUF_Q4_K: x8_pair_amx(grp, group_bytes, K, GGUF_Q4_K, a, M, acc); break;
    case GGUF_Q5_K: x8_pair_amx(grp, group_bytes, K, GGUF_Q5_K, a, M, acc); break;
    case GGUF_Q6_K: x8_pair_amx(grp, group_bytes, K, GGUF_Q6_K, a, M, acc); break;
    default: x8_pair_amx(grp, group_bytes, K, GGUF_Q8_0, a, M, acc); break;
    }
}
#endif /* AMX */
#endif

/* A thread's [begin, end) of a packed matrix's rows moved down to whole groups: applied to every
 * thread's bounds alike, the ranges still cover the rows once (rows is a multiple of 8). */
static inline int64_t x8_down(int64_t row) { return row & ~(int64_t)7; }

/* Output columns [x8_down(begin), x8_down(end)) of out (dt, rows N apart) = a's M rows @ the packed w.T
 * (+ bias), M <= GGUF_MAX_ROWS. */
static void x8_linear_rows(const uint8_t *w, int base, const void *bias, int64_t begin, int64_t end, int64_t N,
                           int64_t K, GgufActs a, int M, void *out, int dt) {
    int64_t row_bytes = K / gguf_qk(base) * gguf_block_bytes(base);
    float acc[GGUF_MAX_ROWS][8];
    int64_t n = x8_down(begin);
#ifdef X8_AMX
    if (amx_on && !gguf_force_scalar && M >= AMX_MIN_ROWS && x8_down(end) - n >= 16) {
        float pair[GGUF_MAX_ROWS][16];
        amx_configure(x8_halves(base));
        for (; n + 16 <= x8_down(end); n += 16) { /* an odd group left goes the vector way */
            x8_pair_amx_any(w + n * row_bytes, 8 * row_bytes, K, base, a, M, pair);
            x8_store_avx2(pair[0], 16, bias, n, N, M, out, dt);
            x8_store_avx2(pair[0] + 8, 16, bias, n + 8, N, M, out, dt);
        }
        AMX_RELEASE();
    }
#endif
    for (; n < x8_down(end); n += 8) {
        const uint8_t *grp = w + n * row_bytes;
#if GGUF_AVX2
        if (!gguf_force_scalar) {
            switch (base) { /* one instance per type: its layout's constants fold */
            case GGUF_Q4_0: x8_group_avx2(grp, K, GGUF_Q4_0, a, M, acc); break;
            case GGUF_Q4_1: x8_group_avx2(grp, K, GGUF_Q4_1, a, M, acc); break;
            case GGUF_Q5_0: x8_group_avx2(grp, K, GGUF_Q5_0, a, M, acc); break;
            case GGUF_Q5_1: x8_group_avx2(grp, K, GGUF_Q5_1, a, M, acc); break;
            case GGUF_Q4_K: x8_group_avx2(grp, K, GGUF_Q4_K, a, M, acc); break;
            case GGUF_Q5_K: x8_group_avx2(grp, K, GGUF_Q5_K, a, M, acc); break;
            case GGUF_Q6_K: x8_group_avx2(grp, K, GGUF_Q6_K, a, M, acc); break;
            default: x8_group_avx2(grp, K, GGUF_Q8_0, a, M, acc); break;
            }
            x8_store_avx2(acc[0], 8, bias, n, N, M, out, dt);
            continue;
        }
#endif
        x8_dot_scalar(grp, K, base, a, M, acc);
        for (int i = 0; i < 8; i++) {
            float b = bias ? load(bias, n + i, dt) : 0.f;
            for (int m = 0; m < M; m++) store(out, m * N + n + i, acc[m][i] + b, dt);
        }
    }
}

/* out[N, K] (dt) = the packed w's values, as the file's rows would give them. */
static void x8_dequantize(const uint8_t *w, void *out, int64_t N, int64_t K, int base, int dt) {
    int64_t runs = K / 32, row_bytes = K / gguf_qk(base) * gguf_block_bytes(base), rb = x8_record_bytes(base);
    int per = x8_runs(base);
#pragma omp parallel for if (N * runs > 256)
    for (int64_t n = 0; n < N; n++)
        for (int64_t r = 0; r < runs; r++) {
            int8_t q[32];
            GgufScales sc;
            x8_q_scalar(w + (n / 8) * 8 * row_bytes + r / per * rb, (int)(r % per), (int)(n % 8), base, q, &sc);
            for (int j = 0; j < 32; j++) { /* gguf's order: d * q, then + m */
                float v = (j < 16 ? sc.lo : sc.hi) * (float)q[j];
                store(out, n * K + r * 32 + j, gguf_has_min(base) ? v + sc.m : v, dt);
            }
        }
}

static inline int gguf_vector(void) { return GGUF_AVX2 && !gguf_force_scalar; }

/* 0 if qt is known and K a whole number of its blocks, else -1. */
static int gguf_check(int64_t K, int qt) {
    if (gguf_x8(qt) && !gguf_x8_packable(gguf_base(qt))) return -1;
    return gguf_block_bytes(qt) && K > 0 && K % gguf_qk(qt) == 0 ? 0 : -1;
}

/* Scratch bytes for M rows of K inputs as int8 runs (GgufActs), and the split of such a buffer. */
static int64_t gguf_acts_bytes(int64_t M, int64_t K) { return M * K + 3 * (int64_t)sizeof(float) * (M * K / 32); }
static GgufActs gguf_acts(char *scratch, int64_t M, int64_t K) {
    float *f = (float *)(scratch + M * K);
    return (GgufActs){(int8_t *)scratch, f, f + M * K / 32, (int32_t *)(f + 2 * (M * K / 32))};
}

/* Inside a parallel region (every thread calls it: a worksharing loop, with its barrier): x's M * K / 32
 * runs (dt) quantized into a. */
static void gguf_quantize_part(const void *x, int64_t M, int64_t K, int dt, GgufActs a) {
    int vector = gguf_vector();
    (void)vector; /* unused without AVX2 */
#pragma omp for
    for (int64_t i = 0; i < M * K / 32; i++) {
#if GGUF_AVX2
        if (vector) gguf_quantize_run_avx2(x, i, dt, a);
        else
#endif
            gguf_quantize_run_scalar(x, i, dt, a);
    }
}

/* Output columns [begin, end) of out (dt, rows N apart) = the M (<= GGUF_MAX_ROWS) quantized rows a @
 * dequant(w).T (+ bias), w's row n giving column n. A packed w (GGUF_X8) moves begin and end down to whole
 * groups (x8_down), so the threads' contiguous ranges still split its rows exactly. */
static void gguf_linear_rows(const uint8_t *w, int qt, const void *bias, int64_t begin, int64_t end, int64_t N,
                             int64_t K, GgufActs a, int M, void *out, int dt) {
    if (gguf_x8(qt)) {
        x8_linear_rows(w, gguf_base(qt), bias, begin, end, N, K, a, M, out, dt);
        return;
    }
    int64_t row_bytes = K / gguf_qk(qt) * gguf_block_bytes(qt);
    int vector = gguf_vector();
    (void)vector;
    float sums[GGUF_TILE * GGUF_MAX_ROWS];
    for (int64_t n0 = begin; n0 < end; n0 += GGUF_TILE) {
        int64_t n1 = n0 + GGUF_TILE < end ? n0 + GGUF_TILE : end;
#if GGUF_AVX2
        if (vector) gguf_dot_any_avx2(w, row_bytes, n0, n1, K, qt, a, M, sums);
        else
#endif
            for (int64_t n = n0; n < n1; n++) gguf_dot_scalar(w + n * row_bytes, K, qt, a, M, sums + (n - n0) * M);
        for (int64_t n = n0; n < n1; n++) {
            float b = bias ? load(bias, n, dt) : 0.f;
            for (int64_t m = 0; m < M; m++) store(out, m * N + n, sums[(n - n0) * M + m] + b, dt);
        }
    }
}

/* out[M, N] = x[M, K] @ dequant(w[N, row bytes]).T (+ bias[N]); x, bias, out in dt. Any M: the x rows
 * are quantized once, then taken GGUF_MAX_ROWS at a time against each thread's weight rows (which stay in
 * its cache). Returns -1 for an unknown type, a K that is not whole blocks, a packed w of N not whole
 * groups or M < 1; -2 if scratch is not had. */
int pr_gguf_linear(const void *x, const void *w, const void *bias, void *out, int64_t M, int64_t N, int64_t K,
                   int qt, int dt) {
    if (gguf_check(K, qt) || M < 1 || (gguf_x8(qt) && N % 8)) return -1;
    char *scratch = alloc_lines(gguf_acts_bytes(M, K));
    if (!scratch) return -2;
    GgufActs a = gguf_acts(scratch, M, K);
    int64_t elem = dt == BF16 ? 2 : 4;
#pragma omp parallel
    {
        gguf_quantize_part(x, M, K, dt, a);
        int64_t begin, end;
        thread_range(N, &begin, &end);
        for (int64_t m = 0; m < M; m += GGUF_MAX_ROWS)
            gguf_linear_rows(w, qt, bias, begin, end, N, K, gguf_acts_from(a, m, K),
                             (int)(M - m < GGUF_MAX_ROWS ? M - m : GGUF_MAX_ROWS), (char *)out + m * N * elem, dt);
    }
    free(scratch);
    return 0;
}

/* out (uint8 [N, row bytes]) = w's rows repacked 8 at a time (the x8 layout); -1 for a type without one
 * or N not a multiple of 8. */
int pr_gguf_pack_x8(const void *w, void *out, int64_t N, int64_t K, int qt) {
    if (gguf_check(K, qt) || gguf_x8(qt) || !gguf_x8_packable(qt) || N % 8) return -1;
    int64_t row_bytes = K / gguf_qk(qt) * gguf_block_bytes(qt);
    memset(out, 0, N * row_bytes);
#pragma omp parallel for if (N > 64)
    for (int64_t g = 0; g < N / 8; g++) x8_pack_group(w, row_bytes, g, qt, K, out);
    return 0;
}

/* out[N, K] (dt) = dequant(w[N, row bytes]): gguf.quants.dequantize's values. -1 as pr_gguf_linear. */
int pr_gguf_dequantize(const void *w, void *out, int64_t N, int64_t K, int qt, int dt) {
    if (gguf_check(K, qt) || N < 0 || (gguf_x8(qt) && N % 8)) return -1;
    if (gguf_x8(qt)) {
        x8_dequantize(w, out, N, K, gguf_base(qt), dt);
        return 0;
    }
    int64_t runs = N * K / 32, bb = gguf_block_bytes(qt), blocks = K / gguf_qk(qt);
    int per = gguf_qk(qt) / 32, vector = gguf_vector();
#pragma omp parallel if (runs > 256)
    {
        int64_t begin, end;
        thread_range(runs, &begin, &end);
#if GGUF_AVX2
        if (vector) gguf_dequantize_range_avx2(w, begin, end, K, qt, out, dt);
        else
#endif
            for (int64_t i = begin; i < end; i++) {
                int64_t n = i / (K / 32), r = i % (K / 32);
                gguf_dequantize_run_scalar((const uint8_t *)w + (n * blocks + r / per) * bb, (int)(r % per), qt, out,
                                           i * 32, dt);
            }
    }
    (void)vector; /* unused without AVX2 */
    return 0;
}

/* 1: select the scalar paths even where the vector ones exist (tests); 0: back to the default. */
void pr_gguf_force_scalar(int on) { gguf_force_scalar = on; }

/* 0: GGUF_MAX_ROWS; 1: whether the vector (AVX2) paths are compiled in; 2: the GGUF_X8 flag; 3: the tile
 * products an emulated AMX build (PR_AMX_EMULATE) ran so far, 0 in any other; -1 for anything else. */
int64_t pr_gguf_abi(int what) {
    switch (what) {
    case 0: return GGUF_MAX_ROWS;
    case 1: return GGUF_AVX2;
    case 2: return GGUF_X8;
    case 3:
#if defined(X8_AMX) && defined(PR_AMX_EMULATE)
        return __atomic_load_n(&amx_products, __ATOMIC_RELAXED);
#else
        return 0;
#endif
    default: return -1;
    }
}

/* ---- one whole decoder layer for a decode step ---------------------------------------------- */

/* A matrix of the layer as up to MAX_PARTS parts stacked by output rows (q | k | v, gate | up), each held
 * as PLAIN weights (the model dtype, [rows, K]) or in a GGUF type's blocks ([rows, row bytes]), and its
 * adapter slots where LoRA is on (lora.a NULL: none; the rows running adapters are the step's). */
enum { PLAIN = -1 };
typedef struct {
    const void *data;
    int64_t rows, type;
} Part;
typedef struct {
    Part part[MAX_PARTS];
    int64_t parts;
    LoraSlots lora;
} Matrix;

/* A norm of the layer: its weight (NULL: the layer has none there) and how it applies it (NORM_*). */
typedef struct {
    const void *weight;
    int64_t kind;
} Norm;

/* A decoder layer as the model describes it (layers/decode_plan.py: the same fields, the contract). With the
 * residual carried beside the stream: attn_norm(residual += x) -> qkv (+ bias) -> per-head q_norm / k_norm ->
 * RoPE -> store K/V -> attention -> o -> attn_out_norm -> mlp_norm(residual += that) -> gate_up -> the
 * activation -> down -> mlp_out_norm -> the layer's output (the next layer adds it to the residual). Llama
 * has no q/k, attn_out and mlp_out norms; Qwen3 adds the q/k norms; Gemma has all six, NORM_UNIT_OFFSET. */
typedef struct {
    Norm attn_norm, q_norm, k_norm, attn_out_norm, mlp_norm, mlp_out_norm;
    const void *qkv_bias;
    Matrix qkv, o, gate_up, down;
    int64_t hidden, intermediate, activation;
    float eps;
} LayerWeights;

static int has_blocks(const Matrix *W) {
    for (int64_t i = 0; i < W->parts; i++)
        if (W->part[i].type != PLAIN) return 1;
    return 0;
}

/* Inside the layer's parallel region (every thread calls it): out (dt, [M, N], N = the parts' rows) = xf
 * (fp32, [M, K], values already rounded to dt) @ W.T (+ bias). GGUF parts take xf quantized into the
 * scratch at acts (first, by all threads), exactly as pr_gguf_linear quantizes the dt tensor of the same
 * values: the unfused path's arithmetic. Each thread computes one contiguous run of output columns across
 * the parts. */
static void matrix_part(const Matrix *W, const void *bias, int64_t K, int dt, const float *xf, int M, char *acts,
                        void *out) {
    int64_t N = 0, begin, end, elem = dt == BF16 ? 2 : 4;
    GgufActs a = gguf_acts(acts, M, K);
    for (int64_t i = 0; i < W->parts; i++) N += W->part[i].rows;
    if (has_blocks(W)) gguf_quantize_part(xf, M, K, F32, a);
    thread_range(N, &begin, &end);
    for (int64_t i = 0, first = 0; i < W->parts; first += W->part[i].rows, i++) {
        const Part *part = &W->part[i];
        int64_t lo = begin > first ? begin - first : 0, hi = end - first < part->rows ? end - first : part->rows;
        if (lo >= hi) continue;
        /* the part's columns: out and bias shifted by its first row, rows still N apart */
        void *cols = (char *)out + first * elem;
        const void *b = bias ? (const char *)bias + first * elem : NULL;
        for (int64_t m = 0; m < M; m += MAX_ROWS) { /* the part's rows of this thread stay in its cache */
            int rows = (int)(M - m < MAX_ROWS ? M - m : MAX_ROWS);
            void *at = (char *)cols + m * N * elem;
            if (part->type == PLAIN) linear_rows(part->data, b, lo, hi, N, K, dt, xf + m * K, rows, at);
            else gguf_linear_rows(part->data, (int)part->type, b, lo, hi, N, K, gguf_acts_from(a, m, K), rows, at, dt);
        }
    }
}

/* 0 if the slots' parts span the matrix's N outputs, else -1 (no slots: 0). */
static int lora_check(const Matrix *W) {
    const LoraSlots *L = &W->lora;
    int64_t N = 0, width = 0;
    if (!L->a) return 0;
    if (!L->b || L->slots < 1 || L->rank < 1 || L->parts < 1 || L->parts > MAX_PARTS) return -1;
    for (int64_t i = 0; i < W->parts; i++) N += W->part[i].rows;
    for (int64_t i = 0; i < L->parts; i++) width += L->width[i];
    return width == N ? 0 : -1;
}

/* 0 if every part's type is PLAIN or known and K whole blocks of it, at most MAX_PARTS parts, and any adapter
 * slots fit; else -1. */
static int matrix_check(const Matrix *W, int64_t K) {
    if (W->parts < 1 || W->parts > MAX_PARTS || lora_check(W)) return -1;
    for (int64_t i = 0; i < W->parts; i++)
        if (W->part[i].type != PLAIN &&
            (gguf_check(K, (int)W->part[i].type) || (gguf_x8((int)W->part[i].type) && W->part[i].rows % 8)))
            return -1;
    return 0;
}

typedef struct {
    int64_t rows; /* M single-token decodes (products take them MAX_ROWS at a time) */
    const int64_t *positions, *slots; /* positions: the rows of the RoPE tables (LongRoPE's offsets in) */
    const int64_t *lora_slots;        /* each row's adapter slot (-1: none); NULL: no row runs an adapter */
    Paged paged;                      /* the common terms; window, scale, softcap and kv_scale are each layer's */
} DecodeStep;

/* One layer of a decode step: its weights, its cache, and what its attention and RoPE read as their own. */
typedef struct {
    const LayerWeights *weights;
    void *kv_cache;
    float *kv_scale; /* an 8-bit cache's scales, else NULL */
    int64_t window;  /* > 0: sliding window (Paged.window) */
    float scale, softcap;
    const float *cos, *sin; /* this layer's RoPE tables [positions, rot] (Gemma: local and global differ) */
    int64_t rot;            /* the first rot dims of each q / k head rotate (partial rotary: rot < dim) */
} StackLayer;

/* Work buffers of one thread team, for the widest layer. */
typedef struct {
    float *xf, *scratch;
    char *qkv, *attn_out, *gate_up, *acts; /* acts: a linear's input as int8 runs, for GGUF parts */
    float *u;                              /* a product's adapter shrink, [M, parts * rank] */
    LoraRows lora;                         /* the step's rows that run adapters (count 0: none) */
} LayerWork;

static int64_t widest_input(const LayerWeights *W, const Paged *P) {
    int64_t H = W->hidden, I = W->intermediate, q_size = P->heads * P->dim;
    return I > H ? (I > q_size ? I : q_size) : (H > q_size ? H : q_size);
}

/* Each q head, then each k head, of row m of the fused qkv normed on its own, in place (Qwen3, Gemma). */
static void norm_heads(const LayerWeights *W, const Paged *P, char *row, int64_t elem, float eps, int dt) {
    for (int64_t h = 0; h < P->heads + P->kv_heads; h++) {
        const Norm *norm = h < P->heads ? &W->q_norm : &W->k_norm;
        char *head = row + elem * h * P->dim;
        if (norm->weight) rms_norm_row(head, NULL, norm->weight, head, NULL, 0, P->dim, eps, dt, (int)norm->kind);
    }
}

/* matrix_part, then the step's adapter delta where the matrix has slots (every thread calls it): the shrink,
 * then, once every thread's columns of the product are in out (a packed GGUF part's thread writes other
 * columns than thread_range's), the expand. The same arithmetic as the product, then cpu_lora_delta. */
static void product_part(const Matrix *W, const void *bias, int64_t K, int dt, const float *xf, int M,
                         const LayerWork *w, void *out) {
    matrix_part(W, bias, K, dt, xf, M, w->acts, out);
    if (!w->lora.count || !W->lora.a) return;
    lora_shrink_part(&W->lora, &w->lora, K, dt, xf, w->u);
#pragma omp barrier
    lora_expand_part(&W->lora, &w->lora, dt, w->u, out);
}

/* The activation's share of the calling thread (every thread calls it), into xf. */
static void activate_part(const LayerWeights *W, const void *gate_up, float *xf, int64_t M, int dt) {
    int64_t begin, end;
    thread_range(M * W->intermediate, &begin, &end);
    gated_range(gate_up, NULL, xf, begin, end, W->intermediate, dt, (int)W->activation);
}

/* x (this layer's input, the previous layer's output) is replaced by this layer's output; residual
 * carries the stream (zeros before the first layer). The same operations, in the same dtype roundings, as
 * the model's DecoderLayer.forward with the per-operation kernels (see LayerWeights). Called by every
 * thread of the team. */
static void decode_layer(const StackLayer *L, const Paged *P, const DecodeStep *S, void *x, void *residual,
                         const LayerWork *w, int64_t per_thread, int dt) {
    const LayerWeights *W = L->weights;
    int64_t M = S->rows, H = W->hidden, dim = P->dim;
    int64_t q_size = P->heads * dim, kv_size = P->kv_heads * dim, qkv_size = q_size + 2 * kv_size;
    int64_t elem = dt == BF16 ? 2 : 4;
    float *xf = w->xf;
#pragma omp for
    for (int64_t m = 0; m < M; m++)
        rms_norm_row(x, residual, W->attn_norm.weight, NULL, xf, m, H, W->eps, dt, (int)W->attn_norm.kind);
    product_part(&W->qkv, W->qkv_bias, H, dt, xf, (int)M, w, w->qkv);
#pragma omp barrier
#pragma omp for
    for (int64_t m = 0; m < M; m++) {
        char *row = w->qkv + elem * m * qkv_size;
        if (W->q_norm.weight || W->k_norm.weight) norm_heads(W, P, row, elem, W->eps, dt);
        rope_row(w->qkv, qkv_size, S->positions[m], L->cos, L->sin, m, P->heads + P->kv_heads, dim, L->rot, dt);
        store_kv_row(P, row + elem * q_size, row + elem * (q_size + kv_size), L->kv_cache, S->slots[m], dt);
    }
    attend_part(P, w->qkv, qkv_size, L->kv_cache, M, w->scratch, per_thread, NULL, xf, dt);
#pragma omp barrier
    product_part(&W->o, NULL, q_size, dt, xf, (int)M, w, w->attn_out);
#pragma omp barrier
#pragma omp for
    for (int64_t m = 0; m < M; m++) {
        if (W->attn_out_norm.weight)
            rms_norm_row(w->attn_out, NULL, W->attn_out_norm.weight, w->attn_out, NULL, m, H, W->eps, dt,
                         (int)W->attn_out_norm.kind);
        rms_norm_row(w->attn_out, residual, W->mlp_norm.weight, NULL, xf, m, H, W->eps, dt, (int)W->mlp_norm.kind);
    }
    product_part(&W->gate_up, NULL, H, dt, xf, (int)M, w, w->gate_up);
#pragma omp barrier
    activate_part(W, w->gate_up, xf, M, dt);
#pragma omp barrier
    /* with an output norm the MLP's product goes to attn_out (free again), the norm of it to x */
    product_part(&W->down, NULL, W->intermediate, dt, xf, (int)M, w, W->mlp_out_norm.weight ? w->attn_out : x);
#pragma omp barrier
    if (W->mlp_out_norm.weight) {
#pragma omp for
        for (int64_t m = 0; m < M; m++)
            rms_norm_row(w->attn_out, NULL, W->mlp_out_norm.weight, x, NULL, m, H, W->eps, dt,
                         (int)W->mlp_out_norm.kind);
    } /* (the omp for's implied barrier: x is the next layer's input) */
}

/* The widest adapter shrink of the layer's matrices (parts * rank; 0: none has slots); *slots becomes the
 * fewest slots any of them has, if fewer. */
static int64_t lora_width(const LayerWeights *W, int64_t *slots) {
    const Matrix *matrices[4] = {&W->qkv, &W->o, &W->gate_up, &W->down};
    int64_t width = 0;
    for (int i = 0; i < 4; i++) {
        const LoraSlots *L = &matrices[i]->lora;
        if (!L->a) continue;
        width = L->parts * L->rank > width ? L->parts * L->rank : width;
        *slots = L->slots < *slots ? L->slots : *slots;
    }
    return width;
}

/* A decode step's decoder layers, layers[0] .. layers[n - 1] in turn, in one parallel region: no
 * interpreter and no thread wake-up between operations or layers. S->paged gives the attention's common
 * terms (its window and kv_scale are each layer's own); S->lora_slots, where given, each row's adapter slot
 * (its delta added after each product of a matrix with slots). Returns -1 for a bad row count, weight layout
 * or adapter slot, -2 if the work buffers cannot be allocated. */
int pr_decode_layers(const StackLayer *layers, int64_t n, const DecodeStep *S, void *x, void *residual, int dt) {
    int64_t M = S->rows, threads = omp_get_max_threads(), elem = dt == BF16 ? 2 : 4;
    int64_t per_thread = attention_scratch(&S->paged, max_context(S->paged.context_lens, M));
    int64_t widest = 0, qkv_size = 0, H = 0, I = 0, lora = 0, slots = INT64_MAX;
    if (M < 1 || n < 1) return -1;
    for (int64_t l = 0; l < n; l++) {
        const LayerWeights *W = layers[l].weights;
        const Paged *P = &S->paged;
        int64_t q_size = P->heads * P->dim, wide = widest_input(W, P);
        if (matrix_check(&W->qkv, W->hidden) || matrix_check(&W->o, q_size) ||
            matrix_check(&W->gate_up, W->hidden) || matrix_check(&W->down, W->intermediate) ||
            !W->attn_norm.weight || !W->mlp_norm.weight || layers[l].rot < 2 || layers[l].rot > P->dim ||
            layers[l].rot % 2)
            return -1;
        int64_t shrink = lora_width(W, &slots);
        widest = wide > widest ? wide : widest, lora = shrink > lora ? shrink : lora;
        H = W->hidden > H ? W->hidden : H, I = W->intermediate > I ? W->intermediate : I;
        qkv_size = q_size + 2 * P->kv_heads * P->dim;
    }
    /* fp32 input of the next linear | attention scratch | adapter shrink | qkv (dt) | o output (dt) | gate_up
     * (dt) | that input as int8 runs, for GGUF parts | the adapter rows' groups (LoraRows: 3 M + 1 int64) */
    int64_t floats = M * widest + per_thread * threads + M * lora, dts = elem * M * (qkv_size + H + 2 * I);
    int64_t groups_at = (sizeof(float) * floats + dts + gguf_acts_bytes(M, widest) + 63) / 64 * 64;
    char *buffer = alloc_lines(groups_at + sizeof(int64_t) * (3 * M + 1));
    if (!buffer) return -2;
    int64_t *row = (int64_t *)(buffer + groups_at), *slot = row + M, *first = slot + M;
    LoraRows groups = {0, slot, first, row};
    if (S->lora_slots && lora && lora_rows(S->lora_slots, M, slots, &groups)) {
        free(buffer);
        return -1;
    }
    LayerWork w;
    w.xf = (float *)buffer, w.scratch = w.xf + M * widest, w.u = w.scratch + per_thread * threads;
    w.qkv = (char *)(w.u + M * lora), w.attn_out = w.qkv + elem * M * qkv_size;
    w.gate_up = w.attn_out + elem * M * H, w.acts = (char *)buffer + sizeof(float) * floats + dts;
    w.lora = groups;
#pragma omp parallel
    for (int64_t l = 0; l < n; l++) {
        Paged P = S->paged;
        P.window = layers[l].window, P.kv_scale = layers[l].kv_scale;
        P.scale = layers[l].scale, P.softcap = layers[l].softcap;
        decode_layer(&layers[l], &P, S, x, residual, &w, per_thread, dt);
    }
    free(buffer);
    return 0;
}

/* ---- what the Python loader reads instead of mirroring by hand -------------------------------- */

/* 0: MAX_ROWS; 1, 2, 3, 4: sizeof LayerWeights, DecodeStep, Paged, StackLayer (cpu.py checks its ctypes
 * structs against these and refuses a library that disagrees); 5, 6: NORM_UNIT_OFFSET, ACT_GELU_TANH; 7: sizeof
 * LoraSlots; -1 for anything else. */
/* Which variant of each kernel family this build holds, as "family=variant" pairs separated by spaces: what
 * the compiler was allowed (-march) decides it, at build time (the library is built for the CPU it runs on). */
#if defined(__AVX512F__)
#define VARIANT_VEC "avx512"
#elif defined(VEC16)
#define VARIANT_VEC "avx2"
#else
#define VARIANT_VEC "scalar"
#endif
#if GGUF_AVX2
#define VARIANT_GGUF "avx2"
#else
#define VARIANT_GGUF "scalar"
#endif
#if GGUF_AVX2 && defined(X8_VNNI)
#define VARIANT_X8 X8_VNNI
#else
#define VARIANT_X8 VARIANT_GGUF
#endif
#define VARIANTS(x8) \
    "linear=" VARIANT_LINEAR " attention=" VARIANT_VEC " norms=" VARIANT_VEC " lora=" VARIANT_VEC \
    " gguf=" VARIANT_GGUF " gguf_x8=" x8
#ifdef DOT_BF16
#define VARIANT_LINEAR "avx512_bf16" /* bfloat16 weights; float32 ones: avx512 */
#else
#define VARIANT_LINEAR VARIANT_VEC
#endif
const char *pr_kernel_variants(void) {
#ifdef X8_AMX
    if (amx_on) return VARIANTS(VARIANT_AMX); /* from AMX_MIN_ROWS rows; fewer: VARIANT_X8 */
#endif
    return VARIANTS(VARIANT_X8);
}

int64_t pr_abi(int what) {
    switch (what) {
    case 0: return MAX_ROWS;
    case 1: return (int64_t)sizeof(LayerWeights);
    case 2: return (int64_t)sizeof(DecodeStep);
    case 3: return (int64_t)sizeof(Paged);
    case 4: return (int64_t)sizeof(StackLayer);
    case 5: return NORM_UNIT_OFFSET;
    case 6: return ACT_GELU_TANH;
    case 7: return (int64_t)sizeof(LoraSlots);
    default: return -1;
    }
}
