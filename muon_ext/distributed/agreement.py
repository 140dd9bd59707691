"""Cross-rank agreement on the settings that shape collectives
(docs/design.md, "Every call completes or changes nothing").

Ranks whose groups differ (`beta2=None` on one rank, another `matrix_view`,
other params) would post collectives of different sizes or orders: gloo
aborts the process, NCCL hangs. Construction, `add_param_group` and
`load_state_dict` therefore gather one small int64 vector per rank over the
meshes of the DTensor params: [global rank, refused, one 62-bit digest per
setting]; every rank compares them, so a refusal or a difference raises on
every rank (naming the setting and the ranks) before anything is written.
A step carries a cheaper form in its existing all_reduce (`step_digest`).

A param writer failing on one rank is reported on every rank
(`share_failures`): one all_gather of [rank, failures] per mesh, and the
failures' text only where some rank had one.
"""

from __future__ import annotations

import hashlib
from typing import Callable, Dict, List, Optional, Sequence, Tuple, TypeVar

import torch
import torch.distributed as dist

from .. import ops
from ..schema import DEFAULTS
from .placements import local

__all__ = ["SETTINGS", "group_digests", "agree", "agree_over_params", "step_digest", "meshes_of", "device_of",
           "share_failures", "RemoteWriterFailure", "device_lr_digest", "lr_code",
           "refuse_together"]

# Every setting of either kind, plus the group's kind and its params' layout.
# With the optional Muon keys that shape a step's exchanges (row blocks cut the owners' matrices),
# and CPU_POLAR_GEMM: not a group key but this rank's CPU BF16 GEMM path for the group (see cpu_polar_gemm).
CPU_POLAR_GEMM = "cpu_polar_gemm"
SETTINGS: Tuple[str, ...] = ("kind", "params") + tuple(sorted(set(DEFAULTS["muon"]) | set(DEFAULTS["adamw"]))) + (
    "row_blocks", "row_block_scales", "split_matrices", CPU_POLAR_GEMM)

# Not in the step's digest: the params' layout cannot change after construction (the planner refuses
# edited groups) and costs O(params) to hash. The lr is in it (a scheduler stepped on one rank only would let
# replicas drift apart): a float or CPU tensor lr by value, a device tensor lr on the device (device_lr_digest).
_PER_CALL_ONLY = ("params",)

T = TypeVar("T")


def _value(v):
    if isinstance(v, torch.Tensor):  # a capturable lr: its value (one host read, outside steps)
        return float(v.detach().float().cpu().reshape(-1)[0]) if v.numel() == 1 else tuple(v.shape)
    if isinstance(v, (list, tuple)):
        return tuple(_value(x) for x in v)
    return v


def _layout(p) -> tuple:
    placements = tuple(str(x) for x in p.placements) if hasattr(p, "placements") else ()
    return (tuple(p.shape), str(p.dtype), placements)


def _hash(value) -> int:
    return int.from_bytes(hashlib.blake2b(repr(value).encode(), digest_size=8).digest(), "little") >> 2


def cpu_polar_gemm() -> tuple:
    """This process's CPU Polar-Express GEMM path for polar_dtype "bfloat16":
    (ops.cpu_bf16_gemm(), ops.cpu_bf16_tile_gemm(), whether the native path's
    at::addmm runs on oneDNN). Each choice has its own summation order, so
    ranks on different paths compute different bits for the same matrix:
    replicas would drift apart without an error. They follow the CPU
    (AVX-512 BF16, AMX), MUON_EXT_CPU_BF16_GEMM / MUON_EXT_CPU_TILE_GEMM (read
    per process; an invalid value raises here) and torch.backends.mkldnn.enabled
    (off, at::addmm multiplies BF16 without oneDNN, and the micro-kernel is off)."""
    native = ops.cpu_bf16_gemm()
    return native, ops.cpu_bf16_tile_gemm(), native == "native" and bool(torch.backends.mkldnn.enabled)


