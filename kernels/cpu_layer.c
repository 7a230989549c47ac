/* One Llama decoder layer's decode step in one call and one OpenMP region (kernels/cpu_ops.py,
 * CpuOps.decode_layer).
 *
 * Why: a decode step of a small model calls ~6 kernels per layer from Python, each its own
 * OpenMP region: the threads wake and part once per kernel, Python runs between them while they
 * spin, and the attention splits only by sequence (one thread at batch 1). Here the threads wake
 * once per layer, split every phase (linear layers by weight panels, attention by
 * (sequence, KV head) units) and meet at a barrier between phases:
 *
 *   xn = rms_norm(x) -> qkv = xn Wqkv -> rotary, KV store -> attention -> x += attn Wo
 *   -> xn = rms_norm(x) -> gu = xn Wgate_up -> act = silu(gate) * up -> x += act Wdown
 *
 * Every phase runs the same code as the separate kernels (kv_rms_norm, kv_linear_share,
 * kv_decode_store_units, kv_decode_attention_units, kv_silu_mul), so the result is bit for bit
 * that of the unfused C path. Arguments: x (batch, hidden), updated in place; weights packed by
 * pack_linear_weight, biases (n,) or NULL; work buffers xn (batch, hidden), qkv (batch, n_qkv),
 * attn (batch, num_q_heads * d), gu (batch, 2 * inter), act (batch, inter); attention arguments
 * as kv_decode_store_units's and kv_decode_attention_units's, scratch: num_threads rows of
 * scratch_stride floats; kq: NULL for a float32 cache, else an fp8 or int8 cache's scales
 * (kv_quant: it stores through kv_decode_store_quant, by KV head); tree: NULL, or the batch's
 * draft-tree rows (kv_tree in cpu_ops.c); kv_dtype: an unquantized cache's element type (KV_F32,
 * KV_F16 or KV_BF16: a half cache halves the bytes attention reads); parts: NULL, or room for
 * the attention's partial results, parts_stride floats a thread (kv_attention_parts_floats):
 * an unquantized cache's attention then splits by chunks of context, not by whole (sequence,
 * KV head) units, so that a batch of fewer units than threads keeps every thread busy
 * (kv_decode_attention_split; the same result bit for bit).
 */
#include <stddef.h>
#include <stdint.h>

#include "cpu_kernels.h"

#ifdef _OPENMP
#include <omp.h>
#define BARRIER _Pragma("omp barrier")
#else
#define BARRIER
static inline int omp_get_thread_num(void) { return 0; }
static inline int omp_get_num_threads(void) { return 1; }
#endif

/* The attention phase both layers share, run by thread t of nt inside their OpenMP region (the
 * barriers are orphaned ones: they bind to the caller's region): rotary and the new K/V stored,
 * a barrier (the rows of a draft chain read each other's K/V), then the attention into attn,
 * split by chunks of context (parts, an unquantized cache) or by (sequence, KV head) units, and
 * a barrier after it. Arguments as kv_decode_layer's. */
static inline void layer_attention(float *qkv, int64_t batch, int64_t num_q_heads,
                                   int64_t num_kv_heads, int64_t d, const float *rope_cos,
                                   const float *rope_sin, void *k_cache, void *v_cache,
                                   int64_t block_stride, int64_t head_stride, int64_t block_size,
                                   const int64_t *block_tables, int64_t table_width,
                                   const int64_t *context_lens, float scale, float *attn,
                                   float *scratch, const kv_quant *kq, const kv_tree *tree,
                                   int64_t kv_dtype, float *parts, int64_t parts_stride,
                                   int64_t t, int64_t nt) {
    int64_t u0 = kv_attention_unit_bound(context_lens, batch, num_kv_heads, t, nt);
    int64_t u1 = kv_attention_unit_bound(context_lens, batch, num_kv_heads, t + 1, nt);
    if (kq) /* by KV head, rows in order: a draft chain's rows may share a tile */
        kv_decode_store_quant(qkv, batch, num_q_heads, num_kv_heads, d, rope_cos,
                              rope_sin, k_cache, v_cache, block_stride, head_stride, block_size,
                              block_tables, table_width, context_lens, kq,
                              num_kv_heads * t / nt, num_kv_heads * (t + 1) / nt, tree);
    else
        kv_decode_store_units(qkv, num_q_heads, num_kv_heads, d, rope_cos, rope_sin,
                              k_cache, v_cache, block_stride, head_stride, block_size,
                              block_tables, table_width, context_lens, u0, u1, tree, kv_dtype);
    BARRIER /* every row's new K/V stored: the rows of a draft chain read each other's */
    if (parts && !kq) { /* split by chunks of context: every thread busy at batch 1 */
        kv_decode_attention_split(qkv, batch, num_q_heads, num_kv_heads, d, k_cache, v_cache,
                                  block_stride, head_stride, block_size, block_tables,
                                  table_width, context_lens, scale, attn, scratch, parts,
                                  parts_stride, t, nt, tree, kv_dtype);
        BARRIER
        kv_decode_attention_merge(batch, num_q_heads, num_kv_heads, d, block_size, context_lens,
                                  attn, parts, parts_stride, t, nt);
    } else
        kv_decode_attention_units(qkv, num_q_heads, num_kv_heads, d, k_cache, v_cache,
                                  block_stride, head_stride, block_size, block_tables,
                                  table_width, context_lens, scale, attn, scratch, u0, u1, kq,
                                  tree, kv_dtype);
    BARRIER
}

