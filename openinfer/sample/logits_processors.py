"""What edits a row's logits before sampling (steps 2-5 of openinfer/sample/sampler.py):
token constraints (allowed_token_ids, grammar masks, bad_words, logit_bias), min_tokens,
repetition / presence / frequency penalties, min-p, top-k and top-p. Every function is
row-local: a row's processed logits never depend on the batch."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence

import torch

from openinfer.kernels.cpu_attention import load_cpu_attention
from openinfer.sample.rows import SamplingRow, float_column

# --------------------------------------------------------------------------------------------
# Token constraints: allowed_token_ids, bad_words, logit_bias
# --------------------------------------------------------------------------------------------





def apply_token_constraints(logits: torch.Tensor, rows: list[SamplingRow], *,
                            copy: bool = True) -> torch.Tensor:
    """Tokens outside a row's ``allowed_token_ids`` or its grammar mask, and tokens that would
    complete one of its bad words, get -inf; then its ``logit_bias`` is added. One batched
    write per kind, for all rows.

    Returns ``logits`` itself when no row uses any of them (one attribute check per row, no
    tensor work). Otherwise, with ``copy``, a new tensor, and the input is never modified (it
    can still serve for the raw logprobs); without, ``logits`` edited in place. Token ids must
    lie in [0, V) (the input processor checks them).
    """
    edited = [i for i, row in enumerate(rows)
              if row.params.edits_logits or row.grammar_mask is not None]
    if not edited:
        return logits
    if copy:
        logits = logits.clone()
    device = logits.device
    constrained = [i for i in edited if rows[i].grammar_mask is not None]
    if constrained:
        apply_grammar_masks(logits, torch.stack([rows[i].grammar_mask for i in constrained]),
                            constrained)
    allowed = [i for i in edited if rows[i].params.allowed_token_ids]
    if allowed:
        row_index, token_index = _row_token_pairs(
            allowed, [rows[i].params.allowed_token_ids for i in allowed], device)
        drop = torch.zeros_like(logits, dtype=torch.bool)
        drop[torch.tensor(allowed, device=device)] = True
        drop[row_index, token_index] = False
        logits.masked_fill_(drop, -math.inf)
    banned = [(i, bad_word_bans(rows[i])) for i in edited if rows[i].params.bad_words_token_ids]
    banned = [(i, tokens) for i, tokens in banned if tokens]
    if banned:
        row_index, token_index = _row_token_pairs(
            [i for i, _ in banned], [tokens for _, tokens in banned], device)
        logits[row_index, token_index] = -math.inf
    biased = [i for i in edited if rows[i].params.logit_bias]
    if biased:
        biases = [rows[i].params.logit_bias for i in biased]
        row_index, token_index = _row_token_pairs(biased, [b.keys() for b in biases], device)
        values = torch.tensor(list(itertools.chain.from_iterable(b.values() for b in biases)),
                              dtype=logits.dtype).to(device, non_blocking=True)
        logits.index_put_((row_index, token_index), values, accumulate=True)
    return logits


def apply_grammar_masks(logits: torch.Tensor, packed: torch.Tensor, row_ids: list[int]) -> None:
    """Set ``logits[row_ids[r], t]`` to -inf where bit t of ``packed[r]`` is clear, in place:
    the CPU extension's kernel for float32 CPU logits (a word of allowed tokens costs one
    compare), else unpacked with torch."""
    kernels = load_cpu_attention() if logits.device.type == "cpu" else None
    if kernels is not None and logits.dtype == torch.float32 and logits.is_contiguous():
        kernels.apply_token_bitmask(logits, packed.contiguous(),
                                    torch.tensor(row_ids, dtype=torch.long))
        return
    refused = refused_tokens(packed, logits.shape[1]).to(logits.device, non_blocking=True)
    if len(row_ids) == logits.shape[0]:  # every row, in order: no gather and scatter
        logits.masked_fill_(refused, -math.inf)
        return
    index = torch.tensor(row_ids, device=logits.device)
    logits[index] = logits[index].masked_fill_(refused, -math.inf)


# Byte value -> which of its 8 bits are clear (little-endian bit order, as llguidance packs).
_CLEAR_BITS = (torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1 == 0


def refused_tokens(packed: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R, W] int32 packed masks (bit t of word t // 32 set: token t allowed) -> [R, V] bool,
    True where the token is refused. One table lookup per mask byte."""
    as_bytes = packed.contiguous().view(torch.uint8).flatten()  # little-endian words
    refused = _CLEAR_BITS.index_select(0, as_bytes.long())  # [R * 4W, 8]
    return refused.view(packed.shape[0], -1)[:, :vocab_size]


