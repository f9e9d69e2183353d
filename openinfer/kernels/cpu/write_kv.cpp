// Stores a step's K and V rows into their cache slots: one call per layer. The torch version
// (openinfer/kernels/paged_attention.py: write_kv) is about ten ops per layer (the slot to
// row arithmetic, a copy of the strided V view, two index_copy_), which at decode sizes costs
// more than the bytes it moves. Here each token's K and V rows (H * D values, heads adjacent)
// are copied straight from the q/k/v projection's views to slot s = block * block_size +
// offset. Into a float8 cache (--kv-cache-dtype) each value x is stored as
// float8(clamp(float(x) * (1 / scale), -max, max)), rounded to nearest even: exactly
// openinfer/kernels/kv_quant.py's quantize_kv, the torch reference.
// Built into the CPU attention extension (openinfer/kernels/cpu_attention.py).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>

#include "ops.h"

namespace {

// Tokens per task: enough bytes that a task outweighs handing it to a thread.
int64_t grain(int64_t row_bytes) { return std::max<int64_t>(1, 65536 / std::max<int64_t>(row_bytes, 1)); }

// One row of n values into a float8 cache: scaled, clamped to the format's largest finite value
// (a plain conversion would make NaN of e4m3fn's overflow), rounded to nearest even.
template <typename C, typename T>
void quantize_row(char* dst, const char* src, int64_t n, float inv_scale) {
  const float limit = float(std::numeric_limits<C>::max());
  C* d = reinterpret_cast<C*>(dst);
  const T* x = reinterpret_cast<const T*>(src);
  for (int64_t i = 0; i < n; ++i) d[i] = C(std::clamp(float(x[i]) * inv_scale, -limit, limit));
}

bool is_fp8(at::ScalarType t) { return t == at::kFloat8_e4m3fn || t == at::kFloat8_e5m2; }

// [T, H, D] with unit stride in D and heads adjacent (any stride between tokens).
void check_rows(const at::Tensor& x, const char* name, const at::Tensor& cache) {
  const auto t = x.scalar_type();
  TORCH_CHECK(x.dim() == 3 && x.device().is_cpu() &&
                  (t == cache.scalar_type() ||
                   (is_fp8(cache.scalar_type()) && (t == at::kFloat || t == at::kBFloat16))),
              name, ": a [tokens, heads, head_dim] CPU tensor of the cache's dtype (float32 or bfloat16 into a "
              "float8 cache)");
  TORCH_CHECK(x.size(1) == cache.size(3) && x.size(2) == cache.size(4), name, ": heads and head_dim of the cache");
  TORCH_CHECK(x.stride(2) == 1 && x.stride(1) == x.size(2), name, ": rows of adjacent heads");
}

}  // namespace

// cache: [2, num_blocks, block_size, H, D] (K, V), any strides for its first two dims, each
// block's [block_size, H, D] contiguous. k, v: [T, H, D]. slot_mapping: [T] int64, each slot
// in [0, num_blocks * block_size).
// k_scale, v_scale: a float8 cache's per-tensor scales (other caches ignore them).
void write_kv(at::Tensor& cache, const at::Tensor& k, const at::Tensor& v, const at::Tensor& slot_mapping,
              double k_scale, double v_scale) {
  TORCH_CHECK(cache.dim() == 5 && cache.size(0) == 2 && cache.device().is_cpu(),
              "cache: a [2, num_blocks, block_size, heads, head_dim] CPU tensor");
  const int64_t num_blocks = cache.size(1), block_size = cache.size(2), H = cache.size(3), D = cache.size(4);
  TORCH_CHECK(cache.stride(4) == 1 && cache.stride(3) == D && cache.stride(2) == H * D,
              "cache: each block's [block_size, heads, head_dim] must be contiguous");
  check_rows(k, "k", cache);
  check_rows(v, "v", cache);
  TORCH_CHECK(k.scalar_type() == v.scalar_type(), "k and v: one dtype");
  TORCH_CHECK(k_scale > 0 && v_scale > 0, "k_scale and v_scale must be > 0");
  const int64_t T = k.size(0);
  TORCH_CHECK(v.size(0) == T && slot_mapping.dim() == 1 && slot_mapping.size(0) == T &&
                  slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous(),
              "slot_mapping: [tokens] int64, one slot per k/v row");
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t limit = num_blocks * block_size;
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(slots[t] >= 0 && slots[t] < limit, "slot_mapping: slot ", slots[t], " out of range");
  const int64_t elem = cache.element_size(), row_bytes = H * D * elem, in_elem = k.element_size();
  char* kc = static_cast<char*>(cache.data_ptr());
  char* vc = kc + cache.stride(0) * elem;
  const int64_t block_stride = cache.stride(1) * elem;
  const char* kp = static_cast<const char*>(k.data_ptr());
  const char* vp = static_cast<const char*>(v.data_ptr());
  const int64_t k_stride = k.stride(0) * in_elem, v_stride = v.stride(0) * in_elem;
  auto store = [&](auto copy_row) {
    at::parallel_for(0, T, grain(2 * row_bytes), [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t at = slots[t] / block_size * block_stride + slots[t] % block_size * row_bytes;
        copy_row(kc + at, kp + t * k_stride, float(1.0 / k_scale));
        copy_row(vc + at, vp + t * v_stride, float(1.0 / v_scale));
      }
    });
  };
  const auto cache_t = cache.scalar_type(), in_t = k.scalar_type();
  const int64_t n = H * D;
  if (cache_t == in_t) {
    store([&](char* dst, const char* src, float) { std::memcpy(dst, src, size_t(row_bytes)); });
  } else if (cache_t == at::kFloat8_e4m3fn && in_t == at::kFloat) {
    store([&](char* dst, const char* src, float inv) { quantize_row<c10::Float8_e4m3fn, float>(dst, src, n, inv); });
  } else if (cache_t == at::kFloat8_e4m3fn) {
    store([&](char* dst, const char* src, float inv) { quantize_row<c10::Float8_e4m3fn, c10::BFloat16>(dst, src, n, inv); });
  } else if (in_t == at::kFloat) {
    store([&](char* dst, const char* src, float inv) { quantize_row<c10::Float8_e5m2, float>(dst, src, n, inv); });
  } else {
    store([&](char* dst, const char* src, float inv) { quantize_row<c10::Float8_e5m2, c10::BFloat16>(dst, src, n, inv); });
  }
}

