// Ragged attention over per-sequence KV caches, one call per layer for every row of a
// forward (specdec native runtime; see specdec/runtime/kernels.py).
//
// Each (row, KV head) task computes, in a fixed order that depends only on the row's
// query, its visible keys (in position order) and their values:
//   s_j = scale * <q, k_j>          16 partial sums over d, then a fixed pairwise tree
//   p_j = exp(s_j - max_j s_j)      float32
//   o   = (sum_j p_j v_j) / sum_j p_j  accumulated over j in position order
// so a row gets the same bits decoded alone, verified in a chain or a token tree, or
// next to any other sequences (batch invariance by construction: no blocking depends on
// the batch). Keys and values are read in their storage dtype, converted per element.
//
// With AVX2 and no AVX-512 the group kernel runs the same steps on V16 (common.h): the
// same bits, one score's lane tree at a time instead of 16 keys at once.
//
// Over a bfloat16 cache on a CPU with AVX512-BF16 (Zen 4, Cooper Lake, Sapphire Rapids)
// group_bf16 runs instead, with other steps (so other bits than the AVX2 path's, the same
// for every row): keys transposed into 16-key tiles of pairs, s_j as one lane's run of
// pair dot products (VDPBF16PS), the same two-pass softmax, and the value sum over pairs
// of keys on pair dot products with the probabilities rounded to bfloat16. Measured on a
// 2-core Zen 4, SmolLM2-135M, the kernel alone over 30 layers and 8,000 keys: 1 / 3 / 5 /
// 16 rows 9.0 / 17 / 26 / 62 ms with lane-reduced pair dot products for the scores (the
// version before), 8.0 / 14.2 / 18.7 / 41 ms with group_bf16.
//
// A row that sees at least 2 kChunk keys (AVX-512 or AVX2 path) is computed in chunks of kChunk
// positions (the last one running to the row's end: kChunk to 2 kChunk - 1 keys), each its
// own task (flash-decoding's split of the keys, Dao et al. 2023), and the chunks are
// merged in position order:
//   m = max_c m_c,  o = (sum_c e^{m_c - m} a_c) / (sum_c e^{m_c - m} l_c)
// with m_c, l_c, a_c the chunk's maximum, sum of p_j and sum of p_j v_j as above. The
// chunk boundaries depend only on the row's number of keys, so this too gives a row the
// same bits in any batch; it lets a long context's few tasks (one per KV head when one
// row decodes) spread over every thread; tasks are handed out largest first. A row with
// fewer than 2 kChunk keys is one chunk, computed exactly as before.
#include "common.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <array>
#include <atomic>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

using namespace specdec;

#if defined(__AVX512F__) || defined(SPECDEC_AVX2)
constexpr int kMaxVec = 8;  // head_dim 64 or 128
constexpr int kMaxGroup = 16;  // query heads per KV head
constexpr int64_t kKeyBlock = 64;  // keys read once per block for every row of a group
constexpr int64_t kMaxRows = 16;  // rows of one sequence sharing their key reads
constexpr int64_t kChunk = 1024;  // keys per task (a multiple of kKeyBlock)

// The chunks of a row that sees n keys, and how many keys its chunk c holds (0 past them).
inline int64_t row_chunks(int64_t n) { return n / kChunk > 1 ? n / kChunk : 1; }
inline int64_t chunk_len(int64_t n, int64_t c) {
  const int64_t k = row_chunks(n);
  return c >= k ? 0 : c == k - 1 ? n - c * kChunk : kChunk;
}

// One row of a group: its queries, visible keys and where its scores and sums go, for
// the task's chunk: positions kb .. kb + len - 1 (chunk_len).
template <typename scalar_t>
struct GroupRow {
  const scalar_t* q;  // [R, D]
  const int64_t* sl;  // visible slots (nullptr: slots 0 .. n-1)
  int64_t n;
  int64_t len;  // positions of the task's chunk the row sees (chunk_len; 0: none)
  float* scores;  // [R, len]
  float* acc;  // [R, D]
  float* stats;  // [R, 2]: the chunk's maximum and sum of p_j (for the merge)
};

// A sequence's packed blocks for one layer and KV head (pack_kv_tiles): keys as
// pack_key_tiles lays a block out, values as pack_value_pairs does, block jb at the
// offset jb * D of its raw keys / values; valid for the positions below `upto` (a
// multiple of kKeyBlock), nullptr / 0 for none.
struct PackedKV {
  const void* keys = nullptr;
  const void* values = nullptr;
  int64_t upto = 0;
};

