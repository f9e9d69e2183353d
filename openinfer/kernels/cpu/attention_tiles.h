// The fp32 tile kernels of the CPU paged attention (paged_attention.cpp, which documents
// the algorithm): K blocks transposed for many-row items, scores from a transposed block or
// straight from K rows (decode), P.V accumulated over V rows, in register tiles of W-lane
// vectors (vec.h). Included by paged_attention.cpp only.
#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>

#include "fp8.h"
#include "vec.h"

namespace oi_attention {

using namespace oi_vec;

// Keys are handled in tiles of KEY_TILE (scratch rows are padded to it) and head_dim must be
// a multiple of it, so that no width needs a scalar tail.
constexpr int KEY_TILE = 16;

// Register tiles (rows x vectors) sized to the register file: 16 vector registers with AVX2,
// 32 with AVX-512.
constexpr int QK_ROWS = W >= 16 ? 12 : 6;  // score tile: QK_ROWS rows x QK_VECS key vectors
constexpr int QK_VECS = 2;
constexpr int PV_ROWS = W >= 16 ? 4 : 2;  // P.V tile: PV_ROWS rows x PV_VECS vectors of D
constexpr int PV_VECS = 4;

// Query rows per work item: enough to amortise converting each K/V block, small enough that
// Q, O and the scores of a tile stay in L2.
constexpr int TILE_ROWS = 64;
// The same for items whose products run on AMX tiles (a bf16 cache on the amx_bf16 path): their
// per-block work (K transposed into pairs, V packed in pairs) is shared by twice the rows. 512-
// token prefill 1.04x, 31 x 64 tokens over a 1024-token cached prefix 1.12x, 16 x 256 tokens
// 1.09x (2 Intel cores). The FMA paths gained only on the shared prefix (float32 1.06-1.08x)
// and lost 1.0-1.08x on the other two; 256 rows were slower for both.
constexpr int AMX_TILE_ROWS = 128;
// Items with at most this many rows (decode: the group's heads) score straight from K rows;
// larger ones transpose each K block once and share it.
constexpr int ROWDOT_ROWS = 8;
// Keys per online-softmax step (whole blocks): the running max, the rescaling of O and the
// horizontal reductions are paid once per chunk rather than once per block. 128 rather than
// 64: a 512-token AMX prefill 1.06x faster, decode and fp32 prefills unchanged (2 Intel cores).
constexpr int CHUNK_KEYS = 128;
constexpr int MAX_CHUNK_BLOCKS = 16;
// K (V) rows of the block this many ahead are prefetched while a block's scores (P.V) are made.
constexpr int PREFETCH_BLOCKS = 2;

constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

// K block rows (n keys of D values, row stride `stride`) -> Kt[D][bsp] in fp32. Full groups of
// 8 keys go through an in-register 8x8 transpose (3 shuffle stages), the rest element by element.
typedef float v8f __attribute__((vector_size(32)));
typedef uint16_t v8h __attribute__((vector_size(16)));
typedef uint32_t v8u __attribute__((vector_size(32)));
inline v8f load8(const float* p) {
  v8f v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}
inline v8f load8(const c10::BFloat16* p) {
  v8h h;
  __builtin_memcpy(&h, p, sizeof h);
  return (v8f)(__builtin_convertvector(h, v8u) << 16);
}
inline v8f load8(const c10::Float8_e4m3fn* p) { return load8_fp8<false>(reinterpret_cast<const uint8_t*>(p)); }
inline v8f load8(const c10::Float8_e5m2* p) { return load8_fp8<true>(reinterpret_cast<const uint8_t*>(p)); }

#if defined(__has_builtin)
#if __has_builtin(__builtin_shufflevector)
#define OI_HAVE_SHUFFLEVECTOR 1
#endif
#endif

template <typename T>
inline void transpose_keys(const T* __restrict src, int64_t stride, int n, int D, float* __restrict kt, int bsp) {
  int k0 = 0;
#ifdef OI_HAVE_SHUFFLEVECTOR
  for (; k0 + 8 <= n; k0 += 8) {
    for (int d0 = 0; d0 < D; d0 += 8) {
      v8f r[8];
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i) r[i] = load8(src + (k0 + i) * stride + d0);
      v8f t[8], u[8];
#pragma GCC unroll 4
      for (int i = 0; i < 8; i += 2) {  // interleave key pairs
        t[i] = __builtin_shufflevector(r[i], r[i + 1], 0, 8, 1, 9, 4, 12, 5, 13);
        t[i + 1] = __builtin_shufflevector(r[i], r[i + 1], 2, 10, 3, 11, 6, 14, 7, 15);
      }
#pragma GCC unroll 2
      for (int i = 0; i < 8; i += 4) {  // then key quads: u[i + j] holds dims j and j + 4
#pragma GCC unroll 2
        for (int j = 0; j < 2; ++j) {
          u[i + 2 * j] = __builtin_shufflevector(t[i + j], t[i + j + 2], 0, 1, 8, 9, 4, 5, 12, 13);
          u[i + 2 * j + 1] = __builtin_shufflevector(t[i + j], t[i + j + 2], 2, 3, 10, 11, 6, 7, 14, 15);
        }
      }
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {  // join the two key quads (128-bit halves)
        v8f lo = __builtin_shufflevector(u[j], u[j + 4], 0, 1, 2, 3, 8, 9, 10, 11);
        v8f hi = __builtin_shufflevector(u[j], u[j + 4], 4, 5, 6, 7, 12, 13, 14, 15);
        __builtin_memcpy(kt + (d0 + j) * bsp + k0, &lo, sizeof lo);
        __builtin_memcpy(kt + (d0 + j + 4) * bsp + k0, &hi, sizeof hi);
      }
    }
  }
#endif
  for (; k0 < n; ++k0) {
    const T* row = src + k0 * stride;
    for (int d = 0; d < D; d += 8) {
      v8f x = load8(row + d);
#pragma GCC unroll 8
      for (int e = 0; e < 8; ++e) kt[(d + e) * bsp + k0] = x[e];
    }
  }
}

