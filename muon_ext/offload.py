"""CPU-staged optimizer state (MuonAdamW(offload="cpu")).

Every param's optimizer state (FP32 master, moments, AdamW step counter) lives
in CPU slabs, page-locked (registered with CUDA, not rounded up to a power of
two as torch's pinned blocks are) when the params are on CUDA; the per-param state entries
are views into them, so state_dict, checkpoints and get_full_parameter_master
read them without copies. A step then runs as a small state machine:

  * Muon chunks (consecutive matrices of one work item, at most `slot_numel`
    elements) take a staging slot in turn (round robin over `buffer_count`):
    the H2D stream copies the chunk's state from the slab into the slot, the
    compute stream runs the resident path's kernel on the slot's views and
    writes the param, the caller's stream waits on that (`compute_done`), the
    D2H stream copies the state back, and the slot is taken again only after
    that copy's event.
  * AdamW params (ZeRO-Offload style): their grads are copied D2H first, the
    CPU kernel updates master and moments in the slab and a pinned copy of the
    param, which the H2D stream writes back.

On a CPU device the same machine runs with plain buffers and no streams, so
CI tests the slot logic, residency, drain and the state views (docs/design.md,
"CPU-staged state").
"""

from __future__ import annotations

import contextlib
import os
import weakref
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch

from . import _C
from ._shapes import matrix_shape, muon_stats_shape, stats_layout_error
from ._types import ParamInfo, WorkItem, is_dtensor
from .runners import ResidentRunner
from .schema import label
from .writers import is_quantized

__all__ = ["OffloadConfig", "check_offload", "StagedRunner"]

OFFLOAD_MODES = ("none", "cpu")
RESIDENCIES = ("cpu_resident", "step_active", "staging_released")


@dataclass(frozen=True)
class OffloadConfig:
    """Staging of offloaded state: `buffer_count` GPU slots (>= 1; 2 overlaps
    copies with compute), each holding `slot_numel` matrix elements with their
    state (None: the largest Muon param). A Muon param is never split: one
    larger than `slot_numel` is refused at construction."""

    buffer_count: int = 2
    slot_numel: Optional[int] = None

    def __post_init__(self):
        for name, value, low in (("buffer_count", self.buffer_count, 1), ("slot_numel", self.slot_numel, 1)):
            if value is None and name == "slot_numel":
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"offload_config.{name} must be an int, got {type(value).__name__}")
            if value < low:
                raise ValueError(f"offload_config.{name} must be >= {low}, got {value}")


def check_offload(offload, offload_config, capturable: bool) -> Optional[OffloadConfig]:
    """The optimizer's offload arguments; the config to use, None for offload="none"."""
    if offload not in OFFLOAD_MODES:
        raise ValueError(f"offload must be 'none' or 'cpu', got {offload!r}")
    if offload_config is not None and not isinstance(offload_config, OffloadConfig):
        raise TypeError(f"offload_config must be a muon_ext.OffloadConfig, got {type(offload_config).__name__}")
    if offload == "none":
        if offload_config is not None:
            raise ValueError("offload_config is given but offload='none'; pass offload='cpu' to use it")
        return None
    if capturable:
        raise ValueError("offload='cpu' cannot be combined with capturable=True (a staged step is not a CUDA graph)")
    return offload_config or OffloadConfig()


# Upper bound of FP32 state values per param element, in a slab or a slot: master, momentum and
# NorMuon statistics (at most one per element) for Muon; master, exp_avg, exp_avg_sq for AdamW.
_STATE_PER_ELEMENT = 3


