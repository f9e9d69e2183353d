"""A model's architecture, read from its Hugging Face config (config.json) once.

Model files read attributes of an ``ArchConfig``, never the raw dict: how each key is spelled
(transformers v4 and v5 names, aliases) and what it defaults to is decided here, in one place.

    ArchConfig                 every decoder: sizes, heads, norm eps, activation, windows
      .rope       RopeArch     base, scaling, the positions the model was trained on
      .moe        MoEArch      routed experts and how they are picked (none: a dense model)
      .mla()      MLAConfig    DeepSeek-V2/V3's latent attention (openinfer.layers.mla)
      .deepseek_v4() V4Arch    DeepSeek-V4's compressed attention, hyper-connections, MoE
      .deepseek_v41() V41Arch  DeepSeek-V4.1's: YOCO split, cross-layer KV and index sharing
      .raw                     the dict itself, for a key that one model alone reads

``mla()``, ``deepseek_v4()`` and ``deepseek_v41()`` are methods, not fields: their keys are required, and only
the models built from them ask (each once, in its constructor). The modules below models/ in
the import order (``config.py``, ``engine_args.py``, ``gguf_file.py``) read the few keys they
need from the dict themselves: they cannot import this one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from openinfer.layers.mla import MLAConfig, yarn_softmax_scale

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
"""DeepSeek-V4's layer types: window only; compressed sparse (CSA); heavily compressed (HCA)."""
DEFAULT_COMPRESS_RATES = {CSA: 4, HCA: 128}


@dataclass(frozen=True)
class RopeArch:
    theta: float
    """The frequencies' base: ``rope_theta`` (or inside v5's ``rope_parameters``); 10000."""
    scaling: dict[str, Any] | None
    """``rope_scaling`` (transformers v4) or ``rope_parameters`` (v5): its type and parameters."""
    max_position: int
    """``max_position_embeddings``: the trained context. The cos/sin table spans it, and
    llama3/YaRN scaling read it, whatever max_model_len is."""
    partial_rotary_factor: float
    """The fraction of each head's dims that is rotated (the leading ones); 1."""


@dataclass(frozen=True)
class MoEArch:
    num_experts: int = 0
    """Routed experts (``n_routed_experts``, ``num_experts`` or ``num_local_experts``); 0: dense."""
    top_k: int = 0
    """Experts per token (``num_experts_per_tok``)."""
    intermediate_size: int = 0
    """Each routed expert's (``moe_intermediate_size``; Mixtral's are ``intermediate_size``)."""
    num_shared_experts: int = 0
    """DeepSeek's always-on experts (``n_shared_experts``), one MLP that many experts wide."""
    first_dense_layers: int = 0
    """DeepSeek: layers before this one have a dense MLP (``first_k_dense_replace``)."""
    layer_freq: int = 1
    """DeepSeek: every ``moe_layer_freq``-th layer after those is sparse."""
    sparse_step: int = 1
    """Qwen3-MoE: layer i is sparse when ``(i + 1) % decoder_sparse_step == 0`` ..."""
    dense_layers: tuple[int, ...] = ()
    """... and it is not one of ``mlp_only_layers``."""
    norm_topk_prob: bool = False
    """Renormalise the chosen experts' weights to sum to one."""
    routed_scaling_factor: float = 1.0
    """DeepSeek: the routed experts' weights are scaled by it."""
    topk_method: str | None = None
    """DeepSeek's routing (``greedy``, ``group_limited_greedy``, ``noaux_tc``); None: unset,
    the model's own default applies."""
    scoring_func: str | None = None
    """DeepSeek: ``softmax`` or ``sigmoid`` scores; None: unset (the method's default)."""
    num_groups: int = 1
    """DeepSeek: experts in ``n_group`` groups ..."""
    topk_groups: int = 1
    """... of which a token's experts come from its best ``topk_group``."""


