/* A grammar's masks on logits: -inf at each illegal token, in place, from the bitmasks
 * llguidance writes (bit b of int32 word w set: token 32w + b is legal). One call takes all of
 * a request's positions; a word with all 32 tokens legal (most of them inside a string) costs a
 * compare, and where few are legal each word's 32 logits take one masked store.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#ifdef SAGUARO_AVX2
#define TARGET __attribute__((target("avx2,fma")))
#else
#define TARGET __attribute__((target("avx512f")))
#endif

/* logits [rows, width] fp32, bits [rows, words]; a row whose skip byte is set is left alone
 * (a position verification cannot reach). Tokens past 32 * words are illegal. */
TARGET void saguaro_mask_logits(float *logits, int64_t rows, int64_t width, const int32_t *bits, int64_t words,
                                const uint8_t *skip) {
    const int64_t full = width / 32 < words ? width / 32 : words; /* words wholly inside the row */
    for (int64_t r = 0; r < rows; r++) {
        if (skip[r]) continue;
        float *row = logits + r * width;
        const uint32_t *word = (const uint32_t *)(bits + r * words);
        for (int64_t w = 0; w < full; w++) {
            const uint32_t illegal = ~word[w];
            if (!illegal) continue;
#ifdef SAGUARO_AVX2
            for (uint32_t left = illegal; left; left &= left - 1) row[w * 32 + __builtin_ctz(left)] = -INFINITY;
#else
            const __m512 minus_infinity = _mm512_set1_ps(-INFINITY);
            _mm512_mask_storeu_ps(row + w * 32, (__mmask16)illegal, minus_infinity);
            _mm512_mask_storeu_ps(row + w * 32 + 16, (__mmask16)(illegal >> 16), minus_infinity);
#endif
        }
        for (int64_t t = full * 32; t < width; t++)
            if (t >= words * 32 || !(word[t / 32] >> (t % 32) & 1)) row[t] = -INFINITY;
    }
}

/* A grammar's masks as a reduced head takes them (a draft's head over some of the tokens):
 * bit k of out row r set where its token ids[k] is legal in bits row r (tokens past 32 * words:
 * illegal). out [rows, out_words], bits past count clear. A gather of one bit a head row, which
 * numpy could only do through a byte a token over the whole vocabulary and back. */
void saguaro_head_bits(const int32_t *bits, int64_t rows, int64_t words, const int64_t *ids, int64_t count,
                       int32_t *out, int64_t out_words) {
    for (int64_t r = 0; r < rows; r++) {
        const uint32_t *word = (const uint32_t *)(bits + r * words);
        uint32_t *head = (uint32_t *)(out + r * out_words);
        for (int64_t w = 0; w < out_words; w++) head[w] = 0;
        for (int64_t k = 0; k < count; k++) {
            const int64_t token = ids[k];
            if (token >= 0 && token < 32 * words && (word[token >> 5] >> (token & 31) & 1))
                head[k >> 5] |= 1u << (k & 31);
        }
    }
}
