/* CPU kernels for kvmesh's float32 decode path, loaded through ctypes (kernels/cpu_ops.py).
 *
 * Why C: a decode step of a small model on one core is dominated not by its matmuls but by the
 * ~40 small torch ops per layer around them (each 3-10 us of dispatch) and by the paged-KV gather,
 * which copies every key and value once more before attention reads them. These kernels fuse the
 * elementwise work and read K/V straight from the pool's blocks.
 *
 * Built with -ffp-contract=off so that every multiply and add rounds as torch's elementwise ops
 * do (the rotary embedding then matches transformers bit for bit). Vectors are GCC vector
 * extensions: the same source compiles to AVX-512, AVX2 or SSE, whatever -march allows.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include "cpu_kernels.h"
#include "cpu_vec.h"

#define LANES 16
_Static_assert(LANES == 16, "hsum16 and BITREV16 are written for 16 lanes");
typedef float vf __attribute__((vector_size(LANES * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(LANES * sizeof(int32_t))));

KV_VECTOR_IO(vf, load, store)

static inline vf splat(float x) { return (vf){0} + x; }

/* mask ? a : b, lane by lane; mask lanes are all ones or all zeros (a vector comparison). */
static inline vf blend(vi mask, vf a, vf b) { return (vf)((mask & (vi)a) | (~mask & (vi)b)); }

/* Sum of the lanes as a tree of halves (4 shuffle+add levels, not 15 dependent adds). */
static inline float hsum(vf v) {
    v += __builtin_shuffle(v, (vi){8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
    v += __builtin_shuffle(v, (vi){4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11});
    v += __builtin_shuffle(v, (vi){2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13});
    v += __builtin_shuffle(v, (vi){1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14});
    return v[0];
}

/* Lane j of the result is the sum of the lanes of v[j], for 16 vectors at once: four levels that
 * each add the two halves of pairs of vectors into one (15 two-source shuffle pairs and 15
 * adds, instead of 16 separate horizontal sums). The levels leave the sums in bit-reversed
 * lane order, so v must come in bit-reversed order (v[bitrev(j)] holds row j). */
static inline vf hsum16(vf v[LANES]) {
#define HALVES(x, y, lo, hi) (__builtin_shuffle(x, y, (vi)lo) + __builtin_shuffle(x, y, (vi)hi))
#define LO8 {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23}
#define HI8 {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31}
#define LO4 {0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27}
#define HI4 {4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31}
#define LO2 {0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29}
#define HI2 {2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31}
#define LO1 {0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30}
#define HI1 {1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31}
    vf a[8], b[4], c[2];
    for (int i = 0; i < 8; i++) a[i] = HALVES(v[2 * i], v[2 * i + 1], LO8, HI8);
    for (int i = 0; i < 4; i++) b[i] = HALVES(a[2 * i], a[2 * i + 1], LO4, HI4);
    for (int i = 0; i < 2; i++) c[i] = HALVES(b[2 * i], b[2 * i + 1], LO2, HI2);
    return HALVES(c[0], c[1], LO1, HI1);
#undef HALVES
#undef LO8
#undef HI8
#undef LO4
#undef HI4
#undef LO2
#undef HI2
#undef LO1
#undef HI1
}

static const int BITREV16[16] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};

/* exp(x) for x in [-87.3, 88.7] (clamped outside): Cephes' expf, range reduction by ln 2 split
 * in two, a degree-5 polynomial, the exponent put in by integer arithmetic. Within 2 ulp. */
static inline vf vexp(vf x) {
    x = blend(x < splat(-87.33f), splat(-87.33f), x);
    x = blend(x > splat(88.72f), splat(88.72f), x);
    vf fx = x * splat(1.44269504088896341f) + splat(0.5f);
    vi n = __builtin_convertvector(fx, vi);
    vf fn = __builtin_convertvector(n, vf);
    n += fn > fx; /* floor: the comparison is -1 where truncation rounded up */
    fn = __builtin_convertvector(n, vf);
    vf r = x - fn * splat(0.693359375f) + fn * splat(2.12194440e-4f);
    vf p = splat(1.9875691500e-4f);
    p = p * r + splat(1.3981999507e-3f);
    p = p * r + splat(8.3334519073e-3f);
    p = p * r + splat(4.1665795894e-2f);
    p = p * r + splat(1.6666665459e-1f);
    p = p * r + splat(5.0000001201e-1f);
    p = p * (r * r) + r + splat(1.0f);
    vi bits = (n + 127) << 23;
    vf two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    return p * two_n;
}

static inline float sexp(float x) {
    vf v = vexp(splat(x));
    return v[0];
}

/* out[t] = x[t] * rsqrt(mean(x[t]^2) + eps) * w, rows of n floats. */
void kv_rms_norm(const float *x, const float *w, float *out, int64_t rows, int64_t n, float eps) {
    for (int64_t t = 0; t < rows; t++) {
        const float *xr = x + t * n;
        float *o = out + t * n;
        vf acc = {0};
        int64_t i = 0;
        for (; i + LANES <= n; i += LANES) {
            vf v = load(xr + i);
            acc += v * v;
        }
        float ss = hsum(acc);
        for (; i < n; i++) ss += xr[i] * xr[i];
        float inv = 1.0f / sqrtf(ss / (float)n + eps);
        vf vinv = splat(inv);
        for (i = 0; i + LANES <= n; i += LANES) store(o + i, load(xr + i) * vinv * load(w + i));
        for (; i < n; i++) o[i] = xr[i] * inv * w[i];
    }
}

/* gate_up: (rows, 2 * n) = [gate | up] -> out: (rows, n) = silu(gate) * up. */
void kv_silu_mul(const float *gate_up, float *out, int64_t rows, int64_t n) {
    for (int64_t t = 0; t < rows; t++) {
        const float *g = gate_up + t * 2 * n;
        const float *u = g + n;
        float *o = out + t * n;
        int64_t i = 0;
        for (; i + LANES <= n; i += LANES) {
            vf gv = load(g + i);
            store(o + i, gv / (splat(1.0f) + vexp(-gv)) * load(u + i));
        }
        for (; i < n; i++) o[i] = g[i] / (1.0f + sexp(-g[i])) * u[i];
    }
}

/* Rotate one head in place by rows of the rotation tables: x * cos + roll(x, d/2) * sin, where
 * cos = cat(cos, cos) and sin = cat(-sin, sin) (shared/model/rope.py). */
static void rope_head(float *x, const float *cos, const float *sin, int64_t d) {
    float rolled[d];
    int64_t half = d / 2;
    memcpy(rolled, x + half, half * sizeof(float));
    memcpy(rolled + half, x, half * sizeof(float));
    for (int64_t i = 0; i < d; i++) {
        float a = rolled[i] * sin[i];
        float b = x[i] * cos[i];
        x[i] = a + b;
    }
}


/* The attention kernel works in vectors of the machine's own width (NL lanes: one register),
 * not in LANES: its inner loops keep a dozen vectors live, and 16-lane vectors on an AVX2
 * machine are register pairs that spill. */
#if defined(__AVX512F__)
#define NL 16
#elif defined(__AVX__)
#define NL 8
#else
#define NL 4
#endif
/* How many KV tiles ahead of use the attention loops ask for (a tile is a fresh stream from
 * DRAM that the hardware prefetchers pick up only after a few misses). */
#ifndef AHEAD
#define AHEAD 3
#endif
typedef float vn __attribute__((vector_size(NL * sizeof(float))));
typedef int32_t vni __attribute__((vector_size(NL * sizeof(int32_t))));
KV_VECTOR_IO(vn, loadn, storen)
/* x in every lane, one broadcast ((vn){0} + x would add zero first, a dependent add; a loop
 * over the lanes compiled to one masked broadcast per lane, 16 a splat on AVX-512) */
static inline vn splatn(float x) {
    vn v = {x};
    return __builtin_shuffle(v, (vni){0});
}

/* Lane j of the result: the sum of the lanes of v[BITREVN[j]] (see hsum16). */
#if NL == 16
static inline vn hsumn(vn v[NL]) { return hsum16(v); }
#define BITREVN BITREV16
#elif NL == 8
static const int BITREVN[8] = {0, 4, 2, 6, 1, 5, 3, 7};
static inline vn hsumn(vn v[NL]) {
#define HALVES(x, y, lo, hi) (__builtin_shuffle(x, y, (vni)lo) + __builtin_shuffle(x, y, (vni)hi))
    vn a[4], b[2];
    for (int i = 0; i < 4; i++)
        a[i] = HALVES(v[2 * i], v[2 * i + 1], ((vni){0, 1, 2, 3, 8, 9, 10, 11}), ((vni){4, 5, 6, 7, 12, 13, 14, 15}));
    for (int i = 0; i < 2; i++)
        b[i] = HALVES(a[2 * i], a[2 * i + 1], ((vni){0, 1, 8, 9, 4, 5, 12, 13}), ((vni){2, 3, 10, 11, 6, 7, 14, 15}));
    return HALVES(b[0], b[1], ((vni){0, 8, 2, 10, 4, 12, 6, 14}), ((vni){1, 9, 3, 11, 5, 13, 7, 15}));
#undef HALVES
}
#else
static const int BITREVN[4] = {0, 2, 1, 3};
static inline vn hsumn(vn v[NL]) {
#define HALVES(x, y, lo, hi) (__builtin_shuffle(x, y, (vni)lo) + __builtin_shuffle(x, y, (vni)hi))
    vn a0 = HALVES(v[0], v[1], ((vni){0, 1, 4, 5}), ((vni){2, 3, 6, 7}));
    vn a1 = HALVES(v[2], v[3], ((vni){0, 1, 4, 5}), ((vni){2, 3, 6, 7}));
    return HALVES(a0, a1, ((vni){0, 4, 2, 6}), ((vni){1, 5, 3, 7}));
#undef HALVES
}
#endif

/* Elements of an unquantized KV cache (kind: KV_F32, KV_F16 or KV_BF16 of cpu_kernels.h), read as
 * vectors of NL float32 lanes: a half cache moves half of float32's bytes from memory, and
 * converting costs one instruction per vector (F16C's vcvtph2ps; bfloat16 is float32's upper
 * half). Addresses and strides stay in elements; kv_es gives the bytes of one. */
static inline int64_t kv_es(int kind) { return kind == KV_F32 ? 4 : 2; }

typedef uint16_t vnh __attribute__((vector_size(NL * sizeof(uint16_t))));
typedef uint32_t vnu __attribute__((vector_size(NL * sizeof(uint32_t))));

static inline float f16_to_float(uint16_t h) {
    _Float16 x;
    memcpy(&x, &h, sizeof x);
    return (float)x;
}

static inline float bf16_to_float(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float x;
    memcpy(&x, &u, sizeof x);
    return x;
}

/* float32 -> IEEE half, round to nearest even (torch's cast). */
static inline uint16_t f16_from_float(float x) {
    _Float16 h = (_Float16)x;
    uint16_t u;
    memcpy(&u, &h, sizeof u);
    return u;
}

/* float32 -> bfloat16, round to nearest even, NaN to 0x7fc0 (torch's cast). */
static inline uint16_t bf16_from_float(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1)) >> 16);
}

