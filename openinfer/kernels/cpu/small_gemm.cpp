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
// fp8_gemm: the same loop over a block-scaled float8 e4m3 W (DeepSeek-V3's and Qwen3-FP8's
// checkpoint format, kept as loaded: one byte per weight, and one float32 scale per bn x bk tile):
// each run of bk inputs is summed unscaled and then multiplied by its tile's scale, so the
// weight is never dequantized in memory (openinfer/kernels/fp8_gemm.py dispatches and holds the
// torch reference).
// Built into the CPU attention extension (openinfer/kernels/cpu_attention.py); the GEMM
// planner (openinfer/kernels/gemm_plan.py, path "small_gemm") times it against torch's paths at
// start-up and uses it only where it is faster and matches F.linear.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "fp8.h"
#include "ops.h"

namespace {

#if defined(OI_VEC_WIDTH)  // a lane twin's build (openinfer/kernels/cpu_attention.py)
constexpr int L = OI_VEC_WIDTH;
#elif defined(__AVX512F__)
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

template <int N>
using Rows = std::integral_constant<int, N>;

// Every tile of out for W rows [n0, n1) and all M rows of x, in order: W rows in steps of R (the
// range's last rows one at a time), each step's rows prepared once (prepare(n, rows)) and passed
// over by every group of up to four x rows (visit(Rows<R>, Rows<MT>, n, m)). Each W tile is
// read from memory once and stays in L1 while the x rows pass. An output's sum does not
// depend on the tile it falls in (one accumulator per output, K in order), so neither M nor
// the thread split changes a value.
template <int R, typename Prepare, typename Visit>
void for_each_tile(int64_t M, int64_t n0, int64_t n1, Prepare&& prepare, Visit&& visit) {
  for (int64_t n = n0; n < n1;) {
    const int64_t rows = n + R <= n1 ? R : 1;
    prepare(n, rows);
    for (int64_t m = 0; m < M; m += 4) {
      const int64_t mt = std::min<int64_t>(4, M - m);
      if (rows == R) {
        switch (mt) {
          case 1: visit(Rows<R>{}, Rows<1>{}, n, m); break;
          case 2: visit(Rows<R>{}, Rows<2>{}, n, m); break;
          case 3: visit(Rows<R>{}, Rows<3>{}, n, m); break;
          default: visit(Rows<R>{}, Rows<4>{}, n, m); break;
        }
      } else {
        switch (mt) {
          case 1: visit(Rows<1>{}, Rows<1>{}, n, m); break;
          case 2: visit(Rows<1>{}, Rows<2>{}, n, m); break;
          case 3: visit(Rows<1>{}, Rows<3>{}, n, m); break;
          default: visit(Rows<1>{}, Rows<4>{}, n, m); break;
        }
      }
    }
    n += rows;
  }
}

constexpr auto nothing_to_prepare = [](int64_t, int64_t) {};

template <int R, typename W>
void rows_block(const W* w, const float* x, int64_t M, int64_t K, float* out, int64_t N,
                int64_t n0, int64_t n1, const float* bias) {
  for_each_tile<R>(M, n0, n1, nothing_to_prepare, [&](auto r, auto mt, int64_t n, int64_t m) {
    tile<decltype(r)::value, decltype(mt)::value>(w + n * K, x + m * K, K, out + m * N + n, N,
                                                   bias ? bias + n : nullptr);
  });
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

using oi_vec::FP8_UNIT;
using oi_vec::fp8_value;
using oi_vec::load_fp8;

// out[m][n .. n+R) for MT rows of x, fp8 W rows n .. n+R whose scale rows are s[r] (one scale
// per bk inputs).
template <int R, int MT>
inline void tile_fp8(const uint8_t* w, const float* const* s, int64_t bk, const float* x, int64_t K,
                     float* out, int64_t N, const float* bias) {
  vf acc[R][MT];
  float tail[R][MT];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MT; ++m) acc[r][m] = vf{}, tail[r][m] = 0.f;
  for (int64_t k0 = 0, kb = 0; k0 < K; k0 += bk, ++kb) {
    const int64_t k1 = std::min(K, k0 + bk);
    vf part[R][MT];
    float part_tail[R][MT];
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MT; ++m) part[r][m] = vf{}, part_tail[r][m] = 0.f;
    int64_t k = k0;
    for (; k + L <= k1; k += L) {
      vf xv[MT];
      for (int m = 0; m < MT; ++m) xv[m] = load(x + m * K + k);
      for (int r = 0; r < R; ++r) {
        const vf wv = load_fp8(w + r * K + k);
        for (int m = 0; m < MT; ++m) part[r][m] += wv * xv[m];
      }
    }
    for (; k < k1; ++k)
      for (int r = 0; r < R; ++r)
        for (int m = 0; m < MT; ++m) part_tail[r][m] += fp8_value(w[r * K + k]) * x[m * K + k];
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MT; ++m) {
        acc[r][m] += part[r][m] * (s[r][kb] * FP8_UNIT);
        tail[r][m] += part_tail[r][m] * (s[r][kb] * FP8_UNIT);
      }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MT; ++m) {
      const float v = hsum(acc[r][m]) + tail[r][m];
      out[m * N + r] = bias ? v + bias[r] : v;
    }
}

