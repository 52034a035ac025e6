/* Rotary embedding of the new tokens' queries and keys, and the K/V write into the pool, in one
   pass over the qkv projection's output.

   PyTorch needs about ten small ops per layer for this (split, roll, mul, addcmul for q and for k,
   two dtype casts, two index_copy_): in a decode step of 8 tokens each costs more in dispatch
   than in arithmetic. Here it is one call per layer.

   Layouts (contiguous):
     qkv        (T, row_stride) float32: per token, q (H * D), then k (KV * D), then v (KV * D)
     cos, sin   (T, D) float32; sin carries rope's sign: rope(x)[d] = x[d] cos[d] + x[d ^ half] sin[d]
                where d ^ half is the same position in the other half of the head
     out_slots  (T,) the pool slot each token's K/V goes to
     k, v       (num_slots, KV, D) float32 or bfloat16 (rounded to nearest even, as PyTorch does)
     q_out      (T, H, D) float32
*/
#include <stdint.h>
#include <string.h>

static inline uint16_t to_bf16(float x)
{
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    return (uint16_t)((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16); /* round to nearest even */
}

/* out[d] = rope(x)[d] for one head of one token. */
static inline void rotate(const float *x, const float *cos, const float *sin, float *out,
                          int64_t D)
{
    const int64_t half = D / 2;
#pragma omp simd
    for (int64_t d = 0; d < half; d++) {
        out[d] = x[d] * cos[d] + x[d + half] * sin[d];
        out[d + half] = x[d + half] * cos[d + half] + x[d] * sin[d + half];
    }
}

static inline void store_row(const float *row, char *dst, int64_t D, int bf16)
{
    if (!bf16) {
        memcpy(dst, row, (size_t)D * sizeof(float));
        return;
    }
    uint16_t *out = (uint16_t *)dst;
    for (int64_t d = 0; d < D; d++) out[d] = to_bf16(row[d]);
}

int rope_store(const float *qkv, int64_t num_tokens, int64_t row_stride, int64_t num_heads,
               int64_t num_kv_heads, int64_t head_dim, const float *cos, const float *sin,
               const int64_t *out_slots, void *k, void *v, int kv_bf16, float *q_out,
               int num_threads)
{
    const int64_t D = head_dim, elem = kv_bf16 ? 2 : 4;
    if (D % 2 != 0 || D > 1024) return 1;
    const int64_t slot_bytes = num_kv_heads * D * elem;
    /* Threads only when there is enough work to pay for waking them (a prefill chunk). */
#pragma omp parallel for num_threads(num_threads) if (num_tokens >= 64)
    for (int64_t t = 0; t < num_tokens; t++) {
        const float *row = qkv + t * row_stride, *c = cos + t * D, *s = sin + t * D;
        for (int64_t h = 0; h < num_heads; h++)
            rotate(row + h * D, c, s, q_out + (t * num_heads + h) * D, D);
        char *k_slot = (char *)k + out_slots[t] * slot_bytes;
        char *v_slot = (char *)v + out_slots[t] * slot_bytes;
        const float *k_row = row + num_heads * D, *v_row = k_row + num_kv_heads * D;
        float rotated[1024];
        for (int64_t h = 0; h < num_kv_heads; h++) {
            rotate(k_row + h * D, c, s, rotated, D);
            store_row(rotated, k_slot + h * D * elem, D, kv_bf16);
            store_row(v_row + h * D, v_slot + h * D * elem, D, kv_bf16);
        }
    }
    return 0;
}
