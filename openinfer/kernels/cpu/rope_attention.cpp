// One attention layer from its merged q/k/v projection, in one call: the [T, (Hq + 2 Hkv) * D]
// rows are split into q, k and v (views), each q/k head row is normalised (Qwen3's q/k norm,
// where given) and rotated (NeoX RoPE), k and v go into the paged cache at the step's slots,
// and q attends. The kernels are the separate calls' own (rotary_neox, write_kv,
// paged_attention), so the result is bitwise theirs; what the one call saves is the Python
// between them: the split and views, the rotary and backend checks, three allocations and
// four bindings' argument parsing, ~50 us per layer of a batch-32 decode step (2026-12-05).
// Built into the CPU attention extension (openinfer/kernels/cpu_attention.py).

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include "ops.h"

at::Tensor RopeAttention::forward(const at::Tensor& qkv, at::Tensor& cache, const AttentionStep& step) const {
  const int64_t H = num_heads, Hkv = num_kv_heads, D = head_dim;
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 && qkv.size(1) == (H + 2 * Hkv) * D,
              "rope_attention: qkv must be [tokens, (heads + 2 * kv_heads) * head_dim], unit stride in features");
  TORCH_CHECK(cache.dim() == 5 && cache.size(0) == 2, "rope_attention: cache must be [2, blocks, block_size, H, D]");
  const int64_t T = qkv.size(0);
  const at::Tensor q = qkv.narrow(1, 0, H * D).view({T, H, D});
  const at::Tensor k = qkv.narrow(1, H * D, Hkv * D).view({T, Hkv, D});
  const at::Tensor v = qkv.narrow(1, (H + Hkv) * D, Hkv * D).view({T, Hkv, D});
  at::Tensor q_rot = at::empty({T, H, D}, qkv.options());
  at::Tensor k_rot = at::empty({T, Hkv, D}, qkv.options());
  rotary_neox(q_rot, k_rot, q, k, step.positions, cos, sin, q_weight, k_weight, eps);
  write_kv(cache, k_rot, v, step.slot_mapping, k_scale, v_scale);
  at::Tensor out = at::empty({T, H, D}, qkv.options());
  paged_attention(out, q_rot, cache.select(0, 0), cache.select(0, 1), step.block_tables, step.query_start_loc,
                  step.seq_lens, scale, step.max_query_len, /*kv_splits=*/0, /*invariant=*/false, window, softcap,
                  sinks, step.bf16_dot, k_scale, v_scale);
  return out.view({T, H * D});
}
