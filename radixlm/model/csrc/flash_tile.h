/* Flash attention on register tiles: the inner loops of the extend kernel, which the decode
   kernel also uses for the rows of requests that share a run of slots.

   A tile is a set of query rows (a multiple of R) with their online-softmax state (running max m,
   running sum l, unnormalised output acc) and, per row, the last key it may see (causal masks;
   -1 for padding rows). tile_attend walks the keys slots[0 .. visible) in blocks of KB:

       K block -> kt (D, KB) transposed, V block -> vb (KB, D): widened, contiguous, in L1
       for each group of R rows that can see some key of the block:
           S (R, KB) = Q K^T        R x KB/VL accumulators, one broadcast-FMA per (row, d, VL keys)
           mask keys past each row's limit; online softmax
           acc (R, D) = acc * alpha + P V       in slabs of PV_NC vectors: R x PV_NC accumulators

   Vectors are VL floats (simd.h): one register of the instruction set the file is built for;
   KB and R are chosen per build so the tiles fit that register file.

   bfloat16 dot products (tile_attend_bf16, on CPUs with AVX512-BF16): the same loops on pairs
   of bfloat16 (one 32-bit lane holds elements 2i and 2i+1), each vdpbf16ps doing two
   multiply-adds per lane into float32 accumulators, so half the instructions. Q K^T pairs run
   along D (kt holds K transposed pair-wise, (D/2, KB)); P V pairs run along the keys (vb holds
   rows 2i and 2i+1 interleaved, (KB/2, D)). The queries are bfloat16 already (a bfloat16
   model); the probabilities P are rounded to bfloat16 after the float32 softmax, as GPU flash
   attention does; m, l and acc stay float32.

   int8 K/V (KV_I8): each row (slot, kv head) is D int8 codes and one bfloat16 scale, the value
   code * scale. Staging dequantizes into kt / vb, exactly (an 8-bit code times a scale of 8
   significant bits fits float32's 24), so the tile runs the float32 loops unchanged.
*/
#ifndef RADIXLM_FLASH_TILE_H
#define RADIXLM_FLASH_TILE_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "simd.h"

/* Tile sizes per build, from the register file (see block_rows and pv_slab):
     S = Q K^T    R rows x KB/VL accumulators + KB/VL key vectors + one broadcast
     acc += P V   R rows x PV_NC accumulators + PV_NC value vectors + one broadcast
   AVX-512 (32 registers): 8 x 2 + 2 + 1 both; AVX2 and generic (16): 6 x 2 + 2 + 1. */
#if VL == 16
#define KB 32 /* keys per block */
#define R 8   /* query rows per register group */
#else
#define KB (2 * VL)
#define R 6
#endif
#define PV_NC 2 /* vectors of columns per P V slab */
#define NV (KB / VL)
#define NO_SCORE -1e30f /* "minus infinity" that -ffast-math may not assume away */
#define LOG2E 1.44269504f /* scores times this are in log2 units: e^x = 2^(x log2 e) */

/* How the pool stores K/V rows: the kernels' `kind`, a literal in every specialised build (so
   each branch on it is resolved at compile time). kv_mode at the C boundary maps onto it:
   0 -> KV_F32, 1 and 2 -> KV_BF16, 3 -> KV_I8. */
#define KV_F32 0
#define KV_BF16 1
#define KV_I8 2 /* int8 codes, one bfloat16 scale per row (slot, kv head) */

/* Bytes of one stored element. */
ALWAYS_INLINE int64_t kv_elem(const int kind) { return kind == KV_F32 ? 4 : kind == KV_BF16 ? 2 : 1; }

/* Element d of a row as float32: the code alone for KV_I8 (its row's scale is applied by the
   caller, once per row). */
ALWAYS_INLINE float kv_at(const char *row, int64_t d, const int kind)
{
    if (kind == KV_F32) return ((const float *)row)[d];
    if (kind == KV_I8) return (float)((const int8_t *)row)[d];
    return bf16_to_float(((const uint16_t *)row)[d]);
}

typedef struct {
    const char *k, *v;   /* the pool layer, as bytes */
    int64_t row_bytes;   /* one slot: KV * D elements */
    int64_t head_offset; /* bytes from a slot's start to this task's head */
    /* KV_I8: the layer's bfloat16 scales, slot s of this head at s * scale_row_bytes +
       scale_head_offset (NULL for float pools) */
    const char *ks, *vs;
    int64_t scale_row_bytes, scale_head_offset;
} KeySource;

