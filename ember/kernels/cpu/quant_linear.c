/* Quantized linear layers on the CPU: y[M, N] = x[M, K] @ W^T, x float32 (multiplied in
 * bfloat16, rounded to nearest even as torch rounds), W in 4- or 8-bit integer codes c with one
 * scale d and one offset m per 32 inputs (w = d * c + m), y float32.
 *
 * Layout (made by ember.kernels.cpu.quant_linear.pack): 16 outputs a tile; per tile and group of
 * 32 inputs one block: d[16] and m[16] as float16 (64 bytes), then the codes, ordered so that
 * they widen to registers of 32 bfloat16 values in the order AVX512-BF16's dot takes them: for
 * each of the 16 outputs a pair of adjacent inputs.
 * - 4 bits (codes 0..15, 320-byte blocks): 8 quads of 32 bytes, quad q holding inputs 4q..4q+3:
 *   byte j (output j / 2, input 4q + j % 2) has that code in its low nibble and the code of input
 *   4q + 2 + j % 2 in its high nibble.
 * - 8 bits (codes -128..127, 576-byte blocks): 16 pairs of 32 bytes, byte j of pair p the code of
 *   output j / 2, input 2p + j % 2.
 *
 * Per tile the codes are widened once into a buffer (exact small integers in bfloat16), then
 * every row of x, 12 rows at a time, takes each group's dot with them, summed from zero in
 * float32, and folds it into its 16 outputs as y = fma(dot, d, y), then y = fma(m, sum of the
 * group's x, y) (the group's sum of x as rounded, in a fixed tree: group_sum_tree). A row's
 * arithmetic is the same whatever the number of rows, so its result does not depend on the
 * batch it came in. A long batch (a prefill chunk) goes through the tiles ROW_BLOCK rows at a
 * time, so those rows stay in L2 while every tile passes over them (a 2,048-row gate_up: 24.2
 * against 28.4 ms with the tiles over all rows at once, one thread).
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
#define HEADER_BYTES 64
#define ROW_BLOCK 192  /* 192 rows of 1,536 bfloat16 inputs: 590 KB, inside a 1 MB L2 */
#define ROWS 12  /* 12 independent dot chains: the dot's latency hidden (8 left it exposed) */

int ember_quant_native(void) {
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

static uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x40u);  /* quiet NaN */
    u += 0x7FFFu + ((u >> 16) & 1u);  /* round to nearest even */
    return (uint16_t)(u >> 16);
}

/* The sum of a group's 32 rounded values, as a fixed tree: lanes j and j + 16 first, then
 * halves of what is left (the vector code's order; the plain C build adds the same way). */
static float group_sum_tree(float *t) {
    for (int width = 8; width >= 1; width /= 2)
        for (int j = 0; j < width; j++) t[j] += t[j + width];
    return t[0];
}

/* x rounded to bfloat16 into xb [rows, k] (contiguous), and each row's sum of it over each
 * group (float32, group_sum_tree's order) into sums [rows, groups]. */
