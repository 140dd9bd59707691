"""Reliability of single calls: nothing is read out of bounds, no step is half
applied, a model cast after the optimizer was built is refused, update_param
refuses non-finite values, and the ops name a list entry that is not a tensor.

Every refused call leaves every tensor bit-identical."""

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch

import muon_ext
from support.helpers import bits
from support.optimizer_snapshot import assert_unchanged, snapshot
from muon_ext import MuonAdamW, ops

P = torch.nn.Parameter
HERE = pathlib.Path(__file__).parent


# ---------------------------------------------------------------------------
# 0. storage that does not hold a tensor's elements: refused, by name
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def storage_results():
    """Runs support/reliability_storage_cases.py in a child process (a missing check
    would read out of bounds, which may kill the process); its JSON lines by case."""
    package_root = str(pathlib.Path(muon_ext.__file__).parent.parent)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), package_root, os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, "-m", "support.reliability_storage_cases"], capture_output=True, text=True,
                         env=env, cwd=str(HERE), timeout=600)
    results = {}
    for line in run.stdout.splitlines():
        if line.startswith("{"):
            entry = json.loads(line)
            results[entry["case"]] = entry
    return results, run


def _storage_case_names():
    from support import reliability_storage_cases

    return list(reliability_storage_cases.all_cases())


@pytest.mark.parametrize("case", _storage_case_names())
def test_storage_that_does_not_hold_the_tensor_is_refused_by_name(storage_results, case):
    results, run = storage_results
    if case not in results:
        pytest.fail(f"the child process died before this case (exit {run.returncode}):\n{run.stderr[-3000:]}")
    assert results[case]["ok"], results[case]["error"]


# ---------------------------------------------------------------------------
# 1. everything the kernels refuse is refused before the first write
# ---------------------------------------------------------------------------


def _optimizer(dtype=torch.float32, **kwargs):
    """Muon 'w' (group 0, written first), AdamW 'a' and 'b' (group 1); stepped once, with fresh grads."""
    gen = torch.Generator().manual_seed(0)
    w, a, b = (P(torch.randn(s, generator=gen).to(dtype)) for s in ((16, 8), (10, 4), (10, 4)))
    opt = MuonAdamW([{"params": [w], "kind": "muon", "lr": 0.02, "param_names": ["w"]},
                     {"params": [a, b], "kind": "adamw", "lr": 1e-3, "param_names": ["a", "b"]}], **kwargs)
    for _ in range(2):
        for p in (w, a, b):
            p.grad = torch.randn(p.shape, generator=gen).to(dtype)
        opt.step()
    return opt, w, a, b


def _set_data(name, make):
    return lambda opt, w, a, b: setattr({"w": w, "a": a, "b": b}[name], "data", make(w, a, b))


def _set_state(name, key, make):
    def apply(opt, w, a, b):
        p = {"w": w, "a": a, "b": b}[name]
        opt.state[p][key] = make(opt.state[p][key], opt, w, a, b)
    return apply


def _del_state(name, key):
    return lambda opt, w, a, b: opt.state[{"w": w, "a": a, "b": b}[name]].pop(key)