/* The bfloat16 scale at byte offset `at` of a scale array, as float32. */
ALWAYS_INLINE float scale_at(const char *scales, int64_t at)
{
    uint16_t bits;
    memcpy(&bits, scales + at, sizeof bits);
    return bf16_to_float(bits);
}

/* Where slot s's scales lie in the scale arrays of src (KV_I8). */
ALWAYS_INLINE int64_t scale_offset(const KeySource *src, int64_t slot)
{
    return slot * src->scale_row_bytes + src->scale_head_offset;
}

typedef struct {
    int64_t rows;         /* a multiple of R */
    const int64_t *limit; /* per row: the last key (index into slots) it may see; -1: none */
    float *acc, *m, *l;   /* (rows, D), (rows), (rows): m starts at NO_SCORE, acc and l at 0 */
} Tile;

/* Ask for the K/V rows of keys slots[from .. to) (row_bytes each) before they are needed: the
   block being computed now takes far longer than the misses, which a random slot order makes
   likely, so they overlap the arithmetic. */
ALWAYS_INLINE void prefetch_block(const KeySource *src, const int64_t *slots, int64_t from,
                                  int64_t to, int64_t row_bytes)
{
    for (int64_t j = from; j < to; j++) {
        const int64_t at = slots[j] * src->row_bytes + src->head_offset;
        for (int64_t b = 0; b < row_bytes; b += 64) { /* one cache line at a time */
            __builtin_prefetch(src->k + at + b);
            __builtin_prefetch(src->v + at + b);
        }
        if (src->ks != NULL) { /* and the rows' scales */
            __builtin_prefetch(src->ks + scale_offset(src, slots[j]));
            __builtin_prefetch(src->vs + scale_offset(src, slots[j]));
        }
    }
}

/* The furthest key any row of the group [r, r + R) may see. */
ALWAYS_INLINE int64_t group_limit(const Tile *t, int64_t r)
{
    int64_t seen = -1;
    for (int64_t i = r; i < r + R; i++) seen = t->limit[i] > seen ? t->limit[i] : seen;
    return seen;
}

/* The online-softmax step of R rows over a block's raw scores x (R rows of KB, in NV vectors;
   sc * x is in log2 units): masks keys j >= count and, per row, j > limit[r] - key0; updates m
   and l; leaves the probabilities in x.

   Lazy rescaling (as FlashAttention-4 does on GPUs): a row's running max m moves only when some
   score of the block exceeds it by more than RESCALE_AT, so probabilities up to 2^RESCALE_AT
   are let through (float32 holds them, and P V, l and acc scale alike; out = acc / l is
   unchanged). After the first blocks a row seldom moves, and the block then costs one compare
   per vector instead of a max tree and a rescale of acc. When it moves, m becomes the block's
   exact max. Stage by stage over the rows, so the rows' dependency chains (the exponentials,
   the sum trees) overlap instead of running one after another. */
#define RESCALE_AT 8.0f
ALWAYS_INLINE void softmax_rows(vf x[R][NV], int64_t count, int64_t key0, const int64_t *limit,
                                float *m, float *l, float *acc, const int64_t D, const float sc)
{
    const vi lanes = iota();
    int moved[R];
    for (int r = 0; r < R; r++) {
        const int64_t last = limit[r] - key0;
        const int64_t end = last + 1 < count ? last + 1 : count; /* keys j < end are visible */
        if (end < KB)
            for (int c = 0; c < NV; c++)
                x[r][c] = where_below(lanes + VL * c, (int32_t)end, x[r][c], splat(NO_SCORE));
        const float bound = (m[r] + RESCALE_AT) / sc; /* sc > 0 */
        moved[r] = 0;
        for (int c = 0; c < NV; c++) moved[r] |= any_above(x[r][c], bound);
    }
    for (int r = 0; r < R; r++) {
        if (!moved[r]) continue;
        vf top_v = x[r][0];
        for (int c = 1; c < NV; c++) top_v = maxv(top_v, x[r][c]);
        const float top = hmax(top_v) * sc; /* > m[r] + RESCALE_AT */
        const float alpha = exp2_1(m[r] - top); /* 0 on the first block */
        l[r] *= alpha;
        m[r] = top;
        float *a = acc + r * D;
#pragma omp simd
        for (int64_t d = 0; d < D; d++) a[d] *= alpha;
    }
    vf sum[R];
    for (int r = 0; r < R; r++) {
        sum[r] = (vf){0};
        for (int c = 0; c < NV; c++) {
            x[r][c] = exp2v(x[r][c] * sc - m[r]);
            sum[r] += x[r][c];
        }
    }
    for (int r = 0; r < R; r++) l[r] += hsum(sum[r]);
}

