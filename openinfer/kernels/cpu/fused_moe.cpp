// A mixture-of-experts layer's routed experts in one call: the router's (weight, slot) pairs in,
// sum_j weight[t, j] * down(act(gate(x_t), up(x_t))) of expert slot[t, j] out, for every token,
// float32 or bfloat16. The Python path it replaces (FusedExperts.forward_native in
// openinfer/layers/moe.py, kept as the oracle) sorts the pairs and runs two GEMM calls per
// expert with a token, each a torch dispatch on a few rows: at decode sizes the layer cost ~5x
// a dense MLP of the same active parameters.
//
//   pairs ─ counting sort by slot ─ 1: h[p] = act(x[token p] . W13[slot])   (expert x tile of I)
//                                   2: y[p] = weight[p] * (h[p] . W2[slot]) (expert x tile of H)
//                                   3: out[t] = sum_j y[pair (t, j)]         (tokens)
//
// Work: each phase is split into tasks (an expert, a tile of TN output columns, up to ROW_CHUNK
// of its rows) cut into one contiguous run of about equal cost per thread; a task streams its
// weight tile once and keeps it in L2 while its rows pass over it, MT rows at a time (MT x NT
// vector accumulators). Phase 1 fuses gate/up with the activation: a W13 tile holds W gate
// columns and the W up columns of the same features, so both are in registers together.
// Phase 3 sums each token's pairs in top-k order, so a row's result never depends on the rest of
// the batch or the thread count.
//
// Weights are packed once at load (openinfer/kernels/fused_moe.py) so that a tile is one run of
// memory: float32 as [E][tiles][K][TN], bfloat16 as [E][tiles][K/2][TN][2] (pairs of inputs, the
// operand layout of VDPBF16PS). Products of bfloat16 weights: VDPBF16PS where compiled
// (AVX512_BF16, path "avx512_bf16"), else each 32-bit pair widened to two float32 vectors by a
// shift and a mask for FMAs (path "fp32"). Accumulation is float32; bfloat16 rounds h (the down
// GEMM's input) and the output, once each.
// FP8 experts (a block-scaled e4m3 checkpoint kept as loaded: one byte per weight): tiles of
// bytes packed as float32's, [E][tiles][K][TN], and beside them each tile's scales per run of
// block_k inputs, [E][tiles][K / block_k][NT] (a vector's columns lie in one scale block). Each
// weight vector is read (fp8.h), multiplied by its scale and used as float32's are: every
// weight is the reference's dequantized value (openinfer/kernels/fp8_gemm.py), so with float32
// activations the result is the float32 kernel's on dequantized weights, bit for bit.
// MXFP4 experts (DeepSeek-V4's release: two e2m1 values per byte, one power-of-two scale per 32
// inputs of each output column): tiles [E][tiles][K/2][TN] of bytes (byte (k/2, n) holds inputs
// k and k + 1 of column n, the low nibble first) and scales [E][tiles][K/32][TN]. A task turns
// its tile into float32 once (the exact values: e2m1 times a power of two) and runs the float32
// micro-kernel over it, so again the result is the float32 kernel's on dequantized weights.
// Built into the CPU attention extension (openinfer/kernels/cpu_attention.py).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "fp8.h"
#include "ops.h"
#include "vec.h"

