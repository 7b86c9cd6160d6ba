/* Products of bf16 activations with weights held as 4- or 8-bit codes in groups of 32 inputs,
 * computed as llama.cpp computes them: activations rounded to 8 bits per group, integer dot
 * products (AVX512-VNNI), one fp32 scale per group.
 *
 * Weights: w[o, i] = code[o, i] * scale[o, g] + low[o, g] for input i of group g, scale and low
 * in fp16 (as GGUF stores them). Activations: x[i] ~ d * q[i] with d = max|x| / 127 over the
 * group and q = round(x / d) in -127..127. Each group then adds
 *     scale * d * sum(code * q) + low * d * sum(q)
 * to an fp32 sum, the integer sums being exact. Sixteen outputs are computed together, one per
 * lane. Each row of activations is computed alone, by the same instructions in the same order,
 * however many rows share the call and however many threads split the outputs: the products
 * are batch-invariant.
 *
 * A tile is 16 outputs x 32 inputs, stored as one record (packing: saguaro/models/native/__init__.py):
 *  - 4-bit, 320 bytes: 4 chunks of 64 code bytes, where byte 4j + t of chunk u holds output j's
 *    codes for inputs 4u + t (low nibble) and 16 + 4u + t (high nibble); 16 fp16 scales; 16 fp16 lows.
 *  - 5-bit (Q5_0, Q5_1, Q5_K), 384 bytes: the 4-bit record's chunks hold the codes' (0..31) low
 *    four bits; then 64 bytes of their top bits, byte 4j + t holding at bit 2u + s that of chunk
 *    u's half s; then 16 fp16 scales and 16 fp16 lows, as in the 4-bit record.
 *  - 6-bit (Q6_K), 448 bytes: the codes (code + 32, so 0..63) in two triples of 64-byte chunks,
 *    triple h for inputs 8h .. 8h + 7 of each half: byte 4j + t of its chunks X, Y, Z holds in
 *    bits 0-5 output j's code for input 8h + t, 8h + 4 + t and 16 + 8h + t, and in bits 6-7 two
 *    bits of its code for input 16 + 8h + 4 + t (X its bits 0-1, Y 2-3, Z 4-5): three chunks of
 *    codes cost one AND each and the fourth six instructions, where low nibbles and a plane of
 *    top bits took about five a chunk (tile_rows.py, one core of a Xeon with AMX: Q6_K records
 *    from memory 1.08x at one row, in cache 1.22x at four rows; 6-bit tiles 1.28x, one row from
 *    memory); then 32 int8 scales, one per output and half group (16 inputs): outputs 0-15 for
 *    inputs 0-15, then for 16-31;
 *    then 16 fp16 super-scales d. w = (code - 32) * scale * d. The two halves keep separate
 *    integer sums, combined in integers: d * x.d * sum_s scale_s * (dot_s - 32 qsum_s).
 *  - K-quant records (Q4_K: kind K4; Q6_K: kind K6) hold a 256-input block of 16 outputs: what
 *    the file stores once per block, then its 8 groups' codes as the 4- and 6-bit records hold
 *    them (parameters first, so that a record is read front to back). K4, 2368 bytes: 16 fp16 d,
 *    16 fp16 dmin, 8 x 16 six-bit sub-scales (a byte each, group by group, outputs 0-15), 8 x 16
 *    sub-mins, 8 x 256 code bytes (from K4_CODES), for w = code * (d * scale) - dmin * min, both
 *    products exact in fp32; K5 (Q5_K), 2880 bytes: K4's parameters, then 8 x 320 code bytes (from
 *    K5_CODES) as the 5-bit record holds them (their low four bits, then the top bits): 5.625 bits
 *    a weight (the file's 5.5, the 5-bit record's 6); K6, 3360 bytes: 16 fp16 d, 8 x 32 int8 sub-scales (as the 6-bit
 *    record's), 8 x 384 code bytes (from K6_CODES) as the 6-bit record holds them. The files' own densities (4.625 and 6.56
 *    bits a weight) where per-group records took 5 and 7.
 *  - K3 records (Q3_K), 1824 bytes: 16 fp16 d, 8 x 32 int8 sub-scales (as K6's), then 8 groups of
 *    192 code bytes (from K3_CODES), each code c = 0..7 standing for c - 4 (the file's two low
 *    bits and its top bit): two chunks of 64 bytes of the low two bits, byte 4j + t of chunk s
 *    holding at bits 2u, 2u + 1 those of output j's input 16s + 4u + t; then 64 bytes whose byte
 *    4j + t holds at bit 4s + u the top bit of that code. w = (c - 4) * sub * d, summed per half
 *    group as K6's: 3.56 bits a weight (the file's 3.44).
 *  - K2 records (Q2_K), 1344 bytes: 16 fp16 d, 16 fp16 dmin, 8 x 32 bytes of each half group's
 *    four-bit scale (low nibble) and min (high nibble), laid out as K6's sub-scales, then 8 groups
 *    of 128 code bytes (from K2_CODES) holding codes 0..3 as K3's two-bit planes. w = d * scale *
 *    c - dmin * min: the file's 2.625 bits a weight.
 *  - 8-bit, 544 bytes: 8 chunks of 64 bytes, byte 4j + t of chunk k holding output j's code for
 *    input 4k + t plus 128 (so unsigned); 16 fp16 scales (the low is zero).
 *  - symmetric 4-bit (Q4_0; kind SYM4), 288 bytes: the 4-bit record without its lows, a code c
 *    standing for (c - 8) * scale; the integer sum takes 8 * sum(q) off, as llama.cpp's Q4_0 dot
 *    subtracts 8 from each code, so the record holds the file's 4.5 bits a weight.
 *  - IQ4 (IQ4_NL, IQ4_XS; kind NL4), 288 bytes: the 4-bit record's chunks and 16 fp16 scales;
 *    a code c stands for the weight kIQ4[c] * scale (kIQ4: ggml's 16 non-linear int8 values),
 *    looked up per byte (vpshufb) and offset by 128 for the unsigned side of vpdpbusd.
 *  - 16-bit (bf16 weights: F16, BF16 and F32 files, safetensors), 1024 bytes: 16 chunks of 64
 *    bytes, bf16 pair j of chunk k holding output j's weights for inputs 2k and 2k + 1. The
 *    activations stay bf16 (no rounding to 8 bits): AVX512-BF16 pair dots into fp32 sums.
 * The tiles of a product follow one another chunk by chunk of 64 groups of inputs, column by
 * column within a chunk (saguaro_tile_offset; a product over at most 64 groups: column by column).
 * A projection may stack parts of different widths (a Q4_K_M file's v is Q6_K, its q and k
 * Q4_K): bits = 0 says the tiles begin with a 64-byte header, int64 parts and then (bits,
 * outputs) per part (at most MAX_PARTS), the parts' tiles following one after the other.
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define TILE_OUT 16
#define GROUP 32
#define MAX_ROWS 8       /* rows sharing one pass over the codes (a verification of K + 1 <= 8 tokens: one) */
#define PREFETCH_TILES 8 /* how far ahead one row's codes are fetched into L1 where that pays (AMD, K6) */
#define PREFETCH_BYTES 4096 /* and otherwise into L2: see streams_alone and tile_column */
#define NL4 104 /* the IQ4 tile kind (not a width: its codes are 4 bits) */
#define SYM4 100 /* the Q4_0 tile kind: 4-bit codes offset by 8, no lows */
#define K4 124 /* the Q4_K record kind */
#define K5 125 /* the Q5_K record kind */
#define K6 126 /* the Q6_K record kind */
#define K3 123 /* the Q3_K record kind */
#define K2 122 /* the Q2_K record kind */
#define BLOCK_GROUPS 8 /* groups in a K2 / K3 / K4 / K5 / K6 record: a K-quant's 256-input block */
#define K4_CODES 320 /* where a K4 record's codes begin, after its block parameters */
#define K5_CODES 320 /* and a K5 record's */
#define K6_CODES 288 /* and a K6 record's */
#define K3_CODES 288 /* and a K3 record's */
#define K2_CODES 320 /* and a K2 record's */
#define HEADER_BYTES 64
#define BF16_CHAINS 2 /* fp32 sums per row in a bf16 product (their order fixed: batch-invariant) */
#define MAX_PARTS 3
#define CHUNK_GROUPS 64 /* see saguaro_chunk_groups */
#define SELECT 0xE4 /* vpternlog's a, b, c -> c ? a : b, bit by bit */