static inline vn load_f16(const uint16_t *p) {
#if NL == 16
    __m256i h;
    memcpy(&h, p, sizeof h);
    return (vn)_mm512_cvtph_ps(h);
#elif NL == 8 && defined(__F16C__)
    __m128i h;
    memcpy(&h, p, sizeof h);
    return (vn)_mm256_cvtph_ps(h);
#else
    vn v;
    for (int i = 0; i < NL; i++) v[i] = f16_to_float(p[i]);
    return v;
#endif
}

static inline vn load_bf16(const uint16_t *p) {
    vnh h;
    memcpy(&h, p, sizeof h);
    vnu u = __builtin_convertvector(h, vnu) << 16;
    vn v;
    memcpy(&v, &u, sizeof v);
    return v;
}

/* The NL elements from element i of p, as floats. */
static inline __attribute__((always_inline)) vn load_kv(const void *p, int64_t i, int kind) {
    if (kind == KV_F16) return load_f16((const uint16_t *)p + i);
    if (kind == KV_BF16) return load_bf16((const uint16_t *)p + i);
    return loadn((const float *)p + i);
}

/* Element i of p as a float. */
static inline __attribute__((always_inline)) float get_kv(const void *p, int64_t i, int kind) {
    if (kind == KV_F16) return f16_to_float(((const uint16_t *)p)[i]);
    if (kind == KV_BF16) return bf16_to_float(((const uint16_t *)p)[i]);
    return ((const float *)p)[i];
}

/* The address of element i of p. */
static inline const void *kv_at(const void *p, int64_t i, int kind) {
    return (const char *)p + i * kv_es(kind);
}

/* x (n floats) stored from element i of p on, converted to the cache's kind. */
static void store_kv(void *p, int64_t i, const float *x, int64_t n, int kind) {
    if (kind == KV_F16)
        for (int64_t j = 0; j < n; j++) ((uint16_t *)p)[i + j] = f16_from_float(x[j]);
    else if (kind == KV_BF16)
        for (int64_t j = 0; j < n; j++) ((uint16_t *)p)[i + j] = bf16_from_float(x[j]);
    else
        memcpy((float *)p + i, x, n * sizeof(float));
}

/* The tile (block_size rows of d) holding context position j0 (a multiple of block_size): read
 * through the block table, or, from tail_from on, from the tail: the rows of a draft-tree node's
 * context past its block-aligned start, gathered in order (kv_tree below). */
static inline __attribute__((always_inline)) const void *tile_at(
    const void *cache, const int64_t *table, int64_t block_stride, int64_t block_size, int64_t d,
    int64_t j0, int64_t tail_from, const void *tail, int kind) {
    if (j0 >= tail_from) return kv_at(tail, (j0 - tail_from) * d, kind);
    return kv_at(cache, table[j0 / block_size] * block_stride, kind);
}

/* Vectors of NL floats in a strip of d that weigh_values keeps in registers for each of up to 4
 * query heads: 4 * SW accumulators and SW values (AVX-512's 32 registers hold 4 * 4 + 4; AVX2's
 * and SSE's 16 hold 4 * 2 + 2). */
#if NL == 16
#define SW 4
#else
#define SW 2
#endif

/* out rows g of gb query heads, floats i0..i0+sw*NL of d (sw <= SW): sum_j p_gj v_j[i0..] over
 * positions [c0, c1) (p: gb rows of c1 - c0), the accumulators in registers; gb, sw and kind
 * are constants after inlining. Each row's strip of the tile AHEAD tiles on (up to pf_end, the
 * unit's context) is asked for as the same row of this tile is weighed. */
