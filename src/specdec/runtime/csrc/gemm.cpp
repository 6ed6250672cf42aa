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
// On CPUs with AVX2 and FMA but no AVX-512 (AMD Zen 1-3, Intel client cores) the same
// arithmetic runs on 16 lanes held as two 8-lane registers (common.h's V16): the same bits
// as the AVX-512 FMA path, at most 4 accumulators per block (16 registers); without
// either, a portable loop (16 partial sums, unfused), about 8x slower.
#include "common.h"

#include <ATen/Parallel.h>

#include <memory>
#include <vector>

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
// The quantized products read 5-6 bits per weight, so a few rows ahead is too close: they
// prefetch this many bytes ahead in the (contiguous) block stream instead (measured on the
// same Xeon, one-row Q4_1 products over 30 layers' matrices with 2 threads: 4 rows ahead
// (1.7 KB at K = 576) read at 10.6 GB/s, 14 KB ahead at 14.4).
#ifndef SPECDEC_QUANT_PREFETCH
#define SPECDEC_QUANT_PREFETCH 16384
#endif
constexpr int64_t kQuantPrefetchBytes = SPECDEC_QUANT_PREFETCH;

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
#elif defined(SPECDEC_AVX2)
// 16 elements of a row from k as V16, zeros past K (`left` = K - k).
template <typename T>
inline V16 load_tail(const T* p, int64_t left) {
  alignas(32) float tmp[kLanes] = {0.f};
  for (int64_t i = 0; i < left && i < kLanes; ++i) tmp[i] = to_float(p[i]);
  return v16_load(tmp);
}

// block_fma's arithmetic on V16 (the same bits): MB x NB accumulators of two registers
// each, at most 4 of them (AVX2 has 16 registers), held as arrays of __m256 (lanes 0-7
// and 8-15) so that the compiler keeps them in registers (an array of V16 went through
// the stack on every step).
template <typename T, int MB, int NB>
inline void block_v16(const T* x, int64_t xs, const T* w, int64_t K, T* y, int64_t ys) {
  __m256 lo[MB][NB], hi[MB][NB];
  _Pragma("GCC unroll 4")
  for (int m = 0; m < MB; ++m)
    _Pragma("GCC unroll 4")
    for (int j = 0; j < NB; ++j) lo[m][j] = hi[m][j] = _mm256_setzero_ps();
  const int64_t full = K / kLanes * kLanes;
  for (int64_t k = 0; k < full; k += kLanes) {
    __m256 wl[NB], wh[NB];
    _Pragma("GCC unroll 4")
    for (int j = 0; j < NB; ++j) {
      _mm_prefetch(reinterpret_cast<const char*>(w + (kPrefetchRows + j) * K + k), _MM_HINT_T0);
      const V16 v = v16_load(w + j * K + k);
      wl[j] = v.lo;
      wh[j] = v.hi;
    }
    _Pragma("GCC unroll 4")
    for (int m = 0; m < MB; ++m) {
      const V16 xv = v16_load(x + m * xs + k);
      _Pragma("GCC unroll 4")
      for (int j = 0; j < NB; ++j) {
        lo[m][j] = _mm256_fmadd_ps(xv.lo, wl[j], lo[m][j]);
        hi[m][j] = _mm256_fmadd_ps(xv.hi, wh[j], hi[m][j]);
      }
    }
  }
  if (full < K) {
    __m256 wl[NB], wh[NB];
    _Pragma("GCC unroll 4")
    for (int j = 0; j < NB; ++j) {
      const V16 v = load_tail(w + j * K + full, K - full);
      wl[j] = v.lo;
      wh[j] = v.hi;
    }
    _Pragma("GCC unroll 4")
    for (int m = 0; m < MB; ++m) {
      const V16 xv = load_tail(x + m * xs + full, K - full);
      _Pragma("GCC unroll 4")
      for (int j = 0; j < NB; ++j) {
        lo[m][j] = _mm256_fmadd_ps(xv.lo, wl[j], lo[m][j]);
        hi[m][j] = _mm256_fmadd_ps(xv.hi, wh[j], hi[m][j]);
      }
    }
  }
  _Pragma("GCC unroll 4")
  for (int m = 0; m < MB; ++m)
    _Pragma("GCC unroll 4")
    for (int j = 0; j < NB; ++j) y[m * ys + j] = from_float<T>(v16_reduce_add({lo[m][j], hi[m][j]}));
}

