// y = x @ W^T (+ b) for a few rows of x and a plain row-major W [N, K], float32 or bfloat16:
// decode's GEMMs. With one to a handful of rows the product is bound by streaming W from memory, not
// by arithmetic, and the BLAS/oneDNN GEMV paths stream it at about half the read bandwidth
// here (10.6 of 21.7 GB/s measured on 2 Zen 3 cores). This reads each W row once for all of
// x's rows: threads take contiguous ranges of W rows, and each inner step reads R rows of W
// side by side (R independent streams for the prefetchers) against up to four rows of x held
// in L1. Accumulation is in float32 lanes, reduced in a fixed order per output.
// A bfloat16 W is widened in registers (a bf16 is the top half of a float32: shift left 16),
// so it streams half the bytes of float32 at the same arithmetic, on any x86-64 CPU: where
// there are no bf16 dot-product instructions, ATen's bf16 GEMV converts element by element
// and runs slower than float32 (the point of this path; x is widened once, out rounded once).
// Built into the CPU attention extension (openinfer/kernels/cpu_attention.py); the GEMM
// planner (openinfer/kernels/gemm_plan.py, path "small_gemm") times it against torch's paths at
// start-up and uses it only where it is faster and matches F.linear.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "ops.h"

namespace {

#if defined(__AVX512F__)
constexpr int L = 16;
#else
constexpr int L = 8;
#endif
typedef float vf __attribute__((vector_size(L * 4)));

inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

typedef uint16_t vh __attribute__((vector_size(L * 2)));
typedef uint32_t vu __attribute__((vector_size(L * 4)));

inline vf load(const uint16_t* p) {  // L bfloat16s as float32 lanes
  vh h;
  std::memcpy(&h, p, sizeof(h));
  const vu u = __builtin_convertvector(h, vu) << 16;
  vf v;
  std::memcpy(&v, &u, sizeof(v));
  return v;
}

inline float widen(float w) { return w; }

inline float widen(uint16_t w) {
  const uint32_t u = uint32_t(w) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

inline float hsum(vf v) {
  float s = 0.f;
  for (int i = 0; i < L; ++i) s += v[i];
  return s;
}

// out[m][n .. n+R) for MT rows of x starting at x (row stride K), W rows n .. n+R.
template <int R, int MT, typename W>
inline void tile(const W* w, const float* x, int64_t K, float* out, int64_t N,
                 const float* bias) {
  vf acc[R][MT];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MT; ++m) acc[r][m] = vf{};
  int64_t k = 0;
  for (; k + L <= K; k += L) {
    vf xv[MT];
    for (int m = 0; m < MT; ++m) xv[m] = load(x + m * K + k);
    for (int r = 0; r < R; ++r) {
      const vf wv = load(w + r * K + k);
      for (int m = 0; m < MT; ++m) acc[r][m] += wv * xv[m];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MT; ++m) {
      float s = hsum(acc[r][m]);
      for (int64_t t = k; t < K; ++t) s += widen(w[r * K + t]) * x[m * K + t];
      out[m * N + r] = bias ? s + bias[r] : s;
    }
}

// W rows [n0, n1) against all M rows of x: each tile of R W rows is read from memory once
// and stays in L1 while every group of up to four x rows passes over it.
template <int R, typename W>
void rows_block(const W* w, const float* x, int64_t M, int64_t K, float* out, int64_t N,
                int64_t n0, int64_t n1, const float* bias) {
  for (int64_t n = n0; n < n1; n += R) {
    const bool full = n + R <= n1;
    for (int64_t m = 0; m < M; m += 4) {
      const int64_t mt = std::min<int64_t>(4, M - m);
      const float* xm = x + m * K;
      float* om = out + m * N;
      if (!full) {  // the range's last rows, one at a time
        for (int64_t t = n; t < n1; ++t) {
          const W* wt = w + t * K;
          const float* bt = bias ? bias + t : nullptr;
          switch (mt) {
            case 1: tile<1, 1>(wt, xm, K, om + t, N, bt); break;
            case 2: tile<1, 2>(wt, xm, K, om + t, N, bt); break;
            case 3: tile<1, 3>(wt, xm, K, om + t, N, bt); break;
            default: tile<1, 4>(wt, xm, K, om + t, N, bt); break;
          }
        }
        continue;
      }
      const W* wn = w + n * K;
      const float* bn = bias ? bias + n : nullptr;
      switch (mt) {
        case 1: tile<R, 1>(wn, xm, K, om + n, N, bn); break;
        case 2: tile<R, 2>(wn, xm, K, om + n, N, bn); break;
        case 3: tile<R, 3>(wn, xm, K, om + n, N, bn); break;
        default: tile<R, 4>(wn, xm, K, om + n, N, bn); break;
      }
    }
  }
}

template <typename W>
void run_rows(const W* pw, const float* px, int64_t M, int64_t K, float* po, int64_t N,
              const float* pb) {
  // Enough W rows per task that it streams ~64 KiB; ranges are contiguous so each thread
  // reads one run of memory.
  const int64_t grain = std::max<int64_t>(8, 16384 / std::max<int64_t>(K * int64_t(sizeof(W)) / 4, 1));
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    // One x row: four W streams at once; more rows: two W rows x four x rows per step
    // (eight accumulators, within AVX2's sixteen registers).
    if (M == 1)
      rows_block<4>(pw, px, M, K, po, N, n0, n1, pb);
    else
      rows_block<2>(pw, px, M, K, po, N, n0, n1, pb);
  });
}

}  // namespace

void small_gemm(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight,
                const c10::optional<at::Tensor>& bias) {
  const auto dtype = weight.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16) && x.scalar_type() == dtype &&
                  out.scalar_type() == dtype,
              "small_gemm: float32 or bfloat16, x, weight and out of one dtype");
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous() && out.is_contiguous(),
              "small_gemm: contiguous tensors");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1) &&
                  out.size(0) == x.size(0) && out.size(1) == weight.size(0),
              "small_gemm: shapes");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  at::Tensor b32;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == dtype && bias->is_contiguous() && bias->numel() == N,
                "small_gemm: bias");
    b32 = bias->to(at::kFloat);
  }
  const float* pb = b32.defined() ? b32.data_ptr<float>() : nullptr;
  if (dtype == at::kFloat) {
    run_rows(weight.data_ptr<float>(), x.data_ptr<float>(), M, K, out.data_ptr<float>(), N, pb);
    return;
  }
  const at::Tensor x32 = x.to(at::kFloat);
  at::Tensor out32 = at::empty({M, N}, x32.options());
  run_rows(reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>()), x32.data_ptr<float>(), M,
           K, out32.data_ptr<float>(), N, pb);
  out.copy_(out32);
}
