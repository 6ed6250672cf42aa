// Causal attention of a prompt chunk over a bfloat16 KV cache, in blocks, on AVX512-BF16
// pair dot products (specdec native runtime; see specdec/runtime/kernels.py,
// prompt_attention, and the prefill plan in specdec/runtime/prefill.py, which chooses it
// by measurement).
//
// Row i of the chunk (position start + i) sees slots 0 .. start + i. Per (row, head), the
// keys are taken in blocks of kKeys positions from slot 0 (FlashAttention's online softmax,
// Dao et al. 2022, Algorithm 1, one row at a time):
//   s_j = scale * <q, k_j>          VDPBF16PS: lane l of a 16-key tile sums the exact
//                                    products of pairs d = 2p, 2p + 1, p = 0 .. d/2 - 1 in
//                                    order, into float32
//   m'  = max(m, max_j s_j),  a = exp(m - m'),  p_j = exp(s_j - m')  (0 past the row's keys)
//   l   = a l + sum_j p_j            float32, the block's sum in a fixed tree
//   o   = a o + sum_j bf16(p_j) v_j  VDPBF16PS again: lane d sums pairs of keys (j, j + 1)
//   out = bf16(o / l)
// The probabilities are rounded to bfloat16 for the value sum, as PyTorch's CPU
// scaled_dot_product_attention does for bfloat16 inputs (its flash kernel's reduced-
// precision P); the normalizer sums them in float32. exp is common.h's exp16.
//
// Every step of a row reads that row's query and its own keys, in blocks aligned to slot 0,
// so a row gets the same bits whatever chunk, task or thread computes it (a prompt split
// into other chunks gives the same bits too). What is shared is only the memory traffic:
// a block of keys and values is packed once (keys as 16-key tiles of pairs, values as
// pairs of keys) and then read from L1 by every row of the task (up to 64 positions x the
// query heads of one KV head).
//
// Why: a long prompt's attention is compute-bound, and PyTorch's flash kernel runs its
// bfloat16 products at about a quarter of this CPU's VDPBF16PS peak (measured on a 2-core
// AMD EPYC Zen 4, SmolLM2-135M, an 8k prompt in chunks of 2048: 18 of its 23 s of prefill
// in scaled_dot_product_attention, about 120 GFLOP/s).
#include "amx_tiles.h"
#include "common.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <vector>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__) && \
    defined(__AVX512BF16__) && defined(__AVX512VBMI__)
#define SPECDEC_AMX_ATTENTION 1
#endif

bool amx_available();  // amx.cpp: the CPU has AMX-BF16 and Linux lets this process use it

namespace {

using namespace specdec;

#if defined(__AVX512BF16__)

constexpr int64_t kKeys = 64;        // keys per block: 4 tiles of 16
constexpr int kTiles = kKeys / 16;
// Chunk positions per task: the most of 64, 32, 16 that still gives every thread at least 4
// tasks (measured on the Zen 4, 2048 rows after 6144 cached: 16 positions 129 ms, 32 119,
// 64 116; more rows read each packed block).
constexpr int64_t kMaxPositions = 64;
inline int64_t positions_per_task(int64_t T, int64_t G, int64_t threads) {
  for (int64_t p = kMaxPositions; p > 16; p /= 2)
    if (G * ((T + p - 1) / p) >= 4 * threads) return p;
  return 16;
}

inline __m512bh as_bh(__m512i v) { return reinterpret_cast<__m512bh>(v); }

inline __m512i bcast_pair(const c10::BFloat16* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return _mm512_set1_epi32(v);
}

// Keys j0 .. j0 + 63 of K ([C, D], D contiguous) as out[p * kTiles + t] = 16 dwords, lane l
// holding key j0 + 16 t + l's pair (2p, 2p + 1); keys at or past `end` are zeros.
template <int D>
void pack_keys(const c10::BFloat16* K, int64_t j0, int64_t end, __m512i* out) {
  const __m512i index = _mm512_mullo_epi32(
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
      _mm512_set1_epi32(D / 2));
  for (int t = 0; t < kTiles; ++t) {
    const int64_t first = j0 + 16 * t;
    const int64_t valid = std::clamp<int64_t>(end - first, 0, 16);
    const __mmask16 mask = static_cast<__mmask16>((1u << valid) - 1u);
    const int* base = reinterpret_cast<const int*>(K + first * D);
    for (int p = 0; p < D / 2; ++p) {
      out[p * kTiles + t] = valid == 16
          ? _mm512_i32gather_epi32(index, base + p, 4)
          : (valid == 0 ? _mm512_setzero_si512()
                        : _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), mask, index,
                                                      base + p, 4));
    }
  }
}

