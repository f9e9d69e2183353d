// y = x @ W^T (+ b) in bfloat16 through AMX tiles, for the few-row GEMMs of decode (and any M).
// oneDNN's packed bf16 linear reads W at about half the machine's read bandwidth for M = 1..32
// on 2 Intel cores (9-10 of 16-21 GB/s at M = 1; 6 GB/s at M = 32), where the tiles' arithmetic
// would keep up with the full bandwidth. Here W is packed once, at load, into 1 KiB blocks of
// 16 outputs x 32 inputs in the tiles' pair layout, stored in the order they are read: a thread
// streams one contiguous run of memory, and each block is one tile load for up to 64 rows of x.
// Accumulation is fp32 in the tiles, rounded to bf16 once at the end.
// Built into the CPU kernel extension (openinfer/kernels/cpu_attention.py); the GEMM planner
// (openinfer/kernels/gemm_plan.py, path "amx") times it against oneDNN's at start-up and uses it only
// where it is faster and matches F.linear.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "amx.h"
#include "ops.h"

#ifdef OI_AMX
namespace {

constexpr int NB = 16;        // outputs per block (tile columns)
constexpr int KB = 32;        // inputs per block (bf16 values of a tile row)
constexpr int BLOCK = NB * KB;  // bf16 values per packed block (1 KiB)
constexpr int GROUPS = 4;     // row groups of 16 per pass: result tiles 0-3 (7 for a short group)
constexpr int PREFETCH = 4;   // blocks ahead

// Tiles: 0-3 results of full groups of 16 rows, 7 the result of a short last group; 4 the x
// tile of a full group, 5 of the short group; 6 the weight block.
oi_amx::TileConfig config_for(int short_rows) {
  oi_amx::TileConfig c;
  for (int t = 0; t < 4; ++t) c.set(t, 16, NB * 4);
  c.set(4, 16, KB * 2);
  c.set(6, KB / 2, NB * 4);
  if (short_rows > 0) {
    c.set(5, short_rows, KB * 2);
    c.set(7, short_rows, NB * 4);
  }
  return c;
}

template <int G>
inline void zero_result() {
  _tile_zero(G);
}

// One 16-output block column against rows [m0, m0 + rows) of x (rows <= 64): result tiles
// accumulate over K, then go out through a float buffer, rounded to bf16 (+ bias).
inline void block_column(const c10::BFloat16* x, int64_t K, const c10::BFloat16* wcol, int64_t m0, int rows,
                         c10::BFloat16* out, int64_t N, int64_t n0, const float* bias) {
  const int full = rows / 16, short_rows = rows % 16;
  const int64_t kblocks = K / KB;
  if (full > 0) _tile_zero(0);
  if (full > 1) _tile_zero(1);
  if (full > 2) _tile_zero(2);
  if (full > 3) _tile_zero(3);
  if (short_rows) _tile_zero(7);
  const c10::BFloat16* xm = x + m0 * K;
  const int64_t xstride = K * 2;
  for (int64_t kb = 0; kb < kblocks; ++kb) {
    const c10::BFloat16* w = wcol + kb * BLOCK;
    const char* ahead = reinterpret_cast<const char*>(w + PREFETCH * BLOCK);
    for (int c = 0; c < BLOCK * 2; c += 64) _mm_prefetch(ahead + c, _MM_HINT_T0);
    _tile_loadd(6, w, NB * 4);
    const c10::BFloat16* xk = xm + kb * KB;
    if (full > 0) { _tile_loadd(4, xk, xstride); _tile_dpbf16ps(0, 4, 6); }
    if (full > 1) { _tile_loadd(4, xk + 16 * K, xstride); _tile_dpbf16ps(1, 4, 6); }
    if (full > 2) { _tile_loadd(4, xk + 32 * K, xstride); _tile_dpbf16ps(2, 4, 6); }
    if (full > 3) { _tile_loadd(4, xk + 48 * K, xstride); _tile_dpbf16ps(3, 4, 6); }
    if (short_rows) { _tile_loadd(5, xk + full * 16 * K, xstride); _tile_dpbf16ps(7, 5, 6); }
  }
  alignas(64) float c[64 * NB];
  if (full > 0) _tile_stored(0, c, NB * 4);
  if (full > 1) _tile_stored(1, c + 16 * NB, NB * 4);
  if (full > 2) _tile_stored(2, c + 32 * NB, NB * 4);
  if (full > 3) _tile_stored(3, c + 48 * NB, NB * 4);
  if (short_rows) _tile_stored(7, c + full * 16 * NB, NB * 4);
  const __m512 b = bias ? _mm512_loadu_ps(bias + n0) : _mm512_setzero_ps();
  for (int r = 0; r < rows; ++r) {
    const __m512 v = _mm512_add_ps(_mm512_load_ps(c + r * NB), b);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (m0 + r) * N + n0), (__m256i)_mm512_cvtneps_pbh(v));
  }
}

