"""muon_ext.torchtitan with torchtitan 0.3.0's MoE: its qwen3 MoE debug recipe
made small for a CPU (support/titan_cpu.qwen3_moe_config; the MoE forward,
torch._grouped_mm included, runs on the CPU), MuonAdamW selected from the
config: routed experts ([E, out, in] stacks, each expert its own matrix) and
shared experts in Muon groups, the router in AdamW, torchtitan's
load-balancing hook moving the expert biases. One process: trains, resumes
exactly from torchtitan's checkpoint. Two processes: FSDP 2 and EP 2 train;
four: EP 2 x expert FSDP 2;
on torchtitan's placements the optimizer equals one process given the same
(synthetic) grads, bit for bit. Three spawned jobs (support/titan_moe_cases.py)."""

import pytest

pytest.importorskip("torchtitan", reason="needs torchtitan: pip install '.[titan]'")

from support import titan_moe_cases  # noqa: E402
from support.dist_helpers import spawn  # noqa: E402


def _job(folder, world: int) -> None:
    """The one-process run (world 1: it saves the step-0 seed the others start from), or the parallel runs."""
    case = titan_moe_cases.single_process if world == 1 else titan_moe_cases.parallel
    spawn(folder, world, case, str(folder), timeout_s=900.0)


@pytest.fixture(scope="module")
def seeded(tmp_path_factory):
    folder = tmp_path_factory.mktemp("titan_moe")
    _job(folder, 1)
    return folder


def test_one_process_moe_trains_balances_and_resumes_exactly(seeded):
    assert (seeded / "muon" / "checkpoint" / "step-0").exists()


def test_fsdp2_and_ep2_moe(seeded):
    import torch

    _job(seeded, 2)
    placements = torch.load(seeded / "moe_placements_2.pt")
    assert set(placements) == {"fsdp2", "ep2"}
    assert all("Shard(dim=0)" in p for p in placements["ep2"]), placements


def test_ep2_x_fsdp2_moe(seeded):
    """4 processes: torchtitan's EP 2 x expert FSDP 2 (experts split by rows over efsdp)."""
    import torch

    _job(seeded, 4)
    placements = torch.load(seeded / "moe_placements_4.pt")
    assert all("Shard(dim=1)" in p for p in placements["ep2_fsdp2"]), placements
