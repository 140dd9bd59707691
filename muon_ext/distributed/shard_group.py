"""The shard group of a split DTensor matrix: the ranks that together hold
each matrix exactly once (the product of the mesh dims that split it), their
process group, and which rows and columns of the matrix each of them holds.

One split mesh dim (FSDP, or tensor parallelism alone, also on a mesh built by
`DeviceMesh.from_group` from a Megatron TP group) uses that dim's process
group. Several (FSDP x TP, HSDP x TP's shard and TP dims) use a process group
over their product, created once per set of ranks with
`new_group(use_local_synchronization=True)`: only its members call it, at
their first step with such a layout. See docs/design.md, "Distributed
(DTensor params)".
"""

from __future__ import annotations

import itertools
from typing import Dict, List, NamedTuple, Tuple

import torch
import torch.distributed as dist

from .placements import IndexSet, Layout, Ranks, coordinate_of, dim_indices, index_set

__all__ = ["ShardGroup", "shard_group"]

_PRODUCT_GROUPS: Dict[Tuple, object] = {}  # (default group, ranks) -> process group over several mesh dims


class ShardGroup(NamedTuple):
    """`ranks`: the shard group (process group, size, this rank's index in
    it); `rows[s]`, `cols[s]`: the global rows and columns of the matrix view
    held by the rank of index s, in its local order; `counts[s]`: their sizes."""

    ranks: Ranks
    rows: List[IndexSet]
    cols: List[IndexSet]
    counts: List[Tuple[int, int]]


def shard_group(layout: Layout, shape: Tuple[int, ...]) -> ShardGroup:
    """The shard group of a param of `shape` (2-D, or more viewed as
    [shape[0], prod(shape[1:])]) placed by `layout`, which splits it on at
    least one mesh dim of more than one rank."""
    mesh, split = layout.mesh, layout.split_dims
    me = dist.get_rank()
    mine = coordinate_of(mesh, me)
    members = []  # (global rank, mesh coordinate) of every rank that differs from mine on the split dims only
    for offsets in itertools.product(*(range(mesh.size(d)) for d in split)):
        coordinate = list(mine)
        for d, k in zip(split, offsets):
            coordinate[d] = k
        members.append((int(mesh.mesh[tuple(coordinate)]), coordinate))
    if len(split) == 1:
        group = mesh.get_group(split[0])
    else:
        key = (id(dist.group.WORLD), tuple(sorted(r for r, _ in members)))
        if key not in _PRODUCT_GROUPS:
            _PRODUCT_GROUPS[key] = dist.new_group(list(key[1]), use_local_synchronization=True)
        group = _PRODUCT_GROUPS[key]
    by_group_rank = sorted(members, key=lambda m: dist.get_group_rank(group, m[0]))
    rows, cols, counts = [], [], []
    for _, coordinate in by_group_rank:
        indices = [dim_indices(size, d, mesh.shape, layout.placements, coordinate) for d, size in enumerate(shape)]
        flat_cols = indices[1] if len(shape) > 1 else torch.zeros(1, dtype=torch.long)
        for d in range(2, len(shape)):  # the flatten view: columns run over dims 1.. in row-major order
            flat_cols = (flat_cols[:, None] * shape[d] + indices[d][None, :]).reshape(-1)
        rows.append(index_set(indices[0]))
        cols.append(index_set(flat_cols))
        counts.append((indices[0].numel(), flat_cols.numel()))
    return ShardGroup(Ranks(group, len(members), dist.get_group_rank(group, me)), rows, cols, counts)

