// Weight-only quantized GEMM for the runner: y = x W^T with W in GGUF-like blocks of 32 inputs
// (Q8_0: w = d * q, q in -127..127; Q4_1: w = d * q + m, q in 0..15; d and m in fp16) and x quantized
// per row and block of 32 to int8 (x ~ dx * xq, dx = amax / 127), as llama.cpp's q8 path does.
//
// Why our own: torch's int8 / int4 CPU kernels take activation rows 4 at a time, so a verify of 8 rows
// costs 1.8 one-row steps. Here each weight tile is unpacked once and used for every row, so 8 or 16
// rows cost little more than one (the step is bound by reading the weights).
//
// Exact by construction: every output (row, column) is computed by the same sequence of operations,
// whatever the number of rows, the row's place among them, the thread or the code path:
//   isum_g = sum over the block of q * xq           (an exact integer, |isum| < 2^24)
//   acc    = fma(float(isum_g), d_g * dx_g, acc)     (for each block g in order, one rounding)
//   acc    = fma(m_g, dx_g * xsum_g, acc)            (Q4_1 only: the minimum times the row's block sum)
// The AVX-512 VNNI, AVX2 and scalar reference paths below differ only in how they get the exact
// integers, so they give the same bits (tests/test_kernels.py). Built with -ffp-contract=off: the only
// fused multiply-adds are the written ones (std::fma in the reference, one rounding as the instruction).
//
// Packed layout (flashdraft/models/runner/kernels/__init__.py packs it): columns in tiles of 16,
// inputs in blocks of 32, per (tile, block):
//   Q8_0: 512 bytes [j = 0..7][column 0..15][4 inputs 4j..4j+3], each byte q + 128;
//   Q4_1: 256 bytes [j = 0..3][column][4 inputs], low nibble inputs 4j.., high nibble 4(j+4)..;
// and fp16 scales [tile][block][d (16 columns), then m (16 columns) for Q4_1].

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <immintrin.h>
#include <torch/library.h>

#include "kernels.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t BLOCK = 32;  // inputs per block
constexpr int64_t TILE = 16;   // columns per tile
constexpr int ROWS = 8;        // rows computed together (each row's arithmetic does not depend on it)
typedef int32_t __attribute__((may_alias, aligned(1))) unaligned_i32;  // 4 activation bytes read at once


// One block of n <= 32 values: int8 codes, dx = amax / 127 and the codes' sum. NaNs are not handled.
template <typename T>
void quantize_block(const T* x, int n, int8_t* q, float* dx, int32_t* sum) {
  float amax = 0.f;
  for (int i = 0; i < n; ++i) amax = std::max(amax, std::fabs(static_cast<float>(x[i])));
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  int32_t s = 0;
  for (int i = 0; i < n; ++i) {
    const float v = std::nearbyint(static_cast<float>(x[i]) * inv);  // |v| <= 127: no clamp needed
    q[i] = static_cast<int8_t>(v);
    s += static_cast<int32_t>(v);
  }
  *dx = amax / 127.f;
  *sum = s;
}

// The same block of 32 with AVX2, the same bits: max and integer sums are exact in any order, and
// each code is the same rounded product.
template <typename T>
__attribute__((target("avx2,fma"))) __m256 load8(const T* x) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm256_loadu_ps(x);
  } else {
    return load_bf16(x);
  }
}

template <typename T>
__attribute__((target("avx2,fma"))) void quantize_block_avx2(const T* x, int8_t* q, float* dx, int32_t* sum) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 v[4], m = _mm256_setzero_ps();
  for (int j = 0; j < 4; ++j) {
    v[j] = load8(x + 8 * j);
    m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[j]));
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  const float amax = _mm_cvtss_f32(m4);
  const __m256 inv = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
  __m256i i[4], total = _mm256_setzero_si256();
  for (int j = 0; j < 4; ++j) {
    i[j] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[j], inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    total = _mm256_add_epi32(total, i[j]);
  }
  const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                      _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  __m128i t = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
  *dx = amax / 127.f;
  *sum = _mm_cvtsi128_si32(t);
}

