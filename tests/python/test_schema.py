"""One table of ranges and modes (csrc/common/schema.h): the Python checks
(muon_ext.schema) and the ops' C++ checks accept exactly the same values."""

import math

import pytest
import torch

from support.helpers import make_grads, make_set
from muon_ext import ops, schema
from support.muon_helpers import make_muon_grads, make_muon_set


def _adamw(**setting):
    s = make_set([4], "fp32")
    kwargs = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
    kwargs.update(setting)
    ops.adamw_step(*s.args(make_grads([4])), **kwargs)


def _muon(**setting):
    s = make_muon_set([(3, 4)], "fp32")
    kwargs = dict(lr=1e-3, ns_steps=1, ns_coefficients=ops.POLAR_EXPRESS_COEFFICIENTS * 40)
    kwargs.update(setting)
    ops.muon_step(*s.args(make_muon_grads([(3, 4)])), **s.kwargs(), **kwargs)


# (kind, name) -> a call that passes `value` to an op as that setting.
PROBES = {
    ("adamw", "lr"): lambda v: _adamw(lr=v),
    ("adamw", "beta1"): lambda v: _adamw(beta1=v),
    ("adamw", "beta2"): lambda v: _adamw(beta2=v),
    ("adamw", "eps"): lambda v: _adamw(eps=v),
    ("adamw", "weight_decay"): lambda v: _adamw(weight_decay=v),
    ("muon", "lr"): lambda v: _muon(lr=v),
    ("muon", "momentum"): lambda v: _muon(momentum=v),
    ("muon", "beta2"): lambda v: _muon(beta2=v),
    ("muon", "weight_decay"): lambda v: _muon(weight_decay=v),
    ("muon", "ns_steps"): lambda v: _muon(ns_steps=v),
    ("muon", "polar_row_blocks"): lambda v: _muon(polar_row_blocks=v),
    ("optimizer", "max_workspace_bytes"): lambda v: _muon(max_workspace_bytes=v),
}


def _candidates(r):
    """Values on and around the range's bounds."""
    if r.integer:
        low = int(r.low)
        values = [low - 1, low, low + 1, 7, 100]
        if not math.isinf(r.high):
            values += [int(r.high) - 1, int(r.high), int(r.high) + 1]
        return values
    values = [r.low - 1e-3, math.nextafter(r.low, -math.inf), r.low, math.nextafter(r.low, math.inf), 0.5, 3.0,
              math.nan, math.inf, -math.inf]
    if not math.isinf(r.high):
        values += [math.nextafter(r.high, -math.inf), r.high, math.nextafter(r.high, math.inf), r.high + 1]
    return values


def _accepted(call, value) -> bool:
    try:
        call(value)
    except ValueError:
        return False
    return True


def test_every_range_of_the_table_has_a_probe():
    assert set(schema.RANGES) == set(PROBES)


@pytest.mark.parametrize("key", sorted(PROBES))
def test_python_and_cpp_accept_the_same_values(key):
    r = schema.RANGES[key]
    for value in _candidates(r):
        python_ok = r.admits(value)
        cpp_ok = _accepted(PROBES[key], value)
        assert python_ok == cpp_ok, f"{key}={value!r}: Python {'accepts' if python_ok else 'refuses'}, " \
                                    f"C++ {'accepts' if cpp_ok else 'refuses'}"


def test_lr_scale_modes_are_the_tables():
    for value in schema.MODES["lr_scale"] + ("spectral", "Original", ""):
        python_ok = value in schema.MODES["lr_scale"]
        assert _accepted(lambda v: _muon(lr_scale=v), value) == python_ok, value


def test_values_that_round_out_of_range_in_float32_are_refused():
    """The kernels compute in FP32: a beta1 just below 1 would round to 1.0f
    (bias correction 1 / (1 - 1) = inf, NaN params) and an lr of 1e300 to inf.
    Both sides check the value and its FP32 rounding."""
    below_one = math.nextafter(1.0, 0.0)
    assert torch.tensor(below_one, dtype=torch.float32).item() == 1.0
    for key, value in [(("adamw", "beta1"), below_one), (("muon", "momentum"), below_one), (("adamw", "lr"), 1e300)]:
        assert not schema.RANGES[key].admits(value), key
        assert not _accepted(PROBES[key], value), key
