// The extension's Python module: every entry point of ops.h, with its argument names and
// defaults. The only file that includes torch's Python binding headers (see ops.h). Kernels
// release the GIL while they run; the tiny queries keep it.

#include <torch/csrc/utils/pybind.h>

#include "ops.h"

namespace py = pybind11;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("paged_attention", &paged_attention, "Paged varlen attention (see openinfer/kernels/cpu_attention.py)",
        py::arg("out"), py::arg("q"), py::arg("key_cache"), py::arg("value_cache"), py::arg("block_tables"),
        py::arg("query_start_loc"), py::arg("seq_lens"), py::arg("scale"), py::arg("max_query_len"),
        py::arg("kv_splits") = 0, py::arg("invariant") = false, py::arg("window") = 0, py::arg("softcap") = 0.0,
        py::arg("sinks") = py::none(), py::arg("bf16_dot") = "", py::arg("k_scale") = 1.0,
        py::arg("v_scale") = 1.0, nogil);
  m.def("bf16_dot_paths", &bf16_dot_paths, "The bf16 product paths of this build: fp32, avx512_bf16, amx_bf16");
  m.def("plan_stats", &plan_stats, "(items, shared-prefix items, partial items) of a call's plan",
        py::arg("block_tables"), py::arg("query_start_loc"), py::arg("seq_lens"), py::arg("num_kv_heads"),
        py::arg("group"), py::arg("block_size"), py::arg("threads"), py::arg("kv_splits") = 0,
        py::arg("invariant") = false);
  m.def("isa", &isa, "The vector width and ISA macros this build was compiled with");
  m.def("rms_norm", &rms_norm, "out = rms_norm(x) * weight, float32 or bfloat16 rows", py::arg("out"),
        py::arg("x"), py::arg("weight"), py::arg("eps"), nogil);
  m.def("add_rms_norm", &add_rms_norm, "sum = x + residual; out = rms_norm(sum) * weight", py::arg("out"),
        py::arg("sum"), py::arg("x"), py::arg("residual"), py::arg("weight"), py::arg("eps"), nogil);
  m.def("fused_moe_tile", &fused_moe_tile, "output columns per packed weight tile of fused_moe");
  m.def("fused_moe", &fused_moe, "a MoE layer's routed experts (see openinfer/kernels/fused_moe.py)", py::arg("x"),
        py::arg("w13"), py::arg("w2"), py::arg("weights"), py::arg("slots"), py::arg("b13"), py::arg("b2"),
        py::arg("activation"), py::arg("alpha"), py::arg("limit"), py::arg("bf16_dot") = "",
        py::arg("w13_scale") = py::none(), py::arg("w2_scale") = py::none(), py::arg("block_k") = 0, nogil);
  m.def("fp8_gemm", &fp8_gemm,
        "out = x @ (weight * scale)^T (+ bias): a float8_e4m3fn weight with a float32 scale per "
        "block_n x block_k tile, few rows", py::arg("out"), py::arg("x"), py::arg("weight"), py::arg("scale"),
        py::arg("block_n"), py::arg("block_k"), py::arg("bias"), nogil);
  m.def("fp8_dequantize", &fp8_dequantize, "out = weight * scale (float32), a float8_e4m3fn weight with a "
        "float32 scale per block_n x block_k tile", py::arg("out"), py::arg("weight"), py::arg("scale"),
        py::arg("block_n"), py::arg("block_k"), nogil);