#if defined(__AVX512F__)
// The sums of the 16 lanes of each of a[0..15], as lane t of the result: the same
// additions in the same tree as _mm512_reduce_add_ps (lanes l + l+8, then + l+4, + l+2,
// + l+1; IEEE addition is commutative), for 16 keys at once: about 3 shuffles and adds per
// key instead of 8.
inline __m512 reduce16(const __m512* a) {
  __m512 s1[8], s2[4], s3[2];
  for (int m = 0; m < 8; ++m)
    s1[m] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * m], a[2 * m + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                          _mm512_shuffle_f32x4(a[2 * m], a[2 * m + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int m = 0; m < 4; ++m)
    s2[m] = _mm512_add_ps(_mm512_shuffle_f32x4(s1[2 * m], s1[2 * m + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                          _mm512_shuffle_f32x4(s1[2 * m], s1[2 * m + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  for (int m = 0; m < 2; ++m)
    s3[m] = _mm512_add_ps(_mm512_shuffle_ps(s2[2 * m], s2[2 * m + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                          _mm512_shuffle_ps(s2[2 * m], s2[2 * m + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(s3[0], s3[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_ps(s3[0], s3[1], _MM_SHUFFLE(3, 1, 3, 1)));
  // lane 4k + s holds key 4s + k
  const __m512i order = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
  return _mm512_permutexvar_ps(order, r);
}
#endif

#if defined(__AVX512F__)
// One query's scores over positions jb .. je - 1, into out (indexed by position): 16 keys
// at a time, key j's 16 lane sums from lanes(j), summed in reduce16's tree, times scale.
template <typename Lanes>
inline void score_keys(float* out, int64_t jb, int64_t je, float scale, Lanes&& lanes) {
  __m512 part[kLanes];
  for (int64_t j0 = jb; j0 < je; j0 += kLanes) {
    const int64_t cnt = je - j0 < kLanes ? je - j0 : kLanes;
    for (int64_t u = 0; u < kLanes; ++u) part[u] = u < cnt ? lanes(j0 + u) : _mm512_setzero_ps();
    const __m512 sc = _mm512_mul_ps(reduce16(part), _mm512_set1_ps(scale));
    _mm512_mask_storeu_ps(out + j0, static_cast<__mmask16>((1u << cnt) - 1u), sc);
  }
}
#endif

// Keys or values jb .. je-1 of a row as float32 rows of D: the cache itself for float32
// slots in order, else converted (once per block for the slots every row of the group
// shares; per row for a token tree's own slots).
template <typename scalar_t, int64_t D>
struct BlockReader {
  const scalar_t* base;
  float* shared;  // [kKeyBlock, D]
  float* own;  // [kKeyBlock, D]
  int64_t shared_to = 0;  // slots jb .. shared_to - 1 are converted in `shared`

  void start(int64_t jb) { shared_to = jb; }

  static void convert(const scalar_t* src, float* dst) {
#if defined(__AVX512F__)
    for (int c = 0; c < D / kLanes; ++c) _mm512_storeu_ps(dst + c * kLanes, load16(src + c * kLanes));
#else
    for (int c = 0; c < D / kLanes; ++c) v16_store(dst + c * kLanes, v16_load(src + c * kLanes));
#endif
  }

  // Pointer to row j - jb of the block (D floats per row).
  const float* rows(const int64_t* sl, int64_t jb, int64_t je) {
    bool in_order = true;
    if (sl)
      for (int64_t j = jb; j < je && in_order; ++j) in_order = sl[j] == j;
    if (in_order) {
      if constexpr (std::is_same_v<scalar_t, float>) return base + jb * D;
      for (; shared_to < je; ++shared_to) convert(base + shared_to * D, shared + (shared_to - jb) * D);
      return shared;
    }
    for (int64_t j = jb; j < je; ++j) convert(base + sl[j] * D, own + (j - jb) * D);
    return own;
  }
};

// Calls visit(row, jb, je, block) for every row of a group and every block of kKeyBlock
// positions the row sees, block after block, so that a block read from `base` serves every
// row of the group before the next one is read (`block`: rows jb .. je-1 as float32).
template <typename scalar_t, int64_t D, typename Visit>
void each_block(GroupRow<scalar_t>* rows, int64_t nrows, int64_t kb, int64_t longest,
                BlockReader<scalar_t, D>& reader, const scalar_t* base, Visit&& visit) {
  reader.base = base;
  for (int64_t jb = kb; jb < longest; jb += kKeyBlock) {
    reader.start(jb);
    for (int64_t i = 0; i < nrows; ++i) {
      const GroupRow<scalar_t>& row = rows[i];
      const int64_t end = kb + row.len;
      const int64_t je = end < jb + kKeyBlock ? end : jb + kKeyBlock;
      if (jb < je) visit(row, jb, je, reader.rows(row.sl, jb, je));
    }
  }
}

// A group kernel's start: the end of its rows' longest chunk, and `reader` on this thread's
// conversion buffers.
template <typename scalar_t, int64_t D>
inline int64_t group_start(const GroupRow<scalar_t>* rows, int64_t nrows, int64_t kb,
                           BlockReader<scalar_t, D>& reader) {
  int64_t longest = kb;
  for (int64_t i = 0; i < nrows; ++i)
    longest = kb + rows[i].len > longest ? kb + rows[i].len : longest;
  static thread_local std::vector<float> buffers(2 * kKeyBlock * kMaxVec * kLanes);
  reader.shared = buffers.data();
  reader.own = buffers.data() + kKeyBlock * D;
  return longest;
}

#if defined(__AVX512F__)
// Softmax of each row's scores (row.scores, [R, len]) in place, in position order: the
// maximum (exact in any order; +0 / -0 give exp(s - m) the same bits), p_j = exp16(s_j - m)
// and their sum in 16 lanes of position-aligned partial sums, then _mm512_reduce_add_ps's
// tree. stats gets (m, sum) per query head; denom[i][r] the sum.
template <typename scalar_t>
void softmax_rows(GroupRow<scalar_t>* rows, int64_t nrows, int64_t R, float (*denom)[kMaxGroup]) {
  for (int64_t i = 0; i < nrows; ++i) {
    const int64_t n = rows[i].len;
    for (int64_t r = 0; r < R; ++r) {
      float* sr = rows[i].scores + r * n;
      __m512 mx = _mm512_set1_ps(-INFINITY);
      int64_t jm = 0;
      for (; jm + kLanes <= n; jm += kLanes) mx = _mm512_max_ps(mx, _mm512_loadu_ps(sr + jm));
      float m = _mm512_reduce_max_ps(mx);
      for (; jm < n; ++jm) m = sr[jm] > m ? sr[jm] : m;
      const __m512 mv = _mm512_set1_ps(m);
      __m512 sum = _mm512_setzero_ps();
      int64_t j = 0;
      for (; j + kLanes <= n; j += kLanes) {
        const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(sr + j), mv));
        _mm512_storeu_ps(sr + j, e);
        sum = _mm512_add_ps(sum, e);
      }
      if (j < n) {
        const __mmask16 mask = static_cast<__mmask16>((1u << (n - j)) - 1u);
        const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, sr + j), mv));
        _mm512_mask_storeu_ps(sr + j, mask, e);
        sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(mask, e));
      }
      denom[i][r] = _mm512_reduce_add_ps(sum);
      rows[i].stats[2 * r] = m;
      rows[i].stats[2 * r + 1] = denom[i][r];
    }
  }
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BF16__)
inline __m512bh as_bh(__m512i v) { return reinterpret_cast<__m512bh>(v); }

// A vector loaded once into a register for the products that use it: GCC otherwise folds
// the load into each VDPBF16PS again (one 64-byte load per product, which the load ports
// of a Zen 4 core cannot feed at one product per cycle: measured 2.9 -> 3.5 products per
// ns for the scores, 2.5 -> 2.9 for the value sums, one core, block in L1; SmolLM2's 30
// layers of 6 rows over 7,744 packed keys, 2 threads: 16.8 -> 15.9 ms). No effect on the
// arithmetic.
inline __m512i in_register(__m512i v) {
  asm volatile("" : "+v"(v));
  return v;
}

// The 16 x 16 transpose of dwords: out[j * stride] lane i = r[i] lane j (unpacks of 32
// and 64 bits within 128-bit lanes, then a 4 x 4 transpose of the 128-bit lanes: 64
// shuffles).
inline void transpose16(const __m512i* r, __m512i* out, int64_t stride) {
  __m512i t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  // u[4 g + c] lane L: keys 4 g .. 4 g + 3 of column 4 L + c
  for (int g = 0; g < 4; ++g) {
    u[4 * g] = _mm512_unpacklo_epi64(t[4 * g], t[4 * g + 2]);
    u[4 * g + 1] = _mm512_unpackhi_epi64(t[4 * g], t[4 * g + 2]);
    u[4 * g + 2] = _mm512_unpacklo_epi64(t[4 * g + 1], t[4 * g + 3]);
    u[4 * g + 3] = _mm512_unpackhi_epi64(t[4 * g + 1], t[4 * g + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    const __m512i x0 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x44);
    const __m512i x1 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xEE);
    const __m512i x2 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x44);
    const __m512i x3 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xEE);
    out[(0 + c) * stride] = _mm512_shuffle_i32x4(x0, x2, 0x88);
    out[(4 + c) * stride] = _mm512_shuffle_i32x4(x0, x2, 0xDD);
    out[(8 + c) * stride] = _mm512_shuffle_i32x4(x1, x3, 0x88);
    out[(12 + c) * stride] = _mm512_shuffle_i32x4(x1, x3, 0xDD);
  }
}

// Keys jb .. jb + 63 of K as 16-key tiles of pairs: out[p * 4 + t] lane l = the dword
// (d = 2p, 2p + 1) of the key at position jb + 16 t + l, which sits in slot sl[pos] (sl:
// nullptr for slot = position); positions at or past `end` are zeros. Tiles wholly past
// `end` are left as they are (never read into a stored score).
template <int64_t D>
inline void pack_key_tiles(const c10::BFloat16* K, const int64_t* sl, int64_t jb, int64_t end,
                           __m512i* out) {
  constexpr int NZ = static_cast<int>(D / 32);  // registers of a key's D bfloat16
  __m512i r[16];
  for (int t = 0; t < 4; ++t) {
    const int64_t first = jb + 16 * t;
    if (first >= end) return;
    for (int z = 0; z < NZ; ++z) {
      for (int64_t l = 0; l < 16; ++l) {
        const int64_t j = first + l;
        r[l] = j < end ? _mm512_loadu_si512(K + (sl ? sl[j] : j) * D + 32 * z)
                       : _mm512_setzero_si512();
      }
      transpose16(r, out + (16 * z) * 4 + t, 4);
    }
  }
}

// Values of positions jb .. jb + 63 as pairs of keys: out[jp * nv + 2 c + h] lane 4 k + i
// holds (V[pos 2 jp][e], V[pos 2 jp + 1][e]) with e = 32 c + 8 k + 4 h + i (the order of
// VPUNPCKLWD / VPUNPCKHWD: dims are permuted within each register, the same for every row,
// and put back in order by unpermute); positions at or past `end` are zeros.
template <int nv>
inline void pack_value_pairs(const c10::BFloat16* V, const int64_t* sl, int64_t jb, int64_t end,
                             __m512i* out) {
  constexpr int64_t D = nv * kLanes;
  for (int64_t jp = 0; jp < kKeyBlock / 2; ++jp) {
    const int64_t j = jb + 2 * jp;
    const c10::BFloat16* a = j < end ? V + (sl ? sl[j] : j) * D : nullptr;
    const c10::BFloat16* b = j + 1 < end ? V + (sl ? sl[j + 1] : j + 1) * D : nullptr;
    for (int c = 0; c < nv / 2; ++c) {
      const __m512i x = a ? _mm512_loadu_si512(a + 32 * c) : _mm512_setzero_si512();
      const __m512i y = b ? _mm512_loadu_si512(b + 32 * c) : _mm512_setzero_si512();
      out[jp * nv + 2 * c] = _mm512_unpacklo_epi16(x, y);
      out[jp * nv + 2 * c + 1] = _mm512_unpackhi_epi16(x, y);
    }
  }
}

// Whether a row reads positions jb .. je - 1 from slots jb .. je - 1.
inline bool slots_in_order(const int64_t* sl, int64_t jb, int64_t je) {
  if (!sl) return true;
  for (int64_t j = jb; j < je; ++j)
    if (sl[j] != j) return false;
  return true;
}

// The scores of QG query heads of one row (queries q + g D; scores at out + g len,
// indexed by position) over positions jb .. je - 1 of a packed block: per query and tile,
// VDPBF16PS over the pairs in order from 0, then times scale. QG queries at once give
// NT QG independent sums (one query's would wait on VDPBF16PS's latency); each query's
// and each tile's arithmetic is its own, so the bits depend neither on QG nor on NT, the
// 16-key tiles computed: those the row sees (je - jb keys; lanes past je unused), so that
// a row ending early in a block (a chain's or a decoding row's last block) skips the rest.
template <int64_t D, int QG, int NT>
inline void score_tiles_n(const c10::BFloat16* q, const __m512i* kp, float* out, int64_t len,
                          int64_t jb, int64_t je, float scale) {
  __m512 acc[QG][NT];
  for (int g = 0; g < QG; ++g)
    for (int t = 0; t < NT; ++t) acc[g][t] = _mm512_setzero_ps();
  for (int p = 0; p < static_cast<int>(D / 2); ++p) {
    __m512i k[NT];
    for (int t = 0; t < NT; ++t) k[t] = in_register(kp[p * 4 + t]);
    for (int g = 0; g < QG; ++g) {
      int32_t pair;
      std::memcpy(&pair, q + g * D + 2 * p, sizeof(pair));
      const __m512bh qb = as_bh(_mm512_set1_epi32(pair));
      for (int t = 0; t < NT; ++t) acc[g][t] = _mm512_dpbf16_ps(acc[g][t], qb, as_bh(k[t]));
    }
  }
  const __m512 sv = _mm512_set1_ps(scale);
  for (int t = 0; t < NT && jb + 16 * t < je; ++t) {
    const int64_t first = jb + 16 * t;
    const int64_t cnt = je - first < 16 ? je - first : 16;
    const __mmask16 mask = static_cast<__mmask16>((1u << cnt) - 1u);
    for (int g = 0; g < QG; ++g)
      _mm512_mask_storeu_ps(out + g * len + first, mask, _mm512_mul_ps(acc[g][t], sv));
  }
}

template <int64_t D, int QG>
inline void score_tiles(const c10::BFloat16* q, const __m512i* kp, float* out, int64_t len,
                        int64_t jb, int64_t je, float scale) {
  switch ((je - jb + 15) / 16) {
    case 1: score_tiles_n<D, QG, 1>(q, kp, out, len, jb, je, scale); break;
    case 2: score_tiles_n<D, QG, 2>(q, kp, out, len, jb, je, scale); break;
    case 3: score_tiles_n<D, QG, 3>(q, kp, out, len, jb, je, scale); break;
    default: score_tiles_n<D, QG, 4>(q, kp, out, len, jb, je, scale); break;
  }
}

// The value sums of QG query heads of one row over positions jb .. je - 1 (probabilities
// at p + g len, indexed by position; sums at acc + g D in pack_value_pairs' order): per
// pair of keys in order, VDPBF16PS of the bfloat16 probabilities with the value pairs.
// A row ending inside a pair (je - jb odd) has probability 0 for the missing key and its
// values masked to zero, so the pair adds the same +0 products whatever the block holds.
template <int nv, int QG>
inline void value_pairs(const float* p, int64_t len, float* acc_out, const __m512i* vp,
                        int64_t jb, int64_t je) {
  constexpr int64_t D = nv * kLanes;
  alignas(64) int32_t pb[QG][kKeyBlock / 2];
  for (int g = 0; g < QG; ++g)
    for (int64_t j0 = jb; j0 < je; j0 += 32) {
      const int64_t left = je - j0;
      const __mmask16 m0 = static_cast<__mmask16>(left >= 16 ? 0xFFFFu : (1u << left) - 1u);
      const __mmask16 m1 = static_cast<__mmask16>(
          left >= 32 ? 0xFFFFu : left <= 16 ? 0u : (1u << (left - 16)) - 1u);
      const __m512 lo = _mm512_maskz_loadu_ps(m0, p + g * len + j0);
      const __m512 hi = _mm512_maskz_loadu_ps(m1, p + g * len + j0 + 16);
      _mm512_store_si512(pb[g] + (j0 - jb) / 2,
                         reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo)));
    }
  __m512 acc[QG][nv];
  for (int g = 0; g < QG; ++g)
    for (int c = 0; c < nv; ++c) acc[g][c] = _mm512_loadu_ps(acc_out + g * D + c * kLanes);
  const int64_t pairs = (je - jb + 1) / 2;
  const int64_t whole = (je - jb) / 2;  // pairs with both keys in the row
  auto add_pair = [&](int64_t jp, const __m512i* v) {
    for (int g = 0; g < QG; ++g) {
      const __m512bh pv = as_bh(_mm512_set1_epi32(pb[g][jp]));
      for (int c = 0; c < nv; ++c) acc[g][c] = _mm512_dpbf16_ps(acc[g][c], pv, as_bh(v[c]));
    }
  };
  for (int64_t jp = 0; jp < whole; ++jp) {
    __m512i v[nv];
    for (int c = 0; c < nv; ++c) v[c] = in_register(vp[jp * nv + c]);
    add_pair(jp, v);
  }
  if (pairs > whole) {  // the row ends inside this pair: its second key's values masked off
    __m512i v[nv];
    for (int c = 0; c < nv; ++c)
      v[c] = _mm512_and_si512(vp[whole * nv + c], _mm512_set1_epi32(0xFFFF));
    add_pair(whole, v);
  }
  for (int g = 0; g < QG; ++g)
    for (int c = 0; c < nv; ++c) _mm512_storeu_ps(acc_out + g * D + c * kLanes, acc[g][c]);
}

// The kept packed block that holds a row's own slots at positions jb .. je - 1, or
// nullptr: they must be consecutive from a block's first slot (a multiple of kKeyBlock)
// below `upto`. A KV window aligned to the blocks (sinks, then a recent part starting at
// position sinks + m kKeyBlock: BatchItem.kv_window's align) reads all its complete blocks
// after the first this way: the same bytes its own packing would write.
inline const __m512i* kept_block(const int64_t* sl, int64_t jb, int64_t je, const __m512i* kept,
                                 int64_t upto, int64_t block_vectors) {
  if (!kept) return nullptr;
  const int64_t first = sl[jb];
  if (first % kKeyBlock || first + kKeyBlock > upto) return nullptr;
  for (int64_t j = jb + 1; j < je; ++j)
    if (sl[j] != first + (j - jb)) return nullptr;
  return kept + (first / kKeyBlock) * block_vectors;
}

// Calls visit(row, jb, je, block) for every row of a group and every block of kKeyBlock
// positions the row sees, block after block, with the block packed by pack(slots, jb, end,
// out): once into `shared` (up to the group's longest row) for every row that reads the
// block's slots in order, so that it serves all of them; into `own` for a row with its own
// slots there (a token tree's or a KV window's), unless they are a kept block's.
//
// `kept` (may be nullptr): the sequence's blocks packed once for every forward
// (pack_kv_tiles), the same bytes pack writes for a whole block, used below `upto`
// instead of packing again.
template <typename Pack, typename Visit>
void each_packed_block(GroupRow<c10::BFloat16>* rows, int64_t nrows, int64_t kb, int64_t longest,
                       __m512i* shared, __m512i* own, Pack&& pack, Visit&& visit,
                       const __m512i* kept, int64_t upto, int64_t block_vectors) {
  for (int64_t jb = kb; jb < longest; jb += kKeyBlock) {
    bool packed = false;
    const __m512i* in_order = shared;
    if (kept && jb + kKeyBlock <= upto) {
      in_order = kept + (jb / kKeyBlock) * block_vectors;
      packed = true;
    }
    for (int64_t i = 0; i < nrows; ++i) {
      const GroupRow<c10::BFloat16>& row = rows[i];
      const int64_t end = kb + row.len;
      const int64_t je = end < jb + kKeyBlock ? end : jb + kKeyBlock;
      if (jb >= je) continue;
      if (slots_in_order(row.sl, jb, je)) {
        if (!packed) pack(nullptr, jb, longest, shared);
        packed = true;
        visit(row, jb, je, in_order);
      } else if (const __m512i* block = kept_block(row.sl, jb, je, kept, upto, block_vectors)) {
        visit(row, jb, je, block);
      } else {
        pack(row.sl, jb, je, own);
        visit(row, jb, je, own);
      }
    }
  }
}

// One (group of rows of one sequence, KV head) task over a bfloat16 cache with
// AVX512-BF16 (Zen 4, Cooper Lake, Sapphire Rapids): the keys-in-lanes formulation of
// FlashAttention's CPU kernels, with the exact two-pass softmax of group_avx512. Per row
// and query head, over positions kb .. kb + len - 1:
//   s_j = scale * <q, k_j>   lane j of a 16-key tile: VDPBF16PS over the pairs
//                            (d = 2p, 2p + 1), p = 0 .. D/2 - 1 in order, from 0, float32
//                            (the prompt kernel's score arithmetic, prompt_attention.cpp)
//   p_j = exp16(s_j - max s), sum p_j in float32 (softmax_rows)
//   o   = (sum over pairs (j, j + 1) in position order of bf16(p_j) v_j + bf16(p_j+1)
//          v_j+1, VDPBF16PS, float32) / sum p_j
// The probabilities are rounded to bfloat16 for the value sum (as the prompt kernel and
// PyTorch's bfloat16 flash kernel do); the normalizer sums them in float32. Each row's
// steps read only its query and its own keys, in pairs and tiles aligned to the chunk's
// start (a multiple of 64): the same bits whatever rows share the task, so a row gets the
// same bits decoded alone, verified in a chain or tree, or batched. What rows share is the
// packing: a 64-key block is packed once (keys as tiles, values as pairs) for every row of
// the group that reads those slots in order; a token tree's or a window's own slots are
// packed per row; a long sequence's complete blocks, packed once for every forward
// (pack_kv_tiles, NativeKVCache.pack_tiles: the same bytes), are read as they are. A row's
// last pair, when its keys end inside one, has the missing key's
// probability 0 and its values zeroed, so it adds +0 products whatever the cache holds.
// Measured on a 2-core Zen 4, SmolLM2-135M, 8,000 cached tokens, one forward of 1 / 3 / 5
// rows: see the header and benchmarks/long_context_cpu/report.md (runs 6-8).
template <int nv>
void group_bf16(GroupRow<c10::BFloat16>* rows, int64_t nrows, const c10::BFloat16* K,
                const c10::BFloat16* V, int64_t R, float scale, int64_t kb, bool normalize,
                const PackedKV& kept) {
  constexpr int64_t D = nv * kLanes;
  int64_t longest = kb;
  for (int64_t i = 0; i < nrows; ++i)
    longest = kb + rows[i].len > longest ? kb + rows[i].len : longest;
  // a packed block: D / 2 pairs x 4 key tiles, or kKeyBlock / 2 key pairs x nv values
  constexpr int64_t kPacked = (D / 2) * 4 > (kKeyBlock / 2) * nv ? (D / 2) * 4 : (kKeyBlock / 2) * nv;
  static thread_local std::vector<__m512i> buffers(2 * kPacked);  // shared, then own
  __m512i* shared = buffers.data();
  __m512i* own = buffers.data() + kPacked;
  // scores
  each_packed_block(
      rows, nrows, kb, longest, shared, own,
      [&](const int64_t* sl, int64_t jb, int64_t end, __m512i* out) {
        pack_key_tiles<D>(K, sl, jb, end, out);
      },
      [&](const GroupRow<c10::BFloat16>& row, int64_t jb, int64_t je, const __m512i* kp) {
        for (int64_t r = 0; r < R;) {
          const int64_t n = R - r < 3 ? R - r : 3;
          float* out = row.scores + r * row.len - kb;  // indexed by position
          if (n == 3)
            score_tiles<D, 3>(row.q + r * D, kp, out, row.len, jb, je, scale);
          else if (n == 2)
            score_tiles<D, 2>(row.q + r * D, kp, out, row.len, jb, je, scale);
          else
            score_tiles<D, 1>(row.q + r * D, kp, out, row.len, jb, je, scale);
          r += n;
        }
      },
      static_cast<const __m512i*>(kept.keys), kept.upto, kKeyBlock * D / 32);
  float denom[kMaxRows][kMaxGroup];
  softmax_rows(rows, nrows, R, denom);
  for (int64_t i = 0; i < nrows; ++i) std::fill(rows[i].acc, rows[i].acc + R * D, 0.f);
  // value sums, in the permuted order of pack_value_pairs
  constexpr int most = nv <= 4 ? 3 : 2;  // accumulators stay in registers
  each_packed_block(
      rows, nrows, kb, longest, shared, own,
      [&](const int64_t* sl, int64_t jb, int64_t end, __m512i* out) {
        pack_value_pairs<nv>(V, sl, jb, end, out);
      },
      [&](const GroupRow<c10::BFloat16>& row, int64_t jb, int64_t je, const __m512i* vp) {
        for (int64_t r = 0; r < R;) {
          const int64_t n = R - r < most ? R - r : most;
          const float* pr = row.scores + r * row.len - kb;  // indexed by position
          float* a = row.acc + r * D;
          if (n == 3)
            value_pairs<nv, most>(pr, row.len, a, vp, jb, je);
          else if (n == 2)
            value_pairs<nv, 2>(pr, row.len, a, vp, jb, je);
          else
            value_pairs<nv, 1>(pr, row.len, a, vp, jb, je);
          r += n;
        }
      },
      static_cast<const __m512i*>(kept.values), kept.upto, kKeyBlock * D / 32);
  // dims back in order (and normalized when this is the row's only chunk)
  for (int64_t i = 0; i < nrows; ++i)
    for (int64_t r = 0; r < R; ++r) {
      float* a = rows[i].acc + r * D;
      alignas(64) float tmp[kMaxVec * kLanes];
      std::copy(a, a + D, tmp);
      const float inv = normalize ? 1.f / denom[i][r] : 1.f;
      for (int c = 0; c < nv / 2; ++c)
        for (int h = 0; h < 2; ++h)
          for (int k = 0; k < 4; ++k)
            for (int e = 0; e < 4; ++e) {
              const float x = tmp[(2 * c + h) * kLanes + 4 * k + e];
              a[32 * c + 8 * k + 4 * h + e] = normalize ? x * inv : x;
            }
    }
}
#endif

// One (group of rows of one sequence, KV head) task with AVX-512. Keys and values are
// read in blocks of kKeyBlock positions, converted to float32 once for every row of the
// group that sees them in order (a chain or tree verification reads the KV cache about
// once instead of once per row). Each row's arithmetic is the same whatever its group:
//   s_j = scale * <q, k_j>: 16 lane products over d (mul, then fma in order of d), summed
//         in _mm512_reduce_add_ps's tree (reduce16, 16 keys at a time);
//   softmax over its keys in position order (max, exp16, 16-lane partial sums);
//   o = sum_j p_j v_j by fma in position order, then times 1 / sum_j p_j.
// Positions kb .. kb + len - 1 of each row only (the task's chunk): each row's acc holds
// sum_j p_j v_j, normalized by 1 / sum_j p_j when `normalize` (the row's only chunk), else
// left for the merge with the chunk's maximum and sum in stats. A bfloat16 cache on a CPU
// with AVX512-BF16 runs group_bf16 instead.
#if defined(__AVX512F__)
template <typename scalar_t, int nv>
void group_avx512(GroupRow<scalar_t>* rows, int64_t nrows, const scalar_t* K, const scalar_t* V,
                  int64_t R, float scale, int64_t kb, bool normalize) {
  constexpr int64_t D = nv * kLanes;
  BlockReader<scalar_t, D> reader;
  const int64_t longest = group_start(rows, nrows, kb, reader);
  __m512 qv[kMaxVec];
  each_block(rows, nrows, kb, longest, reader, K, [&](const GroupRow<scalar_t>& row, int64_t jb,
                                                      int64_t je, const float* block) {
    for (int64_t r = 0; r < R; ++r) {
      for (int c = 0; c < nv; ++c) qv[c] = load16(row.q + r * D + c * kLanes);
      score_keys(row.scores + r * row.len - kb, jb, je, scale, [&](int64_t j) {
        const float* k = block + (j - jb) * D;
        __m512 a = _mm512_mul_ps(qv[0], _mm512_loadu_ps(k));
        for (int c = 1; c < nv; ++c) a = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(k + c * kLanes), a);
        return a;
      });
    }
  });
  float denom[kMaxRows][kMaxGroup];
  softmax_rows(rows, nrows, R, denom);
  for (int64_t i = 0; i < nrows; ++i) std::fill(rows[i].acc, rows[i].acc + R * D, 0.f);
  // one query head at a time over the block, so that its nv accumulators stay in registers
  // (R is not known at compile time: an array of R x nv accumulators went through the
  // stack, a load and a store per FMA); each still sums over j in position order
  __m512 acc[kMaxVec];
  each_block(rows, nrows, kb, longest, reader, V, [&](const GroupRow<scalar_t>& row, int64_t jb,
                                                      int64_t je, const float* vb) {
    for (int64_t r = 0; r < R; ++r) {
      float* a = row.acc + r * D;
      const float* pr = row.scores + r * row.len - kb;  // indexed by position
      for (int c = 0; c < nv; ++c) acc[c] = _mm512_loadu_ps(a + c * kLanes);
      for (int64_t j = jb; j < je; ++j) {
        const float* v = vb + (j - jb) * D;
        const __m512 p = _mm512_set1_ps(pr[j]);
        for (int c = 0; c < nv; ++c) acc[c] = _mm512_fmadd_ps(p, _mm512_loadu_ps(v + c * kLanes), acc[c]);
      }
      for (int c = 0; c < nv; ++c) _mm512_storeu_ps(a + c * kLanes, acc[c]);
    }
  });
  if (!normalize) return;
  for (int64_t i = 0; i < nrows; ++i)
    for (int64_t r = 0; r < R; ++r) {
      const __m512 inv = _mm512_set1_ps(1.f / denom[i][r]);
      float* a = rows[i].acc + r * D;
      for (int c = 0; c < nv; ++c)
        _mm512_storeu_ps(a + c * kLanes, _mm512_mul_ps(_mm512_loadu_ps(a + c * kLanes), inv));
    }
}
#endif  // __AVX512F__ (group_avx512)
#endif  // __AVX512F__ || SPECDEC_AVX2

#if defined(SPECDEC_AVX2)
// group_avx512 on V16 (two AVX2 registers per 16 lanes), step for step: the same products,
// the same reduction tree per score (v16_reduce_add, reduce16's tree one key at a time),
// the same exp, sums and order, so the same bits.
template <typename scalar_t, int nv>
void group_v16(GroupRow<scalar_t>* rows, int64_t nrows, const scalar_t* K, const scalar_t* V,
               int64_t R, float scale, int64_t kb, bool normalize) {
  constexpr int64_t D = nv * kLanes;
  BlockReader<scalar_t, D> reader;
  const int64_t longest = group_start(rows, nrows, kb, reader);
  // registers as __m256 arrays (lanes 0-7, 8-15): an array of V16 went through the stack
  __m256 ql[kMaxVec], qh[kMaxVec];
  each_block(rows, nrows, kb, longest, reader, K, [&](const GroupRow<scalar_t>& row, int64_t jb,
                                                      int64_t je, const float* block) {
    for (int64_t r = 0; r < R; ++r) {
      _Pragma("GCC unroll 8")
      for (int c = 0; c < nv; ++c) {
        const V16 v = v16_load(row.q + r * D + c * kLanes);
        ql[c] = v.lo;
        qh[c] = v.hi;
      }
      float* out = row.scores + r * row.len - kb;  // indexed by position
      for (int64_t j = jb; j < je; ++j) {
        const float* k = block + (j - jb) * D;
        __m256 lo = _mm256_mul_ps(ql[0], _mm256_loadu_ps(k));
        __m256 hi = _mm256_mul_ps(qh[0], _mm256_loadu_ps(k + 8));
        _Pragma("GCC unroll 8")
        for (int c = 1; c < nv; ++c) {
          lo = _mm256_fmadd_ps(ql[c], _mm256_loadu_ps(k + c * kLanes), lo);
          hi = _mm256_fmadd_ps(qh[c], _mm256_loadu_ps(k + c * kLanes + 8), hi);
        }
        out[j] = v16_reduce_add({lo, hi}) * scale;
      }
    }
  });
  float denom[kMaxRows][kMaxGroup];
  for (int64_t i = 0; i < nrows; ++i) {
    const int64_t n = rows[i].len;
    for (int64_t r = 0; r < R; ++r) {
      float* sr = rows[i].scores + r * n;
      float m = -INFINITY;  // the maximum is exact in any order
      for (int64_t j = 0; j < n; ++j) m = sr[j] > m ? sr[j] : m;
      const V16 mv = v16_set1(m);
      V16 sum = v16_zero();
      int64_t j = 0;
      for (; j + kLanes <= n; j += kLanes) {
        const V16 e = v16_exp(v16_sub(v16_load(sr + j), mv));
        v16_store(sr + j, e);
        sum = v16_add(sum, e);
      }
      if (j < n) {  // the tail: lanes past n hold exact zeros in the sum
        alignas(32) float tmp[kLanes] = {0.f};
        std::copy(sr + j, sr + n, tmp);
        v16_store(tmp, v16_exp(v16_sub(v16_load(tmp), mv)));
        std::copy(tmp, tmp + (n - j), sr + j);
        std::fill(tmp + (n - j), tmp + kLanes, 0.f);
        sum = v16_add(sum, v16_load(tmp));
      }
      denom[i][r] = v16_reduce_add(sum);
      rows[i].stats[2 * r] = m;
      rows[i].stats[2 * r + 1] = denom[i][r];
    }
    std::fill(rows[i].acc, rows[i].acc + R * D, 0.f);
  }
  __m256 acc[2 * kMaxVec];  // 8 lanes each: acc[i] holds elements 8 i .. 8 i + 7
  each_block(rows, nrows, kb, longest, reader, V, [&](const GroupRow<scalar_t>& row, int64_t jb,
                                                      int64_t je, const float* vb) {
    for (int64_t r = 0; r < R; ++r) {
      float* a = row.acc + r * D;
      _Pragma("GCC unroll 16")
      for (int c = 0; c < 2 * nv; ++c) acc[c] = _mm256_loadu_ps(a + 8 * c);
      for (int64_t j = jb; j < je; ++j) {
        const float* v = vb + (j - jb) * D;
        const __m256 p = _mm256_set1_ps(row.scores[r * row.len + j - kb]);
        _Pragma("GCC unroll 16")
        for (int c = 0; c < 2 * nv; ++c) acc[c] = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 8 * c), acc[c]);
      }
      _Pragma("GCC unroll 16")
      for (int c = 0; c < 2 * nv; ++c) _mm256_storeu_ps(a + 8 * c, acc[c]);
    }
  });
  if (!normalize) return;
  for (int64_t i = 0; i < nrows; ++i)
    for (int64_t r = 0; r < R; ++r) {
      const V16 inv = v16_set1(1.f / denom[i][r]);
      float* a = rows[i].acc + r * D;
      for (int c = 0; c < nv; ++c) v16_store(a + c * kLanes, v16_mul(v16_load(a + c * kLanes), inv));
    }
}
#endif

