// Fused per-layer work of the native runtime's decoder layer (see
// specdec/runtime/kernels.py): what PyTorch runs as a dozen small operations per layer,
// each allocating its result and re-reading its inputs, done here in one pass per row:
//
//   rms_norm       y = x / sqrt(mean(x^2) + eps) * w
//   add_rms_norm   s = x + delta;  y = rms_norm(s)                  (the residual stream)
//   rotary_kv      rotary embedding of the queries and keys of a fused QKV product, the
//                  queries into their own buffer, the keys and values straight into each
//                  sequence's KV cache
//   silu_mul       y = silu(gate) * up                              (SwiGLU)
//
// Every row is computed on its own, in a fixed order that depends only on the row, so
// the results do not depend on the batch (exact mode). The arithmetic follows PyTorch's:
// float32 inside, the result rounded to the storage dtype (nearest even) where a PyTorch
// operation would return it. The residual sum and the rotary embedding give PyTorch's
// bits exactly (each is one rounding of an exactly computed float: products of two
// 16-bit floats are exact in float32, and the build turns off FMA contraction); the
// norm's sum of squares and SiLU's exp run in another order or polynomial than
// PyTorch's, within a float32 ulp or two before the final rounding.
#include "common.h"

#include <ATen/Parallel.h>

#include <vector>

namespace {

using namespace specdec;

// Rows per thread task: these operations are a microsecond or two per row, so threads pay
// off from a few rows (a verification of 8-16 rows: about half the time on 2 threads).
constexpr int64_t kGrain = 4;

// y = x * rstd * w over one row held as float in `xf` (16 partial sums of squares in a
// fixed order, then a pairwise tree).
template <typename T>
inline void norm_row(const float* xf, const float* wf, float eps, int64_t D, T* y, float* tmp) {
  float lane[kLanes] = {0.f};
  const int64_t Dv = (D / kLanes) * kLanes;
  for (int64_t i = 0; i < Dv; i += kLanes)
    for (int l = 0; l < kLanes; ++l) lane[l] += xf[i + l] * xf[i + l];
  for (int64_t i = Dv; i < D; ++i) lane[i - Dv] += xf[i] * xf[i];
  const float rstd = 1.f / std::sqrt(tree_sum(lane) / static_cast<float>(D) + eps);
  for (int64_t i = 0; i < D; ++i) tmp[i] = xf[i] * rstd * wf[i];
  float_to_row(tmp, D, y);
}

void check_rows(const torch::Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, name, " must be a [T, D] tensor with contiguous rows");
}

template <typename T>
void rms_norm_impl(const torch::Tensor& x, const torch::Tensor* delta, const torch::Tensor& w,
                   float eps, torch::Tensor* sum, torch::Tensor& out) {
  const int64_t T_ = x.size(0), D = x.size(1);
  std::vector<float> wf(D);
  row_to_float(w.data_ptr<T>(), D, wf.data());
  const T* xp = x.data_ptr<T>();
  const T* dp = delta ? delta->data_ptr<T>() : nullptr;
  T* sp = sum ? sum->data_ptr<T>() : nullptr;
  T* op = out.data_ptr<T>();
  const int64_t xs = x.stride(0), ds = delta ? delta->stride(0) : 0, os = out.stride(0);
  at::parallel_for(0, T_, kGrain, [&](int64_t begin, int64_t end) {
    std::vector<float> xf(D), tmp(D);
    for (int64_t t = begin; t < end; ++t) {
      row_to_float(xp + t * xs, D, xf.data());
      if (dp) {  // the residual sum, rounded to the storage dtype as PyTorch's add does
        row_to_float(dp + t * ds, D, tmp.data());
        for (int64_t i = 0; i < D; ++i) tmp[i] = xf[i] + tmp[i];
        float_to_row(tmp.data(), D, sp + t * D);
        row_to_float(sp + t * D, D, xf.data());
      }
      norm_row(xf.data(), wf.data(), eps, D, op + t * os, tmp.data());
    }
  });
}

