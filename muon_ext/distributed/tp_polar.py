"""Polar-Express on a matrix split over a process group, without gathering it
(tensor-parallel Muon, "distributed" mode; docs/design.md, "Megatron-Core
adapter"). A process-group function: it knows nothing of DTensors or trainers.

Each rank holds one shard X_r of the whole matrix X (rows x cols): a block of
columns (`shard_dim=1`, X = [X_0 | X_1 | ...]) or of rows (`shard_dim=0`).
Every iteration needs only a small Gram matrix, which is the sum of the
shards' products, so one all_reduce of it per iteration replaces a gather:

  shard_dim=1:  A = X X^T = sum_r X_r X_r^T  (rows x rows);  X_r = a X_r + B X_r
  shard_dim=0:  A = X^T X = sum_r X_r^T X_r  (cols x cols);  X_r = a X_r + X_r B
  with B = b A + c A A, the same on every rank.

Both forms equal the whole-matrix iteration (X(aI + bX^TX + c(X^TX)^2) =
(aI + bXX^T + c(XX^T)^2)X), whatever the orientation the single-device kernel
picks; they differ from it by FP32 rounding only (the GEMMs here are FP32,
and the sums run over different partitions). The input scale uses the whole
matrix's Frobenius norm (one more all_reduce of the shards' sums of squares, in
double). `normuon_sharded` then applies NorMuon with the whole matrix's
statistics (an all_reduce of per-row or per-column partial sums, or of the
shards' own entries).
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from .._shapes import stats_per_row

__all__ = ["polar_express_sharded", "normuon_sharded"]


def polar_express_sharded(update: torch.Tensor, group, shard_dim: int, coefficients: Sequence[Sequence[float]],
                          ns_steps: int) -> int:
    """Orthogonalizes, in place, this rank's FP32 shard `update` of a matrix split
    along `shard_dim` (0: rows, 1: columns) over `group` (or a batch
    [n, rows, cols] of such shards: one all_reduce per iteration for all of
    them): input scale by the whole matrix's norm, then `ns_steps`
    Polar-Express iterations with `coefficients`. Collective: every rank of
    `group` calls it with its shard of the same matrices. Returns the bytes
    this rank sent (all_reduce payloads)."""
    if shard_dim not in (0, 1):
        raise ValueError(f"polar_express_sharded: shard_dim must be 0 or 1, got {shard_dim!r}")
    if update.dim() not in (2, 3) or update.dtype != torch.float32:
        raise TypeError(f"polar_express_sharded: update must be a 2-D (or batched 3-D) float32 tensor, got "
                        f"{update.dtype} {tuple(update.shape)}")
    if not 0 <= ns_steps <= len(coefficients):
        raise ValueError(f"polar_express_sharded: ns_steps={ns_steps} with {len(coefficients)} coefficient tuples")
    sum_sq = update.double().pow(2).sum(dim=(-2, -1), keepdim=True)
    dist.all_reduce(sum_sq, group=group)
    sent = sum_sq.numel() * sum_sq.element_size()
    norm = torch.sqrt(sum_sq.float())
    x = update * (1.0 / (norm * 1.02 + 1e-6))
    for a, b, c in coefficients[:ns_steps]:
        gram = x @ x.mT if shard_dim == 1 else x.mT @ x
        dist.all_reduce(gram, group=group)
        sent += gram.numel() * gram.element_size()
        poly = b * gram + c * (gram @ gram)
        x = a * x + (poly @ x if shard_dim == 1 else x @ poly)
    update.copy_(x)
    return sent


def normuon_sharded(update: torch.Tensor, stats: torch.Tensor, beta2: float, group, shard_dim: int,
                    index: torch.Tensor, shape: Sequence[int], stats_local: bool) -> int:
    """NorMuon on this rank's FP32 shard `update` (orthogonalized, in place) of a
    matrix of `shape` split along `shard_dim` over `group`, with the whole
    matrix's statistics (one per row if rows >= cols, else per column; the
    formula of docs/design.md, "Muon in three phases"). `index`: the positions
    along `shard_dim` this shard holds. `stats`: the statistics as the caller
    keeps them, in place: the whole [rows, 1] / [1, cols] (the same on every
    rank, and kept so), or (`stats_local`, statistics following the split dim)
    this rank's entries only. Collective; returns the bytes this rank sent."""
    rows, cols = shape
    per_row = stats_per_row(rows, cols)
    reduced = cols if per_row else rows
    stat_dim = 0 if per_row else 1
    partial = (update.double() ** 2).sum(dim=1 - stat_dim)  # per held entry along stat_dim
    sent = 0
    held = None  # positions of the multipliers this shard needs, when the statistics are whole
    if stat_dim != shard_dim:  # the reduced dim is split: the shards' partial sums add up
        dist.all_reduce(partial, group=group)
        sent += partial.numel() * partial.element_size()
        vm = partial.float() / reduced
    else:
        vm = partial.float() / reduced  # whole sums of this shard's own entries
        if stats_local:
            smb = stats.view(-1)
            smb.copy_(torch.lerp(smb, vm, 1.0 - beta2))
            s = 1.0 / torch.sqrt(torch.clamp_min(smb, 1e-10))
            sums = torch.stack([vm.double().sum(), (vm * reduced * s * s).double().sum()])
            dist.all_reduce(sums, group=group)
            sent += sums.numel() * sums.element_size()
            n0, n1 = torch.sqrt(sums[0].float() * reduced), torch.sqrt(sums[1].float())
            _scale(update, s * (n0 / torch.clamp_min(n1, 1e-10)), stat_dim)
            return sent
        whole = torch.zeros(rows if per_row else cols, dtype=torch.float32, device=update.device)
        whole[index] = vm
        dist.all_reduce(whole, group=group)  # one owner per entry: the sum is exact
        sent += whole.numel() * whole.element_size()
        vm, held = whole, index
    smb = stats.view(-1)
    smb.copy_(torch.lerp(smb, vm, 1.0 - beta2))
    s = 1.0 / torch.sqrt(torch.clamp_min(smb, 1e-10))
    n0 = torch.sqrt(vm.sum() * reduced)
    n1 = torch.sqrt(((vm * reduced) * s * s).sum())
    multiplier = s * (n0 / torch.clamp_min(n1, 1e-10))
    _scale(update, multiplier if held is None else multiplier[held], stat_dim)
    return sent


def _scale(update: torch.Tensor, multiplier: torch.Tensor, stat_dim: int) -> None:
    update.mul_(multiplier.view(-1, 1) if stat_dim == 0 else multiplier.view(1, -1))