#if defined(__AVX512F__) || defined(SPECDEC_AVX2)
// The group kernel this CPU runs.
template <typename scalar_t, int nv>
inline void group_kernel(GroupRow<scalar_t>* rows, int64_t nrows, const scalar_t* K,
                         const scalar_t* V, int64_t R, float scale, int64_t kb, bool normalize,
                         const PackedKV& kept) {
#if defined(__AVX512F__)
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    group_bf16<nv>(rows, nrows, K, V, R, scale, kb, normalize, kept);
    return;
  }
#endif
  group_avx512<scalar_t, nv>(rows, nrows, K, V, R, scale, kb, normalize);
#else
  group_v16<scalar_t, nv>(rows, nrows, K, V, R, scale, kb, normalize);
#endif
}
#endif

template <typename scalar_t>
void run(const torch::Tensor& q, const std::vector<torch::Tensor>& kv, int64_t layer, const int64_t* row_seq,
         const int64_t* row_n, const int64_t* row_off, const int64_t* slots, float scale,
         torch::Tensor& out, const std::vector<torch::Tensor>& tiles, const int64_t* tiles_upto) {
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t G = kv[0].size(2);
  const int64_t R = H / G;
  const int64_t Dv = (D / kLanes) * kLanes;
  std::vector<const scalar_t*> base;
  std::vector<int64_t> capacity;
  for (const auto& t : kv) {
    capacity.push_back(t.size(3));
    base.push_back(t.data_ptr<scalar_t>() + layer * 2 * G * t.size(3) * D);
  }
  const scalar_t* qp = q.data_ptr<scalar_t>();
  scalar_t* op = out.data_ptr<scalar_t>();
#if defined(__AVX512F__) || defined(SPECDEC_AVX2)
  if ((D == 64 || D == 128) && R <= kMaxGroup) {
    // Groups: runs of consecutive rows of one sequence, at most kMaxRows each, split
    // evenly; a group's tasks (one per KV head) read its keys once per block.
    std::vector<int64_t> first;  // group g holds rows first[g] .. first[g + 1] - 1
    for (int64_t t = 0; t < T;) {
      int64_t e = t + 1;
      while (e < T && row_seq[e] == row_seq[t]) ++e;
      const int64_t run = e - t, parts = (run + kMaxRows - 1) / kMaxRows;
      for (int64_t k = 0; k < parts; ++k) first.push_back(t + run * k / parts);
      t = e;
    }
    first.push_back(T);
    // Fewer tasks than twice the threads (one sequence's chain or tree verified alone:
    // one task per KV head, 3 on 2 threads for SmolLM2) leave a thread idle for part of
    // the layer: split the group with the most rows in half until there are enough. Only
    // the sharing of the packed keys changes; a row's arithmetic does not depend on its
    // group, so neither do its bits.
    {
      const int64_t target = 2 * at::get_num_threads();
      auto group_tasks = [&](size_t i) -> int64_t {
        if (row_seq[first[i]] < 0) return 0;
        int64_t most = 1;
        for (int64_t t = first[i]; t < first[i + 1]; ++t)
          most = row_chunks(row_n[t]) > most ? row_chunks(row_n[t]) : most;
        return most * G;
      };
      int64_t total = 0;
      for (size_t i = 0; i + 1 < first.size(); ++i) total += group_tasks(i);
      while (total < target) {
        size_t widest = 0;
        int64_t rows = 1;
        for (size_t i = 0; i + 1 < first.size(); ++i)
          if (row_seq[first[i]] >= 0 && first[i + 1] - first[i] > rows) {
            rows = first[i + 1] - first[i];
            widest = i;
          }
        if (rows < 2) break;
        total -= group_tasks(widest);
        first.insert(first.begin() + widest + 1, first[widest] + rows / 2);
        total += group_tasks(widest) + group_tasks(widest + 1);
      }
    }
    const int64_t groups = static_cast<int64_t>(first.size()) - 1;
    // Tasks: (group, chunk, KV head); a group has as many chunks as its row with the
    // most. A group with several keeps every chunk's partial sums for the merge below.
    // Tasks go to the threads largest first, each thread taking the next one when done
    // (a task's result does not depend on which thread runs it).
    std::vector<int64_t> chunks(groups), partial_at(groups, -1);
    std::vector<std::pair<int64_t, int64_t>> order;  // (-keys, task), task = (grp, c, g)
    std::vector<std::array<int64_t, 3>> tasks;
    int64_t partial_floats = 0;
    for (int64_t grp = 0; grp < groups; ++grp) {
      if (row_seq[first[grp]] < 0) continue;
      int64_t most = 1;
      for (int64_t t = first[grp]; t < first[grp + 1]; ++t)
        most = row_chunks(row_n[t]) > most ? row_chunks(row_n[t]) : most;
      chunks[grp] = most;
      if (most > 1) {
        partial_at[grp] = partial_floats;
        partial_floats += most * G * (first[grp + 1] - first[grp]) * R * (D + 2);
      }
      for (int64_t c = 0; c < most; ++c) {
        int64_t keys = 0;
        for (int64_t t = first[grp]; t < first[grp + 1]; ++t) keys += chunk_len(row_n[t], c);
        for (int64_t g = 0; g < G; ++g) {
          order.emplace_back(-keys, static_cast<int64_t>(tasks.size()));
          tasks.push_back({grp, c, g});
        }
      }
    }
    std::stable_sort(order.begin(), order.end(),
                     [](const auto& a, const auto& b) { return a.first < b.first; });
    std::vector<float> partial(partial_floats);
    std::atomic<int64_t> next{0};
    const int64_t num_tasks = static_cast<int64_t>(tasks.size());
    const int64_t workers = std::min<int64_t>(at::get_num_threads(), num_tasks);
    at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
      std::vector<float> scores, acc, stats;
      GroupRow<scalar_t> rows[kMaxRows];
      for (int64_t k = next++; k < num_tasks; k = next++) {
        const auto& task = tasks[order[k].second];
        const int64_t grp = task[0], c = task[1], g = task[2];
        const int64_t t0 = first[grp], t1 = first[grp + 1], nr = t1 - t0;
        const int64_t s = row_seq[t0];
        const int64_t kb = c * kChunk;
        const bool split = chunks[grp] > 1;
        int64_t total = 0;
        for (int64_t t = t0; t < t1; ++t) total += chunk_len(row_n[t], c);
        scores.resize(R * total);
        float* chunk_out = split ? partial.data() + partial_at[grp] + (c * G + g) * nr * R * (D + 2)
                                 : nullptr;
        if (!split) {
          acc.resize(R * D * nr);
          stats.resize(2 * R * nr);
        }
        int64_t used = 0;
        for (int64_t t = t0; t < t1; ++t) {
          GroupRow<scalar_t>& row = rows[t - t0];
          row.q = qp + (t * H + g * R) * D;
          row.sl = row_off[t] < 0 ? nullptr : slots + row_off[t];
          row.n = row_n[t];
          row.len = chunk_len(row.n, c);
          row.scores = scores.data() + R * used;
          if (split) {
            row.acc = chunk_out + (t - t0) * R * (D + 2);
            row.stats = row.acc + R * D;
          } else {
            row.acc = acc.data() + R * D * (t - t0);
            row.stats = stats.data() + 2 * R * (t - t0);
          }
          used += row.len;
        }
        const int64_t cap = capacity[s];
        const scalar_t* K = base[s] + g * cap * D;
        const scalar_t* V = base[s] + (G + g) * cap * D;
        PackedKV kept;
        if (!tiles.empty() && tiles_upto[s] > 0) {
          const scalar_t* tb = tiles[s].data_ptr<scalar_t>() + layer * 2 * G * cap * D;
          kept.keys = tb + g * cap * D;
          kept.values = tb + (G + g) * cap * D;
          kept.upto = tiles_upto[s];
        }
        if (D == 64)
          group_kernel<scalar_t, 4>(rows, nr, K, V, R, scale, kb, !split, kept);
        else
          group_kernel<scalar_t, 8>(rows, nr, K, V, R, scale, kb, !split, kept);
        if (split) continue;
        for (int64_t t = t0; t < t1; ++t)
          for (int64_t r = 0; r < R; ++r) {
            scalar_t* o = op + (t * H + g * R + r) * D;
            const float* a = acc.data() + R * D * (t - t0) + r * D;
            for (int64_t i = 0; i < D; ++i) o[i] = static_cast<scalar_t>(a[i]);
          }
      }
    });
    // The merge of split rows, per (row, KV head), chunks in position order.
    std::vector<int64_t> merges;  // (group, KV head) pairs with several chunks
    for (int64_t grp = 0; grp < groups; ++grp)
      if (chunks[grp] > 1 && row_seq[first[grp]] >= 0)
        for (int64_t g = 0; g < G; ++g) merges.push_back(grp * G + g);
    at::parallel_for(0, static_cast<int64_t>(merges.size()), 1, [&](int64_t begin, int64_t end) {
      std::vector<float> num(D);
      for (int64_t k = begin; k < end; ++k) {
        const int64_t grp = merges[k] / G, g = merges[k] % G;
        const int64_t t0 = first[grp], nr = first[grp + 1] - t0;
        const float* part = partial.data() + partial_at[grp];
        for (int64_t t = t0; t < t0 + nr; ++t) {
          const int64_t used = row_chunks(row_n[t]);
          for (int64_t r = 0; r < R; ++r) {
            auto at = [&](int64_t c) {
              return part + ((c * G + g) * nr + (t - t0)) * R * (D + 2);
            };
            float m = -INFINITY;
            for (int64_t c = 0; c < used; ++c) {
              const float mc = at(c)[R * D + 2 * r];
              m = mc > m ? mc : m;
            }
            float den = 0.f;
            std::fill(num.begin(), num.end(), 0.f);
            for (int64_t c = 0; c < used; ++c) {
              const float* a = at(c) + r * D;
              const float w = std::exp(at(c)[R * D + 2 * r] - m);
              den += w * at(c)[R * D + 2 * r + 1];
              for (int64_t i = 0; i < D; ++i) num[i] += w * a[i];
            }
            const float inv = 1.f / den;
            scalar_t* o = op + (t * H + g * R + r) * D;
            for (int64_t i = 0; i < D; ++i) o[i] = static_cast<scalar_t>(num[i] * inv);
          }
        }
      }
    });
    return;
  }