// An MB x NB block as sub-blocks of at most 4 accumulators (each output's arithmetic does
// not depend on its sub-block): NB split first (2 x 2 reads fewer registers per FMA than
// 1 x 4), down to 1 x 4 for one row.
template <typename T, int MB, int NB>
inline void block(const T* x, int64_t xs, const T* w, int64_t K, T* y, int64_t ys) {
  if constexpr (MB * NB <= 4) {
    block_v16<T, MB, NB>(x, xs, w, K, y, ys);
  } else if constexpr (NB > 2) {
    block<T, MB, NB / 2>(x, xs, w, K, y, ys);
    block<T, MB, NB - NB / 2>(x, xs, w + (NB / 2) * K, K, y + NB / 2, ys);
  } else {
    block<T, MB / 2, NB>(x, xs, w, K, y, ys);
    block<T, MB - MB / 2, NB>(x + (MB / 2) * xs, xs, w, K, y + (MB / 2) * ys, ys);
  }
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


// ---------------------------------------------------------------- GGUF block formats
//
// Weight-only quantized products: the weights stay in llama.cpp's block formats (GGUF)
// and are expanded block by block inside the product. What is computed is exactly
//   y = cast(small_gemm(float32(x), W))   W = the dequantized float32 matrix
// with W as gguf-py and ggml dequantize (Q4_1: w = d q + m, a float32 product then a
// float32 sum; Q8_0: w = q d): the file's weights exactly, float32 accumulation in the
// dense float32 kernel's order (16 lanes, k then k + 16 within each block of 32), the
// result cast to x's dtype. So a row's bits do not depend on M (row-invariant by
// construction), and what streams from memory is the block data: 5.0 bits per weight for
// Q4_1, 8.5 for Q8_0, against 16 for bfloat16. (float32 FMAs rather than bfloat16 pair
// dot products: those run at a quarter of the FMA rate on the CPUs measured here.)
//
// Layouts (ggml's block_q4_1 / block_q8_0, 32 weights per block along K):
//   Q4_1: float16 d, float16 m, 16 bytes: byte j holds q_j (low nibble), q_{j+16} (high)
//   Q8_0: float16 d, 32 int8 q_j
// and the kernel's own layout of a Q4_1 block (specdec.runtime.quant.kernel_layout), made
// once at load so that expanding a block costs fewer instructions (about 2x faster, so a
// one-row product is no longer bound by the expansion):
//   Q4_1K: float32 d, float32 m, 16 bytes: byte 4c + i holds q_{c + 4i} (low nibble) and
//          q_{c + 4i + 16} (high); the same 16 bytes as Q4_1's, as a transposed 4 x 4 array.
// Broadcast to the 16 lanes of a register, lane l's 32 bits then hold the nibbles of
// weights l and l + 16 at bit 8 (l / 4) and 8 (l / 4) + 4: one variable shift per 16
// weights brings each lane's nibble to its low bits, where the permute reads its index.

constexpr int64_t kBlock = 32;
constexpr int kRegisterRows = 16;  // rows of x whose products expand blocks in registers
#ifndef SPECDEC_REGISTER_ROWS_V16
#define SPECDEC_REGISTER_ROWS_V16 8
#endif
// The same with AVX2 (V16): measured on a 2-core AMD EPYC (Zen 3, AVX2), 30 layers of
// SmolLM2 Q4_1 products: 1.13-1.20x faster than the buffer path from 3 to 8 rows, equal at 16.
constexpr int kRegisterRowsV16 = SPECDEC_REGISTER_ROWS_V16;
enum QuantKind : int64_t { kQ4_1 = 0, kQ8_0 = 1, kQ4_1K = 2 };

constexpr int64_t block_bytes(int64_t kind) {
  return kind == kQ4_1 ? 20 : kind == kQ8_0 ? 34 : 24;
}

#if defined(__AVX512F__)
// One block's 32 weights as float32: lo = weights 0..15, hi = 16..31. A Q4_1 block holds
// at most 16 distinct weights, d q + m for q = 0..15: those 16 are computed (the same
// float32 product and sum) and each weight picked by its nibble with one permute.
template <int64_t kind>
inline void expand_f32(const uint8_t* b, __m512& lo, __m512& hi) {
  if constexpr (kind == kQ4_1K) {  // the same values: d q + m for q = 0..15, picked by nibble
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    float d, m;
    std::memcpy(&d, b, sizeof(d));
    std::memcpy(&m, b + 4, sizeof(m));
    const __m512 table = _mm512_add_ps(_mm512_mul_ps(_mm512_set1_ps(d), iota), _mm512_set1_ps(m));
    const __m512i q = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 8)));
    const __m512i shift_lo = _mm512_setr_epi32(0, 0, 0, 0, 8, 8, 8, 8, 16, 16, 16, 16, 24, 24, 24, 24);
    const __m512i shift_hi = _mm512_add_epi32(shift_lo, _mm512_set1_epi32(4));
    lo = _mm512_permutexvar_ps(_mm512_srlv_epi32(q, shift_lo), table);  // reads bits 0..3
    hi = _mm512_permutexvar_ps(_mm512_srlv_epi32(q, shift_hi), table);
    return;
  }
  const __m512 dv = _mm512_set1_ps(half_bits_to_float(b));
  if constexpr (kind == kQ4_1) {
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 table = _mm512_add_ps(_mm512_mul_ps(dv, iota),
                                       _mm512_set1_ps(half_bits_to_float(b + 2)));
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 4));
    const __m128i nib = _mm_set1_epi8(0x0F);
    lo = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm_and_si128(q, nib)), table);
    hi = _mm512_permutexvar_ps(
        _mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(q, 4), nib)), table);
  } else {
    const __m128i q0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2));
    const __m128i q1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 18));
    lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q0)), dv);
    hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q1)), dv);
  }
}

