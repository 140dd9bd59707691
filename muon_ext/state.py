"""Per-param optimizer state: which params the optimizer owns, their master
modes, creating their state, and reading and writing their FP32 masters."""

from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from . import ops
from ._shapes import muon_stats_shape
from ._types import MasterMode, ParamInfo, is_dtensor
from .distributed.placements import local
from .distributed.state import check_values as check_dtensor_values, stats_follow_rows, wrap as dtensor_like
from .distributed.state import zeros as dtensor_zeros
from .schema import label
from .writers import ParamWriterError, WriterEntry, is_quantized, quantized_writer, run_writer, storage_held

__all__ = ["master_mode", "check_master_values", "is_rounding_of", "OptimizerState"]


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
    tensor of the param's shape (any layout or device) whose storage holds it."""
    if not isinstance(values, torch.Tensor):
        raise TypeError(f"update_param: values must be a tensor, got {type(values).__name__}")
    if is_dtensor(values) or is_dtensor(info.param):
        check_dtensor_values(info, values)
        return
    if values.layout != torch.strided or values.is_meta:
        raise TypeError(f"update_param: values must be a dense tensor with data, got layout {values.layout} "
                        f"on {values.device}")
    if values.dtype != torch.float32:
        raise TypeError(f"update_param: values must be float32, got {values.dtype}")
    if tuple(values.shape) != tuple(info.param.shape):
        raise ValueError(f"update_param: values have shape {tuple(values.shape)} but {info.name} has shape "
                         f"{tuple(info.param.shape)}")
    problem = ops.storage_problem(values)  # reading them would go out of bounds
    if problem:
        raise ValueError(f"update_param: values for {info.name}: {problem}")


