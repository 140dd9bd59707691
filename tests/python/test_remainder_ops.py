"""ops.split_master / ops.merge_master against the reference, on every kind of bit pattern."""

import pytest
import torch

from support.helpers import assert_bit_equal
from muon_ext import ops, reference

EDGE_BITS = [0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x7FFF8000, 0x7FC00000, 0x7F7FFFFF, 0xFFFF8000,
             0x3F808000, 0x3F818000, 0x0000FFFF, 0x00008000, 0x80008000, 0x7FFFFFFF, 0xFFFFFFFF]


def patterns(device="cpu"):
    gen = torch.Generator().manual_seed(0)
    random_bits = torch.randint(-2**31, 2**31, (100003,), dtype=torch.int64, generator=gen)
    edges = torch.tensor([b - 2**32 if b >= 2**31 else b for b in EDGE_BITS], dtype=torch.int64)
    return torch.cat([edges, random_bits]).to(torch.int32).view(torch.float32).to(device)


def test_split_and_merge_match_reference_and_round_trip():
    master = patterns()
    param, remainder = ops.split_master(master)
    ref_param, ref_remainder = reference.split_master(master)
    assert_bit_equal(param, ref_param, "param")
    assert_bit_equal(remainder, ref_remainder, "remainder")
    merged = ops.merge_master(param, remainder)
    nan = torch.isnan(master)
    assert_bit_equal(merged[~nan], master[~nan], "round trip")
    assert torch.isnan(merged[nan]).all() and torch.isnan(param[nan].float()).all()
    # The documented NaN case: 0x7FFF8000 -> BF16 0x7FFF (a NaN; TransformerEngine's
    # rule gives -0.0) with remainder -32768 (docs/design.md, "Master weights and remainders").
    assert param.view(torch.int16)[4].item() == 0x7FFF and remainder[4].item() == -32768


def test_split_writes_into_given_tensors():
    master = torch.randn(4, 5)
    param, remainder = torch.empty(4, 5, dtype=torch.bfloat16), torch.empty(4, 5, dtype=torch.int16)
    out = ops.split_master(master, param, remainder)
    assert out[0] is param and out[1] is remainder
    assert_bit_equal(ops.merge_master(param, remainder), master)


@pytest.mark.parametrize("bad, fragment", [
    (dict(master=torch.zeros(3, dtype=torch.float64)), "master must be float32"),
    (dict(param=torch.zeros(3, dtype=torch.float16)), "param must be bfloat16"),
    (dict(remainder=torch.zeros(3, dtype=torch.int32)), "remainder must be int16"),
    (dict(remainder=torch.zeros(4, dtype=torch.int16)), "remainder has shape"),
    (dict(param=torch.zeros(6, dtype=torch.bfloat16)[::2]), "must be contiguous"),
])
def test_bad_input_raises_and_writes_nothing(bad, fragment):
    args = dict(master=torch.ones(3), param=torch.zeros(3, dtype=torch.bfloat16),
                remainder=torch.zeros(3, dtype=torch.int16))
    args.update(bad)
    before = [t.clone() for t in args.values()]
    with pytest.raises((TypeError, ValueError), match=fragment):
        ops.split_master(args["master"], args["param"], args["remainder"])
    for t, b in zip(args.values(), before):
        assert torch.equal(t, b)


@pytest.mark.gpu
def test_cuda_split_and_merge_match_cpu():
    master = patterns("cuda")
    param, remainder = ops.split_master(master)
    ref_param, ref_remainder = ops.split_master(master.cpu())
    assert_bit_equal(param.cpu(), ref_param)
    assert_bit_equal(remainder.cpu(), ref_remainder)
    assert_bit_equal(ops.merge_master(param, remainder).cpu(), ops.merge_master(ref_param, ref_remainder))
