// The shared parts of the CPU paged attention (paged_attention.cpp, attention_two_pass.h): a
// step's work plan (items, merges), the call's parameters and the per-thread scratch.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <memory>
#include <utility>
#include <vector>

namespace oi_paged {

// Per-thread scratch, grown on demand and kept across calls (OpenMP threads persist).
struct Scratch {
  struct Free {
    void operator()(float* p) const { std::free(p); }
  };
  std::unique_ptr<float, Free> buf;
  size_t size = 0;
  float* get(size_t n) {
    if (n > size) {
      size_t bytes = ((n * sizeof(float) + 63) / 64) * 64;
      buf.reset(static_cast<float*>(std::aligned_alloc(64, bytes)));
      TORCH_CHECK(buf, "paged_attention: out of memory for scratch");
      size = n;
    }
    return buf.get();
  }
};
inline thread_local Scratch tls_scratch;

// A work item: the rows of `num_tok` query tokens (row_tokens[tok0 ..]) x the `group` query
// heads of KV head h, against KV blocks [blk0, blk1) of one block table.
struct Item {
  int32_t b;           // the sequence (its block table, causal mask); -1: a shared-prefix item
  int32_t table_b;     // whose block table is read
  int32_t h, num_heads; // KV heads [h, h + num_heads)
  int32_t tok0, num_tok;
  int32_t blk0, blk1;
  int64_t part_row;    // -1: writes `out`; else first row of its partial result
  int64_t cost;
};

// What a step's call does, planned once on the calling thread.
struct Plan {
  std::vector<Item> items;
  std::vector<int32_t> row_tokens;  // global token index of each item token
  // Rows that several items contribute to, merged afterwards: (token * Hkv + h, part_row).
  std::vector<std::pair<int64_t, int64_t>> merges;
  int64_t part_rows = 0;
  int tile_rows = 0;
};

// How the many-row items of a bf16 cache take their products (chosen per machine by
// openinfer/kernels/cpu_attention.py, which times them: VDPBF16PS is twice fp32 FMAs on Zen 5,
// no faster on Intel cores, where AMX tiles are the fast path).
enum Bf16Dot : int { BF16_FP32 = 0, BF16_AVX512 = 1, BF16_AMX = 2 };

struct Params {
  int Hq, Hkv, G, D, BS, BSP;
  Bf16Dot bf16_dot;
  float scale;                 // softmax scale x K's per-tensor scale x kv_unit (fp8.h)
  float v_out;                 // V's per-tensor scale x kv_unit: multiplies each result row
  const int32_t* qsl;
  const int32_t* seq_lens;
  const int32_t* tables;
  int64_t table_stride;
  int64_t q_s0, q_s1, o_s0, o_s1;
  int64_t k_s0, v_s0, kv_row;  // block stride (any), row stride within a block (= Hkv * D)
  int tile_rows;               // rows of the largest item (scratch sizing)
  bool invariant;              // batch-invariant mode: one score path for every item
  int window;                  // sliding window (0: none)
  float softcap;               // scores -> softcap * tanh(scores / softcap) (0: none)
  const float* sinks;          // [Hq] attention sink logits (nullptr: none)
  int chunk_blocks;            // blocks per softmax step
  const int32_t* row_tokens;
  float* part_o;  // [part_rows][D] unnormalised outputs of partial items
  float* part_m;  // [part_rows] their running max
  float* part_l;  // [part_rows] their running sum
};

constexpr int NO_MASK = std::numeric_limits<int>::max() / 2;  // position of shared-prefix rows

// The factor that turns a row's unnormalised output (running max m, running sum l) into its
// result: 1 / l, or with an attention sink s (a logit in the denominator with no value)
// e^(m - M) / (l e^(m - M) + e^(s - M)), M = max(m, s).
inline float normaliser(float m, float l, const float* sinks, int64_t head) {
  if (sinks == nullptr) return 1.f / l;
  const float s = sinks[head], mm = std::max(m, s), a = std::exp(m - mm);
  return a / (l * a + std::exp(s - mm));
}

}  // namespace oi_paged
