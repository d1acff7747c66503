/* The body of kernels/paged_attention.c for one stored KV element type, included once per type
 * with KV_T (the element), LOAD_KV (16 elements -> v16), KV_FLOAT (one element -> float),
 * NAME(x) (a per-type name) and ENTRY (the exported function) defined, and KV_SCALED for a type
 * stored with one float32 scale per (block, head, slot) (fp8: [N, H, bs] beside the blocks; a
 * row's value is LOAD_KV times ROW_UNIT times its scale). q, scores and out stay float32; only K
 * and V are read as stored. */

/* Walks one sequence's rows for one KV head, block by block, with a second cursor prefetching rows
 * ahead. On one thread, batch 8 at a 2,048-token context (small model: 4 KV heads, so a head's rows
 * are a quarter of each block), a layer's float32 attention took 3.4 ms with a burst of prefetches
 * per block and takes 2.1 ms this way; bfloat16 1.9 -> 1.5 ms. */
typedef struct {
    const KV_T *cache, *row, *ahead;
    const float *scales, *srow; /* KV_SCALED: the scales, and the current row's */
    const int64_t *table;
    size_t block_stride, head_offset;
    int block, last_block, offset, bs, D;
    int ahead_block, ahead_offset, ahead_left; /* a second cursor PREFETCH_BYTES ahead */
} NAME(cursor);

/* Moves the look-ahead cursor one row on and prefetches that row into L2 (prefetcht1: on this
 * CPU, float32 streamed at 16 GB/s with it and at 11-12 with prefetcht0, which ties up the L1's
 * few miss buffers). */
static inline __attribute__((always_inline)) void NAME(cursor_ahead)(NAME(cursor) *c) {
    c->ahead_left--;
    c->ahead += c->D;
    if (++c->ahead_offset == c->bs) {
        c->ahead_offset = 0;
        c->ahead = c->cache + c->table[++c->ahead_block] * c->block_stride + c->head_offset;
    }
    for (int i = 0; i < c->D * (int)sizeof(KV_T); i += 64) __builtin_prefetch((const char *)c->ahead + i, 0, 2);
}

/* Rows first .. last of the sequence whose block table is `table`. The look-ahead cursor
 * prefetches each row PREFETCH_BYTES of rows before it is read: blocks are scattered (and a KV
 * head's rows are a fraction of each block), so the hardware prefetcher keeps losing the stream, and
 * a burst of prefetches per block overflows the core's outstanding misses. The distance is in bytes,
 * not rows: a narrower type's rows go by faster. On an AVX-512 CPU (small model, batch 32, a
 * 2,048-token context, one thread) 16 rows ahead left bfloat16 at 10-11 GB/s and float32 at 13-15;
 * 8 KiB ahead (64 and 32 rows) reads them at 14-16 and 15-17. */
static inline NAME(cursor) NAME(cursor_at)(const KV_T *cache, const float *scales, const int64_t *table,
                                           int first, int last, int H, int h, int bs, int D) {
    NAME(cursor) c = {cache, NULL, NULL, scales, NULL, table, (size_t)H * bs * D, (size_t)h * bs * D,
                first / bs, last / bs, first % bs, bs, D, first / bs, first % bs, last - first};
    c.row = cache + table[c.block] * c.block_stride + c.head_offset + (size_t)c.offset * D;
#ifdef KV_SCALED
    c.srow = scales + ((size_t)table[c.block] * H + h) * bs + c.offset;
#endif
    c.ahead = c.row;
    int rows = PREFETCH_BYTES / (D * (int)sizeof(KV_T));
    rows = rows < 16 ? 16 : rows;
    for (int i = 0; i < rows && c.ahead_left > 0; i++) NAME(cursor_ahead)(&c);
    return c;
}

static inline __attribute__((always_inline)) void NAME(cursor_next)(NAME(cursor) *c) {
    c->row += c->D;
#ifdef KV_SCALED
    c->srow++;
#endif
    if (++c->offset == c->bs && c->block < c->last_block) {
        c->offset = 0;
        c->row = c->cache + c->table[++c->block] * c->block_stride + c->head_offset;
#ifdef KV_SCALED
        c->srow = c->scales + (c->row - c->cache) / c->D;
#endif
    }
    if (c->ahead_left > 0) NAME(cursor_ahead)(c);
}

