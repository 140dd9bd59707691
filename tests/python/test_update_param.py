"""MuonAdamW.update_param and get_full_parameter_master in every master mode,
and update_param's validation (nothing changes when it refuses)."""

import pytest
import torch

from support.helpers import assert_bit_equal
from support.optimizer_snapshot import assert_unchanged, snapshot
from muon_ext import MuonAdamW, ops

# name: (param dtype, optimizer kwargs)
MODES = {
    "bf16_remainder": (torch.bfloat16, dict()),
    "bf16_fp32_master": (torch.bfloat16, dict(store_param_remainders=False)),
    "fp32": (torch.float32, dict()),
    "bf16_direct": (torch.bfloat16, dict(master_weights=False)),
}
SHAPES = [(12, 20), (12, 20), (30,), (6, 5)]  # two Muon, two AdamW


def _trained(mode, steps=2, seed=0):
    """An optimizer over SHAPES (Muon + AdamW groups) after `steps` steps, so moments are nonzero."""
    dtype, kwargs = MODES[mode]
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter((torch.randn(s, generator=gen) * 0.1).to(dtype)) for s in SHAPES]
    opt = MuonAdamW([{"params": params[:2], "kind": "muon", "lr": 0.02},
                     {"params": params[2:], "kind": "adamw", "lr": 0.01}], **kwargs)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(dtype)
        opt.step()
    return params, opt








def _new_values(shape, seed=7):
    """FP32 values with low mantissa bits set (not BF16-representable), given
    as a non-contiguous view (a transpose of a transposed buffer)."""
    gen = torch.Generator().manual_seed(seed)
    if len(shape) == 2:
        values = torch.randn(shape[::-1], generator=gen).t()
    else:
        values = torch.randn(shape[0] * 2, generator=gen)[::2]
    assert not values.is_contiguous()
    return values


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("index", [0, 2], ids=["muon", "adamw"])
def test_update_param_writes_param_and_master_and_keeps_history(mode, index):
    """The param and its master take the new values as the mode stores them;
    moments, step counts and every other param are kept bit for bit; the next
    step continues from the new values."""
    params, opt = _trained(mode)
    p = params[index]
    values = _new_values(p.shape)
    expected_values = values.clone()
    snap = snapshot(opt)
    opt.update_param(p, values)
    state = opt.state[p]
    if mode == "bf16_remainder":
        param_bits, remainder = ops.split_master(values.contiguous())
        assert_bit_equal(p.detach(), param_bits, "param")
        assert_bit_equal(state["master_param"], remainder, "remainder")
    elif mode == "bf16_fp32_master":
        assert_bit_equal(state["master_param"], values.contiguous(), "master")
        assert_bit_equal(p.detach(), values.bfloat16(), "param")
    elif mode == "fp32":
        assert_bit_equal(p.detach(), values.contiguous(), "param")
    else:
        assert_bit_equal(p.detach(), values.bfloat16(), "param")
    master = values.contiguous() if mode != "bf16_direct" else values.bfloat16().float()
    assert_bit_equal(opt.get_full_parameter_master(p), master, "full master")
    assert_bit_equal(values, expected_values, "values were modified")
    group, pos = (0, index) if index < 2 else (1, index - 2)
    assert_unchanged(opt, snap, skip={f"group {group} param {pos}", f"group {group} param {pos} master_param"})
    assert float(opt.state[params[2]]["step"]) == 2.0

    # The next step starts from the new master.
    for q in params:
        q.grad = None
    p.grad = torch.zeros_like(p)
    opt.step()
    moved = opt.get_full_parameter_master(p)
    assert (moved - master).abs().max().item() < 0.1
    assert not torch.equal(moved, master) or mode == "bf16_direct"


@pytest.mark.parametrize("mode", list(MODES))
def test_get_full_parameter_master_returns_a_new_fp32_tensor(mode):
    """The returned tensor is FP32, equals the master, and owns its storage:
    writing into it changes neither the param nor any state."""
    params, opt = _trained(mode)
    for p in params:
        master = opt.get_full_parameter_master(p)
        assert master.dtype == torch.float32 and master.shape == p.shape
        if mode == "bf16_fp32_master":
            assert_bit_equal(master, opt.state[p]["master_param"], "master")
        elif mode == "bf16_remainder":
            assert_bit_equal(ops.split_master(master)[0], p.detach(), "param from master")
            assert_bit_equal(ops.split_master(master)[1], opt.state[p]["master_param"], "remainder from master")
        else:
            assert_bit_equal(master, p.detach().float(), "master")
        storages = {t.untyped_storage().data_ptr() for t in [p] + list(opt.state[p].values())}
        assert master.untyped_storage().data_ptr() not in storages
        snap = snapshot(opt)
        master.add_(1.0)
        assert_unchanged(opt, snap)


