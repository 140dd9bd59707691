"""Regression tests for the single-process reliability repros (rounds 2 and 3):
each call either completes or raises with nothing changed; writer failures are
reported after the call completed, the same resident and staged; row-block
settings are checked before any write, like every other setting."""

from __future__ import annotations

import copy

import pytest
import torch

import muon_ext
from muon_ext import quantized
from muon_ext.writers import ParamWriterError
from support.helpers import run_python
from support.optimizer_snapshot import snapshot


def _bf16(shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.nn.Parameter(torch.randn(shape, generator=g).bfloat16())


def _grads(params, seed):
    g = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)


# -- unregister_param_writer on a param that became non-contiguous -----------------


def test_unregister_writer_of_a_non_contiguous_param_is_refused_with_nothing_changed():
    p, other = _bf16((8, 3, 2, 2), 0), _bf16((4, 4), 1)
    opt = muon_ext.MuonAdamW([{"params": [other], "kind": "muon"},
                              {"params": [p], "kind": "muon", "matrix_view": "flatten"}], adapters=False)
    seen = []
    opt.register_param_writer(p, lambda param, master, stream, found_inf: seen.append(master.clone()))
    _grads([p, other], 2)
    opt.step()
    exact = opt.get_full_parameter_master(p)
    p.data = p.data.contiguous(memory_format=torch.channels_last)  # e.g. model.to(channels_last)
    before = snapshot(opt)
    with pytest.raises(ValueError, match=r"param group 1 \(muon\), param 0 is no longer contiguous"):
        opt.unregister_param_writer(p)
    assert snapshot(opt) == before
    assert opt._states.info(p).writer is not None
    p.data = p.data.contiguous()
    assert torch.equal(opt.get_full_parameter_master(p), exact)
    _grads([p, other], 3)
    opt.step()  # the buckets are intact: the writer bucket still steps
    assert len(seen) == 2
    opt.unregister_param_writer(p)  # now accepted: the remainders hold the exact master
    assert torch.equal(opt.get_full_parameter_master(p), seen[-1])
    assert opt.state[p]["master_param"].dtype == torch.int16


# -- FP8 block sizes whose products or sums overflow int64 -------------------------


def test_fp8_huge_blocks_act_as_one_block_without_sigfpe():
    # Runs in a child process: the old kernel died of SIGFPE (block area wrapping to 0).
    code = r"""
import torch
from muon_ext import quantized
m = torch.randn(256, 256, generator=torch.Generator().manual_seed(0))
whole_q, whole_s = quantized.quantize_fp8(m, block=(256, 256))
for block in [(2**32, 2**32), (2**63 - 1, 1), (1, 2**63 - 1), (2**63 - 1, 2**63 - 1)]:
    expect = quantized.scale_inv_shape(m.shape, block)
    q, s = quantized.quantize_fp8(m, block=block)
    assert tuple(s.shape) == expect, (block, s.shape, expect)
    ref_q, ref_s = quantized.quantize_fp8(m, block=(min(block[0], 256), min(block[1], 256)))
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(s, ref_s), block
    out = torch.zeros(256, 256, dtype=torch.float8_e4m3fn)
    torch.ops.muon_ext.quantize_fp8(m, list(block), out, torch.zeros(expect), None)
    assert torch.equal(out.view(torch.uint8), ref_q.view(torch.uint8)), block
q, s = quantized.quantize_fp8(m, block=(2**32, 2**32))
assert torch.equal(q.view(torch.uint8), whole_q.view(torch.uint8)) and torch.equal(s, whole_s)
try:  # a wrong scale shape for a huge block is refused, not silently skipped
    torch.ops.muon_ext.quantize_fp8(m, [2**63 - 1, 1], torch.zeros(256, 256, dtype=torch.float8_e4m3fn),
                                    torch.zeros(0, 256), None)
    raise SystemExit("wrong out_scale_inv shape accepted")
except ValueError as e:
    assert "out_scale_inv has shape [0, 256], expected [1, 256]" in str(e), e
print("ok")
"""
    r = run_python(code)  # outside the source tree: the installed package, not ./muon_ext
    assert r.returncode == 0 and r.stdout.strip() == "ok", (r.returncode, r.stdout, r.stderr[-2000:])


# -- zero-size Muon params with 0-row matrices under matrix_view="batch" -----------


