// Helpers shared by the native runtime's kernels (attention.cpp, layer_ops.cpp): dtype
// conversions (round to nearest even, as PyTorch does), fixed-order sums, and AVX-512
// loads, stores and exp.
#pragma once

#include <torch/extension.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
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
#endif
  for (; i < n; ++i) out[i] = to_float(x[i]);
}

template <typename T>
inline void float_to_row(const float* x, int64_t n, T* out) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + kLanes <= n; i += kLanes) store16(out + i, _mm512_loadu_ps(x + i));
#endif
  for (; i < n; ++i) out[i] = from_float<T>(x[i]);
}

}  // namespace specdec
