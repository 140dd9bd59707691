"""Bodies of the spawned distributed tests (test_distributed*.py): each runs
on every rank of a gloo world and checks many things, so CI spawns few jobs."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from dist_helpers import assert_same_on_every_rank, bits
from muon_ext import MuonAdamW

# Muon matrices per exchange group: wide, tall, square, rows % W != 0, rows < W,
# a group of three (N % W != 0, N < W at W = 4), a group of one (N < W).
SHARDED_MUON = [(6, 10), (10, 6), (8, 8), (7, 5), (3, 9), (1, 6), (9, 4), (9, 4), (9, 4), (5, 7)]
SHARDED_ADAMW = [(5,), (3,), (7, 3)]
REPLICATED_MUON = [(6, 10), (10, 6), (4, 4), (4, 4), (4, 4)]
STEPS = 3


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


def sharded_matches_single_process(rank, world, mesh_shape):
    """Sharded Muon (owner exchange), replicated Muon (all_gather) and AdamW on
    shards step like the single-process optimizer, bit for bit, in FP32 and
    BF16 + remainders; replicas stay bit-identical; state is DTensors on the
    param's mesh; get_full / gather_full_parameter_master."""
    mesh, shard, rep = meshes(mesh_shape)
    for dtype in (torch.float32, torch.bfloat16):
        values = _values(dtype, seed=0)
        ref_params = [[torch.nn.Parameter(v.clone()) for v in group] for group in values]
        placements = [shard, shard, shard, rep, rep]
        params = [[torch.nn.Parameter(distribute_tensor(v.clone(), mesh, pl)) for v in group]
                  for group, pl in zip(values, placements)]
        ref = MuonAdamW(_groups(ref_params))
        opt = MuonAdamW(_groups(params))
        gen = torch.Generator().manual_seed(1)
        for _ in range(STEPS):
            for group_ref, group, pl in zip(ref_params, params, placements):
                for rp, p in zip(group_ref, group):
                    g = torch.randn(rp.shape, generator=gen).to(dtype)
                    rp.grad = g.clone()
                    p.grad = distribute_tensor(g, mesh, pl)
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
