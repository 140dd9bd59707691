"""MuonAdamW(offload="cpu") on the CPU: the staged state machine with plain
buffers as slots (muon_ext/offload.py). Arguments, slabs and their views,
parity with the resident optimizer (offload="none", FP32 masters), residency,
drain, release/restore, checkpoints in both directions; on CUDA the tests marked gpu at the end."""

import contextlib
import copy as copy_module
import pickle

import pytest
import torch

from support.helpers import assert_bit_equal, assert_same_optimizer_tensors
from support.optimizer_snapshot import assert_unchanged, named, snapshot
from muon_ext import MuonAdamW, OffloadConfig

MUON_SHAPES = [(16, 32), (16, 32), (32, 16), (8, 8), (16, 32), (2, 8, 6)]  # the last: matrix_view="flatten"
ADAMW_SHAPES = [(7,), (3, 4), (5,)]


def _build(offload="cpu", seed=0, dtype=torch.bfloat16, beta2=0.95, muon_shapes=MUON_SHAPES, **kwargs):
    """The same params (same bits for the same seed) in a Muon and an AdamW group."""
    gen = torch.Generator().manual_seed(seed)
    make = lambda s, d: torch.nn.Parameter((torch.randn(s, generator=gen) * 0.1).to(d))  # noqa: E731
    muon = [make(s, dtype) for s in muon_shapes]
    adamw = [make(s, dtype) for s in ADAMW_SHAPES[:2]] + [make(ADAMW_SHAPES[2], torch.float32)]
    if offload == "none":
        kwargs.setdefault("store_param_remainders", False)  # offloaded params keep FP32 masters
    opt = MuonAdamW([{"params": muon, "kind": "muon", "lr": 0.02, "beta2": beta2, "matrix_view": "flatten"},
                     {"params": adamw, "kind": "adamw", "lr": 0.01}], offload=offload, **kwargs)
    return muon + adamw, opt


def _step(params, opt, step, skip=()):
    """Grads drawn from the step number (the same for every optimizer), none for params at `skip`."""
    gen = torch.Generator().manual_seed(1000 + step)
    for i, p in enumerate(params):
        g = torch.randn(p.shape, generator=gen).to(p.dtype)
        p.grad = None if i in skip else g
    opt.step()


_assert_same = assert_same_optimizer_tensors


# ---------------------------------------------------------------------------
# arguments
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(buffer_count=0), ValueError, r"offload_config\.buffer_count must be >= 1"),
    (dict(buffer_count=2.0), TypeError, r"offload_config\.buffer_count must be an int"),
    (dict(buffer_count=True), TypeError, r"offload_config\.buffer_count must be an int"),
    (dict(slot_numel=0), ValueError, r"offload_config\.slot_numel must be >= 1"),
    (dict(slot_numel="64"), TypeError, r"offload_config\.slot_numel must be an int"),
])
def test_config_validated(kwargs, error, match):
    with pytest.raises(error, match=match):
        OffloadConfig(**kwargs)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(offload="gpu"), ValueError, "offload must be 'none' or 'cpu', got 'gpu'"),
    (dict(offload="cpu", offload_config={"buffer_count": 2}), TypeError, "offload_config must be a muon_ext.Offload"),
    (dict(offload_config=OffloadConfig()), ValueError, "offload_config is given but offload='none'"),
    (dict(offload="cpu", capturable=True), ValueError, "capturable=True"),
])
def test_optimizer_arguments_validated(kwargs, error, match):
    w = torch.nn.Parameter(torch.randn(4, 4))
    with pytest.raises(error, match=match):
        MuonAdamW([{"params": [w], "kind": "muon"}], **kwargs)


def test_oversize_nonmatrix_and_duplicate_params_refused():
    big, small = torch.nn.Parameter(torch.randn(8, 16)), torch.nn.Parameter(torch.randn(4, 4))
    with pytest.raises(ValueError, match=r"param group 0 \(muon\), param 1 has 128 elements .*slot_numel=100.*never "
                                         r"split"):
        MuonAdamW([{"params": [small, big], "kind": "muon"}], offload="cpu",
                  offload_config=OffloadConfig(slot_numel=100))
    with pytest.raises(ValueError, match="Muon needs matrices"):
        MuonAdamW([{"params": [torch.nn.Parameter(torch.randn(5))], "kind": "muon"}], offload="cpu")
    with pytest.raises(ValueError, match="appears in more than one param group"):
        MuonAdamW([{"params": [small, small], "kind": "muon"}], offload="cpu")
    with pytest.raises(ValueError, match="appears in more than one param group"):
        MuonAdamW([{"params": [small], "kind": "muon"}, {"params": [small], "kind": "adamw"}], offload="cpu")


