// Matrix products with few rows, y = x W^T for x [M, K] and W [N, K], streaming the
// weights once for all M rows (specdec native runtime; see specdec/runtime/linear.py).
//
// A decoding step multiplies one row by every weight matrix: its speed is the speed at
// which the weights stream from memory. Verifying k + 1 draft tokens multiplies k + 1
// rows: the weights still stream once, each block is used for every row while it sits in
// the L1 cache. Each output element is
//   y[m, n] = sum over k of x[m, k] W[n, k]   in 16 float32 lanes (32 with bfloat16 pairs),
//             k in increasing order, then one fixed horizontal sum
// whatever M, the row's place among the M rows, or the thread that computes it: a row
// gets the same bits alone or in any batch (the exact mode's requirement, checked again
// by calibration like every formulation). bfloat16 uses AVX512-BF16's dot product of
// pairs where the CPU has it (float32 accumulation), else converts to float32 and uses
// FMA; float32 and float16 use FMA.
#include "common.h"

#include <ATen/Parallel.h>

namespace {

using namespace specdec;

constexpr int64_t kRowBlock = 4;  // rows of x per pass over a weight block
constexpr int64_t kColBlock = 4;  // rows of W (outputs) per block
constexpr int64_t kGrainCols = 64;  // outputs per thread task, at least
// Software prefetch distance, in rows of W: each step of the k loop reads a 64-byte line of
// each of the block's rows (32 bfloat16, 16 float32) and asks for the same line this many
// rows on (measured on a 2-core Xeon with AMX: a one-row pass over SmolLM2's 269 MB of
// bfloat16 weights went from 13 to 19 GB/s, the machine's read bandwidth being 20).
constexpr int64_t kPrefetchRows = 4;

#if defined(__AVX512F__)
// 16 elements of a row from k as float32, zeros past K (`left` = K - k).
template <typename T>
inline __m512 load_tail(const T* p, int64_t left) {
  alignas(64) float tmp[kLanes] = {0.f};
  for (int64_t i = 0; i < left && i < kLanes; ++i) tmp[i] = to_float(p[i]);
  return _mm512_load_ps(tmp);
}

// A block of MB rows of x against NB rows of W: float32 FMA over 16 lanes. The main
// loop has no branch, so the MB x NB accumulators stay in registers.
template <typename T, int MB, int NB>
inline void block_fma(const T* x, int64_t xs, const T* w, int64_t K, T* y, int64_t ys) {
  __m512 acc[MB][NB];
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_setzero_ps();
  const int64_t full = K / kLanes * kLanes;
  for (int64_t k = 0; k < full; k += kLanes) {
    __m512 wv[NB];
    for (int j = 0; j < NB; ++j) {
      _mm_prefetch(reinterpret_cast<const char*>(w + (kPrefetchRows + j) * K + k), _MM_HINT_T0);
      wv[j] = load16(w + j * K + k);
    }
    for (int m = 0; m < MB; ++m) {
      const __m512 xv = load16(x + m * xs + k);
      for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_fmadd_ps(xv, wv[j], acc[m][j]);
    }
  }
  if (full < K) {
    __m512 wv[NB];
    for (int j = 0; j < NB; ++j) wv[j] = load_tail(w + j * K + full, K - full);
    for (int m = 0; m < MB; ++m) {
      const __m512 xv = load_tail(x + m * xs + full, K - full);
      for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_fmadd_ps(xv, wv[j], acc[m][j]);
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < NB; ++j) y[m * ys + j] = from_float<T>(_mm512_reduce_add_ps(acc[m][j]));
}

#if defined(__AVX512BF16__)
// bfloat16: AVX512-BF16 dot products of consecutive pairs, float32 accumulation.
template <int MB, int NB>
inline void block_bf16(const c10::BFloat16* x, int64_t xs, const c10::BFloat16* w, int64_t K,
                       c10::BFloat16* y, int64_t ys) {
  __m512 acc[MB][NB];
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_setzero_ps();
  constexpr int64_t step = 2 * kLanes;
  const int64_t full = K / step * step;
  for (int64_t k = 0; k < full; k += step) {
    __m512bh wv[NB];
    for (int j = 0; j < NB; ++j) {
      _mm_prefetch(reinterpret_cast<const char*>(w + (kPrefetchRows + j) * K + k), _MM_HINT_T0);
      wv[j] = (__m512bh)_mm512_loadu_si512(w + j * K + k);
    }
    for (int m = 0; m < MB; ++m) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + m * xs + k);
      for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], xv, wv[j]);
    }
  }
  if (full < K) {
    const __mmask32 mask = static_cast<__mmask32>((1ull << (K - full)) - 1ull);
    __m512bh wv[NB];
    for (int j = 0; j < NB; ++j) wv[j] = (__m512bh)_mm512_maskz_loadu_epi16(mask, w + j * K + full);
    for (int m = 0; m < MB; ++m) {
      const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + m * xs + full);
      for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], xv, wv[j]);
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < NB; ++j)
      y[m * ys + j] = from_float<c10::BFloat16>(_mm512_reduce_add_ps(acc[m][j]));
}
#endif

