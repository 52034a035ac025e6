/* Linear layers on quantized weights: y (M, N) = x (M, K) W^T with W as integer blocks
   (radixlm/model/quant/layout.py packs them), activations quantized per 32 inputs.

   quantize_rows   x (float32 or bfloat16) -> per block of 32: xq = round(x * QMAX / max|x|)
                   (int16 in exact mode, int8 in fast), sx = max|x| / QMAX, sxb = sx * sum(xq)
   quant_matmul    per output column, block by block in order: an integer dot product of xq
                   with the block's values (one per scale of the block), then in float32
                       acc = fma(dot_h, scale_h * sx, acc)   for each scale h of the block
                       acc = fma(min, sxb, acc)              where the type has mins
                   The same order at every row count and thread count (threads split the
                   columns), so decode, prefill, batched and alone give the same bits.

   A record is 8 columns x 32 inputs of one weight (layout.py draws it): the values, then the
   block's scales in one of two forms, each exactly what the gguf package dequantizes:
       f16   scales (sub x 8 fp16), mins (8 fp16)                      Q4_0, Q4_1, Q8_0
       k     sc (sub x 8 int8), mc (8 int8), with the super-block's    Q4_K, Q5_K, Q6_K
             d (8 fp16) and -dmin (8 fp16) once per 8 records (quant_record.h)
             scale = d * sc and min = -dmin * mc, products exact in float32
   so a group's stream holds the file's bytes, or close to them, and a decode step streams no
   more. The factors of a super-block are loaded once, at its first record.

   Every vector the unpacking makes holds the 8 columns in its 8 int32 lanes, so the dot
   products need no horizontal sums: exact mode multiplies int16 pairs (vpmaddwd; vpdpwssd with
   AVX512-VNNI), fast mode unsigned 4-bit or sign-folded 8-bit values by int8 quads (vpmaddubsw
   + vpmaddwd; vpdpbusd with VNNI). None of these sums can saturate: |4-bit x int8| pairs <=
   2 * 15 * 127, |8-bit x int8| pairs <= 2 * 128 * 127, int16 pairs stay far from int32's range
   for 32 inputs. Integer sums are exact in any order, so a dot may be split across
   accumulators (to keep the multiply units busy) without changing a bit.

   Rows go ROW_TILE at a time through one group of 8 columns (the tile's accumulators in
   registers, the group's records in L1 for every tile); prefill-sized M goes in slabs of rows
   whose activations stay in L2 while the threads share out the groups. The avx512 build runs
   the 256-bit code with its 32 registers (a longer row tile) and the VNNI forms where the CPU
   has them: on a CPU that runs 512-bit vectors as two halves (Zen 4), zmm would add only
   shuffles (docs/kernels.md). The generic build unpacks a record and multiplies in plain C. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#include "bf16.h"
#include "quant_record.h"
#include "simd.h"

#if defined(__AVX512F__)
#define ROW_TILE 8 /* rows per pass over a group's records: their accumulators in registers */
#else
#define ROW_TILE 4
#endif
#define SLAB_ROWS 64 /* rows whose quantized activations stay in L2 across the groups */
#define AHEAD 2048   /* bytes of the weight stream requested ahead of use */

/* ---- activations ------------------------------------------------------------------------ */

int quantize_rows(const void *x, int64_t M, int64_t K, int32_t bf16, int32_t fast, void *xq,
                  float *sx, float *sxb, int32_t num_threads)
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
        sxb[i] = sx[i] * (float)sum;
    }
    return 0;
}

/* A record's values as int16, [column][input] (the generic build's tiles). */
__attribute__((unused)) static void unpack_record(const uint8_t *q, int bits, int fast,
                                                  int16_t w[GROUP][BLOCK])
{
    for (int j = 0; j < GROUP; j++)
        for (int k = 0; k < BLOCK; k++) w[j][k] = (int16_t)record_value(q, bits, fast, j, k);
}

/* A record's scales and mins as floats, [scale h][column] and [column] (mins 0 without),
   from its scale bytes s and, for the K types, its super-block's factors f (d, -dmin). */
