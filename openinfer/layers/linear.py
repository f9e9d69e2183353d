"""Linear layers whose parameters know how to load Hugging Face checkpoint tensors.

Projections that read the same input (q/k/v, gate/up) are merged into one matmul:
fewer, larger GEMMs are faster on every device. The checkpoint still stores them
apart, so a merged layer loads each shard into its slice of the weight.

Every x @ W^T module (Linear, MergedLinear, the LM head) is a ``GemmLayer``: on CPU, once the
weights are loaded, it gets a GEMM plan (openinfer.kernels.gemm_plan) that runs each call on the
path measured fastest for its row count; without one (CUDA, or OPENINFER_CPU_GEMM=default)
it calls ``linear()``.

Tensor parallelism (openinfer.distributed.parallel_state): a ``MergedLinear`` given
``shard_offsets`` (or a ``ColumnParallelLinear``) holds one rank's rows of each part; a
``RowParallelLinear`` holds one rank's columns and all-reduces its output. Their loaders
read only their slice of a checkpoint tensor (``narrow`` on a safetensors slice), so no
rank holds a full copy of a sharded weight.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from openinfer.distributed.parallel_state import get_tp
from openinfer.kernels.fp8_gemm import dequantize, fp8_linear

# On this project's x86 CPUs (MKL sgemm, AVX2), x @ W^T for 2..256 rows (decode batches) runs
# 1.5-2.5x faster computed as (W @ x^T)^T; from ~512 rows on, the plain form wins (measured:
# benchmarks/bench_linear.py). GPUs pick their own kernels.
CPU_TRANSPOSED_GEMM_MAX_ROWS = 256


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight^T (+ bias) by a fixed rule: what a layer computes without a GEMM plan (CUDA,
    OPENINFER_CPU_GEMM=default, a model not built by load_model)."""
    if x.device.type == "cpu" and x.dim() == 2 and 1 < x.shape[0] <= CPU_TRANSPOSED_GEMM_MAX_ROWS:
        out = torch.mm(weight, x.t()).t().contiguous()
        return out if bias is None else out.add_(bias)
    return F.linear(x, weight, bias)


def narrow(loaded, dim: int, start: int, length: int) -> torch.Tensor:
    """Rows (dim 0) or columns (dim 1) ``start .. start+length`` of a checkpoint tensor: a
    torch tensor, or a safetensors slice, of which only those bytes are read."""
    if isinstance(loaded, torch.Tensor):
        return loaded.narrow(dim, start, length)
    index = [slice(None)] * len(loaded.get_shape())
    index[dim] = slice(start, start + length)
    return loaded[tuple(index)]


def reads_slices(loader):
    """Marks a weight loader that takes a safetensors slice (it reads only its shard)."""
    loader.reads_slices = True
    return loader


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"weight shape mismatch: parameter {tuple(param.shape)} vs checkpoint "
                         f"{tuple(loaded.shape)}")
    param.data.copy_(loaded)


