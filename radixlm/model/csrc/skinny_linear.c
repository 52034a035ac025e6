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

#include "bf16.h"
#include "simd.h"

#define MAX_ROWS 16
#define AHEAD 8192 /* bytes of the weight stream requested ahead of use */
#define BW (16 / VL) /* vectors per block of 16 columns */
/* Rows per pass over a column block: their BW accumulators each, the block's BW vectors of W
   (bfloat16: its two widened halves) and a broadcast must fit the register file; more rows go
   in further passes over the block, which is in L1/L2 by then. */
#if VL == 16
#define ROW_GROUP 16
#elif VL == 8
#define ROW_GROUP 6
#else
#define ROW_GROUP 3
#endif

typedef struct {
    vu v[BW];
} block_u; /* 16 lanes of bfloat16 pairs, or of float32 bits */

ALWAYS_INLINE block_u load_block(const void *p)
{
    block_u w;
    memcpy(&w, p, sizeof w);
    return w;
}

/* Row m's 16 results of block b into y (acc: rows x BW vectors). */
ALWAYS_INLINE void store_block(void *y, const vf *acc, int64_t N, int64_t b, int rows, int bf16)
{
    for (int m = 0; m < rows; m++) {
        if (!bf16) {
            memcpy((float *)y + m * N + b * 16, &acc[m * BW], 16 * sizeof(float));
            continue;
        }
        uint16_t *out = (uint16_t *)y + m * N + b * 16;
        for (int i = 0; i < 16; i++) out[i] = float_to_bf16(acc[m * BW + i / VL][i % VL]);
    }
}

/* acc (rows x BW vectors) += x * (one k step of a block), float32: xk[m] the rows' x at k. */
ALWAYS_INLINE void fma_f32(vf *acc, block_u wk, const float *xk, int64_t stride, const int rows)
{
    for (int m = 0; m < rows; m++)
        for (int c = 0; c < BW; c++) acc[m * BW + c] += xk[m * stride] * (vf)wk.v[c];
}

/* The same for a pair of k in bfloat16: xk[m] the rows' pairs at k. */
ALWAYS_INLINE void fma_bf16(vf *acc, block_u wk, const uint32_t *xk, int64_t stride,
                            const int rows)
{
#if defined(__AVX512BF16__)
    for (int m = 0; m < rows; m++) {
        const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)xk[m * stride]);
        acc[m] = (vf)_mm512_dpbf16_ps((__m512)acc[m], (__m512bh)wk.v[0], xv);
    }
#else
    vf lo[BW], hi[BW]; /* k even, k odd */
    for (int c = 0; c < BW; c++) {
        lo[c] = (vf)(wk.v[c] << 16);
        hi[c] = (vf)(wk.v[c] & 0xFFFF0000u);
    }
    for (int m = 0; m < rows; m++) {
        const uint32_t pair = xk[m * stride];
        const float xl = bf16_to_float((uint16_t)pair), xh = bf16_to_float((uint16_t)(pair >> 16));
        for (int c = 0; c < BW; c++) acc[m * BW + c] += xl * lo[c] + xh * hi[c];
    }
#endif
}

/* Column block b for `rows` (a literal, <= ROW_GROUP) rows, streaming its weights. */
ALWAYS_INLINE void run_block(const void *x, const void *wp, void *y, int64_t N, int64_t K,
                             int64_t b, const int rows, const int bf16)
{
    vf acc[ROW_GROUP * BW];
    for (int i = 0; i < rows * BW; i++) acc[i] = (vf){0};
    const int64_t steps = bf16 ? K / 2 : K; /* 16 lanes of one float, or of one bfloat16 pair */
    const char *w = (const char *)wp + b * steps * 64;
    for (int64_t k = 0; k < steps; k++) {
        const block_u wk = load_block(w + k * 64);
        __builtin_prefetch(w + k * 64 + AHEAD);
        if (bf16) fma_bf16(acc, wk, (const uint32_t *)x + k, steps, rows);
        else fma_f32(acc, wk, (const float *)x + k, steps, rows);
    }
    store_block(y, acc, N, b, rows, bf16);
}

/* Up to MAX_ROWS rows of column block b, ROW_GROUP rows a pass. */
static inline void run_rows(const void *x, const void *wp, void *y, int64_t M, int64_t N,
                            int64_t K, int64_t b, int bf16)
{
    const int64_t elem = bf16 ? 2 : 4;
    for (int64_t m0 = 0; m0 < M; m0 += ROW_GROUP) {
        const char *xr = (const char *)x + m0 * K * elem;
        char *yr = (char *)y + m0 * N * elem;
        const int64_t rows = M - m0 < ROW_GROUP ? M - m0 : ROW_GROUP;
        /* literal row counts and dtype: the row loops unroll, accumulators stay in registers */
#define ROWS_CASE(n)                                                                             \
    case n:                                                                                      \
        if (bf16) run_block(xr, wp, yr, N, K, b, n, 1);                                          \
        else run_block(xr, wp, yr, N, K, b, n, 0);                                               \
        break;
        switch (rows) {
            ROWS_CASE(1)
            ROWS_CASE(2)
#if ROW_GROUP > 3
            ROWS_CASE(4)
            ROWS_CASE(5)
            ROWS_CASE(6)
#endif
#if ROW_GROUP > 6
            ROWS_CASE(7)
            ROWS_CASE(8)
            ROWS_CASE(9)
            ROWS_CASE(10)
            ROWS_CASE(11)
            ROWS_CASE(12)
            ROWS_CASE(13)
            ROWS_CASE(14)
            ROWS_CASE(15)
            ROWS_CASE(16)
#endif
        default: /* 3 */
            if (bf16) run_block(xr, wp, yr, N, K, b, 3, 1);
            else run_block(xr, wp, yr, N, K, b, 3, 0);
        }
#undef ROWS_CASE
    }
}

