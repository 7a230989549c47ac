/* Linear layers over prepacked weights, for kvmesh's float32 CPU path (kernels/cpu_ops.py).
 *
 * Why: a decode step of a small model reads every weight once per step and does little else, so
 * batch-1 decode is a stream of matrix-vector products bound by memory bandwidth. MKL's GEMV
 * reaches that bound for some shapes and layouts and not others (6-15 GB/s on one Zen 3 core);
 * a weight stored as panels of NR output columns, each panel one contiguous (in, NR) strip, is
 * read as a single forward stream, every load a full vector with no horizontal sums, and the
 * same panel serves all rows of a small batch while it is in L1. Threads split the panels, so
 * each reads its own share of the weights.
 *
 * Panel layout (kvmesh.kernels.cpu_ops.pack_linear_weight): packed[p][k][j] = w[p * NR + j][k]
 * for w (n, k), the last panel zero-padded. Accumulation runs over k in order, one fused
 * multiply-add per term (rounding differs from MKL's order in the last bits, not more).
 */
#include <stdint.h>
#include <string.h>

#include "cpu_kernels.h"
#include "cpu_vec.h"

#if defined(__AVX__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
#define VL 16
#define MR 8
#define PR 6
#elif defined(__AVX__)
#define VL 8
#define MR 6
#define PR 5
#else
#define VL 4
#define MR 4
#define PR 1
#endif
#define NR 16 /* output columns per panel; kernels/cpu_ops.py packs with the same width */
#define NV (NR / VL)
/* rows of x per cache block: the block stays in L2 while every panel of a thread passes by */
#define MB 96
/* rows up to which pairs of panels stream from memory together (pair_rows, PR rows at once):
 * a few rows, e.g. a draft chain's verification at batch 1, read the weights nearly as fast as
 * one row does (one panel at a time, 2 to 5 rows read ~15% slower on one Zen core) */
#define PAIR_MAX_ROWS PR

typedef float vl __attribute__((vector_size(VL * sizeof(float))));

KV_VECTOR_IO(vl, loadv, storev)

/* x in every lane: one broadcast from memory. ((vl){0} + x would add zero first: an extra
 * dependent add per broadcast, since the compiler must keep x = -0.0 as +0.0.) */
static inline vl bcast(const float *x) {
#if defined(__AVX512F__)
    return (vl)_mm512_set1_ps(*x);
#elif defined(__AVX__) && VL == 8
    return (vl)_mm256_set1_ps(*x);
#else
    return (vl){0} + *x;
#endif
}

static inline vl fmadd(vl a, vl b, vl c) {
#if defined(__AVX512F__)
    return (vl)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__FMA__) && VL == 8
    return (vl)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
    return a * b + c;
#endif
}

/* y[r][c0 .. c0 + nc) for rows r < mr of x (row stride k): one panel times mr rows. mr is a
 * constant after inlining, so the accumulators live in registers. */
static inline __attribute__((always_inline)) void tile(const float *x, int64_t k,
                                                       const float *panel, const float *bias,
                                                       float *y, int64_t n, int64_t nc, int mr,
                                                       int accumulate, const float *next) {
    vl acc[MR][NV];
    for (int r = 0; r < mr; r++)
        for (int v = 0; v < NV; v++) acc[r][v] = (vl){0};
    for (int64_t kk = 0; kk < k; kk++) {
        vl b[NV];
        /* a panel row is one cache line: the next panel arrives a line per step, from DRAM
         * (a decode step reads every weight once) while this one computes */
        if (next) __builtin_prefetch(next + kk * NR, 0, 3);
        for (int v = 0; v < NV; v++) b[v] = loadv(panel + kk * NR + v * VL);
        for (int r = 0; r < mr; r++) {
            vl a = bcast(x + r * k + kk);
            for (int v = 0; v < NV; v++) acc[r][v] = fmadd(a, b[v], acc[r][v]);
        }
    }
    for (int r = 0; r < mr; r++) {
        float row[NR];
        for (int v = 0; v < NV; v++) storev(row + v * VL, acc[r][v]);
        if (bias)
            for (int j = 0; j < nc; j++) row[j] += bias[j];
        if (accumulate) /* y + (x w + b): the rounding of torch's out.add_(residual) */
            for (int j = 0; j < nc; j++) y[r * n + j] += row[j];
        else
            memcpy(y + r * n, row, nc * sizeof(float));
    }
}

/* One row of x against two whole panels at once (batch-1 decode): two streams from memory in
 * flight instead of one, which reads the weights faster (12 -> 15 GB/s on one Zen 3 core). */
