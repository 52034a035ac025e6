/* The quantized kernels' record layout, shared by the matmuls (quant_linear.c) and the load-time
   repacker (quant_repack.c): quant/layout.py draws it and holds both to it in the tests. */
#ifndef RADIXLM_QUANT_RECORD_H
#define RADIXLM_QUANT_RECORD_H

#include <stdint.h>
#include <string.h>

#define GROUP 8  /* outputs (columns) per record */
#define BLOCK 32 /* inputs per record */
#define SUPER 8  /* records per K-type super-block (256 inputs), which shares one d and -dmin */

/* A group's records follow each other. The K types' (kscale) come SUPER at a time after their
   super-block's factors, d (8 fp16) then -dmin (8 fp16, where has_min), one per column:
       [ factors ] [ record b ] .. [ record b + 7 ]   for b = 0, 8, 16, ...
   so d and dmin stream once per 256 inputs, as in the file; the f16 types have no factors. */
static inline int64_t factor_bytes(int has_min, int kscale)
{
    return kscale ? 16 + (has_min ? 16 : 0) : 0;
}

static inline int64_t scale_bytes(int sub, int has_min, int kscale)
{
    if (kscale) return 8 * sub + (has_min ? 8 : 0); /* sc[sub], mc: int8 */
    return 16 * sub + (has_min ? 16 : 0);          /* scales[sub], mins: fp16 */
}

static inline int64_t record_bytes(int bits, int sub, int has_min, int kscale)
{
    return GROUP * BLOCK * bits / 8 + scale_bytes(sub, has_min, kscale);
}

/* The bytes of one group's nb records (and its factors): a K type's nb is a multiple of SUPER. */
static inline int64_t group_bytes(int64_t nb, int bits, int sub, int has_min, int kscale)
{
    return nb * record_bytes(bits, sub, has_min, kscale) +
           (kscale ? nb / SUPER * factor_bytes(has_min, kscale) : 0);
}

/* Record b of a group whose bytes start at wg, and (K types) its super-block's factors. */
static inline const uint8_t *record_at(const uint8_t *wg, int64_t b, int64_t rec, int64_t fb)
{
    return wg + b * rec + (fb ? (b / SUPER + 1) * fb : 0);
}

static inline const uint8_t *factors_at(const uint8_t *wg, int64_t b, int64_t rec, int64_t fb)
{
    return wg + b / SUPER * (SUPER * rec + fb);
}

/* A record's values take 4, 5, 6 or 8 bits. 4, 5 and 6 share the nibble layout below: the low
   4 bits of every value, then for 5 and 6 a plane of their high bits (32 or 64 bytes), so a
   5-bit Q5_K value or a 6-bit Q6_K one streams in 5/8 or 6/8 of a byte. Q6_K's are stored + 32
   (0..63) and mean stored - 32; Q5_K's are 0..31; 8-bit values are int8. */
static inline int nibble_bits(int bits) { return bits == 4 || bits == 5 || bits == 6; }

/* Where column j's input k lies in a record's values: the byte, and 4 for a high nibble (the
   nibble layout for 4, 5 and 6 bits). */
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

/* The high bits of the nibble at (byte, shift), for a value of `bits` > 4: the nibbles form 8
   byte vectors e = 2 * (byte / 32) + shift / 4 of 32 lanes (lane = byte % 32), and the
   plane holds vector e's h = bits - 4 high bits at plane byte 32 * (e * h / 8) + lane, bit
   (e * h) % 8: one 32-byte vector of planes covers 8 / h nibble vectors, lane for lane. */
static inline void plane_position(int bits, int byte, int shift, int *plane_byte, int *bit)
{
    const int h = bits - 4, e = 2 * (byte / 32) + shift / 4;
    *plane_byte = 128 + 32 * (e * h / 8) + byte % 32;
    *bit = (e * h) % 8;
}

/* Column j's input k of a record's values q, as the integer it means. */
static inline int record_value(const uint8_t *q, int bits, int fast, int j, int k)
{
    int byte, shift;
    position(bits, fast, j, k, &byte, &shift);
    const int raw = (q[byte] >> shift) & (bits == 8 ? 0xFF : 0x0F);
    if (bits == 8) return (int8_t)raw;
    if (bits == 4) return raw;
    int plane_byte, bit;
    plane_position(bits, byte, shift, &plane_byte, &bit);
    const int high = (q[plane_byte] >> bit) & ((1 << (bits - 4)) - 1);
    const int v = raw | (high << 4);
    return bits == 6 ? v - 32 : v;
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