@dataclass(frozen=True)
class V4Arch:
    """DeepSeek-V4's own parts (openinfer/models/deepseek_v4.py); the common sizes are the
    ``ArchConfig``'s (``head_dim`` is its one key/value head's)."""

    layer_types: tuple[str, ...]
    """Each layer's attention: ``SLIDING``, ``CSA`` or ``HCA``."""
    mlp_layer_types: tuple[str, ...]
    """Each layer's MoE: ``hash_moe`` (experts by token id) or ``moe`` (by score); without
    ``mlp_layer_types``, the first ``num_hash_layers`` (3) are hashed."""
    compress_rates: dict[str, int]
    """Tokens per compressed entry, per layer type (``compress_rates`` over CSA 4, HCA 128)."""
    window: int
    """``sliding_window``: the recent tokens every layer attends to."""
    q_lora_rank: int
    """The queries' low-rank projection (``wq_a``), which the indexer's queries share."""
    o_groups: int
    """The output projection's low-rank groups, each over a contiguous run of heads ..."""
    o_lora_rank: int
    """... and each group's rank."""
    index_heads: int
    """CSA's lightning indexer: ``index_n_heads`` scoring heads ..."""
    index_head_dim: int
    """... of ``index_head_dim`` ..."""
    index_topk: int
    """... keeping each query's ``index_topk`` best entries."""
    rope_dim: int
    """The rotated (last) dims of each vector: ``head_dim * partial_rotary_factor``, or 64."""
    main_rope_theta: float
    """The window keys' RoPE base (``rope_parameters.main``, else ``rope_theta``)."""
    compress_rope: dict[str, Any]
    """The compressed entries' RoPE (``rope_parameters.compress``): its base and YaRN scaling."""
    compress_rope_theta: float
    """Its base (``compress_rope_theta``; 160000)."""
    hc_mult: int = 4
    """Residual streams mixed by hyper-connections ..."""
    hc_sinkhorn_iters: int = 20
    """... whose mixing matrix takes this many Sinkhorn iterations ..."""
    hc_eps: float = 1e-6
    routed_scaling_factor: float = 1.5
    """The routed experts' renormalised weights are scaled by it."""
    swiglu_limit: float = 10.0
    """Clamp of the SwiGLU inputs in routed and shared experts."""


@dataclass(frozen=True)
class EngramArch:
    """DeepSeek-V4.1's Engram (openinfer/models/engram.py): hashed n-gram embeddings gated
    into the residual streams of ``layer_ids``."""

    layer_ids: tuple[int, ...]
    max_ngram: int
    """``engram_max_ngram_size``: n-grams of 2 .. this many tokens, one table set each ..."""
    heads: int
    """... of ``engram_n_heads`` hashed tables ..."""
    head_dim: int
    """... of ``engram_head_dim``-wide rows ..."""
    table_size: int
    """... each about ``engram_vocab_size`` rows (the next unused prime above it)."""
    pad_token: int
    """The token id (before compression) that stands for positions before the sequence."""
    tokenizer_file: str
    """The checkpoint's tokenizer.json: its vocabulary compressed (case, accents, spacing
    folded) is what the n-grams are made of."""


@dataclass(frozen=True)
class CandidateArch:
    """DeepSeek-V4.1's candidate blocks: layer ``source``'s indexer scores also pick, per
    query, the ``topk_blocks`` blocks of ``block_size`` entries with the highest best score
    (the last block always), and every later indexer chooses among those blocks' entries."""

    source: int
    topk_blocks: int
    block_size: int


