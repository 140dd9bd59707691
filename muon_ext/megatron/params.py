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
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

__all__ = ["MegatronParam", "classify", "TensorParallelView"]


class MegatronParam(NamedTuple):
    """One Megatron param as the adapter sees it."""

    param: torch.nn.Parameter  # Megatron's (the model's) param
    name: str
    kind: str  # "muon" | "adamw"
    expert: bool
    tp_group: Optional[object]  # its TP (or expert TP) process group; None where not split
    partition_dim: Optional[int]  # dim split over tp_group; None where not split

    @property
    def tp_size(self) -> int:
        return 1 if self.tp_group is None else self.tp_group.size()

    def full_shape(self):
        """The unsplit matrix's shape."""
        shape = list(self.param.shape)
        if self.partition_dim is not None:
            shape[self.partition_dim] *= self.tp_size
        return tuple(shape)


def classify(param: torch.nn.Parameter, name: str, pg_collection) -> MegatronParam:
    """Megatron's Muon rule for `param`, and its TP group where it is split."""
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
    return MegatronParam(param, name, "muon" if muon else "adamw", expert, group, dim)


class TensorParallelView:
    """The DTensor view of one TP-split Muon param ("duplicated" mode): a
    DTensor on a 1-D mesh over the param's TP group, placement
    Shard(partition_dim), whose local tensor is the Megatron param's storage,
    and whose `main_grad` is the Megatron main_grad's storage the same way."""

    _meshes = {}  # process group -> DeviceMesh: one mesh per group, so that params share exchanges

    def __init__(self, mp: MegatronParam):
        from torch.distributed.tensor import DTensor, Shard

        self.source = mp
        self.mesh = self._mesh(mp.tp_group, mp.param.device.type)
        self.placements = (Shard(mp.partition_dim),)
        local = mp.param.detach()
        self.dtensor = DTensor.from_local(local, self.mesh, self.placements, run_check=False,
                                          shape=torch.Size(mp.full_shape()), stride=_contiguous_strides(
                                              mp.full_shape()))
        self._data_ptr = local.data_ptr()

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
        self.dtensor.main_grad = None if grad is None else DTensor.from_local(
            grad, self.mesh, self.placements, run_check=False, shape=self.dtensor.shape,
            stride=self.dtensor.stride())


def _contiguous_strides(shape):
    strides, acc = [], 1
    for size in reversed(shape):
        strides.append(acc)
        acc *= size
    return tuple(reversed(strides))