#endif

#if defined(SPECDEC_AVX2)
// expand_f32 on V16: the same values (d q + m as a float32 product then sum, or q d),
// computed from each weight's q instead of looked up in a table of the 16 possible.
template <int64_t kind>
inline void expand_v16(const uint8_t* b, V16& lo, V16& hi) {
  const __m256i nib = _mm256_set1_epi32(0x0F);
  if constexpr (kind == kQ4_1K) {
    float d, m;
    std::memcpy(&d, b, sizeof(d));
    std::memcpy(&m, b + 4, sizeof(m));
    const __m256 dv = _mm256_set1_ps(d), mv = _mm256_set1_ps(m);
    const __m256i q = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 8)));
    // lane l's nibbles sit at bits 8 (l / 4) and 8 (l / 4) + 4 (see expand_f32)
    const __m256i s0 = _mm256_setr_epi32(0, 0, 0, 0, 8, 8, 8, 8);
    const __m256i s1 = _mm256_setr_epi32(16, 16, 16, 16, 24, 24, 24, 24);
    const __m256i four = _mm256_set1_epi32(4);
    auto w = [&](__m256i shift) {
      const __m256i qi = _mm256_and_si256(_mm256_srlv_epi32(q, shift), nib);
      return _mm256_add_ps(_mm256_mul_ps(dv, _mm256_cvtepi32_ps(qi)), mv);
    };
    lo = {w(s0), w(s1)};
    hi = {w(_mm256_add_epi32(s0, four)), w(_mm256_add_epi32(s1, four))};
    return;
  }
  const __m256 dv = _mm256_set1_ps(half_bits_to_float(b));
  if constexpr (kind == kQ4_1) {
    const __m256 mv = _mm256_set1_ps(half_bits_to_float(b + 2));
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 4));
    auto w = [&](__m128i bytes, int shift) {  // 8 bytes' nibbles at `shift`
      const __m256i qi = _mm256_and_si256(_mm256_srli_epi32(_mm256_cvtepu8_epi32(bytes), shift), nib);
      return _mm256_add_ps(_mm256_mul_ps(dv, _mm256_cvtepi32_ps(qi)), mv);
    };
    const __m128i upper = _mm_srli_si128(q, 8);
    lo = {w(q, 0), w(upper, 0)};
    hi = {w(q, 4), w(upper, 4)};
  } else {
    auto w = [&](int at) {
      const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 2 + at));
      return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)), dv);
    };
    lo = {w(0), w(8)};
    hi = {w(16), w(24)};
  }
}