// Many rows: 32 rows x 32 outputs per step, the 2 x 2 tile blocking of a GEMM's inner
// kernel: per 32 inputs, 2 x tiles and 2 weight blocks feed 4 products, one tile load per
// product (a 64-row block column loads 5 per 4). x is first packed like the weight, into
// 1 KiB blocks of 16 rows x 32 inputs: a row-major x tile is 16 rows 2 K bytes apart, which
// fall into two sets of L1 and evict each other. Tiles: 0-3 the results (2 * row group +
// column), 4-5 x, 6-7 weight blocks. On the peers model's shapes (2 Intel cores): 1.1-1.4x the
// block columns from 32 to 2048 rows before the prefetch below, which adds 1.15-1.3x; then
// 1.2-1.6x oneDNN's packed linear at 64-128 rows, and 0.7-1.2x at 512-2048 depending on the
// run (benchmarks/bench_gemm_paths.py: still behind oneDNN's at 512 rows on a quiet host).
// Row blocks (of 32) from which a pass prefetches the next output pair's weights: at 512 rows
// 1.0-1.17x hot and 1.03-1.09x with weights read from memory (6144x1024 and 1024x3072, 2
// Intel cores); with one row block (a decode step's 32 rows) it doubled the stream in flight
// and ran 0.74x. Measured at 512 only: calls from 256 rows take it.
constexpr int64_t PANEL_BLOCKS = 8;

oi_amx::TileConfig config_2x2() {
  oi_amx::TileConfig c;
  for (int t = 0; t < 8; ++t) c.set(t, 16, 64);
  return c;
}

inline void block_2x2(const c10::BFloat16* xp, int64_t K, const c10::BFloat16* wcol, int64_t column,
                      int64_t m0, c10::BFloat16* out, int64_t N, int64_t n0, const float* bias,
                      const char* ahead = nullptr, int64_t ahead_step = 0) {
  const int64_t kblocks = K / KB;
  // xp: x packed as [M/16][K/32] blocks of 16 rows x 32 inputs (1 KiB, contiguous)
  const c10::BFloat16* xa = xp + (m0 / 16) * kblocks * BLOCK;
  const c10::BFloat16* xb = xa + kblocks * BLOCK;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t kb = 0; kb < kblocks; ++kb) {
    const c10::BFloat16* w0 = wcol + kb * BLOCK;
    const c10::BFloat16* w1 = w0 + column;
    {  // the next step's 4 KiB into L1 while this one's products run (1.15-1.3x)
      const char* next[4] = {reinterpret_cast<const char*>(xa + (kb + 1) * BLOCK),
                             reinterpret_cast<const char*>(xb + (kb + 1) * BLOCK),
                             reinterpret_cast<const char*>(w0 + BLOCK),
                             reinterpret_cast<const char*>(w1 + BLOCK)};
      for (int o = 0; o < BLOCK * 2; o += 64)
        for (const char* p : next) _mm_prefetch(p + o, _MM_HINT_T0);
    }
    if (ahead != nullptr)  // (a prefetch past the weight's end is harmless: it never faults)
      for (int64_t o = 0; o < ahead_step; o += 64) _mm_prefetch(ahead + kb * ahead_step + o, _MM_HINT_T0);
    _tile_loadd(4, xa + kb * BLOCK, 64);
    _tile_loadd(6, w0, NB * 4);
    _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(7, w1, NB * 4);
    _tile_dpbf16ps(1, 4, 7);
    _tile_loadd(5, xb + kb * BLOCK, 64);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  alignas(64) float c[32 * 32];
  _tile_stored(0, c, 128);
  _tile_stored(1, c + 16, 128);
  _tile_stored(2, c + 16 * 32, 128);
  _tile_stored(3, c + 16 * 32 + 16, 128);
  const __m512 b0 = bias ? _mm512_loadu_ps(bias + n0) : _mm512_setzero_ps();
  const __m512 b1 = bias ? _mm512_loadu_ps(bias + n0 + 16) : _mm512_setzero_ps();
  for (int r = 0; r < 32; ++r) {
    const __m512 lo = _mm512_add_ps(_mm512_load_ps(c + r * 32), b0);
    const __m512 hi = _mm512_add_ps(_mm512_load_ps(c + r * 32 + 16), b1);
    _mm512_storeu_si512(out + (m0 + r) * N + n0, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
  }
}

}  // namespace

// W [N, K] bf16 -> blocks [N/16][K/32] of [16 pairs][16 outputs][2]: block (n, k) holds, for each
// pair p of its 32 inputs, the 16 outputs' values of that pair side by side (a tile's B operand).
// Returned as [N, K/32, 32] (same bytes): N leads, as in a weight, and as a 3-d tensor no plain
// linear takes it for a weight by mistake.
at::Tensor amx_pack_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 && weight.dim() == 2, "amx_pack_weight: a bf16 [N, K] weight");
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(N % NB == 0 && K % KB == 0, "amx_pack_weight: N a multiple of 16 and K of 32");
  const at::Tensor w = weight.contiguous();
  at::Tensor packed = at::empty({N, K / KB, KB}, weight.options());
  const c10::BFloat16* src = w.data_ptr<c10::BFloat16>();
  c10::BFloat16* dst = packed.data_ptr<c10::BFloat16>();
  at::parallel_for(0, N / NB, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t nb = b0; nb < b1; ++nb)
      for (int64_t kb = 0; kb < K / KB; ++kb) {
        c10::BFloat16* blk = dst + (nb * (K / KB) + kb) * BLOCK;
        for (int p = 0; p < KB / 2; ++p)
          for (int n = 0; n < NB; ++n)
            for (int j = 0; j < 2; ++j)
              blk[p * NB * 2 + n * 2 + j] = src[(nb * NB + n) * K + kb * KB + 2 * p + j];
      }
  });
  return packed;
}

