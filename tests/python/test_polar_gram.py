"""Gram Newton-Schulz (polar_method="gram" / "auto"): the kernels against the
reference twin, bit-stability, the "auto" rule, the op and group settings.

Accuracy against an SVD polar factor is in test_polar_accuracy.py; the plan's
layout (every GEMM, in exact arithmetic the standard polynomial) in
tests/cpp/test_polar_plan.cpp.
"""

import pytest
import torch

from muon_ext import MuonAdamW, ops, reference

# Small (SIMD lanes, min^2 * max <= 2^20) and BLAS-path shapes, wide and tall.
SHAPES = [(8, 40), (40, 8), (200, 800), (800, 200)]


def scaled(u: torch.Tensor) -> torch.Tensor:
    """The kernels' input scale, for the twin."""
    return u * (1.0 / (u.flatten(1).double().square().sum(1).float().sqrt() * 1.02 + 1e-6))[:, None, None]


def orthogonalize(u: torch.Tensor, polar_dtype: str, polar_method: str, ns_steps: int = 5) -> torch.Tensor:
    x = u.clone()
    coefficients = reference.POLAR_EXPRESS_COEFFICIENTS + reference.POLAR_EXPRESS_COEFFICIENTS[-1:] * 2
    ops.muon_orthogonalize([x], beta2=None, polar_dtype=polar_dtype, polar_method=polar_method, ns_steps=ns_steps,
                           ns_coefficients=coefficients)
    return x


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("ns_steps", [5, 7], ids=["five_steps", "seven_steps"])
def test_kernel_follows_the_twin(shape, ns_steps):
    """FP32: within accumulation-order noise of reference.polar_express_gram
    (measured max |diff| <= 2e-6). BF16: every output a BF16 value, at the
    twin's rounding points: measured relative Frobenius difference up to 0.042
    (8x40, two restarts; the standard kernel: <= 0.008; the kernels
    mirror each symmetric product's upper triangle, the twin multiplies out
    both, and the Gram products pass such ulp differences on)."""
    u = torch.randn((3,) + shape, generator=torch.Generator().manual_seed(5))
    coefficients = (reference.POLAR_EXPRESS_COEFFICIENTS + reference.POLAR_EXPRESS_COEFFICIENTS[-1:] * 2)[:ns_steps]
    twin32 = reference.polar_express_gram(scaled(u), coefficients)
    torch.testing.assert_close(orthogonalize(u, "float32", "gram", ns_steps), twin32, rtol=0, atol=2e-5)
    x16 = orthogonalize(u, "bfloat16", "gram", ns_steps)
    assert torch.equal(x16, x16.bfloat16().float())
    twin16 = reference.polar_express_gram(scaled(u), coefficients, bf16=True)
    assert (x16 - twin16).abs().max().item() < 0.08
    assert ((x16 - twin16).norm() / twin16.norm()).item() < 0.06


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_gram_and_standard_agree_in_fp32(shape):
    """The same polynomial: FP32 results differ by rounding only (measured <= 4e-6)."""
    u = torch.randn((2,) + shape, generator=torch.Generator().manual_seed(6))
    gram, standard = orthogonalize(u, "float32", "gram"), orthogonalize(u, "float32", "standard")
    torch.testing.assert_close(gram, standard, rtol=0, atol=2e-5)
    assert not torch.equal(gram, standard)  # another plan, not the standard one under another name


