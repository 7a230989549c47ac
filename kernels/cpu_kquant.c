/* Linear layers over K-quant (Q4_K, Q5_K, Q6_K) and 2-byte float (F16, BF16) weights as stored
 * (the layouts are in shared/model/quant.py), called by kv_qlinear_share (cpu_quant.c) for
 * these formats: kv_kq_cols computes columns [c0, c1) of y = x w^T (+ bias) for every row of x.
 *
 * K-quants: the activations are the same int8 rows as for Q8_0 and Q4 (kv_quantize_rows: per
 * block of 32, dx = max|x| / 127), where llama.cpp quantizes them per super-block of 256
 * (Q8_K). A K-quant's scales change every 32 values (Q4_K, Q5_K) or 16 (Q6_K), so the int32
 * lanes of vpdpbusd (4 values each) are scaled by their sub-block's scale times their block's
 * dx in float, as the Q4 kernels do; the finer dx keeps more of x than one scale per 256 values,
 * and a decoder layer quantizes each input once whatever the formats of the weights reading it
 * (a Q4_K_M layer mixes Q4_K and Q6_K). Per pair of 32-value blocks (64 values, 16 lanes):
 *
 *   Q4_K, Q5_K: d sc[j] dx sum(q qx) - dmin m[j] dx sum(qx)      (q 0..15 or 0..31)
 *   Q6_K:       d sc[i] dx (sum(q qx) - 32 sum(qx))              (q 0..63, i: the 16 values)
 *
 * the sum(qx) terms from the activation rows' lanes (dx sum(qx) / 8 over 8 lanes, Q4_K and
 * Q5_K) or from vpdpbusd of ones by qx (per 4 values: Q6_K's scales cut a 32-block in two).
 * Each super-block's 8 (or 16) scales are unpacked once per weight row into one float vector and
 * spread over the lanes by vpermps.
 *
 * F16, BF16: x stays float32 (no rounding of the activations: a 2-byte weight is read for its
 * precision); each 16 values of a weight row are widened to float32 in registers (vcvtph2ps, or
 * a 16-bit shift for bfloat16) and multiplied in by FMA: the products are exact, only the order
 * of the sums differs from a float32 matmul over the dequantized weight. (vdpbf16ps would need x
 * rounded to bfloat16 too: half the FMAs, for a decode that waits on memory anyway.)
 *
 * Where the compiler targets no AVX-512 VNNI: AVX2 (with FMA and F16C) in 32-value steps
 * (vpmaddubsw, vpmaddwd), else a scalar loop, computing the same integer sums and float terms.
 * The instruction set is the build's (-march=native on the machine that runs it, cpu_ops.py).
 * Tiles, blocking and thread split as cpu_quant.c's.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_kernels.h"
#include "cpu_vec.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) &&                     \
    defined(__AVX512VNNI__)
#define KQ_VNNI 1
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define KQ_AVX2 1
#include <immintrin.h>
#endif

/* FORMAT_CODES of shared/model/quant_formats.py */
enum { KQ_Q4_K = 3, KQ_Q5_K = 4, KQ_Q6_K = 5, KQ_F16 = 6, KQ_BF16 = 7 };
#define KQ_SB 256 /* values per super-block */
#define KQ_XMB 64 /* rows of x per cache block */

static const int64_t kq_bytes[8] = {34, 18, 20, 144, 176, 210, 2, 2};
static const int64_t kq_values[8] = {32, 32, 32, 256, 256, 256, 1, 1};

int64_t kv_kq_row_bytes(int fmt, int64_t k) { return k / kq_values[fmt] * kq_bytes[fmt]; }

/* Q4_K's and Q5_K's 12 bytes -> 6-bit scales sc[8] and mins mn[8] (quant._k_scales) */
static __attribute__((unused)) void kq_k_scales(const uint8_t *s, int sc[8], int mn[8]) {
    for (int j = 0; j < 4; j++) {
        sc[j] = s[j] & 63;
        mn[j] = s[j + 4] & 63;
        sc[j + 4] = (s[j + 8] & 0x0f) | ((s[j] >> 6) << 4);
        mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4);
    }
}

