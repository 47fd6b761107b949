// The decoder layers of a Llama / Qwen2 / Qwen3 or Gemma 3 model in one call, so no Python runs between
// ops (llama.py's and gemma.py's `Layer` are the same computation, op by op, on torch; they stay the
// reference and run everything this file does not: dense or torch-quantized weights, other dtypes).
// Gemma 3 differs in a few ops, each a flag of the model or layer: its norms (1 + weight in float32,
// one rounding), a norm after the attention and after the MLP, gelu_tanh for SiLU, the embedding rows
// scaled, and sliding-window layers with a RoPE table and a mask of their own (`local`).
//
// Numerics: activations are bfloat16 between ops, as on torch; each op computes in float32 and rounds
// once (`rb`). Every row (a token of a batch row) is computed by the same sequence of operations
// whatever else is in the call, so a verify row equals a one-token step and a row does not depend on
// its batch, by construction:
//   - norms, RoPE, SiLU / gelu_tanh and residuals are row-local; a norm's sum of squares runs in 8 lanes with a
//     fixed final tree (`tree8`);
//   - the GEMMs are qgemm.cpp's (fixed order per output);
//   - attention, per query and head: scores in 8 lanes and `tree8`, the softmax's sum and the
//     weighted sum of values over the slots in order (see "attention" below); a masked
//     slot's weight is exactly 0 (`fexp` of a huge negative is 0), so masked or dead slots, and the
//     slots a causal query cannot see, leave the sums' bits alone;
//   - `fexp` is our own exp (Cody-Waite reduction and Cephes' expf polynomial), the same bits on every path.
// The scalar REFERENCE path and the AVX2 / AVX512 paths differ in their instructions (8 lanes at a
// time, the same operations per lane), not in their bits. The only fused multiply-adds are written
// out (std::fma in the reference), as the file is built with -ffp-contract=off.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <omp.h>
#include <vector>

#include "kernels.h"

namespace {

using bf16 = c10::BFloat16;

// Elementwise loops and sequential sums, compiled for AVX2 and for any x86-64 and picked at load time:
// each element's operations are the same in both, so the bits are too (no reassociation, no fused
// multiply-add: -ffp-contract=off).
#define FD_CLONES __attribute__((target_clones("avx2,fma", "default")))

inline float rb(float v) { return static_cast<float>(bf16(v)); }  // rounded to bf16, as a bf16 op gives it

// exp(x) in float32, the same bits everywhere (no libm, no fused multiply-add); 0 below -87.
inline float fexp(float x) {
  if (!(x > -87.f)) return 0.f;
  x = std::min(x, 88.f);
  const float n = (x * 1.44269504f + 12582912.f) - 12582912.f;  // round(x / ln 2)
  const float r = (x - n * 0.693359375f) - n * -2.12194440e-4f;  // x - n ln 2 in two parts
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = (p * r * r + r) + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return y * scale;
}

// fexp on 8 lanes with AVX2: the same operations, so the same bits, lane by lane.
__attribute__((target("avx2,fma"))) __m256 fexp8(__m256 x) {
  const __m256 valid = _mm256_cmp_ps(x, _mm256_set1_ps(-87.f), _CMP_GT_OQ);  // else 0 (NaN too)
  x = _mm256_min_ps(x, _mm256_set1_ps(88.f));
  const __m256 magic = _mm256_set1_ps(12582912.f);
  const __m256 n = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)), magic), magic);
  const __m256 r = _mm256_sub_ps(_mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(0.693359375f))),
                                 _mm256_mul_ps(n, _mm256_set1_ps(-2.12194440e-4f)));
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(5.0000001201e-1f));
  const __m256 y = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(_mm256_mul_ps(p, r), r), r), _mm256_set1_ps(1.f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(_mm256_mul_ps(y, _mm256_castsi256_ps(e)), valid);
}

// Rounded to bf16 and back (`rb` on 8 lanes), by kernels.h's `bf16_bits`.
__attribute__((target("avx2,fma"))) __m256 rb8(__m256 v) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits(v), 16));
}

__attribute__((target("avx2,fma"))) void store_bf16(bf16* y, __m256 v) {
  const __m256i b = bf16_bits(v);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(y),
                   _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1)));
}

struct Linear {
  at::Tensor packed, scales, bias;
  int64_t n, kind;
  Weights weights() const {
    return {packed.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(scales.data_ptr<int16_t>()), n, kind};
  }
};

// An RMSNorm's weight, in one of the two ways the families scale: Llama's bf16 weight `w` times the
// normed value rounded to bf16 (llama.py's rms_norm), or Gemma's 1 + weight in float32 `g`, normed and
// scaled in float32 and rounded once (gemma.py's). Neither: no norm.
struct Norm {
  const bf16* w = nullptr;
  const float* g = nullptr;
  explicit operator bool() const { return w || g; }
};

// The norm held in t: bf16 (Llama's weight), float32 (Gemma's 1 + weight), or none if empty.
Norm norm_of(const at::Tensor& t) {
  if (!t.defined() || !t.numel()) return {};
  return t.scalar_type() == at::kFloat ? Norm{nullptr, t.data_ptr<float>()} : Norm{t.data_ptr<bf16>(), nullptr};
}

struct Layer {
  at::Tensor norm1, norm2, qnorm, knorm;  // qnorm / knorm empty but for Qwen3 and Gemma 3
  Linear qkv, o, gate_up, down;
  at::Tensor post1, post2;  // Gemma 3: the norms of the attention's and the MLP's outputs (else empty)
  bool sliding = false;     // Gemma 3's sliding-window layers: the local RoPE table and the window's mask
  Norm n1, n2, qn, kn, p1, p2;  // the norms' weights, as `rms_norm` takes them
};

struct Model {
  int64_t heads, kv_heads, head_dim;
  double eps, scale;
  std::vector<Layer> layers;
  bool gemma = false;      // Gemma 3: post-norms, gelu_tanh, float32 norms, scaled embeddings
  float embed_scale = 1;   // Gemma 3: the embedding rows' factor (sqrt(hidden) in bf16)
};

std::vector<std::unique_ptr<Model>> models;  // a handle is an index here


// The fixed final order of 8 lane sums: ((0 + 4) + (2 + 6)) + ((1 + 5) + (3 + 7)).
inline float tree8(const float* a) { return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7])); }

// The sum of squares of n values in 8 lanes (lane l: elements l, l + 8, ... in order, each a fused
// multiply-add), then `tree8`. `vector`: the whole groups of 8 with AVX2, the same operations.
__attribute__((target("avx2,fma"))) int64_t sumsq_avx2(const bf16* x, int64_t n, float* lanes) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = load_bf16(x + i);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  _mm256_storeu_ps(lanes, acc);
  return i;
}

float sumsq(const bf16* x, int64_t n, bool vector) {
  float a[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = vector ? sumsq_avx2(x, n, a) : 0;
  for (; i < n; ++i) a[i % 8] = std::fma(static_cast<float>(x[i]), static_cast<float>(x[i]), a[i % 8]);
  return tree8(a);
}

// y = w * rb(x * inv), 8 at a time.
__attribute__((target("avx2,fma"))) int64_t scale_avx2(const bf16* x, const bf16* w, bf16* y, int64_t n, float inv) {
  const __m256 s = _mm256_set1_ps(inv);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    store_bf16(y + i, _mm256_mul_ps(load_bf16(w + i), rb8(_mm256_mul_ps(load_bf16(x + i), s))));
  return i;
}

// y = (x * inv) * g in float32, rounded once, 8 at a time (Gemma's norm).
__attribute__((target("avx2,fma"))) int64_t scale_f32_avx2(const bf16* x, const float* g, bf16* y, int64_t n,
                                                          float inv) {
  const __m256 s = _mm256_set1_ps(inv);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) store_bf16(y + i, _mm256_mul_ps(_mm256_mul_ps(load_bf16(x + i), s), _mm256_loadu_ps(g + i)));
  return i;
}

// y = norm(x) per row of `width` (x and y may be the same): the statistic in float32 (`sumsq`), then
// scaled as `Norm` says.
void rms_norm(const bf16* x, Norm w, bf16* y, int64_t rows, int64_t width, int64_t stride, double eps, bool vector) {
  for (int64_t r = 0; r < rows; ++r) {
    const bf16* xr = x + r * stride;
    bf16* yr = y + r * stride;
    const float inv = 1.f / std::sqrt(sumsq(xr, width, vector) / static_cast<float>(width) + static_cast<float>(eps));
    if (w.g) {
      int64_t i = vector ? scale_f32_avx2(xr, w.g, yr, width, inv) : 0;
      for (; i < width; ++i) yr[i] = bf16(static_cast<float>(xr[i]) * inv * w.g[i]);
      continue;
    }
    int64_t i = vector ? scale_avx2(xr, w.w, yr, width, inv) : 0;
    for (; i < width; ++i) yr[i] = bf16(static_cast<float>(w.w[i]) * rb(static_cast<float>(xr[i]) * inv));
  }
}

