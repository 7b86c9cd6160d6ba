/* group_matmul.c's kernels for CPUs with AVX2 but not AVX512-VNNI (Zen 2 / 3, Intel's client
 * cores since Alder Lake), on the same tiles: included by group_matmul.c when compiled with
 * -DSAGUARO_AVX2.
 *
 * A 256-bit register holds half a tile's outputs: each group's tile is computed as two halves,
 * outputs 0-7 and 8-15, side by side while the next tiles stream in (two passes over a column,
 * the second from L2, made one row 20% slower and six no faster). vpdpbusd becomes vpmaddubsw
 * (u8 x s8 pairs summed to int16) and vpmaddwd with ones: exact while a pair's sum fits in
 * int16, which holds for codes below 64 (2 x 63 x 127 < 32768). 8-bit and IQ4 codes do not
 * fit, so they multiply as signed codes by the sign trick: |code| x (q with code's sign), at
 * most 2 x 128 x 127. Every integer sum is exact and every fp32 operation is the one the AVX512
 * kernel does per lane, in the same order: the two builds agree bit for bit on 4- to 8-bit
 * and IQ4 tiles.
 */

int saguaro_bf16_supported(void) { return saguaro_cpu_supported(); }

/* R rows of bf16 activations against one column of 16-bit tiles: fp32 sums, input by input in
 * order (pairs widened to fp32: no bf16 pair dot on these CPUs). */
TARGET static void tile_column_bf16(int R, const uint8_t *tiles, const uint16_t *x, int64_t in_features,
                                    float *sums_out) {
    const __m256i high = _mm256_set1_epi32((int)0xFFFF0000u);
    __m256 acc[MAX_ROWS][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t g = 0; g < in_features / GROUP; g++) {
        const uint8_t *tile = tiles + g * 1024;
        for (int line = 0; line < 1024; line += 64)
            _mm_prefetch((const char *)tile + 4 * 1024 + line, _MM_HINT_T0);
        for (int k = 0; k < 16; k++)
            for (int h = 0; h < 2; h++) {
                const __m256i w = _mm256_loadu_si256((const __m256i *)(tile + 64 * k + 32 * h));
                const __m256 even = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
                const __m256 odd = _mm256_castsi256_ps(_mm256_and_si256(w, high));
                for (int r = 0; r < R; r++) {
                    const uint16_t *pair = x + r * in_features + g * GROUP + 2 * k;
                    const uint32_t a = (uint32_t)pair[0] << 16, b = (uint32_t)pair[1] << 16;
                    float fa, fb;
                    memcpy(&fa, &a, 4);
                    memcpy(&fb, &b, 4);
                    acc[r][h] = _mm256_fmadd_ps(even, _mm256_set1_ps(fa), acc[r][h]);
                    acc[r][h] = _mm256_fmadd_ps(odd, _mm256_set1_ps(fb), acc[r][h]);
                }
            }
    }
    for (int r = 0; r < R; r++)
        for (int h = 0; h < 2; h++) _mm256_storeu_ps(sums_out + r * TILE_OUT + 8 * h, acc[r][h]);
}

TARGET static inline __m256 bf16_to_ps(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

/* As the AVX512 kernel: d = max|x| / 127, q = round-to-even(x * 127 / max|x|). */
TARGET static void quantize_row(const uint16_t *x, int64_t groups, QuantizedGroup *out) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t g = 0; g < groups; g++) {
        __m256 v[4], amax = _mm256_setzero_ps();
        for (int i = 0; i < 4; i++) {
            v[i] = bf16_to_ps(x + g * GROUP + 8 * i);
            amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
        }
        float lanes[8], top = 0.0f;
        _mm256_storeu_ps(lanes, amax);
        for (int i = 0; i < 8; i++) top = lanes[i] > top ? lanes[i] : top;
        const float d = top / 127.0f, inverse = top > 0.0f ? 127.0f / top : 0.0f;
        int32_t q[GROUP];
        for (int i = 0; i < 4; i++)
            _mm256_storeu_si256((__m256i *)(q + 8 * i), _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(inverse))));
        out[g].half_qsum[0] = out[g].half_qsum[1] = 0;
        for (int i = 0; i < GROUP; i++) {
            out[g].q[i] = (int8_t)q[i];
            out[g].half_qsum[i >= 16] += q[i];
        }
        out[g].qsum = out[g].half_qsum[0] + out[g].half_qsum[1];
        out[g].d = d;
        out[g].d_qsum = d * (float)out[g].qsum;
        out[g].d_half_qsum[0] = d * (float)out[g].half_qsum[0];
        out[g].d_half_qsum[1] = d * (float)out[g].half_qsum[1];
    }
}

