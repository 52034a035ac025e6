/* The quantized kernels' record layout, shared by the matmuls (quant_linear.c) and the load-time
   repacker (quant_repack.c): quant/layout.py draws it and holds both to it in the tests. */
#ifndef RADIXLM_QUANT_RECORD_H
#define RADIXLM_QUANT_RECORD_H

#include <stdint.h>
#include <string.h>

#define GROUP 8  /* outputs (columns) per record */
#define BLOCK 32 /* inputs per record */

static inline int64_t scale_bytes(int sub, int has_min, int kscale)
{
    if (kscale) return 16 + 8 * sub + (has_min ? 24 : 0); /* d, sc[sub], -dmin, mc */
    return 16 * sub + (has_min ? 16 : 0);                  /* scales[sub], mins: fp16 */
}

static inline int64_t record_bytes(int bits, int sub, int has_min, int kscale)
{
    return GROUP * BLOCK * bits / 8 + scale_bytes(sub, has_min, kscale);
}

/* Where column j's input k lies in a record's values: the byte, and 4 for a high nibble. */
static inline void position(int bits, int fast, int j, int k, int *byte, int *shift)
{
    *shift = 0;
    if (fast) {
        const int s = k / 4, pos = 4 * j + k % 4;
        if (bits == 8) *byte = 32 * s + pos;
        else *byte = 32 * (s / 2) + pos, *shift = 4 * (s % 2);
        return;
    }
    const int s = k / 2, lane = 2 * j + k % 2;
    if (bits == 8) {
        *byte = 16 * s + lane;
        return;
    }
    const int chunk = s / 4, u = s % 4, high_nibble = u / 2, unpack_high = u % 2;
    int within;
    if (!unpack_high) within = lane < 8 ? lane : lane + 8;
    else within = lane < 8 ? lane + 8 : lane + 16;
    *byte = 32 * chunk + within;
    *shift = 4 * high_nibble;
}

/* IEEE half -> float32 (finite values and zeros; GGUF scales are never inf or NaN). */
static inline float half_to_float(uint16_t h)
{
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
    uint32_t bits;
    if (exp == 0 && man == 0) {
        bits = sign;
    } else if (exp == 0) { /* subnormal: normalize */
        int e = -1;
        uint32_t m = man;
        do {
            e++;
            m <<= 1;
        } while ((m & 0x400) == 0);
        bits = sign | ((uint32_t)(112 - e) << 23) | ((m & 0x3FF) << 13);
    } else {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

#endif /* RADIXLM_QUANT_RECORD_H */