#ifdef KV_SCALED /* a row's scale: at a cursor, and at a slot */
#define NAME_ROW_SCALE(c) (*(c).srow * ROW_UNIT)
#define SLOT_SCALE(scales, slot) ((scales)[slot] * ROW_UNIT)
#else
#define NAME_ROW_SCALE(c) 1.0f
#define SLOT_SCALE(scales, slot) 1.0f
#endif

/* One (sequence, KV head): G query heads at q, written to out. `scores` holds G * (n + 16) floats. */
static inline __attribute__((always_inline)) void
NAME(attend_vec)(const float *q, const KV_T *k_cache, const KV_T *v_cache, const float *k_scales,
                 const float *v_scales, const int64_t *table, int first, int ctx, float *out, int G, int H,
                 int h, const int D, int bs, float scale, float *scores) {
    const int chunks = D / 16, n = ctx - first, groups = (n + 15) / 16, stride = groups * 16;
    /* Query heads in batches of GB: each K and V row is loaded (and widened) once per batch. */
    for (int g0 = 0; g0 < G; g0 += GB) {
        const int gn = G - g0 < GB ? G - g0 : GB;
        const float *qg = q + (size_t)g0 * D;
        float *sg = scores + (size_t)g0 * stride;
        v16 qv[GB][MAX_CHUNKS];
        for (int g = 0; g < gn; g++)
            for (int c = 0; c < chunks; c++) qv[g][c] = loadv(qg + (size_t)g * D + 16 * c) * scale;
        NAME(cursor) k = NAME(cursor_at)(k_cache, k_scales, table, first, ctx - 1, H, h, bs, D);
        for (int grp = 0; grp < groups; grp++) {
            const int valid = n - 16 * grp < 16 ? n - 16 * grp : 16;
            v16 part[GB][16];
            for (int i = 0; i < 16; i++) {
                v16 kr[MAX_CHUNKS];
                float ks = 1.0f;
                if (i < valid) {
                    for (int c = 0; c < chunks; c++) kr[c] = LOAD_KV(k.row + 16 * c);
                    ks = NAME_ROW_SCALE(k);
                    NAME(cursor_next)(&k);
                }
                for (int g = 0; g < gn; g++) {
                    v16 acc = {0};
                    if (i < valid)
                        for (int c = 0; c < chunks; c++) acc += qv[g][c] * kr[c];
                    part[g][i] = acc * splat(ks); /* unscaled types: times a constant 1, compiled away */
                }
            }
            for (int g = 0; g < gn; g++) {
                v16 x8[8], x4[4], x2[2];
                for (int i = 0; i < 8; i++) x8[i] = fold8(part[g][2 * i], part[g][2 * i + 1]);
                for (int i = 0; i < 4; i++) x4[i] = fold4(x8[2 * i], x8[2 * i + 1]);
                for (int i = 0; i < 2; i++) x2[i] = fold2(x4[2 * i], x4[2 * i + 1]);
                storev(sg + (size_t)g * stride + 16 * grp, fold1(x2[0], x2[1]));
            }
        }
        float inv[GB];
        for (int g = 0; g < gn; g++) {
            float *s = sg + (size_t)g * stride;
            for (int i = n; i < stride; i++) s[i] = -INFINITY; /* the last group's padding */
            v16 mv = loadv(s);
            for (int grp = 1; grp < groups; grp++) mv = vmax(mv, loadv(s + 16 * grp));
            float m = mv[0];
            for (int i = 1; i < 16; i++) m = mv[i] > m ? mv[i] : m;
            v16 sums = {0};
            for (int grp = 0; grp < groups; grp++) {
                const v16 e = vexp(loadv(s + 16 * grp) - splat(m)); /* padding: exp(-87), 1e-38 */
                storev(s + 16 * grp, e);
                sums += e;
            }
            inv[g] = 1.0f / hsum(sums);
        }
        NAME(cursor) v = NAME(cursor_at)(v_cache, v_scales, table, first, ctx - 1, H, h, bs, D);
        v16 acc[GB][MAX_CHUNKS];
        for (int g = 0; g < gn; g++)
            for (int c = 0; c < chunks; c++) acc[g][c] = (v16){0};
        for (int i = 0; i < n; i++) {
            v16 vr[MAX_CHUNKS];
            for (int c = 0; c < chunks; c++) vr[c] = LOAD_KV(v.row + 16 * c);
            const float vs = NAME_ROW_SCALE(v);
            NAME(cursor_next)(&v);
            for (int g = 0; g < gn; g++) {
                const v16 p = splat(sg[(size_t)g * stride + i] * vs);
                for (int c = 0; c < chunks; c++) acc[g][c] += p * vr[c];
            }
        }
        for (int g = 0; g < gn; g++)
            for (int c = 0; c < chunks; c++) storev(out + (size_t)(g0 + g) * D + 16 * c, acc[g][c] * inv[g]);
    }
}