// Values j0 .. j0 + 63 of V ([C, D]) as out[jp * (D / 16) + v] = 16 dwords, lane l holding
// (V[j0 + 2 jp][16 v + l], V[j0 + 2 jp + 1][16 v + l]); keys at or past `end` are zeros.
template <int D>
void pack_values(const c10::BFloat16* V, int64_t j0, int64_t end, __m512i* out) {
  constexpr int NV = D / 16;
  for (int jp = 0; jp < kKeys / 2; ++jp) {
    const int64_t j = j0 + 2 * jp;
    for (int v = 0; v < NV; ++v) {
      const __m512i a = j < end
          ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(V + j * D + 16 * v)))
          : _mm512_setzero_si512();
      const __m512i b = j + 1 < end
          ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(V + (j + 1) * D + 16 * v)))
          : _mm512_setzero_si512();
      out[jp * NV + v] = _mm512_or_si512(a, _mm512_slli_epi32(b, 16));
    }
  }
}

// One row's running state.
struct RowState {
  const c10::BFloat16* q;  // [D]
  int64_t n;               // keys the row sees (slots 0 .. n - 1)
  float m, l;
  float* o;                // [D] float32
};

// One row's online-softmax step over a block's scores s[kTiles] (raw dot products, scaled
// here): the bfloat16 probabilities to probs (kKeys values, 0 past the row's keys), m and l
// updated; returns a = exp(m - m') (0 on the row's first block, m = -inf).
inline float softmax_row(RowState& row, __m512* s, int64_t j0, float scale, void* probs) {
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __mmask16 valid[kTiles];
  __m512 mx = _mm512_set1_ps(-INFINITY);
  for (int t = 0; t < kTiles; ++t) {
    const __m512i key = _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int>(j0 + 16 * t)));
    valid[t] = _mm512_cmplt_epi32_mask(key, _mm512_set1_epi32(static_cast<int>(row.n)));
    s[t] = _mm512_mul_ps(s[t], _mm512_set1_ps(scale));
    mx = _mm512_mask_max_ps(mx, valid[t], mx, s[t]);
  }
  const float m_new = std::max(row.m, _mm512_reduce_max_ps(mx));
  const __m512 mv = _mm512_set1_ps(m_new);
  __m512 pt[kTiles];
  for (int t = 0; t < kTiles; ++t)
    pt[t] = _mm512_maskz_mov_ps(valid[t], exp16(_mm512_sub_ps(s[t], mv)));
  const float sum = _mm512_reduce_add_ps(
      _mm512_add_ps(_mm512_add_ps(pt[0], pt[1]), _mm512_add_ps(pt[2], pt[3])));
  const float a =
      row.m == -INFINITY ? 0.f : _mm512_cvtss_f32(exp16(_mm512_set1_ps(row.m - m_new)));
  row.l = row.l * a + sum;
  row.m = m_new;
  auto* out = static_cast<char*>(probs);
  for (int t = 0; t < kTiles; t += 2)
    _mm512_storeu_si512(out + 32 * t, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(pt[t + 1], pt[t])));
  return a;
}

// The first of a task's rows that sees keys from slot j0 on: rows are in position order, so
// those that see a block are a suffix.
inline int64_t first_seeing(const RowState* rows, int64_t nrows, int64_t j0) {
  int64_t first = 0;
  while (first < nrows && rows[first].n <= j0) ++first;
  return first;
}