// RoPE on one head, 8 pairs at a time: x[i] = rb(x[i] cos[i]) + rb(x[i + half] sin[i]) and
// x[i + half] = rb(x[i + half] cos[i + half]) + rb(x[i] sin[i + half]).
__attribute__((target("avx2,fma"))) void rope_avx2(bf16* x, const bf16* cos, const bf16* sin, int64_t half) {
  for (int64_t i = 0; i < half; i += 8) {
    const __m256 a = load_bf16(x + i), b = load_bf16(x + half + i);
    store_bf16(x + i, _mm256_add_ps(rb8(_mm256_mul_ps(a, load_bf16(cos + i))),
                                    rb8(_mm256_mul_ps(b, load_bf16(sin + i)))));
    store_bf16(x + half + i, _mm256_add_ps(rb8(_mm256_mul_ps(b, load_bf16(cos + half + i))),
                                           rb8(_mm256_mul_ps(a, load_bf16(sin + half + i)))));
  }
}

// x * cos + roll(x, d / 2) * sin (sin's first half negated by the caller, as llama.py's tables are).
void rope(bf16* x, const bf16* cos, const bf16* sin, int64_t d, bool vector) {
  const int64_t half = d / 2;
  if (vector && half % 8 == 0) return rope_avx2(x, cos, sin, half);
  float t[512];
  for (int64_t i = 0; i < d; ++i) t[i] = static_cast<float>(x[i]);
  for (int64_t i = 0; i < d; ++i) {
    const float rolled = t[i < half ? i + half : i - half];
    x[i] = bf16(rb(t[i] * static_cast<float>(cos[i])) + rb(rolled * static_cast<float>(sin[i])));
  }
}

// bf16 to float (exact: a bf16 is a float's high half), 8 at a time where `vector` (GCC does not
// vectorize c10::BFloat16's conversion: this loop was 4.6% of a verify of 8 tokens).
__attribute__((target("avx2,fma"))) int64_t to_float_avx2(const bf16* x, float* y, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, load_bf16(x + i));
  return i;
}

void to_float(const bf16* x, float* y, int64_t n, bool vector) {
  for (int64_t i = vector ? to_float_avx2(x, y, n) : 0; i < n; ++i) y[i] = static_cast<float>(x[i]);
}

// ---- attention -----------------------------------------------------------------------------------
// Per query, head and slot, in this order on every path:
//   score = q . k in 8 lanes (lane l: elements l, l + 8, ... in order, fused multiply-adds), `tree8`,
//           times the scale, plus the mask;
//   p     = fexp(score - max), divided by the sum of the p's over the slots in order;
//   out   = per element, the sum over slots in order of fma(p, v); a zero p is skipped.
// The AVX2 code runs these operations lane by lane (it only transposes the scores' lane sums before
// adding them up, in the same tree), so each number has the reference's bits.

// 8 floats from float or bfloat16 values (a bf16's float is exact: the same bits either way).
__attribute__((target("avx2,fma"))) inline __m256 load8f(const float* x) { return _mm256_loadu_ps(x); }
__attribute__((target("avx2,fma"))) inline __m256 load8f(const bf16* x) { return load_bf16(x); }

// The dot products of q with 8 keys (k: 8 rows of d values, float or bf16) into out[0..8).
template <typename T>
__attribute__((target("avx2,fma"))) void dots8_avx2(const float* q, const T* k, int64_t d, float* out) {
  if (d < 8) __builtin_unreachable();  // head_dim >= 8 (llama_new): the sums stay in registers
  __m256 a[8];
#pragma GCC unroll 8
  for (int j = 0; j < 8; ++j) a[j] = _mm256_setzero_ps();
  for (int64_t c = 0; c < d; c += 8) {
    const __m256 qv = _mm256_loadu_ps(q + c);
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) a[j] = _mm256_fmadd_ps(qv, load8f(k + j * d + c), a[j]);
  }
  // tree8 of each key's lanes, 8 keys at once: (l0 + l4, l1 + l5, l2 + l6, l3 + l7), then the pairs
  // (l0 + l4) + (l2 + l6) and (l1 + l5) + (l3 + l7), then their sum.
  __m256 b[4];
  for (int j = 0; j < 4; ++j)
    b[j] = _mm256_add_ps(_mm256_permute2f128_ps(a[2 * j], a[2 * j + 1], 0x20),
                         _mm256_permute2f128_ps(a[2 * j], a[2 * j + 1], 0x31));
  const __m256 c01 = _mm256_add_ps(_mm256_shuffle_ps(b[0], b[1], 0x44), _mm256_shuffle_ps(b[0], b[1], 0xEE));
  const __m256 c23 = _mm256_add_ps(_mm256_shuffle_ps(b[2], b[3], 0x44), _mm256_shuffle_ps(b[2], b[3], 0xEE));
  const __m256 r = _mm256_add_ps(_mm256_shuffle_ps(c01, c23, 0x88), _mm256_shuffle_ps(c01, c23, 0xDD));
  // r holds keys 0, 2, 4, 6 | 1, 3, 5, 7
  _mm256_storeu_ps(out, _mm256_permutevar8x32_ps(r, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}

float dot_reference(const float* q, const float* k, int64_t d) {
  float a[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int64_t c = 0; c < d; c += 8)
    for (int l = 0; l < 8; ++l) a[l] = std::fma(q[c + l], k[c + l], a[l]);
  return tree8(a);
}

// s[j] = fexp(s[j] - top) for the whole groups of 8; returns how many it did.
__attribute__((target("avx2,fma"))) int64_t exp_avx2(float* s, int64_t n, float top) {
  const __m256 t = _mm256_set1_ps(top);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) _mm256_storeu_ps(s + j, fexp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), t)));
  return j;
}

// s[j] /= sum for the whole groups of 8; returns how many it did.
__attribute__((target("avx2,fma"))) int64_t divide_avx2(float* s, int64_t n, float sum) {
  const __m256 v = _mm256_set1_ps(sum);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) _mm256_storeu_ps(s + j, _mm256_div_ps(_mm256_loadu_ps(s + j), v));
  return j;
}

// s[j] = s[j] * scale (+ mask[j]) for the whole groups of 8 (two roundings, as the scalar loop); returns
// how many it did.
__attribute__((target("avx2,fma"))) int64_t scale_scores_avx2(float* s, const float* mask, int64_t n, float scale) {
  const __m256 f = _mm256_set1_ps(scale);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(s + j), f);
    _mm256_storeu_ps(s + j, mask ? _mm256_add_ps(v, _mm256_loadu_ps(mask + j)) : v);
  }
  return j;
}

// The largest of s[0..n) with `top` (as std::max in order: the maximum of numbers does not depend on
// their order, and a zero's sign cannot change fexp(s - top) below).
__attribute__((target("avx2,fma"))) float top_avx2(const float* s, int64_t n, float top) {
  __m256 m = _mm256_set1_ps(top);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) m = _mm256_max_ps(_mm256_loadu_ps(s + j), m);
  float lanes[8];
  _mm256_storeu_ps(lanes, m);
  for (float x : lanes) top = std::max(top, x);
  for (; j < n; ++j) top = std::max(top, s[j]);
  return top;
}

// A query's scores s[0..n) in place: times the scale, plus its mask (or none), then fexp(s - max), not
// yet divided by their sum (`softmax` sums them).
void exp_scores(float* s, int64_t n, const float* mask, float scale, bool vector) {
  int64_t j = vector ? scale_scores_avx2(s, mask, n, scale) : 0;
  for (; j < n; ++j) s[j] = mask ? s[j] * scale + mask[j] : s[j] * scale;
  float top = std::numeric_limits<float>::lowest();
  if (vector) {
    top = top_avx2(s, n, top);
  } else {
    for (j = 0; j < n; ++j) top = std::max(top, s[j]);
  }
  j = vector ? exp_avx2(s, n, top) : 0;
  for (; j < n; ++j) s[j] = fexp(s[j] - top);
}

// The softmax of n queries, query i's scores at s + i * stride over its len[i] slots. Each query's sum
// runs over its slots in order: a row's live slots sit at other places in a batch (left padding, dead
// drafts), and zeros added in between or after leave a sequential sum's bits alone, where lanes by slot
// index would not. The queries' sums run side by side (slot by slot, each over zeros past its own
// slots), so n chains of additions overlap instead of one waiting on the last.
void softmax(float* s, int n, int64_t stride, const int64_t* len, const float* const* mask, float scale,
             bool vector) {
  float sum[16];
  int64_t most = 0;
  for (int i = 0; i < n; ++i) {
    exp_scores(s + i * stride, len[i], mask[i], scale, vector);
    most = std::max(most, len[i]);
    sum[i] = 0.f;
  }
  for (int i = 0; i < n; ++i) std::fill(s + i * stride + len[i], s + i * stride + most, 0.f);
  for (int64_t j = 0; j < most; ++j)
    for (int i = 0; i < n; ++i) sum[i] = sum[i] + s[i * stride + j];
  for (int i = 0; i < n; ++i) {
    float* si = s + i * stride;
    int64_t j = vector ? divide_avx2(si, len[i], sum[i]) : 0;
    for (; j < len[i]; ++j) si[j] = si[j] / sum[i];
  }
}

