"""The small-matrix Polar-Express kernel (csrc/cpu/polar_small.h): shapes with
min(rows, cols)^2 * max(rows, cols) <= 2^20 run eight matrices per SIMD vector
instead of BLAS calls.

It must compute the reference iteration (the BF16 rounding points included), and
give every matrix the same bits whatever its lane, group or neighbours.
Thread-count independence is in test_reproducibility.py (shapes 1x1, 8x8, 40x24).
"""

import pytest
import torch

from muon_ext import ops, reference

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
    updates = torch.randn((11,) + shape, generator=gen)
    x0 = scaled_input(updates)
    bf16 = orthogonalize(updates, "bfloat16")
    torch.testing.assert_close(bf16, reference.polar_express(x0, COEFFICIENTS, bf16=True), rtol=0, atol=2.0**-7)
    assert torch.equal(bf16, bf16.bfloat16().float()), "BF16 path: X leaves as BF16 values"
    fp32 = orthogonalize(updates, "float32")
    torch.testing.assert_close(fp32, reference.polar_express(x0.double(), COEFFICIENTS).float(), rtol=0, atol=1e-4)


@pytest.mark.parametrize("polar_dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("shape", [(1, 1), (8, 8), (5, 9), (40, 24)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_a_matrix_gets_the_same_bits_in_any_lane_and_group(shape, polar_dtype):
    """19 matrices fill two groups of eight and three lanes of a third: each one
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