#endif
  at::parallel_for(0, T * G, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(R * D), kf(D), acc(R * D), scores;
    float lane[kLanes];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t t = task / G, g = task % G;
      const int64_t s = row_seq[t];
      if (s < 0) continue;
      const int64_t n = row_n[t], off = row_off[t], cap = capacity[s];
      const scalar_t* K = base[s] + g * cap * D;
      const scalar_t* V = base[s] + (G + g) * cap * D;
      for (int64_t r = 0; r < R; ++r)
        for (int64_t i = 0; i < D; ++i) qf[r * D + i] = to_float(qp[(t * H + g * R + r) * D + i]);
      scores.resize(R * n);
      for (int64_t j = 0; j < n; ++j) {
        const int64_t slot = off < 0 ? j : slots[off + j];
        const scalar_t* k = K + slot * D;
        for (int64_t i = 0; i < D; ++i) kf[i] = to_float(k[i]);
        for (int64_t r = 0; r < R; ++r) {
          const float* qr = qf.data() + r * D;
          for (int l = 0; l < kLanes; ++l) lane[l] = 0.f;
          for (int64_t i = 0; i < Dv; i += kLanes)
            for (int l = 0; l < kLanes; ++l) lane[l] += qr[i + l] * kf[i + l];
          for (int64_t i = Dv; i < D; ++i) lane[i - Dv] += qr[i] * kf[i];
          scores[r * n + j] = tree_sum(lane) * scale;
        }
      }
      std::vector<float> denom(R);
      for (int64_t r = 0; r < R; ++r) {
        float* sr = scores.data() + r * n;
        float m = -INFINITY;
        for (int64_t j = 0; j < n; ++j) m = sr[j] > m ? sr[j] : m;
        float sum = 0.f;
        for (int64_t j = 0; j < n; ++j) {
          sr[j] = std::exp(sr[j] - m);
          sum += sr[j];
        }
        denom[r] = sum;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t j = 0; j < n; ++j) {
        const int64_t slot = off < 0 ? j : slots[off + j];
        const scalar_t* v = V + slot * D;
        for (int64_t i = 0; i < D; ++i) kf[i] = to_float(v[i]);
        for (int64_t r = 0; r < R; ++r) {
          const float p = scores[r * n + j];
          float* a = acc.data() + r * D;
          for (int64_t i = 0; i < D; ++i) a[i] += p * kf[i];
        }
      }
      for (int64_t r = 0; r < R; ++r) {
        scalar_t* o = op + (t * H + g * R + r) * D;
        const float inv = 1.f / denom[r];
        for (int64_t i = 0; i < D; ++i) o[i] = static_cast<scalar_t>(acc[r * D + i] * inv);
      }
    }
  });
}

}  // namespace

