// The decoder layers of a Llama / Qwen2 / Qwen3 model in one call, so no Python runs between ops
// (llama.py's `Layer` is the same computation, op by op, on torch; it stays the reference and runs
// everything this file does not: dense or torch-quantized weights, other dtypes, Gemma 3).
//
// Numerics: activations are bfloat16 between ops, as on torch; each op computes in float32 and rounds
// once (`rb`). Every row (a token of a batch row) is computed by the same sequence of operations
// whatever else is in the call, so a verify row equals a one-token step and a row does not depend on
// its batch, by construction:
//   - norms, RoPE, SiLU and residuals are row-local, their sums sequential;
//   - the GEMMs are qgemm.cpp's (fixed order per output);
//   - attention, per query and head: scores are dot products over head_dim in 8 lanes with a fixed
//     final reduction (`dot8`), the softmax's max and sum and the weighted sum of values run over the
//     slots in order; a masked slot's weight is exactly 0 (`fexp` of a huge negative is 0), so masked
//     or dead slots leave the sums' bits alone.
//   - `fexp` is our own exp (Cody-Waite reduction and Cephes' expf polynomial), the same bits on every path.
// The scalar REFERENCE path and the AVX2 / AVX512 paths differ in the instructions of `dot8`, of the
// softmax's exps and of SiLU (8 lanes at a time, the same operations per lane), not in their bits.

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

__attribute__((target("avx2,fma"))) __m256 load_bf16(const bf16* x) {
  const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(h, 16));
}

__attribute__((target("avx2,fma"))) void store_bf16(bf16* y, __m256 v) {
  const __m256i b = bf16_bits(v);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(y),
                   _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1)));
}

// q . k over d (a multiple of 8): 8 lane sums, sequential, then ((0+4)+(2+6)) + ((1+5)+(3+7)).
float dot8_reference(const float* q, const float* k, int64_t d) {
  float a[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int64_t c = 0; c < d; c += 8)
    for (int l = 0; l < 8; ++l) a[l] = a[l] + q[c + l] * k[c + l];
  return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
}

// The same sums for n queries against one key, with AVX2: the n chains run side by side.
__attribute__((target("avx2,fma"))) void dot8_avx2(const float* const* q, int n, const float* k, int64_t d,
                                                  float* out) {
  for (int i = 0; i < n; ++i) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t c = 0; c < d; c += 8)
      acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_loadu_ps(q[i] + c), _mm256_loadu_ps(k + c)));
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    out[i] = _mm_cvtss_f32(s);
  }
}

struct Linear {
  at::Tensor packed, scales, bias;
  int64_t n, kind;
};

struct Layer {
  at::Tensor norm1, norm2, qnorm, knorm;  // qnorm / knorm empty but for Qwen3
  Linear qkv, o, gate_up, down;
};

struct Model {
  int64_t heads, kv_heads, head_dim;
  double eps, scale;
  std::vector<Layer> layers;
};

std::vector<std::unique_ptr<Model>> models;  // a handle is an index here

at::Tensor linear(const Linear& l, const at::Tensor& x, int64_t path) {
  at::Tensor y = qgemm(x, l.packed, l.scales, l.n, l.kind, path);
  return l.bias.numel() ? y.add_(l.bias) : y;  // bf16 add, as the torch layer's `y + bias`
}

// y = w * norm(x) per row of `width` (x and y may be the same), as llama.py's rms_norm: the statistic
// in float32, the normed value rounded to bf16, then times the weight.
FD_CLONES void rms_norm(const bf16* x, const bf16* w, bf16* y, int64_t rows, int64_t width, int64_t stride, double eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const bf16* xr = x + r * stride;
    bf16* yr = y + r * stride;
    float ss = 0.f;
    for (int64_t i = 0; i < width; ++i) ss = ss + static_cast<float>(xr[i]) * static_cast<float>(xr[i]);
    const float inv = 1.f / std::sqrt(ss / static_cast<float>(width) + static_cast<float>(eps));
    for (int64_t i = 0; i < width; ++i) yr[i] = bf16(static_cast<float>(w[i]) * rb(static_cast<float>(xr[i]) * inv));
  }
}

// x * cos + roll(x, d / 2) * sin (sin's first half negated by the caller, as llama.py's tables are).
FD_CLONES void rope(bf16* x, const bf16* cos, const bf16* sin, int64_t d) {
  float t[512];
  for (int64_t i = 0; i < d; ++i) t[i] = static_cast<float>(x[i]);
  for (int64_t i = 0; i < d; ++i) {
    const float rolled = t[(i + d / 2) % d];
    x[i] = bf16(rb(t[i] * static_cast<float>(cos[i])) + rb(rolled * static_cast<float>(sin[i])));
  }
}

