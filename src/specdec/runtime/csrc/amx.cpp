// A bfloat16 matrix product on AMX tiles whose every row is computed the same way for any
// number of rows (specdec native runtime; see specdec/runtime/linear.py, formulation
// "amx").
//
// y = x W^T, x [M, K] and y [M, N] bfloat16, W given packed once (amx_pack below) as
// 16 x 32 blocks in the tile layout AMX's TDPBF16PS reads ("VNNI": pairs of consecutive k
// side by side):
//   packed[nb][kb][p][j][e] = W[16 nb + j][32 kb + 2 p + e],  p, j < 16, e < 2
// so one block is one B tile of 1 KiB, and the blocks of 16 outputs follow each other
// along K: a product streams the weights once, front to back, whatever M.
//
// Each output y[m, n] is: a float32 accumulator set to zero, then for kb = 0, 1, ... in
// increasing order one TDPBF16PS step that adds row m's 32 products with column n of
// block kb, then one rounding to bfloat16. The instruction computes an element of C from
// row m of A and column n of B only, so the row's bits depend neither on M, nor on the
// row's place in its tile of 16, nor on the thread that computes it (row-invariant by
// construction; calibration checks it like any formulation before exact mode uses it).
// Rows past M (the last tile's padding) and K past the matrix (zeros in both x's copy and
// the packed weights) add exact zeros.
//
// Why: oneDNN's bfloat16 product gives other bits above 32 rows (measured on a 2-core
// Xeon with AMX), so exact mode split a batch of 64 decoding rows into two products that
// each streamed all the weights; and the AVX-512 "stream" kernel is bound by its
// bfloat16 pair dot products at many rows. One TDPBF16PS does 16 x 16 x 32 multiply-adds.
//
// Source: Intel 64 and IA-32 Architectures Software Developer's Manual, vol. 2, TDPBF16PS
// (AMX-BF16), LDTILECFG / TILELOADD / TILESTORED (AMX-TILE); Linux's arch_prctl
// ARCH_REQ_XCOMP_PERM for the tile data state.
#include "amx_tiles.h"
#include "common.h"
#include "quant_tiles.h"

#include <ATen/Parallel.h>

#include <utility>
#include <vector>

// AVX512-BF16 (rounding to bfloat16) and VBMI (the nibble shuffle) come with every AMX CPU
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__) && \
    defined(__AVX512BF16__) && defined(__AVX512VBMI__)
#define SPECDEC_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

using namespace specdec;

#if defined(SPECDEC_AMX)

constexpr int64_t kTileRows = 16;  // rows of x per A tile, k pairs per B tile
constexpr int64_t kTileK = 32;     // bfloat16 values of k per tile
constexpr int64_t kTileN = 16;     // outputs per B tile
constexpr int64_t kBlockElems = kTileRows * kTileK;  // bfloat16 values in one B tile
// Bytes ahead in a column block's stream that each step asks the cache for.
constexpr int64_t kPrefetchBytes = 4096;
// The same for the quantized tiles' stream (bytes ahead of the tile being expanded).
constexpr int64_t kQuantPrefetchBytes = 8192;

