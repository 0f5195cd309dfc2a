// y = x · wᵀ (+ bias) for a few rows of x, float32 (or GGUF Q8_0 / Q4_1 blocks, any rows), AVX2 + FMA + F16C (+ AVX-512
// VNNI where the CPU has it): the CPU verifier's decode and small verification steps, where reading the weights
// once is the whole cost. Built by cpu_linear.py.
//
// One row of x: the weights are read one row at a time, each thread's rows one sequential stream. More rows:
// tiles of weight rows by rows of x in registers (8 lanes; with AVX-512, pairs of rows in 16). Each output is an
// 8-lane partial sum over k reduced once at the end, whatever the tile or the build (a different order from
// oneDNN's: |Δ| ~ 1e-6 relative).
#include "cpu_linear.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

using specmesh_cpu::hsum;

// One output from its 8-lane partial sums over k < k_end: reduced by hsum, then w[j] · x[j] for the tail
// j = k_end … K - 1, fused explicitly (left to the compiler, the tail's products may be vectorized apart from its
// sum, rounded twice, in one tile shape and fused in another: GCC with AVX-512, so rows would differ by step).
// Every tile ends here, so every output is the same sum in the same order.
inline float finish(__m256 acc, const float* w, const float* x, int64_t k_end, int64_t K) {
  float s = hsum(acc);
  for (int64_t j = k_end; j < K; ++j) s = std::fma(w[j], x[j], s);
  return s;
}

// y[t · N + r] = Σ_k x[t, k] · w[r · K + k] for R weight rows (row stride K) and T rows of x: each output an
// 8-lane partial sum over k in order, reduced once (so the same bits whatever R and T). Each step of k loads the
// R weight vectors once for the T rows of x, R·T fused multiply-adds for R + T loads; pf: the next group's rows,
// prefetched with Prefetch (the products of many rows spend long enough on a group for the stream to stall without it).
template <int R, int T, bool Prefetch>
inline void tile_dot(const float* x, const float* w, int64_t K, float* y, int64_t N, const float* pf) {
  __m256 acc[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    if (Prefetch && (k & 15) == 0)
      for (int r = 0; r < R; ++r) _mm_prefetch(reinterpret_cast<const char*>(pf + r * K + k), _MM_HINT_T0);
    __m256 wv[R];
    for (int r = 0; r < R; ++r) wv[r] = _mm256_loadu_ps(w + r * K + k);
    for (int t = 0; t < T; ++t) {
      const __m256 xv = _mm256_loadu_ps(x + t * K + k);
      for (int r = 0; r < R; ++r) acc[r][t] = _mm256_fmadd_ps(wv[r], xv, acc[r][t]);
    }
  }
  for (int t = 0; t < T; ++t)
    for (int r = 0; r < R; ++r) y[t * N + r] = finish(acc[r][t], w + r * K, x + t * K, k, K);
}

// Every row of x (M of them) by R weight rows: 4 rows of x at a time, then the rest.
template <int R, bool Prefetch>
inline void rows_by_rows(const float* x, int64_t M, const float* w, int64_t K, float* y, int64_t N, const float* pf) {
  int64_t t = 0;
  for (; t + 4 <= M; t += 4) tile_dot<R, 4, Prefetch>(x + t * K, w, K, y + t * N, N, pf);
  switch (M - t) {
    case 3: tile_dot<R, 3, Prefetch>(x + t * K, w, K, y + t * N, N, pf); break;
    case 2: tile_dot<R, 2, Prefetch>(x + t * K, w, K, y + t * N, N, pf); break;
    case 1: tile_dot<R, 1, Prefetch>(x + t * K, w, K, y + t * N, N, pf); break;
    default: break;
  }
}

#if defined(__AVX512F__)
// ---- Two rows of x in one 16-lane vector (where the build has AVX-512): lanes 0-7 hold row 2p's 8 values of
// a step of k, lanes 8-15 row 2p + 1's, and the weight row's 8 values are loaded into both halves
// (vbroadcastf64x4). One 16-lane multiply-add is then two rows' 8-lane steps of tile_dot, each lane the same
// fused multiply-add in the same k order, and each half is finished as tile_dot finishes its vector (finish): the
// same bits as tile_dot (and the AVX2 build), at twice the multiply-adds per instruction.