// qblock on V16 (the same bits): MB rows of x against NB quantized rows, MB x NB at most
// 4 (AVX2's 16 registers; accumulators as __m256 arrays, see block_v16), each block
// expanded once per call.
template <int64_t kind, int MB, int NB>
inline void qblock(const float* x, int64_t xs, const uint8_t* q, int64_t row_bytes,
                   int64_t K, float* y, int64_t ys) {
  static_assert(MB * NB <= 4, "at most 4 accumulators of two registers");
  __m256 lo[MB][NB], hi[MB][NB];
  _Pragma("GCC unroll 4")
  for (int m = 0; m < MB; ++m)
    _Pragma("GCC unroll 4")
    for (int j = 0; j < NB; ++j) lo[m][j] = hi[m][j] = _mm256_setzero_ps();
  constexpr int64_t bb = block_bytes(kind);
  for (int64_t blk = 0, k = 0; k < K; ++blk, k += kBlock) {
    _Pragma("GCC unroll 4")
    for (int j = 0; j < NB; ++j) {
      const uint8_t* b = q + j * row_bytes + blk * bb;
      _mm_prefetch(reinterpret_cast<const char*>(b + kQuantPrefetchBytes), _MM_HINT_T0);
      V16 w0, w1;  // weights k .. k + 15, k + 16 .. k + 31
      expand_v16<kind>(b, w0, w1);
      _Pragma("GCC unroll 4")
      for (int m = 0; m < MB; ++m) {
        const float* xm = x + m * xs + k;
        lo[m][j] = _mm256_fmadd_ps(_mm256_loadu_ps(xm), w0.lo, lo[m][j]);
        hi[m][j] = _mm256_fmadd_ps(_mm256_loadu_ps(xm + 8), w0.hi, hi[m][j]);
        lo[m][j] = _mm256_fmadd_ps(_mm256_loadu_ps(xm + 16), w1.lo, lo[m][j]);
        hi[m][j] = _mm256_fmadd_ps(_mm256_loadu_ps(xm + 24), w1.hi, hi[m][j]);
      }
    }
  }
  _Pragma("GCC unroll 4")
  for (int m = 0; m < MB; ++m)
    _Pragma("GCC unroll 4")
    for (int j = 0; j < NB; ++j) y[m * ys + j] = v16_reduce_add({lo[m][j], hi[m][j]});
}

// A few rows of x against the quantized rows [n, n1), four (one row) or two at a time,
// rows in pairs, blocks expanded in registers (again from L1 for each pair of rows); more
// rows take the buffer path (run_quant).
template <int64_t kind>
inline void qcols_v16(const float* x, int64_t xs, int64_t M, const uint8_t* q,
                      int64_t row_bytes, int64_t K, float* y, int64_t N, int64_t n, int64_t n1) {
  if (M == 1) {
    for (; n + 4 <= n1; n += 4) qblock<kind, 1, 4>(x, xs, q + n * row_bytes, row_bytes, K, y + n, N);
  } else {
    for (; n + 2 <= n1; n += 2) {
      int64_t m = 0;
      for (; m + 2 <= M; m += 2)
        qblock<kind, 2, 2>(x + m * xs, xs, q + n * row_bytes, row_bytes, K, y + m * N + n, N);
      if (m < M) qblock<kind, 1, 2>(x + m * xs, xs, q + n * row_bytes, row_bytes, K, y + m * N + n, N);
    }
  }
  for (; n < n1; ++n)
    for (int64_t m = 0; m < M; ++m)
      qblock<kind, 1, 1>(x + m * xs, xs, q + n * row_bytes, row_bytes, K, y + m * N + n, N);
}
#endif

