"""Planning a step: buckets of params stepped together, every check that must
pass before the first write, and the step's work items. Writes nothing.

The checks are metadata only (no tensor data is read) and cover everything
the kernels could refuse or read out of bounds, for every bucket, before the
first kernel runs (docs/design.md, "Data flow of one step"). One C++ call per
bucket (`_C.check_bucket`, csrc/step_checks.h) finds the first bad param and
returns what is wrong with it (a `_C.StepProblem`); only then does Python look
at it again to word the error. A passing check returns the bucket's token
(`_C.CheckedBucket`), which the runner hands to the op so that it does not
check again what was checked here.
"""

from __future__ import annotations

from typing import Callable, Dict, Iterable, List, Mapping, NamedTuple, Optional, Tuple

import torch

from . import _C, row_blocks
from ._shapes import matrix_shape, stats_layout_error
from ._types import Bucket, GradAttr, ParamInfo, WorkItem, is_dtensor
from .amp import capturing, check_step_lr
from .schema import check_block_scales, check_hyper
from .state import master_mode
from .writers import check_released

__all__ = ["StepPlanner", "PlannedItem"]

# How a state entry's shape follows from its param's (csrc/step_checks.h, StateShape).
_PARAM_SHAPE, _SCALAR, _SECOND_MOMENT = 0, 1, 2
_MASTER_DTYPES = {"remainder": torch.int16, "fp32": torch.float32, "none": None}


class PlannedItem(NamedTuple):
    """A work item and the state tensors its kernel call takes, by state key,
    in the order of item.params (as checked; a list is None where some entry
    is still to be created), and the step check's token for the op call on
    exactly these lists (None where the item's lists are not the bucket's)."""

    item: WorkItem
    state: Dict[str, Optional[List[torch.Tensor]]]
    checked: Optional[_C.CheckedBucket] = None


class _Spec(NamedTuple):
    """What a bucket's params were when it was made: the kernels take one
    dtype, device and (Muon) matrix shape per call."""

    dtype: torch.dtype
    device: torch.device
    rows: int  # 0 for AdamW
    cols: int


def overlap_entry(params: List[torch.Tensor], rules: Tuple, index: int, infos: Mapping[int, ParamInfo]) -> str:
    """Names an entry of `_C.check_bucket`'s memory ranges: param `index` of a
    bucket, or (a negative index) one of its state tensors under `rules`."""
    if index >= 0:
        return infos[id(params[index])].name
    position, rule = divmod(-1 - index, len(rules))
    return f"optimizer state '{rules[rule][0]}' of {infos[id(params[position])].name}"


