/* Decode attention that reads K/V where they lie in the pool, sharing prefixes.

   One query token per request, keys = the request's slots in the pool. PyTorch's path gathers
   every request's K/V rows into a padded copy and then runs SDPA over the copy: three passes over
   memory that is read once here. And requests that sit on the same cached prefix (same slot ids)
   are attended as a *unit*: each K/V row of the shared run is loaded once and used by every
   member's queries, the way a radix tree would want it. Decode on a CPU is bound by memory
   traffic, so both cut the time attention takes.

   Work is split into tasks = (unit, kv head); tasks never share an output row, so they run in
   parallel without locks (OpenMP; the process already holds PyTorch's libgomp, which this library
   resolves to, so both share one thread pool). Each task keeps, per query row, the running max m,
   the running sum l and the unnormalised output acc (online softmax), and walks its keys in
   chunks: the shared run first (all members' queries), then each member's own slots.

   The shared run of a unit is many query rows against the same keys, the shape prefill has:
   it goes through the extend kernel's register tiles (flash_tile.h), which widen each K/V row
   once for all the rows and keep 8 rows x 32 keys of scores in registers. Each member's own
   slots (a few rows each) go row by row.

   Layouts (contiguous; q, out float32; k, v float32 (kv_mode 0) or bfloat16 (kv_mode 1; 2: a
   bfloat16 model, whose shared runs use bfloat16 dot products where the CPU has them)):
     q, out     (B, H, D)             B requests, H query heads; heads h*G .. h*G+G-1 read kv head h
     k, v       (num_slots, KV, D)    one layer of the pool
     units      num_units + 1 offsets into the member arrays; unit u = members [units[u], units[u+1])
     shared     (num_units, 2)        offset into `slots` and length of the unit's shared run
     own        (B, 2)                offset and length of each member's own slots (after the run)
     member_row (B,)                  the member's row in q / out
*/
#include <stdlib.h>

#include "flash_tile.h"

#define CHUNK 32 /* keys per softmax update: the chunk's K/V rows stay in L1 */
/* Float32 shared runs of fewer query rows than this go row by row: the tile's staging of each
   key block pays off only over enough rows (8 requests on a 1K run, one layer: 24 rows tiled
   0.13 ms, row by row 0.17; 4 x 2 requests, 6 rows each: tiled 0.22, row by row 0.15). bfloat16
   dot products are faster in tiles at any count. */
#define TILE_MIN_ROWS 16

/* The K and V row addresses of keys slots[from .. from + count), for this task's head. */
ALWAYS_INLINE void row_addresses(const KeySource *src, const int64_t *slots, int64_t from,
                                 int64_t count, const char **k_rows, const char **v_rows)
{
    for (int64_t j = 0; j < count; j++) {
        const int64_t at = slots[from + j] * src->row_bytes + src->head_offset;
        k_rows[j] = src->k + at;
        v_rows[j] = src->v + at;
    }
}

ALWAYS_INLINE void prefetch_row(const char *k_row, const char *v_row, int64_t row_bytes)
{
    for (int64_t b = 0; b < row_bytes; b += 64) { /* one cache line at a time */
        __builtin_prefetch(k_row + b);
        __builtin_prefetch(v_row + b);
    }
}

typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
#define MAX_VECTORS 16 /* head_dim up to 256 */

/* Floats d .. d+16 of a K/V row as one vector (bfloat16 widened by a shift). */
ALWAYS_INLINE v16 load_kv16(const char *row, int64_t d, const int bf16)
{
    if (bf16) {
        u16x16 half;
        memcpy(&half, row + 2 * d, sizeof half);
        return (v16)(__builtin_convertvector(half, u32x16) << 16);
    }
    v16 x;
    memcpy(&x, row + 4 * d, sizeof x);
    return x;
}

ALWAYS_INLINE float sum16(v16 x)
{
    float s = 0.0f;
    for (int i = 0; i < 16; i++) s += x[i];
    return s;
}

/* Online-softmax update of nb query rows (q, pre-scaled) with one chunk of keys; prefetches
   the next chunk's rows (next_k, next_v) as it goes.
   Row by row: the query row (scores) and the output row (P V) stay in vector registers while
   the chunk's K and V rows, in L1 by now, stream past. */