// RG rows against one packed block of keys (j0): scores, online softmax, value sums.
template <int D, int RG>
void rows_block(RowState* rows, const __m512i* kp, const __m512i* vp, int64_t j0, float scale) {
  constexpr int NV = D / 16;
  __m512 s[RG][kTiles];
  for (int r = 0; r < RG; ++r)
    for (int t = 0; t < kTiles; ++t) s[r][t] = _mm512_setzero_ps();
  for (int p = 0; p < D / 2; ++p) {
    __m512i k[kTiles];
    for (int t = 0; t < kTiles; ++t) k[t] = kp[p * kTiles + t];
    for (int r = 0; r < RG; ++r) {
      const __m512bh qb = as_bh(bcast_pair(rows[r].q + 2 * p));
      for (int t = 0; t < kTiles; ++t) s[r][t] = _mm512_dpbf16_ps(s[r][t], qb, as_bh(k[t]));
    }
  }
  alignas(64) uint32_t probs[RG][kKeys / 2];  // bf16(p_j) pairs
  float alpha[RG];
  for (int r = 0; r < RG; ++r) alpha[r] = softmax_row(rows[r], s[r], j0, scale, probs[r]);
  __m512 o[RG][NV];
  for (int r = 0; r < RG; ++r) {
    const __m512 av = _mm512_set1_ps(alpha[r]);
    for (int v = 0; v < NV; ++v) o[r][v] = _mm512_mul_ps(_mm512_loadu_ps(rows[r].o + 16 * v), av);
  }
  for (int jp = 0; jp < kKeys / 2; ++jp) {
    __m512i vv[NV];
    for (int v = 0; v < NV; ++v) vv[v] = vp[jp * NV + v];
    for (int r = 0; r < RG; ++r) {
      const __m512bh pb = as_bh(_mm512_set1_epi32(static_cast<int>(probs[r][jp])));
      for (int v = 0; v < NV; ++v) o[r][v] = _mm512_dpbf16_ps(o[r][v], pb, as_bh(vv[v]));
    }
  }
  for (int r = 0; r < RG; ++r)
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(rows[r].o + 16 * v, o[r][v]);
}

// A task's rows (position-major, head-minor: row i is position t0 + i / R, head g R + i % R)
// as out = bf16(o / l) into op ([T, H * D]).
template <int D>
void write_rows(const RowState* rows, int64_t nrows, int64_t t0, int64_t R, int64_t g,
                int64_t H, c10::BFloat16* op) {
  for (int64_t i = 0; i < nrows; ++i) {
    const int64_t t = t0 + i / R, h = g * R + i % R;
    const __m512 inv = _mm512_set1_ps(1.f / rows[i].l);
    c10::BFloat16* o = op + (t * H + h) * D;
    for (int v = 0; v < D / 16; ++v)
      store16(o + 16 * v, _mm512_mul_ps(_mm512_loadu_ps(rows[i].o + 16 * v), inv));
  }
}

template <int D>
void run(const c10::BFloat16* qp, const c10::BFloat16* kv, int64_t T, int64_t H, int64_t G,
         int64_t C, int64_t start, float scale, c10::BFloat16* op) {
  constexpr int NV = D / 16;
  constexpr int RG = NV <= 4 ? 4 : 2;  // rows per pass: scores and sums stay in registers
  const int64_t R = H / G;             // query heads per KV head
  const int64_t positions = positions_per_task(T, G, at::get_num_threads());
  const int64_t blocks = (T + positions - 1) / positions;
  const int64_t ntasks = blocks * G;
  std::atomic<int64_t> next{0};
  // tasks largest first: the last positions' blocks see the most keys
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    std::vector<__m512i> kp(D / 2 * kTiles), vp(kKeys / 2 * NV);
    std::vector<float> acc(positions * R * D);
    std::vector<RowState> rows(positions * R);
    for (int64_t task; (task = next.fetch_add(1)) < ntasks;) {
      const int64_t b = blocks - 1 - task / G, g = task % G;
      const int64_t t0 = b * positions, t1 = std::min(T, t0 + positions);
      const c10::BFloat16* K = kv + g * C * D;
      const c10::BFloat16* V = kv + (G + g) * C * D;
      int64_t nrows = 0;
      for (int64_t t = t0; t < t1; ++t)
        for (int64_t h = 0; h < R; ++h) {
          rows[nrows] = {qp + (t * H + g * R + h) * D, start + t + 1, -INFINITY, 0.f,
                         acc.data() + nrows * D};
          ++nrows;
        }
      std::fill(acc.begin(), acc.begin() + nrows * D, 0.f);
      const int64_t end = start + t1;  // keys of the task's last row
      for (int64_t j0 = 0; j0 < end; j0 += kKeys) {
        pack_keys<D>(K, j0, end, kp.data());
        pack_values<D>(V, j0, end, vp.data());
        const int64_t first = first_seeing(rows.data(), nrows, j0);
        int64_t r = first;
        for (; r + RG <= nrows; r += RG) rows_block<D, RG>(&rows[r], kp.data(), vp.data(), j0, scale);
        for (; r < nrows; ++r) rows_block<D, 1>(&rows[r], kp.data(), vp.data(), j0, scale);
      }
      write_rows<D>(rows.data(), nrows, t0, R, g, H, op);
    }
  });
}

