"""MuonAdamW(offload="cpu") on CUDA (GPU only): pinned slabs, parity with the
resident optimizer, bounded staging memory, no host syncs, stream ordering
(late grads, slot reuse after D2H, forward after step), release/restore.
The CPU twin of the state machine: test_offload.py."""

import pytest
import torch

from support.helpers import assert_bit_equal, assert_same_optimizer_tensors
from muon_ext import MuonAdamW, OffloadConfig

pytestmark = pytest.mark.gpu

SHAPES = [(256, 512)] * 3 + [(512, 256), (128, 128)]
# Slots that hold the three (256, 512) matrices in one chunk: the staged Muon
# then runs the resident optimizer's cuBLAS batch counts (another batch count
# may pick another GEMM kernel, and parity is bit for bit).
PARITY_SLOT_NUMEL = 3 * 256 * 512


def _requested_bytes(kind="current"):
    """Bytes the caching allocator was asked for (not its rounded block sizes)."""
    return torch.cuda.memory_stats()[f"requested_bytes.all.{kind}"]


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


_assert_same = assert_same_optimizer_tensors


def _assert_same_trajectory(params_a, a, params_b, b, steps):
    """Steps the resident `a` and the offloaded `b` alike; then every tensor bit-identical."""
    for step in range(steps):
        _step(params_a, a, step)
        _step(params_b, b, step)
    b.drain()
    _assert_same(a, b)


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
    params_b, b = _build(offload_config=OffloadConfig(buffer_count=buffer_count, slot_numel=PARITY_SLOT_NUMEL))
    if slow:
        _slow_compute(b)
    _assert_same_trajectory(params_a, a, params_b, b, steps=3)


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
        base = _requested_bytes()
        opt.step()
        opt.drain()
        extra[count] = _requested_bytes("peak") - base
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
    params_b, b = _build(offload_config=OffloadConfig(slot_numel=PARITY_SLOT_NUMEL))
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
    held = _requested_bytes()
    slot_bytes = sum(slot.buffer.numel() * 4 for slot in opt._runner.slots)
    assert slot_bytes > 0
    opt.release_staging()
    assert opt.residency == "staging_released"
    assert _requested_bytes() == held - slot_bytes
    opt.restore_staging()
    assert _requested_bytes() == held
    _step(params, opt, 1)
    opt.drain()


def _copy_writer(seen):
    """A writer that stores the param as the optimizer would, recording its master's device."""
    def writer(param, master, stream, found_inf):
        seen.append(master.device)
        param.data.copy_(master)
    return writer


def test_writer_gets_the_device_master_outside_step():
    """update_param and load_state_dict hand a writer the master on the param's
    device, not the state entry (a view into the CPU slab)."""
    params, opt = _build(adamw=False)
    p, seen = params[0], []
    opt.register_param_writer(p, _copy_writer(seen))
    _step(params, opt, 0)
    values = torch.randn(p.shape, device="cuda")
    opt.update_param(p, values)
    assert_bit_equal(p.detach().cpu(), values.bfloat16().cpu(), "param written by the writer")
    state = opt.state_dict()
    opt.update_param(p, torch.zeros_like(values))
    opt.load_state_dict(state)
    assert_bit_equal(opt.get_full_parameter_master(p), values.cpu(), "master after the load")
    assert seen and all(device == p.device for device in seen), seen


def test_adamw_lr_tensor_on_the_device():
    """A device lr tensor (as a capturable run's checkpoint restores it) also
    drives the offloaded AdamW, which runs on the CPU."""
    params_a, a = _build("none")
    params_b, b = _build(offload_config=OffloadConfig(slot_numel=PARITY_SLOT_NUMEL))
    for opt in (a, b):
        for group in opt.param_groups:
            group["lr"] = torch.tensor([group["lr"]], device="cuda")
    _assert_same_trajectory(params_a, a, params_b, b, steps=2)


def test_quantized_adamw_param_is_refused():
    """Offloaded AdamW params on CUDA are updated on the CPU: a quantized one
    could not be written through its quantize_."""
    from test_quantized_params import QuantizedTensor

    q = torch.nn.Parameter(QuantizedTensor.of(torch.randn(32, device="cuda")))
    with pytest.raises(ValueError, match="quantized param"):
        MuonAdamW([{"params": [q], "kind": "adamw", "lr": 0.01}], offload="cpu", adapters=False)


def test_unregister_param_writer_right_after_step():
    """With compute still running, unregistering reads the master only after the drain."""
    params_a, a = _build("none", adamw=False)
    params_b, b = _build(adamw=False, offload_config=OffloadConfig(buffer_count=1, slot_numel=PARITY_SLOT_NUMEL))
    for params, opt in ((params_a, a), (params_b, b)):
        opt.register_param_writer(params[0], _copy_writer([]))
    _slow_compute(b)
    _step(params_a, a, 0)
    _step(params_b, b, 0)
    b.unregister_param_writer(params_b[0])
    a.unregister_param_writer(params_a[0])
    b.drain()
    _assert_same(a, b)