inline void store_from_float(float* dst, const float* src, int n, float mul) {
  for (int i = 0; i < n; i += W) storeu(dst + i, loadu(src + i) * mul);
}
inline void store_from_float(c10::BFloat16* dst, const float* src, int n, float mul) {
  // c10's round-to-nearest-even, the same rounding as torch's .to(torch.bfloat16).
  for (int i = 0; i < n; ++i) dst[i] = c10::BFloat16(src[i] * mul);
}

// Scores from a transposed key block, for many rows: S[r][0 .. bsp) = Q[r] . Kt for R rows at a
// time (register tile R rows x NK key vectors; Q values broadcast, Kt rows loaded once per R rows).
template <int R, int NK>
inline void score_tile(const float* __restrict q, int D, const float* __restrict kt, int bsp,
                       float* __restrict s, int s_stride) {
  vf acc[R][NK];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NK; ++v) acc[r][v] = splat(0.f);
  for (int d = 0; d < D; ++d) {
    vf k[NK];
#pragma GCC unroll 4
    for (int v = 0; v < NK; ++v) k[v] = loadu(kt + d * bsp + v * W);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      vf qb = splat(q[r * D + d]);
#pragma GCC unroll 4
      for (int v = 0; v < NK; ++v) acc[r][v] += qb * k[v];
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NK; ++v) storeu(s + r * s_stride + v * W, acc[r][v]);
}

template <int R>
inline void score_rows(const float* q, int D, const float* kt, int bsp, float* s, int s_stride) {
  int v = 0;
  for (; v + QK_VECS <= bsp / W; v += QK_VECS) score_tile<R, QK_VECS>(q, D, kt + v * W, bsp, s + v * W, s_stride);
  for (; v < bsp / W; ++v) score_tile<R, 1>(q, D, kt + v * W, bsp, s + v * W, s_stride);
}

