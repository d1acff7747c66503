/* int4_linear.c's AVX-512 path: VNNI's dpbusd multiplies 4 unsigned codes by 4 int8 inputs and
 * adds them into each of 16 int32 lanes, one output row per lane. Included by int4_linear.c only. */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define ROWS_PER_PASS 4 /* activation rows sharing one unpacking of a block's codes */

static inline __m512i splat4(const int8_t *p) { /* 4 int8 inputs in every lane */
    int32_t v;
    memcpy(&v, p, sizeof v);
    return _mm512_set1_epi32(v);
}

static void quantize(const float *x, int m, int k, int8_t *xq, float *dx, float *t) {
    const int groups = k / 32;
    for (int r = 0; r < m; r++) {
        for (int g = 0; g < groups; g++) {
            const float *xg = x + (size_t)r * k + g * 32;
            __m512 a = _mm512_loadu_ps(xg), b = _mm512_loadu_ps(xg + 16);
            float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
            __m512 inv = _mm512_set1_ps(amax > 0 ? 127.0f / amax : 0.0f);
            __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(a, inv));
            __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(b, inv));
            int8_t *out = xq + (size_t)r * k + g * 32;
            _mm_storeu_si128((__m128i *)out, _mm512_cvtsepi32_epi8(q0));
            _mm_storeu_si128((__m128i *)(out + 16), _mm512_cvtsepi32_epi8(q1));
            dx[(size_t)r * groups + g] = amax / 127.0f;
            t[(size_t)r * groups + g] = amax / 127.0f * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
        }
    }
}

/* x [m, k] -> y [m, n]; scratch: xq [m, k] int8, dx and t [m, k / 32] float. */
void int4_linear(const float *x, int m, int k, const uint8_t *w, const uint16_t *scales, int n, float *y,
                 int8_t *xq, float *dx, float *t, int nthreads) {
    const int groups = k / 32, blocks = n / 16;
    quantize(x, m, k, xq, dx, t);
    const __m512i low4 = _mm512_set1_epi8(0x0F);
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1 && blocks > 1)
    for (int nb = 0; nb < blocks; nb++) {
        const uint8_t *wb = w + (size_t)nb * groups * 256;
        const uint16_t *sb = scales + (size_t)nb * groups * 32;
        for (int r0 = 0; r0 < m; r0 += ROWS_PER_PASS) {
            const int rows = m - r0 < ROWS_PER_PASS ? m - r0 : ROWS_PER_PASS;
            __m512 acc[ROWS_PER_PASS];
            for (int j = 0; j < ROWS_PER_PASS; j++) acc[j] = _mm512_setzero_ps();
            for (int g = 0; g < groups; g++) {
                __m512i c[8];
                for (int q = 0; q < 4; q++) {
                    __m512i v = _mm512_loadu_si512((const void *)(wb + (size_t)g * 256 + q * 64));
                    c[2 * q] = _mm512_and_si512(v, low4);
                    c[2 * q + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
                }
                const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sb + g * 32)));
                const __m512 z = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sb + g * 32 + 16)));
                for (int j = 0; j < rows; j++) {
                    const size_t r = r0 + j;
                    const int8_t *xg = xq + r * k + g * 32;
                    __m512i d0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), c[0], splat4(xg));
                    __m512i d1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), c[1], splat4(xg + 4));
                    for (int i = 2; i < 8; i += 2) { /* two chains: dpbusd's latency, not its rate */
                        d0 = _mm512_dpbusd_epi32(d0, c[i], splat4(xg + 4 * i));
                        d1 = _mm512_dpbusd_epi32(d1, c[i + 1], splat4(xg + 4 * i + 4));
                    }
                    const __m512 sd = _mm512_mul_ps(s, _mm512_set1_ps(dx[r * groups + g]));
                    acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(d0, d1)), sd, acc[j]);
                    acc[j] = _mm512_fmadd_ps(z, _mm512_set1_ps(t[r * groups + g]), acc[j]);
                }
            }
            for (int j = 0; j < rows; j++) _mm512_storeu_ps(y + (size_t)(r0 + j) * n + nb * 16, acc[j]);
        }
    }
}

/* The same for an int8 weight with one scale per output row: codes stored plus 128 (unsigned, the
 * operand dpbusd wants unsigned), 16 rows per block, per group 8 planes of 64 bytes (byte 4j+b of
 * plane i: row j's code for input 4i+b); the extra 128 * sum(xq) is the same for every row:
 *   y = s * (sum_g dx_g * sum_k (q_k + 128) xq_k  -  128 * sum_g dx_g * sum_k xq_k)               */
void int8_linear(const float *x, int m, int k, const uint8_t *w, const float *scales, int n, float *y,
                 int8_t *xq, float *dx, float *t, int nthreads) {
    const int groups = k / 32, blocks = n / 16;
    quantize(x, m, k, xq, dx, t);
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1 && blocks > 1)
    for (int nb = 0; nb < blocks; nb++) {
        const uint8_t *wb = w + (size_t)nb * groups * 512;
        const __m512 s = _mm512_loadu_ps(scales + nb * 16);
        for (int r0 = 0; r0 < m; r0 += ROWS_PER_PASS) {
            const int rows = m - r0 < ROWS_PER_PASS ? m - r0 : ROWS_PER_PASS;
            __m512 acc[ROWS_PER_PASS];
            for (int j = 0; j < ROWS_PER_PASS; j++) acc[j] = _mm512_setzero_ps();
            for (int g = 0; g < groups; g++) {
                const uint8_t *wg = wb + (size_t)g * 512;
                for (int j = 0; j < rows; j++) {
                    const size_t r = r0 + j;
                    const int8_t *xg = xq + r * k + g * 32;
                    __m512i d0 = _mm512_setzero_si512(), d1 = _mm512_setzero_si512();
                    for (int i = 0; i < 8; i += 2) {
                        d0 = _mm512_dpbusd_epi32(d0, _mm512_loadu_si512((const void *)(wg + i * 64)), splat4(xg + 4 * i));
                        d1 = _mm512_dpbusd_epi32(d1, _mm512_loadu_si512((const void *)(wg + i * 64 + 64)),
                                                 splat4(xg + 4 * i + 4));
                    }
                    acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(d0, d1)),
                                             _mm512_set1_ps(dx[r * groups + g]), acc[j]);
                }
            }
            for (int j = 0; j < rows; j++) {
                const float *tr = t + (size_t)(r0 + j) * groups;
                float total = 0.0f;
                for (int g = 0; g < groups; g++) total += tr[g];
                __m512 v = _mm512_mul_ps(s, _mm512_sub_ps(acc[j], _mm512_set1_ps(128.0f * total)));
                _mm512_storeu_ps(y + (size_t)(r0 + j) * n + nb * 16, v);
            }
        }
    }
}
