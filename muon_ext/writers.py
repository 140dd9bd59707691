"""Param writers: code that stores a param from its new FP32 master in place
of the built-in low-precision writeback (docs/design.md, "Param writers").

A writer is called as `writer(param, master, stream, found_inf)`:
  * `param`: the nn.Parameter the optimizer owns (its storage may be released);
  * `master`: its new FP32 master, read-only for the writer;
  * `stream`: the CUDA stream to run on (the optimizer's current stream), None on the CPU;
  * `found_inf`: None, or the step's one-element FP32 GradScaler flag on the
    param's device; where it is nonzero the step was skipped and the writer
    must leave its outputs as they are (checked on the device, no host sync).
It runs once per param per step in which the param had a gradient, after the
param's bucket was updated, and from `update_param` / `load_state_dict`.

A writer may offer `check_param(param)`: called at registration, it raises
for a param the writer cannot store (Fp8Writer: buffers of another shape).

A writer that raises does not stop the call it runs in: the masters and state
are the call's result and the writer's outputs are stale. The call completes,
then raises `ParamWriterError` naming every failed param; each one's writer is
called again at the end of the next step (also without a grad) until it
succeeds (docs/design.md, "Every call completes or changes nothing").

Quantized params in TransformerEngine's sense (a tensor subclass with
`dequantize()` and `quantize_(src)`) get `quantize_` as their writer.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from dataclasses import dataclass
from typing import Callable, List, Optional

import torch

from . import ops
from ._types import ParamInfo, is_dtensor
from .amp import capturing

__all__ = ["WriterEntry", "ParamWriterError", "is_quantized", "quantized_writer", "check_registration",
           "check_master_settled", "check_unregistration", "check_released", "storage_held", "run_writer"]


class ParamWriterError(RuntimeError):
    """Raised at the end of a call (step, update_param, load_state_dict) in
    which param writers failed. The call itself completed: masters, state and
    step counts hold its result. `failures`: (param name, exception) pairs;
    their writers are retried at the end of the next step. In a call with
    DTensor params every rank of their meshes raises it (`ranks`: the global
    ranks whose writers failed, else None); names are then "rank r: name", and
    another rank's exception is a RemoteWriterFailure carrying its text."""

    def __init__(self, what: str, failures, ranks: Optional[List[int]] = None):
        self.failures = list(failures)
        self.ranks = None if ranks is None else sorted(ranks)
        where = "" if ranks is None else f" on rank(s) {self.ranks}"
        done = "completed" if ranks is None else "completed on every rank"
        # Another rank's exception (distributed.agreement.RemoteWriterFailure) names its own type.
        lines = "; ".join(f"{name}: {getattr(exc, 'type_name', type(exc).__name__)}: {exc}"
                          for name, exc in self.failures)
        super().__init__(f"{what}: {done} (masters and state updated), but the param writer of "
                         f"{len(self.failures)} param(s) failed{where}, whose outputs are stale until their writer "
                         f"succeeds (retried at the end of the next step): {lines}")


@dataclass(frozen=True)
class WriterEntry:
    """A registered writer. `storage` is the storage named at registration (a
    reference is kept, so the storage object cannot be freed and its identity
    reused while registered); `default` marks a quantized param's own writer."""

    writer: Callable
    storage: Optional[torch.UntypedStorage] = None
    default: bool = False


def is_quantized(p) -> bool:
    """Whether `p` follows the quantized-tensor protocol: a tensor subclass with `dequantize()` and `quantize_(src)`."""
    return (isinstance(p, torch.Tensor) and type(p) not in (torch.Tensor, torch.nn.Parameter)
            and callable(getattr(p, "quantize_", None)) and callable(getattr(p, "dequantize", None)))


def quantized_writer(param, master: torch.Tensor, stream, found_inf: Optional[torch.Tensor]) -> None:
    """The writer of a quantized param: `param.quantize_(master)`, passing the
    GradScaler flag as `noop_flag` where `quantize_` takes one (as
    TransformerEngine's do). Without it a skipped step re-quantizes the
    unchanged master, which stores the same values again."""
    with stream_context(stream):
        if found_inf is not None and _takes_noop_flag(type(param)):
            param.quantize_(master, noop_flag=found_inf)
        else:
            param.quantize_(master)


@functools.lru_cache(maxsize=None)
def _takes_noop_flag(cls: type) -> bool:
    """Whether `cls.quantize_` accepts `noop_flag` (looked up once per class, not at every step)."""
    try:
        return "noop_flag" in inspect.signature(cls.quantize_).parameters
    except (TypeError, ValueError):  # builtins without a signature
        return False


def stream_context(stream):
    """Runs the enclosed code on `stream` (a CUDA stream), or as is for None."""
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def _storage_of(p: torch.Tensor) -> Optional[torch.UntypedStorage]:
    """The param's storage, or None where it has none (a wrapper tensor subclass)."""
    try:
        return p.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None


