/* The per-task loops of the decode attention kernel (decode_attention.c describes it). A header
   so that the literal builds of run_task compile as four units in parallel: decode_attention.c
   holds the float32 K/V builds and the entry point, decode_attention_bf16.c the bfloat16 ones,
   decode_attention_dots.c those with bfloat16 dot products, decode_attention_i8.c the int8 ones
   (one unit with all of them was most of the avx512 library's build time). */
#ifndef RADIXLM_DECODE_TASK_H
#define RADIXLM_DECODE_TASK_H

#include <stdlib.h>

#include "flash_tile.h"

#define CHUNK 32 /* keys per softmax update: the chunk's K/V rows stay in L1 */
/* Shared runs of fewer query rows than this go row by row: the tile's staging of each key block
   pays off only over enough rows (measured crossover, float32 and bfloat16; docs/kernels.md). */
#define TILE_MIN_ROWS 16

/* The K and V row addresses of keys slots[from .. from + count), for this task's head; for
   int8 rows (src->ks set) also their scales' addresses, in k_sc / v_sc. */
ALWAYS_INLINE void row_addresses(const KeySource *src, const int64_t *slots, int64_t from,
                                 int64_t count, const char **k_rows, const char **v_rows,
                                 const char **k_sc, const char **v_sc)
{
    for (int64_t j = 0; j < count; j++) {
        const int64_t at = slots[from + j] * src->row_bytes + src->head_offset;
        k_rows[j] = src->k + at;
        v_rows[j] = src->v + at;
        if (src->ks != NULL) {
            k_sc[j] = src->ks + scale_offset(src, slots[from + j]);
            v_sc[j] = src->vs + scale_offset(src, slots[from + j]);
        }
    }
}

/* One key's K and V rows (row_bytes each) and, for int8 rows (k_sc not NULL), their scales. */
ALWAYS_INLINE void prefetch_row(const char *k_row, const char *v_row, int64_t row_bytes,
                                const char *k_sc, const char *v_sc)
{
    for (int64_t b = 0; b < row_bytes; b += 64) { /* one cache line at a time */
        __builtin_prefetch(k_row + b);
        __builtin_prefetch(v_row + b);
    }
    if (k_sc != NULL) {
        __builtin_prefetch(k_sc);
        __builtin_prefetch(v_sc);
    }
}

/* Whether K row j directly follows row j - 1 in memory: a run of consecutive slots, which the
   hardware prefetchers stream on their own. Requests for those rows as well only crowd the
   miss buffers (measured 1.2x slower on 8 requests of 1,200 consecutive slots, no faster on
   scattered ones), so the software prefetches go to the rows that start somewhere new. */
ALWAYS_INLINE int follows(const char *k_row, const char *prev_k_row, int64_t row_bytes)
{
    return k_row == prev_k_row + row_bytes;
}

ALWAYS_INLINE int in_run(const char *const *k_rows, int64_t j, int64_t row_bytes)
{
    return j > 0 && follows(k_rows[j], k_rows[j - 1], row_bytes);
}

#define MAX_VECTORS (256 / VL) /* head_dim up to 256 */

/* Elements d .. d+VL of a K/V row as one float32 vector (bfloat16 widened by a shift; int8
   codes converted, their row's scale not applied). */
ALWAYS_INLINE vf load_kv(const char *row, int64_t d, const int kind)
{
    if (kind == KV_I8) return load_i8v((const int8_t *)row + d);
    return kind == KV_BF16 ? load_bf16v((const uint16_t *)row + d) : loadv((const float *)row + d);
}

/* Online-softmax update of nb query rows (q, pre-scaled) with one chunk of float32 or bfloat16
   keys (`kind`); prefetches the next chunk's rows (next_k, next_v, and next_ks, next_vs: their
   scales, for int8 rows) as it goes.
   Row by row: the query row (scores) and the output row (P V) stay in vector registers while
   the chunk's K and V rows, in L1 by now, stream past. */
