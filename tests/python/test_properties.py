"""Random differential tests (hypothesis) of the kernels and of MuonAdamW
against `muon_ext.reference`, on the CPU.

Random shapes (1 element, odd, tall and wide, stacked [E, rows, cols] for
Muon, vectors crossing the AdamW kernel's 512-element blocks and
16384-element ranges), every master mode, every grad dtype, settings drawn
from the ranges of `muon_ext.schema.RANGES` (the C++ table the kernels check
against), GradScaler inputs, random starting state and several steps.

What is asserted is what the example-based tests established, with their
measured bounds:
  * AdamW against the reference: bit for bit (test_adamw.py).
  * The three Muon phases against the fused op, a stacked param against a
    bucket of its matrices: bit for bit (test_muon_phases.py, test_muon.py).
  * A matrix's Muon bits do not depend on its chunk or its address
    (docs/design.md).
  * The FP32 master trajectory: bit-identical across master modes, AdamW and
    Muon (test_adamw.py, test_muon.py).
  * Muon against the reference: momentum bit for bit; the rest within the
    measured tolerances of test_muon.py and test_optimizer_equivalence.py,
    cited where used.

Profiles (tests/python/conftest.py): "ci" (default) runs a fixed, small set of
examples; HYPOTHESIS_PROFILE=thorough runs many random ones.
"""

from __future__ import annotations

import math
from typing import List, Optional

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from support.helpers import MASTER_MODES, AdamWSet, assert_bit_equal, fp32_master
from muon_ext import MuonAdamW, ops, reference
from muon_ext.schema import MODES, RANGES
from support.muon_helpers import MuonSet, stat_shape

GRAD_DTYPES = PARAM_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
LOW_PRECISION_MANTISSA_BITS = {torch.bfloat16: 7, torch.float16: 10}
MODES_WITH_FP32_MASTER = ["fp32", "bf16_remainder", "bf16_fp32_master", "fp16_fp32_master"]


# ---------------------------------------------------------------------------
# strategies
# ---------------------------------------------------------------------------


def setting(kind: str, name: str, high: Optional[float] = None):
    """Values the schema admits for a real setting, its edges included. `high`
    caps unbounded ranges where larger values only overflow to inf/NaN."""
    r = RANGES[(kind, name)]
    top = r.high if high is None else min(high, r.high)
    open_top = top == r.high and not r.high_inclusive
    below_top = torch.nextafter(torch.tensor(top), torch.tensor(-math.inf)).item()  # the largest float32 below
    edges = [e for e in (r.low, below_top if open_top else top) if r.admits(e)]
    inner = st.floats(r.low, top, exclude_max=open_top, allow_nan=False, allow_infinity=False)
    return st.one_of(st.sampled_from(edges), inner.filter(r.admits))


seeds = st.integers(0, 2**31 - 1)
steps_counts = st.integers(1, 3)
found_infs = st.one_of(st.none(), st.sampled_from([0.0, 1.0]))  # 1.0: the step is skipped
# Powers of two (GradScaler's) unscale exactly; the others round the grads.
inv_scales = st.one_of(st.none(), st.sampled_from([2.0**-16, 2.0**-3, 1.0, 4.0]), st.floats(1e-3, 4.0))


def examples(share: float):
    """A share of the profile's max_examples, for a test parametrized over modes
    (so that each mode gets examples whatever hypothesis draws)."""
    return settings(max_examples=max(4, round(settings.default.max_examples * share)))


def _tensor_or_none(value):
    return None if value is None else torch.tensor([value], dtype=torch.float32)


def _randn(shape, gen, scale=1.0):
    return torch.randn(shape, generator=gen) * scale


def _as_lr(lr, as_tensor):
    return torch.tensor(lr, dtype=torch.float32) if as_tensor else lr


# ---------------------------------------------------------------------------
# AdamW kernel
# ---------------------------------------------------------------------------

adamw_shape = st.one_of(
    st.integers(0, 70).map(lambda n: (n,)),
    # Around the kernel's 512-element blocks (vector body and scalar tail) and
    # its 16384-element parallel ranges.
    st.sampled_from([(511,), (513,), (16383,), (16385,), (40000,)]),
    st.lists(st.integers(1, 9), min_size=2, max_size=3).map(tuple),
    st.just(()),
)


@st.composite
def adamw_hypers(draw):
    return dict(
        lr=draw(setting("adamw", "lr", high=1.0)),
        beta1=draw(setting("adamw", "beta1")),
        beta2=draw(setting("adamw", "beta2")),
        eps=draw(setting("adamw", "eps", high=1.0)),
        weight_decay=draw(setting("adamw", "weight_decay", high=1.0)),
        adam_w_mode=draw(st.booleans()),
        bias_correction=draw(st.booleans()),
    )


