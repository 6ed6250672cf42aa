// GGUF blocks as 16 x 32 tiles of integers (specdec.runtime.quant.amx_layout), shared by
// the two kernels that read them with bfloat16 activations: amx.cpp (AMX's TDPBF16PS on
// whole tiles) and dpbf16.cpp (AVX512-BF16's VDPBF16PS, one tile row per instruction).
//
// A block of 32 weights of output n is w = d q + m (Q4_1, q in 0..15) or w = d q (Q8_0,
// q in -128..127), with d, m per block (float16 in the file, exact in float32). So
//   y[m, n] = sum over blocks b of  d[n, b] (x[m, b] . q[n, b])  +  m[n, b] S[m, b]
// where S[m, b] is the sum of row m's 32 values of block b. The integers q are exact in
// bfloat16, so bfloat16 pair dot products compute x . q from the file's weights exactly
// (no rounding of w), float32 accumulation.
//
// Tile layout (amx_layout), per 16 outputs j x 32 k:
//   Q4_1: float32 d[16], float32 m[16], then 16 rows p of 16 bytes: output j's byte
//         holds q_j[2p] (low nibble) and q_j[2p + 1] (high), at position pos(j) below
//                                                                    (384 bytes)
//   Q8_0: float32 d[16], then 16 rows p of 32 int8: q_j[2p], q_j[2p + 1] for each j
//                                                                    (576 bytes)
// so row p (the pairs of k 2p, 2p + 1 for the 16 outputs) expands from one 16- or 32-byte
// load into one register of 32 bfloat16: output j's pair at words 2j, 2j + 1. (dpbf16.cpp
// reads the same rows with the scales in float16, see there.)
#pragma once

#include "common.h"

#include <vector>

namespace specdec {

// Bytes of one dense tile of 16 outputs x 32 k (dpbf16.cpp's kind 2): 16 rows of 64 bytes.
constexpr int64_t kDenseTileBytes = 1024;

// The arguments of a tile product (amx_quant_gemm, dpbf16_quant_gemm): x [M, K] bfloat16
// rows contiguous; tiles [N/16, K/32, bytes] uint8 contiguous, bytes = q4_bytes (kind 0,
// Q4_1), q8_bytes (kind 1, Q8_0) or, where the kernel has one (dense_bytes > 0), dense_bytes
// (kind 2, dense bfloat16); y [M, N] bfloat16 contiguous.
inline void check_tile_product(const torch::Tensor& x, const torch::Tensor& tiles, int64_t kind,
                               const torch::Tensor& y, int64_t q4_bytes, int64_t q8_bytes,
                               int64_t dense_bytes = 0) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == torch::kBFloat16,
              "x must be a bfloat16 [M, K] tensor with contiguous rows");
  TORCH_CHECK(kind == 0 || kind == 1 || (kind == 2 && dense_bytes > 0), "unknown tile kind ",
              kind, dense_bytes > 0 ? " (0 = Q4_1, 1 = Q8_0, 2 = dense)" : " (0 = Q4_1, 1 = Q8_0)");
  const int64_t bytes = kind == 0 ? q4_bytes : kind == 1 ? q8_bytes : dense_bytes;
  TORCH_CHECK(tiles.dim() == 3 && tiles.is_contiguous() && tiles.scalar_type() == torch::kUInt8 &&
                  tiles.size(2) == bytes,
              "tiles must be a contiguous uint8 [N/16, K/32, ", bytes, "] tensor");
  TORCH_CHECK(y.dim() == 2 && y.is_contiguous() && y.size(0) == x.size(0) &&
                  y.scalar_type() == torch::kBFloat16 && y.size(1) <= tiles.size(0) * 16 &&
                  y.size(1) > (tiles.size(0) - 1) * 16,
              "y must be a contiguous bfloat16 [M, N] tensor matching the tiles' N");
  TORCH_CHECK(x.size(1) == tiles.size(1) * 32,
              "x has K = ", x.size(1), " but the tiles hold ", tiles.size(1) * 32);
}

}  // namespace specdec

// AVX512-BF16 (pair dot products, rounding to bfloat16) and VBMI (the nibble shuffle)
#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512VBMI__)
#define SPECDEC_QUANT_TILES 1