#if defined(__AVX512F__)
// MB rows of x against NB quantized rows, each block expanded in registers once for the
// MB rows: block_fma's arithmetic on the expanded matrix (so the same bits).
template <int64_t kind, int MB, int NB>
inline void qblock(const float* x, int64_t xs, const uint8_t* q, int64_t row_bytes,
                   int64_t K, float* y, int64_t ys) {
  __m512 acc[MB][NB];
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_setzero_ps();
  constexpr int64_t bb = block_bytes(kind);
  for (int64_t blk = 0, k = 0; k < K; ++blk, k += kBlock) {
    __m512 lo[NB], hi[NB];
    for (int j = 0; j < NB; ++j) {
      const uint8_t* b = q + j * row_bytes + blk * bb;
      _mm_prefetch(reinterpret_cast<const char*>(b + kQuantPrefetchBytes), _MM_HINT_T0);
      expand_f32<kind>(b, lo[j], hi[j]);
    }
    for (int m = 0; m < MB; ++m) {
      const __m512 x0 = _mm512_loadu_ps(x + m * xs + k);
      for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_fmadd_ps(x0, lo[j], acc[m][j]);
      const __m512 x1 = _mm512_loadu_ps(x + m * xs + k + kLanes);
      for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_fmadd_ps(x1, hi[j], acc[m][j]);
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < NB; ++j) y[m * ys + j] = _mm512_reduce_add_ps(acc[m][j]);
}

// qblock for M <= MB rows (MB, MB - 1, ... instantiated down to 1).
template <int64_t kind, int NB, int MB>
inline void qrows(const float* x, int64_t xs, int64_t M, const uint8_t* q, int64_t row_bytes,
                  int64_t K, float* y, int64_t N) {
  if constexpr (MB > 1) {
    if (M < MB) {
      qrows<kind, NB, MB - 1>(x, xs, M, q, row_bytes, K, y, N);
      return;
    }
  }
  qblock<kind, MB, NB>(x, xs, q, row_bytes, K, y, N);
}

// Up to 16 rows with every block expanded in registers: NB rows of W at a time against the
// rows of x in chunks of MB, the MB x NB accumulators held in registers. A chunk beyond
// the first expands the NB rows' blocks again, but from the L1 cache: the weights stream
// from memory once, and there is no buffer round trip. (Measured on a 2-core Xeon, one-row
// to 16-row products over SmolLM2's Q4_1 matrices: 4 x 4 chunks beat 8 x 2 chunks, 16 x 1
// and the buffer path from 5 to 16 rows; 16 rows cost about 5x one row, bound by the
// FMAs, against 6x through the buffer.)
template <int64_t kind, int NB, int MB>
inline void qcols(const float* x, int64_t xs, int64_t M, const uint8_t* q, int64_t row_bytes,
                  int64_t K, float* y, int64_t N, int64_t n, int64_t n1) {
  for (; n + NB <= n1; n += NB)
    for (int64_t m0 = 0; m0 < M; m0 += MB)
      qrows<kind, NB, MB>(x + m0 * xs, xs, std::min<int64_t>(MB, M - m0), q + n * row_bytes,
                          row_bytes, K, y + m0 * N + n, N);
  for (; n < n1; ++n)
    for (int64_t m0 = 0; m0 < M; m0 += MB)
      qrows<kind, 1, MB>(x + m0 * xs, xs, std::min<int64_t>(MB, M - m0), q + n * row_bytes,
                         row_bytes, K, y + m0 * N + n, N);
}
#endif

// One block (32 weights) into out[0..32) as float32.
template <int64_t kind>
inline void expand_block(const uint8_t* b, float* out) {
#if defined(__AVX512F__)
  __m512 lo, hi;
  expand_f32<kind>(b, lo, hi);
  _mm512_storeu_ps(out, lo);
  _mm512_storeu_ps(out + kLanes, hi);
#elif defined(SPECDEC_AVX2)
  V16 lo, hi;
  expand_v16<kind>(b, lo, hi);
  v16_store(out, lo);
  v16_store(out + kLanes, hi);
#else
  if constexpr (kind == kQ4_1K) {
    float d, m;
    std::memcpy(&d, b, sizeof(d));
    std::memcpy(&m, b + 4, sizeof(m));
    for (int j = 0; j < 16; ++j) {
      const uint8_t byte = b[8 + 4 * (j % 4) + j / 4];
      out[j] = d * static_cast<float>(byte & 0x0F) + m;
      out[j + 16] = d * static_cast<float>(byte >> 4) + m;
    }
    return;
  }
  const float d = half_bits_to_float(b);
  if constexpr (kind == kQ4_1) {
    const float m = half_bits_to_float(b + 2);
    for (int j = 0; j < 16; ++j) {
      out[j] = d * static_cast<float>(b[4 + j] & 0x0F) + m;
      out[j + 16] = d * static_cast<float>(b[4 + j] >> 4) + m;
    }
  } else {
    for (int j = 0; j < 32; ++j) out[j] = static_cast<float>(static_cast<int8_t>(b[2 + j])) * d;
  }
#endif
}

// Rows [n, n + rows) of the quantized matrix into buf ([rows, K] float32).
template <int64_t kind>
inline void expand_rows(const uint8_t* q, int64_t row_bytes, int64_t n,
                        int64_t rows, int64_t K, float* buf) {
  constexpr int64_t bb = block_bytes(kind);
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* row = q + (n + r) * row_bytes;
    for (int64_t blk = 0; blk < K / kBlock; ++blk) {
#if defined(__AVX512F__) || defined(SPECDEC_AVX2)
      _mm_prefetch(reinterpret_cast<const char*>(row + kQuantPrefetchBytes + blk * bb),
                   _MM_HINT_T0);
#endif
      expand_block<kind>(row + blk * bb, buf + r * K + blk * kBlock);
    }
  }
}

