// The bf16 product paths of the CPU paged attention (paged_attention.cpp) for the many-row
// items of a bf16 cache: VDPBF16PS dot products (OI_DPBF16) and AMX tiles
// (OI_AMX_ATTENTION), on operands packed as 32-bit pairs of bf16. Included by
// paged_attention.cpp only.
#pragma once

#include "amx.h"
#include "attention_tiles.h"

namespace oi_attention {

#if defined(__AVX512BF16__) && OI_VEC_WIDTH == 16
// bfloat16 dot products (VDPBF16PS: 16 lanes, each += a[2i] b[2i] + a[2i+1] b[2i+1] in fp32)
// for the many-row items of a bf16 cache: Q . K^T over pairs of D, P . V over pairs of keys,
// on operands packed as 32-bit pairs of bf16 (a pair is one broadcastable lane). Twice the
// products per instruction of fp32 FMAs, and K/V blocks are packed rather than widened.
// P is rounded to bf16 for P . V (as torch's CPU flash attention does for bf16); the softmax
// itself (max, exp, running sum) stays fp32.
#define OI_DPBF16 1

inline __m512 dp(__m512 acc, uint32_t a_pair, __m512i b_pairs) {
  return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_set1_epi32(int(a_pair)), (__m512bh)b_pairs);
}
inline __m512i load_pairs(const uint32_t* p) { return _mm512_loadu_si512(p); }

// S[r][0 .. NK*16) = scale * (Q[r] . Kt) for R rows: Q as [R][DP] pairs of D, Kt as [DP][bsp]
// pairs of D per key (transpose_keys on the block's rows read as 32-bit words).
template <int R, int NK>
inline void score_tile_bf16(const uint32_t* __restrict q, int DP, const uint32_t* __restrict kt,
                            int bsp, float scale, float* __restrict s, int s_stride) {
  __m512 acc[R][NK];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NK; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int d = 0; d < DP; ++d) {
    __m512i k[NK];
#pragma GCC unroll 4
    for (int v = 0; v < NK; ++v) k[v] = load_pairs(kt + d * bsp + v * W);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
      for (int v = 0; v < NK; ++v) acc[r][v] = dp(acc[r][v], q[r * DP + d], k[v]);
  }
  const __m512 sc = _mm512_set1_ps(scale);
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NK; ++v) _mm512_storeu_ps(s + r * s_stride + v * W, _mm512_mul_ps(acc[r][v], sc));
}

// Kt rows are bsp pairs apart; scores are taken for its first `keys` columns (a multiple of W).
template <int R>
inline void score_rows_bf16(const uint32_t* q, int DP, const uint32_t* kt, int bsp, float scale, float* s,
                            int s_stride, int keys) {
  int v = 0;
  for (; v + QK_VECS <= keys / W; v += QK_VECS)
    score_tile_bf16<R, QK_VECS>(q, DP, kt + v * W, bsp, scale, s + v * W, s_stride);
  for (; v < keys / W; ++v) score_tile_bf16<R, 1>(q, DP, kt + v * W, bsp, scale, s + v * W, s_stride);
}

template <int R>
inline void score_tail_bf16(int rows, const uint32_t* q, int DP, const uint32_t* kt, int bsp, float scale,
                            float* s, int s_stride, int keys) {
  if constexpr (R > 0) {
    if (rows == R)
      score_rows_bf16<R>(q, DP, kt, bsp, scale, s, s_stride, keys);
    else
      score_tail_bf16<R - 1>(rows, q, DP, kt, bsp, scale, s, s_stride, keys);
  }
}

// keys < 0: all bsp columns.
inline void scores_bf16(int rows, const uint32_t* q, int DP, const uint32_t* kt, int bsp, float scale, float* s,
                        int s_stride, int keys = -1) {
  if (keys < 0) keys = bsp;
  int r = 0;
  for (; r + QK_ROWS <= rows; r += QK_ROWS)
    score_rows_bf16<QK_ROWS>(q + r * DP, DP, kt, bsp, scale, s + r * s_stride, s_stride, keys);
  score_tail_bf16<QK_ROWS - 1>(rows - r, q + r * DP, DP, kt, bsp, scale, s + r * s_stride, s_stride, keys);
}

