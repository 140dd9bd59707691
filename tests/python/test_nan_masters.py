"""A NaN FP32 master always shows as a NaN BF16 param in remainder mode, on
every NaN payload (docs/design.md, "Master weights and remainders").

TransformerEngine's split rule hides 2^17 - 2 NaN patterns: a carry wraps the
high half 0x7FFF into the sign bit (0x7FFFFFFF, the NaN CUDA produces, became
BF16 -0.0) or, without a carry, a high half 0x7F80 stays BF16 inf. Here the
BF16 of a NaN master is clamped into the NaN range; the remainder stays the
low half. The C++ suite (tests/cpp/test_remainder.cpp) sweeps all 2^32
patterns; these tests hold the op, the reference and the kernels to it.
"""

import inspect

import pytest
import torch

import muon_ext
from support.helpers import assert_bit_equal
from muon_ext import ops, reference


def u32(t: torch.Tensor) -> torch.Tensor:
    """FP32 bit patterns as non-negative int64."""
    return t.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF


def from_u32(patterns) -> torch.Tensor:
    b = torch.as_tensor(patterns, dtype=torch.int64)
    return torch.where(b >= 2**31, b - 2**32, b).to(torch.int32).view(torch.float32)


def all_nans(sign: int) -> torch.Tensor:
    """Every FP32 NaN of one sign: exponent all ones, mantissa 1 .. 2^23 - 1."""
    return from_u32((sign << 31) | 0x7F800000 | torch.arange(1, 1 << 23, dtype=torch.int64))


# NaN masters TransformerEngine's rule splits into a non-NaN BF16 (in brackets).
HIDDEN_NANS = [0x7FFFFFFF,  # CUDA's NaN (-0.0)
               0xFFFFFFFF,  # (+0.0)
               0x7FFF8000,  # (-0.0)
               0x7F800001,  # signalling (+inf)
               0xFF807FFF]  # (-inf)


def te_bf16_bits(master: torch.Tensor) -> torch.Tensor:
    b = u32(master)
    return ((b >> 16) + ((b & 0xFFFF) >= 0x8000).to(torch.int64)) & 0xFFFF


@pytest.mark.parametrize("sign", [0, 1])
def test_every_nan_master_splits_to_a_nan_param(sign):
    master = all_nans(sign)
    param, remainder = ops.split_master(master)
    assert torch.isnan(param.float()).all(), "a NaN master gave a non-NaN param"
    ref_param, ref_remainder = reference.split_master(master)
    assert_bit_equal(param, ref_param, "param vs reference")
    assert_bit_equal(remainder, ref_remainder, "remainder vs reference")

    # The remainder is the low half, as for every pattern.
    b = u32(master)
    assert torch.equal(remainder.to(torch.int64) & 0xFFFF, b & 0xFFFF)
    merged = ops.merge_master(param, remainder)
    assert_bit_equal(reference.merge_master(param, remainder), merged, "merge vs reference")
    assert torch.isnan(merged).all(), "a NaN master merged back to a number"
    m = u32(merged)
    # Same sign and low half; only where TransformerEngine's BF16 hid the NaN
    # does the high half move, by one, into the NaN range.
    assert torch.equal(m & 0x8000FFFF, b & 0x8000FFFF)
    hidden = ~torch.isnan(from_u32(te_bf16_bits(master) << 16))
    assert int(hidden.sum()) == 0x7FFF + 0x8000
    assert torch.equal(m == b, ~hidden)
    assert set(((m - b)[hidden]).unique().tolist()) == {0x10000, -0x10000}


def test_non_nan_patterns_round_trip_exactly():
    gen = torch.Generator().manual_seed(3)
    b = torch.randint(0, 2**32, (1 << 20,), dtype=torch.int64, generator=gen)
    b = torch.cat([b, torch.tensor([0, 0x80000000, 0x7F800000, 0xFF800000, 0x7F7FFFFF, 0x7F7F8000, 0x3F808000])])
    master = from_u32(b)
    master = master[~torch.isnan(master)]
    param, remainder = ops.split_master(master)
    assert_bit_equal(ops.merge_master(param, remainder), master, "round trip")
    assert not torch.isnan(param.float()).any(), "a number gave a NaN param"
    ref_param, ref_remainder = reference.split_master(master)
    assert_bit_equal(param, ref_param)
    assert_bit_equal(remainder, ref_remainder)


def te_pairs(patterns):
    """(param, remainder) as TransformerEngine's rule stores the masters: the
    state a checkpoint or an earlier version may hold; it merges to the master."""
    b = torch.as_tensor(patterns, dtype=torch.int64)
    hi = ((b >> 16) + ((b & 0xFFFF) >= 0x8000).to(torch.int64)) & 0xFFFF
    to_i16 = lambda x: torch.where(x >= 0x8000, x - 0x10000, x).to(torch.int16)  # noqa: E731
    return to_i16(hi).view(torch.bfloat16), to_i16(b & 0xFFFF)


