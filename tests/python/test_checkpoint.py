"""MuonAdamW.state_dict / load_state_dict: FP32 masters in every configuration,
bit-exact resume, FP32 moments, TransformerEngine-style int16 masters, and
validation before anything is written."""

import copy
import io

import pytest
import torch

from support.helpers import assert_bit_equal, assert_same_optimizer_tensors
from support.optimizer_snapshot import assert_unchanged, snapshot
from muon_ext import MuonAdamW, ops

# name: (param dtype, optimizer kwargs)
MODES = {
    "bf16_remainder": (torch.bfloat16, dict()),
    "bf16_fp32_master": (torch.bfloat16, dict(store_param_remainders=False)),
    "fp32": (torch.float32, dict()),
    "bf16_direct": (torch.bfloat16, dict(master_weights=False)),
    "fp16_fp32_master": (torch.float16, dict()),
    "fp16_direct": (torch.float16, dict(master_weights=False)),
}
ADAMW_KEYS = {"step", "exp_avg", "exp_avg_sq"}
MUON_KEYS = {"momentum_buffer", "second_momentum_buffer"}


class _Net(torch.nn.Module):
    def __init__(self, seed):
        super().__init__()
        torch.manual_seed(seed)
        self.emb = torch.nn.Embedding(16, 12)
        self.fc1 = torch.nn.Linear(12, 24)
        self.fc2 = torch.nn.Linear(24, 12)
        self.experts = torch.nn.Parameter(torch.randn(2, 6, 4) * 0.2)
        self.ln = torch.nn.LayerNorm(12)


def _build(mode, seed=0, lr_factor=1.0):
    """Model + optimizer with three groups: 2-D Muon, batched Muon (experts), AdamW."""
    dtype, kwargs = MODES[mode]
    model = _Net(seed).to(dtype)
    groups = [
        {"params": [model.fc1.weight, model.fc2.weight], "kind": "muon", "lr": 0.02 * lr_factor},
        {"params": [model.experts], "kind": "muon", "lr": 0.03 * lr_factor, "matrix_view": "batch", "beta2": 0.9},
        {"params": [model.emb.weight, model.fc1.bias, model.fc2.bias, model.ln.weight, model.ln.bias],
         "kind": "adamw", "lr": 0.01 * lr_factor, "weight_decay": 0.05},
    ]
    return model, MuonAdamW(groups, **kwargs)


def _train(model, opt, steps):
    """Deterministic grads per step index (not tied to the model's values)."""
    for k in steps:
        gen = torch.Generator().manual_seed(1000 + k)
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
        opt.step()


def _assert_same_optimizer(a, b):
    assert_same_optimizer_tensors(a, b)
    strip = lambda g: {k: v for k, v in g.items() if k != "params"}  # noqa: E731
    assert [strip(g) for g in a.param_groups] == [strip(g) for g in b.param_groups]


def _save_load(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer)


@pytest.mark.parametrize("mode", list(MODES))
def test_state_dict_holds_fp32_masters_and_nothing_transient(mode):
    """Low-precision params with a master get an FP32 `master_param` equal to
    the full master; FP32 params and master_weights=False get none; there are
    no other keys (no caches or workspaces), and params are referenced by index."""
    model, opt = _build(mode)
    _train(model, opt, range(2))
    sd = opt.state_dict()
    with_master = mode in ("bf16_remainder", "bf16_fp32_master", "fp16_fp32_master")
    index = 0
    for group, saved_group in zip(opt.param_groups, sd["param_groups"]):
        assert set(saved_group) == set(group)
        assert saved_group["params"] == list(range(index, index + len(group["params"])))
        for p in group["params"]:
            entry = sd["state"][index]
            index += 1
            keys = MUON_KEYS if group["kind"] == "muon" else ADAMW_KEYS
            assert set(entry) == keys | ({"master_param"} if with_master else set())
            if with_master:
                assert entry["master_param"].dtype == torch.float32
                assert_bit_equal(entry["master_param"], opt.get_full_parameter_master(p), "master")
            for key in keys:
                assert entry[key].dtype == torch.float32
    assert set(sd) == {"state", "param_groups"} and len(sd["state"]) == index


