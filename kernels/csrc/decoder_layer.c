/* A Llama decoder layer's two halves for the few rows of a decode step, one call each.
 *
 * At a handful of rows each of a layer's ten kernels does a few microseconds of work, and the
 * Python around each call (argument checks, allocations, module dispatch, all of it cold after
 * the weights have streamed through the caches) cost more than the kernels themselves: about
 * 10 ms of a 30 ms step for the default model on the AVX2 EPYC. These run the same kernels
 * in the same order with the same roundings as the module path of worker/llama.py, so their
 * results are identical to it; only the Python between them is gone. The halves split where
 * tensor parallelism all-reduces: after the attention's output projection and after the MLP.
 * A rank alone in its group runs all its layers in one call (decoder_stack), and a step of a few
 * rows on GGUF blocks all of them in one parallel region (decoder_stack_in_region).
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

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

/* The most rows decoder_stack_in_region takes: each thread does every row's row-wise work itself,
 * which past a few rows costs more than the forks it saves. */
enum { IN_REGION_MAX_ROWS = 16 };

/* Whether decoder_stack_in_region takes this step: at most IN_REGION_MAX_ROWS rows, and every
 * layer's four linears multiplying GGUF blocks in the int16 kernel, the one it runs them with. */
static int stack_in_region_supports(const struct AttentionLayer *attention, const struct MlpLayer *mlp,
                                    int32_t layers, const struct DecodeStep *step)
{
    if (step->rows > IN_REGION_MAX_ROWS) return 0;
    for (int i = 0; i < layers; i++) {
        const struct LayerWeight *weights[4] = {&attention[i].qkv, &attention[i].o_proj, &mlp[i].gate_up, &mlp[i].down};
        for (int k = 0; k < 4; k++)
            if (!weights[k]->quantized
                || !quantized_linear_in_region_supports(weights[k]->quantized, step->dtype, step->rows))
                return 0;
    }
    return 1;
}

/* Bytes of one thread's own buffers in decoder_stack_in_region, each aligned to 64 bytes: the
 * running residual sum, a normed row set, the SwiGLU activations and their quantization. */
struct OwnBuffers {
    size_t sum, normed, activated, quantized;
};

static size_t aligned_64(size_t bytes) { return (bytes + 63) / 64 * 64; }

/* decoder_stack's layers in one parallel region: the same kernels in the same order, so the same
 * bits, where a region per kernel forked the threads 150 times a one-row step of the default
 * model, each fork slow with the team's state pushed out of the caches by the weights streamed
 * since the last. The linears, the rotary and KV writes and the attention share their work among
 * the threads, a barrier after each; the row-wise work between them (the norms with the residual
 * sum, SwiGLU, the activations' quantization) each thread does whole for itself, into its own
 * buffers, without waiting for the others. One row, EPYC-Zen4, alternated in one process: the
 * stack 6-14% faster, single-stream decode 1.09x (1.10-1.23x at the host's fast reads). */
