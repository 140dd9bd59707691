"""The one place where a param group's settings become an op's arguments
(docs/design.md, "Group settings and op arguments").

Every runner (resident, staged, the DTensor exchange, the TP Gram form)
calls the ops of muon_ext.ops with keyword arguments built here, so a group
key is read in one module: a new setting is added here once, and every path
honours it alike. A Muon work item may carry a row block's lr scale
(`row_block_scales`): `block_lr_and_decay` applies it.
"""

from __future__ import annotations

from typing import Any, Dict

__all__ = ["adamw", "muon_step", "muon_momentum", "muon_orthogonalize", "muon_apply", "polar_iterations",
           "block_lr_and_decay"]


def block_lr_and_decay(lr, weight_decay: float, block_scale: float = 1.0):
    """A row block's (lr, weight_decay) under its `row_block_scales` entry: the update scales by the block's
    factor and the decay by its inverse, so that the decay step lr * weight_decay stays the group's."""
    if block_scale == 1.0:
        return lr, weight_decay
    return lr * block_scale, weight_decay / block_scale


def adamw(group: dict) -> Dict[str, Any]:
    """`ops.adamw_step`'s settings."""
    beta1, beta2 = group["betas"]
    return dict(lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
                adam_w_mode=group["adam_w_mode"], bias_correction=group["bias_correction"])


def muon_momentum(group: dict) -> Dict[str, Any]:
    """Muon phase 1 (`ops.muon_momentum`)."""
    return dict(momentum=group["momentum"], nesterov=group["nesterov"])


def polar_iterations(group: dict) -> Dict[str, Any]:
    """The Polar-Express iterations every phase-2 path runs: coefficients, count, rounding and method."""
    return dict(ns_steps=group["ns_steps"], ns_coefficients=group["ns_coefficients"],
                polar_dtype=group["polar_dtype"], polar_method=group["polar_method"])


def muon_orthogonalize(group: dict) -> Dict[str, Any]:
    """Muon phase 2 (`ops.muon_orthogonalize`): the iterations and NorMuon's beta2."""
    return dict(beta2=group["beta2"], **polar_iterations(group))


def muon_apply(group: dict, block_scale: float = 1.0) -> Dict[str, Any]:
    """Muon phase 3 (`ops.muon_apply`), for a row block of `block_scale` (1: the whole matrix)."""
    lr, weight_decay = block_lr_and_decay(group["lr"], group["weight_decay"], block_scale)
    return dict(lr=lr, weight_decay=weight_decay, lr_scale=group["lr_scale"])


def muon_step(group: dict, block_scale: float = 1.0) -> Dict[str, Any]:
    """The fused step (`ops.muon_step`): the three phases' settings together."""
    return dict(**muon_momentum(group), **muon_orthogonalize(group), **muon_apply(group, block_scale))