def make_adamw_state(shapes, mode, gen, fresh: bool, step0: int) -> AdamWSet:
    """Arbitrary FP32 masters held in `mode` (remainders by the split rule), and
    fresh or random moments and step counters."""
    param_dtype, master_dtype = MASTER_MODES[mode]
    values = [_randn(s, gen) for s in shapes]
    if master_dtype is torch.int16:
        pairs = [reference.split_master(v) for v in values]
        params, masters = [p for p, _ in pairs], [r for _, r in pairs]
    else:
        params = [v.to(param_dtype) for v in values]
        masters = [v.clone() for v in values] if master_dtype is torch.float32 else []
    if fresh:
        exp_avgs = [torch.zeros(s) for s in shapes]
        exp_avg_sqs = [torch.zeros(s) for s in shapes]
        steps = [torch.zeros(()) for _ in shapes]
    else:
        exp_avgs = [_randn(s, gen, 0.1) for s in shapes]
        exp_avg_sqs = [_randn(s, gen, 0.1) ** 2 for s in shapes]
        steps = [torch.tensor(float(step0 + i)) for i in range(len(shapes))]
    return AdamWSet(params, exp_avgs, exp_avg_sqs, steps, masters)


@pytest.mark.parametrize("mode", list(MASTER_MODES))
@examples(1 / 3)
@given(
    shapes=st.lists(adamw_shape, min_size=1, max_size=4),
    grad_dtype=st.sampled_from(GRAD_DTYPES),
    hyper=adamw_hypers(),
    lr_as_tensor=st.booleans(),
    inv_scale=inv_scales,
    found=st.lists(found_infs, min_size=1, max_size=3),
    fresh=st.booleans(),
    step0=st.integers(0, 2**24 - 8),
    seed=seeds,
)
def test_adamw_op_matches_reference_bit_for_bit(shapes, mode, grad_dtype, hyper, lr_as_tensor, inv_scale, found,
                                                fresh, step0, seed):
    # Same operation order as the reference, no FMA contraction, IEEE div/sqrt
    # (test_adamw.py): every bit of every output agrees, in every mode.
    gen = torch.Generator().manual_seed(seed)
    ours = make_adamw_state(shapes, mode, gen, fresh, step0)
    ref = ours.clone()
    lr = _as_lr(hyper.pop("lr"), lr_as_tensor)
    for found_inf in found:
        grads = [_randn(s, gen).to(grad_dtype) for s in shapes]
        kwargs = dict(hyper, lr=lr, inv_scale=_tensor_or_none(inv_scale), found_inf=_tensor_or_none(found_inf))
        ops.adamw_step(*ours.args(grads), **ours.kwargs(), **kwargs)
        reference.adamw_step(*ref.args(grads), **ref.kwargs(), **kwargs)
    for name in ("params", "exp_avgs", "exp_avg_sqs", "steps", "masters"):
        for i, (a, b) in enumerate(zip(getattr(ours, name), getattr(ref, name))):
            assert_bit_equal(a, b, f"{name}[{i}]")


@given(
    shapes=st.lists(adamw_shape, min_size=1, max_size=3),
    low_mode=st.sampled_from(["bf16_remainder", "bf16_fp32_master", "fp16_fp32_master"]),
    grad_dtype=st.sampled_from(GRAD_DTYPES),
    hyper=adamw_hypers(),
    steps=steps_counts,
    seed=seeds,
)
def test_adamw_master_trajectory_is_the_same_in_every_master_mode(shapes, low_mode, grad_dtype, hyper, steps, seed):
    # The kernel reads the FP32 master, updates it and writes it back in every
    # mode (test_adamw.py): from the same FP32 masters, same bits forever.
    gen = torch.Generator().manual_seed(seed)
    fp32 = make_adamw_state(shapes, "fp32", gen, fresh=True, step0=0)
    low = make_adamw_state(shapes, low_mode, torch.Generator(), fresh=True, step0=0)
    _set_masters(low, fp32.params)
    for _ in range(steps):
        grads = [_randn(s, gen).to(grad_dtype) for s in shapes]
        for s in (fp32, low):
            ops.adamw_step(*s.args(grads), **s.kwargs(), **hyper)
    for i in range(len(shapes)):
        assert_bit_equal(fp32_master(low, i), fp32.params[i], f"master[{i}]")
        _assert_param_is_rounded_master(low.params[i], low.masters[i], fp32.params[i], f"param[{i}]")


def _set_masters(s, values: List[torch.Tensor]) -> None:
    """Makes `values` the FP32 masters of `s` (a set in a mode with a master)."""
    for i, v in enumerate(values):
        if s.masters[i].dtype == torch.int16:
            param, remainder = reference.split_master(v)
            s.params[i].copy_(param)
            s.masters[i].copy_(remainder)
        else:
            s.masters[i].copy_(v)
            s.params[i].copy_(v)


def _assert_param_is_rounded_master(param, master, fp32_value, what):
    """A low-precision param is its master rounded: by the split rule with
    remainders, to nearest even with an FP32 master."""
    expected = reference.split_master(fp32_value)[0] if master.dtype == torch.int16 else fp32_value.to(param.dtype)
    assert_bit_equal(param, expected, what)


# ---------------------------------------------------------------------------
# Muon kernel
# ---------------------------------------------------------------------------

# Small sides mostly; 100..140 gives matrices over 16384 elements (several
# ranges in the input-norm sums).
muon_side = st.one_of(st.integers(1, 12), st.integers(13, 48), st.integers(100, 140))