template <int R>
inline void score_tail(int rows, const float* q, int D, const float* kt, int bsp, float* s, int s_stride) {
  if constexpr (R > 0) {
    if (rows == R)
      score_rows<R>(q, D, kt, bsp, s, s_stride);
    else
      score_tail<R - 1>(rows, q, D, kt, bsp, s, s_stride);
  }
}

inline void scores_transposed(int rows, const float* q, int D, const float* kt, int bsp, float* s, int s_stride) {
  int r = 0;
  for (; r + QK_ROWS <= rows; r += QK_ROWS) score_rows<QK_ROWS>(q + r * D, D, kt, bsp, s + r * s_stride, s_stride);
  score_tail<QK_ROWS - 1>(rows - r, q + r * D, D, kt, bsp, s + r * s_stride, s_stride);
}

// Scores straight from K rows, for few rows (decode): one accumulator per (row, key) over D, for
// 2 rows x 4 keys (or 1 row x 8 keys) at a time, then those accumulators are summed across lanes
// together (a tree of pairwise shuffles + adds). Nothing is transposed, so a block of a 1- or
// 2-row item costs little more than its FMAs; K rows past n are never read.
#ifdef OI_HAVE_SHUFFLEVECTOR
inline v8f to8(vf x) {
#if OI_VEC_WIDTH == 16
  return __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7) +
         __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15);
#else
  return x;
#endif
}
inline v8f pair_sums(v8f a, v8f b) {
  return __builtin_shufflevector(a, b, 0, 2, 8, 10, 4, 6, 12, 14) +
         __builtin_shufflevector(a, b, 1, 3, 9, 11, 5, 7, 13, 15);
}
// [sum(x0), ..., sum(x7)]
inline v8f sum8(const vf* acc) {
  v8f q0 = pair_sums(pair_sums(to8(acc[0]), to8(acc[1])), pair_sums(to8(acc[2]), to8(acc[3])));
  v8f q1 = pair_sums(pair_sums(to8(acc[4]), to8(acc[5])), pair_sums(to8(acc[6]), to8(acc[7])));
  return __builtin_shufflevector(q0, q1, 0, 1, 2, 3, 8, 9, 10, 11) +
         __builtin_shufflevector(q0, q1, 4, 5, 6, 7, 12, 13, 14, 15);
}
#endif

#ifdef OI_HAVE_SHUFFLEVECTOR
// [sum(x0), sum(x1), sum(x2), sum(x3)]
typedef float v4f __attribute__((vector_size(16)));
inline v4f sum4(const vf* acc) {
  v8f q = pair_sums(pair_sums(to8(acc[0]), to8(acc[1])), pair_sums(to8(acc[2]), to8(acc[3])));
  return __builtin_shufflevector(q, q, 0, 1, 2, 3) + __builtin_shufflevector(q, q, 4, 5, 6, 7);
}
#endif

template <typename TK>
inline void scores_rowdot(int rows, const float* __restrict q, int D, const TK* __restrict k, int64_t k_stride,
                          int n, float* __restrict s, int s_stride) {
  int r = 0;
#ifdef OI_HAVE_SHUFFLEVECTOR
  // Two rows x 4 keys: each K vector loaded (and converted) once for both rows.
  for (; r + 2 <= rows; r += 2) {
    const float* qa = q + r * D;
    const float* qb = qa + D;
    float* sa = s + r * s_stride;
    float* sb = sa + s_stride;
    int k0 = 0;
    for (; k0 + 4 <= n; k0 += 4) {
      vf acc_a[4], acc_b[4];
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) acc_a[i] = acc_b[i] = splat(0.f);
      for (int d = 0; d < D; d += W) {
        const vf xa = loadu(qa + d), xb = loadu(qb + d);
#pragma GCC unroll 4
        for (int i = 0; i < 4; ++i) {
          const vf kv = load_as_float(k + (k0 + i) * k_stride + d);
          acc_a[i] += xa * kv;
          acc_b[i] += xb * kv;
        }
      }
      v4f ta = sum4(acc_a), tb = sum4(acc_b);
      __builtin_memcpy(sa + k0, &ta, sizeof ta);
      __builtin_memcpy(sb + k0, &tb, sizeof tb);
    }
    for (; k0 < n; ++k0) {
      vf acc_a = splat(0.f), acc_b = splat(0.f);
      for (int d = 0; d < D; d += W) {
        const vf kv = load_as_float(k + k0 * k_stride + d);
        acc_a += loadu(qa + d) * kv;
        acc_b += loadu(qb + d) * kv;
      }
      sa[k0] = hsum(acc_a);
      sb[k0] = hsum(acc_b);
    }
  }
