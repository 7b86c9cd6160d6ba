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
/* Tokens from which a layer's per-token steps (norms, rope, the cache's writes, residual adds,
 * the gate) are shared out among the threads: a prefill ran them on one thread for 6% of its
 * time (1.7B, 1,024 tokens, two threads). Fewer run on this thread with no parallel region at
 * all: entering one costs 0.3-0.4 us even with an `if` clause false, and a step of the default
 * model would enter some 270 (3% of it). It runs the loop over the `threads` in scope. */
#define PARALLEL_TOKENS 16
#define FOR_TOKENS(t, n, ...) do { \
    if ((n) >= PARALLEL_TOKENS) { \
        _Pragma("omp parallel for schedule(static) num_threads(threads)") \
        for (int64_t t = 0; t < (n); t++) __VA_ARGS__ \
    } else { \
        for (int64_t t = 0; t < (n); t++) __VA_ARGS__ \
    } \
} while (0)
#define QUERY_BATCH 32 /* queries that take the keys and values of a cache row together (attend_batch) */
#define CONVERTED_QUERIES 4 /* and how many share them converted to fp32 */

/* Floats of scratch attention takes a thread: QUERY_BATCH queries' scores, 16 slots of keys or
 * values in fp32 and QUERY_BATCH queries' sums (the AVX2 build uses the first span + 16). */
static int64_t attend_scratch(int64_t span, int64_t head_dim) {
    return QUERY_BATCH * (span + 16) + 16 * head_dim + QUERY_BATCH * head_dim;
}

int saguaro_group_matmul(int bits, const uint8_t *tiles, const uint16_t *x, void *out, int64_t rows,
                         int64_t in_features, int64_t out_features, int out_fp32, int threads,
                         const int32_t *legal, int64_t words);

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

/* 16 keys or values from element i: bf16 from the cache, or (fp32) converted to fp32 before
 * (slots_fp32): the same fp32 values either way. */
TARGET static inline __m512 load_kv(const void *at, int64_t i, int fp32) {
    return fp32 ? _mm512_loadu_ps((const float *)at + i) : load_bf16((const uint16_t *)at + i);
}

/* q . key over a head's lanes, in 16 fp32 lanes (summed across them by key_sums). */
TARGET static inline __m512 key_dot(const __m512 *qv, const void *keys, int64_t at, int64_t lanes, int fp32) {
    __m512 dot = _mm512_mul_ps(qv[0], load_kv(keys, at, fp32));
    for (int64_t l = 1; l < lanes; l++) dot = _mm512_fmadd_ps(qv[l], load_kv(keys, at + 16 * l, fp32), dot);
    return dot;
}

/* Two keys' dot lanes folded into one vector, the first step of key_sums: in each 128-bit
 * quarter, a's lanes 0 + 2 and 1 + 3, interleaved with b's. */
TARGET static inline __m512 fold_pair(__m512 a, __m512 b) {
    return _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
}

/* The lane sums of 16 keys' dot vectors, from their 8 folded pairs: lane k holds key k's sum,
 * ((0 + 2) + (1 + 3)) within each quarter, then (quarters 0 + 1) + (2 + 3), the same for every
 * key: 45 operations for 16 keys, where a sum per key took about 8. */
TARGET static inline __m512 key_sums(const __m512 *pairs) {
    __m512 quads[4], halves[2];
    for (int i = 0; i < 4; i++) {
        const __m512d a = _mm512_castps_pd(pairs[2 * i]), b = _mm512_castps_pd(pairs[2 * i + 1]);
        quads[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    for (int i = 0; i < 2; i++)
        halves[i] = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], 0x88),
                                  _mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(halves[0], halves[1], 0x88), _mm512_shuffle_f32x4(halves[0], halves[1], 0xDD));
}

/* 16 slots of a cache row's keys or values from slot j0 (fewer at the end) in fp32, slot by slot. */
TARGET static inline void slots_fp32(const uint16_t *at, int64_t j0, int64_t count, int64_t head_dim, float *block) {
    for (int64_t i = 0; i < count * head_dim; i += 16) _mm512_storeu_ps(block + i, load_bf16(at + j0 * head_dim + i));
}