// V rows 2j and 2j + 1 of a block (n valid) interleaved into vp[j][D] pairs; the partner of
// an odd last key is 0 (its p is 0 too): keys past n are never read.
inline void pack_value_pairs(const c10::BFloat16* v, int64_t stride, int n, int D, uint32_t* vp) {
  for (int j = 0; 2 * j < n; ++j) {
    const c10::BFloat16* a = v + 2 * j * stride;
    for (int d = 0; d < D; d += W) {
      __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + d)));
      __m512i hi = _mm512_setzero_si512();
      if (2 * j + 1 < n)
        hi = _mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + stride + d))), 16);
      _mm512_storeu_si512(vp + j * D + d, _mm512_or_si512(lo, hi));
    }
  }
}

// 2^t for the softmax of the bf16 products, whose probabilities are rounded to bf16 (8 bits):
// t = n + f (n an integer, |f| <= 1/2), a degree-3 polynomial for 2^f (minimax for the relative
// error, < 7.6e-5: 50 times below bf16's rounding; degree 5 ran prefills 1.03-1.04x slower),
// scaled by 2^n in one VSCALEFPS. Exactly 0 for t below -125 (a masked score's -inf among them),
// by a mask rather than by underflow: results in the denormal range cost a microcode assist
// each (a masked diagonal chunk made the whole kernel 1.2x slower).
inline __m512 exp2_for_bf16(__m512 t) {
  const __mmask16 normal = _mm512_cmp_ps_mask(t, _mm512_set1_ps(-125.f), _CMP_GE_OQ);
  t = _mm512_max_ps(t, _mm512_set1_ps(-126.f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(5.51710948e-2f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.42609993e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.93260968e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.99928117e-1f));
  return _mm512_maskz_scalef_ps(normal, p, n);
}

// One row's probabilities of a chunk for the bf16 products: p = e^(scale * s - m) from its
// scores, written to `pb` rounded to bf16 (what P . V reads); returns their sum in fp32.
inline float probabilities_bf16(const float* s, int width, float scale, float m, c10::BFloat16* pb) {
  constexpr float LOG2E = 1.44269504f;
  const __m512 a = _mm512_set1_ps(scale * LOG2E), b = _mm512_set1_ps(m * LOG2E);
  __m512 sum = _mm512_setzero_ps();
  for (int k = 0; k < width; k += W) {
    const __m512 p = exp2_for_bf16(_mm512_fmsub_ps(_mm512_loadu_ps(s + k), a, b));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(pb + k), (__m256i)_mm512_cvtneps_pbh(p));
    sum = _mm512_add_ps(sum, p);
  }
  return _mm512_reduce_add_ps(sum);
}

// O[r][d0 .. d0 + NV*16) += sum_j P[r][pair j] . V[pair j][d0 ..] for R rows over np key pairs:
// P rows as pairs with a stride of p_stride pairs.
template <int R, int NV>
inline void pv_tile_bf16(const uint32_t* __restrict p, int p_stride, const uint32_t* __restrict vp, int np,
                         float* __restrict o, int D) {
  __m512 acc[R][NV];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < NV; ++c) acc[r][c] = _mm512_loadu_ps(o + r * D + c * W);
  for (int j = 0; j < np; ++j) {
    __m512i x[NV];
#pragma GCC unroll 4
    for (int c = 0; c < NV; ++c) x[c] = load_pairs(vp + j * D + c * W);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
      for (int c = 0; c < NV; ++c) acc[r][c] = dp(acc[r][c], p[r * p_stride + j], x[c]);
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < NV; ++c) _mm512_storeu_ps(o + r * D + c * W, acc[r][c]);
}

template <int R>
inline void pv_rows_bf16(const uint32_t* p, int p_stride, const uint32_t* vp, int np, float* o, int D) {
  int d = 0;
  for (; d + PV_VECS * W <= D; d += PV_VECS * W) pv_tile_bf16<R, PV_VECS>(p, p_stride, vp + d, np, o + d, D);
  for (; d < D; d += W) pv_tile_bf16<R, 1>(p, p_stride, vp + d, np, o + d, D);
}

template <int R>
inline void pv_tail_bf16(int rows, const uint32_t* p, int p_stride, const uint32_t* vp, int np, float* o,
                         int D) {
  if constexpr (R > 0) {
    if (rows == R)
      pv_rows_bf16<R>(p, p_stride, vp, np, o, D);
    else
      pv_tail_bf16<R - 1>(rows, p, p_stride, vp, np, o, D);
  }
}

