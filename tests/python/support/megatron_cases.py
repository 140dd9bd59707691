"""Cases of tests/python/test_megatron.py, run inside one spawned 2-process gloo
job under support.megatron_cpu (megatron-core on the CPU). Each case leaves
model parallel destroyed; assertion messages name the case."""

from __future__ import annotations

import copy
import math

import torch
import torch.distributed as dist

from muon_ext import reference

from support.megatron_cpu import megatron_on_cpu
from support.megatron_model import forward_backward, init_parallel, tiny_gpt


# "distributed" TP against TP=1, max |master difference| after 3 steps at lr 1e-2 (spectral scale ~8): FP32
# rounding of other partitions, amplified by Polar-Express' first coefficients on the small singular values of
# real (low-rank) grads. Measured 7.4e-7 (MHA) and 2.2e-5 (GQA model).
DISTRIBUTED_ATOL = 1e-4


def run_all(rank: int, world: int, cases, *args) -> None:
    with megatron_on_cpu():
        for case, case_args in cases:
            case(*case_args, *args)
            from megatron.core import parallel_state
            parallel_state.destroy_model_parallel()


def optimizer_config(**overrides):
    from megatron.core.optimizer import OptimizerConfig

    settings = dict(optimizer="adam", lr=1e-2, min_lr=1e-3, weight_decay=0.1, bf16=True, clip_grad=1.0,
                    muon_split_qkv=False, muon_tp_mode="blockwise", adam_beta2=0.95)
    settings.update(overrides)
    return OptimizerConfig(**settings)


def build(tp: int, model_kwargs=None, beta2=None, **overrides):
    """A tiny GPT at TP=`tp` and its muon_ext optimizer (`beta2`: NorMuon)."""
    from muon_ext.megatron import get_megatron_muon_optimizer

    init_parallel(tp)
    model = tiny_gpt(fp16=overrides.get("fp16", False), dtype=torch.float16 if overrides.get("fp16") else
                     torch.bfloat16, **(model_kwargs or {}))
    return model, get_megatron_muon_optimizer(optimizer_config(**overrides), [model], beta2=beta2)


def train(model, opt, steps: int, first: int = 0):
    """(losses, grad norms) of `steps` Megatron-style steps on batches first, first + 1, ..."""
    losses, norms = [], []
    for s in range(first, first + steps):
        losses.append(forward_backward(model, s))
        ok, norm, zeros = opt.step()
        assert ok, f"step {s} was skipped"
        norms.append(norm)
    return losses, norms


def gathered_masters(model, opt) -> dict:
    """name -> the whole FP32 master (TP shards gathered over the TP group)."""
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    out = {}
    for name, p in model.named_parameters():
        master = opt.optimizer.get_full_parameter_master(opt.view_of(p)) if not _is_view(opt, p) else \
            opt.optimizer.gather_full_parameter_master(opt.view_of(p))
        if getattr(p, "tensor_model_parallel", False) and group.size() > 1 and not _is_view(opt, p):
            parts = [torch.empty_like(master) for _ in range(group.size())]
            dist.all_gather(parts, master.contiguous(), group=group)
            master = torch.cat(parts, dim=p.partition_dim)
        out[name] = master
    return out


def _is_view(opt, p) -> bool:
    """Whether the optimizer holds `p` as a DTensor view ("duplicated" mode)."""
    from torch.distributed.tensor import DTensor

    return isinstance(opt.view_of(p), DTensor)


def _gather_tp(p):
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    parts = [torch.empty_like(p.detach()) for _ in range(group.size())]
    dist.all_gather(parts, p.detach().contiguous(), group=group)
    return parts


def tp_slice(full: torch.Tensor, p) -> torch.Tensor:
    """This TP rank's part of the whole tensor `full` for the model param `p`."""
    from megatron.core import parallel_state

    if not getattr(p, "tensor_model_parallel", False):
        return full
    tp = parallel_state.get_tensor_model_parallel_world_size()
    return full.chunk(tp, dim=p.partition_dim)[parallel_state.get_tensor_model_parallel_rank()]


