/* 4-bit linear layers on the CPU: y[M, N] = x[M, K] (bfloat16) @ W^T, W in 4-bit codes with one
 * scale d and one offset m per 32 inputs (w = d * q + m), y in float32.
 *
 * Layout (made by ember.kernels.cpu.q4_linear.pack): 16 outputs a tile; per tile and group of
 * 32 inputs one 320-byte block: d[16] and m[16] as float16, then 8 quads of 32 bytes, quad q
 * holding inputs 4q..4q+3 of the group: byte j (output j / 2, input 4q + j % 2) has that code in
 * its low nibble and the code of input 4q + 2 + j % 2 in its high nibble. So a quad widens to
 * two registers of 32 bfloat16 codes in the order AVX512-BF16's dot takes them: for each of 16
 * outputs a pair of adjacent inputs.
 *
 * Per tile the codes are widened once into a buffer (exact small integers in bfloat16, by table
 * lookup), then every row of x, 8 rows at a time, takes each group's dot with them, summed from
 * zero in float32, and folds it into its 16 outputs as y = fma(dot, d, y), then
 * y = fma(m, sum of the group's x, y). A row's arithmetic is the same
 * whatever the number of rows, so its result does not depend on the batch it came in.
 *
 * Without AVX512-BF16 the same arithmetic runs in plain C (the dot's two products are exact in
 * float32 and added odd then even, as VDPBF16PS does): bit for bit the same results but for
 * denormals, which the instruction flushes.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#ifdef __AVX512BF16__
#include <immintrin.h>
#endif

#define TILE 16
#define GROUP 32
#define PAIRS (GROUP / 2)
#define BLOCK_BYTES 320
#define ROWS 8

int ember_q4_native(void) {
#ifdef __AVX512BF16__
    return 1;
#else
    return 0;
#endif
}

#ifndef __AVX512BF16__
static float from_half(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu;
    uint32_t u;
    if (exp == 0) {
        if (man == 0) {
            u = sign;
        } else {  /* subnormal half: normalize */
            exp = 127 - 15 + 1;
            while (!(man & 0x400u)) { man <<= 1; exp--; }
            u = sign | (exp << 23) | ((man & 0x3FFu) << 13);
        }
    } else if (exp == 31) {
        u = sign | 0x7F800000u | (man << 13);
    } else {
        u = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}
#endif

static float from_bf16(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* bfloat16 bits of 0..15 */
static const uint16_t CODE_BF16[16] = {0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0,
                                       0x40E0, 0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150,
                                       0x4160, 0x4170};

/* Each row's sum of x over each group (float32, in input order): [rows, groups]. */
static void group_sums(const uint16_t *x, int64_t x_stride, int rows, int groups, float *sums) {
    for (int i = 0; i < rows; i++)
        for (int g = 0; g < groups; g++) {
            float s = 0.0f;
            for (int j = 0; j < GROUP; j++) s += from_bf16(x[i * x_stride + g * GROUP + j]);
            sums[i * groups + g] = s;
        }
}

#ifdef __AVX512BF16__

static void widen_group(const uint8_t *codes, uint16_t *buf) {
    const __m512i table = _mm512_castsi256_si512(
        _mm256_loadu_si256((const __m256i *)CODE_BF16));
    const __m512i nibble = _mm512_set1_epi16(0x0F);
    for (int q = 0; q < 8; q++) {
        __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(codes + 32 * q)));
        _mm512_store_si512((__m512i *)(buf + (2 * q) * 32),
                           _mm512_permutexvar_epi16(_mm512_and_si512(v, nibble), table));
        _mm512_store_si512((__m512i *)(buf + (2 * q + 1) * 32),
                           _mm512_permutexvar_epi16(_mm512_srli_epi16(v, 4), table));
    }
}

/* R rows (a constant where inlined) times one widened tile, group by group. */
static inline void tile_rows(const uint16_t *buf, const uint8_t *blocks, int groups,
                             const uint32_t *x, int64_t x_stride, const float *sums, float *y,
                             int64_t y_stride, int R, int width) {
    __m512 acc[ROWS], dot[ROWS];
    for (int i = 0; i < R; i++) acc[i] = _mm512_setzero_ps();
    for (int g = 0; g < groups; g++) {
        const uint16_t *gbuf = buf + (size_t)g * PAIRS * 32;
        const uint32_t *gx = x + g * PAIRS;
        for (int i = 0; i < R; i++) dot[i] = _mm512_setzero_ps();
        for (int p = 0; p < PAIRS; p++) {
            __m512bh w = (__m512bh)_mm512_load_si512((const __m512i *)(gbuf + p * 32));
            for (int i = 0; i < R; i++)
                dot[i] = _mm512_dpbf16_ps(dot[i], w,
                                          (__m512bh)_mm512_set1_epi32((int)gx[i * x_stride + p]));
        }
        const uint8_t *block = blocks + (size_t)g * BLOCK_BYTES;
        __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)block));
        __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(block + 32)));
        for (int i = 0; i < R; i++) {
            acc[i] = _mm512_fmadd_ps(dot[i], d, acc[i]);
            acc[i] = _mm512_fmadd_ps(m, _mm512_set1_ps(sums[i * groups + g]), acc[i]);
        }
    }
    __mmask16 mask = (__mmask16)((1u << width) - 1u);
    for (int i = 0; i < R; i++) _mm512_mask_storeu_ps(y + i * y_stride, mask, acc[i]);
}

