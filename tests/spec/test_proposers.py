"""The token drafters: n-gram prompt lookup and suffix trees."""

from __future__ import annotations

import random
import sys
import tracemalloc

import numpy as np

from openinfer.spec.ngram import NgramProposer, ngram_draft
from openinfer.spec.suffix import SuffixProposer, SuffixTree


def _brute_force_ngram(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[-n:]
        for end in range(len(tokens) - 2, n - 2, -1):  # latest occurrence first
            if tokens[end - n + 1:end + 1] == suffix:
                return tokens[end + 1:end + 1 + k]
    return []


def test_ngram_drafts_the_continuation_of_the_longest_latest_match():
    draft = ngram_draft(np.array([1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 3]), 2, 5, 4)
    assert draft.token_ids == [5, 1, 2, 3]
    assert draft.confidences == [0.5, 1.0, 1.0, 1.0]  # "1 2 3" went on to 4 once, 5 once
    assert ngram_draft(np.array([1, 2, 3, 4]), 2, 5, 4).token_ids == []  # no repeat
    assert ngram_draft(np.array([7, 7, 7, 7]), 2, 3, 3).token_ids == [7]  # overlapping match
    rng = random.Random(0)
    for _ in range(300):
        tokens = [rng.randrange(4) for _ in range(rng.randrange(2, 40))]
        k = rng.randrange(1, 6)
        assert ngram_draft(np.array(tokens), 2, 4, k).token_ids == _brute_force_ngram(tokens, 2, 4, k)


def _work(proposer: NgramProposer, tokens: list[int]) -> tuple[int, int]:
    """What one proposal costs, counted rather than timed (a shared box makes timings
    noise): the Python lines it runs and the peak bytes it allocates (numpy's arrays too)."""
    lines = 0

    def tracer(frame, event, arg):
        nonlocal lines
        lines += event == "line"
        return tracer

    tracemalloc.start()
    sys.settrace(tracer)
    try:
        proposer.propose("r", tokens, len(tokens), 5)
    finally:
        sys.settrace(None)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return lines, peak


def test_ngram_cost_grows_linearly_with_the_context():
    proposer = NgramProposer(2, 5)
    rng = random.Random(1)
    work = []
    for length in (4000, 32000):
        tokens = [rng.randrange(50) for _ in range(length)]
        _work(proposer, tokens)  # (first-call allocations out of the count)
        work.append(_work(proposer, tokens))
    (lines, peak), (long_lines, long_peak) = work
    # 8x the context: nowhere near quadratic, in steps or in memory.
    assert long_lines < lines * 8 * 4 and long_peak < peak * 8 * 4, work


def test_suffix_tree_counts_substrings_and_forgets_them_exactly():
    tree = SuffixTree(max_depth=3)
    tail = [tree.root]
    for token in [1, 2, 1, 2, 3]:
        tail = tree.extend(tail, token)
    assert tree.root.children[1].count == 2
    assert tree.root.children[1].children[2].count == 2
    assert tree.root.children[1].children[2].children[3].count == 1
    assert 3 not in tree.root.children[2].children[3].children  # depth 3 at most
    tail = [tree.root]
    for token in [1, 2, 1, 2, 3]:
        tail = tree.extend(tail, token, delta=-1)
    assert tree.root.children == {}


def test_suffix_drafts_the_most_frequent_continuation_with_its_frequency():
    proposer = SuffixProposer(max_depth=8, max_cached_requests=10, min_token_prob=0.1)
    tokens = [5, 1, 2, 3, 9, 1, 2, 3, 9, 1, 2, 3, 4, 1, 2]
    draft = proposer.propose("a", tokens, 1, 4)
    # "1 2" continued with 3 three times; "1 2 3" then 9 twice and 4 once.
    assert draft.token_ids[:2] == [3, 9]
    assert draft.confidences[0] == 1.0 and abs(draft.confidences[1] - 2 / 3) < 1e-9


def test_suffix_global_tree_serves_other_requests_and_evicts_the_oldest():
    proposer = SuffixProposer(max_depth=8, max_cached_requests=2, min_token_prob=0.1)
    output = [40, 41, 42, 43, 44, 45]
    proposer.propose("first", [1, 2] + output, 2, 3)
    proposer.drop("first")
    # Another request whose context ends like the first one's output did.
    draft = proposer.propose("second", [7, 40, 41, 42], 4, 3)
    assert draft.token_ids == [43, 44, 45]
    proposer.propose("third", [8, 9], 2, 3)  # evicts "first" (room for two requests)
    proposer.drop("second")
    assert proposer.propose("fourth", [7, 40, 41, 42], 4, 3).token_ids == []
