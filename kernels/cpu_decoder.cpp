// The Llama decoder's layers for one CPU step over the paged KV cache read in place, in one call: the loop
// of specmesh_server/lean_llama.py with the same operators in the same order, so the same bits, without a
// Python call per operator (a batch-1 step of SmolLM2-135M made ~30 of them a layer, 30 layers). Built with
// cpu_linear.cpp into one library by cpu_linear.py.
//
// Per layer l (x [b, n, hidden], or a packed step's [1, N, hidden]; T = b·n tokens; H heads, G key/value
// heads of D, g = H / G):
//   h = rms_norm(x)                                    aten::rms_norm's bits (rms_norm below)
//   [q; k; v] = h · Wqkvᵀ                              the fused weight, cpu_linear (float32 or GGUF blocks);
//                                                      or three products, oneDNN's (a step of more rows)
//   q, k = x·cos + rotate_half(x)·sin                  in place, each product and the sum rounded apart
//                                                      (as aten's mul, mul, add: fp-contract off)
//   pool[l][:, slot(t)] = k(t), v(t)                   the tokens' cache slots
//   attention per row over its runs of slots           aten::_scaled_dot_product_flash_attention_for_cpu
//     (attention.paged_attention): runs merged by their log-sum-exp, exactly as there; over GGUF blocks,
//     each query over exactly the keys it sees in column order (ordered_attention, as
//     attention.ordered_attention): the same bits whatever the step, as int8-quantized products need
//   x = x + attn · Woᵀ
//   h = rms_norm(x);  [g; u] = h · Wguᵀ;  x = x + (silu(g) · u) · Wdownᵀ
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <ATen/record_function.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <vector>

#include "cpu_linear.h"

namespace {

// A weight's kind: plain float32 (cpu_linear's kernel), oneDNN's packed weight (torch's packed linear, for
// steps of more rows), or otherwise its GGUF block type.
constexpr int64_t kFloat32 = -1, kOneDNN = -2;

at::Tensor onednn(const at::Tensor& x, const at::Tensor& packed) {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack{x, packed, c10::IValue(), std::string("none"), c10::List<std::optional<at::Scalar>>(),
                          std::string("")};
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

at::Tensor product(const at::Tensor& x, const at::Tensor& w, int64_t kind) {
  if (kind == kOneDNN) return onednn(x, w);  // the dispatcher names it in a profile
  // named as the operators are, so that a profile counts the products apart from the loop around them
  RECORD_FUNCTION(kind == kFloat32 ? "specmesh_cpu::linear" : "specmesh_cpu::linear_gguf", std::vector<c10::IValue>());
  return kind == kFloat32 ? specmesh_cpu::linear(x, w, c10::nullopt) : specmesh_cpu::linear_gguf(x, w, kind);
}

// aten::rms_norm as torch computes it on a CPU (its composite: rsqrt(mean(x²) + eps) · x · w), the same bits,
// with torch's own reduction for the mean (so its summation order) and the rest in two passes instead of
// seven operators: x² and x · r · w each rounded as aten's mul rounds them, r = 1 / sqrt(mean + eps) as
// aten's rsqrt computes it (a square root and a division, each correctly rounded).
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const at::Tensor xc = x.contiguous(), w = weight.contiguous();
  const int64_t H = xc.size(-1), T = xc.numel() / H;
  at::Tensor sq = at::empty_like(xc);
  const float* xp = xc.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* sp = sq.data_ptr<float>();
  at::parallel_for(0, T, 64, [&](int64_t t0, int64_t t1) {
    for (int64_t i = t0 * H; i < t1 * H; ++i) sp[i] = xp[i] * xp[i];
  });
  const at::Tensor mean = at::mean(sq, {-1}, true);  // [..., 1]
  const float* mp = mean.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::Tensor y = at::empty_like(xc);
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, T, 64, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float r = 1.0f / std::sqrt(mp[t] + e);
      for (int64_t h = 0; h < H; ++h) {
        const float v = xp[t * H + h] * r;
        yp[t * H + h] = v * wp[h];
      }
    }
  });
  return y;
}

