"""The kernels as torch.library custom ops: schemas, fake/meta kernels,
torch.compile and the profiler (docs/design.md, "Ops (torch.library)")."""

import logging
import warnings

import pytest
import torch

import muon_ext
from support.helpers import make_grads, make_set
from muon_ext import ops
from support.muon_helpers import make_muon_grads, make_muon_set

OPS = ["adamw_step", "muon_step", "muon_momentum", "muon_orthogonalize", "muon_apply", "split_master",
       "merge_master"]


def _op(name):
    return getattr(torch.ops.muon_ext, name).default


def _opcheck_cases():
    """(op name, args, kwargs) with small CPU tensors, one or more per op."""
    s = make_set([7, (3, 4)], "bf16_remainder")
    yield "adamw_step", (s.params, make_grads([7, (3, 4)]), s.exp_avgs, s.exp_avg_sqs, s.masters, s.steps), dict(
        lr=1e-3, lr_tensor=None, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, adam_w_mode=True,
        bias_correction=True, inv_scale=torch.tensor([0.5]), found_inf=None)
    m = make_muon_set([(6, 10), (6, 10)], "bf16_remainder")
    flat = [v for abc in ops.POLAR_EXPRESS_COEFFICIENTS for v in abc]
    yield "muon_step", (m.params, make_muon_grads([(6, 10)] * 2), m.momentum_buffers, m.second_momentum_buffers,
                        m.masters), dict(lr=0.02, lr_tensor=torch.tensor(0.01), momentum=0.95, nesterov=True,
                                         beta2=0.95, weight_decay=0.1, ns_steps=5, ns_coefficients=flat,
                                         lr_scale="original", inv_scale=None, found_inf=torch.zeros(1),
                                         max_workspace_bytes=1 << 20, polar_row_blocks=None, polar_dtype="bfloat16")
    updates = [torch.randn(6, 10), torch.randn(6, 10)]
    yield "muon_momentum", (make_muon_grads([(6, 10)] * 2), [torch.zeros(6, 10) for _ in range(2)], updates), dict(
        momentum=0.9, nesterov=True, inv_scale=None, found_inf=None)
    yield "muon_orthogonalize", ([u.clone() for u in updates], [torch.zeros(1, 10) for _ in range(2)]), dict(
        beta2=0.95, ns_steps=5, ns_coefficients=flat, max_workspace_bytes=1 << 20, polar_row_blocks=2,
        polar_dtype="float32", found_inf=None)
    yield "muon_apply", (m.params, updates, m.masters), dict(lr=0.02, lr_tensor=None, weight_decay=0.1,
                                                             lr_scale="original", rows=6, cols=10, found_inf=None)
    master = torch.randn(5, 3)
    yield "split_master", (master, torch.empty(5, 3, dtype=torch.bfloat16), torch.empty(5, 3, dtype=torch.int16)), {}
    param, rem = ops.split_master(master)
    yield "merge_master", (param, rem, torch.empty(5, 3)), {}


@pytest.mark.parametrize("case", list(_opcheck_cases()), ids=lambda c: c[0])
def test_opcheck(case):
    """Schema (mutations declared), fake/meta kernel, autograd registration and
    AOT dispatch, by torch's own checker."""
    name, args, kwargs = case
    torch.library.opcheck(_op(name), args, kwargs)


def test_every_op_has_a_schema_marking_its_writes():
    mutated = {
        "adamw_step": {"params", "exp_avgs", "exp_avg_sqs", "masters", "steps"},
        "muon_step": {"params", "momentum_buffers", "second_momentum_buffers", "masters"},
        "muon_momentum": {"momentum_buffers", "updates"},
        "muon_orthogonalize": {"updates", "second_momentum_buffers"},
        "muon_apply": {"params", "masters"},
        "split_master": {"param", "remainder"},
        "merge_master": {"master"},
    }
    assert set(mutated) == set(OPS)
    for name in OPS:
        schema = _op(name)._schema
        written = {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write}
        assert written == mutated[name], name
        assert not schema.returns, name


def test_meta_tensors_are_checked_not_computed():
    """The Meta kernel runs the argument checks (so traces fail where eager
    calls would) and writes nothing."""
    s = make_set([4, 4], "fp32", device="cpu")
    meta = lambda ts: [t.to("meta") for t in ts]  # noqa: E731
    ops.adamw_step(meta(s.params), meta(make_grads([4, 4])), meta(s.exp_avgs), meta(s.exp_avg_sqs),
                   meta(s.steps), lr=1e-3)
    with pytest.raises(ValueError, match=r"grads\[1\] has shape"):
        ops.adamw_step(meta(s.params), meta(make_grads([4, 5])), meta(s.exp_avgs), meta(s.exp_avg_sqs),
                       meta(s.steps), lr=1e-3)


class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(32, 16)
        self.hidden = torch.nn.Linear(16, 24)
        self.out = torch.nn.Linear(24, 32)

    def forward(self, tokens):
        return self.out(torch.relu(self.hidden(self.embed(tokens))))


def _train(compile_step: str, steps=3, dtype=torch.bfloat16):
    model = _Model().to(dtype)
    opt = muon_ext.MuonAdamW(muon_ext.param_groups(model, lr=0.02, adamw_lr=1e-3))
    tokens = torch.randint(0, 32, (4, 8), generator=torch.Generator().manual_seed(1))

    def train_step():
        loss = torch.nn.functional.cross_entropy(model(tokens).float().flatten(0, 1), tokens.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    if compile_step == "whole":
        train_step = torch.compile(train_step)
    elif compile_step == "step":
        opt.step = torch.compile(opt.step)
    for _ in range(steps):
        train_step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.slow
@pytest.mark.parametrize("compile_step", ["whole", "step"])
def test_compiled_training_step_gives_eager_params(compile_step, caplog):
    """torch.compile of forward + backward + opt.step() (and of opt.step alone)
    leaves the same params as eager, and Dynamo never reports an untraceable
    call into the extension."""
    torch._dynamo.reset()
    eager = _train("none")
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.WARNING):
        warnings.simplefilter("always")
        compiled = _train(compile_step)
    for i, (a, b) in enumerate(zip(eager, compiled)):
        torch.testing.assert_close(b, a, rtol=0, atol=0, msg=f"param {i}")
    messages = [str(w.message) for w in caught] + [r.getMessage() for r in caplog.records]
    assert not [m for m in messages if "muon_ext" in m or "_C" in m], messages


def test_ops_appear_under_their_names_in_the_profiler():
    model = _Model().to(torch.bfloat16)
    opt = muon_ext.MuonAdamW(muon_ext.param_groups(model, lr=0.02, adamw_lr=1e-3))
    model(torch.randint(0, 32, (2, 4))).float().sum().backward()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        opt.step()
    names = {e.name for e in prof.events()}
    assert {"muon_ext::adamw_step", "muon_ext::muon_step"} <= names, sorted(n for n in names if "muon" in n)