@dataclass(frozen=True)
class V41Arch:
    """DeepSeek-V4.1's own parts (openinfer/models/deepseek_v41.py), from its config.json's
    ``text_config`` (openinfer/config.py lifts it to the top level).

    Layer ``l``'s attention has ``compress_ratios[l]``: 0 a window only; 2 (C2) also one
    entry per two tokens; 1 (C1) one entry per token. The first C1 layer splits the stack:
    layers before it are *producers*, it and the layers after it *consumers* (YOCO), whose
    C1 entries are projections of one hidden state, the first consumer's normed input. A
    layer may read another's entries (``kv_source``), index keys (``index_k_source``) or
    top-k choice (``index_source``): each map sends a layer to the nearest source at or
    before it in the config's ``*_source_layer_ids`` (itself below the first)."""

    compress_ratios: tuple[int, ...]
    first_consumer: int
    """The first ratio-1 layer (DeepInfer's ``n_prefill_layer``)."""
    kv_source: tuple[int, ...]
    index_k_source: tuple[int, ...]
    index_source: tuple[int, ...]
    window: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    index_heads: int
    index_head_dim: int
    index_topk: int
    rope_dim: int
    """``qk_rope_head_dim``: the rotated (last) dims of every vector."""
    rope_theta: float
    """Window (ratio 0) layers' RoPE base."""
    compress_rope_theta: float
    """Compressed layers' RoPE base ..."""
    compress_rope_scaling: dict[str, Any] | None
    """... and their YaRN scaling (``rope_scaling``; its magnitude factor not applied)."""
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    hc_shifted: bool
    """Each sublayer reads the streams with the mix the previous one computed; the last mix
    collapses them (no ``hc_head``)."""
    routed_scaling_factor: float
    swiglu_limit: float
    num_draft_layers: int
    """``num_nextn_predict_layers``: DSpark's draft layers (``mtp.<i>``), not run here."""
    engram: EngramArch | None = None
    candidate: CandidateArch | None = None




def _source_map(ids: list[int], num_layers: int) -> tuple[int, ...]:
    """Each layer's source: the largest id at or before it; a layer before every id is its own."""
    ids = sorted(set(ids))
    return tuple(max((s for s in ids if s <= layer), default=layer) for layer in range(num_layers))


def _check_v41_topology(arch: V41Arch, topk: int) -> None:
    """DeepInfer's rules for the sharing maps: a layer that reads another's state is a
    compressed layer of the same ratio; every KV source is an index-K source and every index-K
    source an index source (so a layer reading a choice reads the chooser's keys and entries);
    nothing after the first consumer pools pairs (so, ratios differing, no consumer reads a
    producer's entries)."""
    ratios, n, c = arch.compress_ratios, len(arch.compress_ratios), arch.first_consumer
    if any(r == 2 for r in ratios[c:]):
        raise ValueError("DeepSeek-V4.1 config: compress_ratios has a ratio-2 layer after the "
                         f"first ratio-1 layer ({c}); consumers pool nothing")
    maps = {"kv_source_layer_ids": arch.kv_source, "index_k_source_layer_ids": arch.index_k_source,
            "index_source_layer_ids": arch.index_source}
    for key, sources in maps.items():
        for layer, source in enumerate(sources):
            if source != layer and (ratios[layer] == 0 or ratios[layer] != ratios[source]):
                raise ValueError(f"DeepSeek-V4.1 config: {key} makes layer {layer} (compress ratio "
                                 f"{ratios[layer]}) read layer {source}'s (ratio {ratios[source]}): "
                                 "only a compressed layer of the same ratio may")
    for layer in range(n):
        own = [arch.kv_source[layer] == layer, arch.index_k_source[layer] == layer,
               arch.index_source[layer] == layer]
        if own != sorted(own):
            raise ValueError(f"DeepSeek-V4.1 config: layer {layer} is a source in "
                             f"{[k for k, o in zip(maps, own, strict=True) if o]} but not in the "
                             "others: every KV source must be an index-K source, every index-K "
                             "source an index source")
    if any(r for r in ratios) and topk <= 0:
        raise ValueError("DeepSeek-V4.1 config: compressed layers need index_topk > 0")