@st.composite
def muon_shapes(draw, max_count=3):
    """A bucket: params of one matrix shape, each [rows, cols] or [E, rows, cols]."""
    rows, cols = draw(muon_side), draw(muon_side)
    leads = draw(st.lists(st.one_of(st.just(()), st.integers(1, 3).map(lambda e: (e,))), min_size=1,
                          max_size=max_count))
    # Keep an example's work small: Polar-Express is cubic in the side.
    if rows * cols > 64 * 64:
        leads = [()]
    return [lead + (rows, cols) for lead in leads]


@st.composite
def muon_hypers(draw, ns_steps=st.integers(0, len(ops.POLAR_EXPRESS_COEFFICIENTS))):
    return dict(
        lr=draw(setting("muon", "lr", high=0.5)),
        momentum=draw(setting("muon", "momentum")),
        nesterov=draw(st.booleans()),
        beta2=draw(st.one_of(st.none(), setting("muon", "beta2"))),
        weight_decay=draw(setting("muon", "weight_decay", high=1.0)),
        ns_steps=draw(ns_steps),
        lr_scale=draw(st.sampled_from(MODES["lr_scale"])),
        polar_dtype=draw(st.sampled_from(MODES["polar_dtype"])),
    )


def make_muon_state(shapes, mode, gen, normuon: bool, fresh: bool) -> MuonSet:
    """Params from FP32 masters of scale 0.1 (as make_muon_set), held in `mode`;
    fresh or random momentum and second moments."""
    param_dtype, master_dtype = MASTER_MODES[mode]
    values = [_randn(s, gen, 0.1) for s in shapes]
    if master_dtype is torch.int16:
        pairs = [reference.split_master(v) for v in values]
        params, masters = [p for p, _ in pairs], [r for _, r in pairs]
    else:
        params = [v.to(param_dtype) for v in values]
        masters = [v.clone() for v in values] if master_dtype is torch.float32 else []
    moms = [torch.zeros(s) if fresh else _randn(s, gen, 0.1) for s in shapes]
    smbs = [torch.zeros(stat_shape(s)) if fresh else _randn(stat_shape(s), gen, 0.1).abs()
            for s in shapes] if normuon else []
    return MuonSet(params, moms, smbs, masters)


def _muon_master(s: MuonSet, i: int) -> torch.Tensor:
    """A new tensor holding the FP32 master (`.float()` of an FP32 param is the param itself)."""
    return fp32_master(s, i) if s.masters else s.params[i].float().clone()


def _reference_muon_hyper(hyper):
    return {k: v for k, v in hyper.items() if k not in ("polar_row_blocks", "max_workspace_bytes")}


def _run_muon_against_reference(shapes, mode, grad_dtype, hyper, inv_scale, found, fresh, seed):
    """Steps a bucket with the op and the reference; returns both, the starting
    FP32 masters and the reference's masters after each step."""
    gen = torch.Generator().manual_seed(seed)
    ours = make_muon_state(shapes, mode, gen, normuon=hyper["beta2"] is not None, fresh=fresh)
    ref = ours.clone()
    start = [_muon_master(ref, i) for i in range(len(shapes))]
    trajectory = [start]
    for found_inf in found:
        grads = [_randn(s, gen).to(grad_dtype) for s in shapes]
        kwargs = dict(inv_scale=_tensor_or_none(inv_scale), found_inf=_tensor_or_none(found_inf))
        ops.muon_step(*ours.args(grads), **ours.kwargs(), **hyper, **kwargs)
        reference.muon_step(*ref.args(grads), **ref.kwargs(), **_reference_muon_hyper(hyper), **kwargs)
        trajectory.append([_muon_master(ref, i) for i in range(len(shapes))])
    return ours, ref, trajectory


def _low_precision_slack(param_dtype, steps, values):
    """One rounding of a low-precision param that is its own master, per step:
    FP32 noise can put the two sides on either side of a rounding boundary, one
    ulp at the magnitude the param had then (the largest of `values`, its
    trajectory), or the smallest subnormal."""
    if param_dtype not in LOW_PRECISION_MANTISSA_BITS:
        return 0.0
    relative = 2.0**-LOW_PRECISION_MANTISSA_BITS[param_dtype]
    top = torch.stack([v.abs() for v in values]).amax(0)
    return steps * relative * (top + torch.finfo(param_dtype).smallest_normal)


