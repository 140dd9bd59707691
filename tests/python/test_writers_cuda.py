"""Param writers on CUDA (GPU only): the writer runs on the caller's current
stream with the device-side GradScaler flag, a released storage is accepted
with its writer, the step stays free of host syncs, and masters match the
same run on the CPU bit for bit."""

import pytest
import torch

import muon_ext
from support.helpers import assert_bit_equal
from support.optimizer_helpers import bf16_values, grad_seq

pytestmark = pytest.mark.gpu

SHAPES = [(64, 128), (64, 128), (96,)]


def _build(device):
    params = [torch.nn.Parameter(v.bfloat16().to(device)) for v in bf16_values(SHAPES, seed=2)]
    groups = [{"params": params[:2], "kind": "muon", "lr": 0.02},
              {"params": params[2:], "kind": "adamw", "lr": 0.01}]
    return params, muon_ext.MuonAdamW(groups, adapters=False)


class StreamRecorder:
    """Copies the master into a BF16 buffer on the stream it is given, and records that stream."""

    def __init__(self, shape, device):
        self.out = torch.zeros(shape, dtype=torch.bfloat16, device=device)
        self.streams, self.flags = [], []

    def __call__(self, param, master, stream, found_inf):
        self.streams.append(stream)
        self.flags.append(found_inf)
        with torch.cuda.stream(stream):
            keep = torch.zeros((), device=master.device) if found_inf is None else found_inf
            self.out.copy_(torch.where(keep != 0, self.out, master.bfloat16()))


def test_writer_on_current_stream_without_host_sync_and_equal_to_cpu():
    params, opt = _build("cuda")
    cpu_params, cpu_opt = _build("cpu")
    writers = [StreamRecorder(p.shape, "cuda") for p in params]
    for p, w in zip(params, writers):
        opt.register_param_writer(p, w, storage=p.untyped_storage())
        p.untyped_storage().resize_(0)
    for p in cpu_params:
        cpu_opt.register_param_writer(p, lambda *a: None)
    side = torch.cuda.Stream()
    grads = grad_seq(SHAPES, 3)
    for k in range(3):
        for p, q, g in zip(params, cpu_params, grads[k]):
            p.grad, q.grad = g.bfloat16().cuda(), g.bfloat16()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            torch.cuda.set_sync_debug_mode("error")
            try:
                opt.step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        torch.cuda.current_stream().wait_stream(side)
        cpu_opt.step()
    for i, (p, q, w) in enumerate(zip(params, cpu_params, writers)):
        assert all(s == side for s in w.streams) and len(w.streams) == 3
        master, cpu_master = opt.state[p]["master_param"], cpu_opt.state[q]["master_param"]
        assert_bit_equal(w.out, master.bfloat16(), "writer output")
        if i == 2:  # AdamW: the shared element math gives the CPU's bits
            assert_bit_equal(master.cpu(), cpu_master, "CUDA vs CPU AdamW master")
        else:  # Muon: cuBLAS and the CPU accumulate the BF16 Polar-Express GEMMs in different orders
            torch.testing.assert_close(master.cpu(), cpu_master, rtol=0, atol=2e-4)
        assert p.untyped_storage().nbytes() == 0


def test_grad_scaler_skip_reaches_writer_on_device():
    params, opt = _build("cuda")
    writer = StreamRecorder(params[0].shape, "cuda")
    opt.register_param_writer(params[0], writer)
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0 ** 4)
    before = writer.out.clone()
    for p, g in zip(params, grad_seq(SHAPES, 1)[0]):
        p.grad = g.bfloat16().cuda()
    params[1].grad[0, 0] = float("inf")
    scaler.step(opt)
    scaler.update()
    assert len(writer.flags) == 1 and writer.flags[0].is_cuda and float(writer.flags[0]) == 1.0
    assert_bit_equal(writer.out, before, "skipped step: writer output unchanged")