/* super-block b's 256 stored integers (Q6_K: minus 32) */
static __attribute__((unused)) void kq_ints(int fmt, const uint8_t *b, int q[KQ_SB]) {
    if (fmt == KQ_Q6_K) {
        for (int h = 0; h < 2; h++)
            for (int s = 0; s < 4; s++)
                for (int i = 0; i < 32; i++) {
                    int lo = b[64 * h + 32 * (s % 2) + i] >> (4 * (s / 2)) & 0x0f;
                    int hi = b[128 + 32 * h + i] >> (2 * s) & 3;
                    q[128 * h + 32 * s + i] = (lo | hi << 4) - 32;
                }
        return;
    }
    const uint8_t *qs = b + (fmt == KQ_Q5_K ? 48 : 16);
    for (int j = 0; j < 8; j++)
        for (int i = 0; i < 32; i++) {
            int v = qs[32 * (j / 2) + i] >> (4 * (j % 2)) & 0x0f;
            if (fmt == KQ_Q5_K) v |= (b[16 + i] >> j & 1) << 4;
            q[32 * j + i] = v;
        }
}

static inline __attribute__((unused)) float kq_bf16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

#if defined(KQ_VNNI) || defined(KQ_AVX2)
static inline float kq_half(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}
#endif

#ifdef KQ_VNNI

/* One super-block's scales as 16 floats: Q4_K, Q5_K: d sc[0..8), then -dmin m[0..8);
 * Q6_K: d scales[0..16) */
static inline __attribute__((always_inline)) __m512 kq_scales(int fmt, const uint8_t *b) {
    if (fmt == KQ_Q6_K) {
        __m128i sc = _mm_loadu_si128((const __m128i *)(b + 192));
        __m512 s = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sc));
        return _mm512_mul_ps(s, _mm512_set1_ps(kq_half(b + 208)));
    }
    uint32_t u[4];
    memcpy(u, b + 4, 12);
    const uint32_t m1 = 0x3f3f3f3f, m2 = 0x0f0f0f0f, m3 = 0x03030303;
    u[3] = ((u[2] >> 4) & m2) | (((u[1] >> 6) & m3) << 4); /* m[4..8) */
    uint32_t mins_lo = u[1] & m1;                             /* m[0..4) */
    u[1] = (u[2] & m2) | (((u[0] >> 6) & m3) << 4);          /* sc[4..8) */
    u[2] = mins_lo;
    u[0] &= m1; /* sc[0..4) */
    __m512 s = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)u)));
    __m512 f = _mm512_mask_blend_ps(0xff00, _mm512_set1_ps(kq_half(b)),
                                    _mm512_set1_ps(-kq_half(b + 2)));
    return _mm512_mul_ps(s, f);
}

/* Values 64 q .. 64 q + 64 of a super-block as unsigned bytes in x's order */
static inline __attribute__((always_inline)) __m512i kq_load(int fmt, const uint8_t *b, int q) {
    const __m256i low4 = _mm256_set1_epi8(0x0f);
    if (fmt == KQ_Q6_K) {
        const int h = q / 2, s = q % 2;
        __m512i ql = _mm512_loadu_si512(b + 64 * h);
        if (s) ql = _mm512_srli_epi16(ql, 4);
        ql = _mm512_and_si512(ql, _mm512_set1_epi8(0x0f));
        __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h));
        const __m256i three = _mm256_set1_epi8(3);
        __m256i h0 = _mm256_and_si256(_mm256_srli_epi16(qh, 4 * s), three);
        __m256i h1 = _mm256_and_si256(_mm256_srli_epi16(qh, 4 * s + 2), three);
        __m512i hb = _mm512_inserti64x4(_mm512_castsi256_si512(h0), h1, 1);
        return _mm512_or_si512(ql, _mm512_slli_epi16(hb, 4));
    }
    const uint8_t *qs = b + (fmt == KQ_Q5_K ? 48 : 16) + 32 * q;
    __m256i v = _mm256_loadu_si256((const __m256i *)qs);
    __m256i lo = _mm256_and_si256(v, low4);
    __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
    if (fmt == KQ_Q5_K) {
        __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 16));
        const __m256i sixteen = _mm256_set1_epi8(16);
        __mmask32 mlo = _mm256_test_epi8_mask(qh, _mm256_set1_epi8((char)(1 << (2 * q))));
        __mmask32 mhi = _mm256_test_epi8_mask(qh, _mm256_set1_epi8((char)(1 << (2 * q + 1))));
        lo = _mm256_mask_add_epi8(lo, mlo, lo, sixteen);
        hi = _mm256_mask_add_epi8(hi, mhi, hi, sixteen);
    }
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