def _late_failures():
    """name: (mutation(opt, w, a, b), optimizer kwargs, error type, message fragments)."""
    shared = torch.zeros(44)  # two (10, 4) params 4 elements apart
    return {
        "param dtype (bf16 -> fp32 through .data)": (
            _set_data("b", lambda w, a, b: b.data.float()), dict(dtype=torch.bfloat16), TypeError,
            ["param group 1 (adamw), param 1 'b' is torch.float32 but was torch.bfloat16"]),
        "param resized through .data": (
            _set_data("b", lambda w, a, b: torch.randn(12, 4)), {}, ValueError,
            ["'b': optimizer state 'exp_avg' has shape (10, 4) and the param (12, 4)"]),
        "Muon param resized, state resized with it": (
            lambda opt, w, a, b: (setattr(w, "data", torch.randn(16, 6)),
                                  opt.state[w].update(momentum_buffer=torch.zeros(16, 6),
                                                      second_momentum_buffer=torch.zeros(16, 1))),
            {}, ValueError, ["param group 0 (muon), param 0 'w' has shape (16, 6), no longer 16x8 matrices"]),
        "params tied through .data": (
            _set_data("b", lambda w, a, b: a.data), {}, ValueError,
            ["param group 1 (adamw), param 1 'b' shares memory with param group 1 (adamw), param 0 'a'"]),
        "params overlapping in part": (
            lambda opt, w, a, b: (setattr(a, "data", shared[:40].view(10, 4)),
                                  setattr(b, "data", shared[4:].view(10, 4))),
            {}, ValueError, ["'b' shares memory with", "'a'"]),
        "param moved to another device": (
            lambda opt, w, a, b: torch.utils.swap_tensors(b, P(b.detach().to("meta"))), {}, ValueError,
            ["'b' is on meta but was on cpu"]),
        "param no longer contiguous": (
            _set_data("a", lambda w, a, b: a.data.t().contiguous().t()), {}, ValueError,
            ["'a' is no longer contiguous"]),
        "state replaced by an FP16 copy": (
            _set_state("b", "exp_avg", lambda t, *_: t.half()), {}, TypeError,
            ["'b': optimizer state 'exp_avg' has dtype torch.float16"]),
        "state of another shape": (
            _set_state("b", "exp_avg_sq", lambda t, *_: t.reshape(-1)), {}, ValueError,
            ["'b': optimizer state 'exp_avg_sq' has shape (40,) and the param (10, 4)"]),
        "state not contiguous": (
            _set_state("b", "exp_avg", lambda t, *_: t.t().contiguous().t()), {}, ValueError,
            ["'b': optimizer state 'exp_avg' must be contiguous"]),
        "state on another device": (
            _set_state("b", "exp_avg", lambda t, *_: t.to("meta")), {}, ValueError,
            ["'b': optimizer state 'exp_avg' is on meta, the param on cpu"]),
        "state not a tensor": (
            _set_state("b", "step", lambda t, *_: 3.0), {}, TypeError,
            ["'b': optimizer state 'step' must be a tensor, got float"]),
        "state deleted": (_del_state("b", "exp_avg"), {}, ValueError, ["'b': optimizer state 'exp_avg' is missing"]),
        "step counter shared": (
            _set_state("b", "step", lambda t, opt, w, a, b: opt.state[a]["step"]), {}, ValueError,
            ["'b': optimizer state 'step' is the same tensor as that of param group 1 (adamw), param 0 'a'"]),
        "moment shared by two params of one bucket": (
            _set_state("b", "exp_avg", lambda t, opt, w, a, b: opt.state[a]["exp_avg"]), {}, ValueError,
            ["optimizer state 'exp_avg' of param group 1 (adamw), param 1 'b' shares memory with optimizer state "
             "'exp_avg' of param group 1 (adamw), param 0 'a'"]),
        "moment overlapping another bucket's moment": (
            _set_state("a", "exp_avg_sq", lambda t, opt, w, a, b: opt.state[w]["momentum_buffer"].view(-1)[8:48]
                       .view(10, 4)), {}, ValueError,
            ["optimizer state 'exp_avg_sq' of param group 1 (adamw), param 0 'a' shares memory with optimizer state "
             "'momentum_buffer' of param group 0 (muon), param 0 'w'"]),
        "remainders in another param's memory": (
            _set_state("b", "master_param", lambda t, opt, w, a, b: a.data.view(torch.int16)),
            dict(dtype=torch.bfloat16), ValueError,
            ["optimizer state 'master_param' of param group 1 (adamw), param 1 'b' shares memory with param group 1 "
             "(adamw), param 0 'a'"]),
        "step counter of two elements": (
            _set_state("b", "step", lambda t, *_: torch.zeros(2)), {}, ValueError,
            ["'b': optimizer state 'step' has shape (2,)"]),
        "Muon momentum FP16": (
            _set_state("w", "momentum_buffer", lambda t, *_: t.half()), {}, TypeError,
            ["'w': optimizer state 'momentum_buffer' has dtype torch.float16"]),
        "NorMuon statistics of the param's shape": (
            _set_state("w", "second_momentum_buffer", lambda t, *_: torch.zeros(16, 8)), {}, ValueError,
            ["'w': optimizer state 'second_momentum_buffer' has shape (16, 8)"]),
        "remainders replaced by an FP32 master": (
            _set_state("b", "master_param", lambda t, *_: t.float()), dict(dtype=torch.bfloat16), TypeError,
            ["'b': optimizer state 'master_param' has dtype torch.float32"]),
        "remainders deleted": (_del_state("b", "master_param"), dict(dtype=torch.bfloat16), ValueError,
                               ["'b': optimizer state 'master_param' is missing"]),
        "a master for an FP32 param": (
            lambda opt, w, a, b: opt.state[b].__setitem__("master_param", b.detach().clone()), {}, ValueError,
            ["'b': optimizer state 'master_param' is unexpected"]),
        "state replaced by a non-dict": (
            lambda opt, w, a, b: opt.state.__setitem__(b, [1]), {}, TypeError,
            ["'b': its optimizer state must be a dict, got list"]),
    }