void check_caches(const std::vector<torch::Tensor>& kv, int64_t layer, int64_t D,
                  c10::ScalarType dtype) {
  TORCH_CHECK(!kv.empty(), "no KV caches");
  for (const auto& t : kv)
    TORCH_CHECK(t.dim() == 5 && t.size(1) == 2 && t.is_contiguous() && t.scalar_type() == dtype &&
                    t.size(4) == D && layer >= 0 && layer < t.size(0),
                "each KV cache must be a contiguous [L, 2, G, C, D] tensor of the queries' dtype");
}

// q: [T, H, D] contiguous; kv: per sequence [L, 2, G, C, D] contiguous, q's dtype (the
// layer `layer` is read); row_seq [T] int64 (-1: row skipped); row_n [T] int64 visible
// keys; row_off [T] int64 offset of the row's slots in `slots` (-1: slots 0 .. n-1);
// out: [T, H * D], q's dtype.
// tiles: empty, or per sequence its packed blocks (pack_kv_tiles: a tensor of its cache's
// shape and dtype), valid below tiles_upto[s] ([S] int64; 0: none), which the bfloat16
// kernel with AVX512-BF16 reads instead of packing those blocks again (the same bytes,
// so the same bits); other kernels ignore them.
void ragged_attention(torch::Tensor q, std::vector<torch::Tensor> kv, int64_t layer,
                      torch::Tensor row_seq, torch::Tensor row_n, torch::Tensor row_off,
                      torch::Tensor slots, double scale, torch::Tensor out,
                      std::vector<torch::Tensor> tiles, torch::Tensor tiles_upto) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "q must be a contiguous [T, H, D] tensor");
  TORCH_CHECK(out.is_contiguous() && out.scalar_type() == q.scalar_type(), "bad out");
  check_caches(kv, layer, q.size(2), q.scalar_type());
  TORCH_CHECK(q.size(1) % kv[0].size(2) == 0, "heads must be a multiple of KV heads");
  const int64_t* upto = nullptr;
  if (!tiles.empty()) {
    TORCH_CHECK(tiles.size() == kv.size() && tiles_upto.scalar_type() == torch::kInt64 &&
                    tiles_upto.is_contiguous() && tiles_upto.numel() == static_cast<int64_t>(kv.size()),
                "tiles: one per KV cache, with tiles_upto an int64 [S] tensor");
    upto = tiles_upto.data_ptr<int64_t>();
    for (size_t i = 0; i < kv.size(); ++i)
      TORCH_CHECK(upto[i] == 0 || (tiles[i].sizes() == kv[i].sizes() && tiles[i].is_contiguous() &&
                                   tiles[i].scalar_type() == kv[i].scalar_type() &&
                                   upto[i] % 64 == 0 && upto[i] <= kv[i].size(3)),
                  "tiles[", i, "] must be a contiguous tensor of its cache's shape and dtype, "
                  "tiles_upto a multiple of 64 slots within it");
  }
  const int64_t* rs = row_seq.data_ptr<int64_t>();
  const int64_t* rn = row_n.data_ptr<int64_t>();
  const int64_t* ro = row_off.data_ptr<int64_t>();
  const int64_t* sl = slots.numel() ? slots.data_ptr<int64_t>() : nullptr;
  const float sc = static_cast<float>(scale);
  const std::vector<torch::Tensor> none;
  const auto& kept = upto ? tiles : none;
  switch (q.scalar_type()) {
    case torch::kFloat32: run<float>(q, kv, layer, rs, rn, ro, sl, sc, out, kept, upto); break;
    case torch::kBFloat16:
      run<c10::BFloat16>(q, kv, layer, rs, rn, ro, sl, sc, out, kept, upto);
      break;
    case torch::kFloat16: run<c10::Half>(q, kv, layer, rs, rn, ro, sl, sc, out, kept, upto); break;
    default: TORCH_CHECK(false, "unsupported dtype ", q.scalar_type());
  }
}

