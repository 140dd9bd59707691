"""MuonAdamW(offload="cpu") on CUDA (GPU only): pinned slabs, parity with the
resident optimizer, bounded staging memory, no host syncs, stream ordering
(late grads, slot reuse after D2H, forward after step), release/restore.
The CPU twin of the state machine: test_offload.py."""

import pytest
import torch

from helpers import assert_bit_equal, optimizer_tensors
from muon_ext import MuonAdamW, OffloadConfig

pytestmark = pytest.mark.gpu

SHAPES = [(256, 512)] * 3 + [(512, 256), (128, 128)]


def _build(offload="cpu", shapes=SHAPES, adamw=True, seed=0, **kwargs):
    gen = torch.Generator().manual_seed(seed)
    make = lambda s: torch.nn.Parameter((torch.randn(s, generator=gen) * 0.05).bfloat16().cuda())  # noqa: E731
    muon = [make(s) for s in shapes]
    other = [make((300,)), make((64, 48))] if adamw else []
    groups = [{"params": muon, "kind": "muon", "lr": 0.02}]
    if other:
        groups.append({"params": other, "kind": "adamw", "lr": 0.01})
    if offload == "none":
        kwargs.setdefault("store_param_remainders", False)
    return muon + other, MuonAdamW(groups, offload=offload, **kwargs)


def _grads(params, step):
    gen = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=gen).bfloat16().cuda() for p in params]


def _step(params, opt, step):
    for p, g in zip(params, _grads(params, step)):
        p.grad = g
    opt.step()


def _assert_same(a, b):
    ta, tb = optimizer_tensors(a), optimizer_tensors(b)
    assert ta.keys() == tb.keys()
    for key in ta:
        assert_bit_equal(ta[key].cpu(), tb[key].cpu(), key)


def _slow_compute(opt, cycles=50_000_000):
    """Delays every Muon kernel call on the stream it runs on (the compute stream)."""
    muon = opt._muon

    def slow(*args):
        torch.cuda._sleep(cycles)
        muon(*args)

    opt._muon = slow


def test_slabs_are_pinned_fp32_views():
    params, opt = _build()
    for p in params:
        state = opt.state[p]
        assert all(t.device.type == "cpu" and t.dtype == torch.float32 and t.is_pinned() for t in state.values())
        assert_bit_equal(state["master_param"], p.detach().float().cpu(), "master")
    storages = {t.untyped_storage().data_ptr() for k, t in opt.state[params[0]].items()}
    assert len(storages) == 1


@pytest.mark.parametrize("buffer_count, slow", [(1, False), (2, False), (3, False), (1, True)],
                         ids=["1", "2", "3", "1-slow-compute"])
def test_parity_with_resident(buffer_count, slow):
    """Muon through the slots and AdamW on the CPU: the resident optimizer's bits
    (same CUDA Muon kernels on the same values; CPU and CUDA AdamW share their math).
    With a deliberately slow compute and one slot, each chunk's H2D must wait for
    the previous chunk's D2H, or the slot would be overwritten mid-kernel."""
    params_a, a = _build("none")
    params_b, b = _build(offload_config=OffloadConfig(buffer_count=buffer_count))
    if slow:
        _slow_compute(b)
    for step in range(3):
        _step(params_a, a, step)
        _step(params_b, b, step)
    b.drain()
    _assert_same(a, b)


def test_peak_memory_does_not_grow_with_matrices():
    """Peak device memory of a step above the params and grads: the same for 1 and 8 matrices."""
    extra = {}
    for count in (1, 8):
        params, opt = _build(shapes=[(512, 512)] * count, adamw=False,
                             offload_config=OffloadConfig(buffer_count=2, slot_numel=512 * 512))
        _step(params, opt, 0)  # slots made
        for p, g in zip(params, _grads(params, 1)):
            p.grad = g
        opt.drain()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        opt.step()
        opt.drain()
        extra[count] = torch.cuda.max_memory_allocated() - base
        del params, opt
    assert extra[1] == extra[8]


def test_step_does_not_sync_the_device():
    params, opt = _build(adamw=False)  # offloaded AdamW waits for its grads on the host, once per step, by design
    _step(params, opt, 0)
    torch.cuda.synchronize()
    for p, g in zip(params, _grads(params, 1)):
        p.grad = g
    torch.cuda.set_sync_debug_mode("error")
    try:
        opt.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert opt.residency == "step_active"
    opt.drain()
    assert opt.residency == "cpu_resident"


def test_late_grads_on_another_stream_are_seen():
    """Grads written late on a side stream the caller's stream waits for."""
    params_a, a = _build("none")
    params_b, b = _build()
    _step(params_a, a, 0)
    side = torch.cuda.Stream()
    grads = _grads(params_b, 0)
    with torch.cuda.stream(side):
        torch.cuda._sleep(100_000_000)
        for p, g in zip(params_b, grads):
            p.grad = g * 1  # written on the side stream, after the sleep
    torch.cuda.current_stream().wait_stream(side)
    b.step()
    b.drain()
    _assert_same(a, b)


def test_forward_right_after_step_sees_new_params():
    params, opt = _build(adamw=False)
    _slow_compute(opt)
    x = torch.randn(8, SHAPES[0][1], device="cuda", dtype=torch.bfloat16)
    for p, g in zip(params, _grads(params, 0)):
        p.grad = g
    before = params[0].detach().clone()
    opt.step()
    y = x @ params[0].t()  # no sync in between: the caller's stream waited on compute_done
    torch.cuda.synchronize()
    assert not torch.equal(params[0].detach(), before)
    assert_bit_equal(y, x @ params[0].t(), "forward")


def test_release_and_restore_return_memory():
    """release_staging() frees exactly the slots (the memory held before they
    were made; cuBLAS keeps its per-stream workspace), restore_staging() takes it back."""
    params, opt = _build()
    _step(params, opt, 0)
    opt.drain()
    held = torch.cuda.memory_allocated()
    slot_bytes = sum(slot.buffer.numel() * 4 for slot in opt._offload.slots)
    assert slot_bytes > 0
    opt.release_staging()
    assert opt.residency == "staging_released"
    assert torch.cuda.memory_allocated() == held - slot_bytes
    opt.restore_staging()
    assert torch.cuda.memory_allocated() == held
    _step(params, opt, 1)
    opt.drain()
