"""The multi-tensor AdamW kernel (CPU) against muon_ext.reference and torch.optim."""

import os

import pytest
import torch

from support.helpers import MASTER_MODES, assert_bit_equal, fp32_master, make_grads, make_set, run_python
from muon_ext import ops, reference

SIZES = [0, 1, 7, 4097, 65537, (33, 17)]
GRAD_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _run_both(mode, grad_dtype, steps=3, **hyper):
    ours, ref = make_set(SIZES, mode), make_set(SIZES, mode)
    for k in range(steps):
        grads = make_grads(SIZES, grad_dtype, seed=k)
        ops.adamw_step(*ours.args(grads), **ours.kwargs(), **hyper)
        reference.adamw_step(*ref.args(grads), **ref.kwargs(), **hyper)
    return ours, ref


@pytest.mark.parametrize("mode", list(MASTER_MODES))
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES)
@pytest.mark.parametrize("adam_w_mode,bias_correction", [(True, True), (False, True), (True, False)])
def test_matches_reference_bit_for_bit(mode, grad_dtype, adam_w_mode, bias_correction):
    # Same operation order as the reference, no FMA contraction, IEEE div/sqrt:
    # every output bit must agree, in every mode.
    hyper = dict(lr=3e-3, beta1=0.8, beta2=0.95, eps=1e-6, weight_decay=0.1,
                 adam_w_mode=adam_w_mode, bias_correction=bias_correction)
    inv_scale = torch.tensor(0.5)
    ours, ref = _run_both(mode, grad_dtype, inv_scale=inv_scale, **hyper)
    for name, a, b in zip(["params", "exp_avgs", "exp_avg_sqs", "steps", "masters"],
                          [ours.params, ours.exp_avgs, ours.exp_avg_sqs, ours.steps, ours.masters],
                          [ref.params, ref.exp_avgs, ref.exp_avg_sqs, ref.steps, ref.masters]):
        for i, (x, y) in enumerate(zip(a, b)):
            assert_bit_equal(x, y, f"{name}[{i}]")
    assert all(float(s) == 3.0 for s in ours.steps)


@pytest.mark.parametrize("capability", ["DEFAULT", "AVX2", "AVX512"])
def test_every_instruction_set_gives_the_same_bits(capability):
    # Each ISA build runs in a fresh process capped by ATEN_CPU_CAPABILITY.
    if capability not in ops.cpu_capabilities():
        pytest.skip(f"{capability} not usable on this machine")
    # Inputs come from numpy: torch's own random generators are vectorized per ISA too.
    code = (
        "import hashlib, numpy as np, torch, muon_ext\n"
        "from muon_ext import ops\n"
        "rng = np.random.default_rng(0)\n"
        "randn = lambda: torch.from_numpy(rng.standard_normal(70001, dtype=np.float32))\n"
        "p = randn().bfloat16(); r = torch.zeros(70001, dtype=torch.int16)\n"
        "m = torch.zeros(70001); v = torch.zeros(70001); s = torch.zeros(())\n"
        "for k in range(3):\n"
        "    ops.adamw_step([p], [randn()], [m], [v], [s], masters=[r], lr=1e-2)\n"
        "print(ops.cpu_capabilities()[-1], int(p.view(torch.int16).long().sum()), int(r.long().sum()),"
        " hashlib.sha256(m.numpy().tobytes()).hexdigest(), hashlib.sha256(v.numpy().tobytes()).hexdigest())\n"
    )
    env = dict(os.environ, ATEN_CPU_CAPABILITY=capability.lower())
    out = run_python(code, env=env, check=True).stdout
    used, *checksums = out.split()
    assert used == capability
    env["ATEN_CPU_CAPABILITY"] = "default"
    base = run_python(code, env=env, check=True).stdout
    assert checksums == base.split()[1:]


def test_best_instruction_set_is_torchs():
    torch_best = torch.backends.cpu.get_cpu_capability()
    if torch_best in ("DEFAULT", "AVX2", "AVX512"):
        assert ops.cpu_capabilities()[-1] == torch_best


