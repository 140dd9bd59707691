"""Per-param optimizer state: which params the optimizer owns, their master
modes, creating their state, and reading and writing their FP32 masters."""

from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from . import ops
from ._shapes import second_moment_shape
from ._types import MasterMode, ParamInfo, is_dtensor
from .schema import label

__all__ = ["master_mode", "check_master_values", "OptimizerState"]


def master_mode(p: torch.Tensor, master_weights, store_param_remainders: bool) -> MasterMode:
    """How a param's FP32 master is kept: the param itself ("none"), int16
    remainders beside a BF16 param ("remainder"), or an FP32 tensor ("fp32")."""
    if p.dtype == torch.float32 or master_weights is False:
        return "none"
    if p.dtype == torch.bfloat16 and store_param_remainders:
        return "remainder"
    return "fp32"


def check_master_values(info: ParamInfo, values) -> None:
    """Raises unless `values` can become the param's FP32 master: a dense FP32
    tensor of the param's shape (any layout or device)."""
    if not isinstance(values, torch.Tensor):
        raise TypeError(f"update_param: values must be a tensor, got {type(values).__name__}")
    if is_dtensor(values):
        raise TypeError("update_param: DTensor values are not supported (this optimizer has no DTensor params)")
    if values.layout != torch.strided or values.is_meta:
        raise TypeError(f"update_param: values must be a dense tensor with data, got layout {values.layout} "
                        f"on {values.device}")
    if values.dtype != torch.float32:
        raise TypeError(f"update_param: values must be float32, got {values.dtype}")
    if tuple(values.shape) != tuple(info.param.shape):
        raise ValueError(f"update_param: values have shape {tuple(values.shape)} but {info.name} has shape "
                         f"{tuple(info.param.shape)}")


class OptimizerState:
    """The params an optimizer owns (a ParamInfo each) and their state in
    `tensors`, the optimizer's `state` mapping (param -> dict of tensors).

    Masters may be pending: an FP32 master to be re-read from its param before
    its next use (after loading a checkpoint without masters, so that model
    weights loaded later still become the masters).
    """

    def __init__(self, tensors: Dict, master_weights, store_param_remainders: bool):
        self.tensors = tensors
        self.master_weights = master_weights
        self.store_param_remainders = store_param_remainders
        self.infos: Dict[int, ParamInfo] = {}  # by id(param)
        self._pending: set = set()  # ids of params whose FP32 master is read from the param at next use

    # -- the params -------------------------------------------------------

    def register(self, index: int, group: dict, names: Optional[Sequence[Optional[str]]] = None) -> List[ParamInfo]:
        """Adds group `index`'s params to the table (their state is not created); returns their infos."""
        params, kind = group["params"], group["kind"]
        names = list(names or ()) or [None] * len(params)
        infos = [ParamInfo(p, index, i, kind, master_mode(p, self.master_weights, self.store_param_remainders),
                           label(index, kind, i, name))
                 for i, (p, name) in enumerate(zip(params, names))]
        for info in infos:
            self.infos[id(info.param)] = info
        return infos

    def info(self, param) -> ParamInfo:
        """The param's info; raises unless it is the very param the optimizer owns."""
        info = self.infos.get(id(param))
        if info is None or info.param is not param:
            raise ValueError("param is not a parameter of this optimizer (pass the very nn.Parameter given to it, "
                             "not param.data or a view)")
        return info

    # -- state ------------------------------------------------------------

    def init(self, info: ParamInfo, group: dict) -> None:
        """Creates the param's missing state entries under `group`'s settings."""
        p, state = info.param, self.tensors[info.param]
        zeros = lambda shape: torch.zeros(shape, dtype=torch.float32, device=p.device)  # noqa: E731
        if info.kind == "adamw":
            state.setdefault("step", zeros(()))
            state.setdefault("exp_avg", zeros(p.shape))
            state.setdefault("exp_avg_sq", zeros(p.shape))
        else:
            state.setdefault("momentum_buffer", zeros(p.shape))
            if group["beta2"] is not None:
                state.setdefault("second_momentum_buffer", zeros(second_moment_shape(p, group["matrix_view"])))
        if info.master == "remainder":
            state.setdefault("master_param", torch.zeros(p.shape, dtype=torch.int16, device=p.device))
        elif info.master == "fp32":
            state.setdefault("master_param", p.detach().float().clone())

    def masters(self, params: Iterable[torch.Tensor]) -> List[torch.Tensor]:
        """The separate masters (FP32 or int16 remainders) of `params`, as the kernels take them."""
        tensors = self.tensors
        return [tensors[p]["master_param"] for p in params if "master_param" in tensors[p]]

    # -- masters ----------------------------------------------------------

    def write_master(self, info: ParamInfo, master: torch.Tensor) -> None:
        """Writes an FP32 master (contiguous, on the param's device) into the param and its state."""
        p = info.param
        if info.master == "remainder":
            ops.split_master(master, p.data, self.tensors[p]["master_param"])
        else:
            if info.master == "fp32":
                self.tensors[p]["master_param"].copy_(master)
            p.data.copy_(master)  # copy_ rounds to nearest even for 16-bit params
        torch.autograd.graph.increment_version(p)
        self._pending.discard(id(p))

    def read_master(self, info: ParamInfo) -> torch.Tensor:
        """A new FP32 tensor holding the param's full master."""
        self.resolve_pending()
        p = info.param
        if info.master == "remainder":
            return ops.merge_master(p.detach(), self.tensors[p]["master_param"])
        if info.master == "fp32":
            return self.tensors[p]["master_param"].detach().clone()
        return p.detach().float().clone()

    def defer_master_read(self, info: ParamInfo) -> None:
        """Marks the param's FP32 master to be re-read from the param at its next use."""
        self._pending.add(id(info.param))

    def resolve_pending(self) -> None:
        """Re-reads every pending FP32 master from its param."""
        for key in self._pending:
            p = self.infos[key].param
            self.tensors[p]["master_param"].copy_(p.detach())
        self._pending.clear()

    def pending_positions(self) -> List[Tuple[int, int]]:
        """(group, index) of each param with a pending master, for pickling."""
        return [(info.group, info.index) for info in self.infos.values() if id(info.param) in self._pending]

    def restore_pending(self, positions: Iterable[Tuple[int, int]], groups: List[dict]) -> None:
        """Marks the params at `positions` (from `pending_positions`) pending again."""
        self._pending = {id(groups[g]["params"][i]) for g, i in positions}