#if defined(SPECDEC_AMX_ATTENTION)
// The same attention with both products on AMX tiles (TDPBF16PS, 16 x 16 x 32 multiply-adds
// per instruction), for CPUs with AMX-BF16. Per block of 64 keys and tile of 16 rows:
//   scores: C tiles 0-3 (16 rows x 16 keys each) = sum over the D / 32 A tiles of the rows'
//     queries (tile 4) . the B tiles of the packed keys (tiles 5, 6): pack_keys' layout is
//     AMX's B layout (16 pairs of dimensions x 16 keys), read with a stride of 4 tiles;
//   the online softmax, row by row on AVX-512 (softmax_row, as the pair kernel runs it:
//     scale, mask, max, exp16, the block's sum, a = exp(m - m')), probabilities rounded to
//     bfloat16 into an A tile per 32 keys;
//   values: C tiles (16 rows x 16 dimensions) = the 2 probability tiles . the B tiles of
//     the packed values (pack_values' layout is the B layout: 16 pairs of keys x 16
//     dimensions), then o = a o + C in float32.
// TDPBF16PS computes an element of C from one row of A and one column of B, so a row's
// bits depend only on its query and its keys, in blocks aligned to slot 0, as in the
// AVX512-BF16 kernel (not the same bits as that kernel: the instruction sums its pairs in
// its own order). Rows that do not see a block skip it.
//
// Source: Intel SDM vol. 2, TDPBF16PS; FlashAttention (Dao et al. 2022), Algorithm 1.
constexpr int64_t kTileBytes = 64;  // bytes per tile row

// C tiles 0-3 = sum over `steps` of A tile a + i a_step (rows a_stride bytes apart) . B
// tiles b + i b_step + t (t = 0..3, rows b_stride bytes apart), stored as 16 rows x 64
// float32 columns at out (row stride ld floats). The scores of a row tile against a block
// of 64 keys (A: the queries, one tile per 32 dimensions; B: the packed keys) and its value
// sums for 64 dimensions (A: the probabilities, one tile per 32 keys; B: the packed values)
// are both this product.
inline void tile_product(const c10::BFloat16* a, int64_t a_step, int64_t a_stride,
                         const __m512i* b, int64_t b_step, int64_t b_stride, int steps,
                         float* out, int64_t ld) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int i = 0; i < steps; ++i) {
    _tile_loadd(4, a + i * a_step, a_stride);
    const __m512i* bi = b + i * b_step;
    _tile_loadd(5, bi + 0, b_stride);
    _tile_dpbf16ps(0, 4, 5);
    _tile_loadd(6, bi + 1, b_stride);
    _tile_dpbf16ps(1, 4, 6);
    _tile_loadd(5, bi + 2, b_stride);
    _tile_dpbf16ps(2, 4, 5);
    _tile_loadd(6, bi + 3, b_stride);
    _tile_dpbf16ps(3, 4, 6);
  }
  _tile_stored(0, out + 0, ld * 4);
  _tile_stored(1, out + 16, ld * 4);
  _tile_stored(2, out + 32, ld * 4);
  _tile_stored(3, out + 48, ld * 4);
}