_CASES = _late_failures()


@pytest.mark.parametrize("case", list(_CASES))
def test_anything_the_kernels_refuse_is_refused_before_the_first_write(case):
    """Group 0 (Muon) is written first: a check left to the kernels would
    raise only after it was updated."""
    mutate, kwargs, exc_type, fragments = _CASES[case]
    opt, w, a, b = _optimizer(**kwargs)
    mutate(opt, w, a, b)
    readable = {k: t for k, t in _tensors(opt).items() if not t.is_meta}
    before = {k: bits(t).clone() for k, t in readable.items()}
    with pytest.raises(exc_type) as error:
        opt.step()
    for fragment in fragments:
        assert fragment in str(error.value), str(error.value)
    for key, t in readable.items():
        assert torch.equal(bits(t), before[key]), f"{key} changed"


def _tensors(opt):
    """Every tensor of the optimizer (params, state, grads), by name; skips non-tensor state."""
    out = {}
    for gi, group in enumerate(opt.param_groups):
        for pi, p in enumerate(group["params"]):
            out[f"{gi}.{pi}"] = p.detach()
            if p.grad is not None:
                out[f"{gi}.{pi}.grad"] = p.grad
            entry = opt.state[p]
            for key, value in (entry.items() if isinstance(entry, dict) else ()):
                if isinstance(value, torch.Tensor):
                    out[f"{gi}.{pi}.{key}"] = value
    return out


def test_a_bad_max_workspace_bytes_is_refused_before_the_adamw_bucket_is_written():
    a, w = P(torch.randn(8)), P(torch.randn(16, 12))
    opt = MuonAdamW([{"params": [a], "kind": "adamw"}, {"params": [w], "kind": "muon"}])
    a.grad, w.grad = torch.ones(8), torch.ones(16, 12)
    opt.max_workspace_bytes = 0
    snap = snapshot(opt)
    with pytest.raises(ValueError, match="max_workspace_bytes must be"):
        opt.step()
    assert_unchanged(opt, snap)


def test_params_of_two_buckets_sharing_memory_are_refused():
    opt, w, a, b = _optimizer()
    shared = torch.zeros(16 * 8)
    w.data = shared.view(16, 8)
    a.data = shared[8:48].view(10, 4)
    snap = snapshot(opt)
    with pytest.raises(ValueError, match=r"param group 1 \(adamw\), param 0 'a' shares memory with param group 0 "
                                         r"\(muon\), param 0 'w'"):
        opt.step()
    assert_unchanged(opt, snap)