#ifdef SAGUARO_AVX2
#define TARGET __attribute__((target("avx2,fma,f16c")))

int saguaro_cpu_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}
#else
#define TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma")))

int saguaro_cpu_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
}
#endif

/* Bytes a kind takes per group of 32 inputs and 16 outputs (K2 to K6: their record's over 8). */
int64_t saguaro_tile_bytes(int bits) {
    return bits == 4 ? 320 : bits == 5 ? 384 : bits == 6 ? 448 : bits == 8 ? 544 : bits == NL4 || bits == SYM4 ? 288
         : bits == K4 ? 296 : bits == K5 ? 360 : bits == K6 ? 420 : bits == K3 ? 228 : bits == K2 ? 168 : 1024;
}

/* Groups of inputs per chunk: a product over more inputs runs chunk by chunk, each thread
 * taking its columns over one chunk before the next, and its tiles are laid out so (below).
 * A row's quantized activations for a chunk (64 x 60 bytes) then stay in L1 while the column's
 * tiles stream past; over a whole 3072- or 8192-input column they did not, and one row of K4
 * records streamed 1.3x slower for it (tile_rows.py, 2 MB pages). bf16 tiles read the
 * activations as they are: not chunked. */
int64_t saguaro_chunk_groups(int bits, int64_t groups) {
    return bits == 16 || groups <= CHUNK_GROUPS ? groups : CHUNK_GROUPS;
}

