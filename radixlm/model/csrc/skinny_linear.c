/* Linear layers for decode-sized batches: y (M, N) = x (M, K) W^T for M <= 16 rows.

   A decode step multiplies a handful of rows by every weight matrix once: it is a stream of the
   weights through the cores, and its speed is how fast that stream runs. oneDNN's matmuls reach
   ~30-33 GB/s here at 8 rows. This kernel reads W in a layout made for streaming, packed once
   at load: blocks of 16 output columns, k-major inside a block (float32: (N/16, K, 16);
   bfloat16: (N/16, K/2, 16, 2), pairs of k per lane), so each 64-byte load is 16 columns at one
   k (or two) and feeds one multiply-add per row; the stream is prefetched 8 KB ahead. On the
   default model's 30 layers + LM head at 8 rows, called from C (decode_step.c): ~63 GB/s in
   bfloat16 (4 KB ahead: 58; one 226 MB matrix: 72; a plain read loop peaks at ~83).

   bfloat16: vdpbf16ps where the CPU has AVX512-BF16, else the pairs are widened to float32.
   Accumulation is float32; a bfloat16 y is rounded once, at the end.

   Layouts (contiguous): x (M, K) and y (M, N) in the model's dtype; wp as above.
*/
#include <stdint.h>
#include <string.h>
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include "bf16.h"

#define ALWAYS_INLINE static inline __attribute__((always_inline))
#define MAX_ROWS 16
#define AHEAD 8192 /* bytes of the weight stream requested ahead of use */

typedef float v16 __attribute__((vector_size(64)));
typedef uint32_t u16x32 __attribute__((vector_size(64))); /* 16 lanes of bfloat16 pairs */

/* Row m's 16 results of block b into y. */
ALWAYS_INLINE void store_block(void *y, const v16 *acc, int64_t N, int64_t b, int rows, int bf16)
{
    for (int m = 0; m < rows; m++) {
        if (!bf16) {
            memcpy((float *)y + m * N + b * 16, &acc[m], sizeof(v16));
            continue;
        }
        uint16_t *out = (uint16_t *)y + m * N + b * 16;
        for (int i = 0; i < 16; i++) out[i] = float_to_bf16(acc[m][i]);
    }
}

/* Column block b, float32. */
ALWAYS_INLINE void block_f32(const float *x, const float *wp, float *y, int64_t N, int64_t K,
                             int64_t b, const int rows)
{
    v16 acc[MAX_ROWS];
    for (int m = 0; m < rows; m++) acc[m] = (v16){0};
    const float *w = wp + b * K * 16;
    for (int64_t k = 0; k < K; k++) {
        v16 wk;
        memcpy(&wk, w + k * 16, sizeof wk);
        __builtin_prefetch((const char *)(w + k * 16) + AHEAD);
        for (int m = 0; m < rows; m++) acc[m] += x[m * K + k] * wk;
    }
    store_block(y, acc, N, b, rows, 0);
}

/* Column block b, bfloat16 (x as pairs: K/2 per row). */
ALWAYS_INLINE void block_bf16(const uint32_t *x, const uint32_t *wp, uint16_t *y, int64_t N,
                              int64_t K, int64_t b, const int rows)
{
    v16 acc[MAX_ROWS];
    for (int m = 0; m < rows; m++) acc[m] = (v16){0};
    const int64_t half = K / 2;
    const uint32_t *w = wp + b * half * 16;
    for (int64_t k = 0; k < half; k++) {
        u16x32 wk;
        memcpy(&wk, w + k * 16, sizeof wk);
        __builtin_prefetch((const char *)(w + k * 16) + AHEAD);
#if defined(__AVX512BF16__)
        for (int m = 0; m < rows; m++)
            acc[m] = (v16)_mm512_dpbf16_ps((__m512)acc[m], (__m512bh)wk,
                                           (__m512bh)_mm512_set1_epi32((int)x[m * half + k]));
#else
        const v16 lo = (v16)(wk << 16), hi = (v16)(wk & 0xFFFF0000u); /* k even, k odd */
        for (int m = 0; m < rows; m++) {
            const uint32_t pair = x[m * half + k];
            acc[m] += bf16_to_float((uint16_t)pair) * lo + bf16_to_float((uint16_t)(pair >> 16)) * hi;
        }
#endif
    }
    store_block(y, acc, N, b, rows, 1);
}

ALWAYS_INLINE void run_block(const void *x, const void *wp, void *y, int64_t N, int64_t K,
                             int64_t b, const int rows, int bf16)
{
    if (bf16) block_bf16(x, wp, y, N, K, b, rows);
    else block_f32(x, wp, y, N, K, b, rows);
}

int skinny_linear(const void *x, const void *wp, void *y, int64_t M, int64_t N, int64_t K,
                  int bf16, int num_threads)
{
    if (M < 1 || M > MAX_ROWS) return 1;
    if (N % 16 != 0 || K % 2 != 0) return 2;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t b = 0; b < N / 16; b++) {
        switch (M) { /* literal row counts: the row loops unroll, accumulators stay in registers */
        case 1: run_block(x, wp, y, N, K, b, 1, bf16); break;
        case 2: run_block(x, wp, y, N, K, b, 2, bf16); break;
        case 3: run_block(x, wp, y, N, K, b, 3, bf16); break;
        case 4: run_block(x, wp, y, N, K, b, 4, bf16); break;
        case 5: run_block(x, wp, y, N, K, b, 5, bf16); break;
        case 6: run_block(x, wp, y, N, K, b, 6, bf16); break;
        case 7: run_block(x, wp, y, N, K, b, 7, bf16); break;
        case 8: run_block(x, wp, y, N, K, b, 8, bf16); break;
        case 9: run_block(x, wp, y, N, K, b, 9, bf16); break;
        case 10: run_block(x, wp, y, N, K, b, 10, bf16); break;
        case 11: run_block(x, wp, y, N, K, b, 11, bf16); break;
        case 12: run_block(x, wp, y, N, K, b, 12, bf16); break;
        case 13: run_block(x, wp, y, N, K, b, 13, bf16); break;
        case 14: run_block(x, wp, y, N, K, b, 14, bf16); break;
        case 15: run_block(x, wp, y, N, K, b, 15, bf16); break;
        default: run_block(x, wp, y, N, K, b, 16, bf16); break;
        }
    }
    return 0;
}