// Block i (row i / blocks, block i % blocks) of x (rows, k); the reference path quantizes with the
// scalar code, the others with AVX2 (the same bits).
template <typename T>
void quantize_one(const T* x, int64_t k, int64_t i, bool vector, Acts& a) {
  const int64_t r = i / a.blocks, k0 = (i % a.blocks) * BLOCK, n = std::min(BLOCK, k - k0);
  int8_t* q = a.q.data() + i * BLOCK;
  if (vector && n == BLOCK) {
    quantize_block_avx2(x + r * k + k0, q, &a.d[i], &a.sum[i]);
  } else {
    std::memset(q, 0, BLOCK);
    quantize_block(x + r * k + k0, int(std::max<int64_t>(n, 0)), q, &a.d[i], &a.sum[i]);
  }
  a.s[i] = a.d[i] * static_cast<float>(a.sum[i]);
}

inline float half(uint16_t h) { return static_cast<float>(c10::Half(h, c10::Half::from_bits())); }

// ---- the reference: one column at a time, plain C++ --------------------------------------------

void tile_reference(int kind, const uint8_t* w, const uint16_t* sc, const Acts& a, int64_t r0, int rows,
                    float* out) {
  const int64_t wbytes = kind == Q8_0 ? 512 : 256, scn = kind == Q8_0 ? 16 : 32;
  for (int r = 0; r < rows; ++r) {
    const int64_t row = r0 + r;
    for (int c = 0; c < TILE; ++c) {
      float acc = 0.f;
      for (int64_t g = 0; g < a.blocks; ++g) {
        const uint8_t* wg = w + g * wbytes;
        const int8_t* xq = a.q.data() + (row * a.blocks + g) * BLOCK;
        int32_t isum = 0;
        for (int i = 0; i < BLOCK; ++i) {
          const int j = i / 4, b = i % 4;  // input i sits in group j of 4, byte b
          const int q = kind == Q8_0 ? int(wg[(j * TILE + c) * 4 + b]) - 128
                                     : (wg[((j % 4) * TILE + c) * 4 + b] >> (j < 4 ? 0 : 4)) & 15;
          isum += q * xq[i];
        }
        const float dx = a.d[row * a.blocks + g];
        const float t = half(sc[g * scn + c]) * dx;
        acc = std::fma(static_cast<float>(isum), t, acc);
        if (kind == Q4_1) acc = std::fma(half(sc[g * scn + 16 + c]), a.s[row * a.blocks + g], acc);
      }
      out[r * TILE + c] = acc;
    }
  }
}

// ---- AVX2: 8 columns at a time (maddubs + madd give the same exact integers as VNNI) ------------
// The weights go group by group (4 inputs of 8 columns), each used at once by every row, so only the
// rows' sums stay in registers (16 ymm registers: a tile's 8 weight vectors beside 8 rows' sums
// spilled). Q4_1's products (|q x| <= 15 * 127) are summed in 16 bits over the whole block (8 pairs:
// at most 30480, no saturation) and widened once per block, not once per group; Q8_0's (|q x| up to
// 127 * 127) are widened at each group.

// 4 activation bytes of row r, group j, broadcast to every 32-bit lane.
__attribute__((target("avx2,fma"))) inline __m256i xgroup(const int8_t* x, int64_t r, int64_t stride, int j) {
  return _mm256_set1_epi32(*reinterpret_cast<const unaligned_i32*>(x + r * stride + 4 * j));
}

