"""The step's checks in C++ (csrc/step_checks.h) and the rules they share:
the shape rules of csrc/common/shapes.h as muon_ext._shapes sees them, the
typed problems of _C.check_bucket, and the checked-bucket token that spares
the step ops the checks the planner made (docs/design.md, "Data flow of one
step" and "Ops (torch.library)")."""

import itertools
import math

import pytest
import torch

from muon_ext import MuonAdamW, _C, ops
from muon_ext._shapes import matrix_shape, second_moment_shape, stats_per_row

P = torch.nn.Parameter


def _spec_matrix_shape(shape, view):
    """The rule as docs/design.md states it, written here independently of C++."""
    if len(shape) == 2:
        return tuple(shape)
    if len(shape) < 2:
        return "rank"
    if view == "flatten":
        return (shape[0], math.prod(shape[1:]))
    if view == "batch":
        return tuple(shape[-2:])
    return "view"


SHAPES = [s for rank in range(0, 5) for s in itertools.product((1, 2, 3, 5), repeat=rank)] + [(3, 0, 7), (0, 4)]


@pytest.mark.parametrize("view", ["error", "flatten", "batch"])
def test_shape_rules_follow_the_stated_rule_on_many_shapes(view):
    for shape in SHAPES:
        p = torch.empty(shape)
        want = _spec_matrix_shape(shape, view)
        if isinstance(want, str):
            with pytest.raises(ValueError, match="Muon needs matrices" if want == "rank" else "matrix_view"):
                matrix_shape(p, view, "p")
            with pytest.raises(ValueError):
                second_moment_shape(p, view)
            continue
        assert matrix_shape(p, view, "p") == want
        rows, cols = want
        lead = tuple(shape[:-2]) if (len(shape) > 2 and view == "batch") else ()
        assert second_moment_shape(p, view) == lead + ((rows, 1) if rows >= cols else (1, cols))
        assert stats_per_row(rows, cols) == (rows >= cols)


def _optimizer(master_weights="auto"):
    g = torch.Generator().manual_seed(0)
    muon = [P(torch.randn(8, 4, generator=g).bfloat16()) for _ in range(3)]
    adamw = [P(torch.randn(5, generator=g).bfloat16()) for _ in range(3)]
    for p in muon + adamw:
        p.grad = torch.randn(p.shape, generator=g).bfloat16()
    opt = MuonAdamW([{"params": muon, "kind": "muon", "lr": 1e-2}, {"params": adamw, "kind": "adamw", "lr": 1e-2}],
                    master_weights=master_weights)
    opt.step()  # state created
    return opt, muon, adamw


def _plan(opt):
    return opt._planner.plan(opt.param_groups, opt._states.infos, opt._states.tensors, opt.grad_attr, False)


def _adamw_call(opt, planned, **kwargs):
    item, state = planned.item, planned.state
    ops.adamw_step(item.params, item.grads, state["exp_avg"], state["exp_avg_sq"], state["step"],
                   masters=state.get("master_param") or (), lr=1e-2, **kwargs)


def test_a_step_consumes_every_token_of_its_plan():
    """Resident steps hand each op the planner's token, and the op takes it (single use)."""
    opt, _, _ = _optimizer()
    opt.step()
    tokens = opt._planner._tokens
    assert len(tokens) == 2 and not any(t.valid for t in tokens)


def test_tokens_of_an_earlier_plan_are_stale():
    opt, _, _ = _optimizer()
    first = _plan(opt)
    assert all(p.checked.valid for p in first)
    _plan(opt)
    assert not any(p.checked.valid for p in first)


def test_a_token_covers_only_the_lists_it_was_made_for():
    opt, _, adamw = _optimizer()
    planned = {p.item.bucket.kind: p for p in _plan(opt)}
    muon_token = planned["muon"].checked
    _adamw_call(opt, planned["adamw"], checked=muon_token)  # foreign: the op checks everything
    assert muon_token.valid  # and does not take it
    adamw_token = planned["adamw"].checked
    _adamw_call(opt, planned["adamw"], checked=adamw_token)
    assert not adamw_token.valid


def test_a_foreign_or_used_token_does_not_spare_a_refusal():
    opt, _, adamw = _optimizer()
    planned = {p.item.bucket.kind: p for p in _plan(opt)}
    item, state = planned["adamw"].item, planned["adamw"].state
    shared = list(state["exp_avg"])
    shared[1] = shared[0]  # two params sharing a moment: refused by every op
    for token in (planned["muon"].checked, None):
        with pytest.raises(ValueError, match=r"exp_avgs\[1\] shares its storage with exp_avgs\[0\]"):
            ops.adamw_step(item.params, item.grads, shared, state["exp_avg_sq"], state["step"],
                           masters=state["master_param"], lr=1e-2, checked=token)
    token = planned["adamw"].checked
    _adamw_call(opt, planned["adamw"], checked=token)  # used once
    with pytest.raises(ValueError, match=r"exp_avgs\[1\] shares its storage"):
        ops.adamw_step(item.params, item.grads, shared, state["exp_avg_sq"], state["step"],
                       masters=state["master_param"], lr=1e-2, checked=token)


def test_a_token_is_stale_once_its_tensors_change():
    """A storage released after planning is found by the op, token or not."""
    opt, _, adamw = _optimizer()
    planned = {p.item.bucket.kind: p for p in _plan(opt)}
    state = planned["adamw"].state
    state["exp_avg_sq"][2].untyped_storage().resize_(0)
    with pytest.raises(ValueError, match=r"adamw_step: exp_avg_sqs\[2\]: its storage holds 0 bytes"):
        _adamw_call(opt, planned["adamw"], checked=planned["adamw"].checked)
    assert planned["adamw"].checked.valid


def test_check_bucket_reports_typed_problems():
    opt, muon, _ = _optimizer()
    tensors = opt._states.tensors
    rules = (("momentum_buffer", torch.float32, 0, True),)
    ok = _C.check_bucket(muon, "grad", tensors, dtype=torch.bfloat16, device=torch.device("cpu"), rules=rules,
                         rows=8, cols=4, matrix_view="error", ranges=_C.MemoryRanges(), bucket=0)
    assert ok.index == -1 and ok.problem == _C.StepProblem.none and ok.uniform and ok.token.valid
    for p in muon:
        p.main_grad = torch.zeros(p.shape)
    muon[1].main_grad = torch.zeros(3)
    bad = _C.check_bucket(muon, "main_grad", tensors, dtype=torch.bfloat16, device=torch.device("cpu"), rules=rules,
                          rows=8, cols=4, matrix_view="error", ranges=None, bucket=0)
    assert (bad.problem, bad.index, bad.token) == (_C.StepProblem.grad_shape, 1, None)
    tensors[muon[2]]["momentum_buffer"] = torch.zeros(8, 4, dtype=torch.float64)
    muon[1].main_grad = None
    bad = _C.check_bucket(muon, "main_grad", tensors, dtype=torch.bfloat16, device=torch.device("cpu"), rules=rules,
                          rows=8, cols=4, matrix_view="error", ranges=None, bucket=0)
    assert (bad.problem, bad.index, bad.key) == (_C.StepProblem.state_dtype, 2, "momentum_buffer")
