"""Data-parallel ownership (docs/design.md, "Data-parallel ownership"): plain
params replicated over a data-parallel group, whose grads the trainer has
already averaged (DDP), are each stepped by one owner rank, which alone keeps
their optimizer state; after the step every rank receives the new values.

The plan is made once per param group, the same on every rank (no
collective): each param's owner by the longest-processing-time rule (costs
in descending order, each to the least loaded rank, ties to the lowest rank),
Muon params weighed by their Polar-Express FLOPs and AdamW params by their
bytes, in two separate balances (the Muon work is compute, the AdamW work
memory traffic). A step then costs one all_reduce (every rank's checks and
settings agreed before any rank writes) and one all_gather per param dtype.
"""

from __future__ import annotations

import heapq
import zlib
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .._shapes import matrix_shape
from .._torch_compat import foreach_copy_
from .._types import ParamInfo

__all__ = ["assign_owners", "polar_flops", "Ownership", "data_parallel_group_of", "state_bytes", "imbalance"]


def polar_flops(rows: int, cols: int, ns_steps: int) -> int:
    """Polar-Express FLOPs of one rows x cols matrix: per iteration 4 m^2 n + 2 m^3 (m <= n)."""
    m, n = min(rows, cols), max(rows, cols)
    return ns_steps * (4 * m * m * n + 2 * m ** 3)


def assign_owners(costs: Sequence[float], loads: List[float]) -> List[int]:
    """Longest processing time first: each cost, largest first (ties in the given order), goes to the rank with
    the least load so far (ties to the lowest rank); `loads` (one per rank) is updated. Deterministic: every
    rank computes the same owners from the same costs."""
    owners = [0] * len(costs)
    heap = [(load, rank) for rank, load in enumerate(loads)]  # (load, rank): the least loaded, lowest rank first
    heapq.heapify(heap)
    for i in sorted(range(len(costs)), key=lambda k: (-costs[k], k)):
        load, rank = heapq.heappop(heap)
        owners[i] = rank
        loads[rank] = load + costs[i]
        heapq.heappush(heap, (loads[rank], rank))
    return owners


def hash_of(value) -> int:
    """A hash that is the same in every process (Python's str hash is salted per process)."""
    return zlib.crc32(repr(value).encode())


def data_parallel_group_of(group) -> Optional[dist.ProcessGroup]:
    """The process group of the `data_parallel_group` argument: a ProcessGroup, a 1-D DeviceMesh, or None."""
    if group is None:
        return None
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise ValueError(f"data_parallel_group: a DeviceMesh must be 1-D, got {group.ndim} dims")
        return group.get_group()
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"data_parallel_group must be a torch.distributed ProcessGroup or a 1-D DeviceMesh, got "
                        f"{type(group).__name__}")
    return group


