"""DeepSeek-V4.1 (``DeepseekV41ForCausalLM``, the model DeepInfer serves), text only: V4's
sink attention over a sliding window plus compressed entries, hyper-connected residual
streams and sqrt-softplus MoE, rearranged so that half the stack shares one cache (YOCO).

    producers   layers 0 .. c - 1: window (ratio 0) or C2 (ratio 2) attention
    consumers   layers c .. : C1 (ratio 1); c is the first ratio-1 layer

    streams ─ x = pre_prev · streams ─ norm ─ Attention ─ write-back ─ ... ─ MoE ─ ...
    ... ─ pre_last · streams ─ norm ─ head

Attention (one K = V head of ``head_dim``, interleaved RoPE on its last ``rope_dim`` dims,
queries through ``wq_a``/``q_norm``/``wq_b`` without a per-head norm): a query at position p
sees the window keys ``p - W + 1 .. p`` and, in a compressed layer of ratio n, the entries
``j < (p + 1) // n`` that its layer's indexer puts in its top ``index_topk``
(``Σ_h w_h · relu(q_h · k_j)``); one softmax with a per-head sink; the output rotated back,
projected by ``o_groups`` low-rank groups. Entries: C2 pools tokens 2j, 2j + 1 with a
per-channel softmax of their gates; C1 projects each token; both normed, then roped at the
group's first token. The index key of entry j is ``k_norm(wk(entry before RoPE))``, roped.

Sharing: a consumer's C1 entries are projections of one hidden state, the first consumer's
normed input (a function of the producers alone); a layer may read the entries, index keys or
top-k choice of an earlier layer (openinfer.models.arch.V41Arch), owning no cache for them.

Residual streams (``hc_shifted``): each sublayer's input is the streams weighted by the mix
the *previous* sublayer computed (the first: stream 0), and the last mix collapses them.

Cache slots (``kv_cache_specs``), per layer in order: its window keys; a C2 KV source's raw
rows (its last pair's projections and gates); a KV source's entries; an index-K source's
index keys. Prefix caching, tiers and preemption see ordinary sliding-window and compressed
pages. Candidate blocks (``candidate_source_layer_id``): that layer's indexer scores also
pick each query's best blocks of entries, and later indexers choose only among them. With
Engram, the first slot keeps each sequence's last ``engram_max_ngram_size``
compressed tokens (openinfer/models/engram.py), so a step's n-grams reach back into
earlier steps, prefix hits and transferred blocks alike. Bounded replay
(openinfer/models/v41_replay.py, on by default): in a prefill the consumers compute only its
last rows, exactly. Images and DSpark's draft layers (``mtp.*``) are not loaded.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from openinfer.attention import compressed
from openinfer.attention.base import AttentionMetadata
from openinfer.kernels.paged_attention import write_kv
from openinfer.kv.spec import CompressedSpec, KVSpec, SlidingWindowSpec
from openinfer.layers.embedding import LMHead, VocabEmbedding
from openinfer.layers.hyper_connections import HyperConnection, HyperHead
from openinfer.layers.norm import RMSNorm
from openinfer.models.arch import ArchConfig, V41Arch
from openinfer.models.base import CausalLM
from openinfer.models.deepseek_v4 import DeepseekV4ForCausalLM, SinkAttention, V4MoE, V4Rope
from openinfer.models.engram import Engram, compressed_vocabulary, table_primes
from openinfer.models.v41_replay import REPLAYED_FROM, replay_rows, replayed_from, replayed_rows, rows_view
from openinfer.models.v41_sparse import V41Compressor, V41Indexer, candidate_entries, top_k_entries

Slot = tuple[torch.Tensor, AttentionMetadata]
GRAM_SHIFTS = (16, 8, 0)
GRAM_DIGITS = len(GRAM_SHIFTS)
"""Engram's token history pages hold each compressed token id as base-256 digits."""


