// y = x · wᵀ (+ bias) for a few rows of x, float32 (or GGUF Q8_0 / Q4_1 blocks, any rows), AVX2 + FMA + F16C (+ AVX-512
// VNNI where the CPU has it): the CPU verifier's decode and small verification steps, where reading the weights
// once is the whole cost. Built by cpu_linear.py.
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
#include <type_traits>
#include <vector>

namespace {

using specmesh_cpu::hsum;

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

// ---- GGUF blocks (ggml's Q4_1 and Q8_0), multiplied in ggml's manner on a CPU (not its bits: ggml scales by
// 127 / max and keeps d in fp16): each 32-value block of a row of x is quantized to int8, and each weight
// block's dot product with it is exact in integers before one float multiply-add per block:
//   x block:  d = max|x| / 127,  q = round(x · (1 / d)) (to nearest, ties to even),  s = d · Σ q
//   Q8_0 weight block: dw, int8 qw[32]:                   Σ_j dw·qw_j · d·q_j = (dw·d) · Σ qw_j q_j
//   Q4_1 weight block: dw, mw, 4-bit qw[32], w = dw·qw + mw: Σ_j w_j · d·q_j = (dw·d) · Σ qw_j q_j + mw · s
// An output is Σ over its row's blocks, 8 at a time, of float(Σ qw q) · (dw·d) (+ mw · s) into 8 float lanes
// (lane j: block j of each 8), reduced once: the same operations whatever the number of rows of x, so a
// row's result does not depend on its step.
//
// The file's blocks are repacked once at load (cpu_linear.pack_gguf; the same bits, 4 or 8 of them a
// weight): per weight row, its blocks' fp16 scales side by side ([nbp], nbp = blocks rounded up to 8, the
// padding 0), so 8 blocks' scales convert in one instruction; then the blocks' integers:
//   Q4_1 row: dw [nbp] fp16, mw [nbp] fp16, qs [nb][16] (weight j < 16: qs[j] & 15; 16 + j: qs[j] >> 4)
//   Q8_0 row: dw [nbp] fp16, qw + 128 [nb][32] as uint8 (an unsigned operand for the u8·s8 dot product)
constexpr int64_t kTile = 4;

inline int64_t padded(int64_t nb) { return (nb + 7) / 8 * 8; }

// 8 int32 lanes of Σ u_j · s_j over 32 bytes (u unsigned, s signed), 4 a lane; exact where maddubs's pair sums
// stay within int16 (the callers': Q4_1's u ≤ 15, Q8_0's |qw| ≤ 128 by the sign trick; vpdpbusd is exact anyway)
inline __m256i dot_u8s8(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

// lane j = Σ of v[j]'s 8 lanes (exact integers, so in any order)
inline __m256i sum8(const __m256i v[8]) {
  const __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
  const __m256i b = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
  return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31));
}

// The rows of x quantized (see above): q [M, nb · 32]; d, s and Σ q [M, nbp], the padding 0.
struct QuantizedRows {
  std::vector<int8_t> q;
  std::vector<float> d, s;
  std::vector<int32_t> sum;
  int64_t nb, nbp;
};

// cpu_linear.quantize_rows_reference is the same in torch, bit for bit.
QuantizedRows quantize_rows(const float* x, int64_t M, int64_t K) {
  const int64_t nb = K / 32, nbp = padded(nb);
  QuantizedRows r{std::vector<int8_t>(M * K), std::vector<float>(M * nbp), std::vector<float>(M * nbp),
                  std::vector<int32_t>(M * nbp), nb, nbp};
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // undoes packs' lane interleave
  at::parallel_for(0, M * nb, 256, [&](int64_t b0, int64_t b1) {
    for (int64_t i = b0; i < b1; ++i) {
      const int64_t t = i / nb, b = i % nb;
      const float* v = x + i * 32;  // rows are contiguous: block i of the whole is block b of row t
      __m256 f[4];
      __m256 amax = _mm256_setzero_ps();
      for (int j = 0; j < 4; ++j) f[j] = _mm256_loadu_ps(v + 8 * j), amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, f[j]));
      __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
      m = _mm_max_ps(m, _mm_movehl_ps(m, m));
      m = _mm_max_ss(m, _mm_movehdup_ps(m));
      const float d = _mm_cvtss_f32(m) / 127.0f, inv = d != 0.0f ? 1.0f / d : 0.0f;
      __m256i q[4];
      for (int j = 0; j < 4; ++j)  // to nearest, ties to even (the default rounding mode)
        q[j] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(f[j], _mm256_set1_ps(inv)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
      const __m256i total = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
      __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
      s4 = _mm_hadd_epi32(s4, s4);
      s4 = _mm_hadd_epi32(s4, s4);
      const int32_t sum = _mm_cvtsi128_si32(s4);
      const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(r.q.data() + i * 32), _mm256_permutevar8x32_epi32(bytes, order));
      r.d[t * nbp + b] = d;
      r.s[t * nbp + b] = d * static_cast<float>(sum);
      r.sum[t * nbp + b] = sum;
    }
  });
  return r;
}

struct Q41 {
  static int64_t row_bytes(int64_t nb) { return 4 * padded(nb) + 16 * nb; }
  static inline const uint8_t* block(const uint8_t* row, int64_t nbp, int64_t b) { return row + 4 * nbp + 16 * b; }
  static inline __m256i weights(const uint8_t* p) {  // 32 unsigned nibbles in order
    const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(qs, 4), qs), _mm256_set1_epi8(0x0F));
  }
  static inline __m256i dot(__m256i w, __m256i x) { return dot_u8s8(w, x); }
};