static void scalar_scales(const uint8_t *f, const uint8_t *s, int sub, int has_min, int kscale,
                          float d[2][GROUP], float mn[GROUP])
{
    const uint16_t *halves = (const uint16_t *)s, *factors = (const uint16_t *)f;
    const int8_t *ints = (const int8_t *)s;
    for (int j = 0; j < GROUP; j++) {
        for (int h = 0; h < sub; h++)
            d[h][j] = kscale ? half_to_float(factors[j]) * (float)ints[8 * h + j]
                             : half_to_float(halves[8 * h + j]);
        mn[j] = 0.0f;
        if (has_min && kscale)
            mn[j] = half_to_float(factors[GROUP + j]) * (float)ints[8 * sub + j];
        else if (has_min)
            mn[j] = half_to_float(halves[8 * sub + j]);
    }
}

/* One tile's view of the activations: rows m0 .. m0 + rows of xq, and their per-block
   sx and sxb. */
typedef struct {
    const void *xq;
    const float *sx, *sxb;
    int64_t K, nb, m0;
} Rows;

#if defined(__AVX2__)

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define HAS_VNNI 1
#define DOT_PAIRS(acc, w, x) _mm256_dpwssd_epi32(acc, w, x)
#define DOT_QUADS(acc, u, s) _mm256_dpbusd_epi32(acc, u, s)
#else
#define HAS_VNNI 0
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

ALWAYS_INLINE __m256 load_halves(const uint8_t *p)
{
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}

