// Ragged attention over per-sequence KV caches, one call per layer for every row of a
// forward (specdec native runtime; see specdec/runtime/kernels.py).
//
// Each (row, KV head) task computes, in a fixed order that depends only on the row's
// query, its visible keys (in position order) and their values:
//   s_j = scale * <q, k_j>          16 partial sums over d, then a fixed pairwise tree
//   p_j = exp(s_j - max_j s_j)      float32
//   o   = (sum_j p_j v_j) / sum_j p_j  accumulated over j in position order
// so a row gets the same bits decoded alone, verified in a chain or a token tree, or
// next to any other sequences (batch invariance by construction: no blocking depends on
// the batch). Keys and values are read in their storage dtype, converted per element.
#include "common.h"

#include <ATen/Parallel.h>

#include <vector>

namespace {

using namespace specdec;

#if defined(__AVX512F__)
constexpr int kMaxVec = 8;  // head_dim 64 or 128
constexpr int kMaxGroup = 16;  // query heads per KV head

// One (row, KV head) task with AVX-512: the same arithmetic for every call.
template <typename scalar_t, int nv>
void task_avx512(const scalar_t* qrow, const scalar_t* K, const scalar_t* V, const int64_t* sl,
                 int64_t n, int64_t R, float scale, std::vector<float>& scores, float* acc_out) {
  constexpr int64_t D = nv * kLanes;
  __m512 qv[kMaxGroup][kMaxVec];
  for (int64_t r = 0; r < R; ++r)
    for (int c = 0; c < nv; ++c) qv[r][c] = load16(qrow + r * D + c * kLanes);
  scores.resize(R * n);
  __m512 kv[kMaxVec];
  for (int64_t j = 0; j < n; ++j) {
    const scalar_t* k = K + (sl ? sl[j] : j) * D;
    for (int c = 0; c < nv; ++c) kv[c] = load16(k + c * kLanes);
    for (int64_t r = 0; r < R; ++r) {
      __m512 a = _mm512_mul_ps(qv[r][0], kv[0]);
      for (int c = 1; c < nv; ++c) a = _mm512_fmadd_ps(qv[r][c], kv[c], a);
      scores[r * n + j] = _mm512_reduce_add_ps(a) * scale;
    }
  }
  float denom[kMaxGroup];
  for (int64_t r = 0; r < R; ++r) {
    float* sr = scores.data() + r * n;
    float m = -INFINITY;
    for (int64_t j = 0; j < n; ++j) m = sr[j] > m ? sr[j] : m;
    const __m512 mv = _mm512_set1_ps(m);
    __m512 sum = _mm512_setzero_ps();
    int64_t j = 0;
    for (; j + kLanes <= n; j += kLanes) {
      const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(sr + j), mv));
      _mm512_storeu_ps(sr + j, e);
      sum = _mm512_add_ps(sum, e);
    }
    if (j < n) {
      const __mmask16 mask = static_cast<__mmask16>((1u << (n - j)) - 1u);
      const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, sr + j), mv));
      _mm512_mask_storeu_ps(sr + j, mask, e);
      sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(mask, e));
    }
    denom[r] = _mm512_reduce_add_ps(sum);
  }
  __m512 acc[kMaxGroup][kMaxVec];
  for (int64_t r = 0; r < R; ++r)
    for (int c = 0; c < nv; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    const scalar_t* v = V + (sl ? sl[j] : j) * D;
    for (int c = 0; c < nv; ++c) kv[c] = load16(v + c * kLanes);
    for (int64_t r = 0; r < R; ++r) {
      const __m512 p = _mm512_set1_ps(scores[r * n + j]);
      for (int c = 0; c < nv; ++c) acc[r][c] = _mm512_fmadd_ps(p, kv[c], acc[r][c]);
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    const __m512 inv = _mm512_set1_ps(1.f / denom[r]);
    for (int c = 0; c < nv; ++c)
      _mm512_storeu_ps(acc_out + r * D + c * kLanes, _mm512_mul_ps(acc[r][c], inv));
  }
}
#endif

