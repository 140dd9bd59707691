"""MuonAdamW on CUDA (GPU only): against the same optimizer on CPU, with
GradScaler("cuda"), without host syncs, captured in a CUDA graph, and
update_param refused in graph capture."""

import pytest
import torch

import muon_ext
from support.helpers import assert_bit_equal, assert_optimizer_unchanged, optimizer_snapshot, optimizer_tensors
from muon_ext import MuonAdamW

pytestmark = pytest.mark.gpu

N_MUON = 3  # fc.weight, proj.weight, odd: the first group


class _Net(torch.nn.Module):
    """A small GPT-like model: embedding, two MLP Linears, an odd-shaped matrix, LayerNorm, head."""

    def __init__(self):
        super().__init__()
        self.wte = torch.nn.Embedding(100, 48)
        self.fc = torch.nn.Linear(48, 160)
        self.proj = torch.nn.Linear(160, 48)
        self.odd = torch.nn.Parameter(torch.randn(3, 5) * 0.2)
        self.ln = torch.nn.LayerNorm(48)
        self.lm_head = torch.nn.Linear(48, 100, bias=False)


def _build(device, dtype=torch.bfloat16, **kwargs):
    """The same model (same initial bits) on `device`, grouped by muon_ext.param_groups."""
    torch.manual_seed(0)
    model = _Net().to(dtype).to(device)
    groups = muon_ext.param_groups(model, lr=0.02, adamw_lr=0.01, adamw_weight_decay=0.1)
    assert [g["kind"] for g in groups] == ["muon", "adamw"] and len(groups[0]["params"]) == 3
    opt = MuonAdamW(groups, **kwargs)
    return [p for g in opt.param_groups for p in g["params"]], opt


def _grads(step, params):
    """CPU grads for `params` (BF16, like the params), the same for every device."""
    gen = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=gen).to(p.dtype) for p in params]


def _set_grads(params, grads, scale=1.0):
    for p, g in zip(params, grads):
        p.grad = (g.to(p.device) * scale).to(p.dtype)


@pytest.mark.parametrize("config", [dict(), dict(store_param_remainders=False)], ids=["remainder", "fp32_master"])
def test_cuda_matches_cpu(config):
    """3 steps of the same BF16 model on CUDA and CPU: AdamW params, masters,
    moments and steps bit for bit (shared element math, no FMA contraction);
    Muon momentum bit for bit (it depends on grads only); Muon updates to the
    BF16 noise of the CUDA Polar-Express (below 5% of the update norm, as in
    test_muon_cuda.py)."""
    cuda, opt_cuda = _build("cuda", **config)
    cpu, opt_cpu = _build("cpu", **config)
    start = [opt_cpu.get_full_parameter_master(p) for p in cpu]
    for k in range(3):
        grads = _grads(k, cpu)
        _set_grads(cuda, grads)
        _set_grads(cpu, grads)
        opt_cuda.step()
        opt_cpu.step()
    for i, (a, b) in enumerate(zip(cuda, cpu)):
        sa, sb = opt_cuda.state[a], opt_cpu.state[b]
        if i >= N_MUON:
            assert_bit_equal(a.detach().cpu(), b.detach(), f"adamw param {i}")
            for key in sb:
                assert_bit_equal(sa[key].cpu(), sb[key], f"adamw param {i} {key}")
        else:
            assert_bit_equal(sa["momentum_buffer"].cpu(), sb["momentum_buffer"], f"momentum {i}")
            d_cuda = opt_cuda.get_full_parameter_master(a).cpu() - start[i]
            d_cpu = opt_cpu.get_full_parameter_master(b) - start[i]
            assert ((d_cuda - d_cpu).norm() / d_cpu.norm()).item() < 0.05, f"muon param {i}"