inline void accumulate_pv_bf16(int rows, const uint32_t* p, int p_stride, const uint32_t* vp, int np, float* o,
                               int D) {
  int r = 0;
  for (; r + PV_ROWS <= rows; r += PV_ROWS)
    pv_rows_bf16<PV_ROWS>(p + r * p_stride, p_stride, vp, np, o + r * D, D);
  pv_tail_bf16<PV_ROWS - 1>(rows - r, p + r * p_stride, p_stride, vp, np, o + r * D, D);
}

#ifdef OI_HAVE_SHUFFLEVECTOR  // (sum4, sum8)
#define OI_ROWDOT_BF16 1
// The few-row items (decode) of a bf16 cache read each K/V row once for a handful of query rows,
// so nothing may be packed or transposed ahead; their products go on the rows in place instead:
// - scores as VDPBF16PS dot products of a K row's 32-value vectors (pairs of D) with the query
//   row's, summed across lanes afterwards: two instructions per 32 values of a row, where the
//   fp32 FMAs took two widening loads, two shifts and two FMAs;
// - P . V with fp32 P on each V vector split into its even and odd values (a shift and a mask, no
//   widening shuffle), so O is kept as [even | odd] halves per 32 values of D ("split" layout)
//   until unsplit_rows restores it. D a multiple of 32.
inline __m512 dp_vec(__m512 acc, __m512i a, __m512i b) { return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b); }
inline __m512i load_bf16x32(const c10::BFloat16* p) { return _mm512_loadu_si512(p); }

// [sum(acc[0]), ..., sum(acc[7])]: a tree of 3-instruction steps (a blend, a two-source permute and
// an add), each halving the vectors and doubling the keys per vector, then one add of lane pairs:
// 24 instructions, 9 of them shuffles, where summing 4 accumulators at a time took 40 with 24.
inline __m256 sum8_dp(const __m512* acc) {
  // Step 1 (keys a, b): [a.lo256 + a.hi256 | b.lo256 + b.hi256].
  auto halves = [](__m512 a, __m512 b) {
    const __m512i idx = _mm512_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23);
    return _mm512_add_ps(_mm512_mask_blend_ps(0xFF00, a, b), _mm512_permutex2var_ps(a, idx, b));
  };
  // Step 2: quarters of (x = [a | b], y = [c | d]) -> [a, c, b, d] with 4 partial sums each.
  auto quarters = [](__m512 x, __m512 y) {
    const __m512i idx = _mm512_setr_epi32(4, 5, 6, 7, 16, 17, 18, 19, 12, 13, 14, 15, 24, 25, 26, 27);
    return _mm512_add_ps(_mm512_mask_blend_ps(0xF0F0, x, y), _mm512_permutex2var_ps(x, idx, y));
  };
  // Step 3: within each quarter, lanes 0-1 from x's key and 2-3 from y's, 2 partial sums each.
  auto pairs = [](__m512 x, __m512 y) {
    const __m512i idx = _mm512_setr_epi32(2, 3, 16, 17, 6, 7, 20, 21, 10, 11, 24, 25, 14, 15, 28, 29);
    return _mm512_add_ps(_mm512_mask_blend_ps(0xCCCC, x, y), _mm512_permutex2var_ps(x, idx, y));
  };
  const __m512 w = pairs(quarters(halves(acc[0], acc[1]), halves(acc[2], acc[3])),
                         quarters(halves(acc[4], acc[5]), halves(acc[6], acc[7])));
  // w's quarters hold keys (0, 4), (2, 6), (1, 5), (3, 7), two lanes each.
  const __m512i even = _mm512_setr_epi32(0, 8, 4, 12, 2, 10, 6, 14, 0, 0, 0, 0, 0, 0, 0, 0);
  const __m512i odd = _mm512_setr_epi32(1, 9, 5, 13, 3, 11, 7, 15, 0, 0, 0, 0, 0, 0, 0, 0);
  return _mm512_castps512_ps256(_mm512_add_ps(_mm512_permutexvar_ps(even, w), _mm512_permutexvar_ps(odd, w)));
}