ALWAYS_INLINE void update_rows(const char *const *k_rows, const char *const *v_rows,
                               int64_t count, const float *q, int64_t nb, float *acc, float *m,
                               float *l, const int64_t D, const int kind,
                               const char *const *next_k, const char *const *next_v,
                               const char *const *next_ks, const char *const *next_vs,
                               int64_t next_count, int64_t next_bytes)
{
    const int64_t nv = D / VL;
    for (int64_t i = 0; i < nb; i++) {
        vf qv[MAX_VECTORS], a[MAX_VECTORS];
        float s[CHUNK];
        for (int64_t c = 0; c < nv; c++) qv[c] = loadv(q + i * D + VL * c);
        int64_t j = 0;
        for (; j + VL <= count; j += VL) { /* s = q K^T, VL keys summed at once (sums_of) */
            if (i == 0)
                for (int t = 0; t < VL; t++)
                    if (j + t < next_count && !in_run(next_k, j + t, next_bytes))
                        prefetch_row(next_k[j + t], next_v[j + t], next_bytes,
                                     next_ks ? next_ks[j + t] : NULL,
                                     next_ks ? next_vs[j + t] : NULL);
            /* the VL keys' dot products side by side, element block c outermost: VL independent
               chains of fused multiply-adds, where one key's chain alone would wait out each
               one's latency (4x slower); each key still sums c in order, so the same bits */
            vf dots[VL];
            for (int t = 0; t < VL; t++) dots[t] = qv[0] * load_kv(k_rows[j + t], 0, kind);
            for (int64_t c = 1; c < nv; c++)
                for (int t = 0; t < VL; t++)
                    dots[t] += qv[c] * load_kv(k_rows[j + t], VL * c, kind);
            storev(s + j, sums_of(dots));
        }
        for (; j < count; j++) { /* the chunk's last keys, one at a time */
            if (i == 0 && j < next_count && !in_run(next_k, j, next_bytes))
                prefetch_row(next_k[j], next_v[j], next_bytes, next_ks ? next_ks[j] : NULL,
                             next_ks ? next_vs[j] : NULL);
            vf dot = qv[0] * load_kv(k_rows[j], 0, kind);
            for (int64_t c = 1; c < nv; c++) dot += qv[c] * load_kv(k_rows[j], VL * c, kind);
            s[j] = hsum(dot);
        }
        float top = m[i], sum = 0.0f;
        if (count == CHUNK) { /* a whole chunk in vectors: max, 2^(s - top) and their sum */
            vf most = splat(top), total = (vf){0};
            for (int64_t c = 0; c < CHUNK; c += VL) most = maxv(most, loadv(s + c));
            top = hmax(most);
            for (int64_t c = 0; c < CHUNK; c += VL) {
                const vf e = exp2v(loadv(s + c) - top);
                storev(s + c, e);
                total += e;
            }
            sum = hsum(total);
        } else { /* the sequence's last chunk */
            for (int64_t j = 0; j < count; j++) top = s[j] > top ? s[j] : top;
#pragma omp simd reduction(+ : sum)
            for (int64_t j = 0; j < count; j++) {
                s[j] = exp2f(s[j] - top);
                sum += s[j];
            }
        }
        const float alpha = exp2f(m[i] - top); /* 0 on the first chunk */
        l[i] = l[i] * alpha + sum;
        m[i] = top;
        for (int64_t c = 0; c < nv; c++) { /* rescale what the earlier chunks gave */
            a[c] = loadv(acc + i * D + VL * c) * alpha;
        }
        for (int64_t j = 0; j < count; j++) /* acc += p V */
            for (int64_t c = 0; c < nv; c++) a[c] += s[j] * load_kv(v_rows[j], VL * c, kind);
        for (int64_t c = 0; c < nv; c++) storev(acc + i * D + VL * c, a[c]);
    }
}

/* update_rows for a chunk of keys (k_sc / v_sc: the int8 rows' scale addresses, and next_ks /
   next_vs the next chunk's; NULL for float rows). bfloat16 K/V are widened once for all nb rows
   first (not once per row: row by row, the widening cost more than the dot products); int8
   rows are dequantized so, whatever nb (exactly: code * scale fits float32). */
ALWAYS_INLINE void update_block(const char *const *k_rows, const char *const *v_rows,
                                const char *const *k_sc, const char *const *v_sc,
                                int64_t count, const float *q, int64_t nb, float *acc, float *m,
                                float *l, const int64_t D, const int kind,
                                const char *const *next_k, const char *const *next_v,
                                const char *const *next_ks, const char *const *next_vs,
                                int64_t next_count)
{
    const int64_t next_bytes = D * kv_elem(kind);
    if (kind == KV_F32 || (kind == KV_BF16 && nb == 1)) {
        update_rows(k_rows, v_rows, count, q, nb, acc, m, l, D, kind, next_k, next_v, next_ks,
                    next_vs, next_count, next_bytes);
        return;
    }
    float wide[2][CHUNK * 256]; /* K, V rows as float32 */
    const char *kw[CHUNK], *vw[CHUNK];
    for (int64_t j = 0; j < count; j++) {
        const float sk = kind == KV_I8 ? scale_at(k_sc[j], 0) : 1.0f;
        const float sv = kind == KV_I8 ? scale_at(v_sc[j], 0) : 1.0f;
        for (int64_t c = 0; c < D / VL; c++) {
            storev(wide[0] + j * D + VL * c, load_kv(k_rows[j], VL * c, kind) * sk);
            storev(wide[1] + j * D + VL * c, load_kv(v_rows[j], VL * c, kind) * sv);
        }
        kw[j] = (const char *)(wide[0] + j * D);
        vw[j] = (const char *)(wide[1] + j * D);
    }
    update_rows(kw, vw, count, q, nb, acc, m, l, D, KV_F32, next_k, next_v, next_ks, next_vs,
                next_count, next_bytes);
}