TARGET static inline __m256 halves(const uint8_t *p) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}

TARGET static inline __m256i quad_of(const int8_t *q) {
    int32_t v;
    memcpy(&v, q, 4);
    return _mm256_set1_epi32(v);
}

/* sum += unsigned codes (< 64) x signed q, four at a time into int32 lanes */
TARGET static inline __m256i dot_unsigned(__m256i sum, __m256i codes, __m256i q) {
    return _mm256_add_epi32(sum, _mm256_madd_epi16(_mm256_maddubs_epi16(codes, q), _mm256_set1_epi16(1)));
}

/* sum += signed codes x signed q (the sign trick) */
TARGET static inline __m256i dot_signed(__m256i sum, __m256i codes, __m256i q) {
    return dot_unsigned(sum, _mm256_abs_epi8(codes), _mm256_sign_epi8(q, codes));
}

/* A chunk's codes for one half of the tile (outputs 8h .. 8h + 7): the first 16 inputs' and the
 * last 16's, widened to bytes as the kind's dots take them (IQ4: its table values, signed);
 * bits is the kind's code_width. */
TARGET static inline __attribute__((always_inline)) void codes_of(int bits, const uint8_t *tile, int u, int h,
                                                                  __m256i *first, __m256i *second) {
    if (bits <= 3) { /* K2, K3: two bits from each half's plane; K3's third from the tops (group_matmul.c) */
        const __m256i two = _mm256_set1_epi8(0x03), third = _mm256_set1_epi8(0x04);
        *first = _mm256_and_si256(_mm256_srli_epi16(_mm256_loadu_si256((const __m256i *)(tile + 32 * h)), 2 * u), two);
        *second = _mm256_and_si256(_mm256_srli_epi16(_mm256_loadu_si256((const __m256i *)(tile + 64 + 32 * h)), 2 * u),
                                   two);
        if (bits == 3) {
            const __m256i tops = _mm256_loadu_si256((const __m256i *)(tile + 128 + 32 * h));
            *first = _mm256_or_si256(*first, _mm256_and_si256(
                u < 2 ? _mm256_slli_epi16(tops, 2 - u) : _mm256_srli_epi16(tops, u - 2), third));
            *second = _mm256_or_si256(*second, _mm256_and_si256(_mm256_srli_epi16(tops, u + 2), third));
        }
        return;
    }
    if (bits == 6) { /* triple u / 2's chunks; the fourth code from their top bits (group_matmul.c) */
        const uint8_t *triple = tile + 192 * (u >> 1) + 32 * h;
        const __m256i six = _mm256_set1_epi8(0x3F), tops = _mm256_set1_epi8((char)0xC0);
        const __m256i x = _mm256_loadu_si256((const __m256i *)triple);
        const __m256i y = _mm256_loadu_si256((const __m256i *)(triple + 64));
        const __m256i z = _mm256_loadu_si256((const __m256i *)(triple + 128));
        *first = _mm256_and_si256(u & 1 ? y : x, six);
        *second = u & 1 ? _mm256_or_si256(_mm256_or_si256(_mm256_srli_epi16(_mm256_and_si256(x, tops), 6),
                                                           _mm256_srli_epi16(_mm256_and_si256(y, tops), 4)),
                                          _mm256_srli_epi16(_mm256_and_si256(z, tops), 2))
                        : _mm256_and_si256(z, six);
        return;
    }
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    const __m256i w = _mm256_loadu_si256((const __m256i *)(tile + 64 * u + 32 * h));
    *first = _mm256_and_si256(w, nibble);
    *second = _mm256_and_si256(_mm256_srli_epi16(w, 4), nibble);
    if (bits == NL4) {
        const __m256i table = _mm256_broadcastsi128_si256(_mm_setr_epi8(
            -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113));
        *first = _mm256_shuffle_epi8(table, *first);
        *second = _mm256_shuffle_epi8(table, *second);
    }
    if (bits == 5) {
        const __m256i one = _mm256_set1_epi8(0x01);
        const __m256i top = _mm256_srli_epi16(_mm256_loadu_si256((const __m256i *)(tile + 256 + 32 * h)), 2 * u);
        *first = _mm256_or_si256(*first, _mm256_slli_epi16(_mm256_and_si256(top, one), 4));
        *second = _mm256_or_si256(*second, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(top, 1), one), 4));
    }
}