// S[r][k] = scale * Q[r] . K[k] for `rows` rows (bf16, row stride D) and n keys (rows of k_stride).
inline void scores_rowdot_bf16(int rows, const c10::BFloat16* __restrict q, int D, const c10::BFloat16* __restrict k,
                               int64_t k_stride, int n, float scale, float* __restrict s, int s_stride) {
  const __m256 sc = _mm256_set1_ps(scale);
  int r = 0;
  // Two rows x 8 keys: each K vector loaded once for both rows.
  for (; r + 2 <= rows; r += 2) {
    const c10::BFloat16* qa = q + r * D;
    const c10::BFloat16* qb = qa + D;
    float* sa = s + r * s_stride;
    float* sb = sa + s_stride;
    int k0 = 0;
    for (; k0 + 8 <= n; k0 += 8) {
      __m512 acc_a[8], acc_b[8];
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i) acc_a[i] = acc_b[i] = _mm512_setzero_ps();
      for (int d = 0; d < D; d += 32) {
        const __m512i xa = load_bf16x32(qa + d), xb = load_bf16x32(qb + d);
#pragma GCC unroll 8
        for (int i = 0; i < 8; ++i) {
          const __m512i kv = load_bf16x32(k + (k0 + i) * k_stride + d);
          acc_a[i] = dp_vec(acc_a[i], kv, xa);
          acc_b[i] = dp_vec(acc_b[i], kv, xb);
        }
      }
      _mm256_storeu_ps(sa + k0, _mm256_mul_ps(sum8_dp(acc_a), sc));
      _mm256_storeu_ps(sb + k0, _mm256_mul_ps(sum8_dp(acc_b), sc));
    }
    for (; k0 < n; ++k0) {
      __m512 acc_a = _mm512_setzero_ps(), acc_b = _mm512_setzero_ps();
      for (int d = 0; d < D; d += 32) {
        const __m512i kv = load_bf16x32(k + k0 * k_stride + d);
        acc_a = dp_vec(acc_a, kv, load_bf16x32(qa + d));
        acc_b = dp_vec(acc_b, kv, load_bf16x32(qb + d));
      }
      sa[k0] = _mm512_reduce_add_ps(acc_a) * scale;
      sb[k0] = _mm512_reduce_add_ps(acc_b) * scale;
    }
  }
  for (; r < rows; ++r) {
    const c10::BFloat16* qr = q + r * D;
    float* sr = s + r * s_stride;
    int k0 = 0;
    for (; k0 + 8 <= n; k0 += 8) {
      __m512 acc[8];
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i) acc[i] = _mm512_setzero_ps();
      for (int d = 0; d < D; d += 32) {
        const __m512i x = load_bf16x32(qr + d);
#pragma GCC unroll 8
        for (int i = 0; i < 8; ++i) acc[i] = dp_vec(acc[i], load_bf16x32(k + (k0 + i) * k_stride + d), x);
      }
      _mm256_storeu_ps(sr + k0, _mm256_mul_ps(sum8_dp(acc), sc));
    }
    for (; k0 < n; ++k0) {
      __m512 acc = _mm512_setzero_ps();
      for (int d = 0; d < D; d += 32) acc = dp_vec(acc, load_bf16x32(k + k0 * k_stride + d), load_bf16x32(qr + d));
      sr[k0] = _mm512_reduce_add_ps(acc) * scale;
    }
  }
}

// The V rows of a chunk's blocks for one head: rows[c] (row stride `stride`) holds keys
// c * bsp .. c * bsp + n[c] of the chunk's P rows.
struct ValueBlocks {
  const c10::BFloat16* const* rows;
  const int* n;
  int count;
  int bsp;
  int64_t stride;
};

