"""Bodies of the spawned tensor-parallel tests (test_distributed.py): DTensor
params split by rows, columns, interleaved rows or several mesh dims at once
(TP alone, on a mesh from `DeviceMesh.from_group` as Megatron's TP group
gives; FSDP x TP; HSDP x TP) step like the single-process optimizer, bit for
bit on the CPU; grads placed otherwise than their params (Partial(sum),
Replicate() for a Shard(0) param) are redistributed first; update_param and
DCP resharding between FSDP x TP, TP alone and one process."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from support.distributed_cases import dtensor
from support.dist_helpers import assert_same_on_every_rank, bits
from muon_ext import MuonAdamW

STEPS = 3

# Muon matrices: (shape, layout name). Wide, tall, odd rows / cols (uneven shards), rows < TP, a group of
# three, a 3-D param under the flatten view split on dim 1 (interleaved columns).
TP_MUON = [((6, 10), "row"), ((10, 6), "col"), ((7, 5), "row"), ((9, 3), "col"), ((3, 9), "row"),
           ((9, 4), "row"), ((9, 4), "row"), ((9, 4), "row"), ((8, 6), "strided"), ((5, 7), "rep")]
TP_FLAT = [((6, 4, 3), "row"), ((6, 4, 3), "col")]
# AdamW: a norm weight (replicated on the TP dim: its grad arrives Partial), an embedding split by rows on the
# TP dim (its grad arrives Replicate on that dim), row- and column-split matrices.
TP_ADAMW = [((5,), "norm"), ((11, 4), "embed"), ((7, 3), "row"), ((4, 6), "col")]


def tp_mesh(kind: str):
    """(mesh, {layout name: placements}, the TP mesh dim) for `kind`:
    "tp": TP alone on a 1-D mesh made with DeviceMesh.from_group from TP groups of 2 ranks (the whole world
    at W = 2; [0, 1] and [2, 3] at W = 4, the other pair a data-parallel replica as in Megatron);
    "fsdp_tp": a 2x2 ("dp", "tp") mesh as torchtitan's FSDP x TP lays params out;
    "hsdp_tp": a 3-D ("replicate", "shard", "tp") mesh of shape (2, 1, 2) or (1, 2, 2)."""
    world = dist.get_world_size()
    if kind == "tp":
        pairs = [list(range(k, k + 2)) for k in range(0, world, 2)]
        groups = [dist.new_group(pair) for pair in pairs]  # every rank creates every group, in the same order
        mine = groups[dist.get_rank() // 2]
        mesh = DeviceMesh.from_group(mine, "cpu")
        return mesh, {"row": (Shard(1),), "col": (Shard(0),), "strided": (_StridedShard(0, split_factor=2),),
                      "rep": (Replicate(),), "norm": (Replicate(),), "embed": (Shard(0),)}, 0
    if kind == "fsdp_tp":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        return mesh, {"row": (Shard(0), Shard(1)), "col": (_StridedShard(0, split_factor=2), Shard(0)),
                      "strided": (Shard(0), _StridedShard(0, split_factor=2)), "rep": (Replicate(), Replicate()),
                      "norm": (Shard(0), Replicate()), "embed": (_StridedShard(0, split_factor=2), Shard(0))}, 1
    shape = {"hsdp_tp": (2, 1, 2), "hsdp_tp_122": (1, 2, 2)}[kind]
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard", "tp"))
    r = Replicate()
    return mesh, {"row": (r, Shard(0), Shard(1)), "col": (r, _StridedShard(0, split_factor=2), Shard(0)),
                  "strided": (r, Shard(0), Shard(0)), "rep": (r, r, r), "norm": (r, Shard(0), r),
                  "embed": (r, _StridedShard(0, split_factor=2), Shard(0))}, 2


def _tp_groups(params):
    muon, flat, adamw = params
    return [{"params": muon, "kind": "muon", "lr": 0.02},
            {"params": flat, "kind": "muon", "lr": 0.03, "matrix_view": "flatten", "beta2": None},
            {"params": adamw, "kind": "adamw", "lr": 0.01}]


def grad_as_trainers_give_it(g, mesh, placements, layout: str, tp_dim: int):
    """The full grad `g` placed as a trainer hands it over: a norm weight's
    grad Partial(sum) on the TP dim (TP rank 0 holds it all, the others zeros,
    so the sum is exact), an embedding's grad Replicate() on the TP dim, the
    others like their param."""
    if layout == "norm":
        local = dtensor(g, mesh, placements).to_local()
        if mesh.get_local_rank(tp_dim) != 0:
            local = torch.zeros_like(local)
        partial = tuple(Partial() if d == tp_dim else pl for d, pl in enumerate(placements))
        return DTensor.from_local(local, mesh, partial, run_check=False, shape=g.shape, stride=g.stride())
    if layout == "embed":
        return dtensor(g, mesh, tuple(Replicate() if d == tp_dim else pl for d, pl in enumerate(placements)))
    return dtensor(g, mesh, placements)


def tp_matches_single_process(rank, world, kind, *_):
    """Muon (owner exchange over the product of the split mesh dims) and
    AdamW (local) on TP / FSDP x TP / HSDP x TP params step like one process,
    bit for bit, in FP32 and BF16 + remainders, with NorMuon (row and column
    statistics) and NorMuon switched on mid-run; state and statistics are
    DTensors on the param's mesh; grads placed otherwise are redistributed;
    update_param and gather_full_parameter_master on split params."""
    mesh, layouts, tp_dim = tp_mesh(kind)
    specs = [TP_MUON, TP_FLAT, TP_ADAMW]
    for dtype in (torch.float32, torch.bfloat16):
        gen = torch.Generator().manual_seed(0)
        values = [[(0.1 * torch.randn(shape, generator=gen)).to(dtype) for shape, _ in group] for group in specs]
        ref_params = [[torch.nn.Parameter(v.clone()) for v in group] for group in values]
        params = [[torch.nn.Parameter(dtensor(v.clone(), mesh, layouts[name])) for v, (_, name) in zip(vs, group)]
                  for vs, group in zip(values, specs)]
        ref, opt = MuonAdamW(_tp_groups(ref_params)), MuonAdamW(_tp_groups(params))
        gen = torch.Generator().manual_seed(1)
        for step in range(STEPS):
            if step == 1:  # NorMuon switched on after construction: its state is created at first use
                ref.param_groups[1]["beta2"] = opt.param_groups[1]["beta2"] = 0.9
            for group_ref, group, spec in zip(ref_params, params, specs):
                for rp, p, (_, name) in zip(group_ref, group, spec):
                    g = torch.randn(rp.shape, generator=gen).to(dtype)
                    rp.grad = g.clone()
                    p.grad = grad_as_trainers_give_it(g, mesh, layouts[name], name, tp_dim)
            ref.step()
            opt.step()
            if step == 1:  # update_param on split params: every rank's block of the new values becomes its master
                for rp, p, (_, name) in zip(ref_params[0][:3], params[0][:3], specs[0][:3]):
                    new = torch.randn(rp.shape, generator=gen) * 0.1
                    ref.update_param(rp, new)
                    opt.update_param(p, dtensor(new, mesh, layouts[name]))
        _assert_equal(opt, ref, params, ref_params, mesh, f"{kind} {dtype}")
    assert opt._distributed.bytes_sent > 0 and opt._distributed.polar_flops > 0


def _assert_equal(opt, ref, params, ref_params, mesh, what):
    for group_ref, group in zip(ref_params, params):
        for rp, p in zip(group_ref, group):
            where = f"{what} {tuple(p.shape)} {tuple(p.placements)}"
            assert isinstance(p, DTensor)
            assert torch.equal(bits(p.full_tensor()), bits(rp)), f"param {where}"
            for key, value in ref.state[rp].items():
                mine = opt.state[p][key]
                assert isinstance(mine, DTensor) and mine.device_mesh == mesh, f"{key} {where}"
                if key != "master_param":
                    assert torch.equal(bits(mine.full_tensor()), bits(value)), f"{key} of {where}"
            full = opt.gather_full_parameter_master(p)
            assert torch.equal(bits(full), bits(ref.get_full_parameter_master(rp))), f"master of {where}"
            if not any(pl.is_shard() or isinstance(pl, _StridedShard) for pl in p.placements):
                assert_same_on_every_rank(p.to_local(), f"replicated {where}")


# ---------------------------------------------------------------------------
# torch.distributed.checkpoint: save at FSDP x TP 2x2, resume at TP=2 and at one process
# ---------------------------------------------------------------------------

# No interleaved ("strided") layout: DCP itself refuses to save a tensor whose local rows are not one chunk
# (torch 2.14: "overlapping chunks"); torchtitan's (_StridedShard(0), Shard(0)) rows are one chunk.
TP_DCP = {"wq": ((8, 6), "col", "muon"), "wo": ((6, 7), "row", "muon"), "w_odd": ((5, 9), "row", "muon"),
          "w_uneven": ((9, 4), "col", "muon"), "norm": ((6,), "norm", "adamw"),
          "embed": ((11, 6), "embed", "adamw")}


def _tp_dcp_model(kind, seed):
    """(module, optimizer, mesh, layouts, TP dim) over TP_DCP as BF16 DTensors placed for `kind` (a plain module
    for kind None: one process), values from `seed`."""
    mesh, layouts, tp_dim = tp_mesh(kind) if kind else (None, None, None)
    gen = torch.Generator().manual_seed(seed)
    model = torch.nn.Module()
    for name, (shape, layout, _) in TP_DCP.items():
        value = (0.1 * torch.randn(shape, generator=gen)).bfloat16()
        model.register_parameter(name, torch.nn.Parameter(dtensor(value, mesh, layouts[layout]) if mesh else value))
    params = dict(model.named_parameters())
    opt = MuonAdamW([{"params": [params[n] for n, spec in TP_DCP.items() if spec[2] == "muon"], "kind": "muon",
                      "lr": 0.02},
                     {"params": [params[n] for n, spec in TP_DCP.items() if spec[2] == "adamw"], "kind": "adamw",
                      "lr": 0.01}])
    return model, opt, mesh, layouts, tp_dim


def _tp_dcp_steps(model, opt, first, last, mesh, layouts, tp_dim):
    params = dict(model.named_parameters())
    for step in range(first, last):
        gen = torch.Generator().manual_seed(2000 + step)
        for name, (shape, layout, _) in TP_DCP.items():
            g = torch.randn(shape, generator=gen).bfloat16()
            params[name].grad = grad_as_trainers_give_it(g, mesh, layouts[layout], layout, tp_dim) if mesh else g
        opt.step()


def tp_dcp_save(rank, world, kind, checkpoints):
    """Two steps at FSDP x TP, then a DCP checkpoint of the model and the optimizer at checkpoints["tp"]."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    model, opt, mesh, layouts, tp_dim = _tp_dcp_model(kind, seed=7)
    _tp_dcp_steps(model, opt, 0, 2, mesh, layouts, tp_dim)
    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
             checkpoint_id=checkpoints["tp"])


