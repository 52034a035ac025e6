/* Linear layers on quantized weights: y (M, N) = x (M, K) W^T with W as integer blocks
   (radixlm/model/quant/layout.py packs them), activations quantized per 32 inputs.

   quantize_rows   x (float32 or bfloat16) -> per block of 32: xq = round(x * QMAX / max|x|)
                   (int16 in exact mode, int8 in fast), sx = max|x| / QMAX, bsum = sum of xq
   quant_matmul    per output column and block: an integer dot product of xq with the block's
                   values, then in float32  t = min * bsum;  t += scale * dot (per sub-block);
                   y += sx * t,  blocks in order. The same order at every row count and thread
                   count (threads split the columns), so decode, prefill, batched and alone give
                   the same bits.

   A weight record is 8 columns x 32 inputs (layout.py draws it); every vector the unpacking
   makes holds the 8 columns in its 8 int32 lanes, so the dot products need no horizontal sums:
   exact mode multiplies int16 pairs (vpmaddwd; vpdpwssd with AVX512-VNNI), fast mode unsigned
   4-bit or sign-folded 8-bit values by int8 quads (vpmaddubsw + vpmaddwd; vpdpbusd with VNNI).
   None of these sums can saturate: |4-bit x int8| pairs <= 2 * 15 * 127, |8-bit x int8| pairs
   <= 2 * 128 * 127, int16 pairs stay far from int32's range for 32 inputs.

   The avx512 build runs the same 256-bit code (8 columns a record), with the VNNI forms where
   the CPU has them; the generic build unpacks a record to int16 and multiplies in plain C. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#include "bf16.h"
#include "simd.h"

#define GROUP 8
#define BLOCK 32
#define ROW_TILE 4   /* rows per pass over a group's records (their accumulators in registers) */
#define AHEAD 2048   /* bytes of the weight stream requested ahead of use */

static int64_t record_bytes(int bits, int sub, int has_min)
{
    return GROUP * BLOCK * bits / 8 + 4 * GROUP * sub + (has_min ? 4 * GROUP : 0);
}

/* ---- activations ------------------------------------------------------------------------ */

int quantize_rows(const void *x, int64_t M, int64_t K, int32_t bf16, int32_t fast, void *xq,
                  float *sx, int32_t *bsum, int32_t num_threads)
{
    if (K % BLOCK) return 1;
    const float qmax = fast ? 127.0f : 32767.0f;
    const int64_t nb = K / BLOCK;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (M * K > 65536)
    for (int64_t i = 0; i < M * nb; i++) {
        const int64_t m = i / nb, b = i % nb;
        float v[BLOCK];
        if (bf16) {
            const uint16_t *p = (const uint16_t *)x + m * K + b * BLOCK;
            for (int k = 0; k < BLOCK; k++) v[k] = bf16_to_float(p[k]);
        } else {
            memcpy(v, (const float *)x + m * K + b * BLOCK, sizeof v);
        }
        float amax = 0.0f;
        for (int k = 0; k < BLOCK; k++) amax = fmaxf(amax, fabsf(v[k]));
        const float inv = amax > 0.0f ? qmax / amax : 0.0f;
        int32_t sum = 0;
        for (int k = 0; k < BLOCK; k++) {
            float r = rintf(v[k] * inv);
            r = fminf(fmaxf(r, -qmax), qmax);
            const int32_t q = (int32_t)r;
            sum += q;
            if (fast) ((int8_t *)xq)[m * K + b * BLOCK + k] = (int8_t)q;
            else ((int16_t *)xq)[m * K + b * BLOCK + k] = (int16_t)q;
        }
        sx[i] = amax * (1.0f / qmax);
        bsum[i] = sum;
    }
    return 0;
}

/* ---- one record against up to ROW_TILE rows ---------------------------------------------- */

/* What a block's float update reads: the record's scales (sub x 8) and mins (8, or none). */
typedef struct {
    const float *scales;
    const float *mins;
} BlockScales;

ALWAYS_INLINE BlockScales block_scales(const uint8_t *rec, int bits, int sub, int has_min)
{
    const float *scales = (const float *)(rec + GROUP * BLOCK * bits / 8);
    return (BlockScales){scales, has_min ? scales + GROUP * sub : NULL};
}

