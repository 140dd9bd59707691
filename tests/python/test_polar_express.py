"""Orthogonalization quality of Polar-Express (CPU kernel in FP32 and BF16; reference BF16 twin).

Polar-Express with the five default tuples maps every singular value of the
normalized input that is not tiny into a band around 1 rather than onto 1.
Measured here (seed 0) on Gaussian 256x256, 128x512, 512x128, 37x91, 520x1100 and on
matrices with singular values log-spaced over 1e-3..1 (256x256, 128x384,
300x100), FP32 kernel and BF16 twin alike (the BF16 kernel passes the same bounds):
  largest output singular value            1.1409 .. 1.1430
  smallest, inputs with sigma/sigma_max > 0.01   0.8576 .. 0.9058
  relative Frobenius distance to U V^T      Gaussian 0.091 .. 0.109, ill-conditioned 0.20 .. 0.28
  spectral distance to U V^T on the span of those singular vectors   <= 0.1436
      (FP32 kernel), <= 0.1476 (BF16 twin, ill-conditioned 300x100)
The bounds below leave a margin of 0.007 .. 0.013 over these figures.
"""

import pytest
import torch

from muon_ext import ops, reference

SV_MAX = 1.155
SV_MIN_ABOVE_THRESHOLD = 0.845
THRESHOLD = 0.01
SPECTRAL_DIST_ON_SPAN = 0.155


def orthogonalize_with_kernel(g: torch.Tensor, polar_dtype: str = "float32") -> torch.Tensor:
    """The kernel's Polar-Express output: with momentum 0, no NorMuon, no decay,
    lr' = 1 and a zero param, the step writes exactly -X."""
    p, mom = torch.zeros_like(g), torch.zeros_like(g)
    ops.muon_step([p], [g], [mom], lr=1.0, momentum=0.0, beta2=None, weight_decay=0.0, lr_scale="none",
                  polar_dtype=polar_dtype)
    return -p


def orthogonalize_bf16_twin(g: torch.Tensor) -> torch.Tensor:
    x = g / (g.norm() * 1.02 + 1e-6)
    return reference.polar_express(x[None], reference.POLAR_EXPRESS_COEFFICIENTS, bf16=True)[0]


def ill_conditioned(rows, cols, smallest, gen):
    u, _ = torch.linalg.qr(torch.randn(rows, rows, dtype=torch.float64, generator=gen))
    v, _ = torch.linalg.qr(torch.randn(cols, cols, dtype=torch.float64, generator=gen))
    k = min(rows, cols)
    s = torch.logspace(0, torch.log10(torch.tensor(smallest)).item(), k, dtype=torch.float64)
    return ((u[:, :k] * s) @ v[:k, :]).float()


def cases():
    gen = torch.Generator().manual_seed(0)
    out = {f"gauss_{r}x{c}": torch.randn(r, c, generator=gen) for r, c in [(256, 256), (128, 512), (512, 128), (37, 91), (520, 1100)]}
    out.update({f"ill_{r}x{c}": ill_conditioned(r, c, 1e-3, gen) for r, c in [(256, 256), (128, 384), (300, 100)]})
    return out


CASES = cases()


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("implementation", ["kernel_fp32", "kernel_bf16", "reference_bf16"])
def test_polar_express_quality(name, implementation):
    g = CASES[name]
    if implementation == "reference_bf16":
        x = orthogonalize_bf16_twin(g).double()
    else:
        x = orthogonalize_with_kernel(g, "float32" if implementation == "kernel_fp32" else "bfloat16").double()
    u, s, vh = torch.linalg.svd(g.double(), full_matrices=False)
    polar = u @ vh
    out_sv = torch.linalg.svdvals(x)
    assert out_sv.max() <= SV_MAX
    keep = s / s.max() > THRESHOLD
    # Singular values of X along the kept input directions: X v_i has norm ~ sigma_i(X).
    kept = torch.linalg.svdvals(x @ vh[keep].T)
    assert kept.min() >= SV_MIN_ABOVE_THRESHOLD
    assert torch.linalg.matrix_norm((x - polar) @ vh[keep].T, ord=2) <= SPECTRAL_DIST_ON_SPAN
    relative = ((x - polar).norm() / polar.norm()).item()
    assert relative <= (0.12 if name.startswith("gauss") else 0.30)


def test_polar_express_is_scale_invariant_and_sign_equivariant():
    g = CASES["gauss_37x91"]
    a = orthogonalize_with_kernel(g)
    torch.testing.assert_close(orthogonalize_with_kernel(g * 1000), a, rtol=0, atol=1e-5)
    torch.testing.assert_close(orthogonalize_with_kernel(-g), -a, rtol=0, atol=0)


@pytest.mark.parametrize("name", [n for n in CASES if n.startswith("gauss")])
def test_fp32_kernel_and_bf16_twin_agree_to_bf16_noise(name):
    """The CUDA rounding (BF16 per GEMM) against FP32 on Gaussian inputs:
    measured relative Frobenius difference 0.012 .. 0.015 (a few BF16 steps of
    2^-8 accumulated over 15 GEMMs), allowed 0.025. Ill-conditioned inputs
    differ more (0.04 .. 0.09): small singular values are where BF16 loses most."""
    g = CASES[name]
    a, b = orthogonalize_with_kernel(g), orthogonalize_bf16_twin(g)
    assert ((a - b).norm() / a.norm()).item() < 0.025


def _bf16_iterations_in_float64(x, coefficients):
    """The BF16 rounding contract written independently: exact products and
    sums (float64), each GEMM output (A, B, X) rounded to BF16 once."""
    def gemm_out(t):
        return t.to(torch.bfloat16).double()

    x = x.double().to(torch.bfloat16).double()
    wide = x.shape[-2] <= x.shape[-1]
    for a, b, c in coefficients:
        a, b, c = (float(torch.tensor(v, dtype=torch.float32)) for v in (a, b, c))
        gram = gemm_out(x @ x.mT if wide else x.mT @ x)
        poly = gemm_out(b * gram + c * (gram @ gram))
        x = gemm_out(a * x + (poly @ x if wide else x @ poly))
    return x.float()


@pytest.mark.parametrize("shape", [(24, 40), (40, 24), (32, 32)])
def test_bf16_twin_rounds_every_gemm_output(shape):
    """reference.polar_express(bf16=True) is the CUDA path's twin: its output is
    BF16-representable and matches an independent float64 computation with the
    same three roundings per iteration. Measured: relative Frobenius distance
    0 .. 1.1e-5 (FP32 vs exact accumulation before rounding rarely flips a BF16
    ulp); without the rounding of A it is 0.024 .. 0.027. Allowed 0.005."""
    g = torch.randn(shape, generator=torch.Generator().manual_seed(3))
    x = (g / (g.norm() * 1.02 + 1e-6))[None]
    twin = reference.polar_express(x, reference.POLAR_EXPRESS_COEFFICIENTS, bf16=True)
    assert torch.equal(twin, twin.bfloat16().float())
    independent = _bf16_iterations_in_float64(x, reference.POLAR_EXPRESS_COEFFICIENTS)
    assert ((twin - independent).norm() / independent.norm()).item() < 0.005