def _foreign_param(shape):
    """A param of the same shape owned by another MuonAdamW (kept alive with it)."""
    q = torch.nn.Parameter(torch.randn(shape).bfloat16())
    q.owner = MuonAdamW([{"params": [q], "kind": "muon"}])
    return q


# case: (param selector, values maker, error type, message fragment)
_BAD_CALLS = {
    "param_data": (lambda p: p.data, lambda p: torch.zeros(p.shape), ValueError, "not a parameter of this optimizer"),
    "param_view": (lambda p: p[:], lambda p: torch.zeros(p.shape), ValueError, "not a parameter of this optimizer"),
    "param_reshaped_view": (lambda p: p.view(p.shape), lambda p: torch.zeros(p.shape), ValueError,
                            "not a parameter of this optimizer"),
    "other_optimizers_param": (lambda p: _foreign_param(p.shape), lambda p: torch.zeros(p.shape), ValueError,
                               "not a parameter of this optimizer"),
    "plain_tensor": (lambda p: torch.zeros(p.shape), lambda p: torch.zeros(p.shape), ValueError,
                     "not a parameter of this optimizer"),
    "values_float64": (lambda p: p, lambda p: torch.zeros(p.shape, dtype=torch.float64), TypeError, "float32"),
    "values_bfloat16": (lambda p: p, lambda p: torch.zeros(p.shape, dtype=torch.bfloat16), TypeError, "float32"),
    "values_wrong_shape": (lambda p: p, lambda p: torch.zeros(12, 21), ValueError, "shape"),
    "values_flattened": (lambda p: p, lambda p: torch.zeros(240), ValueError, "shape"),
    "values_transposed": (lambda p: p, lambda p: torch.zeros(20, 12), ValueError, "shape"),
    "values_not_a_tensor": (lambda p: p, lambda p: torch.zeros(p.shape).tolist(), TypeError, "tensor"),
    "values_sparse": (lambda p: p, lambda p: torch.zeros(p.shape).to_sparse(), TypeError, "dense tensor"),
    "values_meta": (lambda p: p, lambda p: torch.zeros(p.shape, device="meta"), TypeError, "dense tensor"),
}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("case", list(_BAD_CALLS))
def test_update_param_refuses_bad_calls_without_changing_anything(mode, case):
    """Every refused call leaves every tensor of the optimizer (all params, all
    state) bit-identical."""
    select, make_values, exc_type, fragment = _BAD_CALLS[case]
    params, opt = _trained(mode)
    p = params[0]
    target, values = select(p), make_values(p)
    snap = snapshot(opt)
    with pytest.raises(exc_type, match=fragment):
        opt.update_param(target, values)
    assert_unchanged(opt, snap)


@pytest.mark.parametrize("case", ["param_data", "param_view", "other_optimizers_param", "plain_tensor"])
def test_get_full_parameter_master_refuses_foreign_params(case):
    select = _BAD_CALLS[case][0]
    params, opt = _trained("bf16_remainder")
    with pytest.raises(ValueError, match="not a parameter of this optimizer"):
        opt.get_full_parameter_master(select(params[0]))


@pytest.mark.parametrize("mode", list(MODES))
def test_update_local_masters_checks_every_param_before_writing_any(mode):
    """update_local_masters: several params' (local) masters written like update_param, every one checked first:
    a bad value for the second param leaves the first unchanged; get_local_master reads it back."""
    params, opt = _trained(mode)
    values = [_new_values(params[0].shape), _new_values(params[2].shape)]
    before = snapshot(opt)
    for bad, match in ((values[1][:-1], "shape"), (values[1] * float("nan"), "NaN or inf"), (values[1].double(), "float32")):
        with pytest.raises((TypeError, ValueError), match=match):
            opt.update_local_masters([params[0], params[2]], [values[0], bad])
        assert snapshot(opt) == before
    with pytest.raises(ValueError, match="1 values for 2 params"):
        opt.update_local_masters([params[0], params[2]], values[:1])
    opt.update_local_masters([params[0], params[2]], values)
    for p, v in zip((params[0], params[2]), values):
        master = opt.get_local_master(p)
        assert_bit_equal(master, opt.get_full_parameter_master(p), "local master")
        assert_bit_equal(master, v.contiguous() if mode != "bf16_direct" else v.bfloat16().float(), "written")