static inline __attribute__((always_inline)) void weigh_values(
    const float *p, const void *v_cache, const int64_t *table, int64_t block_stride,
    int64_t block_size, int64_t c0, int64_t c1, int64_t pf_end, int64_t d, int64_t i0, int gb,
    int sw, float *out, int64_t tail_from, const void *v_tail, int kind) {
    vn acc[4][SW] = {{{0}}};
    int64_t es = kv_es(kind), n_all = c1 - c0;
    for (int64_t j0 = c0; j0 < c1; j0 += block_size) {
        const void *tile = tile_at(v_cache, table, block_stride, block_size, d, j0, tail_from, v_tail, kind);
        int64_t n = c1 - j0 < block_size ? c1 - j0 : block_size;
        const char *next = 0;
        if (j0 + AHEAD * block_size < pf_end && j0 + AHEAD * block_size < tail_from)
            next = kv_at(v_cache, table[j0 / block_size + AHEAD] * block_stride + i0, kind);
        for (int64_t j = 0; j < n; j++) {
            if (next) /* the strip's sw * NL elements: 1-4 lines, into L2 */
                for (int64_t i = 0; i < sw * NL * es; i += 64) __builtin_prefetch(next + j * d * es + i, 0, 2);
            vn v[SW];
            for (int s = 0; s < sw; s++) v[s] = load_kv(tile, j * d + i0 + s * NL, kind);
            for (int g = 0; g < gb; g++) {
                vn pj = splatn(p[g * n_all + j0 - c0 + j]);
                for (int s = 0; s < sw; s++) acc[g][s] += pj * v[s];
            }
        }
    }
    for (int g = 0; g < gb; g++)
        for (int s = 0; s < sw; s++) storen(out + g * d + i0 + s * NL, acc[g][s]);
}

/* A partial attention result of one query group over some of its context: for each head g the
 * largest score m[g], the sum l[g] of exp(score - m[g]), and acc (group rows of d) the sum of
 * exp(score - m[g]) v; PART_FLOATS floats, in that order. Two partials of consecutive positions
 * fold into one (fold_part); acc / l is the attention's output. */
#define PART_FLOATS(group, d) ((group) * ((d) + 2))

/* The partial of one KV head's query group over context positions [c0, c1) (c0 a multiple of
 * block_size): scores into scratch (group rows of c1 - c0), NL keys at a time for each query
 * head while their K rows sit in L1; their maxima and exponentials; then the exponentials'
 * weighted sum of values. Always inlined with d a constant where it is a common head size, so
 * that the loops over d unroll, and with the cache's element kind a constant. */
static inline __attribute__((always_inline)) void attend_part(
    const float *q, const void *k_cache, const void *v_cache, const int64_t *table,
    int64_t block_stride, int64_t block_size, int64_t c0, int64_t c1, int64_t pf_end,
    int64_t group, int64_t d, float scale, float *scratch, float *part, int64_t tail_from,
    const void *k_tail, const void *v_tail, int kind) {
    int64_t n_all = c1 - c0;
    for (int64_t j0 = c0; j0 < c1; j0 += block_size) {
        const void *tile = tile_at(k_cache, table, block_stride, block_size, d, j0, tail_from, k_tail, kind);
        int64_t n = c1 - j0 < block_size ? c1 - j0 : block_size;
        float *sj = scratch + j0 - c0;
        /* the tile AHEAD tiles on, into L2 a row at a time while this tile's rows compute (a
         * burst of a whole tile's lines stalls on the fill buffers, and the page walks of 4 KiB
         * pages come on top: the pool is in huge pages, shared/config/huge_pages.py) */
        const char *next = 0;
        if (j0 + AHEAD * block_size < pf_end && j0 + AHEAD * block_size < tail_from)
            next = kv_at(k_cache, table[j0 / block_size + AHEAD] * block_stride, kind);
        int64_t row_bytes = d * kv_es(kind);
        int64_t j = 0;
        for (; j + NL <= n; j += NL) {
            for (int64_t g = 0; g < group; g++) {
                const float *qg = q + g * d;
                vn acc[NL];
                for (int r = 0; r < NL; r++) {
                    int64_t kj = (j + r) * d;
                    if (g == 0 && next)
                        for (int64_t i = 0; i < row_bytes; i += 64) __builtin_prefetch(next + (j + r) * row_bytes + i, 0, 2);
                    vn a = {0};
                    int64_t i = 0;
                    for (; i + NL <= d; i += NL) a += loadn(qg + i) * load_kv(tile, kj + i, kind);
                    for (; i < d; i++) a[0] += qg[i] * get_kv(tile, kj + i, kind);
                    acc[BITREVN[r]] = a;
                }
                storen(sj + g * n_all + j, hsumn(acc) * scale);
            }
        }
        for (; j < n; j++) {
            if (next)
                for (int64_t i = 0; i < row_bytes; i += 64) __builtin_prefetch(next + j * row_bytes + i, 0, 2);
            for (int64_t g = 0; g < group; g++) {
                const float *qg = q + g * d;
                float dot = 0;
                for (int64_t i = 0; i < d; i++) dot += qg[i] * get_kv(tile, j * d + i, kind);
                sj[g * n_all + j] = dot * scale;
            }
        }
    }
    for (int64_t g = 0; g < group; g++) {
        float *s = scratch + g * n_all;
        float m = s[0];
        int64_t j = 0;
        if (n_all >= LANES) { /* the largest score: exact in any order */
            vf vm = load(s);
            for (j = LANES; j + LANES <= n_all; j += LANES) {
                vf x = load(s + j);
                vm = blend(x > vm, x, vm);
            }
            for (int i = 0; i < LANES; i++) m = vm[i] > m ? vm[i] : m;
        }
        for (; j < n_all; j++) m = s[j] > m ? s[j] : m;
        vf vsum = {0};
        for (j = 0; j + LANES <= n_all; j += LANES) {
            vf e = vexp(load(s + j) - m);
            store(s + j, e);
            vsum += e;
        }
        float sum = hsum(vsum);
        for (; j < n_all; j++) {
            s[j] = sexp(s[j] - m);
            sum += s[j];
        }
        part[g] = m;
        part[group + g] = sum;
    }
    /* acc_g = sum_j p_gj v_j, in strips of SW * NL floats of d for up to 4 query heads at a time:
     * each strip of V is read once per 4 heads, and the accumulators stay in registers. */
    float *acc = part + 2 * group;
    for (int64_t g0 = 0; g0 < group; g0 += 4) {
        int64_t gn = group - g0 < 4 ? group - g0 : 4;
        const float *p = scratch + g0 * n_all;
        float *o = acc + g0 * d;
        int64_t i0 = 0;
#define WEIGH(SWN)                                                                                 \
    switch (gn) {                                                                                  \
    case 4: weigh_values(p, v_cache, table, block_stride, block_size, c0, c1, pf_end, d, i0, 4, SWN, o, tail_from, v_tail, kind); break; \
    case 3: weigh_values(p, v_cache, table, block_stride, block_size, c0, c1, pf_end, d, i0, 3, SWN, o, tail_from, v_tail, kind); break; \
    case 2: weigh_values(p, v_cache, table, block_stride, block_size, c0, c1, pf_end, d, i0, 2, SWN, o, tail_from, v_tail, kind); break; \
    default: weigh_values(p, v_cache, table, block_stride, block_size, c0, c1, pf_end, d, i0, 1, SWN, o, tail_from, v_tail, kind); \
    }
        for (; i0 + SW * NL <= d; i0 += SW * NL) WEIGH(SW)
        for (; i0 + NL <= d; i0 += NL) WEIGH(1) /* d no multiple of SW * NL: e.g. 80 or 96 */
#undef WEIGH
        for (int64_t g = 0; g < gn; g++) /* the rest of d, when it is no multiple of NL */
            for (int64_t i = i0; i < d; i++) {
                float sum = 0;
                for (int64_t j = c0; j < c1; j++) {
                    int64_t j0 = j - j % block_size;
                    const void *tile = tile_at(v_cache, table, block_stride, block_size, d, j0, tail_from, v_tail, kind);
                    sum += p[g * n_all + j - c0] * get_kv(tile, (j % block_size) * d + i, kind);
                }
                o[g * d + i] = sum;
            }
    }
}