#ifndef OI_LANE_TWIN  // the twin (LANE_TWIN_SOURCES in cpu_attention.py) stops here
  m.def("evict_from_cache", &evict_from_cache,
        "Flush nbytes from address out of every cache level (the GEMM planner's cold timing); false where "
        "unsupported",
        py::arg("address"), py::arg("nbytes"), nogil);
  m.def("install_caching_allocator", &install_caching_allocator,
        "Make torch's CPU allocator keep freed blocks of 1 MiB or more, up to limit_bytes (see "
        "caching_allocator.cpp); a second call sets the limit. False where another allocator has precedence",
        py::arg("limit_bytes"));
  m.def("caching_allocator_stats", &caching_allocator_stats,
        "(hits, misses, cached bytes, limit, live blocks) of the caching allocator; empty before install");
  m.def("write_kv", &write_kv, "cache[:, slot] = k, v for every token (see write_kv.cpp)", py::arg("cache"),
        py::arg("k"), py::arg("v"), py::arg("slot_mapping"), py::arg("k_scale") = 1.0, py::arg("v_scale") = 1.0,
        nogil);
  // module_local: a twin build (another name, see build_extension) loads the same C++ types.
  py::class_<AttentionStep>(m, "AttentionStep", "A step's attention metadata for RopeAttention (made once per step)",
                            py::module_local())
      .def(py::init([](at::Tensor positions, at::Tensor slot_mapping, at::Tensor block_tables,
                       at::Tensor query_start_loc, at::Tensor seq_lens, int64_t max_query_len, std::string bf16_dot) {
             return AttentionStep{positions, slot_mapping, block_tables, query_start_loc, seq_lens, max_query_len,
                                  bf16_dot};
           }),
           py::arg("positions"), py::arg("slot_mapping"), py::arg("block_tables"), py::arg("query_start_loc"),
           py::arg("seq_lens"), py::arg("max_query_len"), py::arg("bf16_dot") = "");
  py::class_<RopeAttention>(m, "RopeAttention", "A layer's q/k norm + RoPE + K/V write + paged attention",
                            py::module_local())
      .def(py::init([](int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, at::Tensor cos, at::Tensor sin,
                       std::optional<at::Tensor> q_weight, std::optional<at::Tensor> k_weight, double eps,
                       double scale, int64_t window, double softcap, std::optional<at::Tensor> sinks,
                       double k_scale, double v_scale) {
             return RopeAttention{num_heads, num_kv_heads, head_dim, cos, sin, q_weight, k_weight, eps, scale,
                                  window, softcap, sinks, k_scale, v_scale};
           }),
           py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("cos"), py::arg("sin"),
           py::arg("q_weight"), py::arg("k_weight"), py::arg("eps"), py::arg("scale"), py::arg("window") = 0,
           py::arg("softcap") = 0.0, py::arg("sinks") = py::none(), py::arg("k_scale") = 1.0,
           py::arg("v_scale") = 1.0)
      .def("__call__", &RopeAttention::forward, py::arg("qkv"), py::arg("cache"), py::arg("step"), nogil);
  py::class_<Gemm>(m, "Gemm", "A GEMM plan's routes, callable from C++", py::module_local())
      .def(py::init([](const std::vector<std::tuple<int64_t, int64_t, at::Tensor, bool>>& routes,
                       std::optional<at::Tensor> bias, int64_t pad_from_rows, int64_t pad_rows,
                       std::optional<at::Tensor> scale, int64_t block_n, int64_t block_k) {
             Gemm g{{}, bias, pad_from_rows, pad_rows, scale, block_n, block_k};
             for (const auto& [max_rows, path, weight, pads] : routes) g.routes.push_back({max_rows, path, weight, pads});
             return g;
           }),
           py::arg("routes"), py::arg("bias"), py::arg("pad_from_rows"), py::arg("pad_rows"),
           py::arg("scale") = py::none(), py::arg("block_n") = 0, py::arg("block_k") = 0)
      .def("covers", &Gemm::covers, py::arg("rows"))
      .def("__call__", &Gemm::operator(), py::arg("x"), nogil);
  m.attr("GEMM_PATHS") = py::dict(py::arg("amx") = int64_t(GEMM_AMX), py::arg("mkl_packed") = int64_t(GEMM_MKL),
                                  py::arg("small_gemm") = int64_t(GEMM_SMALL), py::arg("torch") = int64_t(GEMM_TORCH),
                                  py::arg("torch_t") = int64_t(GEMM_TORCH_T), py::arg("onednn") = int64_t(GEMM_ONEDNN),
                                  py::arg("onednn_packed") = int64_t(GEMM_ONEDNN),
                                  py::arg("widened") = int64_t(GEMM_WIDENED), py::arg("fp8") = int64_t(GEMM_FP8));
  py::class_<DecoderLayer>(m, "DecoderLayer", "One Llama-family decoder layer's weights and kernels",
                           py::module_local())
      .def(py::init([](at::Tensor input_norm, double input_eps, at::Tensor post_norm, double post_eps, Gemm qkv,
                       Gemm o, Gemm gate_up, Gemm down, RopeAttention attention) {
             return DecoderLayer{input_norm, post_norm, input_eps, post_eps, qkv, o, gate_up, down, attention};
           }),
           py::arg("input_norm"), py::arg("input_eps"), py::arg("post_norm"), py::arg("post_eps"), py::arg("qkv"),
           py::arg("o"), py::arg("gate_up"), py::arg("down"), py::arg("attention"));
  py::class_<DecoderLayers>(m, "DecoderLayers", "A Llama-family model's decoder layers in one call per step",
                            py::module_local())
      .def(py::init([](std::vector<DecoderLayer> layers) { return DecoderLayers{layers}; }), py::arg("layers"))
      .def("covers", &DecoderLayers::covers, py::arg("rows"))
      .def("__call__", &DecoderLayers::forward, py::arg("hidden"), py::arg("caches"), py::arg("steps"),
           py::arg("keep") = std::vector<int64_t>{}, nogil);

  m.def("rotary_neox", &rotary_neox, "q_out, k_out = RoPE(q, k) (NeoX pairs)", py::arg("q_out"),
        py::arg("k_out"), py::arg("q"), py::arg("k"), py::arg("positions"), py::arg("cos"), py::arg("sin"),
        py::arg("q_weight") = py::none(), py::arg("k_weight") = py::none(), py::arg("eps") = 0.0, nogil);
  m.def("silu_and_mul", &silu_and_mul, "out = silu(x[..., :I]) * x[..., I:]", py::arg("out"), py::arg("x"),
        nogil);

  m.def("small_gemm", &small_gemm, "out = x @ weight^T (+ bias), float32 or bfloat16, few rows", py::arg("out"),
        py::arg("x"), py::arg("weight"), py::arg("bias"), nogil);
  m.def("amx_gemm_available", &amx_gemm_available, "whether this build and process can run amx_gemm");
