// The extension's entry points, defined in the kernel files and bound to Python in bindings.cpp.
// The kernel files include this header and ATen's tensor headers only: torch's Python binding
// headers take ~7 s to compile per file (2026-12-04, GCC, -O3), so only bindings.cpp reads them
// and a fresh build compiles in about half the time.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "amx.h"

// paged_attention.cpp (contract: openinfer/kernels/cpu_attention.py)
void paged_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& key_cache,
                     const at::Tensor& value_cache, const at::Tensor& block_tables,
                     const at::Tensor& query_start_loc, const at::Tensor& seq_lens, double scale,
                     int64_t max_query_len, int64_t kv_splits, bool invariant, int64_t window, double softcap,
                     const std::optional<at::Tensor>& sinks, const std::string& bf16_dot, double k_scale = 1.0,
                     double v_scale = 1.0);
std::vector<std::string> bf16_dot_paths();
std::string isa();
std::tuple<int64_t, int64_t, int64_t> plan_stats(const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                                                 const at::Tensor& seq_lens, int64_t num_kv_heads, int64_t group,
                                                 int64_t block_size, int64_t threads, int64_t kv_splits,
                                                 bool invariant);
// cache_control.cpp: false where this CPU has no cache-line flush the build knows
bool evict_from_cache(int64_t address, int64_t nbytes);
// caching_allocator.cpp: true once installed (a later call sets the limit); stats are (hits,
// misses, cached bytes, limit, live blocks), empty before install
bool install_caching_allocator(int64_t limit_bytes);
std::vector<int64_t> caching_allocator_stats();
// write_kv.cpp
void write_kv(at::Tensor& cache, const at::Tensor& k, const at::Tensor& v, const at::Tensor& slot_mapping,
              double k_scale = 1.0, double v_scale = 1.0);
// rms_norm.cpp
void rms_norm(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps);
void add_rms_norm(at::Tensor& out, at::Tensor& sum, const at::Tensor& x, const at::Tensor& residual,
                  const at::Tensor& weight, double eps);
// rotary.cpp
void rotary_neox(at::Tensor& q_out, at::Tensor& k_out, const at::Tensor& q, const at::Tensor& k,
                 const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
                 const std::optional<at::Tensor>& q_weight, const std::optional<at::Tensor>& k_weight,
                 double eps);
// activation.cpp
void silu_and_mul(at::Tensor& out, const at::Tensor& x);
// small_gemm.cpp
void small_gemm(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight,
                const std::optional<at::Tensor>& bias);
void fp8_gemm(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale,
              int64_t block_n, int64_t block_k, const std::optional<at::Tensor>& bias);
void fp8_dequantize(at::Tensor& out, const at::Tensor& weight, const at::Tensor& scale, int64_t block_n,
                    int64_t block_k);
// fused_moe.cpp: a MoE layer's routed experts in one call (weights packed by
// openinfer/kernels/fused_moe.py for fused_moe_tile() columns per tile)
int64_t fused_moe_tile();
at::Tensor fused_moe(const at::Tensor& x, const at::Tensor& w13, const at::Tensor& w2, const at::Tensor& weights,
                     const at::Tensor& slots, const std::optional<at::Tensor>& b13,
                     const std::optional<at::Tensor>& b2, int64_t activation, double alpha, double limit,
                     const std::string& bf16_dot, const std::optional<at::Tensor>& w13_scale,
                     const std::optional<at::Tensor>& w2_scale, int64_t block_k);
// amx_gemm.cpp
bool amx_gemm_available();
#ifdef OI_AMX
at::Tensor amx_pack_weight(const at::Tensor& weight);
at::Tensor amx_gemm(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias);
#endif
// mkl_gemm.cpp
bool mkl_gemm_available();
int64_t mkl_packed_bytes(int64_t N, int64_t K, int64_t rows);
void mkl_pack_weight(at::Tensor& dest, const at::Tensor& weight, int64_t rows);
at::Tensor mkl_gemm(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias);
// rope_attention.cpp: a layer's q/k norm, RoPE, K/V write and paged attention in one call.
// The step's metadata, made once per step and read by every layer of its layer group.
struct AttentionStep {
  at::Tensor positions;        // [T] int64
  at::Tensor slot_mapping;     // [T] int64
  at::Tensor block_tables;     // [B, max_blocks] int32
  at::Tensor query_start_loc;  // [B + 1] int32
  at::Tensor seq_lens;         // [B] int32
  int64_t max_query_len;
  std::string bf16_dot;        // the process's bf16 product path ("": the build's default)
};
// A layer's constants, made once per layer.
struct RopeAttention {
  int64_t num_heads, num_kv_heads, head_dim;
  at::Tensor cos, sin;                          // float32 [max_position, D / 2]
  std::optional<at::Tensor> q_weight, k_weight;  // q/k norm weights (both or neither)
  double eps, scale;
  int64_t window;
  double softcap;
  std::optional<at::Tensor> sinks;
  double k_scale = 1.0, v_scale = 1.0;  // an fp8 cache's per-tensor scales
  // qkv [T, (Hq + 2 Hkv) * D] -> attention output [T, Hq * D]; the step's K/V stored in cache.
  at::Tensor forward(const at::Tensor& qkv, at::Tensor& cache, const AttentionStep& step) const;
};
// decoder_layers.cpp: a Llama-family model's decoder layers in one call per step.
// A GEMM as its plan (openinfer/kernels/gemm_plan.py) routes it: per bucket of rows, a path and the
// weight in that path's format. A path the C++ does not know is GEMM_OTHER.
enum GemmPathId : int64_t {
  GEMM_OTHER = -1, GEMM_AMX = 0, GEMM_MKL = 1, GEMM_SMALL = 2, GEMM_TORCH = 3, GEMM_TORCH_T = 4, GEMM_ONEDNN = 5,
  GEMM_WIDENED = 6, GEMM_FP8 = 7
};
struct GemmRoute {
  int64_t max_rows;
  int64_t path;
  at::Tensor weight;
  bool pads;  // the path builds per row count: prefill-sized calls run on padded rows
};
struct Gemm {
  std::vector<GemmRoute> routes;
  std::optional<at::Tensor> bias;
  int64_t pad_from_rows, pad_rows;
  // GEMM_FP8 (a block-scaled fp8 weight kept as loaded): its scales and their tile
  std::optional<at::Tensor> scale = std::nullopt;
  int64_t block_n = 0, block_k = 0;
  const GemmRoute* route(int64_t rows) const;
  bool covers(int64_t rows) const;
  at::Tensor operator()(const at::Tensor& x) const;
  at::Tensor run(const GemmRoute& r, const at::Tensor& x) const;
};
struct DecoderLayer {
  at::Tensor input_norm, post_norm;
  double input_eps, post_eps;
  Gemm qkv, o, gate_up, down;
  RopeAttention attention;
};
struct DecoderLayers {
  std::vector<DecoderLayer> layers;
  // Whether every GEMM's route for this many rows runs here.
  bool covers(int64_t rows) const;
  // hidden [T, H] (the embeddings) -> (x, residual) after the last layer, before the final norm,
  // and the residual stream entering each layer of `keep` (ascending; a drafter's features).
  std::tuple<at::Tensor, at::Tensor, std::vector<at::Tensor>> forward(
      const at::Tensor& hidden, const std::vector<at::Tensor>& caches, const std::vector<AttentionStep>& steps,
      const std::vector<int64_t>& keep) const;
};
// token_mask.cpp
void apply_token_bitmask(at::Tensor& logits, const at::Tensor& bitmask, const at::Tensor& rows);