// GCC's tile intrinsics paste the tile number into the assembly text, so it must be a
// literal: these switch on a constant (folded away once inlined).
#define SPECDEC_TILE_CASES(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7)
inline void tile_zero(int t) {
#define SPECDEC_CASE(i) case i: _tile_zero(i); break;
  switch (t) { SPECDEC_TILE_CASES(SPECDEC_CASE) }
#undef SPECDEC_CASE
}
inline void tile_load(int t, const void* p, int64_t stride) {
#define SPECDEC_CASE(i) case i: _tile_loadd(i, p, stride); break;
  switch (t) { SPECDEC_TILE_CASES(SPECDEC_CASE) }
#undef SPECDEC_CASE
}
inline void tile_store(int t, void* p, int64_t stride) {
#define SPECDEC_CASE(i) case i: _tile_stored(i, p, stride); break;
  switch (t) { SPECDEC_TILE_CASES(SPECDEC_CASE) }
#undef SPECDEC_CASE
}
// C tile c += A tile a . B tile b, for the (c, a, b) triples the kernels use.
inline void tile_dot(int c, int a, int b) {
#define SPECDEC_DOT(ci, ai, bi) \
  if (c == ci && a == ai && b == bi) { _tile_dpbf16ps(ci, ai, bi); return; }
  // R = 1: C tiles 0..C-1, A tile C; R = 2: C tiles 0..2C-1, A tiles 2C, 2C + 1.
  SPECDEC_DOT(0, 1, 6) SPECDEC_DOT(0, 1, 7) SPECDEC_DOT(0, 2, 6) SPECDEC_DOT(0, 2, 7)
  SPECDEC_DOT(1, 2, 6) SPECDEC_DOT(1, 2, 7) SPECDEC_DOT(1, 3, 6) SPECDEC_DOT(1, 3, 7)
  SPECDEC_DOT(0, 4, 6) SPECDEC_DOT(1, 4, 7) SPECDEC_DOT(2, 5, 6) SPECDEC_DOT(3, 5, 7)
  SPECDEC_DOT(0, 4, 7) SPECDEC_DOT(1, 4, 6) SPECDEC_DOT(2, 5, 7) SPECDEC_DOT(3, 5, 6)
  SPECDEC_DOT(1, 5, 6) SPECDEC_DOT(2, 4, 6) SPECDEC_DOT(3, 4, 7)  // the quantized kernels
#undef SPECDEC_DOT
  __builtin_trap();
}

template <typename F, int... I>
inline void unroll_impl(F&& f, std::integer_sequence<int, I...>) {
  (f(std::integral_constant<int, I>{}), ...);
}
template <int N, typename F>
inline void unroll(F&& f) {
  unroll_impl(f, std::make_integer_sequence<int, N>{});
}

// R tiles of 16 rows of x against C blocks of 16 outputs, over all of K. Tiles: C at
// r * C + c, A at R * C + r, B alternating at 6 and 7 (R * C <= 4, R <= 2).
//   a: x's first row tile, packed (pack_rows: 1 KiB per 16 rows x 32 k, k blocks
//   consecutive, a_stride values between row tiles); b: the first block of the first
//   column block, b_stride values between column blocks; out: float32 [16 R][ldo].
template <int R, int C>
inline void tile_kernel(const c10::BFloat16* a, int64_t a_stride, const c10::BFloat16* b,
                        int64_t b_stride, int64_t kblocks, float* out, int64_t ldo) {
  static_assert(R * C <= 4 && R <= 2, "8 tile registers");
  unroll<R * C>([&](auto i) { tile_zero(decltype(i)::value); });
  const char* bp = reinterpret_cast<const char*>(b);
  for (int64_t kb = 0; kb < kblocks; ++kb) {
    unroll<R>([&](auto r) {
      constexpr int ri = decltype(r)::value;
      tile_load(R * C + ri, a + ri * a_stride + kb * kBlockElems, 64);
    });
    unroll<C>([&](auto c) {
      constexpr int ci = decltype(c)::value;
      constexpr int bt = 6 + (ci & 1);
      const char* block = bp + (ci * b_stride + kb * kBlockElems) * 2;
      for (int line = 0; line < 1024; line += 64)
        _mm_prefetch(block + kPrefetchBytes + line, _MM_HINT_T0);
      tile_load(bt, block, 64);
      unroll<R>([&](auto r) {
        constexpr int ri = decltype(r)::value;
        tile_dot(ri * C + ci, R * C + ri, bt);
      });
    });
  }
  unroll<R * C>([&](auto i) {
    constexpr int t = decltype(i)::value;
    tile_store(t, out + (t / C) * kTileRows * ldo + (t % C) * kTileN, ldo * 4);
  });
}

