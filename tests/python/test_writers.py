"""Param writers: registration, the step / update_param / load_state_dict
paths through a writer, released storage, and GradScaler's found-inf flag."""

import copy

import pytest
import torch

import muon_ext
from support.helpers import assert_bit_equal, bits
from support.optimizer_helpers import bf16_values, grad_seq

SHAPES = [(8, 16), (8, 16), (12,)]


class Recorder:
    """A writer that records its calls and stores round-to-nearest-even BF16 of the master into `out`."""

    def __init__(self, shape):
        self.out = torch.full(shape, float("nan"), dtype=torch.bfloat16)
        self.calls = []

    def __call__(self, param, master, stream, found_inf):
        self.calls.append((param, master.clone(), stream, found_inf))
        self.out.copy_(master)


def _model(dtype=torch.bfloat16, seed=0):
    return [torch.nn.Parameter(v.to(dtype)) for v in bf16_values(SHAPES, seed=seed)]


def _opt(params, **kw):
    groups = [{"params": params[:2], "kind": "muon", "lr": 0.02, "polar_dtype": "float32"},
              {"params": params[2:], "kind": "adamw", "lr": 0.01}]
    return muon_ext.MuonAdamW(groups, adapters=False, **kw)


def _step(opt, params, grads):
    for p, g in zip(params, grads):
        p.grad = None if g is None else g.to(p.dtype)
    opt.step()


def _state_bits(opt):
    """Every state tensor's bytes as a hashable snapshot (params may be released: not read)."""
    return {(id(p), k): bytes(bits(v).tolist()) for p, s in opt.state.items() for k, v in s.items()
            if isinstance(v, torch.Tensor)}


def test_writer_receives_final_masters_and_params_are_left_alone():
    # Masters with writers follow the FP32-master trajectory bit for bit; the BF16 params are not written.
    params, reference = _model(), _model()
    opt, ref = _opt(params), _opt(reference, store_param_remainders=False)
    recorders = [Recorder(p.shape) for p in params]
    for p, r in zip(params, recorders):
        opt.register_param_writer(p, r)
    before = [p.detach().clone() for p in params]
    grads = grad_seq(SHAPES, 3)
    for k in range(3):
        _step(opt, params, grads[k])
        _step(ref, reference, grads[k])
        for p, q, r in zip(params, reference, recorders):
            assert len(r.calls) == k + 1
            param, master, stream, found_inf = r.calls[-1]
            assert param is p and stream is None and found_inf is None
            assert_bit_equal(master, ref.state[q]["master_param"], f"master after step {k}")
            assert_bit_equal(r.out, q.detach(), "writer output vs built-in writeback")
    for p, b in zip(params, before):
        assert_bit_equal(p.detach(), b, "param with a writer")
    for p, q in zip(params, reference):
        assert_bit_equal(opt.get_full_parameter_master(p), ref.get_full_parameter_master(q))


def test_writer_not_called_without_grad_and_gets_found_inf():
    params = _model()
    opt = _opt(params)
    rec = Recorder(params[0].shape)
    opt.register_param_writer(params[0], rec)
    grads = grad_seq(SHAPES, 1)[0]
    _step(opt, params, [None] + grads[1:])
    assert rec.calls == []
    # GradScaler's flag reaches the writer as the device tensor (nonzero: skipped step).
    opt.found_inf, opt.grad_scale = torch.ones(()), torch.ones(())
    master = opt.get_full_parameter_master(params[0])
    _step(opt, params, grads)
    (_, seen, _, found_inf), = rec.calls
    assert found_inf is not None and float(found_inf) == 1.0
    assert_bit_equal(seen, master, "a skipped step leaves the master")