namespace {

using namespace oi_vec;

constexpr int NT = 2;              // vectors of columns per tile (W13: one gate, one up)
constexpr int TN = NT * W;         // columns per tile
constexpr int MT = 6;              // rows per micro-kernel pass: 12 of AVX2's 16 registers
constexpr int64_t ROW_CHUNK = 48;  // rows per task, so that a prefill's busy experts split
constexpr int64_t TILE_COST = 16;  // streaming a tile costs about as much as this many rows

#if defined(__AVX512BF16__) && OI_VEC_WIDTH == 16
#define OI_MOE_DPBF16 1
#endif

enum Path { F32, BF16_FMA, BF16_DP, FP8, FP4 };
// What the micro-kernel reads: activations (float, or bf16 pairs as 32-bit words) and weights.
template <Path P> struct Types { using A = float; using Wt = float; };
template <> struct Types<BF16_FMA> { using A = float; using Wt = uint32_t; };
template <> struct Types<BF16_DP> { using A = uint32_t; using Wt = uint32_t; };
template <> struct Types<FP8> { using A = float; using Wt = uint8_t; };
template <> struct Types<FP4> { using A = float; using Wt = uint8_t; };

constexpr int64_t FP4_GROUP = 32;  // inputs per MXFP4 scale

// W bytes of an MXFP4 tile row (inputs k, k + 1 of W columns: the low nibble, the high one) as
// two vectors of their e2m1 values (bit 3 the sign; magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6), by
// a table lookup in a register where the ISA has one (VPERMPS), else from the bits.
inline void load_fp4(const uint8_t* p, vf& lo, vf& hi) {
#if defined(__AVX512F__) && OI_VEC_WIDTH == 16
  const __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m512 table = _mm512_setr_ps(0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f,
                                      -0.f, -.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f);
  lo = (vf)_mm512_permutexvar_ps(_mm512_and_si512(c, _mm512_set1_epi32(15)), table);
  hi = (vf)_mm512_permutexvar_ps(_mm512_srli_epi32(c, 4), table);
#elif defined(__AVX2__) && OI_VEC_WIDTH == 8
  const __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m256 table = _mm256_setr_ps(0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f);
  auto value = [&](__m256i code) {  // VPERMPS reads the low 3 bits; bit 3 becomes the sign
    const __m256 sign = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_and_si256(code, _mm256_set1_epi32(8)), 28));
    return (vf)_mm256_xor_ps(_mm256_permutevar8x32_ps(table, code), sign);
  };
  lo = value(_mm256_and_si256(c, _mm256_set1_epi32(15)));
  hi = value(_mm256_srli_epi32(c, 4));
#else
  typedef uint8_t vbytes __attribute__((vector_size(W)));
  auto value = [](vu code) {  // exponent 0 is the subnormal m * 0.5
    const vu e = (code >> 1) & 3u, m = code & 1u;
    const vu bits = (e == 0u ? m * (126u << 23) : ((e + 126u) << 23) | (m << 22)) | ((code & 8u) << 28);
    vf v;
    std::memcpy(&v, &bits, sizeof(v));
    return v;
  };
  vbytes b;
  std::memcpy(&b, p, sizeof(b));
  const vu c = __builtin_convertvector(b, vu);
  lo = value(c & 15u);
  hi = value(c >> 4);
#endif
}

// An fp8 tile's scales: NT per run of bk inputs (unused by the other paths).
struct Scales {
  const float* s;
  int64_t bk;
};

enum ActivationKind : int64_t { SILU = 0, CLAMPED_SILU = 1, CLAMPED_SWIGLU = 2 };
struct Activation {
  int64_t kind;
  float alpha, limit;
};

// The activations of FusedExperts (openinfer/layers/moe.py): silu_and_mul, ClampedSiluAndMul
// and ClampedSwiGLU.
inline vf activate(vf g, vf u, const Activation& a) {
  if (a.kind == SILU) return g * vsigmoid(g) * u;
  const vf hi = splat(a.limit), lo = splat(-a.limit);
  g = g > hi ? hi : g;
  u = u > hi ? hi : (u < lo ? lo : u);
  if (a.kind == CLAMPED_SILU) return g * vsigmoid(g) * u;
  return (u + 1.f) * g * vsigmoid(g * a.alpha);
}

