/* Prefill (extend) attention over K/V in the pool: e new tokens of a request attend causally to
   its prefix_len cached tokens and to themselves.

   Why not PyTorch's SDPA: its CPU flash kernel does its block products through MKL, which on
   AMD EPYC runs well below the machine's FMA rate, and with a mask (a cached prefix needs one)
   it reaches about 40 GFLOP/s on 2 cores here; a 64-token question over a 1K-token prompt spends
   half of its step in it. This is flash attention written for the CPU's vector registers:

     for each task = (request, kv head, tile of up to TILE new tokens):
       rows = the tile's tokens x the G query heads on this kv head     (token-major, pre-scaled)
       for each block of KB keys the tile can see:
         K block -> kt (D, KB) transposed, V block -> vb (KB, D): widened, contiguous, in L1
         for each group of R rows:
           S (R, KB) = Q K^T        R x KB/16 accumulators, one broadcast-FMA per (row, d, 16 keys)
           mask keys past each row's position; online softmax (running max m, sum l)
           acc (R, D) = acc * alpha + P V       R x D/16 accumulators
       out = acc / l

   Vectors are GCC vector extensions of 16 floats: AVX-512 registers where the CPU has them,
   pairs of AVX2 registers where not (compiled with -march=native on the machine that runs it).
   Tasks write disjoint output rows and run in parallel on PyTorch's OpenMP pool.

   bfloat16 dot products (kv_mode 2: a bfloat16 model over a bfloat16 pool, on a CPU with
   AVX512-BF16): the same loops on pairs of bfloat16 (one 32-bit lane holds elements 2i, 2i+1),
   each vdpbf16ps doing two multiply-adds per lane into float32 accumulators, so half the
   instructions. Q K^T pairs run along D (kt holds K transposed pair-wise, (D/2, KB)); P V pairs
   run along the keys (vb holds rows 2i and 2i+1 interleaved, (KB/2, D)). The queries are
   bfloat16 already; the probabilities P are rounded to bfloat16 after the float32 softmax, as
   GPU flash attention does; m, l and the accumulators stay float32.

   Layouts: q, out (T, H, D) float32; k, v (num_slots, KV, D) float32 (kv_mode 0) or bfloat16
   (kv_mode 1: float32 arithmetic; 2: bfloat16 dot products where the CPU has them, else 1);
   spans (num_spans, 4): first row in q/out, extend_len, prefix_len, offset of the request's
   prefix_len + extend_len slots in `slots`.
*/
#include <math.h>
#include <stdint.h>
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif
#include <stdlib.h>
#include <string.h>

#define TILE 64         /* new tokens per task */
#define KB 32           /* keys per block */
#define R 8             /* query rows per register group */
#define NO_SCORE -1e30f /* "minus infinity" that -ffast-math may not assume away */
#define ALWAYS_INLINE static inline __attribute__((always_inline))

typedef float v16 __attribute__((vector_size(64)));

ALWAYS_INLINE v16 load16(const float *p)
{
    v16 x;
    memcpy(&x, p, sizeof x);
    return x;
}

ALWAYS_INLINE void store16(float *p, v16 x) { memcpy(p, &x, sizeof x); }

