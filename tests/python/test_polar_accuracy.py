"""Polar-Express precision (polar_dtype) against an FP64 SVD polar factor U V^T.

Polar-Express maps singular values into a band around 1 (0.86..1.14, see
test_polar_express.py) and leaves those far below the largest short of it, so
every precision sits ~0.09 (condition 1e6: ~0.68) away from U V^T; the
precision changes the rounding noise on top. Measured (seed 0, relative
Frobenius error, 96x200 on the small-matrix kernel, 300x200 on BLAS; table:
bench/polar_accuracy.py): float16 within 1.001x of float32 and bfloat16 within
1.03x on random, condition-1e6, tiny- and huge-norm matrices. Rank 8: the
rounding noise in the null space is amplified by the iteration: float32 0.088 /
0.064, float16 0.117 / 0.103, bfloat16 0.62 / 0.65 (a BF16 outlier that FP16
cures). A zero matrix gives exactly zero.
"""

import pytest
import torch

from muon_ext import ops, reference
from muon_ext.testing import accuracy_cases, kernel_output, relative_error

SHAPES = [(96, 200), (300, 200)]


@pytest.fixture(scope="module", params=SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def errors(request):
    rows, cols = request.param
    cases = accuracy_cases(rows, cols)
    return {(name, dtype): relative_error(g, lambda m, d=dtype: kernel_output(m, d))
            for name, g in cases.items() for dtype in ("float32", "bfloat16", "float16")}


@pytest.mark.parametrize("case", ["random", "ill_conditioned_1e6", "tiny_norm_1e-3", "huge_norm_1e4"])
def test_16_bit_precisions_add_little_error_on_full_rank_matrices(errors, case):
    fp32, bf16, fp16 = (errors[(case, d)] for d in ("float32", "bfloat16", "float16"))
    assert 0 < fp32 < 0.75, (case, fp32)
    assert fp16 <= 1.01 * fp32, (case, fp16, fp32)
    assert bf16 <= 1.05 * fp32, (case, bf16, fp32)


def test_float16_cures_the_bfloat16_outlier_on_rank_deficient_matrices(errors):
    fp32, bf16, fp16 = (errors[("rank_8", d)] for d in ("float32", "bfloat16", "float16"))
    assert 0 < fp32 < 0.15 and fp16 <= 2 * fp32, (fp32, fp16)
    assert fp16 <= 0.5 * bf16, (fp16, bf16)


def test_zero_matrix_gives_zero(errors):
    for dtype in ("float32", "bfloat16", "float16"):
        assert errors[("zero", dtype)] == 0.0, dtype


@pytest.mark.parametrize("shape", [(8, 8), (300, 200)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_float16_output_is_fp16_values_and_follows_the_twin(shape):
    """Every GEMM output rounded to FP16 (X leaves as FP16 values), at the
    reference twin's rounding points: within an FP16 ulp of values ~1."""
    gen = torch.Generator().manual_seed(1)
    u = torch.randn((3,) + shape, generator=gen)
    x = u.clone()
    ops.muon_orthogonalize([x], beta2=None, polar_dtype="float16")
    assert torch.equal(x, x.half().float())
    x0 = u * (1.0 / (u.flatten(1).double().square().sum(1).float().sqrt() * 1.02 + 1e-6))[:, None, None]
    twin = reference.polar_express(x0, reference.POLAR_EXPRESS_COEFFICIENTS, fp16=True)
    torch.testing.assert_close(x, twin, rtol=0, atol=2.0 ** -9)


# Gram Newton-Schulz (polar_method="gram") against the standard iteration, at
# the same polar_dtype, on the BLAS path (wide and tall) and the small-matrix
# SIMD path. Measured gram/standard error ratios (seed 0; restarts before
# iteration 2 in FP32, before 2 and 4 in BF16 / FP16): float32 1.000, float16
# 0.925 .. 1.003, bfloat16 0.843 .. 1.060 (rank 8 always below 1). Restarting
# only before iteration 3 left a BF16 rank-8 40x160 matrix at 6.07 against
# 0.57; FP16 restarting before 2 only, 160x40 rank 8 at 1.105x (docs/design.md,
# "Gram Newton-Schulz").
GRAM_SHAPES = [(200, 800), (800, 200), (160, 40)]


@pytest.fixture(scope="module", params=GRAM_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def gram_errors(request):
    rows, cols = request.param
    return {(name, dtype, method): relative_error(g, lambda m, d=dtype, k=method: kernel_output(m, d, k))
            for name, g in accuracy_cases(rows, cols).items() for dtype in ("float32", "bfloat16", "float16")
            for method in ("standard", "gram")}


@pytest.mark.parametrize("case", ["random", "ill_conditioned_1e6", "rank_8", "tiny_norm_1e-3", "huge_norm_1e4"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_gram_error_within_1_1x_of_standard(gram_errors, case, dtype):
    standard, gram = gram_errors[(case, dtype, "standard")], gram_errors[(case, dtype, "gram")]
    assert 0 < gram <= 1.1 * standard, (case, dtype, gram, standard)


def test_gram_gives_zero_for_a_zero_matrix(gram_errors):
    for dtype in ("float32", "bfloat16", "float16"):
        assert gram_errors[("zero", dtype, "gram")] == 0.0, dtype
