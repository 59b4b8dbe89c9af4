/* A whole decoder layer in one call, on the model file's blocks (labkit/kernels/native.py
   compiles this file with labkit_kernels.c and gguf_blocks.c, whose kernels it calls). */

#include <math.h>
#include <stdlib.h>
#include <string.h>

void labkit_gemv_q4_1(const unsigned char* W, const float* X, float* Y, long rows, long out,
                      long n);
void labkit_gemv_q8_0(const unsigned char* W, const float* X, float* Y, long rows, long out,
                      long n);
void labkit_gemv_q4_1_q8(const unsigned char* W, const float* X, float* Y, long rows,
                         long out, long n);
void labkit_gemv_q8_0_q8(const unsigned char* W, const float* X, float* Y, long rows,
                         long out, long n);
void labkit_gemv_q4_1x8_q8(const unsigned char* W, const float* X, float* Y, long rows,
                           long out, long n);
void labkit_gemv_bf16(const unsigned short* W, const float* X, float* Y, long rows, long out,
                      long n);
unsigned short labkit_bf16_from_float(float x);

/* ---- a whole decoder layer for a decode step, on the blocks -----------------------------

   For a step of a few rows, PyTorch's per-operation cost (some 45 small operations a layer)
   took longer than the matrix products themselves once the weights were 4-bit. This is the
   layer of labkit.models.llama.decoder_layer in one call, for rows of the paged engine:
     h = rms_norm(x) * attn_norm;  q, k, v = h Wqkv;  rotate q, k (RoPE, half-split pairs);
     store k, v at their (block, slot);  a = paged attention of q;  x += a Wo;
     h = rms_norm(x) * mlp_norm;  g, u = h Wgate_up;  x += (silu(g) * u) Wdown.
   x [rows, hidden] is updated in place. Each matrix is (blocks, kind) with kind 0 = Q4_1,
   1 = Q8_0, 2 = Q4_1 regrouped by eight rows (8-bit activations only), 3 = bfloat16 rows
   (bf16.c: activations rounded to bfloat16); `quantize_x` picks the 8-bit activation
   kernels. cos, sin: [rows, head_dim]. keys and values are float32, or bfloat16 where
   `kv_bf16` (each new entry rounded to the nearest bfloat16 as it is stored). */

void labkit_paged_attention(const float* keys, const float* values, const long* tables,
                            const long* tiles, const float* q, float* out, long num_tiles,
                            long width, long block_size, long kv_heads, long group, long dim,
                            float scale);
void labkit_paged_attention_bf16(const unsigned short* keys, const unsigned short* values,
                                 const long* tables, const long* tiles, const float* q, float* out,
                                 long num_tiles, long width, long block_size, long kv_heads,
                                 long group, long dim, float scale);

void labkit_silu_mul(const float* gate_up, float* act, long rows, long inter);  /* labkit_kernels.c */

static void matrix_product(const unsigned char* W, long kind, long quantize_x, const float* X,
                           float* Y, long rows, long out, long n) {
  if (kind == 3)
    labkit_gemv_bf16((const unsigned short*)W, X, Y, rows, out, n);
  else if (kind == 2)
    labkit_gemv_q4_1x8_q8(W, X, Y, rows, out, n);
  else if (kind == 0)
    (quantize_x ? labkit_gemv_q4_1_q8 : labkit_gemv_q4_1)(W, X, Y, rows, out, n);
  else
    (quantize_x ? labkit_gemv_q8_0_q8 : labkit_gemv_q8_0)(W, X, Y, rows, out, n);
}

/* The elementwise work of a layer: split over the threads once a step has many rows
   (prefill), left on the calling thread for a few (decode), where waking the team costs
   more than the work. */
#define MANY_ROWS 8

static void rms_norm_rows(const float* x, const float* weight, float* h, long rows, long n,
                          float eps) {
  #pragma omp parallel for schedule(static) if (rows >= MANY_ROWS)
  for (long r = 0; r < rows; r++) {
    float squares = 0.0f;
    for (long i = 0; i < n; i++) squares += x[r * n + i] * x[r * n + i];
    const float inverse = 1.0f / sqrtf(squares / (float)n + eps);
    for (long i = 0; i < n; i++) h[r * n + i] = weight[i] * (x[r * n + i] * inverse);
  }
}

static void rotate_heads(float* v, const float* cos, const float* sin, long heads, long dim) {
  const long half = dim / 2;
  for (long h = 0; h < heads; h++) {
    float* p = v + h * dim;
    for (long i = 0; i < half; i++) {
      const float a = p[i], b = p[i + half];
      p[i] = a * cos[i] - b * sin[i];
      p[i + half] = b * cos[i + half] + a * sin[i + half];
    }
  }
}