class StepPlanner:
    """Turns the groups and grads of a step into work items, one kernel call
    each. Buckets are made once and kept until `invalidate` (groups added or
    loaded); groups edited in place (params, kind, matrix_view) are refused.

    `master_weights` / `store_param_remainders`: the optimizer's settings,
    which fixed each param's master mode for the dtype it had then."""

    def __init__(self, master_weights="auto", store_param_remainders: bool = True):
        self.master_weights = master_weights
        self.store_param_remainders = store_param_remainders
        self._buckets: Optional[List[Bucket]] = None
        self._specs: List[_Spec] = []
        self._empty: List[ParamInfo] = []  # zero-size params, in no bucket
        self._signature: Tuple = ()
        self._tokens: List[_C.CheckedBucket] = []  # of the last plan: stale at the next
        # False when the state lives off the params' device (offload="cpu"):
        # muon_ext.offload checks those entries; params and grads are checked here.
        self.state_rules = True
        # Under data-parallel ownership (distributed/ownership.py): whether this rank steps a plain param;
        # the others' are stepped by their owners and arrive after the step. None: every param.
        self.owns: Optional[Callable[[torch.Tensor], bool]] = None

    def invalidate(self) -> None:
        """Re-bucket at the next plan."""
        self._buckets = None

    def plan(self, groups: List[dict], infos: Mapping[int, ParamInfo], tensors: Mapping, grad_attr: GradAttr,
             scaler_attached: bool) -> List[PlannedItem]:
        """Checks every group setting, param, state tensor and grad, raising
        before anything is written; returns a work item per bucket and grad
        dtype (params without a grad left out), with the state it takes.
        Grads are read from each param's `grad_attr`, state from `tensors`
        (param -> dict); `scaler_attached`: a GradScaler handed over found_inf."""
        if torch.compiler.is_compiling():
            return self._plan_outside_graph(groups, infos, tensors, grad_attr, scaler_attached)
        return self._plan(groups, infos, tensors, grad_attr, scaler_attached)

    @torch.compiler.disable
    def _plan_outside_graph(self, *args) -> List[PlannedItem]:
        """Under torch.compile: host-side checks (and a pybind call Dynamo
        cannot trace) run eagerly behind a graph break. Not used in eager
        steps, where the disable wrapper would only add overhead."""
        return self._plan(*args)

    def _plan(self, groups: List[dict], infos: Mapping[int, ParamInfo], tensors: Mapping, grad_attr: GradAttr,
              scaler_attached: bool) -> List[PlannedItem]:
        if grad_attr == "main_grad" and scaler_attached and all(
                info.param.grad is None for info in infos.values()):
            raise ValueError("torch.amp.GradScaler looks for infs in .grad, and no param has one (this optimizer "
                             "steps on main_grad): an inf would go unnoticed; unscale and check main grads yourself")
        capturing_now = capturing()
        for index, group in enumerate(groups):
            check_hyper(index, group)
            _check_lr_storage(index, group["lr"])
            check_step_lr(index, group, capturing_now)  # a CPU tensor lr: its value, and its row blocks' lrs
            if not isinstance(group["lr"], torch.Tensor):
                check_block_scales(f"param group {index} ({group['kind']}): ", group, group["lr"])
        buckets = self._get_buckets(groups, infos)
        for info in self._empty:
            if info.param.numel() != 0:
                raise ValueError(f"{info.name} had no elements when the optimizer was built and has shape "
                                 f"{tuple(info.param.shape)} now; build the optimizer after resizing params")
        for token in self._tokens:
            token.invalidate()
        self._tokens = []
        ranges = _C.MemoryRanges()
        checked, bucket_rules = [], []
        for b, (bucket, spec) in enumerate(zip(buckets, self._specs)):
            group = groups[bucket.group]
            view = group["matrix_view"] if bucket.kind == "muon" else ""  # "": not matrices
            if not bucket.writes_params:
                for p in bucket.params:
                    check_released(infos[id(p)], "")
            rules = _step_rules(bucket, group, infos, spec) if self.state_rules else ()
            bucket_rules.append(rules)
            result = _C.check_bucket(
                bucket.params, grad_attr, tensors, dtype=spec.dtype, device=spec.device,
                rules=rules, rows=spec.rows, cols=spec.cols,
                matrix_view=view, ranges=ranges, bucket=b, param_data=bucket.writes_params)
            if result.index >= 0:
                other_info = infos[id(bucket.params[result.other])] if result.other >= 0 else None
                if result.problem == _P.state_shape and result.key == "second_momentum_buffer":
                    _raise_stats_layout(infos[id(bucket.params[result.index])], group, tensors)
                self._raise(result.problem, infos[id(bucket.params[result.index])], result.key, other_info, spec,
                            tensors, grad_attr)
            if result.token is not None:
                self._tokens.append(result.token)
            blocks = row_blocks.of_group(group, spec.rows) if bucket.kind == "muon" else None
            checked.append((bucket, group, result, result.state, blocks))
        overlap = ranges.first_overlap()
        if overlap is not None:
            (b0, i0), (b1, i1) = overlap
            first = overlap_entry(buckets[b0].params, bucket_rules[b0], i0, infos)
            second = overlap_entry(buckets[b1].params, bucket_rules[b1], i1, infos)
            raise ValueError(f"{second} shares memory with {first}; every param needs storage and optimizer state "
                             "of its own (to tie weights, put one Parameter in one group)")
        return [planned for entry in checked for planned in _work_items(*entry)]

    def check_params(self, infos: Iterable[ParamInfo], groups: List[dict], tensors: Mapping, *, all_state: bool,
                     reading: bool, ranges=None, tag: int = 0) -> None:
        """The checks of a step for params read or written outside one:
        layout, contiguity, storage, and the master (`all_state`: every state
        entry) where present. Writing (update_param, load_state_dict): the
        param's dtype must fit its master mode. `reading` (state_dict,
        get_full_parameter_master): the master must be present, and a dtype
        that no longer fits the mode is refused only where the master cannot
        be read (remainders need a bfloat16 param), so a cast model's state can
        still be saved and loaded into a new optimizer. Params are recorded
        in `ranges` (a `_C.MemoryRanges`, when given) as (`tag` + their position, 0). Without `ranges`,
        consecutive params that a bucket could hold are checked in one C++ call (a checkpoint of 200k tiny
        params: one call per run, not per param)."""
        batch: List[ParamInfo] = []
        batch_key = None
        for position, info in enumerate(infos):
            p = info.param
            if not reading or info.master_mode == "remainder":
                self._check_master_mode(info)
            check_released(info, "")
            # The same shape in the same group: the same matrices (_check_batch finds them for the batch).
            key = (info.group, p.dtype, p.device, info.master_mode, info.writer is None, p.shape)
            if ranges is None and key == batch_key:
                batch.append(info)
                continue
            self._check_batch(batch, groups, tensors, all_state, reading, ranges, tag + position - len(batch))
            batch, batch_key = [info], key
        self._check_batch(batch, groups, tensors, all_state, reading, ranges, tag + len(infos) - len(batch))

    def _check_batch(self, batch: List[ParamInfo], groups: List[dict], tensors: Mapping, all_state: bool,
                     reading: bool, ranges, tag: int) -> None:
        """`check_params`' C++ check of params sharing group, dtype, device, master mode, writer presence and
        matrix shape (one param where `ranges` records them)."""
        if not batch:
            return
        info, group = batch[0], groups[batch[0].group]
        p = info.param
        rows, cols, view = 0, 0, ""
        if info.kind == "muon":
            rows, cols = matrix_shape(p, group["matrix_view"], info.name)
            view = group["matrix_view"]
        rules = _master_rule(info, reading) if info.master_mode != "none" and self.state_rules else ()
        if all_state and self.state_rules:
            rules = _moment_rules(info.kind, group, required=False, rows=rows, cols=cols) + rules
        result = _C.check_bucket(
            [i.param for i in batch], None, tensors, dtype=p.dtype, device=p.device, rules=rules, rows=rows,
            cols=cols, matrix_view=view, ranges=ranges, bucket=tag, param_data=info.writer is None)
        if result.index >= 0:
            bad = batch[result.index]
            other = batch[result.other] if result.other >= 0 else None
            self._raise(result.problem, bad, result.key, other, _Spec(p.dtype, p.device, rows, cols), tensors, "")

    # -- buckets ----------------------------------------------------------

    def _get_buckets(self, groups: List[dict], infos: Mapping[int, ParamInfo]) -> List[Bucket]:
        signature = tuple((tuple(id(p) for p in g["params"]), g["kind"], g.get("matrix_view")) for g in groups)
        if self._buckets is not None and signature != self._signature:
            raise ValueError("param_groups were changed in place (params, kind or matrix_view); add params with "
                             "add_param_group, or build a new optimizer")
        if self._buckets is None:
            buckets: Dict[Tuple, Bucket] = {}
            empty = []
            for info in infos.values():
                p, group = info.param, groups[info.group]
                if is_dtensor(p):
                    continue  # stepped by distributed/step.py, on local tensors
                if self.owns is not None and not self.owns(p):
                    continue  # stepped by its owner rank
                self._check_master_mode(info)
                if p.numel() == 0:
                    empty.append(info)  # nothing to update; the kernels refuse zero-sized matrices
                    continue
                shape = matrix_shape(p, group["matrix_view"], info.name) if info.kind == "muon" else None
                writes = info.writer is None
                key = (info.group, p.device, p.dtype, info.master_mode, writes, shape)
                buckets.setdefault(key, Bucket(info.group, info.kind, [], writes)).params.append(p)
            self._buckets = list(buckets.values())
            self._specs = [_Spec(dtype, device, *(shape or (0, 0))) for (_, device, dtype, _, _, shape) in buckets]
            self._empty = empty
            self._signature = signature
        return self._buckets

    def _check_master_mode(self, info: ParamInfo) -> None:
        """A param cast after construction (model.bfloat16()) keeps the master
        mode of its old dtype: its updates would be lost or refused."""
        p = info.param
        if info.writer is not None or master_mode(p, self.master_weights, self.store_param_remainders) == info.master_mode:
            return  # a param with a writer keeps an FP32 master whatever its dtype
        now = f"{info.name} is {p.dtype} but was"
        if info.master_mode == "none":
            raise TypeError(
                f"{now} torch.float32 when the optimizer was built, so it has no FP32 master (the param itself was "
                f"the master) and updates below {p.dtype}'s precision would be lost. Build the optimizer after "
                "casting the model (load this optimizer's state_dict() into the new one to keep its moments), or "
                "cast the param back to torch.float32 (update_param(param, values) then sets exact values)")
        if info.master_mode == "remainder":
            raise TypeError(
                f"{now} torch.bfloat16 when the optimizer was built: its FP32 master is that bfloat16 param plus "
                "int16 remainders, which need a bfloat16 param. Cast the param back to torch.bfloat16 (the "
                "remainders then complete it to the exact master again), or build the optimizer after casting the "
                "model (update_param(param, values) then sets exact values)")
        was = "torch.float16" if self.store_param_remainders else "torch.bfloat16 or torch.float16"
        raise TypeError(
            f"{now} {was} when the optimizer was built, and its separate FP32 master does not fit a "
            f"{p.dtype} param. Build the optimizer after casting the model (load this optimizer's state_dict() into "
            "the new one: it keeps the FP32 masters), or cast the param back (update_param(param, values) then sets "
            "exact values)")

    # -- messages ---------------------------------------------------------

    def _raise(self, problem: _C.StepProblem, info: ParamInfo, key: str, other: Optional[ParamInfo], spec: _Spec,
               tensors: Mapping, attr: str) -> None:
        """Raises the error for `problem` (found by _C.check_bucket) at `info`'s param: `key` names the
        state entry, `other` the param whose entry it shares, `spec` what the bucket expects."""
        label, p = info.name, info.param
        if problem == _P.param_dtype:
            self._check_master_mode(info)
            raise TypeError(f"{label} is {p.dtype} but was {spec.dtype} when the optimizer bucketed it; params "
                            "must keep their dtype: build the optimizer after casting the model, or cast the param "
                            "back")
        if problem in _PARAM_ERRORS:
            raise _PARAM_ERRORS[problem](label, p, spec)
        if problem in _STATE_ERRORS:
            raise _state_error(problem, label, p, key, other, tensors.get(p))
        raise _GRAD_ERRORS[problem](label, p, getattr(p, attr, None), attr)


