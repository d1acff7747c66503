/* Decode attention over the paged KV cache, reading K and V in place (no gather copy).
 *
 * One query token per sequence. Work item i = (sequence b, KV head h), spread over `nthreads`
 * OpenMP threads. Loaded into a process that has already loaded PyTorch, libgomp.so.1 resolves to
 * torch's own copy, so these are torch's intra-op threads (no second pool spinning against the
 * first). float32 throughout.
 * Layout: q, out [B, Hq, D]; k_cache, v_cache [N, H, bs, D] (HND); tables [B, max_blocks].
 *
 * The fast path (head_dim a multiple of 16, at most 256) uses GCC/clang vector types, so it is
 * portable C that compiles to AVX-512 here and to narrower units elsewhere:
 *   - scores: one 16-lane partial product per token, then a transpose-and-add tree turns 16 tokens'
 *     partials into their 16 dot products (no horizontal sum per token);
 *   - softmax: the vectorized exp of vec.h;
 *   - values: the output row stays in registers while the tokens stream past.
 * Rows are walked with a (block, offset) cursor: no division per token.
 * Other head sizes take the plain loop at the end.
 */
#include <math.h>
#include <stdlib.h>

#include "vec.h"

#define MAX_CHUNKS 16 /* head_dim up to 256 on the fast path */

/* The four levels of a 16 x 16 transpose-and-add: each pairs two vectors and halves the number of
 * partial sums per token, keeping tokens in order. */
