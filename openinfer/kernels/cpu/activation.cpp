// SiLU-and-multiply of the gated MLP, float32 or bfloat16: out = silu(gate) * up over the
// [gate | up] rows MergedLinear produces, in one pass. torch runs it as two ops (silu, then
// mul), each a full pass over the intermediate activations with its own threading: at
// prefill sizes (thousands of rows of 3072 or more) they are memory-bound passes, at decode
// sizes mostly dispatch. Each value depends only on its own gate and up, so any batch gives
// the same bits.
//
// silu(g) = g * sigmoid(g) (vec.h's vsigmoid). bfloat16 rounds where torch's two ops do: silu
// rounded to bf16, then the product rounded again.
// Built into the CPU attention extension (openinfer/kernels/cpu_attention.py).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>

#include "ops.h"
#include "vec.h"

namespace {

using namespace oi_vec;

inline vf silu(vf g) { return g * vsigmoid(g); }

// W results of gate g and up u, rounded as torch rounds its two ops for T.
template <typename T>
inline vf silu_mul(vf g, vf u, const T* p) {
  return round_to(round_to(silu(g), p) * u, p);
}

template <typename T>
void silu_and_mul_rows(T* out, const T* x, int64_t rows, int64_t inter) {
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(inter, 1));
  at::parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* gate = x + r * 2 * inter;
      const T* up = gate + inter;
      T* o = out + r * inter;
      int64_t i = 0;
      for (; i + W <= inter; i += W)
        store_as(o + i, silu_mul(load_as_float(gate + i), load_as_float(up + i), o));
      if (i < inter) {  // the tail, zero-padded to a whole vector
        T g[W] = {}, u[W] = {}, res[W];
        for (int64_t e = i; e < inter; ++e) g[e - i] = gate[e], u[e - i] = up[e];
        store_as(res, silu_mul(load_as_float(g), load_as_float(u), o));
        for (int64_t e = i; e < inter; ++e) o[e] = res[e - i];
      }
    }
  });
}

}  // namespace

// out [rows, I] = silu(x[:, :I]) * x[:, I:], x [rows, 2I] contiguous; both float32 or bfloat16.
void silu_and_mul(at::Tensor& out, const at::Tensor& x) {
  const auto dtype = x.scalar_type();
  TORCH_CHECK(x.device().is_cpu() && (dtype == at::kFloat || dtype == at::kBFloat16),
              "silu_and_mul: x must be a float32 or bfloat16 CPU tensor");
  TORCH_CHECK(out.scalar_type() == dtype && out.device().is_cpu(), "silu_and_mul: out's dtype");
  TORCH_CHECK(x.is_contiguous() && out.is_contiguous(), "silu_and_mul: contiguous tensors only");
  const int64_t inter = x.size(-1) / 2;
  TORCH_CHECK(x.size(-1) == 2 * inter && out.size(-1) == inter && out.numel() * 2 == x.numel(),
              "silu_and_mul: x is [..., 2I] and out [..., I]");
  const int64_t rows = inter ? out.numel() / inter : 0;
  if (dtype == at::kFloat)
    silu_and_mul_rows(out.data_ptr<float>(), x.data_ptr<float>(), rows, inter);
  else
    silu_and_mul_rows(out.data_ptr<c10::BFloat16>(), x.data_ptr<c10::BFloat16>(), rows, inter);
}

