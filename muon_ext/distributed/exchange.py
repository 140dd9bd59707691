"""Muon's orthogonalization of DTensor matrices: each matrix is orthogonalized
whole, by one owner rank, and the work is spread over the ranks.

Matrix j of a group of N same-key matrices is owned by rank (first + j) mod W
of the ranks that share the work; the caller advances `first` from group to
group, so that groups of fewer than W matrices do not all land on rank 0. Split (`ShardGroup`: the ranks of the mesh dims that
split the matrix, by rows, columns or both, e.g. FSDP x TP): one all_to_all
brings every rank's block of matrix j (and its NorMuon statistics) to its
owner, which places each block at its rows and columns, runs `orthogonalize`
on its whole matrices, and one all_to_all sends each rank its block back.
Replicated: every rank holds every matrix; each
orthogonalizes its own and one all_gather hands the results to all ranks, so
replicas stay bit-identical. HSDP composes the two: the replicate dim splits
a group's matrices as for replicated params, each replica's shard group runs
the split exchange on its share, and the all_gather over the replicate dim
hands each rank the rows of the other shares. Nothing is sent for the padding of N to a
multiple of W (owners just hold one matrix fewer), and no padding enters an
orthogonalization. Groups of one rank do not come here (step.py runs the
fused single-device step). Each function returns the bytes this rank sent to other
ranks (the part of a send buffer addressed to itself is not counted).
"""

from __future__ import annotations

from typing import Callable, List, Optional

import torch
import torch.distributed as dist

from .placements import IndexSet, Ranks
from .shard_group import ShardGroup

__all__ = ["exchange_sharded", "exchange_replicated"]

Orthogonalize = Callable[[List[torch.Tensor], List[torch.Tensor]], Optional[int]]  # bytes it sent, if any


def exchange_sharded(shards: ShardGroup, rows: int, cols: int, updates: List[torch.Tensor],
                     stats: List[torch.Tensor], stats_sharded: bool, orthogonalize: Orthogonalize,
                     first: int = 0) -> int:
    """`updates`: this rank's FP32 block [r, c] of each matrix (rows
    `shards.rows[me]`, columns `shards.cols[me]`); `stats`: their NorMuon
    second moments (empty without NorMuon), this rank's rows [r, 1] if
    `stats_sharded`, else the whole replicated statistics ([1, cols], or a
    row-blocked param's column of every block's). Both are overwritten
    with the orthogonalized block and the updated statistics."""
    world, me = shards.ranks.size, shards.ranks.rank
    counts = shards.counts
    n = len(updates)
    mine = list(_owned(me, n, world, first))
    normuon = bool(stats)
    row_stat = 1 if (normuon and stats_sharded) else 0  # statistics travelling with each row
    # Ranks that split only the columns hold the same rows: each sends its copy of their statistics, the
    # owner keeps one (they are equal), so every rank's message has one layout.
    size_of = lambda s: counts[s][0] * counts[s][1] + row_stat * counts[s][0]  # noqa: E731 - rank s's block

    # -- to the owners: my block of matrix j goes to rank j mod W
    send = _cat([piece for d in range(world) for j in _owned(d, n, world, first)
                 for piece in _row_pieces(updates[j], stats[j] if row_stat else None)], updates)
    send_splits = [len(_owned(d, n, world, first)) * size_of(me) for d in range(world)]
    recv_splits = [len(mine) * size_of(s) for s in range(world)]
    recv = _all_to_all(shards.ranks, send, send_splits, recv_splits)

    whole = updates[0].new_empty((len(mine), rows, cols))
    whole_stats = []
    if normuon:
        shape = (len(mine), rows, 1) if stats_sharded else (len(mine),) + tuple(stats[0].shape)
        whole_stat = updates[0].new_empty(shape)
        whole_stats = list(whole_stat)
        if not stats_sharded:
            for k, j in enumerate(mine):
                whole_stat[k].copy_(stats[j])
    offset = 0
    for s in range(world):
        r, c = counts[s]
        for k in range(len(mine)):
            _put(whole[k], shards.rows[s], shards.cols[s], recv[offset:offset + r * c].view(r, c))
            offset += r * c
            if row_stat:
                _put(whole_stat[k], shards.rows[s], slice(None), recv[offset:offset + r].view(r, 1))
                offset += r
    if mine:
        orthogonalize(list(whole), whole_stats)

    # -- back from the owners: rank s gets its block (and, replicated, the whole statistics)
    back = _cat([piece for s in range(world) for k in range(len(mine))
                 for piece in _owner_pieces(whole[k], whole_stats[k] if normuon else None, shards.rows[s],
                                            shards.cols[s], stats_sharded)], updates)
    stat_of = lambda s: (counts[s][0] if stats_sharded else stats[0].numel()) if normuon else 0  # noqa: E731 - rank s's
    back_splits = [len(mine) * (counts[s][0] * counts[s][1] + stat_of(s)) for s in range(world)]
    back_stat = stat_of(me)
    block = counts[me][0] * counts[me][1]
    ret_splits = [len(_owned(d, n, world, first)) * (block + back_stat) for d in range(world)]
    ret = _all_to_all(shards.ranks, back, back_splits, ret_splits)
    offset = 0
    for d in range(world):
        for j in _owned(d, n, world, first):
            updates[j].copy_(ret[offset:offset + block].view(updates[j].shape))
            offset += block
            if normuon:
                stats[j].copy_(ret[offset:offset + back_stat].view(stats[j].shape))
                offset += back_stat
    return (send.numel() - send_splits[me] + back.numel() - back_splits[me]) * send.element_size()


