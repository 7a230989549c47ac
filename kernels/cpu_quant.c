/* Linear layers over weights kept in their GGUF block format (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 here;
 * the K-quants and F16, BF16 in cpu_kquant.c; the layouts are in shared/model/quant.py), for
 * kvmesh's CPU path (kernels/cpu_bindings.py, CpuOps.quant_linear).
 *
 * Why: a decode step reads every weight once, so bytes per weight is the speed. A Q4_1 weight is
 * 5 bits a value against float32's 32. The activations are quantized too, as llama.cpp does: each
 * block of 32 values of a row to int8 with one float scale dx = max|x| / 127 (q = x / dx rounded
 * half to even), and the block's sum of q; a block's dot product is then an integer one:
 *
 *   Q8_0: dw dx sum(qw qx)      Q4_0: dw dx (sum(qw qx) - 8 sum(qx))      Q4_1: dw dx sum(qw qx) + mw dx sum(qx)
 *   Q5_0, Q5_1: as Q4_0 (with 16 for 8) and Q4_1, their values' fifth bits or-ed in from qh
 *
 * With AVX-512 VNNI, vpdpbusd multiplies 64 unsigned by 64 signed bytes and sums each 4 into an
 * int32: a pair of blocks per instruction. Q4 nibbles are unsigned already; Q8_0 takes |qw| and
 * moves qw's sign onto qx (llama.cpp's trick). Each int32 lane is scaled by its block's dw dx in
 * float and summed; the sum(qx) terms are folded in by lanes too (the activation rows carry, per
 * pair of blocks, dx and dx sum(qx) / 8 spread over each block's 8 lanes). Where the compiler
 * targets no AVX-512 VNNI, AVX2 (vpmaddubsw, vpmaddwd; with FMA and F16C) or else a scalar loop
 * computes the same integer sums: the instruction set is the build's (-march=native on the
 * machine that runs it, cpu_ops.py; tests build the others with -march=haswell and x86-64).
 *
 * Activation rows (kv_quantize_rows): xq (rows, k) int8 and xs (rows, qk_scale_stride(k)) float:
 * for pair p of blocks, xs[p * 32 + 0 .. 16) the dx of blocks 2p (lanes 0-7) and 2p + 1 (8-15),
 * xs[p * 32 + 16 .. 32) their dx sum(qx) / 8; zero for a missing last block.
 *
 * Paired Q4 layout (KV_PAIRED | format; shared/model/quant.py's pair_blocks, made at load where
 * the VNNI path is built, kv_quant_pairs()): each pair of blocks 2p, 2p + 1 of a row (A, B) is
 * stored as its scales dA, dB (and mA, mB for Q4_1), then 32 bytes whose byte j holds A's value
 * j in its low nibble and B's value j in its high one; a last unpaired block stays as it was.
 * The same bytes per row; one 32-byte load, two masks and one insert give the 64 values in x's
 * order, where the GGUF layout takes two loads, an insert and a cross-lane shuffle. The values
 * and scales are the same, so the results are bit for bit those of the GGUF layout.
 *
 * Interleaved groups (KV_PAIRED too, the same pair_blocks; Q5_0, Q5_1 and Q8_0 as well): a
 * paired weight's rows in whole groups of QG = 16 are stored block by block with the group's 16
 * rows side by side (qgroup below: one vpdpbusd lane per weight row); only the Q4 rows left
 * over are in pairs (Q5's and Q8_0's: the GGUF layout).
 *
 * Threads split the output features at whole groups of QG: thread t of nt computes the columns
 * of groups [G t / nt, G (t + 1) / nt) of y for every row of x, reading its share of the weight
 * once per block of x rows.
 *
 * A stacked weight (KV_STACKED, shared/model/quant.py's StackedWeight: a fused projection whose
 * row ranges come in different formats, as a Q4_K_M file's q, k (Q4_K) and v (Q6_K)) passes a
 * kv_wstack descriptor for w: each part's columns of y are computed by its own format's kernel.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_kernels.h"
#include "cpu_vec.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define QK_VNNI 1
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define QK_AVX2 1
#include <immintrin.h>
#endif

#ifdef _OPENMP
#include <omp.h>
#else
static inline int omp_get_thread_num(void) { return 0; }
static inline int omp_get_num_threads(void) { return 1; }
#endif

#define XMB 64      /* rows of x per cache block: its int8 rows stay in L2 while weights pass */
#define KV_PAIRED 16 /* or-ed into a Q4 format code: the paired layout (PAIRED_FLAG) */
#define KV_FIRST_KQ 3 /* codes 3 .. 7: Q4_K, Q5_K, Q6_K, F16, BF16 (cpu_kquant.c) */
#define KV_LAST_KQ 7
#define KV_F16_CODE 6
#define KV_BF16_CODE 7
#define KV_STACKED 32 /* STACKED_CODE: w is a kv_wstack */
#define KV_STACK_PARTS 4 /* MAX_STACKED_PARTS */

