"""MuonAdamW (CPU): group schema, construction checks, step behaviour, master
modes and GradScaler. Equivalence with the reference and the seed: test_optimizer_equivalence.py."""

import copy
import pickle

import pytest
import torch

from support.helpers import assert_bit_equal, bits, optimizer_tensors
from support.optimizer_snapshot import assert_unchanged, snapshot, tensor_bits
from muon_ext import MuonAdamW, ops, reference
from support.optimizer_helpers import MuonTwin, adamw_hyper, as_params, bf16_values, grad_seq, muon_hyper, set_grads
from support.muon_helpers import stat_shape
import muon_ext

POLAR_EXPRESS = reference.POLAR_EXPRESS_COEFFICIENTS


# ---------------------------------------------------------------------------
# group schema
# ---------------------------------------------------------------------------


def test_group_defaults_and_extra_keys():
    """Missing keys get the schema's defaults; given values and unknown keys (lr_mult) stay untouched."""
    marker = object()
    w, b = torch.nn.Parameter(torch.randn(4, 6)), torch.nn.Parameter(torch.randn(6))
    opt = MuonAdamW([{"params": [w], "kind": "muon", "lr_mult": 2.0, "tag": marker},
                     {"params": [b], "kind": "adamw", "lr_mult": 0.5, "weight_decay": 0.0}])
    muon, adamw = opt.param_groups
    assert {k: v for k, v in muon.items() if k != "params"} == {
        "kind": "muon", "lr": 1e-3, "weight_decay": 0.1, "momentum": 0.95, "nesterov": True, "beta2": 0.95,
        "ns_steps": 5, "ns_coefficients": POLAR_EXPRESS, "lr_scale": "original", "matrix_view": "error",
        "polar_dtype": "bfloat16", "polar_method": "standard", "lr_mult": 2.0, "tag": marker}
    assert muon["tag"] is marker
    assert {k: v for k, v in adamw.items() if k != "params"} == {
        "kind": "adamw", "lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0,
        "adam_w_mode": True, "bias_correction": True, "lr_mult": 0.5}
    assert muon["params"] == [w] and adamw["params"] == [b]
    # The default weight decay of AdamW groups, and state created at construction.
    assert MuonAdamW([{"params": [torch.nn.Parameter(torch.zeros(3))], "kind": "adamw"}]).param_groups[0][
        "weight_decay"] == 0.01
    assert set(opt.state[w]) == {"momentum_buffer", "second_momentum_buffer"}
    assert set(opt.state[b]) == {"step", "exp_avg", "exp_avg_sq"}


# ---------------------------------------------------------------------------
# construction errors
# ---------------------------------------------------------------------------

_GOOD = torch.nn.Parameter(torch.randn(6, 4))


class _Subclass(torch.Tensor):
    """A tensor subclass without the quantized protocol (dequantize() and quantize_(src)): refused."""


def _bad_groups():
    """(second group, error type, message fragments): the first group is [_GOOD] as Muon."""
    P = torch.nn.Parameter
    return {
        "unknown_kind": ({"params": [P(torch.randn(3))], "kind": "sgd"}, ValueError, ["param group 1", "'sgd'"]),
        "missing_kind": ({"params": [P(torch.randn(3))]}, ValueError, ["param group 1", "kind"]),
        "param_in_two_groups": ({"params": [P(torch.randn(3)), _GOOD], "kind": "adamw"}, ValueError,
                                ["param group 1 (adamw), param 1", "more than one"]),
        "muon_rank1": ({"params": [P(torch.randn(4, 4)), P(torch.randn(5))], "kind": "muon",
                        "param_names": ["w", "bias"]}, ValueError, ["param group 1 (muon), param 1 'bias'", "(5,)"]),
        "muon_rank3_error_view": ({"params": [P(torch.randn(8, 4, 3))], "kind": "muon", "param_names": ["conv"]},
                                  ValueError, ["param group 1 (muon), param 0 'conv'", "matrix_view"]),
        "non_floating": ({"params": [torch.zeros(4, dtype=torch.int32)], "kind": "adamw"}, TypeError,
                         ["param group 1 (adamw), param 0", "int32"]),
        "float64": ({"params": [P(torch.zeros(4, dtype=torch.float64))], "kind": "adamw"}, TypeError,
                    ["param group 1 (adamw), param 0", "float64"]),
        "no_params_key": ({"kind": "adamw", "lr": 0.1}, ValueError, ["param group 1", "no 'params'"]),
        "param_names_length": ({"params": [P(torch.randn(3)), P(torch.randn(4))], "kind": "adamw",
                                "param_names": ["a"]}, ValueError, ["param group 1", "param_names"]),
        "fp8": ({"params": [P(torch.zeros(4, 4).to(torch.float8_e4m3fn), requires_grad=False)], "kind": "muon",
                 "param_names": ["w8"]}, TypeError, ["param group 1 (muon), param 0 'w8'", "float8_e4m3fn"]),
        "params_set": ({"params": {P(torch.randn(3))}, "kind": "adamw"}, TypeError, ["param group 1", "set"]),
        "non_leaf": ({"params": [P(torch.randn(3)) * 2], "kind": "adamw"}, ValueError,
                     ["param group 1 (adamw), param 0", "non-leaf"]),
        "non_contiguous": ({"params": [P(torch.randn(5, 4).t())], "kind": "muon"}, ValueError,
                           ["param group 1 (muon), param 0", "contiguous"]),
        "matrix_view_unknown": ({"params": [P(torch.randn(3, 3))], "kind": "muon", "matrix_view": "rows"}, ValueError,
                                ["param group 1 (muon)", "matrix_view must be"]),
        "lr_scale_unknown": ({"params": [P(torch.randn(3, 3))], "kind": "muon", "lr_scale": "spectral"}, ValueError,
                             ["param group 1 (muon)", "unknown lr_scale"]),
        "tensor_subclass": ({"params": [P(_Subclass(torch.randn(3)))], "kind": "adamw"}, TypeError,
                            ["param group 1 (adamw), param 0", "tensor subclasses"]),
        "betas_scalar": ({"params": [P(torch.randn(3))], "kind": "adamw", "betas": 0.9}, TypeError,
                         ["param group 1 (adamw)", "betas must be a pair"]),
        "eps_negative": ({"params": [P(torch.randn(3))], "kind": "adamw", "eps": -1.0}, ValueError,
                         ["param group 1 (adamw)", "eps must be in"]),
        "amsgrad": ({"params": [P(torch.randn(3))], "kind": "adamw", "amsgrad": True}, ValueError,
                    ["param group 1 (adamw)", "amsgrad=True is not supported"]),
        "lr_string": ({"params": [P(torch.randn(3))], "kind": "adamw", "lr": "0.1"}, TypeError,
                      ["param group 1 (adamw)", "lr must be a number"]),
        "momentum_above_one": ({"params": [P(torch.randn(3, 3))], "kind": "muon", "momentum": 1.5}, ValueError,
                               ["param group 1 (muon)", "momentum must be in [0.0, 1.0)"]),
        "nesterov_string": ({"params": [P(torch.randn(3, 3))], "kind": "muon", "nesterov": "no"}, TypeError,
                            ["param group 1 (muon)", "nesterov must be True or False"]),
        "ns_steps_float": ({"params": [P(torch.randn(3, 3))], "kind": "muon", "ns_steps": 2.5}, ValueError,
                           ["param group 1 (muon)", "ns_steps must be an int"]),
        "coefficient_pairs": ({"params": [P(torch.randn(3, 3))], "kind": "muon", "ns_steps": 1,
                               "ns_coefficients": [(1.0, 2.0)]}, ValueError,
                              ["param group 1 (muon)", "(a, b, c) triples"]),
        "lr_tensor_float64": ({"params": [P(torch.randn(3))], "kind": "adamw", "lr": torch.tensor(0.1, dtype=torch.float64)},
                              TypeError, ["param group 1 (adamw)", "one float32 element"]),
    }