def test_a_param_with_no_elements_at_construction_that_grew_is_refused():
    empty, b = P(torch.zeros(0, 4)), P(torch.randn(4))
    opt = MuonAdamW([{"params": [b], "kind": "adamw"}, {"params": [empty], "kind": "adamw", "param_names": ["e"]}])
    b.grad = torch.ones(4)
    opt.step()
    empty.data = torch.randn(3, 4)
    empty.grad = torch.ones(3, 4)
    snap = snapshot(opt)
    with pytest.raises(ValueError, match=r"'e' had no elements when the optimizer was built and has shape \(3, 4\)"):
        opt.step()
    assert_unchanged(opt, snap)


def test_checks_do_not_refuse_what_steps_fine():
    """NorMuon switched on later (its statistics are created at first use),
    params without grads, grads of mixed dtypes and layouts, flatten views."""
    gen = torch.Generator().manual_seed(0)
    conv = P(torch.randn(8, 4, 3, 3, generator=gen))
    w, v = P(torch.randn(8, 6, generator=gen)), P(torch.randn(8, 6, generator=gen))
    a = P(torch.randn(5, generator=gen))
    opt = MuonAdamW([{"params": [w, v], "kind": "muon", "beta2": None},
                     {"params": [conv], "kind": "muon", "matrix_view": "flatten"},
                     {"params": [a], "kind": "adamw"}])
    w.grad = torch.randn(6, 8, generator=gen).t()
    v.grad_dtype = None  # allows a grad of another dtype
    v.grad = torch.randn(8, 6, generator=gen).bfloat16()
    conv.grad = torch.randn(conv.shape, generator=gen)
    opt.step()
    opt.param_groups[0]["beta2"] = 0.95
    a.grad = torch.randn(5, generator=gen)
    before = a.detach().clone()
    opt.step()
    assert "second_momentum_buffer" in opt.state[w] and not torch.equal(a, before)


# ---------------------------------------------------------------------------
# 2. a model cast after the optimizer was built
# ---------------------------------------------------------------------------


def test_a_model_cast_to_bf16_after_construction_is_refused_and_the_advice_works():
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 8, bias=False)
    opt = MuonAdamW([dict(params=[lin.weight], kind="adamw", lr=1e-4, weight_decay=0.0, param_names=["weight"])])
    lin.weight.grad = torch.ones_like(lin.weight)
    opt.step()
    lin.bfloat16()
    lin.weight.grad = torch.ones_like(lin.weight)
    snap = snapshot(opt)
    with pytest.raises(TypeError) as error:
        opt.step()
    message = str(error.value)
    for fragment in ("param group 0 (adamw), param 0 'weight' is torch.bfloat16 but was torch.float32",
                     "Build the optimizer after casting the model", "state_dict()", "update_param"):
        assert fragment in message, message
    assert_unchanged(opt, snap)
    with pytest.raises(TypeError, match="Build the optimizer after casting"):
        opt.update_param(lin.weight, torch.zeros(8, 8))
    assert_unchanged(opt, snap)

    # The advice: a new optimizer built after the cast, loading the old one's state.
    new = MuonAdamW([dict(params=[lin.weight], kind="adamw", lr=1e-4, weight_decay=0.0)])
    new.load_state_dict(opt.state_dict())
    start = new.get_full_parameter_master(lin.weight)
    for _ in range(100):
        lin.weight.grad = torch.ones_like(lin.weight)
        new.step()
    moved = (new.get_full_parameter_master(lin.weight) - start).abs().mean().item()
    assert 0.008 < moved < 0.012, moved  # 100 sign-like Adam steps of 1e-4: an FP32 master (remainders) again


