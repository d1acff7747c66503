/* NAME(attend_avx2): the decode attention of paged_attention_kv.h on 8-lane AVX2 units, included
 * there (once per stored KV type, with LOAD8_KV(p): 8 elements -> __m256) on AVX2 CPUs without
 * AVX-512. The 16-lane version keeps every query head's q and a K row in registers and a V row's
 * output for every head: on 16 ymm registers that spilled, and SmolLM2's layer (batch 32, 9 query
 * heads over 3 KV heads, a 160-token context) took 1.3 ms for float32 and for bfloat16 alike (6 and
 * 3 GB/s). Here a pass takes at most GB (4) query heads and keeps only their accumulators live:
 *   - scores: two rows at a time, one 8-lane partial dot product per row and query head (q read
 *     from L1), and every 8 rows a horizontal-add transpose turns 8 partials into 8 scores;
 *   - softmax: an 8-lane exp (vec.h's vexp8);
 *   - values: 8 rows at a time, two 8-lane column chunks at a time, each head's output chunk in a
 *     register across the 8 rows, then back to an L1 array.
 * Any head size that is a multiple of 8 (up to 256) takes it. Rows are read 16 elements at a time
 * (LOAD16_KV); bfloat16 widens them with two unpacks against zero (the elements come out as 0-3,
 * 8-11 | 4-7, 12-15, KV_INTERLEAVED), instead of a zero-extension and a shift per 8: q is stored in
 * that order and the output put back in its own (the small model's bfloat16 layer ~10 % faster). */

#ifdef KV_INTERLEAVED
static const int NAME(order)[16] = {0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15};
#endif
/* Element i of a row as LOAD16_KV lays it out: where it sits in the row. */
static inline int NAME(source)(int i, int D) {
#ifdef KV_INTERLEAVED
    return i < D / 16 * 16 ? i / 16 * 16 + NAME(order)[i % 16] : i;
#else
    (void)D;
    return i;
#endif
}

/* Scores of query heads [0, gn) (q scaled, [gn][D] at qs) against rows first..ctx-1, into s
 * ([gn][stride], padded with -inf to stride). */
static inline __attribute__((always_inline)) void
NAME(scores_avx2)(const float *qs, const KV_T *k_cache, const float *k_scales, const int64_t *table,
                  int first, int ctx, int H, int h, int D, int bs, float *s, int stride, const int gn) {
    const int chunks = D / 8, n = ctx - first, groups = (n + 7) / 8;
    NAME(cursor) k = NAME(cursor_at)(k_cache, k_scales, table, first, ctx - 1, H, h, bs, D);
    for (int grp = 0; grp < groups; grp++) {
        const int valid = n - 8 * grp < 8 ? n - 8 * grp : 8;
        __m256 part[GB][8];
        float ks[8];
        for (int r = 0; r < 8; r += 2) { /* two rows at a time: each q chunk loaded once for both */
            __m256 a0[GB], a1[GB];
            for (int g = 0; g < gn; g++) a0[g] = a1[g] = _mm256_setzero_ps();
            ks[r] = ks[r + 1] = 0.0f;
            if (r < valid) {
                const KV_T *k0 = k.row, *k1 = k.row;
                ks[r] = NAME_ROW_SCALE(k);
                NAME(cursor_next)(&k);
                if (r + 1 < valid) {
                    k1 = k.row;
                    ks[r + 1] = NAME_ROW_SCALE(k);
                    NAME(cursor_next)(&k);
                }
                int c = 0;
                for (; c + 1 < chunks; c += 2) {
                    __m256 kl0, kh0, kl1, kh1;
                    LOAD16_KV(k0 + 8 * c, &kl0, &kh0);
                    LOAD16_KV(k1 + 8 * c, &kl1, &kh1);
                    for (int g = 0; g < gn; g++) {
                        const __m256 ql = _mm256_loadu_ps(qs + (size_t)g * D + 8 * c);
                        const __m256 qh = _mm256_loadu_ps(qs + (size_t)g * D + 8 * c + 8);
                        a0[g] = _mm256_fmadd_ps(qh, kh0, _mm256_fmadd_ps(ql, kl0, a0[g]));
                        a1[g] = _mm256_fmadd_ps(qh, kh1, _mm256_fmadd_ps(ql, kl1, a1[g]));
                    }
                }
                if (c < chunks) { /* a head size of 16m + 8: the last 8 as they are */
                    const __m256 kr0 = LOAD8_KV(k0 + 8 * c), kr1 = LOAD8_KV(k1 + 8 * c);
                    for (int g = 0; g < gn; g++) {
                        const __m256 qc = _mm256_loadu_ps(qs + (size_t)g * D + 8 * c);
                        a0[g] = _mm256_fmadd_ps(qc, kr0, a0[g]);
                        a1[g] = _mm256_fmadd_ps(qc, kr1, a1[g]);
                    }
                }
            }
            for (int g = 0; g < gn; g++) part[g][r] = a0[g], part[g][r + 1] = a1[g];
        }
#ifdef KV_SCALED
        const __m256 kscale = _mm256_loadu_ps(ks);
#endif
        for (int g = 0; g < gn; g++) {
            __m256 dots = sum8x8(part[g]);
#ifdef KV_SCALED
            dots = _mm256_mul_ps(dots, kscale);
#endif
            _mm256_storeu_ps(s + (size_t)g * stride + 8 * grp, dots);
        }
        (void)ks;
    }
    for (int g = 0; g < gn; g++)
        for (int i = n; i < stride; i++) s[(size_t)g * stride + i] = -INFINITY;
}