// y [M, N] = x [M, K] W^T, all float32.
template <int64_t kind>
void run_quant(const float* xp, int64_t xs, int64_t M, int64_t K, const uint8_t* qp,
               int64_t row_bytes, int64_t N, float* yp) {
  at::parallel_for(0, (N + kColBlock - 1) / kColBlock, kGrainCols / kColBlock,
                   [&](int64_t b0, int64_t b1) {
    const int64_t n1 = std::min(N, b1 * kColBlock);
    int64_t n = b0 * kColBlock;
#if defined(__AVX512F__)
    if (M <= kRegisterRows) {  // few rows: blocks expanded in registers
      qcols<kind, kColBlock, kRowBlock>(xp, xs, M, qp, row_bytes, K, yp, N, n, n1);
      return;
    }
#elif defined(SPECDEC_AVX2)
    if (M <= kRegisterRowsV16) {
      qcols_v16<kind>(xp, xs, M, qp, row_bytes, K, yp, N, n, n1);
      return;
    }
#endif
    // more rows: four rows of W expanded to a buffer that every row of x then reads
    std::vector<float> buf(kColBlock * K);
    for (; n + kColBlock <= n1; n += kColBlock) {
      expand_rows<kind>(qp, row_bytes, n, kColBlock, K, buf.data());
      cols_against<float, kColBlock>(xp, xs, M, buf.data(), K, yp + n, N);
    }
    for (; n < n1; ++n) {
      expand_rows<kind>(qp, row_bytes, n, 1, K, buf.data());
      cols_against<float, 1>(xp, xs, M, buf.data(), K, yp + n, N);
    }
  });
}

void check_quant(const torch::Tensor& q, int64_t kind, int64_t K) {
  TORCH_CHECK(kind == kQ4_1 || kind == kQ8_0 || kind == kQ4_1K,
              "quantization kind must be 0 (Q4_1), 1 (Q8_0) or 2 (Q4_1, the kernel's layout)");
  TORCH_CHECK(q.dim() == 2 && q.is_contiguous() && q.scalar_type() == torch::kUInt8,
              "quantized weights must be a contiguous uint8 [N, row bytes] tensor");
  TORCH_CHECK(K % kBlock == 0 && q.size(1) == K / kBlock * block_bytes(kind),
              "quantized rows hold ", q.size(1), " bytes; K = ", K, " needs ",
              K / kBlock * block_bytes(kind), " (K a multiple of 32)");
}

