/* The bfloat16 model's part of decode_attention.c's literal builds (see decode_task.h): Q K^T,
   and the shared runs' P V, in bfloat16 dot products (AVX512-BF16); an empty unit in builds
   without them, whose kv_mode 2 runs as kv_mode 1. */
#include "decode_task.h"

#if HAS_BF16_DOTS
void decode_task_dots(const Batch *b, const KeySource *src, int64_t u, int64_t seg,
                      int64_t head, int64_t D)
{
    if (D == 64) run_task(b, src, u, seg, head, 64, KV_BF16, 1, 1);
    else if (D == 128) run_task(b, src, u, seg, head, 128, KV_BF16, 1, 1);
    else run_task(b, src, u, seg, head, D, KV_BF16, 1, 0);
}
#endif
