/* Decode attention over the paged KV cache, reading K and V in place (no gather copy).
 *
 * One query token per sequence. Work item i = (sequence b, KV head h), spread over `nthreads`
 * OpenMP threads. Loaded into a process that has already loaded PyTorch, libgomp.so.1 resolves to
 * torch's own copy, so these are torch's intra-op threads (no second pool spinning against the
 * first). q and out float32; K and V float32 (`paged_decode_attention`), bfloat16
 * (`paged_decode_attention_bf16`) or fp8 e4m3 with one float32 scale per slot
 * (`paged_decode_attention_fp8`, where the compiler has _Float16), widened to float32 as they are
 * loaded: a half or a quarter of the bytes to stream.
 * Layout: q, out [B, Hq, D]; k_cache, v_cache [N, H, bs, D] (HND); tables [B, max_blocks].
 *
 * The fast path (head_dim a multiple of 16, at most 256) uses GCC/clang vector types, so it is
 * portable C that compiles to AVX-512 here and to narrower units elsewhere:
 *   - scores: one 16-lane partial product per token, then a transpose-and-add tree turns 16 tokens'
 *     partials into their 16 dot products (no horizontal sum per token);
 *   - softmax: the vectorized exp of vec.h;
 *   - values: the output row stays in registers while the tokens stream past.
 * Rows are walked with a (block, offset) cursor: no division per token.
 * Other head sizes take the plain loop at the end. On AVX2 without AVX-512 (8-lane units), head sizes
 * that are a multiple of 8 take paged_attention_avx2.h instead, written for 16 registers.
 */
#include <math.h>
#include <stdlib.h>

#include "vec.h"

#define MAX_CHUNKS 16 /* head_dim up to 256 on the fast path */
#define GB 4 /* query heads sharing each load of a K or V row */
#define PREFETCH_BYTES 8192 /* how far ahead of its reads a cursor prefetches (at least 16 rows) */
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(__AVX512F__)
#define ATTEND_AVX2 /* 8-lane units: paged_attention_avx2.h's kernel */
#endif

/* The four levels of a 16 x 16 transpose-and-add: each pairs two vectors and halves the number of
 * partial sums per token, keeping tokens in order. */
#if defined(__AVX2__) && !defined(__AVX512F__)
/* On 8-lane units GCC lowers these 16-lane shuffles lane by lane (a load and an insert per
 * element); the same sums from each v16's two halves (vec.h): fold8 adds the halves, fold4 pairs
 * their 128-bit quarters, fold2 and fold1 shuffle within quarters. */
static inline __m256 fold_half(v16 x, int level) { /* level: 8, 4, 2 or 1, as the functions below */
    __m256 lo, hi;
    halves(x, &lo, &hi);
    if (level == 8) return _mm256_add_ps(lo, hi);
    const __m256 t0 = _mm256_permute2f128_ps(lo, hi, 0x20), t1 = _mm256_permute2f128_ps(lo, hi, 0x31);
    if (level == 4) return _mm256_add_ps(t0, t1);
    if (level == 2) return _mm256_add_ps(_mm256_shuffle_ps(t0, t1, 0x44), _mm256_shuffle_ps(t0, t1, 0xEE));
    return _mm256_add_ps(_mm256_shuffle_ps(t0, t1, 0x88), _mm256_shuffle_ps(t0, t1, 0xDD));
}
static inline v16 fold8(v16 a, v16 b) { return joined(fold_half(a, 8), fold_half(b, 8)); }
static inline v16 fold4(v16 a, v16 b) { return joined(fold_half(a, 4), fold_half(b, 4)); }
static inline v16 fold2(v16 a, v16 b) { return joined(fold_half(a, 2), fold_half(b, 2)); }
static inline v16 fold1(v16 a, v16 b) { return joined(fold_half(a, 1), fold_half(b, 1)); }
/* Lane r: the sum of p[r]'s 8 lanes (paged_attention_avx2.h's transpose-and-add). */
static inline __m256 sum8x8(const __m256 p[8]) {
    const __m256 t0 = _mm256_hadd_ps(p[0], p[1]), t1 = _mm256_hadd_ps(p[2], p[3]);
    const __m256 t2 = _mm256_hadd_ps(p[4], p[5]), t3 = _mm256_hadd_ps(p[6], p[7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3); /* [p0..p3 | p4..p7] per half */
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}
#else
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
#endif

/* The kernel once per stored KV type (paged_attention_kv.h). */
#define KV_T float
#define LOAD_KV(p) loadv(p)
#define LOAD8_KV(p) _mm256_loadu_ps(p)
#define LOAD16_KV(p, lo, hi) (*(lo) = LOAD8_KV(p), *(hi) = LOAD8_KV((p) + 8))
#define KV_FLOAT(x) (x)
#define NAME(x) x##_f32
#define ENTRY paged_decode_attention
#include "paged_attention_kv.h"
#undef KV_T
#undef LOAD_KV
#undef LOAD8_KV
#undef LOAD16_KV
#undef KV_FLOAT
#undef NAME
#undef ENTRY

/* bfloat16 is the top half of a float32: widen each 16-bit lane and shift it into place. */
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));