/* n query rows (contiguous, pre-scaled) attend to the keys slots[0 .. len): each K/V row is
   loaded once per chunk and used by all n rows while it sits in L1.

   Slots lie anywhere in the pool, so each row is a likely cache miss. The first chunk's rows are
   requested up front, and every next chunk's rows one key at a time while the current chunk's
   scores are computed: the misses overlap the arithmetic instead of stalling it one by one
   (a burst of prefetches for a whole chunk is slower: it overflows the miss buffers). */
ALWAYS_INLINE void attend_keys(const KeySource *src, const float *q, int64_t n,
                               const int64_t *slots, int64_t len, float *acc, float *m, float *l,
                               const int64_t D, const int kind)
{
    const char *k_rows[2][CHUNK], *v_rows[2][CHUNK]; /* this chunk's and the next one's */
    const char *k_sc[2][CHUNK], *v_sc[2][CHUNK];     /* int8: their scales */
    const int i8 = kind == KV_I8;
    int64_t cur = 0, count = len < CHUNK ? len : CHUNK;
    row_addresses(src, slots, 0, count, k_rows[0], v_rows[0], k_sc[0], v_sc[0]);
    for (int64_t j = 0; j < count; j++)
        prefetch_row(k_rows[0][j], v_rows[0][j], D * kv_elem(kind), i8 ? k_sc[0][j] : NULL,
                     i8 ? v_sc[0][j] : NULL);
    for (int64_t start = 0; start < len; start += CHUNK, cur ^= 1) {
        const int64_t next = start + CHUNK;
        const int64_t next_count = next >= len ? 0 : (len - next < CHUNK ? len - next : CHUNK);
        const int nx = cur ^ 1;
        row_addresses(src, slots, next, next_count, k_rows[nx], v_rows[nx], k_sc[nx], v_sc[nx]);
        update_block(k_rows[cur], v_rows[cur], k_sc[cur], v_sc[cur], count, q, n, acc, m, l, D,
                     kind, k_rows[nx], v_rows[nx], i8 ? k_sc[nx] : NULL, i8 ? v_sc[nx] : NULL,
                     next_count);
        count = next_count;
    }
}

#if defined(__AVX512F__)
/* The row path on AVX-512 (AVX2 builds keep update_block): 16 keys at a time, per query row
     S (16 keys)   each key's dot product as a vector of 16 partial sums (bfloat16 pairs with
                   vdpbf16ps for a bfloat16 model, else float32 FMAs), the 16 vectors summed
                   lane-wise into one vector of 16 scores: 15 shuffle-and-adds in a tree,
                   instead of a horizontal sum per key
     softmax       online, on that one vector
     acc += P V    each V row widened once for all the rows of the group; acc in registers
   Rows go in groups of up to ROWS, a literal count each, so accumulators stay in registers (a
   kv head's query heads: 3 for the default model; a shared run of 2 requests: 6). Faster than
   update_block on K/V in cache, where one shuffle tree per 16 keys replaces a horizontal sum
   per key; from memory the memory is the limit either way.
   int8 rows: a chunk's K codes are converted once for all the rows, exactly (a code has 8
   bits): to bfloat16 for a bfloat16 model's dot products (kv_mode 4), else to float32; V codes
   as they are read; each key's K scale multiplies its score and its V scale its probability
   (once per key, not per element). */
#define ROWS 8

/* The tree's lane order: lane 4q + r holds key q + 4r, so key j lands in lane LANE_KEYS[j] and
   lane L holds key LANE_KEYS[L] (the permutation is its own inverse). */
