"""Malformed MuonAdamW checkpoints leave the optimizer usable.

Each case corrupts a real state dict. A refused one must raise a TypeError or
ValueError whose message says where (load_state_dict / the param group) and
what (the key, setting or value), leave every param, state tensor and group
setting bit-identical, and the optimizer must then step, and load a good
checkpoint, exactly like a twin that never saw the bad one. A harmless one
must load and then behave exactly like its twin loading the equivalent clean
checkpoint.

test_checkpoint.py (`_CORRUPTIONS` and the tests after it) already covers
group and param counts, the kind, several shapes and dtypes, meta / sparse
masters, exp_avg and step, an int16 master for an FP32 param and unknown
tensor entries; none of those is repeated here.
"""

from __future__ import annotations

import copy
import functools
import math
import re
import warnings
from typing import Callable, NamedTuple, Optional

import pytest
import torch

from support.helpers import assert_bit_equal, optimizer_tensors
from support.optimizer_snapshot import assert_unchanged, snapshot
from test_checkpoint import _build, _train

# The model, groups and grads of test_checkpoint.py (modes bf16_remainder and fp16_fp32_master).
# Where a message must say the problem is.
_WHERE = r"load_state_dict|param group \d"


@functools.lru_cache(maxsize=None)
def _trained_state_dict(mode):
    model, opt = _build(mode, seed=0)
    _train(model, opt, range(3))
    sd = copy.deepcopy(opt.state_dict())
    for group, lr in zip(sd["param_groups"], (0.011, 0.022, 0.0033)):
        group["lr"] = lr
    return sd


def _source(mode):
    """A trained optimizer's state dict (a new deep copy), with lrs the target
    does not have, so that a partial load of the groups would show."""
    return copy.deepcopy(_trained_state_dict(mode))


def _target(mode):
    """Another run of the same model: the optimizer that receives the bad checkpoint."""
    model, opt = _build(mode, seed=1)
    _train(model, opt, range(1))
    return model, opt


def _settings(opt):
    return [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]


def _assert_same_optimizer(a, b, ignore_group_keys=()):
    ta, tb = optimizer_tensors(a), optimizer_tensors(b)
    assert ta.keys() == tb.keys()
    for key in ta:
        assert_bit_equal(ta[key], tb[key], key)
    strip = lambda s: [{k: v for k, v in g.items() if k not in ignore_group_keys} for g in s]  # noqa: E731
    assert strip(_settings(a)) == strip(_settings(b))


def _all_finite(opt):
    return all(bool(torch.isfinite(t.float()).all()) for t in optimizer_tensors(opt).values()
               if t.is_floating_point())


# Where corruptions go: late in the dict (last group, last param), so a loader
# that wrote as it went would already have changed earlier params.
def _muon(sd):
    return sd["state"][sd["param_groups"][0]["params"][0]]


def _experts(sd):
    return sd["state"][sd["param_groups"][1]["params"][0]]


def _adamw_2d(sd):  # the embedding, [16, 12]
    return sd["state"][sd["param_groups"][2]["params"][0]]


def _adamw_last(sd):  # ln.bias, [12]
    return sd["state"][sd["param_groups"][2]["params"][-1]]


def _set(where, **values):
    """A corruption that sets entries of the dict `where(sd)` picks."""
    return lambda sd: where(sd).update(values)


def _set_from(where, key, fn):
    """A corruption that replaces entry `key` of `where(sd)` by `fn(old value)`."""
    return lambda sd: where(sd).update({key: fn(where(sd)[key])})


def _group(index):
    return lambda sd: sd["param_groups"][index]


class Bad(NamedTuple):
    corrupt: Callable[[dict], object]
    what: str  # a regex the message must match besides _WHERE: the key, setting or value at fault
    mode: str = "bf16_remainder"


def _nested_exp_avg(value):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # nested tensors are a prototype API and say so
        return torch.nested.nested_tensor([torch.zeros(value.shape)])


