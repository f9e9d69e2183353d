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
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

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

// float8 e4m3 (1 sign, 4 exponent bits biased by 7, 3 mantissa bits; no infinities) read as 2^-8
// times its value: callers multiply each tile's scale by FP8_UNIT once (exact, a power of two).
// With F16C (every x86 CPU with AVX2): the byte into a 16-bit lane's high half, shifted right by
// one with its sign copied and the copy cleared, is an fp16 of that sign, those exponent bits
// (fp16's bias is 15 for e4m3's 7: the 2^-8) and mantissa, normal or subnormal alike; VCVTPH2PS
// widens 8 or 16 at once. Without (and in the lane twin, which tests it): the bits built straight into float32's fields, a subnormal
// (exponent 0) as its mantissa times 2^-9. No float32 denormal is ever formed (their arithmetic
// is slow on x86, and flushed to 0 under DAZ). The NaN encoding (S.1111.111) reads as +-480:
// checkpoints hold none.
constexpr float FP8_UNIT = 256.f;

#if defined(__F16C__) && defined(__AVX2__) && !defined(OI_LANE_TWIN)
inline vf load_fp8(const uint8_t* p) {
#if defined(__AVX512F__)
  const __m256i h = _mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 8);
  const __m512 f = _mm512_cvtph_ps(_mm256_and_si256(_mm256_srai_epi16(h, 1), _mm256_set1_epi16(int16_t(0xBFFF))));
#else
  const __m128i h = _mm_unpacklo_epi8(_mm_setzero_si128(), _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m256 f = _mm256_cvtph_ps(_mm_and_si128(_mm_srai_epi16(h, 1), _mm_set1_epi16(int16_t(0xBFFF))));
#endif
  vf v;
  std::memcpy(&v, &f, sizeof(v));
  return v;
}
#else
typedef uint8_t vb __attribute__((vector_size(L)));
typedef int32_t vi __attribute__((vector_size(L * 4)));

inline vf load_fp8(const uint8_t* p) {
  vb b;
  std::memcpy(&b, p, sizeof(b));
  const vu u = __builtin_convertvector(b, vu);
  const vu mag = u & 0x7f;
  const vu normal = (mag << 20) + (120u << 23);
  vf sub = __builtin_convertvector(vi(mag & 7), vf) * (1.f / 512.f);
  vu sub_bits;
  std::memcpy(&sub_bits, &sub, sizeof(sub));
  const vu bits = ((mag >> 3) == 0 ? sub_bits : normal) | ((u & 0x80) << 24);
  vf v;
  std::memcpy(&v, &bits, sizeof(v));
  return v * (1.f / FP8_UNIT);
}
#endif

inline float fp8_value(uint8_t b) {  // 2^-8 times the value, as load_fp8
  const uint32_t mag = b & 0x7f;
  float f;
  if (mag >> 3) {
    const uint32_t bits = (mag << 20) + (120u << 23);
    std::memcpy(&f, &bits, sizeof(f));
  } else {
    f = float(mag & 7) * (1.f / 512.f);
  }
  return ((b & 0x80) ? -f : f) * (1.f / FP8_UNIT);
}

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

template <int R, int MT>
inline void tile_fp8_at(const uint8_t* w, const float* scale, int64_t bn, int64_t kblocks, int64_t bk,
                        const float* x, int64_t K, float* out, int64_t N, const float* bias, int64_t n) {
  const float* s[R];
  for (int r = 0; r < R; ++r) s[r] = scale + ((n + r) / bn) * kblocks;
  tile_fp8<R, MT>(w + n * K, s, bk, x, K, out + n, N, bias ? bias + n : nullptr);
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
  for (int64_t n = n0; n < n1;) {
    const int64_t rows = n + R <= n1 ? R : 1;
    dequantize_rows(w, scale, bn, kblocks, bk, K, n, n + rows, buf.data());
    const float* bias_n = bias ? bias + n : nullptr;
    for (int64_t m = 0; m < M; m += 4) {
      const int64_t mt = std::min<int64_t>(4, M - m);
      const float* xm = x + m * K;
      float* om = out + m * N + n;
      if (rows == R) {
        switch (mt) {
          case 1: tile<R, 1>(buf.data(), xm, K, om, N, bias_n); break;
          case 2: tile<R, 2>(buf.data(), xm, K, om, N, bias_n); break;
          case 3: tile<R, 3>(buf.data(), xm, K, om, N, bias_n); break;
          default: tile<R, 4>(buf.data(), xm, K, om, N, bias_n); break;
        }
      } else {
        switch (mt) {
          case 1: tile<1, 1>(buf.data(), xm, K, om, N, bias_n); break;
          case 2: tile<1, 2>(buf.data(), xm, K, om, N, bias_n); break;
          case 3: tile<1, 3>(buf.data(), xm, K, om, N, bias_n); break;
          default: tile<1, 4>(buf.data(), xm, K, om, N, bias_n); break;
        }
      }
    }
    n += rows;
  }
}

// rows_block for an fp8 W: the same order of tiles, each row's scales looked up by its block.
template <int R>
void rows_block_fp8(const uint8_t* w, const float* scale, int64_t bn, int64_t kblocks, int64_t bk,
                    const float* x, int64_t M, int64_t K, float* out, int64_t N, int64_t n0, int64_t n1,
                    const float* bias) {
  for (int64_t n = n0; n < n1; n += R) {
    const bool full = n + R <= n1;
    for (int64_t m = 0; m < M; m += 4) {
      const int64_t mt = std::min<int64_t>(4, M - m);
      const float* xm = x + m * K;
      float* om = out + m * N;
      if (!full) {  // the range's last rows, one at a time
        for (int64_t t = n; t < n1; ++t) {
          switch (mt) {
            case 1: tile_fp8_at<1, 1>(w, scale, bn, kblocks, bk, xm, K, om, N, bias, t); break;
            case 2: tile_fp8_at<1, 2>(w, scale, bn, kblocks, bk, xm, K, om, N, bias, t); break;
            case 3: tile_fp8_at<1, 3>(w, scale, bn, kblocks, bk, xm, K, om, N, bias, t); break;
            default: tile_fp8_at<1, 4>(w, scale, bn, kblocks, bk, xm, K, om, N, bias, t); break;
          }
        }
        continue;
      }
      switch (mt) {
        case 1: tile_fp8_at<R, 1>(w, scale, bn, kblocks, bk, xm, K, om, N, bias, n); break;
        case 2: tile_fp8_at<R, 2>(w, scale, bn, kblocks, bk, xm, K, om, N, bias, n); break;
        case 3: tile_fp8_at<R, 3>(w, scale, bn, kblocks, bk, xm, K, om, N, bias, n); break;
        default: tile_fp8_at<R, 4>(w, scale, bn, kblocks, bk, xm, K, om, N, bias, n); break;
      }
    }
  }
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
