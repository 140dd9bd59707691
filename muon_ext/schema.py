"""The param-group schema: defaults, the accepted ranges and modes, and every
check of a setting.

Ranges and mode names are not written here: they are read from the C++ table
(csrc/common/schema.h, through `_C.schema()`) that the kernels' own checks use,
so Python and C++ cannot accept different values.
"""

from __future__ import annotations

import math
import struct
from typing import Dict, List, NamedTuple, Optional, Tuple

import torch

from . import _C, op_arguments, ops, row_blocks
from ._types import Kind

__all__ = [
    "MUON_DEFAULTS", "ADAMW_DEFAULTS", "DEFAULTS", "SUPPORTED_DTYPES", "Range", "RANGES", "MODES",
    "label", "check_hyper", "check_lr", "check_lr_value", "check_block_scales", "check_options", "new_group",
]

MUON_DEFAULTS = {
    "lr": 1e-3,
    "weight_decay": 0.1,
    "momentum": 0.95,
    "nesterov": True,
    "beta2": 0.95,
    "ns_steps": 5,
    "ns_coefficients": ops.POLAR_EXPRESS_COEFFICIENTS,
    "lr_scale": "original",
    "matrix_view": "error",
    "polar_dtype": "bfloat16",
    "polar_method": "standard",
}
ADAMW_DEFAULTS = {
    "lr": 1e-3,
    "betas": (0.9, 0.999),
    "eps": 1e-8,
    "weight_decay": 0.01,
    "adam_w_mode": True,
    "bias_correction": True,
}
DEFAULTS: Dict[Kind, dict] = {"muon": MUON_DEFAULTS, "adamw": ADAMW_DEFAULTS}
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class Range(NamedTuple):
    """Finite values in [low, high) ([low, high] if high_inclusive); ints only (not bools) if integer."""

    low: float
    high: float
    high_inclusive: bool
    integer: bool

    def admits(self, value) -> bool:
        """Whether `value` is in range; a real must be, both as given and rounded
        to float32 (the kernels compute in FP32: a beta just below 1 rounds to 1)."""
        if self.integer:
            return isinstance(value, int) and not isinstance(value, bool) and self._in_bounds(value)
        return self._in_bounds(value) and self._in_bounds(_to_float32(value))

    def _in_bounds(self, value) -> bool:
        if value != value or value in (math.inf, -math.inf) or value < self.low:  # NaN, inf
            return False
        return value <= self.high if self.high_inclusive else value < self.high

    def describe(self) -> str:
        """The range for messages: 'in [0.0, 1.0)', 'an int >= 0', 'positive (an int)'."""
        close = "]" if self.high_inclusive else ")"
        if not self.integer:
            return f"in [{self.low}, {self.high}{close}"
        if math.isinf(self.high):
            return "positive (an int)" if self.low == 1 else f"an int >= {int(self.low)}"
        return f"an int in [{int(self.low)}, {int(self.high)}{close}"


def _to_float32(value) -> float:
    """`value` rounded to float32 (as a C cast: inf where it overflows)."""
    try:
        return struct.unpack("f", struct.pack("f", float(value)))[0]
    except OverflowError:
        return math.inf if value > 0 else -math.inf


def _read_table() -> Tuple[Dict[Tuple[str, str], Range], Dict[str, Tuple[str, ...]]]:
    table = _C.schema()
    ranges = {(kind, name): Range(float(low), float(high), bool(inclusive), bool(integer))
              for kind, name, low, high, inclusive, integer in table["ranges"]}
    modes = {name: tuple(values) for name, values in table["modes"].items()}
    return ranges, modes


# (kind, name) -> Range, kind "adamw" | "muon" | "optimizer"; mode -> its accepted strings.
RANGES, MODES = _read_table()


def label(group: int, kind: str, index: int, name: Optional[str]) -> str:
    """How messages name a param: 'param group 1 (muon), param 3 'layers.0.w''."""
    return f"param group {group} ({kind}), param {index}" + (f" '{name}'" if name else "")


