// The 8-bit family's GEMM tiles: a reference beside the AVX2 and AVX-512 VNNI paths (qgemm.cpp drives
// them; its header has the arithmetic every path follows). Two kinds share the codes, one signed byte a
// weight:
//   Q8_0: w = d q, q in -127..127, fp16 d per block of 32 (GGUF's Q8_0 as stored, and its Q5_0: q - 16);
//   Q6_K: w = (d sc) q, q in -32..31, per super-block of 256 an fp16 d, per 16 inputs an int8 sc (GGUF's
//         Q6_K as stored; d sc is exact in float32).
// Per output and block: Q8_0 isum = the exact integer sum of q xq, acc = fma(isum, d dx, acc); Q6_K the
// same for each half of 16 inputs in turn, with its own D = d sc.
//
// Packed layout, per tile of 16 columns and block of 32 inputs: 512 bytes [j = 0..7][column][4 inputs
// 4j..4j+3], each byte q + 128 (VNNI multiplies unsigned by signed bytes). Scales per tile (scale_words):
//   Q8_0: per block d[16 columns] (fp16);
//   Q6_K: per block sc[16] of inputs 0-15, then sc[16] of inputs 16-31 (int8, 16 words); then per
//         super-block d[16] (fp16).

#include <immintrin.h>

#include <cmath>
#include <cstring>

#include "kernels.h"

namespace {

// Block g's scale for column c, and Q6_K's second half's (d1).
void scales_reference(int kind, const uint16_t* sc, int64_t blocks, int64_t g, int c, float& d0, float& d1) {
  if (kind == Q8_0) {
    d0 = d1 = half(sc[g * 16 + c]);
    return;
  }
  const int8_t* small = reinterpret_cast<const int8_t*>(sc) + g * 32;
  const float d = half(sc[16 * blocks + (g / SUPER) * 16 + c]);
  d0 = d * static_cast<float>(small[c]);
  d1 = d * static_cast<float>(small[16 + c]);
}

template <int R, int KIND>
void tile_reference(const uint8_t* w, const uint16_t* sc, const Acts& a, int64_t r0, float* out) {
  for (int r = 0; r < R; ++r) {
    const int64_t row = r0 + r;
    for (int c = 0; c < TILE; ++c) {
      float acc = 0.f;
      for (int64_t g = 0; g < a.blocks; ++g) {
        const uint8_t* wg = w + g * 512;
        const int8_t* xq = a.q.data() + (row * a.blocks + g) * BLOCK;
        int32_t isum[2] = {0, 0};  // inputs 0-15, 16-31
        for (int i = 0; i < BLOCK; ++i) isum[i / 16] += (int(wg[((i / 4) * TILE + c) * 4 + i % 4]) - 128) * xq[i];
        float d0, d1;
        scales_reference(KIND, sc, a.blocks, g, c, d0, d1);
        const float dx = a.d[row * a.blocks + g];
        if (KIND == Q8_0) {
          acc = std::fma(static_cast<float>(isum[0] + isum[1]), d0 * dx, acc);
        } else {
          acc = std::fma(static_cast<float>(isum[0]), d0 * dx, acc);
          acc = std::fma(static_cast<float>(isum[1]), d1 * dx, acc);
        }
      }
      out[r * TILE + c] = acc;
    }
  }
}

// ---- AVX2: 8 columns at a time (maddubs + madd give the same exact integers as VNNI) ------------
// The weights go group by group (4 inputs of 8 columns), each used at once by every row, so only the
// rows' sums stay in registers. maddubs multiplies unsigned by signed bytes: |q| against xq given q's
// sign. Q8_0's pair sums (up to 2 * 127 * 127) are widened at each group; Q6_K's (|q| <= 32: at most
// 8128) are summed in 16 bits over each half block and widened once per half.

// `scales_reference` for columns 8h..8h + 7.
template <int KIND>
__attribute__((target("avx2,fma,f16c"))) inline void scales8(const uint16_t* sc, int64_t blocks, int64_t g, int h,
                                                             __m256& d0, __m256& d1) {
  if (KIND == Q8_0) {
    d0 = d1 = fp16x8(sc + g * 16 + h * 8);
    return;
  }
  const uint8_t* small = reinterpret_cast<const uint8_t*>(sc) + g * 32 + h * 8;
  const __m256 d = fp16x8(sc + 16 * blocks + (g / SUPER) * 16 + h * 8);
  d0 = _mm256_mul_ps(d, bytes8<true>(small));
  d1 = _mm256_mul_ps(d, bytes8<true>(small + 16));
}

template <int R, int KIND>
__attribute__((target("avx2,fma,f16c"))) void tile_avx2(const uint8_t* w, const uint16_t* sc, const Acts& a,
                                                       int64_t r0, float* out) {
  const __m256i flip = _mm256_set1_epi8(char(0x80)), ones = _mm256_set1_epi16(1);
  const int64_t stride = a.blocks * BLOCK;
  for (int h = 0; h < 2; ++h) {
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < a.blocks; ++g) {
      const uint8_t* wg = w + g * 512 + h * 32;
      const int8_t* xg = a.q.data() + (r0 * a.blocks + g) * BLOCK;  // row r0's block g; rows `stride` apart
      __m256 d0, d1;
      scales8<KIND>(sc, a.blocks, g, h, d0, d1);
      __m256i isums[R], s16[R];
      for (int r = 0; r < R; ++r) isums[r] = s16[r] = _mm256_setzero_si256();
      for (int j = 0; j < 8; ++j) {  // q + 128 -> q as a signed byte
        const __m256i wv = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + j * 64)), flip);
        const __m256i wu = _mm256_abs_epi8(wv);
        for (int r = 0; r < R; ++r) {
          const __m256i p = _mm256_maddubs_epi16(wu, _mm256_sign_epi8(xgroup(xg, r, stride, j), wv));
          if (KIND == Q8_0) {
            isums[r] = _mm256_add_epi32(isums[r], _mm256_madd_epi16(p, ones));
          } else {
            s16[r] = _mm256_add_epi16(s16[r], p);
          }
        }
        if (KIND == Q6_K && j % 4 == 3) {  // a half's products: one rounding each, in order
          for (int r = 0; r < R; ++r) {
            const __m256 t = _mm256_mul_ps(j < 4 ? d0 : d1, _mm256_set1_ps(a.d[(r0 + r) * a.blocks + g]));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(s16[r], ones)), t, acc[r]);
            s16[r] = _mm256_setzero_si256();
          }
        }
      }
      if (KIND == Q8_0) {
        for (int r = 0; r < R; ++r) {
          const __m256 t = _mm256_mul_ps(d0, _mm256_set1_ps(a.d[(r0 + r) * a.blocks + g]));
          acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isums[r]), t, acc[r]);
        }
      }
    }
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + r * TILE + h * 8, acc[r]);
  }
}

