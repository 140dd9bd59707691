"""A bit-exact snapshot of everything a MuonAdamW call may change: params,
state tensors (DTensors: local parts), group settings, writers and master
modes. Two snapshots compare equal exactly when nothing changed."""

from __future__ import annotations

import torch

from muon_ext import ops


def tensor_bits(t: torch.Tensor):
    """(dtype, shape, bytes) of a tensor's elements; a released storage gives 'released' (not read)."""
    t = t.to_local() if hasattr(t, "to_local") else t
    if ops.storage_problem(t):
        return (str(t.dtype), tuple(t.shape), "released")
    data = t.detach().contiguous().reshape(-1).view(torch.uint8) if t.numel() else t.detach().reshape(-1)
    return (str(t.dtype), tuple(t.shape), bytes(data.tolist()))


def _setting(value):
    if isinstance(value, torch.Tensor):
        return tensor_bits(value)
    if isinstance(value, (list, tuple)):
        return tuple(_setting(v) for v in value)
    return repr(value)


def snapshot(opt) -> dict:
    """Params, state, settings, writers and master modes of `opt`, hashable and comparable."""
    groups = []
    for g in opt.param_groups:
        groups.append(tuple(sorted((k, _setting(v)) for k, v in g.items() if k != "params"))
                      + (("params", tuple(id(p) for p in g["params"])),))
    params = {}
    for g in opt.param_groups:
        for p in g["params"]:
            info = opt._states.info(p)
            state = opt.state.get(p, {})
            params[id(p)] = (tensor_bits(p), info.master, None if info.writer is None else id(info.writer.writer),
                             tuple(sorted((k, tensor_bits(v) if isinstance(v, torch.Tensor) else repr(v))
                                          for k, v in state.items())))
    return {"groups": tuple(groups), "params": params}