def _group_cpu_polar_gemm(group: dict):
    """cpu_polar_gemm() for a Muon group whose params live on the CPU with polar_dtype "bfloat16"; else None
    (the GPU path and the FP32 and FP16 paths do not depend on the host's GEMM)."""
    params = group.get("params", ())
    if group.get("kind") != "muon" or group.get("polar_dtype", DEFAULTS["muon"]["polar_dtype"]) != "bfloat16":
        return None
    if not params or local(params[0]).device.type != "cpu":
        return None
    try:
        return cpu_polar_gemm()
    except RuntimeError as exc:  # an invalid setting: a value of its own (raising here would leave peers waiting)
        return ("invalid", str(exc))


def group_digests(group: dict, keys: Sequence[str] = SETTINGS) -> List[int]:
    """One digest per entry of `keys` (an absent key hashes as absent)."""
    out = []
    for key in keys:
        if key == "params":
            out.append(_hash(tuple(_layout(p) for p in group.get("params", ()))))
        elif key == CPU_POLAR_GEMM:
            out.append(_hash(_group_cpu_polar_gemm(group)))
        else:
            out.append(_hash(_value(group[key]) if key in group else "<absent>"))
    return out


def meshes_of(params) -> list:
    """The distinct device meshes of the DTensor params among `params`, in first-seen order."""
    seen = []
    for p in params:
        mesh = getattr(p, "device_mesh", None)
        if mesh is not None and hasattr(p, "placements") and not any(mesh is m for m in seen):
            seen.append(mesh)
    return seen


def _gather_over_mesh(mesh, row: torch.Tensor) -> torch.Tensor:
    """Every rank of `mesh` gets every rank's `row`: one all_gather over the default group where the mesh
    spans the world, else one per mesh dim, each gathering what the previous ones collected."""
    if mesh.size() == dist.get_world_size():
        dims = [None]
    else:
        dims = list(range(mesh.ndim))
    rows = row.reshape(1, -1)
    for dim in dims:
        group = None if dim is None else mesh.get_group(dim)
        size = dist.get_world_size(group)
        out = [torch.empty_like(rows) for _ in range(size)]
        dist.all_gather(out, rows.contiguous(), group=group)
        rows = torch.cat(out)
    return rows


def agree(what: str, meshes: Sequence, device: torch.device, checks: Callable[[], T],
          groups_of: Callable[[T], Sequence[dict]], group_count: int, first_group: int = 0) -> T:
    """Runs `checks()` on this rank, then agrees over every mesh in `meshes`:
    raises on every rank if any rank's checks raised (its own error there,
    "refused on another rank" elsewhere) or if the settings of the
    `group_count` groups `groups_of(result)` (numbered from `first_group` in
    messages) differ. Returns the result."""
    result: Optional[T] = None
    error: Optional[BaseException] = None
    try:
        result = checks()
        digests = [d for g in groups_of(result) for d in group_digests(g)]
        if len(digests) != group_count * len(SETTINGS):
            raise ValueError(f"{what}: {len(digests) // len(SETTINGS)} param groups here, {group_count} expected")
    except Exception as exc:  # raised after the collective, so that every rank refuses
        error, digests = exc, [0] * (group_count * len(SETTINGS))
    row = torch.tensor([dist.get_rank(), int(error is not None)] + digests, dtype=torch.int64, device=device)
    for mesh in meshes:
        rows = _gather_over_mesh(mesh, row).cpu()
        if error is not None:
            raise error
        refused = [int(r[0]) for r in rows if int(r[1])]
        if refused:
            raise RuntimeError(f"{what}: refused on rank(s) {refused} (see the error there); nothing was changed on "
                               "any rank")
        table = rows[:, 2:].reshape(len(rows), group_count, len(SETTINGS))
        for gi in range(group_count):
            for si, key in enumerate(SETTINGS):
                column = table[:, gi, si]
                if bool((column != column[0]).any()):
                    values = {}
                    for r, v in zip(rows[:, 0].tolist(), column.tolist()):
                        values.setdefault(v, []).append(r)
                    ranks = " vs ".join(str(sorted(rs)) for rs in values.values())
                    thing = _what_differs(key)
                    raise ValueError(f"{what}: param group {first_group + gi} differs across ranks in {thing}: ranks {ranks}; "
                                     "every rank must build and load the same groups (their collectives must "
                                     "match); nothing was changed on any rank")
    if error is not None:
        raise error
    return result