// The rows of x side by side in pairs, once per call: xi [P][K / 8][16] (an odd M's last pair padded with zeros).
struct PairedRows {
  std::vector<float> xi;
  int64_t P, K8;
};

// A tile: kPairR weight rows by kPairP pairs of x rows, 24 accumulators of 32 vector registers (the 2-core Zen 5's
// 211 products: 4 × 6 beat 3 × 4, 4 × 4 and 6 × 4 from 8 to 16 rows and tied them beyond; 3 rows were slower)
constexpr int kPairR = 4, kPairP = 6;

inline PairedRows pair_rows(const float* x, int64_t M, int64_t K) {
  const int64_t K8 = K / 8, P = (M + 1) / 2;
  PairedRows r{std::vector<float>(P * K8 * 16, 0.0f), P, K8};
  for (int64_t t = 0; t < M; ++t)
    for (int64_t j = 0; j < K8; ++j)
      std::memcpy(r.xi.data() + ((t / 2) * K8 + j) * 16 + (t % 2) * 8, x + t * K + 8 * j, 8 * sizeof(float));
  return r;
}

inline __m256 half(__m512 v, int h) {
  return h ? _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)) : _mm512_castps512_ps256(v);
}

// tile_dot for R weight rows by the P pairs of x from pair p0 (rows 2·p0 … 2·p0 + 2P - 1 of M).
template <int R, int P, bool Prefetch>
inline void pair_tile_dot(const PairedRows& xr, int64_t p0, const float* x, int64_t M, const float* w, int64_t K,
                          float* y, int64_t N, const float* pf) {
  __m512 acc[R][P];
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < P; ++p) acc[r][p] = _mm512_setzero_ps();
  const float* xi = xr.xi.data() + p0 * xr.K8 * 16;
  for (int64_t j = 0; j < xr.K8; ++j) {
    const int64_t k = 8 * j;
    if (Prefetch && (j & 1) == 0)
      for (int r = 0; r < R; ++r) _mm_prefetch(reinterpret_cast<const char*>(pf + r * K + k), _MM_HINT_T0);
    __m512 wv[R];
    for (int r = 0; r < R; ++r) wv[r] = _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(_mm256_loadu_ps(w + r * K + k))));
    for (int p = 0; p < P; ++p) {
      const __m512 xv = _mm512_loadu_ps(xi + (p * xr.K8 + j) * 16);
      for (int r = 0; r < R; ++r) acc[r][p] = _mm512_fmadd_ps(wv[r], xv, acc[r][p]);
    }
  }
  const int64_t k = 8 * xr.K8;
  for (int p = 0; p < P; ++p)
    for (int h = 0; h < 2; ++h) {
      const int64_t t = 2 * (p0 + p) + h;
      if (t >= M) continue;
      for (int r = 0; r < R; ++r) y[t * N + r] = finish(half(acc[r][p], h), w + r * K, x + t * K, k, K);
    }
}

// Every row of x by R weight rows: kPairP pairs at a time, then the rest.
template <int R, bool Prefetch>
inline void pairs_by_rows(const PairedRows& xr, const float* x, int64_t M, const float* w, int64_t K, float* y,
                          int64_t N, const float* pf) {
  int64_t p = 0;
  for (; p + kPairP <= xr.P; p += kPairP) pair_tile_dot<R, kPairP, Prefetch>(xr, p, x, M, w, K, y, N, pf);
  switch (xr.P - p) {
    case 5: pair_tile_dot<R, 5, Prefetch>(xr, p, x, M, w, K, y, N, pf); break;
    case 4: pair_tile_dot<R, 4, Prefetch>(xr, p, x, M, w, K, y, N, pf); break;
    case 3: pair_tile_dot<R, 3, Prefetch>(xr, p, x, M, w, K, y, N, pf); break;
    case 2: pair_tile_dot<R, 2, Prefetch>(xr, p, x, M, w, K, y, N, pf); break;
    case 1: pair_tile_dot<R, 1, Prefetch>(xr, p, x, M, w, K, y, N, pf); break;
    default: break;
  }
}
#endif

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
  // One row: one weight row after another, each thread's rows one sequential stream (1.4-1.6x the bandwidth
  // of 8 rows read side by side, whose 8 streams the prefetchers follow worse). More rows: 3 weight rows at a
  // time by 4 rows of x in registers (12 multiply-adds for 7 loads; the 2-core Zen 3's 211 products at 8 rows
  // 43 → 32 ms, oneDNN's 50), the next 3 prefetched; with AVX-512, 4 weight rows by 6 pairs of rows (the 2-core
  // Zen 5's at 24 rows 32 → 25 ms, oneDNN's 28). The same bits every way.