template <typename Fn>
void dispatch(c10::ScalarType dtype, Fn&& fn) {
  switch (dtype) {
    case torch::kFloat32: fn(float{}); break;
    case torch::kBFloat16: fn(c10::BFloat16{}); break;
    case torch::kFloat16: fn(c10::Half{}); break;
    default: TORCH_CHECK(false, "unsupported dtype ", dtype);
  }
}

// One head of rotary embedding: out = r(r(x * cos) + r(swap(x) * sin)), r = rounding to
// T, swap = the two halves exchanged (sin carries rotate_half's sign).
template <typename T>
inline void rotate_head(const T* x, const T* cos, const T* sin, int64_t D, T* out) {
  const int64_t half = D / 2;
#if defined(__AVX512F__)
  if (half % kLanes == 0) {
    for (int64_t i = 0; i < D; i += kLanes) {
      const int64_t j = i < half ? i + half : i - half;
      const __m512 a = round16<T>(_mm512_mul_ps(load16(x + i), load16(cos + i)));
      const __m512 b = round16<T>(_mm512_mul_ps(load16(x + j), load16(sin + i)));
      store16(out + i, _mm512_add_ps(a, b));
    }
    return;
  }
#elif defined(SPECDEC_AVX2)
  if (half % kLanes == 0) {  // the AVX-512 path's arithmetic on V16
    for (int64_t i = 0; i < D; i += kLanes) {
      const int64_t j = i < half ? i + half : i - half;
      const V16 a = v16_round<T>(v16_mul(v16_load(x + i), v16_load(cos + i)));
      const V16 b = v16_round<T>(v16_mul(v16_load(x + j), v16_load(sin + i)));
      v16_store(out + i, v16_add(a, b));
    }
    return;
  }
#endif
  for (int64_t i = 0; i < D; ++i) {
    const int64_t j = i < half ? i + half : i - half;
    const float a = to_float(from_float<T>(to_float(x[i]) * to_float(cos[i])));
    const float b = to_float(from_float<T>(to_float(x[j]) * to_float(sin[i])));
    out[i] = from_float<T>(a + b);
  }
}

template <typename T>
void rotary_impl(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin,
                 const std::vector<torch::Tensor>& kv, int64_t layer, const int64_t* row_seq,
                 const int64_t* row_slot, int64_t H, torch::Tensor& q_out) {
  const int64_t T_ = qkv.size(0), G = kv[0].size(2), D = kv[0].size(4);
  std::vector<T*> base;
  std::vector<int64_t> capacity;
  for (const auto& t : kv) {
    capacity.push_back(t.size(3));
    base.push_back(t.data_ptr<T>() + layer * 2 * G * t.size(3) * D);
  }
  const T* xp = qkv.data_ptr<T>();
  const T* cp = cos.data_ptr<T>();
  const T* sp = sin.data_ptr<T>();
  T* qp = q_out.data_ptr<T>();
  const int64_t xs = qkv.stride(0), cs = cos.stride(0), ss = sin.stride(0);
  for (int64_t t = 0; t < T_; ++t) {
    const int64_t s = row_seq[t];
    TORCH_CHECK(s >= 0 && s < static_cast<int64_t>(kv.size()), "row_seq outside the caches");
    TORCH_CHECK(row_slot[t] >= 0 && row_slot[t] < capacity[s], "slot outside the cache");
  }
  at::parallel_for(0, T_, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* row = xp + t * xs;
      const T* c = cp + t * cs;
      const T* sn = sp + t * ss;
      for (int64_t h = 0; h < H; ++h) rotate_head(row + h * D, c, sn, D, qp + (t * H + h) * D);
      const int64_t s = row_seq[t], cap = capacity[s], slot = row_slot[t];
      for (int64_t g = 0; g < G; ++g) {
        rotate_head(row + (H + g) * D, c, sn, D, base[s] + (g * cap + slot) * D);
        std::memcpy(base[s] + ((G + g) * cap + slot) * D, row + (H + G + g) * D, D * sizeof(T));
      }
    }
  });
}

