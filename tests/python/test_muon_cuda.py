"""The CUDA Muon kernel against the CPU kernel and the BF16 reference twin (GPU only)."""

import pytest
import torch

from support.helpers import assert_bit_equal, fp32_master
from muon_ext import ops, reference
from support.muon_helpers import make_muon_grads, make_muon_set

pytestmark = pytest.mark.gpu

SHAPES = {
    "wide": [(64, 160)] * 5,
    "tall": [(160, 64)] * 5,
    "square": [(128, 128)] * 3,
    "odd": [(3, 5)] * 16,
    "one": [(1, 1)] * 2,
    "odd_tall": [(257, 129)] * 2,
    "experts": [(4, 96, 48)],
}


def _run(shapes, mode, device, steps=3, twin=False, **hyper):
    s = make_muon_set(shapes, mode).to(device)
    for k in range(steps):
        grads = [g.to(device) for g in make_muon_grads(shapes, seed=k)]
        if twin:
            reference.muon_step(*s.args(grads), **s.kwargs(), polar_dtype="bfloat16", **hyper)
        else:
            ops.muon_step(*s.args(grads), **s.kwargs(), **hyper)
    return s


@pytest.mark.parametrize("kind", list(SHAPES))
@pytest.mark.parametrize("mode", ["fp32", "bf16_remainder", "bf16_fp32_master"])
def test_cuda_matches_bf16_reference_twin(kind, mode):
    """BF16 GEMMs on both sides, different accumulation order inside cuBLAS:
    the updates agree to BF16 noise. The momentum (pure FP32 elementwise math
    shared with the CPU) must agree bit for bit."""
    shapes = SHAPES[kind]
    gpu = _run(shapes, mode, "cuda", lr=0.02)
    twin = _run(shapes, mode, "cpu", twin=True, lr=0.02)
    for i in range(len(shapes)):
        assert_bit_equal(gpu.momentum_buffers[i].cpu(), twin.momentum_buffers[i], f"momentum[{i}]")
        start = make_muon_set(shapes, mode).params[i].float()
        delta_gpu = fp32_master(gpu.to("cpu"), i) - start
        delta_twin = fp32_master(twin, i) - start
        assert ((delta_gpu - delta_twin).norm() / delta_twin.norm()).item() < 0.05


@pytest.mark.parametrize("kind", ["wide", "tall", "odd_tall", "experts"])
@pytest.mark.parametrize("row_blocks", [2, 3, 64])
def test_block_triangular_products_match_plain_gemms(kind, row_blocks):
    """polar_row_blocks > 1 runs the block-upper GEMMs and the mirror kernel:
    same math as plain GEMMs, different BF16 roundings (as between two GEMM
    algorithms), so updates agree to BF16 noise; reruns are bit-identical."""
    shapes = SHAPES[kind]
    plain = _run(shapes, "bf16_remainder", "cuda", lr=0.02, polar_row_blocks=1)
    blocked = _run(shapes, "bf16_remainder", "cuda", lr=0.02, polar_row_blocks=row_blocks)
    again = _run(shapes, "bf16_remainder", "cuda", lr=0.02, polar_row_blocks=row_blocks)
    start = make_muon_set(shapes, "bf16_remainder").params
    for i in range(len(shapes)):
        d_plain = fp32_master(plain.to("cpu"), i) - start[i].float()
        d_blocked = fp32_master(blocked.to("cpu"), i) - start[i].float()
        assert ((d_blocked - d_plain).norm() / d_plain.norm()).item() < 0.05
    for x, y in zip(blocked.tensors(), again.tensors()):
        assert_bit_equal(x, y)


def test_cuda_matches_cpu_kernel_to_bf16_noise():
    shapes = SHAPES["wide"]
    gpu = _run(shapes, "fp32", "cuda", lr=0.02)
    cpu = _run(shapes, "fp32", "cpu", lr=0.02)
    start = make_muon_set(shapes).params
    for i in range(len(shapes)):
        d_gpu, d_cpu = gpu.params[i].cpu() - start[i], cpu.params[i] - start[i]
        assert ((d_gpu - d_cpu).norm() / d_cpu.norm()).item() < 0.05