ALWAYS_INLINE void update_block(const char *const *k_rows, const char *const *v_rows,
                                int64_t count, const float *q, int64_t nb, float *acc, float *m,
                                float *l, const int64_t D, const int bf16,
                                const char *const *next_k, const char *const *next_v,
                                int64_t next_count)
{
    const int64_t nv = D / 16;
    for (int64_t i = 0; i < nb; i++) {
        v16 qv[MAX_VECTORS], a[MAX_VECTORS];
        float s[CHUNK];
        for (int64_t c = 0; c < nv; c++) memcpy(&qv[c], q + i * D + 16 * c, sizeof(v16));
        for (int64_t j = 0; j < count; j++) { /* s = q K^T */
            if (i == 0 && j < next_count) /* the next chunk's rows, one key at a time */
                prefetch_row(next_k[j], next_v[j], D * (bf16 ? 2 : 4));
            v16 dot = qv[0] * load_kv16(k_rows[j], 0, bf16);
            for (int64_t c = 1; c < nv; c++) dot += qv[c] * load_kv16(k_rows[j], 16 * c, bf16);
            s[j] = sum16(dot);
        }
        float top = m[i];
        for (int64_t j = 0; j < count; j++) top = s[j] > top ? s[j] : top;
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t j = 0; j < count; j++) {
            s[j] = expf(s[j] - top);
            sum += s[j];
        }
        const float alpha = expf(m[i] - top); /* 0 on the first chunk */
        l[i] = l[i] * alpha + sum;
        m[i] = top;
        for (int64_t c = 0; c < nv; c++) { /* rescale what the earlier chunks gave */
            memcpy(&a[c], acc + i * D + 16 * c, sizeof(v16));
            a[c] *= alpha;
        }
        for (int64_t j = 0; j < count; j++) /* acc += p V */
            for (int64_t c = 0; c < nv; c++) a[c] += s[j] * load_kv16(v_rows[j], 16 * c, bf16);
        for (int64_t c = 0; c < nv; c++) memcpy(acc + i * D + 16 * c, &a[c], sizeof(v16));
    }
}

/* n query rows (contiguous, pre-scaled) attend to the keys slots[0 .. len): each K/V row is
   loaded once per chunk and used by all n rows while it sits in L1.

   Slots lie anywhere in the pool, so each row is a likely cache miss. The first chunk's rows are
   requested up front, and every next chunk's rows one key at a time while the current chunk's
   scores are computed: the misses overlap the arithmetic instead of stalling it one by one
   (a burst of prefetches for a whole chunk was ~10% slower: it overflows the miss buffers). */
ALWAYS_INLINE void attend_keys(const KeySource *src, const float *q, int64_t n,
                               const int64_t *slots, int64_t len, float *acc, float *m, float *l,
                               const int64_t D, const int bf16)
{
    const char *k_rows[2][CHUNK], *v_rows[2][CHUNK]; /* this chunk's and the next one's */
    int64_t cur = 0, count = len < CHUNK ? len : CHUNK;
    row_addresses(src, slots, 0, count, k_rows[0], v_rows[0]);
    for (int64_t j = 0; j < count; j++)
        prefetch_row(k_rows[0][j], v_rows[0][j], D * (bf16 ? 2 : 4));
    for (int64_t start = 0; start < len; start += CHUNK, cur ^= 1) {
        const int64_t next = start + CHUNK;
        const int64_t next_count = next >= len ? 0 : (len - next < CHUNK ? len - next : CHUNK);
        row_addresses(src, slots, next, next_count, k_rows[cur ^ 1], v_rows[cur ^ 1]);
        update_block(k_rows[cur], v_rows[cur], count, q, n, acc, m, l, D, bf16, k_rows[cur ^ 1],
                     v_rows[cur ^ 1], next_count);
        count = next_count;
    }
}

typedef struct {
    const float *q;
    float *out;
    int64_t num_heads, group; /* group: query heads per kv head */
    float scale;
    const int64_t *units, *shared, *own, *member_row, *slots;
} Batch;