/* a = the partial of a's positions followed by b's (both PART_FLOATS(group, d) floats). */
static void fold_part(float *a, const float *b, int64_t group, int64_t d) {
    for (int64_t g = 0; g < group; g++) {
        float ma = a[g], mb = b[g], m = ma > mb ? ma : mb;
        float fa = sexp(ma - m), fb = sexp(mb - m);
        a[g] = m;
        a[group + g] = a[group + g] * fa + b[group + g] * fb;
        float *xa = a + 2 * group + g * d;
        const float *xb = b + 2 * group + g * d;
        for (int64_t i = 0; i < d; i++) xa[i] = xa[i] * fa + xb[i] * fb;
    }
}

/* out (group rows of d) = the partial's acc / l: the attention's output. */
static void finish_part(const float *part, float *out, int64_t group, int64_t d) {
    for (int64_t g = 0; g < group; g++) {
        float inv = 1.0f / part[group + g];
        const float *x = part + 2 * group + g * d;
        for (int64_t i = 0; i < d; i++) out[g * d + i] = x[i] * inv;
    }
}

/* Positions per chunk of context: a unit's context is attended chunk by chunk, each chunk's
 * partial folded into the ones before it in order, so that a unit's result is the same
 * whichever threads computed its chunks (kv_decode_attention_split). */
#ifndef CHUNK_POSITIONS
#define CHUNK_POSITIONS 256
#endif
static inline int64_t chunk_len(int64_t block_size) {
    return block_size >= CHUNK_POSITIONS ? block_size : CHUNK_POSITIONS / block_size * block_size;
}

/* attend_part with d a constant where it is a common head size, and the cache's element kind. */
static void attend_part_any(const float *q, const void *k, const void *v, const int64_t *table,
                            int64_t block_stride, int64_t block_size, int64_t c0, int64_t c1,
                            int64_t pf_end, int64_t group, int64_t d, float scale,
                            float *scratch, float *part, int64_t tail_from, const void *k_tail,
                            const void *v_tail, int kind) {
#define ATTEND(D, KIND)                                                                            \
    attend_part(q, k, v, table, block_stride, block_size, c0, c1, pf_end, group, D, scale,        \
                scratch, part, tail_from, k_tail, v_tail, KIND)
#define KINDS(D)                                                                                   \
    switch (kind) {                                                                                \
    case KV_F16: ATTEND(D, KV_F16); break;                                                         \
    case KV_BF16: ATTEND(D, KV_BF16); break;                                                       \
    default: ATTEND(D, KV_F32);                                                                    \
    }
    if (d == 64) {
        KINDS(64)
    } else if (d == 128) {
        KINDS(128)
    } else {
        KINDS(d)
    }
#undef KINDS
#undef ATTEND
}

/* Chunks [ca, cb) of a unit's context of ctx positions (chunk c: positions [c * ch, min(ctx,
 * (c + 1) * ch))): with each_apart, chunk c's partial into parts + (c - ca) * PART_FLOATS;
 * otherwise the chunks folded in order into parts. */
static void attend_chunks(const float *q, const void *k, const void *v, const int64_t *table,
                          int64_t block_stride, int64_t block_size, int64_t ctx, int64_t ca,
                          int64_t cb, int64_t group, int64_t d, float scale, float *scratch,
                          float *parts, int each_apart, int64_t tail_from, const void *k_tail,
                          const void *v_tail, int kind) {
    int64_t ch = chunk_len(block_size), pf = PART_FLOATS(group, d);
    float next[each_apart ? 1 : pf];
    for (int64_t c = ca; c < cb; c++) {
        int64_t c0 = c * ch, c1 = c0 + ch < ctx ? c0 + ch : ctx;
        float *part = each_apart ? parts + (c - ca) * pf : c == ca ? parts : next;
        attend_part_any(q, k, v, table, block_stride, block_size, c0, c1, ctx, group, d, scale,
                        scratch, part, tail_from, k_tail, v_tail, kind);
        if (!each_apart && c > ca) fold_part(parts, next, group, d);
    }
}

/* Draft-tree rows (kernels/cpu_ops.py, TreeRows): a decode batch may hold one row per node of a
 * draft tree, each a query over its sequence's context up to the sequence's last token and then
 * the node's ancestors and itself. Those sit in the slots after the last token in node order,
 * not at consecutive positions: row b's context positions from starts[b] on are read from the
 * slots of positions positions[offsets[b] + p - starts[b]] (starts[b] = its context length: a
 * plain row). The row's own new K/V goes to the slot of its last context position. Attention
 * gathers the rows of the context from its last whole block on into scratch (a tail of at most
 * block_size - 1 + 64 rows for K and for V, at scratch_offset floats into a thread's scratch
 * row) and reads them there: every score and sum is computed as a plain decode step at the
 * node's position computes it, bit for bit. */
typedef struct kv_tree {
    const int64_t *starts, *offsets, *positions;
    int64_t scratch_offset;
} kv_tree;

/* The slot position holding row b's context position p. */
static inline int64_t tree_position(const kv_tree *tree, int64_t b, int64_t p) {
    if (tree == NULL || p < tree->starts[b]) return p;
    return tree->positions[tree->offsets[b] + p - tree->starts[b]];
}

/* Quantized KV: fp8 or int8, told apart by lut.
 *
 * FP8 (e4m3fn, shared/kv/kv_quant.py): a tile of (block, KV head) in a layer holds fp8
 * bytes meaning byte * scale, one float32 scale per tile. Reading decodes through a 256-entry
 * table (torch's own values, passed in: exact, and cheaper than bit arithmetic); storing follows
 * kv_quant.store bit for bit: power-of-two scales, grown (and the tile requantized) when a new
 * token's largest magnitude does not fit, reset when a token starts the block.
 *
 * INT8 (shared/kv/kv_int8.py, lut NULL): every token of a tile holds d int8 values meaning
 * value * the scale of its group of INT8_GROUP; slot j of tile (b, h) has its scales at
 * b * scale_block_stride + h * scale_head_stride + j * scale_slot_stride. Storing follows
 * kv_int8.store bit for bit (scale = amax / 127, values rint(x / scale) clamped to +-127); a
 * token's bytes depend on that token alone. */
typedef struct kv_quant {
    const float *lut;            /* fp8: (256,) the value of each e4m3fn byte; NULL: int8 */
    float *k_scales, *v_scales;  /* tile (b, h) at b * scale_block_stride + h * scale_head_stride */
    int64_t scale_block_stride, scale_head_stride;
    int64_t scale_slot_stride;   /* int8: floats from one slot's scales to the next's; fp8: 0 */
    int64_t scratch_offset;      /* floats into a scratch row: dequantized K, V, a tile table */
} kv_quant;

#define INT8_GROUP 32
#define INT8_MAX_Q 127.0f
#define INT8_ROTATE_SCALE 0.17677669529663687f /* 32^-1/2, as float32 */

/* The normalized Walsh-Hadamard transform of INT8_GROUP values in place: kv_int8.rotate's
 * butterflies in its order, so bit for bit. */
