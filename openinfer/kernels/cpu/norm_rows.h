// The per-row pieces of the RMSNorm (rms_norm.cpp), shared with the fused q/k norm + RoPE
// (rotary.cpp) so that both round identically: the sum of squares in a fixed order, 1/rms,
// and the scaled row rounded as the dtype's torch reference rounds.
#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "vec.h"

namespace oi_norm {

using namespace oi_vec;

inline float as_float(float v) { return v; }
inline float as_float(c10::BFloat16 v) { return static_cast<float>(v); }

// Rows per task: enough values that a task outweighs handing it to a thread.
inline int64_t grain(int64_t n) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(n, 1)); }

// 1 / rms from a row's sum of squares.
inline float inv_rms_of(float sum_squares, int64_t n, float eps) {
  return 1.0f / std::sqrt(sum_squares / static_cast<float>(n) + eps);
}

// The sum of squares of a row: two vector accumulators (a fixed reduction order, whatever
// the batch), then the tail.
template <typename T>
inline float sum_squares(const T* x, int64_t n) {
  vf a0 = splat(0.f), a1 = splat(0.f);
  int64_t i = 0;
  for (; i + 2 * W <= n; i += 2 * W) {
    const vf u = load_as_float(x + i), v = load_as_float(x + i + W);
    a0 += u * u;
    a1 += v * v;
  }
  for (; i + W <= n; i += W) {
    const vf u = load_as_float(x + i);
    a0 += u * u;
  }
  float s = hsum(a0 + a1);
  for (; i < n; ++i) s += as_float(x[i]) * as_float(x[i]);
  return s;
}

// out[i] = x[i] * inv * w[i], rounded as the dtype's torch reference rounds (bf16: the
// normalised value, then the product). Vectors, then the same arithmetic on the tail.
template <typename T>
inline void scale_row(T* out, const T* x, float inv, const T* w, int64_t n) {
  int64_t i = 0;
  for (; i + W <= n; i += W)
    store_as(out + i, round_to(round_to(load_as_float(x + i) * inv, out) * load_as_float(w + i), out));
  for (; i < n; ++i) out[i] = T(as_float(T(as_float(x[i]) * inv)) * as_float(w[i]));
}

}  // namespace oi_norm