@pytest.mark.parametrize("offload", ["none", "cpu"])
@pytest.mark.parametrize("shape", [(3, 0, 7), (3, 7, 0), (0, 4, 4), (3, 0, 0)])
def test_zero_size_batch_param_loads_its_own_state_dict(offload, shape):
    def build():
        p = torch.nn.Parameter(torch.zeros(shape, dtype=torch.bfloat16))
        w = torch.nn.Parameter(torch.randn(4, 4, generator=torch.Generator().manual_seed(0)))
        return [p, w], muon_ext.MuonAdamW([{"params": [p, w], "kind": "muon", "matrix_view": "batch"}],
                                          offload=offload, adapters=False)

    (p, w), opt = build()
    w.grad = torch.ones(4, 4)
    opt.step()
    sd = copy.deepcopy(opt.state_dict())
    opt.load_state_dict(sd)
    (p2, w2), fresh = build()
    fresh.load_state_dict(sd)
    w2.data.copy_(w)  # FP32 params are their own masters: the model's weights come with the model
    for o, q in ((opt, w), (fresh, w2)):
        q.grad = torch.ones(4, 4)
        o.step()
    assert torch.equal(w, w2) and torch.equal(opt.state[w]["momentum_buffer"], fresh.state[w2]["momentum_buffer"])


# -- writers: validated at registration; failing in a call: the call completes, then reports ----


def _three_params():
    return [_bf16((8, 8), 0), _bf16((8, 8), 1), _bf16((6,), 2)]


def _opt(params, **kw):
    return muon_ext.MuonAdamW([{"params": params[:2], "kind": "muon", "lr": 0.02},
                               {"params": params[2:], "kind": "adamw", "lr": 0.01}], adapters=False, **kw)


def test_fp8_writer_with_buffers_for_another_shape_is_refused_at_registration():
    params = _three_params()
    opt = _opt(params)
    before = snapshot(opt)
    wrong = quantized.Fp8Writer(torch.empty(4, 4, dtype=torch.float8_e4m3fn), torch.empty(1, 1))
    with pytest.raises(ValueError, match=r"param group 0 \(muon\), param 1: the writer does not accept this param: "
                                         r"Fp8Writer: q_out has shape \(4, 4\) on cpu, the param \(8, 8\)"):
        opt.register_param_writer(params[1], wrong)
    assert snapshot(opt) == before
    right = quantized.Fp8Writer(torch.empty(8, 8, dtype=torch.float8_e4m3fn),
                                torch.empty(quantized.scale_inv_shape((8, 8))))
    opt.register_param_writer(params[1], right)


class FlakyWriter:
    """Records every master it is given; raises while `broken`."""

    def __init__(self):
        self.broken, self.masters = False, []

    def __call__(self, param, master, stream, found_inf):
        if self.broken:
            raise RuntimeError("engine down")
        self.masters.append(master.clone())


def test_writer_failing_inside_load_state_dict_completes_the_load_then_reports():
    src_params = _three_params()
    src = muon_ext.MuonAdamW([{"params": src_params[:2], "kind": "muon", "lr": 0.05},
                              {"params": src_params[2:], "kind": "adamw", "lr": 0.5}], adapters=False)
    _grads(src_params, 5)
    src.step()
    sd = copy.deepcopy(src.state_dict())

    params, clean_params = _three_params(), _three_params()
    opt, clean = _opt(params), _opt(clean_params)
    flaky = FlakyWriter()
    opt.register_param_writer(params[1], flaky)
    clean.register_param_writer(clean_params[1], FlakyWriter())
    flaky.broken = True
    with pytest.raises(ParamWriterError, match=r"load_state_dict: completed.*param group 0 \(muon\), param 1: "
                                               r"RuntimeError: engine down") as info:
        opt.load_state_dict(sd)
    assert [name for name, _ in info.value.failures] == ["param group 0 (muon), param 1"]
    clean.load_state_dict(sd)
    assert [g[:-1] for g in snapshot(opt)["groups"]] == [g[:-1] for g in snapshot(clean)["groups"]]  # not params
    for p, q in zip(params, clean_params):
        assert {k: v for k, v in opt.state[p].items()}.keys() == clean.state[q].keys()
        for k in opt.state[p]:
            assert torch.equal(opt.state[p][k], clean.state[q][k]), k
    # The stale writer is retried at the end of the next step, also without a grad for its param.
    flaky.broken = False
    _grads([params[0], clean_params[0]], 6)
    opt.step()
    clean.step()
    assert len(flaky.masters) == 1 and torch.equal(flaky.masters[0], src.get_full_parameter_master(src_params[1]))
    assert not opt._states.stale_writers


