"""Mode aliases, the records the optimizer's modules pass between them, and a
type predicate.

The aliases are for type hints only: the accepted values are read from the C++
table (`muon_ext.schema.MODES`), and tests hold the two to the same names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Literal, NamedTuple, Optional

import torch

__all__ = ["Kind", "MasterMode", "LrScale", "MatrixView", "GradAttr", "ParamInfo", "Bucket", "WorkItem",
           "is_dtensor"]

Kind = Literal["muon", "adamw"]
MasterMode = Literal["none", "fp32", "remainder"]
LrScale = Literal["original", "match_rms_adamw", "none"]
MatrixView = Literal["error", "flatten", "batch"]
GradAttr = Literal["grad", "main_grad"]
PolarDtype = Literal["bfloat16", "float32", "float16"]
PolarMethod = Literal["standard", "gram", "auto"]


@dataclass(slots=True)
class ParamInfo:
    """How the optimizer treats one param (fixed at construction). Slots: one per param, 200k of them in a
    large MoE (a per-instance __dict__ would add about 100 bytes each)."""

    param: torch.nn.Parameter
    group: int  # index of its param group
    index: int  # position within its group
    kind: Kind
    master_mode: MasterMode
    name: str  # for messages
    writer: Optional[Any] = None  # writers.WriterEntry: stores the param from its FP32 master (master_mode is "fp32")


@dataclass
class Bucket:
    """Params stepped together: same group, device, dtype, master mode and (Muon) matrix shape."""

    group: int
    kind: Kind
    params: List[torch.nn.Parameter]
    writes_params: bool = True  # False: params with writers; the kernels update their FP32 masters only


class WorkItem(NamedTuple):
    """One unit of a step's plan: a bucket's params that have grads of one dtype.
    `blocks`: the group's parsed Muon `row_blocks` (muon_ext.row_blocks.RowBlocks),
    None where each param is one matrix; the runners cut their calls by it.
    `dtensors`: for DTensor params, the params themselves, whose local tensors
    `params` and `grads` are (their state, names and autograd versions are the
    DTensors'); None for plain params. `exchange`: how a Muon item's rows
    travel to the rank that orthogonalizes each matrix and back
    (muon_ext.distributed.step.MuonExchange); None where every matrix is whole
    on this rank and the fused kernel steps it (docs/design.md, "Data flow of
    one step")."""

    bucket: Bucket
    group: dict
    params: List[torch.nn.Parameter]
    grads: List[torch.Tensor]
    blocks: Optional[Any] = None
    dtensors: Optional[List[torch.nn.Parameter]] = None
    exchange: Optional[Any] = None

    @property
    def owners(self) -> List[torch.nn.Parameter]:
        """The optimizer's params this item steps (the DTensors for local shards)."""
        return self.params if self.dtensors is None else self.dtensors

    @property
    def mesh(self):
        """The device mesh of a DTensor item (its ranks step or skip together), None for plain params."""
        return None if self.dtensors is None else self.dtensors[0].device_mesh


_DTENSOR_TYPE: Any = None  # DTensor, or () where torch has no distributed; imported at the first call


def is_dtensor(t) -> bool:
    """Whether `t` is a torch.distributed DTensor (False where torch has no distributed). Called per param in
    construction, checkpoints and steps: the class is looked up once (an import statement per call cost
    about 3 us, a second of construction at 200k params)."""
    global _DTENSOR_TYPE
    if _DTENSOR_TYPE is None:
        try:
            from torch.distributed.tensor import DTensor as _DTENSOR_TYPE
        except ImportError:  # pragma: no cover - torch without distributed
            _DTENSOR_TYPE = ()
    return isinstance(t, _DTENSOR_TYPE)