// O[r] (split layout) += sum_k P[r][k] V[k] for R rows over the chunk's keys and 32 * NV values
// of D from d0, O held in registers from the first block to the last.
template <int R, int NV>
inline void pv_tile_split(const float* __restrict p, int p_stride, const ValueBlocks& vb, int d0,
                          float* __restrict o, int D) {
  const __m512i odd_mask = _mm512_set1_epi32(int(0xFFFF0000u));
  __m512 acc[R][2 * NV];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < 2 * NV; ++c) acc[r][c] = _mm512_loadu_ps(o + r * D + d0 + c * W);
  for (int b = 0; b < vb.count; ++b) {
    const c10::BFloat16* v = vb.rows[b] + d0;
    const float* pk = p + b * vb.bsp;
    for (int k = 0; k < vb.n[b]; ++k) {
      __m512 x[2 * NV];
#pragma GCC unroll 2
      for (int c = 0; c < NV; ++c) {
        const __m512i raw = load_bf16x32(v + k * vb.stride + 32 * c);
        x[2 * c] = (__m512)_mm512_slli_epi32(raw, 16);           // values 0, 2, 4, ...
        x[2 * c + 1] = (__m512)_mm512_and_si512(raw, odd_mask);  // values 1, 3, 5, ...
      }
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m512 pb = _mm512_set1_ps(pk[r * p_stride + k]);
#pragma GCC unroll 4
        for (int c = 0; c < 2 * NV; ++c) acc[r][c] = _mm512_fmadd_ps(pb, x[c], acc[r][c]);
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < 2 * NV; ++c) _mm512_storeu_ps(o + r * D + d0 + c * W, acc[r][c]);
}

template <int R>
inline void pv_rows_split(const float* p, int p_stride, const ValueBlocks& vb, float* o, int D) {
  int d = 0;
  for (; d + 64 <= D; d += 64) pv_tile_split<R, 2>(p, p_stride, vb, d, o, D);
  if (d < D) pv_tile_split<R, 1>(p, p_stride, vb, d, o, D);
}

template <int R>
inline void pv_tail_split(int rows, const float* p, int p_stride, const ValueBlocks& vb, float* o, int D) {
  if constexpr (R > 0) {
    if (rows == R)
      pv_rows_split<R>(p, p_stride, vb, o, D);
    else
      pv_tail_split<R - 1>(rows, p, p_stride, vb, o, D);
  }
}

inline void accumulate_pv_split(int rows, const float* p, int p_stride, const ValueBlocks& vb, float* o, int D) {
  int r = 0;
  for (; r + PV_ROWS <= rows; r += PV_ROWS) pv_rows_split<PV_ROWS>(p + r * p_stride, p_stride, vb, o + r * D, D);
  pv_tail_split<PV_ROWS - 1>(rows - r, p + r * p_stride, p_stride, vb, o + r * D, D);
}

// O rows in the split layout back to the order of D, in place.
inline void unsplit_rows(float* o, int rows, int D) {
  alignas(64) static const int32_t lo_idx[16] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23};
  alignas(64) static const int32_t hi_idx[16] = {8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i lo = _mm512_load_si512(lo_idx), hi = _mm512_load_si512(hi_idx);
  for (int64_t i = 0; i < int64_t(rows) * D; i += 32) {
    const __m512 even = _mm512_loadu_ps(o + i), odd = _mm512_loadu_ps(o + i + 16);
    _mm512_storeu_ps(o + i, _mm512_permutex2var_ps(even, lo, odd));
    _mm512_storeu_ps(o + i + 16, _mm512_permutex2var_ps(even, hi, odd));
  }
}
#endif  // OI_HAVE_SHUFFLEVECTOR
#endif

#if defined(OI_DPBF16) && defined(OI_AMX)
#define OI_AMX_ATTENTION 1
// AMX tiles (TDPBF16PS: C[16][16] fp32 += A[16][32 bf16] . B[16 pairs][16][2 bf16]) for the
// full groups of 16 rows of the many-row bf16 items, on the same operands as the VDPBF16PS
// path: Q rows as pairs of D (A), the K block transposed as pairs (B), P rows in bf16 (A) and
// the chunk's V rows interleaved in pairs (B). One tile instruction is 16x16x32 products; the
// rows left over (< 16 of a head) take the VDPBF16PS code.

// Every tile is 16 rows of 64 bytes: a 16 x 32 bf16 operand, 16 pairs x 16 columns, or
// 16 x 16 fp32 results. Loaded by every item that uses tiles (see oi_amx::TileConfig).
inline void configure_tiles() {
  static const oi_amx::TileConfig config = [] {
    oi_amx::TileConfig c;
    for (int t = 0; t < 8; ++t) c.set(t, 16, 64);
    return c;
  }();
  config.load();
}

