/* A paired weight's interleaved groups of rows dequantized to float32, for a prefill chunk's
 * float GEMM (kernels/cpu_bindings.py, CpuOps.dequantize; the layout is shared/model/
 * quant_paired.py's and cpu_quant.c's: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1).
 *
 * Why: from FLOAT_GEMM_ROWS rows on, a weight kept as stored is dequantized once per call and
 * multiplied in float (the prompt's activations keep their precision: shared/model/
 * cpu_modules.py). torch's gathers and casts over the interleaved bytes took about as long as
 * the GEMM itself (SmolLM2's 1728 x 576 Q8_0 projection: 4.8 ms against 5.0 ms for 512 rows);
 * this reads each byte once and writes each float once.
 *
 * The values are torch's reference (quant_paired._dequantize_groups) bit for bit: d q for Q8_0,
 * d q + m for Q4_1 and Q5_1, d (q - 8) and d (q - 16) for Q4_0 and Q5_0, each a float32 product
 * (and sum) of the float16 scales widened, no fused multiply-add (the build's
 * -ffp-contract=off).
 *
 * One group (QG = 16 rows, every block b of them) is QG * block_bytes[fmt] a block: the 16 d
 * (float16), for Q4_1 and Q5_1 the 16 m, for Q5 8 masks of 64 bits (bit 4c + t of mask j: row c's
 * value 4j + t's fifth bit), then chunks of 64 bytes, chunk i's bytes 4c .. 4c + 4 being row c's
 * value bytes 4i .. 4i + 4: Q8_0's 8 chunks of q + 128, Q4's and Q5's 4 of nibble bytes (value
 * 4i + t in the low nibble, 16 + 4i + t in the high one).
 */
#include <stdint.h>
#include <string.h>

#include "cpu_kernels.h"

/* Block b of the group at gb (its QG rows) into out's rows (row stride k) at column b * 32:
 * the integers first into a tile in row order (the chunks read in sequence), then each row
 * scaled (loops the compiler vectorizes). */
static void dequant_group_block(int fmt, const uint8_t *gb, float *out, int64_t k) {
    const int has_m = fmt == KV_Q4_1 || fmt == KV_Q5_1, q5 = fmt == KV_Q5_0 || fmt == KV_Q5_1;
    float d[QG], m[QG], q[QG][QB];
    for (int c = 0; c < QG; c++) {
        d[c] = kv_f16_to_f32(gb + 2 * c);
        m[c] = has_m ? kv_f16_to_f32(gb + 2 * QG + 2 * c) : 0.0f;
    }
    const uint8_t *masks = gb + 2 * QG * (1 + has_m);
    const uint8_t *chunks = masks + (q5 ? 8 * 8 : 0);
    if (fmt == KV_Q8_0) {
        for (int i = 0; i < 8; i++)
            for (int n = 0; n < 64; n++) /* byte n: row n / 4, value 4 i + n % 4 */
                q[n >> 2][4 * i + (n & 3)] = (float)(int8_t)(chunks[i * 64 + n] ^ 0x80);
        for (int c = 0; c < QG; c++)
            for (int j = 0; j < QB; j++) out[c * k + j] = d[c] * q[c][j];
        return;
    }
    for (int i = 0; i < 4; i++)
        for (int n = 0; n < 64; n++) { /* value 4 i + t in the low nibble, 16 + 4 i + t high */
            const uint8_t byte = chunks[i * 64 + n];
            q[n >> 2][4 * i + (n & 3)] = (float)(byte & 0x0f);
            q[n >> 2][16 + 4 * i + (n & 3)] = (float)(byte >> 4);
        }
    if (q5)
        for (int j = 0; j < 8; j++) { /* mask j's bit 4 c + t: row c's value 4 j + t */
            uint64_t mask;
            memcpy(&mask, masks + 8 * j, 8);
            for (int n = 0; n < 64; n++)
                if ((mask >> n) & 1) q[n >> 2][4 * j + (n & 3)] += 16.0f;
        }
    const float offset = fmt == KV_Q4_0 ? -8.0f : fmt == KV_Q5_0 ? -16.0f : 0.0f;
    for (int c = 0; c < QG; c++) {
        float *row = out + c * k;
        if (has_m)
            for (int j = 0; j < QB; j++) row[j] = d[c] * q[c][j] + m[c];
        else
            for (int j = 0; j < QB; j++) row[j] = d[c] * (q[c][j] + offset);
    }
}

/* out (groups * QG, k) float32 = the groups of a paired weight (fmt a KV_ code, no paired flag)
 * dequantized, on num_threads OpenMP threads (each its own groups). */
void kv_dequant_groups(int fmt, const uint8_t *w, int64_t groups, int64_t k, float *out,
                       int64_t num_threads) {
    const int64_t nb = k / QB, gbb = QG * block_bytes[fmt];
    if (num_threads < 1) num_threads = 1;
#pragma omp parallel for num_threads(num_threads) if (num_threads > 1) schedule(static)
    for (int64_t g = 0; g < groups; g++)
        for (int64_t b = 0; b < nb; b++)
            dequant_group_block(fmt, w + (g * nb + b) * gbb, out + g * QG * k + b * QB,
                                k);
}
