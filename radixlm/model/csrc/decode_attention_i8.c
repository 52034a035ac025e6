/* The int8-pool part of decode_attention.c's literal builds (see decode_task.h): kv_mode 3,
   int8 codes with a bfloat16 scale per row, float32 arithmetic whatever the model's dtype. */
#include "decode_task.h"

void decode_task_i8(const Batch *b, const KeySource *src, int64_t u, int64_t head, int64_t part,
                    int64_t D)
{
    if (D == 64) run_task(b, src, u, head, part, 64, KV_I8, 0, 1);
    else if (D == 128) run_task(b, src, u, head, part, 128, KV_I8, 0, 1);
    else run_task(b, src, u, head, part, D, KV_I8, 0, 0);
}
