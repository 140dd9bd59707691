"""Distributed MuonAdamW on gloo, in three spawned jobs (W = 2, 4, 1) that
each run many cases (tests/python/support/distributed_cases.py), so CI spawns few
processes. DTensor params with Shard(0) (FSDP2), (Replicate(), Shard(0))
(HSDP), Replicate() (DDP) and tensor-parallel layouts (support/tp_cases.py) step like the single-process optimizer, bit for
bit on the CPU; refusals are raised on every rank; DCP checkpoints move
between world sizes. Every job runs under a collective timeout and a join
deadline (dist_helpers.spawn), so a hang fails. On CUDA (marked gpu): the
same cases on NCCL, one GPU per rank (W=2 needs two GPUs)."""

import pytest
import torch

from support import distributed_cases as cases
from support import tp_cases
from support.dist_helpers import spawn

W2_CASES = [(cases.sharded_matches_single_process, (2,)), (cases.none_grads_and_refusals, (2,)),
            (cases.update_param_with_dtensors, (2,)), (cases.fsdp2_matches_unsharded, (2,)),
            (tp_cases.tp_matches_single_process, "tp"), (cases.dcp_save, (2,))]
W4_CASES = [(cases.sharded_matches_single_process, (4,)), (cases.sharded_matches_single_process, (2, 2)),
            (cases.none_grads_and_refusals, (2, 2)), (cases.update_param_with_dtensors, (2, 2)),
            (cases.fsdp2_matches_unsharded, (4,)), (cases.fsdp2_matches_unsharded, (2, 2)),
            (cases.dcp_resume, (4,)), (cases.dcp_resume, (2, 2)),
            (tp_cases.tp_matches_single_process, "fsdp_tp"), (tp_cases.tp_matches_single_process, "hsdp_tp"),
            (tp_cases.tp_matches_single_process, "hsdp_tp_122"), (tp_cases.tp_matches_single_process, "tp"),
            (tp_cases.tp_dcp_save, "fsdp_tp"), (tp_cases.tp_dcp_resume, "tp")]
W1_CASES = [(cases.sharded_matches_single_process, (1,)), (cases.dcp_resume, (1,)), (tp_cases.tp_dcp_resume, None)]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Where the jobs save DCP checkpoints: "fsdp" (saved at W=2), "tp" (saved at FSDP x TP 2x2)."""
    tmp = tmp_path_factory.mktemp("dist")
    return {"fsdp": str(tmp / "ckpt_fsdp"), "tp": str(tmp / "ckpt_tp")}


@pytest.fixture(scope="module")
def w2_job(tmp_path_factory, checkpoints):
    """Runs the W=2 job (its last case saves the "fsdp" checkpoint)."""
    spawn(tmp_path_factory.mktemp("w2"), 2, cases.run_all, W2_CASES, checkpoints)
    return checkpoints


@pytest.fixture(scope="module")
def w4_job(tmp_path_factory, w2_job):
    """Runs the W=4 job: it resumes the "fsdp" checkpoint and saves the "tp" one."""
    spawn(tmp_path_factory.mktemp("w4"), 4, cases.run_all, W4_CASES, w2_job, timeout_s=600.0)
    return w2_job


def test_world_2_fsdp_tp_steps_refusals_update_param_and_dcp_save(w2_job):
    """Sharded / replicated Muon and AdamW == single process; None grads and
    one-rank refusals; update_param with DTensors; fully_shard transformer;
    TP=2 on a DeviceMesh.from_group mesh (Shard(1), Shard(0), _StridedShard,
    Partial and Replicate grads) == single process; then a DCP save (at step 2)
    for the resume tests."""
    assert w2_job


def test_world_4_hsdp_fsdp_tp_and_dcp(w4_job):
    """The same at W=4 on a 1-D mesh and a 2x2 HSDP mesh, and resuming the W=2
    checkpoint on both; FSDP x TP 2x2, HSDP x TP (2, 1, 2) and (1, 2, 2), TP=2
    on from_group meshes of rank pairs (Megatron's layout) == single process;
    a DCP save at FSDP x TP 2x2 resumed at TP=2."""
    assert w4_job


def test_world_1_steps_and_dcp_resume(tmp_path, w4_job):
    """Steps at W=1; both checkpoints (saved at W=2 and at FSDP x TP 2x2) resumed in one process."""
    spawn(tmp_path, 1, cases.run_all, W1_CASES, w4_job)


@pytest.mark.gpu
@pytest.mark.parametrize("world", [1, 2])
def test_nccl_sharded_steps_match_single_gpu(tmp_path, world):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    spawn(tmp_path, world, cases.run_all, [(cases.cuda_sharded_matches_single_process, (world,))], backend="nccl",
          timeout_s=120)  # inside gpu_check.sh's 240 s test stage, so a hang fails this test, not the stage
