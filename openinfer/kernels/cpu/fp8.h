// float8 e4m3 weights read into float32 lanes: shared by small_gemm.cpp's fp8_gemm and
// fused_moe.cpp's fp8 experts (block-scaled checkpoints kept as loaded; the torch reference is
// openinfer/kernels/fp8_gemm.py's dequantize).
#pragma once

#include <cstdint>

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

}  // namespace oi_vec