class GemmLayer(nn.Module):
    """A module whose output is x @ weight^T (+ bias): the unit a CPU GEMM plan is made for.

    Subclasses register ``weight`` ([out, in]) and ``bias`` ([out] or None).
    """

    weight: nn.Parameter
    bias: nn.Parameter | None
    timed_buckets: int | None = None
    """How many of the GEMM plan's row buckets to time (openinfer.kernels.gemm_plan.BUCKETS); the
    rest take the last timed one's path. None: all."""

    def __init__(self) -> None:
        super().__init__()
        self.plan: Callable[[torch.Tensor], torch.Tensor] | None = None
        """Set once after loading, on CPU (openinfer.models.gemm_plans.plan_gemms)."""
        self.fp8_block: tuple[int, int] | None = None
        """Set by ``keep_fp8``: ``weight`` is the checkpoint's float8_e4m3fn and
        ``weight_scale_inv`` its scale per tile of this many rows x columns."""

    def gemm(self, x: torch.Tensor) -> torch.Tensor:
        if self.plan is not None:
            return self.plan(x)
        if self.fp8_block is not None:
            return fp8_linear(x, self.weight, self.weight_scale_inv, self.fp8_block, self.bias)
        return linear(x, self.weight, self.bias)

    def dense_weight(self) -> torch.Tensor:
        """The weight's values in the model's dtype, however the layer holds them: what any
        reader other than the layer's own GEMM uses (MLA's absorbed maps)."""
        if self.fp8_block is None:
            return self.weight
        return dequantize(self.weight, self.weight_scale_inv, self.fp8_block, self.dense_dtype)

    def checkpoint_parts(self) -> list[tuple[int, int, int]]:
        """For each checkpoint tensor loaded into this weight (merged layers have several):
        (the first row it fills here, the first row read from the tensor, how many rows)."""
        return [(0, 0, self.weight.shape[0])]

    def checkpoint_first_column(self) -> int:
        """The first column read from the checkpoint's tensors (a row-parallel rank's)."""
        return 0

    def keep_fp8(self, block: tuple[int, int]) -> bool:
        """Before loading: hold the weight as the checkpoint's block-scaled fp8 (one byte per
        weight; openinfer.kernels.fp8_gemm) instead of dequantized. False, and nothing changed,
        where a part's rows (here or in the checkpoint: a merged part, a tensor-parallel
        rank's slice) or a rank's columns do not start on a tile, so no grid of scales fits."""
        rows, cols = block
        if (any(here % rows or there % rows for here, there, _ in self.checkpoint_parts())
                or self.checkpoint_first_column() % cols):
            return False
        n, k = self.weight.shape
        loader = self.weight.weight_loader
        self.dense_dtype = self.weight.dtype
        self.weight = nn.Parameter(torch.empty(n, k, dtype=torch.float8_e4m3fn,
                                               device=self.weight.device), requires_grad=False)
        self.weight.weight_loader = loader
        self.weight_scale_inv = nn.Parameter(
            torch.empty(-(-n // rows), -(-k // cols), dtype=torch.float32,
                        device=self.weight.device), requires_grad=False)
        self.weight_scale_inv.weight_loader = self._load_scale
        self.fp8_block = block
        return True

    def _load_scale(self, param: nn.Parameter, loaded: torch.Tensor, shard: int | None = None) -> None:
        """A checkpoint tensor's scales: the tiles of the rows and columns this layer reads."""
        rows, cols = self.fp8_block
        here, there, count = self.checkpoint_parts()[shard or 0]
        tiles = -(-count // rows)
        loaded = loaded.narrow(0, there // rows, tiles)
        loaded = loaded.narrow(1, self.checkpoint_first_column() // cols, param.shape[1])
        default_weight_loader(param.data[here // rows:here // rows + tiles], loaded)


class Linear(GemmLayer):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        # Uninitialized: every parameter is overwritten by the checkpoint loader.
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.weight.weight_loader = default_weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = default_weight_loader
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gemm(x)


class MergedLinear(Linear):
    """Several projections of the same input stacked along the output dim.

    Column parallel: ``out_sizes`` are this rank's rows of each part, which start at row
    ``shard_offsets[i]`` of the checkpoint's tensor for part i."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool = False,
                 shard_offsets: list[int] | None = None) -> None:
        super().__init__(in_features, sum(out_sizes), bias)
        self.out_sizes = out_sizes
        self.shard_offsets = shard_offsets
        self.weight.weight_loader = self._load_shard
        if bias:
            self.bias.weight_loader = self._load_shard

    @reads_slices
    def _load_shard(self, param: nn.Parameter, loaded: torch.Tensor, shard: int) -> None:
        start, size = sum(self.out_sizes[:shard]), self.out_sizes[shard]
        if self.shard_offsets is not None:
            loaded = narrow(loaded, 0, self.shard_offsets[shard], size)
        elif not isinstance(loaded, torch.Tensor):
            loaded = loaded[:]
        default_weight_loader(param.data[start:start + size], loaded)

    def split(self, out: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return out.split(self.out_sizes, dim=-1)

    def checkpoint_parts(self) -> list[tuple[int, int, int]]:
        return [(sum(self.out_sizes[:i]), self.shard_offsets[i] if self.shard_offsets else 0, size)
                for i, size in enumerate(self.out_sizes)]


class ColumnParallelLinear(Linear):
    """x @ W^T for this rank's rows of W (its heads, its features): no communication; the
    row-parallel layer after it consumes the slice."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 what: str = "the output features of a column-parallel linear") -> None:

        self.tp = get_tp()
        self.out_per_rank = self.tp.split(out_features, what)
        super().__init__(in_features, self.out_per_rank, bias)
        self.weight.weight_loader = self._load_rows
        if bias:
            self.bias.weight_loader = self._load_rows

    @reads_slices
    def _load_rows(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        default_weight_loader(param, narrow(loaded, 0, self.tp.rank * self.out_per_rank,
                                            self.out_per_rank))

    def checkpoint_parts(self) -> list[tuple[int, int, int]]:
        return [(0, self.tp.rank * self.out_per_rank, self.out_per_rank)]


class RowParallelLinear(Linear):
    """x @ W^T over the tensor-parallel ranks: each holds the columns of W for its slice of
    the input features (the column-parallel layer before it produced that slice) and the
    partial products are summed by one all-reduce. Rank 0 alone adds the bias."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:

        self.tp = get_tp()
        self.in_per_rank = self.tp.split(in_features, "the input features of a row-parallel "
                                                      "linear (heads x head_dim, or intermediate_size)")
        super().__init__(self.in_per_rank, out_features, bias)
        self.weight.weight_loader = self._load_columns
        if bias:
            self.bias.weight_loader = self._load_bias

    @reads_slices
    def _load_columns(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        default_weight_loader(param, narrow(loaded, 1, self.tp.rank * self.in_per_rank,
                                            self.in_per_rank))

    def checkpoint_first_column(self) -> int:
        return self.tp.rank * self.in_per_rank

    @reads_slices
    def _load_bias(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if self.tp.rank == 0:
            default_weight_loader(param, narrow(loaded, 0, 0, param.shape[0]))
        else:  # the all-reduce adds rank 0's once
            param.data.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.gemm(x))


class QKVParallelLinear(MergedLinear):
    """The q, k and v projections of a (GQA) attention in one column-parallel matmul: this
    rank's query heads, then its KV heads' keys and values. The head split is decided here, so
    an attention layer reads ``num_heads`` and ``num_kv_heads`` (this rank's) and does no
    tensor-parallel arithmetic.

    A rank holds ``total_heads / tp`` query heads. KV heads are split the same way, or, with
    fewer KV heads than ranks, replicated: each rank holds one, KV head ``rank * kv / tp``
    (so ``tp / kv`` neighbouring ranks share it, as their query heads attend to it). The
    loader reads each part's rows from where this rank's heads start in the checkpoint::

        checkpoint q_proj  [h0 h1 | h2 h3]      k_proj / v_proj  [k0]   (tp 2, 1 KV head)
        rank 0 qkv_proj    [h0 h1  k0  v0]      rank 1 qkv_proj  [h2 h3  k0  v0]
    """

    def __init__(self, hidden_size: int, head_dim: int, total_heads: int, total_kv_heads: int,
                 bias: bool = False) -> None:
        self.tp = get_tp()
        self.head_dim = head_dim
        self.num_heads = self.tp.split(total_heads, "num_attention_heads")
        """This rank's query heads."""
        # This rank's KV heads: its share, or one replicated head when there are fewer than ranks.
        if total_kv_heads >= self.tp.size:
            self.num_kv_heads = self.tp.split(total_kv_heads, "num_key_value_heads")
            first_kv_head = self.tp.rank * self.num_kv_heads
        else:
            if self.tp.size % total_kv_heads:
                raise ValueError(f"num_key_value_heads ({total_kv_heads}) does not divide "
                                 f"tensor_parallel_size {self.tp.size}")
            self.num_kv_heads = 1
            first_kv_head = self.tp.rank * total_kv_heads // self.tp.size
        q_size, kv_size = self.num_heads * head_dim, self.num_kv_heads * head_dim
        super().__init__(hidden_size, [q_size, kv_size, kv_size], bias,
                         shard_offsets=None if self.tp.size == 1 else [
                             self.tp.rank * q_size, *[first_kv_head * head_dim] * 2])