// s[j] = fexp(s[j] - top) for the whole groups of 8; returns how many it did.
__attribute__((target("avx2,fma"))) int64_t exp_avx2(float* s, int64_t n, float top) {
  const __m256 t = _mm256_set1_ps(top);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) _mm256_storeu_ps(s + j, fexp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), t)));
  return j;
}

FD_CLONES void to_float(const bf16* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = static_cast<float>(x[i]);
}

// A query's softmax over its scores in place: the max (exact in any order), exps, the sum over slots
// in order, and the quotients. `vector`: the exps on 8 lanes (the same bits as `fexp`).
void softmax(float* s, int64_t n, bool vector) {
  float top = std::numeric_limits<float>::lowest(), sum = 0.f;
  for (int64_t j = 0; j < n; ++j) top = std::max(top, s[j]);
  int64_t j = 0;
  if (vector) j = exp_avx2(s, n, top);
  for (; j < n; ++j) s[j] = fexp(s[j] - top);
  for (j = 0; j < n; ++j) sum = sum + s[j];
  for (j = 0; j < n; ++j) s[j] = s[j] / sum;
}

// out = sum over slots in order of p_j v_j, per element of head_dim; a zero weight adds nothing.
FD_CLONES void weigh(const float* p, const bf16* values, int64_t n, int64_t d, bf16* out) {
  float acc[512] = {0};
  for (int64_t j = 0; j < n; ++j) {
    if (p[j] == 0.f) continue;  // a masked or dead slot: skipping it keeps the bits
    const bf16* v = values + j * d;
    for (int64_t i = 0; i < d; ++i) acc[i] = acc[i] + p[j] * static_cast<float>(v[i]);
  }
  for (int64_t i = 0; i < d; ++i) out[i] = bf16(acc[i]);
}

// Attention of n queries that share a kv head over its slots 0..end: query i is q[i] (head_dim
// values), sees slot j where mask[i][j] adds 0 (no mask: j <= visible[i]) and writes out[i]. Each
// query's numbers do not depend on the others: they only share the keys' conversion to float.
void attend(const Model& m, const bf16* const* q, int n, const bf16* keys, const bf16* values, int64_t end,
            const int64_t* visible, const float* const* mask, bf16* const* out, int64_t path) {
  const int64_t d = m.head_dim;
  const float scale = static_cast<float>(m.scale), lowest = std::numeric_limits<float>::lowest();
  std::vector<float> qf(n * d), kf(d), s(n * end), dots(n);
  std::vector<const float*> qs(n);
  for (int i = 0; i < n; ++i) {
    to_float(q[i], qf.data() + i * d, d);
    qs[i] = qf.data() + i * d;
  }
  for (int64_t j = 0; j < end; ++j) {
    to_float(keys + j * d, kf.data(), d);
    if (path == REFERENCE)
      for (int i = 0; i < n; ++i) dots[i] = dot8_reference(qs[i], kf.data(), d);
    else
      dot8_avx2(qs.data(), n, kf.data(), d, dots.data());
    for (int i = 0; i < n; ++i)
      s[i * end + j] = mask[i] ? dots[i] * scale + mask[i][j] : (j <= visible[i] ? dots[i] * scale : lowest);
  }
  for (int i = 0; i < n; ++i) {
    softmax(s.data() + i * end, end, path != REFERENCE);
    weigh(s.data() + i * end, values, end, d, out[i]);
  }
}

// x += y (a residual), in bf16.
FD_CLONES void add(bf16* x, const bf16* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] = bf16(static_cast<float>(x[i]) + static_cast<float>(y[i]));
}

// silu(gate) * up, gate and up side by side in `gu` (as the fused projection gives them), for
// elements lo..hi of a row; `vector`: 8 at a time with AVX2, the same operations.
__attribute__((target("avx2,fma"))) int64_t silu_mul_avx2(const bf16* gu, bf16* out, int64_t n, int64_t lo,
                                                         int64_t hi) {
  int64_t i = lo;
  for (; i + 8 <= hi; i += 8) {
    const __m256 a = load_bf16(gu + i);
    const __m256 e = fexp8(_mm256_sub_ps(_mm256_setzero_ps(), a));
    const __m256 silu = rb8(_mm256_div_ps(a, _mm256_add_ps(_mm256_set1_ps(1.f), e)));
    store_bf16(out + i, _mm256_mul_ps(silu, load_bf16(gu + n + i)));
  }
  return i;
}

void silu_mul(const bf16* gu, bf16* out, int64_t n, int64_t lo, int64_t hi, bool vector) {
  int64_t i = vector ? silu_mul_avx2(gu, out, n, lo, hi) : lo;
  for (; i < hi; ++i) {
    const float a = static_cast<float>(gu[i]);
    out[i] = bf16(rb(a / (1.f + fexp(-a))) * static_cast<float>(gu[n + i]));
  }
}

