"""Bodies of the spawned distributed tests (test_distributed*.py): each runs
on every rank of a gloo world and checks many things, so CI spawns few jobs."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from support.dist_helpers import assert_same_on_every_rank, bits
from muon_ext import MuonAdamW

# Muon matrices per exchange group: wide, tall, square, rows % W != 0, rows < W,
# a group of three (N % W != 0, N < W at W = 4), a group of one (N < W).
SHARDED_MUON = [(6, 10), (10, 6), (8, 8), (7, 5), (3, 9), (1, 6), (9, 4), (9, 4), (9, 4), (5, 7)]
SHARDED_ADAMW = [(5,), (3,), (7, 3)]
REPLICATED_MUON = [(6, 10), (10, 6), (4, 4), (4, 4), (4, 4)]
STEPS = 3


def dtensor(full, mesh, placements):
    """`full` as a DTensor with `placements` (any Replicate / Shard / _StridedShard), cut locally by DTensor's
    own rules: no communication, so one rank alone may call it (distribute_tensor with a source rank is a
    collective)."""
    return distribute_tensor(full.to(mesh.device_type).clone(), mesh, placements, src_data_rank=None)


def meshes(shape):
    """(mesh, sharded placements, replicated placements): 1-D FSDP-style, or 2-D HSDP (Replicate(), Shard(0))."""
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard")[-len(shape):])
    if len(shape) == 1:
        return mesh, [Shard(0)], [Replicate()]
    return mesh, [Replicate(), Shard(0)], [Replicate(), Replicate()]


def _groups(params):
    s_muon, s_flat, s_adamw, r_muon, r_adamw = params
    return [
        {"params": s_muon, "kind": "muon", "lr": 0.02},
        {"params": s_flat, "kind": "muon", "lr": 0.03, "matrix_view": "flatten", "beta2": None, "nesterov": False},
        {"params": s_adamw, "kind": "adamw", "lr": 0.01},
        {"params": r_muon, "kind": "muon", "lr": 0.02, "lr_scale": "match_rms_adamw"},
        {"params": r_adamw, "kind": "adamw", "lr": 0.01},
    ]


def _values(dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    shapes = [SHARDED_MUON, [(6, 2, 3)], SHARDED_ADAMW, REPLICATED_MUON, [(4,)]]
    return [[(0.1 * torch.randn(s, generator=gen)).to(dtype) for s in group] for group in shapes]


def sharded_matches_single_process(rank, world, mesh_shape, *_):
    """Sharded Muon (owner exchange), replicated Muon (all_gather) and AdamW on
    shards step like the single-process optimizer, bit for bit, in FP32 and
    BF16 + remainders; replicas stay bit-identical; state is DTensors on the
    param's mesh; get_full / gather_full_parameter_master."""
    mesh, shard, rep = meshes(mesh_shape)
    for dtype in (torch.float32, torch.bfloat16):
        values = _values(dtype, seed=0)
        ref_params = [[torch.nn.Parameter(v.clone()) for v in group] for group in values]
        placements = [shard, shard, shard, rep, rep]
        params = [[torch.nn.Parameter(dtensor(v.clone(), mesh, pl)) for v in group]
                  for group, pl in zip(values, placements)]
        ref = MuonAdamW(_groups(ref_params))
        opt = MuonAdamW(_groups(params))
        gen = torch.Generator().manual_seed(1)
        for step in range(STEPS):
            if step == 1:  # NorMuon switched on after construction: its state is created at first use
                ref.param_groups[1]["beta2"] = opt.param_groups[1]["beta2"] = 0.9
            for group_ref, group, pl in zip(ref_params, params, placements):
                for rp, p in zip(group_ref, group):
                    g = torch.randn(rp.shape, generator=gen).to(dtype)
                    rp.grad = g.clone()
                    p.grad = dtensor(g, mesh, pl)
            ref.step()
            opt.step()
        for group_ref, group in zip(ref_params, params):
            for rp, p in zip(group_ref, group):
                assert isinstance(p, DTensor)
                assert torch.equal(bits(p.full_tensor()), bits(rp)), f"param {tuple(p.shape)} {dtype}"
                for key, value in ref.state[rp].items():
                    mine = opt.state[p][key]
                    assert isinstance(mine, DTensor) and mine.device_mesh == mesh, key
                    if key == "master_param":
                        continue
                    assert torch.equal(bits(mine.full_tensor()), bits(value)), f"{key} of {tuple(p.shape)} {dtype}"
                full = opt.gather_full_parameter_master(p)
                assert type(full) is torch.Tensor and full.dtype == torch.float32
                assert torch.equal(bits(full), bits(ref.get_full_parameter_master(rp)))
                held = opt.get_full_parameter_master(p)
                if any(pl.is_shard() for pl in p.placements) and mesh_shape[-1] > 1:
                    assert held is None
                else:
                    assert torch.equal(bits(held), bits(full))
        for group in params[3:]:  # replicated: every rank holds the same bits
            for p in group:
                assert_same_on_every_rank(p.to_local(), f"replicated param {tuple(p.shape)}")
                for key, value in opt.state[p].items():
                    assert_same_on_every_rank(value.to_local(), f"replicated state {key}")
    muon_bytes = opt._distributed.bytes_sent if world > 1 else 0
    assert muon_bytes >= 0