@pytest.mark.parametrize("mode", list(MASTER_MODES))
@examples(1 / 3)
@given(
    shapes=muon_shapes(),
    grad_dtype=st.sampled_from(GRAD_DTYPES),
    hyper=muon_hypers(ns_steps=st.just(0)),
    inv_scale=inv_scales,
    found=st.lists(found_infs, min_size=1, max_size=3),
    fresh=st.booleans(),
    seed=seeds,
)
def test_muon_op_without_polar_express_matches_reference(shapes, mode, grad_dtype, hyper, inv_scale, found, fresh,
                                                         seed):
    """ns_steps=0 leaves momentum, input scaling, NorMuon and the cautious
    update, all FP32 elementwise math. test_muon.py
    (test_pre_and_post_passes_match_reference_without_polar_express): momentum
    bit for bit; params and second moments within 2e-6 relative (the NorMuon
    FP32 sums run in another order; measured <= 1 ulp of the update). Here the
    2e-6 is taken relative to the param plus the distance it moved (lr reaches
    0.5, where the update outweighs the param), and a low-precision param
    that is its own master may round the other way, one of its ulps per step."""
    ours, ref, trajectory = _run_muon_against_reference(shapes, mode, grad_dtype, hyper, inv_scale, found, fresh,
                                                        seed)
    steps = len(found)
    param_dtype = MASTER_MODES[mode][0]
    for i in range(len(shapes)):
        assert_bit_equal(ours.momentum_buffers[i], ref.momentum_buffers[i], f"momentum[{i}]")
        if hyper["beta2"] is not None:
            torch.testing.assert_close(ours.second_momentum_buffers[i], ref.second_momentum_buffers[i],
                                       rtol=2e-6, atol=0)
        a, b = _muon_master(ours, i), _muon_master(ref, i)
        moved = sum((t[i] - s[i]).abs() for s, t in zip(trajectory, trajectory[1:]))
        slack = 0.0 if ours.masters else _low_precision_slack(param_dtype, steps, [a] + [t[i] for t in trajectory])
        bound = 2e-6 * (b.abs() + moved) + 1e-8 + slack
        excess = ((a - b).abs() - bound).max().item()
        assert excess <= 0, f"master[{i}]: exceeds the bound by {excess}"
        if ours.masters:
            _assert_param_is_rounded_master(ours.params[i], ours.masters[i], a, f"param[{i}]")


def _ulps(steps, *values):
    """One FP32 rounding of the master per step: with an update far below the
    master's ulp, the two sides' exact results may round to neighbours."""
    top = torch.stack([v.abs() for v in values]).amax(0)
    return steps * (torch.nextafter(top, torch.tensor(math.inf)) - top)


def assert_muon_close(ours, ref, trajectory, i, *, weight_decay, lr_prime, low_dtype=None):
    """Muon masters after FP32 Polar-Express on both sides, which sum their
    GEMMs in different orders.

    test_muon.py (test_full_step_matches_fp32_reference) measured max |diff|
    <= 7.5e-6 of the element updates and test_optimizer_equivalence.py 1.1e-6
    .. 1.4e-6 of the update norm, on matrices with 16 to 1100 rows and cols.
    Thin matrices drift further: one step of lr 0.5 on 1 x n and 2 x n
    matrices, 12 seeds, measured up to 2.2e-5 of the update norm and 2.8e-5 of
    the largest element movement (Polar-Express amplifies rounding on rank 1;
    <= 1e-5 from 3 rows on). Allowed: 1e-4 of the largest element movement of
    a reference step, per step, and 1e-4 of the summed step norms, beyond one
    rounding of the master per step. Where X is within that noise of 0 the
    cautious mask may differ (2 of 572,000 elements in test_muon.py) and the
    element differs by its decay term: at most 2 such elements per param. A
    low-precision param without a master may round the other way, one of its
    ulps per step."""
    steps = len(trajectory) - 1
    moves = [t[i] - s[i] for s, t in zip(trajectory, trajectory[1:])]
    step_scale = max((m.abs().max().item() for m in moves if m.numel()), default=0.0)
    rounding = _ulps(steps, ours, ref) + _low_precision_slack(low_dtype, steps, [ours] + [t[i] for t in trajectory])
    tolerance = 1e-4 * steps * step_scale + rounding
    diff = (ours - ref).abs()
    outside = diff > tolerance
    flips = int(outside.sum())
    if flips:
        decay_bound = steps * lr_prime * weight_decay * max(t[i].abs().max().item() for t in trajectory)
        assert flips <= 2 and weight_decay > 0, f"{flips} elements differ by more than the tolerance"
        excess = (diff - tolerance - decay_bound).max().item()
        assert excess <= 0, f"an element differs by {excess} more than its decay term"
    if low_dtype is None:
        update_norm = sum(m.norm().item() for m in moves)
        residual = ((diff - rounding).clamp_min(0) * ~outside).norm().item()
        assert residual <= 1e-4 * update_norm, f"|diff| {residual} above 1e-4 of the update norm {update_norm}"


def _lr_prime(hyper, shape):
    lr = float(hyper["lr"])
    return lr * reference.muon_lr_factor(hyper["lr_scale"], shape[-2], shape[-1])


