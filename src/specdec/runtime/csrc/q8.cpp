// Quantized products with 8-bit activations: llama.cpp's arithmetic for GGUF Q4_1 / Q8_0
// weights (ggml's ggml_vec_dot_q4_1_q8_1 / ggml_vec_dot_q8_0_q8_0: the activations
// rounded to int8 per block of 32, integer dot products per block), written for specdec
// with one fixed order of float operations, so that a row's bits depend on that row only
// (row-invariant for any M, the exact mode's requirement), on 1 or many threads and on
// every x86 CPU (the AVX2 code, its AVX-512 VNNI variant and the plain C++ code compute the
// same operations).
//
// For one row x of the activations and one output n, per block b of 32 k (b increasing):
//   amax = max |x_i|; d_x = amax / 127; id = 1 / d_x (0 if d_x = 0)
//   a_i  = round(x_i * id) (to nearest even: int8, |a_i| <= 127); s_x = d_x * float(sum a_i)
//   p    = sum over the block's 32 i of q_i a_i                (an exact integer)
//   acc  = fma(float(p), d_w * d_x, acc)                       (float32, from acc = 0)
//   acc  = fma(m_w, s_x, acc)                                  (Q4_1 only: w_i = d_w q_i + m_w)
// and y = acc. Q4_1's q_i are its nibbles (0..15), Q8_0's its int8 values (w_i = d_w q_i).
// So dot(x, w) ~ sum_b d_w d_x sum_i q_i a_i + m_w d_x sum_i a_i: an approximation of the
// float32 product (the activations rounded to 8 bits per block of 32), computed in
// integers where the float32 kernel (gemm.cpp) expands every weight.
//
// Layouts (the `kind` codes): 0 / 1 are the file's Q4_1 / Q8_0 rows as they are (read by
// plain C++ code: any N). 4 / 5 interleave each group of 8 outputs (N a multiple of 8;
// specdec.runtime.quant.q8_layout), the same bytes per weight as the file: per group and
// block of 32 k, one record of the 8 outputs' float16 d (then, Q4_1, their 8 m), then
// their integers, 4 k at a time per output:
//   Q4_1 (160 bytes): 4 x 32 bytes; byte 4j + r of vector t holds output j's q_{4t+r}
//                     (low nibble) and q_{16+4t+r} (high nibble)
//   Q8_0 (272 bytes): 8 x 32 bytes; byte 4j + r of vector t holds output j's q_{4t+r}
// so a multiply-add of one vector with the 4 activations a_{4t..4t+3} broadcast gives the 8
// outputs' partial sums at once, and one float32 fma per block scales 8 outputs.

#include "common.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <memory>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define SPECDEC_Q8_SIMD 1
#include <immintrin.h>
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
// vpdpbusd on 256-bit vectors: four u8 x s8 products added to an int32 lane in one
// instruction, where AVX2 takes vpmaddubsw, an int16 add and vpmaddwd. The integers are
// exact either way (no int16 saturation on either path), so the bits are the same.
#define SPECDEC_Q8_VNNI 1
#endif
#endif