void labkit_decoder_layer_blocks(
    float* x, long rows, long hidden, long heads, long kv_heads, long dim, long intermediate,
    float eps, const float* attn_norm, const float* mlp_norm, const unsigned char* const* mats,
    const long* kinds, long quantize_x, const float* cos, const float* sin, void* keys,
    void* values, const long* new_blocks, const long* new_slots, const long* tables,
    const long* tiles, long num_tiles, long width, long block_size, long kv_bf16) {
  const long q_width = heads * dim, kv_width = kv_heads * dim, fused = q_width + 2 * kv_width;
  float* h = malloc(sizeof(float) * rows * hidden);
  float* qkv = malloc(sizeof(float) * rows * fused);
  float* q = malloc(sizeof(float) * rows * q_width);
  float* attn = malloc(sizeof(float) * rows * q_width);
  float* gate_up = malloc(sizeof(float) * rows * 2 * intermediate);
  float* act = malloc(sizeof(float) * rows * intermediate);
  float* delta = malloc(sizeof(float) * rows * hidden);

  rms_norm_rows(x, attn_norm, h, rows, hidden, eps);
  matrix_product(mats[0], kinds[0], quantize_x, h, qkv, rows, fused, hidden);
  #pragma omp parallel for schedule(static) if (rows >= MANY_ROWS)
  for (long r = 0; r < rows; r++) {
    float* row = qkv + r * fused;
    rotate_heads(row, cos + r * dim, sin + r * dim, heads, dim);                 /* q */
    rotate_heads(row + q_width, cos + r * dim, sin + r * dim, kv_heads, dim);    /* k */
    memcpy(q + r * q_width, row, sizeof(float) * q_width);
    for (long g = 0; g < kv_heads; g++) {
      const long block = new_blocks[r], slot = new_slots[r];
      const long k_at = ((block * kv_heads + g) * dim) * block_size + slot;  /* [dim, block_size] */
      const long v_at = ((block * kv_heads + g) * block_size + slot) * dim;
      const float* k_new = row + q_width + g * dim;
      const float* v_new = row + q_width + kv_width + g * dim;
      for (long d = 0; d < dim; d++) {
        if (kv_bf16) {
          ((unsigned short*)keys)[k_at + d * block_size] = labkit_bf16_from_float(k_new[d]);
          ((unsigned short*)values)[v_at + d] = labkit_bf16_from_float(v_new[d]);
        } else {
          ((float*)keys)[k_at + d * block_size] = k_new[d];
          ((float*)values)[v_at + d] = v_new[d];
        }
      }
    }
  }
  const float scale = 1.0f / sqrtf((float)dim);
  if (kv_bf16)
    labkit_paged_attention_bf16(keys, values, tables, tiles, q, attn, num_tiles, width, block_size,
                                kv_heads, heads / kv_heads, dim, scale);
  else
    labkit_paged_attention(keys, values, tables, tiles, q, attn, num_tiles, width, block_size,
                           kv_heads, heads / kv_heads, dim, scale);
  matrix_product(mats[1], kinds[1], quantize_x, attn, delta, rows, hidden, q_width);
  #pragma omp parallel for schedule(static) if (rows >= MANY_ROWS)
  for (long i = 0; i < rows * hidden; i++) x[i] += delta[i];

  rms_norm_rows(x, mlp_norm, h, rows, hidden, eps);
  matrix_product(mats[2], kinds[2], quantize_x, h, gate_up, rows, 2 * intermediate, hidden);
  #pragma omp parallel for schedule(static) if (rows >= MANY_ROWS)
  for (long r = 0; r < rows; r++)
    labkit_silu_mul(gate_up + r * 2 * intermediate, act + r * intermediate, 1, intermediate);
  matrix_product(mats[3], kinds[3], quantize_x, act, delta, rows, hidden, intermediate);
  #pragma omp parallel for schedule(static) if (rows >= MANY_ROWS)
  for (long i = 0; i < rows * hidden; i++) x[i] += delta[i];

  free(h), free(qkv), free(q), free(attn), free(gate_up), free(act), free(delta);
}

/* Every decoder layer of a step in one call: `labkit_decoder_layer_blocks` for layer
   0 .. layers-1 in turn, layer l reading its norms and matrices from entry l (matrices
   and kinds: 4 l .. 4 l + 3) and its keys and values `layer_entries` entries further into
   the pool than layer l - 1. One call a step instead of one a layer: from Python each call
   cost more than a small matrix product. */
void labkit_decoder_layers_blocks(
    float* x, long rows, long layers, long hidden, long heads, long kv_heads, long dim,
    long intermediate, float eps, const float* const* attn_norms, const float* const* mlp_norms,
    const unsigned char* const* mats, const long* kinds, long quantize_x, const float* cos,
    const float* sin, void* keys, void* values, long layer_entries, const long* new_blocks,
    const long* new_slots, const long* tables, const long* tiles, long num_tiles, long width,
    long block_size, long kv_bf16) {
  const long layer_bytes = layer_entries * (kv_bf16 ? 2 : 4);
  for (long l = 0; l < layers; l++)
    labkit_decoder_layer_blocks(x, rows, hidden, heads, kv_heads, dim, intermediate, eps,
                                attn_norms[l], mlp_norms[l], mats + 4 * l, kinds + 4 * l, quantize_x,
                                cos, sin, (char*)keys + l * layer_bytes, (char*)values + l * layer_bytes,
                                new_blocks, new_slots, tables, tiles, num_tiles, width, block_size,
                                kv_bf16);
}
