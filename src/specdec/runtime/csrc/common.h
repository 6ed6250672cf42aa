// Helpers shared by the native runtime's kernels (attention.cpp, layer_ops.cpp): dtype
// conversions (round to nearest even, as PyTorch does), fixed-order sums, and AVX-512
// loads, stores and exp.
#pragma once

#include <torch/extension.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AVX512F__)
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// CPUs with AVX2 and FMA but no AVX-512 (AMD Zen 1-3, Intel client cores): the hot
// kernels run the AVX-512 path's arithmetic on 16 lanes held as two 8-lane registers
// (V16 below), so a product or an exp gives the same bits on either kind of CPU.
#define SPECDEC_AVX2 1
#include <immintrin.h>
#elif defined(__F16C__)
#include <immintrin.h>
#endif

namespace specdec {

constexpr int kLanes = 16;

template <typename T>
inline float to_float(T x) {
  return static_cast<float>(x);
}

template <>
inline float to_float<c10::BFloat16>(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// A float16 stored at p (GGUF block scales), as float32 (exact).
inline float half_bits_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof(h));
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
#endif
}

inline float tree_sum(float* lane) {
  for (int w = kLanes / 2; w >= 1; w /= 2)
    for (int l = 0; l < w; ++l) lane[l] += lane[l + w];
  return lane[0];
}


#if defined(__AVX512F__)
// 16 elements of a row as float32.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// exp of 16 floats (x <= 0 here): x = k ln2 + r, |r| <= ln2 / 2, exp(r) by Cephes'
// expf polynomial, times 2^k; about 1 ulp, and exp(0) is exactly 1.
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.3365f));
  const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(k, _mm512_set1_ps(-2.12194440e-4f), r);
  const __m512 z = _mm512_mul_ps(r, r);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(y, z, r);
  y = _mm512_add_ps(y, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(y, k);
}
#endif

#if defined(SPECDEC_AVX2)
// 16 float32 lanes as two AVX2 registers: lanes 0-7 in lo, 8-15 in hi. Each operation is
// the AVX-512 one lane by lane (a fused multiply-add stays fused), and reduce_add sums the
// lanes in _mm512_reduce_add_ps's tree (tree_sum's), so kernels written on V16 give the
// AVX-512 path's bits.
struct V16 {
  __m256 lo, hi;
};
inline V16 v16_zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline V16 v16_set1(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline V16 v16_load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline __m256 bf16x8(const c10::BFloat16* p) {
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
inline V16 v16_load(const c10::BFloat16* p) { return {bf16x8(p), bf16x8(p + 8)}; }
inline V16 v16_load(const c10::Half* p) {
  return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
}
inline void v16_store(float* p, V16 v) {
  _mm256_storeu_ps(p, v.lo);
  _mm256_storeu_ps(p + 8, v.hi);
}
inline V16 v16_fmadd(V16 a, V16 b, V16 c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
inline V16 v16_mul(V16 a, V16 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline V16 v16_add(V16 a, V16 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline V16 v16_sub(V16 a, V16 b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline V16 v16_div(V16 a, V16 b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
// (hi + lo), then the upper and lower halves of that, then pairs: tree_sum's order.
inline float v16_reduce_add(V16 a) {
  const __m256 s = _mm256_add_ps(a.hi, a.lo);
  const __m128 t = _mm_add_ps(_mm256_extractf128_ps(s, 1), _mm256_castps256_ps128(s));
  const __m128 u = _mm_add_ps(t, _mm_movehl_ps(t, t));
  return _mm_cvtss_f32(_mm_add_ss(u, _mm_movehdup_ps(u)));
}

// exp16's arithmetic on 8 lanes (x <= 0): the same polynomial, and 2^k applied by one
// multiplication by an exact power of two (k >= -126 here, a normal float), which rounds
// as _mm512_scalef_ps does.
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.3365f));
  const __m256 k = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(k, _mm256_set1_ps(-2.12194440e-4f), r);
  const __m256 z = _mm256_mul_ps(r, r);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, z, r);
  y = _mm256_add_ps(y, _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}
inline V16 v16_exp(V16 x) { return {exp8(x.lo), exp8(x.hi)}; }

// 8 floats to bfloat16 bits (nearest even, NaN to 0x7FC0: store16's rounding) in 32-bit lanes.
inline __m256i bf16_bits8(__m256 v) {
  __m256i b = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  b = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(b, _mm256_set1_epi32(0x7FC0), nan);
}
inline void v16_store(c10::BFloat16* p, V16 v) {
  // packus interleaves 128-bit lanes: lo0-3 hi0-3 lo4-7 hi4-7, put back in order
  const __m256i packed = _mm256_packus_epi32(bf16_bits8(v.lo), bf16_bits8(v.hi));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm256_permute4x64_epi64(packed, 0xD8));
}
inline void v16_store(c10::Half* p, V16 v) {
  constexpr int mode = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v.lo, mode));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p + 8), _mm256_cvtps_ph(v.hi, mode));
}
// round16 on V16: to the storage dtype and back.
template <typename T>
inline V16 v16_round(V16 v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    alignas(32) T tmp[kLanes];
    v16_store(tmp, v);
    return v16_load(tmp);
  }
}
#endif

// float -> storage dtype, rounded to nearest even (what PyTorch's casts do).
template <typename T>
inline T from_float(float x) {
  return static_cast<T>(x);
}

#if defined(__AVX512F__)
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(c10::BFloat16* p, __m512 v) {
  __m512i b = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  b = _mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  b = _mm512_srli_epi32(b, 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  b = _mm512_mask_mov_epi32(b, nan, _mm512_set1_epi32(0x7FC0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(b));
}
inline void store16(c10::Half* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
// Round 16 floats to the storage dtype and back (what a PyTorch op that returns that
// dtype does to its result).
template <typename T>
inline __m512 round16(__m512 v) {
  alignas(64) T tmp[kLanes];
  store16(tmp, v);
  return load16(tmp);
}
template <>
inline __m512 round16<float>(__m512 v) {
  return v;
}
#endif

// n elements of a row as float32 / n floats to the storage dtype (rounded as PyTorch's
// cast), 16 at a time where the CPU has AVX-512.
template <typename T>
inline void row_to_float(const T* x, int64_t n, float* out) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + kLanes <= n; i += kLanes) _mm512_storeu_ps(out + i, load16(x + i));
#elif defined(SPECDEC_AVX2)
  for (; i + kLanes <= n; i += kLanes) v16_store(out + i, v16_load(x + i));
#endif
  for (; i < n; ++i) out[i] = to_float(x[i]);
}

template <typename T>
inline void float_to_row(const float* x, int64_t n, T* out) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + kLanes <= n; i += kLanes) store16(out + i, _mm512_loadu_ps(x + i));
#elif defined(SPECDEC_AVX2)
  for (; i + kLanes <= n; i += kLanes) v16_store(out + i, v16_load(x + i));
#endif
  for (; i < n; ++i) out[i] = from_float<T>(x[i]);
}

}  // namespace specdec
