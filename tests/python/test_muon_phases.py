"""Muon in three phases (momentum -> orthogonalize -> apply) against the fused
`ops.muon_step` on the CPU: bit for bit, state included.

The phases exist so that sharded params can run phase 1 and 3 on shards and
phase 2 on whole matrices (docs/design.md, "Muon in three phases"); their
composition must not change a single bit of the single-device result.
"""

import pytest
import torch

from support.helpers import assert_bit_equal, assert_unchanged, snapshot
from muon_ext import ops
from support.muon_helpers import make_muon_grads, make_muon_set

SHAPES = {
    "wide": [(24, 40)] * 2,
    "tall": [(40, 24)] * 3,
    "odd": [(3, 5), (3, 5)],
    "one": [(1, 1)],
    "stacked": [(3, 8, 12), (2, 8, 12)],
    # Sides >= 256 take the block-triangular Polar-Express products, and more
    # than 16384 elements several work items in the input-norm sums.
    "blocked": [(300, 520)],
}
MODES = ["fp32", "bf16_remainder", "bf16_fp32_master", "fp16_fp32_master", "bf16_direct"]


def _phases(s, grads, *, lr, momentum=0.95, nesterov=True, beta2=0.95, weight_decay=0.1, ns_steps=5,
            lr_scale="original", inv_scale=None, found_inf=None, polar_row_blocks=None, lr_tensor=None):
    updates = [torch.empty(p.shape, dtype=torch.float32) for p in s.params]
    ops.muon_momentum(grads, s.momentum_buffers, updates, momentum=momentum, nesterov=nesterov,
                      inv_scale=inv_scale, found_inf=found_inf)
    ops.muon_orthogonalize(updates, s.second_momentum_buffers, beta2=beta2, ns_steps=ns_steps,
                           polar_row_blocks=polar_row_blocks, found_inf=found_inf)
    ops.muon_apply(s.params, updates, masters=s.masters, lr=lr if lr_tensor is None else lr_tensor,
                   weight_decay=weight_decay, lr_scale=lr_scale, found_inf=found_inf)


def _fused(s, grads, *, lr, lr_tensor=None, **hyper):
    ops.muon_step(*s.args(grads), **s.kwargs(), lr=lr if lr_tensor is None else lr_tensor, **hyper)


def _assert_same_state(a, b):
    for name in ("params", "momentum_buffers", "second_momentum_buffers", "masters"):
        for i, (x, y) in enumerate(zip(getattr(a, name), getattr(b, name))):
            assert_bit_equal(x, y, f"{name}[{i}]")


@pytest.mark.parametrize("kind", list(SHAPES))
@pytest.mark.parametrize("mode", MODES)
def test_phases_equal_fused_step_bit_for_bit(kind, mode):
    shapes = SHAPES[kind]
    fused = make_muon_set(shapes, mode)
    phased = fused.clone()
    for k in range(3):
        grads = make_muon_grads(shapes, seed=k)
        _fused(fused, grads, lr=0.02)
        _phases(phased, grads, lr=0.02)
    _assert_same_state(fused, phased)


@pytest.mark.parametrize("setting", [
    dict(beta2=None), dict(nesterov=False), dict(lr_scale="match_rms_adamw"), dict(lr_scale="none"),
    dict(momentum=0.0, weight_decay=0.0), dict(ns_steps=0), dict(ns_steps=2), dict(polar_row_blocks=3),
    dict(inv_scale=torch.tensor([0.25])), dict(lr_tensor=torch.tensor(0.03)),
    dict(grad_dtype=torch.bfloat16), dict(grad_dtype=torch.float16),
])
def test_phases_equal_fused_step_for_every_setting(setting):
    setting = dict(setting)
    grad_dtype = setting.pop("grad_dtype", torch.float32)
    shapes = [(20, 36), (20, 36)]
    normuon = setting.get("beta2", 0.95) is not None
    fused = make_muon_set(shapes, "bf16_remainder", normuon=normuon)
    phased = fused.clone()
    for k in range(2):
        grads = make_muon_grads(shapes, grad_dtype, seed=k)
        _fused(fused, grads, lr=0.02, **setting)
        _phases(phased, grads, lr=0.02, **setting)
    _assert_same_state(fused, phased)