// acc[c0..c0 + 8 NV) += p_j v_j for slots j0..j1 in order, as fused multiply-adds.
template <int NV, typename T>
__attribute__((target("avx2,fma"))) void weigh_avx2(const float* p, const T* v, int64_t j0, int64_t j1, int64_t d,
                                                   int64_t c0, float* acc) {
  __m256 a[NV];
  for (int i = 0; i < NV; ++i) a[i] = _mm256_loadu_ps(acc + c0 + 8 * i);
  for (int64_t j = j0; j < j1; ++j) {
    if (p[j] == 0.f) continue;  // a masked or dead slot: skipping it keeps the bits
    const __m256 pj = _mm256_set1_ps(p[j]);
    for (int i = 0; i < NV; ++i) a[i] = _mm256_fmadd_ps(pj, load8f(v + j * d + c0 + 8 * i), a[i]);
  }
  for (int i = 0; i < NV; ++i) _mm256_storeu_ps(acc + c0 + 8 * i, a[i]);
}

// acc += the weighted values of slots j0..j1, per element in slot order.
template <typename T>
void weigh(const float* p, const T* v, int64_t j0, int64_t j1, int64_t d, float* acc, bool vector) {
  if (vector) {
    for (int64_t c0 = 0; c0 < d; c0 += 64) {
      switch (std::min<int64_t>(8, (d - c0) / 8)) {
        case 1: weigh_avx2<1, T>(p, v, j0, j1, d, c0, acc); break;
        case 2: weigh_avx2<2, T>(p, v, j0, j1, d, c0, acc); break;
        case 3: weigh_avx2<3, T>(p, v, j0, j1, d, c0, acc); break;
        case 4: weigh_avx2<4, T>(p, v, j0, j1, d, c0, acc); break;
        case 5: weigh_avx2<5, T>(p, v, j0, j1, d, c0, acc); break;
        case 6: weigh_avx2<6, T>(p, v, j0, j1, d, c0, acc); break;
        case 7: weigh_avx2<7, T>(p, v, j0, j1, d, c0, acc); break;
        default: weigh_avx2<8, T>(p, v, j0, j1, d, c0, acc);
      }
    }
    return;
  }
  for (int64_t c = 0; c < d; ++c)
    for (int64_t j = j0; j < j1; ++j)
      if (p[j] != 0.f) acc[c] = std::fma(p[j], static_cast<float>(v[j * d + c]), acc[c]);
}

struct Scratch {  // a thread's, in float: the queries, a group of keys and of values, scores, outputs
  std::vector<float> q, k, v, s, acc;
};

// Whether a mask hides all of its n slots (lowest(): the masks' "not visible", torch.finfo.min). Such
// a slot's score is dot * scale + lowest() = lowest() whatever the dot (below half lowest()'s ulp), and
// its p is 0, so the vector path skips the dot products of such groups of slots (dead slots of rows
// that joined later or rejected drafts, up to a quarter of a batch's cache before a compaction): the
// bits stay the reference's, which computes them.
inline bool hidden(const float* mask, int64_t n) {
  for (int64_t u = 0; u < n; ++u)
    if (mask[u] != std::numeric_limits<float>::lowest()) return false;
  return true;
}

// Attention of n queries that share a kv head over its slots 0..kend: query i is q[i] (head_dim
// values), sees slot j where mask[i][j] adds 0 (no mask: j <= visible[i] < kend) and writes out[i].
// Each query's numbers do not depend on the others: they only share the slots' conversion to float.
// The slots go group by group (8 keys, then 16 values) over all the queries: a group is converted
// once into a buffer that stays in L1, read by every query, then the next group overwrites it.
// Converting every slot first wrote the whole head's keys and values out to L2 and back (the
// conversion alone was 4.6% of a verify of 8 tokens, `perf`).
void attend(const Model& m, const bf16* const* q, int n, const bf16* keys, const bf16* values, int64_t kend,
            const int64_t* visible, const float* const* mask, bf16* const* out, bool vector, Scratch& w) {
  const int64_t d = m.head_dim, k8 = (kend + 7) / 8 * 8;
  const float scale = static_cast<float>(m.scale);
  // Few queries read the cache's bf16 directly: converting each value as it is used costs less than
  // converting the slots first (`perf`, 2-core EPYC: the attention's share of a one-row step 9.6% ->
  // 7.1%, of a batch-8 step 22% -> 16%; at 6 queries, a verify of 4, even). The products are the same
  // either way. A last partial group of keys is converted and zero-padded, so no read passes slot kend.
  const bool direct = vector && n <= 3;
  w.q.resize(n * d);
  w.k.resize(8 * d);
  w.v.resize(16 * d);
  w.s.resize(n * k8);
  w.acc.assign(n * d, 0.f);
  int64_t len[16], most = 0;  // the slots each query may see, the most any does
  for (int i = 0; i < n; ++i) {
    len[i] = mask[i] ? kend : visible[i] + 1;
    most = std::max(most, len[i]);
    to_float(q[i], w.q.data() + i * d, d, vector);
  }
  for (int64_t j = 0; j < most; j += 8) {  // scores, 8 slots at a time
    const int64_t g = std::min<int64_t>(8, kend - j);
    bool live[16], any = false;  // query i sees one of these slots (its mask does not hide them all)
    for (int i = 0; i < n; ++i) {
      live[i] = j < len[i] && !(vector && mask[i] && hidden(mask[i] + j, std::min<int64_t>(8, len[i] - j)));
      if (j < len[i] && !live[i]) std::fill(w.s.data() + i * k8 + j, w.s.data() + i * k8 + j + 8, 0.f);
      any = any || live[i];
    }
    if (!any) continue;
    const bool read = direct && g == 8;  // from the cache itself
    if (!read) {
      to_float(keys + j * d, w.k.data(), g * d, vector);
      std::fill(w.k.begin() + g * d, w.k.end(), 0.f);
    }
    for (int i = 0; i < n; ++i) {
      float* s = w.s.data() + i * k8;
      if (!live[i]) continue;
      if (!vector) {
        for (int64_t u = j; u < std::min(len[i], j + 8); ++u)
          s[u] = dot_reference(w.q.data() + i * d, w.k.data() + (u - j) * d, d);
      } else if (read) {
        dots8_avx2(w.q.data() + i * d, keys + j * d, d, s + j);
      } else {
        dots8_avx2(w.q.data() + i * d, w.k.data(), d, s + j);
      }
    }
  }
  softmax(w.s.data(), n, k8, len, mask, scale, vector);
  for (int64_t j = 0; j < most; j += 16) {  // the weighted values, 16 slots at a time
    const int64_t g = std::min<int64_t>(16, kend - j);
    if (!direct) to_float(values + j * d, w.v.data(), g * d, vector);
    for (int i = 0; i < n; ++i) {
      if (j >= len[i]) continue;
      const int64_t j1 = std::min(len[i], j + 16);
      if (direct) {
        weigh(w.s.data() + i * k8 + j, values + j * d, 0, j1 - j, d, w.acc.data() + i * d, vector);
      } else {
        weigh(w.s.data() + i * k8 + j, w.v.data(), 0, j1 - j, d, w.acc.data() + i * d, vector);
      }
    }
  }
  for (int i = 0; i < n; ++i)
    for (int64_t c = 0; c < d; ++c) out[i][c] = bf16(w.acc[i * d + c]);
}

// x += y (a residual), in bf16.
FD_CLONES void add(bf16* x, const bf16* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] = bf16(static_cast<float>(x[i]) + static_cast<float>(y[i]));
}

// act(gate) * up, gate and up side by side in `gu` (as the fused projection gives them), for elements
// lo..hi of a row. Both activations have SiLU's form, a / (1 + exp(-u)) with our own exp: SiLU's u = a;
// Gemma's gelu_tanh(a) = 0.5 a (1 + tanh(z)), z = sqrt(2 / pi) (a + 0.044715 a^3), is u = 2 z. `vector`:
// 8 at a time with AVX2, the same operations.
template <bool GELU>
inline float gate_arg(float a) {
  return GELU ? (a * a * a * 0.044715f + a) * 1.5957691216f : a;  // 2 z
}

template <bool GELU>
__attribute__((target("avx2,fma"))) inline __m256 gate_arg8(__m256 a) {
  if (!GELU) return a;
  const __m256 cube = _mm256_mul_ps(_mm256_mul_ps(_mm256_mul_ps(a, a), a), _mm256_set1_ps(0.044715f));
  return _mm256_mul_ps(_mm256_add_ps(cube, a), _mm256_set1_ps(1.5957691216f));
}

template <bool GELU>
__attribute__((target("avx2,fma"))) int64_t gated_mul_avx2(const bf16* gu, bf16* out, int64_t n, int64_t lo,
                                                          int64_t hi) {
  int64_t i = lo;
  for (; i + 8 <= hi; i += 8) {
    const __m256 a = load_bf16(gu + i);
    const __m256 e = fexp8(_mm256_sub_ps(_mm256_setzero_ps(), gate_arg8<GELU>(a)));
    const __m256 act = rb8(_mm256_div_ps(a, _mm256_add_ps(_mm256_set1_ps(1.f), e)));
    store_bf16(out + i, _mm256_mul_ps(act, load_bf16(gu + n + i)));
  }
  return i;
}

template <bool GELU>
void gated_mul(const bf16* gu, bf16* out, int64_t n, int64_t lo, int64_t hi, bool vector) {
  int64_t i = vector ? gated_mul_avx2<GELU>(gu, out, n, lo, hi) : lo;
  for (; i < hi; ++i) {
    const float a = static_cast<float>(gu[i]);
    out[i] = bf16(rb(a / (1.f + fexp(-gate_arg<GELU>(a)))) * static_cast<float>(gu[n + i]));
  }
}