template <int R, int KIND>
__attribute__((target("avx2,fma,f16c"))) void tile_avx2(const uint8_t* w, const uint16_t* sc, const Acts& a,
                                                       int64_t r0, float* out) {
  const __m256i low = _mm256_set1_epi8(0x0F), flip = _mm256_set1_epi8(char(0x80)), ones = _mm256_set1_epi16(1);
  const int64_t wbytes = KIND == Q8_0 ? 512 : 256, scn = KIND == Q8_0 ? 16 : 32, stride = a.blocks * BLOCK;
  for (int h = 0; h < 2; ++h) {
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < a.blocks; ++g) {
      const uint8_t* wg = w + g * wbytes + h * 32;
      const int8_t* xg = a.q.data() + (r0 * a.blocks + g) * BLOCK;  // row r0's block g; rows `stride` apart
      __m256i isums[R];
      if (KIND == Q4_1) {
        __m256i s16[R];
        for (int r = 0; r < R; ++r) s16[r] = _mm256_setzero_si256();
        for (int j = 0; j < 4; ++j) {  // groups j (low nibbles) and j + 4 (high nibbles)
          const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + j * 64));
          const __m256i lo = _mm256_and_si256(b, low), hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), low);
          for (int r = 0; r < R; ++r)
            s16[r] = _mm256_add_epi16(s16[r], _mm256_add_epi16(_mm256_maddubs_epi16(lo, xgroup(xg, r, stride, j)),
                                                               _mm256_maddubs_epi16(hi, xgroup(xg, r, stride, j + 4))));
        }
        for (int r = 0; r < R; ++r) isums[r] = _mm256_madd_epi16(s16[r], ones);
      } else {
        for (int r = 0; r < R; ++r) isums[r] = _mm256_setzero_si256();
        for (int j = 0; j < 8; ++j) {  // q + 128 -> q as a signed byte; |q| against x with q's sign
          const __m256i wv = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + j * 64)), flip);
          const __m256i wu = _mm256_abs_epi8(wv);
          for (int r = 0; r < R; ++r) {
            const __m256i xv = _mm256_sign_epi8(xgroup(xg, r, stride, j), wv);
            // unsigned x signed bytes, pairs summed to 16 bits: |q| <= 127 and |xq| <= 127 cannot saturate
            isums[r] = _mm256_add_epi32(isums[r], _mm256_madd_epi16(_mm256_maddubs_epi16(wu, xv), ones));
          }
        }
      }
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + g * scn + h * 8)));
      const __m256 m = KIND == Q4_1 ? _mm256_cvtph_ps(_mm_loadu_si128(
                                          reinterpret_cast<const __m128i*>(sc + g * scn + 16 + h * 8)))
                                    : _mm256_setzero_ps();
      for (int r = 0; r < R; ++r) {
        const int64_t i = (r0 + r) * a.blocks + g;
        const __m256 t = _mm256_mul_ps(d, _mm256_set1_ps(a.d[i]));
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isums[r]), t, acc[r]);
        if (KIND == Q4_1) acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(a.s[i]), acc[r]);
      }
    }
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + r * TILE + h * 8, acc[r]);
  }
}

// ---- AVX-512 VNNI: 16 columns at a time, 64 byte products per instruction -----------------------

template <int R, int KIND>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c"))) void tile_avx512(const uint8_t* w,
                                                                                    const uint16_t* sc,
                                                                                    const Acts& a, int64_t r0,
                                                                                    float* out) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  const int64_t wbytes = KIND == Q8_0 ? 512 : 256, scn = KIND == Q8_0 ? 16 : 32;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < a.blocks; ++g) {
    const uint8_t* wg = w + g * wbytes;
    __m512i wv[8];
    if (KIND == Q4_1) {
      for (int j = 0; j < 4; ++j) {
        const __m512i b = _mm512_loadu_si512(wg + j * 64);
        wv[j] = _mm512_and_si512(b, low);
        wv[j + 4] = _mm512_and_si512(_mm512_srli_epi16(b, 4), low);
      }
    } else {
      for (int j = 0; j < 8; ++j) wv[j] = _mm512_loadu_si512(wg + j * 64);  // q + 128, unsigned
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc + g * scn)));
    __m512i isums[R];  // the rows' integer sums side by side: R independent chains of 8 dot products
    for (int r = 0; r < R; ++r) isums[r] = _mm512_setzero_si512();
    const int8_t* xg = a.q.data() + (r0 * a.blocks + g) * BLOCK;  // row r0's block g; rows a.blocks apart
    const int64_t stride = a.blocks * BLOCK;
    for (int j = 0; j < 8; ++j)
      for (int r = 0; r < R; ++r)  // 4 activation bytes to every lane: folded into the dot product's load
        isums[r] = _mm512_dpbusd_epi32(isums[r], wv[j], _mm512_set1_epi32(*reinterpret_cast<const unaligned_i32*>(
                                                           xg + r * stride + 4 * j)));
    const __m512 m = KIND == Q4_1
                         ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc + g * scn + 16)))
                         : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) {
      const int64_t i = (r0 + r) * a.blocks + g;
      __m512i isum = isums[r];
      if (KIND == Q8_0) isum = _mm512_sub_epi32(isum, _mm512_set1_epi32(128 * a.sum[i]));  // the +128 offset
      const __m512 t = _mm512_mul_ps(d, _mm512_set1_ps(a.d[i]));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), t, acc[r]);
      if (KIND == Q4_1) acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(a.s[i]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * TILE, acc[r]);
}