// Packs blocks [start, end) (multiples of 64 slots) of every layer and KV head of a
// bfloat16 cache kv [L, 2, G, C, D] into `tiles` (the same shape): keys as the attention
// kernel's key tiles, values as its value pairs, so that later forwards read them
// instead of packing them again. Only with AVX512-BF16 and D 64 or 128
// (packed_kv_available).
void pack_kv_tiles(torch::Tensor kv, torch::Tensor tiles, int64_t start, int64_t end) {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  TORCH_CHECK(kv.dim() == 5 && kv.size(1) == 2 && kv.is_contiguous() &&
                  kv.scalar_type() == torch::kBFloat16 && (kv.size(4) == 64 || kv.size(4) == 128),
              "pack_kv_tiles: a contiguous bfloat16 [L, 2, G, C, D] cache, D 64 or 128");
  TORCH_CHECK(tiles.sizes() == kv.sizes() && tiles.is_contiguous() &&
                  tiles.scalar_type() == torch::kBFloat16,
              "pack_kv_tiles: tiles must be a contiguous tensor of the cache's shape and dtype");
  TORCH_CHECK(0 <= start && start <= end && end <= kv.size(3) && start % kKeyBlock == 0 &&
                  end % kKeyBlock == 0,
              "pack_kv_tiles: start and end must be multiples of 64 slots within the cache");
  const int64_t L = kv.size(0), G = kv.size(2), C = kv.size(3), D = kv.size(4);
  const int64_t blocks = (end - start) / kKeyBlock;
  const c10::BFloat16* src = kv.data_ptr<c10::BFloat16>();
  c10::BFloat16* dst = tiles.data_ptr<c10::BFloat16>();
  at::parallel_for(0, L * 2 * G * blocks, 16, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      const int64_t head = i / blocks;  // (layer, keys or values, KV head)
      const int64_t jb = start + (i % blocks) * kKeyBlock;
      const c10::BFloat16* from = src + head * C * D;
      __m512i* to = reinterpret_cast<__m512i*>(dst + head * C * D + jb * D);
      const bool keys = (head / G) % 2 == 0;
      if (D == 64) {
        if (keys) pack_key_tiles<64>(from, nullptr, jb, jb + kKeyBlock, to);
        else pack_value_pairs<4>(from, nullptr, jb, jb + kKeyBlock, to);
      } else {
        if (keys) pack_key_tiles<128>(from, nullptr, jb, jb + kKeyBlock, to);
        else pack_value_pairs<8>(from, nullptr, jb, jb + kKeyBlock, to);
      }
    }
  });