// One layer over x (rows = b * t, hidden), in place.
void layer_forward(const Model& m, const Layer& L, at::Tensor& x, int64_t b, int64_t t, const bf16* cos,
                   const bf16* sin, const at::Tensor& kc, const at::Tensor& vc, int64_t start, const float* mask,
                   int64_t path) {
  const int64_t rows = b * t, hidden = x.size(1), h = m.heads, kvh = m.kv_heads, d = m.head_dim;
  const int64_t end = start + t, cap = kc.size(2);
  at::Tensor hx = at::empty_like(x);
  rms_norm(x.data_ptr<bf16>(), L.norm1.data_ptr<bf16>(), hx.data_ptr<bf16>(), rows, hidden, hidden, m.eps);
  at::Tensor qkv = linear(L.qkv, hx, path);  // (rows, (h + 2 kvh) d)
  bf16* p = qkv.data_ptr<bf16>();
  const int64_t width = (h + 2 * kvh) * d;
  if (L.qnorm.numel()) {  // Qwen3: every head of q and k normed before RoPE
    for (int64_t r = 0; r < rows; ++r) {
      rms_norm(p + r * width, L.qnorm.data_ptr<bf16>(), p + r * width, h, d, d, m.eps);
      rms_norm(p + r * width + h * d, L.knorm.data_ptr<bf16>(), p + r * width + h * d, kvh, d, d, m.eps);
    }
  }
  bf16* kp = kc.data_ptr<bf16>();
  bf16* vp = vc.data_ptr<bf16>();
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t row = r / t, slot = start + r % t;
    for (int64_t i = 0; i < h + kvh; ++i) rope(p + r * width + i * d, cos + r * d, sin + r * d, d);
    for (int64_t g = 0; g < kvh; ++g) {  // the new key and value into the cache (row, kv head, slot)
      const int64_t at_ = ((row * kvh + g) * cap + slot) * d;
      std::memcpy(kp + at_, p + r * width + (h + g) * d, d * sizeof(bf16));
      std::memcpy(vp + at_, p + r * width + (h + kvh + g) * d, d * sizeof(bf16));
    }
  }
  at::Tensor att = at::empty({rows, h * d}, x.options());
  bf16* ap = att.data_ptr<bf16>();
  // Work items: (row, kv head, a chunk of the queries that read it: its heads' queries at each token).
  const int64_t group = h / kvh, nq = group * t, chunk = nq <= 4 ? 2 : 4, chunks = (nq + chunk - 1) / chunk;
  at::parallel_for(0, b * kvh * chunks, 1, [&](int64_t lo, int64_t hi) {
    const bf16* qs[8];
    bf16* outs[8];
    const float* masks[8];
    int64_t visible[8];
    for (int64_t item = lo; item < hi; ++item) {
      const int64_t row = item / (kvh * chunks), g = (item / chunks) % kvh, c0 = (item % chunks) * chunk;
      int n = 0;
      for (int64_t k = c0; k < std::min(nq, c0 + chunk); ++k, ++n) {  // query k: token k / group, head
        const int64_t tok = k / group, head = g * group + k % group, r = row * t + tok;
        qs[n] = p + r * width + head * d;
        outs[n] = ap + r * h * d + head * d;
        masks[n] = mask ? mask + r * end : nullptr;
        visible[n] = start + tok;
      }
      const int64_t base = (row * kvh + g) * cap * d;
      attend(m, qs, n, kp + base, vp + base, end, visible, masks, outs, path);
    }
  });
  at::Tensor o = linear(L.o, att, path);
  bf16* xp = x.data_ptr<bf16>();
  const bf16* op = o.data_ptr<bf16>();
  add(xp, op, rows * hidden);
  rms_norm(xp, L.norm2.data_ptr<bf16>(), hx.data_ptr<bf16>(), rows, hidden, hidden, m.eps);
  at::Tensor gu = linear(L.gate_up, hx, path);  // (rows, 2 inter): gate, then up
  const int64_t inter = gu.size(1) / 2;
  at::Tensor act = at::empty({rows, inter}, x.options());
  const bf16* gp = gu.data_ptr<bf16>();
  bf16* actp = act.data_ptr<bf16>();
  at::parallel_for(0, rows * inter, 256, [&](int64_t lo, int64_t hi) {  // elementwise: any split
    for (int64_t r = lo / inter; r * inter < hi; ++r)
      silu_mul(gp + r * 2 * inter, actp + r * inter, inter, std::max(lo - r * inter, int64_t(0)),
               std::min(hi - r * inter, inter), path != REFERENCE);
  });
  at::Tensor down = linear(L.down, act, path);
  const bf16* dp = down.data_ptr<bf16>();
  add(xp, dp, rows * hidden);
}

