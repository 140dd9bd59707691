"""Helpers shared by the MuonAdamW tests: BF16-representable values, params,
grad sequences, hyperparameters as the ops take them, a hand-stepped Muon bucket."""

import torch

from muon_ext import ops
from support.muon_helpers import stat_shape


def bf16_values(shapes, seed=0, scale=0.1):
    """BF16-representable FP32 values, so BF16 and FP32 runs start from the same masters."""
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(s, generator=gen) * scale).bfloat16().float() for s in shapes]


def as_params(values, dtype=torch.float32):
    return [torch.nn.Parameter(v.clone().to(dtype)) for v in values]


def grad_seq(shapes, steps, seed=100):
    """Per-step FP32 grads, BF16-representable so BF16 params can take them exactly."""
    return [bf16_values(shapes, seed=seed + k, scale=1.0) for k in range(steps)]


def set_grads(params, grads):
    for p, g in zip(params, grads):
        p.grad = None if g is None else g.clone().to(p.dtype)


def muon_hyper(group):
    keys = ("lr", "momentum", "nesterov", "beta2", "weight_decay", "ns_steps", "ns_coefficients", "lr_scale",
            "polar_dtype")
    return {k: group[k] for k in keys}


def adamw_hyper(group):
    beta1, beta2 = group["betas"]
    return dict(lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
                adam_w_mode=group["adam_w_mode"], bias_correction=group["bias_correction"])


class MuonTwin:
    """One bucket of same-shape matrices stepped by ops.muon_step by hand, BF16 + remainders."""

    def __init__(self, values):
        self.params = [v.bfloat16() for v in values]
        self.remainders = [torch.zeros(v.shape, dtype=torch.int16) for v in values]
        self.moms = [torch.zeros(v.shape) for v in values]
        self.smbs = [torch.zeros(stat_shape(v.shape)) for v in values]

    def step(self, grads, **hyper):
        ops.muon_step(self.params, [g.bfloat16() for g in grads], self.moms, self.smbs, masters=self.remainders,
                      **hyper)