@dataclass
class V41Step:
    """What one forward step's layers hand each other: the Engram n-grams, the consumers'
    shared hidden state, each KV source's new entries before RoPE (with the positions their
    index keys are roped at), each index source's top-k choice for the layers that reuse it,
    and the candidate source's blocks; choices are per row of the whole step."""

    num_rows: int
    """The step's rows (a consumer on the last rows of each prefill attends for a subset)."""
    shared_hidden: torch.Tensor | None = None
    grams: torch.Tensor | None = None
    """Engram: [T, N] the compressed tokens at t, t - 1, .. t - N + 1 of each step token."""
    fresh: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    """KV source -> (positions [E], entries before RoPE [E, D]) of the entries made this step."""
    choices: dict[int, torch.Tensor] = field(default_factory=dict)
    """Index source -> [num_rows, entries] bool: each row's chosen entries."""
    candidates: torch.Tensor | None = None
    """[num_rows, entries] bool: the candidate source's blocks, as entries, per row."""

    def keep(self, chosen: torch.Tensor | None, count: int, rows: torch.Tensor,
             visible: torch.Tensor) -> torch.Tensor:
        """``visible`` ([Q, C], of step rows ``rows``) into a per-row table of ``count``
        entries (``chosen``, made here when None)."""
        if chosen is None:
            chosen = torch.zeros(self.num_rows, count, dtype=torch.bool, device=visible.device)
        chosen[rows, :visible.shape[1]] = visible
        return chosen


