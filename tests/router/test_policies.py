"""Routing policies and the per-replica cache index, over integers and hashes only."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from openinfer.router.policies import Router, RouterConfig, Worker, WorkerCacheIndex


def _stored(*hashes: bytes, medium: str = "GPU") -> dict:
    return {"type": "BlockStored", "block_hashes": list(hashes), "parent_block_hash": None,
            "token_ids": [], "block_size": 16, "medium": medium}


def test_index_follows_events_detects_gaps_and_restarts():
    index = WorkerCacheIndex()
    assert index.apply(0, [_stored(b"a", b"b")]) and index.match([b"a", b"b", b"c"]) == 2
    assert index.apply(1, [_stored(b"b", medium="HOST"),
                           {"type": "BlockRemoved", "block_hashes": [b"b"], "medium": "GPU"}])
    assert index.match([b"a", b"b"]) == 2           # still held in host memory
    assert not index.apply(3, [_stored(b"z")])      # batch 2 was missed
    assert index.match([b"z"]) == 0 and index.next_seq == 2
    assert index.apply(2, [{"type": "AllBlocksCleared"}]) and index.match([b"a"]) == 0
    index.apply(3, [_stored(b"q")])
    assert index.apply(0, [_stored(b"x")])          # the replica restarted: start over
    assert index.match([b"q"]) == 0 and index.match([b"x"]) == 1


def test_a_publisher_that_started_over_is_told_by_its_epoch_or_numbering():
    """What a replay's end says of the publisher (its next seq, its epoch) against what the
    index followed: a restart shows even when the new life has published more batches than
    the old one had (a numbering not behind ours), by its epoch."""
    index = WorkerCacheIndex()
    assert not index.started_over(0, b"life-one")   # nothing followed yet
    index.epoch = b"life-one"
    for seq in range(5):
        index.apply(seq, [_stored(bytes([seq]))])
    assert not index.started_over(5, b"life-one")   # caught up
    assert not index.started_over(9, b"life-one")   # ahead: a replay brings the rest
    assert index.started_over(2, b"life-one")       # behind us: it restarted
    assert index.started_over(9, b"life-two")       # a new life, further on than the old
    assert index.started_over(2, None) and not index.started_over(9, None)  # (no epoch)


def _router(policy: str, n: int = 3, **kw) -> Router:
    return Router(RouterConfig(policy=policy, **kw), [Worker(f"w{i}") for i in range(n)])


def test_round_robin_skips_unhealthy_and_excluded_replicas():
    r = _router("round_robin")
    r.workers[1].healthy = False
    assert [r.choose([]).worker.url for _ in range(4)] == ["w0", "w2", "w0", "w2"]
    assert r.choose([], exclude={"w0", "w2"}) is None


def test_least_load_counts_routed_requests_and_spreads_ties():
    r = _router("least_load")
    r.workers[0].in_flight = 2
    first = r.choose([]).worker
    first.routed += 1
    second = r.choose([]).worker
    assert {first.url, second.url} == {"w1", "w2"}


def test_cache_aware_prefers_the_longest_prefix_unless_load_is_imbalanced():
    r = _router("cache_aware", balance_abs=4, balance_rel=2.0)
    w0, w1, _ = r.workers
    w0.index.apply(0, [_stored(b"a")])
    w1.index.apply(0, [_stored(b"a", b"b")])
    decision = r.choose([b"a", b"b", b"c"])
    assert (decision.worker, decision.reason, decision.matched_blocks) == (w1, "cache_hit", 2)
    assert r.choose([b"x"]).reason == "no_cache_hit"
    w1.in_flight = 10                                 # 10 - 0 > 4 and 10 > 2 x 0
    decision = r.choose([b"a", b"b"])
    assert decision.reason == "load_override" and decision.worker is not w1


def test_without_events_the_routed_prompts_guide_cache_aware():
    r = _router("cache_aware")
    home = r.choose([b"p1", b"p2"]).worker          # nothing cached: least load
    home.routed += 1
    again = r.choose([b"p1", b"p2", b"p3"])
    assert again.worker is home and again.reason == "cache_hit"
    assert len(home.approx) == 3
    home.index.apply(0, [_stored(b"p1")])           # its events arrive: no more guessing
    assert r.choose([b"p1", b"q"]).worker is home and len(home.approx) == 0
    r.choose([b"p1", b"r"])
    assert len(home.approx) == 0


def test_session_affinity_sticks_until_the_replica_fails():
    r = _router("cache_aware")
    home = r.choose([b"s"], session="alice").worker
    home.routed += 5
    assert r.choose([b"other"], session="alice").worker is home
    home.healthy = False
    assert r.choose([b"other"], session="alice").worker is not home


def test_least_load_adds_what_replicas_report_beyond_our_own_requests():
    r = _router("least_load", n=2)
    r.workers[0].in_flight = 1
    r.workers[1].report(running_and_waiting=5, in_flight_at_report=0)  # another client's load
    assert r.workers[1].load == 5 and r.choose([]).worker.url == "w0"
    r.workers[1].report(running_and_waiting=2, in_flight_at_report=4)  # lagging report
    assert r.workers[1].external_load == 0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 2)), max_size=200))
def test_cache_aware_never_lets_load_imbalance_exceed_the_guard(ops):
    """Every request shares one cached prefix held by w0 only, so cache affinity alone would
    send everything there. Whatever finishes when, no request may go to a replica that is
    loaded beyond the guard relative to the least loaded one."""
    r = _router("cache_aware", balance_abs=4, balance_rel=1.5)
    r.workers[0].index.apply(0, [_stored(b"p", b"q")])
    for arrive, which in ops:
        if arrive:
            least = min(w.load for w in r.workers)
            chosen = r.choose([b"p", b"q"]).worker
            assert chosen.load - least <= 4 or chosen.load <= 1.5 * least
            chosen.in_flight += 1
        elif r.workers[which].in_flight:
            r.workers[which].in_flight -= 1


def test_the_session_key_is_the_header_then_prompt_cache_key_then_user_then_metadata():
    """What the router keeps together: X-Session-Id, OpenAI's prompt_cache_key, `user`,
    Anthropic's metadata.user_id, in that order; a value of another type is no key."""
    from types import SimpleNamespace

    from openinfer.router.forward import _session

    def request(headers: dict | None = None) -> SimpleNamespace:
        return SimpleNamespace(headers=headers or {})

    body = {"prompt_cache_key": "k", "user": "u", "metadata": {"user_id": "m"}}
    assert _session(request({"x-session-id": "h"}), body) == "h"
    assert _session(request(), body) == "k"
    assert _session(request(), {"user": "u", "metadata": {"user_id": "m"}}) == "u"
    assert _session(request(), {"metadata": {"user_id": "m"}}) == "m"
    assert _session(request(), {"user": 5, "metadata": "m"}) is None