def test_no_offload_methods():
    _, opt = _build("none")
    assert opt.residency == "cpu_resident"
    opt.drain()  # a no-op
    for name in ("release_staging", "restore_staging"):
        with pytest.raises(RuntimeError, match=f"{name}.*offload='cpu'"):
            getattr(opt, name)()


# ---------------------------------------------------------------------------
# slabs
# ---------------------------------------------------------------------------


def test_state_entries_are_fp32_views_of_one_slab():
    """With store_param_remainders=True (the default) BF16 params still get
    FP32 masters, equal to the params; every entry is a view of the group's slab."""
    params, opt = _build("cpu")
    assert not opt.store_param_remainders
    for group in opt.param_groups:
        storages = {opt.state[p][k].untyped_storage().data_ptr() for p in group["params"] for k in opt.state[p]}
        assert len(storages) == 1
    for p in params:
        state = opt.state[p]
        assert all(t.dtype == torch.float32 and t.device.type == "cpu" for t in state.values())
        if p.dtype == torch.bfloat16:
            assert_bit_equal(state["master_param"], p.detach().float(), "master")
        else:
            assert "master_param" not in state  # an FP32 param is its own master
    assert sorted(opt.state[params[0]]) == ["master_param", "momentum_buffer", "second_momentum_buffer"]
    assert sorted(opt.state[params[-2]]) == ["exp_avg", "exp_avg_sq", "master_param", "step"]


def test_state_dict_sees_the_slab_without_copies():
    params, opt = _build("cpu")
    _step(params, opt, 0)
    sd = opt.state_dict()
    momentum = sd["state"][0]["momentum_buffer"]
    assert momentum.data_ptr() == opt.state[params[0]]["momentum_buffer"].data_ptr()
    assert_bit_equal(sd["state"][0]["master_param"], opt.state[params[0]]["master_param"], "master")


# ---------------------------------------------------------------------------
# the staged step
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("buffer_count", [1, 2, 3])
@pytest.mark.parametrize("slot_numel", [None, 512, 1536])  # one matrix per slot; one; up to three
def test_parity_with_resident(buffer_count, slot_numel):
    """Params, masters, moments and step counters bit-identical to offload="none"
    with FP32 masters, over several steps; params without grads keep everything."""
    params_a, a = _build("none")
    params_b, b = _build("cpu", offload_config=OffloadConfig(buffer_count=buffer_count, slot_numel=slot_numel))
    for step in range(4):
        skip = (1, 7) if step in (1, 2) else ()
        before = named(b, snapshot(b))
        _step(params_a, a, step, skip)
        _step(params_b, b, step, skip)
        after = named(b, snapshot(b))
        for key, value in before.items():
            if key.startswith(("group 0 param 1", "group 1 param 1")) and skip:
                assert after[key] == value, key
        _assert_same(a, b)


def test_parity_fp32_params_and_direct_updates():
    """FP32 params (their own masters) and master_weights=False (BF16 updated directly) stage only moments."""
    for kwargs in (dict(dtype=torch.float32), dict(master_weights=False)):
        params_a, a = _build("none", **kwargs)
        params_b, b = _build("cpu", **kwargs)
        assert "master_param" not in b.state[params_b[0]]
        for step in range(3):
            _step(params_a, a, step)
            _step(params_b, b, step)
        _assert_same(a, b)


def test_normuon_switched_on_later():
    """beta2=None reserves the second moment in the slab; switching NorMuon on starts it at zero."""
    params_a, a = _build("none", beta2=None)
    params_b, b = _build("cpu", beta2=None)
    assert "second_momentum_buffer" not in b.state[params_b[0]]
    _step(params_a, a, 0)
    _step(params_b, b, 0)
    a.param_groups[0]["beta2"] = b.param_groups[0]["beta2"] = 0.9
    for step in (1, 2):
        _step(params_a, a, step)
        _step(params_b, b, step)
    _assert_same(a, b)
    smb = b.state[params_b[0]]["second_momentum_buffer"]
    assert smb.untyped_storage().data_ptr() == b.state[params_b[0]]["momentum_buffer"].untyped_storage().data_ptr()