/* softmax(cap(q k^T scale)) v, in fp32, for `count` (at most QUERY_BATCH) queries from query
 * `first` of a run of tokens x `heads` query heads (query i: token i / heads, head i % heads)
 * that read the same cache row's keys and values, over each token's visible slots. The slots are
 * taken 16 at a time from slot 0 for every query before the next 16, converted to fp32 once
 * for them all: one query at a time read a kv head's keys and values (67 KB at 256 slots) from
 * L2 for each. Each query's arithmetic is the same whatever the batch: a score's products in
 * 16-wide lanes summed across them by key_sums, the values weighed in slot order. head_dim % 16
 * == 0; scale 0: 1 / sqrt(head_dim); cap 0: no soft cap. scratch: attend_scratch floats. fp32:
 * whether to convert the slots, else read from the cache as they are. */
TARGET static inline __attribute__((always_inline)) void attend_batch(
        const uint16_t *q, int64_t q_stride, int64_t heads, int64_t first, int64_t count, const uint16_t *keys,
        const uint16_t *values, int64_t head_dim, const uint8_t *mask, int64_t span, float scale, float cap,
        float *scratch, uint16_t *out, int64_t out_stride, int fp32) {
    const int64_t lanes = head_dim / 16, stride = span + 16;
    float *scores = scratch, *block = scores + QUERY_BATCH * stride, *sums = block + 16 * head_dim;
    if (scale == 0.0f) scale = 1.0f / sqrtf((float)head_dim);
    __m512 tops[QUERY_BATCH];
    float totals[QUERY_BATCH];
    for (int64_t i = 0; i < count; i++) tops[i] = _mm512_set1_ps(-INFINITY);
    for (int64_t j0 = 0; j0 < span; j0 += 16) {
        const int64_t slots = span - j0 < 16 ? span - j0 : 16;
        const void *from = fp32 ? (const void *)block : (const void *)(keys + j0 * head_dim);
        if (fp32) slots_fp32(keys, j0, slots, head_dim, block);
        for (int64_t i = 0; i < count; i++) {
            const int64_t t = (first + i) / heads, h = (first + i) % heads;
            float *own = scores + i * stride + j0;
            __mmask16 visible = slots == 16 ? 0xFFFF : (__mmask16)((1u << slots) - 1);
            if (mask) { /* the row's bytes of these slots, none read past the row */
                const __m128i bytes = _mm_maskz_loadu_epi8(visible, mask + t * span + j0);
                visible = _mm_test_epi8_mask(bytes, bytes);
            }
            if (!visible) {
                _mm512_storeu_ps(own, _mm512_set1_ps(-INFINITY));
                continue;
            }
            __m512 qv[MAX_HEAD_DIM / 16], pairs[8];
            for (int64_t l = 0; l < lanes; l++) qv[l] = load_bf16(q + t * q_stride + h * head_dim + 16 * l);
            for (int k = 0; k < 16; k += 2) { /* masked slots' dots are not computed */
                const __m512 a = visible >> k & 1 ? key_dot(qv, from, k * head_dim, lanes, fp32) : _mm512_setzero_ps();
                const __m512 b = visible >> (k + 1) & 1 ? key_dot(qv, from, (k + 1) * head_dim, lanes, fp32)
                                                        : _mm512_setzero_ps();
                pairs[k / 2] = fold_pair(a, b);
            }
            __m512 s = _mm512_mul_ps(key_sums(pairs), _mm512_set1_ps(scale));
            if (cap != 0.0f) {
                _mm512_storeu_ps(own, s);
                for (int k = 0; k < slots; k++) own[k] = cap * tanhf(own[k] / cap);
                s = _mm512_loadu_ps(own);
            }
            s = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), visible, s);
            _mm512_storeu_ps(own, s);
            tops[i] = _mm512_max_ps(tops[i], s);
        }
    }
    /* weights e^(s - top), 16 slots at a time; masked slots weigh exactly zero */
    for (int64_t i = 0; i < count; i++) {
        const float top = _mm512_reduce_max_ps(tops[i]);
        float *own = scores + i * stride;
        __m512 sum = _mm512_setzero_ps();
        for (int64_t j = 0; j < span; j += 16) {
            const __mmask16 live = span - j >= 16 ? 0xFFFF : (__mmask16)((1u << (span - j)) - 1);
            const __m512 s = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), live, own + j);
            const __mmask16 visible = _mm512_cmp_ps_mask(s, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ);
            const __m512 p = _mm512_maskz_mov_ps(visible, exp_ps(_mm512_sub_ps(s, _mm512_set1_ps(top))));
            _mm512_mask_storeu_ps(own + j, live, p);
            sum = _mm512_add_ps(sum, p);
        }
        totals[i] = _mm512_reduce_add_ps(sum);
        for (int64_t l = 0; l < lanes; l++) _mm512_storeu_ps(sums + (i * lanes + l) * 16, _mm512_setzero_ps());
    }
    /* the values, weighed in slot order, 16 slots at a time for every query */
    for (int64_t j0 = 0; j0 < span; j0 += 16) {
        const int64_t slots = span - j0 < 16 ? span - j0 : 16;
        const void *from = fp32 ? (const void *)block : (const void *)(values + j0 * head_dim);
        if (fp32) slots_fp32(values, j0, slots, head_dim, block);
        for (int64_t i = 0; i < count; i++) {
            const float *weights = scores + i * stride + j0;
            __m512 acc[MAX_HEAD_DIM / 16];
            for (int64_t l = 0; l < lanes; l++) acc[l] = _mm512_loadu_ps(sums + (i * lanes + l) * 16);
            for (int64_t k = 0; k < slots; k++) {
                if (weights[k] == 0.0f) continue;  /* masked (or vanishingly small: adds nothing either way) */
                const __m512 pv = _mm512_set1_ps(weights[k]);
                for (int64_t l = 0; l < lanes; l++) acc[l] = _mm512_fmadd_ps(pv, load_kv(from, k * head_dim + 16 * l, fp32), acc[l]);
            }
            for (int64_t l = 0; l < lanes; l++) _mm512_storeu_ps(sums + (i * lanes + l) * 16, acc[l]);
        }
    }
    float result[16];
    for (int64_t i = 0; i < count; i++) {
        const int64_t t = (first + i) / heads, h = (first + i) % heads;
        for (int64_t l = 0; l < lanes; l++) {
            _mm512_storeu_ps(result, _mm512_div_ps(_mm512_loadu_ps(sums + (i * lanes + l) * 16), _mm512_set1_ps(totals[i])));
            for (int e = 0; e < 16; e++) out[t * out_stride + h * head_dim + 16 * l + e] = to_bf16(result[e]);
        }
    }
}

