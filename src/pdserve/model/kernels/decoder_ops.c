/* The small operations between a decoder layer's GEMMs, fused so that a decode step pays one call
 * each instead of several PyTorch ops (and their temporaries) per layer.
 *
 * float32, row-major, on the caller's torch threads (libgomp is torch's, see paged_attention.c).
 * Small inputs (a decode step) run on the calling thread; large ones (a prefill) split their rows.
 *   add_rms_norm   x += delta; out = weight * x / sqrt(mean(x^2) + eps)   (transformers' RMSNorm)
 *   rope_write_kv  rotate q and k in place (half-split "rotate_half" layout, cos/sin tables by
 *                  position), then copy k and v into their cache slots
 *   silu_mul       out = silu(gate) * up, gate and up the two halves of each row
 * and, on the logits, the greedy pick with the normaliser the sampled token's logprob needs:
 *   argmax_logsumexp
 */
#include <math.h>
#include <stdint.h>

#include "vec.h"

#define PARALLEL_MIN_ELEMENTS (1 << 16)

void add_rms_norm(float *x, const float *delta, const float *weight, float *out, int rows, int cols,
                  float eps, int nthreads) {
    const int vec_cols = cols - cols % 16;
#pragma omp parallel for num_threads(nthreads) if ((int64_t)rows * cols >= PARALLEL_MIN_ELEMENTS)
    for (int r = 0; r < rows; r++) {
        float *xr = x + (size_t)r * cols, *o = out + (size_t)r * cols;
        const float *dr = delta ? delta + (size_t)r * cols : NULL;
        v16 sq = {0};
        float tail = 0.0f;
        for (int c = 0; c < vec_cols; c += 16) {
            v16 v = loadv(xr + c);
            if (dr) {
                v += loadv(dr + c);
                storev(xr + c, v);
            }
            sq += v * v;
        }
        for (int c = vec_cols; c < cols; c++) {
            if (dr) xr[c] += dr[c];
            tail += xr[c] * xr[c];
        }
        const float inv = 1.0f / sqrtf((hsum(sq) + tail) / (float)cols + eps);
        const v16 iv = splat(inv); /* vec.h: a scalar times a v16 is slow on 8-lane units */
        for (int c = 0; c < vec_cols; c += 16) storev(o + c, loadv(weight + c) * (loadv(xr + c) * iv));
        for (int c = vec_cols; c < cols; c++) o[c] = weight[c] * (xr[c] * inv);
    }
}

/* One head of one token: x[i], x[i + half] -> x[i] cos - x[i + half] sin, x[i + half] cos + x[i] sin. */
static inline void rotate(float *x, const float *cos, const float *sin, int half) {
    int i = 0;
    for (; i + 16 <= half; i += 16) {
        const v16 a = loadv(x + i), b = loadv(x + half + i);
        storev(x + i, a * loadv(cos + i) - b * loadv(sin + i));
        storev(x + half + i, b * loadv(cos + half + i) + a * loadv(sin + half + i));
    }
    for (; i < half; i++) {
        const float a = x[i], b = x[half + i];
        x[i] = a * cos[i] - b * sin[i];
        x[half + i] = b * cos[half + i] + a * sin[half + i];
    }
}

/* q: [tokens, Hq, D] with row stride q_stride; k, v: [tokens, H, D] with strides k_stride,
 * v_stride. Caches [blocks, H, bs, D]; token t goes to (slot_blocks[t], slot_offsets[t]). */
void rope_write_kv(float *q, int64_t q_stride, float *k, int64_t k_stride, const float *v,
                   int64_t v_stride, const int64_t *positions, const float *cos, const float *sin,
                   float *k_cache, float *v_cache, const int64_t *slot_blocks,
                   const int64_t *slot_offsets, int tokens, int Hq, int H, int D, int bs,
                   int nthreads) {
    const int half = D / 2;
#pragma omp parallel for num_threads(nthreads) if ((int64_t)tokens * (Hq + 2 * H) * D >= PARALLEL_MIN_ELEMENTS)
    for (int t = 0; t < tokens; t++) {
        const float *c = cos + positions[t] * D, *s = sin + positions[t] * D;
        for (int h = 0; h < Hq; h++) rotate(q + t * q_stride + (int64_t)h * D, c, s, half);
        for (int h = 0; h < H; h++) {
            float *kh = k + t * k_stride + (int64_t)h * D;
            rotate(kh, c, s, half);
            const size_t slot = (((size_t)slot_blocks[t] * H + h) * bs + slot_offsets[t]) * D;
            memcpy(k_cache + slot, kh, sizeof(float) * D);
            memcpy(v_cache + slot, v + t * v_stride + (int64_t)h * D, sizeof(float) * D);
        }
    }
}