def test_slots_do_not_grow_with_the_number_of_matrices():
    """The staging memory is buffer_count slots of one size, for 1 or 8 matrices per slot."""
    sizes = {}
    for count in (1, 8):
        params, opt = _build("cpu", muon_shapes=[(16, 32)] * count,
                             offload_config=OffloadConfig(buffer_count=2, slot_numel=512))
        _step(params, opt, 0)
        sizes[count] = [slot.buffer.numel() for slot in opt._runner.slots]
    assert sizes[1] == sizes[8] and len(sizes[1]) == 2
    assert sizes[1][0] == 2 * 512 + 32  # master + momentum + the (16, 1) NorMuon statistics per 512 elements


@pytest.mark.parametrize("bad, match", [
    (torch.zeros(3), r"'momentum_buffer' must be a float32 tensor of shape \(32, 16\)"),
    (None, r"'momentum_buffer' is missing"),
])
def test_bad_state_entry_refused_before_any_write(bad, match):
    params, opt = _build("cpu")
    _step(params, opt, 0)
    if bad is None:
        del opt.state[params[2]]["momentum_buffer"]
    else:
        opt.state[params[2]]["momentum_buffer"] = bad
    snap = snapshot(opt)
    with pytest.raises(ValueError, match=r"param group 0 \(muon\), param 2: optimizer state " + match):
        _step(params, opt, 1)
    assert_unchanged(opt, snap)
    if bad is None:  # a checkpoint load restores it, into the slab
        reference, ref = _build("cpu")
        _step(reference, ref, 0)
        opt.load_state_dict(ref.state_dict())
        _step(params, opt, 1)
        _step(reference, ref, 1)
        _assert_same(ref, opt)


def test_replaced_state_entry_goes_back_into_the_slab():
    """An FP32 entry of the right shape (e.g. assigned by a user) is copied into the slab at the next step."""
    params_a, a = _build("none")
    params_b, b = _build("cpu")
    _step(params_a, a, 0)
    _step(params_b, b, 0)
    replaced = b.state[params_b[0]]["momentum_buffer"].clone()
    b.state[params_b[0]]["momentum_buffer"] = replaced
    _step(params_a, a, 1)
    _step(params_b, b, 1)
    view = b.state[params_b[0]]["momentum_buffer"]
    assert view is not replaced and view.untyped_storage().data_ptr() == \
        b.state[params_b[0]]["master_param"].untyped_storage().data_ptr()
    _assert_same(a, b)


# ---------------------------------------------------------------------------
# residency
# ---------------------------------------------------------------------------


def test_residency_drain_release_restore():
    params, opt = _build("cpu")
    assert opt.residency == "cpu_resident"
    _step(params, opt, 0)
    assert opt.residency == "step_active"
    opt.drain()
    opt.drain()  # idempotent
    assert opt.residency == "cpu_resident"
    opt.release_staging()
    assert opt.residency == "staging_released" and opt._runner.slots is None
    snap = snapshot(opt)
    with pytest.raises(RuntimeError, match=r"release_staging\(\).*restore_staging\(\)"):
        _step(params, opt, 1)
    assert_unchanged(opt, snap)
    opt.restore_staging()
    assert opt.residency == "cpu_resident" and len(opt._runner.slots) == 2
    params_a, a = _build("none")
    _step(params_a, a, 0)
    _step(params_a, a, 1)
    _step(params, opt, 1)
    _assert_same(a, opt)


def test_unregister_param_writer_drains_before_reading_the_slab():
    """Unregistering writes the param from its slab master, which the last
    step's copy back may still be writing: it drains first."""
    params, opt = _build("cpu")
    p = params[0]
    opt.register_param_writer(p, lambda param, master, stream, found_inf: param.data.copy_(master))
    _step(params, opt, 0)
    assert opt.residency == "step_active"
    opt.unregister_param_writer(p)
    assert opt.residency == "cpu_resident"
    assert_bit_equal(p.detach(), opt.state[p]["master_param"].bfloat16(), "param from its master")