/* One linear layer of the layer's phases, this thread's share of its output features: float
 * weights packed by pack_linear_weight (fmts NULL), else weight i of fmts in its GGUF block format
 * times the input rows quantized into xq, xs. */
static inline void layer_linear(const int64_t *fmts, int i, const float *in, const int8_t *xq,
                                const float *xs, int64_t batch, int64_t k, const void *w,
                                int64_t n, const float *bias, float *y, int64_t t, int64_t nt,
                                int accumulate) {
    if (fmts)
        kv_qlinear_share(in, xq, xs, batch, k, (int)fmts[i], (const uint8_t *)w, n, bias, y, t, nt,
                         accumulate);
    else
        kv_linear_share(in, batch, k, (const float *)w, n, bias, y, t, nt, accumulate);
}

/* Both layers' one OpenMP region: fmts NULL, float weights (kv_decode_layer); else quantized
 * weights, each linear layer's input rows quantized by the threads that produced them, with a
 * barrier after the attention's output first (its units cut across rows). Every thread takes
 * the same branches, so each barrier is met by all. */
static inline void decode_layer(float *x, int64_t batch, int64_t hidden, const float *attn_norm,
                                const float *ffn_norm, float eps, const int64_t *fmts,
                                const void *wqkv, const float *bqkv, const void *wo,
                                const float *bo, const void *wgu, const float *bgu,
                                const void *wdown, const float *bdown, int64_t inter, float *xn,
                                float *qkv, float *attn, float *gu, float *act, int8_t *xq,
                                float *xs, int64_t num_q_heads, int64_t num_kv_heads, int64_t d,
                                const float *rope_cos, const float *rope_sin, void *k_cache,
                                void *v_cache, int64_t block_stride, int64_t head_stride,
                                int64_t block_size, const int64_t *block_tables,
                                int64_t table_width, const int64_t *context_lens, float scale,
                                float *scratch, int64_t scratch_stride, int64_t num_threads,
                                const kv_quant *kq, const kv_tree *tree, int64_t kv_dtype,
                                float *parts, int64_t parts_stride) {
    int64_t n_qkv = (num_q_heads + 2 * num_kv_heads) * d, n_attn = num_q_heads * d;
    if (num_threads < 1) num_threads = 1;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
    {
        int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
        /* rows [r0, r1) of the row-wise phases */
        int64_t r0 = batch * t / nt, r1 = batch * (t + 1) / nt;
        kv_rms_norm(x + r0 * hidden, attn_norm, xn + r0 * hidden, r1 - r0, hidden, eps);
        if (fmts) kv_quantize_rows(xn, r0, r1, hidden, xq, xs);
        BARRIER
        layer_linear(fmts, 0, xn, xq, xs, batch, hidden, wqkv, n_qkv, bqkv, qkv, t, nt, 0);
        BARRIER
        layer_attention(qkv, batch, num_q_heads, num_kv_heads, d, rope_cos, rope_sin, k_cache,
                        v_cache, block_stride, head_stride, block_size, block_tables, table_width,
                        context_lens, scale, attn, scratch + t * scratch_stride, kq, tree, kv_dtype,
                        parts, parts_stride, t, nt);
        if (fmts) {
            kv_quantize_rows(attn, r0, r1, n_attn, xq, xs);
            BARRIER
        }
        layer_linear(fmts, 1, attn, xq, xs, batch, n_attn, wo, hidden, bo, x, t, nt, 1);
        BARRIER
        kv_rms_norm(x + r0 * hidden, ffn_norm, xn + r0 * hidden, r1 - r0, hidden, eps);
        if (fmts) kv_quantize_rows(xn, r0, r1, hidden, xq, xs);
        BARRIER
        layer_linear(fmts, 2, xn, xq, xs, batch, hidden, wgu, 2 * inter, bgu, gu, t, nt, 0);
        BARRIER
        kv_silu_mul(gu + r0 * 2 * inter, act + r0 * inter, r1 - r0, inter);
        if (fmts) kv_quantize_rows(act, r0, r1, inter, xq, xs);
        BARRIER
        layer_linear(fmts, 3, act, xq, xs, batch, inter, wdown, hidden, bdown, x, t, nt, 1);
    }
}