static int decoder_stack_in_region(const struct AttentionLayer *attention, const struct MlpLayer *mlp,
                                   const struct KvCache *caches, int32_t layers, const struct DecodeStep *step,
                                   void *hidden, void *residual, void *out)
{
    const int64_t rows = step->rows;
    const int dtype = step->dtype, threads = step->num_threads;
    const size_t item = dtype_size(dtype);
    int64_t widest_qkv = 0, widest_heads = 0, widest_intermediate = 0;
    for (int i = 0; i < layers; i++) {
        const int64_t heads = (int64_t)attention[i].heads * attention[i].head_dim;
        const int64_t qkv = heads + 2 * (int64_t)attention[i].kv_heads * attention[i].head_dim;
        widest_qkv = qkv > widest_qkv ? qkv : widest_qkv;
        widest_heads = heads > widest_heads ? heads : widest_heads;
        widest_intermediate = mlp[i].intermediate > widest_intermediate ? mlp[i].intermediate : widest_intermediate;
        const struct KvCache *cache = &caches[i];
        if (!kv_slots_valid(step->slot_mapping, rows, cache->num_blocks * cache->block_size, attention[i].head_dim))
            return FUSED_SLOT_OUTSIDE_CACHE;
    }
    const int64_t hidden_width = attention[0].hidden;
    int64_t widest_input = hidden_width > widest_heads ? hidden_width : widest_heads;
    widest_input = widest_intermediate > widest_input ? widest_intermediate : widest_input;
    const size_t row_bytes = aligned_64(rows * hidden_width * item);
    const struct OwnBuffers own_sizes = {row_bytes, row_bytes, aligned_64(rows * widest_intermediate * item),
                                         aligned_64(quantized_activations_bytes(rows, widest_input))};
    const size_t own_bytes = own_sizes.sum + own_sizes.normed + own_sizes.activated + own_sizes.quantized;
    char *own = aligned_alloc(64, own_bytes * threads), *qkv = malloc(rows * widest_qkv * item);
    char *heads_out = malloc(rows * widest_heads * item), *attended = malloc(rows * hidden_width * item);
    char *both = malloc(rows * 2 * widest_intermediate * item);
    struct AttentionWork **works = calloc(layers, sizeof *works);
    int status = own && qkv && heads_out && attended && both && works ? FUSED_OK : FUSED_NO_MEMORY;
    for (int i = 0; i < layers && status == FUSED_OK; i++) {
        const struct AttentionLayer *a = &attention[i];
        const int64_t qkv_width = ((int64_t)a->heads + 2 * a->kv_heads) * a->head_dim;
        works[i] = attention_work(qkv, qkv_width, a->head_dim, dtype, caches[i].data, caches[i].dtype,
                                  caches[i].num_blocks, caches[i].block_size, a->kv_heads, a->head_dim,
                                  step->block_tables, step->block_table_stride, step->query_start_loc, step->seq_lens,
                                  step->num_seqs, a->heads, a->sliding_window, 0, a->scale, heads_out, threads);
        if (!works[i]) status = FUSED_NO_MEMORY;
    }
    if (status == FUSED_OK) {
#pragma omp parallel num_threads(threads)
        {
            char *sum = own + omp_get_thread_num() * own_bytes, *normed = sum + own_sizes.sum;
            char *activated = normed + own_sizes.normed, *quantized = activated + own_sizes.activated;
            if (residual) memcpy(sum, residual, rows * hidden_width * item);
            const void *x = hidden;
            for (int i = 0; i < layers; i++) {
                const struct AttentionLayer *a = &attention[i];
                const struct MlpLayer *m = &mlp[i];
                const int64_t q_width = (int64_t)a->heads * a->head_dim, kv_width = (int64_t)a->kv_heads * a->head_dim;
                const int64_t qkv_width = q_width + 2 * kv_width;
                const int first_sum = i == 0 && !residual; /* the first layer's input is the residual */
                rms_norm_rows(x, first_sum ? NULL : sum, a->input_norm, normed, rows, a->hidden, dtype, a->eps, 0);
                if (first_sum) memcpy(sum, x, rows * hidden_width * item);
                quantize_activations(normed, dtype, rows, a->hidden, quantized);
                quantized_linear_in_region(a->qkv.quantized, quantized, rows, a->hidden, a->qkv_bias, qkv, dtype);
                /* Each row rotated and its key and value cached by one thread, one barrier for both. */
#pragma omp for schedule(static)
                for (int64_t r = 0; r < rows; r++) {
                    char *row = qkv + r * qkv_width * item;
                    const int64_t angles = r * (a->head_dim / 2);
                    rotary_rows(row, qkv_width, 1, a->heads + a->kv_heads, a->head_dim, dtype, step->cos + angles,
                                step->sin + angles, 0);
                    write_kv_rows(row + q_width * item, qkv_width, row + (q_width + kv_width) * item, qkv_width, dtype,
                                  caches[i].data, caches[i].num_blocks * caches[i].block_size, caches[i].dtype,
                                  a->kv_heads, a->head_dim, step->slot_mapping + r, 1, 0);
                }
                attention_in_region(works[i]);
                quantize_activations(heads_out, dtype, rows, q_width, quantized);
                quantized_linear_in_region(a->o_proj.quantized, quantized, rows, q_width, NULL, attended, dtype);
                rms_norm_rows(attended, sum, m->post_attention_norm, normed, rows, m->hidden, dtype, m->eps, 0);
                quantize_activations(normed, dtype, rows, m->hidden, quantized);
                quantized_linear_in_region(m->gate_up.quantized, quantized, rows, m->hidden, m->gate_up_bias, both,
                                           dtype);
                silu_and_mul_rows(both, activated, rows, m->intermediate, dtype, 0);
                quantize_activations(activated, dtype, rows, m->intermediate, quantized);
                quantized_linear_in_region(m->down.quantized, quantized, rows, m->intermediate, NULL, out, dtype);
                x = out;
            }
            /* After the last barrier: every thread has read `hidden` and `residual`. */
            if (omp_get_thread_num() == 0) memcpy(residual ? residual : hidden, sum, rows * hidden_width * item);
        }
    }
    for (int i = 0; works && i < layers; i++) attention_work_free(works[i]);
    free(works);
    free(own);
    free(qkv);
    free(heads_out);
    free(attended);
    free(both);
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
    if (stack_in_region_supports(attention, mlp, layers, step))
        return decoder_stack_in_region(attention, mlp, caches, layers, step, hidden, residual, out);
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