def replay(model, opt, grads) -> list:
    """Steps `opt` on recorded whole main grads (one dict name -> grad per step),
    each rank taking its TP part; returns the gathered masters after each step."""
    out = []
    for step_grads in grads:
        model.zero_grad_buffer()
        for n, p in model.named_parameters():
            p.main_grad.copy_(tp_slice(step_grads[n], p))
        ok, _, _ = opt.step()
        assert ok
        out.append(gathered_masters(model, opt))
    return out


def record_tp1(steps: int, model_kwargs=None, **overrides):
    """A real TP=1 run: the whole main grads before each step and the masters after it."""
    model, opt = build(1, model_kwargs, **overrides)
    grads, masters = [], []
    for s in range(steps):
        forward_backward(model, s)
        grads.append({n: p.main_grad.clone() for n, p in model.named_parameters()})
        assert opt.step()[0]
        masters.append(gathered_masters(model, opt))
    return grads, masters


def compare(got, want, what: str, atol: float, only=None) -> float:
    """Largest |difference| over the steps' masters (names filtered by `only`); asserts <= atol."""
    worst = 0.0
    for step, (g, w) in enumerate(zip(got, want)):
        for n in w:
            if only is not None and not only(n):
                continue
            err = (g[n] - w[n]).abs().max().item()
            worst = max(worst, err)
            assert err <= atol, f"{what}: step {step} {n}: max |difference| {err} > {atol}"
    return worst


def tp_modes_against_replayed_tp1() -> None:
    """TP=2 stepped on TP=1's (replayed) main grads: "duplicated" (DTensor
    views, whole-matrix orthogonalization) gives TP=1's masters and params bit
    for bit; "distributed" (Gram
    all_reduce, FP32) gives TP=1's masters to DISTRIBUTED_ATOL and every param outside the TP-split Muon matrices bit for bit;
    "blockwise" is a different update (each shard orthogonalized alone) and
    differs from TP=1 by far more. clip_grad=0 (a norm summed over shards
    rounds differently), FP32 Polar-Express on both sides."""
    settings = dict(clip_grad=0.0, muon_fp32_matmul_prec="highest")
    grads, want = record_tp1(3, **settings)
    model, opt = build(2, muon_tp_mode="distributed", **settings)
    split = {n for n, p in model.named_parameters()
             if opt._params[id(p)].kind == "muon" and opt._params[id(p)].partition_dim is not None}
    assert len(split) == 8, split
    got = replay(model, opt, grads)
    compare(got, want, "distributed, unsplit params", 0.0, only=lambda n: n not in split)
    worst = compare(got, want, "distributed, TP-split Muon", DISTRIBUTED_ATOL, only=lambda n: n in split)
    if dist.get_rank() == 0:
        print(f"MEGATRON distributed: max |master difference| to TP=1 {worst:.3g}", flush=True)
    model, opt = build(2, muon_tp_mode="duplicated", **settings)
    assert sum(_is_view(opt, p) for p in model.parameters()) == len(split)
    got = replay(model, opt, grads)
    compare(got, want, "duplicated", 0.0)  # bit for bit, every param
    for n, p in model.named_parameters():  # the BF16 params too: the remainder split of TP=1's masters
        whole = torch.cat(_gather_tp(p), dim=p.partition_dim) if getattr(p, "tensor_model_parallel", False) \
            else p.detach()
        assert torch.equal(whole, reference.split_master(want[-1][n])[0]), n
    model, opt = build(2, muon_tp_mode="blockwise", **settings)
    got = replay(model, opt, grads)
    compare(got, want, "blockwise, unsplit params", 0.0, only=lambda n: n not in split)
    worst = max((got[-1][n] - want[-1][n]).abs().max().item() for n in split)
    assert worst > 1e-3, f"blockwise equals TP=1 ({worst}): the test cannot tell the modes apart"


def blockwise_tp2_trains_like_tp1() -> None:
    """Real training under Megatron DDP: TP=2 "blockwise" and TP=1 losses agree
    to 2% over 4 steps (a different update, and Megatron's BF16 partial sums);
    grad norms come back as floats and match across TP sizes to 2%."""
    model, opt = build(1)
    losses1, norms1 = train(model, opt, 4)
    model, opt = build(2, muon_tp_mode="blockwise")
    losses2, norms2 = train(model, opt, 4)
    assert losses1[-1] < losses1[0], f"TP=1 did not train: {losses1}"
    for a, b in zip(losses1 + norms1, losses2 + norms2):
        assert isinstance(b, float) and abs(a - b) <= 0.02 * abs(a), (losses1, losses2, norms1, norms2)


