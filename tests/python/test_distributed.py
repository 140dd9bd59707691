"""Distributed MuonAdamW on gloo (spawned processes): DTensor params with
Shard(0) (FSDP2), (Replicate(), Shard(0)) (HSDP) and Replicate() (DDP)
step like the single-process optimizer, bit for bit on the CPU."""

import pytest

import distributed_cases as cases
from dist_helpers import spawn


@pytest.mark.parametrize("mesh_shape", [(1,), (2,), (4,), (2, 2)], ids=["W1", "W2", "W4", "hsdp2x2"])
def test_sharded_and_replicated_steps_match_single_process(tmp_path, mesh_shape):
    world = 1
    for size in mesh_shape:
        world *= size
    spawn(tmp_path, world, cases.sharded_matches_single_process, mesh_shape)


@pytest.mark.parametrize("mesh_shape", [(2,), (2, 2)], ids=["W2", "hsdp2x2"])
def test_none_grads_refusals_and_update_param(tmp_path, mesh_shape):
    world = 1
    for size in mesh_shape:
        world *= size
    spawn(tmp_path, world, cases.run_all, [(cases.none_grads_and_refusals, mesh_shape),
                                           (cases.update_param_with_dtensors, mesh_shape)])
