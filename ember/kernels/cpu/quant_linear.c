/* Quantized linear layers on the CPU: y[M, N] = x[M, K] @ W^T, x float32, W in 4- or 8-bit
 * integer codes c with one scale d and one offset m per 32 inputs (w = d * c + m), y float32.
 *
 * x is quantized as llama.cpp quantizes activations for its integer dot products: per row and
 * group of 32 inputs, s = max|x| / 127 and q = round(x * (1 / s)) to nearest even, in [-127, 127]
 * (float32 arithmetic, the same in every build). A group's dot of q with the codes is then an
 * exact integer, whatever instructions sum it, and the group adds
 *     y += d * (dot * s) + m * (s * sum(q))        (two float32 fmas, in this order)
 * to each of its 16 outputs. A row's arithmetic is the same whatever the number of rows or
 * threads, so its result does not depend on the batch it came in, and every build (AVX512-VNNI,
 * AVX2, plain C) gives the same bits.
 *
 * Layout (made by ember.kernels.cpu.quant_linear.pack): 16 outputs a tile; per tile and group one
 * block: d[16] and m[16] as float16 (64 bytes), then the codes in quads of 4 adjacent inputs per
 * output, the order an integer dot instruction takes them (a 32-bit lane per output):
 * - 4 bits (codes 0..15, 320-byte blocks): 4 chunks of 64 bytes; byte 4n + i of chunk c holds
 *   the code of output n, input 4c + i in its low nibble and of input 16 + 4c + i in its high one.
 * - 8 bits (codes -128..127 stored plus 128, 576-byte blocks): 8 chunks of 64 bytes; byte 4n + i
 *   of chunk c is output n, input 4c + i. (The dot of those unsigned bytes less 128 * sum(q).)
 *
 * Per tile the codes are unpacked to 8 chunks of unsigned bytes (inputs 4c..4c+3 in chunk c) once
 * when several passes of rows need them, else group by group as they come.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define EMBER_VNNI 1
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#define EMBER_AVX2 1
#include <immintrin.h>
#endif

#define TILE 16
#define GROUP 32
#define QUADS (GROUP / 4)
#define HEADER_BYTES 64
#define CHUNK 64                    /* bytes of one quad for 16 outputs */
#define UNPACKED (QUADS * CHUNK)    /* bytes of one group's unpacked codes */
#define ROWS 8

/* 2: AVX512-VNNI, 1: AVX2, 0: plain C. */
int ember_quant_native(void) {
#if defined(EMBER_VNNI)
    return 2;
#elif defined(EMBER_AVX2)
    return 1;
#else
    return 0;
#endif
}

/* A row's groups quantized: the codes, and per group the scale s and s * sum(q) (and sum(q)). */
typedef struct {
    const int8_t *q;        /* [rows, k] */
    const float *scale;     /* [rows, groups] */
    const float *offset;    /* [rows, groups]: s * sum(q), multiplied with the weight's offset */
    const int32_t *sum;     /* [rows, groups]: sum(q) */
    int64_t q_stride;       /* k */
    int groups;
} Activations;

/* One group of 32 inputs quantized into q; returns sum(q) and sets *scale. A scale below float32's
 * smallest normal (so its inverse could overflow) quantizes the group to zeros. The vector
 * versions do the same float32 steps (the largest magnitude is exact in any order, and the
 * conversion rounds to nearest even as nearbyintf does), so every build gives the same codes. */
static inline int32_t quantize_group(const float *x, int8_t *q, float *scale) {
#if defined(EMBER_VNNI)
    const __m512 sign = _mm512_set1_ps(-0.0f);
    __m512 lo = _mm512_loadu_ps(x), hi = _mm512_loadu_ps(x + 16);
    float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, lo),
                                                    _mm512_andnot_ps(sign, hi)));