// x [M, K] (row stride xs values) as A tiles: [ceil(M / 16)][kblocks][16][32], rows past M
// and k past K zero. Each tile is then one contiguous KiB (a strided tile load touches 16
// lines 2 KiB apart; measured slower once x outgrows the L1 cache).
void pack_rows(const c10::BFloat16* x, int64_t xs, int64_t M, int64_t K, int64_t kblocks,
               c10::BFloat16* a) {
  const int64_t mtiles = (M + kTileRows - 1) / kTileRows;
  for (int64_t mt = 0; mt < mtiles; ++mt)
    for (int64_t kb = 0; kb < kblocks; ++kb) {
      c10::BFloat16* tile = a + (mt * kblocks + kb) * kBlockElems;
      const int64_t k0 = kb * kTileK, width = std::min<int64_t>(kTileK, K - k0);
      for (int64_t r = 0; r < kTileRows; ++r) {
        const int64_t m = mt * kTileRows + r;
        c10::BFloat16* row = tile + r * kTileK;
        if (m < M && width == kTileK) {
          std::memcpy(row, x + m * xs + k0, 64);
        } else {
          std::memset(row, 0, 64);
          if (m < M) std::memcpy(row, x + m * xs + k0, width * 2);
        }
      }
    }
}

// The float32 tile results [16 R][ldo] into y (rows m0.., columns n0..), rounded to
// bfloat16 as PyTorch's cast rounds (nearest even), within M and N.
inline void write_out(const float* out, int64_t ldo, int64_t rows, int64_t cols,
                      c10::BFloat16* y, int64_t ldy) {
  for (int64_t m = 0; m < rows; ++m) {
    int64_t n = 0;
    for (; n + kLanes <= cols; n += kLanes) store16(y + m * ldy + n, _mm512_loadu_ps(out + m * ldo + n));
    for (; n < cols; ++n) y[m * ldy + n] = from_float<c10::BFloat16>(out[m * ldo + n]);
  }
}

bool request_tile_permission() {
  // Linux keeps the AMX tile data state off until a process asks for it.
  constexpr int kReqXcompPerm = 0x1023;
  constexpr int kXfeatureTileData = 18;
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureTileData) == 0;
}

bool amx_usable() {
  static const bool usable = __builtin_cpu_supports("amx-bf16") && request_tile_permission();
  return usable;
}

// Column blocks per task: 2 (64 outputs' worth of tiles when R = 1 runs 4 at once would
// leave a 2-core machine with too few tasks on a 576-wide matrix).
constexpr int64_t kColsPerTask = 2;

// One task's column blocks nb, nb + 1 (cols of them), B tiles at b (b_stride values
// between the two), against every row tile of the packed x.
inline void column_task(const c10::BFloat16* ap, int64_t M, int64_t kblocks,
                        const c10::BFloat16* b, int64_t b_stride, int64_t nb, int64_t cols,
                        int64_t N, c10::BFloat16* yp, float* out) {
  const int64_t a_stride = kblocks * kBlockElems;
  const int64_t mtiles = (M + kTileRows - 1) / kTileRows;
  const int64_t ldo = 2 * kTileN;
  const int64_t width = std::min<int64_t>(cols * kTileN, N - nb * kTileN);
  int64_t mt = 0;
  for (; mt + 2 <= mtiles; mt += 2) {
    const c10::BFloat16* a = ap + mt * a_stride;
    if (cols == 2) tile_kernel<2, 2>(a, a_stride, b, b_stride, kblocks, out, ldo);
    else tile_kernel<2, 1>(a, a_stride, b, b_stride, kblocks, out, ldo);
    write_out(out, ldo, std::min<int64_t>(2 * kTileRows, M - mt * kTileRows), width,
              yp + mt * kTileRows * N + nb * kTileN, N);
  }
  if (mt < mtiles) {
    const c10::BFloat16* a = ap + mt * a_stride;
    if (cols == 2) tile_kernel<1, 2>(a, a_stride, b, b_stride, kblocks, out, ldo);
    else tile_kernel<1, 1>(a, a_stride, b, b_stride, kblocks, out, ldo);
    write_out(out, ldo, M - mt * kTileRows, width, yp + mt * kTileRows * N + nb * kTileN, N);
  }
}

