// The two-pass items of the CPU paged attention (paged_attention.cpp): the many-row items of a
// bf16 cache on the VDPBF16PS and AMX paths, when two_pass_fits. Included by
// paged_attention.cpp only.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "attention_bf16.h"
#include "paged_attention.h"
#include "vec.h"

namespace oi_paged {

using namespace oi_vec;
using namespace oi_attention;


#ifdef OI_DPBF16
// Keys an item may span and still take the two-pass bf16 path: its K (transposed) and V (paired)
// are packed whole, 4 * D bytes per key, and a group's scores and probabilities take 6 * 32 bytes
// per key: 4096 keys of D = 128 take 2.75 MiB of the thread's scratch.
constexpr int TWO_PASS_KEYS = 4096;

// Whether run_item_two_pass takes an item of a bf16 cache: no window or soft cap (their
// masks and score transform are the online path's), blocks of an even size (pairs of keys never
// straddle two blocks), at most TWO_PASS_KEYS keys, and not in batch-invariant mode (an item's
// key range follows its tile of tokens, which moves with the chunking of a prompt: a row near
// TWO_PASS_KEYS could take either path, and the two paths round differently).
inline bool two_pass_fits(const Params& P, const Item& it) {
  return !P.invariant && P.window <= 0 && P.softcap <= 0.f && P.BS % 2 == 0 && P.D <= 256 &&
         int64_t(it.blk1 - it.blk0) * P.BS <= TWO_PASS_KEYS;
}

// A many-row item of a bf16 cache in two passes per group of up to 32 rows, instead of an online
// softmax per chunk of keys: the item's K blocks are transposed into pairs and its V blocks
// interleaved into pairs once, for all its keys; then each group takes its scores over every key
// its last row can see (the causal triangle at a granularity of 16 keys), one exact max and one
// exponent pass per row (P in bf16, as on the online path), and P.V with O held in tiles (AMX) or
// registers (VDPBF16PS) over every key: no running max, no rescaling of O, no O round trip through
// memory per chunk. On AMX a group is two tiles of 16 rows (a head's last rows padded with zero
// queries). Same results as the online path up to the order of the fp32 sums.
inline void run_item_two_pass(const Params& P, const Item& it, const c10::BFloat16* q, const c10::BFloat16* kc,
                       const c10::BFloat16* vc, c10::BFloat16* out, bool amx) {
  const int G = P.G, D = P.D, BS = P.BS;
  const int32_t* tokens = P.row_tokens + it.tok0;
  const int ntok = it.num_tok, NH = it.num_heads, MH = ntok * G;
  int pos0 = NO_MASK, kv_end = it.blk1 * BS;
  if (it.b >= 0) {
    pos0 = P.seq_lens[it.b] - (P.qsl[it.b + 1] - tokens[0]);
    kv_end = std::min(kv_end, pos0 + ntok);
  }
  const int key0 = it.blk0 * BS;
  const int L = std::max(0, kv_end - key0);  // the item's keys
  const int LD = std::max(32, (L + 31) / 32 * 32);  // their row length in the buffers, padded
  // Keys row `r` of a head sees among the item's.
  auto visible = [&](int r) { return std::clamp(pos0 + r / G + 1 - key0, 0, L); };

  const int groups = (MH + 15) / 16;
  float* scratch = tls_scratch.get(size_t(groups) * 16 * D / 2 + size_t(LD) * D + 32 * size_t(LD) * 3 / 2 +
                                   32 * size_t(D) + 32);
  auto* qp = reinterpret_cast<uint32_t*>(scratch);  // [groups * 16][D/2] Q rows as pairs of D
  auto* kt = qp + size_t(groups) * 16 * D / 2;      // [D/2][LD] K transposed, as pairs of D
  auto* vp = kt + size_t(D / 2) * LD;               // [LD/2][D] V rows interleaved in pairs
  float* s = reinterpret_cast<float*>(vp + size_t(LD / 2) * D);  // [32][LD] two groups' scores
  auto* pb = reinterpret_cast<c10::BFloat16*>(s + 32 * size_t(LD));  // [32][LD] their P in bf16
  float* o = s + 32 * size_t(LD) + 16 * size_t(LD);  // [32][D] their unnormalised output
  float m[32], l[32];
#ifdef OI_AMX_ATTENTION
  if (amx) configure_tiles();
#endif

  const int32_t* table = P.tables + int64_t(it.table_b) * P.table_stride;
  for (int hi = 0; hi < NH; ++hi) {
    const int64_t head0 = int64_t(it.h + hi) * D;
    for (int r = 0; r < groups * 16; ++r) {
      uint32_t* dst = qp + size_t(r) * (D / 2);
      if (r >= MH) {  // padding rows: zeros, never written out
        std::fill(dst, dst + D / 2, 0u);
        continue;
      }
      const int64_t qh = int64_t((it.h + hi) * G + r % G);
      std::memcpy(dst, q + int64_t(tokens[r / G]) * P.q_s0 + qh * P.q_s1, size_t(D) * 2);
    }
    for (int k0 = 0; k0 < L; k0 += BS) {
      const int64_t block = table[it.blk0 + k0 / BS];
      const int n = std::min(BS, L - k0);
      const c10::BFloat16* kb = kc + block * P.k_s0 + head0;
      // A key row read as D/2 32-bit words is its pairs of D: transposed as fp32 would be.
      transpose_keys(reinterpret_cast<const float*>(kb), P.kv_row / 2, n, D / 2,
                     reinterpret_cast<float*>(kt) + k0, LD);
      pack_value_pairs(vc + block * P.v_s0 + head0, P.kv_row, n, D, vp + size_t(k0 / 2) * D);
    }
    for (int d = 0; d < D / 2; ++d) std::fill(kt + size_t(d) * LD + L, kt + size_t(d + 1) * LD, 0u);
    std::fill(vp + size_t((L + 1) / 2) * D, vp + size_t(LD / 2) * D, 0u);

    for (int g0 = 0; g0 < MH; g0 += 32) {
      const int rows = std::min(32, MH - g0);
      const int span = amx ? (rows > 16 ? 32 : 16) : rows;  // AMX: two tiles of 16 rows or one
      const int seen = visible(g0 + rows - 1);  // rows are in position order: the last sees most
      if (seen > 0) {
        const int width = (seen + 31) / 32 * 32;
        const uint32_t* qg = qp + size_t(g0) * (D / 2);
#ifdef OI_AMX_ATTENTION
        if (amx && span == 32)
          pair_scores_amx(qg, D, kt, LD, width, s);
        else if (amx)
          group_scores_amx(qg, D, kt, LD, (seen + 15) / 16 * 16, s);
        else
#endif
          scores_bf16(rows, qg, D / 2, kt, LD, 1.f, s, LD, (seen + 15) / 16 * 16);
        for (int i = 0; i < span; ++i) {
          float* srow = s + size_t(i) * LD;
          c10::BFloat16* prow = pb + size_t(i) * LD;
          const int vis = i < rows ? visible(g0 + i) : seen;
          if (vis == 0) {  // no key of this item is at or before the row's position
            std::fill(prow, prow + width, c10::BFloat16(0.f));
            m[i] = NEG_INF;
            l[i] = 0.f;
            continue;
          }
          std::fill(srow + vis, srow + width, NEG_INF);
          __m512 mx = _mm512_loadu_ps(srow);
          for (int k = 16; k < width; k += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(srow + k));
          m[i] = _mm512_reduce_max_ps(mx) * P.scale;  // scaled scores (scale > 0)
          l[i] = probabilities_bf16(srow, width, P.scale, m[i], prow);
        }
#ifdef OI_AMX_ATTENTION
        if (amx && span == 32)
          pair_pv_amx(pb, LD, vp, D, width, o);
        else if (amx)
          group_pv_amx(pb, LD, vp, D, width, o);
        else
#endif
        {
          std::fill(o, o + size_t(rows) * D, 0.f);
          accumulate_pv_bf16(rows, reinterpret_cast<const uint32_t*>(pb), LD / 2, vp, width / 2, o, D);
        }
      } else {
        std::fill(o, o + 32 * size_t(D), 0.f);
        std::fill(m, m + 32, NEG_INF);
        std::fill(l, l + 32, 0.f);
      }
      for (int i = 0; i < rows; ++i) {
        const int r = g0 + i;
        if (it.part_row >= 0) {
          const int64_t row = it.part_row + int64_t(hi) * MH + r;
          std::copy(o + size_t(i) * D, o + size_t(i + 1) * D, P.part_o + row * D);
          P.part_m[row] = m[i];
          P.part_l[row] = l[i];
          continue;
        }
        const int64_t head = int64_t(it.h + hi) * G + r % G;
        store_from_float(out + int64_t(tokens[r / G]) * P.o_s0 + head * P.o_s1, o + size_t(i) * D, D,
                         normaliser(m[i], l[i], P.sinks, head) * P.v_out);
      }
    }
  }
}
#endif

}  // namespace oi_paged
