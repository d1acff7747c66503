/* 16-lane float vectors in portable GCC/clang vector types (AVX-512 here, narrower units
 * elsewhere), shared by the kernels in this directory. */
#ifndef PDSERVE_VEC_H
#define PDSERVE_VEC_H

#include <stdint.h>
#include <string.h>

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t i16 __attribute__((vector_size(64)));

#if defined(__clang__)
#define SHUF2(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUF2(a, b, ...) __builtin_shuffle(a, b, (i16){__VA_ARGS__})
#endif

static inline v16 loadv(const float *p) { v16 v; memcpy(&v, p, sizeof v); return v; }
static inline void storev(float *p, v16 v) { memcpy(p, &v, sizeof v); }
#if defined(__AVX2__) && !defined(__AVX512F__)
#include <immintrin.h>
/* On 8-lane units a v16 is two 8-lane registers: code GCC lowers lane by lane is written out on them. */
static inline void halves(v16 x, __m256 *lo, __m256 *hi) {
    memcpy(lo, &x, sizeof *lo);
    memcpy(hi, (const char *)&x + sizeof *lo, sizeof *hi);
}
static inline v16 joined(__m256 lo, __m256 hi) {
    v16 x;
    memcpy(&x, &lo, sizeof lo);
    memcpy((char *)&x + sizeof lo, &hi, sizeof hi);
    return x;
}
/* GCC builds `scalar * v16` by 16 scalar stores and a reload of the vector, which then waits on a
 * failed store-to-load forward: the broadcast, written out. */
static inline v16 splat(float x) { return joined(_mm256_set1_ps(x), _mm256_set1_ps(x)); }
#else
static inline v16 splat(float x) { return (v16){0} + x; }
#endif

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define VEC_AVX2 /* v16 math as two 8-lane halves, in intrinsics */
/* exp on one 8-lane register: vexp below, written out in intrinsics. */
static inline __m256 vexp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), r);
    __m256 p = _mm256_fmadd_ps(r, _mm256_set1_ps(1.98756915e-4f), _mm256_set1_ps(1.39819994e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.33345205e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.16657962e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.66666672e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.00000000e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}
#endif

static inline v16 vselect(i16 mask, v16 a, v16 b) { /* mask ? a : b, lane by lane */
    i16 ai, bi;
    memcpy(&ai, &a, sizeof a);
    memcpy(&bi, &b, sizeof b);
    ai = (ai & mask) | (bi & ~mask);
    memcpy(&a, &ai, sizeof a);
    return a;
}
#ifdef VEC_AVX2
static inline v16 vmax(v16 a, v16 b) {
    __m256 al, ah, bl, bh;
    halves(a, &al, &ah), halves(b, &bl, &bh);
    return joined(_mm256_max_ps(al, bl), _mm256_max_ps(ah, bh));
}
static inline v16 vmin(v16 a, v16 b) {
    __m256 al, ah, bl, bh;
    halves(a, &al, &ah), halves(b, &bl, &bh);
    return joined(_mm256_min_ps(al, bl), _mm256_min_ps(ah, bh));
}
#else
static inline v16 vmax(v16 a, v16 b) { return vselect(a > b, a, b); }
static inline v16 vmin(v16 a, v16 b) { return vselect(a < b, a, b); }
#endif

static inline float hsum(v16 v) {
    float s = 0.0f;
    for (int i = 0; i < 16; i++) s += v[i];
    return s;
}

/* exp(x), x clamped to [-87, 88]: Cody-Waite reduction, degree-6 polynomial, about 1 ulp. On
 * 8-lane units, GCC's lowering of this 16-lane code to halves took ~8 cycles an element (a third of
 * the attention kernel's time in its softmax): vexp8 on each half instead. */
#ifdef VEC_AVX2
static inline v16 vexp(v16 x) {
    __m256 lo, hi;
    halves(x, &lo, &hi);
    return joined(vexp8(lo), vexp8(hi));
}
#else
static inline v16 vexp(v16 x) {
    x = vmin(vmax(x, splat(-87.0f)), splat(88.0f));
    const v16 n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f; /* round to nearest */
    v16 r = x - n * 0.693359375f;
    r = r + n * 2.12194440e-4f;
    v16 p = r * 1.98756915e-4f + 1.39819994e-3f;
    p = p * r + 8.33345205e-3f;
    p = p * r + 4.16657962e-2f;
    p = p * r + 1.66666672e-1f;
    p = p * r + 5.00000000e-1f;
    p = p * r * r + r + 1.0f;
    const i16 bits = (__builtin_convertvector(n, i16) + 127) << 23;
    v16 scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}
#endif

#endif
