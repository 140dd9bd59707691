"""Which optimizer each Megatron param goes to, and how a tensor-parallel
shard is shown to MuonAdamW (docs/design.md, "Megatron-Core adapter").

Megatron's Muon rules: 2-D params that are not embeddings or the output
layer (`is_embedding_or_output_parameter`) go to Muon, everything else to
AdamW. A Muon param split over a tensor-parallel group
(`tensor_model_parallel=True`, `partition_dim`) is stepped by `tp_mode`:
"blockwise": the local shard is a matrix of its own (a plain param);
"duplicated": the shard is shown as a DTensor `Shard(partition_dim)` on a 1-D
mesh over the TP group, sharing storage with the Megatron param and its
main_grad, so that MuonAdamW's DTensor path orthogonalizes the whole matrix
(the same bits as TP=1). Expert params use the expert TP group.

The legacy `GroupedMLP` keeps all local experts in one 2-D weight and its
forward reads expert e's matrix from the e-th chunk of its memory
(`weight1.view(E, hidden, -1)`, `weight2.view(E, -1, hidden)`): such a weight
is shown as that `[E, rows, cols]` stack (a view of its storage, and of its
main_grad) under `matrix_view="batch"`, so each expert is orthogonalized on
its own; an expert-TP split of the weight splits every expert's matrix
(weight1's columns, weight2's rows), so the DTensor view is
`Shard(partition_dim + 1)` of the stack (docs/design.md, "Expert stacks").
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

__all__ = ["MegatronParam", "classify", "grouped_experts", "TensorParallelView"]


class MegatronParam(NamedTuple):
    """One Megatron param as the adapter sees it."""

    param: torch.nn.Parameter  # Megatron's (the model's) param
    name: str
    kind: str  # "muon" | "adamw"
    expert: bool
    tp_group: Optional[object]  # its TP (or expert TP) process group; None where not split
    partition_dim: Optional[int]  # dim split over tp_group; None where not split
    grouped: int = 0  # GroupedMLP weight: its number of local experts (0: not one)

    @property
    def tp_size(self) -> int:
        return 1 if self.tp_group is None else self.tp_group.size()

    def full_shape(self):
        """The unsplit matrix's shape."""
        shape = list(self.param.shape)
        if self.partition_dim is not None:
            shape[self.partition_dim] *= self.tp_size
        return tuple(shape)

    def view_shape(self, full: bool):
        """The shape Muon sees: the param's (`full`: unsplit), or for a GroupedMLP weight its `[E, rows, cols]`
        stack of local experts (weight1: `[E, hidden, ffn]`, weight2: `[E, ffn, hidden]`)."""
        shape = self.full_shape() if full else tuple(self.param.shape)
        if not self.grouped:
            return shape
        rows, cols = shape
        if self.name.endswith("weight1"):
            return (self.grouped, rows, cols // self.grouped)
        return (self.grouped, rows // self.grouped, cols)

    def out_in(self, full: bool):
        """(out, in) features of one matrix (of one expert for a GroupedMLP weight, which stores [in, out]): the
        shape Megatron's update scale reads."""
        shape = self.view_shape(full)
        return tuple(reversed(shape[1:])) if self.grouped else shape


def grouped_experts(model_chunks) -> dict:
    """id(param) -> number of local experts, for the weights of the legacy GroupedMLP modules."""
    found = {}
    for chunk in model_chunks:
        for module in chunk.modules():
            if type(module).__name__ == "GroupedMLP":
                for weight in (module.weight1, module.weight2):
                    found[id(weight)] = module.num_local_experts
    return found


def classify(param: torch.nn.Parameter, name: str, pg_collection, grouped: int = 0) -> MegatronParam:
    """Megatron's Muon rule for `param`, and its TP group where it is split; `grouped`: its number of local
    experts if it is a GroupedMLP weight."""
    muon = param.dim() == 2 and not getattr(param, "is_embedding_or_output_parameter", False)
    expert = "experts" in name and "shared" not in name
    group, dim = None, None
    if getattr(param, "tensor_model_parallel", False) and getattr(param, "partition_dim", -1) in (0, 1):
        group = pg_collection.expt_tp if expert else pg_collection.tp
        if group is None or group.size() == 1:
            group = None
        else:
            dim = param.partition_dim
            if getattr(param, "partition_stride", 1) != 1 and muon:
                # Strided shards interleave rows: the gathered matrix would be a permutation of the true one.
                raise ValueError(f"muon_ext.megatron: {name} has partition_stride={param.partition_stride}; "
                                 "only stride 1 is supported for Muon params")
    return MegatronParam(param, name, "muon" if muon else "adamw", expert, group, dim, grouped if muon else 0)


class TensorParallelView:
    """What MuonAdamW holds for a Muon param that is TP-split outside
    "blockwise" mode, or a GroupedMLP weight (`tensor`). Split: a DTensor on a
    1-D mesh over the param's TP group, placement Shard(partition_dim) (of the
    expert stack: partition_dim + 1), whose local tensor is the Megatron
    param's storage, and whose `main_grad` is the Megatron main_grad's
    storage the same way. Not split (a GroupedMLP weight at expert TP 1, or
    "blockwise"): the plain `[E, rows, cols]` view of the storage, with the
    main_grad's view as its `main_grad`."""

    _meshes = {}  # process group -> DeviceMesh: one mesh per group, so that params share exchanges

    def __init__(self, mp: MegatronParam, split: bool = True):
        from torch.distributed.tensor import DTensor, Shard

        self.source = mp
        self.split = split and mp.partition_dim is not None
        local = mp.param.detach().view(mp.view_shape(full=False))
        self.mesh, self.placements = None, ()
        if self.split:
            self.mesh = self._mesh(mp.tp_group, mp.param.device.type)
            self.placements = (Shard(mp.partition_dim + (1 if mp.grouped else 0)),)
            full = mp.view_shape(full=True)
            local = DTensor.from_local(local, self.mesh, self.placements, run_check=False, shape=torch.Size(full),
                                       stride=_contiguous_strides(full))
        self.tensor = local
        self._data_ptr = mp.param.data_ptr()

    @classmethod
    def _mesh(cls, group, device_type: str):
        from torch.distributed.device_mesh import DeviceMesh

        key = (group, device_type)
        if key not in cls._meshes:
            cls._meshes[key] = DeviceMesh.from_group(group, device_type=device_type)
        return cls._meshes[key]

    def refresh_grad(self) -> None:
        """Points the view's main_grad at the Megatron param's current main_grad
        (a DTensor over the same storage); refuses a param whose storage moved."""
        from torch.distributed.tensor import DTensor

        p = self.source.param
        if p.data_ptr() != self._data_ptr:
            raise RuntimeError(f"muon_ext.megatron: {self.source.name}'s storage was replaced after the optimizer "
                               "was built (its DTensor view would step stale memory); rebuild the optimizer")
        grad = getattr(p, "main_grad", None)
        if grad is not None:
            grad = grad.view(self.source.view_shape(full=False))
        if grad is not None and self.split:
            grad = DTensor.from_local(grad, self.mesh, self.placements, run_check=False, shape=self.tensor.shape,
                                      stride=self.tensor.stride())
        self.tensor.main_grad = grad


def _contiguous_strides(shape):
    strides, acc = [], 1
    for size in reversed(shape):
        strides.append(acc)
        acc *= size
    return tuple(reversed(strides))
