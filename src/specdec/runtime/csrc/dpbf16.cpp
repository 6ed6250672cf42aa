// Quantized products (GGUF Q4_1, Q8_0) with bfloat16 activations on AVX512-BF16's pair dot
// products (specdec native runtime; see specdec/runtime/quant.py, kernel "dpbf16"), and
// dense bfloat16 products on the same tiles (specdec/runtime/linear.py, formulation
// "dpbf16"; see "Dense bfloat16 weights" below).
//
// What is computed is the amx kernel's formula (amx.cpp; the two instructions may round
// their pair sums differently, so the kernels are not claimed to agree bit for bit), on
// CPUs with AVX512-BF16 but no AMX (AMD Zen 4 and later, Intel Cooper Lake):
//   y[m, n] = sum over blocks b, in increasing order, of
//             acc = fma(C, d[n, b], acc), then (Q4_1) acc = fma(S[m, b], m[n, b], acc)
// with C = x[m, b] . q[n, b] the exact integers of the file's block (quant_tiles.h) dotted
// with the row's 32 bfloat16 activations: a float32 sum of 16 pair steps, p = 0..15 in
// order, each one VDPBF16PS lane (Intel SDM vol. 2, VDPBF16PS: lane j adds the products
// of its two bfloat16 pairs to its float32 accumulator), then one rounding of acc to
// bfloat16. Every step of output (m, n) reads row m and output n only, in a fixed order,
// so a row gets the same bits alone or in any batch, at any place, on any thread
// (row-invariant by construction; checked again before exact mode uses it, as every
// kernel is).
//
// Why: the fma kernel (gemm.cpp) computes each output as 16 float32 lanes along k and
// expands each block of weights to float32, so a verification of M rows costs M FMAs per
// 16 weights: on a 2-core Zen 4 its Q4_1 product over 5 rows took 2.9x one row's time, and
// verifying 5 draft tokens 2.3x a decoding step. Here a lane is an output: one VDPBF16PS
// (one instruction per cycle, as an FMA, measured on that Zen 4) does 32 multiply-adds, the
// row's pair of activations broadcast to the 16 outputs of a tile, and a tile row's
// integers expand once (3-5 instructions) for every row of x that passes; no horizontal
// sums.
//
// Layout (specdec.runtime.quant.dpbf16_layout): the amx kernel's tiles (quant_tiles.h) with
// the scales kept in float16 as in the file (Q4_1: d[16], m[16], then the 16 nibble rows,
// 320 bytes per 16 x 32 weights: the file's 5 bits per weight; Q8_0: d[16], then the 16
// int8 rows, 544 bytes), each tile's blocks in a row. Made once at load. (Measured on the
// 2-core Zen 4, 30 layers' distinct Q4_1 matrices, one row: 17% fewer bytes than the amx
// layout's float32 scales, 3.0 against 3.7 ms; storing 8 tiles' blocks interleaved, so that
// one row reads one stream instead of 8, was slower: 4.0 ms.)
//
// Dense bfloat16 weights (kind 2; specdec.runtime.linear.dpbf16_dense_layout, the
// formulation "dpbf16" of dense products): the same tiles with the weights themselves, no
// scales, 1024 bytes per 16 outputs x 32 k (row p: output j's w[2p], w[2p + 1] at words 2j,
// 2j + 1), and one float32 accumulator per output taking every pair step, k increasing:
//   y[m, n] = bfloat16(VDPBF16PS chain over p = 0 .. K/2 - 1 of x[m, 2p..2p+1] . w[n, 2p..2p+1])
// Row-invariant by construction as above. Why: oneDNN's bfloat16 inner product and the
// float32 FMA kernel (gemm.cpp) ran one row at 11.4 and 10.2 ms over 30 layers' matrices
// of SmolLM2-135M on the 2-core Zen 4 (212 MB), this at 6.3 ms: a tile row is one load
// and one instruction per row of x, nothing to expand.
#include "quant_tiles.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

