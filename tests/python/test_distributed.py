"""Distributed MuonAdamW on gloo, in three spawned jobs (W = 2, 4, 1) that
each run many cases (tests/python/support/distributed_cases.py), so CI spawns few
processes. DTensor params with Shard(0) (FSDP2), (Replicate(), Shard(0))
(HSDP), Replicate() (DDP) and tensor-parallel layouts (tp_cases.py) step like the single-process optimizer, bit for
bit on the CPU; refusals are raised on every rank; DCP checkpoints move
between world sizes. Every job runs under a collective timeout and a join
deadline (dist_helpers.spawn), so a hang fails."""

import pytest

from support import distributed_cases as cases
from support import tp_cases
from support.dist_helpers import spawn

W2_CASES = [(cases.sharded_matches_single_process, (2,)), (cases.none_grads_and_refusals, (2,)),
            (cases.update_param_with_dtensors, (2,)), (cases.fsdp2_matches_unsharded, (2,)),
            (tp_cases.tp_matches_single_process, "tp"), (cases.dcp_save, (2,))]
W4_CASES = [(cases.sharded_matches_single_process, (4,)), (cases.sharded_matches_single_process, (2, 2)),
            (cases.none_grads_and_refusals, (2, 2)), (cases.update_param_with_dtensors, (2, 2)),
            (cases.fsdp2_matches_unsharded, (4,)), (cases.fsdp2_matches_unsharded, (2, 2)),
            (cases.dcp_resume, (4,)), (cases.dcp_resume, (2, 2))]
W1_CASES = [(cases.sharded_matches_single_process, (1,)), (cases.dcp_resume, (1,))]


@pytest.fixture(scope="module")
def w2_checkpoint(tmp_path_factory):
    """Runs the W=2 job (its last case saves a DCP checkpoint); returns the checkpoint's path."""
    tmp = tmp_path_factory.mktemp("dist")
    path = str(tmp / "ckpt")
    spawn(tmp, 2, cases.run_all, W2_CASES, path)
    return path


def test_world_2_fsdp_steps_refusals_update_param_and_dcp_save(w2_checkpoint):
    """Sharded / replicated Muon and AdamW == single process; None grads and
    one-rank refusals; update_param with DTensors; fully_shard transformer;
    TP=2 on a DeviceMesh.from_group mesh (Shard(1), Shard(0), _StridedShard,
    Partial and Replicate grads) == single process; then a DCP save (at step 2)
    for the resume tests."""
    assert w2_checkpoint


def test_world_4_hsdp_fsdp_and_dcp_resume(tmp_path, w2_checkpoint):
    """The same at W=4 on a 1-D mesh and a 2x2 HSDP mesh, and resuming the W=2 checkpoint on both."""
    spawn(tmp_path, 4, cases.run_all, W4_CASES, w2_checkpoint)


def test_world_1_steps_and_dcp_resume(tmp_path, w2_checkpoint):
    spawn(tmp_path, 1, cases.run_all, W1_CASES, w2_checkpoint)
