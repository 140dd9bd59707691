"""The Muon group key `row_blocks`: each param's matrix cut into row blocks
that are orthogonalized as matrices of their own, each lr-scaled by its own
shape (docs/design.md, "Row blocks"). The planner puts the parsed blocks on
every Muon work item (`WorkItem.blocks`), and every runner (resident, staged
/ offload, DTensor step) cuts its kernel calls with the functions here, so the
shape rule and the cutting are written once.

Two forms of the key:
  * contiguous sizes, `row_blocks=(64, 64, 128)`: blocks of consecutive rows
    (e.g. per attention head: blocks of head_dim rows);
  * index blocks, `row_blocks=[[0, 1, 4, 5], [2, 6], [3, 7]]`: each block a
    list of row indices, together a partition of the rows (an interleaved
    fused QKV: `interleaved(groups, (q, k, v))` builds it).
The optional key `row_block_scales` (positive floats, one per block) scales
each block's update on top of the group's shape rule (lr_scale, applied to
each block's own shape): lr * s for the update, weight_decay / s, so the decay
stays lr * weight_decay (a trainer's own per-matrix scale rule, e.g.
Megatron's muon_scale_mode, applied per block).
A block is the matrix of its rows in the order given; the result equals
stepping the blocks as separate params, bit for bit (same kernels on the same
values). NorMuon keeps per-block statistics, one FP32 buffer of
`stats_numel` entries per param, laid out block after block, each block's part
its own matrix's [b, 1] (b >= cols) or [1, cols] statistics.
"""

from __future__ import annotations

import functools
import math
from typing import Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple

import torch

from . import _C, op_arguments, ops

__all__ = ["RowBlocks", "of_group", "parse", "check", "interleaved", "stats_shape", "stats_numel", "calls",
           "muon_step", "local_runs", "orthogonalize_blocks", "block_stats", "gram_parts"]


class RowBlocks(NamedTuple):
    """Parsed row blocks of a `rows`-row matrix: `order` lists the rows block
    after block (None where the blocks are already consecutive: views, no
    copies), `sizes` the rows of each block."""

    order: Optional[Tuple[int, ...]]
    sizes: Tuple[int, ...]
    rows: int
    scales: Tuple[float, ...]  # per block, 1.0 without row_block_scales

    def starts(self) -> List[int]:
        out, at = [], 0
        for size in self.sizes:
            out.append(at)
            at += size
        return out


def interleaved(groups: int, part_sizes: Sequence[int]) -> List[List[int]]:
    """Index blocks of a matrix made of `groups` consecutive runs of rows, each
    run holding parts of `part_sizes` rows: block k gathers part k of every run
    (Megatron's fused QKV: runs are query groups, parts are q, k, v)."""
    if not isinstance(groups, int) or isinstance(groups, bool) or groups < 1:
        raise ValueError(f"interleaved: groups must be a positive int, got {groups!r}")
    if not part_sizes or not all(isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in part_sizes):
        raise ValueError(f"interleaved: part_sizes must be positive ints, got {part_sizes!r}")
    run = sum(part_sizes)
    blocks, start = [], 0
    for size in part_sizes:
        blocks.append([g * run + start + i for g in range(groups) for i in range(size)])
        start += size
    return blocks


def check(spec, rows: Optional[int], where: str, scales=None) -> None:
    """Raises ValueError, prefixed by `where`, unless `spec` is None (and `scales` too) or valid row blocks
    of `rows` rows with valid `scales` (`rows` None: the form only)."""
    if spec is None:
        if scales is not None:
            raise ValueError(f"{where}row_block_scales={scales!r} without row_blocks")
        return
    frozen = _frozen(spec, where)
    _scales(scales, len(frozen), where)
    if rows is not None:
        _parse(frozen, rows, where, _scales(scales, len(frozen), where))


def of_group(group: dict, rows: int) -> Optional[RowBlocks]:
    """The parsed (checked) row blocks of a Muon group for its params' `rows`-row matrices; None without."""
    return parse(group.get("row_blocks"), rows, group.get("row_block_scales"))


def parse(spec, rows: int, scales=None) -> Optional[RowBlocks]:
    """The parsed blocks of a checked `spec` for `rows` rows (None: no blocks); cached."""
    if spec is None:
        return None
    frozen = _frozen(spec, "")
    return _parse(frozen, rows, "", _scales(scales, len(frozen), ""))


def _scales(scales, count: int, where: str) -> Tuple[float, ...]:
    if scales is None:
        return (1.0,) * count
    if isinstance(scales, torch.Tensor) or not isinstance(scales, (tuple, list)) or len(scales) != count or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0 for v in scales):
        raise ValueError(f"{where}row_block_scales must be None or {count} positive finite numbers (one per row "
                         f"block), got {scales!r}")
    return tuple(float(v) for v in scales)


