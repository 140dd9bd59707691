"""MuonAdamW checkpoints: torch's state-dict layout with FP32 masters.

Saving stores every master as an FP32 tensor, whatever the master mode, so a
checkpoint loads into any configuration. Loading validates the whole state dict
before writing anything, keeps FP32 state FP32 (torch's default load casts
floating state to the param dtype), rewrites each low-precision param from its
loaded master, and accepts TransformerEngine-style int16 remainders. Loaded
masters stay pending until the param's next use, so that the model weights may
be loaded before or after (docs/design.md, "Checkpoints").
"""

from __future__ import annotations

import copy
from typing import Dict, List, NamedTuple

import torch

from ._shapes import muon_stats_shape, stats_layout_error
from ._types import ParamInfo, is_dtensor
from .loaded_masters import load_master, load_remainder
from .schema import check_hyper, check_lr_value, rename_legacy_keys
from .state import OptimizerState
from .writers import is_quantized, storage_held

__all__ = ["state_dict", "load_state_dict", "check_state_dict", "apply_state_dict", "CheckedStateDict"]

_FP32_STATE = ("exp_avg", "exp_avg_sq", "momentum_buffer", "second_momentum_buffer")
_FLOAT32_MAX = float(torch.finfo(torch.float32).max)


def state_dict(groups: List[dict], states: OptimizerState, ownership=None) -> dict:
    """torch's layout (params by index), with every master as a new FP32 tensor. Under data-parallel
    `ownership` (distributed/ownership.py) a collective: every rank packs the entries it owns and one
    all_gather of them gives every rank the whole state, loadable at any data-parallel size."""
    states.pending.resolve()  # a pending master may still rewrite its param (FP32 params included)
    index = {}
    packed_groups = []
    for group in groups:
        packed = {k: v for k, v in group.items() if k != "params"}
        packed["params"] = [index.setdefault(id(p), len(index)) for p in group["params"]]
        packed_groups.append(packed)
    packed_state = {}
    for group in groups:
        for p in group["params"]:
            if ownership is not None and not ownership.owns(p):
                continue  # its owner packs it
            entry = dict(states.tensors[p])
            if "master_param" in entry:
                entry["master_param"] = states.read_master(states.info(p))
            packed_state[index[id(p)]] = entry
    if ownership is not None:
        params = {index[id(p)]: p for group in groups for p in group["params"]}
        packed_state = ownership.gather_entries(packed_state, params)
    return {"state": packed_state, "param_groups": packed_groups}


def load_state_dict(groups: List[dict], states: OptimizerState, saved_dict: dict, *, capturable: bool) -> None:
    """Validates `saved_dict` against the optimizer's `groups` and `states`,
    then loads it: group settings, then each param's state and master. A tensor
    lr of a capturable optimizer is written in place."""
    apply_state_dict(groups, states, check_state_dict(groups, states, saved_dict), capturable=capturable)


class CheckedStateDict(NamedTuple):
    saved_groups: List[dict]  # deep copies of the saved groups
    merged_groups: List[dict]  # each optimizer group with the saved settings over it, as it will be
    plan: List[tuple]  # (param's info, saved entry)