def _check_message(exc, fragments):
    for fragment in fragments:
        assert fragment in str(exc.value), f"{fragment!r} not in {str(exc.value)!r}"


_NON_LEAF_GRAD_WARNING = "ignore:The .grad attribute of a Tensor that is not a leaf"


@pytest.mark.filterwarnings(_NON_LEAF_GRAD_WARNING)
@pytest.mark.parametrize("case", list(_bad_groups()))
def test_construction_errors_name_group_and_param(case):
    """Each bad group raises at construction, naming group and param, and writes
    nothing into the params (values, requires_grad, grads)."""
    group, exc_type, fragments = _bad_groups()[case]
    params = [_GOOD] + list(group.get("params", []))
    before = [(bits(p).clone(), p.requires_grad, p.grad) for p in params]
    with pytest.raises(exc_type) as exc:
        MuonAdamW([{"params": [_GOOD], "kind": "muon"}, group])
    _check_message(exc, fragments)
    for p, (b, rg, g) in zip(params, before):
        assert torch.equal(bits(p), b) and p.requires_grad == rg and p.grad is g


@pytest.mark.filterwarnings(_NON_LEAF_GRAD_WARNING)
@pytest.mark.parametrize("case", list(_bad_groups()))
def test_add_param_group_validates_the_same_way(case):
    """add_param_group refuses the same groups with the same messages; the
    optimizer's groups, state and tensors are left exactly as they were, and it
    still steps afterwards."""
    group, exc_type, fragments = _bad_groups()[case]
    w = torch.nn.Parameter(_GOOD.detach().clone())
    opt = MuonAdamW([{"params": [w], "kind": "muon", "lr": 0.02}])
    w.grad = torch.ones_like(w)
    opt.step()
    if case == "param_in_two_groups":
        group = dict(group, params=[group["params"][0], w])
    groups_before = [dict(g) for g in opt.param_groups]
    snap = snapshot(opt)
    with pytest.raises(exc_type) as exc:
        opt.add_param_group(group)
    _check_message(exc, fragments)
    assert opt.param_groups == groups_before
    assert set(opt.state) == {w}
    assert_unchanged(opt, snap)
    opt.step()
    assert tensor_bits(w) != snap["params"][id(w)][0]


def test_add_param_group_creates_state_and_steps_new_params():
    """A valid added group gets its defaults and state at once and is updated by the next step."""
    w, b = torch.nn.Parameter(torch.randn(6, 4)), torch.nn.Parameter(torch.randn(5))
    opt = MuonAdamW([{"params": [w], "kind": "muon"}])
    w.grad = torch.ones_like(w)
    opt.step()
    opt.add_param_group({"params": b, "kind": "adamw", "lr": 0.1})
    assert opt.param_groups[1]["betas"] == (0.9, 0.999)
    assert set(opt.state[b]) == {"step", "exp_avg", "exp_avg_sq"}
    b0 = b.detach().clone()
    b.grad = torch.ones_like(b)
    opt.step()
    assert float(opt.state[b]["step"]) == 1.0
    torch.testing.assert_close(b.detach(), b0 - 0.1 * (1.0 + 0.01 * b0), rtol=1e-5, atol=1e-6)


@pytest.fixture
def gloo_world(tmp_path):
    """A single-process gloo group (file store), torn down afterwards."""
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is unavailable")
    if dist.is_initialized():
        pytest.skip("a process group is already initialized")
    try:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    except Exception as exc:  # pragma: no cover - depends on the platform
        pytest.skip(f"can't start a gloo process group: {exc}")
    try:
        from torch.distributed.device_mesh import init_device_mesh

        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def test_unsupported_dtensor_placements_are_refused(gloo_world):
    """A Partial DTensor param raises at construction and in add_param_group,
    naming group, param and placements; Shard(1) is accepted, also on a
    stack of matrices (matrix_view "batch"); DTensor values for a plain
    param are refused (tests/python/test_distributed*.py cover the supported
    layouts)."""
    from torch.distributed.tensor import Partial, Shard, distribute_tensor

    d = torch.nn.Parameter(distribute_tensor(torch.randn(3, 8, 4), gloo_world, [Shard(1)]))
    before = bits(d.to_local()).clone()
    MuonAdamW([{"params": [_GOOD], "kind": "muon"}, {"params": [d], "kind": "muon", "matrix_view": "batch"}])
    MuonAdamW([{"params": [distribute_tensor(torch.randn(8, 4), gloo_world, [Shard(1)])], "kind": "muon"}])
    opt = MuonAdamW([{"params": [_GOOD], "kind": "muon"}])
    snap = snapshot(opt)
    partial = torch.distributed.tensor.DTensor.from_local(torch.randn(8, 4), gloo_world, [Partial()])
    with pytest.raises(TypeError) as exc:
        opt.add_param_group({"params": [torch.nn.Parameter(partial)], "kind": "adamw"})
    _check_message(exc, ["param group 1 (adamw), param 0", "DTensor", "Partial"])
    assert len(opt.param_groups) == 1
    assert_unchanged(opt, snap)
    assert torch.equal(bits(d.to_local()), before)
    w = torch.nn.Parameter(torch.randn(8, 4))
    opt = MuonAdamW([{"params": [w], "kind": "muon"}])
    snap = snapshot(opt)
    with pytest.raises(TypeError, match="is a plain tensor, so its values must be a plain tensor too"):
        opt.update_param(w, distribute_tensor(torch.zeros(8, 4), gloo_world, [Shard(0)]))
    assert_unchanged(opt, snap)


# ---------------------------------------------------------------------------
# step behaviour
# ---------------------------------------------------------------------------


def test_matrix_views_step_like_the_equivalent_matrices():
    """matrix_view="flatten" steps a [out, in, k] weight exactly like the
    [out, in*k] matrix, "batch" an [E, out, in] weight exactly like E separate
    matrices (ops.muon_step on those views, BF16 + remainders, bit for bit)."""
    conv_v, experts_v = bf16_values([(8, 4, 3), (3, 10, 6)])
    conv, experts = as_params([conv_v, experts_v], torch.bfloat16)
    opt = MuonAdamW([{"params": [conv], "kind": "muon", "lr": 0.02, "matrix_view": "flatten"},
                     {"params": [experts], "kind": "muon", "lr": 0.03, "matrix_view": "batch"}])
    assert opt.state[conv]["second_momentum_buffer"].shape == (1, 12)
    assert opt.state[experts]["second_momentum_buffer"].shape == (3, 10, 1)
    flat, separate = MuonTwin([conv_v.view(8, 12)]), MuonTwin(list(experts_v.unbind(0)))
    for grads in grad_seq([(8, 4, 3), (3, 10, 6)], 3):
        set_grads([conv, experts], grads)
        opt.step()
        flat.step([grads[0].view(8, 12)], **muon_hyper(opt.param_groups[0]))
        separate.step(list(grads[1].unbind(0)), **muon_hyper(opt.param_groups[1]))
    s = opt.state[conv]
    assert_bit_equal(conv.detach().view(8, 12), flat.params[0], "flatten param")
    assert_bit_equal(s["master_param"].view(8, 12), flat.remainders[0], "flatten remainder")
    assert_bit_equal(s["momentum_buffer"].view(8, 12), flat.moms[0], "flatten momentum")
    assert_bit_equal(s["second_momentum_buffer"], flat.smbs[0], "flatten second moment")
    s = opt.state[experts]
    assert_bit_equal(experts.detach(), torch.stack(separate.params), "batch param")
    assert_bit_equal(s["master_param"], torch.stack(separate.remainders), "batch remainder")
    assert_bit_equal(s["momentum_buffer"], torch.stack(separate.moms), "batch momentum")
    assert_bit_equal(s["second_momentum_buffer"], torch.stack(separate.smbs), "batch second moment")