/* A stacked weight's parts, in row order: format code, rows, address of its (rows, row bytes) */
typedef struct {
    int64_t count;
    int64_t fmt[KV_STACK_PARTS];
    int64_t rows[KV_STACK_PARTS];
    int64_t data[KV_STACK_PARTS];
} kv_wstack;


/* where a block's values start, and (Q5) its fifth bits */
static inline int qs_offset(int fmt) {
    return fmt == KV_Q4_0 ? 2 : fmt == KV_Q4_1 ? 4 : fmt == KV_Q5_0 ? 6 : 8;
}
static inline int qh_offset(int fmt) { return fmt == KV_Q5_0 ? 2 : 4; }
static inline int has_min(int fmt) { return fmt == KV_Q4_1 || fmt == KV_Q5_1; }
static inline int is_q5(int fmt) { return fmt == KV_Q5_0 || fmt == KV_Q5_1; }

int64_t qk_scale_stride(int64_t k) { return (k / QB + 1) / 2 * 32; }

/* 1 where the kernels read the paired Q4 layout (the VNNI build), 0 where they do not */
int64_t kv_quant_pairs(void) {
#ifdef QK_VNNI
    return 1;
#else
    return 0;
#endif
}

float kv_f16_to_f32(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else { /* subnormal: renormalise */
            exp = 127 - 15 + 1;
            while (!(man & 0x400)) {
                man <<= 1;
                exp--;
            }
            bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000 | (man << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* Rows [r0, r1) of x (rows, k) quantized into xq and xs (layout above). */
void kv_quantize_rows(const float *x, int64_t r0, int64_t r1, int64_t k, int8_t *xq, float *xs) {
    int64_t nb = k / QB, stride = qk_scale_stride(k);
    for (int64_t r = r0; r < r1; r++) {
        float *srow = xs + r * stride;
        memset(srow, 0, stride * sizeof(float));
        for (int64_t b = 0; b < nb; b++) {
            const float *v = x + r * k + b * QB;
            int8_t *q = xq + r * k + b * QB;
            float amax = 0.0f;
            for (int i = 0; i < QB; i++) amax = fmaxf(amax, fabsf(v[i]));
            float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
            int32_t sum = 0;
            for (int i = 0; i < QB; i++) {
                int32_t qi = (int32_t)nearbyintf(v[i] * id); /* halves to even, as torch.round */
                qi = qi > 127 ? 127 : qi < -127 ? -127 : qi;
                q[i] = (int8_t)qi;
                sum += qi;
            }
            float *lanes = srow + (b / 2) * 32 + (b % 2) * 8;
            for (int i = 0; i < 8; i++) {
                lanes[i] = d;
                lanes[16 + i] = d * (float)sum / 8.0f;
            }
        }
    }
}

#ifdef QK_VNNI
/* The pair of blocks p of one weight row as 64 bytes in the order of x's values, and its scales:
 * dw (and mw for Q4_1) of block 2p in lanes 0-7, of 2p + 1 in lanes 8-15. has_b: 2p + 1 exists. */
static inline __attribute__((always_inline)) __m512i load_pair(int fmt, int paired,
                                                              const uint8_t *a, int has_b,
                                                              __m512 *dw, __m512 *mw) {
    const int64_t bb = block_bytes[fmt];
    if (paired && has_b) { /* dA dB (mA mB), then A | B << 4 */
        uint64_t s8 = 0;
        memcpy(&s8, a, fmt == KV_Q4_1 ? 8 : 4);
        const __m512i pidx = _mm512_set_epi16(3, 3, 3, 3, 3, 3, 3, 3, 2, 2, 2, 2, 2, 2, 2, 2, 1, 1,
                                              1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
        __m512i halves = _mm512_permutexvar_epi16(
            pidx, _mm512_castsi128_si512(_mm_cvtsi64_si128((long long)s8)));
        *dw = _mm512_cvtph_ps(_mm512_castsi512_si256(halves));
        if (fmt == KV_Q4_1) *mw = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(halves, 1));
        __m256i ab = _mm256_loadu_si256((const __m256i *)(a + (fmt == KV_Q4_1 ? 8 : 4)));
        const __m256i low = _mm256_set1_epi8(0x0f);
        __m256i lo = _mm256_and_si256(ab, low);
        __m256i hi = _mm256_and_si256(_mm256_srli_epi16(ab, 4), low);
        return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
    }
    const uint8_t *b = a + bb;
    uint32_t sa, sb = 0;
    memcpy(&sa, a, 4);
    if (has_b) memcpy(&sb, b, 4);
    /* halves dA, mA, dB, mB -> 32 halves: dA x8, dB x8, mA x8, mB x8 */
    const __m512i idx = _mm512_set_epi16(3, 3, 3, 3, 3, 3, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2,
                                         2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0);
    __m512i halves = _mm512_permutexvar_epi16(
        idx, _mm512_castsi128_si512(_mm_set_epi32(0, 0, (int)sb, (int)sa)));
    *dw = _mm512_cvtph_ps(_mm512_castsi512_si256(halves));
    if (fmt == KV_Q8_0) {
        __m256i qa = _mm256_loadu_si256((const __m256i *)(a + 2));
        __m256i qb = has_b ? _mm256_loadu_si256((const __m256i *)(b + 2)) : _mm256_setzero_si256();
        return _mm512_inserti64x4(_mm512_castsi256_si512(qa), qb, 1);
    }
    if (has_min(fmt)) *mw = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(halves, 1));
    const int off = qs_offset(fmt);
    __m128i qa = _mm_loadu_si128((const __m128i *)(a + off));
    __m128i qb = has_b ? _mm_loadu_si128((const __m128i *)(b + off)) : _mm_setzero_si128();
    __m256i ab = _mm256_inserti128_si256(_mm256_castsi128_si256(qa), qb, 1);
    const __m256i low = _mm256_set1_epi8(0x0f);
    __m256i lo = _mm256_and_si256(ab, low), hi = _mm256_and_si256(_mm256_srli_epi16(ab, 4), low);
    /* [A lo, B lo, A hi, B hi] -> [A lo, A hi, B lo, B hi] */
    __m512i z = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
    z = _mm512_shuffle_i64x2(z, z, _MM_SHUFFLE(3, 1, 2, 0));
    if (is_q5(fmt)) { /* bit j of qh: value j's 16 */
        uint32_t ha, hb = 0;
        memcpy(&ha, a + qh_offset(fmt), 4);
        if (has_b) memcpy(&hb, b + qh_offset(fmt), 4);
        __mmask64 fifth = (__mmask64)ha | (__mmask64)hb << 32;
        z = _mm512_mask_add_epi8(z, fifth, z, _mm512_set1_epi8(16));
    }
    return z;
}

/* Rows of a paired weight in whole groups of QG (the first rows / QG * QG), interleaved: for
 * each block b, its 16 rows' dw (float16, 32 bytes), for Q4_1, Q5_1 their mw (32 bytes), then chunks
 * of 64 bytes, chunk i's bytes 4c .. 4c + 4 being row c's value bytes 4i .. 4i + 4: Q4's 4 chunks
 * of nibble bytes (values 4i + j in the low nibbles, 16 + 4i + j in the high ones; Q5: after 8
 * masks of 64 bits, mask j's bit 4c + t the fifth bit of row c's value 4j + t), Q8_0's 8 of
 * q + 128 (q xor 0x80: unsigned, as vpdpbusd takes its first operand; the 128 sum(qx) that adds
 * is taken off in int32). A chunk's values are one vpdpbusd operand holding 4 values of each of
 * the 16 rows, against x's 4 values broadcast: one int32 lane per weight row, so a block's 16
 * dot products take 8 vpdpbusd and at most 12 unpacking instructions, and its scales one
 * conversion and one or two multiply-adds per row of x for all 16 rows (a third of the
 * instructions per weight byte of the pairs' tiles below). xsum: Q8_0's sum(qx) per row of x
 * and block (NULL for Q4). */
static inline __attribute__((always_inline)) void qgroups(int fmt, int NG, const int8_t *xq,
                                                         const float *xs, const int32_t *xsum,
                                                         int64_t k, const uint8_t *const *gs,
                                                         int R, __m512 out[2][4]) {
    const int64_t nb = k / QB, xss = qk_scale_stride(k), gb = QG * block_bytes[fmt];
    const int head = has_min(fmt) ? 64 : 32, bits = head + (is_q5(fmt) ? 64 : 0);
    const __m512i low = _mm512_set1_epi8(0x0f);
    __m512 acc[2][4], macc[2][4];
    for (int gi = 0; gi < NG; gi++)
        for (int r = 0; r < R; r++) acc[gi][r] = macc[gi][r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m512 dw[2], mw[2];
        __m512i wv[2][8]; /* wv[gi][j]: values 4j .. 4j + 4 of each row of group gi */
        for (int gi = 0; gi < NG; gi++) {
            const uint8_t *blk = gs[gi] + b * gb;
            dw[gi] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)blk));
            if (fmt == KV_Q8_0) {
                for (int j = 0; j < 8; j++) wv[gi][j] = _mm512_loadu_si512(blk + head + 64 * j);
                continue;
            }
            mw[gi] = has_min(fmt)
                         ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 32)))
                         : _mm512_mul_ps(dw[gi], _mm512_set1_ps(fmt == KV_Q4_0 ? -8.0f : -16.0f));
            for (int i = 0; i < 4; i++) {
                __m512i p = _mm512_loadu_si512(blk + bits + 64 * i);
                wv[gi][i] = _mm512_and_si512(p, low);
                wv[gi][i + 4] = _mm512_and_si512(_mm512_srli_epi16(p, 4), low);
            }
            if (is_q5(fmt)) /* the fifth bits of wv[j]'s bytes: a 64-bit mask each */
                for (int j = 0; j < 8; j++) {
                    __mmask64 h;
                    memcpy(&h, blk + head + 8 * j, 8);
                    wv[gi][j] = _mm512_mask_add_epi8(wv[gi][j], h, wv[gi][j], _mm512_set1_epi8(16));
                }
        }
        for (int r = 0; r < R; r++) {
            const float *lanes = xs + r * xss + (b / 2) * 32 + (b % 2) * 8;
            int32_t xv[8];
            memcpy(xv, xq + r * k + b * QB, sizeof xv);
            for (int gi = 0; gi < NG; gi++) {
                __m512i s0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv[gi][0],
                                                 _mm512_set1_epi32(xv[0]));
                __m512i s1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv[gi][1],
                                                 _mm512_set1_epi32(xv[1]));
                for (int j = 2; j < 8; j += 2) {
                    s0 = _mm512_dpbusd_epi32(s0, wv[gi][j], _mm512_set1_epi32(xv[j]));
                    s1 = _mm512_dpbusd_epi32(s1, wv[gi][j + 1], _mm512_set1_epi32(xv[j + 1]));
                }
                __m512i isum = _mm512_add_epi32(s0, s1);
                if (fmt == KV_Q8_0)
                    isum = _mm512_sub_epi32(isum, _mm512_set1_epi32(128 * xsum[r * nb + b]));
                __m512 dot = _mm512_cvtepi32_ps(isum);
                acc[gi][r] = _mm512_fmadd_ps(dot, _mm512_mul_ps(dw[gi], _mm512_set1_ps(lanes[0])),
                                             acc[gi][r]);
                if (fmt != KV_Q8_0)
                    macc[gi][r] = _mm512_fmadd_ps(mw[gi], _mm512_set1_ps(lanes[16] * 8.0f),
                                                  macc[gi][r]);
            }
        }
    }
    for (int gi = 0; gi < NG; gi++)
        for (int r = 0; r < R; r++)
            out[gi][r] = fmt == KV_Q8_0 ? acc[gi][r] : _mm512_add_ps(acc[gi][r], macc[gi][r]);
}