// W rows [n0, n1) times their tiles' scales, as float32 rows of K in out: each product rounded
// once, the values of the reference dequantization (openinfer/kernels/fp8_gemm.py).
void dequantize_rows(const uint8_t* w, const float* scale, int64_t bn, int64_t kblocks, int64_t bk,
                     int64_t K, int64_t n0, int64_t n1, float* out) {
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* wn = w + n * K;
    const float* sn = scale + (n / bn) * kblocks;
    float* on = out + (n - n0) * K;
    for (int64_t k0 = 0, kb = 0; k0 < K; k0 += bk, ++kb) {
      const int64_t k1 = std::min(K, k0 + bk);
      const float sk = sn[kb] * FP8_UNIT;
      int64_t k = k0;
      for (; k + L <= k1; k += L) {
        const vf v = load_fp8(wn + k) * sk;
        std::memcpy(on + k, &v, sizeof(v));
      }
      for (; k < k1; ++k) on[k] = fp8_value(wn[k]) * sk;
    }
  }
}

// More than four x rows: each tile of R W rows is dequantized once into an L2-resident buffer
// and small_gemm's float32 tiles pass every group of four x rows over it (converting per group,
// as the fused tile does, would repeat the conversion M / 4 times).
template <int R>
void rows_block_fp8_buffered(const uint8_t* w, const float* scale, int64_t bn, int64_t kblocks, int64_t bk,
                             const float* x, int64_t M, int64_t K, float* out, int64_t N, int64_t n0,
                             int64_t n1, const float* bias) {
  std::vector<float> buf(R * K);
  for_each_tile<R>(
      M, n0, n1,
      [&](int64_t n, int64_t rows) { dequantize_rows(w, scale, bn, kblocks, bk, K, n, n + rows, buf.data()); },
      [&](auto r, auto mt, int64_t n, int64_t m) {
        tile<decltype(r)::value, decltype(mt)::value>(buf.data(), x + m * K, K, out + m * N + n, N,
                                                       bias ? bias + n : nullptr);
      });
}

// rows_block for an fp8 W: the same tiles, each W row's scales looked up by its block.
template <int R>
void rows_block_fp8(const uint8_t* w, const float* scale, int64_t bn, int64_t kblocks, int64_t bk,
                    const float* x, int64_t M, int64_t K, float* out, int64_t N, int64_t n0, int64_t n1,
                    const float* bias) {
  for_each_tile<R>(M, n0, n1, nothing_to_prepare, [&](auto r, auto mt, int64_t n, int64_t m) {
    constexpr int RR = decltype(r)::value;
    const float* s[RR];
    for (int i = 0; i < RR; ++i) s[i] = scale + ((n + i) / bn) * kblocks;
    tile_fp8<RR, decltype(mt)::value>(w + n * K, s, bk, x + m * K, K, out + m * N + n, N,
                                      bias ? bias + n : nullptr);
  });
}

}  // namespace