template <int D>
void run_amx(const c10::BFloat16* qp, const c10::BFloat16* kv, int64_t T, int64_t H, int64_t G,
             int64_t C, int64_t start, float scale, c10::BFloat16* op) {
  constexpr int NV = D / 16;
  const int64_t R = H / G;
  const int64_t positions = positions_per_task(T, G, at::get_num_threads());
  const int64_t blocks = (T + positions - 1) / positions;
  const int64_t ntasks = blocks * G;
  const int64_t max_tiles = (positions * R + 15) / 16;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    configure_tiles();
    std::vector<__m512i> kp(D / 2 * kTiles), vp(kKeys / 2 * NV);
    std::vector<float> acc(max_tiles * 16 * D);
    std::vector<RowState> rows(max_tiles * 16);
    // the task's queries as A tiles: [tile][D / 32][16 rows][32], rows past the task zero
    std::vector<c10::BFloat16> qa(max_tiles * 16 * D);
    // per block: every row tile's scores, then every row's softmax, then every row tile's
    // value sums (each phase back to back on its unit, not one tile's latency at a time)
    std::vector<float> s(max_tiles * 16 * kKeys), ob(max_tiles * 16 * D), alpha(max_tiles * 16);
    std::vector<c10::BFloat16> pb(max_tiles * 16 * kKeys);
    for (int64_t task; (task = next.fetch_add(1)) < ntasks;) {
      const int64_t b = blocks - 1 - task / G, g = task % G;
      const int64_t t0 = b * positions, t1 = std::min(T, t0 + positions);
      const c10::BFloat16* K = kv + g * C * D;
      const c10::BFloat16* V = kv + (G + g) * C * D;
      const int64_t nrows = (t1 - t0) * R, ntiles = (nrows + 15) / 16;
      std::fill(qa.begin(), qa.begin() + ntiles * 16 * D, c10::BFloat16(0.f));
      for (int64_t i = 0; i < nrows; ++i) {
        const int64_t t = t0 + i / R, h = g * R + i % R;
        rows[i] = {qp + (t * H + h) * D, start + t + 1, -INFINITY, 0.f, acc.data() + i * D};
        const int64_t tile = i / 16, r = i % 16;
        for (int kb = 0; kb < D / 32; ++kb)
          std::memcpy(qa.data() + ((tile * (D / 32) + kb) * 16 + r) * 32, rows[i].q + kb * 32, 64);
      }
      std::fill(acc.begin(), acc.begin() + nrows * D, 0.f);
      // rows past the task's last one: zero probabilities in its last tile
      std::fill(pb.begin() + nrows * kKeys, pb.begin() + ntiles * 16 * kKeys, c10::BFloat16(0.f));
      const int64_t end = start + t1;  // keys of the task's last row
      for (int64_t j0 = 0; j0 < end; j0 += kKeys) {
        pack_keys<D>(K, j0, end, kp.data());
        pack_values<D>(V, j0, end, vp.data());
        const int64_t first = first_seeing(rows.data(), nrows, j0);
        const int64_t tile0 = first / 16;
        for (int64_t tile = tile0; tile < ntiles; ++tile)
          // scores: per 32 dimensions kb, the queries' A tile and pack_keys' rows 16 kb ..
          // 16 kb + 15 (pairs of dimensions) of each 16-key tile
          tile_product(qa.data() + tile * 16 * D, 16 * 32, kTileBytes, kp.data(), 16 * kTiles,
                       kTiles * kTileBytes, D / 32, s.data() + tile * 16 * kKeys, kKeys);
        for (int64_t i = tile0 * 16; i < first; ++i)  // in a tile that sees it, not seeing it
          std::fill(pb.begin() + i * kKeys, pb.begin() + (i + 1) * kKeys, c10::BFloat16(0.f));
        for (int64_t i = first; i < nrows; ++i) {
          __m512 st[kTiles];
          for (int t = 0; t < kTiles; ++t) st[t] = _mm512_loadu_ps(s.data() + i * kKeys + 16 * t);
          alpha[i] = softmax_row(rows[i], st, j0, scale, pb.data() + i * kKeys);
        }
        for (int64_t tile = tile0; tile < ntiles; ++tile)
          for (int v0 = 0; v0 < NV; v0 += 4)
            // value sums: per 32 keys kk, the probabilities' A tile and pack_values' rows
            // 16 kk .. 16 kk + 15 (pairs of keys) of dimension tiles v0 .. v0 + 3
            tile_product(pb.data() + tile * 16 * kKeys, 32, kKeys * 2, vp.data() + v0, 16 * NV,
                         NV * kTileBytes, 2, ob.data() + tile * 16 * D + 16 * v0, D);
        for (int64_t i = first; i < nrows; ++i) {
          const __m512 av = _mm512_set1_ps(alpha[i]);
          float* o = rows[i].o;
          const float* c = ob.data() + i * D;
          for (int v = 0; v < NV; ++v)
            _mm512_storeu_ps(o + 16 * v, _mm512_fmadd_ps(_mm512_loadu_ps(o + 16 * v), av,
                                                         _mm512_loadu_ps(c + 16 * v)));
        }
      }
      write_rows<D>(rows.data(), nrows, t0, R, g, H, op);
    }
    _tile_release();
  });
}
#endif  // SPECDEC_AMX_ATTENTION

