"""How a Muon param becomes matrices, by its group's matrix_view."""

from __future__ import annotations

import math
from typing import Tuple

import torch

from . import row_blocks
from ._types import MatrixView

__all__ = ["matrix_shape", "as_matrices", "second_moment_shape", "muon_stats_shape"]


def matrix_shape(p: torch.Tensor, view: MatrixView, label: str) -> Tuple[int, int]:
    """(rows, cols) of the matrices a Muon param is made of; raises, naming `label`,
    for a param that is not matrices under `view`."""
    if p.dim() == 2:
        return tuple(p.shape)
    if p.dim() < 2:
        raise ValueError(f"{label} has shape {tuple(p.shape)}: Muon needs matrices (rank >= 2); "
                         "put vectors and scalars in an 'adamw' group")
    if view == "flatten":
        return (p.shape[0], math.prod(p.shape[1:]))
    if view == "batch":
        return tuple(p.shape[-2:])
    raise ValueError(f"{label} has rank {p.dim()} (shape {tuple(p.shape)}): set the group's matrix_view to "
                     "'flatten' (view(shape[0], -1)) or 'batch' (leading dims index matrices)")


def as_matrices(t: torch.Tensor, view: MatrixView) -> torch.Tensor:
    """The kernel's view of a Muon param-shaped tensor: [..., rows, cols]."""
    if t.dim() > 2 and view == "flatten":
        return t.view(t.shape[0], -1)
    return t


def second_moment_shape(p: torch.Tensor, view: MatrixView) -> Tuple[int, ...]:
    """Shape of the NorMuon statistics of a Muon param: [..., rows, 1] if rows >= cols else [..., 1, cols]."""
    rows, cols = matrix_shape(p, view, "")
    lead = tuple(p.shape[:-2]) if (p.dim() > 2 and view == "batch") else ()
    return lead + ((rows, 1) if rows >= cols else (1, cols))


def muon_stats_shape(p: torch.Tensor, group: dict) -> Tuple[int, ...]:
    """Shape of a Muon param's NorMuon statistics under its group: `second_moment_shape`,
    or with `row_blocks` each block's own statistics in one column (muon_ext.row_blocks)."""
    blocks = group.get("row_blocks")
    if blocks is None:
        return second_moment_shape(p, group["matrix_view"])
    rows, cols = matrix_shape(p, group["matrix_view"], "")
    return row_blocks.stats_shape(row_blocks.of_group(group, rows), cols)