/* Where the tile of (column, group g) of a columns x groups product begins: the tiles of chunk
 * 0 (every column's first CHUNK_GROUPS groups, column by column), then chunk 1's, and so on. A
 * K-quant's record (8 groups from a multiple of 8) stays whole, chunks being multiples of 8. */
int64_t saguaro_tile_offset(int bits, int64_t columns, int64_t groups, int64_t column, int64_t g) {
    const int64_t chunk = saguaro_chunk_groups(bits, groups), start = g / chunk * chunk;
    const int64_t count = groups - start < chunk ? groups - start : chunk;
    return (start * columns + column * count + g - start) * saguaro_tile_bytes(bits);
}

/* The codes' layout a kind's groups share: K4's is the 4-bit record's, K5's the 5-bit one's, K6's
 * the 6-bit one's. */
static inline int code_width(int bits) {
    return bits == K4 ? 4 : bits == K5 ? 5 : bits == K6 ? 6 : bits == K3 ? 3 : bits == K2 ? 2 : bits;
}

/* Where group g's codes begin in a K-quant's records (kinds with records of BLOCK_GROUPS). */
static inline const uint8_t *record_codes(int bits, const uint8_t *record, int64_t g) {
    return bits == K4 ? record + K4_CODES + (g % BLOCK_GROUPS) * 256
         : bits == K5 ? record + K5_CODES + (g % BLOCK_GROUPS) * 320
         : bits == K6 ? record + K6_CODES + (g % BLOCK_GROUPS) * 384
         : bits == K3 ? record + K3_CODES + (g % BLOCK_GROUPS) * 192 : record + K2_CODES + (g % BLOCK_GROUPS) * 128;
}

/* The K-quant kinds, whose records hold a block of BLOCK_GROUPS groups. */
static inline int is_record(int bits) { return bits == K2 || bits == K3 || bits == K4 || bits == K5 || bits == K6; }

/* Records with a block dmin and per-group mins (w = d * sub * code - dmin * min). */
static inline int has_mins(int bits) { return bits == K2 || bits == K4 || bits == K5; }

/* Codes offset so as to be unsigned (6-bit: by 32; K3: by 4; K2's are), taken off each half group's sum. */
static inline int code_offset(int width) { return width == 6 ? 32 : width == 3 ? 4 : 0; }

/* One row's group of activations, rounded to 8 bits. */
typedef struct {
    int8_t q[GROUP];
    float d;      /* the scale: x ~ d * q */
    float d_qsum; /* d * sum(q), what the group's low multiplies */
    int32_t qsum;
    int32_t half_qsum[2]; /* sum(q) over inputs 0-15 and 16-31 */
    float d_half_qsum[2]; /* d * each half's sum(q), what K2's per-half mins multiply */
} QuantizedGroup;

#ifdef SAGUARO_AVX2
#include "group_matmul_avx2.h"
#else
int saguaro_bf16_supported(void) {
    __builtin_cpu_init();
    return saguaro_cpu_supported() && __builtin_cpu_supports("avx512bf16");
}

/* Whether this CPU streams one row of tiles faster without software prefetches (tile_column).
 * AMD's cores prefetch a lone stream well on their own, and a software prefetch only competes
 * with theirs; cores that do not (a Xeon with AMX) gain from fetching every kind PREFETCH_BYTES
 * ahead into L2, most for the K records, whose bytes a row reads unevenly. Into L2 rather than
 * L1 there: a longer lead hides more of the memory's latency, and L2 holds it.
 * benchmarks/tile_rows.py measures both ways on a machine. */
static int streams_alone;

/* Whether R rows against tiles of tile_bytes a group (each multiply-add costing `cost` int8 ones:
 * bf16's 2) are bound by the core rather than by memory: 4.5 multiply-adds or more a byte. */
static inline __attribute__((always_inline)) int core_bound(int R, int64_t tile_bytes, int cost) {
    return 2 * R * GROUP * TILE_OUT * cost >= 9 * tile_bytes;
}

__attribute__((constructor)) static void choose_prefetching(void) {
    __builtin_cpu_init();
    streams_alone = __builtin_cpu_is("amd");
}

/* R rows of bf16 activations against one column of 16-bit tiles: fp32 sums, pair by pair in
 * input order (the same for any number of rows). Its own target: only CPUs with AVX512-BF16
 * reach it (saguaro_bf16_supported). */