/* attend_batch over queries first .. last - 1, QUERY_BATCH at a time, with the slots converted to
 * fp32 where CONVERTED_QUERIES or more share them (fewer, as a one-token step's 3 queries of a kv
 * head of SmolLM2's twin, attended 1.2x slower so), the common head sizes as constants. */
TARGET static void attend_queries(const uint16_t *q, int64_t q_stride, int64_t heads, int64_t first, int64_t last,
                                  const uint16_t *keys, const uint16_t *values, int64_t head_dim, const uint8_t *mask,
                                  int64_t span, float scale, float cap, float *scratch, uint16_t *out,
                                  int64_t out_stride) {
    for (int64_t i = first; i < last; i += QUERY_BATCH) {
        const int64_t count = last - i < QUERY_BATCH ? last - i : QUERY_BATCH;
#define BATCH(D, FP32) attend_batch(q, q_stride, heads, i, count, keys, values, D, mask, span, scale, cap, scratch, out, \
                                   out_stride, FP32)
        const int fp32 = count >= CONVERTED_QUERIES;
        if (head_dim == 64) BATCH(64, fp32);
        else if (head_dim == 128) BATCH(128, fp32);
        else BATCH(head_dim, fp32);
#undef BATCH
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

/* softmax(cap(q k^T scale)) v, the layer's attention: n tokens' queries, the first H x D values of
 * each row of qkv [n, (H + 2 Hkv) D], over the first span slots of their cache rows (keys, values,
 * row_of and mask as saguaro_decoder_layer takes them) -> out [n, H D] in bf16. Called alone by
 * the tests, which hold it to a float64 reference. Returns 0, -1 where memory ran out, -2 for an
 * unsupported head size. */
TARGET int saguaro_attention(const LayerWeights *w, const uint16_t *qkv, int64_t n, const uint16_t *keys,
                             const uint16_t *values, int64_t cache_slots, const int64_t *row_of, const uint8_t *mask,
                             int64_t span, uint16_t *out, int threads) {
    const int64_t H = w->heads, Hkv = w->kv_heads, D = w->head_dim, qkv_width = (H + 2 * Hkv) * D, group = H / Hkv;
    if (D > MAX_HEAD_DIM || D % 16) return -2;
    const int64_t scratch_floats = attend_scratch(span, D);
    float *scratch = malloc(sizeof(float) * (size_t)(threads > 0 ? threads : 1) * (size_t)scratch_floats);
    int64_t *run_start = malloc(sizeof(int64_t) * (size_t)(n + 1));
    if (!scratch || !run_start) {
        free(scratch);
        free(run_start);
        return -1;
    }
    /* Attention in jobs of one kv head over a run of consecutive tokens in one cache row, whose
     * queries (tokens x the kv head's query heads) read the same keys and values (attend_queries
     * takes them through them together); each run's queries split in `parts` so that every thread
     * has jobs. */
    int64_t runs = 0;
    for (int64_t t = 0; t < n; t++)
        if (t == 0 || row_of[t] != row_of[t - 1]) run_start[runs++] = t;
    run_start[runs] = n;
    const int64_t parts = (threads + runs * Hkv - 1) / (runs * Hkv);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t job = 0; job < runs * Hkv * parts; job++) {
        const int64_t run = job / (Hkv * parts), kv = job / parts % Hkv, part = job % parts;
        const int64_t t0 = run_start[run], queries = (run_start[run + 1] - t0) * group;
        const int64_t base = (row_of[t0] * Hkv + kv) * cache_slots * D;
        int64_t thread = 0;
#ifdef _OPENMP
        thread = omp_get_thread_num();
#endif
        attend_queries(qkv + t0 * qkv_width + kv * group * D, qkv_width, group, queries * part / parts,
                       queries * (part + 1) / parts, keys + base, values + base, D, mask ? mask + t0 * span : NULL,
                       span, w->attn_scale, w->attn_softcap, scratch + thread * scratch_floats,
                       out + t0 * H * D + kv * group * D, H * D);
    }
    free(scratch);
    free(run_start);
    return 0;
}

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
    int status = -1;
    if (!normed || !qkv || !attn || !wide || !narrow) goto done;

    const float offset = w->norm_offset;
    FOR_TOKENS(t, n, { rms_norm(x + t * hidden, w->input_norm, hidden, w->eps, offset, normed + t * hidden); });
    if (saguaro_group_matmul(w->qkv_bits, w->qkv, normed, qkv, n, hidden, qkv_width, 0, threads, NULL, 0)) goto done;
    FOR_TOKENS(t, n, {
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
    });
    if (saguaro_attention(w, qkv, n, keys, values, cache_slots, row_of, mask, span, attn, threads)) goto done;
    if (saguaro_group_matmul(w->o_bits, w->o, attn, narrow, n, H * D, hidden, 0, threads, NULL, 0)) goto done;
    FOR_TOKENS(t, n, { /* the attention's output normed (Gemma), then added to the residual */
        uint16_t *out = narrow + t * hidden, *residual = x + t * hidden;
        if (w->attn_out_norm) rms_norm(out, w->attn_out_norm, hidden, w->eps, offset, out);
        for (int64_t i = 0; i < hidden; i++) residual[i] = to_bf16(from_bf16(residual[i]) + from_bf16(out[i]));
        rms_norm(residual, w->post_norm, hidden, w->eps, offset, normed + t * hidden);
    });
    if (saguaro_group_matmul(w->gate_up_bits, w->gate_up, normed, wide, n, hidden, 2 * inter, 0, threads, NULL, 0)) goto done;
    FOR_TOKENS(t, n, { gated(wide + t * 2 * inter, inter, w->activation, narrow + t * inter); });
    if (saguaro_group_matmul(w->down_bits, w->down, narrow, normed, n, inter, hidden, 0, threads, NULL, 0)) goto done;
    FOR_TOKENS(t, n, { /* the MLP's output normed (Gemma), then added to the residual */
        uint16_t *out = normed + t * hidden, *residual = x + t * hidden;
        if (w->mlp_out_norm) rms_norm(out, w->mlp_out_norm, hidden, w->eps, offset, out);
        for (int64_t i = 0; i < hidden; i++) residual[i] = to_bf16(from_bf16(residual[i]) + from_bf16(out[i]));
    });
    status = 0;
done:
    free(normed);
    free(qkv);
    free(attn);
    free(wide);
    free(narrow);
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
