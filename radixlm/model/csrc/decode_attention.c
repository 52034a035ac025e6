/* Decode attention that reads K/V where they lie in the pool, sharing prefixes.

   One query token per request, keys = the request's slots in the pool. PyTorch's path gathers
   every request's K/V rows into a padded copy and then runs SDPA over the copy: three passes over
   memory that is read once here. And requests that sit on the same cached prefix (same slot ids)
   are attended as a *unit*: each K/V row of the shared run is loaded once and used by every
   member's queries, the way a radix tree would want it. Decode on a CPU is bound by memory
   traffic, so both cut the time attention takes.

   Work is split into tasks = (unit, key segment, kv head): a segment is SEGMENT keys of each
   member's sequence by position (shared run first, then its own slots), so a long request's keys
   are shared out among the threads. Tasks never share an output row or a partial, so they run in
   parallel without locks (OpenMP; the process already holds PyTorch's libgomp, which this library
   resolves to, so both share one thread pool). Each task keeps, per query row, the running max m,
   the running sum l and the unnormalised output acc (online softmax), and walks its keys in
   chunks: the shared run first (all members' queries), then each member's own slots. A row
   with one segment writes its output; longer ones leave (m, l, acc) per segment, merged in
   segment order once every task is done (merge_segments).

   The shared run of a unit is many query rows against the same keys, the shape prefill has:
   from TILE_MIN_ROWS rows up it goes through the extend kernel's register tiles
   (flash_tile.h), which widen each K/V row once for all the rows and keep 8 rows x 32 keys of
   scores in registers. Fewer rows, and each member's own slots (a few rows each), go row by
   row: 16 keys at a time with the scores summed in a shuffle tree on AVX-512 (attend_rows),
   one key at a time on AVX2 (update_block).

   Layouts (contiguous; q, out float32; k, v float32 (kv_mode 0) or bfloat16 (kv_mode 1; 2: a
   bfloat16 model, whose Q K^T, and the shared runs' P V, use bfloat16 dot products where the
   CPU has them) or int8 codes (kv_mode 3: float32 arithmetic on code * scale; 4: a bfloat16
   model, whose row path takes Q K^T over the codes in bfloat16 dot products where the CPU has
   them)):
     q, out     (B, H, D)             B requests, H query heads; heads h*G .. h*G+G-1 read kv head h
     k, v       (num_slots, KV, D)    one layer of the pool, as a view: slot s, kv head h at
                                      element s * slot_stride + h * head_stride (KVPool keeps
                                      its CPU pools head-major: slot_stride D, head_stride
                                      num_slots * D, each head's rows contiguous)
     k_scales,  (num_slots, KV)       kv_mode 3, 4: each row's bfloat16 scale, slot s, kv head h at
     v_scales                         element s * scales_slot_stride + h * scales_head_stride
                                      (unused, and may be NULL, for float pools)
     units      num_units + 1 offsets into the member arrays; unit u = members [units[u], units[u+1])
     shared     (num_units, 2)        offset into `slots` and length of the unit's shared run
     own        (B, 2)                offset and length of each member's own slots (after the run)
     member_row (B,)                  the member's row in q / out
*/
#include "decode_task.h"

/* Literal head sizes let the compiler unroll and specialise the loops; a bfloat16 pool's tasks
   are built in decode_attention_bf16.c, an int8 pool's in decode_attention_i8.c. */
static void run_task_dispatch(const Batch *b, const KeySource *src, int64_t u, int64_t seg,
                              int64_t head, int64_t D, int kv_mode)
{
    if (kv_mode >= 3) decode_task_i8(b, src, u, seg, head, D, kv_mode);
    else if (kv_mode) decode_task_bf16(b, src, u, seg, head, D, kv_mode);
    else if (D == 64) run_task(b, src, u, seg, head, 64, KV_F32, 0, 1);
    else if (D == 128) run_task(b, src, u, seg, head, 128, KV_F32, 0, 1);
    else run_task(b, src, u, seg, head, D, KV_F32, 0, 0);
}