@pytest.mark.parametrize("source,target", [("bf16_remainder", "bf16_fp32_master"),
                                           ("bf16_fp32_master", "bf16_remainder")])
def test_checkpoints_move_between_remainder_and_fp32_master_configs(source, target):
    """A checkpoint from either BF16 master configuration loads into the other
    with the same FP32 masters bit for bit; the param is re-derived by the
    target's rule and moments are carried over exactly."""
    model, opt = _build(source)
    _train(model, opt, range(3))
    sd = _save_load(opt.state_dict())
    _, fresh = _build(target, seed=1)
    fresh.load_state_dict(sd)
    for p, q in zip(_params(opt), _params(fresh)):
        master = opt.get_full_parameter_master(p)
        assert_bit_equal(fresh.get_full_parameter_master(q), master, "master")
        if target == "bf16_remainder":
            param, remainder = ops.split_master(master)
            assert_bit_equal(q.detach(), param, "param")
            assert_bit_equal(fresh.state[q]["master_param"], remainder, "remainder")
        else:
            assert_bit_equal(fresh.state[q]["master_param"], master, "fp32 master")
            assert_bit_equal(q.detach(), master.bfloat16(), "param")
        for key in set(opt.state[p]) - {"master_param"}:
            assert_bit_equal(fresh.state[q][key], opt.state[p][key], key)


def _load(model, opt, checkpoint, order):
    """Model weights and optimizer state from `checkpoint`, in the given order."""
    if order == "model_first":
        model.load_state_dict(checkpoint["model"])
        opt.load_state_dict(checkpoint["optimizer"])
    else:
        opt.load_state_dict(checkpoint["optimizer"])
        model.load_state_dict(checkpoint["model"])


def _params(opt):
    return [p for g in opt.param_groups for p in g["params"]]


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("order", ["model_first", "optimizer_first"])
def test_resume_is_bit_exact(mode, order):
    """Train 3 steps, save model and optimizer (torch.save / torch.load), load
    both into a fresh model + optimizer (different init and hyperparameters)
    in either order, train 3 more: params, masters, moments, step counts and
    hyperparameters equal an uninterrupted 6-step run bit for bit."""
    ref_model, ref_opt = _build(mode)
    _train(ref_model, ref_opt, range(6))

    model, opt = _build(mode)
    _train(model, opt, range(3))
    checkpoint = _save_load({"model": model.state_dict(), "optimizer": opt.state_dict()})
    del model, opt

    model, opt = _build(mode, seed=1, lr_factor=3.0)
    _load(model, opt, checkpoint, order)
    _train(model, opt, range(3, 6))
    _assert_same_optimizer(opt, ref_opt)


def test_fp32_moments_stay_fp32_after_loading():
    """Moments of BF16 params load as FP32, bit for bit (values that BF16
    can't hold); torch's own Optimizer.load_state_dict would cast them to BF16."""
    model, opt = _build("bf16_remainder")
    _train(model, opt, range(2))
    sd = _save_load(opt.state_dict())
    _, fresh = _build("bf16_remainder", seed=1)
    fresh.load_state_dict(copy.deepcopy(sd))
    for key, saved in sd["state"].items():
        q = _params(fresh)[key]
        for name in set(saved) - {"step", "master_param"}:
            assert fresh.state[q][name].dtype == torch.float32
            assert_bit_equal(fresh.state[q][name], saved[name], name)
            assert not torch.equal(saved[name], saved[name].bfloat16().float()), "test needs non-BF16 values"
    _, plain = _build("bf16_remainder", seed=2)
    torch.optim.Optimizer.load_state_dict(plain, copy.deepcopy(sd))
    assert plain.state[_params(plain)[0]]["momentum_buffer"].dtype == torch.bfloat16


