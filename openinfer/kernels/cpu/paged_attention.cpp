// Paged varlen attention for CPUs: prefill, chunked-prefill continuations, prefix hits and
// decode of a whole step in one call per layer, reading K/V blocks in place through the
// block table (nothing is gathered). Built, and its contract documented, by
// openinfer/kernels/cpu_attention.py.
//
// Work (make_plan, once per call on the calling thread)
//   A work item is the rows of some query tokens x the `group` query heads that share one KV
//   head h, against a range of KV blocks of one block table: every K/V block is loaded and
//   converted once for all of them (GQA packing). Normally an item is (sequence, KV head, tile
//   of up to 64 rows; 128 on AMX tiles). Items with few rows per head (decode) take every KV
//   head of their sequence instead: a block row's heads lie side by side, so the item reads each block whole
//   and in order (1.4x faster decode attention than one item per head, 32 x 320 keys, 2 Zen 3
//   cores), where per-head items read short runs scattered 2 KiB apart. Sequences sharing prefix blocks that lie before all their queries (a
//   prefix-cache hit shared by a decode batch) get those blocks as stacked items of all their
//   rows ("cascade"): 32 decodes over a 1024-token prompt read it once per KV head with 64 rows
//   rather than 32 times with 2. Items far above an even share of the work are split along their
//   KV blocks (batch-1 decode on several threads). Items are sorted by cost, largest first, and
//   handed out dynamically (one OpenMP region, torch's thread count). Rows with several contributors
//   (split, cascade) store partial results (unnormalised O, running max m, running sum l); the
//   item that delivers the last part of a row merges it.
//
// Per chunk of keys (whole blocks, ~128 keys) of one item
//   Scores: items with many rows convert each K block to fp32 and transpose it into Kt[D][BSP]
//   (BSP = block_size rounded up to 16), so S[r][k] = sum_d Q[r][d] * Kt[d][k] is FMAs
//   vectorised over keys with no horizontal sums, and the transposition is shared by all rows;
//   items with few rows (decode) take dot products straight from the K rows and sum 4 or 8 of
//   them across lanes at once (no transposition to amortise); with a bf16 cache on CPUs with
//   AVX512_BF16 those are VDPBF16PS products on the K rows in place, and P.V splits each V
//   vector into its even and odd values (attention_bf16.h: scores_rowdot_bf16, pv_tile_split).
//   Online softmax per row in fp32, once per chunk. O[r][:] += p * V[k][:] is vectorised over D, V read in place (fp32) or
//   converted once per block (bf16). Keys past a sequence (block padding, junk table entries)
//   are never loaded; causally masked keys get p = 0 exactly.
//   With a bf16 cache on CPUs with AVX512_BF16, the many-row items take bf16 dot products
//   (VDPBF16PS) instead: Q.K^T over pairs of D on the K block transposed as 32-bit pairs, and
//   P.V over pairs of keys on V rows interleaved in pairs, P rounded to bf16 (OI_DPBF16 in
//   attention_bf16.h; 1.5x on a 512-token prefill, 2x on a 32-token chunk over 1024 keys, 2
//   Zen 5 cores), and on CPUs with AMX they take AMX tiles. These items run in two passes per
//   group of up to 32 rows rather than an online softmax per chunk (run_item_two_pass: all of a
//   group's scores, then its whole P.V with O in tiles or registers), unless a window, soft cap,
//   odd block size or a long key range rules that out.
//
// Files: this one holds the work plan, the online per-item loop and the entry point;
// paged_attention.h the plan's and the call's types, attention_two_pass.h the two-pass items,
// attention_tiles.h the fp32 tile kernels and attention_bf16.h the bf16 product paths.
//
// Batch-invariant mode (`invariant`): no shared-prefix items, no split-KV, and every item scores
//   through the transposed path (a plain FMA chain over D per score). Then each row's result
//   depends only on its own query, position and keys, never on the rest of the step: key chunks
//   are aligned to absolute block indices, keys past a row's position contribute exact zeros,
//   and no row is merged from partial results. Slower for decode (no split across threads, K
//   transposed for a few rows); see openinfer/kernels/invariant_gemm.py.
//
// Variants (per layer): a sliding window (query p reads keys p - window + 1 .. p: items start at
//   their first row's window, no shared-prefix items, keys before a row's window get p = 0), tanh
//   soft-capping of the scores (Gemma 2), and per-head attention sinks (gpt-oss: a logit in every
//   row's softmax denominator with no value, added where a row's result is normalised).
//
// SIMD: GCC/Clang vector extensions of W lanes (vec.h: W = 16 with AVX-512, else 8, or
// -DOI_VEC_WIDTH). The same source is correct for any W; the compiler picks the instructions
// (-march=native), so an AVX2 machine can test the 16-lane code (its vectors are split in two).

#include <ATen/core/Tensor.h>

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "amx.h"
#include "attention_bf16.h"
#include "attention_tiles.h"
#include "attention_two_pass.h"
#include "ops.h"
#include "paged_attention.h"
#include "vec.h"