#endif
  for (; r < rows; ++r) {
    const float* qr = q + r * D;
    float* sr = s + r * s_stride;
    int k0 = 0;
#ifdef OI_HAVE_SHUFFLEVECTOR
    for (; k0 + 8 <= n; k0 += 8) {
      vf acc[8];
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i) acc[i] = splat(0.f);
      for (int d = 0; d < D; d += W) {
        const vf qv = loadu(qr + d);
#pragma GCC unroll 8
        for (int i = 0; i < 8; ++i) acc[i] += qv * load_as_float(k + (k0 + i) * k_stride + d);
      }
      v8f sum = sum8(acc);
      __builtin_memcpy(sr + k0, &sum, sizeof sum);
    }
#endif
    for (; k0 < n; ++k0) {
      vf acc = splat(0.f);
      for (int d = 0; d < D; d += W) acc += loadu(qr + d) * load_as_float(k + k0 * k_stride + d);
      sr[k0] = hsum(acc);
    }
  }
}

// O[r][d0 .. d0 + NV*W) += sum_k P[r][k] V[k][d0 ..] for R rows over n keys.
template <int R, int NV, typename TV>
inline void pv_tile(const float* __restrict p, int bsp, const TV* __restrict v, int64_t v_stride,
                    int n, float* __restrict o, int D) {
  vf acc[R][NV];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < NV; ++c) acc[r][c] = loadu(o + r * D + c * W);
  for (int k = 0; k < n; ++k) {
    vf x[NV];
#pragma GCC unroll 4
    for (int c = 0; c < NV; ++c) x[c] = load_as_float(v + k * v_stride + c * W);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      vf pb = splat(p[r * bsp + k]);
#pragma GCC unroll 4
      for (int c = 0; c < NV; ++c) acc[r][c] += pb * x[c];
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < NV; ++c) storeu(o + r * D + c * W, acc[r][c]);
}

template <int R, typename TV>
inline void pv_rows(const float* p, int bsp, const TV* v, int64_t v_stride, int n, float* o, int D) {
  int d = 0;
  for (; d + PV_VECS * W <= D; d += PV_VECS * W) pv_tile<R, PV_VECS, TV>(p, bsp, v + d, v_stride, n, o + d, D);
  for (; d < D; d += W) pv_tile<R, 1, TV>(p, bsp, v + d, v_stride, n, o + d, D);
}

template <int R, typename TV>
inline void pv_tail(int rows, const float* p, int bsp, const TV* v, int64_t v_stride, int n, float* o,
                    int D) {
  if constexpr (R > 0) {
    if (rows == R)
      pv_rows<R, TV>(p, bsp, v, v_stride, n, o, D);
    else
      pv_tail<R - 1, TV>(rows, p, bsp, v, v_stride, n, o, D);
  }
}

template <typename TV>
inline void accumulate_pv(int rows, const float* p, int bsp, const TV* v, int64_t v_stride, int n,
                          float* o, int D) {
  int r = 0;
  for (; r + PV_ROWS <= rows; r += PV_ROWS) pv_rows<PV_ROWS, TV>(p + r * bsp, bsp, v, v_stride, n, o + r * D, D);
  pv_tail<PV_ROWS - 1, TV>(rows - r, p + r * bsp, bsp, v, v_stride, n, o + r * D, D);
}

}  // namespace oi_attention
