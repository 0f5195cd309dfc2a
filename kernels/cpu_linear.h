// The CPU linears of cpu_linear.cpp, for the decoder loop of cpu_decoder.cpp (one library, built by cpu_linear.py).
#pragma once

#include <ATen/ATen.h>

namespace specmesh_cpu {

// y = x · wᵀ (+ bias): x float32 [..., K], w float32 [N, K] → [..., N].
at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias);

// y = x · Wᵀ with W as GGUF blocks: uint8 [N, K / 32 · block bytes] of ggml type ``kind`` (8 = Q8_0, 3 = Q4_1).
at::Tensor linear_gguf(const at::Tensor& x, const at::Tensor& blocks, int64_t kind);

}  // namespace specmesh_cpu