def test_get_full_parameter_master_drains_and_copies():
    params, opt = _build("cpu")
    _step(params, opt, 0)
    master = opt.get_full_parameter_master(params[0])
    assert opt.residency == "cpu_resident"
    state_master = opt.state[params[0]]["master_param"]
    assert_bit_equal(master, state_master, "master")
    assert master.data_ptr() != state_master.data_ptr()
    master.add_(1.0)
    assert not torch.equal(master, state_master)


def test_update_param_writes_the_slab():
    params, opt = _build("cpu")
    values = torch.randn(16, 32)
    opt.update_param(params[0], values)
    assert_bit_equal(opt.state[params[0]]["master_param"], values, "master")
    assert_bit_equal(params[0].detach(), values.bfloat16(), "param")


def test_pickling_refused():
    _, opt = _build("cpu")
    for copy in (pickle.dumps, copy_module.deepcopy):
        with pytest.raises(TypeError, match="offload='cpu' cannot be pickled or deep-copied"):
            copy(opt)


# ---------------------------------------------------------------------------
# checkpoints
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("saved, resumed", [("none", "cpu"), ("cpu", "none"), ("cpu", "cpu")])
def test_checkpoint_round_trip(saved, resumed):
    """Save after two steps in one mode, resume in the other: bit for bit as never stopping.
    The resident side keeps int16 remainders (the default), the checkpoint carries FP32 masters."""
    params_ref, ref = _build("none")
    params_s, s = _build(saved, store_param_remainders=True)
    for step in (0, 1):
        _step(params_ref, ref, step)
        _step(params_s, s, step)
    sd = s.state_dict()
    params_r, r = _build(resumed, seed=5, store_param_remainders=True)  # other weights: the load replaces them
    with torch.no_grad():
        for p, q in zip(params_r, params_s):
            p.copy_(q)  # model weights, loaded as a trainer would
    r.load_state_dict(sd)
    for step in (2, 3):
        _step(params_ref, ref, step)
        _step(params_r, r, step)
    for i, (p, q) in enumerate(zip(params_ref, params_r)):
        assert_bit_equal(p, q, f"param {i}")
        master = r.get_full_parameter_master(q)
        assert_bit_equal(ref.get_full_parameter_master(p), master, f"master {i}")
        for key in ("momentum_buffer", "second_momentum_buffer", "exp_avg", "exp_avg_sq", "step"):
            if key in ref.state[p]:
                assert_bit_equal(ref.state[p][key], r.state[q][key], f"param {i} {key}")
    if resumed == "cpu":  # the loaded state is in the slabs
        state = r.state[params_r[0]]
        assert state["momentum_buffer"].untyped_storage().data_ptr() == \
            state["master_param"].untyped_storage().data_ptr()


# ---------------------------------------------------------------------------
# groups added later, GradScaler
# ---------------------------------------------------------------------------


def test_add_param_group_later():
    """A group added after steps gets a slab of its own; a larger matrix grows
    the slots; a refused group leaves the optimizer as it was."""
    params_a, a = _build("none")
    params_b, b = _build("cpu", offload_config=OffloadConfig(slot_numel=2048))
    _step(params_a, a, 0)
    _step(params_b, b, 0)
    too_big = torch.nn.Parameter(torch.randn(64, 64))
    groups_before, snap = len(b.param_groups), snapshot(b)
    with pytest.raises(ValueError, match=r"param group 2 \(muon\), param 0 has 4096 elements"):
        b.add_param_group({"params": [too_big], "kind": "muon"})
    assert len(b.param_groups) == groups_before
    assert_unchanged(b, snap)
    for opt, params in ((a, params_a), (b, params_b)):
        gen = torch.Generator().manual_seed(7)
        new = torch.nn.Parameter(torch.randn(32, 64, generator=gen).bfloat16())
        opt.add_param_group({"params": [new], "kind": "muon", "lr": 0.01})
        params.append(new)
    for step in (1, 2):
        _step(params_a, a, step)
        _step(params_b, b, step)
    _assert_same(a, b)