ALWAYS_INLINE float kv_at(const char *row, int64_t d, const int bf16)
{
    if (!bf16) return ((const float *)row)[d];
    const uint32_t bits = (uint32_t)((const uint16_t *)row)[d] << 16;
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

typedef struct {
    const float *q;
    float *out;
    const char *k, *v;
    int64_t num_heads, group, row_bytes, head_bytes;
    float scale;
    const int64_t *spans, *slots;
} Batch;

/* acc[:, c0 .. c0 + 16 * nc) += P V for R rows; the slab's accumulators stay in registers. */
ALWAYS_INLINE void pv_slab(float *acc, const float *vb, float p[R][KB], int64_t count,
                           int64_t c0, const int64_t D, const int nc)
{
    v16 a[R][4];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < nc; c++) a[r][c] = load16(acc + r * D + c0 + c * 16);
    for (int64_t j = 0; j < count; j++) {
        v16 vj[4];
        for (int c = 0; c < nc; c++) vj[c] = load16(vb + j * D + c0 + c * 16);
        for (int r = 0; r < R; r++) {
            const float pj = p[r][j];
            for (int c = 0; c < nc; c++) a[r][c] += pj * vj[c];
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < nc; c++) store16(acc + r * D + c0 + c * 16, a[r][c]);
}

/* Rows [r0, r0 + R) against one key block: S = Q K^T, mask, online softmax, acc += P V.
   limit[r]: the last key index row r may see. */
ALWAYS_INLINE void block_rows(const float *qs, const float *kt, const float *vb, int64_t count,
                              int64_t key0, const int64_t *limit, float *acc, float *m, float *l,
                              const int64_t D)
{
    enum { NV = KB / 16 };
    v16 s[R][NV];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < NV; c++) s[r][c] = (v16){0};
    for (int64_t d = 0; d < D; d++) {
        v16 kd[NV];
        for (int c = 0; c < NV; c++) kd[c] = load16(kt + d * KB + c * 16);
        for (int r = 0; r < R; r++) {
            const float qv = qs[r * D + d];
            for (int c = 0; c < NV; c++) s[r][c] += qv * kd[c];
        }
    }
    float p[R][KB];
    for (int r = 0; r < R; r++) {
        for (int c = 0; c < NV; c++) store16(p[r] + c * 16, s[r][c]);
        const int64_t last = limit[r] - key0; /* keys j > last are masked for this row */
        for (int64_t j = 0; j < KB; j++)
            if (j >= count || j > last) p[r][j] = NO_SCORE;
        float top = m[r];
        for (int64_t j = 0; j < KB; j++) top = p[r][j] > top ? p[r][j] : top;
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t j = 0; j < KB; j++) {
            p[r][j] = expf(p[r][j] - top);
            sum += p[r][j];
        }
        const float alpha = expf(m[r] - top);
        l[r] = l[r] * alpha + sum;
        m[r] = top;
        float *a = acc + r * D;
#pragma omp simd
        for (int64_t d = 0; d < D; d++) a[d] *= alpha;
    }
    int64_t c0 = 0; /* acc (R, D) += P V, in column slabs of 64, then 16 */
    for (; c0 + 64 <= D; c0 += 64) pv_slab(acc, vb, p, count, c0, D, 4);
    for (; c0 < D; c0 += 16) pv_slab(acc, vb, p, count, c0, D, 1);
}

/* One task: new tokens [tok0, tok1) of span `span`, kv head `head`. */
ALWAYS_INLINE void run_task(const Batch *b, int64_t span, int64_t head, int64_t tok0,
                            int64_t tok1, const int64_t D, const int bf16)
{
    const int64_t *sp = b->spans + 4 * span;
    const int64_t row0 = sp[0], prefix = sp[2];
    const int64_t *slots = b->slots + sp[3];
    const int64_t group = b->group, tokens = tok1 - tok0;
    const int64_t n = tokens * group, padded = (n + R - 1) / R * R;
    /* Scratch (floats): qs, acc (padded, D); m, l, limit-as-int64 (padded); kt, vb (KB, D). */
    float *qs = calloc((size_t)(padded * (2 * D + 2) + 2 * KB * D), sizeof(float));
    int64_t *limit = malloc((size_t)padded * sizeof(int64_t));
    if (qs == NULL || limit == NULL) abort();
    float *acc = qs + padded * D, *m = acc + padded * D, *l = m + padded;
    float *kt = l + padded, *vb = kt + KB * D;
    for (int64_t r = 0; r < padded; r++) {
        m[r] = NO_SCORE;
        limit[r] = -1; /* padding rows see nothing (their output is never written) */
        if (r >= n) continue;
        const int64_t tok = tok0 + r / group, g = r % group;
        const float *qr = b->q + ((row0 + tok) * b->num_heads + head * group + g) * D;
        for (int64_t d = 0; d < D; d++) qs[r * D + d] = qr[d] * b->scale;
        limit[r] = prefix + tok;
    }
    const int64_t visible = prefix + tok1;
    for (int64_t key0 = 0; key0 < visible; key0 += KB) {
        const int64_t count = visible - key0 < KB ? visible - key0 : KB;
        for (int64_t j = 0; j < KB; j++) {
            if (j < count) {
                const int64_t at = slots[key0 + j] * b->row_bytes + head * b->head_bytes;
                const char *kr = b->k + at, *vr = b->v + at;
                for (int64_t d = 0; d < D; d++) {
                    kt[d * KB + j] = kv_at(kr, d, bf16);
                    vb[j * D + d] = kv_at(vr, d, bf16);
                }
            } else {
                for (int64_t d = 0; d < D; d++) kt[d * KB + j] = 0.0f;
            }
        }
        for (int64_t r = 0; r < padded; r += R) {
            int64_t seen = -1; /* the furthest key any row of the group may see */
            for (int64_t i = r; i < r + R; i++) seen = limit[i] > seen ? limit[i] : seen;
            if (seen < key0) continue; /* the whole block is in the group's future */
            block_rows(qs + r * D, kt, vb, count, key0, limit + r, acc + r * D, m + r, l + r, D);
        }
    }
    for (int64_t r = 0; r < n; r++) {
        const int64_t tok = tok0 + r / group, g = r % group;
        float *o = b->out + ((row0 + tok) * b->num_heads + head * group + g) * D;
        const float inv = 1.0f / l[r];
        for (int64_t d = 0; d < D; d++) o[d] = acc[r * D + d] * inv;
    }
    free(limit);
    free(qs);
}