@pytest.mark.parametrize("shape", [(8, 40), (200, 800), (800, 200)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("polar_dtype", ["float32", "bfloat16"])
def test_bits_do_not_depend_on_threads_or_batching(shape, polar_dtype):
    u = torch.randn((3,) + shape, generator=torch.Generator().manual_seed(7))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = orthogonalize(u, polar_dtype, "gram")
        torch.set_num_threads(2)
        two = orthogonalize(u, polar_dtype, "gram")
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    for j in range(u.shape[0]):
        assert torch.equal(orthogonalize(u[j:j + 1], polar_dtype, "gram"), one[j:j + 1]), f"matrix {j} alone"


def test_auto_follows_the_one_rule():
    assert ops.polar_method_for("auto", 512, 2048) == "gram"
    assert ops.polar_method_for("auto", 2048, 512) == "gram"
    assert ops.polar_method_for("auto", 512, 2047) == "standard"  # aspect ratio below 4
    assert ops.polar_method_for("auto", 256, 4096) == "standard"  # short side below 512
    assert ops.polar_method_for("gram", 8, 8) == "gram"
    assert ops.polar_method_for("standard", 128, 4096) == "standard"
    with pytest.raises(ValueError, match="polar_method must be 'standard', 'gram' or 'auto', got 'fast'"):
        ops.polar_method_for("fast", 4, 4)
    for shape, picked in [((512, 2048), "gram"), ((40, 160), "standard")]:
        u = torch.randn((1,) + shape, generator=torch.Generator().manual_seed(8))
        assert torch.equal(orthogonalize(u, "bfloat16", "auto"), orthogonalize(u, "bfloat16", picked)), shape


def test_op_refuses_an_unknown_method_before_writing():
    x = torch.randn(1, 8, 40)
    before = x.clone()
    with pytest.raises(ValueError, match="muon_orthogonalize: polar_method must be 'standard', 'gram' or 'auto'"):
        ops.muon_orthogonalize([x], beta2=None, polar_method="Gram")
    assert torch.equal(x, before)
    p, g, m = torch.zeros(8, 40), torch.randn(8, 40), torch.zeros(8, 40)
    with pytest.raises(ValueError, match="muon_step: polar_method must be"):
        ops.muon_step([p], [g], [m], lr=0.1, beta2=None, polar_method="")
    assert torch.equal(p, torch.zeros(8, 40)) and torch.equal(m, torch.zeros(8, 40))


def test_group_setting_checked_and_reaching_the_kernel():
    with pytest.raises(ValueError, match="unknown polar_method 'gramm'"):
        MuonAdamW([{"params": [torch.nn.Parameter(torch.randn(8, 40))], "kind": "muon", "polar_method": "gramm"}])
    w = torch.nn.Parameter(torch.randn(200, 800))
    opt = MuonAdamW([{"params": [w], "kind": "muon", "lr": 0.02, "beta2": None, "polar_method": "gram",
                      "polar_dtype": "float32", "weight_decay": 0.0}], master_weights=False)
    assert opt.param_groups[0]["polar_method"] == "gram"
    start = w.detach().clone()
    w.grad = torch.randn(200, 800, generator=torch.Generator().manual_seed(9))
    opt.step()
    expected, mom = start.clone(), torch.zeros_like(start)
    ops.muon_step([expected], [w.grad], [mom], lr=0.02, beta2=None, weight_decay=0.0, polar_dtype="float32",
                  polar_method="gram")
    assert torch.equal(w.detach(), expected)
    standard = start.clone()
    ops.muon_step([standard], [w.grad], [torch.zeros_like(start)], lr=0.02, beta2=None, weight_decay=0.0,
                  polar_dtype="float32")
    assert not torch.equal(w.detach(), standard)
    assert MuonAdamW([{"params": [torch.nn.Parameter(torch.randn(4, 4))], "kind": "muon"}]).param_groups[0][
        "polar_method"] == "standard"


def test_reference_step_resolves_auto_like_the_kernel():
    """reference.muon_step picks the iteration by the same rule: its "auto"
    equals its "gram" on a qualifying shape and its "standard" elsewhere."""
    for shape, picked in [((512, 2048), "gram"), ((16, 64), "standard")]:
        g = torch.randn(shape, generator=torch.Generator().manual_seed(10))
        results = {}
        for method in ("auto", picked):
            p, m = torch.zeros(shape), torch.zeros(shape)
            reference.muon_step([p], [g], [m], lr=0.1, beta2=None, polar_dtype="float32", polar_method=method)
            results[method] = p
        assert torch.equal(results["auto"], results[picked]), shape


def test_opcheck_with_gram():
    flat = [v for abc in ops.POLAR_EXPRESS_COEFFICIENTS for v in abc]
    updates = [torch.randn(6, 30), torch.randn(6, 30)]
    torch.library.opcheck(torch.ops.muon_ext.muon_orthogonalize.default,
                          ([u.clone() for u in updates], [torch.zeros(1, 30) for _ in range(2)]),
                          dict(beta2=0.95, ns_steps=5, ns_coefficients=flat, max_workspace_bytes=1 << 20,
                               polar_row_blocks=None, polar_dtype="bfloat16", polar_method="gram", found_inf=None))


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(64, 256), (256, 64), (300, 1200)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("polar_dtype", ["float32", "bfloat16"])
def test_cuda_follows_the_twin(shape, polar_dtype):
    """The CUDA plan (cuBLAS batched GEMMs, the same polar_gram_plan) against
    the twin: FP32 to accumulation noise, BF16 to a few BF16 ulps."""
    u = torch.randn((4,) + shape, generator=torch.Generator().manual_seed(11))
    x = u.cuda()
    ops.muon_orthogonalize([x], beta2=None, polar_dtype=polar_dtype, polar_method="gram")
    twin = reference.polar_express_gram(scaled(u), reference.POLAR_EXPRESS_COEFFICIENTS,
                                        bf16=polar_dtype == "bfloat16")
    tolerance = 1e-4 if polar_dtype == "float32" else 0.05
    assert (x.cpu() - twin).abs().max().item() < tolerance