static const int32_t LANE_KEYS[16] __attribute__((aligned(64))) = {0, 4, 8,  12, 1, 5, 9,  13,
                                                                    2, 6, 10, 14, 3, 7, 11, 15};

ALWAYS_INLINE vf widen16(const char *row, int64_t d, const int kind)
{
    if (kind == KV_F32) return loadv((const float *)row + d);
    if (kind == KV_I8)
        return (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(row + d))));
    const __m512i x = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(row + 2 * d)));
    return (vf)_mm512_slli_epi32(x, 16);
}

/* K or V rows (and scales) for the keys past the end of a short chunk: zeros (their scores are
   masked) */
static const float ZERO_ROW[256] __attribute__((aligned(64)));

/* One key's dot product with a query row as 16 partial sums. */
ALWAYS_INLINE vf key_dot(const char *k_row, const float *q, const void *qp, const int64_t D,
                          const int kind, const int dots)
{
    vf dot = (vf){0};
#if HAS_BF16_DOTS
    if (dots) {
        const pair_t *k2 = (const pair_t *)k_row, *q2 = (const pair_t *)qp;
        int64_t c = 0; /* in pairs */
        for (; c + 16 <= D / 2; c += 16)
            dot = (vf)_mm512_dpbf16_ps((__m512)dot, (__m512bh)_mm512_loadu_si512(k2 + c),
                                        (__m512bh)_mm512_loadu_si512(q2 + c));
        if (c < D / 2) { /* D = 16 (mod 32): the last 8 pairs, zero-extended */
            const __m512i kh = _mm512_zextsi256_si512(_mm256_loadu_si256((const __m256i *)(k2 + c)));
            const __m512i qh = _mm512_zextsi256_si512(_mm256_loadu_si256((const __m256i *)(q2 + c)));
            dot = (vf)_mm512_dpbf16_ps((__m512)dot, (__m512bh)kh, (__m512bh)qh);
        }
        return dot;
    }
#endif
    for (int64_t c = 0; c < D / 16; c++) dot += loadv(q + 16 * c) * widen16(k_row, 16 * c, kind);
    return dot;
}

/* nr (a literal, <= ROWS) query rows (qs pre-scaled float32; qp their bfloat16 pairs, unscaled,
   for dots) attend to one chunk of 16 keys, k_rows / v_rows (the first `count` real, the rest
   ZERO_ROW): V rows stored as `kind`, K rows as `k_kind` (kind, or an int8 chunk's staged
   codes: stage_codes); for int8 rows, ks / vs hold the keys' K and V scales in the tree's lane
   order. */
ALWAYS_INLINE void rows_chunk(const char *const *k_rows, const char *const *v_rows, int64_t count,
                              const float *qs, const void *qp, float scale, const int nr,
                              float *acc, float *m, float *l, const int64_t D, const int kind,
                              const int k_kind, const int dots, vf ks, vf vs)
{
    const int64_t nv = D / 16;
    vi key_of_lane;
    memcpy(&key_of_lane, LANE_KEYS, sizeof key_of_lane);
    float p[ROWS][16];
    float alpha[ROWS];
    vf s[ROWS];
    for (int i = 0; i < nr; i++) { /* the scores of every row first: their chains overlap */
        const float *q = qs + i * D;
        const void *q2 = dots ? (const char *)qp + i * D * 2 : NULL;
        __m512 y[8];
        for (int j = 0; j < 8; j++) { /* the tree's first level as the dots come: 256-bit halves */
            const __m512 a = (__m512)key_dot(k_rows[2 * j], q, q2, D, k_kind, dots);
            const __m512 b = (__m512)key_dot(k_rows[2 * j + 1], q, q2, D, k_kind, dots);
            y[j] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
        }
        __m512 z[4], w[2];
        for (int j = 0; j < 4; j++) /* 128-bit quarters, one key each */
            z[j] = _mm512_add_ps(_mm512_shuffle_f32x4(y[2 * j], y[2 * j + 1], 0x88),
                                 _mm512_shuffle_f32x4(y[2 * j], y[2 * j + 1], 0xDD));
        for (int j = 0; j < 2; j++) /* 64-bit pairs, two keys per quarter */
            w[j] = _mm512_add_ps(
                (__m512)_mm512_unpacklo_pd((__m512d)z[2 * j], (__m512d)z[2 * j + 1]),
                (__m512)_mm512_unpackhi_pd((__m512d)z[2 * j], (__m512d)z[2 * j + 1]));
        s[i] = (vf)_mm512_add_ps(_mm512_shuffle_ps(w[0], w[1], 0x88),
                                  _mm512_shuffle_ps(w[0], w[1], 0xDD));
        if (dots) s[i] *= scale;
        if (kind == KV_I8) s[i] *= ks; /* each key's score times its row's scale */
        if (count < 16) s[i] = where_below(key_of_lane, (int32_t)count, s[i], splat(NO_SCORE));
    }
    int moved[ROWS]; /* per row: a row's arithmetic never depends on the others in the chunk */
    for (int i = 0; i < nr; i++) { /* lazy rescaling, as in flash_tile.h's softmax_rows */
        alpha[i] = 1.0f;
        moved[i] = any_above(s[i], m[i] + RESCALE_AT);
        if (!moved[i]) continue;
        const float top = hmax(s[i]); /* > m[i] + RESCALE_AT */
        alpha[i] = exp2_1(m[i] - top);
        l[i] *= alpha[i];
        m[i] = top;
    }
    for (int i = 0; i < nr; i++) {
        vf e = exp2v(s[i] - m[i]);
        if (count < 16) e = where_below(key_of_lane, (int32_t)count, e, (vf){0});
        l[i] += hsum(e);
        storev(p[i], kind == KV_I8 ? e * vs : e); /* int8: V's scale folded into P */
    }
    vf a[ROWS][MAX_VECTORS];
    for (int i = 0; i < nr; i++)
        for (int64_t c = 0; c < nv; c++)
            a[i][c] = moved[i] ? loadv(acc + i * D + 16 * c) * alpha[i] : loadv(acc + i * D + 16 * c);
    for (int j = 0; j < 16; j++) {
        const int lane = LANE_KEYS[j];
        for (int64_t c = 0; c < nv; c++) {
            const vf vv = widen16(v_rows[j], 16 * c, kind);
            for (int i = 0; i < nr; i++) a[i][c] += p[i][lane] * vv;
        }
    }
    for (int i = 0; i < nr; i++)
        for (int64_t c = 0; c < nv; c++) storev(acc + i * D + 16 * c, a[i][c]);
}