def test_mixed_shape_muon_group_equals_per_shape_buckets():
    """A Muon group with several shapes (wide, tall, square, interleaved) gives
    exactly what ops.muon_step gives on each shape bucket."""
    shapes = [(16, 24), (24, 16), (16, 24), (8, 8), (24, 16), (16, 24)]
    values = bf16_values(shapes)
    params = as_params(values, torch.bfloat16)
    opt = MuonAdamW([{"params": params, "kind": "muon", "lr": 0.02, "weight_decay": 0.2}])
    buckets = {}
    for i, s in enumerate(shapes):
        buckets.setdefault(s, []).append(i)
    twins = {s: MuonTwin([values[i] for i in idx]) for s, idx in buckets.items()}
    for grads in grad_seq(shapes, 3):
        set_grads(params, grads)
        opt.step()
        for s, idx in buckets.items():
            twins[s].step([grads[i] for i in idx], **muon_hyper(opt.param_groups[0]))
    for s, idx in buckets.items():
        for j, i in enumerate(idx):
            st = opt.state[params[i]]
            assert_bit_equal(params[i].detach(), twins[s].params[j], f"param {i}")
            assert_bit_equal(st["master_param"], twins[s].remainders[j], f"remainder {i}")
            assert_bit_equal(st["momentum_buffer"], twins[s].moms[j], f"momentum {i}")
            assert_bit_equal(st["second_momentum_buffer"], twins[s].smbs[j], f"second moment {i}")


def test_params_without_grad_are_skipped_without_disturbing_others():
    """Params whose grad is None keep param and state bit for bit (step
    counters included); the others step exactly as in an optimizer that holds
    only them."""
    shapes = [(12, 20)] * 3 + [(30,), (7,)]
    values = bf16_values(shapes)
    params = as_params(values, torch.bfloat16)
    opt = MuonAdamW([{"params": params[:3], "kind": "muon", "lr": 0.02},
                     {"params": params[3:], "kind": "adamw", "lr": 0.01}])
    live = [i for i in range(5) if i not in (1, 4)]
    only = as_params([values[i] for i in live], torch.bfloat16)
    opt_only = MuonAdamW([{"params": only[:2], "kind": "muon", "lr": 0.02},
                          {"params": only[2:], "kind": "adamw", "lr": 0.01}])
    skipped = {i: [bits(params[i]).clone()] + [bits(t).clone() for t in opt.state[params[i]].values()] for i in (1, 4)}
    for grads in grad_seq(shapes, 3):
        set_grads(params, [None if i in (1, 4) else g for i, g in enumerate(grads)])
        set_grads(only, [grads[i] for i in live])
        opt.step()
        opt_only.step()
    for i, saved in skipped.items():
        now = [bits(params[i])] + [bits(t) for t in opt.state[params[i]].values()]
        assert all(torch.equal(a, b) for a, b in zip(now, saved)), f"param {i} was disturbed"
    for j, i in enumerate(live):
        assert_bit_equal(params[i].detach(), only[j].detach(), f"param {i}")
        for key, t in opt.state[params[i]].items():
            assert_bit_equal(t, opt_only.state[only[j]][key], f"param {i} {key}")
    assert float(opt.state[params[4]]["step"]) == 0.0 and float(opt.state[params[3]]["step"]) == 3.0


def test_hyperparameter_changes_take_effect_at_the_next_step():
    """lr, momentum, weight_decay (and AdamW's betas) changed between steps are
    used by the very next step: the run equals ops.* driven with the new values."""
    shapes = [(16, 24), (16, 24), (40,)]
    values = bf16_values(shapes)
    params = as_params(values, torch.bfloat16)
    opt = MuonAdamW([{"params": params[:2], "kind": "muon", "lr": 0.02},
                     {"params": params[2:], "kind": "adamw", "lr": 0.01}])
    twin = MuonTwin(values[:2])
    a_p, a_rem = values[2].bfloat16(), torch.zeros(40, dtype=torch.int16)
    a_m, a_v, a_s = torch.zeros(40), torch.zeros(40), torch.zeros(())
    schedule = [{}, dict(lr=0.05, momentum=0.8, weight_decay=0.5), dict(lr=0.001, momentum=0.0, weight_decay=0.0)]
    for change, grads in zip(schedule, grad_seq(shapes, 3)):
        opt.param_groups[0].update(change)
        if change:
            opt.param_groups[1].update(lr=change["lr"] * 0.5, weight_decay=change["weight_decay"],
                                       betas=(change["momentum"], 0.9))
        set_grads(params, grads)
        opt.step()
        twin.step(grads[:2], **muon_hyper(opt.param_groups[0]))
        ops.adamw_step([a_p], [grads[2].bfloat16()], [a_m], [a_v], [a_s], masters=[a_rem],
                       **adamw_hyper(opt.param_groups[1]))
        for i in range(2):
            assert_bit_equal(params[i].detach(), twin.params[i], f"muon param {i}")
            assert_bit_equal(opt.state[params[i]]["momentum_buffer"], twin.moms[i], f"momentum {i}")
        assert_bit_equal(params[2].detach(), a_p, "adamw param")
        assert_bit_equal(opt.state[params[2]]["exp_avg"], a_m, "exp_avg")


def test_step_closure_returns_its_loss():
    """step(closure) evaluates the closure with grad enabled, steps on the grads
    it produced, and returns its loss."""
    w = torch.nn.Parameter(torch.randn(6, 4))
    b = torch.nn.Parameter(torch.randn(4))
    opt = MuonAdamW([{"params": [w], "kind": "muon", "lr": 0.02}, {"params": [b], "kind": "adamw", "lr": 0.01}])
    x = torch.randn(5, 6)
    calls = []

    def closure():
        opt.zero_grad()
        calls.append(torch.is_grad_enabled())
        loss = ((x @ w + b) ** 2).mean()
        loss.backward()
        return loss

    w0, b0 = w.detach().clone(), b.detach().clone()
    expected = ((x @ w0 + b0) ** 2).mean()
    loss = opt.step(closure)
    assert calls == [True]
    assert isinstance(loss, torch.Tensor) and torch.equal(loss.detach(), expected)
    assert not torch.equal(w.detach(), w0) and not torch.equal(b.detach(), b0)
    assert opt.step() is None