def grad_norm_and_adamw_match_megatron_adam() -> None:
    """At TP=2, the first step's reported grad norm equals Megatron's own
    (Adam, get_megatron_optimizer) on the same grads to 1e-6, and the AdamW
    params (norms, biases, embeddings; Megatron's wd_mult groups) move as
    Megatron's Adam moves them (FP32 main params) to 1e-6 of their size."""
    from megatron.core.optimizer import get_megatron_optimizer

    model, opt = build(2)
    ref_model = tiny_gpt()
    ref_opt = get_megatron_optimizer(optimizer_config(), [ref_model])
    for o in (opt, ref_opt):  # as Megatron's loop does before the first step: lr and wd * wd_mult per group
        constant_scheduler(o).step(1)
    forward_backward(model, 0)
    forward_backward(ref_model, 0)
    for (n, p), (_, q) in zip(model.named_parameters(), ref_model.named_parameters()):
        assert torch.equal(p, q) and torch.equal(p.main_grad, q.main_grad), n
    ok, norm, _ = opt.step()
    ok_ref, ref_norm, _ = ref_opt.step()
    assert ok and ok_ref and abs(norm - ref_norm) <= 1e-6 * ref_norm, (norm, ref_norm)
    checked = 0
    for (n, p), (_, q) in zip(model.named_parameters(), ref_model.named_parameters()):
        if opt._params[id(p)].kind != "adamw":
            continue
        mine, theirs = opt.optimizer.get_full_parameter_master(p), q.main_param
        assert torch.allclose(mine, theirs, rtol=0, atol=1e-6 * max(1.0, theirs.abs().max().item())), n
        checked += 1
    assert checked >= 10, checked


def constant_scheduler(opt, lr=1e-2):
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    return OptimizerParamScheduler(opt, init_lr=lr, max_lr=lr, min_lr=lr, lr_warmup_steps=0, lr_decay_steps=10,
                                   lr_decay_style="constant", start_wd=0.1, end_wd=0.1, wd_incr_steps=10,
                                   wd_incr_style="constant")