/* out[r][c] = row r of x (R <= 4) . weight row c (C <= 4), a K-quant weight */
static inline __attribute__((always_inline)) void kq_tile(int fmt, const int8_t *xq,
                                                         const float *xs, int64_t k,
                                                         const uint8_t *w, int64_t rb, int R,
                                                         int C, float out[4][4]) {
    const int64_t nsb = k / KQ_SB, xss = qk_scale_stride(k), bb = kq_bytes[fmt];
    const __m512i ones = _mm512_set1_epi8(1), zero = _mm512_setzero_si512();
    /* lane l of a pair's 16: its 32-block (Q4_K, Q5_K) or its 16 values (Q6_K) */
    const __m512i half = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m512i quarter = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    __m512 acc[4][4], accm[4][4]; /* the min terms apart: two chains of FMAs, not one */
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) acc[r][c] = accm[r][c] = _mm512_setzero_ps();
    for (int64_t s = 0; s < nsb; s++) {
        __m512 S[4];
        for (int c = 0; c < C; c++) S[c] = kq_scales(fmt, w + c * rb + s * bb);
        for (int q = 0; q < 4; q++) {
            const int64_t p = s * 4 + q;
            __m512i wv[4];
            __m512 dw[4], mw[4];
            __m512i idx = fmt == KQ_Q6_K ? _mm512_add_epi32(_mm512_set1_epi32(4 * q), quarter)
                                         : _mm512_add_epi32(_mm512_set1_epi32(2 * q), half);
            __m512i idx_min = _mm512_add_epi32(idx, _mm512_set1_epi32(8));
            for (int c = 0; c < C; c++) {
                wv[c] = kq_load(fmt, w + c * rb + s * bb, q);
                dw[c] = _mm512_permutexvar_ps(idx, S[c]);
                if (fmt != KQ_Q6_K)
                    mw[c] = _mm512_permutexvar_ps(idx_min, S[c]);
            }
            for (int r = 0; r < R; r++) {
                __m512i xv = _mm512_loadu_si512(xq + r * k + p * 64);
                __m512 dx = _mm512_loadu_ps(xs + r * xss + p * 32);
                __m512 sx = _mm512_loadu_ps(xs + r * xss + p * 32 + 16);
                __m512i x32 = zero;
                if (fmt == KQ_Q6_K) x32 = _mm512_slli_epi32(_mm512_dpbusd_epi32(zero, ones, xv), 5);
                for (int c = 0; c < C; c++) {
                    __m512i dp = _mm512_dpbusd_epi32(zero, wv[c], xv);
                    if (fmt == KQ_Q6_K) dp = _mm512_sub_epi32(dp, x32);
                    acc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dp), _mm512_mul_ps(dw[c], dx),
                                                acc[r][c]);
                    if (fmt != KQ_Q6_K) accm[r][c] = _mm512_fmadd_ps(mw[c], sx, accm[r][c]);
                }
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++)
            out[r][c] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][c], accm[r][c]));
}