# ---------------------------------------------------------------------------
# refusals: None grads on some ranks, a check failing on one rank
# ---------------------------------------------------------------------------


def _local_snapshot(opt):
    """Bits of every param's and state tensor's local part on this rank."""
    out = []
    for group in opt.param_groups:
        for p in group["params"]:
            out.append(bits(p.to_local() if isinstance(p, DTensor) else p).clone())
            for value in opt.state[p].values():
                out.append(bits(value.to_local() if isinstance(value, DTensor) else value).clone())
    return out


def _assert_unchanged(opt, before, what):
    after = _local_snapshot(opt)
    assert all(torch.equal(a, b) for a, b in zip(before, after)), f"{what}: state changed on rank {dist.get_rank()}"


def _raises_everywhere(opt, rank, expected_here, match_here, match_elsewhere, bad_rank):
    """opt.step() raises on every rank: `expected_here` matching `match_here` on `bad_rank` (None: every rank),
    RuntimeError "refused on another rank" elsewhere; nothing changes on any rank."""
    before = _local_snapshot(opt)
    try:
        opt.step()
    except Exception as exc:  # noqa: BLE001 - the type is checked below
        mine = bad_rank is None or rank == bad_rank
        want_type, want = (expected_here, match_here) if mine else (RuntimeError, match_elsewhere)
        assert isinstance(exc, want_type) and want in str(exc), f"rank {rank}: {type(exc).__name__}: {exc}"
    else:
        raise AssertionError(f"rank {rank}: step did not raise")
    _assert_unchanged(opt, before, "refused step")


