/* The vector width and register budget of the instruction set this file is compiled for, and
   the few vector helpers every kernel shares. One source, three builds (native_build.py):

     variant   flags                        VL   registers   used for
     avx512    -march=x86-64-v4 (+bf16)     16   32 zmm      CPUs with AVX-512
     avx2      -march=x86-64-v3              8   16 ymm      AVX2 + FMA
     generic   baseline (SSE2, NEON)         4   16 xmm      anything else

   Vectors are GCC vector extensions of VL floats, so the arithmetic is written once; the tile
   sizes that must fit the register file (rows x accumulators) are set per build below and in
   the kernels, never the AVX-512 ones split in two (GCC would split each 64-byte vector into
   halves and spill the tiles). Where one instruction does what the generic form takes three
   for, the AVX-512 and AVX2 forms are spelled out. */
#ifndef RADIXLM_SIMD_H
#define RADIXLM_SIMD_H

#include <stdint.h>
#include <string.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
#define VL 16
#define ISA_NAME "avx512"
#elif defined(__AVX2__) && defined(__FMA__)
#define VL 8
#define ISA_NAME "avx2"
#else
#define VL 4
#define ISA_NAME "generic"
#endif

#define ALWAYS_INLINE static inline __attribute__((always_inline))

typedef float vf __attribute__((vector_size(VL * 4)));
typedef int32_t vi __attribute__((vector_size(VL * 4)));
typedef uint32_t vu __attribute__((vector_size(VL * 4)));
typedef uint16_t vh __attribute__((vector_size(VL * 2))); /* VL bfloat16 */

ALWAYS_INLINE vf loadv(const float *p)
{
    vf x;
    memcpy(&x, p, sizeof x);
    return x;
}

ALWAYS_INLINE void storev(float *p, vf x) { memcpy(p, &x, sizeof x); }

ALWAYS_INLINE vf splat(float x) { return (vf){0} + x; }

/* VL bfloat16 at p widened to float32 (a bfloat16 is the top half of a float32). */
ALWAYS_INLINE vf load_bf16v(const uint16_t *p)
{
    vh half;
    memcpy(&half, p, sizeof half);
    return (vf)(__builtin_convertvector(half, vu) << 16);
}

/* VL int8 at p converted to float32: a sign extension and a conversion (vpmovsxbd, vcvtdq2ps)
   on AVX-512 and AVX2, where GCC's generic vector conversion goes element by element. */
