"""The small-matrix Polar-Express kernel (csrc/cpu/polar_small.h): shapes with
min(rows, cols)^2 * max(rows, cols) <= 2^20 run sixteen matrices per SIMD vector
instead of BLAS calls.

It must compute the reference iteration (the BF16 rounding points included), and
give every matrix the same bits whatever its lane, group or neighbours.
Thread-count independence is in test_reproducibility.py (shapes 1x1, 8x8, 40x24).
"""

import os

import pytest
import torch

from muon_ext import ops, reference
from support.helpers import run_python

COEFFICIENTS = reference.POLAR_EXPRESS_COEFFICIENTS
# Wide, tall, square, a single element, one row or column, the largest square
# on the small path (100^3 <= 2^20) and a wide one at the limit (64^2 * 256).
SMALL_SHAPES = [(1, 1), (8, 8), (3, 7), (7, 3), (1, 16), (16, 1), (32, 48), (48, 16), (100, 100), (64, 256)]


def orthogonalize(updates: torch.Tensor, polar_dtype: str) -> torch.Tensor:
    x = updates.clone()
    ops.muon_orthogonalize([x], beta2=None, polar_dtype=polar_dtype)
    return x


def scaled_input(updates: torch.Tensor) -> torch.Tensor:
    """The kernel's X before the iterations: u * (1 / (||u|| * 1.02 + 1e-6)) in FP32."""
    norms = updates.flatten(1).double().square().sum(1).float().sqrt()
    return updates * (1.0 / (norms * 1.02 + 1e-6))[:, None, None]