// ---- dispatch ------------------------------------------------------------------------------------

using TileFn = void (*)(const uint8_t*, const uint16_t*, const Acts&, int64_t, float*);

#define FD_TABLE(NAME, FN)                                                                 \
  template <int KIND>                                                                      \
  TileFn NAME(int rows) {                                                                  \
    static const TileFn fns[ROWS] = {FN<1, KIND>, FN<2, KIND>, FN<3, KIND>, FN<4, KIND>,   \
                                     FN<5, KIND>, FN<6, KIND>, FN<7, KIND>, FN<8, KIND>};  \
    return fns[rows - 1];                                                                  \
  }
FD_TABLE(avx2_fn, tile_avx2)
FD_TABLE(avx512_fn, tile_avx512)
#undef FD_TABLE

}  // namespace

int64_t best_path() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni"))
    return AVX512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return AVX2;  // f16c comes with both
  return REFERENCE;
}

namespace {

void run_tile(int64_t path, int64_t kind, const uint8_t* w, const uint16_t* sc, const Acts& a, int64_t r0,
              int rows, float* out) {
  if (path == REFERENCE) return tile_reference(int(kind), w, sc, a, r0, rows, out);
  const TileFn fn = path == AVX512 ? (kind == Q8_0 ? avx512_fn<Q8_0>(rows) : avx512_fn<Q4_1>(rows))
                                   : (kind == Q8_0 ? avx2_fn<Q8_0>(rows) : avx2_fn<Q4_1>(rows));
  fn(w, sc, a, r0, out);
}

// 16 floats to bfloat16 with AVX2 (`bf16_bits`, kernels.h), as torch casts.
__attribute__((target("avx2,fma"))) void store_bf16_avx2(const float* v, uint16_t* y) {
  const __m256i lo = bf16_bits(_mm256_loadu_ps(v)), hi = bf16_bits(_mm256_loadu_ps(v + 8));
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(lo, hi), 0xD8);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(y), packed);
}

// A tile's row of float32 outputs into y's dtype, rounded to nearest even (as torch casts); a bias
// is then added in float32 and rounded again, as torch's `y + bias` in y's dtype does.
template <typename T>
void store(const float* v, T* y, int64_t cols, bool vector, const T* bias) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (vector && cols == TILE && !bias) return store_bf16_avx2(v, reinterpret_cast<uint16_t*>(y));
  }
  for (int64_t c = 0; c < cols; ++c) y[c] = static_cast<T>(v[c]);
  if (bias)
    for (int64_t c = 0; c < cols; ++c) y[c] = static_cast<T>(static_cast<float>(y[c]) + static_cast<float>(bias[c]));
}

template <typename T>
void tiles(const Acts& a, const Weights& w, int64_t path, int64_t t0, int64_t t1, T* y, const T* bias) {
  float buf[ROWS * TILE];
  const int64_t bytes = w.kind == Q8_0 ? 512 : 256, scn = w.kind == Q8_0 ? 16 : 32;
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t c0 = t * TILE, cols = std::min(TILE, w.n - c0);
    for (int64_t r0 = 0; r0 < a.rows; r0 += ROWS) {
      const int rs = int(std::min<int64_t>(ROWS, a.rows - r0));
      run_tile(path, w.kind, w.packed + t * a.blocks * bytes, w.scales + t * a.blocks * scn, a, r0, rs, buf);
      for (int r = 0; r < rs; ++r)
        store(buf + r * TILE, y + (r0 + r) * w.n + c0, cols, path != REFERENCE, bias ? bias + c0 : nullptr);
    }
  }
}