void run_amx(const c10::BFloat16* ap, int64_t M, int64_t kblocks, const c10::BFloat16* wp,
             int64_t N, c10::BFloat16* yp) {
  const int64_t nblocks = (N + kTileN - 1) / kTileN;
  const int64_t b_stride = kblocks * kBlockElems;
  const int64_t tasks = (nblocks + kColsPerTask - 1) / kColsPerTask;
  at::parallel_for(0, tasks, 1, [&](int64_t t0, int64_t t1) {
    configure_tiles();
    alignas(64) float out[2 * kTileRows * 2 * kTileN];
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t nb = t * kColsPerTask;
      const int64_t cols = std::min<int64_t>(kColsPerTask, nblocks - nb);
      column_task(ap, M, kblocks, wp + nb * b_stride, b_stride, nb, cols, N, yp, out);
    }
    _tile_release();
  });
}

// ---------------------------------------------------------------- GGUF blocks on tiles
//
// The quantized products (Q4_1, Q8_0) with bfloat16 activations. A block of 32 weights
// of output n is w = d q + m (Q4_1, q in 0..15) or w = d q (Q8_0, q in -128..127), with
// d, m per block (float16 in the file, exact in float32). So
//   y[m, n] = sum over blocks b of  d[n, b] (x[m, b] . q[n, b])  +  m[n, b] S[m, b]
// where S[m, b] is the sum of row m's 32 values of block b. The integers q are exact in
// bfloat16, so one TDPBF16PS per block computes x . q of 16 rows x 16 outputs (float32
// products of the file's weights exactly, no rounding of w), and each block's tile is
// then scaled into float32 accumulators: acc = fma(C, d, acc), then acc = fma(S, m, acc),
// blocks in increasing order, then one rounding to bfloat16. Every step of a row reads
// that row only, so a row's bits do not depend on M (row-invariant by construction).
// What streams from memory is 6 (Q4_1) or 9 (Q8_0) bits per weight, and expanding a
// block's integers costs a few instructions per 32 weights (a table lookup), once per
// call and group of 64 rows: verifying 16 rows costs about what one row costs.
//
// The tile layout and its row expansions: quant_tiles.h.
constexpr int64_t kGroupTiles = 4;  // row tiles per pass over a column block (C tiles 0-3)

inline void expand_q4_1(const uint8_t* t, __m512i table, __m512i shifts,
                        c10::BFloat16* tile) {
  for (int64_t p = 0; p < kTileRows; ++p)
    _mm512_storeu_si512(tile + p * kTileK, q4_1_tile_row(t + 128, p, table, shifts));
}

inline void expand_q8_0(const uint8_t* t, c10::BFloat16* tile) {
  for (int64_t p = 0; p < kTileRows; ++p) _mm512_storeu_si512(tile + p * kTileK, q8_0_tile_row(t + 64, p));
}

// One block's scaling into the float32 accumulators of `rows` rows: acc = fma(C, d, acc),
// then (Q4_1) acc = fma(S, m, acc). The only place this arithmetic is written: every path
// of the quantized product runs it, so a row gets the same bits whichever path runs it.
inline void scale_block(const uint8_t* tile, int64_t kind, const float* cbuf, float* acc,
                        int64_t rows, const float* sums, int64_t kblocks, int64_t kb) {
  const __m512 d = _mm512_loadu_ps(reinterpret_cast<const float*>(tile));
  if (kind == kTileQ4_1) {
    const __m512 mins = _mm512_loadu_ps(reinterpret_cast<const float*>(tile + 64));
    for (int64_t i = 0; i < rows; ++i) {
      __m512 v = _mm512_fmadd_ps(_mm512_loadu_ps(cbuf + i * kTileN), d,
                                 _mm512_loadu_ps(acc + i * kTileN));
      v = _mm512_fmadd_ps(_mm512_set1_ps(sums[i * kblocks + kb]), mins, v);
      _mm512_storeu_ps(acc + i * kTileN, v);
    }
  } else {
    for (int64_t i = 0; i < rows; ++i)
      _mm512_storeu_ps(acc + i * kTileN,
                       _mm512_fmadd_ps(_mm512_loadu_ps(cbuf + i * kTileN), d,
                                       _mm512_loadu_ps(acc + i * kTileN)));
  }
}

