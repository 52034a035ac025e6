/* bfloat16 <-> float32 for the kernels: a bfloat16 is the top 16 bits of a float32. */
#ifndef RADIXLM_BF16_H
#define RADIXLM_BF16_H

#include <stdint.h>
#include <string.h>

static inline __attribute__((always_inline)) float bf16_to_float(uint16_t x)
{
    const uint32_t bits = (uint32_t)x << 16;
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

/* Rounded to nearest even, as PyTorch's cast does (finite inputs). */
static inline __attribute__((always_inline)) uint16_t float_to_bf16(float x)
{
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    return (uint16_t)((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
}

#endif /* RADIXLM_BF16_H */