/* A chunk's 16 int8 K rows as float32 rows, or as bfloat16 rows for dots, in `wide` (16 rows of
   D floats); `staged` their addresses. Exact: a code is an integer of at most 7 bits. */
ALWAYS_INLINE void stage_codes(const char *const *rows, float *wide, const char **staged,
                               const int64_t D, const int dots)
{
    for (int j = 0; j < 16; j++) {
        float *dst = wide + j * D;
        staged[j] = (const char *)dst;
#if HAS_BF16_DOTS
        if (dots) { /* bfloat16 in memory order: the pairs key_dot reads */
            uint16_t *out = (uint16_t *)dst;
            int64_t c = 0;
            for (; c + 32 <= D; c += 32) {
                const __m512bh both = _mm512_cvtne2ps_pbh((__m512)widen16(rows[j], c + 16, KV_I8),
                                                          (__m512)widen16(rows[j], c, KV_I8));
                memcpy(out + c, &both, sizeof both);
            }
            if (c < D) { /* D = 16 (mod 32) */
                const __m256bh half = _mm512_cvtneps_pbh((__m512)widen16(rows[j], c, KV_I8));
                memcpy(out + c, &half, sizeof half);
            }
            continue;
        }
#endif
        for (int64_t c = 0; c < D; c += 16) storev(dst + c, widen16(rows[j], c, KV_I8));
    }
}

/* n query rows (members of `group` rows each) attend to keys slots[0 .. len), 16 keys per
   chunk; the next chunk's rows are prefetched while this one is computed. Each member's rows go
   in calls of up to ROWS, as they would for that member alone: a literal row count is its own
   instantiation, whose arithmetic the compiler may order differently (-ffast-math), so this
   keeps a row's bits the same in a unit and alone (a verify chain's rows rely on it:
   model/verify_rows.py). */