def scheduler_drives_lr_and_decay() -> None:
    """Megatron's OptimizerParamScheduler writes lr / weight_decay into the
    adapter's (Megatron's) groups; the inner Muon groups take lr * update
    factor and weight_decay / factor at the next step."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    model, opt = build(1, muon_scale_mode="spectral", muon_extra_scale_factor=0.5)
    scheduler = OptimizerParamScheduler(opt, init_lr=0.0, max_lr=1e-2, min_lr=1e-3, lr_warmup_steps=2,
                                        lr_decay_steps=10, lr_decay_style="cosine", start_wd=0.1, end_wd=0.1,
                                        wd_incr_steps=10, wd_incr_style="constant")
    scheduler.step(1)
    train(model, opt, 1)
    for group in opt.optimizer.param_groups:
        outer = opt.param_groups[group["megatron_group"]]
        assert math.isclose(group["lr"], outer["lr"] * group["update_factor"], rel_tol=1e-12)
        assert math.isclose(group["weight_decay"], outer["weight_decay"] / group["update_factor"], rel_tol=1e-12)
        if group["kind"] == "muon":
            rows, cols = group["params"][0].shape
            assert math.isclose(group["update_factor"], 0.5 * max(rows, cols) ** 0.5)
    assert outer["lr"] == 5e-3, outer["lr"]


def fp16_skips_an_overflowing_step() -> None:
    """fp16 with Megatron's dynamic loss scaler: a step whose scaled grads
    overflow returns (False, None, None), writes nothing and halves the scale;
    the next step succeeds."""
    model, opt = build(1, fp16=True, bf16=False, initial_loss_scale=2.0 ** 10, hysteresis=1)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    masters = {n: opt.optimizer.get_full_parameter_master(p) for n, p in model.named_parameters()}
    forward_backward(model, 0, loss_scale=opt.get_loss_scale().item() * 1e35)  # inf grads
    assert opt.step() == (False, None, None)
    assert opt.get_loss_scale().item() == 2.0 ** 9
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]) and torch.equal(opt.optimizer.get_full_parameter_master(p), masters[n]), n
    forward_backward(model, 0, loss_scale=opt.get_loss_scale().item())
    ok, norm, _ = opt.step()
    assert ok and norm > 0
    assert any(not torch.equal(p, before[n]) for n, p in model.named_parameters())


def state_dict_resume_is_exact() -> None:
    """state_dict() after 2 steps, loaded into a fresh optimizer over a fresh
    model holding the same params, continues bit for bit (TP=2 duplicated views)."""
    model, opt = build(2, muon_tp_mode="blockwise")
    train(model, opt, 2)
    saved = copy.deepcopy(opt.state_dict())
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    train(model, opt, 1, first=2)
    expected = gathered_masters(model, opt)
    model2, opt2 = build(2, muon_tp_mode="blockwise")
    with torch.no_grad():
        for n, p in model2.named_parameters():
            p.copy_(params[n])
    opt2.load_state_dict(saved)
    forward_backward(model2, 2)
    opt2.step()
    got = gathered_masters(model2, opt2)
    for n in expected:
        assert torch.equal(got[n], expected[n]), n


def qkv_split_against_hand_split_and_tp1() -> None:
    """muon_split_qkv with grouped-query attention (4 heads, 2 query groups:
    per group 16 q rows, 8 k, 8 v): at TP=1 the first step of linear_qkv
    equals muon_ext.reference.muon_step run on the hand-gathered Q, K and V
    matrices (each with its own spectral scale) to 1e-6; at TP=2 (one query
    group per rank) "duplicated" gives TP=1's masters bit for bit and
    "distributed" to DISTRIBUTED_ATOL, on replayed grads."""
    from muon_ext import ops

    shape = dict(model_kwargs=dict(query_groups=2), clip_grad=0.0, muon_fp32_matmul_prec="highest",
                 muon_split_qkv=True)
    model, opt = build(1, **shape)
    before = {n: opt.optimizer.get_full_parameter_master(opt.view_of(p)) for n, p in model.named_parameters()}
    forward_backward(model, 0)
    grads = {n: p.main_grad.clone() for n, p in model.named_parameters()}
    assert opt.step()[0]
    config = opt.config
    lr, wd = opt.param_groups[0]["lr"], None
    checked = 0
    for n, p in model.named_parameters():
        if "linear_qkv.weight" not in n:
            continue
        wd = next(g["weight_decay"] for g in opt.param_groups if any(q is p for q in g["params"]))
        got = opt.optimizer.get_full_parameter_master(opt.view_of(p))
        rows = torch.arange(64).view(2, 32)
        for part in (rows[:, :16], rows[:, 16:24], rows[:, 24:]):
            index = part.reshape(-1)
            master = before[n][index].clone()
            r, c = master.shape
            factor = max(r, c) ** 0.5  # spectral
            reference.muon_step([master], [grads[n][index]], [torch.zeros_like(master)], lr=lr * factor,
                                momentum=config.muon_momentum, nesterov=False, beta2=None,
                                weight_decay=wd / factor, ns_steps=5, ns_coefficients=ops.POLAR_EXPRESS_COEFFICIENTS,
                                lr_scale="none", polar_dtype="float32")
            err = (got[index] - master).abs().max().item()
            assert err <= 1e-6, f"{n} rows {index[:3].tolist()}...: {err}"
            checked += 1
    assert checked == 6, checked
    grads, want = record_tp1(3, **shape)
    for mode, atol in (("duplicated", 0.0), ("distributed", DISTRIBUTED_ATOL)):
        model, opt = build(2, muon_tp_mode=mode, **shape)
        got = replay(model, opt, grads)
        worst = compare(got, want, f"split QKV, {mode}", atol)
        if dist.get_rank() == 0:
            print(f"MEGATRON split QKV {mode}: max |master difference| to TP=1 {worst:.3g}", flush=True)


def qk_clip_matches_megatron_math_at_tp2() -> None:
    """muon_ext.megatron.clip_qk at TP=2 ("duplicated", BF16 + remainders) on
    given max logits (heads 4, 2 query groups; threshold 2) equals Megatron's
    own SelfAttention.clip_qk on a plain FP32 TP=1 model holding the same
    masters, bit for bit; the BF16 params are the remainder split of the
    clipped masters; every other master is unchanged."""
    from muon_ext.megatron import clip_qk

    logits = torch.tensor([5.0, 0.5, 3.0, 1.0])  # group 0: max 5 (clipped), group 1: max 3 (clipped)
    qk = dict(qk_clip=True, qk_clip_threshold=2.0, qk_clip_alpha=0.5)
    model, opt = build(2, model_kwargs=dict(query_groups=2, **qk), muon_split_qkv=False, muon_tp_mode="duplicated")
    train(model, opt, 1)
    before = gathered_masters(model, opt)
    from megatron.core import parallel_state
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    attentions = [m for m in model.modules() if hasattr(m, "linear_qkv") and hasattr(m, "core_attention")]
    assert len(attentions) == 2
    for attention in attentions:
        attention.core_attention.current_max_attn_logits = logits.chunk(2)[tp_rank].clone()
    largest = clip_qk([model], opt)
    assert largest == logits.chunk(2)[tp_rank].max().item(), largest  # as Megatron: over DP only
    after = gathered_masters(model, opt)
    for n, p in model.named_parameters():
        if "linear_qkv.weight" in n:
            assert not torch.equal(after[n], before[n]), n
            whole = torch.cat(_gather_tp(p), dim=0)
            assert torch.equal(whole, reference.split_master(after[n])[0]), n
        else:
            assert torch.equal(after[n], before[n]), n
    parallel_state.destroy_model_parallel()
    init_parallel(1)
    ref = tiny_gpt(dtype=torch.float32, ddp=False, query_groups=2, **qk)
    with torch.no_grad():
        for n, p in ref.named_parameters():
            p.copy_(before["module." + n])
    for attention in [m for m in ref.modules() if hasattr(m, "linear_qkv") and hasattr(m, "core_attention")]:
        attention.core_attention.current_max_attn_logits = logits.clone()
        attention.clip_qk()
    for n, p in ref.named_parameters():
        assert torch.equal(p.detach(), after["module." + n]), n


def qk_clip_scales_local_rows_without_tp_collectives() -> None:
    """clip_qk at TP=2 (BF16 + remainders; every tp_mode: DTensor views or plain local shards) where only some
    ranks' query groups exceed the threshold, next to negative and zero logits: every rank returns without a
    collective over the TP group (no gather, no update_param: each scales its local master rows), only groups
    above the threshold are scaled (eta = threshold / max logit; a group at or below it never changes, never
    grows). A refusal on one rank (NaN logits) raises on every rank before any layer is written, and keeps the
    logits for a retry."""
    for mode in ("duplicated", "distributed", "blockwise"):
        _qk_clip_on_local_rows(mode)
        from megatron.core import parallel_state
        parallel_state.destroy_model_parallel()


def _qk_clip_on_local_rows(mode: str) -> None:
    import pytest
    from megatron.core import parallel_state

    from muon_ext.megatron import clip_qk

    threshold, alpha = 10.0, 0.5
    model, opt = build(2, model_kwargs=dict(heads=4, query_groups=2, qk_clip=True, qk_clip_threshold=threshold,
                                            qk_clip_alpha=alpha), muon_tp_mode=mode)
    train(model, opt, 1)
    rank = parallel_state.get_tensor_model_parallel_rank()
    layers = [m for m in model.modules() if hasattr(m, "linear_qkv") and hasattr(m, "core_attention")]
    given = [[[50.0, 20.0], [1.0, 2.0]], [[-3.0, -1.0], [0.0, 30.0]]]  # [layer][TP rank]: one query group each
    local = [lambda m=m: opt.optimizer.get_local_master(opt.view_of(m.linear_qkv.weight)) for m in layers]
    before = [read() for read in local]

    def whole_matrix_call(*args, **kwargs):
        raise AssertionError("clip_qk gathered or updated a whole matrix over the TP group")

    inner = opt.optimizer
    inner.gather_full_parameter_master = inner.update_param = whole_matrix_call
    try:
        for layer, logits in zip(layers, given):
            layer.core_attention.current_max_attn_logits = torch.tensor(logits[rank])
        if rank == 1:
            layers[1].core_attention.current_max_attn_logits = torch.tensor([float("nan"), 1.0])
        with pytest.raises(Exception, match="NaN or inf" if rank == 1 else "refused on another rank"):
            clip_qk([model], opt)
        assert all(torch.equal(read(), b) for read, b in zip(local, before)), mode
        assert all(m.core_attention.current_max_attn_logits is not None for m in layers)
        layers[1].core_attention.current_max_attn_logits = torch.tensor(given[1][rank])
        largest = clip_qk([model], opt)
    finally:
        del inner.gather_full_parameter_master, inner.update_param
    assert largest == max(max(logits[rank]) for logits in given), largest
    kv = layers[0].config.kv_channels
    for k, (read, b) in enumerate(zip(local, before)):
        want, top = b.clone(), max(given[k][rank])
        if top > threshold:
            eta = threshold / torch.tensor([top])
            want[:2 * kv] *= eta ** alpha
            want[2 * kv:3 * kv] *= eta ** (1 - alpha)
        assert torch.equal(read(), want), (mode, k, rank)
        assert bool((read().abs() <= b.abs()).all())


def qk_clip_leaves_groups_at_or_below_the_threshold() -> None:
    """TP=1, alpha 1: a query group whose max logit is negative (eta = threshold / max would be negative, a
    "clip" multiplying its Q rows by -2) or zero is left as it is; the group above the threshold in the same
    layer is scaled, and every layer is written (before, alpha 0.5 raised after clipping the first layer)."""
    from muon_ext.megatron import clip_qk

    model, opt = build(1, model_kwargs=dict(query_groups=2, qk_clip=True, qk_clip_threshold=2.0, qk_clip_alpha=1.0),
                       muon_tp_mode="blockwise")
    train(model, opt, 1)
    layers = [m for m in model.modules() if hasattr(m, "linear_qkv") and hasattr(m, "core_attention")]
    weights = [opt.view_of(m.linear_qkv.weight) for m in layers]
    before = [opt.optimizer.get_local_master(w) for w in weights]
    layers[0].core_attention.current_max_attn_logits = torch.tensor([5.0, 0.5, 0.0, 0.0])  # group 1: max 0
    layers[1].core_attention.current_max_attn_logits = torch.tensor([5.0, -3.0, -1.0, -2.0])  # group 1: max -1
    clip_qk([model], opt)
    after = [opt.optimizer.get_local_master(w) for w in weights]
    per_group = after[0].shape[0] // 2
    for a, b in zip(after, before):
        assert not torch.equal(a[:per_group], b[:per_group])  # group 0 (max 5) clipped
        assert torch.equal(a[per_group:], b[per_group:])  # group 1 left as it is
        assert bool((a.abs() <= b.abs()).all())


def _save(model, opt, path: str) -> None:
    import os

    from megatron.core import dist_checkpointing

    os.makedirs(path, exist_ok=True)
    dist.barrier()
    model_sd = model.module.sharded_state_dict()
    dist_checkpointing.save({"model": model_sd, "optimizer": opt.sharded_state_dict(model_sd)}, path)


def _load(model, opt, path: str) -> None:
    from megatron.core import dist_checkpointing

    model_sd = model.module.sharded_state_dict()
    loaded = dist_checkpointing.load({"model": model_sd, "optimizer": opt.sharded_state_dict(model_sd, is_loading=True)},
                                     path)
    model.module.load_state_dict(loaded["model"])
    opt.load_state_dict(loaded["optimizer"])


def normuon_tp_modes_split_qkv_and_resume(path: str) -> None:
    """NorMuon (beta2=0.95) with muon_split_qkv (statistics per Q, K and V
    matrix) on replayed TP=1 grads: TP=2 "duplicated" gives TP=1's masters bit
    for bit, "distributed" (Gram all_reduces, statistics over the whole
    matrices) within DISTRIBUTED_ATOL; a dist_checkpointing save at TP=2
    ("distributed") resumed at TP=1 continues as TP=1 never stopping, within
    DISTRIBUTED_ATOL (exactly the saved state: the first two steps' error only)."""
    shape = dict(model_kwargs=dict(query_groups=2), clip_grad=0.0, muon_fp32_matmul_prec="highest",
                 muon_split_qkv=True, beta2=0.95)
    grads, want = record_tp1(4, **shape)
    model, opt = build(2, muon_tp_mode="duplicated", **shape)
    assert any("second_momentum_buffer" in s for s in opt.optimizer.state.values())
    compare(replay(model, opt, grads), want, "NorMuon split QKV, duplicated", 0.0)
    model, opt = build(2, muon_tp_mode="distributed", **shape)
    got = replay(model, opt, grads[:2])
    worst = compare(got, want[:2], "NorMuon split QKV, distributed", DISTRIBUTED_ATOL)
    where = f"{path}/normuon_tp2_to_tp1"
    _save(model, opt, where)
    resumed_model, resumed = build(1, muon_tp_mode="distributed", **shape)
    _load(resumed_model, resumed, where)
    stats = [s["second_momentum_buffer"] for s in resumed.optimizer.state.values() if "second_momentum_buffer" in s]
    muon_params = sum(mp.kind == "muon" for mp in resumed._params.values())
    assert len(stats) == muon_params > 0 and all(bool((t > 0).all()) for t in stats), \
        "NorMuon statistics were not restored"
    worst = max(worst, compare(replay(resumed_model, resumed, grads[2:]), want[2:],
                               "NorMuon resumed TP=2 -> TP=1", DISTRIBUTED_ATOL))
    if dist.get_rank() == 0:
        print(f"MEGATRON NorMuon split QKV distributed (and resumed at TP=1): max |master difference| to TP=1 "
              f"{worst:.3g}", flush=True)


def dist_checkpoint_across_tp(path: str) -> None:
    """dist_checkpointing (torch_dist) of model + optimizer ("duplicated"):
    saved at TP=2 after 2 steps and resumed at TP=1, and saved at TP=1 and
    resumed at TP=2, then 2 more steps on replayed grads: masters bit-equal to
    never stopping (TP=1's run)."""
    settings = dict(clip_grad=0.0, muon_tp_mode="duplicated", weight_decay=0.1)
    grads, want = record_tp1(4, **settings)
    for first, second in ((2, 1), (1, 2)):
        where = f"{path}/tp{first}_to_tp{second}"
        model, opt = build(first, **settings)
        replay(model, opt, grads[:2])
        _save(model, opt, where)
        model, opt = build(second, **settings)
        _load(model, opt, where)
        got = replay(model, opt, grads[2:])
        compare(got, want[2:], f"resumed TP={first} -> TP={second}", 0.0)


def layer_wise_owns_a_share_and_matches_replicated() -> None:
    """layer_wise_distributed_optimizer=True at DP=2 (TP=1, and TP=2 "blockwise" on 4 ranks): each rank keeps
    about half the optimizer state, and the params equal the replicated optimizer's bit for bit over 3 steps
    (NorMuon on); its state_dict() (the whole state, on every rank) loads into the replicated optimizer and
    both continue alike."""
    from megatron.core import parallel_state
    from muon_ext.distributed.ownership import state_bytes
    from muon_ext.megatron import get_megatron_muon_optimizer

    tp = 2 if dist.get_world_size() == 4 else 1
    settings = dict(muon_tp_mode="blockwise")
    init_parallel(tp)
    assert parallel_state.get_data_parallel_world_size() == 2
    ref_model = tiny_gpt()
    ref = get_megatron_muon_optimizer(optimizer_config(**settings), [ref_model], beta2=0.95)
    model = tiny_gpt()
    opt = get_megatron_muon_optimizer(optimizer_config(**settings), [model], beta2=0.95,
                                      layer_wise_distributed_optimizer=True)
    ref_losses, _ = train(ref_model, ref, 3)
    losses, _ = train(model, opt, 3)
    assert losses == ref_losses
    for (n, p), (_, q) in zip(model.named_parameters(), ref_model.named_parameters()):
        assert torch.equal(p, q), n
    mine, whole = state_bytes(opt.optimizer.state), state_bytes(ref.optimizer.state)
    totals = torch.tensor([float(mine)], dtype=torch.float64)
    dist.all_reduce(totals, group=parallel_state.get_data_parallel_group())
    assert float(totals) == whole and mine <= 0.75 * whole, (mine, whole)
    saved = copy.deepcopy(opt.state_dict())
    ref.load_state_dict(saved)
    train(ref_model, ref, 1, first=3)
    train(model, opt, 1, first=3)
    for (n, p), (_, q) in zip(model.named_parameters(), ref_model.named_parameters()):
        assert torch.equal(p, q), n