@pytest.mark.parametrize("target", ["bf16_remainder", "bf16_fp32_master"])
def test_transformer_engine_int16_masters_combine_with_the_loaded_params(target):
    """A checkpoint whose `master_param` entries are int16 remainders (TE
    style) gives back the exact FP32 masters once the model weights are loaded
    first; moments and steps load as usual."""
    model, opt = _build("bf16_remainder")
    _train(model, opt, range(3))
    sd = opt.state_dict()
    for p, entry in zip(_params(opt), sd["state"].values()):
        entry["master_param"] = opt.state[p]["master_param"].clone()
        assert entry["master_param"].dtype == torch.int16
    checkpoint = _save_load({"model": model.state_dict(), "optimizer": sd})
    fresh_model, fresh = _build(target, seed=1)
    fresh_model.load_state_dict(checkpoint["model"])
    fresh.load_state_dict(checkpoint["optimizer"])
    for p, q in zip(_params(opt), _params(fresh)):
        assert_bit_equal(fresh.get_full_parameter_master(q), opt.get_full_parameter_master(p), "master")
        for key in set(opt.state[p]) - {"master_param"}:
            assert_bit_equal(fresh.state[q][key], opt.state[p][key], key)


def _last_adamw_entry(sd):
    return sd["state"][sd["param_groups"][-1]["params"][-1]]


def _experts_entry(sd):
    return sd["state"][sd["param_groups"][1]["params"][0]]


# Each corrupts a state dict; the corruption sits late (last group or param) so
# a loader that wrote as it went would already have changed earlier params.
_CORRUPTIONS = {
    "too_few_groups": lambda sd: sd["param_groups"].pop(),
    "too_many_groups": lambda sd: sd["param_groups"].append(copy.deepcopy(sd["param_groups"][-1])),
    "too_few_params": lambda sd: sd["param_groups"][-1]["params"].pop(),
    "too_many_params": lambda sd: sd["param_groups"][-1]["params"].append(0),
    "kind_mismatch": lambda sd: sd["param_groups"][1].update(kind="adamw"),
    "exp_avg_shape": lambda sd: _last_adamw_entry(sd).update(exp_avg=torch.zeros(13)),
    "exp_avg_sq_int": lambda sd: _last_adamw_entry(sd).update(
        exp_avg_sq=_last_adamw_entry(sd)["exp_avg_sq"].to(torch.int32)),
    "momentum_shape": lambda sd: _experts_entry(sd).update(momentum_buffer=torch.zeros(2, 4, 6)),
    "second_moment_transposed": lambda sd: _experts_entry(sd).update(
        second_momentum_buffer=_experts_entry(sd)["second_momentum_buffer"].mT.contiguous()),
    "master_shape": lambda sd: _last_adamw_entry(sd).update(master_param=torch.zeros(1, 12)),
    "master_float16": lambda sd: _last_adamw_entry(sd).update(
        master_param=_last_adamw_entry(sd)["master_param"].half()),
    "master_not_a_tensor": lambda sd: _last_adamw_entry(sd).update(master_param=[0.0] * 12),
    "step_not_scalar": lambda sd: _last_adamw_entry(sd).update(step=torch.zeros(2)),
    "state_not_a_dict": lambda sd: sd.update(state=list(sd["state"].values())),
    "ns_steps_above_coefficients": lambda sd: sd["param_groups"][1].update(ns_steps=9),
    "unknown_lr_scale": lambda sd: sd["param_groups"][1].update(lr_scale="spectral"),
    "matrix_view_changed": lambda sd: sd["param_groups"][1].update(matrix_view="flatten"),
    "amsgrad": lambda sd: sd["param_groups"][-1].update(amsgrad=True),
    "betas_scalar": lambda sd: sd["param_groups"][-1].update(betas=0.9),
    "coefficient_pairs": lambda sd: sd["param_groups"][1].update(ns_steps=1, ns_coefficients=[(1.0, 2.0)]),
    "master_on_meta": lambda sd: _last_adamw_entry(sd).update(master_param=torch.empty(12, device="meta")),
    "exp_avg_sparse": lambda sd: _last_adamw_entry(sd).update(exp_avg=torch.zeros(12).to_sparse()),
    "step_on_meta": lambda sd: _last_adamw_entry(sd).update(step=torch.zeros((), device="meta")),
    "step_negative": lambda sd: _last_adamw_entry(sd).update(step=-1.0),
}


