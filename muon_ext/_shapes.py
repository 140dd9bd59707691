"""How a Muon param becomes matrices, by its group's matrix_view.

The rules are C++'s (csrc/common/shapes.h, through `_C`), the ones the
planner's checks, the ops and the kernels use; this module words the errors
and makes the views.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from . import _C, row_blocks
from ._types import MatrixView

__all__ = ["matrix_shape", "as_matrices", "second_moment_shape", "muon_stats_shape", "stats_per_row",
           "stats_layout_error"]


def matrix_shape(p: torch.Tensor, view: MatrixView, label: str) -> Tuple[int, int]:
    """(rows, cols) of the matrices a Muon param is made of; raises, naming `label`,
    for a param that is not matrices under `view`."""
    rule, rows, cols = _C.matrix_shape(p.shape, view)
    if rule == _C.MatrixRule.matrices:
        return rows, cols
    if rule == _C.MatrixRule.rank_below_two:
        raise ValueError(f"{label} has shape {tuple(p.shape)}: Muon needs matrices (rank >= 2); "
                         "put vectors and scalars in an 'adamw' group")
    raise ValueError(f"{label} has rank {p.dim()} (shape {tuple(p.shape)}): set the group's matrix_view to "
                     "'flatten' (view(shape[0], -1)) or 'batch' (leading dims index matrices)")


def as_matrices(t: torch.Tensor, view: MatrixView) -> torch.Tensor:
    """The kernel's view of a Muon param-shaped tensor: [..., rows, cols]."""
    if t.dim() > 2 and view == "flatten":
        return t.view(t.shape[0], -1)
    return t


def second_moment_shape(p: torch.Tensor, view: MatrixView) -> Tuple[int, ...]:
    """Shape of the NorMuon statistics of a Muon param: [..., rows, 1] if rows >= cols else [..., 1, cols]."""
    shape = _C.second_moment_shape(p.shape, view)
    if shape is None:
        matrix_shape(p, view, "")  # raises: not matrices
    return shape


def stats_per_row(rows: int, cols: int) -> bool:
    """Whether NorMuon keeps one statistic per row of a rows x cols matrix (else one per column)."""
    return _C.stats_per_row(rows, cols)


def muon_stats_shape(p: torch.Tensor, group: dict) -> Tuple[int, ...]:
    """Shape of a Muon param's NorMuon statistics under its group: `second_moment_shape`,
    or with `row_blocks` each block's own statistics in one column (muon_ext.row_blocks)."""
    blocks = group.get("row_blocks")
    if blocks is None:
        return second_moment_shape(p, group["matrix_view"])
    rows, cols = matrix_shape(p, group["matrix_view"], "")
    return row_blocks.stats_shape(row_blocks.of_group(group, rows), cols)


def stats_layout_error(label: str, p: torch.Tensor, group: dict, held) -> Optional[ValueError]:
    """None where NorMuon statistics of shape `held` (a param's, or its offload slab region's) fit the param
    under `group`; else the error to raise. Statistics are kept per row block, laid out for the row_blocks they
    were made under: an edit or a checkpoint load that changes that layout is refused the same way resident,
    staged and checkpoint loads (docs/design.md, "Row blocks")."""
    expected = tuple(muon_stats_shape(p, group))
    if tuple(held) == expected:
        return None
    return ValueError(f"{label}: optimizer state 'second_momentum_buffer' (NorMuon statistics, kept per row block) "
                      f"has shape {tuple(held)}, and row_blocks={group.get('row_blocks')!r} needs {expected}: the "
                      "statistics were laid out for other row blocks. Keep the row_blocks they were made with, or "
                      "build a new optimizer with the new row_blocks (a checkpoint loads into an optimizer built "
                      "with its row_blocks)")
