/* y = x W^T for a weight-only int4 or int8 weight, with activations quantized to int8 per group of
 * 32 (llama.cpp's Q8 scheme) so that the CPU multiplies codes by 8-bit inputs in integers.
 *
 * float32, on the caller's torch threads (output row blocks split between them). Layout, made by
 * linear.py (`Int4Linear`): output rows in blocks of 16, one per 32-bit lane of a 64-byte vector,
 * so a block needs no horizontal sums and any input size (a multiple of 32) fills every lane. Per
 * block and group of 32 inputs, 256 bytes: four 64-byte vectors whose low and high nibbles are
 * planes 2q and 2q+1; byte 4j+b of plane i holds row j's code for input 4i+b. Then per block and
 * group the 16 rows' scales and then their zeros minus 8 * scales, float16 [G][2][16]. Per row and
 * group:
 *   sum_k w_k x_k = s * dx * sum_k q_k xq_k + (z - 8s) * dx * sum_k xq_k   (w = (q - 8) s + z)
 * The int8 layout (`Int8Linear`) is the same with a byte per code, plus 128, and a float32 scale
 * per row.
 *
 * Two builds of one layout: AVX512-VNNI (int4_linear_avx512.h), and AVX2 with FMA and F16C
 * (int4_linear_avx2.h), which reads each 64-byte vector as two 32-byte halves of 8 rows.
 */
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include "int4_linear_avx512.h"
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include "int4_linear_avx2.h"
#else
#error "int4_linear needs AVX512-VNNI and AVX512-BW, or AVX2, FMA and F16C"
#endif