#endif  // __AVX512BF16__

}  // namespace

// Whether prompt_attention runs here (built for a CPU with AVX512-BF16).
bool prompt_attention_available() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

// q: [T, H, D] bfloat16 contiguous, the chunk's queries (rotary applied); kv: [L, 2, G, C, D]
// bfloat16 contiguous, the sequence's cache with the chunk's keys and values already at
// slots start .. start + T - 1 (layer `layer` is read); out: [T, H * D] bfloat16; amx: both
// products on AMX tiles (run_amx; the CPU must have AMX-BF16), else on VDPBF16PS (run).
void prompt_attention(torch::Tensor q, torch::Tensor kv, int64_t layer, int64_t start,
                      double scale, torch::Tensor out, bool amx) {
  TORCH_CHECK(prompt_attention_available(), "AVX512-BF16 is not available here");
  TORCH_CHECK(!amx || amx_available(), "AMX bfloat16 tiles are not available on this machine");
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous() && q.scalar_type() == torch::kBFloat16,
              "q must be a contiguous bfloat16 [T, H, D] tensor");
  TORCH_CHECK(kv.dim() == 5 && kv.size(1) == 2 && kv.is_contiguous() &&
                  kv.scalar_type() == torch::kBFloat16 && kv.size(4) == q.size(2) &&
                  layer >= 0 && layer < kv.size(0),
              "kv must be a contiguous bfloat16 [L, 2, G, C, D] tensor with q's D");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), G = kv.size(2), C = kv.size(3);
  TORCH_CHECK(H % G == 0, "heads must be a multiple of KV heads");
  TORCH_CHECK(start >= 0 && start + T <= C, "the chunk's slots must lie in the cache");
  TORCH_CHECK(out.is_contiguous() && out.scalar_type() == torch::kBFloat16 && out.dim() == 2 &&
                  out.size(0) == T && out.size(1) == H * D,
              "out must be a contiguous bfloat16 [T, H * D] tensor");
  TORCH_CHECK(D == 64 || D == 128, "head_dim must be 64 or 128, got ", D);
#if defined(__AVX512BF16__)
  if (T == 0) return;
  const auto* qp = q.data_ptr<c10::BFloat16>();
  const auto* kp = kv.data_ptr<c10::BFloat16>() + layer * 2 * G * C * D;
  auto* op = out.data_ptr<c10::BFloat16>();
  const float sc = static_cast<float>(scale);
#if defined(SPECDEC_AMX_ATTENTION)
  if (amx) {
    if (D == 64) run_amx<64>(qp, kp, T, H, G, C, start, sc, op);
    else run_amx<128>(qp, kp, T, H, G, C, start, sc, op);
    return;
  }
#endif
  if (D == 64) {
    run<64>(qp, kp, T, H, G, C, start, sc, op);
  } else {
    run<128>(qp, kp, T, H, G, C, start, sc, op);
  }
#endif
}