static void pair_row(const float *x, int64_t k, const float *pa, const float *pb,
                     const float *bias, float *y, int accumulate) {
    vl acc[2][NV];
    for (int v = 0; v < NV; v++) acc[0][v] = acc[1][v] = (vl){0};
    for (int64_t kk = 0; kk < k; kk++) {
        vl a = bcast(x + kk);
        for (int v = 0; v < NV; v++) {
            acc[0][v] = fmadd(a, loadv(pa + kk * NR + v * VL), acc[0][v]);
            acc[1][v] = fmadd(a, loadv(pb + kk * NR + v * VL), acc[1][v]);
        }
    }
    float row[2 * NR];
    for (int v = 0; v < NV; v++) {
        storev(row + v * VL, acc[0][v]);
        storev(row + NR + v * VL, acc[1][v]);
    }
    if (bias)
        for (int j = 0; j < 2 * NR; j++) row[j] += bias[j];
    if (accumulate)
        for (int j = 0; j < 2 * NR; j++) y[j] += row[j];
    else
        memcpy(y, row, sizeof row);
}

/* mr rows (at most PR) of x against two whole panels at once: pair_row for a few rows, the
 * same sums in the same order (so a row's result does not depend on how many rows came with
 * it: draft rows verify bit for bit as plain decode rows). PR: as many rows as the registers
 * hold the accumulators of (AVX2: 20 of 16 registers, a few spilled to L1, still faster). */
static inline __attribute__((always_inline)) void pair_tile(const float *x, int64_t k,
                                                            const float *pa, const float *pb,
                                                            const float *bias, float *y,
                                                            int64_t n, int mr, int accumulate) {
    vl acc[PR][2][NV];
    for (int r = 0; r < mr; r++)
        for (int v = 0; v < NV; v++) acc[r][0][v] = acc[r][1][v] = (vl){0};
    for (int64_t kk = 0; kk < k; kk++) {
        vl b0[NV], b1[NV];
        for (int v = 0; v < NV; v++) {
            b0[v] = loadv(pa + kk * NR + v * VL);
            b1[v] = loadv(pb + kk * NR + v * VL);
        }
        for (int r = 0; r < mr; r++) {
            vl a = bcast(x + r * k + kk);
            for (int v = 0; v < NV; v++) {
                acc[r][0][v] = fmadd(a, b0[v], acc[r][0][v]);
                acc[r][1][v] = fmadd(a, b1[v], acc[r][1][v]);
            }
        }
    }
    for (int r = 0; r < mr; r++) {
        float row[2 * NR];
        for (int v = 0; v < NV; v++) {
            storev(row + v * VL, acc[r][0][v]);
            storev(row + NR + v * VL, acc[r][1][v]);
        }
        if (bias)
            for (int j = 0; j < 2 * NR; j++) row[j] += bias[j];
        if (accumulate)
            for (int j = 0; j < 2 * NR; j++) y[r * n + j] += row[j];
        else
            memcpy(y + r * n, row, sizeof row);
    }
}

static void pair_rows(const float *x, int64_t m, int64_t k, const float *pa, const float *pb,
                      const float *bias, float *y, int64_t n, int accumulate) {
    for (int64_t r = 0; r < m; r += PR) {
        const float *xr = x + r * k;
        float *yr = y + r * n;
        switch (m - r < PR ? m - r : PR) {
#if PR > 5
        case 6: pair_tile(xr, k, pa, pb, bias, yr, n, 6, accumulate); break;
#endif
#if PR > 4
        case 5: pair_tile(xr, k, pa, pb, bias, yr, n, 5, accumulate); break;
        case 4: pair_tile(xr, k, pa, pb, bias, yr, n, 4, accumulate); break;
        case 3: pair_tile(xr, k, pa, pb, bias, yr, n, 3, accumulate); break;
#endif
#if PR > 1
        case 2: pair_tile(xr, k, pa, pb, bias, yr, n, 2, accumulate); break;
#endif
        default: pair_tile(xr, k, pa, pb, bias, yr, n, 1, accumulate); break;
        }
    }
}