// S[16][0 .. bsp) = scale * (Q . K^T) for 16 rows: Q as [16][D/2] pairs (row stride D/2), Kt as
// [D/2][bsp] pairs, S with a row stride of s_stride floats. D a multiple of 32, bsp of 16.
inline void scores_amx16(const uint32_t* q, int D, const uint32_t* kt, int bsp, float scale, float* s,
                         int s_stride) {
  for (int k0 = 0; k0 < bsp; k0 += 16) {
    _tile_zero(2);
    for (int d = 0; d < D / 2; d += 16) {  // 32 values of D per step
      _tile_loadd(0, q + d, D * 2);
      _tile_loadd(1, kt + size_t(d) * bsp + k0, bsp * 4);
      _tile_dpbf16ps(2, 0, 1);
    }
    _tile_stored(2, s + k0, s_stride * 4);
  }
  if (scale == 1.f) return;  // the caller scales in the softmax
  const __m512 sc = _mm512_set1_ps(scale);
  for (int r = 0; r < 16; ++r)
    for (int k = 0; k < bsp; k += 16) {
      float* x = s + size_t(r) * s_stride + k;
      _mm512_storeu_ps(x, _mm512_mul_ps(_mm512_loadu_ps(x), sc));
    }
}

// O[16][D] += P . V for 16 rows over `width` keys (a multiple of 32): P as [16][width] bf16 (row
// stride p_stride values), V as [width/2][D] pairs.
inline void pv_amx16(const c10::BFloat16* p, int p_stride, const uint32_t* vp, int width, float* o, int D) {
  for (int d0 = 0; d0 < D; d0 += 16) {
    _tile_loadd(2, o + d0, D * 4);
    for (int k = 0; k < width; k += 32) {
      _tile_loadd(0, p + k, p_stride * 2);
      _tile_loadd(1, vp + size_t(k / 2) * D + d0, D * 4);
      _tile_dpbf16ps(2, 0, 1);
    }
    _tile_stored(2, o + d0, D * 4);
  }
}

// The two-pass items (run_item_two_pass in paged_attention.cpp) take a 16-row group's scores over all
// its keys at once, then its whole P.V, so that O stays in tiles from the first key to the last.

// S[16][0 .. nkeys) = Q . K^T for one group of 16 rows, unscaled: Q as [16][D/2] pairs (row
// stride D/2 words), Kt as [D/2][ld] pairs (ld words per row of D pairs), S with a row stride of
// ld floats. nkeys a multiple of 16, D of 32. Four key tiles at a time share each Q tile load;
// the K tiles rotate through three registers so that a load never waits on the product before.
inline void group_scores_amx(const uint32_t* q, int D, const uint32_t* kt, int ld, int nkeys, float* s) {
  const int q_bytes = D * 2, kt_bytes = ld * 4;
  int k0 = 0;
  for (; k0 + 64 <= nkeys; k0 += 64) {
    _tile_zero(4);
    _tile_zero(5);
    _tile_zero(6);
    _tile_zero(7);
    for (int d = 0; d < D / 2; d += 16) {
      const uint32_t* k = kt + size_t(d) * ld + k0;
      _tile_loadd(0, q + d, q_bytes);
      _tile_loadd(1, k, kt_bytes);
      _tile_dpbf16ps(4, 0, 1);
      _tile_loadd(2, k + 16, kt_bytes);
      _tile_dpbf16ps(5, 0, 2);
      _tile_loadd(3, k + 32, kt_bytes);
      _tile_dpbf16ps(6, 0, 3);
      _tile_loadd(1, k + 48, kt_bytes);
      _tile_dpbf16ps(7, 0, 1);
    }
    _tile_stored(4, s + k0, ld * 4);
    _tile_stored(5, s + k0 + 16, ld * 4);
    _tile_stored(6, s + k0 + 32, ld * 4);
    _tile_stored(7, s + k0 + 48, ld * 4);
  }
  for (; k0 < nkeys; k0 += 16) {
    _tile_zero(4);
    for (int d = 0; d < D / 2; d += 16) {
      _tile_loadd(0, q + d, q_bytes);
      _tile_loadd(1, kt + size_t(d) * ld + k0, kt_bytes);
      _tile_dpbf16ps(4, 0, 1);
    }
    _tile_stored(4, s + k0, ld * 4);
  }
}

