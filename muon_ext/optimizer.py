"""MuonAdamW: Muon for hidden matrices, AdamW for everything else, with exact
FP32 master weights (FP32 params, FP32 master tensors or BF16 + int16 remainders).

Params are bucketed once by (group, device, dtype, master mode, Muon matrix
shape); a step is one multi-tensor kernel call per bucket (see DESIGN.md, "Data
flow of one step"). State is per param and created at construction, so every
rank of a distributed job holds the same keys.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch

from . import _C, ops
from .checkpoint import load_optimizer_state, optimizer_state_dict

__all__ = ["MuonAdamW", "MUON_DEFAULTS", "ADAMW_DEFAULTS"]

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
}
ADAMW_DEFAULTS = {
    "lr": 1e-3,
    "betas": (0.9, 0.999),
    "eps": 1e-8,
    "weight_decay": 0.01,
    "adam_w_mode": True,
    "bias_correction": True,
}
_DEFAULTS = {"muon": MUON_DEFAULTS, "adamw": ADAMW_DEFAULTS}
_SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass
class _ParamInfo:
    """How the optimizer treats one param (fixed at construction)."""

    param: torch.nn.Parameter
    group: int
    index: int  # position within its group
    kind: str  # "muon" | "adamw"
    master: str  # "none" | "fp32" | "remainder"
    name: str  # for messages


@dataclass
class _Bucket:
    group: int
    kind: str
    params: List[torch.nn.Parameter]


class MuonAdamW(torch.optim.Optimizer):
    """Muon + AdamW over seed-schema param groups (see DESIGN.md, "Public Python API").

    Args:
        params: groups `{"params": [...], "kind": "muon" | "adamw", ...}`; missing
            keys get MUON_DEFAULTS / ADAMW_DEFAULTS, unknown extra keys are kept.
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
        if master_weights not in ("auto", True, False):
            raise ValueError(f"master_weights must be 'auto', True or False, got {master_weights!r}")
        if grad_attr not in ("grad", "main_grad"):
            raise ValueError(f"grad_attr must be 'grad' or 'main_grad', got {grad_attr!r}")
        if max_workspace_bytes <= 0:
            raise ValueError(f"max_workspace_bytes must be positive, got {max_workspace_bytes}")
        self.master_weights = master_weights
        self.store_param_remainders = bool(store_param_remainders)
        self.grad_attr = grad_attr
        self.capturable = bool(capturable)
        self.max_workspace_bytes = int(max_workspace_bytes)
        self._info: Dict[int, _ParamInfo] = {}
        self._buckets: Optional[List[_Bucket]] = None
        self._buckets_signature: Tuple = ()
        # FP32 masters to re-read from their params before next use: set by
        # loading a checkpoint without masters, so that model weights loaded
        # afterwards still become the masters.
        self._masters_from_params: set = set()
        if isinstance(params, (torch.Tensor, set, frozenset)):
            raise TypeError(f"params must be a list of param groups, not a {type(params).__name__}")
        groups = list(params)
        if not groups or not all(isinstance(g, dict) for g in groups):
            raise TypeError("MuonAdamW takes a list of param groups with a 'kind' each; "
                            "muon_ext.param_groups(model) builds them")
        super().__init__(groups, defaults={})

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        pending = [(info.group, info.index) for info in self._info.values() if id(info.param) in self._masters_from_params]
        state.update(master_weights=self.master_weights, store_param_remainders=self.store_param_remainders,
                     grad_attr=self.grad_attr, max_workspace_bytes=self.max_workspace_bytes,
                     capturable=self.capturable,
                     _pending_master_reads=pending)
        return state

    def __setstate__(self, state: dict) -> None:
        """After copy.deepcopy / unpickling: the per-param table is keyed by id, so rebuild it."""
        pending = state.pop("_pending_master_reads", [])
        state.setdefault("capturable", False)
        super().__setstate__(state)
        self._buckets = None
        self._buckets_signature = ()
        self._info = {}
        for index, group in enumerate(self.param_groups):
            names = list(group.get("param_names", [])) or [None] * len(group["params"])
            for i, (p, name) in enumerate(zip(group["params"], names)):
                self._info[id(p)] = _ParamInfo(p, index, i, group["kind"], self._master_mode(p),
                                               _label(index, group["kind"], i, name))
        self._masters_from_params = {id(self.param_groups[g]["params"][i]) for g, i in pending}

    # ------------------------------------------------------------------
    # Groups and state
    # ------------------------------------------------------------------

    def add_param_group(self, param_group: dict) -> None:
        """Validate a group, fill its defaults, create its state; re-buckets."""
        index = len(self.param_groups)
        group = dict(param_group)
        kind = group.get("kind")
        if kind not in _DEFAULTS:
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
        for key, value in _DEFAULTS[kind].items():
            group.setdefault(key, value)
        group["params"] = params
        self._check_group(index, group, names)
        if self.capturable:
            devices = {p.device for p in params}
            if len(devices) > 1:
                raise ValueError(f"param group {index}: with capturable=True a group's params must share one device "
                                 f"(its lr tensor lives there), got {sorted(map(str, devices))}")
            group["lr"] = _device_lr(group["lr"], params[0].device if params else torch.device("cpu"))

        infos = []
        for i, (p, name) in enumerate(zip(params, names)):
            infos.append(_ParamInfo(p, index, i, kind, self._master_mode(p), _label(index, kind, i, name)))
        self.param_groups.append(group)
        for info in infos:
            self._info[id(info.param)] = info
            self._init_state(info)
        self._buckets = None

    @staticmethod
    def _check_hyper(index: int, group: dict) -> None:
        """Every group setting the kernels read, checked up front: at
        construction, on loaded groups, and at each step (schedulers and users
        edit groups), so a bad value raises before any param is touched."""
        where = f"param group {index} ({group['kind']})"
        _check_lr(where, group["lr"])
        _check_number(where, "weight_decay", group["weight_decay"], low=0.0)
        if group["kind"] == "adamw":
            betas = group["betas"]
            if not isinstance(betas, (tuple, list)) or len(betas) != 2:
                raise TypeError(f"{where}: betas must be a pair (beta1, beta2), got {betas!r}")
            for name, value in zip(("betas[0]", "betas[1]"), betas):
                _check_number(where, name, value, low=0.0, below=1.0)
            _check_number(where, "eps", group["eps"], low=0.0)
            _check_bool(where, "adam_w_mode", group["adam_w_mode"])
            _check_bool(where, "bias_correction", group["bias_correction"])
            for flag in ("amsgrad", "maximize"):
                if group.get(flag):
                    raise ValueError(f"{where}: {flag}=True is not supported (it changes the AdamW update)")
            return
        if group["matrix_view"] not in ("error", "flatten", "batch"):
            raise ValueError(f"{where}: matrix_view must be 'error', 'flatten' or 'batch', "
                             f"got {group['matrix_view']!r}")
        if group["lr_scale"] not in ("original", "match_rms_adamw", "none"):
            raise ValueError(f"{where}: unknown lr_scale {group['lr_scale']!r}")
        _check_number(where, "momentum", group["momentum"], low=0.0, below=1.0)
        _check_bool(where, "nesterov", group["nesterov"])
        if group["beta2"] is not None:
            _check_number(where, "beta2", group["beta2"], low=0.0, below=1.0)
        coefficients = group["ns_coefficients"]
        if not isinstance(coefficients, (tuple, list)) or not all(
                isinstance(abc, (tuple, list)) and len(abc) == 3 and all(_is_real(v) and math.isfinite(v) for v in abc)
                for abc in coefficients):
            raise ValueError(f"{where}: ns_coefficients must be a list of finite (a, b, c) triples")
        ns_steps = group["ns_steps"]
        if not isinstance(ns_steps, int) or isinstance(ns_steps, bool) or ns_steps < 0:
            raise ValueError(f"{where}: ns_steps must be an int >= 0, got {ns_steps!r}")
        if ns_steps > len(coefficients):
            raise ValueError(f"{where}: ns_steps={ns_steps} but only {len(coefficients)} coefficient tuples")

    def _check_group(self, index: int, group: dict, names) -> None:
        kind = group["kind"]
        self._check_hyper(index, group)
        seen = set()
        for i, p in enumerate(group["params"]):
            label = _label(index, kind, i, names[i])
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"{label}: expected a tensor, got {type(p).__name__}")
            if id(p) in self._info or id(p) in seen:
                raise ValueError(f"{label} appears in more than one param group (or twice in one)")
            seen.add(id(p))
            _check_param_type(p, label)
            if not p.is_leaf:
                raise ValueError(f"{label}: can't optimize a non-leaf tensor")
            if not p.is_contiguous():
                raise ValueError(f"{label}: params must be contiguous")
            if kind == "muon":
                _matrix_shape(p, group["matrix_view"], label)

    def _master_mode(self, p: torch.Tensor) -> str:
        if p.dtype == torch.float32 or self.master_weights is False:
            return "none"
        if p.dtype == torch.bfloat16 and self.store_param_remainders:
            return "remainder"
        return "fp32"

    def _init_state(self, info: _ParamInfo) -> None:
        """Create the param's state (missing entries only)."""
        p, state = info.param, self.state[info.param]
        group = self.param_groups[info.group]
        zeros = lambda shape: torch.zeros(shape, dtype=torch.float32, device=p.device)  # noqa: E731
        if info.kind == "adamw":
            state.setdefault("step", zeros(()))
            state.setdefault("exp_avg", zeros(p.shape))
            state.setdefault("exp_avg_sq", zeros(p.shape))
        else:
            state.setdefault("momentum_buffer", zeros(p.shape))
            if group["beta2"] is not None:
                state.setdefault("second_momentum_buffer", zeros(_second_moment_shape(p, group["matrix_view"])))
        if info.master == "remainder":
            state.setdefault("master_param", torch.zeros(p.shape, dtype=torch.int16, device=p.device))
        elif info.master == "fp32":
            state.setdefault("master_param", p.detach().float().clone())

    def _param_info(self, param) -> _ParamInfo:
        info = self._info.get(id(param))
        if info is None or info.param is not param:
            raise ValueError("param is not a parameter of this optimizer (pass the very nn.Parameter given to it, "
                             "not param.data or a view)")
        return info

    # ------------------------------------------------------------------
    # Step
    # ------------------------------------------------------------------

    def _group_signature(self) -> Tuple:
        return tuple((tuple(id(p) for p in g["params"]), g["kind"], g.get("matrix_view")) for g in self.param_groups)

    def _get_buckets(self) -> List[_Bucket]:
        signature = self._group_signature()
        if self._buckets is not None and signature != self._buckets_signature:
            raise ValueError("param_groups were changed in place (params, kind or matrix_view); add params with "
                             "add_param_group, or build a new optimizer")
        if self._buckets is None:
            buckets: Dict[Tuple, _Bucket] = {}
            for info in self._info.values():
                p, group = info.param, self.param_groups[info.group]
                if p.numel() == 0:
                    continue  # nothing to update; the kernels refuse zero-sized matrices
                shape = _matrix_shape(p, group["matrix_view"], info.name) if info.kind == "muon" else None
                key = (info.group, p.device, p.dtype, info.master, shape)
                buckets.setdefault(key, _Bucket(info.group, info.kind, [])).params.append(p)
            self._buckets = list(buckets.values())
            self._buckets_signature = signature
        return self._buckets

    def _check_grads(self, params: List[torch.Tensor], grads: List) -> bool:
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
            self._raise_unsteppable(params[bad], grads[bad])
        return uniform

    def _raise_unsteppable(self, p: torch.Tensor, grad) -> None:
        label, attr = self._info[id(p)].name, self.grad_attr
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

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None):
        """One optimizer step over every param that has a gradient.

        Every group setting and gradient is checked before the first param is
        written, so a bad one raises with the optimizer untouched."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        try:
            work = self._plan_step()
        except Exception:
            # GradScaler deletes these only after a step returns: drop them so
            # that a later step does not unscale with this step's scale.
            self.__dict__.pop("grad_scale", None)
            self.__dict__.pop("found_inf", None)
            raise
        self._sync_masters_from_params()
        found_inf = getattr(self, "found_inf", None)
        scalers = _GradScalerInputs(getattr(self, "grad_scale", None),
                                    found_inf if isinstance(found_inf, torch.Tensor) else None)
        for bucket, group, params, grads in work:
            inv_scale, found = scalers.on(params[0].device)
            if bucket.kind == "adamw":
                self._step_adamw(group, params, grads, inv_scale, found)
            else:
                self._step_muon(group, params, grads, inv_scale, found)
            torch.autograd.graph.increment_version(params)
        return loss

    def _plan_step(self) -> List[Tuple]:
        """Checks every group and grad; returns (bucket, group, params, grads)
        per bucket and grad dtype. Writes nothing."""
        if self.grad_attr == "main_grad" and hasattr(self, "found_inf") and all(
                info.param.grad is None for info in self._info.values()):
            raise ValueError("torch.amp.GradScaler looks for infs in .grad, and no param has one (this optimizer "
                             "steps on main_grad): an inf would go unnoticed; unscale and check main grads yourself")
        capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
        for index, group in enumerate(self.param_groups):
            self._check_hyper(index, group)
            lr = group["lr"]
            if isinstance(lr, torch.Tensor):
                _check_lr_tensor(index, lr, group["params"])
            elif capturing and group["params"]:
                raise RuntimeError(f"param group {index}: capturing a step needs its lr as a tensor on the params' "
                                   "device (construct with capturable=True); a float lr would be baked into the graph")
        work = []
        for bucket in self._get_buckets():
            group = self.param_groups[bucket.group]
            grads = [getattr(p, self.grad_attr, None) for p in bucket.params]
            if self._check_grads(bucket.params, grads):  # the common case: nothing to sort out
                work.append((bucket, group, bucket.params, grads))
                continue
            by_grad_dtype: Dict[torch.dtype, Tuple[List, List]] = {}
            for p, grad in zip(bucket.params, grads):
                if grad is not None:
                    params, contiguous = by_grad_dtype.setdefault(grad.dtype, ([], []))
                    params.append(p)
                    contiguous.append(grad if grad.is_contiguous() else grad.contiguous())
            work.extend((bucket, group, params, contiguous) for params, contiguous in by_grad_dtype.values())
        return work

    def _masters(self, params) -> List[torch.Tensor]:
        return [self.state[p]["master_param"] for p in params if "master_param" in self.state[p]]

    def _step_adamw(self, group, params, grads, inv_scale, found_inf) -> None:
        states = [self.state[p] for p in params]
        beta1, beta2 = group["betas"]
        ops.adamw_step(
            params, grads, [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states],
            [s["step"] for s in states], masters=self._masters(params), lr=group["lr"], beta1=beta1, beta2=beta2,
            eps=group["eps"], weight_decay=group["weight_decay"], adam_w_mode=group["adam_w_mode"],
            bias_correction=group["bias_correction"], inv_scale=inv_scale, found_inf=found_inf,
        )

    def _step_muon(self, group, params, grads, inv_scale, found_inf) -> None:
        view = group["matrix_view"]
        if group["beta2"] is not None and any("second_momentum_buffer" not in self.state[p] for p in params):
            for p in params:  # beta2 was switched on after construction
                self._init_state(self._info[id(p)])
        states = [self.state[p] for p in params]
        as_matrices = lambda t: _as_matrices(t, view)  # noqa: E731
        ops.muon_step(
            [as_matrices(p) for p in params], [as_matrices(g) for g in grads],
            [as_matrices(s["momentum_buffer"]) for s in states],
            [s["second_momentum_buffer"] for s in states] if group["beta2"] is not None else [],
            masters=[as_matrices(m) for m in self._masters(params)], lr=group["lr"], momentum=group["momentum"],
            nesterov=group["nesterov"], beta2=group["beta2"], weight_decay=group["weight_decay"],
            ns_steps=group["ns_steps"], ns_coefficients=group["ns_coefficients"], lr_scale=group["lr_scale"],
            inv_scale=inv_scale, found_inf=found_inf, max_workspace_bytes=self.max_workspace_bytes,
        )

    # ------------------------------------------------------------------
    # Masters
    # ------------------------------------------------------------------

    @torch.no_grad()
    def update_param(self, param: torch.nn.Parameter, values: torch.Tensor) -> None:
        """Set a parameter and its master weights to `values`.

        `values` are FP32 with the param's full shape (any layout or device).
        The param is written as the master mode stores it (remainder split for
        BF16 + remainders, round-to-nearest-even otherwise). Moments and step
        counts are kept (created if absent). Everything is validated before
        anything is written. Not allowed during CUDA graph capture.
        """
        info = self._param_info(param)
        if not isinstance(values, torch.Tensor):
            raise TypeError(f"update_param: values must be a tensor, got {type(values).__name__}")
        if _is_dtensor(values):
            raise TypeError("update_param: DTensor values are not supported (this optimizer has no DTensor params)")
        if values.layout != torch.strided or values.is_meta:
            raise TypeError(f"update_param: values must be a dense tensor with data, got layout {values.layout} "
                            f"on {values.device}")
        if values.dtype != torch.float32:
            raise TypeError(f"update_param: values must be float32, got {values.dtype}")
        if tuple(values.shape) != tuple(param.shape):
            raise ValueError(f"update_param: values have shape {tuple(values.shape)} but {info.name} has shape "
                             f"{tuple(param.shape)}")
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("update_param: not allowed during CUDA graph capture")
        self._init_state(info)
        self._write_master(info, values.detach().to(param.device).contiguous())
        self._masters_from_params.discard(id(param))

    def _write_master(self, info: _ParamInfo, master: torch.Tensor) -> None:
        """Write an FP32 master (contiguous, on the param's device) into param and state."""
        p = info.param
        if info.master == "remainder":
            ops.split_master(master, p.data, self.state[p]["master_param"])
        else:
            if info.master == "fp32":
                self.state[p]["master_param"].copy_(master)
            p.data.copy_(master)  # copy_ rounds to nearest even for 16-bit params
        torch.autograd.graph.increment_version(p)

    def _sync_masters_from_params(self) -> None:
        for key in self._masters_from_params:
            p = self._info[key].param
            self.state[p]["master_param"].copy_(p.detach())
        self._masters_from_params.clear()

    def get_full_parameter_master(self, param: torch.nn.Parameter) -> Optional[torch.Tensor]:
        """A new FP32 tensor holding the param's full master weights.

        Reconstructed from remainders where they are used; the param's values
        for params without a separate master. Raises for params this optimizer
        does not own.
        """
        info = self._param_info(param)
        self._sync_masters_from_params()
        state = self.state[param]
        if info.master == "remainder":
            return ops.merge_master(param.detach(), state["master_param"])
        if info.master == "fp32":
            return state["master_param"].detach().clone()
        return param.detach().float().clone()

    # ------------------------------------------------------------------
    # Checkpoints
    # ------------------------------------------------------------------

    def state_dict(self) -> dict:
        """torch's layout, with every master stored as an FP32 tensor (portable
        between remainder and non-remainder configurations). Runs the hooks of
        `register_state_dict_pre_hook` / `register_state_dict_post_hook`."""
        for hook in self._optimizer_state_dict_pre_hooks.values():
            hook(self)
        state_dict = optimizer_state_dict(self)
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
        load_optimizer_state(self, state_dict)
        self._buckets = None
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)