/* R rows of quantized activations against one column of tiles (16 outputs): fp32 sums, as the
 * AVX-512 kernel's tile_column takes them (`stride`, `resume`). Each
 * chunk's codes are widened once for both halves, and each row's activations broadcast once
 * for both. 4- and 5-bit codes add a chunk's two byte pair products in int16 (at most 2 x 2 x
 * 31 x 127 < 32768) before widening them: one vpmaddwd where there were two. */
TARGET static inline __attribute__((always_inline)) void tile_column(
        int bits, int R, const uint8_t *tiles, const QuantizedGroup *xq, int64_t stride, int64_t groups,
        float *sums_out, int resume) {
    const __m256i ones = _mm256_set1_epi16(1);
    const int64_t tile_bytes = saguaro_tile_bytes(bits);
    const int width = code_width(bits), blocked = is_record(bits);
    const int halves_apart = width == 6 || width == 3 || width == 2;
    __m256 acc[MAX_ROWS][2], block_d[2], block_neg_dmin[2]; /* K-quants: per half */
    for (int r = 0; r < R; r++)
        for (int h = 0; h < 2; h++)
            acc[r][h] = resume ? _mm256_loadu_ps(sums_out + r * TILE_OUT + 8 * h) : _mm256_setzero_ps();
    block_d[0] = block_d[1] = block_neg_dmin[0] = block_neg_dmin[1] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *record = tiles + (g / BLOCK_GROUPS) * BLOCK_GROUPS * tile_bytes; /* K-quants */
        const uint8_t *tile = blocked ? record_codes(bits, record, g) : tiles + g * tile_bytes;
        if (blocked && g % BLOCK_GROUPS == 0) /* the block's d (and -dmin), converted once */
            for (int h = 0; h < 2; h++) {
                block_d[h] = halves(record + 16 * h);
                if (has_mins(bits)) block_neg_dmin[h] = _mm256_sub_ps(_mm256_setzero_ps(), halves(record + 32 + 16 * h));
            }
        for (int64_t line = 0; line < tile_bytes; line += 64)
            _mm_prefetch((const char *)tiles + (g + PREFETCH_TILES) * tile_bytes + line, _MM_HINT_T0);
        /* per row and half: one int32 sum; 6-bit codes keep their two 16-input halves apart */
        __m256i dots[MAX_ROWS][2][2];
        for (int r = 0; r < R; r++)
            for (int h = 0; h < 2; h++) dots[r][h][0] = dots[r][h][1] = _mm256_setzero_si256();
        if (width != 8) {
            for (int u = 0; u < 4; u++) {
                __m256i first[2], second[2];
                for (int h = 0; h < 2; h++) codes_of(width, tile, u, h, first + h, second + h);
                for (int r = 0; r < R; r++) {
                    const int8_t *q = xq[r * stride + g].q;
                    const __m256i qa = quad_of(q + 4 * u), qb = quad_of(q + 16 + 4 * u);
                    for (int h = 0; h < 2; h++) {
                        if (bits == NL4) {
                            dots[r][h][0] = dot_signed(dots[r][h][0], first[h], qa);
                            dots[r][h][0] = dot_signed(dots[r][h][0], second[h], qb);
                        } else if (halves_apart) {
                            dots[r][h][0] = dot_unsigned(dots[r][h][0], first[h], qa);
                            dots[r][h][1] = dot_unsigned(dots[r][h][1], second[h], qb);
                        } else {
                            const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(first[h], qa),
                                                                   _mm256_maddubs_epi16(second[h], qb));
                            dots[r][h][0] = _mm256_add_epi32(dots[r][h][0], _mm256_madd_epi16(pairs, ones));
                        }
                    }
                }
            }
        } else {
            const __m256i offset = _mm256_set1_epi8((char)0x80);
            for (int k = 0; k < 8; k++) { /* code + 128 -> code */
                __m256i w[2];
                for (int h = 0; h < 2; h++)
                    w[h] = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(tile + 64 * k + 32 * h)), offset);
                for (int r = 0; r < R; r++) {
                    const __m256i qk = quad_of(xq[r * stride + g].q + 4 * k);
                    for (int h = 0; h < 2; h++) dots[r][h][0] = dot_signed(dots[r][h][0], w[h], qk);
                }
            }
        }
        for (int h = 0; h < 2; h++) {
            if (halves_apart) {
                const uint8_t *subs = (blocked ? record + (bits == K2 ? 64 : 32) + 32 * (g % BLOCK_GROUPS) : tile + 384) + 8 * h;
                __m256i scale0 = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)subs));
                __m256i scale1 = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(subs + 16)));
                __m256 low0 = _mm256_setzero_ps(), low1 = _mm256_setzero_ps();
                if (bits == K2) { /* as the AVX512 kernel */
                    const __m256i nibble32 = _mm256_set1_epi32(0x0F);
                    low0 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(scale0, 4), nibble32)),
                                         block_neg_dmin[h]);
                    low1 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(scale1, 4), nibble32)),
                                         block_neg_dmin[h]);
                    scale0 = _mm256_and_si256(scale0, nibble32);
                    scale1 = _mm256_and_si256(scale1, nibble32);
                }
                const __m256 d = blocked ? block_d[h] : halves(tile + 416 + 16 * h);
                for (int r = 0; r < R; r++) {
                    const QuantizedGroup *x = xq + r * stride + g;
                    const __m256i first = _mm256_sub_epi32(dots[r][h][0], _mm256_set1_epi32(code_offset(width) * x->half_qsum[0]));
                    const __m256i second = _mm256_sub_epi32(dots[r][h][1], _mm256_set1_epi32(code_offset(width) * x->half_qsum[1]));
                    const __m256i dot = _mm256_add_epi32(_mm256_mullo_epi32(first, scale0), _mm256_mullo_epi32(second, scale1));
                    acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(d, _mm256_set1_ps(x->d)), acc[r][h]);
                    if (bits == K2) {
                        acc[r][h] = _mm256_fmadd_ps(low0, _mm256_set1_ps(x->d_half_qsum[0]), acc[r][h]);
                        acc[r][h] = _mm256_fmadd_ps(low1, _mm256_set1_ps(x->d_half_qsum[1]), acc[r][h]);
                    }
                }
                continue;
            }
            const uint8_t *params = tile + (bits == 4 || bits == NL4 || bits == SYM4 ? 256 : bits == 5 ? 320 : 512) + 16 * h;
            __m256 scale, low = _mm256_setzero_ps();
            if (bits == K4 || bits == K5) { /* as the AVX512 kernel: exact fp32 products */
                const uint8_t *at = record + 64 + 16 * (g % BLOCK_GROUPS) + 8 * h;
                const __m256 sub = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)at)));
                const __m256 min = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(at + 128))));
                scale = _mm256_mul_ps(sub, block_d[h]);
                low = _mm256_mul_ps(min, block_neg_dmin[h]);
            } else {
                scale = halves(params);
                if (bits == 4 || bits == 5) low = halves(params + 32);
            }
            for (int r = 0; r < R; r++) {
                const QuantizedGroup *x = xq + r * stride + g;
                const __m256i dot = bits == SYM4 ? _mm256_sub_epi32(dots[r][h][0], _mm256_set1_epi32(8 * x->qsum))
                                                 : dots[r][h][0];
                acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(scale, _mm256_set1_ps(x->d)), acc[r][h]);
                if (bits == 4 || bits == 5 || bits == K4 || bits == K5)
                    acc[r][h] = _mm256_fmadd_ps(low, _mm256_set1_ps(x->d_qsum), acc[r][h]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int h = 0; h < 2; h++) _mm256_storeu_ps(sums_out + r * TILE_OUT + 8 * h, acc[r][h]);
}

/* A tile column's 16 sums for one row, into out (bf16, rounded to nearest even, or fp32). */
static inline void store_sums(const float *sums, void *out, int64_t at, int out_fp32) {
    if (out_fp32) {
        memcpy((float *)out + at, sums, sizeof(float) * TILE_OUT);
        return;
    }
    for (int i = 0; i < TILE_OUT; i++) {
        uint32_t bits;
        memcpy(&bits, sums + i, 4);
        ((uint16_t *)out)[at + i] = (uint16_t)((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);
    }
}