// qkv [T, (H + 2G)·D]: the first (H + G) heads of each token rotated in place by its cos, sin [T, D].
__attribute__((optimize("fp-contract=off"))) void rope_inplace(
    float* qkv, const float* cos, const float* sin, int64_t T, int64_t rotated, int64_t heads_all, int64_t D) {
  const int64_t half = D / 2;
  std::vector<float> src(D);
  for (int64_t t = 0; t < T; ++t) {
    const float* c = cos + t * D;
    const float* s = sin + t * D;
    for (int64_t h = 0; h < rotated; ++h) {
      float* v = qkv + (t * heads_all + h) * D;
      std::memcpy(src.data(), v, D * sizeof(float));
      for (int64_t d = 0; d < half; ++d) {
        const float a = src[d] * c[d];
        const float r = -src[d + half] * s[d];
        v[d] = a + r;
      }
      for (int64_t d = half; d < D; ++d) {
        const float a = src[d] * c[d];
        const float r = src[d - half] * s[d];
        v[d] = a + r;
      }
    }
  }
}

// The new tokens' keys (heads H..H+G) and values (H+G..H+2G) of qkv [T, H + 2G, D] into their slots of
// one layer's pools [G, slots, D].
void write_slots(const float* qkv, const int64_t* slots, int64_t T, int64_t H, int64_t G, int64_t D, float* keys,
                 float* values, int64_t pool_slots) {
  const int64_t heads_all = H + 2 * G;
  for (int64_t t = 0; t < T; ++t) {
    const float* token = qkv + t * heads_all * D;
    for (int64_t h = 0; h < G; ++h) {
      const int64_t at = (h * pool_slots + slots[t]) * D;
      std::memcpy(keys + at, token + (H + h) * D, D * sizeof(float));
      std::memcpy(values + at, token + (H + G + h) * D, D * sizeof(float));
    }
  }
}

struct Part {
  at::Tensor out;  // [1, G, g·n, D]
  at::Tensor lse;  // [1, G, g·n] fp32
};

Part flash(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::optional<at::Tensor>& mask,
           double scaling) {
  auto [out, lse] = at::_scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, false, mask, scaling);
  return {out, lse};
}


// ---- Attention in key order, for GGUF steps: every query's own sums over exactly the keys it sees, in
// position order, whatever else its step holds. A token decoded alone, in a tree or in a packed step sees
// the same keys (its prefix and its ancestors, the same bits), so its output is the same bits; flash
// attention's blocking and the runs' log-sum-exp merge depend on the step's shape and the cache's
// layout, a difference of an ulp that int8-quantized activations (linear_gguf) can turn into a flipped
// rounding, and so into a different token. Per query (one head, one token), over its visible keys
// (mask_k > −1e30) in column order, 1 … m:
//   s_k = (q · k_k) · scaling + mask_k      q · k: 8 lanes of partial sums over d in order (lane d mod 8),
//                                           then ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7))
//   p_k = exp(s_k − max s)
//   Σ p: 8 lanes over k in order (lane k mod 8), reduced as above;  Σ p_k · v_k: per d, over k in order
//   out = (Σ p_k · v_k) / Σ p
// Every sum runs over the query's own visible keys only, so the keys its step adds (a sibling branch, other
// tokens of a tree) change nothing. The work is shared where the bits allow: 8 keys' dot products at once
// against one query (8 independent chains, one reduction for the 8), a tile of queries over each group of
// 8 keys, and each chunk of values kept in L1 while the tile's queries pass over it.
struct Key {
  int64_t col;     // the key's column in the mask: its position in the row's keys
  int64_t index;   // its slot in the pool, or its index in the short runs' copies
  bool copied;     // where it lies
  bool masked;     // whether the mask applies (a run wholly below the row's shared part is seen by all)
};

// A group of 8 of a row's keys: all seen by every query (unmasked, none past the row's last: its mask is 0),
// all masked at 8 consecutive columns (a vector of the mask's row), or otherwise key by key.
enum GroupKind : uint8_t { kOpen, kRun, kMixed };

struct RowKeys {
  std::vector<Key> keys;        // sorted by column
  std::vector<uint8_t> groups;  // GroupKind of keys 8g … 8g + 7
};