@pytest.mark.parametrize("mode", MODES_WITH_FP32_MASTER)
@examples(1 / 3)
@given(
    shapes=muon_shapes(),
    grad_dtype=st.sampled_from(GRAD_DTYPES),
    hyper=muon_hypers(ns_steps=st.integers(1, len(ops.POLAR_EXPRESS_COEFFICIENTS))),
    polar_row_blocks=st.one_of(st.none(), st.integers(1, 8)),
    inv_scale=inv_scales,
    found=st.lists(found_infs, min_size=1, max_size=3),
    fresh=st.booleans(),
    seed=seeds,
)
def test_muon_op_matches_reference(shapes, mode, grad_dtype, hyper, polar_row_blocks, inv_scale, found, fresh, seed):
    """With Polar-Express: momentum bit for bit, second moments within
    test_muon.py's 1e-4 relative (test_full_step_matches_fp32_reference),
    masters as in `assert_muon_close`, params the rounded masters. FP32
    Polar-Express (the bounds are FP32 noise); test_muon.py holds the BF16 path
    to the reference's BF16 twin."""
    hyper = dict(hyper, polar_row_blocks=polar_row_blocks, polar_dtype="float32")
    ours, ref, trajectory = _run_muon_against_reference(shapes, mode, grad_dtype, hyper, inv_scale, found, fresh,
                                                        seed)
    for i in range(len(shapes)):
        assert_bit_equal(ours.momentum_buffers[i], ref.momentum_buffers[i], f"momentum[{i}]")
        if hyper["beta2"] is not None:
            torch.testing.assert_close(ours.second_momentum_buffers[i], ref.second_momentum_buffers[i],
                                       rtol=1e-4, atol=1e-9)
        a = _muon_master(ours, i)
        assert_muon_close(a, _muon_master(ref, i), trajectory, i, weight_decay=hyper["weight_decay"],
                          lr_prime=_lr_prime(hyper, shapes[i]))
        if ours.masters:
            _assert_param_is_rounded_master(ours.params[i], ours.masters[i], a, f"param[{i}]")


def _phases(s: MuonSet, grads, *, lr, momentum, nesterov, beta2, weight_decay, ns_steps, lr_scale, polar_dtype,
            inv_scale, found_inf, polar_row_blocks, max_workspace_bytes):
    updates = [torch.empty(p.shape, dtype=torch.float32) for p in s.params]
    ops.muon_momentum(grads, s.momentum_buffers, updates, momentum=momentum, nesterov=nesterov,
                      inv_scale=inv_scale, found_inf=found_inf)
    ops.muon_orthogonalize(updates, s.second_momentum_buffers, beta2=beta2, ns_steps=ns_steps,
                           polar_row_blocks=polar_row_blocks, polar_dtype=polar_dtype,
                           max_workspace_bytes=max_workspace_bytes,
                           found_inf=found_inf)
    ops.muon_apply(s.params, updates, masters=s.masters, lr=lr, weight_decay=weight_decay, lr_scale=lr_scale,
                   found_inf=found_inf)


workspace_bounds = st.one_of(st.just(ops.DEFAULT_MAX_WORKSPACE_BYTES), st.integers(1, 1 << 16))
# A bound below one matrix: each chunk holds exactly one (the op's minimum).
ONE_MATRIX_PER_CHUNK = 1


def _assert_same_muon_state(a: MuonSet, b: MuonSet, what: str) -> None:
    for name in ("params", "momentum_buffers", "second_momentum_buffers", "masters"):
        for i, (x, y) in enumerate(zip(getattr(a, name), getattr(b, name))):
            assert_bit_equal(x, y, f"{what}: {name}[{i}]")


@pytest.mark.parametrize("mode", list(MASTER_MODES))
@examples(1 / 4)
@given(
    shapes=muon_shapes(),
    grad_dtype=st.sampled_from(GRAD_DTYPES),
    hyper=muon_hypers(),
    lr_as_tensor=st.booleans(),
    polar_row_blocks=st.one_of(st.none(), st.integers(1, RANGES[("muon", "polar_row_blocks")].high)),
    workspace=workspace_bounds,
    inv_scale=inv_scales,
    found=st.lists(found_infs, min_size=1, max_size=3),
    fresh=st.booleans(),
    seed=seeds,
)
def test_muon_three_phases_equal_the_fused_op_bit_for_bit(shapes, mode, grad_dtype, hyper, lr_as_tensor,
                                                          polar_row_blocks, workspace, inv_scale, found, fresh,
                                                          seed):
    # Both paths form the same values in the same order (docs/design.md, "Muon
    # in three phases"; test_muon_phases.py). Every matrix starts 64-byte
    # aligned on both sides (the fused op runs one matrix per chunk; stacked
    # params only where rows * cols is a multiple of 16), as the bits of an
    # unaligned one differ (test_polar_express_bits_do_not_depend_on_the_address;
    # 16 bytes on this AVX2 host, the width may differ elsewhere).
    if (shapes[0][-2] * shapes[0][-1]) % 16:
        shapes = [s[-2:] for s in shapes]
    gen = torch.Generator().manual_seed(seed)
    fused = make_muon_state(shapes, mode, gen, normuon=hyper["beta2"] is not None, fresh=fresh)
    phased = fused.clone()
    hyper = dict(hyper, lr=_as_lr(hyper["lr"], lr_as_tensor), polar_row_blocks=polar_row_blocks)
    for found_inf in found:
        grads = [_randn(s, gen).to(grad_dtype) for s in shapes]
        kwargs = dict(hyper, inv_scale=_tensor_or_none(inv_scale), found_inf=_tensor_or_none(found_inf))
        ops.muon_step(*fused.args(grads), **fused.kwargs(), **kwargs, max_workspace_bytes=ONE_MATRIX_PER_CHUNK)
        _phases(phased, grads, **kwargs, max_workspace_bytes=workspace)
    _assert_same_muon_state(fused, phased, "phases vs fused")


