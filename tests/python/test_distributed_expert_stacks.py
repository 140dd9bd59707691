"""Expert stacks (Muon params [E, out, in] under matrix_view="batch", MoE
experts) as DTensors split on any dim, on gloo in two spawned jobs (W = 2, 4)
that each run many layouts (support/expert_stack_cases.py): a split of the
stack's leading dim (FSDP2 or expert parallelism, Shard(0), uneven, ranks with
no expert) keeps whole matrices on each rank, orthogonalized there; a split
of the rows or columns (expert TP, expert FSDP Shard(1)) goes through the
owner exchange expert by expert; 2-D meshes combine them (EP x FSDP, EP x TP,
HSDP). Everything is compared bit for bit with the single-process optimizer;
update_param, gather_full_parameter_master and DCP resharding between layouts
too. Each job runs under dist_helpers.spawn's collective timeout and deadline."""

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from support import expert_stack_cases as cases
from support.dist_helpers import spawn

W2_LAYOUTS = [((2,), [Shard(0)]), ((2,), [Shard(1)]), ((2,), [Shard(2)]), ((2,), [Replicate()]),
              ((1, 2), [Shard(1), Shard(0)])]
W4_LAYOUTS = [((4,), [Shard(0)]), ((2, 2), [Shard(0), Shard(0)]), ((2, 2), [Shard(0), Shard(1)]),
              ((2, 2), [Shard(0), Shard(2)]), ((2, 2), [Replicate(), Shard(0)]), ((2, 2), [Shard(0), Replicate()]),
              ((2, 2), [Shard(1), Shard(2)]), ((2, 2), [Replicate(), Shard(1)]),
              ((2, 2), [_StridedShard(1, split_factor=2), Shard(1)])]


def test_world_2_stacks_split_on_each_dim_and_dcp(tmp_path):
    """EP / FSDP Shard(0) (3 experts on 2 ranks, 1 expert: one rank empty), expert TP Shard(1) / Shard(2),
    replicated, a (1, 2) mesh == one process; update_param; DCP saved at Shard(0), resumed at Shard(1)."""
    spawn(tmp_path, 2, cases.run, [
        (cases.stacks_match_single_process, (W2_LAYOUTS,)),
        (cases.stacks_update_param_and_dcp, (((2,), [Shard(0)]), ((2,), [Shard(1)]), str(tmp_path / "ckpt")))])


def test_world_4_stacks_on_2d_meshes_and_dcp(tmp_path):
    """EP over 4 ranks (ranks without experts), EP x FSDP on dim 0 or 1, EP x TP, HSDP, EP x DP-replicate,
    TP x TP, interleaved (_StridedShard) rows == one process; DCP saved at EP x FSDP 2x2, resumed at TP=4."""
    spawn(tmp_path, 4, cases.run, [
        (cases.stacks_match_single_process, (W4_LAYOUTS,)),
        (cases.stacks_update_param_and_dcp, (((2, 2), [Shard(0), Shard(1)]), ((4,), [Shard(2)]),
                                             str(tmp_path / "ckpt")))], timeout_s=600.0)