// ---- the layer, run by a team of threads ------------------------------------------------------------
// One OpenMP team runs the whole forward (`llama_forward`), so no thread is started per op: each op
// below is a worksharing loop over rows, heads, blocks or tiles, ending at the team's barrier. GEMM
// tiles and attention items go to whichever thread is free (one core may run slower than the other).
// Which thread computes a number never changes its operations.

// The activations and outputs of one forward, shared by the team.
struct Work {
  bf16 *x, *hx, *qkv, *att, *o, *gu, *act, *down;
  Acts hidden, heads, inter;  // the quantized inputs of qkv and gate_up, of o, of down
  const bf16 *cos, *sin;
  int64_t b, t, start, cap, path;
  const float* mask;
  bool causal = true;  // false: every query sees every slot up to its block's end (the DFlash draft)
  // A ragged forward (rows of different lengths) keeps only the live tokens, packed: activation row j
  // is token slot[j] of the (b, t) block, and token r is row packed[r] (-1: dead, not computed). Both
  // null: every token is live, j = r.
  const int64_t* slot = nullptr;
  const int64_t* packed = nullptr;
  int64_t live = 0;  // activation rows: b * t, or the live tokens
  // Gemma 3's sliding-window layers: their RoPE rows (the local table's) and their mask (the window's)
  const bf16 *lcos = nullptr, *lsin = nullptr;
  const float* lmask = nullptr;

  int64_t token(int64_t j) const { return slot ? slot[j] : j; }
  int64_t row(int64_t r) const { return packed ? packed[r] : r; }
};

// y = x W^T (+ bias) from x's quantized blocks `a`, a tile of 16 columns at a time, guided as
// qgemm.cpp's `all_tiles` (A/B on a 2-core EPYC: dynamic chunks of 2 made a verify of 4 rows 1.4x
// slower, static ones lost up to 10% at 8-16 rows).
void team_gemm(const Acts& a, const Linear& l, bf16* y, int64_t path) {
  const Weights w = l.weights();
  const bf16* bias = l.bias.numel() ? l.bias.data_ptr<bf16>() : nullptr;
#pragma omp for schedule(guided, 2)
  for (int64_t t = 0; t < (w.n + 15) / 16; ++t) gemm_tiles(a, w, path, t, t + 1, y, bias);
}

// y = the rows row(0), ..., row(n - 1) of x (width k) times l's weights: quantized into `a` (n rows),
// then `team_gemm` (a head over some of a forward's rows, the draft's fc over the raw context).
template <typename Row>
void rows_gemm(const bf16* x, int64_t k, int64_t n, Row row, Acts& a, const Linear& l, bf16* y, int64_t path) {
#pragma omp for
  for (int64_t i = 0; i < n * a.blocks; ++i) {
    const int64_t r = i / a.blocks;
    quantize_act(x + (row(r) - r) * k, k, i, path, a);  // quantize_act reads row r of its x
  }
  team_gemm(a, l, y, path);
}

// Row r of x (width k) into `a`'s blocks.
void quantize_row(const bf16* x, int64_t k, int64_t r, Acts& a, int64_t path) {
  for (int64_t g = 0; g < a.blocks; ++g) quantize_act(x, k, r * a.blocks + g, path, a);
}

// A layer's cache: keys and values (b, kv_heads, capacity, head_dim).
struct Cache {
  bf16 *k, *v;
};

// The attention of every query: items (row, kv head, a chunk of the queries that read it: its heads'
// queries at each token, up to 16, so a chunk converts the slots once for many queries). Each query's
// output head is quantized for the output projection where it is made (`heads`' blocks of 32 hold no
// two heads' values when head_dim is a multiple of 32; else a loop after the attention does it).
void team_attention(const Model& m, Work& w, Cache cache, const float* mask, Scratch& scratch) {
  const int64_t h = m.heads, kvh = m.kv_heads, d = m.head_dim, width = (h + 2 * kvh) * d, t = w.t;
  const int64_t end = w.start + t, group = h / kvh, nq = group * t, threads = omp_get_num_threads();
  const int64_t want = std::min(nq, std::max((nq + 15) / 16, (2 * threads + w.b * kvh - 1) / (w.b * kvh)));
  const int64_t chunk = (nq + want - 1) / want, chunks = (nq + chunk - 1) / chunk;
#pragma omp for schedule(dynamic, 1)
  for (int64_t item = 0; item < w.b * kvh * chunks; ++item) {
    const bf16* qs[16];
    bf16* outs[16];
    const float* masks[16];
    int64_t visible[16];
    const int64_t row = item / (kvh * chunks), g = (item / chunks) % kvh, c0 = (item % chunks) * chunk;
    int n = 0;
    for (int64_t k = c0; k < std::min(nq, c0 + chunk); ++k) {  // query k: token k / group, head
      const int64_t tok = k / group, head = g * group + k % group, r = row * t + tok, j = w.row(r);
      if (j < 0) continue;  // a dead token of a ragged forward
      qs[n] = w.qkv + j * width + head * d;
      outs[n] = w.att + j * h * d + head * d;
      masks[n] = mask ? mask + r * end : nullptr;
      visible[n++] = w.causal ? w.start + tok : w.start + t - 1;
    }
    if (!n) continue;
    const int64_t base = (row * kvh + g) * w.cap * d, kend = mask ? end : visible[n - 1] + 1;
    attend(m, qs, n, cache.k + base, cache.v + base, kend, visible, masks, outs, w.path != REFERENCE, scratch);
    if (d % 32) continue;
    for (int i = 0; i < n; ++i) {  // query i's head: blocks (out - att) / 32 .. of the heads' activations
      const int64_t first = (outs[i] - w.att) / 32;
      for (int64_t blk = first; blk < first + d / 32; ++blk) quantize_act(w.att, h * d, blk, w.path, w.heads);
    }
  }
  if (d % 32) {
#pragma omp for
    for (int64_t r = 0; r < w.live; ++r) quantize_row(w.att, h * d, r, w.heads, w.path);
  }
}

// What the last op of a layer (the MLP's residual, row by row) also does for the row: copy it out (a
// wanted layer's output) and norm and quantize it for the next layer's first GEMM, so that no barrier
// separates the layers.
struct Next {
  bf16* copy = nullptr;         // a wanted layer's output: the features (b * t, stride), at the row's token
  Norm norm;                    // the next layer's norm1, the model's final norm, or none
  Acts* acts = nullptr;         // where the normed rows are quantized (none after the final norm)
  bf16* normed = nullptr;       // where the normed rows are copied too (the final norm's, a feature)
  int64_t stride = 0;           // the features' row width
};

// Row r of w.x: normed by `norm` into w.hx and quantized into `acts` (if any).
void norm_row(const Model& m, Work& w, Norm norm, Acts* acts, int64_t r, int64_t hidden) {
  rms_norm(w.x + r * hidden, norm, w.hx + r * hidden, 1, hidden, hidden, m.eps, w.path != REFERENCE);
  if (acts) quantize_row(w.hx, hidden, r, *acts, w.path);
}

void output_team(const Model& m, const Layer& L, Work& w, int64_t hidden, const Next& next);

// One layer over w.x (rows = b * t, hidden), in place, its rows already normed and quantized into
// w.hidden (by the previous layer's `Next`); every thread of the team calls it.
void layer_team(const Model& m, const Layer& L, Work& w, Cache cache, int64_t hidden, const Next& next,
                Scratch& scratch) {
  const int64_t rows = w.live, h = m.heads, kvh = m.kv_heads, d = m.head_dim, width = (h + 2 * kvh) * d;
  const int64_t path = w.path;
  const bool vector = path != REFERENCE;
  team_gemm(w.hidden, L.qkv, w.qkv, path);  // (rows, (h + 2 kvh) d)
#pragma omp for
  for (int64_t i = 0; i < rows * (h + kvh); ++i) {  // q and k heads: Qwen3's norms, RoPE; keys, values cached
    const int64_t j = i / (h + kvh), head = i % (h + kvh), r = w.token(j);
    bf16* v = w.qkv + j * width + head * d;
    if (L.qn) rms_norm(v, head < h ? L.qn : L.kn, v, 1, d, d, m.eps, vector);
    rope(v, (L.sliding ? w.lcos : w.cos) + r * d, (L.sliding ? w.lsin : w.sin) + r * d, d, vector);
    if (head >= h) {  // (row, kv head, slot)
      const int64_t at_ = ((r / w.t * kvh + head - h) * w.cap + w.start + r % w.t) * d;
      std::memcpy(cache.k + at_, v, d * sizeof(bf16));
      std::memcpy(cache.v + at_, v + kvh * d, d * sizeof(bf16));
    }
  }
  team_attention(m, w, cache, L.sliding ? w.lmask : w.mask, scratch);
  output_team(m, L, w, hidden, next);
}

