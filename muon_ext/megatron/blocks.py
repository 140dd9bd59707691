"""Muon params the adapter steps itself, block by block (docs/design.md,
"Megatron-Core adapter"): TP shards in "distributed" mode, and the fused QKV
weight under `muon_split_qkv`.

The inner MuonAdamW owns such a param's state (momentum, remainders: so
checkpoints, update_param and masters work as for any param) but never steps
it (its tensor there has no main_grad). Here: phase 1 (momentum) on the local
tensor, then each row block (index set of local rows) is orthogonalized as one
matrix, then phase 3 per block with that block's lr factor. How a block's
matrix is formed when the param is TP-split on dim 0 (a shard holds whole
query groups, so a block's local rows are the rank's part of the whole
block): "local" alone (blockwise), "gather" all_gathered over the TP group and
orthogonalized whole (duplicated: TP=1's bits), "gram" through
tp_polar's Gram all_reduce (distributed).
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch
import torch.distributed as dist

from .. import ops
from ..distributed.tp_polar import polar_express_sharded

__all__ = ["BlockStep", "qkv_row_blocks"]


def qkv_row_blocks(rows: int, split_shapes: Sequence[int]) -> List[torch.Tensor]:
    """Megatron's interleaved fused QKV: per query group `split_shapes` = (q, k, v)
    rows; one index tensor of local rows per part (Q of every group, then K, then V)."""
    per_group = sum(split_shapes)
    if rows % per_group:
        raise ValueError(f"muon_ext.megatron: a linear_qkv weight of {rows} rows does not hold whole query groups "
                         f"of {per_group} rows ({tuple(split_shapes)})")
    groups = rows // per_group
    blocks, start = [], 0
    for size in split_shapes:
        index = (torch.arange(groups).unsqueeze(1) * per_group + start + torch.arange(size)).reshape(-1)
        blocks.append(index)
        start += size
    return blocks


class BlockStep:
    """One hand-stepped Muon param: `tensor` (the inner optimizer's, sharing the
    model param's storage), its row `blocks` (None: the whole local tensor),
    `mode` ("local", "gather", "gram"), the TP group and split dim where split."""

    def __init__(self, name: str, param: torch.nn.Parameter, tensor: torch.Tensor,
                 blocks: List[Optional[torch.Tensor]], mode: str, tp_group=None, partition_dim: Optional[int] = None):
        if mode != "local" and tp_group is None:
            raise ValueError(f"{name}: mode {mode!r} needs a TP group")
        if blocks != [None] and partition_dim not in (None, 0):
            raise ValueError(f"{name}: row blocks of a param split on dim {partition_dim} are not supported")
        self.name, self.param, self.tensor = name, param, tensor
        self.blocks, self.mode, self.tp_group, self.partition_dim = blocks, mode, tp_group, partition_dim

    def block_shapes(self) -> List[tuple]:
        """Shape of each block's orthogonalized matrix (the whole block across TP unless "local")."""
        rows, cols = self.tensor.shape
        tp = 1 if self.mode == "local" or self.tp_group is None else self.tp_group.size()
        shapes = []
        for index in self.blocks:
            r, c = (rows if index is None else index.numel()), cols
            if self.partition_dim == 1:
                c *= tp
            else:
                r *= tp
            shapes.append((r, c))
        return shapes

    def step(self, state: dict, group: dict, factors: Sequence[float]) -> None:
        grad = getattr(self.param, "main_grad", None)
        if grad is None:
            return
        update = torch.empty(self.tensor.shape, dtype=torch.float32, device=self.tensor.device)
        ops.muon_momentum([grad], [state["momentum_buffer"]], [update], momentum=group["momentum"],
                          nesterov=group["nesterov"])
        master = state.get("master_param")
        for index, factor in zip(self.blocks, factors):
            block = update if index is None else update[index]
            block = self._orthogonalize(block.contiguous(), group)
            lr, wd = group["lr"] * factor, group["weight_decay"] / factor
            if index is None:
                ops.muon_apply([self.tensor], [block], masters=[master] if master is not None else [], lr=lr,
                               weight_decay=wd, lr_scale="none")
                continue
            rows, rows_master = self.tensor[index], (master[index] if master is not None else None)
            ops.muon_apply([rows], [block], masters=[rows_master] if master is not None else [], lr=lr,
                           weight_decay=wd, lr_scale="none")
            self.tensor[index] = rows
            if master is not None:
                master[index] = rows_master
        torch.autograd.graph.increment_version(self.param)

    def _orthogonalize(self, block: torch.Tensor, group: dict) -> torch.Tensor:
        if self.mode == "gram":
            polar_express_sharded(block, self.tp_group, self.partition_dim, group["ns_coefficients"],
                                  group["ns_steps"])
            return block
        whole = block
        if self.mode == "gather":
            parts = [torch.empty_like(block) for _ in range(self.tp_group.size())]
            dist.all_gather(parts, block, group=self.tp_group)
            whole = torch.cat(parts, dim=self.partition_dim)
        whole = whole.unsqueeze(0)
        ops.muon_orthogonalize([whole], beta2=None, ns_steps=group["ns_steps"],
                               ns_coefficients=group["ns_coefficients"], polar_dtype=group["polar_dtype"])
        if self.mode != "gather":
            return whole[0]
        return whole[0].chunk(self.tp_group.size(), dim=self.partition_dim)[self.tp_group.rank()].contiguous()
