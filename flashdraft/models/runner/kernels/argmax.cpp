// The greedy choice over a vocabulary: each row's argmax of bf16 logits, as torch.argmax(-1) gives it
// (the first of equal maxima; a NaN counts as the maximum, the first NaN wins).
//
// Why our own: a greedy step cast its 49k bf16 logits to float32 and ran torch's argmax, 0.11 ms of a
// 5 ms one-token step (its bf16 argmax is slower still). Here: one pass for the maximum, one for its
// first index, 8 lanes at a time. A maximum is the same number in any order, and a bf16's float is
// exact, so the index is the reference's.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include "kernels.h"

#include <cmath>
#include <cstdint>

namespace {

using bf16 = c10::BFloat16;

// The reference: one value at a time.
int64_t argmax_reference(const bf16* x, int64_t n) {
  int64_t best = 0;
  float top = static_cast<float>(x[0]);
  if (std::isnan(top)) return 0;
  for (int64_t i = 1; i < n; ++i) {
    const float v = static_cast<float>(x[i]);
    if (std::isnan(v)) return i;
    if (v > top) top = v, best = i;
  }
  return best;
}

// The maximum (lanes, then the tail), then the first slot holding it; a NaN anywhere: the reference.
__attribute__((target("avx2,fma"))) int64_t argmax_avx2(const bf16* x, int64_t n) {
  __m256 top8 = _mm256_set1_ps(-INFINITY), nan = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = load_bf16(x + i);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    top8 = _mm256_max_ps(top8, v);
  }
  if (_mm256_movemask_ps(nan)) return argmax_reference(x, n);
  float lanes[8], top = -INFINITY;
  _mm256_storeu_ps(lanes, top8);
  for (float v : lanes) top = std::max(top, v);
  for (int64_t j = i; j < n; ++j) {
    const float v = static_cast<float>(x[j]);
    if (std::isnan(v)) return argmax_reference(x, n);
    top = std::max(top, v);
  }
  const __m256 t = _mm256_set1_ps(top);
  for (i = 0; i + 8 <= n; i += 8) {
    const int hit = _mm256_movemask_ps(_mm256_cmp_ps(load_bf16(x + i), t, _CMP_EQ_OQ));
    if (hit) return i + __builtin_ctz(hit);
  }
  for (; i < n; ++i)
    if (static_cast<float>(x[i]) == top) break;
  return i;
}

}  // namespace

// x (..., n) bf16 -> the index of each row's maximum (...), int64. `path` as qgemm's: 0 the best this
// CPU runs, 1 the reference, 2 or 3 the AVX2 code (the tests compare them).
at::Tensor argmax_rows(const at::Tensor& x, int64_t path) {
  TORCH_CHECK(x.is_cpu() && x.scalar_type() == at::kBFloat16 && x.dim() >= 1 && x.size(-1) > 0,
              "argmax_rows: x must be a non-empty bf16 CPU tensor");
  const int64_t best = best_path();
  if (path == AUTO) path = best;
  TORCH_CHECK(path == REFERENCE || path <= best, "argmax_rows: this CPU cannot run path ", path);
  const at::Tensor xc = x.contiguous();
  const int64_t n = xc.size(-1), rows = xc.numel() / n;
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end() - 1);
  at::Tensor out = at::empty(shape, x.options().dtype(at::kLong));
  const auto* p = reinterpret_cast<const bf16*>(xc.data_ptr());
  int64_t* o = out.data_ptr<int64_t>();
#pragma omp parallel for if (rows >= 8) num_threads(at::get_num_threads())
  for (int64_t r = 0; r < rows; ++r) o[r] = path == REFERENCE ? argmax_reference(p + r * n, n) : argmax_avx2(p + r * n, n);
  return out;
}

TORCH_LIBRARY_FRAGMENT(flashdraft, m) { m.def("argmax_rows(Tensor x, int path) -> Tensor", &argmax_rows); }
