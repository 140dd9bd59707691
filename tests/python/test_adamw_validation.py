"""Bad input to the AdamW kernel raises a clear error and changes nothing.

Each case corrupts one argument at the LAST index of a three-tensor list, so a
kernel that validated lazily would already have written the first tensors.
"""

import re

import pytest
import torch

from support.helpers import assert_unchanged, make_grads, make_set, snapshot
from muon_ext import ops

SIZES = [16, 33, (4, 5)]


def _case(mode="bf16_remainder"):
    s = make_set(SIZES, mode)
    grads = make_grads(SIZES)
    kwargs = dict(masters=s.masters, lr=1e-2)
    return s, grads, kwargs


def _last(lst, t):
    return lst[:-1] + [t]


def _corruptions():
    # name -> (mode, function(s, grads, kwargs) -> (args, kwargs), expected exception, message fragment)
    def args(s, grads):
        return [s.params, grads, s.exp_avgs, s.exp_avg_sqs, s.steps]

    def corrupt(index, make_bad, mode="bf16_remainder"):
        def build(s, grads, kwargs):
            a = args(s, grads)
            a[index] = _last(a[index], make_bad(a[index][-1]))
            return a, kwargs
        return mode, build

    def corrupt_kw(key, value, mode="bf16_remainder"):
        def build(s, grads, kwargs):
            return args(s, grads), dict(kwargs, **{key: value(kwargs, s)})
        return mode, build

    return {
        "masters shorter": (*corrupt_kw("masters", lambda kw, s: s.masters[:-1]), ValueError, "masters must be empty"),
        "params vs grads length": ("fp32", lambda s, g, kw: ([s.params, g[:-1], s.exp_avgs, s.exp_avg_sqs, s.steps], kw),
                                   ValueError, "grads has 2 entries but params has 3"),
        "grad dtype mixed": (*corrupt(1, lambda t: t.half()), TypeError, "grads[2] has dtype"),
        "grad shape": (*corrupt(1, lambda t: t.reshape(-1)), ValueError, "grads[2] has shape"),
        "grad non-contiguous": (*corrupt(1, lambda t: t.t().contiguous().t()), ValueError, "grads[2] must be contiguous"),
        "grad on meta": (*corrupt(1, lambda t: t.to("meta")), ValueError, "grads[2] is on meta"),
        "param non-contiguous": (*corrupt(0, lambda t: t.t().contiguous().t()), ValueError,
                                 "params[2] must be contiguous"),
        "param dtype mixed": (*corrupt(0, lambda t: t.half()), TypeError, "params[2] has dtype"),
        "param float64": ("fp32", lambda s, g, kw: ([[p.double() for p in s.params], g, s.exp_avgs, s.exp_avg_sqs,
                                                    s.steps], kw), TypeError, "params[0] has dtype"),
        "param shares storage": ("fp32", lambda s, g, kw: ([_last(s.params, s.params[0]), _last(g, g[0]),
                                                           _last(s.exp_avgs, s.exp_avgs[0].clone()),
                                                           _last(s.exp_avg_sqs, s.exp_avg_sqs[0].clone()), s.steps],
                                                          kw), ValueError, "params[2] shares its storage with params[0]"),
        "exp_avg overlaps another": ("bf16_remainder", lambda s, g, kw: (
            [s.params, g, _last(s.exp_avgs, s.exp_avgs[1][:20].view(4, 5)), s.exp_avg_sqs, s.steps], kw),
            ValueError, "exp_avgs[2] shares its storage with exp_avgs[1]"),
        "exp_avg_sq is the param": ("fp32", lambda s, g, kw: ([s.params, g, s.exp_avgs,
                                                                _last(s.exp_avg_sqs, s.params[-1]), s.steps], kw),
                                    ValueError, "exp_avg_sqs[2] shares its storage with params[2]"),
        "exp_avg bf16": (*corrupt(2, lambda t: t.bfloat16()), TypeError, "exp_avgs[2] has dtype"),
        "exp_avg_sq shape": (*corrupt(3, lambda t: t.reshape(-1)), ValueError, "exp_avg_sqs[2] has shape"),
        "step int64": (*corrupt(4, lambda t: t.long()), TypeError, "steps[2] must be float32"),
        "step two elements": (*corrupt(4, lambda t: torch.zeros(2)), ValueError, "steps[2] must hold one element"),
        "step shared": ("bf16_remainder", lambda s, g, kw: ([s.params, g, s.exp_avgs, s.exp_avg_sqs,
                                                             _last(s.steps, s.steps[0])], kw),
                        ValueError, "steps[2] is the same tensor as an earlier entry"),
        "master dtype mixed": (*corrupt_kw("masters", lambda kw, s: _last(s.masters, s.masters[-1].float())),
                               TypeError, "masters[2] has dtype"),
        "master shape": (*corrupt_kw("masters", lambda kw, s: _last(s.masters, s.masters[-1].reshape(-1))),
                         ValueError, "masters[2] has shape"),
        "remainder for fp16": ("fp16_fp32_master", lambda s, g, kw: (
            [s.params, g, s.exp_avgs, s.exp_avg_sqs, s.steps],
            dict(kw, masters=[torch.zeros(p.shape, dtype=torch.int16) for p in s.params])),
            TypeError, "need bfloat16 params"),
        "fp32 master for fp32 param": ("fp32", lambda s, g, kw: (
            [s.params, g, s.exp_avgs, s.exp_avg_sqs, s.steps], dict(kw, masters=[p.clone() for p in s.params])),
            TypeError, "their own master"),
        "master float64": (*corrupt_kw("masters", lambda kw, s: [m.double() for m in s.masters]), TypeError,
                           "masters[0] has dtype"),
        "found_inf int": (*corrupt_kw("found_inf", lambda kw, s: torch.zeros(1, dtype=torch.int32)), TypeError,
                          "found_inf must be float32"),
        "inv_scale two elements": (*corrupt_kw("inv_scale", lambda kw, s: torch.ones(2)), ValueError,
                                   "inv_scale must hold one element"),
        "lr tensor float64": (*corrupt_kw("lr", lambda kw, s: torch.tensor(1e-3, dtype=torch.float64)), TypeError,
                              "lr must be float32"),
        "lr negative": (*corrupt_kw("lr", lambda kw, s: -1e-3), ValueError, "lr must be >= 0"),
        "lr tensor negative": (*corrupt_kw("lr", lambda kw, s: torch.tensor(-1e-3)), ValueError, "lr must be >= 0"),
        "lr nan": (*corrupt_kw("lr", lambda kw, s: float("nan")), ValueError, "lr must be >= 0"),
        "beta1 one": (*corrupt_kw("beta1", lambda kw, s: 1.0), ValueError, "beta1 must be in [0, 1)"),
        "beta2 negative": (*corrupt_kw("beta2", lambda kw, s: -0.1), ValueError, "beta2 must be in [0, 1)"),
        "eps negative": (*corrupt_kw("eps", lambda kw, s: -1e-8), ValueError, "eps must be >= 0"),
        "weight_decay negative": (*corrupt_kw("weight_decay", lambda kw, s: -0.1), ValueError,
                                  "weight_decay must be >= 0"),
    }


CASES = _corruptions()


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_raises_and_changes_nothing(name):
    mode, build, exc, fragment = CASES[name]
    s, grads, kwargs = _case(mode)
    kwargs = dict(kwargs, masters=s.masters)
    args, kwargs = build(s, grads, kwargs)
    watched = s.tensors() + [g for g in grads]
    before = snapshot(watched)
    with pytest.raises(exc, match=re.escape(fragment)):
        ops.adamw_step(*args, **kwargs)
    assert_unchanged(watched, before)


def test_cuda_params_without_cuda_kernels_raise():
    import muon_ext

    if muon_ext.with_cuda or not torch.cuda.is_available():
        pytest.skip("only meaningful for a CPU-only build on a CUDA machine")
    s = make_set([4], "fp32", device="cuda")
    with pytest.raises(ValueError, match="no CUDA kernels"):
        ops.adamw_step(*s.args(make_grads([4], device="cuda")), lr=1e-3)
