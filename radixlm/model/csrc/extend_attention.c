/* Prefill (extend) attention over K/V in the pool: e new tokens of a request attend causally to
   its prefix_len cached tokens and to themselves.

   Why not PyTorch's SDPA: its CPU flash kernel does its block products through MKL, which on
   AMD EPYC runs well below the machine's FMA rate, most of all with a mask (a cached prefix
   needs one), so short questions over long cached prompts spent much of their step in it
   (docs/kernels.md). This is flash attention written for the CPU's vector registers
   (the tile loops are in flash_tile.h):

     for each task = (request, kv head, tile of up to TILE new tokens):
       rows = the tile's tokens x the G query heads on this kv head     (token-major)
       row i of token t may see keys up to prefix_len + t                (causal)
       tile_attend: the rows against their keys, block by block, online softmax
       out = acc / l

   Tasks write disjoint output rows and run in parallel on PyTorch's OpenMP pool.

   Layouts: q, out (T, H, D) float32; k, v (num_slots, KV, D) views (slot s, kv head h at element
   s * slot_stride + h * head_stride, as decode_attention.c reads them) float32 (kv_mode 0) or bfloat16
   (kv_mode 1: float32 arithmetic; 2: a bfloat16 model, bfloat16 dot products where the CPU has
   them, else as 1) or int8 codes (kv_mode 3, or 4 for a bfloat16 model, with k_scales /
   v_scales as decode_attention.c takes them: dequantized as each key block is staged, float32
   arithmetic either way); spans
   (num_spans, 4): first row in q/out, extend_len, prefix_len, offset of the request's
   prefix_len + extend_len slots in `slots`.
*/
#include <stdlib.h>

#include "flash_tile.h"

#define TILE 64    /* new tokens per task, at most */
#define MIN_TILE 8 /* at least (but a shorter extend): below it a key block's staging is shared
                      by too few rows */

typedef struct {
    const float *q;
    float *out;
    const char *k, *v, *ks, *vs; /* ks, vs: int8 pools' scales, else NULL */
    int64_t num_heads, group, row_bytes, head_bytes, scale_row_bytes, scale_head_bytes;
    float scale;
    const int64_t *spans, *slots;
} Batch;

/* One task: new tokens [tok0, tok1) of span `span`, kv head `head`; dots: bfloat16 dot
   products (a bfloat16 pool), else float32 arithmetic over K/V stored as `kind`. */
ALWAYS_INLINE void run_task(const Batch *b, int64_t span, int64_t head, int64_t tok0,
                            int64_t tok1, const int64_t D, const int kind, const int dots)
{
    const int64_t *sp = b->spans + 4 * span;
    const int64_t row0 = sp[0], prefix = sp[2];
    const int64_t group = b->group, n = (tok1 - tok0) * group, rows = (n + R - 1) / R * R;
    /* Scratch (4-byte words): acc, qs (rows, D); m, l (rows); kt, vb (KB, D). */
    float *acc = calloc((size_t)(rows * (2 * D + 2) + 2 * KB * D), sizeof(float));
    int64_t *limit = malloc((size_t)rows * sizeof(int64_t));
    if (acc == NULL || limit == NULL) abort();
    float *qs = acc + rows * D, *m = qs + rows * D, *l = m + rows;
    float *kt = l + rows, *vb = kt + KB * D;
    for (int64_t r = 0; r < rows; r++) {
        m[r] = NO_SCORE;
        limit[r] = -1; /* padding rows see nothing (their output is never written) */
        if (r >= n) continue;
        const int64_t tok = tok0 + r / group, g = r % group;
        const float *qr = b->q + ((row0 + tok) * b->num_heads + head * group + g) * D;
        limit[r] = prefix + tok;
#if HAS_BF16_DOTS
        if (dots) { /* bfloat16 pairs, unscaled */
            pair_t *qp = (pair_t *)qs + r * (D / 2);
            for (int64_t d = 0; d < D / 2; d++)
                qp[d] = bf16_bits(qr[2 * d]) | bf16_bits(qr[2 * d + 1]) << 16;
            continue;
        }
#endif
        for (int64_t d = 0; d < D; d++) qs[r * D + d] = qr[d] * b->scale;
    }
    const Tile tile = {rows, limit, acc, m, l};
    const KeySource src = {b->k,  b->v,  b->row_bytes,        head * b->head_bytes,
                           b->ks, b->vs, b->scale_row_bytes, head * b->scale_head_bytes};
    const int64_t *slots = b->slots + sp[3];
#if HAS_BF16_DOTS
    if (dots)
        tile_attend_bf16(&tile, (const pair_t *)qs, b->scale, &src, slots, prefix + tok1,
                         (pair_t *)kt, (pair_t *)vb, D);
    else
#endif
        tile_attend(&tile, qs, &src, slots, prefix + tok1, kt, vb, D, kind);
    for (int64_t r = 0; r < n; r++) {
        const int64_t tok = tok0 + r / group, g = r % group;
        float *o = b->out + ((row0 + tok) * b->num_heads + head * group + g) * D;
        const float inv = 1.0f / l[r];
        for (int64_t d = 0; d < D; d++) o[d] = acc[r * D + d] * inv;
    }
    free(limit);
    free(acc);
}

