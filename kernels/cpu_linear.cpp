// y = x · wᵀ (+ bias) for a few rows of x, float32 (or GGUF Q8_0 / Q4_1 blocks), AVX2 + FMA + F16C: the CPU verifier's decode and small
// verification steps, where reading the weights once is the whole cost. Built by cpu_linear.py.
//
// The weights are read one row at a time, each thread's rows one sequential stream: the first input row's
// pass brings the row from memory, every further row re-reads it from L1. Each output is an 8-lane
// partial sum over k reduced once at the end (a different order from oneDNN's: |Δ| ~ 1e-6 relative).
#include "cpu_linear.h"

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

// y[t · N] = Σ_k x[t, k] · w[k] for M rows of x (row stride K): each an 8-lane partial sum over k in
// order, reduced once; the weights loaded once for the M rows.
template <int M>
inline void row_dot(const float* x, const float* w, int64_t K, float* y, int64_t N) {
  __m256 acc[M];
  for (int t = 0; t < M; ++t) acc[t] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    const __m256 wv = _mm256_loadu_ps(w + k);
    for (int t = 0; t < M; ++t) acc[t] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + t * K + k), acc[t]);
  }
  for (int t = 0; t < M; ++t) {
    float s = hsum(acc[t]);
    for (int64_t j = k; j < K; ++j) s += w[j] * x[t * K + j];
    y[t * N] = s;
  }
}

// Every row of x (M of them) by weight row w: 4 at a time, then the rest.
inline void rows_by_row(const float* x, int64_t M, const float* w, int64_t K, float* y, int64_t N) {
  int64_t t = 0;
  for (; t + 4 <= M; t += 4) row_dot<4>(x + t * K, w, K, y + t * N, N);
  switch (M - t) {
    case 3: row_dot<3>(x + t * K, w, K, y + t * N, N); break;
    case 2: row_dot<2>(x + t * K, w, K, y + t * N, N); break;
    case 1: row_dot<1>(x + t * K, w, K, y + t * N, N); break;
    default: break;
  }
}

// A float32 output [..., N] for x [..., K].
inline at::Tensor rows_out(const at::Tensor& x, int64_t N) {
  std::vector<int64_t> sizes = x.sizes().vec();
  sizes.back() = N;
  return at::empty(sizes, x.options().dtype(at::kFloat));
}

}  // namespace

namespace specmesh_cpu {

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
  // One weight row after another: each thread reads its rows as one sequential stream (1.4-1.6x the
  // bandwidth of 8 rows read side by side, whose 8 streams the prefetchers follow worse), multiplied by
  // every row of x while in registers.
  at::parallel_for(0, N, 32, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) rows_by_row(xp, M, wp + n * K, K, yp + n, N);
  });
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N, "specmesh_cpu::linear: bias [N]");
    y.add_(*bias);
  }
  return y;
}

}  // namespace specmesh_cpu

namespace {

// ---- GGUF blocks (ggml's layouts). Every output is the float32 kernel's sum over its dequantized weight
// row (8-lane partial sums over k in order, reduced once), whatever the number of rows, so a row's result
// does not depend on its step; the weights are the same floats either way (one fmadd / mul per weight):
//   Q8_0: 34 bytes per 32 weights: fp16 d, int8 q[32];          w = d · q
//   Q4_1: 20 bytes per 32 weights: fp16 d, fp16 m, uint8 qs[16]; w_j = d · (qs[j] & 15) + m,
//         w_{j+16} = d · (qs[j] >> 4) + m   (j < 16)
// A step of at most kFusedTokens rows dequantizes each block into registers and multiplies it there by
// every row of x (the blocks read once, nothing written); a larger step dequantizes 8 weight rows into a
// buffer once and multiplies it tile by tile (2 rows of x × 4 weight rows in registers).
constexpr int64_t kQ80Bytes = 34, kQ41Bytes = 20, kFusedTokens = 4;

inline float half_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// One block's 32 weights as 4 vectors of 8.
struct Q80 {
  static constexpr int64_t kBytes = kQ80Bytes;
  static inline void block(const uint8_t* p, __m256 w[4]) {
    const __m256 d = _mm256_set1_ps(half_to_float(p));
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 2));
    const __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
    w[0] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo)));
    w[1] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8))));
    w[2] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi)));
    w[3] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8))));
  }
};

struct Q41 {
  static constexpr int64_t kBytes = kQ41Bytes;
  static inline void block(const uint8_t* p, __m256 w[4]) {
    const __m128i low4 = _mm_set1_epi8(0x0F);
    const __m256 d = _mm256_set1_ps(half_to_float(p)), m = _mm256_set1_ps(half_to_float(p + 2));
    const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 4));
    const __m128i lo = _mm_and_si128(qs, low4), hi = _mm_and_si128(_mm_srli_epi16(qs, 4), low4);
    w[0] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), m);
    w[1] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), m);
    w[2] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), m);
    w[3] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), m);
  }
};

