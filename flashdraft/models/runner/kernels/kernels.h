// What the kernel files share: the GEMM (qgemm.cpp), used by the layer forward (layers.cpp).
#pragma once

#include <ATen/ATen.h>
#include <immintrin.h>

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <vector>

enum Kind { Q8_0 = 0, Q4_1 = 1 };
enum Path { AUTO = 0, REFERENCE = 1, AVX2 = 2, AVX512 = 3 };

// Activations quantized per row and block of 32 (row-local: a row's values do not depend on the
// rows beside it): int8 codes, dx = amax / 127, and per block dx * xsum (Q4_1's minimum term) and
// xsum (Q8_0's offset correction). Inputs past K count as zeros.
struct Acts {
  int64_t rows = 0, blocks = 0;
  std::vector<int8_t> q;     // rows x blocks*32
  std::vector<float> d, s;   // rows x blocks
  std::vector<int32_t> sum;  // rows x blocks
  void resize(int64_t rows, int64_t k);
};

// Packed weights (see qgemm.cpp): `n` output columns in tiles of 16.
struct Weights {
  const uint8_t* packed;
  const uint16_t* scales;
  int64_t n, kind;
};

// The fastest path this CPU runs (AVX512 with VNNI, AVX2, or the scalar REFERENCE).
int64_t best_path();

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
