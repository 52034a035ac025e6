/* Two elementwise steps of the decoder layer that PyTorch runs as many small ops.

   add_rms_norm: the residual add and the RMS norm after it, in one pass per token:

       h += delta                      (the residual stream; skipped when delta is NULL)
       out = h / sqrt(mean(h^2) + eps) * weight

   PyTorch's CPU rms_norm is a dozen small ops (pow, mean, rsqrt, two muls, and casts for
   bfloat16), and the add before it one more: in a decode step of 8 tokens, 61 norms cost more
   in dispatch than in arithmetic. Arithmetic is float32; a bfloat16 model's h is rounded to
   bfloat16 after the add (as `h + delta` in bfloat16 would be) and its out once at the end.

   silu_mul: the MLP's activation, silu(gate) * up, from the stacked gate_up projection.

   Layouts (contiguous, all of one dtype: float32, or bfloat16 when `bf16`): h, delta, out
   (T, H); weight (H,); gate_up (T, 2 I), gate first; act (T, I).
*/
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

#define ALWAYS_INLINE static inline __attribute__((always_inline))

ALWAYS_INLINE float get(const void *p, int64_t i, int bf16)
{
    return bf16 ? bf16_to_float(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

ALWAYS_INLINE void put(void *p, int64_t i, float x, int bf16)
{
    if (bf16) ((uint16_t *)p)[i] = float_to_bf16(x);
    else ((float *)p)[i] = x;
}

/* One token's row: two passes over it (it stays in L1 between them). */
ALWAYS_INLINE void norm_row(void *h, const void *delta, const void *weight, void *out,
                            int64_t t, int64_t H, float eps, int bf16)
{
    float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
    for (int64_t i = 0; i < H; i++) {
        float x = get(h, t * H + i, bf16);
        if (delta != NULL) {
            put(h, t * H + i, x + get(delta, t * H + i, bf16), bf16);
            x = get(h, t * H + i, bf16); /* what the stream holds (bfloat16: rounded) */
        }
        squares += x * x;
    }
    const float inv = 1.0f / sqrtf(squares / (float)H + eps);
#pragma omp simd
    for (int64_t i = 0; i < H; i++)
        put(out, t * H + i, get(h, t * H + i, bf16) * inv * get(weight, i, bf16), bf16);
}

int add_rms_norm(void *h, const void *delta, const void *weight, void *out, int64_t num_tokens,
                 int64_t hidden, float eps, int bf16, int num_threads)
{
    /* Threads only when there is enough work to pay for waking them (a prefill chunk). The
       dtype goes in as a literal, so each loop compiles for one element type and vectorises. */
#pragma omp parallel for num_threads(num_threads) if (num_tokens >= 64)
    for (int64_t t = 0; t < num_tokens; t++) {
        if (bf16) norm_row(h, delta, weight, out, t, hidden, eps, 1);
        else norm_row(h, delta, weight, out, t, hidden, eps, 0);
    }
    return 0;
}

ALWAYS_INLINE void silu_mul_row(const void *gate_up, void *act, int64_t t, int64_t inter,
                                const int bf16)
{
    const int64_t gate = t * 2 * inter, up = gate + inter;
#pragma omp simd
    for (int64_t i = 0; i < inter; i++) {
        const float x = get(gate_up, gate + i, bf16);
        put(act, t * inter + i, x / (1.0f + expf(-x)) * get(gate_up, up + i, bf16), bf16);
    }
}

int silu_mul(const void *gate_up, void *act, int64_t num_tokens, int64_t inter, int bf16,
             int num_threads)
{
#pragma omp parallel for num_threads(num_threads) if (num_tokens >= 16)
    for (int64_t t = 0; t < num_tokens; t++) {
        if (bf16) silu_mul_row(gate_up, act, t, inter, 1);
        else silu_mul_row(gate_up, act, t, inter, 0);
    }
    return 0;
}