def _raise_stats_layout(info: ParamInfo, group: dict, tensors: Mapping) -> None:
    """NorMuon statistics laid out for other row_blocks (an edit between steps): the words the staged runner and
    load_state_dict use for it (_shapes.stats_layout_error)."""
    held = tensors[info.param]["second_momentum_buffer"]
    if not isinstance(held, torch.Tensor):
        return
    # Row-blocked statistics are one column; other shapes are not a layout's (a replaced tensor: the usual words).
    blocked = group.get("row_blocks") is not None or (held.dim() == 2 and held.shape[1] == 1)
    error = stats_layout_error(info.name, info.param, group, held.shape) if blocked else None
    if error is not None:
        raise error


def _check_lr_storage(index: int, lr) -> None:
    """A tensor lr is read by the kernels (or on the host): its storage must hold it."""
    if isinstance(lr, torch.Tensor):
        problem = _C.storage_problem(lr)
        if problem:
            raise ValueError(f"param group {index}: lr: {problem}")


def _moment_rules(kind: str, group: dict, required: bool, rows: int = 0, cols: int = 0) -> tuple:
    """(key, dtype, shape, required) of the moments the kernels take (csrc/step_checks.h, StateRule);
    `rows` x `cols`: a Muon param's matrices."""
    if kind == "adamw":
        return (("exp_avg", torch.float32, _PARAM_SHAPE, required),
                ("exp_avg_sq", torch.float32, _PARAM_SHAPE, required),
                ("step", torch.float32, _SCALAR, required))
    rules = (("momentum_buffer", torch.float32, _PARAM_SHAPE, required),)
    if group["beta2"] is not None:  # created at first use when NorMuon is switched on later
        blocks = group.get("row_blocks")
        # With row_blocks, one column of every block's own statistics (muon_ext.row_blocks): a shape given here.
        shape = _SECOND_MOMENT if blocks is None else row_blocks.stats_shape(row_blocks.of_group(group, rows), cols)
        rules += (("second_momentum_buffer", torch.float32, shape, False),)
    return rules