#ifdef OI_AMX
  m.def("amx_pack_weight", &amx_pack_weight, "a bf16 [N, K] weight in amx_gemm's blocked layout",
        py::arg("weight"));
  m.def("amx_gemm", &amx_gemm, "x @ weight^T (+ bias), bf16, weight from amx_pack_weight", py::arg("x"),
        py::arg("packed"), py::arg("bias"), nogil);
#endif
  m.def("mkl_gemm_available", &mkl_gemm_available, "whether torch's MKL packed sgemm is here");
  m.def("mkl_packed_bytes", &mkl_packed_bytes, "bytes of a float32 [N, K] weight MKL-packed", py::arg("n"),
        py::arg("k"), py::arg("rows"));
  m.def("mkl_pack_weight", &mkl_pack_weight, "dest = the float32 [N, K] weight MKL-packed", py::arg("dest"),
        py::arg("weight"), py::arg("rows"), nogil);
  m.def("mkl_gemm", &mkl_gemm, "x @ weight^T (+ bias), float32, weight from mkl_pack_weight", py::arg("x"),
        py::arg("packed"), py::arg("bias"), nogil);

  m.def("apply_token_bitmask", &apply_token_bitmask,
        "logits[rows[r], t] = -inf where bit t of bitmask[r] is clear, in place", py::arg("logits"),
        py::arg("bitmask"), py::arg("rows"));
#endif
}