def test_ns_steps_zero_matches_cpu_closely():
    # No GEMMs: only the BF16 rounding of the scaled input separates the paths.
    shapes = SHAPES["tall"]
    gpu = _run(shapes, "fp32", "cuda", ns_steps=0, lr=0.02)
    twin = _run(shapes, "fp32", "cpu", twin=True, ns_steps=0, lr=0.02)
    for i in range(len(shapes)):
        torch.testing.assert_close(gpu.params[i].cpu(), twin.params[i], rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(gpu.second_momentum_buffers[i].cpu(), twin.second_momentum_buffers[i],
                                   rtol=1e-5, atol=0)


def test_two_runs_identical_and_chunking_close():
    """Same inputs, same bits (deterministic reductions, no atomics). Chunking
    changes the cuBLAS batch count, and cuBLAS may pick another kernel for
    another batch count, so chunked runs are only held to BF16 noise."""
    shapes = [(96, 200)] * 9
    a = _run(shapes, "bf16_remainder", "cuda", lr=0.02)
    b = _run(shapes, "bf16_remainder", "cuda", lr=0.02)
    c = _run(shapes, "bf16_remainder", "cuda", lr=0.02, max_workspace_bytes=2 * 96 * 200 * 2)
    for x, y in zip(a.tensors(), b.tensors()):
        assert_bit_equal(x, y, "rerun")
    start = make_muon_set(shapes, "bf16_remainder").params
    for i in range(len(shapes)):
        d_a = fp32_master(a.to("cpu"), i) - start[i].float()
        d_c = fp32_master(c.to("cpu"), i) - start[i].float()
        assert ((d_a - d_c).norm() / d_a.norm()).item() < 0.02


def test_more_matrices_than_one_cublas_batch():
    """70000 matrices of 8x8 in one tensor: the default workspace would hold all
    of them, but a chunk is capped at 65535 matrices (some cuBLAS versions fail
    above that batch count). Agrees with small forced chunks and with the CPU
    kernel to BF16 noise."""
    shapes = [(70000, 8, 8)]
    start = make_muon_set(shapes, "fp32").params[0]
    deltas = []
    for device, workspace in (("cuda", 1 << 30), ("cuda", 8 << 20), ("cpu", 1 << 30)):
        s = _run(shapes, "fp32", device, steps=1, lr=0.02, max_workspace_bytes=workspace)
        deltas.append(fp32_master(s.to("cpu"), 0) - start)
    for other in deltas[1:]:
        assert ((deltas[0] - other).norm() / deltas[0].norm()).item() < 0.02


def test_no_host_sync_and_found_inf():
    shapes = SHAPES["square"]
    s = make_muon_set(shapes, "bf16_remainder").to("cuda")
    grads = [g.cuda() for g in make_muon_grads(shapes)]
    before = [t.clone() for t in s.tensors()]
    lr = torch.tensor([0.02], device="cuda")
    found_inf = torch.tensor([1.0], device="cuda")
    inv_scale = torch.tensor([1.0], device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        ops.muon_step(*s.args(grads), **s.kwargs(), lr=lr, inv_scale=inv_scale, found_inf=found_inf)
        after_skip = [t.clone() for t in s.tensors()]
        found_inf.zero_()
        ops.muon_step(*s.args(grads), **s.kwargs(), lr=lr, inv_scale=inv_scale, found_inf=found_inf)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for a, b in zip(after_skip, before):
        assert_bit_equal(a, b, "found_inf step")
    assert not torch.equal(s.params[0], before[0])


def test_polar_express_quality_on_gpu():
    from test_polar_express import CASES, SPECTRAL_DIST_ON_SPAN, SV_MAX, SV_MIN_ABOVE_THRESHOLD, THRESHOLD

    for name, g in CASES.items():
        p, mom = torch.zeros_like(g).cuda(), torch.zeros_like(g).cuda()
        ops.muon_step([p], [g.cuda()], [mom], lr=1.0, momentum=0.0, beta2=None, weight_decay=0.0, lr_scale="none")
        x = -p.double().cpu()
        u, s, vh = torch.linalg.svd(g.double(), full_matrices=False)
        keep = s / s.max() > THRESHOLD
        assert torch.linalg.svdvals(x).max() <= SV_MAX, name
        assert torch.linalg.svdvals(x @ vh[keep].T).min() >= SV_MIN_ABOVE_THRESHOLD, name
        assert torch.linalg.matrix_norm((x - u @ vh) @ vh[keep].T, ord=2) <= SPECTRAL_DIST_ON_SPAN, name


@pytest.mark.parametrize("kind", ["wide", "tall", "odd_tall", "experts"])
def test_fp32_polar_express_matches_the_cpu_fp32_kernel(kind):
    """polar_dtype="float32": FP32 GEMMs on both devices (no TF32: torch's
    default), so GPU and CPU agree to FP32 summation-order noise, far below the
    BF16 path's ~1% (expected ~1e-6 of the update norm; allowed 1e-4), and
    momentum bit for bit. The BF16 default must differ from it by BF16 noise."""
    shapes = SHAPES[kind]
    assert not torch.backends.cuda.matmul.allow_tf32
    gpu = _run(shapes, "bf16_remainder", "cuda", lr=0.02, polar_dtype="float32")
    cpu = _run(shapes, "bf16_remainder", "cpu", lr=0.02, polar_dtype="float32")
    gpu_bf16 = _run(shapes, "bf16_remainder", "cuda", lr=0.02)
    start = make_muon_set(shapes, "bf16_remainder")
    for i in range(len(shapes)):
        assert_bit_equal(gpu.momentum_buffers[i].cpu(), cpu.momentum_buffers[i], f"momentum[{i}]")
        moved = fp32_master(cpu, i) - fp32_master(start, i)
        fp32_gap = (fp32_master(gpu, i).cpu() - fp32_master(cpu, i)).norm() / moved.norm()
        bf16_gap = (fp32_master(gpu_bf16, i).cpu() - fp32_master(cpu, i)).norm() / moved.norm()
        assert fp32_gap.item() < 1e-4, (i, fp32_gap.item())
        assert bf16_gap.item() > 10 * fp32_gap.item(), (i, fp32_gap.item(), bf16_gap.item())


@pytest.mark.parametrize("kind", ["wide", "tall"])
def test_fp16_polar_express_matches_the_cpu_fp16_kernel_to_fp16_noise(kind):
    """polar_dtype="float16": FP16 cuBLAS GEMMs on an FP16 workspace against the
    CPU's FP32 GEMMs on FP16 values with the same rounding points; the two differ
    in summation order only, so they agree far closer than the BF16 path does
    (FP16 has 3 more mantissa bits: expected ~8x; asserted 2x)."""
    shapes = SHAPES[kind]
    gpu = _run(shapes, "bf16_remainder", "cuda", lr=0.02, polar_dtype="float16")
    cpu = _run(shapes, "bf16_remainder", "cpu", lr=0.02, polar_dtype="float16")
    gpu_bf16 = _run(shapes, "bf16_remainder", "cuda", lr=0.02)
    cpu_bf16 = _run(shapes, "bf16_remainder", "cpu", lr=0.02)
    start = make_muon_set(shapes, "bf16_remainder")
    for i in range(len(shapes)):
        moved = fp32_master(cpu, i) - fp32_master(start, i)
        fp16_gap = (fp32_master(gpu, i).cpu() - fp32_master(cpu, i)).norm() / moved.norm()
        bf16_gap = (fp32_master(gpu_bf16, i).cpu() - fp32_master(cpu_bf16, i)).norm() / moved.norm()
        assert fp16_gap.item() < 0.5 * bf16_gap.item(), (i, fp16_gap.item(), bf16_gap.item())