// Each row's keys, sorted by column: its runs' (row, slot, start, stop, masked) in the pool, then its copied
// run's positions (gathered[i] = its first index in the copies, masked); and their groups' kinds. Once a step.
std::vector<RowKeys> key_lists(const at::Tensor& runs, const at::Tensor& gathered, at::TensorList positions, int64_t B) {
  TORCH_CHECK(runs.dim() == 2 && runs.size(1) == 5 && gathered.size(0) == B && static_cast<int64_t>(positions.size()) == B,
              "ordered attention: every row's runs, copied run and positions");
  const auto run = runs.accessor<int64_t, 2>();
  const auto gath = gathered.accessor<int64_t, 2>();
  std::vector<RowKeys> rows(B);
  for (int64_t r = 0, i = 0; i < B; ++i) {
    std::vector<Key>& ks = rows[i].keys;
    for (; r < runs.size(0) && run[r][0] == i; ++r)
      for (int64_t c = run[r][2]; c < run[r][3]; ++c) ks.push_back({c, run[r][1] + c - run[r][2], false, run[r][4] != 0});
    const at::Tensor cols = positions[i].contiguous();
    const int64_t* cp = cols.data_ptr<int64_t>();
    for (int64_t c = 0; c < cols.numel(); ++c) ks.push_back({cp[c], gath[i][0] + c, true, gath[i][1] != 0});
    std::stable_sort(ks.begin(), ks.end(), [](const Key& a, const Key& b) { return a.col < b.col; });
    const int64_t n = static_cast<int64_t>(ks.size());
    for (int64_t k0 = 0; k0 < n; k0 += 8) {
      bool open = k0 + 8 <= n, masked_run = k0 + 8 <= n;
      for (int64_t l = 0; l < 8 && (open || masked_run); ++l) {
        open = open && !ks[k0 + l].masked;
        masked_run = masked_run && ks[k0 + l].masked && ks[k0 + l].col == ks[k0].col + l;
      }
      rows[i].groups.push_back(open ? kOpen : masked_run ? kRun : kMixed);
    }
  }
  return rows;
}

// lane j = the sum of v[j]'s 8 lanes, ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)), each lane alone
inline __m256 reduce8(const __m256 v[8]) {
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

// lane j = q · k[j] for 8 keys (D = 8·V; V = 0: any D)
template <int V>
inline __m256 dots8(const float* q, const float* const k[8], int64_t D) {
  __m256 acc[8];
  for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
  const int64_t lanes = V > 0 ? V : D / 8;
  for (int64_t v = 0; v < lanes; ++v) {
    const __m256 qv = _mm256_loadu_ps(q + 8 * v);
    for (int j = 0; j < 8; ++j) acc[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[j] + 8 * v), acc[j]);
  }
  return reduce8(acc);
}

