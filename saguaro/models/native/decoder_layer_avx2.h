/* decoder_layer.c's vector pieces for CPUs with AVX2 only (see group_matmul_avx2.h): eight fp32
 * lanes, the same formulas. Attention's dot products sum across eight lanes instead of sixteen,
 * so its last bits may differ from the AVX512 build; within a build every token is still
 * computed alone, in a fixed order. */
#define TARGET __attribute__((target("avx2,fma,f16c")))

TARGET static inline __m256 load_bf16(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

/* fp32 -> the nearest bf16 (ties to even), as 8 bf16 words in the low halves of 32-bit lanes */
TARGET static inline __m256i round_bf16_bits(__m256 v) {
    __m256i bits = _mm256_castps_si256(v);
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    return _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7fff)), odd), 16);
}

TARGET static inline __m256 round_bf16_ps(__m256 v) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(round_bf16_bits(v), 16));
}

TARGET static inline void store_bf16(uint16_t *p, __m256 v) {
    const __m256i words = round_bf16_bits(v);  /* each < 65536: packing without saturation */
    const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(words), _mm256_extracti128_si256(words, 1));
    _mm_storeu_si128((__m128i *)p, packed);
}

/* The AVX512 build's e^x: the same reduction and series; 2^n built in the exponent bits (n is
 * within -126..127 after the clamp, so the product is exact as scalef's). */
TARGET static inline __m256 exp_ps(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 f = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    f = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), f);
    __m256 p = _mm256_set1_ps(1.0f / 720.0f);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 120.0f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 24.0f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 6.0f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
    const __m256i power = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(power));
}

TARGET static inline __m256 silu_ps(__m256 x) {
    return _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0f), exp_ps(_mm256_sub_ps(_mm256_setzero_ps(), x))));
}

TARGET static inline __m256 gelu_tanh_ps(__m256 x) {
    const __m256 inner = _mm256_mul_ps(_mm256_set1_ps(0.7978845608f),
                                       _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(0.044715f), x), _mm256_mul_ps(x, x), x));
    const __m256 tanh = _mm256_sub_ps(_mm256_set1_ps(1.0f), _mm256_div_ps(_mm256_set1_ps(2.0f),
                                      _mm256_add_ps(exp_ps(_mm256_add_ps(inner, inner)), _mm256_set1_ps(1.0f))));
    return _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), x), _mm256_add_ps(_mm256_set1_ps(1.0f), tanh));
}

/* The eight lanes' sum in a fixed order: halves, then pairs, then the last two. */
TARGET static inline float sum_lanes(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
}

/* decoder_layer.c's attend in eight lanes; scores has room for span + 16 values. */
TARGET static void attend(const uint16_t *q, const uint16_t *keys, const uint16_t *values, int64_t head_dim,
                          const uint8_t *mask, int64_t span, float scale, float cap, float *scores, uint16_t *out) {
    const int64_t lanes = head_dim / 8;
    if (scale == 0.0f) scale = 1.0f / sqrtf((float)head_dim);
    __m256 qv[MAX_HEAD_DIM / 8], acc[MAX_HEAD_DIM / 8];
    for (int64_t l = 0; l < lanes; l++) {
        qv[l] = load_bf16(q + 8 * l);
        acc[l] = _mm256_setzero_ps();
    }
    float top = -INFINITY;
    for (int64_t j = 0; j < span; j++) {
        if (mask && !mask[j]) {
            scores[j] = -INFINITY;
            continue;
        }
        __m256 dot = _mm256_mul_ps(qv[0], load_bf16(keys + j * head_dim));
        for (int64_t l = 1; l < lanes; l++) dot = _mm256_fmadd_ps(qv[l], load_bf16(keys + j * head_dim + 8 * l), dot);
        scores[j] = sum_lanes(dot) * scale;
        if (cap != 0.0f) scores[j] = cap * tanhf(scores[j] / cap);
        if (scores[j] > top) top = scores[j];
    }
    /* weights e^(s - top), 8 slots at a time over scores padded with masked slots; masked slots
     * weigh exactly zero */
    for (int64_t j = span; j % 8; j++) scores[j] = -INFINITY;
    __m256 sum = _mm256_setzero_ps();
    for (int64_t j = 0; j < span; j += 8) {
        const __m256 s = _mm256_loadu_ps(scores + j);
        const __m256 visible = _mm256_cmp_ps(s, _mm256_set1_ps(-INFINITY), _CMP_NEQ_OQ);
        const __m256 p = _mm256_and_ps(visible, exp_ps(_mm256_sub_ps(s, _mm256_set1_ps(top))));
        _mm256_storeu_ps(scores + j, p);
        sum = _mm256_add_ps(sum, p);
    }
    const float total = sum_lanes(sum);
    for (int64_t j = 0; j < span; j++) {
        if (scores[j] == 0.0f) continue;
        const __m256 pv = _mm256_set1_ps(scores[j]);
        for (int64_t l = 0; l < lanes; l++) acc[l] = _mm256_fmadd_ps(pv, load_bf16(values + j * head_dim + 8 * l), acc[l]);
    }
    for (int64_t l = 0; l < lanes; l++) store_bf16(out + 8 * l, _mm256_div_ps(acc[l], _mm256_set1_ps(total)));
}

/* decoder_layer.c's attend_queries, one query at a time (scratch: its scores). */
TARGET static void attend_queries(const uint16_t *q, int64_t q_stride, int64_t heads, int64_t first, int64_t last,
                                  const uint16_t *keys, const uint16_t *values, int64_t head_dim, const uint8_t *mask,
                                  int64_t span, float scale, float cap, float *scores, uint16_t *out,
                                  int64_t out_stride) {
    for (int64_t i = first; i < last; i++) {
        const int64_t t = i / heads, h = i % heads;
        attend(q + t * q_stride + h * head_dim, keys, values, head_dim, mask ? mask + t * span : NULL, span, scale, cap,
               scores, out + t * out_stride + h * head_dim);
    }
}

TARGET static void gated(const uint16_t *gate_up, int64_t inter, int activation, uint16_t *out) {
    for (int64_t i = 0; i < inter; i += 8) {
        const __m256 gate = load_bf16(gate_up + i), up = load_bf16(gate_up + inter + i);
        const __m256 act = activation ? gelu_tanh_ps(gate) : silu_ps(gate);
        store_bf16(out + i, _mm256_mul_ps(round_bf16_ps(act), up));
    }
}
