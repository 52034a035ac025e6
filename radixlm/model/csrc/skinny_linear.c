/* Linear layers on a packed weight: y (M, N) = x (M, K) W^T, built for decode-sized batches
   (M <= 16 rows, below) and also used for prefill chunks (tiled_linear; on AVX2 panel_linear).

   A decode step multiplies a handful of rows by every weight matrix once: it is a stream of the
   weights through the cores, and its speed is how fast that stream runs, which oneDNN's matmuls
   leave well below the memory's rate. This kernel reads W in a layout made for streaming, packed once
   at load: blocks of 16 output columns, k-major inside a block (float32: (N/16, K, 16);
   bfloat16: (N/16, K/2, 16, 2), pairs of k per lane), so each 64-byte load is 16 columns at one
   k (or two) and feeds one multiply-add per row; the stream is prefetched 8 KB ahead (shorter
   leads leave the stream starved, longer ones overflow the miss buffers; docs/kernels.md has
   the rates).

   bfloat16: vdpbf16ps where the CPU has AVX512-BF16, else the pairs are widened to float32.
   Accumulation is float32; a bfloat16 y is rounded once, at the end.

   Layouts (contiguous): x (M, K) and y (M, N) in the model's dtype; wp as above.
*/
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

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

/* One k step of a column block: 16 lanes of float32 bits or of bfloat16 pairs, in BW vectors
   (loaded one vector at a time: a 64-byte copy through the stack stalls every step on AVX2). */
ALWAYS_INLINE void load_block(vu *w, const char *p)
{
    for (int c = 0; c < BW; c++) memcpy(&w[c], p + c * sizeof(vu), sizeof(vu));
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
ALWAYS_INLINE void fma_f32(vf *acc, const vu *wk, const float *xk, int64_t stride,
                           const int rows)
{
    for (int m = 0; m < rows; m++)
        for (int c = 0; c < BW; c++) acc[m * BW + c] += xk[m * stride] * (vf)wk[c];
}

/* The same for a pair of k in bfloat16 (k2: the pair's index). With AVX512-BF16, x is bfloat16
   and vdpbf16ps does both k of a pair; elsewhere x was widened to float32 once per call
   (WIDEN_X: a broadcast from memory per element, instead of two scalar conversions per row and
   pair), W's pairs are widened here, and the even k go into every row before the odd ones so
   that only half of W's widened vectors are live at a time (AVX2's 16 registers). */
#if defined(__AVX512BF16__)
#define WIDEN_X 0
ALWAYS_INLINE void fma_bf16(vf *acc, const vu *wk, const void *x, int64_t k2, int64_t K,
                            const int rows)
{
    for (int m = 0; m < rows; m++) {
        const uint32_t pair = ((const uint32_t *)x)[m * (K / 2) + k2];
        const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)pair);
        acc[m] = (vf)_mm512_dpbf16_ps((__m512)acc[m], (__m512bh)wk[0], xv);
    }
}
#else
#define WIDEN_X 1
ALWAYS_INLINE void fma_bf16(vf *acc, const vu *wk, const void *x, int64_t k2, int64_t K,
                            const int rows)
{
    const float *xf = (const float *)x + 2 * k2;
    vf half[BW];
    for (int c = 0; c < BW; c++) half[c] = (vf)(wk[c] << 16); /* k even */
    for (int m = 0; m < rows; m++)
        for (int c = 0; c < BW; c++) acc[m * BW + c] += xf[m * K] * half[c];
    for (int c = 0; c < BW; c++) half[c] = (vf)(wk[c] & 0xFFFF0000u); /* k odd */
    for (int m = 0; m < rows; m++)
        for (int c = 0; c < BW; c++) acc[m * BW + c] += xf[m * K + 1] * half[c];
}
#endif

/* Column block b for `rows` (a literal, <= ROW_GROUP) rows, streaming its weights. */
ALWAYS_INLINE void run_block(const void *x, const void *wp, void *y, int64_t N, int64_t K,
                             int64_t b, const int rows, const int bf16)
{
    vf acc[ROW_GROUP * BW];
    for (int i = 0; i < rows * BW; i++) acc[i] = (vf){0};
    const int64_t steps = bf16 ? K / 2 : K; /* 16 lanes of one float, or of one bfloat16 pair */
    const char *w = (const char *)wp + b * steps * 64;
    for (int64_t k = 0; k < steps; k++) {
        vu wk[BW];
        load_block(wk, w + k * 64);
        __builtin_prefetch(w + k * 64 + AHEAD);
        if (bf16) fma_bf16(acc, wk, x, k, K, rows);
        else fma_f32(acc, wk, (const float *)x + k, steps, rows);
    }
    store_block(y, acc, N, b, rows, bf16);
}