ALWAYS_INLINE __m256 load_int8s(const uint8_t *p)
{
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

/* A record's scales (d[h], 8 columns each) and mins, from the bytes after its values and,
   for the K types, its super-block's d and -dmin (loaded once per super-block). */
ALWAYS_INLINE void record_scales(const uint8_t *s, const int sub, const int has_min,
                                 const int kscale, __m256 super_d, __m256 super_nd, __m256 *d,
                                 __m256 *mn)
{
    if (kscale) {
        for (int h = 0; h < sub; h++) d[h] = _mm256_mul_ps(super_d, load_int8s(s + 8 * h));
        if (has_min) *mn = _mm256_mul_ps(super_nd, load_int8s(s + 8 * sub));
    } else {
        for (int h = 0; h < sub; h++) d[h] = load_halves(s + 16 * h);
        if (has_min) *mn = load_halves(s + 16 * sub);
    }
}

/* Nibble vector e (32 lanes, the low 4 bits of its values) with its high bits from the record's
   plane (quant_record.h), as bytes: 5-bit values 0..31, or 6-bit ones made signed (- 32). */
ALWAYS_INLINE __m256i with_plane(__m256i nibbles, const uint8_t *q, const int bits, const int e)
{
    const int h = bits - 4;
    const __m256i plane = _mm256_loadu_si256((const __m256i *)(q + 128 + 32 * (e * h / 8)));
    /* 16-bit shifts: the masked bits never cross a byte (shift + h <= 8) */
    const __m256i high = _mm256_and_si256(_mm256_srli_epi16(plane, (e * h) % 8),
                                          _mm256_set1_epi8((char)((1 << h) - 1)));
    const __m256i v = _mm256_or_si256(nibbles, _mm256_slli_epi16(high, 4));
    return bits == 6 ? _mm256_sub_epi8(v, _mm256_set1_epi8(32)) : v;
}

/* Independent partial sums per dot: a VNNI dot-product's result feeds the next one, so one
   accumulator per row is a chain of its latency (4 cycles on Zen 4) and a tile of few rows
   (decode) would run at a quarter of the unit's rate or less. Integer sums are exact, so the
   partials add up to the same bits. Without VNNI the chain is the 1-cycle add. */
#define MAX_PARTIALS 4
#if HAS_VNNI
#define PARTIALS(rows) ((rows) >= 8 ? 1 : (rows) >= 4 ? 2 : MAX_PARTIALS)
#else
#define PARTIALS(rows) 1
#endif

/* The int32 dot products (8 columns a vector) of one record's values q with `rows` rows:
   dot[r * sub + h] for the record's scale h. x: the rows' 32 quantized inputs of this block,
   `stride` bytes apart. A step t of the record's loop adds into partial t % P. */
ALWAYS_INLINE void record_dots(__m256i *dot, const uint8_t *q, const char *x, int64_t stride,
                               const int rows, const int bits, const int sub, const int fast)
{
    const int parts = PARTIALS(rows);
    __m256i acc[ROW_TILE * 2][MAX_PARTIALS];
    for (int i = 0; i < rows * sub; i++)
        for (int p = 0; p < parts; p++) acc[i][p] = _mm256_setzero_si256();
#define ADD_PAIRS(i, t, w, xv) acc[i][(t) % parts] = DOT_PAIRS(acc[i][(t) % parts], w, xv)
#define ADD_QUADS(i, t, u, xv) acc[i][(t) % parts] = DOT_QUADS(acc[i][(t) % parts], u, xv)
    const __m256i low4 = _mm256_set1_epi8(0x0F), zero = _mm256_setzero_si256();
#if !HAS_VNNI
    __m256i pairs[ROW_TILE]; /* int16 sums of maddubs pairs (the fast 4/5-bit path) */
    for (int r = 0; r < rows; r++) pairs[r] = zero;
#endif
    if (!fast && nibble_bits(bits)) {
        for (int c = 0; c < 4; c++) { /* a 32-byte load: inputs 8c .. 8c + 7 of every column */
            const __m256i v = _mm256_loadu_si256((const __m256i *)(q + 32 * c));
            __m256i lo = _mm256_and_si256(v, low4);
            __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
            if (bits > 4) { /* the high bits of nibble vectors 2c and 2c + 1 */
                lo = with_plane(lo, q, bits, 2 * c);
                hi = with_plane(hi, q, bits, 2 * c + 1);
            }
            /* int16 lanes: zero-extended, or sign-extended where 6-bit values were made signed */
            const __m256i lo_ext = bits == 6 ? _mm256_cmpgt_epi8(zero, lo) : zero;
            const __m256i hi_ext = bits == 6 ? _mm256_cmpgt_epi8(zero, hi) : zero;
            const __m256i w[4] = {
                _mm256_unpacklo_epi8(lo, lo_ext), _mm256_unpackhi_epi8(lo, lo_ext),
                _mm256_unpacklo_epi8(hi, hi_ext), _mm256_unpackhi_epi8(hi, hi_ext)};
            const int h = sub == 2 ? c / 2 : 0; /* inputs 8c .. 8c + 7: scale h */
            for (int r = 0; r < rows; r++)
                for (int u = 0; u < 4; u++) /* int16 pair 4c + u: inputs 8c + 2u, + 1 */
                    ADD_PAIRS(r * sub + h, u, w[u], bcast32(x + r * stride + 4 * (4 * c + u)));
        }
    } else if (!fast) { /* 8-bit values, exact: 16 bytes sign-extended per pair of inputs */
        for (int s = 0; s < 16; s++) {
            const __m256i w = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(q + 16 * s)));
            const int h = sub == 2 ? s / 8 : 0;
            for (int r = 0; r < rows; r++)
                ADD_PAIRS(r * sub + h, s, w, bcast32(x + r * stride + 4 * s));
        }
    } else if (bits == 4 || bits == 5) { /* fast: unsigned values against int8 quads */
        for (int c = 0; c < 4; c++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(q + 32 * c));
            __m256i lo = _mm256_and_si256(v, low4);
            __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
            if (bits == 5) {
                lo = with_plane(lo, q, bits, 2 * c);
                hi = with_plane(hi, q, bits, 2 * c + 1);
            }
#if HAS_VNNI
            for (int r = 0; r < rows; r++) { /* quads 2c, 2c + 1: inputs 8c .. 8c + 7 */
                ADD_QUADS(r, 2 * c, lo, bcast32(x + r * stride + 8 * c));
                ADD_QUADS(r, 2 * c + 1, hi, bcast32(x + r * stride + 8 * c + 4));
            }
#else
            /* Without VNNI a quad dot is three instructions (maddubs, madd by ones, add). The
               maddubs pairs are summed in int16 instead, and widened once per flush: a pair is
               at most 2 x 31 x 127 = 7,874 (5-bit) or 3,810 (4-bit), so 4 pairs (5-bit: one
               flush per 2 c) or 8 (4-bit: one per record) stay inside int16. Exact sums: the
               same bits. */
            for (int r = 0; r < rows; r++) {
                pairs[r] = _mm256_add_epi16(
                    pairs[r], _mm256_maddubs_epi16(lo, bcast32(x + r * stride + 8 * c)));
                pairs[r] = _mm256_add_epi16(
                    pairs[r], _mm256_maddubs_epi16(hi, bcast32(x + r * stride + 8 * c + 4)));
            }
            if (c == 3 || (bits == 5 && c == 1))
                for (int r = 0; r < rows; r++) {
                    acc[r][0] = _mm256_add_epi32(acc[r][0],
                                                 _mm256_madd_epi16(pairs[r], _mm256_set1_epi16(1)));
                    pairs[r] = _mm256_setzero_si256();
                }
#endif
        }
    } else if (bits == 6) { /* fast, 6-bit values made signed: |w| against x with w's sign */
        for (int c = 0; c < 4; c++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(q + 32 * c));
            const __m256i w[2] = {
                with_plane(_mm256_and_si256(v, low4), q, bits, 2 * c),
                with_plane(_mm256_and_si256(_mm256_srli_epi16(v, 4), low4), q, bits, 2 * c + 1)};
            for (int u = 0; u < 2; u++) { /* quad 2c + u: inputs 8c + 4u .. + 3, scale h */
                const __m256i aw = _mm256_abs_epi8(w[u]);
                const int h = sub == 2 ? c / 2 : 0;
                for (int r = 0; r < rows; r++) {
                    const __m256i xr = bcast32(x + r * stride + 8 * c + 4 * u);
                    ADD_QUADS(r * sub + h, 2 * c + u, aw, _mm256_sign_epi8(xr, w[u]));
                }
            }
        }
    } else { /* fast, 8-bit signed values: |w| against x with w's sign */
        for (int s = 0; s < 8; s++) {
            const __m256i w = _mm256_loadu_si256((const __m256i *)(q + 32 * s));
            const __m256i aw = _mm256_abs_epi8(w);
            const int h = sub == 2 ? s / 4 : 0;
            for (int r = 0; r < rows; r++)
                ADD_QUADS(r * sub + h, s, aw, _mm256_sign_epi8(bcast32(x + r * stride + 4 * s), w));
        }
    }
