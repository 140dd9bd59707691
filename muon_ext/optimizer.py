"""MuonAdamW: Muon for hidden matrices, AdamW for everything else, with exact
FP32 master weights (FP32 params, FP32 master tensors or BF16 + int16 remainders).

A step is one loop for every kind of param: plan (the work items of plain
params, buckets.py, and of DTensor params with the exchange each Muon item
needs, distributed/step.py; every check passed, agreed on every rank, before
anything is written) -> run (each item's kernels, exchange and writers, by the
runner of the state's residency: runners.py, offload.py) -> writer reports
(docs/design.md, "Data flow of one step").
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Callable, Iterable, List, Optional

import torch

from . import entry_points
from . import checkpoint, ops, schema, writers
from ._types import ParamInfo, is_dtensor
from .amp import GradScalerInputs, capturing, device_lr
from .buckets import PlannedItem, StepPlanner
from .offload import StagedRunner, check_offload
from .param_rules import check_group
from .runners import ResidentRunner
from .distributed import agreement
from .distributed.placements import holds_full, local
from .distributed.ownership import Ownership, data_parallel_group_of
from .distributed.step import DistributedStep, agree_on_checks, dtensor_infos
from .state import OptimizerState, check_master_values, gc_paused, master_mode

__all__ = ["MuonAdamW"]


class MuonAdamW(torch.optim.Optimizer):
    """Muon + AdamW over `{"params", "kind": "muon" | "adamw", ...}` param groups (see docs/design.md, "Public Python API").

    Args:
        params: groups `{"params": [...], "kind": "muon" | "adamw", ...}`; missing
            keys get schema.MUON_DEFAULTS / ADAMW_DEFAULTS, unknown extra keys are kept.
        master_weights: "auto" / True give BF16 and FP16 params an FP32 master;
            False updates them directly (FP32 math, round-to-nearest-even).
        store_param_remainders: keep BF16 masters as int16 remainders (2 bytes
            per param instead of 4) rather than FP32 tensors.
        grad_attr: "grad", or "main_grad" for Megatron-style FP32 main grads.
        capturable: keep each group's lr as a one-element float32 tensor on its
            params' device (schedulers update it in place), so that a step can
            be captured in a CUDA graph; a float lr there would be baked in.
        max_workspace_bytes: bound on Muon's transient scratch per chunk.
        offload: "none", or "cpu": every param's state (FP32 masters, also for
            BF16 params with store_param_remainders=True, and moments) lives in
            CPU slabs, pinned for CUDA params, staged through `offload_config`'s
            slots (see muon_ext.offload and docs/design.md, "CPU-staged state").
        offload_config: a muon_ext.OffloadConfig (offload="cpu" only).
        adapters: bind the installed adapters (entry points of the group
            "muon_ext.adapters", each called as `adapter(optimizer)` after
            construction); False skips them.
        data_parallel_group: a ProcessGroup (or 1-D DeviceMesh) over which the
            (plain) params are replicated and their grads already averaged
            (DDP): each param is stepped by one owner rank, which alone keeps
            its state, and every rank receives the new values after the step
            (docs/design.md, "Data-parallel ownership"). step(), update_param,
            gather_full_parameter_master and state_dict() are then collectives
            over it; get_full_parameter_master returns None on a non-owner.
    Works with torch.amp.GradScaler: grads are unscaled in the kernels and a
    found inf skips the whole step.
    """

    _step_supports_amp_scaling = True

    def __init__(
        self,
        params,
        *,
        master_weights="auto",
        store_param_remainders: bool = True,
        grad_attr: str = "grad",
        capturable: bool = False,
        max_workspace_bytes: int = ops.DEFAULT_MAX_WORKSPACE_BYTES,
        offload: str = "none",
        offload_config=None,
        adapters: bool = True,
        data_parallel_group=None,
    ):
        schema.check_options(master_weights, grad_attr, max_workspace_bytes)
        self._offload_config = config = check_offload(offload, offload_config, capturable)
        dp_group = data_parallel_group_of(data_parallel_group)
        if dp_group is not None and config is not None:
            raise ValueError("data_parallel_group with offload='cpu' is not supported yet: the staged state would "
                             "hold every param's state, not the owned ones'")
        self._ownership = Ownership(dp_group) if dp_group is not None else None
        self.master_weights = master_weights
        # Offloaded params keep FP32 masters: the staged kernels update them off the param's device.
        self.store_param_remainders = bool(store_param_remainders) and config is None
        self.grad_attr = grad_attr
        self.capturable = bool(capturable)
        self.max_workspace_bytes = int(max_workspace_bytes)
        self._planner = StepPlanner(master_weights, self.store_param_remainders)
        if self._ownership is not None:
            self._planner.owns = self._ownership.owns
        self._distributed = DistributedStep()
        # Made by the first add_param_group, on torch's self.state: the params' table and the runner of their state.
        self._states: Optional[OptimizerState] = None
        self._runner: Optional[ResidentRunner] = None
        self._planner.state_rules = config is None  # offloaded state is on the CPU: checked by StagedRunner
        if isinstance(params, (torch.Tensor, set, frozenset)):
            raise TypeError(f"params must be a list of param groups, not a {type(params).__name__}")
        groups = list(params)
        if not groups or not all(isinstance(g, dict) for g in groups):
            raise TypeError("MuonAdamW takes a list of param groups with a 'kind' each; "
                            "muon_ext.param_groups(model) builds them")
        if not isinstance(adapters, bool):
            raise TypeError(f"adapters must be True or False, got {adapters!r}")
        super().__init__(groups, defaults={})
        if adapters:
            entry_points.bind_installed(self)

    def __getstate__(self) -> dict:
        if any(info.writer is not None and not info.writer.default for info in self._states.infos.values()):
            raise TypeError("an optimizer with registered param writers cannot be copied or pickled (a writer is "
                            "bound to its param and storage): unregister them first, or save state_dict()")
        if self._runner.staged:
            self._runner.__getstate__()  # raises: staged state is not picklable
        if self._ownership is not None:
            raise TypeError("an optimizer with a data_parallel_group cannot be copied or pickled (it holds a "
                            "process group and only this rank's state): save state_dict() instead")
        state = super().__getstate__()
        state.update(master_weights=self.master_weights, store_param_remainders=self.store_param_remainders,
                     grad_attr=self.grad_attr, max_workspace_bytes=self.max_workspace_bytes,
                     capturable=self.capturable, _pending_master_reads=self._states.pending.positions())
        return state

    def __setstate__(self, state: dict) -> None:
        """After copy.deepcopy / unpickling: the per-param table is keyed by id, so rebuild it."""
        pending = state.pop("_pending_master_reads", [])
        state.setdefault("capturable", False)
        super().__setstate__(state)
        self._planner = StepPlanner(self.master_weights, self.store_param_remainders)
        self._offload_config = None  # __getstate__ refuses offloaded optimizers
        self._ownership = None  # and data-parallel ones
        self._distributed = DistributedStep()
        self._states = OptimizerState(self.state, self.master_weights, self.store_param_remainders)
        self._runner = ResidentRunner(self._states, self.max_workspace_bytes)
        for index, group in enumerate(self.param_groups):
            self._states.register(index, group, group.get("param_names"))
        self._states.pending.restore(pending, self.param_groups)

    # ------------------------------------------------------------------
    # Groups
    # ------------------------------------------------------------------

    @gc_paused()
    def add_param_group(self, param_group: dict) -> None:
        """Validate a group, fill its defaults, create its state; re-buckets."""
        if self._states is None:  # torch's __init__ makes self.state, then adds the groups
            self._states = OptimizerState(self.state, self.master_weights, self.store_param_remainders)
            config = self._offload_config
            self._runner = ResidentRunner(self._states, self.max_workspace_bytes) if config is None else \
                StagedRunner(config, self._states, self.max_workspace_bytes)
        index = len(self.param_groups)

        def checks():
            group, names = schema.new_group(index, param_group)
            check_group(index, group, names, self._states.infos)
            self._runner.check_group(index, group, names)
            params = group["params"]
            if self.capturable:
                devices = {p.device for p in params}
                if len(devices) > 1:
                    raise ValueError(f"param group {index}: with capturable=True a group's params must share one "
                                     f"device (its lr tensor lives there), got {sorted(map(str, devices))}")
                group["lr"] = device_lr(group["lr"], params[0].device if params else torch.device("cpu"))
            return group, names

        given = param_group.get("params") if isinstance(param_group, dict) else None
        given = [given] if isinstance(given, torch.Tensor) else given if isinstance(given, (list, tuple)) else []
        # DTensor params: every rank must add the same group (docs/design.md, "Every call completes or changes
        # nothing").
        group, names = agreement.agree_over_params(f"add_param_group (param group {index})", given, checks,
                                                   lambda checked: [checked[0]], 1, first_group=index)
        if self._ownership is not None and any(writers.is_quantized(p) for p in group["params"]):
            raise ValueError(f"param group {index}: quantized params with a data_parallel_group are not supported "
                             "yet (their FP32 masters write them through a writer on every rank)")
        if self._ownership is not None and any(is_dtensor(p) for p in group["params"]):
            raise ValueError(f"param group {index}: data_parallel_group applies to plain (replicated) params; "
                             "DTensor params share their work over their own mesh (build a separate optimizer "
                             "for them)")
        self.param_groups.append(group)
        infos = self._states.register(index, group, names)
        if self._ownership is not None:
            self._ownership.add(infos, group)  # the same owners on every rank, no collective
        self._runner.add(infos, group)  # staged: state entries as views into a new CPU slab; init keeps them
        for info in self._owned(infos):
            self._states.init(info, group)
        self._planner.invalidate()

    def _owned(self, infos: Iterable[ParamInfo]) -> List[ParamInfo]:
        """The infos whose state this rank keeps: all, or under data-parallel ownership its own."""
        if self._ownership is None:
            return list(infos)
        return [info for info in infos if self._ownership.owns(info.param)]

    # ------------------------------------------------------------------
    # Step
    # ------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None):
        """One optimizer step over every param that has a gradient.

        Every group setting, param, state tensor and gradient is checked
        before the first param is written (metadata only: dtypes, shapes,
        devices, layouts, storage sizes), so a bad one raises, naming the
        param, with the optimizer untouched."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._states.begin_call()
        try:
            plan = self._plan()
        except Exception:
            # GradScaler deletes these only after a step returns: drop them so
            # that a later step does not unscale with this step's scale.
            self.__dict__.pop("grad_scale", None)
            self.__dict__.pop("found_inf", None)
            raise
        self._states.pending.resolve()
        scalers = GradScalerInputs(getattr(self, "grad_scale", None), getattr(self, "found_inf", None))
        self._runner.run(plan, self.param_groups, scalers)  # kernels, then each item's writers
        if self._ownership is not None:  # every param from its owner, on every rank
            self._ownership.share(self._plain_params())
        self._runner.retry_stale_writers(plan)
        # Every rank of a mesh where some rank has writers reports every rank's failures (docs/design.md, "Every
        # call completes or changes nothing").
        self._states.raise_writer_failures("step", self._distributed.writer_meshes)
        return loss

    def _plan(self) -> List[PlannedItem]:
        """The step's work items, every check passed on every rank (docs/design.md, "Data flow of one step"):
        the plain params' buckets, then the DTensor params' items with the exchange each needs. Collective
        where there are DTensor params: every rank joins their agreement, also one whose own planning just
        failed, so that a refusal raises on every rank before any rank writes."""
        schema.check_options(self.master_weights, self.grad_attr, self.max_workspace_bytes)
        scaler = hasattr(self, "found_inf")
        try:
            items = self._planner.plan(self.param_groups, self._states.infos, self._states.tensors, self.grad_attr,
                                       scaler)
            self._runner.check_step()
        finally:
            failed = sys.exc_info()[0] is not None
            if self._ownership is not None:  # every data-parallel rank steps, or none
                self._ownership.agree(failed, agreement.step_digest(self.param_groups,
                                                                    list(range(len(self.param_groups)))),
                                      self._device())
            shard_items = self._distributed.plan(self._planner, self.param_groups, self._states.infos,
                                                 self._states.tensors, self.grad_attr, failed=failed, scaler=scaler)
        return items + shard_items

    def _device(self) -> torch.device:
        """Where this optimizer's data-parallel collectives run: its first plain param's device."""
        plain = self._plain_params()
        return plain[0].device if plain else torch.device("cpu")

    def _plain_params(self) -> List[torch.Tensor]:
        """The optimizer's plain (non-DTensor) params, in group order: the same list on every rank. Made again
        only when the table grew (add_param_group), not at every step."""
        count, plain = getattr(self, "_plain_cache", (-1, []))
        if count != len(self._states.infos):
            plain = [info.param for info in self._states.infos.values() if not is_dtensor(info.param)]
            self._plain_cache = (len(self._states.infos), plain)
        return plain

    # ------------------------------------------------------------------
    # Masters
    # ------------------------------------------------------------------

    @torch.no_grad()
    def update_param(self, param: torch.nn.Parameter, values: torch.Tensor, *, allow_nonfinite: bool = False) -> None:
        """Set a parameter and its master weights to `values`.

        `values` are FP32 with the param's full shape (any layout or device).
        The param is written as the master mode stores it (remainder split for
        BF16 + remainders, round-to-nearest-even otherwise). Moments and step
        counts are kept (created if absent). Everything is validated before
        anything is written. Not allowed during CUDA graph capture.

        Values holding NaN or inf raise ValueError unless `allow_nonfinite=True`.
        That check reads the values: for values on a CUDA device it waits for
        the device (one host synchronization per call); `allow_nonfinite=True`
        skips it.

        For a DTensor param this is a collective over its mesh (every rank
        calls it with its DTensor values): a check failing on any rank raises
        on every rank before any rank writes.
        """
        info = self._states.info(param)
        self._states.begin_call()

        def checks():
            check_master_values(info, values)
            if capturing():
                raise RuntimeError("update_param: not allowed during CUDA graph capture")
            self._check_params([info], all_state=False, reading=False)
            if not allow_nonfinite and not bool(torch.isfinite(local(values)).all()):  # DTensor: this rank's part
                raise ValueError(f"update_param: the values for {info.name} hold NaN or inf; a non-finite master "
                                 "poisons every later step (pass allow_nonfinite=True to write them anyway)")

        if is_dtensor(param):
            agree_on_checks(param, checks, "update_param")
        elif self._ownership is not None:  # a collective: every data-parallel rank writes, or none
            agreement.refuse_together(self._ownership.group, checks, "update_param")
        else:
            checks()
        if self._ownership is None or self._ownership.owns(param):
            self._states.init(info, self.param_groups[info.group])
            self._states.write_master(info, values.detach().to(param.device).contiguous())
        if self._ownership is not None:  # the param as its owner's master mode wrote it
            self._ownership.broadcast_from_owner(param.data, param)
        self._states.raise_writer_failures("update_param")

    def get_full_parameter_master(self, param: torch.nn.Parameter) -> Optional[torch.Tensor]:
        """A new FP32 tensor holding the param's full master weights.

        Reconstructed from remainders where they are used; the param's values
        for params without a separate master. Raises for params this optimizer
        does not own, and (naming it) for a param whose storage or master
        cannot be read. With offload="cpu" it drains first and returns a copy
        of the CPU FP32 master, on the CPU (never a view of the slab).
        """
        info = self._states.info(param)
        if self._ownership is not None and not self._ownership.owns(param):
            return None  # its owner keeps it: gather_full_parameter_master brings it to every rank
        self._check_params([info], all_state=False, reading=True)
        if is_dtensor(param):
            return local(self._states.read_master(info)) if holds_full(param) else None
        return self._states.read_master(info)

    def gather_full_parameter_master(self, param: torch.nn.Parameter) -> torch.Tensor:
        """A collective over a DTensor param's mesh: every rank of it gets the
        full FP32 master as a new plain tensor (every rank must call it, in the
        same order). For a plain param, `get_full_parameter_master`."""
        info = self._states.info(param)
        if self._ownership is not None and not is_dtensor(param):  # from its owner, to every rank
            owned = self._ownership.owns(param)
            master = agreement.refuse_together(
                self._ownership.group, lambda: self.get_full_parameter_master(param) if owned else None,
                "gather_full_parameter_master")
            if master is None:
                master = torch.empty(param.shape, dtype=torch.float32, device=param.device)
            self._ownership.broadcast_from_owner(master, param)
            return master
        self._check_params([info], all_state=False, reading=True)
        master = self._states.read_master(info)
        return master.full_tensor() if is_dtensor(master) else master

    def get_local_master(self, param: torch.nn.Parameter) -> torch.Tensor:
        """A new FP32 tensor of this rank's part of the param's master: a DTensor's local shard, a plain
        param's whole master. Never communicates (docs/design.md, "Megatron-Core adapter", QK-clip)."""
        info = self._states.info(param)
        self._check_params([info], all_state=False, reading=True)
        return local(self._states.read_master(info))

    @torch.no_grad()
    def update_local_masters(self, params, values, *, process_group=None) -> None:
        """`update_param` of this rank's parts: each param's local part (a DTensor's shard here, a plain param
        whole) and its master set to the plain FP32 tensor of the same shape in `values`, every param checked
        before any is written. Never communicates, except with `process_group`: one all_reduce over it, so that
        a refusal on any of its ranks raises on every one of them before any writes (every rank calls it)."""
        infos = [self._states.info(p) for p in params]
        self._states.begin_call()

        def checks():
            if len(values) != len(infos):
                raise ValueError(f"update_local_masters: {len(values)} values for {len(infos)} params")
            if capturing():
                raise RuntimeError("update_local_masters: not allowed during CUDA graph capture")
            for info, v in zip(infos, values):
                check_master_values(dataclasses.replace(info, param=local(info.param)), v)
                if not bool(torch.isfinite(v).all()):
                    raise ValueError(f"update_local_masters: the values for {info.name} hold NaN or inf")
            self._check_params(infos, all_state=False, reading=False)

        agreement.refuse_together(process_group, checks, "update_local_masters")
        for info, v in zip(infos, values):
            self._states.init(info, self.param_groups[info.group])
            self._states.write_master(info, v.detach().to(local(info.param).device).contiguous())
        self._states.raise_writer_failures("update_local_masters")

    def _check_params(self, infos: Iterable[ParamInfo], *, all_state: bool, reading: bool) -> None:
        """Outside a step, before params and masters are read or written: the step's checks (storage held, master
        mode for the dtype, state dtypes, shapes and devices), naming the param.
        Offloaded state is drained first: the CPU copy is then the state."""
        infos = list(infos)
        if reading:  # under data-parallel ownership, only the owner has a master to read
            infos = self._owned(infos)
        self._runner.check_access(infos)
        sharded = dtensor_infos(infos)
        self._planner.check_params([i for i in infos if not is_dtensor(i.param)], self.param_groups,
                                   self._states.tensors, all_state=all_state, reading=reading)
        self._distributed.check(self._planner, sharded, self.param_groups, self._states.tensors,
                                all_state=all_state, reading=reading)

    # ------------------------------------------------------------------
    # Param writers
    # ------------------------------------------------------------------

    @torch.no_grad()
    def register_param_writer(self, param: torch.nn.Parameter, writer: Callable, *, storage=None) -> None:
        """Store `param` through `writer(param, master, stream, found_inf)`
        instead of the built-in low-precision writeback (see muon_ext.writers
        for the call contract). The param gets an FP32 master tensor,
        converted exactly from its current master. With `storage` (the param's
        own `param.untyped_storage()`), that storage may be released
        (`resize_(0)`) while the optimizer steps, updates or loads the param.
        Everything is validated before anything changes."""
        info = self._states.info(param)
        if self._ownership is not None:
            raise ValueError("register_param_writer: not supported with a data_parallel_group yet (a non-owner "
                             "has no master to write the param from; the params are all-gathered instead)")
        released = writers.check_registration(info, writer, storage, staged=self._runner.staged)
        if not released:
            self._check_params([info], all_state=False, reading=True)
            self._states.pending.resolve()
        writers.check_master_settled(info, info in self._states.pending)
        self._states.set_writer(info, writers.WriterEntry(writer, storage))
        self._planner.invalidate()

    @torch.no_grad()
    def unregister_param_writer(self, param: torch.nn.Parameter) -> None:
        """Remove the param's writer: its dtype's master mode again (remainders
        re-derived exactly) and the param written from its master. The param's
        storage must be held again."""
        info = self._states.info(param)
        writers.check_unregistration(info)
        self._runner.drain()  # staged: the last step's copy of the master back to its slab may be in flight
        # The param is then written from its master in its dtype's mode: check it as a step would (contiguity,
        # dtype, storage) before anything changes; its new master entry does not exist yet.
        plain = dataclasses.replace(info, writer=None,
                                    master_mode=master_mode(param, self.master_weights, self.store_param_remainders))
        self._planner.check_params([plain], self.param_groups, {param: {}}, all_state=False, reading=False)
        try:
            self._states.clear_writer(info)
        finally:
            self._planner.invalidate()

    # ------------------------------------------------------------------
    # Staged state (offload="cpu"; see muon_ext.offload)
    # ------------------------------------------------------------------

    @property
    def residency(self) -> str:
        """Where the state is: "cpu_resident" (CPU copies authoritative, slots
        held or not yet made), "step_active" (a step's copies may be in
        flight; drain() settles them), "staging_released" (slots handed back)."""
        return self._runner.residency

    def drain(self) -> None:
        """Waits for every outstanding state copy of the last step; the CPU
        state is then authoritative. Idempotent; a no-op without offload."""
        self._runner.drain()

    def release_staging(self) -> None:
        """Drains and returns the staging slots' device memory to the allocator
        (e.g. to lend the GPU to an inference engine); step() then refuses
        until restore_staging()."""
        self._staged("release_staging").release_staging()

    def restore_staging(self) -> None:
        """Takes the staging slots back after release_staging()."""
        self._staged("restore_staging").restore_staging()

    def _staged(self, name: str) -> StagedRunner:
        if not self._runner.staged:
            raise RuntimeError(f"{name}(): this optimizer has no staged state (construct it with offload='cpu')")
        return self._runner

    # ------------------------------------------------------------------
    # Checkpoints
    # ------------------------------------------------------------------

    @gc_paused()
    def state_dict(self) -> dict:
        """torch's layout, with every master stored as an FP32 tensor (portable
        between remainder and non-remainder configurations). Runs the hooks of
        `register_state_dict_pre_hook` / `register_state_dict_post_hook`."""
        for hook in self._optimizer_state_dict_pre_hooks.values():
            hook(self)
        if self._ownership is not None:  # a collective: every rank gets the whole state, from the owners
            agreement.refuse_together(
                self._ownership.group,
                lambda: self._check_params(self._states.infos.values(), all_state=False, reading=True), "state_dict")
            state_dict = checkpoint.state_dict(self.param_groups, self._states, self._ownership)
        else:
            self._check_params(self._states.infos.values(), all_state=False, reading=True)
            state_dict = checkpoint.state_dict(self.param_groups, self._states)
        for hook in self._optimizer_state_dict_post_hooks.values():
            result = hook(self, state_dict)
            if result is not None:
                state_dict = result
        return state_dict

    @gc_paused()
    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state dict saved by MuonAdamW (any master configuration) or
        with TransformerEngine-style int16 `master_param` remainders.

        Load pre-hooks may replace the (shallow-copied) dict; then everything is
        validated before anything is written. Params are rewritten from their
        loaded FP32 masters (remainders re-derived), FP32 moments stay FP32.
        Load post-hooks run last.
        """
        state_dict = dict(state_dict) if isinstance(state_dict, dict) else state_dict
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = hook(self, state_dict)
            if result is not None:
                state_dict = result
        self._states.begin_call()

        def checks():
            # Loading writes every param and state tensor: none may be written out of bounds.
            self._check_params(self._states.infos.values(), all_state=True, reading=False)
            return checkpoint.check_state_dict(self.param_groups, self._states, state_dict)

        params = [info.param for info in self._states.infos.values()]
        meshes = agreement.meshes_of(params)
        if self._ownership is not None:  # every data-parallel rank loads, or none
            checked = agreement.refuse_together(self._ownership.group, checks, "load_state_dict")
        else:
            # DTensor params: every rank loads, or none (and with the same settings).
            checked = agreement.agree_over_params("load_state_dict", params, checks,
                                                  lambda checked: checked.merged_groups, len(self.param_groups),
                                                  meshes=meshes)
        checkpoint.apply_state_dict(self.param_groups, self._states, checked, capturable=self.capturable)
        if self._ownership is not None:  # a whole state dict (any data-parallel size): keep the owned state
            for info in self._states.infos.values():  # the owner settles the master; the step shares the param
                if not self._ownership.owns(info.param):
                    self._states.pending.forget(info.param)
                    self.state.pop(info.param, None)
        self._runner.adopt(self.param_groups)  # staged: entries the load created go into the slabs
        self._planner.invalidate()
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)
        device = agreement.device_of(params)
        self._states.raise_writer_failures("load_state_dict", [(mesh, device) for mesh in meshes])

