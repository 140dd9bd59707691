"""Which DTensor layouts the optimizer accepts, and which block of the whole
tensor each rank holds.

Accepted: any mix of `Replicate()`, `Shard(d)` and `_StridedShard(d)` over the
mesh dims (FSDP2, HSDP, DDP-style replication, tensor parallelism, and their
products: FSDP x TP, HSDP x TP), never `Partial` (a param is a value, not a
pending sum). Splits follow DTensor's own rules (chunk rule, left to right over
the mesh dims, `_StridedShard`'s interleaving), replayed here on index vectors
(`dim_indices`), so each rank knows, for every rank of its shard group, which
rows and columns of a matrix that rank holds. Splitting one tensor dim only
selects along that dim, so a rank's part is the product of one index set per
dim (a block, possibly with interleaved rows).

A stack of matrices under `matrix_view="batch"` (`[E, rows, cols]`, MoE
experts) is E matrices: `matrix_layout` gives the layout of each of them on a
rank. A mesh dim that splits a leading (batch) dim makes its ranks hold
different matrices (expert or FSDP `Shard(0)`: never exchanged over); one
that splits the rows or the columns splits every matrix (expert TP). See
docs/design.md, "Expert stacks".
"""

from __future__ import annotations

from typing import List, NamedTuple, Optional, Tuple, Union

import torch

from .._torch_compat import compute_local_shape_and_global_offset, split_tensor, strided_shard
from .._types import is_dtensor

__all__ = ["Layout", "Ranks", "check_param", "layout_of", "matrix_layout", "is_stack", "local", "holds_full",
           "is_split", "dim_indices", "expected_local_shape", "IndexSet", "index_set"]

# A set of global indices along one dim: a slice where they are consecutive (the common case), else a LongTensor.
IndexSet = Union[slice, torch.Tensor]


class Ranks(NamedTuple):
    """The ranks along one mesh dim, as this rank sees them: their process group, count and this rank's index."""

    group: object
    size: int
    rank: int


def is_split(placement) -> bool:
    """Whether the placement splits a tensor dim (`Shard`, `_StridedShard`; in torch 2.14 the latter is no Shard)."""
    from torch.distributed.tensor import Shard
    StridedShard = strided_shard()

    return isinstance(placement, (Shard, StridedShard))


class Layout(NamedTuple):
    """A DTensor param's mesh and placements. `split_dims`: the mesh dims of
    more than one rank whose placement splits the tensor (their ranks hold
    different parts: the shard group); `replicate_dims`: those of more than one
    rank that replicate it (their ranks hold the same part); `independent`:
    mesh dims whose ranks hold different matrices of a stack (`matrix_layout`;
    their placement reads Replicate(), they count as neither)."""

    mesh: object  # torch.distributed.device_mesh.DeviceMesh
    placements: Tuple
    independent: Tuple[int, ...] = ()

    @property
    def split_dims(self) -> Tuple[int, ...]:
        return tuple(d for d, pl in enumerate(self.placements) if is_split(pl) and self.mesh.size(d) > 1)

    @property
    def replicate_dims(self) -> Tuple[int, ...]:
        return tuple(d for d, pl in enumerate(self.placements)
                     if pl.is_replicate() and self.mesh.size(d) > 1 and d not in self.independent)

    def ranks(self, dim: int) -> Ranks:
        group = self.mesh.get_group(dim)
        import torch.distributed as dist

        return Ranks(group, self.mesh.size(dim), dist.get_rank(group))


def local(t: torch.Tensor) -> torch.Tensor:
    """The tensor's local part, detached (a plain tensor: itself), sharing its storage: writes land in the tensor."""
    t = t.detach()
    return t.to_local() if is_dtensor(t) else t


def layout_of(p) -> Layout:
    return Layout(p.device_mesh, tuple(p.placements))


def is_stack(p, matrix_view: str) -> bool:
    """Whether the Muon param `p` is a stack of matrices (rank > 2 under `matrix_view="batch"`)."""
    return p.dim() > 2 and matrix_view == "batch"


