"""Megatron-Core's OptimizerConfig read as MuonAdamW settings (no megatron import).

Muon's update scale (`muon_scale_mode`, `muon_extra_scale_factor`) is folded
into each inner group's lr, and its weight decay divided by the same factor,
so that the decay stays `lr * weight_decay` as in Megatron's decoupled decay
(docs/design.md, "Megatron-Core adapter").
"""

from __future__ import annotations

import math
from types import MappingProxyType
from typing import Tuple

__all__ = ["TP_MODES", "SCALE_MODES", "MATCH_RMS_ADAMW", "check_config", "muon_scale", "muon_settings",
           "polar_dtype"]

TP_MODES = ("blockwise", "duplicated", "distributed")
SCALE_MODES = ("spectral", "unit_rms_norm", "shape_scaling")
# OptimizerConfig fields under which Megatron's one `lr` and `weight_decay` serve both kinds: Muon updates
# 0.2 * sqrt(max(rows, cols)) * lr, AdamW's update RMS (as MuonAdamW's lr_scale="match_rms_adamw"; decay
# lr * weight_decay as Megatron's). Megatron's own defaults (spectral, 1.0) give updates of RMS lr, 5x that.
# docs/megatron.md, "One learning rate".
MATCH_RMS_ADAMW = MappingProxyType({"muon_scale_mode": "spectral", "muon_extra_scale_factor": 0.2})
_PRECISIONS = ("highest", "high", "medium")


def check_config(config) -> None:
    """Refuses what the adapter does not do, before anything is built."""
    if getattr(config, "use_distributed_optimizer", False):
        raise ValueError("muon_ext.megatron: use_distributed_optimizer=True is not supported (Megatron's own Muon "
                         "refuses it too); build the model's DDP with use_distributed_optimizer=False")
    if config.fp16 and config.bf16:
        raise ValueError("muon_ext.megatron: OptimizerConfig has both fp16 and bf16 set")
    if config.muon_tp_mode not in TP_MODES:
        raise ValueError(f"muon_ext.megatron: muon_tp_mode must be one of {TP_MODES}, got {config.muon_tp_mode!r}")
    if config.muon_scale_mode not in SCALE_MODES:
        raise ValueError(f"muon_ext.megatron: muon_scale_mode must be one of {SCALE_MODES}, got "
                         f"{config.muon_scale_mode!r}")
    if config.muon_fp32_matmul_prec not in _PRECISIONS:
        raise ValueError(f"muon_ext.megatron: muon_fp32_matmul_prec must be one of {_PRECISIONS}, got "
                         f"{config.muon_fp32_matmul_prec!r}")
    if not (isinstance(config.muon_num_ns_steps, int) and config.muon_num_ns_steps >= 1):
        raise ValueError(f"muon_ext.megatron: muon_num_ns_steps must be an int >= 1, got {config.muon_num_ns_steps!r}")
    factor = config.muon_extra_scale_factor
    if not (isinstance(factor, (int, float)) and math.isfinite(factor) and factor > 0):
        raise ValueError(f"muon_ext.megatron: muon_extra_scale_factor must be a positive number, got {factor!r}")
    if getattr(config, "use_precision_aware_optimizer", False):
        raise ValueError("muon_ext.megatron: use_precision_aware_optimizer is not supported (MuonAdamW keeps its "
                         "own masters: BF16 params + int16 remainders)")


def muon_scale(rows: int, cols: int, mode: str, extra: float) -> float:
    """Megatron's (emerging_optimizers') update scale for a rows x cols matrix, times `extra`."""
    if mode == "spectral":
        scale = max(rows, cols) ** 0.5
    elif mode == "unit_rms_norm":
        scale = (rows / cols) ** 0.5
    else:  # shape_scaling
        scale = max(1.0, rows / cols) ** 0.5
    return scale * extra


def polar_dtype(precision: str) -> str:
    """muon_fp32_matmul_prec -> MuonAdamW's polar_dtype: 'highest' keeps FP32 GEMMs, else BF16."""
    return "float32" if precision == "highest" else "bfloat16"


def muon_settings(config, beta2, ns_coefficients) -> dict:
    """The Muon group keys MuonAdamW takes, from the config (lr and weight decay are set per step)."""
    settings = dict(momentum=config.muon_momentum, nesterov=bool(config.muon_use_nesterov), beta2=beta2,
                    ns_steps=config.muon_num_ns_steps, lr_scale="none", matrix_view="error",
                    polar_dtype=polar_dtype(config.muon_fp32_matmul_prec))
    if ns_coefficients is not None:
        settings["ns_coefficients"] = ns_coefficients
    return settings


def adamw_settings(config) -> dict:
    return dict(betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps, adam_w_mode=True,
                bias_correction=True)


def lr_and_decay(outer_lr: float, outer_wd: float, factor: float) -> Tuple[float, float]:
    """The inner group's (lr, weight_decay) for Megatron's (lr, wd) and a Muon update factor:
    lr * factor scales the update, wd / factor keeps the decay at lr * wd."""
    return outer_lr * factor, outer_wd / factor