def _check_candidates(arch: V41Arch) -> None:
    """DeepInfer's rules: the source is an index source; it and every later layer have its
    compress ratio (so, consumers being C1, blocks of entries are blocks of tokens); enough
    blocks for the top-k."""
    c, ratios = arch.candidate, arch.compress_ratios
    if not 0 <= c.source < len(ratios) or arch.index_source[c.source] != c.source:
        raise ValueError(f"DeepSeek-V4.1 config: candidate_source_layer_id {c.source} is not an "
                         "index source layer")
    if any(r != ratios[c.source] for r in ratios[c.source:]):
        raise ValueError("DeepSeek-V4.1 config: every layer from candidate_source_layer_id "
                         f"{c.source} on must have its compress ratio ({ratios[c.source]})")
    if not 0 < c.block_size <= 16 or c.topk_blocks % 8 or c.topk_blocks * c.block_size < arch.index_topk:
        raise ValueError(f"DeepSeek-V4.1 config: candidate_topk_blocks {c.topk_blocks} x "
                         f"candidate_block_size {c.block_size}: the size must be 1..16, the count a "
                         f"multiple of 8, and together at least index_topk ({arch.index_topk})")


@dataclass(frozen=True)
class ArchConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    """``num_hidden_layers`` (DeepSeek's MTP layers come after them)."""
    num_heads: int
    """Query heads of all tensor-parallel ranks (``num_attention_heads``)."""
    num_kv_heads: int
    """KV heads of all ranks (``num_key_value_heads``; as many as the query heads)."""
    head_dim: int
    """``head_dim``, or ``hidden_size / num_attention_heads``."""
    intermediate_size: int
    """The dense MLP's features; 0 where the config has none (DeepSeek-V4: all MoE)."""
    rms_norm_eps: float
    """Every RMSNorm's epsilon; 1e-6."""
    hidden_act: str
    """The gated MLP's activation: ``hidden_act`` (Gemma: ``hidden_activation``); silu."""
    attention_bias: bool
    """Biases on q/k/v and o (Llama's ``attention_bias``); false."""
    mlp_bias: bool
    tie_word_embeddings: bool
    """The LM head reuses the embedding; false (Gemma 2 reads its own default)."""
    sliding_windows: tuple[int | None, ...]
    """Each layer's attention window, None for full attention (``sliding_window_of``)."""
    num_mtp_layers: int
    """DeepSeek's multi-token-prediction layers after the decoder layers
    (``num_nextn_predict_layers``); 0."""
    rope: RopeArch
    moe: MoEArch
    raw: dict[str, Any] = field(repr=False, compare=False)
    """config.json as read, for the rare key one model alone reads."""
    source_dir: str | None = field(default=None, compare=False)
    """The checkpoint directory, for a model that reads more than weights there (V4.1's
    Engram reads the tokenizer)."""

    @classmethod
    def from_hf(cls, hf: dict[str, Any], source_dir: str | None = None) -> ArchConfig:
        heads = hf["num_attention_heads"]
        params = hf.get("rope_parameters") or {}
        layers = hf["num_hidden_layers"]
        return cls(
            vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], num_layers=layers,
            num_heads=heads, num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            intermediate_size=hf.get("intermediate_size", 0),
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            hidden_act=hf.get("hidden_activation") or hf.get("hidden_act", "silu"),
            attention_bias=bool(hf.get("attention_bias", False)),
            mlp_bias=bool(hf.get("mlp_bias", False)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            sliding_windows=tuple(sliding_window_of(hf, i) for i in range(layers)),
            num_mtp_layers=hf.get("num_nextn_predict_layers") or 0,
            rope=RopeArch(
                theta=float(hf.get("rope_theta") or params.get("rope_theta") or 10000.0),
                scaling=hf.get("rope_scaling") or hf.get("rope_parameters"),
                max_position=hf["max_position_embeddings"],
                partial_rotary_factor=hf.get("partial_rotary_factor", 1.0)),
            moe=_moe(hf),
            raw=hf,
            source_dir=source_dir,
        )

    def mla(self) -> MLAConfig:
        """The latent attention of a DeepSeek-V2/V3 config."""
        hf = self.raw
        nope, rope = hf["qk_nope_head_dim"], hf["qk_rope_head_dim"]
        return MLAConfig(
            hidden_size=self.hidden_size, num_heads=self.num_heads, nope_dim=nope, rope_dim=rope,
            v_dim=hf["v_head_dim"], latent_dim=hf["kv_lora_rank"],
            q_lora_rank=hf.get("q_lora_rank") or 0, bias=self.attention_bias,
            scale=yarn_softmax_scale(self.rope.scaling, nope + rope))

    def deepseek_v4(self) -> V4Arch:
        """The parts of a DeepSeek-V4 config that no other model has."""
        hf = self.raw
        params = self.raw.get("rope_parameters") or {}
        main, compress = params.get("main") or {}, params.get("compress") or {}
        hashed = hf.get("num_hash_layers", 3)
        return V4Arch(
            layer_types=tuple(hf["layer_types"]),
            mlp_layer_types=tuple(hf.get("mlp_layer_types")
                                  or ["hash_moe" if i < hashed else "moe" for i in range(self.num_layers)]),
            compress_rates={**DEFAULT_COMPRESS_RATES, **(hf.get("compress_rates") or {})},
            window=hf["sliding_window"], q_lora_rank=hf["q_lora_rank"],
            o_groups=hf["o_groups"], o_lora_rank=hf["o_lora_rank"],
            index_heads=hf.get("index_n_heads", 0), index_head_dim=hf.get("index_head_dim", 0),
            index_topk=hf.get("index_topk", 0),
            rope_dim=int(self.head_dim * (hf.get("partial_rotary_factor") or 64 / self.head_dim)),
            main_rope_theta=main.get("rope_theta", hf.get("rope_theta", 10000.0)),
            compress_rope=compress,
            compress_rope_theta=compress.get("rope_theta", hf.get("compress_rope_theta", 160000.0)),
            hc_mult=hf.get("hc_mult", 4), hc_sinkhorn_iters=hf.get("hc_sinkhorn_iters", 20),
            hc_eps=hf.get("hc_eps", 1e-6),
            routed_scaling_factor=hf.get("routed_scaling_factor", 1.5),
            swiglu_limit=hf.get("swiglu_limit", 10.0),
        )

    def deepseek_v41(self) -> V41Arch:
        """The parts of a DeepSeek-V4.1 config that no other model has, checked as DeepInfer
        checks them; options openinfer does not implement are refused by name."""
        hf = self.raw
        routing = {"scoring_func": "sqrtsoftplus", "topk_method": "noaux_tc", "norm_topk_prob": True}
        for key, want in routing.items():
            if hf.get(key) != want:
                raise ValueError(f"DeepSeek-V4.1 config: {key}={hf.get(key)!r} is not supported "
                                 f"({want!r} is)")
        n, drafts = self.num_layers, hf.get("num_nextn_predict_layers") or 0
        ratios = tuple(hf["compress_ratios"])
        if len(ratios) != n + drafts:
            raise ValueError(f"DeepSeek-V4.1 config: compress_ratios has {len(ratios)} entries, "
                             f"not num_hidden_layers + num_nextn_predict_layers = {n + drafts}")
        ratios = ratios[:n]
        if any(r not in (0, 1, 2) for r in ratios):
            raise ValueError(f"DeepSeek-V4.1 config: compress_ratios {list(ratios)}: each is 0, 1 or 2")
        if 1 not in ratios:
            raise ValueError("DeepSeek-V4.1 config: compress_ratios has no ratio-1 layer (the "
                             "first one starts the YOCO consumers)")
        kv_ids = hf["kv_source_layer_ids"]
        if not kv_ids:
            raise ValueError("DeepSeek-V4.1 config: kv_source_layer_ids is empty")
        index_k_ids = hf.get("index_k_source_layer_ids") or kv_ids
        scaling = hf.get("rope_scaling")
        arch = V41Arch(
            compress_ratios=ratios, first_consumer=ratios.index(1),
            kv_source=_source_map(kv_ids, n), index_k_source=_source_map(index_k_ids, n),
            index_source=_source_map(hf["index_source_layer_ids"], n),
            window=hf["sliding_window"], q_lora_rank=hf["q_lora_rank"],
            o_groups=hf["o_groups"], o_lora_rank=hf["o_lora_rank"],
            index_heads=hf.get("index_n_heads", 0), index_head_dim=hf.get("index_head_dim", 0),
            index_topk=hf.get("index_topk", 0), rope_dim=hf["qk_rope_head_dim"],
            rope_theta=float(hf["rope_theta"]),
            compress_rope_theta=float(hf.get("compress_rope_theta") or hf["rope_theta"]),
            compress_rope_scaling={"type": "yarn", **scaling} if scaling else None,
            hc_mult=hf["hc_mult"], hc_sinkhorn_iters=hf["hc_sinkhorn_iters"], hc_eps=hf["hc_eps"],
            hc_shifted=hf.get("hc_shifted", True),
            routed_scaling_factor=float(hf["routed_scaling_factor"]),
            swiglu_limit=float(hf["swiglu_limit"]), num_draft_layers=drafts,
            engram=self._engram() if hf.get("engram_layer_ids") else None,
            candidate=None if hf.get("candidate_source_layer_id") is None else CandidateArch(
                source=hf["candidate_source_layer_id"], topk_blocks=hf["candidate_topk_blocks"],
                block_size=hf["candidate_block_size"]),
        )
        _check_v41_topology(arch, arch.index_topk)
        if arch.candidate is not None:
            _check_candidates(arch)
        return arch

    def _engram(self) -> EngramArch:
        hf = self.raw
        if not hf.get("engram_compressed_vocab_size"):
            raise ValueError("DeepSeek-V4.1 config: Engram without engram_compressed_vocab_size "
                             "(n-grams of the uncompressed vocabulary) is not supported")
        if self.source_dir is None:
            raise ValueError("DeepSeek-V4.1 with Engram: its tokenizer.json is needed and the "
                             "checkpoint has no directory")
        return EngramArch(
            layer_ids=tuple(hf["engram_layer_ids"]), max_ngram=hf["engram_max_ngram_size"],
            heads=hf["engram_n_heads"], head_dim=hf["engram_head_dim"],
            table_size=hf["engram_vocab_size"], pad_token=hf.get("engram_pad_token_id", 2),
            tokenizer_file=f"{self.source_dir}/tokenizer.json")