// Every tile. Guided: large contiguous parts first (with few rows the GEMM is bound by reading the
// weights, and a contiguous stream reads fastest), smaller ones at the end to whichever thread is
// free (with more rows it is bound by arithmetic, and one core may run slower than the other).
template <typename T>
void all_tiles(const Acts& a, const Weights& w, int64_t path, int64_t n, T* y) {
#pragma omp parallel for schedule(guided, 4) num_threads(at::get_num_threads())
  for (int64_t t = 0; t < n; ++t) tiles<T>(a, w, path, t, t + 1, y, nullptr);
}

}  // namespace

void Acts::resize(int64_t rows_, int64_t k) {
  rows = rows_;
  blocks = (k + BLOCK - 1) / BLOCK;
  q.resize(rows * blocks * BLOCK);
  d.resize(rows * blocks);
  s.resize(rows * blocks);
  sum.resize(rows * blocks);
}

void quantize_act(const c10::BFloat16* x, int64_t k, int64_t i, int64_t path, Acts& a) {
  quantize_one(x, k, i, path != REFERENCE, a);
}

void gemm_tiles(const Acts& a, const Weights& w, int64_t path, int64_t t0, int64_t t1, c10::BFloat16* y,
                const c10::BFloat16* bias) {
  tiles(a, w, path, t0, t1, y, bias);
}

// y (M, n) in x's dtype = x (M, K) times the packed weights' transpose. `path` 0 picks the best this
// CPU runs; 1-3 force one (the tests compare them).
at::Tensor qgemm(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales, int64_t n, int64_t kind,
                 int64_t path) {
  TORCH_CHECK(x.dim() == 2, "qgemm: x must be 2D (rows, inputs)");
  TORCH_CHECK(x.is_cpu() && qweight.is_cpu() && scales.is_cpu(), "qgemm: a CPU kernel, given tensors elsewhere");
  TORCH_CHECK(kind == Q8_0 || kind == Q4_1, "qgemm: kind must be 0 (Q8_0) or 1 (Q4_1)");
  TORCH_CHECK(qweight.dtype() == at::kByte && qweight.dim() == 3 && qweight.is_contiguous(),
              "qgemm: qweight must be contiguous uint8 (tiles, blocks, bytes)");
  const int64_t tiles_ = qweight.size(0), blocks = qweight.size(1);
  TORCH_CHECK(qweight.size(2) == (kind == Q8_0 ? 512 : 256), "qgemm: wrong bytes per tile and block");
  TORCH_CHECK(scales.scalar_type() == at::kShort && scales.is_contiguous() &&
                  scales.numel() == tiles_ * blocks * (kind == Q8_0 ? 16 : 32),
              "qgemm: scales must be contiguous int16 (fp16 bits) of (tiles, blocks, 16 or 32)");
  TORCH_CHECK(x.size(1) <= blocks * BLOCK && n <= tiles_ * TILE, "qgemm: shapes do not match the weights");
  const int64_t best = best_path();
  if (path == AUTO) path = best;
  TORCH_CHECK(path == REFERENCE || path <= best, "qgemm: this CPU cannot run path ", path);

  const at::Tensor xc = x.contiguous();
  const int64_t rows = xc.size(0), k = xc.size(1);
  Acts a;
  a.resize(rows, blocks * BLOCK);
  const bool vector = path != REFERENCE;
  if (xc.scalar_type() == at::kBFloat16) {
    const auto* xp = reinterpret_cast<const c10::BFloat16*>(xc.data_ptr());
    for (int64_t i = 0; i < rows * blocks; ++i) quantize_one(xp, k, i, vector, a);
  } else {
    const at::Tensor xf = xc.to(at::kFloat);
    for (int64_t i = 0; i < rows * blocks; ++i) quantize_one(xf.data_ptr<float>(), k, i, vector, a);
  }
  const Weights w{qweight.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(scales.data_ptr<int16_t>()), n,
                  kind};
  at::Tensor out = at::empty({rows, n}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "qgemm",
                                  [&] { all_tiles<scalar_t>(a, w, path, tiles_, out.data_ptr<scalar_t>()); });
  return out;
}

TORCH_LIBRARY_FRAGMENT(flashdraft, m) {
  m.def("qgemm(Tensor x, Tensor qweight, Tensor scales, int n, int kind, int path) -> Tensor", &qgemm);
  m.def("best_path() -> int", &best_path);
}