def test_main_grad_is_read_and_grad_ignored():
    """grad_attr="main_grad" steps on the FP32 p.main_grad (bit-exact with
    ops.* fed those grads) and never reads p.grad (NaN here) or writes either."""
    shapes = [(12, 20), (12, 20), (25,)]
    values = bf16_values(shapes)
    params = as_params(values, torch.bfloat16)
    opt = MuonAdamW([{"params": params[:2], "kind": "muon", "lr": 0.02},
                     {"params": params[2:], "kind": "adamw", "lr": 0.01}], grad_attr="main_grad")
    gen = torch.Generator().manual_seed(5)
    main_grads = [torch.randn(s, generator=gen) for s in shapes]  # not BF16-representable
    for p, g in zip(params, main_grads):
        p.main_grad = g.clone()
        p.grad = torch.full_like(p, float("nan"))
    opt.step()
    m_p, m_rem = [v.bfloat16() for v in values[:2]], [torch.zeros(s, dtype=torch.int16) for s in shapes[:2]]
    m_mom, m_smb = [torch.zeros(s) for s in shapes[:2]], [torch.zeros(stat_shape(s)) for s in shapes[:2]]
    ops.muon_step(m_p, main_grads[:2], m_mom, m_smb, masters=m_rem, **muon_hyper(opt.param_groups[0]))
    a_p, a_rem = values[2].bfloat16(), torch.zeros(25, dtype=torch.int16)
    ops.adamw_step([a_p], [main_grads[2]], [torch.zeros(25)], [torch.zeros(25)], [torch.zeros(())],
                   masters=[a_rem], **adamw_hyper(opt.param_groups[1]))
    for i in range(2):
        assert_bit_equal(params[i].detach(), m_p[i], f"muon param {i}")
        assert_bit_equal(opt.state[params[i]]["master_param"], m_rem[i], f"muon remainder {i}")
    assert_bit_equal(params[2].detach(), a_p, "adamw param")
    assert_bit_equal(opt.state[params[2]]["master_param"], a_rem, "adamw remainder")
    for p, g in zip(params, main_grads):
        assert torch.isnan(p.grad).all() and torch.equal(p.main_grad, g)


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_copied_optimizer_is_independent_and_complete(how):
    """copy.deepcopy / pickle keep the master configuration and the per-param
    table: the copy steps exactly like the original (on its own params, which
    the original never sees), and its update_param accepts the copied params."""
    shapes = [(12, 20), (12, 20), (30,)]
    params = as_params(bf16_values(shapes), torch.bfloat16)
    opt = MuonAdamW([{"params": params[:2], "kind": "muon", "lr": 0.02},
                     {"params": params[2:], "kind": "adamw", "lr": 0.01}], store_param_remainders=False)
    grads = grad_seq(shapes, 2)
    set_grads(params, grads[0])
    opt.step()
    twin = copy.deepcopy(opt) if how == "deepcopy" else pickle.loads(pickle.dumps(opt))
    copied = [p for g in twin.param_groups for p in g["params"]]
    assert twin.store_param_remainders is False and twin.master_weights == "auto"
    assert all(a is not b for a, b in zip(params, copied))
    snap = snapshot(opt)
    set_grads(copied, grads[1])
    twin.step()
    assert_unchanged(opt, snap)
    set_grads(params, grads[1])
    opt.step()
    for key, t in optimizer_tensors(twin).items():
        assert_bit_equal(t, optimizer_tensors(opt)[key], key)
    twin.update_param(copied[0], torch.zeros(12, 20))
    assert torch.equal(twin.get_full_parameter_master(copied[0]), torch.zeros(12, 20))
    with pytest.raises(ValueError, match="not a parameter of this optimizer"):
        twin.update_param(params[0], torch.zeros(12, 20))


# ---------------------------------------------------------------------------
# master modes and state size
# ---------------------------------------------------------------------------

MUON_SHAPES = [(32, 48), (32, 48), (48, 16)]
ADAMW_SHAPES = [(100,), (7, 5), (48,)]


def _train(dtype, steps=12, **opt_kwargs):
    shapes = MUON_SHAPES + ADAMW_SHAPES
    values = bf16_values(shapes, scale=0.5)
    params = as_params(values, dtype)
    opt = MuonAdamW([{"params": params[:3], "kind": "muon", "lr": 0.02},
                     {"params": params[3:], "kind": "adamw", "lr": 0.01, "weight_decay": 0.1}], **opt_kwargs)
    for grads in grad_seq(shapes, steps):
        set_grads(params, grads)
        opt.step()
    return values, params, opt


@pytest.mark.parametrize("config,master_dtype", [
    (dict(), torch.int16),
    (dict(master_weights=True), torch.int16),
    (dict(master_weights="auto", store_param_remainders=False), torch.float32),
])
def test_bf16_master_trajectory_is_the_fp32_trajectory(config, master_dtype):
    """BF16 params with remainders or FP32 master tensors: the FP32 master
    follows an FP32-param run from the same values bit for bit (Muon and AdamW
    groups, 12 steps), and the BF16 param is the master rounded by the mode's
    rule (remainder split, or round-to-nearest-even)."""
    _, fp32, fp32_opt = _train(torch.float32)
    _, low, opt = _train(torch.bfloat16, **config)
    for i, (a, b) in enumerate(zip(low, fp32)):
        state = opt.state[a]
        assert state["master_param"].dtype == master_dtype
        master = opt.get_full_parameter_master(a)
        assert_bit_equal(master, b.detach(), f"master {i}")
        expected = ops.split_master(master)[0] if master_dtype == torch.int16 else master.bfloat16()
        assert_bit_equal(a.detach(), expected, f"param {i}")
        for key in set(state) - {"master_param"}:
            assert_bit_equal(state[key], fp32_opt.state[b][key], f"param {i} {key}")
    assert "master_param" not in fp32_opt.state[fp32[0]] and "master_param" not in fp32_opt.state[fp32[3]]


def test_master_weights_false_updates_bf16_params_directly():
    """master_weights=False keeps no master: each step is ops.* in direct mode
    (bit for bit), and the run tracks the FP32 run loosely. Measured drift
    after 12 steps: 6.5% to 13.6% of the FP32 run's total update per param (BF16
    rounding swallows small updates); allowed 25%."""
    values, direct, opt = _train(torch.bfloat16, master_weights=False)
    _, fp32, _ = _train(torch.float32)
    assert all("master_param" not in opt.state[p] for p in direct)
    shapes = MUON_SHAPES + ADAMW_SHAPES
    m_p = [v.bfloat16() for v in values[:3]]
    m_mom, m_smb = [torch.zeros(s) for s in MUON_SHAPES], [torch.zeros(stat_shape(s)) for s in MUON_SHAPES]
    a_p = [v.bfloat16() for v in values[3:]]
    a_m, a_v = [torch.zeros(s) for s in ADAMW_SHAPES], [torch.zeros(s) for s in ADAMW_SHAPES]
    a_s = [torch.zeros(()) for _ in ADAMW_SHAPES]
    for grads in grad_seq(shapes, 12):
        g = [x.bfloat16() for x in grads]
        ops.muon_step(m_p[:2], g[:2], m_mom[:2], m_smb[:2], **muon_hyper(opt.param_groups[0]))
        ops.muon_step(m_p[2:], g[2:3], m_mom[2:], m_smb[2:], **muon_hyper(opt.param_groups[0]))
        ops.adamw_step(a_p, g[3:], a_m, a_v, a_s, **adamw_hyper(opt.param_groups[1]))
    for i, t in enumerate(m_p + a_p):
        assert_bit_equal(direct[i].detach(), t, f"param {i}")
    for i, (p, f, v) in enumerate(zip(direct, fp32, values)):
        drift = ((p.detach().float() - f.detach()).norm() / (f.detach() - v).norm()).item()
        assert 0 < drift < 0.25, f"param {i}: drift {drift:.3f}"