#else  /* plain C: the same layout and arithmetic */

static void widen_group(const uint8_t *codes, uint16_t *buf) {
    for (int q = 0; q < 8; q++)
        for (int j = 0; j < 32; j++) {
            buf[(2 * q) * 32 + j] = CODE_BF16[codes[32 * q + j] & 0x0F];
            buf[(2 * q + 1) * 32 + j] = CODE_BF16[codes[32 * q + j] >> 4];
        }
}

static inline void tile_rows(const uint16_t *buf, const uint8_t *blocks, int groups,
                             const uint32_t *x, int64_t x_stride, const float *sums, float *y,
                             int64_t y_stride, int R, int width) {
    for (int i = 0; i < R; i++) {
        float acc[TILE] = {0};
        for (int g = 0; g < groups; g++) {
            const uint8_t *block = blocks + (size_t)g * BLOCK_BYTES;
            const uint16_t *gbuf = buf + (size_t)g * PAIRS * 32;
            float dot[TILE] = {0};
            for (int p = 0; p < PAIRS; p++) {
                uint32_t xp = x[i * x_stride + g * PAIRS + p];
                float x0 = from_bf16((uint16_t)(xp & 0xFFFFu));
                float x1 = from_bf16((uint16_t)(xp >> 16));
                for (int n = 0; n < TILE; n++) {
                    dot[n] = __builtin_fmaf(from_bf16(gbuf[p * 32 + 2 * n + 1]), x1, dot[n]);
                    dot[n] = __builtin_fmaf(from_bf16(gbuf[p * 32 + 2 * n]), x0, dot[n]);
                }
            }
            for (int n = 0; n < TILE; n++) {
                uint16_t hd, hm;
                memcpy(&hd, block + 2 * n, 2);
                memcpy(&hm, block + 32 + 2 * n, 2);
                acc[n] = __builtin_fmaf(dot[n], from_half(hd), acc[n]);
                acc[n] = __builtin_fmaf(from_half(hm), sums[i * groups + g], acc[n]);
            }
        }
        for (int n = 0; n < width; n++) y[i * y_stride + n] = acc[n];
    }
}

#endif

static void tile_all_rows(const uint16_t *buf, const uint8_t *blocks, int groups,
                          const uint32_t *x, int64_t x_stride, const float *sums, float *y,
                          int64_t y_stride, int rows, int width) {
    int i = 0;
    for (; i + ROWS <= rows; i += ROWS)
        tile_rows(buf, blocks, groups, x + i * x_stride, x_stride, sums + i * groups,
                  y + i * y_stride, y_stride, ROWS, width);
    switch (rows - i) {  /* constant row counts, so each call's loops unroll */
#define TAIL(r) case r: tile_rows(buf, blocks, groups, x + i * x_stride, x_stride, \
                                  sums + i * groups, y + i * y_stride, y_stride, r, width); break;
        TAIL(1) TAIL(2) TAIL(3) TAIL(4) TAIL(5) TAIL(6) TAIL(7)
#undef TAIL
        default: break;
    }
}

/* x: [rows, k] bf16 with row stride x_stride (elements, even); y: [rows, n] float32, row stride
 * y_stride; blocks: [ceil(n / 16), k / 32, 320] bytes. Returns 0, or -1 when out of memory. */
int ember_q4_linear(const uint16_t *x, int64_t x_stride, const uint8_t *blocks, float *y,
                    int64_t y_stride, int rows, int n, int k, int threads) {
    int tiles = (n + TILE - 1) / TILE, groups = k / GROUP;
    size_t buf_stride = ((size_t)k * TILE * 2 + 63) / 64 * 64;
    if (threads < 1) threads = 1;
    float *sums = malloc(sizeof(float) * (size_t)rows * (size_t)groups);
    uint8_t *bufs = aligned_alloc(64, buf_stride * (size_t)threads);
    if (!sums || !bufs) {
        free(sums);
        free(bufs);
        return -1;
    }
    group_sums(x, x_stride, rows, groups, sums);
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && tiles > 1)
    for (int t = 0; t < tiles; t++) {
        uint16_t *buf = (uint16_t *)(bufs + buf_stride * (size_t)omp_get_thread_num());
        const uint8_t *tile = blocks + (size_t)t * groups * BLOCK_BYTES;
        int width = n - t * TILE < TILE ? n - t * TILE : TILE;
        for (int g = 0; g < groups; g++)
            widen_group(tile + (size_t)g * BLOCK_BYTES + 64, buf + (size_t)g * PAIRS * 32);
        tile_all_rows(buf, tile, groups, (const uint32_t *)x, x_stride / 2, sums, y + t * TILE,
                      y_stride, rows, width);
    }
    free(sums);
    free(bufs);
    return 0;
}