@pytest.mark.parametrize("case", list(_CORRUPTIONS))
def test_bad_state_dicts_raise_before_anything_changes(case):
    """Wrong group / param counts, kind, shapes and dtypes raise; every tensor
    and every group hyperparameter is left as it was (the state dict's other
    groups carry different lrs that a partial load would have applied)."""
    model, opt = _build("bf16_remainder")
    _train(model, opt, range(2))
    sd = copy.deepcopy(opt.state_dict())
    for group in sd["param_groups"]:
        group["lr"] = 123.0
    _CORRUPTIONS[case](sd)
    other_model, other = _build("bf16_remainder", seed=1)
    _train(other_model, other, range(1))
    snap = snapshot(other)
    groups = copy.deepcopy([{k: v for k, v in g.items() if k != "params"} for g in other.param_groups])
    with pytest.raises((ValueError, TypeError)):
        other.load_state_dict(sd)
    assert_unchanged(other, snap)
    assert [{k: v for k, v in g.items() if k != "params"} for g in other.param_groups] == groups


def test_int16_master_for_an_fp32_param_is_refused():
    """int16 remainders only make sense with a BF16 param: for FP32 params the
    entry is refused and nothing changes."""
    model, opt = _build("fp32")
    _train(model, opt, range(1))
    sd = copy.deepcopy(opt.state_dict())
    _last_adamw_entry(sd)["master_param"] = torch.zeros(12, dtype=torch.int16)
    snap = snapshot(opt)
    with pytest.raises(TypeError, match="int16"):
        opt.load_state_dict(sd)
    assert_unchanged(opt, snap)


@pytest.mark.parametrize("target", ["bf16_fp32_master", "bf16_remainder"])
def test_checkpoint_without_masters_loads_in_either_order(target):
    """A checkpoint from BF16 params without masters (master_weights=False)
    carries no master_param: the loaded model weights become the masters
    whether they are loaded before or after the optimizer state, and the two
    orders then train to the same bits."""
    source_model, source = _build("bf16_direct")
    _train(source_model, source, range(2))
    checkpoint = _save_load({"model": source_model.state_dict(), "optimizer": source.state_dict()})
    runs = []
    for order in ("model_first", "optimizer_first"):
        model, opt = _build(target, seed=1)
        _load(model, opt, checkpoint, order)
        for p in _params(opt):
            assert_bit_equal(opt.get_full_parameter_master(p), p.detach().float(), "master == loaded param")
        _train(model, opt, range(2, 4))
        runs.append(opt)
    _assert_same_optimizer(runs[0], runs[1])


def test_state_dict_hooks_run_as_in_torch():
    model, opt = _build("bf16_remainder")
    _train(model, opt, range(2))
    calls = []
    opt.register_state_dict_pre_hook(lambda o: calls.append("pre"))
    opt.register_state_dict_post_hook(lambda o, sd: calls.append("post") or {**sd, "note": "tagged"})
    saved = opt.state_dict()
    assert calls == ["pre", "post"] and saved["note"] == "tagged"

    _, target = _build("bf16_remainder", seed=1)

    def retune(o, sd):
        calls.append("load_pre")
        sd.pop("note")  # on torch's shallow copy: the caller's dict keeps it
        return {**sd, "param_groups": [dict(g, lr=0.5) for g in sd["param_groups"]]}

    target.register_load_state_dict_pre_hook(retune)
    target.register_load_state_dict_post_hook(lambda o: calls.append("load_post"))
    target.load_state_dict(saved)
    assert calls[2:] == ["load_pre", "load_post"]
    assert "note" in saved
    assert [g["lr"] for g in target.param_groups] == [0.5] * 3


