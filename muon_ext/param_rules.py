"""Which tensors an optimizer takes as params: checked when a group is added,
before anything is created (the group's settings: muon_ext.schema)."""

from __future__ import annotations

from typing import Container, List, Optional

import torch

from ._shapes import matrix_shape
from ._types import is_dtensor
from .distributed.placements import check_param as check_dtensor_param
from .schema import SUPPORTED_DTYPES, check_hyper, label
from .writers import is_quantized

__all__ = ["check_group"]


def check_group(index: int, group: dict, names: List[Optional[str]], owned: Container[int]) -> None:
    """A new group's settings and params; `owned` holds the ids of params already in the optimizer."""
    kind = group["kind"]
    check_hyper(index, group)
    seen = set()
    for i, p in enumerate(group["params"]):
        where = label(index, kind, i, names[i])
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"{where}: expected a tensor, got {type(p).__name__}")
        if id(p) in owned or id(p) in seen:
            raise ValueError(f"{where} appears in more than one param group (or twice in one)")
        seen.add(id(p))
        _check_param_type(p, where, kind, group.get("matrix_view", ""))
        if not p.is_leaf:
            raise ValueError(f"{where}: can't optimize a non-leaf tensor")
        if not p.is_contiguous():
            raise ValueError(f"{where}: params must be contiguous")
        if kind == "muon":
            matrix_shape(p, group["matrix_view"], where)


def _check_param_type(p: torch.Tensor, where: str, kind: str, matrix_view: str) -> None:
    if is_dtensor(p):
        check_dtensor_param(p, where, kind, matrix_view)
    if not p.dtype.is_floating_point:
        raise TypeError(f"{where} has non-floating dtype {p.dtype}")
    if p.dtype not in SUPPORTED_DTYPES:
        reason = "unsupported dtype"
        if p.element_size() == 1:
            reason = ("plain FP8 params are not supported (use a quantized tensor subclass with dequantize() and "
                      "quantize_(src), or a BF16 param with a param writer)")
        raise TypeError(f"{where} has dtype {p.dtype}: {reason}; supported: float32, bfloat16, float16")
    base = p.data if isinstance(p, torch.nn.Parameter) else p
    if type(base) is not torch.Tensor and not is_quantized(base) and not is_dtensor(base):
        raise TypeError(f"{where} is a {type(base).__name__}: tensor subclasses are supported only as quantized "
                        "params (with dequantize() and quantize_(src) methods)")