def _master_rule(info: ParamInfo, required: bool) -> tuple:
    """The master entry of the param's mode (none: there must be no such entry)."""
    return (("master_param", _MASTER_DTYPES[info.master_mode], _PARAM_SHAPE, required),)


def _step_rules(bucket: Bucket, group: dict, infos: Mapping[int, ParamInfo], spec: "_Spec") -> tuple:
    return (_moment_rules(bucket.kind, group, True, spec.rows, spec.cols)
            + _master_rule(infos[id(bucket.params[0])], True))


def _work_items(bucket: Bucket, group: dict, result, state: Dict,
                blocks: Optional[row_blocks.RowBlocks]) -> List[PlannedItem]:
    grads = result.grads
    if result.uniform:  # the common case: nothing to sort out
        return [PlannedItem(WorkItem(bucket, group, bucket.params, grads, blocks), state, result.token)]
    by_grad_dtype: Dict[torch.dtype, Tuple[List, List, List]] = {}
    for i, (p, grad) in enumerate(zip(bucket.params, grads)):
        if grad is not None:
            params, contiguous, positions = by_grad_dtype.setdefault(grad.dtype, ([], [], []))
            params.append(p)
            contiguous.append(grad if grad.is_contiguous() else grad.contiguous())
            positions.append(i)
    return [PlannedItem(WorkItem(bucket, group, params, contiguous, blocks),
                        {k: None if v is None else [v[i] for i in positions] for k, v in state.items()}, None)
            for params, contiguous, positions in by_grad_dtype.values()]