/* mr rows against one panel; next: the panel after it, fetched during the first tile, or NULL */
static void panel_rows(const float *x, int64_t m, int64_t k, const float *panel,
                       const float *bias, float *y, int64_t n, int64_t nc, int acc,
                       const float *next) {
    int64_t r = 0;
    if (m >= MR) {
        tile(x, k, panel, bias, y, n, nc, MR, acc, next);
        r = MR;
    }
    for (; r + MR <= m; r += MR) tile(x + r * k, k, panel, bias, y + r * n, n, nc, MR, acc, NULL);
    switch (m - r) {
#if MR > 7
    case 7: tile(x + r * k, k, panel, bias, y + r * n, n, nc, 7, acc, r == 0 ? next : NULL); break;
    case 6: tile(x + r * k, k, panel, bias, y + r * n, n, nc, 6, acc, r == 0 ? next : NULL); break;
#endif
#if MR > 5
    case 5: tile(x + r * k, k, panel, bias, y + r * n, n, nc, 5, acc, r == 0 ? next : NULL); break;
    case 4: tile(x + r * k, k, panel, bias, y + r * n, n, nc, 4, acc, r == 0 ? next : NULL); break;
#endif
    case 3: tile(x + r * k, k, panel, bias, y + r * n, n, nc, 3, acc, r == 0 ? next : NULL); break;
    case 2: tile(x + r * k, k, panel, bias, y + r * n, n, nc, 2, acc, r == 0 ? next : NULL); break;
    case 1: tile(x + r * k, k, panel, bias, y + r * n, n, nc, 1, acc, r == 0 ? next : NULL); break;
    default: break;
    }
}

/* Thread t of num_threads's share of y (m, n) = x (m, k) @ w.T (+ bias), w packed as above:
 * a contiguous run of panels. accumulate: y += x @ w.T (+ bias) instead (a residual add fused
 * into the layer, kernels/cpu_layer.c). x and y row-major and contiguous, bias (n,) or NULL. */
void kv_linear_share(const float *x, int64_t m, int64_t k, const float *packed, int64_t n,
                     const float *bias, float *y, int64_t t, int64_t num_threads, int accumulate) {
    int64_t num_panels = (n + NR - 1) / NR;
    int64_t p0 = num_panels * t / num_threads, p1 = num_panels * (t + 1) / num_threads;
    if (m <= PAIR_MAX_ROWS) { /* whole pairs of panels, then a last odd or partial one */
        int64_t p = p0;
        for (; p + 1 < p1 && (p + 2) * NR <= n; p += 2) {
            const float *pa = packed + p * NR * k, *pb = packed + (p + 1) * NR * k;
            const float *b = bias ? bias + p * NR : NULL;
            if (m == 1)
                pair_row(x, k, pa, pb, b, y + p * NR, accumulate);
            else
                pair_rows(x, m, k, pa, pb, b, y + p * NR, n, accumulate);
        }
        for (; p < p1; p++) {
            int64_t c0 = p * NR, nc = n - c0 < NR ? n - c0 : NR;
            panel_rows(x, m, k, packed + p * NR * k, bias ? bias + c0 : NULL, y + c0, n, nc,
                       accumulate, NULL);
        }
        return;
    }
    for (int64_t r0 = 0; r0 < m; r0 += MB) {
        int64_t mb = m - r0 < MB ? m - r0 : MB;
        for (int64_t p = p0; p < p1; p++) {
            int64_t c0 = p * NR, nc = n - c0 < NR ? n - c0 : NR;
            const float *next = r0 == 0 && p + 1 < p1 ? packed + (p + 1) * NR * k : NULL;
            panel_rows(x + r0 * k, mb, k, packed + p * NR * k, bias ? bias + c0 : NULL,
                       y + r0 * n + c0, n, nc, accumulate, next);
        }
    }
}

/* y (m, n) = x (m, k) @ w.T (+ bias), w packed as above; x and y row-major and contiguous, bias
 * (n,) or NULL. num_threads OpenMP threads each take a contiguous run of panels. */
void kv_linear(const float *x, int64_t m, int64_t k, const float *packed, int64_t n,
               const float *bias, float *y, int64_t num_threads) {
    int64_t num_panels = (n + NR - 1) / NR;
    if (num_threads > num_panels) num_threads = num_panels;
    if (num_threads < 1) num_threads = 1;
#pragma omp parallel for num_threads(num_threads) schedule(static, 1) if (num_threads > 1)
    for (int64_t t = 0; t < num_threads; t++)
        kv_linear_share(x, m, k, packed, n, bias, y, t, num_threads, 0);
}

/* Row-major weights read in place: y (m, n) = x (m, k) @ w.T for w (n, k) as stored, no packed
 * copy (a float32 model's tied LM head: 49,152 x 576 floats, 113 MB, which a packed copy would
 * double). A thread's rows are cut into RW runs read side by side: a tile takes one row of each
 * run (RW streams from memory in flight, as pair_row's two panels) against up to RX rows of x,
 * each dot product in VL lanes summed across at the end, so a row's result does not depend on
 * the rows beside it. torch's GEMV read this head at 10-11 GB/s at one row and 4-5 GB/s at 2-8
 * rows on one Zen core. */