/* Segments of unit u: those of its longest member (at least one). */
static int64_t unit_segments(const Batch *b, int64_t u)
{
    int64_t longest = 0;
    for (int64_t r = b->units[u]; r < b->units[u + 1]; r++) {
        const int64_t len = member_len(b, u, r);
        longest = len > longest ? len : longest;
    }
    return segments_of(longest);
}

int decode_attention(const float *q, const void *k, const void *v, const void *k_scales,
                     const void *v_scales, float *out, int64_t num_heads, int64_t num_kv_heads,
                     int64_t head_dim, int64_t slot_stride, int64_t head_stride,
                     int64_t scales_slot_stride, int64_t scales_head_stride, int kv_mode,
                     float scale, int64_t num_units, const int64_t *units, const int64_t *shared,
                     const int64_t *own, const int64_t *member_row, const int64_t *slots,
                     int num_threads)
{
    if (num_heads % num_kv_heads != 0) return 1;
    if (head_dim % 16 != 0 || head_dim > 256) return 2; /* whole vectors */
    if (kv_mode < 0 || kv_mode > 4 || (kv_mode >= 3 && (k_scales == NULL || v_scales == NULL)))
        return 3;
    const int64_t group = num_heads / num_kv_heads, num_rows = units[num_units];
    Batch batch = {q,      out, num_heads, group, scale * LOG2E, units, shared, own,
                   member_row, slots, 1, NULL, NULL}; /* scores in log2 units */
    /* the tasks (unit, segment), unit by unit; their partials where a unit has several */
    int64_t num_work = 0;
    for (int64_t u = 0; u < num_units; u++) {
        const int64_t segments = unit_segments(&batch, u);
        batch.max_segments = segments > batch.max_segments ? segments : batch.max_segments;
        num_work += segments;
    }
    int64_t *work = malloc((size_t)(2 * num_work + 1) * sizeof(int64_t)); /* (unit, segment) */
    if (batch.max_segments > 1) {
        const size_t parts = (size_t)(num_rows * num_heads * batch.max_segments);
        batch.part_ml = malloc(parts * 2 * sizeof(float));
        batch.part_acc = malloc(parts * (size_t)head_dim * sizeof(float));
    }
    int status = 0;
    if (work == NULL || (batch.max_segments > 1 && (!batch.part_ml || !batch.part_acc))) {
        status = 100;
        goto done;
    }
    for (int64_t u = 0, w = 0; u < num_units; u++)
        for (int64_t seg = 0, n = unit_segments(&batch, u); seg < n; seg++, w++)
            work[2 * w] = u, work[2 * w + 1] = seg;
    const int64_t elem = kv_mode >= 3 ? 1 : kv_mode ? 2 : 4;
    const char *ks = kv_mode >= 3 ? k_scales : NULL, *vs = kv_mode >= 3 ? v_scales : NULL;
    const Batch *b = &batch;
#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < num_work * num_kv_heads; t++) {
            const int64_t head = t % num_kv_heads, w = t / num_kv_heads;
            const KeySource src = {k, v, slot_stride * elem, head * head_stride * elem,
                                   ks, vs, scales_slot_stride * 2, head * scales_head_stride * 2};
            run_task_dispatch(b, &src, work[2 * w], work[2 * w + 1], head, head_dim, kv_mode);
        }
        if (b->max_segments > 1) { /* after the loop's barrier: every segment is in */
#pragma omp for schedule(static)
            for (int64_t i = 0; i < num_units * num_heads; i++) {
                const int64_t u = i / num_heads, qh = i % num_heads;
                for (int64_t r = units[u]; r < units[u + 1]; r++) {
                    const int64_t n = segments_of(member_len(b, u, r));
                    if (n > 1) merge_segments(b, member_row[r], qh, n, head_dim);
                }
            }
        }
    }
done:
    free(batch.part_acc);
    free(batch.part_ml);
    free(work);
    return status;
}
