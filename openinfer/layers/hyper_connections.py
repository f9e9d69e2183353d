"""Manifold-constrained hyper-connections (mHC, DeepSeek-V4): the residual stream is ``n``
parallel streams. Around each sublayer, one learned mixing reads the streams into the
sublayer's input (``pre``), and writes its output back (``post``) while mixing the streams
among themselves through a doubly stochastic matrix (``comb``, from Sinkhorn iterations):

    h [T, n, H] ─ pre-weighted sum ─> x ─ sublayer ─> y
    h' = post ⊗ y + combᵀ · h

The coefficients depend on the token (a linear map of the RMS-normalised streams) and are
computed in float32; the streams stay in the compute dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x), the factor computed in float32 and cast to x's dtype first (as V4 does)."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


class HyperConnection(nn.Module):
    """One sublayer's stream mixing: ``(post [T, n], comb [T, n, n], x [T, H])``."""

    def __init__(self, num_streams: int, hidden_size: int, sinkhorn_iters: int, eps: float,
                 norm_eps: float) -> None:
        super().__init__()
        n = num_streams
        self.n, self.sinkhorn_iters, self.eps, self.norm_eps = n, sinkhorn_iters, eps, norm_eps
        f32 = torch.float32
        self.fn = nn.Parameter(torch.empty((2 + n) * n, n * hidden_size, dtype=f32), requires_grad=False)
        self.base = nn.Parameter(torch.zeros((2 + n) * n, dtype=f32), requires_grad=False)
        self.scale = nn.Parameter(torch.ones(3, dtype=f32), requires_grad=False)

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        pre, post, comb = self.mixes(h)
        return post, comb, self.collapse(pre, h)

    def mixes(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(pre [T, n], post [T, n], comb [T, n, n])`` of the streams ``h``. DeepSeek-V4.1's
        shifted form reads the next sublayer's input with this ``pre`` (``collapse``)."""
        n, eps = self.n, self.eps
        flat = unweighted_rms_norm(h.flatten(1).float(), self.norm_eps)
        mix = F.linear(flat, self.fn)
        pre_b, post_b, comb_b = self.base.split([n, n, n * n])
        pre = torch.sigmoid(mix[:, :n] * self.scale[0] + pre_b) + eps
        post = 2 * torch.sigmoid(mix[:, n:2 * n] * self.scale[1] + post_b)
        comb = torch.softmax(mix[:, 2 * n:].view(-1, n, n) * self.scale[2] + comb_b.view(n, n), -1) + eps
        comb = comb / (comb.sum(-2, keepdim=True) + eps)  # columns first, then rows and columns
        for _ in range(self.sinkhorn_iters - 1):
            comb = comb / (comb.sum(-1, keepdim=True) + eps)
            comb = comb / (comb.sum(-2, keepdim=True) + eps)
        return pre, post, comb

    @staticmethod
    def collapse(pre: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """The streams' ``pre``-weighted sum: [T, H]."""
        return (pre.unsqueeze(-1) * h).sum(1).to(h.dtype)

    @staticmethod
    def write_back(h: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                   y: torch.Tensor) -> torch.Tensor:
        """Streams after the sublayer: stream k = post_k * y + sum_j comb[j, k] * h_j."""
        dtype = h.dtype
        return post.to(dtype).unsqueeze(-1) * y.unsqueeze(-2) + comb.to(dtype).transpose(-1, -2) @ h


class HyperHead(nn.Module):
    """The streams collapsed into one hidden state before the final norm (no Sinkhorn)."""

    def __init__(self, num_streams: int, hidden_size: int, eps: float, norm_eps: float) -> None:
        super().__init__()
        f32 = torch.float32
        self.eps, self.norm_eps = eps, norm_eps
        self.hc_fn = nn.Parameter(torch.empty(num_streams, num_streams * hidden_size, dtype=f32),
                                  requires_grad=False)
        self.hc_base = nn.Parameter(torch.zeros(num_streams, dtype=f32), requires_grad=False)
        self.hc_scale = nn.Parameter(torch.ones(1, dtype=f32), requires_grad=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        flat = unweighted_rms_norm(h.flatten(1).float(), self.norm_eps)
        pre = torch.sigmoid(F.linear(flat, self.hc_fn) * self.hc_scale + self.hc_base) + self.eps
        return (pre.unsqueeze(-1) * h).sum(1).to(h.dtype)