#if defined(__AVX512F__)
#define RX 4
#else
#define RX 2
#endif
#define RW 4

/* the sum of v's lanes, as a tree (a dependent chain of VL scalar adds per dot product cost
 * as much as its FMAs at 8 rows of x) */
static inline float lanes_sum(vl v) {
#if defined(__AVX512F__)
    return _mm512_reduce_add_ps((__m512)v);
#elif defined(__AVX2__) && VL == 8
    return kv_hsum8((__m256)v);
#else
    float lanes[VL], s = 0.0f;
    storev(lanes, v);
    for (int i = 0; i < VL; i++) s += lanes[i];
    return s;
#endif
}

/* rows r < mr of x against weight rows w + c * ws (c < nc) into y[r * n + c * ys] */
static inline __attribute__((always_inline)) void rows_tile(const float *x, int64_t k,
                                                            const float *w, int64_t ws, float *y,
                                                            int64_t n, int64_t ys, int mr,
                                                            int nc) {
    vl acc[RX][RW];
    for (int r = 0; r < mr; r++)
        for (int c = 0; c < nc; c++) acc[r][c] = (vl){0};
    const int64_t kv = k / VL * VL;
    for (int64_t kk = 0; kk < kv; kk += VL) {
        vl b[RW];
        for (int c = 0; c < nc; c++) b[c] = loadv(w + c * ws + kk);
        for (int r = 0; r < mr; r++) {
            vl a = loadv(x + r * k + kk);
            for (int c = 0; c < nc; c++) acc[r][c] = fmadd(a, b[c], acc[r][c]);
        }
    }
    for (int r = 0; r < mr; r++)
        for (int c = 0; c < nc; c++) {
            float s = lanes_sum(acc[r][c]);
            for (int64_t kk = kv; kk < k; kk++) s += x[r * k + kk] * w[c * ws + kk];
            y[r * n + c * ys] = s;
        }
}

/* every row of x (in runs of RX) against nc (RW or 1) weight rows: constants after inlining */
static void rows_block(const float *x, int64_t m, int64_t k, const float *w, int64_t ws,
                       float *y, int64_t n, int64_t ys, int nc) {
    for (int64_t r = 0; r < m; r += RX) {
        const float *xr = x + r * k;
        float *yr = y + r * n;
#define ROWS_TILE_CASES(NC)                                                                        \
    switch (m - r < RX ? (int)(m - r) : RX) {                                                      \
    case 4: rows_tile(xr, k, w, ws, yr, n, ys, RX < 4 ? RX : 4, NC); break;                        \
    case 3: rows_tile(xr, k, w, ws, yr, n, ys, RX < 3 ? RX : 3, NC); break;                        \
    case 2: rows_tile(xr, k, w, ws, yr, n, ys, 2, NC); break;                                      \
    default: rows_tile(xr, k, w, ws, yr, n, ys, 1, NC); break;                                     \
    }
        if (nc == RW) {
            ROWS_TILE_CASES(RW)
        } else {
            ROWS_TILE_CASES(1)
        }
#undef ROWS_TILE_CASES
    }
}

/* Thread t of nt's share (weight rows [n t / nt, n (t + 1) / nt)) of kv_linear_rows below. */
void kv_linear_rows_share(const float *x, int64_t m, int64_t k, const float *w, int64_t n,
                          float *y, int64_t t, int64_t nt) {
    const int64_t c0 = n * t / nt, c1 = n * (t + 1) / nt, run = (c1 - c0) / RW;
    for (int64_t i = 0; i < run; i++) /* row i of each of the RW runs */
        rows_block(x, m, k, w + (c0 + i) * k, run * k, y + c0 + i, n, run, RW);
    for (int64_t c = c0 + RW * run; c < c1; c++) /* the last (c1 - c0) % RW rows */
        rows_block(x, m, k, w + c * k, k, y + c, n, 1, 1);
}

/* y (m, n) = x (m, k) @ w.T, w (n, k) row-major as stored; x, y row-major and contiguous.
 * num_threads OpenMP threads each take a contiguous run of w's rows. */
void kv_linear_rows(const float *x, int64_t m, int64_t k, const float *w, int64_t n, float *y,
                    int64_t num_threads) {
    if (num_threads < 1) num_threads = 1;
#pragma omp parallel for num_threads(num_threads) schedule(static, 1) if (num_threads > 1)
    for (int64_t t = 0; t < num_threads; t++) kv_linear_rows_share(x, m, k, w, n, y, t, num_threads);
}
