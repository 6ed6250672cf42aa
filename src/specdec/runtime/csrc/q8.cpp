// Quantized products with 8-bit activations: llama.cpp's arithmetic for GGUF Q4_1 / Q8_0
// weights (ggml's ggml_vec_dot_q4_1_q8_1 / ggml_vec_dot_q8_0_q8_0), written for
// specdec with one fixed order of float operations, so that a row's bits depend on
// that row only (row-invariant for any M, the exact mode's requirement), on 1 or many
// threads and on every x86 CPU with AVX2 (AVX-512 Xeons run the same AVX2 code).
//
// For one row x of the activations and one output n, per block b of 32 k:
//   amax = max |x_i|; d_x = amax / 127; id = 1 / d_x (0 if d_x = 0)
//   a_i  = round(x_i * id) (to nearest even: int8, |a_i| <= 127); s_x = d_x * float(sum a_i)
//   p_l  = sum over i = 4l .. 4l + 3 of q_i a_i (l = 0..7, exact integers)
//   acc_l = fma(float(p_l), d_w * d_x, acc_l)        (float32, b increasing)
//   accm  = fma(m_w, s_x, accm)                       (Q4_1 only: w_i = d_w q_i + m_w)
// and y = ((acc_0 + acc_4) + (acc_2 + acc_6)) + ((acc_1 + acc_5) + (acc_3 + acc_7)) + accm.
// Q4_1's q_i are its nibbles (0..15), Q8_0's its int8 values (w_i = d_w q_i).
//
// Q4_1 in pairs (kind 3, specdec.runtime.quant.q8_layout; K a multiple of 64): blocks
// 2g and 2g + 1 of a row as one 40-byte record (float16 d_0, d_1, m_0, m_1, then block
// 2g's 16 nibble bytes and block 2g + 1's), so one 32-byte load and two masks give both
// blocks' 64 weights. Per pair, for lanes l = 0..3 (block 2g) and 4..7 (block 2g + 1,
// l' = l - 4):
//   p_l  = sum of q_i a_i over i = 4l' .. 4l' + 3 and 16 + 4l' .. 16 + 4l' + 3 (exact)
//   t    = (d_0 d_x0, d_1 d_x1, m_0 s_x0, m_1 s_x1)   (four float32 products)
//   acc_l = fma(float(p_l), t_0 or t_1, acc_l);  mA = mA + t_2;  mB = mB + t_3
// and y = (the fixed 8-lane sum of acc) + (mA + mB). So
//   dot(x, w) ~ sum_b d_w d_x sum_i q_i a_i + m_w d_x sum_i a_i:
// an approximation of the float32 product (the activations rounded to 8 bits per block
// of 32), computed in integers where the float32 kernel (gemm.cpp) expands every weight.

#include "common.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <memory>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define SPECDEC_Q8_SIMD 1
#include <immintrin.h>
#endif