// After the attention (its output quantized): the output projection and residual, the norm, the MLP
// and its residual, over the rows of w.x, and `next`'s work for each row.
void output_team(const Model& m, const Layer& L, Work& w, int64_t hidden, const Next& next) {
  const int64_t rows = w.live, inter = L.gate_up.n / 2, path = w.path;
  const bool vector = path != REFERENCE;
  team_gemm(w.heads, L.o, w.o, path);
#pragma omp for
  for (int64_t r = 0; r < rows; ++r) {
    if (L.p1) rms_norm(w.o + r * hidden, L.p1, w.o + r * hidden, 1, hidden, hidden, m.eps, vector);  // Gemma 3
    add(w.x + r * hidden, w.o + r * hidden, hidden);
    norm_row(m, w, L.n2, &w.hidden, r, hidden);
  }
  team_gemm(w.hidden, L.gate_up, w.gu, path);  // (rows, 2 inter): gate, then up
#pragma omp for
  for (int64_t i = 0; i < rows * w.inter.blocks; ++i) {  // SiLU(gate) * up (Gemma: gelu), a block of 32 at a time
    const int64_t r = i / w.inter.blocks, lo = (i % w.inter.blocks) * 32, hi = std::min(inter, lo + 32);
    (m.gemma ? gated_mul<true> : gated_mul<false>)(w.gu + r * 2 * inter, w.act + r * inter, inter, lo, hi, vector);
    quantize_act(w.act, inter, i, path, w.inter);
  }
  team_gemm(w.inter, L.down, w.down, path);
#pragma omp for
  for (int64_t r = 0; r < rows; ++r) {
    if (L.p2) rms_norm(w.down + r * hidden, L.p2, w.down + r * hidden, 1, hidden, hidden, m.eps, vector);
    add(w.x + r * hidden, w.down + r * hidden, hidden);
    if (next.copy) std::memcpy(next.copy + w.token(r) * next.stride, w.x + r * hidden, hidden * sizeof(bf16));
    if (next.norm) norm_row(m, w, next.norm, next.acts, r, hidden);
    if (next.normed) std::memcpy(next.normed + w.token(r) * next.stride, w.hx + r * hidden, hidden * sizeof(bf16));
  }
}

// One layer of a DFlash draft (models/draft.py's `Layer`): a Qwen3 layer whose keys and values come from
// [context ; norm1(block)]. The context rows are the target's features as the draft's fc and norm made
// them, the same at every layer, so the caller quantizes them once into `kv`'s rows after the block's.
// Their keys and values go to the cache before the block's (slots w.start - c ..), and the block's
// queries see every slot up to the block's end (w.causal false, or the mask).
// The block's rows arrive normed and quantized into `kv` (by the previous layer's `Next`).
void draft_layer_team(const Model& m, const Layer& L, Work& w, Cache cache, Acts& kv, int64_t c, const bf16* ccos,
                      const bf16* csin, int64_t hidden, const Next& next, Scratch& scratch) {
  const int64_t rows = w.b * w.t, h = m.heads, kvh = m.kv_heads, d = m.head_dim, width = (h + 2 * kvh) * d;
  const bool vector = w.path != REFERENCE;
  team_gemm(kv, L.qkv, w.qkv, w.path);  // (rows + b c, (h + 2 kvh) d): the block's rows, then the context's
  const int64_t block_items = rows * (h + kvh), items = block_items + w.b * c * kvh;
#pragma omp for
  for (int64_t i = 0; i < items; ++i) {  // the block's q and k heads, the context's k heads; keys, values cached
    const bool context = i >= block_items;
    const int64_t r = context ? rows + (i - block_items) / kvh : i / (h + kvh);
    const int64_t head = context ? h + (i - block_items) % kvh : i % (h + kvh), j = context ? r - rows : r;
    bf16* v = w.qkv + r * width + head * d;
    rms_norm(v, head < h ? L.qn : L.kn, v, 1, d, d, m.eps, vector);
    rope(v, (context ? ccos : w.cos) + j * d, (context ? csin : w.sin) + j * d, d, vector);
    if (head >= h) {  // (row, kv head, slot)
      const int64_t row = context ? j / c : j / w.t, slot = context ? w.start - c + j % c : w.start + j % w.t;
      const int64_t at_ = ((row * kvh + head - h) * w.cap + slot) * d;
      std::memcpy(cache.k + at_, v, d * sizeof(bf16));
      std::memcpy(cache.v + at_, v + kvh * d, d * sizeof(bf16));
    }
  }
  team_attention(m, w, cache, w.mask, scratch);
  output_team(m, L, w, hidden, next);
}

// A forward's final norm, or none (checked: contiguous, of the hidden width, bf16 or, for Gemma 3, float32).
Norm final_norm(const c10::optional<at::Tensor>& norm, int64_t hidden, bool gemma, const char* who) {
  if (!norm || !norm->defined()) return {};
  TORCH_CHECK(norm->scalar_type() == (gemma ? at::kFloat : at::kBFloat16) && norm->is_contiguous() &&
                  norm->numel() == hidden,
              who, ": the final norm must be contiguous ", gemma ? "float32" : "bf16", " (hidden)");
  return norm_of(*norm);
}

const Model& model(int64_t handle) {
  TORCH_CHECK(handle >= 0 && handle < int64_t(models.size()) && models[handle], "llama: no model ", handle);
  return *models[handle];
}

// The rows of `table` (n, width) at `index` (any shape, int64), side by side: (index.numel(), width).
// The forward's lookups (token embeddings, RoPE tables) done here, not as torch ops before the call: in
// the engine's loop each torch op runs after the weights swept the caches (the embedding and the two
// tables' lookups took 0.14 ms of a plain step there, 0.03 ms warm).
// An index outside the table: an error, or, where not `strict`, an undefined tensor.
at::Tensor rows_of(const at::Tensor& table, const at::Tensor& index, const char* who, bool strict = true) {
  TORCH_CHECK(table.dim() == 2 && table.is_contiguous() && index.scalar_type() == at::kLong, who,
              ": a lookup needs a contiguous (n, width) table and int64 indices");
  const at::Tensor idx = index.contiguous();
  const int64_t n = idx.numel(), width = table.size(1), bytes = width * table.element_size();
  at::Tensor out = at::empty({n, width}, table.options());
  const int64_t* ix = idx.data_ptr<int64_t>();
  const char* from = static_cast<const char*>(table.data_ptr());
  char* to = static_cast<char*>(out.data_ptr());
  for (int64_t i = 0; i < n; ++i) {
    if (!strict && (ix[i] < 0 || ix[i] >= table.size(0))) return at::Tensor();
    TORCH_CHECK(ix[i] >= 0 && ix[i] < table.size(0), who, ": index ", ix[i], " is outside the table's ", table.size(0),
                " rows");
    std::memcpy(to + i * bytes, from + ix[i] * bytes, bytes);
  }
  return out;
}

// A forward's input rows: x as given (bf16 (b, t, hidden)), or, with `embed` (vocab, hidden), the
// embeddings of the token ids x (b, t).
at::Tensor inputs(const at::Tensor& x, const c10::optional<at::Tensor>& embed, const char* who) {
  if (!embed || !embed->defined()) return x;
  TORCH_CHECK(x.dim() == 2, who, ": token ids must be (b, t)");
  return rows_of(*embed, x, who).view({x.size(0), x.size(1), embed->size(1)});
}

// RoPE rows: `table` as given ((b, t, 1, head_dim) or (b, t, head_dim)), or, with `positions` (b, t), the
// rows of a whole table (n, head_dim) at those positions; undefined where a position is not in the table
// (the forward then returns nothing, having written nothing: the caller grows its table and calls again,
// which spares every call the torch ops that would find the positions' range first).
at::Tensor rope_rows(const at::Tensor& table, const c10::optional<at::Tensor>& positions, const char* who) {
  return positions && positions->defined() ? rows_of(table, *positions, who, false) : table.contiguous();
}

}  // namespace

namespace {

// A layer from its 16 tensors and 8 shapes (see `llama_new`), checked: norms in `norm_type`, biases bf16.
Layer make_layer(const at::Tensor* t, const int64_t* s, at::ScalarType norm_type, const char* who) {
  for (int i = 0; i < 16; ++i) {
    const bool norm = i < 4, bias = i >= 4 && (i - 4) % 3 == 2;
    TORCH_CHECK(!(norm || bias) || !t[i].numel() ||
                    (t[i].scalar_type() == (norm ? norm_type : at::kBFloat16) && t[i].is_contiguous()),
                who, ": norms must be contiguous ", norm_type, ", biases contiguous bf16");
  }
  Layer L{t[0], t[1], t[2], t[3], {t[4], t[5], t[6], s[0], s[1]}, {t[7], t[8], t[9], s[2], s[3]},
          {t[10], t[11], t[12], s[4], s[5]}, {t[13], t[14], t[15], s[6], s[7]}};
  L.n1 = norm_of(L.norm1), L.n2 = norm_of(L.norm2), L.qn = norm_of(L.qnorm), L.kn = norm_of(L.knorm);
  return L;
}

int64_t add_model(std::unique_ptr<Model> m) {
  TORCH_CHECK(m->head_dim % 8 == 0 && m->head_dim <= 512, "llama_new: head_dim must be a multiple of 8, at most 512");
  models.push_back(std::move(m));
  return int64_t(models.size()) - 1;
}

}  // namespace

// A model from its tensors, 16 a layer: norm1, norm2, q_norm, k_norm (empty if none), then for qkv,
// o, gate_up and down: packed, scales, bias (empty if none); `shapes` 8 a layer: (n, kind) of each.
int64_t llama_new(const std::vector<at::Tensor>& tensors, const std::vector<int64_t>& shapes, int64_t heads,
                  int64_t kv_heads, int64_t head_dim, double eps, double scale) {
  TORCH_CHECK(tensors.size() % 16 == 0 && shapes.size() == tensors.size() / 2, "llama_new: 16 tensors a layer");
  auto m = std::make_unique<Model>(Model{heads, kv_heads, head_dim, eps, scale, {}});
  for (size_t i = 0; i < tensors.size(); i += 16)
    m->layers.push_back(make_layer(&tensors[i], &shapes[i / 2], at::kBFloat16, "llama_new"));
  return add_model(std::move(m));
}

