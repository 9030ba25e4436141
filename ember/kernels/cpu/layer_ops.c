/* A decoder layer's small ops on the CPU in float32, one call each instead of a dozen torch
 * calls: on a small model a decode step is bound by the number of calls, not their work.
 *
 * - RMSNorm, optionally after adding the residual (the residual stream written back in place),
 *   in HF's order: h * rsqrt(mean(h^2) + eps), then times the weight;
 * - rotary (rotate_half convention) of q's and k's heads in place;
 * - SiLU-and-mul of a fused gate_up output;
 * - storing a step's keys and values into the paged cache at their slots;
 * - decode attention straight from the paged cache through the block table (one query per
 *   request, GQA, sliding window, logit soft-capping), without gathering the blocks.
 *
 * Built with -ffp-contract=off: rotary is then bit for bit torch's (products rounded before the
 * sum). The reductions (the norm's mean, the attention's dots and softmax) differ from torch's
 * in summation order, so they agree to rounding, not bit for bit.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <omp.h>
#include <string.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

/* exp(v) to ~1 ulp in branch-free C that the compiler vectorizes (glibc's expf is not, without
 * -ffast-math): 2^n * p(r), n = round(v / ln 2), r = v - n ln 2 in two parts, p of degree 6. */
static inline float fast_exp(float v) {
    v = v < -87.3f ? -87.3f : (v > 88.7f ? 88.7f : v);
    const float n = nearbyintf(v * 1.44269504088896341f);
    const float r = (v - n * 0.693359375f) + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* out[r] = w * (h * rsqrt(mean(h^2) + eps)) with h = x[r] (+ residual[r], written to x[r]).
 * Row r of x starts at (r / inner) * outer_stride + (r % inner) * x_stride: the heads of a
 * strided [tokens, heads, dim] view (inner = heads) as well as plain rows (inner = rows). */
void ember_rms_norm(float *x, int64_t x_stride, int64_t inner, int64_t outer_stride,
                    const float *residual, int64_t res_stride, const float *weight, float *out,
                    int64_t out_stride, int64_t rows, int64_t dim, float eps, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && rows * dim >= 65536)
    for (int64_t r = 0; r < rows; r++) {
        float *h = x + (r / inner) * outer_stride + (r % inner) * x_stride;
        float *o = out + r * out_stride;
        float sum = 0.0f;
        if (residual) {
            const float *res = residual + r * res_stride;
#pragma omp simd reduction(+ : sum)
            for (int64_t i = 0; i < dim; i++) {
                float v = h[i] + res[i];
                h[i] = v;
                sum += v * v;
            }
        } else {
#pragma omp simd reduction(+ : sum)
            for (int64_t i = 0; i < dim; i++) sum += h[i] * h[i];
        }
        float inv = 1.0f / sqrtf(sum / (float)dim + eps);
#pragma omp simd
        for (int64_t i = 0; i < dim; i++) o[i] = weight[i] * (h[i] * inv);
    }
}

static void rotate_heads(float *x, int64_t heads, int64_t head_size, int64_t half,
                         const float *c, const float *s) {
    for (int64_t hd = 0; hd < heads; hd++) {
        float *x1 = x + hd * head_size, *x2 = x1 + half;
#pragma omp simd
        for (int64_t i = 0; i < half; i++) {
            float a = x1[i], b = x2[i];
            float ac = a * c[i], bs = b * s[i], bc = b * c[i], as = a * s[i];
            x1[i] = ac - bs;
            x2[i] = bc + as;
        }
    }
}

/* q [T, q_heads, head_size] and k [T, k_heads, head_size] (row strides given, heads
 * contiguous) rotated in place over their first rotary_dim dims; cos/sin [T, rotary_dim / 2]
 * contiguous. */
void ember_rotary(float *q, int64_t q_stride, int64_t q_heads, float *k, int64_t k_stride,
                  int64_t k_heads, int64_t tokens, int64_t head_size, int64_t rotary_dim,
                  const float *cos_t, const float *sin_t, int threads) {
    const int64_t half = rotary_dim / 2;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && tokens >= 64)
    for (int64_t t = 0; t < tokens; t++) {
        const float *c = cos_t + t * half, *s = sin_t + t * half;
        rotate_heads(q + t * q_stride, q_heads, head_size, half, c, s);
        rotate_heads(k + t * k_stride, k_heads, head_size, half, c, s);
    }
}

