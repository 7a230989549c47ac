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
#define AHEAD 2
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

/* The tile (block_size rows of d) holding context position j0 (a multiple of block_size): read
 * through the block table, or, from tail_from on, from the tail: the rows of a draft-tree node's
 * context past its block-aligned start, gathered in order (kv_tree below). */
static inline const float *tile_at(const float *cache, const int64_t *table, int64_t block_stride,
                                   int64_t block_size, int64_t d, int64_t j0, int64_t tail_from,
                                   const float *tail) {
    if (j0 >= tail_from) return tail + (j0 - tail_from) * d;
    return cache + table[j0 / block_size] * block_stride;
}

/* out rows g of gb query heads, floats i0..i0+2*NL of d: sum_j p_gj v_j[i0..], the accumulators
 * in registers; gb is a constant after inlining. */
static inline __attribute__((always_inline)) void weigh_values(
    const float *p, const float *v_cache, const int64_t *table, int64_t block_stride,
    int64_t block_size, int64_t ctx, int64_t d, int64_t i0, int gb, float *out,
    int64_t tail_from, const float *v_tail) {
    vn acc[4][2] = {{{0}}};
    for (int64_t j0 = 0; j0 < ctx; j0 += block_size) {
        const float *tile = tile_at(v_cache, table, block_stride, block_size, d, j0, tail_from, v_tail) + i0;
        int64_t n = ctx - j0 < block_size ? ctx - j0 : block_size;
        if (j0 + AHEAD * block_size < ctx && j0 + AHEAD * block_size < tail_from) {
            const float *next = v_cache + table[j0 / block_size + AHEAD] * block_stride + i0;
            for (int64_t j = 0; j < block_size; j++) { /* the strip's 2 * NL floats: 2 lines */
                __builtin_prefetch(next + j * d, 0, 3);
                __builtin_prefetch(next + j * d + 2 * NL - 1, 0, 3);
            }
        }
        for (int64_t j = 0; j < n; j++) {
            const float *vj = tile + j * d;
            vn v0 = loadn(vj), v1 = loadn(vj + NL);
            for (int g = 0; g < gb; g++) {
                vn pj = splatn(p[g * ctx + j0 + j]);
                acc[g][0] += pj * v0;
                acc[g][1] += pj * v1;
            }
        }
    }
    for (int g = 0; g < gb; g++) {
        storen(out + g * d + i0, acc[g][0]);
        storen(out + g * d + i0 + NL, acc[g][1]);
    }
}

/* Attention of one KV head's query group over one sequence's context: scores into scratch
 * (group rows of ctx), NL keys at a time for each query head while their K rows sit in L1;
 * softmax; then the weighted sum of values into out (group rows of d). Always inlined with d a
 * constant where it is a common head size, so that the loops over d unroll. */
