"""Running a planned step: the kernel calls of each work item, and around them
what the residency of its state needs (docs/design.md, "Data flow of one step").

A runner is what `MuonAdamW.step` hands the checked work items to. Two exist:

  * `ResidentRunner` (here): the state lives beside the params; each item is
    one kernel call, then its params' writers.
  * `offload.StagedRunner`: the state lives in CPU slabs; each item's state is
    brought into a staging slot before its kernel call and sent back after.

The protocol the optimizer calls:
  * `run(work, groups, scalers)`: the step's planned (item, state, checked)
    triples (buckets.PlannedItem), every check passed; `drain()`: wait for copies still in flight (state then
    authoritative); `residency`: "cpu_resident", "step_active" or
    "staging_released"; `staged`: whether state is staged at all.
  * Lifecycle hooks, no-ops when resident: `check_group` / `add` (a new param
    group), `check_step` (before a step writes), `check_access` (before state
    is read or written outside a step), `adopt` (after a checkpoint load).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

from . import ops
from ._shapes import as_matrices
from ._types import WorkItem
from .amp import GradScalerInputs

__all__ = ["ResidentRunner"]

StateLists = Dict[str, Optional[List[torch.Tensor]]]


class ResidentRunner:
    """Runs work items whose state lives on the params' device."""

    staged = False
    residency = "cpu_resident"

    def __init__(self, states, max_workspace_bytes: int):
        self.states = states  # the optimizer's OptimizerState
        self.max_workspace_bytes = max_workspace_bytes

    # -- the protocol -----------------------------------------------------

    def run(self, work: List[Tuple[WorkItem, StateLists, Optional[object]]], groups: List[dict],
            scalers: GradScalerInputs) -> None:
        for item, state, checked in work:
            self._run_item(item, state, scalers, checked)

    def drain(self) -> None:
        """Nothing is in flight: kernels and writers run on the caller's stream."""

    def check_group(self, index: int, group: dict, names) -> None:
        pass

    def add(self, infos, group: dict) -> None:
        pass

    def check_step(self) -> None:
        pass

    def check_access(self, infos) -> None:
        pass

    def adopt(self, groups: List[dict]) -> None:
        pass

    # -- one item ---------------------------------------------------------

    def _run_item(self, item: WorkItem, state: StateLists, scalers: GradScalerInputs, checked=None) -> None:
        """`checked`: the planner's token for this item's lists (buckets.PlannedItem), handed to the op."""
        kernel_item, kernel_state = self.acquire(item, state)
        inv_scale, found_inf = scalers.on(kernel_item.params[0].device)
        if item.bucket.kind == "adamw":
            self._adamw(kernel_item, kernel_state, inv_scale, found_inf, checked)
        else:
            self._muon(kernel_item, kernel_state, inv_scale, found_inf, checked)
        self._write(item, kernel_state.get("master_param"), found_inf)
        self.release(item)

    def acquire(self, item: WorkItem, state: StateLists) -> Tuple[WorkItem, StateLists]:
        """The item the kernel runs on and its state lists (resident: as planned)."""
        return item, state

    def release(self, item: WorkItem) -> None:
        """After the item's kernel and writers."""

    def _write(self, item: WorkItem, masters: Optional[List[torch.Tensor]], found_inf) -> None:
        """After the kernels: params with writers are stored from `masters`
        (the FP32 masters the kernels just wrote; staged: the slot's views, on
        the compute stream, before compute_done), and the written params'
        autograd versions move on."""
        if not item.bucket.writes_params:
            for p, master in zip(item.params, masters):
                self.states.run_writer(self.states.info(p), master, found_inf)  # a failure is reported at the end
        torch.autograd.graph.increment_version(item.params)

    @staticmethod
    def _kernel_params(item: WorkItem, state: StateLists):
        """(params, masters) as the kernels take them: params with writers are
        not touched, their FP32 masters are updated as FP32 params would be."""
        if item.bucket.writes_params:
            return item.params, state.get("master_param", ())
        return state["master_param"], ()

    def _adamw(self, item: WorkItem, state: StateLists, inv_scale, found_inf, checked) -> None:
        group = item.group
        params, masters = self._kernel_params(item, state)
        beta1, beta2 = group["betas"]
        lr = group["lr"]
        if isinstance(lr, torch.Tensor) and params and lr.device != params[0].device:
            # Offloaded AdamW of CUDA params runs on the CPU (the planner admitted
            # the lr for the params' device); the host already waits for its grads.
            lr = lr.to(params[0].device)
        ops.adamw_step(
            params, item.grads, state["exp_avg"], state["exp_avg_sq"], state["step"],
            masters=masters, lr=lr, beta1=beta1,
            beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"], adam_w_mode=group["adam_w_mode"],
            bias_correction=group["bias_correction"], inv_scale=inv_scale, found_inf=found_inf, checked=checked,
        )

    def _muon(self, item: WorkItem, state: StateLists, inv_scale, found_inf, checked) -> None:
        group, view = item.group, item.group["matrix_view"]
        params, masters = self._kernel_params(item, state)
        second_moments = []
        if group["beta2"] is not None:
            second_moments = state["second_momentum_buffer"]
            if second_moments is None:  # beta2 was switched on after construction
                for p in item.params:
                    self.states.init(self.states.info(p), group)
                second_moments = [self.states.tensors[p]["second_momentum_buffer"] for p in item.params]
        grads, moms = item.grads, state["momentum_buffer"]
        if view == "flatten":  # the only view that is not the tensors themselves
            params, grads, moms, masters = ([as_matrices(t, view) for t in ts] for ts in (params, grads, moms, masters))
        for params, grads, moms, masters in _row_block_calls(group.get("row_blocks"), params, grads, moms, masters):
            ops.muon_step(
                params, grads, moms, second_moments, masters=masters, lr=group["lr"],
                momentum=group["momentum"], nesterov=group["nesterov"], beta2=group["beta2"],
                weight_decay=group["weight_decay"], ns_steps=group["ns_steps"],
                ns_coefficients=group["ns_coefficients"], lr_scale=group["lr_scale"],
                polar_dtype=group["polar_dtype"], inv_scale=inv_scale, found_inf=found_inf,
                max_workspace_bytes=self.max_workspace_bytes, checked=checked,
            )


def _row_block_calls(blocks, *lists):
    """The muon_step calls of one work item: its lists as they are, or with `row_blocks`
    each matrix cut into contiguous row-block views (disjoint, so each block is a matrix
    of its own: orthogonalized alone, lr-scaled by its own shape), one call per block size."""
    if not blocks:
        return [lists]
    by_size: Dict[int, list] = {}
    start = 0
    for size in blocks:
        calls = by_size.setdefault(size, [[] for _ in lists])
        for out, ts in zip(calls, lists):
            out.extend(t[start:start + size] for t in ts)
        start += size
    return list(by_size.values())
