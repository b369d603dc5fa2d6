/* A Llama decoder layer's two halves for the few rows of a decode step, one call each.
 *
 * At a handful of rows each of a layer's ten kernels does a few microseconds of work, and the
 * Python around each call (argument checks, allocations, module dispatch, all of it cold after
 * the weights have streamed through the caches) cost more than the kernels themselves: about
 * 10 ms of a 30 ms step for the default model on the AVX2 EPYC. These run the same kernels
 * in the same order with the same roundings as the module path of worker/llama.py, so their
 * results are identical to it; only the Python between them is gone. The halves split where
 * tensor parallelism all-reduces: after the attention's output projection and after the MLP.
 */
#include <stdint.h>
#include <stdlib.h>

#include "dtypes.h"
#include "kernels.h"

/* A linear layer's weight [out, in]: streamed (bfloat16 or float32, `streamed_dtype`), or GGUF
 * blocks (exactly one of the pointers is non-NULL). */
struct LayerWeight {
    const void *streamed;
    const struct QuantizedMatrix *quantized;
    int32_t streamed_dtype;
};

/* One layer's attention half: weights in the layout worker/llama.py holds them. */
struct AttentionLayer {
    const void *input_norm;      /* [hidden] of the activations' dtype */
    struct LayerWeight qkv;      /* [(heads + 2 kv_heads) head_dim, hidden] */
    const float *qkv_bias;       /* [(heads + 2 kv_heads) head_dim] or NULL */
    struct LayerWeight o_proj;   /* [hidden, heads head_dim] */
    int32_t hidden, heads, kv_heads, head_dim, sliding_window; /* sliding_window 0: full attention */
    float eps, scale;
};

/* One layer's MLP half. */
struct MlpLayer {
    const void *post_attention_norm; /* [hidden] of the activations' dtype */
    struct LayerWeight gate_up;      /* [2 intermediate, hidden] */
    const float *gate_up_bias;       /* [2 intermediate] or NULL */
    struct LayerWeight down;         /* [hidden, intermediate] */
    int32_t hidden, intermediate;
    float eps;
};

/* What every layer of one step shares: the rows, their rotary angles and where their keys and
 * values go (kernels/reference.py's attention metadata). */
struct DecodeStep {
    int64_t rows;
    int32_t dtype, num_threads;
    const float *cos, *sin;       /* [rows, head_dim / 2] */
    const int64_t *slot_mapping;  /* [rows] */
    const int32_t *block_tables;  /* [num_seqs, block_table_stride] */
    int64_t block_table_stride;
    const int32_t *query_start_loc, *seq_lens;
    int32_t num_seqs;
};

/* The paged cache a layer reads and writes: [2, num_blocks, block_size, kv_heads, head_dim], the keys
 * tiled as kv_layout.h lays them out. */
struct KvCache {
    void *data;
    int64_t num_blocks;
    int32_t block_size, dtype;
};

enum { FUSED_OK = 0, FUSED_NO_MEMORY = -1, FUSED_SLOT_OUTSIDE_CACHE = -2, FUSED_UNSUPPORTED_SHAPE = -3 };

/* out = x W^T + bias through the kernel of W's storage; FUSED_OK or FUSED_NO_MEMORY (the shapes
 * were checked when the layer was built). */
static int layer_linear(const struct LayerWeight *w, const void *x, int dtype, int64_t rows, int64_t in_features,
                        int64_t out_features, const float *bias, void *out, int threads)
{
    const int status = w->quantized
                           ? quantized_linear(w->quantized, x, dtype, rows, in_features, bias, out, dtype, threads)
                           : small_batch_linear(x, dtype, rows, in_features, w->streamed, w->streamed_dtype,
                                                out_features, bias, out, dtype, threads);
    return status ? FUSED_NO_MEMORY : FUSED_OK;
}

/* activated = silu(gate) * up of [gate | up] = x gate_up^T + bias: in one call on GGUF blocks
 * (quantized_swiglu), else the linear's output then silu_and_mul. FUSED_OK or FUSED_NO_MEMORY. */
static int swiglu_linear(const struct LayerWeight *gate_up, const void *x, int dtype, int64_t rows,
                         int64_t in_features, int64_t intermediate, const float *bias, void *activated, int threads)
{
    if (gate_up->quantized)
        return quantized_swiglu(gate_up->quantized, x, dtype, rows, in_features, bias, activated, dtype, threads)
                   ? FUSED_NO_MEMORY
                   : FUSED_OK;
    char *both = malloc(rows * 2 * intermediate * dtype_size(dtype));
    int status = both ? layer_linear(gate_up, x, dtype, rows, in_features, 2 * intermediate, bias, both, threads)
                      : FUSED_NO_MEMORY;
    if (status == FUSED_OK) silu_and_mul(both, activated, rows, (int)intermediate, dtype, threads);
    free(both);
    return status;
}

/* out = o_proj(attention(rotary(qkv(norm(hidden + residual))))), for the step's rows; the sum
 * hidden + residual is written into `residual` (NULL: hidden is the first layer's input and
 * itself the residual). `out` holds partial sums when the heads are split across ranks. Returns
 * FUSED_OK, or before touching anything FUSED_UNSUPPORTED_SHAPE (the attention kernel does not
 * take these shapes), or FUSED_SLOT_OUTSIDE_CACHE / FUSED_NO_MEMORY. */
