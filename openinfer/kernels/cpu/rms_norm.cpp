// RMSNorm for float32 rows, with the pre-norm residual add fused in: one pass over a row
// for the sum of squares, one to scale it. torch's CPU rms_norm is a composite of five ops
// (pow, mean, add, rsqrt, mul), each a full pass with its own threading; at decode sizes
// (a few thousand values per call, ~65 calls per step) their dispatch and fork/join cost
// more than the arithmetic. Rows are independent and each is reduced by one thread in one
// fixed order, so a row's result never depends on the batch (batch-invariant mode).
// Built into the CPU attention extension (openinfer/kernels/cpu_attention.py).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>

#include <cmath>
#include <cstdint>

namespace {

// Rows per task: enough values that a task outweighs handing it to a thread.
int64_t grain(int64_t n) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(n, 1)); }

inline float inv_rms(const float* x, int64_t n, float eps) {
  // Eight partial sums: a fixed reduction order the compiler vectorises.
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) acc[j] += x[i + j] * x[i + j];
  float s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
  for (; i < n; ++i) s += x[i] * x[i];
  return 1.0f / std::sqrt(s / static_cast<float>(n) + eps);
}

void check(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.device().is_cpu(), name, ": a float32 CPU tensor");
  TORCH_CHECK(t.is_contiguous(), name, ": must be contiguous");
}

}  // namespace

// out[r] = x[r] / rms(x[r]) * weight, for rows of length n = weight.numel(). x is [rows, n]
// or [T, H, n] with unit stride in its last dim and any stride in its first (the per-head
// q/k norm of a view into the fused q/k/v output); out is contiguous, x's shape.
void rms_norm(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  check(out, "out");
  check(weight, "weight");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.device().is_cpu(), "x: a float32 CPU tensor");
  const int64_t n = weight.numel();
  TORCH_CHECK(x.size(-1) == n && x.stride(-1) == 1 && out.numel() == x.numel(), "rms_norm: shapes");
  TORCH_CHECK(x.dim() == 2 || (x.dim() == 3 && x.stride(1) == n), "rms_norm: x's layout");
  const int64_t inner = x.dim() == 3 ? x.size(1) : 1;
  const int64_t outer_stride = x.stride(0);
  const int64_t rows = x.numel() / n;
  const float* px = x.data_ptr<float>();
  const float* pw = weight.data_ptr<float>();
  float* po = out.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, rows, grain(n), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* xr = px + (r / inner) * outer_stride + (r % inner) * n;
      float* orow = po + r * n;
      const float inv = inv_rms(xr, n, e);
      for (int64_t i = 0; i < n; ++i) orow[i] = xr[i] * inv * pw[i];
    }
  });
}

// sum[r] = x[r] + residual[r]; out[r] = rms_norm(sum[r]) (the pre-norm block's add + norm).
void add_rms_norm(at::Tensor& out, at::Tensor& sum, const at::Tensor& x, const at::Tensor& residual,
                  const at::Tensor& weight, double eps) {
  check(out, "out");
  check(sum, "sum");
  check(x, "x");
  check(residual, "residual");
  check(weight, "weight");
  const int64_t n = weight.numel();
  TORCH_CHECK(x.numel() % n == 0 && out.numel() == x.numel() && sum.numel() == x.numel() &&
                  residual.numel() == x.numel(),
              "add_rms_norm: shapes");
  const int64_t rows = x.numel() / n;
  const float* px = x.data_ptr<float>();
  const float* pres = residual.data_ptr<float>();
  const float* pw = weight.data_ptr<float>();
  float* psum = sum.data_ptr<float>();
  float* po = out.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, rows, grain(n), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      float* rr = psum + r * n;
      const float* xr = px + r * n;
      const float* res = pres + r * n;
      for (int64_t i = 0; i < n; ++i) rr[i] = xr[i] + res[i];
      float* orow = po + r * n;
      const float inv = inv_rms(rr, n, e);
      for (int64_t i = 0; i < n; ++i) orow[i] = rr[i] * inv * pw[i];
    }
  });
}

void register_rms_norm(pybind11::module& m) {
  m.def("rms_norm", &rms_norm, "out = rms_norm(x) * weight, float32 rows",
        pybind11::arg("out"), pybind11::arg("x"), pybind11::arg("weight"), pybind11::arg("eps"),
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("add_rms_norm", &add_rms_norm, "sum = x + residual; out = rms_norm(sum) * weight",
        pybind11::arg("out"), pybind11::arg("sum"), pybind11::arg("x"), pybind11::arg("residual"),
        pybind11::arg("weight"), pybind11::arg("eps"),
        pybind11::call_guard<pybind11::gil_scoped_release>());
}