namespace {

using namespace specdec;

constexpr int64_t kBlock = 32;
constexpr int64_t kQ4_1 = 0, kQ8_0 = 1, kQ4_1P = 3;
constexpr int64_t kPairBytes = 40;
constexpr int64_t kGrain = 64;  // outputs per thread task, at least
constexpr int64_t kPrefetch = 16384;  // bytes ahead in the block stream (as gemm.cpp)

constexpr int64_t bytes_of(int64_t kind) { return kind == kQ4_1 ? 20 : 34; }

// One block of 32 activations, quantized.
struct XBlock {
  int8_t a[kBlock];
  float d;  // d_x
  float s;  // d_x * sum a_i
};

// Two blocks of activations, quantized, as the Q4_1 pair kernel reads them.
struct XPair {
  int8_t lo[kBlock];  // a_0..15 of block 2g, then of block 2g + 1
  int8_t hi[kBlock];  // a_16..31 of each
  float ds[4];        // d_x0, d_x1, s_x0, s_x1
};

inline XPair pair_of(const XBlock& b0, const XBlock& b1) {
  XPair p;
  std::memcpy(p.lo, b0.a, 16);
  std::memcpy(p.lo + 16, b1.a, 16);
  std::memcpy(p.hi, b0.a + 16, 16);
  std::memcpy(p.hi + 16, b1.a + 16, 16);
  p.ds[0] = b0.d;
  p.ds[1] = b1.d;
  p.ds[2] = b0.s;
  p.ds[3] = b1.s;
  return p;
}

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

#if defined(SPECDEC_Q8_SIMD)
// The fixed 8-lane sum (see the top of the file).
inline float sum8(__m256 v) {
  __m128 t = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  t = _mm_add_ps(t, _mm_movehl_ps(t, t));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

// MB rows of x (blocks xa[m * nb ..]) against NB quantized rows of W (from q), each
// weight block unpacked once per call; y[m * ys + j].
template <int64_t kind, int MB, int NB>
inline void q8block(const XBlock* xa, int64_t nb, const uint8_t* q, int64_t row_bytes,
                    float* y, int64_t ys) {
  constexpr int64_t bb = bytes_of(kind);
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i nib = _mm256_set1_epi8(0x0F);
  __m256 acc[MB][NB];
  float accm[MB][NB];
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < NB; ++j) {
      acc[m][j] = _mm256_setzero_ps();
      accm[m][j] = 0.0f;
    }
  for (int64_t b = 0; b < nb; ++b) {
    __m256i w[NB], ws[NB];  // Q4_1: nibbles as bytes; Q8_0: |q| and q (for the sign)
    float dw[NB], mw[NB] = {};
    for (int j = 0; j < NB; ++j) {
      const uint8_t* blk = q + j * row_bytes + b * bb;
      _mm_prefetch(reinterpret_cast<const char*>(blk + kPrefetch), _MM_HINT_T0);
      dw[j] = half_bits_to_float(blk);
      if constexpr (kind == kQ4_1) {
        mw[j] = half_bits_to_float(blk + 2);
        const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 4));
        // byte i holds q_i (low nibble) and q_{i+16} (high): bytes 0..15, then 16..31
        w[j] = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), nib);
      } else {
        ws[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
        w[j] = _mm256_sign_epi8(ws[j], ws[j]);  // |q| (128 for -128, read unsigned)
      }
    }
    for (int m = 0; m < MB; ++m) {
      const XBlock& xb = xa[m * nb + b];
      const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb.a));
      for (int j = 0; j < NB; ++j) {
        // pairs of u8 x s8 products summed to int16 (at most 2 * 128 * 127: no
        // saturation), then pairs of those to int32: lane l = sum over 4l .. 4l + 3
        __m256i s16;
        if constexpr (kind == kQ4_1) {
          s16 = _mm256_maddubs_epi16(w[j], a);
        } else {
          s16 = _mm256_maddubs_epi16(w[j], _mm256_sign_epi8(a, ws[j]));
        }
        const __m256 p = _mm256_cvtepi32_ps(_mm256_madd_epi16(s16, ones));
        acc[m][j] = _mm256_fmadd_ps(p, _mm256_set1_ps(dw[j] * xb.d), acc[m][j]);
        if constexpr (kind == kQ4_1) accm[m][j] = std::fma(mw[j], xb.s, accm[m][j]);
      }
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < NB; ++j) y[m * ys + j] = sum8(acc[m][j]) + accm[m][j];
}

