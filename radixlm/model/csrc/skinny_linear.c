/* Linear layers on a packed weight: y (M, N) = x (M, K) W^T, built for decode-sized batches
   (M <= 16 rows, below) and also used for prefill chunks (tiled_linear, further down).

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

/* More rows than a decode step (a prefill chunk): the same packed weight, multiplied in register
   tiles of TILE_ROWS rows x TILE_BLOCKS column blocks (24 accumulators): per k, 3 loads of W
   and 8 broadcasts of x feed 24 multiply-adds. Rows go in slabs of SLAB_ROWS, whose x stays in
   L2 while the threads share out the column blocks; each block's K x 16 weights stay in L1/L2
   for the slab's tiles. As fast as oneDNN's packed matmuls at 512 rows and more (~1,000 GFLOP/s
   bfloat16, ~500 float32 on 2 cores), 1.1-1.3x faster at 32-128 rows. */
#define TILE_ROWS 8
#define TILE_BLOCKS 3
#define SLAB_ROWS 96

/* A tile's results (row-major over its nb column blocks) into y, block by block. */
ALWAYS_INLINE void store_tile(void *y, const v16 *acc, int64_t N, int64_t b, const int rows,
                              const int nb, int bf16)
{
    for (int j = 0; j < nb; j++) {
        v16 col[TILE_ROWS];
        for (int m = 0; m < rows; m++) col[m] = acc[m * nb + j];
        store_block(y, col, N, b + j, rows, bf16);
    }
}

/* One tile: rows (a literal, <= TILE_ROWS) x nb column blocks from block b. Each k step (a pair
   of k in bfloat16) loads nb 64-byte slices of W and multiplies them into every row. */
ALWAYS_INLINE void run_tile(const char *x, const void *wp, char *y, int64_t N, int64_t K,
                            int64_t b, const int rows, const int nb, const int bf16)
{
    v16 acc[TILE_ROWS * TILE_BLOCKS];
    for (int i = 0; i < rows * nb; i++) acc[i] = (v16){0};
    const int64_t steps = bf16 ? K / 2 : K; /* 16 lanes of one float, or of one bfloat16 pair */
    const u16x32 *w = (const u16x32 *)wp + b * steps;
    for (int64_t k = 0; k < steps; k++) {
        u16x32 wk[TILE_BLOCKS];
        for (int j = 0; j < nb; j++) memcpy(&wk[j], w + j * steps + k, sizeof(u16x32));
        for (int m = 0; m < rows; m++) {
            if (!bf16) {
                const float xv = ((const float *)x)[m * K + k];
                for (int j = 0; j < nb; j++) acc[m * nb + j] += xv * (v16)wk[j];
                continue;
            }
            const uint32_t pair = ((const uint32_t *)x)[m * steps + k];
#if defined(__AVX512BF16__)
            const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)pair);
            for (int j = 0; j < nb; j++)
                acc[m * nb + j] = (v16)_mm512_dpbf16_ps((__m512)acc[m * nb + j], (__m512bh)wk[j], xv);
#else
            const float lo = bf16_to_float((uint16_t)pair), hi = bf16_to_float((uint16_t)(pair >> 16));
            for (int j = 0; j < nb; j++)
                acc[m * nb + j] += lo * (v16)(wk[j] << 16) + hi * (v16)(wk[j] & 0xFFFF0000u);
#endif
        }
    }
    store_tile(y, acc, N, b, rows, nb, bf16);
}

#define TILE_ROWS_CASES(NB, BF)                                                                    \
    switch (rows) {                                                                              \
    case 1: run_tile(xr, wp, yr, N, K, b, 1, NB, BF); break;                                     \
    case 2: run_tile(xr, wp, yr, N, K, b, 2, NB, BF); break;                                     \
    case 3: run_tile(xr, wp, yr, N, K, b, 3, NB, BF); break;                                     \
    case 4: run_tile(xr, wp, yr, N, K, b, 4, NB, BF); break;                                     \
    case 5: run_tile(xr, wp, yr, N, K, b, 5, NB, BF); break;                                     \
    case 6: run_tile(xr, wp, yr, N, K, b, 6, NB, BF); break;                                     \
    case 7: run_tile(xr, wp, yr, N, K, b, 7, NB, BF); break;                                     \
    default: run_tile(xr, wp, yr, N, K, b, TILE_ROWS, NB, BF); break;                            \
    }

static void tiled_linear(const void *x, const void *wp, void *y, int64_t M, int64_t N, int64_t K,
                         int bf16, int num_threads)
{
    const int64_t elem = bf16 ? 2 : 4, blocks = N / 16;
    const int64_t groups = (blocks + TILE_BLOCKS - 1) / TILE_BLOCKS;
#pragma omp parallel num_threads(num_threads)
    for (int64_t m0 = 0; m0 < M; m0 += SLAB_ROWS) {
        const int64_t m1 = m0 + SLAB_ROWS < M ? m0 + SLAB_ROWS : M;
#pragma omp for schedule(static)
        for (int64_t g = 0; g < groups; g++) {
            const int64_t b = g * TILE_BLOCKS;
            const int64_t nb = blocks - b < TILE_BLOCKS ? blocks - b : TILE_BLOCKS;
            for (int64_t m = m0; m < m1; m += TILE_ROWS) {
                const int rows = m1 - m < TILE_ROWS ? (int)(m1 - m) : TILE_ROWS;
                const char *xr = (const char *)x + m * K * elem;
                char *yr = (char *)y + m * N * elem;
                /* literal row and block counts and dtype: registers, unrolled, no branches */
                if (bf16 && nb == 3) {
                    TILE_ROWS_CASES(3, 1)
                } else if (bf16 && nb == 2) {
                    TILE_ROWS_CASES(2, 1)
                } else if (bf16) {
                    TILE_ROWS_CASES(1, 1)
                } else if (nb == 3) {
                    TILE_ROWS_CASES(3, 0)
                } else if (nb == 2) {
                    TILE_ROWS_CASES(2, 0)
                } else {
                    TILE_ROWS_CASES(1, 0)
                }
            }
        }
    }
}

int skinny_linear(const void *x, const void *wp, void *y, int64_t M, int64_t N, int64_t K,
                  int bf16, int num_threads)
{
    if (M < 1) return 1;
    if (N % 16 != 0 || K % 2 != 0) return 2;
    if (M > MAX_ROWS) {
        tiled_linear(x, wp, y, M, N, K, bf16, num_threads);
        return 0;
    }
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