def none_grads_and_refusals(rank, world, mesh_shape, *_):
    """A grad None on every rank skips the param; None on some ranks only,
    or a check failing on one rank (a DTensor grad's placements, the plain
    planner's lr check), raises on every rank before any rank writes, without hanging.
    A found_inf on one rank skips the DTensor params on every rank."""
    mesh, shard, rep = meshes(mesh_shape)
    gen = torch.Generator().manual_seed(3)
    w = torch.nn.Parameter(dtensor(torch.randn(6, 4, generator=gen), mesh, shard))
    b = torch.nn.Parameter(dtensor(torch.randn(5, generator=gen), mesh, shard))
    r = torch.nn.Parameter(dtensor(torch.randn(3, generator=gen), mesh, rep))
    plain = torch.nn.Parameter(torch.randn(2, 2, generator=gen))
    opt = MuonAdamW([{"params": [w], "kind": "muon"}, {"params": [b, r, plain], "kind": "adamw"}])

    def grads():
        for p, pl in ((w, shard), (b, shard), (r, rep)):
            p.grad = dtensor(torch.randn(p.shape, generator=gen), mesh, pl)
        plain.grad = torch.randn(2, 2, generator=gen)

    grads()
    opt.step()
    grads()
    w.grad = None  # on every rank: skipped, its state untouched
    w_before = [bits(w.to_local()).clone()] + [bits(v.to_local()).clone() for v in opt.state[w].values()]
    step_before = opt.state[b]["step"].to_local().clone()
    opt.step()
    assert torch.equal(bits(w.to_local()), w_before[0])
    assert all(torch.equal(bits(v.to_local()), old) for v, old in zip(opt.state[w].values(), w_before[1:]))
    assert float(opt.state[b]["step"].to_local()) == float(step_before) + 1

    if world > 1:
        grads()
        if rank == world - 1:
            b.grad = None
        _raises_everywhere(opt, rank, ValueError, f"has a grad on {world - 1} of {world} ranks", "", None)
    grads()
    if world > 1:  # a grad placed otherwise on one rank only (an SPMD bug): refused on every rank
        if rank == 0:
            w.grad = dtensor(torch.randn(6, 4, generator=gen), mesh, rep)
        _raises_everywhere(opt, rank, ValueError, "has different placements on different ranks", "", None)
        grads()
    grads()
    if rank == world - 1:  # the plain planner refuses on this rank only
        opt.param_groups[1]["lr"] = -1.0
    _raises_everywhere(opt, rank, ValueError, "lr", "refused on another rank", world - 1)
    opt.param_groups[1]["lr"] = 1e-3
    grads()
    opt.step()  # the optimizer still steps after the refusals

    # Two DTensor params whose local parts share bytes: refused on every rank.
    first = torch.nn.Parameter(dtensor(torch.randn(8, 4, generator=gen), mesh, shard))
    second = torch.nn.Parameter(DTensor.from_local(first.to_local(), mesh, shard, run_check=False,
                                                   shape=first.shape, stride=first.stride()))
    tied = MuonAdamW([{"params": [first, second], "kind": "adamw"}])
    for p in (first, second):
        p.grad = dtensor(torch.randn(8, 4, generator=gen), mesh, shard)
    _raises_everywhere(tied, rank, ValueError, "shares memory with", "refused on another rank", None)

    # GradScaler's found_inf set on one rank only: every rank skips its DTensor
    # params (an owner skipping alone would hand stale rows to the others).
    grads()
    before = [bits(t.to_local()).clone() for t in (w, b, r)]
    opt.grad_scale = torch.tensor(2.0)
    opt.found_inf = torch.tensor(1.0 if rank == 0 else 0.0)
    opt.step()
    del opt.grad_scale, opt.found_inf
    assert all(torch.equal(bits(t.to_local()), old) for t, old in zip((w, b, r), before)), "found_inf not agreed"


# ---------------------------------------------------------------------------
# update_param / get_full_parameter_master with DTensors
# ---------------------------------------------------------------------------