// The Q4_1 pair kernel: MB rows of x (pairs xp[m * np ..]) against NB rows of W.
template <int MB, int NB>
inline void q8pair(const XPair* xp, int64_t np, const uint8_t* q, int64_t row_bytes,
                   float* y, int64_t ys) {
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i nib = _mm256_set1_epi8(0x0F);
  const __m256i spread = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
  __m256 acc[MB][NB];
  __m128 accm[MB][NB];
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < NB; ++j) {
      acc[m][j] = _mm256_setzero_ps();
      accm[m][j] = _mm_setzero_ps();
    }
  for (int64_t g = 0; g < np; ++g) {
    __m256i lo[NB], hi[NB];
    __m128 sc[NB];
    for (int j = 0; j < NB; ++j) {
      const uint8_t* rec = q + j * row_bytes + g * kPairBytes;
      _mm_prefetch(reinterpret_cast<const char*>(rec + kPrefetch), _MM_HINT_T0);
      sc[j] = _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(rec)));
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 8));
      lo[j] = _mm256_and_si256(v, nib);
      hi[j] = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
    }
    for (int m = 0; m < MB; ++m) {
      const XPair& x = xp[m * np + g];
      const __m256i alo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.lo));
      const __m256i ahi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.hi));
      const __m128 xs = _mm_loadu_ps(x.ds);
      for (int j = 0; j < NB; ++j) {
        // int16 lanes: at most 4 * 15 * 127, no saturation
        const __m256i s16 = _mm256_add_epi16(_mm256_maddubs_epi16(lo[j], alo),
                                             _mm256_maddubs_epi16(hi[j], ahi));
        const __m256 p = _mm256_cvtepi32_ps(_mm256_madd_epi16(s16, ones));
        const __m128 t = _mm_mul_ps(sc[j], xs);
        accm[m][j] = _mm_add_ps(accm[m][j], t);
        const __m256 dd = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(t), spread);
        acc[m][j] = _mm256_fmadd_ps(p, dd, acc[m][j]);
      }
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < NB; ++j) {
      alignas(16) float mm[4];
      _mm_store_ps(mm, accm[m][j]);
      y[m * ys + j] = sum8(acc[m][j]) + (mm[2] + mm[3]);
    }
}

#else
// The Q4_1 pair kernel in plain C++.
template <int MB, int NB>
inline void q8pair(const XPair* xp, int64_t np, const uint8_t* q, int64_t row_bytes,
                   float* y, int64_t ys) {
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < NB; ++j) {
      float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0}, ma = 0.0f, mb = 0.0f;
      for (int64_t g = 0; g < np; ++g) {
        const uint8_t* rec = q + j * row_bytes + g * kPairBytes;
        const XPair& x = xp[m * np + g];
        float t[4];
        for (int i = 0; i < 4; ++i) t[i] = half_bits_to_float(rec + 2 * i) * x.ds[i];
        for (int l = 0; l < 8; ++l) {
          const int half = l / 4, base = 16 * half + 4 * (l % 4);
          int p = 0;
          for (int i = base; i < base + 4; ++i) {
            const uint8_t byte = rec[8 + i];
            p += (byte & 0x0F) * x.lo[i] + (byte >> 4) * x.hi[i];
          }
          acc[l] = std::fma(static_cast<float>(p), t[half], acc[l]);
        }
        ma += t[2];
        mb += t[3];
      }
      const float u0 = (acc[0] + acc[4]) + (acc[2] + acc[6]);
      const float u1 = (acc[1] + acc[5]) + (acc[3] + acc[7]);
      y[m * ys + j] = (u0 + u1) + (ma + mb);
    }
}

// The same arithmetic in plain C++ (CPUs without AVX2).
template <int64_t kind, int MB, int NB>
inline void q8block(const XBlock* xa, int64_t nb, const uint8_t* q, int64_t row_bytes,
                    float* y, int64_t ys) {
  constexpr int64_t bb = bytes_of(kind);
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < NB; ++j) {
      float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0}, accm = 0.0f;
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = q + j * row_bytes + b * bb;
        const XBlock& xb = xa[m * nb + b];
        const float dd = half_bits_to_float(blk) * xb.d;
        for (int l = 0; l < 8; ++l) {
          int p = 0;
          for (int i = 4 * l; i < 4 * l + 4; ++i) {
            const int qi = kind == kQ4_1 ? (i < 16 ? blk[4 + i] & 0x0F : blk[4 + i - 16] >> 4)
                                         : static_cast<int8_t>(blk[2 + i]);
            p += qi * xb.a[i];
          }
          acc[l] = std::fma(static_cast<float>(p), dd, acc[l]);
        }
        if constexpr (kind == kQ4_1) accm = std::fma(half_bits_to_float(blk + 2), xb.s, accm);
      }
      const float u0 = (acc[0] + acc[4]) + (acc[2] + acc[6]);
      const float u1 = (acc[1] + acc[5]) + (acc[3] + acc[7]);
      y[m * ys + j] = (u0 + u1) + accm;
    }
}
#endif

