/* Decode attention that reads K/V where they lie in the pool, sharing prefixes.

   One query token per request, keys = the request's slots in the pool. PyTorch's path gathers
   every request's K/V rows into a padded copy and then runs SDPA over the copy: three passes over
   memory that is read once here. And requests that sit on the same cached prefix (same slot ids)
   are attended as a *unit*: each K/V row of the shared run is loaded once and used by every
   member's queries, the way a radix tree would want it. Decode on a CPU is bound by memory
   traffic, so both halve or better the time attention takes.

   Work is split into tasks = (unit, kv head); tasks never share an output row, so they run in
   parallel without locks (OpenMP; the process already holds PyTorch's libgomp, which this library
   resolves to, so both share one thread pool). Each task keeps, per query row, the running max m,
   the running sum l and the unnormalised output acc (online softmax), and walks its keys in
   chunks: the shared run first (all members' queries), then each member's own slots.

   Layouts (float32, contiguous):
     q, out     (B, H, D)             B requests, H query heads; heads h*G .. h*G+G-1 read kv head h
     k, v       (num_slots, KV, D)    one layer of the pool
     units      num_units + 1 offsets into the member arrays; unit u = members [units[u], units[u+1])
     shared     (num_units, 2)        offset into `slots` and length of the unit's shared run
     own        (B, 2)                offset and length of each member's own slots (after the run)
     member_row (B,)                  the member's row in q / out
*/
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#define CHUNK 32        /* keys per softmax update: the chunk's K/V rows stay in L1 */
#define BLOCK 8         /* query rows updated together: their scores fit in registers and L1 */
#define NO_SCORE -1e30f /* "minus infinity" that -ffast-math may not assume away */

typedef struct {
    const float *k, *v;
    int64_t num_kv_heads, head;
} KeySource;

/* Slots lie anywhere in the pool: ask for a chunk's rows early, so their cache misses overlap
   the arithmetic on the chunk before instead of stalling one by one. */
static inline __attribute__((always_inline)) void prefetch_rows(
    const KeySource *src, const int64_t *slots, int64_t from, int64_t len, const int64_t D)
{
    const int64_t stride = src->num_kv_heads * D;
    for (int64_t j = from; j < from + CHUNK && j < len; j++) {
        const int64_t row = slots[j] * stride + src->head * D;
        for (int64_t d = 0; d < D; d += 16) { /* one cache line per 16 floats */
            __builtin_prefetch(src->k + row + d);
            __builtin_prefetch(src->v + row + d);
        }
    }
}

/* Online-softmax update of nb <= BLOCK query rows (q, pre-scaled) with one chunk of keys. */
static inline __attribute__((always_inline)) void update_block(
    const float *const *k_rows, const float *const *v_rows, int64_t count, const float *q,
    int64_t nb, float *acc, float *m, float *l, const int64_t D)
{
    float scores[BLOCK * CHUNK];
    for (int64_t j = 0; j < count; j++) { /* scores (nb, count) = q K^T */
        const float *k = k_rows[j];
        for (int64_t i = 0; i < nb; i++) {
            const float *qi = q + i * D;
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < D; d++) dot += qi[d] * k[d];
            scores[i * CHUNK + j] = dot;
        }
    }
    for (int64_t i = 0; i < nb; i++) { /* weights; rescale what the earlier chunks gave */
        float *s = scores + i * CHUNK;
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
        float *a = acc + i * D;
#pragma omp simd
        for (int64_t d = 0; d < D; d++) a[d] *= alpha;
    }
    for (int64_t j = 0; j < count; j++) { /* acc += P V */
        const float *v = v_rows[j];
        for (int64_t i = 0; i < nb; i++) {
            const float p = scores[i * CHUNK + j];
            float *a = acc + i * D;
#pragma omp simd
            for (int64_t d = 0; d < D; d++) a[d] += p * v[d];
        }
    }
}

/* n query rows (contiguous, pre-scaled) attend to the keys slots[0 .. len): each K/V row is
   loaded once per chunk and used by all n rows, in blocks of BLOCK. */