def update_param_with_dtensors(rank, world, mesh_shape, *_):
    """DTensor values must match the param's mesh, placements, global and
    local shape and be FP32; every refusal leaves every rank's state as it
    was; accepted values become the master on every rank, as in a single
    process. State dicts of plain params do not load into DTensor params
    (nor the reverse)."""
    mesh, shard, rep = meshes(mesh_shape)
    gen = torch.Generator().manual_seed(4)
    start = [0.1 * torch.randn(7, 5, generator=gen), 0.1 * torch.randn(4, generator=gen)]
    w = torch.nn.Parameter(dtensor(start[0].bfloat16(), mesh, shard))
    r = torch.nn.Parameter(dtensor(start[1], mesh, rep))
    opt = MuonAdamW([{"params": [w], "kind": "muon"}, {"params": [r], "kind": "adamw"}])
    ref_w, ref_r = torch.nn.Parameter(start[0].bfloat16()), torch.nn.Parameter(start[1].clone())
    ref = MuonAdamW([{"params": [ref_w], "kind": "muon"}, {"params": [ref_r], "kind": "adamw"}])
    new = torch.randn(7, 5, generator=gen)
    rows = [4, 3] if world == 2 else None

    cases = [
        (new, TypeError, "must be a DTensor too"),
        (dtensor(new, mesh, rep), ValueError, "placements"),
        (dtensor(torch.randn(8, 5), mesh, shard), ValueError, "shape (8, 5)"),
        (dtensor(new.double(), mesh, shard), TypeError, "float32"),
        (dtensor(new.bfloat16(), mesh, shard), TypeError, "float32"),
        (dtensor(torch.full((7, 5), float("nan")), mesh, shard), ValueError, "NaN or inf"),
    ]
    if len(mesh_shape) == 1 and world > 1:
        other = torch.distributed.device_mesh.DeviceMesh("cpu", list(reversed(range(world))))
        cases.append((dtensor(new, other, shard), ValueError, "mesh"))
    if rows is not None:  # same global shape, local rows against the chunk rule (3, 4 instead of 4, 3)
        local = new[:3] if rank == 0 else new[3:]
        cases.append((DTensor.from_local(local, mesh, shard, run_check=False, shape=(7, 5), stride=(5, 1)),
                      ValueError, "local shape"))
    for values, error, match in cases:
        before = _local_snapshot(opt)
        try:
            opt.update_param(w, values)
        except error as exc:
            assert match in str(exc), f"{match!r} not in {exc}"
        else:
            raise AssertionError(f"update_param accepted values expected to fail with {match!r}")
        _assert_unchanged(opt, before, f"update_param refused ({match})")
    if mesh_shape[-1] > 1:  # NaN in one shard only: its ranks refuse, the others too, nothing is written anywhere
        poisoned = new.clone()
        poisoned[0, 0] = float("nan")
        values = dtensor(poisoned, mesh, shard)
        mine_bad = bool(torch.isnan(values.to_local()).any())
        before = _local_snapshot(opt)
        try:
            opt.update_param(w, values)
        except (ValueError, RuntimeError) as exc:
            want = "NaN or inf" if mine_bad else "refused on another rank"
            assert want in str(exc), f"rank {rank}: {want!r} not in {exc}"
        else:
            raise AssertionError(f"rank {rank}: update_param wrote while another rank refused")
        _assert_unchanged(opt, before, "update_param refused on one rank")
    with_plain = torch.randn(4)
    try:
        opt.update_param(r, with_plain)
    except TypeError as exc:
        assert "must be a DTensor too" in str(exc)
    else:
        raise AssertionError("plain values for a replicated DTensor param were accepted")

    opt.update_param(w, dtensor(new, mesh, shard))
    opt.update_param(r, dtensor(new[0, :4].clone(), mesh, rep))
    ref.update_param(ref_w, new)
    ref.update_param(ref_r, new[0, :4].clone())
    for p, rp in ((w, ref_w), (r, ref_r)):
        assert torch.equal(bits(p.full_tensor()), bits(rp))
        assert torch.equal(bits(opt.gather_full_parameter_master(p)), bits(ref.get_full_parameter_master(rp)))
    assert torch.equal(bits(opt.gather_full_parameter_master(w)), bits(new))
    assert (opt.get_full_parameter_master(w) is None) == (mesh_shape[-1] > 1)
    held = opt.get_full_parameter_master(r)
    assert type(held) is torch.Tensor and torch.equal(bits(held), bits(new[0, :4]))
    held.add_(1.0)  # a fresh tensor: the master is not written through it
    assert torch.equal(bits(opt.get_full_parameter_master(r)), bits(new[0, :4]))
    # A plain state dict into DTensor params, or the reverse, is refused before anything is loaded.
    snaps = [_local_snapshot(opt), _local_snapshot(ref)]
    for target, saved in ((opt, ref.state_dict()), (ref, opt.state_dict())):
        try:
            target.load_state_dict(saved)
        except TypeError as exc:
            assert "like the param" in str(exc), exc
        else:
            raise AssertionError("a state dict of the other kind (plain / DTensor) was loaded")
    _assert_unchanged(opt, snaps[0], "plain state dict refused")
    _assert_unchanged(ref, snaps[1], "DTensor state dict refused")


def run_all(rank, world, cases, *args):
    """Runs several (case, mesh_shape) pairs in one spawned job, passing `args` on."""
    for case, mesh_shape in cases:
        case(rank, world, mesh_shape, *args)


# ---------------------------------------------------------------------------
# torch.distributed.checkpoint: save at one world size, resume at another
# ---------------------------------------------------------------------------