def test_registration_converts_remainders_exactly_and_back():
    params, reference = _model(), _model()
    opt, ref = _opt(params), _opt(reference)
    grads = grad_seq(SHAPES, 4)
    for k in range(2):
        _step(opt, params, grads[k])
        _step(ref, reference, grads[k])
    p = params[0]
    master = opt.get_full_parameter_master(p)
    assert opt.state[p]["master_param"].dtype == torch.int16
    opt.register_param_writer(p, lambda *a: None)
    assert opt.state[p]["master_param"].dtype == torch.float32
    assert_bit_equal(opt.get_full_parameter_master(p), master, "FP32 master from remainders")
    opt.unregister_param_writer(p)
    assert opt.state[p]["master_param"].dtype == torch.int16
    assert_bit_equal(opt.get_full_parameter_master(p), master, "remainders from the FP32 master")
    for k in range(2, 4):
        _step(opt, params, grads[k])
        _step(ref, reference, grads[k])
    for a, b in zip(params, reference):
        assert_bit_equal(a.detach(), b.detach())
        assert_bit_equal(opt.state[a]["master_param"], ref.state[b]["master_param"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_unregister_restores_the_dtype_mode(dtype):
    params = _model(dtype)
    opt = _opt(params)
    p = params[0]
    opt.register_param_writer(p, Recorder(p.shape))
    _step(opt, params, grad_seq(SHAPES, 1)[0])
    master = opt.get_full_parameter_master(p)
    opt.unregister_param_writer(p)
    assert ("master_param" in opt.state[p]) == (dtype != torch.float32)
    assert_bit_equal(p.detach(), master.to(dtype), "param written from its master")


def test_registration_errors_change_nothing():
    params = _model()
    opt = _opt(params)
    other = torch.nn.Parameter(torch.zeros(8, 16, dtype=torch.bfloat16))
    snap = _state_bits(opt)
    with pytest.raises(TypeError, match="callable"):
        opt.register_param_writer(params[0], "not a writer")
    with pytest.raises(ValueError, match="not a parameter of this optimizer"):
        opt.register_param_writer(other, Recorder(other.shape))
    with pytest.raises(ValueError, match="not a parameter of this optimizer"):
        opt.register_param_writer(params[0].data, Recorder(other.shape))
    with pytest.raises(ValueError, match="own storage"):
        opt.register_param_writer(params[0], Recorder(other.shape), storage=params[1].untyped_storage())
    with pytest.raises(TypeError, match="UntypedStorage"):
        opt.register_param_writer(params[0], Recorder(other.shape), storage=params[0])
    with pytest.raises(ValueError, match="has no registered writer"):
        opt.unregister_param_writer(params[0])
    assert _state_bits(opt) == snap
    opt.register_param_writer(params[0], Recorder(other.shape))
    snap = _state_bits(opt)
    with pytest.raises(ValueError, match="already has a writer"):
        opt.register_param_writer(params[0], Recorder(other.shape))
    assert _state_bits(opt) == snap
    # A released param whose master needs its values cannot take a writer.
    params[1].untyped_storage().resize_(0)
    with pytest.raises(ValueError, match="register the writer before releasing"):
        opt.register_param_writer(params[1], Recorder(other.shape), storage=params[1].untyped_storage())
    assert _state_bits(opt) == snap
    with pytest.raises(TypeError, match="cannot be copied"):
        copy.deepcopy(opt)


def test_released_storage_with_matching_writer_steps():
    params, reference = _model(), _model()
    opt, ref = _opt(params), _opt(reference, store_param_remainders=False)
    rec = Recorder(params[0].shape)
    opt.register_param_writer(params[0], rec, storage=params[0].untyped_storage())
    params[0].untyped_storage().resize_(0)  # handed to an inference engine
    grads = grad_seq(SHAPES, 2)
    for k in range(2):
        _step(opt, params, grads[k])
        _step(ref, reference, grads[k])
    assert len(rec.calls) == 2
    assert_bit_equal(opt.state[params[0]]["master_param"], ref.state[reference[0]]["master_param"])
    # update_param and get_full_parameter_master work on the released param, through the writer.
    values = torch.randn(params[0].shape)
    opt.update_param(params[0], values)
    assert_bit_equal(opt.get_full_parameter_master(params[0]), values)
    assert_bit_equal(rec.calls[-1][1], values)
    assert rec.calls[-1][3] is None
    # A checkpoint of the released param round-trips through the writer into a fresh optimizer.
    saved = opt.state_dict()
    assert_bit_equal(saved["state"][0]["master_param"], values)
    params2 = _model(seed=9)
    opt2 = _opt(params2)
    rec2 = Recorder(params2[0].shape)
    opt2.register_param_writer(params2[0], rec2, storage=params2[0].untyped_storage())
    params2[0].untyped_storage().resize_(0)
    opt2.load_state_dict(saved)
    assert_bit_equal(opt2.get_full_parameter_master(params2[0]), values)
    assert_bit_equal(rec2.out, values.bfloat16())
    assert params[0].untyped_storage().nbytes() == 0


def test_released_storage_without_matching_registration_changes_nothing():
    params = _model()
    opt = _opt(params)
    grads = grad_seq(SHAPES, 2)
    _step(opt, params, grads[0])
    # No writer at all.
    params[0].untyped_storage().resize_(0)
    snap = _state_bits(opt)
    for p, g in zip(params, grads[1]):
        p.grad = g.to(p.dtype)
    with pytest.raises(ValueError, match=r"group 0 \(muon\), param 0.*register a param writer"):
        opt.step()
    assert _state_bits(opt) == snap
    with pytest.raises(ValueError, match="register a param writer"):
        opt.update_param(params[0], torch.zeros(params[0].shape))
    assert _state_bits(opt) == snap
    # A writer registered without storage=.
    params2 = _model()
    opt2 = _opt(params2)
    rec = Recorder(params2[0].shape)
    opt2.register_param_writer(params2[0], rec)
    params2[0].untyped_storage().resize_(0)
    snap = _state_bits(opt2)
    for p, g in zip(params2, grads[1]):
        p.grad = g.to(p.dtype)
    with pytest.raises(ValueError, match="registered without storage="):
        opt2.step()
    assert _state_bits(opt2) == snap and rec.calls == []
    # The param's storage replaced after registration, then released.
    params3 = _model()
    opt3 = _opt(params3)
    rec = Recorder(params3[0].shape)
    opt3.register_param_writer(params3[0], rec, storage=params3[0].untyped_storage())
    params3[0].data = params3[0].data.clone()
    params3[0].untyped_storage().resize_(0)
    for p, g in zip(params3, grads[1]):
        p.grad = g.to(p.dtype)
    snap = _state_bits(opt3)
    with pytest.raises(ValueError, match="not the storage its writer was registered with"):
        opt3.step()
    assert _state_bits(opt3) == snap and rec.calls == []


def test_load_state_dict_through_writer():
    params, source = _model(), _model(seed=3)
    opt, src = _opt(params), _opt(source)
    _step(src, source, grad_seq(SHAPES, 1)[0])
    saved = src.state_dict()
    rec = Recorder(params[0].shape)
    opt.register_param_writer(params[0], rec, storage=params[0].untyped_storage())
    params[0].untyped_storage().resize_(0)
    opt.load_state_dict(saved)
    assert_bit_equal(opt.get_full_parameter_master(params[0]), src.get_full_parameter_master(source[0]))
    assert_bit_equal(rec.calls[-1][1], src.get_full_parameter_master(source[0]))
    assert_bit_equal(rec.out, source[0].detach(), "the writer stores what the built-in writeback would")
    # TransformerEngine-style int16 remainders need the live BF16 param.
    te_style = copy.deepcopy(saved)
    te_style["state"][0]["master_param"] = src.state[source[0]]["master_param"].clone()
    snap = _state_bits(opt)
    with pytest.raises(ValueError, match="storage is released"):
        opt.load_state_dict(te_style)
    assert _state_bits(opt) == snap


def test_writer_failure_is_named():
    params = _model()
    opt = _opt(params)

    def broken(param, master, stream, found_inf):
        raise KeyError("inference engine gone")

    opt.register_param_writer(params[1], broken)
    with pytest.raises(muon_ext.writers.ParamWriterError,
                       match=r"param writer of 1 param\(s\) failed.*param group 0 \(muon\), param 1: KeyError"):
        _step(opt, params, grad_seq(SHAPES, 1)[0])


@pytest.mark.parametrize("buffer_count", [1, 2])
def test_writer_in_the_staged_path(buffer_count):
    # offload="cpu": the writer gets the slot's master (equal to the resident run's) before the slot is reused.
    params, reference = _model(), _model()
    opt = _opt(params, offload="cpu", offload_config=muon_ext.OffloadConfig(buffer_count=buffer_count,
                                                                           slot_numel=8 * 16))
    ref = _opt(reference, store_param_remainders=False)
    recorders = [Recorder(p.shape) for p in params]
    for p, r in zip(params, recorders):
        opt.register_param_writer(p, r, storage=p.untyped_storage())
    params[0].untyped_storage().resize_(0)
    grads = grad_seq(SHAPES, 3)
    for k in range(3):
        _step(opt, params, grads[k])
        _step(ref, reference, grads[k])
        for r, q in zip(recorders, reference):
            assert_bit_equal(r.calls[-1][1], ref.state[q]["master_param"], f"staged master, step {k}")
    opt.drain()
    for p, q in zip(params, reference):
        assert_bit_equal(opt.get_full_parameter_master(p), ref.get_full_parameter_master(q))
    fp32 = [torch.nn.Parameter(v) for v in bf16_values(SHAPES)]
    staged_fp32 = _opt(fp32, offload="cpu")
    with pytest.raises(ValueError, match="with offload='cpu', writers are supported"):
        staged_fp32.register_param_writer(fp32[0], Recorder(fp32[0].shape))


def test_fp8_writer_keeps_an_inference_copy_of_a_released_param():
    # The use case writers serve: BF16 expert weights released, the FP8 copy (DeepSeek block layout) written each step.
    from muon_ext import quantized, reference

    shapes = [(160, 136), (160, 136), (12,)]
    params = [torch.nn.Parameter(v.bfloat16()) for v in bf16_values(shapes, seed=4)]
    groups = [{"params": params[:2], "kind": "muon", "lr": 0.02}, {"params": params[2:], "kind": "adamw"}]
    opt = muon_ext.MuonAdamW(groups, adapters=False)
    copies = []
    for p in params[:2]:
        q = torch.zeros(p.shape, dtype=torch.float8_e4m3fn)
        scale_inv = torch.zeros(quantized.scale_inv_shape(p.shape, (128, 128)))
        opt.register_param_writer(p, quantized.Fp8Writer(q, scale_inv), storage=p.untyped_storage())
        p.untyped_storage().resize_(0)
        copies.append((q, scale_inv))
    grads = grad_seq(shapes, 3)
    for k in range(3):
        _step(opt, params, grads[k])
        for p, (q, scale_inv) in zip(params, copies):
            want_q, want_scale = reference.quantize_fp8(opt.get_full_parameter_master(p), block=(128, 128))
            assert_bit_equal(q, want_q, f"FP8 copy after step {k}")
            assert_bit_equal(scale_inv, want_scale, f"FP8 scales after step {k}")
    # A GradScaler-skipped step leaves the FP8 copy as it is.
    before = [q.clone() for q, _ in copies]
    opt.found_inf, opt.grad_scale = torch.ones(()), torch.ones(())
    _step(opt, params, grads[0])
    for (q, _), b in zip(copies, before):
        assert_bit_equal(q, b, "skipped step")


# -- On CUDA (marked gpu, skipped without a device; before: test_writers_cuda.py)
# Param writers on CUDA (GPU only): the writer runs on the caller's current
# stream with the device-side GradScaler flag, a released storage is accepted
# with its writer, the step stays free of host syncs, and masters match the
# same run on the CPU bit for bit.


CUDA_SHAPES = [(64, 128), (64, 128), (96,)]


def _build(device, dtype=torch.bfloat16):
    params = [torch.nn.Parameter(v.to(dtype).to(device)) for v in bf16_values(CUDA_SHAPES, seed=2)]
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


@pytest.mark.gpu
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
    grads = grad_seq(CUDA_SHAPES, 3)
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


@pytest.mark.gpu
def test_grad_scaler_skip_reaches_writer_on_device():
    """FP16 params: GradScaler's CUDA inf check has no BF16 kernel."""
    params, opt = _build("cuda", torch.float16)
    writer = StreamRecorder(params[0].shape, "cuda")
    opt.register_param_writer(params[0], writer)
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0 ** 4)
    scaler.scale(torch.ones((), device="cuda"))  # GradScaler refuses step() before a scale()
    before = writer.out.clone()
    for p, g in zip(params, grad_seq(CUDA_SHAPES, 1)[0]):
        p.grad = g.half().cuda()
    params[1].grad[0, 0] = float("inf")
    scaler.step(opt)
    scaler.update()
    assert len(writer.flags) == 1 and writer.flags[0].is_cuda and float(writer.flags[0]) == 1.0
    assert_bit_equal(writer.out, before, "skipped step: writer output unchanged")