struct Q80 {
  static int64_t row_bytes(int64_t nb) { return 2 * padded(nb) + 32 * nb; }
  static inline const uint8_t* block(const uint8_t* row, int64_t nbp, int64_t b) { return row + 2 * nbp + 32 * b; }
  static inline __m256i weights(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  // Σ (qw + 128) · q: the caller takes 128 · Σ q off
  static constexpr bool kOffset = true;
  static inline __m256i dot(__m256i w, __m256i x) { return dot_u8s8(w, x); }
#else
  // maddubs would saturate on (qw + 128) · q: |qw| · (q with qw's sign) instead
  static constexpr bool kOffset = false;
  static inline __m256i dot(__m256i w, __m256i x) {
    const __m256i qw = _mm256_xor_si256(w, _mm256_set1_epi8(static_cast<char>(0x80)));
    return dot_u8s8(_mm256_abs_epi8(qw), _mm256_sign_epi8(x, qw));
  }
#endif
};

// Blocks 8g … 8g + count - 1 of one weight row by T rows of x (from row t0), into acc[t].
template <class Q, int T>
inline __attribute__((always_inline)) void group(const uint8_t* row, int64_t g, int64_t count, const QuantizedRows& x,
                                                 int64_t t0, __m256 acc[T]) {
  const int64_t nbp = x.nbp;
  __m256i dots[T][8];  // per row of x and block: 8 int32 lanes of Σ qw q
  for (int64_t j = 0; j < 8; ++j) {
    if (j >= count) {
      for (int t = 0; t < T; ++t) dots[t][j] = _mm256_setzero_si256();
      continue;
    }
    const int64_t b = 8 * g + j;
    const __m256i w = Q::weights(Q::block(row, nbp, b));
    for (int t = 0; t < T; ++t)
      dots[t][j] = Q::dot(w, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q.data() + ((t0 + t) * x.nb + b) * 32)));
  }
  const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16 * g)));  // [8]
  for (int t = 0; t < T; ++t) {
    const int64_t at = (t0 + t) * nbp + 8 * g;
    __m256i isum = sum8(dots[t]);  // [8]: Σ qw q per block
    if constexpr (std::is_same_v<Q, Q80>) {
      if constexpr (Q80::kOffset)
        isum = _mm256_sub_epi32(isum, _mm256_slli_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.sum.data() + at)), 7));
    }
    acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(dw, _mm256_loadu_ps(x.d.data() + at)), acc[t]);
    if constexpr (std::is_same_v<Q, Q41>) {  // + mw · s
      const __m256 mw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 2 * nbp + 16 * g)));
      acc[t] = _mm256_fmadd_ps(mw, _mm256_loadu_ps(x.s.data() + at), acc[t]);
    }
  }
}

// y[t · N] for T rows of x (from row t0) by one weight row.
template <class Q, int T>
inline void row_times(const uint8_t* row, const QuantizedRows& x, int64_t t0, float* y, int64_t N) {
  __m256 acc[T];
  for (int t = 0; t < T; ++t) acc[t] = _mm256_setzero_ps();
  int64_t g = 0;
  for (; 8 * (g + 1) <= x.nb; ++g) group<Q, T>(row, g, 8, x, t0, acc);
  if (8 * g < x.nb) group<Q, T>(row, g, x.nb - 8 * g, x, t0, acc);
  for (int t = 0; t < T; ++t) y[t * N] = hsum(acc[t]);
}

template <class Q>
void gguf_rows(const float* xp, const uint8_t* bp, int64_t M, int64_t N, int64_t K, float* yp) {
  const QuantizedRows x = quantize_rows(xp, M, K);
  const int64_t row_bytes = Q::row_bytes(x.nb);
  // each thread a run of weight rows, each row read once from memory and multiplied by every row of x,
  // kTile rows of x at a time (the weight row stays in L1 between tiles)
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* row = bp + n * row_bytes;
      int64_t t = 0;
      for (; t + kTile <= M; t += kTile) row_times<Q, kTile>(row, x, t, yp + t * N + n, N);
      switch (M - t) {
        case 3: row_times<Q, 3>(row, x, t, yp + t * N + n, N); break;
        case 2: row_times<Q, 2>(row, x, t, yp + t * N + n, N); break;
        case 1: row_times<Q, 1>(row, x, t, yp + t * N + n, N); break;
        default: break;
      }
    }
  });
}

}  // namespace

namespace specmesh_cpu {

// x [..., K] · W[N, K]ᵀ with W as GGUF blocks repacked (cpu_linear.pack_gguf): uint8 [N, row bytes]; kind 8 = Q8_0,
// 3 = Q4_1 (ggml's type numbers).
at::Tensor linear_gguf(const at::Tensor& x, const at::Tensor& blocks, int64_t kind) {
  TORCH_CHECK(x.device().is_cpu() && blocks.device().is_cpu(), "specmesh_cpu::linear_gguf: CPU tensors");
  TORCH_CHECK(x.scalar_type() == at::kFloat, "specmesh_cpu::linear_gguf: float32 input");
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2, "specmesh_cpu::linear_gguf: uint8 blocks [N, bytes]");
  TORCH_CHECK(kind == 8 || kind == 3, "specmesh_cpu::linear_gguf: Q8_0 (8) or Q4_1 (3) blocks");
  const int64_t N = blocks.size(0), K = x.size(-1), nb = K / 32;
  const int64_t row_bytes = kind == 8 ? Q80::row_bytes(nb) : Q41::row_bytes(nb);
  TORCH_CHECK(K % 32 == 0 && blocks.size(1) == row_bytes, "specmesh_cpu::linear_gguf: x [..., K] and packed blocks [N, ",
              row_bytes, "] (cpu_linear.pack_gguf)");
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