DCP_PARAMS = {"w_tall": ((7, 5), "muon", True), "w_wide": ((3, 9), "muon", True), "w_a": ((9, 4), "muon", True),
              "w_b": ((9, 4), "muon", True), "bias": ((5,), "adamw", True), "norm": ((3,), "adamw", False)}


def _dcp_model(mesh, shard, rep, seed):
    """(module, optimizer) over DCP_PARAMS as BF16 DTensors (sharded or replicated), values from `seed`."""
    gen = torch.Generator().manual_seed(seed)
    model = torch.nn.Module()
    for name, (shape, _, sharded) in DCP_PARAMS.items():
        value = (0.1 * torch.randn(shape, generator=gen)).bfloat16()
        model.register_parameter(name, torch.nn.Parameter(dtensor(value, mesh, shard if sharded else rep)))
    return model, MuonAdamW(_dcp_groups(dict(model.named_parameters())))


def _dcp_groups(params):
    return [{"params": [params[n] for n, (_, kind, _) in DCP_PARAMS.items() if kind == "muon"], "kind": "muon",
             "lr": 0.02},
            {"params": [params[n] for n, (_, kind, _) in DCP_PARAMS.items() if kind == "adamw"], "kind": "adamw",
             "lr": 0.01}]


def _dcp_steps(opt, params, first, last, make):
    for step in range(first, last):
        gen = torch.Generator().manual_seed(1000 + step)
        for name, (shape, _, _) in DCP_PARAMS.items():
            params[name].grad = make(name, torch.randn(shape, generator=gen).bfloat16())
        opt.step()


def dcp_save(rank, world, mesh_shape, checkpoints):
    """Two steps, then a DCP checkpoint of the model and the optimizer at checkpoints["fsdp"]."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    mesh, shard, rep = meshes(mesh_shape)
    model, opt = _dcp_model(mesh, shard, rep, seed=7)
    params = dict(model.named_parameters())
    place = lambda n, g: dtensor(g, mesh, shard if DCP_PARAMS[n][2] else rep)  # noqa: E731
    _dcp_steps(opt, params, 0, 2, place)
    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
             checkpoint_id=checkpoints["fsdp"])


def dcp_resume(rank, world, mesh_shape, checkpoints):
    """Loads the checkpoint into a fresh model and optimizer at this world
    size, steps twice, and equals four uninterrupted single-process steps, bit for bit."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)

    mesh, shard, rep = meshes(mesh_shape)
    model, opt = _dcp_model(mesh, shard, rep, seed=8)  # other values: the load must replace them
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(state, checkpoint_id=checkpoints["fsdp"])
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optim"])
    params = dict(model.named_parameters())
    place = lambda n, g: dtensor(g, mesh, shard if DCP_PARAMS[n][2] else rep)  # noqa: E731
    _dcp_steps(opt, params, 2, 4, place)

    gen = torch.Generator().manual_seed(7)
    ref_params = {name: torch.nn.Parameter((0.1 * torch.randn(shape, generator=gen)).bfloat16())
                  for name, (shape, _, _) in DCP_PARAMS.items()}
    ref = MuonAdamW(_dcp_groups(ref_params))
    _dcp_steps(ref, ref_params, 0, 4, lambda n, g: g)
    for name, rp in ref_params.items():
        p = params[name]
        assert torch.equal(bits(p.full_tensor()), bits(rp)), name
        assert torch.equal(bits(opt.gather_full_parameter_master(p)), bits(ref.get_full_parameter_master(rp))), name
        for key, value in ref.state[rp].items():
            if key != "master_param":
                assert torch.equal(bits(opt.state[p][key].full_tensor()), bits(value)), f"{name} {key}"


# ---------------------------------------------------------------------------
# a small transformer under FSDP2 (fully_shard)
# ---------------------------------------------------------------------------