#define QG_SUMS 4096 /* xsum entries kept on the stack (more: malloc) */

/* Columns [c0, c1) of y for m rows of x from the groups of a paired weight that hold them (a
 * group cut by c0 or c1 is computed whole and stored in part) */
/* out's R rows (x's rows from r) into the columns of group g that [c0, c1) holds, plus bias */
static inline void store_group(const __m512 *out, int R, int64_t r, int64_t g, int64_t c0,
                               int64_t c1, const float *bias, float *y, int64_t n,
                               int accumulate) {
    const int64_t lo = g * QG > c0 ? g * QG : c0, hi = (g + 1) * QG < c1 ? (g + 1) * QG : c1;
    const __mmask16 keep = (__mmask16)(((1u << (hi - lo)) - 1) << (lo - g * QG));
    const __m512 bv = bias ? _mm512_maskz_loadu_ps(keep, bias + g * QG) : _mm512_setzero_ps();
    for (int i = 0; i < R; i++) {
        float *yr = y + (r + i) * n + g * QG;
        __m512 v = _mm512_add_ps(out[i], bv);
        if (accumulate) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(keep, yr));
        _mm512_mask_storeu_ps(yr, keep, v);
    }
}

/* NG groups (gs) against R rows of x from row r: each format's qgroups, with NG and R
 * constants where they are given as such */
