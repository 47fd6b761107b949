// Weight-only quantized GEMM for the runner: y = x W^T with W in GGUF's blocks as stored (the 4-bit family
// Q4_1, Q4_K in q4.cpp; the 8-bit family Q8_0, Q6_K, and Q5_0 as Q8_0, in q8.cpp: their layouts and
// scales there) and x quantized per row and block of 32 to int8 (x ~ dx * xq, dx = amax / 127), as
// llama.cpp's q8 path does. This file quantizes the activations and drives the tiles.
//
// Why our own: torch's int8 / int4 CPU kernels take activation rows 4 at a time, so a verify of 8 rows
// costs 1.8 one-row steps. Here each weight tile is unpacked once and used for every row, so 8 or 16
// rows cost little more than one (the step is bound by reading the weights).
//
// Exact by construction: every output (row, column) is computed by the same sequence of operations,
// whatever the number of rows, the row's place among them, the thread or the code path:
//   isum_g = sum over the block (Q6_K: each half) of q * xq   (an exact integer, |isum| < 2^24)
//   acc    = fma(float(isum_g), D_g * dx_g, acc)     (for each block g in order, one rounding; D the
//                                                     block's scale, exact in float32)
//   acc    = fma(m_g, dx_g * xsum_g, acc)            (Q4_1, Q4_K: the minimum times the row's block sum)
// The AVX-512 VNNI, AVX2 and scalar reference paths differ only in how they get the exact integers,
// so they give the same bits (tests/test_kernels.py). Built with -ffp-contract=off: the only fused
// multiply-adds are the written ones (std::fma in the reference, one rounding as the instruction).
// Columns go in tiles of 16 (flashdraft/models/runner/kernels/__init__.py packs them).

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



// One block of n <= 32 values: int8 codes, dx = amax / 127 and the codes' sum. NaNs are not handled.
template <typename T>
void quantize_block(const T* x, int n, int8_t* q, float* dx, int32_t* sum, int32_t* lo) {
  float amax = 0.f;
  for (int i = 0; i < n; ++i) amax = std::max(amax, std::fabs(static_cast<float>(x[i])));
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  int32_t s = 0, first = 0;
  for (int i = 0; i < n; ++i) {
    const float v = std::nearbyint(static_cast<float>(x[i]) * inv);  // |v| <= 127: no clamp needed
    q[i] = static_cast<int8_t>(v);
    s += static_cast<int32_t>(v);
    if (i < 16) first += static_cast<int32_t>(v);
  }
  *dx = amax / 127.f;
  *sum = s;
  *lo = first;
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

// The sum of 8 32-bit lanes (exact).
__attribute__((target("avx2,fma"))) inline int32_t lanes_sum(__m256i v) {
  __m128i t = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
  return _mm_cvtsi128_si32(t);
}

template <typename T>
__attribute__((target("avx2,fma"))) void quantize_block_avx2(const T* x, int8_t* q, float* dx, int32_t* sum,
                                                            int32_t* lo) {
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
  __m256i i[4];
  for (int j = 0; j < 4; ++j)
    i[j] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[j], inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                      _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  *dx = amax / 127.f;
  *lo = lanes_sum(_mm256_add_epi32(i[0], i[1]));
  *sum = *lo + lanes_sum(_mm256_add_epi32(i[2], i[3]));
}

// Block i (row i / blocks, block i % blocks) of x (rows, k); the reference path quantizes with the
// scalar code, the others with AVX2 (the same bits).
template <typename T>
void quantize_one(const T* x, int64_t k, int64_t i, bool vector, Acts& a) {
  const int64_t r = i / a.blocks, k0 = (i % a.blocks) * BLOCK, n = std::min(BLOCK, k - k0);
  int8_t* q = a.q.data() + i * BLOCK;
  if (vector && n == BLOCK) {
    quantize_block_avx2(x + r * k + k0, q, &a.d[i], &a.sum[i], &a.lo[i]);
  } else {
    std::memset(q, 0, BLOCK);
    quantize_block(x + r * k + k0, int(std::max<int64_t>(n, 0)), q, &a.d[i], &a.sum[i], &a.lo[i]);
  }
  a.s[i] = a.d[i] * static_cast<float>(a.sum[i]);
}

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

// The tile of `rows` rows (1..8) of this kind on this path: its family's file (q4.cpp, q8.cpp).
TileFn tile_fn(int64_t path, int64_t kind, int rows) {
  return nibbles(kind) ? q4_tile(path, kind, rows) : q8_tile(path, kind, rows);
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
  const int64_t bytes = code_bytes(w.kind) * a.blocks, words = scale_words(w.kind, a.blocks);
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t c0 = t * TILE, cols = std::min(TILE, w.n - c0);
    for (int64_t r0 = 0; r0 < a.rows; r0 += ROWS) {
      const int rs = int(std::min<int64_t>(ROWS, a.rows - r0));
      tile_fn(path, w.kind, rs)(w.packed + t * bytes, w.scales + t * words, a, r0, buf);
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
  lo.resize(rows * blocks);
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
  TORCH_CHECK(kind >= Q8_0 && kind <= Q6_K, "qgemm: kind must be 0 (Q8_0), 1 (Q4_1), 2 (Q4_K) or 3 (Q6_K)");
  TORCH_CHECK(qweight.dtype() == at::kByte && qweight.dim() == 3 && qweight.is_contiguous(),
              "qgemm: qweight must be contiguous uint8 (tiles, blocks, bytes)");
  const int64_t tiles_ = qweight.size(0), blocks = qweight.size(1);
  TORCH_CHECK(qweight.size(2) == code_bytes(kind), "qgemm: wrong bytes per tile and block");
  TORCH_CHECK((kind != Q4_K && kind != Q6_K) || blocks % SUPER == 0, "qgemm: K-quants need whole super-blocks");
  TORCH_CHECK(scales.scalar_type() == at::kShort && scales.is_contiguous() &&
                  scales.numel() == tiles_ * scale_words(kind, blocks),
              "qgemm: scales must be contiguous int16 words, scale_words of each tile");
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