static inline v16 load_bf16(const uint16_t *p) {
    u16x16 h;
    memcpy(&h, p, sizeof h);
    u32x16 w = __builtin_convertvector(h, u32x16) << 16;
    v16 f;
    memcpy(&f, &w, sizeof f);
    return f;
}

#if defined(__AVX2__) && !defined(__AVX512F__)
static inline __m256 load8_bf16(const uint16_t *p) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
/* 16 elements as two registers, each bfloat16 the top half of its float32 lane: elements 0-3 and
 * 8-11 in lo, 4-7 and 12-15 in hi (the unpacks work within 128-bit lanes). */
static inline void load16_bf16(const uint16_t *p, __m256 *lo, __m256 *hi) {
    const __m256i v = _mm256_loadu_si256((const __m256i *)p), z = _mm256_setzero_si256();
    *lo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(z, v));
    *hi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(z, v));
}
#endif

static inline float bf16_float(uint16_t x) {
    uint32_t w = (uint32_t)x << 16;
    float f;
    memcpy(&f, &w, sizeof f);
    return f;
}

#define KV_T uint16_t
#define LOAD_KV(p) load_bf16(p)
#define LOAD8_KV(p) load8_bf16(p)
#define LOAD16_KV(p, lo, hi) load16_bf16(p, lo, hi)
#define KV_INTERLEAVED
#define KV_FLOAT(x) bf16_float(x)
#define NAME(x) x##_bf16
#define ENTRY paged_decode_attention_bf16
#include "paged_attention_kv.h"
#undef KV_INTERLEAVED
#undef KV_T
#undef LOAD_KV
#undef LOAD8_KV
#undef LOAD16_KV
#undef KV_FLOAT
#undef NAME
#undef ENTRY

#ifdef __FLT16_MAX__ /* the compiler has _Float16 */
/* fp8 e4m3 (bias 7) is the top of a float16 (bias 15) shifted right by 7: sign to bit 15, exponent
 * and mantissa to bits 7..13. The float16 converts exactly to float32 in hardware, subnormals
 * included, at 2^-8 of the code's value; ROW_UNIT (2^8) folds the difference into each row's
 * scale. Codes are never NaN (writes saturate at +-448). */
typedef uint8_t u8x16 __attribute__((vector_size(16)));
typedef _Float16 h16x16 __attribute__((vector_size(32)));

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__F16C__))
#include <immintrin.h>
/* GCC 12 converts a vector of _Float16 one lane at a time: the instructions, directly (on an
 * AVX2 CPU the generic conversion below made fp8 KV 2.4x slower than float32). 16 codes -> the
 * bits of 16 float16s. */
static inline __m256i fp8_halfbits(const uint8_t *p) {
    const __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p));
    return _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x7F)), 7),
                           _mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x80)), 8));
}
#if defined(__AVX512F__)
static inline v16 load_fp8(const uint8_t *p) { return (v16)_mm512_cvtph_ps(fp8_halfbits(p)); }
#else /* F16C: 8 lanes per instruction */
static inline __m256 load8_fp8(const uint8_t *p) {
    const __m128i w = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)p));
    const __m128i bits = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x7F)), 7),
                                      _mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x80)), 8));
    return _mm256_cvtph_ps(bits);
}
static inline v16 load_fp8(const uint8_t *p) {
    const __m256i bits = fp8_halfbits(p);
    return joined(_mm256_cvtph_ps(_mm256_castsi256_si128(bits)), _mm256_cvtph_ps(_mm256_extracti128_si256(bits, 1)));
}
#endif
#else
static inline v16 load_fp8(const uint8_t *p) {
    u8x16 b;
    memcpy(&b, p, sizeof b);
    const u16x16 w = __builtin_convertvector(b, u16x16);
    const u16x16 bits = ((w & 0x7F) << 7) | ((w & 0x80) << 8);
    h16x16 h;
    memcpy(&h, &bits, sizeof h);
    return __builtin_convertvector(h, v16);
}
#endif

static inline float fp8_float(uint8_t x) {
    const uint16_t bits = (uint16_t)(((x & 0x7F) << 7) | ((x & 0x80) << 8));
    _Float16 h;
    memcpy(&h, &bits, sizeof h);
    return (float)h;
}

#define KV_SCALED
#define ROW_UNIT 256.0f
#define KV_T uint8_t
#define LOAD_KV(p) load_fp8(p)
#define LOAD8_KV(p) load8_fp8(p)
#define LOAD16_KV(p, lo, hi) (*(lo) = LOAD8_KV(p), *(hi) = LOAD8_KV((p) + 8))
#define KV_FLOAT(x) fp8_float(x)
#define NAME(x) x##_fp8
#define ENTRY paged_decode_attention_fp8
#include "paged_attention_kv.h"
#endif
