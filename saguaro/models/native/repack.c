/* GGUF blocks straight into group_matmul.c's tiles (and rows of an embedding into bf16), read
 * from the file's mapped bytes: no intermediate codes, one pass, threads over tile columns.
 *
 * Each 32-weight group of a row is first decoded into what a tile holds for it (the codes as
 * the tile stores them, and the group's scale and low, or Q6_K's two sub-scales and d), with
 * the block layouts of ggml (ggml-quants.c documents them; tests/test_quantized.py checks the
 * result against gguf-py's dequantization).
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define GROUP 32
#define TILE_OUT 16
#define TARGET __attribute__((target("f16c")))

/* ggml's type ids */
enum { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14, IQ4_NL = 20,
       IQ4_XS = 23 };
#define NL4 104 /* group_matmul.c's IQ4 tile kind */
#define SYM4 100 /* group_matmul.c's Q4_0 tile kind */
#define K4 124 /* group_matmul.c's Q4_K record kind */
#define K5 125 /* group_matmul.c's Q5_K record kind */
#define K6 126 /* group_matmul.c's Q6_K record kind */
#define K3 123 /* group_matmul.c's Q3_K record kind */
#define K2 122 /* group_matmul.c's Q2_K record kind */
#define K4_CODES 320 /* where a K4 record's codes begin, after its block parameters */
#define K5_CODES 320 /* and a K5 record's */
#define K6_CODES 288 /* and a K6 record's */
#define K3_CODES 288 /* and a K3 record's */
#define K2_CODES 320 /* and a K2 record's */
static const int8_t IQ4_VALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

typedef struct {
    int16_t code[GROUP]; /* 4 / 5 bits: 0..15 / 0..31; Q6_K: 0..63 (the value plus 32); Q8_0: -128..127;
                          * IQ4: 0..15, an index into IQ4_VALUES */
    float scale, low;    /* w = code * scale + low (Q6_K: w = (code - 32) * sub * d; IQ4: IQ4_VALUES[code] * scale) */
    int8_t sub[2];       /* Q6_K: the sub-scales of inputs 0-15 and 16-31 */
    float d;             /* Q6_K: the super-block scale */
} Group;

TARGET static inline float half_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

TARGET static inline void put_half(uint8_t *p, float v) {
    uint16_t h = _cvtss_sh(v, 0); /* round to nearest even, as torch's .half() */
    memcpy(p, &h, 2);
}

int saguaro_type_bits(int type) {
    switch (type) {
        case Q4_0: return SYM4;
        case Q4_1: return 4;
        case Q4_K: return K4;
        case Q5_0: case Q5_1: return 5;
        case Q5_K: return K5;
        case Q2_K: return K2;
        case Q3_K: return K3;
        case Q6_K: return K6;
        case Q8_0: return 8;
        case IQ4_NL: case IQ4_XS: return NL4;
        default: return 0;
    }
}

static int64_t block_bytes(int type) {
    switch (type) {
        case Q4_0: return 18; case Q4_1: return 20; case Q5_0: return 22; case Q5_1: return 24; case Q8_0: return 34;
        case Q2_K: return 84; case Q3_K: return 110; case Q4_K: return 144; case Q5_K: return 176; case Q6_K: return 210;
        case IQ4_NL: return 18; case IQ4_XS: return 136;
        default: return 0;
    }
}

static int64_t block_weights(int type) {
    return type == Q2_K || type == Q3_K || type == Q4_K || type == Q5_K || type == Q6_K || type == IQ4_XS ? 256 : 32;
}