/* out[r, i] = silu(x[r, i]) * x[r, d + i], silu(v) = v / (1 + exp(-v)). */
void ember_silu_and_mul(const float *x, int64_t x_stride, float *out, int64_t out_stride,
                        int64_t rows, int64_t d, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && rows * d >= 65536)
    for (int64_t r = 0; r < rows; r++) {
        const float *g = x + r * x_stride, *u = g + d;
        float *o = out + r * out_stride;
#pragma omp simd
        for (int64_t i = 0; i < d; i++) o[i] = g[i] / (1.0f + fast_exp(-g[i])) * u[i];
    }
}

/* cache [2, slots, width] (width = kv_heads * head_size); key/value rows of `width` floats
 * (row strides given) go to their slot; a negative slot is skipped (padding). */
void ember_store_kv(const float *key, int64_t k_stride, const float *value, int64_t v_stride,
                    float *cache, int64_t num_slots, const int64_t *slots, int64_t rows,
                    int64_t width) {
    float *kc = cache, *vc = cache + num_slots * width;
    for (int64_t r = 0; r < rows; r++) {
        int64_t slot = slots[r];
        if (slot < 0) continue;
        const float *k = key + r * k_stride, *v = value + r * v_stride;
        float *kd = kc + slot * width, *vd = vc + slot * width;
        for (int64_t i = 0; i < width; i++) {
            kd[i] = k[i];
            vd[i] = v[i];
        }
    }
}

/* Software prefetch a fixed distance ahead of a request's reads. The blocks of a request lie
 * anywhere in the cache, where the hardware prefetcher does not follow, and one core has few
 * misses in flight: waiting for each block as it is reached held the kernel to 5 GB/s on the
 * development machine, a quarter of what one core streams. The reads are the keys of positions
 * start..seq-1, then their values, as one sequence of rows (the values' first rows arrive while
 * the last scores are computed). The cursor runs LOOKAHEAD_ROWS rows ahead and moves a few
 * lines at a time, as the reads do, asking for each line into L2 (locality 2: prefetcht1 on
 * x86), not L1, whose few miss buffers then stay free for the reads themselves: the next
 * block's lines asked for into L1 all at once, as before, ran at 5 GB/s; this cursor into L1
 * at 6-7.5, into L2 at 9.5-11 (benchmarks/cpu_quant.py, attention). */
typedef struct Lookahead {
    const char *kc, *vc;
    const int32_t *table;
    int64_t block_size, row_bytes_apart, start, len, row_lines;
    int64_t row, line;  /* the next line to ask for: row (of 2 * len), line within it */
    const char *address;  /* of that row */
    struct Lookahead *then;  /* past the end: the reads of the task likely next (or NULL) */
} Lookahead;

#define LOOKAHEAD_ROWS 32

/* A decode-attention task: its request, its first kv head and its keys [start, seq). */
typedef struct TaskSpan {
    int64_t req, kv0, start, seq;
} TaskSpan;

static inline TaskSpan task_span(int64_t task, int64_t tasks_per_req, int64_t per_task,
                                 const int32_t *seq_lens, int64_t window) {
    TaskSpan span;
    span.req = task / tasks_per_req;
    span.kv0 = (task % tasks_per_req) * per_task;
    span.seq = seq_lens[span.req];
    span.start = (window > 0 && span.seq > window) ? span.seq - window : 0;
    return span;
}

static inline void lookahead_seek(Lookahead *a, int64_t row) {
    a->row = row;
    a->line = 0;
    if (row >= 2 * a->len) return;
    const int64_t pos = a->start + (row < a->len ? row : row - a->len);
    a->address = (row < a->len ? a->kc : a->vc)
        + ((int64_t)a->table[pos / a->block_size] * a->block_size + pos % a->block_size)
              * a->row_bytes_apart;
}

static inline void lookahead_init(Lookahead *a, const float *kc, const float *vc,
                                  const int32_t *table, int64_t block_size, int64_t token_stride,
                                  int64_t start, int64_t len, int64_t row_bytes) {
    a->kc = (const char *)kc;
    a->vc = (const char *)vc;
    a->table = table;
    a->block_size = block_size;
    a->row_bytes_apart = token_stride * 4;
    a->start = start;
    a->len = len;
    a->row_lines = (row_bytes + 63) / 64;
    a->then = NULL;
    lookahead_seek(a, 0);
}

