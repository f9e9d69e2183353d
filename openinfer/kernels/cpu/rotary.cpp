// Rotary position embedding (NeoX layout: dim i pairs with dim i + D/2) of q and k in one
// call, float32 or bfloat16. torch runs it as about ten ops per tensor (gather cos/sin,
// widen, split, four products, two sums, concatenate, narrow back); here each head row is
// read once and written once. The arithmetic is torch's, rounding for rounding: products and
// sums in float32 with no fused multiply-add (so bf16 results are bitwise torch's), then one
// rounding to the output type. Rows (token, head) are independent. Optionally fused with the
// per-head q/k RMSNorm before it (Qwen3).
// Built into the CPU attention extension (openinfer/kernels/cpu_attention.py).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>

#include <vector>

#include "norm_rows.h"
#include "ops.h"

namespace {

inline float as_float(float v) { return v; }
inline float as_float(c10::BFloat16 v) { return static_cast<float>(v); }

#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
// One head row: o = RoPE(x) with this position's cos/sin (half values each).
template <typename T>
inline void rotate_row(T* o, const T* xr, int64_t half, const float* c, const float* s) {
  using namespace oi_vec;
  int64_t i = 0;
  for (; i + W <= half; i += W) {  // the scalar loop's arithmetic, W lanes at a time
    const vf x1 = load_as_float(xr + i), x2 = load_as_float(xr + i + half);
    const vf cv = loadu(c + i), sv = loadu(s + i);
    const vf a = x1 * cv, b2 = x2 * sv, d = x2 * cv, f = x1 * sv;
    store_as(o + i, round_to(a - b2, o));
    store_as(o + i + half, round_to(d + f, o));
  }
  for (; i < half; ++i) {
    const float x1 = as_float(xr[i]), x2 = as_float(xr[i + half]);
    const float a = x1 * c[i], b2 = x2 * s[i], d = x2 * c[i], f = x1 * s[i];
    o[i] = T(a - b2);
    o[i + half] = T(d + f);
  }
}
#pragma GCC pop_options

template <typename T>
void rotate_rows(T* out, const T* x, int64_t rows, int64_t heads, int64_t dim, int64_t row_stride,
                 const int64_t* positions, const float* cos, const float* sin) {
  const int64_t half = dim / 2;
  at::parallel_for(0, rows * heads, std::max<int64_t>(1, 4096 / dim), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const int64_t t = r / heads;
      rotate_row(out + r * dim, x + t * row_stride + (r % heads) * dim, half, cos + positions[t] * half,
                 sin + positions[t] * half);
    }
  });
}

// Qwen3's q/k norm then RoPE, both tensors in one pass: each head row is normalised into a
// buffer (oi_norm: as rms_norm rounds it) and rotated from there (as rotate_rows rounds it),
// so the result is bitwise rms_norm followed by rotary_neox, with one read and one write of
// each row instead of two, and one fork/join instead of four.
template <typename T>
void norm_rotate_rows(T* q_out, T* k_out, const T* q, const T* k, int64_t rows, int64_t qh, int64_t kh,
                      int64_t dim, int64_t q_stride, int64_t k_stride, const T* qw, const T* kw, float eps,
                      const int64_t* positions, const float* cos, const float* sin) {
  const int64_t half = dim / 2;
  const int64_t heads = qh + kh;
  // Per token: first every head's 1/rms (independent rows, whose reductions and square roots
  // overlap), then each row scaled into a buffer and rotated from there.
  at::parallel_for(0, rows, std::max<int64_t>(1, 4096 / (dim * heads)), [&](int64_t b, int64_t e) {
    T normed[512];
    std::vector<float> inv(heads);
    for (int64_t t = b; t < e; ++t) {
      auto row = [&](int64_t h) { return h < qh ? q + t * q_stride + h * dim : k + t * k_stride + (h - qh) * dim; };
      for (int64_t h = 0; h < heads; ++h) inv[h] = oi_norm::inv_rms_of(oi_norm::sum_squares(row(h), dim), dim, eps);
      const float* c = cos + positions[t] * half;
      const float* s = sin + positions[t] * half;
      for (int64_t h = 0; h < heads; ++h) {
        T* o = h < qh ? q_out + (t * qh + h) * dim : k_out + (t * kh + h - qh) * dim;
        oi_norm::scale_row(normed, row(h), inv[h], h < qh ? qw : kw, dim);
        rotate_row(o, static_cast<const T*>(normed), half, c, s);
      }
    }
  });
}

void check(const at::Tensor& out, const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2),
              name, ": a CPU tensor [T, heads, D] with its heads side by side");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == x.sizes() && out.scalar_type() == x.scalar_type(),
              name, "'s output: contiguous, its shape and dtype");
}

}  // namespace

// q_out, k_out = RoPE(q, k) at `positions` (int64 [T]) from float32 caches [max_pos, D/2].
// With q_weight and k_weight: RoPE(rms_norm(q) * q_weight, rms_norm(k) * k_weight), each head
// row normalised (eps) as rms_norm does (Qwen3's q/k norm).
void rotary_neox(at::Tensor& q_out, at::Tensor& k_out, const at::Tensor& q, const at::Tensor& k,
                 const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
                 const c10::optional<at::Tensor>& q_weight, const c10::optional<at::Tensor>& k_weight,
                 double eps) {
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
  TORCH_CHECK(q_weight.has_value() == k_weight.has_value(), "rotary_neox: both norm weights or neither");
  if (q_weight.has_value()) {
    for (const at::Tensor* w : {&*q_weight, &*k_weight})
      TORCH_CHECK(w->scalar_type() == dtype && w->is_contiguous() && w->numel() == q.size(2),
                  "rotary_neox: norm weights of q's dtype and head_dim values");
    TORCH_CHECK(q.size(2) <= 512, "rotary_neox: the fused norm takes head_dim <= 512");
    const float e = static_cast<float>(eps);
    if (dtype == at::kFloat) {
      norm_rotate_rows(q_out.data_ptr<float>(), k_out.data_ptr<float>(), q.data_ptr<float>(),
                       k.data_ptr<float>(), q.size(0), q.size(1), k.size(1), q.size(2), q.stride(0),
                       k.stride(0), q_weight->data_ptr<float>(), k_weight->data_ptr<float>(), e, pos, c, s);
    } else {
      using B = c10::BFloat16;
      norm_rotate_rows(q_out.data_ptr<B>(), k_out.data_ptr<B>(), q.data_ptr<B>(), k.data_ptr<B>(),
                       q.size(0), q.size(1), k.size(1), q.size(2), q.stride(0), k.stride(0),
                       q_weight->data_ptr<B>(), k_weight->data_ptr<B>(), e, pos, c, s);
    }
    return;
  }
  if (dtype == at::kFloat) {
    rotate_rows(q_out.data_ptr<float>(), q.data_ptr<float>(), q.size(0), q.size(1), q.size(2), q.stride(0), pos, c, s);
    rotate_rows(k_out.data_ptr<float>(), k.data_ptr<float>(), k.size(0), k.size(1), k.size(2), k.stride(0), pos, c, s);
  } else {
    using B = c10::BFloat16;
    rotate_rows(q_out.data_ptr<B>(), q.data_ptr<B>(), q.size(0), q.size(1), q.size(2), q.stride(0), pos, c, s);
    rotate_rows(k_out.data_ptr<B>(), k.data_ptr<B>(), k.size(0), k.size(1), k.size(2), k.stride(0), pos, c, s);
  }
}