@pytest.mark.parametrize("shape", [(5, 5), (37, 29)])
def test_polar_express_bits_do_not_depend_on_the_address(shape):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    results = []
    for offset in range(17):  # floats: 0 and 16 are 64-byte aligned (fresh CPU tensors are)
        u = torch.zeros(offset + x.numel())[offset:].view(x.shape)
        u.copy_(x)
        ops.muon_orthogonalize([u], beta2=None, ns_steps=1)
        results.append(u)
    for offset, u in enumerate(results):
        assert_bit_equal(u, results[0], f"matrix at a {4 * offset}-byte offset")


_UNALIGNED_BUCKET = dict(shapes=[(5, 5), (5, 5)], mode="fp32", workspace=ops.DEFAULT_MAX_WORKSPACE_BYTES, seed=0,
                         hyper=dict(lr=1.0, momentum=0.95, nesterov=True, beta2=None, weight_decay=0.0, ns_steps=1,
                                    lr_scale="none"))


@given(
    shapes=muon_shapes(),
    mode=st.sampled_from(list(MASTER_MODES)),
    hyper=muon_hypers(),
    workspace=workspace_bounds,
    seed=seeds,
)
@example(**_UNALIGNED_BUCKET)
def test_muon_fused_op_bits_do_not_depend_on_the_chunking(shapes, mode, hyper, workspace, seed):
    # On the CPU each matrix has its own GEMMs (docs/design.md, "Rounding
    # contract", Determinism), so the same bits alone, batched or chunked.
    gen = torch.Generator().manual_seed(seed)
    chunked = make_muon_state(shapes, mode, gen, normuon=hyper["beta2"] is not None, fresh=False)
    alone = chunked.clone()
    for _ in range(2):
        grads = [_randn(s, gen) for s in shapes]
        ops.muon_step(*chunked.args(grads), **chunked.kwargs(), **hyper, max_workspace_bytes=workspace)
        ops.muon_step(*alone.args(grads), **alone.kwargs(), **hyper, max_workspace_bytes=ONE_MATRIX_PER_CHUNK)
    _assert_same_muon_state(chunked, alone, "chunked vs one matrix per chunk")


@given(
    rows=muon_side, cols=muon_side, experts=st.integers(1, 4),
    mode=st.sampled_from(list(MASTER_MODES)),
    hyper=muon_hypers(),
    workspace=workspace_bounds,
    steps=steps_counts,
    seed=seeds,
)
def test_muon_stacked_param_steps_like_its_matrices_in_a_list(rows, cols, experts, mode, hyper, workspace, steps,
                                                              seed):
    # An [E, rows, cols] param (matrix_view="batch") is E separate matrices
    # (test_muon.py): bit for bit against a bucket of them, under the same
    # workspace bound.
    if rows * cols > 64 * 64:
        experts = 1
    gen = torch.Generator().manual_seed(seed)
    normuon = hyper["beta2"] is not None
    stacked = make_muon_state([(experts, rows, cols)], mode, gen, normuon=normuon, fresh=False)
    separate = MuonSet(*[[t.clone() for t in ts[0].unbind(0)] if ts else [] for ts in
                         (stacked.params, stacked.momentum_buffers, stacked.second_momentum_buffers, stacked.masters)])
    for _ in range(steps):
        grad = _randn((experts, rows, cols), gen)
        ops.muon_step(*stacked.args([grad]), **stacked.kwargs(), **hyper, max_workspace_bytes=workspace)
        ops.muon_step(*separate.args([g.clone() for g in grad.unbind(0)]), **separate.kwargs(), **hyper,
                      max_workspace_bytes=workspace)
    restacked = MuonSet(*[[torch.stack(ts)] if ts else [] for ts in
                          (separate.params, separate.momentum_buffers, separate.second_momentum_buffers,
                           separate.masters)])
    _assert_same_muon_state(stacked, restacked, "stacked vs separate")


@given(
    shapes=muon_shapes(),
    low_mode=st.sampled_from(["bf16_remainder", "bf16_fp32_master", "fp16_fp32_master"]),
    grad_dtype=st.sampled_from(GRAD_DTYPES),
    hyper=muon_hypers(),
    steps=steps_counts,
    seed=seeds,
)
def test_muon_master_trajectory_is_the_same_in_every_master_mode(shapes, low_mode, grad_dtype, hyper, steps, seed):
    # The update depends on grads and state only and is applied to the FP32
    # master in every mode (test_muon.py): same masters, same bits.
    gen = torch.Generator().manual_seed(seed)
    normuon = hyper["beta2"] is not None
    fp32 = make_muon_state(shapes, "fp32", gen, normuon=normuon, fresh=True)
    low = make_muon_state(shapes, low_mode, torch.Generator(), normuon=normuon, fresh=True)
    _set_masters(low, fp32.params)
    for _ in range(steps):
        grads = [_randn(s, gen).to(grad_dtype) for s in shapes]
        for s in (fp32, low):
            ops.muon_step(*s.args(grads), **s.kwargs(), **hyper)
    for i in range(len(shapes)):
        assert_bit_equal(fp32_master(low, i), fp32.params[i], f"master[{i}]")
        _assert_param_is_rounded_master(low.params[i], low.masters[i], fp32.params[i], f"param[{i}]")
        assert_bit_equal(low.momentum_buffers[i], fp32.momentum_buffers[i], f"momentum[{i}]")


