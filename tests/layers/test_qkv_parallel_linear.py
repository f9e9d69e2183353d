"""QKVParallelLinear: each rank's query and KV heads, and the checkpoint rows it loads, with
KV heads split over the ranks or replicated on several (no process group needed: a rank's
share is decided when the layer is built)."""

from __future__ import annotations

import pytest
import torch

from openinfer.distributed.parallel_state import TensorParallel, get_tp, set_tp
from openinfer.layers.linear import QKVParallelLinear

HIDDEN, HEAD_DIM = 8, 2


@pytest.fixture
def as_rank():
    before = get_tp()

    def build(rank: int, size: int, heads: int, kv_heads: int) -> QKVParallelLinear:
        set_tp(TensorParallel(rank, size))
        return QKVParallelLinear(HIDDEN, HEAD_DIM, heads, kv_heads, bias=True)

    yield build
    set_tp(before)


def _load(layer: QKVParallelLinear, heads: int, kv_heads: int) -> list[torch.Tensor]:
    """Loads q/k/v checkpoint weights whose rows are numbered by head; returns them."""
    parts = [torch.arange(n * HEAD_DIM, dtype=torch.float32)[:, None].expand(-1, HIDDEN) + 100 * i
             for i, n in enumerate([heads, kv_heads, kv_heads])]
    for shard, part in enumerate(parts):
        layer.weight.weight_loader(layer.weight, part, shard)
        layer.bias.weight_loader(layer.bias, part[:, 0], shard)
    return parts


@pytest.mark.parametrize(("size", "kv_heads"), [(1, 2), (2, 4), (2, 2), (4, 2), (4, 1)])
def test_each_rank_holds_its_heads(as_rank, size, kv_heads):
    heads = 8
    for rank in range(size):
        layer = as_rank(rank, size, heads, kv_heads)
        assert layer.num_heads == heads // size
        assert layer.num_kv_heads == max(1, kv_heads // size)
        q, k, v = _load(layer, heads, kv_heads)
        rows = layer.num_heads * HEAD_DIM
        kv_rows = layer.num_kv_heads * HEAD_DIM
        first_kv = rank * kv_heads // size  # its own share, or the head it replicates
        want = torch.cat([q[rank * rows:(rank + 1) * rows],
                          k[first_kv * HEAD_DIM:][:kv_rows], v[first_kv * HEAD_DIM:][:kv_rows]])
        assert torch.equal(layer.weight, want)
        assert torch.equal(layer.bias, want[:, 0])
        assert [t.shape[-1] for t in layer.split(torch.zeros(1, sum(layer.out_sizes)))] == \
            [rows, kv_rows, kv_rows]


def test_refuses_a_split_that_does_not_divide(as_rank):
    with pytest.raises(ValueError, match="num_attention_heads"):
        as_rank(0, 3, 8, 1)
    with pytest.raises(ValueError, match="num_key_value_heads"):
        as_rank(0, 4, 8, 3)