def _what_differs(key: str) -> str:
    if key == "params":
        return "its params (shapes, dtypes, placements)"
    if key == CPU_POLAR_GEMM:
        return ("its CPU BF16 GEMM path (ops.cpu_bf16_gemm(), ops.cpu_bf16_tile_gemm(), "
                "torch.backends.mkldnn.enabled: each sums in its own order, so replicas would drift apart; set "
                "MUON_EXT_CPU_BF16_GEMM=rounded and MUON_EXT_CPU_TILE_GEMM=0 on every rank of a mixed cluster)")
    return f"setting '{key}'"


_STEP_SETTINGS = tuple(key for key in SETTINGS if key not in _PER_CALL_ONLY)


_DIGEST_BITS = 20
_DEVICE_LR = "<device tensor lr: digested on the device>"


def _on_device(lr) -> bool:
    return isinstance(lr, torch.Tensor) and lr.device.type != "cpu"


def step_digest(groups: Sequence[dict], indices: Sequence[int]) -> int:
    """A 20-bit digest of the settings of groups `indices` (every per-step
    setting, the lr included), for the step's sum all_reduce: carrying d and
    d*d, the sums satisfy W * sum(d*d) == sum(d)**2 exactly when every rank's d
    is the same (no extra collective). A device tensor lr (capturable) is left
    to `device_lr_digest`, so that the host never waits for the device."""
    return _hash(tuple(tuple(group_digests(dict(groups[i], lr=_DEVICE_LR) if _on_device(groups[i]["lr"])
                                           else groups[i], _STEP_SETTINGS)) for i in indices)) % (1 << _DIGEST_BITS)


def lr_code(lr: torch.Tensor) -> torch.Tensor:
    """A 20-bit code of a one-element float32 lr tensor's bits, computed where it lives (int64, 0-dim)."""
    bits = lr.detach().reshape(1).to(torch.float32).view(torch.int32).to(torch.int64)[0] & 0xFFFFFFFF
    return ((bits * 2654435761) >> 16) & ((1 << _DIGEST_BITS) - 1)  # multiplicative hash: every bit counts


def device_lr_digest(groups: Sequence[dict], indices: Sequence[int], digest: int,
                     device: torch.device) -> Optional[torch.Tensor]:
    """`digest` with the values of the device tensor lrs of groups `indices` folded in, on `device` (a 0-dim
    int64 tensor, no host sync); None where no such group has one (`digest` is then the whole digest)."""
    lrs = [groups[i]["lr"] for i in indices if _on_device(groups[i]["lr"])]
    if not lrs:
        return None
    out = torch.tensor(digest, dtype=torch.int64, device=device)
    for lr in lrs:
        out = (out * 31 + lr_code(lr.to(device, non_blocking=True))) & ((1 << _DIGEST_BITS) - 1)
    return out


def refuse_together(process_group, checks: Callable[[], T], what: str) -> T:
    """Runs `checks()`; with a `process_group` (None: none, the call is rank-local), then one all_reduce of
    "refused" over it, so that a refusal on any of its ranks raises on every one (its own error there, a
    RuntimeError naming `what` elsewhere) before any writes. Every rank of the group must call it."""
    if process_group is None or not dist.is_initialized():
        return checks()
    result, error = None, None
    try:
        result = checks()
    except Exception as exc:  # raised after the collective every rank joins
        error = exc
    backend = dist.get_backend(process_group)
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    refused = torch.tensor([int(error is not None)], dtype=torch.int32, device=device)
    dist.all_reduce(refused, group=process_group)
    if error is not None:
        raise error
    if int(refused.item()):
        raise RuntimeError(f"{what}: refused on another rank (see its error there); nothing was written on any rank")
    return result