#if defined(__AVX2__)

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define DOT_PAIRS(acc, w, x) _mm256_dpwssd_epi32(acc, w, x)
#define DOT_QUADS(acc, u, s) _mm256_dpbusd_epi32(acc, u, s)
#else
#define DOT_PAIRS(acc, w, x) _mm256_add_epi32(acc, _mm256_madd_epi16(w, x))
#define DOT_QUADS(acc, u, s)                                                                     \
    _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)))
#endif

/* Four bytes (two int16 or four int8 inputs) broadcast to every lane. */
ALWAYS_INLINE __m256i bcast32(const void *p)
{
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

/* The int32 dot products (8 columns per vector) of one record with `rows` rows of xq: dot[r *
   sub + h] for sub-block h. xr[r]: row r's 32 quantized inputs of this block. */
ALWAYS_INLINE void record_dots(__m256i *dot, const uint8_t *q, const void *const *xr,
                               const int rows, const int bits, const int sub, const int fast)
{
    for (int i = 0; i < rows * sub; i++) dot[i] = _mm256_setzero_si256();
    const __m256i low4 = _mm256_set1_epi8(0x0F), zero = _mm256_setzero_si256();
    if (!fast && bits == 4) {
        for (int c = 0; c < 4; c++) { /* a 32-byte load: inputs 8c .. 8c + 7 of every column */
            const __m256i v = _mm256_loadu_si256((const __m256i *)(q + 32 * c));
            const __m256i lo = _mm256_and_si256(v, low4);
            const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
            const __m256i w[4] = {_mm256_unpacklo_epi8(lo, zero), _mm256_unpackhi_epi8(lo, zero),
                                  _mm256_unpacklo_epi8(hi, zero), _mm256_unpackhi_epi8(hi, zero)};
            for (int r = 0; r < rows; r++)
                for (int u = 0; u < 4; u++) {
                    const int s = 4 * c + u; /* int16 pair s: inputs 2s, 2s + 1 */
                    dot[r] = DOT_PAIRS(dot[r], w[u], bcast32((const int16_t *)xr[r] + 2 * s));
                }
        }
    } else if (!fast) { /* 8-bit values, exact: 16 bytes sign-extended per pair of inputs */
        for (int s = 0; s < 16; s++) {
            const __m256i w = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(q + 16 * s)));
            const int h = sub == 2 ? s / 8 : 0;
            for (int r = 0; r < rows; r++)
                dot[r * sub + h] =
                    DOT_PAIRS(dot[r * sub + h], w, bcast32((const int16_t *)xr[r] + 2 * s));
        }
    } else if (bits == 4) { /* fast: unsigned nibbles against int8 quads */
        for (int c = 0; c < 4; c++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(q + 32 * c));
            const __m256i w[2] = {_mm256_and_si256(v, low4),
                                  _mm256_and_si256(_mm256_srli_epi16(v, 4), low4)};
            for (int r = 0; r < rows; r++)
                for (int u = 0; u < 2; u++) {
                    const int s = 2 * c + u; /* quad s: inputs 4s .. 4s + 3 */
                    dot[r] = DOT_QUADS(dot[r], w[u], bcast32((const int8_t *)xr[r] + 4 * s));
                }
        }
    } else { /* fast, 8-bit signed values: |w| against x with w's sign */
        for (int s = 0; s < 8; s++) {
            const __m256i w = _mm256_loadu_si256((const __m256i *)(q + 32 * s));
            const __m256i aw = _mm256_abs_epi8(w);
            const int h = sub == 2 ? s / 4 : 0;
            for (int r = 0; r < rows; r++) {
                const __m256i xs = _mm256_sign_epi8(bcast32((const int8_t *)xr[r] + 4 * s), w);
                dot[r * sub + h] = DOT_QUADS(dot[r * sub + h], aw, xs);
            }
        }
    }
}

