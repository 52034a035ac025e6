/* A whole decode step through the decoder layers in one call.

   A decode step of 8 tokens runs ~270 kernel calls (4 matmuls, 2 norms, rope + K/V store,
   attention and SiLU per layer): each one is microseconds of work, and from Python each also
   pays for the module call, a ctypes call, output tensors and dtype casts, a sizable share of a
   bfloat16 step (docs/kernels.md). Here the layer loop runs in C, calling the
   same kernels in the same order with the same arguments, so the results are bit for bit those
   of the Python loop (CausalLM.forward); what goes is the glue.

   Per layer l (x: the normed input, h: the residual stream, updated in place):
       qkv = x Wqkv                    skinny_linear
       q = rope(q); K/V -> pool        rope_store
       o = attention(q, pool)          decode_attention (float32 queries and output, as
                                       Kernels.decode takes them; cast to the model's dtype)
       h += o Wo; x = norm(h)          skinny_linear, add_rms_norm
       a = silu(x Wg) * (x Wu)         skinny_linear, silu_mul
       h += a Wd; x = next norm(h)     skinny_linear, add_rms_norm (the next layer's input norm,
                                       or the final norm after the last layer)

   Quantized models (`quant`): each matmul's address is instead a descriptor (int64s, built by
   backend.FusedDecode): fast, number of parts, then per part its records, outputs, first
   output, bits, scales per 32 inputs, mins, the scales' form (k or f16); the rows are
   quantized once per matmul (quantize_rows) and every part multiplied (quant_matmul), as
   Kernels.quant_linear does.

   Layouts: h, x (B, hidden) in the model's dtype (float32, or bfloat16 when `bf16`); weights
   (num_layers, 6) addresses: input norm weight, packed Wqkv, packed Wo, post-attention norm
   weight, packed Wgate_up, packed Wdown (pack_skinny's layout); kv (num_layers, 4) addresses
   of each layer's K and V pool views (num_slots, KV, D), strided by slot_stride and
   head_stride (the same for every layer), and of its K and V scales (num_slots, KV), strided
   by scales_slot_stride and scales_head_stride (an int8 pool, kv_mode 3 or 4; 0 otherwise);
   final_norm (hidden,); cos, sin (B, D) float32; out_slots (B,); the decode layout as
   decode_attention takes it. kv_mode as decode_attention takes it; rope_store takes the same.
*/
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"

int add_rms_norm(void *h, const void *delta, const void *weight, void *out, int64_t num_tokens,
                 int64_t hidden, float eps, int bf16, int num_threads);
int skinny_linear(const void *x, const void *wp, void *y, int64_t M, int64_t N, int64_t K,
                  int bf16, int num_threads);
int rope_store(const void *qkv, int64_t num_tokens, int64_t row_stride, int64_t num_heads,
               int64_t num_kv_heads, int64_t head_dim, int64_t slot_stride, int64_t head_stride,
               const float *cos, const float *sin,
               const int64_t *out_slots, void *k, void *v, void *k_scales, void *v_scales,
               int64_t scales_slot_stride, int64_t scales_head_stride, int kv_mode, int qkv_bf16,
               void *q_out, int num_threads);
int decode_attention(const float *q, const void *k, const void *v, const void *k_scales,
                     const void *v_scales, float *out, int64_t num_heads, int64_t num_kv_heads,
                     int64_t head_dim, int64_t slot_stride, int64_t head_stride,
                     int64_t scales_slot_stride, int64_t scales_head_stride, int kv_mode,
                     float scale, int64_t num_units, const int64_t *units, const int64_t *shared,
                     const int64_t *own, const int64_t *member_row, const int64_t *slots,
                     int num_threads);
int silu_mul(const void *gate_up, void *act, int64_t num_tokens, int64_t inter, int bf16,
             int num_threads);
int quantize_rows(const void *x, int64_t M, int64_t K, int32_t bf16, int32_t fast, void *xq,
                  float *sx, float *sxb, int32_t num_threads);
int quant_matmul(const void *xq, const float *sx, const float *sxb, int64_t M, int64_t K,
                 int32_t fast, const uint8_t *w, int64_t N, int32_t bits, int32_t sub,
                 int32_t has_min, int32_t kscale, void *y, int64_t y_stride, int32_t y_bf16,
                 int32_t num_threads);

/* Scratch for quantized rows: up to B x K inputs. */
typedef struct {
    void *xq;
    float *sx, *sxb;
} QuantRows;

enum { D_FAST, D_PARTS, D_HEAD }; /* a descriptor's header; then per part: */
enum { P_RECORDS, P_N, P_START, P_BITS, P_SUB, P_HAS_MIN, P_KSCALE, P_SIZE };

/* y (B, N) = x (B, K) W^T for W packed for skinny_linear, or described by a quant descriptor. */
static int linear(const void *x, const int64_t *w, void *y, int64_t B, int64_t N, int64_t K,
                  int bf16, int quant, QuantRows *rows, int num_threads)
{
    if (!quant) return skinny_linear(x, (const void *)w, y, B, N, K, bf16, num_threads);
    const int fast = (int)w[D_FAST];
    int status = quantize_rows(x, B, K, bf16, fast, rows->xq, rows->sx, rows->sxb, num_threads);
    const int64_t elem = bf16 ? 2 : 4;
    for (int64_t p = 0; status == 0 && p < w[D_PARTS]; p++) {
        const int64_t *part = w + D_HEAD + p * P_SIZE;
        status = quant_matmul(rows->xq, rows->sx, rows->sxb, B, K, fast,
                              (const uint8_t *)part[P_RECORDS], part[P_N], (int32_t)part[P_BITS],
                              (int32_t)part[P_SUB], (int32_t)part[P_HAS_MIN],
                              (int32_t)part[P_KSCALE], (char *)y + part[P_START] * elem, N, bf16,
                              num_threads);
    }
    return status;
}

