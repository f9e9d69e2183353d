"""Rotary position embeddings (RoPE, Su et al. 2021), NeoX / Hugging Face Llama layout.

Each pair of rotated dims (i, i + rotary_dim / 2) is turned by the angle ``position * inv_freq[i]``.
The scaling variants (linear, llama3, yarn) only change ``inv_freq`` and, for yarn, scale cos/sin
by an attention factor; the rotation itself is the same for all of them.
"""

from __future__ import annotations

import math

import torch

from openinfer.kernels.custom_op import CustomOp
from openinfer.layers.norm import RMSNorm

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def _default_inv_freq(rotary_dim: int, theta: float) -> torch.Tensor:
    """Original RoPE frequencies ``theta ** (-2i / rotary_dim)``, one per rotated pair."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    return 1.0 / (theta**exponents)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict, max_position: int) -> torch.Tensor:
    """Llama 3.1 scaling: divide low frequencies by ``factor``, keep high ones, blend in between."""
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling.get("original_max_position_embeddings") or max_position

    wavelen = 2 * math.pi / inv_freq
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor

    # Long wavelengths never completed a turn during pretraining: interpolate them fully.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    # Wavelengths between the two thresholds blend smoothly from scaled to unscaled.
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's recommended attention temperature ``0.1 * mscale * ln(scale) + 1``."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_params(
    rotary_dim: int, theta: float, scaling: dict, max_position: int
) -> tuple[torch.Tensor, float]:
    """YaRN (Peng et al. 2023): NTK-by-parts frequencies plus a cos/sin (attention) factor."""
    original_max = scaling.get("original_max_position_embeddings") or max_position
    # Some configs (e.g. DeepSeek-V3) leave `factor` out and imply it by the context ratio.
    factor = scaling.get("factor") or max_position / original_max

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        # The dim index whose wavelength fits `num_rotations` times into the original context.
        return (rotary_dim * math.log(original_max / (num_rotations * 2 * math.pi))) / (
            2 * math.log(theta)
        )

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # avoid dividing by zero in the ramp

    pos_freqs = theta ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim)
    inv_freq_extrapolation = 1.0 / pos_freqs  # unchanged: high frequencies
    inv_freq_interpolation = 1.0 / (factor * pos_freqs)  # position-interpolated: low frequencies
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    # Weight of the original frequency: 1 below `low` (fast dims), 0 above `high` (slow dims).
    extrapolation_weight = 1 - ramp
    inv_freq = (
        inv_freq_interpolation * (1 - extrapolation_weight)
        + inv_freq_extrapolation * extrapolation_weight
    )
    return inv_freq, float(attention_factor)


class RotaryEmbedding(CustomOp):
    """Applies RoPE to q and k from a precomputed float32 cos/sin cache.

    The cache holds ``max_position x rotary_dim`` floats, so build one per model and share it
    across layers. Positions must be in ``[0, max_position)``. ``forward_cpu``: NeoX rotations
    of whole heads run as one C++ pass over q and k (with Qwen3's q/k norms fused in).
    """

    def __init__(
        self,
        head_dim: int,
        rotary_dim: int,
        max_position: int,
        inv_freq: torch.Tensor,
        attention_factor: float = 1.0,
        interleaved: bool = False,
    ) -> None:
        """Precompute cos/sin for ``max_position`` positions from ``inv_freq`` (rotary_dim / 2).
        ``interleaved``: dims (2i, 2i + 1) form the rotated pairs (DeepSeek, GPT-J) rather than
        (i, i + rotary_dim / 2)."""
        super().__init__()
        self.interleaved = interleaved
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim
        self.max_position = max_position
        # float32 angles: bf16/fp16 cannot resolve position * inv_freq at large positions.
        freqs = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq.float()[None, :]
        # Non-persistent: derived from the config, never part of a checkpoint.
        self.register_buffer("cos_cache", freqs.cos() * attention_factor, persistent=False)
        self.register_buffer("sin_cache", freqs.sin() * attention_factor, persistent=False)

    def forward_native(
        self, positions: torch.LongTensor, q: torch.Tensor, k: torch.Tensor,
        q_norm: RMSNorm | None = None, k_norm: RMSNorm | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q ``[T, num_heads, head_dim]`` and k ``[T, num_kv_heads, head_dim]``, after
        normalising each head row with ``q_norm`` / ``k_norm`` where given (Qwen3's q/k norm;
        the C++ kernel then does both in one pass, bitwise as the two steps).

        ``positions [T]`` gives each token's position. Returns new tensors with the shapes and
        dtypes of q and k.
        """
        if q_norm is not None:
            q, k = q_norm(q), k if k_norm is None else k_norm(k)
        return self._rotate_pairs(positions, q, k)

    def forward_cpu(
        self, positions: torch.LongTensor, q: torch.Tensor, k: torch.Tensor,
        q_norm: RMSNorm | None = None, k_norm: RMSNorm | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        in_kernel = self._in_kernel(positions, q, k)
        if q_norm is not None and not (in_kernel and self._fuses(q_norm, k_norm, q, k)):
            q, k, q_norm = q_norm(q), k if k_norm is None else k_norm(k), None  # norms, then RoPE
            in_kernel = self._in_kernel(positions, q, k)
        if not in_kernel:
            return self._rotate_pairs(positions, q, k)
        q_out, k_out = torch.empty(q.shape, dtype=q.dtype), torch.empty(k.shape, dtype=k.dtype)
        norms = () if q_norm is None else (q_norm.weight, k_norm.weight, q_norm.eps)
        self.cpu_kernels.rotary_neox(q_out, k_out, q, k, positions, self.cos_cache,
                                     self.sin_cache, *norms)
        return q_out, k_out

    def _rotate_pairs(self, positions: torch.Tensor, q: torch.Tensor,
                      k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos = self.cos_cache[positions].unsqueeze(-2)  # [T, 1, rotary_dim / 2]: same for every head
        sin = self.sin_cache[positions].unsqueeze(-2)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    @staticmethod
    def _fuses(q_norm: RMSNorm, k_norm: RMSNorm | None, q: torch.Tensor, k: torch.Tensor) -> bool:
        """Whether the kernel can apply these q/k norms itself: both given, one eps, weights
        of the rows' dtype over the whole head (of at most 512 values: the kernel's buffer)."""
        return (k_norm is not None and q_norm.eps == k_norm.eps
                and q_norm.in_kernel(q) and k_norm.in_kernel(k)
                and q_norm.weight.numel() == q.shape[-1] == k_norm.weight.numel() <= 512)

    def _in_kernel(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> bool:
        """Whether the C++ kernel computes this call: NeoX pairs over the whole head, float32
        or bfloat16 q and k whose heads lie side by side (views into the fused q/k/v output)."""
        return (not self.interleaved and self.rotary_dim == self.head_dim
                and q.dtype == k.dtype and q.dtype in (torch.float32, torch.bfloat16)
                and positions.dtype == torch.int64 and positions.is_contiguous()
                and _heads_side_by_side(q) and _heads_side_by_side(k))

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """NeoX-style rotation: the first half of the rotary dims pairs with the second half.
        Interleaved pairs come out in that layout too (pair i at dims i and i + rotary_dim / 2):
        a layout applied to q and k alike leaves every q.k, and so attention, unchanged."""
        if self.interleaved:
            x1, x2 = x[..., 0:self.rotary_dim:2].float(), x[..., 1:self.rotary_dim:2].float()
        else:
            x1, x2 = x[..., : self.rotary_dim].float().chunk(2, dim=-1)
        rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
        if self.rotary_dim == self.head_dim:
            return rotated
        # Partial rotary: the remaining dims carry no position information and pass through.
        return torch.cat((rotated, x[..., self.rotary_dim :]), dim=-1)


def get_rope(
    head_dim: int,
    max_position: int,
    rope_theta: float,
    rope_scaling: dict | None,
    partial_rotary_factor: float = 1.0,
    interleaved: bool = False,
) -> RotaryEmbedding:
    """Build the RotaryEmbedding described by a Hugging Face config.

    Args:
        head_dim: size of each attention head.
        max_position: number of positions to precompute (the model's max_position_embeddings).
        rope_theta: RoPE base; any ``rope_theta`` inside ``rope_scaling`` is ignored.
        rope_scaling: the config's ``rope_scaling`` / ``rope_parameters`` dict, or None. Its
            ``rope_type`` (or legacy ``type``) must be one of ``SUPPORTED_ROPE_TYPES``.
        partial_rotary_factor: fraction of head_dim that is rotated (the leading dims).
        interleaved: rotate pairs of adjacent dims (see RotaryEmbedding).
    """
    scaling = rope_scaling or {}
    rope_type = scaling.get("rope_type") or scaling.get("type") or "default"
    rotary_dim = int(head_dim * partial_rotary_factor)
    if rotary_dim <= 0 or rotary_dim % 2 or rotary_dim > head_dim:
        raise ValueError(
            f"Rotary dims must be even and in (0, head_dim]; got {rotary_dim} "
            f"(head_dim={head_dim}, partial_rotary_factor={partial_rotary_factor})"
        )

    attention_factor = 1.0
    if rope_type == "default":
        inv_freq = _default_inv_freq(rotary_dim, rope_theta)
    elif rope_type == "linear":
        # Position interpolation: scaling positions by 1/factor == scaling frequencies by 1/factor.
        inv_freq = _default_inv_freq(rotary_dim, rope_theta) / scaling["factor"]
    elif rope_type == "llama3":
        inv_freq = _default_inv_freq(rotary_dim, rope_theta)
        inv_freq = _llama3_inv_freq(inv_freq, scaling, max_position)
    elif rope_type == "yarn":
        inv_freq, attention_factor = _yarn_params(rotary_dim, rope_theta, scaling, max_position)
    else:
        raise ValueError(
            f"Unsupported rope_type {rope_type!r}; supported types are: "
            f"{', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    return RotaryEmbedding(head_dim, rotary_dim, max_position, inv_freq, attention_factor, interleaved)


def _heads_side_by_side(x: torch.Tensor) -> bool:
    """x [T, H, D] with unit stride in D and each head's row right after the previous one."""
    return x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2]
