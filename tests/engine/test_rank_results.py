"""Combining the ranks' answers: a block load is done when every rank's share is, with the
blocks every rank got; counters add up."""

from openinfer.engine.rank_results import ReadsAcrossRanks, summed
from openinfer.kv.plan import BlockLoad


def _load(request_id: str) -> BlockLoad:
    return BlockLoad(request_id, [(b"a" * 32, 0), (b"b" * 32, 1), (b"c" * 32, 2)])


def test_a_load_is_done_when_every_rank_has_its_share_with_the_fewest_blocks():
    reads = ReadsAcrossRanks(2)
    # Rank 0 finishes r1 (all 3 blocks) first; rank 1 is still reading.
    assert reads.finished([[(_load("r1"), 3)], []]) == []
    assert reads.num_partial == 1
    # Rank 1 got only 2 of them (a file of its share missing), and both finish r2.
    done = reads.finished([[(_load("r2"), 3)], [(_load("r1"), 2), (_load("r2"), 3)]])
    assert [(load.request_id, n) for load, n in done] == [("r1", 2), ("r2", 3)]
    assert reads.num_partial == 0


def test_one_rank_passes_its_reads_through():
    reads = ReadsAcrossRanks(1)
    assert [(load.request_id, n) for load, n in reads.finished([[(_load("r"), 1)]])] == [("r", 1)]


def test_counters_add_up_across_ranks():
    ranks = [{"kv_store_bytes": 10, "kv_transfer_bytes": {"store_to_host": 4}},
             {"kv_store_bytes": 12, "kv_transfer_bytes": {"store_to_host": 4, "host_to_device": 1}}]
    assert summed(ranks) == {"kv_store_bytes": 22,
                             "kv_transfer_bytes": {"store_to_host": 8, "host_to_device": 1}}