#elif defined(EMBER_AVX2)
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 v[4], top = _mm256_setzero_ps();
    for (int j = 0; j < 4; j++) {
        v[j] = _mm256_loadu_ps(x + 8 * j);
        top = _mm256_max_ps(top, _mm256_andnot_ps(sign, v[j]));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
    float amax = _mm_cvtss_f32(m4);
#else
    float amax = 0.0f;
    for (int j = 0; j < GROUP; j++) amax = fmaxf(amax, fabsf(x[j]));
#endif
    float s = amax / 127.0f;
    float inverse = s >= FLT_MIN ? 1.0f / s : 0.0f;
    *scale = s;
#if defined(EMBER_VNNI)
    const __m512i bound = _mm512_set1_epi32(127);
    __m512 f = _mm512_set1_ps(inverse);
    __m512i a = _mm512_cvtps_epi32(_mm512_mul_ps(lo, f));
    __m512i b = _mm512_cvtps_epi32(_mm512_mul_ps(hi, f));
    a = _mm512_max_epi32(_mm512_min_epi32(a, bound), _mm512_sub_epi32(_mm512_setzero_si512(), bound));
    b = _mm512_max_epi32(_mm512_min_epi32(b, bound), _mm512_sub_epi32(_mm512_setzero_si512(), bound));
    _mm_storeu_si128((__m128i *)q, _mm512_cvtepi32_epi8(a));
    _mm_storeu_si128((__m128i *)(q + 16), _mm512_cvtepi32_epi8(b));
    return _mm512_reduce_add_epi32(_mm512_add_epi32(a, b));
#elif defined(EMBER_AVX2)
    const __m256i bound = _mm256_set1_epi32(127), low = _mm256_set1_epi32(-127);
    __m256 f = _mm256_set1_ps(inverse);
    __m256i total = _mm256_setzero_si256();
    int32_t codes[GROUP];
    for (int j = 0; j < 4; j++) {
        __m256i c = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], f));
        c = _mm256_max_epi32(_mm256_min_epi32(c, bound), low);
        total = _mm256_add_epi32(total, c);
        _mm256_storeu_si256((__m256i *)(codes + 8 * j), c);
    }
    for (int j = 0; j < GROUP; j++) q[j] = (int8_t)codes[j];
    __m128i t4 = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
    t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0x4E));
    t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0xB1));
    return _mm_cvtsi128_si32(t4);
#else
    int32_t total = 0;
    for (int j = 0; j < GROUP; j++) {
        float v = nearbyintf(x[j] * inverse);
        v = v > 127.0f ? 127.0f : (v < -127.0f ? -127.0f : v);
        q[j] = (int8_t)v;
        total += q[j];
    }
    return total;
#endif
}

static void quantize_rows(const float *x, int64_t x_stride, int rows, int k, int8_t *q,
                          float *scale, float *offset, int32_t *sum, int threads) {
    int groups = k / GROUP;
    /* Rows are independent: the threads split them once there are enough to pay for it. */
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && rows >= 64)
    for (int i = 0; i < rows; i++)
        for (int g = 0; g < groups; g++) {
            int at = i * groups + g;
            int32_t total = quantize_group(x + i * x_stride + g * GROUP,
                                           q + (int64_t)i * k + g * GROUP, &scale[at]);
            offset[at] = scale[at] * (float)total;
            sum[at] = total;
        }
}

/* One group's 4-bit codes as 8 chunks of unsigned bytes (chunk c: inputs 4c..4c+3 of each
 * output), the layout 8-bit codes have in their block. */
static void unpack_group(const uint8_t *codes, uint8_t *out) {
    for (int c = 0; c < 4; c++)
        for (int j = 0; j < CHUNK; j++) {
            out[c * CHUNK + j] = codes[c * CHUNK + j] & 0x0F;
            out[(c + 4) * CHUNK + j] = codes[c * CHUNK + j] >> 4;
        }
}

/* Group g's unpacked codes: 8-bit ones as they are in their block; 4-bit ones from the tile
 * unpacked in buf, or (buf NULL) unpacked now into local. */
static inline const uint8_t *group_codes(const uint8_t *buf, const uint8_t *block, int g, int bits,
                                         uint8_t *local) {
    if (bits == 8) return block + HEADER_BYTES;
    if (buf) return buf + (size_t)g * UNPACKED;
    unpack_group(block + HEADER_BYTES, local);
    return local;
}

#if !defined(EMBER_VNNI) && !defined(EMBER_AVX2)
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

#if defined(EMBER_VNNI)

/* Quad c of group g's codes for 16 outputs (64 unsigned bytes): from the tile unpacked in buf,
 * else from the block (4-bit codes unpacked here: the low nibbles hold quads 0-3, the high
 * ones 4-7). */
static inline __attribute__((always_inline)) __m512i quad_codes(const uint8_t *buf,
                                                                const uint8_t *codes, int g,
                                                                int c, int bits) {
    if (bits == 8) return _mm512_loadu_si512((const __m512i *)(codes + c * CHUNK));
    if (buf) return _mm512_load_si512((const __m512i *)(buf + (size_t)g * UNPACKED + c * CHUNK));
    __m512i v = _mm512_loadu_si512((const __m512i *)(codes + (c & 3) * CHUNK));
    if (c >= 4) v = _mm512_srli_epi16(v, 4);
    return _mm512_and_si512(v, _mm512_set1_epi8(0x0F));
}

/* R rows times one tile, group by group (R and bits constants where inlined, so the loops
 * unroll and the accumulators stay in registers). */