static inline v16 fold8(v16 a, v16 b) {
    return SHUF2(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23)
         + SHUF2(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
}
static inline v16 fold4(v16 a, v16 b) {
    return SHUF2(a, b, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27)
         + SHUF2(a, b, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
}
static inline v16 fold2(v16 a, v16 b) {
    return SHUF2(a, b, 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29)
         + SHUF2(a, b, 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
}
static inline v16 fold1(v16 a, v16 b) {
    return SHUF2(a, b, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30)
         + SHUF2(a, b, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

/* Walks one sequence's rows for one KV head, block by block, prefetching the next block's rows
 * (blocks are scattered, so the hardware prefetcher cannot guess them: +15-30 % on a cold cache). */
typedef struct {
    const float *cache, *row;
    const int64_t *table;
    size_t block_stride, head_offset;
    int block, last_block, offset, bs, D;
} cursor;

static inline void prefetch_block(const cursor *c, int block) {
    const char *p = (const char *)(c->cache + c->table[block] * c->block_stride + c->head_offset);
    for (int i = 0; i < c->bs * c->D * (int)sizeof(float); i += 64) __builtin_prefetch(p + i);
}

/* Rows first .. last of the sequence whose block table is `table`. */
static inline cursor cursor_at(const float *cache, const int64_t *table, int first, int last, int H,
                               int h, int bs, int D) {
    cursor c = {cache, NULL, table, (size_t)H * bs * D, (size_t)h * bs * D,
                first / bs, last / bs, first % bs, bs, D};
    c.row = cache + table[c.block] * c.block_stride + c.head_offset + (size_t)c.offset * D;
    if (c.block < c.last_block) prefetch_block(&c, c.block + 1);
    return c;
}

static inline void cursor_next(cursor *c) {
    c->row += c->D;
    if (++c->offset == c->bs && c->block < c->last_block) {
        c->offset = 0;
        c->row = c->cache + c->table[++c->block] * c->block_stride + c->head_offset;
        if (c->block < c->last_block) prefetch_block(c, c->block + 1);
    }
}

/* One (sequence, KV head): G query heads at q, written to out. `scores` holds G * (n + 16) floats. */
static inline __attribute__((always_inline)) void
attend_vec(const float *q, const float *k_cache, const float *v_cache, const int64_t *table,
           int first, int ctx, float *out, int G, int H, int h, const int D, int bs, float scale,
           float *scores) {
    const int chunks = D / 16, n = ctx - first, groups = (n + 15) / 16, stride = groups * 16;
    for (int g = 0; g < G; g++) {
        v16 qv[MAX_CHUNKS];
        for (int c = 0; c < chunks; c++) qv[c] = loadv(q + (size_t)g * D + 16 * c) * scale;
        cursor k = cursor_at(k_cache, table, first, ctx - 1, H, h, bs, D);
        for (int grp = 0; grp < groups; grp++) {
            const int valid = n - 16 * grp < 16 ? n - 16 * grp : 16;
            v16 part[16];
            for (int i = 0; i < 16; i++) {
                v16 acc = {0};
                if (i < valid) {
                    for (int c = 0; c < chunks; c++) acc += qv[c] * loadv(k.row + 16 * c);
                    cursor_next(&k);
                }
                part[i] = acc;
            }
            v16 x8[8], x4[4], x2[2];
            for (int i = 0; i < 8; i++) x8[i] = fold8(part[2 * i], part[2 * i + 1]);
            for (int i = 0; i < 4; i++) x4[i] = fold4(x8[2 * i], x8[2 * i + 1]);
            for (int i = 0; i < 2; i++) x2[i] = fold2(x4[2 * i], x4[2 * i + 1]);
            storev(scores + (size_t)g * stride + 16 * grp, fold1(x2[0], x2[1]));
        }
    }
    for (int g = 0; g < G; g++) {
        float *s = scores + (size_t)g * stride;
        for (int i = n; i < stride; i++) s[i] = -INFINITY; /* the last group's padding */
        v16 mv = loadv(s);
        for (int grp = 1; grp < groups; grp++) mv = vmax(mv, loadv(s + 16 * grp));
        float m = mv[0];
        for (int i = 1; i < 16; i++) m = mv[i] > m ? mv[i] : m;
        v16 sums = {0};
        for (int grp = 0; grp < groups; grp++) {
            const v16 e = vexp(loadv(s + 16 * grp) - m); /* padding: exp(-87), 1e-38 */
            storev(s + 16 * grp, e);
            sums += e;
        }
        const float inv = 1.0f / hsum(sums);
        cursor v = cursor_at(v_cache, table, first, ctx - 1, H, h, bs, D);
        v16 acc[MAX_CHUNKS];
        for (int c = 0; c < chunks; c++) acc[c] = (v16){0};
        for (int i = 0; i < n; i++) {
            const float p = s[i];
            for (int c = 0; c < chunks; c++) acc[c] += p * loadv(v.row + 16 * c);
            cursor_next(&v);
        }
        for (int c = 0; c < chunks; c++) storev(out + (size_t)g * D + 16 * c, acc[c] * inv);
    }
}

/* Any head size: plain loops. */
static void attend_plain(const float *q, const float *k_cache, const float *v_cache,
                         const int64_t *table, int first, int ctx, float *out, int G, int H, int h,
                         int D, int bs, float scale, float *scores) {
    const int n = ctx - first;
    for (int t = first; t < ctx; t++) {
        const float *k = k_cache + (((size_t)table[t / bs] * H + h) * bs + t % bs) * D;
        for (int g = 0; g < G; g++) {
            float dot = 0.0f;
            for (int d = 0; d < D; d++) dot += q[(size_t)g * D + d] * k[d];
            scores[(size_t)g * n + (t - first)] = dot * scale;
        }
    }
    for (int g = 0; g < G; g++) {
        float *s = scores + (size_t)g * n;
        float m = -INFINITY, sum = 0.0f;
        for (int i = 0; i < n; i++) m = s[i] > m ? s[i] : m;
        for (int i = 0; i < n; i++) { s[i] = expf(s[i] - m); sum += s[i]; }
        for (int i = 0; i < n; i++) s[i] /= sum;
    }
    memset(out, 0, sizeof(float) * (size_t)G * D);
    for (int t = first; t < ctx; t++) {
        const float *v = v_cache + (((size_t)table[t / bs] * H + h) * bs + t % bs) * D;
        for (int g = 0; g < G; g++) {
            const float p = scores[(size_t)g * n + (t - first)];
            for (int d = 0; d < D; d++) out[(size_t)g * D + d] += p * v[d];
        }
    }
}

void paged_decode_attention(const float *q, const float *k_cache, const float *v_cache,
                            const int64_t *tables, const int32_t *ctx_lens, float *out,
                            int B, int Hq, int H, int D, int bs, int max_blocks, int window,
                            float scale, int nthreads) {
    const int G = Hq / H;
#pragma omp parallel num_threads(nthreads)
    {
        float *scores = (float *)malloc(sizeof(float) * (size_t)G * ((size_t)max_blocks * bs + 16));
#pragma omp for schedule(dynamic)
        for (int item = 0; item < B * H; item++) {
            const int b = item / H, h = item % H;
            const int ctx = ctx_lens[b];
            const int first = (window > 0 && ctx > window) ? ctx - window : 0;
            const float *qb = q + ((size_t)b * Hq + (size_t)h * G) * D;
            float *ob = out + ((size_t)b * Hq + (size_t)h * G) * D;
            const int64_t *table = tables + (size_t)b * max_blocks;
            if (D == 64)
                attend_vec(qb, k_cache, v_cache, table, first, ctx, ob, G, H, h, 64, bs, scale, scores);
            else if (D == 128)
                attend_vec(qb, k_cache, v_cache, table, first, ctx, ob, G, H, h, 128, bs, scale, scores);
            else if (D % 16 == 0 && D <= 16 * MAX_CHUNKS)
                attend_vec(qb, k_cache, v_cache, table, first, ctx, ob, G, H, h, D, bs, scale, scores);
            else
                attend_plain(qb, k_cache, v_cache, table, first, ctx, ob, G, H, h, D, bs, scale, scores);
        }
        free(scores);
    }
}