// acc[m][n] = x row m . tile column block n over K inputs (M rows, xr their starts).
template <Path P, int M>
inline void tile(const typename Types<P>::A* const* xr, int64_t K, const typename Types<P>::Wt* w,
                 const Scales& scales, vf (&acc)[M][NT]) {
  for (int m = 0; m < M; ++m)
    for (int n = 0; n < NT; ++n) acc[m][n] = vf{};
  if constexpr (P == FP8) {
    for (int64_t k0 = 0, kb = 0; k0 < K; k0 += scales.bk, ++kb) {
      vf scale[NT];
      for (int n = 0; n < NT; ++n) scale[n] = splat(scales.s[kb * NT + n] * FP8_UNIT);
      for (int64_t k = k0, k1 = std::min(K, k0 + scales.bk); k < k1; ++k, w += TN) {
        vf wv[NT];
        for (int n = 0; n < NT; ++n) wv[n] = load_fp8(w + n * W) * scale[n];
        for (int m = 0; m < M; ++m) {
          const vf xv = splat(xr[m][k]);
          for (int n = 0; n < NT; ++n) acc[m][n] += xv * wv[n];
        }
      }
    }
  } else if constexpr (P == FP4) {
    for (int64_t k0 = 0; k0 < K; k0 += FP4_GROUP) {
      vf scale[NT];
      for (int n = 0; n < NT; ++n) scale[n] = loadu(scales.s + k0 / FP4_GROUP * TN + n * W);
      for (int64_t k = k0, k1 = std::min(K, k0 + FP4_GROUP); k < k1; k += 2, w += TN) {
        vf lo[NT], hi[NT];
        for (int n = 0; n < NT; ++n) {
          load_fp4(w + n * W, lo[n], hi[n]);
          lo[n] *= scale[n], hi[n] *= scale[n];
        }
        for (int m = 0; m < M; ++m) {
          const vf x0 = splat(xr[m][k]), x1 = splat(xr[m][k + 1]);
          for (int n = 0; n < NT; ++n) acc[m][n] += x0 * lo[n];  // (the float32 path's order:
          for (int n = 0; n < NT; ++n) acc[m][n] += x1 * hi[n];  // one input after the other)
        }
      }
    }
  } else if constexpr (P == F32) {
    for (int64_t k = 0; k < K; ++k, w += TN) {
      vf wv[NT];
      for (int n = 0; n < NT; ++n) wv[n] = loadu(w + n * W);
      for (int m = 0; m < M; ++m) {
        const vf xv = splat(xr[m][k]);
        for (int n = 0; n < NT; ++n) acc[m][n] += xv * wv[n];
      }
    }
  } else if constexpr (P == BF16_FMA) {
    for (int64_t k = 0; k < K; k += 2, w += TN) {
      vf even[NT], odd[NT];  // a pair's first input in the low half of its word
      for (int n = 0; n < NT; ++n) {
        vu bits;
        std::memcpy(&bits, w + n * W, sizeof bits);
        even[n] = (vf)(bits << 16);
        odd[n] = (vf)(bits & 0xFFFF0000u);
      }
      for (int m = 0; m < M; ++m) {
        const vf x0 = splat(xr[m][k]), x1 = splat(xr[m][k + 1]);
        for (int n = 0; n < NT; ++n) acc[m][n] += x0 * even[n] + x1 * odd[n];
      }
    }
  } else {
#ifdef OI_MOE_DPBF16
    for (int64_t k2 = 0; k2 < K / 2; ++k2, w += TN) {
      __m512i wv[NT];
      for (int n = 0; n < NT; ++n) wv[n] = _mm512_loadu_si512(w + n * W);
      for (int m = 0; m < M; ++m) {
        const __m512bh xp = (__m512bh)_mm512_set1_epi32(int(xr[m][k2]));
        for (int n = 0; n < NT; ++n) acc[m][n] = (vf)_mm512_dpbf16_ps((__m512)acc[m][n], xp, (__m512bh)wv[n]);
      }
    }
#endif
  }
}

// An expert, a tile of its output columns, and a run of its pairs (sorted order).
struct Task {
  int64_t slot, tile, p0, p1;
};

std::vector<Task> make_tasks(const std::vector<int64_t>& start, int64_t tiles) {
  std::vector<Task> tasks;
  for (size_t e = 0; e + 1 < start.size(); ++e)
    for (int64_t t = 0; t < tiles; ++t)
      for (int64_t p = start[e]; p < start[e + 1]; p += ROW_CHUNK)
        tasks.push_back({int64_t(e), t, p, std::min(p + ROW_CHUNK, start[e + 1])});
  return tasks;
}

// fn(task) for every task: one contiguous run of tasks per thread, of about equal cost.
template <typename F>
void run_tasks(const std::vector<Task>& tasks, const F& fn) {
  const int64_t n = int64_t(tasks.size());
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n));
  auto cost = [](const Task& t) { return TILE_COST + t.p1 - t.p0; };
  int64_t total = 0;
  for (const Task& t : tasks) total += cost(t);
  std::vector<int64_t> bounds{0};
  int64_t i = 0, done = 0;
  for (int64_t part = 1; part < parts; ++part) {
    while (i < n && done < total * part / parts) done += cost(tasks[i++]);
    bounds.push_back(i);
  }
  bounds.push_back(n);
  at::parallel_for(0, parts, 1, [&](int64_t a, int64_t b) {
    for (int64_t part = a; part < b; ++part)
      for (int64_t t = bounds[part]; t < bounds[part + 1]; ++t) fn(tasks[t]);
  });
}