namespace specdec {

enum TileKind : int64_t { kTileQ4_1 = 0, kTileQ8_0 = 1 };
constexpr int64_t tile_bytes(int64_t kind) { return kind == kTileQ4_1 ? 384 : 576; }
constexpr int64_t kTileQuantRows = 16;  // rows p of a tile (pairs of k)
constexpr int64_t kTileQuantK = 32;     // k per tile (one GGUF block)

// The bfloat16 bits of 0..15 (a Q4_1 q), twice, for a 16-bit table lookup that reads the
// low 5 bits of its index (so the bit above a nibble does not matter).
inline __m512i small_int_table() {
  alignas(64) uint16_t bits[32];
  for (int i = 0; i < 32; ++i) {
    const float f = static_cast<float>(i & 15);
    uint32_t u;
    std::memcpy(&u, &f, 4);
    bits[i] = static_cast<uint16_t>(u >> 16);  // exact: small integers fit bfloat16
  }
  return _mm512_load_si512(bits);
}

// Row p's 16 bytes are stored with output j's byte at position pos(j): j = 0, 1, 4, 5, 8,
// 9, 12, 13 first, then 2, 3, 6, 7, 10, 11, 14, 15 (amx_layout), so that, broadcast to the
// four 128-bit lanes, the 64-bit lane L of the row holds the bytes of outputs 2L and
// 2L + 1: one VPMULTISHIFTQB then moves each nibble to the low bits of its own 16-bit
// word, in the order the dot products want (output j's q[2p], q[2p + 1] at words 2j,
// 2j + 1).
inline __m512i nibble_shifts() {
  alignas(64) uint8_t control[64];
  for (int lane = 0; lane < 8; ++lane) {
    const int first = 2 * (lane / 2);  // byte position of output 2L within the lane
    for (int w = 0; w < 4; ++w) {      // words: (2L, e0), (2L, e1), (2L+1, e0), (2L+1, e1)
      control[8 * lane + 2 * w] = static_cast<uint8_t>(8 * (first + w / 2) + 4 * (w % 2));
      control[8 * lane + 2 * w + 1] = 0;  // not read by the table lookup
    }
  }
  return _mm512_load_si512(control);
}

// Row p of a Q4_1 tile as 32 bfloat16 integers (output j's q[2p], q[2p + 1] at words 2j,
// 2j + 1), from the tile's 16 rows of 16 nibble bytes at `nibbles`: a broadcast load, the
// nibble shuffle and the table lookup (which reads bits 0-4 of each word: the nibble, and a
// bit of its neighbour that the doubled table ignores).
inline __m512i q4_1_tile_row(const uint8_t* nibbles, int64_t p, __m512i table,
                             __m512i shifts) {
  const __m512i row = _mm512_broadcast_i32x4(
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(nibbles + 16 * p)));
  return _mm512_permutexvar_epi16(_mm512_multishift_epi64_epi8(shifts, row), table);
}

// Row p of a Q8_0 tile as 32 bfloat16 integers, from its 16 rows of 32 int8 at `ints`
// (exact: |q| <= 128 fits bfloat16).
inline __m512i q8_0_tile_row(const uint8_t* ints, int64_t p) {
  const uint8_t* q = ints + 32 * p;
  const __m512 lo = _mm512_cvtepi32_ps(
      _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q))));
  const __m512 hi = _mm512_cvtepi32_ps(
      _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16))));
  return reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo));
}

// S[m, b]: each row's sum over each block of 32 values of x [M, K] (bfloat16, rows
// contiguous), float32, k in increasing order; in a buffer of the calling thread kept
// between calls (no allocation per product).
inline const float* block_sums(const torch::Tensor& x, int64_t kblocks) {
  static thread_local std::vector<float> sums;
  const int64_t M = x.size(0), xs = x.stride(0);
  if (static_cast<int64_t>(sums.size()) < M * kblocks) sums.resize(M * kblocks);
  const c10::BFloat16* xp = x.data_ptr<c10::BFloat16>();
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < kblocks; ++b) {
      float sum = 0.f;
      for (int64_t i = 0; i < kTileQuantK; ++i) sum += to_float(xp[m * xs + b * kTileQuantK + i]);
      sums[m * kblocks + b] = sum;
    }
  return sums.data();
}

}  // namespace specdec

#endif
