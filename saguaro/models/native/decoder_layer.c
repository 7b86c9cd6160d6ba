/* One Llama-family decoder layer in bf16, with its projections in group_matmul.c's tiles.
 *
 * Called once per layer instead of the ~90 small torch operations a layer costs in Python, which
 * took half of a decode step. Every token is computed alone, in a fixed order (norms, products,
 * rope, and attention over its own cache row with its own mask, skipping masked slots), so a
 * token's result does not depend on how many tokens share the call. Rounding points follow the
 * torch model (saguaro/models/llama.py): bf16 between operations, fp32 inside them.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define MAX_HEAD_DIM 256

int saguaro_group_matmul(int bits, const uint8_t *tiles, const uint16_t *x, void *out, int64_t rows,
                         int64_t in_features, int64_t out_features, int out_fp32, int threads);

typedef struct {
    int64_t hidden, heads, kv_heads, head_dim, intermediate;
    float eps;
    const uint16_t *input_norm, *post_norm; /* bf16 [hidden] */
    const uint16_t *q_norm, *k_norm;        /* bf16 [head_dim], or NULL */
    const uint16_t *qkv_bias;               /* bf16 [(heads + 2 kv_heads) * head_dim], or NULL */
    const uint8_t *qkv, *o, *gate_up, *down; /* tiles */
    int qkv_bits, o_bits, gate_up_bits, down_bits;
    int rope; /* 0: the layer's queries and keys take no positions (SmolLM3's every fourth layer) */
    int rotary_dim; /* rope turns a head's first rotary_dim dimensions (Phi-3's partial rope), cos and sin
                       holding rotary_dim / 2 values a token */
    float norm_offset; /* every norm scales by (norm_offset + weight), in fp32 (Gemma's 1) */
    int activation; /* the gate's: 0 silu, 1 gelu with tanh (Gemma's GeGLU) */
    const uint16_t *attn_out_norm, *mlp_out_norm; /* Gemma's norms of the attention's and the MLP's outputs
                                                     (post_norm then norms the MLP's input), or NULL */
    float attn_scale; /* the scores' scale; 0: 1 / sqrt(head_dim) */
    float attn_softcap; /* Gemma 2: scores -> cap tanh(scores / cap); 0: none */
    int sliding; /* the layer attends through the window mask, with the local cos / sin where given */
} LayerWeights;

static inline float from_bf16(uint16_t v) {
    uint32_t bits = (uint32_t)v << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline uint16_t to_bf16(float f) {  /* round to nearest even; no NaNs arise here */
    uint32_t bits;
    memcpy(&bits, &f, 4);
    return (uint16_t)((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);
}

/* out = bf16(x * rsqrt(mean(x^2) + eps) * (offset + weight)), in fp32 (as torch's fused rms_norm). */
static void rms_norm(const uint16_t *x, const uint16_t *weight, int64_t dim, float eps, float offset, uint16_t *out) {
    float squares = 0.0f;
    for (int64_t i = 0; i < dim; i++) {
        float v = from_bf16(x[i]);
        squares += v * v;
    }
    const float scale = 1.0f / sqrtf(squares / (float)dim + eps);
    for (int64_t i = 0; i < dim; i++) out[i] = to_bf16(from_bf16(x[i]) * scale * (offset + from_bf16(weight[i])));
}

/* Rotate-half rope over a head's first `dims` dimensions, in fp32, rounded once. */
static void rope(uint16_t *head, const float *cos, const float *sin, int64_t dims) {
    const int64_t half = dims / 2;
    for (int64_t i = 0; i < half; i++) {
        float a = from_bf16(head[i]), b = from_bf16(head[i + half]);
        head[i] = to_bf16(a * cos[i] - b * sin[i]);
        head[i + half] = to_bf16(b * cos[i] + a * sin[i]);
    }
}

#ifdef SAGUARO_AVX2
#include "decoder_layer_avx2.h"
#else
#define TARGET __attribute__((target("avx512f,avx512bw,avx512vl,fma")))

TARGET static inline __m512 load_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* fp32 -> the nearest bf16 (ties to even), as 16 bf16 words or back in fp32. */
TARGET static inline __m512i round_bf16_bits(__m512 v) {
    __m512i bits = _mm512_castps_si512(v);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    return _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7fff)), odd), 16);
}

