"""A bit-exact snapshot of everything a MuonAdamW call may change: params,
state tensors (DTensors: local parts), group settings, writers and master
modes. Two snapshots compare equal exactly when nothing changed;
`assert_unchanged` names what did."""

from __future__ import annotations

from typing import Dict, Iterable

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
            info = opt._states.infos.get(id(p))  # None: a param put into a group by hand (not the optimizer's)
            state = opt.state.get(p, {})
            writer = None if info is None or info.writer is None else id(info.writer.writer)
            params[id(p)] = (tensor_bits(p), None if info is None else info.master_mode, writer,
                             tuple(sorted((k, tensor_bits(v) if isinstance(v, torch.Tensor) else repr(v))
                                          for k, v in state.items())))
    return {"groups": tuple(groups), "params": params}


def named(opt, snap: dict) -> Dict[str, object]:
    """`snap` (of `opt`) by name: "group g param i" (its values), "group g param i <state key>",
    "group g param i mode" (master mode and writer), "group g settings"."""
    out: Dict[str, object] = {}
    for gi, g in enumerate(opt.param_groups):
        if gi < len(snap["groups"]):
            out[f"group {gi} settings"] = snap["groups"][gi]
        for pi, p in enumerate(g["params"]):
            entry = snap["params"].get(id(p))
            if entry is None:
                continue
            values, master, writer, state = entry
            name = f"group {gi} param {pi}"
            out[name], out[f"{name} mode"] = values, (master, writer)
            out.update((f"{name} {key}", value) for key, value in state)
    return out


def assert_unchanged(opt, before: dict, skip: Iterable[str] = (), settings: bool = True) -> None:
    """Everything of `opt` as in the snapshot `before` but the names in `skip` (see `named`); group settings
    too unless `settings=False` (a test that edited them itself)."""
    skip = set(skip)
    then, now = named(opt, before), named(opt, snapshot(opt))
    assert then.keys() == now.keys(), f"entries changed: {sorted(then.keys() ^ now.keys())}"
    for key, value in now.items():
        if key in skip or (not settings and key.endswith(" settings")):
            continue
        assert value == then[key], f"{key} changed"