@pytest.mark.parametrize("shape", SMALL_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_small_kernel_follows_the_reference_iteration(shape):
    """BF16: the same rounding points as reference.polar_express(bf16=True); the FP32
    sums differ only in order, so the outputs agree within a BF16 ulp of the values
    (<= 2^-8 relative to ~1). FP32: within FP32 noise amplified by five iterations."""
    gen = torch.Generator().manual_seed(shape[0] * 131 + shape[1])
    updates = torch.randn((19,) + shape, generator=gen)  # a full group of 16 and part of another
    x0 = scaled_input(updates)
    bf16 = orthogonalize(updates, "bfloat16")
    torch.testing.assert_close(bf16, reference.polar_express(x0, COEFFICIENTS, bf16=True), rtol=0, atol=2.0**-7)
    assert torch.equal(bf16, bf16.bfloat16().float()), "BF16 path: X leaves as BF16 values"
    fp32 = orthogonalize(updates, "float32")
    torch.testing.assert_close(fp32, reference.polar_express(x0.double(), COEFFICIENTS).float(), rtol=0, atol=1e-4)


@pytest.mark.parametrize("polar_dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("shape", [(1, 1), (8, 8), (5, 9), (40, 24)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_a_matrix_gets_the_same_bits_in_any_lane_and_group(shape, polar_dtype):
    """19 matrices fill a group of sixteen and three lanes of a second: each one
    alone (lane 0 of a group padded with zeros), and the batch reversed (every
    matrix in another lane), give the batch's bits."""
    gen = torch.Generator().manual_seed(7)
    updates = torch.randn((19,) + shape, generator=gen)
    batch = orthogonalize(updates, polar_dtype)
    for j in range(updates.shape[0]):
        assert torch.equal(orthogonalize(updates[j:j + 1], polar_dtype), batch[j:j + 1]), f"matrix {j} alone"
    assert torch.equal(orthogonalize(updates.flip(0), polar_dtype).flip(0), batch), "batch reversed"


def test_non_finite_inputs_stay_in_their_own_matrix():
    """An inf in one matrix makes that matrix NaN; its lane neighbours are untouched."""
    gen = torch.Generator().manual_seed(3)
    updates = torch.randn(9, 8, 8, generator=gen)
    clean = orthogonalize(updates, "bfloat16")
    updates[4, 2, 3] = float("inf")
    dirty = orthogonalize(updates, "bfloat16")
    assert torch.isnan(dirty[4]).all()
    keep = [j for j in range(9) if j != 4]
    assert torch.equal(dirty[keep], clean[keep])


# Each instruction set's build of the kernel (AVX-512 and AVX2 with FMA
# instructions, the baseline in double) in a fresh process capped by
# ATEN_CPU_CAPABILITY; inputs from numpy (torch's generators are vectorized per
# ISA). Three matrices span 24-30 decades (elements, rows, columns), so BF16
# products fall below 2^-126, where a fused multiply-add may round otherwise
# than a multiply then add; one holds an inf (the NaN-case rounding); every
# polar_dtype, both methods, and the fused step.
_EVERY_ISA_CODE = """
import hashlib, numpy as np, torch
from muon_ext import ops
rng = np.random.default_rng(0)
digest = hashlib.sha256()
for shape in [(1, 1), (8, 8), (5, 9), (40, 24)]:
    u = rng.standard_normal((19,) + shape).astype(np.float32)
    u[3] *= (10.0 ** rng.uniform(-30, 0, shape)).astype(np.float32)
    u[4] *= (10.0 ** np.linspace(0, -24, shape[0]))[:, None].astype(np.float32)
    u[6] *= (10.0 ** np.linspace(0, -24, shape[1]))[None, :].astype(np.float32)
    u[5].flat[-1] = np.inf
    for dtype in ["bfloat16", "float16", "float32"]:
        for method in ["standard", "gram"]:
            x = torch.from_numpy(u.copy())
            ops.muon_orthogonalize([x], beta2=None, polar_dtype=dtype, polar_method=method)
            digest.update(x.numpy().tobytes())
    grads = torch.from_numpy(u.copy()).bfloat16()
    params = torch.from_numpy(rng.standard_normal(u.shape).astype(np.float32) * 0.05).bfloat16()
    moms, masters = torch.zeros(u.shape), torch.zeros(u.shape, dtype=torch.int16)
    smbs = torch.zeros((19, shape[0], 1) if shape[0] >= shape[1] else (19, 1, shape[1]))
    for _ in range(2):
        ops.muon_step([params], [grads], [moms], [smbs], masters=[masters], lr=0.02)
    for t in (params, moms, masters, smbs):
        digest.update(t.view(torch.uint8).numpy().tobytes())
print(ops.cpu_capabilities()[-1], digest.hexdigest())
"""


@pytest.mark.parametrize("capability", ["AVX2", "AVX512"])
def test_every_instruction_set_gives_the_same_bits(capability):
    if capability not in ops.cpu_capabilities():
        pytest.skip(f"{capability} not usable on this machine")
    env = dict(os.environ, ATEN_CPU_CAPABILITY=capability.lower())
    used, checksum = run_python(_EVERY_ISA_CODE, env=env, check=True).stdout.split()
    assert used == capability
    env["ATEN_CPU_CAPABILITY"] = "default"
    baseline_used, baseline = run_python(_EVERY_ISA_CODE, env=env, check=True).stdout.split()
    assert baseline_used == "DEFAULT" and checksum == baseline


# The fused small-matrix step (csrc/cpu/muon_small_step_cpu.cpp, small_step): one
# pass per run of 256 / 64 / ... matrices, across params. Its bits must be the
# unfused passes' (the three phase ops run those), whatever the run, lane,
# thread count or address of a matrix.

def _bucket(shapes, seed, master_mode, normuon=True):
    gen = torch.Generator().manual_seed(seed)
    out = {"params": [], "grads": [], "moms": [], "smbs": [], "masters": []}
    for shape in shapes:
        rows, cols = shape[-2:]
        values = torch.randn(shape, generator=gen) * 0.05
        out["grads"].append(torch.randn(shape, generator=gen).bfloat16())
        out["moms"].append(torch.randn(shape, generator=gen) * 0.1)
        if normuon:
            stat = shape[:-2] + ((rows, 1) if rows >= cols else (1, cols))
            out["smbs"].append(torch.rand(stat, generator=gen) * 1e-2)
        if master_mode == "remainder":
            out["params"].append(values.bfloat16())
            out["masters"].append(torch.randint(-2**15, 2**15, shape, generator=gen, dtype=torch.int16))
        elif master_mode == "fp32":
            out["params"].append(values.bfloat16())
            out["masters"].append(values.clone())
        else:
            out["params"].append(values)
    return out


def _clone(bucket):
    return {k: [t.clone() for t in v] for k, v in bucket.items()}


def _written(bucket):
    return bucket["params"] + bucket["moms"] + bucket["smbs"] + bucket["masters"]


def _fused_step(bucket, **hyper):
    ops.muon_step(bucket["params"], bucket["grads"], bucket["moms"], bucket["smbs"], masters=bucket["masters"],
                  lr=0.02, **hyper)


def _phased_step(bucket, beta2=0.95, polar_method="standard", polar_dtype="bfloat16", nesterov=True, momentum=0.95):
    updates = [torch.empty(p.shape) for p in bucket["params"]]
    ops.muon_momentum(bucket["grads"], bucket["moms"], updates, momentum=momentum, nesterov=nesterov)
    ops.muon_orthogonalize(updates, bucket["smbs"], beta2=beta2, polar_method=polar_method, polar_dtype=polar_dtype)
    ops.muon_apply(bucket["params"], updates, masters=bucket["masters"], lr=0.02)


def _assert_bits(a, b, what):
    for i, (x, y) in enumerate(zip(_written(a), _written(b))):
        assert torch.equal(x.view(torch.uint8), y.view(torch.uint8)), f"{what}: tensor {i}"


# Stacks spanning several runs and params (a run may cross a param boundary),
# counts that leave partial lane groups, one matrix per param, tall / wide
# (NorMuon per row / per column; in the lanes up to 128 statistics, else per
# matrix).
FUSED_BUCKETS = {
    "8x8_stacks": [(150, 8, 8), (37, 8, 8), (8, 8)],
    "1x1_stack": [(5000, 1, 1), (3, 1, 1)],
    "3x7_wide": [(300, 3, 7)],
    "7x3_tall": [(2, 45, 7, 3)],
    # 2, 4 and 16 NorMuon statistics per matrix, full lane groups (8: the 8x8 stacks).
    "2x2": [(48, 2, 2)],
    "4x2": [(32, 4, 2), (17, 4, 2)],
    "4x16": [(40, 4, 16)],
    "many_params": [(5, 9)] * 21,
    # More NorMuon statistics per matrix than the lanes' scratch holds: per matrix.
    "1x200_wide": [(40, 1, 200)],
    "150x2_tall": [(30, 150, 2)],
}


@pytest.mark.parametrize("master_mode", ["remainder", "fp32", "none"])
@pytest.mark.parametrize("kind", list(FUSED_BUCKETS))
def test_fused_small_step_equals_the_phases(kind, master_mode):
    bucket = _bucket(FUSED_BUCKETS[kind], seed=len(kind), master_mode=master_mode)
    fused, phased = _clone(bucket), _clone(bucket)
    for _ in range(2):
        _fused_step(fused)
        _phased_step(phased)
    _assert_bits(fused, phased, kind)


@pytest.mark.parametrize("setting", [dict(beta2=None), dict(polar_method="gram"), dict(polar_dtype="float32"),
                                     dict(polar_dtype="float16"), dict(nesterov=False),
                                     dict(momentum=0.5), dict(momentum=0.3, nesterov=False)],
                         ids=lambda d: "-".join(f"{k}={v}" for k, v in d.items()))
def test_fused_small_step_equals_the_phases_for_every_setting(setting):
    bucket = _bucket([(70, 8, 8), (19, 8, 8)], seed=11, master_mode="remainder",
                     normuon=setting.get("beta2", 0.95) is not None)
    fused, phased = _clone(bucket), _clone(bucket)
    _fused_step(fused, **setting)
    _phased_step(phased, **setting)
    _assert_bits(fused, phased, str(setting))


def test_fused_small_step_splits_nan_masters_by_the_full_rule():
    """The fused apply splits a vector without NaNs by the NaN-free form: blocks
    with NaN masters (the high halves where the split's NaN corrections act:
    0x7F81, 0x7FFF, a negative NaN), an infinite grad, and clean blocks beside
    them give the phased step's bits."""
    bucket = _bucket([(300, 8, 8)], seed=5, master_mode="remainder")
    hi = bucket["params"][0].view(torch.int16).view(-1)
    for at, pattern in ((3, 0x7F81), (700, 0x7FFF), (701, 0x7F80), (5000, -0x40)):  # -0x40: 0xFFC0
        hi[at] = pattern
    bucket["grads"][0].view(-1)[9000] = float("inf")
    fused, phased = _clone(bucket), _clone(bucket)
    _fused_step(fused)
    _phased_step(phased)
    _assert_bits(fused, phased, "NaN masters")
    assert fused["params"][0].isnan().any() and not fused["params"][0][-100:].isnan().any()


def test_fused_small_step_bits_do_not_depend_on_position_address_or_threads():
    """Matrices 5.. of a 300-matrix stack stepped as their own stack (other runs,
    lanes and neighbours), at an odd storage offset, at 1 and 2 threads."""
    bucket = _bucket([(300, 8, 8)], seed=2, master_mode="remainder")
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        whole = _clone(bucket)
        _fused_step(whole)
        torch.set_num_threads(2)
        parallel = _clone(bucket)
        _fused_step(parallel)
        _assert_bits(parallel, whole, "2 threads vs 1")
        shifted = {}
        for key, (t,) in bucket.items():
            storage = torch.empty(t.numel() + 3, dtype=t.dtype)
            view = storage[3:3 + t[5:].numel()].view(t[5:].shape)
            view.copy_(t[5:])
            shifted[key] = [view]
        _fused_step(shifted)
        for i, (a, b) in enumerate(zip(_written(shifted), _written(whole))):
            assert torch.equal(a, b[5:]), f"tensor {i}: matrices 5.. at another position and address"
    finally:
        torch.set_num_threads(before)