// exp(x) in 8 lanes for x ≤ 0 (a score less its query's maximum), each lane alone (Cephes' expf: 2^n · e^r,
// |r| ≤ ln 2 / 2, a degree-6 polynomial; relative error ~1e-7); below −87, 2^−126-ish, not 0.
inline __m256 exp_nonpositive(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// acc [D] += Σ p_k · v_k over keys[from, to) of a query's visible keys, in order (D = 8·V lanes in registers;
// V = 0: any D, through memory)
template <int V>
inline void weighted_values(const int32_t* keys, const float* p, int64_t from, int64_t to, const float* const* value,
                            int64_t D, float* acc) {
  if constexpr (V == 0) {
    for (int64_t k = from; k < to; ++k) {
      const float* v = value[keys[k]];
      const __m256 pv = _mm256_set1_ps(p[k]);
      for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(acc + d, _mm256_fmadd_ps(pv, _mm256_loadu_ps(v + d), _mm256_loadu_ps(acc + d)));
    }
  } else {
    __m256 a[V];
    for (int v = 0; v < V; ++v) a[v] = _mm256_loadu_ps(acc + 8 * v);
    for (int64_t k = from; k < to; ++k) {
      const float* value_k = value[keys[k]];
      const __m256 pv = _mm256_set1_ps(p[k]);
      for (int v = 0; v < V; ++v) a[v] = _mm256_fmadd_ps(pv, _mm256_loadu_ps(value_k + 8 * v), a[v]);
    }
    for (int v = 0; v < V; ++v) _mm256_storeu_ps(acc + 8 * v, a[v]);
  }
}

constexpr int64_t kQueryTile = 8;   // queries over each group of 8 keys
constexpr int64_t kValueChunk = 32;  // keys whose values stay in L1 while a tile's queries pass

// One task: queries [j0, j1) of row i, key/value head h (see above).
template <int V>
void attend_tile(const float* qp, int64_t i, int64_t h, int64_t j0, int64_t j1, int64_t G, int64_t Q, int64_t D,
                 const RowKeys& row, const float* pool_k, const float* pool_v, int64_t pool_stride,
                 const float* copy_k, const float* copy_v, int64_t copy_stride, const float* mp, int64_t mask_row,
                 int64_t mask_query, float scale, const float* zeros, float* op) {
  constexpr float kNone = -std::numeric_limits<float>::infinity();
  // −∞, or any dtype's most negative value (transformers' masks hold finfo.min): a key the query does not see
  constexpr float kUnseen = -1e30f;
  const std::vector<Key>& ks = row.keys;
  const int64_t n = static_cast<int64_t>(ks.size()), groups = (n + 7) / 8, J = j1 - j0;
  std::vector<const float*> kptr(8 * groups, zeros), vptr(n);
  for (int64_t k = 0; k < n; ++k) {
    const int64_t at = ks[k].index * D;
    kptr[k] = ks[k].copied ? copy_k + h * copy_stride + at : pool_k + h * pool_stride + at;
    vptr[k] = ks[k].copied ? copy_v + h * copy_stride + at : pool_v + h * pool_stride + at;
  }
  const std::vector<uint8_t>& kind = row.groups;
  // scores [J, 8·groups], −∞ where unseen
  std::vector<float> score(J * 8 * groups);
  const __m256 scale8 = _mm256_set1_ps(scale), none8 = _mm256_set1_ps(kNone), unseen8 = _mm256_set1_ps(kUnseen);
  for (int64_t grp = 0; grp < groups; ++grp) {
    const float* const* k8 = kptr.data() + 8 * grp;
    for (int64_t j = 0; j < J; ++j) {
      const float* row_mask = mp + i * mask_row + (j0 + j) * mask_query;
      __m256 m8;  // the 8 keys' mask values, −∞ where unseen
      if (kind[grp] == kOpen) {
        m8 = _mm256_setzero_ps();
      } else {
        if (kind[grp] == kRun) {
          m8 = _mm256_loadu_ps(row_mask + ks[8 * grp].col);
        } else {
          float mk[8];
          for (int64_t l = 0; l < 8; ++l) {
            const int64_t k = 8 * grp + l;
            mk[l] = k >= n ? kNone : ks[k].masked ? row_mask[ks[k].col] : 0.0f;
          }
          m8 = _mm256_setr_ps(mk[0], mk[1], mk[2], mk[3], mk[4], mk[5], mk[6], mk[7]);
        }
        m8 = _mm256_blendv_ps(m8, none8, _mm256_cmp_ps(m8, unseen8, _CMP_LT_OQ));
      }
      float* out8 = score.data() + (j * groups + grp) * 8;
      const __m256 hidden = _mm256_cmp_ps(m8, none8, _CMP_EQ_OQ);
      if (_mm256_movemask_ps(hidden) == 0xFF) {  // none of the 8 seen (a causal prefill's later keys): no products
        _mm256_storeu_ps(out8, none8);
        continue;
      }
      const __m256 s8 = _mm256_fmadd_ps(dots8<V>(qp + ((i * G + h) * Q + j0 + j) * D, k8, D), scale8, m8);
      _mm256_storeu_ps(out8, _mm256_blendv_ps(s8, none8, hidden));
    }
  }
  // per query: its visible keys, p_k = exp(s_k − max s), Σ p (8 lanes over its visible keys)
  std::vector<int32_t> seen(J * n + 8);
  std::vector<float> prob(J * (n + 8));
  std::vector<int64_t> count(J), cursor(J, 0);
  std::vector<float> total(J);
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (int64_t j = 0; j < J; ++j) {
    const float* sj = score.data() + j * groups * 8;
    int32_t* seen_j = seen.data() + j * n;
    float* pj = prob.data() + j * (n + 8);
    __m256 max8 = none8;
    int64_t m = 0;
    for (int64_t k0 = 0; k0 < n; k0 += 8) {  // 8 keys at a time: all seen, none, or key by key
      const __m256 s8 = _mm256_loadu_ps(sj + k0);
      const int hidden = _mm256_movemask_ps(_mm256_cmp_ps(s8, none8, _CMP_EQ_OQ));
      if (hidden == 0xFF) continue;
      max8 = _mm256_max_ps(max8, s8);
      if (hidden == 0 && k0 + 8 <= n) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(seen_j + m), _mm256_add_epi32(_mm256_set1_epi32(static_cast<int32_t>(k0)), lane));
        _mm256_storeu_ps(pj + m, s8);
        m += 8;
        continue;
      }
      for (int64_t k = k0; k < std::min(n, k0 + 8); ++k) {
        if (sj[k] == kNone) continue;
        seen_j[m] = static_cast<int32_t>(k);
        pj[m++] = sj[k];
      }
    }
    float top_lanes[8];
    _mm256_storeu_ps(top_lanes, max8);
    const float top = *std::max_element(top_lanes, top_lanes + 8);
    count[j] = m;
    const __m256 top8 = _mm256_set1_ps(top);
    __m256 sum = _mm256_setzero_ps();
    for (int64_t k = 0; k < m; k += 8) {
      const __m256 live = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(m - k)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
      const __m256 e = _mm256_and_ps(live, exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(pj + k), top8)));
      _mm256_storeu_ps(pj + k, e);
      sum = _mm256_add_ps(sum, e);
    }
    total[j] = specmesh_cpu::hsum(sum);
  }
  // Σ p_k · v_k, a chunk of keys' values at a time for every query of the tile
  std::vector<float> acc(J * D, 0.0f);
  for (int64_t c0 = 0; c0 < n; c0 += kValueChunk) {
    const int32_t stop = static_cast<int32_t>(std::min(n, c0 + kValueChunk));
    for (int64_t j = 0; j < J; ++j) {
      const int32_t* seen_j = seen.data() + j * n;
      int64_t to = cursor[j];
      while (to < count[j] && seen_j[to] < stop) ++to;
      if (to > cursor[j])
        weighted_values<V>(seen_j, prob.data() + j * (n + 8), cursor[j], to, vptr.data(), D, acc.data() + j * D);
      cursor[j] = to;
    }
  }
  for (int64_t j = 0; j < J; ++j) {
    float* o = op + ((i * G + h) * Q + j0 + j) * D;
    if (count[j] == 0) {  // a padding query sees nothing
      std::fill(o, o + D, 0.0f);
      continue;
    }
    for (int64_t d = 0; d < D; ++d) o[d] = acc[j * D + d] / total[j];
  }
}