// quant_gemm for x and y in T: 16-bit rows converted to float32 here and the float32
// results rounded to T here (to nearest even, as PyTorch's cast), without two more
// PyTorch operations and allocations per product.
template <typename T>
void quant_gemm_as(const torch::Tensor& x, const torch::Tensor& q, int64_t kind, torch::Tensor& y) {
  const int64_t M = x.size(0), K = x.size(1), N = q.size(0), rb = q.size(1);
  const T* xp = x.data_ptr<T>();
  T* yp = y.data_ptr<T>();
  const float* x32 = nullptr;
  float* y32 = nullptr;
  int64_t xs = x.stride(0);
  std::unique_ptr<float[]> xbuf, ybuf;
  if constexpr (std::is_same_v<T, float>) {
    x32 = xp;
    y32 = yp;
  } else {
    xbuf.reset(new float[M * K]);
    for (int64_t m = 0; m < M; ++m) row_to_float(xp + m * xs, K, xbuf.get() + m * K);
    x32 = xbuf.get();
    xs = K;
    ybuf.reset(new float[M * N]);
    y32 = ybuf.get();
  }
  const uint8_t* qp = q.data_ptr<uint8_t>();
  switch (kind) {
    case kQ4_1: run_quant<kQ4_1>(x32, xs, M, K, qp, rb, N, y32); break;
    case kQ8_0: run_quant<kQ8_0>(x32, xs, M, K, qp, rb, N, y32); break;
    default: run_quant<kQ4_1K>(x32, xs, M, K, qp, rb, N, y32); break;
  }
  if constexpr (!std::is_same_v<T, float>) {
    float_to_row(y32, M * N, yp);
  }
}

// The dequantized matrix in T, a row at a time through a float32 buffer (values rounded
// to T as PyTorch's cast rounds them), with no [N, K] float32 copy.
template <typename T>
void dequantize_as(const torch::Tensor& q, int64_t kind, torch::Tensor& out) {
  const int64_t K = out.size(1), row_bytes = q.size(1);
  const uint8_t* qp = q.data_ptr<uint8_t>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, q.size(0), 16, [&](int64_t n0, int64_t n1) {
    std::vector<float> row(std::is_same_v<T, float> ? 0 : K);
    for (int64_t n = n0; n < n1; ++n) {
      float* dst = std::is_same_v<T, float> ? reinterpret_cast<float*>(op + n * K) : row.data();
      switch (kind) {
        case kQ4_1: expand_rows<kQ4_1>(qp, row_bytes, n, 1, K, dst); break;
        case kQ8_0: expand_rows<kQ8_0>(qp, row_bytes, n, 1, K, dst); break;
        default: expand_rows<kQ4_1K>(qp, row_bytes, n, 1, K, dst); break;
      }
      if constexpr (!std::is_same_v<T, float>) {
        float_to_row(row.data(), K, op + n * K);
      }
    }
  });
}

bool supported_dtype(torch::ScalarType t) {
  return t == torch::kFloat32 || t == torch::kBFloat16 || t == torch::kFloat16;
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

// x: [M, K] rows contiguous; q: [N, K / 32 * block bytes] uint8 (GGUF blocks, row-major);
// y: [M, N] contiguous in x's dtype. kind: 0 = Q4_1, 1 = Q8_0, 2 = Q4_1K (above).
void quant_gemm(torch::Tensor x, torch::Tensor q, int64_t kind, torch::Tensor y) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [M, K] with contiguous rows");
  TORCH_CHECK(supported_dtype(x.scalar_type()), "unsupported dtype ", x.scalar_type());
  check_quant(q, kind, x.size(1));
  TORCH_CHECK(y.is_contiguous() && y.dim() == 2 && y.size(0) == x.size(0) &&
                  y.size(1) == q.size(0) && y.scalar_type() == x.scalar_type(),
              "y must be a contiguous [M, N] tensor in x's dtype");
  switch (x.scalar_type()) {
    case torch::kFloat32: quant_gemm_as<float>(x, q, kind, y); break;
    case torch::kBFloat16: quant_gemm_as<c10::BFloat16>(x, q, kind, y); break;
    default: quant_gemm_as<c10::Half>(x, q, kind, y); break;
  }
}

// The dequantized matrix: out [N, K] (float32, bfloat16 or float16) from q.
void dequantize(torch::Tensor q, int64_t kind, torch::Tensor out) {
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && out.size(0) == q.size(0),
              "out must be a contiguous [N, K] tensor");
  TORCH_CHECK(supported_dtype(out.scalar_type()), "unsupported dtype ", out.scalar_type());
  check_quant(q, kind, out.size(1));
  switch (out.scalar_type()) {
    case torch::kFloat32: dequantize_as<float>(q, kind, out); break;
    case torch::kBFloat16: dequantize_as<c10::BFloat16>(q, kind, out); break;
    default: dequantize_as<c10::Half>(q, kind, out); break;
  }
}