namespace {

using namespace oi_vec;
using namespace oi_attention;
using namespace oi_paged;

// Loads every cache line of `count` runs of `bytes` each and discards them: they are then in this
// core's L2 (see the few-row items in run_item). The runs are read side by side, line x of each
// and then line x + 1, so that the L2 streamer runs ahead on all of them at once: a chunk of 8
// runs at a time (the K and V rows of 4 blocks) read 1.07-1.1x faster than run after run.
inline void read_through(const char* const* runs, int count, int64_t bytes) {
  vi any = {};
  for (int64_t x = 0; x + int64_t(sizeof any) <= bytes; x += 64)
    for (int i = 0; i < count; ++i) {
      vi line;
      std::memcpy(&line, runs[i] + x, sizeof line);
      any |= line;
    }
  volatile int32_t keep = any[0];  // (the loads may not be dropped)
  (void)keep;
}
constexpr int READ_STREAMS = 8;

// T: the query's and output's type; C: the cache's (T itself, or a float8 type under an fp8 KV
// cache, read through load_as_float and the per-tensor scales folded into P.scale and P.v_out).
template <typename T, typename C>
void run_item(const Params& P, const Item& it, const T* q, const C* kc, const C* vc, T* out) {
  const int G = P.G, D = P.D, BS = P.BS, BSP = P.BSP, CB = P.chunk_blocks;
  const int SW = CB * BSP;  // score row stride: one chunk of keys
  const int32_t* tokens = P.row_tokens + it.tok0;
  const int ntok = it.num_tok, NH = it.num_heads;
  const int MH = ntok * G;  // rows per KV head; rows are ordered (head, token, group member)
  const int M = NH * MH;
  // Position of the item's first token; its tokens are consecutive positions of sequence b.
  // Shared-prefix items see every key of their (full) blocks.
  int pos0 = NO_MASK, kv_end = it.blk1 * BS;
  if (it.b >= 0) {
    pos0 = P.seq_lens[it.b] - (P.qsl[it.b + 1] - tokens[0]);
    kv_end = std::min(kv_end, pos0 + ntok);
  }
  const bool rowdot = !P.invariant && MH <= ROWDOT_ROWS;
#ifdef OI_DPBF16
  const bool dpbf16 = std::is_same_v<C, c10::BFloat16> && !rowdot && P.bf16_dot != BF16_FP32;
#else
  const bool dpbf16 = false;
#endif
  // Few-row items of a bf16 cache: VDPBF16PS scores on the K rows in place, P.V on V split into
  // its even and odd values (attention_bf16.h), O in the split layout until the item ends.
#ifdef OI_ROWDOT_BF16
  const bool rowdot_bf16 = std::is_same_v<C, c10::BFloat16> && rowdot && D % 32 == 0 && P.bf16_dot != BF16_FP32;
#else
  const bool rowdot_bf16 = false;
#endif
#ifdef OI_AMX_ATTENTION
  const bool amx = dpbf16 && P.bf16_dot == BF16_AMX;
#else
  const bool amx = false;
#endif
#if defined(OI_DPBF16) && !defined(OI_ONLINE_ONLY)  // (a twin without: bench_attention.py --two-pass)
  if constexpr (std::is_same_v<C, c10::BFloat16>) {
    if (dpbf16 && two_pass_fits(P, it)) return run_item_two_pass(P, it, q, kc, vc, out, amx);
  }
#endif
#ifdef OI_AMX_ATTENTION
  if (amx) configure_tiles();
#endif
  // The bf16 product paths leave their scores unscaled when nothing reads them scaled before
  // the softmax (no soft cap): the scale then rides in the exponent's FMA, one pass over the
  // scores fewer (5% of a 512-token AMX prefill).
  const float score_scale = (dpbf16 || rowdot_bf16) && P.softcap <= 0.f ? 1.f : P.scale;
  const float exp_scale = P.scale / score_scale;

  const size_t TR = size_t(P.tile_rows), mD = TR * D;
  float* qf = tls_scratch.get(2 * mD + TR * (SW + 2) + size_t(D) * BSP + size_t(BS) * D +
                              (dpbf16 ? TR * SW / 2 + size_t(SW) * D / 2 : 0));
  float* o = qf + mD;                  // [M][D] unnormalised output
  float* s = o + mD;                   // [M][SW] scores, then probabilities, of one key chunk
  float* m = s + TR * SW;              // [M] running max
  float* l = m + TR;                   // [M] running sum
  float* kt = l + TR;                  // [D][BSP] transposed K block, or [BS][D] fp32 K rows
  float* vf32 = kt + size_t(D) * BSP;  // [BS][D] fp32 V rows of one block and head
  // bf16 dot products: Q as [M][D/2] pairs in qf, K as [D/2][BSP] pairs in kt, and
  auto* pb = reinterpret_cast<c10::BFloat16*>(vf32 + size_t(BS) * D);  // [M][SW] bf16 P
  auto* vpairs = reinterpret_cast<uint32_t*>(vf32 + size_t(BS) * D + TR * SW / 2);  // [SW/2][D]
  auto* qpairs = reinterpret_cast<uint32_t*>(qf);
  auto* kpairs = reinterpret_cast<uint32_t*>(kt);

  const int32_t* table = P.tables + int64_t(it.table_b) * P.table_stride;
  const int64_t row_bytes = P.kv_row * int64_t(sizeof(C));
  const int64_t head0 = int64_t(it.h) * D;  // offset of the item's first head in a K/V row
  // The item's heads are a run of each block row (the whole row when it has every head). Blocks
  // lie scattered over memory and a run is too short for the hardware prefetcher to lock on:
  // the rows of the block PREFETCH_BLOCKS ahead are requested while this one is computed.
  const int64_t run_bytes = int64_t(NH) * D * int64_t(sizeof(C));
  auto prefetch_block = [&](const C* cache, int64_t block_stride, int j) {
    if (j >= it.blk1 || j * BS >= kv_end) return;
    const int n = std::min(BS, kv_end - j * BS);
    const char* base = reinterpret_cast<const char*>(cache + table[j] * block_stride + head0);
    for (int k = 0; k < n; ++k)
      for (int64_t c = 0; c < run_bytes; c += 64) __builtin_prefetch(base + k * row_bytes + c);
  };

  for (int hi = 0; hi < NH; ++hi) {
    for (int i = 0; i < ntok; ++i) {
      for (int g = 0; g < G; ++g) {
        const T* src = q + int64_t(tokens[i]) * P.q_s0 + int64_t((it.h + hi) * G + g) * P.q_s1;
        const size_t row = size_t(hi * MH + i * G + g);
        if (dpbf16 || rowdot_bf16) {  // the bf16 values as they are (the scale is applied to the scores)
          std::memcpy(qpairs + row * (D / 2), src, size_t(D) * sizeof(T));
          continue;
        }
        float* dst = qf + row * D;
        for (int d = 0; d < D; d += W) storeu(dst + d, load_as_float(src + d) * P.scale);
      }
    }
  }
  std::fill(o, o + size_t(M) * D, 0.f);
  std::fill(m, m + M, NEG_INF);
  std::fill(l, l + M, 0.f);
  if (!rowdot) std::fill(kt, kt + size_t(D) * BSP, 0.f);  // transposed padding keys: finite

  const C* kblk[MAX_CHUNK_BLOCKS];
  const C* vblk[MAX_CHUNK_BLOCKS];
  int nvalid[MAX_CHUNK_BLOCKS];
  for (int j0 = it.blk0; j0 < it.blk1; j0 += CB) {
    const int c0 = j0 * BS;  // first key of the chunk
    if (c0 >= kv_end) break;
    const int nb = std::min(CB, (kv_end - c0 + BS - 1) / BS);
    // Few-row items (decode) of a bf16 cache do a few conversions and FMAs per K/V cache line,
    // and read each line once: loads interleaved with that arithmetic keep few lines in flight
    // (7 GB/s per core from memory, against 25 for a plain pass; the software prefetches below
    // changed nothing there). A plain pass over the chunk's rows first (of items with every
    // head: whole rows) brings them to L2 at the plain pass's rate. Decode attention between
    // layers' weight reads (as in a forward pass; bench_attention.py --read-through, 2 Intel
    // cores): bf16 1.3-1.6x faster; float32 caches, whose loads carry no conversion, ran
    // 0.8-0.95x with it and go without. (fp8 caches convert as bf16 ones do, and take it.)
#ifndef OI_NO_READ_THROUGH  // (a twin without: bench_attention.py --read-through)
    if (!std::is_same_v<C, float> && rowdot && NH == P.Hkv) {
      const char* runs[2 * MAX_CHUNK_BLOCKS];  // the K and V rows of the chunk's full blocks
      int full = 0;
      for (int c = 0; c < nb; ++c) {
        const char* kv[2] = {reinterpret_cast<const char*>(kc + table[j0 + c] * P.k_s0),
                             reinterpret_cast<const char*>(vc + table[j0 + c] * P.v_s0)};
        const int rows = std::min(BS, kv_end - c0 - c * BS);
        if (rows < BS) {
          read_through(kv, 2, rows * row_bytes);
        } else {
          runs[full++] = kv[0];
          runs[full++] = kv[1];
        }
      }
      for (int i = 0; i < full; i += READ_STREAMS)
        read_through(runs + i, std::min(READ_STREAMS, full - i), BS * row_bytes);
    }
#endif
    // Rows are ordered by position within a head: those before the chunk's first key see none
    // of it. rows_h of each head's MH rows, from r0, take part.
    const int r0 = it.b >= 0 ? std::max(0, c0 - pos0) * G : 0;
    const int rows_h = MH - r0;

    // Scores, block by block and within a block head by head: the reads of a block's rows walk
    // its memory in order when the item has every head.
    for (int c = 0; c < nb; ++c) {
      const int64_t block = table[j0 + c];
      const int n = std::min(BS, kv_end - c0 - c * BS);  // valid keys of this block
      kblk[c] = kc + block * P.k_s0 + head0;
      vblk[c] = vc + block * P.v_s0 + head0;
      nvalid[c] = n;
      prefetch_block(kc, P.k_s0, j0 + c + PREFETCH_BLOCKS);
      for (int hi = 0; hi < NH; ++hi) {
        const C* kb = kblk[c] + hi * D;
        const float* qh = qf + size_t(hi * MH + r0) * D;
        float* sr = s + size_t(hi * MH + r0) * SW + c * BSP;
        if (rowdot_bf16) {
#ifdef OI_ROWDOT_BF16
          scores_rowdot_bf16(rows_h, reinterpret_cast<const c10::BFloat16*>(qpairs) + size_t(hi * MH + r0) * D, D,
                             reinterpret_cast<const c10::BFloat16*>(kb), P.kv_row, n, score_scale, sr, SW);
#endif
        } else if (rowdot) {
          if (std::is_same_v<C, float> || rows_h <= 2) {
            scores_rowdot(rows_h, qh, D, kb, P.kv_row, n, sr, SW);
          } else {  // convert once rather than once per row
            for (int k = 0; k < n; ++k)
              for (int d = 0; d < D; d += W) storeu(kt + k * D + d, load_as_float(kb + k * P.kv_row + d));
            scores_rowdot(rows_h, qh, D, static_cast<const float*>(kt), D, n, sr, SW);
          }
        } else if (dpbf16) {
#ifdef OI_DPBF16
          // A key row read as D/2 32-bit words is its pairs of D: transposed as fp32 would be.
          transpose_keys(reinterpret_cast<const float*>(kb), P.kv_row / 2, n, D / 2, kt, BSP);
          const uint32_t* qh2 = qpairs + size_t(hi * MH + r0) * (D / 2);
          int r = 0;
#ifdef OI_AMX_ATTENTION
          if (amx)
            for (; r + 16 <= rows_h; r += 16)
              scores_amx16(qh2 + size_t(r) * (D / 2), D, kpairs, BSP, score_scale, sr + size_t(r) * SW, SW);
#endif
          scores_bf16(rows_h - r, qh2 + size_t(r) * (D / 2), D / 2, kpairs, BSP, score_scale,
                      sr + size_t(r) * SW, SW);
#endif
        } else {
          transpose_keys(kb, P.kv_row, n, D, kt, BSP);
          scores_transposed(rows_h, qh, D, kt, BSP, sr, SW);
        }
      }
    }

    // Online softmax over the chunk. Invisible keys (causal, past the block's valid rows, the
    // padding of a block) get -inf, i.e. p = 0, whatever the score buffer held there.
    const int width = nb * BSP;
    // Rows that see every key of a chunk of whole blocks (no padding, window or soft cap) need
    // no mask pass: 20% of a 512-token AMX prefill went to finding nothing to mask.
    bool whole_chunk = BSP == BS && P.window <= 0 && P.softcap <= 0.f;
    for (int c = 0; c < nb; ++c) whole_chunk = whole_chunk && nvalid[c] == BS;
    const int last_key = c0 + nb * BS - 1;
    for (int hi = 0; hi < NH; ++hi) {
      for (int r = r0; r < MH; ++r) {
        const int row = hi * MH + r;
        const int pos = pos0 + r / G;
        float* srow = s + size_t(row) * SW;
        const int lo = P.window > 0 ? pos - P.window + 1 : std::numeric_limits<int>::min() / 2;
        for (int c = 0; c < (whole_chunk && pos >= last_key ? 0 : nb); ++c) {
          const int key0 = c0 + c * BS;
          const int lim = std::max(0, std::min(nvalid[c], pos - key0 + 1));
          const int first = std::clamp(lo - key0, 0, lim);
          float* sc = srow + c * BSP;
          if (P.softcap > 0.f)
            for (int k = first; k < lim; ++k) sc[k] = P.softcap * std::tanh(sc[k] / P.softcap);
          std::fill(sc, sc + first, NEG_INF);
          std::fill(sc + lim, sc + BSP, NEG_INF);
        }
        vf mx = loadu(srow);
        for (int k = W; k < width; k += W) mx = vmax(mx, loadu(srow + k));
        const float m_old = m[row];
        const float m_new = std::max(m_old, hmax(mx) * exp_scale);  // scaled scores (scale > 0)
        if (m_new == NEG_INF) {  // no key of the chunk (or before it) in this row's window
          std::fill(srow, srow + width, 0.f);
#ifdef OI_DPBF16
          if (dpbf16) std::fill(pb + size_t(row) * SW, pb + size_t(row) * SW + width, c10::BFloat16(0.f));
#endif
          continue;
        }
        float row_sum;
#ifdef OI_DPBF16
        if (dpbf16) {
          row_sum = probabilities_bf16(srow, width, exp_scale, m_new, pb + size_t(row) * SW);
        } else
#endif
        {
          const vf mv = splat(m_new), ev = splat(exp_scale);
          vf sum = splat(0.f);
          for (int k = 0; k < width; k += W) {
            vf p = vexp(loadu(srow + k) * ev - mv);
            storeu(srow + k, p);
            sum += p;
          }
          row_sum = hsum(sum);
        }
        if (m_old != m_new) {
          const float alpha = std::exp(m_old - m_new);  // 0 on the first chunk seen
          float* orr = o + size_t(row) * D;
          for (int d = 0; d < D; d += W) storeu(orr + d, loadu(orr + d) * alpha);
          l[row] *= alpha;
        }
        l[row] += row_sum;
        m[row] = m_new;
      }
    }

#ifdef OI_DPBF16
    if (dpbf16) {
      // The chunk's P rows in bf16 and, per head, its V blocks as one run of pairs (pairs past a
      // block's valid keys are 0, their p is 0): one P.V pass over the whole chunk. AMX takes
      // keys 32 at a time: a chunk of 16 more is padded with zero P and V.
      const int widthp = amx ? (width + 31) / 32 * 32 : width;
      for (int hi = 0; hi < NH; ++hi) {
        const size_t row0 = size_t(hi * MH + r0);
        for (int r = 0; r < rows_h && widthp > width; ++r)
          std::fill(pb + (row0 + r) * SW + width, pb + (row0 + r) * SW + widthp, c10::BFloat16(0.f));
      }
      for (int hi = 0; hi < NH; ++hi) {
        for (int c = 0; c < nb; ++c) {
          if (hi == 0) prefetch_block(vc, P.v_s0, j0 + c + PREFETCH_BLOCKS);
          uint32_t* vb = vpairs + size_t(c) * (BSP / 2) * D;
          pack_value_pairs(reinterpret_cast<const c10::BFloat16*>(vblk[c] + hi * D), P.kv_row, nvalid[c], D, vb);
          std::fill(vb + size_t(nvalid[c] + 1) / 2 * D, vb + size_t(BSP / 2) * D, 0u);
        }
        std::fill(vpairs + size_t(width / 2) * D, vpairs + size_t(widthp / 2) * D, 0u);
        const size_t row0 = size_t(hi * MH + r0);
        int r = 0;
#ifdef OI_AMX_ATTENTION
        if (amx)
          for (; r + 16 <= rows_h; r += 16)
            pv_amx16(pb + (row0 + r) * SW, SW, vpairs, widthp, o + (row0 + r) * D, D);
#endif
        accumulate_pv_bf16(rows_h - r, reinterpret_cast<const uint32_t*>(pb + (row0 + r) * SW), SW / 2, vpairs,
                           width / 2, o + (row0 + r) * D, D);
      }
      continue;
    }
#endif
#ifdef OI_ROWDOT_BF16
    if (rowdot_bf16) {  // per head over the whole chunk, O in registers throughout
      const c10::BFloat16* vrows[MAX_CHUNK_BLOCKS];
      for (int hi = 0; hi < NH; ++hi) {
        for (int c = 0; c < nb; ++c) vrows[c] = reinterpret_cast<const c10::BFloat16*>(vblk[c] + hi * D);
        const ValueBlocks blocks{vrows, nvalid, nb, BSP, P.kv_row};
        const size_t row0 = size_t(hi * MH + r0);
        accumulate_pv_split(rows_h, s + row0 * SW, SW, blocks, o + row0 * D, D);
      }
      continue;
    }
#endif
    for (int c = 0; c < nb; ++c) {
      prefetch_block(vc, P.v_s0, j0 + c + PREFETCH_BLOCKS);
      for (int hi = 0; hi < NH; ++hi) {
        const C* vb = vblk[c] + hi * D;
        const float* pr = s + size_t(hi * MH + r0) * SW + c * BSP;
        float* orow = o + size_t(hi * MH + r0) * D;
        if (std::is_same_v<C, float> || rows_h <= PV_ROWS) {
          // A single row tile converts each V element once anyway: read the block in place.
          accumulate_pv(rows_h, pr, SW, vb, P.kv_row, nvalid[c], orow, D);
        } else {
          for (int k = 0; k < nvalid[c]; ++k)
            for (int d = 0; d < D; d += W) storeu(vf32 + k * D + d, load_as_float(vb + k * P.kv_row + d));
          accumulate_pv(rows_h, pr, SW, static_cast<const float*>(vf32), D, nvalid[c], orow, D);
        }
      }
    }
  }

#ifdef OI_ROWDOT_BF16
  if (rowdot_bf16) unsplit_rows(o, M, D);
#endif
  if (it.part_row < 0) {
    for (int r = 0; r < M; ++r) {
      const int hi = r / MH, i = (r % MH) / G, g = r % G;
      const int64_t head = (it.h + hi) * G + g;
      T* dst = out + int64_t(tokens[i]) * P.o_s0 + head * P.o_s1;
      store_from_float(dst, o + size_t(r) * D, D, normaliser(m[r], l[r], P.sinks, head) * P.v_out);
    }
  } else {
    std::copy(o, o + size_t(M) * D, P.part_o + it.part_row * D);
    std::copy(m, m + M, P.part_m + it.part_row);
    std::copy(l, l + M, P.part_l + it.part_row);
  }
}

// Combines the partial results for the `group` rows of one (token, KV head): each partial is
// rescaled to the common max. merges[first .. first + count) all name that (token, head).
template <typename T>
void merge_rows(const Params& P, const std::pair<int64_t, int64_t>* merges, int count, T* out) {
  const int G = P.G, D = P.D;
  const int64_t token = merges[0].first / P.Hkv, h = merges[0].first % P.Hkv;
  float acc[1024];
  for (int g = 0; g < G; ++g) {
    float mmax = NEG_INF;
    for (int i = 0; i < count; ++i) mmax = std::max(mmax, P.part_m[merges[i].second + g]);
    float total = 0.f;
    std::fill(acc, acc + D, 0.f);
    for (int i = 0; i < count; ++i) {
      const int64_t row = merges[i].second + g;
      if (P.part_m[row] == NEG_INF) continue;  // this part held no key the row can see
      const float w = std::exp(P.part_m[row] - mmax);
      total += w * P.part_l[row];
      const float* po = P.part_o + row * D;
      for (int d = 0; d < D; d += W) storeu(acc + d, loadu(acc + d) + loadu(po + d) * w);
    }
    T* dst = out + token * P.o_s0 + (h * G + g) * P.o_s1;
    store_from_float(dst, acc, D, normaliser(mmax, total, P.sinks, h * G + g) * P.v_out);
  }
}

// "" is the default: VDPBF16PS where compiled, else fp32.
Bf16Dot parse_bf16_dot(const std::string& name) {
#ifdef OI_DPBF16
  if (name.empty() || name == "avx512_bf16") return BF16_AVX512;
#else
  if (name.empty()) return BF16_FP32;
#endif
  if (name == "fp32") return BF16_FP32;
#ifdef OI_AMX_ATTENTION
  if (name == "amx_bf16") {
    TORCH_CHECK(oi_amx::usable(), "paged_attention: the kernel refused this process AMX tile state");
    return BF16_AMX;
  }
#endif
  TORCH_CHECK(false, "paged_attention: bf16_dot '", name, "' is not a path of this build (bf16_dot_paths())");
}

void check_cache(const at::Tensor& c, const char* name, int64_t H, int64_t D) {
  TORCH_CHECK(c.dim() == 4, name, " must be [num_blocks, block_size, num_kv_heads, head_dim]");
  TORCH_CHECK(c.size(2) == H && c.size(3) == D, name, " heads/head_dim do not match q");
  TORCH_CHECK(c.stride(3) == 1 && c.stride(2) == D && c.stride(1) == H * D,
              name, ": each block's [block_size, H, D] must be contiguous");
}

// Work for one call:
// 1. Shared prefixes. Sequences whose tables start with the same blocks, all of them before every
//    query of those sequences (so fully visible, no mask), are grouped: the group's query rows are
//    stacked and attend the shared blocks together ("cascade"), so a 32-way shared prompt is read
//    once per step with 64 rows instead of 32 times with 2. Used when it cuts the passes over the
//    shared blocks (decode batches), not for prefills whose own tiles are already full.
// 2. Own blocks: per (sequence, KV head, query tile).
// 3. Split-KV: items far above an even share of the work are cut along their KV blocks, so that
//    few long items (batch-1 decode) still occupy every thread.
// Items whose rows get contributions from several items write partial results, merged at the end.
// `invariant` (batch-invariant mode): step 2 only, so that no row's result depends on the others.
Plan make_plan(int64_t B, const int32_t* qsl, const int32_t* sl, const int32_t* tables, int64_t table_stride,
               int Hkv, int G, int BS, int threads, int64_t kv_splits, bool invariant, int window,
               int tile_rows) {
  Plan plan;
  const int tile_tokens = std::max(1, tile_rows / G);
  // Per head: a block's rows, + its K/V loads.
  auto cost = [](int heads, int rows, int blocks) { return int64_t(heads) * blocks * (rows + 4); };

  // 1. Shared prefixes: group by first block, then keep the blocks all members agree on.
  std::vector<int> shared(B, 0);  // shared blocks of each sequence (0: none)
  if (!invariant && window == 0) {  // a window moves with each row: no prefix is seen by all
    std::vector<std::pair<int32_t, int32_t>> by_first;  // (first block, sequence)
    for (int32_t b = 0; b < B; ++b) {
      const int q_len = qsl[b + 1] - qsl[b];
      if (q_len > 0 && (sl[b] - q_len) / BS > 0) by_first.emplace_back(tables[b * table_stride], b);
    }
    std::sort(by_first.begin(), by_first.end());
    for (size_t i = 0; i < by_first.size();) {
      size_t j = i;
      while (j < by_first.size() && by_first[j].first == by_first[i].first) ++j;
      if (j - i >= 2) {
        const int32_t* lead = tables + by_first[i].second * table_stride;
        int n = std::numeric_limits<int>::max(), passes = 0, tokens = 0;
        for (size_t k = i; k < j; ++k) {
          const int32_t b = by_first[k].second;
          const int q_len = qsl[b + 1] - qsl[b];
          const int32_t* row = tables + b * table_stride;
          int agree = 0;
          const int visible = (sl[b] - q_len) / BS;  // full blocks before the first query
          while (agree < std::min(n, visible) && row[agree] == lead[agree]) ++agree;
          n = agree;
          passes += (q_len + tile_tokens - 1) / tile_tokens;
          tokens += q_len;
        }
        if (n > 0 && 4 * ((tokens + tile_tokens - 1) / tile_tokens) <= 3 * passes) {
          for (int h = 0; h < Hkv; ++h) {
            // Tiles of the stacked rows of every member (a tile may hold several sequences).
            const int first = int(plan.row_tokens.size());
            for (size_t k = i; k < j; ++k) {
              const int32_t b = by_first[k].second;
              for (int t = qsl[b]; t < qsl[b + 1]; ++t) plan.row_tokens.push_back(t);
            }
            for (int t0 = 0; t0 < tokens; t0 += tile_tokens) {
              const int nt = std::min(tile_tokens, tokens - t0);
              plan.items.push_back({-1, by_first[i].second, h, 1, first + t0, nt, 0, n, 0, cost(1, nt * G, n)});
            }
          }
          for (size_t k = i; k < j; ++k) shared[by_first[k].second] = n;
        }
      }
      i = j;
    }
  }

  // 2. Every sequence's own blocks (all of them when it shares none).
  for (int32_t b = 0; b < B; ++b) {
    const int q_len = qsl[b + 1] - qsl[b];
    if (q_len == 0) continue;
    const int ctx = sl[b] - q_len;
    const int first = int(plan.row_tokens.size());
    for (int t = qsl[b]; t < qsl[b + 1]; ++t) plan.row_tokens.push_back(t);
    for (int q0 = 0; q0 < q_len; q0 += tile_tokens) {
      const int q1 = std::min(q_len, q0 + tile_tokens);
      const int blk1 = (ctx + q1 + BS - 1) / BS;
      // Few rows per head (decode): one item for every head reads each block row whole and in
      // order, which the hardware prefetcher streams; a head's own slice of each row is too
      // short and scattered for it.
      const int heads = !invariant && (q1 - q0) * G <= ROWDOT_ROWS ? Hkv : 1;
      // The first block the tile's first row reads (its window's start).
      const int blk0 = window > 0 ? std::max(0, ctx + q0 - window + 1) / BS : shared[b];
      for (int h = 0; h < Hkv; h += heads)
        plan.items.push_back({b, b, h, heads, first + q0, q1 - q0, blk0, blk1, shared[b] > 0 ? 0 : -1,
                              cost(heads, (q1 - q0) * G, blk1 - blk0)});
    }
  }

  // 3. Split-KV.
  int64_t total = 0;
  for (const Item& it : plan.items) total += it.cost;
  const int64_t share = std::max<int64_t>(1, total / (2 * threads));
  std::vector<Item> items;
  items.reserve(plan.items.size());
  for (const Item& it : plan.items) {
    const int blocks = it.blk1 - it.blk0;
    int64_t parts = invariant ? 1 : kv_splits > 0 ? kv_splits : (it.cost + share - 1) / share;
    parts = std::clamp<int64_t>(parts, 1, blocks);
    for (int p = 0; p < parts; ++p) {
      Item piece = it;
      piece.blk0 = it.blk0 + int(int64_t(blocks) * p / parts);
      piece.blk1 = it.blk0 + int(int64_t(blocks) * (p + 1) / parts);
      piece.cost = cost(it.num_heads, it.num_tok * G, piece.blk1 - piece.blk0);
      if (parts > 1) piece.part_row = 0;
      items.push_back(piece);
    }
  }
  plan.items.swap(items);

  for (Item& it : plan.items) {
    plan.tile_rows = std::max(plan.tile_rows, it.num_heads * it.num_tok * G);
    if (it.part_row < 0) continue;
    it.part_row = plan.part_rows;
    for (int hi = 0; hi < it.num_heads; ++hi)
      for (int i = 0; i < it.num_tok; ++i)
        plan.merges.emplace_back(int64_t(plan.row_tokens[it.tok0 + i]) * Hkv + it.h + hi,
                                 plan.part_rows + int64_t(hi * it.num_tok + i) * G);
    plan.part_rows += int64_t(it.num_heads) * it.num_tok * G;
  }
  std::sort(plan.merges.begin(), plan.merges.end());
  return plan;
}

}  // namespace