// M <= MB rows (MB, MB - 1, ... instantiated down to 1).
template <int64_t kind, int NB, int MB>
inline void q8rows(const XBlock* xa, int64_t nb, int64_t M, const uint8_t* q, int64_t row_bytes,
                   float* y, int64_t ys) {
  if constexpr (MB > 1) {
    if (M < MB) {
      q8rows<kind, NB, MB - 1>(xa, nb, M, q, row_bytes, y, ys);
      return;
    }
  }
  q8block<kind, MB, NB>(xa, nb, q, row_bytes, y, ys);
}

// Rows of W per pass: 4 for one row of x (the decoding step: bound by the stream), 2
// against chunks of 4 rows of x (more rows: bound by the integer products).
template <int64_t kind>
void run(const XBlock* xa, int64_t M, int64_t K, const uint8_t* q, int64_t row_bytes,
         int64_t N, float* y) {
  const int64_t nb = K / kBlock;
  at::parallel_for(0, (N + 3) / 4, kGrain / 4, [&](int64_t c0, int64_t c1) {
    const int64_t n1 = std::min(N, c1 * 4);
    int64_t n = c0 * 4;
    if (M == 1) {
      for (; n + 4 <= n1; n += 4) q8block<kind, 1, 4>(xa, nb, q + n * row_bytes, row_bytes, y + n, N);
    } else {
      for (; n + 2 <= n1; n += 2)
        for (int64_t m0 = 0; m0 < M; m0 += 4)
          q8rows<kind, 2, 4>(xa + m0 * nb, nb, std::min<int64_t>(4, M - m0), q + n * row_bytes,
                             row_bytes, y + m0 * N + n, N);
    }
    for (; n < n1; ++n)
      for (int64_t m0 = 0; m0 < M; m0 += 4)
        q8rows<kind, 1, 4>(xa + m0 * nb, nb, std::min<int64_t>(4, M - m0), q + n * row_bytes,
                           row_bytes, y + m0 * N + n, N);
  });
}

// M <= MB rows of the pair kernel.
template <int NB, int MB>
inline void q8pair_rows(const XPair* xp, int64_t np, int64_t M, const uint8_t* q,
                        int64_t row_bytes, float* y, int64_t ys) {
  if constexpr (MB > 1) {
    if (M < MB) {
      q8pair_rows<NB, MB - 1>(xp, np, M, q, row_bytes, y, ys);
      return;
    }
  }
  q8pair<MB, NB>(xp, np, q, row_bytes, y, ys);
}

// Rows of W per pass and rows of x per chunk (measured on a 2-core AMD EPYC, Zen 3, over
// 30 copies of SmolLM2's gate_up and down matrices: 2 rows of W for one row of x; 2 x 2
// for 2-3 rows; then chunks of 4 rows of x against one row of W, 1.2-1.4x faster than
// 2 x 2 chunks at 4-16 rows).
void run_pairs(const XPair* xp, int64_t M, int64_t K, const uint8_t* q, int64_t row_bytes,
               int64_t N, float* y) {
  const int64_t np = K / (2 * kBlock);
  at::parallel_for(0, (N + 3) / 4, kGrain / 4, [&](int64_t c0, int64_t c1) {
    const int64_t n1 = std::min(N, c1 * 4);
    int64_t n = c0 * 4;
    if (M == 1) {
      for (; n + 2 <= n1; n += 2) q8pair<1, 2>(xp, np, q + n * row_bytes, row_bytes, y + n, N);
    } else if (M < 4) {
      for (; n + 2 <= n1; n += 2)
        q8pair_rows<2, 3>(xp, np, M, q + n * row_bytes, row_bytes, y + n, N);
    }
    for (; n < n1; ++n)
      for (int64_t m0 = 0; m0 < M; m0 += 4)
        q8pair_rows<1, 4>(xp + m0 * np, np, std::min<int64_t>(4, M - m0), q + n * row_bytes,
                          row_bytes, y + m0 * N + n, N);
  });
}

