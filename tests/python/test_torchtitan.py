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


def test_muon_adamw_config_one_learning_rate_by_default():
    """docs/guide.md, "One learning rate": muon_adamw() with one lr (or none:
    torchtitan's 8e-4) gives it to both kinds, Muon scaled to AdamW's update
    RMS; both lrs give the two-lr form of before."""
    from muon_ext.torchtitan import muon_adamw

    def kwargs(config):
        return {c.optimizer_kwargs["kind"]: c.optimizer_kwargs for c in config.param_groups}

    for config, one in ((muon_adamw(), 8e-4), (muon_adamw(lr=3e-4), 3e-4), (muon_adamw(adamw_lr=1e-3), 1e-3)):
        groups = kwargs(config)
        assert (groups["muon"]["lr"], groups["adamw"]["lr"], groups["muon"]["lr_scale"]) == (one, one,
                                                                                               "match_rms_adamw")
        assert groups["muon"]["weight_decay"] == groups["adamw"]["weight_decay"] == 0.1
    groups = kwargs(muon_adamw(lr=0.02, adamw_lr=8e-4, muon_options={"polar_dtype": "float32"}))
    assert (groups["muon"]["lr"], groups["adamw"]["lr"], groups["muon"]["polar_dtype"]) == (0.02, 8e-4, "float32")
    assert "lr_scale" not in groups["muon"]
    assert kwargs(muon_adamw(lr=1e-3, muon_options={"lr_scale": "none"}))["muon"]["lr_scale"] == "none"