def _same_storage(a: torch.UntypedStorage, b: torch.UntypedStorage) -> bool:
    # torch keeps one Python object per storage while it is referenced (the
    # entry holds one), and that object survives resize_(0), unlike the data
    # pointer: identity is the storage's identity.
    return a is b


def storage_held(p: torch.Tensor) -> bool:
    """Whether `p`'s storage holds every element its view addresses (a released storage does not)."""
    return not ops.storage_problem(p)


def check_registration(info: ParamInfo, writer, storage, *, staged: bool) -> bool:
    """Raises unless `writer` may be registered for the param: callable, none
    registered yet, `storage` None or the param's own storage object, a param
    kind writers support (`staged`: the optimizer's state is offloaded), and a
    master that can still be read. Reads and writes nothing; returns whether
    the param's storage is released."""
    name = f"register_param_writer: {info.name}"
    if capturing():
        raise RuntimeError("register_param_writer: not allowed during CUDA graph capture")
    if not callable(writer):
        raise TypeError(f"{name}: writer must be callable as writer(param, master, stream, found_inf), got "
                        f"{type(writer).__name__}")
    if info.writer is not None:
        what = "its quantize_ writer (a quantized param)" if info.writer.default else "a writer"
        raise ValueError(f"{name} already has {what}; unregister_param_writer(param) first")
    if is_dtensor(info.param):
        raise TypeError(f"{name}: writers for DTensor params are not supported")
    if storage is not None:
        if not isinstance(storage, torch.UntypedStorage):
            raise TypeError(f"{name}: storage must be the param's torch.UntypedStorage (param.untyped_storage()), "
                            f"got {type(storage).__name__}")
        own = _storage_of(info.param)
        if own is None or not _same_storage(own, storage):
            raise ValueError(f"{name}: storage is not the param's own storage object (pass param.untyped_storage())")
    check_param = getattr(writer, "check_param", None)
    if callable(check_param):  # what the writer can tell now, rather than at its first call in a step
        try:
            check_param(info.param)
        except Exception as exc:
            raise ValueError(f"{name}: the writer does not accept this param: {exc}") from exc
    if staged and (info.master_mode != "fp32" or (info.kind == "adamw" and info.param.is_cuda)):
        raise ValueError(f"{name}: with offload='cpu', writers are supported for params with a separate FP32 "
                         "master, stepped on their device (Muon params, or params on the CPU)")
    released = not storage_held(info.param)
    if released and info.master_mode != "fp32":
        kept = "int16 remainders complete" if info.master_mode == "remainder" else "the param is"
        raise ValueError(f"{name}: its storage is released, and its master ({kept} its values) cannot be read; "
                         "register the writer before releasing the storage")
    return released


def check_master_settled(info: ParamInfo, pending: bool) -> None:
    """A released param whose master, loaded from a checkpoint, waits for the param's values cannot get a writer."""
    if pending:
        raise ValueError(f"register_param_writer: {info.name}: its master, loaded from a checkpoint, waits for the "
                         "param's values, and its storage is released; restore the storage first")


def check_unregistration(info: ParamInfo) -> None:
    """Raises unless the param's writer may be removed: a writer the user
    registered, and the param's storage held (the optimizer then writes it)."""
    name = f"unregister_param_writer: {info.name}"
    if info.writer is None:
        raise ValueError(f"{name} has no registered writer")
    if info.writer.default:
        raise ValueError(f"{name} is a quantized param: it is always written through its quantize_")
    if capturing():
        raise RuntimeError("unregister_param_writer: not allowed during CUDA graph capture")
    if not storage_held(info.param):
        raise ValueError(f"{name}: its storage is released, and without a writer the optimizer writes the param "
                         "itself; restore the storage first")


def check_released(info: ParamInfo, where: str) -> None:
    """A param whose storage is released may be stepped, updated or loaded only
    through a writer registered with `storage=` naming that same storage."""
    p, entry = info.param, info.writer
    if entry is None:
        return  # the step's own check names a released storage (param_storage)
    if entry.default:
        return  # a quantized param keeps its data in its own fields
    if storage_held(p):
        return
    if entry.storage is None:
        raise ValueError(f"{where}{info.name}: its storage is released and its writer was registered without "
                         "storage=; register the writer with storage=param.untyped_storage() to accept that")
    own = _storage_of(p)
    if own is None or not _same_storage(own, entry.storage):
        raise ValueError(f"{where}{info.name}: its storage is released and is not the storage its writer was "
                         "registered with (the param's storage was replaced); register the writer again")


def run_writer(info: ParamInfo, master: torch.Tensor, found_inf: Optional[torch.Tensor]) -> None:
    """Calls the param's writer on the current stream of the master's device (exceptions propagate)."""
    stream = torch.cuda.current_stream(master.device) if master.is_cuda else None
    info.writer.writer(info.param, master, stream, found_inf)