at::Tensor amx_gemm(const at::Tensor& x_in, const at::Tensor& packed, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(oi_amx::usable(), "amx_gemm: the kernel refused this process AMX tile state");
  TORCH_CHECK(x_in.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16, "amx_gemm: bfloat16 only");
  TORCH_CHECK(packed.is_contiguous() && packed.dim() == 3 && packed.size(0) % NB == 0 && packed.size(2) == KB,
              "amx_gemm: a weight from amx_pack_weight");
  const at::Tensor x = x_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0);
  TORCH_CHECK(x.dim() == 2 && packed.size(1) * KB == K, "amx_gemm: shapes");
  // Allocated here rather than by the caller: the decode step's ~64 calls each save a Python
  // torch.empty (2026-12-05).
  at::Tensor out = at::empty({M, N}, x.options());
  at::Tensor bias_f;
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == N, "amx_gemm: bias");
    bias_f = bias->to(at::kFloat).contiguous();
  }
  const float* pb = bias.has_value() ? bias_f.data_ptr<float>() : nullptr;
  const c10::BFloat16* px = x.data_ptr<c10::BFloat16>();
  const c10::BFloat16* pw = packed.data_ptr<c10::BFloat16>();
  c10::BFloat16* po = out.data_ptr<c10::BFloat16>();
  const int64_t column = (K / KB) * BLOCK;  // bf16 values of one 16-output block column
  // Enough block columns per task that it streams ~64 KiB of weights.
  const int64_t grain = std::max<int64_t>(1, 32768 / column);
  // Rows in runs of 32 through block_2x2 (outputs in pairs of blocks); the rest below.
  int64_t M2 = (N / NB) % 2 == 0 ? M / 32 * 32 : 0;
  if (M2 > 0) {
    const int64_t kblocks = K / KB;
    at::Tensor xpt = at::empty({M2 * K}, x.options());
    c10::BFloat16* xp = xpt.data_ptr<c10::BFloat16>();
    at::parallel_for(0, M2 / 16, 1, [&](int64_t g0, int64_t g1) {
      for (int64_t g = g0; g < g1; ++g)
        for (int64_t kb = 0; kb < kblocks; ++kb)
          for (int r = 0; r < 16; ++r)
            std::memcpy(xp + (g * kblocks + kb) * BLOCK + r * KB, px + (g * 16 + r) * K + kb * KB, KB * 2);
    });
    // Output pairs split over threads; per thread, rows in runs of SUPER (x packed, 512 KiB
    // at K = 1024: in L2) against each pair's weights in turn.
    constexpr int64_t SUPER = 256;
    at::parallel_for(0, N / (2 * NB), std::max<int64_t>(1, grain / 2), [&](int64_t p0, int64_t p1) {
      config_2x2().load();
      for (int64_t mb = 0; mb < M2; mb += SUPER)
        for (int64_t p = p0; p < p1; ++p) {
          const int64_t m1 = std::min(M2, mb + SUPER), blocks = (m1 - mb) / 32;
          // While the passes of PANEL_BLOCKS or more row blocks run over this pair's weights,
          // the next pair's come in, a slice of them per k-step.
          const char* next = p + 1 < p1 && blocks >= PANEL_BLOCKS
                                 ? reinterpret_cast<const char*>(pw + 2 * (p + 1) * column) : nullptr;
          const int64_t step = (2 * column * 2 / (blocks * kblocks) + 63) / 64 * 64;
          for (int64_t m0 = mb, i = 0; m0 < m1; m0 += 32, ++i)
            block_2x2(xp, K, pw + 2 * p * column, column, m0, po, N, 2 * p * NB, pb,
                      next ? next + i * kblocks * step : nullptr, step);
        }
    });
  }
  if (M2 == M) return out;
  at::parallel_for(0, N / NB, grain, [&](int64_t c0, int64_t c1) {
    const int last = int((M - M2) % (16 * GROUPS));
    // Every pass but the last has 64 rows; the last's short group sets tiles 5 and 7.
    const oi_amx::TileConfig full_config = config_for(0), last_config = config_for(last % 16);
    for (int64_t m0 = M2; m0 < M; m0 += 16 * GROUPS) {
      const int rows = int(std::min<int64_t>(16 * GROUPS, M - m0));
      (rows % 16 ? last_config : full_config).load();
      for (int64_t c = c0; c < c1; ++c) block_column(px, K, pw + c * column, m0, rows, po, N, c * NB, pb);
    }
  });
  return out;
}

bool amx_gemm_available() { return oi_amx::usable(); }
#else
bool amx_gemm_available() { return false; }
#endif