@pytest.mark.parametrize("low_mode", ["bf16_fp32_master", "bf16_remainder", "bf16_direct"])
def test_fp32_master_trajectory_identical_across_modes(low_mode):
    # Starting from BF16-representable values (a fresh remainder is zero), the
    # FP32 master must follow the FP32-param trajectory exactly in the master
    # modes; without a master the BF16 rounding each step makes it diverge.
    sizes = [1000, 4097]
    init = [v.bfloat16().float() for v in make_grads(sizes, seed=42)]
    fp32, low = make_set(sizes, "fp32", init=init), make_set(sizes, low_mode, init=init)
    for k in range(20):
        grads = make_grads(sizes, seed=100 + k)
        for s in (fp32, low):
            ops.adamw_step(*s.args(grads), **s.kwargs(), lr=1e-2, weight_decay=0.1)
    for i in range(len(sizes)):
        if low_mode == "bf16_direct":
            drift = (fp32_master(low, i) - fp32_master(fp32, i)).abs()
            assert drift.max() > 0 and drift.mean() < 1e-2
        else:
            assert_bit_equal(fp32_master(low, i), fp32_master(fp32, i), f"master[{i}]")
            assert_bit_equal(low.params[i], fp32.params[i].to(torch.bfloat16) if low_mode != "bf16_remainder"
                             else reference.split_master(fp32.params[i])[0], f"param[{i}]")


def test_fp16_master_trajectory_matches_fp32():
    sizes = [3001]
    init = [v.half().float() for v in make_grads(sizes, seed=7)]
    fp32, half = make_set(sizes, "fp32", init=init), make_set(sizes, "fp16_fp32_master", init=init)
    for k in range(10):
        grads = make_grads(sizes, seed=k)
        for s in (fp32, half):
            ops.adamw_step(*s.args(grads), **s.kwargs(), lr=1e-2)
    assert_bit_equal(half.masters[0], fp32.params[0], "master")
    assert_bit_equal(half.params[0], fp32.params[0].half(), "param")