void fp8_gemm(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale,
              int64_t block_n, int64_t block_k, const std::optional<at::Tensor>& bias) {
  const auto dtype = x.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16) && out.scalar_type() == dtype,
              "fp8_gemm: x and out float32 or bfloat16, of one dtype");
  TORCH_CHECK(weight.scalar_type() == at::kFloat8_e4m3fn && scale.scalar_type() == at::kFloat,
              "fp8_gemm: a float8_e4m3fn weight and float32 scales");
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous() && scale.is_contiguous() && out.is_contiguous(),
              "fp8_gemm: contiguous tensors");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1) &&
                  out.size(0) == x.size(0) && out.size(1) == weight.size(0),
              "fp8_gemm: shapes");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  TORCH_CHECK(block_n > 0 && block_k > 0 && scale.dim() == 2 && scale.size(0) == (N + block_n - 1) / block_n &&
                  scale.size(1) == (K + block_k - 1) / block_k,
              "fp8_gemm: scales [ceil(N / block_n), ceil(K / block_k)]");
  at::Tensor b32;
  if (bias.has_value()) {
    TORCH_CHECK(bias->is_contiguous() && bias->numel() == N, "fp8_gemm: bias");
    b32 = bias->to(at::kFloat);
  }
  const float* pb = b32.defined() ? b32.data_ptr<float>() : nullptr;
  const at::Tensor x32 = dtype == at::kFloat ? x : x.to(at::kFloat);
  at::Tensor out32 = dtype == at::kFloat ? out : at::empty({M, N}, x32.options());
  const auto* pw = reinterpret_cast<const uint8_t*>(weight.data_ptr());
  const float* ps = scale.data_ptr<float>();
  const float* px = x32.data_ptr<float>();
  float* po = out32.data_ptr<float>();
  const int64_t kblocks = scale.size(1);
  // A quarter of small_gemm's float32 grain in rows streams as many bytes per task.
  const int64_t grain = std::max<int64_t>(8, 4 * 16384 / std::max<int64_t>(K, 1));
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    // One x row: eight W rows at a time, whose conversions interleave (1.07-1.29x four rows on 2
    // Zen 3 cores: converting e4m3, not memory, bounds this loop there).
    if (M == 1)
      rows_block_fp8<8>(pw, ps, block_n, kblocks, block_k, px, M, K, po, N, n0, n1, pb);
    else if (M <= 4)
      rows_block_fp8<2>(pw, ps, block_n, kblocks, block_k, px, M, K, po, N, n0, n1, pb);
    else
      rows_block_fp8_buffered<2>(pw, ps, block_n, kblocks, block_k, px, M, K, po, N, n0, n1, pb);
  });
  if (dtype != at::kFloat) out.copy_(out32);
}

void fp8_dequantize(at::Tensor& out, const at::Tensor& weight, const at::Tensor& scale, int64_t block_n,
                    int64_t block_k) {
  TORCH_CHECK(weight.scalar_type() == at::kFloat8_e4m3fn && scale.scalar_type() == at::kFloat &&
                  out.scalar_type() == at::kFloat,
              "fp8_dequantize: a float8_e4m3fn weight, float32 scales and out");
  TORCH_CHECK(weight.is_contiguous() && scale.is_contiguous() && out.is_contiguous() && weight.dim() == 2 &&
                  out.sizes() == weight.sizes(),
              "fp8_dequantize: contiguous tensors, out shaped as weight");
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(block_n > 0 && block_k > 0 && scale.dim() == 2 && scale.size(0) == (N + block_n - 1) / block_n &&
                  scale.size(1) == (K + block_k - 1) / block_k,
              "fp8_dequantize: scales [ceil(N / block_n), ceil(K / block_k)]");
  const auto* pw = reinterpret_cast<const uint8_t*>(weight.data_ptr());
  const float* ps = scale.data_ptr<float>();
  float* po = out.data_ptr<float>();
  const int64_t kblocks = scale.size(1);
  at::parallel_for(0, N, std::max<int64_t>(1, 65536 / std::max<int64_t>(K, 1)), [&](int64_t n0, int64_t n1) {
    dequantize_rows(pw, ps, block_n, kblocks, block_k, K, n0, n1, po + n0 * K);
  });
}

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