template <typename T, int MB, int NB>
inline void block(const T* x, int64_t xs, const T* w, int64_t K, T* y, int64_t ys) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    block_bf16<MB, NB>(x, xs, w, K, y, ys);
    return;
  }
#endif
  block_fma<T, MB, NB>(x, xs, w, K, y, ys);
}
#else
// Portable: the same structure in plain C++ (16 partial sums, then a pairwise tree).
template <typename T, int MB, int NB>
inline void block(const T* x, int64_t xs, const T* w, int64_t K, T* y, int64_t ys) {
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < NB; ++j) {
      float lane[kLanes] = {0.f};
      for (int64_t k = 0; k < K; ++k)
        lane[k % kLanes] += to_float(x[m * xs + k]) * to_float(w[j * K + k]);
      y[m * ys + j] = from_float<T>(tree_sum(lane));
    }
}
#endif

// Rows of W [n, n + NB) against every row of x, in blocks of kRowBlock rows (the W block
// stays in L1 while all of x passes).
template <typename T, int NB>
inline void cols_against(const T* x, int64_t xs, int64_t M, const T* w, int64_t K, T* y,
                         int64_t N) {
  int64_t m0 = 0;
  for (; m0 + kRowBlock <= M; m0 += kRowBlock)
    block<T, kRowBlock, NB>(x + m0 * xs, xs, w, K, y + m0 * N, N);
  switch (M - m0) {
    case 3: block<T, 3, NB>(x + m0 * xs, xs, w, K, y + m0 * N, N); break;
    case 2: block<T, 2, NB>(x + m0 * xs, xs, w, K, y + m0 * N, N); break;
    case 1: block<T, 1, NB>(x + m0 * xs, xs, w, K, y + m0 * N, N); break;
    default: break;
  }
}

template <typename T>
void run(const torch::Tensor& x, const torch::Tensor& w, torch::Tensor& y) {
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  const T* xp = x.data_ptr<T>();
  const T* wp = w.data_ptr<T>();
  T* yp = y.data_ptr<T>();
  const int64_t xs = x.stride(0);
  at::parallel_for(0, (N + kColBlock - 1) / kColBlock, kGrainCols / kColBlock,
                   [&](int64_t b0, int64_t b1) {
    const int64_t n1 = std::min(N, b1 * kColBlock);
    int64_t n = b0 * kColBlock;
    for (; n + kColBlock <= n1; n += kColBlock)
      cols_against<T, kColBlock>(xp, xs, M, wp + n * K, K, yp + n, N);
    for (; n < n1; ++n) cols_against<T, 1>(xp, xs, M, wp + n * K, K, yp + n, N);
  });
}

}  // namespace

// x: [M, K] rows contiguous; w: [N, K] contiguous; y: [M, N] contiguous; one dtype.
void small_gemm(torch::Tensor x, torch::Tensor w, torch::Tensor y) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [M, K] with contiguous rows");
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.size(1) == x.size(1),
              "w must be a contiguous [N, K] tensor");
  TORCH_CHECK(y.is_contiguous() && y.dim() == 2 && y.size(0) == x.size(0) &&
                  y.size(1) == w.size(0),
              "y must be a contiguous [M, N] tensor");
  TORCH_CHECK(w.scalar_type() == x.scalar_type() && y.scalar_type() == x.scalar_type(),
              "x, w and y must share a dtype");
  switch (x.scalar_type()) {
    case torch::kFloat32: run<float>(x, w, y); break;
    case torch::kBFloat16: run<c10::BFloat16>(x, w, y); break;
    case torch::kFloat16: run<c10::Half>(x, w, y); break;
    default: TORCH_CHECK(false, "unsupported dtype ", x.scalar_type());
  }
}