# ---------------------------------------------------------------------------
# MuonAdamW
# ---------------------------------------------------------------------------

MASTER_CONFIGS = {
    "remainders": dict(),
    "fp32_masters": dict(store_param_remainders=False),
    "no_masters": dict(master_weights=False),
}
small_side = st.integers(1, 12)


@st.composite
def muon_group_spec(draw):
    view = draw(st.sampled_from(MODES["matrix_view"]))
    if view == "error":
        shape = st.tuples(small_side, small_side)
    elif view == "batch":
        shape = st.one_of(st.tuples(small_side, small_side), st.tuples(st.integers(1, 3), small_side, small_side))
    else:  # "flatten": conv-like weights
        shape = st.one_of(st.tuples(small_side, small_side), st.tuples(small_side, st.integers(1, 4), small_side),
                          st.tuples(small_side, st.integers(1, 3), st.integers(1, 3), st.integers(1, 3)))
    # The default ns_steps first: hypothesis leans to a list's first value.
    return dict(kind="muon", matrix_view=view, shapes=draw(st.lists(shape, min_size=1, max_size=3)),
                **draw(muon_hypers(ns_steps=st.sampled_from([5, 0, 2]))))


@st.composite
def adamw_group_spec(draw):
    hyper = draw(adamw_hypers())
    shape = st.one_of(st.just(()), st.integers(1, 100).map(lambda n: (n,)), st.tuples(small_side, small_side))
    return dict(kind="adamw", shapes=draw(st.lists(shape, min_size=1, max_size=3)), lr=hyper["lr"],
                betas=(hyper["beta1"], hyper["beta2"]), eps=hyper["eps"], weight_decay=hyper["weight_decay"],
                adam_w_mode=hyper["adam_w_mode"], bias_correction=hyper["bias_correction"])


@st.composite
def optimizer_cases(draw, config, grad_source):
    """Groups of random kinds, shapes and settings, param dtypes, and per step:
    which params have a grad, an lr schedule and (GradScaler) an inf."""
    specs = draw(st.lists(st.one_of(muon_group_spec(), adamw_group_spec()), min_size=1, max_size=3))
    dtypes = [[draw(st.sampled_from(PARAM_DTYPES)) for _ in spec["shapes"]] for spec in specs]
    grad_attr = "main_grad" if grad_source == "main_grad" else "grad"
    steps = draw(steps_counts)
    count = sum(len(spec["shapes"]) for spec in specs)
    # Per step: which params have a grad (the first always: GradScaler needs one), the groups' lr factors
    # (a scheduler), and whether a grad holds an inf.
    has_grad = [[True] + draw(st.lists(st.booleans(), min_size=count - 1, max_size=count - 1)) for _ in range(steps)]
    lr_factors = [draw(st.lists(st.sampled_from([1.0, 0.5, 3.0]), min_size=len(specs), max_size=len(specs)))
                  for _ in range(steps)]
    scale = draw(st.sampled_from([2.0**10, 1.0, 3.0])) if grad_source == "grad_scaler" else None
    inf_step = draw(st.one_of(st.none(), st.integers(0, steps - 1))) if scale is not None else None
    return dict(specs=specs, dtypes=dtypes, grad_attr=grad_attr,
                capturable=draw(st.booleans()), steps=steps, has_grad=has_grad, lr_factors=lr_factors, scale=scale,
                inf_step=inf_step, seed=draw(seeds))


def _reference_view(t: torch.Tensor, spec: dict) -> torch.Tensor:
    """The kernel's matrices of a Muon param-shaped tensor (muon_ext._shapes.as_matrices)."""
    return t.view(t.shape[0], -1) if spec["kind"] == "muon" and spec["matrix_view"] == "flatten" and t.dim() > 2 else t


class _Shadow:
    """One param stepped by muon_ext.reference in the optimizer's master mode,
    from a copy of the optimizer's state."""

    def __init__(self, param, state, spec):
        self.spec = spec
        self.param = param.detach().clone()
        self.state = {k: v.clone() for k, v in state.items()}

    def master(self) -> torch.Tensor:
        master = self.state.get("master_param")
        if master is None:
            return self.param.float().clone()
        return reference.merge_master(self.param, master) if master.dtype == torch.int16 else master.clone()

    def step(self, grad, lr, inv_scale):
        spec, state = self.spec, self.state
        masters = [state["master_param"]] if "master_param" in state else []
        if spec["kind"] == "adamw":
            reference.adamw_step([self.param], [grad], [state["exp_avg"]], [state["exp_avg_sq"]], [state["step"]],
                                 masters=masters, lr=lr, beta1=spec["betas"][0], beta2=spec["betas"][1],
                                 eps=spec["eps"], weight_decay=spec["weight_decay"], adam_w_mode=spec["adam_w_mode"],
                                 bias_correction=spec["bias_correction"], inv_scale=inv_scale)
            return
        view = lambda t: _reference_view(t, spec)  # noqa: E731
        smbs = [state["second_momentum_buffer"]] if spec["beta2"] is not None else []
        reference.muon_step([view(self.param)], [view(grad)], [view(state["momentum_buffer"])], smbs,
                            masters=[view(m) for m in masters], lr=lr, momentum=spec["momentum"],
                            nesterov=spec["nesterov"], beta2=spec["beta2"], weight_decay=spec["weight_decay"],
                            ns_steps=spec["ns_steps"], lr_scale=spec["lr_scale"], polar_dtype=spec["polar_dtype"],
                            inv_scale=inv_scale)


