// float8 values read into float32 lanes: e4m3 weights for small_gemm.cpp's fp8_gemm and
// fused_moe.cpp's fp8 experts (block-scaled checkpoints kept as loaded; the torch reference is
// openinfer/kernels/fp8_gemm.py's dequantize), and e4m3 or e5m2 KV caches for the paged attention
// (--kv-cache-dtype; the torch reference is openinfer/kernels/kv_quant.py).
#pragma once

#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>

#include <cstdint>
#include <type_traits>

#include "vec.h"

namespace oi_vec {

// float8 e4m3 (1 sign, 4 exponent bits biased by 7, 3 mantissa bits; no infinities) read as 2^-8
// times its value: callers multiply each tile's scale by FP8_UNIT once (exact, a power of two).
// With F16C (every x86 CPU with AVX2): the byte into a 16-bit lane's high half, shifted right by
// one with its sign copied and the copy cleared, is an fp16 of that sign, those exponent bits
// (fp16's bias is 15 for e4m3's 7: the 2^-8) and mantissa, normal or subnormal alike; VCVTPH2PS
// widens 8 or 16 at once. Without (and in the lane twin, which tests it): the bits built
// straight into float32's fields, a subnormal (exponent 0) as its mantissa times 2^-9. No
// float32 denormal is ever formed (their arithmetic is slow on x86, and flushed to 0 under DAZ).
// The NaN encoding (S.1111.111) reads as +-480: checkpoints hold none.
constexpr float FP8_UNIT = 256.f;

#if defined(__F16C__) && defined(__AVX2__) && !defined(OI_LANE_TWIN)
inline vf load_fp8(const uint8_t* p) {
#if OI_VEC_WIDTH == 16 && defined(__AVX512F__)
  const __m256i h = _mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 8);
  const __m512 f = _mm512_cvtph_ps(_mm256_and_si256(_mm256_srai_epi16(h, 1), _mm256_set1_epi16(int16_t(0xBFFF))));
#else
  const __m128i h = _mm_unpacklo_epi8(_mm_setzero_si128(), _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m256 f = _mm256_cvtph_ps(_mm_and_si128(_mm_srai_epi16(h, 1), _mm_set1_epi16(int16_t(0xBFFF))));
#endif
  vf v;
  __builtin_memcpy(&v, &f, sizeof(v));
  return v;
}
#else
typedef uint8_t vb __attribute__((vector_size(W)));

inline vf load_fp8(const uint8_t* p) {
  vb b;
  __builtin_memcpy(&b, p, sizeof(b));
  const vu u = __builtin_convertvector(b, vu);
  const vu mag = u & 0x7f;
  const vu normal = (mag << 20) + (120u << 23);
  vf sub = __builtin_convertvector(vi(mag & 7), vf) * (1.f / 512.f);
  vu sub_bits;
  __builtin_memcpy(&sub_bits, &sub, sizeof(sub));
  const vu bits = ((mag >> 3) == 0 ? sub_bits : normal) | ((u & 0x80) << 24);
  vf v;
  __builtin_memcpy(&v, &bits, sizeof(v));
  return v * (1.f / FP8_UNIT);
}
#endif

inline float fp8_value(uint8_t b) {  // 2^-8 times the value, as load_fp8
  const uint32_t mag = b & 0x7f;
  float f;
  if (mag >> 3) {
    const uint32_t bits = (mag << 20) + (120u << 23);
    __builtin_memcpy(&f, &bits, sizeof(f));
  } else {
    f = float(mag & 7) * (1.f / 512.f);
  }
  return ((b & 0x80) ? -f : f) * (1.f / FP8_UNIT);
}

// float8 e5m2 (1 sign, 5 exponent bits biased by 15 as fp16's, 2 mantissa bits) is the high byte
// of an fp16: read exactly (no unit). The lane twin builds the float32 fields, a subnormal as its
// mantissa times 2^-16. Infinities and NaN (exponent 31) read as finite values: KV writes clamp
// to the largest finite value, so a cache holds none.
#if defined(__F16C__) && defined(__AVX2__) && !defined(OI_LANE_TWIN)
inline vf load_fp8_e5m2(const uint8_t* p) {
#if OI_VEC_WIDTH == 16 && defined(__AVX512F__)
  const __m512 f = _mm512_cvtph_ps(
      _mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 8));
#else
  const __m256 f = _mm256_cvtph_ps(_mm_unpacklo_epi8(_mm_setzero_si128(), _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#endif
  vf v;
  __builtin_memcpy(&v, &f, sizeof(v));
  return v;
}
#else
inline vf load_fp8_e5m2(const uint8_t* p) {
  vb b;
  __builtin_memcpy(&b, p, sizeof(b));
  const vu u = __builtin_convertvector(b, vu);
  const vu mag = u & 0x7f;
  const vu normal = (mag << 21) + (112u << 23);
  vf sub = __builtin_convertvector(vi(mag & 3), vf) * (1.f / 65536.f);
  vu sub_bits;
  __builtin_memcpy(&sub_bits, &sub, sizeof(sub));
  const vu bits = ((mag >> 2) == 0 ? sub_bits : normal) | ((u & 0x80) << 24);
  vf v;
  __builtin_memcpy(&v, &bits, sizeof(v));
  return v;
}
#endif

inline float fp8_e5m2_value(uint8_t b) {  // as load_fp8_e5m2
  const uint32_t mag = b & 0x7f;
  float f;
  if (mag >> 2) {
    const uint32_t bits = (mag << 21) + (112u << 23);
    __builtin_memcpy(&f, &bits, sizeof(f));
  } else {
    f = float(mag & 3) * (1.f / 65536.f);
  }
  return (b & 0x80) ? -f : f;
}

// KV cache elements as the attention reads them: W lanes from a cache row. An e4m3 value reads as
// 2^-8 times itself (load_fp8), an e5m2 value exactly: kv_unit is the factor the caller folds into
// its per-tensor scales.
inline vf load_as_float(const c10::Float8_e4m3fn* p) { return load_fp8(reinterpret_cast<const uint8_t*>(p)); }
inline vf load_as_float(const c10::Float8_e5m2* p) { return load_fp8_e5m2(reinterpret_cast<const uint8_t*>(p)); }
inline float value_as_float(const c10::Float8_e4m3fn* p) { return fp8_value(p->x); }
inline float value_as_float(const c10::Float8_e5m2* p) { return fp8_e5m2_value(p->x); }

// Eight values at a time whatever W is (the K-block transposition works in 8x8 tiles).
typedef float f32x8 __attribute__((vector_size(32)));
template <bool E5M2>
inline f32x8 load8_fp8(const uint8_t* p) {
#if defined(__F16C__) && defined(__AVX2__) && !defined(OI_LANE_TWIN)
  __m128i h = _mm_unpacklo_epi8(_mm_setzero_si128(), _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  if constexpr (!E5M2) h = _mm_and_si128(_mm_srai_epi16(h, 1), _mm_set1_epi16(int16_t(0xBFFF)));
  const __m256 f = _mm256_cvtph_ps(h);
  f32x8 v;
  __builtin_memcpy(&v, &f, sizeof(v));
  return v;
#else
  f32x8 v;
  for (int e = 0; e < 8; ++e) v[e] = E5M2 ? fp8_e5m2_value(p[e]) : fp8_value(p[e]);
  return v;
#endif
}

template <typename C>
constexpr float kv_unit() {
  return std::is_same_v<C, c10::Float8_e4m3fn> ? FP8_UNIT : 1.f;
}

}  // namespace oi_vec