def test_second_moment_checked_against_the_loaded_beta2():
    """A saved group with NorMuon on, loaded where it is off: the buffer is
    checked against the param's shape (not against absent state) and loaded."""
    model, opt = _build("bf16_remainder")
    _train(model, opt, range(2))
    saved = copy.deepcopy(opt.state_dict())
    target_model, target = _build("bf16_remainder", seed=1)
    target.param_groups[0]["beta2"] = None
    for p in target.param_groups[0]["params"]:
        target.state[p].pop("second_momentum_buffer")
    bad = copy.deepcopy(saved)
    first = bad["state"][bad["param_groups"][0]["params"][0]]
    first["second_momentum_buffer"] = first["second_momentum_buffer"].mT.contiguous()
    snap = snapshot(target)
    with pytest.raises(ValueError, match="second_momentum_buffer"):
        target.load_state_dict(bad)
    assert_unchanged(target, snap)
    target.load_state_dict(saved)
    p0 = target.param_groups[0]["params"][0]
    assert target.param_groups[0]["beta2"] == 0.95
    assert_bit_equal(target.state[p0]["second_momentum_buffer"], opt.state[model.fc1.weight]["second_momentum_buffer"])


def test_params_missing_from_the_state_dict_start_fresh():
    """As in torch, loading replaces the state: a param without an entry gets
    zero moments and step, and its param as master."""
    model, opt = _build("bf16_remainder")
    _train(model, opt, range(2))
    saved = copy.deepcopy(opt.state_dict())
    saved["state"] = {}
    opt.load_state_dict(saved)
    for p in model.parameters():
        state = opt.state[p]
        for key in ("step", "exp_avg", "exp_avg_sq", "momentum_buffer", "second_momentum_buffer"):
            if key in state:
                assert not state[key].any(), key
        assert_bit_equal(opt.get_full_parameter_master(p), p.detach().float())


def test_unknown_state_entries_are_kept():
    model, opt = _build("bf16_remainder")
    _train(model, opt, range(1))
    saved = copy.deepcopy(opt.state_dict())
    _last_adamw_entry(saved)["ema_of_update"] = torch.full((12,), 3.0)
    opt.load_state_dict(saved)
    assert torch.equal(opt.state[model.ln.bias]["ema_of_update"], torch.full((12,), 3.0))


def test_loading_writes_into_the_existing_state_tensors():
    """A CUDA graph captured before a load keeps stepping on the same tensors:
    load_state_dict must write into them (and into a capturable lr), and the
    optimizer must not share tensors with the loaded dict."""
    model, opt = _build("bf16_remainder")
    _train(model, opt, range(2))
    saved = copy.deepcopy(opt.state_dict())
    target_model, target = _build("bf16_remainder", seed=1)
    _train(target_model, target, range(1))
    before = {(id(p), k): t for p in target_model.parameters() for k, t in target.state[p].items()}
    target.load_state_dict(saved)
    for p in target_model.parameters():
        for k, t in target.state[p].items():
            assert t is before[(id(p), k)], k
    _assert_same_optimizer(opt, target)


def test_loaded_groups_do_not_alias_the_state_dict():
    model, opt = _build("bf16_remainder")
    saved = copy.deepcopy(opt.state_dict())
    saved["param_groups"][0]["lr"] = torch.tensor(0.5)
    saved["param_groups"][0]["betas_note"] = [1, 2]
    target_model, target = _build("bf16_remainder", seed=1)
    target.load_state_dict(saved)
    saved["param_groups"][0]["lr"].fill_(9.0)
    saved["param_groups"][0]["betas_note"].append(3)
    assert float(target.param_groups[0]["lr"]) == 0.5 and target.param_groups[0]["betas_note"] == [1, 2]


def test_a_low_precision_second_moment_loads_as_fp32_where_normuon_is_off():
    model, opt = _build("bf16_remainder")
    _train(model, opt, range(2))
    saved = copy.deepcopy(opt.state_dict())
    saved["param_groups"][0]["beta2"] = None
    first = saved["state"][saved["param_groups"][0]["params"][0]]
    first["second_momentum_buffer"] = first["second_momentum_buffer"].bfloat16()
    target_model, target = _build("bf16_remainder", seed=1)
    target.load_state_dict(saved)
    assert target.state[target_model.fc1.weight]["second_momentum_buffer"].dtype == torch.float32
    target.param_groups[0]["beta2"] = 0.95
    _train(target_model, target, range(1))  # NorMuon back on: steps without a dtype error
