// Portable SIMD helpers shared by the CPU kernels: GCC/Clang vector extensions of W float
// lanes (W = 16 with AVX-512, else 8, or -DOI_VEC_WIDTH); the compiler picks the instructions
// (-march=native). The same source is correct for any W.
#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#ifndef OI_VEC_WIDTH
#if defined(__AVX512F__)
#define OI_VEC_WIDTH 16
#else
#define OI_VEC_WIDTH 8
#endif
#endif

namespace oi_vec {

constexpr int W = OI_VEC_WIDTH;
static_assert(W == 8 || W == 16, "vector width must be 8 or 16 floats");

typedef float vf __attribute__((vector_size(W * 4)));
typedef int32_t vi __attribute__((vector_size(W * 4)));
typedef uint32_t vu __attribute__((vector_size(W * 4)));
typedef uint16_t vh __attribute__((vector_size(W * 2)));

// x - 0.0 is an identity (x + 0.0 is not, for -0.0), so this compiles to one broadcast.
inline vf splat(float x) { return x - vf{}; }
inline vf loadu(const float* p) {
  vf v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}
inline void storeu(float* p, vf v) { __builtin_memcpy(p, &v, sizeof v); }
inline vf load_as_float(const float* p) { return loadu(p); }
inline vf load_as_float(const c10::BFloat16* p) {
  // bf16 is the upper half of an fp32: widen and shift (exact). The generic conversion
  // compiles to five instructions per 16 values on AVX-512 (GCC 12); one widening load here.
#if defined(__AVX512F__) && OI_VEC_WIDTH == 16
  const __m512i u = _mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16);
  return (vf)u;
#elif defined(__AVX2__) && OI_VEC_WIDTH == 8
  const __m256i u = _mm256_slli_epi32(
      _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16);
  return (vf)u;
#else
  vh h;
  __builtin_memcpy(&h, p, sizeof h);
  vu u = __builtin_convertvector(h, vu) << 16;
  return (vf)u;
#endif
}
// Round to bfloat16 as c10::BFloat16(float) does (to nearest, ties to even; NaN to 0x7FC0),
// returned widened back to float (exact).
inline vf round_bf16(vf x) {
  const vu bits = (vu)x;
  const vu rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) & 0xFFFF0000u;
  const vu nan = vu{} + 0x7FC00000u;
  return (vf)(x != x ? nan : rounded);
}
// x rounded to the precision of the type p points to.
inline vf round_to(vf x, const float* /*p*/) { return x; }
inline vf round_to(vf x, const c10::BFloat16* /*p*/) { return round_bf16(x); }
// Stores W values (x already rounded to the type for bf16: round_bf16).
inline void store_as(float* p, vf x) { storeu(p, x); }
inline void store_as(c10::BFloat16* p, vf x) {
#if defined(__AVX512F__) && OI_VEC_WIDTH == 16
  // The upper halves, narrowed by truncation (vpmovdw).
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      _mm512_cvtepi32_epi16(_mm512_srli_epi32((__m512i)x, 16)));
#else
  vh h = __builtin_convertvector((vu)x >> 16, vh);
  __builtin_memcpy(p, &h, sizeof h);
#endif
}

inline vf vmax(vf a, vf b) { return a > b ? a : b; }

// Horizontal max and sum as a tree of halvings (log2 W dependent steps, not W - 1: on short
// rows, such as a 64-wide head's norm, the sequential chain was most of the row's time).
// The sum's order is fixed: the upper half of the lanes into the lower, and so on.
inline float hmax(vf v) {
#if defined(__AVX512F__) && OI_VEC_WIDTH == 16
  return _mm512_reduce_max_ps((__m512)v);
#else
  float t[W];
  __builtin_memcpy(t, &v, sizeof t);
  for (int half = W / 2; half >= 1; half /= 2)
    for (int i = 0; i < half; ++i) t[i] = std::max(t[i], t[i + half]);
  return t[0];
#endif
}
inline float hsum(vf v) {
#if defined(__AVX512F__) && OI_VEC_WIDTH == 16
  return _mm512_reduce_add_ps((__m512)v);
#else
  float t[W];
  __builtin_memcpy(t, &v, sizeof t);
  for (int half = W / 2; half >= 1; half /= 2)
    for (int i = 0; i < half; ++i) t[i] += t[i + half];
  return t[0];
#endif
}

// e^x for x <= 0 (softmax arguments), exactly 0 below -87.3 (so -inf, a masked score, gives 0).
// Cody-Waite reduction x = n ln2 + r, |r| <= ln2/2, a degree-7 Taylor polynomial for e^r
// (relative error ~5e-9), then the exponent bits of 2^n are added.
inline vf vexp(vf x) {
  const vf lo = splat(-87.3f);
  vi underflow = x < lo;
  x = x < lo ? lo : x;
  x = x > splat(0.f) ? splat(0.f) : x;
  const vf magic = splat(12582912.f);  // 1.5 * 2^23: adding it rounds to an integer
  vf t = x * 1.44269504f + magic;
  vi n = (vi)t - (vi)magic;
  vf nf = t - magic;
  vf r = x - nf * 0.693359375f;
  r = r - nf * -2.12194440e-4f;
  vf p = splat(1.f / 5040);
  p = p * r + 1.f / 720;
  p = p * r + 1.f / 120;
  p = p * r + 1.f / 24;
  p = p * r + 1.f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  vi bits = (n + 127) << 23;
  vf y = p * (vf)bits;
  return underflow ? splat(0.f) : y;
}

// 1 / (1 + e^-x) from e^-|x| (vexp takes arguments <= 0): 1 / (1 + z) for x >= 0, z / (1 + z)
// below, so neither branch overflows.
inline vf vsigmoid(vf x) {
  const vf z = vexp(x < 0.f ? x : -x);
  const vf one = splat(1.f);
  return (x >= 0.f ? one : z) / (one + z);
}

}  // namespace oi_vec