def _frozen(spec, where: str):
    """`spec` as a hashable tuple: sizes (ints) or index blocks (tuples of ints)."""
    if isinstance(spec, torch.Tensor) or not isinstance(spec, (tuple, list)) or not spec:
        raise ValueError(f"{where}row_blocks must be None, a non-empty tuple of positive ints (contiguous sizes) or "
                         f"a list of row-index lists (index blocks), got {spec!r}")
    if all(isinstance(b, int) and not isinstance(b, bool) for b in spec):
        return tuple(spec)
    out = []
    for b in spec:
        values = b.tolist() if isinstance(b, torch.Tensor) and b.dim() == 1 else b
        if not isinstance(values, (tuple, list)) or not values or not all(
                isinstance(i, int) and not isinstance(i, bool) for i in values):
            raise ValueError(f"{where}row_blocks: every index block must be a non-empty list of row indices (ints), "
                             f"got {b!r}")
        out.append(tuple(values))
    return tuple(out)


@functools.lru_cache(maxsize=256)
def _parse(spec: tuple, rows: int, where: str, scales: Tuple[float, ...]) -> RowBlocks:
    if isinstance(spec[0], int):
        if not all(b > 0 for b in spec):
            raise ValueError(f"{where}row_blocks must be positive ints, got {spec!r}")
        if sum(spec) != rows:
            raise ValueError(f"{where}row_blocks {spec} sum to {sum(spec)} rows, the param's matrix has {rows}")
        return RowBlocks(None, spec, rows, scales)
    order = [i for block in spec for i in block]
    if sorted(order) != list(range(rows)):
        raise ValueError(f"{where}row_blocks: the index blocks must hold every row of the param's {rows}-row matrix "
                         f"exactly once (got {len(order)} indices)")
    sizes = tuple(len(block) for block in spec)
    if order == list(range(rows)):  # consecutive after all: views
        return RowBlocks(None, sizes, rows, scales)
    return RowBlocks(tuple(order), sizes, rows, scales)


def stats_numel(blocks: RowBlocks, cols: int) -> int:
    """Entries of a param's NorMuon statistics under `blocks`: each block's own."""
    return sum(b if _C.stats_per_row(b, cols) else cols for b in blocks.sizes)


def stats_shape(blocks: RowBlocks, cols: int) -> Tuple[int, int]:
    """Shape of a row-blocked param's NorMuon statistics (one FP32 column, block after block)."""
    return (stats_numel(blocks, cols), 1)


def block_stats(stats: torch.Tensor, blocks: RowBlocks, cols: int) -> List[torch.Tensor]:
    """Views of each block's statistics in a param's buffer."""
    flat, out, at = stats.view(-1), [], 0
    for b in blocks.sizes:
        per_row = _C.stats_per_row(b, cols)  # the rule of csrc/common/shapes.h
        n = b if per_row else cols
        out.append(flat[at:at + n].view((b, 1) if per_row else (1, cols)))
        at += n
    return out


@functools.lru_cache(maxsize=256)
def _order_tensor(order: tuple, device: str) -> torch.Tensor:
    return torch.tensor(order, dtype=torch.long, device=device)


def _permuted(t: torch.Tensor, blocks: RowBlocks) -> torch.Tensor:
    """`t`'s rows block after block: `t` itself (contiguous blocks) or a gathered copy."""
    if blocks.order is None:
        return t
    return t.index_select(0, _order_tensor(blocks.order, str(t.device)))


def _put_back(t: torch.Tensor, permuted: torch.Tensor, blocks: RowBlocks) -> None:
    if blocks.order is not None:
        t.index_copy_(0, _order_tensor(blocks.order, str(t.device)), permuted)


def calls(blocks: Optional[RowBlocks], params, grads, moms, stats, masters) -> Iterator[tuple]:
    """The kernel calls of one Muon work item, as (scale, (params, grads, moms,
    stats, masters)), lists of matrices [rows, cols]: the lists themselves
    (scale 1) without blocks, else one call per block size and scale, each
    block a matrix of its own (written back into the param-shaped tensors
    after the last call); `op_arguments.muon_apply` gives a call's lr and weight decay."""
    if blocks is None:
        yield 1.0, (params, grads, moms, stats, masters)
        return
    cols = next((ts[0].shape[-1] for ts in (params, grads, moms) if ts), 0)
    written = [params, moms, masters]
    permuted = [[_permuted(t, blocks) for t in ts] for ts in written]
    pgrads = [_permuted(g, blocks) for g in grads]
    per_block_stats = [block_stats(s, blocks, cols) for s in stats]
    by_call: Dict[Tuple[int, float], List[list]] = {}
    for k, (start, size) in enumerate(zip(blocks.starts(), blocks.sizes)):
        lists = by_call.setdefault((size, blocks.scales[k]), [[], [], [], [], []])
        rows = slice(start, start + size)
        lists[0].extend(t[rows] for t in permuted[0])
        lists[1].extend(g[rows] for g in pgrads)
        lists[2].extend(t[rows] for t in permuted[1])
        lists[3].extend(s[k] for s in per_block_stats)
        lists[4].extend(t[rows] for t in permuted[2])
    for (_, scale), lists in by_call.items():
        yield scale, tuple(lists)
    for ts, ps in zip(written, permuted):
        for t, p in zip(ts, ps):
            _put_back(t, p, blocks)


