"""Bodies of the spawned expert-stack tests (test_distributed_expert_stacks.py):
Muon stacks of matrices (`matrix_view="batch"`, MoE experts `[E, out, in]`)
split on any tensor dim over 1-D and 2-D meshes step like the single-process
optimizer, bit for bit on the CPU. Each case runs many layouts in one job."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from support.dist_helpers import bits
from support.distributed_cases import dtensor
from muon_ext import MuonAdamW

# Stacks: tall (per-row statistics), wide (per-column statistics), three experts (uneven over 2 and 4 ranks,
# none on some ranks at W=4), one expert (none on every rank but one), 4-D (two leading dims).
STACKS = {"tall": (3, 6, 4), "wide": (3, 4, 6), "one": (1, 5, 5), "many": (4, 3, 3), "deep": (2, 2, 5, 3)}
# After the stacks, plain matrices on the whole mesh: their owner rotation must agree on every rank, whatever
# each rank's number of experts was.
MATRICES = {"rep": ((5, 3), "replicate"), "shard": ((7, 4), "shard")}
VECTORS = {"bias": (5,)}
STEPS = 3


def _mesh(shape):
    return init_device_mesh("cpu", shape, mesh_dim_names=tuple(f"d{i}" for i in range(len(shape))))


def _placements(name, mesh, stack_placements):
    if name in STACKS:
        return stack_placements
    if name in MATRICES and MATRICES[name][1] == "shard":
        return [Shard(0)] + [Replicate()] * (mesh.ndim - 1)
    return [Replicate()] * mesh.ndim


def _shapes():
    return {**STACKS, **{n: s for n, (s, _) in MATRICES.items()}, **VECTORS}


def _groups(params):
    return [{"params": [params[n] for n in ("tall", "wide", "one", "deep")], "kind": "muon", "lr": 0.02,
             "matrix_view": "batch"},
            {"params": [params["many"]], "kind": "muon", "lr": 0.03, "matrix_view": "batch", "beta2": None,
             "nesterov": False, "lr_scale": "match_rms_adamw"},
            {"params": [params[n] for n in MATRICES], "kind": "muon", "lr": 0.02},
            {"params": [params[n] for n in VECTORS], "kind": "adamw", "lr": 0.01}]


def _model(mesh, stack_placements, dtype, seed):
    """(plain params, DTensor params), the same values, as dicts by name."""
    gen = torch.Generator().manual_seed(seed)
    plain, placed = {}, {}
    for name, shape in _shapes().items():
        value = (0.1 * torch.randn(shape, generator=gen)).to(dtype)
        plain[name] = torch.nn.Parameter(value.clone())
        placed[name] = torch.nn.Parameter(dtensor(value, mesh, _placements(name, mesh, stack_placements)))
    return plain, placed


def _steps(ref, opt, plain, placed, mesh, stack_placements, dtype, first, last):
    for step in range(first, last):
        gen = torch.Generator().manual_seed(100 + step)
        for name, shape in _shapes().items():
            g = torch.randn(shape, generator=gen).to(dtype)
            if ref is not None:
                plain[name].grad = g.clone()
            if opt is not None:
                placed[name].grad = dtensor(g, mesh, _placements(name, mesh, stack_placements))
        if ref is not None:
            ref.step()
        if opt is not None:
            opt.step()


def _assert_matches(ref, opt, plain, placed, what):
    for name, rp in plain.items():
        p = placed[name]
        assert isinstance(p, DTensor)
        assert torch.equal(bits(p.full_tensor()), bits(rp)), f"{what}: param {name}"
        for key, value in ref.state[rp].items():
            mine = opt.state[p][key]
            assert isinstance(mine, DTensor) and mine.device_mesh == p.device_mesh, f"{what}: {name} {key}"
            if key != "master_param":
                assert torch.equal(bits(mine.full_tensor()), bits(value)), f"{what}: {name} {key}"
        full = opt.gather_full_parameter_master(p)
        assert torch.equal(bits(full), bits(ref.get_full_parameter_master(rp))), f"{what}: master of {name}"


def stacks_match_single_process(rank, world, layouts):
    """For each (mesh shape, stack placements): FP32 and BF16 + remainders
    stacks (NorMuon per expert, tall and wide, empty local stacks) step like one
    process, bit for bit; state is DTensors, NorMuon statistics keep the
    stack's leading splits; plain matrices after them still agree on their
    owners; get_full_parameter_master is None where the stack is split."""
    for mesh_shape, stack_placements in layouts:
        mesh = _mesh(mesh_shape)
        what = f"{mesh_shape} {stack_placements}"
        for dtype in (torch.float32, torch.bfloat16):
            plain, placed = _model(mesh, stack_placements, dtype, seed=0)
            ref, opt = MuonAdamW(_groups(plain)), MuonAdamW(_groups(placed))
            _steps(ref, opt, plain, placed, mesh, stack_placements, dtype, 0, STEPS)
            _assert_matches(ref, opt, plain, placed, f"{what} {dtype}")
        stat = opt.state[placed["tall"]]["second_momentum_buffer"]  # [E, rows, 1]: splits of dims 0, 1 kept
        for pl, stat_pl in zip(placed["tall"].placements, stat.placements):
            kept = pl if (isinstance(pl, (Shard, _StridedShard)) and pl.dim < 2) else Replicate()
            assert stat_pl == kept, f"{what}: statistics placed {stat.placements}"
        split = any(isinstance(pl, (Shard, _StridedShard)) and mesh.size(d) > 1
                    for d, pl in enumerate(stack_placements))
        held = opt.get_full_parameter_master(placed["tall"])
        assert (held is None) == split, what


def stacks_update_param_and_dcp(rank, world, save_layout, load_layout, checkpoint):
    """update_param on a split stack equals one process; a DCP checkpoint saved
    with the stacks placed by `save_layout` loads into stacks placed by
    `load_layout` (resharded) and the steps after it equal never stopping."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)

    dtype = torch.bfloat16
    mesh_shape, stack_placements = save_layout
    mesh = _mesh(mesh_shape)
    plain, placed = _model(mesh, stack_placements, dtype, seed=5)
    ref, opt = MuonAdamW(_groups(plain)), MuonAdamW(_groups(placed))
    _steps(ref, opt, plain, placed, mesh, stack_placements, dtype, 0, 2)
    new = torch.randn(STACKS["tall"], generator=torch.Generator().manual_seed(9))
    ref.update_param(plain["tall"], new)
    opt.update_param(placed["tall"], dtensor(new, mesh, stack_placements))
    _assert_matches(ref, opt, plain, placed, "update_param")
    model = torch.nn.Module()
    for name, p in placed.items():
        model.register_parameter(name, p)
    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
             checkpoint_id=checkpoint)
    dist.barrier()

    mesh_shape, stack_placements = load_layout
    mesh = _mesh(mesh_shape)
    _, loaded = _model(mesh, stack_placements, dtype, seed=6)  # other values: the load must replace them
    fresh = torch.nn.Module()
    for name, p in loaded.items():
        fresh.register_parameter(name, p)
    resumed = MuonAdamW(_groups(loaded))
    state = {"model": get_model_state_dict(fresh), "optim": get_optimizer_state_dict(fresh, resumed)}
    dcp.load(state, checkpoint_id=checkpoint)
    set_model_state_dict(fresh, state["model"])
    set_optimizer_state_dict(fresh, resumed, state["optim"])
    _steps(ref, resumed, plain, loaded, mesh, stack_placements, dtype, 2, 4)
    _assert_matches(ref, resumed, plain, loaded, f"resumed at {load_layout}")


def run(rank, world, cases):
    for case, args in cases:
        case(rank, world, *args)