// Rows p .. p + m of a task through the micro-kernel, m <= MT: epilogue(i, acc[i]) per row.
template <Path P, typename Row, typename Epilogue>
inline void rows(int64_t p, int64_t m, int64_t K, const typename Types<P>::Wt* w, const Scales& scales,
                 const Row& row, const Epilogue& epilogue) {
  using A = typename Types<P>::A;
  auto pass = [&](auto rows_c) {
    constexpr int R = decltype(rows_c)::value;
    const A* xr[R];
    for (int i = 0; i < R; ++i) xr[i] = row(p + i);
    vf acc[R][NT];
    tile<P, R>(xr, K, w, scales, acc);
    for (int i = 0; i < R; ++i) epilogue(p + i, acc[i]);
  };
  switch (m) {
    case 1: pass(std::integral_constant<int, 1>{}); break;
    case 2: pass(std::integral_constant<int, 2>{}); break;
    case 3: pass(std::integral_constant<int, 3>{}); break;
    case 4: pass(std::integral_constant<int, 4>{}); break;
    case 5: pass(std::integral_constant<int, 5>{}); break;
    default: pass(std::integral_constant<int, MT>{}); break;
  }
}

// A task's rows p0 .. p1 through the micro-kernel, MT at a time. An fp8 task with more rows than
// one pass has its tile converted once into float32 (K x TN, L2-resident) and passed over as
// the float32 path's: the same weights, without converting them again for every MT rows.
template <Path P, typename Row, typename Epilogue>
inline void task_rows_direct(const Task& t, int64_t K, const typename Types<P>::Wt* w,
                             const Scales& scales, const Row& row, const Epilogue& epilogue) {
  if constexpr (P == FP8) {
    if (t.p1 - t.p0 > MT) {
      thread_local std::vector<float> tile32;
      tile32.resize(K * TN);
      for (int64_t k0 = 0, kb = 0; k0 < K; k0 += scales.bk, ++kb) {
        vf scale[NT];
        for (int n = 0; n < NT; ++n) scale[n] = splat(scales.s[kb * NT + n] * FP8_UNIT);
        for (int64_t k = k0, k1 = std::min(K, k0 + scales.bk); k < k1; ++k)
          for (int n = 0; n < NT; ++n)
            storeu(tile32.data() + k * TN + n * W, load_fp8(w + k * TN + n * W) * scale[n]);
      }
      for (int64_t p = t.p0; p < t.p1; p += MT)
        rows<F32>(p, std::min<int64_t>(MT, t.p1 - p), K, tile32.data(), scales, row, epilogue);
      return;
    }
  }
  for (int64_t p = t.p0; p < t.p1; p += MT)
    rows<P>(p, std::min<int64_t>(MT, t.p1 - p), K, w, scales, row, epilogue);
}

template <Path P, typename Row, typename Epilogue>
inline void task_rows(const Task& t, int64_t K, const typename Types<P>::Wt* w, const Scales& scales,
                      const Row& row, const Epilogue& epilogue) {
  if constexpr (P == FP4) {
    if (t.p1 - t.p0 <= MT) {  // one pass: the bytes straight into registers
      rows<FP4>(t.p0, t.p1 - t.p0, K, w, scales, row, epilogue);
      return;
    }
    thread_local std::vector<float> tile32;  // more: the tile turned into float32 once
    tile32.resize(K * TN);
    for (int64_t k2 = 0; k2 < K / 2; ++k2) {
      const float* scale = scales.s + (2 * k2 / FP4_GROUP) * TN;
      for (int n = 0; n < NT; ++n) {
        vf lo, hi;
        load_fp4(w + k2 * TN + n * W, lo, hi);
        const vf sc = loadu(scale + n * W);
        storeu(tile32.data() + 2 * k2 * TN + n * W, lo * sc);
        storeu(tile32.data() + (2 * k2 + 1) * TN + n * W, hi * sc);
      }
    }
    for (int64_t p = t.p0; p < t.p1; p += MT)
      rows<F32>(p, std::min<int64_t>(MT, t.p1 - p), K, tile32.data(), scales, row, epilogue);
    return;
  } else {
    task_rows_direct<P>(t, K, w, scales, row, epilogue);
  }
}

