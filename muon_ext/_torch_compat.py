"""torch's private members that muon_ext uses, all in this one module.

Each one is in `PRIVATE_MEMBERS` with why muon_ext needs it (no public
equivalent does the job) and the torch version it was checked against; the
rest of the package reaches them only through the names below
(tests/python/test_architecture.py holds it to that; docs/design.md, "Module
layout"). A torch without one of them fails where it is first needed with a
RuntimeError naming the member, not with an AttributeError deep in a step.

Members of `torch` and `torch._C` are resolved when this module is imported
(torch itself is loaded by then, and one of them is read on every op call);
those of `torch.distributed` on first use, so that a process that never meets
a DTensor or a process group never imports them.
"""

from __future__ import annotations

import functools
import importlib
from typing import Any, NamedTuple

import torch

__all__ = [
    "PRIVATE_MEMBERS",
    "amp_foreach_non_finite_check_and_unscale_",
    "compute_local_shape_and_global_offset",
    "foreach_copy_",
    "foreach_mul_",
    "split_tensor",
    "strided_shard",
    "torch_dispatch_stack_depth",
]

# The torch release every entry below was checked against (muon_ext's wheel pins its torch: setup.py).
CHECKED_WITH = "2.14.1"


class PrivateMember(NamedTuple):
    """`owner` (a module, or a class given by its module path) and the private `member` on it."""

    owner: str
    member: str
    why: str
    checked_with: str = CHECKED_WITH


PRIVATE_MEMBERS = (
    PrivateMember(
        "torch._C", "_len_torch_dispatch_stack",
        "ops._entry calls the pybind twin of a step op only when no TorchDispatchMode is active; torch has no "
        "public query of the dispatch mode stack, and this one costs nothing on every op call."),
    PrivateMember(
        "torch", "_foreach_mul_",
        "muon_ext.megatron's clip_grad_norm scales all main grads in one multi-tensor kernel, as Megatron-Core's "
        "own clip does; torch has no public foreach API."),
    PrivateMember(
        "torch", "_foreach_copy_",
        "distributed/ownership.py's Ownership.share copies every gathered param out of the all_gather buffer "
        "in one multi-tensor kernel; torch has no public foreach API."),
    PrivateMember(
        "torch", "_amp_foreach_non_finite_check_and_unscale_",
        "muon_ext.megatron's prepare_grads unscales the fp16 main grads and finds inf/nan in one pass, the kernel "
        "torch.amp.GradScaler itself calls; GradScaler's public unscale_ works on an optimizer, not on a grad list."),
    PrivateMember(
        "torch.distributed.tensor.placement_types", "_StridedShard",
        "the placement FSDP2 gives a dim that tensor parallelism already split; DTensor params carry it, so the "
        "layout checks and the index replay must recognise and rebuild it."),
    PrivateMember(
        "torch.distributed.tensor.placement_types.Shard", "_split_tensor",
        "DTensor's own split rule (Shard and _StridedShard), replayed on an index vector to find the global rows "
        "and columns each rank holds, so they agree with DTensor by construction."),
    PrivateMember(
        "torch.distributed.tensor._utils", "compute_local_shape_and_global_offset",
        "the local shape DTensor gives a rank for a global shape and placements (expected param shapes, "
        "optimizer state made with DTensor.from_local); DTensor exposes it for existing tensors only."),
)


def _resolve(owner: str, member: str) -> Any:
    """owner.member, or a RuntimeError saying which private member this torch lacks."""
    try:
        module_path, obj = owner, None
        while obj is None:
            try:
                obj = importlib.import_module(module_path)
            except ModuleNotFoundError:
                if "." not in module_path:
                    raise
                module_path = module_path.rpartition(".")[0]
        for attribute in owner[len(module_path):].lstrip(".").split("."):
            if attribute:
                obj = getattr(obj, attribute)
        return getattr(obj, member)
    except (ImportError, AttributeError) as error:
        entry = next((e for e in PRIVATE_MEMBERS if (e.owner, e.member) == (owner, member)), None)
        checked = entry.checked_with if entry else CHECKED_WITH
        why = f" ({entry.why})" if entry else ""
        raise RuntimeError(
            f"muon_ext needs torch's private {owner}.{member}{why}; it was checked against torch {checked} and "
            f"torch {torch.__version__} does not have it: install the torch muon_ext was built for") from error


@functools.cache
def _lazy(owner: str, member: str) -> Any:
    return _resolve(owner, member)


# torch's own functions, bound as they are (the first is read on every op call: no wrapper).
torch_dispatch_stack_depth = _resolve("torch._C", "_len_torch_dispatch_stack")
foreach_mul_ = _resolve("torch", "_foreach_mul_")
foreach_copy_ = _resolve("torch", "_foreach_copy_")
amp_foreach_non_finite_check_and_unscale_ = _resolve("torch", "_amp_foreach_non_finite_check_and_unscale_")


def strided_shard() -> type:
    """The class torch.distributed.tensor.placement_types._StridedShard."""
    return _lazy("torch.distributed.tensor.placement_types", "_StridedShard")


def split_tensor(placement, tensor: torch.Tensor, num_chunks: int, *, with_padding: bool, contiguous: bool):
    """`placement._split_tensor(...)` of a Shard or _StridedShard: (pieces, pad sizes)."""
    _lazy("torch.distributed.tensor.placement_types.Shard", "_split_tensor")  # a clear error where it is missing
    return placement._split_tensor(tensor, num_chunks, with_padding=with_padding, contiguous=contiguous)


def compute_local_shape_and_global_offset(*args, **kwargs):
    """torch.distributed.tensor._utils.compute_local_shape_and_global_offset."""
    return _lazy("torch.distributed.tensor._utils", "compute_local_shape_and_global_offset")(*args, **kwargs)