/* acc[r] (8 columns) += sx * (min * bsum + scale_h * dot_h ...), in that order. */
ALWAYS_INLINE void block_update(__m256 *acc, const __m256i *dot, BlockScales bs, const float *sx,
                                const int32_t *bsum, int64_t nb, int64_t b, const int rows,
                                const int sub)
{
    const __m256 d0 = _mm256_loadu_ps(bs.scales);
    const __m256 d1 = sub == 2 ? _mm256_loadu_ps(bs.scales + GROUP) : d0;
    const __m256 mn = bs.mins ? _mm256_loadu_ps(bs.mins) : _mm256_setzero_ps();
    for (int r = 0; r < rows; r++) {
        __m256 t = bs.mins ? _mm256_mul_ps(mn, _mm256_set1_ps((float)bsum[r * nb + b]))
                           : _mm256_setzero_ps();
        t = _mm256_fmadd_ps(d0, _mm256_cvtepi32_ps(dot[r * sub]), t);
        if (sub == 2) t = _mm256_fmadd_ps(d1, _mm256_cvtepi32_ps(dot[r * sub + 1]), t);
        acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(sx[r * nb + b]), t, acc[r]);
    }
}

ALWAYS_INLINE void store_row(void *y, int64_t stride, int64_t m, int64_t col, __m256 v, int bf16)
{
    if (!bf16) {
        _mm256_storeu_ps((float *)y + m * stride + col, v);
        return;
    }
    float f[GROUP];
    _mm256_storeu_ps(f, v);
    uint16_t *out = (uint16_t *)y + m * stride + col;
    for (int j = 0; j < GROUP; j++) out[j] = float_to_bf16(f[j]);
}

/* Group g (8 columns) for `rows` (a literal) rows starting at row m0. */
ALWAYS_INLINE void run_group(const uint8_t *w, int64_t g, int64_t nb, int64_t rec,
                             const void *xq, const float *sx, const int32_t *bsum, int64_t K,
                             int64_t m0, const int rows, const int bits, const int sub,
                             const int has_min, const int fast, void *y, int64_t y_stride,
                             int y_bf16)
{
    __m256 acc[ROW_TILE];
    __m256i dot[ROW_TILE * 2];
    for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps();
    const int64_t xsize = fast ? 1 : 2;
    const uint8_t *wg = w + g * nb * rec;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *record = wg + b * rec;
        __builtin_prefetch(record + AHEAD);
        const void *xr[ROW_TILE];
        for (int r = 0; r < rows; r++)
            xr[r] = (const char *)xq + ((m0 + r) * K + b * BLOCK) * xsize;
        record_dots(dot, record, xr, rows, bits, sub, fast);
        block_update(acc, dot, block_scales(record, bits, sub, has_min), sx + m0 * nb,
                     bsum + m0 * nb, nb, b, rows, sub);
    }
    for (int r = 0; r < rows; r++) store_row(y, y_stride, m0 + r, g * GROUP, acc[r], y_bf16);
}

#else /* generic: unpack each record to int16 and multiply in plain C */

/* Where layout.py puts column j's input k: the byte, and 4 for a high nibble. */
static void position(int bits, int fast, int j, int k, int *byte, int *shift)
{
    *shift = 0;
    if (fast) {
        const int s = k / 4, pos = 4 * j + k % 4;
        if (bits == 8) *byte = 32 * s + pos;
        else *byte = 32 * (s / 2) + pos, *shift = 4 * (s % 2);
        return;
    }
    const int s = k / 2, lane = 2 * j + k % 2;
    if (bits == 8) {
        *byte = 16 * s + lane;
        return;
    }
    const int chunk = s / 4, u = s % 4, high_nibble = u / 2, unpack_high = u % 2;
    int within;
    if (!unpack_high) within = lane < 8 ? lane : lane + 8;
    else within = lane < 8 ? lane + 8 : lane + 16;
    *byte = 32 * chunk + within;
    *shift = 4 * high_nibble;
}

static void unpack_record(const uint8_t *q, int bits, int fast, int16_t w[GROUP][BLOCK])
{
    for (int j = 0; j < GROUP; j++)
        for (int k = 0; k < BLOCK; k++) {
            int byte, shift;
            position(bits, fast, j, k, &byte, &shift);
            const uint8_t v = (uint8_t)(q[byte] >> shift);
            w[j][k] = bits == 4 ? (int16_t)(v & 0x0F) : (int16_t)(int8_t)v;
        }
}