def _is_real(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_range(where: str, name: str, value, kind: str, key: Optional[str] = None) -> None:
    """`value` in the table's range for (kind, key or name); messages name it `name`."""
    r = RANGES[(kind, key or name)]
    if not r.integer and not _is_real(value):
        raise TypeError(f"{where}{name} must be a number, got {type(value).__name__}")
    if not r.admits(value):
        raise ValueError(f"{where}{name} must be {r.describe()}, got {value!r}")


def _check_mode(where: str, mode: str, value) -> None:
    values = MODES[mode]
    if value in values:
        return
    choices = ", ".join(repr(v) for v in values[:-1]) + f" or {values[-1]!r}"
    raise ValueError(f"{where}unknown {mode} {value!r} ({mode} must be {choices})")


def _check_bool(where: str, name: str, value) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{where}{name} must be True or False, got {value!r}")


def check_lr(where: str, lr, kind: str) -> None:
    """A float lr in the kind's range, or a one-element float32 tensor (its value is checked where it is read)."""
    if isinstance(lr, torch.Tensor):
        if lr.dtype != torch.float32 or lr.numel() != 1:
            raise TypeError(f"{where}a tensor lr must hold one float32 element, got {lr.dtype} "
                            f"with {lr.numel()} elements")
        return
    _check_range(where, "lr", lr, kind)


def check_lr_value(where: str, value: float, kind: str, group: Optional[dict] = None) -> None:
    """A host lr value (read from a CPU lr tensor) in the kind's range; with its `group`, also the lr of each
    row block (`check_block_scales`)."""
    r = RANGES[(kind, "lr")]
    if not r.admits(value):
        raise ValueError(f"{where}lr must be finite and {r.describe()}, got {value}")
    if group is not None:
        check_block_scales(where, group, value)


def check_block_scales(where: str, group: dict, lr: float) -> None:
    """row_block_scales multiply a block's lr and divide its weight decay (op_arguments.block_lr_and_decay): each block's lr
    and weight decay must be in the kernels' ranges. The lr and weight decay are per-step settings (schedulers
    edit them), so the planner checks the products at every step, for every group, before any write
    (docs/design.md, "Row blocks"); else the kernel refused a huge product after other params, and the
    param's earlier blocks, were written."""
    scales = group.get("row_block_scales")
    if group.get("kind") != "muon" or group.get("row_blocks") is None or not isinstance(scales, (tuple, list)):
        return
    for k, scale in enumerate(scales):
        block_lr, block_decay = op_arguments.block_lr_and_decay(lr, group["weight_decay"], float(scale))
        for name, value in (("lr", block_lr), ("weight_decay", block_decay)):
            r = RANGES[("muon", name)]
            if not r.admits(value):
                raise ValueError(f"{where}row_block_scales[{k}]={scale!r} gives row block {k} a {name} of {value:.6g} "
                                 f"({name} {'times' if name == 'lr' else 'divided by'} the scale), outside the "
                                 f"kernels' range {r.describe()} (float32)")


def check_hyper(index: int, group: dict) -> None:
    """Every group setting the kernels read, checked up front: at construction,
    on loaded groups and at each step (schedulers and users edit groups), so a
    bad value raises before any param is touched."""
    kind = group["kind"]
    where = f"param group {index} ({kind}): "
    check_lr(where, group["lr"], kind)
    _check_range(where, "weight_decay", group["weight_decay"], kind)
    if kind == "adamw":
        betas = group["betas"]
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise TypeError(f"{where}betas must be a pair (beta1, beta2), got {betas!r}")
        _check_range(where, "betas[0]", betas[0], kind, "beta1")
        _check_range(where, "betas[1]", betas[1], kind, "beta2")
        _check_range(where, "eps", group["eps"], kind)
        _check_bool(where, "adam_w_mode", group["adam_w_mode"])
        _check_bool(where, "bias_correction", group["bias_correction"])
        for flag in ("amsgrad", "maximize"):
            if group.get(flag):
                raise ValueError(f"{where}{flag}=True is not supported (it changes the AdamW update)")
        return
    _check_mode(where, "matrix_view", group["matrix_view"])
    _check_mode(where, "lr_scale", group["lr_scale"])
    _check_mode(where, "polar_dtype", group["polar_dtype"])
    _check_mode(where, "polar_method", group["polar_method"])
    _check_range(where, "momentum", group["momentum"], kind)
    _check_bool(where, "nesterov", group["nesterov"])
    if group["beta2"] is not None:  # None: NorMuon off
        _check_range(where, "beta2", group["beta2"], kind)
    coefficients = group["ns_coefficients"]
    if not isinstance(coefficients, (tuple, list)) or not all(
            isinstance(abc, (tuple, list)) and len(abc) == 3 and all(_is_real(v) and math.isfinite(v) for v in abc)
            for abc in coefficients):
        raise ValueError(f"{where}ns_coefficients must be a list of finite (a, b, c) triples")
    ns_steps = group["ns_steps"]
    _check_range(where, "ns_steps", ns_steps, kind)
    if ns_steps > len(coefficients):
        raise ValueError(f"{where}ns_steps={ns_steps} but only {len(coefficients)} coefficient tuples")
    _check_row_blocks(where, group)
    if group.get("split_matrices", "gather") not in SPLIT_MATRICES:
        raise ValueError(f"{where}split_matrices must be one of {SPLIT_MATRICES}, got {group['split_matrices']!r}")
    if group.get("split_matrices") == "in_place" and group["polar_method"] != "standard":
        raise ValueError(f"{where}polar_method={group['polar_method']!r} with split_matrices='in_place': matrices "
                         "split over ranks are orthogonalized on their shards by the standard iteration (one Gram "
                         "all_reduce per iteration); set polar_method='standard', or split_matrices='gather' to "
                         "orthogonalize each matrix whole on one rank")


# How a DTensor Muon matrix split over one mesh dim is orthogonalized (optional key, absent = "gather"):
# gathered whole at an owner rank, or in place on its shards by Gram all_reduces (distributed/tp_polar.py;
# in polar_dtype, polar_method "standard" only).
SPLIT_MATRICES = ("gather", "in_place")
# The key's earlier name and values, still accepted (groups and checkpoints of earlier versions).
_LEGACY_SPLIT_POLAR = {"exchange": "gather", "gram": "in_place"}


def rename_legacy_keys(where: str, group: dict) -> None:
    """A group (or a saved group) written with earlier key names, in place under today's: `split_polar`
    ("exchange" / "gram") is `split_matrices` ("gather" / "in_place")."""
    if "split_polar" not in group:
        return
    value = group.pop("split_polar")
    if value not in _LEGACY_SPLIT_POLAR:
        raise ValueError(f"{where}split_polar (now split_matrices) must be one of {tuple(_LEGACY_SPLIT_POLAR)}, "
                         f"got {value!r}")
    group.setdefault("split_matrices", _LEGACY_SPLIT_POLAR[value])


def _check_row_blocks(where: str, group: dict) -> None:
    """row_blocks (optional Muon key, absent = None): None, contiguous sizes or index blocks of every param's
    matrix rows (muon_ext.row_blocks; under matrix_view, global rows for a DTensor); each block is
    orthogonalized as a matrix of its own, with its own lr scale."""
    blocks, scales = group.get("row_blocks"), group.get("row_block_scales")
    row_blocks.check(blocks, None, where, scales)  # the form alone, also for a group without params
    if blocks is None:
        return
    for i, p in enumerate(group.get("params", ())):
        if not isinstance(p, torch.Tensor) or p.dim() < 2:
            continue  # refused elsewhere, by name
        if p.dim() > 2 and group["matrix_view"] == "batch":
            raise ValueError(f"{where}row_blocks: param {i} is a batch of matrices (matrix_view='batch'); row_blocks "
                             "takes params that are one matrix each")
        row_blocks.check(blocks, p.shape[0], where, scales)


def check_options(master_weights, grad_attr, max_workspace_bytes) -> None:
    """The optimizer's constructor arguments."""
    if master_weights not in ("auto", True, False):
        raise ValueError(f"master_weights must be 'auto', True or False, got {master_weights!r}")
    _check_mode("", "grad_attr", grad_attr)
    _check_range("", "max_workspace_bytes", max_workspace_bytes, "optimizer")


def new_group(index: int, param_group: dict) -> Tuple[dict, List[Optional[str]]]:
    """A copy of `param_group` with its params as a list and its kind's defaults
    filled in, and the params' names (None where unnamed). Checks the shape of
    the group only; `param_rules.check_group` checks its settings and params."""
    group = dict(param_group)
    kind = group.get("kind")
    if kind not in DEFAULTS:
        raise ValueError(f"param group {index}: unknown kind {kind!r}; expected 'muon' or 'adamw'")
    if "params" not in group:
        raise ValueError(f"param group {index} has no 'params'")
    params = group["params"]
    if isinstance(params, (set, frozenset)) or params is None:
        raise TypeError(f"param group {index}: params must be an ordered sequence (a set's order varies "
                        f"between runs), got {type(params).__name__}")
    params = [params] if isinstance(params, torch.Tensor) else list(params)
    names = list(group.get("param_names", [])) or [None] * len(params)
    if len(names) != len(params):
        raise ValueError(f"param group {index}: {len(names)} param_names for {len(params)} params")
    rename_legacy_keys(f"param group {index}: ", group)
    for key, value in DEFAULTS[kind].items():
        group.setdefault(key, value)
    group["params"] = params
    return group, names