// A Gemma 3 model (the same handle as `llama_new`'s, run by `llama_forward`): 18 tensors a layer, the 16
// of `llama_new` with Gemma's norms (input, pre-MLP, q and k: 1 + weight in float32), then the norms after
// the attention and after the MLP (float32); `sliding` a flag a layer (a sliding-window layer: the
// forward's local RoPE rows and mask); the embedding rows' factor.
int64_t gemma_new(const std::vector<at::Tensor>& tensors, const std::vector<int64_t>& shapes,
                  const std::vector<int64_t>& sliding, int64_t heads, int64_t kv_heads, int64_t head_dim, double eps,
                  double scale, double embed_scale) {
  const size_t n = sliding.size();
  TORCH_CHECK(tensors.size() == 18 * n && shapes.size() == 8 * n, "gemma_new: 18 tensors and 8 shapes a layer");
  auto m = std::make_unique<Model>(Model{heads, kv_heads, head_dim, eps, scale, {}, true, float(embed_scale)});
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor* t = &tensors[18 * i];
    Layer L = make_layer(t, &shapes[8 * i], at::kFloat, "gemma_new");
    TORCH_CHECK(L.qnorm.numel() && t[16].scalar_type() == at::kFloat && t[17].scalar_type() == at::kFloat &&
                    t[16].is_contiguous() && t[17].is_contiguous(),
                "gemma_new: q, k and post norms must be contiguous float32");
    L.post1 = t[16], L.post2 = t[17], L.p1 = norm_of(L.post1), L.p2 = norm_of(L.post2), L.sliding = sliding[i];
    m->layers.push_back(std::move(L));
  }
  return add_model(std::move(m));
}

void llama_free(int64_t handle) {
  if (handle >= 0 && handle < int64_t(models.size())) models[handle].reset();
}

// The layers over x (b, t, hidden) bf16 with RoPE tables cos / sin (b, t, 1, head_dim), writing the
// new keys and values at slots start.. of each layer's cache (b, kv_heads, capacity, head_dim);
// `mask` (b, 1, t, start + t) additive float32, or none for causal order. `lengths` (b) int64, or none:
// row i's first lengths[i] tokens are computed, the rest are dead (a verify of chains or trees of
// different sizes: the rows' padding costs nothing; their outputs are zeros, their cache slots are not
// written). Returns the last layer's output, normed by `norm` (the model's final norm, bf16 (hidden),
// the layers' eps) where given, then, if `wanted` names layers, their outputs side by side in its order,
// (b, t, len(wanted) * hidden): the features a DFlash draft reads, where the last layer's is its normed
// output if `norm` is given (as transformers' last hidden state). (The final norm and the features'
// concatenation here rather than in torch: torch.rms_norm on one row took 0.1 ms, 2% of a step, and
// the features of a prompt were copied twice.) With `embed` (vocab, hidden), x is token ids (b, t) and
// the layers run over their embeddings; with `positions` (b, t), cos and sin are whole tables (n,
// head_dim) and each token takes the row of its position (`rows_of`). With `head` (packed, scales,
// bias or empty; `head_shape` its outputs, kind and how many of each row's last tokens), not ragged and
// with `norm`: last, the logits of those tokens (b, keep, outputs) from the normed output, the bits the
// same head gives on `qgemm` (one torch op fewer a step, and no thread team started for it alone).
std::vector<at::Tensor> llama_forward(int64_t handle, const at::Tensor& input, const at::Tensor& cos,
                                      const at::Tensor& sin, const std::vector<at::Tensor>& keys,
                                      const std::vector<at::Tensor>& values, int64_t start,
                                      const c10::optional<at::Tensor>& mask, const c10::optional<at::Tensor>& lengths,
                                      const std::vector<int64_t>& wanted, int64_t path,
                                      const c10::optional<at::Tensor>& norm, const c10::optional<at::Tensor>& embed,
                                      const c10::optional<at::Tensor>& positions, const std::vector<at::Tensor>& head,
                                      const std::vector<int64_t>& head_shape, const std::vector<at::Tensor>& local) {
  const Model& m = model(handle);
  const at::Tensor x = inputs(input, embed, "llama_forward");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 3, "llama_forward: x must be bf16 (b, t, hidden)");
  const Norm final = final_norm(norm, x.size(2), m.gemma, "llama_forward");
  const bool normed = bool(final);
  TORCH_CHECK(keys.size() == m.layers.size() && values.size() == m.layers.size(), "llama_forward: a cache a layer");
  const int64_t b = x.size(0), t = x.size(1);
  if (path == AUTO) path = best_path();
  std::vector<int64_t> slot, packed;  // a ragged forward's maps (see `Work`)
  if (lengths && lengths->defined()) {
    TORCH_CHECK(lengths->scalar_type() == at::kLong && lengths->numel() == b, "llama_forward: lengths must be int64 (b)");
    const at::Tensor n = lengths->contiguous();
    packed.assign(b * t, -1);
    for (int64_t i = 0; i < b; ++i) {
      TORCH_CHECK(n.data_ptr<int64_t>()[i] >= 1 && n.data_ptr<int64_t>()[i] <= t, "llama_forward: lengths must be 1..t");
      for (int64_t tok = 0; tok < n.data_ptr<int64_t>()[i]; ++tok) {
        packed[i * t + tok] = int64_t(slot.size());
        slot.push_back(i * t + tok);
      }
    }
  }
  const bool ragged = !slot.empty();
  const at::Tensor index = ragged ? at::tensor(slot, at::kLong) : at::Tensor();
  TORCH_CHECK(head.empty() || (head.size() == 3 && head_shape.size() == 3 && !ragged && normed &&
                               head_shape[2] >= 1 && head_shape[2] <= t && head[0].dim() == 3 &&
                               head[0].size(0) * 16 >= head_shape[0] && head[0].size(1) * 32 >= x.size(2) &&
                               head[0].size(2) == code_bytes(head_shape[1])),
              "llama_forward: a head is (packed, scales, bias), its shape (outputs, kind, keep <= t), with the "
              "final norm and no lengths");
  const Linear hl{head.empty() ? at::Tensor() : head[0], head.empty() ? at::Tensor() : head[1],
                  head.empty() ? at::Tensor() : head[2], head.empty() ? 0 : head_shape[0],
                  head.empty() ? 0 : head_shape[1]};
  const int64_t keep = head.empty() ? 0 : head_shape[2];
  at::Tensor h = x.reshape({b * t, x.size(2)});
  h = ragged ? h.index_select(0, index) : h.clone();
  if (m.gemma && embed && embed->defined()) {  // Gemma 3's embedding rows times sqrt(hidden), in bf16
    bf16* e = h.data_ptr<bf16>();
    for (int64_t i = 0; i < h.numel(); ++i) e[i] = bf16(static_cast<float>(e[i]) * m.embed_scale);
  }
  const bool windows = std::any_of(m.layers.begin(), m.layers.end(), [](const Layer& L) { return L.sliding; });
  TORCH_CHECK(local.size() == (windows ? 3 : 0) && (!windows || local[2].defined()),
              "llama_forward: sliding-window layers need `local` (cos, sin, mask), other models none");
  at::Tensor c = rope_rows(cos, positions, "llama_forward"), s = rope_rows(sin, positions, "llama_forward"), lc, ls;
  if (windows) lc = rope_rows(local[0], positions, "llama_forward"), ls = rope_rows(local[1], positions, "llama_forward");
  if (!c.defined() || !s.defined() || (windows && (!lc.defined() || !ls.defined())))
    return {};  // a position past the table (see `rope_rows`)
  TORCH_CHECK(c.numel() == b * t * m.head_dim && s.numel() == c.numel() && (!windows || (lc.numel() == c.numel() &&
                                                                                          ls.numel() == c.numel())),
              "llama_forward: RoPE tables of (b, t, head_dim)");
  auto float_mask = [&](const at::Tensor& given) {
    const at::Tensor f = given.to(at::kFloat).contiguous();
    TORCH_CHECK(f.numel() == b * t * (start + t), "llama_forward: a mask must be (b, 1, t, start + t)");
    return f;
  };
  const at::Tensor mk = mask && mask->defined() ? float_mask(*mask) : at::Tensor();
  const at::Tensor lmk = windows ? float_mask(local[2]) : at::Tensor();
  const int64_t rows = h.size(0), hidden = x.size(2), n = int64_t(m.layers.size());
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(keys[i].is_contiguous() && values[i].is_contiguous() && keys[i].size(0) == b &&
                    keys[i].size(2) >= start + t && keys[i].scalar_type() == at::kBFloat16,
                "llama_forward: layer ", i, "'s cache has no room (or is not bf16)");
  const Layer& L0 = m.layers[0];
  const int64_t inter = L0.gate_up.n / 2, qkv = L0.qkv.n, heads = m.heads * m.head_dim;
  auto buffer = [&](int64_t width) { return at::empty({rows, width}, x.options()); };
  const at::Tensor hx = buffer(hidden), qv = buffer(qkv), att = buffer(heads), o = buffer(hidden),
                   gu = buffer(2 * inter), act = buffer(inter), down = buffer(hidden);
  Work w{h.data_ptr<bf16>(), hx.data_ptr<bf16>(), qv.data_ptr<bf16>(), att.data_ptr<bf16>(), o.data_ptr<bf16>(),
         gu.data_ptr<bf16>(), act.data_ptr<bf16>(), down.data_ptr<bf16>(), {}, {}, {},
         c.data_ptr<bf16>(), s.data_ptr<bf16>(), b, t, start, keys[0].size(2), path,
         mk.defined() ? mk.data_ptr<float>() : nullptr};
  w.live = rows;
  if (windows) w.lcos = lc.data_ptr<bf16>(), w.lsin = ls.data_ptr<bf16>(), w.lmask = lmk.data_ptr<float>();
  if (ragged) w.slot = slot.data(), w.packed = packed.data();
  w.hidden.resize(rows, hidden);
  w.heads.resize(rows, heads);
  w.inter.resize(rows, inter);
  const int64_t k = int64_t(wanted.size()), stride = k * hidden;
  std::vector<at::Tensor> out(1);
  if (k) out.push_back(ragged ? at::zeros({b, t, stride}, x.options()) : at::empty({b, t, stride}, x.options()));
  std::vector<bf16*> copies(n, nullptr);  // where the wanted layers' outputs go
  bf16* final_copy = nullptr;             // where the normed output goes, if it is wanted
  for (int64_t j = 0; j < k; ++j) {
    const int64_t i = wanted[j];
    TORCH_CHECK(i >= 0 && i < n, "llama_forward: no layer ", i);
    bf16*& to = i == n - 1 && normed ? final_copy : copies[i];
    TORCH_CHECK(!to, "llama_forward: layer ", i, " is wanted twice");
    to = out[1].data_ptr<bf16>() + j * hidden;
  }
  std::vector<Cache> caches;
  for (int64_t i = 0; i < n; ++i) caches.push_back({keys[i].data_ptr<bf16>(), values[i].data_ptr<bf16>()});
  Acts ha;  // the rows the head reads, quantized
  if (keep) ha.resize(b * keep, hidden);
  const at::Tensor logits = keep ? at::empty({b, keep, hl.n}, x.options()) : at::Tensor();