static void run_group(const uint8_t *w, int64_t g, int64_t nb, int64_t rec, const void *xq,
                      const float *sx, const int32_t *bsum, int64_t K, int64_t m0, int rows,
                      int bits, int sub, int has_min, int fast, void *y, int64_t y_stride,
                      int y_bf16)
{
    float acc[ROW_TILE][GROUP] = {{0}};
    const uint8_t *wg = w + g * nb * rec;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *record = wg + b * rec;
        int16_t wv[GROUP][BLOCK];
        unpack_record(record, bits, fast, wv);
        const BlockScales bs = block_scales(record, bits, sub, has_min);
        for (int r = 0; r < rows; r++) {
            const int64_t m = m0 + r, i = m * nb + b;
            for (int j = 0; j < GROUP; j++) {
                int32_t dot[2] = {0, 0};
                for (int k = 0; k < BLOCK; k++) {
                    const int32_t xv = fast ? ((const int8_t *)xq)[m * K + b * BLOCK + k]
                                            : ((const int16_t *)xq)[m * K + b * BLOCK + k];
                    dot[sub == 2 ? k / 16 : 0] += xv * wv[j][k];
                }
                float t = bs.mins ? bs.mins[j] * (float)bsum[i] : 0.0f;
                t = bs.scales[j] * (float)dot[0] + t;
                if (sub == 2) t = bs.scales[GROUP + j] * (float)dot[1] + t;
                acc[r][j] = sx[i] * t + acc[r][j];
            }
        }
    }
    for (int r = 0; r < rows; r++) {
        const int64_t m = m0 + r;
        for (int j = 0; j < GROUP; j++) {
            if (y_bf16) ((uint16_t *)y)[m * y_stride + g * GROUP + j] = float_to_bf16(acc[r][j]);
            else ((float *)y)[m * y_stride + g * GROUP + j] = acc[r][j];
        }
    }
}

#endif

/* A group's rows, ROW_TILE at a time; literal row counts and formats so the loops unroll. */
static void run_rows(const uint8_t *w, int64_t g, int64_t nb, int64_t rec, const void *xq,
                     const float *sx, const int32_t *bsum, int64_t M, int64_t K, int bits,
                     int sub, int has_min, int fast, void *y, int64_t y_stride, int y_bf16)
{
    for (int64_t m0 = 0; m0 < M; m0 += ROW_TILE) {
        const int rows = M - m0 < ROW_TILE ? (int)(M - m0) : ROW_TILE;
#define FORMAT_CASE(n, B, S, H, F)                                                               \
    if (rows == n && bits == B && sub == S && has_min == H && fast == F) {                       \
        run_group(w, g, nb, rec, xq, sx, bsum, K, m0, n, B, S, H, F, y, y_stride, y_bf16);      \
        continue;                                                                                \
    }
#define FORMATS(n)                                                                               \
    FORMAT_CASE(n, 4, 1, 1, 0) FORMAT_CASE(n, 8, 1, 0, 0) FORMAT_CASE(n, 8, 1, 1, 0)              \
    FORMAT_CASE(n, 8, 2, 0, 0) FORMAT_CASE(n, 4, 1, 1, 1) FORMAT_CASE(n, 8, 1, 0, 1)              \
    FORMAT_CASE(n, 8, 1, 1, 1) FORMAT_CASE(n, 8, 2, 0, 1)
        FORMATS(1)
        FORMATS(2)
        FORMATS(3)
        FORMATS(4)
#undef FORMATS
#undef FORMAT_CASE
        run_group(w, g, nb, rec, xq, sx, bsum, K, m0, rows, bits, sub, has_min, fast, y,
                  y_stride, y_bf16);
    }
}

int quant_matmul(const void *xq, const float *sx, const int32_t *bsum, int64_t M, int64_t K,
                 int32_t fast, const uint8_t *w, int64_t N, int32_t bits, int32_t sub,
                 int32_t has_min, void *y, int64_t y_stride, int32_t y_bf16, int32_t num_threads)
{
    if (K % BLOCK || N % GROUP || (bits != 4 && bits != 8) || (sub != 1 && sub != 2)) return 1;
    if (bits == 4 && (sub != 1 || !has_min)) return 1; /* the 4-bit types all have mins */
    const int64_t nb = K / BLOCK, rec = record_bytes(bits, sub, has_min), groups = N / GROUP;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t g = 0; g < groups; g++)
        run_rows(w, g, nb, rec, xq, sx, bsum, M, K, bits, sub, has_min != 0, fast != 0, y,
                 y_stride, y_bf16);
    return 0;
}
