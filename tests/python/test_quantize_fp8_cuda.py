"""quantize_fp8 and Fp8Writer on CUDA (GPU only): the same bits as the CPU
kernel (and so the reference), no host sync, one launch with blocks (two per
tensor), found_inf read on the device, and the writer on a given stream."""

import pytest
import torch

from support.helpers import assert_bit_equal, assert_unchanged, snapshot
from muon_ext import quantized, reference

pytestmark = pytest.mark.gpu

E4M3 = torch.float8_e4m3fn


def _special_values(n, seed):
    """Random values over many magnitudes, with NaN, inf, zeros, ties and 448."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-40, 40, (n,), generator=g).float())
    picks = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 448.0, 464.0, 2.0**-10, 1e-42])
    idx = torch.randint(0, n, (min(n, 64),), generator=g)
    x[idx] = picks[torch.arange(len(idx)) % len(picks)]
    return x


def _cpu_and_cuda(master, block):
    cpu = quantized.quantize_fp8(master, block=block)
    gpu = quantized.quantize_fp8(master.cuda(), block=block)
    for c, g, what in zip(cpu, gpu, ("q", "scale_inv")):
        assert_bit_equal(g.cpu(), c, what)
    return cpu


SHAPES = [(1, 1), (128, 128), (300, 260), (257, 129), (4096, 1000), (5, 1003), (1001, 7)]
BLOCKS = [(128, 128), (1, 1), (7, 5), (64, 256), (4, 128), None]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("block", BLOCKS, ids=str)
def test_cuda_equals_cpu_and_reference(shape, block):
    if block == (1, 1) and shape[0] * shape[1] > 1 << 20:
        pytest.skip("a million one-element blocks: slow on the CPU side, nothing new")
    master = _special_values(shape[0] * shape[1], seed=shape[0]).reshape(shape)
    q, scale_inv = _cpu_and_cuda(master, block)
    ref_q, ref_scale_inv = reference.quantize_fp8(master, block)
    assert_bit_equal(q, ref_q)
    assert_bit_equal(scale_inv, ref_scale_inv)


@pytest.mark.parametrize("block", [(128, 128), None], ids=str)
def test_unaligned_and_strided_inputs_take_the_scalar_path(block):
    buffer = _special_values(300 * 256 + 1, seed=3)
    _cpu_and_cuda(buffer[1:].reshape(300, 256), block)  # 4-byte but not 16-byte aligned
    _cpu_and_cuda(buffer[: 300 * 256].reshape(256, 300).t(), block)  # non-contiguous: copied


def test_per_tensor_any_shape_and_large():
    _cpu_and_cuda(_special_values(3 * 5 * 7, seed=4).reshape(3, 5, 7), None)
    _cpu_and_cuda(_special_values((1 << 24) + 3, seed=5), None)  # more elements than one pass of the grid
    _cpu_and_cuda(torch.empty(0), None)


def _kernels_launched(fn):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


@pytest.mark.parametrize("block, launches", [((128, 128), 1), (None, 2)], ids=["blocks", "per_tensor"])
def test_launches_no_sync_and_found_inf_on_device(block, launches):
    master = torch.randn(1000, 700, device="cuda")
    out = torch.zeros(1000, 700, dtype=E4M3, device="cuda")
    out_scale_inv = torch.zeros(quantized.scale_inv_shape(master.shape, block), device="cuda")
    found_inf = torch.ones(1, device="cuda")
    torch.cuda.synchronize()

    def call():
        quantized.quantize_fp8(master, block=block, out=out, out_scale_inv=out_scale_inv, found_inf=found_inf)

    torch.cuda.set_sync_debug_mode("error")
    try:
        before = snapshot([out, out_scale_inv])
        call()  # found_inf set: nothing written
        torch.cuda.set_sync_debug_mode("default")
        assert_unchanged([out, out_scale_inv], before)
        found_inf.zero_()
        names = _kernels_launched(call)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert len(names) == launches, names
    assert_bit_equal(out.cpu(), reference.quantize_fp8(master.cpu(), block)[0])


def test_captured_in_a_cuda_graph():
    master = torch.randn(256, 384, device="cuda")
    out, out_scale_inv = torch.empty(256, 384, dtype=E4M3, device="cuda"), torch.empty(2, 3, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        quantized.quantize_fp8(master, out=out, out_scale_inv=out_scale_inv)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        quantized.quantize_fp8(master, out=out, out_scale_inv=out_scale_inv)
    master.mul_(3)
    graph.replay()
    torch.cuda.synchronize()
    assert_bit_equal(out.cpu(), reference.quantize_fp8(master.cpu())[0])


def test_writer_runs_on_the_given_stream():
    master = torch.randn(512, 256, device="cuda")
    q_out, scale_inv_out = torch.zeros(512, 256, dtype=E4M3, device="cuda"), torch.zeros(4, 2, device="cuda")
    writer = quantized.Fp8Writer(q_out, scale_inv_out)
    stream = torch.cuda.Stream()
    torch.cuda.synchronize()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(1 << 30)  # about half a second of work queued on `stream` first
    # The flags stay referenced until `stream` is done with them (a temporary
    # would go back to the allocator, for the default stream, mid-read).
    no_skip, skip = torch.zeros(1, device="cuda"), torch.ones(1, device="cuda")
    writer(None, master, stream, no_skip)
    # Still queued behind the sleep on `stream`: the default stream sees the old buffer.
    assert not bool(q_out.view(torch.uint8).any())
    stream.synchronize()
    assert_bit_equal(q_out.cpu(), reference.quantize_fp8(master.cpu())[0])
    before = snapshot([q_out.cpu(), scale_inv_out.cpu()])
    master.mul_(2)
    writer(None, master, stream, skip)
    torch.cuda.synchronize()
    after = [q_out.cpu(), scale_inv_out.cpu()]
    assert_unchanged(after, before)