void silu_mul(const float *gate_up, float *out, int rows, int inter, int nthreads) {
    const int vec_cols = inter - inter % 16;
#pragma omp parallel for num_threads(nthreads) if ((int64_t)rows * inter >= PARALLEL_MIN_ELEMENTS)
    for (int r = 0; r < rows; r++) {
        const float *g = gate_up + (size_t)r * 2 * inter, *u = g + inter;
        float *o = out + (size_t)r * inter;
#ifdef VEC_AVX2 /* 8 lanes at a time: GCC's halves of the 16-lane loop went through memory */
        const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
        for (int c = 0; c < vec_cols; c += 8) {
            const __m256 x = _mm256_loadu_ps(g + c);
            const __m256 e = vexp8(_mm256_sub_ps(zero, x));
            _mm256_storeu_ps(o + c, _mm256_mul_ps(_mm256_div_ps(x, _mm256_add_ps(one, e)), _mm256_loadu_ps(u + c)));
        }
#else
        for (int c = 0; c < vec_cols; c += 16) {
            const v16 x = loadv(g + c);
            storev(o + c, x / (1.0f + vexp(-x)) * loadv(u + c));
        }
#endif
        for (int c = vec_cols; c < inter; c++) o[c] = g[c] / (1.0f + expf(-g[c])) * u[c];
    }
}

#ifdef VEC_AVX2
/* argmax_logsumexp's vector loop on 8-lane units, in intrinsics (GCC's lowering of its 16-lane
 * compare and select, with the exp's, made the whole function 4x torch's argmax): the largest of
 * x[0, cols), cols a multiple of 16, and its first index. */
static void argmax_avx2(const float *x, int cols, float *best, int64_t *best_at) {
    __m256 m0 = _mm256_loadu_ps(x), m1 = _mm256_loadu_ps(x + 8);
    __m256i i0 = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), i1 = _mm256_add_epi32(i0, _mm256_set1_epi32(8));
    __m256i a0 = i0, a1 = i1;
    const __m256i step = _mm256_set1_epi32(16);
    for (int c = 16; c < cols; c += 16) {
        i0 = _mm256_add_epi32(i0, step), i1 = _mm256_add_epi32(i1, step);
        const __m256 v0 = _mm256_loadu_ps(x + c), v1 = _mm256_loadu_ps(x + c + 8);
        const __m256 g0 = _mm256_cmp_ps(v0, m0, _CMP_GT_OQ), g1 = _mm256_cmp_ps(v1, m1, _CMP_GT_OQ);
        m0 = _mm256_blendv_ps(m0, v0, g0), m1 = _mm256_blendv_ps(m1, v1, g1);
        a0 = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(a0), _mm256_castsi256_ps(i0), g0));
        a1 = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(a1), _mm256_castsi256_ps(i1), g1));
    }
    float m[16];
    int32_t at[16];
    _mm256_storeu_ps(m, m0), _mm256_storeu_ps(m + 8, m1);
    _mm256_storeu_si256((__m256i *)at, a0), _mm256_storeu_si256((__m256i *)(at + 8), a1);
    for (int i = 0; i < 16; i++)
        if (m[i] > *best || (m[i] == *best && at[i] < *best_at)) *best = m[i], *best_at = at[i];
}
#endif

/* Per row of logits [rows, vocab]: the first index of the maximum (torch.argmax) and
 * log(sum(exp(x))) (torch.logsumexp), in two passes over the row. */
void argmax_logsumexp(const float *logits, int rows, int vocab, int64_t *argmax, float *lse,
                      int nthreads) {
    const int vec_cols = vocab - vocab % 16;
#ifndef VEC_AVX2
    const i16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
#endif
#pragma omp parallel for num_threads(nthreads) if ((int64_t)rows * vocab >= PARALLEL_MIN_ELEMENTS)
    for (int r = 0; r < rows; r++) {
        const float *x = logits + (size_t)r * vocab;
        float best = -INFINITY;
        int64_t best_at = 0;
        if (vec_cols) {
#ifdef VEC_AVX2
            argmax_avx2(x, vec_cols, &best, &best_at);
#else
            v16 mv = loadv(x);
            i16 at = lane;
            for (int c = 16; c < vec_cols; c += 16) {
                const v16 v = loadv(x + c);
                const i16 better = v > mv;
                mv = vselect(better, v, mv);
                at = (at & ~better) | ((lane + c) & better);
            }
            for (int i = 0; i < 16; i++)
                if (mv[i] > best || (mv[i] == best && at[i] < best_at)) best = mv[i], best_at = at[i];
#endif
        }
        for (int c = vec_cols; c < vocab; c++)
            if (x[c] > best) best = x[c], best_at = c;
        float total = 0.0f;
#ifdef VEC_AVX2
        __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
        const __m256 shift = _mm256_set1_ps(best);
        for (int c = 0; c < vec_cols; c += 16) {
            s0 = _mm256_add_ps(s0, vexp8(_mm256_sub_ps(_mm256_loadu_ps(x + c), shift)));
            s1 = _mm256_add_ps(s1, vexp8(_mm256_sub_ps(_mm256_loadu_ps(x + c + 8), shift)));
        }
        total = hsum(joined(s0, s1));
#else
        v16 sums = {0};
        for (int c = 0; c < vec_cols; c += 16) sums += vexp(loadv(x + c) - best);
        total = hsum(sums);
#endif
        for (int c = vec_cols; c < vocab; c++) total += expf(x[c] - best);
        argmax[r] = best_at;
        lse[r] = best + logf(total);
    }
}
