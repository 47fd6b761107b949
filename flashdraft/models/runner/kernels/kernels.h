// What the kernel files share: the GEMM (qgemm.cpp), used by the layer forward (layers.cpp).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

enum Kind { Q8_0 = 0, Q4_1 = 1 };
enum Path { AUTO = 0, REFERENCE = 1, AVX2 = 2, AVX512 = 3 };

// The fastest path this CPU runs (AVX512 with VNNI, AVX2, or the scalar REFERENCE).
int64_t best_path();

// x (M, K) times packed Q8_0 / Q4_1 weights' transpose: (M, n) in x's dtype (see qgemm.cpp).
at::Tensor qgemm(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales, int64_t n, int64_t kind,
                 int64_t path);
