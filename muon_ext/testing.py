"""Helpers for testing and benchmarking muon_ext, as torch.testing is for
torch; nothing in the optimizer imports them.

Polar-Express accuracy against an FP64 SVD polar factor: the cases and the
error measure shared by the test (tests/python/test_polar_accuracy.py) and the
table (bench/polar_accuracy.py), so that users can check a kernel the same way."""

from __future__ import annotations

from typing import Callable, Dict

import torch

from . import ops


def _with_singular_values(rows: int, cols: int, values: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    k = min(rows, cols)
    u, _ = torch.linalg.qr(torch.randn(rows, k, generator=gen, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(cols, k, generator=gen, dtype=torch.float64))
    return (u * values) @ v.mT


def accuracy_cases(rows: int, cols: int, seed: int = 0) -> Dict[str, torch.Tensor]:
    """FP64 test matrices: Gaussian, condition 1e6 (log-spaced singular values),
    rank 8, zero, and Gaussian scaled to a tiny (1e-3) and a huge (1e4) norm."""
    gen = torch.Generator().manual_seed(seed)
    k = min(rows, cols)
    gaussian = torch.randn(rows, cols, generator=gen, dtype=torch.float64)
    rank_values = torch.zeros(k, dtype=torch.float64)
    rank_values[:8] = torch.rand(8, generator=gen, dtype=torch.float64) + 0.5
    return {"random": gaussian,
            "ill_conditioned_1e6": _with_singular_values(rows, cols, torch.logspace(0, -6, k, dtype=torch.float64), gen),
            "rank_8": _with_singular_values(rows, cols, rank_values, gen),
            "zero": torch.zeros(rows, cols, dtype=torch.float64),
            "tiny_norm_1e-3": gaussian / gaussian.norm() * 1e-3,
            "huge_norm_1e4": gaussian / gaussian.norm() * 1e4}


def polar_factor(g: torch.Tensor) -> torch.Tensor:
    """U V^T of the FP64 SVD, over the singular values above 1e-12 of the largest
    (a rank-deficient matrix's factor on its range; zero for a zero matrix)."""
    u, s, vh = torch.linalg.svd(g, full_matrices=False)
    keep = s > 1e-12 * s.max() if s.numel() and s.max() > 0 else torch.zeros_like(s, dtype=torch.bool)
    return (u[:, keep] @ vh[keep]).double()


def kernel_output(g: torch.Tensor, polar_dtype: str, polar_method: str = "standard") -> torch.Tensor:
    """muon_orthogonalize of one FP32 matrix: input scale and Polar-Express."""
    x = g.float().clone()[None]
    ops.muon_orthogonalize([x], beta2=None, polar_dtype=polar_dtype, polar_method=polar_method)
    return x[0].double()


def relative_error(g: torch.Tensor, orthogonalize: Callable[[torch.Tensor], torch.Tensor]) -> float:
    """||X - U V^T||_F / max(||U V^T||_F, 1): absolute for a zero matrix."""
    target = polar_factor(g)
    return float((orthogonalize(g) - target).norm() / max(float(target.norm()), 1.0))