@pytest.mark.parametrize("case", ["bf16 remainders -> fp32", "bf16 FP32 master -> fp32", "fp16 -> bf16 (remainders)",
                                  "fp32 -> fp16"])
def test_any_cast_that_changes_the_master_mode_is_refused(case):
    dtype, cast, kwargs = {
        "bf16 remainders -> fp32": (torch.bfloat16, torch.float32, {}),
        "bf16 FP32 master -> fp32": (torch.bfloat16, torch.float32, dict(store_param_remainders=False)),
        "fp16 -> bf16 (remainders)": (torch.float16, torch.bfloat16, {}),
        "fp32 -> fp16": (torch.float32, torch.float16, {}),
    }[case]
    opt, w, a, b = _optimizer(dtype, **kwargs)
    a.data = a.data.to(cast)
    a.grad = torch.ones_like(a)
    snap = snapshot(opt)
    with pytest.raises(TypeError, match=f"'a' is {cast} but was"):
        opt.step()
    assert_unchanged(opt, snap)


def test_a_cast_that_keeps_the_master_mode_is_still_refused_after_bucketing():
    """master_weights=False: FP32 -> BF16 keeps mode 'none', but a bucket's kernel call takes one dtype."""
    opt, w, a, b = _optimizer(master_weights=False)
    a.data = a.data.bfloat16()
    a.grad = torch.ones_like(a)
    snap = snapshot(opt)
    with pytest.raises(TypeError, match=r"'a' is torch.bfloat16 but was torch.float32 when the optimizer bucketed it"):
        opt.step()
    assert_unchanged(opt, snap)


# ---------------------------------------------------------------------------
# 4 (update_param half). non-finite values
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_update_param_refuses_non_finite_values_unless_allowed(bad, dtype):
    opt, w, a, b = _optimizer(dtype)
    values = torch.randn(10, 4)
    values[3, 1] = bad
    snap = snapshot(opt)
    with pytest.raises(ValueError, match=r"update_param: the values for param group 1 \(adamw\), param 1 'b' hold "
                                         r"NaN or inf.*allow_nonfinite=True"):
        opt.update_param(b, values)
    assert_unchanged(opt, snap)
    opt.update_param(b, values, allow_nonfinite=True)
    master = opt.get_full_parameter_master(b)
    assert torch.equal(master.isnan(), values.isnan()) and torch.equal(master.isinf(), values.isinf())
    finite = values.isfinite()
    assert torch.equal(master[finite], values[finite])


def test_update_param_takes_allow_nonfinite_by_keyword_only():
    opt, w, a, b = _optimizer()
    with pytest.raises(TypeError):
        opt.update_param(b, torch.zeros(10, 4), True)


# ---------------------------------------------------------------------------
# 5. ops: a list entry that is not a tensor is named
# ---------------------------------------------------------------------------