// R row tiles (rows valid: `rows`, at most 16 R) of the packed x against one column block:
// C tiles 0..R-1, A tiles 4 and 5, B tile 6; acc [16 R][16] float32.
template <int R>
inline void quant_group(const c10::BFloat16* a, int64_t a_stride, const float* sums,
                        int64_t kblocks, const uint8_t* q, int64_t kind, int64_t rows,
                        __m512i table, __m512i shifts, c10::BFloat16* buffer, float* cbuf,
                        float* acc) {
  const int64_t bytes = tile_bytes(kind);
  for (int64_t i = 0; i < rows; ++i) _mm512_storeu_ps(acc + i * kTileN, _mm512_setzero_ps());
  for (int64_t kb = 0; kb < kblocks; ++kb) {
    const uint8_t* tile = q + kb * bytes;
    for (int64_t line = 0; line < bytes; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(tile) + kQuantPrefetchBytes + line,
                   _MM_HINT_T0);
    if (kind == kTileQ4_1) expand_q4_1(tile, table, shifts, buffer);
    else expand_q8_0(tile, buffer);
    tile_load(6, buffer, 64);
    unroll<R>([&](auto r) {
      constexpr int ri = decltype(r)::value;
      constexpr int at = 4 + (ri & 1);
      tile_zero(ri);
      tile_load(at, a + ri * a_stride + kb * kBlockElems, 64);
      tile_dot(ri, at, 6);
    });
    unroll<R>([&](auto r) {
      constexpr int ri = decltype(r)::value;
      tile_store(ri, cbuf + ri * kTileRows * kTileN, kTileN * 4);
    });
    scale_block(tile, kind, cbuf, acc, rows, sums, kblocks, kb);
  }
}

// Up to 16 rows (one row tile, A tile 4) against C column blocks at once (C tiles 0..C-1,
// B tiles 6 and 7): C independent tile chains per block of k, and x's tile loaded once for
// all of them. The same arithmetic per output as quant_group.
template <int C>
inline void quant_cols(const c10::BFloat16* a, const float* sums, int64_t kblocks,
                       const uint8_t* q, int64_t kind, int64_t rows, __m512i table,
                       __m512i shifts, c10::BFloat16* buffer, float* cbuf, float* acc) {
  const int64_t bytes = tile_bytes(kind);
  const int64_t col_bytes = kblocks * bytes;
  for (int64_t c = 0; c < C; ++c)
    for (int64_t i = 0; i < rows; ++i)
      _mm512_storeu_ps(acc + (c * kTileRows + i) * kTileN, _mm512_setzero_ps());
  for (int64_t kb = 0; kb < kblocks; ++kb) {
    tile_load(4, a + kb * kBlockElems, 64);
    unroll<C>([&](auto c) {
      constexpr int ci = decltype(c)::value;
      constexpr int bt = 6 + (ci & 1);
      const uint8_t* tile = q + ci * col_bytes + kb * bytes;
      for (int64_t line = 0; line < bytes; line += 64)
        _mm_prefetch(reinterpret_cast<const char*>(tile) + kQuantPrefetchBytes + line,
                     _MM_HINT_T0);
      c10::BFloat16* b = buffer + ci * kBlockElems;
      if (kind == kTileQ4_1) expand_q4_1(tile, table, shifts, b);
      else expand_q8_0(tile, b);
      tile_zero(ci);
      tile_load(bt, b, 64);
      tile_dot(ci, 4, bt);
    });
    unroll<C>([&](auto c) {
      constexpr int ci = decltype(c)::value;
      tile_store(ci, cbuf + ci * kTileRows * kTileN, kTileN * 4);
    });
    for (int64_t c = 0; c < C; ++c)
      scale_block(q + c * col_bytes + kb * bytes, kind, cbuf + c * kTileRows * kTileN,
                  acc + c * kTileRows * kTileN, rows, sums, kblocks, kb);
  }
}

