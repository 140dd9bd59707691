"""Quantized params (the TransformerEngine protocol: a tensor subclass with
`dequantize()` and `quantize_(src)`): an FP32 master beside each, updated
as an FP32 param would be, and the param written through `quantize_`."""

import pytest
import torch
from torch.utils._pytree import tree_map

import muon_ext
from support.helpers import assert_bit_equal
from support.optimizer_helpers import bf16_values, grad_seq

FP8_MAX = 448.0


def _fp8(x: torch.Tensor):
    """Per-tensor FP8 (e4m3) codes and scale of FP32 `x`: scale = amax / 448 (1 for all zeros)."""
    amax = x.abs().max()
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


class QuantizedTensor(torch.Tensor):
    """Test-only quantized param: FP8 codes and one FP32 scale, with a nominal
    high-precision dtype; every other op sees the dequantized values."""

    @staticmethod
    def __new__(cls, codes, scale, dtype):
        return torch.Tensor._make_wrapper_subclass(cls, codes.shape, dtype=dtype, device=codes.device)

    def __init__(self, codes, scale, dtype):
        self._codes, self._scale = codes, scale
        self.noop_flags = []

    @classmethod
    def of(cls, x: torch.Tensor, dtype=torch.bfloat16):
        return cls(*_fp8(x.float()), dtype)

    def dequantize(self):
        return (self._codes.float() * self._scale).to(self.dtype)

    def quantize_(self, src, *, noop_flag=None):
        self.noop_flags.append(noop_flag)
        codes, scale = _fp8(src.float())
        if noop_flag is not None:  # a skipped step keeps the stored values (device-side, no sync)
            keep = noop_flag.reshape(()) != 0
            codes = torch.where(keep, self._codes.float(), codes.float()).to(torch.float8_e4m3fn)
            scale = torch.where(keep, self._scale, scale)
        self._codes.copy_(codes)
        self._scale.copy_(scale)
        return self

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.detach.default:  # nn.Parameter(...) and .data share the codes
            (t,) = args
            return cls(t._codes, t._scale, t.dtype)
        unwrap = lambda t: t.dequantize() if isinstance(t, cls) else t  # noqa: E731
        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))


SHAPES = [(16, 32), (16, 32), (32,)]


def _groups(params):
    return [{"params": params[:2], "kind": "muon", "lr": 0.02, "polar_dtype": "float32"},
            {"params": params[2:], "kind": "adamw", "lr": 0.01}]


def _step(opt, params, grads):
    for p, g in zip(params, grads):
        p.grad = g.to(p.dtype)
    opt.step()


def _fp8_error_bound(master):
    """Half an FP8 ulp of each value (relative 2^-4) or of the subnormal spacing (2^-9 scale), plus BF16 rounding."""
    scale = master.abs().max() / FP8_MAX
    return torch.maximum(master.abs() * 2.0 ** -4, scale * 2.0 ** -10) * (1 + 2.0 ** -7) + master.abs() * 2.0 ** -8


def test_quantized_params_follow_the_fp32_run():
    values = bf16_values(SHAPES, seed=5)
    quantized = [torch.nn.Parameter(QuantizedTensor.of(v)) for v in values]
    # FP32 reference: the quantized params' FP32 masters start from the dequantized values.
    reference = [torch.nn.Parameter(q.dequantize().float()) for q in quantized]
    opt = muon_ext.MuonAdamW(_groups(quantized), adapters=False)
    ref = muon_ext.MuonAdamW(_groups(reference), adapters=False)
    assert all(opt.state[p]["master_param"].dtype == torch.float32 for p in quantized)
    grads = grad_seq(SHAPES, 4)
    for k in range(4):
        _step(opt, quantized, grads[k])
        _step(ref, reference, grads[k])
    for q, r in zip(quantized, reference):
        master = opt.get_full_parameter_master(q)
        assert_bit_equal(master, r.detach(), "FP32 master of a quantized param")
        error = (q.dequantize().float() - master).abs()
        assert bool((error <= _fp8_error_bound(master)).all()), f"max FP8 error {error.max()}"
        expected = QuantizedTensor.of(master)
        assert_bit_equal(q._codes, expected._codes, "written through quantize_")
        assert q.noop_flags == [None] * 4
    with pytest.raises(ValueError, match="quantized param"):
        opt.unregister_param_writer(quantized[0])
    with pytest.raises(ValueError, match="already has its quantize_ writer"):
        opt.register_param_writer(quantized[0], lambda *a: None)


def test_quantized_param_gets_grad_scaler_flag_and_update_param():
    values = bf16_values(SHAPES, seed=6)
    quantized = [torch.nn.Parameter(QuantizedTensor.of(v)) for v in values]
    opt = muon_ext.MuonAdamW(_groups(quantized), adapters=False)
    codes = [q._codes.clone() for q in quantized]
    opt.found_inf, opt.grad_scale = torch.ones(()), torch.ones(())
    _step(opt, quantized, grad_seq(SHAPES, 1)[0])
    for q, c in zip(quantized, codes):
        assert len(q.noop_flags) == 1 and float(q.noop_flags[0]) == 1.0
        assert_bit_equal(q._codes, c, "a skipped step keeps the quantized values")
    new = torch.randn(SHAPES[0])
    opt.update_param(quantized[0], new)
    assert_bit_equal(opt.get_full_parameter_master(quantized[0]), new)
    assert_bit_equal(quantized[0]._codes, QuantizedTensor.of(new)._codes)


def test_quantized_param_trains_through_autograd():
    torch.manual_seed(0)
    weight = torch.nn.Parameter(QuantizedTensor.of(torch.randn(16, 32) * 0.1, torch.float32))
    opt = muon_ext.MuonAdamW([{"params": [weight], "kind": "muon", "lr": 0.05}], adapters=False)
    x, target = torch.randn(64, 32), torch.randn(64, 16)
    losses = []
    for _ in range(5):
        loss = torch.nn.functional.mse_loss(x @ weight.t(), target)
        opt.zero_grad()
        loss.backward()
        assert type(weight.grad) is torch.Tensor and weight.grad.dtype == torch.float32
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


@pytest.mark.gpu
def test_transformer_engine_float8_params_train():
    te = pytest.importorskip("transformer_engine.pytorch")
    with te.fp8_model_init(enabled=True):
        layer = te.Linear(64, 64, bias=False, params_dtype=torch.bfloat16, device="cuda")
    weight = layer.weight
    assert muon_ext.writers.is_quantized(weight)
    opt = muon_ext.MuonAdamW([{"params": [weight], "kind": "muon", "lr": 0.02}], adapters=False)
    master = opt.get_full_parameter_master(weight).clone()
    weight.grad = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
    opt.step()
    new_master = opt.get_full_parameter_master(weight)
    assert not torch.equal(master, new_master)
    error = (weight.dequantize().float() - new_master).abs()
    assert bool((error <= _fp8_error_bound(new_master) * 2).all())