/* Ask for the next `lines` lines of the sequence (nothing past its end). */
static inline void lookahead_advance(Lookahead *a, int64_t lines) {
    for (; lines > 0; lines--) {
        if (a->row >= 2 * a->len) {
            if (a->then != NULL && a->then->row < 2 * a->then->len)
                lookahead_advance(a->then, lines);
            return;
        }
        __builtin_prefetch(a->address + a->line * 64, 0, 2);
        if (++a->line == a->row_lines) lookahead_seek(a, a->row + 1);
    }
}

#ifdef __AVX512F__
/* The lane sums of 16 vectors as one vector (element j = the sum of a[j]), by a transpose tree:
 * ~3 instructions a vector instead of a horizontal sum's ~8. */
static inline __m512 sum16(const __m512 *a) {
    __m512 b[8], c[4];
    for (int i = 0; i < 8; i++)  /* per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] */
        b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                             _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; i++)  /* per lane: the lane sums of a[4i..4i+3] */
        c[i] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0xEE));
    __m512 d0 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88),
                              _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
    __m512 d1 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], 0x88),
                              _mm512_shuffle_f32x4(c[2], c[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(d0, d1, 0x88), _mm512_shuffle_f32x4(d0, d1, 0xDD));
}

/* The scores of `rows` query heads (q, rows x d, d a multiple of 16) over keys start..seq-1,
 * 16 keys at a time: each key's dot in a vector of 16 partial sums, the 16 reduced together.
 * A key's sum runs in the same order wherever it falls, so a score does not depend on the
 * batch. */
static inline __attribute__((always_inline)) void scores_avx512(
    const float *restrict q, const float *restrict kc, const int32_t *restrict table,
    int64_t block_size, int64_t token_stride, int64_t start, int64_t seq, int64_t rows,
    int64_t group, int64_t d, float scale, float *restrict scores, Lookahead *ahead) {
    const int64_t len = seq - start;
    const float *keys[16];
    int64_t block = start / block_size, in_block = start % block_size;
    for (int64_t t0 = start; t0 < seq; t0 += 16) {
        const int n = seq - t0 < 16 ? (int)(seq - t0) : 16;
        for (int j = 0; j < n; j++) {  /* walk the block table, no division a key */
            keys[j] = kc + ((int64_t)table[block] * block_size + in_block) * token_stride;
            if (++in_block == block_size) {
                in_block = 0;
                block++;
            }
        }
        for (int j = n; j < 16; j++) keys[j] = keys[0];  /* padding: computed, not stored */
        /* n rows read: the cursor moves as many, spread over the heads. */
        const int64_t per_head = (n * ahead->row_lines + rows - 1) / rows;
        for (int64_t h = 0; h < rows; h++) {
            lookahead_advance(ahead, per_head);
            const float *restrict qh = q + h * d;
            const int64_t off = (h / group) * d;
            __m512 acc[16];
            for (int j = 0; j < 16; j++) acc[j] = _mm512_setzero_ps();
            for (int64_t c = 0; c < d; c += 16) {
                const __m512 qv = _mm512_loadu_ps(qh + c);
                for (int j = 0; j < 16; j++)
                    acc[j] = _mm512_fmadd_ps(qv, _mm512_loadu_ps(keys[j] + off + c), acc[j]);
            }
            _mm512_mask_storeu_ps(scores + h * len + (t0 - start), (__mmask16)((1u << n) - 1u),
                                  _mm512_mul_ps(sum16(acc), _mm512_set1_ps(scale)));
        }
    }
}
#endif

/* One request's kv heads kv0..kv0+nkv-1: their queries (q, nkv * group rows of d, local) over
 * keys start..seq-1, into o. Each key row is read once, for all the heads (front to back, as
 * the cache lays them out). scores holds nkv * group * (seq - start) floats, acc the sums. The
 * queries and sums stay in local (restrict) buffers so that the loops keep them in registers;
 * a head's arithmetic does not depend on nkv. */