#pragma omp parallel num_threads(at::get_num_threads())
  {
    Scratch scratch;
#pragma omp for
    for (int64_t r = 0; r < rows; ++r) norm_row(m, w, m.layers[0].n1, &w.hidden, r, hidden);
    for (int64_t i = 0; i < n; ++i) {
      const bool last = i + 1 == n;
      const Next next{copies[i],
                      last ? final : m.layers[i + 1].n1,
                      last ? nullptr : &w.hidden, last ? final_copy : nullptr, stride};
      layer_team(m, m.layers[i], w, caches[i], hidden, next, scratch);
    }
    if (keep)  // the head over each row's last `keep` normed tokens
      rows_gemm(hx.data_ptr<bf16>(), hidden, b * keep, [&](int64_t r) { return r / keep * t + t - keep + r % keep; },
                ha, hl, logits.data_ptr<bf16>(), path);
  }
  const at::Tensor& y = normed ? hx : h;
  out[0] = ragged ? at::zeros_like(x).view({b * t, hidden}).index_copy_(0, index, y).view(x.sizes()) : y.view(x.sizes());
  if (keep) out.push_back(logits);
  return out;
}

// A DFlash draft's layers (registered by `llama_new`: the same weights as a Qwen3 layer) over its block
// x (b, t, hidden) bf16 and the new context ctx (b, c, hidden) (after its fc and norm), with RoPE tables
// cos / sin (b, t, head_dim) and ccos / csin (b, c, head_dim). Writes the context's and the block's keys
// and values at slots start.. of each layer's cache (b, kv_heads, capacity, head_dim); `mask` (b, 1, t,
// start + c + t) additive float32, or none: every slot seen. Returns the last layer's output, normed by
// `norm` (the draft's final norm, bf16 (hidden), its layers' eps) where given (torch's norm of a block took
// 0.1 ms of a 2 ms draft call in the engine's loop), then, where `head` is given, the logits of the
// block's rows after its first (b, t - 1, n) from those normed rows.
// `fc` (packed, scales, the hidden norm's weight; `kinds` [0] its kind): ctx is the target's raw features
// (b, c, fc inputs), and the draft's fc and hidden norm run here (torch's were 0.15-0.2 ms of a draft
// call in the engine's loop, where every op runs with caches the target's weights have just swept).
// `head` (packed, scales; `kinds` [1], [2] its outputs and kind): the draft vocabulary's head rows;
// with a third tensor, their token ids (int64 (outputs)): also each position's greedy choice (b, t - 1),
// the id of its logits' first maximum.
// `embed`, `positions` as `llama_forward`'s (the block's ids and positions), `cpositions` the context's.
std::vector<at::Tensor> draft_forward(int64_t handle, const at::Tensor& input, const at::Tensor& ctx,
                                      const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& ccos,
                                      const at::Tensor& csin, const std::vector<at::Tensor>& keys,
                                      const std::vector<at::Tensor>& values, int64_t start,
                                      const c10::optional<at::Tensor>& mask, int64_t path,
                                      const c10::optional<at::Tensor>& norm, const std::vector<at::Tensor>& fc,
                                      const std::vector<at::Tensor>& head, const std::vector<int64_t>& kinds,
                                      const c10::optional<at::Tensor>& embed, const c10::optional<at::Tensor>& positions,
                                      const c10::optional<at::Tensor>& cpositions) {
  const Model& m = model(handle);
  const at::Tensor x = inputs(input, embed, "draft_forward");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 3, "draft_forward: x must be bf16 (b, t, hidden)");
  const Norm final = final_norm(norm, x.size(2), m.gemma, "draft_forward");
  const bool normed = bool(final);
  const int64_t b = x.size(0), t = x.size(1), c = ctx.size(1), hidden = x.size(2), rows = b * t, n = m.layers.size();
  TORCH_CHECK((fc.empty() || fc.size() == 3) && (head.empty() || head.size() == 2 || head.size() == 3) &&
                  kinds.size() == 3,
              "draft_forward: fc is (packed, scales, norm), head (packed, scales[, ids]), kinds 3 ints");
  TORCH_CHECK(head.size() < 3 || (head[2].scalar_type() == at::kLong && head[2].numel() == kinds[1]),
              "draft_forward: the head's ids must be int64, one per output");
  TORCH_CHECK(head.empty() || (normed && t > 1), "draft_forward: a head needs the final norm and a block past its anchor");
  const Linear fcl{fc.empty() ? at::Tensor() : fc[0], fc.empty() ? at::Tensor() : fc[1], at::Tensor(), hidden, kinds[0]};
  const Linear hl{head.empty() ? at::Tensor() : head[0], head.empty() ? at::Tensor() : head[1], at::Tensor(), kinds[1],
                  kinds[2]};
  TORCH_CHECK(ctx.scalar_type() == at::kBFloat16 && ctx.dim() == 3 && ctx.size(0) == b &&
                  (fc.empty() ? ctx.size(2) == hidden : ctx.size(2) <= fc[0].size(1) * 32),
              "draft_forward: ctx must be bf16 (b, c, hidden), or (b, c, fc's inputs) with fc");
  TORCH_CHECK(fc.empty() || (fc[2].scalar_type() == at::kBFloat16 && fc[2].is_contiguous() && fc[2].numel() == hidden),
              "draft_forward: the hidden norm must be contiguous bf16 (hidden)");
  for (const Linear* l : {&fcl, &hl})
    TORCH_CHECK(!l->packed.defined() || (l->packed.dim() == 3 && l->packed.size(0) * 16 >= l->n &&
                                         l->packed.size(2) == code_bytes(l->kind)),
                "draft_forward: fc or head packed weights do not match their outputs and kind");
  TORCH_CHECK(head.empty() || head[0].size(1) * 32 >= hidden, "draft_forward: the head's inputs must be the hidden size");
  TORCH_CHECK(keys.size() == m.layers.size() && values.size() == m.layers.size(), "draft_forward: a cache a layer");
  TORCH_CHECK(m.layers[0].qnorm.numel(), "draft_forward: a DFlash draft's layers have q and k norms");
  const int64_t end = start + c + t;
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(keys[i].is_contiguous() && values[i].is_contiguous() && keys[i].size(0) == b &&
                    keys[i].size(2) >= end && keys[i].scalar_type() == at::kBFloat16,
                "draft_forward: layer ", i, "'s cache has no room (or is not bf16)");
  at::Tensor mk;
  if (mask && mask->defined()) {
    mk = mask->to(at::kFloat).contiguous();
    TORCH_CHECK(mk.numel() == b * t * end, "draft_forward: the mask must be (b, 1, t, start + c + t)");
  }
  if (path == AUTO) path = best_path();
  const Layer& L0 = m.layers[0];
  const int64_t inter = L0.gate_up.n / 2, heads = m.heads * m.head_dim;
  auto buffer = [&](int64_t r, int64_t width) { return at::empty({r, width}, x.options()); };
  at::Tensor h = x.reshape({rows, hidden}).clone(), kx = buffer(rows + b * c, hidden);
  const at::Tensor raw = ctx.reshape({b * c, ctx.size(2)}).contiguous();
  if (fc.empty()) kx.narrow(0, rows, b * c).copy_(raw);
  Acts fca;  // the raw context, quantized for fc
  if (!fc.empty()) fca.resize(b * c, raw.size(1));
  at::Tensor fco = fc.empty() ? at::Tensor() : buffer(b * c, hidden);  // fc's output, before the hidden norm
  Acts ha;  // the block's normed rows after the first, quantized for the head
  if (!head.empty()) ha.resize(b * (t - 1), hidden);
  at::Tensor logits = head.empty() ? at::Tensor() : at::empty({b, t - 1, kinds[1]}, x.options());
  const at::Tensor hx = buffer(rows, hidden), qv = buffer(rows + b * c, L0.qkv.n), att = buffer(rows, heads),
                   o = buffer(rows, hidden), gu = buffer(rows, 2 * inter), act = buffer(rows, inter),
                   down = buffer(rows, hidden);
  const at::Tensor c1 = rope_rows(cos, positions, "draft_forward"), s1 = rope_rows(sin, positions, "draft_forward"),
                   c2 = rope_rows(ccos, cpositions, "draft_forward"), s2 = rope_rows(csin, cpositions, "draft_forward");
  if (!c1.defined() || !s1.defined() || !c2.defined() || !s2.defined()) return {};  // see `rope_rows`
  TORCH_CHECK(c1.numel() == rows * m.head_dim && s1.numel() == c1.numel() && c2.numel() == b * c * m.head_dim &&
                  s2.numel() == c2.numel(),
              "draft_forward: RoPE tables of (b, t, head_dim) and (b, c, head_dim)");
  Work w{h.data_ptr<bf16>(), hx.data_ptr<bf16>(), qv.data_ptr<bf16>(), att.data_ptr<bf16>(), o.data_ptr<bf16>(),
         gu.data_ptr<bf16>(), act.data_ptr<bf16>(), down.data_ptr<bf16>(), {}, {}, {},
         c1.data_ptr<bf16>(), s1.data_ptr<bf16>(), b, t, start + c, keys[0].size(2), path,
         mk.defined() ? mk.data_ptr<float>() : nullptr, false};
  w.live = rows;
  w.hidden.resize(rows, hidden);
  w.heads.resize(rows, heads);
  w.inter.resize(rows, inter);
  Acts kv;
  kv.resize(rows + b * c, hidden);
  std::vector<Cache> caches;
  for (int64_t i = 0; i < n; ++i) caches.push_back({keys[i].data_ptr<bf16>(), values[i].data_ptr<bf16>()});