ALWAYS_INLINE void attend_rows(const KeySource *src, const float *qs, const void *qp, float scale,
                               int64_t n, int64_t group, const int64_t *slots, int64_t len,
                               float *acc, float *m, float *l, const int64_t D, const int kind,
                               const int dots)
{
    const int64_t row_bytes = D * kv_elem(kind);
    const char *k_rows[16], *v_rows[16], *k_sc[16], *v_sc[16], *k_staged[16];
    /* int8: K codes staged once per chunk for all the rows (stage_codes) */
    float k_wide[kind == KV_I8 ? 16 * D : 1] __attribute__((aligned(64)));
    const int k_kind = kind != KV_I8 ? kind : dots ? KV_BF16 : KV_F32;
    const char *const *k_read = kind == KV_I8 ? k_staged : k_rows;
    vf ks = (vf){0}, vs = (vf){0};
    for (int64_t key0 = 0; key0 < len; key0 += 16) {
        const int64_t count = len - key0 < 16 ? len - key0 : 16;
        row_addresses(src, slots, key0, count, k_rows, v_rows, k_sc, v_sc);
        for (int64_t j = count; j < 16; j++) {
            k_rows[j] = v_rows[j] = (const char *)ZERO_ROW;
            k_sc[j] = v_sc[j] = (const char *)ZERO_ROW;
        }
        if (kind == KV_I8) {
            for (int lane = 0; lane < 16; lane++) { /* lane L holds key LANE_KEYS[L] */
                ks[lane] = scale_at(k_sc[LANE_KEYS[lane]], 0);
                vs[lane] = scale_at(v_sc[LANE_KEYS[lane]], 0);
            }
            stage_codes(k_rows, k_wide, k_staged, D, dots);
        }
        const int64_t next = key0 + 16, next_count = len - next < 16 ? len - next : 16;
        for (int64_t j = 0; j < next_count; j++) {
            const int64_t at = slots[next + j] * src->row_bytes + src->head_offset;
            const int64_t prev = slots[next + j - 1] * src->row_bytes + src->head_offset;
            if (follows(src->k + at, src->k + prev, row_bytes)) continue; /* in a run */
            const int64_t sat = kind == KV_I8 ? scale_offset(src, slots[next + j]) : 0;
            prefetch_row(src->k + at, src->v + at, row_bytes, kind == KV_I8 ? src->ks + sat : NULL,
                         kind == KV_I8 ? src->vs + sat : NULL);
        }
        for (int64_t r = 0, nr; r < n; r += nr) {
            const int64_t end = (r / group + 1) * group; /* the end of this row's member */
            nr = end - r < ROWS ? end - r : ROWS;
            const float *q = qs + r * D;
            const void *q2 = dots ? (const char *)qp + r * D * 2 : NULL;
            float *a = acc + r * D, *mr = m + r, *lr = l + r;
            switch (nr) { /* literal row counts: registers, unrolled */
            case 1: rows_chunk(k_read, v_rows, count, q, q2, scale, 1, a, mr, lr, D, kind, k_kind, dots, ks, vs); break;
            case 2: rows_chunk(k_read, v_rows, count, q, q2, scale, 2, a, mr, lr, D, kind, k_kind, dots, ks, vs); break;
            case 3: rows_chunk(k_read, v_rows, count, q, q2, scale, 3, a, mr, lr, D, kind, k_kind, dots, ks, vs); break;
            case 4: rows_chunk(k_read, v_rows, count, q, q2, scale, 4, a, mr, lr, D, kind, k_kind, dots, ks, vs); break;
            case 5: rows_chunk(k_read, v_rows, count, q, q2, scale, 5, a, mr, lr, D, kind, k_kind, dots, ks, vs); break;
            case 6: rows_chunk(k_read, v_rows, count, q, q2, scale, 6, a, mr, lr, D, kind, k_kind, dots, ks, vs); break;
            case 7: rows_chunk(k_read, v_rows, count, q, q2, scale, 7, a, mr, lr, D, kind, k_kind, dots, ks, vs); break;
            default: rows_chunk(k_read, v_rows, count, q, q2, scale, 8, a, mr, lr, D, kind, k_kind, dots, ks, vs); break;
            }
        }
    }
}
#endif

/* The row path: AVX-512's attend_rows where the head size is a literal (the common ones; the
   other sizes take update_block: a dozen more copies of attend_rows doubled the build time),
   update_block elsewhere. */
#if defined(__AVX512F__)
#define ATTEND_ROWS(src, qs, qp, scale, n, group, slots, len, acc, m, l, D, kind, dots, wide)    \
    do {                                                                                         \
        if (wide)                                                                                \
            attend_rows(src, qs, qp, scale, n, group, slots, len, acc, m, l, D, kind, dots);     \
        else attend_keys(src, qs, n, slots, len, acc, m, l, D, kind);                            \
    } while (0)
#else
#define ATTEND_ROWS(src, qs, qp, scale, n, group, slots, len, acc, m, l, D, kind, dots, wide)    \
    attend_keys(src, qs, n, slots, len, acc, m, l, D, kind)
#endif