class _Block(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm = torch.nn.LayerNorm(d)
        self.qkv = torch.nn.Linear(d, 3 * d, bias=False)
        self.proj = torch.nn.Linear(d, d, bias=False)
        self.up = torch.nn.Linear(d, 3 * d + 1)  # odd rows: uneven shards
        self.down = torch.nn.Linear(3 * d + 1, d)

    def forward(self, x):
        q, k, v = self.qkv(self.norm(x)).chunk(3, dim=-1)
        x = x + self.proj(torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


class TinyGPT(torch.nn.Module):
    def __init__(self, vocab=29, d=16, layers=2):
        super().__init__()
        self.wte = torch.nn.Embedding(vocab, d)
        self.blocks = torch.nn.ModuleList(_Block(d) for _ in range(layers))
        self.lm_head = torch.nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        x = self.wte(idx)
        for block in self.blocks:
            x = block(x)
        return torch.nn.functional.cross_entropy(self.lm_head(x).flatten(0, 1).float(), idx.roll(-1, 1).flatten())


def _train(model, steps, dtype):
    from muon_ext import param_groups

    opt = MuonAdamW(param_groups(model, lr=0.02, adamw_lr=0.01, weight_decay=0.1))
    gen = torch.Generator().manual_seed(5)
    for _ in range(steps):
        # Every rank trains on the same batch: FSDP's mean of W equal grads is
        # exact at W = 1, 2, 4, so the sharded run can match bit for bit.
        idx = torch.randint(0, 29, (2, 8), generator=gen)
        model(idx).backward()
        opt.step()
        opt.zero_grad()
    return opt


def fsdp2_matches_unsharded(rank, world, mesh_shape, *_, steps=3):
    """A small transformer under fully_shard (1-D mesh, or a 2-D mesh: HSDP)
    trains `steps` steps to the very params of the unsharded run, with FP32
    params and with BF16 params + remainders."""
    from torch.distributed.fsdp import fully_shard

    mesh = meshes(mesh_shape)[0]
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        ref = TinyGPT().to(dtype)
        model = TinyGPT().to(dtype)
        model.load_state_dict(ref.state_dict())
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        ref_opt = _train(ref, steps, dtype)
        opt = _train(model, steps, dtype)
        for (name, rp), (_, p) in zip(ref.named_parameters(), model.named_parameters()):
            assert isinstance(p, DTensor)
            assert torch.equal(bits(p.full_tensor()), bits(rp)), f"{name} {dtype}"
            assert torch.equal(bits(opt.gather_full_parameter_master(p)),
                               bits(ref_opt.get_full_parameter_master(rp))), f"{name} master {dtype}"


# ---------------------------------------------------------------------------
# NCCL on GPUs (test_distributed.py, marked gpu)
# ---------------------------------------------------------------------------


def cuda_sharded_matches_single_process(rank, world, mesh_shape, *_):
    """FSDP-style Shard(0) params on CUDA (NCCL): AdamW equals the single-GPU
    optimizer bit for bit; Muon to BF16 noise (on CUDA the owner's batch of
    matrices may make cuBLAS choose another kernel than the single-GPU batch)."""
    mesh = init_device_mesh("cuda", mesh_shape)
    gen = torch.Generator().manual_seed(0)
    shapes = [(96, 64), (64, 96), (33, 70), (33, 70), (33, 70), (5,), (9,)]
    values = [(0.1 * torch.randn(s, generator=gen)).cuda() for s in shapes]
    ref_params = [torch.nn.Parameter(v.clone()) for v in values]
    params = [torch.nn.Parameter(dtensor(v.clone(), mesh, [Shard(0)])) for v in values]
    groups = lambda ps: [{"params": ps[:5], "kind": "muon", "lr": 0.02},  # noqa: E731
                         {"params": ps[5:], "kind": "adamw", "lr": 0.01}]
    ref, opt = MuonAdamW(groups(ref_params)), MuonAdamW(groups(params))
    for _ in range(2):
        for rp, p in zip(ref_params, params):
            g = torch.randn(rp.shape, generator=gen).cuda()
            rp.grad, p.grad = g.clone(), dtensor(g, mesh, [Shard(0)])
        ref.step()
        opt.step()
    for value, rp, p in zip(values, ref_params, params):
        mine = p.full_tensor()
        if rp.dim() == 1:
            assert torch.equal(bits(mine), bits(rp)), f"AdamW {tuple(rp.shape)}"
        else:
            ref_update, update = rp.detach() - value, mine - value
            err = (update - ref_update).norm() / ref_update.norm()
            assert err < 0.05, f"Muon {tuple(rp.shape)}: relative update error {float(err):.3g}"