#define QGROUPS_CALL(NG, R, r)                                                                     \
    switch (fmt) {                                                                                 \
    case KV_Q4_1: qgroups(KV_Q4_1, NG, xq + (r) * k, xs + (r) * xss, NULL, k, gs, R, out); break;  \
    case KV_Q4_0: qgroups(KV_Q4_0, NG, xq + (r) * k, xs + (r) * xss, NULL, k, gs, R, out); break;  \
    case KV_Q5_1: qgroups(KV_Q5_1, NG, xq + (r) * k, xs + (r) * xss, NULL, k, gs, R, out); break;  \
    case KV_Q5_0: qgroups(KV_Q5_0, NG, xq + (r) * k, xs + (r) * xss, NULL, k, gs, R, out); break;  \
    default: qgroups(KV_Q8_0, NG, xq + (r) * k, xs + (r) * xss, xsum + (r) * nb, k, gs, R, out);   \
    }

/* Columns [c0, c1) of y for m rows of x from the groups of a paired weight that hold them (a
 * group cut by c0 or c1 is computed whole and stored in part). A decode step's one or two rows
 * take two groups at a time, one from each half of the range: two streams from memory in flight
 * instead of one (kv_linear_rows' runs, pair_row's panels), the same sums in the same order. */
static void qk_groups(int fmt, const int8_t *xq, const float *xs, int64_t m, int64_t k,
                      const uint8_t *w, int64_t c0, int64_t c1, const float *bias, float *y,
                      int64_t n, int accumulate) {
    const int64_t nb = k / QB, gbytes = QG * nb * block_bytes[fmt], xss = qk_scale_stride(k);
    int32_t stack[QG_SUMS], *xsum = NULL;
    if (fmt == KV_Q8_0) { /* sum(qx) back from dx sum(qx) / 8: exact, |sum| < 2^12 */
        xsum = m * nb <= QG_SUMS ? stack : malloc(m * nb * sizeof *xsum);
        if (!xsum) return; /* cannot happen at the sizes a step has */
        for (int64_t r = 0; r < m; r++)
            for (int64_t b = 0; b < nb; b++) {
                const float *lanes = xs + r * xss + (b / 2) * 32 + (b % 2) * 8;
                xsum[r * nb + b] =
                    lanes[0] != 0.0f ? (int32_t)nearbyintf(lanes[16] * 8.0f / lanes[0]) : 0;
            }
    }
    const int64_t g0 = c0 / QG, g1 = (c1 + QG - 1) / QG, half = m <= 2 ? (g1 - g0) / 2 : 0;
    for (int64_t i = 0; i < half; i++) { /* groups g0 + i and g0 + half + i */
        const uint8_t *gs[2] = {w + (g0 + i) * gbytes, w + (g0 + half + i) * gbytes};
        __m512 out[2][4];
        if (m == 1) {
            QGROUPS_CALL(2, 1, 0)
        } else {
            QGROUPS_CALL(2, 2, 0)
        }
        store_group(out[0], (int)m, 0, g0 + i, c0, c1, bias, y, n, accumulate);
        store_group(out[1], (int)m, 0, g0 + half + i, c0, c1, bias, y, n, accumulate);
    }
    for (int64_t g = g0 + 2 * half; g < g1; g++) {
        for (int64_t r = 0; r < m; r += 4) {
            const int R = m - r < 4 ? (int)(m - r) : 4;
            const uint8_t *gs[1] = {w + g * gbytes};
            __m512 out[2][4];
            QGROUPS_CALL(1, R, r)
            store_group(out[0], R, r, g, c0, c1, bias, y, n, accumulate);
        }
    }
    if (xsum != stack) free(xsum);
}

