/* The bfloat16-pool part of decode_attention.c's literal builds (see decode_task.h): kv_mode 1,
   float32 arithmetic over bfloat16 K/V; kv_mode 2 (a bfloat16 model, bfloat16 dot products
   where the build has them) is built in decode_attention_dots.c. */
#include "decode_task.h"

void decode_task_bf16(const Batch *b, const KeySource *src, int64_t u, int64_t seg,
                      int64_t head, int64_t D, int kv_mode)
{
    if (kv_mode == 2 && HAS_BF16_DOTS) decode_task_dots(b, src, u, seg, head, D);
    else if (D == 64) run_task(b, src, u, seg, head, 64, KV_BF16, 0, 1);
    else if (D == 128) run_task(b, src, u, seg, head, 128, KV_BF16, 0, 1);
    else run_task(b, src, u, seg, head, D, KV_BF16, 0, 0);
}