/* Up to MAX_ROWS rows of column block b, ROW_GROUP rows a pass. */
static inline void run_rows(const void *x, const void *wp, void *y, int64_t M, int64_t N,
                            int64_t K, int64_t b, int bf16)
{
    const int64_t elem = bf16 ? 2 : 4, x_elem = bf16 && !WIDEN_X ? 2 : 4;
    for (int64_t m0 = 0; m0 < M; m0 += ROW_GROUP) {
        const char *xr = (const char *)x + m0 * K * x_elem;
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
   generic: 3 x 4 xmm). Rows go in slabs of SLAB_ROWS, whose x stays in L2 while the threads
   share out the column blocks; each block's K x 16 weights stay in L1/L2 for the slab's tiles.
   AVX2 has its own loop (panel_linear, below). */
#if VL == 16
#define TILE_ROWS 8
#define TILE_BLOCKS 3
#else
#define TILE_ROWS 3
#define TILE_BLOCKS 1
#endif
#define SLAB_ROWS 96

/* One tile: rows (a literal, <= TILE_ROWS) x nb column blocks, the first at w (K x 16 weights
   each, consecutive), into y's blocks from b. Each k step (a pair of k for bfloat16 pairs)
   loads nb 64-byte slices of W and multiplies them into every row. bf16: x and W are bfloat16
   pairs (vdpbf16ps); out_bf16: y is bfloat16. */
ALWAYS_INLINE void run_tile(const char *x, const char *w, char *y, int64_t N, int64_t K,
                            int64_t b, const int rows, const int nb, const int bf16,
                            const int out_bf16)
{
    vf acc[TILE_BLOCKS][TILE_ROWS * BW]; /* per column block, rows x BW vectors */
    for (int j = 0; j < nb; j++)
        for (int i = 0; i < rows * BW; i++) acc[j][i] = (vf){0};
    const int64_t steps = bf16 ? K / 2 : K; /* 16 lanes of one float, or of one bfloat16 pair */
    for (int64_t k = 0; k < steps; k++) {
        vu wk[TILE_BLOCKS][BW];
        for (int j = 0; j < nb; j++) load_block(wk[j], w + (j * steps + k) * 64);
        for (int j = 0; j < nb; j++) {
            if (bf16) fma_bf16(acc[j], wk[j], x, k, K, rows);
            else fma_f32(acc[j], wk[j], (const float *)x + k, steps, rows);
        }
    }
    for (int j = 0; j < nb; j++) store_block(y, acc[j], N, b + j, rows, out_bf16);
}

#define TILE_CASE(n, NB, BF, OUT)                                                                  \
    case n: run_tile(xr, w, yr, N, K, b, n, NB, BF, OUT); break;
#if TILE_ROWS == 8
#define TILE_ROWS_CASES(NB, BF, OUT)                                                               \
    switch (rows) {                                                                              \
        TILE_CASE(1, NB, BF, OUT) TILE_CASE(2, NB, BF, OUT) TILE_CASE(3, NB, BF, OUT)            \
        TILE_CASE(4, NB, BF, OUT) TILE_CASE(5, NB, BF, OUT) TILE_CASE(6, NB, BF, OUT)            \
        TILE_CASE(7, NB, BF, OUT)                                                                \
    default: run_tile(xr, w, yr, N, K, b, TILE_ROWS, NB, BF, OUT); break;                        \
    }
#else
#define TILE_ROWS_CASES(NB, BF, OUT)                                                               \
    switch (rows) {                                                                              \
        TILE_CASE(1, NB, BF, OUT) TILE_CASE(2, NB, BF, OUT)                                      \
    default: run_tile(xr, w, yr, N, K, b, TILE_ROWS, NB, BF, OUT); break;                        \
    }
#endif

/* A group's nb blocks of bfloat16 pairs (K/2 x 16 each) widened to float32 (K x 16 each). */
static void widen_blocks(const uint32_t *wp, float *wf, int64_t K, int64_t nb)
{
    for (int64_t i = 0; i < nb * (K / 2); i++) /* one k pair of one block: 16 lanes */
        for (int l = 0; l < 16; l++) {
            const uint32_t pair = wp[i * 16 + l];
            wf[(2 * i) * 16 + l] = bf16_to_float((uint16_t)pair);
            wf[(2 * i + 1) * 16 + l] = bf16_to_float((uint16_t)(pair >> 16));
        }
}

#if VL != 8
/* Prefill-sized M: slabs of rows, the threads sharing out the column block groups. Where the
   build widens bfloat16 (WIDEN_X), each group's W blocks are widened once per slab into a
   thread's scratch (in L2) and the float32 tiles run on them: the widening is paid once for
   the slab's rows, not once per tile and k step. */
static int tiled_linear(const void *x, const void *wp, void *y, int64_t M, int64_t N, int64_t K,
                        int bf16, int num_threads)
{
    const int64_t elem = bf16 ? 2 : 4, x_elem = bf16 && !WIDEN_X ? 2 : 4, blocks = N / 16;
    const int64_t groups = (blocks + TILE_BLOCKS - 1) / TILE_BLOCKS;
    const int widen = bf16 && WIDEN_X, pairs = bf16 && !WIDEN_X;
    (void)pairs; /* only 3-block tiles take pairs (AVX512-BF16) */
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        float *wf = widen ? malloc((size_t)(TILE_BLOCKS * K * 16) * sizeof(float)) : NULL;
        failed = widen && wf == NULL;
        for (int64_t m0 = 0; m0 < M && !failed; m0 += SLAB_ROWS) {
            const int64_t m1 = m0 + SLAB_ROWS < M ? m0 + SLAB_ROWS : M;
#pragma omp for schedule(static)
            for (int64_t g = 0; g < groups; g++) {
                const int64_t b = g * TILE_BLOCKS;
                const int64_t nb = blocks - b < TILE_BLOCKS ? blocks - b : TILE_BLOCKS;
                const char *w = (const char *)wp + b * K * elem * 16;
                if (widen) {
                    widen_blocks((const uint32_t *)w, wf, K, nb);
                    w = (const char *)wf;
                }
                for (int64_t m = m0; m < m1; m += TILE_ROWS) {
                    const int rows = m1 - m < TILE_ROWS ? (int)(m1 - m) : TILE_ROWS;
                    const char *xr = (const char *)x + m * K * x_elem;
                    char *yr = (char *)y + m * N * elem;
                    /* literal row and block counts and dtypes: registers, unrolled */
#if TILE_BLOCKS == 3
                    if (pairs && nb == 3) {
                        TILE_ROWS_CASES(3, 1, 1)
                    } else if (pairs && nb == 2) {
                        TILE_ROWS_CASES(2, 1, 1)
                    } else if (pairs) {
                        TILE_ROWS_CASES(1, 1, 1)
                    } else if (nb == 3) {
                        TILE_ROWS_CASES(3, 0, 0)
                    } else if (nb == 2) {
                        TILE_ROWS_CASES(2, 0, 0)
                    } else {
                        TILE_ROWS_CASES(1, 0, 0)
                    }
#else
                    if (widen) { /* float32 tiles on the widened W, bfloat16 out */
                        TILE_ROWS_CASES(1, 0, 1)
                    } else {
                        TILE_ROWS_CASES(1, 0, 0)
                    }
#endif
                }
            }
        }
        free(wf);
    }
    return failed ? 3 : 0;
}
#endif