/* 1 when this build does bfloat16 dot products for kv_mode 2 (else it runs kv_mode 1). */
int extend_bf16_dots(void) { return HAS_BF16_DOTS; }

/* Literal head sizes and element types let the compiler unroll and specialise the loops. */
static void run_task_dispatch(const Batch *b, int64_t span, int64_t head, int64_t tok0,
                              int64_t tok1, int64_t D, int kv_mode)
{
    if (kv_mode == 2 && HAS_BF16_DOTS) {
        if (D == 64) run_task(b, span, head, tok0, tok1, 64, KV_BF16, 1);
        else run_task(b, span, head, tok0, tok1, D, KV_BF16, 1);
    }
    else if (kv_mode >= 3 && D == 64) run_task(b, span, head, tok0, tok1, 64, KV_I8, 0);
    else if (kv_mode >= 3) run_task(b, span, head, tok0, tok1, D, KV_I8, 0);
    else if (D == 64 && !kv_mode) run_task(b, span, head, tok0, tok1, 64, KV_F32, 0);
    else if (D == 64) run_task(b, span, head, tok0, tok1, 64, KV_BF16, 0);
    else if (D == 128 && !kv_mode) run_task(b, span, head, tok0, tok1, 128, KV_F32, 0);
    else if (D == 128) run_task(b, span, head, tok0, tok1, 128, KV_BF16, 0);
    else if (D == 32 && !kv_mode) run_task(b, span, head, tok0, tok1, 32, KV_F32, 0);
    else if (!kv_mode) run_task(b, span, head, tok0, tok1, D, KV_F32, 0);
    else run_task(b, span, head, tok0, tok1, D, KV_BF16, 0);
}

int extend_attention(const float *q, const void *k, const void *v, const void *k_scales,
                     const void *v_scales, float *out, int64_t num_heads, int64_t num_kv_heads,
                     int64_t head_dim, int64_t slot_stride, int64_t head_stride,
                     int64_t scales_slot_stride, int64_t scales_head_stride, int kv_mode,
                     float scale, int64_t num_spans, const int64_t *spans, const int64_t *slots,
                     int num_threads)
{
    if (num_heads % num_kv_heads != 0) return 1;
    if (head_dim % 16 != 0) return 2; /* rows are whole vectors of 16 floats */
    if (kv_mode < 0 || kv_mode > 4 || (kv_mode >= 3 && (k_scales == NULL || v_scales == NULL)))
        return 4;
    const int64_t elem = kv_mode >= 3 ? 1 : kv_mode ? 2 : 4;
    const int i8 = kv_mode >= 3;
    const Batch batch = {q, out, k, v, i8 ? k_scales : NULL, i8 ? v_scales : NULL, num_heads,
                         num_heads / num_kv_heads, slot_stride * elem, head_stride * elem,
                         scales_slot_stride * 2, scales_head_stride * 2, scale * LOG2E, spans,
                         slots};
    /* scores in log2 units: the softmax takes exp2 (flash_tile.h) */
    /* A short extend is few tasks: 28 new tokens on 3 kv heads are 3, and on 2 threads one
       does two thirds of the work. The tile halves until there are 2 tasks a thread (or it is
       MIN_TILE): each row's arithmetic is its own whatever tile holds it. */
    int64_t tile = TILE, num_tiles = 0;
    for (;; tile /= 2) {
        num_tiles = 0;
        for (int64_t s = 0; s < num_spans; s++) num_tiles += (spans[4 * s + 1] + tile - 1) / tile;
        if (num_tiles * num_kv_heads >= 2 * num_threads || tile / 2 < MIN_TILE) break;
    }
    const int64_t num_tasks = num_tiles * num_kv_heads;
    int64_t *tasks = malloc((size_t)(num_tasks * 3) * sizeof(int64_t)); /* (span, head, tile) */
    if (tasks == NULL) return 3;
    int64_t t = 0;
    for (int64_t s = 0; s < num_spans; s++)
        for (int64_t i = (spans[4 * s + 1] + tile - 1) / tile - 1; i >= 0; i--)
            for (int64_t h = 0; h < num_kv_heads; h++) { /* longest (last) tiles first */
                tasks[3 * t] = s;
                tasks[3 * t + 1] = h;
                tasks[3 * t + 2] = i;
                t++;
            }
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t i = 0; i < num_tasks; i++) {
        const int64_t s = tasks[3 * i], tok0 = tasks[3 * i + 2] * tile;
        const int64_t extend_len = spans[4 * s + 1];
        const int64_t tok1 = tok0 + tile < extend_len ? tok0 + tile : extend_len;
        run_task_dispatch(&batch, s, tasks[3 * i + 1], tok0, tok1, head_dim, kv_mode);
    }
    free(tasks);
    return 0;
}

/* The variant this library was built as (simd.h): the loader checks it against its name. */
const char *kernels_isa(void) { return ISA_NAME; }