// out [B, G, g·w, D] for q [B, G, g·w, D]: row i's queries over keys[i] (sorted by column), the pools'
// [G, slots, D] and the copies' [G, copies, D] (heads at their strides).
void ordered_attention(const at::Tensor& q, const float* pool_k, const float* pool_v, int64_t pool_stride,
                       const float* copy_k, const float* copy_v, int64_t copy_stride,
                       const std::vector<RowKeys>& keys, const at::Tensor& mask, double scaling, at::Tensor& out) {
  const int64_t B = q.size(0), G = q.size(1), Q = q.size(2), D = q.size(3);
  TORCH_CHECK(D % 8 == 0, "decode_layers: GGUF steps need a head size that is a multiple of 8");
  RECORD_FUNCTION("specmesh_cpu::ordered_attention", std::vector<c10::IValue>());  // a profile counts it as attention
  const float* qp = q.data_ptr<float>();
  // the folded mask [B or 1, 1, g·w or 1, columns]: a step of one token has one row of it for all g heads
  at::Tensor m = mask.to(at::kFloat).expand({B, 1, Q, mask.size(3)});
  if (m.stride(3) != 1) m = m.contiguous();
  const float* mp = m.data_ptr<float>();
  const int64_t mask_row = m.stride(0), mask_query = m.stride(2);
  float* op = out.data_ptr<float>();
  const std::vector<float> zeros(D, 0.0f);  // the key of a group's lanes past the row's last
  // tiles small enough that every thread has work (the result does not depend on the tiling)
  const int64_t threads = at::get_num_threads();
  const int64_t tile = std::clamp<int64_t>((B * G * Q) / (4 * threads), 1, kQueryTile);
  const int64_t tiles = (Q + tile - 1) / tile;
  at::parallel_for(0, B * G * tiles, 1, [&](int64_t a, int64_t b) {
    for (int64_t task = a; task < b; ++task) {
      const int64_t i = task / (G * tiles), h = task / tiles % G, j0 = task % tiles * tile, j1 = std::min(Q, j0 + tile);
      auto run = [&](auto attend) {
        attend(qp, i, h, j0, j1, G, Q, D, keys[i], pool_k, pool_v, pool_stride, copy_k, copy_v, copy_stride, mp, mask_row,
               mask_query, static_cast<float>(scaling), zeros.data(), op);
      };
      if (D == 64) {
        run(attend_tile<8>);
      } else if (D == 128) {
        run(attend_tile<16>);
      } else {
        run(attend_tile<0>);
      }
    }
  });
}

}  // namespace

