"""Muon's orthogonalization of DTensor matrices: each matrix is orthogonalized
whole, by one owner rank, and the work is spread over the ranks.

Matrix j of a group of N same-key matrices is owned by rank j mod W of the
ranks that share the work (`Ranks`: one mesh dim). Sharded (Shard(0)): one all_to_all
brings every rank's rows of matrix j (and their NorMuon statistics) to its
owner, the owner runs `orthogonalize` on its whole matrices, one all_to_all
sends each rank its rows back. Replicated: every rank holds every matrix; each
orthogonalizes its own and one all_gather hands the results to all ranks, so
replicas stay bit-identical. HSDP composes the two: the replicate dim splits
a group's matrices as for replicated params, each replica's shard group runs
the sharded exchange on its share, and the all_gather over the replicate dim
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

from .placements import Ranks, chunk_rows

__all__ = ["exchange_sharded", "exchange_replicated"]

Orthogonalize = Callable[[List[torch.Tensor], List[torch.Tensor]], Optional[int]]  # bytes it sent, if any


def exchange_sharded(ranks: Ranks, rows: int, cols: int, updates: List[torch.Tensor],
                     stats: List[torch.Tensor], stats_sharded: bool, orthogonalize: Orthogonalize) -> int:
    """`updates`: this rank's FP32 rows [r, cols] of each matrix; `stats`: their
    NorMuon second moments (empty without NorMuon), this rank's rows [r, 1] if
    `stats_sharded`, else the whole replicated [1, cols]. Both are overwritten
    with the orthogonalized rows and the updated statistics."""
    world, me = ranks.size, ranks.rank
    chunks = chunk_rows(rows, world)
    n = len(updates)
    mine = list(range(me, n, world))
    normuon = bool(stats)
    row_stat = 1 if (normuon and stats_sharded) else 0  # statistics travelling with each row

    # -- to the owners: my rows of matrix j go to rank j mod W
    send = _cat([piece for d in range(world) for j in range(d, n, world)
                 for piece in _row_pieces(updates[j], stats[j] if row_stat else None)], updates)
    send_splits = [len(range(d, n, world)) * chunks[me][1] * (cols + row_stat) for d in range(world)]
    recv_splits = [len(mine) * chunks[s][1] * (cols + row_stat) for s in range(world)]
    recv = _all_to_all(ranks, send, send_splits, recv_splits)

    whole = updates[0].new_empty((len(mine), rows, cols))
    whole_stats = []
    if normuon:
        shape = (len(mine), rows, 1) if stats_sharded else (len(mine), 1, cols)
        whole_stat = updates[0].new_empty(shape)
        whole_stats = list(whole_stat)
        if not stats_sharded:
            for k, j in enumerate(mine):
                whole_stat[k].copy_(stats[j])
    offset = 0
    for s in range(world):
        start, count = chunks[s]
        for k in range(len(mine)):
            whole[k, start:start + count].copy_(recv[offset:offset + count * cols].view(count, cols))
            offset += count * cols
            if row_stat:
                whole_stat[k, start:start + count].copy_(recv[offset:offset + count].view(count, 1))
                offset += count
    if mine:
        orthogonalize(list(whole), whole_stats)

    # -- back from the owners: rank s gets its rows (and, replicated, the whole statistics)
    back = _cat([piece for s in range(world) for k in range(len(mine))
                 for piece in _owner_pieces(whole[k], whole_stats[k] if normuon else None, chunks[s],
                                            stats_sharded)], updates)
    stat_of = lambda s: (chunks[s][1] if stats_sharded else cols) if normuon else 0  # noqa: E731 - rank s's
    back_splits = [len(mine) * (chunks[s][1] * cols + stat_of(s)) for s in range(world)]
    back_stat = stat_of(me)
    ret_splits = [len(range(d, n, world)) * (chunks[me][1] * cols + back_stat) for d in range(world)]
    ret = _all_to_all(ranks, back, back_splits, ret_splits)
    offset = 0
    count = chunks[me][1]
    for d in range(world):
        for j in range(d, n, world):
            updates[j].copy_(ret[offset:offset + count * cols].view(count, cols))
            offset += count * cols
            if normuon:
                stats[j].copy_(ret[offset:offset + back_stat].view(stats[j].shape))
                offset += back_stat
    return (send.numel() - send_splits[me] + back.numel() - back_splits[me]) * send.element_size()


def exchange_replicated(ranks: Ranks, updates: List[torch.Tensor], stats: List[torch.Tensor],
                        orthogonalize: Orthogonalize) -> int:
    """`updates` (FP32, of one shape, each the same on every rank of `ranks`:
    whole matrices, or under HSDP this rank's rows) and their NorMuon `stats`
    (or empty): rank r has matrices r, r + W, ... orthogonalized in place by
    `orthogonalize` (all ranks sharing r call it together); one all_gather
    gives every rank every result."""
    world, me = ranks.size, ranks.rank
    n = len(updates)
    mine = list(range(me, n, world))
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
        for k, j in enumerate(range(d, n, world)):
            if d == me:
                continue
            data = gathered[d][k * slot:(k + 1) * slot]
            updates[j].copy_(data[:updates[j].numel()].view(updates[j].shape))
            if stats:
                stats[j].copy_(data[updates[j].numel():].view(stats[j].shape))
    return sent + packed.numel() * packed.element_size() * (world - 1)


def _row_pieces(update: torch.Tensor, stat: Optional[torch.Tensor]) -> List[torch.Tensor]:
    return [update.reshape(-1)] + ([stat.reshape(-1)] if stat is not None else [])


def _owner_pieces(whole: torch.Tensor, stat: Optional[torch.Tensor], chunk, stats_sharded: bool):
    start, count = chunk
    pieces = [whole[start:start + count].reshape(-1)]
    if stat is not None:
        pieces.append((stat[start:start + count] if stats_sharded else stat).reshape(-1))
    return pieces


def _slot(update: torch.Tensor, stat: Optional[torch.Tensor]) -> torch.Tensor:
    return torch.cat(_row_pieces(update, stat))


def _cat(pieces: List[torch.Tensor], like: List[torch.Tensor]) -> torch.Tensor:
    return torch.cat(pieces) if pieces else like[0].new_empty(0)


def _all_to_all(ranks: Ranks, send: torch.Tensor, send_splits: List[int], recv_splits: List[int]) -> torch.Tensor:
    recv = send.new_empty(sum(recv_splits))
    dist.all_to_all_single(recv, send, recv_splits, send_splits, group=ranks.group)
    return recv