// C[32][32] (fp32; rows 0-15 at c, 16-31 at c1, row stride c_bytes) = the sum over `steps` of
// A . B: A two 16-row tiles of 64 bytes per row (at a and a1, row stride a_bytes, 64 bytes on
// per step), B two 16-pair tiles of 16 columns (at b and b + 16 words, row stride b_bytes,
// b_step words on per step). Each A and B tile load feeds two products (the 2 x 2 pattern).
inline void tiles_2x2(const char* a, const char* a1, int a_bytes, const uint32_t* b, size_t b_step,
                      int b_bytes, int steps, float* c, float* c1, int c_bytes) {
  _tile_zero(4);
  _tile_zero(5);
  _tile_zero(6);
  _tile_zero(7);
  for (int i = 0; i < steps; ++i, a += 64, a1 += 64, b += b_step) {
    _tile_loadd(0, a, a_bytes);
    _tile_loadd(2, b, b_bytes);
    _tile_dpbf16ps(4, 0, 2);
    _tile_loadd(3, b + 16, b_bytes);
    _tile_dpbf16ps(5, 0, 3);
    _tile_loadd(1, a1, a_bytes);
    _tile_dpbf16ps(6, 1, 2);
    _tile_dpbf16ps(7, 1, 3);
  }
  _tile_stored(4, c, c_bytes);
  _tile_stored(5, c + 16, c_bytes);
  _tile_stored(6, c1, c_bytes);
  _tile_stored(7, c1 + 16, c_bytes);
}

// The same as group_scores_amx for two groups (32 rows: Q as [32][D/2] pairs, S [32][ld]), nkeys
// a multiple of 32: each K tile serves both groups' Q tiles, half the K loads per product.
inline void pair_scores_amx(const uint32_t* q, int D, const uint32_t* kt, int ld, int nkeys, float* s) {
  const char* q0 = reinterpret_cast<const char*>(q);
  for (int k0 = 0; k0 < nkeys; k0 += 32)
    tiles_2x2(q0, q0 + 16 * D * 2, D * 2, kt + k0, size_t(16) * ld, ld * 4, D / 32, s + k0,
              s + size_t(16) * ld + k0, ld * 4);
}

// O[32][D] = P . V for two groups (P as [32][ld] bf16), 32 columns of O at a time: each V tile
// serves both groups' P tiles.
inline void pair_pv_amx(const c10::BFloat16* p, int ld, const uint32_t* vp, int D, int nkeys, float* o) {
  const char* p0 = reinterpret_cast<const char*>(p);
  for (int d0 = 0; d0 < D; d0 += 32)
    tiles_2x2(p0, p0 + 16 * ld * 2, ld * 2, vp + d0, size_t(16) * D, D * 4, nkeys / 32, o + d0,
              o + size_t(16) * D + d0, D * 4);
}

// O[16][D] = P . V for one group of 16 rows over nkeys keys (a multiple of 32): P as [16][ld] bf16,
// V as [nkeys/2][D] pairs. 64 columns of O at a time stay in four tiles over every key.
inline void group_pv_amx(const c10::BFloat16* p, int ld, const uint32_t* vp, int D, int nkeys, float* o) {
  for (int d0 = 0; d0 < D; d0 += 64) {
    const bool four = d0 + 64 <= D;  // else 32 columns (D a multiple of 32)
    _tile_zero(4);
    _tile_zero(5);
    _tile_zero(6);
    _tile_zero(7);
    for (int k = 0; k < nkeys; k += 32) {
      const uint32_t* v = vp + size_t(k / 2) * D + d0;
      _tile_loadd(0, p + k, ld * 2);
      _tile_loadd(1, v, D * 4);
      _tile_dpbf16ps(4, 0, 1);
      _tile_loadd(2, v + 16, D * 4);
      _tile_dpbf16ps(5, 0, 2);
      if (four) {
        _tile_loadd(3, v + 32, D * 4);
        _tile_dpbf16ps(6, 0, 3);
        _tile_loadd(1, v + 48, D * 4);
        _tile_dpbf16ps(7, 0, 1);
      }
    }
    _tile_stored(4, o + d0, D * 4);
    _tile_stored(5, o + d0 + 16, D * 4);
    if (four) {
      _tile_stored(6, o + d0 + 32, D * 4);
      _tile_stored(7, o + d0 + 48, D * 4);
    }
  }
}
#endif

}  // namespace oi_attention