#else
  (void)kv, (void)tiles, (void)start, (void)end;
  TORCH_CHECK(false, "pack_kv_tiles needs AVX512-BF16 (packed_kv_available)");
#endif
}

bool packed_kv_available() {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

// layer_ops.cpp
void rms_norm(torch::Tensor x, torch::Tensor w, double eps, torch::Tensor out);
void add_rms_norm(torch::Tensor x, torch::Tensor delta, torch::Tensor w, double eps,
                  torch::Tensor sum, torch::Tensor out);
void rotary_kv(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin,
               std::vector<torch::Tensor> kv, int64_t layer, torch::Tensor row_seq,
               torch::Tensor row_slot, int64_t heads, torch::Tensor q_out);
void silu_mul(torch::Tensor gate_up, torch::Tensor out);
void argmax_rows(torch::Tensor x, torch::Tensor out);
// gemm.cpp
void small_gemm(torch::Tensor x, torch::Tensor w, torch::Tensor y);
void quant_gemm(torch::Tensor x, torch::Tensor q, int64_t kind, torch::Tensor y);
void dequantize(torch::Tensor q, int64_t kind, torch::Tensor out);
// amx.cpp
bool amx_available();
void amx_gemm(torch::Tensor x, torch::Tensor packed, torch::Tensor y);
void amx_quant_gemm(torch::Tensor x, torch::Tensor tiles, int64_t kind, torch::Tensor y);
// dpbf16.cpp
bool dpbf16_available();
void dpbf16_quant_gemm(torch::Tensor x, torch::Tensor tiles, int64_t kind, torch::Tensor y);
// tiles_f32.cpp
bool f32_tiles_available();
void f32_tile_gemm(torch::Tensor x, torch::Tensor tiles, torch::Tensor y);
// q8.cpp
void q8_gemm(torch::Tensor x, torch::Tensor q, int64_t kind, torch::Tensor y);
// prompt_attention.cpp
bool prompt_attention_available();
void prompt_attention(torch::Tensor q, torch::Tensor kv, int64_t layer, int64_t start,
                      double scale, torch::Tensor out, bool amx);

// Per product of decode_layer, its kernel: quant_gemm, q8_gemm, dpbf16_quant_gemm (GGUF
// tiles, or dense bfloat16 tiles: code 2), f32_tile_gemm (dense float32 tiles) or the AMX
// products (amx_quant_gemm on GGUF tiles, codes 0 and 1; amx_gemm on dense bfloat16
// weights packed by amx_pack: code 2, as for dpbf16).
enum LayerKernel : int64_t {
  kLayerFma = 0, kLayerQ8 = 1, kLayerDpbf16 = 2, kLayerTilesF32 = 3, kLayerAmx = 4
};
constexpr int64_t kDenseCode = 2;  // the code of a dense bfloat16 matrix (dpbf16, amx)

// One decoder layer of decoding / verification rows whose four products run on specdec's
// own kernels (fma, q8, dpbf16 or amx on GGUF blocks, dpbf16, amx or f32 tiles on dense
// weights: `kernels`, LayerKernel; tiles hold whole tiles of 16 outputs), after the
// attention norm: the calls _fused_layer makes in Python
// (specdec.runtime.model), in the same order on the same functions, so the same bits,
// without a dozen Python calls and allocations per layer. Returns {x + attention output,
// MLP output} (the sum left to the next layer's add_rms_norm).
std::vector<torch::Tensor> decode_layer(
    torch::Tensor x, torch::Tensor normed, torch::Tensor cos, torch::Tensor sin,
    std::vector<torch::Tensor> kv, int64_t layer, torch::Tensor store_seq,
    torch::Tensor store_slot, torch::Tensor row_seq, torch::Tensor row_n, torch::Tensor row_off,
    torch::Tensor slots, double scale, int64_t heads, std::vector<torch::Tensor> blocks,
    std::vector<int64_t> codes, std::vector<int64_t> kernels, torch::Tensor mlp_norm, double eps,
    std::vector<torch::Tensor> tiles, torch::Tensor tiles_upto) {
  TORCH_CHECK(blocks.size() == 4 && codes.size() == 4 && kernels.size() == 4,
              "four products: qkv, o, gate_up, down");
  TORCH_CHECK(!kv.empty(), "no KV caches");
  auto product = [&](const torch::Tensor& in, int i) {
    const bool tiles = kernels[i] == kLayerDpbf16 || kernels[i] == kLayerTilesF32 ||
                       kernels[i] == kLayerAmx;
    auto y = at::empty({in.size(0), blocks[i].size(0) * (tiles ? 16 : 1)}, in.options());
    if (kernels[i] == kLayerAmx) {
      if (codes[i] == kDenseCode) {
        amx_gemm(in, blocks[i], y);
      } else {
        amx_quant_gemm(in, blocks[i], codes[i], y);
      }
    } else if (kernels[i] == kLayerDpbf16) {
      dpbf16_quant_gemm(in, blocks[i], codes[i], y);
    } else if (kernels[i] == kLayerTilesF32) {
      f32_tile_gemm(in, blocks[i], y);
    } else if (kernels[i] == kLayerQ8) {
      q8_gemm(in, blocks[i], codes[i], y);
    } else {
      quant_gemm(in, blocks[i], codes[i], y);
    }
    return y;
  };
  const int64_t T = x.size(0), D = kv[0].size(4);
  auto qkv = product(normed, 0);
  auto q = at::empty({T, heads, D}, x.options());
  rotary_kv(qkv, cos, sin, kv, layer, store_seq, store_slot, heads, q);
  auto attn = at::empty({T, heads * D}, x.options());
  ragged_attention(q, kv, layer, row_seq, row_n, row_off, slots, scale, attn, tiles, tiles_upto);
  auto o = product(attn, 1);
  auto sum = at::empty_like(x), mlp_in = at::empty_like(x);
  add_rms_norm(x, o, mlp_norm, eps, sum, mlp_in);
  auto gate_up = product(mlp_in, 2);
  auto h = at::empty({T, gate_up.size(1) / 2}, x.options());
  silu_mul(gate_up, h);
  return {sum, product(h, 3)};
}

// decode_layer over the layers `layers` in order, each after its attention norm (the
// first one's rms_norm of x, then add_rms_norm of the residual and the previous layer's
// MLP output, as NativeDecoder.forward_full calls them). Per layer i (the position in
// `layers`): blocks / codes / kernels [4 i .. 4 i + 3], attn_norms[i], mlp_norms[i].
// Returns {x, MLP output of the last layer}.
std::vector<torch::Tensor> decode_layers(
    torch::Tensor x, torch::Tensor cos, torch::Tensor sin, std::vector<torch::Tensor> kv,
    std::vector<int64_t> layers, torch::Tensor store_seq, torch::Tensor store_slot,
    torch::Tensor row_seq, torch::Tensor row_n, torch::Tensor row_off, torch::Tensor slots,
    double scale, int64_t heads, std::vector<torch::Tensor> blocks, std::vector<int64_t> codes,
    std::vector<int64_t> kernels, std::vector<torch::Tensor> attn_norms,
    std::vector<torch::Tensor> mlp_norms, double eps, std::vector<torch::Tensor> tiles,
    torch::Tensor tiles_upto) {
  const size_t L = layers.size();
  TORCH_CHECK(L > 0 && blocks.size() == 4 * L && codes.size() == 4 * L && kernels.size() == 4 * L &&
                  attn_norms.size() == L && mlp_norms.size() == L,
              "per layer: four products and two norms");
  torch::Tensor pending;
  for (size_t i = 0; i < L; ++i) {
    auto normed = at::empty_like(x);
    if (i == 0) {
      rms_norm(x, attn_norms[0], eps, normed);
    } else {
      auto sum = at::empty_like(x);
      add_rms_norm(x, pending, attn_norms[i], eps, sum, normed);
      x = sum;
    }
    auto out = decode_layer(
        x, normed, cos, sin, kv, layers[i], store_seq, store_slot, row_seq, row_n, row_off,
        slots, scale, heads, {blocks.begin() + 4 * i, blocks.begin() + 4 * i + 4},
        {codes.begin() + 4 * i, codes.begin() + 4 * i + 4},
        {kernels.begin() + 4 * i, kernels.begin() + 4 * i + 4}, mlp_norms[i], eps, tiles,
        tiles_upto);
    x = out[0];
    pending = out[1];
  }
  return {x, pending};
}

// The instruction set the kernels were built for on this machine (-march=native).
std::string simd() {
#if defined(__AVX512F__)
  return "avx512";
#elif defined(SPECDEC_AVX2)
  return "avx2";
#else
  return "portable";
#endif
}

// The compute kernels run without the Python interpreter lock, as PyTorch's own operations
// do: their arguments are converted (and kept alive by the caller) before the call, and
// they touch no Python object, so another Python thread (the server's HTTP thread, an
// overlapped drafter) runs while a forward computes.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  const auto kReleaseGil = py::call_guard<py::gil_scoped_release>();
  m.def("simd", &simd, "the instruction set of the kernels: avx512, avx2 or portable");
  m.def("rms_norm", &rms_norm, kReleaseGil, "RMSNorm of each row");
  m.def("add_rms_norm", &add_rms_norm, kReleaseGil, "residual sum, then RMSNorm of each row");
  m.def("rotary_kv", &rotary_kv, kReleaseGil,
        "rotary queries; rotary keys and values into the KV caches");
  m.def("silu_mul", &silu_mul, kReleaseGil, "silu(gate) * up");
  m.def("argmax_rows", &argmax_rows, kReleaseGil, "each float32 row's argmax, as torch.argmax");
  m.def("small_gemm", &small_gemm, kReleaseGil, "x W^T for few rows, weights streamed once");
  m.def("quant_gemm", &quant_gemm, kReleaseGil,
        "x W^T with W in GGUF blocks (Q4_1, Q8_0), expanded per call");
  m.def("dequantize", &dequantize, kReleaseGil, "GGUF blocks (Q4_1, Q8_0) to a dense matrix");
  m.def("amx_available", &amx_available, "whether amx_gemm runs here (AMX-BF16 and the tile state)");
  m.def("amx_gemm", &amx_gemm, kReleaseGil,
        "bfloat16 x W^T on AMX tiles, W packed; row-invariant for any M");
  m.def("amx_quant_gemm", &amx_quant_gemm, kReleaseGil,
        "bfloat16 x W^T on AMX tiles, W in Q4_1 / Q8_0 tiles");
  m.def("dpbf16_available", &dpbf16_available, "whether dpbf16_quant_gemm runs here (AVX512-BF16)");
  m.def("dpbf16_quant_gemm", &dpbf16_quant_gemm, kReleaseGil,
        "bfloat16 x W^T with AVX512-BF16 pair dot products, W in Q4_1 / Q8_0 tiles");
  m.def("f32_tiles_available", &f32_tiles_available, "whether f32_tile_gemm runs here (AVX-512)");
  m.def("f32_tile_gemm", &f32_tile_gemm, kReleaseGil,
        "float32 x W^T with W in tiles of 16 outputs; row-invariant for any M");
  m.def("q8_gemm", &q8_gemm, kReleaseGil,
        "x W^T with x quantized to 8 bits per block of 32, W in Q4_1 / Q8_0");
  m.def("decode_layer", &decode_layer, kReleaseGil,
        "one decoder layer of decoding rows, quantized products");
  m.def("decode_layers", &decode_layers, kReleaseGil,
        "decode_layer over several layers, with their norms");
  m.def("ragged_attention", &ragged_attention, kReleaseGil,
        "ragged attention over per-sequence KV caches");
  m.def("pack_kv_tiles", &pack_kv_tiles, kReleaseGil,
        "pack a bfloat16 KV cache's blocks as the attention kernel reads them");
  m.def("packed_kv_available", &packed_kv_available,
        "whether pack_kv_tiles and packed blocks work here (AVX512-BF16)");
  m.def("prompt_attention_available", &prompt_attention_available,
        "whether prompt_attention runs here (AVX512-BF16)");
  m.def("prompt_attention", &prompt_attention, kReleaseGil,
        "causal attention of a prompt chunk over a bfloat16 KV cache, in blocks");
}