#undef ADD_PAIRS
#undef ADD_QUADS
    for (int i = 0; i < rows * sub; i++) {
        __m256i sum = acc[i][0];
        for (int p = 1; p < parts; p++) sum = _mm256_add_epi32(sum, acc[i][p]);
        dot[i] = sum;
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

/* Group g (8 columns, records at wg) for `rows` (a literal) rows of a. */
ALWAYS_INLINE void run_tile(const uint8_t *wg, int64_t g, Rows a, const int rows, const int bits,
                            const int sub, const int has_min, const int kscale, const int fast,
                            void *y, int64_t y_stride, int y_bf16)
{
    __m256 acc[ROW_TILE];
    __m256i dot[ROW_TILE * 2];
    for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps();
    const int64_t xsize = fast ? 1 : 2, stride = a.K * xsize, qbytes = GROUP * BLOCK * bits / 8;
    const int64_t rec = qbytes + scale_bytes(sub, has_min, kscale);
    const int64_t fb = factor_bytes(has_min, kscale);
    const char *x = (const char *)a.xq + a.m0 * stride;
    const float *sx = a.sx + a.m0 * a.nb, *sxb = a.sxb + a.m0 * a.nb;
    __m256 super_d = _mm256_setzero_ps(), super_nd = _mm256_setzero_ps();
    const uint8_t *record = wg;
    for (int64_t b = 0; b < a.nb; b++) {
        if (kscale && b % SUPER == 0) { /* the super-block's d and -dmin, then its 8 records */
            super_d = load_halves(record);
            if (has_min) super_nd = load_halves(record + 16);
            record += fb;
        }
        __builtin_prefetch(record + AHEAD);
        record_dots(dot, record, x + b * BLOCK * xsize, stride, rows, bits, sub, fast);
        __m256 d[2], mn = _mm256_setzero_ps();
        record_scales(record + qbytes, sub, has_min, kscale, super_d, super_nd, d, &mn);
        for (int r = 0; r < rows; r++) {
            const __m256 s = _mm256_set1_ps(sx[r * a.nb + b]);
            for (int h = 0; h < sub; h++)
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r * sub + h]),
                                         _mm256_mul_ps(d[h], s), acc[r]);
            if (has_min) acc[r] = _mm256_fmadd_ps(mn, _mm256_set1_ps(sxb[r * a.nb + b]), acc[r]);
        }
        record += rec;
    }
    for (int r = 0; r < rows; r++) store_row(y, y_stride, a.m0 + r, g * GROUP, acc[r], y_bf16);
}