#if defined(__AVX512F__)
  if (M > 1) {
    const PairedRows xr = pair_rows(xp, M, K);
    at::parallel_for(0, N, 32, [&](int64_t n0, int64_t n1) {
      int64_t n = n0;
      for (; n + kPairR <= n1; n += kPairR)
        pairs_by_rows<kPairR, true>(xr, xp, M, wp + n * K, K, yp + n, N, wp + std::min(n + kPairR, n1 - kPairR) * K);
      for (; n < n1; ++n) pairs_by_rows<1, false>(xr, xp, M, wp + n * K, K, yp + n, N, nullptr);
    });
  } else
#endif
  at::parallel_for(0, N, 32, [&](int64_t n0, int64_t n1) {
    int64_t n = n0;
    if (M > 1)
      for (; n + 3 <= n1; n += 3) rows_by_rows<3, true>(xp, M, wp + n * K, K, yp + n, N, wp + std::min(n + 3, n1 - 3) * K);
    for (; n < n1; ++n) rows_by_rows<1, false>(xp, M, wp + n * K, K, yp + n, N, nullptr);
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
// block's dot product with it is exact in integers before one float multiply and add per block:
//   x block:  d = max|x| / 127,  q = round(x · (1 / d)) (to nearest, ties to even),  s = d · Σ q
//   Q8_0 weight block: dw, int8 qw[32]:                   Σ_j dw·qw_j · d·q_j = (dw·d) · Σ qw_j q_j
//   Q4_1 weight block: dw, mw, 4-bit qw[32], w = dw·qw + mw: Σ_j w_j · d·q_j = (dw·d) · Σ qw_j q_j + mw · s
// An output is y = 0; for each block b in order: y = y + float(Σ qw q) · (dw · d) (+ mw · s), each
// operation rounded (no fused multiply-add): the same operations whatever the number of rows of x, so a
// row's result does not depend on its step, and cpu_linear.linear_gguf_reference computes the same bits.
//
// The file's blocks are repacked once at load (cpu_linear.pack_gguf; the same bits) in groups of 8 weight
// rows, one record per block of the group, so that one 32-byte vector holds 4 weights of each of the 8 rows
// and one u8·s8 dot product (vpdpbusd, or maddubs + madd) with 4 values of x broadcast gives 8 rows' partial
// sums, lane n for row n: no horizontal sums, and each group's outputs are one 8-float store.
//   Q4_1 record (160 bytes): dw [8] fp16, mw [8] fp16, then 4 chunks of 32 bytes for weights 8c … 8c + 7:
//     byte 4n + j = w[n, 8c + j] | w[n, 8c + 4 + j] << 4  (n: row in the group, j < 4)
//   Q8_0 record (272 bytes): dw [8] fp16, then 8 chunks of 32 bytes for weights 4c … 4c + 3:
//     byte 4n + j = qw[n, 4c + j] + 128 (an unsigned operand for the u8·s8 dot product)
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
constexpr int kTile = 8;  // rows of x a group's weights are multiplied by while in registers (32 vector registers)
#else
constexpr int kTile = 4;  // (16 vector registers)
#endif

// isum + Σ u_j · s_j per int32 lane over its 4 bytes (u unsigned, s signed); exact where maddubs's pair sums
// stay within int16 (the callers': Q4_1's u ≤ 15, Q8_0's |qw| ≤ 128 by the sign trick; vpdpbusd is exact anyway)
inline __m256i dot_u8s8(__m256i isum, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(isum, u, s);
#else
  return _mm256_add_epi32(isum, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

// 4 bytes of x in every lane
inline __m256i broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// The rows of x quantized (see above): q [M, K]; d, s and Σ q [M, K / 32].
struct QuantizedRows {
  std::vector<int8_t> q;
  std::vector<float> d, s;
  std::vector<int32_t> sum;
  int64_t K, nb;
};

// cpu_linear.quantize_rows_reference is the same in torch, bit for bit.
QuantizedRows quantize_rows(const float* x, int64_t M, int64_t K) {
  const int64_t nb = K / 32;
  QuantizedRows r{std::vector<int8_t>(M * K), std::vector<float>(M * nb), std::vector<float>(M * nb),
                  std::vector<int32_t>(M * nb), K, nb};
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // undoes packs' lane interleave
  at::parallel_for(0, M * nb, 256, [&](int64_t b0, int64_t b1) {
    for (int64_t i = b0; i < b1; ++i) {
      const float* v = x + i * 32;  // rows are contiguous: block i of the whole is block i % nb of row i / nb
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
      r.d[i] = d;
      r.s[i] = d * static_cast<float>(sum);
      r.sum[i] = sum;
    }
  });
  return r;
}

// isum[t] += Σ qw q over one block of the group's 8 rows (lanes) for rows t0 … t0 + T - 1 of x; xq: the block's
// 32 values of x row t0 (row t at xq + t · K).
struct Q41 {
  static constexpr int64_t kRecord = 160;
  static inline const uint8_t* chunks(const uint8_t* record) { return record + 32; }
  template <int T>
  static inline __attribute__((always_inline)) void dots(const uint8_t* w, const int8_t* xq, int64_t K, __m256i isum[T]) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    for (int c = 0; c < 4; ++c) {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 * c));
      const __m256i lo = _mm256_and_si256(raw, low), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
      for (int t = 0; t < T; ++t) {
        isum[t] = dot_u8s8(isum[t], lo, broadcast4(xq + t * K + 8 * c));
        isum[t] = dot_u8s8(isum[t], hi, broadcast4(xq + t * K + 8 * c + 4));
      }
    }
  }
};

struct Q80 {
  static constexpr int64_t kRecord = 272;
  static inline const uint8_t* chunks(const uint8_t* record) { return record + 16; }
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  // Σ (qw + 128) · q: the caller takes 128 · Σ q off
  static constexpr bool kOffset = true;
  template <int T>
  static inline __attribute__((always_inline)) void dots(const uint8_t* w, const int8_t* xq, int64_t K, __m256i isum[T]) {
    for (int c = 0; c < 8; ++c) {
      const __m256i u = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 * c));
      for (int t = 0; t < T; ++t) isum[t] = dot_u8s8(isum[t], u, broadcast4(xq + t * K + 4 * c));
    }
  }