template <typename scalar_t>
void run(const torch::Tensor& q, const std::vector<torch::Tensor>& kv, int64_t layer, const int64_t* row_seq,
         const int64_t* row_n, const int64_t* row_off, const int64_t* slots, float scale,
         torch::Tensor& out) {
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t G = kv[0].size(2);
  const int64_t R = H / G;
  const int64_t Dv = (D / kLanes) * kLanes;
  std::vector<const scalar_t*> base;
  std::vector<int64_t> capacity;
  for (const auto& t : kv) {
    capacity.push_back(t.size(3));
    base.push_back(t.data_ptr<scalar_t>() + layer * 2 * G * t.size(3) * D);
  }
  const scalar_t* qp = q.data_ptr<scalar_t>();
  scalar_t* op = out.data_ptr<scalar_t>();
  at::parallel_for(0, T * G, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(R * D), kf(D), acc(R * D), scores;
    float lane[kLanes];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t t = task / G, g = task % G;
      const int64_t s = row_seq[t];
      if (s < 0) continue;
      const int64_t n = row_n[t], off = row_off[t], cap = capacity[s];
      const scalar_t* K = base[s] + g * cap * D;
      const scalar_t* V = base[s] + (G + g) * cap * D;
#if defined(__AVX512F__)
      if ((D == 64 || D == 128) && R <= kMaxGroup) {
        const scalar_t* qrow = qp + (t * H + g * R) * D;
        const int64_t* sl = off < 0 ? nullptr : slots + off;
        if (D == 64)
          task_avx512<scalar_t, 4>(qrow, K, V, sl, n, R, scale, scores, acc.data());
        else
          task_avx512<scalar_t, 8>(qrow, K, V, sl, n, R, scale, scores, acc.data());
        for (int64_t r = 0; r < R; ++r) {
          scalar_t* o = op + (t * H + g * R + r) * D;
          for (int64_t i = 0; i < D; ++i) o[i] = static_cast<scalar_t>(acc[r * D + i]);
        }
        continue;
      }
#endif
      for (int64_t r = 0; r < R; ++r)
        for (int64_t i = 0; i < D; ++i) qf[r * D + i] = to_float(qp[(t * H + g * R + r) * D + i]);
      scores.resize(R * n);
      for (int64_t j = 0; j < n; ++j) {
        const int64_t slot = off < 0 ? j : slots[off + j];
        const scalar_t* k = K + slot * D;
        for (int64_t i = 0; i < D; ++i) kf[i] = to_float(k[i]);
        for (int64_t r = 0; r < R; ++r) {
          const float* qr = qf.data() + r * D;
          for (int l = 0; l < kLanes; ++l) lane[l] = 0.f;
          for (int64_t i = 0; i < Dv; i += kLanes)
            for (int l = 0; l < kLanes; ++l) lane[l] += qr[i + l] * kf[i + l];
          for (int64_t i = Dv; i < D; ++i) lane[i - Dv] += qr[i] * kf[i];
          scores[r * n + j] = tree_sum(lane) * scale;
        }
      }
      std::vector<float> denom(R);
      for (int64_t r = 0; r < R; ++r) {
        float* sr = scores.data() + r * n;
        float m = -INFINITY;
        for (int64_t j = 0; j < n; ++j) m = sr[j] > m ? sr[j] : m;
        float sum = 0.f;
        for (int64_t j = 0; j < n; ++j) {
          sr[j] = std::exp(sr[j] - m);
          sum += sr[j];
        }
        denom[r] = sum;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t j = 0; j < n; ++j) {
        const int64_t slot = off < 0 ? j : slots[off + j];
        const scalar_t* v = V + slot * D;
        for (int64_t i = 0; i < D; ++i) kf[i] = to_float(v[i]);
        for (int64_t r = 0; r < R; ++r) {
          const float p = scores[r * n + j];
          float* a = acc.data() + r * D;
          for (int64_t i = 0; i < D; ++i) a[i] += p * kf[i];
        }
      }
      for (int64_t r = 0; r < R; ++r) {
        scalar_t* o = op + (t * H + g * R + r) * D;
        const float inv = 1.f / denom[r];
        for (int64_t i = 0; i < D; ++i) o[i] = static_cast<scalar_t>(acc[r * D + i] * inv);
      }
    }
  });
}

}  // namespace

void check_caches(const std::vector<torch::Tensor>& kv, int64_t layer, int64_t D,
                  c10::ScalarType dtype) {
  TORCH_CHECK(!kv.empty(), "no KV caches");
  for (const auto& t : kv)
    TORCH_CHECK(t.dim() == 5 && t.size(1) == 2 && t.is_contiguous() && t.scalar_type() == dtype &&
                    t.size(4) == D && layer >= 0 && layer < t.size(0),
                "each KV cache must be a contiguous [L, 2, G, C, D] tensor of the queries' dtype");
}