def exchange_replicated(ranks: Ranks, updates: List[torch.Tensor], stats: List[torch.Tensor],
                        orthogonalize: Orthogonalize, first: int = 0) -> int:
    """`updates` (FP32, of one shape, each the same on every rank of `ranks`:
    whole matrices, or under HSDP this rank's rows) and their NorMuon `stats`
    (or empty): rank r has matrices r, r + W, ... orthogonalized in place by
    `orthogonalize` (all ranks sharing r call it together); one all_gather
    gives every rank every result."""
    world, me = ranks.size, ranks.rank
    n = len(updates)
    mine = list(_owned(me, n, world, first))
    sent = 0
    if mine:
        sent = orthogonalize([updates[j] for j in mine], [stats[j] for j in mine] if stats else []) or 0
    slot = updates[0].numel() + (stats[0].numel() if stats else 0)
    if slot == 0:  # HSDP rows of a shard with no rows (the same on every rank of `ranks`)
        return sent
    per_rank = -(-n // world)
    packed = updates[0].new_zeros(per_rank * slot)  # the last slots of some ranks stay padding
    for k, j in enumerate(mine):
        packed[k * slot:(k + 1) * slot].copy_(_slot(updates[j], stats[j] if stats else None))
    gathered = [torch.empty_like(packed) for _ in range(world)]
    dist.all_gather(gathered, packed, group=ranks.group)
    for d in range(world):
        for k, j in enumerate(_owned(d, n, world, first)):
            if d == me:
                continue
            data = gathered[d][k * slot:(k + 1) * slot]
            updates[j].copy_(data[:updates[j].numel()].view(updates[j].shape))
            if stats:
                stats[j].copy_(data[updates[j].numel():].view(stats[j].shape))
    return sent + packed.numel() * packed.element_size() * (world - 1)


def _owned(owner: int, n: int, world: int, first: int) -> range:
    """The matrices of `owner`: matrix j belongs to rank (first + j) mod W."""
    return range((owner - first) % world, n, world)


def _row_pieces(update: torch.Tensor, stat: Optional[torch.Tensor]) -> List[torch.Tensor]:
    return [update.reshape(-1)] + ([stat.reshape(-1)] if stat is not None else [])


def _owner_pieces(whole: torch.Tensor, stat: Optional[torch.Tensor], rows: IndexSet, cols: IndexSet,
                  stats_sharded: bool):
    pieces = [_take(whole, rows, cols).reshape(-1)]
    if stat is not None:
        pieces.append((_take(stat, rows, slice(None)) if stats_sharded else stat).reshape(-1))
    return pieces


def _take(whole: torch.Tensor, rows: IndexSet, cols: IndexSet) -> torch.Tensor:
    """whole[rows][:, cols] (a view where both are slices)."""
    if isinstance(rows, slice) and isinstance(cols, slice):
        return whole[rows, cols]
    return whole[rows][:, cols]


def _put(whole: torch.Tensor, rows: IndexSet, cols: IndexSet, block: torch.Tensor) -> None:
    """whole[rows][:, cols] = block, in place."""
    if isinstance(rows, slice) and isinstance(cols, slice):
        whole[rows, cols].copy_(block)
        return
    if isinstance(rows, slice):
        whole[rows].index_copy_(1, cols, block)
    elif isinstance(cols, slice):
        whole[:, cols].index_copy_(0, rows, block)
    else:
        whole.index_put_((rows[:, None], cols[None, :]), block)


def _slot(update: torch.Tensor, stat: Optional[torch.Tensor]) -> torch.Tensor:
    return torch.cat(_row_pieces(update, stat))


def _cat(pieces: List[torch.Tensor], like: List[torch.Tensor]) -> torch.Tensor:
    return torch.cat(pieces) if pieces else like[0].new_empty(0)


def _all_to_all(ranks: Ranks, send: torch.Tensor, send_splits: List[int], recv_splits: List[int]) -> torch.Tensor:
    recv = send.new_empty(sum(recv_splits))
    dist.all_to_all_single(recv, send, recv_splits, send_splits, group=ranks.group)
    return recv
