"""muon_ext.megatron with Megatron-Core's legacy GroupedMLP experts (all local experts in one 2-D
weight): each expert orthogonalized as its own matrix (megatron-core 0.16.1's own rule would take the
whole 2-D weight as one matrix, coupling the experts), at one process and at EP 2 / expert TP 2 on two
gloo processes, in "duplicated", "distributed" (stacks take the owner exchange) and "blockwise" modes, NorMuon (statistics per expert), and a dist_checkpointing save at expert TP 2 resumed at EP 2; synthetic grads
(support/megatron_grouped_cases.py).
TEGroupedMLP (one param per expert) needs TransformerEngine: skipped where it does not import."""

import importlib.util

import pytest

pytest.importorskip("megatron.core", reason="needs megatron-core: pip install '.[megatron]'")

from support import megatron_grouped_cases as cases  # noqa: E402
from support.dist_helpers import spawn  # noqa: E402


def test_grouped_mlp_experts_one_process(tmp_path):
    spawn(tmp_path, 1, cases.run_all, [(cases.grouped_experts_per_expert, (1, 1, 1, "duplicated")),
                                        (cases.grouped_experts_per_expert, (1, 1, 1, "duplicated", 0.95))],
          timeout_s=300)


def test_grouped_mlp_experts_under_ep_and_expert_tp(tmp_path):
    spawn(tmp_path, 2, cases.run_all, [
        (cases.grouped_experts_per_expert, (1, 1, 2, "duplicated")),
        (cases.grouped_experts_per_expert, (1, 2, 1, "duplicated")),
        (cases.grouped_experts_per_expert, (1, 2, 1, "blockwise")),
        (cases.grouped_experts_per_expert, (1, 2, 1, "distributed")),
        (cases.grouped_experts_per_expert, (1, 1, 2, "duplicated", 0.95)),
        (cases.grouped_experts_per_expert, (1, 2, 1, "duplicated", 0.95)),
        (cases.grouped_checkpoint_across_layouts, (str(tmp_path / "ckpt"),)),
    ], timeout_s=300)


@pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is None,
                    reason="TEGroupedMLP needs TransformerEngine, which does not import here")
def test_te_grouped_mlp_experts():  # pragma: no cover - needs TransformerEngine
    pytest.skip("TEGroupedMLP holds one param per expert (weight0..weightE-1): each is a plain Muon matrix; "
                "not run without TransformerEngine")