/* out[g] += p[g] . V rows for query heads [0, gn): acc is [gn][D] in L1, p is [gn][stride]. */
static inline __attribute__((always_inline)) void
NAME(values_avx2)(const float *p, const KV_T *v_cache, const float *v_scales, const int64_t *table,
                  int first, int ctx, int H, int h, int D, int bs, float *acc, int stride, const int gn) {
    const int chunks = D / 8, n = ctx - first;
    NAME(cursor) v = NAME(cursor_at)(v_cache, v_scales, table, first, ctx - 1, H, h, bs, D);
    for (int i0 = 0; i0 < n; i0 += 8) {
        const int rows = n - i0 < 8 ? n - i0 : 8;
        const KV_T *row[8];
        float w[GB][8];
        for (int r = 0; r < rows; r++) {
            row[r] = v.row;
            const float vs = NAME_ROW_SCALE(v);
            for (int g = 0; g < gn; g++) w[g][r] = p[(size_t)g * stride + i0 + r] * vs;
            NAME(cursor_next)(&v);
        }
        int c = 0;
        for (; c + 1 < chunks; c += 2) {
            __m256 a0[GB], a1[GB];
            for (int g = 0; g < gn; g++) {
                a0[g] = _mm256_loadu_ps(acc + (size_t)g * D + 8 * c);
                a1[g] = _mm256_loadu_ps(acc + (size_t)g * D + 8 * c + 8);
            }
            for (int r = 0; r < rows; r++) {
                __m256 v0, v1;
                LOAD16_KV(row[r] + 8 * c, &v0, &v1);
                for (int g = 0; g < gn; g++) {
                    const __m256 wg = _mm256_broadcast_ss(&w[g][r]);
                    a0[g] = _mm256_fmadd_ps(wg, v0, a0[g]);
                    a1[g] = _mm256_fmadd_ps(wg, v1, a1[g]);
                }
            }
            for (int g = 0; g < gn; g++) {
                _mm256_storeu_ps(acc + (size_t)g * D + 8 * c, a0[g]);
                _mm256_storeu_ps(acc + (size_t)g * D + 8 * c + 8, a1[g]);
            }
        }
        if (c < chunks) { /* an odd chunk count: the last chunk alone */
            __m256 a0[GB];
            for (int g = 0; g < gn; g++) a0[g] = _mm256_loadu_ps(acc + (size_t)g * D + 8 * c);
            for (int r = 0; r < rows; r++) {
                const __m256 v0 = LOAD8_KV(row[r] + 8 * c);
                for (int g = 0; g < gn; g++) a0[g] = _mm256_fmadd_ps(_mm256_broadcast_ss(&w[g][r]), v0, a0[g]);
            }
            for (int g = 0; g < gn; g++) _mm256_storeu_ps(acc + (size_t)g * D + 8 * c, a0[g]);
        }
    }
}