/* acc[:, c0 .. c0 + VL * nc) += P V for R rows; the slab's accumulators stay in registers. */
ALWAYS_INLINE void pv_slab(float *acc, const float *vb, float p[R][KB], int64_t count,
                           int64_t c0, const int64_t D, const int nc)
{
    vf a[R][PV_NC];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < nc; c++) a[r][c] = loadv(acc + r * D + c0 + c * VL);
    for (int64_t j = 0; j < count; j++) {
        vf vj[PV_NC];
        for (int c = 0; c < nc; c++) vj[c] = loadv(vb + j * D + c0 + c * VL);
        for (int r = 0; r < R; r++) {
            const float pj = p[r][j];
            for (int c = 0; c < nc; c++) a[r][c] += pj * vj[c];
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < nc; c++) storev(acc + r * D + c0 + c * VL, a[r][c]);
}

/* Rows [r0, r0 + R) against one key block: S = Q K^T, mask, online softmax, acc += P V.
   limit[r]: the last key index row r may see. */
ALWAYS_INLINE void block_rows(const float *qs, const float *kt, const float *vb, int64_t count,
                              int64_t key0, const int64_t *limit, float *acc, float *m, float *l,
                              const int64_t D)
{
    vf s[R][NV];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < NV; c++) s[r][c] = (vf){0};
    for (int64_t d = 0; d < D; d++) {
        vf kd[NV];
        for (int c = 0; c < NV; c++) kd[c] = loadv(kt + d * KB + c * VL);
        for (int r = 0; r < R; r++) {
            const float qv = qs[r * D + d];
            for (int c = 0; c < NV; c++) s[r][c] += qv * kd[c];
        }
    }
    softmax_rows(s, count, key0, limit, m, l, acc, D, 1.0f); /* q is pre-scaled */
    float p[R][KB];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < NV; c++) storev(p[r] + c * VL, s[r][c]);
    /* acc (R, D) += P V in column slabs of PV_NC vectors, then one: R x PV_NC accumulators
       and the V vectors fit in the register file (wider slabs spill to the stack) */
    int64_t c0 = 0;
    for (; c0 + PV_NC * VL <= D; c0 += PV_NC * VL) pv_slab(acc, vb, p, count, c0, D, PV_NC);
    for (; c0 < D; c0 += VL) pv_slab(acc, vb, p, count, c0, D, 1);
}

/* Keys slots[0 .. visible) for every row of the tile; float32 rows qs (rows, D), pre-scaled.
   kt, vb: scratch of KB * D floats each. */
ALWAYS_INLINE void tile_attend(const Tile *t, const float *qs, const KeySource *src,
                               const int64_t *slots, int64_t visible, float *kt, float *vb,
                               const int64_t D, const int kind)
{
    for (int64_t key0 = 0; key0 < visible; key0 += KB) {
        const int64_t count = visible - key0 < KB ? visible - key0 : KB;
        for (int64_t j = 0; j < KB; j++) {
            if (j < count) {
                const int64_t slot = slots[key0 + j], at = slot * src->row_bytes + src->head_offset;
                const char *kr = src->k + at, *vr = src->v + at;
                /* int8: dequantized as staged (exact); 1 for float rows, folded away */
                const float sk = kind == KV_I8 ? scale_at(src->ks, scale_offset(src, slot)) : 1.0f;
                const float sv = kind == KV_I8 ? scale_at(src->vs, scale_offset(src, slot)) : 1.0f;
                for (int64_t d = 0; d < D; d++) {
                    kt[d * KB + j] = kv_at(kr, d, kind) * sk;
                    vb[j * D + d] = kv_at(vr, d, kind) * sv;
                }
            } else {
                for (int64_t d = 0; d < D; d++) kt[d * KB + j] = 0.0f;
            }
        }
        const int64_t next = key0 + KB + KB < visible ? key0 + KB + KB : visible;
        prefetch_block(src, slots, key0 + KB, next, D * kv_elem(kind));
        for (int64_t r = 0; r < t->rows; r += R) {
            if (group_limit(t, r) < key0) continue; /* the whole block is in the group's future */
            block_rows(qs + r * D, kt, vb, count, key0, t->limit + r, t->acc + r * D, t->m + r,
                       t->l + r, D);
        }
    }
}

#if defined(__AVX512BF16__)
#define HAS_BF16_DOTS 1

typedef uint32_t pair_t; /* two bfloat16: element 2i in the low half, 2i + 1 in the high half */