def matrix_layout(p, matrix_view: str) -> Tuple[Layout, Tuple[int, ...]]:
    """(layout, shape) of what the Muon exchange of the DTensor param `p` sees:
    `layout_of(p)` and `p.shape`, except for a stack (`is_stack`), where each
    matrix (rows, cols) is placed by the splits of the last two dims (as
    `Shard(0)` / `Shard(1)`, `_StridedShard` kept) and the mesh dims that split a
    leading dim are `independent`: their ranks hold other matrices."""
    if not is_stack(p, matrix_view):
        return layout_of(p), tuple(p.shape)
    from torch.distributed.tensor import Replicate, Shard
    StridedShard = strided_shard()

    lead = p.dim() - 2
    placements, independent = [], []
    for mesh_dim, pl in enumerate(p.placements):
        if not is_split(pl):
            placements.append(pl)
        elif pl.dim < lead:
            placements.append(Replicate())
            independent.append(mesh_dim)
        elif isinstance(pl, StridedShard):
            placements.append(StridedShard(pl.dim - lead, split_factor=pl.split_factor))
        else:
            placements.append(Shard(pl.dim - lead))
    return Layout(p.device_mesh, tuple(placements), tuple(independent)), tuple(p.shape[-2:])


def check_param(p, where: str, kind: str, matrix_view: str) -> None:
    """Raises TypeError, naming `where` and the placements, unless the DTensor
    param `p` has a layout the optimizer steps correctly (a stack of matrices
    under `matrix_view="batch"` may be split on any dim: `matrix_layout`)."""
    placements = tuple(p.placements)
    for pl in placements:
        if not (pl.is_replicate() or is_split(pl)):
            raise TypeError(f"{where} is a DTensor with placements {placements} on a mesh of shape "
                            f"{tuple(p.device_mesh.shape)}: a param cannot be {pl} (a pending reduction, not a "
                            "value); supported are Replicate(), Shard(d) and _StridedShard(d) on any mesh dims")
    if p.dim() == 0:
        raise TypeError(f"{where} is a 0-dim DTensor; a scalar param cannot be sharded, use a plain tensor")


def dim_indices(size: int, tensor_dim: int, mesh_shape, placements, coordinate) -> torch.Tensor:
    """The global indices along `tensor_dim` (of `size`) held by the rank at
    mesh `coordinate`, in local order: DTensor's splits replayed, left to
    right over the mesh dims, on an index vector (no communication)."""
    from torch.distributed.tensor import Shard
    StridedShard = strided_shard()

    index = torch.arange(size)
    for mesh_dim, pl in enumerate(placements):
        if not is_split(pl) or pl.dim != tensor_dim:
            continue
        on_vector = StridedShard(0, split_factor=pl.split_factor) if isinstance(pl, StridedShard) else Shard(0)
        pieces, _ = split_tensor(on_vector, index, mesh_shape[mesh_dim], with_padding=False, contiguous=True)
        index = pieces[coordinate[mesh_dim]] if coordinate[mesh_dim] < len(pieces) else index[:0]
    return index


def index_set(index: torch.Tensor) -> IndexSet:
    """`index` as a slice when its entries are consecutive, else itself."""
    n = index.numel()
    if n == 0:
        return slice(0, 0)
    start = int(index[0])
    if int(index[-1]) - start + 1 == n and bool((index.diff() == 1).all()):
        return slice(start, start + n)
    return index


def expected_local_shape(p) -> Tuple[int, ...]:
    """The local shape DTensor's rules give this rank for the DTensor `p`."""
    return tuple(compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements, skip_offset=True)[0])


def holds_full(p) -> bool:
    """Whether this rank's local part of the DTensor `p` is the whole tensor."""
    return not layout_of(p).split_dims


def coordinate_of(mesh, global_rank: int) -> Optional[List[int]]:
    """The mesh coordinate of `global_rank`, or None where it is not in `mesh`."""
    found = (mesh.mesh == global_rank).nonzero()
    return found[0].tolist() if found.numel() else None
