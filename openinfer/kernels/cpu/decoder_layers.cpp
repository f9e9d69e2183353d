// A Llama-family model's decoder layers (Llama, Qwen2, Qwen3, Mistral: pre-norm GQA attention
// with RoPE + gated SiLU MLP) run in one call per step: for each layer, the residual add and
// RMSNorm, the q/k/v GEMM, RopeAttention, the output GEMM, the second add and norm, the
// gate/up GEMM, SiLU-and-multiply and the down GEMM. Each is the kernel the Python layers call,
// with the GEMM path their plan routes this row count to, so the result is bitwise theirs.
//
// Why: on a machine whose caches a kernel sweeps (weights and K/V stream through L2), the
// Python between two kernels runs cold. A segment that takes 2.4 us hot took ~30 us after a
// 4 MiB sweep, and a batch-32 decode step of a 16-layer model had ~130 of them: 6.2 ms of a
// 60 ms step (2026-12-05; benchmarks/bench_step_overhead.py). Here the step has one.
// Built into the CPU attention extension (openinfer/kernels/cpu_attention.py).

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/mm.h>

#include "ops.h"

// oneDNN's linear (kernels/gemm_paths.py's _onednn) on a plain or a packed weight: the op torch
// registers, through the dispatcher (it has no C++ function in torch's headers).
static at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                               std::string_view, c10::List<std::optional<at::Scalar>>,
                                               std::optional<std::string_view>)>();
  return op.call(x, weight, bias, "none", c10::List<std::optional<at::Scalar>>(), std::string_view(""));
}

const GemmRoute* Gemm::route(int64_t rows) const {
  for (const GemmRoute& r : routes)
    if (rows <= r.max_rows) return &r;
  return nullptr;
}

bool Gemm::covers(int64_t rows) const {
  const GemmRoute* r = route(rows);
  return r != nullptr && r->path != GEMM_OTHER;
}

at::Tensor Gemm::operator()(const at::Tensor& x) const {
  const int64_t rows = x.size(0);
  const GemmRoute* r = route(rows);
  TORCH_CHECK(r != nullptr && r->path != GEMM_OTHER, "Gemm: no route of this call's rows runs in C++");
  if (r->pads && rows > pad_from_rows && rows % pad_rows) {
    // As the Python plan: a prefill-sized call of a path that builds per row count runs on rows
    // padded with zeros to a multiple of pad_rows, and keeps the leading rows (contiguous).
    at::Tensor padded = at::empty({rows + pad_rows - rows % pad_rows, x.size(1)}, x.options());
    padded.narrow(0, 0, rows).copy_(x);
    padded.narrow(0, rows, padded.size(0) - rows).zero_();
    return run(*r, padded).narrow(0, 0, rows);
  }
  return run(*r, x);
}

at::Tensor Gemm::run(const GemmRoute& r, const at::Tensor& x) const {
  switch (r.path) {
#ifdef OI_AMX
    case GEMM_AMX:
      return amx_gemm(x, r.weight, bias);
#endif
    case GEMM_MKL:
      return mkl_gemm(x, r.weight, bias);
    case GEMM_SMALL: {
      at::Tensor out = at::empty({x.size(0), r.weight.size(0)}, x.options());
      small_gemm(out, x.contiguous(), r.weight, bias);
      return out;
    }
    case GEMM_TORCH:
      return at::linear(x, r.weight, bias);
    case GEMM_WIDENED: {  // as kernels/gemm_paths.py's _widened: float32 math on a 16-bit weight
      at::Tensor out = at::linear(x.to(at::kFloat), r.weight.to(at::kFloat),
                                  bias.has_value() ? c10::optional<at::Tensor>(bias->to(at::kFloat))
                                                   : c10::nullopt);
      return out.to(x.scalar_type());
    }
    case GEMM_TORCH_T: {  // as kernels/gemm_paths.py's _torch_t: (W @ x^T)^T, then the bias
      at::Tensor out = at::mm(r.weight, x.t()).t().contiguous();
      return bias.has_value() ? out.add_(*bias) : out;
    }
    case GEMM_ONEDNN:
      return onednn_linear(x, r.weight, bias);
    case GEMM_FP8: {  // as kernels/fp8_gemm.py's fp8_linear for its kernel's rows
      TORCH_CHECK(scale.has_value(), "Gemm: an fp8 route without scales");
      at::Tensor out = at::empty({x.size(0), r.weight.size(0)}, x.options());
      fp8_gemm(out, x.contiguous(), r.weight, *scale, block_n, block_k, bias);
      return out;
    }
    default:
      TORCH_CHECK(false, "Gemm: unknown path ", r.path);
  }
}

bool DecoderLayers::covers(int64_t rows) const {
  for (const DecoderLayer& l : layers)
    if (!(l.qkv.covers(rows) && l.o.covers(rows) && l.gate_up.covers(rows) && l.down.covers(rows))) return false;
  return true;
}

std::tuple<at::Tensor, at::Tensor, std::vector<at::Tensor>> DecoderLayers::forward(
    const at::Tensor& hidden, const std::vector<at::Tensor>& caches, const std::vector<AttentionStep>& steps,
    const std::vector<int64_t>& keep) const {
  TORCH_CHECK(caches.size() == layers.size() && steps.size() == layers.size(),
              "DecoderLayers: one cache and one step per layer");
  TORCH_CHECK(hidden.dim() == 2 && hidden.is_contiguous(), "DecoderLayers: hidden states [tokens, hidden]");
  at::Tensor x = hidden, residual;
  std::vector<at::Tensor> kept;
  size_t next_kept = 0;
  for (size_t i = 0; i < layers.size(); ++i) {
    const DecoderLayer& l = layers[i];
    at::Tensor normed = at::empty_like(x);
    if (!residual.defined()) {  // the first layer: the embeddings are the residual stream
      rms_norm(normed, x, l.input_norm, l.input_eps);
      residual = x;
    } else {
      at::Tensor sum = at::empty_like(x);
      add_rms_norm(normed, sum, x, residual, l.input_norm, l.input_eps);
      residual = sum;
    }
    // The stream entering layer i is `residual` now (a fresh tensor: the norms never write it).
    if (next_kept < keep.size() && keep[next_kept] == static_cast<int64_t>(i)) {
      kept.push_back(residual);
      ++next_kept;
    }
    at::Tensor cache = caches[i];
    const at::Tensor attended = l.attention.forward(l.qkv(normed), cache, steps[i]);
    const at::Tensor projected = l.o(attended);
    normed = at::empty_like(projected);
    at::Tensor sum = at::empty_like(projected);
    add_rms_norm(normed, sum, projected, residual, l.post_norm, l.post_eps);
    residual = sum;
    const at::Tensor gate_up = l.gate_up(normed);
    at::Tensor activated = at::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
    silu_and_mul(activated, gate_up);
    x = l.down(activated);
  }
  return {x, residual, kept};
}