static void int8_rotate(float *x) {
    for (int64_t h = 1; h < INT8_GROUP; h *= 2)
        for (int64_t i = 0; i < INT8_GROUP; i += 2 * h)
            for (int64_t j = i; j < i + h; j++) {
                float a = x[j], b = x[j + h];
                x[j] = a + b;
                x[j + h] = a - b;
            }
    for (int64_t i = 0; i < INT8_GROUP; i++) x[i] *= INT8_ROTATE_SCALE;
}

#define FP8_MAX 448.0f

/* float -> e4m3fn, saturating, round to nearest even (torch's cast after clamping to +-448). */
static inline uint8_t e4m3_from_float(float x) {
    x = x > FP8_MAX ? FP8_MAX : x < -FP8_MAX ? -FP8_MAX : x;
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    uint8_t sign = (u >> 24) & 0x80;
    u &= 0x7fffffffu;
    if (u < 0x3c800000u) { /* below 2^-6: subnormals, steps of 2^-9 (8 steps reach 2^-6) */
        float a;
        memcpy(&a, &u, sizeof a);
        a *= 512.0f; /* exact */
        uint32_t m = (uint32_t)a;
        float frac = a - (float)m;
        if (frac > 0.5f || (frac == 0.5f && (m & 1))) m++;
        return sign | (uint8_t)m;
    }
    u += 0x7ffffu + ((u >> 20) & 1); /* round the 23-bit mantissa to 3 bits, ties to even */
    return sign | (uint8_t)((((u >> 23) - 120) << 3) | ((u >> 20) & 7));
}

/* The smallest power of two s >= 2^-30 with amax / s <= 448 (kv_quant.pow2_scale). */
static inline float fp8_pow2_scale(float amax) {
    float s = amax / FP8_MAX;
    if (!(s >= 0x1p-30f)) s = 0x1p-30f;
    uint32_t u;
    memcpy(&u, &s, sizeof u);
    if (u & 0x7fffffu) u = (u & 0x7f800000u) + 0x800000u; /* up to the next power of two */
    memcpy(&s, &u, sizeof s);
    return amax > s * FP8_MAX ? s * 2.0f : s;
}

/* Store one token x (d floats) at slot off of a tile (block_size rows of d bytes) whose scale
 * is *scale: kv_quant.store for one (block, head). */
static void fp8_store(const float *x, uint8_t *tile, float *scale, int64_t off, int64_t block_size,
                      int64_t d, const float *lut) {
    float amax = 0;
    for (int64_t i = 0; i < d; i++) {
        float a = fabsf(x[i]);
        amax = a > amax ? a : amax;
    }
    float old = off == 0 ? 0.0f : *scale, s = fp8_pow2_scale(amax);
    if (s < old) s = old;
    if (old > 0 && s > old) { /* grown: the stored tokens to the new scale (a power of two) */
        float ratio = old / s;
        for (int64_t i = 0; i < block_size * d; i++) tile[i] = e4m3_from_float(lut[tile[i]] * ratio);
    }
    *scale = s;
    for (int64_t i = 0; i < d; i++) tile[off * d + i] = e4m3_from_float(x[i] / s);
}

/* Store one token x (d floats) as int8 at row q with its scales at sc: kv_int8.store. */
static void int8_store(const float *x, int8_t *q, float *sc, int64_t d) {
    for (int64_t g = 0; g < d / INT8_GROUP; g++) {
        float xg[INT8_GROUP];
        memcpy(xg, x + g * INT8_GROUP, sizeof xg);
        int8_rotate(xg);
        float amax = 0;
        for (int64_t i = 0; i < INT8_GROUP; i++) {
            float a = fabsf(xg[i]);
            amax = a > amax ? a : amax;
        }
        float s = amax / INT8_MAX_Q;
        for (int64_t i = 0; i < INT8_GROUP; i++) {
            float r = s > 0 ? rintf(xg[i] / s) : 0.0f;
            r = r > INT8_MAX_Q ? INT8_MAX_Q : r < -INT8_MAX_Q ? -INT8_MAX_Q : r;
            q[g * INT8_GROUP + i] = (int8_t)r;
        }
        sc[g] = s;
    }
}

/* The store phase for a quantized cache, KV heads [h0, h1): rotate each row's q heads of the
 * group and its k head, then quantize its k and v into their slots, rows in order for each head
 * (the rows of a draft chain share tiles, and an fp8 tile's scale may grow: one thread per head
 * keeps that in order). Arguments as kv_decode_store_units's. */
void kv_decode_store_quant(float *qkv, int64_t batch, int64_t num_q_heads, int64_t num_kv_heads,
                           int64_t d, const float *rope_cos, const float *rope_sin,
                           uint8_t *k_cache, uint8_t *v_cache, int64_t block_stride,
                           int64_t head_stride, int64_t block_size, const int64_t *block_tables,
                           int64_t table_width, const int64_t *context_lens, const kv_quant *kq,
                           int64_t h0, int64_t h1, const kv_tree *tree) {
    int64_t group = num_q_heads / num_kv_heads;
    int64_t row = (num_q_heads + 2 * num_kv_heads) * d;
    for (int64_t h = h0; h < h1; h++)
        for (int64_t b = 0; b < batch; b++) {
            float *q = qkv + b * row + h * group * d;
            float *k = qkv + b * row + (num_q_heads + h) * d;
            float *v = k + num_kv_heads * d;
            int64_t pos = tree_position(tree, b, context_lens[b] - 1);
            int64_t block = block_tables[b * table_width + pos / block_size];
            int64_t tile = block * block_stride + h * head_stride;
            int64_t sc = block * kq->scale_block_stride + h * kq->scale_head_stride;
            for (int64_t g = 0; g < group; g++) rope_head(q + g * d, rope_cos + b * d, rope_sin + b * d, d);
            rope_head(k, rope_cos + b * d, rope_sin + b * d, d);
            if (kq->lut) {
                fp8_store(k, k_cache + tile, kq->k_scales + sc, pos % block_size, block_size, d, kq->lut);
                fp8_store(v, v_cache + tile, kq->v_scales + sc, pos % block_size, block_size, d, kq->lut);
            } else {
                int64_t off = tile + (pos % block_size) * d;
                sc += (pos % block_size) * kq->scale_slot_stride;
                int8_store(k, (int8_t *)k_cache + off, kq->k_scales + sc, d);
                int8_store(v, (int8_t *)v_cache + off, kq->v_scales + sc, d);
            }
        }
}

/* n rows of d quantized values at src (consecutive slots of one tile) as floats into dst;
 * scales: the first row's (fp8: the tile's one scale). int8 rows stay rotated. */
static void dequant_rows(const uint8_t *src, float *dst, const float *scales, int64_t n, int64_t d,
                         const kv_quant *kq) {
    if (kq->lut) {
        float s = scales[0];
        for (int64_t i = 0; i < n * d; i++) dst[i] = kq->lut[src[i]] * s;
        return;
    }
    const int8_t *q = (const int8_t *)src;
    for (int64_t r = 0; r < n; r++) {
        const float *sr = scales + r * kq->scale_slot_stride;
        for (int64_t i = 0; i < d; i++) dst[r * d + i] = (float)q[r * d + i] * sr[i / INT8_GROUP];
    }
}

/* The context of one (sequence, KV head) of a quantized cache as float tiles: K into kd, V into
 * vd (ctx rows of d each, in order; int8 rows still rotated), and ident the identity table, so
 * that attend reads them as a float cache of consecutive blocks (block stride block_size * d). */