def test_grad_scaler_cuda_inf_skips_and_finite_equals_unscaled():
    """GradScaler("cuda"): an inf in one Muon grad leaves every tensor
    bit-identical; with finite grads and a power-of-two scale the run equals
    an unscaled run bit for bit (Muon momentum included)."""
    params, opt = _build("cuda")
    plain, opt_plain = _build("cuda")
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**12)
    for k in range(2):
        scaler.scale(torch.ones((), device="cuda"))
        _set_grads(params, _grads(k, params), scale=scaler.get_scale())
        _set_grads(plain, _grads(k, params))
        scaler.step(opt)
        scaler.update()
        opt_plain.step()
    expected = optimizer_tensors(opt_plain)
    for key, t in optimizer_tensors(opt).items():
        assert_bit_equal(t, expected[key], key)

    snap = optimizer_snapshot(opt)
    scaler.scale(torch.ones((), device="cuda"))
    _set_grads(params, _grads(5, params), scale=scaler.get_scale())
    params[1].grad[0, 0] = float("inf")
    scaler.step(opt)
    scaler.update()
    assert_optimizer_unchanged(opt, snap)
    assert scaler.get_scale() == 2.0**11


def test_step_never_syncs_the_host():
    """opt.step() under torch.cuda.set_sync_debug_mode("error"), called by
    GradScaler.step with float lrs, for Muon and AdamW buckets, every step."""
    params, opt = _build("cuda")
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**8)
    unchecked_step = opt.step

    def checked_step(closure=None):
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            return unchecked_step(closure)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    opt.step = checked_step
    before = params[0].detach().clone()
    for k in range(3):
        scaler.scale(torch.ones((), device="cuda"))
        _set_grads(params, _grads(k, params), scale=scaler.get_scale())
        scaler.step(opt)
        scaler.update()
    assert not torch.equal(params[0].detach(), before)


def test_update_param_is_refused_during_graph_capture():
    """update_param raises inside CUDA graph capture and writes nothing."""
    params, opt = _build("cuda")
    _set_grads(params, _grads(0, params))
    opt.step()
    values = torch.randn(params[0].shape, device="cuda")
    snap = optimizer_snapshot(opt)
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    torch.cuda.synchronize()
    error = None
    with torch.cuda.stream(stream):
        graph.capture_begin()
        try:
            opt.update_param(params[0], values)
        except RuntimeError as exc:
            error = exc
        finally:
            graph.capture_end()
    torch.cuda.synchronize()
    assert error is not None and "capture" in str(error)
    assert_optimizer_unchanged(opt, snap)
    opt.update_param(params[0], values)  # allowed outside capture
    assert_bit_equal(opt.get_full_parameter_master(params[0]), values, "master")


@pytest.mark.parametrize("how", ["capturable", "lr_tensors_by_hand"])
def test_step_captured_in_a_cuda_graph_replays_like_eager(how):
    """With lr as device tensors (capturable=True, or set by hand), a whole step
    (both kinds of groups, Muon workspaces from the graph's pool) captures into
    a CUDA graph; replays with new grads and a changed lr give the same bits as
    eager steps."""
    kwargs = dict(capturable=True) if how == "capturable" else {}
    eager_params, eager = _build("cuda", **kwargs)
    graph_params, graphed = _build("cuda", **kwargs)
    for opt in (eager, graphed):
        for group in opt.param_groups:
            if not isinstance(group["lr"], torch.Tensor):
                group["lr"] = torch.tensor([group["lr"]], device="cuda")
    static_grads = [torch.zeros_like(p) for p in graph_params]
    for p, g in zip(graph_params, static_grads):
        p.grad = g

    # Warm up on a side stream (first-use allocations), then capture one step.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    warm = _build("cuda", **kwargs)[1]
    for group in warm.param_groups:
        if not isinstance(group["lr"], torch.Tensor):
            group["lr"] = torch.tensor([group["lr"]], device="cuda")
    with torch.cuda.stream(side):
        _set_grads([p for g in warm.param_groups for p in g["params"]], _grads(0, graph_params))
        warm.step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graphed.step()

    for step in range(3):
        grads = _grads(step, graph_params)
        for g, new in zip(static_grads, grads):
            g.copy_(new.to("cuda"))
        _set_grads(eager_params, grads)
        if step == 2:
            for opt in (eager, graphed):
                for group in opt.param_groups:
                    group["lr"].mul_(0.5)
        graph.replay()
        eager.step()
    torch.cuda.synchronize()
    for (name, a), b in zip(optimizer_tensors(graphed).items(), optimizer_tensors(eager).values()):
        assert_bit_equal(a, b, name)


def test_capture_with_a_float_lr_is_refused():
    params, opt = _build("cuda")
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()  # warm-up outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="capturable=True"):
        with torch.cuda.graph(graph):
            opt.step()