/* More rows than a decode step (a prefill chunk): the same packed weight, multiplied in register
   tiles of TILE_ROWS rows x TILE_BLOCKS column blocks: per k, the tile's vectors of W and one
   broadcast of x per row feed rows x vectors multiply-adds (AVX-512: 8 x 3 zmm accumulators;
   AVX2: 6 x 2 ymm, 16 columns, the classic shape for 16 registers). Rows go in slabs of
   SLAB_ROWS, whose x stays in L2 while the threads share out the column blocks; each block's
   K x 16 weights stay in L1/L2 for the slab's tiles. */
#if VL == 16
#define TILE_ROWS 8
#define TILE_BLOCKS 3
#elif VL == 8
#define TILE_ROWS 6
#define TILE_BLOCKS 1
#else
#define TILE_ROWS 3
#define TILE_BLOCKS 1
#endif
#define SLAB_ROWS 96

/* One tile: rows (a literal, <= TILE_ROWS) x nb column blocks from block b. Each k step (a pair
   of k in bfloat16) loads nb 64-byte slices of W and multiplies them into every row. */
ALWAYS_INLINE void run_tile(const char *x, const void *wp, char *y, int64_t N, int64_t K,
                            int64_t b, const int rows, const int nb, const int bf16)
{
    vf acc[TILE_BLOCKS][TILE_ROWS * BW]; /* per column block, rows x BW vectors */
    for (int j = 0; j < nb; j++)
        for (int i = 0; i < rows * BW; i++) acc[j][i] = (vf){0};
    const int64_t steps = bf16 ? K / 2 : K; /* 16 lanes of one float, or of one bfloat16 pair */
    const char *w = (const char *)wp + b * steps * 64;
    for (int64_t k = 0; k < steps; k++) {
        block_u wk[TILE_BLOCKS];
        for (int j = 0; j < nb; j++) wk[j] = load_block(w + (j * steps + k) * 64);
        for (int j = 0; j < nb; j++) {
            if (bf16) fma_bf16(acc[j], wk[j], (const uint32_t *)x + k, steps, rows);
            else fma_f32(acc[j], wk[j], (const float *)x + k, steps, rows);
        }
    }
    for (int j = 0; j < nb; j++) store_block(y, acc[j], N, b + j, rows, bf16);
}

#define TILE_CASE(n, NB, BF)                                                                       \
    case n: run_tile(xr, wp, yr, N, K, b, n, NB, BF); break;
#if TILE_ROWS == 8
#define TILE_ROWS_CASES(NB, BF)                                                                    \
    switch (rows) {                                                                              \
        TILE_CASE(1, NB, BF) TILE_CASE(2, NB, BF) TILE_CASE(3, NB, BF) TILE_CASE(4, NB, BF)      \
        TILE_CASE(5, NB, BF) TILE_CASE(6, NB, BF) TILE_CASE(7, NB, BF)                           \
    default: run_tile(xr, wp, yr, N, K, b, TILE_ROWS, NB, BF); break;                            \
    }
#elif TILE_ROWS == 6
#define TILE_ROWS_CASES(NB, BF)                                                                    \
    switch (rows) {                                                                              \
        TILE_CASE(1, NB, BF) TILE_CASE(2, NB, BF) TILE_CASE(3, NB, BF) TILE_CASE(4, NB, BF)      \
        TILE_CASE(5, NB, BF)                                                                     \
    default: run_tile(xr, wp, yr, N, K, b, TILE_ROWS, NB, BF); break;                            \
    }
#else
#define TILE_ROWS_CASES(NB, BF)                                                                    \
    switch (rows) {                                                                              \
        TILE_CASE(1, NB, BF) TILE_CASE(2, NB, BF)                                                \
    default: run_tile(xr, wp, yr, N, K, b, TILE_ROWS, NB, BF); break;                            \
    }
#endif

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
            (void)nb; /* one block a tile where TILE_BLOCKS is 1 */
            for (int64_t m = m0; m < m1; m += TILE_ROWS) {
                const int rows = m1 - m < TILE_ROWS ? (int)(m1 - m) : TILE_ROWS;
                const char *xr = (const char *)x + m * K * elem;
                char *yr = (char *)y + m * N * elem;
                /* literal row and block counts and dtype: registers, unrolled, no branches */
#if TILE_BLOCKS == 3
                if (bf16 && nb == 3) {
                    TILE_ROWS_CASES(3, 1)
                } else if (bf16 && nb == 2) {
                    TILE_ROWS_CASES(2, 1)
                } else if (nb == 3) {
                    TILE_ROWS_CASES(3, 0)
                } else if (nb == 2) {
                    TILE_ROWS_CASES(2, 0)
                } else
#endif
                if (bf16) {
                    TILE_ROWS_CASES(1, 1)
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
    for (int64_t b = 0; b < N / 16; b++) run_rows(x, wp, y, M, N, K, b, bf16);
    return 0;
}