static void quant_dequant_context(const uint8_t *k_cache, const uint8_t *v_cache, int64_t h,
                                  int64_t block_stride, int64_t head_stride, int64_t block_size,
                                  const int64_t *table, int64_t ctx, int64_t d,
                                  const kv_quant *kq, float *kd, float *vd, int64_t *ident,
                                  const kv_tree *tree, int64_t b) {
    int64_t plain = tree == NULL ? ctx : tree->starts[b]; /* positions read from their own slot */
    for (int64_t p = plain; p < ctx; p++) { /* a tree row's ancestors, one row each */
        int64_t at = tree_position(tree, b, p), block = table[at / block_size];
        int64_t off = block * block_stride + h * head_stride + (at % block_size) * d;
        int64_t sc = block * kq->scale_block_stride + h * kq->scale_head_stride +
                     (at % block_size) * kq->scale_slot_stride;
        dequant_rows(k_cache + off, kd + p * d, kq->k_scales + sc, 1, d, kq);
        dequant_rows(v_cache + off, vd + p * d, kq->v_scales + sc, 1, d, kq);
    }
    for (int64_t j = 0; j * block_size < ctx; j++) ident[j] = j;
    ctx = plain;
    for (int64_t j = 0; j * block_size < ctx; j++) {
        int64_t block = table[j], n = ctx - j * block_size;
        n = n < block_size ? n : block_size;
        int64_t tile = block * block_stride + h * head_stride;
        int64_t sc = block * kq->scale_block_stride + h * kq->scale_head_stride;
        dequant_rows(k_cache + tile, kd + j * block_size * d, kq->k_scales + sc, n, d, kq);
        dequant_rows(v_cache + tile, vd + j * block_size * d, kq->v_scales + sc, n, d, kq);
        ident[j] = j;
    }
}

/* Ask for the first AHEAD K and V tiles from position start (a multiple of block_size) of one KV
 * head of a sequence ahead of use (the loops in attend_part ask for the later ones as they go):
 * they come from DRAM, since a decode step reads every layer's KV once, more than the caches
 * hold. */
static void prefetch_context(const void *k_cache, const void *v_cache, const int64_t *table,
                             int64_t block_stride, int64_t block_size, int64_t start, int64_t ctx,
                             int64_t d, int kind) {
    int64_t es = kv_es(kind);
    for (int64_t j0 = start; j0 < ctx && j0 < start + AHEAD * block_size; j0 += block_size) {
        int64_t tile = table[j0 / block_size] * block_stride * es;
        int64_t n = (ctx - j0 < block_size ? ctx - j0 : block_size) * d * es;
        for (int64_t i = 0; i < n; i += 64) {
            __builtin_prefetch((const char *)k_cache + tile + i, 0, 2);
            __builtin_prefetch((const char *)v_cache + tile + i, 0, 2);
        }
    }
}

#ifndef PREFETCH_PAIRS
#define PREFETCH_PAIRS 1
#endif

/* One decode step of attention for a batch of one-token rows, for the units [u0, u1) of it:
 * unit u is (row u / num_kv_heads, KV head u % num_kv_heads), i.e. that KV head's query group.
 * Two phases, each over any runs of units (threads may split them), with a barrier between:
 * kv_decode_store_units rotates and stores every unit's new K/V, kv_decode_attention_units
 * attends. Stored first, a row may read the new K/V of another row of its own sequence: the rows
 * of a draft chain (one per draft, each with the context up to itself) verify as they decode.
 *
 * qkv: (batch, num_q_heads + 2 * num_kv_heads, d) projections of the new tokens; the store phase
 *      rotates each unit's q heads and k head in place by rope_cos, rope_sin: (batch, d), the
 *      rotation-table rows of each token's position.
 * k_cache, v_cache: this layer's first K and V tile; the tile of (block b, KV head h) starts
 *      b * block_stride + h * head_stride elements further on and holds block_size rows of d;
 *      elements of kv_dtype (KV_F32, KV_F16, KV_BF16: stored rounded to nearest even, as torch
 *      casts; a quantized cache, kq given, is bytes and kv_dtype is KV_F32).
 * block_tables: (batch, table_width); context_lens: (batch,), counting the new token, which sits
 *      at position context_len - 1 and is written into its slot before attention reads it.
 * out: (batch, num_q_heads, d). Query head j attends with KV head j / (num_q_heads / num_kv_heads)
 *      (transformers' repeat_kv order). scratch: at least max(context_lens) * group floats.
 * tree: NULL, or the rows of draft-tree nodes (kv_tree): their context's later positions, and
 *      the new token's own slot, are read through it.
 */
void kv_decode_store_units(float *qkv, int64_t num_q_heads, int64_t num_kv_heads, int64_t d,
                           const float *rope_cos, const float *rope_sin, void *k_cache,
                           void *v_cache, int64_t block_stride, int64_t head_stride,
                           int64_t block_size, const int64_t *block_tables, int64_t table_width,
                           const int64_t *context_lens, int64_t u0, int64_t u1,
                           const kv_tree *tree, int64_t kv_dtype) {
    int64_t group = num_q_heads / num_kv_heads;
    int64_t row = (num_q_heads + 2 * num_kv_heads) * d;
    for (int64_t u = u0; u < u1; u++) {
        int64_t b = u / num_kv_heads, h = u % num_kv_heads;
        float *q = qkv + b * row + h * group * d;
        float *k = qkv + b * row + (num_q_heads + h) * d;
        float *v = k + num_kv_heads * d;
        int64_t pos = tree_position(tree, b, context_lens[b] - 1);
        const int64_t *table = block_tables + b * table_width;
        for (int64_t g = 0; g < group; g++) rope_head(q + g * d, rope_cos + b * d, rope_sin + b * d, d);
        rope_head(k, rope_cos + b * d, rope_sin + b * d, d);
        int64_t slot = table[pos / block_size] * block_stride + (pos % block_size) * d;
        store_kv(k_cache, slot + h * head_stride, k, d, (int)kv_dtype);
        store_kv(v_cache, slot + h * head_stride, v, d, (int)kv_dtype);
    }
}

/* What attending unit u (row u / num_kv_heads, KV head u % num_kv_heads) reads and writes: its
 * group's queries and output rows, its KV head's view of the cache, its row's block table and
 * context, and for a draft-tree row its context from its last whole block on, gathered into
 * scratch (as elements of the cache's kind). */
typedef struct {
    const float *q;
    float *out;
    const void *kh, *vh;
    const int64_t *table;
    int64_t ctx, tail_from;
    const void *k_tail, *v_tail;
} unit_view;

static unit_view unit_at(const float *qkv, int64_t num_q_heads, int64_t num_kv_heads, int64_t d,
                         const void *k_pool, const void *v_pool, int64_t block_stride,
                         int64_t head_stride, int64_t block_size, const int64_t *block_tables,
                         int64_t table_width, const int64_t *context_lens, float *out,
                         float *scratch, const kv_tree *tree, int64_t u, int kind) {
    int64_t b = u / num_kv_heads, h = u % num_kv_heads, group = num_q_heads / num_kv_heads;
    int64_t es = kv_es(kind);
    unit_view w;
    w.q = qkv + b * (num_q_heads + 2 * num_kv_heads) * d + h * group * d;
    w.out = out + (b * num_q_heads + h * group) * d;
    w.kh = kv_at(k_pool, h * head_stride, kind);
    w.vh = kv_at(v_pool, h * head_stride, kind);
    w.table = block_tables + b * table_width;
    w.ctx = context_lens[b];
    w.tail_from = INT64_MAX;
    w.k_tail = w.v_tail = NULL;
    if (tree != NULL && tree->starts[b] < w.ctx) {
        w.tail_from = tree->starts[b] - tree->starts[b] % block_size;
        char *k_tail = (char *)(scratch + tree->scratch_offset);
        char *v_tail = k_tail + (w.ctx - w.tail_from) * d * es;
        for (int64_t p = w.tail_from; p < w.ctx; p++) {
            int64_t at = tree_position(tree, b, p);
            int64_t slot = w.table[at / block_size] * block_stride + (at % block_size) * d;
            memcpy(k_tail + (p - w.tail_from) * d * es, kv_at(w.kh, slot, kind), d * es);
            memcpy(v_tail + (p - w.tail_from) * d * es, kv_at(w.vh, slot, kind), d * es);
        }
        w.k_tail = k_tail;
        w.v_tail = v_tail;
    }
    return w;
}