typedef struct {
    const float *q;
    float *out;
    int64_t num_heads, group; /* group: query heads per kv head */
    float scale;
    const int64_t *units, *shared, *own, *member_row, *slots;
    /* A member's keys are attended in segments of SEGMENT keys by their position in its
       sequence, each a task of its own (decode_attention.c); where a member has more than one,
       each task leaves its (m, l, acc) per query head here, [out row][segment], for
       merge_segments: part_ml 2 floats, part_acc D floats per entry. */
    int64_t max_segments;
    float *part_ml, *part_acc;
} Batch;

#define SEGMENT 256 /* keys per segment: a multiple of CHUNK, so segments never split a chunk */

/* The segments of a sequence of len keys (at least one). */
ALWAYS_INLINE int64_t segments_of(int64_t len)
{
    return len > SEGMENT ? (len + SEGMENT - 1) / SEGMENT : 1;
}

/* Keys of member r (of unit u) in all: its shared run and its own slots. */
ALWAYS_INLINE int64_t member_len(const Batch *b, int64_t u, int64_t r)
{
    return b->shared[2 * u + 1] + b->own[2 * r + 1];
}

/* One task: kv head `head` of unit u, keys [seg * SEGMENT, (seg + 1) * SEGMENT) of each
   member's sequence (shared run, then its own slots), all the group's query heads of every
   member (each K/V row read once for all of them: a lone request's query heads as tasks of
   their own read its K/V group-times over, 1.4x slower on 2 threads than 3 tasks for 2
   threads), K/V stored as `kind`; dots: bfloat16 dot products on the shared run (and on the row
   path where `wide`: D is a literal).

   Segments are cut by a key's position in its member's sequence, never by the batch, so a row
   walks the same chunks and merges the same segments alone or beside others (the bits a
   verify chain relies on: model/verify_rows.py); they let the threads share a long sequence's
   keys, where tasks per (unit, kv head) left one thread two heads' work and the other one. */
ALWAYS_INLINE void run_task(const Batch *b, const KeySource *src, int64_t u, int64_t seg,
                            int64_t head, const int64_t D, const int kind, const int dots,
                            const int wide)
{
    const int64_t first = b->units[u], num_members = b->units[u + 1] - first;
    const int64_t *run = b->shared + 2 * u;
    const int64_t lo = seg * SEGMENT, hi = lo + SEGMENT;
    /* the shared run's keys in this segment: [run_lo, run_lo + run_len) */
    const int64_t run_lo = lo < run[1] ? lo : run[1];
    const int64_t run_len = (hi < run[1] ? hi : run[1]) - run_lo;
    /* each member's query rows: heads head * group .. + group */
    const int64_t group = b->group, n = num_members * group;
    const int64_t rows = run_len > 0 ? (n + R - 1) / R * R : n; /* the tile's rows: whole groups */
    const int64_t tile_words = run_len > 0 ? rows * D / 2 + 2 * KB * D : (dots ? rows * D / 2 : 0);
    /* Scratch (4-byte words): qs (rows, D) pre-scaled, acc (rows, D), m, l (rows); for the
       shared run's tile: qp (rows, D/2) bfloat16 pairs, kt, vb (KB, D); limit (rows) int64. */
    float *qs = calloc((size_t)(rows * (2 * D + 2) + tile_words), sizeof(float));
    int64_t *limit = malloc((size_t)rows * sizeof(int64_t));
    if (qs == NULL || limit == NULL) abort(); /* a few KB; nothing sensible to do without it */
    float *acc = qs + rows * D, *m = acc + rows * D, *l = m + rows;
    /* the tile's scratch exists only for a unit with a shared run in this segment */
    float *qp = tile_words ? l + rows : NULL, *kt = run_len > 0 ? qp + rows * D / 2 : NULL;
    float *vb = run_len > 0 ? kt + KB * D : NULL;
    for (int64_t i = 0; i < rows; i++) {
        m[i] = NO_SCORE;
        limit[i] = i < n ? run_len - 1 : -1; /* the whole run; padding rows see nothing */
        if (i >= n) continue;
        const int64_t row = b->member_row[first + i / group];
        const float *qi = b->q + (row * b->num_heads + head * b->group + i % group) * D;
        for (int64_t d = 0; d < D; d++) qs[i * D + d] = qi[d] * b->scale;
#if HAS_BF16_DOTS
        if (dots) /* bfloat16 pairs: the tile's and the row path's queries */
            for (int64_t d = 0; d < D / 2; d++)
                ((pair_t *)qp)[i * (D / 2) + d] = bf16_bits(qi[2 * d]) | bf16_bits(qi[2 * d + 1])
                                                                              << 16;
#endif
    }
    if (run_len > 0) {
        const Tile tile = {rows, limit, acc, m, l};
        const int64_t *slots = b->slots + run[0] + run_lo;
        if (n >= TILE_MIN_ROWS) {
#if HAS_BF16_DOTS
            if (dots && kind == KV_BF16) /* int8 runs take the float32 tiles */
                tile_attend_bf16(&tile, (const pair_t *)qp, b->scale, src, slots, run_len,
                                 (pair_t *)kt, (pair_t *)vb, D);
            else
#endif
                tile_attend(&tile, qs, src, slots, run_len, kt, vb, D, kind);
        } else { /* few rows: row by row, each K/V row still loaded once for all */
            ATTEND_ROWS(src, qs, qp, b->scale, n, group, slots, run_len, acc, m, l, D, kind, dots,
                        wide);
        }
    }
    for (int64_t r = 0; r < num_members; r++) { /* own slots at positions run[1] .. */
        const int64_t *mine = b->own + 2 * (first + r), at = r * group;
        const int64_t from = (lo > run[1] ? lo : run[1]) - run[1];
        const int64_t to = (hi < run[1] + mine[1] ? hi : run[1] + mine[1]) - run[1];
        if (to <= from) continue;
        ATTEND_ROWS(src, qs + at * D, dots ? (const char *)qp + at * D * 2 : NULL, b->scale, group,
                    group, b->slots + mine[0] + from, to - from, acc + at * D, m + at, l + at, D,
                    kind, dots, wide);
    }
    for (int64_t i = 0; i < n; i++) {
        const int64_t len = member_len(b, u, first + i / group);
        if (len <= lo) continue; /* no keys of this member in the segment */
        const int64_t row = b->member_row[first + i / group];
        const int64_t at = row * b->num_heads + head * b->group + i % group;
        if (segments_of(len) == 1) { /* one segment: the output itself */
            float *o = b->out + at * D;
            const float inv = 1.0f / l[i];
            for (int64_t d = 0; d < D; d++) o[d] = acc[i * D + d] * inv;
            continue;
        }
        const int64_t part = at * b->max_segments + seg;
        b->part_ml[2 * part] = m[i];
        b->part_ml[2 * part + 1] = l[i];
        memcpy(b->part_acc + part * D, acc + i * D, (size_t)D * sizeof(float));
    }
    free(limit);
    free(qs);
}

