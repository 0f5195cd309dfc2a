// The CPU linears of cpu_linear.cpp, for the decoder loop of cpu_decoder.cpp (one library, built by cpu_linear.py).
#pragma once

#include <ATen/ATen.h>
#include <immintrin.h>

namespace specmesh_cpu {

// The sum of v's 8 lanes: (lo + hi) halves, then pairs, then the last two (one order, every caller).
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// y = x · wᵀ (+ bias): x float32 [..., K], w float32 [N, K] → [..., N].
at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias);

// y = x · Wᵀ with W as GGUF blocks: uint8 [N, K / 32 · block bytes] of ggml type ``kind`` (8 = Q8_0, 3 = Q4_1).
at::Tensor linear_gguf(const at::Tensor& x, const at::Tensor& blocks, int64_t kind);

}  // namespace specmesh_cpu