@pytest.mark.parametrize("shape", [(96, 64), (64, 96), (16, 16)])
def test_persistent_state_bytes_per_param(shape):
    """BF16 + remainders with NorMuon, from the actual tensors: AdamW holds
    2 (param) + 2 (remainder) + 8 (moments) = 12 bytes per element plus a
    4-byte step; Muon 2 + 2 + 4 (momentum) plus a max(rows, cols) FP32 second
    moment."""
    rows, cols = shape
    w = torch.nn.Parameter(torch.randn(shape).bfloat16())
    e = torch.nn.Parameter(torch.randn(shape).bfloat16())
    opt = MuonAdamW([{"params": [w], "kind": "muon"}, {"params": [e], "kind": "adamw"}])
    n = rows * cols

    def persistent(p):
        return p.nbytes + sum(t.nbytes for t in opt.state[p].values())

    assert persistent(e) == 12 * n + 4
    assert persistent(w) == 8 * n + 4 * max(rows, cols)
    assert persistent(w) / n <= 8 + max(rows, cols) * 4 / n
    assert opt.state[w]["master_param"].dtype == torch.int16 and opt.state[e]["master_param"].dtype == torch.int16


# ---------------------------------------------------------------------------
# GradScaler
# ---------------------------------------------------------------------------


def _scaler_setup(init_scale=2.0**10):
    shapes = [(16, 24), (16, 24), (24, 8), (30,)]
    values = bf16_values(shapes)
    params = as_params(values, torch.bfloat16)
    opt = MuonAdamW([{"params": params[:3], "kind": "muon", "lr": 0.02},
                     {"params": params[3:], "kind": "adamw", "lr": 0.01}])
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    return shapes, params, opt, scaler


def test_grad_scaler_inf_skips_the_whole_step():
    """An inf in one (Muon) grad: scaler.step leaves every param, remainder,
    moment and step counter bit-identical, after real steps have filled the state."""
    shapes, params, opt, scaler = _scaler_setup()
    for grads in grad_seq(shapes, 2):
        scaler.scale(torch.ones(()))
        set_grads(params, [g * scaler.get_scale() for g in grads])
        scaler.step(opt)
        scaler.update()
    snap = snapshot(opt)
    scaler.scale(torch.ones(()))
    set_grads(params, [g * scaler.get_scale() for g in grad_seq(shapes, 1, seed=7)[0]])
    params[1].grad[3, 5] = float("inf")
    scaler.step(opt)
    scaler.update()
    assert_unchanged(opt, snap)
    assert scaler.get_scale() == 2.0**9
    assert float(opt.state[params[3]]["step"]) == 2.0


def test_grad_scaler_finite_grads_equal_an_unscaled_run():
    """With a power-of-two scale, scaler.step (unscaling in the kernels) and
    scaler.unscale_ + scaler.step both give exactly the unscaled run, Muon
    momentum included: Muon only ever sees unscaled grads."""
    shapes, params, opt, scaler = _scaler_setup()
    _, params_u, opt_u, scaler_u = _scaler_setup()
    _, plain, opt_plain, _ = _scaler_setup()
    for grads in grad_seq(shapes, 3):
        for s, ps, o, unscale_first in ((scaler, params, opt, False), (scaler_u, params_u, opt_u, True)):
            s.scale(torch.ones(()))
            set_grads(ps, [g * s.get_scale() for g in grads])
            if unscale_first:
                s.unscale_(o)
            s.step(o)
            s.update()
        set_grads(plain, grads)
        opt_plain.step()
    expected = optimizer_tensors(opt_plain)
    for o in (opt, opt_u):
        for key, t in optimizer_tensors(o).items():
            assert_bit_equal(t, expected[key], key)
    assert scaler.get_scale() == 2.0**10


# ---------------------------------------------------------------------------
# step: everything checked before the first param is written
# ---------------------------------------------------------------------------


def _two_kind_optimizer(**kwargs):
    """An AdamW bucket stepped before a Muon bucket, so a late failure would show."""
    P = torch.nn.Parameter
    a, w = P(torch.randn(8, dtype=torch.bfloat16)), P(torch.randn(16, 12, dtype=torch.bfloat16))
    opt = MuonAdamW([{"params": [a], "kind": "adamw", "lr": 0.1}, {"params": [w], "kind": "muon", "lr": 0.1}],
                    **kwargs)
    return opt, a, w


def _late_failures():
    """name: (setup(opt, a, w, attr), error type, message fragment)."""
    def grad(shape=None, dtype=torch.float32):
        return lambda opt, a, w, attr: (setattr(a, attr, torch.randn(8)),
                                        setattr(w, attr, torch.randn(shape or tuple(w.shape), dtype=dtype)))

    def edit(key, value):
        def apply(opt, a, w, attr):
            grad()(opt, a, w, attr)
            opt.param_groups[1 if key in ("lr_scale", "ns_steps") else 0][key] = value
        return apply

    return {
        "grad_shape": (grad((16, 8)), ValueError, "main_grad has shape (16, 8), the param (16, 12)"),
        "grad_float64": (grad(dtype=torch.float64), TypeError, "main_grad has dtype torch.float64"),
        "lr_scale_typo": (edit("lr_scale", "orignal"), ValueError, "unknown lr_scale 'orignal'"),
        "ns_steps_above_coefficients": (edit("ns_steps", 7), ValueError, "ns_steps=7 but only 5"),
        "betas_scalar": (edit("betas", 0.9), TypeError, "betas must be a pair"),
        "lr_tensor_nan": (edit("lr", torch.tensor(float("nan"))), ValueError, "lr must be finite"),
        "grad_not_a_tensor": (lambda opt, a, w, attr: (setattr(a, attr, torch.randn(8)), setattr(w, attr, [0.0])),
                              TypeError, "main_grad must be a tensor, got list"),
    }


