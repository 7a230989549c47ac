/* Unaligned loads and stores of GCC vectors of floats, for kvmesh's CPU kernels: cpu_ops.c and
 * cpu_linear.c each work in vectors of their own widths, read from and written to float arrays
 * with no alignment asked (a memcpy, which the compiler turns into one unaligned move). Also the
 * quantized kernels' tile store and (with AVX2) horizontal sum.
 */
#ifndef KVMESH_CPU_VEC_H
#define KVMESH_CPU_VEC_H

#include <stdint.h>
#include <string.h>

/* LOAD(p): the vector of type T at p; STORE(p, v): v written at p. */
#define KV_VECTOR_IO(T, LOAD, STORE)                                                               \
    static inline T LOAD(const float *p) {                                                         \
        T v;                                                                                       \
        memcpy(&v, p, sizeof v);                                                                   \
        return v;                                                                                  \
    }                                                                                              \
    static inline void STORE(float *p, T v) { memcpy(p, &v, sizeof v); }

/* Rows [0, R) and columns [0, C) of a tile of results (out) plus bias (NULL: none) written to,
 * or with accumulate added to, y (rows n floats apart): how the quantized kernels' tiles end
 * (cpu_quant.c, cpu_kquant.c). */
static inline __attribute__((always_inline)) void kv_store_tile(float out[4][4], int R, int C,
                                                                const float *bias, float *y,
                                                                int64_t n, int accumulate) {
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) {
            float v = out[r][c] + (bias ? bias[c] : 0.0f);
            if (accumulate)
                y[r * n + c] += v;
            else
                y[r * n + c] = v;
        }
}

/* The blocking of a quantized matmul over columns [C0, C1) of M rows (cpu_quant.c, cpu_kquant.c):
 * x's rows in blocks of XMB (their int8 rows stay in L2 while the weights pass), weight rows in
 * runs of 16 against the whole block, then x's rows 4 at a time; ROWS runs with r, R (x's rows
 * [r, r + R)) and cb, ce (weight rows [cb, ce)) in scope. */
#define KV_FOR_ROW_TILES(M, C0, C1, XMB, ROWS)                                                     \
    for (int64_t r0_ = 0; r0_ < (M); r0_ += (XMB)) {                                               \
        int64_t r1_ = (M) - r0_ < (XMB) ? (M) : r0_ + (XMB);                                       \
        for (int64_t cb = (C0); cb < (C1); cb += 16) {                                             \
            int64_t ce = (C1) - cb < 16 ? (C1) : cb + 16;                                          \
            for (int64_t r = r0_; r < r1_; r += 4) {                                               \
                int R = r1_ - r < 4 ? (int)(r1_ - r) : 4;                                          \
                ROWS;                                                                              \
            }                                                                                      \
        }                                                                                          \
    }

#ifdef __AVX2__
#include <immintrin.h>

/* The sum of an AVX vector's 8 floats (cpu_quant.c's and cpu_kquant.c's AVX2 tiles). */
static inline float kv_hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

#endif