TARGET static inline __m512 round_bf16_ps(__m512 v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(round_bf16_bits(v), 16));
}

/* e^x to about an ulp: 2^n e^f with n = round(x log2 e), f = x - n ln 2 (ln 2 in two parts, so
 * |f| <= ln 2 / 2 exactly enough), e^f by its Taylor series to f^6 (error < f^7 / 5040 < 2e-7). */
TARGET static inline __m512 exp_ps(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    f = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), f);
    __m512 p = _mm512_set1_ps(1.0f / 720.0f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* x / (1 + e^-x) */
TARGET static inline __m512 silu_ps(__m512 x) {
    return _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f), exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), x))));
}

/* x / 2 (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))), with tanh(y) = 1 - 2 / (e^2y + 1) */
TARGET static inline __m512 gelu_tanh_ps(__m512 x) {
    const __m512 inner = _mm512_mul_ps(_mm512_set1_ps(0.7978845608f),
                                       _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(0.044715f), x), _mm512_mul_ps(x, x), x));
    const __m512 tanh = _mm512_sub_ps(_mm512_set1_ps(1.0f), _mm512_div_ps(_mm512_set1_ps(2.0f),
                                      _mm512_add_ps(exp_ps(_mm512_add_ps(inner, inner)), _mm512_set1_ps(1.0f))));
    return _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(0.5f), x), _mm512_add_ps(_mm512_set1_ps(1.0f), tanh));
}

/* softmax(cap(q k^T scale)) v for one query head over the visible slots of one cache row, in
 * fp32: products in 16-wide lanes, summed across lanes in a fixed order. head_dim % 16 == 0;
 * scale 0: 1 / sqrt(head_dim); cap 0: no soft cap. */
TARGET static void attend(const uint16_t *q, const uint16_t *keys, const uint16_t *values, int64_t head_dim,
                          const uint8_t *mask, int64_t span, float scale, float cap, float *scores, uint16_t *out) {
    const int64_t lanes = head_dim / 16;
    if (scale == 0.0f) scale = 1.0f / sqrtf((float)head_dim);
    __m512 qv[MAX_HEAD_DIM / 16], acc[MAX_HEAD_DIM / 16];
    for (int64_t l = 0; l < lanes; l++) {
        qv[l] = load_bf16(q + 16 * l);
        acc[l] = _mm512_setzero_ps();
    }
    float top = -INFINITY;
    for (int64_t j = 0; j < span; j++) {
        if (mask && !mask[j]) {
            scores[j] = -INFINITY;
            continue;
        }
        __m512 dot = _mm512_mul_ps(qv[0], load_bf16(keys + j * head_dim));
        for (int64_t l = 1; l < lanes; l++) dot = _mm512_fmadd_ps(qv[l], load_bf16(keys + j * head_dim + 16 * l), dot);
        scores[j] = _mm512_reduce_add_ps(dot) * scale;
        if (cap != 0.0f) scores[j] = cap * tanhf(scores[j] / cap);
        if (scores[j] > top) top = scores[j];
    }
    /* weights e^(s - top), 16 slots at a time; masked slots weigh exactly zero */
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < span; j += 16) {
        const __mmask16 live = span - j >= 16 ? 0xFFFF : (__mmask16)((1u << (span - j)) - 1);
        const __m512 s = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), live, scores + j);
        const __mmask16 visible = _mm512_cmp_ps_mask(s, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ);
        const __m512 p = _mm512_maskz_mov_ps(visible, exp_ps(_mm512_sub_ps(s, _mm512_set1_ps(top))));
        _mm512_mask_storeu_ps(scores + j, live, p);
        sum = _mm512_add_ps(sum, p);
    }
    const float total = _mm512_reduce_add_ps(sum);
    for (int64_t j = 0; j < span; j++) {
        if (scores[j] == 0.0f) continue;  /* masked (or vanishingly small: adds nothing either way) */
        const __m512 pv = _mm512_set1_ps(scores[j]);
        for (int64_t l = 0; l < lanes; l++) acc[l] = _mm512_fmadd_ps(pv, load_bf16(values + j * head_dim + 16 * l), acc[l]);
    }
    float result[16];
    for (int64_t l = 0; l < lanes; l++) {
        _mm512_storeu_ps(result, _mm512_div_ps(acc[l], _mm512_set1_ps(total)));
        for (int i = 0; i < 16; i++) out[16 * l + i] = to_bf16(result[i]);
    }
}