__attribute__((target("avx512f,avx512bf16"))) static inline __attribute__((always_inline)) void bf16_rows(
        int R, const uint8_t *tiles, const uint16_t *x, int64_t in_features, float *sums_out) {
    /* BF16_CHAINS sums per row, chunk k feeding sum k % BF16_CHAINS, however many rows: one chain
     * waited on each pair dot's latency (one row in cache 38 GB/s, against 72 for 8-bit codes) */
    __m512 acc[MAX_ROWS][BF16_CHAINS];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < BF16_CHAINS; c++) acc[r][c] = _mm512_setzero_ps();
    for (int64_t g = 0; g < in_features / GROUP; g++) {
        const uint8_t *tile = tiles + g * 1024;
        if (R > 1 && !core_bound(R, 1024, 2)) /* several rows bound by memory: into L1 (tile_column) */
            for (int line = 0; line < 1024; line += 64)
                _mm_prefetch((const char *)tile + 4 * 1024 + line, _MM_HINT_T0);
        else if (R > 1 || !streams_alone) /* 4 KB ahead into L2; one row on AMD: the hardware's */
            for (int line = 0; line < 1024; line += 64)
                _mm_prefetch((const char *)tile + 4 * 1024 + line, _MM_HINT_T1);
        for (int k = 0; k < 16; k += BF16_CHAINS)
            for (int c = 0; c < BF16_CHAINS; c++) {
                const __m512bh w = (__m512bh)_mm512_loadu_si512((const void *)(tile + 64 * (k + c)));
                for (int r = 0; r < R; r++) {
                    int32_t pair;
                    memcpy(&pair, x + r * in_features + g * GROUP + 2 * (k + c), 4);
                    acc[r][c] = _mm512_dpbf16_ps(acc[r][c], w, (__m512bh)_mm512_set1_epi32(pair));
                }
            }
    }
    for (int r = 0; r < R; r++)
        _mm512_storeu_ps(sums_out + r * TILE_OUT, _mm512_add_ps(acc[r][0], acc[r][1]));
}

/* bf16_rows with R a constant in each case, so that the sums stay in registers (a runtime R
 * kept them on the stack: six rows 1.17x faster from memory, 1.8x in cache; the same sums). */
__attribute__((target("avx512f,avx512bf16"))) static void tile_column_bf16(
        int R, const uint8_t *tiles, const uint16_t *x, int64_t in_features, float *sums_out) {
    switch (R) {
        case 8: bf16_rows(8, tiles, x, in_features, sums_out); break;
        case 7: bf16_rows(7, tiles, x, in_features, sums_out); break;
        case 6: bf16_rows(6, tiles, x, in_features, sums_out); break;
        case 5: bf16_rows(5, tiles, x, in_features, sums_out); break;
        case 4: bf16_rows(4, tiles, x, in_features, sums_out); break;
        case 3: bf16_rows(3, tiles, x, in_features, sums_out); break;
        case 2: bf16_rows(2, tiles, x, in_features, sums_out); break;
        default: bf16_rows(1, tiles, x, in_features, sums_out); break;
    }
}

TARGET static inline __m512 bf16_to_ps(__m256i v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

TARGET static void quantize_row(const uint16_t *x, int64_t groups, QuantizedGroup *out) {
    for (int64_t g = 0; g < groups; g++) {
        __m512 a = bf16_to_ps(_mm256_loadu_si256((const __m256i *)(x + g * GROUP)));
        __m512 b = bf16_to_ps(_mm256_loadu_si256((const __m256i *)(x + g * GROUP + 16)));
        float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
        float d = amax / 127.0f, inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
        __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, _mm512_set1_ps(inverse)));  /* round to nearest even */
        __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, _mm512_set1_ps(inverse)));
        _mm_storeu_si128((__m128i *)out[g].q, _mm512_cvtsepi32_epi8(qa));
        _mm_storeu_si128((__m128i *)(out[g].q + 16), _mm512_cvtsepi32_epi8(qb));
        out[g].half_qsum[0] = _mm512_reduce_add_epi32(qa);
        out[g].half_qsum[1] = _mm512_reduce_add_epi32(qb);
        out[g].qsum = out[g].half_qsum[0] + out[g].half_qsum[1];
        out[g].d = d;
        out[g].d_qsum = d * (float)out[g].qsum;
        out[g].d_half_qsum[0] = d * (float)out[g].half_qsum[0];
        out[g].d_half_qsum[1] = d * (float)out[g].half_qsum[1];
    }
}

TARGET static inline __m512 halves(const uint8_t *p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}

TARGET static inline __m512i quad_of(const int8_t *q) {
    int32_t v;
    memcpy(&v, q, 4);
    return _mm512_set1_epi32(v);
}

/* R rows of quantized activations (`stride` groups apart) against `groups` groups of one column
 * of tiles (16 outputs): fp32 sums, added to those in sums_out where `resume` (the same sums in
 * the same order as one call over all the groups). */