// ---- AVX-512 VNNI: 16 columns at a time, 64 byte products per instruction -----------------------

template <int KIND>
FD_AVX512 inline void scales16(const uint16_t* sc, int64_t blocks, int64_t g, __m512& d0, __m512& d1) {
  if (KIND == Q8_0) {
    d0 = d1 = fp16x16(sc + g * 16);
    return;
  }
  const uint8_t* small = reinterpret_cast<const uint8_t*>(sc) + g * 32;
  const __m512 d = fp16x16(sc + 16 * blocks + (g / SUPER) * 16);
  d0 = _mm512_mul_ps(d, bytes16<true>(small));
  d1 = _mm512_mul_ps(d, bytes16<true>(small + 16));
}

template <int R, int KIND>
FD_AVX512 void tile_avx512(const uint8_t* w, const uint16_t* sc, const Acts& a, int64_t r0, float* out) {
  const int64_t stride = a.blocks * BLOCK;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < a.blocks; ++g) {
    const uint8_t* wg = w + g * 512;
    const int8_t* xg = a.q.data() + (r0 * a.blocks + g) * BLOCK;  // row r0's block g; rows `stride` apart
    __m512 d0, d1;
    scales16<KIND>(sc, a.blocks, g, d0, d1);
    // Q8_0: one sum of 8 groups; Q6_K: groups 0-3, then 4-7, each with its own scale.
    for (int part = 0; part < (KIND == Q8_0 ? 1 : 2); ++part) {
      const int j0 = 4 * part, j1 = KIND == Q8_0 ? 8 : j0 + 4;
      __m512i isums[R];  // the rows' integer sums side by side: R independent chains of dot products
      for (int r = 0; r < R; ++r) isums[r] = _mm512_setzero_si512();
      for (int j = j0; j < j1; ++j) {
        const __m512i wv = _mm512_loadu_si512(wg + j * 64);  // q + 128, unsigned
        for (int r = 0; r < R; ++r)  // 4 activation bytes to every lane: folded into the dot product's load
          isums[r] = _mm512_dpbusd_epi32(isums[r], wv, _mm512_set1_epi32(*reinterpret_cast<const unaligned_i32*>(
                                                           xg + r * stride + 4 * j)));
      }
      for (int r = 0; r < R; ++r) {
        const int64_t i = (r0 + r) * a.blocks + g;
        const int32_t xsum = KIND == Q8_0 ? a.sum[i] : part == 0 ? a.lo[i] : a.sum[i] - a.lo[i];
        const __m512i isum = _mm512_sub_epi32(isums[r], _mm512_set1_epi32(128 * xsum));  // the +128 offset
        const __m512 t = _mm512_mul_ps(part == 0 ? d0 : d1, _mm512_set1_ps(a.d[i]));
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), t, acc[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * TILE, acc[r]);
}

}  // namespace

TileFn q8_tile(int64_t path, int64_t kind, int rows) {
  static const TileFn fns[3][2][ROWS] = {
      {FD_ROWS(tile_reference, Q8_0), FD_ROWS(tile_reference, Q6_K)},
      {FD_ROWS(tile_avx2, Q8_0), FD_ROWS(tile_avx2, Q6_K)},
      {FD_ROWS(tile_avx512, Q8_0), FD_ROWS(tile_avx512, Q6_K)},
  };
  return fns[path - REFERENCE][kind == Q6_K][rows - 1];
}
