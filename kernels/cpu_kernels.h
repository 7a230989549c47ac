/* The kernels that one C file of kvmesh's CPU path calls in another: cpu_layer.c runs the phases
 * of a decoder layer with those of cpu_ops.c and cpu_linear.c. Every one of these files includes
 * this header, so the compiler checks each definition against its declaration here.
 */
#ifndef KVMESH_CPU_KERNELS_H
#define KVMESH_CPU_KERNELS_H

#include <stdint.h>

typedef struct kv_quant kv_quant; /* fp8 or int8 KV: see cpu_ops.c */
typedef struct kv_tree kv_tree; /* draft-tree rows: see cpu_ops.c */

/* The element type of an unquantized KV cache (kv_dtype arguments): float32, IEEE half or
 * bfloat16; stored rounded to nearest even as torch's casts do, read back as float32. */
enum { KV_F32 = 0, KV_F16 = 1, KV_BF16 = 2 };

/* The block formats of cpu_quant.c and cpu_dequant.c: FORMAT_CODES of shared/model/
 * quant_formats.py (3 .. 7: cpu_kquant.c's), QB values a block of block_bytes[format] bytes, a
 * paired weight's rows interleaved QG at a time (shared/model/quant_paired.py) */
#define QB 32 /* values per block */
#define QG 16 /* rows of a paired weight per interleaved group; threads split at groups */
enum { KV_Q8_0 = 0, KV_Q4_0 = 1, KV_Q4_1 = 2, KV_Q5_0 = 8, KV_Q5_1 = 9 };
static const int64_t block_bytes[10] = {34, 18, 20, 0, 0, 0, 0, 0, 22, 24};

void kv_rms_norm(const float *x, const float *w, float *out, int64_t rows, int64_t n, float eps);
void kv_silu_mul(const float *gate_up, float *out, int64_t rows, int64_t n);
void kv_linear_share(const float *x, int64_t m, int64_t k, const float *packed, int64_t n,
                     const float *bias, float *y, int64_t t, int64_t num_threads, int accumulate);
void kv_decode_store_units(float *qkv, int64_t num_q_heads, int64_t num_kv_heads, int64_t d,
                           const float *rope_cos, const float *rope_sin, void *k_cache,
                           void *v_cache, int64_t block_stride, int64_t head_stride,
                           int64_t block_size, const int64_t *block_tables, int64_t table_width,
                           const int64_t *context_lens, int64_t u0, int64_t u1,
                           const kv_tree *tree, int64_t kv_dtype);
void kv_decode_store_quant(float *qkv, int64_t batch, int64_t num_q_heads, int64_t num_kv_heads,
                           int64_t d, const float *rope_cos, const float *rope_sin,
                           uint8_t *k_cache, uint8_t *v_cache, int64_t block_stride,
                           int64_t head_stride, int64_t block_size, const int64_t *block_tables,
                           int64_t table_width, const int64_t *context_lens, const kv_quant *kq,
                           int64_t h0, int64_t h1, const kv_tree *tree);
void kv_decode_attention_units(const float *qkv, int64_t num_q_heads, int64_t num_kv_heads,
                               int64_t d, const void *k_pool, const void *v_pool,
                               int64_t block_stride, int64_t head_stride, int64_t block_size,
                               const int64_t *block_tables, int64_t table_width,
                               const int64_t *context_lens, float scale, float *out,
                               float *scratch, int64_t u0, int64_t u1, const kv_quant *kq,
                               const kv_tree *tree, int64_t kv_dtype);
int64_t kv_attention_parts_floats(int64_t table_width, int64_t block_size, int64_t group,
                                  int64_t d);
void kv_decode_attention_split(const float *qkv, int64_t batch, int64_t num_q_heads,
                               int64_t num_kv_heads, int64_t d, const void *k_pool,
                               const void *v_pool, int64_t block_stride, int64_t head_stride,
                               int64_t block_size, const int64_t *block_tables,
                               int64_t table_width, const int64_t *context_lens, float scale,
                               float *out, float *scratch, float *parts, int64_t parts_stride,
                               int64_t t, int64_t nt, const kv_tree *tree, int64_t kv_dtype);
void kv_decode_attention_merge(int64_t batch, int64_t num_q_heads, int64_t num_kv_heads,
                               int64_t d, int64_t block_size, const int64_t *context_lens,
                               float *out, float *parts, int64_t parts_stride, int64_t t,
                               int64_t nt);
/* cpu_quant.c: linear layers over weights as stored (Q8_0, Q4_0, Q4_1; cpu_kquant.c: the
 * K-quants, F16, BF16; a stacked weight of parts in several), activations quantized per block */
int64_t qk_scale_stride(int64_t k);
float kv_f16_to_f32(const uint8_t *p);
void kv_dequant_groups(int fmt, const uint8_t *w, int64_t groups, int64_t k, float *out,
                       int64_t num_threads);
void kv_quantize_rows(const float *x, int64_t r0, int64_t r1, int64_t k, int8_t *xq, float *xs);
void kv_qlinear_share(const float *x, const int8_t *xq, const float *xs, int64_t m, int64_t k,
                      int fmt, const uint8_t *w, int64_t n, const float *bias, float *y,
                      int64_t t, int64_t nt, int accumulate);
int64_t kv_kq_row_bytes(int fmt, int64_t k);
void kv_kq_cols(const float *x, const int8_t *xq, const float *xs, int64_t m, int64_t k, int fmt,
                const uint8_t *w, int64_t c0, int64_t c1, const float *bias, float *y, int64_t n,
                int accumulate);
int64_t kv_attention_unit_bound(const int64_t *context_lens, int64_t batch, int64_t num_kv_heads,
                                int64_t t, int64_t num_threads);

#endif