TARGET static inline __attribute__((always_inline)) void tile_column(
        int bits, int R, const uint8_t *tiles, const QuantizedGroup *xq, int64_t stride, int64_t groups,
        float *sums_out, int resume) {
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    const int64_t tile_bytes = saguaro_tile_bytes(bits);
    const int width = code_width(bits), blocked = is_record(bits);
    /* Products bound by the core rather than by memory (core_bound) take the tiles PREFETCH_BYTES
     * ahead into L2 on every CPU: the core sets their pace, and L2 holds the lead. Those bound by
     * memory take them PREFETCH_TILES ahead into L1 where the CPU streams well alone
     * (streams_alone), so that each load finds its tile at hand; there, one row of the kinds a
     * row reads evenly (the 4- and 8-bit kinds, the K records but K6) runs without software
     * prefetches, which would only compete with the hardware's. Elsewhere every product
     * fetches into L2 (see streams_alone). benchmarks/peak.py and tile_rows.py measure these. */
    const int into_l1 = streams_alone && !core_bound(R, tile_bytes, 1);
    const int64_t ahead = into_l1 ? PREFETCH_TILES * tile_bytes : PREFETCH_BYTES;
    const int prefetched = R > 1 || !streams_alone || !(bits == 4 || bits == SYM4 || bits == NL4 || bits == 8
                                                        || bits == K4 || bits == K5 || bits == K3 || bits == K2);
    __m512 acc[MAX_ROWS], block_d = _mm512_setzero_ps(), block_neg_dmin = _mm512_setzero_ps(); /* K-quants */
    for (int r = 0; r < R; r++) acc[r] = resume ? _mm512_loadu_ps(sums_out + r * TILE_OUT) : _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *record = tiles + (g / BLOCK_GROUPS) * BLOCK_GROUPS * tile_bytes; /* K-quants */
        const uint8_t *tile = blocked ? record_codes(bits, record, g) : tiles + g * tile_bytes;
        if (blocked && g % BLOCK_GROUPS == 0) { /* the block's d (and -dmin), converted once */
            block_d = halves(record);
            if (has_mins(bits)) block_neg_dmin = _mm512_sub_ps(_mm512_setzero_ps(), halves(record + 32));
        }
        if (prefetched)
            for (int64_t line = 0; line < tile_bytes; line += 64) {
                const char *next = (const char *)tiles + g * tile_bytes + ahead + line;
                if (into_l1) _mm_prefetch(next, _MM_HINT_T0);
                else _mm_prefetch(next, _MM_HINT_T1);
            }
        /* Integer sums, exact in any order: two chains per row where few rows leave the
         * multiplier idle, one where eight rows would run out of registers. */
        const int halves_apart = width == 6 || width == 3 || width == 2; /* one chain per half, scaled apart */
        const int second_chain = halves_apart || R <= 4;
        __m512i dots[MAX_ROWS][2];
        for (int r = 0; r < R; r++) dots[r][0] = dots[r][1] = _mm512_setzero_si512();
        if (width != 8) {
            for (int u = 0; u < 4; u++) {
                __m512i first, second;
                if (width == 6) { /* triple u / 2: codes for inputs 4u + t and 16 + 4u + t */
                    const uint8_t *triple = tile + 192 * (u >> 1);
                    const __m512i six = _mm512_set1_epi8(0x3F);
                    const __m512i x = _mm512_loadu_si512((const void *)triple);
                    const __m512i y = _mm512_loadu_si512((const void *)(triple + 64));
                    const __m512i z = _mm512_loadu_si512((const void *)(triple + 128));
                    first = _mm512_and_si512(u & 1 ? y : x, six);
                    if (u & 1) { /* the fourth code: bits 6-7 of x, y and z, moved to 0-1, 2-3 and 4-5 */
                        const __m512i low = _mm512_ternarylogic_epi32(_mm512_srli_epi16(x, 6), _mm512_srli_epi16(y, 4),
                                                                      _mm512_set1_epi8(0x03), SELECT);
                        second = _mm512_and_si512(_mm512_ternarylogic_epi32(low, _mm512_srli_epi16(z, 2),
                                                                            _mm512_set1_epi8(0x0F), SELECT), six);
                    } else {
                        second = _mm512_and_si512(z, six);
                    }
                } else if (width <= 3) { /* K2, K3: two-bit planes, and K3's third bit */
                    const __m512i two = _mm512_set1_epi8(0x03);
                    first = _mm512_and_si512(_mm512_srli_epi16(_mm512_loadu_si512((const void *)tile), 2 * u), two);
                    second = _mm512_and_si512(_mm512_srli_epi16(_mm512_loadu_si512((const void *)(tile + 64)), 2 * u), two);
                    if (width == 3) {
                        const __m512i third = _mm512_set1_epi8(0x04);
                        const __m512i tops = _mm512_loadu_si512((const void *)(tile + 128));
                        first = _mm512_or_si512(first, _mm512_and_si512(
                            u < 2 ? _mm512_slli_epi16(tops, 2 - u) : _mm512_srli_epi16(tops, u - 2), third));
                        second = _mm512_or_si512(second, _mm512_and_si512(_mm512_srli_epi16(tops, u + 2), third));
                    }
                } else {
                    __m512i w = _mm512_loadu_si512((const void *)(tile + 64 * u));
                    first = _mm512_and_si512(w, nibble);
                    second = _mm512_and_si512(_mm512_srli_epi16(w, 4), nibble);
                }
                if (bits == NL4) { /* codes -> kIQ4 + 128, unsigned */
                    const __m512i table = _mm512_broadcast_i32x4(_mm_setr_epi8(
                        1, 24, 45, 63, 79, 93, 106, 118, (char)129, (char)141, (char)153, (char)166, (char)181,
                        (char)197, (char)217, (char)241));
                    first = _mm512_shuffle_epi8(table, first);
                    second = _mm512_shuffle_epi8(table, second);
                }
                if (width == 5) {
                    const __m512i one = _mm512_set1_epi8(0x01);
                    __m512i top = _mm512_srli_epi16(_mm512_loadu_si512((const void *)(tile + 256)), 2 * u);
                    first = _mm512_or_si512(first, _mm512_slli_epi16(_mm512_and_si512(top, one), 4));
                    second = _mm512_or_si512(second, _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(top, 1), one), 4));
                }
                for (int r = 0; r < R; r++) {
                    const int8_t *q = xq[r * stride + g].q;
                    dots[r][0] = _mm512_dpbusd_epi32(dots[r][0], first, quad_of(q + 4 * u));
                    dots[r][second_chain] = _mm512_dpbusd_epi32(dots[r][second_chain], second, quad_of(q + 16 + 4 * u));
                }
            }
        } else {
            for (int k = 0; k < 8; k++) {
                __m512i w = _mm512_loadu_si512((const void *)(tile + 64 * k));
                for (int r = 0; r < R; r++)
                    dots[r][k & second_chain] = _mm512_dpbusd_epi32(dots[r][k & second_chain], w,
                                                                    quad_of(xq[r * stride + g].q + 4 * k));
            }
        }
        if (halves_apart) {
            const uint8_t *subs = blocked ? record + (bits == K2 ? 64 : 32) + 32 * (g % BLOCK_GROUPS) : tile + 384;
            __m512i scale0 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)subs));
            __m512i scale1 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(subs + 16)));
            __m512 low0 = _mm512_setzero_ps(), low1 = _mm512_setzero_ps();
            if (bits == K2) { /* four-bit scales and mins: -dmin * min, exact in fp32 */
                const __m512i nibble32 = _mm512_set1_epi32(0x0F);
                low0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(scale0, 4), nibble32)), block_neg_dmin);
                low1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(scale1, 4), nibble32)), block_neg_dmin);
                scale0 = _mm512_and_si512(scale0, nibble32);
                scale1 = _mm512_and_si512(scale1, nibble32);
            }
            const __m512 d = blocked ? block_d : halves(tile + 416);
            const int offset = code_offset(width);
            for (int r = 0; r < R; r++) {
                const QuantizedGroup *x = xq + r * stride + g;
                __m512i first = _mm512_sub_epi32(dots[r][0], _mm512_set1_epi32(offset * x->half_qsum[0]));
                __m512i second = _mm512_sub_epi32(dots[r][1], _mm512_set1_epi32(offset * x->half_qsum[1]));
                __m512i dot = _mm512_add_epi32(_mm512_mullo_epi32(first, scale0), _mm512_mullo_epi32(second, scale1));
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(d, _mm512_set1_ps(x->d)), acc[r]);
                if (bits == K2) {
                    acc[r] = _mm512_fmadd_ps(low0, _mm512_set1_ps(x->d_half_qsum[0]), acc[r]);
                    acc[r] = _mm512_fmadd_ps(low1, _mm512_set1_ps(x->d_half_qsum[1]), acc[r]);
                }
            }
            continue;
        }
        const uint8_t *params = tile + (bits == 4 || bits == NL4 || bits == SYM4 ? 256 : bits == 5 ? 320 : 512);
        __m512 scale, low = _mm512_setzero_ps();
        if (bits == K4 || bits == K5) { /* d * sub-scale and -dmin * sub-min: 6-bit integers times fp16, exact in fp32 */
            const uint8_t *at = record + 64 + 16 * (g % BLOCK_GROUPS);
            const __m512 sub = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)at)));
            const __m512 min = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(at + 128))));
            scale = _mm512_mul_ps(sub, block_d);
            low = _mm512_mul_ps(min, block_neg_dmin);
        } else {
            scale = halves(params);
            if (bits == 4 || bits == 5) low = halves(params + 32);
        }
        for (int r = 0; r < R; r++) {
            const QuantizedGroup *x = xq + r * stride + g;
            __m512i dot = second_chain ? _mm512_add_epi32(dots[r][0], dots[r][1]) : dots[r][0];
            if (bits == 8 || bits == NL4) dot = _mm512_sub_epi32(dot, _mm512_set1_epi32(128 * x->qsum));  /* the codes' +128 */
            if (bits == SYM4) dot = _mm512_sub_epi32(dot, _mm512_set1_epi32(8 * x->qsum));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(scale, _mm512_set1_ps(x->d)), acc[r]);
            if (bits == 4 || bits == 5 || bits == K4 || bits == K5) acc[r] = _mm512_fmadd_ps(low, _mm512_set1_ps(x->d_qsum), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) _mm512_storeu_ps(sums_out + r * TILE_OUT, acc[r]);
}