int attention_block(const struct AttentionLayer *layer, const struct DecodeStep *step, const struct KvCache *cache,
                    const void *hidden, void *residual, void *out)
{
    if (!paged_attention_supports(layer->heads, layer->kv_heads, layer->head_dim, cache->block_size))
        return FUSED_UNSUPPORTED_SHAPE;
    const int64_t rows = step->rows;
    const int dtype = step->dtype, threads = step->num_threads;
    const size_t item = dtype_size(dtype);
    const int64_t q_width = (int64_t)layer->heads * layer->head_dim, kv_width = (int64_t)layer->kv_heads * layer->head_dim;
    const int64_t qkv_width = q_width + 2 * kv_width;
    char *normed = malloc(rows * layer->hidden * item), *qkv = malloc(rows * qkv_width * item);
    char *attended = malloc(rows * q_width * item);
    int status = normed && qkv && attended ? FUSED_OK : FUSED_NO_MEMORY;
    if (status == FUSED_OK) {
        rms_norm(hidden, residual, layer->input_norm, normed, rows, layer->hidden, dtype, layer->eps, threads);
        status = layer_linear(&layer->qkv, normed, dtype, rows, layer->hidden, qkv_width, layer->qkv_bias, qkv,
                              threads);
    }
    if (status == FUSED_OK) {
        /* q and k heads sit side by side at the start of each row: one rotation covers both. */
        rotary_embedding(qkv, qkv_width, rows, layer->heads + layer->kv_heads, layer->head_dim, dtype, step->cos,
                         step->sin, threads);
        const char *keys = qkv + q_width * item, *values = qkv + (q_width + kv_width) * item;
        if (write_kv_cache(keys, qkv_width, values, qkv_width, dtype, cache->data,
                           cache->num_blocks * cache->block_size, cache->dtype, layer->kv_heads, layer->head_dim,
                           step->slot_mapping, rows, threads))
            status = FUSED_SLOT_OUTSIDE_CACHE;
    }
    if (status == FUSED_OK
        && paged_attention(qkv, qkv_width, layer->head_dim, dtype, cache->data, cache->dtype, cache->num_blocks,
                           cache->block_size, layer->kv_heads, layer->head_dim, step->block_tables,
                           step->block_table_stride, step->query_start_loc, step->seq_lens, step->num_seqs,
                           layer->heads, layer->sliding_window, 0, layer->scale, attended, threads))
        status = FUSED_NO_MEMORY;
    if (status == FUSED_OK)
        status = layer_linear(&layer->o_proj, attended, dtype, rows, q_width, layer->hidden, NULL, out, threads);
    free(normed);
    free(qkv);
    free(attended);
    return status;
}

/* out = down(silu(gate) * up) of gate_up(norm(hidden + residual)), the sum written into
 * `residual` as in attention_block. Returns FUSED_OK or FUSED_NO_MEMORY. */
int mlp_block(const struct MlpLayer *layer, const struct DecodeStep *step, const void *hidden, void *residual,
              void *out)
{
    const int64_t rows = step->rows;
    const int dtype = step->dtype, threads = step->num_threads;
    const size_t item = dtype_size(dtype);
    char *normed = malloc(rows * layer->hidden * item), *activated = malloc(rows * layer->intermediate * item);
    int status = normed && activated ? FUSED_OK : FUSED_NO_MEMORY;
    if (status == FUSED_OK) {
        rms_norm(hidden, residual, layer->post_attention_norm, normed, rows, layer->hidden, dtype, layer->eps, threads);
        status = swiglu_linear(&layer->gate_up, normed, dtype, rows, layer->hidden, layer->intermediate,
                               layer->gate_up_bias, activated, threads);
    }
    if (status == FUSED_OK)
        status = layer_linear(&layer->down, activated, dtype, rows, layer->intermediate, layer->hidden, NULL, out,
                              threads);
    free(normed);
    free(activated);
    return status;
}

/* Every layer of a stage held by one rank (no all-reduce between the halves): layer i's
 * attention_block then its mlp_block, for `layers` layers, the Python between the layers gone
 * too. `hidden` and `residual` (NULL: hidden is the residual, as in attention_block) as for the
 * first layer; the last layer's output goes to `out`, the running residual sum into `residual`,
 * or into `hidden` when it was NULL. Returns as attention_block, FUSED_UNSUPPORTED_SHAPE before
 * touching anything. */
int decoder_stack(const struct AttentionLayer *attention, const struct MlpLayer *mlp, const struct KvCache *caches,
                  int32_t layers, const struct DecodeStep *step, void *hidden, void *residual, void *out)
{
    for (int i = 0; i < layers; i++)
        if (!paged_attention_supports(attention[i].heads, attention[i].kv_heads, attention[i].head_dim,
                                      caches[i].block_size))
            return FUSED_UNSUPPORTED_SHAPE;
    char *attended = malloc(step->rows * attention[0].hidden * dtype_size(step->dtype));
    int status = attended ? FUSED_OK : FUSED_NO_MEMORY;
    const void *x = hidden;
    for (int i = 0; i < layers && status == FUSED_OK; i++) {
        status = attention_block(&attention[i], step, &caches[i], x, residual, attended);
        if (!residual) residual = hidden;
        if (status == FUSED_OK) status = mlp_block(&mlp[i], step, attended, residual, out);
        x = out;
    }
    free(attended);
    return status;
}