@pytest.mark.parametrize("case", list(_late_failures()))
def test_a_bad_grad_or_setting_anywhere_raises_before_any_param_is_written(case):
    setup, exc_type, fragment = _late_failures()[case]
    opt, a, w = _two_kind_optimizer(grad_attr="main_grad")
    setup(opt, a, w, "main_grad")
    snap = snapshot(opt)
    with pytest.raises(exc_type, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        opt.step()
    assert_unchanged(opt, snap)


def test_sparse_grads_are_refused_by_name():
    emb = torch.nn.Embedding(10, 4, sparse=True)
    opt = MuonAdamW([{"params": [emb.weight], "kind": "adamw", "param_names": ["emb"]}])
    emb(torch.tensor([1, 2])).sum().backward()
    snap = snapshot(opt)
    with pytest.raises(TypeError, match="'emb': grad has layout torch.sparse_coo"):
        opt.step()
    assert_unchanged(opt, snap)


def test_zero_size_params_are_skipped():
    P = torch.nn.Parameter
    empty = [P(torch.zeros(0, 16)), P(torch.zeros(4, 0)), P(torch.zeros(3, 0, 5))]
    w, b = P(torch.randn(6, 4)), P(torch.randn(4))
    opt = MuonAdamW([{"params": empty + [w], "kind": "muon", "matrix_view": "batch"},
                     {"params": [b], "kind": "adamw"}])
    for p in empty + [w, b]:
        p.grad = torch.ones_like(p)
    before = (w.detach().clone(), b.detach().clone())
    opt.step()
    assert not torch.equal(w, before[0]) and not torch.equal(b, before[1])


def test_params_added_to_a_group_in_place_are_refused():
    opt, a, w = _two_kind_optimizer()
    a.grad, w.grad = torch.randn(8).bfloat16(), torch.randn(16, 12).bfloat16()
    opt.step()
    extra = torch.nn.Parameter(torch.randn(5))
    extra.grad = torch.ones(5)
    opt.param_groups[0]["params"].append(extra)
    snap = snapshot(opt)
    with pytest.raises(ValueError, match="changed in place"):
        opt.step()
    assert_unchanged(opt, snap)


def test_grad_scaler_with_main_grad_is_refused_and_without_grads_is_a_no_op():
    opt, a, w = _two_kind_optimizer(grad_attr="main_grad")
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    scaler.scale(torch.ones(()))
    a.main_grad, w.main_grad = torch.randn(8), torch.randn(16, 12)
    snap = snapshot(opt)
    with pytest.raises(ValueError, match="GradScaler looks for infs in .grad"):
        scaler.step(opt)
    assert_unchanged(opt, snap)
    # GradScaler leaves its inputs on the optimizer when step raises: dropped,
    # so a later plain step does not unscale with them.
    assert not hasattr(opt, "grad_scale") and not hasattr(opt, "found_inf")
    # With .grad populated too (hooks copy it into main_grad), GradScaler sees the infs: allowed.
    a.grad, w.grad = torch.randn(8).bfloat16(), torch.randn(16, 12).bfloat16()
    scaler.step(opt)
    assert tensor_bits(a) != snap["params"][id(a)][0]

    # With grad_attr="grad" and no grads at all, GradScaler hands over found_inf=0 (an int).
    opt, a, w = _two_kind_optimizer()
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    scaler.scale(torch.ones(()))
    snap = snapshot(opt)
    scaler.step(opt)
    assert_unchanged(opt, snap)


def test_pending_master_reads_survive_deepcopy():
    """A checkpoint without masters makes FP32 masters re-read the params at
    next use (model weights may be loaded afterwards); copies keep that."""
    w = torch.nn.Parameter(torch.randn(4, 4, dtype=torch.float16))
    opt = MuonAdamW([{"params": [w], "kind": "adamw"}])
    saved = opt.state_dict()
    del saved["state"][0]["master_param"]
    opt.load_state_dict(saved)
    twin = copy.deepcopy(opt)
    w_twin = twin.param_groups[0]["params"][0]
    with torch.no_grad():
        w.fill_(1.0)
        w_twin.fill_(1.0)
    assert opt.get_full_parameter_master(w).eq(1.0).all()
    assert twin.get_full_parameter_master(w_twin).eq(1.0).all()


@pytest.mark.parametrize("kwargs,exc_type,fragment", [
    (dict(master_weights="yes"), ValueError, "master_weights must be"),
    (dict(grad_attr="wgrad"), ValueError, "grad_attr must be"),
    (dict(max_workspace_bytes=0), ValueError, "max_workspace_bytes must be positive"),
])
def test_constructor_arguments_are_checked(kwargs, exc_type, fragment):
    with pytest.raises(exc_type, match=fragment):
        MuonAdamW([{"params": [torch.nn.Parameter(torch.randn(4, 4))], "kind": "muon"}], **kwargs)
    with pytest.raises(TypeError, match="list of param groups, not a Parameter"):
        MuonAdamW(torch.nn.Parameter(torch.randn(4, 4)))


# ---------------------------------------------------------------------------
# every setting reaches the kernels; less common paths
# ---------------------------------------------------------------------------


def test_every_non_default_group_setting_reaches_the_kernels():
    """Each group key set away from its default, the expected run driven
    through ops.* with the same values written as literals."""
    shapes = [(16, 24), (16, 24), (40,)]
    values = bf16_values(shapes)
    params = as_params(values, torch.bfloat16)
    coefficients = [(3.0, -3.2, 1.2), (2.5, -1.5, 0.5), (2.0, -1.4, 0.4)]
    opt = MuonAdamW([
        {"params": params[:2], "kind": "muon", "lr": 0.03, "momentum": 0.9, "nesterov": False, "beta2": None,
         "weight_decay": 0.2, "ns_steps": 3, "ns_coefficients": coefficients, "lr_scale": "match_rms_adamw"},
        {"params": params[2:], "kind": "adamw", "lr": 0.01, "betas": (0.8, 0.99), "eps": 1e-3,
         "weight_decay": 0.05, "adam_w_mode": False, "bias_correction": False}])
    m_p = [v.bfloat16() for v in values[:2]]
    m_rem = [torch.zeros(shapes[0], dtype=torch.int16) for _ in range(2)]
    m_mom = [torch.zeros(shapes[0]) for _ in range(2)]
    a_p, a_rem = values[2].bfloat16(), torch.zeros(40, dtype=torch.int16)
    a_m, a_v, a_s = torch.zeros(40), torch.zeros(40), torch.zeros(())
    for grads in grad_seq(shapes, 3):
        set_grads(params, grads)
        opt.step()
        ops.muon_step(m_p, [g.bfloat16() for g in grads[:2]], m_mom, [], masters=m_rem, lr=0.03, momentum=0.9,
                      nesterov=False, beta2=None, weight_decay=0.2, ns_steps=3, ns_coefficients=coefficients,
                      lr_scale="match_rms_adamw")
        ops.adamw_step([a_p], [grads[2].bfloat16()], [a_m], [a_v], [a_s], masters=[a_rem], lr=0.01, beta1=0.8,
                       beta2=0.99, eps=1e-3, weight_decay=0.05, adam_w_mode=False, bias_correction=False)
    for i in range(2):
        assert_bit_equal(params[i].detach(), m_p[i], f"muon param {i}")
        assert_bit_equal(opt.state[params[i]]["master_param"], m_rem[i], f"muon remainder {i}")
    assert "second_momentum_buffer" not in opt.state[params[0]]
    assert_bit_equal(params[2].detach(), a_p, "adamw param")
    assert_bit_equal(opt.state[params[2]]["exp_avg_sq"], a_v, "exp_avg_sq")


def test_fp16_params_get_an_fp32_master():
    w = torch.nn.Parameter(bf16_values([(12, 20)])[0].half())
    opt = MuonAdamW([{"params": [w], "kind": "muon", "lr": 0.05}])
    master, mom, smb = w.detach().float(), torch.zeros(12, 20), torch.zeros(1, 20)
    p = w.detach().clone()
    for grads in grad_seq([(12, 20)], 3):
        set_grads([w], grads)
        opt.step()
        ops.muon_step([p], [grads[0].half()], [mom], [smb], masters=[master], lr=0.05)
    assert opt.state[w]["master_param"].dtype == torch.float32
    assert_bit_equal(opt.state[w]["master_param"], master)
    assert_bit_equal(w.detach(), p)


def test_non_contiguous_and_mixed_dtype_grads_step_like_fp32_contiguous_ones():
    """A transposed-view grad is made contiguous; BF16 and FP32 main grads in
    one bucket are stepped per grad dtype. Values are BF16-representable, so
    the run equals one with all-FP32 contiguous grads bit for bit."""
    shapes = [(16, 24), (16, 24), (40,), (40,)]
    values = bf16_values(shapes)
    runs = []
    for mixed in (True, False):
        params = as_params(values, torch.bfloat16)
        opt = MuonAdamW([{"params": params[:2], "kind": "muon", "lr": 0.02},
                         {"params": params[2:], "kind": "adamw", "lr": 0.01}], grad_attr="main_grad")
        for grads in grad_seq(shapes, 2):
            for i, (p, g) in enumerate(zip(params, grads)):
                if mixed and i == 0:
                    g = g.t().contiguous().t()  # non-contiguous view
                p.main_grad = g.bfloat16() if mixed and i % 2 == 1 else g
            opt.step()
        runs.append((params, opt))
    (mixed_params, mixed_opt), (plain_params, plain_opt) = runs
    for key, t in optimizer_tensors(mixed_opt).items():
        assert_bit_equal(t, optimizer_tensors(plain_opt)[key], key)


def test_beta2_switched_on_after_construction_starts_normuon_fresh():
    w = torch.nn.Parameter(bf16_values([(12, 20)])[0])
    opt = MuonAdamW([{"params": [w], "kind": "muon", "lr": 0.05, "beta2": None}])
    p, mom, smb = w.detach().clone(), torch.zeros(12, 20), torch.zeros(1, 20)
    for k, grads in enumerate(grad_seq([(12, 20)], 3)):
        beta2 = None if k == 0 else 0.9
        opt.param_groups[0]["beta2"] = beta2
        set_grads([w], grads)
        opt.step()
        ops.muon_step([p], grads, [mom], [] if beta2 is None else [smb], lr=0.05, beta2=beta2)
    assert_bit_equal(w.detach(), p)
    assert_bit_equal(opt.state[w]["second_momentum_buffer"], smb)


def test_update_param_after_loading_a_checkpoint_without_masters():
    """A pending 're-read the master from the param' must not override values
    given to update_param afterwards: the master keeps their FP32 bits."""
    w = torch.nn.Parameter(torch.randn(6, 8).bfloat16())
    opt = MuonAdamW([{"params": [w], "kind": "adamw"}], store_param_remainders=False)
    saved = opt.state_dict()
    del saved["state"][0]["master_param"]
    opt.load_state_dict(saved)
    values = torch.randn(6, 8)
    opt.update_param(w, values)
    assert_bit_equal(opt.get_full_parameter_master(w), values)


def test_step_bumps_version_counters():
    """Autograd must see the in-place update (a graph that saved the param
    before the step then fails loudly in backward instead of using stale values)."""
    w, b = torch.nn.Parameter(torch.randn(6, 4)), torch.nn.Parameter(torch.randn(4))
    opt = MuonAdamW([{"params": [w], "kind": "muon"}, {"params": [b], "kind": "adamw"}])
    w.grad, b.grad = torch.ones(6, 4), torch.ones(4)
    versions = (w._version, b._version)
    opt.step()
    assert w._version > versions[0] and b._version > versions[1]
    version = w._version
    opt.update_param(w, torch.zeros(6, 4))
    assert w._version > version


def test_max_workspace_bytes_reaches_the_muon_kernel(monkeypatch):
    seen = []
    real = ops.muon_step
    monkeypatch.setattr(ops, "muon_step", lambda *a, **k: (seen.append(k["max_workspace_bytes"]), real(*a, **k)))
    w = torch.nn.Parameter(torch.randn(6, 4))
    opt = MuonAdamW([{"params": [w], "kind": "muon"}], max_workspace_bytes=12345)
    w.grad = torch.ones(6, 4)
    opt.step()
    assert seen == [12345]
    twin = copy.deepcopy(MuonAdamW([{"params": [torch.nn.Parameter(torch.randn(4, 4))], "kind": "muon"}],
                                   grad_attr="main_grad", max_workspace_bytes=999))
    assert twin.grad_attr == "main_grad" and twin.max_workspace_bytes == 999


def test_capturable_keeps_lr_as_a_tensor_that_schedulers_and_loading_update_in_place():
    """capturable=True: each group's lr is a float32 tensor on its params'
    device; StepLR and load_state_dict write into that same tensor (a captured
    graph keeps reading it), and the run equals float lrs bit for bit."""
    shapes = [(16, 24), (40,)]
    values = bf16_values(shapes)
    runs = []
    for capturable in (True, False):
        params = as_params(values, torch.bfloat16)
        opt = MuonAdamW([{"params": params[:1], "kind": "muon", "lr": 0.02},
                         {"params": params[1:], "kind": "adamw", "lr": 0.01}], capturable=capturable)
        lrs = [g["lr"] for g in opt.param_groups]
        scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        for grads in grad_seq(shapes, 3):
            set_grads(params, grads)
            opt.step()
            scheduler.step()
        runs.append((params, opt, lrs))
    (params, opt, lrs), (float_params, float_opt, _) = runs
    for lr, group in zip(lrs, opt.param_groups):
        assert isinstance(lr, torch.Tensor) and lr.dtype == torch.float32 and group["lr"] is lr
    assert [g["lr"].item() for g in opt.param_groups] == [torch.tensor(0.02 / 8).item(), torch.tensor(0.01 / 8).item()]
    for key, t in optimizer_tensors(opt).items():
        assert_bit_equal(t, optimizer_tensors(float_opt)[key], key)
    saved = copy.deepcopy(float_opt.state_dict())
    saved["param_groups"][0]["lr"] = 0.125
    opt.load_state_dict(saved)
    assert opt.param_groups[0]["lr"] is lrs[0] and float(lrs[0]) == 0.125
    assert copy.deepcopy(opt).capturable


def test_a_param_made_non_contiguous_after_construction_is_refused_by_name():
    conv = torch.nn.Conv2d(4, 8, 3)
    opt = MuonAdamW([{"params": [conv.weight], "kind": "muon", "matrix_view": "flatten", "param_names": ["conv"]}])
    conv.to(memory_format=torch.channels_last)
    conv.weight.grad = torch.ones_like(conv.weight)
    snap = snapshot(opt)
    with pytest.raises(ValueError, match="'conv' is no longer contiguous"):
        opt.step()
    assert_unchanged(opt, snap)


# -- On CUDA (marked gpu, skipped without a device; before: test_optimizer_cuda.py)
# MuonAdamW on CUDA (GPU only): against the same optimizer on CPU, with
# GradScaler("cuda"), without host syncs, captured in a CUDA graph, and
# update_param refused in graph capture.


N_MUON = 3  # fc.weight, proj.weight, odd: the first group


class _Net(torch.nn.Module):
    """A small GPT-like model: embedding, two MLP Linears, an odd-shaped matrix, LayerNorm, head."""

    def __init__(self):
        super().__init__()
        self.wte = torch.nn.Embedding(100, 48)
        self.fc = torch.nn.Linear(48, 160)
        self.proj = torch.nn.Linear(160, 48)
        self.odd = torch.nn.Parameter(torch.randn(3, 5) * 0.2)
        self.ln = torch.nn.LayerNorm(48)
        self.lm_head = torch.nn.Linear(48, 100, bias=False)


def _build(device, dtype=torch.bfloat16, **kwargs):
    """The same model (same initial bits) on `device`, grouped by muon_ext.param_groups."""
    torch.manual_seed(0)
    model = _Net().to(dtype).to(device)
    groups = muon_ext.param_groups(model, lr=0.02, adamw_lr=0.01, adamw_weight_decay=0.1)
    assert [g["kind"] for g in groups] == ["muon", "adamw"] and len(groups[0]["params"]) == 3
    opt = MuonAdamW(groups, **kwargs)
    return [p for g in opt.param_groups for p in g["params"]], opt


def _grads(step, params):
    """CPU grads for `params` (BF16, like the params), the same for every device."""
    gen = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=gen).to(p.dtype) for p in params]