static inline __attribute__((always_inline)) void attend_heads(
    const float *restrict q, const float *restrict kc, const float *restrict vc,
    const int32_t *restrict table, int64_t block_size, int64_t token_stride, int64_t start,
    int64_t seq, int64_t nkv, int64_t group, int64_t d, float scale, float soft_cap,
    float *restrict scores, float *restrict acc, float *restrict o, Lookahead *ahead) {
    const int64_t len = seq - start, rows = nkv * group;
#ifdef __AVX512F__
    if (d % 16 == 0) {
        scores_avx512(q, kc, table, block_size, token_stride, start, seq, rows, group, d, scale,
                      scores, ahead);
    } else
#endif
    for (int64_t t = start; t < seq;) {
        const int64_t in_block = t % block_size;
        const int64_t n = (block_size - in_block < seq - t) ? block_size - in_block : seq - t;
        const float *restrict k = kc + ((int64_t)table[t / block_size] * block_size + in_block)
                                           * token_stride;
        for (int64_t j = 0; j < n; j++, k += token_stride) {
            lookahead_advance(ahead, ahead->row_lines);
            for (int64_t h = 0; h < rows; h++) {
                const float *restrict qh = q + h * d, *restrict kh = k + (h / group) * d;
                float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                for (int64_t i = 0; i < d; i++) dot += qh[i] * kh[i];
                scores[h * len + (t + j - start)] = dot * scale;
            }
        }
        t += n;
    }
    for (int64_t h = 0; h < rows; h++) {
        float *restrict sh = scores + h * len;
        if (soft_cap > 0.0f)
            for (int64_t t = 0; t < len; t++) sh[t] = soft_cap * tanhf(sh[t] / soft_cap);
        float mx = -INFINITY, total = 0.0f;
        for (int64_t t = 0; t < len; t++) mx = sh[t] > mx ? sh[t] : mx;
#pragma omp simd reduction(+ : total)
        for (int64_t t = 0; t < len; t++) {
            sh[t] = fast_exp(sh[t] - mx);
            total += sh[t];
        }
        const float inv = 1.0f / total;
#pragma omp simd
        for (int64_t t = 0; t < len; t++) sh[t] *= inv;
    }
    for (int64_t i = 0; i < rows * d; i++) acc[i] = 0.0f;
    for (int64_t t = start; t < seq;) {
        const int64_t in_block = t % block_size;
        const int64_t n = (block_size - in_block < seq - t) ? block_size - in_block : seq - t;
        const float *restrict v = vc + ((int64_t)table[t / block_size] * block_size + in_block)
                                           * token_stride;
        for (int64_t j = 0; j < n; j++, v += token_stride) {
            lookahead_advance(ahead, ahead->row_lines);
            for (int64_t h = 0; h < rows; h++) {
                const float p = scores[h * len + (t + j - start)];
                float *restrict ah = acc + h * d;
                const float *restrict vh = v + (h / group) * d;
#pragma omp simd
                for (int64_t i = 0; i < d; i++) ah[i] += p * vh[i];
            }
        }
        t += n;
    }
    for (int64_t i = 0; i < rows * d; i++) o[i] = acc[i];
}

/* The step's keys and values stored first (ember_store_kv; n_store = 0: none), then one query
 * per request: q [reqs, q_heads, D] (row stride q_stride), out [reqs, q_heads * D];
 * cache [2, num_blocks, block_size, kv_heads, D]; block_table [reqs, *] int32 (row stride
 * bt_stride), seq_lens [reqs] int32. Query head h reads kv head h / (q_heads / kv_heads).
 * window > 0 keeps the last `window` keys; soft_cap > 0 applies cap * tanh(s / cap).
 * Returns nonzero when out of memory. */