def check_state_dict(groups: List[dict], states: OptimizerState, saved_dict: dict) -> CheckedStateDict:
    """Every check of `load_state_dict`; writes nothing."""
    if not isinstance(saved_dict, dict):
        raise TypeError(f"load_state_dict: expected a dict, got {type(saved_dict).__name__}")
    saved_groups = saved_dict.get("param_groups")
    saved_state = saved_dict.get("state")
    if not isinstance(saved_groups, list) or not isinstance(saved_state, dict):
        raise ValueError("load_state_dict: expected a dict with 'param_groups' (list) and 'state' (dict)")
    saved_groups = copy.deepcopy(saved_groups)  # as torch: the loaded groups share nothing with the caller
    if len(saved_groups) != len(groups):
        raise ValueError(f"load_state_dict: the state dict has {len(saved_groups)} param groups, "
                         f"the optimizer {len(groups)}")
    plan: List[tuple] = []  # (param's info, saved entry)
    merged_groups: List[dict] = []
    for gi, (saved, group) in enumerate(zip(saved_groups, groups)):
        if not isinstance(saved, dict):
            raise TypeError(f"load_state_dict: param group {gi} must be a dict, got {type(saved).__name__}")
        if not isinstance(saved.get("params", []), (list, tuple)):
            raise TypeError(f"load_state_dict: param group {gi}: 'params' must be a list of state keys, got "
                            f"{type(saved['params']).__name__}")
        if len(saved.get("params", [])) != len(group["params"]):
            raise ValueError(f"load_state_dict: param group {gi} has {len(saved.get('params', []))} params in the "
                             f"state dict and {len(group['params'])} in the optimizer")
        if saved.get("kind", group["kind"]) != group["kind"]:
            raise ValueError(f"load_state_dict: param group {gi} is '{saved.get('kind')}' in the state dict and "
                             f"'{group['kind']}' in the optimizer")
        if isinstance(saved.get("lr"), torch.Tensor) and group["params"]:
            # A tensor lr saved on another device (a capturable run, another rank) lands on this group's.
            saved["lr"] = saved["lr"].detach().to(group["params"][0].device, torch.float32)
        rename_legacy_keys(f"load_state_dict: param group {gi}: ", saved)  # saved by an earlier version
        merged = dict(group, **{k: v for k, v in saved.items() if k != "params"})
        merged_groups.append(merged)
        check_hyper(gi, merged)
        if isinstance(merged["lr"], torch.Tensor):
            # Its value too (a device-to-host read on GPUs, once per load): a
            # bad lr must not load and then fail every step.
            check_lr_value(f"load_state_dict: param group {gi}: ", float(merged["lr"]), merged["kind"])
        if merged["kind"] == "muon" and merged["matrix_view"] != group["matrix_view"]:
            raise ValueError(f"load_state_dict: param group {gi} has matrix_view '{merged['matrix_view']}' in the "
                             f"state dict and '{group['matrix_view']}' in the optimizer")
        for p, key in zip(group["params"], saved["params"]):
            info = states.info(p)
            entry = saved_state.get(key, {})
            _check_entry(info, entry, merged)
            _check_stats_layout(info, states.tensors[p], merged)
            plan.append((info, entry))
    return CheckedStateDict(saved_groups, merged_groups, plan)


def apply_state_dict(groups: List[dict], states: OptimizerState, checked: CheckedStateDict, *,
                     capturable: bool) -> None:
    """Loads a state dict that `check_state_dict` accepted."""
    saved_groups, plan = checked.saved_groups, checked.plan
    for saved, group in zip(saved_groups, groups):
        lr = group["lr"]
        group.update({k: v for k, v in saved.items() if k != "params"})
        if capturable and isinstance(lr, torch.Tensor):
            lr.copy_(torch.as_tensor(group["lr"], dtype=torch.float32).reshape(lr.shape))  # keep graph-captured lr
            group["lr"] = lr
    # Tensors are written in place, so a CUDA graph captured before the load
    # steps on the loaded state.
    for info, entry in plan:
        _load_entry(states, info, entry, groups[info.group])


def _expected_state_shape(p: torch.Tensor, key: str, group: Dict):
    if key == "second_momentum_buffer":
        return muon_stats_shape(p, group) if group["kind"] == "muon" else None
    return tuple(p.shape)


def _check_stats_layout(info: ParamInfo, state: Dict, group: Dict) -> None:
    """The NorMuon statistics this optimizer holds are laid out for its row_blocks (resident tensors, offload
    slab regions): a checkpoint whose row_blocks need another layout is refused here, before the groups are
    replaced, as a step refuses an edit of them."""
    if group["kind"] != "muon":
        return
    held = state.get("second_momentum_buffer")
    if isinstance(held, torch.Tensor):
        error = stats_layout_error(f"load_state_dict: {info.name}", info.param, group, held.shape)
        if error is not None:
            raise error


