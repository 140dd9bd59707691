"""Optimizer state of DTensor params: DTensors on the param's mesh.

State shaped like the param takes the param's placements, so a shard's
moments sit beside its rows. The step counter (shape ()) is replicated.
NorMuon's second moment of a matrix with rows >= cols is (rows, 1): one
statistic per row, split like the param's dim 0 and replicated over the mesh
dims that split other dims (so each rank holds its rows' statistics). With rows < cols it is
(1, cols) and replicated: every rank holds the whole vector and the owner of
the matrix sends its update to all of them (exchange.py). A stack of
matrices (`matrix_view="batch"`, `[E, rows, cols]`) has `[E, rows, 1]` or
`[E, 1, cols]` statistics whose leading dims keep the param's splits (each
rank holds its experts'). All reshard correctly under torch.distributed.checkpoint.
"""

from __future__ import annotations


import torch

from .._types import ParamInfo, is_dtensor
from .. import ops
from .._torch_compat import compute_local_shape_and_global_offset
from .._shapes import matrix_shape, muon_stats_shape, stats_per_row
from .placements import is_split, layout_of, local

__all__ = ["zeros", "wrap", "check_values", "stats_follow_rows", "stats_local_shape"]


def stats_follow_rows(p, group: dict) -> bool:
    """Whether the NorMuon statistics of Muon param `p` in `group` are one per row ((rows, 1), placed like the
    param) rather than one per column ((1, cols)) or, with row_blocks, per block (muon_ext.row_blocks): those
    are replicated."""
    rows, cols = matrix_shape(p, group["matrix_view"], "")
    return stats_per_row(rows, cols) and group.get("row_blocks") is None


def _placements(p, shape, like_param: bool, rows_only: bool) -> tuple:
    """The placements `zeros` gives a state tensor of global `shape` (see there)."""
    from torch.distributed.tensor import Replicate

    placements = layout_of(p).placements
    if like_param and not rows_only:
        return tuple(placements)
    # NorMuon statistics ([..., rows, 1] or [..., 1, cols]): the leading dims, and the rows of per-row statistics,
    # are the param's (only under the batch view has the state the param's rank with leading dims)
    kept = len(shape) - (1 if like_param else 2) if rows_only else 0
    return tuple(pl if is_split(pl) and pl.dim < kept else Replicate() for pl in placements)


def stats_local_shape(p, group: dict) -> tuple:
    """This rank's local shape of the Muon param `p`'s NorMuon statistics (placed as `zeros` places them)."""
    shape = muon_stats_shape(p, group)
    placements = _placements(p, shape, stats_follow_rows(p, group), True)
    return tuple(compute_local_shape_and_global_offset(shape, p.device_mesh, placements, skip_offset=True)[0])


def zeros(p, shape, dtype: torch.dtype, like_param: bool = True, rows_only: bool = False):
    """A zero DTensor of global `shape` on `p`'s mesh: placed like `p` where
    `like_param` (param-shaped state); where `rows_only` (NorMuon's statistics),
    with the splits of `p`'s rows dim where also `like_param` (per-row
    statistics: each rank holds its rows') and of a stack's leading dims (each
    rank holds its matrices'); replicated otherwise."""
    from torch.distributed.tensor import DTensor

    shape = tuple(shape)
    layout = layout_of(p)
    lp = local(p)
    placements = _placements(p, shape, like_param, rows_only)
    local_shape = tuple(compute_local_shape_and_global_offset(shape, layout.mesh, placements, skip_offset=True)[0])
    t = torch.zeros(local_shape, dtype=dtype, device=lp.device)
    return DTensor.from_local(t, layout.mesh, placements, run_check=False, shape=torch.Size(shape),
                              stride=torch.empty(shape, device="meta").stride())


def wrap(t: torch.Tensor, like) -> torch.Tensor:
    """The local tensor `t` (`like`'s local shape) as a DTensor placed like `like`."""
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(t, like.device_mesh, like.placements, run_check=False, shape=like.shape,
                              stride=like.stride())


def check_values(info: ParamInfo, values) -> None:
    """update_param's rule for DTensors: values are a DTensor exactly when the
    param is one, with its mesh, placements, global shape and (on this rank)
    local shape; FP32, dense, its storage holding the local part."""
    p = info.param
    if is_dtensor(values) != is_dtensor(p):
        what = "a DTensor" if is_dtensor(p) else "a plain tensor"
        raise TypeError(f"update_param: {info.name} is {what}, so its values must be {what} too, got "
                        f"{type(values).__name__}")
    if values.dtype != torch.float32:
        raise TypeError(f"update_param: values must be float32, got {values.dtype}")
    if values.device_mesh != p.device_mesh:
        raise ValueError(f"update_param: values for {info.name} are on mesh {values.device_mesh}, the param on "
                         f"{p.device_mesh}")
    if tuple(values.placements) != tuple(p.placements):
        raise ValueError(f"update_param: values for {info.name} have placements {tuple(values.placements)}, the "
                         f"param {tuple(p.placements)}")
    if tuple(values.shape) != tuple(p.shape):
        raise ValueError(f"update_param: values have shape {tuple(values.shape)} but {info.name} has shape "
                         f"{tuple(p.shape)}")
    lv, lp = values.to_local(), local(p)
    if lv.layout != torch.strided or lv.is_meta:
        raise TypeError(f"update_param: values for {info.name} must be dense with data, got layout {lv.layout} on "
                        f"{lv.device}")
    if tuple(lv.shape) != tuple(lp.shape):
        raise ValueError(f"update_param: values for {info.name} have local shape {tuple(lv.shape)} on this rank, "
                         f"the param {tuple(lp.shape)}")
    problem = ops.storage_problem(lv)
    if problem:
        raise ValueError(f"update_param: values for {info.name}: {problem}")