/* out[r][c] = row r of x (float) . weight row c, an F16 or BF16 weight */
static inline __attribute__((always_inline)) void ft_tile(int fmt, const float *x, int64_t k,
                                                         const uint8_t *w, int64_t rb, int R,
                                                         int C, float out[4][4]) {
    /* two accumulators per (r, c), for 16 values each of a step of 32: twice the independent
     * FMA chains (a chain's latency, not the loads, bounds one row at a time otherwise) */
    __m512 acc[2][4][4];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) acc[0][r][c] = acc[1][r][c] = _mm512_setzero_ps();
    for (int64_t i = 0; i < k; i += 32) {
        for (int u = 0; u < 2; u++) {
            __m512 wv[4];
            for (int c = 0; c < C; c++) {
                const uint8_t *p = w + c * rb + 2 * (i + 16 * u);
                const __m256i h = _mm256_loadu_si256((const __m256i *)p);
                wv[c] = fmt == KQ_F16 ? _mm512_cvtph_ps(h)
                                      : _mm512_castsi512_ps(
                                            _mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
            }
            for (int r = 0; r < R; r++) {
                __m512 xv = _mm512_loadu_ps(x + r * k + i + 16 * u);
                for (int c = 0; c < C; c++)
                    acc[u][r][c] = _mm512_fmadd_ps(wv[c], xv, acc[u][r][c]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++)
            out[r][c] = _mm512_reduce_add_ps(_mm512_add_ps(acc[0][r][c], acc[1][r][c]));
}
#elif defined(KQ_AVX2)
/* AVX2 (and FMA, F16C), 32 values at a time: vpmaddubsw multiplies the unsigned weight bytes by
 * the signed activation bytes and sums pairs into int16 (at most 2 * 63 * 127: no saturation),
 * vpmaddwd sums pairs of those into 8 int32 lanes of 4 values each; the lanes are scaled by
 * the block's d sc dx in float, the min terms summed aside. */
/* 32-value block j (0..7) of a super-block as unsigned bytes in x's order */
static inline __attribute__((always_inline)) __m256i kq_load32(int fmt, const uint8_t *b, int j) {
    const __m256i low4 = _mm256_set1_epi8(0x0f);
    if (fmt == KQ_Q6_K) {
        const int h = j / 4, s = j % 4;
        __m256i ql = _mm256_loadu_si256((const __m256i *)(b + 64 * h + 32 * (s % 2)));
        if (s / 2) ql = _mm256_srli_epi16(ql, 4);
        ql = _mm256_and_si256(ql, low4);
        __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h));
        qh = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * s), _mm256_set1_epi8(3));
        return _mm256_or_si256(ql, _mm256_slli_epi16(qh, 4));
    }
    const uint8_t *qs = b + (fmt == KQ_Q5_K ? 48 : 16) + 32 * (j / 2);
    __m256i v = _mm256_loadu_si256((const __m256i *)qs);
    if (j % 2) v = _mm256_srli_epi16(v, 4);
    v = _mm256_and_si256(v, low4);
    if (fmt == KQ_Q5_K) {
        __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 16));
        qh = _mm256_and_si256(_mm256_srli_epi16(qh, j), _mm256_set1_epi8(1));
        v = _mm256_or_si256(v, _mm256_slli_epi16(qh, 4));
    }
    return v;
}

static inline __attribute__((always_inline)) void kq_tile(int fmt, const int8_t *xq,
                                                         const float *xs, int64_t k,
                                                         const uint8_t *w, int64_t rb, int R,
                                                         int C, float out[4][4]) {
    const int64_t nsb = k / KQ_SB, xss = qk_scale_stride(k), bb = kq_bytes[fmt];
    const __m256i ones16 = _mm256_set1_epi16(1), ones8 = _mm256_set1_epi8(1);
    __m256 acc[4][4];
    float macc[4][4];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) acc[r][c] = _mm256_setzero_ps(), macc[r][c] = 0.0f;
    for (int64_t s = 0; s < nsb; s++) {
        float dsub[4][16], msub[4][8];
        for (int c = 0; c < C; c++) {
            const uint8_t *b = w + c * rb + s * bb;
            if (fmt == KQ_Q6_K) {
                float d = kq_half(b + 208);
                for (int i = 0; i < 16; i++) dsub[c][i] = d * (float)(int8_t)b[192 + i];
            } else {
                int sc[8], mn[8];
                float d = kq_half(b), dmin = kq_half(b + 2);
                kq_k_scales(b + 4, sc, mn);
                for (int j = 0; j < 8; j++) {
                    dsub[c][j] = d * (float)sc[j];
                    msub[c][j] = -dmin * (float)mn[j];
                }
            }
        }
        for (int j = 0; j < 8; j++) {
            const int64_t blk = s * 8 + j;
            __m256i wv[4];
            for (int c = 0; c < C; c++) wv[c] = kq_load32(fmt, w + c * rb + s * bb, j);
            for (int r = 0; r < R; r++) {
                __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + r * k + blk * 32));
                const float *lanes = xs + r * xss + (blk / 2) * 32 + (blk % 2) * 8;
                float dx = lanes[0], sx = lanes[16] * 8.0f;
                __m256i x32 = _mm256_setzero_si256();
                if (fmt == KQ_Q6_K)
                    x32 = _mm256_slli_epi32(
                        _mm256_madd_epi16(_mm256_maddubs_epi16(ones8, xv), ones16), 5);
                for (int c = 0; c < C; c++) {
                    __m256i dp = _mm256_madd_epi16(_mm256_maddubs_epi16(wv[c], xv), ones16);
                    __m256 scale;
                    if (fmt == KQ_Q6_K) {
                        dp = _mm256_sub_epi32(dp, x32);
                        __m128 lo = _mm_set1_ps(dsub[c][2 * j] * dx);
                        __m128 hi = _mm_set1_ps(dsub[c][2 * j + 1] * dx);
                        scale = _mm256_insertf128_ps(_mm256_castps128_ps256(lo), hi, 1);
                    } else {
                        scale = _mm256_set1_ps(dsub[c][j] * dx);
                        macc[r][c] += msub[c][j] * sx;
                    }
                    acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dp), scale, acc[r][c]);
                }
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) out[r][c] = kv_hsum8(acc[r][c]) + macc[r][c];
}