static void round_and_sum(const float *x, int64_t x_stride, int rows, int k, uint16_t *xb,
                          float *sums, int threads) {
    int groups = k / GROUP;
    /* Rows are independent: the threads split them once there are enough to pay for it. */
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && rows >= 64)
    for (int i = 0; i < rows; i++) {
        const float *in = x + i * x_stride;
        uint16_t *out = xb + (int64_t)i * k;
        float t[16];
        for (int g = 0; g < groups; g++) {
#ifdef __AVX512BF16__
            /* to_bf16 on 16 lanes: round to nearest even, NaNs quieted */
            __m512 rounded[2];
            for (int h = 0; h < 2; h++) {
                __m512i u = _mm512_loadu_si512((const void *)(in + g * GROUP + 16 * h));
                __mmask16 nan = _mm512_cmpgt_epu32_mask(
                    _mm512_and_si512(u, _mm512_set1_epi32(0x7FFFFFFF)), _mm512_set1_epi32(0x7F800000));
                __m512i even = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
                __m512i r = _mm512_srli_epi32(
                    _mm512_add_epi32(u, _mm512_add_epi32(even, _mm512_set1_epi32(0x7FFF))), 16);
                r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
                _mm256_storeu_si256((__m256i *)(out + g * GROUP + 16 * h), _mm512_cvtepi32_epi16(r));
                rounded[h] = _mm512_castsi512_ps(_mm512_slli_epi32(r, 16));
            }
            _mm512_storeu_ps(t, _mm512_add_ps(rounded[0], rounded[1]));
#else
            for (int j = 0; j < GROUP; j++) out[g * GROUP + j] = to_bf16(in[g * GROUP + j]);
            for (int j = 0; j < 16; j++)
                t[j] = from_bf16(out[g * GROUP + j]) + from_bf16(out[g * GROUP + 16 + j]);
#endif
            sums[i * groups + g] = group_sum_tree(t);
        }
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

static void widen_group8(const uint8_t *codes, uint16_t *buf) {
    for (int p = 0; p < PAIRS; p++) {
        __m512 lo = _mm512_cvtepi32_ps(
            _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(codes + 32 * p))));
        __m512 hi = _mm512_cvtepi32_ps(
            _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(codes + 32 * p + 16))));
        _mm512_store_si512((__m512i *)(buf + p * 32), (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
}

#else  /* plain C: the same layout and arithmetic */

static void widen_group8(const uint8_t *codes, uint16_t *buf) {
    for (int j = 0; j < PAIRS * 32; j++) buf[j] = to_bf16((float)(int8_t)codes[j]);
}

static void widen_group(const uint8_t *codes, uint16_t *buf) {
    for (int q = 0; q < 8; q++)
        for (int j = 0; j < 32; j++) {
            buf[(2 * q) * 32 + j] = CODE_BF16[codes[32 * q + j] & 0x0F];
            buf[(2 * q + 1) * 32 + j] = CODE_BF16[codes[32 * q + j] >> 4];
        }
}

#endif

/* A block's codes (4 bits when the block is 320 bytes, else 8) widened into out. */
static inline void widen(const uint8_t *block, int block_bytes, uint16_t *out) {
    if (block_bytes == HEADER_BYTES + TILE * GROUP / 2)
        widen_group(block + HEADER_BYTES, out);
    else
        widen_group8(block + HEADER_BYTES, out);
}

#ifdef __AVX512BF16__

/* R rows (a constant where inlined) times one tile, group by group: from the widened tile in
 * buf, or (buf NULL: a single pass of rows) each group widened here as it comes. Always inlined,
 * so each row count gets its own unrolled code with the accumulators in registers. */
static inline __attribute__((always_inline)) void tile_rows(
        const uint16_t *buf, const uint8_t *blocks, int block_bytes, int groups, const uint32_t *x,
        int64_t x_stride, const float *sums, float *y, int64_t y_stride, int R, int width) {
    __m512 acc[ROWS], dot[ROWS];
    uint16_t local[PAIRS * 32] __attribute__((aligned(64)));
    for (int i = 0; i < R; i++) acc[i] = _mm512_setzero_ps();
    for (int g = 0; g < groups; g++) {
        const uint16_t *gbuf = buf ? buf + (size_t)g * PAIRS * 32 : local;
        if (!buf) widen(blocks + (size_t)g * block_bytes, block_bytes, local);
        const uint32_t *gx = x + g * PAIRS;
        for (int i = 0; i < R; i++) dot[i] = _mm512_setzero_ps();
        for (int p = 0; p < PAIRS; p++) {
            __m512bh w = (__m512bh)_mm512_load_si512((const __m512i *)(gbuf + p * 32));
            for (int i = 0; i < R; i++)
                dot[i] = _mm512_dpbf16_ps(dot[i], w,
                                          (__m512bh)_mm512_set1_epi32((int)gx[i * x_stride + p]));
        }
        const uint8_t *block = blocks + (size_t)g * block_bytes;
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

#else

static inline void tile_rows(const uint16_t *buf, const uint8_t *blocks, int block_bytes,
                             int groups, const uint32_t *x, int64_t x_stride, const float *sums,
                             float *y, int64_t y_stride, int R, int width) {
    uint16_t local[PAIRS * 32];
    for (int i = 0; i < R; i++) {
        float acc[TILE] = {0};
        for (int g = 0; g < groups; g++) {
            const uint8_t *block = blocks + (size_t)g * block_bytes;
            const uint16_t *gbuf = buf ? buf + (size_t)g * PAIRS * 32 : local;
            if (!buf) widen(block, block_bytes, local);
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

static void tile_all_rows(const uint16_t *buf, const uint8_t *blocks, int block_bytes,
                          int groups, const uint32_t *x, int64_t x_stride, const float *sums,
                          float *y, int64_t y_stride, int rows, int width) {
    int i = 0;
    for (; i + ROWS <= rows; i += ROWS)
        tile_rows(buf, blocks, block_bytes, groups, x + i * x_stride, x_stride, sums + i * groups,
                  y + i * y_stride, y_stride, ROWS, width);
    switch (rows - i) {  /* constant row counts, so each call's loops unroll */
#define TAIL(r) case r: tile_rows(buf, blocks, block_bytes, groups, x + i * x_stride, x_stride, \
                                  sums + i * groups, y + i * y_stride, y_stride, r, width); break;
        TAIL(1) TAIL(2) TAIL(3) TAIL(4) TAIL(5) TAIL(6) TAIL(7) TAIL(8) TAIL(9) TAIL(10) TAIL(11)
#undef TAIL
        default: break;
    }
}

/* x: [rows, k] float32 with row stride x_stride; y: [rows, n] float32 with row stride
 * y_stride; blocks: [ceil(n / 16), k / 32, block] bytes, bits 4 or 8. Returns 0, -1 when out of
 * memory, -2 for other bits. */
int ember_quant_linear(const float *x, int64_t x_stride, const uint8_t *blocks, int bits,
                       float *y, int64_t y_stride, int rows, int n, int k, int threads) {
    if (bits != 4 && bits != 8) return -2;
    int tiles = (n + TILE - 1) / TILE, groups = k / GROUP;
    int block_bytes = HEADER_BYTES + TILE * GROUP * bits / 8;
    size_t buf_stride = ((size_t)k * TILE * 2 + 63) / 64 * 64;
    if (threads < 1) threads = 1;
    float *sums = malloc(sizeof(float) * (size_t)rows * (size_t)groups + 1);
    uint16_t *xb = malloc(sizeof(uint16_t) * (size_t)rows * (size_t)k + 1);
    uint8_t *bufs = aligned_alloc(64, buf_stride * (size_t)threads);
    if (!sums || !xb || !bufs) {
        free(sums);
        free(xb);
        free(bufs);
        return -1;
    }
    round_and_sum(x, x_stride, rows, k, xb, sums, threads);
    for (int r0 = 0; r0 < rows; r0 += ROW_BLOCK) {
        int block_rows = rows - r0 < ROW_BLOCK ? rows - r0 : ROW_BLOCK;
        const uint32_t *block_x = (const uint32_t *)xb + (int64_t)r0 * (k / 2);
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && tiles > 1)
        for (int t = 0; t < tiles; t++) {
            uint16_t *buf = (uint16_t *)(bufs + buf_stride * (size_t)omp_get_thread_num());
            const uint8_t *tile = blocks + (size_t)t * groups * block_bytes;
            int width = n - t * TILE < TILE ? n - t * TILE : TILE;
            /* One pass of rows widens each group as it goes (the codes stay in L1); more passes
             * widen the tile once into buf and reuse it. The same arithmetic either way. */
            int passes = (block_rows + ROWS - 1) / ROWS;
            if (passes > 1)
                for (int g = 0; g < groups; g++)
                    widen(tile + (size_t)g * block_bytes, block_bytes,
                          buf + (size_t)g * PAIRS * 32);
            tile_all_rows(passes > 1 ? buf : NULL, tile, block_bytes, groups, block_x, k / 2,
                          sums + (int64_t)r0 * groups, y + (int64_t)r0 * y_stride + t * TILE,
                          y_stride, block_rows, width);
        }
    }
    free(sums);
    free(xb);
    free(bufs);
    return 0;
}
