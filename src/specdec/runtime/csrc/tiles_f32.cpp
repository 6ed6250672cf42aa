// Dense float32 products on tiles of 16 outputs (specdec native runtime; the formulation
// "tiles" of specdec/runtime/linear.py, float32 models on CPUs with AVX-512).
//
// Layout (specdec.runtime.linear.f32_tile_layout): W [N, K] as [ceil(N / 16), K, 16]
// float32, row k of tile t holding w[16 t + j, k] for j = 0..15 (N padded with zero
// outputs): one 64-byte load gives the k-th weight of 16 outputs.
//
// What is computed, per row m of x and output n (one float32 lane of one register):
//   acc = 0; for k = 0 .. K - 1 in order: acc = fma(x[m, k], w[n, k], acc);  y[m, n] = acc
// Every step of output (m, n) reads row m and output n only, in a fixed order, so a row
// gets the same bits alone or in any batch, at any place, on any thread (row-invariant by
// construction; checked again before exact mode uses it, as every formulation is).
//
// Why: for one row, oneDNN's float32 product and the stream kernel (gemm.cpp, 16 lanes
// along k and a horizontal sum per output) read the weights at 17-24 GB/s on the 2-core
// Zen 4; here a lane is an output, so one row costs one load and one FMA per 16 weights
// and no horizontal sums, and M rows share every load (the dpbf16 kernel's dense tiles,
// dpbf16.cpp, with one k per step instead of a pair).
#include "common.h"

#include <ATen/Parallel.h>

#include <algorithm>

namespace {

#if defined(__AVX512F__)

constexpr int kAccumulators = 24;  // rows x tiles per pass, one register each
constexpr int kMaxRows = 12;       // rows of x per pass over a group of tiles
constexpr int64_t kGroup = 8;      // tiles in cache while all rows pass
constexpr int64_t kPrefetchBytes = 16384;

constexpr int tiles_per_pass(int rows) { return std::max(1, std::min(8, kAccumulators / rows)); }

// MB rows of x against NB tiles (tile j's rows at w + j step floats), all K.
template <int MB, int NB>
void tile_block(const float* x, int64_t xs, const float* w, int64_t K, int64_t step, float* y,
                int64_t N, int64_t n0) {
  __m512 acc[MB][NB];
  for (int r = 0; r < MB; ++r)
    for (int j = 0; j < NB; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    for (int j = 0; j < NB; ++j)
      _mm_prefetch(reinterpret_cast<const char*>(w + j * step + 16 * k) + kPrefetchBytes,
                   _MM_HINT_T0);
    for (int j = 0; j < NB; ++j) {
      const __m512 wv = _mm512_loadu_ps(w + j * step + 16 * k);
      for (int r = 0; r < MB; ++r)
        acc[r][j] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * xs + k]), wv, acc[r][j]);
    }
  }
  for (int j = 0; j < NB; ++j) {
    const int64_t n = n0 + 16 * j, valid = std::min<int64_t>(16, N - n);
    for (int r = 0; r < MB; ++r) {
      if (valid == 16) {
        _mm512_storeu_ps(y + r * N + n, acc[r][j]);
      } else if (valid > 0) {
        _mm512_mask_storeu_ps(y + r * N + n, static_cast<__mmask16>((1u << valid) - 1),
                              acc[r][j]);
      }
    }
  }
}

template <int MB>
void rows_against(const float* x, int64_t xs, const float* w, int64_t K, int64_t t0, int64_t t1,
                  float* y, int64_t N) {
  constexpr int NB = tiles_per_pass(MB);
  const int64_t step = 16 * K;
  int64_t t = t0;
  for (; t + NB <= t1; t += NB) tile_block<MB, NB>(x, xs, w + t * step, K, step, y, N, 16 * t);
  for (; t < t1; ++t) tile_block<MB, 1>(x, xs, w + t * step, K, step, y, N, 16 * t);
}

template <int MB = kMaxRows>
inline void dispatch_rows(int64_t rows, const float* x, int64_t xs, const float* w, int64_t K,
                          int64_t t0, int64_t t1, float* y, int64_t N) {
  if constexpr (MB > 1) {
    if (rows < MB) {
      dispatch_rows<MB - 1>(rows, x, xs, w, K, t0, t1, y, N);
      return;
    }
  }
  rows_against<MB>(x, xs, w, K, t0, t1, y, N);
}

#endif  // __AVX512F__

}  // namespace

// Whether f32_tile_gemm runs here (built for a CPU with AVX-512).
bool f32_tiles_available() {
#if defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

// x: [M, K] float32 rows contiguous; tiles: [ceil(N / 16), K, 16] float32 contiguous (the
// layout above); y: [M, N] float32 contiguous.
void f32_tile_gemm(torch::Tensor x, torch::Tensor tiles, torch::Tensor y) {
  TORCH_CHECK(f32_tiles_available(), "the float32 tile product needs AVX-512 (not built here)");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == torch::kFloat32,
              "x must be a float32 [M, K] tensor with contiguous rows");
  TORCH_CHECK(tiles.dim() == 3 && tiles.is_contiguous() &&
                  tiles.scalar_type() == torch::kFloat32 && tiles.size(2) == 16,
              "tiles must be a contiguous float32 [N/16, K, 16] tensor");
  TORCH_CHECK(x.size(1) == tiles.size(1), "x has K = ", x.size(1), " but the tiles hold ",
              tiles.size(1));
  TORCH_CHECK(y.dim() == 2 && y.is_contiguous() && y.size(0) == x.size(0) &&
                  y.scalar_type() == torch::kFloat32 && y.size(1) <= tiles.size(0) * 16 &&
                  y.size(1) > (tiles.size(0) - 1) * 16,
              "y must be a contiguous float32 [M, N] tensor matching the tiles' N");
#if defined(__AVX512F__)
  const int64_t M = x.size(0), K = x.size(1), N = y.size(1), ntiles = tiles.size(0);
  if (M == 0) return;
  const float* xp = x.data_ptr<float>();
  const float* wp = tiles.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t xs = x.stride(0);
  const int64_t passes = (M + kMaxRows - 1) / kMaxRows;
  const int64_t chunk = (M + passes - 1) / passes;
  at::parallel_for(0, ntiles, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t t = b0; t < b1; t += kGroup) {
      const int64_t t1 = std::min(b1, t + kGroup);
      for (int64_t m0 = 0; m0 < M; m0 += chunk)
        dispatch_rows(std::min(chunk, M - m0), xp + m0 * xs, xs, wp, K, t, t1, yp + m0 * N, N);
    }
  });
#endif
}
