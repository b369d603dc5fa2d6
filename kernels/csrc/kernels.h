/* The kernels that other kernels call: decoder_layer.c strings them together. */
#pragma once
#include <stddef.h>
#include <stdint.h>

void rms_norm(const void *x, void *residual, const void *weight, void *out, int64_t rows, int width, int dtype,
              float eps, int num_threads);
void rotary_embedding(void *x, int64_t row_stride, int64_t rows, int heads, int head_dim, int dtype,
                      const float *cos, const float *sin, int num_threads);
void silu_and_mul(const void *gate_up, void *out, int64_t rows, int width, int dtype, int num_threads);
int write_kv_cache(const void *key, int64_t key_stride, const void *value, int64_t value_stride, int dtype,
                   void *kv_cache, int64_t num_slots, int cache_dtype, int num_kv_heads, int head_dim,
                   const int64_t *slot_mapping, int64_t num_tokens, int num_threads);
int paged_attention_supports(int num_heads, int num_kv_heads, int head_dim, int block_size);
int paged_attention(
    const void *query, int64_t query_token_stride, int64_t query_head_stride, int query_dtype,
    const void *kv_cache, int cache_dtype, int64_t num_blocks, int block_size, int num_kv_heads, int head_dim,
    const int32_t *block_tables, int64_t block_table_stride, const int32_t *query_start_loc,
    const int32_t *seq_lens, int num_seqs, int num_heads, int sliding_window, int long_chunk_tokens, float scale,
    void *out, int num_threads);
int small_batch_linear(
    const void *x, int x_dtype, int64_t rows, int64_t in_features, const void *weight, int weight_dtype,
    int64_t out_features, const float *bias, void *out, int out_dtype, int num_threads);
/* small_batch_linear's bodies: the portable one, and (where the build has AVX512-BF16) the one for
 * bfloat16 rows on bfloat16 weights; small_batch_linear_body() says which the dispatcher uses for
 * them (0, 1). */
int small_batch_linear_portable(
    const void *x, int x_dtype, int64_t rows, int64_t in_features, const void *weight, int weight_dtype,
    int64_t out_features, const float *bias, void *out, int out_dtype, int num_threads);
/* A prefill chunk's attention in float32 (any query and cache dtypes), and in bfloat16 where
 * the build has AVX512-BF16: chunk_attention_bf16_body() says how (0: it declines, 1: with
 * vdpbf16ps, 2: on AMX tiles). */
int chunk_attention(const char *query, int64_t query_token_stride, int64_t query_head_stride, int dtype,
                    const char *kv_cache, int cache_dtype, int64_t num_blocks, int block_size, int num_kv_heads,
                    int head_dim, const int32_t *blocks, int64_t rows, int64_t context, int num_heads,
                    int sliding_window, float scale, char *out, int num_threads);
int chunk_attention_bf16_body(void);
int chunk_attention_bf16(const uint16_t *query, int64_t query_token_stride, int64_t query_head_stride,
                         const uint16_t *kv_cache, int64_t num_blocks, int block_size, int num_kv_heads,
                         int head_dim, const int32_t *blocks, int64_t rows, int64_t context, int num_heads,
                         int sliding_window, float scale, uint16_t *out, int num_threads);
int small_batch_linear_avx512bf16(
    const uint16_t *x, int64_t rows, int64_t in_features, const uint16_t *weight, int64_t out_features,
    const float *bias, void *out, int out_dtype, int num_threads);
int small_batch_linear_body(void);
/* A weight matrix in GGUF's quantized blocks: up to three row ranges stacked (a merged q/k/v or
 * gate/up whose parts the file stores in different types), each of `rows[p]` rows of `types[p]`
 * blocks (ggml's type codes; Q4_0, Q4_1 and Q8_0 | 0x100: rows interleaved 16 at a time by gguf_interleave)
 * at `data[p]`. */