/* out[r][c] = row r of x (R rows, R <= 4) . weight row c (C rows, C <= 4), before bias */
static inline __attribute__((always_inline)) void qtile(int fmt, int paired, const int8_t *xq,
                                                       const float *xs, int64_t k,
                                                       const uint8_t *w, int64_t rb, int R,
                                                       int C, float out[4][4]) {
    const int64_t nb = k / QB, np = (nb + 1) / 2, xss = qk_scale_stride(k), bb = block_bytes[fmt];
    __m512 acc[4][4];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) acc[r][c] = _mm512_setzero_ps();
    for (int64_t p = 0; p < np; p++) {
        const int has_b = 2 * p + 1 < nb;
        __m512i wv[4];
        __m512 dw[4], mw[4];
        __mmask64 neg[4];
        for (int c = 0; c < C; c++) {
            wv[c] = load_pair(fmt, paired, w + c * rb + 2 * p * bb, has_b, &dw[c], &mw[c]);
            if (fmt == KV_Q8_0) {
                neg[c] = _mm512_movepi8_mask(wv[c]);
                wv[c] = _mm512_abs_epi8(wv[c]);
            } else if (fmt == KV_Q4_0 || fmt == KV_Q5_0) {
                mw[c] = _mm512_mul_ps(dw[c], _mm512_set1_ps(fmt == KV_Q4_0 ? -8.0f : -16.0f));
            }
        }
        for (int r = 0; r < R; r++) {
            const int8_t *xr = xq + r * k + p * 64;
            __m512i xv = has_b ? _mm512_loadu_si512(xr)
                               : _mm512_maskz_loadu_epi8(0xffffffffULL, xr);
            __m512 dx = _mm512_loadu_ps(xs + r * xss + p * 32);
            __m512 sx = _mm512_loadu_ps(xs + r * xss + p * 32 + 16);
            for (int c = 0; c < C; c++) {
                __m512i xs8 = fmt == KV_Q8_0
                                  ? _mm512_mask_sub_epi8(xv, neg[c], _mm512_setzero_si512(), xv)
                                  : xv;
                __m512i dp = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv[c], xs8);
                acc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dp), _mm512_mul_ps(dw[c], dx),
                                            acc[r][c]);
                if (fmt != KV_Q8_0) acc[r][c] = _mm512_fmadd_ps(mw[c], sx, acc[r][c]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) out[r][c] = _mm512_reduce_add_ps(acc[r][c]);
}
#elif defined(QK_AVX2)
/* AVX2 (with FMA, F16C), a block of 32 at a time, GGUF layout only (kv_quant_pairs() is 0 here):
 * vpmaddubsw multiplies unsigned weight bytes by signed activation bytes and sums pairs into
 * int16 (Q8_0: |qw| with qw's sign moved onto qx, at most 2 * 128 * 127: no saturation),
 * vpmaddwd sums pairs of those into 8 int32 lanes; the lanes are scaled by dw dx in float and the
 * min terms (Q4) summed aside. */
