// Structured outputs: refuse the tokens a grammar's packed bitmask leaves clear, in place.
// The torch formulation unpacks every bit of every row into a [rows, V] temporary and then
// writes every logit; here a word whose 32 tokens are all allowed (most words of a loose
// mask) costs one compare, and a word with none allowed (most words of a tight one) one
// short fill. Rows are independent: one task per row.
// Built into the CPU attention extension (openinfer/kernels/cpu_attention.py).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <cstring>
#include <limits>

#include "ops.h"

namespace {

constexpr uint32_t kRefusedBits = 0xFF800000u;  // -inf

}  // namespace

// logits: [B, V] float32, contiguous. bitmask: [R, W] int32 (bit t % 32 of word t / 32 set:
// token t allowed), contiguous. rows: [R] int64, the logits row each mask row applies to.
void apply_token_bitmask(at::Tensor& logits, const at::Tensor& bitmask, const at::Tensor& rows) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous(),
              "logits must be a contiguous float32 [B, V] tensor");
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.scalar_type() == at::kInt && bitmask.is_contiguous(),
              "bitmask must be a contiguous int32 [R, W] tensor");
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong && rows.size(0) == bitmask.size(0),
              "rows must be an int64 [R] tensor");
  const int64_t B = logits.size(0), V = logits.size(1), W = bitmask.size(1), R = rows.size(0);
  TORCH_CHECK(W * 32 >= V, "bitmask has fewer bits than logits have columns");
  const int64_t* row_ids = rows.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r) TORCH_CHECK(row_ids[r] >= 0 && row_ids[r] < B, "row out of range");
  float* out = logits.data_ptr<float>();
  const uint32_t* masks = reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>());
  const float refused = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, R, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* row = out + row_ids[r] * V;
      const uint32_t* words = masks + r * W;
      for (int64_t w = 0; w * 32 < V; ++w) {
        const uint32_t word = words[w];
        if (word == 0xFFFFFFFFu) continue;
        const int64_t base = w * 32, n = std::min<int64_t>(32, V - base);
        if (word == 0) {
          for (int64_t b = 0; b < n; ++b) row[base + b] = refused;
        } else if (n == 32) {  // a fixed-length, branch-free blend the compiler vectorises
          float* __restrict x = row + base;
          for (int b = 0; b < 32; ++b) {
            const uint32_t keep = 0u - ((word >> b) & 1u);  // all ones: allowed
            uint32_t bits;
            std::memcpy(&bits, &x[b], 4);
            bits = (bits & keep) | (kRefusedBits & ~keep);
            std::memcpy(&x[b], &bits, 4);
          }
        } else {
          for (int64_t b = 0; b < n; ++b)
            if (!((word >> b) & 1u)) row[base + b] = refused;
        }
      }
    }
  });
}

