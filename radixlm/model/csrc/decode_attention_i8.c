/* The int8-pool part of decode_attention.c's literal builds (see decode_task.h): int8 codes
   with a bfloat16 scale per row, float32 arithmetic (kv_mode 3); a bfloat16 model's (kv_mode
   4) row path takes Q K^T in bfloat16 dot products where the build has them (the codes are
   exact in bfloat16; the tiles stay float32). */
#include "decode_task.h"

void decode_task_i8(const Batch *b, const KeySource *src, int64_t u, int64_t seg,
                    int64_t head, int64_t D, int kv_mode)
{
#if HAS_BF16_DOTS
    if (kv_mode == 4 && D == 64) run_task(b, src, u, seg, head, 64, KV_I8, 1, 1);
    else if (kv_mode == 4 && D == 128) run_task(b, src, u, seg, head, 128, KV_I8, 1, 1);
    else
#endif
    if (D == 64) run_task(b, src, u, seg, head, 64, KV_I8, 0, 1);
    else if (D == 128) run_task(b, src, u, seg, head, 128, KV_I8, 0, 1);
    else run_task(b, src, u, seg, head, D, KV_I8, 0, 0);
}
