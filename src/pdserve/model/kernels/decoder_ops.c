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
        for (int c = 0; c < vec_cols; c += 16) storev(o + c, loadv(weight + c) * (loadv(xr + c) * inv));
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
        for (int c = 0; c < vec_cols; c += 16) {
            const v16 x = loadv(g + c);
            storev(o + c, x / (1.0f + vexp(-x)) * loadv(u + c));
        }
        for (int c = vec_cols; c < inter; c++) o[c] = g[c] / (1.0f + expf(-g[c])) * u[c];
    }
}

/* Per row of logits [rows, vocab]: the first index of the maximum (torch.argmax) and
 * log(sum(exp(x))) (torch.logsumexp), in two passes over the row. */
void argmax_logsumexp(const float *logits, int rows, int vocab, int64_t *argmax, float *lse,
                      int nthreads) {
    const int vec_cols = vocab - vocab % 16;
    const i16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
#pragma omp parallel for num_threads(nthreads) if ((int64_t)rows * vocab >= PARALLEL_MIN_ELEMENTS)
    for (int r = 0; r < rows; r++) {
        const float *x = logits + (size_t)r * vocab;
        float best = -INFINITY;
        int64_t best_at = 0;
        if (vec_cols) {
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
        }
        for (int c = vec_cols; c < vocab; c++)
            if (x[c] > best) best = x[c], best_at = c;
        v16 sums = {0};
        float tail = 0.0f;
        for (int c = 0; c < vec_cols; c += 16) sums += vexp(loadv(x + c) - best);
        for (int c = vec_cols; c < vocab; c++) tail += expf(x[c] - best);
        argmax[r] = best_at;
        lse[r] = best + logf(hsum(sums) + tail);
    }
}