ALWAYS_INLINE vf load_i8v(const int8_t *p)
{
#if defined(__AVX512F__)
    return (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
#elif defined(__AVX2__)
    return (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
#else
    typedef int8_t vc __attribute__((vector_size(VL))); /* VL int8 */
    vc codes;
    memcpy(&codes, p, sizeof codes);
    return __builtin_convertvector(codes, vf);
#endif
}

/* Lane indices 0 .. VL-1. */
ALWAYS_INLINE vi iota(void)
{
    vi x;
    for (int i = 0; i < VL; i++) x[i] = i;
    return x;
}

#if defined(__AVX512F__)
ALWAYS_INLINE vf maxv(vf a, vf b) { return (vf)_mm512_max_ps((__m512)a, (__m512)b); }
ALWAYS_INLINE vf where_below(vi lanes, int32_t end, vf a, vf b) /* a where lane < end */
{
    const __mmask16 k = _mm512_cmplt_epi32_mask((__m512i)lanes, _mm512_set1_epi32(end));
    return (vf)_mm512_mask_blend_ps(k, (__m512)b, (__m512)a);
}
ALWAYS_INLINE int any_above(vf x, float bound) /* 1 when some lane of x exceeds bound */
{
    return _mm512_cmp_ps_mask((__m512)x, _mm512_set1_ps(bound), _CMP_GT_OQ) != 0;
}
#else
ALWAYS_INLINE vf selectv(vi mask, vf a, vf b) /* a where mask, else b */
{
    return (vf)(((vi)a & mask) | ((vi)b & ~mask));
}
ALWAYS_INLINE vf maxv(vf a, vf b) { return selectv(a > b, a, b); }
ALWAYS_INLINE vf where_below(vi lanes, int32_t end, vf a, vf b)
{
    return selectv(lanes < end, a, b);
}
ALWAYS_INLINE int any_above(vf x, float bound)
{
#if defined(__AVX2__)
    return _mm256_movemask_ps(_mm256_cmp_ps((__m256)x, _mm256_set1_ps(bound), _CMP_GT_OQ)) != 0;
#else
    const vi above = x > bound;
    int any = 0;
    for (int i = 0; i < VL; i++) any |= above[i];
    return any != 0;
#endif
}
#endif

/* Lane i against lane i ^ half, for half = VL/2 .. 1: the fold of a horizontal max or sum. */
#if VL == 16
#define FOLD_MASKS                                                                             \
    {(vi){8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7},                               \
     (vi){4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11},                               \
     (vi){2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13},                               \
     (vi){1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14}}
#define FOLDS 4
#define TREE_LO                                                                                \
    {(vi){0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23},                             \
     (vi){0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27},                           \
     (vi){0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29},                           \
     (vi){0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30}}
#define TREE_BITREV (vi){0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15}
#elif VL == 8
#define FOLD_MASKS                                                                             \
    {(vi){4, 5, 6, 7, 0, 1, 2, 3}, (vi){2, 3, 0, 1, 6, 7, 4, 5}, (vi){1, 0, 3, 2, 5, 4, 7, 6}}
#define FOLDS 3
#define TREE_LO                                                                                \
    {(vi){0, 1, 2, 3, 8, 9, 10, 11}, (vi){0, 1, 8, 9, 4, 5, 12, 13},                           \
     (vi){0, 8, 2, 10, 4, 12, 6, 14}}
#define TREE_BITREV (vi){0, 4, 2, 6, 1, 5, 3, 7}
#else
#define FOLD_MASKS {(vi){2, 3, 0, 1}, (vi){1, 0, 3, 2}}
#define FOLDS 2
#define TREE_LO {(vi){0, 1, 4, 5}, (vi){0, 4, 2, 6}}
#define TREE_BITREV (vi){0, 2, 1, 3}
#endif

ALWAYS_INLINE float hmax(vf x)
{
    const vi masks[FOLDS] = FOLD_MASKS;
    for (int f = 0; f < FOLDS; f++) x = maxv(x, __builtin_shuffle(x, masks[f]));
    return x[0];
}

ALWAYS_INLINE float hsum(vf x)
{
    const vi masks[FOLDS] = FOLD_MASKS;
    for (int f = 0; f < FOLDS; f++) x += __builtin_shuffle(x, masks[f]);
    return x[0];
}

/* The horizontal sums of VL vectors as one vector, lane j the sum of x[j]'s lanes: a tree of
   VL - 1 folds instead of VL horizontal sums. A fold of a and b at width w adds each block of
   2w lanes' halves, a's into the first w lanes and b's into the next w (two two-source
   shuffles and an add; TREE_LO picks the low halves, the high ones are w lanes further), so
   each level halves the vectors and the width. The sums come out in bit-reversed order, put
   back by one permute. x is overwritten. */
ALWAYS_INLINE vf sums_of(vf x[VL])
{
    const vi lo[FOLDS] = TREE_LO;
    int n = VL, w = VL / 2;
    for (int f = 0; f < FOLDS; f++, n /= 2, w /= 2)
        for (int j = 0; j < n / 2; j++)
            x[j] = __builtin_shuffle(x[2 * j], x[2 * j + 1], lo[f]) +
                   __builtin_shuffle(x[2 * j], x[2 * j + 1], lo[f] + w);
    return __builtin_shuffle(x[0], TREE_BITREV);
}

/* 2^t. Scores are kept in log2 units (the kernels fold log2(e) into the softmax scale): t = n
   + f with n the nearest integer, |f| <= 1/2, 2^f by a degree-5 polynomial (a relative-error
   fit, ~2e-7 evaluated in float32), times 2^n. AVX-512 rounds and scales in one instruction
   each (vrndscaleps, vscalefps: 2^-1e30 is 0); elsewhere t is clamped at -125 and 2^n is added
   to the exponent bits, leaving ~1e-38 for 0: negligible next to the row maximum's 2^0 = 1. */
ALWAYS_INLINE vf exp2v(vf t)
{
#if defined(__AVX512F__)
    const vf n = (vf)_mm512_roundscale_ps((__m512)t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#elif defined(__AVX2__)
    t = maxv(t, splat(-125.0f));
    const vf n = (vf)_mm256_round_ps((__m256)t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const vi ni = __builtin_convertvector(n, vi);
#else
    t = maxv(t, splat(-125.0f));
    const vi ni = __builtin_convertvector(t + selectv(t < 0, splat(-0.5f), splat(0.5f)), vi);
    const vf n = __builtin_convertvector(ni, vf);
#endif
    const vf f = t - n;
    vf p = 1.32774445e-3f * f + 9.67588369e-3f;
    p = p * f + 5.55071309e-2f;
    p = p * f + 2.40221128e-1f;
    p = p * f + 6.93146944e-1f;
    p = p * f + 1.00000012f;
#if defined(__AVX512F__)
    return (vf)_mm512_scalef_ps((__m512)p, (__m512)n);
#else
    return (vf)((vi)p + (ni << 23));
#endif
}

/* exp2v of one number. */
ALWAYS_INLINE float exp2_1(float t) { return exp2v(splat(t))[0]; }

#endif /* RADIXLM_SIMD_H */
