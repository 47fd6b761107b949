// The 4-bit family's GEMM tiles: a reference beside the AVX2 and AVX-512 VNNI paths (qgemm.cpp drives
// them; its header has the arithmetic every path follows). Two kinds share the codes, 0..15 a weight:
//   Q4_1: w = d q + m, fp16 d and m per block of 32 (GGUF's Q4_1 as stored);
//   Q4_K: w = (d sc) q - (dmin mk), per super-block of 256 fp16 d and dmin, per block of 32 6-bit sc and
//         mk (GGUF's Q4_K as stored; d sc and dmin mk are exact in float32, and the value is rounded once,
//         as ggml and the gguf package dequantize it).
// Per output and block: isum = the exact integer sum of q xq; acc = fma(isum, D dx, acc), D = d or d sc;
// acc = fma(m, dx xsum, acc) with m = m or -(dmin mk).
//
// Packed layout, per tile of 16 columns and block of 32 inputs: 256 bytes [j = 0..3][column][4 inputs
// 4j..4j+3], the low nibbles inputs 4j.., the high nibbles 4(j + 4)... Scales per tile (scale_words):
//   Q4_1: per block d[16 columns], then m[16] (fp16);
//   Q4_K: per block sc[16], then mk[16] (bytes, 16 words); then per super-block d[16], dmin[16] (fp16).

#include <immintrin.h>

#include <cmath>
#include <cstring>

#include "kernels.h"

namespace {

// Block g's scales for column c: D (the products') and m (the minimum term's), as floats.
void scales_reference(int kind, const uint16_t* sc, int64_t blocks, int64_t g, int c, float& d, float& m) {
  if (kind == Q4_1) {
    d = half(sc[g * 32 + c]);
    m = half(sc[g * 32 + 16 + c]);
    return;
  }
  const uint8_t* small = reinterpret_cast<const uint8_t*>(sc) + g * 32;
  const uint16_t* sup = sc + 16 * blocks + (g / SUPER) * 32;
  d = half(sup[c]) * static_cast<float>(small[c]);
  m = -(half(sup[16 + c]) * static_cast<float>(small[16 + c]));
}

template <int R, int KIND>
void tile_reference(const uint8_t* w, const uint16_t* sc, const Acts& a, int64_t r0, float* out) {
  for (int r = 0; r < R; ++r) {
    const int64_t row = r0 + r;
    for (int c = 0; c < TILE; ++c) {
      float acc = 0.f;
      for (int64_t g = 0; g < a.blocks; ++g) {
        const uint8_t* wg = w + g * 256;
        const int8_t* xq = a.q.data() + (row * a.blocks + g) * BLOCK;
        int32_t isum = 0;
        for (int i = 0; i < BLOCK; ++i) {
          const int j = i / 4, b = i % 4;  // input i sits in group j of 4, byte b
          isum += ((wg[((j % 4) * TILE + c) * 4 + b] >> (j < 4 ? 0 : 4)) & 15) * xq[i];
        }
        float d, m;
        scales_reference(KIND, sc, a.blocks, g, c, d, m);
        const int64_t i = row * a.blocks + g;
        acc = std::fma(static_cast<float>(isum), d * a.d[i], acc);
        acc = std::fma(m, a.s[i], acc);
      }
      out[r * TILE + c] = acc;
    }
  }
}

// ---- AVX2: 8 columns at a time (maddubs + madd give the same exact integers as VNNI) ------------
// The weights go group by group (4 inputs of 8 columns), each used at once by every row, so only the
// rows' sums stay in registers (16 ymm registers: a tile's 8 weight vectors beside 8 rows' sums
// spilled). The products (|q x| <= 15 * 127) are summed in 16 bits over the whole block (8 pairs: at
// most 30480, no saturation) and widened once per block.

// `scales_reference` for columns 8h..8h + 7.
template <int KIND>
__attribute__((target("avx2,fma,f16c"))) inline void scales8(const uint16_t* sc, int64_t blocks, int64_t g, int h,
                                                             __m256& d, __m256& m) {
  if (KIND == Q4_1) {
    d = fp16x8(sc + g * 32 + h * 8);
    m = fp16x8(sc + g * 32 + 16 + h * 8);
    return;
  }
  const uint8_t* small = reinterpret_cast<const uint8_t*>(sc) + g * 32 + h * 8;
  const uint16_t* sup = sc + 16 * blocks + (g / SUPER) * 32 + h * 8;
  d = _mm256_mul_ps(fp16x8(sup), bytes8<false>(small));
  m = _mm256_xor_ps(_mm256_mul_ps(fp16x8(sup + 16), bytes8<false>(small + 16)), _mm256_set1_ps(-0.f));  // exact negation
}

template <int R, int KIND>
__attribute__((target("avx2,fma,f16c"))) void tile_avx2(const uint8_t* w, const uint16_t* sc, const Acts& a,
                                                       int64_t r0, float* out) {
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  const int64_t stride = a.blocks * BLOCK;
  for (int h = 0; h < 2; ++h) {
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < a.blocks; ++g) {
      const uint8_t* wg = w + g * 256 + h * 32;
      const int8_t* xg = a.q.data() + (r0 * a.blocks + g) * BLOCK;  // row r0's block g; rows `stride` apart
      __m256i s16[R];
      for (int r = 0; r < R; ++r) s16[r] = _mm256_setzero_si256();
      for (int j = 0; j < 4; ++j) {  // groups j (low nibbles) and j + 4 (high nibbles)
        const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + j * 64));
        const __m256i lo = _mm256_and_si256(b, low), hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), low);
        for (int r = 0; r < R; ++r)
          s16[r] = _mm256_add_epi16(s16[r], _mm256_add_epi16(_mm256_maddubs_epi16(lo, xgroup(xg, r, stride, j)),
                                                             _mm256_maddubs_epi16(hi, xgroup(xg, r, stride, j + 4))));
      }
      __m256 d, m;
      scales8<KIND>(sc, a.blocks, g, h, d, m);
      for (int r = 0; r < R; ++r) {
        const int64_t i = (r0 + r) * a.blocks + g;
        const __m256 t = _mm256_mul_ps(d, _mm256_set1_ps(a.d[i]));
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(s16[r], ones)), t, acc[r]);
        acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(a.s[i]), acc[r]);
      }
    }
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + r * TILE + h * 8, acc[r]);
  }
}