namespace specmesh_cpu {

// Every layer of the step; returns x after the last (before the final norm). See the file's head, and
// cpu_linear.decode_layers for the arguments.
at::Tensor decode_layers(
    at::Tensor x,                        // float32 [b, n, hidden]
    const at::Tensor& cos,               // float32 [b·n, D]
    const at::Tensor& sin,               // float32 [b·n, D]
    at::TensorList norms,                // per layer: the input norm's and the post-attention norm's [hidden]
    at::TensorList products,             // per layer: qkv, o, gate_up, down (fused) or q, k, v, o, gate, up, down
    at::IntArrayRef kinds,               // each product's kind (kFloat32, kOneDNN or a GGUF type)
    const at::Tensor& keys,              // float32 [layers, G, slots, D]
    const at::Tensor& values,            // float32 [layers, G, slots, D]
    const at::Tensor& write,             // int64 [b·n]: each token's slot
    const at::Tensor& read_blocks,       // int64 [m]: the blocks the rows' short runs copy, in order
    int64_t block_size,
    const at::Tensor& runs,              // int64 [R, 5]: row, slot, start, stop, masked
    const at::Tensor& gathered,          // int64 [B, 2]: per row its copied run's first slot in the copies, masked
    at::TensorList gathered_positions,   // int64 [count] per row: the copied run's positions (empty: none)
    const at::Tensor& mask,              // float32 [B, 1, g·w, kv_len]: the folded mask
    const std::optional<at::Tensor>& pack_rows,  // a packed step (x [1, N, hidden]): token t's row, int64 [N]
    const std::optional<at::Tensor>& pack_cols,  // and its column in the padded layout [B, w]
    int64_t pack_width,                  // w: the padded layout's width (a packed step's)
    int64_t heads, int64_t kv_heads, double eps, double scaling,
    bool ordered) {                      // attention in key order (ordered_attention): a model over GGUF blocks
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 3 && x.is_contiguous(), "decode_layers: x float32 [b, n, hidden]");
  TORCH_CHECK(keys.is_contiguous() && values.is_contiguous() && keys.scalar_type() == at::kFloat, "decode_layers: float32 pools");
  const int64_t L = keys.size(0), b = x.size(0), n = x.size(1), hidden = x.size(2), T = b * n;
  const int64_t G = kv_heads, H = heads, D = keys.size(3), g = H / G, slots = keys.size(2);
  // Attention reads B rows of w tokens: the step's own layout, or a packed step's padded one (its queries
  // scattered there and its outputs gathered back, as attention.Packing does).
  const bool packed = pack_rows.has_value() && pack_rows->defined();
  const int64_t B = gathered.size(0), w = packed ? pack_width : n;
  TORCH_CHECK(packed ? (b == 1 && pack_cols.has_value() && pack_rows->numel() == T) : B == b,
              "decode_layers: a packed step brings one row [1, N] and each token's row and column");
  at::Tensor slot_of;  // a packed token's place in the padded layout, row · w + column: int64 [N]
  if (packed) slot_of = *pack_rows * w + *pack_cols;
  const int64_t per = static_cast<int64_t>(products.size()) / L;
  TORCH_CHECK(static_cast<int64_t>(norms.size()) == 2 * L && (per == 4 || per == 7) &&
              static_cast<int64_t>(products.size()) == per * L && kinds.size() == products.size(),
              "decode_layers: every layer's norms, and its 4 (fused) or 7 products with their kinds");
  TORCH_CHECK(write.numel() == T && runs.dim() == 2 && runs.size(1) == 5 && gathered.dim() == 2 && gathered.size(1) == 2 &&
              static_cast<int64_t>(gathered_positions.size()) == gathered.size(0), "decode_layers: the rows' reads");
  const at::Tensor c = cos.contiguous(), s = sin.contiguous(), slot = write.contiguous();
  const auto run = runs.accessor<int64_t, 2>();
  const auto gath = gathered.accessor<int64_t, 2>();
  const int64_t copied = read_blocks.numel();
  at::Tensor gk, gv;  // the short runs' copies, [G, m·bs, D], reused across layers
  if (copied) {
    gk = at::empty({G, copied, block_size * D}, keys.options());
    gv = at::empty({G, copied, block_size * D}, keys.options());
  }
  // attention in key order (ordered_attention): each row's keys, sorted by column, once for every layer
  const std::vector<RowKeys> row_keys = ordered ? key_lists(runs, gathered, gathered_positions, B) : std::vector<RowKeys>();
  for (int64_t l = 0; l < L; ++l) {
    const at::TensorList p = products.slice(per * l, per);
    const at::IntArrayRef k = kinds.slice(per * l, per);
    at::Tensor h = rms_norm(x, norms[2 * l], eps);
    at::Tensor fused = per == 4 ? product(h, p[0], k[0])
                                : at::cat({product(h, p[0], k[0]), product(h, p[1], k[1]), product(h, p[2], k[2])},
                                          -1);  // [b, n, (H + 2G)·D]
    rope_inplace(fused.data_ptr<float>(), c.data_ptr<float>(), s.data_ptr<float>(), T, H + G, H + 2 * G, D);
    at::Tensor pk = keys[l], pv = values[l];  // [G, slots, D]
    write_slots(fused.data_ptr<float>(), slot.data_ptr<int64_t>(), T, H, G, D, pk.data_ptr<float>(),
                pv.data_ptr<float>(), slots);
    if (copied) {
      at::index_select_out(gk, pk.view({G, -1, block_size * D}), 1, read_blocks);
      at::index_select_out(gv, pv.view({G, -1, block_size * D}), 1, read_blocks);
    }
    at::Tensor q;  // [B, G, g·w, D]: the heads sharing a key/value head side by side (attention.fold_queries)
    if (packed) {
      at::Tensor pad = at::zeros({B * w, H, D}, x.options());  // padding's queries zero, their outputs dropped
      pad.index_copy_(0, slot_of, fused.view({T, H + 2 * G, D}).slice(1, 0, H));
      q = pad.view({B, w, H, D}).transpose(1, 2).reshape({B, G, g * w, D});
    } else {
      q = fused.view({b, n, H + 2 * G, D}).slice(2, 0, H).transpose(1, 2).reshape({b, G, g * n, D});
    }
    at::Tensor out = at::empty({B, G, g * w, D}, x.options());
    if (ordered) {
      const at::Tensor qc = q.contiguous();
      ordered_attention(qc, pk.data_ptr<float>(), pv.data_ptr<float>(), slots * D, copied ? gk.data_ptr<float>() : nullptr,
                        copied ? gv.data_ptr<float>() : nullptr, copied * block_size * D, row_keys, mask, scaling, out);
    } else {  // flash attention per run, the runs merged by their log-sum-exp
      std::vector<Part> parts;
      int64_t r = 0;
      for (int64_t i = 0; i < B; ++i) {
        parts.clear();
        const at::Tensor qi = q.slice(0, i, i + 1);
        for (; r < runs.size(0) && run[r][0] == i; ++r) {
          const int64_t at_slot = run[r][1], start = run[r][2], stop = run[r][3];
          const at::Tensor kr = pk.slice(1, at_slot, at_slot + stop - start).unsqueeze(0);
          const at::Tensor vr = pv.slice(1, at_slot, at_slot + stop - start).unsqueeze(0);
          std::optional<at::Tensor> m;
          if (run[r][4]) m = mask.slice(0, i, i + 1).slice(3, start, stop);
          parts.push_back(flash(qi, kr, vr, m, scaling));
        }
        if (const int64_t count = gathered_positions[i].numel()) {
          const int64_t from = gath[i][0];
          const at::Tensor kr = gk.view({G, -1, D}).slice(1, from, from + count).unsqueeze(0);
          const at::Tensor vr = gv.view({G, -1, D}).slice(1, from, from + count).unsqueeze(0);
          std::optional<at::Tensor> m;
          if (gath[i][1]) m = mask.slice(0, i, i + 1).index_select(3, gathered_positions[i]);
          parts.push_back(flash(qi, kr, vr, m, scaling));
        }
        TORCH_CHECK(!parts.empty(), "decode_layers: row ", i, " reads nothing");
        if (parts.size() == 1) {
          out[i].copy_(parts[0].out[0]);
          continue;
        }
        // out = Σ_r exp(lse_r − LSE) · out_r: the runs' softmaxes weighted by their shares of the row's mass
        std::vector<at::Tensor> outs, lses;
        for (const Part& p : parts) {
          outs.push_back(p.out[0]);
          lses.push_back(p.lse[0]);
        }
        const at::Tensor weights = at::softmax(at::stack(lses), 0);  // [runs, G, g·n]
        out[i].copy_((weights.unsqueeze(-1) * at::stack(outs).to(at::kFloat)).sum(0));
      }
    }
    at::Tensor attn = out.view({B, H, w, D}).transpose(1, 2).contiguous();  // [B, w, H, D]
    attn = (packed ? attn.view({B * w, H, D}).index_select(0, slot_of) : attn).view({b, n, H * D});
    const int64_t o = per == 4 ? 1 : 3;
    x = x + product(attn, p[o], k[o]);
    h = rms_norm(x, norms[2 * l + 1], eps);
    at::Tensor gate, up;  // [b, n, I] each
    if (per == 4) {
      const auto halves = product(h, p[2], k[2]).chunk(2, -1);  // [g; u] = h · Wguᵀ
      gate = halves[0], up = halves[1];
    } else {
      gate = product(h, p[4], k[4]), up = product(h, p[5], k[5]);
    }
    x = x + product(at::silu(gate.contiguous()) * up, p[per - 1], k[per - 1]);
  }
  return x;
}