def test_writer_failing_inside_update_param_writes_the_master_then_reports():
    params = _three_params()
    opt = _opt(params)
    flaky = FlakyWriter()
    opt.register_param_writer(params[1], flaky)
    flaky.broken = True
    values = torch.full((8, 8), 0.25)
    with pytest.raises(ParamWriterError, match="update_param: completed"):
        opt.update_param(params[1], values)
    assert torch.equal(opt.get_full_parameter_master(params[1]), values)
    flaky.broken = False
    opt.update_param(params[1], values + 1)  # a later successful write clears the stale mark
    assert not opt._states.stale_writers and torch.equal(flaky.masters[-1], values + 1)


@pytest.mark.parametrize("failing_step", [0, 1])
def test_writer_failing_mid_step_keeps_the_step_the_same_resident_and_staged(failing_step):
    # The step completes everywhere (every bucket's update stays, staged state is copied back), then
    # reports; resident and offload="cpu" end with the same masters and state as a run whose writer works.
    runs = {}
    for mode in ("resident", "staged", "working"):
        params = _three_params()
        kw = {"offload": "cpu", "offload_config": muon_ext.OffloadConfig(buffer_count=1, slot_numel=64)} \
            if mode == "staged" else {"store_param_remainders": False}
        opt = _opt(params, **kw)
        writer = FlakyWriter()
        opt.register_param_writer(params[0], writer)
        for k in range(3):
            _grads(params, 10 + k)
            writer.broken = mode != "working" and k == failing_step
            if writer.broken:
                with pytest.raises(ParamWriterError, match=r"step: completed.*param group 0 \(muon\), param 0"):
                    opt.step()
            else:
                opt.step()
        runs[mode] = ([opt.get_full_parameter_master(p) for p in params],
                      [opt.state[p]["momentum_buffer"].clone() for p in params[:2]], writer.masters)
    for mode in ("resident", "staged"):
        masters, moms, seen = runs[mode]
        assert all(torch.equal(a, b) for a, b in zip(masters, runs["working"][0])), mode
        assert all(torch.equal(a, b) for a, b in zip(moms, runs["working"][1])), mode
        assert torch.equal(seen[-1], runs["working"][2][-1]), mode  # the writer caught up
        assert len(seen) == 2  # 3 steps, one failed call


# -- row_block_scales whose products with the lr or weight decay leave the kernels' range ------------------------


@pytest.mark.parametrize("scale, lr, what", [(1e300, 1e-3, "a lr of 1e\\+297"),
                                             (1e-300, 1e-3, "a weight_decay of 1e\\+299"),
                                             (1e36, torch.tensor(1e3), "a lr of 1e\\+39")])
def test_row_block_scales_out_of_range_are_refused_before_any_write(scale, lr, what):
    """A huge (or tiny) scale is a valid setting on its own, but the block's lr (times the scale) or weight decay
    (divided by it) overflows FP32: refused at the step, before the first group is written, not by the kernel
    after other params and the param's earlier blocks were (also for a CPU tensor lr, read on the host)."""
    torch.manual_seed(0)
    a, b, w = (torch.nn.Parameter(torch.randn(shape)) for shape in ((8, 8), (8,), (12, 8)))
    opt = muon_ext.MuonAdamW([dict(params=[a], kind="muon"), dict(params=[b], kind="adamw"),
                              dict(params=[w], kind="muon", lr=lr, row_blocks=(4, 4, 4),
                                   row_block_scales=(1.0, scale, 1.0))], adapters=False)
    _grads([a, b, w], 1)
    before = snapshot(opt)
    with pytest.raises(ValueError, match=rf"param group 2( \(muon\))?: row_block_scales\[1\]=.* gives row block 1 {what}"):
        opt.step()
    assert snapshot(opt) == before
    opt.param_groups[2]["row_block_scales"] = (1.0, 2.0, 1.0)
    opt.step()  # in step again
    assert all(torch.isfinite(p).all() for p in (a, b, w))