#ifdef ATTEND_AVX2
#include "paged_attention_avx2.h"
#endif

/* Any head size: plain loops. */
static void NAME(attend_plain)(const float *q, const KV_T *k_cache, const KV_T *v_cache,
                               const float *k_scales, const float *v_scales, const int64_t *table,
                               int first, int ctx, float *out, int G, int H, int h, int D, int bs,
                               float scale, float *scores) {
    const int n = ctx - first;
    (void)k_scales, (void)v_scales;
    for (int t = first; t < ctx; t++) {
        const size_t slot = ((size_t)table[t / bs] * H + h) * bs + t % bs;
        const KV_T *k = k_cache + slot * D;
        const float ks = SLOT_SCALE(k_scales, slot);
        for (int g = 0; g < G; g++) {
            float dot = 0.0f;
            for (int d = 0; d < D; d++) dot += q[(size_t)g * D + d] * KV_FLOAT(k[d]);
            scores[(size_t)g * n + (t - first)] = dot * ks * scale;
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
        const size_t slot = ((size_t)table[t / bs] * H + h) * bs + t % bs;
        const KV_T *v = v_cache + slot * D;
        const float vs = SLOT_SCALE(v_scales, slot);
        for (int g = 0; g < G; g++) {
            const float p = scores[(size_t)g * n + (t - first)] * vs;
            for (int d = 0; d < D; d++) out[(size_t)g * D + d] += p * KV_FLOAT(v[d]);
        }
    }
}

void ENTRY(const float *q, const KV_T *k_cache, const KV_T *v_cache,
#ifdef KV_SCALED
           const float *k_scales, const float *v_scales,
#endif
                            const int64_t *tables, const int32_t *ctx_lens, float *out,
                            int B, int Hq, int H, int D, int bs, int max_blocks, int window,
                            float scale, int nthreads) {
    const int G = Hq / H;
#ifndef KV_SCALED
    const float *k_scales = NULL, *v_scales = NULL;
#endif
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
#ifdef ATTEND_AVX2
            if (D == 64)
                NAME(attend_avx2)(qb, k_cache, v_cache, k_scales, v_scales, table, first, ctx, ob, G, H, h, 64, bs, scale, scores);
            else if (D % 8 == 0 && D <= 16 * MAX_CHUNKS)
                NAME(attend_avx2)(qb, k_cache, v_cache, k_scales, v_scales, table, first, ctx, ob, G, H, h, D, bs, scale, scores);
            else
#endif
            if (D == 64)
                NAME(attend_vec)(qb, k_cache, v_cache, k_scales, v_scales, table, first, ctx, ob, G, H, h, 64, bs, scale, scores);
            else if (D == 128)
                NAME(attend_vec)(qb, k_cache, v_cache, k_scales, v_scales, table, first, ctx, ob, G, H, h, 128, bs, scale, scores);
            else if (D % 16 == 0 && D <= 16 * MAX_CHUNKS)
                NAME(attend_vec)(qb, k_cache, v_cache, k_scales, v_scales, table, first, ctx, ob, G, H, h, D, bs, scale, scores);
            else
                NAME(attend_plain)(qb, k_cache, v_cache, k_scales, v_scales, table, first, ctx, ob, G, H, h, D, bs, scale, scores);
        }
        free(scores);
    }
}

#undef NAME_ROW_SCALE
#undef SLOT_SCALE