/* One task: kv head `head` of unit u; dots: bfloat16 dot products on the shared run. */
ALWAYS_INLINE void run_task(const Batch *b, const KeySource *src, int64_t u, int64_t head,
                            const int64_t D, const int bf16, const int dots)
{
    const int64_t first = b->units[u], num_members = b->units[u + 1] - first;
    const int64_t *run = b->shared + 2 * u;
    const int64_t group = b->group, n = num_members * group;
    const int64_t rows = run[1] > 0 ? (n + R - 1) / R * R : n; /* the tile's rows: whole groups */
    const int64_t tile_words = run[1] > 0 ? rows * D / 2 + 2 * KB * D : 0;
    /* Scratch (4-byte words): qs (rows, D) pre-scaled, acc (rows, D), m, l (rows); for the
       shared run's tile: qp (rows, D/2) bfloat16 pairs, kt, vb (KB, D); limit (rows) int64. */
    float *qs = calloc((size_t)(rows * (2 * D + 2) + tile_words), sizeof(float));
    int64_t *limit = malloc((size_t)rows * sizeof(int64_t));
    if (qs == NULL || limit == NULL) abort(); /* a few KB; nothing sensible to do without it */
    float *acc = qs + rows * D, *m = acc + rows * D, *l = m + rows;
    /* the tile's scratch exists only for a unit with a shared run */
    float *qp = tile_words ? l + rows : NULL, *kt = tile_words ? qp + rows * D / 2 : NULL;
    float *vb = tile_words ? kt + KB * D : NULL;
    for (int64_t i = 0; i < rows; i++) {
        m[i] = NO_SCORE;
        limit[i] = i < n ? run[1] - 1 : -1; /* the whole run; padding rows see nothing */
        if (i >= n) continue;
        const int64_t row = b->member_row[first + i / group];
        const float *qi = b->q + (row * b->num_heads + head * group + i % group) * D;
        for (int64_t d = 0; d < D; d++) qs[i * D + d] = qi[d] * b->scale;
#if HAS_BF16_DOTS
        if (dots && run[1] > 0) /* the tile's queries */
            for (int64_t d = 0; d < D / 2; d++)
                ((pair_t *)qp)[i * (D / 2) + d] = bf16_bits(qi[2 * d]) | bf16_bits(qi[2 * d + 1])
                                                                              << 16;
#endif
    }
    if (run[1] > 0) {
        const Tile tile = {rows, limit, acc, m, l};
        const int64_t *slots = b->slots + run[0];
#if HAS_BF16_DOTS
        if (dots)
            tile_attend_bf16(&tile, (const pair_t *)qp, b->scale, src, slots, run[1],
                             (pair_t *)kt, (pair_t *)vb, D);
        else
#endif
        if (n >= TILE_MIN_ROWS)
            tile_attend(&tile, qs, src, slots, run[1], kt, vb, D, bf16);
        else /* float32 with few rows: row by row, each K/V row still loaded once for all */
            attend_keys(src, qs, n, slots, run[1], acc, m, l, D, bf16);
    }
    for (int64_t r = 0; r < num_members; r++) {
        const int64_t *mine = b->own + 2 * (first + r), at = r * group;
        attend_keys(src, qs + at * D, group, b->slots + mine[0], mine[1], acc + at * D, m + at,
                    l + at, D, bf16);
    }
    for (int64_t i = 0; i < n; i++) {
        const int64_t row = b->member_row[first + i / group];
        float *o = b->out + (row * b->num_heads + head * group + i % group) * D;
        const float inv = 1.0f / l[i];
        for (int64_t d = 0; d < D; d++) o[d] = acc[i * D + d] * inv;
    }
    free(limit);
    free(qs);
}

/* Literal head sizes and element types let the compiler unroll and specialise the loops. */
static void run_task_dispatch(const Batch *b, const KeySource *src, int64_t u, int64_t head,
                              int64_t D, int kv_mode)
{
    if (kv_mode == 2 && HAS_BF16_DOTS) {
        if (D == 64) run_task(b, src, u, head, 64, 1, 1);
        else run_task(b, src, u, head, D, 1, 1);
    }
    else if (D == 64 && !kv_mode) run_task(b, src, u, head, 64, 0, 0);
    else if (D == 64) run_task(b, src, u, head, 64, 1, 0);
    else if (D == 128 && !kv_mode) run_task(b, src, u, head, 128, 0, 0);
    else if (D == 128) run_task(b, src, u, head, 128, 1, 0);
    else if (!kv_mode) run_task(b, src, u, head, D, 0, 0);
    else run_task(b, src, u, head, D, 1, 0);
}

int decode_attention(const float *q, const void *k, const void *v, float *out, int64_t num_heads,
                     int64_t num_kv_heads, int64_t head_dim, int kv_mode, float scale,
                     int64_t num_units, const int64_t *units, const int64_t *shared,
                     const int64_t *own, const int64_t *member_row, const int64_t *slots,
                     int num_threads)
{
    if (num_heads % num_kv_heads != 0) return 1;
    if (head_dim % 16 != 0 || head_dim > 16 * MAX_VECTORS) return 2; /* whole vectors */
    const Batch batch = {q,     out,    num_heads, num_heads / num_kv_heads, scale, units, shared,
                         own,   member_row, slots};
    const int64_t elem = kv_mode ? 2 : 4;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t t = 0; t < num_units * num_kv_heads; t++) {
        const int64_t head = t % num_kv_heads;
        const KeySource src = {k, v, num_kv_heads * head_dim * elem, head * head_dim * elem};
        run_task_dispatch(&batch, &src, t / num_kv_heads, head, head_dim, kv_mode);
    }
    return 0;
}