namespace {

using namespace specdec;

constexpr int64_t kBlock = 32;
constexpr int64_t kQ4_1 = 0, kQ8_0 = 1, kQ4_1X8 = 4, kQ8_0X8 = 5;
constexpr int64_t kGroup = 8;           // outputs per record of the interleaved layouts
constexpr int64_t kGrainGroups = 8;     // groups per thread task, at least
constexpr int64_t kPrefetch = 16384;    // bytes ahead in the record stream (as gemm.cpp)
constexpr int64_t kGrainRows = 8;       // rows per thread task quantizing x / converting y

constexpr bool is_q4_1(int64_t kind) { return kind == kQ4_1 || kind == kQ4_1X8; }
constexpr bool is_x8(int64_t kind) { return kind == kQ4_1X8 || kind == kQ8_0X8; }
constexpr int64_t bytes_of(int64_t kind) { return is_q4_1(kind) ? 20 : 34; }

// One block of 32 activations, quantized.
struct XBlock {
  int8_t a[kBlock];
  float d;  // d_x
  float s;  // d_x * sum a_i
};

// One row of K floats into K / 32 blocks.
inline void quantize_row(const float* x, int64_t K, XBlock* out) {
  for (int64_t b = 0; b < K / kBlock; ++b) {
    const float* xb = x + b * kBlock;
    XBlock& o = out[b];
#if defined(SPECDEC_Q8_SIMD)
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 v[4];
    __m256 mx = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      v[i] = _mm256_loadu_ps(xb + 8 * i);
      mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v[i]));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float amax = _mm_cvtss_f32(m4);
    const float d = amax / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    const __m256 idv = _mm256_set1_ps(id);
    __m256i q[4];
    for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], idv));  // nearest even
    const __m256i total = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
    t = _mm_hadd_epi32(t, t);
    t = _mm_hadd_epi32(t, t);
    const int sum = _mm_cvtsi128_si32(t);
    const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(o.a),
                        _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
#else
    float amax = 0.0f;
    for (int i = 0; i < kBlock; ++i) amax = std::max(amax, std::fabs(xb[i]));
    const float d = amax / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    int sum = 0;
    for (int i = 0; i < kBlock; ++i) {
      const int v = static_cast<int>(std::nearbyint(xb[i] * id));  // default mode: nearest even
      o.a[i] = static_cast<int8_t>(v);
      sum += v;
    }
#endif
    o.d = d;
    o.s = d * static_cast<float>(sum);
  }
}

// One block of weights of output n, unpacked: d_w, m_w (Q4_1) and the 32 integers.
struct WBlock {
  float d, m;
  int q[kBlock];
};

template <int64_t kind>
inline void weight_block(const uint8_t* q, int64_t row_bytes, int64_t n, int64_t b, WBlock& w) {
  constexpr int64_t bb = bytes_of(kind);
  if constexpr (!is_x8(kind)) {
    const uint8_t* blk = q + n * row_bytes + b * bb;
    w.d = half_bits_to_float(blk);
    if constexpr (is_q4_1(kind)) {
      w.m = half_bits_to_float(blk + 2);
      for (int i = 0; i < 16; ++i) {
        w.q[i] = blk[4 + i] & 0x0F;
        w.q[16 + i] = blk[4 + i] >> 4;
      }
    } else {
      for (int i = 0; i < kBlock; ++i) w.q[i] = static_cast<int8_t>(blk[2 + i]);
    }
  } else {
    const uint8_t* rec = q + (n / kGroup) * kGroup * row_bytes + b * kGroup * bb;
    const int64_t j = n % kGroup;
    w.d = half_bits_to_float(rec + 2 * j);
    if constexpr (is_q4_1(kind)) {
      w.m = half_bits_to_float(rec + 16 + 2 * j);
      for (int t = 0; t < 4; ++t)
        for (int r = 0; r < 4; ++r) {
          const uint8_t byte = rec[32 + 32 * t + 4 * j + r];
          w.q[4 * t + r] = byte & 0x0F;
          w.q[16 + 4 * t + r] = byte >> 4;
        }
    } else {
      for (int t = 0; t < 8; ++t)
        for (int r = 0; r < 4; ++r) w.q[4 * t + r] = static_cast<int8_t>(rec[16 + 32 * t + 4 * j + r]);
    }
  }
}