def device_of(params) -> torch.device:
    for p in params:
        if hasattr(p, "placements"):
            return local(p).device
    return torch.device("cpu")


def agree_over_params(what: str, params, checks: Callable[[], T], groups_of: Callable[[T], Sequence[dict]],
                      group_count: int, first_group: int = 0, meshes=None) -> T:
    """`agree` over the meshes of the DTensor params among `params` (or the
    given `meshes_of(params)`); where there are none, no rank waits for
    another: just `checks()`."""
    meshes = meshes_of(params) if meshes is None else meshes
    if not meshes:
        return checks()
    return agree(what, meshes, device_of(params), checks, groups_of, group_count, first_group)


# The longest text of one rank's writer failures that other ranks are told (UTF-8 bytes; cut beyond).
_REPORT_BYTES = 4096
_HEADER_BYTES = 16  # (rank, text length) as two int64
_FIELD, _RECORD = "\x1f", "\x1e"


class RemoteWriterFailure(RuntimeError):
    """What a param writer raised on another rank: its text, and the name of its type (`type_name`)."""

    def __init__(self, type_name: str, message: str):
        super().__init__(message)
        self.type_name = type_name


def share_failures(meshes: Sequence[Tuple[object, torch.device]], failures: Sequence[Tuple[str, BaseException]]
                   ) -> Tuple[List[int], List[Tuple[str, BaseException]]]:
    """A collective over every (mesh, device) of `meshes` (in the same order on
    every rank): each rank learns which ranks' param writers failed in the
    call, and what they raised. Returns (failing global ranks, failures named
    "rank r: name"; another rank's exception is a RemoteWriterFailure), both empty where no rank of the meshes had a failure.
    Costs one all_gather of two int64 per rank per mesh; the text travels only
    where some rank failed."""
    me = dist.get_rank()
    reported: Dict[int, List[Tuple[str, BaseException]]] = {}
    for mesh, device in meshes:
        counts = _gather_over_mesh(mesh, torch.tensor([me, len(failures)], dtype=torch.int64, device=device)).cpu()
        if not bool(counts[:, 1].any()):
            continue
        text = _RECORD.join(f"{name}{_FIELD}{type(exc).__name__}{_FIELD}{exc}" for name, exc in failures).encode()[
            :_REPORT_BYTES]
        # One byte per byte of text, after a header of (rank, length) as int64.
        row = torch.zeros(_HEADER_BYTES + _REPORT_BYTES, dtype=torch.uint8)
        row[:_HEADER_BYTES].view(torch.int64).copy_(torch.tensor([me, len(text)], dtype=torch.int64))
        if text:
            row[_HEADER_BYTES:_HEADER_BYTES + len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8)
        for other in _gather_over_mesh(mesh, row.to(device)).cpu():
            rank, size = other[:_HEADER_BYTES].view(torch.int64).tolist()
            if rank == me:
                reported[rank] = [(f"rank {rank}: {name}", exc) for name, exc in failures]
            elif size and rank not in reported:
                records = bytes(other[_HEADER_BYTES:_HEADER_BYTES + size].tolist()).decode(errors="replace").split(
                    _RECORD)
                fields = [r.split(_FIELD, 2) + ["", ""] for r in records]  # a cut record may lack fields
                reported[rank] = [(f"rank {rank}: {f[0]}", RemoteWriterFailure(f[1], f[2])) for f in fields]
    ranks = sorted(r for r, entries in reported.items() if entries)
    return ranks, [entry for r in ranks for entry in reported[r]]