// See openinfer/kernels/cpu_attention.py for the contract. kv_splits: 0 = automatic,
// k > 0 = split every item's KV range into (up to) k parts (tests). invariant: batch-invariant
// mode (see the top of this file; kv_splits is then ignored). k_scale, v_scale: a float8 cache's
// per-tensor scales (a key is its stored value times k_scale); other caches ignore them.
void paged_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& key_cache,
                     const at::Tensor& value_cache, const at::Tensor& block_tables,
                     const at::Tensor& query_start_loc, const at::Tensor& seq_lens, double scale,
                     int64_t max_query_len, int64_t kv_splits, bool invariant, int64_t window, double softcap,
                     const std::optional<at::Tensor>& sinks, const std::string& bf16_dot, double k_scale,
                     double v_scale) {
  for (const at::Tensor* t : {&static_cast<const at::Tensor&>(out), &q, &key_cache, &value_cache, &block_tables,
                              &query_start_loc, &seq_lens})
    TORCH_CHECK(t->device().is_cpu(), "paged_attention: CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes(), "q and out must be [T, Hq, D] of one shape");
  const auto dtype = q.scalar_type(), cache_dtype = key_cache.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "paged_attention: float32 or bfloat16 only");
  const bool fp8_cache = cache_dtype == at::kFloat8_e4m3fn || cache_dtype == at::kFloat8_e5m2;
  TORCH_CHECK(out.scalar_type() == dtype && value_cache.scalar_type() == cache_dtype &&
                  (cache_dtype == dtype || fp8_cache),
              "q and out must share one dtype, and key_cache and value_cache be of it or both float8 "
              "(e4m3fn, e5m2)");
  TORCH_CHECK(k_scale > 0 && v_scale > 0, "k_scale and v_scale must be > 0");
  if (!fp8_cache) k_scale = v_scale = 1.0;
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1, "q and out must be contiguous in head_dim");
  const int64_t T = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t Hkv = key_cache.size(2);
  check_cache(key_cache, "key_cache", Hkv, D);
  check_cache(value_cache, "value_cache", Hkv, D);
  TORCH_CHECK(value_cache.size(0) == key_cache.size(0) && value_cache.size(1) == key_cache.size(1),
              "key_cache and value_cache shapes differ");
  TORCH_CHECK(Hkv > 0 && Hq % Hkv == 0, "num query heads must be a multiple of num kv heads");
  TORCH_CHECK(D % KEY_TILE == 0 && D <= 1024, "head_dim must be a multiple of 16 (at most 1024)");
  const int64_t num_blocks = key_cache.size(0), BS = key_cache.size(1);
  for (const auto* t : {&block_tables, &query_start_loc, &seq_lens})
    TORCH_CHECK(t->scalar_type() == at::kInt, "block_tables, query_start_loc and seq_lens must be int32");
  TORCH_CHECK(query_start_loc.dim() == 1 && seq_lens.dim() == 1 && block_tables.dim() == 2,
              "query_start_loc [B+1], seq_lens [B], block_tables [B, max_blocks]");
  const int64_t B = seq_lens.size(0);
  TORCH_CHECK(query_start_loc.size(0) == B + 1 && block_tables.size(0) == B, "batch sizes differ");
  TORCH_CHECK(block_tables.stride(1) == 1 || block_tables.size(1) <= 1, "block_tables rows must be contiguous");
  const auto qsl_t = query_start_loc.contiguous(), sl_t = seq_lens.contiguous();
  const int32_t* qsl = qsl_t.data_ptr<int32_t>();
  const int32_t* sl = sl_t.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int64_t max_blocks = block_tables.size(1), table_stride = block_tables.stride(0);
  TORCH_CHECK(qsl[0] == 0 && qsl[B] == T, "query_start_loc must run from 0 to num_tokens");
  for (int64_t b = 0; b < B; ++b) {
    const int q_len = qsl[b + 1] - qsl[b];
    TORCH_CHECK(q_len >= 0 && q_len <= max_query_len, "sequence ", b, ": query length ", q_len,
                " outside [0, max_query_len=", max_query_len, "]");
    TORCH_CHECK(sl[b] >= q_len, "sequence ", b, ": seq_len ", sl[b], " < query length ", q_len);
    if (q_len == 0) continue;
    const int64_t nblk = (sl[b] + BS - 1) / BS;
    TORCH_CHECK(nblk <= max_blocks, "sequence ", b, ": seq_len ", sl[b], " needs ", nblk, " blocks, table has ",
                max_blocks);
    const int32_t* row = tables + b * table_stride;
    for (int64_t j = 0; j < nblk; ++j)
      TORCH_CHECK(row[j] >= 0 && row[j] < num_blocks, "sequence ", b, ": block id ", row[j], " out of range");
  }
  TORCH_CHECK(window >= 0 && softcap >= 0, "window and softcap must be >= 0 (0: none)");
  at::Tensor sinks_f;
  if (sinks.has_value()) {
    TORCH_CHECK(sinks->dim() == 1 && sinks->size(0) == Hq, "sinks must be [num_query_heads]");
    sinks_f = sinks->to(at::kFloat).contiguous();
  }
  if (T == 0) return;

  const int threads = std::max(1, at::get_num_threads());
  const int G = int(Hq / Hkv);
  Params P;
  P.chunk_blocks = int(std::clamp<int64_t>(CHUNK_KEYS / BS, 1, MAX_CHUNK_BLOCKS));
  P.BSP = int((BS + KEY_TILE - 1) / KEY_TILE * KEY_TILE);
  // Batch-invariant mode takes the build's default path whatever was chosen: a choice timed at
  // start-up may differ between two processes on one machine, and under AMX a row's sum order
  // would depend on the 16-row tile it falls in. AMX tiles take 32 values of D and 32 keys of a
  // chunk at a time.
  P.bf16_dot = parse_bf16_dot(invariant ? "" : bf16_dot);
  if (P.bf16_dot == BF16_AMX && (D % 32 != 0 || P.chunk_blocks * P.BSP % 32 != 0)) P.bf16_dot = BF16_AVX512;
  const bool amx_items = cache_dtype == at::kBFloat16 && P.bf16_dot == BF16_AMX;
  Plan plan = make_plan(B, qsl, sl, tables, table_stride, int(Hkv), G, int(BS), threads, kv_splits, invariant,
                        int(window), amx_items ? AMX_TILE_ROWS : TILE_ROWS);

  P.Hq = int(Hq);
  P.Hkv = int(Hkv);
  P.G = G;
  P.D = int(D);
  P.BS = int(BS);
  const double unit = cache_dtype == at::kFloat8_e4m3fn ? kv_unit<c10::Float8_e4m3fn>() : 1.0;
  P.scale = float(scale * k_scale * unit);
  P.v_out = float(v_scale * unit);
  P.qsl = qsl;
  P.seq_lens = sl;
  P.tables = tables;
  P.table_stride = table_stride;
  P.q_s0 = q.stride(0);
  P.q_s1 = q.stride(1);
  P.o_s0 = out.stride(0);
  P.o_s1 = out.stride(1);
  P.k_s0 = key_cache.stride(0);
  P.v_s0 = value_cache.stride(0);
  P.kv_row = Hkv * D;
  P.tile_rows = plan.tile_rows;
  P.invariant = invariant;
  P.window = int(window);
  P.softcap = float(softcap);
  P.sinks = sinks.has_value() ? sinks_f.data_ptr<float>() : nullptr;
  P.row_tokens = plan.row_tokens.data();
  std::unique_ptr<float[]> parts(new float[size_t(plan.part_rows) * (D + 2)]);
  P.part_o = parts.get();
  P.part_m = P.part_o + plan.part_rows * D;
  P.part_l = P.part_m + plan.part_rows;

  // Largest items first (dynamic scheduling then balances the tail).
  std::vector<int64_t> order(plan.items.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = int64_t(i);
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return plan.items[a].cost > plan.items[b].cost; });
  // Runs of merge entries for one (token, head), and how many contributions each still awaits:
  // the item that delivers a run's last one merges it, inside the same parallel region (a second
  // fork/join costs a scheduler time slice when the machine is oversubscribed).
  std::vector<int64_t> runs, run_keys;
  for (size_t i = 0; i < plan.merges.size(); ++i) {
    if (i == 0 || plan.merges[i].first != plan.merges[i - 1].first) {
      runs.push_back(int64_t(i));
      run_keys.push_back(plan.merges[i].first);
    }
  }
  runs.push_back(int64_t(plan.merges.size()));
  std::unique_ptr<std::atomic<int32_t>[]> awaiting(new std::atomic<int32_t>[run_keys.size()]);
  for (size_t r = 0; r < run_keys.size(); ++r) awaiting[r].store(int32_t(runs[r + 1] - runs[r]));

  auto run = [&](auto* tag, auto* cache_tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    using C = std::remove_pointer_t<decltype(cache_tag)>;
    const T* qp = reinterpret_cast<const T*>(q.data_ptr());
    const C* kp = reinterpret_cast<const C*>(key_cache.data_ptr());
    const C* vp = reinterpret_cast<const C*>(value_cache.data_ptr());
    T* op = reinterpret_cast<T*>(out.data_ptr());
    const int64_t n = int64_t(order.size());
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (n > 1)
    for (int64_t i = 0; i < n; ++i) {
      const Item& it = plan.items[order[i]];
      run_item<T, C>(P, it, qp, kp, vp, op);
      if (it.part_row < 0) continue;
      for (int t = 0; t < it.num_tok * it.num_heads; ++t) {
        const int64_t key = int64_t(plan.row_tokens[it.tok0 + t % it.num_tok]) * Hkv + it.h + t / it.num_tok;
        const int64_t r = std::lower_bound(run_keys.begin(), run_keys.end(), key) - run_keys.begin();
        // acq_rel: the last contributor sees every other contributor's partial rows.
        if (awaiting[r].fetch_sub(1, std::memory_order_acq_rel) == 1)
          merge_rows<T>(P, plan.merges.data() + runs[r], int(runs[r + 1] - runs[r]), op);
      }
    }
  };
  auto run_cache = [&](auto* tag) {
    if (cache_dtype == at::kFloat8_e4m3fn)
      run(tag, static_cast<c10::Float8_e4m3fn*>(nullptr));
    else if (cache_dtype == at::kFloat8_e5m2)
      run(tag, static_cast<c10::Float8_e5m2*>(nullptr));
    else
      run(tag, tag);
  };
  if (dtype == at::kFloat)
    run_cache(static_cast<float*>(nullptr));
  else
    run_cache(static_cast<c10::BFloat16*>(nullptr));
}