def _check_entry(info: ParamInfo, entry: Dict, group: Dict) -> None:
    """Raises unless `entry` can be loaded into the param's state under the merged `group`."""
    p = info.param
    if not isinstance(entry, dict):
        raise TypeError(f"load_state_dict: {info.name}: expected a dict of state, got {type(entry).__name__}")
    for key, value in entry.items():
        where = f"load_state_dict: {info.name}, state '{key}'"
        if key == "step":
            ok = (isinstance(value, (int, float)) and not isinstance(value, bool)) or (
                isinstance(value, torch.Tensor) and value.numel() == 1 and value.layout == torch.strided
                and not value.is_meta and not value.is_complex())
            # Step counters are FP32 tensors: the value must survive the rounding.
            if not ok or not 0 <= float(value) <= _FLOAT32_MAX:
                raise ValueError(f"{where}: expected a number in [0, {_FLOAT32_MAX:.4g}] (float32) or a "
                                 f"one-element tensor holding one, got {value!r}")
            continue
        if key not in _FP32_STATE and key != "master_param":
            continue  # unknown extra state (any type) is kept as is
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{where}: expected a tensor, got {type(value).__name__}")
        if is_dtensor(value) != is_dtensor(p) or (is_dtensor(p) and value.device_mesh != p.device_mesh):
            want = f"a DTensor on the param's mesh {p.device_mesh}" if is_dtensor(p) else "a plain tensor"
            raise TypeError(f"{where}: expected {want}, like the param, got {type(value).__name__} (DTensor params "
                            "load through torch.distributed.checkpoint's set_optimizer_state_dict)")
        if value.layout != torch.strided or value.is_meta or value.is_nested:
            kind = "a nested tensor" if value.is_nested else f"layout {value.layout} on {value.device}"
            raise TypeError(f"{where}: expected a dense tensor with data, got {kind}")
        if key == "master_param":
            int16_ok = value.dtype == torch.int16 and p.dtype == torch.bfloat16
            if value.dtype != torch.float32 and not int16_ok:
                raise TypeError(f"{where}: expected float32 (or int16 remainders for bfloat16 params), got {value.dtype}")
            if value.dtype == torch.int16 and is_quantized(p):
                raise TypeError(f"{where}: int16 remainders complete a bfloat16 param's values, and this is a "
                                "quantized param (its values are quantized, not the master's bfloat16 high half); "
                                "load an FP32 master (a MuonAdamW state dict)")
            if value.dtype == torch.int16 and not storage_held(p):
                raise ValueError(f"{where}: int16 remainders complete the bfloat16 param's values, and its storage "
                                 "is released; load an FP32 master (a MuonAdamW state dict) or restore the storage")
            expected = tuple(p.shape)
        else:
            if not value.dtype.is_floating_point:
                raise TypeError(f"{where}: expected a floating tensor, got {value.dtype}")
            expected = _expected_state_shape(p, key, group)
        if expected is not None and tuple(value.shape) != expected:
            raise ValueError(f"{where}: shape {tuple(value.shape)}, expected {expected}")


def _load_entry(states: OptimizerState, info: ParamInfo, entry: Dict, group: Dict) -> None:
    """Replaces the param's state with `entry` (as torch does: state the entry
    lacks starts fresh, zero moments and step; a missing master is the param),
    writing into the existing tensors."""
    p = info.param
    states.init(info, group)
    state = states.tensors[p]
    for key in list(state):
        if key == "master_param" or key in entry:
            continue
        if key in _FP32_STATE or key == "step":
            state[key].zero_()
        else:
            del state[key]  # extra state the checkpoint does not have
    for key, value in entry.items():
        if key == "master_param" or (key == "step" and "step" not in state):
            continue  # the master is written below; a step counter only where this kind keeps one
        if key == "step":
            state["step"].fill_(float(value))
        elif key in state and isinstance(value, torch.Tensor):
            state[key].copy_(value)  # keeps our dtype (FP32) and device
        elif key in _FP32_STATE:
            state[key] = value.to(device=p.device, dtype=torch.float32, copy=True)
        else:
            state[key] = value.to(p.device) if isinstance(value, torch.Tensor) else value
    master = entry.get("master_param")
    if master is None and info.writer is not None:
        pass  # the param (released or quantized) holds no master to read: its master stays as it is
    elif master is None and info.master_mode == "fp32":
        # No saved master: the param is the master, whether the model weights
        # are loaded before or after this call; read it at the next use.
        states.pending.mark(info, "param")
    elif master is None:
        states.write_master(info, p.detach().float())  # a zero remainder: the param, whenever loaded, is the master
    elif master.dtype == torch.int16:
        load_remainder(states, info, master.to(p.device).contiguous())
    else:
        load_master(states, info, master.to(device=p.device, dtype=torch.float32).contiguous())
