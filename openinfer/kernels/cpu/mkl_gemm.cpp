// y = x @ W^T (+ b), float32, on a weight MKL packed once at load (cblas_sgemm_pack): the
// GEMM planner's "mkl_packed" path (openinfer/kernels/gemm_plan.py).
//
// Why: MKL's sgemm, behind F.linear, repacks W into its kernel's panel layout on every call.
// At decode's few rows that copy is most of the call (a 6144x1024 weight at 7 rows: 1.30 ms
// unpacked, 0.61 ms packed); at prefill's 512 rows it still costs ~10% (33.2 vs 29.9 ms per
// layer of the 0.27B peers model, shapes interleaved as in a forward; 2 Intel cores).
// torch's own wrapper (torch.ops.mkl._mkl_linear) runs the packed product only when the row
// count equals the one given at packing and falls back to the plain weight otherwise; MKL's
// packed buffer itself serves any row count (checked against F.linear at 1..2000 rows), so
// this calls cblas_sgemm_compute directly.
//
// The functions are the ones torch's MKL exports from libtorch_cpu (LP64: int dimensions).
// They are declared weak: a torch built without MKL leaves them null, and the path then
// reports itself unavailable instead of the extension failing to load.
// MKL's note: the packed buffer must not be moved (it holds addresses of its own); torch
// tensors never move their storage, and the plan keeps the one it packed.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <cstdint>

#include "ops.h"

extern "C" {
size_t cblas_sgemm_pack_get_size(int identifier, int m, int n, int k) __attribute__((weak));
void cblas_sgemm_pack(int layout, int identifier, int trans, int m, int n, int k, float alpha,
                      const float* src, int ld, float* dest) __attribute__((weak));
void cblas_sgemm_compute(int layout, int transa, int transb, int m, int n, int k, const float* a,
                         int lda, const float* b, int ldb, float beta, float* c, int ldc)
    __attribute__((weak));
}

namespace {

// CBLAS enum values (mkl_cblas.h).
constexpr int ROW_MAJOR = 101, NO_TRANS = 111, TRANS = 112, PACKED = 151, B_MATRIX = 162;

bool available() {
  return cblas_sgemm_pack_get_size != nullptr && cblas_sgemm_pack != nullptr &&
         cblas_sgemm_compute != nullptr;
}

int checked_int(int64_t v, const char* what) {
  TORCH_CHECK(v > 0 && v < (int64_t(1) << 31), "mkl_gemm: ", what, " out of range: ", v);
  return int(v);
}

}  // namespace

bool mkl_gemm_available() { return available(); }

// Bytes MKL needs for W [N, K] packed for rows of about ``rows`` (the layout it picks depends
// on them: packed for 16 rows, 512-row products ran 1.4x slower than packed for 512).
int64_t mkl_packed_bytes(int64_t N, int64_t K, int64_t rows) {
  TORCH_CHECK(available(), "mkl_gemm: this torch has no MKL packed GEMM");
  return int64_t(cblas_sgemm_pack_get_size(B_MATRIX, checked_int(rows, "rows"), checked_int(N, "N"),
                                           checked_int(K, "K")));
}

// Packs float32 W [N, K] into ``dest`` (at least mkl_packed_bytes(N, K, rows) bytes).
void mkl_pack_weight(at::Tensor& dest, const at::Tensor& weight, int64_t rows) {
  TORCH_CHECK(available(), "mkl_gemm: this torch has no MKL packed GEMM");
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.dim() == 2 && weight.is_contiguous(),
              "mkl_pack_weight: a contiguous float32 [N, K] weight");
  const int N = checked_int(weight.size(0), "N"), K = checked_int(weight.size(1), "K");
  TORCH_CHECK(dest.is_contiguous() && dest.nbytes() >= size_t(mkl_packed_bytes(N, K, rows)),
              "mkl_pack_weight: dest too small");
  // B = W^T (K x N): W row-major [N, K] read transposed.
  cblas_sgemm_pack(ROW_MAJOR, B_MATRIX, TRANS, checked_int(rows, "rows"), N, K, 1.0f,
                   weight.data_ptr<float>(), K, static_cast<float*>(dest.data_ptr()));
}

// x [M, K] @ W^T (+ bias [N]) -> [M, N], W from mkl_pack_weight (its N rows). Bias: out
// starts as the bias rows and MKL adds the product to it (beta = 1).
at::Tensor mkl_gemm(const at::Tensor& x_in, const at::Tensor& packed, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(available(), "mkl_gemm: this torch has no MKL packed GEMM");
  TORCH_CHECK(x_in.scalar_type() == at::kFloat, "mkl_gemm: float32 only");
  TORCH_CHECK(x_in.dim() == 2 && packed.is_contiguous() && packed.dim() == 2, "mkl_gemm: x [M, K], a packed weight");
  const at::Tensor x = x_in.contiguous();
  const int M = checked_int(x.size(0), "M"), K = checked_int(x.size(1), "K"),
            N = checked_int(packed.size(0), "N");
  at::Tensor out = at::empty({M, N}, x.options());
  float beta = 0.0f;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == N, "mkl_gemm: bias");
    out.copy_(bias->view({1, N}).expand({M, N}));
    beta = 1.0f;
  }
  cblas_sgemm_compute(ROW_MAJOR, NO_TRANS, PACKED, M, N, K, x.data_ptr<float>(), K,
                      static_cast<const float*>(packed.data_ptr()), N, beta,
                      out.data_ptr<float>(), N);
  return out;
}

