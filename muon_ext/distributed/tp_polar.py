"""Polar-Express and NorMuon on matrices split over a process group, without
gathering them (tensor-parallel Muon, "in_place" mode; docs/design.md,
"Split matrices orthogonalized in place"). A process-group module: it knows
nothing of DTensors or trainers, and holds no arithmetic: the ops
`muon_ext.ops.sharded_*` compute between its collectives.

Each rank holds one shard of every matrix (a block of columns or of rows).
Every iteration needs only the matrices' small Gram matrices, sums of the
shards' products: one all_reduce per iteration carries the Gram matrices of
every matrix of the step at once (all shapes, all groups), one more their
norms, and one NorMuon's statistics. The collective count of a step is thus
ns_steps + 2, whatever the number of matrices.
"""

from __future__ import annotations

from typing import List, NamedTuple, Optional, Sequence

import torch
import torch.distributed as dist

from .. import ops

__all__ = ["ShardedBatch", "NormuonShard", "polar_express_shards", "polar_express_sharded", "normuon_sharded"]


class ShardedBatch(NamedTuple):
    """This rank's shards `x` ([n, rows, cols] FP32, orthogonalized in place) of n same-shape matrices split
    along `shard_dim` (0: rows, 1: columns), and their group's iterations."""

    x: torch.Tensor
    shard_dim: int
    coefficients: Sequence[Sequence[float]]
    ns_steps: int
    polar_dtype: str

    def gram_numel(self) -> int:
        side = self.x.shape[1] if self.shard_dim == 1 else self.x.shape[2]
        return self.x.shape[0] * side * side


class NormuonShard(NamedTuple):
    """NorMuon on one matrix's shard `x` (a view, scaled in place) of a `shape` matrix split along `shard_dim`:
    `stats` as the caller keeps them (whole, or this shard's own entries where `stats_local`), `held` the
    positions this shard holds along `shard_dim` (needed where the statistics are whole)."""

    x: torch.Tensor
    stats: torch.Tensor
    shape: Sequence[int]
    shard_dim: int
    held: Optional[torch.Tensor]
    beta2: float
    stats_local: bool

    def settings(self) -> dict:
        rows, cols = self.shape
        held = None if self.held is None else self.held.to(self.x.device)
        return dict(rows=rows, cols=cols, shard_dim=self.shard_dim, held=held, beta2=self.beta2,
                    stats_local=self.stats_local)


def polar_express_sharded(update: torch.Tensor, group, shard_dim: int, coefficients: Sequence[Sequence[float]],
                          ns_steps: int, polar_dtype: str = "float32") -> int:
    """`polar_express_shards` for one matrix's shard `update` ([rows, cols] FP32, in place) or one batch of
    them ([n, rows, cols])."""
    x = update.unsqueeze(0) if update.dim() == 2 else update
    return polar_express_shards([ShardedBatch(x, shard_dim, coefficients, ns_steps, polar_dtype)], group)


def polar_express_shards(batches: List[ShardedBatch], group) -> int:
    """Orthogonalizes every batch's shards in place: the input scale from the whole matrices' norms (one
    all_reduce of every matrix's sum of squares), then each iteration with one all_reduce of every matrix's
    Gram matrix. Collective: every rank of `group` calls it with its shards of the same matrices, in the same
    order; bad arguments raise before the first collective. Returns the bytes this rank sent."""
    for b in batches:
        _check(b)
    if not batches:
        return 0
    device = batches[0].x.device
    sums = torch.empty(sum(b.x.shape[0] for b in batches), dtype=torch.float64, device=device)
    parts = sums.split([b.x.shape[0] for b in batches])
    for b, part in zip(batches, parts):
        ops.sharded_polar_norms(b.x, part)
    sent = _all_reduce(sums, group)
    for b, part in zip(batches, parts):
        ops.sharded_polar_scale(b.x, part, polar_dtype=b.polar_dtype)
    for step in range(max(b.ns_steps for b in batches)):
        active = [b for b in batches if step < b.ns_steps]  # the same on every rank: group settings
        grams = torch.empty(sum(b.gram_numel() for b in active), dtype=torch.float32, device=device)
        parts = grams.split([b.gram_numel() for b in active])
        for b, part in zip(active, parts):
            ops.sharded_polar_gram(b.x, part, shard_dim=b.shard_dim, polar_dtype=b.polar_dtype)
        sent += _all_reduce(grams, group)
        for b, part in zip(active, parts):
            ops.sharded_polar_iterate(b.x, part, b.coefficients[step], shard_dim=b.shard_dim,
                                      polar_dtype=b.polar_dtype)
    return sent


def normuon_sharded(shards: List[NormuonShard], group) -> int:
    """NorMuon on every shard with its whole matrix's statistics: one all_reduce of every matrix's payload
    (ops.sharded_normuon_partial), then the multipliers. Collective; returns the bytes this rank sent."""
    if not shards:
        return 0
    sizes = [ops.sharded_normuon_payload_numel(s.x, *s.shape, s.shard_dim, s.stats_local) for s in shards]
    payload = torch.empty(sum(sizes), dtype=torch.float64, device=shards[0].x.device)
    parts = payload.split(sizes)
    settings = [s.settings() for s in shards]
    for s, part, kw in zip(shards, parts, settings):
        ops.sharded_normuon_partial(s.x, s.stats, part, **kw)
    sent = _all_reduce(payload, group)
    for s, part, kw in zip(shards, parts, settings):
        ops.sharded_normuon_finish(s.x, s.stats, part, **kw)
    return sent


def _check(b: ShardedBatch) -> None:
    if b.shard_dim not in (0, 1):
        raise ValueError(f"polar_express_sharded: shard_dim must be 0 or 1, got {b.shard_dim!r}")
    if b.x.dim() != 3 or b.x.dtype != torch.float32:
        raise TypeError(f"polar_express_sharded: update must be a 2-D (or batched 3-D) float32 tensor, got "
                        f"{b.x.dtype} {tuple(b.x.shape)}")
    if not 0 <= b.ns_steps <= len(b.coefficients):
        raise ValueError(f"polar_express_sharded: ns_steps={b.ns_steps} with {len(b.coefficients)} coefficient "
                         "tuples")


def _all_reduce(t: torch.Tensor, group) -> int:
    dist.all_reduce(t, group=group)
    return t.numel() * t.element_size()