#else
  // maddubs would saturate on (qw + 128) · q: |qw| · (q with qw's sign) instead
  static constexpr bool kOffset = false;
  template <int T>
  static inline __attribute__((always_inline)) void dots(const uint8_t* w, const int8_t* xq, int64_t K, __m256i isum[T]) {
    for (int c = 0; c < 8; ++c) {
      const __m256i qw = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 * c)),
                                          _mm256_set1_epi8(static_cast<char>(0x80)));
      const __m256i u = _mm256_abs_epi8(qw);
      for (int t = 0; t < T; ++t) isum[t] = dot_u8s8(isum[t], u, _mm256_sign_epi8(broadcast4(xq + t * K + 4 * c), qw));
    }
  }
#endif
};

// y[t · N + n] for the group's 8 weight rows n (a group of records) by rows t0 … t0 + T - 1 of x.
// (No fused multiply-add: y = y + float(Σ qw q) · (dw · d), each rounded, as the reference does.)
template <class Q, int T>
__attribute__((optimize("fp-contract=off"))) void group_times(const uint8_t* group, const QuantizedRows& x, int64_t t0,
                                                              float* y, int64_t N) {
  __m256 acc[T];
  for (int t = 0; t < T; ++t) acc[t] = _mm256_setzero_ps();
  for (int64_t b = 0; b < x.nb; ++b) {
    const uint8_t* record = group + b * Q::kRecord;
    __m256i isum[T];
    for (int t = 0; t < T; ++t) isum[t] = _mm256_setzero_si256();
    Q::template dots<T>(Q::chunks(record), x.q.data() + t0 * x.K + 32 * b, x.K, isum);
    const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(record)));  // [8]
    for (int t = 0; t < T; ++t) {
      const int64_t at = (t0 + t) * x.nb + b;
      __m256i total = isum[t];
      if constexpr (std::is_same_v<Q, Q80>) {
        if constexpr (Q80::kOffset) total = _mm256_sub_epi32(total, _mm256_set1_epi32(x.sum[at] * 128));
      }
      const __m256 scale = _mm256_mul_ps(dw, _mm256_set1_ps(x.d[at]));
      acc[t] = _mm256_add_ps(acc[t], _mm256_mul_ps(_mm256_cvtepi32_ps(total), scale));
      if constexpr (std::is_same_v<Q, Q41>) {  // + mw · s
        const __m256 mw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(record + 16)));
        acc[t] = _mm256_add_ps(acc[t], _mm256_mul_ps(mw, _mm256_set1_ps(x.s[at])));
      }
    }
  }
  for (int t = 0; t < T; ++t) _mm256_storeu_ps(y + (t0 + t) * N, acc[t]);
}

