"""The drafter a speculative config names."""

from __future__ import annotations

from openinfer.spec.config import SpeculativeConfig
from openinfer.spec.ngram import NgramProposer
from openinfer.spec.proposer import TokenProposer
from openinfer.spec.suffix import SuffixProposer


def make_token_proposer(spec: SpeculativeConfig | None) -> TokenProposer | None:
    """The n-gram or suffix drafter (None: no speculation, or a model drafter)."""
    if spec is None:
        return None
    if spec.method == "ngram":
        return NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
    if spec.method == "suffix":
        return SuffixProposer(spec.suffix_decoding_max_tree_depth,
                              spec.suffix_decoding_max_cached_requests,
                              spec.suffix_decoding_min_token_prob)
    return None