def _memory_of(device: torch.device) -> Optional[int]:
    """Bytes of memory `device` has (None where unknown)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


# --------------------------------------------------------------------------
# Slabs: where each param's state lives
# --------------------------------------------------------------------------


class _Layout:
    """One param's state in its slab: consecutive FP32 regions, (key, start, shape)
    from `offset`; `size` elements in all. A slot holds the same regions."""

    def __init__(self, info: ParamInfo, group: dict):
        p = info.param
        n = p.numel()
        regions: List[Tuple[str, Tuple[int, ...]]] = []
        if info.master_mode == "fp32":
            regions.append(("master_param", tuple(p.shape)))
        if info.kind == "muon":
            regions.append(("momentum_buffer", tuple(p.shape)))
            # Reserved even with beta2=None: NorMuon may be switched on later.
            regions.append(("second_momentum_buffer", muon_stats_shape(p, group)))
        else:
            regions += [("exp_avg", tuple(p.shape)), ("exp_avg_sq", tuple(p.shape)), ("step", ())]
        self.info = info
        self.group = group  # the optimizer's group dict (edited in place by users, schedulers and loads)
        self.numel = n
        self.regions = []
        start = 0
        for key, shape in regions:
            self.regions.append((key, start, shape))
            start += _prod(shape)
        self.size = start
        self.slab: Optional[torch.Tensor] = None
        self.offset = 0
        self.entries: Dict[str, torch.Tensor] = {}  # every region as a view of the slab

    def place(self, slab: torch.Tensor, offset: int) -> None:
        self.slab, self.offset = slab, offset
        self.entries = self.views(slab, offset)

    def state(self, group: dict) -> Dict[str, torch.Tensor]:
        """The slab views that are state entries under `group` (the second moment only while NorMuon is on)."""
        if "second_momentum_buffer" in self.entries and group["beta2"] is None:
            return {k: v for k, v in self.entries.items() if k != "second_momentum_buffer"}
        return self.entries

    def views(self, buffer: torch.Tensor, offset: int, group: Optional[dict] = None) -> Dict[str, torch.Tensor]:
        """The state entries as views of `buffer` from `offset` (with a `group`:
        the second moment only while its NorMuon is on)."""
        out = {}
        for key, start, shape in self.regions:
            if key == "second_momentum_buffer" and group is not None and group["beta2"] is None:
                continue
            out[key] = buffer[offset + start: offset + start + _prod(shape)].view(shape)
        return out


def _prod(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


# --------------------------------------------------------------------------
# Streams: CUDA streams and events, or nothing on the CPU
# --------------------------------------------------------------------------


class _CpuStreams:
    """The CPU twin: copies and kernels run in program order, nothing to wait for."""

    def begin(self) -> None:
        pass

    def copy(self, direction: str, pairs, after=None):
        for dst, src in pairs:
            dst.copy_(src)
        return None

    def computing(self, after, reads=()):
        return contextlib.nullcontext()

    def compute_done(self):
        return None

    def wait_host(self, event) -> None:
        pass

    def drain(self) -> None:
        pass


class _CudaStreams:
    """An H2D, a compute and a D2H stream on one device. Every wait is a
    stream-on-event wait; the host waits only in `wait_host` and `drain`."""

    def __init__(self, device: torch.device):
        self.device = device
        self.h2d = torch.cuda.Stream(device)
        self.compute = torch.cuda.Stream(device)
        self.d2h = torch.cuda.Stream(device)
        self.caller = None

    def begin(self) -> None:
        """Step start: every stream waits for the caller's current stream (grads
        ready, clipping done), and the copy streams for each other's earlier
        work (a new H2D reads what the last D2H wrote, and vice versa)."""
        self.caller = torch.cuda.current_stream(self.device)
        start = self.caller.record_event()
        for stream in (self.h2d, self.compute, self.d2h):
            stream.wait_event(start)
        self.h2d.wait_stream(self.d2h)
        self.d2h.wait_stream(self.h2d)

    def copy(self, direction: str, pairs, after=None):
        """Asynchronous copies (dst, src) on the `direction` stream ("h2d" or
        "d2h") after event `after`; returns the event of their completion."""
        stream = self.h2d if direction == "h2d" else self.d2h
        if after is not None:
            stream.wait_event(after)
        with torch.cuda.stream(stream):
            for dst, src in pairs:
                if src.is_cuda:
                    src.record_stream(stream)  # e.g. a grad the caller frees right after step()
                dst.copy_(src, non_blocking=True)
            return stream.record_event()

    @contextlib.contextmanager
    def computing(self, after, reads=()):
        """Makes the compute stream current (kernels, their workspaces, the
        param writer) after event `after`; `reads` (grads, made on any stream)
        are kept from reuse until it is done with them."""
        if after is not None:
            self.compute.wait_event(after)
        for t in reads:
            t.record_stream(self.compute)
        with torch.cuda.stream(self.compute):
            yield

    def compute_done(self):
        """Records compute_done; the caller's stream waits on it, so that a
        forward right after step() sees the new params."""
        done = self.compute.record_event()
        self.caller.wait_event(done)
        return done

    def wait_host(self, event) -> None:
        if event is not None:
            event.synchronize()

    def drain(self) -> None:
        # Every D2H waited for its compute and H2D: the D2H stream is the last of
        # them, except after a step that raised between a chunk's compute and its
        # D2H; the compute stream is waited for too, so no kernel still writes a
        # slot that release_staging hands back.
        self.d2h.synchronize()
        self.compute.synchronize()
        self.h2d.synchronize()


def _unregister_host_memory(buffer: torch.Tensor) -> None:
    # Also runs at interpreter exit, possibly after CUDA shut down: a refusal
    # there leaves nothing to undo.
    _C.unregister_host_memory(buffer.data_ptr())


def _page_locked_zeros(numel: int, owner: object) -> torch.Tensor:
    """A zeroed FP32 CPU tensor of `numel` elements in page-locked memory.

    torch's pinned allocator rounds every block up to a power of two (a slab
    just over 2^k bytes would pin 2^(k+1)), so the slab is a plain CPU tensor
    registered with CUDA instead (registered memory counts as pinned for
    is_pinned() and makes copies asynchronous). It is unregistered when
    `owner` is collected, or at exit; the finalizer holds the tensor until
    then, so its memory is never freed while registered, and views that
    outlive the owner stay valid pageable memory. Where CUDA refuses to
    register it, torch's pinned allocator is used.
    """
    slab = torch.zeros(numel, dtype=torch.float32)
    if numel == 0 or not _C.register_host_memory(slab.data_ptr(), slab.nbytes):
        return torch.zeros(numel, dtype=torch.float32, pin_memory=True)
    weakref.finalize(owner, _unregister_host_memory, slab)
    return slab


# --------------------------------------------------------------------------
# The staged state
# --------------------------------------------------------------------------


class _Slot:
    """A staging buffer and the event after which it may be refilled (its last D2H)."""

    def __init__(self, buffer: torch.Tensor):
        self.buffer = buffer
        self.free = None


class StagedRunner(ResidentRunner):
    """The runner of an optimizer with offloaded state (muon_ext.runners):
    slabs, slots and the staged step. `add` installs slab views in the state
    entries before the optimizer creates the rest of a param's state."""

    staged = True

    def __init__(self, config: OffloadConfig, states, max_workspace_bytes: int):
        super().__init__(states, max_workspace_bytes)
        self.config = config
        self.tensors = states.tensors
        self.layouts: Dict[int, _Layout] = {}  # by id(param)
        self.device: Optional[torch.device] = None
        self.streams = _CpuStreams()  # CUDA streams once a CUDA param joins
        self.slots: Optional[List[_Slot]] = None
        self.residency = "cpu_resident"
        self._host: Dict[Tuple[int, str], torch.Tensor] = {}  # (id(param), role/dtype) -> pinned AdamW buffer
        self._next_slot = 0
        self._grads_ready = None
        self._active = None  # the Muon chunk between acquire and release: (slot, D2H copies, compute context)

    def __getstate__(self):
        raise TypeError("an optimizer with offload='cpu' cannot be pickled or deep-copied (its state lives in pinned "
                        "slabs staged through device streams); save and load its state_dict() instead")

    # -- construction -----------------------------------------------------

    def check_group(self, index: int, group: dict, names: List[Optional[str]]) -> None:
        """Raises, naming the param, unless a new group's params can be offloaded:
        every param of the optimizer on one CPU or CUDA device, each Muon param
        within slot_numel. Run before the group is added."""
        device = self.device
        for i, p in enumerate(group["params"]):
            where = label(index, group["kind"], i, names[i])
            if is_dtensor(p):
                raise ValueError(f"{where} is a DTensor: offload='cpu' does not support distributed params yet")
            device = p.device if device is None else device
            if p.device != device or device.type not in ("cpu", "cuda"):
                raise ValueError(f"{where} is on {p.device}; with offload='cpu' every param must be on one CPU or "
                                 f"CUDA device (the first is on {device})")
            if group["kind"] == "adamw" and p.device.type == "cuda" and is_quantized(p):
                raise ValueError(f"{where} is a quantized param: with offload='cpu', AdamW params on CUDA are "
                                 "updated on the CPU and cannot be written through its quantize_; put it in a "
                                 "Muon group or keep offload='none'")
            if group["kind"] == "muon" and self.config.slot_numel is not None and p.numel() > self.config.slot_numel:
                rows, cols = matrix_shape(p, group["matrix_view"], where)
                raise ValueError(f"{where} has {p.numel()} elements ({rows}x{cols} matrices), more than "
                                 f"offload_config.slot_numel={self.config.slot_numel}; a param is never split "
                                 "across slots: raise slot_numel (or leave it None: the largest Muon param)")
        self._check_memory(device, group)

    def _check_memory(self, device: Optional[torch.device], group: dict) -> None:
        """At construction, not at the first step: the slab (CPU memory) and the
        staging slots (the params' device) must fit in the memory there is. The
        bounds are generous (3 FP32 values of state per element at most), so
        this refuses only sizes that cannot be allocated."""
        if device is None:
            return
        numel = sum(layout.numel for layout in self.layouts.values())
        muon = sum(layout.numel for layout in self.layouts.values() if layout.info.kind == "muon")
        new = sum(p.numel() for p in group["params"])
        muon += new if group["kind"] == "muon" else 0
        limit = muon if self.config.slot_numel is None else min(self.config.slot_numel, muon)
        needs = [("CPU memory for the offloaded state slabs", 4 * _STATE_PER_ELEMENT * (numel + new),
                  torch.device("cpu")),
                 (f"{device} memory for offload_config.buffer_count={self.config.buffer_count} staging slots of "
                  f"{limit} matrix elements", 4 * _STATE_PER_ELEMENT * limit * self.config.buffer_count, device)]
        for what, nbytes, where in needs:
            total = _memory_of(where)
            if total is not None and nbytes > total:
                raise ValueError(f"offload='cpu': {what} need up to {nbytes} bytes, more than the {total} bytes "
                                 f"{where} has; lower offload_config.slot_numel or buffer_count")

    def add(self, infos: List[ParamInfo], group: dict) -> None:
        """Puts a checked group's state into a new slab: the FP32 master from
        the param, zero moments, as views in their state entries."""
        if not infos:
            return
        layouts = [_Layout(info, group) for info in infos]
        device = self.device = infos[0].param.device
        slab = self._new_slab(sum(layout.size for layout in layouts))
        offset = 0
        for layout in layouts:
            layout.place(slab, offset)
            offset += layout.size
            views = layout.state(group)
            if "master_param" in views:
                views["master_param"].copy_(layout.info.param.detach())
            self.tensors[layout.info.param].update(views)
            self.layouts[id(layout.info.param)] = layout
        if device.type == "cuda" and not isinstance(self.streams, _CudaStreams):
            self.streams = _CudaStreams(device)
        self._fit_slots()

    def _new_slab(self, numel: int) -> torch.Tensor:
        if self.device.type == "cuda":
            return _page_locked_zeros(numel, self)
        return torch.zeros(numel, dtype=torch.float32)

    def _fit_slots(self) -> None:
        if self.slots is not None and self._slot_size() > (self.slots[0].buffer.numel() if self.slots else 0):
            self._free_slots()  # a larger param joined: new slots at the next step

    def _relayout(self, layout: _Layout) -> None:
        """Moves a param's state to a slab of its own, laid out for its group's row_blocks now: NorMuon switched
        on after an edit of row_blocks, or a checkpoint's statistics for other blocks loaded while it was off
        (the resident path makes the statistics then, in the new shape; the old region was never used)."""
        moved = _Layout(layout.info, layout.group)
        moved.place(self._new_slab(moved.size), 0)
        entry = self.tensors[layout.info.param]
        for key, view in layout.entries.items():
            if key != "second_momentum_buffer":
                moved.entries[key].copy_(view)
                if entry.get(key) is view:
                    entry[key] = moved.entries[key]
        self.layouts[id(layout.info.param)] = moved
        self._fit_slots()

    # -- state entries ----------------------------------------------------

    def check_entries(self, infos, *, required: bool) -> None:
        """Raises, naming the param and key, for a state entry that is missing
        where `required` (a step; the NorMuon statistics are made when NorMuon
        is switched on) or neither its slab view nor an FP32 tensor of its
        shape (which `adopt` copies in)."""
        for info in infos:
            layout = self.layouts[id(info.param)]
            entry = self.tensors[info.param]
            stats = entry.get("second_momentum_buffer")
            if required and stats is not None and layout.group["beta2"] is not None:
                # The resident planner refuses statistics of another layout the same way (a row_blocks edit).
                error = stats_layout_error(info.name, info.param, layout.group, stats.shape)
                if error is not None:
                    raise error
            for key, view in layout.entries.items():
                value = entry.get(key)
                if value is None and required and key != "second_momentum_buffer":
                    raise ValueError(f"{info.name}: optimizer state '{key}' is missing (load a checkpoint or build a "
                                     "new optimizer)")
                if value is None or value is view or (isinstance(value, torch.Tensor) and _same_view(value, view)):
                    continue
                shape = tuple(view.shape)
                if not isinstance(value, torch.Tensor) or value.dtype != torch.float32 or \
                        tuple(value.shape) != shape or value.layout != torch.strided:
                    got = f"{value.dtype} {tuple(value.shape)}" if isinstance(value, torch.Tensor) else \
                        type(value).__name__
                    raise ValueError(f"{info.name}: optimizer state '{key}' must be a float32 tensor of shape {shape} "
                                     f"(offloaded state lives in CPU slabs), got {got}")

    def check_access(self, infos) -> None:
        """Before state is read or written outside a step: the last step's
        copies settled (the CPU copy is then the state), and each entry its
        slab view or an FP32 tensor of its shape (a load may restore missing ones)."""
        self.drain()
        self.check_entries(infos, required=False)

    def adopt(self, groups: List[dict]) -> None:
        """Makes every state entry its slab view again: an entry replaced (a
        checkpoint load creating one) is copied in; a missing second moment
        (NorMuon switched on) starts at zero. Run after `check_entries`."""
        stale = [layout for layout in self.layouts.values() if "second_momentum_buffer" in layout.state(layout.group)
                 and layout.entries["second_momentum_buffer"] is not self.tensors[layout.info.param].get(
                     "second_momentum_buffer")
                 and stats_layout_error("", layout.info.param, layout.group,
                                        layout.entries["second_momentum_buffer"].shape) is not None]
        if stale:
            self.drain()  # the last step's copies may still write the old slab regions
        for layout in stale:
            self._relayout(layout)
        todo = []
        for layout in list(self.layouts.values()):
            entry, group = self.tensors[layout.info.param], groups[layout.info.group]
            for key, view in layout.state(group).items():
                value = entry.get(key)
                if value is not view and (value is None or not _same_view(value, view)):
                    todo.append((entry, key, view, value))
        if todo:
            self.drain()  # the last step's copies may still write these slab regions
        for entry, key, view, value in todo:
            if value is None:
                view.zero_()
            else:
                view.copy_(value)
            entry[key] = view

    # -- residency --------------------------------------------------------

    def drain(self) -> None:
        """Waits for every outstanding copy; the CPU state is then authoritative. Idempotent."""
        if self.streams is not None:
            self.streams.drain()
        if self.residency == "step_active":
            self.residency = "cpu_resident"

    def release_staging(self) -> None:
        """Drains, then hands the slots' device memory back to the allocator."""
        self.drain()
        self._free_slots()
        self.residency = "staging_released"

    def restore_staging(self) -> None:
        """Takes the slots back (allocated now); a no-op unless released."""
        if self.residency == "staging_released":
            self._alloc_slots()
            self.residency = "cpu_resident"

    def _slot_size(self) -> int:
        """Elements of one slot: any chunk of at most slot_numel matrix elements
        fits with its state (each param's state per element is bounded)."""
        muon = [layout for layout in self.layouts.values() if layout.info.kind == "muon" and layout.numel]
        if not muon:
            return 0
        limit = self._slot_numel()
        return max((layout.size * limit + layout.numel - 1) // layout.numel for layout in muon)

    def _slot_numel(self) -> int:
        if self.config.slot_numel is not None:
            # No chunk holds more than every Muon element: a larger slot_numel would only allocate unused memory.
            every = sum(layout.numel for layout in self.layouts.values() if layout.info.kind == "muon")
            return min(self.config.slot_numel, every)
        return max((layout.numel for layout in self.layouts.values() if layout.info.kind == "muon"), default=0)

    def _alloc_slots(self) -> None:
        size = self._slot_size()
        self.slots = [_Slot(torch.empty(size, dtype=torch.float32, device=self.device))
                      for _ in range(self.config.buffer_count)] if size else []
        self._next_slot = 0

    def _free_slots(self) -> None:
        self.drain()  # the slots' last copies must be done before their memory is reused
        self.slots = None

    # -- the staged step --------------------------------------------------

    def check_step(self) -> None:
        """What a step needs beyond the planner's checks, before anything is written:
        staging held, every state entry in place."""
        if self.residency == "staging_released":
            raise RuntimeError("step(): the staging slots were released (release_staging()); call "
                               "restore_staging() before stepping")
        self.check_entries((layout.info for layout in self.layouts.values()), required=True)

    def run(self, work: List, groups: List[dict], scalers) -> None:
        """One staged step over the planned `work` ((item, state, checked) triples, every
        check passed, `check_step` too): Muon items cut into slot-sized chunks
        first, AdamW items last (their CPU update overlaps the Muon pipeline on
        CUDA), each acquired, run and released as the resident runner runs it."""
        self.adopt(groups)
        if self.slots is None:
            self._alloc_slots()
        self.streams.begin()
        self.residency = "step_active"
        muon, adamw = [], []
        for item, state, _ in work:  # the planner's tokens cover its lists, not the slots'
            if item.bucket.kind == "muon":
                muon += [(chunk, state, None) for chunk in self._chunks(item)]
            else:
                adamw.append((item, state, None))
        self._grads_ready = self._copy_adamw_grads([item for item, _, _ in adamw])
        try:
            super().run(muon + adamw, groups, scalers)
        finally:
            self._leave_compute()

    def _chunks(self, item: WorkItem) -> List[WorkItem]:
        """Consecutive params of `item` whose matrices fit one slot together."""
        limit, chunks, start, used = self._slot_numel(), [], 0, 0
        for i, p in enumerate(item.params):
            if i > start and used + p.numel() > limit:
                chunks.append(WorkItem(item.bucket, item.group, item.params[start:i], item.grads[start:i], item.blocks))
                start, used = i, 0
            used += p.numel()
        chunks.append(WorkItem(item.bucket, item.group, item.params[start:], item.grads[start:], item.blocks))
        return chunks

    def acquire(self, item: WorkItem, state=None) -> Tuple[WorkItem, Dict[str, List[torch.Tensor]]]:
        """The item to run the kernel on and its state lists: a Muon chunk's
        state copied into the next slot (after that slot's last D2H), with the
        compute stream made current; an AdamW item's CPU state (and, on CUDA,
        pinned copies of its params and grads)."""
        if item.bucket.kind == "adamw":
            return self._acquire_adamw(item)
        slot = self.slots[self._next_slot]
        self._next_slot = (self._next_slot + 1) % len(self.slots)
        pairs, views, at = [], [], 0
        for p in item.params:
            layout = self.layouts[id(p)]
            pairs.append((slot.buffer[at: at + layout.size], layout.slab[layout.offset: layout.offset + layout.size]))
            views.append(layout.views(slot.buffer, at, item.group))
            at += layout.size
        pairs = _merge(pairs)
        loaded = self.streams.copy("h2d", pairs, after=slot.free)
        self._active = (slot, [(src, dst) for dst, src in pairs], self.streams.computing(loaded, item.grads))
        self._active[2].__enter__()
        return item, {key: [v[key] for v in views] for key in views[0]}

    def release(self, item: WorkItem) -> None:
        """A Muon chunk: compute_done (the caller waits on it), the state back
        to the slab on the D2H stream, the slot free after that copy. An AdamW
        item: its pinned params back to the device params."""
        if item.bucket.kind == "adamw":
            self._release_adamw(item)
            return
        slot, back, context = self._active
        self._active = None
        done = self.streams.compute_done()
        context.__exit__(None, None, None)
        slot.free = self.streams.copy("d2h", back, after=done)

    def _leave_compute(self) -> None:
        """After an exception inside a staged item: the caller's stream is current again."""
        active, self._active = self._active, None
        if active is not None:
            active[2].__exit__(None, None, None)

    # -- AdamW on the CPU ---------------------------------------------------

    def _host_buffer(self, p: torch.Tensor, role: str, dtype: torch.dtype) -> torch.Tensor:
        key = (id(p), f"{role}:{dtype}")
        buffer = self._host.get(key)
        if buffer is None:
            buffer = self._host[key] = torch.empty(p.shape, dtype=dtype, pin_memory=True)
        return buffer

    def _copy_adamw_grads(self, items: List[WorkItem]):
        """CUDA: the AdamW grads (and params that are their own master) to pinned
        buffers on the D2H stream, ahead of the Muon state; the event of their arrival."""
        if not items or self.device.type != "cuda":
            return None
        pairs = []
        for item in items:
            for p, g in zip(item.params, item.grads):
                pairs.append((self._host_buffer(p, "grad", g.dtype), g))
                if self.layouts[id(p)].info.master_mode == "none":
                    pairs.append((self._host_buffer(p, "param", p.dtype), p.detach()))
        return self.streams.copy("d2h", pairs)

    def _acquire_adamw(self, item: WorkItem):
        layouts = [self.layouts[id(p)] for p in item.params]
        views = [layout.state(item.group) for layout in layouts]
        state = {key: [v[key] for v in views] for key in views[0]}
        if self.device.type != "cuda":
            return item, state  # the params are CPU tensors: the kernel updates them and the slab in place
        self.streams.wait_host(self._grads_ready)  # one host wait per step, for every AdamW grad
        self._grads_ready = None
        params = [self._host_buffer(p, "param", p.dtype) for p in item.params]
        grads = [self._host_buffer(p, "grad", g.dtype) for p, g in zip(item.params, item.grads)]
        return WorkItem(item.bucket, item.group, params, grads), state

    def _release_adamw(self, item: WorkItem) -> None:
        if self.device.type != "cuda":
            return
        pairs = [(p.detach(), self._host_buffer(p, "param", p.dtype)) for p in item.params]
        self.streams.caller.wait_event(self.streams.copy("h2d", pairs))


def _merge(pairs):
    """(dst, src) 1-D slices whose neighbours continue the same two buffers become one copy."""
    merged = []
    for dst, src in pairs:
        if merged:
            last_dst, last_src = merged[-1]
            if _continues(last_dst, dst) and _continues(last_src, src):
                merged[-1] = (_joined(last_dst, dst), _joined(last_src, src))
                continue
        merged.append((dst, src))
    return merged


def _continues(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() and \
        a.storage_offset() + a.numel() == b.storage_offset()


def _joined(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a.as_strided((a.numel() + b.numel(),), (1,), a.storage_offset())


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.dtype == b.dtype and a.stride() == b.stride()