class _Passthrough(torch.utils._python_dispatch.TorchDispatchMode):
    """Makes ops.* call torch.ops.muon_ext.* instead of the pybind fast entry."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _op_calls():
    """op: (lists by argument name, call(lists, **extra))."""
    from support.muon_helpers import stat_shape

    def adamw():
        ps = [torch.randn(4) for _ in range(3)]
        lists = dict(params=ps, grads=[torch.randn(4) for _ in ps], exp_avgs=[torch.zeros(4) for _ in ps],
                     exp_avg_sqs=[torch.zeros(4) for _ in ps], steps=[torch.zeros(()) for _ in ps],
                     masters=[])
        return lists, lambda l, **kw: ops.adamw_step(l["params"], l["grads"], l["exp_avgs"], l["exp_avg_sqs"],
                                                      l["steps"], masters=l["masters"], lr=1e-3, **kw)

    def muon():
        ps = [torch.randn(6, 4) for _ in range(3)]
        lists = dict(params=ps, grads=[torch.randn(6, 4) for _ in ps], momentum_buffers=[torch.zeros(6, 4) for _ in ps],
                     second_momentum_buffers=[torch.zeros(stat_shape((6, 4))) for _ in ps])
        return lists, lambda l, **kw: ops.muon_step(l["params"], l["grads"], l["momentum_buffers"],
                                                     l["second_momentum_buffers"], lr=0.02, **kw)

    def momentum():
        lists = dict(grads=[torch.randn(5) for _ in range(3)], momentum_buffers=[torch.zeros(5) for _ in range(3)],
                     updates=[torch.zeros(5) for _ in range(3)])
        return lists, lambda l, **kw: ops.muon_momentum(l["grads"], l["momentum_buffers"], l["updates"], **kw)

    def orthogonalize():
        lists = dict(updates=[torch.randn(6, 4) for _ in range(3)],
                     second_momentum_buffers=[torch.zeros(stat_shape((6, 4))) for _ in range(3)])
        return lists, lambda l, **kw: ops.muon_orthogonalize(l["updates"], l["second_momentum_buffers"], **kw)

    def apply():
        lists = dict(params=[torch.randn(6, 4) for _ in range(3)], updates=[torch.randn(6, 4) for _ in range(3)])
        return lists, lambda l, **kw: ops.muon_apply(l["params"], l["updates"], lr=0.02, matrix_shape=(6, 4), **kw)

    return {"adamw_step": adamw, "muon_step": muon, "muon_momentum": momentum,
            "muon_orthogonalize": orthogonalize, "muon_apply": apply}


def _entry_cases():
    cases = []
    for op, make in _op_calls().items():
        for name in make()[0]:
            if name == "masters":
                continue
            for index in (0, 2):
                for bad in (None, 1.5):
                    cases.append((op, name, index, bad))
    return cases


@pytest.mark.parametrize("via", ["pybind", "torch.ops"])
@pytest.mark.parametrize("op,name,index,bad", _entry_cases())
def test_ops_name_a_list_entry_that_is_not_a_tensor(op, name, index, bad, via):
    lists, call = _op_calls()[op]()
    watched = [t for ts in lists.values() for t in ts]
    before = [t.clone() for t in watched]
    lists[name][index] = bad
    with pytest.raises(TypeError) as error:
        if via == "torch.ops":
            with _Passthrough():
                call(lists)
        else:
            call(lists)
    assert str(error.value) == f"{op}: {name}[{index}] must be a tensor, got {type(bad).__name__}"
    for t, b in zip(watched, before):
        assert torch.equal(t, b)


@pytest.mark.parametrize("op", ["adamw_step", "muon_step", "muon_momentum"])
def test_ops_name_a_scaler_input_that_is_not_a_tensor(op):
    lists, call = _op_calls()[op]()
    with pytest.raises(TypeError, match=re.escape(f"{op}: inv_scale must be a tensor or None, got float")):
        call(lists, inv_scale=0.5)


def test_the_op_checks_still_raise_their_own_type_errors():
    lists, call = _op_calls()["adamw_step"]()
    lists["grads"][2] = lists["grads"][2].double()
    with pytest.raises(TypeError, match=re.escape("adamw_step: grads[2] has dtype Double")):
        call(lists)


def test_remainder_ops_name_an_argument_that_is_not_a_tensor():
    with pytest.raises(TypeError, match="split_master: master must be a tensor, got NoneType"):
        ops.split_master(None)
    with pytest.raises(TypeError, match="merge_master: remainder must be a tensor, got list"):
        ops.merge_master(torch.zeros(3, dtype=torch.bfloat16), [0, 0, 0])


def test_a_tensor_given_for_a_list_is_refused():
    with pytest.raises(TypeError, match="adamw_step: params must be a sequence of tensors, got a tensor"):
        ops.adamw_step(torch.zeros(3, 4), [torch.zeros(4)] * 3, [torch.zeros(4)] * 3, [torch.zeros(4)] * 3,
                       [torch.zeros(())] * 3, lr=1e-3)
