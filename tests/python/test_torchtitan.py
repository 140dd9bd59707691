"""muon_ext.torchtitan against the real torchtitan 0.3.0: its llama3 debug
model (2 layers) on CPU with gloo, MuonAdamW selected from the config, at 1
process (against torchtitan's AdamW; resume from torchtitan's checkpoint
exact) and at 2 processes (FSDP 2, TP 2; TP masters equal to 1 process).
Two spawned jobs (tests/python/support/titan_cases.py), each under a
collective timeout and a join deadline."""

import pytest

pytest.importorskip("torchtitan", reason="needs torchtitan: pip install '.[titan]'")

from support import titan_cases  # noqa: E402
from support.dist_helpers import spawn  # noqa: E402


@pytest.fixture(scope="module")
def single_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("titan")
    spawn(folder, 1, titan_cases.single_process, str(folder), timeout_s=900.0)
    return folder


def test_one_process_muon_and_adamw_train_and_resume_exactly(single_run):
    import torch

    saved = torch.load(single_run / "single.pt")
    assert saved["muon"][-1] < saved["muon"][0] and saved["adamw"][-1] < saved["adamw"][0]


def test_fsdp2_and_tp2(single_run):
    spawn(single_run, 2, titan_cases.parallel, str(single_run), timeout_s=900.0)