class _GradScalerInputs:
    """inv_scale and found_inf from torch.amp.GradScaler, per device, without host syncs."""

    def __init__(self, grad_scale: Optional[torch.Tensor], found_inf: Optional[torch.Tensor]):
        self.grad_scale, self.found_inf = grad_scale, found_inf
        self.cache: Dict[torch.device, Tuple] = {}

    def on(self, device: torch.device):
        if device not in self.cache:
            inv = None
            if self.grad_scale is not None:
                inv = self.grad_scale.to(device, non_blocking=True).double().reciprocal().float().reshape(1)
            found = None if self.found_inf is None else self.found_inf.to(device, non_blocking=True).float().reshape(1)
            self.cache[device] = (inv, found)
        return self.cache[device]


def _device_lr(lr, device: torch.device) -> torch.Tensor:
    """lr as a one-element float32 tensor on `device` (a float32 tensor already there is kept)."""
    if isinstance(lr, torch.Tensor):
        if lr.dtype == torch.float32 and lr.device == device and lr.numel() == 1:
            return lr
        return lr.detach().to(device=device, dtype=torch.float32).reshape(())
    return torch.tensor(float(lr), dtype=torch.float32, device=device)


def _check_lr_tensor(index: int, lr: torch.Tensor, params) -> None:
    """A tensor lr must sit where the kernels can read it: on the CPU (its value
    is read on the host, so it is checked here too) or on every param's device."""
    if lr.device.type == "cpu":
        value = float(lr)
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"param group {index}: lr must be finite and >= 0, got {value}")
        return
    for p in params:
        if p.device != lr.device:
            raise ValueError(f"param group {index}: lr is on {lr.device} but a param is on {p.device}")


