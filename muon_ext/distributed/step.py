"""One optimizer step over the DTensor params: checks on the local tensors,
one agreement collective per mesh, then AdamW on the shards and Muon through
the owner exchange (exchange.py).

Every rank takes part in the agreement, also one whose own checks (or the
plain params' planning) failed, so that a refusal is raised on every rank
before any rank writes: a rank-local error there, "refused on another rank"
elsewhere. The same collective carries each param's grad presence: a grad
None on every rank skips the param (state untouched), None on some ranks
only is an error on every rank. Collectives run in the same order on every
rank: meshes, then exchange groups, in the order of the param groups and
their params.
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from typing import Callable, Dict, List, Mapping, NamedTuple, Tuple

import torch
import torch.distributed as dist

from .. import _C, op_arguments, ops, row_blocks
from .._shapes import as_matrices, matrix_shape
from ..amp import capturing
from .._types import Bucket, ParamInfo, WorkItem, is_dtensor
from ..buckets import PlannedItem
from ..schema import SUPPORTED_DTYPES
from .agreement import device_lr_digest, step_digest
from .exchange import exchange_replicated, exchange_sharded
from .ownership import polar_flops
from .placements import Layout, dim_indices, expected_local_shape, is_split, local, matrix_layout
from .stacks import matrices
from .shard_group import ShardGroup, shard_group
from .state import stats_follow_rows, stats_local_shape
from .tp_polar import NormuonShard, ShardedBatch, normuon_sharded, polar_express_shards

__all__ = ["DistributedStep", "dtensor_infos", "agree_on_checks"]


def dtensor_infos(infos) -> List[ParamInfo]:
    return [info for info in infos if is_dtensor(info.param)]


class _Entry(NamedTuple):
    info: ParamInfo
    param: torch.Tensor  # local
    grad: torch.Tensor  # local, contiguous


class DistributedStep:
    """Plans and runs the DTensor params' part of `MuonAdamW.step`.
    `bytes_sent`: bytes this rank has sent to other ranks in Muon exchanges
    (all steps; the small agreement collective is not counted);
    `polar_flops`: the Polar-Express FLOPs of the matrices this rank
    orthogonalized in them (per iteration 4 m^2 n + 2 m^3, m <= n)."""

    def __init__(self):
        self.bytes_sent = 0
        self.polar_flops = 0  # Polar-Express FLOPs of the matrices this rank orthogonalized in exchanges
        self._shard_groups: Dict[Tuple, ShardGroup] = {}  # (layout, param shape) -> its shard group
        self._dinfos: List[ParamInfo] = []
        self._seen = 0  # how many infos _dinfos was taken from (the table only grows: add_param_group)
        # (mesh, device) of the meshes where some rank has a param writer at this step: the step's writer
        # failures are shared over them at its end (agreement.share_failures).
        self.writer_meshes: List[Tuple[object, torch.device]] = []

    # -- checks -----------------------------------------------------------

    def check(self, planner, infos: List[ParamInfo], groups: List[dict], tensors: Mapping, *, all_state: bool,
              reading: bool, ranges=None) -> None:
        """The planner's checks (`StepPlanner.check_params`) on each DTensor
        param's local tensors, plus what only DTensors have: state tensors
        are DTensors, local rows follow the chunk rule, NorMuon statistics
        have their local shape. Local params are recorded in `ranges` (when
        given) tagged by their position in `infos`."""
        for position, info in enumerate(infos):
            p, lp = info.param, local(info.param)
            if tuple(lp.shape) != expected_local_shape(p):
                raise ValueError(f"{info.name} has local shape {tuple(lp.shape)} on this rank; DTensor's placement "
                                 f"rules give {expected_local_shape(p)} (placements {tuple(p.placements)}, shape "
                                 f"{tuple(p.shape)})")
            entry = tensors.get(p, {})
            for key, value in entry.items():
                if isinstance(value, torch.Tensor) and not is_dtensor(value):
                    raise TypeError(f"{info.name}: optimizer state '{key}' is a plain tensor; a DTensor param's "
                                    "state must be DTensors on its mesh (load DTensor state, e.g. through "
                                    "torch.distributed.checkpoint.state_dict.set_optimizer_state_dict)")
            group = dict(groups[info.group])
            local_state = {k: local(v) if isinstance(v, torch.Tensor) else v for k, v in entry.items()}
            stat = None
            if info.kind == "muon":
                stat = local_state.pop("second_momentum_buffer", None)
                group["beta2"] = None  # its local shape is checked below, not by the planner's whole-matrix rule
            local_groups = list(groups)
            local_groups[info.group] = group
            planner.check_params([dataclasses.replace(info, param=lp)], local_groups, {lp: local_state},
                                 all_state=all_state, reading=reading, ranges=ranges, tag=position)
            if stat is not None and groups[info.group]["beta2"] is not None:
                want = stats_local_shape(p, groups[info.group])
                if stat.dtype != torch.float32 or tuple(stat.shape) != want or stat.device != lp.device \
                        or not stat.is_contiguous():
                    raise ValueError(f"{info.name}: optimizer state 'second_momentum_buffer' has local shape "
                                     f"{tuple(stat.shape)} ({stat.dtype}, {stat.device}), expected {want} "
                                     f"(torch.float32, contiguous, {lp.device})")

    def _grad(self, info: ParamInfo, grad_attr: str):
        """The param's DTensor grad, checked (None where it has none). Its
        placements may differ from the param's (a Partial(sum) grad of a
        replicated norm weight under SequenceParallel, a replicated grad of a
        Shard(0) embedding): `_local_grads` redistributes it after the agreement."""
        p = info.param
        g = getattr(p, grad_attr, None)
        if g is None:
            return None
        if not is_dtensor(g):
            raise TypeError(f"{info.name}: {grad_attr} is a {type(g).__name__}; a DTensor param needs a DTensor "
                            "grad")
        if g.device_mesh != p.device_mesh:
            raise ValueError(f"{info.name}: {grad_attr} is on mesh {g.device_mesh}, the param on {p.device_mesh}")
        if tuple(g.shape) != tuple(p.shape):
            raise ValueError(f"{info.name}: {grad_attr} has shape {tuple(g.shape)}, the param {tuple(p.shape)}")
        lg, lp = local(g), local(p)
        if lg.layout != torch.strided:
            raise TypeError(f"{info.name}: {grad_attr} has layout {lg.layout}; sparse gradients are not supported")
        if lg.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{info.name}: {grad_attr} has dtype {lg.dtype}; supported: float32, bfloat16, float16")
        if lg.device != lp.device:
            raise ValueError(f"{info.name}: {grad_attr} is on {lg.device}, the param on {lp.device}")
        if tuple(g.placements) == tuple(p.placements) and lg.shape != lp.shape:
            raise ValueError(f"{info.name}: {grad_attr} has local shape {tuple(lg.shape)}, the param "
                             f"{tuple(lp.shape)}")
        problem = ops.storage_problem(lg)
        if problem:
            raise ValueError(f"{info.name}: {grad_attr}: {problem}")
        return g

    @staticmethod
    def _local_grads(infos: List[ParamInfo], grads: Dict) -> Dict:
        """Each grad's local part on the param's placements, contiguous: a grad
        placed otherwise is redistributed first, as DTensor's own ops would (a
        collective over its mesh; every rank runs them in param order)."""
        out = {}
        for info in infos:
            g = grads.get(id(info.param))
            if g is None:
                continue
            if tuple(g.placements) != tuple(info.param.placements):
                g = g.redistribute(info.param.device_mesh, info.param.placements)
            out[id(info.param)] = local(g).contiguous()
        return out

    # -- plan -------------------------------------------------------------

    def plan(self, planner, groups: List[dict], infos: Mapping[int, ParamInfo], tensors: Mapping, grad_attr: str,
             failed: bool, scaler: bool = False):
        """The DTensor params' work, or None where this rank's plain planning
        `failed` (its error is then raised by the caller). Collective when
        there are DTensor params: every rank must call it at every step."""
        if self._seen != len(infos):  # a param's type never changes: look again only at new groups
            self._dinfos, self._seen = dtensor_infos(infos.values()), len(infos)
        dinfos = self._dinfos
        self.writer_meshes = []
        if not dinfos:
            return []
        if capturing():  # every rank captures, so every rank refuses, before any collective
            raise RuntimeError("step: DTensor params cannot be stepped inside CUDA graph capture (the step agrees "
                               "across ranks with a collective and reads its result on the host)")
        error, grads = None, {}
        if not failed:
            try:
                ranges = _C.MemoryRanges()
                self.check(planner, dinfos, groups, tensors, all_state=True, reading=False, ranges=ranges)
                overlap = ranges.first_overlap()
                if overlap is not None:  # each would be stepped, and written, twice
                    (first, i0), (second, i1) = overlap
                    what = lambda tag, index: ("the optimizer state of " if index < 0 else "") + dinfos[tag].name  # noqa: E731
                    raise ValueError(f"{what(second, i1)} shares memory with {what(first, i0)} on this rank; every "
                                     "param needs storage and optimizer state of its own (to tie weights, put one "
                                     "Parameter in one group)")
                for info in dinfos:
                    grads[id(info.param)] = self._grad(info, grad_attr)
            except Exception as exc:  # raised after the agreement, so every rank refuses the step
                error = exc
        refused = failed or error is not None
        writers = any(info.writer is not None for info in infos.values())  # writers are on plain params only
        self._agree(dinfos, grads, refused, grad_attr, groups, scaler, writers)
        if error is not None:
            raise error
        if failed:
            return None
        return self._items(dinfos, self._local_grads(dinfos, grads), groups, tensors)

    def _agree(self, infos: List[ParamInfo], grads: Dict, refused: bool, grad_attr: str, groups: List[dict],
               scaler: bool, writers: bool) -> None:
        """One all_reduce per mesh of [refused, GradScaler present, a digest of
        the groups' settings and its square, param writers present, then per
        param: grad present, a code of its grad's placements and its square]:
        every rank sees the same sums, so every rank takes the same decision
        (also whether the step's writer failures are shared at its end)."""
        by_mesh: Dict[object, List[ParamInfo]] = {}
        for info in infos:
            by_mesh.setdefault(info.param.device_mesh, []).append(info)
        for mesh, members in by_mesh.items():
            device = local(members[0].param).device
            # The settings of the mesh's groups and the GradScaler's presence, checked equal on every rank
            # without another collective (agreement.step_digest); settings edited on one rank only would
            # otherwise post mismatched exchanges, or (the lr) let replicas drift apart.
            indices = sorted({i.group for i in members})
            digest = step_digest(groups, indices)
            present = [grads.get(id(i.param)) is not None for i in members]
            codes = [_placements_code(grads[id(i.param)].placements) if here else 0
                     for i, here in zip(members, present)]
            bits = torch.tensor([int(refused), int(scaler), digest, digest * digest, int(writers)]
                                + [int(here) for here in present] + codes + [c * c for c in codes],
                                dtype=torch.int64, device=device)
            with_device_lr = device_lr_digest(groups, indices, digest, device)
            if with_device_lr is not None:  # a capturable lr's value, folded in on the device
                bits[2], bits[3] = with_device_lr, with_device_lr * with_device_lr
            _all_reduce_over(mesh, bits)
            sums = bits.tolist()
            if sums[0]:
                if refused:
                    return  # this rank raises its own error
                raise RuntimeError("MuonAdamW.step: the step was refused on another rank (see its error); nothing "
                                   "was written on any rank")
            if 0 < sums[1] < mesh.size():
                raise ValueError(f"MuonAdamW.step: a GradScaler drives this step on {sums[1]} of {mesh.size()} "
                                 "ranks; use one on every rank or on none; nothing was written on any rank")
            if mesh.size() * sums[3] != sums[2] * sums[2]:
                raise ValueError("MuonAdamW.step: the group settings of the DTensor params differ across ranks "
                                 "(edited on some ranks only? or a CPU BF16 GEMM path, "
                                 "agreement.cpu_polar_gemm()); their exchanges would not match; nothing was "
                                 "written on any rank")
            if sums[4]:
                self.writer_meshes.append((mesh, device))
            n, base = len(members), 5
            for k, info in enumerate(members):
                count, total, squares = sums[base + k], sums[base + n + k], sums[base + 2 * n + k]
                if 0 < count < mesh.size():
                    raise ValueError(f"MuonAdamW.step: {info.name} has a {grad_attr} on {count} of {mesh.size()} "
                                     "ranks of its mesh; a DTensor param's grad must be present on every rank or "
                                     "on none (then it is skipped); nothing was written on any rank")
                if count * squares != total * total:  # equal codes everywhere exactly when (sum c)^2 == n sum c^2
                    raise ValueError(f"MuonAdamW.step: {info.name}'s {grad_attr} has different placements on "
                                     f"different ranks of its mesh; nothing was written on any rank")

    # -- work items -------------------------------------------------------

    def _items(self, infos: List[ParamInfo], grads: Dict, groups: List[dict], tensors: Mapping) -> List[PlannedItem]:
        """The DTensor params' part of the step's plan, in the same order on every rank: AdamW items on the
        local shards, then per Muon exchange group one item whose `exchange` brings each matrix's rows to its
        owner, or, where every matrix is whole on every rank, fused-kernel items like plain params'. Items of
        a group are cut by (param dtype, master mode, grad dtype): the kernels take one of each per call."""
        adamw, muon = _work(infos, grads, groups)
        items: List[PlannedItem] = []
        for gi, entries in adamw:
            items += _local_items(Bucket(gi, "adamw", [e.info.param for e in entries]), groups[gi], entries,
                                  tensors, ("exp_avg", "exp_avg_sq", "step"), None)
        first = 0  # the owner of each exchange group's first matrix: rotates, so that small groups spread out
        in_place: Dict[Tuple, WorkItem] = {}  # (mesh, mesh dim) -> the one item of the matrices split there
        for (gi, rows, cols, _, _), entries in muon:
            group, p = groups[gi], entries[0].info.param
            # a stack's layout is its matrices' (docs/design.md, "Expert stacks"): a split of the batch dim
            # leaves whole matrices on each rank
            layout, shape = matrix_layout(p, group["matrix_view"])
            bucket = Bucket(gi, "muon", [e.info.param for e in entries])
            blocks = row_blocks.of_group(group, rows)  # each block a matrix of its own (docs/design.md,
            # "Row blocks"): cut at the owners' orthogonalization and at phase 3, on the rows each rank holds
            same_shape = MuonMatrices(group, rows, cols, entries, blocks, layout, shape)
            if not layout.split_dims and not layout.replicate_dims:  # every matrix whole, no one to share with
                items += _local_items(bucket, group, entries, tensors, _MUON_KEYS, blocks)
            elif len(layout.split_dims) == 1 and not layout.replicate_dims and not same_shape.stack and \
                    group.get("split_matrices", "gather") == "in_place":
                key = (layout.mesh, layout.split_dims[0])
                if key not in in_place:  # one item for all of them, where the first of them is
                    in_place[key] = WorkItem(bucket, group, [], [], None, [], InPlaceExchange(self, []))
                    items.append(PlannedItem(in_place[key], {}, None))
                item = in_place[key]  # its lists grow: it steps (and versions) every matrix its exchange lists
                item.exchange.matrices.append(same_shape)
                item.params.extend(e.param for e in entries)
                item.grads.extend(e.grad for e in entries)
                item.dtensors.extend(e.info.param for e in entries)
            else:
                item = WorkItem(bucket, group, [e.param for e in entries], [e.grad for e in entries], blocks,
                                [e.info.param for e in entries], MuonExchange(self, same_shape, first))
                items.append(PlannedItem(item, {}, None))
            first += len(entries)
        return items

    def _shard_group(self, layout: Layout, shape: Tuple[int, ...]) -> ShardGroup:
        key = (layout, shape)
        if key not in self._shard_groups:
            self._shard_groups[key] = shard_group(layout, shape)
        return self._shard_groups[key]

    def _momentum(self, sub: "MuonMatrices", states, inv_scale, found_inf):
        """Phase 1 on the local rows: (the kernels' view of a local tensor, FP32 updates, NorMuon statistics)."""
        group, entries, tensors = sub.group, sub.entries, states.tensors
        if group["beta2"] is not None:
            for e in entries:
                if "second_momentum_buffer" not in tensors[e.info.param]:  # beta2 switched on after construction
                    states.init(e.info, group)
        view, split = group["matrix_view"], sub.layout.split_dims and not sub.stack

        def mat(t):  # the kernels' view; a rank's block of a split matrix is [local rows, local cols]
            return t.reshape(t.shape[0], math.prod(t.shape[1:])) if split else as_matrices(t, view)

        moms = [mat(local(tensors[e.info.param]["momentum_buffer"])) for e in entries]
        updates = [m.new_empty(m.shape) for m in moms]
        for batch in _batches(list(range(len(entries))), lambda i: entries[i].grad.dtype):
            ops.muon_momentum([mat(entries[i].grad) for i in batch], [moms[i] for i in batch],
                              [updates[i] for i in batch], inv_scale=inv_scale, found_inf=found_inf,
                              **op_arguments.muon_momentum(group))
        stats = []
        if group["beta2"] is not None:
            stats = [local(tensors[e.info.param]["second_momentum_buffer"]) for e in entries]
        return mat, updates, stats

    def _apply(self, sub: "MuonMatrices", mat, updates: List[torch.Tensor], tensors, found_inf) -> None:
        """Phase 3 on the local rows, each row block's rows with its own lr scale."""
        group, entries, rows, cols = sub.group, sub.entries, sub.rows, sub.cols
        runs = [(rows, 1.0, None)]  # (matrix rows for the lr scale, block scale, local rows; None: all)
        if sub.blocks is not None:
            mesh = entries[0].info.param.device_mesh
            held = dim_indices(rows, 0, tuple(mesh.mesh.shape), entries[0].info.param.placements,
                               mesh.get_coordinate())
            runs = row_blocks.local_runs(sub.blocks, held)
        for batch in _batches(list(range(len(entries))), lambda i: (entries[i].param.dtype, entries[i].info.master_mode)):
            masters = [mat(local(tensors[entries[i].info.param]["master_param"])) for i in batch
                       if "master_param" in tensors[entries[i].info.param]]
            params, batch_updates = [mat(entries[i].param) for i in batch], [updates[i] for i in batch]
            for block_rows, scale, index in runs:
                settings = op_arguments.muon_apply(group, scale)
                _apply_rows(index, params, batch_updates, masters, lambda ps, us, ms: ops.muon_apply(
                    ps, us, masters=ms, matrix_shape=(block_rows, cols), found_inf=found_inf, **settings))

    def _muon(self, sub: "MuonMatrices", states, max_workspace_bytes: int, first: int, inv_scale,
              found_inf) -> None:
        """Muon on matrices split or replicated over their mesh: phase 1 on the local rows, phase 2 where each
        matrix is whole (its owner, by the exchange), phase 3 on the local rows."""
        group, rows, cols, entries, layout = sub.group, sub.rows, sub.cols, sub.entries, sub.layout
        mat, updates, stats = self._momentum(sub, states, inv_scale, found_inf)
        split, replicas = layout.split_dims, layout.replicate_dims

        def orthogonalize_matrices(whole: List[torch.Tensor], whole_stats: List[torch.Tensor]) -> None:
            ops.muon_orthogonalize(whole, whole_stats, max_workspace_bytes=max_workspace_bytes, found_inf=found_inf,
                                   **op_arguments.muon_orthogonalize(group))
            self.polar_flops += len(whole) * polar_flops(*whole[0].shape[-2:], group["ns_steps"])

        def orthogonalize(whole: List[torch.Tensor], whole_stats: List[torch.Tensor]) -> None:
            row_blocks.orthogonalize_blocks(sub.blocks, whole, whole_stats, orthogonalize_matrices)

        mats, mat_stats = matrices(updates), matrices(stats)  # one 2-D view per matrix: a stack's experts one by one
        if not mats:  # a stack with no matrix here, nor on the ranks sharing its work
            pass
        elif not split:  # replicated: the first replicate dim splits the work (any others repeat it)
            self.bytes_sent += exchange_replicated(layout.ranks(replicas[0]), mats, mat_stats, orthogonalize, first)
        else:
            stats_sharded = bool(stats) and stats_follow_rows(entries[0].info.param, group)
            shards = self._shard_group(layout, sub.shape)

            def in_shard_group(ups: List[torch.Tensor], sts: List[torch.Tensor]) -> int:
                return exchange_sharded(shards, rows, cols, ups, sts, stats_sharded, orthogonalize, first)

            if replicas:  # HSDP (x TP): the replicas split the matrices too
                self.bytes_sent += exchange_replicated(layout.ranks(replicas[0]), mats, mat_stats, in_shard_group,
                                                       first)
            else:
                self.bytes_sent += in_shard_group(mats, mat_stats)
        self._apply(sub, mat, updates, states.tensors, found_inf)

    def _muon_in_place(self, subs: List["MuonMatrices"], states, inv_scale, found_inf) -> None:
        """split_matrices="in_place": every matrix (every row block) of `subs`, all split over one mesh dim,
        orthogonalized where it lies, then NorMuon with the whole matrix's statistics: no rank gathers a matrix
        (docs/design.md, "Split matrices orthogonalized in place"). The collectives of all of them are joined
        (tp_polar.py): ns_steps + 2 all_reduces per step, whatever the number of matrices and groups."""
        if found_inf is not None and bool(found_inf.item()):  # a skipped step moves nothing, statistics included
            return
        phase1 = [self._momentum(sub, states, inv_scale, found_inf) for sub in subs]
        layout = subs[0].layout  # a plain matrix's layout: stacks take the owner exchange
        mesh_dim = layout.split_dims[0]
        process_group = layout.mesh.get_group(mesh_dim)
        mesh_shape, coordinate = tuple(layout.mesh.mesh.shape), layout.mesh.get_coordinate()
        batches, normuon, written = [], [], []
        for sub, (_, updates, stats) in zip(subs, phase1):
            group, rows, cols, entries, blocks = sub.group, sub.rows, sub.cols, sub.entries, sub.blocks
            p = entries[0].info.param
            shard_dim = 0 if p.placements[mesh_dim].dim == 0 else 1
            held = dim_indices(rows, 0, mesh_shape, p.placements, coordinate) if shard_dim == 0 else \
                _held_columns(p, mesh_shape, coordinate)
            stats_local = bool(stats) and stats_follow_rows(p, group)
            per_block_stats = [row_blocks.block_stats(s, blocks, cols) if blocks is not None else [s] for s in stats]
            iterations = op_arguments.polar_iterations(group)
            for k, (local_rows, along, shape) in enumerate(row_blocks.gram_parts(blocks, held if shard_dim == 0
                                                                                else None, rows, cols)):
                x = torch.stack([u if local_rows is None else u.index_select(0, local_rows) for u in updates])
                batches.append(ShardedBatch(x, shard_dim, iterations["ns_coefficients"], iterations["ns_steps"],
                                            iterations["polar_dtype"]))
                self.polar_flops += len(updates) * polar_flops(*shape, iterations["ns_steps"])
                normuon += [NormuonShard(x[i], per_block_stats[i][k], shape, shard_dim,
                                         held if along is None else along, group["beta2"], stats_local)
                            for i in range(len(updates)) if stats]
                written.append((updates, local_rows, x))
        self.bytes_sent += polar_express_shards(batches, process_group)
        self.bytes_sent += normuon_sharded(normuon, process_group)
        for updates, local_rows, x in written:
            for i, update in enumerate(updates):
                if local_rows is None:
                    update.copy_(x[i])
                else:
                    update.index_copy_(0, local_rows, x[i])
        for sub, (mat, updates, _) in zip(subs, phase1):
            self._apply(sub, mat, updates, states.tensors, found_inf)


_MUON_KEYS = ("momentum_buffer", "second_momentum_buffer")


class MuonMatrices(NamedTuple):
    """A Muon group's same-shape DTensor matrices with one layout, as an exchange takes them: `layout` and
    `shape` are each matrix's (placements.matrix_layout: a stack's matrices are placed as its split says)."""

    group: dict
    rows: int
    cols: int
    entries: List[_Entry]
    blocks: object  # row_blocks.RowBlocks or None
    layout: Layout
    shape: Tuple[int, ...]

    @property
    def stack(self) -> bool:
        """The params are stacks of matrices (matrix_view="batch" on more than 2 dims)."""
        return len(self.shape) < self.entries[0].info.param.dim()


class MuonExchange(NamedTuple):
    """How a DTensor Muon item's rows travel (WorkItem.exchange): its matrices split or replicated over the
    mesh go to their owners (the first one's owner rotates with `first`), are orthogonalized there and
    come back, by `DistributedStep._muon`."""

    step: "DistributedStep"
    matrices: MuonMatrices
    first: int

    def run(self, item: WorkItem, states, inv_scale, found_inf, max_workspace_bytes: int) -> None:
        self.step._muon(self.matrices, states, max_workspace_bytes, self.first, inv_scale, found_inf)


class InPlaceExchange(NamedTuple):
    """No rows travel (WorkItem.exchange for split_matrices="in_place"): every matrix split over one mesh dim is
    orthogonalized on its shards by Gram all_reduces, all of the step's such matrices together, by
    `DistributedStep._muon_in_place`."""

    step: "DistributedStep"
    matrices: List[MuonMatrices]

    def run(self, item: WorkItem, states, inv_scale, found_inf, max_workspace_bytes: int) -> None:
        self.step._muon_in_place(self.matrices, states, inv_scale, found_inf)


def mesh_scalers(mesh, device: torch.device, scalers, agreed: Dict) -> Tuple:
    """GradScaler's (inv_scale, found_inf) for a DTensor item, with found_inf summed over its mesh at the
    mesh's first item of the step (`agreed` keeps it for the rest): the ranks of a mesh skip or step
    together (an owner skipping would send stale rows to ranks that step)."""
    if mesh not in agreed:
        inv_scale, found_inf = scalers.on(device)
        if found_inf is not None:
            found_inf = found_inf.clone()
            _all_reduce_over(mesh, found_inf)
        agreed[mesh] = (inv_scale, found_inf)
    return agreed[mesh]


def _local_items(bucket: Bucket, group: dict, entries: List[_Entry], tensors: Mapping, keys: Tuple[str, ...],
                 blocks) -> List[PlannedItem]:
    """Items whose local tensors the fused kernels step as they step plain params, with their state lists
    (local tensors; a list None where an entry is still to be created: NorMuon switched on later)."""
    out = []
    for batch in _batches(entries, lambda e: (e.param.dtype, e.info.master_mode, e.grad.dtype)):
        state = [tensors[e.info.param] for e in batch]
        lists = {key: [local(s[key]) for s in state] if all(key in s for s in state) else None for key in keys}
        if "master_param" in state[0]:
            lists["master_param"] = [local(s["master_param"]) for s in state]
        item = WorkItem(bucket, group, [e.param for e in batch], [e.grad for e in batch], blocks,
                        [e.info.param for e in batch])
        out.append(PlannedItem(item, lists, None))
    return out


def agree_on_checks(param, checks: Callable[[], None], what: str) -> None:
    """Runs `checks` on this rank, then agrees with every rank of the DTensor
    `param`'s mesh (one small all_reduce): if they failed on any rank, every
    rank raises (its own error where they failed, a RuntimeError naming
    `what` elsewhere), so that no rank writes while another refuses."""
    error = None
    try:
        checks()
    except Exception as exc:  # re-raised below, after the collective every rank must join
        error = exc
    refused = torch.tensor([int(error is not None)], dtype=torch.int32, device=local(param).device)
    _all_reduce_over(param.device_mesh, refused)
    if error is not None:
        raise error
    if int(refused.item()):
        raise RuntimeError(f"{what}: refused on another rank of the mesh (see its error); nothing was written on "
                           "any rank")


def _placements_code(placements) -> int:
    """A small positive code of a grad's placements, compared across ranks (a mismatch is an SPMD bug)."""
    return zlib.crc32(repr(tuple(placements)).encode()) % 65521 + 1


def _all_reduce_over(mesh, t: torch.Tensor) -> None:
    """Sums `t` over every rank of `mesh`: one collective (over the default group where the mesh spans it)."""
    if mesh.size() == dist.get_world_size():
        dist.all_reduce(t)
    else:
        for dim in range(mesh.ndim):
            dist.all_reduce(t, group=mesh.get_group(dim))


def _work(infos: List[ParamInfo], grads: Dict, groups: List[dict]):
    """(adamw, muon): [(group index, entries)] and [((group, rows, cols, placements, mesh), entries)], in param
    order; the Muon key is the same on every rank (never the local shape)."""
    adamw: Dict[int, List[_Entry]] = {}
    muon: Dict[Tuple, List[_Entry]] = {}
    for info in infos:
        g = grads.get(id(info.param))
        if g is None or info.param.numel() == 0:  # zero-size (globally, so on every rank): nothing to update
            continue
        entry = _Entry(info, local(info.param), g)
        if info.kind == "adamw":
            adamw.setdefault(info.group, []).append(entry)
        else:
            p = info.param
            rows, cols = matrix_shape(p, groups[info.group]["matrix_view"], info.name)
            view_shape = tuple(p.shape) if (groups[info.group]["matrix_view"] == "batch" and p.dim() > 2) else ()
            if any(is_split(pl) and pl.dim > 0 for pl in p.placements):  # blocks depend on the shape, not just
                view_shape = tuple(p.shape)  # rows and cols: (6, 2, 3) and (6, 6) split on dim 1 differ
            key = (info.group, rows, cols, tuple(p.placements), p.device_mesh) + ((view_shape,) if view_shape else ())
            muon.setdefault(key, []).append(entry)
    return list(adamw.items()), [(k[:5], v) for k, v in muon.items()]


def _held_columns(p, mesh_shape, coordinate) -> torch.Tensor:
    """The columns of `p`'s matrix (dims 1.. flattened) this rank holds, in local order."""
    index = torch.arange(math.prod(p.shape[1:])).view(p.shape[1:])
    for dim in range(1, p.dim()):
        index = index.index_select(dim - 1, dim_indices(p.shape[dim], dim, mesh_shape, p.placements, coordinate))
    return index.reshape(-1)


def _apply_rows(index, params: List[torch.Tensor], updates: List[torch.Tensor], masters: List[torch.Tensor],
                apply) -> None:
    """Muon phase 3 (`apply(params, updates, masters)`, elementwise) on the local rows `index` of each
    matrix (None: all of them): gathered, applied, written back."""
    if index is None:
        apply(params, updates, masters)
        return
    if index.numel() == 0:
        return
    index = index.to(params[0].device)
    rows = lambda ts: [t.index_select(0, index) for t in ts]  # noqa: E731
    part_params, part_masters = rows(params), rows(masters)
    apply(part_params, rows(updates), part_masters)
    for whole, part in zip(params + masters, part_params + part_masters):
        whole.index_copy_(0, index, part)


def _batches(items: list, key) -> List[list]:
    out: Dict = {}
    for item in items:
        out.setdefault(key(item), []).append(item)
    return list(out.values())
