/* The CPU's peak int8 dot-product rate, measured: ten independent accumulator chains of the widest u8 x s8
 * dot product the compiler is allowed (-march=native): vpdpbusd on 512 bits with AVX512-VNNI, on 256 with
 * AVX-VNNI, else AVX2's maddubs + madd + add (three instructions per 32 products). One chain set per OpenMP
 * thread; ops = 2 per product (a multiply and an add), as GEMM rates count them. Where the compiler is allowed
 * AMX-INT8 and Linux grants the tile state, the peak is instead four independent tdpbssd chains (16 x 16 x 64
 * products each), what the GGUF x8 kernel's batches use there. Prints "<GOPS> <instruction>", and on AMX a
 * second line "<GOPS> <what>" (amx_block_scaled_gops). Built and run by gguf_kernels.py. */
#if defined(__AMX_INT8__)
#define _GNU_SOURCE
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>

#if defined(__AVX512VNNI__)
typedef __m512i V;
#define NAME "vpdpbusd zmm"
#define PRODUCTS 64
static inline V step(V a, V u, V s) { return _mm512_dpbusd_epi32(a, u, s); }
static inline V splat8(char c) { return _mm512_set1_epi8(c); }
static inline int lane0(V x) { return _mm_cvtsi128_si32(_mm512_castsi512_si128(x)); }
#elif defined(__AVXVNNI__) || defined(__AVX2__)
typedef __m256i V;
#define PRODUCTS 32
#if defined(__AVXVNNI__)
#define NAME "vpdpbusd ymm (AVX-VNNI)"
static inline V step(V a, V u, V s) { return _mm256_dpbusd_avx_epi32(a, u, s); }
#else
#define NAME "vpmaddubsw + vpmaddwd + vpaddd ymm"
static inline V step(V a, V u, V s) { /* a as the signed side too: else the products would be loop-invariant */
    (void)s;
    return _mm256_add_epi32(a, _mm256_madd_epi16(_mm256_maddubs_epi16(u, a), _mm256_set1_epi16(1)));
}
#endif
static inline V splat8(char c) { return _mm256_set1_epi8(c); }
static inline int lane0(V x) { return _mm_cvtsi128_si32(_mm256_castsi256_si128(x)); }
#endif

#if defined(__AMX_INT8__)
typedef struct { uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; } TileConfig;

/* ldtilecfg of the whole struct: gcc 12's _tile_loadconfig says it reads 8 bytes of it, so gcc dropped the stores
 * of the shapes as dead and the instruction faulted on what the stack held. */
static inline void load_tile_config(const TileConfig *c) { __asm__ volatile("ldtilecfg %0" ::"m"(*c)); }

/* Tiles 0-3: accumulators, 4-5: A, 6-7: B, all 16 rows x 64 bytes. */
static double amx_gops(void) {
    unsigned long granted = 0;
    if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18) || syscall(SYS_arch_prctl, 0x1022, &granted) ||
        !(granted >> 18 & 1))
        return 0;
    const long iters = 2000000L;
    double best = 0;
    for (int rep = 0; rep < 3; rep++) {
        double start = omp_get_wtime();
#pragma omp parallel
        {
            TileConfig cfg;
            static int8_t data[16][64];
            memset(&cfg, 0, sizeof cfg);
            cfg.palette = 1;
            for (int t = 0; t < 8; t++) cfg.rows[t] = 16, cfg.colsb[t] = 64;
            load_tile_config(&cfg);
            _tile_loadd(4, data, 64);
            _tile_loadd(5, data, 64);
            _tile_loadd(6, data, 64);
            _tile_loadd(7, data, 64);
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (long n = 0; n < iters; n++) {
                _tile_dpbssd(0, 4, 6);
                _tile_dpbssd(1, 4, 7);
                _tile_dpbssd(2, 5, 6);
                _tile_dpbssd(3, 5, 7);
            }
            _tile_release();
        }
        double rate = 2.0 * 16 * 16 * 64 * 4 * iters * omp_get_max_threads() / (omp_get_wtime() - start);
        best = rate > best ? rate : best;
    }
    return best / 1e9;
}

/* The bound on any GGUF kernel that scales each block exactly: the rate of the least work such a kernel does
 * per block of 32 inputs, 16 x rows and 16 output columns. That is one tdpbssd of K = 32 (the block's integer
 * dots), its tile store, and the x8 kernel's scaling of the 16 rows' dots: convert, the two scales' product, an
 * fma, the minimum's fma (x8_dot_avx2's chain for a type with a minimum, as Q4_1, Q4_K and Q5_K; it keeps every
 * row's bits whatever path the row takes). A and B stay in their tiles, the scales in L1, the sums in
 * registers: no unpacking, no tile loads, no output, so a real kernel stays below it. */