template <typename T>
void silu_mul_impl(const torch::Tensor& gate_up, torch::Tensor& out) {
  const int64_t T_ = gate_up.size(0), F = gate_up.size(1) / 2;
  const T* xp = gate_up.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t xs = gate_up.stride(0), os = out.stride(0);
  at::parallel_for(0, T_, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* g = xp + t * xs;
      const T* u = g + F;
      T* o = op + t * os;
      int64_t i = 0;
#if defined(__AVX512F__)
      const __m512 one = _mm512_set1_ps(1.f);
      for (; i + kLanes <= F; i += kLanes) {
        const __m512 x = load16(g + i);
        const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), x));
        const __m512 silu = round16<T>(_mm512_div_ps(x, _mm512_add_ps(one, e)));
        store16(o + i, _mm512_mul_ps(silu, load16(u + i)));
      }
#elif defined(SPECDEC_AVX2)
      const V16 one = v16_set1(1.f);
      for (; i + kLanes <= F; i += kLanes) {  // the AVX-512 path's arithmetic on V16
        const V16 x = v16_load(g + i);
        const V16 e = v16_exp(v16_sub(v16_zero(), x));
        const V16 silu = v16_round<T>(v16_div(x, v16_add(one, e)));
        v16_store(o + i, v16_mul(silu, v16_load(u + i)));
      }
#endif
      for (; i < F; ++i) {
        const float x = to_float(g[i]);
        const float silu = to_float(from_float<T>(x / (1.f + std::exp(-x))));
        o[i] = from_float<T>(silu * to_float(u[i]));
      }
    }
  });
}

// The index of row x[0..V)'s maximum, as torch.argmax gives it: the first maximal
// element, a NaN counting as greater than any number (the first NaN wins). Two passes
// over the row: its maximum (with a NaN flag), then the first element equal to it; the
// second pass reads the row from the cache the first left it in.
int64_t argmax_row(const float* x, int64_t V) {
  int64_t i = 0;
  float best = -INFINITY;
  bool nan = false;
#if defined(__AVX512F__)
  if (V >= kLanes) {
    __m512 m = _mm512_set1_ps(-INFINITY);
    __mmask16 unordered = 0;
    for (; i + kLanes <= V; i += kLanes) {
      const __m512 v = _mm512_loadu_ps(x + i);
      unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      m = _mm512_max_ps(m, v);
    }
    nan = unordered != 0;
    best = _mm512_reduce_max_ps(m);
  }
#endif
  for (; i < V; ++i) {
    if (x[i] != x[i]) nan = true;
    else if (x[i] > best) best = x[i];
  }
  if (nan) {
    for (int64_t j = 0; j < V; ++j)
      if (x[j] != x[j]) return j;
  }
  int64_t j = 0;
#if defined(__AVX512F__)
  const __m512 b = _mm512_set1_ps(best);
  for (; j + kLanes <= V; j += kLanes) {
    const __mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + j), b, _CMP_EQ_OQ);
    if (hit) return j + __builtin_ctz(static_cast<unsigned>(hit));
  }
#endif
  for (; j < V; ++j)
    if (x[j] == best) return j;
  return 0;  // unreachable: some element equals the maximum
}

}  // namespace

// x: [T, D] (rows contiguous); w: [D]; out: [T, D] (rows contiguous); all one dtype.
void rms_norm(torch::Tensor x, torch::Tensor w, double eps, torch::Tensor out) {
  check_rows(x, "x");
  check_rows(out, "out");
  TORCH_CHECK(w.dim() == 1 && w.is_contiguous() && w.size(0) == x.size(1), "w must be [D]");
  TORCH_CHECK(out.sizes() == x.sizes(), "out must be x's shape");
  TORCH_CHECK(w.scalar_type() == x.scalar_type() && out.scalar_type() == x.scalar_type(),
              "x, w and out must share a dtype");
  dispatch(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    rms_norm_impl<T>(x, nullptr, w, static_cast<float>(eps), nullptr, out);
  });
}