def _set_grads(params, grads, scale=1.0):
    for p, g in zip(params, grads):
        p.grad = (g.to(p.device) * scale).to(p.dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("config", [dict(), dict(store_param_remainders=False)], ids=["remainder", "fp32_master"])
def test_cuda_matches_cpu(config):
    """3 steps of the same BF16 model on CUDA and CPU: AdamW params, masters,
    moments and steps bit for bit (shared element math, no FMA contraction);
    Muon momentum bit for bit (it depends on grads only); Muon updates to the
    BF16 noise of the CUDA Polar-Express (below 5% of the update norm, as in
    test_muon.py, on CUDA)."""
    cuda, opt_cuda = _build("cuda", **config)
    cpu, opt_cpu = _build("cpu", **config)
    start = [opt_cpu.get_full_parameter_master(p) for p in cpu]
    for k in range(3):
        grads = _grads(k, cpu)
        _set_grads(cuda, grads)
        _set_grads(cpu, grads)
        opt_cuda.step()
        opt_cpu.step()
    for i, (a, b) in enumerate(zip(cuda, cpu)):
        sa, sb = opt_cuda.state[a], opt_cpu.state[b]
        if i >= N_MUON:
            assert_bit_equal(a.detach().cpu(), b.detach(), f"adamw param {i}")
            for key in sb:
                assert_bit_equal(sa[key].cpu(), sb[key], f"adamw param {i} {key}")
        else:
            assert_bit_equal(sa["momentum_buffer"].cpu(), sb["momentum_buffer"], f"momentum {i}")
            d_cuda = opt_cuda.get_full_parameter_master(a).cpu() - start[i]
            d_cpu = opt_cpu.get_full_parameter_master(b) - start[i]
            assert ((d_cuda - d_cpu).norm() / d_cpu.norm()).item() < 0.05, f"muon param {i}"


@pytest.mark.gpu
def test_grad_scaler_cuda_inf_skips_and_finite_equals_unscaled():
    """GradScaler("cuda"): an inf in one Muon grad leaves every tensor
    bit-identical; with finite grads and a power-of-two scale the run equals
    an unscaled run bit for bit (Muon momentum included). FP16 params, the
    dtype GradScaler is for: its CUDA inf check, which GradScaler runs on the
    grads before our step, has no BF16 kernel (NotImplementedError in torch)."""
    params, opt = _build("cuda", torch.float16)
    plain, opt_plain = _build("cuda", torch.float16)
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**12)
    for k in range(2):
        scaler.scale(torch.ones((), device="cuda"))
        _set_grads(params, _grads(k, params), scale=scaler.get_scale())
        _set_grads(plain, _grads(k, params))
        scaler.step(opt)
        scaler.update()
        opt_plain.step()
    expected = optimizer_tensors(opt_plain)
    for key, t in optimizer_tensors(opt).items():
        assert_bit_equal(t, expected[key], key)

    snap = snapshot(opt)
    scaler.scale(torch.ones((), device="cuda"))
    _set_grads(params, _grads(5, params), scale=scaler.get_scale())
    params[1].grad[0, 0] = float("inf")
    scaler.step(opt)
    scaler.update()
    assert_unchanged(opt, snap)
    assert scaler.get_scale() == 2.0**11


