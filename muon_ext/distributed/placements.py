"""Which DTensor layouts the optimizer accepts, and where each rank's rows are.

Accepted: `Replicate()` on every mesh dim (DDP-style), or `Shard(0)` on one
mesh dim and `Replicate()` on the others (FSDP2 on a 1-D mesh, HSDP on a 2-D
mesh). Shards follow DTensor's chunk rule (as `torch.chunk`): rank r of the
shard dim holds rows [r * c, min((r + 1) * c, n)) with c = ceil(n / W), so
shards are uneven and the last ranks may hold no rows.
"""

from __future__ import annotations

from typing import List, NamedTuple, Optional, Tuple

import torch

from .._types import is_dtensor

__all__ = ["Layout", "Ranks", "check_param", "layout_of", "local", "chunk_rows", "holds_full"]


class Ranks(NamedTuple):
    """The ranks along one mesh dim, as this rank sees them: their process group, count and this rank's index."""

    group: object
    size: int
    rank: int


class Layout(NamedTuple):
    """A DTensor param's mesh and placements; `shard_dim` is the mesh dim that
    splits tensor dim 0 (None: replicated on every mesh dim)."""

    mesh: object  # torch.distributed.device_mesh.DeviceMesh
    placements: Tuple
    shard_dim: Optional[int]

    def ranks(self, dim: int) -> Ranks:
        return Ranks(self.mesh.get_group(dim), self.mesh.size(dim), self.mesh.get_local_rank(dim))

    def work_dims(self) -> Tuple[int, Optional[int]]:
        """(the mesh dim whose ranks split a group's matrices first: the shard dim, else dim 0;
        a replicate dim beside the shard dim that splits them further, or None)."""
        if self.shard_dim is None:
            return 0, None
        others = [d for d in range(self.mesh.ndim) if d != self.shard_dim]
        return self.shard_dim, (others[0] if others else None)


def local(t: torch.Tensor) -> torch.Tensor:
    """The tensor's local part, detached (a plain tensor: itself), sharing its storage: writes land in the tensor."""
    t = t.detach()
    return t.to_local() if is_dtensor(t) else t


def layout_of(p) -> Layout:
    shards = [d for d, pl in enumerate(p.placements) if pl.is_shard()]
    return Layout(p.device_mesh, tuple(p.placements), shards[0] if shards else None)


def check_param(p, where: str, kind: str, matrix_view: str) -> None:
    """Raises TypeError, naming `where` and the placements, unless the DTensor
    param `p` has a layout the optimizer steps correctly."""
    from torch.distributed.tensor import Replicate, Shard

    placements = tuple(p.placements)
    # _StridedShard subclasses Shard: its rows are interleaved, not a chunk.
    ok = all(isinstance(pl, Replicate) or (type(pl) is Shard and pl.dim == 0) for pl in placements)
    if not ok or sum(pl.is_shard() for pl in placements) > 1:
        raise TypeError(f"{where} is a DTensor with placements {placements} on a mesh of shape "
                        f"{tuple(p.device_mesh.shape)}: supported are Replicate() on every mesh dim (DDP) and "
                        "Shard(0) on one mesh dim, Replicate() on the others (FSDP2, HSDP)")
    if p.dim() == 0:
        raise TypeError(f"{where} is a 0-dim DTensor; a scalar param cannot be sharded, use a plain tensor")
    if kind == "muon" and p.dim() > 2 and matrix_view == "batch" and any(pl.is_shard() for pl in placements):
        raise TypeError(f"{where} is a DTensor with placements {placements} under matrix_view='batch': Shard(0) "
                        "would split the batch of matrices, not their rows; replicate it or use 'flatten'")


def chunk_rows(n: int, world: int) -> List[Tuple[int, int]]:
    """(start, count) of dim 0's rows on each rank of a shard dim of `world` ranks (DTensor's chunk rule)."""
    c = -(-n // world) if n else 0
    return [(min(r * c, n), max(0, min((r + 1) * c, n) - r * c)) for r in range(world)]


def holds_full(p) -> bool:
    """Whether this rank's local part of the DTensor `p` is the whole tensor."""
    layout = layout_of(p)
    return layout.shard_dim is None or layout.mesh.size(layout.shard_dim) == 1
