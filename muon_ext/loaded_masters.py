"""Masters loaded from a checkpoint, settled against the param at its next use.

`load_state_dict` may run before or after the model weights are loaded
(docs/design.md, "Checkpoints"). A loaded master therefore stays *pending*
until the param's next use (a step, a master read, a state dict), and is then
settled against the param as it is by that time, by where its master comes
from (its source):

  * "param": no saved master; the param, as then loaded, is the master.
  * "loaded": a saved FP32 master; it stays the master where the param is then
    still a rounding of it, and the param is rewritten from it.
  * "remainder": saved int16 remainders; the master is merged from the param
    as then loaded.

A master written in any other way (a step, `update_param`) is no longer pending.
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Tuple

import torch

from . import ops
from ._types import ParamInfo
from .distributed.placements import local
from .writers import storage_held

__all__ = ["PendingMasters", "load_master", "load_remainder", "is_rounding_of"]


class PendingMasters:
    """The pending masters of one optimizer's params (sources as in the module docstring)."""

    def __init__(self, states):
        """`states`: the optimizer's state.OptimizerState, whose masters these are."""
        self._states = states
        # id(param) -> (source, tensor or None). The tensor is what settling needs
        # and the live state does not hold: "loaded": the BF16 param as written
        # (remainder mode; with the remainder it is the master) or the master
        # itself (no separate master); None in FP32-master mode, whose master
        # tensor holds it. "remainder": the saved remainders (modes without
        # int16 state).
        self._pending: Dict[int, Tuple[str, Optional[torch.Tensor]]] = {}

    def mark(self, info: ParamInfo, source: str, kept: Optional[torch.Tensor] = None) -> None:
        self._pending[id(info.param)] = (source, kept)

    def forget(self, param: torch.Tensor) -> None:
        """The param's master was written: nothing to settle."""
        self._pending.pop(id(param), None)

    def __contains__(self, info: ParamInfo) -> bool:
        return id(info.param) in self._pending

    def resolve(self) -> None:
        """Settles every pending master against its param as it is now. A
        param whose storage does not hold its elements (released) stays
        pending: reading it would be out of bounds."""
        if not self._pending:
            return
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            # Settling inside a graph would replay at every step, against stale loaded values.
            raise RuntimeError("masters loaded by load_state_dict are settled at their next use, which cannot be "
                               "captured in a CUDA graph: step once (or call get_full_parameter_master) before "
                               "capturing")
        states = self._states
        for key in [k for k in self._pending if storage_held(local(states.infos[k].param))]:
            source, kept = self._pending[key]
            info = states.infos[key]
            p = info.param
            if source == "param":
                local(states.tensors[p]["master_param"]).copy_(local(p))
                del self._pending[key]
            elif source == "remainder":
                states.write_master(info, ops.merge_master(local(p), kept))
            else:
                self._settle_loaded(info, kept)

    def _settle_loaded(self, info: ParamInfo, kept: Optional[torch.Tensor]) -> None:
        """The loaded master stays where the param is still what the load wrote
        or a rounding of the master; elsewhere the param's value becomes the
        master. The param is then rewritten from the master as the load did, so
        both load orders leave the same bits."""
        states = self._states
        p = local(info.param)  # DTensor params: each rank settles its local part
        if info.master_mode == "remainder":
            master, written = ops.merge_master(kept, local(states.tensors[info.param]["master_param"])), kept
        else:
            master = local(states.tensors[info.param]["master_param"]) if info.master_mode == "fp32" else kept
            master = master.to(p.device)  # offloaded masters are on the CPU
            written = master.to(p.dtype)
        same = _same_bits(p, written)
        if bool(same.all()):  # as the load left it (the usual resume): one host sync, once, spares the full test
            del self._pending[id(info.param)]
            return
        keep = is_rounding_of(p, master) | same
        states.write_master(info, torch.where(keep, master, p.float()))

    def positions(self) -> List[Tuple[int, int, str, Optional[torch.Tensor]]]:
        """(group, index, source, kept tensor) of each param with a pending master, for pickling."""
        return [(info.group, info.index) + self._pending[key] for key, info in self._states.infos.items()
                if key in self._pending]

    def restore(self, positions: Iterable[tuple], groups: List[dict]) -> None:
        """Marks the params at `positions` (from `positions()`) pending again;
        (group, index) pairs, pickled before masters were kept, are re-reads."""
        self._pending = {}
        for position in positions:
            g, i = position[:2]
            self._pending[id(groups[g]["params"][i])] = tuple(position[2:]) if len(position) > 2 else ("param", None)


def load_master(states, info: ParamInfo, master: torch.Tensor) -> None:
    """Writes a master loaded from a checkpoint (FP32, contiguous, on the
    param's device) and keeps it pending, so that model weights loaded
    afterwards do not replace it as long as they are a rounding of it."""
    states.write_master(info, master)
    p = info.param
    if info.writer is not None:
        return  # the param holds no rounding of the master for model weights to overwrite
    if info.master_mode == "remainder":
        kept = local(p).clone()  # with the remainder, the master; model weights may overwrite the param
    elif info.master_mode == "fp32":
        kept = None  # the master tensor holds it
    else:
        kept = local(master).clone()  # the param is the master: model weights overwrite it
    states.pending.mark(info, "loaded", kept)


def load_remainder(states, info: ParamInfo, remainder: torch.Tensor) -> None:
    """Takes int16 remainders from a checkpoint (TransformerEngine style, on
    the param's device): the master is the BF16 param, as the model weights
    leave it, merged with them."""
    p = info.param
    if info.writer is not None:  # the BF16 param is live (checked before loading): merge now
        states.write_master(info, ops.merge_master(p.detach(), remainder))
    elif info.master_mode == "remainder":
        # The pair (param, remainder) is the master whenever it is read.
        states.tensors[p]["master_param"].copy_(remainder)
        states.pending.forget(p)
    else:
        states.pending.mark(info, "remainder", local(remainder).clone())


def is_rounding_of(values: torch.Tensor, master: torch.Tensor) -> torch.Tensor:
    """Where `values` (any float dtype) is a rounding of the FP32 `master`:
    either neighbour of the master in BF16, FP16 or `values`' dtype, converted
    to `values`' dtype to nearest even (as `model.load_state_dict` converts
    weights saved in another dtype), or NaN where the master is NaN.

    The neighbours cover every rounding that produces model weights: nearest
    even into any of these dtypes, the remainder split's round half up (BF16),
    and double roundings such as FP32 -> FP16 -> BF16. Elementwise on the
    values' device, no host sync."""
    dtype = values.dtype
    ok = torch.isnan(values) & torch.isnan(master)
    if dtype == torch.float32:
        ok |= values == master
    for fmt in {dtype, torch.bfloat16, torch.float16} - {torch.float32}:
        near = master.to(fmt)
        below = near.float() < master
        far = torch.nextafter(near, torch.where(below, torch.inf, -torch.inf).to(fmt))
        far = torch.where(near.float() == master, near, far)  # exact in fmt: one neighbour
        ok |= (values == near.to(dtype)) | (values == far.to(dtype))
    return ok


_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise bit equality of two tensors of one float dtype (NaN payloads included)."""
    if a.dtype != b.dtype:
        return torch.zeros(a.shape, dtype=torch.bool, device=a.device)
    kind = _INT_OF_SIZE[a.element_size()]
    return a.contiguous().view(kind) == b.contiguous().view(kind)