#else /* generic: unpack each record to int16 and multiply in plain C */

static void run_tile(const uint8_t *wg, int64_t g, Rows a, int rows, int bits, int sub,
                     int has_min, int kscale, int fast, void *y, int64_t y_stride, int y_bf16)
{
    float acc[ROW_TILE][GROUP] = {{0}};
    const int64_t qbytes = GROUP * BLOCK * bits / 8;
    const int64_t rec = qbytes + scale_bytes(sub, has_min, kscale);
    const int64_t fb = factor_bytes(has_min, kscale);
    for (int64_t b = 0; b < a.nb; b++) {
        const uint8_t *record = record_at(wg, b, rec, fb);
        int16_t wv[GROUP][BLOCK];
        unpack_record(record, bits, fast, wv);
        float d[2][GROUP], mn[GROUP];
        scalar_scales(factors_at(wg, b, rec, fb), record + qbytes, sub, has_min, kscale, d, mn);
        for (int r = 0; r < rows; r++) {
            const int64_t m = a.m0 + r, i = m * a.nb + b;
            for (int j = 0; j < GROUP; j++) {
                int32_t dot[2] = {0, 0};
                for (int k = 0; k < BLOCK; k++) {
                    const int64_t at = m * a.K + b * BLOCK + k;
                    const int32_t xv =
                        fast ? ((const int8_t *)a.xq)[at] : ((const int16_t *)a.xq)[at];
                    dot[sub == 2 ? k / 16 : 0] += xv * wv[j][k];
                }
                for (int h = 0; h < sub; h++)
                    acc[r][j] = fmaf((float)dot[h], d[h][j] * a.sx[i], acc[r][j]);
                if (has_min) acc[r][j] = fmaf(mn[j], a.sxb[i], acc[r][j]);
            }
        }
    }
    for (int r = 0; r < rows; r++) {
        const int64_t m = a.m0 + r;
        for (int j = 0; j < GROUP; j++) {
            if (y_bf16) ((uint16_t *)y)[m * y_stride + g * GROUP + j] = float_to_bf16(acc[r][j]);
            else ((float *)y)[m * y_stride + g * GROUP + j] = acc[r][j];
        }
    }
}

#endif

/* Rows m0 .. m1 of group g: tiles of ROW_TILE, then the rest in halving tiles (literal row
   counts and formats, so each tile's loops unroll and its accumulators stay in registers). */
static void run_rows(const uint8_t *w, int64_t g, Rows a, int64_t m1, int bits, int sub,
                     int has_min, int kscale, int fast, void *y, int64_t y_stride, int y_bf16)
{
    const uint8_t *wg = w + g * group_bytes(a.nb, bits, sub, has_min, kscale);
    while (a.m0 < m1) {
        const int64_t left = m1 - a.m0;
        const int rows = left >= ROW_TILE ? ROW_TILE : left >= 4 ? 4 : left >= 2 ? 2 : 1;
#define FORMAT_CASE(n, B, S, H, KS, F)                                                           \
    if (rows == n && bits == B && sub == S && has_min == H && kscale == KS && fast == F) {        \
        run_tile(wg, g, a, n, B, S, H, KS, F, y, y_stride, y_bf16);                             \
        a.m0 += n;                                                                               \
        continue;                                                                                \
    }
#define MODE_FORMATS(n, F)                                                                       \
    FORMAT_CASE(n, 4, 1, 1, 0, F) /* Q4_0, Q4_1 */                                               \
    FORMAT_CASE(n, 8, 1, 0, 0, F) /* Q8_0 */                                                     \
    FORMAT_CASE(n, 4, 1, 1, 1, F) /* Q4_K */                                                     \
    FORMAT_CASE(n, 5, 1, 1, 1, F) /* Q5_K */                                                     \
    FORMAT_CASE(n, 6, 2, 0, 1, F) /* Q6_K */
#define FORMATS(n) MODE_FORMATS(n, 0) MODE_FORMATS(n, 1)
        FORMATS(1)
        FORMATS(2)
        FORMATS(4)
#if ROW_TILE == 8
        FORMATS(8)
#endif
#undef FORMATS
#undef MODE_FORMATS
#undef FORMAT_CASE
        return; /* quant_matmul refused every other format */
    }
}

