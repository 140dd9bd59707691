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
double). NorMuon's statistics are not computed here.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

__all__ = ["polar_express_sharded"]


def polar_express_sharded(update: torch.Tensor, group, shard_dim: int, coefficients: Sequence[Sequence[float]],
                          ns_steps: int) -> int:
    """Orthogonalizes, in place, this rank's FP32 shard `update` of a matrix split
    along `shard_dim` (0: rows, 1: columns) over `group`: input scale by the
    whole matrix's norm, then `ns_steps` Polar-Express iterations with
    `coefficients`. Collective: every rank of `group` calls it with its shard of
    the same matrix. Returns the bytes this rank sent (all_reduce payloads)."""
    if shard_dim not in (0, 1):
        raise ValueError(f"polar_express_sharded: shard_dim must be 0 or 1, got {shard_dim!r}")
    if update.dim() != 2 or update.dtype != torch.float32:
        raise TypeError(f"polar_express_sharded: update must be a 2-D float32 tensor, got {update.dtype} "
                        f"{tuple(update.shape)}")
    if not 0 <= ns_steps <= len(coefficients):
        raise ValueError(f"polar_express_sharded: ns_steps={ns_steps} with {len(coefficients)} coefficient tuples")
    sum_sq = update.double().pow(2).sum().reshape(1)
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