REFUSED = {
    # the layout
    "no_state_key": pytest.param(Bad(lambda sd: sd.pop("state"), "state")),
    "no_param_groups_key": pytest.param(Bad(lambda sd: sd.pop("param_groups"), "param_groups")),
    "param_groups_a_dict": pytest.param(Bad(lambda sd: sd.update(param_groups=dict(enumerate(sd["param_groups"]))),
                                            "param_groups")),
    "group_not_a_dict": pytest.param(Bad(lambda sd: sd["param_groups"].__setitem__(
        2, list(sd["param_groups"][2].items())), r"param group 2|param_groups\[2\]")),
    "group_without_params": pytest.param(Bad(lambda sd: sd["param_groups"][2].pop("params"), "params")),
    "group_params_not_a_list": pytest.param(Bad(_set(_group(2), params=5), "params")),
    "entry_not_a_dict": pytest.param(Bad(lambda sd: sd["state"].__setitem__(
        sd["param_groups"][2]["params"][-1], torch.zeros(12)), "dict")),
    # step counters
    "step_nan": pytest.param(Bad(_set(_adamw_last, step=math.nan), "'step'")),
    "step_inf_tensor": pytest.param(Bad(_set(_adamw_last, step=torch.tensor(math.inf)), "'step'")),
    "step_bool": pytest.param(Bad(_set(_adamw_last, step=True), "'step'")),
    "step_string": pytest.param(Bad(_set(_adamw_last, step="3"), "'step'")),
    "step_complex_tensor": pytest.param(Bad(_set(_adamw_last, step=torch.tensor(3 + 0j)), "'step'")),
    "step_beyond_float32": pytest.param(Bad(_set(_adamw_last, step=1e300), "'step'")),
    # state tensors
    "exp_avg_complex": pytest.param(Bad(_set(_adamw_last, exp_avg=torch.zeros(12, dtype=torch.complex64)),
                                        "'exp_avg'")),
    "exp_avg_sq_bool": pytest.param(Bad(_set(_adamw_last, exp_avg_sq=torch.zeros(12, dtype=torch.bool)),
                                        "'exp_avg_sq'")),
    "exp_avg_sq_shape": pytest.param(Bad(_set(_adamw_2d, exp_avg_sq=torch.zeros(12, 16)), "'exp_avg_sq'")),
    "exp_avg_nested": pytest.param(Bad(_set_from(_adamw_last, "exp_avg", _nested_exp_avg), "'exp_avg'")),
    "momentum_a_list": pytest.param(Bad(_set_from(_muon, "momentum_buffer", lambda v: v.tolist()),
                                        "'momentum_buffer'")),
    "momentum_on_meta": pytest.param(Bad(_set_from(_muon, "momentum_buffer", lambda v: v.to("meta")),
                                         "'momentum_buffer'")),
    "momentum_float64_wrong_shape": pytest.param(Bad(_set_from(_experts, "momentum_buffer",
                                                               lambda v: v.double().reshape(2, 4, 6)),
                                                     "'momentum_buffer'")),
    "second_moment_sparse": pytest.param(Bad(_set_from(_experts, "second_momentum_buffer", lambda v: v.to_sparse()),
                                             "'second_momentum_buffer'")),
    "second_moment_for_one_matrix": pytest.param(Bad(_set_from(_experts, "second_momentum_buffer", lambda v: v[0]),
                                                     "'second_momentum_buffer'")),
    "master_sparse": pytest.param(Bad(_set_from(_adamw_last, "master_param", lambda v: v.to_sparse()),
                                      "'master_param'")),
    "master_float64": pytest.param(Bad(_set_from(_adamw_last, "master_param", lambda v: v.double()),
                                       "'master_param'")),
    "master_flattened": pytest.param(Bad(_set_from(_muon, "master_param", lambda v: v.reshape(-1)),
                                         "'master_param'")),
    "master_int16_for_fp16_param": pytest.param(Bad(_set_from(_adamw_last, "master_param",
                                                              lambda v: torch.zeros(v.shape, dtype=torch.int16)),
                                                    "'master_param'", mode="fp16_fp32_master")),
    # group settings
    "lr_negative": pytest.param(Bad(_set(_group(2), lr=-1e-3), "lr")),
    "lr_nan": pytest.param(Bad(_set(_group(0), lr=math.nan), "lr")),
    "lr_string": pytest.param(Bad(_set(_group(2), lr="1e-3"), "lr")),
    "lr_none": pytest.param(Bad(_set(_group(1), lr=None), "lr")),
    "lr_tensor_of_two": pytest.param(Bad(_set(_group(2), lr=torch.tensor([1e-3, 2e-3])), "lr")),
    "lr_tensor_nan": pytest.param(Bad(_set(_group(2), lr=torch.tensor(math.nan)), "lr")),
    "weight_decay_inf": pytest.param(Bad(_set(_group(2), weight_decay=math.inf), "weight_decay")),
    "eps_negative": pytest.param(Bad(_set(_group(2), eps=-1e-8), "eps")),
    "beta1_one": pytest.param(Bad(_set(_group(2), betas=(1.0, 0.999)), r"betas\[0\]")),
    "beta2_rounds_to_one": pytest.param(Bad(_set(_group(2), betas=(0.9, 1.0 - 2.0**-26)), r"betas\[1\]")),
    "betas_triple": pytest.param(Bad(_set(_group(2), betas=(0.9, 0.99, 0.999)), "betas")),
    "adam_w_mode_int": pytest.param(Bad(_set(_group(2), adam_w_mode=1), "adam_w_mode")),
    "bias_correction_none": pytest.param(Bad(_set(_group(2), bias_correction=None), "bias_correction")),
    "maximize": pytest.param(Bad(_set(_group(2), maximize=True), "maximize")),
    "momentum_one": pytest.param(Bad(_set(_group(1), momentum=1.0), "momentum")),
    "nesterov_string": pytest.param(Bad(_set(_group(1), nesterov="yes"), "nesterov")),
    "muon_beta2_negative": pytest.param(Bad(_set(_group(1), beta2=-0.1), "beta2")),
    "ns_steps_float": pytest.param(Bad(_set(_group(1), ns_steps=2.0), "ns_steps")),
    "ns_steps_negative": pytest.param(Bad(_set(_group(1), ns_steps=-1), "ns_steps")),
    "coefficients_nan": pytest.param(Bad(_set(_group(1), ns_coefficients=[(math.nan, 1.0, 1.0)] * 5),
                                         "ns_coefficients")),
    "matrix_view_unknown": pytest.param(Bad(_set(_group(1), matrix_view="stack"), "matrix_view")),
}


