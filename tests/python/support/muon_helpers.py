"""Test helpers for the Muon kernel: buckets in every master mode."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List

import torch

from support.helpers import MASTER_MODES


@dataclass
class MuonSet:
    params: List[torch.Tensor]
    momentum_buffers: List[torch.Tensor]
    second_momentum_buffers: List[torch.Tensor]
    masters: List[torch.Tensor] = field(default_factory=list)

    def tensors(self):
        return self.params + self.momentum_buffers + self.second_momentum_buffers + self.masters

    def args(self, grads):
        return (self.params, grads, self.momentum_buffers, self.second_momentum_buffers)

    def kwargs(self):
        return dict(masters=self.masters)

    def clone(self) -> "MuonSet":
        return MuonSet(*[[t.clone() for t in ts] for ts in
                         (self.params, self.momentum_buffers, self.second_momentum_buffers, self.masters)])

    def to(self, device) -> "MuonSet":
        return MuonSet(*[[t.to(device) for t in ts] for ts in
                         (self.params, self.momentum_buffers, self.second_momentum_buffers, self.masters)])


def stat_shape(shape):
    rows, cols = shape[-2], shape[-1]
    return (*shape[:-2], rows, 1) if rows >= cols else (*shape[:-2], 1, cols)


def make_muon_set(shapes, mode="fp32", normuon=True, seed=0, init=None) -> MuonSet:
    param_dtype, master_dtype = MASTER_MODES[mode]
    gen = torch.Generator().manual_seed(seed)
    values = init if init is not None else [torch.randn(s, generator=gen) * 0.1 for s in shapes]
    params = [v.to(param_dtype) for v in values]
    if master_dtype is torch.float32:
        masters = [p.float() for p in params]
    elif master_dtype is torch.int16:
        masters = [torch.zeros(p.shape, dtype=torch.int16) for p in params]
    else:
        masters = []
    moms = [torch.zeros(p.shape) for p in params]
    smbs = [torch.zeros(stat_shape(p.shape)) for p in params] if normuon else []
    return MuonSet(params, moms, smbs, masters)


def make_muon_grads(shapes, dtype=torch.float32, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen).to(dtype) for s in shapes]


def assert_close_except_cautious_flips(actual, expected, *, atol, flip_bound, max_flip_fraction=1e-5):
    """Params of two Muon implementations agree to `atol`, except where the
    cautious mask (X * p >= 0) came out differently: there X is within rounding
    of 0, so one side decayed the element and the other did not. Such elements
    may differ by up to `flip_bound` (the decay terms of the steps taken) and
    must be rare; on small matrices `max_flip_fraction` allows none."""
    diff = (actual.float() - expected.float()).abs()
    flips = int((diff > atol).sum())
    assert flips <= int(max_flip_fraction * diff.numel()), f"{flips} elements differ by more than {atol}"
    assert diff.max().item() <= flip_bound, f"max |diff| {diff.max().item()} above the decay bound {flip_bound}"