#if defined(__AVX512BF16__)
#define HAS_BF16_DOTS 1

typedef uint32_t pair_t; /* two bfloat16: element 2i in the low half, 2i + 1 in the high half */

/* acc += a * b pair-wise: lane i gets a.lo * b.lo + a.hi * b.hi; b is one pair for all lanes. */
ALWAYS_INLINE v16 dot_pairs(v16 acc, __m512i a, pair_t b)
{
    return (v16)_mm512_dpbf16_ps((__m512)acc, (__m512bh)a, (__m512bh)_mm512_set1_epi32((int)b));
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
    v16 a[R][4];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < nc; c++) a[r][c] = load16(acc + r * D + c0 + c * 16);
    for (int64_t j = 0; j < pairs; j++) {
        __m512i vj[4];
        for (int c = 0; c < nc; c++) vj[c] = load_pairs(vb + j * D + c0 + c * 16);
        for (int r = 0; r < R; r++)
            for (int c = 0; c < nc; c++) a[r][c] = dot_pairs(a[r][c], vj[c], p[r][j]);
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < nc; c++) store16(acc + r * D + c0 + c * 16, a[r][c]);
}

/* block_rows with bfloat16 pairs: qs (R, D/2), kt (D/2, KB), vb (KB/2, D) pairs. */
ALWAYS_INLINE void block_rows_bf16(const pair_t *qs, const pair_t *kt, const pair_t *vb,
                                   int64_t count, int64_t key0, const int64_t *limit, float *acc,
                                   float *m, float *l, const int64_t D, const float scale)
{
    enum { NV = KB / 16 };
    const int64_t half = D / 2;
    v16 s[R][NV];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < NV; c++) s[r][c] = (v16){0};
    for (int64_t d = 0; d < half; d++) {
        __m512i kd[NV];
        for (int c = 0; c < NV; c++) kd[c] = load_pairs(kt + d * KB + c * 16);
        for (int r = 0; r < R; r++) {
            const pair_t qv = qs[r * half + d];
            for (int c = 0; c < NV; c++) s[r][c] = dot_pairs(s[r][c], kd[c], qv);
        }
    }
    float p[R][KB];
    pair_t pp[R][KB / 2];
    for (int r = 0; r < R; r++) {
        for (int c = 0; c < NV; c++) store16(p[r] + c * 16, s[r][c] * scale);
        const int64_t last = limit[r] - key0;
        for (int64_t j = 0; j < KB; j++)
            if (j >= count || j > last) p[r][j] = NO_SCORE;
        float top = m[r];
        for (int64_t j = 0; j < KB; j++) top = p[r][j] > top ? p[r][j] : top;
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t j = 0; j < KB; j++) {
            p[r][j] = expf(p[r][j] - top);
            sum += p[r][j];
        }
        const float alpha = expf(m[r] - top);
        l[r] = l[r] * alpha + sum;
        m[r] = top;
        float *a = acc + r * D;