static inline __attribute__((always_inline)) void ft_tile(int fmt, const float *x, int64_t k,
                                                         const uint8_t *w, int64_t rb, int R,
                                                         int C, float out[4][4]) {
    __m256 acc[4][4];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) acc[r][c] = _mm256_setzero_ps();
    for (int64_t i = 0; i < k; i += 8) {
        __m256 wv[4];
        for (int c = 0; c < C; c++) {
            __m128i h = _mm_loadu_si128((const __m128i *)(w + c * rb + 2 * i));
            wv[c] = fmt == KQ_F16 ? _mm256_cvtph_ps(h)
                                  : _mm256_castsi256_ps(
                                        _mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
        }
        for (int r = 0; r < R; r++) {
            __m256 xv = _mm256_loadu_ps(x + r * k + i);
            for (int c = 0; c < C; c++) acc[r][c] = _mm256_fmadd_ps(wv[c], xv, acc[r][c]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) out[r][c] = kv_hsum8(acc[r][c]);
}
#else
/* The scalar definitions: the same integer sums per block and float terms per block */
static void kq_tile(int fmt, const int8_t *xq, const float *xs, int64_t k, const uint8_t *w,
                    int64_t rb, int R, int C, float out[4][4]) {
    const int64_t nsb = k / KQ_SB, xss = qk_scale_stride(k), bb = kq_bytes[fmt];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) out[r][c] = 0.0f;
    for (int c = 0; c < C; c++)
        for (int64_t s = 0; s < nsb; s++) {
            const uint8_t *b = w + c * rb + s * bb;
            int q[KQ_SB], sc[8], mn[8];
            kq_ints(fmt, b, q);
            float d = 0.0f, dmin = 0.0f, dsub[16], msub[8];
            if (fmt == KQ_Q6_K) {
                d = kv_f16_to_f32(b + 208);
                for (int i = 0; i < 16; i++) dsub[i] = d * (float)(int8_t)b[192 + i];
            } else {
                d = kv_f16_to_f32(b), dmin = kv_f16_to_f32(b + 2);
                kq_k_scales(b + 4, sc, mn);
                for (int j = 0; j < 8; j++) {
                    dsub[j] = d * (float)sc[j];
                    msub[j] = -dmin * (float)mn[j];
                }
            }
            for (int r = 0; r < R; r++) {
                float acc = 0.0f;
                for (int j = 0; j < 8; j++) { /* the super-block's 32-value blocks */
                    const int64_t blk = s * 8 + j;
                    const int8_t *qx = xq + r * k + blk * 32;
                    const float *lanes = xs + r * xss + (blk / 2) * 32 + (blk % 2) * 8;
                    float dx = lanes[0], sx = lanes[16] * 8.0f;
                    if (fmt == KQ_Q6_K) {
                        for (int u = 0; u < 2; u++) {
                            int32_t isum = 0;
                            for (int i = 0; i < 16; i++)
                                isum += q[32 * j + 16 * u + i] * qx[16 * u + i];
                            acc += dsub[2 * j + u] * dx * (float)isum;
                        }
                    } else {
                        int32_t isum = 0;
                        for (int i = 0; i < 32; i++) isum += q[32 * j + i] * qx[i];
                        acc += dsub[j] * dx * (float)isum + msub[j] * sx;
                    }
                }
                out[r][c] += acc;
            }
        }
}

static void ft_tile(int fmt, const float *x, int64_t k, const uint8_t *w, int64_t rb, int R,
                    int C, float out[4][4]) {
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) {
            float acc = 0.0f;
            for (int64_t i = 0; i < k; i++) {
                const uint8_t *p = w + c * rb + 2 * i;
                acc += (fmt == KQ_F16 ? kv_f16_to_f32(p) : kq_bf16(p)) * x[r * k + i];
            }
            out[r][c] = acc;
        }
}
#endif