void run_amx_quant(const c10::BFloat16* ap, const float* sums, int64_t M, int64_t kblocks,
                   const uint8_t* qp, int64_t kind, int64_t N, c10::BFloat16* yp) {
  const int64_t nblocks = (N + kTileN - 1) / kTileN;
  const int64_t bytes = tile_bytes(kind);
  const int64_t a_stride = kblocks * kBlockElems;
  const int64_t mtiles = (M + kTileRows - 1) / kTileRows;
  // One row: tiles of one row (a C tile store is then 64 bytes, not 1 KiB).
  const int tile_rows = static_cast<int>(std::min<int64_t>(M, kTileRows));
  if (mtiles == 1) {  // decoding and verification: 4 column blocks at once
    const int64_t groups = (nblocks + kGroupTiles - 1) / kGroupTiles;
    at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
      TileConfig config;
      for (int t = 0; t < 8; ++t) {
        config.colsb[t] = 64;
        config.rows[t] = t >= 6 ? kTileRows : tile_rows;
      }
      _tile_loadconfig(&config);
      const __m512i table = small_int_table();
      const __m512i shifts = nibble_shifts();
      alignas(64) c10::BFloat16 buffer[kGroupTiles * kBlockElems];
      alignas(64) float cbuf[kGroupTiles * kTileRows * kTileN];
      alignas(64) float acc[kGroupTiles * kTileRows * kTileN];
      for (int64_t g = g0; g < g1; ++g) {
        const int64_t nb = g * kGroupTiles;
        const int64_t cols = std::min<int64_t>(kGroupTiles, nblocks - nb);
        const uint8_t* q = qp + nb * kblocks * bytes;
        switch (cols) {
          case 1: quant_cols<1>(ap, sums, kblocks, q, kind, M, table, shifts, buffer, cbuf, acc); break;
          case 2: quant_cols<2>(ap, sums, kblocks, q, kind, M, table, shifts, buffer, cbuf, acc); break;
          case 3: quant_cols<3>(ap, sums, kblocks, q, kind, M, table, shifts, buffer, cbuf, acc); break;
          default: quant_cols<4>(ap, sums, kblocks, q, kind, M, table, shifts, buffer, cbuf, acc); break;
        }
        for (int64_t c = 0; c < cols; ++c)
          write_out(acc + c * kTileRows * kTileN, kTileN, M,
                    std::min<int64_t>(kTileN, N - (nb + c) * kTileN), yp + (nb + c) * kTileN, N);
      }
      _tile_release();
    });
    return;
  }
  at::parallel_for(0, nblocks, 1, [&](int64_t n0, int64_t n1) {
    TileConfig config;
    for (int t = 0; t < 8; ++t) {
      config.colsb[t] = 64;
      config.rows[t] = t == 6 ? kTileRows : tile_rows;  // B tile: always 16 k pairs
    }
    _tile_loadconfig(&config);
    const __m512i table = small_int_table();
    const __m512i shifts = nibble_shifts();
    alignas(64) c10::BFloat16 buffer[kBlockElems];
    alignas(64) float cbuf[kGroupTiles * kTileRows * kTileN];
    alignas(64) float acc[kGroupTiles * kTileRows * kTileN];
    for (int64_t nb = n0; nb < n1; ++nb) {
      const uint8_t* q = qp + nb * kblocks * bytes;
      const int64_t width = std::min<int64_t>(kTileN, N - nb * kTileN);
      for (int64_t mt = 0; mt < mtiles; mt += kGroupTiles) {
        const int64_t row0 = mt * kTileRows;
        const int64_t rows = std::min<int64_t>(kGroupTiles * kTileRows, M - row0);
        const c10::BFloat16* a = ap + mt * a_stride;
        const float* s = sums + row0 * kblocks;
        switch (std::min<int64_t>(kGroupTiles, mtiles - mt)) {
          case 1: quant_group<1>(a, a_stride, s, kblocks, q, kind, rows, table, shifts, buffer, cbuf, acc); break;
          case 2: quant_group<2>(a, a_stride, s, kblocks, q, kind, rows, table, shifts, buffer, cbuf, acc); break;
          case 3: quant_group<3>(a, a_stride, s, kblocks, q, kind, rows, table, shifts, buffer, cbuf, acc); break;
          default: quant_group<4>(a, a_stride, s, kblocks, q, kind, rows, table, shifts, buffer, cbuf, acc); break;
        }
        write_out(acc, kTileN, rows, width, yp + row0 * N + nb * kTileN, N);
      }
    }
    _tile_release();
  });
}

