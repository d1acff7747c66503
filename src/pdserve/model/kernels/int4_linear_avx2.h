/* int4_linear.c's AVX2 path, llama.cpp's scheme for CPUs without VNNI: maddubs multiplies unsigned
 * codes by int8 inputs into int16 pair sums, madd with ones adds the pairs into int32 lanes. Each
 * 64-byte vector of the layout is read as two 32-byte halves, rows 0-7 and 8-15 of its block.
 *
 * int4: a pair sum is at most 2 * 15 * 127, so a group's 8 planes add up in int16 (30,480 <
 * 32,767) before one madd; both halves of a block go in one pass, so each broadcast input serves
 * 16 rows (17 % faster at 1 and 32 rows than a pass per half: SmolLM2's projections, runs alternated).
 * int8: the stored code minus 128 is the signed weight w; maddubs takes |w| (at most 128,
 * unsigned) and the input with w's sign, so its pair sums stay within int16 (2 * 128 * 127) and
 * each plane is widened on its own; no 128 * sum(xq) correction is needed.
 * Included by int4_linear.c only. */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

static inline __m256i splat4(const int8_t *p) { /* 4 int8 inputs in every lane */
    int32_t v;
    memcpy(&v, p, sizeof v);
    return _mm256_set1_epi32(v);
}

static inline float max8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

static inline int32_t sum8(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1))));
}

static void quantize(const float *x, int m, int k, int8_t *xq, float *dx, float *t) {
    const int groups = k / 32;
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7); /* undoes the packs' lane interleave */
    for (int r = 0; r < m; r++) {
        for (int g = 0; g < groups; g++) {
            const float *xg = x + (size_t)r * k + g * 32;
            __m256 v[4], top = _mm256_setzero_ps();
            for (int i = 0; i < 4; i++) {
                v[i] = _mm256_loadu_ps(xg + 8 * i);
                top = _mm256_max_ps(top, _mm256_andnot_ps(sign, v[i]));
            }
            const float amax = max8(top);
            const __m256 inv = _mm256_set1_ps(amax > 0 ? 127.0f / amax : 0.0f);
            __m256i q[4];
            for (int i = 0; i < 4; i++) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));
            __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
            _mm256_storeu_si256((__m256i *)(xq + (size_t)r * k + g * 32), _mm256_permutevar8x32_epi32(bytes, order));
            const __m256i total = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
            dx[(size_t)r * groups + g] = amax / 127.0f;
            t[(size_t)r * groups + g] = amax / 127.0f * (float)sum8(total);
        }
    }
}

/* One block of 16 output rows for every activation row, INT4_ROWS rows per pass over its codes.
 * `prefetch` (a constant at each call): issue a prefetch W_PREFETCH bytes ahead of each vector read.
 * At one row the kernel waits on memory and the prefetches made SmolLM2's projections 25 % faster on
 * an AVX2-only EPYC (4.0 -> 3.0 ms); at 32 it is compute-bound, and the same loop with them, even
 * skipped at run time, was 10 % slower: two copies of the loop. */