template <typename T>
void q8_gemm_as(const torch::Tensor& x, const torch::Tensor& q, int64_t kind, torch::Tensor& y) {
  const int64_t M = x.size(0), K = x.size(1), N = q.size(0), nb = K / kBlock;
  const T* xp = x.data_ptr<T>();
  std::unique_ptr<XBlock[]> xa(new XBlock[M * nb]);
  std::unique_ptr<float[]> row(std::is_same_v<T, float> ? nullptr : new float[K]);
  for (int64_t m = 0; m < M; ++m) {
    const float* xr;
    if constexpr (std::is_same_v<T, float>) {
      xr = xp + m * x.stride(0);
    } else {
      row_to_float(xp + m * x.stride(0), K, row.get());
      xr = row.get();
    }
    quantize_row(xr, K, xa.get() + m * nb);
  }
  std::unique_ptr<float[]> ybuf(std::is_same_v<T, float> ? nullptr : new float[M * N]);
  float* y32 = std::is_same_v<T, float> ? reinterpret_cast<float*>(y.data_ptr<T>()) : ybuf.get();
  const uint8_t* qp = q.data_ptr<uint8_t>();
  if (kind == kQ4_1P) {
    const int64_t np = nb / 2;
    std::unique_ptr<XPair[]> xp(new XPair[M * np]);
    for (int64_t i = 0; i < M * np; ++i) xp[i] = pair_of(xa[2 * i], xa[2 * i + 1]);
    run_pairs(xp.get(), M, K, qp, q.size(1), N, y32);
  } else if (kind == kQ4_1) {
    run<kQ4_1>(xa.get(), M, K, qp, q.size(1), N, y32);
  } else {
    run<kQ8_0>(xa.get(), M, K, qp, q.size(1), N, y32);
  }
  if constexpr (!std::is_same_v<T, float>) float_to_row(y32, M * N, y.data_ptr<T>());
}

}  // namespace

// x: [M, K] rows contiguous (float32, bfloat16 or float16); q: [N, K / 32 * block bytes]
// uint8, GGUF's own blocks (kind 0 = Q4_1, 20 bytes; 1 = Q8_0, 34 bytes) or Q4_1 in pairs
// (kind 3, 40 bytes per 64 weights); y: [M, N]
// contiguous in x's dtype (the float32 result rounded to it).
void q8_gemm(torch::Tensor x, torch::Tensor q, int64_t kind, torch::Tensor y) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [M, K] with contiguous rows");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16 ||
                  x.scalar_type() == torch::kFloat16,
              "unsupported dtype ", x.scalar_type());
  TORCH_CHECK(kind == kQ4_1 || kind == kQ8_0 || kind == kQ4_1P,
              "quantization kind must be 0 (Q4_1), 1 (Q8_0) or 3 (Q4_1 in pairs)");
  const int64_t K = x.size(1);
  TORCH_CHECK(q.dim() == 2 && q.is_contiguous() && q.scalar_type() == torch::kUInt8,
              "quantized weights must be a contiguous uint8 [N, row bytes] tensor");
  const int64_t unit = kind == kQ4_1P ? 2 * kBlock : kBlock;
  const int64_t need = kind == kQ4_1P ? K / unit * kPairBytes : K / kBlock * bytes_of(kind);
  TORCH_CHECK(K % unit == 0 && q.size(1) == need, "quantized rows hold ", q.size(1),
              " bytes; K = ", K, " needs ", need, " (K a multiple of ", unit, ")");
  TORCH_CHECK(y.is_contiguous() && y.dim() == 2 && y.size(0) == x.size(0) &&
                  y.size(1) == q.size(0) && y.scalar_type() == x.scalar_type(),
              "y must be a contiguous [M, N] tensor in x's dtype");
  switch (x.scalar_type()) {
    case torch::kFloat32: q8_gemm_as<float>(x, q, kind, y); break;
    case torch::kBFloat16: q8_gemm_as<c10::BFloat16>(x, q, kind, y); break;
    default: q8_gemm_as<c10::Half>(x, q, kind, y); break;
  }
}