/* Ask for the first tiles of unit u's chunks from chunk c on (see prefetch_context). */
static void prefetch_unit(const void *k_pool, const void *v_pool, int64_t num_kv_heads,
                          int64_t head_stride, int64_t block_stride, int64_t block_size,
                          const int64_t *block_tables, int64_t table_width,
                          const int64_t *context_lens, int64_t d, int64_t u, int64_t c,
                          int kind) {
    int64_t b = u / num_kv_heads, h = u % num_kv_heads;
    prefetch_context(kv_at(k_pool, h * head_stride, kind), kv_at(v_pool, h * head_stride, kind),
                     block_tables + b * table_width, block_stride, block_size,
                     c * chunk_len(block_size), context_lens[b], d, kind);
}

void kv_decode_attention_units(const float *qkv, int64_t num_q_heads, int64_t num_kv_heads,
                               int64_t d, const void *k_pool, const void *v_pool,
                               int64_t block_stride, int64_t head_stride, int64_t block_size,
                               const int64_t *block_tables, int64_t table_width,
                               const int64_t *context_lens, float scale, float *out,
                               float *scratch, int64_t u0, int64_t u1, const kv_quant *kq,
                               const kv_tree *tree, int64_t kv_dtype) {
    int kind = kq ? KV_F32 : (int)kv_dtype;
    int64_t group = num_q_heads / num_kv_heads, ch = chunk_len(block_size);
    float state[PART_FLOATS(group, d)];
    for (int64_t u = u0; u < u1; u++) {
        int64_t b = u / num_kv_heads, h = u % num_kv_heads;
        int64_t ctx = context_lens[b], chunks = (ctx + ch - 1) / ch;
        if (kq) { /* a quantized cache: this unit's context read back as floats, then as below */
            const float *q = qkv + b * (num_q_heads + 2 * num_kv_heads) * d + h * group * d;
            const int64_t *table = block_tables + b * table_width;
            float *oh = out + (b * num_q_heads + h * group) * d;
            float *kd = scratch + kq->scratch_offset, *vd = kd + table_width * block_size * d;
            int64_t *ident = (int64_t *)(vd + table_width * block_size * d);
            quant_dequant_context(k_pool, v_pool, h, block_stride, head_stride, block_size, table,
                                  ctx, d, kq, kd, vd, ident, tree, b);
            /* int8 K and V stay rotated (kv_int8.rotate): the group's queries are rotated alike
             * and the output rotated back, once each instead of every context token */
            float qr[kq->lut ? 1 : group * d];
            if (!kq->lut) {
                memcpy(qr, q, group * d * sizeof(float));
                for (int64_t i = 0; i < group * d; i += INT8_GROUP) int8_rotate(qr + i);
            }
            const float *qa = kq->lut ? q : qr;
            attend_chunks(qa, kd, vd, ident, block_size * d, block_size, ctx, 0, chunks, group, d,
                          scale, scratch, state, 0, INT64_MAX, NULL, NULL, KV_F32);
            finish_part(state, oh, group, d);
            if (!kq->lut)
                for (int64_t i = 0; i < group * d; i += INT8_GROUP) int8_rotate(oh + i);
            continue;
        }
        unit_view w = unit_at(qkv, num_q_heads, num_kv_heads, d, k_pool, v_pool, block_stride,
                              head_stride, block_size, block_tables, table_width, context_lens,
                              out, scratch, tree, u, kind);
        /* the tiles of the unit PREFETCH_PAIRS ahead, while this one computes (the first
         * units' tiles before the first one) */
        for (int64_t ahead = u == u0 ? 0 : PREFETCH_PAIRS; ahead <= PREFETCH_PAIRS; ahead++)
            if (u + ahead < u1)
                prefetch_unit(k_pool, v_pool, num_kv_heads, head_stride, block_stride, block_size,
                              block_tables, table_width, context_lens, d, u + ahead, 0, kind);
        attend_chunks(w.q, w.kh, w.vh, w.table, block_stride, block_size, ctx, 0, chunks, group,
                      d, scale, scratch, state, 0, w.tail_from, w.k_tail, w.v_tail, kind);
        finish_part(state, w.out, group, d);
    }
}

/* The work items of a step's attention: each unit's chunks (chunk_len positions, the last one
 * shorter), units in order, chunks in order. The first item of thread t of nt, runs of
 * consecutive items with about equal work (positions). */
static int64_t item_bound(const int64_t *context_lens, int64_t batch, int64_t num_kv_heads,
                          int64_t ch, int64_t t, int64_t nt) {
    if (t <= 0) return 0;
    int64_t total = 0, items = 0;
    for (int64_t b = 0; b < batch; b++) {
        total += context_lens[b];
        items += (context_lens[b] + ch - 1) / ch;
    }
    if (t >= nt) return items * num_kv_heads;
    total *= num_kv_heads;
    int64_t target = (total * t + nt - 1) / nt, sum = 0, i = 0;
    for (int64_t u = 0; u < batch * num_kv_heads && sum < target; u++) {
        int64_t ctx = context_lens[u / num_kv_heads];
        for (int64_t c0 = 0; c0 < ctx && sum < target; c0 += ch, i++)
            sum += ctx - c0 < ch ? ctx - c0 : ch;
    }
    return i;
}

int64_t kv_attention_parts_floats(int64_t table_width, int64_t block_size, int64_t group,
                                  int64_t d) {
    int64_t ch = chunk_len(block_size);
    return (1 + (table_width * block_size + ch - 1) / ch) * PART_FLOATS(group, d);
}

/* Thread t's share of a step's attention over an unquantized cache, split by work items
 * (item_bound) rather than by whole units, so that a batch of fewer units than threads (batch
 * 1: one unit per KV head) keeps every thread busy. A unit whose chunks all fall to thread t is
 * attended and written as kv_decode_attention_units does; of a unit cut between threads, the
 * thread with its first chunk leaves the fold of its chunks at parts + t * parts_stride (the
 * head slot), and every later one leaves each chunk's partial after that slot; after a barrier
 * kv_decode_attention_merge folds them in order. The same chunks in the same order: the result is
 * kv_decode_attention_units's bit for bit, whatever the split. parts_stride: at least
 * kv_attention_parts_floats(table_width, block_size, group, d) floats. Other arguments as
 * kv_decode_attention_units's; batch rows of the step. */