def bad_word_bans(row: SamplingRow) -> list[int]:
    """Tokens the row's bad words forbid as its next token (vLLM semantics): the last token of
    every bad word whose other tokens are the last tokens of the output so far. A one-token bad
    word is always banned. Only output tokens count, never the prompt."""
    output = row.output_token_ids
    num_output = len(output)
    banned: list[int] = []
    for sequence in row.params.bad_words_token_ids or ():
        prefix_len = len(sequence) - 1
        if prefix_len == 0 or (
            prefix_len <= num_output
            and list(output[num_output - prefix_len:]) == sequence[:prefix_len]
        ):
            banned.append(sequence[-1])
    return banned


def _row_token_pairs(
    row_ids: list[int], token_lists: Sequence[Iterable[int]], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Index tensors (row, token) for every token of every row's list, to write all rows in one
    indexed operation: ``row_ids[j]`` is repeated once per token of ``token_lists[j]``."""
    lengths: list[int] = []
    flat: list[int] = []
    for tokens in token_lists:
        before = len(flat)
        flat.extend(tokens)
        lengths.append(len(flat) - before)
    row_index = torch.repeat_interleave(torch.tensor(row_ids), torch.tensor(lengths))
    token_index = torch.tensor(flat, dtype=torch.long)
    return row_index.to(device, non_blocking=True), token_index.to(device, non_blocking=True)


# --------------------------------------------------------------------------------------------
# Penalties and min_tokens
# --------------------------------------------------------------------------------------------


def apply_penalties(
    logits: torch.Tensor, rows: list[SamplingRow], *, copy: bool = True
) -> torch.Tensor:
    """min_tokens masking, then repetition, presence and frequency penalties.

    Returns ``logits`` itself when no row needs any of them (the common, cheap case); otherwise a
    new tensor, so the input can still serve for the raw logprobs. ``copy=False``: the caller
    owns ``logits`` and lets it be modified in place (and returned).
    """
    masked = [
        i for i, row in enumerate(rows)
        if row.stop_token_ids and len(row.output_token_ids) < row.params.min_tokens
    ]
    repeated = [i for i, row in enumerate(rows) if row.params.repetition_penalty != 1.0]
    counted = [
        i for i, row in enumerate(rows)
        if row.params.presence_penalty != 0.0 or row.params.frequency_penalty != 0.0
    ]
    if not (masked or repeated or counted):
        return logits
    if copy:
        logits = logits.clone()
    if masked:
        _mask_stop_tokens(logits, rows, masked)
    if repeated:
        _apply_repetition_penalty(logits, rows, repeated)
    if counted:
        _apply_presence_frequency_penalties(logits, rows, counted)
    return logits


def _mask_stop_tokens(logits: torch.Tensor, rows: list[SamplingRow], indices: list[int]) -> None:
    """In place: stop tokens of the given rows get -inf (they have not reached min_tokens)."""
    vocab_size = logits.shape[1]
    pairs = [
        (i, token) for i in indices for token in rows[i].stop_token_ids if 0 <= token < vocab_size
    ]
    if pairs:
        row_index, token_index = zip(*pairs)
        device = logits.device
        logits[torch.tensor(row_index, device=device), torch.tensor(token_index, device=device)] = (
            -math.inf
        )


def _apply_repetition_penalty(
    logits: torch.Tensor, rows: list[SamplingRow], indices: list[int]
) -> None:
    """In place: tokens seen in the prompt or output have positive logits divided by the
    penalty and negative ones multiplied (both push the token down for a penalty > 1)."""
    device = logits.device
    index = torch.tensor(indices, device=device)
    sub = logits[index]
    seen = _token_counts(
        [itertools.chain(rows[i].prompt_token_ids, rows[i].output_token_ids) for i in indices],
        sub.shape[1], device,
    ) > 0
    penalty = float_column([rows[i].params.repetition_penalty for i in indices], device)
    penalized = torch.where(sub > 0, sub / penalty, sub * penalty)
    logits[index] = torch.where(seen, penalized, sub)


def _apply_presence_frequency_penalties(
    logits: torch.Tensor, rows: list[SamplingRow], indices: list[int]
) -> None:
    """In place: logit -= presence * (count > 0) + frequency * count, counts over the output."""
    device = logits.device
    index = torch.tensor(indices, device=device)
    counts = _token_counts([rows[i].output_token_ids for i in indices], logits.shape[1], device)
    presence = float_column([rows[i].params.presence_penalty for i in indices], device)
    frequency = float_column([rows[i].params.frequency_penalty for i in indices], device)
    logits[index] = logits[index] - (presence * (counts > 0) + frequency * counts)


def _token_counts(
    token_lists: Iterable[Iterable[int]], vocab_size: int, device: torch.device
) -> torch.Tensor:
    """[R, V] float counts of each token id in each row's list (one scatter_add for all rows)."""
    token_lists = list(token_lists)
    counts = torch.zeros(len(token_lists), vocab_size, device=device)
    rows, tokens = _row_token_pairs(list(range(len(token_lists))), token_lists, device)
    if tokens.numel():
        counts.index_put_((rows, tokens), torch.ones_like(tokens, dtype=counts.dtype),
                          accumulate=True)
    return counts


# --------------------------------------------------------------------------------------------
# Truncation: min-p, top-k, top-p
# --------------------------------------------------------------------------------------------


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """In place: drop (-inf) tokens whose probability is below min_p [B] times the row's top
    probability. Works on logits: p_i < min_p * p_max  <=>  l_i < l_max + log(min_p), which
    saves a softmax; min_p == 0 gives a threshold of -inf, i.e. no-op."""
    threshold = logits.amax(dim=-1, keepdim=True) + min_p.log().unsqueeze(1)
    return logits.masked_fill_(logits < threshold, -math.inf)


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """In place: drop (-inf) tokens outside each row's top-k, then outside its nucleus.

    ``top_k`` [B] long (V or more disables a row); ``top_p`` [B] float (1 disables a row); either
    may be None when no row uses it. Top-p keeps the smallest set of most likely tokens whose
    probability (after top-k) sums to >= top_p; the most likely token is always kept.
    """
    vocab_size = logits.shape[1]
    if top_p is None:
        if top_k is None:
            return logits
        return _apply_top_k_only(logits, top_k)

    sorted_logits, order = logits.sort(dim=-1, descending=True)
    drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if top_k is not None:
        positions = torch.arange(vocab_size, device=logits.device)
        drop |= positions.unsqueeze(0) >= top_k.unsqueeze(1)
        sorted_logits.masked_fill_(drop, -math.inf)
    probs = sorted_logits.softmax(dim=-1)
    # Probability of the strictly more likely tokens: a token is needed while that is < top_p.
    # It is exactly 0 at position 0, so the top token always stays. Rows with top_p == 1 are
    # skipped outright so float rounding in the cumsum cannot clip their tail.
    mass_before = probs.cumsum(dim=-1) - probs
    threshold = torch.where(top_p < 1, top_p, math.inf).unsqueeze(1)
    drop |= mass_before >= threshold
    # Back from sorted order to vocabulary order.
    drop = torch.empty_like(drop).scatter_(1, order, drop)
    return logits.masked_fill_(drop, -math.inf)


def _apply_top_k_only(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Top-k without top-p: a partial topk is much cheaper than sorting the whole vocabulary.
    Ties with the k-th logit are kept."""
    vocab_size = logits.shape[1]
    enabled = top_k < vocab_size
    k = torch.where(enabled, top_k, 1)
    kth_index = (k - 1).unsqueeze(1)
    top_values = logits.topk(int(k.max()), dim=-1).values
    kth = top_values.gather(1, kth_index)
    threshold = torch.where(enabled.unsqueeze(1), kth, -math.inf)
    return logits.masked_fill_(logits < threshold, -math.inf)


def effective_top_k(top_k: int, vocab_size: int) -> int:
    """SamplingParams' top_k with "disabled" (0, -1 or >= V) spelled as V."""
    return top_k if 0 < top_k < vocab_size else vocab_size