int quant_matmul(const void *xq, const float *sx, const float *sxb, int64_t M, int64_t K,
                 int32_t fast, const uint8_t *w, int64_t N, int32_t bits, int32_t sub,
                 int32_t has_min, int32_t kscale, void *y, int64_t y_stride, int32_t y_bf16,
                 int32_t num_threads)
{
    if (K % BLOCK || N % GROUP) return 1;
    const int known = (bits == 4 && sub == 1 && has_min) ||                /* Q4_0/Q4_1/Q4_K */
                      (bits == 8 && sub == 1 && !has_min && !kscale) ||    /* Q8_0 */
                      (bits == 5 && sub == 1 && has_min && kscale) ||      /* Q5_K */
                      (bits == 6 && sub == 2 && !has_min && kscale);       /* Q6_K */
    if (!known || (kscale && K % (SUPER * BLOCK))) return 1;
    const int64_t nb = K / BLOCK, groups = N / GROUP;
#pragma omp parallel num_threads(num_threads)
    for (int64_t m0 = 0; m0 < M; m0 += SLAB_ROWS) {
        const int64_t m1 = m0 + SLAB_ROWS < M ? m0 + SLAB_ROWS : M;
        const Rows a = {xq, sx, sxb, K, nb, m0};
        /* static and nowait: a thread keeps its groups (in its L2) from slab to slab */
#pragma omp for schedule(static) nowait
        for (int64_t g = 0; g < groups; g++)
            run_rows(w, g, a, m1, bits, sub, has_min != 0, kscale != 0, fast != 0, y, y_stride,
                     y_bf16);
    }
    return 0;
}

/* Rows of a quantized weight as floats (an embedding lookup): out[i] = W[rows[i]], each value
   scale * q + min rounded after the multiply and after the add, as the gguf package
   dequantizes (never a fused multiply-add: the float model the exact numerics are held to has
   these values). out is float32, or bfloat16 when out_bf16. */
int quant_rows(const uint8_t *w, const int64_t *rows, int64_t num_rows, int64_t N, int64_t K,
               int32_t fast, int32_t bits, int32_t sub, int32_t has_min, int32_t kscale,
               void *out, int32_t out_bf16)
{
    if (K % BLOCK || N % GROUP || (kscale && K % (SUPER * BLOCK))) return 1;
    const int64_t nb = K / BLOCK, rec = record_bytes(bits, sub, has_min, kscale);
    const int64_t qbytes = GROUP * BLOCK * bits / 8, fb = factor_bytes(has_min, kscale);
    const int64_t per_group = group_bytes(nb, bits, sub, has_min, kscale);
    for (int64_t i = 0; i < num_rows; i++) {
        if (rows[i] < 0 || rows[i] >= N) return 2;
        const int64_t g = rows[i] / GROUP;
        const int j = (int)(rows[i] % GROUP);
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *wg = w + g * per_group, *record = record_at(wg, b, rec, fb);
            float d[2][GROUP], mn[GROUP];
            scalar_scales(factors_at(wg, b, rec, fb), record + qbytes, sub, has_min, kscale, d,
                          mn);
            for (int k = 0; k < BLOCK; k++) {
                const int q = record_value(record, bits, fast, j, k);
                volatile float scaled = (float)q * d[sub == 2 ? k / 16 : 0][j]; /* no fma */
                const float v = has_min ? scaled + mn[j] : scaled;
                const int64_t at = i * K + b * BLOCK + k;
                if (out_bf16) ((uint16_t *)out)[at] = float_to_bf16(v);
                else ((float *)out)[at] = v;
            }
        }
    }
    return 0;
}
