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
#include "common.h"

#include <ATen/Parallel.h>

#include <utility>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__)
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

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {0};
  uint16_t colsb[16] = {0};
  uint8_t rows[16] = {0};
};

// Every tile 16 rows of 64 bytes (A: 16 rows x 32 bfloat16; B: 16 k pairs x 16 outputs;
// C: 16 rows x 16 float32).
inline void configure_tiles() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.colsb[t] = 64;
    config.rows[t] = kTileRows;
  }
  _tile_loadconfig(&config);
}


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
//   a: the first row, a_stride bytes between rows; b: the first block of the first column
//   block, b_stride bfloat16 values between column blocks; out: float32 [16 R][ldo].
template <int R, int C>
inline void tile_kernel(const c10::BFloat16* a, int64_t a_stride, const c10::BFloat16* b,
                        int64_t b_stride, int64_t kblocks, float* out, int64_t ldo) {
  static_assert(R * C <= 4 && R <= 2, "8 tile registers");
  unroll<R * C>([&](auto i) { tile_zero(decltype(i)::value); });
  const char* bp = reinterpret_cast<const char*>(b);
  for (int64_t kb = 0; kb < kblocks; ++kb) {
    unroll<R>([&](auto r) {
      constexpr int ri = decltype(r)::value;
      tile_load(R * C + ri, a + ri * kTileRows * (a_stride / 2) + kb * kTileK, a_stride);
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

void run_amx(const c10::BFloat16* xp, int64_t xs_bytes, int64_t M, int64_t kblocks,
             const c10::BFloat16* wp, int64_t N, c10::BFloat16* yp) {
  const int64_t nblocks = (N + kTileN - 1) / kTileN;
  const int64_t b_stride = kblocks * kBlockElems;
  const int64_t mtiles = (M + kTileRows - 1) / kTileRows;
  const int64_t tasks = (nblocks + kColsPerTask - 1) / kColsPerTask;
  at::parallel_for(0, tasks, 1, [&](int64_t t0, int64_t t1) {
    configure_tiles();
    alignas(64) float out[2 * kTileRows * 2 * kTileN];
    const int64_t ldo = 2 * kTileN;
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t nb = t * kColsPerTask;
      const int64_t cols = std::min<int64_t>(kColsPerTask, nblocks - nb);
      const c10::BFloat16* b = wp + nb * b_stride;
      int64_t mt = 0;
      for (; mt + 2 <= mtiles; mt += 2) {
        const c10::BFloat16* a = xp + mt * kTileRows * (xs_bytes / 2);
        if (cols == 2) tile_kernel<2, 2>(a, xs_bytes, b, b_stride, kblocks, out, ldo);
        else tile_kernel<2, 1>(a, xs_bytes, b, b_stride, kblocks, out, ldo);
        write_out(out, ldo, std::min<int64_t>(2 * kTileRows, M - mt * kTileRows),
                  std::min<int64_t>(cols * kTileN, N - nb * kTileN),
                  yp + mt * kTileRows * N + nb * kTileN, N);
      }
      if (mt < mtiles) {
        const c10::BFloat16* a = xp + mt * kTileRows * (xs_bytes / 2);
        if (cols == 2) tile_kernel<1, 2>(a, xs_bytes, b, b_stride, kblocks, out, ldo);
        else tile_kernel<1, 1>(a, xs_bytes, b, b_stride, kblocks, out, ldo);
        write_out(out, ldo, M - mt * kTileRows,
                  std::min<int64_t>(cols * kTileN, N - nb * kTileN),
                  yp + mt * kTileRows * N + nb * kTileN, N);
      }
    }
    _tile_release();
  });
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
  // A tiles read 16 rows of 32 k: pad x with zero rows / columns unless it is whole.
  torch::Tensor a = x;
  if (M % kTileRows || K != kblocks * kTileK) {
    a = torch::zeros({(M + kTileRows - 1) / kTileRows * kTileRows, kblocks * kTileK},
                     x.options());
    a.narrow(0, 0, M).narrow(1, 0, K).copy_(x);
  }
  run_amx(a.data_ptr<c10::BFloat16>(), a.stride(0) * 2, M, kblocks,
          packed.data_ptr<c10::BFloat16>(), y.size(1), y.data_ptr<c10::BFloat16>());
#endif
}