int ember_decode_attention(const float *key, int64_t k_stride, const float *value,
                           int64_t v_stride, const int64_t *slots, int64_t n_store,
                           const float *q, int64_t q_stride, float *cache,
                           int64_t num_blocks, int64_t block_size, const int32_t *block_table,
                           int64_t bt_stride, const int32_t *seq_lens, float *out, int64_t reqs,
                           int64_t q_heads, int64_t kv_heads, int64_t d, float scale,
                           int64_t window, float soft_cap, int threads) {
    const int64_t group = q_heads / kv_heads;
    const int64_t token_stride = kv_heads * d;
    const float *kc = cache, *vc = cache + num_blocks * block_size * token_stride;
    if (n_store > 0)
        ember_store_kv(key, k_stride, value, v_stride, cache, num_blocks * block_size, slots,
                       n_store, token_stride);
    int64_t longest = 0;
    for (int64_t r = 0; r < reqs; r++) longest = seq_lens[r] > longest ? seq_lens[r] : longest;
    if (window > 0 && longest > window) longest = window;
    if (threads < 1) threads = 1;
    /* A task is a request's kv heads: all of them (each key row read once) when there are
     * enough requests for the threads, else one head each. */
    const int64_t per_task = reqs >= threads ? kv_heads : 1;
    const int64_t tasks = reqs * (kv_heads / per_task);
    const int64_t rows = per_task * group;
    /* Per thread: the scores, the queries and the sums. */
    const size_t per_thread = (size_t)(rows * longest + 2 * rows * d + 16);
    float *scratch = (float *)malloc(sizeof(float) * per_thread * (size_t)threads);
    if (!scratch) return 1;
    const int64_t tasks_per_req = kv_heads / per_task;
    /* The prefetch cursor over a task's reads: its request's keys, then its values. */
#define TASK_LOOKAHEAD(A, SPAN)                                                               \
    do {                                                                                      \
        const TaskSpan s_ = (SPAN);                                                           \
        lookahead_init((A), kc + s_.kv0 * d, vc + s_.kv0 * d, block_table + s_.req * bt_stride, \
                       block_size, token_stride, s_.start, s_.seq - s_.start, per_task * d * 4); \
    } while (0)
#pragma omp parallel num_threads(threads) if (threads > 1 && tasks > 1)
    {
        /* Each thread's cursor runs on from one task into the one it likely takes next
         * (dynamic scheduling hands the tasks out in turn), so only its first starts cold. */
        Lookahead ahead, next;
        int64_t next_task = -1;
        const int64_t team = omp_get_num_threads();
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < tasks; task++) {
            const TaskSpan span = task_span(task, tasks_per_req, per_task, seq_lens, window);
            const int64_t r = span.req, kv0 = span.kv0, seq = span.seq, start = span.start;
            float *o = out + r * q_heads * d + kv0 * group * d;
            if (seq - start <= 0) {
                for (int64_t i = 0; i < rows * d; i++) o[i] = 0.0f;
                continue;
            }
            if (next_task == task) {
                ahead = next;
            } else {
                TASK_LOOKAHEAD(&ahead, span);
                lookahead_advance(&ahead, LOOKAHEAD_ROWS * ahead.row_lines);
            }
            next_task = task + team;
            ahead.then = NULL;
            if (next_task < tasks) {
                TASK_LOOKAHEAD(&next,
                               task_span(next_task, tasks_per_req, per_task, seq_lens, window));
                ahead.then = &next;
            }
            float *mine = scratch + per_thread * (size_t)omp_get_thread_num();
            float *ql = mine, *acc = mine + rows * d, *scores = mine + 2 * rows * d;
            const float *qh = q + r * q_stride + kv0 * group * d;
            for (int64_t i = 0; i < rows * d; i++) ql[i] = qh[i];
            /* The common head sizes as constants, so the inner loops unroll. */
#define ATTEND(D) attend_heads(ql, kc + kv0 * d, vc + kv0 * d, block_table + r * bt_stride, \
                               block_size, token_stride, start, seq, per_task, group, D, scale, \
                               soft_cap, scores, acc, o, &ahead)
            if (d == 64) ATTEND(64);
            else if (d == 128) ATTEND(128);
            else ATTEND(d);
#undef ATTEND
        }
    }
#undef TASK_LOOKAHEAD
    free(scratch);
    return 0;
}

/* out[r] = weight[ids[r]] (rows of dim floats); an id outside [0, vocab) gives zeros. */
void ember_embedding(const float *weight, int64_t vocab, int64_t dim, const int64_t *ids,
                     int64_t rows, float *out) {
    for (int64_t r = 0; r < rows; r++) {
        const int64_t id = ids[r];
        float *o = out + r * dim;
        if (id < 0 || id >= vocab) {
            for (int64_t i = 0; i < dim; i++) o[i] = 0.0f;
            continue;
        }
        const float *w = weight + id * dim;
        for (int64_t i = 0; i < dim; i++) o[i] = w[i];
    }
}

/* cos/sin [T, half] of positions[t] * inv_freq[i] (the float32 product, as torch takes it),
 * times scaling when it is not 1. */
void ember_cos_sin(const int64_t *positions, int64_t tokens, const float *inv_freq, int64_t half,
                   float scaling, float *cos_out, float *sin_out) {
    for (int64_t t = 0; t < tokens; t++) {
        const float pos = (float)positions[t];
        for (int64_t i = 0; i < half; i++) {
            const float f = pos * inv_freq[i];
            float c = cosf(f), s = sinf(f);
            if (scaling != 1.0f) {
                c *= scaling;
                s *= scaling;
            }
            cos_out[t * half + i] = c;
            sin_out[t * half + i] = s;
        }
    }
}
