// y = x · wᵀ (+ bias) for a few rows of x, float32 (or GGUF Q8_0 / Q4_1 blocks), AVX2 + FMA + F16C: the CPU verifier's decode and small
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

#include <algorithm>
#include <cstring>
#include <vector>

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

// A float32 output [..., N] for x [..., K].
inline at::Tensor rows_out(const at::Tensor& x, int64_t N) {
  std::vector<int64_t> sizes = x.sizes().vec();
  sizes.back() = N;
  return at::empty(sizes, x.options().dtype(at::kFloat));
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "specmesh_cpu::linear: CPU tensors");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, "specmesh_cpu::linear: float32");
  TORCH_CHECK(w.dim() == 2 && x.size(-1) == w.size(1) && w.size(1) > 0, "specmesh_cpu::linear: x [..., K] and w [N, K], K > 0");
  const int64_t N = w.size(0), K = w.size(1);
  const at::Tensor xc = x.contiguous(), wc = w.contiguous();
  const int64_t M = xc.numel() / K;
  at::Tensor y = rows_out(x, N);
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
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N, "specmesh_cpu::linear: bias [N]");
    y.add_(*bias);
  }
  return y;
}

// ---- GGUF blocks (ggml's layouts), dequantized 8 weight rows at a time into a float buffer, then the
// same per-row sums as linear(): a row's outputs do not depend on how many rows come with it.
//   Q8_0: 34 bytes per 32 weights: fp16 d, int8 q[32];          w = d · q
//   Q4_1: 20 bytes per 32 weights: fp16 d, fp16 m, uint8 qs[16]; w_j = d · (qs[j] & 15) + m,
//         w_{j+16} = d · (qs[j] >> 4) + m   (j < 16)
constexpr int64_t kQ80Bytes = 34, kQ41Bytes = 20;

inline float half_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

inline void dequant_q8_0(const uint8_t* row, int64_t blocks, float* out) {
  for (int64_t b = 0; b < blocks; ++b, row += kQ80Bytes, out += 32) {
    const __m256 d = _mm256_set1_ps(half_to_float(row));
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 2));
    const __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
    _mm256_storeu_ps(out, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo))));
    _mm256_storeu_ps(out + 8, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)))));
    _mm256_storeu_ps(out + 16, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi))));
    _mm256_storeu_ps(out + 24, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)))));
  }
}

inline void dequant_q4_1(const uint8_t* row, int64_t blocks, float* out) {
  const __m128i low4 = _mm_set1_epi8(0x0F);
  for (int64_t b = 0; b < blocks; ++b, row += kQ41Bytes, out += 32) {
    const __m256 d = _mm256_set1_ps(half_to_float(row)), m = _mm256_set1_ps(half_to_float(row + 2));
    const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 4));
    const __m128i lo = _mm_and_si128(qs, low4), hi = _mm_and_si128(_mm_srli_epi16(qs, 4), low4);
    _mm256_storeu_ps(out, _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), m));
    _mm256_storeu_ps(out + 8, _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), m));
    _mm256_storeu_ps(out + 16, _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), m));
    _mm256_storeu_ps(out + 24, _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), m));
  }
}

// x [..., K] · W[N, K]ᵀ with W as GGUF blocks: uint8 [N, K / 32 · block bytes]; kind 8 = Q8_0, 3 = Q4_1
// (ggml's type numbers).
at::Tensor linear_gguf(const at::Tensor& x, const at::Tensor& blocks, int64_t kind) {
  TORCH_CHECK(x.device().is_cpu() && blocks.device().is_cpu(), "specmesh_cpu::linear_gguf: CPU tensors");
  TORCH_CHECK(x.scalar_type() == at::kFloat, "specmesh_cpu::linear_gguf: float32 input");
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2, "specmesh_cpu::linear_gguf: uint8 blocks [N, bytes]");
  TORCH_CHECK(kind == 8 || kind == 3, "specmesh_cpu::linear_gguf: Q8_0 (8) or Q4_1 (3) blocks");
  const int64_t block_bytes = kind == 8 ? kQ80Bytes : kQ41Bytes;
  const int64_t N = blocks.size(0), K = x.size(-1), nb = K / 32;
  TORCH_CHECK(K % 32 == 0 && blocks.size(1) == nb * block_bytes, "specmesh_cpu::linear_gguf: x [..., K] and blocks [N, K / 32 · ", block_bytes, "]");
  const at::Tensor xc = x.contiguous(), bc = blocks.contiguous();
  const int64_t M = xc.numel() / K;
  at::Tensor y = rows_out(x, N);
  const float* xp = xc.data_ptr<float>();
  const uint8_t* bp = bc.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  const int64_t row_bytes = nb * block_bytes;
  auto dequant = kind == 8 ? dequant_q8_0 : dequant_q4_1;
  at::parallel_for(0, (N + 7) / 8, 4, [&](int64_t b0, int64_t b1) {
    std::vector<float> w(8 * K);  // this chunk's 8 weight rows, dequantized
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t rows = std::min<int64_t>(8, N - b * 8);
      for (int64_t r = 0; r < rows; ++r) dequant(bp + (b * 8 + r) * row_bytes, nb, w.data() + r * K);
      for (int64_t t = 0; t < M; ++t) {
        if (rows == 8) {
          rows_dot<8>(xp + t * K, w.data(), K, yp + t * N + b * 8);
        } else {
          for (int64_t r = 0; r < rows; ++r) rows_dot<1>(xp + t * K, w.data() + r * K, K, yp + t * N + b * 8 + r);
        }
      }
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY(specmesh_cpu, m) {
  m.def("linear(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  m.def("linear_gguf(Tensor x, Tensor blocks, int kind) -> Tensor");
}
TORCH_LIBRARY_IMPL(specmesh_cpu, CPU, m) {
  m.impl("linear", &linear);
  m.impl("linear_gguf", &linear_gguf);
}