_P = _C.StepProblem

# The words of each problem _C.check_bucket reports (csrc/step_checks.h, StepProblem).
_PARAM_ERRORS = {
    # e.g. model.to(memory_format=...) after construction
    _P.param_contiguous: lambda label, p, spec: ValueError(
        f"{label} is no longer contiguous; params must stay contiguous"),
    _P.param_device: lambda label, p, spec: ValueError(
        f"{label} is on {p.device} but was on {spec.device} when the optimizer bucketed it (its state is there); "
        "move the model before building the optimizer"),
    _P.param_shape: lambda label, p, spec: ValueError(
        f"{label} has shape {tuple(p.shape)}, no longer {spec.rows}x{spec.cols} matrices; params must keep their "
        "shape (resize them before building the optimizer)"),
    _P.param_storage: lambda label, p, spec: ValueError(
        f"{label}: {_C.storage_problem(p)}; restore the param's storage before the optimizer reads or writes it, or "
        "(storage released on purpose) register a param writer for it with storage=param.untyped_storage()"),
    _P.param_layout: lambda label, p, spec: TypeError(
        f"{label} has layout {p.layout}; params must be dense (strided)"),
    _P.param_type: lambda label, p, spec: TypeError(f"{label} is a {type(p).__name__}, not a tensor"),
}