@pytest.mark.parametrize("case", list(REFUSED.values()), ids=list(REFUSED))
def test_a_refused_checkpoint_changes_nothing_and_the_optimizer_carries_on(case):
    clean = _source(case.mode)
    bad = copy.deepcopy(clean)
    case.corrupt(bad)
    model, opt = _target(case.mode)
    twin_model, twin = _target(case.mode)
    snap, settings = snapshot(opt), copy.deepcopy(_settings(opt))

    with pytest.raises((TypeError, ValueError)) as raised:
        opt.load_state_dict(bad)
    message = str(raised.value)
    assert re.search(_WHERE, message) and re.search(case.what, message), f"unclear message: {message!r}"
    assert_unchanged(opt, snap)
    assert _settings(opt) == settings

    # Steps as if nothing happened, then loads a good checkpoint as if nothing happened.
    _train(model, opt, range(1, 2))
    _train(twin_model, twin, range(1, 2))
    _assert_same_optimizer(opt, twin)
    opt.load_state_dict(copy.deepcopy(clean))
    twin.load_state_dict(clean)
    _train(model, opt, range(2, 3))
    _train(twin_model, twin, range(2, 3))
    _assert_same_optimizer(opt, twin)
    assert _all_finite(opt)


def test_a_state_dict_that_is_not_a_dict_is_refused():
    model, opt = _target("bf16_remainder")
    snap = snapshot(opt)
    with pytest.raises((TypeError, ValueError), match=_WHERE):
        opt.load_state_dict([_source("bf16_remainder")])  # e.g. torch.load of another file
    assert_unchanged(opt, snap)


