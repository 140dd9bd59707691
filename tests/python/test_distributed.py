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


def test_dcp_save_at_w2_resume_at_w4_and_w1(tmp_path):
    """torch.distributed.checkpoint with get/set_optimizer_state_dict: saved
    at W=2, resumed at W=4 (and 2x2 HSDP) and W=1, equal to never stopping."""
    path = str(tmp_path / "ckpt")
    spawn(tmp_path, 2, cases.run_all, [(cases.dcp_save, (2,))], path)
    spawn(tmp_path, 4, cases.run_all, [(cases.dcp_resume, (4,)), (cases.dcp_resume, (2, 2))], path)
    spawn(tmp_path, 1, cases.run_all, [(cases.dcp_resume, (1,))], path)