def _is_real(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_number(where: str, name: str, value, low: float, below: Optional[float] = None) -> None:
    """A finite real in [low, below) (or [low, inf) without `below`)."""
    if not _is_real(value):
        raise TypeError(f"{where}: {name} must be a number, got {type(value).__name__}")
    if not math.isfinite(value) or value < low or (below is not None and value >= below):
        bound = f"[{low}, {below})" if below is not None else f">= {low}"
        raise ValueError(f"{where}: {name} must be in {bound}, got {value}")


def _check_bool(where: str, name: str, value) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{where}: {name} must be True or False, got {value!r}")


def _check_lr(where: str, lr) -> None:
    if isinstance(lr, torch.Tensor):
        if lr.dtype != torch.float32 or lr.numel() != 1:
            raise TypeError(f"{where}: a tensor lr must hold one float32 element, got {lr.dtype} "
                            f"with {lr.numel()} elements")
        return
    _check_number(where, "lr", lr, low=0.0)


def _label(group: int, kind: str, index: int, name: Optional[str]) -> str:
    """How messages name a param: 'param group 1 (muon), param 3 'layers.0.w''."""
    return f"param group {group} ({kind}), param {index}" + (f" '{name}'" if name else "")


def _is_dtensor(t) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        return False
    return isinstance(t, DTensor)


def _check_param_type(p: torch.Tensor, label: str) -> None:
    if _is_dtensor(p):
        raise TypeError(f"{label} is a DTensor: sharded params are not supported yet (Muon on a local shard "
                        "would be silently wrong)")
    if not p.dtype.is_floating_point:
        raise TypeError(f"{label} has non-floating dtype {p.dtype}")
    if p.dtype not in _SUPPORTED_DTYPES:
        reason = "FP8 / quantized params are not supported yet" if p.element_size() == 1 else "unsupported dtype"
        raise TypeError(f"{label} has dtype {p.dtype}: {reason}; supported: float32, bfloat16, float16")
    base = p.data if isinstance(p, torch.nn.Parameter) else p
    if type(base) is not torch.Tensor:
        raise TypeError(f"{label} is a {type(base).__name__}: tensor subclasses (quantized params) are not "
                        "supported yet")


def _matrix_shape(p: torch.Tensor, view: str, label: str) -> Tuple[int, int]:
    """(rows, cols) of the matrices a Muon param is made of, by matrix_view."""
    if p.dim() == 2:
        return tuple(p.shape)
    if p.dim() < 2:
        raise ValueError(f"{label} has shape {tuple(p.shape)}: Muon needs matrices (rank >= 2); "
                         "put vectors and scalars in an 'adamw' group")
    if view == "flatten":
        return (p.shape[0], math.prod(p.shape[1:]))
    if view == "batch":
        return tuple(p.shape[-2:])
    raise ValueError(f"{label} has rank {p.dim()} (shape {tuple(p.shape)}): set the group's matrix_view to "
                     "'flatten' (view(shape[0], -1)) or 'batch' (leading dims index matrices)")


def _as_matrices(t: torch.Tensor, view: str) -> torch.Tensor:
    """The kernel's view of a Muon param-shaped tensor: [..., rows, cols]."""
    if t.dim() > 2 and view == "flatten":
        return t.view(t.shape[0], -1)
    return t


def _second_moment_shape(p: torch.Tensor, view: str) -> Tuple[int, ...]:
    rows, cols = _matrix_shape(p, view, "")
    lead = tuple(p.shape[:-2]) if (p.dim() > 2 and view == "batch") else ()
    return lead + ((rows, 1) if rows >= cols else (1, cols))