/* fp32 -> bf16, rounded to nearest even (no NaNs arise here). */
TARGET static inline __m256i ps_to_bf16(__m512 v) {
    __m512i bits = _mm512_castps_si512(v);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7fff)), odd);
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
}

/* A tile column's 16 sums for one row, into out (bf16 or fp32) at element `at`. */
TARGET static inline void store_sums(const float *sums, void *out, int64_t at, int out_fp32) {
    const __m512 v = _mm512_loadu_ps(sums);
    if (out_fp32) _mm512_storeu_ps((float *)out + at, v);
    else _mm256_storeu_si256((__m256i *)((uint16_t *)out + at), ps_to_bf16(v));
}
#endif

/* Which of a tile column's 16 outputs a row's grammar allows: bits 16c .. 16c + 15 of its mask
 * (int32 words, bit b of word w for output 32w + b; outputs past 32 * words: none). */
static inline uint32_t legal_outputs(const int32_t *legal, int64_t words, int64_t row, int64_t column) {
    if (column / 2 >= words) return 0;
    return ((uint32_t)legal[row * words + column / 2] >> (16 * (column % 2))) & 0xFFFF;
}

/* A tile column's 16 fp32 sums for one row, -inf at the outputs its grammar forbids. */
static inline void store_legal_sums(const float *sums, float *out, uint32_t legal) {
    for (int j = 0; j < TILE_OUT; j++) out[j] = legal >> j & 1 ? sums[j] : -INFINITY;
}