static inline __attribute__((always_inline)) void qtile(int fmt, int paired, const int8_t *xq,
                                                       const float *xs, int64_t k,
                                                       const uint8_t *w, int64_t rb, int R,
                                                       int C, float out[4][4]) {
    (void)paired;
    const int64_t nb = k / QB, xss = qk_scale_stride(k), bb = block_bytes[fmt];
    const __m256i ones = _mm256_set1_epi16(1);
    const __m128i low4 = _mm_set1_epi8(0x0f);
    __m256 acc[4][4];
    float macc[4][4];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) acc[r][c] = _mm256_setzero_ps(), macc[r][c] = 0.0f;
    for (int64_t b = 0; b < nb; b++) {
        __m256i wv[4];
        float dw[4], mw[4];
        for (int c = 0; c < C; c++) {
            const uint8_t *blk = w + c * rb + b * bb;
            uint16_t h;
            memcpy(&h, blk, 2);
            dw[c] = _cvtsh_ss(h);
            if (fmt == KV_Q8_0) {
                wv[c] = _mm256_loadu_si256((const __m256i *)(blk + 2));
                mw[c] = 0.0f;
                continue;
            }
            __m128i qs = _mm_loadu_si128((const __m128i *)(blk + qs_offset(fmt)));
            __m128i lo = _mm_and_si128(qs, low4);
            __m128i hi = _mm_and_si128(_mm_srli_epi16(qs, 4), low4);
            wv[c] = _mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1);
            if (is_q5(fmt)) { /* byte j gets bit j of qh: 16 where it is set */
                uint32_t qh;
                memcpy(&qh, blk + qh_offset(fmt), 4);
                const __m256i spread = _mm256_set_epi64x(0x0303030303030303LL, 0x0202020202020202LL,
                                                         0x0101010101010101LL, 0);
                const __m256i bits = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
                __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)qh), spread);
                v = _mm256_cmpeq_epi8(_mm256_and_si256(v, bits), bits);
                wv[c] = _mm256_or_si256(wv[c], _mm256_and_si256(v, _mm256_set1_epi8(16)));
            }
            if (has_min(fmt)) {
                memcpy(&h, blk + 2, 2);
                mw[c] = _cvtsh_ss(h);
            } else {
                mw[c] = (fmt == KV_Q4_0 ? -8.0f : -16.0f) * dw[c];
            }
        }
        for (int r = 0; r < R; r++) {
            __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + r * k + b * QB));
            const float *lanes = xs + r * xss + (b / 2) * 32 + (b % 2) * 8;
            float dx = lanes[0], sx = lanes[16] * 8.0f;
            for (int c = 0; c < C; c++) {
                __m256i a = wv[c], xs8 = xv;
                if (fmt == KV_Q8_0) {
                    xs8 = _mm256_sign_epi8(xv, a);
                    a = _mm256_abs_epi8(a);
                } else {
                    macc[r][c] += mw[c] * sx;
                }
                __m256i dp = _mm256_madd_epi16(_mm256_maddubs_epi16(a, xs8), ones);
                acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dp), _mm256_set1_ps(dw[c] * dx),
                                            acc[r][c]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) out[r][c] = kv_hsum8(acc[r][c]) + macc[r][c];
}
#else
/* The scalar definition: integer sums per block, then the block's float terms (GGUF layout only:
 * kv_quant_pairs() is 0 here, so no weight is paired for this build). */
