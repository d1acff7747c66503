/* Decode attention over the paged KV cache, reading K and V in place (no gather copy).
 *
 * One query token per sequence. Work item i = (sequence b, KV head h), spread over `nthreads`
 * OpenMP threads. Loaded into a process that has already loaded PyTorch, libgomp.so.1 resolves to
 * torch's own copy, so these are torch's intra-op threads (no second pool spinning against the
 * first). float32 throughout:
 * dot products and sums accumulate in float32 (vectorized), softmax as torch does (max, exp, sum).
 * Layout: q, out [B, Hq, D]; k_cache, v_cache [N, H, bs, D] (HND); tables [B, max_blocks].
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

void paged_decode_attention(const float *q, const float *k_cache, const float *v_cache,
                            const int64_t *tables, const int32_t *ctx_lens, float *out,
                            int B, int Hq, int H, int D, int bs, int max_blocks, int window,
                            float scale, int nthreads) {
    const int G = Hq / H;
#pragma omp parallel for schedule(dynamic) num_threads(nthreads)
    for (int item = 0; item < B * H; item++) {
        const int b = item / H, h = item % H;
        const int ctx = ctx_lens[b];
        const int first = (window > 0 && ctx > window) ? ctx - window : 0;
        const int n = ctx - first;
        float *scores = (float *)malloc(sizeof(float) * (size_t)G * (size_t)n);
        const float *qb = q + ((size_t)b * Hq + (size_t)h * G) * D;
        const int64_t *table = tables + (size_t)b * max_blocks;
        for (int t = first; t < ctx; t++) {
            const float *k = k_cache + (((size_t)table[t / bs] * H + h) * bs + t % bs) * D;
            for (int g = 0; g < G; g++) {
                const float *qg = qb + (size_t)g * D;
                float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                for (int d = 0; d < D; d++) dot += qg[d] * k[d];
                scores[(size_t)g * n + (t - first)] = dot * scale;
            }
        }
        for (int g = 0; g < G; g++) {
            float *s = scores + (size_t)g * n;
            float m = -INFINITY, sum = 0.0f;
            for (int i = 0; i < n; i++) m = s[i] > m ? s[i] : m;
            for (int i = 0; i < n; i++) { s[i] = expf(s[i] - m); sum += s[i]; }
            const float inv = 1.0f / sum;
            for (int i = 0; i < n; i++) s[i] *= inv;
        }
        float *ob = out + ((size_t)b * Hq + (size_t)h * G) * D;
        for (int g = 0; g < G; g++)
            for (int d = 0; d < D; d++) ob[(size_t)g * D + d] = 0.0f;
        for (int t = first; t < ctx; t++) {
            const float *v = v_cache + (((size_t)table[t / bs] * H + h) * bs + t % bs) * D;
            for (int g = 0; g < G; g++) {
                const float p = scores[(size_t)g * n + (t - first)];
                float *o = ob + (size_t)g * D;
#pragma omp simd
                for (int d = 0; d < D; d++) o[d] += p * v[d];
            }
        }
        free(scores);
    }
}