/* out[rows, out_features] = x[rows, in_features] @ w.T, out in bf16 or fp32. With legal (a
 * grammar's masks, [rows, words] int32, fp32 out only), each output a row's mask forbids is
 * -inf instead, and a tile column no row of a block allows is not computed: a head under a
 * grammar writes its masked logits once, while they are in the cache, and skips the tokens no
 * row may take. Every other output is the product's, bit for bit. Returns 0, -1 where memory
 * ran out, -2 for a header that does not describe out_features. */
TARGET int saguaro_group_matmul(int bits, const uint8_t *tiles, const uint16_t *x, void *out, int64_t rows,
                                int64_t in_features, int64_t out_features, int out_fp32, int threads,
                                const int32_t *legal, int64_t words) {
    const int64_t groups = in_features / GROUP, columns = out_features / TILE_OUT;
    int64_t parts = 1, part_bits[MAX_PARTS] = {bits}, part_end[MAX_PARTS] = {columns};
    const uint8_t *part_tiles[MAX_PARTS] = {tiles};
    if (bits == 0) { /* stacked parts: see the header's description above */
        const int64_t *header = (const int64_t *)tiles;
        parts = header[0];
        if (parts < 1 || parts > MAX_PARTS) return -2;
        const uint8_t *at = tiles + HEADER_BYTES;
        for (int64_t p = 0; p < parts; p++) {
            part_bits[p] = header[1 + 2 * p];
            part_end[p] = (p ? part_end[p - 1] : 0) + header[2 + 2 * p] / TILE_OUT;
            part_tiles[p] = at;
            at += (part_end[p] - (p ? part_end[p - 1] : 0)) * groups * saguaro_tile_bytes((int)part_bits[p]);
        }
        if (part_end[parts - 1] != columns) return -2;
    }
    QuantizedGroup *xq = malloc(sizeof(QuantizedGroup) * (size_t)(rows * groups + 1));
    if (!xq) return -1;
    /* each row rounded alone: shared out where a prefill's rows would leave the other threads
     * idle, and on this thread with no parallel region where they are few (decoder_layer.c's
     * PARALLEL_TOKENS) */
    if (rows >= 16) {
#pragma omp parallel for schedule(static) num_threads(threads)
        for (int64_t r = 0; r < rows; r++) quantize_row(x + r * in_features, groups, xq + r * groups);
    } else {
        for (int64_t r = 0; r < rows; r++) quantize_row(x + r * in_features, groups, xq + r * groups);
    }
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        /* This thread's columns. One block of rows (a decode step, a verification) sweeps them
         * chunk by chunk of inputs, as the tiles lie; more rows take each column's chunks in
         * turn for every block of rows, so that a column's tiles, in cache, serve all the rows.
         * Each output's sums are added in the same order either way, however the columns are
         * shared out: batch-invariant. */
        const int64_t n = omp_get_num_threads(), t = omp_get_thread_num();
        const int64_t first = columns * t / n, last = columns * (t + 1) / n;
        const int64_t chunks = (groups + CHUNK_GROUPS - 1) / CHUNK_GROUPS, blocks = (rows + MAX_ROWS - 1) / MAX_ROWS;
        const int chunks_first = blocks == 1;
        /* the sums carried from chunk to chunk: each column's where the chunks come first, else one's */
        const int64_t kept = chunks_first ? last - first : 1, most = rows < MAX_ROWS ? rows : MAX_ROWS;
        float *partial = malloc(sizeof(float) * (size_t)(kept * most * TILE_OUT + 1));
        if (!partial) {
#pragma omp atomic write
            failed = 1;
        }
        const int64_t steps = partial ? (last - first) * blocks * chunks : 0;
        for (int64_t step = 0; step < steps; step++) {
            const int64_t column = first + (chunks_first ? step % (last - first) : step / (blocks * chunks));
            const int64_t g0 = (chunks_first ? step / (last - first) : step % chunks) * CHUNK_GROUPS;
            const int64_t r0 = chunks_first ? 0 : step / chunks % blocks * MAX_ROWS;
            int64_t p = 0;
            while (column >= part_end[p]) p++;
            const int b = (int)part_bits[p];
            const int64_t first_column = p ? part_end[p - 1] : 0, chunk = saguaro_chunk_groups(b, groups);
            if (g0 % chunk) continue; /* a kind not chunked: all its groups at g0 = 0 */
            const int64_t count = groups - g0 < chunk ? groups - g0 : chunk;
            const uint8_t *tiles_of_column = part_tiles[p] + saguaro_tile_offset(
                b, part_end[p] - first_column, groups, column - first_column, g0);
            const int R = rows - r0 < MAX_ROWS ? (int)(rows - r0) : MAX_ROWS;
            uint32_t allowed[MAX_ROWS], any = !legal;
            for (int r = 0; legal && r < R; r++) any |= allowed[r] = legal_outputs(legal, words, r0 + r, column);
            if (!any) {
                if (g0 + count == groups)
                    for (int r = 0; r < R; r++)
                        for (int j = 0; j < TILE_OUT; j++) ((float *)out)[(r0 + r) * out_features + column * TILE_OUT + j] = -INFINITY;
                continue;
            }
            const QuantizedGroup *xr = xq + r0 * groups + g0;
            float *result = partial + (chunks_first ? column - first : 0) * most * TILE_OUT;
            /* constant widths and row counts, so each case keeps its sums in registers */
#define CASE(B, N) tile_column(B, N, tiles_of_column, xr, groups, count, result, g0 > 0)
#define ROWS_OF(B) \
            switch (R) { \
                case 8: CASE(B, 8); break; case 7: CASE(B, 7); break; case 6: CASE(B, 6); break; \
                case 5: CASE(B, 5); break; case 4: CASE(B, 4); break; case 3: CASE(B, 3); break; \
                case 2: CASE(B, 2); break; default: CASE(B, 1); break; \
            }
            if (b == 16) tile_column_bf16(R, tiles_of_column, x + r0 * in_features, in_features, result);
            else if (b == NL4) { ROWS_OF(NL4) } else if (b == SYM4) { ROWS_OF(SYM4) }
            else if (b == K4) { ROWS_OF(K4) } else if (b == K6) { ROWS_OF(K6) } else if (b == K3) { ROWS_OF(K3) }
            else if (b == K2) { ROWS_OF(K2) } else if (b == K5) { ROWS_OF(K5) }
            else if (b == 4) { ROWS_OF(4) } else if (b == 5) { ROWS_OF(5) } else if (b == 6) { ROWS_OF(6) } else { ROWS_OF(8) }
#undef ROWS_OF
#undef CASE
            if (g0 + count == groups)
                for (int r = 0; r < R; r++) {
                    const int64_t at = (r0 + r) * out_features + column * TILE_OUT;
                    if (legal) store_legal_sums(result + r * TILE_OUT, (float *)out + at, allowed[r]);
                    else store_sums(result + r * TILE_OUT, out, at, out_fp32);
                }
        }
        free(partial);
    }
    free(xq);
    return failed ? -1 : 0;
}