// ---- AVX-512 VNNI: 16 columns at a time, 64 byte products per instruction -----------------------

template <int KIND>
FD_AVX512 inline void scales16(const uint16_t* sc, int64_t blocks, int64_t g, __m512& d, __m512& m) {
  if (KIND == Q4_1) {
    d = fp16x16(sc + g * 32);
    m = fp16x16(sc + g * 32 + 16);
    return;
  }
  const uint8_t* small = reinterpret_cast<const uint8_t*>(sc) + g * 32;
  const uint16_t* sup = sc + 16 * blocks + (g / SUPER) * 32;
  d = _mm512_mul_ps(fp16x16(sup), bytes16<false>(small));
  m = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(_mm512_mul_ps(fp16x16(sup + 16), bytes16<false>(small + 16))),
                                           _mm512_set1_epi32(int32_t(0x80000000u))));  // exact negation
}

template <int R, int KIND>
FD_AVX512 void tile_avx512(const uint8_t* w, const uint16_t* sc, const Acts& a, int64_t r0, float* out) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  const int64_t stride = a.blocks * BLOCK;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < a.blocks; ++g) {
    const uint8_t* wg = w + g * 256;
    __m512i wv[8];
    for (int j = 0; j < 4; ++j) {
      const __m512i b = _mm512_loadu_si512(wg + j * 64);
      wv[j] = _mm512_and_si512(b, low);
      wv[j + 4] = _mm512_and_si512(_mm512_srli_epi16(b, 4), low);
    }
    __m512i isums[R];  // the rows' integer sums side by side: R independent chains of 8 dot products
    for (int r = 0; r < R; ++r) isums[r] = _mm512_setzero_si512();
    const int8_t* xg = a.q.data() + (r0 * a.blocks + g) * BLOCK;  // row r0's block g; rows `stride` apart
    for (int j = 0; j < 8; ++j)
      for (int r = 0; r < R; ++r)  // 4 activation bytes to every lane: folded into the dot product's load
        isums[r] = _mm512_dpbusd_epi32(isums[r], wv[j], _mm512_set1_epi32(*reinterpret_cast<const unaligned_i32*>(
                                                           xg + r * stride + 4 * j)));
    __m512 d, m;
    scales16<KIND>(sc, a.blocks, g, d, m);
    for (int r = 0; r < R; ++r) {
      const int64_t i = (r0 + r) * a.blocks + g;
      const __m512 t = _mm512_mul_ps(d, _mm512_set1_ps(a.d[i]));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isums[r]), t, acc[r]);
      acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(a.s[i]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * TILE, acc[r]);
}

}  // namespace

TileFn q4_tile(int64_t path, int64_t kind, int rows) {
  static const TileFn fns[3][2][ROWS] = {
      {FD_ROWS(tile_reference, Q4_1), FD_ROWS(tile_reference, Q4_K)},
      {FD_ROWS(tile_avx2, Q4_1), FD_ROWS(tile_avx2, Q4_K)},
      {FD_ROWS(tile_avx512, Q4_1), FD_ROWS(tile_avx512, Q4_K)},
  };
  return fns[path - REFERENCE][kind == Q4_K][rows - 1];
}
