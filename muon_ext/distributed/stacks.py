"""The matrices of local tensors, as the Muon exchange takes them: one 2-D
view per matrix, so a stack of matrices (`matrix_view="batch"`, MoE experts
`[E, rows, cols]`) spreads over the owners expert by expert, as separate
params would (docs/design.md, "Expert stacks")."""

from __future__ import annotations

import math
from typing import List

import torch

__all__ = ["matrices"]


def matrices(tensors: List[torch.Tensor]) -> List[torch.Tensor]:
    """Each tensor's matrices ([..., rows, cols] -> views [rows, cols]; a
    2-D tensor is one), in order. The tensors are contiguous (update buffers,
    checked state), so the views write into them."""
    return [m for t in tensors for m in t.view(math.prod(t.shape[:-2]), *t.shape[-2:]).unbind(0)]