@pytest.mark.gpu
def test_step_never_syncs_the_host():
    """opt.step() under torch.cuda.set_sync_debug_mode("error"), called by
    GradScaler.step with float lrs, for Muon and AdamW buckets, every step
    (FP16 params: GradScaler's CUDA inf check has no BF16 kernel)."""
    params, opt = _build("cuda", torch.float16)
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**8)
    unchecked_step = opt.step

    def checked_step(closure=None):
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            return unchecked_step(closure)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    opt.step = checked_step
    before = params[0].detach().clone()
    for k in range(3):
        scaler.scale(torch.ones((), device="cuda"))
        _set_grads(params, _grads(k, params), scale=scaler.get_scale())
        scaler.step(opt)
        scaler.update()
    assert not torch.equal(params[0].detach(), before)


@pytest.mark.gpu
def test_update_param_is_refused_during_graph_capture():
    """update_param raises inside CUDA graph capture and writes nothing."""
    params, opt = _build("cuda")
    _set_grads(params, _grads(0, params))
    opt.step()
    values = torch.randn(params[0].shape, device="cuda")
    snap = snapshot(opt)
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    torch.cuda.synchronize()
    error = None
    with torch.cuda.stream(stream):
        graph.capture_begin()
        try:
            opt.update_param(params[0], values)
        except RuntimeError as exc:
            error = exc
        finally:
            graph.capture_end()
    torch.cuda.synchronize()
    assert error is not None and "capture" in str(error)
    assert_unchanged(opt, snap)
    opt.update_param(params[0], values)  # allowed outside capture
    assert_bit_equal(opt.get_full_parameter_master(params[0]), values, "master")


@pytest.mark.gpu
@pytest.mark.parametrize("how", ["capturable", "lr_tensors_by_hand"])
def test_step_captured_in_a_cuda_graph_replays_like_eager(how):
    """With lr as device tensors (capturable=True, or set by hand), a whole step
    (both kinds of groups, Muon workspaces from the graph's pool) captures into
    a CUDA graph; replays with new grads and a changed lr give the same bits as
    eager steps."""
    kwargs = dict(capturable=True) if how == "capturable" else {}
    eager_params, eager = _build("cuda", **kwargs)
    graph_params, graphed = _build("cuda", **kwargs)
    for opt in (eager, graphed):
        for group in opt.param_groups:
            if not isinstance(group["lr"], torch.Tensor):
                group["lr"] = torch.tensor([group["lr"]], device="cuda")
    static_grads = [torch.zeros_like(p) for p in graph_params]
    for p, g in zip(graph_params, static_grads):
        p.grad = g

    # Warm up on a side stream (first-use allocations), then capture one step.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    warm = _build("cuda", **kwargs)[1]
    for group in warm.param_groups:
        if not isinstance(group["lr"], torch.Tensor):
            group["lr"] = torch.tensor([group["lr"]], device="cuda")
    with torch.cuda.stream(side):
        _set_grads([p for g in warm.param_groups for p in g["params"]], _grads(0, graph_params))
        warm.step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graphed.step()

    for step in range(3):
        grads = _grads(step, graph_params)
        for g, new in zip(static_grads, grads):
            g.copy_(new.to("cuda"))
        _set_grads(eager_params, grads)
        if step == 2:
            for opt in (eager, graphed):
                for group in opt.param_groups:
                    group["lr"].mul_(0.5)
        graph.replay()
        eager.step()
    torch.cuda.synchronize()
    for (name, a), b in zip(optimizer_tensors(graphed).items(), optimizer_tensors(eager).values()):
        assert_bit_equal(a, b, name)


@pytest.mark.gpu
def test_capture_with_a_float_lr_is_refused():
    params, opt = _build("cuda")
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()  # warm-up outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="capturable=True"):
        with torch.cuda.graph(graph):
            opt.step()