struct QuantizedMatrix {
    int32_t parts;
    int32_t types[3];
    int64_t rows[3];
    const uint8_t *data[3];
    /* Steps of at least this many bfloat16 rows multiply interleaved parts by vdpbf16ps where the
     * build has AVX512-BF16 and no AMX tiles are granted (0: never); measured at start. */
    int64_t bfloat16_dot_rows;
};
int quantized_linear(const struct QuantizedMatrix *matrix, const void *x, int x_dtype, int64_t rows,
                     int64_t in_features, const float *bias, void *out, int out_dtype, int num_threads);
int quantized_swiglu(const struct QuantizedMatrix *matrix, const void *x, int x_dtype, int64_t rows,
                     int64_t in_features, const float *bias, void *out, int out_dtype, int num_threads);
int gguf_linear_supports(int type, int64_t in_features);
int gguf_linear_body(void);
int gguf_interleave(const uint8_t *data, int type, int64_t rows, int64_t cols, uint8_t *out);
int gguf_dequantize(const uint8_t *data, int type, int64_t rows, int64_t cols, const int64_t *ids,
                    int64_t stored_rows, void *out, int out_dtype, int num_threads);

/* The pieces decoder_layer.c runs a decode step's stack of layers with in one parallel region.
 * Those with a `shared` flag share their rows among the region's threads (returning after their
 * barrier) or, without it, do them all on the calling thread; quantize_activations always does;
 * attention_in_region and quantized_linear_in_region share their work (returning after a barrier). */
struct AttentionWork;
void rms_norm_rows(const void *x, void *residual, const void *weight, void *out, int64_t rows, int width,
                   int dtype, float eps, int shared);
void rotary_rows(void *x, int64_t row_stride, int64_t rows, int heads, int head_dim, int dtype, const float *cos,
                 const float *sin, int shared);
void silu_and_mul_rows(const void *gate_up, void *out, int64_t rows, int width, int dtype, int shared);
int kv_slots_valid(const int64_t *slot_mapping, int64_t num_tokens, int64_t num_slots, int head_dim);
void write_kv_rows(const void *key, int64_t key_stride, const void *value, int64_t value_stride, int dtype,
                   void *kv_cache, int64_t num_slots, int cache_dtype, int num_kv_heads, int head_dim,
                   const int64_t *slot_mapping, int64_t num_tokens, int shared);
struct AttentionWork *attention_work(
    const void *query, int64_t query_token_stride, int64_t query_head_stride, int query_dtype,
    const void *kv_cache, int cache_dtype, int64_t num_blocks, int block_size, int num_kv_heads, int head_dim,
    const int32_t *block_tables, int64_t block_table_stride, const int32_t *query_start_loc,
    const int32_t *seq_lens, int num_seqs, int num_heads, int sliding_window, int long_chunk_tokens, float scale,
    void *out, int num_threads);
void attention_in_region(const struct AttentionWork *work);
void attention_work_free(struct AttentionWork *work);
int quantized_linear_in_region_supports(const struct QuantizedMatrix *matrix, int x_dtype, int64_t rows);
size_t quantized_activations_bytes(int64_t rows, int64_t in_features);
void quantize_activations(const void *x, int x_dtype, int64_t rows, int64_t in_features, void *quantized);
void quantized_linear_in_region(const struct QuantizedMatrix *matrix, const void *quantized, int64_t rows,
                                int64_t in_features, const float *bias, void *out, int out_dtype);

/* One linear's LoRA slots in kernels/lora.py's layout: a [in_features][parts][slots][max_rank],
 * b [slots][max_rank][sum of rows] (each part's B in its own columns, the scale folded in), both
 * in `dtype`; rows[p] is part p's output columns. */
struct LoraPool {
    int32_t parts, slots, max_rank, dtype;
    int64_t in_features;
    int64_t rows[3];
    const void *a;
    const void *b;
};
int lora_add(const struct LoraPool *pool, const void *x, int x_dtype, int64_t tokens, const int64_t *token_slots,
             void *y, int y_dtype, int num_threads);