/* acc += a * b pair-wise: lane i gets a.lo * b.lo + a.hi * b.hi; b is one pair for all lanes. */
ALWAYS_INLINE vf dot_pairs(vf acc, __m512i a, pair_t b)
{
    return (vf)_mm512_dpbf16_ps((__m512)acc, (__m512bh)a, (__m512bh)_mm512_set1_epi32((int)b));
}

ALWAYS_INLINE __m512i load_pairs(const pair_t *p) { return _mm512_loadu_si512(p); }

/* float32 -> bfloat16 bits, rounded to nearest even (finite inputs). */
ALWAYS_INLINE uint32_t bf16_bits(float x)
{
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}

/* acc[:, c0 .. c0 + 16 * nc) += P V for R rows, two keys per instruction. */
ALWAYS_INLINE void pv_slab_bf16(float *acc, const pair_t *vb, pair_t p[R][KB / 2],
                                int64_t pairs, int64_t c0, const int64_t D, const int nc)
{
    vf a[R][2];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < nc; c++) a[r][c] = loadv(acc + r * D + c0 + c * 16);
    for (int64_t j = 0; j < pairs; j++) {
        __m512i vj[2];
        for (int c = 0; c < nc; c++) vj[c] = load_pairs(vb + j * D + c0 + c * 16);
        for (int r = 0; r < R; r++)
            for (int c = 0; c < nc; c++) a[r][c] = dot_pairs(a[r][c], vj[c], p[r][j]);
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < nc; c++) storev(acc + r * D + c0 + c * 16, a[r][c]);
}

/* block_rows with bfloat16 pairs: qs (R, D/2), kt (D/2, KB), vb (KB/2, D) pairs. */
ALWAYS_INLINE void block_rows_bf16(const pair_t *qs, const pair_t *kt, const pair_t *vb,
                                   int64_t count, int64_t key0, const int64_t *limit, float *acc,
                                   float *m, float *l, const int64_t D, const float scale)
{
    const int64_t half = D / 2;
    vf s[R][NV];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < NV; c++) s[r][c] = (vf){0};
    for (int64_t d = 0; d < half; d++) {
        __m512i kd[NV];
        for (int c = 0; c < NV; c++) kd[c] = load_pairs(kt + d * KB + c * 16);
        for (int r = 0; r < R; r++) {
            const pair_t qv = qs[r * half + d];
            for (int c = 0; c < NV; c++) s[r][c] = dot_pairs(s[r][c], kd[c], qv);
        }
    }
    softmax_rows(s, count, key0, limit, m, l, acc, D, scale);
    pair_t pp[R][KB / 2];
    for (int r = 0; r < R; r++) {
        for (int c = 0; c < NV / 2; c++) { /* 32 probabilities -> 16 pairs, in key order */
            const __m512bh packed =
                _mm512_cvtne2ps_pbh((__m512)s[r][2 * c + 1], (__m512)s[r][2 * c]);
            memcpy(pp[r] + 16 * c, &packed, sizeof packed);
        }
    }
    const int64_t pairs = (count + 1) / 2;
    int64_t c0 = 0;
    for (; c0 + 32 <= D; c0 += 32) pv_slab_bf16(acc, vb, pp, pairs, c0, D, 2);
    for (; c0 < D; c0 += 16) pv_slab_bf16(acc, vb, pp, pairs, c0, D, 1);
}

/* The 16 x 16 block of 32-bit lanes r[i][j] -> r[j][i]: pairs of rows interleaved by 32 and
   then 64 bits, then 128-bit quarters gathered in two rounds (32 + 32 + 64 instructions). */
ALWAYS_INLINE void transpose16x16(__m512i r[16])
{
    __m512i t[16], u[16], v[8], w[8];
    for (int i = 0; i < 8; i++) { /* t[2i]: rows 2i, 2i+1 at columns 4k, 4k+1 of quarter k */
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) { /* u[4i + j]: rows 4i .. 4i+3 at column 4k + j of quarter k */
        u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int j = 0; j < 4; j++) { /* v: rows 0..7, w: rows 8..15; columns j, 8+j and 4+j, 12+j */
        v[j] = _mm512_shuffle_i32x4(u[j], u[4 + j], 0x88);
        v[4 + j] = _mm512_shuffle_i32x4(u[j], u[4 + j], 0xDD);
        w[j] = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0x88);
        w[4 + j] = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0xDD);
    }
    for (int j = 0; j < 4; j++) {
        r[j] = _mm512_shuffle_i32x4(v[j], w[j], 0x88);
        r[8 + j] = _mm512_shuffle_i32x4(v[j], w[j], 0xDD);
        r[4 + j] = _mm512_shuffle_i32x4(v[4 + j], w[4 + j], 0x88);
        r[12 + j] = _mm512_shuffle_i32x4(v[4 + j], w[4 + j], 0xDD);
    }
}