/* One (sequence, KV head): G query heads at q, written to out. `scores` holds G * (n + 16) floats. */
static void NAME(attend_avx2)(const float *q, const KV_T *k_cache, const KV_T *v_cache, const float *k_scales,
                              const float *v_scales, const int64_t *table, int first, int ctx, float *out,
                              int G, int H, int h, const int D, int bs, float scale, float *scores) {
    const int n = ctx - first, stride = (n + 7) / 8 * 8;
    float qs[GB * 16 * MAX_CHUNKS], acc[GB * 16 * MAX_CHUNKS];
    for (int g0 = 0; g0 < G; g0 += GB) {
        const int gn = G - g0 < GB ? G - g0 : GB;
        float *sg = scores + (size_t)g0 * stride;
        for (int g = 0; g < gn; g++)
            for (int i = 0; i < D; i++) qs[g * D + i] = q[(size_t)(g0 + g) * D + NAME(source)(i, D)] * scale;
        switch (gn) { /* a constant head count per pass: the accumulators stay in registers */
        case 1: NAME(scores_avx2)(qs, k_cache, k_scales, table, first, ctx, H, h, D, bs, sg, stride, 1); break;
        case 2: NAME(scores_avx2)(qs, k_cache, k_scales, table, first, ctx, H, h, D, bs, sg, stride, 2); break;
        case 3: NAME(scores_avx2)(qs, k_cache, k_scales, table, first, ctx, H, h, D, bs, sg, stride, 3); break;
        default: NAME(scores_avx2)(qs, k_cache, k_scales, table, first, ctx, H, h, D, bs, sg, stride, GB); break;
        }
        float inv[GB];
        for (int g = 0; g < gn; g++) {
            float *s = sg + (size_t)g * stride;
            __m256 mv = _mm256_loadu_ps(s);
            for (int i = 8; i < stride; i += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(s + i));
            float lanes[8], m = -INFINITY;
            _mm256_storeu_ps(lanes, mv);
            for (int i = 0; i < 8; i++) m = lanes[i] > m ? lanes[i] : m;
            __m256 sums = _mm256_setzero_ps();
            for (int i = 0; i < stride; i += 8) {
                const __m256 e = vexp8(_mm256_sub_ps(_mm256_loadu_ps(s + i), _mm256_set1_ps(m))); /* padding: exp(-87) */
                _mm256_storeu_ps(s + i, e);
                sums = _mm256_add_ps(sums, e);
            }
            _mm256_storeu_ps(lanes, sums);
            float total = 0.0f;
            for (int i = 0; i < 8; i++) total += lanes[i];
            inv[g] = 1.0f / total;
        }
        memset(acc, 0, sizeof(float) * (size_t)gn * D);
        switch (gn) {
        case 1: NAME(values_avx2)(sg, v_cache, v_scales, table, first, ctx, H, h, D, bs, acc, stride, 1); break;
        case 2: NAME(values_avx2)(sg, v_cache, v_scales, table, first, ctx, H, h, D, bs, acc, stride, 2); break;
        case 3: NAME(values_avx2)(sg, v_cache, v_scales, table, first, ctx, H, h, D, bs, acc, stride, 3); break;
        default: NAME(values_avx2)(sg, v_cache, v_scales, table, first, ctx, H, h, D, bs, acc, stride, GB); break;
        }
        for (int g = 0; g < gn; g++) {
            const __m256 norm = _mm256_set1_ps(inv[g]);
            float *o = out + (size_t)(g0 + g) * D;
            const float *a = acc + (size_t)g * D;
            int i = 0;
#ifdef KV_INTERLEAVED
            for (; i + 16 <= D; i += 16) { /* 0-3, 8-11 | 4-7, 12-15 back to 0-15 */
                const __m256 lo = _mm256_loadu_ps(a + i), hi = _mm256_loadu_ps(a + i + 8);
                _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_permute2f128_ps(lo, hi, 0x20), norm));
                _mm256_storeu_ps(o + i + 8, _mm256_mul_ps(_mm256_permute2f128_ps(lo, hi, 0x31), norm));
            }
#endif
            for (; i < D; i += 8) _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_loadu_ps(a + i), norm));
        }
    }
}