template <class Q>
inline void dequant_row(const uint8_t* row, int64_t blocks, float* out) {
  __m256 w[4];
  for (int64_t b = 0; b < blocks; ++b, row += Q::kBytes, out += 32) {
    Q::block(row, w);
    for (int j = 0; j < 4; ++j) _mm256_storeu_ps(out + 8 * j, w[j]);
  }
}

// y[t · N] = Σ_k x[t · K + k] · w[k] for T rows of x and one weight row of GGUF blocks, dequantized in registers.
template <class Q, int T>
inline void fused_row(const uint8_t* row, int64_t blocks, const float* x, int64_t K, float* y, int64_t N) {
  __m256 acc[T], w[4];
  for (int t = 0; t < T; ++t) acc[t] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b, row += Q::kBytes) {
    Q::block(row, w);
    for (int t = 0; t < T; ++t)
      for (int j = 0; j < 4; ++j) acc[t] = _mm256_fmadd_ps(w[j], _mm256_loadu_ps(x + t * K + b * 32 + 8 * j), acc[t]);
  }
  for (int t = 0; t < T; ++t) y[t * N] = hsum(acc[t]);
}

template <class Q>
void fused_rows(const uint8_t* row, int64_t blocks, const float* x, int64_t M, int64_t K, float* y, int64_t N) {
  switch (M) {
    case 1: return fused_row<Q, 1>(row, blocks, x, K, y, N);
    case 2: return fused_row<Q, 2>(row, blocks, x, K, y, N);
    case 3: return fused_row<Q, 3>(row, blocks, x, K, y, N);
    default: return fused_row<Q, 4>(row, blocks, x, K, y, N);
  }
}

// y[t · N + r] = Σ_k x[t · K + k] · w[r · K + k] for T rows of x and R float32 weight rows (K % 8 == 0),
// each sum as row_dot's.
template <int T, int R>
inline void tile_dot(const float* x, const float* w, int64_t K, float* y, int64_t N) {
  __m256 acc[T][R];
  for (int t = 0; t < T; ++t)
    for (int r = 0; r < R; ++r) acc[t][r] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    __m256 wv[R];
    for (int r = 0; r < R; ++r) wv[r] = _mm256_loadu_ps(w + r * K + k);
    for (int t = 0; t < T; ++t) {
      const __m256 xv = _mm256_loadu_ps(x + t * K + k);
      for (int r = 0; r < R; ++r) acc[t][r] = _mm256_fmadd_ps(wv[r], xv, acc[t][r]);
    }
  }
  for (int t = 0; t < T; ++t)
    for (int r = 0; r < R; ++r) y[t * N + r] = hsum(acc[t][r]);
}

template <class Q>
void gguf_rows(const float* xp, const uint8_t* bp, int64_t M, int64_t N, int64_t K, float* yp) {
  const int64_t nb = K / 32, row_bytes = nb * Q::kBytes;
  at::parallel_for(0, (N + 7) / 8, 4, [&](int64_t b0, int64_t b1) {
    std::vector<float> w(M > kFusedTokens ? 8 * K : 0);  // this chunk's 8 weight rows, dequantized
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t rows = std::min<int64_t>(8, N - b * 8);
      if (M <= kFusedTokens) {
        for (int64_t r = 0; r < rows; ++r) fused_rows<Q>(bp + (b * 8 + r) * row_bytes, nb, xp, M, K, yp + b * 8 + r, N);
        continue;
      }
      for (int64_t r = 0; r < rows; ++r) dequant_row<Q>(bp + (b * 8 + r) * row_bytes, nb, w.data() + r * K);
      float* yb = yp + b * 8;
      int64_t t = 0;
      for (; t + 2 <= M; t += 2) {
        if (rows == 8) {
          tile_dot<2, 4>(xp + t * K, w.data(), K, yb + t * N, N);
          tile_dot<2, 4>(xp + t * K, w.data() + 4 * K, K, yb + t * N + 4, N);
        } else {
          for (int64_t r = 0; r < rows; ++r) tile_dot<2, 1>(xp + t * K, w.data() + r * K, K, yb + t * N + r, N);
        }
      }
      for (; t < M; ++t)
        for (int64_t r = 0; r < rows; ++r) tile_dot<1, 1>(xp + t * K, w.data() + r * K, K, yb + t * N + r, N);
    }
  });
}

}  // namespace

namespace specmesh_cpu {

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
  if (M == 0) return y;
  if (kind == 8) {
    gguf_rows<Q80>(xp, bp, M, N, K, yp);
  } else {
    gguf_rows<Q41>(xp, bp, M, N, K, yp);
  }
  return y;
}

}  // namespace specmesh_cpu

TORCH_LIBRARY(specmesh_cpu, m) {
  m.def("linear(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  m.def("linear_gguf(Tensor x, Tensor blocks, int kind) -> Tensor");
}
TORCH_LIBRARY_IMPL(specmesh_cpu, CPU, m) {
  m.impl("linear", &specmesh_cpu::linear);
  m.impl("linear_gguf", &specmesh_cpu::linear_gguf);
}
