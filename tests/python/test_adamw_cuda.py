"""The CUDA AdamW kernel against the CPU kernel and the reference (GPU only).

With --fmad=false, IEEE division and square root and bias corrections from the
same double multiplications, the GPU and CPU kernels are expected to agree bit
for bit, so the comparisons below are exact.
"""

import pytest
import torch

from support.helpers import MASTER_MODES, assert_bit_equal, make_grads, make_set
from muon_ext import ops, reference

pytestmark = pytest.mark.gpu

# Ragged sizes (not multiples of the 4-wide vector path), a 2-D param, and one
# tensor large enough to span several 65536-element chunks.
SIZES = [1, 3, 4, 7, 4097, 65537, (129, 257), 300001]


def _to(s, device):
    out = s.clone()
    for ts in (out.params, out.exp_avgs, out.exp_avg_sqs, out.steps, out.masters):
        ts[:] = [t.to(device) for t in ts]
    return out


def _assert_sets_equal(gpu, cpu):
    for x, y in zip(gpu.tensors(), cpu.tensors()):
        assert_bit_equal(x.cpu(), y)


@pytest.mark.parametrize("mode", list(MASTER_MODES))
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_cuda_matches_cpu_kernel_and_reference(mode, grad_dtype, adam_w_mode):
    cpu = make_set(SIZES, mode)
    gpu, ref = _to(cpu, "cuda"), cpu.clone()
    hyper = dict(lr=3e-3, beta1=0.8, beta2=0.95, eps=1e-6, weight_decay=0.1, adam_w_mode=adam_w_mode)
    for k in range(3):
        grads = make_grads(SIZES, grad_dtype, seed=k)
        inv_scale = torch.tensor([0.5])
        ops.adamw_step(*cpu.args(grads), **cpu.kwargs(), inv_scale=inv_scale, **hyper)
        reference.adamw_step(*ref.args(grads), **ref.kwargs(), inv_scale=inv_scale, **hyper)
        ops.adamw_step(*gpu.args([g.cuda() for g in grads]), **gpu.kwargs(), inv_scale=inv_scale.cuda(), **hyper)
    _assert_sets_equal(gpu, cpu)
    for x, y in zip(cpu.tensors(), ref.tensors()):
        assert_bit_equal(x, y)


def test_many_tensors_split_across_launches():
    # More tensors than one launch's slots and more chunks than its blocks.
    sizes = [5000 + 13 * i for i in range(90)] + [40 * 65536 + 3] * 9
    cpu = make_set(sizes, "bf16_remainder")
    gpu = _to(cpu, "cuda")
    grads = make_grads(sizes)
    ops.adamw_step(*cpu.args(grads), **cpu.kwargs(), lr=1e-2)
    ops.adamw_step(*gpu.args([g.cuda() for g in grads]), **gpu.kwargs(), lr=1e-2)
    _assert_sets_equal(gpu, cpu)


def test_misaligned_views_take_the_scalar_path():
    sizes = [1001, 65536 * 2]
    cpu = make_set(sizes, "bf16_fp32_master")
    gpu = _to(cpu, "cuda")
    # Contiguous views at an odd element offset: not 8/16-byte aligned.
    for ts in (gpu.params, gpu.exp_avgs, gpu.masters):
        for i, t in enumerate(ts):
            base = torch.empty(t.numel() + 1, dtype=t.dtype, device="cuda")
            ts[i] = base[1:].view(t.shape).copy_(t)
    grads = make_grads(sizes)
    ops.adamw_step(*cpu.args(grads), **cpu.kwargs(), lr=1e-2)
    ops.adamw_step(*gpu.args([g.cuda() for g in grads]), **gpu.kwargs(), lr=1e-2)
    _assert_sets_equal(gpu, cpu)


def test_found_inf_and_device_scalars_without_host_sync():
    s = _to(make_set(SIZES, "bf16_remainder"), "cuda")
    grads = [g.cuda() for g in make_grads(SIZES)]
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


def test_step_counters_on_another_device_are_rejected():
    s = _to(make_set([8], "fp32"), "cuda")
    s.steps[0] = s.steps[0].cpu()
    with pytest.raises(ValueError, match=r"steps\[0\] is on cpu"):
        ops.adamw_step(*s.args([torch.ones(8, device="cuda")]), lr=1e-3)


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