// sum = x + delta (contiguous [T, D]), out = rms_norm(sum, w).
void add_rms_norm(torch::Tensor x, torch::Tensor delta, torch::Tensor w, double eps,
                  torch::Tensor sum, torch::Tensor out) {
  check_rows(x, "x");
  check_rows(delta, "delta");
  check_rows(out, "out");
  TORCH_CHECK(sum.is_contiguous() && sum.sizes() == x.sizes(), "sum must be a contiguous [T, D]");
  TORCH_CHECK(delta.sizes() == x.sizes() && out.sizes() == x.sizes(), "shapes differ");
  TORCH_CHECK(w.dim() == 1 && w.is_contiguous() && w.size(0) == x.size(1), "w must be [D]");
  for (const auto* t : {&delta, &w, &sum, &out})
    TORCH_CHECK(t->scalar_type() == x.scalar_type(), "all tensors must share a dtype");
  dispatch(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    rms_norm_impl<T>(x, &delta, w, static_cast<float>(eps), &sum, out);
  });
}

// qkv: [T, (H + 2G) * D] rows contiguous (queries, keys, values); cos, sin: [T, D]; kv:
// per sequence [L, 2, G, C, D] contiguous; row t's key and value go to slot row_slot[t]
// of sequence row_seq[t]; q_out: [T, H * D] contiguous.
void rotary_kv(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin,
               std::vector<torch::Tensor> kv, int64_t layer, torch::Tensor row_seq,
               torch::Tensor row_slot, int64_t heads, torch::Tensor q_out) {
  TORCH_CHECK(!kv.empty(), "no KV caches");
  const int64_t G = kv[0].size(2), D = kv[0].size(4), T_ = qkv.size(0);
  for (const auto& t : kv)
    TORCH_CHECK(t.dim() == 5 && t.size(1) == 2 && t.is_contiguous() &&
                    t.scalar_type() == qkv.scalar_type() && t.size(2) == G && t.size(4) == D &&
                    layer >= 0 && layer < t.size(0),
                "each KV cache must be a contiguous [L, 2, G, C, D] tensor of qkv's dtype");
  check_rows(qkv, "qkv");
  TORCH_CHECK(qkv.size(1) == (heads + 2 * G) * D, "qkv must be [T, (H + 2G) * D]");
  TORCH_CHECK(D % 2 == 0, "head_dim must be even");
  for (const auto* t : {&cos, &sin}) {
    check_rows(*t, "cos/sin");
    TORCH_CHECK(t->size(0) == T_ && t->size(1) == D && t->scalar_type() == qkv.scalar_type(),
                "cos and sin must be [T, D] in qkv's dtype");
  }
  TORCH_CHECK(q_out.is_contiguous() && q_out.numel() == T_ * heads * D &&
                  q_out.scalar_type() == qkv.scalar_type(),
              "q_out must be a contiguous [T, H * D] tensor of qkv's dtype");
  TORCH_CHECK(row_seq.numel() == T_ && row_slot.numel() == T_, "row_seq and row_slot must be [T]");
  const int64_t* rs = row_seq.data_ptr<int64_t>();
  const int64_t* sl = row_slot.data_ptr<int64_t>();
  dispatch(qkv.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    rotary_impl<T>(qkv, cos, sin, kv, layer, rs, sl, heads, q_out);
  });
}

// gate_up: [T, 2F] rows contiguous (gate, then up); out: [T, F].
void silu_mul(torch::Tensor gate_up, torch::Tensor out) {
  check_rows(gate_up, "gate_up");
  check_rows(out, "out");
  TORCH_CHECK(gate_up.size(1) % 2 == 0 && out.size(0) == gate_up.size(0) &&
                  out.size(1) == gate_up.size(1) / 2 && out.scalar_type() == gate_up.scalar_type(),
              "out must be [T, F] for gate_up [T, 2F], one dtype");
  dispatch(gate_up.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    silu_mul_impl<T>(gate_up, out);
  });
}

// x: [R, V] float32, rows contiguous (V >= 1); out: [R] int64, each row's argmax.
void argmax_rows(torch::Tensor x, torch::Tensor out) {
  check_rows(x, "x");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32, "x must be float32");
  TORCH_CHECK(x.size(1) >= 1, "x must have at least one column");
  TORCH_CHECK(out.dim() == 1 && out.is_contiguous() && out.size(0) == x.size(0) &&
                  out.scalar_type() == torch::kInt64,
              "out must be a contiguous [R] int64 tensor");
  const int64_t R = x.size(0), V = x.size(1), stride = x.stride(0);
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, R, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) op[r] = argmax_row(xp + r * stride, V);
  });
}
