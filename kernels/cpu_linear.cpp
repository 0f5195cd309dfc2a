// y = x · wᵀ (+ bias) for a few rows of x, float32, AVX2 + FMA: the CPU verifier's decode and small
// verification steps, where reading the weights once is the whole cost. Built by cpu_linear.py.
//
// The weights are read in blocks of 8 output rows, as 8 streams: the first input row's pass brings the
// block from memory (8 accumulators, the weights as FMA operands), every further row re-reads it from
// L1/L2. Each output is an 8-lane partial sum over k reduced once at the end (a different order from
// oneDNN's: |Δ| ~ 1e-6 relative).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

namespace {

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// y[r] = Σ_k x[k] · w[r, k] for R consecutive weight rows (row stride K).
template <int R>
inline void rows_dot(const float* x, const float* w, int64_t K, float* y) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    const __m256 xv = _mm256_loadu_ps(x + k);
    for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(w + r * K + k), xv, acc[r]);
  }
  for (int r = 0; r < R; ++r) {
    float s = hsum(acc[r]);
    for (int64_t j = k; j < K; ++j) s += w[r * K + j] * x[j];
    y[r] = s;
  }
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "specmesh_cpu::linear: CPU tensors");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, "specmesh_cpu::linear: float32");
  TORCH_CHECK(w.dim() == 2 && x.size(-1) == w.size(1), "specmesh_cpu::linear: x [..., K] and w [N, K]");
  const int64_t N = w.size(0), K = w.size(1);
  const at::Tensor xc = x.contiguous(), wc = w.contiguous();
  const int64_t M = xc.numel() / K;
  std::vector<int64_t> sizes = x.sizes().vec();
  sizes.back() = N;
  at::Tensor y = at::empty(sizes, x.options());
  const float* xp = xc.data_ptr<float>();
  const float* wp = wc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t blocks = N / 8;
  at::parallel_for(0, blocks, 4, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t t = 0; t < M; ++t) rows_dot<8>(xp + t * K, wp + b * 8 * K, K, yp + t * N + b * 8);
  });
  for (int64_t n = blocks * 8; n < N; ++n)
    for (int64_t t = 0; t < M; ++t) rows_dot<1>(xp + t * K, wp + n * K, K, yp + t * N + n);
  if (bias.has_value() && bias->defined()) y.add_(*bias);
  return y;
}

}  // namespace

TORCH_LIBRARY(specmesh_cpu, m) { m.def("linear(Tensor x, Tensor w, Tensor? bias) -> Tensor"); }
TORCH_LIBRARY_IMPL(specmesh_cpu, CPU, m) { m.impl("linear", &linear); }
