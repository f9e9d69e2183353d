// RMSNorm for float32 and bfloat16 rows, with the pre-norm residual add fused in: one pass
// over a row for the sum of squares (and the add), one to scale it. torch's CPU rms_norm is a composite of
// five ops (pow, mean, add, rsqrt, mul; eight with bf16's casts), each a full pass with its
// own threading; at decode sizes (a few thousand values per call, ~65 calls per step) their
// dispatch and fork/join cost more than the arithmetic. Rows are independent and each is
// reduced by one thread in one fixed order, so a row's result never depends on the batch
// (batch-invariant mode).
//
// bfloat16 rounds where the Hugging Face models do (openinfer/layers/norm.py's torch path):
// the residual sum is rounded to bf16; the row is normalised in float32 and rounded to bf16,
// then multiplied by the bf16 weight and rounded again.
// Built into the CPU attention extension (openinfer/kernels/cpu_attention.py).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>

#include <cmath>
#include <cstdint>

#include "norm_rows.h"
#include "ops.h"

namespace {

using namespace oi_norm;

// sum[i] = x[i] + r[i] in T; returns the sum of squares of sum (as stored), in
// sum_squares' order: the add and the reduction in one pass over the row.
template <typename T>
inline float add_row(T* sum, const T* x, const T* r, int64_t n) {
  vf a0 = splat(0.f), a1 = splat(0.f);
  int64_t i = 0;
  for (; i + 2 * W <= n; i += 2 * W) {
    const vf u = round_to(load_as_float(x + i) + load_as_float(r + i), sum);
    const vf v = round_to(load_as_float(x + i + W) + load_as_float(r + i + W), sum);
    store_as(sum + i, u);
    store_as(sum + i + W, v);
    a0 += u * u;
    a1 += v * v;
  }
  for (; i + W <= n; i += W) {
    const vf u = round_to(load_as_float(x + i) + load_as_float(r + i), sum);
    store_as(sum + i, u);
    a0 += u * u;
  }
  float s = hsum(a0 + a1);
  for (; i < n; ++i) {
    sum[i] = T(as_float(x[i]) + as_float(r[i]));
    s += as_float(sum[i]) * as_float(sum[i]);
  }
  return s;
}

void check(const at::Tensor& t, const char* name, at::ScalarType dtype) {
  TORCH_CHECK(t.scalar_type() == dtype && t.device().is_cpu(), name,
              ": a CPU tensor of the norm's dtype (float32 or bfloat16)");
  TORCH_CHECK(t.is_contiguous(), name, ": must be contiguous");
}

template <typename T>
void rms_norm_rows(T* po, const T* px, const T* pw, int64_t rows, int64_t n, int64_t inner,
                   int64_t outer_stride, float eps) {
  at::parallel_for(0, rows, grain(n), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = px + (r / inner) * outer_stride + (r % inner) * n;
      scale_row(po + r * n, xr, inv_rms_of(sum_squares(xr, n), n, eps), pw, n);
    }
  });
}

template <typename T>
void add_rms_norm_rows(T* po, T* psum, const T* px, const T* pres, const T* pw, int64_t rows,
                       int64_t n, float eps) {
  at::parallel_for(0, rows, grain(n), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      T* rr = psum + r * n;
      const T* xr = px + r * n;
      const T* res = pres + r * n;
      scale_row(po + r * n, rr, inv_rms_of(add_row(rr, xr, res, n), n, eps), pw, n);
    }
  });
}

}  // namespace

// out[r] = x[r] / rms(x[r]) * weight, for rows of length n = weight.numel(). x is [rows, n]
// or [T, H, n] with unit stride in its last dim and any stride in its first (the per-head
// q/k norm of a view into the fused q/k/v output); out is contiguous, x's shape. All three
// float32, or all three bfloat16.
void rms_norm(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  const auto dtype = x.scalar_type();
  check(out, "out", dtype);
  check(weight, "weight", dtype);
  TORCH_CHECK(x.device().is_cpu() && (dtype == at::kFloat || dtype == at::kBFloat16),
              "x: a float32 or bfloat16 CPU tensor");
  const int64_t n = weight.numel();
  TORCH_CHECK(x.size(-1) == n && x.stride(-1) == 1 && out.numel() == x.numel(), "rms_norm: shapes");
  TORCH_CHECK(x.dim() == 2 || (x.dim() == 3 && x.stride(1) == n), "rms_norm: x's layout");
  const int64_t inner = x.dim() == 3 ? x.size(1) : 1;
  const int64_t rows = x.numel() / n;
  const float e = static_cast<float>(eps);
  if (dtype == at::kFloat)
    rms_norm_rows(out.data_ptr<float>(), x.data_ptr<float>(), weight.data_ptr<float>(), rows, n,
                  inner, x.stride(0), e);
  else
    rms_norm_rows(out.data_ptr<c10::BFloat16>(), x.data_ptr<c10::BFloat16>(),
                  weight.data_ptr<c10::BFloat16>(), rows, n, inner, x.stride(0), e);
}

// sum[r] = x[r] + residual[r]; out[r] = rms_norm(sum[r]) (the pre-norm block's add + norm).
void add_rms_norm(at::Tensor& out, at::Tensor& sum, const at::Tensor& x, const at::Tensor& residual,
                  const at::Tensor& weight, double eps) {
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "x: float32 or bfloat16");
  check(out, "out", dtype);
  check(sum, "sum", dtype);
  check(x, "x", dtype);
  check(residual, "residual", dtype);
  check(weight, "weight", dtype);
  const int64_t n = weight.numel();
  TORCH_CHECK(x.numel() % n == 0 && out.numel() == x.numel() && sum.numel() == x.numel() &&
                  residual.numel() == x.numel(),
              "add_rms_norm: shapes");
  const int64_t rows = x.numel() / n;
  const float e = static_cast<float>(eps);
  if (dtype == at::kFloat)
    add_rms_norm_rows(out.data_ptr<float>(), sum.data_ptr<float>(), x.data_ptr<float>(),
                      residual.data_ptr<float>(), weight.data_ptr<float>(), rows, n, e);
  else
    add_rms_norm_rows(out.data_ptr<c10::BFloat16>(), sum.data_ptr<c10::BFloat16>(),
                      x.data_ptr<c10::BFloat16>(), residual.data_ptr<c10::BFloat16>(),
                      weight.data_ptr<c10::BFloat16>(), rows, n, e);
}