// x as whole A tiles (pack_rows), in a buffer of the calling thread kept between calls
// (no allocation per product: a decoding step makes 120 of them).
const c10::BFloat16* packed_rows(const torch::Tensor& x, int64_t kblocks) {
  static thread_local std::vector<c10::BFloat16> a;
  const int64_t M = x.size(0);
  const int64_t need = (M + kTileRows - 1) / kTileRows * kblocks * kBlockElems;
  if (static_cast<int64_t>(a.size()) < need) a.resize(need);
  pack_rows(x.data_ptr<c10::BFloat16>(), x.stride(0), M, x.size(1), kblocks, a.data());
  return a.data();
}

#endif  // SPECDEC_AMX

}  // namespace

// Whether amx_gemm runs here: built with AMX, the CPU has AMX-BF16, and the kernel let this
// process use the tile state.
bool amx_available() {
#if defined(SPECDEC_AMX)
  return amx_usable();
#else
  return false;
#endif
}

// x: [M, K] bfloat16 rows contiguous; packed: [N_blocks, K_blocks, 16, 16, 2] bfloat16
// (above); y: [M, N] bfloat16 contiguous.
void amx_gemm(torch::Tensor x, torch::Tensor packed, torch::Tensor y) {
  TORCH_CHECK(amx_available(), "AMX bfloat16 tiles are not available on this machine");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == torch::kBFloat16,
              "x must be a bfloat16 [M, K] tensor with contiguous rows");
  TORCH_CHECK(packed.dim() == 5 && packed.is_contiguous() && packed.size(2) == 16 &&
                  packed.size(3) == 16 && packed.size(4) == 2 &&
                  packed.scalar_type() == torch::kBFloat16,
              "packed must be a contiguous bfloat16 [N/16, K/32, 16, 16, 2] tensor");
  TORCH_CHECK(y.dim() == 2 && y.is_contiguous() && y.size(0) == x.size(0) &&
                  y.scalar_type() == torch::kBFloat16 && y.size(1) <= packed.size(0) * 16 &&
                  y.size(1) > (packed.size(0) - 1) * 16,
              "y must be a contiguous bfloat16 [M, N] tensor matching packed's N");
#if defined(SPECDEC_AMX)
  const int64_t M = x.size(0), K = x.size(1), kblocks = packed.size(1);
  TORCH_CHECK(K <= kblocks * kTileK && K > (kblocks - 1) * kTileK,
              "x has K = ", K, " but packed holds ", kblocks * kTileK, " (padded)");
  if (M == 0) return;
  run_amx(packed_rows(x, kblocks), M, kblocks, packed.data_ptr<c10::BFloat16>(), y.size(1),
          y.data_ptr<c10::BFloat16>());
#endif
}

// x: [M, K] bfloat16 rows contiguous; tiles: [N_blocks, K_blocks, tile bytes] uint8 (the
// tile layout above); kind: 0 = Q4_1, 1 = Q8_0; y: [M, N] bfloat16 contiguous.
void amx_quant_gemm(torch::Tensor x, torch::Tensor tiles, int64_t kind, torch::Tensor y) {
  TORCH_CHECK(amx_available(), "AMX bfloat16 tiles are not available on this machine");
  specdec::check_tile_product(x, tiles, kind, y, 384, 576);
#if defined(SPECDEC_AMX)
  const int64_t M = x.size(0), kblocks = tiles.size(1);
  if (M == 0) return;
  const float* sums = block_sums(x, kblocks);
  run_amx_quant(packed_rows(x, kblocks), sums, M, kblocks, tiles.data_ptr<uint8_t>(),
                kind, y.size(1), y.data_ptr<c10::BFloat16>());
#endif
}
