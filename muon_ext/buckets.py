"""Planning a step: buckets of params stepped together, every check that must
pass before the first write, and the step's work items. Writes nothing."""

from __future__ import annotations

from typing import Dict, List, Mapping, Optional, Tuple

import torch

from . import _C
from ._shapes import matrix_shape
from ._types import Bucket, GradAttr, ParamInfo, WorkItem
from .amp import capturing, check_step_lr
from .schema import check_hyper

__all__ = ["StepPlanner"]


class StepPlanner:
    """Turns the groups and grads of a step into work items, one kernel call
    each. Buckets are made once and kept until `invalidate` (groups added or
    loaded); groups edited in place (params, kind, matrix_view) are refused."""

    def __init__(self):
        self._buckets: Optional[List[Bucket]] = None
        self._signature: Tuple = ()

    def invalidate(self) -> None:
        """Re-bucket at the next plan."""
        self._buckets = None

    def plan(self, groups: List[dict], infos: Mapping[int, ParamInfo], grad_attr: GradAttr,
             scaler_attached: bool) -> List[WorkItem]:
        """Checks every group setting and grad, raising before anything is
        written; returns a work item per bucket and grad dtype (params without
        a grad left out). Grads are read from each param's `grad_attr`;
        `scaler_attached`: a GradScaler handed over found_inf."""
        if torch.compiler.is_compiling():
            return self._plan_outside_graph(groups, infos, grad_attr, scaler_attached)
        return self._plan(groups, infos, grad_attr, scaler_attached)

    @torch.compiler.disable
    def _plan_outside_graph(self, *args) -> List[WorkItem]:
        """Under torch.compile: host-side checks (and a pybind call Dynamo
        cannot trace) run eagerly behind a graph break. Not used in eager
        steps, where the disable wrapper would only add overhead."""
        return self._plan(*args)

    def _plan(self, groups: List[dict], infos: Mapping[int, ParamInfo], grad_attr: GradAttr,
              scaler_attached: bool) -> List[WorkItem]:
        if grad_attr == "main_grad" and scaler_attached and all(
                info.param.grad is None for info in infos.values()):
            raise ValueError("torch.amp.GradScaler looks for infs in .grad, and no param has one (this optimizer "
                             "steps on main_grad): an inf would go unnoticed; unscale and check main grads yourself")
        capturing_now = capturing()
        for index, group in enumerate(groups):
            check_hyper(index, group)
            check_step_lr(index, group, capturing_now)
        work = []
        for bucket in self._get_buckets(groups, infos):
            group = groups[bucket.group]
            grads = [getattr(p, grad_attr, None) for p in bucket.params]
            if _check_grads(bucket.params, grads, infos, grad_attr):  # the common case: nothing to sort out
                work.append(WorkItem(bucket, group, bucket.params, grads))
                continue
            by_grad_dtype: Dict[torch.dtype, Tuple[List, List]] = {}
            for p, grad in zip(bucket.params, grads):
                if grad is not None:
                    params, contiguous = by_grad_dtype.setdefault(grad.dtype, ([], []))
                    params.append(p)
                    contiguous.append(grad if grad.is_contiguous() else grad.contiguous())
            work.extend(WorkItem(bucket, group, params, contiguous) for params, contiguous in by_grad_dtype.values())
        return work

    def _get_buckets(self, groups: List[dict], infos: Mapping[int, ParamInfo]) -> List[Bucket]:
        signature = tuple((tuple(id(p) for p in g["params"]), g["kind"], g.get("matrix_view")) for g in groups)
        if self._buckets is not None and signature != self._signature:
            raise ValueError("param_groups were changed in place (params, kind or matrix_view); add params with "
                             "add_param_group, or build a new optimizer")
        if self._buckets is None:
            buckets: Dict[Tuple, Bucket] = {}
            for info in infos.values():
                p, group = info.param, groups[info.group]
                if p.numel() == 0:
                    continue  # nothing to update; the kernels refuse zero-sized matrices
                shape = matrix_shape(p, group["matrix_view"], info.name) if info.kind == "muon" else None
                key = (info.group, p.device, p.dtype, info.master, shape)
                buckets.setdefault(key, Bucket(info.group, info.kind, [])).params.append(p)
            self._buckets = list(buckets.values())
            self._signature = signature
        return self._buckets


def _check_grads(params: List[torch.Tensor], grads: List, infos: Mapping[int, ParamInfo], attr: str) -> bool:
    """Raises, naming the param, unless every param can be stepped with its
    grad (_C.check_bucket_grads); returns whether every grad is present,
    contiguous and of one dtype."""
    try:
        bad, uniform = _C.check_bucket_grads(params, grads)
    except TypeError:  # the binding refuses a grad that is not a tensor
        bad = next((i for i, g in enumerate(grads) if g is not None and not isinstance(g, torch.Tensor)), None)
        if bad is None:
            raise
    if bad >= 0:
        _raise_unsteppable(infos[id(params[bad])].name, params[bad], grads[bad], attr)
    return uniform


def _raise_unsteppable(label: str, p: torch.Tensor, grad, attr: str) -> None:
    if not p.is_contiguous():  # e.g. model.to(memory_format=...) after construction
        raise ValueError(f"{label} is no longer contiguous; params must stay contiguous")
    if not isinstance(grad, torch.Tensor):
        raise TypeError(f"{label}: {attr} must be a tensor, got {type(grad).__name__}")
    if grad.layout != torch.strided:
        raise TypeError(f"{label}: {attr} has layout {grad.layout}; sparse gradients are not supported")
    if grad.shape != p.shape:
        raise ValueError(f"{label}: {attr} has shape {tuple(grad.shape)}, the param {tuple(p.shape)}")
    if grad.device != p.device:
        raise ValueError(f"{label}: {attr} is on {grad.device}, the param on {p.device}")
    raise TypeError(f"{label}: {attr} has dtype {grad.dtype}; supported: float32, bfloat16, float16")