class V41Attention(SinkAttention):
    """Tensor parallel as V4's: heads, sinks and output groups split; the one K = V head,
    the entries and the indexer whole on every rank."""

    def __init__(self, arch: ArchConfig, v41: V41Arch, layer: int, ropes: dict[str, V4Rope]) -> None:
        ratio = v41.compress_ratios[layer]
        super().__init__(arch, v41.q_lora_rank, v41.o_groups, v41.o_lora_rank,
                         ropes["compress" if ratio else "main"])
        hidden, eps = arch.hidden_size, arch.rms_norm_eps
        self.layer, self.window, self.ratio = layer, v41.window, ratio
        self.kv_source, self.index_k_source = v41.kv_source[layer], v41.index_k_source[layer]
        self.index_source = v41.index_source[layer]
        self.consumer = layer >= v41.first_consumer
        self.candidate = v41.candidate
        """Candidate blocks: the source layer picks them, later indexers choose within them."""
        self.kv_norm = RMSNorm(self.head_dim, eps, fp32_weight=True)
        if self.ratio and self.kv_source == layer:
            self.compressor = V41Compressor(hidden, self.head_dim, self.ratio, eps)
        if self.ratio and self.index_source == layer:
            self.indexer = V41Indexer(arch, v41, makes_keys=self.index_k_source == layer)

    # ---- the layer's own KV slots ---------------------------------------------------------

    def own_slots(self) -> list[str]:
        """Window keys; a C2 KV source's raw rows (kv and gate of the last pair); a KV
        source's entries; an index-K source's index keys."""
        names = ["window"]
        if self.ratio and self.kv_source == self.layer:
            names += ["raw", "entries"] if self.ratio == 2 else ["entries"]
        if self.ratio and self.index_k_source == self.layer:
            names.append("index_keys")
        return names

    def slot_spec(self, name: str, block_size: int, dtype: str) -> KVSpec:
        if name == "window":
            return SlidingWindowSpec(block_size, 1, self.head_dim, dtype, self.window, shared_kv=True)
        if name == "raw":
            return SlidingWindowSpec(block_size, 1, self.head_dim, dtype, self.ratio)
        dim = self.head_dim if name == "entries" else self.indexer.head_dim
        return CompressedSpec(block_size, self.ratio, dim, dtype)

    # ---- forward ---------------------------------------------------------------------------

    def forward(self, positions: torch.Tensor, x: torch.Tensor, slots: dict[str, Slot],
                step: V41Step, published: bool = False) -> torch.Tensor:
        """``published``: the step's entries and index keys are already made (``publish``:
        a consumer running on the last rows of a prefill makes them for every row first)."""
        T, H, D = x.shape[0], self.num_heads, self.head_dim
        cos, sin = self.rope.cos_sin(positions, x.dtype)
        qr = self.q_norm(self.wq_a(x))
        q = self.rope(self.wq_b(qr).view(T, H, D), cos, sin)
        kv = self.rope(self.kv_norm(self.wkv(x)), cos, sin)
        window_cache, meta = slots["window"]
        write_kv(window_cache, kv[:, None], kv[:, None], meta.slot_mapping)
        if not published:
            self.publish(positions, x, slots, step)
        out = torch.empty(T, H, D, dtype=x.dtype, device=x.device)
        for batch in compressed.step_batches(meta):  # the decodes; groups of prefill chunks
            rows = batch.rows
            got = self._attend(batch, q[rows], qr[rows], x[rows], slots, step)
            out.index_copy_(0, batch.to_rows, got.flatten(0, 1).index_select(0, batch.take))
        return self.project_out(out, cos, sin)

    def publish(self, positions: torch.Tensor, x: torch.Tensor, slots: dict[str, Slot],
                step: V41Step) -> None:
        """A source's entries (a consumer's from the shared hidden state) and index keys."""
        if self.ratio and self.kv_source == self.layer:
            self._make_entries(step.shared_hidden if self.consumer else x, positions, slots, step)
        if self.ratio and self.index_k_source == self.layer:
            self._make_index_keys(slots, step)

    def _make_entries(self, h: torch.Tensor, positions: torch.Tensor, slots: dict[str, Slot],
                      step: V41Step) -> None:
        """The entries whose tokens complete in this step, stored (roped) and published to
        ``step.fresh`` (before RoPE) for the index keys."""
        c, m = self.compressor, self.ratio
        entry_cache, entry_meta = slots["entries"]
        if m == 1:  # one entry per token
            pre = c.norm(c.wkv(h))
            compressed.store_token_entries(entry_cache, entry_meta,
                                           self.rope(pre, *self.rope.cos_sin(positions, pre.dtype)))
            step.fresh[self.layer] = (positions, pre)
            return
        raw_cache, raw_meta = slots["raw"]
        write_kv(raw_cache, c.wkv(h)[:, None], c.wgate(h)[:, None], raw_meta.slot_mapping)
        new = compressed.new_entries(entry_meta, m, raw_meta)
        if new is None:
            step.fresh[self.layer] = (positions[:0], h.new_empty(0, self.head_dim))
            return
        page, offset = new.group
        pre = c.norm(c.pool_pairs(raw_cache[0][page, offset, 0].flatten(0, 1),
                                  raw_cache[1][page, offset, 0].flatten(0, 1)))
        roped = self.rope(pre, *self.rope.cos_sin(new.positions, pre.dtype))
        entry_cache[new.slot] = roped.to(entry_cache.dtype)
        step.fresh[self.layer] = (new.positions, pre)

    def _make_index_keys(self, slots: dict[str, Slot], step: V41Step) -> None:
        ix = self.indexer
        key_cache, key_meta = slots["index_keys"]
        at, pre = step.fresh[self.kv_source]
        if not pre.shape[0]:
            return
        keys = ix.k_norm(ix.wk(pre))
        keys = self.rope(keys, *self.rope.cos_sin(at, keys.dtype))
        if self.ratio == 1:
            compressed.store_token_entries(key_cache, key_meta, keys)
        else:
            key_cache[compressed.new_entries(key_meta, self.ratio).slot] = keys.to(key_cache.dtype)

    def _attend(self, batch: compressed.SequenceBatch, q: torch.Tensor, qr: torch.Tensor,
                x: torch.Tensor, slots: dict[str, Slot], step: V41Step) -> torch.Tensor:
        """A batch's queries ([P, N, ...]) over their window keys, their chosen entries and
        the sinks: [P, N, H, D]."""
        window_cache, meta = slots["window"]
        # (a consumer on a prefill's last rows: its keys before its first computed row were
        # never written)
        keys, allowed = compressed.batch_window(window_cache, meta, batch, self.window,
                                                meta.derived.get(REPLAYED_FROM))
        found = None
        if self.ratio:
            entry_cache, entry_meta = slots["entries"]
            found = compressed.batch_entries(entry_cache, entry_meta, batch, self.ratio)
        if found is not None:
            entries, visible = found
            rows = compressed.step_rows(meta, batch.rows)  # [P, N] rows of the whole step
            if self.index_source == self.layer:
                key_cache, key_meta = slots["index_keys"]
                index_keys, _ = compressed.batch_entries(key_cache, key_meta, batch, self.ratio)
                count = max(meta.seq_lens_list) // self.ratio  # the step's most entries
                visible = self._select(qr, x, batch, index_keys, visible, step, rows, count)
                step.choices[self.layer] = step.keep(
                    step.choices.get(self.layer), count, rows.flatten()[batch.take],
                    visible.flatten(0, 1)[batch.take])
            else:  # the source's rows include these (a consumer's rows are a suffix)
                visible = step.choices[self.index_source][rows][..., :visible.shape[-1]]
            keys = torch.cat([keys, entries], 1)
            allowed = torch.cat([allowed, visible], 2)
        return compressed.attend_with_sinks(q, keys, allowed, self.attn_sink, self.head_dim**-0.5)

    def _select(self, qr: torch.Tensor, x: torch.Tensor, batch: compressed.SequenceBatch,
                index_keys: torch.Tensor, visible: torch.Tensor, step: V41Step,
                rows: torch.Tensor, count: int) -> torch.Tensor:
        """[P, N, C]: the visible entries each query's indexer scores put in its top
        ``index_topk`` (after the candidate source: among its candidate blocks' entries).
        ``index_keys`` [P, C, DI]; ``rows`` [P, N]: the queries' rows in the whole step;
        ``count``: the step's most entries (the candidates' width)."""
        ix = self.indexer
        (P, N), heads, C = batch.positions.shape, ix.num_heads, visible.shape[-1]
        qi = self.rope(ix.wq_b(qr.flatten(0, 1)).view(P * N, heads, ix.head_dim),
                       *self.rope.cos_sin(batch.positions.flatten(), qr.dtype))
        scores = F.relu(torch.einsum("pnhd,pld->pnhl", qi.view(P, N, heads, -1).float(),
                                     index_keys.float()))
        score = (scores * ix.weights_proj(x.flatten(0, 1)).float().view(P, N, heads, 1)).sum(2)
        score, visible = score.flatten(0, 1), visible.flatten(0, 1)
        if self.candidate is not None and self.layer == self.candidate.source:
            step.candidates = step.keep(step.candidates, count,
                                        rows.flatten()[batch.take],
                                        candidate_entries(score, visible, self.candidate)[batch.take])
        elif self.candidate is not None and self.layer > self.candidate.source:
            visible = visible & step.candidates[rows.flatten()][:, :C]
        return top_k_entries(score, visible, ix.topk).view(P, N, C)