static inline __attribute__((always_inline)) void tile_rows(
        const uint8_t *buf, const uint8_t *blocks, int bits, int block_bytes, Activations a,
        float *y, int64_t y_stride, int R, int width) {
    __m512 acc[ROWS];
    for (int i = 0; i < R; i++) acc[i] = _mm512_setzero_ps();
    for (int g = 0; g < a.groups; g++) {
        const uint8_t *block = blocks + (size_t)g * block_bytes;
        const int8_t *gq = a.q + g * GROUP;
        __m512i dot[ROWS];
        for (int i = 0; i < R; i++) dot[i] = _mm512_setzero_si512();
#pragma GCC unroll 8
        for (int c = 0; c < QUADS; c++) {
            __m512i w = quad_codes(buf, block + HEADER_BYTES, g, c, bits);
            for (int i = 0; i < R; i++) {
                int32_t quad;
                memcpy(&quad, gq + i * a.q_stride + 4 * c, 4);
                dot[i] = _mm512_dpbusd_epi32(dot[i], w, _mm512_set1_epi32(quad));
            }
        }
        __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)block));
        __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(block + 32)));
        for (int i = 0; i < R; i++) {
            int at = i * a.groups + g;
            if (bits == 8) dot[i] = _mm512_sub_epi32(dot[i], _mm512_set1_epi32(128 * a.sum[at]));
            __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(dot[i]), _mm512_set1_ps(a.scale[at]));
            acc[i] = _mm512_fmadd_ps(d, t, acc[i]);
            acc[i] = _mm512_fmadd_ps(m, _mm512_set1_ps(a.offset[at]), acc[i]);
        }
    }
    __mmask16 mask = (__mmask16)((1u << width) - 1u);
    for (int i = 0; i < R; i++) _mm512_mask_storeu_ps(y + i * y_stride, mask, acc[i]);
}

#elif defined(EMBER_AVX2)

/* The same with 256-bit registers: each tile in two halves of 8 outputs. 4-bit codes: the 8
 * quads' byte-pair products (at most 2 * 15 * 127 each) sum in 16 bits without overflow. 8-bit
 * codes: the sign trick (|c| times q with c's sign) keeps each pair within 16 bits. */
static inline void tile_rows(const uint8_t *buf, const uint8_t *blocks, int bits, int block_bytes,
                             Activations a, float *y, int64_t y_stride, int R, int width) {
    __m256 acc[2][ROWS];
    uint8_t local[UNPACKED] __attribute__((aligned(64)));
    const __m256i ones = _mm256_set1_epi16(1), bias = _mm256_set1_epi8((char)0x80);
    for (int h = 0; h < 2; h++)
        for (int i = 0; i < R; i++) acc[h][i] = _mm256_setzero_ps();
    for (int g = 0; g < a.groups; g++) {
        const uint8_t *block = blocks + (size_t)g * block_bytes;
        const uint8_t *gw = group_codes(buf, block, g, bits, local);
        for (int h = 0; h < 2; h++) {
            __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(block + 16 * h)));
            __m256 m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(block + 32 + 16 * h)));
            for (int i = 0; i < R; i++) {
                const int8_t *gq = a.q + i * a.q_stride + g * GROUP;
                __m256i dot;
                if (bits == 4) {
                    __m256i pairs = _mm256_setzero_si256();
                    for (int c = 0; c < QUADS; c++) {
                        int32_t quad;
                        memcpy(&quad, gq + 4 * c, 4);
                        __m256i w = _mm256_loadu_si256((const __m256i *)(gw + c * CHUNK + 32 * h));
                        pairs = _mm256_add_epi16(pairs,
                                                 _mm256_maddubs_epi16(w, _mm256_set1_epi32(quad)));
                    }
                    dot = _mm256_madd_epi16(pairs, ones);
                } else {
                    dot = _mm256_setzero_si256();
                    for (int c = 0; c < QUADS; c++) {
                        int32_t quad;
                        memcpy(&quad, gq + 4 * c, 4);
                        __m256i w = _mm256_xor_si256(  /* the signed code */
                            _mm256_loadu_si256((const __m256i *)(gw + c * CHUNK + 32 * h)), bias);
                        __m256i p = _mm256_maddubs_epi16(
                            _mm256_sign_epi8(w, w), _mm256_sign_epi8(_mm256_set1_epi32(quad), w));
                        dot = _mm256_add_epi32(dot, _mm256_madd_epi16(p, ones));
                    }
                }
                int at = i * a.groups + g;
                __m256 t = _mm256_mul_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(a.scale[at]));
                acc[h][i] = _mm256_fmadd_ps(d, t, acc[h][i]);
                acc[h][i] = _mm256_fmadd_ps(m, _mm256_set1_ps(a.offset[at]), acc[h][i]);
            }
        }
    }
    for (int i = 0; i < R; i++) {
        float out[TILE];
        _mm256_storeu_ps(out, acc[0][i]);
        _mm256_storeu_ps(out + 8, acc[1][i]);
        memcpy(y + i * y_stride, out, sizeof(float) * (size_t)width);
    }
}

