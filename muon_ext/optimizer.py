"""MuonAdamW: Muon for hidden matrices, AdamW for everything else, with exact
FP32 master weights (FP32 params, FP32 master tensors or BF16 + int16 remainders).

A step runs plan -> [acquire] -> [gather] -> kernels -> [scatter] -> write ->
[release] per work item (one kernel call on one bucket of params, see
docs/design.md, "Data flow of one step"). The bracketed stages do nothing yet:
they are where CPU-staged state and distributed Muon will attach.
"""

from __future__ import annotations

import sys
from typing import Callable, Dict, Iterable, List, Optional

import torch

from . import checkpoint, ops, schema
from ._shapes import as_matrices
from ._types import ParamInfo, WorkItem, is_dtensor
from .amp import GradScalerInputs, capturing, device_lr
from .buckets import StepPlanner
from .distributed.placements import holds_full, local
from .distributed.step import DistributedStep, dtensor_infos
from .state import OptimizerState, check_master_values

__all__ = ["MuonAdamW"]


class MuonAdamW(torch.optim.Optimizer):
    """Muon + AdamW over seed-schema param groups (see docs/design.md, "Public Python API").

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
    ):
        schema.check_options(master_weights, grad_attr, max_workspace_bytes)
        self.master_weights = master_weights
        self.store_param_remainders = bool(store_param_remainders)
        self.grad_attr = grad_attr
        self.capturable = bool(capturable)
        self.max_workspace_bytes = int(max_workspace_bytes)
        self._planner = StepPlanner(master_weights, self.store_param_remainders)
        self._distributed = DistributedStep()
        self._states: Optional[OptimizerState] = None  # made by the first add_param_group, on torch's self.state
        if isinstance(params, (torch.Tensor, set, frozenset)):
            raise TypeError(f"params must be a list of param groups, not a {type(params).__name__}")
        groups = list(params)
        if not groups or not all(isinstance(g, dict) for g in groups):
            raise TypeError("MuonAdamW takes a list of param groups with a 'kind' each; "
                            "muon_ext.param_groups(model) builds them")
        super().__init__(groups, defaults={})

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        state.update(master_weights=self.master_weights, store_param_remainders=self.store_param_remainders,
                     grad_attr=self.grad_attr, max_workspace_bytes=self.max_workspace_bytes,
                     capturable=self.capturable, _pending_master_reads=self._states.pending_positions())
        return state

    def __setstate__(self, state: dict) -> None:
        """After copy.deepcopy / unpickling: the per-param table is keyed by id, so rebuild it."""
        pending = state.pop("_pending_master_reads", [])
        state.setdefault("capturable", False)
        super().__setstate__(state)
        self._planner = StepPlanner(self.master_weights, self.store_param_remainders)
        self._distributed = DistributedStep()
        self._states = OptimizerState(self.state, self.master_weights, self.store_param_remainders)
        for index, group in enumerate(self.param_groups):
            self._states.register(index, group, group.get("param_names"))
        self._states.restore_pending(pending, self.param_groups)

    # ------------------------------------------------------------------
    # Groups
    # ------------------------------------------------------------------

    def add_param_group(self, param_group: dict) -> None:
        """Validate a group, fill its defaults, create its state; re-buckets."""
        if self._states is None:  # torch's __init__ makes self.state, then adds the groups
            self._states = OptimizerState(self.state, self.master_weights, self.store_param_remainders)
        index = len(self.param_groups)
        group, names = schema.new_group(index, param_group)
        schema.check_group(index, group, names, self._states.infos)
        params = group["params"]
        if self.capturable:
            devices = {p.device for p in params}
            if len(devices) > 1:
                raise ValueError(f"param group {index}: with capturable=True a group's params must share one device "
                                 f"(its lr tensor lives there), got {sorted(map(str, devices))}")
            group["lr"] = device_lr(group["lr"], params[0].device if params else torch.device("cpu"))
        self.param_groups.append(group)
        for info in self._states.register(index, group, names):
            self._states.init(info, group)
        self._planner.invalidate()

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
        try:
            schema.check_options(self.master_weights, self.grad_attr, self.max_workspace_bytes)
            try:
                work = self._planner.plan(self.param_groups, self._states.infos, self._states.tensors,
                                          self.grad_attr, hasattr(self, "found_inf"))
            finally:  # DTensor params: every rank joins the agreement, also one whose planning just failed
                failed = sys.exc_info()[0] is not None
                dwork = self._distributed.plan(self._planner, self.param_groups, self._states.infos,
                                               self._states.tensors, self.grad_attr, failed=failed)
        except Exception:
            # GradScaler deletes these only after a step returns: drop them so
            # that a later step does not unscale with this step's scale.
            self.__dict__.pop("grad_scale", None)
            self.__dict__.pop("found_inf", None)
            raise
        self._states.resolve_pending()
        scalers = GradScalerInputs(getattr(self, "grad_scale", None), getattr(self, "found_inf", None))
        for item, state in work:
            self._acquire(item)
            self._gather(item)
            inv_scale, found_inf = scalers.on(item.params[0].device)
            if item.bucket.kind == "adamw":
                self._adamw(item, state, inv_scale, found_inf)
            else:
                self._muon(item, state, inv_scale, found_inf)
            self._scatter(item)
            self._write(item)
            self._release(item)
        if dwork:
            self._distributed.run(dwork, self.param_groups, self._states, scalers, self.max_workspace_bytes)
        return loss

    def _acquire(self, item: WorkItem) -> None:
        """Offload: take staging slots and bring the item's CPU-held state onto the device."""

    def _gather(self, item: WorkItem) -> None:
        """Distributed: exchange sharded Muon matrices so that each is whole on the rank that owns it."""

    def _scatter(self, item: WorkItem) -> None:
        """Distributed: send updated matrices back to the ranks that hold their shards."""

    def _write(self, item: WorkItem) -> None:
        """Post-kernel bookkeeping on the written params; param writers (e.g. FP8) attach here."""
        torch.autograd.graph.increment_version(item.params)

    def _release(self, item: WorkItem) -> None:
        """Offload: drain the item's staged state back to CPU memory and free its slots."""

    def _adamw(self, item: WorkItem, state: Dict[str, Optional[List[torch.Tensor]]], inv_scale, found_inf) -> None:
        group, params = item.group, item.params
        beta1, beta2 = group["betas"]
        ops.adamw_step(
            params, item.grads, state["exp_avg"], state["exp_avg_sq"], state["step"],
            masters=state.get("master_param", ()), lr=group["lr"], beta1=beta1,
            beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"], adam_w_mode=group["adam_w_mode"],
            bias_correction=group["bias_correction"], inv_scale=inv_scale, found_inf=found_inf,
        )

    def _muon(self, item: WorkItem, state: Dict[str, Optional[List[torch.Tensor]]], inv_scale, found_inf) -> None:
        group, params, view = item.group, item.params, item.group["matrix_view"]
        second_moments = []
        if group["beta2"] is not None:
            second_moments = state["second_momentum_buffer"]
            if second_moments is None:  # beta2 was switched on after construction
                for p in params:
                    self._states.init(self._states.info(p), group)
                second_moments = [self.state[p]["second_momentum_buffer"] for p in params]
        grads, moms, masters = item.grads, state["momentum_buffer"], state.get("master_param", ())
        if view == "flatten":  # the only view that is not the tensors themselves
            params, grads, moms, masters = ([as_matrices(t, view) for t in ts] for ts in (params, grads, moms, masters))
        ops.muon_step(
            params, grads, moms, second_moments, masters=masters, lr=group["lr"],
            momentum=group["momentum"], nesterov=group["nesterov"], beta2=group["beta2"],
            weight_decay=group["weight_decay"], ns_steps=group["ns_steps"], ns_coefficients=group["ns_coefficients"],
            lr_scale=group["lr_scale"], polar_dtype=group["polar_dtype"], inv_scale=inv_scale, found_inf=found_inf,
            max_workspace_bytes=self.max_workspace_bytes,
        )

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
        """
        info = self._states.info(param)
        check_master_values(info, values)
        if capturing():
            raise RuntimeError("update_param: not allowed during CUDA graph capture")
        self._check_params([info], all_state=False, reading=False)
        if not allow_nonfinite and not bool(torch.isfinite(local(values)).all()):  # DTensor: this rank's part
            raise ValueError(f"update_param: the values for {info.name} hold NaN or inf; a non-finite master "
                             "poisons every later step (pass allow_nonfinite=True to write them anyway)")
        self._states.init(info, self.param_groups[info.group])
        self._states.write_master(info, values.detach().to(param.device).contiguous())

    def get_full_parameter_master(self, param: torch.nn.Parameter) -> Optional[torch.Tensor]:
        """A new FP32 tensor holding the param's full master weights.

        Reconstructed from remainders where they are used; the param's values
        for params without a separate master. Raises for params this optimizer
        does not own, and (naming it) for a param whose storage or master
        cannot be read.
        """
        info = self._states.info(param)
        self._check_params([info], all_state=False, reading=True)
        if is_dtensor(param):
            return local(self._states.read_master(info)) if holds_full(param) else None
        return self._states.read_master(info)

    def gather_full_parameter_master(self, param: torch.nn.Parameter) -> torch.Tensor:
        """A collective over a DTensor param's mesh: every rank of it gets the
        full FP32 master as a new plain tensor (every rank must call it, in the
        same order). For a plain param, `get_full_parameter_master`."""
        info = self._states.info(param)
        self._check_params([info], all_state=False, reading=True)
        master = self._states.read_master(info)
        return master.full_tensor() if is_dtensor(master) else master

    def _check_params(self, infos: Iterable[ParamInfo], *, all_state: bool, reading: bool) -> None:
        """Outside a step, before params and masters are read or written: the step's checks (storage held, master
        mode for the dtype, state dtypes, shapes and devices), naming the param."""
        infos = list(infos)
        sharded = dtensor_infos(infos)
        self._planner.check_params([i for i in infos if not is_dtensor(i.param)], self.param_groups,
                                   self._states.tensors, all_state=all_state, reading=reading)
        self._distributed.check(self._planner, sharded, self.param_groups, self._states.tensors,
                                all_state=all_state, reading=reading)

    # ------------------------------------------------------------------
    # Checkpoints
    # ------------------------------------------------------------------

    def state_dict(self) -> dict:
        """torch's layout, with every master stored as an FP32 tensor (portable
        between remainder and non-remainder configurations). Runs the hooks of
        `register_state_dict_pre_hook` / `register_state_dict_post_hook`."""
        for hook in self._optimizer_state_dict_pre_hooks.values():
            hook(self)
        self._check_params(self._states.infos.values(), all_state=False, reading=True)
        state_dict = checkpoint.state_dict(self.param_groups, self._states)
        for hook in self._optimizer_state_dict_post_hooks.values():
            result = hook(self, state_dict)
            if result is not None:
                state_dict = result
        return state_dict

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
        # Loading writes every param and state tensor: none may be written out of bounds.
        self._check_params(self._states.infos.values(), all_state=True, reading=False)
        checkpoint.load_state_dict(self.param_groups, self._states, state_dict, capturable=self.capturable)
        self._planner.invalidate()
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)