enum { IN_NORM, QKV, O, POST_NORM, GATE_UP, DOWN, PER_LAYER }; /* the weights' columns */

/* n elements between float32 and the model's dtype (a plain copy for float32). */
static void to_float(const void *src, float *dst, int64_t n, int bf16)
{
    for (int64_t i = 0; i < n; i++)
        dst[i] = bf16 ? bf16_to_float(((const uint16_t *)src)[i]) : ((const float *)src)[i];
}

static void from_float(const float *src, void *dst, int64_t n, int bf16)
{
    for (int64_t i = 0; i < n; i++) {
        if (bf16) ((uint16_t *)dst)[i] = float_to_bf16(src[i]);
        else ((float *)dst)[i] = src[i];
    }
}

/* Nonzero statuses: 1-9 from the kernels (as they return them), 100 out of memory. */
#define CHECK(call)                                                                              \
    do {                                                                                         \
        status = (call);                                                                         \
        if (status != 0) goto done;                                                              \
    } while (0)

int decode_layers(void *h, void *x, const int64_t *layers, const int64_t *kv,
                  int64_t slot_stride, int64_t head_stride, int64_t scales_slot_stride,
                  int64_t scales_head_stride, const void *final_norm, int64_t num_layers, int64_t B, int64_t hidden,
                  int64_t num_heads,
                  int64_t num_kv_heads, int64_t head_dim, int64_t inter, float eps, int bf16,
                  int kv_mode, float scale, const float *cos, const float *sin,
                  const int64_t *out_slots, int64_t num_units, const int64_t *units,
                  const int64_t *shared, const int64_t *own, const int64_t *member_row,
                  const int64_t *slots, int quant, int num_threads)
{
    const int64_t elem = bf16 ? 2 : 4, q_size = num_heads * head_dim;
    const int64_t qkv_size = q_size + 2 * num_kv_heads * head_dim;
    /* Scratch: qkv, q (model dtype), q32, o32 (float32), o, delta, gate_up, act (model dtype) */
    char *qkv = malloc((size_t)(B * (qkv_size + q_size + hidden + 3 * inter) * elem));
    float *q32 = malloc((size_t)(2 * B * q_size) * sizeof(float));
    const int64_t widest = inter > q_size ? (inter > hidden ? inter : hidden)
                                          : (q_size > hidden ? q_size : hidden);
    QuantRows rows = {NULL, NULL, NULL};
    if (quant) {
        rows.xq = malloc((size_t)(B * widest * 2));
        rows.sx = malloc((size_t)(B * widest / 32 + 1) * sizeof(float));
        rows.sxb = malloc((size_t)(B * widest / 32 + 1) * sizeof(float));
    }
    int status = 0;
    if (qkv == NULL || q32 == NULL || (quant && (!rows.xq || !rows.sx || !rows.sxb))) {
        status = 100;
        goto done;
    }
    char *q = qkv + B * qkv_size * elem, *delta = q + B * q_size * elem;
    char *gate_up = delta + B * hidden * elem, *act = gate_up + 2 * B * inter * elem;
    char *o = q; /* q is spent by the time o is written */
    float *o32 = q32 + B * q_size;
    CHECK(add_rms_norm(h, NULL, (const void *)layers[IN_NORM], x, B, hidden, eps, bf16,
                       num_threads));
    for (int64_t l = 0; l < num_layers; l++) {
        const int64_t *w = layers + l * PER_LAYER;
        void *k = (void *)kv[4 * l], *v = (void *)kv[4 * l + 1];
        void *k_scales = (void *)kv[4 * l + 2], *v_scales = (void *)kv[4 * l + 3];
        CHECK(linear(x, (const int64_t *)w[QKV], qkv, B, qkv_size, hidden, bf16, quant, &rows,
                     num_threads));
        CHECK(rope_store(qkv, B, qkv_size, num_heads, num_kv_heads, head_dim, slot_stride,
                         head_stride, cos, sin, out_slots, k, v, k_scales, v_scales,
                         scales_slot_stride, scales_head_stride, kv_mode, bf16, q, num_threads));
        to_float(q, q32, B * q_size, bf16);
        CHECK(decode_attention(q32, k, v, k_scales, v_scales, o32, num_heads, num_kv_heads,
                               head_dim, slot_stride, head_stride, scales_slot_stride,
                               scales_head_stride, kv_mode, scale, num_units, units, shared,
                               own, member_row, slots, num_threads));
        from_float(o32, o, B * q_size, bf16);
        CHECK(linear(o, (const int64_t *)w[O], delta, B, hidden, q_size, bf16, quant, &rows,
                     num_threads));
        CHECK(add_rms_norm(h, delta, (const void *)w[POST_NORM], x, B, hidden, eps, bf16,
                           num_threads));
        CHECK(linear(x, (const int64_t *)w[GATE_UP], gate_up, B, 2 * inter, hidden, bf16, quant,
                     &rows, num_threads));
        CHECK(silu_mul(gate_up, act, B, inter, bf16, num_threads));
        CHECK(linear(act, (const int64_t *)w[DOWN], delta, B, hidden, inter, bf16, quant, &rows,
                     num_threads));
        const void *next_norm = l + 1 < num_layers ? (const void *)w[PER_LAYER + IN_NORM]
                                                   : final_norm;
        CHECK(add_rms_norm(h, delta, next_norm, x, B, hidden, eps, bf16, num_threads));
    }
done:
    free(rows.xq);
    free(rows.sx);
    free(rows.sxb);
    free(q32);
    free(qkv);
    return status;
}
