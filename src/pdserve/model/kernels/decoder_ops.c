/* The small operations between a decoder layer's GEMMs, fused so that a decode step pays one call
 * each instead of several PyTorch ops (and their temporaries) per layer.
 *
 * float32, row-major, on the caller's torch threads (libgomp is torch's, see paged_attention.c).
 * Small inputs (a decode step) run on the calling thread; large ones (a prefill) split their rows.
 *   add_rms_norm   x += delta; out = weight * x / sqrt(mean(x^2) + eps)   (transformers' RMSNorm)
 *   rope_write_kv  rotate q and k in place (half-split "rotate_half" layout, cos/sin tables by
 *                  position), then store k and v in their cache slots (float32, bfloat16 or fp8)
 *   silu_mul       out = silu(gate) * up, gate and up the two halves of each row
 * and, on the logits, the greedy pick with the normaliser the sampled token's logprob needs:
 *   argmax_logsumexp
 * and a decode step's whole stack of layers, these ops between the projection and attention kernels:
 *   decode_layers
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

/* float32 -> bfloat16 as torch rounds it (to nearest even; a NaN stays a NaN). */
static inline uint16_t bf16_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if (f != f) return 0x7FC0;
    return (uint16_t)((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

/* float32 -> fp8 e4m3fn as torch rounds it (to nearest even, subnormals included; c10's
 * fp8e4m3fn_from_fp32_value). The caller has clamped x to +-448. */
static inline uint8_t fp8_bits(float x) {
    uint32_t u, denorm;
    memcpy(&u, &x, sizeof u);
    const uint32_t sign = u & 0x80000000u;
    u ^= sign;
    uint8_t code;
    if (u >= 1087u << 20) {
        code = 0x7F; /* NaN (and anything from 480 up, which the clamp rules out) */
    } else if (u < 121u << 23) { /* a subnormal or zero: let the FPU round at the denormal scale */
        const uint32_t mask = 141u << 23;
        float f, m;
        memcpy(&f, &u, sizeof f);
        memcpy(&m, &mask, sizeof m);
        f += m;
        memcpy(&denorm, &f, sizeof denorm);
        code = (uint8_t)(denorm - mask);
    } else {
        const uint32_t odd = (u >> 20) & 1;
        u += ((uint32_t)(7 - 127) << 23) + 0x7FFFF + odd;
        code = (uint8_t)(u >> 20);
    }
    return code | (uint8_t)(sign >> 24);
}

enum kv_kind { KV_FLOAT32, KV_BFLOAT16, KV_FP8 };

/* One head's D values into cache slot `slot` (of [blocks, H, bs]), as the cache stores them: float32,
 * bfloat16, or fp8 with the slot's scale (kv_dtype.py's quantize: the row's absolute maximum over
 * 448, 1 for a row of zeros) in `scales`. */
static inline void store_slot(void *cache, float *scales, size_t slot, const float *x, int D, int kind) {
    if (kind == KV_FLOAT32) {
        memcpy((float *)cache + slot * D, x, sizeof(float) * D);
    } else if (kind == KV_BFLOAT16) {
        uint16_t *out = (uint16_t *)cache + slot * D;
        for (int i = 0; i < D; i++) out[i] = bf16_bits(x[i]);
    } else {
        float amax = 0.0f;
        for (int i = 0; i < D; i++) amax = fmaxf(amax, fabsf(x[i]));
        const float scale = amax > 0.0f ? amax / 448.0f : 1.0f;
        uint8_t *out = (uint8_t *)cache + slot * D;
        for (int i = 0; i < D; i++) out[i] = fp8_bits(fminf(fmaxf(x[i] / scale, -448.0f), 448.0f));
        scales[slot] = scale;
    }
}

/* q: [tokens, Hq, D] with row stride q_stride; k, v: [tokens, H, D] with strides k_stride,
 * v_stride. Caches [blocks, H, bs, D] of `kind` (fp8's scales [blocks, H, bs]; NULL otherwise);
 * token t goes to (slot_blocks[t], slot_offsets[t]). */
void rope_write_kv(float *q, int64_t q_stride, float *k, int64_t k_stride, const float *v,
                   int64_t v_stride, const int64_t *positions, const float *cos, const float *sin,
                   void *k_cache, void *v_cache, float *k_scales, float *v_scales, int kind,
                   const int64_t *slot_blocks, const int64_t *slot_offsets, int tokens, int Hq, int H,
                   int D, int bs, int nthreads) {
    const int half = D / 2;
#pragma omp parallel for num_threads(nthreads) if ((int64_t)tokens * (Hq + 2 * H) * D >= PARALLEL_MIN_ELEMENTS)
    for (int t = 0; t < tokens; t++) {
        const float *c = cos + positions[t] * D, *s = sin + positions[t] * D;
        for (int h = 0; h < Hq; h++) rotate(q + t * q_stride + (int64_t)h * D, c, s, half);
        for (int h = 0; h < H; h++) {
            float *kh = k + t * k_stride + (int64_t)h * D;
            rotate(kh, c, s, half);
            const size_t slot = ((size_t)slot_blocks[t] * H + h) * bs + slot_offsets[t];
            store_slot(k_cache, k_scales, slot, kh, D, kind);
            store_slot(v_cache, v_scales, slot, v + t * v_stride + (int64_t)h * D, D, kind);
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

/* A decode step's decoder layers in one call: every row a single-token decode, tensor parallel
 * size 1, every projection a kernels/int4_linear.c one. Per layer the ops above and the linear and
 * attention kernels run in the order llama.py's DecoderLayer calls them, on the same buffers'
 * contents, so the hidden states are bit for bit those of the Python path; what goes is the Python
 * between ~9 calls per layer (fused_decode.py says what it cost). The linear and attention kernels
 * live in their own libraries and come as function pointers (all their arguments are pointers,
 * ints and floats, so one pointer type serves the int4 and int8 kernels). */
typedef void (*linear_fn)(const float *x, int m, int k, const void *w, const void *scales, int n,
                          float *y, int8_t *xq, float *dx, float *t, int nthreads);
typedef void (*attend_fn)(const float *q, const void *k_cache, const void *v_cache,
                          const int64_t *tables, const int32_t *ctx_lens, float *out, int B, int Hq,
                          int H, int D, int bs, int max_blocks, int window, float scale, int nthreads);
typedef void (*attend_scaled_fn)(const float *q, const void *k_cache, const void *v_cache,
                                 const float *k_scales, const float *v_scales, const int64_t *tables,
                                 const int32_t *ctx_lens, float *out, int B, int Hq, int H, int D,
                                 int bs, int max_blocks, int window, float scale, int nthreads);

struct linear { /* out = n rows of the weight, in = k (multiples of 16 and 32) */
    linear_fn fn;
    const void *w, *scales;
    int k, n;
};

struct layer {
    struct linear qkv, o, gate_up, down;
    const float *qkv_bias, *input_norm, *post_attn_norm; /* qkv_bias may be NULL */
    void *k_cache, *v_cache;
    float *k_scales, *v_scales; /* fp8's, else NULL */
};

struct model {
    int num_layers, hidden, heads, kv_heads, head_dim, inter, block_size, kv_kind;
    float eps, scale; /* the RMSNorms' epsilon; attention's 1 / sqrt(head_dim) */
    const float *cos, *sin, *final_norm;
    void *attend; /* an attend_fn, or for fp8 an attend_scaled_fn */
    const struct layer *layers;
};

struct step { /* the step's metadata (model_runner.py) and scratch, `rows` rows of each buffer */
    int rows, max_blocks, window;
    const int64_t *positions, *slot_blocks, *slot_offsets, *tables;
    const int32_t *context_lens;
    float *h, *qkv, *q, *attn, *delta, *gate_up, *act; /* [rows, each one's width] */
    int8_t *xq; /* [rows, largest input] and [rows, largest input / 32] twice: the linear kernels' */
    float *dx, *t;
};

static void project(const struct linear *l, const float *x, float *y, const struct step *s, int nthreads) {
    l->fn(x, s->rows, l->k, l->w, l->scales, l->n, y, s->xq, s->dx, s->t, nthreads);
}

/* x: the residual stream [rows, hidden] (the embeddings in, updated in place); out: the final
 * norm's output [rows, hidden]. */
void decode_layers(const struct model *m, const struct step *s, float *x, float *out, int nthreads) {
    const int R = s->rows, D = m->head_dim, q_width = m->heads * D, kv_width = m->kv_heads * D;
    const float *delta = NULL;
    for (int i = 0; i < m->num_layers; i++) {
        const struct layer *L = m->layers + i;
        add_rms_norm(x, delta, L->input_norm, s->h, R, m->hidden, m->eps, nthreads);
        project(&L->qkv, s->h, s->qkv, s, nthreads);
        const int qkv_n = L->qkv.n;
        if (L->qkv_bias)
            for (int r = 0; r < R; r++)
                for (int c = 0; c < qkv_n; c++) s->qkv[(size_t)r * qkv_n + c] += L->qkv_bias[c];
        float *q = s->qkv, *k = q + q_width, *v = k + kv_width;
        rope_write_kv(q, qkv_n, k, qkv_n, v, qkv_n, s->positions, m->cos, m->sin, L->k_cache,
                      L->v_cache, L->k_scales, L->v_scales, m->kv_kind, s->slot_blocks,
                      s->slot_offsets, R, m->heads, m->kv_heads, D, m->block_size, nthreads);
        for (int r = 0; r < R; r++) memcpy(s->q + (size_t)r * q_width, q + (size_t)r * qkv_n, sizeof(float) * q_width);
        if (m->kv_kind == KV_FP8)
            ((attend_scaled_fn)m->attend)(s->q, L->k_cache, L->v_cache, L->k_scales, L->v_scales,
                                          s->tables, s->context_lens, s->attn, R, m->heads, m->kv_heads,
                                          D, m->block_size, s->max_blocks, s->window, m->scale, nthreads);
        else
            ((attend_fn)m->attend)(s->q, L->k_cache, L->v_cache, s->tables, s->context_lens, s->attn, R,
                                   m->heads, m->kv_heads, D, m->block_size, s->max_blocks, s->window,
                                   m->scale, nthreads);
        project(&L->o, s->attn, s->delta, s, nthreads);
        add_rms_norm(x, s->delta, L->post_attn_norm, s->h, R, m->hidden, m->eps, nthreads);
        project(&L->gate_up, s->h, s->gate_up, s, nthreads);
        silu_mul(s->gate_up, s->act, R, m->inter, nthreads);
        project(&L->down, s->act, s->delta, s, nthreads);
        delta = s->delta;
    }
    add_rms_norm(x, delta, m->final_norm, out, R, m->hidden, m->eps, nthreads);
}
