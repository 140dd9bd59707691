"""Bad input to the Muon kernel raises a clear error and changes nothing.

Corruptions sit at the last list index where possible, so a lazily validating
kernel would already have written the first matrices.
"""

import re

import pytest
import torch

from support.helpers import assert_unchanged, snapshot
from muon_ext import ops
from support.muon_helpers import make_muon_grads, make_muon_set

SHAPES = [(6, 10)] * 3


def _last(lst, t):
    return lst[:-1] + [t]


def _replace(field, make):
    """A case that replaces one positional list (0 params, 1 grads, 2 moms, 3 smbs) or keyword."""
    def build(s, grads, kwargs):
        args = list(s.args(grads))
        if isinstance(field, int):
            args[field] = make(args[field], s)
        else:
            kwargs = dict(kwargs, **{field: make(kwargs.get(field), s)})
        return args, kwargs
    return build


CASES = {
    "grads shorter": (_replace(1, lambda g, s: g[:-1]), ValueError, "grads has 2 entries but params has 3"),
    "momentum missing": (_replace(2, lambda m, s: m[:-1]), ValueError, "momentum_buffers has 2 entries"),
    "second moments with beta2 None": (lambda s, g, kw: (list(s.args(g)), dict(kw, beta2=None)), ValueError,
                                       "be empty when beta2 is None"),
    "second moments missing": (_replace(3, lambda v, s: []), ValueError, "one entry per param when beta2 is set"),
    "masters shorter": (_replace("masters", lambda m, s: s.masters[:-1]), ValueError, "masters must be empty or"),
    "param 1-D": (_replace(0, lambda p, s: [t.reshape(-1) for t in p]), ValueError,
                  "params[0] must have at least 2 dimensions"),
    "zero-sized matrix": (lambda s, g, kw: ([[torch.zeros(0, 5, dtype=torch.bfloat16)], [torch.zeros(0, 5)],
                                              [torch.zeros(0, 5)], [torch.zeros(0, 1)]], dict(kw, masters=[])),
                          ValueError, "zero-sized matrices"),
    "param shape differs": (_replace(0, lambda p, s: _last(p, torch.zeros(6, 11, dtype=p[0].dtype))), ValueError,
                            "params[2] has shape [6, 11] but the bucket's matrices are 6x10"),
    "grad dtype mixed": (_replace(1, lambda g, s: _last(g, g[-1].half())), TypeError, "grads[2] has dtype"),
    "grad shape": (_replace(1, lambda g, s: _last(g, g[-1].t().contiguous())), ValueError, "grads[2] has shape"),
    "grad non-contiguous": (_replace(1, lambda g, s: _last(g, torch.zeros(10, 6).t())), ValueError,
                            "grads[2] must be contiguous"),
    "momentum bf16": (_replace(2, lambda m, s: _last(m, m[-1].bfloat16())), TypeError,
                      "momentum_buffers[2] has dtype"),
    "second moment full shape": (_replace(3, lambda v, s: _last(v, torch.zeros(6, 10))), ValueError,
                                 "second_momentum_buffers[2] has shape [6, 10], expected [1, 10]"),
    "master dtype mixed": (_replace("masters", lambda m, s: _last(s.masters, s.masters[-1].float())), TypeError,
                           "masters[2] has dtype"),
    "param shares storage": (_replace(0, lambda p, s: _last(p, p[0])), ValueError, "shares its storage"),
    "momentum shared": (_replace(2, lambda m, s: _last(m, m[0])), ValueError,
                        "momentum_buffers[2] shares its storage with momentum_buffers[0]"),
    "second moments shared": (_replace(3, lambda v, s: _last(v, v[0])), ValueError,
                              "second_momentum_buffers[2] shares its storage with second_momentum_buffers[0]"),
    "ns_steps above coefficients": (_replace("ns_steps", lambda v, s: 6), ValueError,
                                    "ns_steps=6 but only 5 coefficient tuples"),
    "ns_steps negative": (_replace("ns_steps", lambda v, s: -1), ValueError, "ns_steps must be >= 0"),
    "coefficient pair": (lambda s, g, kw: (list(s.args(g)), dict(kw, ns_steps=1, ns_coefficients=[(1.0, 2.0)])),
                         ValueError, "must be an (a, b, c) triple"),
    "coefficient nan": (lambda s, g, kw: (list(s.args(g)), dict(kw, ns_steps=1,
                                                                ns_coefficients=[(1.0, float("nan"), 0.0)])),
                        ValueError, "must be finite"),
    "lr_scale unknown": (_replace("lr_scale", lambda v, s: "spectral"), ValueError, "lr_scale must be"),
    "momentum one": (_replace("momentum", lambda v, s: 1.0), ValueError, "momentum must be in [0, 1)"),
    "beta2 one": (_replace("beta2", lambda v, s: 1.0), ValueError, "beta2 must be in [0, 1) or None"),
    "weight_decay negative": (_replace("weight_decay", lambda v, s: -0.1), ValueError, "weight_decay must be >= 0"),
    "lr negative": (_replace("lr", lambda v, s: -1.0), ValueError, "lr must be >= 0"),
    "lr tensor negative": (_replace("lr", lambda v, s: torch.tensor(-1.0)), ValueError, "lr must be >= 0"),
    "workspace zero": (_replace("max_workspace_bytes", lambda v, s: 0), ValueError,
                       "max_workspace_bytes must be positive"),
    "row blocks zero": (_replace("polar_row_blocks", lambda v, s: 0), ValueError,
                        "polar_row_blocks must be in [1, 64] or None"),
    "row blocks above 64": (_replace("polar_row_blocks", lambda v, s: 65), ValueError,
                            "polar_row_blocks must be in [1, 64] or None"),
    "row blocks bool": (_replace("polar_row_blocks", lambda v, s: True), TypeError,
                        "polar_row_blocks must be an int or None"),
    "row blocks float": (_replace("polar_row_blocks", lambda v, s: 2.0), TypeError,
                         "polar_row_blocks must be an int or None"),
    "found_inf int": (_replace("found_inf", lambda v, s: torch.zeros(1, dtype=torch.int32)), TypeError,
                      "found_inf must be float32"),
    "inv_scale two elements": (_replace("inv_scale", lambda v, s: torch.ones(2)), ValueError,
                               "inv_scale must hold one element"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_raises_and_changes_nothing(name):
    build, exc, fragment = CASES[name]
    s = make_muon_set(SHAPES, "bf16_remainder")
    grads = make_muon_grads(SHAPES)
    args, kwargs = build(s, grads, dict(masters=s.masters, lr=0.02))
    watched = s.tensors() + grads
    before = snapshot(watched)
    with pytest.raises(exc, match=re.escape(fragment)):
        ops.muon_step(*args, **kwargs)
    assert_unchanged(watched, before)