class OptimizerState:
    """The params an optimizer owns (a ParamInfo each) and their state in
    `tensors`, the optimizer's `state` mapping (param -> dict of tensors).

    Masters may be pending after a checkpoint load, settled at their next use
    (a step, `read_master`, a state dict) so that model weights loaded after
    the optimizer state still count (docs/design.md, "Checkpoints"):
      * "param": no saved master; the param, as then loaded, is the master.
      * "loaded": a saved FP32 master; it stays the master where the param is
        then still a rounding of it, and the param is rewritten from it.
      * "remainder": saved int16 remainders; the master is merged from the
        param as then loaded.
    """

    def __init__(self, tensors: Dict, master_weights, store_param_remainders: bool):
        self.tensors = tensors
        self.master_weights = master_weights
        self.store_param_remainders = store_param_remainders
        self.infos: Dict[int, ParamInfo] = {}  # by id(param)
        # id(param) -> (kind, tensor or None), kinds as in the class docstring.
        # The tensor is what settling needs and the live state does not hold:
        # "loaded": the BF16 param as written (remainder mode; with the
        # remainder it is the master) or the master itself (no separate
        # master); None in FP32-master mode, whose master tensor holds it.
        # "remainder": the saved remainders (modes without int16 state).
        self._pending: Dict[int, Tuple[str, Optional[torch.Tensor]]] = {}
        # Params whose writer failed at its last call (id -> info): retried at the end of the next step.
        self.stale_writers: Dict[int, ParamInfo] = {}
        self._writer_failures: List[Tuple[str, BaseException]] = []  # of the current call

    # -- the params -------------------------------------------------------

    def register(self, index: int, group: dict, names: Optional[Sequence[Optional[str]]] = None) -> List[ParamInfo]:
        """Adds group `index`'s params to the table (their state is not created); returns their infos."""
        params, kind = group["params"], group["kind"]
        names = list(names or ()) or [None] * len(params)
        infos = []
        for i, (p, name) in enumerate(zip(params, names)):
            if is_quantized(p):  # its FP32 master is kept beside it and quantize_ writes it
                info = ParamInfo(p, index, i, kind, "fp32", label(index, kind, i, name),
                                 WriterEntry(quantized_writer, default=True))
            else:
                info = ParamInfo(p, index, i, kind, master_mode(p, self.master_weights, self.store_param_remainders),
                                 label(index, kind, i, name))
            infos.append(info)
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
        def zeros(shape, dtype=torch.float32, like_param=True, rows_only=False):
            if is_dtensor(p):  # on the param's mesh, split like it or replicated (distributed/state.py)
                return dtensor_zeros(p, shape, dtype, like_param, rows_only)
            return torch.zeros(shape, dtype=dtype, device=p.device)

        if info.kind == "adamw":
            state.setdefault("step", zeros((), like_param=False))
            state.setdefault("exp_avg", zeros(p.shape))
            state.setdefault("exp_avg_sq", zeros(p.shape))
        else:
            state.setdefault("momentum_buffer", zeros(p.shape))
            if group["beta2"] is not None:
                state.setdefault("second_momentum_buffer", zeros(muon_stats_shape(p, group),
                                                                 like_param=stats_follow_rows(p, group), rows_only=True))
        if info.master == "remainder":
            state.setdefault("master_param", zeros(p.shape, torch.int16))
        elif info.master == "fp32" and "master_param" not in state:
            values = p.dequantize() if is_quantized(p) else p.detach()
            state["master_param"] = values.float().clone()

    def masters(self, params: Iterable[torch.Tensor]) -> List[torch.Tensor]:
        """The separate masters (FP32 or int16 remainders) of `params`, as the kernels take them."""
        tensors = self.tensors
        return [tensors[p]["master_param"] for p in params if "master_param" in tensors[p]]

    # -- masters ----------------------------------------------------------

    def write_master(self, info: ParamInfo, master: torch.Tensor) -> None:
        """Writes an FP32 master (contiguous, on the param's device) into the
        param and its state; a param with a writer is written by its writer."""
        p, master = info.param, local(master)  # DTensor params: each rank writes its local part
        if info.writer is not None:
            self.tensors[p]["master_param"].copy_(master)
            # The writer reads `master`, on the param's device: with offload="cpu"
            # the state entry is a view into a CPU slab.
            self.run_writer(info, master, None)
        elif info.master == "remainder":
            ops.split_master(master, local(p.data), local(self.tensors[p]["master_param"]))
        else:
            if info.master == "fp32":
                local(self.tensors[p]["master_param"]).copy_(master)
            local(p.data).copy_(master)  # copy_ rounds to nearest even for 16-bit params
        torch.autograd.graph.increment_version(p)
        self._pending.pop(id(p), None)

    def read_master(self, info: ParamInfo) -> torch.Tensor:
        """A new FP32 tensor holding the param's full master."""
        self.resolve_pending()
        p = info.param
        if info.master == "remainder":
            merged = ops.merge_master(local(p), local(self.tensors[p]["master_param"]))
            return dtensor_like(merged, p) if is_dtensor(p) else merged
        if info.master == "fp32":
            return self.tensors[p]["master_param"].detach().clone()
        return p.detach().float().clone()

    def load_master(self, info: ParamInfo, master: torch.Tensor) -> None:
        """Writes a master loaded from a checkpoint (FP32, contiguous, on the
        param's device) and keeps it pending, so that model weights loaded
        afterwards do not replace it as long as they are a rounding of it."""
        self.write_master(info, master)
        p = info.param
        if info.writer is not None:
            return  # the param holds no rounding of the master for model weights to overwrite
        if info.master == "remainder":
            kept = local(p).clone()  # with the remainder, the master; model weights may overwrite the param
        elif info.master == "fp32":
            kept = None  # the master tensor holds it
        else:
            kept = local(master).clone()  # the param is the master: model weights overwrite it
        self._pending[id(p)] = ("loaded", kept)

    def load_remainder(self, info: ParamInfo, remainder: torch.Tensor) -> None:
        """Takes int16 remainders from a checkpoint (TransformerEngine style,
        on the param's device): the master is the BF16 param, as the model
        weights leave it, merged with them."""
        p = info.param
        if info.writer is not None:  # the BF16 param is live (checked before loading): merge now
            self.write_master(info, ops.merge_master(p.detach(), remainder))
        elif info.master == "remainder":
            # The pair (param, remainder) is the master whenever it is read.
            self.tensors[p]["master_param"].copy_(remainder)
            self._pending.pop(id(p), None)
        else:
            self._pending[id(p)] = ("remainder", local(remainder).clone())

    # -- writers ----------------------------------------------------------

    def run_writer(self, info: ParamInfo, master: torch.Tensor, found_inf: Optional[torch.Tensor]) -> None:
        """Runs the param's writer; a failure is recorded, not raised, so that
        the call completes (docs/design.md, "Every call completes or changes
        nothing"): `raise_writer_failures` reports it at the call's end."""
        try:
            run_writer(info, master, found_inf)
        except Exception as exc:
            self.stale_writers[id(info.param)] = info
            self._writer_failures.append((info.name, exc))
        else:
            self.stale_writers.pop(id(info.param), None)

    def begin_call(self) -> None:
        """Forgets writer failures of an earlier call that raised before reporting them."""
        self._writer_failures = []

    def raise_writer_failures(self, what: str) -> None:
        """Raises ParamWriterError for the writers that failed in this call, if any."""
        failures, self._writer_failures = self._writer_failures, []
        if failures:
            raise ParamWriterError(what, failures)

    def set_writer(self, info: ParamInfo, entry: WriterEntry) -> None:
        """Gives the param a writer and an FP32 master tensor, converted exactly from its current master."""
        if info.master != "fp32":  # an FP32 master tensor is kept as it is (offload: a view into its slab)
            self.tensors[info.param]["master_param"] = self.read_master(info)
        info.master, info.writer = "fp32", entry

    def clear_writer(self, info: ParamInfo) -> None:
        """Removes the param's writer: its dtype's master mode again, the param
        written from its master. On failure the writer, mode and FP32 master are
        put back (the caller has checked the param, so none is expected)."""
        p, state = info.param, self.tensors[info.param]
        master, before = state["master_param"], (info.master, info.writer)
        info.master, info.writer = master_mode(p, self.master_weights, self.store_param_remainders), None
        try:
            if info.master == "remainder":
                state["master_param"] = torch.zeros(p.shape, dtype=torch.int16, device=p.device)
            elif info.master == "none":
                del state["master_param"]
            self.write_master(info, master)
        except BaseException:
            info.master, info.writer = before
            state["master_param"] = master
            raise
        self.stale_writers.pop(id(p), None)

    def defer_master_read(self, info: ParamInfo) -> None:
        """Marks the param's FP32 master to be re-read from the param at its next use."""
        self._pending[id(info.param)] = ("param", None)

    def is_pending(self, info: ParamInfo) -> bool:
        """Whether the param's master waits to be settled against the param (see the class docstring)."""
        return id(info.param) in self._pending

    def resolve_pending(self) -> None:
        """Settles every pending master against its param as it is now
        (docs/design.md, "Checkpoints"). A param whose storage does not hold
        its elements (released) stays pending: reading it would be out of bounds."""
        if not self._pending:
            return
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            # Settling inside a graph would replay at every step, against stale loaded values.
            raise RuntimeError("masters loaded by load_state_dict are settled at their next use, which cannot be "
                               "captured in a CUDA graph: step once (or call get_full_parameter_master) before "
                               "capturing")
        for key in [k for k in self._pending if storage_held(local(self.infos[k].param))]:
            kind, kept = self._pending[key]
            info = self.infos[key]
            p = info.param
            if kind == "param":
                local(self.tensors[p]["master_param"]).copy_(local(p))
                del self._pending[key]
            elif kind == "remainder":
                self.write_master(info, ops.merge_master(local(p), kept))
            else:
                self._settle_loaded(info, kept)

    def _settle_loaded(self, info: ParamInfo, kept: Optional[torch.Tensor]) -> None:
        """The loaded master stays where the param is still what the load wrote
        or a rounding of the master; elsewhere the param's value becomes the
        master. The param is then rewritten from the master as the load did, so
        both load orders leave the same bits."""
        p = local(info.param)  # DTensor params: each rank settles its local part
        if info.master == "remainder":
            master, written = ops.merge_master(kept, local(self.tensors[info.param]["master_param"])), kept
        else:
            master = local(self.tensors[info.param]["master_param"]) if info.master == "fp32" else kept
            master = master.to(p.device)  # offloaded masters are on the CPU
            written = master.to(p.dtype)
        same = _same_bits(p, written)
        if bool(same.all()):  # as the load left it (the usual resume): one host sync, once, spares the full test
            del self._pending[id(info.param)]
            return
        keep = is_rounding_of(p, master) | same
        self.write_master(info, torch.where(keep, master, p.float()))

    def pending_positions(self) -> List[Tuple[int, int, str, Optional[torch.Tensor]]]:
        """(group, index, kind, kept tensor) of each param with a pending master, for pickling."""
        return [(info.group, info.index) + self._pending[key] for key, info in self.infos.items()
                if key in self._pending]

    def restore_pending(self, positions: Iterable[tuple], groups: List[dict]) -> None:
        """Marks the params at `positions` (from `pending_positions`) pending
        again; (group, index) pairs, pickled before masters were kept, are re-reads."""
        self._pending = {}
        for position in positions:
            g, i = position[:2]
            self._pending[id(groups[g]["params"][i])] = tuple(position[2:]) if len(position) > 2 else ("param", None)


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