class V41DecoderLayer(nn.Module):
    def __init__(self, arch: ArchConfig, v41: V41Arch, layer: int, ropes: dict[str, V4Rope]) -> None:
        super().__init__()
        hidden, eps = arch.hidden_size, arch.rms_norm_eps
        streams, iters, hc_eps = v41.hc_mult, v41.hc_sinkhorn_iters, v41.hc_eps
        self.shifted = v41.hc_shifted
        self.shares_hidden = layer == v41.first_consumer
        self.hc_attn = HyperConnection(streams, hidden, iters, hc_eps, eps)
        self.attn_norm = RMSNorm(hidden, eps, fp32_weight=True)
        self.attn = V41Attention(arch, v41, layer, ropes)
        self.hc_ffn = HyperConnection(streams, hidden, iters, hc_eps, eps)
        self.ffn_norm = RMSNorm(hidden, eps, fp32_weight=True)
        self.ffn = V4MoE(arch, v41.routed_scaling_factor, v41.swiglu_limit,
                         shared_experts=arch.moe.num_shared_experts, vision_bias=True)
        self.engram: Engram | None = None  # set by the model on Engram layers

    def forward(self, positions: torch.Tensor, h: torch.Tensor, pre: torch.Tensor | None,
                input_ids: torch.Tensor, slots: dict[str, Slot], step: V41Step,
                grams: torch.Tensor | None, published: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(streams, this layer's last mix: the next sublayer's ``pre`` when shifted).
        ``pre`` None: the first layer, whose input is stream 0 (the embedding). ``grams``:
        the rows' Engram n-grams. ``published``: the step's shared hidden state, entries and
        index keys are already made (for every row, by the model)."""
        if self.engram is not None:
            h = self.engram(h, grams)
        mix, post, comb = self.hc_attn.mixes(h)
        x = self._input(h, pre, mix)
        xn = self.attn_norm(x)
        if self.shares_hidden and not published:
            step.shared_hidden = xn
        h = HyperConnection.write_back(h, post, comb, self.attn(positions, xn, slots, step, published))
        mix_ffn, post, comb = self.hc_ffn.mixes(h)
        x = self._input(h, mix, mix_ffn)
        h = HyperConnection.write_back(h, post, comb, self.ffn(self.ffn_norm(x), input_ids))
        return h, mix_ffn

    def normed_input(self, h: torch.Tensor, pre: torch.Tensor | None) -> torch.Tensor:
        """The attention's normed input of every row (the consumers' shared hidden state)."""
        if self.engram is not None:
            raise ValueError("an Engram layer cannot start the YOCO consumers")
        mix = None if self.shifted else self.hc_attn.mixes(h)[0]
        return self.attn_norm(self._input(h, pre, mix))

    def _input(self, h: torch.Tensor, previous: torch.Tensor | None, own: torch.Tensor) -> torch.Tensor:
        if not self.shifted:
            return HyperConnection.collapse(own, h)
        return h[:, 0] if previous is None else HyperConnection.collapse(previous, h)


class DeepseekV41ForCausalLM(CausalLM):
    """Module names are the release checkpoint's (``embed``, ``layers.<l>.attn.wq_a``,
    ``layers.<l>.ffn.experts.<e>.w1``, ``hc_attn_fn``, ``norm``, ``head``); a leading
    ``model.`` is read past. DSpark's ``mtp.*`` and the vision tower's tensors are not
    loaded (the loader names them in its log)."""

    supports_tensor_parallel = True
    supports_decode_graphs = False  # its batches are made from the step's lengths on the host
    supports_fp8_kv_cache = False  # entries and index keys are read in torch, unscaled

    # DeepSeek's names of expert, shared-expert and mHC tensors, as V4's.
    expert_weights = DeepseekV4ForCausalLM.expert_weights
    packed_modules = DeepseekV4ForCausalLM.packed_modules
    checkpoint_renames = DeepseekV4ForCausalLM.checkpoint_renames

    def __init__(self, arch: ArchConfig) -> None:
        super().__init__()
        v41 = arch.deepseek_v41()
        hidden, eps, max_position = arch.hidden_size, arch.rms_norm_eps, arch.rope.max_position
        ropes = {"main": V4Rope(v41.rope_dim, v41.rope_theta, None, max_position),
                 "compress": V4Rope(v41.rope_dim, v41.compress_rope_theta, v41.compress_rope_scaling,
                                    max_position)}
        self.checkpoint_prefixes = {"model.": ""}
        self.streams, self.shifted = v41.hc_mult, v41.hc_shifted
        self.embed = VocabEmbedding(arch.vocab_size, hidden)
        self.layers = nn.ModuleList(V41DecoderLayer(arch, v41, i, ropes) for i in range(arch.num_layers))
        if not self.shifted:
            self.hc_head = HyperHead(self.streams, hidden, v41.hc_eps, eps)
        self.norm = RMSNorm(hidden, eps, fp32_weight=True)
        self.head = LMHead(arch.vocab_size, hidden, None)
        self.engram = v41.engram
        self._owners: list[tuple[int, str]] = []
        """(layer, slot name) of each cache slot, in order; layer -1: the model's."""
        if self.engram is not None:
            self._add_engram(arch, v41)
            self._owners.append((-1, "grams"))
        self.replay_rows = replay_rows(v41)
        """Consumer layer -> the last rows of a prefill it computes (bounded replay); empty: off."""
        self.num_rows_skipped = 0
        """Consumer-layer rows bounded replay did not compute (summed over layers)."""
        self._slots: list[dict[str, int]] = []
        """Per layer, the cache slot it reads for each name: its own, or its source's."""
        for layer in self.layers:
            attn, slots = layer.attn, {}
            for name in attn.own_slots():
                slots[name] = len(self._owners)
                self._owners.append((attn.layer, name))
            if attn.ratio:
                for name, source in (("entries", attn.kv_source), ("index_keys", attn.index_k_source)):
                    if name not in slots:
                        slots[name] = self._slots[source][name]
            self._slots.append(slots)

    def _add_engram(self, arch: ArchConfig, v41: V41Arch) -> None:
        """Engram modules on their layers, and the compressed vocabulary they read."""
        engram = v41.engram
        table = compressed_vocabulary(engram.tokenizer_file)
        vocab = max(table) + 1
        table += [table[engram.pad_token]] * (arch.vocab_size - len(table))  # padded embedding rows
        self.register_buffer("compressed", torch.tensor(table, dtype=torch.long), persistent=False)
        self.compressed_pad = table[engram.pad_token]
        primes = table_primes(engram)
        for layer in engram.layer_ids:
            self.layers[layer].engram = Engram(engram, layer, primes[layer], vocab, arch.hidden_size,
                                               v41.hc_mult, arch.rms_norm_eps)

    def kv_cache_specs(self, block_size: int, dtype: str) -> list[KVSpec | None]:
        """The Engram token history (if any), then every layer's own slots in layer order
        (see the module docstring)."""
        specs = []
        for layer, name in self._owners:
            if layer < 0:
                specs.append(SlidingWindowSpec(block_size, 1, GRAM_DIGITS, dtype, self.engram.max_ngram,
                                               shared_kv=True))
                continue
            spec = self.layers[layer].attn.slot_spec(name, block_size, dtype)
            if name == "window" and layer in self.replay_rows:
                spec = dataclasses.replace(spec, replay_rows=self.replay_rows[layer])
            specs.append(spec)
        return specs

    def _grams(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: torch.Tensor,
               meta: AttentionMetadata) -> torch.Tensor:
        """[T, N]: each step token's compressed token and those of the N - 1 before it (the
        pad token before the sequence), read back from the history pages, where the step's
        own are written first (as base-256 digits: exact in any float dtype)."""
        ids = self.compressed[input_ids]
        digits = torch.stack([(ids >> s) & 255 for s in GRAM_SHIFTS], -1).to(cache.dtype)
        write_kv(cache, digits[:, None], digits[:, None], meta.slot_mapping)
        lens = meta.query_start_loc[1:] - meta.query_start_loc[:-1]
        tables = meta.block_tables.long()[torch.repeat_interleave(
            torch.arange(len(lens), device=lens.device), lens.long())]
        back = positions[:, None].long() - torch.arange(self.engram.max_ngram, device=ids.device)
        bs = meta.block_size
        pages = tables.gather(1, back.clamp(min=0) // bs)
        read = cache[0][pages, back.clamp(min=0) % bs, 0].long()
        grams = sum(read[..., i] << s for i, s in enumerate(GRAM_SHIFTS))
        return torch.where(back >= 0, grams, self.compressed_pad)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], metas: list[AttentionMetadata]) -> torch.Tensor:
        x = self.embed(input_ids)
        h = x.unsqueeze(1).expand(-1, self.streams, -1).contiguous()
        step, pre = V41Step(num_rows=input_ids.shape[0]), None
        if self.engram is not None:
            step.grams = self._grams(input_ids, positions, kv_caches[0], metas[0])
        for index, (layer, slots) in enumerate(zip(self.layers, self._slots, strict=True)):
            views = {name: (kv_caches[i], metas[i]) for name, i in slots.items()}
            rows = replayed_rows(self.replay_rows.get(index), positions, views["window"][1])
            if rows is None:
                h, pre = layer(positions, h, pre, input_ids, views, step, step.grams)
                continue
            # A consumer on the last rows of each prefill: what the rows it skips feed into
            # other rows' queries (the shared hidden state, entries, index keys) first, for all.
            if layer.shares_hidden:
                step.shared_hidden = layer.normed_input(h, pre)
            layer.attn.publish(positions, step.shared_hidden, views, step)
            self.num_rows_skipped += positions.shape[0] - rows.numel()
            if not rows.numel():
                continue
            window_cache, meta = views["window"]
            computed_from = replayed_from(self.replay_rows[index], meta)
            views["window"] = (window_cache, rows_view(meta, rows, computed_from))
            grams = None if step.grams is None else step.grams[rows]
            out, mix = layer(positions[rows], h[rows], None if pre is None else pre[rows],
                             input_ids[rows], views, step, grams, published=True)
            h = h.index_copy(0, rows, out)
            if pre is None:  # (the first layer a consumer: no mix before it)
                pre = mix.new_zeros(h.shape[0], mix.shape[1])
            pre = pre.index_copy(0, rows, mix)
        if self.shifted:
            return self.norm(HyperConnection.collapse(pre, h))
        return self.norm(self.hc_head(h))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden)
