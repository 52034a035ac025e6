/* Rotary embedding of the new tokens' queries and keys, and the K/V write into the pool, in one
   pass over the qkv projection's output.

   PyTorch needs about ten small ops per layer for this (split, roll, mul, addcmul for q and for k,
   two dtype casts, two index_copy_): in a decode step of 8 tokens each costs more in dispatch
   than in arithmetic. Here it is one call per layer.

   Layouts (contiguous, but k and v):
     qkv        (T, row_stride) float32 or bfloat16 (qkv_bf16, a bfloat16 model): per token,
                q (H * D), then k (KV * D), then v (KV * D); the arithmetic is float32
     cos, sin   (T, D) float32; sin carries rope's sign: rope(x)[d] = x[d] cos[d] + x[d ^ half] sin[d]
                where d ^ half is the same position in the other half of the head
     out_slots  (T,) the pool slot each token's K/V goes to
     k, v       (num_slots, KV, D) views, slot s and kv head h at element s * slot_stride +
                h * head_stride; by kv_mode: 0 float32, 1 or 2 bfloat16 (rounded to nearest
                even, as PyTorch does), 3 or 4 int8 codes (quantize_row)
     k_scales,  kv_mode 3, 4: (num_slots, KV) bfloat16, each row's scale, slot s and kv head h at
     v_scales   element s * scales_slot_stride + h * scales_head_stride
     q_out      (T, H, D) in qkv's dtype
*/
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

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

static inline void store_row(const float *row, void *dst, int64_t D, int bf16)
{
    if (!bf16) {
        memcpy(dst, row, (size_t)D * sizeof(float));
        return;
    }
    uint16_t *out = (uint16_t *)dst;
    for (int64_t d = 0; d < D; d++) out[d] = float_to_bf16(row[d]);
}

/* One row as int8 codes and a bfloat16 scale, the format of an int8 pool (cache/kv_quant.py
   holds the same arithmetic in PyTorch, step for step): scale = max|x| * (1/127) rounded up to
   a bfloat16, so no |x| / scale exceeds 127 (clamped all the same); code = x * (1 / scale)
   rounded to nearest even. Dequantized, code * scale is exact in float32 and within scale / 2
   of x. A row of zeros gets scale 0 and codes 0. */
static inline void quantize_row(const float *x, int8_t *codes, uint16_t *scale, int64_t D)
{
    float amax = 0.0f;
    for (int64_t d = 0; d < D; d++) amax = fmaxf(amax, fabsf(x[d]));
    const float raw = amax * (1.0f / 127.0f);
    uint32_t bits;
    memcpy(&bits, &raw, sizeof bits);
    bits = (bits + 0xFFFFu) & 0xFFFF0000u; /* up to the next bfloat16 (raw >= 0, finite) */
    float rounded;
    memcpy(&rounded, &bits, sizeof rounded);
    *scale = (uint16_t)(bits >> 16);
    const float inv = rounded > 0.0f ? 1.0f / rounded : 0.0f;
#pragma omp simd
    for (int64_t d = 0; d < D; d++) {
        const float c = rintf(x[d] * inv);
        codes[d] = (int8_t)(c > 127.0f ? 127.0f : c < -127.0f ? -127.0f : c);
    }
}

/* D elements of a float32 or bfloat16 row, as float32 in out. */
static inline const float *load_row(const void *src, int64_t at, int64_t D, int bf16, float *out)
{
    if (!bf16) return (const float *)src + at;
    const uint16_t *in = (const uint16_t *)src + at;
    for (int64_t d = 0; d < D; d++) out[d] = bf16_to_float(in[d]);
    return out;
}

/* A rotated K row or a V row into the pool: as stored (float32 or bfloat16), or quantized with
   its scale (int8, `scale` its address). */
static inline void store_kv(const float *row, void *dst, uint16_t *scale, int64_t D, int kv_mode)
{
    if (kv_mode >= 3) quantize_row(row, (int8_t *)dst, scale, D);
    else store_row(row, dst, D, kv_mode != 0);
}

int rope_store(const void *qkv, int64_t num_tokens, int64_t row_stride, int64_t num_heads,
               int64_t num_kv_heads, int64_t head_dim, int64_t slot_stride, int64_t head_stride,
               const float *cos, const float *sin,
               const int64_t *out_slots, void *k, void *v, void *k_scales, void *v_scales,
               int64_t scales_slot_stride, int64_t scales_head_stride, int kv_mode, int qkv_bf16,
               void *q_out, int num_threads)
{
    const int i8 = kv_mode >= 3, kv_bf16 = kv_mode == 1 || kv_mode == 2;
    const int64_t D = head_dim, elem = i8 ? 1 : kv_bf16 ? 2 : 4, q_elem = qkv_bf16 ? 2 : 4;
    if (D % 2 != 0 || D > 1024) return 1;
    if (kv_mode < 0 || kv_mode > 4 || (i8 && (k_scales == NULL || v_scales == NULL))) return 2;
    const int64_t slot_bytes = slot_stride * elem, head_bytes = head_stride * elem;
    /* Threads only when there is enough work to pay for waking them (a prefill chunk). */
#pragma omp parallel for num_threads(num_threads) if (num_tokens >= 64)
    for (int64_t t = 0; t < num_tokens; t++) {
        const float *c = cos + t * D, *s = sin + t * D;
        float x[1024], rotated[1024];
        for (int64_t h = 0; h < num_heads; h++) {
            rotate(load_row(qkv, t * row_stride + h * D, D, qkv_bf16, x), c, s, rotated, D);
            store_row(rotated, (char *)q_out + (t * num_heads + h) * D * q_elem, D, qkv_bf16);
        }
        char *k_slot = (char *)k + out_slots[t] * slot_bytes;
        char *v_slot = (char *)v + out_slots[t] * slot_bytes;
        const int64_t k_at = t * row_stride + num_heads * D, v_at = k_at + num_kv_heads * D;
        for (int64_t h = 0; h < num_kv_heads; h++) {
            const int64_t scale_at = out_slots[t] * scales_slot_stride + h * scales_head_stride;
            uint16_t *k_scale = i8 ? (uint16_t *)k_scales + scale_at : NULL;
            uint16_t *v_scale = i8 ? (uint16_t *)v_scales + scale_at : NULL;
            rotate(load_row(qkv, k_at + h * D, D, qkv_bf16, x), c, s, rotated, D);
            store_kv(rotated, k_slot + h * head_bytes, k_scale, D, kv_mode);
            void *v_dst = v_slot + h * head_bytes;
            if (!i8 && kv_bf16 == qkv_bf16) /* the same dtype: a plain copy */
                memcpy(v_dst, (const char *)qkv + (v_at + h * D) * q_elem, (size_t)(D * elem));
            else
                store_kv(load_row(qkv, v_at + h * D, D, qkv_bf16, x), v_dst, v_scale, D, kv_mode);
        }
    }
    return 0;
}