def _same(sd):
    return sd


class Harmless(NamedTuple):
    corrupt: Callable[[dict], object]
    equivalent: Callable[[dict], object] = _same  # the clean dict made what the corrupt one means
    extra_group_key: Optional[str] = None  # kept in the loaded group, absent from the twin's


def _zero(where, key):
    return _set_from(where, key, torch.zeros_like)


HARMLESS = {
    "extra_top_level_key": pytest.param(Harmless(lambda sd: sd.update(saved_by="trainer v2"))),
    "extra_group_key": pytest.param(Harmless(_set(_group(0), schedule_note=[1, 2]), extra_group_key="schedule_note")),
    "group_without_kind": pytest.param(Harmless(lambda sd: sd["param_groups"][1].pop("kind"))),
    "entry_for_an_unknown_index": pytest.param(Harmless(lambda sd: sd["state"].__setitem__(
        999, {"exp_avg": torch.zeros(3)}))),
    "step_python_int": pytest.param(Harmless(_set_from(_adamw_last, "step", lambda v: int(v)))),
    "step_int64_tensor": pytest.param(Harmless(_set_from(_adamw_last, "step", lambda v: v.long()))),
    "step_in_a_muon_entry": pytest.param(Harmless(_set(_muon, step=torch.tensor(7.0)))),
    "exp_avg_float64": pytest.param(Harmless(_set_from(_adamw_2d, "exp_avg", lambda v: v.double()))),
    "exp_avg_sq_non_contiguous": pytest.param(Harmless(_set_from(_adamw_2d, "exp_avg_sq",
                                                                 lambda v: v.t().contiguous().t()))),
    # torch's own Optimizer.load_state_dict casts moments to the param dtype.
    "moments_in_bfloat16": pytest.param(Harmless(
        _set_from(_experts, "momentum_buffer", lambda v: v.bfloat16()),
        _set_from(_experts, "momentum_buffer", lambda v: v.bfloat16().float()))),
    "momentum_missing": pytest.param(Harmless(lambda sd: _muon(sd).pop("momentum_buffer"),
                                              _zero(_muon, "momentum_buffer"))),
    "exp_avg_sq_missing": pytest.param(Harmless(lambda sd: _adamw_last(sd).pop("exp_avg_sq"),
                                                _zero(_adamw_last, "exp_avg_sq"))),
    "unknown_entry_that_is_not_a_tensor": pytest.param(
        Harmless(_set(_adamw_last, note="from trainer v2"), lambda sd: _adamw_last(sd).update(note="from trainer v2"))),
}


@pytest.mark.parametrize("case", list(HARMLESS.values()), ids=list(HARMLESS))
def test_a_harmless_oddity_loads_like_its_clean_equivalent(case):
    clean = _source("bf16_remainder")
    odd, equivalent = copy.deepcopy(clean), copy.deepcopy(clean)
    case.corrupt(odd)
    case.equivalent(equivalent)
    model, opt = _target("bf16_remainder")
    twin_model, twin = _target("bf16_remainder")
    opt.load_state_dict(odd)
    twin.load_state_dict(equivalent)
    ignore = () if case.extra_group_key is None else (case.extra_group_key,)
    _assert_same_optimizer(opt, twin, ignore)
    if case.extra_group_key is not None:
        assert case.extra_group_key in opt.param_groups[0]
    _train(model, opt, range(1, 2))
    _train(twin_model, twin, range(1, 2))
    _assert_same_optimizer(opt, twin, ignore)
    assert _all_finite(opt)


def test_a_step_count_beyond_int64_is_refused_or_steps_finite():
    clean = _source("bf16_remainder")
    bad = copy.deepcopy(clean)
    _adamw_last(bad)["step"] = torch.tensor(1e30)
    model, opt = _target("bf16_remainder")
    snap = snapshot(opt)
    try:
        opt.load_state_dict(bad)
    except (TypeError, ValueError):
        assert_unchanged(opt, snap)
        return
    _train(model, opt, range(1, 2))
    assert _all_finite(opt), "a loaded step count turned params or state into NaN"