template <class Q>
void gguf_rows(const float* xp, const uint8_t* bp, int64_t M, int64_t N, int64_t K, float* yp) {
  const QuantizedRows x = quantize_rows(xp, M, K);
  const int64_t group_bytes = x.nb * Q::kRecord;
  // each thread a run of groups, each group read once from memory and multiplied by every row of x, kTile rows
  // of x at a time (the group, 8 · K / 32 records, stays in L1 between tiles)
  at::parallel_for(0, N / 8, 4, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const uint8_t* group = bp + g * group_bytes;
      float* y = yp + 8 * g;
      int64_t t = 0;
      for (; t + kTile <= M; t += kTile) group_times<Q, kTile>(group, x, t, y, N);
      switch (M - t) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
        case 7: group_times<Q, 7>(group, x, t, y, N); break;
        case 6: group_times<Q, 6>(group, x, t, y, N); break;
        case 5: group_times<Q, 5>(group, x, t, y, N); break;
        case 4: group_times<Q, 4>(group, x, t, y, N); break;
#endif
        case 3: group_times<Q, 3>(group, x, t, y, N); break;
        case 2: group_times<Q, 2>(group, x, t, y, N); break;
        case 1: group_times<Q, 1>(group, x, t, y, N); break;
        default: break;
      }
    }
  });
}

}  // namespace

namespace specmesh_cpu {

// x [..., K] · W[N, K]ᵀ with W as GGUF blocks repacked (cpu_linear.pack_gguf): uint8 [N / 8, group bytes], 8
// weight rows a group; kind 8 = Q8_0, 3 = Q4_1 (ggml's type numbers).
at::Tensor linear_gguf(const at::Tensor& x, const at::Tensor& blocks, int64_t kind) {
  TORCH_CHECK(x.device().is_cpu() && blocks.device().is_cpu(), "specmesh_cpu::linear_gguf: CPU tensors");
  TORCH_CHECK(x.scalar_type() == at::kFloat, "specmesh_cpu::linear_gguf: float32 input");
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2, "specmesh_cpu::linear_gguf: uint8 blocks [N / 8, bytes]");
  TORCH_CHECK(kind == 8 || kind == 3, "specmesh_cpu::linear_gguf: Q8_0 (8) or Q4_1 (3) blocks");
  const int64_t N = 8 * blocks.size(0), K = x.size(-1), nb = K / 32;
  const int64_t group_bytes = nb * (kind == 8 ? Q80::kRecord : Q41::kRecord);
  TORCH_CHECK(K % 32 == 0 && blocks.size(1) == group_bytes, "specmesh_cpu::linear_gguf: x [..., K] and packed blocks [N / 8, ",
              group_bytes, "] (cpu_linear.pack_gguf)");
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