#if VL == 8
/* AVX2 prefill: 6 rows x 16 columns in 12 ymm accumulators (with the two vectors of W and a
   broadcast: all 16 registers), each tile over the whole of K, as in BLIS's Haswell kernel. The
   rows' x is first copied into panels of PANEL_ROWS rows, k-major (K x 6: one 24-byte step per
   k), so a tile reads x as one sequential stream: read in place, x is 6 streams K floats apart,
   which held the tile well below oneDNN (docs/kernels.md). Each thread takes a fixed range of
   column blocks and packs every slab's panels itself: no barrier anywhere, so a thread the OS
   sets aside delays only its own columns (with a barrier per slab, the other thread waited for
   it at every slab). Per element: one accumulator, k in order, as in the decode passes
   (run_block), so a row gets the same bits whichever path multiplies it. */
#define PANEL_ROWS 6

/* Rows r0 .. r0 + rows of x (M, K) as one panel (K, PANEL_ROWS); missing rows are zeros. */
static void pack_panel(const float *x, float *panel, int64_t r0, int rows, int64_t K)
{
    for (int64_t k = 0; k < K; k++)
        for (int m = 0; m < PANEL_ROWS; m++)
            panel[k * PANEL_ROWS + m] = m < rows ? x[(r0 + m) * K + k] : 0.0f;
}