void kv_decode_layer(float *x, int64_t batch, int64_t hidden, const float *attn_norm,
                     const float *ffn_norm, float eps, const float *wqkv, const float *bqkv,
                     const float *wo, const float *bo, const float *wgu, const float *bgu,
                     const float *wdown, const float *bdown, int64_t inter, float *xn, float *qkv,
                     float *attn, float *gu, float *act, int64_t num_q_heads,
                     int64_t num_kv_heads, int64_t d, const float *rope_cos,
                     const float *rope_sin, void *k_cache, void *v_cache, int64_t block_stride,
                     int64_t head_stride, int64_t block_size, const int64_t *block_tables,
                     int64_t table_width, const int64_t *context_lens, float scale,
                     float *scratch, int64_t scratch_stride, int64_t num_threads,
                     const kv_quant *kq, const kv_tree *tree, int64_t kv_dtype, float *parts,
                     int64_t parts_stride) {
    decode_layer(x, batch, hidden, attn_norm, ffn_norm, eps, NULL, wqkv, bqkv, wo, bo, wgu, bgu,
                 wdown, bdown, inter, xn, qkv, attn, gu, act, NULL, NULL, num_q_heads,
                 num_kv_heads, d, rope_cos, rope_sin, k_cache, v_cache, block_stride, head_stride,
                 block_size, block_tables, table_width, context_lens, scale, scratch,
                 scratch_stride, num_threads, kq, tree, kv_dtype, parts, parts_stride);
}

/* The same layer over weights kept in their GGUF block format (cpu_quant.c; CpuOps.
 * decode_layer_quant). Each linear layer's input rows are quantized per block of 32 to int8 by
 * the threads that produced them (right after their RMSNorm or SiLU-and-multiply, or after a
 * barrier for the attention's output, whose units cut across rows), then every thread multiplies
 * its share of the weight's output features by all rows (kv_qlinear_share):
 *
 *   xn = rms_norm(x), q(xn) -> qkv = q(xn) Wqkv -> rotary, KV store -> attention -> q(attn)
 *   -> x += q(attn) Wo -> xn = rms_norm(x), q(xn) -> gu = q(xn) Wgate_up
 *   -> act = silu(gate) * up, q(act) -> x += q(act) Wdown
 *
 * The same kernels in the same order as the per-module path (QuantLinear on CpuOps.quant_linear,
 * which quantizes its input rows the same way), so the result is bit for bit that path's.
 * fmts: the four weights' formats (KV_Q8_0 ...) in the order wqkv, wo, wgu, wdown; xq (batch,
 * max_k) int8 and xs (batch, qk_scale_stride(max_k)) float: room for one quantized input, max_k
 * the widest of hidden, num_q_heads * d and inter. Other arguments as kv_decode_layer's. */
void kv_decode_layer_quant(float *x, int64_t batch, int64_t hidden, const float *attn_norm,
                           const float *ffn_norm, float eps, const int64_t *fmts,
                           const uint8_t *wqkv, const float *bqkv, const uint8_t *wo,
                           const float *bo, const uint8_t *wgu, const float *bgu,
                           const uint8_t *wdown, const float *bdown, int64_t inter, float *xn,
                           float *qkv, float *attn, float *gu, float *act, int8_t *xq, float *xs,
                           int64_t num_q_heads, int64_t num_kv_heads, int64_t d,
                           const float *rope_cos, const float *rope_sin, void *k_cache,
                           void *v_cache, int64_t block_stride, int64_t head_stride,
                           int64_t block_size, const int64_t *block_tables, int64_t table_width,
                           const int64_t *context_lens, float scale, float *scratch,
                           int64_t scratch_stride, int64_t num_threads, const kv_quant *kq,
                           const kv_tree *tree, int64_t kv_dtype, float *parts,
                           int64_t parts_stride) {
    decode_layer(x, batch, hidden, attn_norm, ffn_norm, eps, fmts, wqkv, bqkv, wo, bo, wgu, bgu,
                 wdown, bdown, inter, xn, qkv, attn, gu, act, xq, xs, num_q_heads, num_kv_heads,
                 d, rope_cos, rope_sin, k_cache, v_cache, block_stride, head_stride, block_size,
                 block_tables, table_width, context_lens, scale, scratch, scratch_stride,
                 num_threads, kq, tree, kv_dtype, parts, parts_stride);
}