class Ownership:
    """Who steps each plain param of one optimizer over `group` (see the module docstring)."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.owners: Dict[int, int] = {}  # id(param) -> owner's rank in the group
        self._loads = {"muon": [0.0] * self.world, "adamw": [0.0] * self.world}
        self._plan_digest = 0
        self.bytes_sent = 0  # by share (all steps): the measure the benchmarks report
        self._share_key, self._share_plan_cache = None, []

    def polar_loads(self) -> List[float]:
        """Polar-Express FLOPs per step assigned to each rank (the plan's Muon balance)."""
        return list(self._loads["muon"])

    # -- the plan ------------------------------------------------------------

    def add(self, infos: List[ParamInfo], group: dict) -> None:
        """Owners for a new param group's params (earlier groups keep theirs)."""
        if not infos:
            return
        kind = infos[0].kind
        if kind == "muon":
            costs = []
            for info in infos:
                rows, cols = matrix_shape(info.param, group["matrix_view"], info.name)
                matrices = info.param.numel() // max(1, rows * cols)
                costs.append(float(matrices * polar_flops(rows, cols, group["ns_steps"])))
        else:
            costs = [float(info.param.numel() * info.param.element_size()) for info in infos]
        for info, owner in zip(infos, assign_owners(costs, self._loads[kind])):
            self.owners[id(info.param)] = owner
        # The plan's shapes enter every step's digest: ranks with other params would gather mismatched buffers.
        shapes = tuple((info.kind, tuple(info.param.shape), str(info.param.dtype)) for info in infos)
        self._plan_digest = (self._plan_digest * 1000003 + hash_of(shapes)) % (1 << 20)

    def owns(self, param) -> bool:
        return self.owners.get(id(param), self.rank) == self.rank

    def owner_global_rank(self, param) -> int:
        return dist.get_global_rank(self.group, self.owners[id(param)])

    # -- collectives -------------------------------------------------------

    def agree(self, refused: bool, digest: int, device: torch.device) -> None:
        """One all_reduce of [refused, digest, digest^2]: a refusal, or group settings that differ, on any rank
        raise on every rank before any writes."""
        digest = (digest * 1000003 + self._plan_digest) % (1 << 20)
        bits = torch.tensor([int(refused), digest, digest * digest], dtype=torch.int64, device=device)
        dist.all_reduce(bits, group=self.group)
        refusals, total, squares = bits.tolist()
        if refusals:
            if refused:
                return  # this rank raises its own error
            raise RuntimeError("MuonAdamW.step: the step was refused on another data-parallel rank (see its "
                               "error); nothing was written on any rank")
        if self.world * squares != total * total:
            raise ValueError("MuonAdamW.step: the group settings or params differ across the data-parallel ranks "
                             "(edited on some ranks only?); nothing was written on any rank")

    def share(self, params: List[torch.Tensor]) -> int:
        """Every param from its owner to every rank: per dtype, one all_gather of each rank's owned params
        (flat, padded to the largest rank's share). The layout of the buffers is planned once per param list
        (`_share_plan`): a step's host work is a copy in and a copy out, none per rank. Returns the bytes this
        rank sent."""
        sent = 0
        for dtype, device, size, mine, theirs in self._share_plan(params):
            buffer = torch.zeros(size, dtype=dtype, device=device)
            if mine:
                torch.cat([p.detach().reshape(-1) for p in mine], out=buffer[:sum(p.numel() for p in mine)])
            gathered = torch.empty(size * self.world, dtype=dtype, device=device)
            dist.all_gather_into_tensor(gathered, buffer, group=self.group)
            sent += size * buffer.element_size() * (self.world - 1)  # to every other rank (a ring's total)
            targets, offsets = theirs
            if targets:
                sources = [gathered[at:at + p.numel()] for p, at in zip(targets, offsets)]
                foreach_copy_([p.data.view(-1) for p in targets], sources)
        self.bytes_sent += sent
        return sent

    def _share_plan(self, params: List[torch.Tensor]):
        """[(dtype, device, padded share size, this rank's params, (other ranks' params, their offsets in the
        gathered buffer))] for `params`, cached until the param list changes."""
        key = (len(self.owners), tuple(map(id, params)))
        if self._share_key != key:
            by_dtype: Dict[Tuple[torch.dtype, torch.device], List[torch.Tensor]] = {}
            for p in params:
                by_dtype.setdefault((p.dtype, p.device), []).append(p)
            plan = []
            for (dtype, device), members in by_dtype.items():
                shares: List[List[torch.Tensor]] = [[] for _ in range(self.world)]
                for p in members:
                    shares[self.owners[id(p)]].append(p)
                size = max(sum(p.numel() for p in share) for share in shares)
                if size == 0:
                    continue
                targets, offsets = [], []
                for r, share in enumerate(shares):
                    at = r * size
                    for p in share:
                        if r != self.rank:
                            targets.append(p)
                            offsets.append(at)
                        at += p.numel()
                plan.append((dtype, device, size, shares[self.rank], (targets, offsets)))
            self._share_key, self._share_plan_cache = key, plan
        return self._share_plan_cache

    def gather_entries(self, owned: Dict[int, Dict], params: Dict[int, torch.Tensor]) -> Dict[int, Dict]:
        """Every rank's `owned` state entries (index -> entry) on every rank, in index order, each tensor on its
        param's device (`params`: index -> param): one all_gather of the entries as objects (on the CPU, so that
        a tensor never lands on another rank's device). The entries travel as their owners made them: no rank
        has to know another's keys or shapes (NorMuon statistics switched on, row blocks, masters)."""
        on_cpu = {k: {key: v.cpu() if isinstance(v, torch.Tensor) else v for key, v in entry.items()}
                  for k, entry in owned.items()}
        parts: List[Optional[Dict]] = [None] * self.world
        dist.all_gather_object(parts, on_cpu, group=self.group)
        merged = {k: entry for part in parts for k, entry in part.items()}
        return {k: {key: v.to(params[k].device) if isinstance(v, torch.Tensor) else v
                    for key, v in merged[k].items()} for k in sorted(merged)}

    def broadcast_from_owner(self, tensor: torch.Tensor, param) -> None:
        """`tensor` (on every rank, the same shape) from the param's owner to every rank of the group."""
        dist.broadcast(tensor, src=self.owner_global_rank(param), group=self.group)


def state_bytes(state: Dict) -> int:
    """Bytes of every tensor in an optimizer's per-param state mapping (for the benchmarks)."""
    return sum(v.numel() * v.element_size() for entry in state.values() for v in entry.values()
               if isinstance(v, torch.Tensor))


def imbalance(loads: Sequence[float]) -> float:
    """max / mean of per-rank loads (1.0: perfectly balanced)."""
    mean = sum(loads) / len(loads)
    return max(loads) / mean if mean else 1.0