/* K or V of the keys past the end of a short block: zeros (their scores are masked). */
static const uint16_t ZERO_BF16[256] __attribute__((aligned(64)));

/* Stage the K/V rows of keys slots[key0 .. key0 + count) for tile_attend_bf16: kt (D/2, KB)
   pairs, K transposed (key j in lane j); vb (KB/2, D) pairs, keys 2i and 2i+1 interleaved;
   keys past count are zeros. With D a multiple of 32 (up to 256), in vector registers: K in
   16 x 16 transposes, V two rows at a time through a two-source word permute (the
   element-by-element copies were a visible share of a prefill block); else element by element. */
ALWAYS_INLINE void stage_block_bf16(const KeySource *src, const int64_t *slots, int64_t key0,
                                    int64_t count, pair_t *kt, pair_t *vb, const int64_t D)
{
    const int64_t half = D / 2;
    const uint16_t *k_rows[KB], *v_rows[KB];
    for (int64_t j = 0; j < KB; j++) {
        if (j < count) {
            const int64_t at = slots[key0 + j] * src->row_bytes + src->head_offset;
            k_rows[j] = (const uint16_t *)(src->k + at);
            v_rows[j] = (const uint16_t *)(src->v + at);
        } else {
            k_rows[j] = v_rows[j] = ZERO_BF16;
        }
    }
#if defined(__AVX512BW__)
    if (D % 32 == 0 && D <= 256) {
        for (int64_t g = 0; g < KB; g += 16)
            for (int64_t h = 0; h < half; h += 16) {
                __m512i r[16];
                for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_si512(k_rows[g + i] + 2 * h);
                transpose16x16(r);
                for (int i = 0; i < 16; i++) _mm512_storeu_si512(kt + (h + i) * KB + g, r[i]);
            }
        /* word w of the output: element c + w/2 of row a (w even) or row b (w odd) */
        const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9,
                                            40, 8, 39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1,
                                            32, 0);
        const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
        for (int64_t j = 0; j < KB; j += 2) {
            pair_t *vp = vb + (j / 2) * D;
            for (int64_t c = 0; c < D; c += 32) {
                const __m512i a = _mm512_loadu_si512(v_rows[j] + c);
                const __m512i b = _mm512_loadu_si512(v_rows[j + 1] + c);
                _mm512_storeu_si512(vp + c, _mm512_permutex2var_epi16(a, lo, b));
                _mm512_storeu_si512(vp + c + 16, _mm512_permutex2var_epi16(a, hi, b));
            }
        }
        return;
    }
#endif
    for (int64_t j = 0; j < KB; j++) { /* ZERO_BF16 may be shorter than D here */
        const pair_t *kr = (const pair_t *)k_rows[j];
        for (int64_t d = 0; d < half; d++) kt[d * KB + j] = j < count ? kr[d] : 0;
    }
    for (int64_t j = 0; j < KB; j += 2) {
        pair_t *vp = vb + (j / 2) * D;
        for (int64_t d = 0; d < D; d++)
            vp[d] = (j < count ? v_rows[j][d] : 0u) |
                    (uint32_t)(j + 1 < count ? v_rows[j + 1][d] : 0u) << 16;
    }
}

/* tile_attend with bfloat16 dot products: rows qs (rows, D/2) bfloat16 pairs, unscaled (the
   scores are scaled in float32). K/V are bfloat16 in the pool. kt, vb: KB * D / 2 pairs each. */
ALWAYS_INLINE void tile_attend_bf16(const Tile *t, const pair_t *qs, float scale,
                                    const KeySource *src, const int64_t *slots, int64_t visible,
                                    pair_t *kt, pair_t *vb, const int64_t D)
{
    const int64_t half = D / 2;
    for (int64_t key0 = 0; key0 < visible; key0 += KB) {
        const int64_t count = visible - key0 < KB ? visible - key0 : KB;
        stage_block_bf16(src, slots, key0, count, kt, vb, D);
        const int64_t next = key0 + KB + KB < visible ? key0 + KB + KB : visible;
        prefetch_block(src, slots, key0 + KB, next, D * 2);
        for (int64_t r = 0; r < t->rows; r += R) {
            if (group_limit(t, r) < key0) continue;
            block_rows_bf16(qs + r * half, kt, vb, count, key0, t->limit + r, t->acc + r * D,
                            t->m + r, t->l + r, D, scale);
        }
    }
}
#else
#define HAS_BF16_DOTS 0
#endif

#endif /* RADIXLM_FLASH_TILE_H */