/* rows (<= PANEL_ROWS) of y's column block b from one panel and the block's K x 16 weights. */
ALWAYS_INLINE void panel_tile(const float *panel, const float *w, char *y, int64_t N, int64_t K,
                              int64_t b, int rows, const int out_bf16)
{
    vf acc[PANEL_ROWS * BW];
    for (int i = 0; i < PANEL_ROWS * BW; i++) acc[i] = (vf){0};
    for (int64_t k = 0; k < K; k++) {
        const vf w0 = loadv(w + k * 16), w1 = loadv(w + k * 16 + VL);
        for (int m = 0; m < PANEL_ROWS; m++) {
            acc[m * BW] += panel[k * PANEL_ROWS + m] * w0;
            acc[m * BW + 1] += panel[k * PANEL_ROWS + m] * w1;
        }
    }
    store_block(y, acc, N, b, rows, out_bf16);
}

/* Prefill-sized M on AVX2 (x float32; a bfloat16 W's blocks are widened once per slab into the
   thread's scratch, y is then bfloat16). */
static int panel_linear(const float *x, const void *wp, void *y, int64_t M, int64_t N, int64_t K,
                        int bf16, int num_threads)
{
    const int64_t elem = bf16 ? 2 : 4, blocks = N / 16;
    const int64_t slab = (SLAB_ROWS + PANEL_ROWS - 1) / PANEL_ROWS * PANEL_ROWS;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        const int64_t t = omp_get_thread_num(), threads = omp_get_num_threads();
        const int64_t b0 = blocks * t / threads, b1 = blocks * (t + 1) / threads;
        float *panels = malloc((size_t)(slab * K) * sizeof(float));
        float *wf = bf16 ? malloc((size_t)(K * 16) * sizeof(float)) : NULL;
        failed = panels == NULL || (bf16 && wf == NULL);
        for (int64_t m0 = 0; m0 < M && !failed && b0 < b1; m0 += slab) {
            const int64_t m1 = m0 + slab < M ? m0 + slab : M;
            for (int64_t r = m0; r < m1; r += PANEL_ROWS) {
                const int rows = m1 - r < PANEL_ROWS ? (int)(m1 - r) : PANEL_ROWS;
                pack_panel(x, panels + (r - m0) * K, r, rows, K);
            }
            for (int64_t b = b0; b < b1; b++) {
                const float *w = (const float *)((const char *)wp + b * K * elem * 16);
                if (bf16) {
                    widen_blocks((const uint32_t *)w, wf, K, 1);
                    w = wf;
                }
                for (int64_t r = m0; r < m1; r += PANEL_ROWS) {
                    const int rows = m1 - r < PANEL_ROWS ? (int)(m1 - r) : PANEL_ROWS;
                    char *yr = (char *)y + r * N * elem;
                    if (bf16) panel_tile(panels + (r - m0) * K, w, yr, N, K, b, rows, 1);
                    else panel_tile(panels + (r - m0) * K, w, yr, N, K, b, rows, 0);
                }
            }
        }
        free(panels);
        free(wf);
    }
    return failed ? 3 : 0;
}
#endif

int skinny_linear(const void *x, const void *wp, void *y, int64_t M, int64_t N, int64_t K,
                  int bf16, int num_threads)
{
    if (M < 1) return 1;
    if (N % 16 != 0 || K % 2 != 0) return 2;
    float *widened = NULL; /* bfloat16 x as float32, where the build widens it (fma_bf16) */
    if (bf16 && WIDEN_X) {
        widened = malloc((size_t)(M * K) * sizeof(float));
        if (widened == NULL) return 3;
        for (int64_t i = 0; i < M * K; i++) widened[i] = bf16_to_float(((const uint16_t *)x)[i]);
        x = widened;
    }
    int status = 0;
    if (M > MAX_ROWS) {
#if VL == 8
        status = panel_linear(x, wp, y, M, N, K, bf16, num_threads);
#else
        status = tiled_linear(x, wp, y, M, N, K, bf16, num_threads);
#endif
    } else {
#pragma omp parallel for schedule(static) num_threads(num_threads)
        for (int64_t b = 0; b < N / 16; b++) run_rows(x, wp, y, M, N, K, b, bf16);
    }
    free(widened);
    return status;
}