static inline __attribute__((always_inline)) void attend(
    const float *q, const float *k_cache, const float *v_cache, const int64_t *table,
    int64_t block_stride, int64_t block_size, int64_t ctx, int64_t group, int64_t d, float scale,
    float *scratch, float *out, int64_t tail_from, const float *k_tail, const float *v_tail) {
    for (int64_t j0 = 0; j0 < ctx; j0 += block_size) {
        const float *tile = tile_at(k_cache, table, block_stride, block_size, d, j0, tail_from, k_tail);
        int64_t n = ctx - j0 < block_size ? ctx - j0 : block_size;
        if (j0 + AHEAD * block_size < ctx && j0 + AHEAD * block_size < tail_from) { /* the tile AHEAD tiles on, while this one computes */
            const float *next = k_cache + table[j0 / block_size + AHEAD] * block_stride;
            for (int64_t i = 0; i < block_size * d; i += 64 / sizeof(float)) __builtin_prefetch(next + i, 0, 3);
        }
        int64_t j = 0;
        for (; j + NL <= n; j += NL) {
            for (int64_t g = 0; g < group; g++) {
                const float *qg = q + g * d;
                vn acc[NL];
                for (int r = 0; r < NL; r++) {
                    const float *kj = tile + (j + r) * d;
                    vn a = {0};
                    int64_t i = 0;
                    for (; i + NL <= d; i += NL) a += loadn(qg + i) * loadn(kj + i);
                    for (; i < d; i++) a[0] += qg[i] * kj[i];
                    acc[BITREVN[r]] = a;
                }
                storen(scratch + g * ctx + j0 + j, hsumn(acc) * scale);
            }
        }
        for (; j < n; j++) {
            const float *kj = tile + j * d;
            for (int64_t g = 0; g < group; g++) {
                const float *qg = q + g * d;
                float dot = 0;
                for (int64_t i = 0; i < d; i++) dot += qg[i] * kj[i];
                scratch[g * ctx + j0 + j] = dot * scale;
            }
        }
    }
    for (int64_t g = 0; g < group; g++) {
        float *s = scratch + g * ctx;
        float m = s[0];
        for (int64_t j = 1; j < ctx; j++) m = s[j] > m ? s[j] : m;
        vf vsum = {0};
        int64_t j = 0;
        for (; j + LANES <= ctx; j += LANES) {
            vf e = vexp(load(s + j) - m);
            store(s + j, e);
            vsum += e;
        }
        float sum = hsum(vsum);
        for (; j < ctx; j++) {
            s[j] = sexp(s[j] - m);
            sum += s[j];
        }
        float inv = 1.0f / sum;
        for (j = 0; j < ctx; j++) s[j] *= inv;
    }
    /* out_g = sum_j p_gj v_j, in strips of 2 * NL floats of d for up to 4 query heads at a time:
     * each strip of V is read once per 4 heads, and the accumulators stay in registers. */
    for (int64_t g0 = 0; g0 < group; g0 += 4) {
        int64_t gn = group - g0 < 4 ? group - g0 : 4;
        const float *p = scratch + g0 * ctx;
        float *o = out + g0 * d;
        int64_t i0 = 0;
        for (; i0 + 2 * NL <= d; i0 += 2 * NL) {
            switch (gn) {
            case 4: weigh_values(p, v_cache, table, block_stride, block_size, ctx, d, i0, 4, o, tail_from, v_tail); break;
            case 3: weigh_values(p, v_cache, table, block_stride, block_size, ctx, d, i0, 3, o, tail_from, v_tail); break;
            case 2: weigh_values(p, v_cache, table, block_stride, block_size, ctx, d, i0, 2, o, tail_from, v_tail); break;
            default: weigh_values(p, v_cache, table, block_stride, block_size, ctx, d, i0, 1, o, tail_from, v_tail);
            }
        }
        for (int64_t g = 0; g < gn; g++) /* the rest of d, when it is no multiple of 2 * NL */
            for (int64_t i = i0; i < d; i++) {
                float sum = 0;
                for (int64_t j = 0; j < ctx; j++) {
                    int64_t j0 = j - j % block_size;
                    const float *tile = tile_at(v_cache, table, block_stride, block_size, d, j0, tail_from, v_tail);
                    sum += p[g * ctx + j] * tile[(j % block_size) * d + i];
                }
                o[g * d + i] = sum;
            }
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

/* Ask for the first AHEAD K and V tiles of one KV head of a sequence ahead of use (the loops in
 * attend ask for the later ones as they go): they come from DRAM, since a decode step reads
 * every layer's KV once, more than the caches hold. */
static void prefetch_context(const float *k_cache, const float *v_cache, const int64_t *table,
                             int64_t block_stride, int64_t block_size, int64_t ctx, int64_t d) {
    for (int64_t j0 = 0; j0 < ctx && j0 < AHEAD * block_size; j0 += block_size) {
        int64_t tile = table[j0 / block_size] * block_stride;
        int64_t n = (ctx - j0 < block_size ? ctx - j0 : block_size) * d;
        for (int64_t i = 0; i < n; i += 64 / sizeof(float)) {
            __builtin_prefetch(k_cache + tile + i, 0, 2);
            __builtin_prefetch(v_cache + tile + i, 0, 2);
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
 *      b * block_stride + h * head_stride floats further on and holds block_size rows of d.
 * block_tables: (batch, table_width); context_lens: (batch,), counting the new token, which sits
 *      at position context_len - 1 and is written into its slot before attention reads it.
 * out: (batch, num_q_heads, d). Query head j attends with KV head j / (num_q_heads / num_kv_heads)
 *      (transformers' repeat_kv order). scratch: at least max(context_lens) * group floats.
 * tree: NULL, or the rows of draft-tree nodes (kv_tree): their context's later positions, and
 *      the new token's own slot, are read through it.
 */
void kv_decode_store_units(float *qkv, int64_t num_q_heads, int64_t num_kv_heads, int64_t d,
                           const float *rope_cos, const float *rope_sin, float *k_cache,
                           float *v_cache, int64_t block_stride, int64_t head_stride,
                           int64_t block_size, const int64_t *block_tables, int64_t table_width,
                           const int64_t *context_lens, int64_t u0, int64_t u1,
                           const kv_tree *tree) {
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
        memcpy(k_cache + slot + h * head_stride, k, d * sizeof(float));
        memcpy(v_cache + slot + h * head_stride, v, d * sizeof(float));
    }
}

void kv_decode_attention_units(const float *qkv, int64_t num_q_heads, int64_t num_kv_heads,
                               int64_t d, const void *k_pool, const void *v_pool,
                               int64_t block_stride, int64_t head_stride, int64_t block_size,
                               const int64_t *block_tables, int64_t table_width,
                               const int64_t *context_lens, float scale, float *out,
                               float *scratch, int64_t u0, int64_t u1, const kv_quant *kq,
                               const kv_tree *tree) {
    const float *k_cache = k_pool, *v_cache = v_pool;
    int64_t group = num_q_heads / num_kv_heads;
    int64_t row = (num_q_heads + 2 * num_kv_heads) * d;
    for (int64_t u = u0; u < u1; u++) {
        int64_t b = u / num_kv_heads, h = u % num_kv_heads;
        const float *q = qkv + b * row + h * group * d;
        int64_t ctx = context_lens[b];
        const int64_t *table = block_tables + b * table_width;
        float *oh = out + (b * num_q_heads + h * group) * d;
        if (kq) { /* a quantized cache: this unit's context read back as floats, then as below */
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
            int64_t bsd = block_size * d;
            if (d == 64)
                attend(qa, kd, vd, ident, bsd, block_size, ctx, group, 64, scale, scratch, oh, INT64_MAX, NULL, NULL);
            else if (d == 128)
                attend(qa, kd, vd, ident, bsd, block_size, ctx, group, 128, scale, scratch, oh, INT64_MAX, NULL, NULL);
            else
                attend(qa, kd, vd, ident, bsd, block_size, ctx, group, d, scale, scratch, oh, INT64_MAX, NULL, NULL);
            if (!kq->lut)
                for (int64_t i = 0; i < group * d; i += INT8_GROUP) int8_rotate(oh + i);
            continue;
        }
        const float *kh = k_cache + h * head_stride, *vh = v_cache + h * head_stride;
        /* a tree row: its context from its last whole block on, gathered into scratch */
        int64_t tail_from = INT64_MAX;
        float *k_tail = NULL, *v_tail = NULL;
        if (tree != NULL && tree->starts[b] < ctx) {
            tail_from = tree->starts[b] - tree->starts[b] % block_size;
            k_tail = scratch + tree->scratch_offset;
            v_tail = k_tail + (ctx - tail_from) * d;
            for (int64_t p = tail_from; p < ctx; p++) {
                int64_t at = tree_position(tree, b, p);
                int64_t slot = table[at / block_size] * block_stride + (at % block_size) * d;
                memcpy(k_tail + (p - tail_from) * d, kh + slot, d * sizeof(float));
                memcpy(v_tail + (p - tail_from) * d, vh + slot, d * sizeof(float));
            }
        }
        /* the tiles of the unit PREFETCH_PAIRS ahead, while this one computes (the first
         * units' tiles before the first one) */
        for (int64_t ahead = u == u0 ? 0 : PREFETCH_PAIRS; ahead <= PREFETCH_PAIRS; ahead++) {
            int64_t next = u + ahead;
            if (next >= u1) break;
            int64_t nb = next / num_kv_heads, nh = next % num_kv_heads;
            prefetch_context(k_cache + nh * head_stride, v_cache + nh * head_stride,
                             block_tables + nb * table_width, block_stride, block_size,
                             context_lens[nb], d);
        }
        if (d == 64)
            attend(q, kh, vh, table, block_stride, block_size, ctx, group, 64, scale, scratch, oh,
                   tail_from, k_tail, v_tail);
        else if (d == 128)
            attend(q, kh, vh, table, block_stride, block_size, ctx, group, 128, scale, scratch, oh,
                   tail_from, k_tail, v_tail);
        else
            attend(q, kh, vh, table, block_stride, block_size, ctx, group, d, scale, scratch, oh,
                   tail_from, k_tail, v_tail);
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
 * tree: NULL, or the batch's draft-tree rows. */
void kv_decode_attention(float *qkv, int64_t num_q_heads, int64_t num_kv_heads, int64_t d,
                         const float *rope_cos, const float *rope_sin, void *k_cache,
                         void *v_cache, int64_t block_stride, int64_t head_stride,
                         int64_t block_size, const int64_t *block_tables, int64_t table_width,
                         const int64_t *context_lens, float scale, float *out, float *scratch,
                         int64_t scratch_stride, const int64_t *bounds, int64_t num_parts,
                         const kv_quant *kq, const kv_tree *tree) {
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
                                  bounds[p + 1] * num_kv_heads, tree);
        }
        /* the loop's implicit barrier: every new K/V is stored before any row attends */
#pragma omp for schedule(static, 1)
        for (int64_t p = 0; p < num_parts; p++)
            kv_decode_attention_units(qkv, num_q_heads, num_kv_heads, d, k_cache, v_cache,
                                      block_stride, head_stride, block_size, block_tables,
                                      table_width, context_lens, scale, out,
                                      scratch + p * scratch_stride, bounds[p] * num_kv_heads,
                                      bounds[p + 1] * num_kv_heads, kq, tree);
    }
}