def nan_state(n=1037):
    """n masters (vector body and scalar tail), finite except the hidden NaNs at the front."""
    gen = torch.Generator().manual_seed(0)
    finite = u32(torch.randn(n - len(HIDDEN_NANS), generator=gen))
    patterns = torch.cat([torch.tensor(HIDDEN_NANS, dtype=torch.int64), finite])
    param, remainder = te_pairs(patterns)
    assert_bit_equal(reference.merge_master(param, remainder), from_u32(patterns))
    return param, remainder, torch.isnan(from_u32(patterns))


def test_adamw_kernel_writes_nan_params_for_nan_masters():
    param, remainder, nan = nan_state()
    grad = torch.full(param.shape, 0.5)
    ops.adamw_step([param], [grad], [torch.zeros(param.shape)], [torch.zeros(param.shape)], [torch.zeros(())],
                   masters=[remainder], lr=1e-3)
    master = reference.merge_master(param, remainder)
    assert torch.equal(torch.isnan(master), nan)
    assert torch.equal(torch.isnan(param.float()), nan), "the BF16 param hides a NaN master"


@pytest.mark.parametrize("shape", [(37, 28), (28, 37)])
def test_muon_kernels_write_nan_params_for_nan_masters(shape):
    rows, cols = shape
    param, remainder, nan = nan_state(rows * cols)
    param, remainder, nan = param.view(shape), remainder.view(shape), nan.view(shape)
    grad = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    stat = torch.zeros((rows, 1) if rows >= cols else (1, cols))
    fused_param, fused_rem = param.clone(), remainder.clone()
    ops.muon_step([fused_param], [grad], [torch.zeros(shape)], [stat.clone()], masters=[fused_rem], lr=0.02)
    assert torch.equal(torch.isnan(fused_param.float()), nan), "fused step: the BF16 param hides a NaN master"
    update = torch.randn(shape)
    ops.muon_apply([param], [update], masters=[remainder], lr=0.02, weight_decay=0.1)
    assert torch.equal(torch.isnan(param.float()), nan), "muon_apply: the BF16 param hides a NaN master"


def _update_param_kwargs(opt):
    # update_param refuses non-finite values by default; the opt-out keeps
    # this test about the split.
    return {"allow_nonfinite": True} if "allow_nonfinite" in inspect.signature(opt.update_param).parameters else {}


def test_optimizer_never_shows_a_nan_master_as_a_number():
    """shared repro: update_param with NaN masters, then a step."""
    w = torch.nn.Parameter(torch.ones(2, 3, dtype=torch.bfloat16))
    opt = muon_ext.MuonAdamW([dict(params=[w], kind="adamw")])
    values = from_u32(HIDDEN_NANS + [0x7FC00000]).reshape(2, 3)
    opt.update_param(w, values, **_update_param_kwargs(opt))
    assert torch.isnan(w.detach().float()).all()
    assert torch.isnan(opt.get_full_parameter_master(w)).all()
    w.grad = torch.ones_like(w)
    opt.step()
    assert torch.isnan(w.detach().float()).all()
    assert torch.isnan(opt.get_full_parameter_master(w)).all()


@pytest.mark.gpu
@pytest.mark.parametrize("sign", [0, 1])
def test_cuda_split_matches_cpu_on_every_nan(sign):
    master = all_nans(sign)
    param, remainder = ops.split_master(master.cuda())
    cpu_param, cpu_remainder = ops.split_master(master)
    assert_bit_equal(param.cpu(), cpu_param)
    assert_bit_equal(remainder.cpu(), cpu_remainder)
    assert torch.isnan(ops.merge_master(param, remainder)).all()


@pytest.mark.gpu
def test_cuda_kernels_write_nan_params_for_nan_masters():
    param, remainder, nan = nan_state()
    param, remainder = param.cuda(), remainder.cuda()
    ops.adamw_step([param], [torch.full(param.shape, 0.5, device="cuda")], [torch.zeros(param.shape, device="cuda")],
                   [torch.zeros(param.shape, device="cuda")], [torch.zeros((), device="cuda")], masters=[remainder],
                   lr=1e-3)
    assert torch.equal(torch.isnan(param.float()).cpu(), nan)
    shape = (37, 28)
    p, r, n = nan_state(shape[0] * shape[1])
    p, r = p.view(shape).cuda(), r.view(shape).cuda()
    ops.muon_step([p], [torch.randn(shape, device="cuda")], [torch.zeros(shape, device="cuda")],
                  [torch.zeros(shape[0], 1, device="cuda")], masters=[r], lr=0.02)
    assert torch.equal(torch.isnan(p.float()).cpu(), n.view(shape))
