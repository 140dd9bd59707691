"""Running a planned step: the kernel calls of each work item, and around them
what the residency of its state needs (docs/design.md, "Data flow of one step").

A runner is what `MuonAdamW.step` hands the checked work items to. Two exist:

  * `ResidentRunner` (here): the state lives beside the params; each item is
    one kernel call, then its params' writers.
  * `offload.StagedRunner`: the state lives in CPU slabs; each item's state is
    brought into a staging slot before its kernel call and sent back after.

The protocol the optimizer calls:
  * `run(work, groups, scalers)`: the step's planned (item, state, checked)
    triples (buckets.PlannedItem), every check passed; `retry_stale_writers(work)`
    after them; `drain()`: wait for copies still in flight (state then
    authoritative); `residency`: "cpu_resident", "step_active" or
    "staging_released"; `staged`: whether state is staged at all.
  * Lifecycle hooks, no-ops when resident: `check_group` / `add` (a new param
    group), `check_step` (before a step writes), `check_access` (before state
    is read or written outside a step), `adopt` (after a checkpoint load).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

from . import op_arguments, ops, row_blocks
from ._shapes import as_matrices
from ._types import WorkItem
from .amp import GradScalerInputs
from .distributed.placements import local
from .distributed.step import mesh_scalers

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
        """Every planned item in plan order (the same order on every rank: a DTensor item's collectives, its
        mesh's GradScaler agreement and its exchange, are entered alike everywhere)."""
        agreed: Dict[object, Tuple] = {}  # per mesh: GradScaler's inputs with found_inf summed over it
        for item, state, checked in work:
            self._run_item(item, state, scalers, checked, agreed)

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

    def retry_stale_writers(self, work) -> None:
        """At the end of a step: writers that failed at their last call and did
        not run in this step are called again with their current master
        (found_inf None: whatever this step did, their outputs are stale)."""
        states = self.states
        if not states.stale_writers:
            return
        ran = {id(p) for item, *_ in work for p in item.params if not item.bucket.writes_params}
        retry = [info for key, info in states.stale_writers.items() if key not in ran]
        if retry:
            self.drain()  # staged: the step's copies of the masters back to their slabs
        for info in retry:
            master = states.tensors[info.param]["master_param"]
            states.run_writer(info, master.to(info.param.device), None)

    # -- one item ---------------------------------------------------------

    def _run_item(self, item: WorkItem, state: StateLists, scalers: GradScalerInputs, checked, agreed: Dict) -> None:
        """`checked`: the planner's token for this item's lists (buckets.PlannedItem), handed to the op.
        `agreed`: the step's GradScaler inputs per mesh, filled at a mesh's first item."""
        if item.mesh is not None:  # the ranks of a mesh skip or step together
            inv_scale, found_inf = mesh_scalers(item.mesh, item.params[0].device, scalers, agreed)
        if item.exchange is not None:  # rows travel to each matrix's owner and back (distributed/step.py)
            item.exchange.run(item, self.states, inv_scale, found_inf, self.max_workspace_bytes)
            self._write(item, None, found_inf)
            return
        kernel_item, kernel_state = self.acquire(item, state)
        if item.mesh is None:
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
        torch.autograd.graph.increment_version(item.owners)

    @staticmethod
    def _kernel_params(item: WorkItem, state: StateLists):
        """(params, masters) as the kernels take them: params with writers are
        not touched, their FP32 masters are updated as FP32 params would be."""
        if item.bucket.writes_params:
            return item.params, state.get("master_param", ())
        return state["master_param"], ()

    def _adamw(self, item: WorkItem, state: StateLists, inv_scale, found_inf, checked) -> None:
        params, masters = self._kernel_params(item, state)
        settings = op_arguments.adamw(item.group)
        lr = settings["lr"]
        if isinstance(lr, torch.Tensor) and params and lr.device != params[0].device:
            # Offloaded AdamW of CUDA params runs on the CPU (the planner admitted
            # the lr for the params' device); the host already waits for its grads.
            settings["lr"] = lr.to(params[0].device)
        ops.adamw_step(params, item.grads, state["exp_avg"], state["exp_avg_sq"], state["step"], masters=masters,
                       inv_scale=inv_scale, found_inf=found_inf, checked=checked, **settings)

    def _muon(self, item: WorkItem, state: StateLists, inv_scale, found_inf, checked) -> None:
        group, view = item.group, item.group["matrix_view"]
        params, masters = self._kernel_params(item, state)
        second_momentum_buffers = []
        if group["beta2"] is not None:
            second_momentum_buffers = state["second_momentum_buffer"]
            if second_momentum_buffers is None:  # beta2 was switched on after construction
                for p in item.owners:
                    self.states.init(self.states.info(p), group)
                second_momentum_buffers = [local(self.states.tensors[p]["second_momentum_buffer"])
                                           for p in item.owners]
        grads, moms = item.grads, state["momentum_buffer"]
        if view == "flatten":  # the only view that is not the tensors themselves
            params, grads, moms, masters = ([as_matrices(t, view) for t in ts] for ts in (params, grads, moms, masters))
        row_blocks.muon_step(item.blocks, group, params, grads, moms, second_momentum_buffers, masters,
                             inv_scale=inv_scale,
                             found_inf=found_inf, max_workspace_bytes=self.max_workspace_bytes, checked=checked)
