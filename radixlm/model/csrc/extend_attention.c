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

   Layouts: q, out (T, H, D) float32; k, v (num_slots, KV, D) float32 or bfloat16;
   spans (num_spans, 4): first row in q/out, extend_len, prefix_len, offset of the request's
   prefix_len + extend_len slots in `slots`.
*/
#include <math.h>
#include <stdint.h>
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

static void run_task_dispatch(const Batch *b, int64_t span, int64_t head, int64_t tok0,
                              int64_t tok1, int64_t D, int bf16)
{
    if (D == 64 && !bf16) run_task(b, span, head, tok0, tok1, 64, 0);
    else if (D == 64) run_task(b, span, head, tok0, tok1, 64, 1);
    else if (D == 128 && !bf16) run_task(b, span, head, tok0, tok1, 128, 0);
    else if (D == 128) run_task(b, span, head, tok0, tok1, 128, 1);
    else if (D == 32 && !bf16) run_task(b, span, head, tok0, tok1, 32, 0);
    else if (!bf16) run_task(b, span, head, tok0, tok1, D, 0);
    else run_task(b, span, head, tok0, tok1, D, 1);
}

int extend_attention(const float *q, const void *k, const void *v, float *out, int64_t num_heads,
                     int64_t num_kv_heads, int64_t head_dim, int kv_bf16, float scale,
                     int64_t num_spans, const int64_t *spans, const int64_t *slots,
                     int num_threads)
{
    if (num_heads % num_kv_heads != 0) return 1;
    if (head_dim % 16 != 0) return 2; /* rows are whole vectors of 16 floats */
    const int64_t head_bytes = head_dim * (kv_bf16 ? 2 : 4);
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
        run_task_dispatch(&batch, s, tasks[3 * i + 1], tok0, tok1, head_dim, kv_bf16);
    }
    free(tasks);
    return 0;
}