namespace {

using namespace specdec;

#if defined(SPECDEC_QUANT_TILES)

constexpr int kMaxRows = 12;          // rows of x per pass over a tile's blocks
constexpr int kMaxAccumulators = 12;  // rows x tiles per pass (two registers each)
constexpr int64_t kGroup = 8;         // tiles in cache while all rows pass

// Tiles per pass for MB rows: as many as the registers hold (a tile row's integers are
// expanded once per pass, so more rows per pass expand less often), up to 8 for one row.
constexpr int tiles_per_pass(int rows) {
  return rows == 1 ? 8 : std::max(1, std::min(4, kMaxAccumulators / rows));
}
// Dense tiles keep one register per row and tile (no block dot products to scale), so a
// pass holds twice the accumulators: up to 8 tiles, 24 registers (measured on the 2-core
// Zen 4, 30 layers' distinct matrices: 4 rows 1.07x one row's time, against 1.55x with the
// quantized kinds' 12).
constexpr int kDenseAccumulators = 24;
constexpr int dense_tiles_per_pass(int rows) {
  return std::max(1, std::min(8, kDenseAccumulators / rows));
}
// Bytes ahead in a tile's stream that each block asks the cache for (measured on the 2-core
// Zen 4, one-row products over 30 layers' distinct Q4_1 matrices: 4 KB ahead 3.9 ms, 16 KB
// 3.6, 32 KB 4.1, no prefetch 4.4).
#ifndef SPECDEC_DPBF16_PREFETCH
#define SPECDEC_DPBF16_PREFETCH 16384
#endif
constexpr int64_t kPrefetchBytes = SPECDEC_DPBF16_PREFETCH;

enum HalfTileKind : int64_t { kHalfQ4_1 = 0, kHalfQ8_0 = 1, kDense = 2 };
constexpr int64_t half_tile_bytes(int64_t kind) {
  return kind == kHalfQ4_1 ? 320 : kind == kHalfQ8_0 ? 544 : kDenseTileBytes;
}

template <int64_t kind>
inline __m512bh tile_row(const uint8_t* tile, int64_t p, __m512i table, __m512i shifts) {
  if constexpr (kind == kHalfQ4_1) {
    return reinterpret_cast<__m512bh>(q4_1_tile_row(tile + 64, p, table, shifts));
  } else if constexpr (kind == kDense) {
    return reinterpret_cast<__m512bh>(_mm512_loadu_si512(tile + 64 * p));
  } else {
    return reinterpret_cast<__m512bh>(q8_0_tile_row(tile + 32, p));
  }
}

inline __m512 half16(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// x[k], x[k + 1] in every 32-bit lane.
inline __m512bh pair(const c10::BFloat16* x) {
  int32_t v;
  std::memcpy(&v, x, sizeof(v));
  return reinterpret_cast<__m512bh>(_mm512_set1_epi32(v));
}

// MB rows of x against NB tiles of 16 outputs, over all K blocks: tile j's block kb at
// q + j step + kb bytes; the outputs n0 .. n0 + 16 NB - 1 of y (those below N).
template <int64_t kind, int MB, int NB>
void tile_block(const c10::BFloat16* x, int64_t xs, const float* sums, int64_t kblocks,
                const uint8_t* q, int64_t step, __m512i table, __m512i shifts,
                c10::BFloat16* y, int64_t N, int64_t n0) {
  static_assert(MB * NB <= (kind == kDense ? kDenseAccumulators : kMaxAccumulators) ||
                    (MB == 1 && NB <= 8),
                "accumulators must stay in registers");
  constexpr int64_t bytes = half_tile_bytes(kind);
  __m512 acc[MB][NB];
  for (int r = 0; r < MB; ++r)
    for (int j = 0; j < NB; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t kb = 0; kb < kblocks; ++kb) {
    const c10::BFloat16* xb = x + kb * kTileQuantK;
    const uint8_t* tiles = q + kb * bytes;
    for (int j = 0; j < NB; ++j)
      for (int64_t line = 0; line < bytes; line += 64)
        _mm_prefetch(reinterpret_cast<const char*>(tiles + j * step) + kPrefetchBytes + line,
                     _MM_HINT_T0);
    // the block's pair steps: a dense tile adds them straight into acc (no scales); a
    // quantized one into its block dot product, which its scales then add into acc
    __m512 dot[MB][NB];
    __m512(&into)[MB][NB] = kind == kDense ? acc : dot;
    if constexpr (kind != kDense)
      for (int r = 0; r < MB; ++r)
        for (int j = 0; j < NB; ++j) dot[r][j] = _mm512_setzero_ps();
    for (int64_t p = 0; p < kTileQuantRows; ++p) {
      for (int j = 0; j < NB; ++j) {
        const __m512bh w = tile_row<kind>(tiles + j * step, p, table, shifts);
        for (int r = 0; r < MB; ++r)
          into[r][j] = _mm512_dpbf16_ps(into[r][j], pair(xb + r * xs + 2 * p), w);
      }
    }
    if constexpr (kind != kDense) {
      for (int j = 0; j < NB; ++j) {
        const __m512 d = half16(tiles + j * step);
        for (int r = 0; r < MB; ++r) acc[r][j] = _mm512_fmadd_ps(dot[r][j], d, acc[r][j]);
        if constexpr (kind == kHalfQ4_1) {
          const __m512 mins = half16(tiles + j * step + 32);
          for (int r = 0; r < MB; ++r)
            acc[r][j] = _mm512_fmadd_ps(_mm512_set1_ps(sums[r * kblocks + kb]), mins, acc[r][j]);
        }
      }
    }
  }
  for (int j = 0; j < NB; ++j) {
    const int64_t n = n0 + 16 * j, valid = std::min<int64_t>(16, N - n);
    for (int r = 0; r < MB; ++r) {
      if (valid == 16) {
        store16(y + r * N + n, acc[r][j]);
      } else if (valid > 0) {
        alignas(64) c10::BFloat16 tmp[16];
        store16(tmp, acc[r][j]);
        std::copy(tmp, tmp + valid, y + r * N + n);
      }
    }
  }
}

// MB rows against the tiles [t0, t1) (tile t's blocks at qp + t step), NB tiles at a time.
template <int64_t kind, int MB>
void rows_against(const c10::BFloat16* x, int64_t xs, const float* sums, int64_t kblocks,
                  const uint8_t* qp, int64_t step, int64_t t0, int64_t t1, __m512i table,
                  __m512i shifts, c10::BFloat16* y, int64_t N) {
  constexpr int NB = kind == kDense ? dense_tiles_per_pass(MB) : tiles_per_pass(MB);
  int64_t t = t0;
  for (; t + NB <= t1; t += NB)
    tile_block<kind, MB, NB>(x, xs, sums, kblocks, qp + t * step, step, table, shifts, y, N, 16 * t);
  for (; t < t1; ++t)
    tile_block<kind, MB, 1>(x, xs, sums, kblocks, qp + t * step, step, table, shifts, y, N, 16 * t);
}

// rows_against for 1 <= rows <= kMaxRows.
template <int64_t kind, int MB = kMaxRows>
inline void dispatch_rows(int64_t rows, const c10::BFloat16* x, int64_t xs, const float* sums,
                          int64_t kblocks, const uint8_t* qp, int64_t step, int64_t t0,
                          int64_t t1, __m512i table, __m512i shifts, c10::BFloat16* y,
                          int64_t N) {
  if constexpr (MB > 1) {
    if (rows < MB) {
      dispatch_rows<kind, MB - 1>(rows, x, xs, sums, kblocks, qp, step, t0, t1, table, shifts, y, N);
      return;
    }
  }
  rows_against<kind, MB>(x, xs, sums, kblocks, qp, step, t0, t1, table, shifts, y, N);
}

template <int64_t kind>
void run_tiles(const c10::BFloat16* xp, int64_t xs, const float* sums, int64_t M,
               int64_t kblocks, const uint8_t* qp, int64_t N, c10::BFloat16* yp) {
  constexpr int64_t bytes = half_tile_bytes(kind);
  const int64_t ntiles = (N + 15) / 16;
  // rows in passes of equal size, at most kMaxRows each (16 rows: two of 8)
  const int64_t passes = (M + kMaxRows - 1) / kMaxRows;
  const int64_t chunk = (M + passes - 1) / passes;
  // grain 1: OpenMP hands each thread an equal share of the tiles
  at::parallel_for(0, ntiles, 1, [&](int64_t b0, int64_t b1) {
    const __m512i table = small_int_table();
    const __m512i shifts = nibble_shifts();
    const int64_t step = kblocks * bytes;  // one tile's blocks
    for (int64_t t = b0; t < b1; t += kGroup) {  // these tiles stay in cache for all rows
      const int64_t t1 = std::min(b1, t + kGroup);
      for (int64_t m0 = 0; m0 < M; m0 += chunk)
        dispatch_rows<kind>(std::min(chunk, M - m0), xp + m0 * xs, xs, sums + m0 * kblocks,
                            kblocks, qp, step, t, t1, table, shifts, yp + m0 * N, N);
    }
  });
}

#endif  // SPECDEC_QUANT_TILES

}  // namespace

// Whether dpbf16_quant_gemm runs here (built for a CPU with AVX512-BF16 and VBMI).
bool dpbf16_available() {
#if defined(SPECDEC_QUANT_TILES)
  return true;
#else
  return false;
#endif
}

// x: [M, K] bfloat16 rows contiguous; tiles: [N_blocks, K_blocks, tile bytes] uint8 in the
// layout above; kind: 0 = Q4_1, 1 = Q8_0, 2 = dense bfloat16 weights (the dense layout
// above); y: [M, N] bfloat16 contiguous.
void dpbf16_quant_gemm(torch::Tensor x, torch::Tensor tiles, int64_t kind, torch::Tensor y) {
  TORCH_CHECK(dpbf16_available(), "AVX512-BF16 pair dot products are not available here");
  specdec::check_tile_product(x, tiles, kind, y, 320, 544, kDenseTileBytes);
#if defined(SPECDEC_QUANT_TILES)
  const int64_t M = x.size(0), kblocks = tiles.size(1);
  if (M == 0) return;
  const auto* xp = x.data_ptr<c10::BFloat16>();
  const auto* qp = tiles.data_ptr<uint8_t>();
  auto* yp = y.data_ptr<c10::BFloat16>();
  if (kind == kDense) {
    run_tiles<kDense>(xp, x.stride(0), nullptr, M, kblocks, qp, y.size(1), yp);
    return;
  }
  const float* sums = block_sums(x, kblocks);
  if (kind == kHalfQ4_1) {
    run_tiles<kHalfQ4_1>(xp, x.stride(0), sums, M, kblocks, qp, y.size(1), yp);
  } else {
    run_tiles<kHalfQ8_0>(xp, x.stride(0), sums, M, kblocks, qp, y.size(1), yp);
  }
#endif
}