#pragma omp parallel num_threads(at::get_num_threads())
  {
    Scratch scratch;
    if (!fc.empty()) {  // the context through fc and the hidden norm into kx's rows after the block's
      rows_gemm(raw.data_ptr<bf16>(), raw.size(1), b * c, [](int64_t r) { return r; }, fca, fcl, fco.data_ptr<bf16>(),
                path);
#pragma omp for
      for (int64_t r = 0; r < b * c; ++r)
        rms_norm(fco.data_ptr<bf16>() + r * hidden, norm_of(fc[2]), kx.data_ptr<bf16>() + (rows + r) * hidden, 1,
                 hidden, hidden, m.eps, path != REFERENCE);
    }
#pragma omp for nowait
    for (int64_t i = rows * kv.blocks; i < (rows + b * c) * kv.blocks; ++i)  // the context, once for all layers
      quantize_act(kx.data_ptr<bf16>(), hidden, i, path, kv);
#pragma omp for
    for (int64_t r = 0; r < rows; ++r) norm_row(m, w, m.layers[0].n1, &kv, r, hidden);
    for (int64_t i = 0; i < n; ++i) {
      const bool last = i + 1 == n;
      const Next next{nullptr,
                      last ? final : m.layers[i + 1].n1,
                      last ? nullptr : &kv};
      draft_layer_team(m, m.layers[i], w, caches[i], kv, c, c2.data_ptr<bf16>(), s2.data_ptr<bf16>(), hidden, next,
                       scratch);
    }
    if (!head.empty())  // the head over the normed rows 1..t - 1 of each row of the batch (not its anchor)
      rows_gemm(hx.data_ptr<bf16>(), hidden, b * (t - 1), [&](int64_t r) { return r / (t - 1) * t + r % (t - 1) + 1; },
                ha, hl, logits.data_ptr<bf16>(), path);
  }
  std::vector<at::Tensor> out{(normed ? hx : h).view(x.sizes())};
  if (!head.empty()) out.push_back(logits);
  if (head.size() == 3) out.push_back(head[2].index_select(0, argmax_rows(logits, path).view(-1)).view({b, t - 1}));
  return out;
}

// After a tree verify: in every layer's keys and values (b, kv_heads, capacity, head_dim), row r's slots
// start.. take its slots start + order[r][j] (b, n), in place: the accepted path moved to the block's
// front. One call for all layers; as torch ops it was a gather and a copy per layer and tensor (about 360
// ops a step, each with the caches the weights had swept). The same bytes as `_gather_block`.
void reorder_slots(const std::vector<at::Tensor>& keys, const std::vector<at::Tensor>& values, int64_t start,
                   const at::Tensor& order) {
  TORCH_CHECK(order.scalar_type() == at::kLong && order.dim() == 2, "reorder_slots: order must be int64 (b, n)");
  const at::Tensor o = order.contiguous();
  const int64_t b = o.size(0), n = o.size(1);
  const int64_t* ix = o.data_ptr<int64_t>();
  std::vector<char> tmp;
  for (const auto* list : {&keys, &values})
    for (const at::Tensor& t : *list) {
      TORCH_CHECK(t.dim() == 4 && t.is_contiguous() && t.size(0) == b, "reorder_slots: a cache buffer must be "
                  "contiguous (b, kv_heads, capacity, head_dim)");
      const int64_t heads = t.size(1), cap = t.size(2), row = t.size(3) * t.element_size();
      for (int64_t i = 0; i < b * n; ++i)
        TORCH_CHECK(ix[i] >= 0 && start + ix[i] < cap && start + n <= cap, "reorder_slots: a slot past the buffer");
      tmp.resize(n * row);
      char* base = static_cast<char*>(t.data_ptr());
      for (int64_t r = 0; r < b; ++r)
        for (int64_t h = 0; h < heads; ++h) {
          char* slots = base + ((r * heads + h) * cap + start) * row;
          for (int64_t j = 0; j < n; ++j) std::memcpy(tmp.data() + j * row, slots + ix[r * n + j] * row, row);
          std::memcpy(slots, tmp.data(), n * row);
        }
    }
}

// The MLP's gate: silu(gate) * up, or with `gelu` gelu_tanh(gate) * up, of gu (rows, 2 n) bf16 (gate, then
// up), on `path`, as the layers compute it (for the tests, which compare the paths and torch's ops).
at::Tensor gated(const at::Tensor& gu, bool gelu, int64_t path) {
  TORCH_CHECK(gu.scalar_type() == at::kBFloat16 && gu.dim() == 2 && gu.size(1) % 2 == 0,
              "gated: gu must be bf16 (rows, 2 n)");
  if (path == AUTO) path = best_path();
  const at::Tensor x = gu.contiguous();
  const int64_t rows = x.size(0), n = x.size(1) / 2;
  at::Tensor out = at::empty({rows, n}, x.options());
  for (int64_t r = 0; r < rows; ++r)
    (gelu ? gated_mul<true> : gated_mul<false>)(x.data_ptr<bf16>() + r * 2 * n, out.data_ptr<bf16>() + r * n, n, 0, n, path != REFERENCE);
  return out;
}

TORCH_LIBRARY_FRAGMENT(flashdraft, m) {
  m.def("llama_new(Tensor[] tensors, int[] shapes, int heads, int kv_heads, int head_dim, float eps, float scale) -> int",
        &llama_new);
  m.def("llama_free(int handle) -> ()", &llama_free);
  m.def("gated(Tensor gu, bool gelu, int path) -> Tensor", &gated);
  m.def("reorder_slots(Tensor[] keys, Tensor[] values, int start, Tensor order) -> ()", &reorder_slots);
  m.def("llama_forward(int handle, Tensor x, Tensor cos, Tensor sin, Tensor[] keys, Tensor[] values, int start, "
        "Tensor? mask, Tensor? lengths, int[] wanted, int path, Tensor? norm, Tensor? embed, "
        "Tensor? positions, Tensor[] head, int[] head_shape, Tensor[] local) -> Tensor[]",
        &llama_forward);
  m.def("gemma_new(Tensor[] tensors, int[] shapes, int[] sliding, int heads, int kv_heads, int head_dim, float eps, "
        "float scale, float embed_scale) -> int",
        &gemma_new);
  m.def("draft_forward(int handle, Tensor x, Tensor ctx, Tensor cos, Tensor sin, Tensor ccos, Tensor csin, "
        "Tensor[] keys, Tensor[] values, int start, Tensor? mask, int path, Tensor? norm, Tensor[] fc, "
        "Tensor[] head, int[] kinds, Tensor? embed=None, Tensor? positions=None, Tensor? cpositions=None) -> Tensor[]",
        &draft_forward);
}