/* Q4_K / Q5_K: the six-bit scale and min of sub-block j packed in 12 bytes */
static inline void k_scale_min(int j, const uint8_t *q, int *scale, int *min) {
    if (j < 4) {
        *scale = q[j] & 63;
        *min = q[j + 4] & 63;
    } else {
        *scale = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *min = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

TARGET static void decode_group(int type, const uint8_t *row, int64_t g, Group *out) {
    const int64_t per_block = block_weights(type) / GROUP;
    const uint8_t *b = row + (g / per_block) * block_bytes(type);
    const int sb = (int)(g % per_block); /* 32-weight sub-block within a 256-weight block */
    switch (type) {
        case Q4_0: case Q4_1: case Q5_0: case Q5_1: {
            const int has_min = type == Q4_1 || type == Q5_1, five = type == Q5_0 || type == Q5_1;
            const float d = half_at(b);
            uint32_t top = 0;
            if (five) memcpy(&top, b + 2 + 2 * has_min, 4);
            const uint8_t *qs = b + 2 + 2 * has_min + 4 * five;
            for (int j = 0; j < GROUP; j++) {
                int code = j < 16 ? qs[j] & 15 : qs[j - 16] >> 4;
                out->code[j] = (int16_t)(code | (five ? ((top >> j) & 1) << 4 : 0));
            }
            out->scale = d;
            out->low = has_min ? half_at(b + 2) : (five ? -16.0f : -8.0f) * d;
            break;
        }
        case IQ4_NL: case IQ4_XS: {
            /* IQ4_NL: fp16 d, 16 bytes of codes. IQ4_XS: fp16 d, 16 bits of the sub-scales' top
             * two bits, 4 bytes of their low four, 128 bytes of codes; sub-scale = ls - 32. */
            const uint8_t *qs = type == IQ4_NL ? b + 2 : b + 8 + 16 * sb;
            for (int j = 0; j < GROUP; j++) out->code[j] = (int16_t)(j < 16 ? qs[j] & 15 : qs[j - 16] >> 4);
            out->scale = half_at(b);
            if (type == IQ4_XS) {
                uint16_t high;
                memcpy(&high, b + 2, 2);
                const int ls = ((b[4 + sb / 2] >> (4 * (sb % 2))) & 15) | (((high >> (2 * sb)) & 3) << 4);
                out->scale *= (float)(ls - 32);
            }
            out->low = 0.0f;
            break;
        }
        case Q8_0:
            for (int j = 0; j < GROUP; j++) out->code[j] = (int8_t)b[2 + j];
            out->scale = half_at(b);
            out->low = 0.0f;
            break;
        case Q4_K: case Q5_K: {
            int scale, min;
            k_scale_min(sb, b + 4, &scale, &min);
            out->scale = half_at(b) * (float)scale;
            out->low = -(half_at(b + 2) * (float)min);
            const int chunk = sb / 2, half = sb % 2;
            const uint8_t *qs = b + (type == Q4_K ? 16 : 48) + 32 * chunk, *qh = b + 16;
            for (int j = 0; j < GROUP; j++) {
                int code = (qs[j] >> (4 * half)) & 15;
                if (type == Q5_K) code |= ((qh[j] >> (2 * chunk + half)) & 1) << 4;
                out->code[j] = (int16_t)code;
            }
            break;
        }
        case Q3_K: {
            /* 32 bytes of top bits, 64 of two-bit codes, 16 six-bit sub-scales in 12 bytes (low
             * nibbles, then top bit pairs), fp16 d; w = d * (sub - 32) * (two bits - (top ? 0 : 4)) */
            const int n = sb / 4, j = sb % 4;
            const uint8_t *hmask = b, *qs = b + 32 + 32 * n, *scales = b + 96;
            for (int l = 0; l < GROUP; l++) {
                const int low2 = (qs[l] >> (2 * j)) & 3, top = (hmask[l] >> (4 * n + j)) & 1;
                out->code[l] = (int16_t)(low2 - (top ? 0 : 4) + 32); /* as Q6_K's tiles hold codes */
            }
            for (int s = 0; s < 2; s++) {
                const int k = 2 * sb + s;
                const int low4 = k < 8 ? scales[k] & 15 : scales[k - 8] >> 4;
                const int top2 = (scales[8 + k % 4] >> (2 * (k / 4))) & 3;
                out->sub[s] = (int8_t)((low4 | (top2 << 4)) - 32);
            }
            out->d = half_at(b + 108);
            break;
        }
        case Q6_K: {
            const int n = sb / 4, i = sb % 4; /* half of 128 weights, quarter of 32 within it */
            const uint8_t *ql = b + 64 * n + (i & 1 ? 32 : 0), *qh = b + 128 + 32 * n;
            for (int l = 0; l < GROUP; l++) {
                int low4 = i >= 2 ? ql[l] >> 4 : ql[l] & 15;
                out->code[l] = (int16_t)(low4 | (((qh[l] >> (2 * i)) & 3) << 4));
            }
            out->sub[0] = (int8_t)b[192 + 2 * sb];
            out->sub[1] = (int8_t)b[192 + 2 * sb + 1];
            out->d = half_at(b + 208);
            break;
        }
    }
}

/* The 4-bit types, fast: group g of a row as the 16 bytes a 4-bit tile holds for it (byte i:
 * code i in the low nibble, code 16 + i in the high), with its scale and low. Q4_0, Q4_1,
 * IQ4_NL and IQ4_XS store their codes so already. */
TARGET static void decode_pairs(int type, const uint8_t *row, int64_t g, uint8_t pairs[16], float *scale, float *low) {
    const int64_t per_block = block_weights(type) / GROUP;
    const uint8_t *b = row + (g / per_block) * block_bytes(type);
    const int sb = (int)(g % per_block);
    *scale = half_at(b);
    *low = type == Q4_0 ? -8.0f * *scale : type == Q4_1 ? half_at(b + 2) : 0.0f;
    if (type == IQ4_XS) {
        uint16_t high;
        memcpy(&high, b + 2, 2);
        *scale *= (float)((((b[4 + sb / 2] >> (4 * (sb % 2))) & 15) | (((high >> (2 * sb)) & 3) << 4)) - 32);
    }
    memcpy(pairs, type == Q4_1 ? b + 4 : type == IQ4_XS ? b + 8 + 16 * sb : b + 2, 16);
}

/* Row j's 16 bytes of a 4-bit tile's codes from 32 nibbles: byte i pairs the low (or, with
 * high set, the high) nibbles of qs[i] and qs[16 + i], the first in its low half. */
TARGET static inline void put_nibble_pairs(const uint8_t *qs, int high, uint8_t *tile, int j) {
    const __m128i nibble = _mm_set1_epi8(15);
    const __m128i first = _mm_loadu_si128((const __m128i *)qs), second = _mm_loadu_si128((const __m128i *)(qs + 16));
    __m128i pairs = high ? _mm_or_si128(_mm_and_si128(_mm_srli_epi16(first, 4), nibble), _mm_andnot_si128(nibble, second))
                         : _mm_or_si128(_mm_and_si128(first, nibble), _mm_slli_epi16(_mm_and_si128(second, nibble), 4));
    for (int u = 0; u < 4; u++, pairs = _mm_srli_si128(pairs, 4)) {
        const int32_t four = _mm_cvtsi128_si32(pairs);
        memcpy(tile + 64 * u + 4 * j, &four, 4);
    }
}

/* Q4_K: a row's 256-weight block as row j of its K4 record (group_matmul.c): d and dmin as
 * the file stores them, the six-bit sub-scales and mins a byte each, then each group's nibbles
 * paired as a 4-bit tile pairs them. */
TARGET static void q4_k_block_record(const uint8_t *b, uint8_t *record, int j) {
    for (int sb = 0; sb < 8; sb++) {
        int sc, min;
        k_scale_min(sb, b + 4, &sc, &min);
        put_nibble_pairs(b + 16 + 32 * (sb / 2), sb % 2, record + K4_CODES + 256 * sb, j);
        record[64 + 16 * sb + j] = (uint8_t)sc;
        record[192 + 16 * sb + j] = (uint8_t)min;
    }
    memcpy(record + 2 * j, b, 2);
    memcpy(record + 32 + 2 * j, b + 2, 2);
}

/* Q5_K: row j of a 256-weight block's K5 record: K4's parameters, then each group's low four bits
 * as Q4_K's and its 64 bytes of top bits as the 5-bit tile holds them (byte 4j + t, bit 2u + s:
 * input 16s + 4u + t), the top bit of sub-block sb's input l being bit sb of qh[l]. */
TARGET static void q5_k_block_record(const uint8_t *b, uint8_t *record, int j) {
    const uint8_t *qh = b + 16;
    for (int sb = 0; sb < 8; sb++) {
        int sc, min;
        k_scale_min(sb, b + 4, &sc, &min);
        uint8_t *tile = record + K5_CODES + 320 * sb;
        put_nibble_pairs(b + 48 + 32 * (sb / 2), sb % 2, tile, j);
        for (int t = 0; t < 4; t++) {
            uint8_t top = 0;
            for (int u = 0; u < 4; u++)
                for (int half = 0; half < 2; half++)
                    top |= (uint8_t)(((qh[16 * half + 4 * u + t] >> sb) & 1) << (2 * u + half));
            tile[256 + 4 * j + t] = top;
        }
        record[64 + 16 * sb + j] = (uint8_t)sc;
        record[192 + 16 * sb + j] = (uint8_t)min;
    }
    memcpy(record + 2 * j, b, 2);
    memcpy(record + 32 + 2 * j, b + 2, 2);
}

/* Row j's 6-bit codes (0..63, inputs 0-31 of a group) as a 6-bit tile holds them (group_matmul.c):
 * in two triples of chunks, the codes of inputs 8h + t, 8h + 4 + t and 16 + 8h + t in bits 0-5
 * of triple h's three bytes 4j + t, and two bits each of the code of input 16 + 8h + 4 + t on top. */
static void put_six_bit_codes(const uint8_t *code, uint8_t *tile, int j) {
    for (int h = 0; h < 2; h++)
        for (int t = 0; t < 4; t++) {
            const int fourth = code[16 + 8 * h + 4 + t];
            uint8_t *at = tile + 192 * h + 4 * j + t;
            at[0] = (uint8_t)(code[8 * h + t] | (fourth & 3) << 6);
            at[64] = (uint8_t)(code[8 * h + 4 + t] | ((fourth >> 2) & 3) << 6);
            at[128] = (uint8_t)(code[16 + 8 * h + t] | (fourth >> 4) << 6);
        }
}

/* Q6_K: row j of a 256-weight block's K6 record: d, the sub-scales, then each group's codes as
 * a 6-bit tile holds them. Group sb's input l is the block's weight 32 sb + l: its low nibble
 * from ql (the low or high halves of bytes 64n .. 64n + 63), its top two bits at bit 2i of qh. */
static void q6_k_block_record(const uint8_t *b, uint8_t *record, int j) {
    for (int sb = 0; sb < 8; sb++) {
        const int n = sb / 4, i = sb % 4;
        const uint8_t *ql = b + 64 * n + (i & 1 ? 32 : 0), *qh = b + 128 + 32 * n;
        uint8_t code[GROUP];
        for (int l = 0; l < GROUP; l++)
            code[l] = (uint8_t)(((ql[l] >> (i >= 2 ? 4 : 0)) & 15) | ((qh[l] >> (2 * i)) & 3) << 4);
        put_six_bit_codes(code, record + K6_CODES + 384 * sb, j);
        record[32 + 32 * sb + j] = b[192 + 2 * sb];
        record[32 + 32 * sb + 16 + j] = b[192 + 2 * sb + 1];
    }
    memcpy(record + 2 * j, b + 208, 2);
}

/* Q3_K: row j of a 256-weight block's K3 record: d, the sub-scales as K6's, then each group's
 * codes (0..7, the value plus 4) as two planes, the low two bits and the top one. */
TARGET static void q3_k_block_record(const uint8_t *b, uint8_t *record, int j) {
    for (int sb = 0; sb < 8; sb++) {
        Group group;
        decode_group(Q3_K, b, sb, &group); /* the block as a one-block row */
        uint8_t *codes = record + K3_CODES + 192 * sb;
        for (int t = 0; t < 4; t++) {
            uint8_t low[2] = {0, 0}, top = 0;
            for (int s = 0; s < 2; s++)
                for (int u = 0; u < 4; u++) {
                    const int c = group.code[16 * s + 4 * u + t] - 28; /* decode_group's value + 32, as + 4 */
                    low[s] |= (uint8_t)((c & 3) << (2 * u));
                    top |= (uint8_t)(((c >> 2) & 1) << (4 * s + u));
                }
            codes[4 * j + t] = low[0];
            codes[64 + 4 * j + t] = low[1];
            codes[128 + 4 * j + t] = top;
        }
        record[32 + 32 * sb + j] = (uint8_t)group.sub[0];
        record[32 + 32 * sb + 16 + j] = (uint8_t)group.sub[1];
    }
    memcpy(record + 2 * j, b + 108, 2);
}

/* Q2_K (16 bytes of four-bit scales and mins, one per 16 weights; 64 of two-bit codes; fp16 d
 * and dmin): row j of a 256-weight block's K2 record, d and dmin, each half group's scale and
 * min byte as the file holds it, then each group's codes in two planes, as K3's low two bits. */
TARGET static void q2_k_block_record(const uint8_t *b, uint8_t *record, int j) {
    for (int sb = 0; sb < 8; sb++) {
        const uint8_t *qs = b + 16 + 32 * (sb / 4);
        uint8_t *codes = record + K2_CODES + 128 * sb;
        for (int t = 0; t < 4; t++)
            for (int s = 0; s < 2; s++) {
                uint8_t low = 0;
                for (int u = 0; u < 4; u++) low |= (uint8_t)(((qs[16 * s + 4 * u + t] >> (2 * (sb % 4))) & 3) << (2 * u));
                codes[64 * s + 4 * j + t] = low;
            }
        record[64 + 32 * sb + j] = b[2 * sb];
        record[64 + 32 * sb + 16 + j] = b[2 * sb + 1];
    }
    memcpy(record + 2 * j, b + 80, 2);
    memcpy(record + 32 + 2 * j, b + 82, 2);
}

/* One tile (16 outputs x 32 inputs) from its 16 rows' decoded groups, laid out as
 * group_matmul.c reads it. */
TARGET static void write_tile(int bits, const Group *groups, uint8_t *tile) {
    if (bits == 8) {
        for (int k = 0; k < 8; k++)
            for (int j = 0; j < TILE_OUT; j++)
                for (int t = 0; t < 4; t++) tile[64 * k + 4 * j + t] = (uint8_t)(groups[j].code[4 * k + t] + 128);
        for (int j = 0; j < TILE_OUT; j++) put_half(tile + 512 + 2 * j, groups[j].scale);
        return;
    }
    if (bits == 6) {
        for (int j = 0; j < TILE_OUT; j++) {
            uint8_t code[GROUP];
            for (int i = 0; i < GROUP; i++) code[i] = (uint8_t)groups[j].code[i];
            put_six_bit_codes(code, tile, j);
        }
        for (int j = 0; j < TILE_OUT; j++) {
            tile[384 + j] = (uint8_t)groups[j].sub[0];
            tile[400 + j] = (uint8_t)groups[j].sub[1];
            put_half(tile + 416 + 2 * j, groups[j].d);
        }
        return;
    }
    for (int u = 0; u < 4; u++)
        for (int j = 0; j < TILE_OUT; j++)
            for (int t = 0; t < 4; t++) {
                const int16_t *c = groups[j].code;
                tile[64 * u + 4 * j + t] = (uint8_t)((c[4 * u + t] & 15) | ((c[16 + 4 * u + t] & 15) << 4));
            }
    if (bits == 5) {
        for (int j = 0; j < TILE_OUT; j++)
            for (int t = 0; t < 4; t++) {
                uint8_t top = 0;
                for (int u = 0; u < 4; u++)
                    for (int s = 0; s < 2; s++) top |= (uint8_t)(((groups[j].code[16 * s + 4 * u + t] >> 4) & 1) << (2 * u + s));
                tile[256 + 4 * j + t] = top;
            }
    }
    const int params = bits == 5 ? 320 : 256;
    for (int j = 0; j < TILE_OUT; j++) {
        put_half(tile + params + 2 * j, groups[j].scale);
        if (bits != NL4) put_half(tile + params + 32 + 2 * j, groups[j].low);
    }
}

int64_t saguaro_tile_bytes(int bits);
int64_t saguaro_tile_offset(int bits, int64_t columns, int64_t groups, int64_t column, int64_t g);

/* tiles of rows x cols weights held as `type` blocks, `row_bytes` apart; output row r reads
 * row order[r] (order may be NULL). Returns 0, or -2 for a type or shape the tiles do not take. */
TARGET int saguaro_repack(int type, const uint8_t *data, int64_t row_bytes, int64_t rows, int64_t cols,
                   const int64_t *order, uint8_t *tiles, int threads) {
    const int bits = saguaro_type_bits(type);
    if (!bits || rows % TILE_OUT || cols % block_weights(type)) return -2;
    const int64_t groups = cols / GROUP;
    if (type == Q2_K || type == Q3_K || type == Q4_K || type == Q5_K || type == Q6_K) {
#pragma omp parallel for schedule(static) num_threads(threads)
        for (int64_t column = 0; column < rows / TILE_OUT; column++)
            for (int64_t block = 0; block < cols / 256; block++)
                for (int j = 0; j < TILE_OUT; j++) {
                    const int64_t r = column * TILE_OUT + j;
                    const uint8_t *b = data + (order ? order[r] : r) * row_bytes + block * block_bytes(type);
                    uint8_t *record = tiles + saguaro_tile_offset(bits, rows / TILE_OUT, groups, column, block * 8);
                    if (type == Q4_K) q4_k_block_record(b, record, j);
                    else if (type == Q5_K) q5_k_block_record(b, record, j);
                    else if (type == Q6_K) q6_k_block_record(b, record, j);
                    else if (type == Q3_K) q3_k_block_record(b, record, j);
                    else q2_k_block_record(b, record, j);
                }
        return 0;
    }
    if (bits == 4 || bits == NL4 || bits == SYM4) { /* the common case: bytes moved, not codes decoded */
#pragma omp parallel for schedule(static) num_threads(threads)
        for (int64_t column = 0; column < rows / TILE_OUT; column++) {
            for (int64_t g = 0; g < groups; g++) {
                uint8_t *tile = tiles + saguaro_tile_offset(bits, rows / TILE_OUT, groups, column, g);
                for (int j = 0; j < TILE_OUT; j++) {
                    const int64_t r = column * TILE_OUT + j;
                    uint8_t pairs[16];
                    float scale, low;
                    decode_pairs(type, data + (order ? order[r] : r) * row_bytes, g, pairs, &scale, &low);
                    for (int u = 0; u < 4; u++) memcpy(tile + 64 * u + 4 * j, pairs + 4 * u, 4);
                    put_half(tile + 256 + 2 * j, scale);
                    if (bits == 4) put_half(tile + 288 + 2 * j, low);
                }
            }
        }
        return 0;
    }
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t column = 0; column < rows / TILE_OUT; column++) {
        Group decoded[TILE_OUT];
        for (int64_t g = 0; g < groups; g++) {
            for (int j = 0; j < TILE_OUT; j++) {
                const int64_t r = column * TILE_OUT + j;
                decode_group(type, data + (order ? order[r] : r) * row_bytes, g, &decoded[j]);
            }
            write_tile(bits, decoded, tiles + saguaro_tile_offset(bits, rows / TILE_OUT, groups, column, g));
        }
    }
    return 0;
}

/* Q6_K's 256 weights of block b, as decode_group and the formula below give them (the same
 * products in the same order), without a call per group. */
TARGET static void q6_k_block_weights(const uint8_t *b, float *w) {
    const float d = half_at(b + 208);
    for (int sb = 0; sb < 8; sb++) {
        const int n = sb / 4, i = sb % 4, shift = i >= 2 ? 4 : 0;
        const uint8_t *ql = b + 64 * n + (i & 1 ? 32 : 0), *qh = b + 128 + 32 * n;
        for (int half = 0; half < 2; half++) {
            const int sub = (int8_t)b[192 + 2 * sb + half];
            for (int l = 16 * half; l < 16 * half + 16; l++) {
                const int code = ((ql[l] >> shift) & 15) | (((qh[l] >> (2 * i)) & 3) << 4);
                w[GROUP * sb + l] = (float)((code - 32) * sub) * d;
            }
        }
    }
}

/* Q2_K's 256 weights of block b: d * scale * code - dmin * min, as ggml and gguf-py give them. */
TARGET static void q2_k_block_weights(const uint8_t *b, float *w) {
    const float d = half_at(b + 80), dmin = half_at(b + 82);
    for (int i = 0; i < 256; i++) {
        const int sb = i / 32, l = i % 32, sc = b[2 * sb + l / 16];
        const int code = (b[16 + 32 * (sb / 4) + l] >> (2 * (sb % 4))) & 3;
        w[i] = d * (float)(sc & 15) * (float)code - dmin * (float)(sc >> 4);
    }
}

/* out[i] = row ids[i] dequantized, in fp32 or bf16 (rounded to nearest even). Returns 0, or -2. */
TARGET int saguaro_dequantize_rows(int type, const uint8_t *data, int64_t row_bytes, int64_t cols, const int64_t *ids,
                                   int64_t count, void *out, int out_bf16, int threads) {
    const int bits = saguaro_type_bits(type);
    const int64_t per_block = block_weights(type);
    if (!bits || cols % per_block) return -2;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t i = 0; i < count; i++) {
        const uint8_t *row = data + ids[i] * row_bytes;
        float w[256];
        for (int64_t start = 0; start < cols; start += per_block) {
            if (type == Q6_K) {
                q6_k_block_weights(row + start / per_block * block_bytes(type), w);
            } else if (type == Q2_K) {
                q2_k_block_weights(row + start / per_block * block_bytes(type), w);
            } else {
                for (int64_t g = 0; g < per_block / GROUP; g++) {
                    Group group;
                    float *v = w + GROUP * g;
                    decode_group(type, row, start / GROUP + g, &group);
                    for (int j = 0; j < GROUP; j++)
                        v[j] = type == Q3_K ? (float)(group.code[j] - 32) * (float)group.sub[j / 16] * group.d
                             : bits == NL4  ? (float)IQ4_VALUES[group.code[j]] * group.scale
                                            : (float)group.code[j] * group.scale + group.low;
                }
            }
            if (!out_bf16) {
                memcpy((float *)out + i * cols + start, w, per_block * sizeof(float));
                continue;
            }
            uint16_t *to = (uint16_t *)out + i * cols + start;
            for (int j = 0; j < per_block; j++) {
                uint32_t u;
                memcpy(&u, &w[j], 4);
                to[j] = (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16);
            }
        }
    }
    return 0;
}
