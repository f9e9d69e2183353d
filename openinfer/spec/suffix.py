"""Suffix decoding: draft continuations from suffix trees over the request's own tokens
and over recent requests' outputs (the method of SuffixDecoding, Oliaro et al. 2024;
vLLM's ``suffix`` method).

Each tree indexes every substring of at most ``max_depth`` tokens with its number of
occurrences. Appending a token extends the at most ``max_depth`` suffixes that end at the
previous token, O(max_depth) per token. To draft, the longest suffix of the context that
is a path with a continuation in a tree is found, then the most frequent child is
followed while its share of the continuing occurrences (the confidence of that position)
stays at least
``min_token_prob``. The request's own tree and the global tree of recent outputs each
propose; the draft with the larger expected accepted length (the sum of the running
products of confidences) wins.

The global tree keeps the outputs of the last ``max_cached_requests`` requests to finish
or stay (each added as it is generated); the oldest is removed by walking its tokens
again with negative counts.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from openinfer.spec.proposer import Draft, TokenProposer


class _Node:
    __slots__ = ("count", "children")

    def __init__(self) -> None:
        self.count = 0
        self.children: dict[int, _Node] = {}


class SuffixTree:
    """Counts of every substring of at most ``max_depth`` tokens of the sequences added."""

    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        self.root = _Node()

    def extend(self, tail: list[_Node], token: int, delta: int = 1) -> list[_Node]:
        """Count ``token`` after each node of ``tail`` (the paths of the suffixes ending
        at the previous token, shortest first, the root among them); returns the new tail."""
        new_tail = [self.root]
        for node in tail:
            if len(new_tail) > self.max_depth:
                break
            child = node.children.get(token)
            if child is None:
                if delta < 0:
                    continue
                child = node.children[token] = _Node()
            child.count += delta
            if child.count <= 0:
                del node.children[token]
            else:
                new_tail.append(child)
        return new_tail

    def match(self, context: Sequence[int]) -> tuple[_Node | None, int]:
        """The node of the longest suffix of ``context`` that is a path with a continuation
        (and its length)."""
        for n in range(min(self.max_depth, len(context)), 0, -1):
            node = self.root
            for token in context[len(context) - n:]:
                node = node.children.get(token)
                if node is None:
                    break
            else:
                if node.children:
                    return node, n
        return None, 0

    def draft(self, context: Sequence[int], num_tokens: int, min_prob: float) -> Draft:
        node, _ = self.match(context)
        draft = Draft()
        while node is not None and len(draft.token_ids) < num_tokens and node.children:
            token, child = max(node.children.items(), key=lambda item: item[1].count)
            # Among the occurrences that continue (the context's own one does not yet).
            confidence = child.count / sum(c.count for c in node.children.values())
            if confidence < min_prob:
                break
            draft.token_ids.append(token)
            draft.confidences.append(confidence)
            node = child
        return draft


def expected_accepted(draft: Draft) -> float:
    total, survive = 0.0, 1.0
    for c in draft.confidences:
        survive *= c
        total += survive
    return total


class SuffixProposer(TokenProposer):
    def __init__(self, max_depth: int, max_cached_requests: int, min_token_prob: float) -> None:
        self.max_depth = max_depth
        self.min_token_prob = min_token_prob
        self.max_cached_requests = max_cached_requests
        self._local: dict[str, tuple[SuffixTree, list[_Node], int]] = {}
        """Per running request: its tree, the tail of suffix paths, tokens indexed."""
        self.global_tree = SuffixTree(max_depth)
        self._global: OrderedDict[str, tuple[list[int], list[_Node], int]] = OrderedDict()
        """Per request in the global tree: its output so far, tail, prompt length."""

    def propose(self, request_id: str, token_ids: Sequence[int], num_prompt_tokens: int,
                num_tokens: int) -> Draft:
        self._index(request_id, token_ids, num_prompt_tokens)
        local = self._local[request_id][0].draft(token_ids, num_tokens, self.min_token_prob)
        shared = self.global_tree.draft(token_ids, num_tokens, self.min_token_prob)
        return shared if expected_accepted(shared) > expected_accepted(local) else local

    def _index(self, request_id: str, token_ids: Sequence[int], num_prompt_tokens: int) -> None:
        tree, tail, done = self._local.get(request_id) or (SuffixTree(self.max_depth), [], 0)
        if not tail:
            tail = [tree.root]
        for token in token_ids[done:]:
            tail = tree.extend(tail, token)
        self._local[request_id] = (tree, tail, len(token_ids))
        if self.max_cached_requests == 0:
            return
        entry = self._global.get(request_id)
        if entry is None:
            entry = ([], [self.global_tree.root], num_prompt_tokens)
            self._global[request_id] = entry
            while len(self._global) > self.max_cached_requests:
                self._evict()
        output, gtail, prompt_len = entry
        for token in token_ids[prompt_len + len(output):]:
            gtail = self.global_tree.extend(gtail, token)
            output.append(token)
        self._global[request_id] = (output, gtail, prompt_len)

    def _evict(self) -> None:
        _, (output, _, _) = self._global.popitem(last=False)
        tail = [self.global_tree.root]
        for token in output:
            tail = self.global_tree.extend(tail, token, delta=-1)

    def drop(self, request_id: str) -> None:
        # Its output stays in the global tree (that is what the tree is for).
        self._local.pop(request_id, None)