#else  /* plain C: the same arithmetic */

static inline void tile_rows(const uint8_t *buf, const uint8_t *blocks, int bits, int block_bytes,
                             Activations a, float *y, int64_t y_stride, int R, int width) {
    uint8_t local[UNPACKED];
    for (int i = 0; i < R; i++) {
        float acc[TILE] = {0};
        for (int g = 0; g < a.groups; g++) {
            const uint8_t *block = blocks + (size_t)g * block_bytes;
            const uint8_t *gw = group_codes(buf, block, g, bits, local);
            const int8_t *gq = a.q + i * a.q_stride + g * GROUP;
            int at = i * a.groups + g;
            for (int n = 0; n < TILE; n++) {
                int32_t dot = 0;
                for (int c = 0; c < QUADS; c++)
                    for (int j = 0; j < 4; j++) dot += gw[c * CHUNK + 4 * n + j] * gq[4 * c + j];
                if (bits == 8) dot -= 128 * a.sum[at];
                uint16_t hd, hm;
                memcpy(&hd, block + 2 * n, 2);
                memcpy(&hm, block + 32 + 2 * n, 2);
                float t = (float)dot * a.scale[at];
                acc[n] = fmaf(from_half(hd), t, acc[n]);
                acc[n] = fmaf(from_half(hm), a.offset[at], acc[n]);
            }
        }
        for (int n = 0; n < width; n++) y[i * y_stride + n] = acc[n];
    }
}

#endif

/* All rows times one tile, ROWS at a time; every call of tile_rows has constant bits and row
 * counts, so each is compiled on its own with its loops unrolled. */
static void tile_all_rows(const uint8_t *buf, const uint8_t *blocks, int bits, int block_bytes,
                          Activations a, float *y, int64_t y_stride, int rows, int width) {
    int i = 0;
    for (; i + ROWS <= rows; i += ROWS) {
        if (bits == 4)
            tile_rows(buf, blocks, 4, block_bytes, a, y + i * y_stride, y_stride, ROWS, width);
        else
            tile_rows(buf, blocks, 8, block_bytes, a, y + i * y_stride, y_stride, ROWS, width);
        a.q += ROWS * a.q_stride;
        a.scale += ROWS * a.groups;
        a.offset += ROWS * a.groups;
        a.sum += ROWS * a.groups;
    }
    switch ((rows - i) * 2 + (bits == 8)) {
#define TAIL(r) \
        case 2 * r: tile_rows(buf, blocks, 4, block_bytes, a, y + i * y_stride, y_stride, r, \
                              width); break; \
        case 2 * r + 1: tile_rows(buf, blocks, 8, block_bytes, a, y + i * y_stride, y_stride, r, \
                                  width); break;
        TAIL(1) TAIL(2) TAIL(3) TAIL(4) TAIL(5) TAIL(6) TAIL(7)
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
    size_t buf_stride = (size_t)groups * UNPACKED;
    size_t per_row_group = (size_t)rows * (size_t)groups;
    if (threads < 1) threads = 1;
    int8_t *q = aligned_alloc(64, ((size_t)rows * (size_t)k + 63) / 64 * 64 + 64);
    float *scales = malloc(sizeof(float) * 2 * per_row_group + 1);
    int32_t *sums = malloc(sizeof(int32_t) * per_row_group + 1);
    uint8_t *bufs = aligned_alloc(64, buf_stride * (size_t)threads);
    if (!q || !scales || !sums || !bufs) {
        free(q);
        free(scales);
        free(sums);
        free(bufs);
        return -1;
    }
    quantize_rows(x, x_stride, rows, k, q, scales, scales + per_row_group, sums, threads);
    Activations a = {q, scales, scales + per_row_group, sums, k, groups};
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && tiles > 1)
    for (int t = 0; t < tiles; t++) {
        uint8_t *buf = bufs + buf_stride * (size_t)omp_get_thread_num();
        const uint8_t *tile = blocks + (size_t)t * groups * block_bytes;
        int width = n - t * TILE < TILE ? n - t * TILE : TILE;
        /* 4-bit codes: one pass of rows unpacks each group as it goes (the codes stay in L1);
         * more passes unpack the tile once into buf and reuse it. The same arithmetic either
         * way. 8-bit codes are read as they are. */
        int unpack_tile = bits == 4 && rows > ROWS;
        if (unpack_tile)
            for (int g = 0; g < groups; g++)
                unpack_group(tile + (size_t)g * block_bytes + HEADER_BYTES,
                             buf + (size_t)g * UNPACKED);
        tile_all_rows(unpack_tile ? buf : NULL, tile, bits, block_bytes, a, y + t * TILE,
                      y_stride, rows, width);
    }
    free(q);
    free(scales);
    free(sums);
    free(bufs);
    return 0;
}