def test_grad_scaler_inf_skips_and_finite_matches_resident():
    params_a, a = _build("none")
    params_b, b = _build("cpu")
    for params, opt in ((params_a, a), (params_b, b)):
        scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
        for step in range(2):
            scaler.scale(torch.ones(()))
            gen = torch.Generator().manual_seed(1000 + step)
            for p in params:
                p.grad = (torch.randn(p.shape, generator=gen) * 4.0).to(p.dtype)
            scaler.step(opt)
            scaler.update()
        snap = snapshot(opt)
        scaler.scale(torch.ones(()))
        params[0].grad[0, 0] = float("inf")
        scaler.step(opt)
        scaler.update()
        assert_unchanged(opt, snap)
    _assert_same(a, b)


# ---------------------------------------------------------------------------
# the order of waits (the events the CUDA streams use, recorded on the CPU)
# ---------------------------------------------------------------------------


class _RecordingStreams:
    """The CPU twin's interface, logging which event each copy and compute waits for."""

    def __init__(self):
        self.log, self.count = [], 0

    def _event(self, kind):
        self.count += 1
        return f"{kind}{self.count}"

    def begin(self):
        self.log.append(("begin",))

    def copy(self, direction, pairs, after=None):
        for dst, src in pairs:
            dst.copy_(src)
        event = self._event(direction)
        self.log.append((direction, after, event))
        return event

    def computing(self, after, reads=()):
        self.log.append(("compute", after))
        return contextlib.nullcontext()

    def compute_done(self):
        event = self._event("done")
        self.log.append(("done", event))
        return event

    def wait_host(self, event):
        pass

    def drain(self):
        self.log.append(("drain",))


@pytest.mark.parametrize("buffer_count", [1, 2, 3])
def test_slot_reuse_waits_for_its_d2h(buffer_count):
    """Each chunk's H2D waits for the D2H of the chunk that last used its slot
    (none for the first use), compute waits for its H2D, D2H for compute_done."""
    params, opt = _build("cpu", muon_shapes=[(16, 32)] * 5, offload_config=OffloadConfig(buffer_count=buffer_count))
    streams = opt._runner.streams = _RecordingStreams()
    for step in range(2):
        _step(params, opt, step)
    chunks = [entry for entry in streams.log if entry[0] != "begin"]
    assert len(chunks) == 2 * 5 * 4  # per chunk: h2d, compute, done, d2h
    d2h_events = []
    for k in range(0, len(chunks), 4):
        (h2d, after, loaded), (compute, waited), (done, event), (d2h, d2h_after, freed) = chunks[k: k + 4]
        assert (h2d, compute, done, d2h) == ("h2d", "compute", "done", "d2h")
        index = k // 4
        assert after == (d2h_events[index - buffer_count] if index >= buffer_count else None)
        assert waited == loaded and d2h_after == event
        d2h_events.append(freed)
    assert streams.log[0] == ("begin",) and streams.log.count(("begin",)) == 2


def test_page_locked_slab_is_unregistered_when_its_owner_goes(monkeypatch):
    """CUDA slabs are registered CPU tensors (torch's pinned blocks are rounded up to
    a power of two); the registration ends with the owner, while the memory is still
    held, and a refused registration falls back to torch's pinned allocator."""
    import gc

    from muon_ext import offload

    calls = []
    monkeypatch.setattr(offload._C, "register_host_memory", lambda ptr, nbytes: calls.append(("reg", ptr, nbytes)) or True)
    monkeypatch.setattr(offload._C, "unregister_host_memory", lambda ptr: calls.append(("unreg", ptr)) or True)

    class Owner:
        pass

    owner = Owner()
    slab = offload._page_locked_zeros(1000, owner)
    assert slab.shape == (1000,) and slab.dtype == torch.float32 and not bool(slab.any())
    assert calls == [("reg", slab.data_ptr(), 4000)]
    view = slab[10:20]
    del owner
    gc.collect()
    assert calls[-1] == ("unreg", slab.data_ptr())
    view.fill_(1.0)  # views outliving the owner are still valid (pageable) memory

    pinned = []
    monkeypatch.setattr(offload._C, "register_host_memory", lambda ptr, nbytes: False)
    monkeypatch.setattr(offload.torch, "zeros", lambda *a, **k: pinned.append(k.get("pin_memory")) or torch.empty(0))
    offload._page_locked_zeros(10, Owner())
    assert pinned == [None, True]