static double amx_block_scaled_gops(void) {
    const long iters = 1000000L;
    double best = 0;
    for (int rep = 0; rep < 3; rep++) {
        double start = omp_get_wtime();
        float sink = 0;
#pragma omp parallel reduction(+ : sink)
        {
            TileConfig cfg;
            static const int8_t a[16][32], b[8][64];
            int32_t dots[16][16] __attribute__((aligned(64)));
            float xd[64][16], xs[64][16], wd[16], wm[16];
            for (int j = 0; j < 64; j++)
                for (int m = 0; m < 16; m++) xd[j][m] = 1.f / (j + m + 1), xs[j][m] = (float)(j - m);
            for (int n = 0; n < 16; n++) wd[n] = (float)n, wm[n] = (float)-n;
            memset(&cfg, 0, sizeof cfg);
            cfg.palette = 1;
            cfg.rows[0] = 16, cfg.colsb[0] = 64; /* the block's dots */
            cfg.rows[1] = 16, cfg.colsb[1] = 32; /* A: 16 x rows x 32 inputs */
            cfg.rows[2] = 8, cfg.colsb[2] = 64;  /* B: 32 inputs x 16 columns */
            load_tile_config(&cfg);
            _tile_loadd(1, a, 32);
            _tile_loadd(2, b, 64);
            __m512 acc[16];
#pragma GCC unroll 16 /* every loop over acc unrolled, or gcc keeps the 16 sums on the stack (the kernel does not) */
            for (int m = 0; m < 16; m++) acc[m] = _mm512_setzero_ps();
            const __m512 D = _mm512_loadu_ps(wd), M = _mm512_loadu_ps(wm);
            for (long n = 0; n < iters; n++) {
                const int j = (int)(n & 63);
                _tile_zero(0);
                _tile_dpbssd(0, 1, 2);
                _tile_stored(0, dots, 64);
                __asm__ volatile("" ::: "memory"); /* the tile store wrote dots */
#pragma GCC unroll 16
                for (int m = 0; m < 16; m++) {
                    const __m512 dot = _mm512_cvtepi32_ps(_mm512_load_si512(dots[m]));
                    acc[m] = _mm512_fmadd_ps(dot, _mm512_mul_ps(D, _mm512_set1_ps(xd[j][m])), acc[m]);
                    acc[m] = _mm512_fmadd_ps(M, _mm512_set1_ps(xs[j][m]), acc[m]);
                }
            }
            _tile_release();
#pragma GCC unroll 16
            for (int m = 0; m < 16; m++) sink += _mm512_reduce_add_ps(acc[m]);
        }
        double rate = 2.0 * 16 * 16 * 32 * iters * omp_get_max_threads() / (omp_get_wtime() - start);
        best = rate > best && sink == sink ? rate : best; /* sink keeps the sums, and so the scaling */
    }
    return best / 1e9;
}
#endif

int main(void) {
#if defined(__AMX_INT8__)
    double amx = amx_gops();
    if (amx > 0) {
        printf("%.1f tdpbssd (AMX)\n", amx);
        printf("%.1f tdpbssd with each GGUF block's exact scaling\n", amx_block_scaled_gops());
        return 0;
    }
#endif
#ifdef NAME
    const long iters = 50000000L;
    double best = 0;
    long sink = 0;
    for (int rep = 0; rep < 3; rep++) {
        double start = omp_get_wtime();
#pragma omp parallel reduction(+ : sink)
        {
            V u = splat8(3), s = splat8(-2), a[10];
            for (int i = 0; i < 10; i++) a[i] = splat8((char)i);
            for (long n = 0; n < iters; n++) {
#pragma GCC unroll 10
                for (int i = 0; i < 10; i++) a[i] = step(a[i], u, s);
            }
            for (int i = 0; i < 10; i++) sink += lane0(a[i]);
        }
        double rate = 2.0 * PRODUCTS * 10 * iters * omp_get_max_threads() / (omp_get_wtime() - start);
        best = rate > best ? rate : best;
    }
    printf("%.1f %s\n", best / 1e9, NAME);
    return (int)(sink & 0); /* sink keeps the chains */
#else
    printf("0 none\n");
    return 0;
#endif
}