#pragma omp simd
        for (int64_t d = 0; d < D; d++) a[d] *= alpha;
        for (int c = 0; c < KB / 32; c++) { /* 32 probabilities -> 16 pairs, in key order */
            const __m512bh packed = _mm512_cvtne2ps_pbh((__m512)load16(p[r] + 32 * c + 16),
                                                        (__m512)load16(p[r] + 32 * c));
            memcpy(pp[r] + 16 * c, &packed, sizeof packed);
        }
    }
    const int64_t pairs = (count + 1) / 2;
    int64_t c0 = 0;
    for (; c0 + 64 <= D; c0 += 64) pv_slab_bf16(acc, vb, pp, pairs, c0, D, 4);
    for (; c0 < D; c0 += 16) pv_slab_bf16(acc, vb, pp, pairs, c0, D, 1);
}

/* run_task for bfloat16 queries over a bfloat16 pool (see the top of the file). */
ALWAYS_INLINE void run_task_bf16(const Batch *b, int64_t span, int64_t head, int64_t tok0,
                                 int64_t tok1, const int64_t D)
{
    const int64_t *sp = b->spans + 4 * span;
    const int64_t row0 = sp[0], prefix = sp[2];
    const int64_t *slots = b->slots + sp[3];
    const int64_t group = b->group, tokens = tok1 - tok0, half = D / 2;
    const int64_t n = tokens * group, padded = (n + R - 1) / R * R;
    /* Scratch (4-byte words): acc (padded, D); m, l (padded); qs (padded, D/2); kt, vb. */
    float *acc = calloc((size_t)(padded * (D + half + 2) + KB * D), 4);
    int64_t *limit = malloc((size_t)padded * sizeof(int64_t));
    if (acc == NULL || limit == NULL) abort();
    float *m = acc + padded * D, *l = m + padded;
    pair_t *qs = (pair_t *)(l + padded), *kt = qs + padded * half, *vb = kt + half * KB;
    for (int64_t r = 0; r < padded; r++) {
        m[r] = NO_SCORE;
        limit[r] = -1;
        if (r >= n) continue;
        const int64_t tok = tok0 + r / group, g = r % group;
        const float *qr = b->q + ((row0 + tok) * b->num_heads + head * group + g) * D;
        for (int64_t d = 0; d < half; d++)
            qs[r * half + d] = bf16_bits(qr[2 * d]) | bf16_bits(qr[2 * d + 1]) << 16;
        limit[r] = prefix + tok;
    }
    const int64_t visible = prefix + tok1;
    for (int64_t key0 = 0; key0 < visible; key0 += KB) {
        const int64_t count = visible - key0 < KB ? visible - key0 : KB;
        for (int64_t j = 0; j < KB; j += 2) {
            const uint16_t *v0 = NULL, *v1 = NULL;
            for (int64_t i = j; i < j + 2; i++) {
                const pair_t *kr = NULL;
                if (i < count) {
                    const int64_t at = slots[key0 + i] * b->row_bytes + head * b->head_bytes;
                    kr = (const pair_t *)(b->k + at);
                    *(i == j ? &v0 : &v1) = (const uint16_t *)(b->v + at);
                }
                for (int64_t d = 0; d < half; d++) kt[d * KB + i] = kr ? kr[d] : 0;
            }
            pair_t *vp = vb + (j / 2) * D;
            for (int64_t d = 0; d < D; d++)
                vp[d] = (v0 ? v0[d] : 0u) | (uint32_t)(v1 ? v1[d] : 0u) << 16;
        }
        for (int64_t r = 0; r < padded; r += R) {
            int64_t seen = -1;
            for (int64_t i = r; i < r + R; i++) seen = limit[i] > seen ? limit[i] : seen;
            if (seen < key0) continue;
            block_rows_bf16(qs + r * half, kt, vb, count, key0, limit + r, acc + r * D, m + r,
                            l + r, D, b->scale);
        }
    }
    for (int64_t r = 0; r < n; r++) {
        const int64_t tok = tok0 + r / group, g = r % group;
        float *o = b->out + ((row0 + tok) * b->num_heads + head * group + g) * D;
        const float inv = 1.0f / l[r];
        for (int64_t d = 0; d < D; d++) o[d] = acc[r * D + d] * inv;
    }
    free(limit);
    free(acc);
}
#else
#define HAS_BF16_DOTS 0
#endif