# -- On CUDA (marked gpu, skipped without a device; before: test_offload_cuda.py)
# MuonAdamW(offload="cpu") on CUDA (GPU only): pinned slabs, parity with the
# resident optimizer, bounded staging memory, no host syncs, stream ordering
# (late grads, slot reuse after D2H, forward after step), release/restore.
# The CPU twin of the state machine: test_offload.py.


SHAPES = [(256, 512)] * 3 + [(512, 256), (128, 128)]
# Slots that hold the three (256, 512) matrices in one chunk: the staged Muon
# then runs the resident optimizer's cuBLAS batch counts (another batch count
# may pick another GEMM kernel, and parity is bit for bit).
PARITY_SLOT_NUMEL = 3 * 256 * 512


def _requested_bytes(kind="current"):
    """Bytes the caching allocator was asked for (not its rounded block sizes),
    after the device is idle and the allocator has taken back the blocks whose
    free waited on another stream (record_stream: the grads the compute stream
    read, the slots the D2H stream read). It does so lazily, at its next
    allocation; until then their bytes still count as requested."""
    torch.cuda.synchronize()
    torch.empty(1, device="cuda")  # an allocation: the allocator processes its completed events
    return torch.cuda.memory_stats()[f"requested_bytes.all.{kind}"]


def _cuda_build(offload="cpu", shapes=SHAPES, adamw=True, seed=0, **kwargs):
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


def _cuda_step(params, opt, step):
    for p, g in zip(params, _grads(params, step)):
        p.grad = g
    opt.step()


def _assert_same_trajectory(params_a, a, params_b, b, steps):
    """Steps the resident `a` and the offloaded `b` alike; then every tensor bit-identical."""
    for step in range(steps):
        _cuda_step(params_a, a, step)
        _cuda_step(params_b, b, step)
    b.drain()
    _assert_same(a, b)


def _slow_compute(opt, cycles=50_000_000):
    """Delays every Muon kernel call on the stream it runs on (the compute stream)."""
    runner = opt._runner
    muon = runner._muon

    def slow(*args):
        torch.cuda._sleep(cycles)
        muon(*args)

    runner._muon = slow


@pytest.mark.gpu
def test_slabs_are_pinned_fp32_views():
    params, opt = _cuda_build()
    for p in params:
        state = opt.state[p]
        assert all(t.device.type == "cpu" and t.dtype == torch.float32 and t.is_pinned() for t in state.values())
        assert_bit_equal(state["master_param"], p.detach().float().cpu(), "master")
    storages = {t.untyped_storage().data_ptr() for k, t in opt.state[params[0]].items()}
    assert len(storages) == 1


@pytest.mark.parametrize("buffer_count, slow", [(1, False), (2, False), (3, False), (1, True)],
                         ids=["1", "2", "3", "1-slow-compute"])
@pytest.mark.gpu
def test_parity_with_resident_on_cuda(buffer_count, slow):
    """Muon through the slots and AdamW on the CPU: the resident optimizer's bits
    (same CUDA Muon kernels on the same values; CPU and CUDA AdamW share their math).
    With a deliberately slow compute and one slot, each chunk's H2D must wait for
    the previous chunk's D2H, or the slot would be overwritten mid-kernel."""
    params_a, a = _cuda_build("none")
    params_b, b = _cuda_build(offload_config=OffloadConfig(buffer_count=buffer_count, slot_numel=PARITY_SLOT_NUMEL))
    if slow:
        _slow_compute(b)
    _assert_same_trajectory(params_a, a, params_b, b, steps=3)


@pytest.mark.gpu
def test_peak_memory_does_not_grow_with_matrices():
    """Peak device memory of a step above the params and grads: the same for 1 and 8 matrices."""
    extra = {}
    for count in (1, 8):
        params, opt = _cuda_build(shapes=[(512, 512)] * count, adamw=False,
                             offload_config=OffloadConfig(buffer_count=2, slot_numel=512 * 512))
        _cuda_step(params, opt, 0)  # slots made
        for p, g in zip(params, _grads(params, 1)):
            p.grad = g
        opt.drain()
        base = _requested_bytes()  # settled first: the peak starts from it
        torch.cuda.reset_peak_memory_stats()
        opt.step()
        opt.drain()
        extra[count] = _requested_bytes("peak") - base
        del params, opt
    assert extra[1] == extra[8]