/* The output of query head qh of out row `row` whose member has num_segments > 1 segments:
   their (m, l, acc) rescaled to the largest m and summed in segment order (a fixed order: the
   same bits however the tasks ran). */
static inline void merge_segments(const Batch *b, int64_t row, int64_t qh, int64_t num_segments,
                                  int64_t D)
{
    const int64_t at = row * b->num_heads + qh, base = at * b->max_segments;
    float top = NO_SCORE;
    for (int64_t s = 0; s < num_segments; s++)
        top = b->part_ml[2 * (base + s)] > top ? b->part_ml[2 * (base + s)] : top;
    float *o = b->out + at * D, sum = 0.0f;
    for (int64_t d = 0; d < D; d++) o[d] = 0.0f;
    for (int64_t s = 0; s < num_segments; s++) {
        const float w = exp2f(b->part_ml[2 * (base + s)] - top);
        sum += b->part_ml[2 * (base + s) + 1] * w;
        const float *a = b->part_acc + (base + s) * D;
        for (int64_t d = 0; d < D; d++) o[d] += a[d] * w;
    }
    const float inv = 1.0f / sum;
    for (int64_t d = 0; d < D; d++) o[d] *= inv;
}

/* One task of a bfloat16 pool (kv_mode 1 or 2): decode_attention_bf16.c; of a bfloat16 model
   with bfloat16 dot products (kv_mode 2 where HAS_BF16_DOTS): decode_attention_dots.c; of an
   int8 pool (kv_mode 3): decode_attention_i8.c. */
void decode_task_bf16(const Batch *b, const KeySource *src, int64_t u, int64_t seg,
                      int64_t head, int64_t D, int kv_mode);
void decode_task_i8(const Batch *b, const KeySource *src, int64_t u, int64_t seg, int64_t head,
                    int64_t D, int kv_mode);
void decode_task_dots(const Batch *b, const KeySource *src, int64_t u, int64_t seg,
                      int64_t head, int64_t D);

#endif /* RADIXLM_DECODE_TASK_H */