const Model& model(int64_t handle) {
  TORCH_CHECK(handle >= 0 && handle < int64_t(models.size()) && models[handle], "llama: no model ", handle);
  return *models[handle];
}

}  // namespace

// A model from its tensors, 16 a layer: norm1, norm2, q_norm, k_norm (empty if none), then for qkv,
// o, gate_up and down: packed, scales, bias (empty if none); `shapes` 8 a layer: (n, kind) of each.
int64_t llama_new(const std::vector<at::Tensor>& tensors, const std::vector<int64_t>& shapes, int64_t heads,
                  int64_t kv_heads, int64_t head_dim, double eps, double scale) {
  TORCH_CHECK(tensors.size() % 16 == 0 && shapes.size() == tensors.size() / 2, "llama_new: 16 tensors a layer");
  TORCH_CHECK(head_dim % 8 == 0 && head_dim <= 512, "llama_new: head_dim must be a multiple of 8, at most 512");
  auto m = std::make_unique<Model>(Model{heads, kv_heads, head_dim, eps, scale, {}});
  for (size_t i = 0; i < tensors.size(); i += 16) {
    const auto* t = &tensors[i];
    const auto* s = &shapes[i / 2];
    Layer L{t[0], t[1], t[2], t[3], {t[4], t[5], t[6], s[0], s[1]}, {t[7], t[8], t[9], s[2], s[3]},
            {t[10], t[11], t[12], s[4], s[5]}, {t[13], t[14], t[15], s[6], s[7]}};
    m->layers.push_back(std::move(L));
  }
  models.push_back(std::move(m));
  return int64_t(models.size()) - 1;
}

void llama_free(int64_t handle) {
  if (handle >= 0 && handle < int64_t(models.size())) models[handle].reset();
}

// The layers over x (b, t, hidden) bf16 with RoPE tables cos / sin (b, t, 1, head_dim), writing the
// new keys and values at slots start.. of each layer's cache (b, kv_heads, capacity, head_dim);
// `mask` (b, 1, t, start + t) additive float32, or none for causal order. Returns the last layer's
// output, then the outputs of the layers in `wanted`.
std::vector<at::Tensor> llama_forward(int64_t handle, const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                                      const std::vector<at::Tensor>& keys, const std::vector<at::Tensor>& values,
                                      int64_t start, const c10::optional<at::Tensor>& mask,
                                      const std::vector<int64_t>& wanted, int64_t path) {
  const Model& m = model(handle);
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 3, "llama_forward: x must be bf16 (b, t, hidden)");
  TORCH_CHECK(keys.size() == m.layers.size() && values.size() == m.layers.size(), "llama_forward: a cache a layer");
  const int64_t b = x.size(0), t = x.size(1);
  if (path == AUTO) path = best_path();
  at::Tensor h = x.reshape({b * t, x.size(2)}).clone();
  const at::Tensor c = cos.contiguous(), s = sin.contiguous();
  at::Tensor mk;
  if (mask && mask->defined()) {
    mk = mask->to(at::kFloat).contiguous();
    TORCH_CHECK(mk.numel() == b * t * (start + t), "llama_forward: the mask must be (b, 1, t, start + t)");
  }
  std::vector<at::Tensor> out(1);
  for (size_t i = 0; i < m.layers.size(); ++i) {
    TORCH_CHECK(keys[i].is_contiguous() && keys[i].size(0) == b && keys[i].size(2) >= start + t,
                "llama_forward: layer ", i, "'s cache has no room");
    layer_forward(m, m.layers[i], h, b, t, c.data_ptr<bf16>(), s.data_ptr<bf16>(), keys[i], values[i], start,
                  mk.defined() ? mk.data_ptr<float>() : nullptr, path);
    if (std::find(wanted.begin(), wanted.end(), int64_t(i)) != wanted.end()) out.push_back(h.view(x.sizes()).clone());
  }
  out[0] = h.view(x.sizes());
  return out;
}

TORCH_LIBRARY_FRAGMENT(flashdraft, m) {
  m.def("llama_new(Tensor[] tensors, int[] shapes, int heads, int kv_heads, int head_dim, float eps, float scale) -> int",
        &llama_new);
  m.def("llama_free(int handle) -> ()", &llama_free);
  m.def("llama_forward(int handle, Tensor x, Tensor cos, Tensor sin, Tensor[] keys, Tensor[] values, int start, "
        "Tensor? mask, int[] wanted, int path) -> Tensor[]",
        &llama_forward);
}