@pytest.mark.gpu
def test_step_does_not_sync_the_device():
    params, opt = _cuda_build(adamw=False)  # offloaded AdamW waits for its grads on the host, once per step, by design
    _cuda_step(params, opt, 0)
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


@pytest.mark.gpu
def test_late_grads_on_another_stream_are_seen():
    """Grads written late on a side stream the caller's stream waits for."""
    params_a, a = _cuda_build("none")
    params_b, b = _cuda_build(offload_config=OffloadConfig(slot_numel=PARITY_SLOT_NUMEL))
    _cuda_step(params_a, a, 0)
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


@pytest.mark.gpu
def test_forward_right_after_step_sees_new_params():
    params, opt = _cuda_build(adamw=False)
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


@pytest.mark.gpu
def test_release_and_restore_return_memory():
    """release_staging() frees exactly the slots (the memory held before they
    were made; cuBLAS keeps its per-stream workspace), restore_staging() takes it back."""
    params, opt = _cuda_build()
    _cuda_step(params, opt, 0)
    opt.drain()
    held = _requested_bytes()
    slot_bytes = sum(slot.buffer.numel() * 4 for slot in opt._runner.slots)
    assert slot_bytes > 0
    opt.release_staging()
    assert opt.residency == "staging_released"
    assert _requested_bytes() == held - slot_bytes
    opt.restore_staging()
    assert _requested_bytes() == held
    _cuda_step(params, opt, 1)
    opt.drain()


def _copy_writer(seen):
    """A writer that stores the param as the optimizer would, recording its master's device."""
    def writer(param, master, stream, found_inf):
        seen.append(master.device)
        param.data.copy_(master)
    return writer


@pytest.mark.gpu
def test_writer_gets_the_device_master_outside_step():
    """update_param and load_state_dict hand a writer the master on the param's
    device, not the state entry (a view into the CPU slab)."""
    params, opt = _cuda_build(adamw=False)
    p, seen = params[0], []
    opt.register_param_writer(p, _copy_writer(seen))
    _cuda_step(params, opt, 0)
    values = torch.randn(p.shape, device="cuda")
    opt.update_param(p, values)
    assert_bit_equal(p.detach().cpu(), values.bfloat16().cpu(), "param written by the writer")
    state = opt.state_dict()
    opt.update_param(p, torch.zeros_like(values))
    opt.load_state_dict(state)
    assert_bit_equal(opt.get_full_parameter_master(p), values.cpu(), "master after the load")
    assert seen and all(device == p.device for device in seen), seen


@pytest.mark.gpu
def test_adamw_lr_tensor_on_the_device():
    """A device lr tensor (as a capturable run's checkpoint restores it) also
    drives the offloaded AdamW, which runs on the CPU."""
    params_a, a = _cuda_build("none")
    params_b, b = _cuda_build(offload_config=OffloadConfig(slot_numel=PARITY_SLOT_NUMEL))
    for opt in (a, b):
        for group in opt.param_groups:
            group["lr"] = torch.tensor([group["lr"]], device="cuda")
    _assert_same_trajectory(params_a, a, params_b, b, steps=2)


@pytest.mark.gpu
def test_quantized_adamw_param_is_refused():
    """Offloaded AdamW params on CUDA are updated on the CPU: a quantized one
    could not be written through its quantize_."""
    from test_quantized_params import QuantizedTensor

    q = torch.nn.Parameter(QuantizedTensor.of(torch.randn(32, device="cuda")))
    with pytest.raises(ValueError, match="quantized param"):
        MuonAdamW([{"params": [q], "kind": "adamw", "lr": 0.01}], offload="cpu", adapters=False)


@pytest.mark.gpu
def test_unregister_param_writer_right_after_step():
    """With compute still running, unregistering reads the master only after the drain."""
    params_a, a = _cuda_build("none", adamw=False)
    params_b, b = _cuda_build(adamw=False, offload_config=OffloadConfig(buffer_count=1, slot_numel=PARITY_SLOT_NUMEL))
    for params, opt in ((params_a, a), (params_b, b)):
        opt.register_param_writer(params[0], _copy_writer([]))
    _slow_compute(b)
    _cuda_step(params_a, a, 0)
    _cuda_step(params_b, b, 0)
    b.unregister_param_writer(params_b[0])
    a.unregister_param_writer(params_a[0])
    b.drain()
    _assert_same(a, b)