#define INT4_ROWS 2 /* activation rows per pass (2 x 2 halves of sums; 1 and 4 measured slower) */
#define W_PREFETCH 4096
static inline __attribute__((always_inline)) void int4_block(const uint8_t *wb, const uint16_t *sb, int m, int k,
                                                              int groups, int n, int nb, const int8_t *xq,
                                                              const float *dx, const float *t, float *y,
                                                              const int prefetch) {
    const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    for (int r0 = 0; r0 < m; r0 += INT4_ROWS) {
        const int rows = m - r0 < INT4_ROWS ? m - r0 : INT4_ROWS;
        __m256 acc[INT4_ROWS][2];
        for (int j = 0; j < INT4_ROWS; j++) acc[j][0] = acc[j][1] = _mm256_setzero_ps();
        for (int g = 0; g < groups; g++) {
            __m256i p[INT4_ROWS][2];
            for (int j = 0; j < INT4_ROWS; j++) p[j][0] = p[j][1] = _mm256_setzero_si256();
            for (int q = 0; q < 4; q++) {
                const uint8_t *wq = wb + (size_t)g * 256 + q * 64;
                if (prefetch) _mm_prefetch((const char *)wq + W_PREFETCH, _MM_HINT_T0);
                const __m256i v0 = _mm256_loadu_si256((const __m256i *)wq);
                const __m256i v1 = _mm256_loadu_si256((const __m256i *)(wq + 32));
                const __m256i a0 = _mm256_and_si256(v0, low4), b0 = _mm256_and_si256(_mm256_srli_epi16(v0, 4), low4);
                const __m256i a1 = _mm256_and_si256(v1, low4), b1 = _mm256_and_si256(_mm256_srli_epi16(v1, 4), low4);
                for (int j = 0; j < rows; j++) {
                    const int8_t *xg = xq + (size_t)(r0 + j) * k + g * 32 + 8 * q;
                    const __m256i xa = splat4(xg), xb = splat4(xg + 4);
                    p[j][0] = _mm256_add_epi16(p[j][0], _mm256_add_epi16(_mm256_maddubs_epi16(a0, xa),
                                                                         _mm256_maddubs_epi16(b0, xb)));
                    p[j][1] = _mm256_add_epi16(p[j][1], _mm256_add_epi16(_mm256_maddubs_epi16(a1, xa),
                                                                         _mm256_maddubs_epi16(b1, xb)));
                }
            }
            for (int h = 0; h < 2; h++) {
                const __m256 s = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sb + g * 32 + 8 * h)));
                const __m256 z = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sb + g * 32 + 16 + 8 * h)));
                for (int j = 0; j < rows; j++) {
                    const size_t r = r0 + j;
                    const __m256i d = _mm256_madd_epi16(p[j][h], ones);
                    const __m256 sd = _mm256_mul_ps(s, _mm256_set1_ps(dx[r * groups + g]));
                    acc[j][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), sd, acc[j][h]);
                    acc[j][h] = _mm256_fmadd_ps(z, _mm256_set1_ps(t[r * groups + g]), acc[j][h]);
                }
            }
        }
        for (int j = 0; j < rows; j++) {
            _mm256_storeu_ps(y + (size_t)(r0 + j) * n + nb * 16, acc[j][0]);
            _mm256_storeu_ps(y + (size_t)(r0 + j) * n + nb * 16 + 8, acc[j][1]);
        }
    }
}

/* x [m, k] -> y [m, n]; scratch: xq [m, k] int8, dx and t [m, k / 32] float. */
void int4_linear(const float *x, int m, int k, const uint8_t *w, const uint16_t *scales, int n, float *y,
                 int8_t *xq, float *dx, float *t, int nthreads) {
    const int groups = k / 32, blocks = n / 16;
    quantize(x, m, k, xq, dx, t);
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1 && blocks > 1)
    for (int nb = 0; nb < blocks; nb++) {
        const uint8_t *wb = w + (size_t)nb * groups * 256;
        const uint16_t *sb = scales + (size_t)nb * groups * 32;
        if (m <= INT4_ROWS) /* one pass: the codes stream from memory once */
            int4_block(wb, sb, m, k, groups, n, nb, xq, dx, t, y, 1);
        else
            int4_block(wb, sb, m, k, groups, n, nb, xq, dx, t, y, 0);
    }
}

/* The int8 layout: per block of 16 rows and group, 8 planes of 64 bytes whose byte 4j+b is row j's
 * code plus 128 for input 4i+b. A pass reads whole planes (rows 0-7 and 8-15 of the block as two
 * halves), so the weights stream in order, and a plane's weight-only work (load, the flip back to
 * signed, |w|) is done once and serves every row of the pass; per row remain the sign transfer,
 * maddubs and the widening add. A pass per half, reading every other 32 bytes, ran SmolLM2's
 * projections at one row at 11.5 GB/s on an AVX2-only EPYC. Where one pass streams the codes, it
 * prefetches as int4_block does (6.8 -> 6.3 ms there). */