struct Step {
  int64_t H, Ip, Hp, E, T, k;
  std::vector<int64_t> start;  // [E + 1]: slot e's pairs are p in start[e] .. start[e + 1]
  std::vector<int64_t> token;  // [pairs]: the token of pair p
  std::vector<float> weight;   // [pairs]
  std::vector<int64_t> pos;    // [T * k]: the sorted position of pair (t, j), -1 if not here
};

// Pairs grouped by slot, in (token, j) order within a slot; slots outside 0 .. E are another
// rank's (expert parallel) and are left out.
Step sort_pairs(const at::Tensor& slots, const at::Tensor& weights, int64_t E) {
  Step s;
  s.T = slots.size(0), s.k = slots.size(1), s.E = E;
  const int64_t* sl = slots.data_ptr<int64_t>();
  const float* wt = weights.data_ptr<float>();
  const int64_t n = s.T * s.k;
  s.start.assign(E + 1, 0);
  for (int64_t i = 0; i < n; ++i)
    if (sl[i] >= 0 && sl[i] < E) ++s.start[sl[i] + 1];
  for (int64_t e = 0; e < E; ++e) s.start[e + 1] += s.start[e];
  std::vector<int64_t> next(s.start.begin(), s.start.end() - 1);
  s.token.resize(s.start[E]);
  s.weight.resize(s.start[E]);
  s.pos.assign(n, -1);
  for (int64_t i = 0; i < n; ++i) {
    if (sl[i] < 0 || sl[i] >= E) continue;
    const int64_t p = next[sl[i]]++;
    s.token[p] = i / s.k, s.weight[p] = wt[i], s.pos[i] = p;
  }
  return s;
}

// An fp8 layer's packed scales (nullptr otherwise) and their run of inputs.
struct LayerScales {
  const float* s13 = nullptr;
  const float* s2 = nullptr;
  int64_t bk = 0;
};

template <Path P, typename Out>
void run(Out* out, const typename Types<P>::A* x, const typename Types<P>::Wt* w13,
         const typename Types<P>::Wt* w2, const float* b13, const float* b2, const Step& s,
         const Activation& act, const LayerScales& ls = {}) {
  using A = typename Types<P>::A;
  constexpr int64_t per_word = P == BF16_FMA || P == BF16_DP || P == FP4 ? 2 : 1;  // inputs per weight element
  constexpr int64_t scale_cols = P == FP4 ? TN : NT;  // a tile's scales per run of inputs
  const int64_t H = s.H, Ip = s.Ip, Hp = s.Hp, pairs = s.start[s.E];
  const int64_t tiles13 = Ip / W, tiles2 = Hp / TN;
  const int64_t tile13 = H / per_word * TN, tile2 = Ip / per_word * TN;  // weight elements per tile
  const int64_t kb13 = ls.bk ? (H + ls.bk - 1) / ls.bk : 0, kb2 = ls.bk ? (Ip + ls.bk - 1) / ls.bk : 0;
  constexpr int64_t per_a = P == BF16_DP ? 2 : 1;                         // inputs per A element
  // h: float32, or bf16 for VDPBF16PS (the bf16-rounded value either way).
  const at::Tensor hbuf = at::empty({pairs, Ip}, at::TensorOptions().dtype(P == BF16_DP ? at::kBFloat16 : at::kFloat));
  const at::Tensor ybuf = at::empty({pairs, Hp}, at::TensorOptions().dtype(at::kFloat));
  float* y = ybuf.data_ptr<float>();
  char* h = static_cast<char*>(hbuf.data_ptr());

  run_tasks(make_tasks(s.start, tiles13), [&](const Task& t) {
    const auto* w = w13 + (t.slot * tiles13 + t.tile) * tile13;
    const Scales scales{ls.s13 ? ls.s13 + (t.slot * tiles13 + t.tile) * kb13 * scale_cols : nullptr, ls.bk};
    const float* bg = b13 ? b13 + t.slot * 2 * Ip + t.tile * W : nullptr;
    auto row = [&](int64_t p) { return x + s.token[p] * (H / per_a); };
    auto store = [&](int64_t p, const vf* acc) {
      vf g = acc[0], u = acc[1];
      if (bg) g += loadu(bg), u += loadu(bg + Ip);
      const vf v = activate(g, u, act);
      if constexpr (P == BF16_DP)
        store_as(reinterpret_cast<c10::BFloat16*>(h) + p * Ip + t.tile * W, round_bf16(v));
      else  // float32 h, rounded to bfloat16 for a bfloat16 layer
        storeu(reinterpret_cast<float*>(h) + p * Ip + t.tile * W, round_to(v, out));
    };
    task_rows<P>(t, H, w, scales, row, store);
  });

  run_tasks(make_tasks(s.start, tiles2), [&](const Task& t) {
    const auto* w = w2 + (t.slot * tiles2 + t.tile) * tile2;
    const Scales scales{ls.s2 ? ls.s2 + (t.slot * tiles2 + t.tile) * kb2 * scale_cols : nullptr, ls.bk};
    const float* bias = b2 ? b2 + t.slot * Hp + t.tile * TN : nullptr;
    auto row = [&](int64_t p) { return reinterpret_cast<const A*>(h) + p * (Ip / per_a); };
    auto store = [&](int64_t p, const vf* acc) {
      const vf scale = splat(s.weight[p]);
      for (int n = 0; n < NT; ++n) {
        const vf v = bias ? acc[n] + loadu(bias + n * W) : acc[n];
        storeu(y + p * Hp + t.tile * TN + n * W, v * scale);
      }
    };
    task_rows<P>(t, Ip, w, scales, row, store);
  });

  const int64_t grain = std::max<int64_t>(1, 4096 / std::max<int64_t>(H * s.k, 1));
  at::parallel_for(0, s.T, grain, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t* pos = s.pos.data() + t * s.k;
      for (int64_t c = 0; c < H; c += W) {  // rows of y are Hp >= c + W wide
        vf sum = vf{};
        for (int64_t j = 0; j < s.k; ++j)
          if (pos[j] >= 0) sum += loadu(y + pos[j] * Hp + c);
        Out res[W];
        store_as(res, round_to(sum, res));
        std::memcpy(out + t * H + c, res, sizeof(Out) * std::min<int64_t>(W, H - c));
      }
    }
  });
}

}  // namespace