def test_found_inf_leaves_every_phase_a_no_op():
    shapes = [(12, 20)]
    s = make_muon_set(shapes, "bf16_remainder")
    grads = make_muon_grads(shapes)
    updates = [torch.randn(shapes[0])]
    watched = s.tensors() + updates
    before = snapshot(watched)
    _phases(s, grads, lr=0.02, found_inf=torch.ones(1))
    ops.muon_orthogonalize(updates, s.second_momentum_buffers, found_inf=torch.ones(1))
    assert_unchanged(watched, before)


def test_elementwise_phases_work_on_shards():
    """Phases 1 and 3 are elementwise: applied to row blocks of a matrix (as
    FSDP2 shards it, the last one empty) they give the whole matrix's bits."""
    shape = (10, 16)
    whole = make_muon_set([shape], "bf16_remainder", normuon=False)
    sharded = whole.clone()
    grads = make_muon_grads([shape])
    updates = [torch.empty(shape)]
    ops.muon_momentum(grads, whole.momentum_buffers, updates)
    ops.muon_orthogonalize(updates, beta2=None)
    ops.muon_apply(whole.params, updates, masters=whole.masters, lr=0.02)

    bounds = [(0, 4), (4, 8), (8, 10), (10, 10)]
    shard = lambda t, b: t[b[0]:b[1]]  # noqa: E731  (row blocks of a contiguous matrix are contiguous)
    shard_updates = [torch.empty(shard(updates[0], b).shape) for b in bounds]
    ops.muon_momentum([shard(grads[0], b) for b in bounds], [shard(sharded.momentum_buffers[0], b) for b in bounds],
                      shard_updates)
    full = torch.cat(shard_updates)
    ops.muon_orthogonalize([full], beta2=None)
    ops.muon_apply([shard(sharded.params[0], b) for b in bounds], list(full.split([b[1] - b[0] for b in bounds])),
                   masters=[shard(sharded.masters[0], b) for b in bounds], lr=0.02, matrix_shape=shape)
    _assert_same_state(whole, sharded)


@pytest.mark.parametrize("call, fragment", [
    (lambda: ops.muon_momentum([torch.zeros(3)], [torch.zeros(3)], [torch.zeros(3, dtype=torch.float64)]),
     "updates[0] has dtype Double"),
    (lambda: ops.muon_momentum([torch.zeros(3)], [torch.zeros(4)], [torch.zeros(3)]),
     "momentum_buffers[0] has shape [4], expected [3]"),
    (lambda: ops.muon_momentum([torch.zeros(3)], [], [torch.zeros(3)]),
     "momentum_buffers has 0 entries but updates has 1"),
    (lambda: ops.muon_momentum([torch.zeros(3)], [torch.zeros(3)], [torch.zeros(3)], momentum=1.0),
     "momentum must be in [0, 1)"),
    (lambda: ops.muon_orthogonalize([torch.zeros(4, 6), torch.zeros(4, 7)], beta2=None),
     "updates[1] has shape [4, 7] but the bucket's matrices are 4x6"),
    (lambda: ops.muon_orthogonalize([torch.zeros(4, 6)], [torch.zeros(4, 1)]),
     "second_momentum_buffers[0] has shape [4, 1], expected [1, 6]"),
    (lambda: ops.muon_orthogonalize([torch.zeros(4, 6)], [torch.zeros(1, 6)], beta2=None),
     "be empty when beta2 is None"),
    (lambda: ops.muon_apply([torch.zeros(3)], [torch.zeros(3)], lr=0.1),
     "params[0] is not a matrix; pass matrix_shape"),
    (lambda: ops.muon_apply([torch.zeros(2, 3)], [torch.zeros(2, 3)], lr=0.1, lr_scale="spectral"),
     "lr_scale must be"),
    (lambda: ops.muon_apply([torch.zeros(2, 3, dtype=torch.bfloat16)], [torch.zeros(2, 3)],
                            masters=[torch.zeros(2, 3, dtype=torch.int16)], lr=-1.0),
     "lr must be >= 0"),
    (lambda: ops.muon_apply([torch.zeros(2, 3)], [torch.zeros(2, 3, dtype=torch.bfloat16)], lr=0.1),
     "updates[0] has dtype"),
])
def test_phase_checks_name_the_argument(call, fragment):
    with pytest.raises((TypeError, ValueError), match=__import__("re").escape(fragment)):
        call()


def test_momentum_and_updates_must_be_distinct_buffers():
    m = torch.zeros(3, 4)
    with pytest.raises(ValueError, match=r"momentum_buffers\[0\] and updates\[0\] are the same tensor"):
        ops.muon_momentum([torch.ones(3, 4)], [m], [m])
    assert torch.equal(m, torch.zeros(3, 4))