// q: [T, H, D] contiguous; kv: per sequence [L, 2, G, C, D] contiguous, q's dtype (the
// layer `layer` is read); row_seq [T] int64 (-1: row skipped); row_n [T] int64 visible
// keys; row_off [T] int64 offset of the row's slots in `slots` (-1: slots 0 .. n-1);
// out: [T, H * D], q's dtype.
void ragged_attention(torch::Tensor q, std::vector<torch::Tensor> kv, int64_t layer,
                      torch::Tensor row_seq, torch::Tensor row_n, torch::Tensor row_off,
                      torch::Tensor slots, double scale, torch::Tensor out) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "q must be a contiguous [T, H, D] tensor");
  TORCH_CHECK(out.is_contiguous() && out.scalar_type() == q.scalar_type(), "bad out");
  check_caches(kv, layer, q.size(2), q.scalar_type());
  TORCH_CHECK(q.size(1) % kv[0].size(2) == 0, "heads must be a multiple of KV heads");
  const int64_t* rs = row_seq.data_ptr<int64_t>();
  const int64_t* rn = row_n.data_ptr<int64_t>();
  const int64_t* ro = row_off.data_ptr<int64_t>();
  const int64_t* sl = slots.numel() ? slots.data_ptr<int64_t>() : nullptr;
  const float sc = static_cast<float>(scale);
  switch (q.scalar_type()) {
    case torch::kFloat32: run<float>(q, kv, layer, rs, rn, ro, sl, sc, out); break;
    case torch::kBFloat16: run<c10::BFloat16>(q, kv, layer, rs, rn, ro, sl, sc, out); break;
    case torch::kFloat16: run<c10::Half>(q, kv, layer, rs, rn, ro, sl, sc, out); break;
    default: TORCH_CHECK(false, "unsupported dtype ", q.scalar_type());
  }
}

// layer_ops.cpp
void rms_norm(torch::Tensor x, torch::Tensor w, double eps, torch::Tensor out);
void add_rms_norm(torch::Tensor x, torch::Tensor delta, torch::Tensor w, double eps,
                  torch::Tensor sum, torch::Tensor out);
void rotary_kv(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin,
               std::vector<torch::Tensor> kv, int64_t layer, torch::Tensor row_seq,
               torch::Tensor row_slot, int64_t heads, torch::Tensor q_out);
void silu_mul(torch::Tensor gate_up, torch::Tensor out);
// gemm.cpp
void small_gemm(torch::Tensor x, torch::Tensor w, torch::Tensor y);
void quant_gemm(torch::Tensor x, torch::Tensor q, int64_t kind, torch::Tensor y);
void dequantize(torch::Tensor q, int64_t kind, torch::Tensor out);
// amx.cpp
bool amx_available();
void amx_gemm(torch::Tensor x, torch::Tensor packed, torch::Tensor y);
void amx_quant_gemm(torch::Tensor x, torch::Tensor tiles, int64_t kind, torch::Tensor y);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "RMSNorm of each row");
  m.def("add_rms_norm", &add_rms_norm, "residual sum, then RMSNorm of each row");
  m.def("rotary_kv", &rotary_kv, "rotary queries; rotary keys and values into the KV caches");
  m.def("silu_mul", &silu_mul, "silu(gate) * up");
  m.def("small_gemm", &small_gemm, "x W^T for few rows, weights streamed once");
  m.def("quant_gemm", &quant_gemm, "x W^T with W in GGUF blocks (Q4_1, Q8_0), expanded per call");
  m.def("dequantize", &dequantize, "GGUF blocks (Q4_1, Q8_0) to a dense matrix");
  m.def("amx_available", &amx_available, "whether amx_gemm runs here (AMX-BF16 and the tile state)");
  m.def("amx_gemm", &amx_gemm, "bfloat16 x W^T on AMX tiles, W packed; row-invariant for any M");
  m.def("amx_quant_gemm", &amx_quant_gemm, "bfloat16 x W^T on AMX tiles, W in Q4_1 / Q8_0 tiles");
  m.def("ragged_attention", &ragged_attention, "ragged attention over per-sequence KV caches");
}
