"""Per-param optimizer state: which params the optimizer owns, their master
modes, creating their state, and reading and writing their FP32 masters."""

from __future__ import annotations

import contextlib
import gc

from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from . import ops
from ._shapes import muon_stats_shape
from ._types import MasterMode, ParamInfo, is_dtensor
from .distributed.agreement import share_failures
from .distributed.placements import local
from .distributed.state import check_values as check_dtensor_values, stats_follow_rows, wrap as dtensor_like
from .distributed.state import zeros as dtensor_zeros
from .loaded_masters import PendingMasters
from .schema import label
from .writers import ParamWriterError, WriterEntry, is_quantized, quantized_writer, run_writer

__all__ = ["master_mode", "check_master_values", "OptimizerState"]


@contextlib.contextmanager
def gc_paused():
    """Python's cyclic garbage collector paused while a call makes or walks objects per param (construction,
    add_param_group, state_dict, load_state_dict; usable as a decorator). At 200k params such a call allocates
    about a million tensors and dicts, and every collection they trigger rescans all live objects: half of
    construction's time (bench/RESULTS.md, "Construction and checkpoints at scale"). Nothing made here forms
    cycles that need collecting now; the collector's previous setting is restored."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


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
    Masters loaded from a checkpoint may be pending in `pending`, settled at
    their next use (muon_ext.loaded_masters)."""

    def __init__(self, tensors: Dict, master_weights, store_param_remainders: bool):
        self.tensors = tensors
        self.master_weights = master_weights
        self.store_param_remainders = store_param_remainders
        self.infos: Dict[int, ParamInfo] = {}  # by id(param)
        self.pending = PendingMasters(self)
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

        # `key not in state` first: a load or an offload slab has made most entries, and a zero tensor made
        # only to be dropped (setdefault's argument) cost a third of a 200k-param load.
        if info.kind == "adamw":
            if "step" not in state:
                state["step"] = zeros((), like_param=False)
            for key in ("exp_avg", "exp_avg_sq"):
                if key not in state:
                    state[key] = zeros(p.shape)
        else:
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = zeros(p.shape)
            if group["beta2"] is not None and "second_momentum_buffer" not in state:
                state["second_momentum_buffer"] = zeros(muon_stats_shape(p, group),
                                                        like_param=stats_follow_rows(p, group), rows_only=True)
        if info.master_mode == "remainder":
            if "master_param" not in state:
                state["master_param"] = zeros(p.shape, torch.int16)
        elif info.master_mode == "fp32" and "master_param" not in state:
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
        elif info.master_mode == "remainder":
            ops.split_master(master, local(p.data), local(self.tensors[p]["master_param"]))
        else:
            if info.master_mode == "fp32":
                local(self.tensors[p]["master_param"]).copy_(master)
            local(p.data).copy_(master)  # copy_ rounds to nearest even for 16-bit params
        torch.autograd.graph.increment_version(p)
        self.pending.forget(p)

    def read_master(self, info: ParamInfo) -> torch.Tensor:
        """A new FP32 tensor holding the param's full master."""
        self.pending.resolve()
        p = info.param
        if info.master_mode == "remainder":
            merged = ops.merge_master(local(p), local(self.tensors[p]["master_param"]))
            return dtensor_like(merged, p) if is_dtensor(p) else merged
        if info.master_mode == "fp32":
            return self.tensors[p]["master_param"].detach().clone()
        return p.detach().float().clone()

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

    def raise_writer_failures(self, what: str, meshes: Sequence = ()) -> None:
        """Raises ParamWriterError for the writers that failed in this call, if
        any; with `meshes` ((mesh, device) pairs, a collective) on every rank
        of them where any rank's failed (agreement.share_failures)."""
        failures, self._writer_failures = self._writer_failures, []
        ranks = None
        if meshes:
            ranks, failures = share_failures(meshes, failures)
        if failures:
            raise ParamWriterError(what, failures, ranks)

    def set_writer(self, info: ParamInfo, entry: WriterEntry) -> None:
        """Gives the param a writer and an FP32 master tensor, converted exactly from its current master."""
        if info.master_mode != "fp32":  # an FP32 master tensor is kept as it is (offload: a view into its slab)
            self.tensors[info.param]["master_param"] = self.read_master(info)
        info.master_mode, info.writer = "fp32", entry

    def clear_writer(self, info: ParamInfo) -> None:
        """Removes the param's writer: its dtype's master mode again, the param
        written from its master. On failure the writer, mode and FP32 master are
        put back (the caller has checked the param, so none is expected)."""
        p, state = info.param, self.tensors[info.param]
        master, before = state["master_param"], (info.master_mode, info.writer)
        info.master_mode, info.writer = master_mode(p, self.master_weights, self.store_param_remainders), None
        try:
            if info.master_mode == "remainder":
                state["master_param"] = torch.zeros(p.shape, dtype=torch.int16, device=p.device)
            elif info.master_mode == "none":
                del state["master_param"]
            self.write_master(info, master)
        except BaseException:
            info.master_mode, info.writer = before
            state["master_param"] = master
            raise
        self.stale_writers.pop(id(p), None)
