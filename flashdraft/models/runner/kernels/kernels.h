// What the kernel files share: the GEMM (qgemm.cpp: activations, dispatch; q4.cpp and q8.cpp: the tiles of
// each quant family, a reference beside each fast path), used by the layer forward (layers.cpp).
#pragma once

#include <ATen/ATen.h>
#include <immintrin.h>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <vector>

// The weights' kinds, by their codes: 4 bits (Q4_1, Q4_K: q4.cpp) or 8 bits (Q8_0, Q6_K: q8.cpp). GGUF's
// Q5_0 runs as Q8_0 (its q - 16 is exact in 8 bits, its d the same).
enum Kind { Q8_0 = 0, Q4_1 = 1, Q4_K = 2, Q6_K = 3 };
enum Path { AUTO = 0, REFERENCE = 1, AVX2 = 2, AVX512 = 3 };
constexpr int64_t BLOCK = 32;  // inputs per block (activations and weights)
constexpr int64_t TILE = 16;   // output columns per tile
constexpr int64_t SUPER = 8;   // blocks per K-quant super-block (256 inputs)

inline bool nibbles(int64_t kind) { return kind == Q4_1 || kind == Q4_K; }
// Bytes of codes per tile and block: 32 inputs x 16 columns, 4 or 8 bits each.
inline int64_t code_bytes(int64_t kind) { return nibbles(kind) ? 256 : 512; }
// 16-bit words of scales per tile of `blocks` blocks (see q4.cpp, q8.cpp): per block, Q8_0 d[16]; Q4_1 d[16],
// m[16]; Q4_K and Q6_K 32 bytes of small integer scales; then per super-block Q4_K d[16], dmin[16] and Q6_K d[16].
inline int64_t scale_words(int64_t kind, int64_t blocks) {
  const int64_t supers = (blocks + SUPER - 1) / SUPER;
  switch (kind) {
    case Q8_0: return 16 * blocks;
    case Q4_1: return 32 * blocks;
    case Q4_K: return 16 * blocks + 32 * supers;
    default: return 16 * blocks + 16 * supers;
  }
}

// Activations quantized per row and block of 32 (row-local: a row's values do not depend on the
// rows beside it): int8 codes, dx = amax / 127, and per block dx * xsum (Q4_1's minimum term) and
// xsum (Q8_0's offset correction), and the first 16 codes' sum (Q6_K's, whose scales go by 16). Inputs
// past K count as zeros.
struct Acts {
  int64_t rows = 0, blocks = 0;
  std::vector<int8_t> q;         // rows x blocks*32
  std::vector<float> d, s;       // rows x blocks
  std::vector<int32_t> sum, lo;  // rows x blocks
  void resize(int64_t rows, int64_t k);
};

// Packed weights (see q4.cpp, q8.cpp): `n` output columns in tiles of 16.
struct Weights {
  const uint8_t* packed;
  const uint16_t* scales;
  int64_t n, kind;
};

// The fastest path this CPU runs (AVX512 with VNNI, AVX2, or the scalar REFERENCE).
int64_t best_path();

// Rows r0..r0 + rows of one tile: out (rows, 16) float32 = the rows' quantized blocks times the tile's
// weights `w` (code_bytes a block) with its scales `sc` (scale_words of the tile). Per output, the
// same operations on every path (the header of qgemm.cpp).
using TileFn = void (*)(const uint8_t* w, const uint16_t* sc, const Acts& a, int64_t r0, float* out);
TileFn q4_tile(int64_t path, int64_t kind, int rows);  // q4.cpp: Q4_1, Q4_K
TileFn q8_tile(int64_t path, int64_t kind, int rows);  // q8.cpp: Q8_0, Q6_K
constexpr int ROWS = 8;                                 // rows a tile call computes at most

// fp16 bits as a float (exact).
inline float half(uint16_t h) { return static_cast<float>(c10::Half(h, c10::Half::from_bits())); }

// x (M, K) times packed Q8_0 / Q4_1 weights' transpose: (M, n) in x's dtype (see qgemm.cpp).
at::Tensor qgemm(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales, int64_t n, int64_t kind,
                 int64_t path);

// x (..., n) bf16 -> each row's first maximum (...), int64 (argmax.cpp).
at::Tensor argmax_rows(const at::Tensor& x, int64_t path);

// Block i (row i / a.blocks) of x (a.rows, k) into `a`: any thread, any order.
void quantize_act(const c10::BFloat16* x, int64_t k, int64_t i, int64_t path, Acts& a);

// Tiles t0..t1 of y (a.rows, w.n) = x W^T (+ bias) from x's quantized blocks: any thread, any split.
void gemm_tiles(const Acts& a, const Weights& w, int64_t path, int64_t t0, int64_t t1, c10::BFloat16* y,
                const c10::BFloat16* bias);

// 8 bfloat16 values as floats with AVX2 (exact: a bf16 is a float's high half). Every file's bf16 loads.
inline __attribute__((target("avx2,fma"))) __m256 load_bf16(const c10::BFloat16* x) {
  const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(h, 16));
}

// 8 floats' bfloat16 bits (in 32-bit lanes) with AVX2, those of c10::BFloat16(float): round to nearest
// even, NaN -> 0x7FC0. Both files' bf16 stores use it, so they round as torch casts.
inline __attribute__((target("avx2,fma"))) __m256i bf16_bits(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i bias = _mm256_add_epi32(_mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1)),
                                        _mm256_set1_epi32(0x7FFF));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, bias), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
}

// What the tiles of every quant family share (q4.cpp, q8.cpp).
typedef int32_t __attribute__((may_alias, aligned(1))) unaligned_i32;  // 4 activation bytes read at once
#define FD_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c")))
// A kind's tiles of 1..ROWS rows, for a dispatch table.
#define FD_ROWS(FN, KIND) \
  { FN<1, KIND>, FN<2, KIND>, FN<3, KIND>, FN<4, KIND>, FN<5, KIND>, FN<6, KIND>, FN<7, KIND>, FN<8, KIND> }

// The 4 activation bytes of row r's group j (x: row 0's block, rows `stride` apart) in every 32-bit lane.
inline __attribute__((target("avx2,fma"))) __m256i xgroup(const int8_t* x, int64_t r, int64_t stride, int j) {
  return _mm256_set1_epi32(*reinterpret_cast<const unaligned_i32*>(x + r * stride + 4 * j));
}

// 8 fp16 values (bits) as floats (exact).
inline __attribute__((target("avx2,fma,f16c"))) __m256 fp16x8(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// 16 fp16 values (bits) as floats (exact).
inline FD_AVX512 __m512 fp16x16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// 8 (16) unsigned or signed bytes as floats (exact): a K-quant's small integer scales.
template <bool SIGNED>
inline __attribute__((target("avx2,fma,f16c"))) __m256 bytes8(const uint8_t* p) {
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtepi32_ps(SIGNED ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b));
}

template <bool SIGNED>
inline FD_AVX512 __m512 bytes16(const uint8_t* p) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm512_cvtepi32_ps(SIGNED ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b));
}
