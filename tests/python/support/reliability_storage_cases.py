"""Cases for tensors whose storage no longer holds their elements (released
with untyped_storage().resize_(0), or shrunk under a view). Without the checks
the extension reads and writes such tensors out of bounds and the process may
die, so test_reliability_checks.py runs these cases in a child process:
`python -m support.reliability_storage_cases` (from tests/python) prints one JSON line per case.

Every case expects a named error, and every tensor that can still be read
bit-identical afterwards (the released ones still released).
"""

from __future__ import annotations

import json
import sys
import traceback

import torch

from support.helpers import bits, optimizer_tensors
from muon_ext import MuonAdamW, ops
from support.muon_helpers import stat_shape

P = torch.nn.Parameter
MODES = {"bf16_remainder": (torch.bfloat16, {}), "bf16_fp32_master": (torch.bfloat16, dict(store_param_remainders=False)),
         "fp32": (torch.float32, {})}


def release(t: torch.Tensor) -> None:
    t.untyped_storage().resize_(0)


def shrink(t: torch.Tensor) -> None:
    """Leaves the storage holding half of the tensor."""
    t.untyped_storage().resize_(t.untyped_storage().nbytes() // 2)


def readable(tensors: dict) -> dict:
    """Bits of every tensor whose storage holds it; the size of the others' storage."""
    return {k: bits(t).clone() if not ops.storage_problem(t) else t.untyped_storage().nbytes()
            for k, t in tensors.items()}


def assert_same(before: dict, after: dict) -> None:
    assert before.keys() == after.keys(), (sorted(before), sorted(after))
    for key, value in before.items():
        now = after[key]
        same = torch.equal(value, now) if isinstance(value, torch.Tensor) and isinstance(now, torch.Tensor) else (
            value == now)
        assert same, f"{key} changed"


def expect(exc, fragments, fn) -> None:
    try:
        fn()
    except exc as error:
        for fragment in [fragments] if isinstance(fragments, str) else fragments:
            assert fragment in str(error), f"{fragment!r} not in {type(error).__name__}: {error}"
        return
    raise AssertionError(f"no {exc.__name__} raised")


# ---------------------------------------------------------------------------
# the optimizer
# ---------------------------------------------------------------------------


def optimizer(mode="bf16_remainder", **kwargs):
    """AdamW 'a' (written first), Muon 'w', AdamW 'b'; stepped once, with fresh grads."""
    dtype, options = MODES[mode]
    gen = torch.Generator().manual_seed(0)
    a, w, b = (P(torch.randn(s, generator=gen).to(dtype)) for s in ((8,), (16, 12), (6,)))
    opt = MuonAdamW([{"params": [a], "kind": "adamw", "lr": 0.1, "param_names": ["a"]},
                     {"params": [w], "kind": "muon", "lr": 0.1, "param_names": ["w"]},
                     {"params": [b], "kind": "adamw", "lr": 0.1, "param_names": ["b"]}], **options, **kwargs)
    for _ in range(2):
        for p in (a, w, b):
            p.grad = torch.randn(p.shape, generator=gen).to(dtype)
        opt.step()
    return opt, a, w, b


def refused_step(opt, fragments, extra=None):
    tensors = dict(optimizer_tensors(opt), **(extra or {}))
    before = readable(tensors)
    expect(ValueError, fragments, opt.step)
    assert_same(before, readable(tensors))


def step_cases():
    cases = {}
    for mode in MODES:
        def param(mode=mode):
            opt, a, w, b = optimizer(mode)
            release(w)
            refused_step(opt, ["param group 1 (muon), param 0 'w'", "its storage holds 0 bytes"])

        def adamw_param(mode=mode):
            opt, a, w, b = optimizer(mode)
            release(b)
            refused_step(opt, ["param group 2 (adamw), param 0 'b'", "its storage holds 0 bytes"])

        cases[f"step: released Muon param ({mode})"] = param
        cases[f"step: released AdamW param ({mode})"] = adamw_param

    def shrunk_param():
        opt, a, w, b = optimizer()
        shrink(w)
        refused_step(opt, ["'w'", "its storage holds 192 bytes", "needs 384"])

    def view_of_shrunk_base():
        opt, a, w, b = optimizer()
        base = torch.zeros(100, dtype=w.dtype)
        b.data = base[90:96]  # a view at storage offset 90
        base.untyped_storage().resize_(95 * 2)
        refused_step(opt, ["'b'", "storage offset 90", "needs 192"])

    def grad(attr="grad"):
        def run():
            opt, a, w, b = optimizer()
            g = torch.randn(12, 16).bfloat16().t()  # not contiguous: its reach is checked through its strides
            w.grad = g
            release(g)
            refused_step(opt, ["'w': grad: its storage holds 0 bytes"])
        return run

    def state(key, param="b", mode="bf16_remainder", how=release):
        def run():
            opt, a, w, b = optimizer(mode)
            how(opt.state[{"w": w, "b": b}[param]][key])
            refused_step(opt, [f"'{param}': optimizer state '{key}': its storage holds"])
        return run

    def state_replaced_by_a_small_view():
        opt, a, w, b = optimizer()
        small = torch.zeros(10)
        opt.state[b]["exp_avg"] = small[2:8]
        small.untyped_storage().resize_(16)
        refused_step(opt, ["'b': optimizer state 'exp_avg': its storage holds 16 bytes"])

    def lr_tensor():
        opt, a, w, b = optimizer()
        lr = torch.tensor(0.1)
        opt.param_groups[2]["lr"] = lr
        release(lr)
        refused_step(opt, ["param group 2: lr: its storage holds 0 bytes"], {"lr": lr})

    cases.update({
        "step: shrunk param": shrunk_param,
        "step: param viewing a shrunk base": view_of_shrunk_base,
        "step: released non-contiguous grad": grad(),
        "step: released exp_avg": state("exp_avg"),
        "step: released exp_avg_sq": state("exp_avg_sq"),
        "step: released step counter": state("step"),
        "step: released remainders": state("master_param"),
        "step: released FP32 master": state("master_param", mode="bf16_fp32_master"),
        "step: released momentum": state("momentum_buffer", "w"),
        "step: released second moments": state("second_momentum_buffer", "w"),
        "step: shrunk momentum": state("momentum_buffer", "w", how=shrink),
        "step: state replaced by a view of a small storage": state_replaced_by_a_small_view,
        "step: released lr tensor": lr_tensor,
    })
    return cases


def other_entry_cases():
    cases = {}

    def refused(opt, fn, fragments, exc=ValueError, extra=None):
        tensors = dict(optimizer_tensors(opt), **(extra or {}))
        groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
        before = readable(tensors)
        expect(exc, fragments, fn)
        assert_same(before, readable(tensors))
        assert groups == [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]

    for mode in MODES:
        def update_param(mode=mode):
            opt, a, w, b = optimizer(mode)
            release(w)
            refused(opt, lambda: opt.update_param(w, torch.zeros(16, 12)), ["'w'", "its storage holds 0 bytes"])

        def full_master(mode=mode):
            opt, a, w, b = optimizer(mode)
            release(b)
            refused(opt, lambda: opt.get_full_parameter_master(b), ["'b'", "its storage holds 0 bytes"])

        def state_dict(mode=mode):
            opt, a, w, b = optimizer(mode)
            release(a)
            refused(opt, opt.state_dict, ["'a'", "its storage holds 0 bytes"])

        def load_state_dict(mode=mode):
            opt, a, w, b = optimizer(mode)
            saved = opt.state_dict()
            saved["param_groups"][0]["lr"] = 0.5
            release(w)
            refused(opt, lambda: opt.load_state_dict(saved), ["'w'", "its storage holds 0 bytes"])

        cases[f"update_param: released param ({mode})"] = update_param
        cases[f"get_full_parameter_master: released param ({mode})"] = full_master
        cases[f"state_dict: released param ({mode})"] = state_dict
        cases[f"load_state_dict: released param ({mode})"] = load_state_dict

    def released_values():
        opt, a, w, b = optimizer()
        values = torch.randn(16, 12)
        release(values)
        refused(opt, lambda: opt.update_param(w, values), ["update_param: values for", "its storage holds 0 bytes"])

    def released_master_on_update():
        opt, a, w, b = optimizer()
        release(opt.state[w]["master_param"])
        refused(opt, lambda: opt.update_param(w, torch.zeros(16, 12)), ["'w': optimizer state 'master_param'"])

    def load_released_state():
        opt, a, w, b = optimizer()
        saved = opt.state_dict()
        release(opt.state[b]["exp_avg_sq"])
        refused(opt, lambda: opt.load_state_dict(saved), ["'b': optimizer state 'exp_avg_sq'"])

    cases.update({
        "update_param: released values": released_values,
        "update_param: released remainders": released_master_on_update,
        "load_state_dict: released state": load_released_state,
    })
    return cases


# ---------------------------------------------------------------------------
# the ops
# ---------------------------------------------------------------------------


class _Passthrough(torch.utils._python_dispatch.TorchDispatchMode):
    """Routes ops.* through torch.ops.muon_ext.* (not the pybind fast entry)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _adamw_args():
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(s, generator=gen).bfloat16() for s in (5, 7, (3, 4))]
    lists = dict(params=params, grads=[torch.randn(p.shape, generator=gen) for p in params],
                 exp_avgs=[torch.zeros(p.shape) for p in params], exp_avg_sqs=[torch.zeros(p.shape) for p in params],
                 steps=[torch.zeros(()) for _ in params],
                 masters=[torch.zeros(p.shape, dtype=torch.int16) for p in params])
    scalars = dict(lr=torch.tensor(1e-2), inv_scale=torch.ones(1), found_inf=torch.zeros(1))
    return lists, scalars, lambda l, s: ops.adamw_step(l["params"], l["grads"], l["exp_avgs"], l["exp_avg_sqs"],
                                                        l["steps"], masters=l["masters"], **s)


def _muon_args():
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(6, 4, generator=gen).bfloat16() for _ in range(3)]
    lists = dict(params=params, grads=[torch.randn(6, 4, generator=gen) for _ in params],
                 momentum_buffers=[torch.zeros(6, 4) for _ in params],
                 second_momentum_buffers=[torch.zeros(stat_shape((6, 4))) for _ in params],
                 masters=[torch.zeros(6, 4, dtype=torch.int16) for _ in params])
    scalars = dict(lr=torch.tensor(1e-2), inv_scale=torch.ones(1), found_inf=torch.zeros(1))
    return lists, scalars, lambda l, s: ops.muon_step(l["params"], l["grads"], l["momentum_buffers"],
                                                       l["second_momentum_buffers"], masters=l["masters"], **s)


def _momentum_args():
    gen = torch.Generator().manual_seed(0)
    lists = dict(grads=[torch.randn(5, generator=gen) for _ in range(3)], momentum_buffers=[torch.zeros(5) for _ in range(3)],
                 updates=[torch.zeros(5) for _ in range(3)])
    scalars = dict(inv_scale=torch.ones(1), found_inf=torch.zeros(1))
    return lists, scalars, lambda l, s: ops.muon_momentum(l["grads"], l["momentum_buffers"], l["updates"], **s)


def _orthogonalize_args():
    gen = torch.Generator().manual_seed(0)
    lists = dict(updates=[torch.randn(6, 4, generator=gen) for _ in range(3)],
                 second_momentum_buffers=[torch.zeros(stat_shape((6, 4))) for _ in range(3)])
    scalars = dict(found_inf=torch.zeros(1))
    return lists, scalars, lambda l, s: ops.muon_orthogonalize(l["updates"], l["second_momentum_buffers"], **s)


def _apply_args():
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(6, 4, generator=gen).bfloat16() for _ in range(3)]
    lists = dict(params=params, updates=[torch.randn(6, 4, generator=gen) for _ in params],
                 masters=[torch.zeros(6, 4, dtype=torch.int16) for _ in params])
    scalars = dict(lr=torch.tensor(1e-2), found_inf=torch.zeros(1))
    return lists, scalars, lambda l, s: ops.muon_apply(l["params"], l["updates"], masters=l["masters"], **s)


OP_ARGS = {"adamw_step": _adamw_args, "muon_step": _muon_args, "muon_momentum": _momentum_args,
           "muon_orthogonalize": _orthogonalize_args, "muon_apply": _apply_args}


def op_cases():
    cases = {}
    for op, make in OP_ARGS.items():
        lists, scalars, _ = make()
        for via in ("pybind", "torch.ops"):
            for name in list(lists) + list(scalars):
                def run(op=op, make=make, name=name, via=via):
                    lists, scalars, call = make()
                    target = lists[name][2] if name in lists else scalars[name]
                    watched = {f"{k}[{i}]": t for k, ts in lists.items() for i, t in enumerate(ts)}
                    watched.update(scalars)
                    before = readable(watched)
                    release(target)
                    where = f"{name}[2]" if name in lists else ("lr" if name == "lr" else name)
                    if via == "torch.ops":
                        with _Passthrough():
                            expect(ValueError, [f"{op}: {where}: its storage holds 0 bytes"],
                                   lambda: call(lists, scalars))
                    else:
                        expect(ValueError, [f"{op}: {where}: its storage holds 0 bytes"], lambda: call(lists, scalars))
                    after = readable(watched)
                    before[f"{name}[2]" if name in lists else name] = 0  # the one released
                    assert_same(before, after)
                cases[f"{op} ({via}): released {name}"] = run

    def shrunk_view():
        lists, scalars, call = _adamw_args()
        base = torch.zeros(40, dtype=torch.bfloat16)
        lists["params"][2] = base[20:32].view(3, 4)
        base.untyped_storage().resize_(50)
        expect(ValueError, ["adamw_step: params[2]: its storage holds 50 bytes", "storage offset 20", "needs 64"],
               lambda: call(lists, scalars))

    def remainder_ops():
        for fn, names in ((lambda m, p, r: ops.split_master(m, p, r), ("master", "param", "remainder")),
                          (lambda m, p, r: ops.merge_master(p, r, m), ("master", "param", "remainder"))):
            for name in names:
                tensors = dict(master=torch.randn(10), param=torch.zeros(10, dtype=torch.bfloat16),
                               remainder=torch.zeros(10, dtype=torch.int16))
                release(tensors[name])
                expect(ValueError, [f": {name}: its storage holds 0 bytes"],
                       lambda: fn(tensors["master"], tensors["param"], tensors["remainder"]))

    def meta_tensors_still_trace():
        lists, scalars, call = _adamw_args()
        call({k: [t.to("meta") for t in v] for k, v in lists.items()}, {k: v.to("meta") for k, v in scalars.items()})

    cases.update({"adamw_step: params[2] viewing a shrunk base": shrunk_view,
                  "split_master / merge_master: released arguments": remainder_ops,
                  "meta tensors pass the storage check": meta_tensors_still_trace})
    return cases


def all_cases() -> dict:
    return {**step_cases(), **other_entry_cases(), **op_cases()}


def main() -> None:
    for name, case in all_cases().items():
        try:
            case()
            result = {"case": name, "ok": True}
        except BaseException:  # noqa: BLE001 - reported to the parent
            result = {"case": name, "ok": False, "error": traceback.format_exc()}
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--list":
        print(json.dumps(list(all_cases())))
    else:
        main()