#define KQ_TILE(FMT, R, C, OUT, W)                                                                 \
    do {                                                                                           \
        if ((FMT) == KQ_F16 || (FMT) == KQ_BF16)                                                   \
            ft_tile(FMT, x, k, W, rb, R, C, OUT);                                                  \
        else                                                                                       \
            kq_tile(FMT, xq, xs, k, W, rb, R, C, OUT);                                             \
    } while (0)

/* R rows of x against weight rows [c0, c1): C_MAIN at a time, then one by one */
#define KQ_ROWS(FMT, R, C_MAIN)                                                                    \
    do {                                                                                           \
        float out[4][4];                                                                           \
        int64_t c = c0;                                                                            \
        for (; c + C_MAIN <= c1; c += C_MAIN) {                                                    \
            KQ_TILE(FMT, R, C_MAIN, out, w + c * rb);                                              \
            kv_store_tile(out, R, C_MAIN, bias ? bias + c : NULL, y + c, n, accumulate);           \
        }                                                                                          \
        for (; c < c1; c++) {                                                                      \
            KQ_TILE(FMT, R, 1, out, w + c * rb);                                                   \
            kv_store_tile(out, R, 1, bias ? bias + c : NULL, y + c, n, accumulate);                \
        }                                                                                          \
    } while (0)

#define KQ_FORMAT_BODY(FMT)                                                                        \
    switch (R) {                                                                                   \
    case 4: KQ_ROWS(FMT, 4, 2); break;                                                             \
    case 3: KQ_ROWS(FMT, 3, 2); break;                                                             \
    case 2: KQ_ROWS(FMT, 2, 4); break;                                                             \
    default: KQ_ROWS(FMT, 1, 4); break;                                                            \
    }

/* R (<= 4) rows of x (float x, or quantized xq, xs) times weight rows [c0, c1) into y */
static void kq_rows(int fmt, const float *x, const int8_t *xq, const float *xs, int R, int64_t k,
                    const uint8_t *w, int64_t rb, int64_t c0, int64_t c1, const float *bias,
                    float *y, int64_t n, int accumulate) {
    switch (fmt) {
    case KQ_Q4_K: KQ_FORMAT_BODY(KQ_Q4_K) break;
    case KQ_Q5_K: KQ_FORMAT_BODY(KQ_Q5_K) break;
    case KQ_Q6_K: KQ_FORMAT_BODY(KQ_Q6_K) break;
    case KQ_F16: KQ_FORMAT_BODY(KQ_F16) break;
    default: KQ_FORMAT_BODY(KQ_BF16) break;
    }
}

/* Columns [c0, c1) of y (m, n) = x (m, k) @ w.T (+ bias), w (rows from 0, k) in fmt (KQ_Q4_K ..
 * KQ_BF16); x float (read for F16, BF16) and its quantized rows xq, xs (kv_quantize_rows; read
 * for the K-quants). accumulate: y += instead. */
void kv_kq_cols(const float *x, const int8_t *xq, const float *xs, int64_t m, int64_t k, int fmt,
                const uint8_t *w, int64_t c0, int64_t c1, const float *bias, float *y, int64_t n,
                int accumulate) {
    const int64_t rb = kv_kq_row_bytes(fmt, k), xss = qk_scale_stride(k);
    const int is_float = fmt == KQ_F16 || fmt == KQ_BF16;
    KV_FOR_ROW_TILES(m, c0, c1, KQ_XMB,
                     kq_rows(fmt, x + r * k, is_float ? NULL : xq + r * k,
                             is_float ? NULL : xs + r * xss, R, k, w, rb, cb, ce, bias, y + r * n,
                             n, accumulate));
}