// ordered_attention as an operator, for the Python loops over GGUF weights (attention.ordered_attention):
// q [B, G, Q, D] (folded queries), pools [G, slots, D], copies [G, copies, D] (or empty), each row's runs and
// copied run as decode_layers takes them, the folded mask [B or 1, 1, Q or 1, columns] → [B, G, Q, D].
at::Tensor ordered_attention_op(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                                const at::Tensor& copied_keys, const at::Tensor& copied_values, const at::Tensor& runs,
                                const at::Tensor& gathered, at::TensorList positions, const at::Tensor& mask, double scaling) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && keys.scalar_type() == at::kFloat && q.dim() == 4 && keys.dim() == 3,
              "ordered_attention: float32 q [B, G, Q, D] and pools [G, slots, D]");
  const at::Tensor qc = q.contiguous(), kc = keys.contiguous(), vc = values.contiguous();
  const at::Tensor ck = copied_keys.contiguous(), cv = copied_values.contiguous();
  const bool copies = ck.numel() > 0;
  at::Tensor out = at::empty_like(qc);
  ordered_attention(qc, kc.data_ptr<float>(), vc.data_ptr<float>(), kc.size(1) * kc.size(2),
                    copies ? ck.data_ptr<float>() : nullptr, copies ? cv.data_ptr<float>() : nullptr,
                    copies ? ck.size(1) * ck.size(2) : 0, key_lists(runs, gathered, positions, q.size(0)), mask, scaling, out);
  return out;
}

}  // namespace specmesh_cpu