/* 1 when this build does bfloat16 dot products for kv_mode 2 (else it runs kv_mode 1). */
int extend_bf16_dots(void) { return HAS_BF16_DOTS; }

static void run_task_dispatch(const Batch *b, int64_t span, int64_t head, int64_t tok0,
                              int64_t tok1, int64_t D, int kv_mode)
{
#if HAS_BF16_DOTS
    if (kv_mode == 2) {
        if (D == 64) run_task_bf16(b, span, head, tok0, tok1, 64);
        else run_task_bf16(b, span, head, tok0, tok1, D);
        return;
    }
#endif
    const int bf16 = kv_mode != 0;
    if (D == 64 && !bf16) run_task(b, span, head, tok0, tok1, 64, 0);
    else if (D == 64) run_task(b, span, head, tok0, tok1, 64, 1);
    else if (D == 128 && !bf16) run_task(b, span, head, tok0, tok1, 128, 0);
    else if (D == 128) run_task(b, span, head, tok0, tok1, 128, 1);
    else if (D == 32 && !bf16) run_task(b, span, head, tok0, tok1, 32, 0);
    else if (!bf16) run_task(b, span, head, tok0, tok1, D, 0);
    else run_task(b, span, head, tok0, tok1, D, 1);
}

int extend_attention(const float *q, const void *k, const void *v, float *out, int64_t num_heads,
                     int64_t num_kv_heads, int64_t head_dim, int kv_mode, float scale,
                     int64_t num_spans, const int64_t *spans, const int64_t *slots,
                     int num_threads)
{
    if (num_heads % num_kv_heads != 0) return 1;
    if (head_dim % 16 != 0) return 2; /* rows are whole vectors of 16 floats */
    const int64_t head_bytes = head_dim * (kv_mode ? 2 : 4);
    const Batch batch = {q,         out,       k, v, num_heads, num_heads / num_kv_heads,
                         num_kv_heads * head_bytes, head_bytes, scale, spans, slots};
    int64_t num_tasks = 0;
    for (int64_t s = 0; s < num_spans; s++) num_tasks += (spans[4 * s + 1] + TILE - 1) / TILE;
    num_tasks *= num_kv_heads;
    int64_t *tasks = malloc((size_t)(num_tasks * 3) * sizeof(int64_t)); /* (span, head, tile) */
    if (tasks == NULL) return 3;
    int64_t t = 0;
    for (int64_t s = 0; s < num_spans; s++)
        for (int64_t tile = (spans[4 * s + 1] + TILE - 1) / TILE - 1; tile >= 0; tile--)
            for (int64_t h = 0; h < num_kv_heads; h++) { /* longest (last) tiles first */
                tasks[3 * t] = s;
                tasks[3 * t + 1] = h;
                tasks[3 * t + 2] = tile;
                t++;
            }
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t i = 0; i < num_tasks; i++) {
        const int64_t s = tasks[3 * i], tok0 = tasks[3 * i + 2] * TILE;
        const int64_t extend_len = spans[4 * s + 1];
        const int64_t tok1 = tok0 + TILE < extend_len ? tok0 + TILE : extend_len;
        run_task_dispatch(&batch, s, tasks[3 * i + 1], tok0, tok1, head_dim, kv_mode);
    }
    free(tasks);
    return 0;
}