// The arithmetic at the top of the file in plain C++, one output at a time: every layout
// on CPUs without AVX2, and the file's own rows (kinds 0 and 1) everywhere.
template <int64_t kind>
void run_plain(const XBlock* xa, int64_t M, int64_t K, const uint8_t* q, int64_t row_bytes,
               int64_t N, float* y) {
  const int64_t nb = K / kBlock;
  at::parallel_for(0, N, kGroup * kGrainGroups, [&](int64_t n0, int64_t n1) {
    WBlock w;
    std::unique_ptr<float[]> acc(new float[M]);
    for (int64_t n = n0; n < n1; ++n) {
      std::fill(acc.get(), acc.get() + M, 0.0f);
      for (int64_t b = 0; b < nb; ++b) {
        weight_block<kind>(q, row_bytes, n, b, w);
        for (int64_t m = 0; m < M; ++m) {
          const XBlock& xb = xa[m * nb + b];
          int p = 0;
          for (int i = 0; i < kBlock; ++i) p += w.q[i] * xb.a[i];
          float a = std::fma(static_cast<float>(p), w.d * xb.d, acc[m]);
          if constexpr (is_q4_1(kind)) a = std::fma(w.m, xb.s, a);
          acc[m] = a;
        }
      }
      for (int64_t m = 0; m < M; ++m) y[m * N + n] = acc[m];
    }
  });
}

#if defined(SPECDEC_Q8_SIMD)
// a_{i..i+3} of a block, as the 32-bit lane of all 8 lanes.
inline __m256i broadcast4(const int8_t* a) {
  int32_t v;
  std::memcpy(&v, a, sizeof(v));
  return _mm256_set1_epi32(v);
}

// MB rows of x (blocks xa[m * nb ..]) against one group of 8 outputs of an interleaved
// layout (records g[b * 8 * block bytes]); y[m * ys + 0..7].
template <int64_t kind, int MB>
inline void x8_group(const XBlock* xa, int64_t nb, const uint8_t* g, float* y, int64_t ys) {
  constexpr int64_t rb = kGroup * bytes_of(kind);
  [[maybe_unused]] const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* rec = g + b * rb;
    for (int64_t off = 0; off < rb; off += 64)
      _mm_prefetch(reinterpret_cast<const char*>(rec + kPrefetch + off), _MM_HINT_T0);
    const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec)));
    __m256i sum[MB];
    for (int m = 0; m < MB; ++m) sum[m] = _mm256_setzero_si256();
    if constexpr (is_q4_1(kind)) {
      // int16 lanes: 8 pairs of products of at most 15 * 127, no saturation
      const __m256i nib = _mm256_set1_epi8(0x0F);
#pragma GCC unroll 1  // unrolled, the 8 nibble vectors and MB sums spill
      for (int t = 0; t < 4; ++t) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 32 + 32 * t));
        const __m256i lo = _mm256_and_si256(v, nib);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
        for (int m = 0; m < MB; ++m) {
          const int8_t* a = xa[m * nb + b].a;
#if defined(SPECDEC_Q8_VNNI)
          sum[m] = _mm256_dpbusd_epi32(sum[m], lo, broadcast4(a + 4 * t));
          sum[m] = _mm256_dpbusd_epi32(sum[m], hi, broadcast4(a + 16 + 4 * t));
#else
          sum[m] = _mm256_add_epi16(
              sum[m], _mm256_add_epi16(_mm256_maddubs_epi16(lo, broadcast4(a + 4 * t)),
                                       _mm256_maddubs_epi16(hi, broadcast4(a + 16 + 4 * t))));
#endif
        }
      }
#if !defined(SPECDEC_Q8_VNNI)
      for (int m = 0; m < MB; ++m) sum[m] = _mm256_madd_epi16(sum[m], ones);