static inline void qtile(int fmt, int paired, const int8_t *xq, const float *xs, int64_t k, const uint8_t *w,
                         int64_t rb, int R, int C, float out[4][4]) {
    const int64_t nb = k / QB, xss = qk_scale_stride(k), bb = block_bytes[fmt];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) {
            float acc = 0.0f;
            for (int64_t b = 0; b < nb; b++) {
                const uint8_t *blk = w + c * rb + b * bb;
                const int8_t *qx = xq + r * k + b * QB;
                const float *lanes = xs + r * xss + (b / 2) * 32 + (b % 2) * 8;
                float dx = lanes[0], sx = lanes[16] * 8.0f, dw = kv_f16_to_f32(blk);
                int32_t isum = 0;
                if (fmt == KV_Q8_0) {
                    const int8_t *qw = (const int8_t *)(blk + 2);
                    for (int i = 0; i < QB; i++) isum += qw[i] * qx[i];
                    acc += dw * dx * (float)isum;
                } else {
                    const uint8_t *qs = blk + qs_offset(fmt);
                    uint32_t qh = 0;
                    if (is_q5(fmt)) memcpy(&qh, blk + qh_offset(fmt), 4);
                    for (int i = 0; i < QB / 2; i++) {
                        int lo = (qs[i] & 0x0f) | (int)((qh >> i & 1) << 4);
                        int hi = (qs[i] >> 4) | (int)((qh >> (i + QB / 2) & 1) << 4);
                        isum += lo * qx[i] + hi * qx[i + QB / 2];
                    }
                    float mw = has_min(fmt)          ? kv_f16_to_f32(blk + 2)
                               : fmt == KV_Q4_0 ? -8.0f * dw
                                                : -16.0f * dw;
                    acc += dw * dx * (float)isum + mw * sx;
                }
            }
            out[r][c] = acc;
        }
}
#endif

/* R rows of x against weight rows [c0, c1): C_MAIN at a time, then one by one */
#define QK_ROWS(FMT, PAIRED, R, C_MAIN)                                                               \
    do {                                                                                           \
        float out[4][4];                                                                           \
        int64_t c = c0;                                                                            \
        for (; c + C_MAIN <= c1; c += C_MAIN) {                                                    \
            qtile(FMT, PAIRED, xq, xs, k, w + c * rb, rb, R, C_MAIN, out);                         \
            kv_store_tile(out, R, C_MAIN, bias ? bias + c : NULL, y + c, n, accumulate);           \
        }                                                                                          \
        for (; c < c1; c++) {                                                                      \
            qtile(FMT, PAIRED, xq, xs, k, w + c * rb, rb, R, 1, out);                              \
            kv_store_tile(out, R, 1, bias ? bias + c : NULL, y + c, n, accumulate);                \
        }                                                                                          \
    } while (0)

#define QK_FORMAT_BODY(FMT, PAIRED)                                                                 \
    switch (R) {                                                                                   \
    case 4: QK_ROWS(FMT, PAIRED, 4, 2); break;                                                     \
    case 3: QK_ROWS(FMT, PAIRED, 3, 2); break;                                                     \
    case 2: QK_ROWS(FMT, PAIRED, 2, 4); break;                                                     \
    default: QK_ROWS(FMT, PAIRED, 1, 4); break;                                                    \
    }

/* R (<= 4) rows of quantized x times weight rows [c0, c1) into y's columns [c0, c1) */
static void qk_rows(int fmt, const int8_t *xq, const float *xs, int R, int64_t k,
                    const uint8_t *w, int64_t rb, int64_t c0, int64_t c1, const float *bias,
                    float *y, int64_t n, int accumulate) {
    switch (fmt) {
    case KV_Q8_0: QK_FORMAT_BODY(KV_Q8_0, 0) break;
    case KV_Q4_0: QK_FORMAT_BODY(KV_Q4_0, 0) break;
    case KV_Q4_1: QK_FORMAT_BODY(KV_Q4_1, 0) break;
    case KV_Q5_0: QK_FORMAT_BODY(KV_Q5_0, 0) break;
    case KV_Q5_1: QK_FORMAT_BODY(KV_Q5_1, 0) break;
#ifdef QK_VNNI
    case KV_Q4_0 | KV_PAIRED: QK_FORMAT_BODY(KV_Q4_0, 1) break;
    default: QK_FORMAT_BODY(KV_Q4_1, 1) break;
#else
    default: break; /* no paired weight reaches this build (kv_quant_pairs) */
#endif
    }
}