/* out = bf16(bf16(act(gate)) * up), as torch rounds it: gate_up holds the gate's `inter` values,
 * then up's; activation 0 silu, 1 gelu with tanh. */
TARGET static void gated(const uint16_t *gate_up, int64_t inter, int activation, uint16_t *out) {
    for (int64_t i = 0; i < inter; i += 16) {
        const __m512 gate = load_bf16(gate_up + i), up = load_bf16(gate_up + inter + i);
        const __m512 act = activation ? gelu_tanh_ps(gate) : silu_ps(gate);
        _mm256_storeu_si256((__m256i *)(out + i), _mm512_cvtepi32_epi16(round_bf16_bits(_mm512_mul_ps(round_bf16_ps(act), up))));
    }
}

#endif

/* x [n, hidden] (bf16, updated in place) through one layer. keys / values: this layer's cache,
 * [cache_rows, kv_heads, cache_slots, head_dim]; token t is written at row_of[t], slot_of[t] and
 * attends to slots 0 .. span - 1 of its row where mask[t * span + j] (all of them when mask is
 * NULL). Returns 0, -1 where memory ran out, -2 for an unsupported head size. */
TARGET int saguaro_decoder_layer(const LayerWeights *w, uint16_t *x, int64_t n, const float *cos, const float *sin,
                          uint16_t *keys, uint16_t *values, int64_t cache_slots, const int64_t *row_of,
                          const int64_t *slot_of, const uint8_t *mask, int64_t span, int threads) {
    const int64_t H = w->heads, Hkv = w->kv_heads, D = w->head_dim, hidden = w->hidden, inter = w->intermediate;
    const int64_t qkv_width = (H + 2 * Hkv) * D, group = H / Hkv;
    if (D > MAX_HEAD_DIM || D % 16 || inter % 16) return -2;
    uint16_t *normed = malloc(sizeof(uint16_t) * n * (hidden > H * D ? hidden : H * D));
    uint16_t *qkv = malloc(sizeof(uint16_t) * n * qkv_width);
    uint16_t *attn = malloc(sizeof(uint16_t) * n * H * D);
    uint16_t *wide = malloc(sizeof(uint16_t) * n * 2 * inter);
    uint16_t *narrow = malloc(sizeof(uint16_t) * n * (hidden > inter ? hidden : inter));
    float *scores = malloc(sizeof(float) * (size_t)(threads > 0 ? threads : 1) * (size_t)(span + 16));
    int status = -1;
    if (!normed || !qkv || !attn || !wide || !narrow || !scores) goto done;

    const float offset = w->norm_offset;
    for (int64_t t = 0; t < n; t++) rms_norm(x + t * hidden, w->input_norm, hidden, w->eps, offset, normed + t * hidden);
    if (saguaro_group_matmul(w->qkv_bits, w->qkv, normed, qkv, n, hidden, qkv_width, 0, threads)) goto done;
    for (int64_t t = 0; t < n; t++) {
        uint16_t *row = qkv + t * qkv_width;
        if (w->qkv_bias)
            for (int64_t i = 0; i < qkv_width; i++) row[i] = to_bf16(from_bf16(row[i]) + from_bf16(w->qkv_bias[i]));
        for (int64_t h = 0; h < H + Hkv; h++) {
            uint16_t *head = row + h * D;
            const uint16_t *norm = h < H ? w->q_norm : w->k_norm;
            if (norm) rms_norm(head, norm, D, w->eps, offset, head);
            if (w->rope) rope(head, cos + t * (w->rotary_dim / 2), sin + t * (w->rotary_dim / 2), w->rotary_dim);
        }
        for (int64_t h = 0; h < Hkv; h++) {
            const int64_t at = ((row_of[t] * Hkv + h) * cache_slots + slot_of[t]) * D;
            memcpy(keys + at, row + (H + h) * D, sizeof(uint16_t) * D);
            memcpy(values + at, row + (H + Hkv + h) * D, sizeof(uint16_t) * D);
        }
    }
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t job = 0; job < n * H; job++) {
        const int64_t t = job / H, h = job % H, kv = h / group;
        const int64_t base = (row_of[t] * Hkv + kv) * cache_slots * D;
        float *own_scores = scores;
#ifdef _OPENMP
        own_scores += (size_t)omp_get_thread_num() * (size_t)(span + 16);
#endif
        attend(qkv + t * qkv_width + h * D, keys + base, values + base, D, mask ? mask + t * span : NULL, span,
               w->attn_scale, w->attn_softcap, own_scores, attn + t * H * D + h * D);
    }
    if (saguaro_group_matmul(w->o_bits, w->o, attn, narrow, n, H * D, hidden, 0, threads)) goto done;
    if (w->attn_out_norm)
        for (int64_t t = 0; t < n; t++) rms_norm(narrow + t * hidden, w->attn_out_norm, hidden, w->eps, offset, narrow + t * hidden);
    for (int64_t i = 0; i < n * hidden; i++) x[i] = to_bf16(from_bf16(x[i]) + from_bf16(narrow[i]));

    for (int64_t t = 0; t < n; t++) rms_norm(x + t * hidden, w->post_norm, hidden, w->eps, offset, normed + t * hidden);
    if (saguaro_group_matmul(w->gate_up_bits, w->gate_up, normed, wide, n, hidden, 2 * inter, 0, threads)) goto done;
    for (int64_t t = 0; t < n; t++) gated(wide + t * 2 * inter, inter, w->activation, narrow + t * inter);
    if (saguaro_group_matmul(w->down_bits, w->down, narrow, normed, n, inter, hidden, 0, threads)) goto done;
    if (w->mlp_out_norm)
        for (int64_t t = 0; t < n; t++) rms_norm(normed + t * hidden, w->mlp_out_norm, hidden, w->eps, offset, normed + t * hidden);
    for (int64_t i = 0; i < n * hidden; i++) x[i] = to_bf16(from_bf16(x[i]) + from_bf16(normed[i]));
    status = 0;