#endif
    } else {
      // |q| (128 for -128, read unsigned) times a with q's sign: one pair is at most
      // 2 * 128 * 127 in int16, so each vector's pairs go to int32 at once
      for (int t = 0; t < 8; ++t) {
        const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 16 + 32 * t));
        const __m256i aw = _mm256_abs_epi8(w);
        for (int m = 0; m < MB; ++m) {
          const __m256i a = _mm256_sign_epi8(broadcast4(xa[m * nb + b].a + 4 * t), w);
#if defined(SPECDEC_Q8_VNNI)
          sum[m] = _mm256_dpbusd_epi32(sum[m], aw, a);
#else
          sum[m] = _mm256_add_epi32(sum[m], _mm256_madd_epi16(_mm256_maddubs_epi16(aw, a), ones));
#endif
        }
      }
    }
    for (int m = 0; m < MB; ++m) {
      const XBlock& xb = xa[m * nb + b];
      const __m256 p = _mm256_cvtepi32_ps(sum[m]);
      acc[m] = _mm256_fmadd_ps(p, _mm256_mul_ps(dw, _mm256_set1_ps(xb.d)), acc[m]);
      if constexpr (is_q4_1(kind)) {
        const __m256 mw =
            _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + 16)));
        acc[m] = _mm256_fmadd_ps(mw, _mm256_set1_ps(xb.s), acc[m]);
      }
    }
  }
  for (int m = 0; m < MB; ++m) _mm256_storeu_ps(y + m * ys, acc[m]);
}

// M <= MB rows (MB, MB - 1, ... instantiated down to 1).
template <int64_t kind, int MB>
inline void x8_rows(const XBlock* xa, int64_t nb, int64_t M, const uint8_t* g, float* y,
                    int64_t ys) {
  if constexpr (MB > 1) {
    if (M < MB) {
      x8_rows<kind, MB - 1>(xa, nb, M, g, y, ys);
      return;
    }
  }
  x8_group<kind, MB>(xa, nb, g, y, ys);
}

// The interleaved layouts: per group of 8 outputs, the rows of x in chunks of kRows (the
// group's records stay in L1 between chunks). Measured on the AMD EPYC (Zen 3) test VM:
// 8 rows reach about 60 GMAC/s per core, near its one vpmaddubsw per cycle; 4 rows ~10% less.
constexpr int64_t kRows = 8;
constexpr int64_t kTileRows = 128;

template <int64_t kind>
void run_x8(const XBlock* xa, int64_t M, int64_t K, const uint8_t* q, int64_t row_bytes,
            int64_t N, float* y) {
  const int64_t nb = K / kBlock;
  // a prompt's rows in tiles of kTileRows, so that a tile's quantized activations stay in
  // L2 while every group of weights passes by (each output is still one row against one
  // group: the tiling changes no operation)
  for (int64_t t0 = 0; t0 < M; t0 += kTileRows) {
    const int64_t t1 = std::min(M, t0 + kTileRows);
    at::parallel_for(0, N / kGroup, kGrainGroups, [&](int64_t g0, int64_t g1) {
      for (int64_t g = g0; g < g1; ++g) {
        const uint8_t* rec = q + g * kGroup * row_bytes;
        for (int64_t m0 = t0; m0 < t1; m0 += kRows)
          x8_rows<kind, kRows>(xa + m0 * nb, nb, std::min(kRows, t1 - m0), rec,
                               y + m0 * N + g * kGroup, N);
      }
    });
  }
}
#endif