static inline __attribute__((always_inline)) void attend_keys(
    const KeySource *src, const float *q, int64_t n, const int64_t *slots, int64_t len,
    float *acc, float *m, float *l, const int64_t D)
{
    const int64_t stride = src->num_kv_heads * D;
    const float *k_rows[CHUNK], *v_rows[CHUNK];
    for (int64_t start = 0; start < len; start += CHUNK) {
        const int64_t count = len - start < CHUNK ? len - start : CHUNK;
        prefetch_rows(src, slots, start + CHUNK, len, D);
        for (int64_t j = 0; j < count; j++) {
            const int64_t row = slots[start + j] * stride + src->head * D;
            k_rows[j] = src->k + row;
            v_rows[j] = src->v + row;
        }
        for (int64_t i = 0; i < n; i += BLOCK) {
            const int64_t nb = n - i < BLOCK ? n - i : BLOCK;
            update_block(k_rows, v_rows, count, q + i * D, nb, acc + i * D, m + i, l + i, D);
        }
    }
}

/* One task: kv head `head` of one unit. Scratch holds n rows of acc (D), m and l. */
static inline __attribute__((always_inline)) void run_task(
    const float *q, float *out, const KeySource *src, int64_t num_heads, float scale,
    int64_t member_begin, int64_t member_end, const int64_t *shared, const int64_t *own, const int64_t *member_row,
    const int64_t *slots, const int64_t D)
{
    const int64_t group = num_heads / src->num_kv_heads;
    const int64_t n = (member_end - member_begin) * group;
    /* Scratch: the n query rows copied contiguous and pre-scaled, then acc (n, D), m, l. */
    float *qs = calloc((size_t)(n * (2 * D + 2)), sizeof(float));
    if (qs == NULL) abort(); /* a few KB; nothing sensible to do without it */
    float *acc = qs + n * D, *m = acc + n * D, *l = m + n;
    for (int64_t i = 0; i < n; i++) {
        const int64_t row = member_row[member_begin + i / group];
        const float *qi = q + (row * num_heads + src->head * group + i % group) * D;
        for (int64_t d = 0; d < D; d++) qs[i * D + d] = qi[d] * scale;
        m[i] = NO_SCORE;
    }
    if (shared[1] > 0) attend_keys(src, qs, n, slots + shared[0], shared[1], acc, m, l, D);
    for (int64_t r = 0; r < member_end - member_begin; r++) {
        const int64_t *mine = own + 2 * (member_begin + r);
        const int64_t at = r * group;
        attend_keys(src, qs + at * D, group, slots + mine[0], mine[1], acc + at * D, m + at,
                    l + at, D);
    }
    for (int64_t i = 0; i < n; i++) {
        const int64_t row = member_row[member_begin + i / group];
        float *o = out + (row * num_heads + src->head * group + i % group) * D;
        const float inv = 1.0f / l[i];
        for (int64_t d = 0; d < D; d++) o[d] = acc[i * D + d] * inv;
    }
    free(qs);
}

int decode_attention(const float *q, const float *k, const float *v, float *out, int64_t num_heads,
                     int64_t num_kv_heads, int64_t head_dim, float scale, int64_t num_units,
                     const int64_t *units, const int64_t *shared, const int64_t *own,
                     const int64_t *member_row, const int64_t *slots, int num_threads)
{
    if (num_heads % num_kv_heads != 0) return 1;
    const int64_t num_tasks = num_units * num_kv_heads;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t t = 0; t < num_tasks; t++) {
        const int64_t u = t / num_kv_heads;
        const KeySource src = {k, v, num_kv_heads, t % num_kv_heads};
        /* Literal head sizes let the compiler unroll the inner loops fully. */
        if (head_dim == 64)
            run_task(q, out, &src, num_heads, scale, units[u], units[u + 1], shared + 2 * u, own,
                     member_row, slots, 64);
        else if (head_dim == 128)
            run_task(q, out, &src, num_heads, scale, units[u], units[u + 1], shared + 2 * u, own,
                     member_row, slots, 128);
        else
            run_task(q, out, &src, num_heads, scale, units[u], units[u + 1], shared + 2 * u, own,
                     member_row, slots, head_dim);
    }
    return 0;
}
