/* GGUF block bytes -> the quantized kernels' records, in one pass at load.

   The Python path (quant/blocks.py decodes, quant/layout.py packs) is the reference and says
   what a record holds; this is the same transformation without numpy's intermediate arrays,
   so a multi-gigabyte file loads at memory speed. Each thread takes whole groups of 8 output
   rows: for every block of 32 inputs it decodes the 8 rows' values and scales from ggml's
   block layouts (ggml-common.h) and writes one record (and, at a K type's super-block, the
   factors before its 8 records: quant_record.h). `row_order` (or NULL) names the file
   row each output row comes from (llama's q/k rows, un-permuted for our rope).

   qtype is ggml's type number: Q4_0 2, Q4_1 3, Q8_0 8, Q4_K 12, Q5_K 13, Q6_K 14. */
#include <stdint.h>
#include <string.h>
#include <omp.h>

#include "quant_record.h"

enum { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

/* float -> half bits, for values that are halves (checked by the caller: 1 if not exact). */
static int float_to_half_bits(float f, uint16_t *out)
{
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    const uint16_t sign = (uint16_t)((bits >> 16) & 0x8000);
    const int exp = (int)((bits >> 23) & 0xFF) - 127;
    const uint32_t man = bits & 0x7FFFFF;
    if ((bits & 0x7FFFFFFF) == 0) {
        *out = sign;
    } else if (exp >= -14 && exp <= 15) { /* normal */
        if (man & 0x1FFF) return 1;
        *out = (uint16_t)(sign | ((exp + 15) << 10) | (man >> 13));
    } else if (exp >= -24 && exp < -14) { /* subnormal */
        const uint32_t full = man | 0x800000;
        const int shift = -exp - 14 + 13;
        if (full & ((1u << shift) - 1)) return 1;
        *out = (uint16_t)(sign | (full >> shift));
    } else {
        return 1;
    }
    return half_to_float(*out) == f ? 0 : 1;
}

static uint16_t read_half(const uint8_t *p)
{
    uint16_t h;
    memcpy(&h, p, 2);
    return h;
}

/* The K types' 6-bit scale and min of sub-block j (0..7) from their 12 packed bytes. */
static void k_scale_min(const uint8_t *s, int j, int *sc, int *mc)
{
    if (j < 4) {
        *sc = s[j] & 63;
        *mc = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
        *mc = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

/* One row's block b as the kernels hold it: 32 values as their stored bits (a 4-bit value
   0..15, or an int8's byte), and the scale fields of that row's column of the record (f16
   form: scale[sub], min; k form: d, sc[sub], nd, mc). */
typedef struct {
    uint16_t scale, min; /* f16 form */
    uint16_t d, nd;      /* k form */
    int8_t sc[2], mc;
} RowScales;

/* Decodes row `row` (of cols inputs), block b, of a tensor of type qtype into v[0..32) and
   *sc. 1 if a Q4_0 min is not a half. */
static int decode_block(const uint8_t *raw, int qtype, int64_t row, int64_t cols, int64_t b,
                        uint8_t *v, RowScales *sc)
{
    if (qtype == Q4_0 || qtype == Q4_1 || qtype == Q8_0) {
        const int64_t size = qtype == Q4_0 ? 18 : qtype == Q4_1 ? 20 : 34;
        const uint8_t *blk = raw + (row * (cols / BLOCK) + b) * size;
        sc->scale = read_half(blk);
        if (qtype == Q8_0) {
            memcpy(v, blk + 2, BLOCK);
            return 0;
        }
        const uint8_t *qs = blk + (qtype == Q4_0 ? 2 : 4);
        for (int k = 0; k < 16; k++) {
            v[k] = qs[k] & 0x0F;
            v[k + 16] = qs[k] >> 4;
        }
        if (qtype == Q4_1) {
            sc->min = read_half(blk + 2);
            return 0;
        }
        return float_to_half_bits(-8.0f * half_to_float(sc->scale), &sc->min);
    }
    const int64_t super = b / 8; /* a super-block of 256 inputs; its sub-block j of 32 */
    const int j = (int)(b % 8);
    if (qtype == Q4_K || qtype == Q5_K) {
        const int64_t size = qtype == Q4_K ? 144 : 176;
        const uint8_t *blk = raw + (row * (cols / 256) + super) * size;
        sc->d = read_half(blk);
        sc->nd = read_half(blk + 2) ^ 0x8000; /* -dmin */
        int s, m;
        k_scale_min(blk + 4, j, &s, &m);
        sc->sc[0] = (int8_t)s;
        sc->mc = (int8_t)m;
        const uint8_t *qs = blk + (qtype == Q4_K ? 16 : 48) + 32 * (j / 2), *qh = blk + 16;
        const int shift = j % 2 ? 4 : 0;
        for (int l = 0; l < BLOCK; l++) v[l] = (qs[l] >> shift) & 0x0F;
        if (qtype == Q5_K)
            for (int l = 0; l < BLOCK; l++) v[l] |= (uint8_t)(((qh[l] >> j) & 1) << 4);
        return 0;
    }
    /* Q6_K: ql[128], qh[64], sc[16] int8 (per 16 inputs), d. Inputs 32 j .. 32 j + 31 are
       quarter j % 4 of half j / 4: low nibbles or high ones of 32 ql bytes, 2 bits of qh. */
    const uint8_t *blk = raw + (row * (cols / 256) + super) * 210;
    const int half = j / 4, quarter = j % 4;
    const uint8_t *ql = blk + 64 * half + (quarter % 2) * 32, *qh = blk + 128 + 32 * half;
    const int low_shift = quarter < 2 ? 0 : 4, high_shift = 2 * quarter;
    sc->d = read_half(blk + 208);
    sc->sc[0] = (int8_t)blk[192 + 2 * j];
    sc->sc[1] = (int8_t)blk[192 + 2 * j + 1];
    for (int l = 0; l < BLOCK; l++) {
        const int q = ((ql[l] >> low_shift) & 0x0F) | (((qh[l] >> high_shift) & 3) << 4);
        v[l] = (uint8_t)(int8_t)(q - 32);
    }
    return 0;
}

int repack_blocks(const uint8_t *raw, int32_t qtype, int64_t rows, int64_t cols,
                  const int64_t *row_order, int32_t fast, uint8_t *records, int32_t num_threads)
{
    const int known = qtype == Q4_0 || qtype == Q4_1 || qtype == Q8_0 || qtype == Q4_K ||
                      qtype == Q5_K || qtype == Q6_K;
    const int k_type = qtype == Q4_K || qtype == Q5_K || qtype == Q6_K;
    if (!known || rows % GROUP || cols % (k_type ? 256 : BLOCK)) return 1;
    const int bits = qtype == Q8_0 ? 8 : qtype == Q5_K ? 5 : qtype == Q6_K ? 6 : 4;
    const int sub = qtype == Q6_K ? 2 : 1, has_min = qtype != Q8_0 && qtype != Q6_K;
    const int64_t qbytes = GROUP * BLOCK * bits / 8, nb = cols / BLOCK;
    const int64_t rec = record_bytes(bits, sub, has_min, k_type);
    const int64_t fb = factor_bytes(has_min, k_type);
    const int64_t per_group = group_bytes(nb, bits, sub, has_min, k_type);
    /* per record byte: the value (column * 32 + input) its low bits come from, and where the
       type has 4-bit values, the one its high nibble comes from (layout.py's _sources) */
    int low_src[GROUP * BLOCK], high_src[GROUP * BLOCK];
    /* and for 5- and 6-bit values, the plane byte and bit of each value's high bits */
    int plane_byte[GROUP * BLOCK], plane_bit[GROUP * BLOCK];
    for (int j = 0; j < GROUP; j++)
        for (int k = 0; k < BLOCK; k++) {
            int byte, shift;
            position(bits, fast, j, k, &byte, &shift);
            if (shift) high_src[byte] = j * BLOCK + k;
            else low_src[byte] = j * BLOCK + k;
            if (bits == 5 || bits == 6)
                plane_position(bits, byte, shift, &plane_byte[j * BLOCK + k],
                               &plane_bit[j * BLOCK + k]);
        }
    int failed = 0;
#pragma omp parallel for num_threads(num_threads) schedule(static) reduction(| : failed)
    for (int64_t g = 0; g < rows / GROUP; g++) {
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *wg = records + g * per_group;
            uint8_t *r = wg + (record_at(wg, b, rec, fb) - wg), *s = r + qbytes;
            uint8_t *f = wg + (factors_at(wg, b, rec, fb) - wg); /* K types: d[8], -dmin[8] */
            const int first = k_type && b % SUPER == 0; /* writes its super-block's factors */
            uint8_t v[GROUP * BLOCK];
            memset(s, 0, (size_t)(rec - qbytes));
            for (int j = 0; j < GROUP; j++) {
                const int64_t out_row = g * GROUP + j;
                const int64_t row = row_order ? row_order[out_row] : out_row;
                RowScales rs = {0};
                failed |= decode_block(raw, qtype, row, cols, b, v + j * BLOCK, &rs);
                if (k_type) { /* sc[sub][8], mc[8]; the factors d[8] fp16, -dmin[8] fp16 */
                    for (int h = 0; h < sub; h++) s[8 * h + j] = (uint8_t)rs.sc[h];
                    if (has_min) s[8 * sub + j] = (uint8_t)rs.mc;
                    if (first) memcpy(f + 2 * j, &rs.d, 2);
                    if (first && has_min) memcpy(f + 16 + 2 * j, &rs.nd, 2);
                } else { /* scales[sub][8] fp16, mins[8] fp16 */
                    memcpy(s + 2 * j, &rs.scale, 2);
                    if (has_min) memcpy(s + 16 * sub + 2 * j, &rs.min, 2);
                }
            }
            if (bits == 6) /* stored + 32: 0..63 */
                for (int i = 0; i < GROUP * BLOCK; i++) v[i] = (uint8_t)((v[i] + 32) & 63);
            if (bits == 8) {
                for (int64_t i = 0; i < qbytes; i++) r[i] = v[low_src[i]];
            } else { /* nibbles, then the high bits' plane */
                for (int64_t i = 0; i < 128; i++)
                    r[i] = (uint8_t)((v[low_src[i]] & 0x0F) | ((v[high_src[i]] & 0x0F) << 4));
                if (bits > 4) {
                    memset(r + 128, 0, (size_t)(qbytes - 128));
                    for (int i = 0; i < GROUP * BLOCK; i++)
                        r[plane_byte[i]] |= (uint8_t)((v[i] >> 4) << plane_bit[i]);
                }
            }
        }
    }
    return failed ? 2 : 0;
}