def _group(spec, params):
    keys = [k for k in spec if k not in ("shapes",)]
    return dict({k: spec[k] for k in keys}, params=params)


@pytest.mark.parametrize("config", list(MASTER_CONFIGS))
@pytest.mark.parametrize("grad_source", ["grad", "main_grad", "grad_scaler"])
@examples(1 / 3)
@given(data=st.data())
def test_muon_adamw_matches_reference(config, grad_source, data):
    """MuonAdamW in every master configuration, mixed param dtypes, Muon
    groups under every matrix_view, AdamW groups, grads or FP32 main grads,
    params without a grad on some steps, an lr schedule, a capturable lr, and
    torch.amp.GradScaler with an inf on some step, against a param-by-param
    reference: AdamW bit for bit (test_optimizer_equivalence.py), Muon
    momentum bit for bit, second moments within 1e-4 relative and masters as
    in `assert_muon_close`."""
    case = data.draw(optimizer_cases(config, grad_source), label="case")
    gen = torch.Generator().manual_seed(case["seed"])
    specs = case["specs"]
    for spec in specs:  # the bounds are FP32 noise; test_muon.py holds BF16 Polar-Express to its twin
        if spec["kind"] == "muon":
            spec["polar_dtype"] = "float32"
    params = [[torch.nn.Parameter(_randn(s, gen, 0.1).to(dtype)) for s, dtype in zip(spec["shapes"], dtypes)]
              for spec, dtypes in zip(specs, case["dtypes"])]
    opt = MuonAdamW([_group(spec, ps) for spec, ps in zip(specs, params)], grad_attr=case["grad_attr"],
                    capturable=case["capturable"], **MASTER_CONFIGS[config])
    flat = [(spec, p) for spec, ps in zip(specs, params) for p in ps]
    shadows = [_Shadow(p, opt.state[p], spec) for spec, p in flat]
    trajectories = [[s.master()] for s in shadows]
    scaler = None
    if case["scale"] is not None:
        scaler = torch.amp.GradScaler("cpu", init_scale=case["scale"])

    for k in range(case["steps"]):
        for group, spec, factor in zip(opt.param_groups, specs, case["lr_factors"][k]):
            if case["capturable"]:
                group["lr"].fill_(spec["lr"] * factor)
            else:
                group["lr"] = spec["lr"] * factor
        lrs = [float(opt.param_groups[g]["lr"]) for g, ps in enumerate(params) for _ in ps]
        scale = 1.0
        if scaler is not None:
            scaler.scale(torch.ones(()))
            scale = scaler.get_scale()
        grads = []
        for j, (spec, p) in enumerate(flat):
            grad = None
            if case["has_grad"][k][j]:
                dtype = torch.float32 if case["grad_attr"] == "main_grad" else p.dtype
                grad = (_randn(p.shape, gen) * scale).to(dtype)
                if case["inf_step"] == k and j == 0:
                    grad.view(-1)[0] = float("inf")
            setattr(p, case["grad_attr"], grad)
            grads.append(grad)
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        inv_scale = None if scaler is None else torch.tensor([1.0 / scale], dtype=torch.float32)
        for shadow, grad, lr, trajectory in zip(shadows, grads, lrs, trajectories):
            if grad is not None and case["inf_step"] != k:
                shadow.step(grad, lr, inv_scale)
            trajectory.append(shadow.master())

    for j, ((spec, p), shadow) in enumerate(zip(flat, shadows)):
        state = opt.state[p]
        assert state.keys() == shadow.state.keys()
        if spec["kind"] == "adamw":
            assert_bit_equal(p.detach(), shadow.param, f"adamw param {j}")
            for key in state:
                assert_bit_equal(state[key], shadow.state[key], f"adamw param {j} {key}")
            continue
        assert_bit_equal(state["momentum_buffer"], shadow.state["momentum_buffer"], f"muon param {j} momentum")
        if "second_momentum_buffer" in state:
            torch.testing.assert_close(state["second_momentum_buffer"], shadow.state["second_momentum_buffer"],
                                       rtol=1e-4, atol=1e-9)
        low_dtype = p.dtype if "master_param" not in state and p.dtype != torch.float32 else None
        rows, cols = _reference_view(p, spec).shape[-2:]
        lr_prime = max(spec["lr"] * f for f in (1.0, 0.5, 3.0)) * reference.muon_lr_factor(spec["lr_scale"], rows, cols)
        assert_muon_close(opt.get_full_parameter_master(p), shadow.master(), [[m] for m in trajectories[j]], 0,
                          weight_decay=spec["weight_decay"], lr_prime=lr_prime, low_dtype=low_dtype)