TORCH_LIBRARY_FRAGMENT(specmesh_cpu, m) {
  m.def(
      "decode_layers(Tensor x, Tensor cos, Tensor sin, Tensor[] norms, Tensor[] products, int[] kinds, "
      "Tensor keys, Tensor values, Tensor write, "
      "Tensor read_blocks, int block_size, Tensor runs, Tensor gathered, Tensor[] gathered_positions, Tensor mask, "
      "Tensor? pack_rows, Tensor? pack_cols, int pack_width, int heads, int kv_heads, float eps, float scaling, "
      "bool ordered) -> Tensor");
}
TORCH_LIBRARY_FRAGMENT(specmesh_cpu, m) {
  m.def(
      "ordered_attention(Tensor q, Tensor keys, Tensor values, Tensor copied_keys, Tensor copied_values, Tensor runs, "
      "Tensor gathered, Tensor[] positions, Tensor mask, float scaling) -> Tensor");
}
TORCH_LIBRARY_IMPL(specmesh_cpu, CPU, m) {
  m.impl("decode_layers", &specmesh_cpu::decode_layers);
  m.impl("ordered_attention", &specmesh_cpu::ordered_attention_op);
}
// oneDNN's packed weights are MkldnnCPU tensors: a step that brings them dispatches there
TORCH_LIBRARY_IMPL(specmesh_cpu, MkldnnCPU, m) { m.impl("decode_layers", &specmesh_cpu::decode_layers); }