// The bf16 product paths this build has, in the order of Bf16Dot ("avx512_bf16" where compiled
// for AVX512_BF16, "amx_bf16" where for AMX and the kernel grants this process the tile state).
std::vector<std::string> bf16_dot_paths() {
  std::vector<std::string> paths{"fp32"};
#ifdef OI_DPBF16
  paths.push_back("avx512_bf16");
#endif
#ifdef OI_AMX_ATTENTION
  if (oi_amx::usable()) paths.push_back("amx_bf16");
#endif
  return paths;
}

std::string isa() {
  std::string s = "vec" + std::to_string(W);
#if defined(__AVX512F__)
  s += "+avx512f";
#endif
#if defined(__AVX512BF16__)
  s += "+avx512bf16";
#endif
#ifdef OI_AMX_ATTENTION
  s += "+amxbf16";
#endif
#if defined(__AVX2__)
  s += "+avx2";
#endif
#if defined(__FMA__)
  s += "+fma";
#endif
#if defined(__ARM_NEON)
  s += "+neon";
#endif
  return s;
}

// How a call would be planned (tests and benchmarks): items, of which shared-prefix items, and
// items writing partial results (shared-prefix members, split KV); as for float32 and the FMA
// paths of bf16 (TILE_ROWS).
std::tuple<int64_t, int64_t, int64_t> plan_stats(const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                                                 const at::Tensor& seq_lens, int64_t num_kv_heads, int64_t group,
                                                 int64_t block_size, int64_t threads, int64_t kv_splits,
                                                 bool invariant) {
  const auto qsl = query_start_loc.contiguous(), sl = seq_lens.contiguous();
  Plan plan = make_plan(seq_lens.size(0), qsl.data_ptr<int32_t>(), sl.data_ptr<int32_t>(),
                        block_tables.data_ptr<int32_t>(), block_tables.stride(0), int(num_kv_heads), int(group),
                        int(block_size), int(threads), kv_splits, invariant, 0, TILE_ROWS);
  int64_t shared = 0, partial = 0;
  for (const Item& it : plan.items) {
    shared += it.b < 0;
    partial += it.part_row >= 0;
  }
  return {int64_t(plan.items.size()), shared, partial};
}