/* Columns [c0, c1) of y (m, n) = x @ w.T (+ bias) for every row: w's rows (wrows of them) from 0
 * (a stacked weight: each part's rows from its first), bias and y's columns indexed alike. */
static void qlinear_cols(const float *x, const int8_t *xq, const float *xs, int64_t m, int64_t k,
                         int fmt, const uint8_t *w, int64_t wrows, int64_t c0, int64_t c1,
                         const float *bias, float *y, int64_t n, int accumulate) {
    if (fmt == KV_STACKED) {
        const kv_wstack *s = (const kv_wstack *)w;
        int64_t base = 0;
        for (int64_t i = 0; i < s->count; i++) {
            int64_t lo = c0 > base ? c0 : base, end = base + s->rows[i];
            int64_t hi = c1 < end ? c1 : end;
            const uint8_t *part = (const uint8_t *)(uintptr_t)s->data[i];
            if (lo < hi)
                qlinear_cols(x, xq, xs, m, k, (int)s->fmt[i], part, s->rows[i], lo - base,
                             hi - base, bias ? bias + base : NULL, y + base, n, accumulate);
            base = end;
        }
        return;
    }
    if (fmt >= KV_FIRST_KQ && fmt <= KV_LAST_KQ) {
        kv_kq_cols(x, xq, xs, m, k, fmt, w, c0, c1, bias, y, n, accumulate);
        return;
    }
    const int64_t rb = k / QB * block_bytes[fmt & ~KV_PAIRED], xss = qk_scale_stride(k);
#ifdef QK_VNNI
    if (fmt & KV_PAIRED) { /* the rows in whole groups interleaved, the rest in pairs */
        const int64_t grouped = wrows / QG * QG;
        if (c0 < grouped)
            qk_groups(fmt & ~KV_PAIRED, xq, xs, m, k, w, c0, c1 < grouped ? c1 : grouped, bias, y,
                      n, accumulate);
        if (c1 <= grouped) return;
        c0 = c0 > grouped ? c0 : grouped;
        const int base = fmt & ~KV_PAIRED; /* Q8_0's and Q5's other rows: the GGUF layout */
        if (base == KV_Q8_0 || is_q5(base)) fmt = base;
    }
#endif
    /* weight rows in runs of 16 against the whole block of x rows: both stay in cache */
    KV_FOR_ROW_TILES(m, c0, c1, XMB,
                     qk_rows(fmt, xq + r * k, xs + r * xss, R, k, w, rb, cb, ce, bias, y + r * n,
                             n, accumulate));
}

/* Thread t of nt's share of y (m, n) = x (m, k) @ w.T (+ bias): columns [n t / nt, n (t+1) / nt).
 * x given as floats (read for F16 and BF16 weights) and quantized (kv_quantize_rows; read for
 * the block formats); w (n, k) in format fmt, rows back to back, or a kv_wstack (KV_STACKED).
 * accumulate: y += instead (a residual add). */
void kv_qlinear_share(const float *x, const int8_t *xq, const float *xs, int64_t m, int64_t k,
                      int fmt, const uint8_t *w, int64_t n, const float *bias, float *y,
                      int64_t t, int64_t nt, int accumulate) {
    /* cut at whole groups of QG columns (a paired weight's interleaved rows) */
    const int64_t groups = (n + QG - 1) / QG, c0 = groups * t / nt * QG;
    const int64_t c1 = t + 1 == nt ? n : groups * (t + 1) / nt * QG;
    qlinear_cols(x, xq, xs, m, k, fmt, w, n, c0 < n ? c0 : n, c1 < n ? c1 : n, bias, y, n,
                 accumulate);
}

/* y (m, n) = x (m, k) @ w.T (+ bias) on num_threads OpenMP threads; xq (m, k) and xs
 * (m, qk_scale_stride(k)): room for x quantized (not written for an F16 or BF16 weight). */
void kv_qlinear(const float *x, int64_t m, int64_t k, int fmt, const uint8_t *w, int64_t n,
                const float *bias, float *y, int8_t *xq, float *xs, int64_t num_threads) {
    if (num_threads < 1) num_threads = 1;
    const int is_float = fmt == KV_F16_CODE || fmt == KV_BF16_CODE;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
    {
        int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
        if (!is_float) kv_quantize_rows(x, m * t / nt, m * (t + 1) / nt, k, xq, xs);
#pragma omp barrier
        kv_qlinear_share(x, xq, xs, m, k, fmt, w, n, bias, y, t, nt, 0);
    }
}