void kv_decode_attention_split(const float *qkv, int64_t batch, int64_t num_q_heads,
                               int64_t num_kv_heads, int64_t d, const void *k_pool,
                               const void *v_pool, int64_t block_stride, int64_t head_stride,
                               int64_t block_size, const int64_t *block_tables,
                               int64_t table_width, const int64_t *context_lens, float scale,
                               float *out, float *scratch, float *parts, int64_t parts_stride,
                               int64_t t, int64_t nt, const kv_tree *tree, int64_t kv_dtype) {
    int kind = (int)kv_dtype;
    int64_t group = num_q_heads / num_kv_heads, ch = chunk_len(block_size);
    int64_t pf = PART_FLOATS(group, d);
    int64_t i0 = item_bound(context_lens, batch, num_kv_heads, ch, t, nt);
    int64_t i1 = item_bound(context_lens, batch, num_kv_heads, ch, t + 1, nt);
    float *mine = parts + t * parts_stride;
    float state[pf];
    int first = 1;
    for (int64_t u = 0, idx = 0; u < batch * num_kv_heads && idx < i1; u++) {
        int64_t ctx = context_lens[u / num_kv_heads], chunks = (ctx + ch - 1) / ch;
        int64_t ca = i0 - idx > 0 ? i0 - idx : 0, cb = i1 - idx < chunks ? i1 - idx : chunks;
        idx += chunks;
        if (ca >= cb) continue;
        if (first) /* this thread's first tiles */
            prefetch_unit(k_pool, v_pool, num_kv_heads, head_stride, block_stride, block_size,
                          block_tables, table_width, context_lens, d, u, ca, kind);
        first = 0;
        if (u + 1 < batch * num_kv_heads && idx < i1) /* the next unit's, while this computes */
            prefetch_unit(k_pool, v_pool, num_kv_heads, head_stride, block_stride, block_size,
                          block_tables, table_width, context_lens, d, u + 1, 0, kind);
        unit_view w = unit_at(qkv, num_q_heads, num_kv_heads, d, k_pool, v_pool, block_stride,
                              head_stride, block_size, block_tables, table_width, context_lens,
                              out, scratch, tree, u, kind);
        int whole = ca == 0 && cb == chunks;
        float *dst = whole ? state : ca == 0 ? mine : mine + pf;
        attend_chunks(w.q, w.kh, w.vh, w.table, block_stride, block_size, ctx, ca, cb, group, d,
                      scale, scratch, dst, ca > 0, w.tail_from, w.k_tail, w.v_tail, kind);
        if (whole) finish_part(state, w.out, group, d);
    }
}

/* After kv_decode_attention_split's barrier: thread t folds the unit it holds the head slot of
 * (its last unit, when cut), with the partials the later threads left, in chunk order, and
 * writes its output. */
void kv_decode_attention_merge(int64_t batch, int64_t num_q_heads, int64_t num_kv_heads,
                               int64_t d, int64_t block_size, const int64_t *context_lens,
                               float *out, float *parts, int64_t parts_stride, int64_t t,
                               int64_t nt) {
    int64_t group = num_q_heads / num_kv_heads, ch = chunk_len(block_size);
    int64_t pf = PART_FLOATS(group, d);
    int64_t i0 = item_bound(context_lens, batch, num_kv_heads, ch, t, nt);
    int64_t i1 = item_bound(context_lens, batch, num_kv_heads, ch, t + 1, nt);
    if (i0 >= i1) return;
    for (int64_t u = 0, idx = 0; u < batch * num_kv_heads && idx < i1; u++) {
        int64_t ctx = context_lens[u / num_kv_heads], chunks = (ctx + ch - 1) / ch;
        int64_t start = idx;
        idx += chunks;
        /* the unit whose first chunk is this thread's and whose last is not */
        if (start < i0 || start >= i1 || idx <= i1) continue;
        float *state = parts + t * parts_stride;
        int64_t c = i1 - start; /* the first chunk of a later thread */
        for (int64_t j = t + 1; j < nt && c < chunks; j++) {
            int64_t end = item_bound(context_lens, batch, num_kv_heads, ch, j + 1, nt) - start;
            end = end < chunks ? end : chunks;
            for (int64_t cc = c; cc < end; cc++)
                fold_part(state, parts + j * parts_stride + pf + (cc - c) * pf, group, d);
            c = end > c ? end : c;
        }
        int64_t b = u / num_kv_heads, h = u % num_kv_heads;
        finish_part(state, out + (b * num_q_heads + h * group) * d, group, d);
    }
}

/* The first unit of thread t of num_threads: runs of consecutive units with about equal work
 * (a unit's work is its sequence's context length). */
int64_t kv_attention_unit_bound(const int64_t *context_lens, int64_t batch, int64_t num_kv_heads,
                                int64_t t, int64_t num_threads) {
    if (t <= 0) return 0;
    if (t >= num_threads) return batch * num_kv_heads;
    int64_t total = 0;
    for (int64_t b = 0; b < batch; b++) total += context_lens[b];
    total *= num_kv_heads;
    /* the first unit whose work before it reaches the target */
    int64_t target = (total * t + num_threads - 1) / num_threads, sum = 0, u = 0;
    for (; u < batch * num_kv_heads && sum < target; u++) sum += context_lens[u / num_kv_heads];
    return u;
}

/* kv_decode_attention: the batch in num_parts runs of consecutive sequences, run p being
 * [bounds[p], bounds[p + 1]), one OpenMP thread each (the caller balances their context
 * lengths). Every run has its own scratch_stride floats of scratch. Built with -fopenmp the
 * threads are those of the OpenMP runtime already in the process (torch's libgomp, matched by its
 * soname), so they do not compete with another pool's spinning threads; built without it, the
 * runs go one after another. Arguments as kv_decode_attention_units's above; kq: NULL for a
 * float32 cache, else the cache is fp8 or int8 bytes (stored by KV head, kv_decode_store_quant);
 * tree: NULL, or the batch's draft-tree rows; kv_dtype: an unquantized cache's element type. */
void kv_decode_attention(float *qkv, int64_t num_q_heads, int64_t num_kv_heads, int64_t d,
                         const float *rope_cos, const float *rope_sin, void *k_cache,
                         void *v_cache, int64_t block_stride, int64_t head_stride,
                         int64_t block_size, const int64_t *block_tables, int64_t table_width,
                         const int64_t *context_lens, float scale, float *out, float *scratch,
                         int64_t scratch_stride, const int64_t *bounds, int64_t num_parts,
                         const kv_quant *kq, const kv_tree *tree, int64_t kv_dtype) {
#pragma omp parallel num_threads(num_parts) if (num_parts > 1)
    {
        if (kq) {
#pragma omp for schedule(static, 1)
            for (int64_t h = 0; h < num_kv_heads; h++)
                kv_decode_store_quant(qkv, bounds[num_parts], num_q_heads, num_kv_heads, d,
                                      rope_cos, rope_sin, k_cache, v_cache, block_stride,
                                      head_stride, block_size, block_tables, table_width,
                                      context_lens, kq, h, h + 1, tree);
        } else {
#pragma omp for schedule(static, 1)
        for (int64_t p = 0; p < num_parts; p++)
            kv_decode_store_units(qkv, num_q_heads, num_kv_heads, d, rope_cos, rope_sin, k_cache,
                                  v_cache, block_stride, head_stride, block_size, block_tables,
                                  table_width, context_lens, bounds[p] * num_kv_heads,
                                  bounds[p + 1] * num_kv_heads, tree, kv_dtype);
        }
        /* the loop's implicit barrier: every new K/V is stored before any row attends */
#pragma omp for schedule(static, 1)
        for (int64_t p = 0; p < num_parts; p++)
            kv_decode_attention_units(qkv, num_q_heads, num_kv_heads, d, k_cache, v_cache,
                                      block_stride, head_stride, block_size, block_tables,
                                      table_width, context_lens, scale, out,
                                      scratch + p * scratch_stride, bounds[p] * num_kv_heads,
                                      bounds[p + 1] * num_kv_heads, kq, tree, kv_dtype);
    }
}