#define ROWS_PER_PASS 3 /* activation rows per pass: 2 x 3 sums, the planes and an input in 16 registers */
static inline __attribute__((always_inline)) void int8_pass(const uint8_t *wb, const int8_t *xq, const float *dx,
                                                             int k, int groups, int rows, __m256 acc[][2],
                                                             const int prefetch) {
    const __m256i flip = _mm256_set1_epi8((char)0x80), ones = _mm256_set1_epi16(1);
    for (int j = 0; j < rows; j++) acc[j][0] = acc[j][1] = _mm256_setzero_ps();
    for (int g = 0; g < groups; g++) {
        const uint8_t *wg = wb + (size_t)g * 512;
        __m256i d[ROWS_PER_PASS][2];
        for (int j = 0; j < rows; j++) d[j][0] = d[j][1] = _mm256_setzero_si256();
        for (int i = 0; i < 8; i++) {
            if (prefetch) _mm_prefetch((const char *)wg + i * 64 + W_PREFETCH, _MM_HINT_T0);
            const __m256i w0 = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(wg + i * 64)), flip);
            const __m256i w1 = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(wg + i * 64 + 32)), flip);
            const __m256i aw0 = _mm256_abs_epi8(w0), aw1 = _mm256_abs_epi8(w1);
            for (int j = 0; j < rows; j++) {
                const __m256i x = splat4(xq + (size_t)j * k + g * 32 + 4 * i);
                d[j][0] = _mm256_add_epi32(d[j][0], _mm256_madd_epi16(_mm256_maddubs_epi16(aw0, _mm256_sign_epi8(x, w0)), ones));
                d[j][1] = _mm256_add_epi32(d[j][1], _mm256_madd_epi16(_mm256_maddubs_epi16(aw1, _mm256_sign_epi8(x, w1)), ones));
            }
        }
        for (int j = 0; j < rows; j++) {
            const __m256 sx = _mm256_set1_ps(dx[(size_t)j * groups + g]);
            acc[j][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d[j][0]), sx, acc[j][0]);
            acc[j][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d[j][1]), sx, acc[j][1]);
        }
    }
}

void int8_linear(const float *x, int m, int k, const uint8_t *w, const float *scales, int n, float *y,
                 int8_t *xq, float *dx, float *t, int nthreads) {
    const int groups = k / 32, blocks = n / 16;
    quantize(x, m, k, xq, dx, t);
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1 && blocks > 1)
    for (int nb = 0; nb < blocks; nb++) {
        const uint8_t *wb = w + (size_t)nb * groups * 512;
        const __m256 s0 = _mm256_loadu_ps(scales + nb * 16), s1 = _mm256_loadu_ps(scales + nb * 16 + 8);
        for (int r0 = 0; r0 < m; r0 += ROWS_PER_PASS) {
            const int rows = m - r0 < ROWS_PER_PASS ? m - r0 : ROWS_PER_PASS;
            __m256 acc[ROWS_PER_PASS][2];
            const int8_t *xr = xq + (size_t)r0 * k;
            const float *dr = dx + (size_t)r0 * groups;
            /* constant row counts: the row loops unroll into registers; prefetches (int4_block) only
             * where one pass streams the codes */
            if (m == 1)
                int8_pass(wb, xr, dr, k, groups, 1, acc, 1);
            else if (rows == ROWS_PER_PASS)
                int8_pass(wb, xr, dr, k, groups, ROWS_PER_PASS, acc, m == ROWS_PER_PASS);
            else if (rows == 1)
                int8_pass(wb, xr, dr, k, groups, 1, acc, 0);
            else
                int8_pass(wb, xr, dr, k, groups, rows, acc, m == rows);
            for (int j = 0; j < rows; j++) {
                _mm256_storeu_ps(y + (size_t)(r0 + j) * n + nb * 16, _mm256_mul_ps(s0, acc[j][0]));
                _mm256_storeu_ps(y + (size_t)(r0 + j) * n + nb * 16 + 8, _mm256_mul_ps(s1, acc[j][1]));
            }
        }
    }
}