def muon_step(blocks: Optional[RowBlocks], group: dict, params, grads, moms, stats, masters, *, inv_scale,
              found_inf, max_workspace_bytes: int, checked=None) -> None:
    """The fused Muon step (`ops.muon_step` under `group`'s settings) on a work item's matrices, one call per
    block size and scale (one call without blocks): the runners' single place that calls it. `checked`: the
    planner's token for the item's lists, handed to the op only where the call takes those very lists."""
    if blocks is not None:
        checked = None  # the calls take block views, which the token does not cover
    for scale, (ps, gs, ms, ss, masters_) in calls(blocks, params, grads, moms, stats, masters):
        ops.muon_step(ps, gs, ms, ss, masters=masters_, inv_scale=inv_scale, found_inf=found_inf,
                      max_workspace_bytes=max_workspace_bytes, checked=checked,
                      **op_arguments.muon_step(group, scale))


def orthogonalize_blocks(blocks: Optional[RowBlocks], whole: List[torch.Tensor], stats: List[torch.Tensor],
                         orthogonalize) -> None:
    """Phase 2 on whole FP32 update matrices (the DTensor step's owners): each
    block of each matrix orthogonalized as a matrix of its own, one
    `orthogonalize(matrices, stats)` call per block size, written back."""
    if blocks is None:
        orthogonalize(whole, stats)
        return
    for _, (_, _, updates, stats_of_blocks, _) in calls(blocks, [], [], whole, stats, []):
        # calls() cuts (params, grads, moms, stats, masters): the updates go where moms go, written back after
        orthogonalize(list(updates), list(stats_of_blocks))


def local_runs(blocks: RowBlocks, local_rows: torch.Tensor) -> List[Tuple[int, float, torch.Tensor]]:
    """For phase 3 on a shard holding the global rows `local_rows` (in local
    order): [(block rows, block scale, local row indices)] per block size and
    scale, so that each block's rows are applied with its own lr scale."""
    block_of = torch.empty(blocks.rows, dtype=torch.long)
    order = torch.tensor(blocks.order) if blocks.order is not None else torch.arange(blocks.rows)
    for k, (start, size) in enumerate(zip(blocks.starts(), blocks.sizes)):
        block_of[order[start:start + size]] = k
    mine = block_of[local_rows]
    runs: Dict[Tuple[int, float], List[int]] = {}
    for k in mine.unique().tolist():
        runs.setdefault((blocks.sizes[k], blocks.scales[k]), []).append(k)
    return [(size, scale, torch.isin(mine, torch.tensor(ks)).nonzero().flatten())
            for (size, scale), ks in runs.items()]


def gram_parts(blocks: Optional[RowBlocks], held_rows: Optional[torch.Tensor], rows: int,
               cols: int) -> List[Tuple[Optional[torch.Tensor], Optional[torch.Tensor], Tuple[int, int]]]:
    """The matrices a shard orthogonalizes in place (split_matrices="in_place"), in block order, the same on every
    rank: [(its local rows, or None for all; its positions along a row split within the block, or None for
    the shard's own; the block's whole shape)]. `held_rows`: the global rows a row-split shard holds, in local
    order (None: the shard holds every row)."""
    if blocks is None:
        return [(None, None, (rows, cols))]
    order = torch.tensor(blocks.order) if blocks.order is not None else torch.arange(rows)
    out = []
    for start, size in zip(blocks.starts(), blocks.sizes):
        block_rows = order[start:start + size]
        if held_rows is None:
            out.append((block_rows, None, (size, cols)))
            continue
        position = torch.full((rows,), -1, dtype=torch.long)
        position[block_rows] = torch.arange(size)
        in_block = position[held_rows]
        local = (in_block >= 0).nonzero().flatten()
        along = in_block[local]
        keep = along.argsort()  # the block's rows in block order, as the whole block lists them
        out.append((local[keep], along[keep], (size, cols)))
    return out