def _moe(hf: dict[str, Any]) -> MoEArch:
    return MoEArch(
        num_experts=_routed_experts(hf), top_k=hf.get("num_experts_per_tok", 0),
        intermediate_size=hf.get("moe_intermediate_size") or 0,
        num_shared_experts=hf.get("n_shared_experts") or 0,
        first_dense_layers=hf.get("first_k_dense_replace", 0),
        layer_freq=hf.get("moe_layer_freq") or 1, sparse_step=hf.get("decoder_sparse_step", 1),
        dense_layers=tuple(hf.get("mlp_only_layers") or ()),
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        routed_scaling_factor=float(hf.get("routed_scaling_factor") or 1.0),
        topk_method=hf.get("topk_method"), scoring_func=hf.get("scoring_func"),
        num_groups=hf.get("n_group") or 1, topk_groups=hf.get("topk_group") or 1,
    )


def _routed_experts(hf: dict[str, Any]) -> int:
    """Hub configs say n_routed_experts (DeepSeek) or num_experts (Qwen3-MoE); transformers 5
    may save either as num_local_experts (Mixtral's and gpt-oss's name)."""
    return hf.get("n_routed_experts") or hf.get("num_local_experts") or hf.get("num_experts") or 0


def sliding_window_of(hf: dict[str, Any], layer: int) -> int | None:
    """Layer ``layer``'s window from config.json: every layer's (Mistral, Mixtral), those that
    ``layer_types`` names ``sliding_attention``, or none (Qwen2/3 unless ``use_sliding_window``)."""
    window = hf.get("sliding_window")
    if not window or hf.get("use_sliding_window") is False:
        return None
    types = hf.get("layer_types")
    if types is not None:
        return window if types[layer] == SLIDING else None
    if "max_window_layers" in hf:  # Qwen configs written before layer_types existed
        return window if layer >= hf["max_window_layers"] else None
    return window