int64_t fused_moe_tile() { return TN; }

at::Tensor fused_moe(const at::Tensor& x, const at::Tensor& w13, const at::Tensor& w2, const at::Tensor& weights,
                     const at::Tensor& slots, const std::optional<at::Tensor>& b13,
                     const std::optional<at::Tensor>& b2, int64_t activation, double alpha, double limit,
                     const std::string& bf16_dot, const std::optional<at::Tensor>& w13_scale,
                     const std::optional<at::Tensor>& w2_scale, int64_t block_k) {
  const auto dtype = x.scalar_type();
  const bool fp8 = w13.scalar_type() == at::kFloat8_e4m3fn, fp4 = w13.scalar_type() == at::kByte;
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "fused_moe: float32 or bfloat16 x");
  TORCH_CHECK((fp8 || fp4 || w13.scalar_type() == dtype) && w2.scalar_type() == w13.scalar_type(),
              "fused_moe: weights in x's dtype, or both float8_e4m3fn, or both MXFP4 bytes (uint8)");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && w13.is_contiguous() && w2.is_contiguous(),
              "fused_moe: contiguous x [T, H] and packed weights");
  TORCH_CHECK(slots.scalar_type() == at::kLong && weights.scalar_type() == at::kFloat && slots.is_contiguous() &&
                  weights.is_contiguous() && slots.sizes() == weights.sizes() && slots.dim() == 2 &&
                  slots.size(0) == x.size(0),
              "fused_moe: int64 slots and float32 weights, both [T, k]");
  TORCH_CHECK(activation >= SILU && activation <= CLAMPED_SWIGLU, "fused_moe: unknown activation ", activation);
  const int64_t per_word = (dtype == at::kFloat || fp8) && !fp4 ? 1 : 2;  // inputs per row of a tile
  const int64_t row_width = fp4 ? TN : TN * per_word;                    // elements per row of a tile
  Step s = sort_pairs(slots, weights, w13.size(0));
  s.H = x.size(1), s.Ip = w13.size(1) * W, s.Hp = w2.size(1) * TN;
  TORCH_CHECK(w13.dim() == 4 && w13.size(2) * per_word == s.H && w13.size(3) == row_width,
              "fused_moe: w13 is not packed for this hidden size and build (fused_moe_tile())");
  TORCH_CHECK(w2.dim() == 4 && w2.size(0) == s.E && w2.size(2) * per_word == s.Ip && w2.size(3) == row_width &&
                  s.Hp >= s.H && s.Hp < s.H + TN,
              "fused_moe: w2 is not packed to match w13 and x");
  LayerScales ls;
  TORCH_CHECK((fp8 || fp4) == (w13_scale.has_value() && w2_scale.has_value()),
              "fused_moe: fp8 and MXFP4 weights, and only they, have scales");
  if (fp8 || fp4) {
    TORCH_CHECK(fp8 ? block_k > 0 : block_k == FP4_GROUP, "fused_moe: fp8 weights need block_k, MXFP4 32");
    const int64_t kb13 = (s.H + block_k - 1) / block_k, kb2 = (s.Ip + block_k - 1) / block_k;
    const int64_t cols = fp4 ? TN : NT;  // scales per column (MXFP4), or per vector of columns
    TORCH_CHECK(w13_scale->scalar_type() == at::kFloat && w2_scale->scalar_type() == at::kFloat &&
                    w13_scale->is_contiguous() && w2_scale->is_contiguous() &&
                    w13_scale->sizes() == at::IntArrayRef({s.E, w13.size(1), kb13, cols}) &&
                    w2_scale->sizes() == at::IntArrayRef({s.E, w2.size(1), kb2, cols}),
                "fused_moe: scales are float32 [E, tiles, ceil(K / block_k), ", cols, "], packed as the weights");
    ls = {w13_scale->data_ptr<float>(), w2_scale->data_ptr<float>(), block_k};
  }
  const float* pb13 = nullptr;
  const float* pb2 = nullptr;
  if (b13.has_value() || b2.has_value()) {
    TORCH_CHECK(b13.has_value() && b2.has_value() && b13->scalar_type() == at::kFloat &&
                    b2->scalar_type() == at::kFloat && b13->is_contiguous() && b2->is_contiguous() &&
                    b13->numel() == s.E * 2 * s.Ip && b2->numel() == s.E * s.Hp,
                "fused_moe: biases are float32 [E, 2, I] and [E, H], padded as the weights");
    pb13 = b13->data_ptr<float>(), pb2 = b2->data_ptr<float>();
  }
  const Activation act{activation, float(alpha), float(limit)};
  at::Tensor out = at::empty({s.T, s.H}, x.options());
  if (s.T == 0) return out;
  if (fp8 || fp4) {
    const auto* pw13 = static_cast<const uint8_t*>(w13.data_ptr());
    const auto* pw2 = static_cast<const uint8_t*>(w2.data_ptr());
    const at::Tensor xf = x.to(at::kFloat);
    auto go = [&](auto* o) {
      if (fp4)
        run<FP4>(o, xf.data_ptr<float>(), pw13, pw2, pb13, pb2, s, act, ls);
      else
        run<FP8>(o, xf.data_ptr<float>(), pw13, pw2, pb13, pb2, s, act, ls);
    };
    if (dtype == at::kFloat)
      go(out.data_ptr<float>());
    else
      go(out.data_ptr<c10::BFloat16>());
    return out;
  }
  if (dtype == at::kFloat) {
    run<F32>(out.data_ptr<float>(), x.data_ptr<float>(), w13.data_ptr<float>(), w2.data_ptr<float>(), pb13, pb2,
             s, act);
    return out;
  }
  TORCH_CHECK(s.H % 2 == 0, "fused_moe: bfloat16 needs an even hidden size");
  auto* o = out.data_ptr<c10::BFloat16>();
  const auto* pw13 = static_cast<const uint32_t*>(w13.data_ptr());
  const auto* pw2 = static_cast<const uint32_t*>(w2.data_ptr());
  bool dp = bf16_dot.empty() || bf16_dot == "avx512_bf16" || bf16_dot == "amx_bf16";  // (no AMX tiles here)
#ifndef OI_MOE_DPBF16
  TORCH_CHECK(bf16_dot.empty() || bf16_dot == "fp32", "fused_moe: bf16_dot '", bf16_dot,
              "' is not a path of this build");
  dp = false;
#endif
  TORCH_CHECK(dp || bf16_dot.empty() || bf16_dot == "fp32", "fused_moe: unknown bf16_dot '", bf16_dot, "'");
  if (dp) {
    run<BF16_DP>(o, static_cast<const uint32_t*>(x.data_ptr()), pw13, pw2, pb13, pb2, s, act);
  } else {
    const at::Tensor xf = x.to(at::kFloat);
    run<BF16_FMA>(o, xf.data_ptr<float>(), pw13, pw2, pb13, pb2, s, act);
  }
  return out;
}