template <typename T>
void q8_gemm_as(const torch::Tensor& x, const torch::Tensor& q, int64_t kind, torch::Tensor& y) {
  const int64_t M = x.size(0), K = x.size(1), N = q.size(0), nb = K / kBlock;
  const T* xp = x.data_ptr<T>();
  std::unique_ptr<XBlock[]> xa(new XBlock[M * nb]);
  // rows quantized (and converted to float) in parallel: each row's blocks depend on that
  // row only, so the bits do not depend on the split
  at::parallel_for(0, M, kGrainRows, [&](int64_t m0, int64_t m1) {
    std::unique_ptr<float[]> row(std::is_same_v<T, float> ? nullptr : new float[K]);
    for (int64_t m = m0; m < m1; ++m) {
      const float* xr;
      if constexpr (std::is_same_v<T, float>) {
        xr = xp + m * x.stride(0);
      } else {
        row_to_float(xp + m * x.stride(0), K, row.get());
        xr = row.get();
      }
      quantize_row(xr, K, xa.get() + m * nb);
    }
  });
  std::unique_ptr<float[]> ybuf(std::is_same_v<T, float> ? nullptr : new float[M * N]);
  float* y32 = std::is_same_v<T, float> ? reinterpret_cast<float*>(y.data_ptr<T>()) : ybuf.get();
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const int64_t rb = q.size(1);
  switch (kind) {
    case kQ4_1: run_plain<kQ4_1>(xa.get(), M, K, qp, rb, N, y32); break;
    case kQ8_0: run_plain<kQ8_0>(xa.get(), M, K, qp, rb, N, y32); break;
#if defined(SPECDEC_Q8_SIMD)
    case kQ4_1X8: run_x8<kQ4_1X8>(xa.get(), M, K, qp, rb, N, y32); break;
    default: run_x8<kQ8_0X8>(xa.get(), M, K, qp, rb, N, y32); break;
#else
    case kQ4_1X8: run_plain<kQ4_1X8>(xa.get(), M, K, qp, rb, N, y32); break;
    default: run_plain<kQ8_0X8>(xa.get(), M, K, qp, rb, N, y32); break;
#endif
  }
  if constexpr (!std::is_same_v<T, float>) {
    T* yp = y.data_ptr<T>();
    at::parallel_for(0, M, kGrainRows, [&](int64_t m0, int64_t m1) {
      float_to_row(y32 + m0 * N, (m1 - m0) * N, yp + m0 * N);
    });
  }
}

}  // namespace

// x: [M, K] rows contiguous (float32, bfloat16 or float16), K a multiple of 32; q:
// [N, K / 32 * block bytes] uint8: GGUF's own rows (kind 0 = Q4_1, 20 bytes per block;
// 1 = Q8_0, 34 bytes) or groups of 8 rows interleaved (kind 4 = Q4_1, 5 = Q8_0; N a
// multiple of 8); y: [M, N] contiguous in x's dtype (the float32 result rounded to it).
void q8_gemm(torch::Tensor x, torch::Tensor q, int64_t kind, torch::Tensor y) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [M, K] with contiguous rows");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16 ||
                  x.scalar_type() == torch::kFloat16,
              "unsupported dtype ", x.scalar_type());
  TORCH_CHECK(kind == kQ4_1 || kind == kQ8_0 || kind == kQ4_1X8 || kind == kQ8_0X8,
              "quantization kind must be 0 (Q4_1), 1 (Q8_0), 4 (Q4_1 in groups of 8) or 5 "
              "(Q8_0 in groups of 8)");
  const int64_t K = x.size(1);
  TORCH_CHECK(q.dim() == 2 && q.is_contiguous() && q.scalar_type() == torch::kUInt8,
              "quantized weights must be a contiguous uint8 [N, row bytes] tensor");
  const int64_t need = K / kBlock * bytes_of(kind);
  TORCH_CHECK(K % kBlock == 0 && q.size(1) == need, "quantized rows hold ", q.size(1),
              " bytes; K = ", K, " needs ", need, " (K a multiple of 32)");
  TORCH_CHECK(!is_x8(kind) || q.size(0) % kGroup == 0, "kind ", kind,
              " interleaves groups of 8 outputs: N = ", q.size(0), " is not a multiple of 8");
  TORCH_CHECK(y.is_contiguous() && y.dim() == 2 && y.size(0) == x.size(0) &&
                  y.size(1) == q.size(0) && y.scalar_type() == x.scalar_type(),
              "y must be a contiguous [M, N] tensor in x's dtype");
  switch (x.scalar_type()) {
    case torch::kFloat32: q8_gemm_as<float>(x, q, kind, y); break;
    case torch::kBFloat16: q8_gemm_as<c10::BFloat16>(x, q, kind, y); break;
    default: q8_gemm_as<c10::Half>(x, q, kind, y); break;
  }
}
