// Rotary position embedding (NeoX layout: dim i pairs with dim i + D/2) of q and k in one
// call, float32 or bfloat16. torch runs it as about ten ops per tensor (gather cos/sin,
// widen, split, four products, two sums, concatenate, narrow back); here each head row is
// read once and written once. The arithmetic is torch's, rounding for rounding: products and
// sums in float32 with no fused multiply-add (so bf16 results are bitwise torch's), then one
// rounding to the output type. Rows (token, head) are independent.
// Built into the CPU attention extension (openinfer/kernels/cpu_attention.py).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/csrc/utils/pybind.h>

namespace {

inline float as_float(float v) { return v; }
inline float as_float(c10::BFloat16 v) { return static_cast<float>(v); }

#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
template <typename T>
void rotate_rows(T* out, const T* x, int64_t rows, int64_t heads, int64_t dim, int64_t row_stride,
                 const int64_t* positions, const float* cos, const float* sin) {
  const int64_t half = dim / 2;
  at::parallel_for(0, rows * heads, std::max<int64_t>(1, 4096 / dim), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const int64_t t = r / heads, h = r % heads;
      const T* xr = x + t * row_stride + h * dim;
      T* o = out + r * dim;
      const float* c = cos + positions[t] * half;
      const float* s = sin + positions[t] * half;
      for (int64_t i = 0; i < half; ++i) {
        const float x1 = as_float(xr[i]), x2 = as_float(xr[i + half]);
        const float a = x1 * c[i], b2 = x2 * s[i], d = x2 * c[i], f = x1 * s[i];
        o[i] = T(a - b2);
        o[i + half] = T(d + f);
      }
    }
  });
}
#pragma GCC pop_options

void check(const at::Tensor& out, const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2),
              name, ": a CPU tensor [T, heads, D] with its heads side by side");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == x.sizes() && out.scalar_type() == x.scalar_type(),
              name, "'s output: contiguous, its shape and dtype");
}

// q_out, k_out = RoPE(q, k) at `positions` (int64 [T]) from float32 caches [max_pos, D/2].
void rotary_neox(at::Tensor& q_out, at::Tensor& k_out, const at::Tensor& q, const at::Tensor& k,
                 const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin) {
  check(q_out, q, "q");
  check(k_out, k, "k");
  const auto dtype = q.scalar_type();
  TORCH_CHECK(k.scalar_type() == dtype && (dtype == at::kFloat || dtype == at::kBFloat16),
              "rotary_neox: q and k both float32 or both bfloat16");
  TORCH_CHECK(q.size(2) == k.size(2) && q.size(2) % 2 == 0 && q.size(0) == k.size(0), "rotary_neox: shapes");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() &&
                  positions.numel() == q.size(0), "rotary_neox: positions, int64 [T]");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.size(-1) * 2 == q.size(2), "rotary_neox: the caches");
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < positions.numel(); ++t)
    TORCH_CHECK(pos[t] >= 0 && pos[t] < cos.size(0), "rotary_neox: a position past the cache");
  const float* c = cos.data_ptr<float>();
  const float* s = sin.data_ptr<float>();
  if (dtype == at::kFloat) {
    rotate_rows(q_out.data_ptr<float>(), q.data_ptr<float>(), q.size(0), q.size(1), q.size(2), q.stride(0), pos, c, s);
    rotate_rows(k_out.data_ptr<float>(), k.data_ptr<float>(), k.size(0), k.size(1), k.size(2), k.stride(0), pos, c, s);
  } else {
    using B = c10::BFloat16;
    rotate_rows(q_out.data_ptr<B>(), q.data_ptr<B>(), q.size(0), q.size(1), q.size(2), q.stride(0), pos, c, s);
    rotate_rows(k_out.data_ptr<B>(), k.data_ptr<B>(), k.size(0), k.size(1), k.size(2), k.stride(0), pos, c, s);
  }
}

}  // namespace

void register_rotary(pybind11::module& m) {
  m.def("rotary_neox", &rotary_neox, "q_out, k_out = RoPE(q, k) (NeoX pairs)", pybind11::arg("q_out"),
        pybind11::arg("k_out"), pybind11::arg("q"), pybind11::arg("k"), pybind11::arg("positions"),
        pybind11::arg("cos"), pybind11::arg("sin"), pybind11::call_guard<pybind11::gil_scoped_release>());
}