_STATE_REPAIR = "state tensors must keep the dtype, shape and device they were made with"
_STATE_TENSOR_ERRORS = {
    _P.state_layout: lambda where, p, t: TypeError(f"{where} has layout {t.layout}; {_STATE_REPAIR}"),
    _P.state_dtype: lambda where, p, t: TypeError(f"{where} has dtype {t.dtype}; {_STATE_REPAIR}"),
    _P.state_device: lambda where, p, t: ValueError(
        f"{where} is on {t.device}, the param on {p.device}; {_STATE_REPAIR} (move the model before building the "
        "optimizer)"),
    _P.state_shape: lambda where, p, t: ValueError(
        f"{where} has shape {tuple(t.shape)} and the param {tuple(p.shape)}: params must keep their shape and "
        f"{_STATE_REPAIR}"),
    _P.state_contiguous: lambda where, p, t: ValueError(f"{where} must be contiguous; {_STATE_REPAIR}"),
    _P.state_storage: lambda where, p, t: ValueError(f"{where}: {_C.storage_problem(t)}"),
}
_STATE_ERRORS = frozenset(_STATE_TENSOR_ERRORS) | {_P.state_type, _P.state_missing, _P.state_unexpected,
                                                   _P.state_shared}


def _state_error(problem: _C.StepProblem, label: str, p: torch.Tensor, key: str, other: Optional[ParamInfo],
                 entry) -> Exception:
    where = f"{label}: optimizer state '{key}'"
    if problem == _P.state_missing:
        return ValueError(f"{where} is missing ({_STATE_REPAIR}; load a checkpoint or build a new optimizer)")
    if problem == _P.state_unexpected:
        return ValueError(f"{where} is unexpected: this param keeps no separate master")
    if problem == _P.state_shared:
        return ValueError(f"{where} is the same tensor as that of {other.name}; each param needs its own")
    if not isinstance(entry, dict):
        return TypeError(f"{label}: its optimizer state must be a dict, got {type(entry).__name__}")
    t = entry.get(key)
    if problem == _P.state_type or not isinstance(t, torch.Tensor):
        return TypeError(f"{where} must be a tensor, got {type(t).__name__}")
    return _STATE_TENSOR_ERRORS[problem](where, p, t)


_GRAD_ERRORS = {
    _P.grad_type: lambda label, p, grad, attr: TypeError(
        f"{label}: {attr} must be a tensor, got {type(grad).__name__}"),
    _P.grad_layout: lambda label, p, grad, attr: TypeError(
        f"{label}: {attr} has layout {grad.layout}; sparse gradients are not supported"),
    _P.grad_shape: lambda label, p, grad, attr: ValueError(
        f"{label}: {attr} has shape {tuple(grad.shape)}, the param {tuple(p.shape)}"),
    _P.grad_device: lambda label, p, grad, attr: ValueError(
        f"{label}: {attr} is on {grad.device}, the param on {p.device}"),
    _P.grad_storage: lambda label, p, grad, attr: ValueError(f"{label}: {attr}: {_C.storage_problem(grad)}"),
    _P.grad_dtype: lambda label, p, grad, attr: TypeError(
        f"{label}: {attr} has dtype {grad.dtype}; supported: float32, bfloat16, float16"),
}