done:
    free(normed);
    free(qkv);
    free(attn);
    free(wide);
    free(narrow);
    free(scores);
    return status;
}

/* Every layer of a model in one call, then the final norm (its weight final_norm, eps and offset
 * those of the layers): layer i reads w[i] and its cache at keys / values + i * layer_elements; a
 * sliding layer attends through window_mask (NULL: every slot) and turns by cos_local / sin_local
 * where they are given (Gemma 3's own base for them), the others through mask, cos and sin. In
 * Python the final norm was seven small torch operations, each slow right after the layers have
 * streamed the weights through the caches. Returns saguaro_decoder_layer's status of the first
 * layer that fails. */
TARGET int saguaro_decoder_layers(const LayerWeights *w, int64_t num_layers, uint16_t *x, int64_t n, const float *cos,
                                  const float *sin, uint16_t *keys, uint16_t *values, int64_t layer_elements,
                                  int64_t cache_slots, const int64_t *row_of, const int64_t *slot_of,
                                  const uint8_t *mask, int64_t span, const uint16_t *final_norm,
                                  const float *cos_local, const float *sin_local, const uint8_t *window_mask,
                                  int threads) {
    for (int64_t i = 0; i < num_layers; i++) {
        const int sliding = w[i].sliding, local = sliding && cos_local;
        const int status = saguaro_decoder_layer(w + i, x, n, local ? cos_local : cos, local ? sin_local : sin,
                                                 keys + i * layer_elements, values + i * layer_elements, cache_slots,
                                                 row_of, slot_of, sliding ? window_mask : mask, span, threads);
        if (status) return status;
    }
    for (int64_t t = 0; t < n; t++)
        rms_norm(x + t * w->hidden, final_norm, w->hidden, w->eps, w->norm_offset, x + t * w->hidden);
    return 0;
}