def tp_dcp_resume(rank, world, kind, checkpoints):
    """Loads the FSDP x TP checkpoint into a fresh model and optimizer placed
    for `kind` (None: plain tensors in one process), steps twice, and equals
    four uninterrupted single-process steps, bit for bit."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)

    model, opt, mesh, layouts, tp_dim = _tp_dcp_model(kind, seed=8)  # other values: the load must replace them
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(state, checkpoint_id=checkpoints["tp"])
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optim"])
    _tp_dcp_steps(model, opt, 2, 4, mesh, layouts, tp_dim)

    ref_model, ref, _, _, _ = _tp_dcp_model(None, seed=7)
    _tp_dcp_steps(ref_model, ref, 0, 4, None, None, None)
    params = dict(model.named_parameters())
    for name, rp in ref_model.named_parameters():
        p = params[name]
        full = p.full_tensor() if isinstance(p, DTensor) else p
        assert torch.equal(bits(full), bits(rp)), f"{kind}: {name}"
        assert torch.equal(bits(opt.gather_full_parameter_master(p)), bits(ref.get_full_parameter_master(rp))), name
        for key, value in ref.state[rp].items():
            if key != "master_param":
                mine = opt.state[p][key]
                mine = mine.full_tensor() if isinstance(mine, DTensor) else mine
                assert torch.equal(bits(mine), bits(value)), f"{kind}: {name} {key}"