@pytest.mark.parametrize("mode", ["fp32", "bf16_remainder", "bf16_fp32_master"])
@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_matches_torch_optim_over_many_steps(mode, adam_w_mode):
    """Against torch.optim.AdamW / Adam(weight_decay=...) on FP32 copies over 60 steps.

    torch evaluates the same math in another order (p *= 1 - lr*wd first, lerp
    for the moments, sqrt(v)/sqrt(bc2)), which agrees to ~1e-6 relative per step;
    after 60 steps at lr=1e-2 we measured max |diff| 6.0e-6 (FP32) / 6.9e-6
    (BF16 modes) in AdamW mode and 4.8e-7 in L2 mode; allowed 1e-5 + 1e-5 rel.
    """
    sizes = [5000, (64, 33)]
    ours = make_set(sizes, mode, seed=3)
    torch_params = [fp32_master(ours, i).clone().requires_grad_(False) for i in range(len(sizes))]
    cls = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
    opt = cls(torch_params, lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05, foreach=False)
    for k in range(60):
        grads = make_grads(sizes, seed=k)
        for p, g in zip(torch_params, grads):
            p.grad = g
        opt.step()
        ops.adamw_step(*ours.args(grads), **ours.kwargs(), lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8,
                       weight_decay=0.05, adam_w_mode=adam_w_mode)
    for i, p in enumerate(torch_params):
        torch.testing.assert_close(fp32_master(ours, i), p, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ours.exp_avgs[i], opt.state[p]["exp_avg"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(ours.exp_avg_sqs[i], opt.state[p]["exp_avg_sq"], rtol=1e-5, atol=1e-7)


def test_found_inf_skips_everything_including_step_counters():
    s = make_set(SIZES, "bf16_remainder")
    grads = make_grads(SIZES)
    ops.adamw_step(*s.args(grads), **s.kwargs(), lr=1e-2)
    before = [t.clone() for t in s.tensors()]
    ops.adamw_step(*s.args(grads), **s.kwargs(), lr=1e-2, found_inf=torch.tensor([1.0]))
    for a, b in zip(s.tensors(), before):
        assert_bit_equal(a, b)
    ops.adamw_step(*s.args(grads), **s.kwargs(), lr=1e-2, found_inf=torch.tensor([0.0]))
    assert all(float(t) == 2.0 for t in s.steps)


def test_inv_scale_unscales_grads():
    # Scaling by a power of two is exact, so scaled grads + inv_scale must equal
    # unscaled grads bit for bit.
    a, b = make_set(SIZES, "fp32"), make_set(SIZES, "fp32")
    grads = make_grads(SIZES)
    ops.adamw_step(*a.args(grads), **a.kwargs(), lr=1e-2)
    ops.adamw_step(*b.args([g * 1024 for g in grads]), **b.kwargs(), lr=1e-2, inv_scale=torch.tensor([1 / 1024]))
    for x, y in zip(a.tensors(), b.tensors()):
        assert_bit_equal(x, y)


def test_lr_tensor_equals_lr_float():
    a, b = make_set(SIZES, "bf16_fp32_master"), make_set(SIZES, "bf16_fp32_master")
    grads = make_grads(SIZES)
    ops.adamw_step(*a.args(grads), **a.kwargs(), lr=2e-3)
    ops.adamw_step(*b.args(grads), **b.kwargs(), lr=torch.tensor(2e-3))
    for x, y in zip(a.tensors(), b.tensors()):
        assert_bit_equal(x, y)


def test_empty_lists_are_a_no_op():
    ops.adamw_step([], [], [], [], [], lr=1e-3)
    ops.adamw_step([], [], [], [], [], lr=torch.tensor(1e-3))


def test_steps_are_per_tensor():
    s = make_set([100, 200], "fp32")
    s.steps[1].fill_(9.0)
    ops.adamw_step(*s.args(make_grads([100, 200])), lr=1e-3)
    assert [float(t) for t in s.steps] == [1.0, 10.0]


@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES)
def test_non_finite_values_propagate_like_the_reference(grad_dtype):
    sizes = [64]
    ours, ref = make_set(sizes, "bf16_remainder"), make_set(sizes, "bf16_remainder")
    grads = make_grads(sizes, grad_dtype)
    grads[0][3] = float("inf")
    grads[0][5] = float("nan")
    ops.adamw_step(*ours.args(grads), **ours.kwargs(), lr=1e-2)
    reference.adamw_step(*ref.args(grads), **ref.kwargs(), lr=1e-2)
    for x, y in zip(ours.tensors(), ref.tensors()):
        assert_bit_equal(x, y)
    assert torch.isnan(fp32_master(ours, 0)[3]) and torch.isnan(fp32_master(ours, 0)[5])


# -- On CUDA (marked gpu, skipped without a device; before: test_adamw_cuda.py)
# The CUDA AdamW kernel against the CPU kernel and the reference (GPU only).
#
# With --fmad=false, IEEE division and square root and bias corrections from the
# same double multiplications, the GPU and CPU kernels are expected to agree bit
# for bit, so the comparisons below are exact.


# Ragged sizes (not multiples of the 4-wide vector path), a 2-D param, and one
# tensor large enough to span several 65536-element chunks.
CUDA_SIZES = [1, 3, 4, 7, 4097, 65537, (129, 257), 300001]


def _to(s, device):
    out = s.clone()
    for ts in (out.params, out.exp_avgs, out.exp_avg_sqs, out.steps, out.masters):
        ts[:] = [t.to(device) for t in ts]
    return out


def _assert_sets_equal(gpu, cpu):
    for x, y in zip(gpu.tensors(), cpu.tensors()):
        assert_bit_equal(x.cpu(), y)


def _step_both_and_compare(cpu, gpu, sizes):
    """One AdamW step on the CPU set and its CUDA copy with the same grads: the same bits."""
    grads = make_grads(sizes)
    ops.adamw_step(*cpu.args(grads), **cpu.kwargs(), lr=1e-2)
    ops.adamw_step(*gpu.args([g.cuda() for g in grads]), **gpu.kwargs(), lr=1e-2)
    _assert_sets_equal(gpu, cpu)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", list(MASTER_MODES))
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_cuda_matches_cpu_kernel_and_reference(mode, grad_dtype, adam_w_mode):
    cpu = make_set(CUDA_SIZES, mode)
    gpu, ref = _to(cpu, "cuda"), cpu.clone()
    hyper = dict(lr=3e-3, beta1=0.8, beta2=0.95, eps=1e-6, weight_decay=0.1, adam_w_mode=adam_w_mode)
    for k in range(3):
        grads = make_grads(CUDA_SIZES, grad_dtype, seed=k)
        inv_scale = torch.tensor([0.5])
        ops.adamw_step(*cpu.args(grads), **cpu.kwargs(), inv_scale=inv_scale, **hyper)
        reference.adamw_step(*ref.args(grads), **ref.kwargs(), inv_scale=inv_scale, **hyper)
        ops.adamw_step(*gpu.args([g.cuda() for g in grads]), **gpu.kwargs(), inv_scale=inv_scale.cuda(), **hyper)
    _assert_sets_equal(gpu, cpu)
    for x, y in zip(cpu.tensors(), ref.tensors()):
        assert_bit_equal(x, y)


@pytest.mark.gpu
@pytest.mark.parametrize("blocks_per_launch", [None, "7", "320"])
def test_many_tensors_split_across_launches(monkeypatch, blocks_per_launch):
    # More tensors than one launch's 256 slots, and (with a small
    # MUON_EXT_CUDA_BLOCKS_PER_LAUNCH) more chunks than its blocks, a tensor's
    # chunks carried over from one launch to the next: the same bits as the CPU.
    if blocks_per_launch is not None:
        monkeypatch.setenv("MUON_EXT_CUDA_BLOCKS_PER_LAUNCH", blocks_per_launch)
    sizes = [5000 + 13 * i for i in range(290)] + [40 * 65536 + 3] * 9
    cpu = make_set(sizes, "bf16_remainder")
    gpu = _to(cpu, "cuda")
    _step_both_and_compare(cpu, gpu, sizes)


@pytest.mark.gpu
@pytest.mark.parametrize("value", ["0", "-3", "2561", "12x", "1e3"])
def test_blocks_per_launch_setting_is_checked(monkeypatch, value):
    cpu = make_set([4097], "fp32")
    gpu = _to(cpu, "cuda")
    before = [t.clone() for t in gpu.tensors()]
    monkeypatch.setenv("MUON_EXT_CUDA_BLOCKS_PER_LAUNCH", value)
    with pytest.raises(RuntimeError, match="MUON_EXT_CUDA_BLOCKS_PER_LAUNCH must be an integer from 1 to"):
        ops.adamw_step(*gpu.args([g.cuda() for g in make_grads([4097])]), **gpu.kwargs(), lr=1e-2)
    torch.cuda.synchronize()
    # Raised before the step counters' launch: nothing moved.
    for x, y in zip(gpu.tensors(), before):
        assert_bit_equal(x.cpu(), y.cpu())


@pytest.mark.gpu
def test_misaligned_views_take_the_scalar_path():
    sizes = [1001, 65536 * 2]
    cpu = make_set(sizes, "bf16_fp32_master")
    gpu = _to(cpu, "cuda")
    # Contiguous views at an odd element offset: not 8/16-byte aligned.
    for ts in (gpu.params, gpu.exp_avgs, gpu.masters):
        for i, t in enumerate(ts):
            base = torch.empty(t.numel() + 1, dtype=t.dtype, device="cuda")
            ts[i] = base[1:].view(t.shape).copy_(t)
    _step_both_and_compare(cpu, gpu, sizes)


@pytest.mark.gpu
def test_found_inf_and_device_scalars_without_host_sync():
    s = _to(make_set(CUDA_SIZES, "bf16_remainder"), "cuda")
    grads = [g.cuda() for g in make_grads(CUDA_SIZES)]
    lr = torch.tensor([1e-2], device="cuda")
    inv_scale = torch.tensor([1.0], device="cuda")
    found_inf = torch.tensor([1.0], device="cuda")
    before = [t.clone() for t in s.tensors()]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        ops.adamw_step(*s.args(grads), **s.kwargs(), lr=lr, inv_scale=inv_scale, found_inf=found_inf)
        found_inf.zero_()
        ops.adamw_step(*s.args(grads), **s.kwargs(), lr=lr, inv_scale=inv_scale, found_inf=found_inf)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(float(t) == 1.0 for t in s.steps)  # the first call was skipped entirely
    assert not torch.equal(before[0], s.params[0])


@pytest.mark.gpu
def test_cuda_graph_capture_replays_like_eager():
    sizes = [4097, 65537]
    eager, graphed = (_to(make_set(sizes, "bf16_remainder"), "cuda") for _ in range(2))
    grads = [g.cuda() for g in make_grads(sizes)]
    lr = torch.tensor([1e-2], device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            ops.adamw_step(*graphed.args(grads), **graphed.kwargs(), lr=lr)
    torch.cuda.current_stream().wait_stream(stream)
    for _ in range(3):
        graph.replay()
        ops.adamw_step(*eager.args(grads), **eager.kwargs(), lr=lr)
    torch.cuda.synchronize()
    for x, y in zip(graphed.tensors(), eager.tensors()):
        assert_bit_equal(x, y)
    assert all(float(t) == 3.0 for t in graphed.steps)


@pytest.mark.gpu
def test_step_counters_on_another_device_are_rejected():
    s = _to(make_set([8], "fp32"), "cuda")
    s.steps[0] = s.steps[0].cpu()
    with pytest.raises(ValueError, match=r"steps\[0\] is on cpu"):
        ops.adamw_step(*s.args([torch.ones(8, device="cuda")]), lr=1e-3)


@pytest.mark.gpu
@pytest.mark.slow
def test_tensor_over_2_pow_31_elements():
    """64-bit indexing: one BF16 param of 2^31 + 4099 elements (about 30 GB of state).

    The update is elementwise, so windows at the start, across 2^31 and at the
    end are checked against the CPU kernel run on those windows alone.
    """
    n = 2**31 + 4099
    if torch.cuda.get_device_properties(0).total_memory < 48 * 2**30:
        pytest.skip("needs a GPU with >= 48 GiB")
    gen = torch.Generator(device="cuda").manual_seed(0)
    param = torch.randn(n, device="cuda", dtype=torch.bfloat16, generator=gen)
    grad = torch.randn(n, device="cuda", dtype=torch.bfloat16, generator=gen)
    remainder = torch.zeros(n, dtype=torch.int16, device="cuda")
    m, v = torch.zeros(n, device="cuda"), torch.zeros(n, device="cuda")
    step = torch.zeros((), device="cuda")
    windows = [slice(0, 4096), slice(2**31 - 2048, 2**31 + 2048), slice(n - 4096, n)]
    before = [(param[w].cpu(), grad[w].cpu()) for w in windows]
    ops.adamw_step([param], [grad], [m], [v], [step], masters=[remainder], lr=1e-2)
    for w, (p0, g0) in zip(windows, before):
        cpu = make_set([p0.numel()], "bf16_remainder", init=[p0.float()])
        ops.adamw_step(*cpu.args([g0]), **cpu.kwargs(), lr=1e-2)
        assert_bit_equal(param[w].cpu(), cpu.params[0], f"param window {w}")
        assert_bit_equal(remainder[w].cpu(), cpu.masters[0], f"remainder window {w}")
        assert_bit_equal(v[w].cpu(), cpu.exp_avg_sqs[0], f"exp_avg_sq window {w}")
